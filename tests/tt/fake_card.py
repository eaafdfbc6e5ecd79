"""A Tenstorrent card that is not there: the device side of ttnn replaced by fakes that enforce the contracts.

Written from ``docs/tt_op_contract.md`` and the tt-metal files it names (tenstorrent/tt-metal,
``ttnn/cpp/ttnn/operations/experimental/speculative_execution/speculative_sdpa_decode/``: ``device/
speculative_sdpa_decode_op.cpp`` validate(), ``device/speculative_sdpa_decode_program_factory.cpp``; the authors'
``tests/ttnn/unit_tests/operations/speculative_execution/test_speculative_flash_decode.py``; and
``ttnn/cpp/ttnn/operations/experimental/paged_cache/device/paged_cache_operation.cpp``) alone: nothing here imports
alspec_eval's statement of the contract (``backends/tt/contract.py``) or its bfloat8_b rounding, so a mistake
there cannot hide in both. Every call a card would reject is rejected here, by the card's own check, with a
message that starts with ``fake card:`` and names the check (tests match on it):

- the speculative op: keyword names (anything else is a TypeError, as pybind raises) and types; a program config
  with ``k_chunk_size`` = S (the window the card was installed for), ``q_chunk_size`` = the padded heads,
  ``exp_approx_mode=False`` and a grid within ``(device.x, device.y - 1)`` (the last row is CCL's) holding one
  core per KV head of every row; a compute config with HiFi4 and ``math_approx_mode=False``; cache length % S;
  at most 32 query heads, Hq % Hkv, a bfloat16 query; 2S < pos + 1 <= cache length for every row; causal, no
  mask;
- memory: q, K and V in tile layout; the query DRAM-interleaved or height-sharded, K and V DRAM-interleaved
  (``All other inputs must be in DRAM``), the output not sharded (the program factory's ``sharded output is not
  yet supported``). A tensor uploaded without a memory config lies where ttnn puts it: DRAM, interleaved;
- ttnn's exact decode op: the same program and compute configs, memory and cache rules;
- ``paged_update_cache``: the input in float32 or bfloat16, tile layout, height-sharded (row-major shard
  orientation) with one shard core per batch row and shard [32, D]; the cache interleaved in DRAM, of the
  input's batch; one index per row, inside the cache;
- what the rows hold, read from the tensors themselves and never from the backend's arithmetic: a row's
  ``cur_pos`` is the position of its newest token. While a model runs (:class:`Witness`: the host's query, KV
  cache and left padding as the model's attention call handed them to the backend), each row of every cache must
  be one host row's cache with its left padding dropped (in the cache's dtype, by this card's rounding; zero past
  it), its ``cur_pos`` that row's newest position, host length - 1 - left padding (so the cache holds the step's
  token there), and the query that row's; called outside a model, the newest token is the last position holding a
  nonzero key; the call records
  which host rows it computed (``rows``), for comparisons with sim row by row. On a card without the speculative
  op (``speculative_op=False``, a released wheel) the decode op also takes A~'s window keys: the first S and the
  last keys up to the current one, [ceil32(pos+1) - S, pos] (or [0, pos] while pos + 1 <= 2S), in that order.

Outputs follow the authors' golden (``get_speculative_flash_decode_expected`` in tt-metal's
test_speculative_flash_decode.py), written out here per row: exact attention over [0, pos], the speculative one
over the first S positions and [ceil32(pos+1) - S, ceil32(pos+1)) with positions after pos masked; outputs
[1, B, padded heads, D] in the query's dtype, distance and norm SQUARED, [1, 1, B, 1] bfloat16 (row major, DRAM).
Every accepted call is recorded in ``device.calls`` with its outputs (``out``) and, while a model runs, its layer,
host cache length, step (``step``: one per layer and decode step) and host rows.
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
# The device's compute_with_storage_grid_size(): not the backend's host default (8, 7), so a grid taken from the
# wrong place is refused. The op may use (8, 4) = 32 cores here, the grid of the authors' tests.
GRID = (8, 5)
SECOND_GRID = (4, 3)  # another card: the op may use (4, 2) = 8 cores
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
    written: torch.Tensor | None = None  # (B, L): positions paged_update_cache wrote (their token came as bfloat16)


@dataclass
class Witness:
    """One layer's decode step as the model's attention call hands it to the backend: the host's query
    (B, Hq, D), KV cache (B, Hkv, L, D) (left padded, the step's token last) and left padding per row."""

    step: int
    layer: int
    query: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor
    pad: list[int]


@dataclass
class FakeDevice:
    grid: Any
    window: int  # S: the k_chunk_size every op call must carry
    speculative_op: bool = True
    calls: list[tuple[str, dict[str, Any]]] = field(default_factory=list)
    witness: Witness | None = None
    steps: int = 0

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


def window_keys(pos: int, window: int) -> list[int]:
    """The key positions of A~ at position ``pos`` (the contract's windows): [0, S) and [ceil32(pos+1) - S, pos];
    the whole context [0, pos] while it fits in 2S."""
    if pos + 1 <= 2 * window:
        return list(range(pos + 1))
    end = -(-(pos + 1) // TILE) * TILE
    return list(range(window)) + list(range(end - window, pos + 1))


def install(monkeypatch: Any, ttnn: Any, window: int, grid: tuple[int, int] = GRID,
            speculative_op: bool = True) -> FakeDevice:
    """Patch ``ttnn`` so that tt_mode=device runs here, for a run with S = ``window`` on a device of ``grid``;
    without the authors' op where ``speculative_op`` is False (a released wheel: the backend's fallback). Returns
    the device, whose ``calls`` record every op it accepted."""
    from alspec_eval.backends.tt.speculator import TTSpeculator

    device = FakeDevice(ttnn.CoreCoord(*grid), window, speculative_op)
    real_to_torch = ttnn.to_torch
    dram, interleaved = ttnn.BufferType.DRAM, ttnn.TensorMemoryLayout.INTERLEAVED
    height = ttnn.TensorMemoryLayout.HEIGHT_SHARDED

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
        memory = ttnn.DRAM_MEMORY_CONFIG if memory_config is None else memory_config  # ttnn's default placement
        if memory.is_sharded():
            shard = memory.shard_spec
            rows = tensor.numel() // tensor.shape[-1]
            if memory.memory_layout == height and (shard.shape[1] != tensor.shape[-1]
                                                   or shard.shape[0] * shard.grid.num_cores() != rows):
                raise CardError("upload sharding", f"shards {list(shard.shape)} on {shard.grid.num_cores()} cores "
                                                   f"do not tile a tensor of {tuple(tensor.shape)}")
        return FakeTensor(store(tensor, dtype), dtype, layout, memory)

    def to_torch(tensor: Any, **_: Any) -> torch.Tensor:
        return tensor.value if isinstance(tensor, FakeTensor) else real_to_torch(tensor)

    def check_keywords(name: str, kwargs: dict[str, Any], allowed: set[str]) -> None:
        unknown = set(kwargs) - allowed
        if unknown:
            raise TypeError(f"{name}(): incompatible keyword arguments {sorted(unknown)}")

    def check_memory(name: str, q: FakeTensor, k: FakeTensor, v: FakeTensor, kwargs: dict[str, Any]) -> None:
        """speculative_sdpa_decode_op.cpp validate(): tiles; Q height-sharded or in DRAM, K and V in DRAM; the
        output not sharded; causal without a mask (the authors' K and V: ttnn.DRAM_MEMORY_CONFIG)."""
        for tensor, what in ((q, "query"), (k, "K"), (v, "V")):
            if not isinstance(tensor, FakeTensor) or tensor.layout != ttnn.TILE_LAYOUT:
                raise CardError("layout", f"{name}: the {what} must be a device tensor in tile layout")
        memory = q.memory_config
        if memory.memory_layout != height and (memory.memory_layout != interleaved or memory.buffer_type != dram):
            raise CardError("query memory", f"{name}: {memory}: height-sharded or DRAM interleaved")
        for tensor, what in ((k, "K"), (v, "V")):
            memory = tensor.memory_config
            if memory.memory_layout != interleaved or memory.buffer_type != dram:
                raise CardError("cache memory", f"{name}: the {what} cache is {memory}: DRAM interleaved")
            if tensor.dtype not in (ttnn.bfloat16, ttnn.bfloat8_b, ttnn.bfloat4_b):
                raise CardError("cache dtype", f"{name}: {tensor.dtype}")
        out = kwargs.get("memory_config")
        if out is not None and out.is_sharded():
            raise CardError("output memory", f"{name}: {out}: sharded output is not supported")
        if kwargs.get("is_causal", True) is not True or kwargs.get("attn_mask") is not None:
            raise CardError("causal", f"{name}: causal decode without attn_mask only")
        batch, dim = q.value.shape[1], q.value.shape[3]
        if q.value.shape[0] != 1 or k.value.shape[0] != batch or v.value.shape != k.value.shape \
                or k.value.shape[3] != dim:
            raise CardError("shapes", f"{name}: q {tuple(q.value.shape)}, k {tuple(k.value.shape)}, "
                                      f"v {tuple(v.value.shape)} are not [1, B, Hq, D], [B, Hkv, L, D]")

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
        if len(kwargs["cur_pos"]) != batch or any(not 0 <= p < k.value.shape[2] for p in kwargs["cur_pos"]):
            raise CardError("cur_pos", f"{kwargs['cur_pos']}: one position per row, inside the cache of "
                                       f"{k.value.shape[2]}")

    def holds(cache: FakeTensor, i: int, keys: torch.Tensor, whole: bool = True) -> bool:
        """Whether row i of ``cache`` holds ``keys`` (Hkv, n, D) from its start, in its own dtype, and (``whole``, a
        whole cache) nothing after them. A position paged_update_cache wrote holds its token as uploaded, in
        bfloat16, then stored: a float32 key rounds twice there."""
        n = keys.shape[1]
        row = cache.value[i]
        if n > row.shape[1]:
            return False
        expected = store(keys, cache.dtype)
        if cache.written is not None:
            expected = torch.where(cache.written[i, None, :n, None], store(keys.to(torch.bfloat16), cache.dtype),
                                   expected)
        if not torch.equal(row[:, :n], expected):
            return False
        return not whole or not row[:, n:].any()

    def read_rows(name: str, q: FakeTensor, k: FakeTensor, v: FakeTensor, cur_pos: list[int]) -> dict[str, Any]:
        """The card's own reading of what each row holds: cur_pos against the cache's contents; with a witness,
        the host row each op row computes. Returns what the call record adds."""
        w = device.witness
        if w is None:  # the newest token is the last that holds a key (a zero key, the pad token's, reads as none)
            filled = k.value.ne(0).any(-1).any(1)  # (B, L)
            newest = [int(f.nonzero().max()) if f.any() else -1 for f in filled]
            for i, p in enumerate(cur_pos):
                if p != newest[i]:
                    raise CardError("cur_pos", f"{name}: row {i} has cur_pos {p}, but the newest token of the cache "
                                               f"it was given is at {newest[i]}")
            return {}
        length = w.key.shape[2]

        def row_holds(i: int, b: int, window: bool) -> bool:
            """Whether row i holds host row b's cache (``window``: the fallback's gathered window keys of it)."""
            pad = w.pad[b]
            if not window:
                return holds(k, i, w.key[b][:, pad:]) and holds(v, i, w.value[b][:, pad:])
            keys = window_keys(length - 1 - pad, device.window)
            index = torch.tensor(keys) + pad
            return (len(keys) == cur_pos[i] + 1 and holds(k, i, w.key[b][:, index], whole=False)
                    and holds(v, i, w.value[b][:, index], whole=False))

        def match(window: bool) -> tuple[list[int], int | None]:
            """The host row each op row holds (each host row once), and the first op row that holds none."""
            rows: list[int] = []
            for i in range(len(cur_pos)):
                b = next((b for b in range(len(w.pad)) if b not in rows and row_holds(i, b, window)), None)
                if b is None:
                    return rows, i
                rows.append(b)
            return rows, None

        # One reading for the whole call: every row a whole cache, or (the fallback's A~) every row its window keys;
        # a row within 2S reads as both, its window being its whole context.
        window = False
        rows, missing = match(window)
        if missing is not None and not device.speculative_op:
            window = True
            rows, missing = match(window)
        if missing is not None:
            raise CardError("cache contents", f"{name}: row {missing} of the cache it was given (cur_pos "
                                              f"{cur_pos[missing]}) holds no host row's KV cache with its left padding "
                                              f"dropped (left padding {w.pad}, host length {length})")
        for i, (p, b) in enumerate(zip(cur_pos, rows)):
            if not window and p != length - 1 - w.pad[b]:
                raise CardError("cur_pos", f"{name}: row {i} holds host row {b}, whose newest token is at "
                                           f"{length - 1 - w.pad[b]} (host length {length}, left padding "
                                           f"{w.pad[b]}), but has cur_pos {p}")
            if not torch.equal(q.value[0, i], w.query[b].to(q.value.dtype)):
                raise CardError("query", f"{name}: row {i}'s query is not host row {b}'s")
        return {"step": w.step, "layer": w.layer, "length": length, "rows": rows, "window": window}

    def speculative(q: FakeTensor, k: FakeTensor, v: FakeTensor, **kwargs: Any) -> tuple[FakeTensor, ...]:
        check_keywords("speculative_scaled_dot_product_attention_decode", kwargs, SPEC_KEYWORDS)
        check_memory("speculative op", q, k, v, kwargs)
        check_configs("speculative op", q, k, kwargs)
        if not isinstance(kwargs.get("lambda_"), float):
            raise CardError("keyword types", f"lambda_={kwargs.get('lambda_')!r} is not a float")
        batch, heads, kv_heads, length = q.value.shape[1], q.value.shape[2], k.value.shape[1], k.value.shape[2]
        if q.dtype != ttnn.bfloat16 or heads > 32 or heads % kv_heads:
            raise CardError("heads", f"q {q.dtype} with {heads} heads over {kv_heads} KV heads")
        cur_pos, s = kwargs["cur_pos"], device.window
        if any(p + 1 <= 2 * s for p in cur_pos):
            raise CardError("trivial rows", f"cur_pos {cur_pos} with S = {s}, cache {length}: needs 2S < pos + 1")
        seen = read_rows("speculative op", q, k, v, cur_pos)
        full, spec = authors_golden(q.value[0], k.value, v.value, cur_pos, s, kwargs["scale"])
        padded = int(kwargs["program_config"].q_chunk_size)
        outs = [torch.zeros(1, batch, padded, q.value.shape[3], dtype=q.value.dtype) for _ in range(2)]
        outs[0][0, :, :heads], outs[1][0, :, :heads] = full, spec
        d2 = (full.float() - spec.float()).square().sum((1, 2)).bfloat16().reshape(1, 1, batch, 1)
        n2 = full.float().square().sum((1, 2)).bfloat16().reshape(1, 1, batch, 1)
        device.calls.append(("speculative", {**kwargs, "cache_length": length, "batch": batch, **seen,
                                             "out": (outs[0].clone(), outs[1].clone(), d2.clone(), n2.clone())}))
        memory = kwargs.get("memory_config") or ttnn.DRAM_MEMORY_CONFIG
        return (*(FakeTensor(o, q.dtype, ttnn.TILE_LAYOUT, memory) for o in outs),
                *(FakeTensor(t, ttnn.bfloat16, ttnn.ROW_MAJOR_LAYOUT, ttnn.DRAM_MEMORY_CONFIG) for t in (d2, n2)))

    def sdpa_decode(q: FakeTensor, k: FakeTensor, v: FakeTensor, **kwargs: Any) -> FakeTensor:
        check_keywords("scaled_dot_product_attention_decode", kwargs, DECODE_KEYWORDS)
        check_memory("decode op", q, k, v, kwargs)
        check_configs("decode op", q, k, kwargs)
        seen = read_rows("decode op", q, k, v, kwargs["cur_pos"])
        heads, padded = q.value.shape[2], int(kwargs["program_config"].q_chunk_size)
        out = torch.zeros(1, q.value.shape[1], padded, q.value.shape[3], dtype=q.value.dtype)
        out[0, :, :heads] = exact_attention(q.value[0], k.value, v.value, kwargs["cur_pos"], kwargs["scale"])
        device.calls.append(("decode", {**kwargs, "cache_length": k.value.shape[2], "batch": q.value.shape[1], **seen,
                                        "out": out.clone()}))
        return FakeTensor(out, q.dtype, ttnn.TILE_LAYOUT, kwargs.get("memory_config") or ttnn.DRAM_MEMORY_CONFIG)

    def paged_update_cache(cache: FakeTensor, token: FakeTensor, **kwargs: Any) -> FakeTensor:
        check_keywords("paged_update_cache", kwargs, UPDATE_KEYWORDS)
        batch, kv_heads, length, dim = cache.value.shape
        if token.dtype not in (ttnn.float32, ttnn.bfloat16):
            raise CardError("update input dtype", f"{token.dtype}; paged_update_cache takes float32 or bfloat16")
        if token.layout != ttnn.TILE_LAYOUT or tuple(token.value.shape[:3]) != (1, batch, TILE) \
                or token.value.shape[3] != dim:
            raise CardError("update input", f"{tuple(token.value.shape)} must be [1, B, 32, D] in tile layout")
        memory = token.memory_config
        if memory.memory_layout != height:
            raise CardError("update input sharding", f"{memory}: height-sharded, one row per core")
        shard = memory.shard_spec
        if shard.grid.num_cores() != batch or list(shard.shape) != [TILE, dim]:
            raise CardError("update input sharding", f"{shard}: one shard core per row, shard [32, {dim}]")
        if shard.orientation != ttnn.ShardOrientation.ROW_MAJOR:
            raise CardError("update input sharding", f"{shard.orientation}: only ROW_MAJOR sharding is supported")
        if cache.layout != ttnn.TILE_LAYOUT or cache.memory_config.memory_layout != interleaved \
                or cache.memory_config.buffer_type != dram:
            raise CardError("update cache", f"{cache.memory_config}: the cache must be interleaved, in DRAM, tiled")
        if kwargs.get("batch_offset", 0) != 0 or kwargs.get("page_table") is not None:
            raise CardError("update cache", "batch_offset must be 0; no page table for a contiguous cache")
        idxs = kwargs.get("update_idxs")
        if not isinstance(idxs, list) or len(idxs) != batch or any(not 0 <= i < length for i in idxs):
            raise CardError("update indices", f"{idxs}: one index per row, inside the cache of {length}")
        device.calls.append(("update", {"update_idxs": list(idxs)}))
        rows, idxs = torch.arange(batch), torch.tensor(idxs)
        cache.value[rows, :, idxs] = store(token.value[0, :, :kv_heads].float(), cache.dtype)
        if cache.written is None:
            cache.written = torch.zeros(batch, length, dtype=torch.bool)
        cache.written[rows, idxs] = True
        return cache

    real_attend = TTSpeculator.attend

    def attend(self: Any, module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *args: Any,
               **kwargs: Any) -> Any:
        """The model's attention call into the backend: a decode step's host tensors become the card's witness."""
        if query.shape[2] != 1 or self.session is None:
            return real_attend(self, module, query, key, value, *args, **kwargs)
        device.steps += 1
        device.witness = Witness(device.steps, module.layer_idx, query[:, :, 0], key, value,
                                 self.session.region.pad.tolist())
        try:
            return real_attend(self, module, query, key, value, *args, **kwargs)
        finally:
            device.witness = None

    monkeypatch.setattr(TTSpeculator, "attend", attend)
    monkeypatch.setattr(ttnn, "GetNumAvailableDevices", lambda: 1)
    monkeypatch.setattr(ttnn, "open_device", lambda device_id=0, **_: device)
    monkeypatch.setattr(ttnn, "close_device", lambda _: None)
    monkeypatch.setattr(ttnn, "from_torch", from_torch)
    monkeypatch.setattr(ttnn, "to_torch", to_torch)
    monkeypatch.setattr(ttnn.transformer, "scaled_dot_product_attention_decode", sdpa_decode)
    if speculative_op:
        monkeypatch.setattr(ttnn.experimental, "speculative_scaled_dot_product_attention_decode", speculative,
                            raising=False)
    else:
        monkeypatch.delattr(ttnn.experimental, "speculative_scaled_dot_product_attention_decode", raising=False)
    monkeypatch.setattr(ttnn.experimental, "paged_update_cache", paged_update_cache)
    return device


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """One row: q (Hq, D) over the keys and values k, v (Hkv, n, D), each KV head serving Hq / Hkv consecutive query
    heads as in the authors' golden (``repeat`` per KV head); in the query's dtype."""
    k, v = k.to(q.dtype), v.to(q.dtype)
    return torch.nn.functional.scaled_dot_product_attention(q[None, :, None], k[None], v[None], scale=scale,
                                                            enable_gqa=True)[0, :, 0]


def exact_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cur_pos: list[int],
                    scale: float) -> torch.Tensor:
    """q (B, Hq, D) over keys [0, pos] of each row."""
    return torch.stack([_attend(q[b], k[b, :, :p + 1], v[b, :, :p + 1], scale) for b, p in enumerate(cur_pos)])


def authors_golden(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cur_pos: list[int], window: int,
                   scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(full, speculative) per row: the speculative output attends to [0, S) and [ceil32(pos+1) - S, pos]."""
    spec = []
    for b, p in enumerate(cur_pos):
        start = -(-(p + 1) // TILE) * TILE - window
        kk, vv = (torch.cat([t[b, :, :window], t[b, :, start:p + 1]], 1) for t in (k, v))
        spec.append(_attend(q[b], kk, vv, scale))
    return exact_attention(q, k, v, cur_pos, scale), torch.stack(spec)
