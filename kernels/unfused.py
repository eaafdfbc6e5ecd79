"""Unfused baseline: exact and speculative attention as two separate SDPA calls.

Same contract as the fused kernels, without the shared partial; useful to
cross-check them and to measure what the fusion saves.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..semantics import window_bounds
from .reference import SpecDecodeOutput, check_inputs, resolve_start, verify


def unfused_decode(
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
    """Exact = SDPA over the cache masked to [start, cur_pos]; spec = SDPA over the two windows.

    ``start`` (left padding) as in :func:`.reference.speculative_flash_decode`;
    ``chunk_size`` is accepted for interface parity and unused.
    """
    check_inputs(q, k, v, cur_pos, window, window_align, start)
    b, hq, dim = q.shape
    cache_len = k.shape[2]
    cur_pos = cur_pos.to(device=q.device, dtype=torch.long)
    start, logical = resolve_start(start, cur_pos)
    last_start, trivial = window_bounds(logical, window, window_align)
    pos = torch.arange(cache_len, device=q.device)[None, :]
    in_ctx = pos <= cur_pos[:, None]
    if start is not None:
        in_ctx &= pos >= start[:, None]
        pos = pos - start[:, None]  # logical positions (negative in the padding, masked by in_ctx)
    in_win = (pos < window) | ((pos >= last_start[:, None]) & (pos < last_start[:, None] + window))

    def attend(mask: torch.Tensor) -> torch.Tensor:
        out = F.scaled_dot_product_attention(
            q[:, :, None], k, v, attn_mask=mask[:, None, None, :], scale=scale, enable_gqa=True
        )
        return out[:, :, 0]

    exact = attend(in_ctx)
    spec = torch.where(trivial[:, None, None], exact, attend(in_ctx & in_win))
    d, n, decision = verify(exact, spec, trivial, lam)
    return SpecDecodeOutput(exact, spec, d, n, decision, trivial)
