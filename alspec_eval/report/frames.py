"""A sweep as tidy pandas frames, with the paired statistics a user needs to call a score difference real.

``load(outdir)`` gives three frames:

- ``cells``: one row per (task, cell): policy, lambda, the approximation of A~ (``approx``, its ``approx_args``),
  window, metric, score, lm-eval's stderr, n, decisions, hit rate with a document-level 95% interval
  (``hit_low``, ``hit_high``: a cluster bootstrap over documents, since one document's decisions move together;
  NaN for cells without per-document counts) and the Wilson interval that treats every decision as independent
  (``hit_low_decision``, ``hit_high_decision``: per decision, several times narrower), and against the baseline
  on the same documents the mean score difference with a paired-bootstrap 95% interval (BOOTSTRAP_RESAMPLES
  resamples of documents, seeded) and, for 0/1 metrics, McNemar's exact p-value; the share of the context A~ reads
  (``density``), the share a step reads once rejections fall back to A (``effective_density``) and the mean d/n
  (``output_error``), NaN for cells from before they were recorded;
- ``layers``: one row per (task, cell, layer) with the counts;
- ``documents``: one row per (task, cell, document) with the document's score on the cell's metric.

Every table and figure of the report reads from these frames.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import pandas as pd
from scipy import stats

from alspec_eval.approximations import names
from alspec_eval.report.cells import BASELINE, Cell, load_sweep

BOOTSTRAP_RESAMPLES = 10_000
BOOTSTRAP_SEED = 0
Z95 = float(stats.norm.ppf(0.975))  # two-sided 95% normal quantile
ROUTINES = ("Intervals and tests from scipy.stats: bootstrap intervals by `bootstrap` (percentile, "
            f"{BOOTSTRAP_RESAMPLES:,} resamples of documents, seeded), Wilson intervals by "
            "`binomtest(...).proportion_ci(method='wilson')`, McNemar's exact test by `binomtest` on the discordant "
            "documents.")


class Frames(NamedTuple):
    cells: pd.DataFrame
    layers: pd.DataFrame
    documents: pd.DataFrame


def wilson(successes: int, trials: int, level: float = 0.95) -> tuple[float, float]:
    """Wilson score interval of a binomial proportion (``scipy.stats.binomtest``; NaN, NaN without trials)."""
    if trials == 0:
        return math.nan, math.nan
    interval = stats.binomtest(successes, trials).proportion_ci(level, method="wilson")
    return float(interval.low), float(interval.high)


def _percentile_bootstrap(data: tuple[np.ndarray, ...], statistic: Callable[..., np.ndarray], resamples: int,
                          seed: int, level: float) -> tuple[float, float]:
    """``scipy.stats.bootstrap``'s percentile interval of ``statistic`` over the rows of ``data`` resampled together
    (documents), seeded; one document gives its own value (nothing to resample)."""
    if len(data[0]) < 2:
        value = float(statistic(*data, axis=-1))
        return value, value
    result = stats.bootstrap(data, statistic, n_resamples=resamples, paired=True, vectorized=True, batch=500,
                             confidence_level=level, method="percentile", rng=np.random.default_rng(seed))
    return float(result.confidence_interval.low), float(result.confidence_interval.high)


def paired_bootstrap(differences: np.ndarray, resamples: int = BOOTSTRAP_RESAMPLES, seed: int = BOOTSTRAP_SEED,
                     level: float = 0.95) -> tuple[float, float, float]:
    """Mean per-document difference and its percentile bootstrap interval, resampling documents."""
    differences = np.asarray(differences, dtype=float)
    if len(differences) == 0:
        return math.nan, math.nan, math.nan
    return (float(differences.mean()),
            *_percentile_bootstrap((differences,), np.mean, resamples, seed, level))


def _ratio(accepted: np.ndarray, speculated: np.ndarray, axis: int = -1) -> np.ndarray:
    return accepted.sum(axis) / speculated.sum(axis)


def cluster_bootstrap_ratio(accepted: np.ndarray, speculated: np.ndarray, resamples: int = BOOTSTRAP_RESAMPLES,
                            seed: int = BOOTSTRAP_SEED, level: float = 0.95) -> tuple[float, float]:
    """Percentile bootstrap interval of sum(accepted) / sum(speculated), resampling the documents (the clusters)
    that speculated: one without a decision adds nothing to either sum, and a resample of only such would have no
    ratio."""
    accepted, speculated = np.asarray(accepted, dtype=float), np.asarray(speculated, dtype=float)
    decided = speculated > 0
    if not decided.any():
        return math.nan, math.nan
    return _percentile_bootstrap((accepted[decided], speculated[decided]), _ratio, resamples, seed, level)


def paired_ratio_difference(a: tuple[np.ndarray, np.ndarray], b: tuple[np.ndarray, np.ndarray],
                            resamples: int = BOOTSTRAP_RESAMPLES, seed: int = BOOTSTRAP_SEED,
                            level: float = 0.95) -> tuple[float, float, float]:
    """sum(accepted) / sum(speculated) of ``a`` minus that of ``b`` (each (accepted, speculated) per document, the
    same documents in the same order) and its percentile bootstrap interval, resampling the documents both cells
    speculated on (where both ratios exist in every resample) for both at once; the difference itself is over
    every document."""
    (acc_a, spec_a), (acc_b, spec_b) = ((np.asarray(x, dtype=float) for x in pair) for pair in (a, b))
    both = (spec_a > 0) & (spec_b > 0)
    if not both.any():
        return math.nan, math.nan, math.nan

    def difference(acc_a, spec_a, acc_b, spec_b, axis=-1):
        return _ratio(acc_a, spec_a, axis) - _ratio(acc_b, spec_b, axis)

    data = tuple(x[both] for x in (acc_a, spec_a, acc_b, spec_b))
    return (float(difference(acc_a, spec_a, acc_b, spec_b)),
            *_percentile_bootstrap(data, difference, resamples, seed, level))


def decisions_by_document(cell: Cell) -> dict[Any, tuple[int, int]]:
    """Per document (of the cell's metric filter), by doc_id: accepted and speculated decisions summed over its
    requests."""
    _, _, filt = cell.metric.partition(",")
    return {s["doc_id"]: (sum(r["accepted"] for r in s["alspec"]), sum(r["speculated"] for r in s["alspec"]))
            for s in cell.sample_log if s.get("alspec") and s.get("filter", filt) == filt}


def document_decisions(cell: Cell) -> tuple[np.ndarray, np.ndarray]:
    """Per document (of the cell's metric filter): accepted and speculated decisions summed over its requests."""
    values = np.array(list(decisions_by_document(cell).values()), dtype=float).reshape(-1, 2)
    return values[:, 0], values[:, 1]


def mcnemar_exact(only_baseline: int, only_cell: int) -> float:
    """Two-sided exact McNemar p-value from the discordant pairs (documents right in one run only): a binomial test
    of one side's count against half of them (``scipy.stats.binomtest``)."""
    n = only_baseline + only_cell
    return 1.0 if n == 0 else float(stats.binomtest(only_cell, n, 0.5).pvalue)


def document_scores(cell: Cell) -> pd.Series:
    """The cell's per-document score on its own metric ("name,filter"), indexed by doc_id."""
    name, _, filt = cell.metric.partition(",")
    rows = {s["doc_id"]: float(s[name]) for s in cell.sample_log
            if name in s and isinstance(s[name], (int, float)) and s.get("filter", filt) == filt}
    return pd.Series(rows, dtype=float, name="score").sort_index()


def load(outdir: str | Path) -> Frames:
    """The sweep in ``outdir`` as (cells, layers, documents) frames."""
    sweep = load_sweep(outdir)
    cells, layers, documents = [], [], []
    scores = {(c.task, c.name): document_scores(c) for c in sweep.cells}
    for c in sweep.cells:
        docs = scores[c.task, c.name]
        documents += [{"task": c.task, "cell": c.name, "doc_id": d, "score": s} for d, s in docs.items()]
        name, _, filt = c.metric.partition(",")
        stderr = c.metrics.get(f"{name}_stderr,{filt}")
        nan2 = (math.nan, math.nan)
        low, high = cluster_bootstrap_ratio(*document_decisions(c)) if c.hit_rate is not None else nan2
        low_d, high_d = wilson(c.total.accepted, c.total.speculated) if c.hit_rate is not None else nan2
        row = {"task": c.task, "cell": c.name, "engine": c.engine, "row": c.row.label, "rank": c.row.order,
               "policy": c.policy,
               "lambda": c.lam, "approx": c.row.approx.name,
               "approx_args": args_text(c.row.approx),
               "window": sweep.window_of(c.row), "metric": c.metric, "score": c.score,
               "stderr": stderr if isinstance(stderr, (int, float)) else math.nan, "n": len(docs) or c.samples,
               "speculated": c.total.speculated, "accepted": c.total.accepted,
               "hit_rate": c.hit_rate if c.hit_rate is not None else math.nan, "hit_low": low, "hit_high": high,
               "hit_low_decision": low_d, "hit_high_decision": high_d,
               "density": _or_nan(c.total.density), "effective_density": _or_nan(c.total.effective_density),
               "output_error": _or_nan(c.total.output_error),
               "promise_dn": _or_nan(c.total.promise_dn), "promise_denominator": _or_nan(c.total.promise_denominator),
               "gamma": c.gamma if c.gamma is not None else math.nan, "tau": c.tau if c.tau is not None else math.nan}
        row.update(paired_difference(docs, scores.get((c.task, _baseline_name(sweep, c.task))), c.row == BASELINE))
        cells.append(row)
        for i, layer in enumerate(c.layers):
            layers.append({"task": c.task, "cell": c.name, "layer": i, "speculated": layer.speculated,
                           "accepted": layer.accepted, "trivial": layer.trivial,
                           "hit_rate": layer.hit_rate if layer.hit_rate is not None else math.nan,
                           "skipped": layer.skipped})
    frame = pd.DataFrame(cells).sort_values(["task", "rank", "lambda", "gamma", "approx", "approx_args"], na_position="first",
                                            kind="stable", key=_approximations_in_order)
    return Frames(frame.reset_index(drop=True), pd.DataFrame(layers), pd.DataFrame(documents))


def args_text(approx) -> str:
    """An approximation's parameters as the frames and CSVs write them: ``page:16;...``."""
    return ";".join(f"{k}:{v}" for k, v in approx.args().items())


def _or_nan(value: float | None) -> float:
    return math.nan if value is None else value


def _approximations_in_order(column: pd.Series) -> pd.Series:
    """Sort key: approximations in the registry's order (sink, local, quest, topk, ...), other columns as they
    are."""
    order = {name: i for i, name in enumerate(names())}
    return column.map(lambda name: order.get(name, len(order))) if column.name == "approx" else column


def _baseline_name(sweep, task: str) -> str | None:
    cell = sweep.cell(task, BASELINE)
    return None if cell is None else cell.name


def paired_difference(docs: pd.Series, baseline: pd.Series | None, is_baseline: bool) -> dict[str, float]:
    """Difference against the baseline on the documents both scored: mean, bootstrap interval, McNemar p."""
    empty = {"diff": math.nan, "diff_low": math.nan, "diff_high": math.nan, "p_value": math.nan, "n_paired": 0}
    if is_baseline or baseline is None:
        return empty
    both = docs.index.intersection(baseline.index)
    if len(both) == 0:
        return empty
    cell, base = docs[both].to_numpy(), baseline[both].to_numpy()
    mean, low, high = paired_bootstrap(cell - base)
    binary = np.isin(cell, (0.0, 1.0)).all() and np.isin(base, (0.0, 1.0)).all()
    p = mcnemar_exact(int(((base == 1) & (cell == 0)).sum()), int(((base == 0) & (cell == 1)).sum())) if binary else math.nan
    return {"diff": mean, "diff_low": low, "diff_high": high, "p_value": p, "n_paired": len(both)}


def not_worse(cells: pd.DataFrame) -> pd.Series:
    """Cells whose score is not significantly below the baseline: the interval of the difference reaches 0 (and,
    for 0/1 metrics, McNemar does not reject at 5% where the cell is lower)."""
    reaches_zero = cells["diff_high"] >= 0
    mcnemar_ok = cells["p_value"].isna() | (cells["p_value"] >= 0.05) | (cells["diff"] >= 0)
    return reaches_zero & mcnemar_ok & cells["diff"].notna()


CHANCE = 0.0  # a generated answer's string match (RULER's metric) by chance


def baseline_interval(cells: pd.DataFrame, documents: pd.DataFrame, task: str) -> tuple[float, float, float]:
    """The baseline's mean score on ``task`` and its 95% bootstrap interval over documents (NaNs without one)."""
    base = cells[(cells["task"] == task) & (cells["row"] == BASELINE.label)]
    if base.empty:
        return math.nan, math.nan, math.nan
    mine = documents[(documents["task"] == task) & (documents["cell"] == base.iloc[0]["cell"])]
    return paired_bootstrap(mine["score"].to_numpy())


def frontier_choice(cells: pd.DataFrame, speedups: dict[tuple[str, str], float],
                    documents: pd.DataFrame) -> dict[str, str]:
    """Per task, one sentence naming the cell with the largest projected speedup whose score is not significantly
    below the baseline (``speedups`` maps (task, row label) to the latency model's speedup); none where the baseline
    is not above chance, since no cell can lose what the model never had."""
    sentences = {}
    for task, group in cells.groupby("task", sort=False):
        mean, low, high = baseline_interval(cells, documents, task)
        if not low > CHANCE:
            sentences[task] = (f"{task}: the baseline scores {mean:.3f} [{low:.3f}, {high:.3f}], not above chance "
                               f"({CHANCE:g}): no cell is named, since none can lose what the model never had.")
            continue
        group = group.assign(speedup=[speedups.get((task, r), math.nan) for r in group["row"]])
        ok = group[not_worse(group) & group["speedup"].notna() & (group["row"] != BASELINE.label)]
        if ok.empty:
            sentences[task] = f"{task}: no cell is free of a significant score loss against the baseline."
            continue
        best = ok.loc[ok["speedup"].idxmax()]
        sentences[task] = (f"{task}: {best['row']} gives the largest projected speedup ({best['speedup']:.2f}x) "
                           f"without a significantly lower score ({best['diff']:+.3f} "
                           f"[{best['diff_low']:+.3f}, {best['diff_high']:+.3f}], n = {best['n_paired']}).")
    return sentences
