"""The one definition of the rules (alspec_eval.semantics): hand-computed cases, and every path calls it:
a mutated rule makes the tests of the kernels and of the sim backend fail."""

from __future__ import annotations

import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from alspec_eval import semantics

ROOT = Path(__file__).parents[1]


def test_window_positions_by_hand():
    pos = torch.tensor([20, 40, 7])
    positions, valid = semantics.window_positions(pos, 4, 1)
    assert positions.tolist() == [[0, 1, 2, 3, 17, 18, 19, 20], [0, 1, 2, 3, 37, 38, 39, 40], list(range(8))]
    assert valid.all()
    positions, valid = semantics.window_positions(torch.tensor([40, 64, 63]), 32, 32)  # ends 64, 96, 64
    assert positions[0].tolist() == list(range(32)) + list(range(32, 64))  # pos+1 = 41 <= 64: trivial
    assert valid[0].tolist() == [True] * 41 + [False] * 23
    assert positions[1].tolist() == list(range(32)) + list(range(64, 96))
    assert valid[1].tolist() == [True] * 33 + [False] * 31
    assert semantics.is_trivial(torch.tensor([63, 64]), 32).tolist() == [True, False]


def test_accept_ties_inf_and_squares():
    d, n = torch.tensor([1.0, 2.0, 0.0, 3.0]), torch.tensor([10.0, 10.0, 0.0, 0.0])
    assert semantics.accept(d, n, 0.1).tolist() == [True, False, True, False]
    assert semantics.accept(d, n, math.inf).all()  # lambda = inf accepts also where n = 0
    assert semantics.accept(d, n, torch.tensor([0.1, 0.3, 0.0, 0.0])).tolist() == [True, True, True, False]
    assert semantics.accept_squared(d * d, n * n, 0.1).tolist() == [True, False, True, False]
    d, n = semantics.distances(torch.ones(2, 3, 4), torch.zeros(2, 3, 4))
    assert d.dtype == torch.float32 and torch.allclose(d, torch.full((2,), math.sqrt(12))) and (n == 0).all()


def test_commit_takes_a_tilde_where_accepted_in_the_dtype_of_a():
    exact = torch.zeros(3, 2, 4, dtype=torch.bfloat16)
    approx = torch.arange(24, dtype=torch.float32).reshape(3, 2, 4)
    out = semantics.commit(exact, approx, torch.tensor([True, False, True]))
    assert out.dtype == torch.bfloat16
    assert torch.equal(out[0], approx[0].bfloat16()) and torch.equal(out[1], exact[1])
    assert torch.equal(out[2], approx[2].bfloat16())


# For each broken rule, tests that compare with an independent oracle and must fail.
GUARDS = {
    "window": ["tests/kernels/test_kernel_reference.py::test_matches_sdpa",
               "tests/kernels/test_kernel_triton.py::test_interpreter_left_padding",
               "tests/test_equivalence.py::test_sink_policy_equals_reference_sink_attention"],
    "trivial": ["tests/kernels/test_kernel_reference.py::test_trivial_rows_are_exact_copies",
                "tests/kernels/test_kernel_reference.py::test_matches_sdpa",
                "tests/kernels/test_kernel_triton.py::test_interpreter_left_padding",
                "tests/test_equivalence.py::test_sink_policy_equals_reference_sink_attention"],
    "accept": ["tests/kernels/test_kernel_reference.py::test_accept_around_measured_ratio",
               "tests/test_equivalence.py::test_ratio_and_acceptance_follow_the_definition"],
}


@pytest.mark.slow
@pytest.mark.parametrize("mutation", sorted(GUARDS))
def test_mutated_rule_is_caught_on_every_path(mutation):
    env = {**os.environ, "ALSPEC_MUTATION": mutation}
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "semantics_mutations", "-p", "no:randomly",
                          "-rf", *GUARDS[mutation]], cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    failed = {re.sub(r"\[.*", "", line.split()[1]) for line in run.stdout.splitlines() if line.startswith("FAILED ")}
    assert run.returncode == 1, run.stdout[-2000:] + run.stderr[-2000:]
    assert failed == set(GUARDS[mutation]), run.stdout[-3000:]
