"""The speculative flash decode kernels inside the sim backend make the same decisions as the SDPA path."""

from __future__ import annotations

import importlib.util
import os

import pytest

import torch

from helpers import PROMPTS, alspec_lm, gen_requests, recorded, sample_stats
from row_kinds import examples
from alspec_eval.approx_check.properties import median_ratio

pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore")]


def _kernels() -> list:
    kernels = ["torch"]
    if importlib.util.find_spec("triton") is not None and os.environ.get("TRITON_INTERPRET") == "1":
        kernels.append("triton")
    return kernels


@pytest.mark.parametrize("kernel", _kernels())
@pytest.mark.parametrize("align", [1, 32])
def test_kernel_decisions_equal_sdpa_path(model, kernel, align):
    window = 32 if align == 32 else 8
    prompts = [p * (3 if align == 32 else 1) for p in PROMPTS]
    lam = median_ratio(alspec_lm(model, window=window, window_align=align), prompts[0])
    runs = {}
    for name in ("model", kernel):
        lm = alspec_lm(model, batch_size=2, kernel=name, window=window, window_align=align, **{"lambda": lam})
        assert (lm.speculator.decode_kernel is None) == (name == "model")
        requests = gen_requests(prompts)
        runs[name] = (lm.generate_until(requests), sample_stats(requests))
    assert runs[kernel] == runs["model"]
    accepted = sum(s["accepted"] for s in runs["model"][1])
    assert 0 < accepted < sum(s["speculated"] for s in runs["model"][1])


@pytest.mark.parametrize("kind", [e.id for e in examples(0.1)])
def test_every_row_kind_records_through_a_fused_kernel_what_kernel_model_records(model, kind, tmp_path):
    """A fused decode step decides every batch row and records the speculated ones by mask (no read-back of their
    positions): each row kind run alone from its model_args (a static row's exact layers recorded as rejected, a
    tuned row's per-layer thresholds, self-speculation's drafts) records the very codes and ratios of kernel=model."""
    lam = median_ratio(alspec_lm(model), PROMPTS[0])
    example = next(e for e in examples(lam, model.config.num_hidden_layers, tmp_path) if e.id == kind)
    runs = {}
    for kernel in ("model", "torch"):
        lm = alspec_lm(model, batch_size=2, kernel=kernel, **example.model_args)
        with recorded(lm) as traces:
            requests = gen_requests()
            runs[kernel] = (lm.generate_until(requests), sample_stats(requests), traces)
    assert runs["torch"][:2] == runs["model"][:2]
    assert len(runs["torch"][2]) == len(runs["model"][2]) > 0
    for fused, plain in zip(runs["torch"][2], runs["model"][2]):
        assert torch.equal(fused.codes, plain.codes)
        torch.testing.assert_close(fused.ratios, plain.ratios, rtol=1e-4, atol=1e-6, equal_nan=True)
