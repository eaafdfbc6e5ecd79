"""Which positions speculate, and what a forward pass decided there (docs/design.md, Semantics 6)."""

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
    lam: per-row lambda (B,), or per-row per-layer (B, L), overriding the config's, so that one batch can
        hold the rows of a lambda sweep (inf: pure sink) or of per-layer schedules; None uses the config.
    exact: rows that never speculate nor record (the baseline rows of such a batch).
    """

    pad: torch.Tensor
    spec_start: torch.Tensor
    row_end: torch.Tensor
    lam: torch.Tensor | None = None
    exact: torch.Tensor | None = None

    @classmethod
    def build(cls, pad: list[int] | torch.Tensor, spec_start: list[int] | torch.Tensor,
              row_end: list[int] | torch.Tensor | None = None, device: torch.device | str = "cpu",
              lam: list[float] | list[list[float]] | None = None, exact: list[bool] | None = None) -> "DecodeRegion":
        pad_t = torch.as_tensor(pad, dtype=torch.long, device=device)
        start_t = torch.as_tensor(spec_start, dtype=torch.long, device=device)
        end_t = torch.full_like(pad_t, NO_END) if row_end is None else torch.as_tensor(row_end, dtype=torch.long, device=device)
        lam_t = None if lam is None else torch.as_tensor(lam, dtype=torch.float32, device=device)
        exact_t = None if exact is None else torch.as_tensor(exact, dtype=torch.bool, device=device)
        shapes = {t.shape[:1] for t in (pad_t, start_t, end_t, lam_t, exact_t) if t is not None}
        if len(shapes) != 1 or pad_t.dim() != 1 or (lam_t is not None and lam_t.dim() > 2):
            raise ValueError("pad, spec_start, row_end and exact must be 1-D, lam 1-D or (rows, layers), with one "
                             "entry per batch row")
        return cls(pad_t, start_t, end_t, lam_t, exact_t)

    @classmethod
    def from_left_padded(cls, attention_mask: torch.Tensor, speculate_prefill: bool,
                         lam: list[float] | list[list[float]] | None = None,
                         exact: list[bool] | None = None) -> "DecodeRegion":
        """Generation: prompts are left padded; every token fed back after the prompt speculates."""
        batch, prompt_len = attention_mask.shape
        pad = prompt_len - attention_mask.long().sum(-1)
        start = pad if speculate_prefill else torch.full_like(pad, prompt_len)
        return cls.build(pad, start, device=attention_mask.device, lam=lam, exact=exact)


@dataclass
class Trace:
    """Decisions of one region: codes and d/n ratios of shape (batch, positions, layers).

    Position i of the trace is physical cache index ``offset + i`` (a region that starts on a
    filled KV cache records from there).
    """

    codes: torch.Tensor
    ratios: torch.Tensor
    offset: int = 0

    def row_stats(self, row: int, start: int, end: int) -> AcceptanceStats:
        """Statistics of batch row ``row`` over physical positions [start, end)."""
        lo, hi = max(start - self.offset, 0), max(end - self.offset, 0)
        return AcceptanceStats.from_trace(self.codes[row, lo:hi], self.ratios[row, lo:hi])

    def accepted_layers(self, row: int, start: int, end: int) -> list[int]:
        """Number of accepted layers at each position in [start, end): the per-token trace."""
        lo, hi = start - self.offset, max(end - self.offset, 0)
        padding = [0] * max(-lo, 0)  # positions before the trace (an exact prefill) accepted nothing
        return padding + (self.codes[row, max(lo, 0):hi] == ACCEPTED).sum(-1).tolist()
