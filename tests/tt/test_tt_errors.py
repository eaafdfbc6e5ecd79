"""backend=tt stops before the model loads when ttnn or the device is missing, with a message that says why."""

from __future__ import annotations

import sys

import pytest

from alspec_eval.adapter import ALSpecLM
from alspec_eval.config import ConfigError, SpeculationConfig, TTSettings


def _fail_if_loaded(*_: object, **__: object) -> None:
    raise AssertionError("the model was loaded before the environment was checked")


def test_missing_ttnn_says_how_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "ttnn", None)  # makes `import ttnn` raise ImportError
    monkeypatch.setattr("lm_eval.models.huggingface.HFLM.__init__", _fail_if_loaded)
    with pytest.raises(ConfigError, match=r"backend=tt.*pip install ttnn.*3\.12"):
        ALSpecLM(pretrained="unused", backend="tt")


def test_no_device_stops_before_the_model_loads(monkeypatch):
    ttnn = pytest.importorskip("ttnn", reason="ttnn is not importable here (Python 3.12 env: scripts/tt_env.sh)")
    try:
        if ttnn.GetNumAvailableDevices() > 0:
            pytest.skip("a Tenstorrent device is present")
    except RuntimeError:
        pass  # ttnn's own "No chips detected"
    monkeypatch.setattr("lm_eval.models.huggingface.HFLM.__init__", _fail_if_loaded)
    with pytest.raises(ConfigError, match="no Tenstorrent device.*tt_mode=host"):
        ALSpecLM(pretrained="unused", backend="tt", tt_device_id=0)


def test_tt_config():
    assert SpeculationConfig(backend="tt", window=64).window_align == 32  # the TT op's window definition
    assert SpeculationConfig().tt.kv_dtype == "bfloat8_b"
    with pytest.raises(ConfigError, match="window=48"):
        SpeculationConfig(backend="tt", window=48)
    for bad, match in [({"tt_mode": "card"}, "tt_mode='card'"), ({"tt_kv_dtype": "float32"}, "tt_kv_dtype='float32'"),
                       ({"tt_device_id": -1}, "tt_device_id=-1")]:
        with pytest.raises(ConfigError, match=match):
            SpeculationConfig.from_model_args({"backend": "tt", "window": 32, **bad})
    config, rest = SpeculationConfig.from_model_args({"backend": "tt", "window": 32, "tt_mode": "host",
                                                      "tt_kv_dtype": "bfloat16", "tt_device_id": 1})
    assert (config.tt, rest) == (TTSettings(mode="host", kv_dtype="bfloat16", device_id=1), {})
    assert {k: config.to_dict()[k] for k in ("tt_mode", "tt_kv_dtype", "tt_device_id")} == {
        "tt_mode": "host", "tt_kv_dtype": "bfloat16", "tt_device_id": 1}  # recorded under the model_args names


@pytest.mark.parametrize("installed, mode, match", [
    (None, "host",
     r"tt_kernel=ttlang needs TT-Lang.*not installed.*tt-lang.*tt_mode=device.*pip install tt-lang-sim.*tt_mode=host"),
    ("tt-lang", "host", r"tt_mode=host runs the kernel on the simulator.*installed TT-Lang is the compiler"),
    ("tt-lang-sim", "device", r"tt_mode=device needs the TT-Lang compiler.*only the simulator.*use tt_mode=host"),
])
def test_ttlang_kernel_missing_stops_before_the_model_loads(monkeypatch, installed, mode, match):
    monkeypatch.setattr("alspec_eval.kernels.ttlang.decode.flavour", lambda: installed)
    monkeypatch.setattr("lm_eval.models.huggingface.HFLM.__init__", _fail_if_loaded)
    with pytest.raises(ConfigError, match=match):
        ALSpecLM(pretrained="unused", backend="tt", tt_kernel="ttlang", tt_mode=mode, window=32)


def test_tt_kernel_config():
    assert SpeculationConfig().tt.kernel == "ttnn"
    with pytest.raises(ConfigError, match="tt_kernel='triton'.*ttnn.*ttlang"):
        SpeculationConfig.from_model_args({"backend": "tt", "window": 32, "tt_kernel": "triton"})
    config, rest = SpeculationConfig.from_model_args({"backend": "tt", "window": 32, "tt_kernel": "ttlang"})
    assert (config.tt.kernel, rest) == ("ttlang", {})
