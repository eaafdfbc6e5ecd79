"""The Appendix F projection against hand computations, and the alspec-report command line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from alspec_eval.report.cli import main
from alspec_eval.report.latency import LatencyError, LatencySpec, load_latency, project
from alspec_eval.report.load import BASELINE, SINK, STATIC, Row, load_sweep
from alspec_eval.report.presets import PRESETS

# 4 layers: non-attention 100 µs, exact attention 300 µs, speculative 10 µs, 5 µs per miss. Attention
# outlasts speculative + non-attention, so a model that only overlaps the two would give other numbers.
TINY = {"name": "tiny", "num_layers": 4, "non_attention_us": 100, "attention_us": 300, "speculative_us": 10,
        "miss_overhead_us": 5}


def test_projection_by_hand(sweep_dir: Path) -> None:
    p = project(load_sweep(sweep_dir), LatencySpec.from_mapping(TINY, "tiny"))
    gsm = "alspec_gsm8k_cot"
    assert not p.averaged
    # baseline: 4 x (300 + 100) = 1600 µs
    assert p.entries[(BASELINE, gsm)].token_us == pytest.approx(1600)
    assert p.entries[(BASELINE, gsm)].tokens_per_s == pytest.approx(1e6 / 1600)
    # lambda 0.1, per-layer hits 0.2, 0.4, 0.48, 0.6 (sum 1.68): 1.68 x 110 + 2.32 x 405 = 1124.4 µs
    e = p.entries[(Row(1, 0.1), gsm)]
    assert e.token_us == pytest.approx(1124.4)
    assert e.speedup == pytest.approx(1600 / 1124.4)
    # sink: every layer 10 + 100; static: layers 2, 3 approximated, 0, 1 exact without miss overhead
    assert p.entries[(SINK, gsm)].token_us == pytest.approx(440)
    assert p.entries[(STATIC, gsm)].token_us == pytest.approx(2 * 110 + 2 * 400)


def test_projection_averages_when_layer_counts_differ(sweep_dir: Path) -> None:
    spec = LatencySpec.from_mapping({**TINY, "num_layers": 8}, "tiny8")
    p = project(load_sweep(sweep_dir), spec)
    assert p.averaged
    # mean per-layer hit 0.42 on all 8 layers: 8 x (0.42 x 110 + 0.58 x 405) = 2248.8 µs
    assert p.entries[(Row(1, 0.1), "alspec_gsm8k_cot")].token_us == pytest.approx(2248.8)
    assert p.entries[(BASELINE, "alspec_gsm8k_cot")].token_us == pytest.approx(3200)


def test_per_layer_lists_and_bad_specs(tmp_path: Path) -> None:
    path = tmp_path / "lat.json"
    path.write_text(json.dumps({"non_attention_us": [1, 2, 3], "attention_us": 4, "speculative_us": [0, 0, 1]}))
    spec = load_latency(path)
    assert spec.name == "lat" and spec.attention_us == (4.0, 4.0, 4.0) and spec.baseline_us == 18
    with pytest.raises(LatencyError, match="num_layers"):
        LatencySpec.from_mapping({"non_attention_us": 1, "attention_us": 1, "speculative_us": 1}, "x")
    with pytest.raises(LatencyError, match="list of 3"):
        LatencySpec.from_mapping({"non_attention_us": [1, 2, 3], "attention_us": [1], "speculative_us": 1}, "x")


def test_presets_are_labelled_illustrative() -> None:
    assert PRESETS and all("not the paper" in s.description for s in PRESETS.values())


def test_cli_with_latency_yaml(sweep_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    lat = tmp_path / "my.yaml"
    lat.write_text("\n".join(f"{k}: {v}" for k, v in TINY.items()) + "\n")
    assert main([str(sweep_dir), "--latency", str(lat)]) == 0
    md = (sweep_dir / "report" / "latency.md").read_text()
    assert "**tiny**" in md and "example-llama8b" not in md
    assert "889.4 tok/s (1.42×)" in md  # 1e6 / 1124.4 µs, 1600 / 1124.4
    assert "report.html" in capsys.readouterr().out


def test_cli_with_preset(sweep_dir: Path) -> None:
    name = next(iter(PRESETS))
    assert main([str(sweep_dir), "--preset", name]) == 0
    assert f"**{name}**" in (sweep_dir / "report" / "latency.md").read_text()


@pytest.mark.parametrize("args, needle", [(["--preset", "nope"], "unknown preset 'nope'"),
                                          (["--latency", "missing.yaml"], "cannot read latency file")])
def test_cli_bad_latency(sweep_dir: Path, capsys: pytest.CaptureFixture[str], args: list[str], needle: str) -> None:
    assert main([str(sweep_dir), *args]) == 2
    err = capsys.readouterr().err
    assert needle in err and err.count("\n") == 1


def test_cli_empty_folder(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main([str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and str(tmp_path) in err and "run a lambda sweep" in err
    assert not (tmp_path / "report").exists()
