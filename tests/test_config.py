"""Bad model_args stop with one message that names the value and the fix, before any model loads."""

from __future__ import annotations

import math

import pytest
from transformers import LlamaForCausalLM

from alspec_eval.approx_check.models import tiny_model
from alspec_eval.config import ConfigError, SpeculationConfig, parse_layers
from helpers import alspec_lm

BAD = [
    ({"lambda": -0.1}, "lambda=-0.1"),
    ({"lambda": float("nan")}, "lambda=nan"),
    ({"lambda": "abc"}, "lambda='abc'"),
    ({"window": 0}, "window=0"),
    ({"policy": "greedy"}, "policy='greedy'"),
    ({"backend": "cuda"}, "backend='cuda'"),
    ({"policy": "static"}, "static_layers="),
    ({"static_layers": "1;2"}, "only applies to policy=static"),
    ({"policy": "static", "static_layers": "1;x"}, "'x'"),
    ({"window_align": 16}, "window_align=16"),
    ({"window_align": 32, "window": 48}, "window=48"),
    ({"kernel": "cuda"}, "kernel='cuda'"),
    ({"trace_tokens": "maybe"}, "trace_tokens='maybe'"),
    ({"lamda": 0.1}, "did you mean 'lambda'"),
    ({"windows": 64}, "did you mean 'window'"),
    ({"polciy": "sink"}, "did you mean 'policy'"),
    ({"approx": "snapkvv"}, "approx='snapkvv'"),
    ({"approx": "no.such.module:Class"}, "cannot load no.such.module:Class"),
    ({"approx": "alspec_eval.config:SpeculationConfig"}, "is not a subclass of alspec_eval.Approximation"),
    ({"approx_args": "page:16"}, "sink has no parameter 'page'"),
    ({"approx": "quest", "approx_args": "page:0"}, "page:0"),
    ({"approx": "quest", "approx_args": "page:x"}, "page='x'"),
    ({"approx": "quest", "approx_args": "page"}, "'page' is not key:value"),
    ({"approx": "quest", "approx_args": "pag:4"}, "quest has no parameter 'pag'; its parameters: page (default 16)"),
    ({"approx": "quest", "window": 8, "approx_args": "page:16"}, "page:16"),  # one past the window: use e.g. page:8
    ({"approx": "quest", "window": 12, "approx_args": "page:5"}, "page:5"),  # does not divide 2S
    ({"approx": "quest", "backend": "tt", "window": 128}, "backend=sim only"),
    ({"approx": "topk", "kernel": "triton"}, "kernel=triton"),
    ({"approx": "topk", "kernel": "torch"}, "kernel=torch"),
    ({"approx": "topk", "window_align": 32}, "window_align=32"),
]


def test_page_at_exactly_the_window_is_accepted_and_the_default_is_quests():
    quest = SpeculationConfig(approx="quest", window=8, approx_args="page:8").approx  # page 0 and the current: 2S
    assert (quest.name, quest.page) == ("quest", 8)
    assert SpeculationConfig(approx="quest", window=8, approx_args={"page": "4"}).approx.page == 4
    assert SpeculationConfig(approx="quest").approx.page == 16 and SpeculationConfig().approx.args() == {}
    with pytest.raises(ConfigError, match="use e.g. page:8"):
        SpeculationConfig(approx="quest", window=8, approx_args="page:9")
    config = SpeculationConfig(approx="topk", lam=0.2)
    assert config.to_dict()["approx"] == "topk" and config.sink_draft().approx.name == "topk"
    assert SpeculationConfig(approx="quest", approx_args="page:8").to_dict()["approx_args"] == {"page": 8}


def test_policy_sink_is_the_old_name_of_always():
    """"sink" names the approximation; the policy that accepts A~ always is "always", read under its old name too."""
    old, new = SpeculationConfig(policy="sink", approx="quest"), SpeculationConfig(policy="always", approx="quest")
    assert old == new and old.policy == "always" and old.to_dict()["policy"] == "always"
    from_args, _ = SpeculationConfig.from_model_args({"policy": "sink", "window": 8})
    assert from_args.thresholds(2) == [math.inf, math.inf] and from_args.recorded_lambda == "inf"
    draft = SpeculationConfig(policy="selfspec", gamma=2, window=8).sink_draft()  # self-speculation drafts with it
    assert (draft.policy, draft.gamma, draft.thresholds(2)) == ("always", None, [math.inf, math.inf])
    with pytest.raises(ConfigError, match="use one of dynamic, always, static, exact, selfspec"):
        SpeculationConfig(policy="sinks")


@pytest.mark.parametrize(("args", "named"), BAD)
def test_bad_args_name_the_value(args, named):
    with pytest.raises(ConfigError) as err:
        SpeculationConfig.from_model_args(args, {"pretrained"})
    assert named in str(err.value)


def test_good_args_parse():
    config, rest = SpeculationConfig.from_model_args(
        {"lambda": "inf", "window": 64, "policy": "static", "static_layers": "0;3-5", "pretrained": "x",
         "trace_tokens": "true"}, {"pretrained"})
    assert math.isinf(config.lam) and config.window == 64 and config.static_layers == (0, 3, 4, 5)
    assert config.trace_tokens is True and rest == {"pretrained": "x"}
    assert config.to_dict()["lambda"] is None  # static decides per layer, not by lambda: nothing to record
    assert SpeculationConfig(lam=math.inf).to_dict()["lambda"] == "inf"
    assert SpeculationConfig(kernel="sdpa").kernel == "model"  # the older name of "no fused kernel"


def test_parse_layers():
    assert parse_layers("7-9;0 3+3") == (0, 3, 7, 8, 9)
    with pytest.raises(ConfigError, match="reversed"):
        parse_layers("5-2")


@pytest.mark.slow
def test_layer_out_of_range_is_caught():
    with pytest.raises(ConfigError, match=r"static_layers contains \[3\], but the model has 3 layers"):
        alspec_lm(tiny_model(layers=3), policy="static", static_layers="0;3")


@pytest.mark.slow
def test_tt_backend_is_not_silently_simulated():
    with pytest.raises(ConfigError, match="backend=tt"):
        alspec_lm(tiny_model(), backend="tt")


class Unhookable(LlamaForCausalLM):
    """Stands for a model whose attention does not dispatch through AttentionInterface."""

    _supports_attention_backend = False


@pytest.mark.slow
def test_model_that_cannot_be_hooked():
    with pytest.raises(ConfigError, match="AttentionInterface"):
        alspec_lm(Unhookable(tiny_model().config))


@pytest.mark.parametrize(("key", "meant"), [("foo", None), ("batchsize", "batch_size"), ("dtpye", "dtype")])
def test_a_key_nobody_takes_is_one_line(key, meant):
    from alspec_eval.adapter import _HFLM_ARGS
    from alspec_eval.config import unknown_model_arg

    line = unknown_model_arg(key, 1, "LlamaForCausalLM", _HFLM_ARGS)
    assert "\n" not in line and f"{key}=1" in line and "LlamaForCausalLM does not take" in line
    assert "lambda, lambda_schedule, policy" in line and "from_pretrained" in line
    assert (f"did you mean {meant!r}" in line) if meant else "did you mean" not in line


@pytest.mark.slow
@pytest.mark.parametrize("key", ["foo", "batchsize"])
def test_a_key_nobody_takes_stops_before_the_weights_load(tmp_path, monkeypatch, key):
    from transformers import PreTrainedModel

    from alspec_eval.adapter import ALSpecLM
    from alspec_eval.approx_check.models import save_tiny

    path = save_tiny(tmp_path)

    def loaded(*_, **__):
        raise AssertionError("the weights loaded before the bad model_arg was refused")

    monkeypatch.setattr(PreTrainedModel, "_load_pretrained_model", loaded)
    with pytest.raises(ConfigError, match=rf"unknown model_arg {key}=1: .*does not take '{key}'"):
        ALSpecLM(pretrained=path, device="cpu", **{key: 1})
