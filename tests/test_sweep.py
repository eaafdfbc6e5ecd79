"""Sweeps: config validation, shared prefill against separate runs, and a killed sweep that resumes."""

from __future__ import annotations

import csv
import json
import re
import warnings
from pathlib import Path

import pytest

from alspec_eval.approx_check.models import save_tiny, tiny_model
from alspec_eval.approx_check.properties import median_ratio
from alspec_eval.config import ConfigError, SpeculationConfig
from alspec_eval.rows import BASELINE, SINK, Row
from alspec_eval.rows import prefill_groups
from alspec_eval.sweep.config import fingerprint, load_config, parse_config
from alspec_eval.sweep.runner import cell_path, existing_cells, run_sweep
from default_approximations import DRAFTS, PROMPT_SCORING, approx_args
from helpers import PROMPTS, alspec_lm, gen_requests, ll_requests, read_cells, sample_stats
from row_kinds import examples

CONFIGS = Path(__file__).parents[1] / "configs"
pytestmark = pytest.mark.filterwarnings("ignore")


@pytest.mark.parametrize("name", ["smoke", "demo", "paper_table1", "demo_approx", "demo_kvpress", "ruler",
                                  "ruler_density", "ruler_llama3", "ruler_vllm", "ruler_llama3_vllm"])
def test_shipped_configs_are_valid(name):
    config = load_config(CONFIGS / f"{name}.yaml")
    last = {"demo_approx": "inf_snapkv_w32_k5_r8_S32",  # no static rows
            "demo_kvpress": "lambda_0.4_kvpress-CompactorPress",
            "ruler": "inf_vattention_e0.3_d0.2_b0.05_s4_l32_t32_seed0",  # each draft unverified too (always)
            "ruler_density": "inf_vattention_e0.3_d0.2_b0.05_s4_l32_t32_seed0_S256",  # on a budget axis
            "ruler_llama3": "lambda_0.4_kvpress-KnormPress_S128", "ruler_vllm": "inf_kvpress-StreamingLLMPress",
            "ruler_llama3_vllm": "lambda_0.4_kvpress-StreamingLLMPress_S128"}.get(name, "static")
    assert config.rows()[0].name == "baseline" and config.rows()[-1].name == last
    assert sorted(p.stem for p in CONFIGS.glob("*.yaml")) == ["demo", "demo_approx", "demo_kvpress", "paper_table1",
                                                              "ruler", "ruler_density", "ruler_llama3", "ruler_llama3_vllm",
                                                              "ruler_vllm", "smoke"]
    assert config.engine == ("vllm" if name.endswith("_vllm") else "hf")


@pytest.mark.parametrize(("change", "message"), [
    ({"lambda": [0.1]}, "unknown key 'lambda'; did you mean 'lambdas'?"),
    ({"lambdas": [0.1, -1]}, "lambdas must be finite and > 0"),
    ({"lambdas": "0.1"}, "lambdas must be a list of numbers"),
    ({"static": {"p": 0.8, "lambda": 0.3}}, "static.lambda=0.3 must be one of lambdas"),
    ({"static": {"q": 0.8}}, "unknown key 'q'"),
    ({"window": 0}, "window=0 must be an integer >= 1"),
    ({"gammas": [4, 0]}, "gammas must be a list of draft lengths"),
    ({"lambdas": []}, "lambdas is empty ([]), but the static baseline calibrates"),
    ({"approx": ["sink", "snapkvv"]}, "approx='snapkvv' is unknown"),
    ({"approx": []}, "approx must be a list of approximations"),
    ({"page": 8}, "a sweep gives quest's page as approx_args: {quest: {page: 8}}"),
    ({"approx_args": {"quest": {"page": 8}}}, "must map approximations of approx (sink)"),
    ({"approx": ["quest"], "window": 8, "approx_args": {"quest": {"page": 16}}}, "page:16 does not divide"),
    ({"approx": ["quest"], "window": 8}, "page:16 does not divide"),  # quest's default page, one past S = 8
    ({"approx": ["topk"], "model_args": {"kernel": "triton"}}, "kernel=triton"),
    ({"approx": ["quest"], "model_args": {"backend": "tt"}, "window": 128}, "backend=sim only"),
    ({"model_args": {"approx": "topk"}}, "move them there"),
    ({"model_args": {"approx_args": "page:4"}}, "move them there"),
    ({"window": []}, "window=[] must be an integer >= 1 or a list of them (a budget axis)"),
    ({"window": [16, 0]}, "window=[16, 0] must be an integer >= 1"),
    ({"window": [8, 32], "approx": ["quest"], "approx_args": {"quest": {"page": 16}}}, "page:16 does not divide the key "
     "budget 2S=16"),  # fits S = 32, not S = 8
    ({"sink": False, "always": True}, "sink is the old name of always; keep always: True and drop sink"),
    ({"approx": ["sink", "vattention"], "approx_args": {"vattention": []}},
     "approx_args vattention: [] lists no setting; give one mapping of its parameters per setting"),
    ({"approx": ["quest"], "window": 8, "approx_args": {"quest": [{"page": 4}, {"page": 4}]}},
     "approx_args quest: {'page': 4} is the setting {'page': 4} again (quest P=4); list each setting once"),
    ({"approx": ["vattention"], "approx_args": {"vattention": [{"epsilon": 0.1}, {"delta": 0.1}]}},
     "approx_args vattention: {'delta': 0.1} is the setting {'epsilon': 0.1} again"),  # the same once defaults fill in
    ({"approx": ["quest"], "window": 8, "approx_args": {"quest": [4, {"page": 8}]}},
     "approx_args quest: 4 in the list is not a setting"),
    ({"approx": ["quest"], "window": 8, "approx_args": {"quest": [{"page": 4}, {"page": 16}]}},
     "page:16 does not divide"),  # every setting is checked against the window
])
def test_config_errors_name_the_key_and_fix(change, message):
    raw = {"name": "x", "tasks": ["alspec_recall"], "lambdas": [0.1, 0.2], **change}
    with pytest.raises(ConfigError, match=re.escape(message)):
        parse_config(raw)


def test_a_sweep_of_approximations_has_each_approximations_rows_and_static_calibrated_on_its_own():
    config = parse_config({"name": "x", "tasks": ["alspec_recall"], "lambdas": [0.1], "window": 8,
                           "approx": ["quest", "sink", "quest"], "approx_args": {"quest": "page:4"}})
    assert [row.name for row in config.rows()] == [
        "baseline", "lambda_0.1_quest_p4", "inf_quest_p4", "lambda_0.1", "sink", "static_quest_p4", "static"]
    assert config.rows()[-2].calibration(0.1).name == "lambda_0.1_quest_p4"
    assert [row.name for row in parse_config({"name": "x", "tasks": ["t"], "lambdas": [0.1]}).rows()] == [
        "baseline", "lambda_0.1", "sink", "static"]  # without approx: the paper's rows, as before


TWO_VATTENTIONS = {"name": "x", "tasks": ["alspec_recall"], "lambdas": [0.1, 0.4], "window": 8,
                   "approx": ["sink", "vattention", "quest"],
                   "approx_args": {"vattention": [{"epsilon": 0.3, "delta": 0.2}, {"epsilon": 0.1, "delta": 0.1}],
                                   "quest": {"page": 4}}}


def test_one_approximation_at_two_settings_is_two_row_sets_with_their_own_cells(tmp_path):
    """approx_args {name: [setting, setting]}: that approximation once per setting, in the list's order, each with
    its own rows, cell files, labels, fingerprints and static calibration; a resumed sweep tells them apart."""
    config = parse_config({**TWO_VATTENTIONS, "output": str(tmp_path)})
    sink, first, second, quest = config.approx
    assert (first.name, first.epsilon, first.delta) == ("vattention", 0.3, 0.2)
    assert (second.name, second.epsilon, second.delta) == ("vattention", 0.1, 0.1)
    assert first.args() == {**second.args(), "epsilon": 0.3, "delta": 0.2}  # the other parameters their defaults
    assert sink.is_default and quest.page == 4
    rows = config.rows()
    assert [r.name for r in rows] == [
        "baseline", "lambda_0.1", "lambda_0.4", "sink",
        *(f"{kind}_vattention_e{e}_d{d}_b0.05_s4_l32_t32_seed0" for e, d in ((0.3, 0.2), (0.1, 0.1))
          for kind in ("lambda_0.1", "lambda_0.4", "inf")),
        "lambda_0.1_quest_p4", "lambda_0.4_quest_p4", "inf_quest_p4",
        "static", *(f"static_vattention_e{e}_d{d}_b0.05_s4_l32_t32_seed0" for e, d in ((0.3, 0.2), (0.1, 0.1))),
        "static_quest_p4"]
    assert len({r.label for r in rows}) == len({cell_path(tmp_path, "alspec_recall", r) for r in rows}) == len(rows)
    ones = [Row.dynamic(0.4, a) for a in (first, second)]
    assert [r.label for r in ones] == ["λ = 0.4 · vattention ε=0.3 δ=0.2 base=0.05 sink=4 local=32 top=32 seed=0",
                                       "λ = 0.4 · vattention ε=0.1 δ=0.1 base=0.05 sink=4 local=32 top=32 seed=0"]
    for row in ones:  # each cell records its own setting, and reads back as its own row
        record = row.record()
        assert record["approx_args"] == row.approx.args()
        assert Row.from_record(record["policy"], record["lambda"], approx=record["approx"],
                               approx_args=record["approx_args"]) == row
    static = [r for r in rows if r.calibrated and r.approx in (first, second)]
    assert [r.calibration(0.4).name for r in static] == [r.name for r in ones]
    prints = [fingerprint(config, "alspec_recall", r) for r in ones]
    assert prints[0] != prints[1]
    # a sweep killed after the first setting's cell resumes with the second's still to run
    path = cell_path(tmp_path, "alspec_recall", ones[0])
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps({"cell": ones[0].name, "fingerprint": prints[0]}))
    missing = existing_cells(config, recompute=False)
    assert ("alspec_recall", ones[0]) not in missing and ("alspec_recall", ones[1]) in missing
    assert len(missing) == len(rows) - 1


def test_sweep_json_keeps_every_setting_and_reads_back():
    """sweep.json (SweepConfig.to_dict) lists a name's settings in order, so that the config it gives and the
    report's reading of it have the same approximations; a single mapping is written as before."""
    from alspec_eval.report.cells import Sweep

    config = parse_config(TWO_VATTENTIONS)
    saved = json.loads(json.dumps(config.to_dict()))
    assert saved["approx"] == ["sink", "vattention", "quest"]
    assert saved["approx_args"] == {"vattention": [config.approx[1].args(), config.approx[2].args()],
                                    "quest": {"page": 4}}
    again = parse_config({**TWO_VATTENTIONS, "approx": saved["approx"], "approx_args": saved["approx_args"]})
    assert again.approx == config.approx and again.rows() == config.rows()
    report = Sweep(Path("unused"), saved)
    assert report.approximations == [config.approx[0], config.approx[3], *config.approx[1:3]]  # registry order
    assert {r for r in report.rows if r.lam == 0.4} == {r for r in config.rows() if r.lam == 0.4}
    assert len({r.label for r in report.rows}) == len(report.rows)


def test_a_single_mapping_of_approx_args_keeps_its_meaning():
    """{quest: {page: 4}} is one setting, as before, and a list of that one mapping is the same sweep."""
    raw = {"name": "x", "tasks": ["alspec_recall"], "lambdas": [0.1], "window": 8, "approx": ["sink", "quest"]}
    one = parse_config({**raw, "approx_args": {"quest": {"page": 4}}})
    listed = parse_config({**raw, "approx_args": {"quest": [{"page": 4}]}})
    assert one.approx == listed.approx and [a.slug for a in one.approx] == ["sink", "quest_p4"]
    assert [r.name for r in one.rows()] == [r.name for r in listed.rows()] == [
        "baseline", "lambda_0.1", "sink", "lambda_0.1_quest_p4", "inf_quest_p4", "static", "static_quest_p4"]
    assert one.to_dict()["approx_args"] == listed.to_dict()["approx_args"] == {"quest": {"page": 4}}


def test_a_budget_axis_gives_every_row_each_window():
    config = parse_config({"name": "x", "tasks": ["alspec_recall"], "lambdas": [0.1], "window": [32, 16, 32],
                           "approx": ["sink", "local"]})
    assert config.windows == [16, 32]
    assert [row.name for row in config.rows()] == [
        "baseline", "lambda_0.1_S16", "sink_S16", "lambda_0.1_S32", "sink_S32", "lambda_0.1_local_S16",
        "inf_local_S16", "lambda_0.1_local_S32", "inf_local_S32", "static_S16", "static_S32", "static_local_S16",
        "static_local_S32"]
    static = config.rows()[-1]
    assert static.calibration(0.1).name == "lambda_0.1_local_S32" and static.label == "static · local · S=32"
    assert static.config(SpeculationConfig(window=16)).window == 32  # a row runs with its own window
    record = static.record([1])
    assert Row.from_record(record["policy"], approx=record["approx"], window=record["window"]) == static
    assert fingerprint(config, "alspec_recall", config.rows()[3])["window"] == 32
    assert fingerprint(config, "alspec_recall", BASELINE)["window"] == 16
    groups = prefill_groups(config.rows())  # one prefill, every approximation and window decoding from it
    assert [[r.name for r in g] for g in groups] == [
        ["baseline", "lambda_0.1_S16", "sink_S16", "lambda_0.1_S32", "sink_S32",
         "lambda_0.1_local_S16", "inf_local_S16", "lambda_0.1_local_S32", "inf_local_S32"]]


def test_a_resumed_sweep_reuses_a_lambda_inf_cell_under_its_old_sink_name(tmp_path):
    """A cell of A~ always of another approximation written as "sink_<slug>.json" (before such rows were named
    "inf_<slug>") is this config's cell: a resumed sweep reuses it, and a stale one is refused under that name."""
    config = parse_config({"name": "x", "tasks": ["alspec_recall"], "lambdas": [0.1], "window": 8, "static": False,
                           "approx": ["sink", "quest"], "approx_args": {"quest": "page:4"}, "output": str(tmp_path)})
    task, row = "alspec_recall", SINK.approximated(config.approx[1])
    old = tmp_path / "cells" / task / "sink_quest_p4.json"
    old.parent.mkdir(parents=True)
    old.write_text(json.dumps({"cell": "sink_quest_p4",
                               "fingerprint": {**fingerprint(config, task, row), "cell": "sink_quest_p4"}}))
    assert row.name == "inf_quest_p4" and cell_path(tmp_path, task, row) == old
    missing = existing_cells(config, recompute=False)
    assert (task, row) not in missing and len(missing) == len(config.rows()) - 1
    old.write_text(json.dumps({"fingerprint": {**fingerprint(config, task, row), "cell": "sink_quest_p4", "seed": 1}}))
    with pytest.raises(ConfigError, match=re.escape(f"{old} is made with other settings")):
        existing_cells(config, recompute=False)
    assert (task, row) in existing_cells(config, recompute=True)


def test_empty_lambdas_without_static_is_a_sweep():
    config = parse_config({"name": "x", "tasks": ["alspec_recall"], "lambdas": [], "static": False, "gammas": [2]})
    assert [row.name for row in config.rows()] == ["baseline", "sink", "selfspec_g2"]


def test_the_lambda_inf_rows_key_is_always_and_sink_its_old_name():
    """`always` names the rows that accept A~ always; configs written with `sink` read the same."""
    raw = {"name": "x", "tasks": ["alspec_recall"], "lambdas": [0.1], "approx": ["sink", "quest"],
           "approx_args": {"quest": {"page": 4}}, "window": 8}

    def names(**key: bool) -> list[str]:
        return [row.name for row in parse_config({**raw, **key}).rows()]

    every = names()
    assert {"sink", "inf_quest_p4"} <= set(every) and names(sink=True) == names(always=True) == every
    assert names(sink=False) == names(always=False) == [n for n in every if n not in ("sink", "inf_quest_p4")]


def test_missing_config_file():
    with pytest.raises(ConfigError, match="does not exist"):
        load_config("configs/nope.yaml")


@pytest.mark.slow
def test_shared_prefill_equals_separate_runs(tmp_path):
    """Every kind of row that shares the prefill (row_kinds.py) answers as a run of its own model_args would."""
    model = tiny_model()
    lam = median_ratio(alspec_lm(model), PROMPTS[0])
    kinds = [e for e in examples(lam, folder=tmp_path) if e.row.shares_prefill]
    variants = [e.row for e in kinds] + [Row.dynamic(2 * lam)]
    shared_lm = alspec_lm(model, batch_size=2)
    shared = {}
    with warnings.catch_warnings(record=True) as warned, shared_lm.shared_prefill(variants) as fork:
        warnings.simplefilter("always")
        for variant in variants:
            with shared_lm.answering(variant, shared=fork):
                gen, ll = gen_requests(), ll_requests()
                shared[variant.name] = (shared_lm.generate_until(gen), sample_stats(gen),
                                        shared_lm.loglikelihood(ll), sample_stats(ll))
    # transformers 5.24 renamed the cache argument: the project passes the installed version's name (compat.py)
    assert not [w for w in warned if "past_key_values" in str(w.message)]
    for variant, args in [(e.row, e.model_args) for e in kinds] + [(variants[-1], {"lambda": 2 * lam})]:
        lm = alspec_lm(model, batch_size=2, **args)
        gen, ll = gen_requests(), ll_requests()
        texts, gen_stats, lls, ll_stats = shared[variant.name]
        assert lm.generate_until(gen) == texts, variant
        assert sample_stats(gen) == gen_stats, variant
        assert [x for x, _ in lm.loglikelihood(ll)] == pytest.approx([x for x, _ in lls], abs=1e-4), variant
        assert sample_stats(ll) == ll_stats, variant
    accepted = {v.kind if v.kind != "dynamic" else v.lam: sum(s["accepted"] for s in shared[v.name][1])
                for v in variants}
    assert accepted["baseline"] == 0 and 0 < accepted[lam] < accepted[2 * lam] < accepted["always"]
    assert accepted["selfspec"] == 0 and 0 < accepted["tuned"] < accepted["always"]
    assert shared["selfspec_g2"][0] == shared["baseline"][0]  # lossless
    assert all(s["selfspec"]["steps"] > 0 for s in shared["selfspec_g2"][1])



@pytest.mark.slow
@pytest.mark.parametrize("approx", DRAFTS)
def test_shared_prefill_of_an_approximation_equals_separate_runs(approx):
    """Rows of another approximation (and self-speculation drafting with it) on one prefill with the sink's rows
    answer as runs of their own model_args would: each approximation decodes from the prefill in a call of its
    own."""
    model = tiny_model()
    args = approx_args(approx, 8)
    lam = median_ratio(alspec_lm(model, **args), PROMPTS[0])
    made = SpeculationConfig(**args).approx
    variants = [BASELINE, Row.dynamic(lam, made), SINK.approximated(made), Row.selfspec(2, made), Row.dynamic(lam)]
    shared_lm = alspec_lm(model, batch_size=2)
    shared = {}
    with shared_lm.shared_prefill(variants) as fork:
        for variant in variants:
            with shared_lm.answering(variant, shared=fork):
                gen, ll = gen_requests(), ll_requests()
                shared[variant] = (shared_lm.generate_until(gen), sample_stats(gen), shared_lm.loglikelihood(ll),
                                   sample_stats(ll))
    own_args = [{"policy": "exact"}, {"lambda": lam, **args}, {"policy": "always", **args},
                {"policy": "selfspec", "gamma": 2, **args}, {"lambda": lam}]
    for variant, own in zip(variants, own_args, strict=True):
        lm = alspec_lm(model, batch_size=2, **own)
        gen, ll = gen_requests(), ll_requests()
        texts, gen_stats, lls, ll_stats = shared[variant]
        assert lm.generate_until(gen) == texts, variant
        assert sample_stats(gen) == gen_stats, variant
        assert [x for x, _ in lm.loglikelihood(ll)] == pytest.approx([x for x, _ in lls], abs=1e-4), variant
        assert sample_stats(ll) == ll_stats, variant
    accepted = [sum(s["accepted"] for s in shared[v][1]) for v in variants[:3]]
    assert accepted[0] == 0 < accepted[1] < accepted[2]


def _prompt_args(approx: str) -> dict:
    """The model_args of a registered approximation or of a kvpress press (default_presses.py) at S = 8."""
    from default_presses import press_args

    return press_args(approx.split(":", 1)[1], 8) if approx.startswith("kvpress:") else approx_args(approx, 8)


PROMPT_DRAFTS = [*PROMPT_SCORING, "kvpress:SnapKVPress", "kvpress:CompactorPress"]


@pytest.mark.slow
@pytest.mark.parametrize("approx", PROMPT_DRAFTS)
def test_rows_that_score_the_prompt_share_the_prefill_of_a_sweep(approx, tmp_path):
    """An approximation that scores the prompt at prefill observes it from the queries and inputs the shared
    prefill kept: a sweep with shared_prefill on gives the cells of one with it off (each row its own prefill);
    self-speculation with it is refused before anything loads."""
    model = save_tiny(tmp_path / "model", max_positions=4096)
    overrides = {"model_args": {"pretrained": model}, "lambdas": [0.5, 1.0], "static": False, "window": 8,
                 "approx": ["sink", approx], "approx_args": {approx: _prompt_args(approx)["approx_args"]}}
    cells = [read_cells(run_sweep(load_config(CONFIGS / "smoke.yaml", {**overrides, "shared_prefill": shared,
                                                                        "output": str(tmp_path / str(shared))})))
             for shared in (True, False)]
    assert cells[0] == cells[1]
    made = SpeculationConfig(window=8, **_prompt_args(approx)).approx
    assert {f"alspec_recall/lambda_0.5_{made.slug}", f"alspec_recall/inf_{made.slug}"} <= set(cells[0])
    assert cells[0][f"alspec_recall/lambda_1_{made.slug}"]["alspec"]["total"]["speculated"] > 0
    with pytest.raises(ConfigError, match="scores the prompt at prefill"):
        SpeculationConfig(policy="selfspec", window=8, **_prompt_args(approx))


@pytest.mark.slow
@pytest.mark.parametrize("approx", PROMPT_DRAFTS)
def test_a_prompt_scoring_row_on_a_shared_prefill_answers_as_its_own_run(approx):
    """Generations and log-likelihoods (a common prompt prefix, then the rest per fork) of a prompt-scoring row on
    one prefill beside the sink's rows equal runs of its own model_args."""
    model = tiny_model()
    args = _prompt_args(approx)
    lam = median_ratio(alspec_lm(model, window=8), PROMPTS[0])
    made = SpeculationConfig(window=8, **args).approx
    variants = [BASELINE, Row.dynamic(lam, made), SINK.approximated(made), Row.dynamic(lam)]
    shared_lm, shared = alspec_lm(model, batch_size=2, window=8), {}
    with shared_lm.shared_prefill(variants) as fork:
        for variant in variants:
            with shared_lm.answering(variant, shared=fork):
                gen, ll = gen_requests(), ll_requests()
                shared[variant] = (shared_lm.generate_until(gen), sample_stats(gen), shared_lm.loglikelihood(ll),
                                   sample_stats(ll))
    own_args = [{"policy": "exact"}, {"lambda": lam, **args}, {"policy": "always", **args}, {"lambda": lam}]
    for variant, own in zip(variants, own_args, strict=True):
        lm = alspec_lm(model, batch_size=2, window=8, **own)
        gen, ll = gen_requests(), ll_requests()
        texts, gen_stats, lls, ll_stats = shared[variant]
        assert lm.generate_until(gen) == texts, variant
        assert sample_stats(gen) == gen_stats, variant
        assert [x for x, _ in lm.loglikelihood(ll)] == pytest.approx([x for x, _ in lls], abs=1e-4), variant
        assert sample_stats(ll) == ll_stats, variant
    assert sum(s["speculated"] for s in shared[variants[1]][1]) > 0


@pytest.mark.slow
def test_a_budget_axis_sweep_runs_each_window_and_reports_score_against_density(tmp_path, monkeypatch):
    """window: [4, 8] with two approximations: a cell per (approximation, window, lambda), the same with and without
    the shared prefill (one per document: each approximation and window decodes from it in a call of its own,
    counted), each
    cell's densities those of its own S, and the report's score against effective density."""
    from alspec_eval.report.build import write_report
    from alspec_eval.stats import DENSITY, EFFECTIVE_DENSITY

    model = save_tiny(tmp_path / "model", max_positions=4096)
    overrides = {"model_args": {"pretrained": model}, "lambdas": [0.5, 1.0], "static": False, "window": [4, 8],
                 "approx": ["sink", "quest"], "approx_args": {"quest": "page:4"}}
    from alspec_eval.shared_prefill import SharedPrefill

    forks, original = [], SharedPrefill._forks

    def spy(self, indices, cache):
        parts = list(original(self, indices, cache))
        forks.append([(config.approx.name, config.window) for config, _, _ in parts])
        return iter(parts)

    monkeypatch.setattr(SharedPrefill, "_forks", spy)
    outs = [run_sweep(load_config(CONFIGS / "smoke.yaml", {**overrides, "shared_prefill": shared,
                                                           "output": str(tmp_path / str(shared))}))
            for shared in (True, False)]
    # every prefill serves both approximations at both windows
    assert forks and all(calls == [("sink", 4), ("sink", 8), ("quest", 4), ("quest", 8)] for calls in forks)
    cells = read_cells(outs[0])
    assert cells == read_cells(outs[1])
    assert sorted(cells) == sorted(f"alspec_recall/{name}" for name in [
        "baseline", *(f"{'inf' if kind == 'sink' and approx else kind}{approx}_S{w}"  # λ = ∞ of quest: no sink
                      for kind in ("lambda_0.5", "lambda_1", "sink") for approx in ("", "_quest_p4") for w in (4, 8))])
    for approx in ("", "_quest_p4"):
        small, large = (cells[f"alspec_recall/lambda_1{approx}_S{w}"] for w in (4, 8))
        assert small["window"] == 4 and large["window"] == 8
        assert small["alspec"]["total"][DENSITY] < large["alspec"]["total"][DENSITY] <= 1
        for cell in (small, large):
            total = cell["alspec"]["total"]
            assert total[DENSITY] <= total[EFFECTIVE_DENSITY] <= 1
    names = {p.name for p in write_report(outs[0], latency=[])}
    assert {"score_vs_density.png", "heatmap_alspec_recall_S4.png", "heatmap_alspec_recall_quest_p4_S8.png"} <= names
    from alspec_eval.report.figures import score_vs_density
    from alspec_eval.report.frames import load

    frame = load(outs[0]).cells
    (ax,) = [a for a in score_vs_density(frame).axes if a.get_title() == "alspec_recall"]
    curves = {line.get_label(): line for line in ax.lines if not line.get_label().startswith("_")}
    assert set(curves) == {"sink · S=4", "sink · S=8", "quest P=4 · S=4", "quest P=4 · S=8", "dense baseline (exact A)"}
    for approx, label in (("sink", "sink"), ("quest", "quest P=4")):
        for w in (4, 8):
            rows = frame[(frame["approx"] == approx) & (frame["window"] == w) & (frame["policy"] == "dynamic")]
            assert sorted(curves[f"{label} · S={w}"].get_xdata()) == pytest.approx(
                sorted(100 * rows["effective_density"]))


@pytest.mark.slow
def test_a_sweep_of_one_approximation_at_two_settings_writes_and_reports_both(tmp_path):
    """vattention at two settings through a tiny model: each setting's cells on disk record their own parameters,
    sweep.json keeps both, and Table 1, the board and their CSVs name each setting in a row of its own."""
    from alspec_eval.report.build import write_report
    from alspec_eval.report.cells import load_sweep
    from alspec_eval.report.frames import args_text
    from alspec_eval.stats import DENSITY, PROMISE_DENOMINATOR, PROMISE_DN

    model = save_tiny(tmp_path / "model", max_positions=4096)
    settings = [{"epsilon": 0.1, "delta": 0.1, "sink": 2, "local": 4, "top": 4},
                {"epsilon": 0.3, "delta": 0.2, "sink": 2, "local": 4, "top": 4}]
    config = load_config(CONFIGS / "smoke.yaml", {
        "model_args": {"pretrained": model}, "lambdas": [1.0], "static": False, "window": 8,
        "approx": ["sink", "vattention"], "approx_args": {"vattention": settings}, "output": str(tmp_path / "out")})
    made = config.approx[1:]
    out = run_sweep(config)
    cells = read_cells(out)
    for approx, setting in zip(made, settings, strict=True):
        for kind in ("lambda_1", "inf"):
            cell = cells[f"alspec_recall/{kind}_{approx.slug}"]
            assert cell["approx"] == "vattention" and {k: cell["approx_args"][k] for k in setting} == setting
            total = cell["alspec"]["total"]  # its promise, realized: shares, verified (lambda) or not (inf)
            assert all(0 <= total[k] <= 1 for k in (PROMISE_DN, PROMISE_DENOMINATOR)) and total[DENSITY] is not None
    assert PROMISE_DN not in cells["alspec_recall/lambda_1"]["alspec"]["total"]  # the sink promises nothing
    assert len(cells) == 3 + 2 * len(made)  # baseline, lambda_1, sink and each setting's two rows
    assert json.loads((out / "sweep.json").read_text())["approx_args"] == {"vattention": [a.args() for a in made]}
    assert load_sweep(out).approximations == config.approx
    names = {p.name: p for p in write_report(out)}
    table = names["table1.md"].read_text()
    assert all(f"λ = 1 · {a.label}" in table for a in made)
    assert all(("ε missed: d/n" in line) == ("vattention" in line) for line in table.splitlines() if "λ = 1" in line)
    board = names["board.md"].read_text()
    assert all(f"| {a.label} †" in board for a in made)  # an oracle: shown, not ranked
    assert "| hit rate | ε missed: d/n | ε missed: D |" in board
    with names["board.csv"].open() as handle:
        entries = list(csv.DictReader(handle))
    drafts = [(r["approx"], r["approx_args"]) for r in entries]
    assert sorted(a for n, a in drafts if n == "vattention") == sorted(args_text(a) for a in made)
    for r in entries:  # the shares where the draft promises (and a cell was verified), empty otherwise
        assert (r["promise_dn"] not in ("", "nan")) == (r["approx"] == "vattention" and r["speedup"] != "nan"), r
    with names["table1.csv"].open() as handle:
        rows = {(r["approx"], r["approx_args"]) for r in csv.DictReader(handle) if r["policy"] == "dynamic"}
    assert {("vattention", args_text(a)) for a in made} <= rows


@pytest.mark.slow
def test_killed_sweep_resumes_to_the_same_cells(tmp_path):
    model = save_tiny(tmp_path / "model", max_positions=4096)
    overrides = {"model_args": {"pretrained": model}, "lambdas": [0.5, 1.0], "static": {"p": 0.5, "lambda": 1.0}}

    def stop_after_first(path: Path) -> None:
        raise KeyboardInterrupt

    interrupted = load_config(CONFIGS / "smoke.yaml", {**overrides, "output": str(tmp_path / "a")})
    with pytest.raises(KeyboardInterrupt):
        run_sweep(interrupted, on_cell=stop_after_first)
    assert [p.name for p in (tmp_path / "a" / "cells" / "alspec_recall").iterdir()] == ["baseline.json"]
    run_sweep(interrupted)
    straight = run_sweep(load_config(CONFIGS / "smoke.yaml", {**overrides, "output": str(tmp_path / "b")}))
    resumed, fresh = read_cells(tmp_path / "a"), read_cells(straight)
    assert resumed == fresh
    assert sorted(fresh) == [f"alspec_recall/{c}" for c in sorted(["baseline", "lambda_0.5", "lambda_1", "sink", "static"])]
    sink, static = fresh["alspec_recall/sink"], fresh["alspec_recall/static"]
    assert sink["alspec"]["total"]["hit_rate"] == 1.0 and sink["lambda"] == "inf"
    dynamic = fresh["alspec_recall/lambda_1"]["alspec"]["layers"]
    assert static["static_layers"] == [l["layer"] for l in dynamic if l["hit_rate"] is not None and l["hit_rate"] >= 0.5]
    assert fresh["alspec_recall/baseline"]["alspec"]["total"]["speculated"] == 0
    assert all(isinstance(c["score"], float) and c["metric"] == "exact_match,first-number" for c in fresh.values())


@pytest.mark.slow  # lm-eval indexes every task it has (15 s) to name the one meant
def test_unknown_task_stops_before_loading(tmp_path):
    config = parse_config({"name": "x", "tasks": ["alspec_recal"], "lambdas": [0.1], "output": str(tmp_path),
                           "model_args": {"pretrained": str(tmp_path / "missing")}})
    with pytest.raises(ConfigError, match="'alspec_recal' is not an lm-eval task or group; did you mean 'alspec_recall'"):
        run_sweep(config)
    assert not (tmp_path / "cells").exists()


@pytest.mark.slow
def test_the_console_keeps_to_the_progress_bar_and_lm_eval_logs_to_the_run_folder(tmp_path, capfd, monkeypatch):
    """lm-eval's per-cell warnings (a task's custom dataset, once per cell) go to the run's lm_eval.log, and git's
    complaint outside a checkout (lm-eval reads the commit hash per cell) reaches neither."""
    model = save_tiny(tmp_path / "model", max_positions=4096)
    monkeypatch.chdir(tmp_path)  # outside any git checkout
    out = run_sweep(load_config(CONFIGS / "smoke.yaml", {"model_args": {"pretrained": model}, "lambdas": [0.5],
                                                          "static": False, "output": str(tmp_path / "out")}))
    console = capfd.readouterr()
    log = (out / "lm_eval.log").read_text()
    cells = len(list((out / "cells").rglob("*.json")))
    assert cells == 3 and log.count("Custom kwargs can be passed") == cells
    assert "Custom kwargs" not in console.err + console.out and "fatal" not in console.err + console.out
    assert "sweep" in console.err  # the progress bar


@pytest.mark.slow
def test_a_sweep_describes_its_environment_once(tmp_path, monkeypatch):
    """lm-eval describes the environment in every run's results (torch's collect_env: pip, nvidia-smi; 0.5 s a cell
    on a 2-core CPU): a sweep does it once and every cell's run takes that description; lm-eval's own is back
    after."""
    from lm_eval import evaluator

    calls = []

    def described(storage: dict) -> None:
        calls.append(1)
        storage.update(pretty_env_info=f"described {len(calls)} times")

    monkeypatch.setattr(evaluator, "add_env_info", described)
    model = save_tiny(tmp_path / "model", max_positions=4096)
    config = load_config(CONFIGS / "smoke.yaml", {"model_args": {"pretrained": model}, "lambdas": [1.0],
                                                  "static": False, "limit": 1, "output": str(tmp_path / "out")})
    seen = []
    original = evaluator.simple_evaluate

    def simple_evaluate(*args, **kwargs):
        results = original(*args, **kwargs)
        seen.append(results["pretty_env_info"])
        return results

    monkeypatch.setattr(evaluator, "simple_evaluate", simple_evaluate)
    monkeypatch.setattr("lm_eval.simple_evaluate", simple_evaluate)
    cells = read_cells(run_sweep(config))
    assert len(cells) == len(seen) >= 3 and calls == [1]
    assert set(seen) == {"described 1 times"}
    assert evaluator.add_env_info is described
