"""Which positions speculate, and what a forward pass decided there (docs/design.md, Semantics 6)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .plan import Plan
from .semantics import request_seed
from .stats import ACCEPTED, AcceptanceStats

NO_END = 2**62  # row_end for rows without right padding


@dataclass(frozen=True)
class DecodeRegion:
    """Per batch row, in physical (padded cache) indices.

    pad: index of the row's first real token (left padding before it is not part of the sequence).
    spec_start: first index that speculates (the first token fed back after the exact prefill).
    row_end: index past the last real token (right padding after it is ignored).
    plan: what each (row, layer) decides (plan.py); None takes the session's config for every row.
    tokens: the rows' tokens at least up to each spec_start (B, T): what a draft that draws seeds each request from
    (:meth:`seeds`); None where the caller gives none (such a draft is then refused).
    """

    pad: torch.Tensor
    spec_start: torch.Tensor
    row_end: torch.Tensor
    plan: Plan | None = None
    tokens: torch.Tensor | None = None

    @classmethod
    def build(cls, pad: list[int] | torch.Tensor, spec_start: list[int] | torch.Tensor,
              row_end: list[int] | torch.Tensor | None = None, device: torch.device | str = "cpu",
              plan: Plan | None = None, tokens: torch.Tensor | None = None) -> "DecodeRegion":
        pad_t = torch.as_tensor(pad, dtype=torch.long, device=device)
        start_t = torch.as_tensor(spec_start, dtype=torch.long, device=device)
        end_t = torch.full_like(pad_t, NO_END) if row_end is None else torch.as_tensor(row_end, dtype=torch.long, device=device)
        if len({t.shape for t in (pad_t, start_t, end_t)}) != 1 or pad_t.dim() != 1 or (
                plan is not None and plan.rows != len(pad_t)) or (tokens is not None and len(tokens) != len(pad_t)):
            raise ValueError("pad, spec_start, row_end, the plan and the tokens must have one entry per batch row")
        return cls(pad_t, start_t, end_t, plan, tokens)

    @classmethod
    def from_left_padded(cls, attention_mask: torch.Tensor, speculate_prefill: bool, plan: Plan | None = None,
                         tokens: torch.Tensor | None = None) -> "DecodeRegion":
        """Generation: prompts are left padded; every token fed back after the prompt speculates."""
        batch, prompt_len = attention_mask.shape
        pad = prompt_len - attention_mask.long().sum(-1)
        start = pad if speculate_prefill else torch.full_like(pad, prompt_len)
        return cls.build(pad, start, device=attention_mask.device, plan=plan, tokens=tokens)

    def seeds(self) -> torch.Tensor:
        """Each row's request seed (B,) int64: :func:`.semantics.request_seed` of its tokens in [pad, spec_start),
        the tokens before its speculation start, as vLLM's driver derives it from the same tokens."""
        if self.tokens is None:
            raise ValueError("this draft draws at random, seeded by each request's tokens, and this call's decode "
                             "region gives none: build it with tokens=")
        tokens, pad, start = self.tokens.tolist(), self.pad.tolist(), self.spec_start.tolist()
        return torch.tensor([request_seed(row[p:s]) for row, p, s in zip(tokens, pad, start, strict=True)])


@dataclass
class Trace:
    """Decisions of one region: codes and d/n ratios of shape (batch, positions, layers).

    Position i of the trace is physical cache index ``offset + i`` (a region that starts on a
    filled KV cache records from there).
    """

    codes: torch.Tensor
    ratios: torch.Tensor
    offset: int = 0
    pad: torch.Tensor | None = None  # (B,) each row's left padding, on the host: logical positions for densities
    budget: int | None = 0  # the keys A~ attends to (the draft's max_keys: 2S), for densities; None: it varies
    # per-decision measures beside code and d/n (stats.KEYS_READ where the budget varies, stats.DENOMINATOR where the
    # draft promises its denominator), each (batch, positions, layers), NaN where not measured
    measures: dict[str, torch.Tensor] = field(default_factory=dict)
    epsilon: float | None = None  # the draft's promised error (Approximation.promise), whose realized shares count

    def row_stats(self, row: int, start: int, end: int) -> AcceptanceStats:
        """Statistics of batch row ``row`` over physical positions [start, end)."""
        lo, hi = max(start - self.offset, 0), max(end - self.offset, 0)
        codes = self.codes[row, lo:hi]
        pos = None
        if self.pad is not None:
            pos = torch.arange(lo, lo + len(codes)) + self.offset - int(self.pad[row])
        measures = {name: grid[row, lo:hi] for name, grid in self.measures.items()}
        return AcceptanceStats.from_trace(codes, self.ratios[row, lo:hi], pos, self.budget, measures, self.epsilon)

    def accepted_layers(self, row: int, start: int, end: int) -> list[int]:
        """Number of accepted layers at each position in [start, end): the per-token trace. Positions the trace
        does not cover (an exact prefill, a plan that never speculates) accepted nothing."""
        counts = [0] * max(end - start, 0)
        if self.codes.dim() == 3:
            lo, hi = max(start - self.offset, 0), max(min(end - self.offset, self.codes.shape[1]), 0)
            traced = (self.codes[row, lo:hi] == ACCEPTED).sum(-1).tolist()
            first = lo + self.offset - start
            counts[first:first + len(traced)] = traced
        return counts
