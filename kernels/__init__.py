"""Speculative flash decode kernels (installed as ``alspec_eval.kernels``).

All kernels share one signature, ``(q, k, v, cur_pos, window, lam, chunk_size=None,
window_align=1, scale=None, *, start=None) -> SpecDecodeOutput``; see :mod:`.reference`.
``start`` (B,) is the physical cache index of each sequence's first real token
(left padding); ``cur_pos`` stays physical and positions count from ``start``.

The names below load on first use (PEP 562): from the repository root the folder is also visible as a
top-level ``kernels`` (the name of a PyPI package that transformers probes for), and importing it there
must stay harmless. The kernels themselves import only as ``alspec_eval.kernels``.
"""

from __future__ import annotations

from importlib import import_module
from typing import Any

_EXPORTS = {"DecodeKernel": "registry", "select_kernel": "registry", "torch_kernel": "registry",
            "SpecDecodeOutput": "reference", "speculative_flash_decode": "reference"}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(import_module(f"{__name__}.{_EXPORTS[name]}"), name)
