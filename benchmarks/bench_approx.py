"""Simulation time of each approximation of A~ (model_arg ``approx=``, every registered one) against ``approx=sink``.

One resident model per runner: ``--model alspec`` with each approximation (``--approx``, default every registered
one; quest's pages of 16 tokens unless ``--approx_args`` says otherwise), plus the stock ``--model hf`` as the floor. All at lambda 0.1, window 64, batch size 1, on prompts of
about ``--tokens`` tokens cut from the bundled haystack (as ``bench_adapter.py`` cuts them). Two workloads, each
through lm-eval's own request methods:

1. generation: ``generate_until``, ``--new-tokens`` new tokens per prompt (no stop sequence);
2. teacher forcing: ``loglikelihood`` of each prompt's last ``--continuation`` tokens given the rest (every
   continuation position speculates).

Runs are interleaved in rounds (each round runs hf and every approximation on both workloads) and the medians over
``--repeats`` rounds are compared. Prints, per runner, the median seconds of each workload, its ratio to sink and
to hf, and alspec's hit rate; with the torch thread count, the device and the shape. Every alspec runner uses the
same ``--kernel`` (default ``model``: only the sink has a fused kernel, so sink runs on the same path as the others
and only the choice of A~'s keys differs).

Defaults: 2 prompts of 1024 tokens, 32 new tokens, 256-token continuations, 3 rounds, torch's own thread
count; sized for about 4 minutes with SmolLM2 in float32 on an idle 2-core CPU (an estimate from the README's
idle decode speeds; on 2 cores shared with other jobs it took 35 minutes, where ``--threads 1`` may fare better).

The model: the embedded SmolLM2-135M (``--shape smollm2``), or a Llama-3-8B shape with random weights in bfloat16
(``--shape llama3-8b``, built as in ``bench_adapter.py``; ``--layers`` shrinks it for a smoke run).

    python benchmarks/bench_approx.py [--prompts 2] [--repeats 3] [--tokens 1024] [--new-tokens 32] \
        [--continuation 256] [--approx sink,local,quest,topk] [--approx_args quest=page:16] [--threads N] \
        [--shape smollm2|llama3-8b] [--device cpu|cuda]
"""

from __future__ import annotations

import argparse
import statistics
import time

def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3, help="interleaved rounds; medians over them")
    parser.add_argument("--tokens", type=int, default=1024, help="prompt length in tokens (about)")
    parser.add_argument("--new-tokens", type=int, default=32, help="generation: new tokens per prompt")
    parser.add_argument("--continuation", type=int, default=256,
                        help="teacher forcing: the prompt's last tokens scored as the continuation")
    parser.add_argument("--approx", default=None, help="approximations to time (default: every registered one)")
    parser.add_argument("--approx_args", action="append", default=["quest=page:16"], metavar="NAME=ARGS",
                        help="one approximation's parameters at window 64, e.g. quest=page:16 (repeat per name)")
    parser.add_argument("--kernel", choices=["model", "auto"], default="model",
                        help="alspec's decode kernel for every approximation (quest and topk take model or auto)")
    parser.add_argument("--device", default=None, help="default: cuda where available, else cpu")
    parser.add_argument("--shape", choices=["smollm2", "llama3-8b"], default="smollm2")
    parser.add_argument("--layers", type=int, default=None, help="llama3-8b only: fewer layers, for a smoke run")
    parser.add_argument("--dtype", default="float32", help="smollm2's dtype, e.g. bfloat16 on CUDA")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch's CPU threads (default: torch's own; 1 may fare better on a shared CPU)")
    args = parser.parse_args()
    if args.continuation >= args.tokens:
        parser.error(f"--continuation {args.continuation} must be shorter than --tokens {args.tokens}")

    import torch
    from lm_eval.api.instance import Instance
    from lm_eval.models.huggingface import HFLM

    from alspec_eval.adapter import ALSpecLM
    from alspec_eval.approximations import make_approximation, names as registered
    from alspec_eval.smollm2 import smollm2_path
    from bench_adapter import llama3_8b, prompts, requests

    if args.threads:
        torch.set_num_threads(args.threads)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    path = str(smollm2_path())  # its tokenizer serves the random model too (its ids are within 128256)
    given = dict(item.split("=", 1) for item in args.approx_args)
    approximations = {name: make_approximation(name, given.get(name))
                      for name in (args.approx.split(",") if args.approx else registered())}
    names = ["hf", *approximations]
    dtype = "bfloat16" if args.shape == "llama3-8b" else args.dtype
    # one resident model per runner (alspec's hooks stay on theirs), so hf runs the plain model
    instances = {name: llama3_8b(device, args.layers) for name in names} if args.shape == "llama3-8b" else {}
    models: dict[str, HFLM] = {}
    for name in names:
        common = ({"pretrained": instances[name], "tokenizer": path} if instances else
                  {"pretrained": path, "dtype": dtype}) | {"device": device, "batch_size": 1}
        spec = {"lambda": 0.1, "window": 64, "kernel": args.kernel, "approx": approximations.get(name)}
        models[name] = HFLM(**common) if name == "hf" else ALSpecLM(**common, **spec)

    tokenizer = models["hf"].tokenizer
    texts = prompts(tokenizer, args.prompts, args.tokens)
    pairs = []  # (context, continuation): the continuation is the prompt's last --continuation tokens
    for text in texts:
        ids = tokenizer(text)["input_ids"]
        pairs.append((tokenizer.decode(ids[:-args.continuation]), tokenizer.decode(ids[-args.continuation:])))
    gen_kwargs = {"until": [], "max_gen_toks": args.new_tokens, "do_sample": False}

    # fresh instances per call (alspec's ledger logs its statistics into each request's arguments); each workload
    # is its own task in alspec's statistics (the hit rates printed)
    def generated() -> list[Instance]:
        return [Instance("generate_until", {}, (t, dict(gen_kwargs)), i, ("generate", i, 1))
                for i, t in enumerate(texts)]

    def scored() -> list[Instance]:
        return [Instance("loglikelihood", {}, pair, i, ("teacher", i, 1)) for i, pair in enumerate(pairs)]

    def clock(lm: HFLM, method, batch: list[Instance]) -> float:
        if lm.device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        method(batch, disable_tqdm=True)
        if lm.device.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - start

    workloads = {"generate": lambda lm: clock(lm, lm.generate_until, generated()),
                 "teacher": lambda lm: clock(lm, lm.loglikelihood, scored())}
    warm = prompts(tokenizer, 1, 4 * 64)  # past 2S = 128 tokens, so it speculates
    for lm in models.values():  # warm-up, not timed (its statistics go to task "bench")
        lm.generate_until(requests(warm, 4), disable_tqdm=True)
        lm.loglikelihood([Instance("loglikelihood", {}, (warm[0][:-200], warm[0][-200:]), 0, ("bench", 0, 1))],
                         disable_tqdm=True)
    times: dict[str, dict[str, list[float]]] = {name: {w: [] for w in workloads} for name in names}
    for _ in range(args.repeats):  # interleaved rounds
        for workload, run in workloads.items():
            for name in names:
                times[name][workload].append(run(models[name]))
    med = {name: {w: statistics.median(t) for w, t in ws.items()} for name, ws in times.items()}

    gpu = f" ({torch.cuda.get_device_name()})" if device == "cuda" else ""
    print(f"device={device}{gpu} threads={torch.get_num_threads()} torch {torch.__version__} shape={args.shape}"
          f"{f' layers={args.layers}' if args.layers else ''} dtype={dtype} kernel={args.kernel} lambda=0.1 "
          f"window=64 batch=1")
    print(f"prompts={args.prompts}x{args.tokens} tokens; generate: {args.new_tokens} new tokens; teacher: "
          f"loglikelihood of the last {args.continuation} tokens; medians of {args.repeats} interleaved rounds")
    head = f"{'runner':14s} | {'generate s':>10s} {'/sink':>6s} {'/hf':>6s} {'hit':>6s} | " \
           f"{'teacher s':>10s} {'/sink':>6s} {'/hf':>6s} {'hit':>6s}"
    print(head)
    print("-" * len(head))
    for name in names:
        label = "hf" if name == "hf" else approximations[name].label
        hits = {}
        if name != "hf":
            tasks = models[name].statistics()["tasks"]
            hits = {w: tasks[w]["total"]["hit_rate"] for w in workloads}
        cells = []
        for w in workloads:
            hit = f"{hits[w]:6.3f}" if hits else f"{'-':>6s}"
            cells.append(f"{med[name][w]:10.2f} {med[name][w] / med['sink'][w]:6.3f} "
                         f"{med[name][w] / med['hf'][w]:6.3f} {hit}")
        print(f"{label:14s} | " + " | ".join(cells))
    print("runs (s):")
    for name in names:
        print(f"  {name:6s} " + "  ".join(f"{w} {[round(t, 2) for t in times[name][w]]}" for w in workloads))


if __name__ == "__main__":
    main()
