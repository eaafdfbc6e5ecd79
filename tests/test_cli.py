"""The stock `lm_eval` command finds `--model alspec` and its tasks; bad input fails before loading."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # builds models, runs lm-eval or starts processes

LM_EVAL = str(Path(sys.executable).with_name("lm_eval"))  # the venv's script, activated or not
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}


def _python(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=ENV, cwd="/", check=True)


def test_registration_is_lazy_and_keeps_builtin_models():
    out = _python(
        "import sys\n"
        "assert 'lm_eval' not in sys.modules, 'the startup hook imported lm-eval (its import sets os.environ)'\n"
        "from lm_eval.api.registry import get_model\n"
        "assert 'torch' not in sys.modules, 'the startup hook imported torch'\n"
        "assert get_model('hf').__name__ == 'HFLM'\n"
        "print(get_model('alspec').__module__)\n"
    )
    assert out.stdout.strip() == "alspec_eval.adapter"


def test_bundled_tasks_are_found_without_include_path():
    out = _python("from lm_eval.tasks import TaskManager\nprint(sorted(TaskManager().all_tasks))")
    assert "'alspec_recall'" in out.stdout and "'gsm8k'" in out.stdout


def test_bad_lambda_stops_before_loading_with_one_message(tmp_path):
    result = subprocess.run(
        [LM_EVAL, "--model", "alspec", "--model_args", f"pretrained={tmp_path}/missing,lambda=-1",
         "--tasks", "alspec_recall", "--device", "cpu", "--output_path", str(tmp_path)],
        capture_output=True, text=True, env=ENV)
    assert result.returncode != 0
    assert "alspec: lambda=-1.0 is invalid; use a float >= 0 or inf" in result.stderr
    assert "Traceback" not in result.stderr and "missing" not in result.stderr.split("alspec:")[-1]


def test_a_model_arg_nobody_takes_is_one_line(tmp_path):
    from alspec_eval.approx_check.models import save_tiny

    result = subprocess.run(
        [LM_EVAL, "--model", "alspec", "--model_args", f"pretrained={save_tiny(tmp_path / 'm')},foo=1",
         "--tasks", "alspec_recall", "--device", "cpu", "--limit", "1"], capture_output=True, text=True, env=ENV)
    assert result.returncode != 0 and "Traceback" not in result.stderr, result.stderr[-3000:]
    assert "alspec: unknown model_arg foo=1: " in result.stderr and "does not take 'foo'" in result.stderr


def test_alspec_eval_run_delegates_to_lm_eval():
    result = subprocess.run([sys.executable, "-m", "alspec_eval", "run", "--help"], capture_output=True, text=True,
                            env=ENV)
    assert result.returncode == 0 and "--model_args" in result.stdout


def test_use_cache_is_refused_in_one_line_before_loading(tmp_path):
    result = subprocess.run(
        [LM_EVAL, "--model", "alspec", "--model_args", f"pretrained={tmp_path}/missing,lambda=0.05",
         "--tasks", "alspec_recall", "--device", "cpu", "--use_cache", str(tmp_path / "cache")],
        capture_output=True, text=True, env=ENV)
    assert result.returncode != 0
    assert "alspec: --use_cache is not supported with --model alspec" in result.stderr
    assert "Traceback" not in result.stderr and not list(tmp_path.glob("cache*"))


def test_use_cache_through_simple_evaluate_is_refused(tmp_path):
    import pytest
    from lm_eval import simple_evaluate

    from alspec_eval.config import ConfigError
    from helpers import alspec_lm
    from alspec_eval.approx_check.models import tiny_model

    with pytest.raises(ConfigError, match="--use_cache is not supported"):
        simple_evaluate(model=alspec_lm(tiny_model()), tasks=["alspec_recall"], limit=1, use_cache=str(tmp_path / "cache"))


def test_every_cli_without_its_required_arguments_prints_usage_and_exits_2():
    """As argparse does: alspec-eval without a command, alspec-sweep without a config, alspec-report without a
    folder, alspec-latency without a table; each prints its usage on stderr and exits 2."""
    for script in ("alspec-eval", "alspec-sweep", "alspec-report", "alspec-latency"):
        result = subprocess.run([str(Path(sys.executable).with_name(script))], capture_output=True, text=True, env=ENV)
        assert result.returncode == 2, (script, result.returncode, result.stderr)
        assert result.stderr.startswith("usage:") and "error:" in result.stderr, (script, result.stderr)
