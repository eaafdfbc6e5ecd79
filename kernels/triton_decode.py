"""Triton speculative flash decode (split-K over the sequence).

Program (b, kv head, split) computes a flash partial for all query heads of
one KV head. Split 0 is the speculative chunk (first and last S positions), so
its partial, normalised, is the approximation; splits 1.. cover the middle.
One reduction program per (b, kv head) merges the partials into the exact
output, writes both outputs and the squared norms for verification.

Triton is imported lazily: this module imports without it, and calling the
kernel without it raises a clear error. Set TRITON_INTERPRET=1 before the first
call to run on the CPU through Triton's interpreter (how CI tests it).
"""

from __future__ import annotations

import functools
import math
from typing import Any

import torch

from ..semantics import accept, window_bounds
from .reference import SpecDecodeOutput, check_inputs, resolve_start


@functools.lru_cache(maxsize=None)
def _kernels() -> tuple[Any, Any]:
    """Build the two jitted kernels on first use (triton decides interpret mode here)."""
    try:
        import triton
        import triton.language as tl
    except ImportError as err:  # pragma: no cover - depends on the environment
        raise RuntimeError(
            "kernel=triton needs the `triton` package (pip install triton, or alspec-eval[triton]); "
            "use kernel=torch for the reference implementation"
        ) from err

    @triton.jit
    def partial_kernel(
        q_ptr, k_ptr, v_ptr, last_start_ptr, mid_stop_ptr, cur_pos_ptr, start_ptr, o_ptr, lse_ptr,
        stride_qb, stride_qh, stride_kb, stride_kh, stride_kl, stride_vb, stride_vh, stride_vl,
        cache_len, scale,
        GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, WINDOW: tl.constexpr, NUM_SPLITS: tl.constexpr,
        BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, IEEE: tl.constexpr,
        HAS_START: tl.constexpr,
    ):
        b = tl.program_id(0)
        h = tl.program_id(1)
        split = tl.program_id(2)
        hkv = tl.num_programs(1)
        offs_g = tl.arange(0, BLOCK_G)
        offs_d = tl.arange(0, BLOCK_D)
        offs_n = tl.arange(0, BLOCK_N)
        g_mask = offs_g < GROUP
        d_mask = offs_d < HEAD_DIM
        q = tl.load(
            q_ptr + b * stride_qb + (h * GROUP + offs_g)[:, None] * stride_qh + offs_d[None, :],
            mask=g_mask[:, None] & d_mask[None, :], other=0.0,
        )
        # cur, last_start, mid_stop are logical (counted from the first real token);
        # with left padding, physical = logical + start (HAS_START only).
        cur = tl.load(cur_pos_ptr + b)
        last_start = tl.load(last_start_ptr + b)
        if HAS_START:
            first = tl.load(start_ptr + b)
        else:
            first = 0
        k_base = k_ptr + b * stride_kb + h * stride_kh
        v_base = v_ptr + b * stride_vb + h * stride_vh

        # Split 0 walks j in [0, 2S) mapped onto the two windows; split i > 0
        # walks its share of the middle [S, mid_stop).
        is_spec = split == 0
        mid_len = tl.maximum(tl.load(mid_stop_ptr + b) - WINDOW, 0)
        per = tl.cdiv(mid_len, NUM_SPLITS - 1)
        lo = tl.where(is_spec, 0, WINDOW + (split - 1) * per)
        hi = tl.where(is_spec, 2 * WINDOW, tl.minimum(lo + per, WINDOW + mid_len))

        m_i = tl.full([BLOCK_G], -1e30, tl.float32)
        l_i = tl.zeros([BLOCK_G], tl.float32)
        acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
        for start in range(lo, hi, BLOCK_N):
            j = start + offs_n
            pos = tl.where(is_spec & (j >= WINDOW), last_start + j - WINDOW, j)
            if HAS_START:
                phys = pos + first
            else:
                phys = pos
            valid = (j < hi) & (pos <= cur) & (phys < cache_len)
            kv_mask = valid[:, None] & d_mask[None, :]
            k = tl.load(k_base + phys[:, None] * stride_kl + offs_d[None, :], mask=kv_mask, other=0.0)
            v = tl.load(v_base + phys[:, None] * stride_vl + offs_d[None, :], mask=kv_mask, other=0.0)
            if IEEE:
                s = tl.dot(q, tl.trans(k), input_precision="ieee")
            else:
                s = tl.dot(q, tl.trans(k))
            s = tl.where(valid[None, :], s * scale, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            alpha = tl.exp(m_i - m_new)
            p = tl.exp(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, axis=1)
            if IEEE:
                pv = tl.dot(p.to(v.dtype), v, input_precision="ieee")
            else:
                pv = tl.dot(p.to(v.dtype), v)
            acc = acc * alpha[:, None] + pv
            m_i = m_new

        has = l_i > 0
        o = acc / tl.where(has, l_i, 1.0)[:, None]
        lse = tl.where(has, m_i + tl.log(tl.where(has, l_i, 1.0)), float("-inf"))
        row = (b * hkv + h) * NUM_SPLITS + split
        tl.store(
            o_ptr + (row * BLOCK_G + offs_g)[:, None] * BLOCK_D + offs_d[None, :], o,
        )
        tl.store(lse_ptr + row * BLOCK_G + offs_g, lse)

    @triton.jit
    def reduce_kernel(
        o_ptr, lse_ptr, exact_ptr, spec_ptr, sq_ptr,
        GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, NUM_SPLITS: tl.constexpr,
        BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr,
    ):
        b = tl.program_id(0)
        h = tl.program_id(1)
        hkv = tl.num_programs(1)
        offs_g = tl.arange(0, BLOCK_G)
        offs_d = tl.arange(0, BLOCK_D)
        mask = (offs_g < GROUP)[:, None] & (offs_d < HEAD_DIM)[None, :]
        base = (b * hkv + h) * NUM_SPLITS
        tile = offs_g[:, None] * BLOCK_D + offs_d[None, :]

        # The speculative partial is the running state the middle merges into.
        spec = tl.load(o_ptr + base * BLOCK_G * BLOCK_D + tile)
        lse = tl.load(lse_ptr + base * BLOCK_G + offs_g)
        acc = spec
        for split in range(1, NUM_SPLITS):
            o_s = tl.load(o_ptr + (base + split) * BLOCK_G * BLOCK_D + tile)
            lse_s = tl.load(lse_ptr + (base + split) * BLOCK_G + offs_g)
            new = tl.maximum(lse, lse_s) + tl.log(1.0 + tl.exp(-tl.abs(lse - lse_s)))
            w_s = tl.where(lse_s > float("-inf"), tl.exp(lse_s - new), 0.0)
            acc = acc * tl.exp(lse - new)[:, None] + o_s * w_s[:, None]
            lse = new

        out = (b * hkv + h) * GROUP * HEAD_DIM + offs_g[:, None] * HEAD_DIM + offs_d[None, :]
        tl.store(spec_ptr + out, spec.to(spec_ptr.dtype.element_ty), mask=mask)
        tl.store(exact_ptr + out, acc.to(exact_ptr.dtype.element_ty), mask=mask)
        # Verification on the rounded outputs, as the caller sees them.
        e = tl.where(mask, acc.to(exact_ptr.dtype.element_ty).to(tl.float32), 0.0)
        sp = tl.where(mask, spec.to(spec_ptr.dtype.element_ty).to(tl.float32), 0.0)
        diff = sp - e
        tl.store(sq_ptr + (b * hkv + h) * 2, tl.sum(tl.sum(diff * diff, axis=1), axis=0))
        tl.store(sq_ptr + (b * hkv + h) * 2 + 1, tl.sum(tl.sum(e * e, axis=1), axis=0))

    return partial_kernel, reduce_kernel


def _next_pow2(x: int) -> int:
    return 1 << max(x - 1, 0).bit_length()


def _num_splits(batch_heads: int, max_mid: int, block_n: int, device: torch.device) -> int:
    """Speculative split plus enough middle splits to fill the GPU (a couple of waves)."""
    if max_mid <= 0:
        return 2  # keep one (empty) middle split so the grid shape is stable
    sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4
    want = max(1, math.ceil(2 * sms / batch_heads))
    return 1 + min(want, math.ceil(max_mid / block_n))


def speculative_flash_decode_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cur_pos: torch.Tensor,
    window: int,
    lam: float | torch.Tensor,
    chunk_size: int | None = None,
    window_align: int = 1,
    scale: float | None = None,
    *,
    start: torch.Tensor | None = None,
) -> SpecDecodeOutput:
    """Same contract as :func:`reference.speculative_flash_decode` (``start`` included); ``chunk_size`` is BLOCK_N."""
    check_inputs(q, k, v, cur_pos, window, window_align, start)
    partial_kernel, reduce_kernel = _kernels()
    b, hq, dim = q.shape
    hkv, cache_len = k.shape[1], k.shape[2]
    group = hq // hkv
    scale = dim**-0.5 if scale is None else scale
    q = q.contiguous()
    if k.stride(3) != 1 or v.stride(3) != 1:
        k, v = k.contiguous(), v.contiguous()
    cur_pos = cur_pos.to(device=q.device, dtype=torch.long)
    start, cur_pos = resolve_start(start, cur_pos)  # from here on cur_pos is logical
    last_start, trivial = window_bounds(cur_pos, window, window_align)
    mid_stop = torch.where(trivial, torch.full_like(last_start, window), torch.minimum(last_start, cur_pos + 1))

    block_g = max(16, _next_pow2(group))
    block_d = max(16, _next_pow2(dim))
    block_n = chunk_size or 64
    if block_n < 16 or block_n & (block_n - 1):
        raise ValueError(f"chunk_size (BLOCK_N) must be a power of two >= 16 for tl.dot, got {block_n}")
    splits = _num_splits(b * hkv, int(mid_stop.max()) - window, block_n, q.device)
    o_part = torch.empty(b * hkv * splits * block_g, block_d, device=q.device, dtype=torch.float32)
    lse_part = torch.empty(b * hkv * splits * block_g, device=q.device, dtype=torch.float32)
    exact = torch.empty_like(q)
    spec = torch.empty_like(q)
    sq = torch.empty(b, hkv, 2, device=q.device, dtype=torch.float32)

    i32 = torch.int32
    partial_kernel[(b, hkv, splits)](
        q, k, v, last_start.to(i32), mid_stop.to(i32), cur_pos.to(i32), cur_pos if start is None else start.to(i32),
        o_part, lse_part,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1), v.stride(2),
        cache_len, scale,
        GROUP=group, HEAD_DIM=dim, WINDOW=window, NUM_SPLITS=splits,
        BLOCK_G=block_g, BLOCK_D=block_d, BLOCK_N=block_n, IEEE=q.dtype == torch.float32,
        HAS_START=start is not None,
    )
    reduce_kernel[(b, hkv)](
        o_part, lse_part, exact, spec, sq,
        GROUP=group, HEAD_DIM=dim, NUM_SPLITS=splits, BLOCK_G=block_g, BLOCK_D=block_d,
    )
    exact = torch.where(trivial[:, None, None], spec, exact)
    d, n = sq.sum(dim=1).sqrt().unbind(dim=1)
    return SpecDecodeOutput(exact, spec, d, n, accept(d, n, lam) | trivial, trivial)
