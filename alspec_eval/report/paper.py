"""A sweep beside the paper's own numbers: Table 1 (Llama 3.1 8B) or Table 2 (Llama 3.1 70B) of the ALSpec paper
(Cai et al., ICML 2025), shipped as ``alspec_eval/data/paper_tables.csv``.

For every task of the sweep that the paper reports and every row it reports (baseline, lambda 0.05 .. 0.25), the
paper's score and hit rate beside the cell's, their difference, and whether the paper's number lies outside the
cell's 95% interval: for the score, a bootstrap over the cell's documents (lm-eval's stderr x 1.96 where the cell
has no per-document scores); for the hit rate, the document-level (cluster) interval of the frames (Wilson's
per-decision interval where the cell has no per-document counts, and said so). One sentence per task says whether
the sweep reproduced the paper there.
"""

from __future__ import annotations

import csv
import math
import re
from dataclasses import dataclass
from importlib import resources

import pandas as pd

from alspec_eval.report.cells import BASELINE, Row, Sweep
from alspec_eval.report.frames import ROUTINES, Z95, paired_bootstrap
from alspec_eval.report.table import MISSING, markdown_table

TABLES = {"table1": "llama-3.1-8b", "table2": "llama-3.1-70b"}
TABLE_MODELS = {"table1": "Llama 3.1 8B", "table2": "Llama 3.1 70B"}
# The paper's task names -> the lm-eval tasks that configs/paper_table1.yaml runs for them.
LM_EVAL_TASKS = {"ifeval": "ifeval", "gpqa_cot": "gpqa_main_cot_zeroshot", "swde": "swde", "fda": "fda",
                 "gsm8k_cot": "gsm8k_cot", "math_mmlu_pro": "mmlu_pro_math", "mgsm_cot_sw": "mgsm_native_cot_sw",
                 "hotpotqa": "longbench_hotpotqa", "repobench_p": "longbench_repobench-p",
                 "econ": "mmlu_pro_economics", "business": "mmlu_pro_business", "psych": "mmlu_pro_psychology"}
CHOICES = ("auto", "table1", "table2", "none")
CITATION = "Cai, Vora, Zhang, O'Connor, Jeffrey, ICML 2025"


@dataclass(frozen=True)
class Published:
    score: float
    hit_rate: float | None  # a fraction (the paper prints percent); None for the baseline


def published(table: str) -> dict[tuple[str, Row], Published]:
    """The paper's numbers of one table, keyed by (lm-eval task, row)."""
    text = (resources.files("alspec_eval") / "data" / "paper_tables.csv").read_text(encoding="utf-8")
    rows = csv.DictReader(line for line in text.splitlines() if not line.startswith("#"))
    out = {}
    for r in rows:
        if r["model"] != TABLES[table]:
            continue
        row = BASELINE if r["lambda"] == "baseline" else Row.dynamic(float(r["lambda"]))
        hit = float(r["hit_rate_pct"]) / 100 if r["hit_rate_pct"] else None
        out[(LM_EVAL_TASKS[r["task"]], row)] = Published(float(r["score"]), hit)
    return out


def matching_table(model: str | None) -> str | None:
    """The table whose model the sweep's model names (Llama 3.1 8B or 70B, any casing, hub id or local path)."""
    match = re.search(r"llama[-_ ]?3\.1[-_ ]?(8|70)b", (model or "").lower())
    return None if match is None else {"8": "table1", "70": "table2"}[match.group(1)]


def choose(sweep: Sweep, paper: str = "auto") -> tuple[str | None, str]:
    """(table or None, one line saying which and why)."""
    if paper not in CHOICES:
        raise ValueError(f"--paper {paper!r}: use one of {', '.join(CHOICES)}")
    if paper == "none":
        return None, "No comparison with the paper (--paper none)."
    table = matching_table(sweep.model) if paper == "auto" else paper
    if table is None:
        return None, (f"No paper column: the sweep's model {sweep.model!r} is neither of the paper's (Table 1: "
                      "Llama 3.1 8B, Table 2: Llama 3.1 70B); --paper table1 compares anyway.")
    tasks = {task for task, _ in published(table)}
    if not tasks & set(sweep.tasks):
        return None, (f"No paper column: none of the sweep's tasks is in the paper's {table} "
                      f"({', '.join(sorted(tasks))}).")
    return table, f"Beside the paper's {table.replace('table', 'Table ')} ({TABLE_MODELS[table]}, {CITATION})."


def compare(sweep: Sweep, cells: pd.DataFrame, documents: pd.DataFrame, table: str) -> pd.DataFrame:
    """One row per (task, row) that both the sweep and the paper have: ours, the paper's, the difference and
    whether the paper's number lies outside our 95% interval, for score and hit rate."""
    paper = published(table)
    by_key = cells.set_index(["task", "row"])
    out = []
    for task in sweep.tasks:
        for row in sweep.rows:
            pub = paper.get((task, row))
            if pub is None or (task, row.label) not in by_key.index:
                continue
            c = by_key.loc[(task, row.label)]
            s_low, s_high = _score_interval(c, documents[(documents.task == task) & (documents.cell == c["cell"])])
            entry = {"task": task, "row": row.label, "score": c["score"], "score_low": s_low, "score_high": s_high,
                     "paper_score": pub.score, "score_diff": c["score"] - pub.score,
                     "score_outside": bool(not s_low <= pub.score <= s_high) if not math.isnan(s_low) else None,
                     "hit_rate": math.nan, "hit_low": math.nan, "hit_high": math.nan, "hit_interval": "",
                     "paper_hit_rate": math.nan, "hit_diff": math.nan, "hit_outside": None}
            if pub.hit_rate is not None and not math.isnan(c["hit_rate"]):
                per_document = not math.isnan(c["hit_low"])
                low, high = (c["hit_low"], c["hit_high"]) if per_document else (c["hit_low_decision"],
                                                                                  c["hit_high_decision"])
                entry.update(hit_rate=c["hit_rate"], hit_low=low, hit_high=high,
                             hit_interval="documents" if per_document else "decisions",
                             paper_hit_rate=pub.hit_rate, hit_diff=c["hit_rate"] - pub.hit_rate,
                             hit_outside=bool(not low <= pub.hit_rate <= high))
            out.append(entry)
    return pd.DataFrame(out)


def _score_interval(cell: pd.Series, docs: pd.DataFrame) -> tuple[float, float]:
    """95% interval of the cell's score: a bootstrap of its documents' mean, else lm-eval's stderr x 1.96."""
    if len(docs):
        _, low, high = paired_bootstrap(docs["score"].to_numpy())
        return low, high
    if not math.isnan(cell["stderr"]):
        return cell["score"] - Z95 * cell["stderr"], cell["score"] + Z95 * cell["stderr"]
    return math.nan, math.nan


def verdicts(comparison: pd.DataFrame, table: str) -> dict[str, str]:
    """Per task one sentence: reproduced (every number of the paper inside our intervals) or not, and by how much."""
    name = table.replace("table", "Table ")
    out = {}
    for task, group in comparison.groupby("task", sort=False):
        checks = [(r, "score") for r in group.itertuples() if r.score_outside is not None]
        checks += [(r, "hit rate") for r in group.itertuples() if r.hit_outside is not None]
        outside = [(r, what) for r, what in checks if (r.score_outside if what == "score" else r.hit_outside)]
        if not checks:
            out[task] = f"{task}: cannot judge (no interval: the cells keep no per-document scores or stderr)."
        elif not outside:
            worst = max(checks, key=lambda c: abs(_diff(*c)))
            out[task] = (f"{task}: reproduced: all {len(checks)} numbers of the paper's {name} lie within this "
                         f"sweep's 95% intervals (largest gap: {worst[1]} at {worst[0].row}, {_fmt(*worst)}).")
        else:
            gaps = "; ".join(f"{what} at {r.row} {_ours(r, what)} against {_paper(r, what)} ({_fmt(r, what)})"
                             for r, what in outside)
            out[task] = (f"{task}: not reproduced: {len(outside)} of {len(checks)} numbers of the paper's {name} lie "
                         f"outside this sweep's 95% intervals: {gaps}.")
    return out


def _star(flag: bool) -> str:
    """The mark of a figure outside the paper's interval."""
    return " *" if flag else ""


def _diff(r, what: str) -> float:
    return r.score_diff if what == "score" else r.hit_diff


def _fmt(r, what: str) -> str:
    d = _diff(r, what)
    return f"{d:+.3f}" if what == "score" else f"{100 * d:+.1f} points"


def _ours(r, what: str) -> str:
    return f"{r.score:.3f}" if what == "score" else f"{100 * r.hit_rate:.1f}%"


def _paper(r, what: str) -> str:
    return f"{r.paper_score:.3f}" if what == "score" else f"{100 * r.paper_hit_rate:.1f}%"


def comparison_rows(comparison: pd.DataFrame) -> list[list[str]]:
    """Header plus one line per (task, row): ours [interval] | paper | difference, for score and hit rate; an
    asterisk marks a paper number outside our interval."""
    def pct(x: float) -> str:
        return MISSING if math.isnan(x) else f"{100 * x:.1f}%"

    header = ["task", "row", "score [95%]", "paper", "Δ", "hit rate [95%]", "paper", "Δ"]
    lines = [header]
    for r in comparison.itertuples():
        score = f"{r.score:.3f} [{r.score_low:.3f}, {r.score_high:.3f}]" if not math.isnan(r.score_low) else f"{r.score:.3f}"
        hit = (MISSING if math.isnan(r.hit_rate) else
               f"{pct(r.hit_rate)} [{pct(r.hit_low)}, {pct(r.hit_high)}]" + (" (per decision)" if r.hit_interval == "decisions" else ""))
        lines.append([r.task, r.row, score, f"{r.paper_score:.3f}{_star(r.score_outside)}", f"{r.score_diff:+.3f}", hit,
                      f"{pct(r.paper_hit_rate)}{_star(r.hit_outside)}",
                      MISSING if math.isnan(r.hit_diff) else f"{100 * r.hit_diff:+.1f}"])
    return lines


@dataclass(frozen=True)
class PaperSection:
    """The report's section beside the paper: which table and why, the side-by-side rows, one sentence per task."""

    line: str
    rows: list[list[str]] | None = None
    sentences: tuple[str, ...] = ()

    def markdown(self) -> str:
        if self.rows is None:
            return self.line + "\n"
        return (f"{self.line} {NOTE} {ROUTINES}\n\n{markdown_table(self.rows)}\n"
                + "".join(f"- {s}\n" for s in self.sentences))


NOTE = ("Score: 95% bootstrap interval over the cell's documents; hit rate: document-level (cluster) interval. "
        "* marks a paper number outside the interval. Δ = this sweep - the paper (hit rate in points).")


def paper_section(sweep: Sweep, cells: pd.DataFrame, documents: pd.DataFrame, paper: str = "auto") -> PaperSection:
    table, line = choose(sweep, paper)
    if table is None:
        return PaperSection(line)
    comparison = compare(sweep, cells, documents, table)
    return PaperSection(line, comparison_rows(comparison), tuple(verdicts(comparison, table).values()))
