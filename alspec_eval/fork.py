"""Shared prefill for sweeps: compute the exact prompt once, fork the KV cache per variant.

With `speculate_prefill=false` the prompt's KV cache is the same for every lambda, so a
sweep's variants (baseline, each lambda, pure sink) run as rows of one batch after one
exact prefill, each row with its own lambda. lm-eval still scores each variant on its
own: the first pass computes every variant and answers with variant 0; later passes
replay the stored generations / logits of variant v through the same HFLM code.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from lm_eval.models.huggingface import HFLM
from transformers import DynamicCache

from .region import DecodeRegion

if TYPE_CHECKING:
    from .adapter import ALSpecLM

RowKey = tuple[int, ...]


@dataclass(frozen=True)
class Variant:
    """One cell of a sweep that can share the prefill: the baseline, a lambda, or pure sink (lam = inf)."""

    name: str
    lam: float = 0.0
    exact: bool = False


@dataclass
class SharedPrefill:
    """What the first pass computed for every variant, keyed by row input, and which variant answers now."""

    variants: list[Variant]
    replay: int = 0
    recorded: bool = False
    rows: dict[tuple[RowKey, int], dict[str, Any]] = field(default_factory=dict)

    def region_args(self, batch: int) -> dict[str, list]:
        """Per-row lambda and exact flags for a batch of ``batch`` requests, each repeated once per variant."""
        return {"lam": [v.lam for _ in range(batch) for v in self.variants],
                "exact": [v.exact for _ in range(batch) for v in self.variants]}


def generate_all(lm: "ALSpecLM", fork: SharedPrefill, context: torch.Tensor, max_length: int, stop: list[str],
                 generation_kwargs: dict[str, Any]) -> tuple[torch.Tensor, list[tuple[RowKey, int, dict]]]:
    """Generate every variant after one exact prefill of the prompts (all but their last token).

    Returns the output rows (batch * variants, variant-major within a request) and per row its
    prompt key, variant index and statistics.
    """
    mask = generation_kwargs.pop("attention_mask", None)
    mask = torch.ones_like(context) if mask is None else mask
    variants = len(fork.variants)
    cache = DynamicCache(config=lm.model.config)
    if context.shape[1] > 1:
        positions = (mask.long().cumsum(-1) - 1).clamp(min=0)
        with torch.no_grad():
            lm.model(context[:, :-1], attention_mask=mask[:, :-1], position_ids=positions[:, :-1],
                     past_key_values=cache, use_cache=True)
    cache.batch_repeat_interleave(variants)
    context_v, mask_v = context.repeat_interleave(variants, 0), mask.repeat_interleave(variants, 0)
    region = DecodeRegion.from_left_padded(mask_v, False, **fork.region_args(len(context)))
    with lm.speculator.speculating(region) as trace:
        out = HFLM._model_generate(lm, context_v, max_length, stop, attention_mask=mask_v,
                                   past_key_values=cache, **generation_kwargs)
    rows = []
    for r in range(len(out)):
        rows.append((tuple(context_v[r, int(region.pad[r]):].tolist()), r % variants,
                     lm._generation_stats(trace, region, r, out[r], context.shape[1], stop)))
    return out, rows


def forward_all(lm: "ALSpecLM", fork: SharedPrefill, inps: torch.Tensor, keys: list[RowKey],
                starts: list[int]) -> tuple[torch.Tensor, list[dict]]:
    """Teacher-forced logits of every variant after one exact pass over the common prompt prefix.

    Returns logits (batch * variants, length, vocab) and per row its statistics.
    """
    variants = len(fork.variants)
    common = min(starts)
    cache = DynamicCache(config=lm.model.config)
    with torch.no_grad():
        prefix = lm.model(inps[:, :common], past_key_values=cache, use_cache=True).logits if common else None
        cache.batch_repeat_interleave(variants)
        ends = [len(k) for k in keys]
        region = DecodeRegion.build([0] * len(keys) * variants, [s for s in starts for _ in range(variants)],
                                    [e for e in ends for _ in range(variants)], device=inps.device,
                                    **fork.region_args(len(keys)))
        with lm.speculator.speculating(region) as trace:
            rest = lm.model(inps[:, common:].repeat_interleave(variants, 0), past_key_values=cache,
                            use_cache=True).logits
    logits = rest if prefix is None else torch.cat([prefix.repeat_interleave(variants, 0), rest], dim=1)
    stats = [lm._teacher_forced_stats(trace, r, starts[r // variants], ends[r // variants]) for r in range(len(logits))]
    return logits, stats


def sweep_variants(lambdas: list[float], baseline: bool = True, sink: bool = True) -> list[Variant]:
    """The variants of a sweep that share a prefill, in the order their cells are named."""
    out = [Variant("baseline", exact=True)] if baseline else []
    out += [Variant(f"lambda_{lam:g}", lam=float(lam)) for lam in lambdas]
    if sink:
        out.append(Variant("sink", lam=math.inf))
    return out
