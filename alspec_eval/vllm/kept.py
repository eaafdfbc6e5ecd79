"""What a draft keeps of each page of keys beside vLLM's paged cache (``Approximation.kept_page``: Quest's bounds,
kvpress's Knorm scores, CUR's squared norms), so that a decode step reads each page's summary instead of its keys.

A layer's summaries are one tensor, (num_blocks, N / g, Hkv, F): per physical block of N keys, one summary per part
of g = gcd(page, N) keys; a page is page / g parts, within a block or across blocks, merged when read. They follow
the cache: the parts a step fills are summarized again after the platform's backend has written them
(:func:`keep_written`), so prefix-shared blocks share their summaries, and a block vLLM frees and hands to another
request is summarized again when that request writes it. What the cache held before the draft was configured is
summarized a block at a time (:func:`summarize_blocks`): every block at once, or, on a CPU worker, each at the first
step that holds it. A part only counts once all its keys are written, which is true of every page a draft reads
(full pages before the current one). Torch only, no vLLM.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from .tiled import VERIFY_BUDGET


CPU_CHUNK = 2**19  # bytes of a CPU cache's keys summarized at once when a layer's summaries are made: a chunk's
# copies stay in the processor's caches (a chunk of VERIFY_BUDGET cost 2-5x as much for CUR's norms here)


SHARE = 0.5  # the most of the keys' bytes a layer's summaries may take: past it (Quest's bounds of pages under 4
# keys) a step reads no fewer bytes of summaries than of keys, and the cache beside vLLM's would grow by half or more


def part_size(approx: Any, block_size: int) -> int:
    """Keys per kept part: the largest run that divides both the draft's page and the cache's block."""
    return math.gcd(approx.kept_page(), block_size)


def summarize_parts(kept: torch.Tensor, approx: Any, kv_cache: torch.Tensor, layout: Any, block: torch.Tensor,
                    part: torch.Tensor) -> None:
    """Summarize parts ``part`` (n,) of physical blocks ``block`` (n,) from the keys (and, for a draft that
    ``reads_layer``, the values) the cache holds now, into ``kept``; a part whose keys are not all written yet gets a
    summary no read uses."""
    heads, dim = kv_cache.shape[1], kv_cache.shape[-1] // 2
    size = kv_cache.shape[2] // kept.shape[1]
    step = max(1, VERIFY_BUDGET // (4 * size * heads * dim * kv_cache.element_size()))  # keys, values, copies
    for lo in range(0, len(block), step):
        ids, at = (block, part) if len(block) <= step else (block[lo:lo + step], part[lo:lo + step])
        kept[ids, at] = approx.summarize(*layout.parts(kv_cache, ids, at, size, approx.reads_layer))


def summaries(approx: Any, kv_cache: torch.Tensor) -> tuple[tuple[int, ...], torch.dtype]:
    """The shape and dtype of a layer's summaries of ``kv_cache``: (num_blocks, N / g, Hkv, F), the draft's dtype
    (Knorm's scores: float32)."""
    blocks_all, heads, size = kv_cache.shape[:3]
    g = part_size(approx, size)
    blank = kv_cache.new_zeros(1, g, heads, kv_cache.shape[-1] // 2)
    probe = approx.summarize(blank, blank if approx.reads_layer else None)  # (1, Hkv, F)
    return (blocks_all, size // g, heads, probe.shape[-1]), probe.dtype


def summary_bytes(approx: Any, kv_cache: torch.Tensor) -> int:
    shape, dtype = summaries(approx, kv_cache)
    return math.prod(shape) * dtype.itemsize


def keeps(approx: Any, kv_cache: torch.Tensor) -> bool:
    """Whether a draft keeps summaries of this cache: where it declares ``kept_page`` and they take at most
    :data:`SHARE` of the keys' bytes; else a step reads keys, as for any draft."""
    keys = kv_cache.numel() // 2 * kv_cache.element_size()
    return bool(approx.kept_page()) and summary_bytes(approx, kv_cache) <= SHARE * keys


def allocate(approx: Any, kv_cache: torch.Tensor, layout: Any, blocks: torch.Tensor | None = None) -> torch.Tensor:
    """A layer's summaries: those of physical blocks ``blocks`` (host) made from the cache as it holds them now, the
    others left to :func:`summarize_blocks`; None: every block's (what vLLM wrote before the draft was configured,
    prefix-cached blocks among it)."""
    shape, dtype = summaries(approx, kv_cache)
    try:
        kept = kv_cache.new_empty(shape, dtype=dtype)
    except torch.OutOfMemoryError as err:  # a GPU's: vLLM sized its KV cache to the memory it was allowed
        share = math.prod(shape) * dtype.itemsize / (kv_cache.numel() * kv_cache.element_size())
        raise torch.OutOfMemoryError(
            f"approx={approx.name} keeps summaries beside vLLM's KV cache, {share:.1%} of its size, outside vLLM's "
            f"memory profile, and the device has no room left for them ({err}); leave that much: start the engine "
            "with a lower gpu_memory_utilization (or kv_cache_memory_bytes)") from err
    summarize_blocks(kept, approx, kv_cache, layout, blocks)
    return kept


def summarize_blocks(kept: torch.Tensor, approx: Any, kv_cache: torch.Tensor, layout: Any,
                     blocks: torch.Tensor | None) -> None:
    """Summarize every part of physical blocks ``blocks`` (host; None: every block) from the cache as it holds them
    now, read in place (``all_parts``) a few blocks at a time."""
    heads, size = kv_cache.shape[1:3]
    keys, values = layout.all_parts(kv_cache, size // kept.shape[1], approx.reads_layer)  # (blocks, N / g, g, Hkv, D)
    budget = CPU_CHUNK if kv_cache.device.type == "cpu" else VERIFY_BUDGET
    step = max(1, budget // (4 * size * heads * keys.shape[-1] * kv_cache.element_size()))  # blocks at once
    count = kv_cache.shape[0] if blocks is None else len(blocks)
    for lo in range(0, count, step):
        ids = slice(lo, lo + step) if blocks is None else blocks[lo:lo + step].to(kv_cache.device)
        kept[ids] = approx.summarize(keys[ids], None if values is None else values[ids])


def held_blocks(block_table: torch.Tensor, seq_lens: torch.Tensor, block_size: int) -> torch.Tensor:
    """The physical blocks a step's requests hold (every block of each one's first ``seq_lens`` keys), once each:
    the blocks a step may read summaries of (host)."""
    count = -(-seq_lens.long() // block_size)
    width = int(count.max()) if len(count) else 0
    held = torch.arange(width) < count[:, None]
    return block_table[:len(seq_lens), :width][held].long().unique()


def written_parts(query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
                  size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The parts of ``size`` keys a step fills, as (batch row, logical part) pairs (host): every part whose last key
    it writes. Only a full part's summary is read, and a part is summarized the step it fills, so a decode step
    summarizes a part once every ``size`` steps."""
    requests = len(seq_lens)
    lengths = (query_start_loc[1:requests + 1] - query_start_loc[:requests]).long()
    ends = seq_lens.long()
    first = (ends - lengths) // size
    count = (ends // size - first).clamp(min=0)
    row = torch.repeat_interleave(torch.arange(requests), count)
    offset = torch.arange(int(count.sum())) - torch.repeat_interleave(count.cumsum(0) - count, count)
    return row, first[row] + offset


def written_blocks(block_table: torch.Tensor, written: tuple[torch.Tensor, torch.Tensor],
                   per_block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The physical block and the part within it of each part the step filled (:func:`written_parts`, on the block
    table's device), found through the block table (nothing read back): the same at every layer that shares it."""
    row, part = written
    return block_table[row, part // per_block].long(), part % per_block


def keep_written(kept: torch.Tensor, approx: Any, kv_cache: torch.Tensor, layout: Any,
                 blocks: tuple[torch.Tensor, torch.Tensor]) -> None:
    """Summarize again the parts the step filled, at their physical blocks (:func:`written_blocks`)."""
    if len(blocks[0]):
        summarize_parts(kept, approx, kv_cache, layout, *blocks)


def page_summaries(kept: torch.Tensor, approx: Any, block_table: torch.Tensor, block_size: int,
                   requests: torch.Tensor, length: int) -> torch.Tensor:
    """Every full page's summary of batch rows ``requests`` (b,) up to ``length`` keys, merged from its parts:
    (b, Hkv, length // page, F), what ``prepare_pages`` takes."""
    page, g = approx.kept_page(), block_size // kept.shape[1]
    pages = length // page
    if g == page:  # a page is one part, within its block: whole blocks read, an index a block
        ids = block_table[requests.to(block_table.device, non_blocking=True), :-(-pages * page // block_size)]
        parts = kept.index_select(0, ids.flatten().long()).view(len(requests), -1, *kept.shape[2:])[:, :pages]
        return parts.transpose(1, 2).contiguous()
    starts = torch.arange(pages * page // g, device=block_table.device) * g  # every part's first position
    ids = block_table[requests.to(block_table.device, non_blocking=True)[:, None], starts // block_size].long()
    rows = (ids * kept.shape[1] + starts % block_size // g).flatten()  # each part's row of the flattened summaries
    parts = kept.flatten(0, 1).index_select(0, rows).view(len(requests), -1, *kept.shape[2:])  # (b, pages P / g, ..)
    if page > g:  # a page of several parts (a page of one part is that part's summary)
        parts = approx.merge(parts.view(len(requests), pages, page // g, *parts.shape[2:]))  # (b, pages, Hkv, F)
    return parts.transpose(1, 2).contiguous()  # a page's summary whole: the bounds' products read no strided copy
