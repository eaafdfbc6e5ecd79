"""Independent oracle for the kernel tests: per-sequence SDPA over explicit position lists."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def window_positions(pos: int, window: int, align: int) -> list[int]:
    """Positions the approximation attends to, written out from the spec (no shared code)."""
    ctx = pos + 1
    if ctx <= 2 * window:
        return list(range(ctx))
    end = ctx if align == 1 else -(-ctx // 32) * 32
    return list(range(window)) + [p for p in range(end - window, end) if p <= pos]


def sdpa_over(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: list[list[int]]) -> torch.Tensor:
    """Attention of q[b] over k[b, :, positions[b]] in float32, one SDPA call per sequence."""
    out = []
    for b, idx in enumerate(positions):
        i = torch.tensor(idx)
        o = F.scaled_dot_product_attention(
            q[b, :, None].float()[None], k[b][:, i].float()[None], v[b][:, i].float()[None], enable_gqa=True
        )
        out.append(o[0, :, 0])
    return torch.stack(out)


def make_inputs(
    batch: int, hq: int, hkv: int, length: int, dim: int, cur_pos: list[int], dtype: torch.dtype = torch.float32, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random q, k, v with large finite garbage after each cur_pos (it must be ignored)."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, hq, dim, generator=g)
    k = torch.randn(batch, hkv, length, dim, generator=g)
    v = torch.randn(batch, hkv, length, dim, generator=g)
    for b, p in enumerate(cur_pos):
        k[b, :, p + 1 :] = 300.0
        v[b, :, p + 1 :] = -1e4
    return q.to(dtype), k.to(dtype), v.to(dtype), torch.tensor(cur_pos)
