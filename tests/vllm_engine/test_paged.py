"""alspec_eval.vllm.paged against an independent float64 oracle written from the ALSpec definition alone.

The oracle never calls the code under test: it writes known keys/values into a paged cache with its own writers
(both layouts, shuffled and shared blocks, garbage in every unwritten slot), computes A and A~ per token in float64
from those keys, and decides accept/reject itself. Every comparison is tight enough that a window off by one, a
wrong GQA head map, a misread layout or a missing tensor-parallel reduction changes the result by orders of
magnitude more than the tolerance.
"""

from __future__ import annotations

import math
import weakref
from dataclasses import dataclass

import pytest
import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from alspec_eval.approximations import make_approximation
from alspec_eval.approximations.base import Approximation
from alspec_eval.approximations.quest import Quest
from alspec_eval.errors import ConfigError
from alspec_eval.stats import ACCEPTED, REJECTED, TRIVIAL
from alspec_eval.vllm import native, verifiers
from alspec_eval.vllm.native import NativeRows
from alspec_eval.vllm.paged import (CpuVecLayout, LayoutError, PlainLayout, Settings, StepRows, check_newest,
                                    layout_for, slots)
from alspec_eval.vllm.tiled import Tiles, tile_size
from alspec_eval.vllm.verifiers import VERIFIERS, Gathered, choose, verify_and_count, verify_layer

HKV, HQ = 2, 6  # GQA group of 3: query head h reads KV head h // 3
GEOMETRY = {"plain": (16, 8), "cpu-vec": (32, 16)}  # layout -> (block size N, head dim D)
LAYOUTS = {"plain": PlainLayout(), "cpu-vec": CpuVecLayout()}


# ---- writers: the two cache layouts, from their description ----
def write_plain(cache, b, o, k, v):
    """key (Hkv, D) at cache[b, h, o, :D], value at cache[b, h, o, D:]."""
    d = k.shape[-1]
    cache[b, :, o, :d], cache[b, :, o, d:] = k, v


def write_cpu_vec(cache, b, o, k, v):
    """Per (b, h), 2*N*D flat elements: the N keys as a (D, N) row-major matrix, then the N values as (N, D)."""
    n, d = cache.shape[2], k.shape[-1]
    flat = cache.view(cache.shape[0], cache.shape[1], 2 * n * d)
    flat[b, :, torch.arange(d) * n + o] = k
    flat[b, :, n * d + o * d + torch.arange(d)] = v


WRITERS = {"plain": write_plain, "cpu-vec": write_cpu_vec}


def build_step(layout, S, seed=0, geometry=None):
    """A mixed step of five requests, written into a shuffled paged cache.

    r0 prefills its whole prompt with start S (tokens below S are not rows; S..2S-1 trivial, pos 2S-1 the edge);
    r1 decodes at pos+1 == 2S+1 (first measured) and r2 at pos+1 == 2S (last trivial); r3 decodes a longer context;
    r4 prefills a chunk of 5 whose start excludes its first 2 tokens. r3 shares r0's first blocks, and r2 r1's
    where they fill a block. Every unwritten slot and the block-table padding hold large garbage."""
    N, D = geometry or GEOMETRY[layout]
    g = torch.Generator().manual_seed(seed)
    specs = [(2 * S + 40, 2 * S + 40, S), (2 * S + 1, 1, 0), (2 * S, 1, 0), (3 * S + 40, 1, 0), (3 * S + 20, 5, 3 * S + 17)]
    K = [torch.randn(L, HKV, D, generator=g) for L, _, _ in specs]
    V = [torch.randn(L, HKV, D, generator=g) for L, _, _ in specs]
    nblk = [-(-L // N) for L, _, _ in specs]
    share = {b: (a, (min(specs[a][0], specs[b][0]) - 1) // N) for a, b in [(0, 3), (1, 2)]}  # prefix sharing
    for b, (a, n) in share.items():  # b's first n blocks are a's: same keys and values there
        K[b][:n * N], V[b][:n * N] = K[a][:n * N], V[a][:n * N]
    assert share[3][1] > 0, "the geometry must share at least one block"
    used = sum(nblk) - sum(n for _, n in share.values())
    phys = torch.randperm(used + 1, generator=g).tolist()  # one spare block: the padding target
    garbage = phys.pop()
    table = torch.full((len(specs), max(nblk) + 1), garbage, dtype=torch.long)
    for r, n in enumerate(nblk):
        a, shared = share.get(r, (r, 0))
        for j in range(n):
            table[r, j] = table[a, j] if j < shared else phys.pop()
    cache = (8 * torch.randn(used + 1, HKV, N, 2 * D, generator=g)).contiguous()
    for r, (L, _, _) in enumerate(specs):
        for p in range(L):
            WRITERS[layout](cache, table[r, p // N], p % N, K[r][p], V[r][p])
    seq_lens = torch.tensor([L for L, _, _ in specs])
    qlens = torch.tensor([q for _, q, _ in specs])
    qsl = torch.cat([torch.zeros(1, dtype=torch.long), qlens.cumsum(0)])
    starts = torch.tensor([s for _, _, s in specs])
    tok = [(r, p) for r, (L, q, _) in enumerate(specs) for p in range(L - q, L)]  # (request, pos) per token
    query = torch.randn(len(tok), HQ, D, generator=g)
    scale = 1.5 / math.sqrt(D)
    A = torch.stack([attend64(query[t], K[r], V[r], range(p + 1), scale) for t, (r, p) in enumerate(tok)])
    return dict(N=N, D=D, K=K, V=V, cache=cache, table=table, seq_lens=seq_lens, qsl=qsl, starts=starts, tok=tok,
                query=query, scale=scale, A=A, output=A.float(), layout=LAYOUTS[layout], S=S)


# ---- the float64 oracle ----
def attend64(q, K, V, positions, scale):
    """softmax(q.k * scale) @ v for each query head (Hq, D) over the listed positions of K, V (L, Hkv, D)."""
    idx = torch.tensor(sorted(set(positions)), dtype=torch.long)
    k, v = K[idx].double(), V[idx].double()
    out = []
    for h in range(q.shape[0]):
        kv = h // (q.shape[0] // k.shape[1])
        w = torch.softmax((k[:, kv] @ q[h].double()) * scale, 0)
        out.append(w @ v[:, kv])
    return torch.stack(out)


def approx_positions(pos, S, align, approx, first_shift=0, last_shift=0):
    """Key positions of A~ (shifts exist only to prove the tests notice an off-by-one)."""
    if approx == "local":
        return range(pos - 2 * S + 1 + last_shift, pos + 1)
    end = pos + 1 if align == 1 else -(-(pos + 1) // 32) * 32
    last = [p for p in range(end - S + last_shift, end + last_shift) if 0 <= p <= pos]
    return list(range(S + first_shift)) + last


def oracle(step, approx, align, heads=slice(None), **shift):
    """Per token (in token order): (trivial, A~ (Hq, D) float64 or None, d, n) for the given query heads."""
    S, out = step["S"], []
    for t, (r, p) in enumerate(step["tok"]):
        if p + 1 <= 2 * S:
            out.append((True, None, math.nan, math.nan))
            continue
        At = attend64(step["query"][t], step["K"][r], step["V"][r], approx_positions(p, S, align, approx, **shift),
                      step["scale"])[heads]
        A = step["A"][t][heads]
        out.append((False, At, (At - A).norm().item(), A.norm().item()))
    return out


def row_index(step, rows):
    """Which tokens the code's rows are, after checking they are exactly the tokens at or past their start."""
    want = [t for t, (r, p) in enumerate(step["tok"]) if p >= step["starts"][r]]
    assert sorted(rows.token.tolist()) == want
    for t, r, p in zip(rows.token.tolist(), rows.request.tolist(), rows.pos.tolist()):
        assert (r, p) == step["tok"][t]
    return rows.token.tolist()


def split_lambda(ratios, gap=1e-3):
    """A threshold in the middle of the ratios, halfway across the widest gap there, so no row sits on a tie (the
    gap, relative, at least ``gap``: well past float32 rounding and the paths' 1e-5 agreement)."""
    r = sorted(ratios)
    i = max(range(len(r) // 4, 3 * len(r) // 4), key=lambda i: (r[i + 1] - r[i]) / r[i + 1])
    assert (r[i + 1] - r[i]) / r[i + 1] > gap, "ratios too close to split without a float32 tie"
    return (r[i] + r[i + 1]) / 2


def step_plan(step: dict, rows: StepRows, settings: Settings, verifier) -> verifiers.Plan:
    """The step's plan for ``verifier``, as its first layer builds it."""
    layer = verifiers.Layer(step["query"], step["output"], step["cache"], step["layout"], step["table"], step["N"],
                            step["scale"])
    return verifiers.plan(rows, settings, layer, verifier)


def run(step, approx, align, lam, layer=1, **kw):
    """verify_layer on a copy of the step's output with thresholds (nan, lam), for layer 1 by default."""
    out = step["output"].clone()
    rows = StepRows.build(step["qsl"], step["seq_lens"], step["starts"], 100 + torch.arange(len(step["starts"])),
                          seeds=kw.get("seeds"))
    assert torch.equal(rows.tag, 100 + rows.request)  # each token carries its own request's tag
    settings = Settings(thresholds=(math.nan, lam), window=step["S"], window_align=align,
                        approx=make_approximation(approx), first_kv_head=kw.get("first_kv_head", 0))
    way = kw.get("verifier")
    res = verify_layer(kw.get("query", step["query"]), kw.get("out", out), kw.get("cache", step["cache"]),
                       step["layout"], step["table"], step["N"], rows, settings, layer, step["scale"],
                       reduce=kw.get("reduce"), verifier=way and VERIFIERS[way]())
    return res, kw.get("out", out), rows


# ---- 1. layouts ----
@pytest.mark.parametrize("layout", ["plain", "cpu-vec"])
def test_gather_reads_back_what_was_written(layout):
    """Random (request, pos) through shuffled, shared blocks come back bit for bit, head h from head h."""
    step = build_step(layout, S=8)
    g = torch.Generator().manual_seed(1)
    req = torch.randint(0, 5, (40,), generator=g)
    pos = (torch.rand(40, generator=g) * step["seq_lens"][req]).long()
    block, offset = slots(step["table"], req, pos, step["N"])
    assert torch.equal(block.reshape(-1), step["table"][req, pos // step["N"]])
    assert torch.equal(offset.reshape(-1), pos % step["N"])
    shape = (10, HKV, 2)  # (M, Hkv, n): every head reads its own positions, from its own head
    keys, values = step["layout"].gather(step["cache"], block.reshape(shape), offset.reshape(shape))
    r_, p_ = req.view(shape), pos.view(shape)
    for m, h, j in torch.cartesian_prod(*(torch.arange(x) for x in shape)).tolist():
        assert torch.equal(keys[m, h, j], step["K"][r_[m, h, j]][p_[m, h, j], h])
        assert torch.equal(values[m, h, j], step["V"][r_[m, h, j]][p_[m, h, j], h])


@pytest.mark.parametrize("layout", ["plain", "cpu-vec"])
def test_check_newest_catches_the_other_layout(layout):
    """The newest keys read back match in the layout they were written in and raise when read in the other."""
    step = build_step(layout, S=8)
    rows = StepRows.build(step["qsl"], step["seq_lens"], step["starts"], torch.zeros(5, dtype=torch.long))
    token, request, pos = rows.newest(step["qsl"], step["seq_lens"])
    assert token.tolist() == (step["qsl"][1:] - 1).tolist() and pos.tolist() == (step["seq_lens"] - 1).tolist()
    key = torch.stack([step["K"][r][p] for r, p in step["tok"]])
    args = (step["table"], step["N"], key, token, request, pos)
    check_newest(step["cache"], step["layout"], *args)
    other = LAYOUTS["cpu-vec" if layout == "plain" else "plain"]
    with pytest.raises(LayoutError):
        check_newest(step["cache"], other, *args)


def test_layout_for():
    assert isinstance(layout_for("CPU_ATTN", "vec"), CpuVecLayout)
    assert isinstance(layout_for("FLASH_ATTN"), PlainLayout) and isinstance(layout_for("TRITON_ATTN"), PlainLayout)
    for backend, isa in [("CPU_ATTN", "amx"), ("FLASHINFER", None)]:
        with pytest.raises(LayoutError, match=backend) as err:
            layout_for(backend, isa)
        assert isinstance(err.value, ConfigError) and "\n" not in str(err.value)


# ---- 2. verify_layer against the oracle ----
CASES = [("sink", 8, 1), ("local", 8, 1), ("sink", 32, 1), ("local", 32, 1), ("sink", 32, 32)]


@pytest.mark.parametrize("layout", ["plain", "cpu-vec"])
@pytest.mark.parametrize("approx,S,align", CASES)
def test_verify_layer_matches_oracle(layout, approx, S, align):
    """Codes, ratios and outputs row by row, with lambda splitting the measured rows into accepted and rejected."""
    step = build_step(layout, S)
    want = oracle(step, approx, align)
    rows_tok = [t for t, (r, p) in enumerate(step["tok"]) if p >= step["starts"][r]]
    lam = split_lambda([want[t][2] / want[t][3] for t in rows_tok if not want[t][0]])
    (codes, ratios), out, rows = run(step, approx, align, lam)
    tokens = row_index(step, rows)
    seen = set()
    for i, t in enumerate(tokens):
        trivial, At, d, n = want[t]
        r, p = step["tok"][t]
        assert trivial == (p + 1 <= 2 * S)
        if trivial:
            assert codes[i] == TRIVIAL and math.isnan(ratios[i])
            assert torch.equal(out[t], step["output"][t])
            continue
        assert ratios[i].item() == pytest.approx(d / n, rel=1e-5)
        if d <= lam * n:
            assert codes[i] == ACCEPTED
            torch.testing.assert_close(out[t].double(), At, rtol=0, atol=1e-5)
        else:
            assert codes[i] == REJECTED and torch.equal(out[t], step["output"][t])
        seen.add(int(codes[i]))
    assert seen == {ACCEPTED, REJECTED}
    assert {step["tok"][t][1] + 1 for t in tokens} >= {2 * S, 2 * S + 1}  # both sides of the trivial edge are rows
    for t in set(range(len(step["tok"]))) - set(tokens):  # below start: never touched
        assert torch.equal(out[t], step["output"][t])
    assert run(step, approx, align, lam, layer=0)[0] is None  # layer 0's threshold is NaN: off


# ---- 3. the special thresholds ----
@pytest.mark.parametrize("layout", ["plain", "cpu-vec"])
def test_a_weighted_draft_is_attended_with_its_weights(layout):
    """vAttention through the gathered path (its log-weights added to semantics.attend's scores): each row's d/n is
    that of the float64 softmax over the keys and weights the independent reference selects (vattention_oracle.py,
    its budget at the draft's 1/sqrt(D)), at the step's own scale; accepted rows commit that A~. Its draws are those
    of each request's seed, the layer and the model's KV heads (a rank whose first KV head is the model's third)."""
    import vattention_oracle
    from alspec_eval.approximations.vattention import VAttention

    step = build_step(layout, 8)
    args = {"sink": 2, "local": 4, "top": 4, "base_rate": 0.25, "epsilon": 0.5, "delta": 0.3}
    seeds, layer, first = torch.tensor([7, 2**32 - 5, 0, 123_456_789, 99]), 1, 3
    want, sampled = {}, False
    for t, (r, p) in enumerate(step["tok"]):
        if p + 1 <= 2 * step["S"] or p < step["starts"][r]:
            continue
        K, V = step["K"][r].transpose(0, 1), step["V"][r].transpose(0, 1)  # (Hkv, L, D)
        heads = vattention_oracle.reference(step["query"][t], K, V, p, **args, request=int(seeds[r]), layer=layer,
                                            head_offset=first).heads
        sampled |= any(0 < len(h.sample) < h.m for h in heads)  # weights other than 0
        out = []
        for h in range(HQ):
            kv = heads[h // (HQ // HKV)]
            keys = torch.tensor(kv.fixed + kv.sample)
            weight = torch.tensor([0.0] * len(kv.fixed) + [kv.log_weight] * len(kv.sample), dtype=torch.float64)
            scores = (K[h // (HQ // HKV), keys].double() @ step["query"][t, h].double()) * step["scale"] + weight
            out.append(scores.softmax(0) @ V[h // (HQ // HKV), keys].double())
        At, A = torch.stack(out), step["A"][t]
        want[t] = (At, (At - A).norm().item(), A.norm().item())
    assert sampled
    lam = split_lambda([d / n for _, d, n in want.values()])
    (codes, ratios), out, rows = run(step, VAttention(**args), 1, lam, layer, seeds=seeds, first_kv_head=first)
    for i, t in enumerate(row_index(step, rows)):
        if t not in want:
            continue
        At, d, n = want[t]
        assert ratios[i].item() == pytest.approx(d / n, rel=1e-5)
        if d <= lam * n:
            assert codes[i] == ACCEPTED
            torch.testing.assert_close(out[t].double(), At, rtol=0, atol=1e-5)
        else:
            assert codes[i] == REJECTED


@pytest.mark.parametrize("layout", ["plain", "cpu-vec"])
def test_special_thresholds(layout):
    step = build_step(layout, S=8)
    want = oracle(step, "sink", 1)
    for lam in (0.0, math.inf, -math.inf):
        (codes, ratios), out, rows = run(step, "sink", 1, lam)
        tokens = row_index(step, rows)
        for i, t in enumerate(tokens):
            trivial, At, d, n = want[t]
            if trivial:
                assert codes[i] == TRIVIAL and math.isnan(ratios[i])
            elif lam == 0.0:  # d > 0 for random keys: measured, rejected
                assert codes[i] == REJECTED and ratios[i].item() == pytest.approx(d / n, rel=1e-5)
            elif lam == math.inf:
                assert codes[i] == ACCEPTED
                assert math.isnan(ratios[i]) or ratios[i].item() == pytest.approx(d / n, rel=1e-5)
                torch.testing.assert_close(out[t].double(), At, rtol=0, atol=1e-5)
            else:  # REJECT: the exact layer, nothing computed
                assert codes[i] == REJECTED and math.isnan(ratios[i])
        if lam != math.inf:
            assert torch.equal(out, step["output"])
    assert run(step, "sink", 1, math.nan)[0] is None


# ---- 4. tensor parallel ----
def paths(layout: str) -> list[str]:
    """The paths a layout's cache is verified on: the CPU kernel reads the CPU layout only, the paged Triton
    verifier (in Triton's interpreter here) the plain layouts only."""
    return [p for p in VERIFIERS if p not in ("native", "listed", "triton")
            or getattr(LAYOUTS[layout], {"listed": "native"}.get(p, p))]


TENSOR_PARALLEL = [(layout, way) for layout in ("plain", "cpu-vec") for way in paths(layout)]


@pytest.mark.parametrize("layout,way", TENSOR_PARALLEL)
def test_tensor_parallel_sums_squares_across_ranks(layout, way):
    """Two ranks, one KV head each: summing [d^2; n^2] through reduce gives the full-head decision, and lambda is
    chosen where a rank deciding alone would decide otherwise, so an ignored or wrong reduction fails; on every
    verifier (the reduce is a step of their interface)."""
    step = build_step(layout, S=8)
    full = oracle(step, "sink", 1)
    halves = [oracle(step, "sink", 1, heads=slice(3 * h, 3 * h + 3)) for h in range(2)]
    rows_tok = [t for t, (r, p) in enumerate(step["tok"]) if p >= step["starts"][r] and not full[t][0]]
    ratio = {t: [full[t][2] / full[t][3]] + [hv[t][2] / hv[t][3] for hv in halves] for t in rows_tok}
    all_r = sorted(x for v in ratio.values() for x in v)
    best = None
    for lam in [(a + b) / 2 for a, b in zip(all_r, all_r[1:])]:
        margin = min(abs(x - lam) / lam for x in all_r)
        if any((v[0] <= lam) != (v[h] <= lam) for v in ratio.values() for h in (1, 2)) and margin > (best or (0,))[0]:
            best = (margin, lam)
    assert best and best[0] > 1e-4
    lam = best[1]
    (codes_full, _), out_full, rows = run(step, "sink", 1, lam, verifier=way)
    tokens = row_index(step, rows)
    sel = [i for i, t in enumerate(tokens) if not full[t][0]]
    ranks = [dict(query=step["query"][:, 3 * h:3 * h + 3].contiguous(),
                  cache=step["cache"][:, h:h + 1].contiguous()) for h in range(2)]
    partial = []
    for h in range(2):  # alone (reduce = identity): each rank's own decision and its [d^2; n^2]
        cap = []
        out = step["output"][:, 3 * h:3 * h + 3].clone()
        (codes, ratios), _, _ = run(step, "sink", 1, lam, out=out, reduce=lambda x: cap.append(x.clone()) or x,
                                    verifier=way, **ranks[h])
        assert len(cap) == 1 and cap[0].shape[0] == 2 and cap[0].dtype == torch.float32
        cols = sel if cap[0].shape[1] == len(tokens) else range(len(sel))
        got = cap[0][:, list(cols)].double()
        want = torch.tensor([[halves[h][tokens[i]][2] ** 2 for i in sel], [halves[h][tokens[i]][3] ** 2 for i in sel]],
                            dtype=torch.float64)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-10)
        for i in sel:
            assert (codes[i] == ACCEPTED) == (ratio[tokens[i]][h + 1] <= lam)
        partial.append(cap[0])
    assert any((codes_full[i] == ACCEPTED) != (ratio[tokens[i]][h + 1] <= lam) for i in sel for h in (0, 1))
    outs = []
    for h in range(2):  # together: reduce adds the other rank's partial sums
        out = step["output"][:, 3 * h:3 * h + 3].clone()
        (codes, ratios), _, _ = run(step, "sink", 1, lam, out=out, reduce=lambda x, h=h: x + partial[1 - h],
                                    verifier=way, **ranks[h])
        assert torch.equal(codes, codes_full)
        for i in sel:
            assert ratios[i].item() == pytest.approx(ratio[tokens[i]][0], rel=1e-5)
        outs.append(out)
    torch.testing.assert_close(torch.cat(outs, 1), out_full, rtol=0, atol=1e-6)


# ---- 5. the window's edges ----
@pytest.mark.parametrize("layout", ["plain", "cpu-vec"])
@pytest.mark.parametrize("approx,S,align", [("sink", 8, 1), ("local", 8, 1), ("sink", 32, 32)])
def test_window_off_by_one_is_caught(layout, approx, S, align):
    """Every accepted A~ matches the exact position set to 1e-5 and lies far (> 1e-3) from the A~ of every window
    shifted by one, so passing pins both edges of each window rather than approximately the right keys."""
    step = build_step(layout, S)
    want = oracle(step, approx, align)
    shifts = [dict(last_shift=1), dict(last_shift=-1)] + ([dict(first_shift=1), dict(first_shift=-1)]
                                                          if approx == "sink" else [])
    wrong = [oracle(step, approx, align, **s) for s in shifts]
    (codes, _), out, rows = run(step, approx, align, math.inf)
    for i, t in enumerate(row_index(step, rows)):
        if want[t][0]:
            continue
        got = out[t].double()
        torch.testing.assert_close(got, want[t][1], rtol=0, atol=1e-5)
        for w in wrong:
            assert (got - w[t][1]).abs().max() > 1e-3


# ---- 6. the streamed A~ (the CPU kernel, tiles) against the gathered reference ----
@pytest.mark.parametrize("layout", ["plain", "cpu-vec"])
@pytest.mark.parametrize("approx,S,align", CASES)
def test_streamed_decides_as_gathered(layout, approx, S, align):
    """The CPU kernel (one pass over the cache) and tiles of consecutive queries (a 40-token prefill in several
    tiles, a 3-token chunk, decode rows as tiles of one) give the gathered path's decisions, its d/n to float32
    rounding and its committed outputs."""
    step = build_step(layout, S)
    want = oracle(step, approx, align)
    rows_tok = [t for t, (r, p) in enumerate(step["tok"]) if p >= step["starts"][r]]
    lam = split_lambda([want[t][2] / want[t][3] for t in rows_tok if not want[t][0]])
    settings = Settings(thresholds=(lam,), window=S, window_align=align, approx=make_approximation(approx))
    assert choose(settings.approx, step["layout"], step["cache"]).name == ("native" if layout == "cpu-vec" else "tiles")
    got = {}
    for path in paths(layout):
        out = step["output"].clone()
        rows = StepRows.build(step["qsl"], step["seq_lens"], step["starts"], torch.arange(5))
        got[path] = verify_layer(step["query"], out, step["cache"], step["layout"], step["table"], step["N"],
                                 rows, settings, 0, step["scale"], verifier=VERIFIERS[path]()), out
        plan = step_plan(step, rows, settings, VERIFIERS[path]())
        assert type(plan.prepared) is {"tiles": Tiles, "native": NativeRows, "triton": NativeRows,
                                       "listed": tuple}.get(path, type(None))
    tiles = step_plan(step, rows, settings, VERIFIERS["tiles"]()).prepared
    assert {g.token.shape[1] for g in tiles.groups} == {1, tile_size(S)}
    (codes_ref, ratios_ref), out_ref = got.pop("gathered")
    for path, ((codes, ratios), out) in got.items():
        assert torch.equal(codes, codes_ref) and set(codes.tolist()) == {TRIVIAL, ACCEPTED, REJECTED}, path
        torch.testing.assert_close(ratios, ratios_ref, rtol=1e-5, atol=0, equal_nan=True)
        torch.testing.assert_close(out, out_ref, rtol=0, atol=1e-6)


@pytest.mark.parametrize("dim", [16, 24, 64, 128, 256])
def test_cpu_kernel_at_every_head_dim_decides_as_gathered(dim):
    """The kernel's channel loops: one register of channels, a head_dim not a multiple of one (channel by channel),
    four and eight registers, and past eight (channel by channel again), each against the gathered reference."""
    step = build_step("cpu-vec", 8, geometry=(16, dim))
    rows_tok = [t for t, (r, p) in enumerate(step["tok"]) if p >= step["starts"][r]]
    want = oracle(step, "sink", 1)
    lam = split_lambda([want[t][2] / want[t][3] for t in rows_tok if not want[t][0]])
    settings = Settings(thresholds=(lam,), window=8, window_align=1, approx=make_approximation("sink"))
    got = {}
    for path in ("native", "gathered"):
        rows = StepRows.build(step["qsl"], step["seq_lens"], step["starts"], torch.arange(5))
        out = step["output"].clone()
        got[path] = verify_layer(step["query"], out, step["cache"], step["layout"], step["table"], step["N"], rows,
                                 settings, 0, step["scale"], verifier=VERIFIERS[path]()), out
    ((codes, ratios), out), ((codes_ref, ratios_ref), out_ref) = got["native"], got["gathered"]
    assert torch.equal(codes, codes_ref) and set(codes.tolist()) == {TRIVIAL, ACCEPTED, REJECTED}
    torch.testing.assert_close(ratios, ratios_ref, rtol=1e-5, atol=0, equal_nan=True)
    torch.testing.assert_close(out, out_ref, rtol=1e-6, atol=4e-6)  # values of 8-sigma keys: a few float32 steps


def _kernel_decides_as_gathered(case: dict, S: int, atol: float = 1e-6) -> None:
    """The kernel (path native) on a rolling case: decisions equal the gathered path's, d/n and outputs to float32
    rounding, at a lambda between the measured ratios (some rows accepted, some rejected)."""

    def settings_at(lam: float) -> Settings:
        return Settings(thresholds=(lam,), window=S, window_align=1, approx=make_approximation("sink"))

    _, measured = verify_layer(case["query"], case["out"].clone(), case["cache"], LAYOUTS["cpu-vec"], case["table"],
                               case["block"], case["rows"], settings_at(0.3), 0, case["scale"], verifier=Gathered())
    settings = settings_at(split_lambda(measured[measured.isfinite()].tolist(), gap=1e-4))
    got = {}
    for path in ("native", "gathered"):
        out = case["out"].clone()
        got[path] = verify_layer(case["query"], out, case["cache"], LAYOUTS["cpu-vec"], case["table"], case["block"],
                                 case["rows"], settings, 0, case["scale"], verifier=VERIFIERS[path]()), out
    ((codes, ratios), out), ((codes_ref, ratios_ref), out_ref) = got["native"], got["gathered"]
    assert torch.equal(codes, codes_ref) and set(codes.tolist()) == {TRIVIAL, ACCEPTED, REJECTED}
    torch.testing.assert_close(ratios, ratios_ref, rtol=1e-5, atol=0, equal_nan=True)
    torch.testing.assert_close(out, out_ref, rtol=1e-5, atol=atol)


@pytest.mark.parametrize("heads,dim,S", [((2, 2), 64, 16), ((4, 1), 64, 32), ((8, 2), 128, 16), ((8, 1), 64, 4),
                                         ((9, 3), 144, 64)])
def test_cpu_kernel_tiles_of_a_long_prefill_decide_as_gathered(heads, dim, S):
    """A rolling prefill's rows go through the kernel in tiles of consecutive positions: GQA groups of 1, 4 and 8
    with head dims whose P @ V passes hold 6 or 3 queries (a pass that ends inside a row, or spans several with
    shifted windows), a window small enough that tiles are cut by their keys' waste, and a head dim past eight
    registers. Decisions equal the gathered path's, d/n to float32 rounding."""
    _kernel_decides_as_gathered(_rolling(S=S, tokens=260, heads=heads, dim=dim), S)


@pytest.mark.parametrize("group", [1, 3, 4])
@pytest.mark.parametrize("dim", range(16, 272, 16))
def test_cpu_kernel_every_head_dim_decides_as_gathered(dim, group):
    """Every head dim the vectorised P @ V takes (1 to 16 registers of channels, in passes of 8) at GQA groups 1, 3
    and 4, on short tiles (window 4: 3 or 4 rows a tile): scores in blocks of 3, 4 and 6 queries, P @ V passes full
    and partial (3 slots where a pass has no more queries), each block and pass size at each register count."""
    # A~ of 8 keys: values near 0 after cancellation differ by a few float32 steps of the terms (up to 2e-6)
    _kernel_decides_as_gathered(_rolling(S=4, tokens=48, heads=(2 * group, 2), dim=dim), 4, atol=4e-6)


@pytest.mark.parametrize("group,rows", [(1, 3), (3, 3), (2, 3), (2, 2), (4, 2)])
@pytest.mark.parametrize("S", [24, 40, 64])
def test_cpu_kernel_a_few_rows_of_long_runs_decide_as_gathered(S, group, rows):
    """Two or three rows past the trivial edge in 128-key blocks (a step of a request's decode rows, as the kernel
    sees it): 3 to 12 queries, scored in blocks of 3, 4 and 6 over runs of 24, 40 and 64 keys (1 to 4 key
    registers)."""
    case = _rolling(S=S, tokens=2 * S + rows, heads=(2 * group, 2), dim=64, block=128)
    _kernel_decides_as_gathered(case, S, atol=4e-6)


@pytest.mark.parametrize("group,rows", [(3, 3), (2, 3), (4, 2)])  # 9, 6 and 8 queries: blocks of 3, 6 and 4
@pytest.mark.parametrize("S", [72, 88, 104, 120, 128])
def test_cpu_kernel_runs_longer_than_a_key_step_decide_as_gathered(S, group, rows):
    """Runs of 72 to 128 keys in 128-key blocks (the sink's; the window's crosses a block edge), scored in blocks of
    3, 4 and 6 queries: two steps of 4 key registers a run, the second of 1 to 4 (the earlier tests' runs take one)."""
    case = _rolling(S=S, tokens=2 * S + rows, heads=(2 * group, 2), dim=64, block=128)
    _kernel_decides_as_gathered(case, S, atol=4e-6)


def test_cpu_kernel_in_bfloat16_decides_as_gathered():
    """bfloat16 on the CPU layout: the kernel rounds the probabilities and the output as semantics.attend does, so
    the decisions are the gathered path's and every committed value is within one bfloat16 step of it."""
    step = build_step("cpu-vec", 32)
    bf16 = {k: step[k].to(torch.bfloat16) for k in ("query", "output", "cache")}
    got = {}
    for path in ("native", "gathered"):
        rows = StepRows.build(step["qsl"], step["seq_lens"], step["starts"], torch.arange(5))
        settings = Settings(thresholds=(0.45,), window=32, window_align=1, approx=make_approximation("sink"))
        out = bf16["output"].clone()
        got[path] = verify_layer(bf16["query"], out, bf16["cache"], step["layout"], step["table"], step["N"], rows,
                                 settings, 0, step["scale"], verifier=VERIFIERS[path]()), out
    ((codes, ratios), out), ((codes_ref, ratios_ref), out_ref) = got["native"], got["gathered"]
    assert torch.equal(codes, codes_ref) and set(codes.tolist()) == {TRIVIAL, ACCEPTED, REJECTED}
    torch.testing.assert_close(ratios, ratios_ref, rtol=1e-3, atol=0, equal_nan=True)
    changed = (out != bf16["output"]).flatten(1).any(1)
    assert changed.any() and torch.equal(changed, (out_ref != bf16["output"]).flatten(1).any(1))
    step_size = out_ref.float().abs().clamp(min=1e-3) * 2 ** -7  # one bfloat16 step of each value
    assert ((out.float() - out_ref.float()).abs() <= step_size).all()


def test_cpu_kernel_accepts_as_semantics_at_the_limit():
    """The kernel's accept at lambda exactly a row's d/n, and one float32 step below: row for row what
    semantics.accept decides from the same d and n (the square roots of its d^2 and n^2, correctly rounded as C's
    sqrtf; torch's vectorised sqrt may be one step off), its d/n, and semantics.commit's outputs."""
    from alspec_eval import semantics

    step = build_step("cpu-vec", 8)
    rows = StepRows.build(step["qsl"], step["seq_lens"], step["starts"], torch.arange(5))
    settings = Settings(thresholds=(0.5,), window=8, window_align=1, approx=make_approximation("sink"))
    plan = step_plan(step, rows, settings, verifiers.Native())
    approx, d2, n2 = (t.clone() for t in native.verify(step["query"], step["output"], step["cache"], step["table"],
                                                       plan.prepared, step["scale"], native.Scratch()))
    d, n = d2.double().sqrt().float(), n2.double().sqrt().float()
    accepted = 0
    for ratio in (d / n).tolist():
        for lam in (ratio, float(torch.nextafter(torch.tensor(ratio), torch.tensor(0.0)))):
            out = step["output"].clone()
            codes, ratios = native.verify_and_decide(step["query"], out, step["cache"], step["table"], plan.prepared,
                                                     step["scale"], lam, plan.codes, plan.ratios, native.Scratch())
            want = semantics.accept(d, n, lam)
            assert torch.equal(codes[plan.live] == ACCEPTED, want), lam
            assert torch.equal(codes[plan.live] == REJECTED, ~want)
            assert torch.equal(ratios[plan.live], d / n)
            token = plan.prepared.token
            assert torch.equal(out[token], semantics.commit(step["output"][token], approx, want))
            accepted += int(want.sum())
    assert 0 < accepted < 2 * len(d2) ** 2  # both sides of the limit occur


def test_cpu_kernel_exponential_is_within_an_ulp_of_exp():
    """The softmax's exponential (a polynomial, vectorised): within 1.05 float32 steps of e^x in float64 over the
    whole range a softmax gives it (x <= 0 down to float32's smallest normal result), the same bits LANES at a time
    as one at a time, and about float32's smallest normal below that (never 0: the sum stays positive)."""
    x = torch.cat([-torch.rand(1_000_000, generator=torch.Generator().manual_seed(0), dtype=torch.float64) * 87.3,
                   torch.tensor([0.0, -0.0, -1e-30, -87.33, -88.0, -1000.0, -math.inf], dtype=torch.float64)]).float()
    y, one_by_one = torch.empty_like(x), torch.empty_like(x)
    native.library().alspec_exp(x.data_ptr(), y.data_ptr(), len(x))
    for at in range(0, 64 * 15, 15):  # 15 a call: a vector of LANES (8 or 16) and the scalar tail, or the tail alone
        native.library().alspec_exp(x[at:].data_ptr(), one_by_one[at:].data_ptr(), 15)
    assert torch.equal(y[:64 * 15], one_by_one[:64 * 15])
    exact = x.double().exp()
    normal = exact >= torch.finfo(torch.float32).tiny
    step = torch.exp2(exact.log2().floor() - 23)  # float32's step in e^x's binade
    assert ((y.double() - exact).abs() / step)[normal].max() <= 1.05
    assert ((y[~normal] > 0) & (y[~normal] < 1.0001 * torch.finfo(torch.float32).tiny)).all()


def test_cpu_kernel_does_not_depend_on_the_thread_count():
    """A row's A~ is one thread's work: the same bits with one thread or two."""
    step = build_step("cpu-vec", 32)
    rows = StepRows.build(step["qsl"], step["seq_lens"], step["starts"], torch.arange(5))
    settings = Settings(thresholds=(0.5,), window=32, window_align=32, approx=make_approximation("sink"))
    plan = step_plan(step, rows, settings, verifiers.Native())
    threads = torch.get_num_threads()
    got = []
    try:
        for count in (1, 2):
            torch.set_num_threads(count)
            got.append([t.clone() for t in native.verify(step["query"], step["output"], step["cache"], step["table"],
                                                         plan.prepared, step["scale"], native.Scratch())])
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(a, b) for a, b in zip(*got))


# ---- 6b. the listed kernel (verify_cpu.c's rows of a draft that selects by content) against the gathered path ----
def _content_drafts() -> list[tuple[str, dict]]:
    """Every draft that runs in vLLM and needs no prompt observed first (the prompt scorers are compared end to end
    in test_vllm_drafts.py), by its model_args at a window of 8, the sink's ranges among them."""
    from default_approximations import DEFAULT_APPROXIMATIONS
    from default_presses import DEFAULT_PRESSES

    drafts = [(name, args(8)) for name, args in DEFAULT_APPROXIMATIONS.items()]
    drafts += [(f"kvpress:{name}", args(8)) for name, args in DEFAULT_PRESSES.items()]
    made = [(name, args, make_approximation(name, args or None)) for name, args in drafts]
    return [(name, args) for name, args, a in made if not a.hf_only and not a.prompt_keys]


CONTENT_DRAFTS = _content_drafts()
UNKEPT_QUEST = ("quest", {"page": 2})  # summaries as large as the keys: not kept, the keys read as any draft's


def _listed_against_gathered(step: dict, approx: Approximation, lam: float, rows: StepRows | None = None,
                             atol: float = 1e-6) -> tuple[torch.Tensor, torch.Tensor]:
    """Both ways on one layer of ``step`` (build_step's keys, or a _rolling case's): the same codes and measures,
    d/n and committed outputs to float32 rounding; returns the listed way's codes and d/n. A draft that keeps page
    summaries (Quest, Knorm) selects from them, as the engine's do (the listed way in C where the draft offers it),
    where the engine keeps them (``kept.keeps``: Quest's pages of 2 keys are not, and read keys)."""
    from alspec_eval.vllm import kept as kept_pages

    got = {}
    keeps = kept_pages.keeps(approx, step["cache"])
    summaries = kept_pages.allocate(approx, step["cache"], step["layout"]) if keeps else None
    for path in ("listed", "gathered"):
        fresh = rows or StepRows.build(step["qsl"], step["seq_lens"], step["starts"], torch.arange(5),
                                       seeds=torch.tensor([7, 2**32 - 5, 0, 123_456_789, 99]))
        fresh.plans.clear()
        settings = Settings(thresholds=(lam,), window=step["S"], window_align=1, approx=approx)
        out = step["output"].clone()
        got[path] = verify_and_count(step["query"], out, step["cache"], step["layout"], step["table"], step["N"],
                                     fresh, settings, 0, step["scale"], verifier=VERIFIERS[path](),
                                     kept=summaries), out
    ((codes, ratios, measures), out), ((codes_ref, ratios_ref, measures_ref), out_ref) = got["listed"], got["gathered"]
    assert torch.equal(codes, codes_ref)
    torch.testing.assert_close(ratios, ratios_ref, rtol=1e-5, atol=0, equal_nan=True)
    torch.testing.assert_close(out, out_ref, rtol=1e-5, atol=atol)
    assert measures.keys() == measures_ref.keys()
    for name in measures:
        torch.testing.assert_close(measures[name], measures_ref[name], rtol=1e-5, atol=1e-6, equal_nan=True)
    return codes, ratios


@pytest.mark.parametrize("name,args", [*CONTENT_DRAFTS, UNKEPT_QUEST],
                         ids=[*(n for n, _ in CONTENT_DRAFTS), "quest-p2"])
def test_listed_kernel_decides_every_draft_as_gathered(name, args):
    """Every content draft on the CPU layout (build_step's prefill, decode rows and a chunk; shared and shuffled
    blocks, garbage in every unread slot), verified by the listed kernel: the gathered path's decisions at a lambda
    between the measured ratios, its d/n and outputs to float32 rounding, its measures; the engine chooses it."""
    step = build_step("cpu-vec", 8)
    approx = make_approximation(name, args or None)
    assert choose(approx, step["layout"], step["cache"]).name == ("native" if approx.keys_by_position else "listed")
    _, ratios = _listed_against_gathered(step, approx, 0.3)
    measured = ratios[ratios.isfinite()].tolist()
    codes, _ = _listed_against_gathered(step, approx, split_lambda(measured, gap=1e-4))
    assert {ACCEPTED, REJECTED} <= set(codes.tolist())


@pytest.mark.parametrize("name,args,selections", [("kvpress:RandomPress", "seed:0", 1), ("kvpress:CURPress", None, 2)])
@pytest.mark.parametrize("path", ["listed", "gathered"])
def test_a_draft_that_selects_alike_at_every_layer_selects_once_a_step(monkeypatch, name, args, selections, path):
    """A draft that declares same_at_every_layer (RandomPress: its numbers from one fixed seed) selects once a step:
    the step's second layer lists the first layer's keys and decides as a step of its own would; a draft that reads
    keys selects at every layer."""
    step = build_step("cpu-vec", 8)
    approx = make_approximation(name, args)
    calls = []
    select = type(approx).select
    monkeypatch.setattr(type(approx), "select", lambda self, *a, **k: calls.append(1) or select(self, *a, **k))

    def rows() -> StepRows:
        return StepRows.build(step["qsl"], step["seq_lens"], step["starts"], torch.arange(5))

    settings = Settings(thresholds=(0.3, 0.3), window=step["S"], window_align=1, approx=approx)
    shared = rows()
    got = [verify_and_count(step["query"], step["output"].clone(), step["cache"], step["layout"], step["table"],
                            step["N"], shared, settings, layer, step["scale"], verifier=VERIFIERS[path]())
           for layer in (0, 1)]
    assert len(calls) == selections
    alone = verify_and_count(step["query"], step["output"].clone(), step["cache"], step["layout"], step["table"],
                             step["N"], rows(), settings, 1, step["scale"], verifier=VERIFIERS[path]())
    assert torch.equal(got[1][0], alone[0]) and torch.equal(got[1][1].nan_to_num(-1), alone[1].nan_to_num(-1))


@dataclass(frozen=True)
class NarrowQuest(Quest):
    """Quest as a user's draft might return it: int32 indices and a uint8 mask."""

    def select(self, *args, **kwargs):
        index, valid = super().select(*args, **kwargs)
        return index.int(), valid.to(torch.uint8)


@pytest.mark.parametrize("path", ["listed", "gathered"])
def test_a_drafts_int32_indices_and_uint8_mask_are_read_as_positions_and_flags(path):
    """A decode step hands on its one selection as the draft returned it: indices and a mask of other dtypes are
    listed as int64 positions and bool flags, deciding as the draft that returns those."""
    case = _rolling(S=8, tokens=40)
    got = []
    for approx in (Quest(page=4), NarrowQuest(page=4)):
        rows = StepRows.build(torch.tensor([0, 1]), torch.tensor([40]), torch.tensor([0]), torch.tensor([7]))
        settings = Settings(thresholds=(0.3,), window=8, window_align=1, approx=approx)
        got.append(verify_and_count(case["query"][39:], case["out"][39:].clone(), case["cache"], LAYOUTS["cpu-vec"],
                                    case["table"], case["block"], rows, settings, 0, case["scale"],
                                    verifier=VERIFIERS[path]()))
    assert torch.equal(got[0][0], got[1][0]) and torch.equal(got[0][1], got[1][1])
    assert got[0][1].isfinite().all()


def test_same_at_every_layer_is_refused_for_a_draft_that_reads_keys():
    with pytest.raises(TypeError, match="same_at_every_layer"):
        type("ReadsKeys", (Approximation,), {"same_at_every_layer": True, "__module__": __name__})


def test_listed_kernel_under_tensor_parallel_measures_as_alone():
    """A measuring draft (vAttention: its densities and its denominator's misses) through the listed kernel with a
    tensor-parallel reduce (one rank: the sum is its own): the same codes, d/n and measures as deciding in the
    kernel's one call, and as the gathered path's under the same reduce."""
    step = build_step("cpu-vec", 8)
    approx = make_approximation("vattention", dict(CONTENT_DRAFTS)["vattention"])
    got = {}
    for path, reduce in (("listed", None), ("listed", lambda x: x), ("gathered", lambda x: x)):
        rows = StepRows.build(step["qsl"], step["seq_lens"], step["starts"], torch.arange(5),
                              seeds=torch.tensor([7, 2**32 - 5, 0, 123_456_789, 99]))
        settings = Settings(thresholds=(0.3,), window=8, window_align=1, approx=approx)
        got[path, reduce is None] = verify_and_count(step["query"], step["output"].clone(), step["cache"],
                                                     step["layout"], step["table"], step["N"], rows, settings, 0,
                                                     step["scale"], reduce=reduce, verifier=VERIFIERS[path]())
    alone = got["listed", True]
    assert len(alone[2]) == 2 and all(m.isfinite().any() for m in alone[2].values())
    for key in (("listed", False), ("gathered", False)):
        codes, ratios, measures = got[key]
        assert torch.equal(codes, alone[0]), key
        torch.testing.assert_close(ratios, alone[1], rtol=1e-5, atol=0, equal_nan=True)
        assert measures.keys() == alone[2].keys(), key
        for name in measures:
            torch.testing.assert_close(measures[name], alone[2][name], rtol=1e-5, atol=1e-6, equal_nan=True)


def _prefill_case(tokens: int, block: int) -> dict:
    """_rolling's one request prefilling ``tokens`` positions, in build_step's terms, on the CPU layout."""
    case = _rolling(S=8, tokens=tokens, block=block)
    cache = torch.empty_like(case["cache"])
    plain = case["cache"]
    for b in range(cache.shape[0]):  # the same keys and values, in the CPU layout
        for o in range(block):
            write_cpu_vec(cache, b, o, plain[b, :, o, :64], plain[b, :, o, 64:])
    return dict(query=case["query"], output=case["out"], cache=cache, table=case["table"], N=block,
                layout=LAYOUTS["cpu-vec"], scale=case["scale"], S=8, rows=case["rows"])


@pytest.mark.parametrize("name", ["topk", "quest", "kvpress:KnormPress", "vattention"])
def test_listed_kernel_tiles_of_a_prefill_decide_as_gathered(name):
    """A 300-token prefill (one request, tiles of 64 rows): blocks two rows read are copied once and read there, the
    rest from the cache. Decisions and d/n as the gathered path's, in blocks of 16 and of 128 keys."""
    args = dict(CONTENT_DRAFTS)[name]
    for block in (16, 128):
        case = _prefill_case(300, block)
        _listed_against_gathered(case, make_approximation(name, args or None), 0.3, case["rows"], atol=1e-5)


@pytest.mark.parametrize("name", ["topk", "quest", "vattention"])
def test_listed_kernel_bits_do_not_depend_on_the_rows_beside(name):
    """A position's d/n is the same bits whether its row is verified alone (keys read from the cache) or among a
    prefill's tiles (keys read from the tile's copies of shared blocks): how a step is cut never moves a decision."""
    args = dict(CONTENT_DRAFTS)[name]
    case = _prefill_case(200, 16)
    settings = Settings(thresholds=(0.3,), window=8, window_align=1, approx=make_approximation(name, args or None))

    def ratios(lo: int, hi: int) -> torch.Tensor:
        rows = StepRows.build(torch.tensor([0, hi - lo]), torch.tensor([hi]), torch.tensor([0]), torch.tensor([7]))
        _, got = verify_layer(case["query"][lo:hi], case["output"][lo:hi].clone(), case["cache"], case["layout"],
                              case["table"], case["N"], rows, settings, 0, case["scale"], verifier=verifiers.Listed())
        return got

    whole = ratios(0, 200)
    assert whole[16:].isfinite().all()
    for at in (20, 99, 150, 199):
        assert torch.equal(ratios(at, at + 1), whole[at:at + 1]), at


def test_listed_kernel_reads_no_slot_that_does_not_count():
    """Slots a draft marks as not counting are never read: pointed into a block of NaN keys and values, they leave
    A~ finite and equal, bit for bit, to the same rows with those slots dropped. A log-weight is added to its key's
    score: a row with a key weighted differs."""
    step = build_step("cpu-vec", 8)
    size = step["N"]
    poisoned = torch.full_like(step["cache"][:1], math.nan)
    cache = torch.cat([step["cache"], poisoned])  # every request's first block made NaN
    table = step["table"].clone()
    table[:, 0] = len(cache) - 1
    rows = StepRows.build(step["qsl"], step["seq_lens"], step["starts"], torch.arange(5))
    live = (rows.pos >= size + 8).nonzero().squeeze(1)
    assert len(live) >= 8 and len(rows.request[live].unique()) >= 2
    g = torch.Generator().manual_seed(5)
    kept = torch.stack([size + torch.randperm(int(p) + 1 - size, generator=g)[:8] for p in rows.pos[live]])
    kept = kept[:, None, :].expand(-1, HKV, -1)  # 8 keys past the first block, the same for both KV heads
    nowhere = torch.full((len(live), HKV, 2), 3)  # a position in the NaN block
    listed = torch.cat([nowhere, kept, nowhere], -1)
    valid = torch.ones_like(listed, dtype=torch.bool)
    valid[..., :2] = valid[..., -2:] = False
    token, request = rows.token[live], rows.request[live]

    def approx(positions: torch.Tensor, valid: torch.Tensor | None, weight: torch.Tensor | None) -> torch.Tensor:
        return native.verify_listed(step["query"], step["output"], cache, table,
                                    native.Listed(token, request, live, positions, valid, weight), step["scale"],
                                    native.Scratch())[0].clone()

    masked, dropped = approx(listed, valid, None), approx(kept, None, None)
    assert masked.isfinite().all() and torch.equal(masked, dropped)
    weight = torch.zeros(kept.shape)
    weight[..., 0] = 2.0
    assert (approx(kept, None, weight) - dropped).abs().amax(-1).gt(1e-3).all()


def test_listed_kernel_reads_keys_from_the_contexts_the_draft_read():
    """Given the contexts a draft read to select (read_contexts' keys: a view, not contiguous), the listed kernel reads
    each row's keys there, whole, with the same bits as from the cache's transposed blocks; a key changed in one
    context moves A~ of exactly the rows that list it, and a row given no context (-1) reads the cache."""
    from alspec_eval.vllm.paged import read_contexts

    step = build_step("cpu-vec", 8)
    cache, table, size = step["cache"], step["table"], step["N"]
    rows = StepRows.build(step["qsl"], step["seq_lens"], step["starts"], torch.arange(5))
    live = (rows.pos >= 2 * 8).nonzero().squeeze(1)
    token, request = rows.token[live], rows.request[live]
    g = torch.Generator().manual_seed(3)
    positions = torch.stack([torch.randperm(int(p) + 1, generator=g)[:12] for p in rows.pos[live]])[:, None, :]
    positions = positions.expand(-1, HKV, -1).clone()
    positions[:, 1] = positions[:, 1].flip(-1)  # the heads' lists in other orders
    requests = request.unique()
    lengths = torch.stack([rows.pos[live][request == r].max() + 1 for r in requests])
    keys, _, _ = read_contexts(cache, step["layout"], table, size, requests, lengths, values=False)
    held = keys.new_full((*keys.shape[:2], keys.shape[2] + 5, keys.shape[3]), math.nan)
    held[:, :, :keys.shape[2]] = keys
    keys = held[:, :, :keys.shape[2]]  # as read_contexts returns a context shorter than its blocks: a view
    assert not keys.is_contiguous()
    where = torch.full((5,), -1)
    where[requests] = torch.arange(len(requests))

    def verified(context: torch.Tensor | None, context_row: torch.Tensor | None) -> tuple[torch.Tensor, ...]:
        listed = native.Listed(token, request, live, positions, None, None, context, context_row)
        return tuple(t.clone() for t in native.verify_listed(step["query"], step["output"], cache, table, listed,
                                                             step["scale"], native.Scratch()))

    from_cache = verified(None, None)
    from_context = verified(keys, where[request])
    for a, b in zip(from_cache, from_context, strict=True):
        assert torch.equal(a, b)
    changed = keys.clone()
    r, p = int(request[0]), int(positions[0, 0, 0])
    changed[int(where[r]), 0, p] += 4.0  # KV head 0's key at p of row 0's request
    lists = ((request == r) & (positions[:, 0] == p).any(-1))
    moved = (verified(changed, where[request])[0] != from_cache[0]).flatten(1).any(-1)
    assert lists.any() and torch.equal(moved, lists)
    alone = where[request].clone()
    alone[request == r] = -1  # those rows read the cache
    assert torch.equal(verified(changed, alone)[0], from_cache[0])


def test_the_listed_verifier_hands_the_kernel_the_contexts_a_draft_read(monkeypatch):
    """vAttention reads its requests' contexts to select: the listed kernel gets them (one group here), each row its
    own, and KeyDiff too; top-k (scored in place) and Random (by chance) read none, and the kernel gets none."""
    from alspec_eval.vllm.paged import read_contexts

    given = {}
    original = native.verify_listed_and_decide

    def spy(*args, **kwargs):
        given["rows"] = args[4]
        return original(*args, **kwargs)

    monkeypatch.setattr(native, "verify_listed_and_decide", spy)
    step = build_step("cpu-vec", 8)
    for name, reads in (("vattention", True), ("kvpress:KeyDiffPress", True), ("topk", False),
                        ("kvpress:RandomPress", False)):
        approx = make_approximation(name, dict(CONTENT_DRAFTS)[name] or None)
        rows = StepRows.build(step["qsl"], step["seq_lens"], step["starts"], torch.arange(5))
        settings = Settings(thresholds=(0.3,), window=8, window_align=1, approx=approx)
        verify_and_count(step["query"], step["output"].clone(), step["cache"], step["layout"], step["table"],
                         step["N"], rows, settings, 0, step["scale"], verifier=verifiers.Listed())
        listed = given.pop("rows")
        assert (listed.context is not None) == reads, name
        if reads:  # each row's context is its own request's keys
            assert listed.context.shape[0] == len(listed.request.unique()) and (listed.context_row >= 0).all()
            for r in listed.request.unique().tolist():
                length = int(rows.pos[listed.live][listed.request == r].max()) + 1
                own, _, _ = read_contexts(step["cache"], step["layout"], step["table"], step["N"], torch.tensor([r]),
                                          torch.tensor([length]), values=False)
                for at in listed.context_row[listed.request == r].tolist():
                    assert torch.equal(listed.context[at, :, :length], own[0])


def test_without_a_compiler_the_cpu_layout_verifies_by_tiles(monkeypatch, tmp_path, caplog):
    """No C compiler: one warning naming the fix, and the CPU layout's rows go by tiles, with the same decisions."""
    step = build_step("cpu-vec", 8)
    settings = Settings(thresholds=(0.5,), window=8, window_align=1, approx=make_approximation("sink"))
    built = native.library()
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    monkeypatch.setenv("ALSPEC_CACHE", str(tmp_path))
    native.library.cache_clear()
    try:
        with caplog.at_level("WARNING"):
            assert native.library() is None and not native.usable(step["layout"], step["cache"])
        assert "did not build" in caplog.text and str(tmp_path / "no-such-cc") in caplog.text
        assert choose(settings.approx, step["layout"], step["cache"]).name == "tiles"
    finally:
        native.library.cache_clear()
        monkeypatch.undo()
    assert built is not None and native.library() is not None


def _rolling(S: int, tokens: int = 1024, heads: tuple[int, int] = (9, 3), dim: int = 64, block: int = 16):
    """One request prefilling ``tokens`` positions, every one speculating (rolling loglikelihood), in a shuffled
    plain cache: what scoring a long document through vLLM verifies in one step."""
    g = torch.Generator().manual_seed(3)
    blocks = -(-tokens // block)
    cache = torch.randn(blocks + 1, heads[1], block, 2 * dim, generator=g)
    table = torch.randperm(blocks + 1, generator=g)[None, :blocks + 1]
    qsl, lens = torch.tensor([0, tokens]), torch.tensor([tokens])
    rows = StepRows.build(qsl, lens, torch.tensor([0]), torch.tensor([7]))
    query = torch.randn(tokens, heads[0], dim, generator=g)
    settings = Settings(thresholds=(0.3,) * 4, window=S, window_align=1, approx=make_approximation("sink"))
    return dict(query=query, out=torch.randn(tokens, heads[0], dim, generator=g), cache=cache, table=table,
                block=block, rows=rows, settings=settings, scale=dim ** -0.5)


class PeakBytes(TorchDispatchMode):
    """The most bytes that tensors made inside the mode held at once (storages counted once, freed ones dropped)."""

    def __init__(self) -> None:
        super().__init__()
        self.live, self.peak, self.seen = 0, 0, set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in torch.utils._pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in self.seen:
                storage = t.untyped_storage()
                key, size = storage.data_ptr(), storage.nbytes()
                self.seen.add(key)
                self.live += size
                self.peak = max(self.peak, self.live)
                weakref.finalize(storage, self._free, key, size)
        return out

    def _free(self, key: int, size: int) -> None:
        self.live -= size
        self.seen.discard(key)


def test_verification_memory_is_bounded_by_the_budget(monkeypatch):
    """Rolling scoring at S = 64 over 1,024 positions: the streamed path's transient stays within the budget plus
    a few (Hq, D) rows per token, where the gathered path's M x Hkv x 2S x D copies are 4x the budget's bound."""
    import alspec_eval.vllm.paged as paged
    import alspec_eval.vllm.tiled as tiled

    monkeypatch.setattr(tiled, "VERIFY_BUDGET", 4 * 2**20)
    monkeypatch.setattr(paged, "VERIFY_BUDGET", 4 * 2**20)
    case = _rolling(S=64)
    per_token = 5 * 4 * case["query"][0].numel()  # A~, A, their float32 difference: what reserve() counts
    bound = tiled.VERIFY_BUDGET + per_token * len(case["query"])
    peaks = {}
    for path in ("tiles", "gathered"):
        case["rows"].plans.clear()
        way = VERIFIERS[path]()
        verifiers.plan(case["rows"], case["settings"], verifiers.Layer(
            case["query"], case["out"], case["cache"], PlainLayout(), case["table"], case["block"], case["scale"]),
            way)  # the step's plan, built once
        with PeakBytes() as peak:
            verify_layer(case["query"], case["out"].clone(), case["cache"], PlainLayout(), case["table"],
                         case["block"], case["rows"], case["settings"], 1, case["scale"], verifier=way)
        peaks[path] = peak.peak
    unchunked = 2 * len(case["query"]) * 3 * 128 * 64 * 4  # the keys and values a row-by-row gather copies
    assert peaks["tiles"] <= bound < unchunked / 4, (peaks, bound)
    assert peaks["gathered"] <= bound  # the gathered path goes in chunks too


class ReadBacks(TorchFunctionMode):
    """Calls that read a tensor's values on the host (a stream stall on a GPU)."""

    NAMES = {"item", "__bool__", "__int__", "__float__", "__index__", "cpu", "tolist", "nonzero", "numpy"}

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name in self.NAMES or (name == "__getitem__" and any(
                isinstance(a, torch.Tensor) and a.dtype == torch.bool for a in torch.utils._pytree.tree_leaves(args[1:]))):
            self.calls.append(name)
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("layout", ["plain", "cpu-vec"])
@pytest.mark.parametrize("approx", ["sink", "local"])
@pytest.mark.parametrize("tokens", [1, 300])
def test_no_read_back_per_layer(layout, approx, tokens, monkeypatch):
    """After the step's first layer has built its plan on the host, a layer's verification (by the verifier the
    engine chose once) reads nothing back: decode rows and a prefill chunk alike; the worker reads the decisions
    once per engine call (WorkerState.take)."""
    from alspec_eval.vllm.backend import WorkerState

    case = _rolling(S=16, tokens=64 + tokens)
    rows = StepRows.build(torch.tensor([0, tokens]), torch.tensor([64 + tokens]), torch.tensor([0]), torch.tensor([7]))
    settings = Settings(thresholds=(0.3,) * 4, window=16, window_align=1, approx=make_approximation(approx))
    state = WorkerState(settings=settings)
    query, out = case["query"][:tokens], case["out"][:tokens].clone()
    verifier = choose(settings.approx, LAYOUTS[layout], case["cache"])
    assert verifier.name == ("native" if layout == "cpu-vec" else "tiles")
    for layer in range(4):
        with ReadBacks() as reads:
            decided = verify_and_count(query, out, case["cache"], LAYOUTS[layout], case["table"], case["block"],
                                       rows, settings, layer, case["scale"], verifier=verifier)
        if layer:
            assert reads.calls == [], (layer, reads.calls)
        state.records.append((rows.tag, rows.pos, layer, *decided))
    with ReadBacks() as reads:
        taken = state.take()
    assert reads.calls.count("cpu") == 1 and taken.codes.shape == (tokens, 4)


def test_a_decode_step_hands_a_draft_its_rows_in_order(monkeypatch):
    """A decode step's rows are its requests in order, which vLLM's gathered path knows on the host: the draft gets
    semantics.rows_in_order (known by identity: its keys used in place, nothing read back); a prefill's rows, repeated,
    are gathered."""
    from alspec_eval import semantics
    from alspec_eval.approximations.vattention import VAttention

    seen = []
    original = VAttention.select

    def select(self, query, key, rows, *args, **kwargs):
        seen.append(rows is semantics.rows_in_order(len(rows), rows.device) and len(rows) == len(key))
        return original(self, query, key, rows, *args, **kwargs)

    monkeypatch.setattr(VAttention, "select", select)
    case = _rolling(S=8, tokens=40)
    settings = Settings(thresholds=(0.3,), window=8, window_align=1, approx=make_approximation("vattention"))
    for tokens, in_order in ((1, True), (40, False)):  # one decode row; a prefill of 40 rows of one request
        rows = StepRows.build(torch.tensor([0, tokens]), torch.tensor([40]), torch.tensor([0]), torch.tensor([7]))
        verify_and_count(case["query"][40 - tokens:], case["out"][40 - tokens:].clone(), case["cache"],
                         LAYOUTS["plain"], case["table"], case["block"], rows, settings, 0, case["scale"],
                         verifier=Gathered())
        assert seen.pop() is in_order and not seen


@pytest.mark.parametrize("budget", [None, 1], ids=["whole", "parts"])
@pytest.mark.parametrize("approx", [name for name, args in CONTENT_DRAFTS  # drafts by position select nothing
                                    if not make_approximation(name, args or None).keys_by_position])
def test_a_draft_finds_its_rows_and_positions_on_the_host(approx, budget, monkeypatch):
    """Every draft the gathered path runs is handed rows, positions and padding whose values the host holds
    (semantics.host_values reads them there, so a press that slices each row's keys by its position reads nothing
    back from a GPU), those values the tensors' own: in a decode step, a prefill's repeated rows, and rows in parts
    (a context budget of one byte)."""
    from alspec_eval import semantics
    import alspec_eval.vllm.paged as paged

    if budget is not None:
        monkeypatch.setattr(paged, "CONTEXT_BUDGET", budget)
    settings = Settings(thresholds=(0.3,), window=8, window_align=1,
                        approx=make_approximation(approx, dict(CONTENT_DRAFTS)[approx] or None))
    handed = []
    cls = type(settings.approx)
    for method in ("select", "select_scored"):
        original = getattr(cls, method)

        def spy(self, first, *args, _original=original, _method=method):
            rows, pos, pad = args[1:4] if _method == "select" else args[:3]
            handed.append([(t in semantics._HOST_VALUES, semantics.host_values(t) == t.tolist())
                           for t in (rows, pos, pad)])
            return _original(self, first, *args)

        monkeypatch.setattr(cls, method, spy)
    case = _rolling(S=8, tokens=40)
    for tokens in (1, 40):  # one decode row; a prefill of 40 rows of one request
        rows = StepRows.build(torch.tensor([0, tokens]), torch.tensor([40]), torch.tensor([0]), torch.tensor([7]))
        verify_and_count(case["query"][40 - tokens:], case["out"][40 - tokens:].clone(), case["cache"],
                         LAYOUTS["plain"], case["table"], case["block"], rows, settings, 0, case["scale"],
                         verifier=Gathered())
    assert handed and all(each == [(True, True)] * 3 for each in handed), handed
    assert budget is None or len(handed) > 2  # rows in parts: one call per part


class HostCopies(TorchFunctionMode):
    """Copies from the host that wait for the device on a GPU: ``.to`` a device of a CPU tensor without
    ``non_blocking``, and a Python number written into a tensor through an index (copied from the host)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if name == "to" and args[0].device.type == "cpu" and not kwargs.get("non_blocking") and (
                "device" in kwargs or any(isinstance(a, (torch.device, str)) for a in args[1:])):
            self.calls.append("to")
        if name == "__setitem__" and isinstance(args[2], (bool, int, float)):
            self.calls.append("__setitem__")
        return func(*args, **kwargs)


@pytest.mark.parametrize("approx", ["quest", "topk", "vattention", "kvpress:KnormPress"])
def test_the_gathered_path_copies_nothing_from_the_host_that_waits(approx):
    """On the layers after a step's first (its plan built), the gathered path (a GPU's, here on the CPU) moves the
    host's indices to the device without waiting on it and writes no host number into a device tensor: on a GPU each
    such copy stalls the host until the stream drains (an H200 measured 6 a layer for Quest before)."""
    step = build_step("plain", 8)
    settings = Settings(thresholds=(0.5,) * 3, window=8, window_align=1,
                        approx=make_approximation(approx, dict(CONTENT_DRAFTS)[approx] or None))
    rows = StepRows.build(step["qsl"], step["seq_lens"], step["starts"], torch.arange(5))
    for layer in range(3):
        with HostCopies() as copies:
            verify_and_count(step["query"], step["output"].clone(), step["cache"], step["layout"], step["table"],
                             step["N"], rows, settings, layer, step["scale"], verifier=Gathered())
        if layer:
            assert copies.calls == [], (layer, copies.calls)


@pytest.mark.parametrize("approx", ["topk", "quest"])
def test_a_selecting_draft_groups_its_contexts_once_per_step(approx, monkeypatch):
    """A draft that selects by content (gathered): which requests' contexts its rows read, and in which groups, is
    host work done on the step's first layer only; the later layers decide from the same groups as a fresh step."""
    import alspec_eval.vllm.paged as paged

    built = []
    original = paged.Contexts.build
    monkeypatch.setattr(paged.Contexts, "build", lambda *a: built.append(1) or original(*a))
    step = build_step("plain", 8)
    settings = Settings(thresholds=(0.5,) * 3, window=8, window_align=1, approx=make_approximation(approx))
    rows = StepRows.build(step["qsl"], step["seq_lens"], step["starts"], torch.arange(5))
    way = choose(settings.approx, step["layout"], step["cache"])
    assert way.name == "gathered"
    got = [verify_layer(step["query"], step["output"].clone(), step["cache"], step["layout"], step["table"],
                        step["N"], rows, settings, layer, step["scale"], verifier=way) for layer in range(3)]
    assert built == [1]
    fresh = StepRows.build(step["qsl"], step["seq_lens"], step["starts"], torch.arange(5))
    alone = verify_layer(step["query"], step["output"].clone(), step["cache"], step["layout"], step["table"],
                         step["N"], fresh, settings, 2, step["scale"], verifier=way)
    assert torch.equal(got[2][0], alone[0]) and torch.equal(got[2][1].nan_to_num(-1), alone[1].nan_to_num(-1))


def test_scratch_addresses_follow_its_growth():
    """The kernel's scratch addresses are those of the buffers take() holds, also after they grew (a stale address
    would write into freed memory)."""
    scratch = native.Scratch()
    for count in (3, 2, 40, 41, 7):
        addresses = scratch.addresses(torch.float32, 9, 64, count)
        held = scratch.take(torch.float32, 9, 64, count)
        assert addresses == tuple(t.data_ptr() for t in held) and len(held[0]) == count
    assert len(scratch.held[(torch.float32, 9, 64)][1]) == 80  # doubled at 41, not grown again at 7


@pytest.mark.parametrize("layout", ["plain", "cpu-vec"])
@pytest.mark.parametrize("approx,align", [("sink", 1), ("sink", 32), ("local", 1)])
def test_a_position_decides_the_same_bits_however_the_step_is_cut(layout, approx, align):
    """A prompt of 300 positions verified in one step, or in chunks cut elsewhere beside another request's decode
    row (chunked prefill, a prefix-cache hit): every position's d/n is the same bits, so a sweep's cell or a
    data-parallel replica scores as the engine alone does."""
    case = _rolling(S=16, tokens=300)
    settings = Settings(thresholds=(0.3,), window=16, window_align=align, approx=make_approximation(approx))
    table = torch.cat([case["table"], case["table"].flip(1)])  # a second request: the same blocks, read backwards

    def ratios(cuts: list[int]) -> torch.Tensor:
        out = []
        for lo, hi in zip(cuts, cuts[1:]):
            qsl, lens = torch.tensor([0, 1, 1 + hi - lo]), torch.tensor([250, hi])  # the decode row comes first
            rows = StepRows.build(qsl, lens, torch.tensor([0, 0]), torch.tensor([1, 7]), torch.tensor([100, 300]))
            query = torch.cat([case["query"][:1], case["query"][lo:hi]])
            codes, ratio = verify_layer(query, torch.cat([case["out"][:1], case["out"][lo:hi]]), case["cache"],
                                        LAYOUTS[layout], table, case["block"], rows, settings, 0, case["scale"])
            out.append(ratio[rows.tag == 7])
        return torch.cat(out)

    whole = ratios([0, 300])
    assert whole[32:].isfinite().all()  # past the trivial edge every position is measured
    for cuts in ([0, 137, 300], [0, 40, 41, 299, 300], [0, 64, 200, 300]):
        assert torch.equal(ratios(cuts).nan_to_num(-1), whole.nan_to_num(-1)), cuts


@pytest.mark.parametrize("layout", ["plain", "cpu-vec"])
def test_layers_with_their_own_block_tables_read_their_own_blocks(layout):
    """Where a step's layers hold their caches in blocks of their own (KV-cache groups of a hybrid model), each
    layer reads its own table: the tiles' reads found for one table are not reused for another."""
    step = build_step(layout, S=8)
    perm = torch.randperm(step["cache"].shape[0], generator=torch.Generator().manual_seed(4))
    cache2, table2 = step["cache"][perm].contiguous(), perm.argsort()[step["table"]]  # the same keys, elsewhere
    rows = StepRows.build(step["qsl"], step["seq_lens"], step["starts"], torch.arange(5))
    settings = Settings(thresholds=(0.5, 0.5), window=8, window_align=1, approx=make_approximation("sink"))
    got = [verify_layer(step["query"], step["output"].clone(), cache, step["layout"], table, step["N"], rows,
                        settings, layer, step["scale"])[1]
           for layer, (cache, table) in enumerate([(step["cache"], step["table"]), (cache2, table2)])]
    assert got[0].isfinite().any() and torch.equal(got[0].nan_to_num(-1), got[1].nan_to_num(-1))


@dataclass(frozen=True)
class Jumpy(Approximation):
    """A user's draft fixed by position whose one range jumps back S keys at every 50th position: a tile that holds
    such a position reads further back than its neighbours (each tile's reads come from its own positions)."""

    keys_by_position = True

    def position_ranges(self, pos, window, window_align):
        start = pos - 2 * window + 1 - window * (pos % 50 == 0).long()
        return start[:, None], (pos + 1)[:, None], (3 * window,)


@pytest.mark.parametrize("layout", ["plain", "cpu-vec"])
def test_a_draft_whose_ranges_jump_reads_what_each_tile_needs(layout):
    step = build_step(layout, S=8)
    settings = Settings(thresholds=(0.5,), window=8, window_align=1, approx=Jumpy())
    got = {}
    for path in paths(layout):
        rows = StepRows.build(step["qsl"], step["seq_lens"], step["starts"], torch.arange(5))
        got[path] = verify_layer(step["query"], step["output"].clone(), step["cache"], step["layout"],
                                 step["table"], step["N"], rows, settings, 0, step["scale"], verifier=VERIFIERS[path]())
    tiles = step_plan(step, rows, settings, VERIFIERS["tiles"]()).prepared
    prompt_reads = {g.chunks.shape[1] for g in tiles.groups if g.token.shape[1] > 1}
    assert len(prompt_reads) == 2  # tiles with a jump read more than those without
    for path in paths(layout)[:-1]:
        assert torch.equal(got[path][0], got["gathered"][0])
        torch.testing.assert_close(got[path][1], got["gathered"][1], rtol=1e-5, atol=0, equal_nan=True)


def test_lagkv_reads_no_context_once_its_stores_hold_the_settled_scores(monkeypatch):
    """kvpress's LagKV keeps each request's settled chunk scores (``keeps_scores``): a step reads the contexts and
    fills the stores, the same step again with those stores reads none, and both decide as scoring every row from
    its keys (no stores), bit for bit."""
    import alspec_eval.vllm.paged as paged

    reads = []
    original = paged.read_contexts
    monkeypatch.setattr(paged, "read_contexts", lambda *a: reads.append(len(a[4])) or original(*a))
    step = build_step("plain", 8)
    approx = make_approximation("kvpress:LagKVPress", "n_sink:2;lag_size:4")
    settings = Settings(thresholds=(0.5,), window=8, window_align=1, approx=approx)
    way = choose(approx, step["layout"], step["cache"])
    stores: dict[int, dict] = {row: {} for row in range(5)}

    def decided(observed):
        rows = StepRows.build(step["qsl"], step["seq_lens"], step["starts"], torch.arange(5))
        return verify_layer(step["query"], step["output"].clone(), step["cache"], step["layout"], step["table"],
                            step["N"], rows, settings, 0, step["scale"], observed=observed, verifier=way)

    first = decided(stores)
    assert sum(reads) == 4 and all("scores" in store for row, store in stores.items() if row != 2)
    reads.clear()
    again = decided(stores)
    assert reads == []
    reads.clear()
    alone = decided(None)
    assert sum(reads) == 4
    for got in (first, again):
        assert torch.equal(got[0], alone[0]) and torch.equal(got[1].nan_to_num(-1), alone[1].nan_to_num(-1))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("size,dim", [(16, 8), (32, 24), (128, 64), (12, 20), (3, 5)])
def test_cpu_blocks_read_in_one_pass_are_torch_s(dtype, size, dim):
    """CPU_ATTN's whole blocks read by the C kernel (keys transposed back in 8 x 8 register tiles where it can, the
    rest one by one; values copied) are torch's index_select and permuted copy, bit for bit: blocks repeated and in
    any order, a head dim and a block size that are not multiples of a tile (12 x 20: a tile and an edge each way;
    3 x 5: no tile), with and without the values; and the kernel is what reads them."""
    layout = CpuVecLayout()
    cache = torch.randn(40, 3, size, 2 * dim, generator=torch.Generator().manual_seed(1)).to(dtype)
    ids = torch.randint(0, 40, (4, 7), generator=torch.Generator().manual_seed(2))
    ids[1, 3] = ids[0, 0]
    for values in (True, False):
        assert native.read_blocks(cache, ids, values) is not None
        got, want = layout.blocks(cache, ids, values), layout.blocks_by_torch(cache, ids, values)
        assert torch.equal(got[0], want[0])
        assert got[1] is None if not values else torch.equal(got[1], want[1])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("group,dim,size", [(1, 8, 16), (3, 16, 32), (4, 64, 128), (8, 24, 16)])
def test_cpu_key_scores_are_semantics_key_scores(dtype, group, dim, size):
    """Keys scored where they lie (the listed kernel's scorer): each row's semantics.key_scores against its own
    request's keys up to its position, to float32 rounding (the same products, summed in the channels' order), -inf
    past it, at GQA groups of 1 to 8 (query blocks of 3, 4 and 6, padded) and blocks of 16 to 128 keys; a NaN key
    scores NaN, as torch's max keeps it."""
    from alspec_eval import semantics

    step = build_step("cpu-vec", 8 if size < 128 else 48, geometry=(size, dim))  # requests sharing a block
    cache, query = step["cache"].to(dtype), torch.randn(len(step["tok"]), group * HKV, dim).to(dtype)
    request = torch.tensor([r for r, _ in step["tok"]])
    pos = torch.tensor([p for _, p in step["tok"]])
    width = int(pos.max()) + 3
    keys, _ = step["layout"].blocks(cache, step["table"][:, :-(-width // size)], False)
    want = semantics.key_scores(query, keys[request][:, :, :width])
    want = want.masked_fill(torch.arange(width) > pos[:, None, None], -math.inf)
    got = native.key_scores(cache, step["table"], query, request, pos, width)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert torch.equal(got.isinf(), want.isinf())
    poisoned = cache.clone().view(cache.shape[0], HKV, -1)
    block = step["table"][3, 0]  # request 3's first block (request 0's too: they share it)
    poisoned[block, 1, 5 * size + 1] = math.nan  # its key 1's channel 5, at KV head 1
    got = native.key_scores(poisoned.view(cache.shape), step["table"], query, request, pos, width)
    reads = (step["table"][request, 0] == block) & (pos >= 1)  # the rows whose keys include it
    assert torch.equal(got[:, 1, 1].isnan(), reads) and not got[:, 0].isnan().any()
    assert (step["table"][request, 0] == block).any() and (step["table"][request, 0] != block).any()
    if group > 1:  # one query head's NaN: its KV head's scores, the largest over the group, are NaN
        query[4, 1, 0] = math.nan
        got = native.key_scores(cache, step["table"], query, request, pos, width)
        assert got[4, 0, :int(pos[4]) + 1].isnan().all() and not got[4, 1].isnan().any()


def test_a_draft_that_ranks_by_scores_reads_no_context_on_the_cpu(monkeypatch):
    """Top-k through the listed kernel scores its keys where they lie: no context is read (its decisions are the
    gathered path's: test_listed_kernel_decides_every_draft_as_gathered), unless a measure it declares reads the keys
    (a promise on the denominator): then the context is read and the measure taken."""
    import alspec_eval.vllm.paged as paged
    from alspec_eval.approximations.base import Promise
    from alspec_eval.approximations.topk import TopK
    from alspec_eval.stats import DENOMINATOR

    @dataclass(frozen=True)
    class PromisingTopK(TopK):
        def promise(self) -> Promise:
            return Promise(0.5, 0.5, denominator=True)

    reads = []
    original = paged.read_contexts
    monkeypatch.setattr(paged, "read_contexts", lambda *a: reads.append(1) or original(*a))
    step = build_step("cpu-vec", 8)
    for approx, read in ((TopK(), False), (PromisingTopK(), True)):
        reads.clear()
        rows = StepRows.build(step["qsl"], step["seq_lens"], step["starts"], torch.arange(5))
        settings = Settings(thresholds=(0.3,), window=8, window_align=1, approx=approx)
        codes, _, measures = verify_and_count(step["query"], step["output"].clone(), step["cache"], step["layout"],
                                              step["table"], step["N"], rows, settings, 0, step["scale"],
                                              verifier=verifiers.Listed())
        assert bool(reads) == read and (codes == ACCEPTED).any()
        assert set(measures) == ({DENOMINATOR} if read else set())
    _listed_against_gathered(step, PromisingTopK(), 0.3)


# ---- observations kept across calls, per prompt (paged.Prompts.kept; the driver's side: test_vllm_drafts_tiny.py) ----
def _observing(digest: int | None, held: bool, stored: object = None):
    """One request (tag 5) whose step holds the last position of its observation window, at layer 1 of a snapkv
    engine, and the worker's prompts: its digest, whether the driver counted on it, and ``stored`` kept for it."""
    from alspec_eval.vllm.paged import PromptRows, Prompts, observation_scope

    prompts = Prompts()
    settings = Settings(thresholds=(0.1, 0.1), window=8, window_align=1, approx=make_approximation("snapkv"))
    if digest is not None:
        prompts.digests[5] = (digest, held)
    if stored is not None:
        prompts.kept[observation_scope(settings), digest, 1] = stored
    rows = PromptRows(token=torch.tensor([0]), request=torch.tensor([0]), pos=torch.tensor([9]), tag=torch.tensor([5]),
                      first=torch.tensor([8]), start=torch.tensor([10]))
    return rows, settings, prompts


def test_a_prompt_observed_in_an_earlier_call_is_not_observed_again():
    """A kept observation of the request's prompt at the layer is the request's, and nothing is read (no cache is
    given: a read would fail); the observation goes to the end of the least-recently-used order."""
    from alspec_eval.vllm.paged import observe_layer

    from alspec_eval.vllm.paged import observation_scope

    stored = object()
    rows, settings, prompts = _observing(77, held=True, stored=stored)
    scope = observation_scope(settings)
    prompts.kept[scope, 78, 1] = object()
    prompts.kept[(scope[0], 16), 77, 1] = object()  # the same prompt under another window: another observation
    observe_layer(torch.zeros(1, 9, 64), None, None, None, 16, rows, settings, 1, 0.125, prompts)
    assert prompts.observed[5, 1] is stored and list(prompts.kept)[-1] == (scope, 77, 1)


def test_a_prompt_the_driver_counted_on_but_not_kept_is_refused():
    """The driver let the prefix cache serve the window of a prompt every worker said it held: a worker that does
    not hold it would observe a window it never saw; it says so instead."""
    from alspec_eval.vllm.paged import observe_layer

    rows, settings, prompts = _observing(77, held=True)
    with pytest.raises(RuntimeError, match="digest 77"):
        observe_layer(torch.zeros(1, 9, 64), None, None, None, 16, rows, settings, 1, 0.125, prompts)


def test_an_observation_is_kept_by_prompt_and_layer():
    """A request's observation, made from its window, is kept under its prompt's digest and the layer (2S entries of
    the ranking, all a step reads), and is the request's own; without a digest nothing is kept."""
    from alspec_eval.vllm.paged import PromptRows, observation_scope, observe_layer

    case = _rolling(S=8, tokens=64)
    for digest in (77, None):
        _, settings, prompts = _observing(digest, held=False)
        window = PromptRows(token=torch.arange(10), request=torch.zeros(10, dtype=torch.long),
                            pos=torch.arange(54, 64), tag=torch.full((10,), 5), first=torch.full((10,), 32),
                            start=torch.full((10,), 64))
        observe_layer(case["query"][54:64], case["cache"], LAYOUTS["plain"], case["table"], case["block"], window,
                      settings, 1, case["scale"], prompts)
        observed = prompts.observed[5, 1]
        assert observed.order.shape[-1] == 2 * settings.window
        assert list(prompts.kept) == ([(observation_scope(settings), 77, 1)] if digest else [])
        assert all(v is observed for v in prompts.kept.values())


def test_the_workers_hold_the_prompts_observed_at_every_layer_used_last(monkeypatch):
    """What a worker reports holding: the prompts observed at every observing layer, the least recently used beyond
    OBSERVATIONS_KEPT prompts dropped (and forgotten)."""
    import alspec_eval.vllm.paged as paged

    monkeypatch.setattr(paged, "OBSERVATIONS_KEPT", 2)
    prompts, scope, other = paged.Prompts(), ("snapkv", 64), ("snapkv", 32)
    for digest, layers in ((1, (0, 1)), (2, (0, 1)), (3, (0,)), (4, (0, 1))):
        for layer in layers:
            prompts.kept[scope, digest, layer] = object()
    prompts.kept.move_to_end((scope, 2, 0))  # prompt 2 used again: 2 and 4 are the last two used
    assert prompts.held(scope, [0, 1]) == [2, 4] and prompts.held(other, [0, 1]) == []
    assert {d for _, d, _ in prompts.kept} == {2, 4}
    prompts.kept[scope, 5, 0] = object()  # the newest, at one layer only: held where that layer is all that observes
    assert prompts.held(scope, [0]) == [2, 5] and {d for _, d, _ in prompts.kept} == {2, 5}
    assert prompts.held(scope, [0, 1]) == [2]
    prompts.kept[other, 6, 0] = object()  # another window's observation counts among the two used last
    assert prompts.held(other, [0]) == [6] and prompts.held(scope, [0]) == [5]
