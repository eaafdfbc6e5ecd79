"""Quest (Tang et al., ICML 2024): pages of ``page`` tokens, each bounded by its keys' element-wise minimum and
maximum; page 0 and the current page always, the rest by bound up to 2S tokens (semantics.quest_positions). The
bounds merge (the minimum of minima), so a paged cache keeps them per block as keys are written (``kept_page``)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .. import semantics
from ..errors import ConfigError
from .base import Approximation, Selected


@dataclass(frozen=True)
class Quest(Approximation):
    page: int = field(default=16, metadata={"short": "p", "label": "P"})  # tokens per page, as in Quest

    description = "Quest's query-aware pages of {page} tokens"
    marker, colour = "v", "tab:green"

    def check(self, window: int) -> None:
        if self.page < 1:
            raise ConfigError(f"approx_args page:{self.page} is invalid; use an integer >= 1 (tokens per Quest "
                              "page), e.g. page:16")
        if self.page > window or (2 * window) % self.page:
            fits = [p for p in (1, 2, 4, 8, 16, 32, 64) if p <= window and (2 * window) % p == 0]
            raise ConfigError(f"approx_args page:{self.page} does not divide the key budget 2S={2 * window} into "
                              f"pages of which two or more fit (page <= window={window}); use e.g. page:{fits[-1]}")

    def keys_read(self, context: int, window: int) -> float:
        # every page's minimum and maximum (2 (L / P) D elements: L / P keys' worth), then its 2S keys
        return min(2 * window + context / self.page, context)

    def prepare(self, key: torch.Tensor, pad: torch.Tensor, window: int,
                observed: None = None) -> tuple[torch.Tensor, torch.Tensor]:
        batch, heads, length, dim = key.shape
        pages = length // self.page  # full pages of the longest row; a shorter row's later ones are never candidates
        phys = (pad[:, None] + torch.arange(pages * self.page, device=key.device)).clamp_max(length - 1)
        # whole keys by row and position (a copy of D elements at a time, not a gather element by element)
        keys = key.transpose(1, 2)[torch.arange(batch, device=key.device)[:, None], phys]  # (B, pages P, Hkv, D)
        keys = keys.view(batch, pages, self.page, heads, dim)
        return keys.amin(2).transpose(1, 2), keys.amax(2).transpose(1, 2)

    def kept_page(self) -> int:
        return self.page

    def summarize(self, keys: torch.Tensor, values: None = None) -> torch.Tensor:
        return torch.cat([keys.amin(-3), keys.amax(-3)], -1)

    def merge(self, parts: torch.Tensor) -> torch.Tensor:
        dim = parts.shape[-1] // 2
        return torch.cat([parts[..., :dim].amin(-3), parts[..., dim:].amax(-3)], -1)

    def prepare_pages(self, pages: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        dim = pages.shape[-1] // 2
        return pages[..., :dim], pages[..., dim:]

    def select(self, query: torch.Tensor, key: torch.Tensor, rows: torch.Tensor, pos: torch.Tensor,
               pad: torch.Tensor, window: int, passed: tuple, prepared: tuple[torch.Tensor, torch.Tensor]) -> Selected:
        page_min, page_max = prepared
        bounds = semantics.page_bounds(query, semantics.rows_of(page_min, rows), semantics.rows_of(page_max, rows))
        positions, valid = semantics.quest_positions(bounds, pos, window, self.page)
        return (positions + pad[:, None, None]).clamp_max(key.shape[2] - 1), valid

    def select_kept(self, query: torch.Tensor, kept: torch.Tensor, block_table: torch.Tensor, block_size: int,
                    request: torch.Tensor, pos: torch.Tensor, window: int, length: int) -> Selected | None:
        from ..vllm.native import quest_pages  # the CPU kernel: bounds and choice in one call, to float32 rounding

        return quest_pages(query, kept, block_table, block_size, request, pos, self.page, window, length)

    def position_bytes(self, key: torch.Tensor, query_heads: int) -> int:
        pages = key.shape[2] // self.page
        return pages * key.shape[1] * (2 * key.shape[3] * key.element_size() + 4 * query_heads // key.shape[1] + 16)
