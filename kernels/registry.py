"""Kernel selection and the one signature every speculative flash decode kernel has."""

from __future__ import annotations

import os
from typing import Protocol

import torch

from .cpu_fast import applies as cpu_fast_applies
from .cpu_fast import speculative_decode_cpu
from .reference import SpecDecodeOutput, speculative_flash_decode
from .triton_decode import speculative_flash_decode_triton
from .unfused import unfused_decode


class DecodeKernel(Protocol):
    """A decode step's exact and speculative attention with d, n and the decision (see :mod:`.reference`).

    A kernel may also have ``prepare(cur_pos, window, window_align, start)``: what its calls in one decode pass
    share (window bounds, trivial rows), computed once and handed to each call as ``geometry=``.
    """

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cur_pos: torch.Tensor, window: int,
                 lam: float | torch.Tensor, chunk_size: int | None = None, window_align: int = 1,
                 scale: float | None = None, *, start: torch.Tensor | None = None) -> SpecDecodeOutput: ...


def torch_kernel(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cur_pos: torch.Tensor, window: int,
                 lam: float | torch.Tensor, chunk_size: int | None = None, window_align: int = 1,
                 scale: float | None = None, *, start: torch.Tensor | None = None) -> SpecDecodeOutput:
    """``kernel=torch``: the CPU fast path where it applies (one position, no left padding), else the reference."""
    fast = chunk_size is None and cpu_fast_applies(q, cur_pos, start)
    kernel = speculative_decode_cpu if fast else speculative_flash_decode
    return kernel(q, k, v, cur_pos, window, lam, chunk_size, window_align, scale, start=start)


def select_kernel(name: str, device: torch.device | str) -> DecodeKernel:
    """Kernel for ``torch|triton|unfused`` (the sim backend's ``kernel=auto`` chooses among them and ``model``).

    ``unfused`` (two separate SDPA calls) cross-checks the fused kernels; it is not the sim backend's
    ``kernel=model``, which is the model's own attention plus a gathered window.
    """
    device = torch.device(device)
    if name == "torch":
        return torch_kernel
    if name == "unfused":
        return unfused_decode
    if name == "triton":
        if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
            raise ValueError(f"kernel=triton runs on CUDA (or on CPU with TRITON_INTERPRET=1), not on {device}")
        return speculative_flash_decode_triton
    raise ValueError(f"unknown kernel {name!r}; use torch, triton or unfused")
