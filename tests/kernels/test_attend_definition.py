"""Every decode kernel's A~ is semantics.attend (A~'s one arithmetic) over the keys semantics.window_positions lists:
the torch reference and its CPU fast path, the unfused SDPA baseline and the Triton kernel (its interpreter on the
CPU, compiled on a GPU, against semantics.attend on the same device), in float32, where the definition rounds
nothing, to float32 summation order."""

from __future__ import annotations

import pytest
import torch

from alspec_eval import semantics
from alspec_eval.kernels.registry import select_kernel

KERNELS = ["torch", "unfused"] + (["triton"] if __import__("importlib").util.find_spec("triton") else [])


@pytest.mark.parametrize("name", KERNELS)
@pytest.mark.parametrize("align", [1, 32])
def test_a_tilde_is_semantics_attend(name, align):
    device = "cuda" if name == "triton" and torch.cuda.is_available() else "cpu"
    g = torch.Generator().manual_seed(5)
    b, hq, hkv, dim, window, length = 3, 6, 2, 16, 16, 120
    q = torch.randn(b, hq, dim, generator=g).to(device)
    k = torch.randn(b, hkv, length, dim, generator=g).to(device)
    v = torch.randn(b, hkv, length, dim, generator=g).to(device)
    cur_pos = torch.tensor([31, 32, 101], device=device)  # the trivial edge, the first measured row, a long context
    out = select_kernel(name, device)(q, k, v, cur_pos, window, 0.1, window_align=align, scale=0.3)
    positions, valid = semantics.window_positions(cur_pos, window, align)
    index = positions.clamp(max=length - 1)[:, None, :, None].expand(-1, hkv, -1, dim)
    want = semantics.attend(q[:, None], k.gather(2, index), v.gather(2, index), valid[:, None, None, :], 0.3)[:, 0]
    torch.testing.assert_close(out.spec, want, rtol=0, atol=2e-6)
    assert out.trivial.tolist() == [True, False, False]
