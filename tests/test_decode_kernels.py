"""The speculative flash decode kernels inside the sim backend make the same decisions as the SDPA path."""

from __future__ import annotations

import importlib.util
import os

import pytest

from helpers import PROMPTS, alspec_lm, gen_requests, median_ratio, sample_stats
from tiny import tiny_model

pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore")]


def _kernels() -> list:
    kernels = ["torch"]
    if importlib.util.find_spec("triton") is not None and os.environ.get("TRITON_INTERPRET") == "1":
        kernels.append("triton")
    return kernels


@pytest.fixture(scope="module")
def model():
    return tiny_model()


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
