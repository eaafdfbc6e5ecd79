"""How the report draws and names each row kind, in one table keyed by kind.

A kind added to ``rows.KINDS`` needs its entry here and nothing else in the report: everything else the report
asks the row itself (``exact_attention``, ``drafts_tokens``, ``lam``, ``gamma``, ``label``, ``order``).
"""

from __future__ import annotations

from dataclasses import dataclass

from alspec_eval.rows import Row


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
    "sink": Style("X", "tab:blue", "sink (λ = ∞)"),
    "static": Style("s", "tab:blue", "static layers"),
    "selfspec": Style("^", "tab:orange"),
    "tuned": Style("*", "tab:red"),
}


def style(row: Row) -> Style:
    return STYLES[row.kind]


def row_columns(row: Row) -> dict[str, str]:
    """What the CSV files say a row is: its kind (the ``policy`` column), its lambda and its gamma (blank for the
    kinds without one)."""
    return {"policy": row.kind, "lambda": "" if row.lam is None else f"{row.lam:g}",
            "gamma": "" if row.gamma is None else str(row.gamma)}
