"""A Tenstorrent card that is not there: the device side of ttnn replaced by fakes that enforce the contracts.

The authors' speculative op (``../shared/tt_op_contract.md``) is a test double written here from the contract,
independently of alspec_eval's own statement of it: exactly the op's keyword arguments (anything else is a
TypeError, as pybind raises), its preconditions raised as errors (as TT_FATAL would), and its outputs from the
project's host golden. ttnn's exact decode op and ``paged_update_cache`` are faked the same way. Every call is
recorded, so tests can check what a card would have been sent.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

# From the contract: the op's Python signature after (q, k, v).
SPEC_KEYWORDS = {"lambda_", "is_causal", "attn_mask", "cur_pos", "cur_pos_tensor", "scale", "memory_config",
                 "program_config", "compute_kernel_config", "priority_tensor", "other_priority_tensor", "ccl_enabled",
                 "multi_device_global_semaphore", "queue_id"}
DECODE_KEYWORDS = {"is_causal", "attn_mask", "cur_pos", "cur_pos_tensor", "scale", "memory_config", "program_config",
                   "compute_kernel_config", "sliding_window_size", "queue_id"}
GRID = (8, 7)


@dataclass
class FakeTensor:
    value: torch.Tensor
    dtype: Any
    memory_config: Any = None


@dataclass
class FakeDevice:
    grid: Any
    calls: list[tuple[str, dict[str, Any]]] = field(default_factory=list)

    def compute_with_storage_grid_size(self) -> Any:
        return self.grid


def _round(ttnn: Any, tensor: torch.Tensor, dtype: Any) -> torch.Tensor:
    from alspec_eval.backends.tt import round_bfloat8_b

    return round_bfloat8_b(tensor) if dtype == ttnn.bfloat8_b else tensor.to(torch.bfloat16)


def install(monkeypatch: Any, ttnn: Any) -> FakeDevice:
    """Patch ``ttnn`` so that tt_mode=device runs here; returns the device, whose ``calls`` record every op."""
    from alspec_eval.backends.tt.contract import speculative_golden

    device = FakeDevice(ttnn.CoreCoord(*GRID))
    decode_golden = ttnn.get_golden_function(ttnn.transformer.scaled_dot_product_attention_decode)

    def from_torch(tensor: torch.Tensor, dtype: Any = None, layout: Any = None, device: Any = None,
                   memory_config: Any = None, **_: Any) -> FakeTensor:
        assert device is not None and layout == ttnn.TILE_LAYOUT, "device tensors are uploaded in tile layout"
        return FakeTensor(_round(ttnn, tensor, dtype), dtype, memory_config)

    def to_torch(tensor: Any, **_: Any) -> torch.Tensor:
        return tensor.value if isinstance(tensor, FakeTensor) else real_to_torch(tensor)

    def check_chunked(name: str, k: FakeTensor, kwargs: dict[str, Any]) -> int:
        config = kwargs.get("program_config")
        if config is None:
            raise RuntimeError(f"{name}: no program_config, the op would choose its own chunk size")
        chunk = int(config.k_chunk_size)
        if chunk % 32 or chunk & (chunk - 1):
            raise RuntimeError(f"{name}: k_chunk_size {chunk} is not a power of 2 and a multiple of 32")
        if k.value.shape[2] % chunk:
            raise RuntimeError(f"{name}: cache length {k.value.shape[2]} is not a multiple of k_chunk_size {chunk}")
        if kwargs.get("compute_kernel_config") is None:
            raise RuntimeError(f"{name}: no compute_kernel_config (HiFi2 and approximate math by default)")
        return chunk

    def speculative(q: FakeTensor, k: FakeTensor, v: FakeTensor, **kwargs: Any) -> tuple[FakeTensor, ...]:
        unknown = set(kwargs) - SPEC_KEYWORDS
        if unknown:
            raise TypeError(f"speculative_scaled_dot_product_attention_decode(): incompatible keyword arguments {unknown}")
        window = check_chunked("speculative op", k, kwargs)
        batch, heads, kv_heads = q.value.shape[1], q.value.shape[2], k.value.shape[1]
        if q.dtype != ttnn.bfloat16 or heads > 32 or heads % kv_heads or batch * kv_heads > GRID[0] * GRID[1]:
            raise RuntimeError(f"speculative op: q {q.dtype} {tuple(q.value.shape)} over {kv_heads} KV heads")
        cur_pos = list(kwargs.get("cur_pos", []))
        if len(cur_pos) != batch or any(p + 1 <= 2 * window or p >= k.value.shape[2] for p in cur_pos):
            raise RuntimeError(f"speculative op: cur_pos {cur_pos} with S={window}: no valid output for pos+1 <= 2S")
        device.calls.append(("speculative", {**kwargs, "cache_length": k.value.shape[2], "batch": batch}))
        outputs = speculative_golden(q.value, k.value, v.value, **kwargs)
        return tuple(FakeTensor(o, ttnn.bfloat16) for o in outputs)

    def sdpa_decode(q: FakeTensor, k: FakeTensor, v: FakeTensor, **kwargs: Any) -> FakeTensor:
        unknown = set(kwargs) - DECODE_KEYWORDS
        if unknown:
            raise TypeError(f"scaled_dot_product_attention_decode(): incompatible keyword arguments {unknown}")
        check_chunked("decode op", k, kwargs)
        device.calls.append(("decode", {**kwargs, "cache_length": k.value.shape[2], "batch": q.value.shape[1]}))
        return FakeTensor(decode_golden(q.value, k.value, v.value, cur_pos=kwargs["cur_pos"], scale=kwargs["scale"]),
                          ttnn.bfloat16)

    def paged_update_cache(cache: FakeTensor, token: FakeTensor, *, update_idxs: list[int], **kwargs: Any) -> FakeTensor:
        unknown = set(kwargs) - {"update_idxs_tensor", "share_cache", "page_table", "batch_offset",
                                 "compute_kernel_config"}
        if unknown:
            raise TypeError(f"paged_update_cache(): incompatible keyword arguments {unknown}")
        batch, kv_heads = cache.value.shape[0], cache.value.shape[1]
        if token.value.shape[:3] != (1, batch, 32) or token.memory_config is None or len(update_idxs) != batch:
            raise RuntimeError(f"paged_update_cache: input {tuple(token.value.shape)} must be [1, B, 32, D], "
                               "height-sharded, one index per row")
        if any(i >= cache.value.shape[2] for i in update_idxs):
            raise RuntimeError(f"paged_update_cache: index {max(update_idxs)} past the cache")
        device.calls.append(("update", {"update_idxs": list(update_idxs)}))
        rows = torch.arange(batch)
        cache.value[rows, :, torch.tensor(update_idxs)] = _round(ttnn, token.value[0, :, :kv_heads], cache.dtype)
        return cache

    real_to_torch = ttnn.to_torch
    monkeypatch.setattr(ttnn, "GetNumAvailableDevices", lambda: 1)
    monkeypatch.setattr(ttnn, "open_device", lambda device_id=0, **_: device)
    monkeypatch.setattr(ttnn, "close_device", lambda _: None)
    monkeypatch.setattr(ttnn, "from_torch", from_torch)
    monkeypatch.setattr(ttnn, "to_torch", to_torch)
    monkeypatch.setattr(ttnn.transformer, "scaled_dot_product_attention_decode", sdpa_decode)
    monkeypatch.setattr(ttnn.experimental, "speculative_scaled_dot_product_attention_decode", speculative, raising=False)
    monkeypatch.setattr(ttnn.experimental, "paged_update_cache", paged_update_cache)
    return device
