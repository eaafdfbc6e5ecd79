"""The vAttention draft against an independent float64 reference (vattention_oracle.py, written from docs/design.md's
"vAttention: a weighted draft" alone): its selection (fixed keys, sampled keys, log-weights) position by position in a
padded batch, its A~ through ``semantics.attend`` with the log-weights as the bias, and the promise on the softmax
denominator's relative error over many random positions.

The promise: with z = Phi^-1(1 - delta / 2), the two-sided |D~ - D| > epsilon D has probability about delta under the
central limit theorem (less, with the finite-population correction of sampling without replacement), where the
budget binds: the test checks the two-sided share against delta with a one-sided binomial test.
"""

from __future__ import annotations

import functools
import math

import numpy as np
import pytest
import torch
from scipy.stats import binomtest

import vattention_oracle as oracle
from alspec_eval import semantics
from alspec_eval.approximations import Site
from alspec_eval.approximations.vattention import VAttention

HQ, HKV, DIM = 4, 2, 16
SCALE = DIM ** -0.5
WINDOW = 8  # ignored by the rule (every context here is past 2S = 16 keys but the first)
# a (row, KV head) whose deciding query head's pre-ceil budget lies within this relative distance of an integer may
# round the other way in float32: skipped (a float32 x carries a relative error of a few 1e-6; 1e-3, as wide as a
# budget's fractional part at x ~ 300, would skip most rows of the cases whose budget lies between b and m)
EDGE = 1e-5
MAX_SKIPPED = 2

# ---------------------------------------------------------------- the selection: a padded batch of three rows

PADS = (0, 37, 5)
LENGTHS = (2000, 900, 1300)
POSITIONS = ((0, 10), (0, 1999), (0, 1000), (0, 75), (0, 1500), (1, 899), (1, 120), (1, 40), (1, 300), (1, 611),
             (2, 1299), (2, 699), (2, 517), (2, 68), (2, 69))

SETTINGS = {
    "full": dict(epsilon=0.001),  # the budget reaches m: every key, all of weight 1
    "base": dict(epsilon=2.0, base_rate=0.1),  # the budget stays at b
    "between": dict(),  # the defaults: b < B < m on most rows
    "other": dict(epsilon=0.05, delta=0.4, base_rate=0.03, sink=1, local=5, top=0, seed=4_000_000_123),
}
# where each setting draws: the layer and the model's first KV head of the cache (a tensor-parallel rank's)
SITES = {"full": Site(0), "base": Site(1), "between": Site(11), "other": Site(30, first_kv_head=6)}
REQUESTS = (oracle.request_seed([1, 2, 3]), 0, 2**32 - 1)  # each batch row's request seed
# "ties": every row's keys are copies of 24 vectors, so that the top keys tie (the earlier key wins)
CASES = [("random", name) for name in SETTINGS] + [("ties", "between"), ("ties", "base")]


@functools.cache
def batch(kind: str):
    """key, value (3, Hkv, L, D): row b's logical key t at physical t + PADS[b], its padding and everything past its
    length large random data (never to be selected); query (r, Hq, D); rows, pos, pad (r,)."""
    gen = torch.Generator().manual_seed(1234 if kind == "random" else 5678)
    L = max(p + n for p, n in zip(PADS, LENGTHS, strict=True))
    key = 10 * torch.randn(len(PADS), HKV, L, DIM, generator=gen)
    value = 10 * torch.randn(len(PADS), HKV, L, DIM, generator=gen)
    for b, (p, n) in enumerate(zip(PADS, LENGTHS, strict=True)):
        if kind == "random":
            k = torch.randn(HKV, n, DIM, generator=gen)
        else:
            pool = torch.randn(HKV, 24, DIM, generator=gen)
            k = pool[:, torch.randint(24, (n,), generator=gen)]
        key[b, :, p:p + n] = k
        value[b, :, p:p + n] = torch.randn(HKV, n, DIM, generator=gen)
    rows = torch.tensor([r for r, _ in POSITIONS])
    pos = torch.tensor([t for _, t in POSITIONS])
    assert all(t < LENGTHS[r] for r, t in POSITIONS)
    pad = torch.tensor(PADS)[rows]
    query = torch.randn(len(POSITIONS), HQ, DIM, generator=gen)
    return key, value, query, rows, pos, pad


def logical(key: torch.Tensor, b: int) -> torch.Tensor:
    """Row b's real keys (or values), (Hkv, n, D), logical position t at index t."""
    return key[b, :, PADS[b]:PADS[b] + LENGTHS[b]]


@functools.cache
def references(kind: str, setting: str) -> list[oracle.Reference]:
    key, value, query, rows, pos, _ = batch(kind)
    site = SITES[setting]
    return [oracle.reference(query[i], logical(key, r), logical(value, r), t, **SETTINGS[setting],
                             request=REQUESTS[r], layer=site.layer, head_offset=site.first_kv_head)
            for i, (r, t) in enumerate(POSITIONS)]


def run_select(approx: VAttention, key, query, rows, pos, pad, row_pads, site=Site(0), requests=REQUESTS):
    """approx.select as the speculator calls it (each position's request seed, the layer's site); (index, valid,
    log_weight) with valid and the head dimension filled."""
    passed = approx.per_pass(pos, pad, key.shape[2], WINDOW, 1, seed=torch.tensor(requests)[rows])
    prepared = approx.prepare(key, row_pads, WINDOW, site=site)
    index, valid, log_weight = approx.select(query, key, rows, pos, pad, WINDOW, passed, prepared)
    if valid is None:
        valid = torch.ones_like(index, dtype=torch.bool)
    shape = (index.shape[0], key.shape[1], index.shape[-1])
    index, valid, log_weight = index.expand(shape), valid.expand(shape), log_weight.expand(shape)
    assert index.dtype == torch.long and valid.dtype == torch.bool and log_weight.dtype == torch.float32
    return index, valid, log_weight


@functools.cache
def engine(kind: str, setting: str):
    key, _, query, rows, pos, pad = batch(kind)
    return run_select(VAttention(**SETTINGS[setting]), key, query, rows, pos, pad, torch.tensor(PADS),
                      SITES[setting])


def selected(index, valid, log_weight, i: int, h: int, pad: int) -> dict[int, float]:
    """Position i's KV head h: logical key -> log-weight, for the valid entries."""
    keep = valid[i, h]
    return dict(zip((index[i, h][keep] - pad).tolist(), log_weight[i, h][keep].double().tolist(), strict=True))


def close(a: float, b: float) -> bool:
    """Equal to float32 rounding (log-weights are at most log(2000) ~ 7.6)."""
    return abs(a - b) <= 1e-6 * max(1.0, abs(b))


def test_the_reference_hash_is_lowbias32():
    """lowbias32 (Chris Wellons' hash-prospector): its known values, and a bijection on a sample of 32-bit words."""
    assert oracle.lowbias32(0) == 0
    # step by step for x = 1
    x = 1
    x ^= x >> 16
    x = x * 0x7FEB352D % 2**32
    x ^= x >> 15
    x = x * 0x846CA68B % 2**32
    x ^= x >> 16
    assert oracle.lowbias32(1) == x
    words = [(i * 2654435761) % 2**32 for i in range(5000)]
    assert len({oracle.lowbias32(w) for w in words}) == len(set(words))
    f = oracle.lowbias32
    assert oracle.priority(3, 9, 2, 5, 1, 7) == f(f(f(f(f(f(3) ^ 9) ^ 2) ^ 5) ^ 1) ^ 7)


@pytest.mark.parametrize("tokens", [[], [1, 2, 3], [0], [-1], [2**40, 7, 151_000], list(range(5000))])
def test_the_request_seed_is_the_reference_crc(tokens):
    """semantics.request_seed, the one both engines derive a request's seed with, is the reference's CRC-32."""
    assert semantics.request_seed(tokens) == oracle.request_seed(tokens)


def test_each_rows_seed_is_its_own_context():
    """A left-padded batch's request seeds (DecodeRegion.seeds, and a session's copy of them on its device): each
    row's CRC of its tokens from its first real token up to, not including, its speculation start; a region that
    gives no tokens is refused in one line."""
    from alspec_eval.config import SpeculationConfig
    from alspec_eval.plan import Plan
    from alspec_eval.region import DecodeRegion
    from alspec_eval.speculator import Session

    tokens = torch.tensor([[0, 0, 5, 6, 7, 8], [1, 2, 3, 4, 5, 6], [0, 9, 9, 8, 7, 6]])
    pad, start = [2, 0, 1], [5, 3, 6]
    region = DecodeRegion.build(pad, start, tokens=tokens)
    want = [oracle.request_seed(row[p:s]) for row, p, s in zip(tokens.tolist(), pad, start, strict=True)]
    assert region.seeds().tolist() == want and len(set(want)) == 3
    session = Session(SpeculationConfig(window=2), region, Plan.uniform([0.0], 3))
    assert session.seeds(torch.device("cpu")).tolist() == want
    with pytest.raises(ValueError, match="build it with tokens="):
        DecodeRegion.build(pad, start).seeds()


def test_draws_depend_on_the_layer_and_the_request():
    """Two layers, or two requests, with the same keys and queries sample other keys (the rest's order is their
    hash's); the same layer and request sample alike, whatever else the batch holds."""
    key, _, query, rows, pos, pad = batch("random")
    approx, pads = VAttention(**SETTINGS["between"]), torch.tensor(PADS)

    def sampled(site, requests):
        index, valid, log_weight = run_select(approx, key, query, rows, pos, pad, pads, site, requests)
        return [sorted(int(j) for j, w in zip(index[i, h], log_weight[i, h]) if w != 0)
                for i in range(len(POSITIONS)) for h in range(HKV)]

    first = sampled(Site(1), REQUESTS)
    assert sampled(Site(1), REQUESTS) == first
    assert sampled(Site(2), REQUESTS) != first
    other = sampled(Site(1), (REQUESTS[0] + 1, *REQUESTS[1:]))
    row0 = [i * HKV + h for i, (r, _) in enumerate(POSITIONS) for h in range(HKV) if r == 0]
    assert [other[k] for k in row0] != [first[k] for k in row0]
    assert [o for k, o in enumerate(other) if k not in row0] == [f for k, f in enumerate(first) if k not in row0]


def test_a_rank_holding_some_kv_heads_draws_as_the_whole_model():
    """Under tensor parallelism a rank's cache holds some KV heads: told the model's index of its first, it selects
    each of them as the whole model's selection does (the hash takes the model's head index, not the rank's)."""
    key, _, query, rows, pos, pad = batch("random")
    approx, pads = VAttention(**SETTINGS["between"]), torch.tensor(PADS)
    group = HQ // HKV
    whole = run_select(approx, key, query, rows, pos, pad, pads, Site(4))
    rank = run_select(approx, key[:, 1:], query[:, group:], rows, pos, pad, pads, Site(4, first_kv_head=1))
    local = run_select(approx, key[:, 1:], query[:, group:], rows, pos, pad, pads, Site(4))
    for got, want in zip(rank, whole, strict=True):
        assert torch.equal(got[:, 0], want[:, 1])
    assert not torch.equal(local[0][:, 0], whole[0][:, 1])  # the rank's own index would draw other keys


@pytest.mark.parametrize("setting", list(SETTINGS))
def test_the_cases_exercise_their_budgets(setting):
    """The reference's own budgets on the random batch are what each setting is for (so the tests below are not
    trivial): B = m, B = b, and strictly between for most rows."""
    heads = [h for ref in references("random", setting) for h in ref.heads if h.m > 0]
    assert heads and max(h.m for h in heads) > 1500
    assert any(h.m <= 10 for h in heads)  # a short context: few keys past the fixed ones
    if setting == "full":
        assert all(h.B == h.m for h in heads)
    elif setting == "base":
        assert all(h.B == h.b for h in heads) and max(h.b for h in heads) > 100
    else:
        between = [h for h in heads if h.b < h.B < h.m]
        assert len(between) >= len(heads) // 2
        assert len({h.B for h in between}) >= 5
    # m == 0 (the fixed keys hold the whole context) and p < 2S occur
    assert any(all(h.m == 0 for h in ref.heads) for ref in references("random", setting)) or setting == "other"


@pytest.mark.parametrize(("kind", "setting"), CASES)
def test_selection_matches_the_reference(kind, setting):
    """Per position and KV head: the same fixed keys (log-weight 0), the same sampled keys, the same log-weight
    log(m / B); never a key outside [pad, pad + pos], never one twice."""
    _, _, _, rows, pos, pad = batch(kind)
    index, valid, log_weight = engine(kind, setting)
    skipped, compared, errors = [], 0, []
    for i, (ref, (r, t)) in enumerate(zip(references(kind, setting), POSITIONS, strict=True)):
        p = PADS[r]
        for h, head in enumerate(ref.heads):
            where = f"row {r} (pad {p}) pos {t} KV head {h} (m {head.m}, b {head.b}, B {head.B})"
            phys = index[i, h][valid[i, h]].tolist()
            assert all(p <= x <= p + t for x in phys), f"{where}: a key outside [pad, pad + pos]: {sorted(phys)[-5:]}"
            assert len(set(phys)) == len(phys), f"{where}: a key selected twice"
            assert all(math.isfinite(w) for w in log_weight[i, h][valid[i, h]].tolist()), f"{where}: a weight not finite"
            if head.on_rounding_edge(EDGE):
                skipped.append(where)
                continue
            compared += 1
            got = selected(index, valid, log_weight, i, h, p)
            want = head.weights()
            if head.log_weight == 0.0:  # B == m (or m == 0): every key of the context, all of weight 1
                if set(got) != set(want):
                    errors.append(f"{where}: keys differ: engine only {sorted(set(got) - set(want))[:8]}, "
                                  f"reference only {sorted(set(want) - set(got))[:8]}")
                elif not all(close(w, 0.0) for w in got.values()):
                    errors.append(f"{where}: a log-weight not 0 where B = m")
                continue
            fixed = {j for j, w in got.items() if close(w, 0.0)}
            sample = set(got) - fixed
            if fixed != set(head.fixed):
                errors.append(f"{where}: fixed keys (log-weight 0) differ: engine only {sorted(fixed - set(head.fixed))[:8]}"
                              f", reference only {sorted(set(head.fixed) - fixed)[:8]}")
            if sample != set(head.sample):
                errors.append(f"{where}: sampled keys differ ({len(sample)} vs B = {head.B}): engine only "
                              f"{sorted(sample - set(head.sample))[:8]}, reference only {sorted(set(head.sample) - sample)[:8]}"
                              f"; pre-ceil budgets {head.budgets}")
            bad = {j: w for j, w in got.items() if j in sample and not close(w, head.log_weight)}
            if bad:
                errors.append(f"{where}: sampled keys' log-weights {sorted(set(bad.values()))[:3]} != "
                              f"log(m / B) = {head.log_weight}")
    assert not errors, "\n".join(errors[:20])
    assert len(skipped) <= MAX_SKIPPED, skipped
    assert compared >= 2 * len(POSITIONS) - MAX_SKIPPED


def gather(cache: torch.Tensor, rows: torch.Tensor, index: torch.Tensor, valid: torch.Tensor, pad: torch.Tensor):
    """cache[rows[i], h, index[i, h, k]] as (r, Hkv, N, D); invalid entries read the row's first key."""
    safe = torch.where(valid, index, pad[:, None, None])
    return torch.gather(cache[rows], 2, safe[..., None].expand(-1, -1, -1, cache.shape[-1]))


def engine_output(kind: str, setting: str, weighted: bool = True) -> torch.Tensor:
    """A~ of every position as an engine computes it: the selected keys and values, semantics.attend, the
    log-weights as the bias (or none); (r, Hq, D)."""
    key, value, query, rows, _, pad = batch(kind)
    index, valid, log_weight = engine(kind, setting)
    bias = torch.where(valid, log_weight, 0.0)[:, :, None, :] if weighted else None
    out = semantics.attend(query[:, None], gather(key, rows, index, valid, pad), gather(value, rows, index, valid, pad),
                           valid[:, :, None, :], SCALE, bias=bias)
    return out[:, 0].double()


@pytest.mark.parametrize(("kind", "setting"), CASES)
def test_output_matches_the_reference(kind, setting):
    """semantics.attend on the selection, with the log-weights as the bias, gives the reference's float64 A~ to 1e-5
    (relative to its norm); with the weights dropped it does not (where any key weighs m / B > 1)."""
    refs = references(kind, setting)
    weighted, unweighted = engine_output(kind, setting), engine_output(kind, setting, weighted=False)
    checked, differ, weighed = 0, 0, 0
    for i, ref in enumerate(refs):
        if any(h.on_rounding_edge(EDGE) for h in ref.heads):
            continue
        want = torch.tensor(ref.output, dtype=torch.float64)
        err = (weighted[i] - want).norm() / want.norm()
        assert err <= 1e-5, f"position {POSITIONS[i]}: ||A~ - reference|| / ||reference|| = {err:.3g}"
        checked += 1
        if any(h.log_weight > 0 for h in ref.heads):
            weighed += 1
            differ += bool((unweighted[i] - want).norm() / want.norm() > 1e-3)
    assert checked >= len(refs) - MAX_SKIPPED
    if setting == "full":
        assert weighed == 0
    else:
        assert weighed >= len(refs) // 2 and differ == weighed, (differ, weighed)


def test_reference_denominator_and_output_agree():
    """The reference's own D~ is the denominator of its A~ (sum_F e + (m / B) sum_sample e), computed apart here in
    numpy from its key sets."""
    key, value, query, rows, pos, _ = batch("random")
    for ref, (i, (r, t)) in zip(references("random", "between"), enumerate(POSITIONS), strict=True):
        K = logical(key, r).double().numpy()
        V = logical(value, r).double().numpy()
        q = query[i].double().numpy()
        for g in range(HQ):
            head = ref.heads[g // (HQ // HKV)]
            s = SCALE * K[g // (HQ // HKV), :t + 1] @ q[g]
            e = np.exp(s - s.max())
            w = np.zeros(t + 1)
            w[head.fixed] = 1.0
            if head.B:
                w[head.sample] = head.m / head.B
            assert math.isclose(ref.D[g], e.sum(), rel_tol=1e-12)
            assert math.isclose(ref.D_tilde[g], (w * e).sum(), rel_tol=1e-12)
            out = (w * e) @ V[g // (HQ // HKV), :t + 1] / (w * e).sum()
            np.testing.assert_allclose(ref.output[g], out, rtol=1e-10, atol=1e-12)
            assert len(head.fixed) + head.m == t + 1 and len(head.sample) == head.B


@pytest.mark.parametrize("epsilon", [0.005, 0.02, 0.08])
def test_the_denominator_measure_is_the_references_missed_share(epsilon):
    """What the engines record where a draft promises its denominator (semantics.denominator_exceeded): per position,
    the share of query heads with |D~ - D| > epsilon D, equal to the reference's own D~ and D (float64) but where a
    head sits within 1e-6 of the threshold."""
    key, _, query, rows, pos, pad = batch("random")
    index, valid, log_weight = engine("random", "between")
    span = torch.arange(key.shape[2])
    allowed = (span >= pad[:, None]) & (span <= (pad + pos)[:, None])
    got = semantics.denominator_exceeded(query, key[rows], allowed, index, valid, log_weight, SCALE, epsilon)
    compared, shares = 0, set()
    for i, ref in enumerate(references("random", "between")):
        errors = [abs(t - d) / d for t, d in zip(ref.D_tilde, ref.D, strict=True)]
        if any(abs(e - epsilon) < 1e-6 for e in errors):
            continue
        want = sum(e > epsilon for e in errors) / HQ
        assert got[i].item() == pytest.approx(want), (i, errors)
        compared, shares = compared + 1, shares | {want}
    assert compared >= len(POSITIONS) - 2 and len(shares) >= 2  # both sides of the threshold among the rows


# ---------------------------------------------------------------- the promise: many keys, random attention

PROMISE_PADS = (0, 23)
PROMISE_LENGTHS = (4000, 3950)
PROMISE_POSITIONS = tuple((b, t) for b, n in enumerate(PROMISE_LENGTHS) for t in range(n - 300, n, 6))  # 100


@functools.cache
def promise_batch():
    gen = torch.Generator().manual_seed(97)
    L = max(p + n for p, n in zip(PROMISE_PADS, PROMISE_LENGTHS, strict=True))
    key = 10 * torch.randn(len(PROMISE_PADS), HKV, L, DIM, generator=gen)
    for b, (p, n) in enumerate(zip(PROMISE_PADS, PROMISE_LENGTHS, strict=True)):
        key[b, :, p:p + n] = torch.randn(HKV, n, DIM, generator=gen)
    rows = torch.tensor([b for b, _ in PROMISE_POSITIONS])
    pos = torch.tensor([t for _, t in PROMISE_POSITIONS])
    pad = torch.tensor(PROMISE_PADS)[rows]
    query = 1.5 * torch.randn(len(PROMISE_POSITIONS), HQ, DIM, generator=gen)  # softmax's largest p ~ 0.04
    return key, query, rows, pos, pad


@pytest.mark.parametrize("params", [dict(epsilon=0.1, delta=0.1), dict(epsilon=0.05, delta=0.2, seed=7)])
def test_denominator_error_within_epsilon_with_probability_one_minus_delta(params):
    """D~_g = sum over the selection of exp(log-weight) e_gj against D_g = sum of e_gj over all n keys, float64 from
    the engine's selection: |D~ - D| > eps D in at most a delta share of the (position, query head) pairs (one-sided
    binomial test); the budget varies and stays below m for most rows."""
    approx = VAttention(**params)
    eps, delta = approx.epsilon, approx.delta
    key, query, rows, pos, pad = promise_batch()
    index, valid, log_weight = run_select(approx, key, query, rows, pos, pad, torch.tensor(PROMISE_PADS))
    fixed = approx.sink + approx.local + approx.top  # disjoint at these contexts
    up = down = pairs = 0
    budgets, below = [], 0
    keys = key.double().numpy()
    for i, (b, t) in enumerate(PROMISE_POSITIONS):
        n, m = t + 1, t + 1 - fixed
        for h in range(HKV):
            keep = valid[i, h]
            phys = index[i, h][keep].numpy()
            assert phys.min() >= PROMISE_PADS[b] and phys.max() <= PROMISE_PADS[b] + t
            weight = np.exp(log_weight[i, h][keep].double().numpy())
            sampled = int((weight > 1 + 1e-6).sum())
            B = sampled or m
            assert len(phys) == fixed + B
            budgets.append(B)
            below += B < m
            K = keys[b, h, PROMISE_PADS[b]:PROMISE_PADS[b] + n]
            for g in range(h * (HQ // HKV), (h + 1) * (HQ // HKV)):
                s = SCALE * K @ query[i, g].double().numpy()
                e = np.exp(s - s.max())
                D = e.sum()
                D_tilde = (weight * e[phys - PROMISE_PADS[b]]).sum()
                rel = (D_tilde - D) / D
                pairs += 1
                up += rel > eps
                down += rel < -eps
    assert pairs >= 200
    assert len(set(budgets)) >= 20 and below >= 0.9 * len(budgets), (sorted(set(budgets)), below)
    p_value = binomtest(up + down, pairs, delta, alternative="greater").pvalue
    assert p_value > 1e-3, f"|D~ - D| > eps D in {up + down} of {pairs} pairs (> delta = {delta}: p = {p_value:.2g})"


@pytest.mark.parametrize("share", [0.0, 0.1, 0.5, 1.0])
def test_the_chosen_keys_come_first_as_a_stable_sort_puts_them(share):
    """The selection's slots (the chosen keys first, each part in key order) are those of a stable sort of the
    chosen mask, at every share of keys chosen, none and all among them."""
    from alspec_eval.approximations.vattention import _chosen_first

    chosen = torch.rand(5, 3, 257, generator=torch.Generator().manual_seed(0)) < share
    want = chosen.to(torch.int8).sort(dim=-1, descending=True, stable=True).indices
    assert torch.equal(_chosen_first(chosen), want)

