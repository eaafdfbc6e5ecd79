"""Data parallel runs (``accelerate launch``, or torch.distributed set up by hand): statistics from every rank,
files from one.

lm-eval shards requests across ranks and gathers the samples and metrics itself; acceptance statistics are the
adapter's, so it gathers them after each request batch, on every rank (lm-eval calls ``get_model_info`` on rank 0
only, where a collective would hang).
"""

from __future__ import annotations

import os
from typing import Any

from .stats import AcceptanceStats


def _distributed() -> Any:
    import torch.distributed as dist

    return dist if dist.is_available() and dist.is_initialized() else None


def gather_statistics(local: dict[str, AcceptanceStats], samples: dict[Any, dict[str, Any]], world_size: int,
                      num_layers: int) -> tuple[dict[str, AcceptanceStats], dict[Any, dict[str, Any]]]:
    """Per-task statistics summed over ranks, and every rank's per-sample entries (``local`` and ``samples``
    themselves in one process)."""
    dist = _distributed()
    if world_size <= 1 or dist is None:
        return dict(local), dict(samples)
    parts: list[tuple[dict[str, AcceptanceStats], dict]] = [({}, {}) for _ in range(dist.get_world_size())]
    dist.all_gather_object(parts, (local, samples))
    total: dict[str, AcceptanceStats] = {}
    every: dict[Any, dict[str, Any]] = {}
    for part, part_samples in parts:
        for task, stats in part.items():
            total[task] = total.get(task, AcceptanceStats.zeros(num_layers)) + stats
        every.update(part_samples)
    return dict(sorted(total.items())), every


def is_main_process(rank: int | None = None) -> bool:
    """The process that writes files: rank 0 (of lm-eval's model, else of torch.distributed), local rank 0."""
    if rank is None:
        dist = _distributed()
        rank = dist.get_rank() if dist is not None else 0
    return rank == 0 and int(os.environ.get("LOCAL_RANK", "0")) == 0


def barrier() -> None:
    """Wait for every rank (a no-op in one process)."""
    dist = _distributed()
    if dist is not None:
        dist.barrier()
