"""Wall time of `--model alspec` (sim backend) against the stock `--model hf` on the same generation work.

SmolLM2-135M, prompts of about 2K tokens cut from the bundled haystack, 64 new tokens each
(no stop sequence), lambda 0.1, window 64. Runs alternate between the two models and the
median of the repeats is compared. Prints the ratio alspec / hf (target: at most 1.10).

    python benchmarks/bench_adapter.py [--prompts 4] [--repeats 3] [--tokens 2048]
"""

from __future__ import annotations

import argparse
import statistics
import time
from importlib import resources

import torch
from lm_eval.api.instance import Instance
from lm_eval.models.huggingface import HFLM

from alspec_eval.adapter import ALSpecLM
from alspec_eval.smollm2 import smollm2_path


def prompts(tokenizer, count: int, tokens: int) -> list[str]:
    haystack = (resources.files("alspec_eval") / "data" / "haystack.txt").read_text(encoding="utf-8")
    ids = tokenizer(haystack)["input_ids"]
    step = len(ids) // count
    return [tokenizer.decode(ids[i * step:i * step + tokens]) for i in range(count)]


def requests(texts: list[str], new_tokens: int) -> list[Instance]:
    kwargs = {"until": [], "max_gen_toks": new_tokens, "do_sample": False}
    return [Instance("generate_until", {}, (t, dict(kwargs)), i, ("bench", i, 1)) for i, t in enumerate(texts)]


def timed(lm: HFLM, texts: list[str], new_tokens: int) -> float:
    start = time.perf_counter()
    lm.generate_until(requests(texts, new_tokens), disable_tqdm=True)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--kernels", default="sdpa,torch",
                        help="alspec's decode kernels to time, comma-separated: auto, sdpa, torch, triton")
    parser.add_argument("--dtype", default="float32", help="model dtype, e.g. bfloat16 on CUDA")
    args = parser.parse_args()

    path = str(smollm2_path())
    common = {"pretrained": path, "device": args.device, "batch_size": args.batch_size, "dtype": args.dtype}
    models: dict[str, HFLM] = {"hf": HFLM(**common)}
    for kernel in args.kernels.split(","):
        models[kernel] = ALSpecLM(**common, **{"lambda": 0.1, "window": 64, "kernel": kernel})
    texts = prompts(models["hf"].tokenizer, args.prompts, args.tokens)
    for lm in models.values():
        timed(lm, texts[:1], 4)  # warm-up
    times: dict[str, list[float]] = {name: [] for name in models}
    for _ in range(args.repeats):  # interleaved rounds
        for name, lm in models.items():
            times[name].append(timed(lm, texts, args.new_tokens))
    medians = {name: statistics.median(t) for name, t in times.items()}
    print(f"device={args.device} threads={torch.get_num_threads()} prompts={args.prompts}x{args.tokens} tokens "
          f"new={args.new_tokens} batch={args.batch_size} dtype={args.dtype}, medians of {args.repeats} rounds")
    print(f"hf              median {medians['hf']:.2f} s  runs {[round(t, 2) for t in times['hf']]}")
    for name in models:
        if name == "hf":
            continue
        hit = models[name].statistics()["tasks"]["bench"]["total"]["hit_rate"]
        print(f"alspec {name:8s} median {medians[name]:.2f} s  runs {[round(t, 2) for t in times[name]]}  "
              f"hit rate {hit:.3f}  ratio alspec/hf = {medians[name] / medians['hf']:.3f}")


if __name__ == "__main__":
    main()
