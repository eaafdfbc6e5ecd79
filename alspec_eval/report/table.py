"""Table 1 of the paper: score / hit rate per row (baseline, lambdas, sink, static) and task."""

from __future__ import annotations

import csv
from pathlib import Path

from alspec_eval.report.load import BASELINE, Cell, Sweep

MISSING = "–"


def format_cell(cell: Cell | None) -> str:
    """"0.253 / 42.0%" (score as lm-eval reports it, hit rate in percent); the baseline has no hit rate."""
    if cell is None:
        return MISSING
    score = MISSING if cell.score is None else f"{cell.score:.3f}"
    if cell.row == BASELINE:
        return score
    hit = MISSING if cell.hit_rate is None else f"{100 * cell.hit_rate:.1f}%"
    return f"{score} / {hit}"


def table1_rows(sweep: Sweep) -> list[list[str]]:
    """Header plus one formatted line per row of Table 1."""
    header = ["", *sweep.tasks]
    return [header, *([row.label, *(format_cell(sweep.cell(t, row)) for t in sweep.tasks)] for row in sweep.rows)]


def markdown_table(rows: list[list[str]]) -> str:
    """GitHub-flavoured markdown of a header row plus body rows."""
    def line(cells: list[str]) -> str:
        return "| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |"
    return "\n".join([line(rows[0]), line(["---"] * len(rows[0])), *map(line, rows[1:])]) + "\n"


def table1_markdown(sweep: Sweep) -> str:
    metrics = sorted({f"{c.task}: `{c.metric}`" for c in sweep.cells if c.metric})
    caption = "Score / speculation hit rate (share of non-trivial decode attention replaced by the sink approximation)."
    return f"{caption}\n\n{markdown_table(table1_rows(sweep))}\nMetrics: {'; '.join(metrics)}\n"


def write_table1_csv(sweep: Sweep, path: Path) -> Path:
    """Table 1 layout with numbers kept numeric: per task a score and a hit-rate (%) column."""
    with path.open("w", newline="") as f:
        out = csv.writer(f)
        out.writerow(["row", "policy", "lambda", *(f"{t} {col}" for t in sweep.tasks for col in ("score", "hit_rate_pct"))])
        for row in sweep.rows:
            values: list[str] = []
            for task in sweep.tasks:
                cell = sweep.cell(task, row)
                values += [_num(cell.score if cell else None), _num(100 * cell.hit_rate if cell and cell.hit_rate is not None else None)]
            out.writerow([row.label, row.kind, f"{row.lam:g}" if row.kind == "dynamic" else "", *values])
    return path


def _num(x: float | None) -> str:
    return "" if x is None else repr(float(x))

