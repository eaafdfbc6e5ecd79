"""Triton speculative flash decode (split-K over the sequence), one launch per call.

Program (b, kv head, split) computes a flash partial for all query heads of one KV head. Split 0 is the speculative
chunk (first and last S positions), so its partial, normalised, is the approximation; splits 1.. cover the middle.
The last split of each (row, KV head) to finish merges that head's partials into the exact output, and the last
head of each row verifies: d, n and the decision (:mod:`.triton_source`). The merges run in parallel, one per
(row, KV head), and in a fixed order, so the outputs are the same bits run to run.

Host work per call is kept small, since a decode step calls it once per layer: what depends only on the model's
shape is computed once (:func:`_static`), the partials' scratch is reused across calls (one stream at a time, as a
model's forward runs), the outputs come from three allocations, and what the layers of one decode pass share (window
bounds, trivial rows, int32 positions) comes once per pass from :func:`prepare`. No read-back.

Triton is imported lazily: this module imports without it, and calling the kernel without it raises a clear error.
Set TRITON_INTERPRET=1 before the first call to run on the CPU through Triton's interpreter (how CI tests it).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import NamedTuple

import torch

from ..semantics import window_bounds
from .reference import SpecDecodeOutput, check_inputs
from .triton_launch import constexprs, kernel, launch_for


@functools.lru_cache(maxsize=None)
def _processors(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4


SPLIT_BLOCKS = 4  # the fewest key blocks a middle split streams: fewer splits leave the merge fewer partials
SPLIT_WAVES = 2  # programs per processor the middle splits aim at: more, the shorter the last wave's tail


def _num_splits(batch_heads: int, max_mid: int, block_n: int, device: torch.device) -> int:
    """Speculative split plus enough middle splits to fill the GPU (a couple of waves), each of at least
    ``SPLIT_BLOCKS`` blocks. ``max_mid`` bounds the middle from the cache's length (no read-back of the positions);
    splits past a row's middle stay empty."""
    if max_mid <= 0:
        return 2  # keep one (empty) middle split so the grid shape is stable
    want = max(1, math.ceil(SPLIT_WAVES * _processors(device) / batch_heads))
    return 1 + min(want, math.ceil(max_mid / (block_n * SPLIT_BLOCKS)))


class Geometry(NamedTuple):
    """One decode pass's windows, shared by its layers: ``packed`` (5, B) int32 rows last_start, mid_stop, cur_pos
    (logical, counted from each row's first real token), start (each row's first real token, physical) and trivial,
    as the kernel reads them; ``trivial`` (B,) bool, as the caller reads it."""

    packed: torch.Tensor
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
    packed = torch.stack([last_start, mid_stop, logical, start, trivial.long()]).to(torch.int32)
    return Geometry(packed, trivial)


@dataclasses.dataclass(frozen=True)
class _Static:
    """What a call needs that depends only on the model's shape and the lambda's kind."""

    block_n: int
    constants: dict
    settings: dict


@functools.lru_cache(maxsize=256)
def _static(dtype: torch.dtype, hq: int, hkv: int, dim: int, chunk_size: int | None) -> _Static:
    launch = launch_for(dtype, dim)
    if chunk_size:
        if chunk_size < 16 or chunk_size & (chunk_size - 1):
            raise ValueError(f"chunk_size (BLOCK_N) must be a power of two >= 16 for tl.dot, got {chunk_size}")
        launch = dataclasses.replace(launch, block_n=chunk_size)
    return _Static(launch.block_n, constexprs(dtype, hq // hkv, dim, launch),
                   {"num_stages": launch.num_stages, "num_warps": launch.num_warps})


class _Scratch:
    """The partials and tickets of one device, grown as needed and reused by every call: a call's partials are
    written and merged within its own launch, and its tickets return to zero when it ends."""

    def __init__(self) -> None:
        self.floats: dict[torch.device, torch.Tensor] = {}
        self.tickets: dict[torch.device, torch.Tensor] = {}

    def get(self, device: torch.device, floats: int, tickets: int) -> tuple[torch.Tensor, torch.Tensor]:
        if device not in self.floats or self.floats[device].numel() < floats:
            self.floats[device] = torch.empty(max(floats, 2 * self.floats.get(device, torch.empty(0)).numel()),
                                              device=device, dtype=torch.float32)
        if device not in self.tickets or self.tickets[device].numel() < tickets:
            self.tickets[device] = torch.zeros(2 * tickets, device=device, dtype=torch.int32)
        return self.floats[device], self.tickets[device]


_scratch = _Scratch()


def buffers(q: torch.Tensor, hkv: int, splits: int) -> tuple[torch.Tensor, ...]:
    """A launch's buffers, laid out as the kernel reads them (:mod:`.triton_source`): the reused scratch (partials,
    their log-sum-exps, each head's squared sums) and tickets, then the outputs (A, then A~), norms (d, then n) and
    decisions of this call."""
    b, hq, dim = q.shape
    parts = b * hkv * splits
    scratch, tickets = _scratch.get(q.device, parts * (hq // hkv) * (dim + 1) + 2 * b * hkv, b * hkv + b)
    outputs = torch.empty((2, b, hq, dim), device=q.device, dtype=q.dtype)
    norms = torch.empty((2, b), device=q.device, dtype=torch.float32)
    decision = torch.empty(b, device=q.device, dtype=torch.bool)
    return scratch, tickets, outputs, norms, decision


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
    b, hq, dim = q.shape
    hkv, cache_len = k.shape[1], k.shape[2]
    device = q.device
    per_row = isinstance(lam, torch.Tensor)
    static = _static(q.dtype, hq, hkv, dim, chunk_size)
    q = q.contiguous()
    if k.stride(3) != 1 or v.stride() != k.stride():  # one set of strides serves both
        k, v = k.contiguous(), v.contiguous()
    splits = _num_splits(b * hkv, cache_len - window, static.block_n, device)
    scratch, tickets, outputs, norms, decision = buffers(q, hkv, splits)
    if per_row:
        lam = lam.to(device=device, dtype=torch.float32).contiguous()  # the kernel reads row b at lam_ptr + b
    kernel()[(b, hkv, splits)](
        q, k, v, geometry.packed, scratch, tickets, outputs, lam if per_row else norms, 0.0 if per_row else float(lam),
        norms, decision, k.stride(0), k.stride(1), k.stride(2), cache_len, dim**-0.5 if scale is None else scale,
        window, splits, hq // hkv, int(per_row), **static.constants, **static.settings,
    )
    exact, spec = outputs.unbind()
    d, n = norms.unbind()
    return SpecDecodeOutput(exact, spec, d, n, decision, geometry.trivial)


speculative_flash_decode_triton.prepare = prepare  # type: ignore[attr-defined]  # see registry.DecodeKernel
