"""The one row type: names, labels, settings and records, and reading a record back."""

from __future__ import annotations

import math

import pytest

from alspec_eval.config import SpeculationConfig
from alspec_eval.rows import BASELINE, SINK, STATIC, Row, sweep_rows


@pytest.mark.parametrize(("row", "name", "label"), [
    (BASELINE, "baseline", "baseline"), (Row.dynamic(0.1), "lambda_0.1", "λ = 0.1"), (SINK, "sink", "sink"),
    (STATIC, "static", "static"), (Row.selfspec(4), "selfspec_g4", "selfspec γ = 4")])
def test_names_labels_and_records_round_trip(row, name, label):
    assert (row.name, row.label) == (name, label)
    record = row.record()
    assert Row.from_record(record["policy"], record["lambda"], record.get("gamma")) == row
    SpeculationConfig(**{k: v for k, v in row.settings((1,) if row == STATIC else ()).items()})  # a valid config


def test_settings_are_what_each_row_runs_with():
    assert Row.dynamic(0.2).settings() == {"policy": "dynamic", "lam": 0.2, "static_layers": (), "gamma": None,
                                           "lambda_schedule": None}
    assert SINK.thresholds(2) == [math.inf] * 2 and Row.dynamic(0.2).thresholds(2) == [0.2, 0.2]
    assert BASELINE.exact_attention and Row.selfspec(2).exact_attention and not SINK.exact_attention
    assert STATIC.settings((2, 3))["policy"] == "static" and STATIC.settings(())["policy"] == "exact"
    assert STATIC.record([2, 3]) == {"policy": "static", "lambda": None, "static_layers": [2, 3]}


def test_rows_are_checked_and_ordered():
    with pytest.raises(ValueError, match="dynamic row needs lambda"):
        Row("dynamic")
    with pytest.raises(ValueError, match="sink row takes no gamma"):
        Row("sink", gamma=2)
    rows = sweep_rows([0.05, 0.1], gammas=[2])
    assert [r.name for r in rows] == ["baseline", "lambda_0.05", "lambda_0.1", "sink", "selfspec_g2"]
    assert [r.order for r in rows] == [0, 1, 1, 2, 4]
