"""One decode step through the TT-Lang kernel: packing into tiles, running, unpacking.

``ttlang_decode`` is the kernel as an attention op (used by ``backend=tt, tt_kernel=ttlang`` and by
``run_sim``). TT-Lang comes in two wheels that both install the ``ttl`` package: the compiler (``tt-lang``,
with the real ``ttnn`` and a Tenstorrent card) and the pure-Python simulator (``tt-lang-sim``, which brings
its own simulated ``ttnn``). ``load_ttnn`` makes the kernel importable on either: under the simulator it
puts the simulator's ``ttl`` and ``ttnn`` into ``sys.modules``, and the simulator rebinds
``torch.bfloat16`` (and float16) to float32 for the whole process, so every later ``torch.bfloat16`` in
that process means float32. Import this module freely; nothing is loaded until ``load_ttnn``.
"""

from __future__ import annotations

import functools
import importlib.util
import os
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

from ...constants import TILE
SIM, COMPILER = "tt-lang-sim", "tt-lang"
INSTALL_HINT = ("on a machine with a Tenstorrent card install the TT-Lang compiler (the `tt-lang` wheel, "
                "https://github.com/tenstorrent/tt-lang, next to ttnn) and use tt_mode=device; anywhere else "
                "`pip install tt-lang-sim` (Python 3.10-3.12, part of this package's `test` extra) runs the "
                "kernel on the simulator with tt_mode=host")


@functools.cache
def flavour() -> str | None:
    """Which TT-Lang is installed: ``"tt-lang-sim"``, ``"tt-lang"`` (the compiler) or None.

    Decided without importing ``ttl`` the way ``ttl/__init__`` decides it: the simulator wheel ships
    ``ttl/_sim_only_marker.py`` (``TTLANG_SIM_ONLY=1`` marks a source tree run as the simulator).
    Cached, since after ``load_ttnn`` the name ``ttl`` resolves to the simulator's stand-in module.
    """
    spec = importlib.util.find_spec("ttl")
    if spec is None:
        return None
    locations = spec.submodule_search_locations or []
    marker = any((Path(loc) / "_sim_only_marker.py").exists() for loc in locations)
    return SIM if marker or os.environ.get("TTLANG_SIM_ONLY", "0") == "1" else COMPILER


def load_ttnn() -> ModuleType:
    """The ``ttnn`` the kernel runs on: the simulator's (installed process-wide, see the module docstring)
    under tt-lang-sim, else the real one. ImportError without TT-Lang."""
    kind = flavour()
    if kind is None:
        raise ImportError(f"TT-Lang (the `ttl` package) is not installed; {INSTALL_HINT}")
    if kind == SIM:
        from ttl.sim.ttlang_sim import setup_simulator_imports

        setup_simulator_imports()
    import ttnn

    return ttnn


@functools.lru_cache(maxsize=8)
def _operation(pairs: tuple, tiles_per_cache: int, scale: float) -> Any:
    """The kernel for one tile schedule. Every layer of a decode step has the same schedule, so on the
    compiler it is built once per step (the schedule is baked in as constants: a new cur_pos is a new op)."""
    from .spec_decode import build

    return build(list(pairs), tiles_per_cache, scale)


def ttlang_decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cur_pos: list[int] | torch.Tensor, window: int,
                  scale: float, device: Any, kv_dtype: Any = None) -> tuple[torch.Tensor, ...]:
    """Exact and speculative attention of one decode step with the verification sums, by the TT-Lang kernel.

    q: (B, Hq, D); k, v: (B, Hkv, L, D), each sequence starting at index 0 (no left padding); cur_pos: (B,)
    index of the current token, keys after it are masked. The windows are the first ``window`` and the
    tile-aligned last ``window`` positions (window_align=32); ``window`` a multiple of 32. ``device``: an
    open device of the ttnn from ``load_ttnn``; ``kv_dtype``: the ttnn dtype of K and V on the device
    (default bfloat16; the simulator computes in float32 whatever the dtype). A head_dim that is not a
    multiple of 32 is zero-padded, which changes neither outputs nor sums. Up to 32 query heads per KV head.

    Returns (exact, spec) (B, Hq, D) and (d2, n2) (B,): ||spec - exact||^2 and ||exact||^2 over all heads,
    float32 on the host.
    """
    ttnn = load_ttnn()
    from .spec_decode import from_torch, schedule

    cur_pos = [int(p) for p in (cur_pos.tolist() if isinstance(cur_pos, torch.Tensor) else cur_pos)]
    b, hq, dim = q.shape
    hkv, length = k.shape[1], k.shape[2]
    group, pairs = hq // hkv, b * hkv
    if hq % hkv or group > TILE:
        raise ValueError(f"{hq} query heads over {hkv} KV heads: the kernel takes up to {TILE} query heads per KV head")
    if max(cur_pos) >= length:
        raise ValueError(f"cur_pos {max(cur_pos)} is past the {length} cached positions")
    dp, lt = -(-dim // TILE) * TILE, -(-length // TILE)
    qp = q.new_zeros(pairs, TILE, dp, dtype=torch.float32)  # the query heads of one KV head: rows of a tile
    qp[:, :group, :dim] = q.float().reshape(pairs, group, dim)
    kp, vp = (x.new_zeros(pairs, lt * TILE, dp, dtype=torch.float32) for x in (k, v))
    kp[:, :length, :dim] = k.float().reshape(pairs, length, dim)
    vp[:, :length, :dim] = v.float().reshape(pairs, length, dim)
    bias = torch.zeros(b, TILE, lt * TILE)
    for i, p in enumerate(cur_pos):
        bias[i, :, p + 1:] = float("-inf")
    rowmask = torch.zeros(TILE, dp)
    rowmask[:group] = 1.0

    kv_dtype = ttnn.bfloat16 if kv_dtype is None else kv_dtype
    def dev(t: torch.Tensor, dtype: Any = ttnn.bfloat16) -> Any:
        return from_torch(t.contiguous(), dtype, device)

    outs = [dev(torch.zeros(pairs * TILE, dp)), dev(torch.zeros(pairs * TILE, dp))]  # spec, exact
    sums = [dev(torch.zeros(pairs * TILE, TILE)), dev(torch.zeros(pairs * TILE, TILE))]  # d2, n2
    op = _operation(tuple(schedule(cur_pos, window, hkv)), lt, float(scale))
    args = (dev(qp.reshape(-1, dp)), dev(kp.reshape(-1, dp), kv_dtype), dev(vp.reshape(-1, dp), kv_dtype),
            dev(bias.reshape(-1, lt * TILE)), dev(rowmask), *outs, *sums)
    threads = torch.get_num_threads()
    if flavour() == SIM:  # the simulator's 32x32 tile matmuls are ~40x slower with torch's thread pool
        torch.set_num_threads(1)
    try:
        op(*args)
    finally:
        torch.set_num_threads(threads)
    spec, exact = (ttnn.to_torch(t).float().reshape(pairs, TILE, dp)[:, :group, :dim].reshape(b, hq, dim) for t in outs)
    d2, n2 = (ttnn.to_torch(t).float().reshape(b, hkv, TILE, TILE)[:, :, 0, 0].sum(1) for t in sums)
    return exact, spec, d2, n2
