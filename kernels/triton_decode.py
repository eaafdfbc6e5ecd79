"""Triton speculative flash decode (split-K over the sequence).

Program (b, kv head, split) computes a flash partial for all query heads of
one KV head. Split 0 is the speculative chunk (first and last S positions), so
its partial, normalised, is the approximation; splits 1.. cover the middle.
One reduction program per sequence merges each KV head's partials into the
exact output, writes both outputs, and verifies: d, n and the decision.

Two launches per call and no read-back: the grid comes from shapes the host
knows, and what the layers of one decode pass share (window bounds, trivial
rows, int32 positions) comes once per pass from :func:`prepare`.

Triton is imported lazily: this module imports without it, and calling the
kernel without it raises a clear error. Set TRITON_INTERPRET=1 before the first
call to run on the CPU through Triton's interpreter (how CI tests it).
"""

from __future__ import annotations

import functools
import math
from typing import Any, NamedTuple

import torch

from ..semantics import window_bounds
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
        o_ptr, lse_ptr, exact_ptr, spec_ptr, trivial_ptr, lam_ptr, lam, d_ptr, n_ptr, accept_ptr,
        HKV: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, NUM_SPLITS: tl.constexpr,
        BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr, LAM_PER_ROW: tl.constexpr,
    ):
        b = tl.program_id(0)
        offs_g = tl.arange(0, BLOCK_G)
        offs_d = tl.arange(0, BLOCK_D)
        mask = (offs_g < GROUP)[:, None] & (offs_d < HEAD_DIM)[None, :]
        tile = offs_g[:, None] * BLOCK_D + offs_d[None, :]
        trivial = tl.load(trivial_ptr + b)
        d2 = 0.0
        n2 = 0.0
        for h in range(HKV):
            base = (b * HKV + h) * NUM_SPLITS
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
            acc = tl.where(trivial, spec, acc)  # a trivial context: A~ is A, bit for bit

            out = (b * HKV + h) * GROUP * HEAD_DIM + offs_g[:, None] * HEAD_DIM + offs_d[None, :]
            tl.store(spec_ptr + out, spec.to(spec_ptr.dtype.element_ty), mask=mask)
            tl.store(exact_ptr + out, acc.to(exact_ptr.dtype.element_ty), mask=mask)
            # Verification on the rounded outputs, as the caller sees them.
            e = tl.where(mask, acc.to(exact_ptr.dtype.element_ty).to(tl.float32), 0.0)
            sp = tl.where(mask, spec.to(spec_ptr.dtype.element_ty).to(tl.float32), 0.0)
            diff = sp - e
            d2 += tl.sum(tl.sum(diff * diff, axis=1), axis=0)
            n2 += tl.sum(tl.sum(e * e, axis=1), axis=0)
        # semantics.accept in float32: d <= lambda n, lambda = inf accepting all; trivial rows accept
        d = tl.sqrt_rn(d2)
        n = tl.sqrt_rn(n2)
        if LAM_PER_ROW:
            lam = tl.load(lam_ptr + b)
        tl.store(d_ptr + b, d)
        tl.store(n_ptr + b, n)
        tl.store(accept_ptr + b, (d <= lam * n) | (lam == float("inf")) | trivial)

    return partial_kernel, reduce_kernel


def _next_pow2(x: int) -> int:
    return 1 << max(x - 1, 0).bit_length()


@functools.lru_cache(maxsize=None)
def _processors(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4


def _num_splits(batch_heads: int, max_mid: int, block_n: int, device: torch.device) -> int:
    """Speculative split plus enough middle splits to fill the GPU (a couple of waves). ``max_mid`` bounds the
    middle from the cache's length (no read-back of the positions); splits past a row's middle stay empty."""
    if max_mid <= 0:
        return 2  # keep one (empty) middle split so the grid shape is stable
    want = max(1, math.ceil(2 * _processors(device) / batch_heads))
    return 1 + min(want, math.ceil(max_mid / block_n))


class Geometry(NamedTuple):
    """One decode pass's windows, shared by its layers: the kernel's int32 positions (logical, counted from each
    row's first real token) and the trivial rows."""

    last_start: torch.Tensor
    mid_stop: torch.Tensor
    cur_pos: torch.Tensor
    start: torch.Tensor | None  # left padding; None where no row has any
    trivial: torch.Tensor


def prepare(cur_pos: torch.Tensor, window: int, window_align: int = 1,
            start: torch.Tensor | None = None) -> Geometry:
    """The geometry of :func:`speculative_flash_decode_triton` for ``cur_pos`` (physical) and ``start``: computed
    once per decode pass (its layers share it) instead of once per layer."""
    cur_pos = cur_pos.to(dtype=torch.long)
    start, cur_pos = resolve_start(start, cur_pos)  # from here on cur_pos is logical
    last_start, trivial = window_bounds(cur_pos, window, window_align)
    mid_stop = torch.where(trivial, torch.full_like(last_start, window), torch.minimum(last_start, cur_pos + 1))
    i32 = torch.int32
    return Geometry(last_start.to(i32), mid_stop.to(i32), cur_pos.to(i32), None if start is None else start.to(i32),
                    trivial)


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
    geometry: Geometry | None = None,
) -> SpecDecodeOutput:
    """Same contract as :func:`reference.speculative_flash_decode` (``start`` included); ``chunk_size`` is BLOCK_N.
    ``geometry``: :func:`prepare` of these ``cur_pos``, ``window``, ``window_align`` and ``start``, which the layers
    of a decode pass share (computed and the inputs checked here when absent)."""
    if geometry is None:
        check_inputs(q, k, v, cur_pos, window, window_align, start)
        geometry = prepare(cur_pos.to(q.device), window, window_align, start)
    partial_kernel, reduce_kernel = _kernels()
    b, hq, dim = q.shape
    hkv, cache_len = k.shape[1], k.shape[2]
    group = hq // hkv
    scale = dim**-0.5 if scale is None else scale
    q = q.contiguous()
    if k.stride(3) != 1 or v.stride(3) != 1:
        k, v = k.contiguous(), v.contiguous()

    block_g = max(16, _next_pow2(group))
    block_d = max(16, _next_pow2(dim))
    block_n = chunk_size or 64
    if block_n < 16 or block_n & (block_n - 1):
        raise ValueError(f"chunk_size (BLOCK_N) must be a power of two >= 16 for tl.dot, got {block_n}")
    splits = _num_splits(b * hkv, cache_len - window, block_n, q.device)
    o_part = torch.empty(b * hkv * splits * block_g, block_d, device=q.device, dtype=torch.float32)
    lse_part = torch.empty(b * hkv * splits * block_g, device=q.device, dtype=torch.float32)
    exact = torch.empty_like(q)
    spec = torch.empty_like(q)
    d, n = torch.empty(2, b, device=q.device, dtype=torch.float32)
    decision = torch.empty(b, device=q.device, dtype=torch.bool)
    per_row = isinstance(lam, torch.Tensor)
    if per_row:
        lam = lam.to(device=q.device, dtype=torch.float32)

    g = geometry
    partial_kernel[(b, hkv, splits)](
        q, k, v, g.last_start, g.mid_stop, g.cur_pos, g.cur_pos if g.start is None else g.start,
        o_part, lse_part,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1), v.stride(2),
        cache_len, scale,
        GROUP=group, HEAD_DIM=dim, WINDOW=window, NUM_SPLITS=splits,
        BLOCK_G=block_g, BLOCK_D=block_d, BLOCK_N=block_n, IEEE=q.dtype == torch.float32,
        HAS_START=g.start is not None,
    )
    reduce_kernel[(b,)](
        o_part, lse_part, exact, spec, g.trivial, lam if per_row else d, 0.0 if per_row else float(lam), d, n, decision,
        HKV=hkv, GROUP=group, HEAD_DIM=dim, NUM_SPLITS=splits, BLOCK_G=block_g, BLOCK_D=block_d,
        LAM_PER_ROW=per_row,
    )
    return SpecDecodeOutput(exact, spec, d, n, decision, g.trivial)


speculative_flash_decode_triton.prepare = prepare  # type: ignore[attr-defined]  # see registry.DecodeKernel
