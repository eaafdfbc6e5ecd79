"""Every draft that runs inside vLLM selects from its paged cache the keys it selects from the HF engine's contiguous
one (approx_check.paged: both layouts, blocks of 16 and 128, shuffled and shared blocks, a prompt observed over three
prefill steps, a request with an empty prompt); a reader that gets the block table wrong is caught;
and the drafts that cannot run there are exactly those that read what only the HF layer has, refused in one line.
Torch only, no vLLM."""

from __future__ import annotations

import pytest
import torch

from alspec_eval.approx_check import paged as check
from alspec_eval.config import SpeculationConfig
from alspec_eval.errors import ConfigError
from alspec_eval.vllm import paged
from alspec_eval.vllm.checks import check_runs_in_vllm
from default_approximations import APPROXIMATIONS, approx_args
from default_presses import PRESSES, press_args

WINDOW = 16
GEOMETRIES = [(4, 2, 16), (3, 3, 24)]  # (Hq, Hkv, D): grouped-query heads, and one query head per KV head
HF_ONLY = {"CriticalKVPress", "SnapKVPress", "PyramidKVPress", "ExpectedAttentionPress", "CapPress",
           "LeverageScorePress", "NonCausalAttnPress", "CompactorPress"}


def draft(name: str):
    args = press_args(name, WINDOW) if name in PRESSES else approx_args(name, WINDOW)
    return SpeculationConfig(window=WINDOW, **args).approx


IN_VLLM = APPROXIMATIONS + [p for p in PRESSES if p not in HF_ONLY]


@pytest.mark.parametrize("geometry", GEOMETRIES)
@pytest.mark.parametrize("name", IN_VLLM)
def test_a_paged_cache_selects_as_a_contiguous_one(name, geometry):
    assert check.paged_equals_contiguous(draft(name), *geometry, WINDOW) == []


def test_the_drafts_that_cannot_run_in_vllm_read_what_only_the_hf_layer_has():
    assert {name for name in APPROXIMATIONS + PRESSES if draft(name).hf_only} == HF_ONLY


@pytest.mark.parametrize("name", sorted(HF_ONLY))
def test_a_draft_that_cannot_run_in_vllm_is_refused_in_one_line(name):
    with pytest.raises(ConfigError) as err:
        check_runs_in_vllm(draft(name))
    message = str(err.value)
    assert "\n" not in message and f"approx=kvpress:{name} cannot run in vLLM" in message
    assert "--model alspec" in message and ("o_proj" in message or "hidden states" in message)


def _shifted(read):
    """A reader whose contexts start one key late (the block table read from its second slot)."""
    def read_contexts(*args):
        keys, values, pad = read(*args)
        return keys.roll(-1, 2), None if values is None else values.roll(-1, 2), pad
    return read_contexts


def _other_request(read):
    """A reader that takes each request's blocks from the next row of the block table."""
    def read_contexts(kv_cache, layout, block_table, block_size, request, *rest):
        return read(kv_cache, layout, block_table, block_size, (request + 1) % len(block_table), *rest)
    return read_contexts


@pytest.mark.parametrize("broken", [_shifted, _other_request])
@pytest.mark.parametrize("name", ["quest", "topk", "snapkv", "KnormPress"])
def test_a_reader_that_gets_the_cache_wrong_is_caught(monkeypatch, broken, name):
    monkeypatch.setattr(paged, "read_contexts", broken(paged.read_contexts))
    found = check.paged_equals_contiguous(draft(name), 4, 2, 16, WINDOW)
    assert len(found) == 4 and all("positions select other keys" in line for line in found), found


@pytest.mark.parametrize("window, page", [(16, 4), (24, 24), (32, 32)])  # pages smaller and larger than a block
def test_quest_pages_across_blocks_select_as_from_a_contiguous_cache(window, page):
    approx = SpeculationConfig(window=window, approx="quest", approx_args=f"page:{page}").approx
    batch = check.Batch(4, 2, 16, window)
    _, table = batch.cache(check.LAYOUTS[0], 16, seed=1)
    # a page of the longest request over two blocks that are not neighbours in the cache (where pages span blocks)
    longest = table[2].tolist()
    pairs = [(longest[t // 16], longest[(t + page - 1) // 16]) for t in range(0, batch.lengths[2] - page, page)]
    assert page <= 16 or any(b != a + 1 and b != a for a, b in pairs)
    for layout in check.LAYOUTS:
        assert batch.paged(approx, layout, 16) == batch.contiguous(approx)


@pytest.mark.parametrize("name", ["quest", "topk", "KnormPress"])
def test_requests_read_one_at_a_time_where_their_contexts_exceed_the_budget(monkeypatch, name):
    """With a budget smaller than any context, each request's context is read alone: the same keys."""
    groups = []
    chunks = paged._chunks
    monkeypatch.setattr(paged, "_chunks", lambda *a, **k: groups.append(chunks(*a, **k)) or groups[-1])
    monkeypatch.setattr(paged, "CONTEXT_BUDGET", 1)
    assert check.paged_equals_contiguous(draft(name), 4, 2, 16, WINDOW) == []
    assert groups and all(len(group) == 1 for found in groups for group in found)


def test_requests_share_a_read_up_to_the_budget():
    lengths = torch.tensor([100, 300, 200, 50])
    per_token = 1000
    paged_budget = 2 * 300 * per_token  # two of the longest contexts
    groups = paged._chunks(lengths, per_token, one_each=False, budget=paged_budget)
    assert sorted(i for g in groups for i in g.tolist()) == [0, 1, 2, 3]
    for group in groups:
        assert len(group) == 1 or int(lengths[group].max()) * per_token * len(group) <= paged_budget
    assert [len(g) for g in groups] == [3, 1]  # shortest first: 50, 100 and 200 padded to 200 fit, then 300
