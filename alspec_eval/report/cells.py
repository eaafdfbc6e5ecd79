"""Reading a sweep's output folder (sweep.json + cells/<task>/<cell>.json) into plain dataclasses.

The files as frozen records with a lookup by (task, row); :mod:`.frames` turns them into tidy pandas frames.
"""

from __future__ import annotations

import functools
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from alspec_eval.config import canonical_policy
from alspec_eval.approximations import DEFAULT, Approximation, make_approximation, order
from alspec_eval.approximations import names as registry_names
from alspec_eval.rows import BASELINE, SINK, STATIC, Row
from alspec_eval.stats import (DENSITY, EFFECTIVE_DENSITY, OUTPUT_ERROR, PROMISE_DENOMINATOR, PROMISE_DN, RATIO_EDGES,
                               SCHEMA_VERSION)

__all__ = ["BASELINE", "SINK", "STATIC", "Cell", "LayerStats", "NoCellsError", "Row", "Sweep", "load_cell", "load_sweep"]

READABLE_SCHEMAS = (1, SCHEMA_VERSION)


class NoCellsError(FileNotFoundError):
    """The folder holds no finished cell; raised so the CLI can print one line with the fix."""


@dataclass(frozen=True)
class LayerStats:
    """One layer's (or the total's) speculation counts and d/n histogram (schema version 2; version 1 has the same fields)."""

    speculated: int
    accepted: int
    trivial: int
    hit_rate: float | None
    hist: tuple[int, ...]
    skipped: str | None = None
    density: float | None = None  # the share of the context A~ reads (stats.DENSITY); None in older files
    effective_density: float | None = None  # with rejections falling back to A (stats.EFFECTIVE_DENSITY)
    output_error: float | None = None  # mean d/n (stats.OUTPUT_ERROR)
    # a draft's promise, realized: the share of d/n above its epsilon, of denominators missed (None: no promise)
    promise_dn: float | None = None
    promise_denominator: float | None = None

    @classmethod
    def from_dict(cls, d: dict[str, Any], skipped: str | None = None) -> "LayerStats":
        return cls(int(d["speculated"]), int(d["accepted"]), int(d["trivial"]), d.get("hit_rate"),
                   tuple(int(x) for x in d["hist"]), d.get("skipped", skipped), d.get(DENSITY),
                   d.get(EFFECTIVE_DENSITY), d.get(OUTPUT_ERROR), d.get(PROMISE_DN), d.get(PROMISE_DENOMINATOR))


@dataclass(frozen=True)
class Cell:
    """One finished (task, policy, lambda) evaluation with its statistics."""

    task: str
    name: str
    policy: str
    lam: float | None
    static_layers: tuple[int, ...] | None
    metric: str
    score: float | None
    metrics: dict[str, Any]
    layers: tuple[LayerStats, ...]
    total: LayerStats
    samples: int | None = None
    elapsed_s: float | None = None
    sample_log: tuple[dict[str, Any], ...] = ()  # per document: doc_id, filter and the metric values
    gamma: int | None = None  # selfspec: tokens drafted per step
    draft: dict[str, Any] | None = None  # selfspec with generations: gamma, steps, drafted, accepted, tau, hist
    schedule: dict[str, Any] | None = None  # a tuned row's per-layer lambdas: schedule, path, sha256
    approx: str = DEFAULT  # which 2S keys A~ attended to, by name (cells before approximations: the default's)
    approx_args: dict[str, Any] | None = None  # its parameters
    window: int | None = None  # its S where the sweep has several (a budget axis)
    page: int | None = None  # quest's page, as cells before the registry of approximations record it
    engine: str = "hf"  # what ran it: hf (--model alspec) or vllm (--model alspec-vllm); cells before engines: hf

    @functools.cached_property
    def row(self) -> Row:
        """The row the cell file records (read once: every property below asks it)."""
        return Row.from_record(self.policy, self.lam, self.gamma, self.schedule, self.approx, self.approx_args,
                               self.page, self.window)

    @property
    def hit_rate(self) -> float | None:
        """Share of non-trivial decisions that used the approximation; None for the exact baseline and for
        token-level self-speculation (its attention is exact)."""
        return None if self.row.exact_attention else self.total.hit_rate

    @property
    def tau(self) -> float | None:
        """Self-speculation's mean tokens per verification step; None for the other policies and for a task that
        generates nothing (loglikelihood scoring is exact under selfspec)."""
        return None if self.draft is None else self.draft["tau"]

    def layer_hit_rates(self) -> list[float]:
        """Per-layer share of attention replaced by A~ (0 where nothing was speculated or attention is exact)."""
        if self.row.exact_attention:
            return [0.0] * len(self.layers)
        return [layer.hit_rate or 0.0 for layer in self.layers]


@dataclass
class Sweep:
    """All cells of one output folder, with the sweep's declared tasks and lambdas."""

    outdir: Path
    meta: dict[str, Any]
    cells: list[Cell] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._index: dict[tuple[str, Row], Cell] = {}
        for cell in self.cells:
            key = (cell.task, cell.row)
            if key in self._index:
                raise ValueError(f"{self.outdir}: cells {self._index[key].name!r} and {cell.name!r} of task "
                                 f"{cell.task!r} are both the {cell.row.label} row; remove one")
            self._index[key] = cell

    @property
    def model(self) -> str | None:
        """The model as sweep.json names it (``model``, or the runner's ``model_args.pretrained``)."""
        return self.meta.get("model") or (self.meta.get("model_args") or {}).get("pretrained")

    @property
    def tasks(self) -> list[str]:
        """Tasks in sweep.json order, then any others that have cells."""
        declared = list(self.meta.get("tasks") or [])
        return declared + sorted({c.task for c in self.cells} - set(declared))

    @property
    def lambdas(self) -> list[float]:
        """Declared and measured lambdas, sorted."""
        found = {c.row.lam for c in self.cells if c.row.lam is not None}
        return sorted(found | {_as_lambda(x) for x in self.meta.get("lambdas") or []})

    @property
    def gammas(self) -> list[int]:
        """Declared and measured self-speculation draft lengths, sorted."""
        found = {c.gamma for c in self.cells if c.gamma is not None}
        return sorted(found | set(self.meta.get("gammas") or []))

    @functools.cached_property
    def approximations(self) -> list[Approximation]:
        """Every approximation of A~ the sweep declares (sweep.json's ``approx`` and ``approx_args``, a name's list of
        settings one each; sweeps before approximations: the sink; before the registry: quest's ``page``) or has a
        cell for, in :meth:`approx_order`."""
        found = {c.row.approx for c in self.cells if c.row != BASELINE}
        return sorted(dict.fromkeys([*self._declared, *found]), key=self.approx_order)

    @functools.cached_property
    def _declared(self) -> list[Approximation]:
        """The approximations sweep.json declares, in its order (a name at several settings: each, in order)."""
        args = self.meta.get("approx_args") or {}
        page = self.meta.get("page")
        out = []
        for name in self.meta.get("approx") or [DEFAULT]:
            given = args.get(name, {"page": page} if page is not None and name == "quest" else None)
            out += [make_approximation(name, setting) for setting in (given if isinstance(given, list) else [given])]
        return list(dict.fromkeys(out))

    def approx_order(self, approx: Approximation) -> tuple:
        """Sort key: the registry's order; one approximation's settings as sweep.json lists them (others found only
        in cells after them, by their parameters)."""
        place, names = self._places
        known, name, slug = order(approx, names)
        return known, name, place.get(approx, len(place)), slug

    @functools.cached_property
    def _places(self) -> tuple[dict[Approximation, int], list[str]]:
        """What :meth:`approx_order` compares, made once: each declared approximation's place, and the registry's
        names (its entry points are read from every installed package's metadata)."""
        return {a: i for i, a in enumerate(self._declared)}, registry_names()

    @functools.cached_property
    def rows(self) -> list[Row]:
        """Every row the sweep declares or has a cell for, in Table 1's order: kinds in rows.KINDS order, rows of one
        kind by lambda or gamma, then by approximation (sink, quest, topk), so that each lambda's approximations
        stand together (a sweep run with ``static: false`` declares no static row; rows only found in cells, such
        as tuned ones, by name)."""
        static = [STATIC] if self.meta.get("static_p", 0.8) is not None else []
        declared = [row.approximated(approx, window) for approx in self.approximations for window in self.axis
                    for row in [*map(Row.dynamic, self.lambdas), SINK, *static, *map(Row.selfspec, self.gammas)]]
        rows = {BASELINE, *declared, *(c.row for c in self.cells)}
        return sorted(rows, key=lambda r: (r.order, r.lam or 0.0, r.gamma or 0, self.approx_order(r.approx), r.name))

    def cell(self, task: str, row: Row) -> Cell | None:
        return self._index.get((task, row))

    @property
    def axis(self) -> list[int | None]:
        """The windows of a budget axis (sweep.json's ``window`` a list), else [None]: the sweep's one."""
        window = self.meta.get("window")
        return list(window) if isinstance(window, list) else [None]

    @property
    def curves(self) -> list[tuple[Approximation, int | None]]:
        """Every (approximation, window) whose lambda rows draw one curve: each approximation at each window of a
        budget axis (window None: the sweep's one)."""
        return [(approx, window) for approx in self.approximations for window in self.axis]

    def window_of(self, row: Row) -> int | None:
        """The S a row ran with: its own on a budget axis, else the sweep's (the baseline of an axis: its first)."""
        return row.window or self.axis[0] or self.meta.get("window")

    def dynamic_cells(self, task: str, approx: Approximation | None = None, window: int | None = None) -> list[Cell]:
        """The task's lambda cells of one approximation (None: the default) and window (on a budget axis), by
        increasing lambda."""
        return [c for lam in self.lambdas
                if (c := self.cell(task, Row.dynamic(lam, approx).approximated(approx, window))) is not None]


def _as_lambda(value: Any) -> float | None:
    """Cells store lambda as a float, the string "inf" (sink) or null."""
    if value is None:
        return None
    return math.inf if value == "inf" else float(value)


def load_cell(path: Path) -> Cell:
    """Parse one cell file; a statistics schema this version cannot read is an error, not a silent misread."""
    try:
        d = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not valid JSON ({e}); delete it and re-run that cell") from None
    stats = d.get("alspec") or {}
    if stats.get("schema_version", SCHEMA_VERSION) not in READABLE_SCHEMAS:  # v2 only adds ``selfspec``
        raise ValueError(f"{path}: statistics schema_version {stats['schema_version']} is not {SCHEMA_VERSION}; "
                         "re-run the cell with this alspec-eval")
    edges = stats.get("ratio_edges")
    if edges is not None and not _same_edges(edges):
        raise ValueError(f"{path}: ratio_edges differ from the schema's; re-run the cell with this alspec-eval")
    skipped = {int(k): v for k, v in (stats.get("skipped_layers") or {}).items()}
    layers = tuple(LayerStats.from_dict(x, skipped.get(int(x["layer"]))) for x in stats.get("layers", []))
    total = LayerStats.from_dict(stats["total"]) if "total" in stats else LayerStats(0, 0, 0, None, ())
    static = d.get("static_layers")
    return Cell(task=d["task"], name=d.get("cell", path.stem), policy=canonical_policy(d["policy"]), lam=_as_lambda(d.get("lambda")),
                static_layers=tuple(static) if static is not None else None, metric=d.get("metric", ""),
                score=d.get("score"), metrics=d.get("metrics") or {}, layers=layers, total=total,
                samples=d.get("samples"), elapsed_s=d.get("elapsed_s"), sample_log=tuple(d.get("sample_log") or ()),
                gamma=d.get("gamma", (stats.get("selfspec") or {}).get("gamma")), draft=stats.get("selfspec"),
                schedule=d.get("lambda_schedule"), approx=d.get("approx") or DEFAULT,
                approx_args=d.get("approx_args"), page=d.get("page"), window=d.get("window"),
                engine=d.get("engine", "hf"))


def _same_edges(edges: list[float]) -> bool:
    return len(edges) == len(RATIO_EDGES) and all(math.isclose(a, b, rel_tol=1e-9) for a, b in zip(edges, RATIO_EDGES))


def load_sweep(outdir: str | Path) -> Sweep:
    """Load every finished cell of ``outdir``; raises NoCellsError when there is none."""
    outdir = Path(outdir)
    meta_path = outdir / "sweep.json"
    meta = json.loads(meta_path.read_text()) if meta_path.is_file() else {}
    cells = [load_cell(p) for p in sorted(outdir.glob("cells/*/*.json"))]
    if not cells:
        raise NoCellsError(f"{outdir} has no finished cells (expected {outdir / 'cells' / '<task>' / '<cell>.json'}); "
                           "run a lambda sweep into this folder first, or pass the sweep's output folder")
    return Sweep(outdir, meta, cells)
