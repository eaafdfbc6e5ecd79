"""The statistics sidecar JSON next to lm-eval's results file.

The stock `lm_eval` CLI writes `results_<timestamp>.json` under `--output_path` but
tells the model nothing about it, so at exit the sidecar is written beside the
newest results file that this process produced, as `alspec_<timestamp>.json`.
"""

from __future__ import annotations

import atexit
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

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


def sidecar_for(results_file: Path) -> Path:
    """`results_2026-01-01T00-00-00.json` -> `alspec_2026-01-01T00-00-00.json` in the same folder."""
    return results_file.with_name("alspec_" + results_file.name.removeprefix("results_"))


def newest_results(output: Path, since: float) -> Path | None:
    """The results file written by this run: the newest one under ``output`` modified after ``since``."""
    if output.suffix == ".json":
        candidates = list(output.parent.glob(f"{output.stem}*.json"))
    else:
        candidates = list(output.rglob("results_*.json"))
    candidates = [p for p in candidates if p.stat().st_mtime >= since and not p.name.startswith("alspec_")]
    return max(candidates, key=lambda p: p.stat().st_mtime, default=None)


def register_sidecar(statistics: Callable[[], dict[str, Any]], is_main: Callable[[], bool] = lambda: True) -> None:
    """At exit, write the statistics next to the results of an `lm_eval --output_path ...` run; in a data-parallel
    run only the main process writes (its statistics are every rank's)."""
    output = _cli_output_path(sys.argv)
    if output is None:
        return
    started = time.time()

    def write() -> None:
        if not is_main():
            return
        results = newest_results(output, started)
        if results is not None:
            write_json_atomic(sidecar_for(results), statistics())

    atexit.register(write)
