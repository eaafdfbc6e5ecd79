"""Triton kernel against the torch reference: Triton's interpreter on CPU, compiled on CUDA."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    # Must precede the kernels' first use: triton picks interpreter mode when a kernel is decorated.
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton", reason="triton is not installed (pip install triton)")

from kernel_oracle import make_inputs  # noqa: E402

from alspec_eval.kernels import select_kernel, speculative_flash_decode  # noqa: E402
from alspec_eval.kernels import triton_decode  # noqa: E402

POSITIONS = [150, 16, 15, 3, 97]
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _compare(device: str, dtype: torch.dtype, align: int, window: int, chunk: int, atol: float) -> None:
    q, k, v, cur_pos = (t.to(device) for t in make_inputs(len(POSITIONS), 6, 2, 160, 32, POSITIONS, dtype=dtype))
    ref = speculative_flash_decode(q, k, v, cur_pos, window, 0.5, window_align=align)
    out = triton_decode.speculative_flash_decode_triton(q, k, v, cur_pos, window, 0.5, chunk_size=chunk, window_align=align)
    torch.testing.assert_close(out.exact, ref.exact, atol=atol, rtol=atol)
    torch.testing.assert_close(out.spec, ref.spec, atol=atol, rtol=atol)
    torch.testing.assert_close(out.d, ref.d, atol=atol * 10, rtol=atol * 10)
    torch.testing.assert_close(out.n, ref.n, atol=atol * 10, rtol=atol * 10)
    assert torch.equal(out.trivial, ref.trivial)
    assert torch.equal(out.spec[out.trivial], out.exact[out.trivial])


@pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter test; CUDA runs the compiled kernel instead")
@pytest.mark.parametrize("align,window", [(1, 8), (32, 32)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])  # the interpreter's tl.dot mishandles bfloat16
def test_interpreter_matches_reference(align: int, window: int, dtype: torch.dtype) -> None:
    _compare("cpu", dtype, align, window, 16, 1e-5 if dtype == torch.float32 else 2e-3)


@pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter test")
def test_accept_decision_matches_reference() -> None:
    q, k, v, cur_pos = make_inputs(len(POSITIONS), 6, 2, 160, 32, POSITIONS, seed=5)
    ratio = speculative_flash_decode(q, k, v, cur_pos, 8, 0.0).d / speculative_flash_decode(q, k, v, cur_pos, 8, 0.0).n
    lam = float(ratio[0]) * 1.001  # row 0 just accepted; row 4 checked against the reference
    ref = speculative_flash_decode(q, k, v, cur_pos, 8, lam)
    out = triton_decode.speculative_flash_decode_triton(q, k, v, cur_pos, 8, lam, chunk_size=16)
    assert out.accept[0]
    assert torch.equal(out.accept, ref.accept)


def test_missing_triton_raises_clearly(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(__import__("sys").modules, "triton", None)
    triton_decode._kernels.cache_clear()
    q, k, v, cur_pos = make_inputs(1, 2, 1, 8, 16, [7])
    try:
        with pytest.raises(RuntimeError, match="needs the `triton` package"):
            triton_decode.speculative_flash_decode_triton(q, k, v, cur_pos, 2, 0.1)
    finally:
        triton_decode._kernels.cache_clear()


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("align,window", [(1, 8), (32, 32)])
def test_cuda_matches_reference(dtype: torch.dtype, align: int, window: int) -> None:
    _compare("cuda", dtype, align, window, 64, 1e-5 if dtype == torch.float32 else 2e-2)


@needs_cuda
def test_auto_selects_triton_on_cuda() -> None:
    assert select_kernel("auto", "cuda") is triton_decode.speculative_flash_decode_triton
