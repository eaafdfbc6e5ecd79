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

from .. import semantics
from .reference import SpecDecodeOutput, check_inputs


def applies(q: torch.Tensor, cur_pos: torch.Tensor, start: torch.Tensor | None) -> bool:
    """Whether the fast path covers this call: CPU, no left padding, one position for the whole batch."""
    if q.device.type != "cpu" or (start is not None and bool(start.any())):
        return False
    return len(cur_pos) == 1 or bool((cur_pos == cur_pos[0]).all())


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
    """Same contract as :func:`.reference.speculative_flash_decode` where :func:`applies`; ``chunk_size`` unused.
    The window geometry is :mod:`alspec_eval.semantics`' on the one position, as Python integers (no small ops)."""
    check_inputs(q, k, v, cur_pos, window, window_align, start)
    b, hq, dim = q.shape
    hkv = k.shape[1]
    pos = int(cur_pos[0])
    trivial = bool(semantics.is_trivial(pos, window))
    qg = q.view(b, hkv, hq // hkv, dim)
    exact = F.scaled_dot_product_attention(qg, k[:, :, :pos + 1], v[:, :, :pos + 1], scale=scale).view(b, hq, dim)
    if trivial:
        spec = exact
    else:
        first = semantics.last_window_end(pos, window_align) - window
        last = min(first + window, pos + 1)  # an aligned last window stops at the current token
        keys = torch.cat([k[:, :, :window], k[:, :, first:last]], dim=2)
        values = torch.cat([v[:, :, :window], v[:, :, first:last]], dim=2)
        spec = F.scaled_dot_product_attention(qg, keys, values, scale=scale).view(b, hq, dim)
    d, n = semantics.distances(spec, exact)
    flags = torch.full((b,), trivial)
    decision = flags if trivial else semantics.accept(d, n, lam)
    return SpecDecodeOutput(exact, spec, d, n, decision, flags)
