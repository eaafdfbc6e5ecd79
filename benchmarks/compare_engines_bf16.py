"""`--model alspec-vllm` against `--model alspec` in bfloat16: the share of the same positions each accepts, overall
and per layer, on rolling loglikelihood (every position speculates), SmolLM2 in bfloat16, one draft (the sink by
default; ``--approx`` another that runs in vLLM), one lambda and window. The engines compute A with their own kernels (vLLM's CPU attention, torch's SDPA), so their A differ by
bf16 rounding; A~ is semantics.attend's arithmetic on both (SDPA's to one bf16 step), and d and n are float32.

Run it in .venv-vllm (scripts/vllm_env.sh):

    python benchmarks/compare_engines_bf16.py [--documents 2] [--tokens 3000] [--lambda 0.1] [--window 64]
        [--approx topk] [--approx-args page:16]
"""

from __future__ import annotations

import argparse

from bench_vllm import prompts


def per_layer(stats: dict) -> tuple[list[tuple[int, int]], tuple[int, int]]:
    task = stats["tasks"]["bench"]
    layers = [(layer["accepted"], layer["speculated"]) for layer in task["layers"]]
    return layers, (task["total"]["accepted"], task["total"]["speculated"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--documents", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=3000)
    parser.add_argument("--lambda", dest="lam", type=float, default=0.1)
    parser.add_argument("--window", type=int, default=64)
    parser.add_argument("--approx", default="sink", help="the draft, as approx= names it (default sink)")
    parser.add_argument("--approx-args", default=None, help="its approx_args (page:16), if any")
    args = parser.parse_args()

    from lm_eval.api.instance import Instance

    from alspec_eval.adapter import ALSpecLM
    from alspec_eval.smollm2 import smollm2_path
    from alspec_eval.vllm.model import ALSpecVLLM

    path = str(smollm2_path())
    spec = {"lambda": args.lam, "window": args.window, "approx": args.approx, "approx_args": args.approx_args}
    vllm_lm = ALSpecVLLM(path, dtype="bfloat16", max_model_len=args.tokens + 64, enforce_eager=True, seed=0,
                         kv_cache_memory_bytes=2**30, **spec)
    documents = prompts(vllm_lm.tokenizer, args.documents, args.tokens)

    def requests() -> list[Instance]:  # fresh each time: an engine's call may annotate the instances
        return [Instance("loglikelihood_rolling", {}, (t,), i, ("bench", i, 1)) for i, t in enumerate(documents)]

    vllm_lm.loglikelihood_rolling(requests(), disable_tqdm=True)
    ours = per_layer(vllm_lm.statistics())
    del vllm_lm
    hf_lm = ALSpecLM(pretrained=path, dtype="bfloat16", device="cpu", batch_size=1, max_length=args.tokens + 64,
                     **spec)
    hf_lm.loglikelihood_rolling(requests(), disable_tqdm=True)
    theirs = per_layer(hf_lm.statistics())
    (a, s), (b, t) = ours[1], theirs[1]
    print(f"rolling loglikelihood, {args.documents} documents of {args.tokens} tokens, SmolLM2 bfloat16, "
          f"{args.approx}{' ' + args.approx_args if args.approx_args else ''}, "
          f"lambda {args.lam}, window {args.window}")
    print(f"  accepted: alspec-vllm {a}/{s} = {a / s:.2%}, alspec {b}/{t} = {b / t:.2%}, "
          f"{100 * abs(a / s - b / t):.2f} points apart")
    gaps = [100 * abs(x[0] / x[1] - y[0] / y[1]) for x, y in zip(ours[0], theirs[0]) if x[1] and y[1]]
    worst = max(range(len(gaps)), key=gaps.__getitem__)
    print(f"  per layer: the widest gap {gaps[worst]:.2f} points (layer {worst}); mean {sum(gaps) / len(gaps):.2f}")
    print("  per layer (vllm %, hf %): " + ", ".join(f"{i}: {100 * x[0] / x[1]:.1f}/{100 * y[0] / y[1]:.1f}"
                                                      for i, (x, y) in enumerate(zip(ours[0], theirs[0])) if x[1]))


if __name__ == "__main__":
    main()
