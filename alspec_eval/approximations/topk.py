"""The 2S keys with the largest exact scores per KV head: an oracle (it needs every score, as exact attention
does), so a ceiling for any 2S keys chosen by score, not something to deploy."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .. import semantics
from .base import Approximation, Selected


@dataclass(frozen=True)
class TopK(Approximation):
    description = "the 2S keys with the largest exact scores"
    marker, colour = "P", "tab:purple"
    oracle = True
    ranks_by_scores = True

    def keys_read(self, context: int, window: int) -> float:
        return context  # every key's score: it starts no earlier than A

    def select(self, query: torch.Tensor, key: torch.Tensor, rows: torch.Tensor, pos: torch.Tensor,
               pad: torch.Tensor, window: int, passed: tuple, prepared: None) -> Selected:
        return self.select_scored(semantics.key_scores(query, semantics.rows_of(key, rows)), rows, pos, pad, window,
                                  passed, prepared)

    def select_scored(self, scores: torch.Tensor, rows: torch.Tensor, pos: torch.Tensor, pad: torch.Tensor,
                      window: int, passed: tuple, prepared: None) -> Selected:
        logical = torch.arange(scores.shape[-1], device=scores.device) - pad[:, None]
        allowed = (logical >= 0) & (logical <= pos[:, None])  # the row's own keys up to the current token
        return semantics.topk_positions(scores.masked_fill(~allowed[:, None, :], -torch.inf), window), None

    def position_bytes(self, key: torch.Tensor, query_heads: int) -> int:
        # the row's gathered keys, its scores per query head and per KV head, and the sort's values and indices
        return key.shape[2] * (key.shape[1] * key.shape[3] * key.element_size() + 4 * query_heads + 16 * key.shape[1])
