"""Preemption under a full KV cache, by design: vLLM frees a preempted request's blocks and later recomputes every
position it had, after their outputs were read. Each position keeps the decision of the pass whose output was read
(the first), the positions decided again are counted in the provenance, and the per-layer counts and texts equal a
run on an engine with room for every request. The next cell on the same engine equals that cell run alone."""

from __future__ import annotations

import math

import pytest

pytest.importorskip("vllm")
import torch

from conftest import TINY, speculating
from test_vllm_reference import text_tokens

pytestmark = pytest.mark.slow

BLOCKS = 12  # 384 tokens of cache: the five requests below need about 16 blocks at once


@pytest.fixture(scope="module")
def pressed(tiny_path):
    """The tiny Llama with a KV cache too small for the batch, its metrics on (to count vLLM's preemptions)."""
    from alspec_eval.vllm.model import ALSpecVLLM

    return ALSpecVLLM(tiny_path, window=16, **{**TINY, "num_gpu_blocks_override": BLOCKS, "max_model_len": 320,
                                              "disable_log_stats": False})


def preemptions(lm) -> int:
    return int(sum(m.value for m in lm.model.get_metrics() if m.name == "vllm:num_preemptions"))


def generate(lm, lam: float) -> tuple[list[list[int]], dict[tuple[int, ...], dict[str, list[int]]]]:
    """Five prompts of 40 to 120 tokens, 100 tokens each; the texts and each request's per-layer counts."""
    from vllm import SamplingParams

    prompts = [text_tokens(40 + 20 * i, 50 + i) for i in range(5)]
    greedy = SamplingParams(temperature=0, max_tokens=100, ignore_eos=True)
    with speculating(lm, lam=lam):
        outputs = lm._model_generate(prompts, generate=True, sampling_params=[greedy] * len(prompts))
    counts = {}
    for prompt in prompts:
        stats = lm.ledger.records[tuple(prompt)].stats
        counts[tuple(prompt)] = {k: getattr(stats, k).tolist() for k in ("speculated", "accepted", "trivial")}
    return [list(o.outputs[0].token_ids) for o in outputs], counts


def median_ratio(lm) -> float:
    """A lambda at this model's median d/n, so that rows accept and reject."""
    from vllm import SamplingParams

    from conftest import dumps_of

    with speculating(lm, dump=True, lam=math.inf, speculate_prefill=True):
        lm._model_generate([text_tokens(120, 1)], generate=True,
                           sampling_params=[SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)])
        ratios = torch.cat([d["ratio"] for d in dumps_of(lm)])
    return float(ratios[~ratios.isnan()].median()) * 1.0001


def test_preempted_requests_count_each_position_once_and_equal_a_run_without_pressure(pressed, alspec_tiny):
    lam = median_ratio(alspec_tiny)
    before = preemptions(pressed)
    pressed.reset_statistics()
    texts, counts = generate(pressed, lam)
    assert preemptions(pressed) > before  # vLLM preempted and recomputed
    assert pressed.statistics()["provenance"]["redecided_positions"] > 0  # and positions were decided again
    roomy_texts, roomy_counts = generate(alspec_tiny, lam)
    assert texts == roomy_texts
    assert counts == roomy_counts
    speculated = sum(sum(c["speculated"]) for c in counts.values())
    accepted = sum(sum(c["accepted"]) for c in counts.values())
    assert 0 < accepted < speculated  # both decisions occur
    # the next cell on the pressed engine (another lambda) equals that cell on the roomy engine: no block computed
    # under the first cell's rules is served to it
    assert generate(pressed, lam * 1.5) == generate(alspec_tiny, lam * 1.5)


def test_blocks_of_speculated_generated_tokens_are_served_to_no_other_cell(alspec_tiny):
    """vLLM caches the full blocks of generated tokens too: a request whose prompt continues a generation is served
    them. An exact generation's blocks are (the control); a speculating cell's are not, to any other cell, while the
    exact blocks before its speculation start are."""
    from vllm import SamplingParams

    lm, prompt = alspec_tiny, text_tokens(64, 77)  # two blocks of 32
    greedy = SamplingParams(temperature=0, max_tokens=96, ignore_eos=True)
    one = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)

    def continued(lam: float) -> int:
        """Tokens of prompt + its generation at lam that an exact request finds in the prefix cache."""
        with speculating(lm, lam=lam):
            text = list(lm._model_generate([prompt], generate=True, sampling_params=[greedy])[0].outputs[0].token_ids)
        with speculating(lm, lam=0.0):
            return lm._model_generate([prompt + text], generate=True, sampling_params=[one])[0].num_cached_tokens

    assert continued(0.0) > len(prompt)  # the exact generation's blocks are served
    # the speculating one's are not; its prompt's blocks, exact, still are
    assert continued(median_ratio(lm)) == len(prompt)
