"""The paper's latency model (Appendix F) against its own tables and hand computations; alspec-latency and the
report's latency section."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from alspec_eval.latency import PRESETS, LatencyError, LatencyModel, load_latency, preset
from alspec_eval.latency_cli import main as latency_main
from alspec_eval.report.cli import main as report_main
from alspec_eval.report.latency import project_sweep
from alspec_eval.report.cells import BASELINE, SINK, STATIC, Row, load_sweep

# The paper's own numbers, restated here from docs/paper.md (ns, context 1K).
N150 = {"n150-tp1": (846747, 69853, 2313703), "n150-tp2": (555015, 64309, 1207636),
        "n150-tp4": (387584, 56024, 638529), "n150-tp8": (440451, 50096, 384460)}
H100_TP4 = {"h100-tp4-1k": 244.6, "h100-tp4-32k": 214.2, "h100-tp4-64k": 191.4, "h100-tp4-96k": 178.2,
            "h100-tp4-128k": 169.3}

# 4 layers, microseconds: hit = 10 + max(300 - 10, 100) = 300, miss = 100 + 300 = 400.
TINY = {"name": "tiny", "num_layers": 4, "fixed_us": 50, "per_layer_us": 100, "fd_us": 280, "sfd_s_us": 300,
        "sfd_r_us": 10}


def test_presets_are_the_papers_tables_only():
    assert set(PRESETS) == set(N150) | set(H100_TP4)
    for name, (per_layer, fd, fixed) in N150.items():
        m = PRESETS[name]
        assert (m.per_layer_us, m.fd_us, m.fixed_us) == (per_layer / 1e3, fd / 1e3, fixed / 1e3)
        assert 1e6 / m.full_tp_us() == pytest.approx(1e9 / (fixed + 32 * (per_layer + fd)), rel=1e-12)
        assert m.estimates == ["sfd_s_us", "sfd_r_us"]
        assert all("Table" in m.sources[k] for k in ("fixed_us", "per_layer_us", "fd_us"))
    for name, tp4 in H100_TP4.items():
        m = PRESETS[name]
        assert 1e6 / m.full_tp_us() == pytest.approx(tp4, rel=1e-12) and not m.estimates
        assert "Table 3" in m.sources["per_layer_us"] and not m.round_hits


def test_n150_tp1_at_seven_eighths_by_hand():
    m = preset("n150-tp1")
    sfd_r = 69.853 * 256 / 1024
    hit, miss = sfd_r + max(69.853 - sfd_r, 846.747), 846.747 + 69.853
    assert m.alspec_us(0.875) == pytest.approx(2313.703 + 28 * hit + 4 * miss)


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_floor_ceil_form_equals_per_layer_form_at_whole_layers(name):
    m = PRESETS[name]
    rounded = LatencyModel(**{**m.__dict__, "round_hits": True})
    for k in range(m.num_layers + 1):
        assert rounded.alspec_us(k / m.num_layers) == pytest.approx(
            m.per_layer_alspec_us([1.0] * k + [0.0] * (m.num_layers - k)))


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_zero_hit_rate_is_full_tp_and_latency_falls_with_r(name):
    m = PRESETS[name]
    assert m.alspec_us(0.0) == pytest.approx(m.full_tp_us())
    rates = [i / 64 for i in range(65)]
    latencies = [m.alspec_us(r) for r in rates]
    assert all(b <= a + 1e-9 for a, b in zip(latencies, latencies[1:]))
    assert latencies[-1] < latencies[0]


def test_gpu_projection_uses_r_as_a_fraction():
    m = preset("h100-tp4-128k")  # attention 63, non-attention 101 per layer
    assert m.alspec_us(0.65) == pytest.approx(m.fixed_us + 32 * (0.65 * 101 + 0.35 * (101 + 63)))


def test_cli_json(capsys):
    assert latency_main(["--preset", "h100-tp4-32k", "--hit-rate", "0.65", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["preset"] == "h100-tp4-32k" and out["hit_rate"] == 0.65
    assert out["baseline_tokens_per_s"] == pytest.approx(214.2)
    assert out["speedup"] == pytest.approx(out["tokens_per_s"] / out["baseline_tokens_per_s"])
    assert out["token_latency_us"] == pytest.approx(1e6 / out["tokens_per_s"])


def test_cli_table_names_estimates(capsys):
    assert latency_main(["--preset", "n150-tp1", "--hit-rate", "0.875"]) == 0
    out = capsys.readouterr().out
    assert "ESTIMATES" in out and "sfd_s_us, sfd_r_us" in out and "0.875" in out
    assert latency_main(["--list-presets"]) == 0
    assert "Appendix F, Table 7" in capsys.readouterr().out


@pytest.mark.parametrize("args, needle", [
    (["--preset", "n150-tp", "--hit-rate", "0.5"], "did you mean 'n150-tp"),
    (["--preset", "n150-tp1", "--hit-rate", "1.5"], "hit rate 1.5 is outside [0, 1]"),
    (["--preset", "n150-tp1"], "--hit-rate R"),
    (["--latency", "LAT", "--hit-rate", "0.5"], "lacks sfd_r_us"),
    (["--latency", "NEG", "--hit-rate", "0.5"], "fd_us=-1"),
])
def test_cli_bad_input_is_one_line(tmp_path, capsys, args, needle):
    (tmp_path / "lat.json").write_text(json.dumps({k: v for k, v in TINY.items() if k != "sfd_r_us"}))
    (tmp_path / "neg.json").write_text(json.dumps({**TINY, "fd_us": -1}))
    args = [str(tmp_path / "lat.json") if a == "LAT" else str(tmp_path / "neg.json") if a == "NEG" else a for a in args]
    assert latency_main(args) == 2
    err = capsys.readouterr().err
    assert needle in err and err.count("\n") == 1


def test_cli_from_sweep(sweep_dir: Path, tmp_path: Path, capsys):
    (tmp_path / "tiny.json").write_text(json.dumps(TINY))
    assert latency_main(["--latency", str(tmp_path / "tiny.json"), "--from", str(sweep_dir), "--json"]) == 0
    cells = {(c["task"], c["cell"]): c for c in json.loads(capsys.readouterr().out)["cells"]}
    # lambda 0.1, per-layer hits 0.2, 0.4, 0.48, 0.6 (sum 1.68): 50 + 1.68 x 300 + 2.32 x 400
    assert cells[("alspec_gsm8k_cot", "λ = 0.1")]["token_latency_us"] == pytest.approx(50 + 1.68 * 300 + 2.32 * 400)
    assert cells[("alspec_gsm8k_cot", "baseline")]["token_latency_us"] == pytest.approx(50 + 4 * 380)


def test_report_projection_by_hand(sweep_dir: Path) -> None:
    p = project_sweep(load_sweep(sweep_dir), LatencyModel.from_mapping(TINY, "tiny"))
    gsm = "alspec_gsm8k_cot"
    assert not p.averaged
    assert p.entries[(BASELINE, gsm)].token_latency_us == pytest.approx(50 + 4 * 380)
    e = p.entries[(Row.dynamic(0.1), gsm)]
    assert e.token_latency_us == pytest.approx(50 + 1.68 * 300 + 2.32 * 400)
    assert e.speedup == pytest.approx((50 + 4 * 380) / (50 + 1.68 * 300 + 2.32 * 400))
    assert p.entries[(SINK, gsm)].token_latency_us == pytest.approx(50 + 4 * 300)
    assert p.entries[(STATIC, gsm)].token_latency_us == pytest.approx(50 + 2 * 300 + 2 * 400)


def test_report_averages_when_layer_counts_differ(sweep_dir: Path) -> None:
    p = project_sweep(load_sweep(sweep_dir), LatencyModel.from_mapping({**TINY, "num_layers": 8}, "tiny8"))
    assert p.averaged
    # mean per-layer hit 0.42 on all 8 layers
    assert p.entries[(Row.dynamic(0.1), "alspec_gsm8k_cot")].token_latency_us == pytest.approx(50 + 8 * (0.42 * 300 + 0.58 * 400))


def test_report_cli_with_latency_file_and_presets(sweep_dir: Path, tmp_path: Path, capsys) -> None:
    lat = tmp_path / "my.yaml"
    lat.write_text("\n".join(f"{k}: {v}" for k, v in TINY.items()) + "\n")
    assert report_main([str(sweep_dir), "--latency", str(lat)]) == 0
    md = (sweep_dir / "report" / "latency.md").read_text()
    assert "**tiny**" in md and "h100" not in md
    assert f"{1e6 / (50 + 1.68 * 300 + 2.32 * 400):.1f} tok/s" in md
    assert (sweep_dir / "report" / "speedup_vs_score.png").stat().st_size > 0
    assert report_main([str(sweep_dir), "--preset", "n150-tp1", "--preset", "h100-tp4-128k"]) == 0
    md = (sweep_dir / "report" / "latency.md").read_text()
    assert "**n150-tp1**" in md and "**h100-tp4-128k**" in md and "ESTIMATES" in md
    capsys.readouterr()
    assert report_main([str(sweep_dir), "--preset", "nope"]) == 2
    assert "unknown preset 'nope'" in capsys.readouterr().err


def test_user_table_validation(tmp_path: Path) -> None:
    path = tmp_path / "t.yaml"
    path.write_text("num_layers: 2\nfixed_us: 1\nper_layer_us: 2\nfd_us: 3\nsfd_s_us: 3\nsfd_r_us: 1\n")
    assert load_latency(path).full_tp_us() == 1 + 2 * 5
    with pytest.raises(LatencyError, match="unknown field"):
        LatencyModel.from_mapping({**TINY, "speculative_us": 1}, "x")
    with pytest.raises(LatencyError, match="num_layers"):
        LatencyModel.from_mapping({**TINY, "num_layers": 0}, "x")
    assert math.isclose(LatencyModel.from_mapping(TINY, "x").hit_us, 300)
