"""One line, not a traceback, for a bad setting on the command line.

Library users catch :class:`~alspec_eval.config.ConfigError` (a ``ValueError``) like any exception; only
command-line processes print it as ``alspec: <message>`` and exit 1. For the stock ``lm_eval`` command
there is no entry point of ours to wrap (lm-eval builds the model deep inside ``cli_evaluate``), so the
``.pth`` hook calls :func:`install_in_lm_eval`, which installs it when, and only when, the process is that console script; ``alspec-eval
run`` calls it itself. Nothing here runs on ``import alspec_eval``.
"""

from __future__ import annotations

import sys
from pathlib import Path
from types import TracebackType

PREFIX = "alspec"
LM_EVAL_SCRIPTS = ("lm_eval", "lm-eval")


def _one_line(previous):  # noqa: ANN001, ANN202 (sys.excepthook's own types)
    def excepthook(exc_type: type[BaseException], exc: BaseException, tb: TracebackType | None) -> None:
        from .config import ConfigError

        if issubclass(exc_type, ConfigError):
            print(f"{PREFIX}: {exc}", file=sys.stderr)
        else:
            previous(exc_type, exc, tb)

    excepthook.alspec = True
    return excepthook


def install() -> None:
    """Print ConfigErrors that end this process as one line (idempotent)."""
    if not getattr(sys.excepthook, "alspec", False):
        sys.excepthook = _one_line(sys.excepthook)


def install_in_lm_eval(argv: list[str]) -> None:
    """:func:`install` when this process is the stock ``lm_eval`` console script (``argv[0]``)."""
    if argv and Path(argv[0]).name in LM_EVAL_SCRIPTS:
        install()
