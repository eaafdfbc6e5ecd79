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

import dataclasses
import functools
import importlib
import math
from typing import Any, NamedTuple

import torch

from ..semantics import window_bounds
from .reference import SpecDecodeOutput, check_inputs
from .triton_launch import constexprs, launch_for


@functools.lru_cache(maxsize=None)
def _kernels() -> tuple[Any, Any]:
    """The two jitted kernels, built on first use (triton decides interpret mode when they are)."""
    try:
        triton_source = importlib.import_module(".triton_source", __package__)
    except ImportError as err:  # pragma: no cover - depends on the environment
        raise RuntimeError(
            "kernel=triton needs the `triton` package (pip install triton, or alspec-eval[triton]); "
            "use kernel=torch for the reference implementation"
        ) from err
    return triton_source.partial_kernel, triton_source.reduce_kernel


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
    row's first real token), each row's first real token (physical) and the trivial rows."""

    last_start: torch.Tensor
    mid_stop: torch.Tensor
    cur_pos: torch.Tensor
    start: torch.Tensor
    trivial: torch.Tensor


def prepare(cur_pos: torch.Tensor, window: int, window_align: int = 1,
            start: torch.Tensor | None = None) -> Geometry:
    """The geometry of :func:`speculative_flash_decode_triton` for ``cur_pos`` (physical) and ``start``: computed
    once per decode pass (its layers share it) instead of once per layer, with no read-back."""
    cur_pos = cur_pos.to(dtype=torch.long)
    start = torch.zeros_like(cur_pos) if start is None else start.to(device=cur_pos.device, dtype=torch.long)
    logical = cur_pos - start
    last_start, trivial = window_bounds(logical, window, window_align)
    mid_stop = torch.where(trivial, torch.full_like(last_start, window), torch.minimum(last_start, logical + 1))
    i32 = torch.int32
    return Geometry(last_start.to(i32), mid_stop.to(i32), logical.to(i32), start.to(i32), trivial)


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

    per_row = isinstance(lam, torch.Tensor)
    launch = launch_for(q.dtype, dim)
    if chunk_size:
        if chunk_size < 16 or chunk_size & (chunk_size - 1):
            raise ValueError(f"chunk_size (BLOCK_N) must be a power of two >= 16 for tl.dot, got {chunk_size}")
        launch = dataclasses.replace(launch, block_n=chunk_size)
    constants = constexprs(q.dtype, group, dim, per_row, launch)
    block_g, block_d = constants["partial"]["BLOCK_G"], constants["partial"]["BLOCK_D"]
    splits = _num_splits(b * hkv, cache_len - window, launch.block_n, q.device)
    o_part = torch.empty(b * hkv * splits * block_g, block_d, device=q.device, dtype=torch.float32)
    lse_part = torch.empty(b * hkv * splits * block_g, device=q.device, dtype=torch.float32)
    exact = torch.empty_like(q)
    spec = torch.empty_like(q)
    d, n = torch.empty(2, b, device=q.device, dtype=torch.float32)
    decision = torch.empty(b, device=q.device, dtype=torch.bool)
    if per_row:
        lam = lam.to(device=q.device, dtype=torch.float32).contiguous()  # the kernel reads row b at lam_ptr + b

    g = geometry
    settings = {"num_stages": launch.num_stages, "num_warps": launch.num_warps}
    partial_kernel[(b, hkv, splits)](
        q, k, v, g.last_start, g.mid_stop, g.cur_pos, g.start, o_part, lse_part,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1), v.stride(2),
        cache_len, scale, group, dim, window, splits, **constants["partial"], **settings,
    )
    reduce_kernel[(b,)](
        o_part, lse_part, exact, spec, g.trivial, lam if per_row else d, 0.0 if per_row else float(lam), d, n, decision,
        hkv, group, dim, splits, **constants["reduce"], **settings,
    )
    return SpecDecodeOutput(exact, spec, d, n, decision, g.trivial)


speculative_flash_decode_triton.prepare = prepare  # type: ignore[attr-defined]  # see registry.DecodeKernel
