"""Scoring of needle-in-a-haystack answers: which needles the model retrieved.

Matching is by presence, not by exact answer, because the model is free to phrase
its answer (the paper counts needles retrieved out of 10).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

from .generator import Needle, NeedleSample


@dataclass(frozen=True)
class Score:
    """Needles found in one answer, per needle in the sample's order."""

    found: int
    total: int
    per_needle: list[bool]

    @property
    def fraction(self) -> float:
        return self.found / self.total


def needle_found(needle: Needle, answer: str) -> bool:
    """Hashes must appear verbatim (all 32 hex digits); a pass key must appear as a whole
    number (so 71432 does not match 714321); a fact's key answer in any case."""
    if needle.kind == "hash":
        return needle.answer in answer
    if needle.kind == "passkey":
        return re.search(rf"(?<!\d){re.escape(needle.answer)}(?!\d)", answer) is not None
    return needle.answer.lower() in answer.lower()


def score_needles(needles: Sequence[Needle], answer: str) -> Score:
    """Score against bare needles: lm-eval documents carry the needles, not the sample."""
    per_needle = [needle_found(n, answer) for n in needles]
    return Score(sum(per_needle), len(per_needle), per_needle)


def score_answer(sample: NeedleSample, answer: str) -> Score:
    return score_needles(sample.needles, answer)
