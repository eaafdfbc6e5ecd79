"""Figures of a sweep: per-layer acceptance heatmaps, score against hit rate, open-loop acceptance, and for a sweep
of several approximations of A~ the per-layer hit rate of each at one lambda.

Figures are built with the object API on the Agg canvas, so making them never touches pyplot's
global backend (the notebook keeps its inline one).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
from matplotlib import colormaps
from matplotlib.colors import to_rgba
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from alspec_eval.report.cells import BASELINE, Row, Sweep
from alspec_eval.approximations import DEFAULT, Approximation, default_approximation, make_approximation
from alspec_eval.report.styles import approx_label, curve_label, hit_rate_legend, style
from alspec_eval.report.table import beyond_sink
from alspec_eval.stats import OPEN_LOOP_GRID, open_loop

if TYPE_CHECKING:
    import pandas as pd
    from matplotlib.axes import Axes

    from alspec_eval.report.latency import SweepProjection


def _figure(width: float, height: float) -> Figure:
    fig = Figure(figsize=(width, height), layout="constrained")
    FigureCanvasAgg(fig)
    return fig


# Label offsets (points) tried in turn around a point, nearest first: right/left, above/below, then further out.
LABEL_OFFSETS: tuple[tuple[int, int], ...] = tuple(
    (dx, sign * dy) for dy in (3, 14, 25, 36, 47) for sign in (1, -1) for dx in (5, -5))

Label = tuple["Axes", float, float, str, dict[str, Any]]  # axes, data x, data y, text, annotate keywords


def place_labels(fig: Figure, labels: list[Label]) -> None:
    """Label points so that no two labels overlap. Points that coincide on screen (within 4 px) share one label
    ("λ = 0.05, λ = 0.1, sink"); each label takes the first offset of LABEL_OFFSETS whose box meets no label placed
    before it and stays inside the axes (else the first that meets no label). Labels stay out of the layout, which
    is drawn first, so the boxes checked are the boxes saved."""
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    groups: dict[int, list[list[Any]]] = {}  # per axes: [display xy, data xy, texts, keywords]
    for ax, x, y, text, kw in labels:
        px = ax.transData.transform((x, y))
        same = next((g for g in groups.setdefault(id(ax), []) if g[3] == kw and np.abs(g[0] - px).max() <= 4), None)
        if same is None:
            groups[id(ax)].append([px, (ax, x, y), [text], kw])
        else:
            same[2].append(text)
    for ax_groups in groups.values():
        boxes = []
        for _, (ax, x, y), texts, kw in ax_groups:
            frame = ax.get_window_extent(renderer)
            text = ", ".join(dict.fromkeys(texts))
            free = []  # (inside the axes, offset index) of every offset whose box meets no placed label
            for i, (dx, dy) in enumerate(LABEL_OFFSETS):
                note = ax.annotate(text, (x, y), textcoords="offset points", xytext=(dx, dy),
                                   ha="left" if dx > 0 else "right", va="bottom" if dy > 0 else "top", **kw)
                box = note.get_window_extent(renderer)
                note.remove()
                if not any(box.overlaps(b) for b in boxes):
                    inside = frame.x0 <= box.x0 and box.x1 <= frame.x1 and frame.y0 <= box.y0 and box.y1 <= frame.y1
                    free.append((not inside, i))
                    if inside:
                        break
            dx, dy = LABEL_OFFSETS[min(free)[1] if free else -1]
            note = ax.annotate(text, (x, y), textcoords="offset points", xytext=(dx, dy),
                               ha="left" if dx > 0 else "right", va="bottom" if dy > 0 else "top", **kw)
            note.set_in_layout(False)
            boxes.append(note.get_window_extent(renderer))


def _task_colours(sweep: Sweep) -> dict[str, tuple[float, ...]]:
    cmap = colormaps["tab10"]
    return {task: cmap(i % 10) for i, task in enumerate(sweep.tasks)}


def acceptance_heatmap(sweep: Sweep, task: str, approx: Approximation | None = None,
                       window: int | None = None) -> Figure:
    """Per-layer hit rate (layers x lambda) of the task's dynamic cells of one approximation (None: the default) at
    one window of a budget axis; skipped layers stay blank."""
    approx = default_approximation() if approx is None else approx
    cells = sweep.dynamic_cells(task, approx, window)
    num_layers = max((len(c.layers) for c in cells), default=0)
    grid = np.full((num_layers, len(cells)), np.nan)
    for j, cell in enumerate(cells):
        for i, layer in enumerate(cell.layers):
            if layer.hit_rate is not None:
                grid[i, j] = 100 * layer.hit_rate
    fig = _figure(2.2 + 0.9 * max(len(cells), 1), 1.6 + 0.22 * max(num_layers, 4))
    ax = fig.add_subplot()
    image = ax.imshow(grid, aspect="auto", origin="lower", cmap="viridis", vmin=0, vmax=100, interpolation="nearest")
    ax.set_xticks(range(len(cells)), [f"{c.lam:g}" for c in cells])
    ax.set_yticks(range(num_layers), [str(i) for i in range(num_layers)], fontsize=7 if num_layers > 16 else 9)
    ax.set_xlabel("λ")
    ax.set_ylabel("layer")
    ax.set_title(f"{task}: per-layer acceptance" + ("" if approx.is_default and window is None
                                                     else f", {curve_label(approx, window)}"))
    if grid.size <= 240:
        for (i, j), v in np.ndenumerate(grid):
            if not math.isnan(v):
                ax.text(j, i, f"{v:.0f}", ha="center", va="center", fontsize=6, color="white" if v < 60 else "black")
    fig.colorbar(image, ax=ax, label="hit rate (%)")
    return fig


def schedule_profile(sweep: Sweep, row: Row) -> Figure:
    """A tuned schedule's per-layer lambda (bars) and each task's measured per-layer hit rate (lines)."""
    num_layers = max((len(c.layers) for task in sweep.tasks if (c := sweep.cell(task, row)) is not None), default=0)
    lambdas = row.schedule.lambdas(num_layers)
    fig = _figure(2.4 + 0.22 * max(num_layers, 8), 3.8)
    ax = fig.add_subplot()
    finite = [lam for lam in lambdas if math.isfinite(lam) and lam > 0]
    top = max(finite, default=1.0) * 4
    ax.bar(range(num_layers), [min(lam, top) if lam > 0 else 0 for lam in lambdas], color="tab:gray", alpha=0.5,
           label="λ (∞ drawn at the top)")
    ax.set_yscale("symlog", linthresh=min(finite, default=1e-3))
    ax.set_xlabel("layer")
    ax.set_ylabel("λ")
    hits = ax.twinx()
    for task in sweep.tasks:
        if (cell := sweep.cell(task, row)) is not None:
            hits.plot(range(len(cell.layers)), [100 * (layer.hit_rate or 0.0) for layer in cell.layers], "o-",
                      markersize=3, label=f"{task} hit rate")
    hits.set_ylabel("hit rate (%)")
    hits.set_ylim(-5, 105)
    handles = ax.get_legend_handles_labels()[0] + hits.get_legend_handles_labels()[0]
    fig.legend(handles=handles, loc="outside lower center", ncol=3, fontsize=7)
    ax.set_title(f"{row.label}: per-layer λ and hit rate", fontsize=9)
    return fig


def score_vs_hit_rate(sweep: Sweep) -> Figure:
    """One panel per task (so tasks whose sink points coincide stay apart): the lambda cells as a line, the baseline
    dashed, the kinds whose style has a hit-rate legend (sink, static) as markers. A sweep of several
    approximations draws each one's lambda line and markers in its own colour (its class's marker and colour),
    labelled with it."""
    tasks = sweep.tasks
    cols = min(3, len(tasks))
    rows = math.ceil(len(tasks) / cols)
    fig = _figure(4.4 * cols + 0.4, 3.6 * rows + 0.5)
    axes = fig.subplots(rows, cols, squeeze=False)
    colours = _task_colours(sweep)
    several = beyond_sink(sweep) or len(sweep.curves) > 1  # a sweep of the sink at one window: as before
    shades = {w: 1.0 - 0.5 * i / max(len(sweep.axis) - 1, 1) for i, w in enumerate(sweep.axis)}  # darker: smaller S

    def colour_of(approx: Approximation, task: str, window: int | None = None) -> Any:
        if not several:
            return colours[task]
        if len(shades) == 1:
            return approx.colour
        red, green, blue, _ = to_rgba(approx.colour)
        return (red * shades[window], green * shades[window], blue * shades[window])

    def named(text: str, approx: Approximation, window: int | None = None) -> str:
        return f"{text} · {curve_label(approx, window)}" if several else text

    labels: list[Label] = []
    for ax, task in zip(axes.flat, tasks):
        colour = colours[task]
        for approx, window in sweep.curves:
            points = [(100 * c.hit_rate, c.score, c.lam) for c in sweep.dynamic_cells(task, approx, window)
                      if c.hit_rate is not None and c.score is not None]
            if points:
                xs, ys, _ = zip(*points)
                line = f"{approx.marker}-" if several else "o-"
                ax.plot(xs, ys, line, color=colour_of(approx, task, window),
                        label=named("dynamic (λ)", approx, window))
                labels += [(ax, x, y, f"λ={lam:g}", {"fontsize": 7, "color": colour_of(approx, task, window)})
                           for x, y, lam in points]
        base = sweep.cell(task, BASELINE)
        if base is not None and base.score is not None:
            ax.axhline(base.score, color=colour if not several else "black", linestyle="--", linewidth=1,
                       label="baseline (exact)")
        for row in sweep.rows:
            cell, look, legend = sweep.cell(task, row), style(row), hit_rate_legend(row)
            if legend and cell is not None and cell.hit_rate is not None and cell.score is not None:
                ax.plot(100 * cell.hit_rate, cell.score, look.marker, color=colour_of(row.approx, task, row.window),
                        markersize=8, markeredgecolor="black", linestyle="",
                        label=named(legend, row.approx, row.window))
        ax.set_xlim(0, 105)
        ax.set_xlabel("speculation hit rate (%)")
        ax.set_ylabel("score")
        ax.set_title(task, fontsize=10)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=6 if several else 7, loc="best")
    for ax in list(axes.flat)[len(tasks):]:
        ax.set_visible(False)
    fig.suptitle("Score against hit rate" + (" by approximation of A~" if several else ""))
    place_labels(fig, labels)
    return fig


def middle_lambda(sweep: Sweep) -> float:
    """The sweep's middle lambda (the static baseline's default calibration lambda too)."""
    return sweep.lambdas[len(sweep.lambdas) // 2]


def hit_rate_by_approximation(sweep: Sweep, lam: float | None = None) -> Figure:
    """Per task, each layer's hit rate at one lambda (the sweep's middle one unless given), one line per
    approximation of A~ in its style, its overall hit rate in the legend; skipped layers stay blank. topk is an
    oracle (it needs every exact score), so its line is a ceiling, labelled as such."""
    lam = middle_lambda(sweep) if lam is None else lam
    tasks = sweep.tasks
    cols = min(3, len(tasks))
    rows = math.ceil(len(tasks) / cols)
    fig = _figure(4.6 * cols + 0.4, 3.6 * rows + 0.4)
    axes = fig.subplots(rows, cols, squeeze=False, sharey=True)
    for ax, task in zip(axes.flat, tasks):
        num_layers = 0
        for approx, window in sweep.curves:
            cell = sweep.cell(task, Row.dynamic(lam, approx).approximated(approx, window))
            if cell is None or cell.hit_rate is None:
                continue
            hits = [math.nan if layer.hit_rate is None else 100 * layer.hit_rate for layer in cell.layers]
            num_layers = max(num_layers, len(hits))
            ax.plot(range(len(hits)), hits, f"{approx.marker}-", color=approx.colour, markersize=5,
                    label=f"{curve_label(approx, window)}: {100 * cell.hit_rate:.1f}%")
        ax.set_xticks(range(0, num_layers, math.ceil(num_layers / 16) or 1))  # at most 16 ticks
        ax.set_ylim(-5, 105)
        ax.set_xlabel("layer")
        ax.set_title(task, fontsize=10)
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7, loc="best", title="A~ (all layers)", title_fontsize=7)
    for ax in axes[:, 0]:
        ax.set_ylabel("hit rate (%)")
    for ax in list(axes.flat)[len(tasks):]:
        ax.set_visible(False)
    fig.suptitle(f"Per-layer hit rate by approximation of A~ at λ = {lam:g}")
    return fig


def open_loop_acceptance_figure(sweep: Sweep) -> Figure:
    """Per task, the open-loop acceptance read off each lambda cell's histogram, with its measured hit rate: the
    sink's cells (a sweep without the sink: its first approximation's, named in the title)."""
    approx, window = sweep.curves[0]
    tasks = sweep.tasks
    cols = min(3, len(tasks))
    rows = math.ceil(len(tasks) / cols)
    fig = _figure(4.6 * cols + 1.2, 3.6 * rows)
    axes = fig.subplots(rows, cols, squeeze=False, sharey=True)
    cmap = colormaps["viridis"]
    lams = sweep.lambdas
    for ax, task in zip(axes.flat, tasks):
        for cell in sweep.dynamic_cells(task, approx, window):
            colour = cmap(lams.index(cell.lam) / max(len(lams) - 1, 1))
            curve = open_loop(cell.total.hist)
            if not curve.decisions:
                continue
            ax.plot(OPEN_LOOP_GRID, [100 * v for v in curve.hit], color=colour, label=f"from λ={cell.lam:g} run")
            if cell.hit_rate is not None:
                ax.plot(cell.lam, 100 * cell.hit_rate, "o", color=colour, markeredgecolor="black")
        ax.set_xscale("log")
        ax.set_title(task, fontsize=10)
        ax.set_xlabel("λ (threshold on d/n)")
        ax.grid(alpha=0.3, which="both")
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7, loc="upper left")
    for ax in axes[:, 0]:
        ax.set_ylabel("open-loop acceptance (%)")
    for ax in list(axes.flat)[len(tasks):]:
        ax.set_visible(False)
    fig.suptitle("Open-loop acceptance from the d/n histograms (dots: measured hit rate of each run)"
                 + ("" if approx.is_default and window is None else f", {curve_label(approx, window)}"))
    return fig


def speedup_vs_score(sweep: Sweep, projection: "SweepProjection") -> Figure:
    """The trade-off a user decides on: per task, projected speedup (the paper's latency model on the cells'
    measured per-layer hit rates) against score, one point per cell; the baseline at 1x."""
    tasks = sweep.tasks
    cols = min(3, len(tasks))
    rows = math.ceil(len(tasks) / cols)
    fig = _figure(4.6 * cols + 0.6, 3.6 * rows)
    axes = fig.subplots(rows, cols, squeeze=False)
    labels: list[Label] = []
    for ax, task in zip(axes.flat, tasks):
        for row in sweep.rows:
            cell, entry = sweep.cell(task, row), projection.entries.get((row, task))
            if cell is None or entry is None or cell.score is None:
                continue
            look = style(row)
            ax.plot(entry.speedup, cell.score, look.marker, color=look.colour, markersize=7)
            labels.append((ax, entry.speedup, cell.score, row.label, {"fontsize": 7}))
        ax.set_title(task, fontsize=10)
        ax.set_xlabel("projected speedup (×)")
        ax.set_ylabel("score")
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(tasks):]:
        ax.set_visible(False)
    estimate = " (with estimates: " + ", ".join(projection.spec.estimates) + ")" if projection.spec.estimates else ""
    fig.suptitle(f"Projected speedup against score, {projection.spec.name}{estimate}")
    place_labels(fig, labels)
    return fig


def frontier(cells: "pd.DataFrame", projection: "SweepProjection") -> Figure:
    """Per task: projected speedup against the paired score difference to the baseline (95% interval), one point per
    cell; filled points are not significantly worse, so the right-most filled point is the cheapest safe choice.

    A sweep of several approximations of A~ adds, per task, a panel of the same difference against the hit rate,
    each approximation's lambda rows as its own labelled curve, and draws each approximation's points in the speed
    panel in its own colour (the latency model prices each from the keys its A~ reads)."""
    from alspec_eval.report.frames import not_worse

    tasks = list(dict.fromkeys(cells["task"]))
    # a sweep of the sink alone: as before; an approximation at two settings is two (by name and parameters)
    several = "approx" in cells and len(cells[["approx", "approx_args"]].drop_duplicates()) > 1
    cols = min(3, len(tasks))
    rows = math.ceil(len(tasks) / cols)
    fig = _figure(4.6 * cols + 0.6, 3.6 * rows * (2 if several else 1))
    axes = fig.subplots(rows * (2 if several else 1), cols, squeeze=False)
    labels: list[Label] = []
    for ax, task in zip(axes[:rows].flat, tasks):
        group = cells[(cells["task"] == task) & cells["diff"].notna()]
        ok = not_worse(group)
        for (_, r), good in zip(group.iterrows(), ok):
            entry = projection.entries.get((_row_of(r, projection.rows), task))
            if entry is None:
                continue
            err = [[r["diff"] - r["diff_low"]], [r["diff_high"] - r["diff"]]]
            look = _approximation_of(r) if several else default_approximation()
            ax.errorbar(entry.speedup, r["diff"], yerr=err, fmt=look.marker, color=look.colour, capsize=3,
                        markerfacecolor=look.colour if good else "white")
            labels.append((ax, entry.speedup, r["diff"], r["row"], {"fontsize": 7}))
        ax.axhline(0, color="black", linewidth=0.8, linestyle="--")
        ax.set_title(task, fontsize=10)
        ax.set_xlabel(f"projected speedup (×), {projection.spec.name}")
        ax.set_ylabel("score − baseline (95% CI)")
        ax.grid(alpha=0.3)
    if several:
        for ax, task in zip(axes[rows:].flat, tasks):
            labels += _difference_by_hit_rate(ax, cells[cells["task"] == task], task)
    for ax in [*list(axes[:rows].flat)[len(tasks):], *list(axes[rows:].flat)[len(tasks) if several else 0:]]:
        ax.set_visible(False)
    fig.suptitle("Speed against score (filled: not significantly worse than the baseline)", fontsize=9)
    place_labels(fig, labels)
    return fig


def score_vs_density(cells: "pd.DataFrame") -> Figure:
    """Per task, score minus the dense baseline's (paired 95% interval) against the effective density, the share
    of the context a step reads once rejections fall back to A: each approximation's lambda rows as a curve per
    window of the budget (its marker and colour; the windows solid, dashed, dotted from the smallest; an oracle's
    curve is its ceiling, said in the legend), the dense baseline at 100%. A curve runs from its smallest lambda
    (right) to its largest (left); filled where not significantly worse than the baseline."""
    from alspec_eval.report.frames import not_worse

    tasks = list(dict.fromkeys(cells["task"]))
    cols = min(3, len(tasks))
    rows = math.ceil(len(tasks) / cols)
    dynamic = cells[(cells["policy"] == "dynamic") & cells["lambda"].notna() & cells["effective_density"].notna()
                    & cells["diff"].notna()]
    windows = sorted(dynamic["window"].dropna().unique())
    styles = dict(zip(windows, ["-", "--", ":", "-."] * len(windows)))
    fig = _figure(4.8 * cols + 0.6, 3.8 * rows + 1.4)
    axes = fig.subplots(rows, cols, squeeze=False, sharey=True)
    for ax, task in zip(axes.flat, tasks):
        group = dynamic[dynamic["task"] == task]
        for _, curve in group.groupby(["approx", "approx_args", "window"], sort=False, dropna=False):
            look, window = _approximation_of(curve.iloc[0]), curve.iloc[0]["window"]
            curve = curve.sort_values("effective_density")
            xs = 100 * curve["effective_density"]
            ax.plot(xs, curve["diff"], linestyle=styles[window], color=look.colour, linewidth=1, marker=look.marker,
                    markersize=4, label=curve_label(look, int(window) if len(windows) > 1 else None))
            for x, (_, r), good in zip(xs, curve.iterrows(), not_worse(curve)):
                ax.errorbar(x, r["diff"], yerr=[[r["diff"] - r["diff_low"]], [r["diff_high"] - r["diff"]]],
                            fmt=look.marker, color=look.colour, capsize=2, markersize=5,
                            markerfacecolor=look.colour if good else "white")
        ax.plot(100, 0, "D", color="black", markersize=7, linestyle="", label="dense baseline (exact A)")
        ax.axhline(0, color="black", linewidth=0.8, linestyle="--")
        ax.set_xlim(0, 105)
        ax.set_xlabel("effective density (% of the context read per step)")
        ax.set_title(task, fontsize=10)
        ax.grid(alpha=0.3)
    for ax in axes[:, 0]:
        ax.set_ylabel("score − baseline (95% CI)")
    for ax in list(axes.flat)[len(tasks):]:
        ax.set_visible(False)
    handles, names = axes.flat[0].get_legend_handles_labels()
    fig.legend(handles, names, loc="outside lower center", ncol=min(len(names), 4), fontsize=7, frameon=False)
    fig.suptitle("Score against effective density: each curve from its smallest λ (right) to its largest (left); "
                 "filled: not significantly worse than the baseline", fontsize=9)
    return fig


def _difference_by_hit_rate(ax: "Axes", group: "pd.DataFrame", task: str) -> list[Label]:
    """One task's lambda rows, a curve per approximation: paired score difference (95% interval) against hit rate,
    filled where not significantly worse than the baseline."""
    from alspec_eval.report.frames import not_worse

    group = group[group["diff"].notna() & group["hit_rate"].notna() & (group["policy"] == "dynamic")
                  & group["lambda"].notna()]  # the lambda rows (a tuned row decides by a schedule)
    labels: list[Label] = []
    for _, curve in group.groupby(["approx", "approx_args"], sort=False, dropna=False):
        look = _approximation_of(curve.iloc[0])
        curve = curve.sort_values("lambda")
        xs = 100 * curve["hit_rate"]
        ax.plot(xs, curve["diff"], f"{look.marker}-", color=look.colour, linewidth=1, label=approx_label(look))
        for x, (_, r), good in zip(xs, curve.iterrows(), not_worse(curve)):
            ax.errorbar(x, r["diff"], yerr=[[r["diff"] - r["diff_low"]], [r["diff_high"] - r["diff"]]],
                        fmt=look.marker, color=look.colour, capsize=3, markerfacecolor=look.colour if good else "white")
            labels.append((ax, x, r["diff"], f"λ={r['lambda']:g}", {"fontsize": 7, "color": look.colour}))
    ax.axhline(0, color="black", linewidth=0.8, linestyle="--")
    ax.set_xlim(0, 105)
    ax.set_title(f"{task}: by approximation of A~", fontsize=10)
    ax.set_xlabel("speculation hit rate (%)")
    ax.set_ylabel("score − baseline (95% CI)")
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=7, loc="best")
    return labels


def _approximation_of(r: "pd.Series") -> Approximation:
    """The approximation of a frame's cell (its ``approx`` and ``approx_args`` columns)."""
    return make_approximation(r["approx"] or DEFAULT, r["approx_args"] or None)


def _row_of(r: "pd.Series", rows: list[Row]) -> Row:
    """The row of a frame's cell (cells are named after their rows, or were under a legacy name)."""
    return next(row for row in rows if r["cell"] in row.file_names)


def attention_vs_token_speculation(sweep: Sweep, task: str, projection: "SweepProjection") -> Figure:
    """At one S: attention-level speculation's hit rate per lambda next to token-level self-speculation's tau per
    gamma, each point labelled with the latency model's projected speedup."""
    window = sweep.axis[0]  # on a budget axis: its smallest S
    dynamic = [c for c in sweep.dynamic_cells(task, None, window) if c.hit_rate is not None]
    drafts = [c for g in sweep.gammas if (c := sweep.cell(task, Row.selfspec(g).approximated(None, window))) is not None
              and c.tau is not None]
    fig = _figure(9.0, 3.4)
    left, right = fig.subplots(1, 2)

    def speedup(cell) -> str:
        entry = projection.entries.get((cell.row, task))
        return "" if entry is None else f"{entry.speedup:.2f}×"

    xs, ys = [c.lam for c in dynamic], [100 * c.hit_rate for c in dynamic]
    left.plot(xs, ys, "o-", color="tab:blue")
    labels: list[Label] = [(left, x, y, speedup(c), {"fontsize": 8}) for c, x, y in zip(dynamic, xs, ys)]
    left.set_xscale("log")
    left.set_ylim(0, 105)
    left.set_xlabel("λ")
    left.set_ylabel("hit rate (%)")
    left.set_title("attention-level (ALSpec)", fontsize=10)
    gs, taus = [c.row.gamma for c in drafts], [c.tau for c in drafts]
    right.plot(gs, taus, "s-", color="tab:orange")
    labels += [(right, x, y, speedup(c), {"fontsize": 8}) for c, x, y in zip(drafts, gs, taus)]
    right.plot(gs, [g + 1 for g in gs], ":", color="grey", label="τ = γ + 1 (every draft accepted)")
    right.set_xticks(gs)
    right.set_ylim(bottom=1)
    right.set_xlabel("γ (drafted tokens per step)")
    right.set_ylabel("τ (tokens per verification step)")
    right.set_title("token-level (self-speculation, sink draft)", fontsize=10)
    right.legend(fontsize=7, loc="upper left")
    for ax in (left, right):
        ax.grid(alpha=0.3)
    fig.suptitle(f"{task}, S = {window or sweep.meta.get('window')}: labels are projected speedups ({projection.spec.name})",
                 fontsize=9)
    place_labels(fig, labels)
    return fig


def save(fig: Figure, path: Path) -> Path:
    fig.savefig(path, dpi=120)
    return path
