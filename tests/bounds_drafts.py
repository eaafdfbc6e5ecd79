"""Drafts that break the bound of the contract (every key in [0, pos]), importable by a vLLM worker as
``approx=bounds_drafts:Class`` (tests/ is on the path): four drafts that break the contract, each as a user wrote it."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from alspec_eval import Approximation
from alspec_eval.approximations.local import Local

BEFORE = 100_000  # how far before the context BeforeContext's ranges lie
PAST = 4_096  # how far past the query PastQuery's ranges run
AHEAD = 8  # how far past the query PeeksEight's keys end


@dataclass(frozen=True)
class BeforeContext(Local):
    """position_ranges 100,000 positions before the context (its select is Local's, within bounds)."""

    def position_ranges(self, pos, window, window_align):
        return (pos - 2 * window + 1 - BEFORE)[:, None], (pos + 1 - BEFORE)[:, None], (2 * window,)


@dataclass(frozen=True)
class PastQuery(Local):
    """position_ranges that run 4,096 positions past the query."""

    def position_ranges(self, pos, window, window_align):
        return (pos - 2 * window + 1)[:, None], (pos + 1 + PAST)[:, None], (2 * window + PAST,)


@dataclass(frozen=True)
class PeeksEight(Local):
    """per_pass selects the 2S keys ending 8 positions past the query: in teacher-forced scoring the cache holds
    them, and the draft would read the continuation it scores."""

    def per_pass(self, pos, pad, key_len, window, window_align):
        return (pad[:, None] + pos[:, None] - 2 * window + 1 + AHEAD + torch.arange(2 * window, device=pos.device),)


@dataclass(frozen=True)
class OneMore(Approximation):
    """2S + 1 keys: four sinks, the last 2S - 4 keys and one from the middle (more than the budget, inside [0, pos])."""

    def keys_read(self, context, window):
        return 2 * window + 1

    def select(self, query, key, rows, pos, pad, window, passed, prepared):
        first = torch.arange(4, device=pos.device).expand(len(pos), -1)
        recent = pos[:, None] - 2 * window + 5 + torch.arange(2 * window - 4, device=pos.device)
        middle = (recent[:, :1] + 4) // 2  # between the sinks and the recent keys (pos >= 2S where it speculates)
        return (torch.cat([first, middle, recent], 1) + pad[:, None])[:, None, :], None
