"""A sweep of several approximations of A~ (approx: [sink, quest, topk]) in the report: each approximation's rows in
Table 1 with their own paired score differences, topk marked as an oracle ceiling, a projected speedup priced from
the keys each A~ reads, the per-layer hit rate by approximation (only where a sweep has more than one), and each approximation's
lambda rows as their own curve where figures draw score against hit rate."""

from __future__ import annotations

import csv
import json
import math
import shutil
from pathlib import Path

import numpy as np
import pytest
from synthetic_sweep import (DOCUMENTS, LAMBDAS, PAGE, SCORES, SPECULATED, TASKS, approx_accepted, approx_score,
                             write_sweep)

from alspec_eval.approximations import make_approximation, names
from alspec_eval.latency import DEFAULT_PRESET, preset
from alspec_eval.report.build import write_report
from alspec_eval.report.cells import BASELINE, SINK, STATIC, Row, load_sweep
from alspec_eval.report.figures import (frontier, hit_rate_by_approximation, open_loop_acceptance_figure,
                                        score_vs_hit_rate, speedup_vs_score)
from alspec_eval.report.frames import load, paired_bootstrap
from alspec_eval.report.latency import project_sweep
from default_approximations import APPROXIMATIONS

APPROX = ["sink", "quest", "topk"]
MADE = {a: make_approximation(a, {"page": PAGE} if a == "quest" else None) for a in APPROX}
LABEL = {"sink": "", "quest": f" · quest P={PAGE}", "topk": " · topk"}  # rows.Row's label suffixes
# A~ always (kind "sink") is "sink" for the sink approximation only; of another it is "λ = ∞ · <approximation>"
KIND_LABEL = {(kind, a): "λ = ∞" if kind == "sink" and a != "sink" else kind
              for kind in ("sink", "static", "selfspec γ = 2") for a in APPROX}
MARK = {"sink": "", "quest": "", "topk": " †"}  # Table 1 marks the oracle's rows


@pytest.fixture(scope="module")
def approx_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_sweep(tmp_path_factory.mktemp("approx"), documents=True, extra_kinds=["selfspec"],
                       approximations=APPROX)


@pytest.fixture(scope="module")
def written(approx_dir: Path) -> dict[str, Path]:
    return {p.name: p for p in write_report(approx_dir)}


def rows_of(table: str) -> dict[str, list[str]]:
    """Row label (as shown) -> cells of a markdown table."""
    rows = {}
    for line in table.splitlines():
        if line.startswith("| ") and not line.startswith("| ---"):
            cells = [c.strip() for c in line.strip("|").split(" | ")]
            rows[cells[0]] = cells[1:]
    return rows


def test_every_approximation_has_a_style_and_only_topk_and_vattention_are_oracles():
    made = [make_approximation(a) for a in names()]
    assert [a.name for a in made] == APPROXIMATIONS
    assert [a.name for a in made if a.oracle] == ["topk", "vattention"]  # they read every score
    assert len({(a.marker, a.colour) for a in made}) == len(made)


def test_rows_stand_together_per_lambda(approx_dir: Path):
    sweep = load_sweep(approx_dir)
    assert sweep.approximations == [MADE[a] for a in APPROX]
    expected = ["baseline", *(f"λ = {lam:g}{LABEL[a]}" for lam in LAMBDAS for a in APPROX),
                *(f"{KIND_LABEL[kind, a]}{LABEL[a]}" for kind in ("sink", "static", "selfspec γ = 2") for a in APPROX)]
    assert [row.label for row in sweep.rows] == expected
    for task in TASKS:
        assert [c.name for c in sweep.dynamic_cells(task)] == [f"lambda_{lam:g}" for lam in LAMBDAS]
        assert [c.name for c in sweep.dynamic_cells(task, MADE["quest"])] == [f"lambda_{lam:g}_quest_p{PAGE}"
                                                                              for lam in LAMBDAS]
        assert [c.row for c in sweep.dynamic_cells(task, MADE["topk"])] == [Row.dynamic(lam, MADE["topk"])
                                                                            for lam in LAMBDAS]
    # the frames keep the same order within a task
    cells = load(approx_dir).cells
    assert [r for r in cells[cells["task"] == TASKS[0]]["row"]] == expected


def test_a_sweep_reads_the_registrys_entry_points_once(approx_dir: Path, monkeypatch: pytest.MonkeyPatch):
    """Ordering a sweep's rows compares approximations many times; the registry's entry points (every installed
    package's metadata: seconds in a large environment) are read once for all of them, and as many times again the
    same orders come out."""
    from alspec_eval.approximations import registry

    reads = []
    points = registry.entry_points
    monkeypatch.setattr(registry, "entry_points", lambda **kw: reads.append(1) or points(**kw))
    sweep = load_sweep(approx_dir)
    rows, approximations = sweep.rows, sweep.approximations
    assert len(reads) == 1 and len(rows) > len(approximations) > 2
    assert sweep.rows == rows and sweep.approximations == approximations and len(reads) == 1


def test_every_file_is_written(approx_dir: Path, written: dict[str, Path]):
    heatmaps = {f"heatmap_{task}{suffix}.png" for task in TASKS for suffix in ("", f"_quest_p{PAGE}", "_topk")}
    assert set(written) == {"table1.md", "table1.csv", "score_vs_hit_rate.png", "hit_rate_by_approximation.png",
                            *heatmaps, "open_loop_acceptance.png", "speedup_vs_score.png", "frontier.png",
                            *(f"alspec_vs_selfspec_{task}.png" for task in TASKS), "paper.md", "latency.md",
                            "latency.csv", "report.html", "approximations.md", "approximations.csv", "board.md",
                            "board.csv"}
    for path in written.values():
        assert path.parent == approx_dir / "report" and path.stat().st_size > 0
    page = written["report.html"].read_text()
    assert page.count('src="data:image/png;base64,') >= sum(name.endswith(".png") for name in written)
    assert "Per-layer hit rate by approximation of A~ (λ = 0.1)" in page


def expected_cell(task: str, key: float | str, approx: str) -> str:
    """Table 1's cell, computed here: score, its paired difference against the baseline on the same documents (the
    synthetic sweep's documents are nested: the first right ones of each cell) with the bootstrap's interval, and
    the hit rate from the accepted decisions."""
    n = DOCUMENTS[task]
    score, base = approx_score(task, key, approx), SCORES[task]["baseline"]
    right, base_right = round(score * n), round(base * n)
    differences = np.array([float(i < right) - float(i < base_right) for i in range(n)])
    mean, low, high = paired_bootstrap(differences)
    assert mean == pytest.approx(score - base)
    if key == "sink":
        hit = 100.0
    elif key == "static":
        hit = 50.0
    else:
        hit = 100 * sum(approx_accepted(task, key, approx)) / (4 * SPECULATED)
    return f"{score:.3f} ({mean:+.3f} [{low:+.2f}, {high:+.2f}]) / {hit:.1f}%"


def test_table1_has_each_approximation_with_its_own_paired_difference(written: dict[str, Path]):
    table = written["table1.md"].read_text()
    rows = rows_of(table)
    for approx in APPROX:
        for j, task in enumerate(TASKS):
            for lam in LAMBDAS:
                assert rows[f"λ = {lam:g}{LABEL[approx]}{MARK[approx]}"][j] == expected_cell(task, lam, approx)
            for kind in ("sink", "static"):
                assert rows[f"{KIND_LABEL[kind, approx]}{LABEL[approx]}{MARK[approx]}"][j] == expected_cell(task, kind, approx)
    # quest and topk differ from the sink where the synthetic sweep makes them differ
    assert rows["λ = 0.1 · topk †"][0] != rows["λ = 0.1"][0] != rows[f"λ = 0.1 · quest P={PAGE}"][0]
    assert "replaced by the row's approximation A~" in table
    assert f"quest P={PAGE}: Quest's query-aware pages of {PAGE} tokens" in table
    assert "† topk:" in table and "ORACLE ceiling" in table
    assert not any(label.endswith("†") for label in rows if "topk" not in label)
    page = written["report.html"].read_text()
    assert "λ = 0.1 · topk †" in page and "ORACLE ceiling" in page


def test_table1_csv_names_each_rows_approximation(written: dict[str, Path]):
    with written["table1.csv"].open() as f:
        rows = {r["row"]: r for r in csv.DictReader(f)}
    quest = rows[f"λ = 0.1 · quest P={PAGE}"]
    assert (quest["policy"], quest["lambda"], quest["approx"], quest["approx_args"], quest["oracle"]) == (
        "dynamic", "0.1", "quest", f"page:{PAGE}", "")
    assert (rows["λ = ∞ · topk"]["approx"], rows["λ = ∞ · topk"]["oracle"]) == ("topk", "yes")
    assert (rows["λ = ∞ · topk"]["policy"], rows["sink"]["policy"], rows["sink"]["approx"]) == ("always", "always", "sink")
    assert rows["baseline"]["approx"] == "" and rows["λ = 0.1"]["approx"] == "sink"
    assert rows["λ = 0.1"]["approx_args"] == "" and rows["λ = 0.1 · topk"]["approx_args"] == ""
    assert float(quest["alspec_gsm8k_cot score"]) == approx_score("alspec_gsm8k_cot", 0.1, "quest")
    assert float(quest["alspec_gsm8k_cot diff"]) == pytest.approx(approx_score("alspec_gsm8k_cot", 0.1, "quest") - 0.3)


def test_every_row_gets_a_projected_speedup_priced_from_the_keys_it_reads(approx_dir: Path,
                                                                          written: dict[str, Path]):
    """The sink's rows as the paper prices them; quest's A~ reads its page bounds besides its 2S keys (a hit costs
    FD x (K / P) / K more); topk reads every key, so a hit costs a miss: no gain, said so in the note."""
    sweep = load_sweep(approx_dir)
    spec = preset(DEFAULT_PRESET)
    p = project_sweep(sweep, spec)
    for task in TASKS:
        for row in sweep.rows:
            entry = p.entries.get((row, task))
            if row.drafts_tokens:
                continue
            assert entry is not None and math.isfinite(entry.speedup), row.label
            measured = sweep.cell(task, row).layer_hit_rates() if row != BASELINE else [0.0]
            hits = [sum(measured) / len(measured)] * spec.num_layers  # 4 measured layers, 32 in the table: the mean
            if row.approx.name == "topk" and row != BASELINE:  # an oracle: every key read, a hit is a miss
                assert entry.speedup == pytest.approx(1.0), row.label
            elif row.approx.name == "quest":
                partial = spec.sfd_r_us + spec.fd_us * (spec.context_tokens / PAGE) / spec.context_tokens
                hit = partial + max(spec.sfd_s_us - partial, spec.per_layer_us)
                expected = spec.fixed_us + sum(h * hit + (1 - h) * spec.miss_us for h in hits)
                assert entry.token_latency_us == pytest.approx(expected), row.label
            else:  # the sink: the paper's hit cost
                expected = spec.fixed_us + sum(h * spec.hit_us + (1 - h) * spec.miss_us for h in hits)
                assert entry.token_latency_us == pytest.approx(expected), row.label
    quest_01, sink_01 = (p.entries[(Row.dynamic(0.1, MADE[a]), TASKS[0])] for a in ("quest", "sink"))
    assert sink_01.speedup > 1 and quest_01.speedup > 1
    md = written["latency.md"].read_text()
    assert "an oracle: it reads every key, so it gains nothing" in md and f"quest P={PAGE} {128 + 32768 // PAGE}" in md
    rows = rows_of(md)
    for row in sweep.rows:
        assert all("tok/s" in c for c in rows[row.label + MARK[row.approx.name]]), row.label
    with written["latency.csv"].open() as f:
        assert {r["row"] for r in csv.DictReader(f)} == {r.label for r in sweep.rows}


def test_hit_rate_by_approximation_draws_each_at_one_lambda(approx_dir: Path):
    sweep = load_sweep(approx_dir)
    for lam in (None, 0.2):
        fig = hit_rate_by_approximation(sweep, lam)
        expect = 0.1 if lam is None else lam  # the sweep's middle lambda by default
        assert f"λ = {expect:g}" in fig._suptitle.get_text()
        panels = {ax.get_title(): ax for ax in fig.axes if ax.get_visible()}
        assert list(panels) == TASKS
        for task, ax in panels.items():
            assert [line.get_label() for line in ax.lines] == [
                f"{name}: {100 * sum(approx_accepted(task, expect, a)) / (4 * SPECULATED):.1f}%"
                for a, name in zip(APPROX, ("sink", f"quest P={PAGE}", "topk (oracle ceiling)"))]
            for line, approx in zip(ax.lines, APPROX):
                np.testing.assert_allclose(line.get_ydata(), [100 * a / SPECULATED
                                                              for a in approx_accepted(task, expect, approx)])
                assert (line.get_marker(), line.get_color()) == (MADE[approx].marker, MADE[approx].colour)


def test_the_figure_only_for_more_than_one_approximation(tmp_path: Path):
    for approximations in (["sink"], ["quest"], ["sink", "topk"]):
        out = write_sweep(tmp_path / "_".join(approximations), approximations=approximations)
        names = {p.name for p in write_report(out, latency=[])}
        assert ("hit_rate_by_approximation.png" in names) == (len(approximations) > 1), approximations
        if approximations == ["quest"]:  # a sweep without the sink draws its approximation's lambda cells
            assert {f"heatmap_{task}_quest_p{PAGE}.png" for task in TASKS} <= names
            assert not any(name.startswith("heatmap_") and "quest" not in name for name in names)
            sweep = load_sweep(out)
            assert len(open_loop_acceptance_figure(sweep).axes[0].lines) == 2 * len(LAMBDAS)  # curve and dot each
            assert [r.label for r in sweep.rows] == ["baseline", *(f"λ = {lam:g} · quest P={PAGE}" for lam in LAMBDAS),
                                                     f"λ = ∞ · quest P={PAGE}", f"static · quest P={PAGE}"]
    with pytest.raises(ValueError, match="lambda 0.3 is not one of the sweep's lambdas"):
        write_report(out, latency=[], lam=0.3)


def test_score_against_hit_rate_has_a_curve_per_approximation(approx_dir: Path):
    sweep = load_sweep(approx_dir)
    for ax, task in zip(score_vs_hit_rate(sweep).axes, TASKS):
        curves = {line.get_label(): line for line in ax.lines if line.get_label().startswith("dynamic (λ)")}
        assert list(curves) == ["dynamic (λ) · sink", f"dynamic (λ) · quest P={PAGE}",
                                "dynamic (λ) · topk (oracle ceiling)"]
        for line, approx in zip(curves.values(), APPROX):
            np.testing.assert_allclose(line.get_xdata(), [100 * sum(approx_accepted(task, lam, approx)) / 200
                                                          for lam in LAMBDAS])
            np.testing.assert_allclose(line.get_ydata(), [approx_score(task, lam, approx) for lam in LAMBDAS])
            assert line.get_color() == MADE[approx].colour
        points = ax.get_legend_handles_labels()[1]
        assert {"sink (λ = ∞) · sink", f"λ = ∞ · quest P={PAGE}", "static layers · topk (oracle ceiling)"} <= set(points)


def test_frontier_has_every_approximations_speeds_and_curves_against_hit_rate(approx_dir: Path):
    sweep, cells = load_sweep(approx_dir), load(approx_dir).cells
    projection = project_sweep(sweep, preset(DEFAULT_PRESET))
    fig = frontier(cells, projection)
    speed = [ax for ax in fig.axes if ax.get_title() in TASKS]
    by_hit = [ax for ax in fig.axes if ax.get_title().endswith("by approximation of A~")]
    assert len(speed) == len(by_hit) == len(TASKS)
    for ax, task in zip(speed, TASKS):  # a point per row with a projection and a paired difference, in its colour
        priced = [r for r in sweep.rows if r != BASELINE and (r, task) in projection.entries]
        assert len(priced) > 3 * len(LAMBDAS)
        colours = [c.lines[0].get_color() for c in ax.containers]
        assert sorted(colours) == sorted(r.approx.colour for r in priced)
    for ax, task in zip(by_hit, TASKS):
        curves = {line.get_label(): line for line in ax.lines if not line.get_label().startswith("_")}
        assert list(curves) == ["sink", f"quest P={PAGE}", "topk (oracle ceiling)"]
        for line, approx in zip(curves.values(), APPROX):
            np.testing.assert_allclose(line.get_xdata(), [100 * sum(approx_accepted(task, lam, approx)) / 200
                                                          for lam in LAMBDAS])
            np.testing.assert_allclose(line.get_ydata(), [approx_score(task, lam, approx) - SCORES[task]["baseline"]
                                                          for lam in LAMBDAS])
    # speed against score: every priced row and the baseline
    fig = speedup_vs_score(sweep, projection)
    assert len(fig.axes[0].lines) == len([r for r in sweep.rows if (r, TASKS[0]) in projection.entries])


def test_an_older_cell_without_approx_is_the_sinks(approx_dir: Path, tmp_path: Path):
    """Cells before approximations record no approx: they are the sink's rows, wherever the sweep has others."""
    cell = json.loads((approx_dir / "cells" / TASKS[0] / "lambda_0.1.json").read_text())
    assert "approx" not in cell and "approx_args" not in cell
    sweep = load_sweep(approx_dir)
    assert sweep.cell(TASKS[0], Row.dynamic(0.1)).name == "lambda_0.1"
    assert sweep.cell(TASKS[0], SINK.approximated(MADE["quest"])).name == f"inf_quest_p{PAGE}"
    assert sweep.cell(TASKS[0], STATIC.approximated(MADE["topk"])).name == "static_topk"


def test_a_lambda_inf_cell_written_under_its_old_sink_name_still_reads(approx_dir: Path, tmp_path: Path):
    """Cells written before λ = ∞ rows of other approximations were named "inf_<slug>" are "sink_<slug>.json" and
    record that name: the report reads them as the same row, labelled by what it is."""
    old = tmp_path / "old"
    shutil.copytree(approx_dir, old)
    for task in TASKS:
        for a in ("quest", "topk"):
            row = SINK.approximated(MADE[a])
            (legacy,) = row.legacy_names
            data = json.loads((old / "cells" / task / f"{row.name}.json").read_text())
            (old / "cells" / task / f"{row.name}.json").unlink()
            (old / "cells" / task / f"{legacy}.json").write_text(json.dumps({**data, "cell": legacy}))
    sweep = load_sweep(old)
    cell = sweep.cell(TASKS[0], SINK.approximated(MADE["quest"]))
    assert (cell.name, cell.row.label, cell.row.name) == (f"sink_quest_p{PAGE}", f"λ = ∞ · quest P={PAGE}",
                                                          f"inf_quest_p{PAGE}")
    assert [row.label for row in sweep.rows] == [row.label for row in load_sweep(approx_dir).rows]
    cells = load(old).cells
    assert set(cells[cells["policy"] == "always"]["row"]) == {"sink", f"λ = ∞ · quest P={PAGE}", "λ = ∞ · topk"}
    projection = project_sweep(sweep, preset(DEFAULT_PRESET))
    assert len(frontier(cells, projection).axes) == len(frontier(load(approx_dir).cells, projection).axes)  # its row found
