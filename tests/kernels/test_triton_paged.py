"""The paged Triton kernel (kernels/triton_paged.py) against the float64 oracle, Triton's interpreter on the CPU and
compiled on CUDA. The test writes each row's logical cache into a vLLM FlashAttention-layout paged cache itself
(physical blocks shuffled, two rows sharing their prefix's blocks, garbage in unused blocks and past each row's
position) and hands the oracle the logical cache it started from, so the kernel's reads through the block table are
checked against a path that never reads one."""

from __future__ import annotations

import math

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed (pip install triton)")

from float64_oracle import decisions_away_from_boundary, decode_step_float64

from alspec_eval.kernels import triton_decode
from alspec_eval.kernels.triton_paged import check_paged_inputs, speculative_flash_decode_paged

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # the interpreter on the CPU, compiled on a GPU
HQ, HKV, DIM, WINDOW, CAPACITY = 6, 2, 32, 16, 144  # grouped-query heads: 3 query heads per KV head
# rows: deep; sharing row 0's prefix blocks; context exactly 2S (trivial); 2S + 1 (the first non-trivial)
CUR_POS = [120, 80, 2 * WINDOW - 1, 2 * WINDOW]
TRIVIAL = [False, False, True, False]
SHARED = 48  # positions of row 0's prefix that row 1 shares, block for block
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 1.6e-2}  # relative, of the whole row
D_RTOL = {torch.float32: 5e-4, torch.bfloat16: 0.1}
MARGIN = {torch.float32: 1e-4, torch.bfloat16: 4e-2}  # |d - lambda n| / n a decision is sure by
# Triton's CPU interpreter computes tl.dot on bfloat16 wrongly: bfloat16 is checked on a GPU only
DTYPES = [torch.float32, *([torch.bfloat16] if DEVICE == "cuda" else [])]


def logical_cache(seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q (B, Hq, D) and each row's K, V by position (B, Hkv, CAPACITY, D): row 1 repeats row 0's first SHARED
    positions, and every position past a row's query holds large finite garbage (it must never be attended)."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(len(CUR_POS), HQ, DIM, generator=g)
    k, v = (torch.randn(len(CUR_POS), HKV, CAPACITY, DIM, generator=g) for _ in range(2))
    k[1, :, :SHARED], v[1, :, :SHARED] = k[0, :, :SHARED], v[0, :, :SHARED]
    for b, p in enumerate(CUR_POS):
        k[b, :, p + 1:], v[b, :, p + 1:] = 300.0, -1e4
    return q, k, v


def page(k: torch.Tensor, v: torch.Tensor, block: int, seed: int, layout: str = "combined") -> tuple:
    """The logical caches written into shuffled physical blocks of (num_blocks, block, Hkv, D) caches, the rows'
    block table, and the blocks no row uses filled with garbage. ``layout`` "combined": K and V views of one
    (2, num_blocks, block, Hkv, D) cache (vLLM FlashAttention's); "strided": V a transposed view of a
    (num_blocks, Hkv, block, D) store, strides of its own."""
    rows, per_row = k.shape[0], CAPACITY // block
    shared = SHARED // block
    own = [list(range(per_row)) if b != 1 else list(range(shared, per_row)) for b in range(rows)]
    spare = 3
    count = sum(map(len, own)) + spare
    order = torch.randperm(count, generator=torch.Generator().manual_seed(seed)).tolist()  # logical -> physical
    table = torch.empty(rows, per_row, dtype=torch.int32)
    combined = torch.full((2, count, block, HKV, DIM), 1e3)  # garbage wherever no row's key is written
    k_cache = combined[0]
    if layout == "combined":
        v_cache = combined[1]
    else:
        v_cache = torch.full((count, HKV, block, DIM), -1e3).transpose(1, 2)
    for b in range(rows):
        for i in range(per_row):
            if b == 1 and i < shared:
                table[b, i] = table[0, i]  # row 0's physical block: the same keys
                continue
            table[b, i] = order.pop()
            k_cache[table[b, i]] = k[b, :, i * block:(i + 1) * block].transpose(0, 1)
            v_cache[table[b, i]] = v[b, :, i * block:(i + 1) * block].transpose(0, 1)
    assert len(order) == spare and table.unique().numel() == count - spare
    return k_cache, v_cache, table


def to_device(*tensors: torch.Tensor, dtype: torch.dtype | None = None) -> list[torch.Tensor]:
    """On DEVICE; floating tensors in ``dtype``, keeping their strides (a view's layout is what is tested)."""
    out = []
    for t in tensors:
        if t.is_floating_point() and dtype is not None:
            t = torch.empty_strided(t.shape, t.stride(), dtype=dtype).copy_(t) if t.is_contiguous() is False \
                and t.stride() != t.contiguous().stride() and t._base is None else t.to(dtype)
        out.append(t.to(DEVICE))
    return out


def lambdas(ratio: list[float], margin: float) -> list[float]:
    """Per row: row 0 accepted, row 1 rejected, the trivial row 0 (accepted all the same), row 3 accepted; each
    beyond the margin."""
    assert ratio[1] > 3 * margin
    return [1.5 * ratio[0] + 2 * margin, ratio[1] / 1.5 - margin, 0.0, 1.5 * ratio[3] + 2 * margin]


@pytest.mark.parametrize("layout", ["combined", "strided"])
@pytest.mark.parametrize("align", [1, 32])
@pytest.mark.parametrize("block", [16, 32, 24])  # vLLM's sizes, and one no power of two
@pytest.mark.parametrize("dtype", DTYPES)
def test_paged_kernel_equals_the_float64_oracle(dtype: torch.dtype, block: int, align: int, layout: str) -> None:
    if layout == "strided" and (block, align) != (24, 32):
        pytest.skip("one strided case is enough: the strides are runtime values")
    q, k, v = logical_cache(seed=block + align)
    k_cache, v_cache, table = page(k.to(dtype).float(), v.to(dtype).float(), block, seed=block, layout=layout)
    q = q.to(dtype).float()
    oracle = decode_step_float64(q.double(), k.to(dtype).double(), v.to(dtype).double(), CUR_POS, [0] * 4, WINDOW,
                                 align, 1.0)
    lam = lambdas((oracle["d"] / oracle["n"]).tolist(), MARGIN[dtype])
    if layout == "strided":
        v_cache = v_cache.to(DEVICE, dtype) if dtype == torch.float32 else \
            v_cache.transpose(1, 2).to(dtype).transpose(1, 2)
    out = speculative_flash_decode_paged(q.to(DEVICE, dtype), k_cache.to(DEVICE, dtype), v_cache.to(DEVICE, dtype)
                                         if layout == "combined" else v_cache.to(DEVICE), table.to(DEVICE),
                                         torch.tensor(CUR_POS, device=DEVICE), WINDOW,
                                         torch.tensor(lam, device=DEVICE), window_align=align, chunk_size=16)
    out = type(out)(*(x.cpu() for x in out))
    want = decode_step_float64(q.double(), k.to(dtype).double(), v.to(dtype).double(), CUR_POS, [0] * 4, WINDOW,
                               align, lam)
    for name in ("exact", "spec"):
        error = (getattr(out, name).double() - want[name]).flatten(1).norm(dim=1) / want[name].flatten(1).norm(dim=1)
        assert error.max() < TOLERANCE[dtype], (name, error)
    torch.testing.assert_close(out.d.double(), want["d"], rtol=D_RTOL[dtype], atol=1e-6)
    torch.testing.assert_close(out.n.double(), want["n"], rtol=TOLERANCE[dtype], atol=0)
    assert out.trivial.tolist() == want["trivial"] == TRIVIAL
    assert torch.equal(out.spec[2], out.exact[2])  # trivial: A~ is A, bit for bit
    assert decisions_away_from_boundary(want["d"], want["n"], lam, MARGIN[dtype]) == [0, 1, 2, 3]
    assert out.accept.tolist() == want["accept"] == [True, False, True, True]
    assert not triton_decode._scratch.tickets[torch.device(DEVICE)].any()  # back at zero for the next call
