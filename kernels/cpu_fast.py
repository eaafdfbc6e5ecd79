"""The CPU fast path of the speculative decode, for the common step: every sequence at the same position, no left
padding. Tested against :mod:`.reference`, which stays the readable definition.

On the CPU, ATen's fused SDPA kernel is the fastest exact decode there is, and the split into a window chunk and
merged middle chunks that the reference spells out costs a few dozen small ops per call. Here the exact output is
one grouped-query SDPA over the uncopied cache (the query heads of a KV head as rows of one (B, Hkv, G, D) query,
the cache sliced, not masked) and A~ one over the 2S window keys (copied: 2S rows); the approximation adds
2S / L of the work, verification a few norms.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..semantics import window_bounds
from .reference import SpecDecodeOutput, check_inputs, resolve_start, verify


def applies(q: torch.Tensor, cur_pos: torch.Tensor, start: torch.Tensor | None) -> bool:
    """Whether the fast path covers this call: CPU, no left padding, one position for the whole batch."""
    if q.device.type != "cpu" or (start is not None and bool(start.any())):
        return False
    return bool((cur_pos == cur_pos[0]).all())


def speculative_decode_cpu(
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
    """Same contract as :func:`.reference.speculative_flash_decode` where :func:`applies`; ``chunk_size`` unused."""
    check_inputs(q, k, v, cur_pos, window, window_align, start)
    b, hq, dim = q.shape
    hkv = k.shape[1]
    cur_pos = cur_pos.to(dtype=torch.long)
    _, pos = resolve_start(start, cur_pos)
    last_start, trivial = window_bounds(pos[:1], window, window_align)
    length = int(pos[0]) + 1
    qg = q.view(b, hkv, hq // hkv, dim)
    exact = F.scaled_dot_product_attention(qg, k[:, :, :length], v[:, :, :length], scale=scale)
    if bool(trivial[0]):
        spec = exact
    else:
        first, last = int(last_start[0]), min(int(last_start[0]) + window, length)  # aligned windows stop at pos
        keys = torch.cat([k[:, :, :window], k[:, :, first:last]], dim=2)
        values = torch.cat([v[:, :, :window], v[:, :, first:last]], dim=2)
        spec = F.scaled_dot_product_attention(qg, keys, values, scale=scale)
    exact, spec = exact.reshape(b, hq, dim), spec.reshape(b, hq, dim)
    trivial = trivial.expand(b)
    d, n, decision = verify(exact, spec, trivial, lam)
    return SpecDecodeOutput(exact, spec, d, n, decision, trivial)
