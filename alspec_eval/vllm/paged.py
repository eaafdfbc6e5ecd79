"""ALSpec over a paged KV cache (vLLM): the backends it wraps and how each one's cache is read (:data:`BACKENDS`),
which tokens of a step speculate (:class:`StepRows`), and the keys a draft selects for them, read through the block
table (:func:`gathered`, the reference every verifier of :mod:`.verifiers` is tested against).

Torch only, no vLLM: the tests call it on synthetic caches in every layout :data:`BACKENDS` reads. The rules
(windows, trivial positions, d and n, acceptance, A~'s arithmetic) are :mod:`alspec_eval.semantics`'.
"""

from __future__ import annotations

import collections
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from .. import semantics
from ..approximations.base import Ranges, Site, draw_inputs, selection
from ..bounds import Breaches
from ..errors import ConfigError
from ..measures import Selection, measure, measures_keys
from .kept import page_summaries
from .native import read_blocks
from .tiled import VERIFY_BUDGET

# vLLM's caches arrive in the attention call as (num_blocks, Hkv, N, 2D): per block and KV head, N keys and their
# values. How the 2D elements of a (block, head) are packed depends on the backend and, on the CPU, its ISA.


# a verifier's scores of keys where they lie: (queries (r, Hq, D), batch rows (r,), positions (r,), width) ->
# semantics.key_scores of each row against its request's keys up to its position, (r, Hkv, width), -inf past it
Scorer = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, int], torch.Tensor]


class LayoutError(ConfigError):
    """A cache layout the adapters do not know, or one that reads back other keys than were written."""


@dataclass(frozen=True)
class PlainLayout:
    """FlashAttention's and Triton's: (num_blocks, Hkv, N, 2D) with a token's key in the first D of its last
    dimension and its value in the last D (their ``kv_cache.transpose(1, 2).split(D, -1)``). The view's strides
    are the allocation's ``KVCacheLayout`` (on CUDA by default NHD: a permuted view, not contiguous), so every read
    here indexes the view; none flattens it."""

    name: str = "plain"
    native: bool = False  # read by verify_cpu.c (:mod:`.native`)
    triton: bool = True  # read by the paged Triton verifier on CUDA (:mod:`alspec_eval.kernels.triton_verify`)

    def halves(self, kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The keys and the values, (num_blocks, Hkv, N, D) views each."""
        dim = kv_cache.shape[-1] // 2
        return kv_cache[..., :dim], kv_cache[..., dim:]

    def gather(self, kv_cache: torch.Tensor, block: torch.Tensor,
               offset: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values at (block, offset), both (M, Hkv, n); returns two (M, Hkv, n, D)."""
        dim = kv_cache.shape[-1] // 2
        head = torch.arange(kv_cache.shape[1], device=block.device)[None, :, None]
        rows = kv_cache[block, head, offset]  # (M, Hkv, n, 2D)
        return rows[..., :dim], rows[..., dim:]

    def blocks(self, kv_cache: torch.Tensor, ids: torch.Tensor,
               values: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The keys (and values) of whole blocks ``ids`` (R, nb), in order: (R, Hkv, nb N, D) each; only the halves
        asked for are copied."""
        rows, count = ids.shape
        dim, heads, size = kv_cache.shape[-1] // 2, kv_cache.shape[1], kv_cache.shape[2]

        def read(half: torch.Tensor) -> torch.Tensor:
            return half[ids].transpose(1, 2).reshape(rows, heads, count * size, dim)

        return read(kv_cache[..., :dim]), read(kv_cache[..., dim:]) if values else None

    def parts(self, kv_cache: torch.Tensor, block: torch.Tensor, part: torch.Tensor, size: int,
              values: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The keys (and values) of part ``part`` (n,) of ``size`` keys of blocks ``block`` (n,): (n, size, Hkv, D)
        each."""
        dim = kv_cache.shape[-1] // 2

        def read(half: torch.Tensor) -> torch.Tensor:
            return half.unflatten(2, (-1, size))[block, :, part].transpose(1, 2)

        return read(kv_cache[..., :dim]), read(kv_cache[..., dim:]) if values else None

    def all_parts(self, kv_cache: torch.Tensor, size: int,
                  values: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Every block's keys (and values) in parts of ``size``: (blocks, N / size, size, Hkv, D) views, nothing
        copied."""
        dim = kv_cache.shape[-1] // 2

        def view(half: torch.Tensor) -> torch.Tensor:
            return half.unflatten(2, (-1, size)).permute(0, 2, 3, 1, 4)

        return view(kv_cache[..., :dim]), view(kv_cache[..., dim:]) if values else None

    def chunk_rows(self, shape: torch.Size, block: torch.Tensor, start: torch.Tensor,
                   width: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Where the ``width`` consecutive slots from ``start`` of blocks ``block`` (both (T, c)) are, for
        :meth:`read_chunks`: the blocks and the slots, (T, c, 1, 1) and (T, c, 1, width), indices of the view."""
        slot = start[..., None] + torch.arange(width, device=start.device)
        return block[..., None, None], slot[:, :, None, :]

    def read_chunks(self, kv_cache: torch.Tensor, rows: tuple[torch.Tensor, torch.Tensor],
                    width: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The keys and values :meth:`chunk_rows` located: two (T, Hkv, c width, D), a slice of slots a row."""
        block, slot = rows
        (tiles, count), heads, twice = block.shape[:2], kv_cache.shape[1], kv_cache.shape[-1]
        head = torch.arange(heads, device=block.device)[:, None]
        both = kv_cache[block, head, slot]  # (T, c, Hkv, width, 2D), whatever the view's strides
        both = both.transpose(1, 2).reshape(tiles, heads, count * width, twice)
        return both[..., :twice // 2], both[..., twice // 2:]


@dataclass(frozen=True)
class CpuVecLayout:
    """vLLM's CPU_ATTN with the ``vec`` ISA: a (block, head)'s 2ND elements hold its N keys transposed, as a (D, N)
    matrix, then its N values as an (N, D) one."""

    name: str = "cpu-vec"
    native: bool = True
    triton: bool = False

    def gather(self, kv_cache: torch.Tensor, block: torch.Tensor,
               offset: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        blocks, heads, size, twice = kv_cache.shape
        dim = twice // 2
        flat = kv_cache.view(blocks, heads, size * twice)
        keys_t = flat[..., :size * dim].view(blocks, heads, dim, size)  # (block, head, D, N): keys transposed
        values = flat[..., size * dim:].view(blocks, heads, size, dim)
        head = torch.arange(heads, device=block.device)[None, :, None]
        return keys_t[block, head, :, offset], values[block, head, offset]

    def blocks(self, kv_cache: torch.Tensor, ids: torch.Tensor,
               values: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
        """In one pass of the C kernel where it reads this cache (:func:`.native.read_blocks`), else torch's."""
        read = read_blocks(kv_cache, ids, values)
        return read if read is not None else self.blocks_by_torch(kv_cache, ids, values)

    def blocks_by_torch(self, kv_cache: torch.Tensor, ids: torch.Tensor,
                        values: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
        """:meth:`blocks` in torch ops: a copy of each block selected, then of its keys transposed."""
        _, heads, size, twice = kv_cache.shape
        dim, (rows, count) = twice // 2, ids.shape
        flat = kv_cache.view(-1, heads, size * twice)
        ids = ids.flatten()  # whole rows of blocks selected (a copy of each), not element by element
        keys = flat[..., :size * dim].index_select(0, ids).view(rows, count, heads, dim, size).permute(0, 2, 1, 4, 3)
        keys = keys.reshape(rows, heads, count * size, dim)
        if not values:
            return keys, None
        picked = flat[..., size * dim:].index_select(0, ids).view(rows, count, heads, size, dim).transpose(1, 2)
        return keys, picked.reshape(rows, heads, count * size, dim)

    def parts(self, kv_cache: torch.Tensor, block: torch.Tensor, part: torch.Tensor, size: int,
              values: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        blocks, heads, length, twice = kv_cache.shape
        dim = twice // 2
        flat = kv_cache.view(blocks, heads, length * twice)
        keys_t = flat[..., :length * dim].view(blocks, heads, dim, -1, size)
        keys = keys_t[block, :, :, part].permute(0, 3, 1, 2)
        if not values:
            return keys, None
        return keys, flat[..., length * dim:].view(blocks, heads, -1, size, dim)[block, :, part].transpose(1, 2)

    def all_parts(self, kv_cache: torch.Tensor, size: int,
                  values: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        blocks, heads, length, twice = kv_cache.shape
        dim = twice // 2
        flat = kv_cache.view(blocks, heads, length * twice)
        keys = flat[..., :length * dim].view(blocks, heads, dim, -1, size).permute(0, 3, 4, 1, 2)
        if not values:
            return keys, None
        return keys, flat[..., length * dim:].view(blocks, heads, -1, size, dim).permute(0, 2, 3, 1, 4)

    def chunk_rows(self, shape: torch.Size, block: torch.Tensor, start: torch.Tensor,
                   width: int) -> tuple[torch.Tensor, torch.Tensor]:
        """A key slice is D runs of ``width`` (the keys are stored transposed, D x N): (T, c, Hkv, D) rows of
        ``width``; a value slice is one run: (T, c, Hkv) rows of ``width`` D."""
        _, heads, size, twice = shape
        dim = twice // 2
        head = (block[..., None] * heads + torch.arange(heads, device=block.device)) * (size * twice)  # (T, c, H)
        start = start[..., None]
        key_rows = (head[..., None] + torch.arange(dim, device=block.device) * size + start[..., None]) // width
        return key_rows, (head + size * dim + start * dim) // (width * dim)

    def read_chunks(self, kv_cache: torch.Tensor, rows: tuple[torch.Tensor, torch.Tensor],
                    width: int) -> tuple[torch.Tensor, torch.Tensor]:
        key_rows, value_rows = rows
        tiles, count, heads, dim = key_rows.shape
        keys = kv_cache.view(-1, width).index_select(0, key_rows.flatten()).view(tiles, count, heads, dim, width)
        keys = keys.permute(0, 2, 1, 4, 3).reshape(tiles, heads, count * width, dim)
        values = kv_cache.view(-1, width * dim).index_select(0, value_rows.flatten())
        return keys, values.view(tiles, count, heads, width, dim).transpose(1, 2).reshape(tiles, heads, count * width,
                                                                                           dim)


@dataclass(frozen=True)
class Wrapped:
    """A vLLM attention backend alspec-vllm speculates on: the class of :mod:`.backends` that wraps it (registered
    over its name by :mod:`.plugin`) and how its cache is read, by the backend's ISA (None where it has none)."""

    wrapper: str
    layouts: dict[str | None, PlainLayout | CpuVecLayout]


# the one list of the backends alspec-vllm wraps, by vLLM's AttentionBackendEnum name
BACKENDS: dict[str, Wrapped] = {
    "CPU_ATTN": Wrapped("cpu.ALSpecCPUAttentionBackend", {"vec": CpuVecLayout()}),
    "FLASH_ATTN": Wrapped("flash.ALSpecFlashAttentionBackend", {None: PlainLayout()}),
    "FLEX_ATTENTION": Wrapped("flex.ALSpecFlexAttentionBackend", {None: PlainLayout()}),
    "TRITON_ATTN": Wrapped("triton.ALSpecTritonAttentionBackend", {None: PlainLayout()}),
}


def layout_for(backend: str, isa: str | None = None) -> PlainLayout | CpuVecLayout:
    """The adapter of a backend's cache, or one line refusing it (never read a cache wrongly)."""
    layout = BACKENDS[backend].layouts.get(isa) if backend in BACKENDS else None
    if layout is None:
        known = ", ".join(f"{b}" + (f" (isa {i})" if i else "") for b, w in BACKENDS.items() for i in w.layouts)
        raise LayoutError(f"alspec-vllm cannot read the KV cache of vLLM's {backend}"
                          + (f" with isa {isa}" if isa else "") + f": it reads {known}; on the CPU use dtype=float32 "
                          "or float16 (bfloat16 on AMX packs keys otherwise), on CUDA attention_backend=FLASH_ATTN, "
                          "TRITON_ATTN or FLEX_ATTENTION, and no fp8 kv_cache_dtype")
    return layout


@dataclass(frozen=True)
class Settings:
    """What the workers speculate with (one engine, one cell): every layer's threshold (a lambda, or config.OFF,
    REJECT, ALWAYS), the window and its alignment, and the approximation."""

    thresholds: tuple[float, ...]
    window: int
    window_align: int
    approx: Any
    check_layout: bool = False  # compare the newest key read back with the incoming one at every step (tests)
    dump: bool = False  # keep every verified row's inputs, contexts and outputs for an outside reference (tests)
    first_kv_head: int = 0  # the model's index of this worker's first KV head (tensor parallel: its rank's share)
    # the draft's selections that reached outside [0, pos], counted where found; the driver takes them (bounds.py)
    breaches: Breaches = field(default_factory=Breaches, compare=False, repr=False)


@dataclass(frozen=True)
class StepRows:
    """The tokens of one step that speculate: their index in the step's flattened tokens, their request's batch row
    (its block-table row), their logical position, and the request's tag (the driver's id for it)."""

    token: torch.Tensor
    request: torch.Tensor
    pos: torch.Tensor
    tag: torch.Tensor
    prompt: torch.Tensor  # which are prompt positions (teacher-forced; the rest were generated)
    seed: torch.Tensor  # the request's seed (semantics.request_seed), for a draft that draws at random
    plans: dict[Any, Any] = field(default_factory=dict, compare=False, repr=False)  # verifiers.plan's, per verifier

    @classmethod
    def build(cls, query_start_loc: torch.Tensor, seq_lens: torch.Tensor, starts: torch.Tensor,
              tags: torch.Tensor, prompt_lens: torch.Tensor | None = None,
              seeds: torch.Tensor | None = None) -> "StepRows":
        """From the step's metadata (``query_start_loc`` (R + 1,), ``seq_lens`` (R,)) and, per request, where its
        speculation starts (``starts``; a position past any context where it does not speculate), its tag, its
        prompt's length (None: a request's tokens are its prompt's where the step holds more than one) and its
        seed (None: 0)."""
        requests = len(seq_lens)
        qsl = query_start_loc[:requests + 1].long().cpu()
        lengths = qsl[1:] - qsl[:-1]
        request = torch.repeat_interleave(torch.arange(requests), lengths)
        token = torch.arange(int(qsl[-1]))
        pos = token - qsl[:-1][request] + (seq_lens.long().cpu() - lengths)[request]
        keep = pos >= starts.long()[request]
        prompt = pos < prompt_lens.long()[request] if prompt_lens is not None else lengths[request] > 1
        seed = torch.zeros_like(request) if seeds is None else seeds.long()[request]
        return cls(token[keep], request[keep], pos[keep], tags.long()[request][keep], prompt[keep], seed[keep])

    def newest(self, query_start_loc: torch.Tensor, seq_lens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor,
                                                                                     torch.Tensor]:
        """Every request's newest token of the step: its index, batch row and position (the layout check)."""
        requests = len(seq_lens)
        qsl = query_start_loc[:requests + 1].long().cpu()
        keep = qsl[1:] > qsl[:-1]
        return (qsl[1:] - 1)[keep], torch.arange(requests)[keep], (seq_lens.long().cpu() - 1)[keep]


def position_keys(settings: Settings, pos: torch.Tensor, device: torch.device) -> Ranges:
    """The ranges of a draft that declares ``keys_by_position`` at the host positions ``pos``, cut to [0, pos];
    what reached outside is counted in ``settings.breaches`` (copied to ``device`` only where any did)."""
    approx = settings.approx
    ranges = approx.position_ranges(pos, settings.window, settings.window_align)
    if ranges is None:
        raise ConfigError(f"the draft {approx.label} declares keys_by_position, but its position_ranges returned "
                          "None: return its ranges, or declare keys_by_position = False")
    starts, ends, outside = semantics.readable_ranges(*ranges[:2], pos)
    if bool(outside.any()):
        settings.breaches.add(outside.to(device), pos.to(device))
    return starts, ends, ranges[2]


def readable_ranges(approx: Any, pos: torch.Tensor, window: int, window_align: int) -> Ranges:
    """The draft's ``position_ranges`` at ``pos`` cut to [0, pos] (:func:`.semantics.readable_ranges`): what the
    tiles read, at the rows' positions and at any the tiles probe."""
    starts, ends, widths = approx.position_ranges(pos, window, window_align)
    return (*semantics.readable_ranges(starts, ends, pos)[:2], widths)


@dataclass(frozen=True)
class PromptRows:
    """The tokens of one step in a request's observation window: its prompt's last positions, whose queries a
    prompt-scoring draft reads (``Approximation.observe_prompt``), [first, end) with end = max(start, 1) (an empty
    prompt is observed, empty, at position 0); per token the window's first position and the prompt's end."""

    token: torch.Tensor
    request: torch.Tensor
    pos: torch.Tensor
    tag: torch.Tensor
    first: torch.Tensor
    start: torch.Tensor

    @classmethod
    def build(cls, query_start_loc: torch.Tensor, seq_lens: torch.Tensor, firsts: torch.Tensor, starts: torch.Tensor,
              tags: torch.Tensor) -> "PromptRows":
        every = StepRows.build(query_start_loc, seq_lens, firsts, tags)  # the tokens at or past each window's first
        start = starts.long()[every.request]
        keep = every.pos < start.clamp(min=1)
        return cls(every.token[keep], every.request[keep], every.pos[keep], every.tag[keep],
                   firsts.long()[every.request][keep], start[keep])


def observation_first(start: int, window: int) -> int:
    """The first position of the observation window of a prompt that ends at ``start`` (where speculation starts),
    for a draft that reads its last ``window`` queries."""
    return start - min(window, start)


OBSERVATIONS_KEPT = 4096  # prompts (under one draft and window) whose observations a worker keeps across calls (each
# 2S key indices per KV head and layer: 48 MB at 4,096 of a 32-layer model with 8 KV heads and S = 64), the least
# recently used dropped


@dataclass
class Prompts:
    """What a worker keeps of requests across steps, per (request tag, layer): for a prompt-scoring draft the queries
    of the observation window until the prompt's end has passed the layer, then what ``observe_prompt`` made of
    them; for a draft that ``keeps_scores``, the store its settled scores are kept in. Across calls, per (prompt
    digest, layer) under each draft and window (:func:`observation_scope`: a sweep's cells of other drafts between
    them keep them), the observations themselves (``kept``, the :data:`OBSERVATIONS_KEPT` used last): a prompt seen
    again is not observed again, and where every worker holds it the driver lets vLLM's prefix cache serve its
    observation window (:mod:`.prefix_cache`). ``digests``: each live request's prompt digest and whether the
    driver counted on the workers holding it."""

    queries: dict[tuple[int, int], torch.Tensor] = field(default_factory=dict)
    observed: dict[tuple[int, int], Any] = field(default_factory=dict)
    settled: dict[tuple[int, int], dict] = field(default_factory=dict)
    digests: dict[int, tuple[int, bool]] = field(default_factory=dict)
    kept: collections.OrderedDict = field(default_factory=collections.OrderedDict)

    def prune(self, live: set[int]) -> None:
        """Forget the requests no longer in the engine (a preempted request keeps what it observed and what
        settled: its keys are computed again, as they were); the observations kept by prompt stay."""
        for kept in (self.queries, self.observed, self.settled):
            for key in [k for k in kept if k[0] not in live]:
                del kept[key]
        for tag in [t for t in self.digests if t not in live]:
            del self.digests[tag]

    def held(self, scope: tuple, layers: list[int]) -> list[int]:
        """The prompts (digests) observed under ``scope`` at every one of ``layers``, after the least recently used
        beyond :data:`OBSERVATIONS_KEPT` (prompts under a scope) are dropped: what the driver may count on at the next
        call."""
        recent = list(dict.fromkeys((s, digest) for s, digest, _ in reversed(self.kept)))  # most recently used first
        dropped = set(recent[OBSERVATIONS_KEPT:])
        for key in [k for k in self.kept if k[:2] in dropped]:
            del self.kept[key]
        return sorted(d for s, d in recent[:OBSERVATIONS_KEPT]
                      if s == scope and all((s, d, layer) in self.kept for layer in layers))


def observation_scope(settings: Settings) -> tuple:
    """What a kept observation was made under: the draft (its arguments) and the window, whose budget it is cut to
    (``Approximation.kept_observation``)."""
    return settings.approx, settings.window


def slots(block_table: torch.Tensor, request: torch.Tensor, pos: torch.Tensor,
          block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The physical block and offset of logical position ``pos`` of batch row ``request`` (broadcast together)."""
    table = block_table.long()
    return table[request, pos // block_size], pos % block_size


def check_newest(kv_cache: torch.Tensor, layout: Any, block_table: torch.Tensor, block_size: int,
                 key: torch.Tensor, token: torch.Tensor, request: torch.Tensor, pos: torch.Tensor) -> None:
    """The key read back at each request's newest position must equal the incoming key, bit for bit."""
    if not len(token):
        return
    block, offset = slots(block_table, request[:, None], pos[:, None], block_size)
    heads = kv_cache.shape[1]
    read, _ = layout.gather(kv_cache, block.expand(-1, heads)[..., None], offset.expand(-1, heads)[..., None])
    if not torch.equal(read[..., 0, :], key[token.to(key.device)].to(read.dtype)):
        raise LayoutError(f"alspec-vllm read other keys back from the KV cache than were written (layout "
                          f"{layout.name}): this vLLM stores its cache otherwise; use a vLLM alspec-eval is tested "
                          "with (the [vllm] extra)")


def contexts(kv_cache: torch.Tensor, layout: Any, block_table: torch.Tensor, block_size: int,
             rows: StepRows) -> tuple[torch.Tensor, torch.Tensor]:
    """Every row's whole context as the cache holds it, (M, Hkv, max pos + 1, D) keys and values, positions past a
    row's own left as position 0's (an outside reference masks them): what a test recomputes A and A~ from."""
    span = torch.arange(int(rows.pos.max()) + 1)
    positions = torch.where(span <= rows.pos[:, None], span, 0)[:, None, :].expand(-1, kv_cache.shape[1], -1)
    block, offset = slots(block_table, rows.request[:, None, None].to(block_table.device),
                          positions.to(block_table.device), block_size)
    return layout.gather(kv_cache, block, offset)


CONTEXT_BUDGET = 128 * 2**20  # bytes of contexts read from the paged cache at once, unless one request's is larger


def read_contexts(kv_cache: torch.Tensor, layout: Any, block_table: torch.Tensor, block_size: int,
                  request: torch.Tensor, length: torch.Tensor,
                  values: bool = True) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """The keys (and values) of batch rows ``request`` (b,) up to the longest ``length``, read through the block
    table a block at a time: (b, Hkv, max length, D) each, and each row's padding (zeros: a shorter row's keys past
    its length are other blocks', which no draft reads, as none reads a key past its position)."""
    most = int(length.max())
    ids = block_table[request.to(block_table.device, non_blocking=True), :-(-most // block_size)].long()
    keys, held = layout.blocks(kv_cache, ids, values)
    return keys[:, :, :most], None if held is None else held[:, :, :most], torch.zeros_like(ids[:, 0])


def unread_contexts(kv_cache: torch.Tensor, count: int, length: int,
                    values: bool) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """What :func:`read_contexts` returns, for a draft that reads no key (``reads_keys = False``): its shape, dtype
    and device, every element NaN and nothing read or allocated (one element, broadcast)."""
    heads, dim = kv_cache.shape[1], kv_cache.shape[-1] // 2
    nothing = kv_cache.new_full((), math.nan).expand(count, heads, length, dim)
    return nothing, nothing if values else None, torch.zeros(count, dtype=torch.long, device=kv_cache.device)


def _layer_inputs(approx: Any, values: torch.Tensor | None) -> dict[str, Any]:
    """What a draft that reads the layer gets inside vLLM: the values, and no HF module (``hf_only`` drafts are
    refused before the engine starts)."""
    from ..approximations import LayerInputs

    return {"layer": LayerInputs(None, values)} if approx.reads_layer else {}


def observe_layer(query: torch.Tensor, kv_cache: torch.Tensor, layout: Any, block_table: torch.Tensor,
                  block_size: int, rows: PromptRows, settings: Settings, layer: int, scale: float,
                  prompts: Prompts) -> None:
    """Keep this layer's queries of each request's observation window, and where the window's last position is in
    the step, let the draft score the prompt (``observe_prompt``) from them and the prompt's keys in the cache. A
    prompt split over several steps (chunked prefill) is observed whole, once."""
    lam = settings.thresholds[layer]
    if math.isnan(lam) or lam == -math.inf or not len(rows.token):
        return
    approx = settings.approx
    for tag in rows.tag.unique().tolist():
        key = (tag, layer)
        if key in prompts.observed:  # a recompute after preemption: observed before
            continue
        digest, held = prompts.digests.get(tag, (None, False))
        stored = (observation_scope(settings), digest, layer)
        if stored in prompts.kept:  # this prompt, observed in an earlier call
            prompts.kept.move_to_end(stored)
            prompts.observed[key] = prompts.kept[stored]
            continue
        if held:
            raise RuntimeError(f"alspec-vllm: the driver counted on this worker holding the observation of a prompt "
                               f"(digest {digest}) at layer {layer}, which it does not hold; its observation window "
                               "may have come from the prefix cache unobserved")
        mine = (rows.tag == tag).nonzero().squeeze(1)
        first, start = int(rows.first[mine[0]]), int(rows.start[mine[0]])
        end = max(start, 1)
        kept = prompts.queries.get(key)
        if kept is None:
            kept = prompts.queries[key] = query.new_zeros(end - first, *query.shape[1:])
        kept[(rows.pos[mine] - first).to(query.device)] = query[rows.token[mine].to(query.device)]
        if int(rows.pos[mine].max()) != end - 1:
            continue
        keys, values, _ = read_contexts(kv_cache, layout, block_table, block_size, rows.request[mine[:1]],
                                        torch.tensor([end]), approx.reads_layer)
        device = keys.device
        observation = approx.observe_prompt(
            kept.transpose(0, 1)[None], keys, scale, torch.tensor([start], device=device),
            torch.zeros(1, dtype=torch.long, device=device), first, **_layer_inputs(approx, values))
        prompts.observed[key] = approx.kept_observation(observation, settings.window)
        del prompts.queries[key]
        if digest is not None:
            prompts.kept[stored] = prompts.observed[key]


def selected_positions(query: torch.Tensor, kv_cache: torch.Tensor, layout: Any, block_table: torch.Tensor,
                       block_size: int, request: torch.Tensor, pos: torch.Tensor, settings: Settings,
                       observed: dict[int, Any], groups: Contexts | None = None, kept: torch.Tensor | None = None,
                       seed: torch.Tensor | None = None, site: Site | None = None, scale: float = 1.0,
                       scorer: Scorer | None = None, read: list[tuple[torch.Tensor, torch.Tensor]] | None = None,
                       native: bool = False
                       ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None, dict[str, torch.Tensor]]:
    """The logical positions of A~'s keys for speculating rows (their queries (M, Hq, D), batch rows, positions):
    (M, Hkv or 1, n), which count (None: all), and a weighted draft's log-weights (None: none). Where they depend on
    the position alone (``position_ranges``), its ranges listed, as the other paths read them (cut to [0, pos]:
    :func:`.semantics.readable_ranges`); else each request's context is read from the cache (:func:`read_contexts`,
    requests chunked to :data:`CONTEXT_BUDGET`), the draft selects as on the HF engine (``per_pass``, ``prepare``,
    ``select``) and its keys are moved into [0, pos] (:func:`.semantics.readable_keys`). What reached outside is
    counted in ``settings.breaches``. ``observed``: per batch row, what a prompt-scoring draft kept of its prompt at
    this layer, or the store of a draft that ``keeps_scores``. ``groups``: the rows' requests grouped for reading
    (:class:`Contexts`), where the step built them once for all its layers. ``kept``: the layer's page summaries of a
    draft that keeps them (:mod:`.kept`), prepared from instead of the keys. ``seed`` (the rows' request seeds) and
    ``site`` (the layer's): what a draft that draws at random draws from. Last, what the draft's declarations ask
    each row to measure (:func:`.measures.measure`, at the model's ``scale``; none for a draft fixed by position).
    ``scorer``: where the verifier scores keys where they lie (:data:`Scorer`), a draft that ``ranks_by_scores``
    (and measures no key) selects from its scores, and no context is read. ``read``: where given, each group's
    requests (batch rows) and the keys read for them are appended to it, for a verifier that reads A~'s keys there.
    ``native``: a draft that keeps page summaries selects from them in one native call where it offers one
    (``Approximation.select_kept``: the CPU verifier's), else prepares from them and selects."""
    if settings.approx.keys_by_position:
        return *_listed(*position_keys(settings, pos, query.device)), None, {}
    if groups is None:
        groups = Contexts.build(request, pos, settings.approx, kv_cache)
    seed = torch.zeros_like(pos) if seed is None else seed
    if not settings.approx.ranks_by_scores or measures_keys(settings.approx):
        scorer = None
    once = settings.approx.same_at_every_layer and not measures_keys(settings.approx)
    if once and groups.selected:
        positions, valid, log_weight, measures = groups.selected[0]
    else:
        positions, valid, log_weight, measures = _selected(query, kv_cache, layout, block_table, block_size, pos,
                                                           settings, observed, groups, kept, seed,
                                                           site or Site(0, settings.first_kv_head), scale, scorer,
                                                           read, native)
        if once:
            groups.selected.append((positions, valid, log_weight, measures))
    last = pos.to(positions.device, non_blocking=True)[:, None, None]
    positions, outside = semantics.readable_keys(positions, valid, torch.zeros_like(last), last)
    settings.breaches.add(outside, pos)
    return positions, valid, log_weight, measures


def _listed(starts: torch.Tensor, ends: torch.Tensor,
            widths: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The keys of ranges [starts, ends) (R, K) listed, range after range, ``widths[k]`` slots for range k: (R, 1, n)
    logical positions and which count (None: all)."""
    slot = [torch.arange(w, device=starts.device) for w in widths]
    positions = torch.cat([starts[:, k, None] + s for k, s in enumerate(slot)], 1)
    valid = torch.cat([s < (ends - starts)[:, k, None] for k, s in enumerate(slot)], 1)
    return positions[:, None, :], None if bool(valid.all()) else valid[:, None, :]


@dataclass(frozen=True)
class Group:
    """Requests whose contexts are read together, and the step's rows that select from them (host tensors)."""

    group: torch.Tensor  # its requests, as indices into Contexts.requests
    mine: torch.Tensor  # its rows, as indices into the step's selecting rows
    local: torch.Tensor  # each row's request, as an index into the group
    requests: torch.Tensor  # its requests' batch rows
    lengths: torch.Tensor  # how many positions of each are read
    pos: torch.Tensor  # its rows' positions
    in_order: bool  # its rows are its requests, in order (a decode step): rows_in_order's, nothing indexed


@dataclass(frozen=True)
class Contexts:
    """How a step's selecting rows read their requests' contexts: the requests (batch rows) and how far each is read,
    in groups whose contexts fit :data:`CONTEXT_BUDGET` together (:func:`_chunks`), and per group which rows are its
    and their index in it. Host work that depends on the step's rows and the cache's geometry alone: built once per
    step (:class:`.verifiers.Gathered`), not at every layer."""

    requests: torch.Tensor  # (r,) batch rows
    lengths: torch.Tensor  # (r,) how many positions of each are read
    groups: tuple[Group, ...]
    # a draft that selects the same at every layer (same_at_every_layer): the step's selection, made at its first
    selected: list = field(default_factory=list, compare=False, repr=False)

    @classmethod
    def build(cls, request: torch.Tensor, pos: torch.Tensor, approx: Any, kv_cache: torch.Tensor) -> "Contexts":
        requests, inverse = request.cpu().unique(return_inverse=True)
        lengths = torch.zeros(len(requests), dtype=torch.long).scatter_reduce(0, inverse, pos.cpu() + 1, "amax")
        per_token = ((2 if approx.reads_layer else 1) * kv_cache.shape[1] * (kv_cache.shape[-1] // 2)
                     * kv_cache.element_size())
        groups = []
        # a prompt's observation is its own, unless the draft stacks what it prepared of several
        for group in _chunks(lengths, per_token, one_each=approx.prompt_keys and not approx.stacks_prepared):
            local = torch.full((len(requests),), -1, dtype=torch.long)
            local[group] = torch.arange(len(group))
            mine = (local[inverse] >= 0).nonzero().squeeze(1)
            index = local[inverse[mine]]
            groups.append(Group(group, mine, index, requests[group], lengths[group], pos.cpu()[mine],
                                len(index) == len(group) and bool((index == torch.arange(len(index))).all())))
        return cls(requests, lengths, tuple(groups))


def _selected(query: torch.Tensor, kv_cache: torch.Tensor, layout: Any, block_table: torch.Tensor, block_size: int,
              pos: torch.Tensor, settings: Settings, observed: dict[int, Any], contexts: Contexts,
              kept: torch.Tensor | None, seed: torch.Tensor, site: Site, scale: float, scorer: Scorer | None,
              read: list[tuple[torch.Tensor, torch.Tensor]] | None = None, native: bool = False
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, dict[str, torch.Tensor]]:
    """:func:`selected_positions` of a draft that selects from each request's context, as the draft returned them,
    and each row's measures."""
    approx, window = settings.approx, settings.window
    heads = kv_cache.shape[1]
    width = approx.max_keys(window) or 2 * window  # None (a budget up to the context): widened as selections come

    def blank() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        return (torch.zeros(len(pos), heads, width, dtype=torch.long, device=query.device),
                torch.zeros(len(pos), heads, width, dtype=torch.bool, device=query.device),
                torch.zeros(len(pos), heads, width, device=query.device) if approx.weighted else None)

    # one group of every row in order (a decode step): its one selection is the step's, as the draft returned it
    whole = len(contexts.groups) == 1 and contexts.groups[0].in_order and len(contexts.groups[0].mine) == len(pos)
    positions, valid, log_weight = (None, None, None) if whole else blank()
    measures: dict[str, torch.Tensor] = {}
    for each in contexts.groups:
        group, mine, local, requests, lengths = each.group, each.mine, each.local, each.requests, each.lengths
        stores = [observed.get(r) for r in requests.tolist()] if approx.keeps_scores else None
        if approx.reads_keys and kept is None and scorer is None and (stores is None or any(
                approx.needs_keys(store, n) for store, n in zip(stores, lengths.tolist()))):
            keys, values, pad = read_contexts(kv_cache, layout, block_table, block_size, requests, lengths,
                                              approx.reads_layer)
            if read is not None:
                read.append((requests, keys))
        else:
            keys, values, pad = unread_contexts(kv_cache, len(group), int(lengths.max()), approx.reads_layer)
        # the host's indices moved without waiting on the device (a GPU's stream runs on: nothing is read back); rows
        # that are the group's requests in order (a decode step), known here on the host, go as such (rows_of)
        rows = (semantics.rows_in_order(len(local), keys.device) if each.in_order
                else local.to(keys.device, non_blocking=True))
        host_pos = each.pos
        where = host_pos.to(keys.device, non_blocking=True)
        row_pad, mine, host_mine = pad[rows], mine.to(keys.device, non_blocking=True), mine
        passed = approx.per_pass(where, row_pad, keys.shape[2], window, settings.window_align,
                                 **draw_inputs(approx, seed=lambda: seed[host_mine].to(keys.device, non_blocking=True)))
        drawn = draw_inputs(approx, site=lambda: site)
        if kept is not None:  # the pages' summaries, kept beside the cache: prepared below, unless read natively
            prepared = None
        elif approx.prompt_keys:  # each request's prompt prepared from its own observation, then stacked
            alone = [approx.prepare(keys[i:i + 1], pad[i:i + 1], window, observed.get(request),
                                    **_layer_inputs(approx, None if values is None else values[i:i + 1]), **drawn)
                     for i, request in enumerate(requests.tolist())]
            prepared = alone[0] if len(alone) == 1 else approx.stack_prepared(alone, window)
        else:  # a draft that keeps scores: each row's store
            prepared = approx.prepare(keys, pad, window, stores, **_layer_inputs(approx, values), **drawn)
        step = max(1, CONTEXT_BUDGET // max(1, approx.position_bytes(keys, query.shape[1])))
        for lo in range(0, len(mine), step):
            # one part (the usual case): the group's own tensors, no slice of each (rows_in_order's rows among them)
            single, part = len(mine) <= step, slice(lo, lo + step)

            def cut(t: torch.Tensor) -> torch.Tensor:
                return t if single else t[part]

            # a draft that slices each row's keys reads the rows and positions from the host's copies (host_values);
            # the contexts read here have no left padding (read_contexts, unread_contexts)
            rows_part, where_part, pad_part = (semantics.known_on_host(cut(rows), cut(local)),
                                               semantics.known_on_host(cut(where), cut(host_pos)),
                                               semantics.known_on_host(cut(row_pad), torch.zeros_like(cut(host_pos))))
            mine_query = query if whole and single else query[cut(mine)]  # whole: every row, in order
            passed_part = tuple(None if t is None else cut(t) for t in passed)
            selected = None if kept is None or not native else approx.select_kept(
                mine_query, kept, block_table, block_size, requests if each.in_order else requests[cut(local)],
                cut(host_pos), window, keys.shape[2])
            if selected is None and kept is not None and prepared is None:
                prepared = approx.prepare_pages(page_summaries(kept, approx, block_table, block_size, requests,
                                                               keys.shape[2]))
            if selected is None and scorer is None:
                selected = approx.select(mine_query, keys, rows_part, where_part, pad_part, window, passed_part,
                                         prepared)
            elif selected is None:  # scored where the keys lie, as wide as the contexts read would be
                scores = scorer(mine_query, requests[rows_part], where_part, keys.shape[2])
                selected = approx.select_scored(scores, rows_part, where_part, pad_part, window, passed_part,
                                                prepared)
            index, chosen, weight = selection(approx, selected)
            if whole and single:  # the contexts read here have no left padding: the indices are positions
                positions, valid = index.long(), None if chosen is None else chosen.bool()  # as _placed's are
                log_weight = None if weight is None else weight.float()
            else:
                positions, valid, log_weight = _placed(positions, valid, log_weight, blank, cut(mine), pad_part,
                                                       index, chosen, weight)
            taken = Selection(mine_query, keys, rows_part, pad_part, where_part, index, chosen, weight)
            for name, value in measure(approx, window, taken, scale).items():
                if name not in measures:
                    measures[name] = torch.full((len(pos),), math.nan, device=query.device)
                measures[name][cut(mine)] = value
    return positions, valid, log_weight, measures


def _placed(positions: torch.Tensor | None, valid: torch.Tensor | None, log_weight: torch.Tensor | None,
            blank: Callable[[], tuple], rows: torch.Tensor, pad: torch.Tensor, index: torch.Tensor,
            chosen: torch.Tensor | None, weight: torch.Tensor | None
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The step's positions, valid and log-weights (``blank``'s where None) with the selection of ``rows`` (indices
    ``index`` into contexts left-padded by ``pad``) in their rows, widened where it lists more keys than declared
    (alspec-check-approx says so: read, as hf does)."""
    if positions is None:
        positions, valid, log_weight = blank()
    width = index.shape[-1]
    if width > positions.shape[-1]:
        more = (0, width - positions.shape[-1])
        positions, valid = torch.nn.functional.pad(positions, more), torch.nn.functional.pad(valid, more)
        log_weight = None if log_weight is None else torch.nn.functional.pad(log_weight, more)
    positions[rows, :, :width] = index - pad[:, None, None]
    # a True made on the device: a Python True is copied from the host, which waits for a GPU
    valid[rows, :, :width] = valid.new_ones(()) if chosen is None else chosen
    if log_weight is not None:
        log_weight[rows, :, :width] = weight.float()
    return positions, valid, log_weight


def _chunks(lengths: torch.Tensor, per_token: int, one_each: bool, budget: int | None = None) -> list[torch.Tensor]:
    """Requests (indices into ``lengths``) in groups whose contexts, padded to the group's longest, take at most
    ``budget`` bytes (:data:`CONTEXT_BUDGET`; a request alone where its own takes more, or where ``one_each``)."""
    budget = CONTEXT_BUDGET if budget is None else budget
    if one_each:
        return [torch.tensor([i]) for i in range(len(lengths))]
    groups, current, longest = [], [], 0
    for i in lengths.argsort().tolist():
        longest_with = max(longest, int(lengths[i]))
        if current and longest_with * per_token * (len(current) + 1) > budget:
            groups.append(torch.tensor(current))
            current, longest_with = [], int(lengths[i])
        current.append(i)
        longest = longest_with
    return groups + [torch.tensor(current)]


def gathered(query: torch.Tensor, kv_cache: torch.Tensor, layout: Any, block_table: torch.Tensor, block_size: int,
             request: torch.Tensor, pos: torch.Tensor, settings: Settings, observed: dict[int, Any],
             scale: float, groups: Contexts | None = None, kept: torch.Tensor | None = None,
             seed: torch.Tensor | None = None,
             site: Site | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """A~ (M, Hq, D) of rows whose queries are ``query`` (M, Hq, D): each row's selected keys and values gathered
    from the paged cache (:func:`selected_positions`), rows in chunks of :data:`VERIFY_BUDGET` bytes; and what the
    draft's declarations ask each row to measure (:func:`.measures.measure`). The path of drafts that select by
    content, and the reference the streamed path (:mod:`.tiled`) is tested against."""
    positions, valid, log_weight, measures = selected_positions(query, kv_cache, layout, block_table, block_size,
                                                                request, pos, settings, observed, groups, kept, seed,
                                                                site, scale)
    kv_heads, (rows, heads, dim) = kv_cache.shape[1], query.shape
    positions = positions.expand(-1, kv_heads, -1)
    if valid is not None:
        positions = torch.where(valid, positions, 0)  # masked below; any slot of the row's own table is readable
        valid = valid.to(kv_cache.device, non_blocking=True)[:, :, None, :]
    n = positions.shape[-1]
    element = kv_cache.element_size()
    per_row = 2 * kv_heads * n * dim * (element + (4 if element != 4 else 0)) + (3 * heads + kv_heads) * n * 4
    step = max(1, VERIFY_BUDGET // per_row)
    request_at = request.to(block_table.device, non_blocking=True)
    parts = []
    for lo in range(0, rows, step):
        part = slice(lo, lo + step)
        block, offset = slots(block_table, request_at[part, None, None],
                              positions[part].to(block_table.device, non_blocking=True), block_size)
        keys, values = layout.gather(kv_cache, block, offset)
        bias = None if log_weight is None else log_weight[part, :, None, :].to(kv_cache.device, non_blocking=True)
        parts.append(semantics.attend(query[part, None], keys, values, None if valid is None else valid[part],
                                      scale, bias)[:, 0])
    return parts[0] if len(parts) == 1 else torch.cat(parts), measures
