"""Self-speculation rows in the report: score / tau in Table 1, the projected speedup from tau, and the figure."""

from __future__ import annotations

import json

import pytest

from alspec_eval.latency import preset
from alspec_eval.report.build import write_report
from alspec_eval.report.cells import Row, load_sweep
from alspec_eval.report.latency import project_sweep
from alspec_eval.stats import RATIO_EDGES
from synthetic_sweep import NUM_LAYERS, SCORES, TASKS, cell_json, layer_entry, write_sweep

TAU = {2: 1.8, 4: 2.5}  # per gamma: tau = 1 + accepted / steps, from the histograms below
HIST = {2: [4, 4, 2], 4: [3, 3, 1, 2, 1]}  # 10 steps each: accepted 8 (tau 1.8) and 15 (tau 2.5)


def add_selfspec(outdir, generating: tuple[str, ...] = tuple(TASKS)) -> None:
    """Selfspec cells for every task; only ``generating`` tasks have draft statistics (a loglikelihood task's
    selfspec cell is scored exactly and drafts nothing)."""
    meta = json.loads((outdir / "sweep.json").read_text())
    (outdir / "sweep.json").write_text(json.dumps({**meta, "gammas": [2, 4]}))
    for task in TASKS:
        for gamma, hist in HIST.items():
            cell = cell_json(task, f"selfspec_g{gamma}", "selfspec", None,
                             [layer_entry(i, 0, 0, [0] * (len(RATIO_EDGES) + 1)) for i in range(NUM_LAYERS)],
                             SCORES[task]["baseline"], documents=True)
            accepted = sum(k * n for k, n in enumerate(hist))
            cell["gamma"] = gamma
            if task not in generating:
                (outdir / "cells" / task / f"selfspec_g{gamma}.json").write_text(json.dumps(cell))
                continue
            cell["alspec"]["selfspec"] = {"gamma": gamma, "steps": sum(hist), "drafted": gamma * sum(hist),
                                          "accepted": accepted, "tau": 1 + accepted / sum(hist), "hist": hist}
            (outdir / "cells" / task / f"selfspec_g{gamma}.json").write_text(json.dumps(cell))


@pytest.fixture
def sweep_dir(tmp_path):
    out = write_sweep(tmp_path / "sweep", documents=True)
    add_selfspec(out)
    return out


def test_table1_shows_score_and_tau(sweep_dir):
    written = write_report(sweep_dir)
    table = (sweep_dir / "report" / "table1.md").read_text()
    task = TASKS[0]
    line = next(l for l in table.splitlines() if l.startswith("| selfspec γ = 4 |"))
    assert f"{SCORES[task]['baseline']:.3f} (+0.000 [+0.00, +0.00]) / τ = {TAU[4]:.2f}" in line
    assert {p.name for p in written} >= {f"alspec_vs_selfspec_{t}.png" for t in TASKS}
    rows = (sweep_dir / "report" / "table1.csv").read_text().splitlines()
    assert any(r.startswith("selfspec γ = 2,selfspec,,2,") for r in rows)
    assert "speedup = τ / (γ c + 1)" in (sweep_dir / "report" / "latency.md").read_text()


def test_projected_speedup_is_tau_over_draft_cost(sweep_dir):
    spec = preset("h100-tp4-32k")  # Table 3, 32K: attention 29 us, non-attention 100 us per layer, TP4 214.2 tok/s
    verify = 1e6 / 214.2
    fixed = verify - 32 * (29 + 100)
    # the draft's attention at 2S = 128 keys (the synthetic sweep's S = 64), on the line through Table 3's two
    # smallest contexts: 13 us at 1K and 29 us at 32K
    attention = 13 + (128 - 1024) * (29 - 13) / (32768 - 1024)
    draft = fixed + 32 * (100 + attention)
    p = project_sweep(load_sweep(sweep_dir), spec)
    for gamma, tau in TAU.items():
        entry = p.entries[(Row.selfspec(gamma), TASKS[0])]
        assert entry.speedup == pytest.approx(tau / (gamma * draft / verify + 1))


def test_the_draft_cost_at_32k_on_table_3s_points():
    """h100-tp4-32k at S = 128: c = 0.888 with Table 3's points (not 0.80 with FD scaled by 2S/K), so tau 1.444
    at gamma 4 projects 0.317x."""
    from alspec_eval.latency import project_selfspec

    ss = project_selfspec(preset("h100-tp4-32k"), 1.444, 4, 128)
    assert round(ss.cost_ratio, 3) == 0.888 and round(ss.speedup, 3) == 0.317


def test_latency_cli_projects_a_selfspec_cell_as_the_report_does(sweep_dir, capsys):
    from alspec_eval.latency_cli import main as latency_main

    assert latency_main(["--preset", "h100-tp4-32k", "--from", str(sweep_dir), "--json"]) == 0
    cells = json.loads(capsys.readouterr().out)["cells"]
    p = project_sweep(load_sweep(sweep_dir), preset("h100-tp4-32k"))
    for gamma, tau in TAU.items():
        cell = next(c for c in cells if c["task"] == TASKS[0] and c["cell"] == f"selfspec γ = {gamma}")
        assert cell["speedup"] == pytest.approx(p.entries[(Row.selfspec(gamma), TASKS[0])].speedup)
        assert cell["tau"] == pytest.approx(tau) and cell["hit_rate"] is None and cell["speedup"] < 1
    assert latency_main(["--preset", "h100-tp4-32k", "--from", str(sweep_dir)]) == 0
    table = capsys.readouterr().out
    assert "τ" in table and f"{TAU[4]:.4g}" in table
    assert latency_main(["--list-presets"]) == 0
    assert "K = 32768 tokens" in capsys.readouterr().out


def test_a_sweep_without_static_has_no_static_row(sweep_dir):
    meta = json.loads((sweep_dir / "sweep.json").read_text())
    (sweep_dir / "sweep.json").write_text(json.dumps({**meta, "static_p": None}))
    for task in TASKS:
        (sweep_dir / "cells" / task / "static.json").unlink()
    assert [r.label for r in load_sweep(sweep_dir).rows] == [
        "baseline", "λ = 0.05", "λ = 0.1", "λ = 0.2", "sink", "selfspec γ = 2", "selfspec γ = 4"]


def test_a_task_without_generations_has_a_selfspec_row_without_tau(tmp_path):
    out = write_sweep(tmp_path / "sweep", documents=True)
    add_selfspec(out, generating=(TASKS[0],))
    written = {p.name for p in write_report(out)}
    line = next(l for l in (out / "report" / "table1.md").read_text().splitlines() if l.startswith("| selfspec γ = 2 |"))
    assert line.endswith("/ τ = – |") and f"τ = {TAU[2]:.2f}" in line
    assert f"alspec_vs_selfspec_{TASKS[0]}.png" in written and f"alspec_vs_selfspec_{TASKS[1]}.png" not in written
    p = project_sweep(load_sweep(out), preset("h100-tp4-32k"))
    assert (Row.selfspec(2), TASKS[1]) not in p.entries and (Row.selfspec(2), TASKS[0]) in p.entries
