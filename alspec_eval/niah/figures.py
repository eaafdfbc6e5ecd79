"""The paper's needle figures from a needle sweep's cells.

- needles found and share of attention approximated, against lambda (Figure 3a);
- average acceptance per layer for each lambda (Figure 3b);
- length x depth grid per cell: score as colour, hit rate written in each square;
- the answers shaded token by token by how many layers accepted (Figure 8).
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path
from typing import Any

import numpy as np
from matplotlib import colormaps

from ..approximations import Approximation, default_approximation
from ..report.figures import _figure, save
from ..report.styles import approx_label
from ..report.cells import BASELINE, SINK, Sweep, load_sweep
from ..rows import Row


def _cells(outdir: Path) -> dict[str, dict[str, Any]]:
    """Raw cell JSONs by cell name (the report loader keeps no samples)."""
    return {p.stem: json.loads(p.read_text()) for p in sorted((outdir / "cells").glob("*/*.json"))}


def _score(sample: dict[str, Any]) -> float:
    """A sample's needle score: its one per-length metric."""
    return next(v for k, v in sample.items() if k.isdigit())


def _row(cell: dict[str, Any]) -> Row:
    return Row.from_record(cell["policy"], cell.get("lambda"), cell.get("gamma"), cell.get("lambda_schedule"),
                           cell.get("approx"), cell.get("approx_args"), cell.get("page"))


def _label(cell: dict[str, Any]) -> str:
    """The row a raw cell JSON was made as, for a title: "λ = 0.05", "baseline", "sink", "λ = ∞ · quest P=16"."""
    return _row(cell).label


def needles_vs_lambda(sweep: Sweep, task: str, approx: Approximation | None = None) -> Any:
    """Figure 3a: score and hit rate per lambda of one approximation (None: the default), baseline and its sink row
    (A~ always) as references. Needle runs have few prompts, so each score carries its Wilson 95% interval and n."""
    from ..report.frames import wilson

    fig = _figure(6.4, 4.6)
    ax = fig.add_subplot()
    approx = default_approximation() if approx is None else approx
    dynamic = sweep.dynamic_cells(task, approx)
    lams = [c.lam for c in dynamic]
    n = max((c.samples or 0 for c in dynamic), default=0)
    intervals = [wilson(round(c.score * (c.samples or 0)), c.samples or 0) for c in dynamic]
    err = [[c.score - lo for c, (lo, _) in zip(dynamic, intervals)], [hi - c.score for c, (_, hi) in zip(dynamic, intervals)]]
    ax.errorbar(lams, [c.score for c in dynamic], yerr=err, fmt="o-", color="tab:blue", capsize=3,
                label=f"needles found (dynamic), 95% interval, n = {n}")
    for row, style in ((BASELINE, "--"), (SINK.approximated(approx), ":")):
        if (cell := sweep.cell(task, row)) is not None and cell.score is not None:
            ax.axhline(cell.score, linestyle=style, color="tab:blue", alpha=0.7, label=f"{row.label} score")
    ax.set_xscale("log")
    ax.set_xticks(lams, [f"{lam:g}" for lam in lams])
    ax.minorticks_off()
    ax.set_xlabel("λ")
    ax.set_ylabel("score (share of needles found)")
    ax.set_ylim(-0.05, 1.05)
    hits = ax.twinx()
    hits.plot(lams, [100 * (c.total.hit_rate or 0.0) for c in dynamic], "s-", color="tab:orange",
              label="attention approximated")
    hits.set_ylabel("hit rate (%)", color="tab:orange")
    hits.set_ylim(-5, 105)
    handles = ax.get_legend_handles_labels()[0] + hits.get_legend_handles_labels()[0]
    fig.legend(handles=handles, loc="outside lower center", ncol=2, fontsize=8)
    ax.set_title(f"{task}: needles found and attention approximated{_approx_title(approx)}")
    return fig


def _approx_title(approx: Approximation) -> str:
    return "" if approx.is_default else f" ({approx_label(approx)})"


def acceptance_per_layer(sweep: Sweep, task: str, approx: Approximation | None = None) -> Any:
    """Figure 3b: average acceptance of each layer, one line per lambda of one approximation (None: the default)."""
    fig = _figure(6.4, 4.0)
    ax = fig.add_subplot()
    cmap = colormaps["viridis"]
    approx = default_approximation() if approx is None else approx
    dynamic = sweep.dynamic_cells(task, approx)
    for i, cell in enumerate(dynamic):
        ax.plot(range(len(cell.layers)), [100 * (h or 0.0) for h in (l.hit_rate for l in cell.layers)], "o-",
                markersize=3, color=cmap(i / max(len(dynamic) - 1, 1)), label=f"λ = {cell.lam:g}")
    ax.set_xlabel("layer")
    ax.set_ylabel("acceptance (%)")
    ax.set_ylim(-5, 105)
    ax.legend(fontsize=8)
    ax.set_title(f"{task}: acceptance per layer{_approx_title(approx)}")
    return fig


def length_depth_grid(cell: dict[str, Any]) -> Any:
    """Score by prompt length and needle depth; each square also shows that square's hit rate."""
    groups: dict[tuple[int, float], list[dict[str, Any]]] = defaultdict(list)
    for sample in cell["sample_log"]:
        groups[sample["doc"]["max_length"], sample["doc"].get("depth") or 0.0].append(sample)
    lengths = sorted({k[0] for k in groups})
    depths = sorted({k[1] for k in groups})
    score = np.full((len(depths), len(lengths)), np.nan)
    fig = _figure(max(5.0, 1.6 + 1.3 * len(lengths)), 1.6 + 0.6 * len(depths))
    ax = fig.add_subplot()
    for (length, depth), samples in groups.items():
        i, j = depths.index(depth), lengths.index(length)
        score[i, j] = np.mean([_score(s) for s in samples])
        spec = sum(a["speculated"] for s in samples for a in s["alspec"])
        acc = sum(a["accepted"] for s in samples for a in s["alspec"])
        label = f"{100 * acc / spec:.0f}%" if spec else "–"
        ax.text(j, i, label, ha="center", va="center", fontsize=9,
                color="white" if score[i, j] < 0.5 else "black")
    image = ax.imshow(score, cmap="RdYlGn", vmin=0, vmax=1, aspect="auto")
    fig.colorbar(image, ax=ax, label="score")
    ax.set_xticks(range(len(lengths)), [f"{n // 1024}K" for n in lengths])
    ax.set_yticks(range(len(depths)), [f"{d:.0%}" for d in depths])
    ax.set_xlabel("context length (tokens)")
    ax.set_ylabel("needle depth")
    ax.set_title(f"{cell['task']}, {_label(cell)}: score (colour), hit rate (text)", fontsize=9)
    return fig


def token_traces(cell: dict[str, Any], tokenizer: Any, num_layers: int, limit: int = 6) -> Any:
    """Figure 8: each answer's tokens shaded by how many layers accepted the approximation; each row is labelled
    with its needle's depth and whether the answer found it, and a colour bar gives the scale."""
    from matplotlib.cm import ScalarMappable
    from matplotlib.colors import Normalize

    traced = [s for s in cell["sample_log"] if s["alspec"] and "accepted_layers_per_token" in s["alspec"][0]][:limit]
    rows = []
    for sample in traced:
        response = sample["response"][0] if isinstance(sample["response"], list) else sample["response"]
        ids = tokenizer(response, add_special_tokens=False)["input_ids"]
        tokens = [tokenizer.decode([t]).replace("\n", "⏎") for t in ids]
        rows.append((sample, tokens, sample["alspec"][0]["accepted_layers_per_token"]))
    width = max((sum(max(len(t), 1) for t in tokens) for _, tokens, _ in rows), default=10)
    fig = _figure(min(3.0 + 0.09 * width, 14.0), 0.8 + 0.45 * max(len(rows), 1))
    ax = fig.add_subplot()
    ax.set_axis_off()
    cmap, norm = colormaps["Blues"], Normalize(0, num_layers)
    for row, (sample, tokens, counts) in enumerate(rows):
        doc = sample.get("doc", {})
        found = "found" if _score(sample) >= 1 else "missed"
        depth = f"depth {doc['depth']:.0%}" if isinstance(doc.get("depth"), (int, float)) else ""
        ax.text(-0.01, -row, f"{depth} {found}".strip(), fontsize=8, ha="right", va="center")
        x = 0.0
        for text, count in zip(tokens, counts, strict=False):
            ax.text(x, -row, text, fontsize=8, family="monospace", va="center",
                    bbox={"facecolor": cmap(norm(count)), "edgecolor": "none", "pad": 1.5})
            x += max(len(text), 1) / width
    ax.set_xlim(0, 1.02)
    ax.set_ylim(-len(rows) + 0.5, 0.5)
    fig.colorbar(ScalarMappable(norm=norm, cmap=cmap), ax=ax, label="layers accepted", fraction=0.03, pad=0.01)
    ax.set_title(f"{cell['task']}, {_label(cell)}: answer tokens shaded by layers that accepted A~", fontsize=9)
    return fig


def write_niah_figures(outdir: Path, tokenizer: Any = None) -> list[Path]:
    """All needle figures into OUTDIR/figures/; the token traces need the model's tokenizer."""
    sweep = load_sweep(outdir)
    figures = outdir / "figures"
    figures.mkdir(exist_ok=True)
    written = []
    for task in sweep.tasks:
        for approx in sweep.approximations:
            suffix = approx.row_part("_")  # the default's files keep their names
            written.append(save(needles_vs_lambda(sweep, task, approx), figures / f"{task}_needles_vs_lambda{suffix}.png"))
            written.append(save(acceptance_per_layer(sweep, task, approx),
                                figures / f"{task}_acceptance_per_layer{suffix}.png"))
    cells = _cells(outdir)
    if tokenizer is None:
        tokenizer = _tokenizer(sweep)
    for name, cell in cells.items():
        if cell["sample_log"] and "max_length" in cell["sample_log"][0]["doc"]:
            written.append(save(length_depth_grid(cell), figures / f"{cell['task']}_{name}_grid.png"))
        row = _row(cell)
        if tokenizer is not None and row.by_lambda:
            layers = cell["alspec"]["num_layers"]
            written.append(save(token_traces(cell, tokenizer, layers), figures / f"{cell['task']}_{name}_tokens.png"))
    return written


def _tokenizer(sweep: Sweep) -> Any:
    from transformers import AutoTokenizer

    from ..smollm2 import SMOLLM2_ALIAS, smollm2_path

    name = sweep.model
    if name in (None, SMOLLM2_ALIAS):
        name = str(smollm2_path())
    return AutoTokenizer.from_pretrained(name)
