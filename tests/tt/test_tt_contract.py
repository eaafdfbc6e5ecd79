"""backend=tt against a card that enforces the authors' op contract by itself (tests/tt/fake_card.py): tt_mode=device
end to end on a tiny model decides and generates as sim (window_align=32, bfloat16 KV) and as host mode (bfloat8_b KV,
the default) at S = 32, 64 and 128, sends the op only what it can take, keeps the KV cache on the device, and every
single plausible bug in the backend is rejected by the card's own check."""

from __future__ import annotations

import dataclasses

import pytest
import torch

ttnn = pytest.importorskip("ttnn", reason="ttnn is not importable here; it needs Python 3.10/3.12: scripts/tt_env.sh")

import fake_card
import tt_compare
from helpers import PROMPTS, alspec_lm, gen_requests, sample_stats

from alspec_eval.backends.tt import contract, runtime as tt_runtime
from alspec_eval.config import ConfigError, SpeculationConfig, TTSettings

pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore")]  # builds models and runs lm-eval requests
WINDOW = 32
# Prompts of 5 to 240 characters: in one batch some rows are past 2S = 64 while others are not (mixed steps).
PROMPTS_MIXED = [PROMPTS[0] * 3, PROMPTS[3], PROMPTS[1] * 2, PROMPTS[2]]


@pytest.fixture
def card(monkeypatch):
    return fake_card.install(monkeypatch, ttnn, WINDOW)


@pytest.fixture
def card_for(monkeypatch):
    """A card for a run at another S (the op's k_chunk_size must be the run's window)."""
    return lambda window: fake_card.install(monkeypatch, ttnn, window)


def _decisions(requests) -> list[tuple[int, int]]:
    return [(s["speculated"], s["accepted"]) for s in sample_stats(requests)]


def _gap_lambda(model, window: int = WINDOW, text: str = PROMPTS[0] * 3) -> float:
    return tt_compare.gap_lambda(model, window, text)


def _run(model, lam: float, window: int = WINDOW, prompts: list[str] = PROMPTS_MIXED, **args):
    lm = alspec_lm(model, batch_size=4, window=window, **args, **{"lambda": lam})
    requests = gen_requests(prompts)
    outputs = lm.generate_until(requests)
    layers = [(e["speculated"], e["accepted"], e["trivial"]) for e in lm.statistics()["tasks"]["gen"]["layers"]]
    return outputs, _decisions(requests), layers


# Per S: prompts of which some rows pass 2S during generation while others stay below it (mixed steps).
PROMPTS_BY_WINDOW = {32: PROMPTS_MIXED, 64: PROMPTS_MIXED, 128: [PROMPTS[0] * 4, PROMPTS[3], PROMPTS[1] * 3, PROMPTS[2]]}


@pytest.mark.parametrize("window", sorted(PROMPTS_BY_WINDOW))
def test_device_path_equals_sim(bf16_model, card_for, window):
    card = card_for(window)
    prompts = PROMPTS_BY_WINDOW[window]
    lam = _gap_lambda(bf16_model, window, prompts[0])
    sim = _run(bf16_model, lam, window, prompts, window_align=32)
    tt = _run(bf16_model, lam, window, prompts, backend="tt", tt_mode="device", tt_kv_dtype="bfloat16")
    assert tt == sim
    assert 0 < sum(a for _, a in sim[1]) < sum(s for s, _ in sim[1])
    kinds = [kind for kind, _ in card.calls]
    assert {"speculative", "decode", "update"} <= set(kinds)
    for kind, call in card.calls:
        if kind == "speculative":
            assert call["program_config"].k_chunk_size == window
            assert call["cache_length"] % window == 0
            assert min(call["cur_pos"]) + 1 > 2 * window
            assert "speculative_chunk_size" not in call


@pytest.mark.parametrize("window", [32, 64])
def test_device_path_with_bfloat8_b_kv_equals_host_mode(bf16_model, card_for, window):
    """The default KV dtype: the card stores the cache as bfloat8_b blocks by its own rounding; host mode rounds
    with the backend's. Same outputs and decisions."""
    lam = _gap_lambda(bf16_model, window)
    host = _run(bf16_model, lam, window, backend="tt", tt_mode="host", tt_kv_dtype="bfloat8_b")  # before the card
    card = card_for(window)
    device = _run(bf16_model, lam, window, backend="tt", tt_mode="device")  # tt_kv_dtype defaults to bfloat8_b
    assert device == host
    assert any(kind == "speculative" for kind, _ in card.calls)


def test_a_reconfigured_window_reaches_the_op(bf16_model, card_for):
    """A sweep changes settings between cells on one loaded model: the op must run with the new window (it once kept
    the window the runtime was built with)."""
    lam = _gap_lambda(bf16_model, 64)
    sim = _run(bf16_model, lam, 64, window_align=32)
    card = card_for(64)
    lm = alspec_lm(bf16_model, batch_size=4, window=32, backend="tt", tt_mode="device", tt_kv_dtype="bfloat16",
                   **{"lambda": lam})
    lm.reconfigure(window=64)
    requests = gen_requests(PROMPTS_MIXED)
    assert (lm.generate_until(requests), _decisions(requests)) == sim[:2]
    chunks = {call["program_config"].k_chunk_size for kind, call in card.calls if kind == "speculative"}
    assert chunks == {64}


def test_each_layer_calls_the_op_with_its_own_lambda(bf16_model, card, tmp_path):
    """lambda_schedule: every layer's op call gets that layer's lambda, and the decisions equal sim's."""
    import json

    lam = _gap_lambda(bf16_model)
    schedule = [lam, 4 * lam, lam / 4]  # the tiny model's three layers
    path = tmp_path / "schedule.json"
    path.write_text(json.dumps(schedule))
    sim = _run(bf16_model, 0.1, lambda_schedule=str(path), window_align=32)
    tt = _run(bf16_model, 0.1, lambda_schedule=str(path), backend="tt", tt_mode="device", tt_kv_dtype="bfloat16")
    assert tt == sim
    lambdas = [call["lambda_"] for kind, call in card.calls if kind == "speculative"]
    assert lambdas[:3] == schedule  # one call per layer and step, in layer order
    assert len(lambdas) % 3 == 0 and lambdas == schedule * (len(lambdas) // 3)


def test_kv_cache_stays_on_the_device(bf16_model, card, monkeypatch):
    """Each layer's cache is uploaded once per request; later steps append one token through paged_update_cache."""
    uploads = []
    real = ttnn.from_torch
    monkeypatch.setattr(ttnn, "from_torch", lambda t, **kw: uploads.append(tuple(t.shape)) or real(t, **kw))
    lm = alspec_lm(bf16_model, batch_size=4, window=WINDOW, backend="tt", tt_mode="device", tt_kv_dtype="bfloat16")
    lm.generate_until(gen_requests([PROMPTS[0] * 3] * 4))
    layers = lm.speculator.num_layers
    cache_uploads = [s for s in uploads if len(s) == 4 and s[1] == 2 and s[2] >= 2 * WINDOW]
    assert len(cache_uploads) == 2 * layers  # K and V of each layer, once for the request
    updates = [c for kind, c in card.calls if kind == "update"]
    assert len(updates) > 2 * layers and all(len(c["update_idxs"]) == 4 for c in updates)


def _compute_config(ttnn, fidelity: str = "HiFi4", approx: bool = False):
    return ttnn.WormholeComputeKernelConfig(math_fidelity=getattr(ttnn.MathFidelity, fidelity), math_approx_mode=approx,
                                            fp32_dest_acc_en=False, packer_l1_acc=False)


def _old_binding(self, q, k, v, **kwargs):
    """PR #16359's keyword, which the op no longer has."""
    kwargs = dict(lambda_=kwargs["lam"], speculative_chunk_size=kwargs["window"], cur_pos=kwargs["cur_pos"],
                  scale=kwargs["scale"])
    return getattr(self.ttnn.experimental, contract.OP_NAME)(q, k, v, **kwargs)


def _off_by_one_trivial(monkeypatch):
    """Rows with pos + 1 == 2S treated as speculative (the op has no valid output there)."""
    import types

    from alspec_eval import semantics
    from alspec_eval.backends.tt import speculator

    patched = types.SimpleNamespace(**{**vars(semantics), "is_trivial": lambda pos, window: pos + 1 < 2 * window})
    monkeypatch.setattr(speculator, "semantics", patched)


# One plausible bug each, applied to the backend, and the card check that must reject it.
MUTATIONS = {
    "HiFi2 instead of HiFi4": (lambda mp: mp.setattr(contract, "compute_kernel_config",
                                                     lambda t: _compute_config(t, "HiFi2")), "math_fidelity"),
    "math_approx_mode=True": (lambda mp: mp.setattr(contract, "compute_kernel_config",
                                                    lambda t: _compute_config(t, approx=True)), "math_approx_mode"),
    "exp_approx_mode=True": (lambda mp: mp.setattr(contract, "program_config", lambda t, grid, heads, window:
                             t.SDPAProgramConfig(compute_with_storage_grid_size=grid, q_chunk_size=32,
                                                 k_chunk_size=window, exp_approx_mode=True)), "exp_approx_mode"),
    "q_chunk_size of the unpadded heads": (lambda mp: mp.setattr(contract, "padded_heads", lambda heads: heads),
                                           "q_chunk_size"),
    "cache padded to a multiple of 32, not S": (lambda mp: mp.setattr(
        contract, "cache_length", lambda length, window: -(-length // 32) * 32), "cache length"),
    "cache not padded": (lambda mp: mp.setattr(contract, "cache_length", lambda length, window: length),
                         "cache length"),
    "new token cast to bfloat8_b before paged_update_cache": (
        lambda mp: mp.setattr(contract, "UPDATE_INPUT_DTYPE", "bfloat8_b"), "update input dtype"),
    "the whole device grid": (lambda mp: mp.setattr(contract, "op_grid", lambda t, grid: grid), "grid"),
    "rows with pos + 1 = 2S sent to the op": (_off_by_one_trivial, "trivial rows"),
    "PR #16359's speculative_chunk_size keyword": (
        lambda mp: mp.setattr(tt_runtime.TTRuntime, "speculative", _old_binding), "keywords"),
}
# S = 64; a row of 200 tokens (a cache padded to 32 is no multiple of 64), a short one (mixed steps), and one that
# passes pos + 1 = 2S = 128 while it generates.
MUTATION_PROMPTS = [(PROMPTS[0] * 3)[:200], PROMPTS[3], (PROMPTS[2] * 2)[:126]]


@pytest.mark.parametrize("bug", sorted(MUTATIONS))
def test_every_single_bug_is_rejected_by_the_cards_own_check(bf16_model, card_for, monkeypatch, bug):
    mutate, check = MUTATIONS[bug]
    card_for(64)
    _run(bf16_model, 0.1, 64, MUTATION_PROMPTS, backend="tt", tt_mode="device")  # unmutated: the card takes every call
    mutate(monkeypatch)
    with pytest.raises((fake_card.CardError, TypeError)) as caught:
        _run(bf16_model, 0.1, 64, MUTATION_PROMPTS, backend="tt", tt_mode="device")
    if check == "keywords":
        assert caught.type is TypeError and "incompatible keyword arguments" in str(caught.value)
    else:
        assert caught.type is fake_card.CardError and caught.value.check == check, str(caught.value)


def test_window_not_a_power_of_two(bf16_model, card):
    with pytest.raises(ConfigError, match="window=96 is not a power of 2"):
        SpeculationConfig(backend="tt", window=96)
    # Were the config check skipped, the card would refuse the op's k_chunk_size.
    config = SpeculationConfig(backend="tt", tt=TTSettings(mode="device"), window=64)
    object.__setattr__(config, "window", 96)
    rt = tt_runtime.TTRuntime(ttnn, mode="device")
    q = rt.upload(torch.randn(1, 1, 4, 64), ttnn.bfloat16)
    k = rt.upload(torch.randn(1, 2, 288, 64), ttnn.bfloat16)
    with pytest.raises(fake_card.CardError, match="fake card: k_chunk_size: 96"):
        rt.speculative(q, k, k, lam=0.1, cur_pos=[250], scale=0.125, query_heads=4, window=config.window)


def test_limits_before_loading(tmp_path, card):
    from alspec_eval.adapter import ALSpecLM
    from alspec_eval.approx_check.models import save_tiny

    path = save_tiny(tmp_path / "tiny")
    # the card's grid is 8 x 5; the op may use 8 x 4 = 32 cores (the last row is CCL's)
    with pytest.raises(ConfigError, match=r"batch_size=25 x 2 KV heads = 50 exceeds the 32 cores it may use"):
        ALSpecLM(pretrained=path, backend="tt", tt_mode="device", window=32, batch_size=25, device="cpu")
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
