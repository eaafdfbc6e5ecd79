"""Drafts at equal density: a draft whose key budget varies per query (``max_keys`` None: vAttention's sample) reads
more or less of the context than the 2S keys of the others, so a comparison at one S is not at equal density. On a
budget axis (several S), each such draft is set beside every draft of 2S keys at the S where their measured
densities (the share of the context A~ read, ``stats.DENSITY``) are nearest, both cells at that S: the same
documents and the same trivial positions. Per task and lambda (and unverified, lambda = inf): hit rates and scores,
paired. Written only for a sweep with a budget axis and both kinds of draft."""

from __future__ import annotations

import csv
import math
from dataclasses import asdict, dataclass
from pathlib import Path

from ..approximations import Approximation
from .cells import SINK, Row, Sweep
from .frames import ROUTINES
from .gains import paired_difference
from .styles import ORACLE_MARK, oracle_note
from .table import markdown_table


@dataclass(frozen=True)
class Pairing:
    """A draft whose budget varies (``approx``) beside one of 2S keys (``other``) at the S of their nearest densities;
    differences are ``approx``'s minus ``other``'s."""

    task: str
    lam: float  # inf: both unverified (A~ always)
    approx: Approximation
    other: Approximation
    window: int
    density: float
    other_density: float
    documents: int
    other_hit: float
    hit: float
    hit_diff: float
    hit_low: float
    hit_high: float
    score_diff: float
    score_low: float
    score_high: float


def equal_density(sweep: Sweep) -> list[Pairing]:
    """Every (task, lambda, varying draft, fixed draft) whose cells exist at some S of the axis with densities."""
    windows = [w for w in sweep.axis if w is not None]
    if len(windows) < 2:
        return []
    varying = [a for a in sweep.approximations if a.max_keys(windows[0]) is None]
    fixed = [a for a in sweep.approximations if a.max_keys(windows[0]) is not None]
    pairings = []
    for task in sweep.tasks:
        for lam, row in [*((lam, Row.dynamic(lam)) for lam in sweep.lambdas), (math.inf, SINK)]:
            for approx in varying:
                for other in fixed:
                    found = []
                    for window in windows:
                        ours = sweep.cell(task, row.approximated(approx, window))
                        theirs = sweep.cell(task, row.approximated(other, window))
                        if ours and theirs and ours.total.density is not None and theirs.total.density is not None:
                            found.append((abs(ours.total.density - theirs.total.density), window, ours, theirs))
                    if found:  # the nearest densities; of equally near ones, the smallest S
                        _, window, ours, theirs = min(found, key=lambda f: f[0])
                        pairings.append(Pairing(task, lam, approx, other, window, ours.total.density,
                                                theirs.total.density, *paired_difference(ours, theirs)))
    return pairings


TITLE = "At equal density: drafts whose budget varies beside drafts of 2S keys"
NOTE = ("A draft whose key budget varies per query reads more or less of the context than 2S keys, so the board's "
        "comparison at one S is not at equal density. Each such draft is set beside every draft of 2S keys at the S "
        "of the sweep's budget axis where their densities (the share of the context A~ read) are nearest, both cells "
        "at that S: the same documents and positions. Hit rate and score of the first minus the second's, in "
        "percentage points, with paired 95% bootstrap intervals over the documents (n); λ = ∞: both unverified. "
        + ROUTINES)


def _points(x: float) -> str:
    return "–" if math.isnan(x) else f"{100 * x:+.1f}"


def _name(approx: Approximation) -> str:
    return approx.label + (ORACLE_MARK if approx.oracle else "")


def density_rows(pairings: list[Pairing]) -> list[list[str]]:
    """The table, header first."""
    rows = [["task", "λ", "draft: density, hit rate", "S", "beside: density, hit rate", "n", "Δ hit rate [95% CI]",
             "Δ score [95% CI]"]]
    for p in pairings:
        rows.append([p.task, "∞" if math.isinf(p.lam) else f"{p.lam:g}",
                     f"{_name(p.approx)}: {100 * p.density:.1f}%, {100 * p.hit:.1f}%", str(p.window),
                     f"{_name(p.other)}: {100 * p.other_density:.1f}%, {100 * p.other_hit:.1f}%", str(p.documents),
                     f"{_points(p.hit_diff)} [{_points(p.hit_low)}, {_points(p.hit_high)}]",
                     f"{_points(p.score_diff)} [{_points(p.score_low)}, {_points(p.score_high)}]"])
    return rows


def density_notes(pairings: list[Pairing]) -> list[str]:
    oracles = dict.fromkeys(oracle_note(a) for p in pairings for a in (p.approx, p.other) if a.oracle)
    return [f"{ORACLE_MARK} {note}" for note in oracles]


def density_markdown(pairings: list[Pairing]) -> str:
    return "\n".join([f"# {TITLE}", "", NOTE, "", markdown_table(density_rows(pairings)), *density_notes(pairings)])


def write_density_csv(pairings: list[Pairing], path: Path) -> Path:
    def args(approx: Approximation) -> str:
        return ";".join(f"{k}:{v}" for k, v in approx.args().items())

    with path.open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=["task", "lam", "approx", "approx_args", "other", "other_args",
                                                    *list(Pairing.__dataclass_fields__)[4:]])
        writer.writeheader()
        writer.writerows({**asdict(p), "approx": p.approx.name, "approx_args": args(p.approx),
                          "other": p.other.name, "other_args": args(p.other)} for p in pairings)
    return path
