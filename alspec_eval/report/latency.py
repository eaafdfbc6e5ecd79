"""The report's latency section: the paper's model (:mod:`alspec_eval.latency`) on every cell of a sweep.

A cell's projection uses its measured per-layer hit rates (sink and static cells: 1 on the layers they
approximate); the baseline row is full tensor parallelism. A self-speculation cell's uses its tau, gamma and
the draft/verify cost ratio (:func:`alspec_eval.latency.project_selfspec`, inputs stated in the note). Where the sweep's model has another number
of layers than the latency table, every layer gets the cell's mean per-layer hit rate (said in the note).

The model prices the sink's A~ (SFD over 2S fixed keys); a row of another approximation is priced from the keys its
A~ reads per decode step (``Approximation.keys_read`` at the table's context K: an ESTIMATE beyond 2S,
:meth:`LatencyModel.hit_us_reading`), so an oracle that reads every key projects no gain, and the note says so.
"""

from __future__ import annotations

import csv
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

from alspec_eval.approximations import Approximation
from alspec_eval.latency import (DEFAULT_PRESET, LatencyError, LatencyModel, Projection, SelfSpecProjection, full_tp,
                                 project_layers, project_selfspec)
from alspec_eval.report.cells import BASELINE, Row, Sweep
from alspec_eval.report.styles import row_columns, table_label
from alspec_eval.report.table import MISSING, markdown_table

__all__ = ["DEFAULT_PRESET", "SweepProjection", "keys_read", "project_sweep", "projection_markdown",
           "projection_note", "projection_rows", "write_projection_csv"]


@dataclass(frozen=True)
class SweepProjection:
    """One latency model applied to every cell of a sweep."""

    spec: LatencyModel
    tasks: list[str]
    rows: list[Row]
    entries: dict[tuple[Row, str], Projection]
    averaged: bool  # hit rates were averaged over layers (layer counts differ)
    selfspec: dict[tuple[Row, str], SelfSpecProjection] = field(default_factory=dict)

    windows: tuple[int, ...] = ()  # the sweep's S (each of a budget axis)

    @property
    def approximations(self) -> list[Approximation]:
        """The approximations of the rows that speculate attention, each once."""
        return list(dict.fromkeys(row.approx for row in self.rows if not row.exact_attention or row.drafts_tokens))


def keys_read(spec: LatencyModel, approx: Approximation, window: int) -> float:
    """Keys and values a decode step's A~ reads per KV head at the table's context K (2S where the table has no K
    and the approximation reads no more at any context)."""
    context = spec.context_tokens
    if context is None:
        keys = approx.keys_read(2**40, window)
        if keys > 2 * window:
            raise LatencyError(f"latency table {spec.name!r} has no context_tokens (K): give it to price "
                               f"{approx.label}, whose A~ reads more keys than the sink's 2S at long contexts")
        return keys
    return approx.keys_read(context, window)


def project_sweep(sweep: Sweep, spec: LatencyModel) -> SweepProjection:
    """Projected tokens/s and speedup of every measured cell the model prices (the sink's); the baseline row needs
    no cell."""
    entries: dict[tuple[Row, str], Projection] = {}
    selfspec: dict[tuple[Row, str], SelfSpecProjection] = {}
    averaged = False
    for task in sweep.tasks:
        entries[(BASELINE, task)] = full_tp(spec)
        for row in sweep.rows[1:]:
            cell = sweep.cell(task, row)
            if cell is None:
                continue
            window = int(sweep.window_of(row))
            keys = keys_read(spec, row.approx, window)
            if row.drafts_tokens:  # a task that only scores (no generations) has no tau: nothing to project
                if cell.tau is not None:
                    ss = selfspec[(row, task)] = project_selfspec(spec, cell.tau, row.gamma, window, keys)
                    entries[(row, task)] = ss.as_projection(spec.estimates)
                continue
            entries[(row, task)], avg = project_layers(spec, cell.layer_hit_rates(), keys, window)
            averaged |= avg
    return SweepProjection(spec, sweep.tasks, sweep.rows, entries, averaged, selfspec,
                           tuple(int(w or sweep.window_of(BASELINE)) for w in sweep.axis))


def projection_rows(p: SweepProjection) -> list[list[str]]:
    """Header plus "tokens/s (speedup×)" per row and task."""
    def fmt(e: Projection | None) -> str:
        return MISSING if e is None else f"{e.tokens_per_s:.1f} tok/s ({e.speedup:.2f}×)"
    return [["", *p.tasks], *([table_label(row), *(fmt(p.entries.get((row, t))) for t in p.tasks)] for row in p.rows)]


def projection_note(p: SweepProjection) -> str:
    """The table's quantities in one sentence, its estimates named, and whether hit rates were averaged."""
    s = p.spec
    note = (f"{s.num_layers} layers; per token: fixed {s.fixed_us:.4g} µs, per layer {s.per_layer_us:.4g} µs "
            f"non-attention, FD {s.fd_us:.4g} µs, SFD_S {s.sfd_s_us:.4g} µs, SFD_R {s.sfd_r_us:.4g} µs; "
            f"a hit costs {s.hit_us:.4g} µs, a miss {s.miss_us:.4g} µs.")
    if s.estimates:
        note += f" ESTIMATES, not the paper's measurements: {', '.join(s.estimates)} ({s.sources[s.estimates[0]]})."
    if p.averaged:
        note += " The measured model's layer count differs from this table's: every layer gets the mean per-layer hit rate."
    if p.selfspec:
        ss = next(iter(p.selfspec.values()))
        note += (f" Self-speculation rows: speedup = τ / (γ c + 1) (Leviathan et al., 2023) with c = draft step / "
                 f"verification step = {ss.draft_us:.4g} / {ss.verify_us:.4g} µs = {ss.cost_ratio:.3f}; ESTIMATES: the "
                 f"draft step's attention reads 2S = {2 * ss.window} keys instead of K = {ss.context_tokens or '?'} "
                 f"and takes {ss.draft_attention_us:.4g} µs per layer ({ss.draft_attention_source}), "
                 "and verifying γ + 1 tokens costs one exact decode step.")
    for window in p.windows:
        others = [a for a in p.approximations if keys_read(s, a, window) > 2 * window]
        if others:
            reads = "; ".join(f"{a.label} {keys_read(s, a, window):.0f}" + (" (an oracle: it reads every key, so it "
                                                                          "gains nothing)" if a.oracle else "")
                              for a in others)
            note += (f" Keys a hit's A~ reads per KV head at K = {s.context_tokens} against the sink's 2S = "
                     f"{2 * window}: {reads}; ESTIMATE: each extra key adds FD / K to the hit, reading K keys costs "
                     "a miss.")
    return note


def projection_markdown(p: SweepProjection) -> str:
    title = f"**{p.spec.name}**" + (f": {p.spec.description}" if p.spec.description else "")
    return f"{title}\n\n{projection_note(p)}\n\n{markdown_table(projection_rows(p))}"


def write_projection_csv(projections: Sequence[SweepProjection], path: Path) -> Path:
    """Long form: one line per preset, row and task."""
    with path.open("w", newline="") as f:
        out = csv.writer(f)
        out.writerow(["preset", "row", "policy", "lambda", "task", "hit_rate", "token_us", "tokens_per_s", "speedup",
                      "estimates"])
        for p in projections:
            for row in p.rows:
                for task in p.tasks:
                    e = p.entries.get((row, task))
                    if e is not None:
                        described = row_columns(row)
                        out.writerow([p.spec.name, row.label, described["policy"], described["lambda"], task,
                                      f"{e.hit_rate:.6g}", f"{e.token_latency_us:.6g}", f"{e.tokens_per_s:.6g}",
                                      f"{e.speedup:.6g}", ";".join(e.estimates)])
    return path
