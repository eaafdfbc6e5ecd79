"""Torch reference of the speculative flash decode kernel.

One decode query per sequence attends to its KV cache. The first and the last
``window`` positions form the first chunk of a flash decode; its partial result
(o, m, l) normalised is the speculative output (attention sink). The remaining
middle positions are processed as one block and merged into that same partial,
so the exact output costs one extra merge and the approximation comes for free.
Verification compares the two in float32.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from ..constants import WINDOW_ALIGNS
from ..semantics import accept, distances, window_bounds, window_positions


class SpecDecodeOutput(NamedTuple):
    """Exact and speculative attention outputs plus the verification verdict."""

    exact: torch.Tensor  # (B, Hq, D), input dtype
    spec: torch.Tensor  # (B, Hq, D), input dtype
    d: torch.Tensor  # (B,) float32, ||spec - exact||_2 over heads and head_dim
    n: torch.Tensor  # (B,) float32, ||exact||_2
    accept: torch.Tensor  # (B,) bool
    trivial: torch.Tensor  # (B,) bool, context fits in the two windows


def check_inputs(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cur_pos: torch.Tensor,
    window: int,
    window_align: int,
    start: torch.Tensor | None = None,
) -> None:
    """Fail early on shapes the kernels cannot interpret (they index blindly)."""
    if q.dim() != 3 or k.dim() != 4 or v.shape != k.shape:
        raise ValueError(f"expected q (B,Hq,D), k/v (B,Hkv,L,D); got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    b, hq, dim = q.shape
    if k.shape[0] != b or k.shape[3] != dim or hq % k.shape[1] != 0:
        raise ValueError(f"q {tuple(q.shape)} does not match k {tuple(k.shape)} (GQA needs Hq % Hkv == 0)")
    if cur_pos.shape != (b,):
        raise ValueError(f"cur_pos must have shape ({b},), got {tuple(cur_pos.shape)}")
    if window < 1:
        raise ValueError(f"window must be >= 1, got {window}")
    if window_align not in WINDOW_ALIGNS:
        raise ValueError(f"window_align must be one of {WINDOW_ALIGNS}, got {window_align}")
    if start is not None:
        if start.shape != (b,) or start.dtype.is_floating_point:
            raise ValueError(f"start must be an integer tensor of shape ({b},), got {start.dtype} {tuple(start.shape)}")
        if bool(((start < 0) | (start > cur_pos.to(start.device))).any()):
            raise ValueError("start must satisfy 0 <= start <= cur_pos (the current token is a real token)")


def resolve_start(
    start: torch.Tensor | None, cur_pos: torch.Tensor
) -> tuple[torch.Tensor | None, torch.Tensor]:
    """(start or None when absent or all zero, logical position cur_pos - start).

    None selects the unshifted path, which needs no extra index arithmetic or
    masks; ``cur_pos`` must already be long on the compute device.
    """
    if start is None:
        return None, cur_pos
    start = start.to(device=cur_pos.device, dtype=torch.long)
    if not bool(start.any()):
        return None, cur_pos
    return start, cur_pos - start


def verify(
    exact: torch.Tensor, spec: torch.Tensor, trivial: torch.Tensor, lam: float | torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """d, n and the decision of each sequence (semantics.distances and semantics.accept); trivial rows accept."""
    d, n = distances(spec, exact)
    return d, n, accept(d, n, lam) | trivial


def partial_math(
    qg: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor | None, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Flash partial of one chunk: normalised output and float32 log-sum-exp.

    qg (B, Hkv, G, D) against k, v (B, Hkv, N, D); ``bias`` (B, 1, 1, N) is 0 or
    -inf. Scores and softmax statistics are float32, the P @ V product runs in
    the input dtype. Rows without a valid key get lse = -inf (a no-op in merges).
    """
    s = torch.matmul(qg, k.transpose(-1, -2)).float() * scale
    if bias is not None:
        s = s + bias
    m = s.amax(dim=-1, keepdim=True)
    m_safe = torch.where(torch.isinf(m), torch.zeros_like(m), m)
    p = torch.exp(s - m_safe)
    l = p.sum(dim=-1, keepdim=True)
    o = torch.matmul(p.to(v.dtype), v).float() / l.clamp(min=torch.finfo(torch.float32).tiny)
    return o.to(qg.dtype), (m_safe + torch.log(l)).squeeze(-1)


def partial_flash_cpu(
    qg: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor | None, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as :func:`partial_math`, through ATen's fused CPU flash kernel.

    The fused kernel never materialises the score row, which is what keeps the
    reference within a few percent of plain SDPA at long context. It reports
    lse = 0 for fully masked rows; those are set to -inf here.
    """
    if bias is not None:
        bias = bias.to(qg.dtype)
    o, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(qg, k, v, attn_mask=bias, scale=scale)
    if bias is not None:
        empty = torch.isinf(bias).all(dim=-1)  # (B, 1, 1)
        lse = lse.masked_fill(empty, float("-inf"))
    return o, lse


def split_flash_cpu(
    qg: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`partial_flash_cpu` of an unmasked block, split along the keys into batch entries.

    ATen's CPU kernel parallelises over batch x heads only; one sequence with 3 KV heads
    leaves threads idle. Viewing the block as ``splits`` sequences (no copy when B = 1) and
    reducing their partials (split-K) keeps every thread busy.
    """
    b, hkv, length, dim = k.shape
    splits = min(8, -(-2 * torch.get_num_threads() // (b * hkv)))
    if b != 1 or splits < 2 or length < 256 * splits:
        return partial_flash_cpu(qg, k, v, None, scale)
    size = length // splits
    body = splits * size
    ks, vs = (t[:, :, :body].reshape(hkv, splits, size, dim).transpose(0, 1) for t in (k, v))
    o, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        qg.expand(splits, -1, -1, -1), ks, vs, scale=scale)
    total = torch.logsumexp(lse, 0, keepdim=True)
    o = (o.float() * torch.exp(lse - total).unsqueeze(-1)).sum(0, keepdim=True).to(qg.dtype)
    if body == length:
        return o, total
    o_tail, lse_tail = partial_flash_cpu(qg, k[:, :, body:], v[:, :, body:], None, scale)
    o, total = merge(o, total, o_tail, lse_tail)
    return o.to(qg.dtype), total


def merge(
    o1: torch.Tensor, lse1: torch.Tensor, o2: torch.Tensor, lse2: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Combine two flash partials (the split-K reduction); lse2 = -inf is a no-op."""
    lse = torch.logaddexp(lse1, lse2)
    w1 = torch.exp(lse1 - lse).unsqueeze(-1)
    w2 = torch.exp(lse2 - lse).unsqueeze(-1)
    o = o1.float() * w1 + torch.where(w2 > 0, o2.float() * w2, torch.zeros_like(w2))
    return o, lse


def _bias(valid: torch.Tensor) -> torch.Tensor:
    """(B, N) validity as an additive (B, 1, 1, N) float32 mask."""
    zero = torch.zeros(valid.shape, dtype=torch.float32, device=valid.device)
    return zero.masked_fill(~valid, float("-inf"))[:, None, None, :]


def speculative_flash_decode(
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
    """Exact and sink attention of one decode query per sequence, sharing work.

    q (B, Hq, D); k, v (B, Hkv, L, D) with positions > cur_pos[b] ignored
    (masked, not zeroed, so they must be finite); cur_pos (B,) physical cache
    index of the current token. ``start`` (B,) is the physical index of each
    sequence's first real token (left padding; None means 0): keys before it are
    never attended (masked, so they too must be finite), and windows and the
    trivial test use logical positions p = cur_pos - start: first window physical
    [start, start + S), last window logical [end - S, end) with end = p + 1 (or
    ceil32(p + 1)), exact attention over physical [start, cur_pos].
    ``chunk_size`` bounds the number of middle keys scored at once (None: the
    whole middle in one block, the fastest on CPU).
    """
    check_inputs(q, k, v, cur_pos, window, window_align, start)
    b, hq, dim = q.shape
    hkv, cache_len = k.shape[1], k.shape[2]
    scale = dim**-0.5 if scale is None else scale
    partial = partial_flash_cpu if q.device.type == "cpu" else partial_math
    cur_pos = cur_pos.to(device=q.device, dtype=torch.long)
    start, pos = resolve_start(start, cur_pos)  # pos: logical position of the current token
    last_start, trivial = window_bounds(pos, window, window_align)

    # GQA without copying K/V: the query heads of one KV head become rows.
    qg = q.reshape(b, hkv, hq // hkv, dim)

    # Chunk 1: the two sink windows, gathered (B, Hkv, 2S, D).
    idx, valid = window_positions(pos, window, window_align)  # logical
    if start is not None:
        idx = idx + start[:, None]  # physical, clipped to the cache
    valid &= idx < cache_len
    gidx = idx.clamp(max=cache_len - 1)[:, None, :, None].expand(b, hkv, 2 * window, dim)
    k_w, v_w = torch.gather(k, 2, gidx), torch.gather(v, 2, gidx)
    if bool(valid.all()):  # the common decode step: nothing to mask, no bias (fewer ops per call)
        o_w, lse = partial(qg, k_w, v_w, None, scale)
    else:
        keep = valid[:, None, :, None]  # zero masked garbage: 0 * inf would poison P @ V
        o_w, lse = partial(qg, k_w.masked_fill(~keep, 0), v_w.masked_fill(~keep, 0), _bias(valid), scale)
    spec = o_w.reshape(b, hq, dim)

    # Remaining chunks: middle keys, logical [S, stop), merged into the same partial.
    mid_stop = torch.minimum(last_start, pos + 1)  # a short aligned window may end past cur_pos
    if start is None:
        row_lo, row_hi = None, mid_stop
        mid_lo, mid_end = window, int(mid_stop.max())
        uniform = bool((mid_stop == mid_end).all())
    else:
        # Physical [start + S, start + stop) per row; rows without a middle don't widen the span.
        # Bounds on the host in one transfer: tiny tensor ops cost more than the lists.
        row_lo, row_hi = start + window, start + mid_stop
        bounds = list(zip(row_lo.tolist(), row_hi.tolist()))
        spans = [(a, z) for a, z in bounds if z > a]
        mid_lo = min((a for a, _ in spans), default=0)
        mid_end = max((z for _, z in spans), default=0)
        # A batch whose rows share start and end (e.g. one sequence) slices without a mask.
        uniform = all(a == mid_lo and z == mid_end for a, z in bounds)
    # All rows trivial (or all middles empty): no chunk at all. An empty key block would
    # crash ATen's fused CPU kernel and a zero step would crash range().
    span = max(mid_end - mid_lo, 0)
    step = max(span if chunk_size is None else int(chunk_size), 1)
    o: torch.Tensor = o_w
    for lo in range(mid_lo, mid_lo + span, step):
        hi = min(lo + step, mid_end)
        if uniform:
            bias = None
        else:
            phys = torch.arange(lo, hi, device=q.device)[None, :]
            keys = phys < row_hi[:, None]
            if row_lo is not None:
                keys &= phys >= row_lo[:, None]
            bias = _bias(keys)
        if bias is None and partial is partial_flash_cpu:
            o_c, lse_c = split_flash_cpu(qg, k[:, :, lo:hi], v[:, :, lo:hi], scale)
        else:
            o_c, lse_c = partial(qg, k[:, :, lo:hi], v[:, :, lo:hi], bias, scale)
        o, lse = merge(o, lse, o_c, lse_c)
    exact = torch.where(trivial[:, None, None], spec, o.to(q.dtype).reshape(b, hq, dim))

    d, n, decision = verify(exact, spec, trivial, lam)
    return SpecDecodeOutput(exact, spec, d, n, decision, trivial)
