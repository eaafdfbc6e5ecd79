"""`alspec-sweep CONFIG`: run (or resume) a lambda sweep, then write its report."""

from __future__ import annotations

import argparse
import sys

from ..config import ConfigError
from .config import load_config
from .runner import run_sweep


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="alspec-sweep", description=__doc__)
    parser.add_argument("config", help="sweep YAML, e.g. configs/demo.yaml")
    parser.add_argument("--output", help="output folder (default: the config's output, else results/<name>)")
    parser.add_argument("--limit", type=float, help="override the config's per-task sample limit")
    parser.add_argument("--no-report", action="store_true", help="skip writing the report at the end")
    args = parser.parse_args(argv)
    overrides = {k: v for k, v in {"output": args.output, "limit": args.limit}.items() if v is not None}
    if "limit" in overrides and overrides["limit"].is_integer():
        overrides["limit"] = int(overrides["limit"])
    try:
        config = load_config(args.config, overrides)
        out = run_sweep(config)
    except ConfigError as err:
        sys.exit(f"alspec-sweep: {err}")
    from ..distributed import is_main_process

    if not is_main_process():  # a data-parallel run: the main process writes the report
        return
    print(f"cells in {out / 'cells'}")
    if not args.no_report:
        from ..report.cli import main as report

        report([str(out)])


if __name__ == "__main__":
    main()
