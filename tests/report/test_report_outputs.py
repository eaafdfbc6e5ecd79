"""write_report on a synthetic sweep: files, Table 1 cells, figure data, open-loop curves."""

from __future__ import annotations

import csv
import re
from pathlib import Path

import numpy as np
import pytest
from synthetic_sweep import ACCEPTED, LAMBDAS, SCORES, SPECULATED, TASKS, write_sweep

from alspec_eval.report.build import write_report
from alspec_eval.report.figures import acceptance_heatmap, score_vs_hit_rate
from alspec_eval.report.cells import Row, load_sweep
from alspec_eval.stats import OPEN_LOOP_GRID, open_loop


@pytest.fixture(scope="module")
def written(sweep_dir: Path) -> list[Path]:
    return write_report(sweep_dir)


def md_rows(path: Path) -> dict[str, list[str]]:
    """Row label -> cells of a markdown table."""
    rows = {}
    for line in path.read_text().splitlines():
        if line.startswith("| ") and not line.startswith("| ---"):
            cells = [c.strip() for c in line.strip("|").split(" | ")]
            rows[cells[0]] = cells[1:]
    return rows


def test_files_exist(sweep_dir: Path, written: list[Path]) -> None:
    names = {p.name for p in written}
    assert names == {"table1.md", "table1.csv", "score_vs_hit_rate.png", "heatmap_alspec_gsm8k_cot.png",
                     "heatmap_alspec_recall.png", "open_loop_acceptance.png", "speedup_vs_score.png", "paper.md", "latency.md", "latency.csv",
                     "report.html"}
    for p in written:
        assert p.parent == sweep_dir / "report" and p.stat().st_size > 0
        if p.suffix == ".png":
            assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_table1_cells(written: list[Path]) -> None:
    rows = md_rows(written[0])
    assert list(rows) == ["", "baseline", "λ = 0.05", "λ = 0.1", "λ = 0.2", "sink", "static"]
    assert rows[""] == TASKS
    assert rows["λ = 0.1"][0] == "0.250 / 42.0%"  # 84 of 200 decisions accepted
    assert rows["baseline"] == ["0.300", "0.875"]  # score only
    assert rows["sink"] == ["0.050 / 100.0%", "0.500 / 100.0%"]
    assert rows["static"] == ["0.100 / 50.0%", "0.625 / 50.0%"]  # 2 of 4 layers approximated
    for j, task in enumerate(TASKS):
        for lam in LAMBDAS:
            hit = 100 * sum(ACCEPTED[task][lam]) / (4 * SPECULATED)
            assert rows[f"λ = {lam:g}"][j] == f"{SCORES[task][lam]:.3f} / {hit:.1f}%"


def test_table1_csv_is_numeric(written: list[Path]) -> None:
    with written[1].open() as f:
        rows = {r["row"]: r for r in csv.DictReader(f)}
    assert float(rows["λ = 0.1"]["alspec_gsm8k_cot score"]) == 0.25
    assert float(rows["λ = 0.1"]["alspec_gsm8k_cot hit_rate_pct"]) == pytest.approx(42.0)
    assert float(rows["λ = 0.2"]["alspec_recall hit_rate_pct"]) == pytest.approx(96.5)
    assert rows["baseline"]["alspec_recall hit_rate_pct"] == ""


def test_missing_cell_shows_dash(tmp_path: Path) -> None:
    outdir = write_sweep(tmp_path / "partial")
    (outdir / "cells" / "alspec_recall" / "lambda_0.2.json").unlink()
    (outdir / "cells" / "alspec_recall" / "static.json").unlink()
    rows = md_rows(write_report(outdir, latency=[])[0])
    assert rows["λ = 0.2"] == ["0.150 / 62.5%", "–"]
    assert rows["static"] == ["0.100 / 50.0%", "–"]


def test_html_is_self_contained(written: list[Path]) -> None:
    page = written[-1].read_text()
    assert page.count('src="data:image/png;base64,') == sum(p.suffix == ".png" for p in written)
    assert not re.search(r'src="(?!data:)', page)
    assert "model tiny-4-layer" in page and "0.250 / 42.0%" in page and "h100-tp4-32k" in page and "Table 3" in page


def test_heatmap_is_layers_by_lambda(sweep_dir: Path) -> None:
    fig = acceptance_heatmap(load_sweep(sweep_dir), "alspec_gsm8k_cot")
    grid = np.asarray(fig.axes[0].images[0].get_array())
    expected = np.array([ACCEPTED["alspec_gsm8k_cot"][lam] for lam in LAMBDAS]).T * 100 / SPECULATED
    np.testing.assert_allclose(grid, expected)


def test_score_line_points(sweep_dir: Path) -> None:
    ax = next(a for a in score_vs_hit_rate(load_sweep(sweep_dir)).axes if a.get_title() == "alspec_recall")
    line = next(l for l in ax.lines if l.get_label() == "dynamic (λ)")  # one panel per task
    np.testing.assert_allclose(line.get_xdata(), [100 * sum(ACCEPTED["alspec_recall"][lam]) / 200 for lam in LAMBDAS])
    np.testing.assert_allclose(line.get_ydata(), [SCORES["alspec_recall"][lam] for lam in LAMBDAS])


def test_open_loop_curves_monotone_and_consistent(sweep_dir: Path) -> None:
    sweep = load_sweep(sweep_dir)
    for task in TASKS:
        cells = sweep.dynamic_cells(task)
        assert [c.lam for c in cells] == LAMBDAS
        for cell in cells:
            curve = open_loop(cell.total.hist).hit
            assert all(a <= b for a, b in zip(curve, curve[1:])), (task, cell.lam)
            assert curve[-1] == 1.0
        # lambda = 0.1 is a bin edge: the open-loop value there is exactly the run's own hit rate
        k = min(range(len(OPEN_LOOP_GRID)), key=lambda i: abs(OPEN_LOOP_GRID[i] - 0.1))
        assert OPEN_LOOP_GRID[k] == pytest.approx(0.1)
        cell = sweep.cell(task, Row.dynamic(0.1))
        assert open_loop(cell.total.hist).hit[k] == pytest.approx(cell.hit_rate)
