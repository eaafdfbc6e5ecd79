"""A synthetic sweep folder for the report tests: 2 tasks, baseline, 3 lambdas, sink, static, a 4-layer model, on
request one row of each further kind of rows.KINDS, and on request the lambda, sink and static rows (and the further
kinds' rows) of further approximations of A~ (quest, topk), each accepting more than the sink and scoring higher.

Statistics are consistent: each layer has explicit d/n ratios, the histogram bins them with the
schema-v1 rule and a lambda cell accepts exactly the ratios <= lambda.
"""

from __future__ import annotations

import bisect
import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from alspec_eval.approximations import make_approximation
from alspec_eval.rows import Row
from alspec_eval.schedule import LambdaSchedule
from alspec_eval.stats import RATIO_EDGES

TASKS = ["alspec_gsm8k_cot", "alspec_recall"]
LAMBDAS = [0.05, 0.1, 0.2]
NUM_LAYERS = 4
SPECULATED = 50  # non-trivial decisions per layer
STATIC_LAYERS = [2, 3]

# Accepted decisions per layer at each lambda; gsm8k at lambda 0.1 totals 84 / 200 = 42.0%.
ACCEPTED = {
    "alspec_gsm8k_cot": {0.05: [5, 10, 12, 15], 0.1: [10, 20, 24, 30], 0.2: [20, 30, 35, 40]},
    "alspec_recall": {0.05: [25, 30, 35, 40], 0.1: [35, 40, 45, 48], 0.2: [45, 48, 50, 50]},
}
SCORES = {
    "alspec_gsm8k_cot": {"baseline": 0.3, 0.05: 0.3, 0.1: 0.25, 0.2: 0.15, "sink": 0.05, "static": 0.1},
    "alspec_recall": {"baseline": 0.875, 0.05: 0.875, 0.1: 0.8125, 0.2: 0.75, "sink": 0.5, "static": 0.625},
}
# Further approximations: per layer, their lambda cells accept EXTRA_ACCEPTED more decisions than the sink's (at most
# every one) and their lambda, sink and static cells get EXTRA_RIGHT more documents right (at most the baseline's).
EXTRA_ACCEPTED = {"quest": 3, "topk": 6}
EXTRA_RIGHT = {"quest": 1, "topk": 2}
PAGE = 16  # quest's page in the synthetic sweep.json
METRICS = {"alspec_gsm8k_cot": "exact_match,strict-match", "alspec_recall": "acc,none"}
DOCUMENTS = {"alspec_gsm8k_cot": 20, "alspec_recall": 16}  # every score above is a multiple of 1/n


def sample_log(task: str, score: float, decisions: tuple[int, int] = (0, 0)) -> list[dict[str, Any]]:
    """Per-document 0/1 scores with the cell's mean: the first round(score n) documents right (nested across cells,
    so a lower-scoring cell loses documents the baseline had), plus another filter's entries to be ignored.
    ``decisions`` (accepted, speculated) of the cell are spread over the documents, clustered: speculated evenly,
    accepted filling the first documents (as one document's decisions move together)."""
    name, _, filt = METRICS[task].partition(",")
    n = DOCUMENTS[task]
    right = round(score * n)
    accepted_left, speculated = decisions
    log, other = [], []
    for i in range(n):
        spec = speculated // n + (i < speculated % n)
        acc = min(spec, accepted_left)
        accepted_left -= acc
        log.append({"task": task, "doc_id": i, "filter": filt, name: float(i < right),
                    "alspec": [{"speculated": spec, "accepted": acc, "trivial": 0}]})
        other.append({"task": task, "doc_id": i, "filter": "other-filter", name: 1.0,
                      "alspec": [{"speculated": 1, "accepted": 1, "trivial": 0}]})
    return log + other


def ratios_for(accepted: int, lam: float) -> list[float]:
    """SPECULATED ratios of which exactly ``accepted`` are <= lam (accepted ones spread below it)."""
    below = [lam * 10 ** (-2 * (i + 1) / (accepted + 1)) for i in range(accepted)]
    above = [lam * 10 ** (1.5 * (i + 1) / (SPECULATED - accepted + 1)) for i in range(SPECULATED - accepted)]
    return below + above


def hist_of(ratios: list[float]) -> list[int]:
    hist = [0] * (len(RATIO_EDGES) + 1)
    for r in ratios:
        hist[bisect.bisect_right(RATIO_EDGES, r)] += 1
    return hist


def layer_entry(i: int, speculated: int, accepted: int, hist: list[int]) -> dict[str, Any]:
    return {"layer": i, "speculated": speculated, "accepted": accepted, "trivial": 3,
            "hit_rate": accepted / speculated if speculated else None, "hist": hist}


def stats(layers: list[dict[str, Any]]) -> dict[str, Any]:
    spec = sum(x["speculated"] for x in layers)
    acc = sum(x["accepted"] for x in layers)
    hist = [sum(col) for col in zip(*(x["hist"] for x in layers))]
    return {"schema_version": 1, "num_layers": NUM_LAYERS, "ratio_edges": list(RATIO_EDGES), "skipped_layers": {},
            "config": {"window": 64}, "layers": layers,
            "total": {"speculated": spec, "accepted": acc, "trivial": 3 * len(layers),
                      "hit_rate": acc / spec if spec else None, "hist": hist}}


def cell_json(task: str, name: str, policy: str, lam: Any, layers: list[dict[str, Any]], score: float,
              static_layers: list[int] | None = None, documents: bool = False) -> dict[str, Any]:
    metric = METRICS[task]
    cell = {"task": task, "cell": name, "policy": policy, "lambda": lam, "static_layers": static_layers,
            "metric": metric, "score": score, "metrics": {metric: score, metric.replace(",", "_stderr,"): 0.1},
            "alspec": stats(layers), "samples": 16, "elapsed_s": 1.0}
    if documents:
        cell["sample_log"] = sample_log(task, score)
    return cell


def example_row(kind: str) -> Row:
    """One row of ``kind``, with a gamma or a schedule where the kind takes one (a new kind that takes something
    else fails here until it is given)."""
    if kind == "selfspec":
        return Row.selfspec(2)
    if kind == "tuned":
        return Row.tuned(LambdaSchedule.of([0.05, 0.1, 0.2, math.inf]))
    return Row(kind)


def row_cell(task: str, row: Row) -> dict[str, Any]:
    """The cell of a further row as its run records it (``Row.record``): rows with exact attention decide nothing
    and score as the baseline (a drafting row with draft statistics: 10 steps, one token accepted each), the others
    decide as the lambda 0.1 cell."""
    if row.exact_attention:
        layers = [layer_entry(i, 0, 0, [0] * (len(RATIO_EDGES) + 1)) for i in range(NUM_LAYERS)]
    else:
        layers = [layer_entry(i, SPECULATED, a, hist_of(ratios_for(a, 0.1))) for i, a in enumerate(ACCEPTED[task][0.1])]
    record = row.record()
    cell = cell_json(task, row.name, record["policy"], record["lambda"], layers,
                     SCORES[task]["baseline" if row.exact_attention else 0.1])
    cell.update(record)
    if row.drafts_tokens:
        hist = [0, 10] + [0] * (row.gamma - 1)
        cell["alspec"]["selfspec"] = {"gamma": row.gamma, "steps": 10, "drafted": 10 * row.gamma, "accepted": 10,
                                      "tau": 2.0, "hist": hist}
    return cell


def approx_accepted(task: str, lam: float, approx: str = "sink") -> list[int]:
    """Accepted decisions per layer of the task's lambda cell of ``approx``."""
    return [min(SPECULATED, a + EXTRA_ACCEPTED.get(approx, 0)) for a in ACCEPTED[task][lam]]


def approx_score(task: str, key: float | str, approx: str = "sink") -> float:
    """Score of the task's lambda (``key``), sink or static cell of ``approx``: a multiple of 1 / documents."""
    n = DOCUMENTS[task]
    right = min(round(SCORES[task][key] * n) + EXTRA_RIGHT.get(approx, 0), round(SCORES[task]["baseline"] * n))
    return right / n


def write_sweep(outdir: Path, documents: bool = False, extra_kinds: Sequence[str] = (),
                approximations: Sequence[str] = ("sink",)) -> Path:
    """The sweep folder, plus one row of each of ``extra_kinds`` (kinds beyond the paper's four), for each of
    ``approximations`` (quest with pages of PAGE tokens). A sweep of the sink alone writes no ``approx`` key, as
    sweeps before approximations did."""
    (outdir / "sweep.json").parent.mkdir(parents=True, exist_ok=True)
    meta = {"name": "synthetic", "model": "tiny-4-layer", "window": 64, "lambdas": LAMBDAS, "tasks": TASKS,
            "static_p": 0.8}
    if list(approximations) != ["sink"]:
        meta.update(approx=list(approximations),
                    approx_args={"quest": {"page": PAGE}} if "quest" in approximations else {})
    (outdir / "sweep.json").write_text(json.dumps(meta))
    empty = [0] * (len(RATIO_EDGES) + 1)
    for task in TASKS:
        cells: dict[str, dict[str, Any]] = {}
        cells["baseline"] = cell_json(task, "baseline", "exact", None,
                                      [layer_entry(i, 0, 0, empty) for i in range(NUM_LAYERS)], SCORES[task]["baseline"])
        for approx in approximations:
            made = make_approximation(approx, {"page": PAGE} if approx == "quest" else None)
            approximated: dict[str, dict[str, Any]] = {}
            for lam in LAMBDAS:
                layers = [layer_entry(i, SPECULATED, a, hist_of(ratios_for(a, lam)))
                          for i, a in enumerate(approx_accepted(task, lam, approx))]
                row = Row.dynamic(lam, made)
                approximated[row.name] = cell_json(task, row.name, "dynamic", lam, layers,
                                                   approx_score(task, lam, approx))
            wide = hist_of(ratios_for(10, 0.05))
            row = Row("always").approximated(made)
            every = [layer_entry(i, SPECULATED, SPECULATED, wide) for i in range(NUM_LAYERS)]
            approximated[row.name] = cell_json(task, row.name, "always", "inf", every, approx_score(task, "sink", approx))
            row = Row("static").approximated(made)
            static = [layer_entry(i, SPECULATED, SPECULATED, wide) if i in STATIC_LAYERS
                      else layer_entry(i, SPECULATED, 0, empty) for i in range(NUM_LAYERS)]
            approximated[row.name] = cell_json(task, row.name, "static", None, static,
                                               approx_score(task, "static", approx), STATIC_LAYERS)
            if approx != "sink":
                for data in approximated.values():
                    data.update(approx=approx, approx_args=made.args())
            cells.update(approximated)
            for row in (example_row(kind).approximated(made) for kind in extra_kinds):
                cells[row.name] = row_cell(task, row)
        for name, data in cells.items():
            if documents:
                total = data["alspec"]["total"]
                data["sample_log"] = sample_log(task, data["score"], (total["accepted"], total["speculated"]))
            path = outdir / "cells" / task / f"{name}.json"
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(data))
    return outdir
