"""The simulated reference backend: an attention function for transformers' AttentionInterface.

Every hooked attention call first runs the model's own attention implementation
(so exact positions are bit-identical to the plain model), then, for positions in
the decode region, attends over the first and last S keys only, verifies in float32
and commits the approximation where accepted (DESIGN.md, Semantics 1-5).
"""

from __future__ import annotations

import importlib.util
import math
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from transformers import AttentionInterface, PreTrainedModel
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from ..config import ConfigError, SpeculationConfig
from ..region import DecodeRegion, Trace
from ..stats import ACCEPTED, REJECTED, TRIVIAL

ATTR = "alspec_speculator"

# (query (B,Hq,1,D), key, value (B,Hkv,L,D), pad (B,), config, scaling) -> (A, A~), each (B,1,Hq,D): a
# decode step's exact and approximate attention computed together (the speculative flash decode).
DecodeKernel = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, SpeculationConfig, float],
                        tuple[torch.Tensor, torch.Tensor]]


def flash_decode_kernel(name: str, device: torch.device) -> DecodeKernel | None:
    """``kernel=torch|triton``: decode steps through the speculative flash decode, A~ being its first partial.

    ``auto`` is Triton on CUDA and, on the CPU, ``sdpa``: the model's own attention for A plus a gathered
    2S-key attention for A~, which keeps A bit-identical to the plain model.
    """
    from ..kernels import select_kernel

    if name == "auto":
        name = "triton" if device.type == "cuda" and importlib.util.find_spec("triton") else "sdpa"
    if name == "sdpa":
        return None
    kernel = select_kernel(name, device)

    def decode(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, pad: torch.Tensor,
               config: SpeculationConfig, scaling: float) -> tuple[torch.Tensor, torch.Tensor]:
        cur_pos = torch.full_like(pad, key.shape[2] - 1)
        out = kernel(query[:, :, 0], key, value, cur_pos, config.window, math.inf, window_align=config.window_align,
                     scale=scaling, start=pad)
        return out.exact[:, None], out.spec[:, None]

    return decode


@dataclass
class _Pass:
    """The decode-region geometry of one forward pass, shared by all its layers, and their decisions.

    rows, cols: the speculated (batch row, query index) positions; ``index``: each one's 2S window
    positions in the KV cache and ``mask`` the ones past the current token (window_align=32 only).
    """

    q_len: int
    offset: int  # physical index of the first query
    trivial: torch.Tensor  # (B, q_len) bool
    rows: torch.Tensor
    cols: torch.Tensor
    index: torch.Tensor
    mask: torch.Tensor | None
    decisions: dict[int, tuple[torch.Tensor, torch.Tensor] | None] = field(default_factory=dict)


class Speculator:
    """Holds the config, the active decode region and the decisions recorded during it."""

    def __init__(self, config: SpeculationConfig, num_layers: int, skipped_layers: dict[int, str],
                 base_attention: Callable, decode_kernel: DecodeKernel | None = None) -> None:
        self.config = config
        self.num_layers = num_layers
        self.skipped_layers = skipped_layers
        self.base_attention = base_attention
        self.decode_kernel = decode_kernel
        self.region: DecodeRegion | None = None
        self._passes: list[_Pass | None] = []

    @contextmanager
    def speculating(self, region: DecodeRegion) -> Iterator[Trace]:
        """Speculate inside ``region`` for the forward passes run in this block; the trace fills on exit."""
        if self.region is not None:
            raise RuntimeError("speculating() blocks cannot nest")
        self.region, self._passes = region, []
        trace = Trace(torch.empty(0), torch.empty(0))
        try:
            yield trace
        finally:
            passes = [p for p in self._passes if p is not None]
            trace.codes, trace.ratios = self._assemble(len(region.pad), passes)
            trace.offset = passes[0].offset if passes else 0
            self.region, self._passes = None, []

    def new_forward(self, *_: object) -> None:
        """Forward pre-hook of the model: each forward pass appends its query positions to the trace."""
        if self.region is not None:
            self._passes.append(None)

    def _plan(self, query: torch.Tensor, key: torch.Tensor) -> _Pass:
        """Which positions of this pass speculate, and their window positions (computed at its first layer)."""
        cfg, region = self.config, self.region
        q_len, k_len = query.shape[2], key.shape[2]
        phys = torch.arange(k_len - q_len, k_len, device=query.device)
        pos = phys - region.pad[:, None]  # (B, Tq) position within the sequence
        in_region = (phys >= region.spec_start[:, None]) & (phys < region.row_end[:, None])
        if region.exact is not None:
            in_region &= ~region.exact[:, None]
        trivial = in_region & (pos + 1 <= 2 * cfg.window)
        rows, cols = (in_region & ~trivial).nonzero(as_tuple=True)
        index, mask = window_index(pos[rows, cols], region.pad[rows], cfg.window, cfg.window_align, k_len)
        return _Pass(q_len, k_len - q_len, trivial, rows, cols, index, mask)

    def _assemble(self, batch: int, passes: list[_Pass]) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-pass sparse decisions as dense (batch, positions, layers) codes and ratios."""
        codes, ratios = [], []
        for p in passes:
            c = torch.zeros(batch, p.q_len, self.num_layers, dtype=torch.int8)
            r = torch.full((batch, p.q_len, self.num_layers), float("nan"))
            rows, cols, trivial = p.rows.cpu(), p.cols.cpu(), p.trivial.cpu()
            for layer, decision in p.decisions.items():
                c[:, :, layer].masked_fill_(trivial, TRIVIAL)
                if decision is None:  # a static policy's exact layer: decided, not measured
                    c[rows, cols, layer] = REJECTED
                    continue
                accept, ratio = decision
                c[rows, cols, layer] = torch.where(accept.cpu(), ACCEPTED, REJECTED).to(torch.int8)
                r[rows, cols, layer] = ratio.cpu()
            codes.append(c)
            ratios.append(r)
        if not codes:
            return torch.zeros(batch, 0, self.num_layers, dtype=torch.int8), torch.zeros(batch, 0, self.num_layers)
        return torch.cat(codes, 1), torch.cat(ratios, 1)

    def commit(self, layer: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               exact: torch.Tensor, scaling: float, approx_all: torch.Tensor | None = None) -> torch.Tensor:
        """Return the committed attention output (batch, q_len, heads, head_dim) and record the decisions.

        ``approx_all`` (same shape as ``exact``) is A~ for every position when a decode kernel computed it
        together with A; otherwise A~ is computed here for the speculated positions only.
        """
        cfg, region = self.config, self.region
        assert region is not None
        if self._passes[-1] is None:
            self._passes[-1] = self._plan(query, key)
        plan = self._passes[-1]
        rows, cols = plan.rows, plan.cols
        if cfg.policy == "static" and layer not in cfg.static_layers:
            plan.decisions[layer] = None
            return exact
        if not len(rows):
            plan.decisions[layer] = (torch.empty(0, dtype=torch.bool), torch.empty(0))
            return exact
        if approx_all is not None:
            approx = approx_all[rows, cols]
        else:
            approx = sink_attention(query[rows, :, cols], key, value, rows, plan.index, plan.mask, scaling)
        exact_rows = exact[rows, cols]
        d, n = self.distances(approx, exact_rows, rows, cols)
        if cfg.policy != "dynamic":
            accept = torch.ones_like(d, dtype=torch.bool)
        elif region.lam is not None:
            lam = region.lam[rows]
            accept = self.within(d, n, lam) | torch.isinf(lam)
        else:
            accept = self.within(d, n, cfg.lam) if cfg.lam != float("inf") else torch.ones_like(d, dtype=torch.bool)
        exact[rows, cols] = torch.where(accept[:, None, None], approx, exact_rows)
        plan.decisions[layer] = (accept, d / n)
        return exact

    def distances(self, approx: torch.Tensor, exact: torch.Tensor, rows: torch.Tensor,
                  cols: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """d = ||A~ - A|| and n = ||A|| (float32) of the speculated (row, col) positions; a backend whose op
        verifies on the device overrides this to report the device's numbers."""
        return (approx.float() - exact.float()).flatten(1).norm(dim=-1), exact.float().flatten(1).norm(dim=-1)

    def within(self, d: torch.Tensor, n: torch.Tensor, lam: float | torch.Tensor) -> torch.Tensor:
        """The acceptance test d <= lam * n (DESIGN.md, Semantics 4); the TT op compares squares instead."""
        return d <= lam * n


def window_index(pos: torch.Tensor, pad: torch.Tensor, window: int, window_align: int,
                 k_len: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """KV-cache indices (R, 2S) of the first S and last S positions of R queries at sequence positions ``pos``
    (>= 2S, so the windows are disjoint), and for window_align=32 the (R, 1, 1, 2S) mask of those <= pos."""
    offsets = torch.arange(window, device=pos.device)
    last_end = pos + 1 if window_align == 1 else (pos + window_align) // window_align * window_align
    logical = torch.cat([offsets.expand(len(pos), -1), (last_end - window)[:, None] + offsets], dim=1)
    index = (logical + pad[:, None]).clamp_max(k_len - 1)
    mask = None if window_align == 1 else (logical <= pos[:, None])[:, None, None, :]
    return index, mask


def sink_attention(q: torch.Tensor, key: torch.Tensor, value: torch.Tensor, rows: torch.Tensor,
                   index: torch.Tensor, mask: torch.Tensor | None, scaling: float) -> torch.Tensor:
    """A~ for R query rows (R, Hq, D): attention over their 2S window keys only, gathered from the
    (B, Hkv, L, D) cache: no O(L^2) buffer. Runs in the model dtype."""
    k = key[rows[:, None], :, index].transpose(1, 2)  # (R, Hkv, 2S, D)
    v = value[rows[:, None], :, index].transpose(1, 2)
    out = F.scaled_dot_product_attention(q[:, :, None, :], k, v, attn_mask=mask, scale=scaling,
                                         enable_gqa=k.shape[1] != q.shape[1])
    return out[:, :, 0, :]


def alspec_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
                     **kwargs) -> tuple[torch.Tensor, torch.Tensor | None]:
    """AttentionInterface entry: the model's own attention, then speculation inside the active region."""
    speculator: Speculator = getattr(module, ATTR)
    layer, region = module.layer_idx, speculator.region
    speculating = region is not None and speculator.config.policy != "exact" and layer not in speculator.skipped_layers
    scaling = query.shape[-1] ** -0.5 if scaling is None else scaling
    if speculating and query.shape[2] == 1 and speculator.decode_kernel is not None:
        exact, approx = speculator.decode_kernel(query, key, value, region.pad, speculator.config, scaling)
        return speculator.commit(layer, query, key, value, exact, scaling, approx), None
    out, weights = speculator.base_attention(module, query, key, value, attention_mask, scaling=scaling,
                                             dropout=dropout, **kwargs)
    if not speculating:
        return out, weights
    return speculator.commit(layer, query, key, value, out, scaling), weights


def _attention_modules(model: PreTrainedModel) -> dict[int, torch.nn.Module]:
    """Self-attention modules by layer index (the modules that call the attention interface)."""
    def has_layer_idx(module: torch.nn.Module) -> bool:
        return isinstance(getattr(module, "layer_idx", None), int)

    return {m.layer_idx: m for m in model.modules()
            if has_layer_idx(m) and not any(has_layer_idx(c) for c in m.modules() if c is not m)}


def _sliding_layers(model: PreTrainedModel, num_layers: int) -> dict[int, str]:
    """Sliding-window layers are not speculated (their window already bounds the cache)."""
    config = model.config.get_text_config()
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None:
        return {i: "sliding_window" for i, t in enumerate(layer_types) if t == "sliding_attention"}
    if getattr(config, "sliding_window", None) and getattr(config, "use_sliding_window", True):
        return dict.fromkeys(range(num_layers), "sliding_window")
    return {}


def _base_attention(model: PreTrainedModel, attention_module: torch.nn.Module) -> tuple[str, Callable]:
    name = model.config._attn_implementation or "sdpa"
    if name.startswith("alspec_"):
        name = name.removeprefix("alspec_")
    if name == "eager":  # eager attention is model-specific and lives in the modeling module
        return name, sys.modules[type(attention_module).__module__].eager_attention_forward
    if name not in ALL_ATTENTION_FUNCTIONS:
        raise ConfigError(f"attention implementation {name!r} cannot be wrapped; load the model with attn_implementation=sdpa or eager")
    return name, ALL_ATTENTION_FUNCTIONS[name]


def install(model: PreTrainedModel, config: SpeculationConfig,
            speculator_cls: Callable[..., Speculator] = Speculator) -> Speculator:
    """Route the model's attention through ``alspec_attention``; returns the speculator that controls it.

    ``speculator_cls`` lets another backend (tt) bring its own decode kernel and verification.
    """
    if not (model._supports_attention_backend and model._can_set_attn_implementation()):
        raise ConfigError(
            f"{type(model).__name__} does not dispatch attention through transformers' AttentionInterface, "
            "so speculation cannot be hooked; use a model that does (Llama, Qwen2/3, Mistral, Gemma, ...)"
        )
    modules = _attention_modules(model)
    num_layers = model.config.get_text_config().num_hidden_layers
    if sorted(modules) != list(range(num_layers)):
        raise ConfigError(f"found attention modules for layers {sorted(modules)} of {num_layers}; "
                          f"{type(model).__name__} cannot be hooked layer by layer")
    config.check_layers(num_layers)
    base_name, base_fn = _base_attention(model, modules[0])
    name = f"alspec_{base_name}"
    AttentionInterface.register(name, alspec_attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register(name, ALL_MASK_ATTENTION_FUNCTIONS[base_name])
    speculator = speculator_cls(config, num_layers, _sliding_layers(model, num_layers), base_fn,
                            flash_decode_kernel(config.kernel, model.device))
    for module in modules.values():
        setattr(module, ATTR, speculator)
    model.register_forward_pre_hook(speculator.new_forward)
    model.set_attn_implementation(name)
    return speculator
