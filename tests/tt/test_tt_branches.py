"""backend=tt on the fake card (tests/tt/fake_card.py), branch by branch of ``TTSpeculator.decode``, call by call
against sim (tests/tt/tt_compare.py): the branch a long-context run takes at every step (every row past 2S: one
speculative call for the whole batch on the resident cache), a batch that starts mixed and ends there, the fallback
of a card whose ttnn lacks the op, the largest window, and the op's batch limit at its edge."""

from __future__ import annotations

import copy

import pytest
import torch

ttnn = pytest.importorskip("ttnn", reason="ttnn is not importable here; it needs Python 3.10/3.12: scripts/tt_env.sh")

import fake_card  # noqa: E402
import tt_compare  # noqa: E402
from tiny import save_tiny, tiny_model  # noqa: E402

from alspec_eval.config import ConfigError  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore")]  # builds models and runs lm-eval requests


@pytest.fixture(scope="module")
def model():
    return tiny_model().to(torch.bfloat16)


def _both(model, card, window: int, prompts: list[str], batch: int, kv_dtype: str = "bfloat16",
          max_gen_toks: int = 8, **args):
    """sim and tt on the same requests: equal generations and decisions, every op call equal to sim's rows."""
    lam, sim, sim_calls = tt_compare.settled(model, window, prompts, batch, kv_dtype, max_gen_toks, **args)
    tt, _ = tt_compare.run(model, lam, window, prompts, batch, kv_dtype, max_gen_toks, backend="tt", **args)
    worst = tt_compare.compare_calls(card, sim_calls)
    assert tt == sim
    return sim, worst


def _pads(prompts: list[str], batch: int) -> list[list[int]]:
    """Each generate batch's left padding, as lm-eval batches them (longest first)."""
    lengths = sorted((len(p) for p in prompts), reverse=True)
    groups = [lengths[i:i + batch] for i in range(0, len(lengths), batch)]
    return [[g[0] - n for n in g] for g in groups]


@pytest.mark.parametrize("batch", [1, 4])
@pytest.mark.parametrize("kv_dtype", ["bfloat16", "bfloat8_b"])
@pytest.mark.parametrize("window", [32, 64, 128])
def test_every_row_past_2s_takes_one_speculative_call_equal_to_sim(model, monkeypatch, window, kv_dtype, batch):
    """Long prompts only: every row is past 2S from the first decode step, so every step of every layer is one
    speculative call for the whole batch on the resident cache, and each call's A, A~, d, n equal sim's rows."""
    card = fake_card.install(monkeypatch, ttnn, window)
    prompts = tt_compare.long_prompts(window, 4 if batch == 4 else 2)
    sim, worst = _both(model, card, window, prompts, batch, kv_dtype)
    speculated = sum(s for s, _ in sim[1]) // batch  # a batch's rows speculate at the same layers and steps
    assert tt_compare.branches(card) == {"all past 2S": speculated}
    assert 0 < sum(a for _, a in sim[1]) < sum(s for s, _ in sim[1])
    for kind, call in card.calls:
        if kind == "speculative":
            assert call["batch"] == batch and call["rows"] == list(range(batch))
            assert call["program_config"].k_chunk_size == window and call["cache_length"] % window == 0
    if batch == 4:
        assert _pads(prompts, 4) == [[0, 9, 18, 27]]  # left padding: the rows' positions differ
    print(worst)


def test_a_batch_that_starts_mixed_ends_past_2s(model, monkeypatch):
    """One row starts within 2S and passes it during generation: the mixed branch, then the all-past branch on the
    same resident cache, in one request; every op call equal to sim's."""
    window = 32
    card = fake_card.install(monkeypatch, ttnn, window)
    # the short row's pos + 1 runs 61 .. 67 over its 7 decode steps: past 2S = 64 from the 5th
    prompts = tt_compare.long_prompts(window, 3, shortest=80) + [tt_compare.TEXT[500:560]]
    _both(model, card, window, prompts, 4)
    pads = _pads(prompts, 4)[0]
    seen = []
    for calls in tt_compare.steps(card).values():
        kind = tt_compare.branch(calls)
        assert kind == tt_compare.expected_branch(calls[0][1], window, pads)
        if not seen or seen[-1] != kind:
            seen.append(kind)
    assert seen == ["mixed", "all past 2S"]


def test_a_card_without_the_op_runs_the_fallback_equal_to_sim(model, monkeypatch):
    """A released ttnn (no speculative op) on a card: A from the decode op on the resident cache, A~ from it on the
    2S window keys (the card checks they are the contract's windows of the host's rows), d and n on the host."""
    window = 32
    card = fake_card.install(monkeypatch, ttnn, window, speculative_op=False)
    prompts = tt_compare.long_prompts(window, 3, shortest=80) + [tt_compare.TEXT[500:550]]
    lam = tt_compare.gap_lambda(model, window)
    sim, _ = tt_compare.run(model, lam, window, prompts, 4)
    tt, _ = tt_compare.run(model, lam, window, prompts, 4, backend="tt")
    assert tt == sim
    assert set(tt_compare.branches(card)) == {"fallback"}


def test_largest_window(monkeypatch):
    """S = 512, the largest window the README allows for backend=tt: rows past 2S = 1024 tokens."""
    from alspec_eval.adapter import ALSpecLM
    from helpers import TOKENIZER

    window, big = 512, tiny_model(max_positions=2048).to(torch.bfloat16)
    card = fake_card.install(monkeypatch, ttnn, window)
    prompts = tt_compare.long_prompts(window, 2)
    lam = tt_compare.gap_lambda(big, window, tt_compare.TEXT[:1180])
    runs = {}
    for name, args in {"sim": {"window_align": 32}, "tt": {"backend": "tt", "tt_mode": "device",
                                                           "tt_kv_dtype": "bfloat16"}}.items():
        lm = ALSpecLM(pretrained=copy.deepcopy(big), tokenizer=TOKENIZER, batch_size=2, max_length=2048, device="cpu",
                      window=window, **args, **{"lambda": lam})
        calls = tt_compare.record_sim(lm, "bfloat16") if name == "sim" else None
        reqs = tt_compare.requests(prompts, 6)
        runs[name] = (lm.generate_until(reqs), [r.arguments[-1]["alspec"]["accepted"] for r in reqs]), calls
    assert runs["tt"][0] == runs["sim"][0]
    tt_compare.compare_calls(card, runs["sim"][1])
    assert set(tt_compare.branches(card)) == {"all past 2S"}
    assert {c["program_config"].k_chunk_size for k, c in card.calls if k == "speculative"} == {512}


@pytest.mark.parametrize("grid", [fake_card.GRID, fake_card.SECOND_GRID])
def test_batch_limit_at_its_edge(tmp_path, monkeypatch, grid):
    """batch x KV heads = x * (y - 1), the op's cores on this card, is accepted and runs on the card; one row more
    stops before the weights load, in one line."""
    from lm_eval.models.huggingface import HFLM

    from alspec_eval.adapter import ALSpecLM

    card = fake_card.install(monkeypatch, ttnn, 32, grid)
    path = save_tiny(tmp_path / "tiny")
    cores = grid[0] * (grid[1] - 1)
    fit = cores // 2  # the tiny model has 2 KV heads
    with monkeypatch.context() as patch:
        def loaded(*_, **__):
            raise AssertionError("the weights loaded before the batch limit was checked")

        patch.setattr(HFLM, "_create_model", loaded)
        with pytest.raises(ConfigError) as refused:
            ALSpecLM(pretrained=path, backend="tt", tt_mode="device", window=32, batch_size=fit + 1, device="cpu")
    message = str(refused.value)
    assert "\n" not in message
    assert f"batch_size={fit + 1} x 2 KV heads = {2 * fit + 2} exceeds the {cores} cores it may use" in message
    assert f"use batch_size <= {fit}" in message
    lm = ALSpecLM(pretrained=path, backend="tt", tt_mode="device", window=32, batch_size=fit, device="cpu")
    lm.generate_until(tt_compare.requests(tt_compare.long_prompts(32, fit, shortest=70), 3))
    ops = [call for kind, call in card.calls if kind == "speculative"]
    assert ops and {c["batch"] for c in ops} == {fit}
    assert all(c["program_config"].compute_with_storage_grid_size.y == grid[1] - 1 for c in ops)
