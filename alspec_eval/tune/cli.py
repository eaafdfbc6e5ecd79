"""`alspec-tune`: the per-layer lambda schedule with the largest projected speedup whose score stays within a budget
of the baseline, searched on calibration documents and validated once on held-out ones.

Writes OUTPUT/schedule.json (for lambda_schedule=), OUTPUT/tune.json (every candidate and its numbers),
OUTPUT/tune.md, and the held-out sweep with its report (OUTPUT/heldout/report/). Rerun the same command to resume.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ..cli_errors import bad_input


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="alspec-tune", description=__doc__,
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("config", nargs="?", help="a sweep YAML (tasks, model_args, window, the uniform lambdas to beat, "
                                             "static baseline), e.g. configs/demo.yaml; options override it")
    p.add_argument("--tasks", default=None, help="lm-eval task names, comma separated (without a config)")
    p.add_argument("--model_args", default=None, help="k=v,... merged over the config's model_args")
    p.add_argument("--lambdas", default=None, help="uniform lambdas to beat (default: the config's, else "
                                                   "0.05,0.1,0.2,0.4)")
    p.add_argument("--window", type=int, default=None, help="S (default: the config's, else 128)")
    p.add_argument("--limit", type=float, default=None, help="documents per task before the split")
    p.add_argument("--max_drop", type=float, default=0.02,
                   help="largest acceptable drop of each task's primary metric against the baseline (the lower end "
                        "of the paired 95%% bootstrap interval)")
    p.add_argument("--preset", default=None, help="latency table of the projected speedup (alspec-latency "
                                                  "--list-presets; default: the report's)")
    p.add_argument("--holdout", type=float, default=0.5, help="share of each task's documents held out, by doc_id")
    p.add_argument("--seed", type=int, default=None, help="seed of the split (default: the config's seed)")
    p.add_argument("--steps", type=int, default=6, help="candidates the bisection runs")
    p.add_argument("--batch_size", type=int, default=None, help="override the config's batch_size")
    p.add_argument("--device", default=None, help="override the config's device, e.g. cuda:0")
    p.add_argument("--output_path", "--output", dest="output", default=None,
                   help="output folder (default: results/tune_<config name>)")
    p.add_argument("--recompute", action="store_true",
                   help="recompute runs made with other settings (another split, model or window) instead of refusing")
    return p


def plan_from_args(args: argparse.Namespace):
    """The plan, every setting checked before the model loads."""
    from dataclasses import replace

    from ..approximations import DEFAULT, default_approximation
    from ..config import ConfigError
    from ..latency import preset
    from ..report.latency import DEFAULT_PRESET
    from ..sweep.config import load_config, parse_config, parse_model_args
    from .tuner import TunePlan

    if not args.max_drop >= 0:
        raise ConfigError(f"--max_drop {args.max_drop} must be >= 0, e.g. --max_drop 0.02")
    if args.max_drop > 1:  # per-document scores are shares in [0, 1], so no drop exceeds 1
        raise ConfigError(f"--max_drop {args.max_drop} admits every schedule: the drop is a difference of the primary "
                          "metric's per-document scores (accuracy, exact match: 0 or 1), which never exceeds 1; use a "
                          "share such as 0.02 (two points), or 1 to choose for speed alone")
    if not 0 < args.holdout < 1:
        raise ConfigError(f"--holdout {args.holdout} must be a fraction in (0, 1), e.g. --holdout 0.5")
    if args.steps < 1:
        raise ConfigError(f"--steps {args.steps} must be >= 1")
    if args.config is None and args.tasks is None:
        raise ConfigError("give a sweep config (e.g. configs/demo.yaml) or --tasks")
    overrides = {k: v for k, v in {"batch_size": args.batch_size, "device": args.device, "window": args.window,
                                   "seed": args.seed}.items() if v is not None}
    if args.tasks:
        overrides["tasks"] = [t for t in args.tasks.split(",") if t]
    if args.lambdas:
        try:
            overrides["lambdas"] = [float(x) for x in args.lambdas.split(",") if x]
        except ValueError:
            raise ConfigError(f"--lambdas {args.lambdas!r}: write numbers separated by ',', e.g. 0.05,0.1") from None
    if args.limit is not None:
        overrides["limit"] = int(args.limit) if args.limit.is_integer() else args.limit
    if args.config:
        base = load_config(args.config, overrides)
    else:
        base = parse_config({"name": "tune", "lambdas": [0.05, 0.1, 0.2, 0.4], **overrides}, source="alspec-tune")
    if args.model_args:
        base = replace(base, model_args={**base.model_args, **parse_model_args(args.model_args)})
    if isinstance(base.window, list):
        raise ConfigError(f"window {base.window}: alspec-tune tunes one window's lambdas; give one, e.g. "
                          f"--window {base.windows[0]}")
    if list(base.approx) != [default_approximation()]:
        raise ConfigError(f"approx {[a.label for a in base.approx]}: alspec-tune tunes the sink's lambdas (the speedup it maximises is the "
                          f"paper's latency model, which is the sink's); drop approx from the config or set it to [{DEFAULT}]")
    if base.gammas or base.schedules:
        base = replace(base, gammas=[], schedules=[])
    output = Path(args.output or f"results/tune_{base.name}")
    return TunePlan(base, args.max_drop, preset(args.preset or DEFAULT_PRESET), args.holdout, args.steps, output,
                    args.recompute)


def main(argv: list[str] | None = None) -> None:
    args = parser().parse_args(argv)
    from ..config import ConfigError
    from ..latency import LatencyError

    try:
        plan = plan_from_args(args)
        from ..sweep.runner import check_tasks, check_writable, task_manager
        from .tuner import Tuner, document_counts, split_documents, write_outputs

        check_writable(plan.output, plan.base.tasks)
        tasks = task_manager(plan.base)  # one task index for every sweep of the tune
        check_tasks(plan.base.tasks, tasks)
        tuner = Tuner(plan, tasks=tasks)
        tuner.calibration_docs, tuner.heldout_docs = split_documents(document_counts(plan.base, tasks), plan.holdout,
                                                                     plan.base.seed)
        result = tuner.run()
    except (ConfigError, LatencyError) as err:
        sys.exit(bad_input("alspec-tune", err))
    for path in write_outputs(plan.output, result):
        print(path)
    print((plan.output / "tune.md").read_text())
    from ..report.cli import main as report

    code = report([str(plan.output / "heldout"), "--preset", plan.latency.name])
    if code:
        sys.exit(code)


if __name__ == "__main__":
    main()
