"""GPU time of alspec-vllm's CUDA verifier (kernels/triton_verify.py: A~ read in place from vLLM's paged cache, then
d, n, the decision and the commit in torch) beside flash decoding over the same cache, on CUDA; no vLLM needed.

The cache is one layer's (num_blocks, Hkv, N, 2D) view as vLLM 0.32 allocates it, keys and values in the last
dimension, in NHD memory (``KVCacheLayout.LBNHC``, vLLM's default for FlashAttention and Triton: a permuted view) or
HND memory (``LBHNC``); each request's blocks shuffled over it. Llama-3-8B heads (32/8, head_dim 128), bfloat16, one
decode row per request at the cache's end, the sink's ranges (S = --window). Baseline: exact decode attention alone,
``flash_attn.flash_attn_with_kvcache`` over the paged cache where flash-attn is installed and takes the layout,
else flash SDPA over a contiguous copy (gathered once, the gather not timed). GPU time per call: a CUDA graph of
``--graph-calls`` calls replayed and timed with CUDA events, candidates interleaved round by round, medians; host
time per call: calls back to back, no synchronisation; microseconds. Every row's A~ is checked against a float64
reference over the same keys (the last column); the script exits 1 where it differs by more than bfloat16 rounding.

    python benchmarks/bench_paged_verify.py [--rounds 5] [--batches 1,8] [--contexts 4096,131072] [--layouts nhd,hnd]
"""

from __future__ import annotations

import argparse
import sys


def ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",")]


LAYOUTS = {"nhd": "BNHC", "hnd": "BHNC"}  # memory order of the per-layer view's axes (LBNHC, LBHNC)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--window", type=int, default=64, help="S, tokens per sink window (default 64)")
    p.add_argument("--block-size", type=int, default=16, help="positions per cache block (default 16)")
    p.add_argument("--batches", type=ints, default=[1, 8], help="batch sizes (default 1,8)")
    p.add_argument("--contexts", type=ints, default=[4096, 16384, 65536, 131072],
                   help="context lengths (default 4K, 16K, 64K, 128K)")
    p.add_argument("--layouts", type=lambda t: t.split(","), default=list(LAYOUTS),
                   help="cache layouts, of nhd (LBNHC) and hnd (LBHNC) (default both)")
    p.add_argument("--rounds", type=int, default=11, help="interleaved rounds per figure (default 11)")
    p.add_argument("--graph-calls", type=int, default=50, help="calls per CUDA graph (default 50)")
    p.add_argument("--host-calls", type=int, default=200, help="calls per host-time round (default 200)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    unknown = [name for name in args.layouts if name not in LAYOUTS]
    if unknown:
        print(f"bench_paged_verify.py: unknown layout {unknown[0]!r}; use nhd, hnd or both (--layouts nhd,hnd)",
              file=sys.stderr)
        return 2
    import torch  # after the arguments: --help answers without loading torch

    if not torch.cuda.is_available():
        print("bench_paged_verify.py: no CUDA device (torch.cuda.is_available() is False): it times CUDA kernels "
              "only, nothing was measured", file=sys.stderr)
        return 1
    return cuda_main(args)


HQ, HKV, DIM = 32, 8, 128  # Llama-3-8B's heads
AGREE = 2e-2  # the largest difference of A~ from the float64 reference, relative to its largest element (bfloat16)


def cuda_main(args: argparse.Namespace) -> int:
    import torch
    from bench_kernels import _copy_bandwidth

    bandwidth = _copy_bandwidth()
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, bfloat16, {HQ}/{HKV} heads, d {DIM}, block "
          f"size {args.block_size}, S={args.window}, copy bandwidth {bandwidth / 1e12:.2f} TB/s; microseconds per "
          f"call; gpu = CUDA graph of {args.graph_calls} calls, median of {args.rounds} interleaved rounds; host = "
          f"{args.host_calls} calls back to back; A~ = the Triton verifier's kernel, verify = A~, d, n, the decision "
          "and the commit; baseline: flash decoding of A over the same cache", flush=True)
    print("| layout | B | L | baseline | baseline gpu | A~ gpu | verify gpu | verify/baseline | baseline host | "
          "verify host | max abs(A~ - float64) / max abs(float64) |")
    print("|" + " --- |" * 11, flush=True)
    worst = 0.0
    for layout in args.layouts:
        for batch in args.batches:
            for ctx in args.contexts:
                worst = max(worst, measure(args, layout, batch, ctx))
                torch.cuda.empty_cache()
    if worst > AGREE:
        print(f"bench_paged_verify.py: A~ differs from the float64 reference by {worst:.2g} of its largest element "
              f"(more than {AGREE})", file=sys.stderr)
        return 1
    return 0


def measure(args: argparse.Namespace, layout: str, batch: int, ctx: int) -> float:
    """Print one shape's row; return how far A~ is from the float64 reference."""
    import statistics

    import torch
    from bench_kernels import _host_us, _interleaved
    from bench_paged_kernel import baseline

    from alspec_eval import semantics
    from alspec_eval.kernels.triton_verify import paged_approximation

    size, blocks = args.block_size, -(-ctx // args.block_size)
    generator = torch.Generator(device="cuda").manual_seed(0)
    order = LAYOUTS[layout]
    sizes = {"B": batch * blocks, "H": HKV, "N": size, "C": 2 * DIM}
    memory = torch.randn([sizes[a] for a in order], device="cuda", dtype=torch.bfloat16, generator=generator)
    cache = memory.permute([order.index(a) for a in "BHNC"])  # (blocks, Hkv, N, 2D), the layout's strides
    keys, values = cache[..., :DIM], cache[..., DIM:]
    table = torch.randperm(batch * blocks, device="cuda", generator=generator).view(batch, blocks).int()
    query = torch.randn(batch, HQ, DIM, device="cuda", dtype=torch.bfloat16, generator=generator)
    exact = torch.randn(batch, HQ, DIM, device="cuda", dtype=torch.bfloat16, generator=generator)  # A, as vLLM wrote
    pos = torch.full((batch,), ctx - 1, device="cuda")
    rows = torch.arange(batch, device="cuda")
    starts, ends = semantics.window_ranges(pos, args.window, 1)
    scale = DIM ** -0.5

    def approximate() -> torch.Tensor:
        return paged_approximation(query, keys, values, table, rows, rows, pos, starts, ends, scale)

    def verify() -> torch.Tensor:
        approx = approximate()
        d2, n2 = semantics.squared_distances(approx, exact)
        accepted = semantics.accept(d2.sqrt(), n2.sqrt(), 0.1)
        exact.copy_(semantics.commit(exact, approx, accepted))  # in place, as verify_layer commits into vLLM's output
        return accepted

    k_flat, v_flat = ((h.transpose(1, 2)[table.long()].flatten(1, 2)[:, :ctx].transpose(1, 2).contiguous())
                      for h in (keys, values))  # (B, Hkv, L, D)
    seqlens = torch.full((batch,), ctx, device="cuda", dtype=torch.int32)
    name, exact_call, _ = baseline(query, keys.transpose(1, 2), values.transpose(1, 2), table, seqlens, k_flat,
                                   v_flat)
    error = reference_error(approximate(), query, k_flat, v_flat, args.window, ctx, scale)
    fns = {"baseline": exact_call, "approx": approximate, "verify": verify}
    gpu = _interleaved(fns, args.graph_calls, args.rounds)
    host = {n: statistics.median(_host_us(fns[n], args.host_calls) for _ in range(args.rounds))
            for n in ("baseline", "verify")}
    length = f"{ctx // 1024}K" if ctx % 1024 == 0 else str(ctx)
    print(f"| {layout} | {batch} | {length} | {name} | {gpu['baseline']:.1f} | {gpu['approx']:.1f} | "
          f"{gpu['verify']:.1f} | {gpu['verify'] / gpu['baseline']:.2f} | {host['baseline']:.1f} | "
          f"{host['verify']:.1f} | {error:.2g} |", flush=True)
    return error


def reference_error(approx, query, k_flat, v_flat, window: int, ctx: int, scale: float) -> float:
    """A~ in float64 over the first and last S keys of each row (its own arithmetic, not the kernel's)."""
    import torch

    listed = torch.cat([torch.arange(window), torch.arange(ctx - window, ctx)]).cuda()
    keys, values = k_flat[:, :, listed].double(), v_flat[:, :, listed].double()
    group = query.shape[1] // keys.shape[1]
    q = query.double().view(query.shape[0], keys.shape[1], group, -1)
    weights = torch.softmax(q @ keys.transpose(-1, -2) * scale, -1)
    want = (weights @ values).reshape(approx.shape)
    return ((approx.double() - want).abs().max() / want.abs().max()).item()


if __name__ == "__main__":
    raise SystemExit(main())
