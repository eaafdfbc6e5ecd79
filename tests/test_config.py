"""Bad model_args stop with one message that names the value and the fix, before any model loads."""

from __future__ import annotations

import math

import pytest
from transformers import LlamaForCausalLM

from alspec_eval.config import ConfigError, SpeculationConfig, parse_layers
from helpers import alspec_lm
from tiny import tiny_model

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
]


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
    assert config.to_dict()["lambda"] == "inf"
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
