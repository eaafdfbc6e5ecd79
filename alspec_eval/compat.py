"""The lm-eval versions the adapter is tested with (it relies on HFLM internals; see setup.cfg)."""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

from .config import ConfigError

TESTED_LM_EVAL = ("0.4.13",)


def check_lm_eval() -> None:
    """One clear line, before any model loads, where the installed lm-eval is not one the adapter is tested with."""
    try:
        found = version("lm_eval")
    except PackageNotFoundError:
        return  # a source checkout without metadata: nothing to compare
    if found not in TESTED_LM_EVAL:
        raise ConfigError(f"lm-eval {found} is installed, but alspec-eval is tested with lm-eval "
                          f"{', '.join(TESTED_LM_EVAL)} (it relies on HFLM internals); "
                          f"run pip install 'lm-eval=={TESTED_LM_EVAL[-1]}'")
