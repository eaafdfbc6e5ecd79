"""Per-layer lambda schedules (``lambda_schedule=PATH``): parsing and its errors, and every path honouring them."""

from __future__ import annotations

import json
import math

import pytest

from helpers import PROMPTS, alspec_lm, gen_requests, ll_requests, sample_stats

from alspec_eval.adapter import ALSpecLM
from alspec_eval.approx_check.models import save_tiny, tiny_model
from alspec_eval.approx_check.properties import median_ratio
from alspec_eval.config import ConfigError, SpeculationConfig
from alspec_eval.rows import BASELINE, Row
from alspec_eval.schedule import LambdaSchedule

LAYERS = 3


def write(tmp_path, data, name: str = "schedule.json") -> str:
    path = tmp_path / name
    path.write_text(json.dumps(data))
    return str(path)


@pytest.mark.parametrize(("data", "message"), [
    ([0.1, -1, 0.2], r"lambda_schedule .*\[1\]=-1 is not a lambda"),
    ([0.1, "x", 0.2], r"\[1\]='x' is not a lambda"),
    ([], "the list is empty"),
    ({"layers": {"1": 0.2}}, 'expected a list or a mapping with "default"'),
    ({"default": 0.1, "layers": {"one": 0.2}}, "layer 'one' is not a layer index"),
    ({"default": 0.1, "layers": [0.2]}, '"layers" must map layer indices'),
])
def test_bad_schedules_name_the_value(tmp_path, data, message):
    with pytest.raises(ConfigError, match=message):
        SpeculationConfig(lambda_schedule=write(tmp_path, data))


@pytest.mark.slow
def test_schedule_errors_before_the_model_loads(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        SpeculationConfig(lambda_schedule=str(tmp_path / "nope.json"))
    (tmp_path / "bad.json").write_text("[0.1,")
    with pytest.raises(ConfigError, match="not valid JSON"):
        SpeculationConfig(lambda_schedule=str(tmp_path / "bad.json"))
    good = write(tmp_path, [0.1] * LAYERS)
    with pytest.raises(ConfigError, match="lambda=0.2 and lambda_schedule=.* both set the threshold"):
        SpeculationConfig(lam=0.2, lambda_schedule=good)
    with pytest.raises(ConfigError, match="only applies to policy=dynamic"):
        SpeculationConfig(policy="always", lambda_schedule=good)
    model = save_tiny(tmp_path / "model")  # 3 layers; the checks run on its config, before the weights load
    with pytest.raises(ConfigError, match="gives 2 lambdas, but the model has 3 decoder layers"):
        ALSpecLM(pretrained=model, lambda_schedule=write(tmp_path, [0.1, 0.2], "short.json"), device="cpu")
    with pytest.raises(ConfigError, match=r"names layers \[5\], but the model has 3 layers"):
        ALSpecLM(pretrained=model, lambda_schedule=write(tmp_path, {"default": 0.1, "layers": {"5": 1}}, "far.json"),
                 device="cpu")


def test_both_forms_and_what_a_result_records(tmp_path):
    mapping = LambdaSchedule.load(write(tmp_path, {"default": 0.1, "layers": {"2": "inf", "0": 0.3}}))
    assert mapping.lambdas(LAYERS) == [0.3, 0.1, math.inf]
    listed = LambdaSchedule.load(write(tmp_path, [0.3, 0.1, "inf"], "list.json"))
    assert listed.lambdas(LAYERS) == mapping.lambdas(LAYERS) and listed.digest != mapping.digest
    assert LambdaSchedule.from_json(listed.to_json()) == LambdaSchedule(listed.default, listed.layers)
    record = SpeculationConfig(lambda_schedule=listed).to_dict()
    assert record["lambda"] is None
    assert record["lambda_schedule"] == {"schedule": [0.3, 0.1, "inf"], "path": listed.path, "sha256": listed.digest}
    row = Row.tuned(listed)
    record = row.record()
    assert Row.from_record(record["policy"], record["lambda"], schedule=record["lambda_schedule"]) == row


def _run(model, **args):
    lm = alspec_lm(model, batch_size=2, **args)
    gen, ll = gen_requests(), ll_requests()
    return lm.generate_until(gen), sample_stats(gen), lm.loglikelihood(ll), sample_stats(ll), lm.statistics()["tasks"]


@pytest.mark.slow
@pytest.mark.parametrize("kernel", ["model", "torch"])
def test_a_constant_schedule_is_the_scalar_lambda_bit_for_bit(tmp_path, kernel):
    model = tiny_model()
    lam = median_ratio(alspec_lm(model), PROMPTS[0])
    scalar = _run(model, kernel=kernel, **{"lambda": lam})
    schedule = _run(model, kernel=kernel, lambda_schedule=write(tmp_path, [lam] * LAYERS))
    assert schedule == scalar  # generations, loglikelihoods (floats compared exactly) and every statistic
    assert 0 < scalar[4]["gen"]["total"]["accepted"] < scalar[4]["gen"]["total"]["speculated"]


@pytest.mark.slow
def test_lambda_zero_layers_never_accept(tmp_path):
    model = tiny_model()
    *_, tasks = _run(model, lambda_schedule=write(tmp_path, {"default": 0.0, "layers": {"1": "inf"}}))
    for task in ("gen", "ll"):
        layers = tasks[task]["layers"]
        assert layers[0]["accepted"] == layers[2]["accepted"] == 0 < layers[0]["speculated"]
        assert layers[1]["accepted"] == layers[1]["speculated"] > 0


@pytest.mark.slow
def test_a_schedule_row_shares_the_prefill_and_equals_its_own_run(tmp_path):
    model = tiny_model()
    lam = median_ratio(alspec_lm(model), PROMPTS[0])
    schedule = LambdaSchedule.load(write(tmp_path, [lam / 2, 4 * lam, lam]))
    rows = [BASELINE, Row.dynamic(lam), Row.tuned(schedule)]
    lm = alspec_lm(model, batch_size=2)
    shared = {}
    with lm.shared_prefill(rows) as fork:
        for row in rows:
            with lm.answering(row, shared=fork):
                gen, ll = gen_requests(), ll_requests()
                shared[row] = (lm.generate_until(gen), sample_stats(gen), [x for x, _ in lm.loglikelihood(ll)],
                               sample_stats(ll))
    alone = _run(model, lambda_schedule=schedule)
    assert shared[rows[2]][:2] == alone[:2]
    assert shared[rows[2]][2] == pytest.approx([x for x, _ in alone[2]], abs=1e-4) and shared[rows[2]][3] == alone[3]
    assert shared[rows[2]][1] != shared[rows[1]][1]  # the schedule decided otherwise than its middle lambda
