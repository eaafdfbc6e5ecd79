"""Every registered approximation with parameters that fit a test's window: the one list that parametrizes each
test that must hold for every approximation (kvpress's tests/default_presses.py pattern). A built-in added to the
registry without an entry here fails test_approximation_registry.py."""

from __future__ import annotations

from collections.abc import Callable

from alspec_eval.approximations import approximation_class

# name -> its approx_args at a window of S tokens (quest: pages of S/2 tokens, so two pages are chosen by bound
# besides the first and the current one)
DEFAULT_APPROXIMATIONS: dict[str, Callable[[int], dict]] = {
    "sink": lambda window: {},
    "local": lambda window: {},
    "quest": lambda window: {"page": max(1, window // 2)},
    "topk": lambda window: {},
    "snapkv": lambda window: {"observe": 8, "pool": 3, "recent": max(1, window // 2)},
    # sinks, local and top keys of S/2 each, a base sample of 1/4 of the rest, and a promise loose enough that the
    # sample stays below the whole rest on a tiny model's short prompts (where it reaches it, A~ is A up to rounding)
    "vattention": lambda window: {"sink": 2, "local": max(1, window // 2), "top": max(1, window // 2),
                                  "base_rate": 0.25, "epsilon": 0.5, "delta": 0.3},
}
APPROXIMATIONS = list(DEFAULT_APPROXIMATIONS)
BEYOND_SINK = [a for a in APPROXIMATIONS if not approximation_class(a).fused_kernel]  # no fused kernel computes them
PROMPT_SCORING = [a for a in APPROXIMATIONS if approximation_class(a).prompt_keys]  # no self-speculation drafts
DRAFTS = [a for a in BEYOND_SINK if a not in PROMPT_SCORING]  # those self-speculation drafts with and rows share


def approx_args(approx: str, window: int) -> dict:
    """The model_args of ``approx`` at ``window``, as a user writes them (approx_args=page:4)."""
    args = DEFAULT_APPROXIMATIONS[approx](window)
    return {"approx": approx, **({"approx_args": ";".join(f"{k}:{v}" for k, v in args.items())} if args else {})}
