"""Decode speed of token-level self-speculation (policy=selfspec) and of ALSpec against plain greedy decoding.

SmolLM2-135M in float32 on this machine's CPU, a prompt cut from the bundled haystack at each context length,
``--new`` tokens decoded after one exact prefill (the prefill is not timed: every method starts from a copy of
the same cache). Methods, each timed per round, rounds interleaved, medians compared:

- greedy: the plain model (no hooks), one token per forward pass over the KV cache (the baseline);
- selfspec γ = g: ``alspec_eval.selfspec.selfspec_generate``, the sink draft (S = ``--window``) and exact
  verification, for every g of ``--gammas``;
- alspec λ: the speculating model (policy=dynamic) decoding one token per pass: each layer computes A and A~ and
  commits one (the simulation; on hardware a hit lets the second device start early, which a CPU cannot show).

Each line prints tokens/s, the ratio to greedy, and the speedup the report projects for the same measurement on
the ``--preset`` latency table (self-speculation: τ / (γ c + 1); ALSpec: the per-layer hit rates), both kept.

    python benchmarks/bench_selfspec.py [--contexts 2048,8192] [--new 32] [--rounds 3] [--gammas 2,4,8]
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time
from importlib import resources
from typing import Callable


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--contexts", default="2048,8192", help="prompt lengths in tokens, comma-separated")
    parser.add_argument("--new", type=int, default=32, help="tokens decoded per method and round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--gammas", default="2,4,8")
    parser.add_argument("--window", type=int, default=128, help="S of the sink (the paper's 128)")
    parser.add_argument("--lam", type=float, default=0.1, help="lambda of the ALSpec row")
    parser.add_argument("--preset", default=None, help="latency table of the projection (default: the report's)")
    args = parser.parse_args()

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache

    from alspec_eval.compat import with_cache
    from alspec_eval.config import SpeculationConfig
    from alspec_eval.hooks import speculation
    from alspec_eval.latency import DEFAULT_PRESET, preset, project_layers, project_selfspec
    from alspec_eval.smollm2 import smollm2_path
    from alspec_eval.region import DecodeRegion
    from alspec_eval.selfspec import selfspec_generate

    spec = preset(args.preset or DEFAULT_PRESET)
    path = smollm2_path()
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    haystack = tokenizer((resources.files("alspec_eval") / "data" / "haystack.txt").read_text(encoding="utf-8"))
    gammas = [int(g) for g in args.gammas.split(",")]
    print(f"SmolLM2-135M float32, CPU, torch {torch.__version__}, {torch.get_num_threads()} threads; "
          f"{args.new} new tokens, S = {args.window}, medians of {args.rounds} interleaved rounds; "
          f"projection on {spec.name} (an estimate, see latency.md)")

    for context in (int(c) for c in args.contexts.split(",")):
        prompt = haystack["input_ids"][:context]
        prefilled = DynamicCache(config=model.config)
        with torch.no_grad():
            model(torch.tensor([prompt[:-1]]), **with_cache(model, prefilled), use_cache=True)

        def greedy() -> tuple[list[int], dict]:
            cache, token, out = copy.deepcopy(prefilled), prompt[-1], []
            with torch.no_grad():
                for _ in range(args.new):
                    logits = model(torch.tensor([[token]]), **with_cache(model, cache), use_cache=True).logits
                    token = int(logits[0, -1].argmax())
                    out.append(token)
            return out, {}

        def selfspec(gamma: int) -> Callable[[], tuple[list[int], dict]]:
            def run() -> tuple[list[int], dict]:
                config = SpeculationConfig(policy="selfspec", window=args.window, gamma=gamma)
                with speculation(model) as speculator:
                    out, draft = selfspec_generate(model, speculator, config, [prompt[-1]], args.new, gamma, lambda t: None,
                                                   copy.deepcopy(prefilled))
                return out, {"tau": draft.tau, "speedup": project_selfspec(spec, draft.tau, gamma, args.window).speedup}
            return run

        def alspec() -> tuple[list[int], dict]:
            cache, token, out = copy.deepcopy(prefilled), prompt[-1], []
            config = SpeculationConfig(lam=args.lam, window=args.window)
            with speculation(model) as speculator, \
                    torch.no_grad(), speculator.speculating(DecodeRegion.build([0], [0]), config) as trace:
                for _ in range(args.new):
                    logits = model(torch.tensor([[token]]), **with_cache(model, cache), use_cache=True).logits
                    token = int(logits[0, -1].argmax())
                    out.append(token)
            stats = trace.row_stats(0, len(prompt) - 1, len(prompt) - 1 + args.new)
            rates = (stats.accepted / stats.speculated.clamp(min=1)).tolist()
            return out, {"hit rate": stats.summary()["hit_rate"], "speedup": project_layers(spec, rates)[0].speedup}

        methods: dict[str, Callable[[], tuple[list[int], dict]]] = {
            "greedy": greedy, **{f"selfspec γ = {g}": selfspec(g) for g in gammas}, f"alspec λ = {args.lam:g}": alspec}
        times: dict[str, list[float]] = {name: [] for name in methods}
        info: dict[str, dict] = {}
        outputs: dict[str, list[int]] = {}
        for _ in range(args.rounds):
            for name, run in methods.items():
                start = time.perf_counter()
                outputs[name], info[name] = run()
                times[name].append(time.perf_counter() - start)
        base = statistics.median(times["greedy"])
        print(f"\ncontext {context} tokens")
        print(f"{'method':<18}{'tok/s':>8}{'÷ greedy':>10}{'τ / hit rate':>14}{'projected':>11}  output = greedy")
        for name in methods:
            t = statistics.median(times[name])
            measure = info[name].get("tau", info[name].get("hit rate"))
            projected = info[name].get("speedup")
            print(f"{name:<18}{args.new / t:>8.2f}{base / t:>9.2f}×{'' if measure is None else f'{measure:.3f}':>14}"
                  f"{'' if projected is None else f'{projected:.3f}×':>11}  {outputs[name] == outputs['greedy']}")


if __name__ == "__main__":
    main()
