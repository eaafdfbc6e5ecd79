"""`alspec-niah`: the paper's needle experiment as a sweep (baseline, lambdas, pure sink) by length and depth.

The run is an ordinary resumable sweep over the `alspec_niah` / `alspec_niah_single` task with
token traces on; the needle figures are drawn from its cells afterwards.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ..approximations import DEFAULT
from ..cli_errors import bad_input
from ..config import ConfigError, unloadable_model
from ..sweep.config import SweepConfig, parse_config, parse_model_args
from .generator import SUPPORTED_LENGTHS

TASKS = {"single": "alspec_niah_single", "paper": "alspec_niah"}


def _floats(text: str, flag: str) -> list[float]:
    try:
        return [float(x) for x in text.split(",") if x]
    except ValueError:
        raise ConfigError(f"{flag} {text!r}: write numbers separated by ',', e.g. {flag} 0.1,0.5") from None


def _gammas(text: str) -> list[int]:
    values = _floats(text, "--gammas")
    if any(not v.is_integer() or v < 1 for v in values):
        raise ConfigError(f"--gammas {text!r}: draft lengths are integers >= 1, e.g. --gammas 2,4")
    return [int(v) for v in values]


def niah_config(args: argparse.Namespace) -> SweepConfig:
    """The needle run as a sweep config; lengths and depths are checked here, before any model loads."""
    lengths = [int(x) for x in _floats(args.lengths, '--lengths')]
    if bad := [n for n in lengths if n not in SUPPORTED_LENGTHS]:
        raise ConfigError(f"--lengths {bad} unsupported; use powers of two from 1024 to 131072, e.g. --lengths 2048,4096")
    if bad := [d for d in _floats(args.depths, '--depths') if not 0 <= d <= 1]:
        raise ConfigError(f"--depths {bad} out of range; use fractions of the haystack in [0, 1], e.g. --depths 0.1,0.5")
    metadata = {"max_seq_lengths": lengths, "niah_samples": args.samples,
                "niah_seed": args.seed, "niah_needle": args.needle, "niah_chat": args.chat}
    if args.mode == "single":
        metadata["niah_depths"] = _floats(args.depths, '--depths')
    return parse_config({
        "name": f"niah_{args.mode}", "tasks": [TASKS[args.mode]], "lambdas": _floats(args.lambdas, '--lambdas'),
        "model_args": {**parse_model_args(args.model_args), "trace_tokens": True}, "window": args.window,
        "batch_size": args.batch_size, "device": args.device, "static": False, "gammas": _gammas(args.gammas),
        "shared_prefill": not args.no_shared_prefill,
        "gen_kwargs": {"max_gen_toks": args.max_gen_toks, "until": ["\n\n"]},
        "metadata": metadata, "output": args.output or f"results/niah_{args.mode}", "seed": args.seed,
        "approx": [a for a in args.approx.split(",") if a], "approx_args": _approx_args(args.approx_args),
    }, source="needle run")


def _approx_args(given: list[str]) -> dict[str, str]:
    """--approx_args quest=page:8 (repeated) as the sweep config's {name: args}."""
    out = {}
    for item in given:
        name, sep, args = item.partition("=")
        if not sep or not name:
            raise ConfigError(f"--approx_args {item!r} is not NAME=ARGS; write e.g. --approx_args quest=page:8")
        out[name] = args
    return out


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="alspec-niah", description=__doc__,
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--mode", choices=sorted(TASKS), default="single", help="paper (Appendix G) or single needles")
    p.add_argument("--lengths", default="2048", help="prompt lengths in tokens, powers of two from 1024 to 131072")
    p.add_argument("--depths", default="0.1,0.5,0.9", help="needle depths (single mode), fractions of the haystack")
    p.add_argument("--lambdas", default="0.05,0.1,0.2,0.4", help="lambda cells (baseline and pure sink are added)")
    p.add_argument("--window", type=int, default=64, help="S, tokens in each sink window")
    p.add_argument("--gammas", default="", help="self-speculation cells (policy=selfspec), one per draft length, "
                                                "e.g. 2,4; none by default")
    p.add_argument("--approx", default=DEFAULT, help="approximations of A~, each with its rows: sink (the paper's), "
                   "local, quest (Quest's pages), topk (an oracle ceiling: the top-scoring keys), a registered name "
                   "or pkg.module:Class")
    p.add_argument("--approx_args", "--approx-args", dest="approx_args", action="append", default=[],
                   metavar="NAME=ARGS", help="one approximation's parameters, e.g. quest=page:8 (repeat per name)")
    p.add_argument("--samples", type=int, default=1, help="prompts per length (and depth)")
    p.add_argument("--needle", choices=["passkey", "fact"], default="passkey", help="single mode's needle")
    p.add_argument("--model_args", "--model-args", dest="model_args", default="pretrained=smollm2,dtype=float32",
                   help="lm-eval model_args of the model")
    p.add_argument("--device", default="cpu", help="torch device, e.g. cuda:0")
    p.add_argument("--batch_size", "--batch-size", dest="batch_size", type=int, default=1, help="requests per batch")
    p.add_argument("--max_gen_toks", "--max-gen-toks", dest="max_gen_toks", type=int, default=48,
                   help="new tokens per answer")
    p.add_argument("--chat", action=argparse.BooleanOptionalAction, default=None,
                   help="bake the model's chat template into the prompts (default: when it has one)")
    p.add_argument("--seed", type=int, default=0, help="seed of the needles and their placement")
    p.add_argument("--output_path", "--output", dest="output", default=None,
                   help="output folder (default: results/niah_<mode>)")
    p.add_argument("--allow_longer", action="store_true",
                   help="allow lengths beyond the model's context (for a model run with RoPE scaling)")
    p.add_argument("--no_shared_prefill", action="store_true",
                   help="run the cells one after another instead of as rows of one batch after one shared prefill: "
                        "one KV cache at a time (less memory at long context), one prefill per cell (more time)")
    p.add_argument("--recompute", action="store_true",
                   help="recompute cells made with other settings (or unreadable) instead of refusing")
    return p


def check_context(config: SweepConfig, lengths: list[int], max_gen_toks: int) -> None:
    """Lengths beyond the model's context are refused before the weights load: the prompt would be cut to the
    context, and cells labelled with a length the model never saw."""
    from transformers import AutoConfig

    from ..sweep.runner import resolved_model_args

    args = resolved_model_args(config)
    try:
        model_config = AutoConfig.from_pretrained(args["pretrained"]).get_text_config()
    except OSError as err:
        raise ConfigError(unloadable_model(args["pretrained"], err)) from None
    limit = getattr(model_config, "max_position_embeddings", None)
    if "max_length" in args:
        limit = int(args["max_length"])
    if limit is not None and (too_long := [n for n in lengths if n + max_gen_toks > limit]):
        raise ConfigError(f"--lengths {too_long}: with {max_gen_toks} new tokens they exceed the model's context of "
                          f"{limit} positions (max_position_embeddings); use lengths up to "
                          f"{max((n for n in SUPPORTED_LENGTHS if n + max_gen_toks <= limit), default=0)}, or "
                          "--allow_longer for a model run with RoPE scaling")


def main(argv: list[str] | None = None) -> None:
    args = parser().parse_args(argv)
    from ..distributed import is_main_process
    from ..sweep.runner import run_sweep

    try:
        config = niah_config(args)
        if not args.allow_longer:
            check_context(config, [int(x) for x in _floats(args.lengths, "--lengths")], args.max_gen_toks)
        out = run_sweep(config, recompute=args.recompute)
    except ConfigError as err:
        sys.exit(bad_input("alspec-niah", err))
    from .figures import write_niah_figures

    if is_main_process():  # a data-parallel run writes its figures once
        for path in write_niah_figures(Path(out)):
            print(path)


if __name__ == "__main__":
    main()
