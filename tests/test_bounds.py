"""A draft reads keys of [0, pos] only, whatever it returns (tests/bounds_drafts.py's four drafts): the one
rule (semantics.readable_ranges, readable_keys), the count kept on the device (bounds.Breaches), the hf engine
reading the cut keys and refusing the call in one line with no result written, and alspec-check-approx naming
every broken draft in one line. The paged paths: tests/vllm_engine/test_paged_bounds.py."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
from torch.overrides import TorchFunctionMode

from alspec_eval import semantics
from alspec_eval.approx_check.properties import ranges_lie_in_the_context
from alspec_eval.approximations import make_approximation
from alspec_eval.approximations.local import Local
from alspec_eval.bounds import Breaches, DraftOutOfBounds
from alspec_eval.region import DecodeRegion
from bounds_drafts import BeforeContext, PastQuery, PeeksEight
from helpers import TOKENIZER, alspec_lm, ll_requests


class ReadBacks(TorchFunctionMode):
    """Calls that read a tensor's values on the host (a stream stall on a GPU)."""

    NAMES = {"item", "__bool__", "__int__", "__float__", "__index__", "cpu", "tolist", "nonzero", "numpy"}

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", "") in self.NAMES:
            self.calls.append(func.__name__)
        return func(*args, **(kwargs or {}))


def test_ranges_are_cut_to_the_context():
    """Per query: a range inside stays; one before position 0 or past pos is cut there and flagged; an empty range
    is never flagged; a query with nothing readable left reads its own key (its A~ stays a number)."""
    pos = torch.tensor([10, 10, 10, 10, 10, 5])
    starts = torch.tensor([[0, 5], [-3, 5], [0, 8], [-100, 20], [4, 4], [0, 2]])
    ends = torch.tensor([[3, 11], [3, 11], [0, 12], [-90, 30], [4, 11], [1, 6]])
    cut_starts, cut_ends, outside = semantics.readable_ranges(starts, ends, pos)
    assert outside.tolist() == [False, True, True, True, False, False]
    assert cut_starts.tolist() == [[0, 5], [0, 5], [0, 8], [10, 11], [4, 4], [0, 2]]
    assert cut_ends.tolist() == [[3, 11], [3, 11], [0, 11], [11, 11], [4, 11], [1, 6]]


def test_selected_keys_are_moved_into_the_context():
    """A counted key before 0 or past pos is read as the nearest readable one (as many keys kept, no mask added);
    a key that does not count (``valid`` False) moves too, but is never flagged."""
    low, high = torch.tensor([0, 0, 0, 2])[:, None, None], torch.tensor([10, 10, 10, 12])[:, None, None]
    keys = torch.tensor([[[0, 10, 3]], [[-2, 5, 11]], [[4, 5, 40]], [[1, 2, 12]]])  # the last row's pad is 2
    valid = torch.tensor([[[True, True, True]], [[True, True, True]], [[True, True, False]], [[True] * 3]])
    moved, outside = semantics.readable_keys(keys, valid, low, high)
    assert moved.tolist() == [[[0, 10, 3]], [[0, 5, 10]], [[4, 5, 10]], [[2, 2, 12]]]
    assert outside.tolist() == [False, True, False, True]
    assert semantics.readable_keys(keys, None, low, high)[1].tolist() == [False, True, True, True]
    heads = torch.tensor([[[3, 4], [9, 11]]])  # a key per KV head: the second head's reaches past pos
    assert semantics.readable_keys(heads, None, low[:1], high[:1])[1].tolist() == [True]


def test_breaches_are_counted_without_a_read_back_and_taken_once():
    """Counting on the device reads nothing back (a GPU's stream stays unstalled per layer); take reads once and
    starts anew."""
    breaches = Breaches()
    assert breaches.take() == (0, -1)
    with ReadBacks() as reads:
        breaches.add(torch.tensor([False, True, True]), torch.tensor([7, 40, 30]))
        breaches.add(torch.tensor([], dtype=torch.bool), torch.tensor([], dtype=torch.long))
        breaches.add(torch.tensor([True, False]), torch.tensor([12, 90]))
        semantics.readable_keys(torch.tensor([[[3, 50]]]), None, torch.zeros(1, 1, 1, dtype=torch.long),
                                torch.full((1, 1, 1), 9))
    assert reads.calls == []
    assert breaches.take() == (3, 40)
    assert breaches.take() == (0, -1)


def _traced(lm, ids: torch.Tensor, start: int) -> tuple[torch.Tensor, DraftOutOfBounds | None]:
    """One teacher-forced pass speculating from ``start``: its d/n and what the call raised on exit."""
    refused = None
    try:
        region = DecodeRegion.build([0], [start], tokens=ids)
        with torch.no_grad(), lm.speculator.speculating(region, lm.spec_config) as trace:
            lm.model(ids)
    except DraftOutOfBounds as err:
        refused = err
    return trace.ratios, refused


class CutEight(Local):
    """PeeksEight's keys moved into [0, pos] by the draft itself: what the hf engine reads of PeeksEight."""

    def per_pass(self, pos, pad, key_len, window, window_align):
        peeks = PeeksEight().per_pass(pos, pad, key_len, window, window_align)[0]
        return (torch.minimum(peeks, (pad + pos)[:, None]),)


@pytest.mark.slow
def test_the_hf_engine_reads_what_a_future_reading_draft_selects_cut_and_refuses_the_call(tiny_llama):
    """Teacher-forced scoring with PeeksEight (per_pass selects the 2S keys ending 8 past the query, which the cache
    holds): every layer reads the keys cut to [0, pos] (the d/n of a draft that cuts them itself, bit for bit), and
    the call ends refused in one line naming the draft, the last position and how many positions read outside."""
    ids = torch.tensor([TOKENIZER("It was the best of times, it was the worst of times, it was")["input_ids"]])
    start = 30
    peeks, refused = _traced(alspec_lm(tiny_llama, approx="bounds_drafts:PeeksEight"), ids, start)
    cut, clean = _traced(alspec_lm(tiny_llama, approx=CutEight()), ids, start)
    assert clean is None and refused is not None
    assert peeks[0, start:].isfinite().all() and torch.equal(peeks.nan_to_num(-1), cut.nan_to_num(-1))
    message = str(refused)
    speculated = ids.shape[1] - start  # every one non-trivial (start > 2S) and reading 8 keys past itself
    assert "\n" not in message and message.startswith("approx=bounds_drafts:PeeksEight read keys outside [0, pos]")
    assert f"at position {ids.shape[1] - 1} (found {speculated} times)" in message


@pytest.mark.slow
def test_a_refused_loglikelihood_writes_no_result(tiny_llama):
    """Through lm-eval's loglikelihood: the refusal propagates and the task has no statistics; a draft within
    bounds (local) answers the same requests."""
    lm = alspec_lm(tiny_llama, approx="bounds_drafts:PeeksEight")
    with pytest.raises(DraftOutOfBounds, match="approx=bounds_drafts:PeeksEight"):
        lm.loglikelihood(ll_requests("refused"), True)
    assert "refused" not in lm.statistics()["tasks"]
    local = alspec_lm(tiny_llama, approx="local")
    assert all(math.isfinite(ll) for ll, _ in local.loglikelihood(ll_requests("kept"), True))
    assert local.statistics()["tasks"]["kept"]["total"]["speculated"]


@pytest.mark.parametrize("draft, line", [
    (BeforeContext(), f"window_align=1: at position 16 the ranges [{1 - 100_000}, {17 - 100_000}) reach outside "
                      "[0, 16]"),
    (PastQuery(), "window_align=1: at position 16 the ranges [1, 4113) reach outside [0, 16]"),
])
def test_check_approx_names_ranges_that_leave_the_context(draft, line):
    """alspec-check-approx's position_ranges property: the first position whose ranges leave [0, pos], and each
    range wider than its width."""
    contract = SimpleNamespace(approx=draft, window=8)
    assert ranges_lie_in_the_context(contract) == [line]


@pytest.mark.parametrize("name", ["sink", "local"])
def test_check_approx_passes_the_built_in_ranges_at_every_alignment(name):
    contract = SimpleNamespace(approx=make_approximation(name), window=8)
    assert ranges_lie_in_the_context(contract) == []


def test_check_approx_names_a_range_wider_than_its_width():
    class Narrow(Local):
        def position_ranges(self, pos, window, window_align):
            return (pos - 2 * window + 1)[:, None], (pos + 1)[:, None], (2 * window - 1,)

    contract = SimpleNamespace(approx=Narrow(), window=8)
    assert ranges_lie_in_the_context(contract) == ["window_align=1: range 0 holds up to 16 keys, more than its "
                                                   "width 15"]


def test_check_approx_names_a_draft_whose_declaration_disagrees_with_its_ranges():
    """vLLM chooses how it verifies from ``keys_by_position``: a draft with ranges that does not declare it, and one
    that declares it without ranges, are each named."""
    class Undeclared(Local):
        keys_by_position = False

    class Declared(type(make_approximation("topk"))):
        keys_by_position = True

    assert ranges_lie_in_the_context(SimpleNamespace(approx=Undeclared(), window=8)) == [
        "window_align=1: position_ranges returned ranges, but the draft declares keys_by_position = False: declare it "
        "True exactly where position_ranges gives the keys (vLLM chooses how it verifies from the declaration)"]
    assert ranges_lie_in_the_context(SimpleNamespace(approx=Declared(), window=8))[0].startswith(
        "window_align=1: position_ranges returned None, but the draft declares keys_by_position = True")


@pytest.fixture(scope="module")
def tiny_llama():
    from alspec_eval.approx_check.models import tiny_model

    return tiny_model("llama", layers=3)

