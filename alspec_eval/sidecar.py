"""The statistics sidecar JSON next to lm-eval's results file.

The stock `lm_eval` CLI writes `results_<timestamp>.json` under `--output_path` but
tells the model nothing about it, so at exit the sidecar is written beside the
results file that this process produced, as `alspec_<timestamp>.json`.
"""

from __future__ import annotations

import atexit
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .config import ConfigError
from .report_io import write_json_atomic


def cli_option(argv: list[str], name: str, short: str) -> str | None:
    """The value of an option of the stock ``lm_eval`` command line (``--name V``, ``--name=V`` or ``-s V``)."""
    for i, arg in enumerate(argv):
        if arg in (name, short) and i + 1 < len(argv):
            return argv[i + 1]
        if arg.startswith(name + "="):
            return arg.split("=", 1)[1]
    return None


def _cli_output_path(argv: list[str]) -> Path | None:
    value = cli_option(argv, "--output_path", "-o")
    return None if value is None else Path(value)


def lm_eval_command_line(argv: list[str]) -> bool:
    """Whether this process is lm-eval's command line (``lm_eval``, ``python -m lm_eval``) or ``alspec-eval run``."""
    prog = Path(argv[0]) if argv else Path()
    return (prog.name in ("lm_eval", "lm-eval", "alspec-eval")
            or (prog.name == "__main__.py" and prog.parent.name in ("lm_eval", "alspec_eval")))


def sidecar_for(results_file: Path) -> Path:
    """`results_2026-01-01T00-00-00.json` -> `alspec_2026-01-01T00-00-00.json` in the same folder."""
    return results_file.with_name("alspec_" + results_file.name.removeprefix("results_"))


def own_results(output: Path, since: float, statistics: dict[str, Any]) -> Path | None:
    """The results file this run wrote: the newest one under ``output`` since ``since`` whose ``config.alspec``
    holds this run's statistics (another run sharing the folder writes other statistics; an interrupted run none)."""
    if output.suffix == ".json":
        candidates = list(output.parent.glob(f"{output.stem}*.json"))
    else:
        candidates = list(output.rglob("results_*.json"))
    candidates = [p for p in candidates if p.stat().st_mtime >= since and not p.name.startswith("alspec_")]
    mine = json.loads(json.dumps(statistics))
    for path in sorted(candidates, key=lambda p: p.stat().st_mtime, reverse=True):
        try:
            if json.loads(path.read_text()).get("config", {}).get("alspec") == mine:
                return path
        except (OSError, ValueError):
            continue
    return None


def check_output_path(output: Path) -> None:
    """lm-eval only warns when --output_path cannot be written (and exits 0 with nothing saved): fail here instead,
    before the evaluation runs, naming the part of the path that is a file."""
    for part in (output, *output.parents):
        if part.exists():
            if not part.is_dir() and not (part == output and output.suffix == ".json"):
                raise ConfigError(f"--output_path {output}: {part} is a file, not a folder; choose another path")
            return


def summary(statistics: dict[str, Any]) -> list[str]:
    """A line per task: decisions, hit rate, and the layers that accept most and least (printed after lm-eval's
    score table)."""
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


def register_sidecar(statistics: Callable[[], dict[str, Any]], is_main: Callable[[], bool] = lambda: True) -> None:
    """At exit, write the statistics next to the results of an `lm_eval --output_path ...` run, named after that
    results file; in a data-parallel run only the main process writes (its statistics are every rank's).

    Why at exit: lm-eval tells the model nothing about --output_path and writes the results file after the
    evaluation returns, so the stock command line and the file it writes are all there is to go by."""
    if not lm_eval_command_line(sys.argv):  # a sweep's or a script's --output_path is not lm-eval's
        return
    output = _cli_output_path(sys.argv)
    if output is not None:
        check_output_path(output)
    started = time.time()

    def write() -> None:
        if not is_main():
            return
        stats = statistics()
        if stats["tasks"]:
            print("\n".join(summary(stats)))
        if output is None:
            return
        results = own_results(output, started, stats)
        if results is not None:
            print(f"alspec: statistics in {write_json_atomic(sidecar_for(results), stats)}")
        else:
            print(f"alspec: no results file of this run under {output}; the acceptance statistics are in the "
                  "results' config.alspec only if lm-eval wrote them", file=sys.stderr)

    atexit.register(write)
