"""The last 2S keys: StreamingLLM without its sink, the lower bound the sink's first window is measured
against."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .base import Approximation, Ranges, Selected


@dataclass(frozen=True)
class Local(Approximation):
    description = "the last 2S keys (the sink without its first window)"
    marker, colour = "s", "tab:brown"
    keys_by_position = True

    def keys_read(self, context: int, window: int) -> float:
        return min(2 * window, context)

    def per_pass(self, pos: torch.Tensor, pad: torch.Tensor, key_len: int, window: int,
                 window_align: int) -> tuple[torch.Tensor]:
        # a speculated (non-trivial) position has pos + 1 > 2S keys: the last 2S all exist
        return (pad[:, None] + pos[:, None] - 2 * window + 1 + torch.arange(2 * window, device=pos.device),)

    def position_ranges(self, pos: torch.Tensor, window: int, window_align: int) -> Ranges:
        return (pos - 2 * window + 1)[:, None], (pos + 1)[:, None], (2 * window,)

    def select(self, query: torch.Tensor, key: torch.Tensor, rows: torch.Tensor, pos: torch.Tensor,
               pad: torch.Tensor, window: int, passed: tuple, prepared: None) -> Selected:
        return passed[0][:, None, :], None
