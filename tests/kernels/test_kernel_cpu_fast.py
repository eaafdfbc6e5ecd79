"""The CPU fast path (kernel=torch's common step) against the readable reference."""

from __future__ import annotations

import math

import pytest
import torch

from alspec_eval.kernels import select_kernel, speculative_flash_decode, torch_kernel
from alspec_eval.kernels import cpu_fast
from kernel_oracle import make_inputs


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("align,window", [(1, 8), (32, 32)])
@pytest.mark.parametrize("pos", [7, 63, 64, 65, 100, 159])
@pytest.mark.parametrize("hq,hkv", [(6, 2), (4, 4)])
def test_fast_path_equals_reference(dtype, tol, align, window, pos, hq, hkv):
    q, k, v, cur_pos = make_inputs(2, hq, hkv, 160, 16, [pos, pos], dtype=dtype, seed=pos)
    ref = speculative_flash_decode(q, k, v, cur_pos, window, 0.3, window_align=align)
    out = cpu_fast.speculative_decode_cpu(q, k, v, cur_pos, window, 0.3, window_align=align)
    torch.testing.assert_close(out.exact.float(), ref.exact.float(), atol=tol, rtol=tol)
    torch.testing.assert_close(out.spec.float(), ref.spec.float(), atol=tol, rtol=tol)
    torch.testing.assert_close(out.d, ref.d, atol=tol * 10, rtol=tol * 10)
    assert torch.equal(out.trivial, ref.trivial)
    ratio = ref.d / ref.n
    clear = ~ref.trivial & ((ratio - 0.3).abs() > 0.05 * 0.3)
    assert torch.equal(out.accept[clear], ref.accept[clear]) and out.accept[ref.trivial].all()


def test_dispatch():
    q, k, v, cur_pos = make_inputs(2, 6, 2, 160, 16, [100, 100])
    assert select_kernel("torch", "cpu") is torch_kernel
    assert cpu_fast.applies(q, cur_pos, None) and cpu_fast.applies(q, cur_pos, torch.zeros(2, dtype=torch.long))
    assert not cpu_fast.applies(q, torch.tensor([100, 90]), None)
    assert not cpu_fast.applies(q, cur_pos, torch.tensor([0, 3]))
    out = torch_kernel(q, k, v, torch.tensor([100, 90]), 8, math.inf)  # uneven positions: the reference
    ref = speculative_flash_decode(q, k, v, torch.tensor([100, 90]), 8, math.inf)
    assert torch.equal(out.exact, ref.exact) and torch.equal(out.spec, ref.spec)
