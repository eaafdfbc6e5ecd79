"""The rules of attention-level speculation, written once (docs/design.md, Semantics 2-4).

Read beside the paper's Algorithm 1. Every path calls this module: the sim and tt backends, the
host side of the torch reference, the Triton and TT-Lang wrappers (the values they hand a kernel)
and the report's open-loop curves. Kernel bodies compute in-kernel; their tests compare with it.

Positions here are logical: counted from the sequence's first real token (left padding is not part
of the sequence); ``pos`` is the current token's position, so the context holds pos + 1 tokens.
"""

from __future__ import annotations

import functools
import math
import struct
import zlib
from collections.abc import Sequence

import torch
from torch.utils.weak import WeakIdKeyDictionary


def is_trivial(pos: torch.Tensor, window: int) -> torch.Tensor:
    """The context fits in the two windows (pos + 1 <= 2S): A~ equals A, accepted, counted as trivial."""
    return pos + 1 <= 2 * window


def last_window_end(pos: torch.Tensor, window_align: int) -> torch.Tensor:
    """One past the last window: the current token (window_align=1), or ceil32(pos + 1) as the TT op."""
    return (pos + window_align) // window_align * window_align


def window_bounds(pos: torch.Tensor, window: int, window_align: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Start of the last window and the trivial flag per query.

    The last window is [end - S, end); with window_align=32 its positions past ``pos`` are masked.
    Trivial queries get last_start = S, so the two windows tile [0, 2S) without overlap.
    """
    trivial = is_trivial(pos, window)
    last_start = torch.where(trivial, torch.full_like(pos, window), last_window_end(pos, window_align) - window)
    return last_start, trivial


def window_positions(pos: torch.Tensor, window: int, window_align: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The 2S key positions of A~ for each query, (R, 2S): first S, then the last S; and which are valid
    (<= pos: the aligned last window may end past the current token, and a trivial context is shorter)."""
    last_start, _ = window_bounds(pos, window, window_align)
    offsets = torch.arange(window, device=pos.device)
    positions = torch.cat([offsets.expand(len(pos), -1), last_start[:, None] + offsets], dim=1)
    return positions, positions <= pos[:, None]


def window_ranges(pos: torch.Tensor, window: int, window_align: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A~'s keys as two ranges of positions per query, [starts, ends) each (R, 2): the first window, then the last,
    both cut at the current token; the keys :func:`window_positions` lists as valid, as ranges (a paged cache reads
    them by range)."""
    last_start, _ = window_bounds(pos, window, window_align)
    starts = torch.stack([torch.zeros_like(pos), last_start], 1)
    ends = torch.minimum(torch.stack([torch.full_like(pos, window), last_start + window], 1), pos[:, None] + 1)
    return starts, ends


def readable_ranges(starts: torch.Tensor, ends: torch.Tensor,
                    pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A draft's key ranges [starts, ends) (R, K) cut to the keys a query at ``pos`` (R,) may read, [0, pos] (no key
    before the sequence, none past the query), whatever the draft returned, so that no path reads outside; and which
    queries' ranges reached outside it (R,): a non-empty range that starts before 0 or ends past pos + 1. Such a
    query left with no key reads its own, so its A~ stays a number until the run is refused (``bounds``)."""
    starts, ends, limit = starts.long(), ends.long(), (pos.long() + 1)[:, None]
    outside = ((ends > starts) & ((starts < 0) | (ends > limit))).any(1)
    cut_starts = starts.clamp(min=0).minimum(limit)
    cut_ends = ends.minimum(limit).maximum(cut_starts)
    first = torch.arange(starts.shape[1], device=pos.device) == 0
    none = (outside & (cut_ends == cut_starts).all(1))[:, None] & first  # nothing readable: its own key, in range 0
    return torch.where(none, limit - 1, cut_starts), torch.where(none, limit, cut_ends), outside


def readable_keys(keys: torch.Tensor, valid: torch.Tensor | None, low: torch.Tensor,
                  high: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A draft's selected keys (R, H or 1, n) and which count (``valid``; None: all) moved into [low, high] ((R, 1, 1)
    each: [0, pos] as logical positions, [pad, pad + pos] as indices into a left-padded cache): a key outside is read
    as the nearest readable one, so nothing outside is read and a query keeps as many keys; and which queries
    selected a counted key outside (R,) (the run is refused: ``bounds``)."""
    moved = torch.clamp(keys, low, high)
    outside = moved != keys
    if valid is not None:
        outside = outside & valid
    return moved, outside.any(dim=(1, 2))


def attend(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, valid: torch.Tensor | None,
           scale: float, bias: torch.Tensor | None = None) -> torch.Tensor:
    """A~'s arithmetic, one definition for every engine that computes it outside the model's attention function:
    the scores q.k accumulate in float32 (from the inputs' own values), the softmax's max, exponentials and sum
    are float32, the unnormalised probabilities are rounded to the values' dtype and P @ V accumulates in float32,
    divided by the sum, and the output is rounded to the query's dtype (FlashAttention's arithmetic; in float32
    nothing is rounded). Grouped-query heads as HF's repeat_kv: query head h reads KV head h // (Hq / Hkv).

    query (B, Q, Hq, D); keys, values (B, Hkv, n, D); valid (B, Hkv or 1, Q, n), which keys each query reads
    (None: all); bias (B, Hkv or 1, Q, n), a weighted draft's log-weights, added to the float32 scores (None: none);
    returns (B, Q, Hq, D). A query with no valid key gives NaN."""
    b, q_len, heads, dim = query.shape
    kv_heads = keys.shape[1]
    group = heads // kv_heads
    q = query.float().view(b, q_len, kv_heads, group, dim).permute(0, 2, 1, 3, 4).reshape(b, kv_heads, -1, dim)
    scores = (q @ keys.float().transpose(-1, -2)) * scale  # (B, Hkv, Q g, n)
    if bias is not None:
        scores = (scores.view(b, kv_heads, q_len, group, -1) + bias.float()[:, :, :, None, :]).view(b, kv_heads,
                                                                                                 q_len * group, -1)
    if valid is not None:
        scores = scores.view(b, kv_heads, q_len, group, -1).masked_fill(~valid[:, :, :, None, :], -math.inf)
        scores = scores.view(b, kv_heads, q_len * group, -1)
    top = scores.amax(-1, keepdim=True)
    weights = (scores - top).exp()
    out = (weights.to(values.dtype).float() @ values.float()) / weights.sum(-1, keepdim=True)
    return out.view(b, kv_heads, q_len, group, dim).permute(0, 2, 1, 3, 4).reshape(b, q_len, heads, dim).to(query.dtype)


def page_bounds(query: torch.Tensor, page_min: torch.Tensor, page_max: torch.Tensor) -> torch.Tensor:
    """Quest's upper bound of q.k over each page's keys, sum_i max(q_i min_i, q_i max_i), as q+ . max + q- . min
    (two products, no (pages, channels) buffer); per KV head, the largest over its group of query heads.
    query (R, Hq, D); page_min, page_max (R, Hkv, pages, D); returns (R, Hkv, pages)."""
    r, heads, dim = query.shape
    q = query.float().view(r, page_max.shape[1], heads // page_max.shape[1], dim)  # HF's repeat_kv: head h uses h // g
    bounds = q.clamp(min=0) @ page_max.float().transpose(-1, -2) + q.clamp(max=0) @ page_min.float().transpose(-1, -2)
    return bounds.amax(2)


def quest_positions(bounds: torch.Tensor, pos: torch.Tensor, window: int, page: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The 2S key positions of Quest's A~ per KV head, (R, Hkv, 2S), and which are valid: page 0 and the current
    token's page always, then the 2S/P - 2 full pages between them with the largest bounds (ties: the earlier page),
    keys past ``pos`` excluded. ``bounds`` (R, Hkv, pages) of pages [jP, (j+1)P), logical positions."""
    others = 2 * window // page - 2
    current = pos // page
    index = torch.arange(max(bounds.shape[-1], others), device=pos.device)
    candidate = (index >= 1) & (index < current[:, None])  # full pages strictly between the two kept ones
    if bounds.shape[-1] < others:  # fewer pages in the cache than the budget: the rest are never candidates
        bounds = torch.nn.functional.pad(bounds, (0, others - bounds.shape[-1]))
    ranked = bounds.float().masked_fill(~candidate[:, None, :], -math.inf)
    chosen = ranked.sort(dim=-1, descending=True, stable=True).indices[..., :others]  # (R, Hkv, others)
    chosen_valid = candidate[:, None, :].expand_as(ranked).gather(-1, chosen)
    always = torch.stack([torch.zeros_like(current), current], -1)[:, None, :].expand(-1, bounds.shape[1], -1)
    pages = torch.cat([always, chosen], -1)  # (R, Hkv, 2S/P)
    positions = (pages[..., None] * page + torch.arange(page, device=pos.device)).flatten(-2)
    page_valid = torch.cat([torch.ones_like(always, dtype=torch.bool), chosen_valid], -1)
    valid = page_valid.repeat_interleave(page, -1) & (positions <= pos[:, None, None])
    return positions, valid


def key_scores(query: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """q.k of every key, per KV head the largest over its group of query heads: query (R, Hq, D), keys
    (R, Hkv, L, D); returns (R, Hkv, L) in float32."""
    r, heads, dim = query.shape
    q = query.float().view(r, keys.shape[1], heads // keys.shape[1], dim)
    return (q @ keys.float().transpose(-1, -2)).amax(2)


@functools.cache
def rows_in_order(count: int, device: torch.device) -> torch.Tensor:
    """The rows 0..count-1 as an engine hands them to a draft where a step's positions are its batch's rows in order
    (a decode step, which the engine knows on the host): one tensor per (count, device), so that :func:`rows_of`
    knows them by identity, with nothing read back. Never written."""
    return torch.arange(count, device=device)


def rows_of(batch: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """``batch.index_select(0, rows)``: each speculated position's row of a per-row tensor (keys, page bounds). Where
    ``rows`` are :func:`rows_in_order` of the batch, the tensor itself: no step copies every row's keys, and nothing
    is read back to know it."""
    if len(rows) == len(batch) and rows is rows_in_order(len(rows), rows.device):
        return batch
    return batch.index_select(0, rows)


_HOST_VALUES: WeakIdKeyDictionary = WeakIdKeyDictionary()  # device tensor -> the host's copy it was made from


def known_on_host(tensor: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """``tensor``, which an engine made from the host's ``values`` (a step's rows and positions, copied to the device
    without waiting), with those values kept beside it for :func:`host_values`, as long as ``tensor`` lives."""
    _HOST_VALUES[tensor] = values
    return tensor


def host_values(tensor: torch.Tensor) -> list:
    """``tensor.tolist()``, from the host's copy where the engine made it from one (:func:`known_on_host`): a draft
    that needs a row's position as a Python int (to slice its keys) reads nothing back from a GPU."""
    return _HOST_VALUES.get(tensor, tensor).tolist()


def topk_positions(scores: torch.Tensor, window: int) -> torch.Tensor:
    """The 2S keys with the largest scores per KV head, (R, Hkv, 2S) (ties: the earlier key); keys that must not be
    chosen (past the current token, left padding) score -inf. A non-trivial context has more than 2S keys."""
    return best_first(scores, 2 * window)


def best_first(scores: torch.Tensor, keep: int) -> torch.Tensor:
    """The first ``keep`` indices of (..., L) scores' stable descending sort, compared as float32 (ties: the
    earlier key; NaN first, -0.0 equal to 0.0), by a partial selection rather than a sort of all L: each score's
    float32 bits, made to order as the floats do, times 2^32, plus L - 1 - its index, are unique keys whose top
    ``keep`` are that answer, with nothing read back."""
    length = scores.shape[-1]
    if keep >= length:
        return scores.sort(dim=-1, descending=True, stable=True).indices[..., :keep]
    # -0.0 + 0.0 is 0.0; every NaN made Python's (its sign bit clear: the largest key)
    values = (scores.float() + 0.0).nan_to_num(nan=math.nan, posinf=math.inf, neginf=-math.inf)
    bits = values.view(torch.int32)
    ordered = (bits ^ ((bits >> 31) & 0x7FFFFFFF)).long()  # a negative float's other 31 bits reversed
    earlier = torch.arange(length - 1, -1, -1, device=scores.device)
    return (ordered * 2**32 + earlier).topk(keep, dim=-1).indices


def distances(approx: torch.Tensor, exact: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """d = ||A~ - A||_2 and n = ||A||_2 per query over all heads and head_dim, in float32."""
    e, over = exact.float(), tuple(range(1, exact.dim()))
    return torch.linalg.vector_norm(approx.float() - e, dim=over), torch.linalg.vector_norm(e, dim=over)


def squared_distances(approx: torch.Tensor, exact: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """d^2 and n^2 per query over the heads given, in float32: what a tensor-parallel rank holds of its heads. Summed
    over every rank's heads, their square roots are :func:`distances` over all heads."""
    e, over = exact.float(), tuple(range(1, exact.dim()))
    return (approx.float() - e).square().sum(over), e.square().sum(over)


def accept(d: torch.Tensor, n: torch.Tensor, lam: float | torch.Tensor) -> torch.Tensor:
    """Accept iff d <= lambda n. lambda may be per query; lambda = inf accepts all (also n = 0); a plan's NaN
    (off) and -inf (exact, rejected) never accept."""
    if isinstance(lam, (int, float)):  # one threshold: no tensor to build (decode steps call this per layer)
        return torch.ones_like(d, dtype=torch.bool) if lam == math.inf else d <= lam * n
    lam = lam.to(dtype=torch.float32, device=d.device)
    return (d <= lam * n) | (lam == math.inf)


def accept_squared(d2: torch.Tensor, n2: torch.Tensor, lam: float | torch.Tensor) -> torch.Tensor:
    """The TT op's form of :func:`accept` on its own squared values: d^2 <= lambda^2 n^2 (no square root on
    the device). Equal to ``accept`` except where rounding of the squares moves a tie."""
    if isinstance(lam, (int, float)):
        return torch.ones_like(d2, dtype=torch.bool) if lam == math.inf else (d2 <= lam * lam * n2) & (lam >= 0)
    lam = lam.to(dtype=torch.float32, device=d2.device)
    return ((d2 <= lam * lam * n2) & (lam >= 0)) | (lam == math.inf)


def commit(exact: torch.Tensor, approx: torch.Tensor, accept: torch.Tensor) -> torch.Tensor:
    """What a verified position continues with (Semantics 5): A~ where accepted, A elsewhere, per query (the first
    dimension of ``exact`` and ``approx``, ``accept`` one bool each), in the dtype of A."""
    return torch.where(accept.reshape(-1, *[1] * (exact.dim() - 1)), approx.to(exact.dtype), exact)


def keys_read(index: torch.Tensor, valid: torch.Tensor | None) -> torch.Tensor:
    """How many keys each position's selection (``index``, (r, Hkv or 1, n); ``valid``: which count, None: all)
    reads per KV head, its mean over the KV heads (r,) float32: what a draft whose budget varies is priced from."""
    if valid is None:
        return torch.full((index.shape[0],), float(index.shape[-1]), device=index.device)
    return valid.sum(-1).float().mean(-1)


def denominator_exceeded(query: torch.Tensor, keys: torch.Tensor, allowed: torch.Tensor, index: torch.Tensor,
                         valid: torch.Tensor | None, log_weight: torch.Tensor | None, scale: float, epsilon: float,
                         softcap: float | None = None) -> torch.Tensor:
    """The share of each position's query heads whose softmax denominator its selection misses by more than
    ``epsilon`` of it: |D~ - D| > epsilon D, D the sum of exp(s_j - m) over the keys ``allowed`` (r, L), D~ that over
    the selected keys (``index`` (r, Hkv or 1, n) into L, ``valid`` which count) weighted by exp(``log_weight``), the
    scores s at the model's ``scale`` (and ``softcap``), float64 from float32 products. ``query`` (r, Hq, D), ``keys``
    (r, Hkv, L, D). What a draft's promise on the denominator (vAttention's) is measured by: (r,) float32."""
    rows, heads, dim = query.shape
    kv_heads = keys.shape[1]
    group = heads // kv_heads
    scores = (query.float().view(rows, kv_heads, group, dim) @ keys.float().transpose(-1, -2)).double() * scale
    if softcap:
        scores = softcap * torch.tanh(scores / softcap)
    scores = scores.masked_fill(~allowed[:, None, None, :], -math.inf)
    e = (scores - scores.amax(-1, keepdim=True)).exp()  # (r, Hkv, g, L)
    at = index.expand(rows, kv_heads, -1)
    picked = e.gather(-1, at[:, :, None, :].expand(-1, -1, group, -1))
    if log_weight is not None:
        picked = picked * log_weight.double().exp().expand(rows, kv_heads, -1)[:, :, None, :]
    if valid is not None:
        picked = picked * valid.expand(rows, kv_heads, -1)[:, :, None, :]
    whole, estimate = e.sum(-1), picked.sum(-1)
    return ((estimate - whole).abs() > epsilon * whole).double().mean((1, 2)).float()


def request_seed(tokens: Sequence[int]) -> int:
    """A request's seed for a draft that draws at random: zlib's CRC-32 of the tokens before its speculation start,
    each as 8 bytes little-endian signed. Every engine derives it from the same tokens, so requests draw alike
    wherever they run and apart where their contexts differ."""
    return zlib.crc32(struct.pack(f"<{len(tokens)}q", *map(int, tokens)))
