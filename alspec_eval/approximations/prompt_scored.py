"""What every approximation that scores the prompt once, at prefill, shares (snapkv; kvpress's prompt-time presses):
at each decode step the newest ``recent`` tokens plus the 2S - recent prompt keys of highest score, its budget check,
its cost and its memory. A subclass declares ``recent`` among its own fields and scores the prompt
(``observe_prompt``, ``prepare``)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..errors import ConfigError
from .base import Approximation, Selected, scores_bytes


@dataclass(frozen=True)
class PromptScored(Approximation):
    prompt_keys = True

    def check(self, window: int) -> None:
        if not 1 <= self.recent < 2 * window:
            raise ConfigError(f"approx_args recent:{self.recent} leaves no prompt key in the budget 2S = {2 * window}; "
                              f"use 1 <= recent < {2 * window}, e.g. recent:{min(8, 2 * window - 1)}")
        super().check(window)

    def keys_read(self, context: int, window: int) -> float:
        return min(2 * window, context)  # the prompt is scored once, at prefill: no cost per decode step

    def select(self, query: torch.Tensor, key: torch.Tensor, rows: torch.Tensor, pos: torch.Tensor,
               pad: torch.Tensor, window: int, passed: tuple, prepared: torch.Tensor) -> Selected:
        return newest_and_top(prepared, key, rows, pos, pad, window, self.recent)

    def position_bytes(self, key: torch.Tensor, query_heads: int) -> int:
        return scores_bytes(key)


def newest_and_top(scores: torch.Tensor, key: torch.Tensor, rows: torch.Tensor, pos: torch.Tensor, pad: torch.Tensor,
                   window: int, recent: int) -> Selected:
    """SnapKV's rule for every prompt-time scorer (kvpress's too): at each position the newest ``recent`` tokens,
    then the 2S - recent prompt keys of highest ``scores`` (B, Hkv, L_prompt; physical, -inf where none) older than
    them, ties to the earlier key."""
    newest = pad[:, None] + pos[:, None] - recent + 1 + torch.arange(recent, device=pos.device)
    scores = scores[rows]
    t = torch.arange(scores.shape[-1], device=pos.device)
    older = t[None, :] < (newest[:, :1])  # a prompt key among the newest R is kept as one of them
    ranked = scores.masked_fill(~older[:, None, :], -math.inf)
    budget = 2 * window - recent
    if ranked.shape[-1] < budget:  # fewer prompt keys than the budget: the rest never count
        ranked = F.pad(ranked, (0, budget - ranked.shape[-1]), value=-math.inf)
    top = ranked.sort(dim=-1, descending=True, stable=True)
    chosen, valid = top.indices[..., :budget], top.values[..., :budget] > -math.inf
    heads = scores.shape[1]
    index = torch.cat([newest[:, None, :].expand(-1, heads, -1), chosen], -1).clamp_max(key.shape[2] - 1)
    return index, torch.cat([torch.ones_like(newest, dtype=torch.bool)[:, None, :].expand(-1, heads, -1), valid], -1)
