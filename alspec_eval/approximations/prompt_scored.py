"""What every approximation that scores the prompt once, at prefill, shares (snapkv; kvpress's prompt-time presses):
at each decode step the newest ``recent`` tokens plus the 2S - recent prompt keys of highest score, its budget check,
its cost and its memory. A subclass declares ``recent`` among its own fields and scores the prompt
(``observe_prompt``, ``prepare``)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .. import semantics
from ..errors import ConfigError
from .base import Approximation, Selected, scores_bytes


@dataclass(frozen=True)
class PromptScored(Approximation):
    prompt_keys = True
    reads_keys = False  # the decode step's keys come from the prompt's scores and the position
    stacks_prepared = True

    def check(self, window: int) -> None:
        if not 1 <= self.recent < 2 * window:
            raise ConfigError(f"approx_args recent:{self.recent} leaves no prompt key in the budget 2S = {2 * window}; "
                              f"use 1 <= recent < {2 * window}, e.g. recent:{min(8, 2 * window - 1)}")
        super().check(window)

    def keys_read(self, context: int, window: int) -> float:
        return min(2 * window, context)  # the prompt is scored once, at prefill: no cost per decode step

    def select(self, query: torch.Tensor, key: torch.Tensor, rows: torch.Tensor, pos: torch.Tensor,
               pad: torch.Tensor, window: int, passed: tuple, prepared: PromptRanking) -> Selected:
        return newest_and_top(prepared, key, rows, pos, pad, window, self.recent)

    def position_bytes(self, key: torch.Tensor, query_heads: int) -> int:
        return scores_bytes(key)

    def kept_observation(self, observed: PromptRanking, window: int) -> PromptRanking:
        """What an engine keeps of a prompt's observation: the ranking's first 2S entries, all a step reads
        (:func:`newest_and_top`), apart from the rest (a prompt of L keys ranks L per KV head and layer)."""
        return PromptRanking(observed.order[..., :2 * window].clone())

    def stack_prepared(self, prepared: list[PromptRanking], window: int) -> PromptRanking:
        """The rankings' first 2S entries, which hold every key a step keeps (:func:`newest_and_top`), a row each,
        a shorter one filled with unscored marks."""
        def first(order: torch.Tensor) -> torch.Tensor:
            if order.shape[-1] == 2 * window:  # as kept (kept_observation): no op a row
                return order
            order = order[..., :2 * window]
            return torch.nn.functional.pad(order, (0, 2 * window - order.shape[-1]), value=UNSCORED)

        return PromptRanking(torch.cat([first(r.order) for r in prepared]))


@dataclass(frozen=True)
class PromptRanking:
    """A prompt's key scores ranked once, when the prompt is scored: per row and KV head the key indices best first
    (ties: the earlier key), (B, Hkv, L_prompt) int32, unscored keys (-inf: past the prompt, padding) marked past any
    position (:data:`UNSCORED`), so that a decode step keeps its keys without a sort (:func:`newest_and_top`). As
    much memory as the scores it replaces."""

    order: torch.Tensor

    @classmethod
    def of(cls, scores: torch.Tensor) -> "PromptRanking":
        """``scores`` (B, Hkv, L_prompt; physical, -inf or NaN where no key) ranked."""
        scored = scores > -math.inf  # NaN is not
        order = torch.where(scored, scores, -math.inf).sort(dim=-1, descending=True, stable=True).indices
        return cls(torch.where(scored.gather(-1, order), order, UNSCORED).to(torch.int32))


UNSCORED = 2**31 - 1  # the order's mark of an unscored key: no position is older than it


def newest_and_top(ranking: PromptRanking, key: torch.Tensor, rows: torch.Tensor, pos: torch.Tensor,
                   pad: torch.Tensor, window: int, recent: int) -> Selected:
    """SnapKV's rule for every prompt-time scorer (kvpress's too): at each position the newest ``recent`` tokens,
    then the 2S - recent prompt keys of highest score older than them (a prompt key among the newest is kept as one
    of them), ties to the earlier key: the first 2S - recent of the prompt's ranking that are older and scored."""
    newest = (pad + pos + (1 - recent))[:, None] + torch.arange(recent, device=pos.device)
    budget = 2 * window - recent
    # at most ``recent`` prompt keys are among the newest, and unscored keys rank last: the first 2S of the ranking
    # hold every key a position keeps, so a step reads 2S of them per KV head, not the prompt's L
    order = semantics.rows_of(ranking.order[..., :2 * window], rows).long()  # (r, Hkv, <= 2S)
    kept = order < newest[:, :1, None]  # older, and scored
    rank = kept.cumsum(-1)  # from 1
    slot = (rank * kept).clamp_(max=budget + 1)  # 1..budget: the first budget kept; 0 and budget + 1: none
    chosen = torch.zeros(*order.shape[:2], budget + 2, dtype=order.dtype, device=order.device)
    chosen = chosen.scatter(-1, slot, order)[..., 1:budget + 1]  # invalid slots stay 0
    valid = torch.arange(1, budget + 1, device=pos.device) <= rank[..., -1:]
    heads = order.shape[1]
    index = torch.cat([newest[:, None, :].expand(-1, heads, -1), chosen], -1).clamp_max(key.shape[2] - 1)
    return index, torch.cat([torch.ones_like(newest, dtype=torch.bool)[:, None, :].expand(-1, heads, -1), valid], -1)
