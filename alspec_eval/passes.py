"""A forward pass of a speculating call: which of its positions speculate (found once, at its first layer, and
shared by its layers) and each layer's decisions, kept where the layers computed them; and the call's record
assembled from its passes once it ends (one copy to the host, no read-back per layer)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import ClassVar

import torch

from . import semantics
from .bounds import Breaches
from .plan import Plan
from .stats import ACCEPTED, REJECTED, TRIVIAL

# A layer's decisions in one pass: (accept, d, n) of its speculated positions (of every batch row, for a fused
# decode step: ``Pass.dense``), or None for a static policy's exact layer (decided, not measured). They stay where
# the layer computed them until the call ends (a read-back per layer would stall a GPU's stream).
# (accept, d, n, measures): measures, what else each position's decision measured, by name (stats.KEYS_READ,
# stats.DENOMINATOR; none for most drafts)
Decision = tuple[torch.Tensor, torch.Tensor, torch.Tensor, dict[str, torch.Tensor]] | None


@dataclass
class Pass:
    """The decode-region geometry of one forward pass, shared by all its layers, and their decisions.

    rows, cols: the speculated (batch row, query index) positions, ``pos`` their logical positions and ``pad`` their
    rows' left padding; ``keys``: what the approximation computes once per pass for them (the sink's window
    positions; Approximation.per_pass). A fused decode step (``dense``) has none of them, only the mask
    ``speculated``: finding the positions would read back from the device once per step.
    """

    q_len: int
    offset: int  # physical index of the first query
    trivial: torch.Tensor | None  # (B, q_len) bool; None for an idle pass (no position in the region)
    rows: torch.Tensor | None = None
    cols: torch.Tensor | None = None
    pos: torch.Tensor | None = None
    pad: torch.Tensor | None = None
    speculated: torch.Tensor | None = None  # (B,) bool of a fused decode step (``dense``): its speculated rows
    kernel_inputs: dict | None = None  # a fused decode step's positions (and kernel geometry), shared by its layers
    decisions: dict[int, Decision] = field(default_factory=dict)
    dense: bool = False  # a fused decode step: decisions hold every batch row, ``speculated`` says which count
    every_row: bool = False  # a decode step whose every batch row speculates: rows are 0..B-1, layers use whole tensors
    keys: tuple[torch.Tensor | None, ...] = ()
    low: torch.Tensor | None = None  # (R, 1, 1): the first key each speculated position may read (its row's pad)
    high: torch.Tensor | None = None  # (R, 1, 1): the last (pad + pos); both from them unless given (a device copy)
    # per device, (R,) bool: whose selection left [low, high] at any layer (shared by the device copies, as decisions)
    outside: dict[torch.device, torch.Tensor] = field(default_factory=dict)
    copies: dict = field(default_factory=dict, repr=False)  # the geometry on the other devices of a device map
    TENSORS: ClassVar[tuple[str, ...]] = ("trivial", "rows", "cols", "pos", "pad", "speculated", "low", "high")

    def __post_init__(self) -> None:
        if self.pos is not None and self.low is None:  # the keys each speculated position may read
            self.low, self.high = self.pad[:, None, None], (self.pad + self.pos)[:, None, None]

    def on(self, device: torch.device) -> Pass:
        """This pass's geometry on ``device`` (a layer of a device map), copied there once per pass; decisions are
        recorded in this pass's own ``decisions`` whichever copy a layer uses."""
        if self.trivial is None or self.trivial.device == device:
            return self
        if device not in self.copies:
            moved = {name: getattr(self, name).to(device) for name in Pass.TENSORS if getattr(self, name) is not None}
            keys = tuple(None if t is None else t.to(device) for t in self.keys)
            self.copies[device] = dataclasses.replace(self, **moved, keys=keys, kernel_inputs=None,
                                                      decisions=self.decisions, copies={})
        return self.copies[device]

    def readable(self, index: torch.Tensor, valid: torch.Tensor | None, part: slice) -> torch.Tensor:
        """The keys positions ``part`` selected, ``index`` (r, Hkv or 1, n), moved into what each may read
        (:func:`.semantics.readable_keys`); which positions' counted keys moved is kept on their device, for the call's
        end (:func:`out_of_bounds`): no read-back per layer."""
        index, outside = semantics.readable_keys(index, valid, self.low[part], self.high[part])
        seen = self.outside.get(index.device)
        if seen is None:
            seen = self.outside[index.device] = torch.zeros(len(self.pos), dtype=torch.bool, device=index.device)
        seen[part].logical_or_(outside)
        return index


def out_of_bounds(passes: list[Pass]) -> tuple[int, int]:
    """How many of the call's speculated positions selected keys outside what they may read (at any layer), and the
    largest such position, read back once."""
    breaches = Breaches()
    for p in passes:
        for seen in p.outside.values():
            breaches.add(seen, p.pos)
    return breaches.take()


def assemble(plan: Plan, passes: list[Pass],
             num_layers: int) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """Per-pass sparse decisions as dense (batch, positions, layers) codes, ratios and each measure the decisions
    carry (NaN where not measured), put together where the decisions are and copied to the host once (no read-back
    per layer: on a GPU each would stall the stream). A (row, layer) the plan has off records nothing, whatever its
    batch mates decided."""
    batch = plan.rows
    device = next((p.trivial.device for p in passes if p.trivial is not None), torch.device("cpu"))
    names = sorted({name for p in passes for d in p.decisions.values() if d is not None for name in d[3]})
    codes, ratios, grids = [], [], {name: [] for name in names}
    for p in passes:
        c = torch.zeros(batch, p.q_len, num_layers, dtype=torch.int8, device=device)
        r = torch.full((batch, p.q_len, num_layers), float("nan"), device=device)
        codes.append(c)
        ratios.append(r)
        for grid in grids.values():
            grid.append(torch.full_like(r, float("nan")))
        if p.trivial is None or not p.decisions:  # an idle pass: nothing in the region
            continue
        decided = torch.tensor(sorted(p.decisions), device=device)
        c[:, :, decided] = torch.where(p.trivial[:, :, None], TRIVIAL, 0).to(torch.int8)
        exact = [layer for layer, decision in p.decisions.items() if decision is None]
        measured = sorted(layer for layer, decision in p.decisions.items() if decision is not None)
        # (R, layers) or, for a fused decode step, (B, layers): each layer's decisions moved from the layer's
        # own device (a device map spreads them)
        accept, d, n = (torch.stack([p.decisions[layer][i].to(device) for layer in measured], 1)
                        if measured else None for i in range(3))
        if p.dense:  # every batch row decided: keep the speculated ones, by mask
            speculated = p.speculated.to(device)[:, None]
            if exact:
                at = torch.tensor(exact, device=device)
                c[:, 0, at] = torch.where(speculated, REJECTED, c[:, 0, at]).to(torch.int8)
            if measured:
                at = torch.tensor(measured, device=device)
                code = torch.where(accept, ACCEPTED, REJECTED).to(torch.int8)
                c[:, 0, at] = torch.where(speculated, code, c[:, 0, at])
                r[:, 0, at] = torch.where(speculated, (d / n).float(), r[:, 0, at])
            continue
        rows, cols = p.rows[:, None], p.cols[:, None]
        if exact:
            c[rows, cols, torch.tensor(exact, device=device)] = REJECTED
        if measured:
            at = torch.tensor(measured, device=device)
            c[rows, cols, at] = torch.where(accept, ACCEPTED, REJECTED).to(torch.int8)
            r[rows, cols, at] = (d / n).float()
            for name, grid in grids.items():  # every measured layer of a draft that measures has it (none: no rows)
                values = [p.decisions[layer][3].get(name) for layer in measured]
                if all(v is not None for v in values):
                    grid[-1][rows, cols, at] = torch.stack([v.to(device) for v in values], 1).float()
    if not codes:
        empty = torch.zeros(batch, 0, num_layers)
        return torch.zeros(batch, 0, num_layers, dtype=torch.int8), empty, {name: empty.clone() for name in names}
    codes, ratios = torch.cat(codes, 1).cpu(), torch.cat(ratios, 1).cpu()
    off = plan.lam.isnan()[:, None, :]
    measures = {name: torch.cat(grid, 1).cpu().masked_fill(off, float("nan")) for name, grid in grids.items()}
    return codes.masked_fill(off, 0), ratios.masked_fill(off, float("nan")), measures
