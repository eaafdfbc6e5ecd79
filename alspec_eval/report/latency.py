"""Projected decode latency under attention-level speculation (the paper's Appendix F model).

On a two-device ALSpec pipeline the speculative flash decode emits A~ (its first partial result)
after ``speculative_us``; the second device starts the post-attention ops with it at once. On a hit
the exact attention finishes off the critical path, so the layer costs speculative + non-attention;
on a miss the exact attention is paid in full, plus ``miss_overhead_us`` for whatever a miss costs
beyond that (re-syncing the devices; 0 by default, as the paper's figure could not be checked).
With h_l the measured hit rate of layer l:

    T_base = sum_l (attn_l + non_l)
    T_spec = sum_l [ h_l (spec_l + non_l) + (1 - h_l) (attn_l + non_l + miss) ]
    tokens/s = 1e6 / T,   speedup = T_base / T_spec

Sink and static cells replace attention unconditionally, so h_l is 1 on their approximated layers and
no miss overhead is paid on the others. When the latency table has a different number of layers than
the measured model, every target layer gets the measured mean per-layer hit rate.
"""

from __future__ import annotations

import csv
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import yaml

from alspec_eval.report.load import BASELINE, Row, Sweep
from alspec_eval.report.table import MISSING, markdown_table


class LatencyError(ValueError):
    """A latency file or preset that cannot be used; the message names the field and the fix."""


@dataclass(frozen=True)
class LatencySpec:
    """Per-layer decode latencies in microseconds for one device, model and context length."""

    name: str
    non_attention_us: tuple[float, ...]
    attention_us: tuple[float, ...]
    speculative_us: tuple[float, ...]
    miss_overhead_us: float = 0.0
    description: str = ""

    @property
    def num_layers(self) -> int:
        return len(self.attention_us)

    @property
    def baseline_us(self) -> float:
        return sum(self.attention_us) + sum(self.non_attention_us)

    @classmethod
    def from_mapping(cls, d: dict[str, Any], default_name: str) -> "LatencySpec":
        """Scalars apply to every layer (then ``num_layers`` is required); lists give one value per layer."""
        fields = ("non_attention_us", "attention_us", "speculative_us")
        missing = [k for k in fields if k not in d]
        if missing:
            raise LatencyError(f"latency spec {default_name!r} lacks {', '.join(missing)}; give microseconds per layer "
                               "(a number, or a list with one number per layer)")
        lists = {k: d[k] for k in fields if isinstance(d[k], list)}
        num_layers = d.get("num_layers") or (len(next(iter(lists.values()))) if lists else None)
        if not isinstance(num_layers, int) or num_layers < 1:
            raise LatencyError(f"latency spec {default_name!r}: set num_layers (an integer >= 1) when all latencies are scalars")
        values: dict[str, tuple[float, ...]] = {}
        for k in fields:
            v = d[k] if isinstance(d[k], list) else [d[k]] * num_layers
            if len(v) != num_layers or not all(isinstance(x, (int, float)) and x >= 0 for x in v):
                raise LatencyError(f"latency spec {default_name!r}: {k} must be a number >= 0 or a list of "
                                   f"{num_layers} such numbers")
            values[k] = tuple(float(x) for x in v)
        miss = d.get("miss_overhead_us", 0.0)
        if not isinstance(miss, (int, float)) or miss < 0:
            raise LatencyError(f"latency spec {default_name!r}: miss_overhead_us must be a number >= 0")
        return cls(name=str(d.get("name", default_name)), miss_overhead_us=float(miss),
                   description=str(d.get("description", "")), **values)


def load_latency(path: str | Path) -> LatencySpec:
    """Read a user's latency table from YAML (.yaml/.yml) or JSON."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as e:
        raise LatencyError(f"cannot read latency file {path}: {e.strerror}") from None
    try:
        data = yaml.safe_load(text) if path.suffix in (".yaml", ".yml") else json.loads(text)
    except (yaml.YAMLError, json.JSONDecodeError) as e:
        raise LatencyError(f"latency file {path} does not parse: {' '.join(str(e).split())}") from None
    if not isinstance(data, dict):
        raise LatencyError(f"latency file {path} must hold a mapping with non_attention_us, attention_us, speculative_us")
    return LatencySpec.from_mapping(data, path.stem)


@dataclass(frozen=True)
class Projected:
    """Projected token latency of one (row, task)."""

    token_us: float
    speedup: float

    @property
    def tokens_per_s(self) -> float:
        return 1e6 / self.token_us


def project_rates(spec: LatencySpec, hit_rates: Sequence[float], speculative: bool = True) -> Projected:
    """Apply the formula above to per-layer hit rates already matched to ``spec``'s layers.

    ``speculative`` is False for sink/static, which never verify and so never pay a miss.
    """
    miss = spec.miss_overhead_us if speculative else 0.0
    total = sum(h * (s + n) + (1 - h) * (a + n + miss)
                for h, s, a, n in zip(hit_rates, spec.speculative_us, spec.attention_us, spec.non_attention_us))
    return Projected(total, spec.baseline_us / total)


def matched_hit_rates(measured: Sequence[float], num_layers: int) -> tuple[list[float], bool]:
    """Per-layer rates if the layer counts agree, else the mean everywhere; the flag says which."""
    if len(measured) == num_layers:
        return list(measured), False
    mean = sum(measured) / len(measured) if measured else 0.0
    return [mean] * num_layers, True


@dataclass(frozen=True)
class Projection:
    """One latency spec applied to every cell of a sweep."""

    spec: LatencySpec
    tasks: list[str]
    rows: list[Row]
    entries: dict[tuple[Row, str], Projected]
    averaged: bool  # hit rates were averaged over layers (layer counts differ)


def project(sweep: Sweep, spec: LatencySpec) -> Projection:
    """Projected tokens/s and speedup of every measured cell; the baseline row needs no cell."""
    entries: dict[tuple[Row, str], Projected] = {}
    averaged = False
    for task in sweep.tasks:
        entries[(BASELINE, task)] = Projected(spec.baseline_us, 1.0)
        for row in sweep.rows[1:]:
            cell = sweep.cell(task, row)
            if cell is None:
                continue
            rates, avg = matched_hit_rates(cell.layer_hit_rates(), spec.num_layers)
            averaged |= avg
            entries[(row, task)] = project_rates(spec, rates, speculative=cell.policy == "dynamic")
    return Projection(spec, sweep.tasks, sweep.rows, entries, averaged)


def projection_rows(p: Projection) -> list[list[str]]:
    """Header plus "tokens/s (speedup×)" per row and task."""
    def fmt(e: Projected | None) -> str:
        return MISSING if e is None else f"{e.tokens_per_s:.1f} tok/s ({e.speedup:.2f}×)"
    return [["", *p.tasks], *([row.label, *(fmt(p.entries.get((row, t))) for t in p.tasks)] for row in p.rows)]


def projection_note(p: Projection) -> str:
    """The spec's totals in one sentence, and whether hit rates had to be averaged over layers."""
    s = p.spec
    note = (f"{s.num_layers} layers; per token: non-attention {sum(s.non_attention_us):.0f} µs, exact attention "
            f"{sum(s.attention_us):.0f} µs, speculative attention {sum(s.speculative_us):.0f} µs, "
            f"miss overhead {s.miss_overhead_us:g} µs per missed layer.")
    if p.averaged:
        note += " The measured model's layer count differs from this table's: every layer gets the mean per-layer hit rate."
    return note


def projection_markdown(p: Projection) -> str:
    title = f"**{p.spec.name}**" + (f": {p.spec.description}" if p.spec.description else "")
    return f"{title}\n\n{projection_note(p)}\n\n{markdown_table(projection_rows(p))}"


def write_projection_csv(projections: Sequence[Projection], path: Path) -> Path:
    """Long form: one line per preset, row and task."""
    with path.open("w", newline="") as f:
        out = csv.writer(f)
        out.writerow(["preset", "row", "policy", "lambda", "task", "token_us", "tokens_per_s", "speedup"])
        for p in projections:
            for row in p.rows:
                for task in p.tasks:
                    e = p.entries.get((row, task))
                    if e is not None:
                        out.writerow([p.spec.name, row.label, row.kind, f"{row.lam:g}" if row.kind == "dynamic" else "",
                                      task, f"{e.token_us:.6g}", f"{e.tokens_per_s:.6g}", f"{e.speedup:.6g}"])
    return path
