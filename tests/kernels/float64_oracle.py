"""Independent float64 oracle for one speculative attention decode step.

Written from docs/design.md (Semantics 2-4) alone, without reading the kernels or their
other oracles. Positions are logical: pos = cur_pos - start counts from the row's first
real token; left padding (physical indices < start) is never attended to.
"""

from __future__ import annotations

import math

import torch


def _ceil32(x: int) -> int:
    return -(-x // 32) * 32


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, idx: list[int], scale: float) -> torch.Tensor:
    """Softmax attention of one query (D,) over the listed cache rows of k, v (L, D)."""
    keys, vals = k[idx], v[idx]
    scores = (keys @ q) * scale
    w = torch.exp(scores - scores.max())
    return (w / w.sum()) @ vals


def _window_positions(pos: int, window: int, window_align: int) -> list[int]:
    """Logical positions in A~ for a non-trivial row: first S, plus the last S (Semantics 2)."""
    end = pos + 1 if window_align == 1 else _ceil32(pos + 1)
    last = range(max(end - window, 0), min(end, pos + 1))  # positions after pos are masked
    return sorted(set(range(window)) | set(last))


def decode_step_float64(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cur_pos: list[int], start: list[int],
    window: int, window_align: int, lam: float | list[float], scale: float | None = None,
) -> dict:
    """q: (B, Hq, D); k, v: (B, Hkv, L, D) cache, physical indices; query head h uses kv head h // G.
    cur_pos: physical index of each row's current token; start: physical index of its first real token.
    Returns exact, spec (B, Hq, D), d, n (B,) as float64 tensors; trivial, accept as lists of bool."""
    assert window_align in (1, 32)
    q, k, v = q.double(), k.double(), v.double()
    B, Hq, D = q.shape
    G = Hq // k.shape[1]
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    lams = lam if isinstance(lam, (list, tuple)) else [lam] * B
    exact, spec = torch.zeros_like(q), torch.zeros_like(q)
    d, n = torch.zeros(B, dtype=torch.float64), torch.zeros(B, dtype=torch.float64)
    trivial: list[bool] = []
    accept: list[bool] = []
    for b in range(B):
        pos = cur_pos[b] - start[b]
        full = list(range(start[b], cur_pos[b] + 1))
        is_trivial = pos + 1 <= 2 * window  # Semantics 3: context fits in 2S, A~ = A
        approx = full if is_trivial else [start[b] + p for p in _window_positions(pos, window, window_align)]
        for h in range(Hq):
            exact[b, h] = _attend(q[b, h], k[b, h // G], v[b, h // G], full, scale)
            spec[b, h] = exact[b, h] if is_trivial else _attend(q[b, h], k[b, h // G], v[b, h // G], approx, scale)
        d[b] = torch.linalg.vector_norm(spec[b] - exact[b])  # over all heads and head_dim
        n[b] = torch.linalg.vector_norm(exact[b])
        trivial.append(is_trivial)
        accept.append(is_trivial or math.isinf(lams[b]) or bool(d[b] <= lams[b] * n[b]))
    return {"exact": exact, "spec": spec, "d": d, "n": n, "trivial": trivial, "accept": accept}


def decisions_away_from_boundary(
    d: torch.Tensor, n: torch.Tensor, lam: float | list[float], margin: float,
) -> list[int]:
    """Row indices where |d - lam * n| > margin * n, so rounding cannot flip the decision."""
    lams = lam if isinstance(lam, (list, tuple)) else [lam] * len(d)
    return [b for b in range(len(d)) if abs(float(d[b]) - lams[b] * float(n[b])) > margin * float(n[b])]
