"""One open-loop rule for the report and alspec-tune (``stats.open_loop``): the numbers of the two copies it replaced,
a brute force from raw ratios through ``semantics.accept``, and both readers (the report's figure, the tuner's
curves) held to that brute force, so a bin rule changed in one place only fails here."""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

import pytest
import torch

from alspec_eval import semantics
from alspec_eval.latency import DEFAULT_PRESET, preset
from alspec_eval.report.cells import load_sweep
from alspec_eval.report.figures import open_loop_acceptance_figure
from alspec_eval.stats import NUM_BINS, OPEN_LOOP_GRID, RATIO_EDGES, open_loop, ratio_bins
from alspec_eval.sweep.config import SweepConfig
from alspec_eval.tune.tuner import Tuner, TunePlan

E = RATIO_EDGES
N = len(OPEN_LOOP_GRID)


def _hist(**bins: int) -> list[int]:
    """A histogram with counts in the named bins (``b20=3``: 3 decisions in bin 20, [E[19], E[20]))."""
    hist = [0] * NUM_BINS
    for name, count in bins.items():
        hist[int(name[1:])] = count
    return hist


def test_the_grid_is_the_bin_edges_from_1e_3_to_10():
    assert OPEN_LOOP_GRID == E[20:] and OPEN_LOOP_GRID[0] == 1e-3 and OPEN_LOOP_GRID[-1] == 10.0


# Recorded from the two copies before they became one (tune/search.py's hit and error, report/figures.py's
# acceptance, None where it had no decisions): (hist, hit, error).
RECORDED = {
    "empty": ([0] * NUM_BINS, [0.0] * N, [0.0] * N),
    "all underflow": (_hist(b0=7), [1.0] * N, [E[0]] * N),
    "all overflow": (_hist(b101=5), [0.0] * N, [0.0] * N),
    "a bin exactly at the first threshold": (_hist(b20=3, b21=4), [3 / 7] + [1.0] * (N - 1),
                                             [3 * E[20] / 7] + [(3 * E[20] + 4 * E[21]) / 7] * (N - 1)),
    "a bin at the last threshold, one past it": (_hist(b100=2, b101=3), [0.0] * (N - 1) + [2 / 5],
                                                 [0.0] * (N - 1) + [2 * E[100] / 5]),
}


@pytest.mark.parametrize("name", RECORDED)
def test_the_numbers_of_the_two_copies_it_replaced(name):
    hist, hit, error = RECORDED[name]
    curve = open_loop(hist)
    assert curve.decisions == sum(hist)
    assert list(curve.hit) == hit and list(curve.error) == error  # exact: tune's path and the figures stay put


def _rule_before(hist: list[int]) -> tuple[list[float], list[float]]:
    """tune/search.py's copy as it was (a bin accepted when its upper edge is <= t), kept as the oracle."""
    total, hit, error = sum(hist), [], []
    for t in OPEN_LOOP_GRID:
        accepted = [(count, E[k]) for k, count in enumerate(hist[:len(E)]) if E[k] <= t]
        hit.append(sum(c for c, _ in accepted) / total if total else 0.0)
        error.append(sum(c * edge for c, edge in accepted) / total if total else 0.0)
    return hit, error


@pytest.mark.parametrize("seed", range(5))
def test_random_histograms_match_the_rule_before(seed):
    rng = random.Random(seed)
    hist = [rng.choice([0, 0, 1, 5, 100]) for _ in range(NUM_BINS)]
    curve = open_loop(hist)
    assert (list(curve.hit), list(curve.error)) == _rule_before(hist)


# ------------------------------------------------------------------ brute force from raw ratios

def _ratios() -> torch.Tensor:
    """Raw d/n ratios at the top of their bins (just below each finite upper edge, the underflow bin's included, 1 to
    3 per bin, so a bin at a threshold counts), plus ratios past the last edge (overflow)."""
    tops = [math.nextafter(e, 0.0) for k, e in enumerate(E) for _ in range(1 + k % 3)]
    return torch.tensor([*tops, 20.0, 1e3], dtype=torch.float64)


def _brute_force(ratios: torch.Tensor) -> tuple[list[float], list[float]]:
    """At each threshold t, the share of the ratios semantics.accept(r, 1, t) accepts and their mean ratio."""
    hit, error = [], []
    for t in OPEN_LOOP_GRID:
        ok = semantics.accept(ratios, torch.ones_like(ratios), t)
        hit.append(int(ok.sum()) / len(ratios))
        error.append(float(ratios[ok].sum()) / len(ratios))
    return hit, error


def _hist_of(ratios: torch.Tensor) -> list[int]:
    return torch.bincount(ratio_bins(ratios), minlength=NUM_BINS).tolist()


def _sweep_folder(root: Path, hists: list[list[int]]) -> Path:
    """A sweep folder with one task and one lambda cell whose layers have ``hists``."""
    def stats(hist: list[int]) -> dict:
        return {"speculated": sum(hist), "accepted": 0, "trivial": 0, "hit_rate": 0.0, "hist": hist}
    total = [sum(col) for col in zip(*hists)]
    cell = {"task": "t", "cell": "lambda_0.1", "policy": "dynamic", "lambda": 0.1, "metric": "acc,none", "score": 0.5,
            "alspec": {"schema_version": 2, "ratio_edges": list(E), "layers": [{"layer": i, **stats(h)}
                                                                               for i, h in enumerate(hists)],
                       "total": stats(total)}}
    (root / "cells" / "t").mkdir(parents=True)
    (root / "sweep.json").write_text(json.dumps({"tasks": ["t"], "lambdas": [0.1], "window": 64}))
    (root / "cells" / "t" / "lambda_0.1.json").write_text(json.dumps(cell))
    return root


def _figure_curve(folder: Path) -> list[float]:
    """The open-loop line the report draws for the cell (percent)."""
    line = open_loop_acceptance_figure(load_sweep(folder)).axes[0].lines[0]
    assert list(line.get_xdata()) == list(OPEN_LOOP_GRID)
    return list(line.get_ydata())


def _tuner_curves(folder: Path) -> list:
    plan = TunePlan(SweepConfig("t", ["t"], [0.1]), max_drop=0.05, latency=preset(DEFAULT_PRESET))
    return Tuner(plan, tasks=None).curves(folder)  # reads cells only: no task index


def test_the_bin_rule_is_semantics_accept_on_raw_ratios():
    """Ratios at the top of their bins make the histogram reading exact: each threshold accepts, by the histogram,
    exactly the ratios semantics.accept accepts (a bin whose upper edge is the threshold included)."""
    ratios = _ratios()
    hit, error = _brute_force(ratios)
    curve = open_loop(_hist_of(ratios))
    assert list(curve.hit) == hit
    assert curve.error == pytest.approx(error, rel=1e-12)
    assert 0 < hit[0] < hit[-1] < 1  # the thresholds split the ratios: the check is not vacuous


def test_the_report_and_the_tuner_read_the_same_rule(tmp_path):
    """Both readers against the brute force (the figure draws the cell's total, the tuner reads each layer), so a
    bin rule changed in one of them only fails here."""
    layers = [_ratios(), _ratios()[::2].contiguous()]
    folder = _sweep_folder(tmp_path / "sweep", [_hist_of(r) for r in layers])
    total_hit, _ = _brute_force(torch.cat(layers))
    assert _figure_curve(folder) == pytest.approx([100 * h for h in total_hit], rel=1e-12)
    for curve, ratios in zip(_tuner_curves(folder), layers, strict=True):
        hit, error = _brute_force(ratios)
        assert list(curve.hit) == hit and curve.error == pytest.approx(error, rel=1e-12)


def test_a_rule_changed_in_semantics_reaches_both_readers(tmp_path, monkeypatch):
    """semantics.accept is the only bin rule: a more generous one (d <= 1.2 lambda n, one bin more) moves the
    report's curve and the tuner's alike, one grid step."""
    ratios = _ratios()
    folder = _sweep_folder(tmp_path / "sweep", [_hist_of(ratios)])
    before = open_loop(_hist_of(ratios)).hit
    monkeypatch.setattr(semantics, "accept", lambda d, n, lam: d <= 1.2 * lam * n)
    shifted = list(before[1:])
    assert _figure_curve(folder)[:-1] == pytest.approx([100 * h for h in shifted], rel=1e-12)
    assert list(_tuner_curves(folder)[0].hit[:-1]) == shifted
