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


def test_window_ranges_are_the_valid_window_positions():
    """The ranges a paged cache reads are exactly the positions window_positions marks valid, at both alignments,
    on both sides of the trivial edge."""
    for window, align in ((4, 1), (32, 32), (8, 32)):
        pos = torch.arange(0, 5 * window + 70)
        positions, valid = semantics.window_positions(pos, window, align)
        starts, ends = semantics.window_ranges(pos, window, align)
        for r in range(len(pos)):
            listed = {int(p) for p, ok in zip(positions[r], valid[r]) if ok}
            ranged = {p for k in range(2) for p in range(int(starts[r, k]), int(ends[r, k]))}
            assert listed == ranged, (window, align, int(pos[r]))
            assert int(ends[r, 0]) <= int(starts[r, 1])  # disjoint, in order


def _attend64(query, keys, values, valid, scale):
    """softmax(q k^T scale) v per query head in float64, head h on KV head h // (Hq / Hkv), from the definition."""
    b, q_len, heads, _ = query.shape
    group = heads // keys.shape[1]
    out = torch.zeros(query.shape, dtype=torch.float64)
    for i in range(b):
        for j in range(q_len):
            for h in range(heads):
                kv = h // group
                mask = valid[i, min(kv, valid.shape[1] - 1), j]
                w = torch.softmax((keys[i, kv].double() @ query[i, j, h].double()) * scale
                                  + torch.where(mask, 0.0, -math.inf), 0)
                out[i, j, h] = w @ values[i, kv].double()
    return out


@pytest.mark.parametrize("kv_mask_heads", [1, 2])
def test_attend_is_softmax_attention_with_grouped_heads(kv_mask_heads):
    g = torch.Generator().manual_seed(0)
    query, keys, values = (torch.randn(3, 4, 6, 8, generator=g), torch.randn(3, 2, 10, 8, generator=g),
                           torch.randn(3, 2, 10, 8, generator=g))
    valid = torch.rand(3, kv_mask_heads, 4, 10, generator=g) > 0.3
    valid[..., 0] = True
    got = semantics.attend(query, keys, values, valid, 0.7)
    torch.testing.assert_close(got.double(), _attend64(query, keys, values, valid, 0.7), rtol=0, atol=2e-6)
    assert got.dtype == torch.float32


def test_attend_in_bfloat16_is_the_platforms_flash_arithmetic():
    """In bfloat16, A~ through torch's SDPA on the CPU (the kernel HF models attend with, and the arithmetic of
    FlashAttention and vLLM's kernels: float32 scores and softmax, probabilities in bf16, float32 accumulation) is
    semantics.attend's to one bf16 step of each head's largest value, where HF's eager arithmetic (scores rounded to bf16) is not."""
    g = torch.Generator().manual_seed(1)
    query = torch.randn(64, 1, 9, 64, generator=g).bfloat16()
    keys, values = (2 * torch.randn(64, 3, 128, 64, generator=g)).bfloat16(), torch.randn(64, 3, 128, 64, generator=g).bfloat16()
    valid = torch.rand(64, 1, 1, 128, generator=g) > 0.2
    ours = semantics.attend(query, keys, values, valid, 0.125)[:, 0].float()
    sdpa = torch.nn.functional.scaled_dot_product_attention(
        query.transpose(1, 2), keys.repeat_interleave(3, 1), values.repeat_interleave(3, 1), attn_mask=valid,
        scale=0.125)[:, :, 0].float()
    top = ours.abs().amax(-1, keepdim=True)  # each head's largest value, and one bf16 step there
    step = 2.0 ** (torch.floor(torch.log2(top)) - 7)
    assert ((sdpa - ours).abs() <= step).all() and (sdpa != ours).float().mean() < 0.1
    scores = ((query.transpose(1, 2) @ keys.repeat_interleave(3, 1).transpose(-1, -2)) * 0.125)  # rounded to bf16
    eager = (scores.masked_fill(~valid, -math.inf).float().softmax(-1).bfloat16() @ values.repeat_interleave(3, 1))
    assert not ((eager[:, :, 0].float() - ours).abs() <= step).all()


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
