"""CPU time of the speculative flash decode reference against exact decode attention alone.

The speculative kernel returns the exact output, the approximation and the verdict; the claim is that this
costs next to nothing over the exact attention alone. The baseline an expert picks on the CPU is grouped-query
SDPA over the uncopied KV cache: the query viewed as (B, Hkv, G, D), so each KV head's keys serve its G query
heads as rows ("grouped"); plain SDPA with enable_gqa=True is the second column. Timings interleave the
candidates round by round (the machine is shared and noisy) and report medians.

    python benchmarks/bench_kernels.py [--threads 1] [--dtype bfloat16] [--rounds 200]

On CUDA (``--device cuda``, bfloat16, batch 1 and 8) the candidates are cuDNN's and flash SDPA on the grouped
query, and the Triton speculative kernel, each timed for GPU time (``triton.testing.do_bench``, medians) and
for wall time per call (back-to-back calls, one synchronisation: what a host-bound decode pays); the floor
is K and V read once at the bandwidth of a large device-to-device copy measured in the same run.

    python benchmarks/bench_kernels.py --device cuda [--rounds 100]
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


def cuda_main(args: argparse.Namespace) -> None:
    """GPU time and wall per call of the Triton kernel beside cuDNN and flash SDPA, and the floor."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from triton.testing import do_bench

    from alspec_eval.kernels.triton_decode import speculative_flash_decode_triton

    src = torch.empty(2**28, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    copy_ms = do_bench(lambda: dst.copy_(src), return_mode="median")
    bandwidth = 2 * src.numel() / (copy_ms / 1e3)  # bytes read plus written per second

    def wall_ms(fn: Callable[[], object], calls: int = 50) -> float:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
        return (time.perf_counter() - t0) / calls * 1e3

    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, bfloat16, 1 query token, S={args.window}; "
          f"copy bandwidth {bandwidth / 1e12:.2f} TB/s")
    print("gpu = median GPU time (do_bench); wall = per call, back to back; floor = K and V read once")
    print(f"{'B':>2} {'hq/hkv/d':>10} {'context':>8} {'cudnn':>7} {'flash':>7} {'triton':>7} {'floor':>7} "
          f"{'cudnn wall':>10} {'triton wall':>11} {'triton/floor':>12} {'wall triton/cudnn':>17}")
    for batch in (1, 8):
        for hq, hkv, dim in SHAPES:
            for ctx in CONTEXTS:
                q = torch.randn(batch, hq, dim, dtype=torch.bfloat16, device="cuda")
                k, v = (torch.randn(batch, hkv, ctx, dim, dtype=torch.bfloat16, device="cuda") for _ in range(2))
                cur_pos = torch.full((batch,), ctx - 1, device="cuda")
                grouped = q.view(batch, hkv, hq // hkv, dim)

                def sdpa(backend: SDPBackend) -> Callable[[], object]:
                    def run() -> object:
                        with sdpa_kernel(backend):
                            return F.scaled_dot_product_attention(grouped, k, v)
                    return run

                fns = {"cudnn": sdpa(SDPBackend.CUDNN_ATTENTION), "flash": sdpa(SDPBackend.FLASH_ATTENTION),
                       "triton": lambda: speculative_flash_decode_triton(q, k, v, cur_pos, args.window, 0.1)}
                gpu = {name: do_bench(fn, rep=args.rounds, return_mode="median") for name, fn in fns.items()}
                walls = {name: statistics.median(wall_ms(fns[name]) for _ in range(5)) for name in ("cudnn", "triton")}
                floor = 2 * k.numel() * k.element_size() / bandwidth * 1e3
                print(f"{batch:>2} {hq}/{hkv}/{dim:>3} {ctx:>8} {gpu['cudnn']:>7.3f} {gpu['flash']:>7.3f} "
                      f"{gpu['triton']:>7.3f} {floor:>7.3f} {walls['cudnn']:>10.3f} {walls['triton']:>11.3f} "
                      f"{gpu['triton'] / floor:>12.2f} {walls['triton'] / walls['cudnn']:>17.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--window", type=int, default=64, help="S, tokens per sink window")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--rounds", type=int, default=50)
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    args = parser.parse_args()
    if args.device == "cuda":
        cuda_main(args)
        return
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
