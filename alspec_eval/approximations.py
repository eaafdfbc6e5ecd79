"""Which 2S keys A~ attends to when they depend on the query (model_args ``approx=``): Quest's pages or the
top-scoring keys. The paper's sink windows (``approx=sink``, the default) are fixed per position, so the speculator
computes them once per pass (semantics.window_positions) and the fused kernels and the TT op compute them too; the
selections here run per layer, on its cache, with the rules of :mod:`alspec_eval.semantics`.

A selection gives, for a layer's speculated positions, each KV head's key positions in the (B, Hkv, L, D) cache and
which are valid; the speculator gathers them and calls the model's own attention on them, as for the sink.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch

from . import semantics
from .config import SpeculationConfig


class KeySelection(Protocol):
    def prepare(self, key: torch.Tensor, pad: torch.Tensor) -> Any:
        """What the layer's selections share, computed once per layer and pass (None if nothing)."""

    def select(self, query: torch.Tensor, key: torch.Tensor, rows: torch.Tensor, pos: torch.Tensor, pad: torch.Tensor,
               shared: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Per speculated position (query (r, Hq, D) of batch row ``rows``, logical position ``pos``, left padding
        ``pad``): the physical key index (r, Hkv, 2S) and its valid mask (None when all are valid)."""

    def position_bytes(self, key: torch.Tensor, query_heads: int) -> int:
        """Bytes one speculated position's selection holds at its peak (for the speculator's chunks)."""


@dataclass(frozen=True)
class Quest:
    """Quest (Tang et al., ICML 2024): pages of ``page`` tokens, each bounded by its keys' element-wise min and max;
    page 0 and the current page always, the rest by bound up to 2S tokens (semantics.quest_positions)."""

    window: int
    page: int

    def prepare(self, key: torch.Tensor, pad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        batch, heads, length, dim = key.shape
        pages = length // self.page  # full pages of the longest row; a shorter row's later ones are never candidates
        phys = (pad[:, None] + torch.arange(pages * self.page, device=key.device)).clamp_max(length - 1)
        keys = key.gather(2, phys[:, None, :, None].expand(-1, heads, -1, dim)).view(batch, heads, pages, self.page, dim)
        return keys.amin(3), keys.amax(3)

    def select(self, query: torch.Tensor, key: torch.Tensor, rows: torch.Tensor, pos: torch.Tensor, pad: torch.Tensor,
               shared: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        page_min, page_max = shared
        bounds = semantics.page_bounds(query, page_min[rows], page_max[rows])
        positions, valid = semantics.quest_positions(bounds, pos, self.window, self.page)
        return (positions + pad[:, None, None]).clamp_max(key.shape[2] - 1), valid

    def position_bytes(self, key: torch.Tensor, query_heads: int) -> int:
        pages = key.shape[2] // self.page
        return pages * key.shape[1] * (2 * key.shape[3] * key.element_size() + 4 * query_heads // key.shape[1] + 16)


@dataclass(frozen=True)
class TopK:
    """The 2S keys with the largest exact scores per KV head: an oracle (it needs every score, as exact attention
    does), so a ceiling for any 2S-key subset chosen by score, not something to deploy."""

    window: int

    def prepare(self, key: torch.Tensor, pad: torch.Tensor) -> None:
        return None

    def select(self, query: torch.Tensor, key: torch.Tensor, rows: torch.Tensor, pos: torch.Tensor, pad: torch.Tensor,
               shared: None) -> tuple[torch.Tensor, None]:
        logical = torch.arange(key.shape[2], device=key.device) - pad[:, None]
        allowed = (logical >= 0) & (logical <= pos[:, None])  # the row's own keys up to the current token
        scores = semantics.key_scores(query, key[rows]).masked_fill(~allowed[:, None, :], -torch.inf)
        return semantics.topk_positions(scores, self.window), None

    def position_bytes(self, key: torch.Tensor, query_heads: int) -> int:
        # the row's gathered keys, its scores per query head and per KV head, and the sort's values and indices
        return key.shape[2] * (key.shape[1] * key.shape[3] * key.element_size() + 4 * query_heads + 16 * key.shape[1])


def key_selection(config: SpeculationConfig) -> KeySelection | None:
    """The config's selection; None for the sink windows, which the speculator computes once per pass."""
    if not config.selects_keys:
        return None
    return Quest(config.window, config.page) if config.approx == "quest" else TopK(config.window)
