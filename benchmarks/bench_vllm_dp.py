"""A 4-cell sweep on alspec-vllm's data-parallel replicas against the same sweep on one engine: wall time of the
whole sweep and of the engine starts, the starts themselves, and whether every cell gave the same texts and
per-layer counts.

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

COUNTS = ("speculated", "accepted", "trivial")
ENGINE = {"dtype": "float32", "enforce_eager": True, "kv_cache_memory_bytes": 1024 * 2**20, "seed": 0,
          "max_model_len": 2048}


def sweep(replicas: int, args: argparse.Namespace, out: Path) -> tuple[float, float, int, int, dict]:
    """Wall time of the engine start and of the sweep, engines started, engine calls, and every cell's file."""
    from alspec_eval.smollm2 import smollm2_path
    from alspec_eval.sweep.config import parse_config
    from alspec_eval.sweep.runner import cell_path, run_sweep
    from alspec_eval.vllm.model import ALSpecVLLM

    config = parse_config({"name": f"dp{replicas}", "tasks": [args.task], "lambdas": [0.1, 0.4], "window": 16,
                           "engine": "vllm", "limit": args.limit, "static": False,
                           "model_args": {"pretrained": "smollm2", **ENGINE}, "output": str(out / f"dp{replicas}")})
    start = time.perf_counter()
    lm = ALSpecVLLM(str(smollm2_path()), window=16, data_parallel_size=replicas, **ENGINE)
    started_in = time.perf_counter() - start
    engine = lm.model
    calls = 0
    generate = lm._model_generate

    def counted(*a, **k):
        nonlocal calls
        calls += 1
        return generate(*a, **k)

    lm._model_generate = counted
    folder = run_sweep(config, lm=lm)
    wall = time.perf_counter() - start - started_in
    assert lm.model is engine  # the same engine (or replicas) served every cell
    started = len(engine.actors) if replicas > 1 else 1
    cells = {row.name: json.loads(cell_path(folder, args.task, row).read_text()) for row in config.rows()}
    if replicas > 1:
        engine.shutdown()
    else:  # its processes stopped now: at exit, multiprocessing would wait for them once Ray has started
        engine.llm_engine.engine_core.shutdown()
    return started_in, wall, started, calls, cells


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--limit", type=int, default=8)
    parser.add_argument("--task", default="alspec_recall")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        one = sweep(1, args, Path(tmp))
        many = sweep(args.replicas, args, Path(tmp))
    same = True
    for name, cell in one[4].items():  # per cell: texts, counts, and the d/n the counts come from
        other = many[4][name]
        texts = [s["response"] for s in cell["sample_log"]] == [s["response"] for s in other["sample_log"]]
        counts = [[layer[k] for k in COUNTS] for layer in cell["alspec"]["layers"]] == \
            [[layer[k] for k in COUNTS] for layer in other["alspec"]["layers"]]
        moved = sum(abs(x - y) for a, b in zip(cell["alspec"]["layers"], other["alspec"]["layers"])
                    for x, y in zip(a["hist"], b["hist"])) // 2
        same &= texts and counts
        print(f"  {name}: texts equal: {texts}, per-layer counts equal: {counts}, d/n moved to another "
              f"histogram bin: {moved} of {cell['alspec']['total']['speculated']}")
    print(f"4-cell sweep ({', '.join(one[4])}) of {args.task}, limit {args.limit}, SmolLM2 float32:")
    for name, (start, wall, started, calls, _) in (("1 engine", one), (f"{args.replicas} replicas", many)):
        print(f"  {name:10s}: start {start:6.1f} s, sweep {wall:6.1f} s, engines started: {started}, "
              f"engine calls: {calls}")
    print(f"  lm-eval's own data parallel would start {one[3] * args.replicas} engines: one per replica and call")
    print(f"  replicas over one engine: start {many[0] / one[0]:.2f}x, sweep {many[1] / one[1]:.2f}x, whole "
          f"{(many[0] + many[1]) / (one[0] + one[1]):.2f}x; texts and counts equal in every cell: {same}")


if __name__ == "__main__":
    main()
