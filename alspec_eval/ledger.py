"""Request identity for the adapter: which model input belongs to which lm-eval request, and what it decided.

HFLM batches, pads, truncates and reorders requests, and its model calls see token tensors only. The ledger keys
every model input by its tokens (without padding), keeps each input's decisions as a :class:`RowRecord`, and sums
them per request (the samples log and :meth:`RequestLedger.samples`) and per task (the run's statistics).
"""

from __future__ import annotations

import dataclasses
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from lm_eval.api.instance import Instance

from .region import DecodeRegion, Trace
from .stats import AcceptanceStats, DraftStats

RowKey = tuple[int, ...]  # a model input's tokens, without padding: how a batch row is found again
SampleKey = tuple[str, int, int, int]  # a request: task, doc_id, idx (the request within its document), repeat


@dataclass(frozen=True)
class RowRecord:
    """What one model input decided: its statistics, and per token the number of layers that accepted."""

    stats: AcceptanceStats
    tokens: list[int] = field(default_factory=list)

    @classmethod
    def teacher_forced(cls, trace: Trace, row: int, start: int, end: int) -> RowRecord:
        """A teacher-forced input's decisions over physical positions [start, end)."""
        return cls(trace.row_stats(row, start, end), trace.accepted_layers(row, start, end))

    @classmethod
    def generated(cls, trace: Trace, region: DecodeRegion, row: int, new_tokens: list[int], prompt_len: int,
                  kept: Callable[[list[int]], int]) -> RowRecord:
        """A generated row's decisions up to where it would have stopped alone; the last kept token is never fed
        back. ``kept``: how many of the new tokens the row keeps (``StopRule.kept``)."""
        end = prompt_len + kept(new_tokens) - 1
        return cls(trace.row_stats(row, int(region.spec_start[row]), end),
                   trace.accepted_layers(row, prompt_len - 1, end))

    @classmethod
    def drafted(cls, num_layers: int, draft: DraftStats, kept: int) -> RowRecord:
        """A self-speculative row of ``kept`` tokens: attention is exact (no layer accepts A~), the draft statistics
        are all there is."""
        return cls(dataclasses.replace(AcceptanceStats.zeros(num_layers), draft=draft), [0] * kept)


def model_input(context_enc: list[int], continuation_enc: list[int], max_length: int) -> RowKey:
    """HFLM's truncation of a loglikelihood pair (``HFLM._loglikelihood_tokens``): context and continuation, cut to
    their last ``max_length + 1`` tokens, without the last token (whose logit nothing reads)."""
    return tuple((context_enc + continuation_enc)[-(max_length + 1):][:-1])


def row_keys(context: torch.Tensor, attention_mask: torch.Tensor | None) -> list[RowKey]:
    """The keys of a left-padded batch of prompts."""
    pads = [0] * len(context) if attention_mask is None else (attention_mask.shape[1] - attention_mask.long().sum(-1)).tolist()
    return [tuple(row[pad:].tolist()) for row, pad in zip(context, pads, strict=True)]


def teacher_forced_passes(inputs: list[tuple[RowKey, int]]) -> list[list[int]]:
    """Indices of ``inputs`` (key, speculation start) split into passes in which each key has one start: the same
    model input scored from two starts (two context/continuation splits of one text) runs in two passes."""
    passes: list[list[int]] = []
    starts: list[dict[RowKey, int]] = []
    for i, (key, start) in enumerate(inputs):
        slot = next((p for p, seen in enumerate(starts) if seen.get(key, start) == start), len(passes))
        if slot == len(passes):
            passes.append([])
            starts.append({})
        passes[slot].append(i)
        starts[slot][key] = start
    return passes


@dataclass
class RequestLedger:
    """The records of the requests in flight, per task and per sample sums of the finished ones."""

    num_layers: int
    trace_tokens: bool = False
    records: dict[RowKey, RowRecord] = field(default_factory=dict)  # this task's model inputs so far
    starts: dict[RowKey, int] = field(default_factory=dict)  # teacher forcing: the inputs of this pass
    lengths: list[int] = field(default_factory=list)  # their distinct lengths, longest first
    task_stats: dict[str, AcceptanceStats] = field(default_factory=dict)  # this rank's
    sample_stats: dict[SampleKey, dict[str, Any]] = field(default_factory=dict)  # this rank's
    decode_tokens: int = 0  # generated or teacher-forced tokens answered so far, for progress displays

    def run(self, requests: list[Instance], run: Callable[[list[Instance]], list],
            keys_of: Callable[[Instance], list[RowKey]]) -> list:
        """Run each task's requests apart (``run``: HFLM's own request method), then add every request's records to
        its sample and task."""
        by_task: dict[str, list[int]] = defaultdict(list)
        for i, inst in enumerate(requests):
            by_task[inst.task_name or "default"].append(i)
        results: list = [None] * len(requests)
        seen: Counter[int] = Counter()
        for task, indices in by_task.items():
            self.records.clear()
            outputs = run([requests[i] for i in indices])
            total = self.task_stats.get(task, AcceptanceStats.zeros(self.num_layers))
            for i, out in zip(indices, outputs, strict=True):
                results[i] = out
                inst = requests[i]
                seen[id(inst)] += 1
                if seen[id(inst)] > inst.repeats:  # lm-eval's padding of a data-parallel rank: not a request
                    continue
                rows = [self.records[key] for key in keys_of(inst)]
                self.decode_tokens += sum(len(r.tokens) for r in rows)
                sample = sum((r.stats for r in rows), AcceptanceStats.zeros(self.num_layers))
                total = total + sample
                self._log_sample(inst, seen[id(inst)] - 1, sample, rows)
            self.task_stats[task] = total
        return results

    def _log_sample(self, inst: Instance, repeat: int, sample: AcceptanceStats, rows: list[RowRecord]) -> None:
        """A request's statistics, kept by (task, doc_id, idx, repeat) and appended to its arguments: lm-eval's samples
        log writes a request's arguments and nothing else of it."""
        entry = sample.summary()
        if self.trace_tokens:
            entry["accepted_layers_per_token"] = [t for r in rows for t in r.tokens]
        self.sample_stats[inst.task_name or "default", inst.doc_id, inst.idx, repeat] = entry
        args = inst.arguments if isinstance(inst.arguments, tuple) else (inst.arguments,)
        if args and isinstance(args[-1], dict) and "alspec" in args[-1]:  # a repeated request: log it once
            args = args[:-1]
        inst.arguments = (*args, {"alspec": entry})

    def reset(self) -> None:
        """Start counting anew (a sweep's next cell)."""
        self.task_stats, self.sample_stats = {}, {}

    # ------------------------------------------------------------------ finding batch rows again

    @contextmanager
    def teacher_forcing(self, starts: dict[RowKey, int]) -> Iterator[None]:
        """The inputs of one teacher-forced pass and where each speculates; :meth:`match` finds them in a batch."""
        self.starts, self.lengths = starts, sorted({len(k) for k in starts}, reverse=True)
        try:
            yield
        finally:
            self.starts, self.lengths = {}, []

    def match(self, row: list[int]) -> RowKey:
        """The known input that this right-padded batch row holds: the longest known input the row starts with,
        followed only by one repeated (padding) token. Needs no pad id and no knowledge of lm-eval's batching."""
        for length in self.lengths:
            if length <= len(row) and len(set(row[length:])) <= 1 and tuple(row[:length]) in self.starts:
                return tuple(row[:length])
        raise RuntimeError("a loglikelihood batch row matches no request of this pass")

    def prompt_key(self, tokens: list[int]) -> RowKey:
        """The generated input of a prompt: itself, or the left-truncated prompt HFLM generated from."""
        key = tuple(tokens)
        if key in self.records:
            return key
        return next(k for k in self.records if key[-len(k):] == k)


def samples_path(stats_path: Path) -> Path:
    """Where a statistics file's per-request entries go: `stats.json` -> `stats.samples.jsonl`."""
    return stats_path.with_name(stats_path.stem + ".samples.jsonl")


def sample_rows(samples: dict[SampleKey, dict[str, Any]]) -> list[dict[str, Any]]:
    """Per-request statistics as rows keyed by task, doc_id, idx (the request within its document) and repeat."""
    return [{"task": task, "doc_id": doc, "idx": idx, "repeat": repeat, **entry}
            for (task, doc, idx, repeat), entry in sorted(samples.items())]
