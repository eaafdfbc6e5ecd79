"""A Tenstorrent card that is not there: the device side of ttnn replaced by fakes that enforce the contracts.

Written from ``../shared/tt_op_contract.md`` alone: nothing here imports alspec_eval's statement of the contract
(``backends/tt/contract.py``) or its bfloat8_b rounding, so a mistake there cannot hide in both. Every call a card
would reject is rejected here, by the card's own check, with a message that starts with ``fake card:`` and names
the check (tests match on it):

- the speculative op: keyword names (anything else is a TypeError, as pybind raises) and types; a program config
  with ``k_chunk_size`` = S (the window the card was installed for), ``q_chunk_size`` = the padded heads,
  ``exp_approx_mode=False`` and a grid within ``(device.x, device.y - 1)`` (the last row is CCL's) holding one
  core per KV head of every row; a compute config with HiFi4 and ``math_approx_mode=False``; cache length % S;
  at most 32 query heads, Hq % Hkv, a bfloat16 query; 2S < pos + 1 <= cache length for every row;
- ttnn's exact decode op: the same program and compute configs and cache rule;
- ``paged_update_cache``: the input in float32 or bfloat16, tile layout, height-sharded with one shard core per
  batch row and shard width D; the cache interleaved; one index per row, inside the cache.

Outputs follow the authors' golden (``get_speculative_flash_decode_expected`` in tt-metal's
test_speculative_flash_decode.py), written out here per row: exact attention over [0, pos], the speculative one
over the first S positions and [ceil32(pos+1) - S, ceil32(pos+1)) with positions after pos masked; outputs
[1, B, padded heads, D] in the query's dtype, distance and norm SQUARED, [1, 1, B, 1] bfloat16. Every accepted
call is recorded in ``device.calls``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch

# From the contract: the op's Python signature after (q, k, v).
SPEC_KEYWORDS = {"lambda_", "is_causal", "attn_mask", "cur_pos", "cur_pos_tensor", "scale", "memory_config",
                 "program_config", "compute_kernel_config", "priority_tensor", "other_priority_tensor", "ccl_enabled",
                 "multi_device_global_semaphore", "queue_id"}
DECODE_KEYWORDS = {"is_causal", "attn_mask", "cur_pos", "cur_pos_tensor", "scale", "memory_config", "program_config",
                   "compute_kernel_config", "sliding_window_size", "queue_id"}
UPDATE_KEYWORDS = {"update_idxs", "update_idxs_tensor", "share_cache", "page_table", "batch_offset",
                   "compute_kernel_config"}
GRID = (8, 7)  # the device's compute_with_storage_grid_size(); the ops may use (8, 6)
TILE = 32


class CardError(RuntimeError):
    """A call the card rejects (TT_FATAL on a real card)."""

    def __init__(self, check: str, detail: str) -> None:
        super().__init__(f"fake card: {check}: {detail}")
        self.check = check


@dataclass
class FakeTensor:
    value: torch.Tensor
    dtype: Any
    layout: Any = None
    memory_config: Any = None


@dataclass
class FakeDevice:
    grid: Any
    window: int  # S: the k_chunk_size every op call must carry
    calls: list[tuple[str, dict[str, Any]]] = field(default_factory=list)

    def compute_with_storage_grid_size(self) -> Any:
        return self.grid


def bfloat8_b(x: torch.Tensor) -> torch.Tensor:
    """tt-metal's bfloat8_b block float: every 16 consecutive values of a row share one exponent, that of the
    largest magnitude M (2^e with 2^(e-1) <= M < 2^e), and keep a sign and 7 magnitude bits: multiples of 2^(e-7)
    up to 127 of them, rounded half to even."""
    blocks = x.float().reshape(-1, 16)
    largest = blocks.abs().amax(1, keepdim=True)
    e = torch.where(largest > 0, torch.floor(torch.log2(largest)) + 1, torch.zeros_like(largest))
    unit = torch.exp2(e - 7)
    q = torch.round(blocks / unit).clamp(-127, 127) * unit
    return q.reshape(x.shape).to(torch.bfloat16)


def install(monkeypatch: Any, ttnn: Any, window: int) -> FakeDevice:
    """Patch ``ttnn`` so that tt_mode=device runs here, for a run with S = ``window``; returns the device, whose
    ``calls`` record every op it accepted."""
    device = FakeDevice(ttnn.CoreCoord(*GRID), window)
    real_to_torch = ttnn.to_torch

    def store(tensor: torch.Tensor, dtype: Any) -> torch.Tensor:
        if dtype == ttnn.bfloat8_b:
            return bfloat8_b(tensor)
        if dtype in (ttnn.bfloat16, ttnn.float32):
            return tensor.to(torch.bfloat16 if dtype == ttnn.bfloat16 else torch.float32)
        raise CardError("dtype", f"{dtype} is not a dtype this card stores")

    def from_torch(tensor: torch.Tensor, dtype: Any = None, layout: Any = None, device: Any = None,
                   memory_config: Any = None, **_: Any) -> FakeTensor:
        if device is None or layout != ttnn.TILE_LAYOUT:
            raise CardError("upload", "device tensors are uploaded to the device in tile layout")
        return FakeTensor(store(tensor, dtype), dtype, layout, memory_config)

    def to_torch(tensor: Any, **_: Any) -> torch.Tensor:
        return tensor.value if isinstance(tensor, FakeTensor) else real_to_torch(tensor)

    def check_keywords(name: str, kwargs: dict[str, Any], allowed: set[str]) -> None:
        unknown = set(kwargs) - allowed
        if unknown:
            raise TypeError(f"{name}(): incompatible keyword arguments {sorted(unknown)}")

    def check_configs(name: str, q: FakeTensor, k: FakeTensor, kwargs: dict[str, Any]) -> None:
        """Program config, compute config, grid and cache length: what the op and ttnn's decode op share."""
        config, compute = kwargs.get("program_config"), kwargs.get("compute_kernel_config")
        if not isinstance(config, ttnn.SDPAProgramConfig):
            raise CardError("program_config", f"{name} needs an SDPAProgramConfig, got {type(config).__name__}")
        if int(config.k_chunk_size) != device.window:
            raise CardError("k_chunk_size", f"{config.k_chunk_size} is not S = {device.window}")
        heads = q.value.shape[2]
        padded = 2 ** math.ceil(math.log2(math.ceil(heads / TILE) * TILE))
        if int(config.q_chunk_size) != padded:
            raise CardError("q_chunk_size", f"{config.q_chunk_size} for {heads} query heads, padded to {padded}")
        if config.exp_approx_mode is not False:
            raise CardError("exp_approx_mode", "approximate exponentials; the authors run exp_approx_mode=False")
        grid = config.compute_with_storage_grid_size
        if grid.x > device.grid.x or grid.y > device.grid.y - 1:
            raise CardError("grid", f"({grid.x}, {grid.y}) exceeds ({device.grid.x}, {device.grid.y - 1}): "
                                    "the last column is dedicated for ccl")
        batch, kv_heads = q.value.shape[1], k.value.shape[1]
        if batch * kv_heads > grid.x * grid.y:
            raise CardError("grid", f"{batch} rows x {kv_heads} KV heads need more than the {grid.x * grid.y} cores")
        if not isinstance(compute, ttnn.WormholeComputeKernelConfig):
            raise CardError("compute_kernel_config", f"{name} needs one, got {type(compute).__name__}")
        if compute.math_fidelity != ttnn.MathFidelity.HiFi4:
            raise CardError("math_fidelity", f"{compute.math_fidelity}; the authors run HiFi4")
        if compute.math_approx_mode is not False:
            raise CardError("math_approx_mode", "approximate math; the authors run math_approx_mode=False")
        if k.value.shape[2] % device.window:
            raise CardError("cache length", f"{k.value.shape[2]} is not a multiple of S = {device.window}")
        if not isinstance(kwargs.get("scale"), float) or not isinstance(kwargs.get("cur_pos"), list) or not all(
                isinstance(p, int) for p in kwargs["cur_pos"]):
            raise CardError("keyword types", "scale is a float and cur_pos a list of ints")

    def speculative(q: FakeTensor, k: FakeTensor, v: FakeTensor, **kwargs: Any) -> tuple[FakeTensor, ...]:
        check_keywords("speculative_scaled_dot_product_attention_decode", kwargs, SPEC_KEYWORDS)
        check_configs("speculative op", q, k, kwargs)
        if not isinstance(kwargs.get("lambda_"), float):
            raise CardError("keyword types", f"lambda_={kwargs.get('lambda_')!r} is not a float")
        batch, heads, kv_heads, length = q.value.shape[1], q.value.shape[2], k.value.shape[1], k.value.shape[2]
        if q.dtype != ttnn.bfloat16 or heads > 32 or heads % kv_heads:
            raise CardError("heads", f"q {q.dtype} with {heads} heads over {kv_heads} KV heads")
        cur_pos, s = kwargs["cur_pos"], device.window
        if len(cur_pos) != batch or any(p + 1 <= 2 * s or p >= length for p in cur_pos):
            raise CardError("trivial rows", f"cur_pos {cur_pos} with S = {s}, cache {length}: needs 2S < pos + 1")
        device.calls.append(("speculative", {**kwargs, "cache_length": length, "batch": batch}))
        full, spec = authors_golden(q.value[0], k.value, v.value, cur_pos, s, kwargs["scale"])
        padded = int(kwargs["program_config"].q_chunk_size)
        outs = [torch.zeros(1, batch, padded, q.value.shape[3], dtype=q.value.dtype) for _ in range(2)]
        outs[0][0, :, :heads], outs[1][0, :, :heads] = full, spec
        d2 = (full.float() - spec.float()).square().sum((1, 2))
        n2 = full.float().square().sum((1, 2))
        return (*(FakeTensor(o, q.dtype) for o in outs),
                *(FakeTensor(t.bfloat16().reshape(1, 1, batch, 1), ttnn.bfloat16) for t in (d2, n2)))

    def sdpa_decode(q: FakeTensor, k: FakeTensor, v: FakeTensor, **kwargs: Any) -> FakeTensor:
        check_keywords("scaled_dot_product_attention_decode", kwargs, DECODE_KEYWORDS)
        check_configs("decode op", q, k, kwargs)
        device.calls.append(("decode", {**kwargs, "cache_length": k.value.shape[2], "batch": q.value.shape[1]}))
        heads, padded = q.value.shape[2], int(kwargs["program_config"].q_chunk_size)
        out = torch.zeros(1, q.value.shape[1], padded, q.value.shape[3], dtype=q.value.dtype)
        out[0, :, :heads] = exact_attention(q.value[0], k.value, v.value, kwargs["cur_pos"], kwargs["scale"])
        return FakeTensor(out, q.dtype)

    def paged_update_cache(cache: FakeTensor, token: FakeTensor, **kwargs: Any) -> FakeTensor:
        check_keywords("paged_update_cache", kwargs, UPDATE_KEYWORDS)
        batch, kv_heads, length, dim = cache.value.shape
        if token.dtype not in (ttnn.float32, ttnn.bfloat16):
            raise CardError("update input dtype", f"{token.dtype}; paged_update_cache takes float32 or bfloat16")
        if token.layout != ttnn.TILE_LAYOUT or tuple(token.value.shape[:3]) != (1, batch, TILE):
            raise CardError("update input", f"{tuple(token.value.shape)} must be [1, B, 32, D] in tile layout")
        memory = token.memory_config
        if memory is None or memory.memory_layout != ttnn.TensorMemoryLayout.HEIGHT_SHARDED:
            raise CardError("update input sharding", f"{memory}: height-sharded, one row per core")
        if memory.shard_spec.grid.num_cores() != batch or list(memory.shard_spec.shape) != [TILE, dim]:
            raise CardError("update input sharding", f"{memory.shard_spec}: one shard core per row, shard [32, {dim}]")
        if cache.memory_config is not None and cache.memory_config.memory_layout != ttnn.TensorMemoryLayout.INTERLEAVED:
            raise CardError("update cache", "the cache must be interleaved")
        idxs = kwargs.get("update_idxs")
        if not isinstance(idxs, list) or len(idxs) != batch or any(not 0 <= i < length for i in idxs):
            raise CardError("update indices", f"{idxs}: one index per row, inside the cache of {length}")
        device.calls.append(("update", {"update_idxs": list(idxs)}))
        rows = torch.arange(batch)
        cache.value[rows, :, torch.tensor(idxs)] = store(token.value[0, :, :kv_heads].float(), cache.dtype)
        return cache

    monkeypatch.setattr(ttnn, "GetNumAvailableDevices", lambda: 1)
    monkeypatch.setattr(ttnn, "open_device", lambda device_id=0, **_: device)
    monkeypatch.setattr(ttnn, "close_device", lambda _: None)
    monkeypatch.setattr(ttnn, "from_torch", from_torch)
    monkeypatch.setattr(ttnn, "to_torch", to_torch)
    monkeypatch.setattr(ttnn.transformer, "scaled_dot_product_attention_decode", sdpa_decode)
    monkeypatch.setattr(ttnn.experimental, "speculative_scaled_dot_product_attention_decode", speculative, raising=False)
    monkeypatch.setattr(ttnn.experimental, "paged_update_cache", paged_update_cache)
    return device


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, keys: torch.Tensor, scale: float) -> torch.Tensor:
    """One row: q (Hq, D) over the key positions ``keys`` of k, v (Hkv, L, D), KV heads repeated for GQA as the
    authors' golden does; in the query's dtype."""
    group = q.shape[0] // k.shape[0]
    kk = k[:, keys].to(q.dtype).repeat_interleave(group, 0)
    vv = v[:, keys].to(q.dtype).repeat_interleave(group, 0)
    return torch.nn.functional.scaled_dot_product_attention(q[:, None], kk, vv, scale=scale)[:, 0]


def exact_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cur_pos: list[int],
                    scale: float) -> torch.Tensor:
    """q (B, Hq, D) over keys [0, pos] of each row."""
    return torch.stack([_attend(q[b], k[b], v[b], torch.arange(p + 1), scale) for b, p in enumerate(cur_pos)])


def authors_golden(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cur_pos: list[int], window: int,
                   scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(full, speculative) per row: the speculative output attends to [0, S) and [ceil32(pos+1) - S, pos]."""
    spec = []
    for b, p in enumerate(cur_pos):
        end = -(-(p + 1) // TILE) * TILE
        keys = torch.cat([torch.arange(window), torch.arange(end - window, p + 1)])
        spec.append(_attend(q[b], k[b], v[b], keys, scale))
    return exact_attention(q, k, v, cur_pos, scale), torch.stack(spec)
