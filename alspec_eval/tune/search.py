"""The search of alspec-tune: the per-layer lambdas that project the largest speedup within a score budget.

1. Open loop. A calibration run's per-layer d/n histograms say, for every layer and threshold t of the report's grid
   (``stats.open_loop``), the share of decisions t would accept (``h``) and the mean d/n it would let through
   (``e``, the error a layer adds).
2. A path of schedules. From every layer at lambda = 0, greedily raise the one layer whose next threshold buys the
   most hit rate per unit of added error (the steepest step of the layers' h-against-e curves), until every layer
   is at the largest threshold. Along the path each layer's lambda only grows, so the open-loop hit rates, the
   projected speedup (linear in them, ``latency.project_layers``) and the error all grow with the step.
3. Closed loop. Bisection on the path's step: the candidate at the middle step is run on the calibration
   documents and judged by the budget (every task's paired bootstrap interval of the score difference against the
   baseline has its lower bound >= -max_drop); feasible moves up, infeasible down.
4. The choice: of every candidate that was run and met the budget, the uniform lambdas of the calibration sweep
   included, the one with the largest projected speedup from its measured hit rates.

Why it is sound: nothing is kept on a prediction. Every candidate is run, and the schedule chosen met the budget
on the calibration documents with the hit rates it measured there; since the uniform lambdas are candidates, it
projects at least the speedup of the best uniform lambda that met the budget on them. The held-out documents,
never seen by the search, then judge it once. The open-loop path only orders the candidates: it assumes the score
drop grows with the error allowance, which bisection needs; where it does not, bisection still returns a feasible
candidate, perhaps not the fastest on the path.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from ..stats import OPEN_LOOP_GRID, OpenLoop


def schedule_path(curves: Sequence[OpenLoop]) -> list[list[float]]:
    """The greedy path of per-layer lambdas: step 0 has every layer at 0; each step raises one layer to a higher
    threshold of OPEN_LOOP_GRID (where open-loop predictions are exact), the step with the most hit rate per unit of
    added error (ties: the lower layer); the last step has every layer at the largest threshold."""
    level = [-1] * len(curves)  # index into OPEN_LOOP_GRID; -1 is lambda = 0

    def gain(layer: int) -> tuple[float, int, int] | None:
        """The best next step of a layer: (hit per error, layer, target level), over every higher level."""
        curve, k = curves[layer], level[layer]
        h0, e0 = (curve.hit[k], curve.error[k]) if k >= 0 else (0.0, 0.0)
        best = None
        for j in range(k + 1, len(OPEN_LOOP_GRID)):
            dh, de = curve.hit[j] - h0, curve.error[j] - e0
            rate = math.inf if de <= 0 and dh > 0 else (dh / de if de > 0 else 0.0)
            if best is None or rate > best[0]:
                best = (rate, layer, j)
        return best

    path = [[0.0] * len(curves)]
    while True:
        steps = [g for layer in range(len(curves)) if (g := gain(layer)) is not None]
        if not steps:
            return path
        _, layer, target = max(steps, key=lambda g: (g[0], -g[1]))
        level[layer] = target
        path.append([OPEN_LOOP_GRID[k] if k >= 0 else 0.0 for k in level])


@dataclass(frozen=True)
class Measured:
    """A candidate run on the calibration documents: whether it met the budget on every task, and its projected
    speedup from the hit rates it measured."""

    feasible: bool
    speedup: float
    details: dict = field(default_factory=dict, compare=False)  # per task: diff, interval, hit rates (for tune.json)


@dataclass
class Search:
    """Bisection on the path's step; ``evaluate`` runs one schedule (per-layer lambdas) on the calibration
    documents."""

    path: list[list[float]]
    evaluate: Callable[[list[float]], Measured]
    tried: list[tuple[int, list[float], Measured]] = field(default_factory=list)

    def run(self, steps: int, start: int = 0) -> None:
        """``steps`` bisection steps between ``start`` (taken as feasible: the bracket's low end) and the path's end
        (taken as infeasible: every layer at the largest threshold; neither end is run)."""
        lo, hi = start, len(self.path) - 1
        for _ in range(steps):
            if hi - lo <= 1:
                break
            mid = (lo + hi) // 2
            measured = self.evaluate(self.path[mid])
            self.tried.append((mid, self.path[mid], measured))
            lo, hi = (mid, hi) if measured.feasible else (lo, mid)


def start_step(path: list[list[float]], curves: Sequence[OpenLoop], hit_rate: float) -> int:
    """The last step whose open-loop mean hit rate stays within ``hit_rate`` (the best uniform lambda's measured
    one): where bisection starts, since the uniform lambda met the budget there."""
    step = 0
    for i, lambdas in enumerate(path):
        mean = sum(_hit_at(c, lam) for c, lam in zip(curves, lambdas)) / len(curves)
        if mean > hit_rate:
            break
        step = i
    return step


def _hit_at(curve: OpenLoop, lam: float) -> float:
    if lam <= 0:
        return 0.0
    return curve.hit[OPEN_LOOP_GRID.index(lam)]


def best(candidates: Sequence[tuple[str, Measured]]) -> tuple[str, Measured] | None:
    """The feasible candidate with the largest projected speedup (ties: the first)."""
    feasible = [c for c in candidates if c[1].feasible]
    return max(feasible, key=lambda c: c[1].speedup) if feasible else None
