"""A sweep's shared-prefill batch through the fused Triton kernel equals the same batch through the model's own
attention (kernel=model): texts, log-likelihoods and every recorded decision, for every row kind of row_kinds.py at
once, each batch row with its own thresholds (a tuned row's per layer). Triton's interpreter on the CPU.

The bug it guards: a layer's per-row thresholds were a strided column of the plan, and the kernel read row b's at
``lam_ptr + b``, so decisions landed on other rows (a sink row's hit rate fell from 100% to 25%)."""

from __future__ import annotations

import pytest
import torch
from lm_eval.api.instance import Instance

pytest.importorskip("triton", reason="triton is not installed (pip install triton)")

from helpers import GEN_KWARGS, PROMPTS, alspec_lm, ll_requests, recorded, sample_stats
from row_kinds import examples

from alspec_eval.approx_check.models import tiny_model
from alspec_eval.approx_check.properties import median_ratio
from alspec_eval.kernels import triton_decode
from alspec_eval.plan import Plan
from alspec_eval.rows import Row

pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore")]
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # the interpreter on the CPU, compiled on a GPU


# 12 new tokens: the shortest prompt (8 tokens, 2S = 16) goes past 2S in the same batch as rows that speculate from
# the first step (the interpreter's time grows with the steps)
MAX_GEN_TOKS = 12


def _generations() -> list[Instance]:
    return [Instance("generate_until", {}, (p, {**GEN_KWARGS, "max_gen_toks": MAX_GEN_TOKS}), i, ("gen", i, 1))
            for i, p in enumerate(PROMPTS)]


def _sweep(model: torch.nn.Module, rows: list[Row], kernel: str) -> tuple[dict, list]:
    lm = alspec_lm(model, batch_size=4, kernel=kernel, device=DEVICE)
    answers = {}
    with recorded(lm) as traces, lm.shared_prefill(rows) as fork:
        for row in rows:
            with lm.answering(row, shared=fork):
                gen, ll = _generations(), ll_requests()
                answers[row.name] = (lm.generate_until(gen), sample_stats(gen), lm.loglikelihood(ll), sample_stats(ll))
    return answers, traces


def test_a_shared_prefill_batch_through_triton_equals_kernel_model(tmp_path):
    model = tiny_model()
    lam = median_ratio(alspec_lm(model), PROMPTS[0])
    model = model.to(DEVICE)  # an instance stays where it is (lm-eval moves only what it loads)
    rows = [e.row for e in examples(lam, folder=tmp_path) if e.row.shares_prefill] + [Row.dynamic(2 * lam)]
    assert {r.kind for r in rows} >= {"baseline", "dynamic", "always", "selfspec", "tuned"}
    model_answers, model_traces = _sweep(model, rows, "model")
    triton_answers, triton_traces = _sweep(model, rows, "triton")
    for row in rows:
        texts, gen_stats, lls, ll_stats = model_answers[row.name]
        assert triton_answers[row.name][0] == texts, row.name
        assert triton_answers[row.name][1] == gen_stats, row.name
        assert [x for x, _ in triton_answers[row.name][2]] == pytest.approx([x for x, _ in lls], abs=1e-4), row.name
        assert triton_answers[row.name][3] == ll_stats, row.name
    assert len(triton_traces) == len(model_traces)
    decided = 0
    for fused, plain in zip(triton_traces, model_traces):
        assert torch.equal(fused.codes, plain.codes)
        torch.testing.assert_close(fused.ratios, plain.ratios, rtol=1e-4, atol=1e-6, equal_nan=True)
        decided += int((plain.codes != 0).sum())
    assert decided > 0
    sink = sum(s["accepted"] for s in triton_answers["sink"][1])
    assert sink > 0 and sink == sum(s["speculated"] for s in triton_answers["sink"][1])  # lambda = inf: A~ always


def test_per_row_thresholds_of_a_plan_reach_their_rows():
    """The kernel decides row b by row b's threshold at the layer, the plan's column handed over as it is."""
    from kernel_oracle import make_inputs

    from alspec_eval.kernels import speculative_flash_decode

    q, k, v, cur_pos = (t.to(DEVICE) for t in make_inputs(4, 6, 2, 160, 32, [150, 120, 100, 90]))
    plan = Plan.of_rows([[0.0, 1e9, 0.0], [float("inf")] * 3, [0.0, 0.0, 5.0], [float("nan")] * 3])
    for layer in range(3):
        lam = plan.layer(layer, DEVICE)
        fused = triton_decode.speculative_flash_decode_triton(q, k, v, cur_pos, 8, lam, chunk_size=16)
        reference = speculative_flash_decode(q, k, v, cur_pos, 8, plan.lam[:, layer].to(DEVICE))
        assert fused.accept.tolist() == reference.accept.tolist(), layer
        strided = plan.lam.to(DEVICE)[:, layer]  # a column of a (rows, layers) tensor: not contiguous
        assert not strided.is_contiguous()
        assert triton_decode.speculative_flash_decode_triton(q, k, v, cur_pos, 8, strided,
                                                             chunk_size=16).accept.tolist() == reference.accept.tolist()
    assert [plan.layer(i).tolist()[0] for i in range(3)] == [0.0, 1e9, 0.0]
