"""Which blocks of a request vLLM's prefix cache keys by the speculation rules (prefix_cache.speculated_block_key):
those that hold a position at or after the request's speculation start, under rules that can change a KV entry.
Fast: no vLLM (a request is anything with ``sampling_params.extra_args``)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from alspec_eval.vllm.prefix_cache import TAG, prompt_digest, speculated_block_key


def request(tag) -> SimpleNamespace:
    return SimpleNamespace(sampling_params=SimpleNamespace(extra_args=None if tag is None else {TAG: tag}))


@pytest.mark.parametrize("block, key", [
    ((0, 32), None), ((32, 64), None),  # every position before the start (64): exact, shared
    ((64, 96), (TAG, "rules", 64)),  # the start is the block's first position
    ((48, 80), (TAG, "rules", 64)),  # a block over the start
    ((96, 128), (TAG, "rules", 64)),
])
def test_blocks_from_the_speculation_start_carry_the_rules(block, key):
    assert speculated_block_key(request([64, 7, "rules"]), *block) == key


def test_the_block_that_ends_one_past_the_start_is_keyed_and_the_one_before_is_not():
    assert speculated_block_key(request([63, 7, "r"]), 32, 64) == (TAG, "r", 63)
    assert speculated_block_key(request([64, 7, "r"]), 32, 64) is None


@pytest.mark.parametrize("tag", [None, [0, 7, None], [0, 7]])  # untagged, lambda = 0 or exact, an older tag
def test_blocks_that_no_speculation_changes_are_shared(tag):
    assert speculated_block_key(request(tag), 0, 32) is None


def test_two_starts_key_the_same_tokens_apart():
    assert speculated_block_key(request([10, 1, "r"]), 0, 32) != speculated_block_key(request([20, 1, "r"]), 0, 32)


@pytest.mark.parametrize("block, key", [
    ((0, 32), None),  # before the observation window (from 40): shared
    ((32, 64), (TAG, "observed", 7)),  # holds the window's first position: this request's own, its prefill runs
    ((64, 96), (TAG, "observed", 7)),  # past the start: its own too
])
def test_a_prompt_scoring_draft_s_observation_window_is_never_served_from_the_cache(block, key):
    assert speculated_block_key(request([64, 7, "rules", 40]), *block) == key


def test_the_block_that_ends_at_the_window_s_first_position_is_shared_and_one_past_is_not():
    assert speculated_block_key(request([64, 7, None, 32]), 0, 32) is None
    assert speculated_block_key(request([64, 7, None, 31]), 0, 32) == (TAG, "observed", 7)


def test_two_requests_with_the_same_prompt_observe_apart():
    assert speculated_block_key(request([64, 1, None, 40]), 32, 64) != speculated_block_key(
        request([64, 2, None, 40]), 32, 64)


def test_a_window_every_worker_has_observed_is_shared_and_speculated_blocks_still_carry_the_rules():
    """The driver counts on every worker holding the prompt's observation (the tag's last field): its window may
    come from the prefix cache (exact blocks, keyed by their tokens), and blocks past the start keep the rules."""
    held, fresh = [64, 7, "r", 40, 0, 123, True], [64, 7, "r", 40, 0, 123, False]
    assert speculated_block_key(request(held), 32, 64) is None
    assert speculated_block_key(request(fresh), 32, 64) == (TAG, "observed", 7)
    assert speculated_block_key(request(held), 64, 96) == (TAG, "r", 64)


def test_a_prompts_digest_is_its_tokens():
    """The same tokens, the same digest (63 bits); one token changed, one more, or the tokens' order: another."""
    tokens = list(range(100, 600))
    digest = prompt_digest(tokens, len(tokens))
    assert digest == prompt_digest(list(tokens), len(tokens)) and 0 <= digest < 2**63
    others = [tokens[:-1] + [7], tokens + [1], tokens[::-1], tokens[:-1]]
    assert len({digest, *(prompt_digest(t, len(t)) for t in others)}) == 1 + len(others)


def test_a_prompts_digest_reads_the_tokens_before_its_start_and_the_start():
    """Tokens past the speculation start do not count (a loglikelihood continuation); an empty prompt and a
    one-token prompt, which both read the first token, differ by their start."""
    tokens = list(range(100, 600))
    assert prompt_digest(tokens, 300) == prompt_digest(tokens[:300] + [1, 2], 300) != prompt_digest(tokens, 301)
    assert prompt_digest(tokens, 0) != prompt_digest(tokens, 1)
