"""The request ledger: finding batch rows again, HFLM's truncation, passes, and per-sample records."""

from __future__ import annotations

import pytest
import torch
from lm_eval.api.instance import Instance

from alspec_eval.ledger import RequestLedger, RowRecord, model_input, sample_rows, teacher_forced_passes
from alspec_eval.region import Trace
from alspec_eval.stats import ACCEPTED, REJECTED, AcceptanceStats


def test_rows_are_found_whatever_the_pad_token():
    ledger = RequestLedger(num_layers=2)
    with ledger.teacher_forcing({(5, 7, 9): 1, (5, 7): 1, (3,): 0}):
        assert ledger.match([5, 7, 9, 42, 42]) == (5, 7, 9)
        assert ledger.match([5, 7, 42, 42, 42]) == (5, 7)
        assert ledger.match([3, 1, 1]) == (3,)
        with pytest.raises(RuntimeError, match="matches no request"):
            ledger.match([4, 1, 1])
    with pytest.raises(RuntimeError, match="matches no request"):  # outside the pass nothing is known
        ledger.match([3, 1, 1])


def test_model_input_is_hflms_truncation():
    assert model_input([1, 2, 3], [4, 5], max_length=10) == (1, 2, 3, 4)
    assert model_input([1, 2, 3], [4, 5], max_length=3) == (2, 3, 4)  # the last max_length + 1 tokens, minus the last


def test_one_input_from_two_starts_runs_in_two_passes():
    inputs = [((1, 2, 3), 1), ((4, 5), 1), ((1, 2, 3), 2), ((1, 2, 3), 1), ((1, 2, 3), 0)]
    assert teacher_forced_passes(inputs) == [[0, 1, 3], [2], [4]]


def test_samples_are_kept_per_document_request_and_repeat():
    ledger = RequestLedger(num_layers=1)
    stats = AcceptanceStats.zeros(1)
    stats.speculated[0], stats.accepted[0] = 4, 3
    requests = [Instance("loglikelihood", {}, ("a", "b"), idx, ("t", doc, 2)) for doc in (7, 3) for idx in (0, 1)]

    def run(batch):
        ledger.records.update({(id(inst),): RowRecord(stats) for inst in batch})
        return [0.0] * len(batch)

    doubled = [r for r in requests for _ in range(2)]  # lm-eval sends a request once per repeat
    ledger.run(doubled, run, lambda inst: [(id(inst),)])
    rows = sample_rows(ledger.sample_stats)
    keys = [(s["task"], s["doc_id"], s["idx"], s["repeat"]) for s in rows]
    assert keys == [("t", doc, idx, rep) for doc in (3, 7) for idx in (0, 1) for rep in (0, 1)]
    assert all(s["accepted"] == 3 and s["speculated"] == 4 for s in rows)
    assert ledger.task_stats["t"].accepted[0] == 3 * len(doubled)
    assert requests[0].arguments[-1]["alspec"]["accepted"] == 3  # the samples log's entry, once per request


def test_per_token_trace_covers_every_kept_token_even_where_nothing_was_traced():
    """accepted_layers over [start, end): traced positions count their accepted layers; positions before the trace,
    after it, or of a trace that never ran (a plan that never speculates) accepted nothing."""
    codes = torch.tensor([[[ACCEPTED, REJECTED], [ACCEPTED, ACCEPTED], [0, 0]]])  # positions 10, 11, 12
    trace = Trace(codes, torch.zeros(codes.shape), offset=10)
    assert trace.accepted_layers(0, 10, 13) == [1, 2, 0]
    assert trace.accepted_layers(0, 8, 12) == [0, 0, 1, 2]
    assert trace.accepted_layers(0, 11, 15) == [2, 0, 0, 0]
    assert trace.accepted_layers(0, 4, 7) == [0, 0, 0]  # all before the trace (not sliced from its end)
    assert trace.accepted_layers(0, 14, 16) == [0, 0]
    assert trace.accepted_layers(0, 12, 12) == []
    assert Trace(torch.empty(0), torch.empty(0)).accepted_layers(0, 5, 8) == [0, 0, 0]
