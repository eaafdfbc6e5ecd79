"""The authors' speculative op, ``ttnn.experimental.speculative_scaled_dot_product_attention_decode``
(tenstorrent/tt-metal PR #22177), as code: its keywords, preconditions, configs and a host golden.

Written from ``docs/tt_op_contract.md``. No ttnn wheel has the op and no card is here, so what the
backend sends the op is pinned by this module and by a test double built from it. Facts:

- signature ``(q, k, v, *, lambda_=0.2, is_causal=True, attn_mask=None, cur_pos=[], cur_pos_tensor=None,
  scale=None, memory_config=None, program_config=None, compute_kernel_config=None, priority_tensor=None,
  other_priority_tensor=None, ccl_enabled=False, multi_device_global_semaphore=None, queue_id=0)``; no
  ``speculative_chunk_size`` (that was PR #16359);
- S is ``program_config.k_chunk_size``: a power of 2 and a multiple of 32 (without a program_config the op
  picks its own chunk size, so S would silently differ); the authors run HiFi4 with
  ``math_approx_mode=False`` and ``exp_approx_mode=False``;
- cache length % S == 0; at most 32 query heads; Hq % Hkv == 0; bfloat16 query; pos + 1 > 2S for every row (no
  valid output otherwise);
- the core grid: the program factory reserves the device grid's last row for CCL, so the op gets at most
  ``(device.x, device.y - 1)`` (``op_grid``), and batch x KV heads must fit in its cores (one head per core);
- ``paged_update_cache`` takes the new token in float32 or bfloat16, tile layout, height-sharded one row per
  core with shard width D, one index per row; the cache itself interleaved (bfloat8_b allowed);
- windows: first [0, S), last [ceil32(pos+1) - S, ceil32(pos+1)), later positions masked (window_align=32);
- returns (full, speculative) ``[1, B, padded heads, D]`` in the query's dtype and the SQUARED distance and
  norm ``[1, 1, B, 1]`` in bfloat16, over all query heads x head_dim.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from ... import semantics
from ...constants import TILE
from ...config import ConfigError, tt_window_problem

OP_NAME = "speculative_scaled_dot_product_attention_decode"
DEFAULT_LAMBDA = 0.2  # the op's default lambda_ (docs/tt_op_contract.md)
OP_KEYWORDS = frozenset({"lambda_", "is_causal", "attn_mask", "cur_pos", "cur_pos_tensor", "scale", "memory_config",
                         "program_config", "compute_kernel_config", "priority_tensor", "other_priority_tensor",
                         "ccl_enabled", "multi_device_global_semaphore", "queue_id"})
MAX_QUERY_HEADS = 32

# Host mode has no device to ask for its grid: a Wormhole N150's worker grid is assumed (an assumption of
# this project, not a number of the contract); on a card the device's compute_with_storage_grid_size() counts.
HOST_GRID = (8, 7)
UPDATE_INPUT_DTYPE = "bfloat16"  # paged_update_cache's input: float32 or bfloat16 only, whatever the cache's dtype


def op_grid(ttnn: Any, device_grid: Any) -> Any:
    """The cores the op may use: the device grid without its last row, which the program factory reserves for CCL
    (``TT_FATAL(num_cores_available <= x * (y - 1), ...)``)."""
    return ttnn.CoreCoord(device_grid.x, device_grid.y - 1)


def check_limits(query_heads: int, kv_heads: int, batch: int | None, cores: int) -> None:
    """The op's limits on a model and batch size, as one ConfigError naming the limit, before any weights load."""
    if query_heads > MAX_QUERY_HEADS:
        raise ConfigError(f"the TT op takes at most {MAX_QUERY_HEADS} query heads per device; this model has "
                          f"{query_heads}: shard the heads over devices (tensor parallelism) or use backend=sim")
    if query_heads % kv_heads:
        raise ConfigError(f"the TT op needs query heads divisible by KV heads; this model has {query_heads} and "
                          f"{kv_heads}: use backend=sim")
    if batch is not None and batch * kv_heads > cores:
        raise ConfigError(f"the TT op runs one KV head per core: batch_size={batch} x {kv_heads} KV heads = "
                          f"{batch * kv_heads} exceeds the {cores} cores it may use (the device grid without its last "
                          f"row, which the op reserves for CCL); use batch_size <= {max(cores // kv_heads, 1)}")


def padded_heads(query_heads: int) -> int:
    """The query-head rows of the op's outputs: the next power of 2 of ceil32(heads), as the authors pad them."""
    return 1 << (-(-query_heads // TILE) * TILE - 1).bit_length()


def cache_length(length: int, window: int) -> int:
    """A KV cache length the op takes: a multiple of S (which is a multiple of 32)."""
    return -(-length // window) * window


def program_config(ttnn: Any, grid: Any, query_heads: int, window: int) -> Any:
    """The authors' program config: S as k_chunk_size, exact exponentials."""
    return ttnn.SDPAProgramConfig(compute_with_storage_grid_size=grid, q_chunk_size=padded_heads(query_heads),
                                  k_chunk_size=window, exp_approx_mode=False)


def compute_kernel_config(ttnn: Any) -> Any:
    """The authors' compute config: HiFi4, no approximate math (without one the op runs HiFi2, approximate)."""
    return ttnn.WormholeComputeKernelConfig(math_fidelity=ttnn.MathFidelity.HiFi4, math_approx_mode=False,
                                            fp32_dest_acc_en=False, packer_l1_acc=False)


def check_call(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kwargs: dict[str, Any]) -> tuple[list[int], int]:
    """Raise as the op would (TypeError for an unknown keyword, like pybind; RuntimeError for a violated
    precondition, like TT_FATAL); returns (cur_pos, S)."""
    unknown = set(kwargs) - OP_KEYWORDS
    if unknown:
        raise TypeError(f"{OP_NAME}(): incompatible keyword arguments {sorted(unknown)}")
    config = kwargs.get("program_config")
    if config is None:
        raise RuntimeError("no program_config: the op would pick its own chunk size, not S")
    window = int(config.k_chunk_size)
    if tt_window_problem(window):
        raise RuntimeError(f"k_chunk_size {window} must be a power of 2 and a multiple of {TILE}")
    if kwargs.get("compute_kernel_config") is None:
        raise RuntimeError("no compute_kernel_config: the op would run HiFi2 with approximate math")
    batch, heads, kv_heads, length = q.shape[1], q.shape[2], k.shape[1], k.shape[2]
    if q.shape[0] != 1 or k.shape[0] != batch or v.shape != k.shape or k.shape[3] != q.shape[3]:
        raise RuntimeError(f"shapes q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} are not "
                           "[1, B, Hq, D], [B, Hkv, L, D]")
    if length % window:
        raise RuntimeError(f"cache length {length} is not a multiple of k_chunk_size {window}")
    if heads > MAX_QUERY_HEADS or heads % kv_heads:
        raise RuntimeError(f"{heads} query heads over {kv_heads} KV heads")
    cur_pos = list(kwargs.get("cur_pos") or [])
    if len(cur_pos) != batch:
        raise RuntimeError(f"cur_pos has {len(cur_pos)} entries for a batch of {batch}")
    bad = [p for p in cur_pos if p + 1 <= 2 * window or p >= length]
    if bad:
        raise RuntimeError(f"cur_pos {bad}: the op needs 2S < pos + 1 <= cache length ({2 * window} < .. <= {length})")
    return cur_pos, window


def speculative_golden(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kwargs: Any) -> tuple[torch.Tensor, ...]:
    """The op on host tensors: q [1, B, Hq, D], k/v [B, Hkv, L, D] -> (full, speculative, dist^2, norm^2), with the
    op's keywords and preconditions (``check_call``). Attention runs in the query's dtype (torch SDPA, the exact
    part over [0, pos], the speculative part over the window_align=32 windows of ``semantics``)."""
    cur_pos, window = check_call(q, k, v, kwargs)
    batch, heads, dim = q.shape[1], q.shape[2], q.shape[3]
    scale = kwargs.get("scale")
    pos = torch.tensor(cur_pos)
    index, valid = semantics.window_positions(pos, window, TILE)
    full = q.new_zeros(1, batch, padded_heads(heads), dim)
    spec = torch.zeros_like(full)
    for b, p in enumerate(cur_pos):
        qb = q[0, b, :, None].unsqueeze(0)  # (1, Hq, 1, D)
        keys, values = k[b:b + 1].to(q.dtype), v[b:b + 1].to(q.dtype)
        full[0, b, :heads] = F.scaled_dot_product_attention(
            qb, keys[:, :, :p + 1], values[:, :, :p + 1], scale=scale, enable_gqa=True)[0, :, 0]
        w = index[b][valid[b]]
        spec[0, b, :heads] = F.scaled_dot_product_attention(
            qb, keys[:, :, w], values[:, :, w], scale=scale, enable_gqa=True)[0, :, 0]
    d, n = semantics.distances(spec[0, :, :heads], full[0, :, :heads])
    return full, spec, (d * d).bfloat16().reshape(1, 1, batch, 1), (n * n).bfloat16().reshape(1, 1, batch, 1)
