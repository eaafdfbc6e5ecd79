"""A user's own draft, importable by a vLLM worker as ``approx=user_draft:HighestSums`` (tests/ is on the path):
per KV head the 2S keys whose elements sum highest up to the current position, the sums computed once per layer in
``prepare`` (not the norm: RoPE keeps a repeated token's norm, and ties would go by rounding).
It is written to the contract alone (docs/design.md, "Approximations"), with no code for either engine."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from alspec_eval import Approximation


@dataclass(frozen=True)
class HighestSums(Approximation):
    description = "the 2S keys whose elements sum highest"

    def keys_read(self, context: int, window: int) -> float:
        return context

    def prepare(self, key, pad, window, observed=None):
        return key.float().sum(-1)  # (B, Hkv, L)

    def select(self, query, key, rows, pos, pad, window, passed, prepared):
        logical = torch.arange(key.shape[2], device=key.device) - pad[:, None]
        seen = (logical >= 0) & (logical <= pos[:, None])
        sums = prepared[rows].masked_fill(~seen[:, None, :], -torch.inf)
        return sums.sort(dim=-1, descending=True, stable=True).indices[..., :2 * window], None
