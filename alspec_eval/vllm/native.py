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
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import torch

from ..smollm2 import cache_dir
from ..stats import ACCEPTED, REJECTED

log = logging.getLogger(__name__)

FLAGS = ("-O3", "-march=native", "-fno-math-errno", "-ffp-contract=fast", "-fopenmp", "-fPIC", "-shared", "-std=gnu11")
DTYPES = {torch.float32: 0, torch.bfloat16: 1}
_I64, _PTR = ctypes.c_int64, ctypes.c_void_p


@dataclass(frozen=True)
class NativeRows:
    """A step's verified rows as the kernel reads them (host tensors, int64, contiguous): token, batch row, and per
    row the draft's key ranges [starts, ends) (``Approximation.position_ranges``), with the most keys a row reads;
    and where each is among the step's rows (``live``: where its code and d/n go)."""

    token: torch.Tensor
    request: torch.Tensor
    starts: torch.Tensor
    ends: torch.Tensor
    live: torch.Tensor
    most_keys: int

    @classmethod
    def build(cls, token: torch.Tensor, request: torch.Tensor, starts: torch.Tensor, ends: torch.Tensor,
              live: torch.Tensor) -> "NativeRows":
        starts, ends = starts.long(), ends.long().maximum(starts.long())
        most = int((ends - starts).sum(1).max()) if len(starts) else 0
        return cls(*(t.long().contiguous() for t in (token, request, starts, ends, live)), most)


class Scratch:
    """Where :func:`verify` writes A~, d^2 and n^2: buffers that only grow, reused by every layer and step. Tensors of
    tens of MB made per layer or step (a prefill's rows) land on glibc's heap among vLLM's own, which it then keeps:
    per layer, about 300 MB after one rolling call."""

    def __init__(self) -> None:
        self.held: dict[tuple[torch.dtype, int, int], tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}

    def take(self, dtype: torch.dtype, heads: int, dim: int,
             count: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        held = self.held.get((dtype, heads, dim))
        if held is None or len(held[1]) < count:
            size = max(count, 2 * len(held[1]) if held is not None else 0)
            held = self.held[(dtype, heads, dim)] = (torch.empty(size, heads, dim, dtype=dtype), torch.empty(size),
                                                     torch.empty(size))
        return held[0][:count], held[1][:count], held[2][:count]


SCRATCH = Scratch()  # one worker, one layer at a time


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
                                  _I64, _I64, _I64, _I64, ctypes.c_float, ctypes.c_int, _PTR, _PTR, _PTR]
    lib.alspec_exp.restype = None
    lib.alspec_exp.argtypes = [_PTR, _PTR, _I64]
    lib.alspec_decide.restype = None
    lib.alspec_decide.argtypes = [_PTR, _I64, _PTR, _I64, _PTR, _PTR, _I64, _I64, ctypes.c_int, _PTR, _PTR,
                                  ctypes.c_double, ctypes.c_int8, ctypes.c_int8, _PTR, _PTR]
    return lib


def usable(layout: object, kv_cache: torch.Tensor) -> bool:
    """Whether this cache is one the kernel reads (a layout that says so, on the CPU, float32 or bfloat16, dense),
    and the kernel built."""
    return (getattr(layout, "native", False) and kv_cache.device.type == "cpu" and kv_cache.dtype in DTYPES
            and kv_cache.is_contiguous() and library() is not None)


def verify(query: torch.Tensor, exact: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor,
           rows: NativeRows, scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A~ (rows, Hq, D) in the cache's dtype and d^2, n^2 (rows,) float32 against ``exact`` (A, indexed by token like
    ``query``, both (tokens, Hq, D) with heads and channels dense): :func:`alspec_eval.semantics.attend` and
    :func:`~alspec_eval.semantics.squared_distances`, for every row in one call. The three are views of the worker's
    :data:`SCRATCH`, overwritten by the next call."""
    blocks, kv_heads, block_size, twice = kv_cache.shape
    tokens, heads, dim = query.shape
    for name, tensor in (("query", query), ("exact", exact)):
        if tensor.dtype != kv_cache.dtype or tensor.stride(2) != 1 or tensor.stride(1) != dim:
            raise ValueError(f"alspec-vllm's CPU kernel needs {name} as (tokens, heads, head_dim) with dense heads "
                             f"in the cache's dtype {kv_cache.dtype}, got {tuple(tensor.shape)} strides "
                             f"{tensor.stride()} {tensor.dtype}")
    table = block_table if block_table.dtype == torch.int32 and block_table.stride(1) == 1 else \
        block_table.to(torch.int32).contiguous()
    count = len(rows.token)
    approx, d2, n2 = SCRATCH.take(kv_cache.dtype, heads, dim, count)
    status = library().alspec_verify(
        query.data_ptr(), query.stride(0), exact.data_ptr(), exact.stride(0), kv_cache.data_ptr(), table.data_ptr(),
        table.stride(0), count, rows.token.data_ptr(), rows.request.data_ptr(), rows.starts.data_ptr(),
        rows.ends.data_ptr(), rows.starts.shape[1], rows.most_keys, heads, kv_heads, dim, block_size, scale,
        DTYPES[kv_cache.dtype], approx.data_ptr(), d2.data_ptr(), n2.data_ptr())
    if status:
        raise MemoryError(f"alspec-vllm's CPU kernel ran out of memory for {count} rows of {rows.most_keys} keys")
    return approx, d2, n2


def decide(exact: torch.Tensor, approx: torch.Tensor, d2: torch.Tensor, n2: torch.Tensor, rows: NativeRows,
           lam: float, codes: torch.Tensor, ratios: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """After :func:`verify`, where no other rank holds heads of the rows: :func:`alspec_eval.semantics.accept` at
    ``lam`` and :func:`~alspec_eval.semantics.commit` into ``exact`` in place, in C; returns copies of the step's
    ``codes`` (int8) and ``ratios`` (d/n) with the rows' decisions."""
    codes, ratios = codes.clone(), ratios.clone()
    library().alspec_decide(exact.data_ptr(), exact.stride(0), approx.data_ptr(), len(rows.token),
                            rows.token.data_ptr(), rows.live.data_ptr(), exact.shape[1], exact.shape[2],
                            DTYPES[exact.dtype], d2.data_ptr(), n2.data_ptr(), lam, ACCEPTED, REJECTED,
                            codes.data_ptr(), ratios.data_ptr())
    return codes, ratios
