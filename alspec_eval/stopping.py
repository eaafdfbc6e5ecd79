"""Where a generated row stops: one rule for HFLM's batched rows and for self-speculating rows.

HFLM generates a batch until every row has stopped, so a row's later tokens (after its EOS or stop
string) were fed back only because of its batch mates; their decisions must not count, or the
statistics would depend on the batch size. A self-speculating row verifies several tokens per step,
so its stop can fall inside a step; the tokens after it are neither output nor counted.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass


def stop_length(tokens: list[int], stop: Sequence[str], eos_ids: Collection[int],
                decode: Callable[[list[int]], str]) -> int | None:
    """How many of ``tokens`` the row keeps where greedy decoding stops: up to its first EOS, or the shortest prefix
    whose text contains a stop string (the decoded prefix grows with its length, so a binary search finds it);
    None while it has not stopped."""
    eos = next((i + 1 for i, t in enumerate(tokens) if t in eos_ids), None)
    end = len(tokens) if eos is None else eos
    strings = [s for s in stop if s]

    def stopped(n: int) -> bool:
        text = decode(tokens[:n])
        return any(s in text for s in strings)

    if not strings or not stopped(end):
        return eos
    lo, hi = 1, end
    while lo < hi:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if stopped(mid) else (mid + 1, hi)
    return lo


@dataclass(frozen=True)
class StopRule:
    """One request's stop: its stop strings, the model's EOS ids and the tokenizer's decoding."""

    stop: Sequence[str]
    eos_ids: Collection[int]
    decode: Callable[[list[int]], str]

    def stopped_at(self, tokens: list[int]) -> int | None:
        """:func:`stop_length` of ``tokens``: how many greedy decoding keeps, None while it has not stopped."""
        return stop_length(tokens, self.stop, self.eos_ids, self.decode)

    def kept(self, tokens: list[int]) -> int:
        """How many of ``tokens`` the row generates alone (all of them if it never stops)."""
        end = self.stopped_at(tokens)
        return len(tokens) if end is None else end
