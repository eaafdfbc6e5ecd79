"""A pytest plugin that breaks one rule of ``alspec_eval.semantics`` before anything imports it
(``-p semantics_mutations`` with ALSPEC_MUTATION set): the tests that guard the rule must then fail."""

from __future__ import annotations

import os

import torch

from alspec_eval import semantics

_original = {name: getattr(semantics, name) for name in ("last_window_end", "is_trivial", "accept")}


def _window_off_by_one(pos: torch.Tensor, window_align: int) -> torch.Tensor:
    return _original["last_window_end"](pos, window_align) + 1


def _trivial_bound(pos: torch.Tensor, window: int) -> torch.Tensor:
    return pos + 1 <= 2 * window + 1


def _lambda_not_squared(d: torch.Tensor, n: torch.Tensor, lam: float | torch.Tensor) -> torch.Tensor:
    lam = torch.as_tensor(lam, dtype=torch.float32, device=d.device)
    return (d * d <= lam * n * n) | torch.isinf(lam)


MUTATIONS = {"window": ("last_window_end", _window_off_by_one), "trivial": ("is_trivial", _trivial_bound),
             "accept": ("accept", _lambda_not_squared)}

if os.environ.get("ALSPEC_MUTATION"):
    name, mutant = MUTATIONS[os.environ["ALSPEC_MUTATION"]]
    setattr(semantics, name, mutant)
