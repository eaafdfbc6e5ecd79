"""One rank of a data-parallel lm-eval run on the CPU (gloo), set up as HFLM sets up ranks on GPUs.

Usage: python tests/dp_worker.py RANK WORLD PORT OUT.json            (rank 0 writes OUT.json)
       python tests/dp_worker.py RANK WORLD PORT OUTDIR sweep MODEL SCHEDULE  (the smoke sweep config on MODEL,
                                                                      with a tuned row of lambda_schedule SCHEDULE)
       python tests/dp_worker.py RANK WORLD PORT OUTDIR approx MODEL  (every registered approximation's lambda
                                                                      and sink rows, default_approximations.py,
                                                                      and two of kvpress's presses)
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).parent))

from helpers import alspec_lm
from alspec_eval.approx_check.models import tiny_model

DP_PRESSES = ["KnormPress", "SnapKVPress"]  # kvpress's drafts on two ranks: a key-only and a prompt-time press


def main() -> None:
    rank, world, port, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], Path(sys.argv[4])
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    if world > 1:
        dist.init_process_group("gloo", rank=rank, world_size=world)
    if sys.argv[5:6] == ["sweep"]:
        from alspec_eval.sweep.config import load_config
        from alspec_eval.sweep.runner import build_lm, run_sweep

        config = load_config(Path(__file__).parents[1] / "configs" / "smoke.yaml",
                             {"model_args": {"pretrained": sys.argv[6]}, "lambdas": [0.5, 1.0],
                              "static": {"p": 0.5, "lambda": 1.0}, "gammas": [2], "schedules": sys.argv[7:8],
                              "output": str(out)})
        lm = build_lm(config)
        _as_rank(lm, rank, world)
        run_sweep(config, lm=lm)
    elif sys.argv[5:6] == ["approx"]:
        from alspec_eval.sweep.config import load_config
        from alspec_eval.sweep.runner import build_lm, run_sweep
        from default_approximations import APPROXIMATIONS, approx_args
        from default_presses import press_args

        made = [approx_args(a, 8) for a in APPROXIMATIONS] + [press_args(p, 8) for p in DP_PRESSES]
        config = load_config(Path(__file__).parents[1] / "configs" / "smoke.yaml",
                             {"model_args": {"pretrained": sys.argv[6]}, "lambdas": [1.0], "static": False,
                              "window": 8, "approx": [m["approx"] for m in made], "output": str(out),
                              "approx_args": {m["approx"]: m["approx_args"] for m in made if "approx_args" in m}})
        lm = build_lm(config)
        _as_rank(lm, rank, world)
        run_sweep(config, lm=lm)
    else:
        _evaluate(rank, world, out)
    if world > 1:
        dist.destroy_process_group()


def _as_rank(lm, rank: int, world: int) -> None:
    """What HFLM sets up under accelerate on GPUs: rank, world size and the accelerator's collectives."""
    lm._rank, lm._world_size = rank, world

    def gather(t: torch.Tensor) -> torch.Tensor:
        parts = [torch.zeros_like(t) for _ in range(world)]
        dist.all_gather(parts, t)
        return torch.stack(parts)

    lm.accelerator = SimpleNamespace(wait_for_everyone=dist.barrier if world > 1 else lambda: None, gather=gather,
                                     unwrap_model=lambda m: m)


def _evaluate(rank: int, world: int, out: Path) -> None:
    lm = alspec_lm(tiny_model(), batch_size=2, window=16, **{"lambda": 0.9}, stats_path=str(out.with_suffix(f".stats{rank}.json")))
    _as_rank(lm, rank, world)
    from lm_eval import simple_evaluate

    results = simple_evaluate(model=lm, tasks=["alspec_recall"], limit=5, log_samples=True, bootstrap_iters=0)
    if rank == 0:
        samples = sorted((s["doc_id"], s["arguments"][0][-1]["alspec"]) for s in results["samples"]["alspec_recall"])
        out.write_text(json.dumps({"alspec": results["config"]["alspec"], "samples": samples,
                                   "score": results["results"]["alspec_recall"]}))


if __name__ == "__main__":
    main()
