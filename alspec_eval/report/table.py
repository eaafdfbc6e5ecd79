"""Table 1 of the paper: score / hit rate per row (baseline, lambdas, sink, static) and task; self-speculation
rows (one per gamma) show score / tau instead. A sweep of several approximations of A~ has each row once per
approximation (at each lambda: sink, quest, topk), the oracle's rows marked."""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from alspec_eval.approximations import default_approximation
from alspec_eval.report.cells import BASELINE, Row, Sweep
from alspec_eval.report.frames import ROUTINES
from alspec_eval.report.styles import ORACLE_MARK, oracle_note, row_columns, table_label

MISSING = "–"
APPROX_COLUMNS = ("approx", "approx_args", "oracle")  # the CSV files' columns of a sweep beyond the sink (styles.row_columns)


def format_cell(cell: pd.Series | None, row: Row) -> str:
    """"0.807 (-0.004 [-0.02, +0.01]) / 94.8%": score as lm-eval reports it, the paired difference to the baseline
    with its 95% interval where the cell has per-document scores, and the hit rate; the baseline (the reference) shows
    its score only, a row that drafts tokens its tau instead of a hit rate."""
    if cell is None:
        return MISSING
    score = MISSING if pd.isna(cell["score"]) else f"{cell['score']:.3f}"
    if row == BASELINE:
        return score
    if not pd.isna(cell["diff"]):
        score += f" ({cell['diff']:+.3f} [{cell['diff_low']:+.2f}, {cell['diff_high']:+.2f}])"
    if row.drafts_tokens:
        return f"{score} / τ = {MISSING if pd.isna(cell['tau']) else format(cell['tau'], '.2f')}"
    hit = MISSING if pd.isna(cell["hit_rate"]) else f"{100 * cell['hit_rate']:.1f}%"
    return f"{score} / {hit}{promise_text(cell)}"


def promise_text(cell: pd.Series) -> str:
    """A promising draft's realized shares beside its hit rate, " (ε missed: d/n 12.0%, D 3.1%)"; nothing for a draft
    that promises nothing."""
    parts = [f"{name} {100 * cell[key]:.1f}%" for name, key in (("d/n", "promise_dn"), ("D", "promise_denominator"))
             if key in cell and not pd.isna(cell[key])]
    return f" (ε missed: {', '.join(parts)})" if parts else ""


def table1_rows(sweep: Sweep, cells: pd.DataFrame | None = None) -> list[list[str]]:
    """Header plus one formatted line per row of Table 1 (every declared row; a cell not run shows a dash)."""
    cells = frames_of(sweep) if cells is None else cells
    by_key = {(r.task, r.row): pd.Series(r._asdict()) for r in cells.itertuples(index=False)}
    header = ["", *sweep.tasks]
    return [header, *([table_label(row), *(format_cell(by_key.get((t, row.label)), row) for t in sweep.tasks)]
                      for row in sweep.rows)]


def beyond_sink(sweep: Sweep) -> bool:
    """Whether the sweep has rows of an approximation other than the default, the sink (its tables then say which is
    which)."""
    return sweep.approximations != [default_approximation()]


def approximation_notes(sweep: Sweep) -> list[str]:
    """Below Table 1 of a sweep beyond the sink: what each approximation's A~ attends to, and the oracle's mark."""
    if not beyond_sink(sweep):
        return []
    lines = ["Approximations of A~ (the row's label names it; unnamed: sink): "
             + "; ".join(a.caption() for a in sweep.approximations) + "."]
    return lines + [f"{ORACLE_MARK} {oracle_note(a)}" for a in sweep.approximations if a.oracle]


def frames_of(sweep: Sweep) -> pd.DataFrame:
    from alspec_eval.report.frames import load

    return load(sweep.outdir).cells


def markdown_table(rows: list[list[str]]) -> str:
    """GitHub-flavoured markdown of a header row plus body rows."""
    def line(cells: list[str]) -> str:
        return "| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |"
    return "\n".join([line(rows[0]), line(["---"] * len(rows[0])), *map(line, rows[1:])]) + "\n"


def table1_markdown(sweep: Sweep, cells: pd.DataFrame | None = None) -> str:
    metrics = sorted({f"{c.task}: `{c.metric}`" for c in sweep.cells if c.metric})
    approximation = "the row's approximation A~" if beyond_sink(sweep) else "the sink approximation"
    caption = ("Score (paired difference to the baseline on the same documents, 95% bootstrap interval) / speculation "
               f"hit rate (share of non-trivial decode attention replaced by {approximation}).")
    if sweep.gammas:
        draft = "the row's approximation" if beyond_sink(sweep) else "the same sink"
        caption += (f" Self-speculation rows ({draft} as the draft, gamma tokens per step): score / τ, the mean "
                    "tokens per verification step, the verifier's own token included (– for a task that only scores: "
                    "loglikelihood is exact under self-speculation).")
    if any(a.promise() is not None for a in sweep.approximations):
        caption += (" A draft that promises its error (ε, δ: vAttention's) shows, beside its hit rate, the share of "
                    "decisions whose d/n exceeded ε and of (decision, query head) pairs whose softmax denominator its "
                    "selection missed by more than ε of it (D), measured against exact attention: the promise holds "
                    "where these stay below δ.")
    notes = "".join(f"{line}\n" for line in approximation_notes(sweep))
    return (f"{caption}\n\n{markdown_table(table1_rows(sweep, cells))}\n{notes}Metrics: {'; '.join(metrics)}\n"
            f"{ROUTINES}\n")


def write_table1_csv(sweep: Sweep, path: Path, cells: pd.DataFrame | None = None) -> Path:
    """Table 1 layout with numbers kept numeric: per task a score, hit-rate (%) and paired-difference columns."""
    cells = frames_of(sweep) if cells is None else cells
    columns = {"score": "score", "hit_rate_pct": "hit_rate_pct", "tau": "tau", "diff": "diff", "diff_low": "diff_low",
               "diff_high": "diff_high", "p_value": "mcnemar_p"}
    table = cells.assign(hit_rate_pct=100 * cells["hit_rate"])
    for key in ("promise_dn", "promise_denominator"):  # where a draft promises its error: the realized shares
        if key in cells and cells[key].notna().any():
            columns[f"{key}_pct"] = f"{key}_pct"
            table[f"{key}_pct"] = 100 * cells[key]
    wide = table.pivot(index="row", columns="task", values=list(columns))
    order = [row.label for row in sweep.rows]
    wide = wide.reindex(order)
    wide.columns = [f"{task} {columns[col]}" for col, task in wide.columns]
    wide = wide[[f"{t} {columns[c]}" for t in sweep.tasks for c in columns if f"{t} {columns[c]}" in wide.columns]]
    described = {row.label: row_columns(row) for row in sweep.rows}
    for i, column in enumerate(("policy", "lambda", "gamma", *(APPROX_COLUMNS if beyond_sink(sweep) else ()))):
        wide.insert(i, column, [described[r][column] for r in wide.index])
    wide.index.name = "row"
    wide.to_csv(path, float_format="%.17g")
    return path
