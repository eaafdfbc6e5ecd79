"""A 4-cell sweep on alspec-vllm's data-parallel replicas against the same sweep on one engine: wall time of the
whole sweep (engine starts included), the starts themselves, and whether every cell came out equal.

Replicas live for the whole sweep (alspec_eval.vllm.replicas), so a sweep starts `data_parallel_size` engines once;
lm-eval's own `--model vllm` with `data_parallel_size` starts every replica's engine again on each engine call, which
this prints beside (the engine calls counted in the run on one engine, times the replicas). On a CPU each replica
runs on a core of its own, and the single engine on all of them. Run it in .venv-vllm (scripts/vllm_env.sh, with Ray).

    python benchmarks/bench_vllm_dp.py [--replicas 2] [--limit 8] [--task alspec_recall]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

ENGINE = {"dtype": "float32", "enforce_eager": True, "kv_cache_memory_bytes": 256 * 2**20, "seed": 0,
          "max_model_len": 2048}


def sweep(replicas: int, args: argparse.Namespace, out: Path) -> tuple[float, int, int, dict]:
    """Wall time (engine start included), engines started, engine calls, and every cell's file."""
    from alspec_eval.smollm2 import smollm2_path
    from alspec_eval.sweep.config import parse_config
    from alspec_eval.sweep.runner import cell_path, run_sweep
    from alspec_eval.vllm.model import ALSpecVLLM

    config = parse_config({"name": f"dp{replicas}", "tasks": [args.task], "lambdas": [0.1, 0.4], "window": 16,
                           "engine": "vllm", "limit": args.limit, "static": False,
                           "model_args": {"pretrained": "smollm2", **ENGINE}, "output": str(out / f"dp{replicas}")})
    start = time.perf_counter()
    lm = ALSpecVLLM(str(smollm2_path()), window=16, data_parallel_size=replicas, **ENGINE)
    engine = lm.model
    calls = 0
    generate = lm._model_generate

    def counted(*a, **k):
        nonlocal calls
        calls += 1
        return generate(*a, **k)

    lm._model_generate = counted
    folder = run_sweep(config, lm=lm)
    wall = time.perf_counter() - start
    assert lm.model is engine  # the same engine (or replicas) served every cell
    started = len(engine.actors) if replicas > 1 else 1
    cells = {row.name: json.loads(cell_path(folder, args.task, row).read_text()) for row in config.rows()}
    if replicas > 1:
        engine.shutdown()
    return wall, started, calls, cells


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--limit", type=int, default=8)
    parser.add_argument("--task", default="alspec_recall")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        one = sweep(1, args, Path(tmp))
        many = sweep(args.replicas, args, Path(tmp))
    equal = all(many[3][name]["sample_log"] == cell["sample_log"] and
                many[3][name]["alspec"]["layers"] == cell["alspec"]["layers"] for name, cell in one[3].items())
    print(f"4-cell sweep ({', '.join(one[3])}) of {args.task}, limit {args.limit}, SmolLM2 float32:")
    print(f"  1 engine:   {one[0]:7.1f} s, engines started: {one[1]}, engine calls: {one[2]}")
    print(f"  {args.replicas} replicas: {many[0]:7.1f} s, engines started: {many[1]} (lm-eval's own data parallel "
          f"would start {one[2] * args.replicas}: one per replica and engine call)")
    print(f"  ratio (replicas over one engine): {many[0] / one[0]:.2f}x; every cell equal: {equal}")


if __name__ == "__main__":
    main()
