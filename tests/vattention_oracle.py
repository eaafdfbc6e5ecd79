"""An independent reference for the vAttention draft (docs/design.md, "vAttention: a weighted draft"), written from
that rule text alone, one query and one position at a time, with plain Python loops in float64 (no batching, no
masks, no gathers, no code of alspec_eval).

Notation (one sequence, no padding): the query at logical position ``pos`` has Hq heads ``q[g]`` (post-RoPE); the
cache has Hkv KV heads with keys ``K[h, t]`` and values ``V[h, t]``; query head g uses KV head g // (Hq / Hkv). Only
keys t <= pos exist for the query (n = pos + 1): anything past ``pos`` in ``K`` / ``V`` is never read.

The rule, per KV head h (scores s_gj = scale q_g . k_j, scale = D ** -0.5 unless given):

1. fixed keys F (weight 1): [0, min(sink, n)), [max(0, n - local), n), and of the rest the ``top`` keys with the
   largest max_g s_gj over the head's query heads (ties: the earlier key), fewer if fewer remain;
2. the rest R (m keys), ordered by (u_j, j) ascending, u_j = f(f(f(f(f(f(seed) ^ r) ^ l) ^ p) ^ h) ^ j) (lowbias32,
   every value mod 2**32; r the request seed, l the layer index, h = head_offset + the cache's local head index, the
   KV head's index in the model); the sample is the first B keys of that order, the base sample the first b;
3. b = min(m, max(2, floor(base_rate m)));
4. per query head, e_gj = exp(s_gj - max_j s_gj) over all n keys, sigma_g the standard deviation of e over the base
   sample (divided by b - 1), D^_g = sum_F e + (m / b) sum_base e, budget x_g = (z sigma_g m / (epsilon D^_g)) ** 2
   with z = Phi^-1(1 - delta / 2), B_g = ceil(x_g); B = min(m, max(b, max_g B_g));
5. sampled keys weigh m / B (log-weight log(m / B), stored in float32), fixed keys 1: A~_g is the weighted softmax
   over F and the sample, its denominator D~_g = sum_F e + (m / B) sum_sample e.

The request seed r is zlib's CRC-32 of the tokens before the speculation start, each packed as 8 bytes little-endian
signed (``request_seed``); no tokens give 0.
"""

from __future__ import annotations

import math
import struct
import zlib
from dataclasses import dataclass, field
from statistics import NormalDist

MASK = 0xFFFFFFFF


def lowbias32(x: int) -> int:
    """lowbias32: x ^= x >> 16; x *= 0x7feb352d; x ^= x >> 15; x *= 0x846ca68b; x ^= x >> 16 (all mod 2**32)."""
    x &= MASK
    x ^= x >> 16
    x = (x * 0x7FEB352D) & MASK
    x ^= x >> 15
    x = (x * 0x846CA68B) & MASK
    x ^= x >> 16
    return x


def priority(seed: int, request: int, layer: int, pos: int, head: int, key: int) -> int:
    """u_j = f(f(f(f(f(f(seed) xor r) xor l) xor p) xor h) xor j), every value mod 2**32 (r the request seed, l the
    layer index, p the position, h the KV head's index in the model, j the key's logical position)."""
    x = lowbias32(seed & MASK)
    x = lowbias32(x ^ (request & MASK))
    x = lowbias32(x ^ (layer & MASK))
    x = lowbias32(x ^ (pos & MASK))
    x = lowbias32(x ^ (head & MASK))
    return lowbias32(x ^ (key & MASK))


def request_seed(tokens: list[int]) -> int:
    """zlib's CRC-32 of the tokens, each as 8 bytes little-endian signed (no tokens: 0)."""
    data = b"".join(struct.pack("<q", int(t)) for t in tokens)
    return zlib.crc32(data) & MASK


def float32(x: float) -> float:
    """x rounded to the nearest float32 (as the engine stores a log-weight)."""
    return struct.unpack("f", struct.pack("f", x))[0]


def _lists(t):
    """A tensor (or array) as nested Python floats (float64); lists pass through."""
    if hasattr(t, "detach"):
        return t.detach().double().tolist()
    if hasattr(t, "tolist"):
        return t.astype("float64").tolist()
    return t


def _dot(a: list[float], b: list[float]) -> float:
    total = 0.0
    for x, y in zip(a, b, strict=True):
        total += x * y
    return total


@dataclass
class Head:
    """One KV head's selection: sorted fixed keys and sampled keys (logical positions), their sizes and the budget."""

    fixed: list[int]
    sample: list[int]
    m: int  # |R|
    b: int  # the base sample's size
    B: int  # the sample's size
    budgets: list[float]  # x_g, the pre-ceil budget of each of the group's query heads (empty where m < 2)
    log_weight: float  # the sampled keys' log-weight, float32(log(m / B)) (0.0 where m == 0)
    group: list[int] = field(default_factory=list)  # the query heads g of this KV head

    def weights(self) -> dict[int, float]:
        """Every selected key's log-weight: 0 for fixed keys, log(m / B) (float32) for sampled ones."""
        out = dict.fromkeys(self.fixed, 0.0)
        out.update(dict.fromkeys(self.sample, self.log_weight))
        return out

    def on_rounding_edge(self, rel: float) -> bool:
        """True where moving any query head's pre-ceil budget by a relative ``rel`` could change B (a float32
        engine may land on the other side of an integer there)."""
        if not self.budgets:
            return False

        def budget(scale: float) -> int:
            return min(self.m, max(self.b, max(math.ceil(x * scale) for x in self.budgets)))

        return budget(1.0 - rel) != budget(1.0 + rel)


@dataclass
class Reference:
    heads: list[Head]  # per KV head
    D: list[float]  # per query head: sum of e_gj over all n keys
    D_hat: list[float]  # per query head: sum_F e + (m / b) sum_base e (0.0 where m == 0: no estimate is made)
    D_tilde: list[float]  # per query head: sum_F e + (m / B) sum_sample e
    output: list[list[float]]  # A~, (Hq, D)


def reference(q, K, V, pos: int, *, epsilon: float = 0.1, delta: float = 0.1, base_rate: float = 0.05,
              sink: int = 4, local: int = 32, top: int = 32, seed: int = 0, scale: float | None = None,
              request: int = 0, layer: int = 0, head_offset: int = 0) -> Reference:
    """The vAttention selection and A~ for the query at logical position ``pos``. q: (Hq, D); K, V: (Hkv, L, D) with
    L > pos (keys past ``pos`` are never read); tensors, arrays or nested lists. ``request`` is the request seed,
    ``layer`` the layer's index, ``head_offset`` the model's index of the cache's first KV head (local head h hashes
    as head_offset + h)."""
    q = _lists(q)
    K = [row[:pos + 1] for row in _lists(K)]
    V = [row[:pos + 1] for row in _lists(V)]
    hq, hkv = len(q), len(K)
    if hq % hkv != 0:
        raise ValueError("Hq must be a multiple of Hkv")
    n = pos + 1
    if any(len(row) < n for row in K) or any(len(row) < n for row in V):
        raise ValueError(f"K / V hold fewer than pos + 1 = {n} keys")
    dim = len(q[0])
    if scale is None:
        scale = dim ** -0.5
    z = NormalDist().inv_cdf(1.0 - delta / 2)
    per_group = hq // hkv

    heads: list[Head] = []
    D = [0.0] * hq
    D_hat = [0.0] * hq
    D_tilde = [0.0] * hq
    output = [[0.0] * dim for _ in range(hq)]
    for h in range(hkv):
        group = [g for g in range(hq) if g // per_group == h]
        s = {g: [scale * _dot(q[g], K[h][j]) for j in range(n)] for g in group}

        # 1. fixed keys
        fixed = set(range(min(sink, n))) | set(range(max(0, n - local), n))
        rest = [j for j in range(n) if j not in fixed]
        best = {j: max(s[g][j] for g in group) for j in rest}
        fixed |= set(sorted(rest, key=lambda j: (-best[j], j))[:top])

        # 2. the rest, in priority order
        R = [j for j in range(n) if j not in fixed]
        m = len(R)
        order = sorted(R, key=lambda j: (priority(seed, request, layer, pos, head_offset + h, j), j))

        e = {}
        for g in group:
            top_score = max(s[g])
            e[g] = [math.exp(x - top_score) for x in s[g]]

        budgets: list[float] = []
        if m == 0:
            b = B = 0
        else:
            # 3. the base sample
            b = min(m, max(2, math.floor(base_rate * m)))
            base = order[:b]
            # 4. the budget
            if b >= 2:
                for g in group:
                    vals = [e[g][j] for j in base]
                    mean = sum(vals) / b
                    sigma = math.sqrt(sum((x - mean) ** 2 for x in vals) / (b - 1))
                    d_hat = sum(e[g][j] for j in fixed) + (m / b) * sum(vals)
                    D_hat[g] = d_hat
                    if sigma == 0.0:
                        budgets.append(0.0)
                    elif d_hat == 0.0:
                        budgets.append(math.inf)
                    else:
                        budgets.append((z * sigma * m / (epsilon * d_hat)) ** 2)
                B = min(m, max(b, max(math.ceil(x) if math.isfinite(x) else m for x in budgets)))
            else:  # m == 1: the base sample is all of R
                B = m
        sample = order[:B]
        weight = m / B if B else 1.0
        log_weight = float32(math.log(weight)) if B else 0.0
        heads.append(Head(sorted(fixed), sorted(sample), m, b, B, budgets, log_weight, group))

        # 5. the weighted denominator and A~
        for g in group:
            D[g] = sum(e[g])
            num = [0.0] * dim
            den = 0.0
            for keys, w in ((fixed, 1.0), (sample, weight)):
                for j in keys:
                    c = w * e[g][j]
                    den += c
                    for i, v in enumerate(V[h][j]):
                        num[i] += c * v
            D_tilde[g] = den
            output[g] = [x / den for x in num]
    return Reference(heads, D, D_hat, D_tilde, output)
