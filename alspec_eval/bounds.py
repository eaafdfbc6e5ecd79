"""A draft reads keys of [0, pos] only, whatever it returns (docs/design.md, Approximations): every engine cuts what
a draft selects to that range before anything is read (:func:`alspec_eval.semantics.readable_ranges` and
:func:`~alspec_eval.semantics.readable_keys`, the one rule), counts the queries whose draft reached outside where it
found them (on the device: no read-back per layer), and after the call refuses the run in one line naming the draft
and a position, before any result is written. A draft that reads the future would score the continuation it is asked
to predict; one that reads before the sequence reads another request's cache (or no memory at all, in a kernel).
"""

from __future__ import annotations

from typing import Any

import torch

from .errors import ConfigError


class DraftOutOfBounds(ConfigError):
    """A draft selected keys outside [0, pos]: its run is refused (its A~ read only the cut keys, so it measured
    nothing that holds for the draft as written)."""


class Breaches:
    """How many selections reached outside [0, pos] and the largest query position among them, kept as tensors where
    they were found and read once, after the call (:meth:`take`)."""

    def __init__(self) -> None:
        self.count: torch.Tensor | None = None  # () int64
        self.last: torch.Tensor | None = None  # () int64; -1 where none

    def add(self, outside: torch.Tensor, pos: torch.Tensor) -> None:
        """Count the queries at ``pos`` (R,) whose selection reached outside (``outside`` (R,) bool); device ops
        only (tensors found on another device are moved to where the count is)."""
        if not len(outside):
            return
        if self.count is None:
            self.count = torch.zeros((), dtype=torch.long, device=outside.device)
            self.last = torch.full((), -1, dtype=torch.long, device=outside.device)
        device = self.count.device
        outside, pos = outside.to(device, non_blocking=True), pos.to(device, non_blocking=True)
        self.count.add_(outside.sum())
        torch.maximum(self.last, torch.where(outside, pos.long(), -1).amax(), out=self.last)

    def pending(self) -> torch.Tensor | None:
        """(count, last position) as one (2,) tensor where they are, for a read-back shared with other values; None
        where nothing was counted. Counting starts anew."""
        if self.count is None:
            return None
        found = torch.stack([self.count, self.last])
        self.count = self.last = None
        return found

    def take(self) -> tuple[int, int]:
        """(count, last position), read back once; counting starts anew."""
        found = self.pending()
        return (0, -1) if found is None else tuple(found.tolist())


def refuse(approx: Any, count: int, position: int) -> None:
    """Raise :class:`DraftOutOfBounds` naming the draft and a position where ``count`` selections reached outside."""
    if count:
        raise DraftOutOfBounds(
            f"approx={approx.name} read keys outside [0, pos] (past the query or before the sequence) at position "
            f"{position} (found {count} times), so the run is refused and no result written: every key a draft "
            f"reads (position_ranges, or what per_pass and select return) must lie in [0, pos]; alspec-check-approx "
            f"{approx.name} names the broken rule")
