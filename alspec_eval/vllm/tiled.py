"""A~ of a draft whose keys are fixed by position (``Approximation.position_ranges``: the sink, local) over a paged
cache, with no copy of 2S keys per query: consecutive queries of a request form a tile, which reads the union of
their ranges once, through the block table, and each query attends to its own keys in it by mask
(:func:`alspec_eval.semantics.attend`). A prefill of T speculating tokens reads about T / Q (2S + Q) keys in place of
T 2S; a decode step's rows are tiles of one.

Everything that depends on the step's positions alone (the tiles, their key positions, the masks) is built on the
host once per step (:meth:`Tiles.build`) and copied to the device once; per layer the work is device ops only: the
block-table lookup, one gather of the tiles' keys and values per chunk of :data:`VERIFY_BUDGET` bytes, the attention.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from .. import semantics
from ..approximations.base import Ranges

VERIFY_BUDGET = 64 * 2**20  # bytes of one chunk's transient (keys, values, scores) in a layer's verification
TILE = 64  # the most consecutive queries of a request that share one read of their keys
READ = 16  # keys read together from a block (a slice of its keys' memory, not key by key), where the block allows


def tile_size(window: int) -> int:
    """Queries per tile where a request has several in a step: enough that a tile's keys (2S + Q) are read once for
    many queries, few enough that the masked scores (Q (2S + Q)) stay near the needed Q 2S."""
    return max(16, min(TILE, 2 * window))


@dataclass(frozen=True)
class TileGroup:
    """Tiles of the same size Q: per tile its batch row and its n key positions (logical), per (tile, slot) the
    step token whose query it holds and which keys that query reads; per query of the group its flat slot."""

    request: torch.Tensor  # (T,)
    chunks: torch.Tensor  # (T, c): where each read of ``width`` consecutive positions begins (logical), n = c width
    token: torch.Tensor  # (T, Q)
    valid: torch.Tensor | None  # (T, 1, Q, n); None where every query reads every key of its tile
    rows: torch.Tensor  # (m,) indices into the verified rows, tile by tile
    slot: torch.Tensor  # (m,) index into the T Q flattened slots
    offsets: list[int]  # (T + 1) where each tile's rows begin in ``rows``, on the host: chunks slice without a read
    width: int

    def to(self, device: torch.device) -> "TileGroup":
        moved = (None if t is None else t.to(device, non_blocking=True)
                 for t in (self.request, self.chunks, self.token, self.valid, self.rows, self.slot))
        return TileGroup(*moved, self.offsets, self.width)

    def tile_bytes(self, kv_heads: int, heads: int, dim: int, element: int) -> int:
        """The transient of one tile in :func:`approximate`: its keys and values (and their float32 copies), the
        scores, weights and outputs in float32."""
        q_len, n = self.token.shape[1], self.chunks.shape[1] * self.width
        copies = 2 * kv_heads * n * dim * (element + (4 if element != 4 else 0))
        return copies + 3 * heads * q_len * n * 4 + 2 * heads * q_len * dim * 4


@dataclass(frozen=True)
class Tiles:
    """One step's tiles for the verified rows (token, batch row, position each), by tile size."""

    groups: tuple[TileGroup, ...]
    count: int  # verified rows
    found: dict[Any, list[tuple[torch.Tensor, torch.Tensor]]] = field(default_factory=dict, compare=False, repr=False)

    @classmethod
    def build(cls, token: torch.Tensor, request: torch.Tensor, pos: torch.Tensor, prompt: torch.Tensor,
              ranges: Callable[[torch.Tensor], Ranges], window: int, block_size: int) -> "Tiles":
        """Prompt positions (``prompt``: a prefill's, teacher-forced) go in tiles of :func:`tile_size` positions
        fixed by position (tile pos // Q of its request); a generated position (a decode step) is a tile of one.
        A tile reads, per range, from the earliest start to the latest end of the ranges of all its Q positions past
        the trivial edge (whether the step holds them or not), so which keys a query's tile reads, where its own lie
        in them and so its A~'s bits depend on its position alone: not on how vLLM chunked the prompt, the other
        requests or what the prefix cache held. ``ranges``: the draft's ``position_ranges`` at positions. Each range
        is read :data:`READ` keys at a time (aligned, within a block); tiles that read as many keys go together."""
        width = math.gcd(READ, block_size)
        groups: list[TileGroup] = []
        for size, rows in ((1, (~prompt).nonzero().squeeze(1)), (tile_size(window), prompt.nonzero().squeeze(1))):
            if len(rows):
                groups += _groups(rows, size, token, request, pos, ranges, window, width)
        return cls(tuple(groups), len(pos))

    def to(self, device: torch.device) -> "Tiles":
        return Tiles(tuple(g.to(device) for g in self.groups), self.count)

    def rows(self, layout: Any, shape: torch.Size, block_table: torch.Tensor,
             block_size: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per group, where its reads are in a cache of ``shape`` (``layout.chunk_rows``), found through the block
        table once per step and table (every layer of a KV-cache group shares both)."""
        key = (layout.name, tuple(shape), block_table.data_ptr(), block_size)
        if key not in self.found:
            self.found[key] = [layout.chunk_rows(shape, block_table[g.request[:, None], g.chunks // block_size].long(),
                                                 g.chunks % block_size, g.width) for g in self.groups]
        return self.found[key]


def _reads(ranges: Callable[[torch.Tensor], Ranges], tile_index: torch.Tensor, size: int,
           window: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per tile of ``size`` positions (its index in its request) and range: the first key it reads and how many,
    the union of that range over the tile's positions past the trivial edge, (T, K) each."""
    at = (tile_index[:, None] * size + torch.arange(size)).clamp(min=2 * window)  # (T, Q): past the trivial edge
    starts, ends, _ = ranges(at.flatten())
    starts, ends = (x.view(*at.shape, -1) for x in (starts, ends))  # (T, Q, K)
    nonempty = ends > starts
    lo = torch.where(nonempty, starts, 1 << 62).amin(1)
    hi = torch.where(nonempty, ends, -(1 << 62)).amax(1)
    empty = hi < lo  # a range no position of the tile reads: one aligned read, masked
    return torch.where(empty, 0, lo), torch.where(empty, 1, hi - lo)


def _groups(rows: torch.Tensor, size: int, token: torch.Tensor, request: torch.Tensor, pos: torch.Tensor,
            ranges: Callable[[torch.Tensor], Ranges], window: int, width: int) -> list[TileGroup]:
    """The tiles of ``rows``, ``size`` positions each (the tile of position p is p // size of its request), in
    groups of tiles that make as many reads of ``width`` aligned positions per range (:func:`_reads`)."""
    row_pos, row_request = pos[rows], request[rows]
    (tile_request, tile_index), tile = torch.stack([row_request, row_pos // size]).unique(dim=1, return_inverse=True)
    starts, ends, widths = ranges(row_pos)
    if size == 1:  # a tile of one reads its own ranges, as wide as the draft declares (or wider where they are)
        lo, spans = starts, (ends - starts).clamp(min=torch.tensor(widths))
    else:
        lo, spans = _reads(ranges, tile_index, size, window)
    reads = (spans + 2 * width - 2) // width  # aligned reads that cover a span from any start
    shapes, shape_of = reads.unique(dim=0, return_inverse=True)
    groups = []
    for kind, counts in enumerate(shapes.tolist()):
        tiles = (shape_of == kind).nonzero().squeeze(1)
        local = torch.full((len(tile_request),), -1).index_put((tiles,), torch.arange(len(tiles)))
        mine = (local[tile] >= 0).nonzero().squeeze(1)
        groups.append(_group(rows[mine], local[tile[mine]], tile_request[tiles], lo[tiles], counts, size,
                             token, row_pos[mine], starts[mine], ends[mine], width))
    return groups


def _group(rows: torch.Tensor, tile: torch.Tensor, tile_request: torch.Tensor, lo: torch.Tensor, reads: list[int],
           size: int, token: torch.Tensor, row_pos: torch.Tensor, starts: torch.Tensor, ends: torch.Tensor,
           width: int) -> TileGroup:
    """One group's tiles (per verified row its tile, per tile its request and the first key of each range), each
    range read in ``reads[k]`` aligned reads of ``width`` positions from its first key."""
    count = len(tile_request)
    base = lo // width * width
    chunks = torch.cat([base[:, k, None] + width * torch.arange(c) for k, c in enumerate(reads)], 1)  # (T, c)
    key_pos = (chunks[:, :, None] + torch.arange(width)).flatten(1)  # (T, n)
    part = torch.cat([torch.full((c * width,), k) for k, c in enumerate(reads)])  # which range each key is in
    last = torch.zeros(count, dtype=torch.long).scatter_reduce(0, tile, row_pos, "amax")
    chunks = chunks.clamp(min=0).minimum(last[:, None] // width * width)  # readable blocks; masked unless valid
    slot_in = row_pos % size
    queries = torch.zeros(count, size, dtype=torch.long)
    queries[tile, slot_in] = token[rows]
    valid = torch.zeros(count, size, key_pos.shape[1], dtype=torch.bool)
    valid[tile, slot_in] = (key_pos[tile] >= starts[:, part]) & (key_pos[tile] < ends[:, part])
    valid = None if bool(valid.all()) else valid[:, None]  # (decode rows of the sink: every key counts, no mask)
    offsets = [0] + torch.bincount(tile, minlength=count).cumsum(0).tolist()
    order = tile.argsort(stable=True)  # rows tile by tile, so that a chunk of tiles is a slice of them
    return TileGroup(tile_request, chunks, queries, valid, rows[order], (tile * size + slot_in)[order], offsets,
                     width)


def approximate(query: torch.Tensor, kv_cache: torch.Tensor, layout: Any, block_table: torch.Tensor,
                block_size: int, tiles: Tiles, scale: float) -> torch.Tensor:
    """A~ (M, Hq, D) of the verified rows, in their order: every tile's keys and values read through the block
    table (where, found on the step's first layer: :meth:`Tiles.rows`), chunks of tiles up to :data:`VERIFY_BUDGET`
    bytes at a time."""
    heads, dim = query.shape[1], query.shape[2]
    kv_heads = kv_cache.shape[1]
    out = query.new_empty(tiles.count, heads, dim)
    for group, (key_rows, value_rows) in zip(tiles.groups, tiles.rows(layout, kv_cache.shape, block_table,
                                                                      block_size)):
        step = max(1, VERIFY_BUDGET // group.tile_bytes(kv_heads, heads, dim, kv_cache.element_size()))
        size = group.token.shape[1]
        for lo in range(0, len(group.request), step):
            part = slice(lo, lo + step)
            keys, values = layout.read_chunks(kv_cache, (key_rows[part], value_rows[part]), group.width)
            valid = None if group.valid is None else group.valid[part]
            approx = semantics.attend(query[group.token[part]], keys, values, valid, scale)
            chosen = slice(group.offsets[lo], group.offsets[min(lo + step, len(group.request))])
            out[group.rows[chosen]] = approx.flatten(0, 1)[group.slot[chosen] - lo * size]
    return out


def reserve(query: torch.Tensor) -> None:
    """Hold a layer's verification peak for a moment: one chunk's transient (:data:`VERIFY_BUDGET`) and, per token
    of the pass, A~, A and their float32 difference (five (Hq, D) float32 rows at most). In vLLM's profiling pass,
    which sizes the KV cache from the peak it measures at ``max_num_batched_tokens``, this makes the verification's
    peak part of it, so ``gpu_memory_utilization`` holds. Nothing is written (on the CPU no page is touched)."""
    torch.empty(VERIFY_BUDGET + 5 * 4 * query.numel(), dtype=torch.uint8, device=query.device)
