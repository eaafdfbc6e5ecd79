"""Installed, the `.pth` hook stays out of other runs' way: importing alspec-eval patches nothing, and a `--model hf`
run writes and prints the same with the hook as without it.

"Without the hook" is `python -S` with lm-eval's site-packages and the repository on PYTHONPATH: packages import, no
`.pth` file runs.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from argparse import Namespace
from pathlib import Path
from types import SimpleNamespace

import pytest

from alspec_eval.config import ConfigError

ROOT = Path(__file__).parents[1]
SITE_PACKAGES = Path(next(iter(importlib.util.find_spec("lm_eval").submodule_search_locations))).parent
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
UNHOOKED_ENV = {**ENV, "PYTHONPATH": os.pathsep.join([str(SITE_PACKAGES), str(ROOT)])}
HOOKED, UNHOOKED = ([sys.executable], ENV), ([sys.executable, "-S"], UNHOOKED_ENV)

# What a process reports about the functions the hook may replace: where each is defined and whether it is ours.
PROBE = """
import json, sys
import lm_eval.models, lm_eval.tasks.manager, lm_eval._cli.harness, lm_eval._cli.run, lm_eval.loggers.evaluation_tracker
from lm_eval.api.registry import model_registry

def probe():
    functions = {"TaskManager.__init__": lm_eval.tasks.manager.TaskManager.__init__,
                 "HarnessCLI.parse_args": lm_eval._cli.harness.HarnessCLI.parse_args,
                 "Run._execute": lm_eval._cli.run.Run._execute,
                 "EvaluationTracker.save_results_aggregated":
                     lm_eval.loggers.evaluation_tracker.EvaluationTracker.save_results_aggregated}
    return {"ours": sorted(name for name, f in functions.items()
                           if getattr(f, "_alspec", False) or "alspec_eval" in f.__code__.co_filename),
            "models": sorted(set(model_registry) - set(lm_eval.models.MODEL_MAPPING)),
            "adapter_imported": "alspec_eval.adapter" in sys.modules,
            "finders": [type(f).__name__ for f in sys.meta_path], "excepthook": sys.excepthook is sys.__excepthook__}
"""
PATCHED = ["HarnessCLI.parse_args", "TaskManager.__init__"]


def _run(where: tuple[list[str], dict], args: list[str], cwd: Path | None = None) -> subprocess.CompletedProcess:
    prefix, env = where
    return subprocess.run([*prefix, *args], capture_output=True, text=True, env=env, cwd=cwd)


def test_the_bundled_folder_defines_alspec_names_only():
    """Every TaskManager scans it: a name there that is not alspec_* (a task, group or tag) could change what another
    model's run loads."""
    from lm_eval.tasks._index import TaskIndex

    from alspec_eval._lmeval_hook import tasks_dir

    names = TaskIndex.build([tasks_dir()])
    assert names and all(name.startswith("alspec_") for name in names), sorted(names)


class _Parser:
    """Stands for lm-eval's HarnessCLI: parse_args gives back what it was built with."""

    def __init__(self, args: Namespace) -> None:
        self.args = args

    def parse_args(self) -> Namespace:
        return self.args


def test_only_an_alspec_run_is_wrapped(tmp_path):
    """The wrapped parser hands back every other command line as lm-eval parsed it; a --config YAML's model counts."""
    from alspec_eval.lm_eval_cli import patch_cli, run_alspec

    patch_cli(SimpleNamespace(HarnessCLI=_Parser))
    config = tmp_path / "run.yaml"
    config.write_text("model: alspec\nuse_cache: cache\n")

    def execute(args: Namespace) -> None:
        """lm-eval's Run._execute."""

    def func(**given: object) -> object:
        return _Parser(Namespace(**{"command": "run", "model": None, "config": None, "func": execute, **given})
                       ).parse_args().func

    assert func(model="hf") is execute and func(model="hf", config=str(config)) is execute
    assert _Parser(Namespace(command="ls", func=execute)).parse_args().func is execute
    for wrapped in (func(model="alspec"), func(config=str(config))):
        assert wrapped.func is run_alspec and wrapped.args == (execute,)


def test_a_config_files_alspec_run_is_checked(tmp_path):
    from alspec_eval.lm_eval_cli import check_arguments

    config = tmp_path / "run.yaml"
    config.write_text("model: alspec\nuse_cache: cache\n")
    with pytest.raises(ConfigError, match="--use_cache is not supported"):
        check_arguments(Namespace(config=str(config), model=None, use_cache=None, output_path=None))
    check_arguments(Namespace(config=str(config), model="hf", use_cache=None, output_path=None))


@pytest.mark.slow
def test_importing_alspec_eval_patches_nothing():
    """Without the hook, our modules leave lm-eval's functions, registry, finders and excepthook as they were; then
    `plug_in` patches only the parser and the TaskManager (the results writer only inside an alspec run)."""
    code = ("import alspec_eval.sweep, alspec_eval.sweep.runner, alspec_eval.report, alspec_eval.lm_eval_cli\n"
            + PROBE + "before = probe()\nimport alspec_eval._lmeval_hook as hook\nhook.plug_in()\n"
            "print(json.dumps([before, probe()]))\n")
    result = _run(UNHOOKED, ["-c", code], cwd=ROOT)
    assert result.returncode == 0, result.stderr[-3000:]
    before, after = json.loads(result.stdout.splitlines()[-1])
    assert before["ours"] == [] and before["excepthook"], before
    assert before["models"] == (["alspec"] if before["adapter_imported"] else []), before
    assert not {"_PatchOnImport"} & set(before["finders"]), before
    assert after["ours"] == PATCHED and after["models"] == ["alspec", "alspec-vllm"] and after["excepthook"], after


def _files(folder: Path) -> dict[str, Path]:
    """The files a run wrote, by name with lm-eval's timestamps normalised."""
    return {re.sub(r"\d{4}-\d{2}-\d{2}T\d{2}-\d{2}-\d{2}\.\d+", "<time>", str(p.relative_to(folder))): p
            for p in folder.rglob("*") if p.is_file()}


@pytest.mark.slow
def test_an_hf_run_is_the_same_with_and_without_the_hook(tmp_path):
    """Same exit, stdout, file names, results (but the run's date and duration) and samples; both load the bundled
    tasks through --include_path, as a run without the hook must."""
    from alspec_eval.approx_check.models import save_tiny

    model = save_tiny(tmp_path / "model")
    args = ["-m", "lm_eval", "run", "--model", "hf", "--model_args", f"pretrained={model}", "--tasks",
            "alspec_recall,alspec_hellaswag", "--include_path", str(ROOT / "tasks"), "--limit", "2", "--device", "cpu",
            "--use_cache", "cache", "--output_path", "out", "--log_samples"]  # relative: the same in both results
    runs = {}
    for name, where in (("hooked", HOOKED), ("plain", UNHOOKED)):
        (tmp_path / name).mkdir()
        runs[name] = _run(where, args, cwd=tmp_path / name)
        assert runs[name].returncode == 0, (name, runs[name].stderr[-3000:])
    assert runs["hooked"].stdout == runs["plain"].stdout
    hooked, plain = _files(tmp_path / "hooked"), _files(tmp_path / "plain")
    assert set(hooked) == set(plain) and any(n.startswith("cache") for n in hooked), (sorted(hooked), sorted(plain))
    for name, path in hooked.items():
        if name.endswith(".jsonl"):
            assert path.read_text().splitlines() == plain[name].read_text().splitlines(), name
        elif name.endswith(".json"):
            mine, theirs = json.loads(path.read_text()), json.loads(plain[name].read_text())
            for varying in ("date", "total_evaluation_time_seconds"):  # differ between two plain runs too
                mine.pop(varying), theirs.pop(varying)
            assert mine == theirs, name
    assert {n.rsplit("/", 1)[-1] for n in hooked if n.startswith("out/")} == {
        "results_<time>.json", "samples_alspec_recall_<time>.jsonl", "samples_alspec_hellaswag_<time>.jsonl"}


@pytest.mark.slow
def test_an_hf_runs_error_is_the_same_with_and_without_the_hook(tmp_path):
    """The same exit status and the same traceback: no handler or frame of ours in another model's run."""
    args = ["-m", "lm_eval", "run", "--model", "hf", "--tasks", "no_such_task", "--device", "cpu"]
    hooked, plain = _run(HOOKED, args, cwd=tmp_path), _run(UNHOOKED, args, cwd=tmp_path)
    assert hooked.returncode == plain.returncode != 0
    traceback = "Traceback (most recent call last):"
    assert hooked.stderr.rsplit(traceback, 1)[-1] == plain.stderr.rsplit(traceback, 1)[-1], hooked.stderr[-3000:]
    assert plain.stderr.strip().endswith("Tasks not found: no_such_task"), plain.stderr[-3000:]


FAILING_HOOK = """
import sys
import alspec_eval._lmeval_hook as hook
def simulated(module):
    raise RuntimeError("simulated lm-eval change")
hook.register_alspec = simulated  # the registration fails; the parser is patched as always
hook.add_task_path = lambda module: None  # without the installed package (python -S), lm-eval finds the tasks itself
hook.plug_in()
from lm_eval.__main__ import cli_evaluate
sys.argv = ["lm_eval", "run", "--model", sys.argv[1], "--tasks", "alspec_recall", "--limit", "1",
            "--include_path", sys.argv[2]]
cli_evaluate()
"""


@pytest.mark.slow
@pytest.mark.parametrize("model", ["alspec-vllm", "nosuch"])
def test_a_hook_that_cannot_patch_lm_eval_says_why_where_an_alspec_model_is_asked_for(model):
    """A patch that raises (as after an lm-eval change) leaves lm-eval as it was: `--model alspec` fails on lm-eval's
    own "no model" error, preceded by one line with the lm-eval version, the failure and the way around it; any other
    model's error prints as lm-eval prints it."""
    from importlib.metadata import version

    result = _run(UNHOOKED, ["-c", FAILING_HOOK, model, str(ROOT / "tasks")], cwd=ROOT)
    assert result.returncode != 0
    ours = [line for line in result.stderr.splitlines() if line.startswith("alspec-eval could not plug")]
    if model == "nosuch":
        assert ours == [] and "'nosuch'" in result.stderr
        return
    assert ours == [f"alspec-eval could not plug into lm-eval {version('lm_eval')} (lm_eval.models: RuntimeError: "
                    "simulated lm-eval change); run `alspec-eval run --model alspec ...` instead, with the same "
                    "arguments"]
