"""Needle-in-a-haystack prompts and scoring for long-context accuracy under speculation."""

from .generator import (FACTS, SUPPORTED_LENGTHS, Needle, NeedleSample, make_paper_sample, make_single_sample,
                        tolerance)
from .scoring import Score, needle_found, score_answer, score_needles

__all__ = [
    "FACTS",
    "Needle",
    "NeedleSample",
    "SUPPORTED_LENGTHS",
    "Score",
    "make_paper_sample",
    "make_single_sample",
    "needle_found",
    "score_answer",
    "score_needles",
    "tolerance",
]
