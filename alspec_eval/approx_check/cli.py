"""``alspec-check-approx NAME|pkg.module:Class [--approx_args ARGS]``: run the contract on an approximation.

Each property on tiny random models of three families (llama, qwen2, gemma2); one line per property and family,
"ok" or what broke. Exit 0 when every property holds, 1 when one breaks, 2 on bad input.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Callable
from typing import Any

from ..cli_errors import bad_input
from ..errors import ConfigError

PROGRAM = "alspec-check-approx"
FAMILIES = ("llama", "qwen2", "gemma2")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=PROGRAM, description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("approx", help="a registered approximation (sink, local, quest, topk, ...) or pkg.module:Class")
    p.add_argument("--approx_args", "--approx-args", dest="approx_args", default=None,
                   help="its parameters, as model_args take them: key:value;key:value (e.g. page:4)")
    p.add_argument("--window", type=int, default=8, help="S: the budget is 2S keys (the prompts are 8 to 80 tokens)")
    p.add_argument("--families", default=",".join(FAMILIES), help="tiny model families to run it on")
    return p


def main(argv: list[str] | None = None) -> None:
    args = parser().parse_args(argv)
    logging.getLogger("lm_eval").setLevel(logging.ERROR)  # its notes on a model passed as an object, per instance
    from ..config import SpeculationConfig
    from .families import CONTRACT as KNOWN

    families = [f for f in args.families.split(",") if f]
    try:
        if unknown := [f for f in families if f not in KNOWN]:
            raise ConfigError(f"--families {','.join(unknown)}: unknown; use some of {','.join(KNOWN)}")
        approx = SpeculationConfig(approx=args.approx, approx_args=args.approx_args, window=args.window).approx
    except ConfigError as err:
        sys.exit(bad_input(PROGRAM, err))
    sys.exit(0 if check(approx, args.window, families) else 1)


def check(approx, window: int, families: list[str]) -> bool:
    """Print one line per property and family; whether all hold."""
    from .families import CONTRACT
    from .models import build, char_tokenizer
    from .properties import KEY_RULES, PAGED, PROPERTIES, Contract

    tokenizer, holds = char_tokenizer(), True
    print(f"{PROGRAM}: {approx.label} at S = {window} ({approx.caption()})")
    for family in families:
        contract = Contract(approx, build(CONTRACT[family]), tokenizer, window)
        for name, prop in PROPERTIES.items():
            broken = holds_or_says_why(prop, contract)
            holds &= not broken
            skipped = name == PAGED and approx.hf_only  # it never runs in vLLM, and says why
            print(f"{family}: {name}: " + (f"not run ({approx.hf_only})" if skipped else
                                           'ok' if not broken else 'BROKEN: ' + '; '.join(broken)))
        broken = contract.broken_keys
        holds &= not broken
        print(f"{family}: {KEY_RULES}: {'ok' if not broken else 'BROKEN: ' + '; '.join(broken)}")
    return holds


def holds_or_says_why(prop: Callable[[Any], list[str]], contract: Any) -> list[str]:
    """What ``prop`` says broke, or, where the draft raised (its own code, or an engine refusing it), the exception
    in one line: a broken draft is a failed property, never a traceback."""
    try:
        return prop(contract)
    except Exception as err:  # anything the draft's code raises breaks the property
        return [f"{type(err).__name__}: {' '.join(str(err).split())}"]


if __name__ == "__main__":
    main()
