"""The paged Triton verifier (kernels/triton_verify.py) against a float64 oracle, in Triton's interpreter on the CPU
(compiled on CUDA). The test writes each request's keys into a paged cache itself: physical blocks shuffled, two
requests sharing their prefix's blocks, every unwritten slot and spare block holding large garbage, and the cache's
memory in one of vLLM's layouts (NHD and HND per layer, and a layer of a cross-layer allocation). The oracle attends
to the listed positions of the logical keys it started from, so the kernel's reads through the block table are
checked against a path that never reads one."""

from __future__ import annotations

import math

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed (pip install triton)")

from alspec_eval import semantics
from alspec_eval.kernels.triton_verify import check_verify_inputs, paged_approximation

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # the interpreter on the CPU, compiled on a GPU
DIM, WINDOW, BLOCK = 32, 8, 16
LENGTHS = [70, 2 * WINDOW, 2 * WINDOW + 1, 45]  # request 1: the trivial edge (pos + 1 = 2S); 2: the first measured
SHARED = 32  # positions of request 0 that request 3 shares, block for block
# memory order of the (blocks, heads, slots, 2D) per-layer view, with the layer axis L where a layout has one
ORDERS = {"HND": "BHNC", "NHD": "BNHC", "BLNHC": "BLNHC"}
TOLERANCE = {torch.float32: 2e-6, torch.float16: 2e-3}  # of the row's norm: float32, float16 rounding


def paged_cache(keys: list[torch.Tensor], values: list[torch.Tensor], order: str, dtype: torch.dtype,
                seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The requests' (L, Hkv, D) keys and values in shuffled physical blocks of a (blocks, Hkv, BLOCK, 2D) view whose
    memory runs in ``order`` (a letter per axis, L a second layer's, which holds garbage), and the block table."""
    heads = keys[0].shape[1]
    need = [-(-len(k) // BLOCK) for k in keys]
    shared = SHARED // BLOCK
    count = sum(need) - shared + 2
    sizes = {"B": count, "H": heads, "N": BLOCK, "C": 2 * DIM, "L": 2}
    memory = torch.full([sizes[a] for a in order], 7e3, dtype=dtype)
    if "L" in order:
        memory = memory.select(order.index("L"), 1)
        order = order.replace("L", "")
    view = memory.permute([order.index(a) for a in "BHNC"])
    physical = torch.randperm(count, generator=torch.Generator().manual_seed(seed)).tolist()
    table = torch.full((len(keys), max(need) + 1), physical[-1], dtype=torch.int32)  # padding: a garbage block
    for r, n in enumerate(need):
        for j in range(n):
            table[r, j] = table[0, j] if r == 3 and j < shared else physical.pop(0)
            span = slice(j * BLOCK, min((j + 1) * BLOCK, len(keys[r])))
            if r == 3 and j < shared:
                assert torch.equal(keys[3][span], keys[0][span])
                continue
            filled = span.stop - span.start
            view[table[r, j], :, :filled] = torch.cat([keys[r][span], values[r][span]], -1).transpose(0, 1).to(dtype)
    return view.to(DEVICE), table.to(DEVICE)


def logical(heads: int, kv_heads: int, seed: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    keys = [torch.randn(n, kv_heads, DIM, generator=g) for n in LENGTHS]
    values = [torch.randn(n, kv_heads, DIM, generator=g) for n in LENGTHS]
    keys[3][:SHARED], values[3][:SHARED] = keys[0][:SHARED], values[0][:SHARED]
    return keys, values


def rows_of(draft: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Positions of every request from WINDOW on, every fifth and each request's last (prefill rows, the trivial
    edge 2S - 1, the first measured 2S, decode rows alike): request, position, and the draft's ranges ("sink":
    semantics.window_ranges at align 32, "local": the last 2S keys)."""
    picked = [sorted({*range(WINDOW, n, 5), n - 1}) for n in LENGTHS]
    request = torch.cat([torch.full((len(p),), r) for r, p in enumerate(picked)])
    pos = torch.cat([torch.tensor(p) for p in picked])
    if draft == "sink":
        starts, ends = semantics.window_ranges(pos, WINDOW, 32)
    else:
        starts, ends = (pos - 2 * WINDOW + 1)[:, None], (pos + 1)[:, None]
    return request, pos, starts, ends


def oracle(query: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor], request: torch.Tensor,
           pos: torch.Tensor, starts: torch.Tensor, ends: torch.Tensor, scale: float) -> torch.Tensor:
    """float64: each row's query heads over the keys at positions in its ranges and in [0, pos]."""
    out = []
    for m in range(len(pos)):
        r, p = int(request[m]), int(pos[m])
        listed = sorted({i for s, e in zip(starts[m].tolist(), ends[m].tolist()) for i in range(s, e) if 0 <= i <= p})
        k, v = keys[r][listed].double(), values[r][listed].double()
        group = query.shape[1] // k.shape[1]
        heads = [torch.softmax(k[:, h // group] @ query[m, h].double() * scale, 0) @ v[:, h // group]
                 for h in range(query.shape[1])]
        out.append(torch.stack(heads))
    return torch.stack(out)


def run(query, cache, table, request, pos, starts, ends, scale, token=None):
    dim = cache.shape[-1] // 2
    token = torch.arange(len(pos)) if token is None else token
    return paged_approximation(query.to(DEVICE), cache[..., :dim], cache[..., dim:], table,
                               *(t.to(DEVICE) for t in (token, request, pos, starts, ends)), scale).cpu()


@pytest.mark.parametrize("order", list(ORDERS))
@pytest.mark.parametrize("draft", ["sink", "local"])
def test_the_verifier_equals_the_float64_oracle_in_every_layout(order: str, draft: str) -> None:
    """float32, GQA group 3: every row's A~ to float32 rounding, through NHD, HND and a cross-layer view."""
    keys, values = logical(6, 2, seed=1)
    cache, table = paged_cache(keys, values, ORDERS[order], torch.float32, seed=2)
    assert cache.is_contiguous() == (order == "HND")
    request, pos, starts, ends = rows_of(draft)
    query = torch.randn(len(pos), 6, DIM, generator=torch.Generator().manual_seed(3))
    scale = 1.5 / math.sqrt(DIM)
    got = run(query, cache, table, request, pos, starts, ends, scale)
    want = oracle(query, keys, values, request, pos, starts, ends, scale)
    error = (got.double() - want).flatten(1).norm(dim=1) / want.flatten(1).norm(dim=1)
    assert error.max() < TOLERANCE[torch.float32], error.max()


def test_keys_and_values_with_strides_of_their_own() -> None:
    """Keys from an NHD cache and values from an HND one (their head and slot strides differ): each is read with
    its own."""
    keys, values = logical(6, 2, seed=14)
    nhd, table = paged_cache(keys, values, "BNHC", torch.float32, seed=15)
    hnd = nhd.contiguous()  # the same blocks, HND memory
    assert nhd.stride()[1:3] != hnd.stride()[1:3] and nhd.stride()[1] != hnd.stride()[1]
    request, pos, starts, ends = rows_of("sink")
    query = torch.randn(len(pos), 6, DIM, generator=torch.Generator().manual_seed(16))
    got = paged_approximation(query.to(DEVICE), nhd[..., :DIM], hnd[..., DIM:], table,
                              *(t.to(DEVICE) for t in (torch.arange(len(pos)), request, pos, starts, ends)),
                              DIM ** -0.5).cpu()
    want = oracle(query, keys, values, request, pos, starts, ends, DIM ** -0.5)
    assert ((got.double() - want).flatten(1).norm(dim=1) / want.flatten(1).norm(dim=1)).max() < 2e-6


@pytest.mark.parametrize(("group", "dtype"), [(1, torch.float32), (2, torch.float32), (4, torch.float32),
                                               (8, torch.float32), (1, torch.float16), (8, torch.float16)],
                         ids=["1-float32", "2-float32", "4-float32", "8-float32", "1-float16", "8-float16"])
def test_every_group_and_dtype(group: int, dtype: torch.dtype) -> None:
    """GQA groups 1 to 8 (one and two KV heads), float32 and float16 (the interpreter's bfloat16 tl.dot is wrong:
    bfloat16 is compiled for the GPUs, tests/kernels/test_triton_compile.py), NHD: A~ to the dtype's rounding."""
    kv_heads = 2 if group < 8 else 1
    keys, values = logical(group * kv_heads, kv_heads, seed=group)
    keys, values = [k.to(dtype) for k in keys], [v.to(dtype) for v in values]
    cache, table = paged_cache(keys, values, "BNHC", dtype, seed=group + 1)
    request, pos, starts, ends = rows_of("sink")
    query = torch.randn(len(pos), group * kv_heads, DIM, generator=torch.Generator().manual_seed(5)).to(dtype)
    got = run(query, cache, table, request, pos, starts, ends, DIM ** -0.5)
    assert got.dtype == dtype
    want = oracle(query, keys, values, request, pos, starts, ends, DIM ** -0.5)
    error = (got.double() - want).flatten(1).norm(dim=1) / want.flatten(1).norm(dim=1)
    assert error.max() < TOLERANCE[dtype], error.max()


def test_rows_are_read_by_token_and_their_own_table_row() -> None:
    """Rows listed out of order, some tokens of the step not verified: row m reads query[token[m]] and its own
    request's blocks; a wrong block in request 0's table moves request 0's rows that read it and no other row."""
    keys, values = logical(6, 2, seed=7)
    cache, table = paged_cache(keys, values, "BNHC", torch.float32, seed=8)
    request, pos, starts, ends = rows_of("sink")
    order = torch.randperm(len(pos), generator=torch.Generator().manual_seed(9))[:20]
    query = torch.randn(len(pos) + 5, 6, DIM, generator=torch.Generator().manual_seed(10))
    token = order + 5
    args = (request[order], pos[order], starts[order], ends[order], DIM ** -0.5)
    got = run(query, cache, table, *args, token=token)
    want = oracle(query[token], keys, values, *args)
    assert ((got.double() - want).flatten(1).norm(dim=1) / want.flatten(1).norm(dim=1)).max() < 2e-6
    other = table.clone()
    other[0, 0] = table[1, 0]  # request 0's first window now reads request 1's keys
    moved = run(query, cache, other, *args, token=token)
    zero = request[order] == 0
    assert (moved[zero] - got[zero]).abs().amax(dim=(1, 2)).min() > 1e-3
    assert torch.equal(moved[~zero], got[~zero])


@pytest.mark.filterwarnings("ignore:invalid value encountered in divide")  # the empty rows' 0 / 0, in numpy
def test_ranges_past_the_context_are_cut_to_it() -> None:
    """A draft whose ranges run before position 0 and past the query reads [0, pos] only: the same bits as its
    ranges cut by hand; a row whose ranges hold no key of [0, pos] gives NaN (as semantics.attend does)."""
    keys, values = logical(6, 2, seed=11)
    cache, table = paged_cache(keys, values, "BNHC", torch.float32, seed=12)
    request, pos, starts, ends = rows_of("local")
    query = torch.randn(len(pos), 6, DIM, generator=torch.Generator().manual_seed(13))
    wild_starts, wild_ends = starts - 100_000, ends + 4096
    cut = run(query, cache, table, request, pos, wild_starts.clamp(min=0), torch.minimum(wild_ends, pos[:, None] + 1),
              DIM ** -0.5)
    assert torch.equal(run(query, cache, table, request, pos, wild_starts, wild_ends, DIM ** -0.5), cut)
    empty = run(query, cache, table, request, pos, pos[:, None] + 1, pos[:, None] + 9, DIM ** -0.5)
    assert empty.isnan().all()


def test_inputs_it_cannot_read_are_refused() -> None:
    query, cache, table = torch.zeros(4, 6, 32), torch.zeros(5, 2, 16, 32), torch.zeros(2, 3, dtype=torch.int32)
    check_verify_inputs(query, cache, cache, table)
    with pytest.raises(ValueError, match="Hq % Hkv"):
        check_verify_inputs(torch.zeros(4, 5, 32), cache, cache, table)
    with pytest.raises(ValueError, match="contiguous"):
        strided = torch.zeros(5, 2, 32, 16).transpose(2, 3)
        check_verify_inputs(query, strided, strided, table)
    with pytest.raises(ValueError, match="block_table"):
        check_verify_inputs(query, cache, cache, table[0])


def test_the_benchmark_answers_help_and_refuses_without_cuda(monkeypatch: pytest.MonkeyPatch,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    """benchmarks/bench_paged_verify.py (scripts/gpu_check.sh runs it): --help before torch loads, a bad layout
    named (exit 2), and without CUDA a clear message and exit status 1, nothing measured."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).parents[2] / "benchmarks" / "bench_paged_verify.py"
    spec = importlib.util.spec_from_file_location("bench_paged_verify", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    with pytest.raises(SystemExit) as done:
        bench.main(["--help"])
    assert done.value.code == 0 and "--layouts" in capsys.readouterr().out
    assert bench.main(["--layouts", "nhd,lbnhc"]) == 2 and "'lbnhc'" in capsys.readouterr().err
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert bench.main(["--rounds", "1"]) == 1
    assert "no CUDA device" in capsys.readouterr().err
