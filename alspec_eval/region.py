"""Which positions speculate, and what a forward pass decided there (DESIGN.md, Semantics 6)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .stats import ACCEPTED, AcceptanceStats

NO_END = 2**62  # row_end for rows without right padding


@dataclass(frozen=True)
class DecodeRegion:
    """Per batch row, in physical (padded cache) indices.

    pad: index of the row's first real token (left padding before it is not part of the sequence).
    spec_start: first index that speculates (the first token fed back after the exact prefill).
    row_end: index past the last real token (right padding after it is ignored).
    """

    pad: torch.Tensor
    spec_start: torch.Tensor
    row_end: torch.Tensor

    @classmethod
    def build(cls, pad: list[int] | torch.Tensor, spec_start: list[int] | torch.Tensor,
              row_end: list[int] | torch.Tensor | None = None, device: torch.device | str = "cpu") -> "DecodeRegion":
        pad_t = torch.as_tensor(pad, dtype=torch.long, device=device)
        start_t = torch.as_tensor(spec_start, dtype=torch.long, device=device)
        end_t = torch.full_like(pad_t, NO_END) if row_end is None else torch.as_tensor(row_end, dtype=torch.long, device=device)
        if not (pad_t.shape == start_t.shape == end_t.shape and pad_t.dim() == 1):
            raise ValueError("pad, spec_start and row_end must be 1-D with one entry per batch row")
        return cls(pad_t, start_t, end_t)

    @classmethod
    def from_left_padded(cls, attention_mask: torch.Tensor, speculate_prefill: bool) -> "DecodeRegion":
        """Generation: prompts are left padded; every token fed back after the prompt speculates."""
        batch, prompt_len = attention_mask.shape
        pad = prompt_len - attention_mask.long().sum(-1)
        start = pad if speculate_prefill else torch.full_like(pad, prompt_len)
        return cls.build(pad, start, device=attention_mask.device)


@dataclass
class Trace:
    """Decisions of one region: codes and d/n ratios of shape (batch, positions, layers), positions physical."""

    codes: torch.Tensor
    ratios: torch.Tensor

    def row_stats(self, row: int, start: int, end: int) -> AcceptanceStats:
        """Statistics of batch row ``row`` over physical positions [start, end)."""
        return AcceptanceStats.from_trace(self.codes[row, start:end], self.ratios[row, start:end])

    def accepted_layers(self, row: int, start: int, end: int) -> list[int]:
        """Number of accepted layers at each position in [start, end): the per-token trace."""
        return (self.codes[row, start:end] == ACCEPTED).sum(-1).tolist()
