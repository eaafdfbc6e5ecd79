"""How the report draws and names each row kind, in one table keyed by kind, and each approximation of A~, in one
table keyed by approx.

A kind added to ``rows.KINDS`` needs its entry here and nothing else in the report: everything else the report
asks the row itself (``exact_attention``, ``drafts_tokens``, ``lam``, ``gamma``, ``label``, ``order``). The same
holds for an approximation added to ``config.APPROXIMATIONS``.
"""

from __future__ import annotations

from dataclasses import dataclass

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
    "sink": Style("X", "tab:blue", "sink (λ = ∞)"),
    "static": Style("s", "tab:blue", "static layers"),
    "selfspec": Style("^", "tab:orange"),
    "tuned": Style("*", "tab:red"),
}


@dataclass(frozen=True)
class ApproxStyle:
    """One approximation's look where figures tell approximations apart (``marker``, ``colour``: its lambda rows'
    line and points), and what tables add to its rows' labels (``mark``, explained by ``note``): the oracle's rows
    carry a mark, so that no one reads its numbers as an approximation to deploy."""

    marker: str
    colour: str
    description: str  # what A~ attends to, for captions ("{page}": quest's page)
    mark: str = ""
    note: str | None = None

    @property
    def oracle(self) -> bool:
        """An approximation that reads what it approximates (every exact score): a ceiling, marked wherever shown."""
        return self.note is not None


ORACLE_NOTE = ("topk: A~ attends to the 2S keys with the largest exact scores, an ORACLE ceiling for any 2S keys "
               "chosen by score: it needs every exact score, as exact attention does, so it is no approximation to "
               "deploy.")

APPROX_STYLES: dict[str, ApproxStyle] = {
    "sink": ApproxStyle("o", "tab:blue", "the sink windows"),
    "quest": ApproxStyle("v", "tab:green", "Quest's query-aware pages of {page} tokens"),
    "topk": ApproxStyle("P", "tab:purple", "the 2S keys with the largest exact scores", "†", ORACLE_NOTE),
}

# Why the speed columns hold a dash for rows of these approximations (the latency model is the sink's).
NO_COST_MODEL = "no cost model for {names}: the paper's latency model is the sink's"


def style(row: Row) -> Style:
    return STYLES[row.kind]


def approx_style(approx: str) -> ApproxStyle:
    return APPROX_STYLES[approx]


def approx_label(approx: str, page: int | None = None) -> str:
    """An approximation as legends name it: "sink", "quest P=16", "topk (oracle ceiling)"."""
    label = approx + (f" P={page}" if page is not None else "")
    return label + (" (oracle ceiling)" if approx_style(approx).oracle else "")


def approx_description(approx: str, page: int | None = None) -> str:
    """"quest P=16: Quest's query-aware pages of 16 tokens"."""
    name = approx + (f" P={page}" if page is not None else "")
    return f"{name}: {approx_style(approx).description.format(page=page)}"


def table_label(row: Row) -> str:
    """The row's label as tables show it: an oracle's rows marked (``APPROX_STYLES``' mark, its note below the
    table)."""
    mark = approx_style(row.approx).mark
    return f"{row.label} {mark}" if mark else row.label


def row_columns(row: Row) -> dict[str, str]:
    """What the CSV files say a row is: its kind (the ``policy`` column), its lambda and its gamma (blank for the
    kinds without one), and where a sweep has more than the sink its approximation (blank for the baseline, which
    has none), quest's page and whether it is an oracle ceiling ("oracle": "yes" for topk)."""
    return {"policy": row.kind, "lambda": "" if row.lam is None else f"{row.lam:g}",
            "gamma": "" if row.gamma is None else str(row.gamma), "approx": "" if row == BASELINE else row.approx,
            "page": "" if row.page is None else str(row.page),
            "oracle": "yes" if approx_style(row.approx).oracle else ""}
