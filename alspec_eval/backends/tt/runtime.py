"""The ttnn calls of a run: on the card (tt_mode=device) or as golden functions on host tensors (tt_mode=host).

Every op is called the same way in both modes. On the host an op runs as ttnn's own golden function; the
authors' speculative op has none, so :func:`contract.speculative_golden` stands in. Without a card ttnn builds
no tile-layout tensors (bfloat8_b included), so host mode keeps KV caches as torch tensors holding the values
the device would hold (``round_bfloat8_b``).
"""

from __future__ import annotations

import atexit
import functools
from types import ModuleType
from typing import Any, Callable

import torch

from . import contract


def round_bfloat8_b(x: torch.Tensor) -> torch.Tensor:
    """``x`` rounded as tt-metal packs bfloat8_b tiles: each 16 values of a face row (16 consecutive entries of
    the last dim, one token's) share the exponent of the largest and keep a 7-bit magnitude, rounded to nearest
    even and saturated. The result is exact in bfloat16. ``ttnn.from_torch`` does this only with a card present.
    """
    groups = x.float().reshape(*x.shape[:-1], -1, 16)
    _, exponent = torch.frexp(groups.abs().amax(-1, keepdim=True))  # max in [2^(e-1), 2^e)
    step = torch.ldexp(torch.ones_like(groups[..., :1]), exponent - 7)
    mantissa = torch.round(groups.abs() / step).clamp_max(127)
    return (groups.sign() * mantissa * step).reshape(x.shape).to(torch.bfloat16)


class TTRuntime:
    """One run's device (or none), grid, compute config and ops: what the model's load fixes (``tt_mode``,
    ``tt_device_id``, ``tt_kv_dtype``, ``tt_kernel``). What a call speculates with (the window) comes per call."""

    def __init__(self, ttnn: ModuleType, *, mode: str, device_id: int = 0, kv_dtype: str = "bfloat8_b",
                 kernel: str = "ttnn") -> None:
        self.ttnn = ttnn
        self.kv_dtype = getattr(ttnn, kv_dtype)
        self.device = None
        self.ttlang: Callable | None = None  # tt_kernel=ttlang: kernels.ttlang.decode.ttlang_decode on this device
        if mode == "device":
            self.device = ttnn.open_device(device_id=device_id)
            atexit.register(ttnn.close_device, self.device)
        if kernel == "ttlang":
            from ...kernels.ttlang.decode import ttlang_decode

            device = self.device if self.device is not None else ttnn.open_device(device_id=0)  # the simulator's
            self.ttlang = functools.partial(ttlang_decode, device=device)
            self.has_speculative_op = False
            return
        device_grid = (self.device.compute_with_storage_grid_size() if self.device is not None
                       else ttnn.CoreCoord(*contract.HOST_GRID))
        self.grid = contract.op_grid(ttnn, device_grid)  # the op's cores: the device's last row is CCL's
        self.compute_config = contract.compute_kernel_config(ttnn)
        self.has_speculative_op = hasattr(getattr(ttnn, "experimental", None), contract.OP_NAME)

    @property
    def cores(self) -> int:
        return self.grid.x * self.grid.y

    # ------------------------------------------------------------------ tensors

    def upload(self, tensor: torch.Tensor, dtype: Any) -> Any:
        """``tensor`` on the device in ``dtype`` (tile layout); on the host a torch tensor of the device's values."""
        ttnn = self.ttnn
        if self.device is not None:
            return ttnn.from_torch(tensor.contiguous(), dtype=dtype, layout=ttnn.TILE_LAYOUT, device=self.device)
        return round_bfloat8_b(tensor) if dtype == ttnn.bfloat8_b else tensor.to(torch.bfloat16)

    def download(self, tensor: Any) -> torch.Tensor:
        return tensor if isinstance(tensor, torch.Tensor) else self.ttnn.to_torch(tensor)

    def append(self, cache: Any, new: torch.Tensor, positions: list[int]) -> Any:
        """Write one token per row (``new`` (B, Hkv, D)) into a resident (B, Hkv, L, D) cache at ``positions``, as
        tt_transformers does: ``paged_update_cache`` with per-row indices and the input [1, B, 32, D] height-sharded
        one row per core."""
        ttnn = self.ttnn
        if self.device is None:
            rows = torch.arange(len(positions))
            cache[rows, :, torch.tensor(positions)] = self.upload(new, self.kv_dtype)
            return cache
        batch, heads, dim = new.shape
        padded = new.new_zeros(1, batch, contract.TILE, dim)
        padded[0, :, :heads] = new
        shards = ttnn.create_sharded_memory_config(
            shape=(contract.TILE, dim), core_grid=ttnn.num_cores_to_corerangeset(batch, self.grid, row_wise=True),
            strategy=ttnn.ShardStrategy.HEIGHT, use_height_and_width_as_shard_shape=True)
        token = ttnn.from_torch(padded, dtype=getattr(ttnn, contract.UPDATE_INPUT_DTYPE), layout=ttnn.TILE_LAYOUT,
                                device=self.device, memory_config=shards)
        ttnn.experimental.paged_update_cache(cache, token, update_idxs=positions)
        return cache

    # ------------------------------------------------------------------ ops

    def sdpa_decode(self, q: Any, k: Any, v: Any, *, cur_pos: list[int], scale: float, query_heads: int,
                    window: int) -> Any:
        """ttnn's exact decode attention (the trivial steps, and A and A~ where ttnn lacks the speculative op)."""
        op = self.ttnn.transformer.scaled_dot_product_attention_decode
        kwargs = dict(cur_pos=cur_pos, scale=scale, program_config=self.program_config(query_heads, window),
                      compute_kernel_config=self.compute_config)
        if self.device is not None:
            return op(q, k, v, **kwargs)
        golden = self.ttnn.get_golden_function(op)
        return golden(q, k, v, cur_pos=cur_pos, scale=scale)

    def speculative(self, q: Any, k: Any, v: Any, *, lam: float, cur_pos: list[int], scale: float,
                    query_heads: int, window: int) -> tuple[Any, ...]:
        """The authors' op, called exactly as its contract says; on the host its golden (contract.py)."""
        kwargs = dict(lambda_=lam, cur_pos=cur_pos, scale=scale, program_config=self.program_config(query_heads, window),
                      compute_kernel_config=self.compute_config)
        if self.device is not None:
            return getattr(self.ttnn.experimental, contract.OP_NAME)(q, k, v, **kwargs)
        return contract.speculative_golden(q, k, v, **kwargs)

    def program_config(self, query_heads: int, window: int) -> Any:
        return contract.program_config(self.ttnn, self.grid, query_heads, window)

    def kernel_decode(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor, window: int,
                      scale: float) -> tuple[torch.Tensor, ...]:
        """tt_kernel=ttlang: (A, A~, d^2, n^2) of a decode step from the TT-Lang kernel. On the simulator (which
        computes in float32 whatever the dtype) the KV cache is rounded to bfloat8_b here, as in the golden path."""
        kv_dtype = self.kv_dtype
        if self.device is None:
            if kv_dtype == self.ttnn.bfloat8_b:
                k, v = round_bfloat8_b(k), round_bfloat8_b(v)
            kv_dtype = self.ttnn.bfloat16
        return self.ttlang(q, k, v, pos.tolist(), window, scale, kv_dtype=kv_dtype)
