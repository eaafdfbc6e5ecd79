"""What produced an output file: package versions and the model, recorded in every result this tool writes."""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version
from typing import Any

PACKAGES = ("alspec-eval", "lm_eval", "transformers", "torch")


def versions() -> dict[str, str | None]:
    found: dict[str, str | None] = {}
    for name in PACKAGES:
        try:
            found[name] = version(name)
        except PackageNotFoundError:
            found[name] = None
    return found


def provenance(model_args: dict[str, Any]) -> dict[str, Any]:
    """The model (as loaded: its resolved path or hub id and the other model_args) and the package versions."""
    return {"model_args": {k: str(v) for k, v in sorted(model_args.items())}, "versions": versions()}
