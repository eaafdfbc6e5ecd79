"""A call's decision plan: one threshold per (batch row, layer), compiled from a ``SpeculationConfig`` (its
``thresholds``) or from a sweep's rows, and carried by the decode region. The speculator, the fused kernels and the
TT op read the plan, never a policy's name.

A threshold is a lambda >= 0 (accept iff d <= lambda n), or one of config.py's ``OFF`` (NaN: exact, not recorded),
``REJECT`` (-inf: exact, recorded as rejected) and ``ALWAYS`` (inf: A~ always). ``semantics.accept`` rejects NaN and
-inf by itself, so a row's threshold goes to a kernel as it is.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cached_property

import torch


# What a layer does in a plan, the same for all its rows where the host must know it without a read-back.
IDLE, EXACT_REJECTED, MEASURED = "idle", "exact, rejected", "measured"


@dataclass(frozen=True, eq=False)
class Plan:
    """Thresholds (rows, layers), float32, on the host; copies on a layer's device are made once per plan."""

    lam: torch.Tensor
    _on: dict = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        if self.lam.dim() != 2 or self.lam.dtype != torch.float32 or self.lam.device.type != "cpu":
            raise ValueError("a plan is a (rows, layers) float32 tensor on the host")

    @classmethod
    def uniform(cls, thresholds: Sequence[float], rows: int) -> Plan:
        """Every row with the same per-layer thresholds (one config's)."""
        return cls(torch.tensor([list(thresholds)] * rows, dtype=torch.float32).reshape(rows, len(thresholds)))

    @classmethod
    def of_rows(cls, rows: Sequence[Sequence[float]]) -> Plan:
        """Each batch row its own per-layer thresholds (the rows of a sweep in one batch)."""
        return cls(torch.tensor([list(r) for r in rows], dtype=torch.float32))

    def without(self, layers: Sequence[int]) -> Plan:
        """The plan with ``layers`` off (sliding-window layers: their window already bounds the cache)."""
        if not layers:
            return self
        lam = self.lam.clone()
        lam[:, list(layers)] = float("nan")
        return Plan(lam)

    @property
    def rows(self) -> int:
        return self.lam.shape[0]

    @cached_property
    def _lines(self) -> list[list[float]]:
        """The thresholds as Python floats: what the host decides from them costs one copy, not one per layer."""
        return self.lam.tolist()

    @cached_property
    def _active(self) -> list[bool]:
        return [not all(math.isnan(x) for x in line) for line in self._lines]

    @cached_property
    def active_rows(self) -> torch.Tensor:
        """(rows,) bool: rows with any layer not off (the others never speculate nor record)."""
        return torch.tensor(self._active, dtype=torch.bool)

    @cached_property
    def layer_kinds(self) -> list[str]:
        """Per layer: IDLE (off in every row), EXACT_REJECTED (exact in every row, some recorded rejected: nothing to
        measure) or MEASURED (some row computes A~ and decides)."""
        columns = list(zip(*self._lines)) or [()] * self.lam.shape[1]
        return [IDLE if all(math.isnan(x) for x in col) else
                EXACT_REJECTED if all(math.isnan(x) or x == -math.inf for x in col) else MEASURED for col in columns]

    @cached_property
    def _uniform(self) -> list[float | None]:
        """Per layer, the threshold all active rows share (rows off everywhere never speculate), else None."""
        lines = [line for line, active in zip(self._lines, self._active) if active]
        if not lines:
            return [None] * self.lam.shape[1]

        def same(a: float, b: float) -> bool:
            return a == b or (math.isnan(a) and math.isnan(b))

        return [col[0] if all(same(x, col[0]) for x in col) else None for col in zip(*lines)]

    def layer(self, layer: int, device: torch.device | str = "cpu") -> float | torch.Tensor:
        """Each row's threshold at ``layer``: a float where every active row has the same (no tensor to build or
        move), else a contiguous (rows,) tensor on ``device`` (the whole plan moved there once, layer by layer, so
        that a kernel reading ``lam[b]`` at ``ptr + b`` gets row b's threshold)."""
        value = self._uniform[layer]
        if value is not None:
            return value
        device = torch.device(device)
        if device not in self._on:
            self._on[device] = self.lam.t().contiguous().to(device)
        return self._on[device][layer]
