"""The speculator of backend=tt: decode steps on the device, decided on the op's own squared norms.

Per layer the KV cache stays on the device (left-aligned rows, length a multiple of S): a new request uploads
it once, each decode step appends its token with ``paged_update_cache``. Rows whose context fits in 2S never
reach the speculative op (it has no valid output there): they take ttnn's exact decode op and count as trivial.
Without the speculative op in the installed ttnn, A and A~ come from the exact decode op (A~ over the 2S window
keys) and d, n from the host in float32. Teacher-forced rows (several queries per call) take the sim path.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

import torch

from ... import semantics
from ...config import SpeculationConfig
from ...kernels import SpecDecodeOutput
from ...speculator import Speculator
from . import contract
from .runtime import TTRuntime

HEADROOM = 512  # positions a resident cache holds beyond its request's current length before it is rebuilt


def left_align(cache: torch.Tensor, pad: torch.Tensor, length: int) -> torch.Tensor:
    """(B, H, L, D) left-padded rows moved to start at index 0 and zero-filled to ``length`` positions: the op
    counts positions from index 0 and has no per-row start."""
    out = cache.new_zeros((*cache.shape[:2], length, cache.shape[3]))
    for b, p in enumerate(pad.tolist()):
        out[b, :, :cache.shape[2] - p] = cache[b, :, p:]
    return out


@dataclass
class _Resident:
    """A layer's KV cache on the device, and what identifies the request it mirrors."""

    k: Any
    v: Any
    pad: list[int]
    length: int  # physical length of the host cache mirrored
    capacity: int
    last_key: torch.Tensor  # (B, Hkv, D) the host's key of the last token mirrored


class TTSpeculator(Speculator):
    """The speculator with the TT device for decode steps."""

    def __init__(self, num_layers: int, skipped_layers: dict[int, str], base_attention: Callable, runtime: TTRuntime,
                 additive_mask: bool = False) -> None:
        super().__init__(num_layers, skipped_layers, base_attention, additive_mask=additive_mask)
        self.runtime = runtime
        self._resident: dict[int, _Resident] = {}

    def has_fused_decode(self) -> bool:
        return True

    def fused_decode(self, layer: int, plan: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     scaling: float) -> SpecDecodeOutput:
        """A decode step's A, A~, d, n and decision for every batch row; query (B, Hq, 1, D), key/value (B, Hkv, L, D)."""
        pad = self.session.on(key.device)[0]
        pos = key.shape[2] - 1 - pad  # logical position of the current token
        lam = self.thresholds(None, layer, key.device)
        return self.decode(layer, query[:, :, 0], key, value, pad, pos, lam, scaling, self.session.config)

    def decode(self, layer: int, q: torch.Tensor, key: torch.Tensor, value: torch.Tensor, pad: torch.Tensor,
               pos: torch.Tensor, lam: float | torch.Tensor, scale: float, config: SpeculationConfig) -> SpecDecodeOutput:
        """A decode step for query ``q`` (B, Hq, D) with ``config``'s window; the decision takes ``lam``, the plan's
        threshold of each row at ``layer``, which is also the op's ``lambda_`` where it is one finite lambda."""
        rt, window = self.runtime, config.window
        batch, heads, dim = q.shape
        trivial = semantics.is_trivial(pos, window)
        if rt.ttlang is not None:  # tt_kernel=ttlang: one kernel for A, A~ and the verification sums
            length = -(-key.shape[2] // contract.TILE) * contract.TILE
            exact, approx, d2, n2 = rt.kernel_decode(q, left_align(key, pad, length), left_align(value, pad, length),
                                                     pos, window, scale)
            return _from_squares(exact.to(q.dtype), approx.to(q.dtype), d2, n2, lam, trivial)
        k_dev, v_dev = self._resident_cache(layer, key, value, pad, pos, window)
        q_dev = rt.upload(q[None], rt.ttnn.bfloat16)  # the ops' [1, B, Hq, D]

        def host(out: Any) -> torch.Tensor:  # [1, B, padded heads, D] -> (B, Hq, D)
            return rt.download(out)[0, :batch, :heads, :dim].to(q.dtype)

        if not rt.has_speculative_op:
            exact = host(rt.sdpa_decode(q_dev, k_dev, v_dev, cur_pos=pos.tolist(), scale=scale, query_heads=heads,
                                        window=window))
            positions, valid = semantics.window_positions(pos, window, contract.TILE)
            index = (positions + pad[:, None]).clamp_max(key.shape[2] - 1)
            rows = torch.arange(batch)[:, None]
            k_w, v_w = (rt.upload(t[rows, :, index].transpose(1, 2), rt.kv_dtype) for t in (key, value))
            approx = host(rt.sdpa_decode(q_dev, k_w, v_w, cur_pos=(valid.sum(1) - 1).tolist(), scale=scale,
                                         query_heads=heads, window=window))
            d, n = semantics.distances(approx, exact)
            return SpecDecodeOutput(exact, approx, d, n, semantics.accept_squared(d * d, n * n, lam) | trivial, trivial)
        # The op's own decision (its priority tensor) is not read: the host decides each row on d^2 and n^2. Where the
        # layer has no single finite lambda (sink's inf, rows of a sweep), the op gets its default.
        op_lambda = lam if isinstance(lam, float) and 0 <= lam < math.inf else contract.DEFAULT_LAMBDA
        if not trivial.any():
            full, spec, d2, n2 = rt.speculative(q_dev, k_dev, v_dev, lam=op_lambda, cur_pos=pos.tolist(), scale=scale,
                                                query_heads=heads, window=window)
            d2, n2 = (rt.download(t).float().flatten()[:batch] for t in (d2, n2))
            return _from_squares(host(full), host(spec), d2, n2, lam, trivial)
        # Some rows fit in 2S: the exact op for all, the speculative op for the others only (their cache uploaded
        # apart, until every row is past 2S).
        exact = host(rt.sdpa_decode(q_dev, k_dev, v_dev, cur_pos=pos.tolist(), scale=scale, query_heads=heads,
                                    window=window))
        approx, d2, n2 = exact.clone(), torch.zeros(batch), torch.ones(batch)
        rows = (~trivial).nonzero().flatten()
        if len(rows):
            capacity = contract.cache_length(int(pos[rows].max()) + 1, window)
            k_sub, v_sub = (rt.upload(left_align(t[rows], pad[rows], capacity), rt.kv_dtype) for t in (key, value))
            full, spec, d2_sub, n2_sub = rt.speculative(rt.upload(q[rows][None], rt.ttnn.bfloat16), k_sub, v_sub,
                                                        lam=op_lambda, cur_pos=pos[rows].tolist(), scale=scale,
                                                        query_heads=heads, window=window)
            sub = len(rows)
            exact[rows] = rt.download(full)[0, :sub, :heads, :dim].to(q.dtype)
            approx[rows] = rt.download(spec)[0, :sub, :heads, :dim].to(q.dtype)
            d2[rows], n2[rows] = (rt.download(t).float().flatten()[:sub] for t in (d2_sub, n2_sub))
        return _from_squares(exact, approx, d2, n2, lam, trivial)

    def _resident_cache(self, layer: int, key: torch.Tensor, value: torch.Tensor, pad: torch.Tensor,
                        pos: torch.Tensor, window: int) -> tuple[Any, Any]:
        """The layer's device cache, with this step's token appended; uploaded whole only for a new request (or
        when it outgrows its capacity)."""
        rt, length = self.runtime, key.shape[2]
        r = self._resident.get(layer)
        continues = (r is not None and r.length + 1 == length and r.pad == pad.tolist()
                     and r.last_key.shape[0] == key.shape[0] and int(pos.max()) < r.capacity
                     and r.capacity % window == 0 and torch.equal(r.last_key, key[:, :, -2]))
        if continues:
            positions = pos.tolist()
            r.k = rt.append(r.k, key[:, :, -1], positions)
            r.v = rt.append(r.v, value[:, :, -1], positions)
        else:
            capacity = contract.cache_length(length + HEADROOM, window)
            r = _Resident(rt.upload(left_align(key, pad, capacity), rt.kv_dtype),
                          rt.upload(left_align(value, pad, capacity), rt.kv_dtype), pad.tolist(), length, capacity,
                          key[:, :, -1].clone())
            self._resident[layer] = r
        r.length, r.last_key = length, key[:, :, -1].clone()
        return r.k, r.v

    def verify(self, approx: torch.Tensor, exact: torch.Tensor,
               lam: float | torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Host-side rows (teacher forcing) decide in the op's squared form too."""
        d, n = semantics.distances(approx, exact)
        return semantics.accept_squared(d * d, n * n, lam), d, n


def _from_squares(exact: torch.Tensor, approx: torch.Tensor, d2: torch.Tensor, n2: torch.Tensor,
                  lam: float | torch.Tensor, trivial: torch.Tensor) -> SpecDecodeOutput:
    """A step decided on the device's own squared distance and norm (d/n reported from them)."""
    accept = semantics.accept_squared(d2, n2, lam) | trivial
    return SpecDecodeOutput(exact, approx, d2.sqrt(), n2.sqrt(), accept, trivial)
