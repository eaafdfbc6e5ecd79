"""A deliberately broken approximation for ``alspec-check-approx``: the last 2S keys shifted one ahead, so it reads
the next token's key wherever the cache already holds it (a teacher-forced pass) and repeats the newest key where it
does not (a decode step). The contract must fail it, one line per broken property."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from alspec_eval import Approximation


@dataclass(frozen=True)
class PeeksAhead(Approximation):
    description = "the last 2S keys, one position ahead (broken on purpose)"

    def keys_read(self, context: int, window: int) -> float:
        return 2 * window

    def select(self, query, key, rows, pos, pad, window, passed, prepared):
        index = pad[:, None] + pos[:, None] - 2 * window + 2 + torch.arange(2 * window)
        return index.clamp_max(key.shape[2] - 1)[:, None, :], None
