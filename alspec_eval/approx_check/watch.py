"""The key rules checked on every selection an approximation makes while the contract runs: never a key past the
current position, never a padding key, at most the keys it declares (2S), none twice, indices inside the cache."""

from __future__ import annotations

from typing import Any

import torch

from ..approximations import Approximation, Selected, selection


def watched(approx: Approximation, broken: list[str], seen: list | None = None) -> Approximation:
    """The same approximation (its class subclassed, its parameters kept) whose selections are checked; what a
    selection breaks is appended to ``broken`` once per rule, and each selection (index, valid, log_weight) to
    ``seen`` where given."""
    base = type(approx)

    def select(self: Approximation, query: torch.Tensor, key: torch.Tensor, rows: torch.Tensor, pos: torch.Tensor,
               pad: torch.Tensor, window: int, passed: tuple, prepared: Any) -> Selected:
        selected = base.select(self, query, key, rows, pos, pad, window, passed, prepared)
        index, valid, log_weight = selection(self, selected)
        if seen is not None:
            seen.append((index, valid, log_weight))
        for rule in key_rules(index, valid, key, rows, pos, pad, self.max_keys(window)):
            if rule not in broken:
                broken.append(rule)
        return selected

    cls = type(base.__name__, (base,), {"select": select, "__module__": base.__module__,
                                        "__qualname__": base.__qualname__})
    return cls(**approx.args())


def key_rules(index: torch.Tensor, valid: torch.Tensor | None, key: torch.Tensor, rows: torch.Tensor,
              pos: torch.Tensor, pad: torch.Tensor, most: int | None) -> list[str]:
    """Which rules one selection breaks (empty: none); ``most``: the keys a position may count per KV head (the
    draft's ``max_keys``; None: its context)."""
    heads = key.shape[1]
    if index.dim() != 3 or index.shape[0] != len(rows) or index.shape[1] not in (1, heads):
        return [f"selection shape {tuple(index.shape)}: select must return (positions {len(rows)}, KV heads {heads} "
                "or 1, keys)"]
    keep = torch.ones_like(index, dtype=torch.bool) if valid is None else valid.expand_as(index)
    broken = []
    if most is not None and index.shape[2] > most and bool((keep.sum(-1) > most).any()):
        broken.append(f"more than max_keys = {most} keys: up to {int(keep.sum(-1).max())} per KV head")
    if bool(((index < 0) | (index >= key.shape[2]))[keep].any()):
        broken.append("a key index outside the cache (negative, or past its last key)")
    logical = index - pad[:, None, None]
    if bool((logical > pos[:, None, None])[keep].any()):
        broken.append("a future key: a position past the current token")
    if bool((logical < 0)[keep].any()):
        broken.append("a padding key: a position before the row's first real token")
    ordered = torch.where(keep, index, -1 - torch.arange(index.shape[2], device=index.device)).sort(-1).values
    if bool((ordered[..., 1:] == ordered[..., :-1]).any()):
        broken.append("a key selected twice for one KV head")
    return broken
