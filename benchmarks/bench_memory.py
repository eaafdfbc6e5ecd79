"""Peak memory at SmolLM2's full 8K context on the CPU, against the stock `--model hf` on the same input (target:
ratio <= 1.1 for --model alspec): a needle run (generation: only the new tokens speculate), and rolling scoring
(`loglikelihood_rolling` of an 8K-token text: every position speculates, so A~'s window keys are gathered for
thousands of positions per layer, in chunks of bounded size).

Each run is its own process (the stock commands, as a user types them); its peak resident set size comes from the
kernel's accounting of that child (ru_maxrss). `alspec-niah` decodes a sweep's variants (baseline, each lambda and
pure sink) as rows of one batch after one shared prefill, so it holds one KV cache per variant by design.

Peak RSS of one run varies by a few hundred MiB with the allocator's timing, so runs are repeated, interleaved,
and the medians compared.

    python benchmarks/bench_memory.py [--length 8192] [--max-gen-toks 16] [--repeats 3] [--runs hf,alspec,...]
    python benchmarks/bench_memory.py --device cuda --shape llama3-8b --runs hf_rolling,alspec_rolling
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

# One rolling-loglikelihood request of `length` tokens of the haystack, through HFLM or ALSpecLM (argv: model
# path, "hf" or "alspec", length, window, device, shape, layers). On CUDA it prints the peak of allocated GPU memory
# in MiB (the Llama-3-8B shape: random weights in bfloat16, bench_adapter.py's).
ROLLING = """
import sys
from importlib import resources
import torch
from lm_eval.api.instance import Instance
from lm_eval.models.huggingface import HFLM
from alspec_eval.adapter import ALSpecLM
model, kind, length, window, device, shape, layers = sys.argv[1:8]
length, window = int(length), int(window)
args = dict(max_length=length, batch_size=1, device=device)
if shape == "llama3-8b":
    from bench_adapter import llama3_8b
    args.update(pretrained=llama3_8b(device, int(layers) or None), tokenizer=model)
else:
    args.update(pretrained=model, dtype="float32")
lm = HFLM(**args) if kind == "hf" else ALSpecLM(**args, window=window, **{"lambda": 0.1})
haystack = (resources.files("alspec_eval") / "data" / "haystack.txt").read_text(encoding="utf-8")
text = lm.tokenizer.decode(lm.tok_encode(haystack[:8 * length])[:length - 1])
if device == "cuda":
    torch.cuda.reset_peak_memory_stats()
lm.loglikelihood_rolling([Instance("loglikelihood_rolling", {}, (text,), 0, ("rolling", 0, 1))], disable_tqdm=True)
if device == "cuda":
    print(torch.cuda.max_memory_allocated() / 2**20)
"""


def peak_mib(cmd: list[str]) -> tuple[float, float]:
    """(peak in MiB, wall seconds) of one command run to completion: the GPU memory it allocated where it prints
    that, else its resident set size."""
    import time

    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(Path(__file__).parent), os.environ.get("PYTHONPATH")]))}
    start = time.perf_counter()
    with tempfile.TemporaryFile("w+") as out:
        proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.PIPE, text=True)
        _, status, usage = os.wait4(proc.pid, 0)  # this child's own peak, not the largest of every child's
        if status:
            sys.exit(f"bench_memory: {' '.join(cmd)} failed:\n{proc.stderr.read()[-3000:]}")
        out.seek(0)
        printed = out.read().split()
    gpu = float(printed[-1]) if printed and printed[-1].replace(".", "", 1).isdigit() else None
    return gpu if gpu is not None else usage.ru_maxrss / 1024, time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--length", type=int, default=8192, help="needle prompt length in tokens")
    parser.add_argument("--max-gen-toks", type=int, default=16)
    parser.add_argument("--window", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--device", default="cpu", help="cuda: the rolling runs' peak of allocated GPU memory")
    parser.add_argument("--shape", choices=["smollm2", "llama3-8b"], default="smollm2",
                        help="the rolling runs' model (llama3-8b: random weights in bfloat16, for CUDA)")
    parser.add_argument("--layers", type=int, default=0, help="llama3-8b only: fewer layers, for a smoke run")
    parser.add_argument("--runs", default="hf,alspec,niah,niah_seq,hf_rolling,alspec_rolling",
                        help="which runs, comma-separated (hf, alspec, niah, niah_seq: the needle run; hf_rolling, "
                             "alspec_rolling: rolling scoring)")
    args = parser.parse_args()
    from alspec_eval.smollm2 import smollm2_path

    model = str(smollm2_path())
    bin_dir = Path(sys.executable).parent
    metadata = json.dumps({"max_seq_lengths": [args.length], "niah_depths": [0.5]})
    common = ["--tasks", "alspec_niah_single", "--metadata", metadata, "--limit", "1", "--device", "cpu",
              "--batch_size", "1", "--gen_kwargs", f"max_gen_toks={args.max_gen_toks}"]
    runs = {
        "hf": [str(bin_dir / "lm_eval"), "--model", "hf", "--model_args", f"pretrained={model},dtype=float32", *common],
        "alspec": [str(bin_dir / "lm_eval"), "--model", "alspec", "--model_args",
                   f"pretrained={model},dtype=float32,lambda=0.1,window={args.window}", *common],
    }
    for kind in ("hf", "alspec"):
        runs[f"{kind} rolling"] = [sys.executable, "-c", ROLLING, model, kind, str(args.length), str(args.window),
                                   args.device, args.shape, str(args.layers)]
    niah = "alspec-niah (baseline, lambda 0.1, sink)"
    niah_seq = "alspec-niah --no_shared_prefill"
    chosen = {"hf": "hf", "alspec": "alspec", "niah": niah, "niah_seq": niah_seq, "hf_rolling": "hf rolling",
              "alspec_rolling": "alspec rolling"}
    wanted = [chosen[k] for k in args.runs.split(",")]
    measured: dict[str, list[tuple[float, float]]] = {name: [] for name in wanted}
    for _ in range(args.repeats):
        with tempfile.TemporaryDirectory() as out:  # a fresh folder each time: a sweep reuses finished cells
            runs[niah] = [
                str(bin_dir / "alspec-niah"), "--lengths", str(args.length), "--depths", "0.5", "--lambdas", "0.1",
                "--window", str(args.window), "--max-gen-toks", str(args.max_gen_toks), "--output", out,
                "--allow_longer"]  # the same prompt as the lm_eval runs: 8K plus the new tokens, cut by lm-eval to 8K
            runs[niah_seq] = [*runs[niah][:-3], "--output", out + "/sequential", "--allow_longer", "--no_shared_prefill"]
            for name in wanted:
                measured[name].append(peak_mib(runs[name]))
    if args.device != "cpu" and not set(wanted) <= {"hf rolling", "alspec rolling"}:
        sys.exit("bench_memory: --device cuda measures the rolling runs only; add --runs hf_rolling,alspec_rolling")
    print(f"{args.shape} on {args.device} (peak {'GPU memory allocated' if args.device == 'cuda' else 'RSS'}); "
          f"SmolLM2-135M float32, needle prompt of {args.length} tokens, {args.max_gen_toks} new tokens; rolling "
          f"scoring of {args.length} tokens; CPU threads={os.cpu_count()}, medians of {args.repeats} interleaved runs")
    peaks = {name: statistics.median(p for p, _ in m) for name, m in measured.items()}
    for name, m in measured.items():
        base = "hf rolling" if name.endswith("rolling") else "hf"
        ratio = f"ratio to {base} {peaks[name] / peaks[base]:.3f}" if base in peaks else ""
        print(f"{name:45s} peak {peaks[name]:8.0f} MiB  {ratio}  "
              f"runs {[round(p) for p, _ in m]}  wall {statistics.median(w for _, w in m):.0f} s")


if __name__ == "__main__":
    main()
