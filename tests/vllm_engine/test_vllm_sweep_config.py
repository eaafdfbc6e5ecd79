"""A sweep on the vLLM engine, as configs and command lines give it: one engine per sweep, refused in one line where
it mixes engines or asks vLLM for what only hf has, and cells whose fingerprints name the engine (an hf cell's
fingerprint is what it was, so existing sweeps resume). Fast: nothing loads."""

from __future__ import annotations

import pytest

from alspec_eval.errors import ConfigError
from alspec_eval.rows import Row
from alspec_eval.sweep.config import fingerprint, parse_config

BASE = {"name": "s", "tasks": ["alspec_recall"], "lambdas": [0.1]}


@pytest.mark.parametrize("given", [{"engine": "vllm"}, {"model": "alspec-vllm"},
                                   {"model": "alspec-vllm", "engine": "vllm"},
                                   {"engine": "vllm", "approx": ["sink", "local", "quest", "topk", "snapkv"]}])
def test_a_vllm_sweep(given):
    assert parse_config({**BASE, **given}).engine == "vllm"


def test_hf_stays_the_default_and_its_fingerprints_do_not_change():
    hf = parse_config(dict(BASE))
    assert hf.engine == "hf" and "engine" not in fingerprint(hf, "alspec_recall", Row.dynamic(0.1))
    vllm = parse_config({**BASE, "engine": "vllm"})
    assert fingerprint(vllm, "alspec_recall", Row.dynamic(0.1))["engine"] == "vllm"


@pytest.mark.parametrize("given, named", [
    ({"model": "alspec", "engine": "vllm"}, "two engines"),
    ({"model": "alspec-vllm", "engine": "hf"}, "two engines"),
    ({"engine": "sglang"}, "engine='sglang'"),
    ({"model": "vllm"}, "model='vllm'"),
    ({"engine": "vllm", "gammas": [2]}, "gammas"),
    ({"engine": "vllm", "model_args": {"kernel": "triton"}}, "kernel=triton"),
    ({"engine": "vllm", "device": "cuda"}, "device"),
    ({"engine": "vllm", "batch_size": 4}, "batch_size"),
    ({"engine": "vllm", "approx": ["sink", "kvpress:CapPress"]}, "approx=kvpress:CapPress cannot run in vLLM"),
])
def test_refused_in_one_line(given, named):
    with pytest.raises(ConfigError) as err:
        parse_config({**BASE, **given})
    assert named in str(err.value) and "\n" not in str(err.value)


def test_the_command_line_chooses_the_engine(tmp_path, monkeypatch):
    from alspec_eval.sweep import cli

    config = tmp_path / "s.yaml"
    config.write_text("name: s\ntasks: [alspec_recall]\nlambdas: [0.1]\nengine: vllm\n")
    seen = {}
    monkeypatch.setattr("alspec_eval.sweep.runner.run_sweep", lambda c, recompute: seen.setdefault("c", c).output_dir)
    cli.main([str(config), "--model", "alspec", "--output_path", str(tmp_path / "out"), "--no-report"])
    assert seen["c"].engine == "hf"
    seen.clear()
    cli.main([str(config), "--output_path", str(tmp_path / "out"), "--no-report"])
    assert seen["c"].engine == "vllm"
