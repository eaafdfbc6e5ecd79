"""Shared prefill for sweeps: compute the exact prompt once, fork the KV cache per variant.

With `speculate_prefill=false` the prompt's KV cache is the same for every lambda, so a
sweep's variants (baseline, each lambda, pure sink) run as rows of one batch after one
exact prefill, each row with its own line of the decision plan. lm-eval still scores each
variant on its own: each variant answers through :meth:`SharedPrefill.answers` (the adapter's
``answering(row, shared=...)``); the first pass computes every variant, later passes replay the
stored generations / logits of their variant through the same HFLM code.
Self-speculation variants (one per gamma) decode each row alone from its slice of the same
prefill; their teacher-forced rows are exact (token-level speculation scores nothing differently).

It returns tokens, logits and records; it calls nothing of the adapter's (HFLM's own generation comes as an argument).
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import DynamicCache, PreTrainedModel

from .answers import HFCall, HFGenerate
from .compat import with_cache
from .config import SpeculationConfig
from .ledger import RowKey, RowRecord, row_keys
from .plan import Plan
from .region import DecodeRegion
from .rows import Row
from .selfspec import check_greedy, row_cache, selfspec_generate
from .prompt_observer import PromptPrefix
from .speculator import Speculator
from .stopping import StopRule


@dataclass
class _Stored:
    """One (request input, variant)'s record and what it answers with: generated tokens, or the logits HFLM reads
    (from position ``lo`` on)."""

    record: RowRecord
    generated: torch.Tensor | None = None
    logits: torch.Tensor | None = None
    lo: int = 0


@dataclass
class SharedPrefill:
    """What the first pass computed for every sweep row (a variant), keyed by (request input, variant index)."""

    variants: list[Row]
    model: PreTrainedModel
    speculator: Speculator
    config: SpeculationConfig  # the base (the sweep's window); each fork its approximation and window, each row its plan
    pad_token_id: int
    rows: dict[tuple[RowKey, int], _Stored] = field(default_factory=dict)

    def answers(self, row: Row) -> Replay:
        """The source that answers as ``row`` (one of the variants)."""
        return Replay(self, self.variants.index(row))

    def plan(self, batch: int, variants: list[Row]) -> Plan:
        """The decision plan of a batch of ``batch`` requests, each repeated once per variant: each row its variant's
        thresholds."""
        lines = [v.config(self.config).thresholds(self.speculator.num_layers) for v in variants]
        return Plan.of_rows([line for _ in range(batch) for line in lines])

    def generate(self, context: torch.Tensor, max_length: int, stop: list[str], rule: StopRule,
                 generation_kwargs: dict[str, Any], hf_generate: HFGenerate,
                 variant: int) -> tuple[torch.Tensor, list[RowRecord]]:
        """Generations of ``variant`` and their records; the first pass generates every variant."""
        keys = row_keys(context, generation_kwargs.get("attention_mask"))
        if any((key, 0) not in self.rows for key in keys):
            for key, v, stored in self._generate_all(context, max_length, stop, rule, dict(generation_kwargs),
                                                           hf_generate):
                self.rows[key, v] = stored
        entries = [self.rows[key, variant] for key in keys]
        width = max(len(e.generated) for e in entries)
        out = context.new_full((len(context), context.shape[1] + width), self.pad_token_id)
        out[:, :context.shape[1]] = context
        for b, entry in enumerate(entries):
            out[b, context.shape[1]:context.shape[1] + len(entry.generated)] = entry.generated
        return out, [e.record for e in entries]

    def forward(self, inps: torch.Tensor, keys: list[RowKey], starts: list[int],
                variant: int) -> tuple[torch.Tensor, list[RowRecord]]:
        """Teacher-forced logits of ``variant`` and their records; the first pass computes all.

        Only the logits HFLM reads are kept (from the last context token on); the rest of the output is zero.
        """
        if any((key, 0) not in self.rows for key in keys):
            logits, first, records = self._forward_all(inps, keys, starts)
            variants = len(self.variants)
            for r, record in enumerate(records):
                key, start = keys[r // variants], starts[r // variants]
                lo = max(start - 1, 0)  # HFLM reads the logits from the last context token on
                self.rows[key, r % variants] = _Stored(record, logits=logits[r, lo - first:len(key) - first], lo=lo)
        entries = [self.rows[key, variant] for key in keys]
        out = inps.new_zeros((*inps.shape, entries[0].logits.shape[-1]), dtype=entries[0].logits.dtype)
        for b, (key, entry) in enumerate(zip(keys, entries, strict=True)):
            out[b, entry.lo:len(key)] = entry.logits
        return out, [e.record for e in entries]

    def _generate_all(self, context: torch.Tensor, max_length: int, stop: list[str], rule: StopRule,
                      generation_kwargs: dict[str, Any], hf_generate: HFGenerate) -> list[tuple[RowKey, int, _Stored]]:
        """Every variant after one exact prefill of the prompts (all but their last token): per output row its
        prompt key, variant index and stored record with the generated tokens."""
        model = self.model
        mask = generation_kwargs.pop("attention_mask", None)
        mask = torch.ones_like(context) if mask is None else mask
        cache = DynamicCache(config=model.config)
        prefix = None
        if context.shape[1] > 1:
            positions = (mask.long().cumsum(-1) - 1).clamp(min=0)
            with torch.no_grad(), self._capturing(context.shape[1] - 1) as prefix:
                model(context[:, :-1], attention_mask=mask[:, :-1], position_ids=positions[:, :-1],
                      **with_cache(model, cache), use_cache=True, logits_to_keep=1)
        keys, pads = row_keys(context, mask), (mask.shape[1] - mask.long().sum(-1)).tolist()
        rows = []
        for v, variant in enumerate(self.variants):
            if not variant.drafts_tokens:
                continue
            for b, key in enumerate(keys):
                own = row_cache(model, cache, b, pads[b]) if len(key) > 1 else None
                tokens, draft = selfspec_generate(model, self.speculator, variant.config(self.config),
                                                  list(key[-1:] if own is not None else key),
                                                  max_length - context.shape[1], variant.gamma, rule.stopped_at, own)
                rows.append((key, v, _Stored(RowRecord.drafted(self.speculator.num_layers, draft, rule.kept(tokens)),
                                             generated=context.new_tensor(tokens))))
        attention = [v for v, variant in enumerate(self.variants) if not variant.drafts_tokens]
        for config, group, part in self._forks(attention, cache):  # one call per approximation and window
            context_v, mask_v = context.repeat_interleave(len(group), 0), mask.repeat_interleave(len(group), 0)
            region = DecodeRegion.from_left_padded(
                mask_v, False, plan=self.plan(len(context), [self.variants[v] for v in group]), tokens=context_v)
            with self.speculator.speculating(region, config, self._prefix(prefix, config, len(group))) as trace:
                out = hf_generate(context_v, max_length, stop, attention_mask=mask_v, **with_cache(model, part),
                                  **generation_kwargs)
            prompt_len = context.shape[1]
            for r in range(len(out)):
                record = RowRecord.generated(trace, region, r, out[r, prompt_len:].tolist(), prompt_len, rule.kept)
                rows.append((keys[r // len(group)], group[r % len(group)],
                             _Stored(record, generated=out[r, prompt_len:])))
        return rows

    def _forks(self, indices: list[int], cache: DynamicCache) -> Iterator[tuple[SpeculationConfig, list[int],
                                                                                DynamicCache]]:
        """The variants ``indices`` by approximation and window (a call's passes gather one A~ at one budget; the
        rows of exact attention, the baseline's, join the first), each group with its config and the prefill's cache
        repeated once per variant: a copy for every group but the last, so that every approximation and window
        decodes from the one prefill."""
        groups: dict[tuple, list[int]] = {}
        for v in indices:
            variant = self.variants[v]
            groups.setdefault((None, None) if variant.exact_attention else (variant.approx, variant.window), []).append(v)
        if (None, None) in groups and len(groups) > 1:
            first = next(key for key in groups if key != (None, None))
            groups[first] = sorted(groups[first] + groups.pop((None, None)))
        for i, ((approx, window), group) in enumerate(groups.items()):
            part = cache if i == len(groups) - 1 else copy.deepcopy(cache)
            part.batch_repeat_interleave(len(group))
            yield dataclasses.replace(self.config, window=window or self.config.window,
                                      approx=approx or self.config.approx), group, part

    @contextmanager
    def _capturing(self, length: int) -> Iterator[PromptPrefix | None]:
        """The prefill's prompt positions kept for the approximations that score the prompt, where a variant has
        one (their forks observe the prompt from it): queries, inputs and rotary terms of every layer, held until
        the forks have run."""
        if any(v.approx.prompt_keys and not v.exact_attention for v in self.variants):
            with self.speculator.prompts.capturing(length) as kept:
                yield kept
        else:
            yield None

    @staticmethod
    def _prefix(kept: PromptPrefix | None, config: SpeculationConfig, rows: int) -> PromptPrefix | None:
        """What a fork of ``rows`` variants per request gets of the prefill's prompt positions."""
        return kept.repeated(rows) if kept is not None and config.approx.prompt_keys else None

    def _forward_all(self, inps: torch.Tensor, keys: list[RowKey],
                     starts: list[int]) -> tuple[torch.Tensor, int, list[RowRecord]]:
        """Teacher-forced logits of every variant after one exact pass over the common prompt prefix.

        Returns logits (batch * variants, positions, vocab) from position ``first`` on (the last common prompt
        position: no earlier logit is ever read, so none is kept), ``first``, and per row its record.
        """
        model, variants = self.model, len(self.variants)
        common = min(starts)
        cache = DynamicCache(config=model.config)
        ends = [len(k) for k in keys]
        logits, records = None, [None] * (len(keys) * variants)
        with torch.no_grad():
            with self._capturing(common) as kept:
                prefix = (model(inps[:, :common], **with_cache(model, cache), use_cache=True, logits_to_keep=1).logits
                          if common else None)
            for config, group, part in self._forks(list(range(variants)), cache):  # one call per window
                n = len(group)
                region = DecodeRegion.build([0] * len(keys) * n, [s for s in starts for _ in range(n)],
                                            [e for e in ends for _ in range(n)], device=inps.device,
                                            plan=self.plan(len(keys), [self.variants[v] for v in group]),
                                            tokens=inps.repeat_interleave(n, 0))
                with self.speculator.speculating(region, config, self._prefix(kept if common else None, config,
                                                                              n)) as trace:
                    rest = model(inps[:, common:].repeat_interleave(n, 0), **with_cache(model, part),
                                 use_cache=True).logits
                if prefix is not None:
                    rest = torch.cat([prefix.repeat_interleave(n, 0), rest], dim=1)
                if logits is None:
                    logits = rest.new_empty((len(keys) * variants, *rest.shape[1:]))
                rows = torch.tensor([b * variants + v for b in range(len(keys)) for v in group], device=rest.device)
                logits[rows] = rest
                for r, row in enumerate(rows.tolist()):
                    records[row] = RowRecord.teacher_forced(trace, r, starts[r // n], ends[r // n])
        return logits, max(common - 1, 0), records


@dataclass
class Replay:
    """The shared prefill's answers as one of its variants (the adapter's source while that row is evaluated)."""

    prefill: SharedPrefill
    variant: int

    def forward(self, inps: torch.Tensor, keys: list[RowKey], starts: list[int],
                hf_call: HFCall) -> tuple[torch.Tensor, list[RowRecord]]:
        return self.prefill.forward(inps, keys, starts, self.variant)

    def generate(self, context: torch.Tensor, max_length: int, stop: list[str], rule: StopRule,
                 generation_kwargs: dict[str, Any], hf_generate: HFGenerate) -> tuple[torch.Tensor, list[RowRecord]]:
        if any(v.drafts_tokens for v in self.prefill.variants):
            check_greedy(generation_kwargs)
        return self.prefill.generate(context, max_length, stop, rule, generation_kwargs, hf_generate, self.variant)
