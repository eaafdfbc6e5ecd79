"""tt_kernel=ttlang: the TT-Lang speculative flash decode kernel as the tt backend's decode op, on tt-lang-sim.

tt_mode=host with the simulator (float32) must decide exactly as the sim backend with window_align=32 and give
the same outputs up to float rounding. The simulator rebinds torch.bfloat16 process-wide, so the comparison runs
in a subprocess (ttlang_run.py); this process only looks for the package.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from alspec_eval.kernels.ttlang.decode import SIM, flavour
from alspec_eval.stats import ACCEPTED, REJECTED

pytestmark = pytest.mark.slow  # builds models, runs lm-eval or starts processes

if flavour() != SIM:
    pytest.skip("tt-lang-sim is not installed here (pip install tt-lang-sim, Python 3.10-3.12; part of the test extra)",
                allow_module_level=True)

SCRIPT = Path(__file__).with_name("ttlang_run.py")


@pytest.fixture(scope="module")
def result() -> dict:
    proc = subprocess.run([sys.executable, str(SCRIPT)], cwd=SCRIPT.parents[2], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout)


def test_decode_steps_run_the_kernel(result: dict) -> None:
    assert result["speculator"] == "TTSpeculator"
    assert result["kernel_calls"] > 0  # every decode step of every layer: not the golden ttnn path


def test_kernel_matches_reference(result: dict) -> None:
    """A, A~ and the device's d and n of one left-padded GQA decode step against the torch reference."""
    kernel = result["kernel"]
    assert kernel["pcc_exact"] >= 0.999 and kernel["pcc_spec"] >= 0.999
    assert kernel["max_abs_exact"] < 1e-4 and kernel["max_abs_spec"] < 1e-4
    assert kernel["d"] == pytest.approx(kernel["d_reference"], rel=1e-4)
    assert kernel["n"] == pytest.approx(kernel["n_reference"], rel=1e-4)


def test_decisions_and_outputs_equal_sim(result: dict) -> None:
    """Greedy decode steps: the same accept decision per step and layer, the same tokens and logits; lambda sits
    between two measured ratios, far from every ratio compared with the two paths' float differences."""
    assert result["margin"] > 100 * result["max_rel_ratio"] and result["max_rel_ratio"] < 1e-4
    assert result["codes_tt"] == result["codes_sim"]
    codes = [c for row in result["codes_sim"] for step in row for c in step]
    assert ACCEPTED in codes and REJECTED in codes  # both kinds of decision were compared
    assert result["tokens_equal"]
    assert result["max_abs_logits"] < 1e-4


def test_generation_equals_sim(result: dict) -> None:
    """generate_until through lm-eval with a left-padded batch: same text, per-sample and per-layer counts."""
    assert result["generations_tt"] == result["generations_sim"]
    assert result["samples_tt"] == result["samples_sim"]
    assert result["layers_tt"] == result["layers_sim"]
    assert any(layer["accepted"] for layer in result["layers_sim"])
