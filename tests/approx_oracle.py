"""An independent reference for attention-level speculation's approximations (sink, quest, topk), written from
their rule text alone, position by position with plain Python loops (no batching, no masks, no gathers).

Notation (one sequence, no padding): the query at logical position ``pos`` has Hq heads ``q[h]`` (post-RoPE);
the cache has Hkv KV heads with keys ``K[kvh, t]`` and values ``V[kvh, t]`` (post-RoPE keys). ``g = Hq // Hkv``
and query head ``h`` uses KV head ``h // g`` (repeat_kv). Only keys ``t <= pos`` exist for the query: anything
past ``pos`` in ``K``/``V`` is never read. The budget is ``2 * window`` keys.
"""

from __future__ import annotations

import math

import torch

APPROXES = ("sink", "quest", "topk")


def _lists(t: torch.Tensor) -> list:
    """A tensor as nested Python floats (float64), so the loops below share no code with torch's kernels."""
    return t.detach().double().tolist() if isinstance(t, torch.Tensor) else t


def _dot(a: list[float], b: list[float]) -> float:
    """a . b, summed channel by channel."""
    total = 0.0
    for x, y in zip(a, b, strict=True):
        total += x * y
    return total


def check_page(window: int, page: int) -> None:
    """quest: "valid only if 2S % P == 0 and P <= S" (and a page holds at least one key)."""
    if isinstance(page, bool) or not isinstance(page, int) or page < 1 or page > window or (2 * window) % page != 0:
        raise ValueError(f"invalid quest page {page!r} for window {window}: need 2S % P == 0 and 0 < P <= S")


def is_trivial(pos: int, window: int) -> bool:
    """"if pos + 1 <= 2S, A~ = A for every approximation"."""
    return pos + 1 <= 2 * window


def _sink(pos: int, window: int) -> list[int]:
    """sink: "every KV head keeps keys {0..S-1} ∪ {pos-S+1..pos}"."""
    keep = set(range(0, window)) | set(range(pos - window + 1, pos + 1))
    return sorted(t for t in keep if 0 <= t <= pos)


def page_min_max(K_kvh: list[list[float]], lo: int, hi: int) -> tuple[list[float], list[float]]:
    """mn[i] / mx[i]: the element-wise min / max over keys lo..hi-1 of channel i."""
    mn, mx = list(K_kvh[lo]), list(K_kvh[lo])
    for t in range(lo + 1, hi):
        for i, x in enumerate(K_kvh[t]):
            if x < mn[i]:
                mn[i] = x
            if x > mx[i]:
                mx[i] = x
    return mn, mx


def quest_bound(q_h: list[float], mn: list[float], mx: list[float]) -> float:
    """U_h[j] = sum_i max(q_h[i] * mn[i], q_h[i] * mx[i]) (raw q, no scaling)."""
    total = 0.0
    for qi, lo, hi in zip(q_h, mn, mx, strict=True):
        total += max(qi * lo, qi * hi)
    return total


def quest_page_bounds(q, K, pos: int, page: int) -> dict[tuple[int, int], float]:
    """U[kvh, j] = max over the group's query heads h (h // g == kvh) of U_h[j], for every candidate page j in
    1..cur-1 (cur = pos // P; all full, so every key of them is <= pos)."""
    q, K = _lists(q), _lists(K)
    hq, hkv = len(q), len(K)
    g = hq // hkv
    cur = pos // page
    bounds = {}
    for kvh in range(hkv):
        for j in range(1, cur):
            lo, hi = j * page, (j + 1) * page
            assert hi - 1 <= pos
            mn, mx = page_min_max(K[kvh], lo, hi)
            bounds[kvh, j] = max(quest_bound(q[h], mn, mx) for h in range(hq) if h // g == kvh)
    return bounds


def _quest(q, K, pos: int, window: int, page: int) -> list[list[int]]:
    """quest: page 0 and page cur = pos // P (keys cur*P..pos) always; of the candidate pages 1..cur-1 the
    M = 2S/P - 2 with the largest U[kvh, j] (ties: smaller page first), all of them if fewer; keys <= pos."""
    hkv = len(K)
    cur = pos // page
    m = 2 * window // page - 2
    bounds = quest_page_bounds(q, K, pos, page)
    kept = []
    for kvh in range(hkv):
        candidates = sorted(range(1, cur), key=lambda j: (-bounds[kvh, j], j))
        pages = {0, cur} | set(candidates[:m])
        kept.append(sorted(t for j in pages for t in range(j * page, (j + 1) * page) if t <= pos))
    return kept


def topk_scores(q, K, pos: int) -> list[list[float]]:
    """s[kvh, t] = max over the group's query heads h of q_h . K[kvh, t], t <= pos."""
    q, K = _lists(q), _lists(K)
    hq, hkv = len(q), len(K)
    g = hq // hkv
    return [[max(_dot(q[h], K[kvh][t]) for h in range(hq) if h // g == kvh) for t in range(pos + 1)]
            for kvh in range(hkv)]


def _topk(q, K, pos: int, window: int) -> list[list[int]]:
    """topk: per KV head the 2S keys with the largest s[kvh, t] (ties: smaller t first)."""
    kept = []
    for scores in topk_scores(q, K, pos):
        order = sorted(range(pos + 1), key=lambda t: (-scores[t], t))
        kept.append(sorted(order[:2 * window]))
    return kept


def _prepare(q, K, pos: int):
    """q and K as lists, K cut to keys 0..pos (keys past pos never exist for this query)."""
    q, K = _lists(q), [row[:pos + 1] for row in _lists(K)]
    if len(q) % len(K) != 0:
        raise ValueError("Hq must be a multiple of Hkv")
    if any(len(row) < pos + 1 for row in K):
        raise ValueError(f"K holds fewer than pos + 1 = {pos + 1} keys")
    return q, K


def kept_keys(q: torch.Tensor, K: torch.Tensor, pos: int, window: int, approx: str, page: int = 16
              ) -> list[list[int]]:
    """Per KV head, the sorted positions the approximation keeps for the query at ``pos``. q: (Hq, D);
    K: (Hkv, L, D) with L > pos allowed (keys past pos are never read). Trivial positions keep all of 0..pos."""
    if approx not in APPROXES:
        raise ValueError(f"unknown approximation {approx!r}")
    if approx == "quest":
        check_page(window, page)
    q, K = _prepare(q, K, pos)
    if is_trivial(pos, window):
        return [list(range(pos + 1)) for _ in K]
    if approx == "sink":
        return [_sink(pos, window) for _ in K]
    if approx == "quest":
        return _quest(q, K, pos, window, page)
    return _topk(q, K, pos, window)


def _attend(q_h: list[float], K_kvh, V_kvh, keys: list[int], scaling: float) -> list[float]:
    """softmax(scaling * q_h . K[t]) over t in keys, weighted sum of V[t]; float64, one key at a time."""
    logits = [scaling * _dot(q_h, K_kvh[t]) for t in keys]
    top = max(logits)
    weights = [math.exp(x - top) for x in logits]
    total = sum(weights)
    out = [0.0] * len(V_kvh[0])
    for w, t in zip(weights, keys, strict=True):
        for i, v in enumerate(V_kvh[t]):
            out[i] += w / total * v
    return out


def _output(q, K, V, keys_per_kvh: list[list[int]], scaling: float) -> list[list[float]]:
    hq, hkv = len(q), len(K)
    g = hq // hkv
    return [_attend(q[h], K[h // g], V[h // g], keys_per_kvh[h // g], scaling) for h in range(hq)]


def exact_output(q: torch.Tensor, K: torch.Tensor, V: torch.Tensor, pos: int, scaling: float) -> torch.Tensor:
    """A: every query head attends to all keys 0..pos of its KV head. (Hq, D), float64."""
    q, K = _prepare(q, K, pos)
    V = [row[:pos + 1] for row in _lists(V)]
    return torch.tensor(_output(q, K, V, [list(range(pos + 1))] * len(K), scaling), dtype=torch.float64)


def approx_output(q: torch.Tensor, K: torch.Tensor, V: torch.Tensor, pos: int, window: int, approx: str,
                  scaling: float, page: int = 16) -> torch.Tensor:
    """A~: every query head attends to its KV head's kept keys only. (Hq, D), float64."""
    keys = kept_keys(q, K, pos, window, approx, page)
    q, K = _prepare(q, K, pos)
    V = [row[:pos + 1] for row in _lists(V)]
    return torch.tensor(_output(q, K, V, keys, scaling), dtype=torch.float64)


def ratio(q: torch.Tensor, K: torch.Tensor, V: torch.Tensor, pos: int, window: int, approx: str, scaling: float,
          page: int = 16) -> float:
    """d / n with d = ||A~ - A||_2 and n = ||A||_2 over all query heads and head dims of the position together."""
    exact = exact_output(q, K, V, pos, scaling).flatten().tolist()
    approx_ = approx_output(q, K, V, pos, window, approx, scaling, page).flatten().tolist()
    d = math.sqrt(sum((a - e) ** 2 for a, e in zip(approx_, exact, strict=True)))
    n = math.sqrt(sum(e * e for e in exact))
    return d / n
