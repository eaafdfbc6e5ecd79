"""backend=tt against a card that enforces the authors' op contract (tests/tt/fake_card.py): tt_mode=device end to
end on a tiny model decides and generates as sim (window_align=32, bfloat16), sends the op only what it can take,
keeps the KV cache on the device, and mutations of the call fail."""

from __future__ import annotations

import dataclasses

import pytest
import torch

ttnn = pytest.importorskip("ttnn", reason="ttnn is not importable here; it needs Python 3.10/3.12: scripts/tt_env.sh")

import fake_card  # noqa: E402
from helpers import PROMPTS, alspec_lm, gen_requests, sample_stats  # noqa: E402
from tiny import tiny_model  # noqa: E402

from alspec_eval.backends.tt import contract, runtime as tt_runtime  # noqa: E402
from alspec_eval.config import ConfigError, SpeculationConfig  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore")
WINDOW = 32
# Prompts of 5 to 240 characters: in one batch some rows are past 2S = 64 while others are not (mixed steps).
PROMPTS_MIXED = [PROMPTS[0] * 3, PROMPTS[3], PROMPTS[1] * 2, PROMPTS[2]]


@pytest.fixture(scope="module")
def model():
    return tiny_model().to(torch.bfloat16)


@pytest.fixture
def card(monkeypatch):
    return fake_card.install(monkeypatch, ttnn)


def _decisions(requests) -> list[tuple[int, int]]:
    return [(s["speculated"], s["accepted"]) for s in sample_stats(requests)]


def _gap_lambda(model) -> float:
    """A lambda in the widest gap between measured ratios near the median (sim, window_align=32), so no decision
    sits within the op's bfloat16 rounding of the squared norms."""
    from alspec_eval.region import DecodeRegion
    from helpers import TOKENIZER

    lm = alspec_lm(model, window=WINDOW, window_align=32, **{"lambda": 0.0})
    ids = torch.tensor([TOKENIZER(PROMPTS[0] * 3)["input_ids"]])
    with torch.no_grad(), lm.speculator.speculating(DecodeRegion.build([0], [0])) as trace:
        lm.model(ids)
    ratios = trace.ratios[~torch.isnan(trace.ratios)].sort().values
    middle = ratios[len(ratios) // 4: 3 * len(ratios) // 4]
    gaps = middle[1:] / middle[:-1]
    i = int(gaps.argmax())
    assert gaps[i] > 1.01, "no gap wider than the bfloat16 rounding near the median"
    return float((middle[i] * middle[i + 1]).sqrt())


def _run(model, lam: float, window: int = WINDOW, prompts: list[str] = PROMPTS_MIXED, **args):
    lm = alspec_lm(model, batch_size=4, window=window, **args, **{"lambda": lam})
    requests = gen_requests(prompts)
    outputs = lm.generate_until(requests)
    layers = [(e["speculated"], e["accepted"], e["trivial"]) for e in lm.statistics()["tasks"]["gen"]["layers"]]
    return outputs, _decisions(requests), layers


def test_device_path_equals_sim(model, card):
    lam = _gap_lambda(model)
    sim = _run(model, lam, window_align=32)
    tt = _run(model, lam, backend="tt", tt_mode="device", tt_kv_dtype="bfloat16")
    assert tt == sim
    assert 0 < sum(a for _, a in sim[1]) < sum(s for s, _ in sim[1])
    kinds = [kind for kind, _ in card.calls]
    assert {"speculative", "decode", "update"} <= set(kinds)
    for kind, call in card.calls:
        if kind == "speculative":
            assert call["program_config"].k_chunk_size == WINDOW
            assert call["cache_length"] % WINDOW == 0
            assert min(call["cur_pos"]) + 1 > 2 * WINDOW
            assert "speculative_chunk_size" not in call


def test_kv_cache_stays_on_the_device(model, card, monkeypatch):
    """Each layer's cache is uploaded once per request; later steps append one token through paged_update_cache."""
    uploads = []
    real = ttnn.from_torch
    monkeypatch.setattr(ttnn, "from_torch", lambda t, **kw: uploads.append(tuple(t.shape)) or real(t, **kw))
    lm = alspec_lm(model, batch_size=4, window=WINDOW, backend="tt", tt_mode="device", tt_kv_dtype="bfloat16")
    lm.generate_until(gen_requests([PROMPTS[0] * 3] * 4))
    layers = lm.speculator.num_layers
    cache_uploads = [s for s in uploads if len(s) == 4 and s[1] == 2 and s[2] >= 2 * WINDOW]
    assert len(cache_uploads) == 2 * layers  # K and V of each layer, once for the request
    updates = [c for kind, c in card.calls if kind == "update"]
    assert len(updates) > 2 * layers and all(len(c["update_idxs"]) == 4 for c in updates)


def test_old_keyword_fails(model, card, monkeypatch):
    real = tt_runtime.TTRuntime.speculative

    def old_binding(self, q, k, v, **kwargs):
        kwargs = dict(lambda_=kwargs["lam"], speculative_chunk_size=self.config.window, cur_pos=kwargs["cur_pos"],
                      scale=kwargs["scale"])
        return getattr(self.ttnn.experimental, contract.OP_NAME)(q, k, v, **kwargs)

    monkeypatch.setattr(tt_runtime.TTRuntime, "speculative", old_binding)
    with pytest.raises(TypeError, match="incompatible keyword"):
        _run(model, 0.1, backend="tt", tt_mode="device", tt_kv_dtype="bfloat16")
    monkeypatch.setattr(tt_runtime.TTRuntime, "speculative", real)


def test_tile_padded_cache_fails(model, card, monkeypatch):
    monkeypatch.setattr(contract, "cache_length", lambda length, window: -(-length // 32) * 32)  # tiles, not S
    with pytest.raises(RuntimeError, match="not a multiple of k_chunk_size"):
        _run(model, 0.1, window=64, prompts=[(PROMPTS[0] * 3)[:200], PROMPTS[3]], backend="tt", tt_mode="device",
             tt_kv_dtype="bfloat16")  # pos + 1 = 201: a tile-padded cache of 224 is not a multiple of S = 64


def test_window_not_a_power_of_two(model, card):
    with pytest.raises(ConfigError, match="window=96 is not a power of 2"):
        SpeculationConfig(backend="tt", window=96)
    # Were the config check skipped, the card would refuse the op's k_chunk_size.
    config = SpeculationConfig(backend="tt", tt_mode="device", window=64)
    object.__setattr__(config, "window", 96)
    rt = tt_runtime.TTRuntime(ttnn, config)
    q = rt.upload(torch.randn(1, 1, 4, 64), ttnn.bfloat16)
    k = rt.upload(torch.randn(1, 2, 288, 64), ttnn.bfloat16)
    with pytest.raises(RuntimeError, match="k_chunk_size 96"):
        rt.speculative(q, k, k, lam=0.1, cur_pos=[250], scale=0.125, query_heads=4)


def test_limits_before_loading(tmp_path, card):
    from alspec_eval.adapter import ALSpecLM
    from tiny import save_tiny

    path = save_tiny(tmp_path / "tiny")
    with pytest.raises(ConfigError, match=r"batch_size=40 x 2 KV heads = 80 exceeds the 56 cores"):
        ALSpecLM(pretrained=path, backend="tt", tt_mode="device", window=32, batch_size=40, device="cpu")
    with pytest.raises(ConfigError, match="at most 32 query heads"):
        contract.check_limits(40, 8, 1, 56)
    with pytest.raises(ConfigError, match="divisible"):
        contract.check_limits(6, 4, 1, 56)


def test_compute_kernel_config_is_the_authors(card):
    config = contract.compute_kernel_config(ttnn)
    assert config.math_fidelity == ttnn.MathFidelity.HiFi4 and config.math_approx_mode is False
    program = contract.program_config(ttnn, ttnn.CoreCoord(8, 7), 9, 128)
    assert program.k_chunk_size == 128 and program.q_chunk_size == 32 and program.exp_approx_mode is False
    assert dataclasses.is_dataclass(fake_card.FakeTensor)
