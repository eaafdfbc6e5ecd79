"""The stock ``lm_eval`` command with ``--model alspec``: its arguments checked before the model loads, and the
statistics sidecar written beside the results file lm-eval writes.

lm-eval 0.4.13 tells a model neither its command line nor where its results go (the statistics reach the results JSON
through the model's ``get_model_info``, under ``config.alspec``; a file beside it has no channel), so the ``.pth`` hook
(:mod:`alspec_eval._lmeval_hook`) wraps ``HarnessCLI.parse_args``, which sees the parsed arguments. Only for a ``run``
whose model is alspec does it put :func:`run_alspec` around lm-eval's ``Run._execute``: the one-line errors,
``--use_cache`` refused, ``--output_path`` checked, and ``EvaluationTracker.save_results_aggregated`` wrapped in that
process, so ``alspec_<timestamp>.json`` goes beside ``results_<timestamp>.json``. Any other command line comes back
as lm-eval parsed it and runs through lm-eval's code alone (not even a frame of ours in its tracebacks).
"""

from __future__ import annotations

import argparse
import functools
from pathlib import Path
from collections.abc import Callable
from types import ModuleType
from typing import Any

from .config import ConfigError
from .atomic_json import write_json_atomic

ALSPEC_MODELS = ("alspec", "alspec-vllm")  # the models whose runs go through run_alspec
# lm-eval's request cache (CachingLM) is keyed by the request alone and answers cached requests without calling
# the model: another lambda's answers would be served, and the cached samples would have no decisions.
USE_CACHE_REFUSED = ("--use_cache is not supported with --model alspec: lm-eval keys its cache by the request alone, "
                     "so answers cached under one lambda, window or policy would be served for another, without "
                     "their acceptance statistics; drop --use_cache (alspec-sweep shares one exact prefill per "
                     "request across a sweep's cells instead)")


def check_output_path(output: Path) -> None:
    """lm-eval only warns when --output_path cannot be written (and exits 0 with nothing saved): fail here instead,
    before the evaluation runs, naming the part of the path that is a file."""
    for part in (output, *output.parents):
        if part.exists():
            if not part.is_dir() and not (part == output and output.suffix == ".json"):
                raise ConfigError(f"--output_path {output}: {part} is a file, not a folder; choose another path")
            return


def settings(args: argparse.Namespace) -> dict[str, Any]:
    """The run's settings as lm-eval merges them (``EvaluatorConfig.from_cli``): a ``--config`` YAML's, overridden by
    the command line's set values; a YAML lm-eval cannot read counts as none (lm-eval says what is wrong with it)."""
    merged: dict[str, Any] = {}
    if getattr(args, "config", None):
        from lm_eval.config.evaluate_config import EvaluatorConfig

        try:
            merged.update(EvaluatorConfig.load_yaml_config(args.config))
        except Exception:
            pass
    merged.update({key: value for key, value in vars(args).items() if value or value == 0})
    return merged


def check_arguments(args: argparse.Namespace) -> None:
    """What the parsed ``lm_eval run`` arguments can tell before an alspec model loads."""
    given = settings(args)
    if given.get("model") not in ALSPEC_MODELS:
        return
    if given.get("use_cache"):
        raise ConfigError(USE_CACHE_REFUSED)
    if given.get("output_path"):
        check_output_path(Path(given["output_path"]))


def sidecar_for(results_file: Path) -> Path:
    """`results_2026-01-01T00-00-00.json` -> `alspec_2026-01-01T00-00-00.json` in the same folder."""
    return results_file.with_name("alspec_" + results_file.name.removeprefix("results_"))


def results_file(tracker: Any) -> Path | None:
    """The file ``tracker.save_results_aggregated`` just wrote (its own naming rule), or None without an output."""
    if not tracker.output_path or not hasattr(tracker, "date_id"):
        return None
    path = Path(tracker.output_path)
    if path.suffix == ".json":
        return path.with_name(f"{path.stem}_{tracker.date_id}.json")
    return path / str(tracker.general_config_tracker.model_name_sanitized) / f"results_{tracker.date_id}.json"


def summary(statistics: dict[str, Any]) -> list[str]:
    """A line per task: decisions, hit rate, and the layers that accept most and least."""
    lines = []
    for task, stats in statistics["tasks"].items():
        total = stats["total"]
        line = f"alspec: {task}: speculated {total['speculated']}, accepted {total['accepted']}"
        if total["hit_rate"] is not None:
            line += f" ({100 * total['hit_rate']:.1f}%)"
            rated = [(layer["hit_rate"], layer["layer"]) for layer in stats["layers"] if layer["hit_rate"] is not None]
            (low, low_layer), (high, high_layer) = min(rated), max(rated)
            line += f"; highest layer {high_layer} ({100 * high:.1f}%), lowest layer {low_layer} ({100 * low:.1f}%)"
        lines.append(line)
    return lines


def write_sidecar(tracker: Any, results: dict[str, Any]) -> Path | None:
    """After lm-eval saved ``results``: the summary, and the statistics beside the results file (main process only:
    lm-eval saves results there alone)."""
    statistics = (results.get("config") or {}).get("alspec")
    if statistics is None:  # another model's results
        return None
    if statistics["tasks"]:
        print("\n".join(summary(statistics)))
    path = results_file(tracker)
    if path is None or not path.exists():
        return None
    sidecar = write_json_atomic(sidecar_for(path), statistics)
    print(f"alspec: statistics in {sidecar}")
    return sidecar


def _wrap(cls: type, name: str, make: Callable[[Callable], Callable]) -> None:
    """Replace the method ``cls.name`` with ``make(original)`` once (a second call finds it wrapped)."""
    original = getattr(cls, name)
    if getattr(original, "_alspec", False):
        return
    wrapped = functools.wraps(original)(make(original))
    wrapped._alspec = True
    setattr(cls, name, wrapped)


def run_alspec(execute: Callable[[argparse.Namespace], None], args: argparse.Namespace) -> None:
    """lm-eval's ``Run._execute`` for an alspec run: errors in one line, arguments checked before the model loads,
    the sidecar beside the results."""
    from lm_eval.loggers import evaluation_tracker

    from . import cli_errors

    cli_errors.install()
    check_arguments(args)
    patch_tracker(evaluation_tracker)
    execute(args)


def patch_cli(module: ModuleType) -> None:
    """Wrap ``lm_eval._cli.harness.HarnessCLI.parse_args``: an alspec ``run`` executes through :func:`run_alspec`."""
    def make(parse_args: Callable) -> Callable:
        def parse(self: Any) -> argparse.Namespace:
            args = parse_args(self)
            if getattr(args, "command", None) == "run" and settings(args).get("model") in ALSPEC_MODELS:
                args.func = functools.partial(run_alspec, args.func)
            return args
        return parse

    _wrap(module.HarnessCLI, "parse_args", make)


def patch_tracker(module: ModuleType) -> None:
    """Wrap ``EvaluationTracker.save_results_aggregated`` so the sidecar goes beside the file it writes."""
    def make(save: Callable) -> Callable:
        def save_results_aggregated(self: Any, results: dict, samples: dict | None = None) -> None:
            save(self, results=results, samples=samples)
            write_sidecar(self, results)
        return save_results_aggregated

    _wrap(module.EvaluationTracker, "save_results_aggregated", make)
