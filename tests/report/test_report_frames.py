"""Tidy frames of a sweep and the paired statistics: bootstrap coverage, McNemar by hand, round trip of the cell
files, and Table 1 with intervals added and nothing else changed."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from alspec_eval import report
from alspec_eval.report.build import write_report
from alspec_eval.report.frames import (BOOTSTRAP_RESAMPLES, cluster_bootstrap_ratio, mcnemar_exact, not_worse,
                                       paired_bootstrap, paired_ratio_difference, wilson)
from synthetic_sweep import ACCEPTED, DOCUMENTS, LAMBDAS, NUM_LAYERS, SCORES, SPECULATED, TASKS, write_sweep


@pytest.fixture(scope="module")
def documented(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_sweep(tmp_path_factory.mktemp("documented"), documents=True)


def test_bootstrap_interval_covers_the_true_difference_at_the_stated_rate():
    rng = np.random.default_rng(7)
    true, trials, covered = 0.1, 300, 0
    for t in range(trials):
        diffs = true + rng.normal(0, 1, size=80)  # per-document differences with mean `true`
        _, low, high = paired_bootstrap(diffs, resamples=2000, seed=t)
        covered += low <= true <= high
    assert 0.91 <= covered / trials <= 0.98  # 95% nominal; the percentile bootstrap runs slightly narrow at n=80


def test_bootstrap_is_seeded():
    diffs = np.arange(30) % 3 - 1.0
    assert paired_bootstrap(diffs) == paired_bootstrap(diffs)
    assert BOOTSTRAP_RESAMPLES == 10_000


def test_mcnemar_by_hand():
    # 1 document right only in the baseline, 9 only in the cell: p = 2 (C(10,0) + C(10,1)) / 2^10
    assert mcnemar_exact(1, 9) == pytest.approx(2 * 11 / 1024)
    assert mcnemar_exact(9, 1) == mcnemar_exact(1, 9)
    assert mcnemar_exact(3, 3) == 1.0 and mcnemar_exact(0, 0) == 1.0


def test_wilson_by_hand():
    low, high = wilson(84, 200)
    assert low == pytest.approx(0.35374, abs=1e-5) and high == pytest.approx(0.48928, abs=1e-5)  # worked by hand
    assert all(math.isnan(x) for x in wilson(0, 0))


def _wilson_formula(k: int, n: int, z: float = 1.959963984540054) -> tuple[float, float]:
    """The Wilson score interval as the report computed it by hand before scipy.stats made it."""
    p = k / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return max(0.0, centre - half), min(1.0, centre + half)


def _mcnemar_formula(b: int, c: int) -> float:
    """The exact McNemar p-value as the report computed it by hand before scipy.stats made it."""
    n = b + c
    return min(1.0, 2 * sum(math.comb(n, k) for k in range(min(b, c) + 1)) / 2**n) if n else 1.0


def test_scipy_gives_the_numbers_the_hand_written_statistics_gave():
    """Every count up to 60 trials (every edge: 0 and all successes, ties of the discordant pairs) and some large
    ones: the same Wilson interval and McNemar p-value, to float rounding."""
    counts = [(k, n) for n in range(1, 61) for k in range(n + 1)] + [(1000, 2000), (7, 5000), (4999, 5000)]
    for k, n in counts:
        assert wilson(k, n) == pytest.approx(_wilson_formula(k, n), rel=1e-12, abs=1e-15), (k, n)
        assert mcnemar_exact(k, n - k) == pytest.approx(_mcnemar_formula(k, n - k), rel=1e-9), (k, n)


def _numpy_bootstrap(statistic, data: tuple[np.ndarray, ...], seed: int, resamples: int = 10_000) -> np.ndarray:
    """Percentile bootstrap written apart from scipy: documents resampled together, 2.5% and 97.5% quantiles."""
    index = np.random.default_rng(seed).integers(0, len(data[0]), size=(resamples, len(data[0])))
    return np.quantile(statistic(*(x[index] for x in data)), [0.025, 0.975])


def test_the_bootstraps_agree_with_an_independent_one_within_resampling_noise():
    """scipy's resampling is not the hand-written one's, so the ends move by Monte Carlo noise only: at 10,000
    resamples the 2.5% quantile of these statistics has a standard error of about 0.004 (means of 60 normal
    documents) and 0.003 (ratios of 60 documents): a tolerance of 0.02 is five of them, while a wrong statistic
    (the mean of per-document ratios, a sum where a mean belongs, one side's documents alone) misses it."""
    rng = np.random.default_rng(3)
    diffs = rng.normal(0.2, 1.0, size=60)
    _, low, high = paired_bootstrap(diffs)
    assert (low, high) == pytest.approx(tuple(_numpy_bootstrap(lambda d: d.mean(1), (diffs,), 1)), abs=0.02)
    speculated = rng.integers(5, 200, size=60).astype(float)
    accepted = np.floor(speculated * rng.beta(2, 5, size=60))
    def ratio(a: np.ndarray, s: np.ndarray) -> np.ndarray:
        return a.sum(1) / s.sum(1)

    assert cluster_bootstrap_ratio(accepted, speculated) == pytest.approx(
        tuple(_numpy_bootstrap(ratio, (accepted, speculated), 2)), abs=0.02)
    other = np.floor(speculated * rng.beta(3, 4, size=60))
    diff, low, high = paired_ratio_difference((other, speculated), (accepted, speculated))
    assert diff == pytest.approx(other.sum() / speculated.sum() - accepted.sum() / speculated.sum())
    expected = _numpy_bootstrap(lambda a, s, b, t: a.sum(1) / s.sum(1) - b.sum(1) / t.sum(1),
                                (other, speculated, accepted, speculated), 4)
    assert (low, high) == pytest.approx(tuple(expected), abs=0.02)


def test_documents_without_decisions_are_left_out_of_the_ratio_bootstraps():
    """A document that speculated nothing adds nothing to a ratio: the interval is that of the others alone, and a
    cell with no decision has none."""
    accepted, speculated = np.array([3.0, 9, 1, 6, 0]), np.array([10.0, 10, 10, 10, 0])
    assert cluster_bootstrap_ratio(accepted, speculated) == cluster_bootstrap_ratio(accepted[:4], speculated[:4])
    assert all(math.isnan(x) for x in cluster_bootstrap_ratio(np.zeros(3), np.zeros(3)))
    assert all(math.isnan(x) for x in paired_ratio_difference((accepted, speculated), (np.zeros(5), np.zeros(5))))
    one = cluster_bootstrap_ratio(np.array([3.0, 0]), np.array([10.0, 0]))
    assert one == (0.3, 0.3)  # one document: nothing to resample


def test_cluster_interval_is_about_documents_not_decisions():
    """Documents that all have the same hit rate: no document-level uncertainty, however few decisions; documents
    that accept all or nothing: an interval as wide as a binomial over documents (10 of 20), far wider than
    Wilson's over the 2000 decisions."""
    same = cluster_bootstrap_ratio(np.full(20, 3), np.full(20, 10))
    assert same == pytest.approx((0.3, 0.3))
    low, high = cluster_bootstrap_ratio(np.array([100] * 10 + [0] * 10), np.full(20, 100))
    w_low, w_high = wilson(1000, 2000)
    assert low <= 0.3 and high >= 0.7 and (high - low) > 5 * (w_high - w_low)
    assert all(math.isnan(x) for x in cluster_bootstrap_ratio(np.zeros(0), np.zeros(0)))


def test_frames_round_trip_the_cells(documented: Path):
    frames = report.load(documented)
    cells = frames.cells.set_index(["task", "cell"])
    for task in TASKS:
        for lam in LAMBDAS:
            row = cells.loc[(task, f"lambda_{lam:g}")]
            assert row["score"] == SCORES[task][lam] and row["lambda"] == lam and row["window"] == 64
            assert row["accepted"] == sum(ACCEPTED[task][lam]) and row["speculated"] == NUM_LAYERS * SPECULATED
            assert row["stderr"] == 0.1 and row["n"] == DOCUMENTS[task] == row["n_paired"]
            right_base, right = round(SCORES[task]["baseline"] * DOCUMENTS[task]), round(SCORES[task][lam] * DOCUMENTS[task])
            assert row["diff"] == pytest.approx(SCORES[task][lam] - SCORES[task]["baseline"])
            assert row["p_value"] == pytest.approx(mcnemar_exact(right_base - right, 0))
            assert row["hit_low"] < row["hit_rate"] < row["hit_high"]
            assert row["hit_low_decision"] < row["hit_rate"] < row["hit_high_decision"]
            assert (row["hit_low_decision"], row["hit_high_decision"]) == wilson(row["accepted"], row["speculated"])
            # the synthetic documents' decisions are clustered: the document-level interval is the wider one
            assert row["hit_high"] - row["hit_low"] > row["hit_high_decision"] - row["hit_low_decision"]
    assert math.isnan(cells.loc[("alspec_recall", "baseline")]["diff"])
    layers = frames.layers.set_index(["task", "cell", "layer"])
    assert layers.loc[("alspec_recall", "lambda_0.1", 2)]["accepted"] == ACCEPTED["alspec_recall"][0.1][2]
    docs = frames.documents
    assert len(docs[(docs.task == "alspec_recall") & (docs.cell == "sink")]) == DOCUMENTS["alspec_recall"]
    assert docs.groupby(["task", "cell"])["score"].mean().loc[("alspec_recall", "sink")] == SCORES["alspec_recall"]["sink"]


def test_sink_cells_written_under_the_old_policy_name_report_as_before(tmp_path: Path):
    """A sweep folder of before the policy "sink" was named "always": its cells give the same frames."""
    new, old = write_sweep(tmp_path / "new"), write_sweep(tmp_path / "old")
    for path in (old / "cells").glob("*/sink.json"):
        cell = json.loads(path.read_text())
        assert cell["policy"] == "always"
        path.write_text(json.dumps({**cell, "policy": "sink"}))
    frames = [report.load(folder).cells.drop(columns=["elapsed_s"], errors="ignore") for folder in (new, old)]
    pd.testing.assert_frame_equal(*frames)
    assert set(frames[1][frames[1].cell == "sink"]["policy"]) == {"always"}


def test_table1_gains_intervals_and_nothing_else(documented: Path, tmp_path: Path):
    plain = write_sweep(tmp_path / "plain")
    with_ci = (write_report(documented, latency=[])[0]).read_text().splitlines()
    without = (write_report(plain, latency=[])[0]).read_text().splitlines()
    table = [line for line in with_ci if line.startswith("|")]
    assert [line.split(" | ")[0] for line in table] == [line.split(" | ")[0] for line in without if line.startswith("|")]
    stripped = [pd.Series(line.split(" | ")).str.replace(r" \([+-][0-9.]+ \[[+-][0-9.]+, [+-][0-9.]+\]\)", "", regex=True)
                .tolist() for line in table]
    assert stripped == [line.split(" | ") for line in without if line.startswith("|")]
    sink = next(line for line in table if line.startswith("| sink"))
    assert "0.500 (-0.375 [" in sink  # recall: 8 of 16 documents right against 14


def test_frontier_names_the_cheapest_safe_cell(documented: Path):
    paths = write_report(documented)
    names = {p.name for p in paths}
    assert {"frontier.png", "table1.md"} <= names
    md = (documented / "report" / "table1.md").read_text()
    assert "alspec_recall: " in md and "gives the largest projected speedup" in md
    frames = report.load(documented).cells
    ok = not_worse(frames)
    # recall at lambda 0.05 keeps the baseline's score: not worse; sink loses 6 of 16 documents: worse
    key = frames.set_index(["task", "cell"]).index
    assert ok[list(key).index(("alspec_recall", "lambda_0.05"))]
    assert not ok[list(key).index(("alspec_recall", "sink"))]
