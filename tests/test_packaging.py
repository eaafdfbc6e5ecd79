"""`pip install .` ships what the stock lm_eval command needs: the registration .pth, tasks with their data, kernels."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).parents[1]


def test_wheel_contents(tmp_path):
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", str(ROOT),
                    "-w", str(tmp_path)], check=True, capture_output=True)
    (wheel,) = tmp_path.glob("alspec_eval-*.whl")
    with zipfile.ZipFile(wheel) as zf:
        names = set(zf.namelist())
        pth = zf.read("alspec_eval_lmeval.pth").decode()
        entry_points = zf.read(next(n for n in names if n.endswith("entry_points.txt"))).decode()
    assert pth.strip() == "import alspec_eval._lmeval_hook"
    for task in ("alspec_recall/alspec_recall.yaml", "alspec_recall/recall.jsonl", "alspec_recall/utils.py",
                 "alspec_gsm8k/gsm8k_test.jsonl", "alspec_gsm8k/gsm8k_LICENSE.txt", "alspec_niah/utils.py",
                 "alspec_table1/alspec_table1.yaml"):
        assert f"alspec_eval/tasks/{task}" in names, task
    assert {"alspec_eval/kernels/reference.py", "alspec_eval/kernels/triton_decode.py",
            "alspec_eval/kernels/ttlang/spec_decode.py", "alspec_eval/data/haystack.txt"} <= names
    assert "alspec = alspec_eval.adapter:ALSpecLM" in entry_points
    for script in ("alspec-eval", "alspec-sweep", "alspec-report", "alspec-niah"):
        assert f"{script} = " in entry_points
