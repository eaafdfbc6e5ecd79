"""Every kvpress press alspec-eval runs as a draft, with arguments that make it score on the tests' short prompts
(SnapKV's window and LagKV's chunks shorter than they are): the one list that parametrizes each test that must hold
for every press (kvpress's own tests/default_presses.py pattern). A press supported without an entry here fails
test_kvpress.py."""

from __future__ import annotations

from collections.abc import Callable

# press -> its approx_args at a window of S tokens (prompt-time presses: recent = S/2 of the 2S keys)
DEFAULT_PRESSES: dict[str, Callable[[int], dict]] = {
    "KnormPress": lambda window: {},
    "KeyDiffPress": lambda window: {},
    "CURPress": lambda window: {"num_sinks": 2, "local_window_size": 4},
    "LagKVPress": lambda window: {"n_sink": 2, "lag_size": 4},
    "RandomPress": lambda window: {"seed": 3},
    "StreamingLLMPress": lambda window: {"n_sink": 2},
    "CriticalKVPress": lambda window: {"press": "KeyDiffPress"},
    "SnapKVPress": lambda window: {"window_size": 4, "kernel_size": 3, "recent": max(1, window // 2)},
    "PyramidKVPress": lambda window: {"window_size": 4, "kernel_size": 3, "recent": max(1, window // 2)},
    "ExpectedAttentionPress": lambda window: {"n_sink": 2, "n_future_positions": 16, "recent": max(1, window // 2)},
    "CapPress": lambda window: {"n_sink": 2, "n_future_positions": 16, "recent": max(1, window // 2)},
    "LeverageScorePress": lambda window: {"sketch_dimension": 8, "recent": max(1, window // 2)},
    "NonCausalAttnPress": lambda window: {"chunk_size": 8, "recent": max(1, window // 2)},
    "CompactorPress": lambda window: {"sink_size_start": 2, "sink_size_end": 2, "chunk_size": 8,
                                      "sketch_dimension": 8, "recent": max(1, window // 2)},
}
PRESSES = list(DEFAULT_PRESSES)


def press_args(press: str, window: int) -> dict:
    """The model_args of ``kvpress:<press>`` at ``window``, as a user writes them."""
    args = DEFAULT_PRESSES[press](window)
    return {"approx": f"kvpress:{press}",
            **({"approx_args": ";".join(f"{k}:{v}" for k, v in args.items())} if args else {})}
