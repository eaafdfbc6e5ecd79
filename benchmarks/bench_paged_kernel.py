"""GPU time of the paged Triton speculative decode (kernels/triton_paged.py) beside flash decoding over the same paged
KV cache, on CUDA.

The cache is vLLM FlashAttention's layout, K and V views of one (2, num_blocks, block_size, Hkv, D) tensor, each
row's blocks shuffled over it; Llama-3-8B heads (32/8, head_dim 128), bfloat16, one query token per row at the
cache's end. The baseline is exact decode attention alone: ``flash_attn.flash_attn_with_kvcache`` reading the same
blocks through the same table where flash-attn is installed and takes the block size (flash-attn 2 wants multiples
of 256), else flash SDPA over a contiguous copy of the cache (gathered once, the gather not timed); the table names
the one used. Also the contiguous Triton call on that copy, so that the cost of the table is read off directly.
GPU time per call: a CUDA graph of ``--graph-calls`` calls replayed and timed with CUDA events, candidates
interleaved round by round, medians; host time per call: calls back to back, no synchronisation. Every figure in
microseconds. The paged call's A is checked against the baseline's output (the last column): the script exits 1
where they differ by more than bfloat16 rounding.

    python benchmarks/bench_paged_kernel.py [--rounds 5] [--batches 1,8] [--contexts 2048,32768] [--block-size 16]
"""

from __future__ import annotations

import argparse
import sys
from typing import Callable


def ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",")]


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--window", type=int, default=64, help="S, tokens per sink window (default 64)")
    p.add_argument("--block-size", type=int, default=16, help="positions per cache block (default 16, vLLM's)")
    p.add_argument("--batches", type=ints, default=[1, 8], help="batch sizes (default 1,8)")
    p.add_argument("--contexts", type=ints, default=[2048, 8192, 32768, 131072],
                   help="context lengths (default 2K, 8K, 32K, 128K)")
    p.add_argument("--rounds", type=int, default=11, help="interleaved rounds per figure (default 11)")
    p.add_argument("--graph-calls", type=int, default=50, help="calls per CUDA graph (default 50)")
    p.add_argument("--host-calls", type=int, default=200, help="calls per host-time round (default 200)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    import torch  # after the arguments: --help answers without loading torch

    if not torch.cuda.is_available():
        print("bench_paged_kernel.py: no CUDA device (torch.cuda.is_available() is False): it times CUDA kernels "
              "only, nothing was measured", file=sys.stderr)
        return 1
    return cuda_main(args)


def baseline(q, k_cache, v_cache, table, seqlens, k_flat, v_flat) -> tuple[str, Callable[[], object], Callable]:
    """(name, call, its output as (B, Hq, D)) of exact decode attention: flash-attn over the paged cache where it
    runs, else flash SDPA over the contiguous copy."""
    import torch.nn.functional as F
    from bench_kernels import _runs
    from torch.nn.attention import SDPBackend, sdpa_kernel

    try:
        from flash_attn import flash_attn_with_kvcache
    except ImportError:
        flash_attn_with_kvcache = None
    if flash_attn_with_kvcache is not None:
        def paged() -> object:
            return flash_attn_with_kvcache(q[:, None], k_cache, v_cache, cache_seqlens=seqlens, block_table=table)
        if _runs("flash_attn_with_kvcache", paged):
            return "flash-attn paged", paged, lambda out: out[:, 0]
    b, hq, dim = q.shape
    grouped = q.view(b, k_flat.shape[1], hq // k_flat.shape[1], dim)

    def sdpa() -> object:
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            return F.scaled_dot_product_attention(grouped, k_flat, v_flat)
    return "SDPA on a copy", sdpa, lambda out: out.reshape(b, hq, dim)


HQ, HKV, DIM = 32, 8, 128  # Llama-3-8B's heads
AGREE = 2e-2  # the largest difference of A from the baseline's, relative to its largest element (bfloat16 outputs)


def cuda_main(args: argparse.Namespace) -> int:
    """One markdown row per (batch, context), printed as it is measured; 1 if the paged call's A differs from the
    baseline's by more than AGREE anywhere."""
    import torch
    from bench_kernels import _copy_bandwidth

    bandwidth = _copy_bandwidth()
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, bfloat16, {HQ}/{HKV} heads, d {DIM}, "
          f"block size {args.block_size}, S={args.window}, copy bandwidth {bandwidth / 1e12:.2f} TB/s; microseconds "
          f"per call; gpu = CUDA graph of {args.graph_calls} calls, median of {args.rounds} interleaved rounds; host = "
          f"{args.host_calls} calls back to back; baseline: flash-attn paged = flash_attn_with_kvcache over the paged "
          "cache and its table, SDPA on a copy = flash SDPA over a contiguous copy of it (the copy not timed)",
          flush=True)
    print("| B | L | baseline | floor | baseline gpu | paged gpu | paged/baseline | contiguous gpu | paged/contiguous | "
          "baseline host | paged host | host paged/baseline | max abs(A - baseline) / max abs(baseline) |")
    print("|" + " --- |" * 13, flush=True)
    worst = 0.0
    for batch in args.batches:
        for ctx in args.contexts:
            worst = max(worst, measure(args, batch, ctx, bandwidth))
            torch.cuda.empty_cache()  # the next shape's cache where this one's was
    if worst > AGREE:
        print(f"bench_paged_kernel.py: the paged call's A differs from the baseline's by {worst:.2g} of its largest "
              f"element (more than {AGREE})", file=sys.stderr)
        return 1
    return 0


def measure(args: argparse.Namespace, batch: int, ctx: int, bandwidth: float) -> float:
    """Print one shape's row; return how far the paged call's A is from the baseline's (relative to its largest
    element)."""
    import statistics

    import torch
    from bench_kernels import _host_us, _interleaved

    from alspec_eval.kernels.triton_decode import prepare, speculative_flash_decode_triton
    from alspec_eval.kernels.triton_paged import speculative_flash_decode_paged

    blocks = -(-ctx // args.block_size)
    generator = torch.Generator(device="cuda").manual_seed(0)
    kv = torch.randn(2, batch * blocks, args.block_size, HKV, DIM, device="cuda", dtype=torch.bfloat16,
                     generator=generator)
    k_cache, v_cache = kv.unbind()  # vLLM FlashAttention's layout: views of one cache
    table = torch.randperm(batch * blocks, device="cuda", generator=generator).view(batch, blocks).int()
    q = torch.randn(batch, HQ, DIM, device="cuda", dtype=torch.bfloat16, generator=generator)
    cur_pos = torch.full((batch,), ctx - 1, device="cuda")
    seqlens = torch.full((batch,), ctx, device="cuda", dtype=torch.int32)
    k_flat, v_flat = (c[table.long()].flatten(1, 2)[:, :ctx].transpose(1, 2).contiguous() for c in (k_cache, v_cache))
    geometry = prepare(cur_pos, args.window, 1)  # once per decode pass, as a model's layers share it
    name, exact, as_heads = baseline(q, k_cache, v_cache, table, seqlens, k_flat, v_flat)
    fns = {"baseline": exact,
           "paged": lambda: speculative_flash_decode_paged(q, k_cache, v_cache, table, cur_pos, args.window, 0.1,
                                                           geometry=geometry),
           "contiguous": lambda: speculative_flash_decode_triton(q, k_flat, v_flat, cur_pos, args.window, 0.1,
                                                                 geometry=geometry)}
    want = as_heads(exact()).float()
    error = ((fns["paged"]().exact.float() - want).abs().max() / want.abs().max()).item()
    gpu = _interleaved(fns, args.graph_calls, args.rounds)
    host = {n: statistics.median(_host_us(fns[n], args.host_calls) for _ in range(args.rounds))
            for n in ("baseline", "paged")}
    floor = 2 * k_flat.numel() * k_flat.element_size() / bandwidth * 1e6
    length = f"{ctx // 1024}K" if ctx % 1024 == 0 else str(ctx)
    print(f"| {batch} | {length} | {name} | {floor:.1f} | {gpu['baseline']:.1f} | {gpu['paged']:.1f} | "
          f"{gpu['paged'] / gpu['baseline']:.2f} | {gpu['contiguous']:.1f} | {gpu['paged'] / gpu['contiguous']:.2f} | "
          f"{host['baseline']:.1f} | {host['paged']:.1f} | {host['paged'] / host['baseline']:.2f} | {error:.2g} |",
          flush=True)
    return error


if __name__ == "__main__":
    raise SystemExit(main())
