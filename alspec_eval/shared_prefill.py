"""Shared prefill for sweeps: compute the exact prompt once, fork the KV cache per variant.

With `speculate_prefill=false` the prompt's KV cache is the same for every lambda, so a
sweep's variants (baseline, each lambda, pure sink) run as rows of one batch after one
exact prefill, each row with its own lambda. lm-eval still scores each variant on its
own: the first pass computes every variant and answers with variant 0; later passes
replay the stored generations / logits of variant ``replay`` through the same HFLM code.
Self-speculation variants (one per gamma) decode each row alone from its slice of the same
prefill; their teacher-forced rows are exact (token-level speculation scores nothing differently).

It returns tokens, logits and records; it calls nothing of the adapter's (HFLM's own generation comes as an argument).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import DynamicCache, PreTrainedModel

from .config import SpeculationConfig
from .ledger import RowKey, RowRecord, row_keys
from .region import DecodeRegion
from .rows import Row
from .selfspec import row_cache, selfspec_generate
from .backends.sim.speculator import Speculator
from .stopping import StopRule

Generate = Callable[..., torch.Tensor]  # HFLM's generation of a batch: (context, max_length, stop, **kwargs) -> tokens


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
    """What the first pass computed for every sweep row (a variant), keyed by (request input, variant index), and
    which variant answers."""

    variants: list[Row]
    model: PreTrainedModel
    speculator: Speculator
    config: SpeculationConfig  # the group's: policy=dynamic, the sweep's window; rows bring their own lambda
    pad_token_id: int
    replay: int = 0
    rows: dict[tuple[RowKey, int], _Stored] = field(default_factory=dict)

    def region_args(self, batch: int, variants: list[Row]) -> dict[str, list]:
        """Per-row lambda (per layer where a variant is a schedule) and exact flags for a batch of ``batch``
        requests, each repeated once per variant."""
        layers = self.speculator.num_layers
        per_layer = any(v.kind == "tuned" for v in variants)
        lam = [v.thresholds(layers) if per_layer else v.thresholds(1)[0] for v in variants]
        return {"lam": [x for _ in range(batch) for x in lam],
                "exact": [v.exact_attention for _ in range(batch) for v in variants]}

    def generate(self, context: torch.Tensor, max_length: int, stop: list[str], rule: StopRule,
                 generation_kwargs: dict[str, Any], hf_generate: Generate) -> tuple[torch.Tensor, list[RowRecord]]:
        """Generations of the variant being replayed and their records; the first pass generates every variant."""
        keys = row_keys(context, generation_kwargs.get("attention_mask"))
        if any((key, 0) not in self.rows for key in keys):
            for key, variant, stored in self._generate_all(context, max_length, stop, rule, dict(generation_kwargs),
                                                           hf_generate):
                self.rows[key, variant] = stored
        entries = [self.rows[key, self.replay] for key in keys]
        width = max(len(e.generated) for e in entries)
        out = context.new_full((len(context), context.shape[1] + width), self.pad_token_id)
        out[:, :context.shape[1]] = context
        for b, entry in enumerate(entries):
            out[b, context.shape[1]:context.shape[1] + len(entry.generated)] = entry.generated
        return out, [e.record for e in entries]

    def forward(self, inps: torch.Tensor, keys: list[RowKey], starts: list[int]) -> tuple[torch.Tensor, list[RowRecord]]:
        """Teacher-forced logits of the variant being replayed and their records; the first pass computes all.

        Only the logits HFLM reads are kept (from the last context token on); the rest of the output is zero.
        """
        if any((key, 0) not in self.rows for key in keys):
            logits, first, records = self._forward_all(inps, keys, starts)
            variants = len(self.variants)
            for r, record in enumerate(records):
                key, start = keys[r // variants], starts[r // variants]
                lo = max(start - 1, 0)  # HFLM reads the logits from the last context token on
                self.rows[key, r % variants] = _Stored(record, logits=logits[r, lo - first:len(key) - first], lo=lo)
        entries = [self.rows[key, self.replay] for key in keys]
        out = inps.new_zeros((*inps.shape, entries[0].logits.shape[-1]), dtype=entries[0].logits.dtype)
        for b, (key, entry) in enumerate(zip(keys, entries, strict=True)):
            out[b, entry.lo:len(key)] = entry.logits
        return out, [e.record for e in entries]

    def _generate_all(self, context: torch.Tensor, max_length: int, stop: list[str], rule: StopRule,
                      generation_kwargs: dict[str, Any], hf_generate: Generate) -> list[tuple[RowKey, int, _Stored]]:
        """Every variant after one exact prefill of the prompts (all but their last token): per output row its
        prompt key, variant index and stored record with the generated tokens."""
        model = self.model
        mask = generation_kwargs.pop("attention_mask", None)
        mask = torch.ones_like(context) if mask is None else mask
        cache = DynamicCache(config=model.config)
        if context.shape[1] > 1:
            positions = (mask.long().cumsum(-1) - 1).clamp(min=0)
            with torch.no_grad():
                model(context[:, :-1], attention_mask=mask[:, :-1], position_ids=positions[:, :-1],
                      past_key_values=cache, use_cache=True, logits_to_keep=1)
        keys, pads = row_keys(context, mask), (mask.shape[1] - mask.long().sum(-1)).tolist()
        rows = []
        for v, variant in enumerate(self.variants):
            if variant.kind != "selfspec":
                continue
            for b, key in enumerate(keys):
                own = row_cache(model, cache, b, pads[b]) if len(key) > 1 else None
                tokens, draft = selfspec_generate(model, self.speculator, self.config, list(key[-1:] if own is not None else key),
                                                  max_length - context.shape[1], variant.gamma, rule.stopped_at, own)
                rows.append((key, v, _Stored(RowRecord.drafted(self.speculator.num_layers, draft),
                                             generated=context.new_tensor(tokens))))
        attention = [v for v, variant in enumerate(self.variants) if variant.kind != "selfspec"]
        if not attention:
            return rows
        cache.batch_repeat_interleave(len(attention))
        context_v, mask_v = context.repeat_interleave(len(attention), 0), mask.repeat_interleave(len(attention), 0)
        region = DecodeRegion.from_left_padded(
            mask_v, False, **self.region_args(len(context), [self.variants[v] for v in attention]))
        with self.speculator.speculating(region, self.config) as trace:
            out = hf_generate(context_v, max_length, stop, attention_mask=mask_v, past_key_values=cache,
                              **generation_kwargs)
        prompt_len = context.shape[1]
        for r in range(len(out)):
            record = RowRecord.generated(trace, region, r, out[r, prompt_len:].tolist(), prompt_len, rule.kept)
            rows.append((keys[r // len(attention)], attention[r % len(attention)],
                         _Stored(record, generated=out[r, prompt_len:])))
        return rows

    def _forward_all(self, inps: torch.Tensor, keys: list[RowKey],
                     starts: list[int]) -> tuple[torch.Tensor, int, list[RowRecord]]:
        """Teacher-forced logits of every variant after one exact pass over the common prompt prefix.

        Returns logits (batch * variants, positions, vocab) from position ``first`` on (the last common prompt
        position: no earlier logit is ever read, so none is kept), ``first``, and per row its record.
        """
        model, variants = self.model, len(self.variants)
        common = min(starts)
        cache = DynamicCache(config=model.config)
        with torch.no_grad():
            prefix = (model(inps[:, :common], past_key_values=cache, use_cache=True, logits_to_keep=1).logits
                      if common else None)
            cache.batch_repeat_interleave(variants)
            ends = [len(k) for k in keys]
            region = DecodeRegion.build([0] * len(keys) * variants, [s for s in starts for _ in range(variants)],
                                        [e for e in ends for _ in range(variants)], device=inps.device,
                                        **self.region_args(len(keys), self.variants))
            with self.speculator.speculating(region, self.config) as trace:
                rest = model(inps[:, common:].repeat_interleave(variants, 0), past_key_values=cache,
                             use_cache=True).logits
        logits = rest if prefix is None else torch.cat([prefix.repeat_interleave(variants, 0), rest], dim=1)
        records = [RowRecord.teacher_forced(trace, r, starts[r // variants], ends[r // variants])
                   for r in range(len(logits))]
        return logits, max(common - 1, 0), records
