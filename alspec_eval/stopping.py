"""Where a generated row would have stopped on its own.

HFLM generates a batch until every row has stopped, so a row's later tokens (after its EOS or stop
string) were fed back only because of its batch mates; their decisions must not count, or the
statistics would depend on the batch size.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence


def own_length(tokens: list[int], stop: Sequence[str], eos_ids: Collection[int],
               decode: Callable[[list[int]], str]) -> int:
    """How many of ``tokens`` the row generates alone: up to its first EOS, or the shortest prefix whose
    text contains a stop string (the decoded prefix grows with its length, so a binary search finds it)."""
    length = next((i + 1 for i, t in enumerate(tokens) if t in eos_ids), len(tokens))
    strings = [s for s in stop if s]

    def stopped(n: int) -> bool:
        text = decode(tokens[:n])
        return any(s in text for s in strings)

    if not strings or not stopped(length):
        return length
    lo, hi = 1, length
    while lo < hi:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if stopped(mid) else (mid + 1, hi)
    return lo


def has_stopped(tokens: list[int], stop: Sequence[str], eos_ids: Collection[int],
                decode: Callable[[list[int]], str]) -> bool:
    """Whether ``tokens`` hold an EOS or their text a stop string (a self-speculating row ends its steps here)."""
    if any(t in eos_ids for t in tokens):
        return True
    text = decode(tokens)
    return any(s in text for s in stop if s)
