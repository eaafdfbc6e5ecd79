"""backend=sim: the simulated reference, on the CPU or CUDA (docs/design.md, Semantics 1-5).

The model's attention runs through the speculator (:mod:`.speculator`; :mod:`.hooks` puts it into the model). ``kernel`` picks how
a decode step computes A and A~: ``model``, no fused kernel: the model's own attention function (sdpa or
eager, with every term of its family) for A and, on the gathered 2S window keys, for A~ (A bit-identical to
the plain model); ``torch`` or ``triton``, the speculative flash decode, A~ being the first partial of A.
``auto`` is ``triton`` on CUDA where the attention is plain softmax, else ``model``.
"""

from __future__ import annotations

import importlib.util
from typing import Any

import torch
from transformers import PreTrainedModel

from ... import hooks
from ...compat import config_dtype
from ...config import ConfigError
from ...kernels import select_kernel
from ...speculator import Speculator
from .. import Backend


def attention_shape(config: Any) -> tuple[int, int]:
    """(head_dim, query heads per KV head) of a model's config, as the fused kernels see its attention."""
    text = config.get_text_config()
    heads = text.num_attention_heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    return head_dim, heads // (getattr(text, "num_key_value_heads", None) or heads)


def triton_misfit(device: torch.device, dtype: torch.dtype, config: Any) -> str | None:
    """Why kernel=triton cannot run this model on the CUDA ``device``: its binaries compiled for the device's
    architecture, against its limits (kernels/triton_launch.py); None where they fit."""
    from ...kernels import triton_launch

    head_dim, group = attention_shape(config)
    arch = triton_launch.arch_of(device)
    reason = triton_launch.misfit(dtype, group, head_dim, arch)  # scalar and per-row lambda share one binary
    return f"{reason} ({dtype}, head_dim {head_dim}, {group} query heads per KV head)" if reason else None


def choose_kernel(name: str, device: torch.device, plain_softmax: bool, dtype: torch.dtype,
                  config: Any) -> tuple[str, str]:
    """The kernel that runs for ``kernel=name`` (see the module docstring), and one line saying why, for the
    results."""
    if name != "auto":
        return name, f"{name}: as asked"
    if device.type != "cuda":
        return "model", f"model: kernel=auto runs triton on CUDA only, not on {device.type}"
    if importlib.util.find_spec("triton") is None:
        return "model", "model: kernel=auto found no triton (pip install triton)"
    if not plain_softmax:
        return "model", "model: kernel=auto runs triton for plain softmax attention only"
    reason = triton_misfit(device, dtype, config)
    if reason:
        return "model", f"model: kernel=auto found that {reason}"
    from ...kernels.triton_launch import arch_of

    return "triton", f"triton: kernel=auto, and it fits sm_{arch_of(device).capability}"


def install(model: PreTrainedModel, kernel: str = "auto") -> tuple[Speculator, str]:
    """Hook the model's attention with decode steps on ``kernel``; returns the speculator that controls it
    (``hooks.remove`` undoes it) and the line saying which kernel runs and why."""
    if kernel in ("torch", "triton"):
        hooks.check_fused_kernel(f"kernel={kernel}", model.config, model)
    plain = not hooks.formula_terms(model.config, model)
    name, why = choose_kernel(kernel, model.device, plain, model.dtype, model.config)
    fused = None if name == "model" else select_kernel(name, model.device)
    return hooks.install(model, decode_kernel=fused), why


class SimBackend(Backend):
    """backend=sim: nothing to check before loading but the fused kernels' formula, device and fit."""

    def check_model(self, model_config: Any, batch_size: int | None, device: torch.device | None = None,
                    dtype: torch.dtype | None = None) -> None:
        kernel = self.config.kernel
        if kernel not in ("torch", "triton"):
            return
        hooks.check_fused_kernel(f"kernel={kernel}", model_config)
        if kernel == "triton" and device is not None:
            select_kernel(kernel, device)  # CUDA, or the interpreter
            reason = device.type == "cuda" and triton_misfit(device, dtype or config_dtype(model_config), model_config)
            if reason:
                raise ConfigError(f"kernel=triton cannot run here: {reason}; use kernel=auto (which then runs "
                                  "kernel=model) or kernel=model")

    def install(self, model: PreTrainedModel) -> Speculator:
        speculator, self.kernel_line = install(model, self.config.kernel)
        return speculator
