"""What another approximation of A~ buys over the sink at the same lambda and key budget 2S:
per task, window (on a budget axis) and lambda, its hit rate minus the sink's and its score minus the sink's, each
with a paired 95% bootstrap interval over the documents both cells ran, and the speedup the latency model projects
for each (the first table of the report's). Written only for a sweep with the sink and another approximation."""

from __future__ import annotations

import csv
import math
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from ..approximations import Approximation
from ..latency import Projection
from .cells import Cell, Row, Sweep
from .frames import ROUTINES, decisions_by_document, document_scores, paired_bootstrap, paired_ratio_difference
from .styles import ORACLE_MARK, oracle_note


@dataclass(frozen=True)
class Gain:
    task: str
    lam: float
    approx: Approximation
    window: int | None  # on a budget axis; None: the sweep's one
    documents: int
    sink_hit: float
    hit: float
    hit_diff: float
    hit_low: float
    hit_high: float
    score_diff: float
    score_low: float
    score_high: float
    sink_speedup: float | None = None  # projected (None without a latency table)
    speedup: float | None = None


def approximation_gains(sweep: Sweep, entries: dict[tuple[Row, str], Projection] | None = None) -> list[Gain]:
    """Every (task, lambda, window, approximation other than the sink) whose cell and the sink's cell at the same
    window both exist; ``entries``: a latency table's projections of the sweep's cells."""
    gains = []
    entries = entries or {}
    others = [approx for approx in sweep.approximations if not approx.is_default]
    for task in sweep.tasks:
        for window, lam, approx in ((w, lam, a) for w in sweep.axis for lam in sweep.lambdas for a in others):
            sink_row, row = Row("dynamic", lam=lam, window=window), Row.dynamic(lam, approx).approximated(approx, window)
            sink, other = sweep.cell(task, sink_row), sweep.cell(task, row)
            if sink is None or other is None:
                continue
            speeds = [entries[key].speedup if key in entries else None for key in ((sink_row, task), (row, task))]
            gains.append(Gain(task, lam, approx, window, *paired_difference(other, sink), *speeds))
    return gains


def paired_difference(ours: Cell, theirs: Cell) -> tuple[int, float, float, float, float, float, float, float, float]:
    """Two cells of one task on the documents both ran: their number, ``theirs``'s hit rate and ``ours``'s, the hit
    rate's difference (ours minus theirs) and the score's, each with its paired 95% bootstrap interval."""
    decided = decisions_by_document(ours), decisions_by_document(theirs)
    docs = sorted(set(decided[0]) & set(decided[1]))
    pairs = [np.array([d[doc] for doc in docs], dtype=float).reshape(-1, 2) for d in decided]
    hit = paired_ratio_difference(*((p[:, 0], p[:, 1]) for p in pairs))
    scores = document_scores(ours), document_scores(theirs)
    common = scores[0].index.intersection(scores[1].index)
    score = paired_bootstrap((scores[0][common] - scores[1][common]).to_numpy())
    return len(docs), _rate(pairs[1]), _rate(pairs[0]), *hit, *score


def _rate(pairs: np.ndarray) -> float:
    return float(pairs[:, 0].sum() / pairs[:, 1].sum()) if pairs[:, 1].sum() else math.nan


def _points(x: float) -> str:
    return "–" if math.isnan(x) else f"{100 * x:+.1f}"


TITLE = "Beside the sink: other approximations at the same lambda and 2S keys"
NOTE = ("Hit rate and score of each approximation minus the sink's at the same lambda and window, in percentage "
        "points, and the speedup the latency model projects for each (an ESTIMATE beyond the sink's 2S keys), with "
        "paired 95% bootstrap intervals over the documents (n). " + ROUTINES)


def gains_rows(gains: list[Gain]) -> list[list[str]]:
    """The table (header first): hit rates, their difference and the score difference per task, window (a budget
    axis's), lambda and approximation, and the projected speedups where a latency table priced them."""
    axis = any(g.window is not None for g in gains)
    priced = any(g.speedup is not None for g in gains)
    rows = [["task", *(["S"] if axis else []), "λ", "approximation", "n", "hit rate, sink → it", "Δ hit rate [95% CI]",
             "Δ score [95% CI]", *(["projected speedup, sink → it"] if priced else [])]]
    for g in gains:
        name = g.approx.label + (ORACLE_MARK if g.approx.oracle else "")
        speed = "–" if g.speedup is None or g.sink_speedup is None else f"{g.sink_speedup:.2f}× → {g.speedup:.2f}×"
        rows.append([g.task, *([str(g.window)] if axis else []), f"{g.lam:g}", name, str(g.documents),
                     f"{100 * g.sink_hit:.1f}% → {100 * g.hit:.1f}%",
                     f"{_points(g.hit_diff)} [{_points(g.hit_low)}, {_points(g.hit_high)}]",
                     f"{_points(g.score_diff)} [{_points(g.score_low)}, {_points(g.score_high)}]",
                     *([speed] if priced else [])])
    return rows


def gains_notes(gains: list[Gain]) -> list[str]:
    return [f"{ORACLE_MARK} {note}" for note in dict.fromkeys(oracle_note(g.approx) for g in gains if g.approx.oracle)]


def gains_markdown(gains: list[Gain]) -> str:
    rows = gains_rows(gains)
    table = ["| " + " | ".join(r) + " |" for r in rows]
    table.insert(1, "|" + " --- |" * len(rows[0]))
    return "\n".join([f"# {TITLE}", "", NOTE, "", *table, "", *gains_notes(gains)]) + "\n"


def write_gains_csv(gains: list[Gain], path: Path) -> Path:
    with path.open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=["task", "lam", "approx", "approx_args",
                                                    *list(Gain.__dataclass_fields__)[3:]])
        writer.writeheader()
        writer.writerows({**asdict(g), "approx": g.approx.name,
                          "approx_args": ";".join(f"{k}:{v}" for k, v in g.approx.args().items())} for g in gains)
    return path
