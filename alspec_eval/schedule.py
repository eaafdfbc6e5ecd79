"""Per-layer lambda schedules (``lambda_schedule=PATH``): one threshold per decoder layer instead of one for all.

A schedule file is JSON: a list with one lambda per decoder layer, or ``{"default": x, "layers": {"3": y, ...}}``.
Values are numbers >= 0 or the string ``"inf"`` (the layer always takes A~). What a result records is the schedule
itself with its path and a digest, so a result always says which schedule produced it.
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .errors import ConfigError

DEFAULT_LAMBDA = 0.1  # SpeculationConfig's lambda when none is given; a schedule goes with it only
EXAMPLE = 'e.g. [0.1, 0.2, ...] with one value per layer, or {"default": 0.1, "layers": {"3": 0.4}}'


def _threshold(value: Any, where: str) -> float:
    if value == "inf":
        return math.inf
    if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value) or value < 0:
        raise ConfigError(f"{where}={value!r} is not a lambda; use a number >= 0 or \"inf\" ({EXAMPLE})")
    return float(value)


@dataclass(frozen=True)
class LambdaSchedule:
    """Per-layer lambdas: ``layers`` (index, lambda) pairs, every other layer ``default`` (None: the list form,
    which names every layer)."""

    default: float | None
    layers: tuple[tuple[int, float], ...]
    path: str | None = None

    @classmethod
    def from_json(cls, data: Any, source: str = "lambda_schedule", path: str | None = None) -> LambdaSchedule:
        """Parse the file's JSON; every mistake is one ConfigError that names it and the fix."""
        if isinstance(data, list):
            if not data:
                raise ConfigError(f"{source}: the list is empty; give one lambda per decoder layer ({EXAMPLE})")
            return cls(None, tuple((i, _threshold(v, f"{source}[{i}]")) for i, v in enumerate(data)), path)
        if not isinstance(data, dict) or set(data) - {"default", "layers"} or "default" not in data:
            raise ConfigError(f"{source}: expected a list or a mapping with \"default\" and \"layers\" ({EXAMPLE})")
        layers = data.get("layers") or {}
        if not isinstance(layers, dict):
            raise ConfigError(f"{source}: \"layers\" must map layer indices to lambdas ({EXAMPLE})")
        pairs = []
        for key, value in layers.items():
            if not str(key).isdigit():
                raise ConfigError(f"{source}: layer {key!r} is not a layer index (0, 1, ...)")
            pairs.append((int(key), _threshold(value, f"{source}.layers[{key}]")))
        return cls(_threshold(data["default"], f"{source}.default"), tuple(sorted(pairs)), path)

    @classmethod
    def load(cls, path: str | Path) -> LambdaSchedule:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"lambda_schedule={str(path)!r} does not exist; give the path of a schedule JSON "
                              f"({EXAMPLE}), e.g. the schedule.json that alspec-tune writes")
        try:
            data = json.loads(path.read_text())
        except json.JSONDecodeError as err:
            raise ConfigError(f"lambda_schedule={str(path)!r} is not valid JSON ({err})") from None
        return cls.from_json(data, f"lambda_schedule {path}", str(path))

    @classmethod
    def of(cls, lambdas: list[float], path: str | None = None) -> LambdaSchedule:
        """The list form of ``lambdas``."""
        return cls(None, tuple(enumerate(float(x) for x in lambdas)), path)

    def check_layers(self, num_layers: int) -> None:
        """The schedule against the model's layer count (known before the weights load)."""
        if self.default is None and len(self.layers) != num_layers:
            raise ConfigError(f"lambda_schedule{f' {self.path}' if self.path else ''} gives {len(self.layers)} "
                              f"lambdas, but the model has {num_layers} decoder layers; give one per layer, or "
                              '{"default": x, "layers": {...}} for a few')
        bad = [i for i, _ in self.layers if i >= num_layers]
        if bad:
            raise ConfigError(f"lambda_schedule names layers {bad}, but the model has {num_layers} layers "
                              f"(0..{num_layers - 1}); drop them")

    def lambdas(self, num_layers: int) -> list[float]:
        """One lambda per layer."""
        out = [self.default if self.default is not None else math.nan] * num_layers
        for i, lam in self.layers:
            out[i] = lam
        return out

    def layer_lambda(self, layer: int) -> float:
        """``layer``'s lambda (asked once per layer and forward pass: a lookup, not a scan)."""
        return self._by_layer.get(layer, self.default)

    @functools.cached_property
    def _by_layer(self) -> dict[int, float]:
        return dict(self.layers)

    def to_json(self) -> Any:
        """The file's form (what :meth:`from_json` reads back)."""
        def enc(x: float) -> float | str:
            return x if math.isfinite(x) else "inf"

        if self.default is None:
            return [enc(lam) for _, lam in self.layers]
        return {"default": enc(self.default), "layers": {str(i): enc(lam) for i, lam in self.layers}}

    @property
    def digest(self) -> str:
        """SHA-256 of the schedule's canonical JSON (not of its path)."""
        return hashlib.sha256(json.dumps(self.to_json(), sort_keys=True).encode()).hexdigest()

    def to_dict(self) -> dict[str, Any]:
        """What a result records: the schedule, its path and digest."""
        return {"schedule": self.to_json(), "path": self.path, "sha256": self.digest}
