"""CPU time of the speculative flash decode reference against exact decode attention alone.

The speculative kernel returns the exact output, the approximation and the verdict; the claim is that this
costs next to nothing over the exact attention alone. The baseline an expert picks on the CPU is grouped-query
SDPA over the uncopied KV cache: the query viewed as (B, Hkv, G, D), so each KV head's keys serve its G query
heads as rows ("grouped"); plain SDPA with enable_gqa=True is the second column. Timings interleave the
candidates round by round (the machine is shared and noisy) and report medians.

    python benchmarks/bench_kernels.py [--threads 1] [--dtype bfloat16] [--rounds 200]

On CUDA (``--device cuda``, bfloat16, Llama-3-8B heads, batch 1 and 8, 2K to 128K keys) the candidates are flash
and cuDNN SDPA on the grouped query, and the Triton speculative call; each is timed for GPU time alone (a CUDA graph
of its calls, replayed), per kernel (torch.profiler) and for host time per call (back-to-back calls, no
synchronisation: what a host-bound decode pays); the floor is K and V read once at the bandwidth of a large
device-to-device copy measured in the same run. A markdown table, a line per shape as it is measured.

    python benchmarks/bench_kernels.py --device cuda [--rounds 5] [--batches 1,8] [--contexts 2048,131072]
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Callable

import torch
import torch.nn.functional as F

from alspec_eval.kernels import speculative_flash_decode, torch_kernel
from alspec_eval.kernels.triton_launch import Launch

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
    """Per call of the Triton speculative decode beside flash and cuDNN SDPA on the grouped view (exact attention
    alone), Llama-3-8B heads, bfloat16: GPU-only time (a CUDA graph of ``--graph-calls`` calls replayed, CUDA
    events), GPU time per kernel (torch.profiler), host time per call (back-to-back calls, no synchronisation), and
    the floor (K and V read once at the copy bandwidth measured in the same run). Rounds interleave the candidates;
    figures are medians. The table comes first and line by line, so that a run cut short still returns it."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.profiler import ProfilerActivity, profile

    from alspec_eval.kernels.triton_decode import prepare, speculative_flash_decode_triton

    hq, hkv, dim = 32, 8, 128
    bandwidth = _copy_bandwidth()
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, bfloat16, {hq}/{hkv} heads, d {dim}, "
          f"1 query token, S={args.window}, copy bandwidth {bandwidth / 1e12:.2f} TB/s; microseconds per call; "
          f"gpu = CUDA graph of {args.graph_calls} calls; host = {args.host_calls} calls back to back; "
          "kernels = torch.profiler per kernel", flush=True)
    print("| B | L | floor | flash gpu | cudnn gpu | triton gpu | triton/flash | triton kernels | flash host | "
          "triton host | host triton/flash |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |", flush=True)
    for batch in args.batches:
        for ctx in args.contexts:
            q = torch.randn(batch, hq, dim, dtype=torch.bfloat16, device="cuda")
            k, v = (torch.randn(batch, hkv, ctx, dim, dtype=torch.bfloat16, device="cuda") for _ in range(2))
            cur_pos = torch.full((batch,), ctx - 1, device="cuda")
            start = torch.zeros(batch, dtype=torch.long, device="cuda")
            geometry = prepare(cur_pos, args.window, 1, start)  # once per decode pass, as the adapter passes it
            grouped = q.view(batch, hkv, hq // hkv, dim)

            def sdpa(backend: SDPBackend) -> Callable[[], object]:
                def run() -> object:
                    with sdpa_kernel(backend):
                        return F.scaled_dot_product_attention(grouped, k, v)
                return run

            fns = {"flash": sdpa(SDPBackend.FLASH_ATTENTION), "cudnn": sdpa(SDPBackend.CUDNN_ATTENTION),
                   "triton": lambda: speculative_flash_decode_triton(q, k, v, cur_pos, args.window, 0.1,
                                                                     start=start, geometry=geometry)}
            fns = {name: fn for name, fn in fns.items() if _runs(name, fn)}
            gpu = _interleaved(fns, args.graph_calls, args.rounds)
            host = {name: statistics.median(_host_us(fn, args.host_calls) for _ in range(args.rounds))
                    for name, fn in fns.items() if name != "cudnn"}
            kernels = _kernel_us(fns["triton"], 20, ProfilerActivity, profile)
            floor = 2 * k.numel() * k.element_size() / bandwidth * 1e6
            cell = {name: f"{gpu[name]:.1f}" if name in gpu else "-" for name in ("flash", "cudnn", "triton")}
            print(f"| {batch} | {ctx // 1024}K | {floor:.1f} | {cell['flash']} | {cell['cudnn']} | {cell['triton']} | "
                  f"{gpu['triton'] / gpu['flash']:.2f} | {', '.join(f'{n} {t:.1f}' for n, t in kernels.items())} | "
                  f"{host['flash']:.1f} | {host['triton']:.1f} | {host['triton'] / host['flash']:.2f} |", flush=True)
            torch.cuda.empty_cache()  # the next shape's cache where this one's was


def _constexpr_kernel():
    """The decode kernel with the group compiled in too (a binary per group), to measure what making it a runtime
    value costs."""
    import importlib.util
    import inspect
    import tempfile

    from alspec_eval.kernels import triton_source

    text = inspect.getsource(triton_source)
    text = text.replace('"NUM_SPLITS", "GROUP", "LAM_PER_ROW"', '"NUM_SPLITS", "LAM_PER_ROW"')
    text = text.replace("NUM_SPLITS, GROUP, LAM_PER_ROW,", "NUM_SPLITS, GROUP: tl.constexpr, LAM_PER_ROW,")
    assert "GROUP: tl.constexpr" in text
    path = tempfile.mkdtemp() + "/constexpr_source.py"
    with open(path, "w") as f:
        f.write(text)
    spec = importlib.util.spec_from_file_location("constexpr_source", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.decode_kernel


EXPLORE = [  # (BLOCK_N, stages, warps), split blocks, split waves
    ((64, 3, 4), 1, 2), ((64, 3, 4), 4, 2), ((64, 3, 4), 8, 2), ((64, 3, 8), 4, 2), ((128, 2, 8), 4, 2),
]


def explore_main(args: argparse.Namespace) -> None:
    """GPU-only time of the Triton call under other launch settings and split sizes, with the group a runtime value
    (rt, as shipped) or compiled in (ce), as a ratio to flash SDPA in the same rounds (the shapes of
    :func:`cuda_main`): where the chosen settings are measured, not guessed."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from alspec_eval.kernels import triton_decode, triton_launch

    hq, hkv, dim = 32, 8, 128
    kernels = {"rt": triton_launch.kernel(), "ce": _constexpr_kernel()}
    variants = [(name, Launch(*launch), blocks, waves) for name in kernels for launch, blocks, waves in EXPLORE]
    print(f"{torch.cuda.get_device_name()}: the Triton call's GPU time / flash SDPA's (CUDA graph of "
          f"{args.graph_calls} calls, medians of {args.rounds} rounds); variant = kernel BLOCK_N,stages,warps "
          "/ split blocks / split waves")
    print("| B | L | flash gpu | " + " | ".join(f"{name} {lc.block_n},{lc.num_stages},{lc.num_warps}/{nb}/{nw}"
                                              for name, lc, nb, nw in variants) + " |")
    print("|" + " --- |" * (3 + len(variants)), flush=True)
    for batch in args.batches:
        for ctx in args.contexts:
            q = torch.randn(batch, hq, dim, dtype=torch.bfloat16, device="cuda")
            k, v = (torch.randn(batch, hkv, ctx, dim, dtype=torch.bfloat16, device="cuda") for _ in range(2))
            cur_pos = torch.full((batch,), ctx - 1, device="cuda")
            start = torch.zeros(batch, dtype=torch.long, device="cuda")
            geometry = triton_decode.prepare(cur_pos, args.window, 1, start)
            grouped = q.view(batch, hkv, hq // hkv, dim)

            def flash() -> object:
                with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                    return F.scaled_dot_product_attention(grouped, k, v)

            cells, flash_us = [], []
            for name, launch, blocks, waves in variants:
                triton_decode.kernel = lambda fn=kernels[name]: fn
                triton_decode.launch_for = lambda dtype, head_dim, launch=launch: launch
                triton_decode._static.cache_clear()
                triton_decode.SPLIT_BLOCKS, triton_decode.SPLIT_WAVES = blocks, waves

                def triton() -> object:
                    return triton_decode.speculative_flash_decode_triton(q, k, v, cur_pos, args.window, 0.1,
                                                                         start=start, geometry=geometry)
                if not _runs(f"{name} {launch}", triton):
                    cells.append("-")
                    continue
                gpu = _interleaved({"flash": flash, "triton": triton}, args.graph_calls, args.rounds)
                flash_us.append(gpu["flash"])
                cells.append(f"{gpu['triton'] / gpu['flash']:.2f}")
            print(f"| {batch} | {ctx // 1024}K | {statistics.median(flash_us or [0]):.1f} | " + " | ".join(cells)
                  + " |", flush=True)
            torch.cuda.empty_cache()
    triton_decode.kernel, triton_decode.launch_for = triton_launch.kernel, triton_launch.launch_for


def _copy_bandwidth() -> float:
    """Bytes read plus written per second by a large device-to-device copy."""
    src = torch.empty(2**28, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    return 2 * src.numel() / (_graph_us(lambda: dst.copy_(src), 5, 3) / 1e6)


def _runs(name: str, fn: Callable[[], object]) -> bool:
    try:
        fn()
        torch.cuda.synchronize()
        return True
    except RuntimeError as err:  # a backend this GPU or shape lacks (cuDNN's SDPA, for one)
        print(f"({name}: {str(err).splitlines()[0]})", flush=True)
        return False


def _graph(fn: Callable[[], object], calls: int) -> torch.cuda.CUDAGraph:
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    return graph


def _replay_us(graph: torch.cuda.CUDAGraph, calls: int) -> float:
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    begin.record()
    graph.replay()
    end.record()
    end.synchronize()
    return begin.elapsed_time(end) * 1e3 / calls


def _graph_us(fn: Callable[[], object], calls: int, rounds: int) -> float:
    graph = _graph(fn, calls)
    return statistics.median(_replay_us(graph, calls) for _ in range(rounds))


def _interleaved(fns: dict[str, Callable[[], object]], calls: int, rounds: int) -> dict[str, float]:
    """GPU-only microseconds per call of each function: its graph replayed, the candidates in interleaved rounds."""
    graphs = {name: _graph(fn, calls) for name, fn in fns.items()}
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(rounds):
        for name, graph in graphs.items():
            times[name].append(_replay_us(graph, calls))
    return {name: statistics.median(t) for name, t in times.items()}


def _host_us(fn: Callable[[], object], calls: int) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    took = time.perf_counter() - t0
    torch.cuda.synchronize()
    return took / calls * 1e6


def _kernel_us(fn: Callable[[], object], calls: int, activity, profile) -> dict[str, float]:
    """GPU microseconds per call of each kernel ``fn`` launches."""
    with profile(activities=[activity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    found = {}
    for event in prof.key_averages():
        took = getattr(event, "self_device_time_total", None) or getattr(event, "self_cuda_time_total", 0)
        if took > 0:
            found[event.key.split("(")[0][:24]] = took / calls
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--window", type=int, default=64, help="S, tokens per sink window")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--rounds", type=int, default=50)
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--batches", type=lambda t: [int(x) for x in t.split(",")], default=[1, 8],
                        help="CUDA: batch sizes (default 1,8)")
    parser.add_argument("--contexts", type=lambda t: [int(x) for x in t.split(",")],
                        default=[2048, 8192, 32768, 131072], help="CUDA: context lengths (default 2K, 8K, 32K, 128K)")
    parser.add_argument("--graph-calls", type=int, default=50, help="CUDA: calls per graph")
    parser.add_argument("--host-calls", type=int, default=200, help="CUDA: calls per host-time round")
    parser.add_argument("--explore", action="store_true",
                        help="CUDA: the Triton call's GPU time under the settings of EXPLORE, beside flash SDPA")
    args = parser.parse_args()
    if args.explore:
        explore_main(args)
        return
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
