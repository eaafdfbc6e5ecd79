"""Where a model call's answers come from while one evaluation runs: HFLM's own call under one speculation session
(:class:`Speculated`), greedy self-speculation for generations (:class:`SelfSpeculated`), or a sweep's shared prefill
(``SharedPrefill.answers``). The adapter holds one source per evaluation (``ALSpecLM.answering``), so its two model
calls only hand each request to it and file the records.

A source answers a teacher-forced batch (``forward``: logits and a record per row) and a generation batch
(``generate``: tokens laid out as HF's generate would, and a record per row); HFLM's own call comes as an argument.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from transformers import PreTrainedModel

from .config import SpeculationConfig
from .ledger import RowKey, RowRecord, row_keys
from .region import DecodeRegion
from .selfspec import check_greedy, selfspec_generate
from .speculator import Speculator
from .stopping import StopRule

HFCall = Callable[[], torch.Tensor]  # HFLM's _model_call of this batch
HFGenerate = Callable[..., torch.Tensor]  # HFLM's _model_generate: (context, max_length, stop, **kwargs) -> tokens


class Answers(Protocol):
    def forward(self, inps: torch.Tensor, keys: list[RowKey], starts: list[int],
                hf_call: HFCall) -> tuple[torch.Tensor, list[RowRecord]]: ...

    def generate(self, context: torch.Tensor, max_length: int, stop: list[str], rule: StopRule,
                 generation_kwargs: dict[str, Any], hf_generate: HFGenerate) -> tuple[torch.Tensor, list[RowRecord]]: ...


@dataclass
class Speculated:
    """HFLM's own call inside one speculation session with ``config`` (docs/design.md, Semantics 6)."""

    speculator: Speculator
    config: SpeculationConfig

    def forward(self, inps: torch.Tensor, keys: list[RowKey], starts: list[int],
                hf_call: HFCall) -> tuple[torch.Tensor, list[RowRecord]]:
        region = DecodeRegion.build([0] * len(keys), starts, [len(k) for k in keys], device=inps.device, tokens=inps)
        with self.speculator.speculating(region, self.config) as trace:
            logits = hf_call()
        return logits, [RowRecord.teacher_forced(trace, b, start, len(key))
                        for b, (key, start) in enumerate(zip(keys, starts, strict=True))]

    def generate(self, context: torch.Tensor, max_length: int, stop: list[str], rule: StopRule,
                 generation_kwargs: dict[str, Any], hf_generate: HFGenerate) -> tuple[torch.Tensor, list[RowRecord]]:
        mask = generation_kwargs.get("attention_mask")
        region = DecodeRegion.from_left_padded(torch.ones_like(context) if mask is None else mask,
                                               self.config.speculate_prefill, tokens=context)
        with self.speculator.speculating(region, self.config) as trace:
            out = hf_generate(context, max_length, stop, **generation_kwargs)
        prompt_len = context.shape[1]
        return out, [RowRecord.generated(trace, region, b, out[b, prompt_len:].tolist(), prompt_len, rule.kept)
                     for b in range(len(context))]


@dataclass
class SelfSpeculated(Speculated):
    """policy=selfspec: each generated row decoded alone by greedy self-speculation, laid out as HF's generate would;
    teacher-forced rows are exact (the config's plan is off: token-level speculation scores nothing differently)."""

    model: PreTrainedModel | None = None
    pad_token_id: int = 0

    def generate(self, context: torch.Tensor, max_length: int, stop: list[str], rule: StopRule,
                 generation_kwargs: dict[str, Any], hf_generate: HFGenerate) -> tuple[torch.Tensor, list[RowRecord]]:
        check_greedy(generation_kwargs)
        rows, records = [], []
        for key in row_keys(context, generation_kwargs.get("attention_mask")):
            tokens, draft = selfspec_generate(self.model, self.speculator, self.config, list(key),
                                              max_length - context.shape[1], self.config.gamma, rule.stopped_at)
            rows.append(tokens)
            records.append(RowRecord.drafted(self.speculator.num_layers, draft, rule.kept(tokens)))
        out = context.new_full((len(context), context.shape[1] + max(map(len, rows))), self.pad_token_id)
        out[:, :context.shape[1]] = context
        for b, tokens in enumerate(rows):
            out[b, context.shape[1]:context.shape[1] + len(tokens)] = context.new_tensor(tokens)
        return out, records


def answers_for(config: SpeculationConfig, speculator: Speculator, model: PreTrainedModel,
                pad_token_id: int) -> Speculated:
    """The source of a run with ``config`` on its own (no shared prefill)."""
    if config.drafts_tokens:
        return SelfSpeculated(speculator, config, model, pad_token_id)
    return Speculated(speculator, config)
