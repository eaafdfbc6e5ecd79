"""Every draft that runs inside vLLM selects from its paged cache the keys it selects from the HF engine's contiguous
one (approx_check.paged: both layouts, blocks of 16 and 128, shuffled and shared blocks, a prompt observed over three
prefill steps, a request with an empty prompt); a reader that gets the block table wrong is caught, of the contexts
or of keys scored where they lie;
and the drafts that cannot run there are exactly those that read what only the HF layer has, refused in one line.
Torch only, no vLLM."""

from __future__ import annotations

import pytest
import torch

from alspec_eval.approx_check import paged as check
from alspec_eval.config import SpeculationConfig
from alspec_eval.errors import ConfigError
from alspec_eval.vllm import paged
from alspec_eval.vllm.kept import allocate
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
KEPT = ["quest", "KnormPress", "CURPress"]  # the drafts that keep page summaries beside vLLM's cache (kept_page)


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


def _shifted_scores(score):
    """The same, for keys scored where they lie (vLLM's CPU kernel: a draft that ranks by scores)."""
    def key_scores(*args):
        return score(*args).roll(-1, -1)
    return key_scores


def _other_request(read):
    """A reader that takes each request's blocks from the next row of the block table."""
    def read_contexts(kv_cache, layout, block_table, block_size, request, *rest):
        return read(kv_cache, layout, block_table, block_size, (request + 1) % len(block_table), *rest)
    return read_contexts


def _other_request_scores(score):
    def key_scores(kv_cache, block_table, query, request, *rest):
        return score(kv_cache, block_table, query, (request + 1) % len(block_table), *rest)
    return key_scores


@pytest.mark.parametrize("broken", [(_shifted, _shifted_scores), (_other_request, _other_request_scores)],
                         ids=["shifted", "other_request"])
@pytest.mark.parametrize("name", ["topk", "snapkv", "KeyDiffPress"])
def test_a_reader_that_gets_the_cache_wrong_is_caught(monkeypatch, broken, name):
    """On both layouts at blocks of 16 and 128, whether the draft's keys are read (contexts) or scored where they
    lie (top-k on the CPU's layout, where the C kernel builds)."""
    from alspec_eval.vllm import native

    monkeypatch.setattr(paged, "read_contexts", broken[0](paged.read_contexts))
    monkeypatch.setattr(native, "key_scores", broken[1](native.key_scores))
    found = [line for line in check.paged_equals_contiguous(draft(name), 4, 2, 16, WINDOW)
             if "declares reads_keys" not in line]  # snapkv's hint: its prompt's keys were read wrong
    assert len(found) == 4 and all("positions select other keys" in line for line in found), found


# pages smaller and larger than a block; pages of 1 and 2 keys, whose bounds are not kept (the keys read instead)
@pytest.mark.parametrize("window, page", [(16, 1), (16, 2), (16, 4), (24, 24), (32, 32)])
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


def test_snapkv_selects_for_the_rows_of_several_requests_at_once():
    """SnapKV's prompts are observed one request at a time inside vLLM; their rankings stack
    (``stack_prepared``), so a step selects for every request's rows in one group (the keys: the paged property
    above, and alone past the budget below)."""
    approx = draft("snapkv")
    batch = check.Batch(4, 2, 16, WINDOW)
    cache, _ = batch.cache(check.LAYOUTS[0], 16, seed=1)
    request = torch.cat([torch.full((check.SPECULATED,), row) for row in range(len(batch.lengths))])
    groups = paged.Contexts.build(request, torch.cat(batch.pos), approx, cache).groups
    assert approx.stacks_prepared and [len(g.group) for g in groups] == [4]


@pytest.mark.parametrize("name", ["quest", "topk", "KnormPress", "snapkv"])
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


def _reads(monkeypatch) -> list[int]:
    """Counts the contexts read from the paged cache (each call's requests)."""
    reads, read = [], paged.read_contexts
    monkeypatch.setattr(paged, "read_contexts", lambda *a, **k: reads.append(len(a[4])) or read(*a, **k))
    return reads


@pytest.mark.parametrize("name", IN_VLLM)
def test_only_drafts_that_read_keys_read_contexts_once_observed(monkeypatch, name):
    """Past the prompt's observation, a draft that declares ``reads_keys = False`` (SnapKV's family: its keys come
    from the prompt's scores and the position; the presses that rank by position or by chance) reads no context from the paged cache, nor does one that keeps page
    summaries beside it (Quest, Knorm, CUR); every other selecting draft reads each request's once a layer, however many of its
    positions speculate."""
    approx = draft(name)
    if approx.keys_by_position:
        pytest.skip("its keys are its position_ranges: no context is read")
    batch = check.Batch(4, 2, 16, WINDOW)
    cache, table = batch.cache(check.LAYOUTS[0], 16, seed=1)
    settings = paged.Settings((0.0,), WINDOW, 1, approx)
    prompts = paged.Prompts()
    if approx.prompt_keys:
        batch._observe(approx, cache, check.LAYOUTS[0], table, 16, settings, prompts)
    kept = allocate(approx, cache, check.LAYOUTS[0]) if approx.kept_page() else None
    reads = _reads(monkeypatch)
    request = torch.cat([torch.full((check.SPECULATED,), row) for row in range(len(batch.lengths))])
    query = torch.cat([q[p] for q, p in zip(batch.queries, batch.pos)])
    observed = {row: prompts.observed.get((row, 0)) for row in range(len(batch.lengths))}
    paged.selected_positions(query, cache, check.LAYOUTS[0], table, 16, request, torch.cat(batch.pos), settings,
                             observed, kept=kept)
    assert approx.reads_keys == (name not in ("snapkv", "RandomPress", "StreamingLLMPress")), \
        "the drafts that declare reading no key"
    assert (approx.kept_page() is not None) == (name in KEPT), "the drafts that keep page summaries"
    assert sum(reads) == (len(batch.lengths) if approx.reads_keys and kept is None else 0), reads


def test_a_draft_that_reads_keys_it_declares_unread_is_named():
    """A draft that declares ``reads_keys = False`` and still ranks by the keys selects otherwise from vLLM's cache
    (whose keys it is handed as NaN): alspec-check-approx's paged property names the declaration."""
    import dataclasses

    from alspec_eval.approximations.topk import TopK

    liar = dataclasses.make_dataclass("Liar", [], bases=(TopK,), frozen=True, namespace={"reads_keys": False})()
    found = check.paged_equals_contiguous(liar, 4, 2, 16, WINDOW)
    assert "positions select other keys" in found[0] and "declares reads_keys = False" in found[-1], found


def _pages_shifted(summaries):
    """Page summaries read one part late."""
    def page_summaries(kept, *args):
        return summaries(kept.roll(-1, 1), *args)
    return page_summaries


def _pages_of_other_request(summaries):
    def page_summaries(kept, approx, block_table, block_size, requests, length):
        return summaries(kept, approx, block_table, block_size, (requests + 1) % len(block_table), length)
    return page_summaries


@pytest.mark.parametrize("broken", [_pages_shifted, _pages_of_other_request])
@pytest.mark.parametrize("name", KEPT)
def test_kept_pages_read_wrong_are_caught(monkeypatch, broken, name):
    """Quest, Knorm and CUR prepare from the page summaries kept beside the cache (vllm.kept: bounds, scores, norms):
    read from the wrong part or request, they select other keys than from a contiguous cache."""
    monkeypatch.setattr(paged, "page_summaries", broken(paged.page_summaries))
    found = check.paged_equals_contiguous(draft(name), 4, 2, 16, WINDOW)
    assert len(found) == 4 and all("positions select other keys" in line for line in found), found
