"""Wall time of one layer's verification inside alspec-vllm, per draft, on a paged cache as vLLM's FlashAttention
backend holds it on a GPU, beside flash decoding of A over the same keys: what each draft costs a decode step where
users run the board (32K-128K tokens), without vLLM (its CUDA build cannot be installed beside this torch).

The cache is one layer's (num_blocks, Hkv, N, 2D) view in NHD memory (``KVCacheLayout.LBNHC``, a permuted view), each
request's blocks shuffled over it; Llama-3-8B heads (32/8, head_dim 128), bfloat16 on CUDA (float32 with ``--device
cpu``, a dry run at small contexts), one decode row per request at the cache's end, lambda 0.1, S = ``--window``.
Each draft goes through the verifier the engine chooses for it (``verifiers.choose``: the Triton verifier for drafts
by position, the gathered path for drafts by content), with the page summaries a draft keeps (Quest's bounds,
Knorm's scores) made beforehand as the engine keeps them, and the step's plan built once, as at a step's first layer
(the figures are a step's other layers). Per call: wall time (the paths read flags back, so GPU time
alone would flatter them), calls synchronised, drafts interleaved round by round, medians; milliseconds.
SnapKV is left out: it needs its prompt observed at prefill.

    python benchmarks/bench_paged_drafts.py [--contexts 32768,131072] [--batches 1,8] [--rounds 3]
"""

from __future__ import annotations

import argparse
import sys

DRAFTS = {"sink": None, "quest": "page:16", "topk": None, "vattention": "epsilon:0.1;delta:0.1",
          "kvpress:KnormPress": None, "kvpress:KeyDiffPress": None, "kvpress:CURPress": None,
          "kvpress:LagKVPress": None, "kvpress:RandomPress": "seed:0", "kvpress:StreamingLLMPress": None}
HQ, HKV, DIM = 32, 8, 128  # Llama-3-8B's heads


def ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",")]


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--drafts", type=lambda t: t.split(","), default=list(DRAFTS),
                   help=f"drafts by name (default: {','.join(DRAFTS)})")
    p.add_argument("--window", type=int, default=64, help="S, tokens per sink window (default 64)")
    p.add_argument("--block-size", type=int, default=16, help="positions per cache block (default 16)")
    p.add_argument("--batches", type=ints, default=[1, 8], help="decode rows (default 1,8)")
    p.add_argument("--contexts", type=ints, default=[32768, 131072], help="context lengths (default 32K, 128K)")
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds (default 3)")
    p.add_argument("--calls", type=int, default=5, help="calls per draft and round (default 5)")
    p.add_argument("--device", default="cuda", help="cuda (default), or cpu for a dry run")
    p.add_argument("--profile", type=int, default=0, metavar="N",
                   help="after each shape, print each draft's N costliest host operations of one call (torch.profiler)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    unknown = [name for name in args.drafts if name not in DRAFTS]
    if unknown:
        print(f"bench_paged_drafts.py: unknown draft {unknown[0]!r}; use some of {','.join(DRAFTS)}", file=sys.stderr)
        return 2
    import torch  # after the arguments: --help answers without loading torch

    if args.device == "cuda" and not torch.cuda.is_available():
        print("bench_paged_drafts.py: no CUDA device (torch.cuda.is_available() is False); --device cpu runs a dry "
              "run, nothing was measured", file=sys.stderr)
        return 1
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    print(f"{torch.cuda.get_device_name() if device.type == 'cuda' else 'CPU'}, torch {torch.__version__}, "
          f"{str(dtype).removeprefix('torch.')}, {HQ}/{HKV} heads, d {DIM}, block size {args.block_size}, "
          f"S={args.window}, lambda 0.1, NHD cache; milliseconds of wall time per layer call, median of "
          f"{args.rounds} interleaved rounds of {args.calls} calls", flush=True)
    print("| B | L | flash decoding of A | " + " | ".join(args.drafts) + " |")
    print("|" + " --- |" * (3 + len(args.drafts)), flush=True)
    failed = False
    for batch in args.batches:
        for ctx in args.contexts:
            failed |= measure(args, device, dtype, batch, ctx)
            if device.type == "cuda":
                torch.cuda.empty_cache()
    return 1 if failed else 0


def measure(args: argparse.Namespace, device, dtype, batch: int, ctx: int) -> bool:
    """Print one shape's row (each draft: its wall time and verifier, or why it failed); True where one failed."""
    import statistics
    import time
    import traceback

    import torch

    from alspec_eval.approximations import make_approximation
    from alspec_eval.host_waits import host_waits
    from alspec_eval.vllm import kept
    from alspec_eval.vllm.paged import Settings, StepRows, layout_for
    from alspec_eval.vllm.verifiers import choose, verify_and_count

    size, blocks = args.block_size, -(-ctx // args.block_size)
    generator = torch.Generator(device=device).manual_seed(0)
    memory = torch.randn(batch * blocks, size, HKV, 2 * DIM, device=device, dtype=dtype, generator=generator)
    cache = memory.permute(0, 2, 1, 3)  # (blocks, Hkv, N, 2D) in NHD memory: what FlashAttention's forward gets
    table = torch.randperm(batch * blocks, device=device, generator=generator).view(batch, blocks).int()
    query = torch.randn(batch, HQ, DIM, device=device, dtype=dtype, generator=generator)
    exact = torch.randn(batch, HQ, DIM, device=device, dtype=dtype, generator=generator)
    layout = layout_for("FLASH_ATTN")
    scale = DIM ** -0.5

    def step() -> StepRows:
        return StepRows.build(torch.arange(batch + 1), torch.full((batch,), ctx), torch.zeros(batch, dtype=torch.long),
                              torch.arange(batch), seeds=torch.arange(batch) + 7)

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize()

    calls, names, failures = {}, {}, {}
    keys = cache[..., :DIM].transpose(1, 2)  # (blocks, N, Hkv, D) views, as flash decoding reads them
    values = cache[..., DIM:].transpose(1, 2)
    if device.type == "cuda":
        from bench_paged_kernel import baseline

        k_flat, v_flat = ((h[table.long()].flatten(1, 2)[:, :ctx].transpose(1, 2).contiguous())
                          for h in (keys, values))
        _, calls["flash"], _ = baseline(query, keys, values, table, torch.full((batch,), ctx, device=device,
                                                                                dtype=torch.int32), k_flat, v_flat)
    for name in args.drafts:
        try:
            approx = make_approximation(name, DRAFTS[name])
            settings = Settings(thresholds=(0.1,), window=args.window, window_align=1, approx=approx)
            verifier = choose(approx, layout, cache)
            summaries = kept.allocate(approx, cache, layout) if approx.kept_page() else None

            rows = step()  # one step: its plan built at the first call, as at a step's first layer, then reused

            def call(settings=settings, verifier=verifier, summaries=summaries, rows=rows) -> None:
                verify_and_count(query, exact.clone(), cache, layout, table, size, rows, settings, 0, scale,
                                 verifier=verifier, kept=summaries)

            call()
            sync()
            calls[name], names[name] = call, verifier.name
        except Exception as error:  # a draft that fails is reported in its cell, and the others still run
            failures[name] = f"{type(error).__name__}: {error}".splitlines()[0][:80]
            traceback.print_exc(limit=3, file=sys.stderr)
    times: dict[str, list[float]] = {name: [] for name in calls}
    for _ in range(args.rounds):
        for name, fn in calls.items():
            sync()
            start = time.perf_counter()
            for _ in range(args.calls):
                fn()
            sync()
            times[name].append((time.perf_counter() - start) / args.calls * 1e3)
    median = {name: statistics.median(t) for name, t in times.items()}
    syncs = {name: len(host_waits(calls[name])) for name in names} if device.type == "cuda" else {}
    flash = f"{median['flash']:.3f}" if "flash" in median else "-"
    cells = [f"failed ({failures[n]})" if n in failures else
             f"{median[n]:.2f} ({names[n]}" + (f", {syncs[n]} syncs)" if n in syncs else ")") for n in args.drafts]
    length = f"{ctx // 1024}K" if ctx % 1024 == 0 else str(ctx)
    print(f"| {batch} | {length} | {flash} | " + " | ".join(cells) + " |", flush=True)
    if args.profile:
        for name in names:
            print(f"{name} at B {batch}, L {length}: the {args.profile} costliest host operations of one call")
            print(host_profile(calls[name], args.profile), flush=True)
    return bool(failures)


def host_profile(fn, rows: int) -> str:
    """One call's host operations by their own CPU time: where a host-bound verification spends it."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    return prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=rows)


if __name__ == "__main__":
    sys.exit(main())
