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


def padded_oracle(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cur_pos: list[int], start: list[int], window: int, align: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(exact, spec) of left-padded rows from the definition: cut each row's real tokens out
    of the cache (physical [start, cur_pos]) and attend over them as an unpadded sequence."""
    exact, spec = [], []
    for b, (p, s) in enumerate(zip(cur_pos, start)):
        qb, kb, vb = q[b : b + 1], k[b : b + 1, :, s : p + 1], v[b : b + 1, :, s : p + 1]
        exact.append(sdpa_over(qb, kb, vb, [list(range(p - s + 1))]))
        spec.append(sdpa_over(qb, kb, vb, [window_positions(p - s, window, align)]))
    return torch.cat(exact), torch.cat(spec)


def fill_padding(k: torch.Tensor, v: torch.Tensor, start: list[int], seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Copies of k, v with large finite random garbage (seeded) before each row's start."""
    g = torch.Generator().manual_seed(seed)
    k, v = k.clone(), v.clone()
    for b, s in enumerate(start):
        shape = (k.shape[1], s, k.shape[3])
        k[b, :, :s] = (torch.rand(shape, generator=g) * 600 - 300).to(k.dtype)  # scores far above the real ones
        v[b, :, :s] = (torch.rand(shape, generator=g) * 2e4 - 1e4).to(v.dtype)
    return k, v


def make_inputs(
    batch: int,
    hq: int,
    hkv: int,
    length: int,
    dim: int,
    cur_pos: list[int],
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    start: list[int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random q, k, v with large finite garbage after each cur_pos (it must be ignored).

    With ``start`` the positions before start[b] (left padding) get random large
    finite garbage too (:func:`fill_padding` with the same seed).
    """
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, hq, dim, generator=g)
    k = torch.randn(batch, hkv, length, dim, generator=g)
    v = torch.randn(batch, hkv, length, dim, generator=g)
    for b, p in enumerate(cur_pos):
        k[b, :, p + 1 :] = 300.0
        v[b, :, p + 1 :] = -1e4
    if start is not None:
        k, v = fill_padding(k, v, start, seed)
    return q.to(dtype), k.to(dtype), v.to(dtype), torch.tensor(cur_pos)
