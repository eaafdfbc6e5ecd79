"""Two ranks over torch.distributed (gloo) through lm-eval's simple_evaluate: statistics gathered from every rank
equal one process's on the same requests, and files are written once."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import comparable, read_cells

pytestmark = pytest.mark.slow  # builds models, runs lm-eval or starts processes

WORKER = Path(__file__).with_name("dp_worker.py")
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "OMP_NUM_THREADS": "1"}


def _port() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return str(s.getsockname()[1])


def _launch(world: int, out: Path, *extra: str) -> None:
    port = _port()
    procs = [subprocess.Popen([sys.executable, str(WORKER), str(r), str(world), port, str(out), *extra], env=ENV,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for r in range(world)]
    logs = [p.communicate(timeout=600)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), "\n".join(log[-3000:] for log in logs)


def _run(world: int, out: Path) -> dict:
    _launch(world, out)
    return json.loads(out.read_text())


@pytest.mark.filterwarnings("ignore")
def test_two_ranks_equal_one_process(tmp_path):
    one = _run(1, tmp_path / "one.json")
    two = _run(2, tmp_path / "two.json")
    assert comparable(two["alspec"]["tasks"]) == one["alspec"]["tasks"]  # totals, per-layer counts, histograms
    assert two["samples"] == one["samples"]
    assert two["score"] == one["score"]
    total = one["alspec"]["tasks"]["alspec_recall"]["total"]
    assert 0 < total["accepted"] < total["speculated"]
    # stats_path (written in get_model_info) comes from the main process only, with every rank's statistics
    assert sorted(p.name for p in tmp_path.glob("two.stats*.json")) == ["two.stats0.json"]
    assert comparable(json.loads((tmp_path / "two.stats0.json").read_text())["tasks"]) == one["alspec"]["tasks"]
    # ... and beside it every rank's per-request entries, keyed by (task, doc_id, idx, repeat), as the samples log's
    rows = [json.loads(line) for line in (tmp_path / "two.stats0.samples.jsonl").read_text().splitlines()]
    assert rows == [json.loads(line) for line in (tmp_path / "one.stats0.samples.jsonl").read_text().splitlines()]
    assert [(r["doc_id"], r["idx"], r["repeat"]) for r in rows] == [(d, 0, 0) for d, _ in one["samples"]]
    assert [{k: r[k] for k in entry} for r, (_, entry) in zip(rows, one["samples"])] == [e for _, e in one["samples"]]



@pytest.mark.filterwarnings("ignore")
def test_every_approximation_on_two_ranks_equals_one_process(tmp_path):
    """Each registered approximation's lambda and sink cells (default_approximations.py)
    and two of kvpress's presses', swept on two ranks: the cells of one process."""
    from default_approximations import APPROXIMATIONS
    from dp_worker import DP_PRESSES
    from alspec_eval.approx_check.models import save_tiny

    model = save_tiny(tmp_path / "model", max_positions=4096)
    _launch(1, tmp_path / "one", "approx", model)
    _launch(2, tmp_path / "two", "approx", model)
    one, two = read_cells(tmp_path / "one"), read_cells(tmp_path / "two")
    assert len(one) == 1 + 2 * (len(APPROXIMATIONS) + len(DP_PRESSES)) and two == one
    assert all(cell["alspec"]["total"]["speculated"] > 0 for name, cell in one.items() if "baseline" not in name)


@pytest.mark.filterwarnings("ignore")
def test_sweep_on_two_ranks_writes_one_process_cells_and_resumes(tmp_path):
    from alspec_eval.approx_check.models import save_tiny

    model = save_tiny(tmp_path / "model", max_positions=4096)
    schedule = tmp_path / "schedule.json"
    schedule.write_text(json.dumps([0.5, 1.0, 0.7]))  # a per-layer lambda_schedule row, in the shared prefill too
    _launch(1, tmp_path / "one", "sweep", model, str(schedule))
    _launch(2, tmp_path / "two", "sweep", model, str(schedule))
    one, two = read_cells(tmp_path / "one"), read_cells(tmp_path / "two")
    assert len(one) == 7 and two == one
    assert one["alspec_recall/selfspec_g2"]["alspec"]["selfspec"]["steps"] > 0
    (tuned,) = [cell for name, cell in one.items() if "/tuned_" in name]
    assert tuned["lambda_schedule"]["schedule"] == [0.5, 1.0, 0.7] and tuned["alspec"]["total"]["accepted"] > 0
    # Resume under two ranks: a folder that already holds the baseline cell gets the other six, the same.
    (tmp_path / "three" / "cells" / "alspec_recall").mkdir(parents=True)
    baseline = tmp_path / "one" / "cells" / "alspec_recall" / "baseline.json"
    (tmp_path / "three" / "cells" / "alspec_recall" / "baseline.json").write_text(baseline.read_text())
    _launch(2, tmp_path / "three", "sweep", model, str(schedule))
    assert read_cells(tmp_path / "three") == one
