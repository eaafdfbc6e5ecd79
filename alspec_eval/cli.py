"""`alspec-eval` / `python -m alspec_eval`: the command line.

`alspec-eval run ...` is `lm_eval run ...` with `--model alspec` as the default model:
it takes exactly lm_eval's arguments.
"""

from __future__ import annotations

import sys


def run(argv: list[str]) -> None:
    """Hand the arguments to lm-eval's own CLI (the `run` subcommand)."""
    from lm_eval.__main__ import cli_evaluate

    from . import cli_errors

    cli_errors.install()
    has_model = any(a == "--model" or a.startswith("--model=") for a in argv)
    sys.argv = ["alspec-eval", "run", *([] if has_model else ["--model", "alspec"]), *argv]
    cli_evaluate()


COMMANDS = {"run": run}
USAGE = "usage: alspec-eval {run} ...\n  run   lm_eval run with --model alspec by default (same arguments as lm_eval)"


def main(argv: list[str] | None = None) -> None:
    """As argparse does: usage on stdout and exit 0 for --help; usage on stderr and exit 2 without a command."""
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in ("-h", "--help"):
        print(USAGE)
        return
    if not argv:
        print(f"{USAGE}\nalspec-eval: error: a command is required", file=sys.stderr)
        sys.exit(2)
    if argv[0] not in COMMANDS:
        print(f"{USAGE}\nalspec-eval: error: unknown command {argv[0]!r}", file=sys.stderr)
        sys.exit(2)
    COMMANDS[argv[0]](argv[1:])


if __name__ == "__main__":
    main()
