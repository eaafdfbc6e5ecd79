"""Outputs a user can trust: every cell says how it was made, a rerun reuses a cell only under the same settings,
one sweep per folder, files as readable as lm-eval's, and mistakes stop in one line before the model loads."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from alspec_eval.approx_check.models import save_tiny
from alspec_eval.config import ConfigError
from alspec_eval.lm_eval_cli import check_output_path, patch_tracker
from alspec_eval.sweep.config import load_config
from alspec_eval.sweep.runner import output_lock, run_sweep

CONFIGS = Path(__file__).parents[1] / "configs"
BIN = Path(sys.executable).parent
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
pytestmark = pytest.mark.filterwarnings("ignore")


@pytest.fixture(scope="module")
def swept(tmp_path_factory):
    root = tmp_path_factory.mktemp("sweep")
    model = save_tiny(root / "model", max_positions=4096)
    overrides = {"model_args": {"pretrained": model}, "lambdas": [0.5, 1.0], "static": {"p": 0.5, "lambda": 1.0},
                 "gammas": [2], "output": str(root / "out")}
    config = load_config(CONFIGS / "smoke.yaml", overrides)
    from helpers import task_managers_built

    with task_managers_built() as built:
        run_sweep(config)
    assert len(built) == 1, built  # one for the sweep's 6 cells and its task check, not one each
    return config, overrides, root / "out"


def _cell(out: Path, name: str) -> dict:
    return json.loads((out / "cells" / "alspec_recall" / f"{name}.json").read_text())


@pytest.mark.slow
def test_every_cell_records_its_own_settings(swept):
    config, _, out = swept
    expected = {"baseline": ("exact", None), "lambda_0.5": ("dynamic", 0.5), "lambda_1": ("dynamic", 1.0),
                "sink": ("always", "inf")}
    for name, (policy, lam) in expected.items():  # shared-prefill variants: each its own, not the sweep's first lambda
        recorded = _cell(out, name)["alspec"]["config"]
        assert (recorded["policy"], recorded["lambda"], recorded["gamma"]) == (policy, lam, None), name
        assert recorded["window"] == 16 and recorded["backend"] == "sim" and recorded["kernel"] == "auto"
    selfspec = _cell(out, "selfspec_g2")
    assert (selfspec["alspec"]["config"]["policy"], selfspec["alspec"]["config"]["gamma"]) == ("selfspec", 2)
    assert selfspec["gamma"] == 2 and selfspec["alspec"]["selfspec"]["steps"] > 0
    static = _cell(out, "static")
    assert static["alspec"]["config"]["static_layers"] == static["static_layers"]
    assert static["alspec"]["config"]["policy"] == ("static" if static["static_layers"] else "exact")
    assert static["alspec"]["config"]["lambda"] is None and selfspec["alspec"]["config"]["lambda"] is None
    for name in [*expected, "selfspec_g2", "static"]:
        cell = _cell(out, name)
        assert cell["provenance"]["versions"]["lm_eval"] and cell["provenance"]["versions"]["alspec-eval"]
        assert cell["provenance"]["model_args"]["pretrained"] == config.model_args["pretrained"]
        assert cell["fingerprint"]["window"] == 16 and cell["fingerprint"]["limit"] == 3
        mode = stat.S_IMODE((out / "cells" / "alspec_recall" / f"{name}.json").stat().st_mode)
        assert mode == 0o666 & ~_umask(), oct(mode)


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


@pytest.mark.slow
def test_changed_settings_are_refused_before_loading_and_sweep_json_kept(swept):
    _, overrides, out = swept
    before = (out / "sweep.json").read_text()
    for change in ({"window": 32}, {"limit": 5}):
        changed = load_config(CONFIGS / "smoke.yaml", {**overrides, **change,
                                                      "model_args": {"pretrained": "/no/such/model"}})
        with pytest.raises(ConfigError, match="made with other settings.*--recompute"):
            run_sweep(changed)
    assert (out / "sweep.json").read_text() == before


@pytest.mark.slow
def test_truncated_cell_is_refused_then_recomputed(swept, tmp_path):
    config, overrides, out = swept
    copy = tmp_path / "copy"
    subprocess.run(["cp", "-r", str(out), str(copy)], check=True)
    cell = copy / "cells" / "alspec_recall" / "lambda_1.json"
    cell.write_text(cell.read_text()[:100])
    again = load_config(CONFIGS / "smoke.yaml", {**overrides, "output": str(copy)})
    with pytest.raises(ConfigError, match="lambda_1.json is unreadable"):
        run_sweep(again)
    run_sweep(again, recompute=True)
    fresh, original = json.loads(cell.read_text()), _cell(out, "lambda_1")
    fresh.pop("elapsed_s"), original.pop("elapsed_s")
    assert fresh == original


@pytest.mark.slow
def test_cells_of_one_task_index_equal_cells_each_indexed_afresh(swept, tmp_path, monkeypatch):
    """The sweep shares one TaskManager across its cells; each cell computed through a TaskManager of its own (as
    every cell was before) is the same file, results and samples included."""
    from helpers import read_cells

    from alspec_eval.sweep import runner

    config, overrides, out = swept
    evaluate = runner.evaluate_cell
    managers = []

    def afresh(lm, config, task, row, extra, tasks):
        managers.append(runner.task_manager(config))
        return evaluate(lm, config, task, row, extra, managers[-1])

    monkeypatch.setattr(runner, "evaluate_cell", afresh)
    run_sweep(load_config(CONFIGS / "smoke.yaml", {**overrides, "output": str(tmp_path / "afresh")}))
    assert len(managers) == 6 and len({id(m) for m in managers}) == 6
    cells, shared = read_cells(tmp_path / "afresh"), read_cells(out)
    assert cells == shared and all(cell["sample_log"] for cell in cells.values())


def test_a_task_index_made_for_other_metadata_is_refused(tmp_path):
    from types import SimpleNamespace

    config = load_config(CONFIGS / "smoke.yaml", {"model_args": {"pretrained": str(tmp_path)},
                                                  "output": str(tmp_path / "out")})
    other = SimpleNamespace(metadata={"pretrained": str(tmp_path), "dtype": "float16"})
    with pytest.raises(ValueError, match="float16.*build it with task_manager"):
        run_sweep(config, tasks=other)
    assert not (tmp_path / "out").exists()


def test_second_sweep_on_a_folder_in_use_refuses(tmp_path):
    with output_lock(tmp_path):
        with pytest.raises(ConfigError, match="another alspec-sweep is writing"):
            with output_lock(tmp_path):
                pass


@pytest.mark.slow
def test_unwritable_output_and_bad_limit_stop_before_loading(tmp_path):
    (tmp_path / "afile").write_text("x")
    result = subprocess.run([str(BIN / "alspec-sweep"), str(CONFIGS / "smoke.yaml"), "--output_path",
                             str(tmp_path / "afile")], capture_output=True, text=True, env=ENV)
    assert result.returncode != 0 and result.stderr.count("\n") == 1
    assert "is a file, not a folder" in result.stderr and "Traceback" not in result.stderr
    bad = tmp_path / "bad.yaml"
    bad.write_text((CONFIGS / "smoke.yaml").read_text() + "limit: three\n")
    with pytest.raises(ConfigError, match="limit='three' must be a number of samples"):
        load_config(bad)


class _Tracker:
    """Stands for lm-eval's EvaluationTracker: writes results_<date_id>.json as its save_results_aggregated does."""

    def __init__(self, output_path, date_id: str) -> None:
        self.output_path, self.date_id = output_path, date_id
        self.general_config_tracker = type("General", (), {"model_name_sanitized": "m"})()

    def save_results_aggregated(self, results, samples=None):
        folder = Path(self.output_path) / "m"
        folder.mkdir(parents=True, exist_ok=True)
        (folder / f"results_{self.date_id}.json").write_text(json.dumps(results))


def test_sidecar_goes_beside_this_runs_results_only(tmp_path):
    """The results writer names the sidecar after the file it just wrote; another model's results get none."""
    import types

    patch_tracker(types.SimpleNamespace(EvaluationTracker=_Tracker))
    mine = {"config": {"lambda": 0.05}, "tasks": {}}
    _Tracker(tmp_path, "2026-01-01T00-00-01").save_results_aggregated({"config": {"alspec": mine}})
    _Tracker(tmp_path, "2026-01-01T00-00-02").save_results_aggregated({"config": {"model": "hf"}})
    (sidecar,) = (tmp_path / "m").glob("alspec_*.json")
    assert sidecar.name == "alspec_2026-01-01T00-00-01.json" and json.loads(sidecar.read_text()) == mine
    (tmp_path / "afile").write_text("x")
    with pytest.raises(ConfigError, match="afile is a file, not a folder"):
        check_output_path(tmp_path / "afile" / "x")


@pytest.mark.slow
def test_stock_cli_output_path_under_a_file_fails_before_loading(tmp_path):
    (tmp_path / "afile").write_text("x")
    result = subprocess.run([str(BIN / "lm_eval"), "--model", "alspec", "--model_args", "pretrained=/no/such/model",
                             "--tasks", "alspec_recall", "--output_path", str(tmp_path / "afile" / "x")],
                            capture_output=True, text=True, env=ENV)
    assert result.returncode != 0 and "Traceback" not in result.stderr
    assert "alspec: --output_path" in result.stderr and "afile is a file" in result.stderr


@pytest.mark.slow
def test_missing_model_is_one_line(tmp_path):
    result = subprocess.run([str(BIN / "lm_eval"), "--model", "alspec", "--model_args", "pretrained=/no/such/model",
                             "--tasks", "alspec_recall", "--limit", "1"], capture_output=True, text=True, env=ENV)
    assert result.returncode != 0 and "Traceback" not in result.stderr
    assert "alspec: pretrained='/no/such/model' cannot be loaded" in result.stderr
    assert "a local folder with config.json" in result.stderr


@pytest.mark.slow
def test_needle_length_beyond_the_context_is_refused(tmp_path):
    model = save_tiny(tmp_path / "model", max_positions=1024)
    result = subprocess.run([str(BIN / "alspec-niah"), "--lengths", "2048", "--model_args", f"pretrained={model}",
                             "--window", "-3", "--output_path", str(tmp_path / "out")], capture_output=True, text=True,
                            env=ENV)
    assert result.returncode != 0 and result.stderr.count("alspec-niah:") == 1  # no doubled prefix
    result = subprocess.run([str(BIN / "alspec-niah"), "--lengths", "2048", "--model_args", f"pretrained={model}",
                             "--output_path", str(tmp_path / "out")], capture_output=True, text=True, env=ENV)
    assert result.returncode != 0 and "Traceback" not in result.stderr
    assert "exceed the model's context of 1024 positions" in result.stderr and "--allow_longer" in result.stderr
    assert not (tmp_path / "out" / "cells").exists()


@pytest.mark.parametrize("module", ["alspec_eval.sweep.cli", "alspec_eval.niah.cli", "alspec_eval.report.cli",
                                    "alspec_eval.tune.cli", "alspec_eval.latency_cli"])
@pytest.mark.slow
def test_help_imports_no_torch(module):
    code = (f"import sys\nfrom {module} import main\ntry:\n    main(['--help'])\nexcept SystemExit:\n    pass\n"
            "assert 'torch' not in sys.modules, 'torch imported for --help'")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=ENV)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "(default:" in result.stdout


def test_only_alspec_runs_have_their_arguments_checked(tmp_path):
    """The wrapped `lm_eval run` checks --use_cache and --output_path for --model alspec alone."""
    from argparse import Namespace

    from alspec_eval.lm_eval_cli import check_arguments

    (tmp_path / "afile").write_text("x")
    bad = {"use_cache": str(tmp_path / "cache"), "output_path": None}
    with pytest.raises(ConfigError, match="--use_cache is not supported"):
        check_arguments(Namespace(model="alspec", **bad))
    with pytest.raises(ConfigError, match="afile is a file"):
        check_arguments(Namespace(model="alspec", use_cache=None, output_path=str(tmp_path / "afile" / "x")))
    check_arguments(Namespace(model="hf", **bad))  # another model's arguments are lm-eval's business


@pytest.mark.slow
def test_stock_cli_prints_a_summary_and_the_sidecar_path(tmp_path):
    model = save_tiny(tmp_path / "model", max_positions=4096)
    result = subprocess.run([str(BIN / "lm_eval"), "--model", "alspec", "--model_args",
                             f"pretrained={model},lambda=0.9,window=16", "--tasks", "alspec_recall", "--limit", "2",
                             "--device", "cpu", "--output_path", str(tmp_path / "out")],
                            capture_output=True, text=True, env=ENV)
    assert result.returncode == 0, result.stderr[-2000:]
    (sidecar,) = (tmp_path / "out").rglob("alspec_*.json")
    stats = json.loads(sidecar.read_text())["tasks"]["alspec_recall"]
    total, layers = stats["total"], stats["layers"]
    high = max(layers, key=lambda layer: (layer["hit_rate"], layer["layer"]))
    assert (f"alspec: alspec_recall: speculated {total['speculated']}, accepted {total['accepted']} "
            f"({100 * total['hit_rate']:.1f}%); highest layer {high['layer']}") in result.stdout
    assert f"alspec: statistics in {sidecar}" in result.stdout


@pytest.mark.slow
def test_bundled_gsm8k_score_and_statistics_share_the_task_name():
    """lm-eval reports the score under the name the user asked for; the statistics must sit under the same one."""
    from lm_eval import simple_evaluate

    from helpers import alspec_lm
    from alspec_eval.approx_check.models import tiny_model

    results = simple_evaluate(model=alspec_lm(tiny_model(), window=4), tasks=["alspec_gsm8k_cot_local"], limit=1,
                              num_fewshot=0, gen_kwargs="max_gen_toks=4", bootstrap_iters=0)
    assert set(results["results"]) == {"alspec_gsm8k_cot_local"}
    assert "exact_match,strict-match" in results["results"]["alspec_gsm8k_cot_local"]
    tasks = results["config"]["alspec"]["tasks"]
    assert set(tasks) == {"alspec_gsm8k_cot_local"} and tasks["alspec_gsm8k_cot_local"]["total"]["speculated"] > 0
