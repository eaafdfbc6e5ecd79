"""The contract on a paged cache (vLLM's): an approximation's selection read through a block table equals its
selection from the contiguous, left-padded cache the HF engine holds, on the same keys, queries and prompts.

The paged cache is laid out as vLLM lays it out: blocks of 16 and of 128 tokens in both layouts alspec-vllm reads,
physical blocks in shuffled order, two requests sharing their common prefix's blocks, a prompt observed over
three steps (chunked prefill), a draft's page summaries kept beside the cache (Quest's bounds) as the engine
keeps them, and a draft that ranks by scores scored where its keys lie on the CPU's layout, as the engine's C kernel
scores them (``select_scored``). Torch only: no vLLM, no model (random keys of a family's head geometry).
"""

from __future__ import annotations

import functools

import torch

from ..approximations import Approximation, LayerInputs, Site, draw_inputs, selection
from ..semantics import request_seed
from ..vllm import native
from ..vllm.kept import allocate, keeps
from ..vllm.paged import (CpuVecLayout, PlainLayout, PromptRows, Prompts, Settings, observation_first, observe_layer,
                          selected_positions)

BLOCK_SIZES = (16, 128)
LAYOUTS = (PlainLayout(), CpuVecLayout())
# past the 2S trivial keys: the first two share their first SHARED tokens; the last speculates from position 0
LENGTHS = (150, 97, 262, 60)
SHARED = 64
SPECULATED = 9  # each request's last positions that speculate (a prefill chunk's worth: several per request)
SITE = Site(layer=3)  # where a draft that draws draws: a layer other than the first


class Batch:
    """Random keys, values and queries of four requests (a family's Hq, Hkv and D), as one left-padded batch."""

    def __init__(self, heads: int, kv_heads: int, dim: int, window: int, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.window, self.heads, self.kv_heads = window, heads, kv_heads
        self.lengths = [n + 2 * window for n in LENGTHS]
        self.keys = [torch.randn(kv_heads, n, dim, generator=g) for n in self.lengths]
        self.values = [torch.randn(kv_heads, n, dim, generator=g) for n in self.lengths]
        self.queries = [torch.randn(n, heads, dim, generator=g) for n in self.lengths]  # a query at every position
        for part in (self.keys, self.values):
            part[1][:, :SHARED] = part[0][:, :SHARED]
        self.scale = dim ** -0.5
        self.pos = [torch.arange(n - SPECULATED, n) for n in self.lengths]
        # each prompt ends where its speculation starts; the last has none (speculate_prefill: observed empty)
        self.start = [n - SPECULATED for n in self.lengths[:-1]] + [0]

    def contiguous(self, approx: Approximation) -> list[list[list[int]]]:
        """Per speculated position and KV head, the sorted logical positions selected, as the HF engine selects
        them: one left-padded batch, the prompt observed in one pass that holds every position."""
        longest = max(self.lengths)
        pad = torch.tensor([longest - n for n in self.lengths])
        key = torch.zeros(len(self.lengths), self.kv_heads, longest, self.keys[0].shape[-1])
        value, query = torch.zeros_like(key), torch.zeros(len(self.lengths), self.heads, longest, key.shape[-1])
        for row, n in enumerate(self.lengths):
            key[row, :, longest - n:], value[row, :, longest - n:] = self.keys[row], self.values[row]
            query[row, :, longest - n:] = self.queries[row].transpose(0, 1)
        extra = {"layer": LayerInputs(None, value)} if approx.reads_layer else {}
        observed = None
        if approx.prompt_keys:
            observed = approx.observe_prompt(query, key, self.scale, torch.tensor(self.start) + pad, pad, 0, **extra)
        rows = torch.cat([torch.full((SPECULATED,), row) for row in range(len(self.lengths))])
        pos = torch.cat(self.pos)
        passed = approx.per_pass(pos, pad[rows], longest, self.window, 1,
                                 **draw_inputs(approx, seed=lambda: self.seeds()[rows]))
        prepared = approx.prepare(key, pad, self.window, observed, **extra, **draw_inputs(approx, site=lambda: SITE))
        index, valid, log_weight = selection(approx, approx.select(query[rows, :, pos + pad[rows]], key, rows, pos,
                                                                   pad[rows], self.window, passed, prepared))
        return _sets(index - pad[rows][:, None, None], valid, self.kv_heads, log_weight)

    def paged(self, approx: Approximation, layout: PlainLayout | CpuVecLayout, block_size: int,
              seed: int = 1) -> list[list[list[int]]]:
        """The same through a paged cache in ``layout`` (blocks of ``block_size``, shuffled, the shared prefix's full
        blocks held once), the prompts observed over three steps."""
        cache, table = self.cache(layout, block_size, seed)
        settings = Settings((0.0,), self.window, 1, approx)
        prompts = Prompts()
        if approx.prompt_keys:
            self._observe(approx, cache, layout, table, block_size, settings, prompts)
        request = torch.cat([torch.full((SPECULATED,), row) for row in range(len(self.lengths))])
        pos = torch.cat(self.pos)
        query = torch.cat([q[p] for q, p in zip(self.queries, self.pos)])
        observed = {row: prompts.observed.get((row, 0)) for row in range(len(self.lengths))}
        kept = allocate(approx, cache, layout) if keeps(approx, cache) else None  # as vLLM keeps them
        scorer = functools.partial(native.key_scores, cache, table) if native.usable(layout, cache) else None
        positions, valid, log_weight, _ = selected_positions(query, cache, layout, table, block_size, request, pos,
                                                             settings, observed, kept=kept,
                                                             seed=self.seeds()[request], site=SITE, scorer=scorer)
        return _sets(positions, valid, self.kv_heads, log_weight)

    def seeds(self) -> torch.Tensor:
        """Each prompt's request seed, as both engines derive it (from its tokens: here, its length)."""
        return torch.tensor([request_seed([n]) for n in self.lengths])

    def cache(self, layout: PlainLayout | CpuVecLayout, block_size: int,
              seed: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The paged cache, (blocks, Hkv, N, 2D) packed as ``layout`` reads it, and its block table."""
        dim = self.keys[0].shape[-1]
        shared = SHARED // block_size  # full blocks of the common prefix, held once
        owned = [-(-n // block_size) - (shared if row == 1 else 0) for row, n in enumerate(self.lengths)]
        total = sum(owned)
        physical = torch.randperm(total + 3, generator=torch.Generator().manual_seed(seed))  # 3 blocks no one holds
        width = max(-(-n // block_size) for n in self.lengths) + 2  # the table's rows are wider than any request's
        table = torch.zeros(len(self.lengths), width, dtype=torch.int32)
        cursor = 0
        for row, n in enumerate(self.lengths):
            first = shared if row == 1 else 0
            if row == 1:
                table[1, :shared] = table[0, :shared]
            count = -(-n // block_size) - first
            table[row, first:first + count] = physical[cursor:cursor + count].int()
            cursor += count
        cache = torch.randn(total + 3, self.kv_heads, block_size, 2 * dim)  # junk where nothing was written
        for row, n in enumerate(self.lengths):
            for t in range(n):
                block, offset = int(table[row, t // block_size]), t % block_size
                _write(cache, layout, block, offset, self.keys[row][:, t], self.values[row][:, t])
        return cache, table

    def _observe(self, approx: Approximation, cache: torch.Tensor, layout: PlainLayout | CpuVecLayout,
                 table: torch.Tensor, block_size: int, settings: Settings, prompts: Prompts) -> None:
        """Each request's prompt prefilled in three steps (every request in each), its window observed over them."""
        firsts = torch.tensor([observation_first(s, approx.prompt_window()) for s in self.start])
        starts, tags = torch.tensor(self.start), torch.arange(len(self.lengths))
        # a window of 6 or more positions spans all three steps; an empty prompt is observed at position 0
        cuts = [[0, s - 5, s - 2, s] if s else [0, 1, 2, 3] for s in self.start]
        for step in range(3):
            lengths = torch.tensor([c[step + 1] - c[step] for c in cuts])
            seq_lens = torch.tensor([c[step + 1] for c in cuts])
            query_start_loc = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)])
            rows = PromptRows.build(query_start_loc, seq_lens, firsts, starts, tags)
            query = torch.cat([q[c[step]:c[step + 1]] for q, c in zip(self.queries, cuts)])
            observe_layer(query, cache, layout, table, block_size, rows, settings, 0, self.scale, prompts)


def _write(cache: torch.Tensor, layout: PlainLayout | CpuVecLayout, block: int, offset: int, key: torch.Tensor,
           value: torch.Tensor) -> None:
    """One token's key and value (Hkv, D) into ``cache`` as ``layout`` packs them."""
    dim = key.shape[-1]
    if isinstance(layout, CpuVecLayout):
        size = cache.shape[2]
        flat = cache[block].view(cache.shape[1], 2 * size * dim)
        flat[:, :size * dim].view(-1, dim, size)[:, :, offset] = key
        flat[:, size * dim:].view(-1, size, dim)[:, offset] = value
    else:
        cache[block, :, offset, :dim], cache[block, :, offset, dim:] = key, value


def _sets(index: torch.Tensor, valid: torch.Tensor | None, kv_heads: int,
          log_weight: torch.Tensor | None = None) -> list[list[list]]:
    """Per position and KV head, the sorted keys counted, each with its log-weight where the draft weights them."""
    index = index.expand(-1, kv_heads, -1)
    keep = torch.ones_like(index, dtype=torch.bool) if valid is None else valid.expand_as(index)
    weight = torch.zeros(index.shape) if log_weight is None else log_weight.float().expand(index.shape)
    return [[sorted(zip(index[m, h][keep[m, h]].tolist(), weight[m, h][keep[m, h]].tolist()))
             for h in range(kv_heads)] for m in range(index.shape[0])]


def paged_equals_contiguous(approx: Approximation, heads: int, kv_heads: int, dim: int, window: int) -> list[str]:
    """What differs between the paged and the contiguous selections, one line per layout and block size (empty:
    equal everywhere)."""
    batch = Batch(heads, kv_heads, dim, window)
    expected = batch.contiguous(approx)
    broken = []
    for layout in LAYOUTS:
        for block_size in BLOCK_SIZES:
            got = batch.paged(approx, layout, block_size)
            wrong = [m for m, (a, b) in enumerate(zip(got, expected, strict=True)) if a != b]
            if wrong:
                broken.append(f"{layout.name} cache, blocks of {block_size}: {len(wrong)} of {len(expected)} "
                              f"positions select other keys than from a contiguous cache")
    if broken and not approx.reads_keys:
        broken.append("the draft declares reads_keys = False, so vLLM reads no context for it (its keys are NaN "
                      "there): declare reads_keys = True if prepare or select read the keys")
    return broken
