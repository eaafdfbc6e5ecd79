"""SnapKV (Li et al., 2024), the prompt-time family of kvpress: the prompt's keys scored once after prefill by the
attention of its last ``observe`` queries (summed over them and a KV head's query heads, average-pooled over
``pool`` neighbouring keys), the observation window itself always preferred; at each decode step the newest
``recent`` tokens plus the top 2S - recent prompt keys per KV head."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from ..errors import ConfigError
from .prompt_scored import PromptRanking, PromptScored


@dataclass(frozen=True)
class SnapKV(PromptScored):
    observe: int = field(default=32, metadata={"short": "w", "label": "W"})  # the prompt's last queries that score
    pool: int = field(default=5, metadata={"short": "k", "label": "k"})  # average-pooling kernel (odd)
    recent: int = field(default=8, metadata={"short": "r", "label": "R"})  # newest tokens always kept

    description = "the newest {recent} tokens and the prompt keys its last {observe} queries attend to most"
    marker, colour = "D", "tab:olive"

    def check(self, window: int) -> None:
        if self.observe < 1:
            raise ConfigError(f"approx_args observe:{self.observe} is invalid; use an integer >= 1 (the prompt's last "
                              "queries that score its keys), e.g. observe:32")
        if self.pool < 1 or self.pool % 2 == 0:
            raise ConfigError(f"approx_args pool:{self.pool} is invalid; use an odd integer >= 1 (the pooling kernel "
                              "over neighbouring keys), e.g. pool:5")
        super().check(window)

    def prompt_window(self) -> int:
        return self.observe

    def prepare(self, key: torch.Tensor, pad: torch.Tensor, window: int, observed: PromptRanking | None = None
                ) -> PromptRanking:
        if observed is None:
            raise RuntimeError("snapkv scored no prompt: no forward pass of this call held the prompts' last "
                               f"{self.observe} positions (a prompt prefilled outside the call)")
        return observed

    def observe_prompt(self, query: torch.Tensor, key: torch.Tensor, scaling: float, start: torch.Tensor,
                       pad: torch.Tensor, offset: int) -> PromptRanking:
        """Each prompt key's score (B, Hkv, L), ranked: -inf past the prompt and on padding, +inf in the observation
        window. ``query`` (B, Hq, q_len, D) holds physical positions from ``offset``; ``start`` (B,): where each
        row's prompt ends (its first speculated position, physical)."""
        batch, heads, _, dim = query.shape
        kv_heads, length = key.shape[1], key.shape[2]
        prompt = start - pad  # logical prompt length
        window = prompt.clamp(max=self.observe)  # w = min(observe, P)
        slot = torch.arange(self.observe, device=query.device)
        q_phys = start[:, None] - self.observe + slot  # (B, observe): the last ``observe`` positions; the first
        real = slot >= (self.observe - window)[:, None]  # observe - w of them fall before the prompt
        q = query.gather(2, (q_phys - offset).clamp(0, query.shape[2] - 1)[:, None, :, None].expand(-1, heads, -1, dim))
        k = key.float().repeat_interleave(heads // kv_heads, 1)
        logits = (q.float() @ k.transpose(-1, -2)) * scaling  # (B, Hq, observe, L)
        t = torch.arange(length, device=key.device)
        seen = (t[None, None, :] <= q_phys[:, :, None]) & (t[None, None, :] >= pad[:, None, None])
        weights = logits.masked_fill(~seen[:, None], -math.inf).softmax(-1)
        weights = weights.masked_fill(~real[:, None, :, None], 0.0).nan_to_num(0.0)
        raw = weights.sum(2).view(batch, kv_heads, heads // kv_heads, length).sum(2)  # (B, Hkv, L)
        prefix = (t[None, :] >= pad[:, None]) & (t[None, :] < (start - window)[:, None])
        raw = raw * prefix[:, None, :]
        pooled = F.avg_pool1d(raw.view(-1, 1, length), self.pool, stride=1, padding=self.pool // 2,
                              count_include_pad=True).view(batch, kv_heads, length)
        observed = (t[None, :] >= (start - window)[:, None]) & (t[None, :] < start[:, None])
        scores = torch.where(observed[:, None, :], math.inf, pooled)
        return PromptRanking.of(scores.masked_fill(~(prefix | observed)[:, None, :], -math.inf))
