"""Acceptance statistics, schema version 2 (docs/design.md, Statistics; version 2 adds ``selfspec``).

A run records, per batch row, token position and layer, one decision code and the
ratio d/n. Reducing a row's codes gives a sample's counts and ratio histogram;
summing samples gives a task's. Because every number is derived from per-row
decisions, statistics do not depend on batch composition.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from . import semantics

SCHEMA_VERSION = 2
# Per layer, beside the counts (added within version 2; files without them read as before): sparse-attention-hub's
# names where the meaning is the same. Means over the layer's non-trivial decisions.
DENSITY = "research_attention_density"  # the share of the context A~ reads: 2S / (pos + 1), or the keys it read
EFFECTIVE_DENSITY = "effective_density"  # what a step reads once rejections fall back to A: the above, or 1
OUTPUT_ERROR = "research_attention_output_error"  # ||A~ - A|| / ||A||: d / n
# A draft's promise (vAttention's epsilon, delta), measured: per layer the share of verified decisions where ALSpec's
# d/n exceeds epsilon, and the share of (decision, query head) pairs whose softmax denominator the selection misses by
# more than epsilon of it; present only where the draft promises (null where it bounds no denominator)
PROMISE_DN = "promise_dn_exceeded"
PROMISE_DENOMINATOR = "promise_denominator_exceeded"
# per-decision measures beside code and d/n, by name (Trace.measures, the engines' records)
KEYS_READ = "keys"  # a draft whose budget varies: the keys its A~ read per KV head (their mean over the KV heads)
DENOMINATOR = "denominator"  # a draft that promises its denominator: the share of query heads that miss it
DIGITS = 9  # significant digits the float means are written with (sums over ranks may differ in the last bit)

# Decision codes, one per (row, position, layer); 0 marks positions outside the decode region.
TRIVIAL, REJECTED, ACCEPTED = 1, 2, 3

# Fixed log-spaced bins of d/n: 20 per decade from 1e-4 to 10, plus underflow [0, 1e-4) and overflow [10, inf).
RATIO_EDGES: tuple[float, ...] = tuple(10 ** (k / 20) for k in range(-80, 21))
NUM_BINS = len(RATIO_EDGES) + 1


def ratio_bins(ratios: torch.Tensor) -> torch.Tensor:
    """Bin index of each ratio: bin k holds edges[k-1] <= r < edges[k]."""
    edges = torch.tensor(RATIO_EDGES, dtype=ratios.dtype, device=ratios.device)
    return torch.bucketize(ratios, edges, right=True)


@dataclass
class DraftStats:
    """Token-level self-speculation (policy=selfspec): per verification step, how many of the drafted tokens the
    exact model accepted. tau, the mean tokens per step, counts the verifier's own token too."""

    gamma: int
    hist: list[int]  # verification steps by accepted draft tokens, 0..gamma
    drafted: int = 0  # the last step of a row drafts fewer than gamma when max_gen_toks is near

    @classmethod
    def zeros(cls, gamma: int) -> "DraftStats":
        return cls(gamma, [0] * (gamma + 1))

    def record(self, drafted: int, accepted: int) -> None:
        self.drafted += drafted
        self.hist[accepted] += 1

    @property
    def steps(self) -> int:
        return sum(self.hist)

    @property
    def accepted(self) -> int:
        return sum(k * n for k, n in enumerate(self.hist))

    @property
    def tau(self) -> float | None:
        return (self.accepted + self.steps) / self.steps if self.steps else None

    def __add__(self, other: "DraftStats") -> "DraftStats":
        if other.gamma != self.gamma:
            raise ValueError(f"cannot add self-speculation statistics of gamma {self.gamma} and {other.gamma}")
        return DraftStats(self.gamma, [a + b for a, b in zip(self.hist, other.hist)], self.drafted + other.drafted)

    def to_dict(self) -> dict[str, Any]:
        return {"gamma": self.gamma, "steps": self.steps, "drafted": self.drafted, "accepted": self.accepted,
                "tau": self.tau, "hist": list(self.hist)}


@dataclass
class AcceptanceStats:
    """Per-layer counts and ratio histograms for a sample, a task or a whole run (and, under policy=selfspec,
    the token-level draft statistics)."""

    speculated: torch.Tensor  # (L,) non-trivial decisions
    accepted: torch.Tensor  # (L,)
    trivial: torch.Tensor  # (L,)
    hist: torch.Tensor  # (L, NUM_BINS) counts of d/n over non-trivial decisions
    draft: DraftStats | None = None
    # (L,) float64 sums over non-trivial decisions: A~'s density, the effective density, and d/n where measured
    density: torch.Tensor | None = None
    effective: torch.Tensor | None = None
    error: torch.Tensor | None = None
    # (L, 4) float64 where the draft promises (else None): decisions with d/n > epsilon, decisions measured, the sum of
    # the denominator's missed shares, decisions it was measured at (none where it bounds no denominator: null)
    promised: torch.Tensor | None = None

    def __post_init__(self) -> None:
        for name in ("density", "effective", "error"):
            if getattr(self, name) is None:
                object.__setattr__(self, name, torch.zeros(len(self.speculated), dtype=torch.float64))

    @classmethod
    def zeros(cls, num_layers: int) -> "AcceptanceStats":
        z = torch.zeros(num_layers, dtype=torch.long)
        return cls(z.clone(), z.clone(), z.clone(), torch.zeros(num_layers, NUM_BINS, dtype=torch.long))

    @classmethod
    def from_trace(cls, codes: torch.Tensor, ratios: torch.Tensor, pos: torch.Tensor | None = None,
                   budget: int | None = 0, measures: dict[str, torch.Tensor] | None = None,
                   epsilon: float | None = None) -> "AcceptanceStats":
        """Reduce one row's (positions, layers) codes and ratios; NaN ratios (not measured) stay out of the histogram.
        ``pos``: each position's logical position and ``budget`` the keys A~ attends to (2S: the draft's
        ``max_keys``), for the densities; None, a budget that varies per head and query (vAttention's): then the
        measure :data:`KEYS_READ` (positions, layers), the keys each decision's A~ read per KV head, gives them
        (without it they are not measured: NaN sums, reported as null). ``epsilon``: a draft's promised error, whose
        realized shares are counted (d/n, and the measure :data:`DENOMINATOR` where given)."""
        measures = measures or {}
        keys = measures.get(KEYS_READ)
        codes, ratios = codes.cpu(), ratios.cpu()
        num_layers = codes.shape[-1]
        decided = (codes == ACCEPTED) | (codes == REJECTED)
        measured = decided & ~torch.isnan(ratios)
        layer_idx = torch.arange(num_layers).expand_as(codes)[measured]
        flat = layer_idx * NUM_BINS + ratio_bins(ratios[measured].float())
        hist = torch.bincount(flat, minlength=num_layers * NUM_BINS).view(num_layers, NUM_BINS)
        density = effective = None
        if pos is not None:  # a budget that varies and was not measured: NaN wherever decided (null)
            read = (torch.tensor(float(budget), dtype=torch.float64) if budget is not None
                    else torch.full(codes.shape, math.nan, dtype=torch.float64) if keys is None
                    else keys.cpu().double())
            share = (read / (pos.double() + 1)[:, None]).clamp(max=1.0).expand_as(codes)
            density = torch.where(decided, share, 0.0).sum(0)
            effective = torch.where(codes == ACCEPTED, share, torch.where(decided, 1.0, 0.0)).sum(0)
        return cls(
            speculated=decided.sum(0),
            accepted=(codes == ACCEPTED).sum(0),
            trivial=(codes == TRIVIAL).sum(0),
            hist=hist,
            density=density,
            effective=effective,
            error=torch.where(measured, ratios.double(), 0.0).sum(0),
            promised=None if epsilon is None else _promised(ratios, measured, decided, measures.get(DENOMINATOR),
                                                            epsilon),
        )

    def __add__(self, other: "AcceptanceStats") -> "AcceptanceStats":
        return AcceptanceStats(
            self.speculated + other.speculated,
            self.accepted + other.accepted,
            self.trivial + other.trivial,
            self.hist + other.hist,
            self.draft if other.draft is None else other.draft if self.draft is None else self.draft + other.draft,
            self.density + other.density,
            self.effective + other.effective,
            self.error + other.error,
            self.promised if other.promised is None else other.promised if self.promised is None
            else self.promised + other.promised,
        )

    def means(self, layer: int | None = None) -> dict[str, float | None]:
        """The densities and the mean d/n of one layer (None: over every layer), as the results name them."""
        pick = (lambda t: t.sum()) if layer is None else (lambda t: t[layer])
        spec, measured = int(pick(self.speculated)), int(pick(self.hist.sum(-1)))
        out = {DENSITY: _mean(float(pick(self.density)), spec),
               EFFECTIVE_DENSITY: _mean(float(pick(self.effective)), spec),
               OUTPUT_ERROR: _mean(float(pick(self.error)), measured)}
        if self.promised is not None:  # only a draft that promises has these
            dn, dn_count, den, den_count = (float(pick(self.promised[:, i])) for i in range(4))
            out[PROMISE_DN] = _mean(dn, int(dn_count))
            out[PROMISE_DENOMINATOR] = _mean(den, int(den_count))
        return out

    def summary(self) -> dict[str, Any]:
        """Totals over layers, as logged per sample."""
        spec, acc = int(self.speculated.sum()), int(self.accepted.sum())
        out = {"speculated": spec, "accepted": acc, "trivial": int(self.trivial.sum()), "hit_rate": _rate(acc, spec)}
        if self.draft is not None:
            out["selfspec"] = {k: v for k, v in self.draft.to_dict().items() if k != "hist"}
        return out

    def to_dict(self, skipped_layers: dict[int, str] | None = None) -> dict[str, Any]:
        """Schema v2 form of one task: per-layer entries and totals."""
        skipped_layers = skipped_layers or {}
        layers = []
        for i in range(len(self.speculated)):
            spec, acc = int(self.speculated[i]), int(self.accepted[i])
            entry: dict[str, Any] = {
                "layer": i,
                "speculated": spec,
                "accepted": acc,
                "trivial": int(self.trivial[i]),
                "hit_rate": _rate(acc, spec),
                **self.means(i),
                "hist": self.hist[i].tolist(),
            }
            if i in skipped_layers:
                entry["skipped"] = skipped_layers[i]
            layers.append(entry)
        total = {k: v for k, v in self.summary().items() if k != "selfspec"}
        out: dict[str, Any] = {"layers": layers, "total": {**total, **self.means(), "hist": self.hist.sum(0).tolist()}}
        if self.draft is not None:
            out["selfspec"] = self.draft.to_dict()
        return out


def run_statistics(config: dict[str, Any], num_layers: int, skipped_layers: dict[int, str],
                   tasks: dict[str, AcceptanceStats]) -> dict[str, Any]:
    """Schema v2 of a run: config, histogram edges and per-task, per-layer statistics."""
    return {
        "schema_version": SCHEMA_VERSION,
        "config": config,
        "num_layers": num_layers,
        "skipped_layers": {str(k): v for k, v in sorted(skipped_layers.items())},
        "ratio_edges": list(RATIO_EDGES),
        "tasks": {task: stats.to_dict(skipped_layers) for task, stats in sorted(tasks.items())},
    }


def _promised(ratios: torch.Tensor, measured: torch.Tensor, decided: torch.Tensor, missed: torch.Tensor | None,
              epsilon: float) -> torch.Tensor:
    """(L, 4) sums of a promise's realized failures over one row (:attr:`AcceptanceStats.promised`): d/n > epsilon
    over the measured decisions, and the denominator's missed shares over the decisions where they were measured."""
    dn = (measured & (ratios.float() > torch.tensor(epsilon, dtype=torch.float32))).sum(0).double()  # as d/n is
    missed = torch.full(decided.shape, math.nan) if missed is None else missed.cpu()  # a row that measured none
    counted = decided & ~torch.isnan(missed)
    den, den_count = torch.where(counted, missed.double(), 0.0).sum(0), counted.sum(0).double()
    return torch.stack([dn, measured.sum(0).double(), den, den_count], 1)


def _mean(total: float, count: int) -> float | None:
    """total / count to DIGITS digits; None where nothing was counted or the total was not measured (NaN)."""
    return float(f"{total / count:.{DIGITS}g}") if count and not math.isnan(total) else None


def _rate(accepted: int, speculated: int) -> float | None:
    """hit_rate = accepted / speculated; None (JSON null) when nothing was speculated."""
    return accepted / speculated if speculated else None


# The thresholds of every open-loop curve, the report's figure and alspec-tune's layer lambdas alike: the histogram's
# bin edges from 1e-3 up, where reading a curve off the histogram is exact (no bin straddles a threshold).
OPEN_LOOP_GRID: tuple[float, ...] = tuple(e for e in RATIO_EDGES if e >= 1e-3)


@dataclass(frozen=True)
class OpenLoop:
    """A d/n histogram read open loop at each threshold ``OPEN_LOOP_GRID[k]``: ``hit[k]``, the share of decisions it
    would accept, and ``error[k]``, the mean d/n it would let through (each at its bin's upper edge: an upper bound,
    the error a layer adds). Both 0 without ``decisions``."""

    decisions: int
    hit: tuple[float, ...]
    error: tuple[float, ...]


def open_loop(hist: Sequence[int]) -> OpenLoop:
    """The open-loop curve of a histogram (the same bins in every schema version). A bin counts as accepted at t when
    semantics.accept accepts its upper edge (d = edge, n = 1), so the bin rule is the decode rule: then t accepts
    every ratio in the bin, and at the grid's thresholds no bin is accepted in part."""
    total = sum(hist)
    upper = [*RATIO_EDGES, math.inf]
    edges = torch.tensor(upper, dtype=torch.float64)
    hit, error = [], []
    for t in OPEN_LOOP_GRID:
        accepted = semantics.accept(edges, torch.ones_like(edges), t).tolist()
        hit.append(sum(c for c, ok in zip(hist, accepted) if ok) / total if total else 0.0)
        error.append(sum(c * e for c, e, ok in zip(hist, upper, accepted) if ok) / total if total else 0.0)
    return OpenLoop(total, tuple(hit), tuple(error))
