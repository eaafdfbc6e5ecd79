"""CPU time of the speculative flash decode reference against exact decode attention alone.

The speculative kernel returns the exact output, the approximation and the verdict; the claim is that this
costs next to nothing over the exact attention alone. The baseline an expert picks on the CPU is grouped-query
SDPA over the uncopied KV cache: the query viewed as (B, Hkv, G, D), so each KV head's keys serve its G query
heads as rows ("grouped"); plain SDPA with enable_gqa=True is the second column. Timings interleave the
candidates round by round (the machine is shared and noisy) and report medians.

    python benchmarks/bench_kernels.py [--threads 1] [--dtype bfloat16] [--rounds 200]
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Callable

import torch
import torch.nn.functional as F

from alspec_eval.kernels import speculative_flash_decode, torch_kernel

SHAPES = [(9, 3, 64), (32, 8, 128)]  # (q heads, kv heads, head_dim): SmolLM2-135M, Llama-3-8B-like
CONTEXTS = [4096, 16384, 32768]


FLUSH = torch.empty(64 * 2**20 // 4)  # larger than the last-level cache


def median_ms(fns: dict[str, Callable[[], object]], rounds: int, warmup: int = 5) -> dict[str, float]:
    """Median wall time per call of each function, measured in interleaved rounds. Each call starts with the
    caches flushed, as a decode step finds a layer's KV cache (read once per token), so that no candidate
    inherits another's warm cache (plain SDPA with enable_gqa copies K/V and evicts them, for one)."""
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            FLUSH.fill_(1.0)
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    return {name: statistics.median(t) * 1e3 for name, t in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--window", type=int, default=64, help="S, tokens per sink window")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--rounds", type=int, default=50)
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    torch.manual_seed(0)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {args.dtype}, batch 1, 1 query token, S={args.window}")
    print("ratio = speculative (exact + approximation + verification) / exact attention: grouped-query SDPA "
          "(query as (B, Hkv, G, D)), and plain SDPA with enable_gqa=True")
    print("spec = kernel=torch (the CPU fast path here); reference = the readable split-K reference")
    print(f"{'hq/hkv/d':>10} {'context':>8} {'grouped ms':>10} {'sdpa ms':>9} {'spec ms':>9} {'/grouped':>9} "
          f"{'/sdpa':>6} {'ref/grouped':>12}")
    for hq, hkv, dim in SHAPES:
        for ctx in CONTEXTS:
            q = torch.randn(1, hq, dim, dtype=dtype)
            k = torch.randn(1, hkv, ctx, dim, dtype=dtype)
            v = torch.randn(1, hkv, ctx, dim, dtype=dtype)
            cur_pos = torch.tensor([ctx - 1])
            grouped_q = q.view(1, hkv, hq // hkv, dim)
            ms = median_ms(
                {
                    "grouped": lambda: F.scaled_dot_product_attention(grouped_q, k, v),
                    "sdpa": lambda: F.scaled_dot_product_attention(q[:, :, None], k, v, enable_gqa=True),
                    "spec": lambda: torch_kernel(q, k, v, cur_pos, args.window, 0.1),
                    "reference": lambda: speculative_flash_decode(q, k, v, cur_pos, args.window, 0.1),
                },
                rounds=args.rounds,
            )
            print(f"{hq}/{hkv}/{dim:>3} {ctx:>8} {ms['grouped']:>10.3f} {ms['sdpa']:>9.3f} {ms['spec']:>9.3f} "
                  f"{ms['spec'] / ms['grouped']:>9.2f} {ms['spec'] / ms['sdpa']:>6.2f} "
                  f"{ms['reference'] / ms['grouped']:>12.2f}")


if __name__ == "__main__":
    main()
