"""alspec-vllm against the strongest fair baselines: plain vLLM with the same engine arguments, and `--model alspec`.

1. Generation: `--model alspec-vllm` (lambda 0.1, window 64) against lm-eval's own `--model vllm`, both engines resident,
   rounds interleaved, medians compared: wall time and generated tokens per second of one generate_until call.
2. A whole lm-eval run of one small task: `lm_eval --model alspec-vllm` against `lm_eval --model alspec` (hf), each a
   fresh command (the engine start included), with the score and the per-layer hit rates of both (the engines' own
   numerics differ, so these are measured, not asserted equal).

3. `--drafts`: every draft that runs inside vLLM (the sink, local, quest, topk, snapkv, kvpress's key-only presses)
   against plain vLLM on the same requests at 2K and 4K tokens of context (prompt and new tokens), one alspec-vllm
   engine reconfigured per draft, rounds interleaved over plain vLLM and every draft, medians compared.

4. `--windows`: the cost of verification at each window, generation and rolling loglikelihood (every position
   speculates), alspec-vllm (the sink, lambda 0.1) over plain vLLM and over the same alspec-vllm engine with
   speculation off (policy=exact: the same process, so that what differs between two engine processes, up to 10% on a
   2-core VM, drops out of that ratio), rounds interleaved, medians compared; with each
   engine process's peak RSS during the calls (its high-water mark reset before each) and A~'s share of A's key
   reads (2S over the context: where it nears 1, A~ costs another A).

5. `--records`: what reading the decisions back costs at scale: 2,000 requests of 64 generated tokens on a tiny
   random Llama of 30 layers (SmolLM2's depth), the engine call's wall against the time inside vLLM's generate (the
   rest: the workers' packed decisions taken and every request's record built).

6. `--memory`: peak RSS alone: each engine (plain vLLM, alspec-vllm at each window) in a fresh process of its own
   (vLLM in-process, `VLLM_ENABLE_V1_MULTIPROCESSING=0`, so that one process holds the engine), one rolling
   loglikelihood call to warm it, its high-water mark reset, then the measured call; rounds interleaved, medians
   compared, with plain vLLM's own spread (the allocator's) beside them.

Run it in .venv-vllm (scripts/vllm_env.sh); `--model alspec` runs in the same environment.

    python benchmarks/bench_vllm.py [--prompts 8] [--tokens 1024] [--new 64] [--rounds 5] [--task alspec_recall]
    python benchmarks/bench_vllm.py --windows 16,64,256,1024 [--prompts 8] [--tokens 1024] [--new 64] \
        [--documents 4] [--document-tokens 3500] [--rounds 3]
    python benchmarks/bench_vllm.py --memory 64,1024 [--documents 4] [--document-tokens 3500] [--rounds 3]
    python benchmarks/bench_vllm.py --records [--requests 2000] [--new 64]
    python benchmarks/bench_vllm.py --drafts [--contexts 2048,4096] [--prompts 4] [--new 32] [--rounds 3] [--approx quest,topk]
    ALSPEC_VLLM_CHECK_LAYOUT=1 python benchmarks/bench_vllm.py --skip engines --dtype bfloat16 --graphs \
        --attention-backend FLASH_ATTN      # on CUDA (scripts/gpu_check.sh): the layout read back at every step
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from importlib import resources
from pathlib import Path

ENGINE = {"dtype": "float32", "enforce_eager": True, "kv_cache_memory_bytes": 512 * 2**20, "seed": 0,
          "max_model_len": 4096}


def prompts(tokenizer, count: int, tokens: int) -> list[str]:
    haystack = (resources.files("alspec_eval") / "data" / "haystack.txt").read_text(encoding="utf-8")
    ids = tokenizer(haystack)["input_ids"]
    step = len(ids) // count
    return [tokenizer.decode(ids[i * step:i * step + tokens]) for i in range(count)]


def engine_args(args: argparse.Namespace) -> dict:
    """The engine arguments both engines get: ENGINE, with the command line's dtype, backend and graphs."""
    out = {**ENGINE, "dtype": args.dtype}
    if args.graphs:
        out.pop("enforce_eager")
    if args.attention_backend:
        out["attention_backend"] = args.attention_backend
    return out


def generation(args: argparse.Namespace) -> None:
    from lm_eval.api.instance import Instance

    from alspec_eval.compat import lm_eval_vllm
    from alspec_eval.smollm2 import smollm2_path
    from alspec_eval.vllm.model import ALSpecVLLM

    path = str(smollm2_path())
    plain = lm_eval_vllm().VLLM(pretrained=path, **engine_args(args))
    ours = ALSpecVLLM(path, window=64, **{"lambda": 0.1}, **engine_args(args))
    texts = prompts(plain.tokenizer, args.prompts, args.tokens)
    kwargs = {"until": [], "max_gen_toks": args.new, "do_sample": False}

    def timed(lm) -> tuple[float, int]:
        requests = [Instance("generate_until", {}, (t, dict(kwargs)), i, ("bench", i, 1)) for i, t in enumerate(texts)]
        start = time.perf_counter()
        out = lm.generate_until(requests, disable_tqdm=True)
        return time.perf_counter() - start, sum(len(lm.tok_encode(o)) for o in out)

    timed(plain), timed(ours)  # warm-up: first-call allocations and oneDNN's kernels
    walls: dict[str, list[float]] = {"vllm": [], "alspec-vllm": []}
    tokens: dict[str, list[int]] = {"vllm": [], "alspec-vllm": []}
    for _ in range(args.rounds):
        for name, lm in (("vllm", plain), ("alspec-vllm", ours)):
            wall, new = timed(lm)
            walls[name].append(wall)
            tokens[name].append(new)
    print(f"generation: {args.prompts} prompts of {args.tokens} tokens, {args.new} new tokens each, lambda 0.1, "
          f"window 64, SmolLM2 {args.dtype}, {ours.attention_backend}, medians of {args.rounds} interleaved rounds")
    for name in walls:
        wall = statistics.median(walls[name])
        print(f"  {name:12s} {wall:7.2f} s  {statistics.median(tokens[name]) / wall:7.1f} tokens/s")
    ratio = statistics.median(walls["alspec-vllm"]) / statistics.median(walls["vllm"])
    print(f"  alspec-vllm / vllm wall: {ratio:.3f}")
    hit = ours.statistics()["tasks"]["bench"]["total"]["hit_rate"]
    print(f"  alspec-vllm hit rate: {hit:.3f}")


# every draft that runs inside vLLM, with the arguments configs/ruler_vllm.yaml gives them
DRAFTS = {"sink": None, "local": None, "quest": "page:16", "topk": None, "snapkv": None, "kvpress:KnormPress": None,
          "kvpress:KeyDiffPress": None, "kvpress:CURPress": None, "kvpress:LagKVPress": None,
          "kvpress:RandomPress": "seed:0", "kvpress:StreamingLLMPress": None}


def drafts(args: argparse.Namespace) -> None:
    """Per draft and context, alspec-vllm's wall over plain vLLM's on the same requests (medians of interleaved
    rounds): what reading each row's context from the paged cache and selecting in PyTorch costs."""
    from lm_eval.api.instance import Instance

    from alspec_eval.compat import lm_eval_vllm
    from alspec_eval.smollm2 import smollm2_path
    from alspec_eval.vllm.model import ALSpecVLLM

    path, longest = str(smollm2_path()), max(args.contexts)
    # room in each engine's KV cache for every prompt at the longest context (SmolLM2 in float32: 30 layers, 3 KV
    # heads of 64, keys and values: 46,080 bytes a token), so that the prefix cache holds them across rounds
    engine = {**engine_args(args), "max_model_len": longest,
              "kv_cache_memory_bytes": max(ENGINE["kv_cache_memory_bytes"], 2 * args.prompts * longest * 46080)}
    plain = lm_eval_vllm().VLLM(pretrained=path, **engine)
    ours = ALSpecVLLM(path, window=64, **{"lambda": 0.1}, **engine)
    kwargs = {"until": [], "max_gen_toks": args.new, "do_sample": False, "ignore_eos": True}
    print(f"drafts: {args.prompts} prompts, {args.new} new tokens each, lambda 0.1, window 64, SmolLM2 {args.dtype}, "
          f"medians of {args.rounds} interleaved rounds (plain vLLM, then each draft)")
    for context in args.contexts:
        texts = prompts(plain.tokenizer, args.prompts, context - args.new)

        def timed(lm) -> float:
            requests = [Instance("generate_until", {}, (t, dict(kwargs)), i, ("bench", i, 1))
                        for i, t in enumerate(texts)]
            start = time.perf_counter()
            lm.generate_until(requests, disable_tqdm=True)
            return time.perf_counter() - start

        chosen = {name: a for name, a in DRAFTS.items() if not args.approx or name in args.approx}
        walls: dict[str, list[float]] = {name: [] for name in ["vllm", *chosen]}
        hits: dict[str, float] = {}
        timed(plain)  # warm-up: the prompts into plain vLLM's prefix cache
        for round_ in range(args.rounds + 1):  # the first round of each draft warms it (its prompts, its code paths)
            if round_:
                walls["vllm"].append(timed(plain))
            for name, approx_args in chosen.items():
                ours.reconfigure(approx=name, approx_args=approx_args)
                ours.reset_statistics()
                wall = timed(ours)
                if round_:
                    walls[name].append(wall)
                    hits[name] = ours.statistics()["tasks"]["bench"]["total"]["hit_rate"]
        plain_wall = statistics.median(walls["vllm"])
        print(f"  context {context}: plain vLLM {plain_wall:.2f} s")
        for name in chosen:
            wall = statistics.median(walls[name])
            print(f"    {name:24s} {wall:7.2f} s  {wall / plain_wall:6.2f}x plain  hit rate {hits[name]:.3f}")


def engine_pids(before: set[int]) -> set[int]:
    """The processes started since ``before`` was taken (an engine's core and workers)."""
    import psutil

    return {p.pid for p in psutil.Process().children(recursive=True)} - before


def reset_peak(pids: set[int]) -> None:
    for pid in pids:
        Path(f"/proc/{pid}/clear_refs").write_text("5")  # resets VmHWM to the current RSS


def rss(pids: set[int]) -> int:
    """The sum of the processes' resident sets now, in bytes."""
    return sum(int(line.split()[1]) * 1024 for pid in pids
               for line in Path(f"/proc/{pid}/status").read_text().splitlines() if line.startswith("VmRSS:"))


def peak_rss(pids: set[int]) -> int:
    """The sum of the processes' RSS high-water marks, in bytes."""
    total = 0
    for pid in pids:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                total += int(line.split()[1]) * 1024
    return total


def windows(args: argparse.Namespace) -> None:
    """Per window, alspec-vllm's wall and peak RSS over plain vLLM's on generation and on rolling loglikelihood."""
    import psutil
    from lm_eval.api.instance import Instance

    from alspec_eval.compat import lm_eval_vllm
    from alspec_eval.smollm2 import smollm2_path
    from alspec_eval.vllm.model import ALSpecVLLM

    path = str(smollm2_path())
    longest = max(args.tokens + args.new, args.document_tokens + 64)
    room = max(args.prompts * (args.tokens + args.new), args.documents * longest) * 46080  # SmolLM2 float32, a token
    engine = {**engine_args(args), "max_model_len": longest,
              "kv_cache_memory_bytes": max(ENGINE["kv_cache_memory_bytes"], 2 * room)}
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    plain = lm_eval_vllm().VLLM(pretrained=path, batch_size="auto", **engine)
    plain_pids = engine_pids(before)
    ours = ALSpecVLLM(path, window=64, batch_size="auto", **{"lambda": 0.1}, **engine)
    our_pids = engine_pids(before | plain_pids)
    print(f"engines started: RSS plain {rss(plain_pids) / 2**30:.2f} GiB, alspec-vllm {rss(our_pids) / 2**30:.2f} GiB")
    texts = prompts(plain.tokenizer, args.prompts, args.tokens)
    documents = prompts(plain.tokenizer, args.documents, args.document_tokens)
    gen_kwargs = {"until": [], "max_gen_toks": args.new, "do_sample": False, "ignore_eos": True}

    def call(lm, kind: str, pids: set[int]) -> tuple[float, int]:
        if kind == "generation":
            requests = [Instance("generate_until", {}, (t, dict(gen_kwargs)), i, ("bench", i, 1))
                        for i, t in enumerate(texts)]
        else:
            requests = [Instance("loglikelihood_rolling", {}, (t,), i, ("bench", i, 1)) for i, t in enumerate(documents)]
        reset_peak(pids)
        before = rss(pids)
        start = time.perf_counter()
        getattr(lm, "generate_until" if kind == "generation" else "loglikelihood_rolling")(requests, disable_tqdm=True)
        return time.perf_counter() - start, peak_rss(pids), before

    print(f"windows: sink, lambda 0.1, SmolLM2 {args.dtype}; generation: {args.prompts} prompts of {args.tokens} "
          f"tokens, {args.new} new; rolling: {args.documents} documents of {args.document_tokens} tokens; "
          f"medians of {args.rounds} interleaved rounds; peak RSS of each engine's processes, reset before each call")
    policy = ours.spec_config.policy
    for kind in args.kinds:
        context = args.tokens + args.new if kind == "generation" else args.document_tokens
        walls: dict[object, list[float]] = {"vllm": []}
        peaks: dict[object, list[int]] = {"vllm": []}
        rises: dict[object, list[int]] = {"vllm": []}
        hits: dict[int, float] = {}
        call(plain, kind, plain_pids)  # warm-up
        for round_ in range(args.rounds + 1):  # the first round of each window warms it
            if round_:
                wall, peak, before = call(plain, kind, plain_pids)
                walls["vllm"].append(wall)
                peaks["vllm"].append(peak)
                rises["vllm"].append(peak - before)
            for window in ("off", *args.windows):  # off: the same engine process, speculation off (policy=exact)
                ours.reconfigure(**({"policy": "exact"} if window == "off" else {"window": window, "policy": policy}))
                ours.reset_statistics()
                wall, peak, before = call(ours, kind, our_pids)
                if round_:
                    walls.setdefault(window, []).append(wall)
                    peaks.setdefault(window, []).append(peak)
                    rises.setdefault(window, []).append(peak - before)
                    if window != "off":
                        hits[window] = ours.statistics()["tasks"]["bench"]["total"]["hit_rate"] or 0.0
        plain_wall, plain_peak, plain_rise = statistics.median(walls["vllm"]), max(peaks["vllm"]), max(rises["vllm"])
        off_wall = statistics.median(walls["off"])

        def rounds(key: object) -> str:  # every round's wall: the machine's own spread beside the medians
            return ", ".join(f"{w:.2f}" for w in walls[key])

        print(f"  {kind}: plain vLLM {plain_wall:.2f} s (rounds {rounds('vllm')}), peak RSS {plain_peak / 2**30:.2f} "
              f"GiB ({plain_rise / 2**20:.0f} MiB over its RSS before the call); alspec-vllm with speculation off "
              f"{off_wall:.2f} s (rounds {rounds('off')}), {off_wall / plain_wall:.2f}x plain")
        for window in args.windows:
            wall, peak, rise = statistics.median(walls[window]), max(peaks[window]), max(rises[window])
            print(f"    window {window:5d}  {wall:7.2f} s  {wall / plain_wall:5.2f}x wall, {wall / off_wall:5.2f}x off "
                  f"(rounds {rounds(window)})  "
                  f"{peak / plain_peak:5.2f}x peak RSS (+{rise / 2**20:.0f} MiB in the call)  A~ reads "
                  f"{min(1.0, 2 * window / context):.2f} of A's keys at the longest context  hit rate {hits[window]:.3f}")


def memory_one(args: argparse.Namespace) -> None:
    """One engine alone (``--memory-one``: vllm or a window), in this process: the measured call's peak RSS, as JSON."""
    from lm_eval.api.instance import Instance

    from alspec_eval.compat import lm_eval_vllm
    from alspec_eval.smollm2 import smollm2_path
    from alspec_eval.vllm.model import ALSpecVLLM

    path, longest = str(smollm2_path()), args.document_tokens + 64
    engine = {**engine_args(args), "max_model_len": longest,
              "kv_cache_memory_bytes": max(ENGINE["kv_cache_memory_bytes"], 2 * args.documents * longest * 46080)}
    if args.memory_one == "vllm":
        lm = lm_eval_vllm().VLLM(pretrained=path, batch_size="auto", **engine)
    else:
        lm = ALSpecVLLM(path, window=int(args.memory_one), batch_size="auto", **{"lambda": 0.1}, **engine)
    documents = prompts(lm.tokenizer, args.documents, args.document_tokens)
    me = {os.getpid()}
    for measured in (False, True):
        reset_peak(me)
        before = rss(me)
        start = time.perf_counter()
        lm.loglikelihood_rolling([Instance("loglikelihood_rolling", {}, (t,), i, ("bench", i, 1))
                                  for i, t in enumerate(documents)], disable_tqdm=True)
    print(json.dumps({"peak": peak_rss(me), "before": before, "after": rss(me), "wall": time.perf_counter() - start}))


def memory(args: argparse.Namespace) -> None:
    """Per window, alspec-vllm's peak RSS over plain vLLM's, each engine alone in a fresh process (part 6)."""
    names = ["vllm", *map(str, args.memory)]
    got: dict[str, list[dict]] = {name: [] for name in names}
    for _ in range(args.rounds):
        for name in names:
            run = subprocess.run([sys.executable, __file__, "--memory-one", name, "--documents", str(args.documents),
                                  "--document-tokens", str(args.document_tokens), "--dtype", args.dtype],
                                 capture_output=True, text=True, env={**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"})
            if run.returncode:
                sys.exit(f"--memory-one {name} failed:\n{run.stderr[-3000:]}")
            got[name].append(json.loads(run.stdout.strip().splitlines()[-1]))
    print(f"memory: rolling loglikelihood, {args.documents} documents of {args.document_tokens} tokens, SmolLM2 "
          f"{args.dtype}; each engine alone in a fresh process, {args.rounds} rounds; peak RSS of the measured call "
          f"(after a warm-up call), GiB")
    plain = statistics.median(r["peak"] for r in got["vllm"])
    for name in names:
        peaks = [r["peak"] / 2**30 for r in got[name]]
        before = statistics.median(r["before"] for r in got[name]) / 2**30
        print(f"  {'plain vLLM' if name == 'vllm' else 'window ' + name:12s} peak {statistics.median(peaks):.2f} "
              f"(rounds {', '.join(f'{p:.2f}' for p in peaks)})  RSS before the call {before:.2f}  "
              f"{statistics.median(r['peak'] for r in got[name]) / plain:.3f}x plain")


def records(args: argparse.Namespace) -> None:
    """The engine call's wall and the part of it outside vLLM's generate: taking the packed decisions from the
    worker and building every request's record."""
    from lm_eval.api.instance import Instance

    from alspec_eval.approx_check.models import ARCHS, build, char_tokenizer
    from alspec_eval.vllm.model import ALSpecVLLM

    with tempfile.TemporaryDirectory() as tmp:
        path = str(Path(tmp) / "tiny")  # head_dim 32: CPU_ATTN's vec layout, as SmolLM2's
        build(ARCHS["llama"], 0, hidden_size=128, intermediate_size=256, num_hidden_layers=30).save_pretrained(path)
        char_tokenizer().save_pretrained(path)
        ours = ALSpecVLLM(path, window=4, **{"lambda": 0.1}, **{**ENGINE, "max_model_len": 256},
                          max_num_seqs=256)
        generate, inside = ours.model.generate, []

        def timed_generate(*a, **k):
            start = time.perf_counter()
            out = generate(*a, **k)
            inside.append(time.perf_counter() - start)
            return out

        ours.model.generate = timed_generate
        kwargs = {"until": [], "max_gen_toks": args.new, "do_sample": False, "ignore_eos": True}
        texts = [f"{i:05d} abc" for i in range(args.requests)]
        requests = [Instance("generate_until", {}, (t, dict(kwargs)), i, ("bench", i, 1)) for i, t in enumerate(texts)]
        start = time.perf_counter()
        ours.generate_until(requests, disable_tqdm=True)
        wall = time.perf_counter() - start
    speculated = ours.statistics()["tasks"]["bench"]["total"]["speculated"]
    outside = wall - sum(inside)
    print(f"records: {args.requests} requests x {args.new} new tokens, tiny Llama of 30 layers, window 4: "
          f"{speculated} decisions")
    print(f"  engine call {wall:.2f} s, inside vLLM's generate {sum(inside):.2f} s, decisions taken and records "
          f"built {outside:.2f} s = {outside / wall:.1%} of the call")


def whole_run(model: str, task: str, limit: int, out: Path) -> tuple[float, dict, dict]:
    extra = ",".join(f"{k}={v}" for k, v in ENGINE.items()) if model == "alspec-vllm" else "dtype=float32"
    args = f"pretrained=smollm2,lambda=0.1,window=64,{extra}"
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    start = time.perf_counter()
    subprocess.run([Path(sys.executable).parent / "lm_eval", "--model", model, "--model_args", args, "--tasks", task,
                    "--limit", str(limit), "--output_path", out, "--log_samples"], check=True, env=env,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wall = time.perf_counter() - start
    results = json.loads(next(out.rglob("results_*.json")).read_text())
    samples = [json.loads(line) for line in next(out.rglob("samples_*.jsonl")).read_text().splitlines()]
    return wall, results, {s["doc_id"]: s["resps"] for s in samples}


def engines(args: argparse.Namespace) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        runs = {model: whole_run(model, args.task, args.limit, Path(tmp) / model) for model in ("alspec", "alspec-vllm")}
    print(f"\nwhole run: lm_eval --tasks {args.task} --limit {args.limit}, lambda 0.1, window 64, SmolLM2 float32")
    for model, (wall, results, _) in runs.items():
        scores = {k: v for k, v in results["results"][args.task].items() if isinstance(v, float)}
        total = results["config"]["alspec"]["tasks"][args.task]["total"]
        print(f"  {model:12s} {wall:7.1f} s  scores {scores}  hit rate {total['hit_rate']:.3f} "
              f"({total['accepted']}/{total['speculated']})")
    print(f"  alspec-vllm / alspec whole-run time: {runs['alspec-vllm'][0] / runs['alspec'][0]:.3f}")
    same = sum(runs["alspec"][2][d] == runs["alspec-vllm"][2].get(d) for d in runs["alspec"][2])
    print(f"  identical responses: {same} of {len(runs['alspec'][2])}")
    layers = [zip(*(runs[m][1]["config"]["alspec"]["tasks"][args.task]["layers"] for m in ("alspec", "alspec-vllm")))]
    print("  per-layer hit rate (hf, vllm): " + ", ".join(
        f"{a['layer']}: {fmt(a['hit_rate'])}/{fmt(b['hit_rate'])}" for pair in layers for a, b in pair))


def fmt(rate: float | None) -> str:
    return "-" if rate is None else f"{rate:.2f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--new", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--task", default="alspec_recall")
    parser.add_argument("--limit", type=int, default=8)
    parser.add_argument("--skip", choices=["generation", "engines"], help="leave one part out")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--attention-backend", help="CUDA: FLASH_ATTN or TRITON_ATTN (the CPU always takes CPU_ATTN)")
    parser.add_argument("--graphs", action="store_true", help="let vLLM capture its (piecewise) CUDA graphs")
    parser.add_argument("--windows", type=lambda s: [int(x) for x in s.split(",")], default=None,
                        help="only the cost per window (part 4), at these windows")
    parser.add_argument("--documents", type=int, default=4, help="rolling loglikelihood documents (part 4)")
    parser.add_argument("--kinds", type=lambda s: s.split(","), default=["generation", "rolling"],
                        help="which of generation,rolling part 4 measures")
    parser.add_argument("--document-tokens", type=int, default=3500, help="tokens of each document (part 4)")
    parser.add_argument("--memory", type=lambda s: [int(x) for x in s.split(",")], default=None,
                        help="only peak RSS per window, each engine alone (part 6), at these windows")
    parser.add_argument("--memory-one", help=argparse.SUPPRESS)
    parser.add_argument("--records", action="store_true", help="only the decisions' read-back at scale (part 5)")
    parser.add_argument("--requests", type=int, default=2000, help="requests of part 5")
    parser.add_argument("--drafts", action="store_true", help="only the per-draft comparison (part 3)")
    parser.add_argument("--contexts", type=lambda s: [int(x) for x in s.split(",")], default=[2048, 4096],
                        help="tokens of context (prompt and new tokens) of the per-draft comparison")
    parser.add_argument("--approx", type=lambda s: s.split(","), default=None,
                        help="the drafts of the per-draft comparison (default: every one of DRAFTS)")
    args = parser.parse_args()
    if args.memory_one:
        memory_one(args)
        return
    if args.memory:
        memory(args)
        return
    if args.windows:
        windows(args)
        return
    if args.records:
        records(args)
        return
    if args.drafts:
        drafts(args)
        return
    if args.skip != "generation":
        generation(args)
    if args.skip != "engines":
        engines(args)


if __name__ == "__main__":
    main()
