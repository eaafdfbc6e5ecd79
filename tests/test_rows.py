"""The one row type: names, labels, settings and records, and reading a record back."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, replace

import pytest

from alspec_eval.approximations import DEFAULT, default_approximation, make_approximation
from alspec_eval.approximations.quest import Quest
from alspec_eval.approximations.sink import Sink
from alspec_eval.config import SpeculationConfig
from alspec_eval.plan import EXACT_REJECTED, IDLE, MEASURED, Plan
from alspec_eval.rows import BASELINE, KINDS, SINK, STATIC, Row, prefill_groups, sweep_rows

from row_kinds import examples

TOPK = make_approximation("topk")


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
                                           "lambda_schedule": None, "approx": Sink(), "approx_args": None}
    assert BASELINE.exact_attention and Row.selfspec(2).exact_attention and not SINK.exact_attention
    assert STATIC.settings((2, 3))["policy"] == "static" and STATIC.settings(())["policy"] == "exact"
    assert STATIC.record([2, 3]) == {"policy": "static", "lambda": None, "static_layers": [2, 3]}


def test_rows_are_checked_and_ordered():
    with pytest.raises(ValueError, match="dynamic row needs lambda"):
        Row("dynamic")
    with pytest.raises(ValueError, match="always row takes no gamma"):
        Row("always", gamma=2)
    rows = sweep_rows([0.05, 0.1], gammas=[2])
    assert [r.name for r in rows] == ["baseline", "lambda_0.05", "lambda_0.1", "sink", "selfspec_g2"]
    assert [r.order for r in rows] == [0, 1, 1, 2, 4]


def test_rows_of_each_approximation_are_named_run_recorded_and_read_back_apart():
    base = SpeculationConfig(window=8)
    quest, topk = Row.dynamic(0.1, Quest(page=4)), Row.dynamic(0.1).approximated(TOPK)
    assert (quest.name, topk.name, SINK.approximated(Quest()).name) == ("lambda_0.1_quest_p4", "lambda_0.1_topk",
                                                                        "inf_quest_p16")
    assert len({Row.dynamic(0.1), quest, topk, Row.dynamic(0.1, Quest(page=8))}) == 4  # four cells, four names
    assert len({r.name for r in (Row.dynamic(0.1), quest, topk, Row.dynamic(0.1, Quest(page=8)))}) == 4
    assert quest.label == "λ = 0.1 · quest P=4" and Row.dynamic(0.1).label == "λ = 0.1"
    config = quest.config(base)
    assert (config.approx, config.lam) == (Quest(page=4), 0.1)
    assert Row.dynamic(0.1).config(replace(base, approx="topk")).approx == Sink()  # a row never keeps another's
    for row in (quest, topk, STATIC.approximated(TOPK), Row.selfspec(2, Quest(page=4)), SINK, SINK.approximated(TOPK),
                BASELINE):
        record = row.record([1] if row.calibrated else None)
        assert Row.from_record(record["policy"], record["lambda"], record.get("gamma"), None, record.get("approx"),
                               record.get("approx_args")) == row
    assert Row.from_record("dynamic", 0.1, approx="quest", page=4) == quest  # a cell from before the registry
    assert "approx" not in Row.dynamic(0.1).record()  # a sink cell reads as before approximations
    with pytest.raises(ValueError, match="baseline row cannot take approx 'quest P=16'"):
        BASELINE.approximated(Quest())


def test_the_default_approximation_is_named_once():
    assert default_approximation() == make_approximation(DEFAULT) == Sink() and default_approximation().is_default
    assert SpeculationConfig().approx == Row("dynamic", lam=0.1).approx == default_approximation()
    assert not Quest().is_default and not TOPK.is_default

    @dataclass(frozen=True)
    class Wide(Sink):  # the sink's windows under another class: no default, so its rows carry its slug
        pass

    assert not Wide().is_default and Row.dynamic(0.1, Wide()).name == f"lambda_0.1_{Wide().slug}"
    with pytest.raises(TypeError, match="a row's approx is an Approximation, not 'quest'; make one with"):
        Row.dynamic(0.1, "quest")  # names become approximations where they are read (config, cells), not here


def test_lambda_inf_of_another_approximation_is_no_sink():
    """A~ always of the sink is the paper's sink row; of another approximation it is that approximation accepted
    unverified: "λ = ∞ · quest P=16", file "inf_quest_p16" (its cells of before: "sink_quest_p16")."""
    quest = SINK.approximated(Quest())
    assert (SINK.name, SINK.label, SINK.legacy_names) == ("sink", "sink", ())
    assert (SINK.approximated(None, 32).name, SINK.approximated(None, 32).label) == ("sink_S32", "sink · S=32")
    assert (quest.name, quest.label, quest.legacy_names) == ("inf_quest_p16", "λ = ∞ · quest P=16", ("sink_quest_p16",))
    assert (quest.kind, quest.policy, quest.record()["lambda"]) == ("always", "always", "inf")
    wide = SINK.approximated(TOPK, 32)
    assert (wide.name, wide.label, wide.file_names) == ("inf_topk_S32", "λ = ∞ · topk · S=32",
                                                        ("inf_topk_S32", "sink_topk_S32"))
    assert Row.dynamic(0.1, Quest()).legacy_names == () and STATIC.approximated(Quest()).legacy_names == ()


def test_a_cell_recorded_under_the_old_policy_name_reads_as_the_same_row():
    """Cells written before the policy "sink" was named "always" keep reading, as the row they were made as."""
    for row in (SINK, SINK.approximated(Quest()), SINK.approximated(None, 32)):
        record = {**row.record(), "policy": "sink"}
        assert Row.from_record(record["policy"], record["lambda"], approx=record.get("approx"),
                               approx_args=record.get("approx_args"), window=record.get("window")) == row


def test_a_cell_under_its_legacy_name_is_found_and_its_fingerprint_matches(tmp_path):
    row = SINK.approximated(Quest())
    assert row.cell_file(tmp_path) == tmp_path / "inf_quest_p16.json"  # a new cell: its name
    (tmp_path / "sink_quest_p16.json").write_text("{}")
    assert row.cell_file(tmp_path) == tmp_path / "sink_quest_p16.json"  # resumed and rewritten in place: one file
    assert SINK.cell_file(tmp_path) == tmp_path / "sink.json"
    expected = {"task": "t", "cell": "inf_quest_p16", "seed": 1}
    for cell in ("inf_quest_p16", "sink_quest_p16"):
        assert row.same_cell(json.loads(json.dumps({**expected, "cell": cell})), expected)
    for found in ({**expected, "seed": 2}, {**expected, "cell": "sink_topk"}, None, "unreadable", {"seed": 1}):
        assert not row.same_cell(found, expected)
    assert not SINK.same_cell({**expected, "cell": "sink_quest_p16"}, {**expected, "cell": "sink"})


def test_one_prefill_serves_every_row_but_the_static_one():
    approximations = [None, Quest(page=4), TOPK, make_approximation("snapkv")]
    rows = sweep_rows([0.1, 0.2], gammas=[2], approximations=approximations)
    groups = prefill_groups([*rows, STATIC])
    assert [[r.name for r in g] for g in groups] == [[
        "baseline", "lambda_0.1", "lambda_0.2", "sink", "selfspec_g2", "lambda_0.1_quest_p4", "lambda_0.2_quest_p4",
        "inf_quest_p4", "selfspec_g2_quest_p4", "lambda_0.1_topk", "lambda_0.2_topk", "inf_topk", "selfspec_g2_topk",
        "lambda_0.1_snapkv_w32_k5_r8", "lambda_0.2_snapkv_w32_k5_r8", "inf_snapkv_w32_k5_r8",
        "selfspec_g2_snapkv_w32_k5_r8"]]
    assert prefill_groups([STATIC]) == []


def test_every_kind_has_an_example():
    assert sorted(e.row.kind for e in examples(0.1)) == sorted(KINDS)


# What each kind's line of a decision plan must be, at the example's lambda 0.1 on 4 layers, written from
# docs/design.md (NaN: exact, not recorded; -inf: exact, rejected; inf: A~ always; else accept iff d <= lambda n).
NAN, INF = math.nan, math.inf
EXPECTED_LINES = {"baseline": [NAN] * 4, "dynamic": [0.1] * 4, "always": [INF] * 4, "static": [-INF, INF, -INF, -INF],
                  "selfspec": [NAN] * 4, "tuned": [0.05, 0.4, 0.1, 0.2]}


@pytest.mark.parametrize("example", examples(0.1, layers=4), ids=lambda e: e.id)
def test_every_kind_compiles_to_its_plan_line(example):
    """Every kind's config, and the same row run from model_args, compile to the line the design gives."""
    line = example.row.config(SpeculationConfig(window=8), example.static_layers).thresholds(4)
    from_args, _ = SpeculationConfig.from_model_args({**example.model_args, "window": 8})
    expected = EXPECTED_LINES[example.row.kind]
    for got in (line, from_args.thresholds(4)):
        assert [("nan" if math.isnan(x) else round(x, 6)) for x in got] == [
            ("nan" if math.isnan(x) else x) for x in expected]


def test_a_plan_says_per_layer_what_to_do_and_hands_kernels_a_float_where_it_can():
    plan = Plan.of_rows([[NAN, -INF, 0.1, INF], [NAN, -INF, 0.2, INF], [NAN, NAN, NAN, NAN]])
    assert plan.layer_kinds == [IDLE, EXACT_REJECTED, MEASURED, MEASURED]
    assert plan.active_rows.tolist() == [True, True, False]
    assert plan.layer(3) == INF and isinstance(plan.layer(3), float)
    lam = plan.layer(2)
    assert not isinstance(lam, float) and lam[:2].tolist() == pytest.approx([0.1, 0.2]) and math.isnan(lam[2])
    assert plan.without([3]).layer_kinds == [IDLE, EXACT_REJECTED, MEASURED, IDLE]
    mixed = Plan.of_rows([[-INF], [0.5]])
    assert mixed.layer_kinds == [MEASURED]  # some row measures: A~ is computed, the -inf row is rejected


def test_recorded_lambda_is_the_rows_own():
    """A cell records its own row's settings: no sink or baseline cell records a sweep's first lambda."""
    base = SpeculationConfig(lam=0.5, window=8)
    recorded = {e.row.kind: e.row.config(base, e.static_layers).to_dict()["lambda"] for e in examples(0.1)}
    assert recorded == {"baseline": None, "dynamic": 0.1, "always": "inf", "static": None, "selfspec": None,
                        "tuned": None}
