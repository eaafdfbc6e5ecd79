"""The paged Triton kernel (kernels/triton_paged.py) against the float64 oracle, Triton's interpreter on the CPU and
compiled on CUDA. The test writes each row's logical cache into a vLLM FlashAttention-layout paged cache itself
(physical blocks shuffled, two rows sharing their prefix's blocks, garbage in unused blocks and past each row's
position) and hands the oracle the logical cache it started from, so the kernel's reads through the block table are
checked against a path that never reads one."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed (pip install triton)")

from float64_oracle import decisions_away_from_boundary, decode_step_float64

from alspec_eval.kernels import triton_decode
from alspec_eval.kernels.triton_paged import check_paged_inputs, speculative_flash_decode_paged

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # the interpreter on the CPU, compiled on a GPU
HQ, HKV, DIM, WINDOW, CAPACITY = 6, 2, 32, 16, 144  # grouped-query heads: 3 query heads per KV head
# rows: deep; sharing row 0's prefix blocks; context exactly 2S (trivial); 2S + 1 (the first non-trivial)
CUR_POS = [120, 80, 2 * WINDOW - 1, 2 * WINDOW]
TRIVIAL = [False, False, True, False]
SHARED = 48  # positions of row 0's prefix that row 1 shares, block for block
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 1.6e-2}  # relative, of the whole row
D_RTOL = {torch.float32: 5e-4, torch.bfloat16: 0.1}
MARGIN = {torch.float32: 1e-4, torch.bfloat16: 4e-2}  # |d - lambda n| / n a decision is sure by
# Triton's CPU interpreter computes tl.dot on bfloat16 wrongly: bfloat16 is checked on a GPU only
DTYPES = [torch.float32, *([torch.bfloat16] if DEVICE == "cuda" else [])]


def logical_cache(seed: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q (B, Hq, D) and each row's K, V by position (B, Hkv, CAPACITY, D), on the CPU in ``dtype``: row 1 repeats
    row 0's first SHARED positions, and every position past a row's query holds large finite garbage (it must never
    be attended)."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(len(CUR_POS), HQ, DIM, generator=g)
    k, v = (torch.randn(len(CUR_POS), HKV, CAPACITY, DIM, generator=g) for _ in range(2))
    k[1, :, :SHARED], v[1, :, :SHARED] = k[0, :, :SHARED], v[0, :, :SHARED]
    for b, p in enumerate(CUR_POS):
        k[b, :, p + 1:], v[b, :, p + 1:] = 300.0, -1e4
    return q.to(dtype), k.to(dtype), v.to(dtype)


def page(k: torch.Tensor, v: torch.Tensor, block: int, seed: int,
         layout: str = "combined") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The logical caches written into shuffled physical blocks of (num_blocks, block, Hkv, D) caches on DEVICE, and
    the rows' block table; blocks no row uses hold garbage. ``layout`` "combined": K and V are views of one
    (2, num_blocks, block, Hkv, D) cache (vLLM FlashAttention's); "strided": V is a transposed view of a padded
    (num_blocks, Hkv, block, D + 8) store, its block, slot and head strides all other than K's."""
    rows, per_row, shared = k.shape[0], CAPACITY // block, SHARED // block
    spare = 3
    count = rows * per_row - shared + spare
    order = torch.randperm(count, generator=torch.Generator().manual_seed(seed)).tolist()  # physical block ids
    table = torch.empty(rows, per_row, dtype=torch.int32)
    combined = torch.full((2, count, block, HKV, DIM), 1e3, dtype=k.dtype, device=DEVICE)
    k_cache = combined[0]
    v_cache = combined[1] if layout == "combined" else \
        torch.full((count, HKV, block, DIM + 8), -1e3, dtype=k.dtype, device=DEVICE)[..., :DIM].transpose(1, 2)
    for b in range(rows):
        for i in range(per_row):
            if b == 1 and i < shared:
                table[b, i] = table[0, i]  # row 0's physical block: the same keys
                continue
            table[b, i] = physical = order.pop()
            k_cache[physical] = k[b, :, i * block:(i + 1) * block].transpose(0, 1).to(DEVICE)
            v_cache[physical] = v[b, :, i * block:(i + 1) * block].transpose(0, 1).to(DEVICE)
    assert len(order) == spare and table.unique().numel() == count - spare
    return k_cache, v_cache, table.to(DEVICE)


def lambdas(ratio: list[float], margin: float) -> list[float]:
    """Per row, each beyond the margin: row 0 accepted, row 1 rejected, the trivial row 0 (accepted all the same),
    row 3 accepted."""
    assert ratio[1] > 3 * margin
    return [1.5 * ratio[0] + 2 * margin, ratio[1] / 1.5 - margin, 0.0, 1.5 * ratio[3] + 2 * margin]


def paged(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, table: torch.Tensor, align: int,
          lam: float | list[float]) -> triton_decode.SpecDecodeOutput:
    """The paged kernel's outputs, on the CPU."""
    out = speculative_flash_decode_paged(q.to(DEVICE), k_cache, v_cache, table, torch.tensor(CUR_POS, device=DEVICE),
                                         WINDOW, lam if isinstance(lam, float) else torch.tensor(lam, device=DEVICE),
                                         window_align=align, chunk_size=16)
    return type(out)(*(x.cpu() for x in out))


@pytest.mark.parametrize(("block", "align", "layout"),
                         [(16, 1, "combined"), (16, 32, "combined"), (32, 1, "combined"), (32, 32, "combined"),
                          (24, 32, "strided")])  # vLLM's block sizes, and one no power of two with V's own strides
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda dtype: str(dtype).removeprefix("torch."))
def test_paged_kernel_equals_the_float64_oracle(dtype: torch.dtype, block: int, align: int, layout: str) -> None:
    q, k, v = logical_cache(block + align, dtype)
    k_cache, v_cache, table = page(k, v, block, seed=block, layout=layout)
    differ = [a != b for a, b in zip(v_cache.stride()[:3], k_cache.stride()[:3])]
    assert differ == [layout == "strided"] * 3
    q64, k64, v64 = q.double(), k.double(), v.double()
    ratio = decode_step_float64(q64, k64, v64, CUR_POS, [0] * 4, WINDOW, align, 1.0)
    lam = lambdas((ratio["d"] / ratio["n"]).tolist(), MARGIN[dtype])
    want = decode_step_float64(q64, k64, v64, CUR_POS, [0] * 4, WINDOW, align, lam)
    out = paged(q, k_cache, v_cache, table, align, lam)
    for name in ("exact", "spec"):
        error = (getattr(out, name).double() - want[name]).flatten(1).norm(dim=1) / want[name].flatten(1).norm(dim=1)
        assert error.max() < TOLERANCE[dtype], (name, error)
    # bfloat16: A and A~ are each rounded before d is taken, which moves a small d by up to their rounding
    d_atol = 1e-6 if dtype == torch.float32 else TOLERANCE[dtype] * float(want["n"].max())
    torch.testing.assert_close(out.d.double(), want["d"], rtol=D_RTOL[dtype], atol=d_atol)
    torch.testing.assert_close(out.n.double(), want["n"], rtol=TOLERANCE[dtype], atol=0)
    assert out.trivial.tolist() == want["trivial"] == TRIVIAL
    assert torch.equal(out.spec[2], out.exact[2])  # trivial: A~ is A, bit for bit
    assert out.d[2] == 0 and decisions_away_from_boundary(want["d"], want["n"], lam, MARGIN[dtype]) == [0, 1, 3]
    assert out.accept.tolist() == want["accept"] == [True, False, True, True]
    assert not triton_decode._scratch.tickets[k_cache.device].any()  # back at zero for the next call (cuda:0, not cuda)


def gathered(cache: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """A paged cache as the contiguous kernel takes it, (B, Hkv, max_blocks * block, D): each row's blocks in table
    order, whole (garbage past each row's position included)."""
    return cache[table.long()].flatten(1, 2).transpose(1, 2).contiguous()


@pytest.mark.parametrize("align", [1, 32])
def test_paged_kernel_equals_the_contiguous_kernel_on_the_gathered_cache(align: int) -> None:
    """The same program on the same keys, only read through the table: bit for bit in the interpreter (the same
    splits, blocks and order of operations); compiled, to float32 rounding."""
    q, k, v = logical_cache(3, torch.float32)
    k_cache, v_cache, table = page(k, v, 16, seed=3)
    out = paged(q, k_cache, v_cache, table, align, 0.05)
    flat = triton_decode.speculative_flash_decode_triton(
        q.to(DEVICE), gathered(k_cache, table), gathered(v_cache, table), torch.tensor(CUR_POS, device=DEVICE),
        WINDOW, 0.05, chunk_size=16, window_align=align)
    for name, a, b in zip(out._fields, out, flat):
        if DEVICE == "cpu":
            assert torch.equal(a, b.cpu()), name
        else:
            torch.testing.assert_close(a, b.cpu(), rtol=1e-6, atol=1e-6, msg=name)


def test_a_wrong_block_in_the_table_changes_what_reads_it_and_nothing_else() -> None:
    """Row 0's table is read, for the middle and for the windows: one of its middle blocks replaced by another row's
    moves its A away from the oracle's, and leaves A~ and every other row the same bits (a row reads its own table
    row only); its first block swapped with a middle one moves A~ (the window holds other keys) but not A (the same
    keys, in another order)."""
    q, k, v = logical_cache(5, torch.float32)
    k_cache, v_cache, table = page(k, v, 16, seed=5)
    want = decode_step_float64(q.double(), k.double(), v.double(), CUR_POS, [0] * 4, WINDOW, 1, 0.05)

    def error(out: triton_decode.SpecDecodeOutput, name: str) -> float:
        return float((getattr(out, name)[0].double() - want[name][0]).norm() / want[name][0].norm())

    right = paged(q, k_cache, v_cache, table, 1, 0.05)
    assert error(right, "exact") < TOLERANCE[torch.float32] and error(right, "spec") < TOLERANCE[torch.float32]
    other = table.clone()
    other[0, 3] = table[3, 0]  # positions 48..63 of row 0: the middle, outside both of its windows
    moved = paged(q, k_cache, v_cache, other, 1, 0.05)
    assert error(moved, "exact") > 100 * TOLERANCE[torch.float32]
    assert torch.equal(moved.spec[0], right.spec[0])
    for field in ("exact", "spec", "d", "n", "accept"):
        assert torch.equal(getattr(moved, field)[1:], getattr(right, field)[1:]), field
    swapped = table.clone()
    swapped[0, [0, 3]] = table[0, [3, 0]]  # the first window's block and a middle one
    moved = paged(q, k_cache, v_cache, swapped, 1, 0.05)
    assert error(moved, "spec") > 100 * TOLERANCE[torch.float32] and error(moved, "exact") < TOLERANCE[torch.float32]


def test_shapes_the_kernel_cannot_read_are_refused() -> None:
    q, k_cache, table, cur_pos = torch.zeros(2, 6, 32), torch.zeros(4, 16, 2, 32), torch.zeros(2, 3, dtype=torch.int32), \
        torch.zeros(2, dtype=torch.long)
    check_paged_inputs(q, k_cache, k_cache, table, cur_pos, 8, 32)
    with pytest.raises(ValueError, match="int32"):
        check_paged_inputs(q, k_cache, k_cache, table.long(), cur_pos, 8, 1)
    with pytest.raises(ValueError, match="head_dim must be contiguous"):
        strided = torch.zeros(4, 16, 32, 2).transpose(2, 3)
        check_paged_inputs(q, strided, strided, table, cur_pos, 8, 1)
    with pytest.raises(ValueError, match="GQA"):
        check_paged_inputs(torch.zeros(2, 5, 32), k_cache, k_cache, table, cur_pos, 8, 1)
    with pytest.raises(ValueError, match="window_align"):
        check_paged_inputs(q, k_cache, k_cache, table, cur_pos, 8, 16)


def test_the_benchmark_answers_help_and_refuses_without_cuda(monkeypatch: pytest.MonkeyPatch,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    """benchmarks/bench_paged_kernel.py (scripts/gpu_check.sh runs it): --help before torch loads; without CUDA a
    clear message and exit status 1, nothing measured."""
    spec = importlib.util.spec_from_file_location("bench_paged_kernel",
                                                  Path(__file__).parents[2] / "benchmarks" / "bench_paged_kernel.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    with pytest.raises(SystemExit) as done:
        bench.main(["--help"])
    assert done.value.code == 0 and "--block-size" in capsys.readouterr().out
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert bench.main(["--rounds", "1"]) == 1
    assert "no CUDA device" in capsys.readouterr().err
