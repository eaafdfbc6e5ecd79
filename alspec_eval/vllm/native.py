"""Verification in one pass over vLLM's CPU paged cache (``verify_cpu.c``): every verified row's A~ read straight
from the cache through the block table, with no copy of its keys, and its d^2, n^2, in one call a layer. Torch ops
cost a few microseconds each and copy every key they read; this is what keeps verification near free on the CPU.

The C source ships with the package and is built once per machine and source with the system's C compiler, into
the project's cache (``$ALSPEC_CACHE``, default ``~/.cache/alspec_eval``, folder ``native``), and loaded with
ctypes; it shares torch's OpenMP runtime. Where no compiler builds it, alspec-vllm says so once and verifies with
the tiles (:mod:`.tiled`), same decisions.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

import torch

from ..smollm2 import cache_dir
from ..stats import ACCEPTED, REJECTED

log = logging.getLogger(__name__)

FLAGS = ("-O3", "-march=native", "-fno-math-errno", "-ffp-contract=fast", "-fopenmp", "-fPIC", "-shared", "-std=gnu11")
DTYPES = {torch.float32: 0, torch.bfloat16: 1}
_I64, _PTR = ctypes.c_int64, ctypes.c_void_p


@dataclass(frozen=True)
class NativeRows:
    """A step's verified rows as a kernel reads them (int64, contiguous): token, batch row, and per row the draft's
    key ranges [starts, ends) (``Approximation.position_ranges``), with the most keys a row reads; where each is
    among the step's rows (``live``: where its code and d/n go) and its position. Host tensors for the C kernel,
    device tensors (:meth:`to`) for the Triton verifier (:mod:`alspec_eval.kernels.triton_verify`)."""

    token: torch.Tensor
    request: torch.Tensor
    starts: torch.Tensor
    ends: torch.Tensor
    live: torch.Tensor
    pos: torch.Tensor
    most_keys: int

    @classmethod
    def build(cls, token: torch.Tensor, request: torch.Tensor, starts: torch.Tensor, ends: torch.Tensor,
              live: torch.Tensor, pos: torch.Tensor) -> "NativeRows":
        starts, ends = starts.long(), ends.long().maximum(starts.long())
        most = int((ends - starts).sum(1).max()) if len(starts) else 0
        return cls(*(t.long().contiguous() for t in (token, request, starts, ends, live, pos)), most)

    def to(self, device: torch.device) -> "NativeRows":
        return NativeRows(*(t.to(device, non_blocking=True) for t in (self.token, self.request, self.starts,
                                                                       self.ends, self.live, self.pos)),
                          self.most_keys)

    @functools.cached_property
    def arguments(self) -> tuple[int, ...]:
        """The kernel's arguments that are the rows', read once: a decode step calls the kernel at every layer, where
        Python's own costs, run between layers whose weights have just passed through the caches, are most of a
        call's."""
        return (len(self.token), self.token.data_ptr(), self.request.data_ptr(), self.starts.data_ptr(),
                self.ends.data_ptr(), self.starts.shape[1], self.most_keys)


class Scratch:
    """Where :func:`verify` writes A~, d^2 and n^2: buffers that only grow, reused by every layer and step. Tensors of
    tens of MB made per layer or step (a prefill's rows) land on glibc's heap among vLLM's own, which it then keeps:
    per layer, about 300 MB after one rolling call."""

    def __init__(self) -> None:
        self.held: dict[tuple[torch.dtype, int, int], tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        self.pointers: dict[tuple[torch.dtype, int, int], tuple[int, int, int, int]] = {}  # rows held, addresses

    def take(self, dtype: torch.dtype, heads: int, dim: int,
             count: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        held = self.held.get((dtype, heads, dim))
        if held is None or len(held[1]) < count:
            size = max(count, 2 * len(held[1]) if held is not None else 0)
            held = self.held[(dtype, heads, dim)] = (torch.empty(size, heads, dim, dtype=dtype), torch.empty(size),
                                                     torch.empty(size))
            self.pointers[(dtype, heads, dim)] = (size, *(t.data_ptr() for t in held))
        return held[0][:count], held[1][:count], held[2][:count]

    def addresses(self, dtype: torch.dtype, heads: int, dim: int, count: int) -> tuple[int, int, int]:
        """Where :meth:`take` would put ``count`` rows, without making its views (the kernel alone reads them)."""
        held = self.pointers.get((dtype, heads, dim))
        if held is None or held[0] < count:
            self.take(dtype, heads, dim, count)
            held = self.pointers[(dtype, heads, dim)]
        return held[1:]


def _cpu_flags() -> str:
    """The CPU's feature flags (``-march=native`` builds for them), so that a shared cache never loads a library
    built for another CPU."""
    try:
        return next((line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags")), "")
    except OSError:
        return platform.processor()


@functools.cache
def library() -> ctypes.CDLL | None:
    """The built kernel, or None (said once) where this machine cannot build it."""
    source = resources.files(__package__).joinpath("verify_cpu.c").read_bytes()
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        log.warning("alspec-vllm: no C compiler (cc, gcc, or $CC), so verification on the CPU uses torch ops "
                    "(slower, same decisions); install gcc to verify in one pass")
        return None
    try:
        version = subprocess.run([compiler, "--version"], capture_output=True, text=True, check=True).stdout
        key = hashlib.sha256(b"\0".join([source, " ".join(FLAGS).encode(), version.encode(),
                                         platform.machine().encode(), _cpu_flags().encode()])).hexdigest()[:16]
        cache = cache_dir() / "native"
        built = cache / f"verify_cpu-{key}.so"
        if not built.exists():
            cache.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryDirectory(dir=cache) as work:
                (Path(work) / "verify_cpu.c").write_bytes(source)
                subprocess.run([compiler, *FLAGS, "verify_cpu.c", "-o", "verify_cpu.so", "-lm"], cwd=work,
                               capture_output=True, text=True, check=True)
                os.replace(Path(work) / "verify_cpu.so", built)  # atomic: ranks and replicas build side by side
        lib = ctypes.CDLL(str(built))
    except (OSError, subprocess.CalledProcessError) as error:
        detail = getattr(error, "stderr", "") or str(error)
        log.warning("alspec-vllm: the CPU verification kernel did not build with %s (%s), so verification on the CPU "
                    "uses torch ops (slower, same decisions); set CC to a C compiler with OpenMP (gcc) to verify in "
                    "one pass", compiler, detail.strip().splitlines()[-1] if detail.strip() else error)
        return None
    lib.alspec_verify.restype = ctypes.c_int
    lib.alspec_verify.argtypes = [_PTR, _I64, _PTR, _I64, _PTR, _PTR, _I64, _I64, _PTR, _PTR, _PTR, _PTR, _I64, _I64,
                                  _I64, _I64, _I64, _I64, ctypes.c_float, ctypes.c_int, _PTR, _PTR, _PTR,
                                  ctypes.c_int, ctypes.c_double, _PTR, ctypes.c_int8, ctypes.c_int8, _PTR, _PTR]
    lib.alspec_verify_listed.restype = ctypes.c_int
    lib.alspec_verify_listed.argtypes = [_PTR, _I64, _PTR, _I64, _PTR, _PTR, _I64, _I64, _PTR, _PTR, _PTR, _PTR, _PTR,
                                         _I64, _PTR, _PTR, _PTR, _PTR, _I64, _I64, _I64, _I64, ctypes.c_float,
                                         ctypes.c_int, _PTR, _PTR,
                                         _PTR, ctypes.c_int, ctypes.c_double, _PTR, ctypes.c_int8, ctypes.c_int8, _PTR,
                                         _PTR]
    lib.alspec_key_scores.restype = ctypes.c_int
    lib.alspec_key_scores.argtypes = [_PTR, _I64, _PTR, _PTR, _I64, _I64, _PTR, _PTR, _PTR, _I64, _I64, _I64, _I64,
                                      ctypes.c_int, _PTR, _I64]
    lib.alspec_quest_pages.restype = ctypes.c_int
    lib.alspec_quest_pages.argtypes = [_PTR, _I64, ctypes.c_int, _PTR, ctypes.c_int, _PTR, _I64, _I64, _PTR, _PTR,
                                       _I64, _I64, _I64, _I64, _I64, _I64, _I64, _I64, _I64, _PTR, _PTR]
    lib.alspec_rank_kept.restype = ctypes.c_int
    lib.alspec_rank_kept.argtypes = [_PTR, _PTR, _I64, _I64, _PTR, _PTR, _I64, _I64, _I64, _I64, ctypes.c_float, _PTR]
    lib.alspec_read_blocks.restype = None
    lib.alspec_read_blocks.argtypes = [_PTR, _I64, _I64, _I64, _I64, _PTR, _I64, _I64, _PTR, _PTR]
    lib.alspec_exp.restype = None
    lib.alspec_exp.argtypes = [_PTR, _PTR, _I64]
    return lib


def usable(layout: object, kv_cache: torch.Tensor) -> bool:
    """Whether this cache is one the kernel reads (a layout that says so, on the CPU, float32 or bfloat16, dense),
    and the kernel built."""
    return (getattr(layout, "native", False) and kv_cache.device.type == "cpu" and kv_cache.dtype in DTYPES
            and kv_cache.is_contiguous() and library() is not None)


def _inputs(query: torch.Tensor, exact: torch.Tensor, kv_cache: torch.Tensor,
            block_table: torch.Tensor) -> torch.Tensor:
    """Refuse inputs the kernel would misread; returns the block table as int32 rows (vLLM's own, where it is)."""
    dim = query.shape[2]
    for name, tensor in (("query", query), ("exact", exact)):
        if tensor.dtype != kv_cache.dtype or tensor.stride(2) != 1 or tensor.stride(1) != dim:
            raise ValueError(f"alspec-vllm's CPU kernel needs {name} as (tokens, heads, head_dim) with dense heads "
                             f"in the cache's dtype {kv_cache.dtype}, got {tuple(tensor.shape)} strides "
                             f"{tensor.stride()} {tensor.dtype}")
    return block_table if block_table.dtype == torch.int32 and block_table.stride(1) == 1 else \
        block_table.to(torch.int32).contiguous()


def _call(query: torch.Tensor, exact: torch.Tensor, kv_cache: torch.Tensor, table: torch.Tensor, rows: NativeRows,
          scale: float, scratch: tuple[int, int, int], *decision: Any) -> None:
    """One call of the kernel: measure (``decision`` empty) or measure and decide (the arguments after ``decide``)."""
    _, kv_heads, block_size, _ = kv_cache.shape
    _, heads, dim = query.shape
    count, *row_arguments = rows.arguments
    status = library().alspec_verify(
        query.data_ptr(), query.stride(0), exact.data_ptr(), exact.stride(0), kv_cache.data_ptr(), table.data_ptr(),
        table.stride(0), count, *row_arguments, heads, kv_heads, dim, block_size, scale, DTYPES[kv_cache.dtype],
        *scratch, *(decision or (0, 0.0, None, 0, 0, None, None)))
    if status:
        raise MemoryError(f"alspec-vllm's CPU kernel ran out of memory for {count} rows of {rows.most_keys} keys")


def verify(query: torch.Tensor, exact: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor,
           rows: NativeRows, scale: float, scratch: Scratch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A~ (rows, Hq, D) in the cache's dtype and d^2, n^2 (rows,) float32 against ``exact`` (A, indexed by token like
    ``query``, both (tokens, Hq, D) with heads and channels dense): :func:`alspec_eval.semantics.attend` and
    :func:`~alspec_eval.semantics.squared_distances`, for every row in one call; what a tensor-parallel rank sums
    with the others' before any decides. The three are views of ``scratch`` (the engine's), overwritten by the next
    call."""
    return _measured(_call, query, exact, kv_cache, block_table, rows, scale, scratch)


def _measured(call: Callable[..., None], query: torch.Tensor, exact: torch.Tensor, kv_cache: torch.Tensor,
              block_table: torch.Tensor, rows: Any, scale: float,
              scratch: Scratch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A~, d^2 and n^2 of ``rows`` by a kernel's ``call``, in ``scratch``."""
    table = _inputs(query, exact, kv_cache, block_table)
    approx, d2, n2 = scratch.take(kv_cache.dtype, query.shape[1], query.shape[2], len(rows.token))
    call(query, exact, kv_cache, table, rows, scale, (approx.data_ptr(), d2.data_ptr(), n2.data_ptr()))
    return approx, d2, n2


def _decided(call: Callable[..., None], query: torch.Tensor, exact: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor,
             rows: Any, scale: float, lam: float, codes: torch.Tensor, ratios: torch.Tensor,
             scratch: Scratch) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`_measured`, decided at ``lam`` and committed in the same call; copies of ``codes`` and ``ratios``."""
    table = _inputs(query, exact, kv_cache, block_table)
    codes, ratios = codes.clone(), ratios.clone()
    call(query, exact, kv_cache, table, rows, scale,
         scratch.addresses(kv_cache.dtype, query.shape[1], query.shape[2], len(rows.token)),
         1, lam, rows.live.data_ptr(), ACCEPTED, REJECTED, codes.data_ptr(), ratios.data_ptr())
    return codes, ratios


def read_blocks(kv_cache: torch.Tensor, ids: torch.Tensor,
                values: bool = True) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """CPU_ATTN's whole blocks ``ids`` (R, nb) as :meth:`.paged.CpuVecLayout.blocks` returns them, (R, Hkv, nb N, D)
    keys (and values), in one pass (torch's way is an index_select, then a copy that transposes every block's keys:
    two passes, the second element by element); None where the kernel does not read this cache."""
    if kv_cache.device.type != "cpu" or kv_cache.element_size() not in (2, 4) or not kv_cache.is_contiguous() \
            or library() is None:
        return None
    _, heads, size, twice = kv_cache.shape
    rows, count = ids.shape
    ids = ids.long().contiguous()
    keys = kv_cache.new_empty(rows, heads, count * size, twice // 2)
    held = torch.empty_like(keys) if values else None
    library().alspec_read_blocks(kv_cache.data_ptr(), heads, size, twice // 2, kv_cache.element_size(),
                                 ids.data_ptr(), rows, count, keys.data_ptr(), None if held is None else held.data_ptr())
    return keys, held


def key_scores(kv_cache: torch.Tensor, block_table: torch.Tensor, query: torch.Tensor, request: torch.Tensor,
               pos: torch.Tensor, width: int) -> torch.Tensor:
    """:func:`alspec_eval.semantics.key_scores` of rows whose queries are ``query`` (r, Hq, D) against their requests'
    keys up to ``pos`` (batch rows ``request``, (r,) each), straight from the cache: (r, Hkv, width) float32, every
    slot past a row's position -inf. No key is copied (the keys stay transposed, as the cache holds them)."""
    table = _inputs(query, query, kv_cache, block_table)
    rows, heads, dim = query.shape
    _, kv_heads, block_size, _ = kv_cache.shape
    token, request = torch.arange(rows), request.long().contiguous()
    length = (pos.long() + 1).contiguous()
    out = torch.empty(rows, kv_heads, width)
    if library().alspec_key_scores(query.data_ptr(), query.stride(0), kv_cache.data_ptr(), table.data_ptr(),
                                   table.stride(0), rows, token.data_ptr(), request.data_ptr(), length.data_ptr(),
                                   heads, kv_heads, dim, block_size, DTYPES[kv_cache.dtype], out.data_ptr(), width):
        raise MemoryError(f"alspec-vllm's CPU kernel ran out of memory scoring {rows} rows")
    return out


def quest_pages(query: torch.Tensor, kept: torch.Tensor, block_table: torch.Tensor, block_size: int,
                request: torch.Tensor, pos: torch.Tensor, page: int, window: int,
                length: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Quest's keys (``Quest.select`` from :func:`.kept.page_summaries`) of rows whose queries are ``query`` (r, Hq,
    D), at logical positions ``pos`` of batch rows ``request`` (host, (r,) each), with no left padding, their
    contexts read to ``length`` keys: each candidate page bounded straight from the summaries kept beside the cache
    (``kept``, (blocks, parts a block, Hkv, 2D)), to float32 rounding, and chosen and listed in the same call; the
    positions (r, Hkv, 2S) int64 and which count (bool). None where the kernel does not read these tensors."""
    if query.device.type != "cpu" or kept.device.type != "cpu" or query.dtype not in DTYPES \
            or kept.dtype not in DTYPES or not kept.is_contiguous() or library() is None:
        return None
    rows, heads, dim = query.shape
    kv_heads, part = kept.shape[2], block_size // kept.shape[1]
    query = query if query.stride(2) == 1 and query.stride(1) == dim else query.contiguous()
    table = block_table if block_table.dtype == torch.int32 and block_table.stride(1) == 1 else \
        block_table.to(torch.int32).contiguous()
    request, pos = request.long().contiguous(), pos.long().contiguous()
    others = 2 * window // page - 2
    positions = torch.empty(rows, kv_heads, 2 * window, dtype=torch.long)
    valid = torch.empty(rows, kv_heads, 2 * window, dtype=torch.bool)
    if library().alspec_quest_pages(query.data_ptr(), query.stride(0), DTYPES[query.dtype], kept.data_ptr(),
                                    DTYPES[kept.dtype], table.data_ptr(), table.stride(0), rows, request.data_ptr(),
                                    pos.data_ptr(), heads, kv_heads, dim, block_size, part, page, others,
                                    length // page, length, positions.data_ptr(), valid.data_ptr()):
        raise MemoryError(f"alspec-vllm's CPU kernel ran out of memory choosing Quest's pages of {rows} rows")
    return positions, valid


def rank_kept(kept: torch.Tensor, block_table: torch.Tensor, block_size: int, request: torch.Tensor,
              pos: torch.Tensor, keep: int, length: int, tie: float) -> torch.Tensor | None:
    """kvpress's ranking (``kvpress.ranked``, ties within ``tie``) of the per-key scores kept beside the cache
    (``kept``, (blocks, N, Hkv, 1) float32: a key-only press that scores each key alone) of rows at logical positions
    ``pos`` of batch rows ``request`` (host, (r,) each), with no left padding, their contexts read to ``length``
    keys: the ``keep`` best keys of each row's [0, pos] per KV head, (r, Hkv, keep) int64, read and ranked in one
    call. None where the kernel does not read these tensors."""
    if kept.device.type != "cpu" or kept.dtype != torch.float32 or kept.shape[1] != block_size \
            or kept.shape[-1] != 1 or not kept.is_contiguous() or length < keep or library() is None:
        return None
    table = block_table if block_table.dtype == torch.int32 and block_table.stride(1) == 1 else \
        block_table.to(torch.int32).contiguous()
    request, pos = request.long().contiguous(), pos.long().contiguous()
    out = torch.empty(len(pos), kept.shape[2], keep, dtype=torch.long)
    if library().alspec_rank_kept(kept.data_ptr(), table.data_ptr(), table.stride(0), len(pos), request.data_ptr(),
                                  pos.data_ptr(), kept.shape[2], block_size, keep, length, tie, out.data_ptr()):
        raise MemoryError(f"alspec-vllm's CPU kernel ran out of memory ranking the kept scores of {len(pos)} rows")
    return out


@dataclass(frozen=True)
class Listed:
    """Rows whose keys a draft selected by content, as :func:`verify_listed` reads them: their tokens and batch rows
    (int64, host), where each is among the step's rows (``live``), and per row and KV head the logical positions of
    its keys (``positions``, (rows, Hkv or 1, n) int64), which slots count (``valid``, the same or None: all) and a
    weighted draft's log-weights (``log_weight``, (rows, Hkv, n) or None), as :func:`.paged.selected_positions`
    returns them. ``context``: the keys the draft read to select (:func:`.paged.read_contexts`, (contexts, Hkv, L, D)
    in the cache's dtype), and per row its context (``context_row``, int64, -1: none), which the kernel reads the
    rows' keys from, whole, instead of gathering them from the cache's transposed blocks a cache line a channel."""

    token: torch.Tensor
    request: torch.Tensor
    live: torch.Tensor
    positions: torch.Tensor
    valid: torch.Tensor | None
    log_weight: torch.Tensor | None
    context: torch.Tensor | None = None
    context_row: torch.Tensor | None = None

    def lists(self, kv_heads: int) -> tuple[list[torch.Tensor | None], Any]:
        """The three per-head lists as the kernel reads them (each list's slots dense) and their row and head strides
        (a head stride of 0 where one list serves every head)."""
        lists = [self.positions.contiguous(), None if self.valid is None else self.valid.contiguous().view(torch.uint8),
                 None if self.log_weight is None else self.log_weight.float().contiguous()]
        strides = (ctypes.c_int64 * 6)(*(s for t in lists for s in (
            (0, 0) if t is None else (t.stride(0), t.stride(1) if t.shape[1] == kv_heads else 0))))
        return lists, strides


def _call_listed(query: torch.Tensor, exact: torch.Tensor, kv_cache: torch.Tensor, table: torch.Tensor, rows: Listed,
                 scale: float, scratch: tuple[int, int, int], *decision: Any) -> None:
    """One call of the listed kernel: measure (``decision`` empty) or measure and decide."""
    _, kv_heads, block_size, _ = kv_cache.shape
    _, heads, dim = query.shape
    lists, strides = rows.lists(kv_heads)  # held until the kernel returns
    context = rows.context
    context_row = None if context is None else rows.context_row.long().contiguous()  # held until the kernel returns
    if context is not None and not (context.dtype == kv_cache.dtype and context.device.type == "cpu"
                                    and context.shape[1] == kv_heads and context.shape[-1] == dim
                                    and context.stride(-1) == 1 and context.stride(-2) == dim):
        raise ValueError(f"the listed kernel reads contexts of (contexts, {kv_heads}, L, {dim}) {kv_cache.dtype} keys "
                         f"on the CPU, each position's keys whole; got {tuple(context.shape)} {context.dtype} with "
                         f"strides {context.stride()}")
    status = library().alspec_verify_listed(
        query.data_ptr(), query.stride(0), exact.data_ptr(), exact.stride(0), kv_cache.data_ptr(), table.data_ptr(),
        table.stride(0), len(rows.token), rows.token.data_ptr(), rows.request.data_ptr(),
        *(None if t is None else t.data_ptr() for t in lists), rows.positions.shape[-1], strides,
        None if context is None else context.data_ptr(),
        None if context is None else context_row.data_ptr(),
        None if context is None else (ctypes.c_int64 * 2)(context.stride(0), context.stride(1)), heads, kv_heads,
        dim, block_size, scale, DTYPES[kv_cache.dtype], *scratch, *(decision or (0, 0.0, None, 0, 0, None, None)))
    if status:
        raise MemoryError(f"alspec-vllm's CPU kernel ran out of memory for {len(rows.token)} rows of "
                          f"{rows.positions.shape[-1]} keys")


def verify_listed(query: torch.Tensor, exact: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor,
                  rows: Listed, scale: float, scratch: Scratch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`verify` for rows whose keys are listed per KV head (:class:`Listed`): A~ over the listed keys that
    count, in the list's order (no other key is read), and d^2, n^2."""
    return _measured(_call_listed, query, exact, kv_cache, block_table, rows, scale, scratch)


def verify_listed_and_decide(query: torch.Tensor, exact: torch.Tensor, kv_cache: torch.Tensor,
                             block_table: torch.Tensor, rows: Listed, scale: float, lam: float, codes: torch.Tensor,
                             ratios: torch.Tensor, scratch: Scratch) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`verify_listed`, decided and committed in the same call as :func:`verify_and_decide` does."""
    return _decided(_call_listed, query, exact, kv_cache, block_table, rows, scale, lam, codes, ratios, scratch)


def verify_and_decide(query: torch.Tensor, exact: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor,
                      rows: NativeRows, scale: float, lam: float, codes: torch.Tensor, ratios: torch.Tensor,
                      scratch: Scratch) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`verify`, then, where no other rank holds heads of the rows, :func:`alspec_eval.semantics.accept` at
    ``lam`` and :func:`~alspec_eval.semantics.commit` into ``exact`` in place, in the same call; returns copies of the
    step's ``codes`` (int8) and ``ratios`` (d/n) with the rows' decisions."""
    return _decided(_call, query, exact, kv_cache, block_table, rows, scale, lam, codes, ratios, scratch)
