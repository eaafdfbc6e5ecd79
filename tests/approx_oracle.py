"""An independent reference for attention-level speculation's approximations (sink, quest, topk, local, snapkv),
written from their rule text alone, position by position with plain Python loops (no batching, no masks, no gathers).

Notation (one sequence, no padding): the query at logical position ``pos`` has Hq heads ``q[h]`` (post-RoPE);
the cache has Hkv KV heads with keys ``K[kvh, t]`` and values ``V[kvh, t]`` (post-RoPE keys). ``g = Hq // Hkv``
and query head ``h`` uses KV head ``h // g`` (repeat_kv). Only keys ``t <= pos`` exist for the query: anything
past ``pos`` in ``K``/``V`` is never read. The budget is ``2 * window`` keys.

snapkv also needs the prompt's observation queries (the prompt is logical positions ``[0, P)``), so it is not in
``APPROXES`` / ``kept_keys``: ``snapkv_prompt_scores`` scores the prompt once per layer, ``snapkv_kept_keys`` picks
the keys for a decode query from those scores, ``snapkv_output`` / ``snapkv_ratio`` give A~ and d / n.
"""

from __future__ import annotations

import math

import torch

APPROXES = ("sink", "quest", "topk", "local")


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


def _local(pos: int, window: int) -> list[int]:
    """local: "every KV head keeps keys {pos-2S+1 .. pos} ∩ {0..pos}"."""
    return [t for t in range(pos - 2 * window + 1, pos + 1) if 0 <= t <= pos]


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
    if approx == "local":
        return [_local(pos, window) for _ in K]
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


# ---------------------------------------------------------------- snapkv (needs the prompt's observation queries)


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _check_observe_pool(observe: int, pool: int) -> None:
    if not _is_int(observe) or observe < 1:
        raise ValueError(f"invalid snapkv observe {observe!r}: need w_max >= 1")
    if not _is_int(pool) or pool < 1 or pool % 2 != 1:
        raise ValueError(f"invalid snapkv pool {pool!r}: need an odd k >= 1")


def _check_recent(window: int, recent: int) -> None:
    if not _is_int(recent) or recent < 1 or recent >= 2 * window:
        raise ValueError(f"invalid snapkv recent {recent!r} for window {window}: need 1 <= R < 2S")


def check_snapkv(window: int, observe: int, pool: int, recent: int) -> None:
    """snapkv(observe=w_max, pool=k, recent=R): "k odd >= 1, 1 <= R < 2S, w_max >= 1"."""
    _check_observe_pool(observe, pool)
    _check_recent(window, recent)


def observation_window(prompt_len: int, observe: int) -> tuple[int, int]:
    """[P - w, P) with w = min(w_max, P)."""
    if not _is_int(prompt_len) or prompt_len < 1:
        raise ValueError(f"invalid prompt length {prompt_len!r}: need P >= 1")
    w = min(observe, prompt_len)
    return prompt_len - w, prompt_len


def snapkv_pool(raw: list[float], pool: int) -> list[float]:
    """pooled[t] = (1/k) * sum of raw[j] over j in [t - k//2, t + k//2] with 0 <= j < len(raw): zero padding,
    always divided by k (avg_pool1d with count_include_pad=True)."""
    n, half = len(raw), pool // 2
    pooled = []
    for t in range(n):
        total = 0.0
        for j in range(t - half, t + half + 1):
            if 0 <= j < n:
                total += raw[j]
        pooled.append(total / pool)
    return pooled


def _softmax(logits: list[float]) -> list[float]:
    top = max(logits)
    weights = [math.exp(x - top) for x in logits]
    total = sum(weights)
    return [w / total for w in weights]


def snapkv_prompt_scores(obs_q, K, prompt_len: int, observe: int, pool: int, scaling: float
                         ) -> list[list[float]]:
    """The per-layer prompt scores s[kvh][t], t in [0, P): +inf for the observation window [P - w, P); for
    t in [0, P - w) the pooled (``snapkv_pool``) raw[kvh][t] = sum over the group's query heads h and the
    observation queries q in [P - w, P) (all >= t) of softmax over keys 0..q of scaling * q_vec[h][q] . K[t].

    obs_q: (Hq, n, D) as a tensor or nested lists, either the w observation queries only (n == w: entry i is
    position P - w + i) or the queries of positions 0..n-1 with n >= P (only [P - w, P) is read).
    K: (Hkv, L, D) with L >= P (keys past P are never read)."""
    _check_observe_pool(observe, pool)
    lo, hi = observation_window(prompt_len, observe)
    w = hi - lo
    obs_q, K = _lists(obs_q), [row[:prompt_len] for row in _lists(K)]
    hq, hkv = len(obs_q), len(K)
    if hq % hkv != 0:
        raise ValueError("Hq must be a multiple of Hkv")
    if any(len(row) < prompt_len for row in K):
        raise ValueError(f"K holds fewer than P = {prompt_len} keys")
    g = hq // hkv
    queries = []  # queries[h][i]: the query of head h at position lo + i
    for rows in obs_q:
        if len(rows) == w:
            queries.append(rows)
        elif len(rows) >= prompt_len:
            queries.append(rows[lo:hi])
        else:
            raise ValueError(f"need the w = {w} observation queries or the queries of positions 0..P-1")
    scores = []
    for kvh in range(hkv):
        raw = [0.0] * lo
        for h in range(hq):
            if h // g != kvh:
                continue
            for i in range(w):
                q = lo + i
                weights = _softmax([scaling * _dot(queries[h][i], K[kvh][t]) for t in range(q + 1)])
                for t in range(lo):  # q >= lo > t
                    raw[t] += weights[t]
        scores.append(snapkv_pool(raw, pool) + [math.inf] * w)
    return scores


def snapkv_kept_keys(scores: list[list[float]], pos: int, prompt_len: int, window: int, recent: int
                     ) -> list[list[int]]:
    """Per KV head, the sorted positions snapkv keeps for the decode query at ``pos``: trivial positions
    (pos + 1 <= 2S) keep all of 0..pos; otherwise (pos >= P) the newest R keys pos-R+1..pos plus the 2S - R prompt
    keys t in [0, P) not among them with the largest scores[kvh][t] (ties, +inf included: smaller t first), all
    of them if fewer."""
    _check_recent(window, recent)
    if any(len(row) != prompt_len for row in scores):
        raise ValueError(f"scores must hold P = {prompt_len} entries per KV head")
    if is_trivial(pos, window):
        return [list(range(pos + 1)) for _ in scores]
    if pos < prompt_len:
        raise ValueError(f"pos {pos} is inside the prompt [0, {prompt_len}): snapkv selects for decode queries")
    newest = list(range(pos - recent + 1, pos + 1))
    kept = []
    for row in scores:
        candidates = sorted((t for t in range(prompt_len) if t < newest[0]), key=lambda t: (-row[t], t))
        kept.append(sorted(set(candidates[:2 * window - recent]) | set(newest)))
    return kept


def snapkv_output(q: torch.Tensor, K: torch.Tensor, V: torch.Tensor, pos: int, scores: list[list[float]],
                  prompt_len: int, window: int, recent: int, scaling: float) -> torch.Tensor:
    """A~ of snapkv for the query at ``pos``: every query head attends to its KV head's kept keys only.
    q: (Hq, D); K, V: (Hkv, L, D) with L > pos. (Hq, D), float64."""
    keys = snapkv_kept_keys(scores, pos, prompt_len, window, recent)
    q, K = _prepare(q, K, pos)
    V = [row[:pos + 1] for row in _lists(V)]
    return torch.tensor(_output(q, K, V, keys, scaling), dtype=torch.float64)


def snapkv_ratio(q: torch.Tensor, K: torch.Tensor, V: torch.Tensor, pos: int, scores: list[list[float]],
                 prompt_len: int, window: int, recent: int, scaling: float) -> float:
    """d / n of snapkv (as ``ratio``)."""
    exact = exact_output(q, K, V, pos, scaling).flatten().tolist()
    approx_ = snapkv_output(q, K, V, pos, scores, prompt_len, window, recent, scaling).flatten().tolist()
    d = math.sqrt(sum((a - e) ** 2 for a, e in zip(approx_, exact, strict=True)))
    n = math.sqrt(sum(e * e for e in exact))
    return d / n
