"""At equal density (report/density.py): on a budget axis, a draft whose budget varies (vAttention) beside each
draft of 2S keys at the S where their measured densities are nearest, both cells at that S, hit rates and scores
paired by document; written only where the sweep has a budget axis and both kinds of draft."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest

from alspec_eval.approximations import make_approximation
from alspec_eval.report.build import write_report
from alspec_eval.rows import Row
from alspec_eval.stats import DENSITY as DENSITY_KEY
from alspec_eval.stats import RATIO_EDGES

TASK = "alspec_recall"
METRIC = "acc,none"
WINDOWS = [4, 8]
DOCS = 6
VATT = {"epsilon": 0.1, "delta": 0.1}
# each draft's density per S: vattention's hardly moves; the sink's nears it at S = 8, quest's equals it at S = 4
DENSITY = {"vattention": {4: 0.30, 8: 0.31}, "sink": {4: 0.10, 8: 0.29}, "quest": {4: 0.30, 8: 0.55}}
# per document (accepted of 10 speculated, right) for each draft and S at lambda 0.1; unverified: all accepted
DECIDED = {("vattention", 4): [7, 8, 9, 6, 7, 8], ("vattention", 8): [9, 9, 8, 7, 9, 9],
           ("sink", 4): [1, 2, 1, 0, 2, 1], ("sink", 8): [5, 6, 4, 6, 5, 5],
           ("quest", 4): [4, 5, 3, 4, 6, 2], ("quest", 8): [8, 7, 8, 9, 7, 8]}
RIGHT = {"vattention": [1, 1, 1, 1, 0, 1], "sink": [1, 0, 1, 1, 0, 0], "quest": [1, 1, 0, 1, 0, 1]}


def _approx(name: str):
    return make_approximation(name, VATT if name == "vattention" else {"page": 2} if name == "quest" else None)


def _cell(row: Row, approx: str, accepted: list[int], right: list[int], density: float | None) -> dict:
    total = {"speculated": 10 * DOCS, "accepted": sum(accepted), "trivial": 0, "hit_rate": sum(accepted) / 60,
             "hist": [0] * (len(RATIO_EDGES) + 1), **({} if density is None else {DENSITY_KEY: density})}
    made = _approx(approx)
    return {"task": TASK, "cell": row.name, **row.record(), "static_layers": None, "metric": METRIC,
            "score": sum(right) / DOCS, "metrics": {METRIC: sum(right) / DOCS}, "samples": DOCS, "elapsed_s": 1.0,
            "alspec": {"schema_version": 2, "num_layers": 1, "ratio_edges": list(RATIO_EDGES),
                       "skipped_layers": {}, "config": {}, "layers": [{"layer": 0, **total}], "total": total},
            "sample_log": [{"task": TASK, "doc_id": d, "filter": "none", "acc": float(right[d]),
                            "alspec": [{"speculated": 10, "accepted": accepted[d], "trivial": 0}]}
                           for d in range(DOCS)],
            **({} if made.is_default else {"approx": made.name, "approx_args": made.args()})}


def write(folder: Path, window: int | list[int], approximations: list[str]) -> Path:
    folder.mkdir(parents=True)
    (folder / "sweep.json").write_text(json.dumps({
        "name": "density", "model": "tiny", "tasks": [TASK], "lambdas": [0.1], "window": window, "static_p": None,
        "approx": approximations, "approx_args": {"vattention": VATT, "quest": {"page": 2}}}))
    cells = {"baseline": _cell(Row("baseline"), "sink", [0] * DOCS, [1] * DOCS, None)}
    for name in approximations:
        for s in (window if isinstance(window, list) else [None]):
            for row in (Row.dynamic(0.1), Row("always")):
                row = row.approximated(_approx(name), s)
                unverified = row.kind == "always"
                cells[row.name] = _cell(row, name, [10] * DOCS if unverified else DECIDED[name, s or 4], RIGHT[name],
                                        DENSITY[name][s or 4])
    for name, data in cells.items():
        path = folder / "cells" / TASK / f"{name}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(data))
    return folder


@pytest.fixture(scope="module")
def written(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    folder = write(tmp_path_factory.mktemp("density") / "axis", WINDOWS, ["sink", "quest", "vattention"])
    return {p.name: p for p in write_report(folder)}


def test_each_fixed_draft_is_met_at_the_s_of_the_nearest_density(written):
    rows = list(csv.DictReader(written["density.csv"].open()))
    assert [(r["lam"], r["approx"], r["other"], r["window"]) for r in rows] == [
        ("0.1", "vattention", "sink", "8"), ("0.1", "vattention", "quest", "4"),
        ("inf", "vattention", "sink", "8"), ("inf", "vattention", "quest", "4")]
    for r in rows:
        other, s = r["other"], int(r["window"])
        ours = [10] * DOCS if r["lam"] == "inf" else DECIDED["vattention", s]
        theirs = [10] * DOCS if r["lam"] == "inf" else DECIDED[other, s]
        assert float(r["density"]) == DENSITY["vattention"][s] and float(r["other_density"]) == DENSITY[other][s]
        assert int(r["documents"]) == DOCS
        assert float(r["hit"]) == pytest.approx(sum(ours) / 60) and float(r["other_hit"]) == pytest.approx(
            sum(theirs) / 60)
        assert float(r["hit_diff"]) == pytest.approx((sum(ours) - sum(theirs)) / 60)
        assert float(r["score_diff"]) == pytest.approx((sum(RIGHT["vattention"]) - sum(RIGHT[other])) / DOCS)
        assert float(r["hit_low"]) <= float(r["hit_diff"]) <= float(r["hit_high"])
        assert float(r["score_low"]) <= float(r["score_diff"]) <= float(r["score_high"])
    table = written["density.md"].read_text()
    assert "| alspec_recall | 0.1 | vattention ε=0.1 δ=0.1" in table and "| 8 | sink: 29.0%, 51.7% |" in table
    assert "| alspec_recall | ∞ | vattention" in table
    assert "† vattention" in table  # an oracle, noted
    assert "At equal density" in written["report.html"].read_text()


def test_no_table_without_a_budget_axis_or_a_draft_whose_budget_varies(tmp_path):
    one = write(tmp_path / "one", 4, ["sink", "vattention"])
    single = write(tmp_path / "single", [4], ["sink", "vattention"])  # an axis of one S: nothing to choose from
    fixed = write(tmp_path / "fixed", WINDOWS, ["sink", "quest"])
    for folder in (one, single, fixed):
        names = {p.name for p in write_report(folder)}
        assert "density.md" not in names and not (folder / "report" / "density.md").exists()
