"""What alspec-vllm counts and caches, on the tiny Llama: exactly the positions whose outputs are read (a
loglikelihood's continuation tokens fed in, but its last token; a generation's tokens fed back, but its last), and
prefix-cache blocks of speculated prompts served only under the same rules (an exact prompt is shared by all)."""

from __future__ import annotations

import math
import random

import pytest

pytest.importorskip("vllm")
from lm_eval.api.instance import Instance

from conftest import speculating

pytestmark = pytest.mark.slow


def text(n: int, seed: int) -> str:
    rng = random.Random(seed)
    return "".join(rng.choice("abcdefghijklmnopqrstuvwxyz ") for _ in range(n))


def greedy(tokens: int):
    from vllm import SamplingParams

    return SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)


def test_records_cover_exactly_the_positions_whose_outputs_are_read(alspec_tiny):
    layers = alspec_tiny.num_layers
    with speculating(alspec_tiny, lam=math.inf) as lm:
        context, continuation = text(100, 1), text(9, 2)
        lm.loglikelihood([Instance("loglikelihood", {}, (context, continuation), 0, ("ll", 0, 1))])
        stats = lm.ledger.records[lm._pairs[context, continuation]].stats
        # positions len(context) .. len(input) - 2 feed a scored token: len(continuation) - 1 rows, none trivial
        assert stats.speculated.tolist() == [len(lm.tok_encode(continuation)) - 1] * layers
        assert int(stats.trivial.sum()) == 0
        prompt = [3 + (i * 7) % 90 for i in range(60)]
        lm._model_generate([prompt], generate=True, sampling_params=[greedy(12)])
        # the prompt is exact; the 11 generated tokens fed back speculate, the 12th feeds nothing
        assert lm.ledger.records[tuple(prompt)].stats.speculated.tolist() == [11] * layers


def test_speculated_prompt_blocks_serve_only_the_same_rules(alspec_tiny):
    """vLLM reports the prompt tokens it took from its prefix cache (num_cached_tokens)."""
    prompt = [3 + (i * 11) % 90 for i in range(200)]

    def cached(tokens: list[int]) -> int:
        return alspec_tiny._model_generate([tokens], generate=True, sampling_params=[greedy(2)])[0].num_cached_tokens

    with speculating(alspec_tiny, lam=math.inf, speculate_prefill=True):
        cached(prompt)
        assert cached(prompt) > 0  # the same rules: its speculated blocks are served
    with speculating(alspec_tiny, lam=0.3, speculate_prefill=True):
        assert cached(prompt) == 0  # other rules: never served
    other = [5 + (i * 13) % 90 for i in range(200)]
    with speculating(alspec_tiny, lam=0.3):
        cached(other)
    with speculating(alspec_tiny, lam=math.inf):
        assert cached(other) > 0  # an exact prompt is shared by every setting
