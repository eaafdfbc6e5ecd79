"""What --model alspec-vllm refuses, in one line naming the value and the fix, before any engine starts: arguments of
hf's own paths, drafts that cannot read a paged cache, models whose attention is not ALSpec's, engine settings whose
cache it cannot read, and vLLM missing (the main venv has none). Fast: no engine starts."""

from __future__ import annotations

import importlib.util

import pytest
import transformers

from alspec_eval.config import SpeculationConfig
from alspec_eval.errors import ConfigError
from alspec_eval.vllm import checks
from alspec_eval.vllm.checks import check_data_parallel, check_engine_args, check_model_config, check_speculation


def refused(call, *args) -> str:
    with pytest.raises(ConfigError) as err:
        call(*args)
    message = str(err.value)
    assert "\n" not in message
    return message


@pytest.mark.parametrize("args, named", [
    ({"backend": "tt"}, "backend=tt"), ({"kernel": "triton"}, "kernel=triton"), ({"tt_mode": "host"}, "tt_mode"),
    ({"policy": "selfspec", "gamma": 2}, "gamma=2"), ({"policy": "selfspec"}, "policy=selfspec"),
    ({"approx": "kvpress:CriticalKVPress"}, "approx=kvpress:CriticalKVPress cannot run in vLLM"),
    ({"approx": "kvpress:SnapKVPress"}, "approx=kvpress:SnapKVPress cannot run in vLLM"),
])
def test_arguments_this_engine_does_not_take(args, named):
    config, _ = SpeculationConfig.from_model_args(dict(args))
    assert named in refused(check_speculation, args, config)


@pytest.mark.parametrize("args", [{}, {"approx": "local"}, {"approx": "quest"}, {"approx": "topk"}, {"approx": "snapkv"},
                                  {"approx": "kvpress:KnormPress"}, {"policy": "sink"}, {"policy": "exact"},
                                  {"policy": "static", "static_layers": "0;2"}, {"window_align": 32, "window": 64}])
def test_what_it_takes(args):
    config, _ = SpeculationConfig.from_model_args(dict(args))
    check_speculation(args, config)
    assert len(config.thresholds(3)) == 3 and not any(t == -0.5 for t in config.thresholds(3))


@pytest.mark.parametrize("config, named", [
    (transformers.MistralConfig(sliding_window=4096), "sliding-window"),
    (transformers.Qwen2Config(use_sliding_window=True, sliding_window=128), "sliding-window"),
    (transformers.LlamaConfig(layer_types=["sliding_attention", "full_attention"], num_hidden_layers=2), "sliding"),
    (transformers.Gemma2Config(sliding_window=None, layer_types=["full_attention"] * 26), "soft-caps"),
    (transformers.BloomConfig(), "ALiBi"),
    (transformers.FalconConfig(alibi=True), "ALiBi"),
    (transformers.PretrainedConfig(model_type="gpt_oss"), "attention sinks"),
])
def test_models_whose_attention_is_not_alspecs(config, named):
    assert named in refused(check_model_config, config)


@pytest.mark.parametrize("config", [transformers.LlamaConfig(), transformers.Qwen2Config(use_sliding_window=False),
                                    transformers.MistralConfig(sliding_window=None)])
def test_models_it_runs(config):
    check_model_config(config)


@pytest.mark.parametrize("args, named", [
    ({"kv_cache_dtype": "fp8_e4m3"}, "kv_cache_dtype=fp8_e4m3"),
    ({"attention_backend": "FLASHINFER"}, "attention_backend=FLASHINFER"),
    ({"worker_extension_cls": "my.Ext"}, "worker_extension_cls"),
    ({"pipeline_parallel_size": 2}, "pipeline_parallel_size=2"),
    ({"decode_context_parallel_size": 2}, "decode_context_parallel_size=2"),
    ({"prefill_context_parallel_size": "4"}, "prefill_context_parallel_size=4"),
    ({"speculative_config": {"method": "ngram", "num_speculative_tokens": 2}}, "speculative_config"),
])
def test_engine_settings_it_cannot_run_with(args, named):
    assert named in refused(check_engine_args, args)


def test_engine_settings_it_runs_with():
    from alspec_eval.vllm.paged import BACKENDS

    for backend in BACKENDS:  # every backend it wraps may be named, in any case
        check_engine_args({"tensor_parallel_size": 2, "attention_backend": backend.lower(), "kv_cache_dtype": "auto",
                           "data_parallel_size": 1, "pipeline_parallel_size": 1, "decode_context_parallel_size": 1,
                           "prefill_context_parallel_size": None, "speculative_config": None})


@pytest.mark.parametrize("key", ["pipeline_parallel_size", "decode_context_parallel_size",
                                 "prefill_context_parallel_size"])
def test_settings_that_split_layers_or_caches_name_tensor_parallel(key):
    assert "tensor_parallel_size" in refused(check_engine_args, {key: 2})


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vLLM is installed here")
def test_vllm_missing_names_the_extra():
    message = refused(importlib.import_module, "alspec_eval.vllm.model")
    assert "pip install 'alspec-eval[vllm]'" in message


def test_the_layout_table_refuses_what_it_cannot_read():
    from alspec_eval.vllm.paged import LayoutError, layout_for

    for backend, isa in [("CPU_ATTN", "amx"), ("CPU_ATTN", "neon"), ("FLASHINFER", None)]:
        with pytest.raises(LayoutError, match=backend):
            layout_for(backend, isa)
    assert layout_for("CPU_ATTN", "vec").name == "cpu-vec" and layout_for("TRITON_ATTN").name == "plain"


@pytest.mark.slow  # importing vLLM's CPU attention starts a process (its CPU probe)
@pytest.mark.parametrize("config, args, refused", [
    (transformers.LlamaConfig(hidden_size=512, num_attention_heads=8), {"dtype": "float32"}, False),
    (transformers.LlamaConfig(hidden_size=512, num_attention_heads=8), {"dtype": "float32", "block_size": 16}, True),
    (transformers.LlamaConfig(hidden_size=640, num_attention_heads=8), {"dtype": "float32"}, True),  # head 80: vec16
])
def test_a_cpu_cache_layout_it_cannot_read_is_refused_before_the_engine_starts(config, args, refused):
    pytest.importorskip("vllm")
    import torch

    from alspec_eval.vllm.checks import check_cpu_cache
    from alspec_eval.vllm.paged import LayoutError

    if torch.cuda.is_available():
        pytest.skip("the CPU's attention backend only")
    if refused:
        with pytest.raises(LayoutError, match="CPU_ATTN with isa vec16"):
            check_cpu_cache(config, args)
    else:
        check_cpu_cache(config, args)


@pytest.fixture
def machine(monkeypatch):
    """A CPU-only machine with Ray installed and ``cores`` cores (set by the test)."""
    import torch

    state = {"cores": 4, "ray": True}
    real = importlib.util.find_spec
    monkeypatch.setattr(checks.importlib.util, "find_spec",
                        lambda name, *a: (object() if state["ray"] else None) if name == "ray" else real(name, *a))
    monkeypatch.setattr(checks.os, "sched_getaffinity", lambda pid: set(range(state["cores"])))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    return state


def test_data_parallel_without_ray_names_the_package(machine):
    machine["ray"] = False
    assert "pip install ray" in refused(check_data_parallel, {"data_parallel_size": 2})
    check_data_parallel({"data_parallel_size": 1})  # one replica is one engine: no Ray


def test_data_parallel_at_the_machine_s_cores_and_one_past(machine):
    check_data_parallel({"data_parallel_size": 4})
    check_data_parallel({"data_parallel_size": 2, "tensor_parallel_size": 2})
    message = refused(check_data_parallel, {"data_parallel_size": 5})
    assert "data_parallel_size=5" in message and "has 4" in message and "to 4" in message
    message = refused(check_data_parallel, {"data_parallel_size": 3, "tensor_parallel_size": 2})
    assert "needs 6" in message and "to 2" in message
