"""The paper's A~: the first S and the last S keys of the sequence (semantics.window_positions), fixed by position,
so computed once per pass for every layer and head; the fused decode kernels and the TT op compute it too.

Torch-free to import: the sink is every row's default, made wherever a row is (the lm-eval hook, --help)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..constants import WINDOW_ALIGNS
from .base import Approximation, Ranges, Selected

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class Sink(Approximation):
    description = "the sink windows (the first S and the last S keys)"
    marker, colour = "o", "tab:blue"
    fused_kernel = tt_op = keys_by_position = True
    window_aligns = WINDOW_ALIGNS

    def keys_read(self, context: int, window: int) -> float:
        return min(2 * window, context)

    def per_pass(self, pos: torch.Tensor, pad: torch.Tensor, key_len: int, window: int,
                 window_align: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        from .. import semantics

        positions, valid = semantics.window_positions(pos, window, window_align)
        return (positions + pad[:, None]).clamp_max(key_len - 1), None if bool(valid.all()) else valid

    def position_ranges(self, pos: torch.Tensor, window: int, window_align: int) -> Ranges:
        from .. import semantics

        return (*semantics.window_ranges(pos, window, window_align), (window, window))

    def select(self, query: torch.Tensor, key: torch.Tensor, rows: torch.Tensor, pos: torch.Tensor,
               pad: torch.Tensor, window: int, passed: tuple, prepared: None) -> Selected:
        index, valid = passed
        return index[:, None, :], None if valid is None else valid[:, None, :]
