"""The speculator's own host time per layer and decode step, on the CPU: the hook's Python and the torch ops it
dispatches, apart from the attention arithmetic.

A GPU decode step is bound by the host wherever the model is small for its GPU or the batch is small: each layer's
Python and each op it launches add to the step's wall time whatever the GPU does. This measures that work where
no GPU is: tiny Llama models (hidden size 64, so the arithmetic costs next to nothing) of two depths generate the
same tokens through lm-eval's ``generate_until`` as ``--model hf`` and as ``--model alspec``; the per-layer figure
is the slope between the depths of (alspec - hf) per decode step, medians of interleaved rounds.

Two speculation paths:
- ``model``: kernel=model, the model's own attention plus A~ on a gathered window;
- ``fused``: the path ``kernel=auto`` takes on a GPU, the Triton call with its launch stubbed out (the wrapper's
  host work runs: geometry once per pass, shape constants, scratch, three allocations; the kernel does not).

    python benchmarks/bench_host.py [--batch 8] [--new-tokens 32] [--rounds 5] [--layers 2,10]
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch
import transformers
from lm_eval.api.instance import Instance
from lm_eval.models.huggingface import HFLM

from alspec_eval.adapter import ALSpecLM
from alspec_eval.approx_check.models import char_tokenizer
from alspec_eval.kernels import triton_decode

PROMPT = "It was the best of times, it was the worst of times, it was the age of wisdom, it was the age of " * 2


class _NoLaunch:
    """Stands in for the jitted Triton kernel: ``kernel[grid](*args)`` returns at once."""

    def __getitem__(self, grid: tuple) -> Any:
        return lambda *args, **kwargs: None


def model(layers: int) -> transformers.PreTrainedModel:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=110, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                                      pad_token_id=0, bos_token_id=1, eos_token_id=2, attn_implementation="sdpa")
    return transformers.LlamaForCausalLM(config).eval()


def runner(kind: str, layers: int, batch: int) -> HFLM:
    common = {"pretrained": model(layers), "tokenizer": char_tokenizer(), "batch_size": batch, "device": "cpu",
              "max_length": 1024}
    if kind == "hf":
        return HFLM(**common)
    lm = ALSpecLM(**common, **{"lambda": 0.1, "window": 8, "kernel": "model" if kind == "model" else "torch"})
    if kind == "fused":
        lm.speculator.decode_kernel = triton_decode.speculative_flash_decode_triton
    return lm


def seconds(lm: HFLM, batch: int, new_tokens: int) -> float:
    kwargs = {"until": [], "max_gen_toks": new_tokens, "do_sample": False}
    requests = [Instance("generate_until", {}, (PROMPT[: len(PROMPT) - i], dict(kwargs)), i, ("bench", i, 1))
                for i in range(batch)]
    start = time.perf_counter()
    lm.generate_until(requests, disable_tqdm=True)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--layers", default="2,10", help="the two depths, comma-separated")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    depths = [int(x) for x in args.layers.split(",")]
    triton_decode.kernel = lambda: _NoLaunch()  # the fused path's launch stubbed: its host work only
    kinds = ("hf", "model", "fused")
    runners = {(kind, layers): runner(kind, layers, args.batch) for kind in kinds for layers in depths}
    for lm in runners.values():
        seconds(lm, args.batch, 4)  # warm-up
    times: dict[tuple[str, int], list[float]] = {key: [] for key in runners}
    for _ in range(args.rounds):  # interleaved rounds
        for key, lm in runners.items():
            times[key].append(seconds(lm, args.batch, args.new_tokens))
    median = {key: statistics.median(t) for key, t in times.items()}
    steps = args.new_tokens - 1  # the first new token comes from the prefill
    added = depths[1] - depths[0]
    print(f"torch {torch.__version__}, transformers {transformers.__version__}, {args.threads} thread(s), batch "
          f"{args.batch}, {args.new_tokens} new tokens, {depths[0]} and {depths[1]} layers, medians of {args.rounds} "
          "interleaved rounds")
    per_layer_hf = (median["hf", depths[1]] - median["hf", depths[0]]) / (added * steps) * 1e6
    print(f"hf's own host time per layer and decode step: {per_layer_hf:.0f} us")
    for kind in kinds[1:]:
        over = [(median[kind, d] - median["hf", d]) for d in depths]
        per_layer = (over[1] - over[0]) / (added * steps) * 1e6
        print(f"speculator ({kind}): {per_layer:.0f} us per layer and decode step over hf "
              f"({per_layer / per_layer_hf:.2f}x hf's own); per step at {depths[1]} layers: "
              f"{over[1] / steps * 1e3:.2f} ms over hf")


if __name__ == "__main__":
    main()
