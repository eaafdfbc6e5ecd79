"""The host golden of the authors' speculative op (backends/tt/contract.py) against the window geometry of the torch
reference kernel (window_align=32), and the op's preconditions. Needs no ttnn."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from alspec_eval.backends.tt.contract import padded_heads, speculative_golden
from alspec_eval.kernels import speculative_flash_decode

CONFIGS = dict(program_config=None, compute_kernel_config=object())


def _call(q, k, v, window, cur_pos, **extra):
    kwargs = {**CONFIGS, "program_config": SimpleNamespace(k_chunk_size=window), "lambda_": 0.1, "cur_pos": cur_pos,
              "scale": q.shape[-1] ** -0.5, **extra}
    return speculative_golden(q, k, v, **kwargs)


@pytest.mark.parametrize("window", [32, 64])
def test_golden_matches_reference_geometry(window):
    torch.manual_seed(window)
    length = 6 * window
    cur_pos = [2 * window, 2 * window + 4, 3 * window + 5, length - 1, 2 * window + 31]  # just above 2S, not tile-aligned
    b, hq, hkv, dim = len(cur_pos), 8, 2, 64
    q = torch.randn(1, b, hq, dim)
    k, v = torch.randn(b, hkv, length, dim) * 2, torch.randn(b, hkv, length, dim)
    full, spec, d2, n2 = _call(q, k, v, window, cur_pos)
    assert full.shape == (1, b, padded_heads(hq), dim) and d2.shape == n2.shape == (1, 1, b, 1)
    assert d2.dtype == n2.dtype == torch.bfloat16 and not full[0, :, hq:].any()
    ref = speculative_flash_decode(q[0], k, v, torch.tensor(cur_pos), window, math.inf, window_align=32)
    torch.testing.assert_close(full[0, :, :hq], ref.exact, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(spec[0, :, :hq], ref.spec, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(d2.flatten().float(), ref.d ** 2, rtol=8e-3, atol=0)  # bfloat16, as the op returns
    torch.testing.assert_close(n2.flatten().float(), ref.n ** 2, rtol=8e-3, atol=0)
    assert (ref.d > 0).all()


def test_padded_heads():
    assert [padded_heads(h) for h in (1, 9, 32)] == [32, 32, 32]


@pytest.mark.parametrize("case, error", [
    ({"cur_pos": [63]}, "pos\\+1 <= 2S|2S < pos"),
    ({"length": 100}, "not a multiple of k_chunk_size"),
    ({"extra": {"speculative_chunk_size": 32}}, "incompatible keyword"),
    ({"window": 96}, "power of 2"),
    ({"extra": {"compute_kernel_config": None}}, "compute_kernel_config"),
])
def test_preconditions_raise(case, error):
    window = case.get("window", 32)
    length = case.get("length", 192)
    q, k = torch.randn(1, 1, 4, 64), torch.randn(1, 2, length, 64)
    exc = TypeError if "extra" in case and "speculative_chunk_size" in case["extra"] else RuntimeError
    with pytest.raises(exc, match=error):
        _call(q, k, k, window, case.get("cur_pos", [100]), **case.get("extra", {}))
