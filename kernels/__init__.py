"""Speculative flash decode kernels (installed as ``alspec_eval.kernels``).

All kernels share one signature, ``(q, k, v, cur_pos, window, lam, chunk_size=None,
window_align=1, scale=None, *, start=None) -> SpecDecodeOutput``; see :mod:`.reference`.
``start`` (B,) is the physical cache index of each sequence's first real token
(left padding); ``cur_pos`` stays physical and positions count from ``start``.
"""

from __future__ import annotations

import importlib.util
import os
from typing import Callable

import torch

from .reference import SpecDecodeOutput, speculative_flash_decode
from .sdpa import sdpa_decode
from .triton_decode import speculative_flash_decode_triton

DecodeKernel = Callable[..., SpecDecodeOutput]

__all__ = ["DecodeKernel", "SpecDecodeOutput", "select_kernel", "speculative_flash_decode"]


def select_kernel(name: str, device: torch.device | str) -> DecodeKernel:
    """Kernel for ``kernel=auto|torch|triton|sdpa``; auto is Triton on CUDA when installed, else torch."""
    device = torch.device(device)
    has_triton = importlib.util.find_spec("triton") is not None
    if name == "auto":
        name = "triton" if device.type == "cuda" and has_triton else "torch"
    if name == "torch":
        return speculative_flash_decode
    if name == "sdpa":
        return sdpa_decode
    if name == "triton":
        if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
            raise ValueError(f"kernel=triton runs on CUDA (or on CPU with TRITON_INTERPRET=1), not on {device}")
        return speculative_flash_decode_triton
    raise ValueError(f"unknown kernel {name!r}; use auto, torch, triton or sdpa")
