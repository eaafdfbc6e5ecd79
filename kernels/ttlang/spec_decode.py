"""Speculative flash decode in TT-Lang (tile-aligned windows, ``window_align=32``).

For every (sequence, KV head) pair one node streams K/V tiles of 32 positions:
first the tiles of the two sink windows, then the middle tiles. The running
online-softmax state (m, l, o) lives in dataflow buffers; after the window
tiles it is normalised once and written out as the speculative output, then
the same state keeps absorbing the middle tiles and becomes the exact output.
At the end the node reduces ||spec - exact||^2 and ||exact||^2 for the
verification. The query heads of one KV head are the rows of one tile (GQA).

The tile schedule depends on each sequence's cur_pos and is baked in as Python
constants (the TT op reads cur_pos on device instead); masking of positions
past cur_pos comes in as an additive bias tile per sequence.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import ttl
import ttnn

from ... import semantics
from ...constants import TILE



@dataclass(frozen=True)
class PairSchedule:
    """K/V tiles one (sequence, KV head) pair visits: window tiles first, then the middle."""

    seq: int
    window_tiles: tuple[int, ...]
    middle_tiles: tuple[int, ...]


def schedule(cur_pos: list[int], window: int, kv_heads: int) -> list[PairSchedule]:
    """Tile schedule per pair, from the window geometry of :mod:`alspec_eval.semantics` (window_align=32)."""
    if window % TILE:
        raise ValueError(f"window must be a multiple of {TILE}, got {window}")
    wt = window // TILE
    pos = torch.tensor(cur_pos, dtype=torch.long)
    last_start, trivial = semantics.window_bounds(pos, window, TILE)
    ends = semantics.last_window_end(pos, TILE) // TILE
    pairs = []
    for b, (last, end, short) in enumerate(zip((last_start // TILE).tolist(), ends.tolist(), trivial.tolist())):
        if short:  # trivial: everything is the speculative chunk
            win, mid = tuple(range(end)), ()
        else:
            win, mid = tuple(range(wt)) + tuple(range(last, last + wt)), tuple(range(wt, last))
        pairs.extend(PairSchedule(b, win, mid) for _ in range(kv_heads))
    return pairs


def build(pairs: list[PairSchedule], tiles_per_cache: int, scale: float):
    """The TT-Lang operation for one schedule.

    Operands (tile layout): q (P*32, D) with the query heads of pair p in rows
    p*32.., k and v (P*Lt*32, D), bias (B*32, Lt*32) 0 or -inf, rowmask (32, D)
    1 on real query-head rows; outputs spec and exact (P*32, D), d2 and n2
    (P*32, 32) with the pair's sums at element (0, 0).
    """

    @ttl.operation(grid=(1, 1))
    def spec_decode(q, k, v, bias, rowmask, spec, exact, d2, n2) -> None:
        dt = q.shape[1] // TILE
        q_dfb = ttl.make_dataflow_buffer_like(q, shape=(1, dt), block_count=2)
        k_dfb = ttl.make_dataflow_buffer_like(k, shape=(1, dt), block_count=2)
        v_dfb = ttl.make_dataflow_buffer_like(v, shape=(1, dt), block_count=2)
        bias_dfb = ttl.make_dataflow_buffer_like(bias, shape=(1, 1), block_count=2)
        rowmask_dfb = ttl.make_dataflow_buffer_like(rowmask, shape=(1, dt), block_count=2)
        m_dfb = ttl.make_dataflow_buffer_like(d2, shape=(1, 1), block_count=2)
        l_dfb = ttl.make_dataflow_buffer_like(d2, shape=(1, 1), block_count=2)
        o_dfb = ttl.make_dataflow_buffer_like(exact, shape=(1, dt), block_count=2)
        keep_dfb = ttl.make_dataflow_buffer_like(spec, shape=(1, dt), block_count=2)
        spec_dfb = ttl.make_dataflow_buffer_like(spec, shape=(1, dt), block_count=2)
        exact_dfb = ttl.make_dataflow_buffer_like(exact, shape=(1, dt), block_count=2)
        d2_dfb = ttl.make_dataflow_buffer_like(d2, shape=(1, 1), block_count=2)
        n2_dfb = ttl.make_dataflow_buffer_like(n2, shape=(1, 1), block_count=2)

        def normalised(o_blk, l_blk):
            return o_blk / ttl.block.broadcast(l_blk, dims=[-1], shape=(1, dt))

        @ttl.compute()
        def attend():
            for pair in pairs:
                with q_dfb.wait() as q_blk:
                    with m_dfb.reserve() as m_blk, l_dfb.reserve() as l_blk, o_dfb.reserve() as o_blk:
                        m_blk.store(ttl.block.fill(-1e30, shape=(1, 1)))
                        l_blk.store(ttl.block.fill(0, shape=(1, 1)))
                        o_blk.store(ttl.block.fill(0, shape=(1, dt)))
                    n_win = len(pair.window_tiles)
                    n_tiles = n_win + len(pair.middle_tiles)
                    for i in range(n_tiles):
                        with (
                            k_dfb.wait() as k_blk,
                            v_dfb.wait() as v_blk,
                            bias_dfb.wait() as bias_blk,
                            m_dfb.wait() as m_old,
                            l_dfb.wait() as l_old,
                            o_dfb.wait() as o_old,
                        ):
                            s = (q_blk @ ttl.block.transpose(k_blk)) * ttl.block.fill(scale, shape=(1, 1)) + bias_blk
                            m_new = ttl.math.max(m_old, ttl.math.reduce_max(s, dims=[-1], shape=(1, 1)))
                            alpha = ttl.math.exp(m_old - m_new)
                            p = ttl.math.exp(s - ttl.block.broadcast(m_new, dims=[-1], shape=(1, 1)))
                            l_new = l_old * alpha + ttl.math.reduce_sum(p, dims=[-1], shape=(1, 1))
                            o_new = o_old * ttl.block.broadcast(alpha, dims=[-1], shape=(1, dt)) + p @ v_blk
                            if i < n_tiles - 1:  # the last running max has no consumer
                                with m_dfb.reserve() as m_blk:
                                    m_blk.store(m_new)
                            with l_dfb.reserve() as l_blk, o_dfb.reserve() as o_blk:
                                l_blk.store(l_new)
                                o_blk.store(o_new)
                            if i == n_win - 1:  # the window chunk is done: its partial is the approximation
                                approx = normalised(o_new, l_new)
                                with spec_dfb.reserve() as out_blk, keep_dfb.reserve() as keep_blk:
                                    out_blk.store(approx)
                                    keep_blk.store(approx)
                with (
                    l_dfb.wait() as l_blk,
                    o_dfb.wait() as o_blk,
                    keep_dfb.wait() as approx,
                    rowmask_dfb.wait() as rows,
                ):
                    full = normalised(o_blk, l_blk)
                    diff = (approx - full) * rows
                    ref = full * rows
                    with exact_dfb.reserve() as out_blk, d2_dfb.reserve() as d_blk, n2_dfb.reserve() as n_blk:
                        out_blk.store(full)
                        d_blk.store(ttl.math.reduce_sum(diff * diff, dims=[0, 1], shape=(1, 1)))
                        n_blk.store(ttl.math.reduce_sum(ref * ref, dims=[0, 1], shape=(1, 1)))

        @ttl.datamovement()
        def read():
            for p, pair in enumerate(pairs):
                with q_dfb.reserve() as blk:
                    ttl.copy(q[p : p + 1, 0:dt], blk).wait()
                for t in pair.window_tiles + pair.middle_tiles:
                    row = p * tiles_per_cache + t
                    with k_dfb.reserve() as k_blk, v_dfb.reserve() as v_blk, bias_dfb.reserve() as b_blk:
                        tk = ttl.copy(k[row : row + 1, 0:dt], k_blk)
                        tv = ttl.copy(v[row : row + 1, 0:dt], v_blk)
                        tb = ttl.copy(bias[pair.seq : pair.seq + 1, t : t + 1], b_blk)
                        tk.wait()
                        tv.wait()
                        tb.wait()
                with rowmask_dfb.reserve() as blk:
                    ttl.copy(rowmask[0:1, 0:dt], blk).wait()

        @ttl.datamovement()
        def write():
            for p in range(len(pairs)):
                with spec_dfb.wait() as blk:
                    ttl.copy(blk, spec[p : p + 1, 0:dt]).wait()
                with exact_dfb.wait() as blk:
                    ttl.copy(blk, exact[p : p + 1, 0:dt]).wait()
                with d2_dfb.wait() as blk:
                    ttl.copy(blk, d2[p : p + 1, 0:1]).wait()
                with n2_dfb.wait() as blk:
                    ttl.copy(blk, n2[p : p + 1, 0:1]).wait()

    return spec_decode


def from_torch(t, dtype, device):
    """Host tensor to a device tensor in tile layout."""
    return ttnn.from_torch(t, dtype=dtype, layout=ttnn.TILE_LAYOUT, device=device, memory_config=ttnn.DRAM_MEMORY_CONFIG)
