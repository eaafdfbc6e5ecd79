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
from ...kernels import DecodeKernel, select_kernel
from ...speculator import Speculator
from .. import Backend


def decode_kernel(name: str, device: torch.device, plain_softmax: bool = True) -> DecodeKernel | None:
    """The fused kernel of ``kernel=name`` on ``device``, or None for ``model`` (see the module docstring)."""
    if name == "auto":
        fused = device.type == "cuda" and importlib.util.find_spec("triton") and plain_softmax
        name = "triton" if fused else "model"
    return None if name == "model" else select_kernel(name, device)


def install(model: PreTrainedModel, kernel: str = "auto") -> Speculator:
    """Hook the model's attention with decode steps on ``kernel``; returns the speculator that controls it
    (``hooks.remove`` undoes it)."""
    if kernel in ("torch", "triton"):
        hooks.check_fused_kernel(f"kernel={kernel}", model.config, model)
    plain = not hooks.formula_terms(model.config, model)
    return hooks.install(model, decode_kernel=decode_kernel(kernel, model.device, plain))


class SimBackend(Backend):
    """backend=sim: nothing to check before loading but the fused kernels' formula."""

    def check_model(self, model_config: Any, batch_size: int | None) -> None:
        if self.config.kernel in ("torch", "triton"):
            hooks.check_fused_kernel(f"kernel={self.config.kernel}", model_config)

    def install(self, model: PreTrainedModel) -> Speculator:
        return install(model, self.config.kernel)
