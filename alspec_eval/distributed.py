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


def gather_task_stats(local: dict[str, AcceptanceStats], world_size: int,
                      num_layers: int) -> dict[str, AcceptanceStats]:
    """Per-task statistics summed over ranks (``local`` itself in one process)."""
    dist = _distributed()
    if world_size <= 1 or dist is None:
        return dict(local)
    parts: list[dict[str, AcceptanceStats]] = [{} for _ in range(dist.get_world_size())]
    dist.all_gather_object(parts, local)
    total: dict[str, AcceptanceStats] = {}
    for part in parts:
        for task, stats in part.items():
            total[task] = total.get(task, AcceptanceStats.zeros(num_layers)) + stats
    return dict(sorted(total.items()))


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
