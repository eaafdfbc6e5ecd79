"""A whole sweep on one vLLM engine: every cell's settings reach the workers, counters start anew per cell, and the
prefix cache never serves a speculated block to another cell. Each cell equals the same cell evaluated alone on the
engine in the reverse order, texts, log-probabilities and every per-layer count alike: vLLM on the CPU computes the
same step alike every time, and its prefix cache serves exact prompt blocks bit for bit. Which requests share a step
is a matter of timing, so the mean d/n is compared to the precision the engine determines it to (ERROR_REL)."""

from __future__ import annotations

import json
import math

import pytest

pytest.importorskip("vllm")

from conftest import ENGINE

pytestmark = pytest.mark.slow

# A layer's mean d/n (research_attention_output_error) is the one number a cell does not determine to the last bit.
# vLLM's engine core (its own process) steps whatever requests have reached it, so which decode rows share a step
# depends on when the driver's requests of one call arrive, and on the CPU a matrix product gives a row other last
# bits beside 1 row than beside 2 or 3 (a decode row's query first differs at layer 1: layer 0's o_proj and MLP). Its
# hidden states, A and A~, and so d/n, then differ in float32 rounding, which these cells' texts, log-probabilities
# and counts do not show (a sink cell commits A~ at every layer: A reaches nothing but d/n). Measured on the recall
# cell's requests: one request per engine call against three, d/n within 6e-6 relative per row; the driver slowed by
# 0.5 s between two requests of one call, texts equal and layer sums within 3.4e-6. The mean is written to 9 digits
# (stats.DIGITS), so such a run reads other last digits; a mean of positive ratios moves no more than its rows.
ERROR_REL = 1e-4


def test_a_sweep_on_one_engine_equals_its_cells_run_alone(alspec_smol, tmp_path):
    from alspec_eval.sweep.config import parse_config

    config = parse_config({"name": "v", "tasks": ["alspec_recall", "alspec_hellaswag"], "lambdas": [0.1, 0.4],
                           "window": 16, "engine": "vllm", "limit": 3, "static": {"p": 0.5, "lambda": 0.1},
                           "model_args": {"pretrained": "smollm2", **ENGINE}, "output": str(tmp_path / "v")})
    alspec_smol.reconfigure(window=16)  # HellaSwag's items are 60 to 150 tokens: past 2S = 32
    try:
        check(alspec_smol, config, tmp_path)
    finally:
        alspec_smol.reconfigure(window=64)


def exact_part(cell: dict) -> list[dict]:
    """Every per-layer entry but the mean d/n: counts, histograms, densities, bit for bit."""
    from alspec_eval.stats import OUTPUT_ERROR

    return [{k: v for k, v in layer.items() if k != OUTPUT_ERROR} for layer in cell["alspec"]["layers"]]


def errors(cell: dict) -> list[float]:
    """Every layer's mean d/n, NaN where it measured none."""
    from alspec_eval.stats import OUTPUT_ERROR

    return [math.nan if layer[OUTPUT_ERROR] is None else layer[OUTPUT_ERROR] for layer in cell["alspec"]["layers"]]


def check(alspec_smol, config, tmp_path) -> None:
    from alspec_eval.sweep.runner import cell_path, evaluate_cell, run_sweep, static_layers, task_manager

    out = run_sweep(config, lm=alspec_smol)
    tasks = task_manager(config)
    for task in config.tasks:
        cells = {row.name: json.loads(cell_path(out, task, row).read_text()) for row in config.rows()}
        assert {c["engine"] for c in cells.values()} == {"vllm"}
        total = {name: cell["alspec"]["total"] for name, cell in cells.items()}
        assert total["baseline"]["speculated"] == 0
        # sink loses the recall task's code and may stop after one token, feeding nothing back: nothing speculated
        assert total["sink"]["accepted"] == total["sink"]["speculated"] > (0 if task == "alspec_hellaswag" else -1)
        if task == "alspec_hellaswag":  # each cell's lambda reached the workers
            assert 0 < total["lambda_0.1"]["hit_rate"] < total["lambda_0.4"]["hit_rate"] < 1
        for row in reversed(config.rows()):  # alone, in the reverse order: the baseline last
            layers = tuple(static_layers(out, task, config, row)) if row.calibrated else ()
            with alspec_smol.answering(row, layers):
                alone = evaluate_cell(alspec_smol, config, task, row, row.record(list(layers) if layers else None),
                                      tasks)
            alone = json.loads(json.dumps(alone))  # as the cell file holds it (tuples as lists)
            swept = cells[row.name]
            assert alone["sample_log"] == swept["sample_log"], (task, row.name)  # texts, log-probabilities
            assert exact_part(alone) == exact_part(swept), (task, row.name)
            assert errors(alone) == pytest.approx(errors(swept), rel=ERROR_REL, nan_ok=True), (task, row.name)
            assert alone["score"] == swept["score"]
    # resumed: every cell is on disk with its fingerprint, so nothing is evaluated again; the report reads the cells
    written = {p: p.stat().st_mtime_ns for p in (out / "cells").rglob("*.json")}
    run_sweep(config, lm=None)  # would start an engine of its own if a cell were missing
    assert {p: p.stat().st_mtime_ns for p in (out / "cells").rglob("*.json")} == written
    from alspec_eval.report.build import write_report

    assert any(p.name == "table1.md" for p in write_report(out))
