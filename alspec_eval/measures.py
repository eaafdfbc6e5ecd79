"""What a decision measures beside its code and d/n, as the draft's declarations ask: the keys its A~ read where its
budget varies (``max_keys`` None: the densities), and, where it promises its softmax denominator's error
(``promise().denominator``), the share of its query heads whose denominator the selection misses by more than
epsilon of it. One rule for both engines: the HF engine and vLLM's selected-keys path call :func:`measure` on what
the draft selected."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from . import semantics
from .stats import DENOMINATOR, KEYS_READ


@dataclass(frozen=True)
class Selection:
    """A chunk of positions' selections as an engine holds them: their queries (r, Hq, D), the cache they select
    from (B, Hkv, L, D) and each position's row of it (``rows`` (r,)), the first and last key each may read (``low``,
    ``high``: r elements each, any shape), and what ``select`` returned (indices into L, which count, log-weights).
    Nothing is computed from it but what a draft's declarations ask for (a decode step launches no op for others)."""

    query: torch.Tensor
    cache: torch.Tensor
    rows: torch.Tensor
    low: torch.Tensor
    high: torch.Tensor
    index: torch.Tensor
    valid: torch.Tensor | None
    log_weight: torch.Tensor | None


def measures_keys(approx: Any) -> bool:
    """Whether a measure the draft declares reads the keys (the denominator's): an engine then hands
    :func:`measure` the keys themselves."""
    promise = approx.promise()
    return promise is not None and promise.denominator


def measure(approx: Any, window: int, taken: Selection, scale: float,
            softcap: float | None = None) -> dict[str, torch.Tensor]:
    """The measures ``approx`` declares, (r,) float32 each by name (:data:`.stats.KEYS_READ`,
    :data:`.stats.DENOMINATOR`); none for a draft of a fixed budget that promises nothing. ``scale`` and
    ``softcap``: the model's terms, at which the denominator is measured."""
    out = {}
    if approx.max_keys(window) is None:
        out[KEYS_READ] = semantics.keys_read(taken.index, taken.valid)
    if measures_keys(approx):
        promise = approx.promise()
        keys = semantics.rows_of(taken.cache, taken.rows)
        span = torch.arange(keys.shape[2], device=keys.device)
        allowed = (span >= taken.low.reshape(-1, 1)) & (span <= taken.high.reshape(-1, 1))  # (r, L)
        index = taken.index.clamp(0, keys.shape[2] - 1)  # a key outside [0, pos] is refused after the call
        out[DENOMINATOR] = semantics.denominator_exceeded(taken.query, keys, allowed, index, taken.valid,
                                                          taken.log_weight, scale, promise.epsilon, softcap)
    return out
