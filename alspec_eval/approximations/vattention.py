"""vAttention (Desai et al., "vAttention: Verified Sparse Attention", 2026): sinks, the local keys and the top scores
attended exactly, the rest estimated from a random sample weighted by the inverse of its sampling probability, its
size chosen per KV head and query from a base sample's spread (the central limit theorem) so that the softmax
denominator's relative error stays within ``epsilon`` with probability 1 - ``delta``. A weighted draft: docs/design.md,
"vAttention: a weighted draft", is its rule, step by step; this module follows it.

Its draws are a hash of (seed, request seed, layer, position, KV head, key), so every engine, device and
tensor-parallel rank samples alike without a generator.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from statistics import NormalDist

import torch

from .. import semantics
from ..errors import ConfigError
from .base import Approximation, Promise, Selected, Site

MASK32 = 0xFFFFFFFF
UNDRAWN = 1 << 33  # the priority of a key outside the rest R: after every drawn key


@dataclass(frozen=True)
class VAttention(Approximation):
    epsilon: float = field(default=0.1, metadata={"short": "e", "label": "ε"})
    delta: float = field(default=0.1, metadata={"short": "d", "label": "δ"})
    base_rate: float = field(default=0.05, metadata={"short": "b", "label": "base"})
    sink: int = field(default=4, metadata={"short": "s"})
    local: int = field(default=32, metadata={"short": "l"})
    top: int = field(default=32, metadata={"short": "t"})
    seed: int = field(default=0, metadata={"short": "seed"})

    description = ("vAttention: {sink} sinks, the last {local} keys, the top {top} scores and a weighted sample "
                   "within epsilon={epsilon} at delta={delta}")
    marker, colour = "X", "tab:cyan"
    oracle = True  # it reads every score (its top keys, its budget)
    weighted = True
    draws = True

    def check(self, window: int) -> None:
        bad = [(name, value, rule, example) for name, value, ok, rule, example in (
            ("epsilon", self.epsilon, 0 < self.epsilon < 1, "0 < epsilon < 1", "epsilon:0.1"),
            ("delta", self.delta, 0 < self.delta < 1, "0 < delta < 1", "delta:0.1"),
            ("base_rate", self.base_rate, 0 < self.base_rate <= 1, "0 < base_rate <= 1", "base_rate:0.05"),
            ("sink", self.sink, self.sink >= 0, "sink >= 0", "sink:4"),
            ("local", self.local, self.local >= 1, "local >= 1 (the current key is always read)", "local:32"),
            ("top", self.top, self.top >= 0, "top >= 0", "top:32"),
            ("seed", self.seed, 0 <= self.seed <= MASK32, "0 <= seed < 2^32", "seed:0")) if not ok]
        if bad:
            name, value, rule, example = bad[0]
            raise ConfigError(f"approx_args {name}:{value} is invalid for vattention; use {rule}, e.g. {example}")

    def promise(self) -> Promise:
        return Promise(self.epsilon, self.delta, denominator=True)  # its budget bounds the denominator's error

    def max_keys(self, window: int) -> None:
        return None  # the sample may reach the whole context

    def keys_read(self, context: int, window: int) -> float:
        return context  # every key's score: it starts no earlier than A

    def per_pass(self, pos: torch.Tensor, pad: torch.Tensor, key_len: int, window: int, window_align: int,
                 seed: torch.Tensor | None = None) -> tuple[torch.Tensor]:
        return (seed,)  # each position's request seed

    def prepare(self, key: torch.Tensor, pad: torch.Tensor, window: int, observed: None = None, layer: None = None,
                site: Site | None = None) -> Site:
        return site

    def select(self, query: torch.Tensor, key: torch.Tensor, rows: torch.Tensor, pos: torch.Tensor,
               pad: torch.Tensor, window: int, passed: tuple[torch.Tensor], prepared: Site) -> Selected:
        r, heads, dim = query.shape
        kv_heads, length = key.shape[1], key.shape[2]
        logical = torch.arange(length, device=key.device) - pad[:, None]  # (r, L)
        allowed = ((logical >= 0) & (logical <= pos[:, None]))[:, None, :]  # (r, 1, L)
        q = query.float().view(r, kv_heads, heads // kv_heads, dim)
        scores = (q @ semantics.rows_of(key, rows).float().transpose(-1, -2)) * dim ** -0.5  # (r, Hkv, g, L)
        scores = scores.masked_fill(~allowed[:, :, None, :], -math.inf)
        fixed = self._fixed(scores, logical, pos, allowed)
        rest = allowed & ~fixed  # (r, Hkv, L)
        m = rest.sum(-1)
        heads_at = prepared.first_kv_head + torch.arange(kv_heads, device=key.device)  # the model's KV heads
        draws = _priority(self.seed, passed[0], prepared.layer, pos, heads_at, logical)
        rank = _ranks(torch.where(rest, draws, UNDRAWN))
        budget = self._budget(scores, fixed, rest, rank, m)
        sample = rest & (rank < budget[..., None])
        chosen = fixed | sample
        # every key's slot, the chosen first: as wide as the cache, so that no count is read back to size it
        order = _chosen_first(chosen)
        valid = torch.arange(length, device=key.device) < chosen.sum(-1, keepdim=True)
        weight = (m.double() / budget.clamp(min=1).double()).log().float()  # log(m / B), float32
        log_weight = torch.where(sample.gather(-1, order), weight[..., None], 0.0)
        return order, valid, log_weight

    def _fixed(self, scores: torch.Tensor, logical: torch.Tensor, pos: torch.Tensor,
               allowed: torch.Tensor) -> torch.Tensor:
        """F per KV head (r, Hkv, L): the first ``sink`` keys, the last ``local``, and the ``top`` of the rest by
        the largest score over the KV head's query heads (ties: the earlier key)."""
        ends = (logical < self.sink) | (logical > pos[:, None] - self.local)
        edges = (allowed & ends[:, None, :]).expand(-1, scores.shape[1], -1)
        if not self.top:
            return edges
        ranked = scores.amax(2).masked_fill(edges | ~allowed, -math.inf)
        top = semantics.best_first(ranked, self.top)
        tops = torch.zeros_like(edges).scatter_(-1, top, ranked.gather(-1, top) > -math.inf)
        return edges | tops

    def _budget(self, scores: torch.Tensor, fixed: torch.Tensor, rest: torch.Tensor, rank: torch.Tensor,
                m: torch.Tensor) -> torch.Tensor:
        """B per KV head (r, Hkv): the largest of its query heads' budgets from the base sample, within [b, m]."""
        m64 = m.double()
        base = torch.minimum(m64, (self.base_rate * m64).floor().clamp(min=2))  # b
        in_base = (rest & (rank < base[..., None])).unsqueeze(2)  # (r, Hkv, 1, L)
        e = (scores - scores.amax(-1, keepdim=True)).exp().double()  # (r, Hkv, g, L); exp(-inf) = 0
        drawn = torch.where(in_base, e, 0.0)
        mean = drawn.sum(-1) / base.clamp(min=1)[..., None]
        spread = (torch.where(in_base, e - mean[..., None], 0.0).square().sum(-1)
                  / (base - 1).clamp(min=1)[..., None]).sqrt()
        denominator = torch.where(fixed.unsqueeze(2), e, 0.0).sum(-1) + m64[..., None] * mean  # D^ per query head
        z = NormalDist().inv_cdf(1 - self.delta / 2)  # two-sided
        wanted = (z * spread * m64[..., None] / (self.epsilon * denominator)).square().ceil().amax(-1)
        return torch.minimum(m64, torch.maximum(base, wanted.nan_to_num(nan=0.0))).long()

    def position_bytes(self, key: torch.Tensor, query_heads: int) -> int:
        # the row's keys; per query head its float32 scores (two) and float64 exponentials, base draws and spread
        # (four); per KV head the priorities, ranks, sorts and masks
        return key.shape[2] * (key.shape[1] * key.shape[3] * key.element_size() + 40 * query_heads
                               + 48 * key.shape[1])


def _chosen_first(chosen: torch.Tensor) -> torch.Tensor:
    """The keys' indices (..., L), the chosen first, each part in key order: a stable sort of ``~chosen``, made by
    counting (a key's slot is the chosen keys before it, or the count chosen plus the others before it)."""
    taken = chosen.long()
    before = taken.cumsum(-1) - taken
    index = torch.arange(chosen.shape[-1], device=chosen.device).expand_as(taken)
    slot = torch.where(chosen, before, taken.sum(-1, keepdim=True) + index - before)
    return torch.empty_like(slot).scatter_(-1, slot, index)


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """x c mod 2^32 for 0 <= x < 2^32, in int64 without overflow (the constant in two 16-bit halves)."""
    return (x * (c & 0xFFFF) + (((x * (c >> 16)) & 0xFFFF) << 16)) & MASK32


def _lowbias32(x: torch.Tensor) -> torch.Tensor:
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def _priority(seed: int, request: torch.Tensor, layer: int, pos: torch.Tensor, heads: torch.Tensor,
              logical: torch.Tensor) -> torch.Tensor:
    """u = f(f(f(f(f(f(seed) ^ r) ^ l) ^ p) ^ h) ^ j) per position (its request seed r and position p), KV head h (the
    model's index) and key j: (r, Hkv, L), every value mod 2^32."""
    u = _lowbias32(torch.full_like(pos, seed & MASK32))
    u = _lowbias32(u ^ (request.to(pos) & MASK32))
    u = _lowbias32(u ^ (layer & MASK32))
    u = _lowbias32(u ^ (pos & MASK32))[:, None]
    u = _lowbias32(u ^ heads)[:, :, None]
    return _lowbias32(u ^ (logical & MASK32)[:, None, :])


def _ranks(priority: torch.Tensor) -> torch.Tensor:
    """Each key's place in the order (priority, key) ascending: the sample is the keys ranked below B."""
    order = priority.sort(dim=-1, stable=True).indices
    return torch.empty_like(order).scatter_(-1, order, torch.arange(order.shape[-1], device=order.device)
                                            .expand_as(order).contiguous())
