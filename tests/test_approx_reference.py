"""The approximations (sink, quest, topk) against an independent reference (approx_oracle.py): first the reference
against its own rules, then the d/n ratios the speculator records at lambda 0 against the reference evaluated on
the plain model's own query/key/value (captured through a registered attention function), with and without left
padding."""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn.functional as F
from transformers import AttentionInterface, DynamicCache
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

import approx_oracle as oracle
from alspec_eval.approx_check.models import tiny_model
from alspec_eval.compat import with_cache
from alspec_eval.region import DecodeRegion
from helpers import PROMPTS, TOKENIZER, alspec_lm

pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore")]

WINDOW = 8
PAGE = 4
START = 40
FAMILIES = ["llama", "qwen2"]
TEXT = (PROMPTS[0] + ", " + PROMPTS[1])[:100]


def _random_case(seed: int, hq: int = 4, hkv: int = 2, length: int = 60, d: int = 16):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(hq, d, generator=gen)
    K = torch.randn(hkv, length, d, generator=gen)
    V = torch.randn(hkv, length, d, generator=gen)
    return q, K, V


# ---------------------------------------------------------------- the reference against its own rules


@pytest.mark.parametrize("approx", oracle.APPROXES)
def test_trivial_positions_keep_everything(approx):
    q, K, V = _random_case(0)
    for pos in range(2 * WINDOW):
        assert oracle.kept_keys(q, K, pos, WINDOW, approx, page=PAGE) == [list(range(pos + 1))] * 2
        assert oracle.ratio(q, K, V, pos, WINDOW, approx, 0.25, page=PAGE) == 0.0
    assert oracle.kept_keys(q, K, 2 * WINDOW, WINDOW, approx, page=PAGE) != [list(range(2 * WINDOW + 1))] * 2


def test_sink_keeps_the_first_and_last_window():
    q, K, _ = _random_case(1)
    for pos in range(2 * WINDOW, 60):
        expected = list(range(WINDOW)) + list(range(pos - WINDOW + 1, pos + 1))
        assert oracle.kept_keys(q, K, pos, WINDOW, "sink") == [expected, expected]


def test_invalid_quest_pages_raise():
    q, K, _ = _random_case(2)
    for page in (0, -4, 3, 5, 16, 32):  # 2S % P != 0, or P > S, or no page at all
        with pytest.raises(ValueError):
            oracle.kept_keys(q, K, 30, WINDOW, "quest", page=page)
    for page in (1, 2, 4, 8):
        oracle.kept_keys(q, K, 30, WINDOW, "quest", page=page)
    with pytest.raises(ValueError):
        oracle.kept_keys(q, K, 30, WINDOW, "nope")


@pytest.mark.parametrize("seed", range(4))
def test_quest_bound_is_an_upper_bound(seed):
    q, K, _ = _random_case(seed, hq=6, hkv=2)  # g = 3
    g = 3
    for pos in (20, 37, 59):
        bounds = oracle.quest_page_bounds(q, K, pos, PAGE)
        assert sorted(j for kvh, j in bounds if kvh == 0) == list(range(1, pos // PAGE))
        for (kvh, j), bound in bounds.items():
            keys = K[kvh, j * PAGE:(j + 1) * PAGE].double()
            for h in range(kvh * g, (kvh + 1) * g):
                assert bound >= float((keys @ q[h].double()).max()) - 1e-9
            # the bound of the group is the largest head's bound: some head's per-channel bound attains it
            mn, mx = keys.amin(0), keys.amax(0)
            best = max(float(torch.maximum(q[h].double() * mn, q[h].double() * mx).sum())
                       for h in range(kvh * g, (kvh + 1) * g))
            assert bound == pytest.approx(best, rel=1e-12, abs=1e-12)


@pytest.mark.parametrize("page", [1, 2, 4, 8])
def test_quest_keeps_sink_page_current_page_and_the_best_bounds(page):
    q, K, _ = _random_case(5)
    m = 2 * WINDOW // page - 2
    for pos in range(2 * WINDOW, 60):
        kept = oracle.kept_keys(q, K, pos, WINDOW, "quest", page=page)
        bounds = oracle.quest_page_bounds(q, K, pos, page)
        cur = pos // page
        for kvh, keys in enumerate(kept):
            assert len(keys) <= 2 * WINDOW and keys == sorted(set(keys)) and max(keys) == pos
            assert set(range(page)) | set(range(cur * page, pos + 1)) <= set(keys)
            chosen = {t // page for t in keys} - {0, cur}
            assert len(chosen) == min(m, cur - 1)
            for j in chosen:  # whole pages only
                assert set(range(j * page, (j + 1) * page)) <= set(keys)
            others = set(range(1, cur)) - chosen
            if chosen and others:
                assert min(bounds[kvh, j] for j in chosen) >= max(bounds[kvh, j] for j in others)


def test_quest_ties_take_the_smaller_page():
    q, K, _ = _random_case(6)
    K = torch.zeros_like(K)  # every bound 0
    pos = 50
    kept = oracle.kept_keys(q, K, pos, WINDOW, "quest", page=PAGE)
    m = 2 * WINDOW // PAGE - 2  # 2 pages: 1 and 2
    assert kept == [list(range((m + 1) * PAGE)) + list(range(pos // PAGE * PAGE, pos + 1))] * 2
    # a page whose keys align with every query head wins for that KV head only
    K[1, 9 * PAGE + 2] = 5 * q[2:4].sum(0)
    kept = oracle.kept_keys(q, K, pos, WINDOW, "quest", page=PAGE)
    assert set(range(9 * PAGE, 10 * PAGE)) <= set(kept[1]) and not set(range(9 * PAGE, 10 * PAGE)) & set(kept[0])


@pytest.mark.parametrize("seed", range(4))
def test_topk_keeps_the_largest_scores(seed):
    q, K, _ = _random_case(seed, hq=4, hkv=2)
    for pos in (16, 31, 59):
        kept = oracle.kept_keys(q, K, pos, WINDOW, "topk")
        for kvh in range(2):
            scores = (K[kvh, :pos + 1].double() @ q[2 * kvh:2 * kvh + 2].double().T).max(-1).values
            order = torch.sort(-scores, stable=True).indices  # descending, smaller index first on ties
            assert kept[kvh] == sorted(order[:2 * WINDOW].tolist())
            inside = scores[kept[kvh]]
            outside = scores[[t for t in range(pos + 1) if t not in kept[kvh]]]
            assert len(kept[kvh]) == 2 * WINDOW and inside.min() >= outside.max()


def test_topk_ties_take_the_smaller_position():
    q, K, _ = _random_case(7)
    K = torch.ones_like(K)
    assert oracle.kept_keys(q, K, 40, WINDOW, "topk") == [list(range(2 * WINDOW))] * 2


def test_local_keeps_exactly_the_last_2s():
    q, K, _ = _random_case(11)
    for pos in range(2 * WINDOW, 60):
        expected = list(range(pos - 2 * WINDOW + 1, pos + 1))
        assert oracle.kept_keys(q, K, pos, WINDOW, "local") == [expected, expected]
    for pos in range(2 * WINDOW):  # trivial: everything
        assert oracle.kept_keys(q, K, pos, WINDOW, "local") == [list(range(pos + 1))] * 2


def _snapkv_case(seed: int, hq: int = 4, hkv: int = 2, length: int = 60, d: int = 16):
    """The decode query q plus the queries of every position (prompt queries included), keys and values."""
    gen = torch.Generator().manual_seed(seed)
    Q = torch.randn(hq, length, d, generator=gen)
    K = torch.randn(hkv, length, d, generator=gen)
    V = torch.randn(hkv, length, d, generator=gen)
    return Q, K, V


def test_snapkv_pooling_at_the_edges_divides_by_k():
    assert oracle.snapkv_pool([1.0, 2.0, 3.0, 4.0], 3) == pytest.approx([3 / 3, 6 / 3, 9 / 3, 7 / 3], abs=0)
    assert oracle.snapkv_pool([1.0, 2.0, 3.0, 4.0], 5) == pytest.approx([6 / 5, 10 / 5, 10 / 5, 9 / 5], abs=0)
    assert oracle.snapkv_pool([2.0], 7) == [2.0 / 7]
    assert oracle.snapkv_pool([1.0, 5.0], 1) == [1.0, 5.0]
    gen = torch.Generator().manual_seed(12)
    for n in (1, 2, 5, 13):
        raw = torch.rand(n, generator=gen, dtype=torch.float64)
        for k in (1, 3, 5, 7, 9):
            expected = F.avg_pool1d(raw[None, None], k, stride=1, padding=k // 2, count_include_pad=True)[0, 0]
            assert oracle.snapkv_pool(raw.tolist(), k) == pytest.approx(expected.tolist(), rel=1e-12, abs=1e-15)
    # end to end: a constant raw score pools to less at the edges (fewer real neighbours, still divided by k)
    Q, K, _ = _snapkv_case(13, hq=1, hkv=1, d=2)
    K = torch.zeros_like(K)  # uniform attention: raw[t] = sum over q of 1 / (q + 1), the same for every t
    scores = oracle.snapkv_prompt_scores(Q, K, 20, 4, 5, 1.0)[0]
    raw = sum(1 / (q + 1) for q in range(16, 20))
    assert scores[:16] == pytest.approx([3 * raw / 5, 4 * raw / 5] + [raw] * 12 + [4 * raw / 5, 3 * raw / 5],
                                        rel=1e-12)
    assert scores[16:] == [math.inf] * 4


@pytest.mark.parametrize("seed", range(3))
def test_snapkv_scores_equal_torch(seed):
    """The prompt scores against a batched torch computation (causal softmax, group sum, avg_pool1d)."""
    Q, K, _ = _snapkv_case(seed, hq=6, hkv=2)  # g = 3
    scaling = 16 ** -0.5
    for prompt_len, observe, pool in ((30, 8, 5), (30, 1, 1), (17, 4, 7), (5, 8, 3), (12, 12, 3), (40, 3, 9)):
        w = min(observe, prompt_len)
        lo = prompt_len - w
        scores = oracle.snapkv_prompt_scores(Q, K, prompt_len, observe, pool, scaling)
        obs_only = oracle.snapkv_prompt_scores(Q[:, lo:prompt_len], K, prompt_len, observe, pool, scaling)
        assert scores == obs_only
        for kvh in range(2):
            assert len(scores[kvh]) == prompt_len and scores[kvh][lo:] == [math.inf] * w
            if lo == 0:
                continue
            raw = torch.zeros(lo, dtype=torch.float64)
            for h in range(3 * kvh, 3 * kvh + 3):
                logits = scaling * Q[h, lo:prompt_len].double() @ K[kvh, :prompt_len].double().T  # (w, P)
                causal = torch.arange(prompt_len)[None, :] > torch.arange(lo, prompt_len)[:, None]
                raw += logits.masked_fill(causal, -math.inf).softmax(-1).sum(0)[:lo]
            pooled = F.avg_pool1d(raw[None, None], pool, stride=1, padding=pool // 2, count_include_pad=True)[0, 0]
            assert scores[kvh][:lo] == pytest.approx(pooled.tolist(), rel=1e-10, abs=1e-14)


def test_snapkv_keeps_the_newest_recent_always():
    Q, K, _ = _snapkv_case(14)
    prompt_len = 30
    scores = oracle.snapkv_prompt_scores(Q, K, prompt_len, 6, 3, 0.25)
    for recent in (1, 4, 8, 15):
        for pos in range(prompt_len, 60):
            kept = oracle.snapkv_kept_keys(scores, pos, prompt_len, WINDOW, recent)
            newest = set(range(pos - recent + 1, pos + 1))
            for kvh, keys in enumerate(kept):
                assert keys == sorted(set(keys)) and len(keys) == 2 * WINDOW and max(keys) == pos
                assert newest <= set(keys)
                others = set(keys) - newest
                assert all(t < prompt_len for t in others)  # the rest are prompt keys
                rest = [t for t in range(min(prompt_len, pos - recent + 1)) if t not in others]
                if rest:
                    assert min(scores[kvh][t] for t in others) >= max(scores[kvh][t] for t in rest)


def test_snapkv_observation_window_outranks_everything():
    Q, K, _ = _snapkv_case(15, hq=2, hkv=1, d=4)
    prompt_len, observe = 30, 4
    K[0, 3] = 50 * Q[0, 26:30].sum(0)  # key 3 takes nearly all of the observation queries' attention
    scores = oracle.snapkv_prompt_scores(Q, K, prompt_len, observe, 1, 1.0)[0]
    assert max(range(26), key=lambda t: scores[t]) == 3 and scores[3] > 3.9  # head 0's 4 queries alone give ~4
    assert scores[26:] == [math.inf] * 4
    for pos in (40, 50, 59):  # 2S - R = 12 prompt slots: the window first, then key 3
        kept = oracle.snapkv_kept_keys([scores], pos, prompt_len, WINDOW, 4)[0]
        assert set(range(26, 30)) | {3} <= set(kept)
    # 2S - R = 2 slots < w = 4: the two smallest window positions (ties between +inf), not key 3
    assert oracle.snapkv_kept_keys([scores], 50, prompt_len, WINDOW, 14)[0] == [26, 27] + list(range(37, 51))
    # the newest R = 3 cover part of the window: of the 13 slots, 26..28 first, then key 3 and the next best 9
    best = sorted(range(26), key=lambda t: (-scores[t], t))
    assert best[0] == 3
    assert oracle.snapkv_kept_keys([scores], 31, prompt_len, WINDOW, 3)[0] == \
        sorted({26, 27, 28} | set(range(29, 32)) | set(best[:10]))


def test_snapkv_hand_built_case():
    """P = 10, w = 3 (observation queries at 7, 8, 9, all q = [1, 0]), k = 3, S = 3 (2S = 6), R = 2, one KV
    head, one query head, D = 2, scaling 1. Keys K[t] = [x_t, 0] with x = [2, 0, 10, 1, -3, 4, 0, 0, 0, 0], so the
    logit of key t is x_t and key 2 takes almost all attention. With E = e^10, each observation query gives key 2
    about 1 (0.997), key t != 2 about e^{x_t} / E; summed over the 3 queries (eps = 3 / E ~ 1.36e-4):
        raw ~ [7.39 eps, eps, 3, 2.72 eps, 0.05 eps, 54.6 eps, eps]             (t = 0..6)
    pooled * 3 (zero padding at both ends, always divided by 3):
        t=0: raw0 + raw1            ~ 8.39 eps
        t=1: raw0 + raw1 + raw2     ~ 3 + 8.39 eps    <- first
        t=2: raw1 + raw2 + raw3     ~ 3 + 3.72 eps    <- second
        t=3: raw2 + raw3 + raw4     ~ 3 + 2.77 eps    <- third
        t=4: raw3 + raw4 + raw5     ~ 57.4 eps
        t=5: raw4 + raw5 + raw6     ~ 55.7 eps
        t=6: raw5 + raw6            ~ 55.6 eps
    and keys 7, 8, 9 score +inf. 2S - R = 4 prompt slots:
        pos = 10: newest {9, 10}; slots: 7, 8 (+inf), then 1, 2         -> [1, 2, 7, 8, 9, 10]
        pos = 11: newest {10, 11}; slots: 7, 8, 9 (+inf), then 1        -> [1, 7, 8, 9, 10, 11]
        pos = 14: newest {13, 14}; the same 4 prompt slots              -> [1, 7, 8, 9, 13, 14]
    (key 1 outranks key 2, the key with the attention: pooling gives it key 0's and key 2's scores).
    """
    x = [2.0, 0.0, 10.0, 1.0, -3.0, 4.0, 0.0, 0.0, 0.0, 0.0]
    K = torch.tensor([[[v, 0.0] for v in x] + [[0.5, 0.5]] * 6], dtype=torch.float64)  # 6 decode keys 10..15
    obs_q = [[[1.0, 0.0]] * 3]
    scores = oracle.snapkv_prompt_scores(obs_q, K, 10, 3, 3, 1.0)
    E = math.exp(10)
    raw = [sum(math.exp(x[t]) / sum(math.exp(v) for v in x[:q + 1]) for q in (7, 8, 9)) for t in range(7)]
    assert raw[2] == pytest.approx(3, abs=2e-2) and raw[1] == pytest.approx(3 / E, rel=1e-2)
    padded = [0.0] + raw + [0.0]
    assert scores[0][:7] == pytest.approx([sum(padded[t:t + 3]) / 3 for t in range(7)], rel=1e-12)
    assert scores[0][1] > scores[0][2] > scores[0][3] > max(scores[0][t] for t in (0, 4, 5, 6))
    assert scores[0][7:] == [math.inf] * 3
    assert oracle.snapkv_kept_keys(scores, 10, 10, 3, 2) == [[1, 2, 7, 8, 9, 10]]
    assert oracle.snapkv_kept_keys(scores, 11, 10, 3, 2) == [[1, 7, 8, 9, 10, 11]]
    assert oracle.snapkv_kept_keys(scores, 14, 10, 3, 2) == [[1, 7, 8, 9, 13, 14]]
    for pos in range(6):  # trivial
        assert oracle.snapkv_kept_keys(scores, pos, 10, 3, 2) == [list(range(pos + 1))]


def test_snapkv_with_fewer_prompt_keys_than_slots_keeps_them_all():
    Q, K, _ = _snapkv_case(16)
    scores = oracle.snapkv_prompt_scores(Q, K, 3, 8, 3, 0.25)
    assert scores == [[math.inf] * 3] * 2  # w = min(8, 3) = 3: the whole prompt is the observation window
    for pos in (16, 30, 59):
        assert oracle.snapkv_kept_keys(scores, pos, 3, WINDOW, 4) == [[0, 1, 2] + list(range(pos - 3, pos + 1))] * 2
    scores = oracle.snapkv_prompt_scores(Q, K, 9, 2, 3, 0.25)  # window 7, 8; keys 0..6 pooled scores
    for pos in (16, 30, 59):  # 2S - R = 12 slots, 9 prompt keys: all of them, 13 keys in all
        expected = list(range(9)) + list(range(pos - 3, pos + 1))
        assert oracle.snapkv_kept_keys(scores, pos, 9, WINDOW, 4) == [expected, expected]
    # pos 20, R = 12: newest 9..20; 4 slots for the 9 prompt keys: the window 7, 8 and the best 2 of 0..6
    for kvh, keys in enumerate(oracle.snapkv_kept_keys(scores, 20, 9, WINDOW, 12)):
        best = sorted(range(7), key=lambda t: (-scores[kvh][t], t))[:2]
        assert keys == sorted(best) + [7, 8] + list(range(9, 21))
    # pos 16, R = 12: newest 5..16 (the window among them); 4 slots for the 5 candidates 0..4: the best 4
    for kvh, keys in enumerate(oracle.snapkv_kept_keys(scores, 16, 9, WINDOW, 12)):
        best = sorted(range(5), key=lambda t: (-scores[kvh][t], t))[:4]
        assert keys == sorted(best) + list(range(5, 17))


def test_snapkv_invalid_parameters_raise():
    Q, K, _ = _snapkv_case(17)
    scores = oracle.snapkv_prompt_scores(Q, K, 20, 4, 3, 0.25)
    for pool in (0, 2, 4, -1, True):
        with pytest.raises(ValueError):
            oracle.snapkv_prompt_scores(Q, K, 20, 4, pool, 0.25)
    for observe in (0, -3):
        with pytest.raises(ValueError):
            oracle.snapkv_prompt_scores(Q, K, 20, observe, 3, 0.25)
    with pytest.raises(ValueError):
        oracle.snapkv_prompt_scores(Q, K, 0, 4, 3, 0.25)
    for recent in (0, 2 * WINDOW, 2 * WINDOW + 1):
        with pytest.raises(ValueError):
            oracle.snapkv_kept_keys(scores, 30, 20, WINDOW, recent)
    for args in ((0, 3, 4), (4, 2, 4), (4, 3, 0), (4, 3, 2 * WINDOW)):
        with pytest.raises(ValueError):
            oracle.check_snapkv(WINDOW, *args)
    oracle.check_snapkv(WINDOW, 1, 1, 1)
    oracle.check_snapkv(WINDOW, 64, 7, 2 * WINDOW - 1)
    with pytest.raises(ValueError):  # a non-trivial position inside the prompt
        oracle.snapkv_kept_keys(scores, 18, 20, WINDOW, 4)


def test_snapkv_output_equals_masked_sdpa():
    Q, K, V = _snapkv_case(18)
    scaling = 16 ** -0.5
    prompt_len = 25
    scores = oracle.snapkv_prompt_scores(Q, K, prompt_len, 5, 3, scaling)
    Kr, Vr = K.double().repeat_interleave(2, 0), V.double().repeat_interleave(2, 0)
    for pos in (10, 25, 41, 59):
        q = Q[:, pos]
        kept = oracle.snapkv_kept_keys(scores, pos, prompt_len, WINDOW, 6)
        mask = torch.zeros(4, 1, K.shape[1], dtype=torch.bool)
        for h in range(4):
            mask[h, 0, kept[h // 2]] = True
        expected = F.scaled_dot_product_attention(q.double()[:, None], Kr, Vr, attn_mask=mask, scale=scaling)[:, 0]
        got = oracle.snapkv_output(q, K, V, pos, scores, prompt_len, WINDOW, 6, scaling)
        assert torch.allclose(got, expected, rtol=1e-10, atol=1e-12)
        ratio = oracle.snapkv_ratio(q, K, V, pos, scores, prompt_len, WINDOW, 6, scaling)
        assert (ratio == 0.0) == oracle.is_trivial(pos, WINDOW) and ratio >= 0.0


@pytest.mark.parametrize("approx", oracle.APPROXES)
def test_keys_past_pos_are_never_read(approx):
    q, K, V = _random_case(8, length=45)
    gen = torch.Generator().manual_seed(9)
    garbage_k = 1e3 * torch.randn(2, 30, 16, generator=gen)
    garbage_v = 1e3 * torch.randn(2, 30, 16, generator=gen)
    for pos in (17, 30, 33, 44):  # 33: inside a page
        short_k, short_v = K[:, :pos + 1], V[:, :pos + 1]
        long_k, long_v = torch.cat([short_k, garbage_k], 1), torch.cat([short_v, garbage_v], 1)
        assert oracle.kept_keys(q, long_k, pos, WINDOW, approx, page=PAGE) == \
            oracle.kept_keys(q, short_k, pos, WINDOW, approx, page=PAGE)
        assert oracle.ratio(q, long_k, long_v, pos, WINDOW, approx, 0.25, page=PAGE) == \
            oracle.ratio(q, short_k, short_v, pos, WINDOW, approx, 0.25, page=PAGE)


@pytest.mark.parametrize("approx", oracle.APPROXES)
def test_outputs_equal_masked_sdpa(approx):
    """A and A~ against torch's attention with a boolean mask over the kept keys (repeat_kv for GQA)."""
    q, K, V = _random_case(10)
    scaling = 16 ** -0.5
    Kr, Vr = K.double().repeat_interleave(2, 0), V.double().repeat_interleave(2, 0)
    for pos in (10, 20, 41, 59):
        kept = oracle.kept_keys(q, K, pos, WINDOW, approx, page=PAGE)
        mask = torch.zeros(4, 1, K.shape[1], dtype=torch.bool)
        for h in range(4):
            mask[h, 0, kept[h // 2]] = True
        causal = torch.zeros(4, 1, K.shape[1], dtype=torch.bool)
        causal[..., :pos + 1] = True
        expected = F.scaled_dot_product_attention(q.double()[:, None], Kr, Vr, attn_mask=mask, scale=scaling)[:, 0]
        exact = F.scaled_dot_product_attention(q.double()[:, None], Kr, Vr, attn_mask=causal, scale=scaling)[:, 0]
        ours = oracle.approx_output(q, K, V, pos, WINDOW, approx, scaling, page=PAGE)
        torch.testing.assert_close(ours, expected, rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(oracle.exact_output(q, K, V, pos, scaling), exact, rtol=1e-10, atol=1e-12)
        assert oracle.ratio(q, K, V, pos, WINDOW, approx, scaling, page=PAGE) == pytest.approx(
            float((expected - exact).norm() / exact.norm()), rel=1e-9, abs=1e-12)


# ---------------------------------------------------------------- the speculator against the reference

CAPTURE = "alspec_reference_capture"
_CALLS: list[tuple[int, torch.Tensor, torch.Tensor, torch.Tensor, float]] = []


def _capture(module, query, key, value, attention_mask, scaling=None, **kwargs):
    _CALLS.append((module.layer_idx, query.detach().clone(), key.detach().clone(), value.detach().clone(),
                   module.scaling if scaling is None else scaling))
    return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, **kwargs)


AttentionInterface.register(CAPTURE, _capture)
AttentionMaskInterface.register(CAPTURE, sdpa_mask)


def _plain_layers(model, ids, **kwargs):
    """Per layer, the (query, key, value, scaling) the plain model's attention receives: (B, H, T, D) each."""
    plain = copy.deepcopy(model)
    plain.set_attn_implementation(CAPTURE)
    assert plain.config._attn_implementation == CAPTURE
    _CALLS.clear()
    with torch.no_grad():
        plain(ids, **kwargs)
    calls = list(_CALLS)
    _CALLS.clear()
    assert [c[0] for c in calls] == list(range(model.config.num_hidden_layers))
    return [c[1:] for c in calls]


def _speculator_ratios(model, approx, ids, region, **kwargs):
    args = {"window": WINDOW, "approx": approx, "lambda": 0.0}
    if approx == "quest":
        args["approx_args"] = f"page:{PAGE}"
    spec = alspec_lm(model, **args)
    with torch.no_grad(), spec.speculator.speculating(region, spec.spec_config) as trace:
        spec.model(ids, **kwargs)
    assert trace.offset == 0
    return trace.ratios


def _oracle_ratios(layers, row, pad, approx, start, end):
    """Reference ratios (positions start..end-1 logical, layers) of batch row ``row`` whose real tokens begin at
    physical index ``pad``: the reference sees only the row's unpadded sequence."""
    out = torch.full((end - start, len(layers)), math.nan, dtype=torch.float64)
    for layer, (query, key, value, scaling) in enumerate(layers):
        K, V = key[row, :, pad:], value[row, :, pad:]
        for pos in range(start, end):
            q = query[row, :, pad + pos]
            out[pos - start, layer] = oracle.ratio(q, K, V, pos, WINDOW, approx, scaling, page=PAGE)
    return out


def _pad_heavy(model):
    """The model with a large random embedding for the pad token (id 0). RMSNorm undoes the scale, but the odd
    direction gives padded keys that topk would pick (test_left_padding_is_never_selected checks that it would)."""
    model = copy.deepcopy(model)
    with torch.no_grad():
        gen = torch.Generator().manual_seed(11)
        model.get_input_embeddings().weight[0] = 30.0 * torch.randn(model.config.hidden_size, generator=gen)
    return model


def _padded_batch(model, ids, pad: int = 12):
    """The pad-heavy model and a batch of the sequence and of itself cut by ``pad`` tokens and left padded back:
    (model, pad, the short sequence, batch, attention mask)."""
    short = ids[0, :ids.shape[1] - pad]
    batch = torch.stack([ids[0], torch.cat([torch.zeros(pad, dtype=torch.long), short])])
    mask = torch.ones_like(batch)
    mask[1, :pad] = 0
    return _pad_heavy(model), pad, short, batch, mask


@pytest.fixture(scope="module", params=FAMILIES)
def family(request):
    model = tiny_model(request.param)
    ids = torch.tensor([TOKENIZER(TEXT)["input_ids"]])
    assert ids.shape[1] == 100
    return request.param, model, ids, _plain_layers(model, ids)


_ORACLE_CACHE: dict[tuple[str, str], torch.Tensor] = {}


def _cached_oracle(name, layers, approx, end):
    if (name, approx) not in _ORACLE_CACHE:
        _ORACLE_CACHE[name, approx] = _oracle_ratios(layers, 0, 0, approx, START, end)
    return _ORACLE_CACHE[name, approx]


def _assert_ratios_equal(ours, expected, what):
    expected = expected.to(ours.dtype)
    bad = ~torch.isclose(ours, expected, rtol=1e-4, atol=1e-5)
    if bad.any():
        where = [(int(p), int(layer), float(ours[p, layer]), float(expected[p, layer]))
                 for p, layer in bad.nonzero()[:10]]
        pytest.fail(f"{what}: {int(bad.sum())} ratios differ from the reference; (position offset, layer, "
                    f"speculator, reference): {where}")


@pytest.mark.parametrize("approx", oracle.APPROXES)
def test_speculator_ratios_equal_the_reference(family, approx):
    name, model, ids, layers = family
    length = ids.shape[1]
    ratios = _speculator_ratios(model, approx, ids, DecodeRegion.build([0], [START]))
    assert ratios.shape == (1, length, model.config.num_hidden_layers)
    assert torch.isnan(ratios[0, :START]).all()
    expected = _cached_oracle(name, layers, approx, length)
    _assert_ratios_equal(ratios[0, START:], expected, f"{approx} on {name} (positions from {START})")
    assert (expected > 0).all()  # START >= 2S: every traced position speculates
    if approx != "sink":
        sink = _cached_oracle(name, layers, "sink", length)
        assert not torch.allclose(expected, sink, rtol=1e-3, atol=1e-4), f"{approx} cannot be told from sink"


@pytest.mark.parametrize("positions", ["physical", "logical"])
@pytest.mark.parametrize("approx", oracle.APPROXES)
def test_left_padding_is_never_selected(family, approx, positions):
    """A left padded row (pad tokens with a large embedding) records the reference's ratios of its unpadded
    sequence. "physical": no position_ids (HF's RoPE positions count the padding), compared with the reference on
    the padded run's own query/key/value of the row's real tokens; "logical": position_ids that start at 0 on the
    first real token, compared with the reference on the unpadded sequence run alone."""
    name, model, ids, solo_layers = family
    model, pad, short, batch, mask = _padded_batch(model, ids)
    kwargs = {"attention_mask": mask}
    if positions == "logical":
        kwargs["position_ids"] = (mask.cumsum(-1) - 1).clamp(min=0)
    layers = _plain_layers(model, batch, **kwargs)
    region = DecodeRegion.build(pad=[0, pad], spec_start=[START, START + pad])
    ratios = _speculator_ratios(model, approx, batch, region, **kwargs)
    assert torch.isnan(ratios[1, :START + pad]).all()
    logical_end = short.shape[0]
    if positions == "logical":
        expected = _cached_oracle(name, solo_layers, approx, ids.shape[1])[:logical_end - START]
        _assert_ratios_equal(ratios[1, START + pad:], expected, f"{approx} on {name}, left padded row, "
                             "logical position_ids, against the unpadded sequence alone")
        return
    expected = _oracle_ratios(layers, 1, pad, approx, START, logical_end)
    _assert_ratios_equal(ratios[1, START + pad:], expected, f"{approx} on {name}, left padded row")
    _assert_ratios_equal(ratios[0, START:], _oracle_ratios(layers, 0, 0, approx, START, ids.shape[1]),
                         f"{approx} on {name}, unpadded row of the padded batch")
    # The comparison bites: were the padding selectable (the row taken as a sequence from physical index 0), the
    # reference would keep padded keys and give other ratios.
    selectable = _oracle_ratios(layers, 1, 0, approx, START + pad, batch.shape[1])
    assert not torch.allclose(selectable, expected, rtol=1e-3, atol=1e-4)
    if approx == "topk":
        picked = 0
        for query, key, _, _ in layers:
            for phys in range(START + pad, batch.shape[1]):
                kept = oracle.kept_keys(query[1, :, phys], key[1], phys, WINDOW, "topk")
                picked += sum(t < pad for keys in kept for t in keys)
        assert picked > 0, "no padded key would score into topk's budget: the test would not catch it"


SNAPKV = {"observe": 8, "pool": 3, "recent": 4}  # 2S = 16: the newest 4 and the 12 best prompt keys


def _snapkv_oracle_ratios(layers, row, pad, prompt, start, end):
    """Reference ratios of snapkv (positions start..end-1 logical) of batch row ``row`` (real tokens from physical
    ``pad``), its prompt the first ``prompt`` real tokens, scored by the oracle on the row's own sequence."""
    out = torch.full((end - start, len(layers)), math.nan, dtype=torch.float64)
    for layer, (query, key, value, scaling) in enumerate(layers):
        Q, K, V = query[row, :, pad:], key[row, :, pad:], value[row, :, pad:]
        scores = oracle.snapkv_prompt_scores(Q, K, prompt, SNAPKV["observe"], SNAPKV["pool"], scaling)
        for pos in range(start, end):
            out[pos - start, layer] = oracle.snapkv_ratio(Q[:, pos], K, V, pos, scores, prompt, WINDOW,
                                                          SNAPKV["recent"], scaling)
    return out


def _snapkv_ratios(model, ids, region, **kwargs):
    spec = alspec_lm(model, window=WINDOW, approx="snapkv", approx_args=SNAPKV, **{"lambda": 0.0})
    with torch.no_grad(), spec.speculator.speculating(region, spec.spec_config) as trace:
        spec.model(ids, **kwargs)
    return trace.ratios


def test_snapkv_ratios_equal_the_reference(family):
    """Teacher forcing: the prompt [0, START) scored in the same pass by its last 8 queries, every later position
    keeps the newest 4 tokens and the 12 best prompt keys, per KV head."""
    name, model, ids, layers = family
    ratios = _snapkv_ratios(model, ids, DecodeRegion.build([0], [START]))
    expected = _snapkv_oracle_ratios(layers, 0, 0, START, START, ids.shape[1])
    _assert_ratios_equal(ratios[0, START:], expected, f"snapkv on {name}")
    for other in ("sink", "local"):  # it is neither of the fixed windows
        assert not torch.allclose(expected, _cached_oracle(name, layers, other, ids.shape[1]), rtol=1e-3, atol=1e-4)


def test_snapkv_left_padded_rows_score_their_own_prompt(family):
    """A left padded row (pad tokens with a large embedding) beside an unpadded one, with prompts of different
    lengths: each row's prompt is scored from its own real tokens, and no padding key is ever kept."""
    name, model, ids, _ = family
    model, pad, short, batch, mask = _padded_batch(model, ids)
    layers = _plain_layers(model, batch, attention_mask=mask)
    prompts = (START, START - 6)
    region = DecodeRegion.build(pad=[0, pad], spec_start=[prompts[0], prompts[1] + pad])
    ratios = _snapkv_ratios(model, batch, region, attention_mask=mask)
    _assert_ratios_equal(ratios[1, prompts[1] + pad:],
                         _snapkv_oracle_ratios(layers, 1, pad, prompts[1], prompts[1], short.shape[0]),
                         f"snapkv on {name}, left padded row")
    _assert_ratios_equal(ratios[0, prompts[0]:], _snapkv_oracle_ratios(layers, 0, 0, prompts[0], prompts[0],
                                                                      ids.shape[1]), f"snapkv on {name}, unpadded row")


def test_snapkv_refuses_a_prompt_whose_observation_window_spans_two_passes(family):
    """A prompt prefilled in two passes that split its last 8 positions: no pass holds the observation window, so
    nothing is scored from a partial window; the first decode position says so instead of guessing."""
    _, model, ids, _ = family
    spec = alspec_lm(model, window=WINDOW, approx="snapkv", approx_args=SNAPKV, **{"lambda": 0.0})
    cache = DynamicCache(config=spec.model.config)
    region = DecodeRegion.build([0], [START])
    with torch.no_grad(), pytest.raises(RuntimeError, match="snapkv scored no prompt"), \
            spec.speculator.speculating(region, spec.spec_config):
        spec.model(ids[:, :START - 3], **with_cache(spec.model, cache), use_cache=True)
        spec.model(ids[:, START - 3:START + 4], **with_cache(spec.model, cache), use_cache=True)
