"""`alspec-sweep CONFIG`: run (or resume) a lambda sweep, then write its report.

Options override the config's keys and speak lm-eval's language (--model_args, --batch_size, --output_path,
--device, --limit). A cell already on disk is reused only when it was made with the same settings."""

from __future__ import annotations

import argparse
import sys

from ..cli_errors import bad_input


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="alspec-sweep", description=__doc__,
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("config", help="sweep YAML, e.g. configs/demo.yaml")
    p.add_argument("--output_path", "--output", dest="output", default=None,
                   help="output folder (default: the config's output, else results/<name>)")
    p.add_argument("--model", choices=["alspec", "alspec-vllm"], default=None,
                   help="the engine every cell runs on: alspec (hf) or alspec-vllm (vLLM); overrides the config's")
    p.add_argument("--model_args", default=None, help="k=v,... merged over the config's model_args")
    p.add_argument("--batch_size", type=int, default=None, help="override the config's batch_size")
    p.add_argument("--device", default=None, help="override the config's device, e.g. cuda:0")
    p.add_argument("--limit", type=float, default=None, help="override the config's per-task sample limit")
    p.add_argument("--recompute", action="store_true",
                   help="recompute cells made with other settings (or unreadable) instead of refusing")
    p.add_argument("--no-report", action="store_true", help="skip writing the report at the end")
    return p


def main(argv: list[str] | None = None) -> None:
    args = parser().parse_args(argv)
    from ..config import ConfigError
    from ..distributed import is_main_process
    from .config import load_config, parse_model_args
    from .runner import run_sweep

    try:
        overrides = {k: v for k, v in {"output": args.output, "limit": args.limit, "batch_size": args.batch_size,
                                       "device": args.device}.items() if v is not None}
        if args.model:
            from .config import ENGINES

            overrides.update(model=args.model, engine={m: e for e, m in ENGINES.items()}[args.model])
        if "limit" in overrides and overrides["limit"].is_integer():
            overrides["limit"] = int(overrides["limit"])
        config = load_config(args.config, overrides)
        if args.model_args:
            from dataclasses import replace

            config = replace(config, model_args={**config.model_args, **parse_model_args(args.model_args)})
        out = run_sweep(config, recompute=args.recompute)
    except ConfigError as err:
        sys.exit(bad_input("alspec-sweep", err))
    if not is_main_process():  # a data-parallel run: the main process writes the report
        return
    print(f"cells in {out / 'cells'}")
    if not args.no_report:
        from ..report.cli import main as report

        code = report([str(out)])
        if code:
            sys.exit(code)


if __name__ == "__main__":
    main()
