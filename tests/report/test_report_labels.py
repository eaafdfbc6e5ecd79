"""Point labels in the report's figures never overlap, also where points coincide (recall at 100% hit rate:
every lambda, sink and static cell on one spot) or crowd (scores and speedups a hair apart)."""

from __future__ import annotations

import itertools
import json

import pytest

from matplotlib.text import Annotation

from alspec_eval.latency import preset
from alspec_eval.report.cells import load_sweep
from alspec_eval.report.figures import attention_vs_token_speculation, frontier, score_vs_hit_rate, speedup_vs_score
from alspec_eval.report.frames import load
from alspec_eval.report.latency import project_sweep
from synthetic_sweep import TASKS, write_sweep
from test_report_selfspec import add_selfspec


def crowded(tmp_path):
    """Recall: every speculative cell accepts everything with the baseline's score (one spot per figure);
    gsm8k: scores 0.001 apart."""
    out = write_sweep(tmp_path / "sweep", documents=True)
    add_selfspec(out)
    for path in (out / "cells" / TASKS[1]).glob("*.json"):
        cell = json.loads(path.read_text())
        if cell["policy"] in ("dynamic", "always", "static"):
            for layer in cell["alspec"]["layers"]:
                layer["accepted"], layer["hit_rate"] = layer["speculated"], 1.0
            total = cell["alspec"]["total"]
            total["accepted"] = total["speculated"] = sum(x["speculated"] for x in cell["alspec"]["layers"])
            total["hit_rate"] = 1.0
        base = json.loads((out / "cells" / TASKS[1] / "baseline.json").read_text())
        cell["score"], cell["sample_log"] = base["score"], base["sample_log"]
        path.write_text(json.dumps(cell))
    for i, path in enumerate(sorted((out / "cells" / TASKS[0]).glob("*.json"))):
        cell = json.loads(path.read_text())
        cell["score"] = 0.3 + 0.001 * i
        path.write_text(json.dumps(cell))
    return out


def labels_of(fig) -> dict[int, list[Annotation]]:
    fig.canvas.draw()
    return {i: [t for t in ax.texts if isinstance(t, Annotation)] for i, ax in enumerate(fig.axes)}


def test_labels_never_overlap(tmp_path):
    out = crowded(tmp_path)
    sweep, cells = load_sweep(out), load(out).cells
    projection = project_sweep(sweep, preset("h100-tp4-32k"))
    figures = [score_vs_hit_rate(sweep), speedup_vs_score(sweep, projection), frontier(cells, projection),
               *(attention_vs_token_speculation(sweep, task, projection) for task in TASKS)]
    for fig in figures:
        renderer = fig.canvas.get_renderer()
        for notes in labels_of(fig).values():
            boxes = [n.get_window_extent(renderer) for n in notes]
            for (a, box_a), (b, box_b) in itertools.combinations(zip(notes, boxes), 2):
                assert not box_a.overlaps(box_b), (fig.texts[0].get_text() if fig.texts else "", a.get_text(), b.get_text())
    # coinciding points share one label that names them all
    recall = next(n.get_text() for n in labels_of(figures[0])[1] if "λ=0.05" in n.get_text())
    assert recall == "λ=0.05, λ=0.1, λ=0.2"


@pytest.mark.parametrize(("shares", "text"), [
    ({"promise_dn": 0.12, "promise_denominator": 0.031}, " (ε missed: d/n 12.0%, D 3.1%)"),
    ({"promise_dn": 0.5, "promise_denominator": float("nan")}, " (ε missed: d/n 50.0%)"),  # it bounds no denominator
    ({"promise_dn": float("nan"), "promise_denominator": float("nan")}, ""),  # it promises nothing
    ({}, ""),  # frames from before the promise was measured
])
def test_a_promises_shares_beside_the_hit_rate(shares, text):
    """Table 1's cell text of a draft that promises its error: each realized share under its own name."""
    import pandas as pd

    from alspec_eval.report.table import promise_text

    assert promise_text(pd.Series(shares, dtype=float)) == text
