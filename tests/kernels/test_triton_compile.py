"""Both Triton kernels compiled for real GPUs on the CPU (Triton's ptxas, no GPU): every shape ``kernel=auto`` can
pick fits every architecture users evaluate on, with the launch settings the launcher uses; the paged kernel
(kernels/triton_paged.py) fits sm_89 at every shape.

The compiler runs in a process of its own (``python -m alspec_eval.kernels.triton_launch``): a process whose Triton
was imported with the interpreter on (these tests, on the CPU) cannot compile for a GPU. Left padding is a runtime
value of the kernels (each row's first real token is always read), so one binary serves padded and unpadded
batches; the interpreter tests check both. ``ALSPEC_TRITON_VERSION`` names the Triton this run must compile with
(CI runs this file again with the oldest Triton the package admits).
"""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed (pip install triton)")

from alspec_eval.kernels.triton_launch import ARCHS, DTYPES, MATRIX, Arch, Resources, blocks, launch_for

pytestmark = pytest.mark.compiles  # starts the compiler's process, in the fast tier


def compile_matrix(*args: str) -> tuple[int, list[dict]]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-m", "alspec_eval.kernels.triton_launch", *args], env=env,
                          capture_output=True, text=True)
    assert done.returncode in (0, 1) and "Traceback" not in done.stderr, done.stderr
    return done.returncode, [json.loads(line) for line in done.stdout.splitlines()]


@pytest.fixture(scope="module")
def matrix() -> tuple[int, list[dict]]:
    return compile_matrix()


def test_every_shape_compiles_and_fits_every_architecture(matrix) -> None:
    code, rows = matrix
    wanted = os.environ.get("ALSPEC_TRITON_VERSION")
    assert wanted in (None, rows[0]["triton"]), f"compiled with Triton {rows[0]['triton']}, not {wanted}"
    shapes = {(r["arch"], r["dtype"], r["head_dim"], r["group"]) for r in rows}
    assert shapes == set(itertools.product(sorted(ARCHS), DTYPES.values(), *list(MATRIX.values())[1:]))
    assert len(shapes) == 4 * 3 * 5 * 4 == len(rows)
    misfits = [r for r in rows if r["misfit"]]
    assert not misfits and code == 0, "\n".join(map(str, misfits))
    for r in rows:  # the launcher's settings, and what ptxas reported within every limit
        dtype = next(t for t, name in DTYPES.items() if name == r["dtype"])
        assert r["launch"] == vars(launch_for(dtype, r["head_dim"]))
        for kernel in r["kernels"].values():
            assert 0 < kernel["registers"] <= 255 and kernel["shared"] <= ARCHS[r["arch"]].shared_per_block


def test_the_paged_kernel_compiles_for_sm_89_and_fits() -> None:
    """The paged kernel (kernels/triton_paged.py, block table reads, vLLM's block size 16) at every shape of the
    matrix on sm_89, with the decode kernel's launch settings; spills are reported, not refused, as for the decode
    kernel."""
    code, rows = compile_matrix("--arch", "89", "--kernel", "paged", "--page", "16")
    assert os.environ.get("ALSPEC_TRITON_VERSION") in (None, rows[0]["triton"])
    assert code == 0 and len(rows) == 3 * 5 * 4
    for r in rows:
        assert list(r["kernels"]) == ["paged"] and r["misfit"] is None, r
        assert 0 < r["kernels"]["paged"]["registers"] <= 255
        assert r["kernels"]["paged"]["shared"] <= ARCHS[89].shared_per_block


def test_the_paged_verifier_compiles_and_fits() -> None:
    """alspec-vllm's CUDA verifier (kernels/triton_verify.py) at every dtype (bfloat16 included, which Triton's
    interpreter cannot check), head_dim and group of the matrix, at vLLM's block size 16, for sm_89: the targets'
    tightest shared memory (every target allows 255 registers a thread); within every limit. With the newest Triton
    at most 32 bytes a thread spill (Triton 3.9: 32 at 16-bit head_dim 128, none on sm_90); the oldest admitted
    (3.1, CI's second run) spills up to 80 at head_dim 80 and 96, reported as the decode kernels' are."""
    code, rows = compile_matrix("--arch", "89", "--kernel", "verify", "--page", "16")
    assert os.environ.get("ALSPEC_TRITON_VERSION") in (None, rows[0]["triton"])
    assert code == 0 and len(rows) == 3 * 5 * 4
    for r in rows:
        assert list(r["kernels"]) == ["verify"] and r["misfit"] is None, r
        kernel = r["kernels"]["verify"]
        assert 0 < kernel["registers"] <= 255 and kernel["shared"] <= ARCHS[r["arch"]].shared_per_block, r
        assert os.environ.get("ALSPEC_TRITON_VERSION") or kernel["spilled"] <= 32, r


def test_settings_over_a_limit_are_refused_with_their_bytes() -> None:
    code, rows = compile_matrix("--arch", "86", "--arch", "90", "--launch", "64,3")  # before: fp32 took 64 keys in 3 stages
    over = {(r["arch"], r["dtype"], r["head_dim"]) for r in rows if r["misfit"]}
    assert code == 1 and over == {(86, "fp32", d) for d in (80, 96, 128, 256)} | {(90, "fp32", 256)}
    row = next(r for r in rows if (r["arch"], r["dtype"], r["head_dim"]) == (86, "fp32", 128))
    assert row["misfit"] == (f"the decode kernel needs {row['kernels']['decode']['shared']} bytes of shared memory "
                             "per block, sm_86 allows 101376")


def test_registers_are_checked_per_thread_and_per_block() -> None:
    assert Resources("decode", 0, 256, 128).misfit(ARCHS[90]).startswith("the decode kernel needs 256 registers")
    assert Resources("reduce", 0, 255, 128).misfit(ARCHS[90]) is None
    assert "registers" in Resources("partial", 0, 200, 128).misfit(Arch(90, 232448, registers_per_block=25599))
    assert Resources("partial", 101377, 1, 128).misfit(ARCHS[89]).endswith("sm_89 allows 101376")
    assert Resources("partial", 101376, 1, 128).misfit(ARCHS[89]) is None


def test_an_unknown_dtype_is_refused() -> None:
    from alspec_eval.kernels.triton_launch import misfit

    assert misfit(torch.float64, 8, 128, ARCHS[90]) == (
        "the Triton kernels take torch.float32, torch.float16, torch.bfloat16, not torch.float64")


def test_blocks_round_up_to_powers_of_two_of_at_least_16() -> None:
    assert blocks(1, 64) == (16, 64)
    assert blocks(4, 80) == (16, 128)
    assert blocks(16, 128) == (16, 128)
    assert blocks(17, 256) == (32, 256)
