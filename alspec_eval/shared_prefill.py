"""Shared prefill for sweeps: compute the exact prompt once, fork the KV cache per variant.

With `speculate_prefill=false` the prompt's KV cache is the same for every lambda, so a
sweep's variants (baseline, each lambda, pure sink) run as rows of one batch after one
exact prefill, each row with its own lambda. lm-eval still scores each variant on its
own: the first pass computes every variant and answers with variant 0; later passes
replay the stored generations / logits of variant ``replay`` through the same HFLM code.
Self-speculation variants (one per gamma) decode each row alone from its slice of the same
prefill; their teacher-forced rows are exact (token-level speculation scores nothing differently).

The module works through :class:`PrefillHost`, the few things it needs of the adapter.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from transformers import DynamicCache, PreTrainedModel

from .config import SpeculationConfig
from .region import DecodeRegion, Trace
from .rows import Row
from .selfspec import row_cache
from .speculator import Speculator

RowKey = tuple[int, ...]  # a request's input tokens (without padding): how rows are found again


class PrefillHost(Protocol):
    """What a shared prefill needs of the model adapter."""

    model: PreTrainedModel
    speculator: Speculator
    spec_config: SpeculationConfig
    tokenizer: Any

    def generate_rows(self, context: torch.Tensor, max_length: int, stop: list[str], **kwargs: Any) -> torch.Tensor:
        """HFLM's own generation of a batch (no shared prefill)."""

    def generation_stats(self, trace: Trace, region: DecodeRegion, row: int, out: torch.Tensor, prompt_len: int,
                         stop: Sequence[str]) -> dict[str, Any]:
        """A generated row's statistics entry."""

    def teacher_forced_stats(self, trace: Trace, row: int, start: int, end: int) -> dict[str, Any]:
        """A teacher-forced row's statistics entry."""

    def selfspec_row(self, cache: DynamicCache | None, pending: list[int], max_new: int, stop: Sequence[str],
                     generation_kwargs: dict[str, Any], gamma: int | None = None) -> tuple[list[int], dict[str, Any]]:
        """A row's self-speculative generation after ``cache`` and its statistics entry."""


def row_keys(context: torch.Tensor, attention_mask: torch.Tensor | None) -> list[RowKey]:
    """The keys of a left-padded batch of prompts."""
    pads = [0] * len(context) if attention_mask is None else (attention_mask.shape[1] - attention_mask.long().sum(-1)).tolist()
    return [tuple(row[pad:].tolist()) for row, pad in zip(context, pads, strict=True)]


@dataclass
class SharedPrefill:
    """What the first pass computed for every sweep row (a variant), keyed by (request input, variant index), and
    which variant answers."""

    variants: list[Row]
    replay: int = 0
    rows: dict[tuple[RowKey, int], dict[str, Any]] = field(default_factory=dict)

    @staticmethod
    def region_args(batch: int, variants: list[Row]) -> dict[str, list]:
        """Per-row lambda and exact flags for a batch of ``batch`` requests, each repeated once per variant."""
        return {"lam": [v.threshold for _ in range(batch) for v in variants],
                "exact": [v.exact_attention for _ in range(batch) for v in variants]}

    def generate(self, host: PrefillHost, context: torch.Tensor, max_length: int, stop: list[str],
                 generation_kwargs: dict[str, Any]) -> tuple[torch.Tensor, list[dict[str, Any]]]:
        """Generations of the variant being replayed and their statistics; the first pass generates every variant."""
        keys = row_keys(context, generation_kwargs.get("attention_mask"))
        if any((key, 0) not in self.rows for key in keys):
            for key, variant, entry in self._generate_all(host, context, max_length, stop, dict(generation_kwargs)):
                self.rows[key, variant] = entry
        entries = [self.rows[key, self.replay] for key in keys]
        width = max(len(e["generated"]) for e in entries)
        pad_id = host.tokenizer.pad_token_id
        out = context.new_full((len(context), context.shape[1] + width), pad_id)
        out[:, :context.shape[1]] = context
        for b, entry in enumerate(entries):
            out[b, context.shape[1]:context.shape[1] + len(entry["generated"])] = entry["generated"]
        return out, entries

    def forward(self, host: PrefillHost, inps: torch.Tensor, keys: list[RowKey],
                starts: list[int]) -> tuple[torch.Tensor, list[dict[str, Any]]]:
        """Teacher-forced logits of the variant being replayed and their statistics; the first pass computes all.

        Only the logits HFLM reads are kept (from the last context token on); the rest of the output is zero.
        """
        if any((key, 0) not in self.rows for key in keys):
            logits, first, stats = self._forward_all(host, inps, keys, starts)
            variants = len(self.variants)
            for r, entry in enumerate(stats):
                key, start = keys[r // variants], starts[r // variants]
                lo = max(start - 1, 0)  # HFLM reads the logits from the last context token on
                self.rows[key, r % variants] = {**entry, "lo": lo, "logits": logits[r, lo - first:len(key) - first]}
        entries = [self.rows[key, self.replay] for key in keys]
        out = inps.new_zeros((*inps.shape, entries[0]["logits"].shape[-1]), dtype=entries[0]["logits"].dtype)
        for b, (key, entry) in enumerate(zip(keys, entries, strict=True)):
            out[b, entry["lo"]:len(key)] = entry["logits"]
        return out, entries

    def _generate_all(self, host: PrefillHost, context: torch.Tensor, max_length: int, stop: list[str],
                      generation_kwargs: dict[str, Any]) -> list[tuple[RowKey, int, dict[str, Any]]]:
        """Every variant after one exact prefill of the prompts (all but their last token): per output row its
        prompt key, variant index and statistics entry with the ``generated`` tokens."""
        mask = generation_kwargs.pop("attention_mask", None)
        mask = torch.ones_like(context) if mask is None else mask
        cache = DynamicCache(config=host.model.config)
        if context.shape[1] > 1:
            positions = (mask.long().cumsum(-1) - 1).clamp(min=0)
            with torch.no_grad():
                host.model(context[:, :-1], attention_mask=mask[:, :-1], position_ids=positions[:, :-1],
                           past_key_values=cache, use_cache=True, logits_to_keep=1)
        keys, pads = row_keys(context, mask), (mask.shape[1] - mask.long().sum(-1)).tolist()
        rows = []
        for v, variant in enumerate(self.variants):
            if variant.kind != "selfspec":
                continue
            for b, key in enumerate(keys):
                own = row_cache(host.model, cache, b, pads[b]) if len(key) > 1 else None
                tokens, entry = host.selfspec_row(own, list(key[-1:] if own is not None else key), max_length - context.shape[1],
                                                  stop, generation_kwargs, variant.gamma)
                rows.append((key, v, {**entry, "generated": context.new_tensor(tokens)}))
        attention = [v for v, variant in enumerate(self.variants) if variant.kind != "selfspec"]
        if not attention:
            return rows
        cache.batch_repeat_interleave(len(attention))
        context_v, mask_v = context.repeat_interleave(len(attention), 0), mask.repeat_interleave(len(attention), 0)
        region = DecodeRegion.from_left_padded(
            mask_v, False, **self.region_args(len(context), [self.variants[v] for v in attention]))
        with host.speculator.speculating(region, host.spec_config) as trace:
            out = host.generate_rows(context_v, max_length, stop, attention_mask=mask_v, past_key_values=cache,
                                     **generation_kwargs)
        for r in range(len(out)):
            entry = host.generation_stats(trace, region, r, out[r], context.shape[1], stop)
            rows.append((keys[r // len(attention)], attention[r % len(attention)],
                         {**entry, "generated": out[r, context.shape[1]:]}))
        return rows

    def _forward_all(self, host: PrefillHost, inps: torch.Tensor, keys: list[RowKey],
                     starts: list[int]) -> tuple[torch.Tensor, int, list[dict]]:
        """Teacher-forced logits of every variant after one exact pass over the common prompt prefix.

        Returns logits (batch * variants, positions, vocab) from position ``first`` on (the last common prompt
        position: no earlier logit is ever read, so none is kept), ``first``, and per row its statistics.
        """
        variants = len(self.variants)
        common = min(starts)
        cache = DynamicCache(config=host.model.config)
        with torch.no_grad():
            prefix = (host.model(inps[:, :common], past_key_values=cache, use_cache=True, logits_to_keep=1).logits
                      if common else None)
            cache.batch_repeat_interleave(variants)
            ends = [len(k) for k in keys]
            region = DecodeRegion.build([0] * len(keys) * variants, [s for s in starts for _ in range(variants)],
                                        [e for e in ends for _ in range(variants)], device=inps.device,
                                        **self.region_args(len(keys), self.variants))
            with host.speculator.speculating(region, host.spec_config) as trace:
                rest = host.model(inps[:, common:].repeat_interleave(variants, 0), past_key_values=cache,
                                  use_cache=True).logits
        logits = rest if prefix is None else torch.cat([prefix.repeat_interleave(variants, 0), rest], dim=1)
        stats = [host.teacher_forced_stats(trace, r, starts[r // variants], ends[r // variants])
                 for r in range(len(logits))]
        return logits, max(common - 1, 0), stats

