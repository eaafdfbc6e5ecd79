"""alspec-vllm's CPU kernels for drafts that select by content, against the torch ops they replace, on a synthetic
CPU_ATTN cache (SmolLM2's heads: 9 query and 3 KV heads of 64 channels; blocks of 128 keys; float32; each request's
blocks shuffled over the cache), on one thread as vLLM's CPU worker runs them:

- ``listed``: A~, d^2 and n^2 of rows whose keys are listed per KV head (``native.verify_listed``) against the
  gathered path's torch ops (``paged.slots``, the layout's gather, ``semantics.attend``,
  ``semantics.squared_distances``): 4 decode rows of 2S keys scattered over the context or in one run, and a prefill
  of 96 rows a request whose keys come from a shared pool of 200 (its tiles copy the shared blocks once);
- ``scores``: top-k's key scores where the keys lie (``native.key_scores``) against reading the contexts
  (``paged.read_contexts``) and ``semantics.key_scores``;
- ``blocks``: a context's blocks in one pass (``native.read_blocks``) against torch's index_select and transposing
  copy.

Each pair is checked to agree (A~ and the scores to float32 rounding, the blocks bit for bit) before it is timed;
the script exits 1 where they differ. Each call starts with the caches flushed, as a decode step finds a layer's KV
cache (``bench_kernels.median_ms``); medians of interleaved rounds, milliseconds per call, and the ratio of torch's
time to the kernel's.

    python benchmarks/bench_listed_cpu.py [--rounds 30] [--context 4096] [--window 64]
"""

from __future__ import annotations

import argparse
import sys

HEADS, KV_HEADS, DIM, BLOCK = 9, 3, 64, 128


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=30, help="interleaved rounds per figure (default 30)")
    p.add_argument("--context", type=int, default=4096, help="keys in each request's context (default 4096)")
    p.add_argument("--window", type=int, default=64, help="S: each row lists 2S keys per KV head (default 64)")
    p.add_argument("--requests", type=int, default=4, help="requests (decode rows) in the step (default 4)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    import torch
    from bench_kernels import median_ms

    from alspec_eval import semantics
    from alspec_eval.vllm import native
    from alspec_eval.vllm.paged import CpuVecLayout, read_contexts, slots

    if native.library() is None:
        print("no C compiler built the CPU kernel: nothing to compare", file=sys.stderr)
        return 1
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    requests, length, keep = args.requests, args.context, 2 * args.window
    per_request = -(-length // BLOCK)
    cache = torch.randn(requests * per_request + 8, KV_HEADS, BLOCK, 2 * DIM, generator=g)
    table = torch.randperm(len(cache), generator=g)[:requests * per_request].view(requests, per_request).int()
    layout, scratch, failed = CpuVecLayout(), native.Scratch(), False

    def cases() -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """Per case, each row's request and its listed positions (rows, Hkv, 2S)."""
        rows = torch.arange(requests)
        scattered = torch.stack([torch.randperm(length, generator=g)[:keep].sort().values
                                 for _ in range(requests * KV_HEADS)]).view(requests, KV_HEADS, keep)
        run = torch.arange(keep) + torch.randint(0, length - keep, (requests, KV_HEADS, 1), generator=g)
        pool = torch.stack([torch.randperm(length, generator=g)[:200] for _ in range(requests * KV_HEADS)])
        pool = pool.view(requests, KV_HEADS, 200)
        prefill = rows.repeat_interleave(96)
        picked = torch.stack([pool[r][:, torch.randperm(200, generator=g)[:keep]] for r in prefill.tolist()])
        return {"4 decode rows, scattered keys": (rows, scattered), "4 decode rows, one run": (rows, run),
                f"{len(prefill)} prefill rows, shared keys": (prefill, picked)}

    print(f"CPU_ATTN cache: {requests} requests of {length} keys, {HEADS}/{KV_HEADS} heads of {DIM}, blocks of "
          f"{BLOCK}, float32, one thread, caches flushed before each call; medians of {args.rounds} interleaved "
          "rounds, ms per call")
    print(f"{'case':44s} {'torch':>9s} {'C':>9s} {'torch/C':>8s}")
    for name, (request, positions) in cases().items():
        count = len(request)
        query, exact = torch.randn(count, HEADS, DIM, generator=g), torch.randn(count, HEADS, DIM, generator=g)
        token = torch.arange(count)
        listed = native.Listed(token, request, token, positions, None, None)

        def torch_way() -> torch.Tensor:
            block, offset = slots(table, request[:, None, None], positions, BLOCK)
            keys, values = layout.gather(cache, block, offset)
            approx = semantics.attend(query[:, None], keys, values, None, DIM ** -0.5)[:, 0]
            return approx, *semantics.squared_distances(approx, exact)

        def kernel() -> tuple[torch.Tensor, ...]:
            return native.verify_listed(query, exact, cache, table, listed, DIM ** -0.5, scratch)

        failed |= not all(torch.allclose(a, b, rtol=1e-4, atol=1e-5) for a, b in zip(torch_way(), kernel()))
        t = median_ms({"torch": torch_way, "C": kernel}, args.rounds)
        print(f"{'listed: ' + name:44s} {t['torch']:9.3f} {t['C']:9.3f} {t['torch'] / t['C']:7.2f}x")

    request, pos = torch.arange(requests), torch.full((requests,), length - 1)
    query = torch.randn(requests, HEADS, DIM, generator=g)

    def scores_by_torch() -> torch.Tensor:
        keys, _, _ = read_contexts(cache, layout, table, BLOCK, request, pos + 1, values=False)
        return semantics.key_scores(query, keys)

    def scores_in_place() -> torch.Tensor:
        return native.key_scores(cache, table, query, request, pos, length)

    failed |= not torch.allclose(scores_by_torch(), scores_in_place(), rtol=1e-5, atol=1e-4)
    t = median_ms({"torch": scores_by_torch, "C": scores_in_place}, args.rounds)
    print(f"{'scores: top-k, 4 decode rows':44s} {t['torch']:9.3f} {t['C']:9.3f} {t['torch'] / t['C']:7.2f}x")

    ids = table.long()
    failed |= not all(torch.equal(a, b) for a, b in zip(layout.blocks(cache, ids), layout.blocks_by_torch(cache, ids)))
    t = median_ms({"torch": lambda: layout.blocks_by_torch(cache, ids), "C": lambda: native.read_blocks(cache, ids)},
                  args.rounds)
    print(f"{'blocks: keys and values of 4 contexts':44s} {t['torch']:9.3f} {t['C']:9.3f} {t['torch'] / t['C']:7.2f}x")
    if failed:
        print("a kernel disagreed with torch's ops", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
