"""backend=sim: the simulated reference, on the CPU or CUDA (DESIGN.md, Semantics 1-5).

The model's attention runs through the speculator (:mod:`alspec_eval.speculator`). ``kernel`` picks how
a decode step computes A and A~: ``sdpa``, the model's own attention for A plus a gathered 2S-key
attention for A~ (A bit-identical to the plain model); ``torch`` or ``triton``, the speculative flash
decode, A~ being the first partial of A. ``auto`` is Triton on CUDA and ``sdpa`` on the CPU.
"""

from __future__ import annotations

import importlib.util

import torch
from transformers import PreTrainedModel

from .. import hooks
from ..kernels import DecodeKernel, select_kernel
from ..speculator import Speculator


def decode_kernel(name: str, device: torch.device, plain_softmax: bool = True) -> DecodeKernel | None:
    """The fused kernel of ``kernel=name`` on ``device``, or None for ``sdpa`` (see the module docstring); ``auto``
    is ``sdpa`` too where the model's attention is not plain softmax (soft-capping, sinks)."""
    if name == "auto":
        fused = device.type == "cuda" and importlib.util.find_spec("triton") and plain_softmax
        name = "triton" if fused else "sdpa"
    return None if name == "sdpa" else select_kernel(name, device)


def install(model: PreTrainedModel, kernel: str = "auto") -> Speculator:
    """Hook the model's attention with decode steps on ``kernel``; returns the speculator that controls it
    (``hooks.remove`` undoes it)."""
    if kernel in ("torch", "triton"):
        hooks.check_fused_kernel(f"kernel={kernel}", model.config, model)
    plain = not hooks.formula_terms(model.config, model)
    return hooks.install(model, decode_kernel=decode_kernel(kernel, model.device, plain))
