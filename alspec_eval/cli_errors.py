"""One line, not a traceback, for a bad setting on the command line.

Library users catch :class:`~alspec_eval.config.ConfigError` (a ``ValueError``) like any exception; only
command-line processes print it as one line: the ``alspec-*`` commands through :func:`bad_input` (exit status 2,
argparse's for a wrong command line), ``lm_eval`` and ``alspec-eval run`` as ``alspec: <message>`` (exit status 1, as
every other error of lm-eval's). For the stock ``lm_eval`` command
there is no entry point of ours, so the ``.pth`` hook wraps lm-eval's ``run`` command, which installs it for a
``--model alspec`` run alone (:mod:`alspec_eval.lm_eval_cli`); ``alspec-eval run`` calls it itself. Nothing here runs
on ``import alspec_eval``.
"""

from __future__ import annotations

import sys
from types import TracebackType

PREFIX = "alspec"
BAD_INPUT = 2  # argparse's exit status for a wrong command line; every alspec-* command exits with it on bad input


def bad_input(program: str, err: BaseException) -> int:
    """Say what is wrong in one line on stderr and give the exit status; the alspec-* commands' one convention."""
    print(f"{program}: {err}", file=sys.stderr)
    return BAD_INPUT


def _one_line(previous):
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
