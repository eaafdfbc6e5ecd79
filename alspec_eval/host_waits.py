"""Where a call makes the host wait for a CUDA device: each read-back or blocking copy stalls a host-bound decode step
at every layer. Counted with torch's sync debug mode (its warnings; not its own first notice that it is a prototype):
what ``benchmarks/bench_paged_drafts.py`` reports per draft and ``tests/gpu`` holds every draft to."""

from __future__ import annotations

import warnings
from collections.abc import Callable


def host_waits(call: Callable[[], object]) -> list[str]:
    """The first line of each warning torch's sync debug mode gives while ``call`` runs: one per synchronizing
    operation it makes (none on a host-bound path that copies without waiting and reads nothing back)."""
    import torch

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            call()
        finally:
            torch.cuda.set_sync_debug_mode(0)
    return [str(w.message).splitlines()[0] for w in caught if "called a synchronizing" in str(w.message)]
