"""backend=tt on the fake card (tests/tt/fake_card.py), branch by branch of ``TTSpeculator.decode``, call by call
against sim (tests/tt/tt_compare.py): the branch a long-context run takes at every step (every row past 2S: one
speculative call for the whole batch on the resident cache), a batch that starts mixed and ends there, the fallback
of a card whose ttnn lacks the op, the largest window, and the op's batch limit at its edge."""

from __future__ import annotations

import copy
import importlib
import inspect
import textwrap

import pytest
import torch

ttnn = pytest.importorskip("ttnn", reason="ttnn is not importable here; it needs Python 3.10/3.12: scripts/tt_env.sh")

import fake_card
import tt_compare

from alspec_eval.approx_check.models import save_tiny, tiny_model
from alspec_eval.config import ConfigError

pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore")]  # builds models and runs lm-eval requests


def _both(model, card, window: int, prompts: list[str], batch: int, kv_dtype: str = "bfloat16",
          max_gen_toks: int = 8, **args):
    """sim and tt on the same requests: equal generations and decisions, every op call equal to sim's rows, every
    layer's committed output equal to sim's."""
    lam, sim, sim_calls, sim_committed = tt_compare.settled(model, window, prompts, batch, kv_dtype, max_gen_toks,
                                                            **args)
    tt, _, tt_committed = tt_compare.run(model, lam, window, prompts, batch, kv_dtype, max_gen_toks, backend="tt",
                                         **args)
    worst = tt_compare.compare_calls(card, sim_calls)
    worst["committed"] = tt_compare.compare_committed(tt_committed, sim_committed)
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
def test_every_row_past_2s_takes_one_speculative_call_equal_to_sim(bf16_model, monkeypatch, window, kv_dtype, batch):
    """Long prompts only: every row is past 2S from the first decode step, so every step of every layer is one
    speculative call for the whole batch on the resident cache, and each call's A, A~, d, n equal sim's rows."""
    card = fake_card.install(monkeypatch, ttnn, window)
    prompts = tt_compare.long_prompts(window, 4 if batch == 4 else 2)
    sim, worst = _both(bf16_model, card, window, prompts, batch, kv_dtype)
    speculated = sum(s for s, _ in sim[1]) // batch  # a batch's rows speculate at the same layers and steps
    assert tt_compare.branches(card) == {"all past 2S": speculated}
    assert 0 < sum(a for _, a in sim[1]) < sum(s for s, _ in sim[1])
    for kind, call in card.calls:
        if kind == "speculative":
            assert call["batch"] == batch and call["rows"] == list(range(batch))
            assert call["program_config"].k_chunk_size == window and call["cache_length"] % window == 0
    if batch == 4:
        assert _pads(prompts, 4) == [[0, 9, 18, 27]]  # left padding: the rows' positions differ
    assert set(worst) == {"A", "A~", "d", "n", "committed"} and max(worst.values()) <= tt_compare.TOL


def test_a_batch_that_starts_mixed_ends_past_2s(bf16_model, monkeypatch):
    """One row starts within 2S and passes it during generation: the mixed branch, then the all-past branch on the
    same resident cache, in one request; every op call equal to sim's."""
    _mixed_then_past(bf16_model, monkeypatch)


def _mixed_then_past(model, monkeypatch) -> None:
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


def test_a_card_without_the_op_runs_the_fallback_equal_to_sim(bf16_model, monkeypatch):
    """A released ttnn (no speculative op) on a card: A from the decode op on the resident cache, A~ from it on the
    2S window keys (the card checks they are the contract's windows of the host's rows), d and n on the host."""
    _fallback(bf16_model, monkeypatch)


def _fallback(model, monkeypatch) -> None:
    window = 32
    card = fake_card.install(monkeypatch, ttnn, window, speculative_op=False)
    prompts = tt_compare.long_prompts(window, 3, shortest=80) + [tt_compare.TEXT[500:550]]
    lam = tt_compare.gap_lambda(model, window)
    sim, _, sim_committed = tt_compare.run(model, lam, window, prompts, 4)
    tt, _, tt_committed = tt_compare.run(model, lam, window, prompts, 4, backend="tt")
    assert tt == sim
    tt_compare.compare_committed(tt_committed, sim_committed)
    assert set(tt_compare.branches(card)) == {"fallback"}


def test_largest_window(monkeypatch):
    """S = 512, the largest window docs/tenstorrent.md allows for backend=tt: rows past 2S = 1024 tokens."""
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
        committed = tt_compare.record_committed(lm)
        reqs = tt_compare.requests(prompts, 6)
        runs[name] = (lm.generate_until(reqs), [r.arguments[-1]["alspec"]["accepted"] for r in reqs]), calls, committed
    assert runs["tt"][0] == runs["sim"][0]
    tt_compare.compare_calls(card, runs["sim"][1])
    tt_compare.compare_committed(runs["tt"][2], runs["sim"][2])
    assert set(tt_compare.branches(card)) == {"all past 2S"}
    assert {c["program_config"].k_chunk_size for k, c in card.calls if k == "speculative"} == {512}


@pytest.mark.parametrize("grid", [fake_card.GRID, fake_card.SECOND_GRID])
def test_batch_limit_at_its_edge(tmp_path, monkeypatch, grid):
    """batch x KV heads = x * (y - 1), the op's cores on this card, is accepted and runs on the card; one row more
    stops before the weights load, in one line."""
    _limit_edge(tmp_path, monkeypatch, grid)


def _limit_edge(tmp_path, monkeypatch, grid: tuple[int, int]) -> None:
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


# Single bugs in the backend's source (``old`` replaced by ``new`` in one function), each on one branch of
# TTSpeculator.decode or at one limit's edge, and the scenario that must catch it: by a comparison with sim (call by
# call, committed outputs, generations and decisions) or by the card's own check.
SPECULATOR = "alspec_eval.backends.tt.speculator:TTSpeculator.decode"
BUGS = {
    "all past 2S: cur_pos one past": (
        SPECULATOR, "lam=op_lambda, cur_pos=pos.tolist()", "lam=op_lambda, cur_pos=(pos + 1).tolist()", "branches"),
    "all past 2S: cur_pos one short": (
        SPECULATOR, "lam=op_lambda, cur_pos=pos.tolist()", "lam=op_lambda, cur_pos=(pos - 1).tolist()", "branches"),
    "all past 2S: d2 and n2 read in the wrong order": (
        SPECULATOR, "for t in (d2, n2))", "for t in (n2, d2))", "branches"),
    "all past 2S: A and A~ swapped": (
        SPECULATOR, "_from_squares(host(full), host(spec),", "_from_squares(host(spec), host(full),", "branches"),
    "all past 2S taken while a row is within 2S": (
        SPECULATOR, "if not trivial.any():", "if not trivial.all():", "branches"),
    "mixed: the op on the trivial rows": (
        SPECULATOR, "rows = (~trivial).nonzero().flatten()", "rows = trivial.nonzero().flatten()", "branches"),
    "mixed: cur_pos of every row": (
        SPECULATOR, "cur_pos=pos[rows].tolist()", "cur_pos=pos.tolist()", "branches"),
    "mixed: d2 and n2 read in the wrong order": (
        SPECULATOR, "for t in (d2_sub, n2_sub))", "for t in (n2_sub, d2_sub))", "branches"),
    "mixed: A~ of the rows written as A": (
        SPECULATOR, "approx[rows] = rt.download(spec)", "approx[rows] = rt.download(full)", "branches"),
    "fallback: window keys without the left padding": (
        SPECULATOR, "index = (positions + pad[:, None])", "index = (positions + 0 * pad[:, None])", "fallback"),
    "fallback: A~'s cur_pos one past": (
        SPECULATOR, "cur_pos=(valid.sum(1) - 1).tolist()", "cur_pos=valid.sum(1).tolist()", "fallback"),
    "limit: one row more than the cores admitted": (
        "alspec_eval.backends.tt.contract:check_limits", "batch * kv_heads > cores", "(batch - 1) * kv_heads > cores",
        "limits"),
    "limit: the exact fit refused": (
        "alspec_eval.backends.tt.contract:check_limits", "batch * kv_heads > cores", "batch * kv_heads >= cores",
        "limits"),
    "limit: the host's default grid on a card": (
        "alspec_eval.backends.tt.runtime:TTRuntime.__init__",
        "compute_with_storage_grid_size() if self.device is not None", "compute_with_storage_grid_size() if False",
        "limits"),
}


def _break(monkeypatch, target: str, old: str, new: str) -> None:
    """Replace the function ``module:qualname`` by its own source with ``old`` (once) replaced by ``new``."""
    module_name, qualname = target.split(":")
    module = importlib.import_module(module_name)
    owner, name = (module, qualname) if "." not in qualname else (getattr(module, qualname.split(".")[0]),
                                                                  qualname.split(".")[1])
    source = textwrap.dedent(inspect.getsource(getattr(owner, name)))
    assert source.count(old) == 1, f"{target}: {old!r} is not in its source once"
    namespace = dict(vars(module))
    exec(compile(source.replace(old, new), module.__file__, "exec"), namespace)
    monkeypatch.setattr(owner, name, namespace[name])


@pytest.mark.parametrize("bug", sorted(BUGS))
def test_every_single_bug_on_a_branch_or_a_limit_is_caught(bf16_model, tmp_path, monkeypatch, bug):
    target, old, new, scenario = BUGS[bug]
    _break(monkeypatch, target, old, new)
    run = {"branches": lambda: _mixed_then_past(bf16_model, monkeypatch),
           "fallback": lambda: _fallback(bf16_model, monkeypatch),
           "limits": lambda: _limit_edge(tmp_path, monkeypatch, fake_card.SECOND_GRID)}[scenario]
    with pytest.raises((AssertionError, pytest.fail.Exception, fake_card.CardError, ConfigError)) as caught:
        run()
    print(f"\n{bug}: caught by {caught.type.__name__}: {str(caught.value).splitlines()[0][:150]}")
