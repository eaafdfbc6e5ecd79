"""Beside the sink (report/gains.py): each other approximation's hit rate and score minus the sink's at the same
lambda, with paired document-bootstrap intervals; written only for a sweep with the sink and another approximation."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import numpy as np
import pytest
from synthetic_sweep import DOCUMENTS, LAMBDAS, PAGE, TASKS, write_sweep

from alspec_eval.latency import DEFAULT_PRESET
from alspec_eval.report.build import write_report
from alspec_eval.report.frames import paired_ratio_difference


@pytest.fixture(scope="module")
def written(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    folder = write_sweep(tmp_path_factory.mktemp("gains"), documents=True, approximations=["sink", "quest", "topk"])
    return {p.name: p for p in write_report(folder)}


def _documents(path: Path) -> dict[int, tuple[int, int, float]]:
    """(accepted, speculated, score) per doc_id of a cell file, read from its JSON without the report's code."""
    cell = json.loads(path.read_text())
    name, _, filt = cell["metric"].partition(",")
    return {s["doc_id"]: (sum(r["accepted"] for r in s["alspec"]), sum(r["speculated"] for r in s["alspec"]), s[name])
            for s in cell["sample_log"] if s["filter"] == filt}


def test_every_task_lambda_and_approximation_is_its_cells_minus_the_sinks(written: dict[str, Path]):
    rows = list(csv.DictReader(written["approximations.csv"].open()))
    assert [(r["task"], float(r["lam"]), r["approx"]) for r in rows] == [
        (task, lam, approx) for task in TASKS for lam in LAMBDAS for approx in ("quest", "topk")]
    cells = written["table1.md"].parent.parent / "cells"
    for r in rows:
        name = f"lambda_{float(r['lam']):g}" + (f"_quest_p{PAGE}" if r["approx"] == "quest" else "_topk")
        ours, sink = _documents(cells / r["task"] / f"{name}.json"), _documents(cells / r["task"] / f"lambda_{float(r['lam']):g}.json")
        assert int(r["documents"]) == len(ours) == DOCUMENTS[r["task"]]
        hit = sum(a for a, _, _ in ours.values()) / sum(s for _, s, _ in ours.values())
        sink_hit = sum(a for a, _, _ in sink.values()) / sum(s for _, s, _ in sink.values())
        score = np.mean([ours[d][2] - sink[d][2] for d in ours])
        assert float(r["hit_diff"]) == pytest.approx(hit - sink_hit) and float(r["sink_hit"]) == pytest.approx(sink_hit)
        assert float(r["score_diff"]) == pytest.approx(score)
        assert float(r["hit_low"]) <= float(r["hit_diff"]) <= float(r["hit_high"])
        assert float(r["score_low"]) <= float(r["score_diff"]) <= float(r["score_high"])
    assert any(float(r["hit_diff"]) > 0 for r in rows)  # the synthetic quest and topk accept more than the sink
    latency = {(r["row"], r["task"]): float(r["speedup"]) for r in csv.DictReader(written["latency.csv"].open())
               if r["preset"] == DEFAULT_PRESET}
    for r in rows:  # the projected speedups are the latency table's, an oracle's none at all
        label = f"λ = {float(r['lam']):g}"
        other = f"{label} · " + (f"quest P={PAGE}" if r["approx"] == "quest" else "topk")
        assert float(r["sink_speedup"]) == pytest.approx(latency[label, r["task"]], rel=1e-5)
        assert float(r["speedup"]) == pytest.approx(latency[other, r["task"]], rel=1e-5)
        assert r["approx"] != "topk" or float(r["speedup"]) == pytest.approx(1.0)
    table = written["approximations.md"].read_text()
    assert "| alspec_recall | 0.1 | topk† |" in table and "† topk" in table
    assert "Beside the sink" in written["report.html"].read_text()


def test_the_interval_resamples_both_cells_on_the_same_documents():
    """Every document gains exactly one accepted decision in 10: a paired resample always differs by 0.1; resampling
    the two cells apart would spread it."""
    rng = np.random.default_rng(0)
    speculated = np.full(30, 10.0)
    sink = rng.integers(0, 9, size=30).astype(float)
    assert paired_ratio_difference((sink + 1, speculated), (sink, speculated)) == pytest.approx((0.1, 0.1, 0.1))
    diff, low, high = paired_ratio_difference((sink, speculated), (rng.permutation(sink), speculated))
    assert diff == pytest.approx(0.0) and low < 0 < high


def test_no_table_without_the_sink_and_another(tmp_path: Path):
    folder = write_sweep(tmp_path, documents=True)
    assert not {"approximations.md", "approximations.csv"} & {p.name for p in write_report(folder)}


def test_each_figure_is_on_the_page_once(written: dict[str, Path]):
    page = written["report.html"].read_text()
    for name in written:
        if name.endswith(".png"):
            assert page.count(f'alt="{name[:-4]}"') == 1, name


# G5: the interval is a 95% one (tails of 2.5% each), not 90%
def test_paired_ratio_interval_has_the_stated_level():
    rng = np.random.default_rng(1)
    n = 400
    spec = np.full(n, 10.0)
    base = rng.integers(2, 8, size=n).astype(float)
    other = base + rng.choice([-1.0, 1.0], size=n)
    diff, low, high = paired_ratio_difference((other, spec), (base, spec))
    per_doc = (other - base) / 10
    se = per_doc.std(ddof=1) / np.sqrt(n)
    assert diff == pytest.approx(per_doc.mean())
    assert (high - low) / 2 == pytest.approx(1.96 * se, rel=0.06)  # a 90% interval would be 1.645 se
