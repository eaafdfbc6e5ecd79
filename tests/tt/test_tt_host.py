"""tt_mode=host: the TT path with ttnn's golden functions; equals sim under a bfloat16 KV cache, and bfloat8_b
changes results only through the rounding of the KV cache."""

from __future__ import annotations

import math

import pytest
import torch

ttnn = pytest.importorskip("ttnn", reason="ttnn is not importable here; it needs Python 3.10/3.12: scripts/tt_env.sh")

from helpers import PROMPTS, alspec_lm, comparable, gen_requests, sample_stats

from alspec_eval.backends.tt import TTRuntime, TTSpeculator, round_bfloat8_b
from alspec_eval.config import SpeculationConfig, TTSettings
from alspec_eval.kernels import speculative_flash_decode
from alspec_eval.stats import RATIO_EDGES

pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore")]  # builds models and runs lm-eval requests
WINDOW = 32
PROMPTS_LONG = [p * 3 for p in PROMPTS]  # past 2S = 64 tokens, so decode steps speculate


def _median_lambda(model) -> float:
    """A histogram edge near the median decode ratio (exact commits): about half the decisions accept."""
    lm = alspec_lm(model, window=WINDOW, window_align=32, **{"lambda": 0.0})
    lm.generate_until(gen_requests(PROMPTS_LONG))
    hist = lm.statistics()["tasks"]["gen"]["total"]["hist"]
    half, seen = sum(hist) / 2, 0
    for k, count in enumerate(hist):
        seen += count
        if seen >= half:
            return RATIO_EDGES[k]
    raise AssertionError("no decisions")


def test_host_bfloat16_equals_sim(bf16_model):
    """Same model in bfloat16, sim with window_align=32: the same A and A~ inputs (bf16 round trips are exact),
    so the same generations and the same decisions, token by token and layer by layer."""
    lam = _median_lambda(bf16_model)
    runs = {}
    for name, args in {"sim": {"window_align": 32},
                       "tt": {"backend": "tt", "tt_mode": "host", "tt_kv_dtype": "bfloat16"}}.items():
        lm = alspec_lm(bf16_model, batch_size=2, window=WINDOW, trace_tokens=True, **args, **{"lambda": lam})
        requests = gen_requests(PROMPTS_LONG)
        runs[name] = (lm.generate_until(requests), sample_stats(requests), lm.statistics()["tasks"])
    assert isinstance(lm.speculator, TTSpeculator)
    assert runs["tt"][:2] == runs["sim"][:2]
    # the op's d and n are the roots of its own squares in bfloat16 (docs/tt_op_contract.md): the same decisions and
    # histograms, the mean d/n to 3 digits
    assert comparable(runs["tt"][2], rel=1e-3) == runs["sim"][2]
    total = runs["sim"][2]["gen"]["total"]
    assert 0 < total["accepted"] < total["speculated"]


def _decode(kv_dtype: str, q, k, v, pad, lam: float = 0.1):
    config = SpeculationConfig(backend="tt", tt=TTSettings(mode="host", kv_dtype=kv_dtype), window=WINDOW, lam=lam)
    speculator = TTSpeculator(1, {}, None, runtime=TTRuntime(ttnn, mode="host", kv_dtype=kv_dtype))
    out = speculator.decode(0, q[:, :, 0], k, v, pad, k.shape[2] - 1 - pad, lam, q.shape[-1] ** -0.5, config)
    return out.exact[:, None], out.spec[:, None]


def _inputs(length: int = 150):
    torch.manual_seed(0)
    q = (torch.randn(2, 4, 1, 64) * 2).bfloat16()
    k, v = (torch.randn(2, 2, length, 64) * 2).bfloat16(), torch.randn(2, 2, length, 64).bfloat16()
    return q, k, v, torch.tensor([0, 7])


def _ratio(exact: torch.Tensor, approx: torch.Tensor) -> torch.Tensor:
    return (approx.float() - exact.float()).flatten(1).norm(dim=1) / exact.float().flatten(1).norm(dim=1)


def test_decode_matches_reference_kernel():
    """The golden decode op with left-aligned rows and tile-aligned windows is the window_align=32 semantics."""
    q, k, v, pad = _inputs()
    exact, approx = _decode("bfloat16", q, k, v, pad)
    ref = speculative_flash_decode(q[:, :, 0], k, v, torch.full((2,), k.shape[2] - 1), WINDOW, math.inf,
                                   window_align=32, start=pad)
    torch.testing.assert_close(exact[:, 0], ref.exact, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(approx[:, 0], ref.spec, atol=2e-2, rtol=2e-2)


def test_bfloat8_b_differs_only_through_kv_rounding():
    q, k, v, pad = _inputs()
    exact8, approx8 = _decode("bfloat8_b", q, k, v, pad)
    # Exactly the bfloat16 path on a KV cache rounded beforehand: the rounding is the only difference.
    exact_r, approx_r = _decode("bfloat16", q, round_bfloat8_b(k), round_bfloat8_b(v), pad)
    assert torch.equal(exact8, exact_r) and torch.equal(approx8, approx_r)
    exact16, approx16 = _decode("bfloat16", q, k, v, pad)
    assert not torch.equal(exact8, exact16)
    rel = (exact8.float() - exact16.float()).norm() / exact16.float().norm()
    assert 0 < rel < 0.03  # 7-bit mantissas: about 1% per K/V entry
    moved = (_ratio(exact8, approx8) - _ratio(exact16, approx16)).abs()
    assert bool((moved < 0.03 * _ratio(exact16, approx16) + 0.01).all())


def test_round_bfloat8_b():
    x = torch.zeros(2, 32)
    x[0, :3] = torch.tensor([1.0, 0.01, -1.999])  # group max 1.999: step 2^-6 for the whole group of 16
    x[0, 16] = 0.01  # the next group has its own exponent
    y = round_bfloat8_b(x)
    assert y.dtype == torch.bfloat16
    assert y[0, :3].tolist() == [1.0, 2 ** -6, -127 * 2 ** -6]  # rounded to nearest, saturated at 127 steps
    assert y[0, 16].item() == torch.tensor(0.01).bfloat16().item() and not y[1].any()
    z = torch.randn(3, 40, 64) * 5
    r = round_bfloat8_b(z)
    scale = z.reshape(3, 40, 4, 16).abs().amax(-1, keepdim=True)
    assert bool(((r.float() - z).reshape(3, 40, 4, 16).abs() <= scale * 2 ** -7 + 1e-9).all())
    w = z.clone()
    w[1, 5] *= 100  # rounding is per token: other tokens keep their values
    changed = (round_bfloat8_b(w) != r).any(-1)
    assert changed.nonzero().tolist() == [[1, 5]]
    assert torch.equal(round_bfloat8_b(r), r)
