"""How the report draws and names each row kind, in one table keyed by kind, and each approximation of A~.

A kind added to ``rows.KINDS`` needs its entry here and nothing else in the report: everything else the report
asks the row itself (``exact_attention``, ``drafts_tokens``, ``lam``, ``gamma``, ``label``, ``order``). The same
holds for an approximation: its class says how it is drawn (alspec_eval.approximations).
"""

from __future__ import annotations

from dataclasses import dataclass

from alspec_eval.approximations import Approximation
from alspec_eval.rows import BASELINE, Row


@dataclass(frozen=True)
class Style:
    """One kind's look. ``marker`` and ``colour``: its points where figures tell rows apart by kind (speedup
    against score). ``hit_rate_legend``: its legend where score against hit rate draws it as one point per task;
    None where it is no such point (lambda rows are that figure's line, the baseline its dashed reference,
    self-speculation has no hit rate)."""

    marker: str
    colour: str
    hit_rate_legend: str | None = None


STYLES: dict[str, Style] = {
    "baseline": Style("D", "black"),
    "dynamic": Style("o", "tab:blue"),
    "always": Style("X", "tab:blue", "sink (λ = ∞)"),
    "static": Style("s", "tab:blue", "static layers"),
    "selfspec": Style("^", "tab:orange"),
    "tuned": Style("*", "tab:red"),
}


def oracle_note(approx: Approximation) -> str:
    """Below a table with an oracle's rows: what its mark means, so that no one reads its numbers as an approximation
    to deploy."""
    return (f"{approx.label}: A~ attends to {approx.description.format(**approx.args())}, an ORACLE ceiling: it "
            "reads every exact score, as exact attention does, so it is no approximation to deploy.")


ORACLE_MARK = "†"


def style(row: Row) -> Style:
    return STYLES[row.kind]


def hit_rate_legend(row: Row) -> str | None:
    """The row's legend where score against hit rate draws it as a point (its kind's ``hit_rate_legend``), except
    where the row names its kind otherwise: A~ always of an approximation other than the default is no sink, "λ = ∞"
    (the figure names the approximation beside it)."""
    legend = style(row).hit_rate_legend
    return row.kind_label if legend is not None and row.unverified else legend


def approx_label(approx: Approximation) -> str:
    """An approximation as legends name it: "sink", "quest P=16", "topk (oracle ceiling)"."""
    return approx.label + (" (oracle ceiling)" if approx.oracle else "")


def curve_label(approx: Approximation, window: int | None) -> str:
    """An approximation's curve at one window of a budget axis: "quest P=16 · S=32" (no S: the sweep's one)."""
    return approx_label(approx) + ("" if window is None else f" · S={window}")


def table_label(row: Row) -> str:
    """The row's label as tables show it: an oracle's rows marked (:data:`ORACLE_MARK`, its note below the table)."""
    return f"{row.label} {ORACLE_MARK}" if row.approx.oracle else row.label


def row_columns(row: Row) -> dict[str, str]:
    """What the CSV files say a row is: its kind (the ``policy`` column), its lambda and its gamma (blank for the
    kinds without one), and where a sweep has more than the sink its approximation (blank for the baseline, which
    has none), its parameters (``approx_args`` syntax) and whether it is an oracle ceiling ("oracle": "yes")."""
    return {"policy": row.kind, "lambda": "" if row.lam is None else f"{row.lam:g}",
            "gamma": "" if row.gamma is None else str(row.gamma), "approx": "" if row == BASELINE else row.approx.name,
            "approx_args": ";".join(f"{k}:{v}" for k, v in row.approx.args().items()),
            "oracle": "yes" if row.approx.oracle else ""}
