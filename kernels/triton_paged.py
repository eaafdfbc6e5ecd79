"""Triton speculative flash decode over a paged KV cache, as vLLM's FlashAttention backend keeps it; one launch.

The program of :mod:`.triton_decode` (split-K over the positions, split 0 the speculative chunk, per-head tickets
and a merge in split order, the row's last head deciding), run by :mod:`.triton_paged_source`: the one difference is
where a position's key lives. K and V are (num_blocks, block_size, Hkv, D) each, with strides of their own whose
head_dim is contiguous (views of one combined cache serve as they are); ``block_table`` (B, max_blocks) int32 lists
each row's blocks in order, position p of row b in block ``block_table[b, p // block_size]`` at slot
``p % block_size``. Rows may share blocks (a shared prefix). No left padding: a row's context is positions
0..cur_pos. The geometry (:func:`.triton_decode.prepare`, once per decode pass), scratch and tickets are the
contiguous call's; no read-back, and no copy of the cache.
"""

from __future__ import annotations

import torch

from ..constants import WINDOW_ALIGNS
from .reference import SpecDecodeOutput
from .triton_decode import Geometry, _num_splits, _static, buffers, prepare
from .triton_launch import kernel


def check_paged_inputs(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
                       cur_pos: torch.Tensor, window: int, window_align: int) -> None:
    """Fail early on shapes the kernel cannot interpret (it indexes blindly). Positions are not read back: keys
    past the table's capacity are never read."""
    if q.dim() != 3 or k_cache.dim() != 4 or v_cache.shape != k_cache.shape:
        raise ValueError(f"expected q (B,Hq,D), k_cache/v_cache (num_blocks,block_size,Hkv,D); got {tuple(q.shape)}, "
                         f"{tuple(k_cache.shape)}, {tuple(v_cache.shape)}")
    b, hq, dim = q.shape
    if k_cache.shape[3] != dim or hq % k_cache.shape[2] != 0:
        raise ValueError(f"q {tuple(q.shape)} does not match the cache {tuple(k_cache.shape)} (GQA needs Hq % Hkv == 0)")
    if k_cache.stride(3) != 1 or v_cache.stride(3) != 1:
        raise ValueError("the caches' head_dim must be contiguous (stride 1): the kernel reads a key's row at once")
    if block_table.dim() != 2 or block_table.shape[0] != b or block_table.dtype != torch.int32:
        raise ValueError(f"block_table must be int32 (B={b}, max_blocks), got {block_table.dtype} "
                         f"{tuple(block_table.shape)}")
    if cur_pos.shape != (b,):
        raise ValueError(f"cur_pos must have shape ({b},), got {tuple(cur_pos.shape)}")
    if window < 1:
        raise ValueError(f"window must be >= 1, got {window}")
    if window_align not in WINDOW_ALIGNS:
        raise ValueError(f"window_align must be one of {WINDOW_ALIGNS}, got {window_align}")


def speculative_flash_decode_paged(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    cur_pos: torch.Tensor,
    window: int,
    lam: float | torch.Tensor,
    window_align: int = 1,
    scale: float | None = None,
    *,
    chunk_size: int | None = None,
    geometry: Geometry | None = None,
) -> SpecDecodeOutput:
    """:func:`.triton_decode.speculative_flash_decode_triton`'s outputs for the cache the block table describes;
    ``cur_pos`` (B,) is each row's query position (logical, from 0), ``chunk_size`` BLOCK_N, ``geometry``
    :func:`.triton_decode.prepare` of ``cur_pos``, ``window`` and ``window_align`` (computed and the inputs checked
    here when absent)."""
    if geometry is None:
        check_paged_inputs(q, k_cache, v_cache, block_table, cur_pos, window, window_align)
        geometry = prepare(cur_pos.to(q.device), window, window_align)
    b, hq, dim = q.shape
    page, hkv = k_cache.shape[1], k_cache.shape[2]
    capacity = block_table.shape[1] * page  # positions the table can hold: the kernel reads none past it
    per_row = isinstance(lam, torch.Tensor)
    static = _static(q.dtype, hq, hkv, dim, chunk_size)
    q = q.contiguous()
    if block_table.stride(1) != 1:
        block_table = block_table.contiguous()
    splits = _num_splits(b * hkv, capacity - window, static.block_n, q.device)
    scratch, tickets, outputs, norms, decision = buffers(q, hkv, splits)
    if per_row:
        lam = lam.to(device=q.device, dtype=torch.float32).contiguous()  # the kernel reads row b at lam_ptr + b
    kernel("paged")[(b, hkv, splits)](
        q, k_cache, v_cache, block_table, geometry.packed, scratch, tickets, outputs, lam if per_row else norms,
        0.0 if per_row else float(lam), norms, decision, k_cache.stride(0), k_cache.stride(2), k_cache.stride(1),
        v_cache.stride(0), v_cache.stride(2), v_cache.stride(1), block_table.stride(0), capacity,
        dim**-0.5 if scale is None else scale, window, splits, hq // hkv, int(per_row), **static.constants, PAGE=page,
        **static.settings,
    )
    exact, spec = outputs.unbind()
    d, n = norms.unbind()
    return SpecDecodeOutput(exact, spec, d, n, decision, geometry.trivial)
