"""Wall time of a K=5 lambda sweep plus baseline with a shared prefill, against six separate runs.

SmolLM2-135M (or ``--shape llama3-8b``: Llama-3-8B's shape with random weights in bfloat16, as in
bench_adapter.py), prompts of about 4K tokens from the bundled haystack, 32 new tokens each, window 64. The shared run prefills each prompt once and decodes the six variants as rows of
one batch; the separate runs prefill six times. Prints the ratio shared / separate (target:
at most 0.5) and checks that both give the same generations.

    python benchmarks/bench_sweep.py [--prompts 2] [--tokens 4096] [--new-tokens 32]
    python benchmarks/bench_sweep.py --device cuda --shape llama3-8b
"""

from __future__ import annotations

import argparse
import time

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
    args = parser.parse_args()

    path = str(smollm2_path())  # its tokenizer serves the random model too (its ids are within 128256)
    model = {"pretrained": llama3_8b(args.device, args.layers), "tokenizer": path} if args.shape == "llama3-8b" \
        else {"pretrained": path, "dtype": "float32"}
    lm = ALSpecLM(**model, device=args.device, batch_size=1, window=64)
    texts = prompts(lm.tokenizer, args.prompts, args.tokens)
    variants = sweep_rows(LAMBDAS, sink=False)

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


if __name__ == "__main__":
    main()
