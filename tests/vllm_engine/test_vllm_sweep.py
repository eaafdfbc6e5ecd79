"""A whole sweep on one vLLM engine: every cell's settings reach the workers, counters start anew per cell, and the
prefix cache never serves a speculated block to another cell. Each cell equals the same cell evaluated alone on the
engine in the reverse order, texts, log-probabilities and every per-layer count alike: vLLM on the CPU is
deterministic for the same requests, and its prefix cache serves exact prompt blocks bit for bit."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("vllm")

from conftest import ENGINE

pytestmark = pytest.mark.slow


def test_a_sweep_on_one_engine_equals_its_cells_run_alone(alspec_smol, tmp_path):
    from alspec_eval.sweep.config import parse_config
    from alspec_eval.sweep.runner import cell_path, evaluate_cell, run_sweep, static_layers, task_manager

    config = parse_config({"name": "v", "tasks": ["alspec_recall", "alspec_hellaswag"], "lambdas": [0.1, 0.4],
                           "window": 64, "engine": "vllm", "limit": 3, "static": {"p": 0.5, "lambda": 0.1},
                           "model_args": {"pretrained": "smollm2", **ENGINE}, "output": str(tmp_path / "v")})
    out = run_sweep(config, lm=alspec_smol)
    tasks = task_manager(config)
    for task in config.tasks:
        cells = {row.name: json.loads(cell_path(out, task, row).read_text()) for row in config.rows()}
        assert {c["engine"] for c in cells.values()} == {"vllm"}
        assert cells["baseline"]["alspec"]["total"]["speculated"] == 0
        assert cells["sink"]["alspec"]["total"]["hit_rate"] == 1.0
        hits = [cells[f"lambda_{lam}"]["alspec"]["total"]["hit_rate"] for lam in (0.1, 0.4)]
        assert 0 < hits[0] < hits[1] < 1  # each cell's lambda reached the workers
        for row in reversed(config.rows()):  # alone, in the reverse order: the baseline last
            layers = tuple(static_layers(out, task, config, row)) if row.calibrated else ()
            with alspec_smol.answering(row, layers):
                alone = evaluate_cell(alspec_smol, config, task, row, row.record(list(layers) if layers else None),
                                      tasks)
            swept = cells[row.name]
            assert alone["sample_log"] == swept["sample_log"], (task, row.name)  # texts, log-probabilities
            assert alone["alspec"]["layers"] == swept["alspec"]["layers"], (task, row.name)
            assert alone["score"] == swept["score"]
