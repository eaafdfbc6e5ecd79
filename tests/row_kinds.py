"""Every kind of sweep row, one example each, with the model_args a user would write to run it alone (as kvpress's
tests/default_presses.py lists its presses): tests parametrize over :func:`examples`, so a new kind is tested by
adding it here (a test fails until every kind in rows.KINDS has an example)."""

from __future__ import annotations

import json
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from alspec_eval.rows import BASELINE, SINK, STATIC, Row
from alspec_eval.schedule import LambdaSchedule


@dataclass(frozen=True)
class Example:
    row: Row
    static_layers: tuple[int, ...]  # a static row's calibrated layers
    model_args: dict[str, Any]  # the same row as `--model_args` of a run on its own

    @property
    def id(self) -> str:
        return self.row.kind


def examples(lam: float, layers: int = 3, folder: Path | None = None) -> list[Example]:
    """One row of each kind for a model of ``layers`` layers; ``lam`` a lambda that accepts some and rejects some.
    The tuned row's schedule is written to ``folder`` (a new temporary one by default)."""
    folder = Path(tempfile.mkdtemp()) if folder is None else folder
    lambdas = [lam / 2, 4 * lam, lam, 2 * lam][:layers] + [lam] * max(layers - 4, 0)
    path = folder / "schedule.json"
    path.write_text(json.dumps(lambdas))
    return [
        Example(BASELINE, (), {"policy": "exact"}),
        Example(Row.dynamic(lam), (), {"lambda": lam}),
        Example(SINK, (), {"policy": "always"}),
        Example(STATIC, (1,), {"policy": "static", "static_layers": "1"}),
        Example(Row.selfspec(2), (), {"policy": "selfspec", "gamma": 2}),
        Example(Row.tuned(LambdaSchedule.load(path)), (), {"lambda_schedule": str(path)}),
    ]
