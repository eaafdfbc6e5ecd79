"""The densities and the output error next to d/n, per layer and in total (sparse-attention-hub's names): the share
of the context A~ reads (2S / (pos + 1)), the share a step reads once a rejection falls back to A (1), and the mean
d/n, each over a layer's non-trivial decisions; computed here from the decisions by hand."""

from __future__ import annotations

import math

import pytest
import torch
from lm_eval.api.instance import Instance

from alspec_eval.approx_check.models import tiny_model
from alspec_eval.region import DecodeRegion, Trace
from alspec_eval.stats import (ACCEPTED, DENOMINATOR, DENSITY, EFFECTIVE_DENSITY, KEYS_READ, OUTPUT_ERROR,
                               PROMISE_DENOMINATOR, PROMISE_DN, REJECTED, TRIVIAL, AcceptanceStats)
from helpers import TOKENIZER, alspec_lm, sample_stats

NAN = math.nan


def test_a_rows_densities_by_hand():
    # logical positions 3, 9, 19 (a left padding of 2: physical 5, 11, 21 from offset 5), S = 2, two layers
    codes = torch.zeros(1, 17, 2, dtype=torch.int8)
    ratios = torch.full((1, 17, 2), NAN)
    codes[0, 0], codes[0, 6], codes[0, 16] = torch.tensor([TRIVIAL, TRIVIAL]), torch.tensor([ACCEPTED, REJECTED]), \
        torch.tensor([REJECTED, ACCEPTED])
    ratios[0, 6], ratios[0, 16] = torch.tensor([0.1, 0.5]), torch.tensor([0.7, NAN])  # layer 1 at 19: not measured
    trace = Trace(codes, ratios, offset=5, pad=torch.tensor([2]), budget=4)  # 2S
    stats = trace.row_stats(0, 5, 22)
    first, second = stats.means(0), stats.means(1)
    assert first[DENSITY] == pytest.approx((4 / 10 + 4 / 20) / 2)
    assert first[EFFECTIVE_DENSITY] == pytest.approx((4 / 10 + 1) / 2)  # accepted at 9, rejected at 19
    assert first[OUTPUT_ERROR] == pytest.approx((0.1 + 0.7) / 2)
    assert second[EFFECTIVE_DENSITY] == pytest.approx((1 + 4 / 20) / 2) and second[OUTPUT_ERROR] == pytest.approx(0.5)
    total = stats.means()
    assert total[DENSITY] == pytest.approx((4 / 10 + 4 / 20) * 2 / 4)
    assert total[OUTPUT_ERROR] == pytest.approx((0.1 + 0.7 + 0.5) / 3)
    entry = stats.to_dict()["layers"][0]
    assert (entry[DENSITY], entry[EFFECTIVE_DENSITY], entry[OUTPUT_ERROR]) == tuple(first[k] for k in
                                                                                    (DENSITY, EFFECTIVE_DENSITY,
                                                                                     OUTPUT_ERROR))
    empty = AcceptanceStats.zeros(2).means(0)
    assert empty == {DENSITY: None, EFFECTIVE_DENSITY: None, OUTPUT_ERROR: None}
    summed = stats + stats
    assert summed.means(0) == first  # means of a sum of equal parts
    # a budget that varies per head and query (max_keys None): the densities are not measured, d/n still is
    varying = Trace(codes, ratios, offset=5, pad=torch.tensor([2]), budget=None).row_stats(0, 5, 22)
    assert varying.means(0) == {DENSITY: None, EFFECTIVE_DENSITY: None, OUTPUT_ERROR: first[OUTPUT_ERROR]}
    assert (varying + varying).to_dict()["total"][DENSITY] is None


@pytest.mark.slow
def test_scored_continuations_report_the_densities_of_their_positions():
    """Teacher-forced continuations at S = 4: per token the layers that accepted (trace_tokens) give the effective
    density; the positions give A~'s; a direct trace of the same pass gives the mean d/n."""
    model, window = tiny_model(), 4
    pairs = [("It was the best of times,", " it was the worst"), ("Hundreds", " of people went by")]
    lm = alspec_lm(model, window=window, trace_tokens=True, **{"lambda": 0.2})
    requests = [Instance("loglikelihood", {}, pair, i, ("ll", i, 1)) for i, pair in enumerate(pairs)]
    lm.loglikelihood(requests)
    layers = model.config.num_hidden_layers
    density = effective = count = 0.0
    for (context, continuation), stats in zip(pairs, sample_stats(requests), strict=True):
        start, text = len(TOKENIZER(context)["input_ids"]), TOKENIZER(context + continuation)["input_ids"]
        for pos, accepted in zip(range(start, len(text) - 1), stats["accepted_layers_per_token"], strict=True):
            if pos + 1 <= 2 * window:
                continue
            share = 2 * window / (pos + 1)
            density += layers * share
            effective += accepted * share + (layers - accepted)
            count += layers
    total = lm.statistics()["tasks"]["ll"]["total"]
    assert total["speculated"] == count
    assert total[DENSITY] == pytest.approx(density / count) and total[EFFECTIVE_DENSITY] == pytest.approx(
        effective / count)
    assert total[DENSITY] < total[EFFECTIVE_DENSITY] < 1
    ids = torch.tensor([TOKENIZER("".join(pairs[0]))["input_ids"][:-1]])
    region = DecodeRegion.build([0], [len(TOKENIZER(pairs[0][0])["input_ids"])], tokens=ids)
    with torch.no_grad(), lm.speculator.speculating(region, lm.spec_config) as trace:
        lm.model(ids)
    for layer in range(layers):
        measured = trace.ratios[0, :, layer][~torch.isnan(trace.ratios[0, :, layer])]
        got = trace.row_stats(0, 0, ids.shape[1]).means(layer)[OUTPUT_ERROR]
        assert got == pytest.approx(float(measured.double().mean()), rel=1e-8)


def test_a_varying_budgets_densities_from_the_keys_read_by_hand():
    """A budget that varies (max_keys None): each decision's share is the keys its A~ read over pos + 1; a decided
    position whose keys were not measured (an exact layer's) leaves its layer's densities null, not 0."""
    codes = torch.zeros(1, 3, 2, dtype=torch.int8)
    codes[0, 0], codes[0, 1], codes[0, 2] = torch.tensor([TRIVIAL, TRIVIAL]), torch.tensor([ACCEPTED, REJECTED]), \
        torch.tensor([REJECTED, REJECTED])
    ratios = torch.tensor([[[NAN, NAN], [0.1, 0.5], [0.7, NAN]]])
    keys = torch.tensor([[[NAN, NAN], [6.0, 2.5], [12.0, NAN]]])  # layer 1 at position 11: an exact layer
    # logical positions 9, 10, 11
    trace = Trace(codes, ratios, offset=9, pad=torch.tensor([0]), budget=None, measures={KEYS_READ: keys})
    stats = trace.row_stats(0, 9, 12)
    first, second = stats.means(0), stats.means(1)
    assert first[DENSITY] == pytest.approx((6 / 11 + 12 / 12) / 2)
    assert first[EFFECTIVE_DENSITY] == pytest.approx((6 / 11 + 1) / 2)  # accepted at 10, rejected at 11
    assert second[DENSITY] is None and second[EFFECTIVE_DENSITY] == 1.0  # rejected twice: A read
    assert stats.means()[DENSITY] is None and first[OUTPUT_ERROR] == pytest.approx((0.1 + 0.7) / 2)


@pytest.mark.slow
def test_a_draft_whose_budget_varies_reports_the_keys_it_read():
    """vAttention's budget varies per head and query (max_keys None): each decision records the keys its selection
    counted per KV head (their mean over the KV heads), at its own position and layer, and the densities are
    theirs over pos + 1, not 2S / (pos + 1)."""
    from alspec_eval.approximations.vattention import VAttention
    from default_approximations import approx_args

    lm = alspec_lm(tiny_model(), window=4, **approx_args("vattention", 4), **{"lambda": 0.2})
    epsilon = lm.spec_config.approx.epsilon
    counted: list[tuple[list[int], list[float]]] = []
    missed: list[tuple[int, list[int], list[float]]] = []
    select = VAttention.select

    def spied(self, query, key, rows, pos, pad, window, passed, prepared):
        index, valid, log_weight = select(self, query, key, rows, pos, pad, window, passed, prepared)
        counted.append((prepared.layer, pos.tolist(), [float(v.sum()) / v.shape[0] for v in valid]))
        missed.append((prepared.layer, pos.tolist(), [
            _denominator_missed(query[i], key[rows[i]], int(pad[i]), int(pos[i]), index[i], valid[i], log_weight[i],
                                epsilon) for i in range(len(pos))]))
        return index, valid, log_weight

    context, continuation = "It was the best of times, it was the worst", " of times, it was the age"
    ids = torch.tensor([TOKENIZER(context + continuation)["input_ids"][:-1]])
    start = len(TOKENIZER(context)["input_ids"])
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(VAttention, "select", spied)
        with torch.no_grad(), lm.speculator.speculating(DecodeRegion.build([0], [start], tokens=ids),
                                                        lm.spec_config) as trace:
            lm.model(ids)
    want = torch.full(trace.codes.shape[1:], NAN)
    for layer, positions, keys in counted:
        for p, k in zip(positions, keys, strict=True):
            want[p, layer] = k
    assert len(counted) == trace.codes.shape[-1] and (want[start:] > 2 * 4).any()  # past 2S somewhere
    torch.testing.assert_close(trace.measures[KEYS_READ][0], want, equal_nan=True)
    density = trace.row_stats(0, start, ids.shape[1]).means()[DENSITY]
    decided = (trace.codes[0] == ACCEPTED) | (trace.codes[0] == REJECTED)
    shares = (want / (torch.arange(ids.shape[1])[:, None] + 1)).clamp(max=1)
    assert density == pytest.approx(float(shares[decided].mean()))
    want = torch.full(trace.codes.shape[1:], NAN)  # the share of query heads whose denominator the sample missed
    for layer, positions, shares in missed:
        for p, k in zip(positions, shares, strict=True):
            want[p, layer] = k
    torch.testing.assert_close(trace.measures[DENOMINATOR][0], want, equal_nan=True)
    assert (want[start:] > 0).any() and (want[start:] < 1).any()  # misses and hits among the decisions


def _denominator_missed(q, K, pad, pos, index, valid, log_weight, epsilon) -> float:
    """Apart from the engines, in numpy float64: the share of q's heads with |D~ - D| > epsilon D, D over the keys
    [pad, pad + pos] of K (Hkv, L, D), D~ over each KV head's valid selected keys weighted by exp(log-weight)."""
    import numpy as np

    q, K = q.double().numpy(), K.double().numpy()
    heads, kv_heads, dim = q.shape[0], K.shape[0], q.shape[1]
    out = []
    for g in range(heads):
        h = g // (heads // kv_heads)
        s = K[h, pad:pad + pos + 1] @ q[g] / np.sqrt(dim)
        e = np.exp(s - s.max())
        chosen = [(int(j) - pad, float(w)) for j, ok, w in zip(index[h], valid[h], log_weight[h]) if ok]
        estimate = sum(e[j] * np.exp(w) for j, w in chosen)
        out.append(abs(estimate - e.sum()) > epsilon * e.sum())
    return float(np.mean(out))


def test_a_promises_realized_shares_by_hand():
    """A draft that promises epsilon (vAttention's): per layer, the share of measured decisions whose d/n exceeds it,
    and the mean of the denominator's missed shares where measured; a draft that promises nothing has no such
    entries (not 0), and summing with one that does keeps its counts."""
    codes = torch.tensor([[[ACCEPTED, REJECTED], [REJECTED, ACCEPTED], [TRIVIAL, TRIVIAL], [ACCEPTED, REJECTED]]],
                         dtype=torch.int8)
    ratios = torch.tensor([[[0.05, 0.4], [0.2, 0.1], [NAN, NAN], [0.11, NAN]]])
    missed = torch.tensor([[[0.0, 0.5], [0.25, NAN], [NAN, NAN], [1.0, NAN]]])
    trace = Trace(codes, ratios, pad=torch.tensor([0]), budget=4, measures={DENOMINATOR: missed}, epsilon=0.1)
    stats = trace.row_stats(0, 0, 4)
    first, second = stats.means(0), stats.means(1)
    assert first[PROMISE_DN] == pytest.approx(2 / 3) and second[PROMISE_DN] == pytest.approx(1 / 2)  # 0.1: not >
    assert first[PROMISE_DENOMINATOR] == pytest.approx(1.25 / 3) and second[PROMISE_DENOMINATOR] == 0.5
    assert stats.means()[PROMISE_DN] == pytest.approx(3 / 5)
    no_denominator = Trace(codes, ratios, pad=torch.tensor([0]), budget=4, epsilon=0.1).row_stats(0, 0, 4)
    assert no_denominator.means(0)[PROMISE_DENOMINATOR] is None and no_denominator.means(0)[PROMISE_DN] is not None
    none = Trace(codes, ratios, pad=torch.tensor([0]), budget=4).row_stats(0, 0, 4)
    assert PROMISE_DN not in none.means() and PROMISE_DN not in none.to_dict()["layers"][0]
    total = AcceptanceStats.zeros(2) + stats + stats
    assert total.means(0)[PROMISE_DN] == pytest.approx(2 / 3) and total.to_dict()["total"][PROMISE_DN] == \
        pytest.approx(3 / 5)


def test_a_row_that_measured_nothing_leaves_the_promises_shares_as_they_are():
    """A request whose positions were all trivial records no measure (no decision carried one): summed into a task,
    it adds nothing to the denominator's share, and does not make it null."""
    codes = torch.tensor([[[ACCEPTED], [REJECTED]]], dtype=torch.int8)
    measured = Trace(codes, torch.tensor([[[0.05], [0.3]]]), pad=torch.tensor([0]), budget=4,
                     measures={DENOMINATOR: torch.tensor([[[0.5], [0.0]]])}, epsilon=0.1).row_stats(0, 0, 2)
    trivial = Trace(torch.tensor([[[TRIVIAL]]], dtype=torch.int8), torch.tensor([[[NAN]]]), pad=torch.tensor([0]),
                    budget=4, epsilon=0.1).row_stats(0, 0, 1)
    total = trivial + measured
    assert total.means()[PROMISE_DENOMINATOR] == pytest.approx(0.25) and total.means()[PROMISE_DN] == 0.5
