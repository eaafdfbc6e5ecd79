"""TT-Lang kernel on tt-lang-sim against the torch reference (bf16, window_align=32).

tt-lang-sim is part of the `test` extra (it runs on Python 3.10-3.12 with the CPU torch).
The simulator rebinds torch.bfloat16 process-wide, so it runs in a subprocess.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # builds models, runs lm-eval or starts processes

# Only look for the simulator: importing it here would rebind torch.bfloat16 for every later test.
if importlib.util.find_spec("ttl") is None:
    pytest.skip("tt-lang-sim is not installed (pip install -e '.[test]')", allow_module_level=True)

ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def result() -> dict:
    proc = subprocess.run(
        [sys.executable, "-m", "alspec_eval.kernels.ttlang.run_sim", "--json"], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout)


def test_outputs_match_reference(result: dict) -> None:
    assert result["pcc_exact"] >= 0.999
    assert result["pcc_spec"] >= 0.999
    assert result["max_abs_exact"] < 2e-2 and result["max_abs_spec"] < 2e-2


def test_verification_matches_reference(result: dict) -> None:
    assert result["trivial"] == [False, False, True]
    assert result["d_kernel"][2] == 0.0  # trivial: the approximation is the exact output
    assert result["d_kernel"] == pytest.approx(result["d_reference"], rel=1e-2)
    assert result["n_kernel"] == pytest.approx(result["n_reference"], rel=1e-2)
    for case in result["decisions"]:
        assert case["kernel"] == case["reference"], case
    # Lambdas are 0.99x and 1.01x each row's ratio: that row flips from reject to accept.
    for row, trivial in enumerate(result["trivial"]):
        below, above = result["decisions"][2 * row]["kernel"][row], result["decisions"][2 * row + 1]["kernel"][row]
        assert (below, above) == ((True, True) if trivial else (False, True))
