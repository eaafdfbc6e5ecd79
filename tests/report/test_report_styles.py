"""The report's one table of row kinds (report/styles.py): every kind of rows.KINDS has a style, and a sweep with a
row of every kind renders in Table 1, the CSV files and the figures, each kind drawn with its style."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest
from synthetic_sweep import TASKS, write_sweep

from alspec_eval.latency import DEFAULT_PRESET, preset
from alspec_eval.report.build import write_report
from alspec_eval.report.cells import load_sweep
from alspec_eval.report.figures import score_vs_hit_rate, speedup_vs_score
from alspec_eval.report.latency import project_sweep
from alspec_eval.report.styles import STYLES
from alspec_eval.report.table import MISSING
from alspec_eval.rows import KINDS

PAPER_KINDS = ("baseline", "dynamic", "sink", "static")  # what write_sweep always writes


def test_every_kind_has_a_style():
    assert set(STYLES) == set(KINDS)


@pytest.fixture(scope="module")
def every_kind(tmp_path_factory: pytest.TempPathFactory) -> Path:
    extra = [kind for kind in KINDS if kind not in PAPER_KINDS]
    return write_sweep(tmp_path_factory.mktemp("kinds"), documents=True, extra_kinds=extra)


def test_a_sweep_with_every_kind_renders(every_kind: Path):
    sweep = load_sweep(every_kind)
    assert {row.kind for row in sweep.rows} == set(KINDS)
    written = {p.name: p for p in write_report(every_kind)}
    table = written["table1.md"].read_text()
    for row in sweep.rows:
        line = next(x for x in table.splitlines() if x.startswith(f"| {row.label} |"))
        assert MISSING not in line, line  # every row's cell is found and formatted, for every task
    with written["table1.csv"].open() as f:
        assert [r["policy"] for r in csv.DictReader(f)] == [row.kind for row in sweep.rows]
    with written["latency.csv"].open() as f:
        assert {r["policy"] for r in csv.DictReader(f)} == set(KINDS)
    assert any(name.startswith("schedule_tuned_") for name in written)  # the tuned row's profile
    assert all(f"alspec_vs_selfspec_{task}.png" in written for task in TASKS)  # the drafting row's comparison


def test_each_kind_is_drawn_with_its_style(every_kind: Path):
    sweep = load_sweep(every_kind)
    fig = speedup_vs_score(sweep, project_sweep(sweep, preset(DEFAULT_PRESET)))
    drawn = {(line.get_marker(), line.get_color()) for line in fig.axes[0].lines}
    assert drawn == {(s.marker, s.colour) for s in STYLES.values()}
    points = set(score_vs_hit_rate(sweep).axes[0].get_legend_handles_labels()[1])
    assert {s.hit_rate_legend for s in STYLES.values() if s.hit_rate_legend} <= points
    assert {"sink (λ = ∞)", "static layers"} <= points  # the paper's two baselines, each its own point
