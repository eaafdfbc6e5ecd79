"""Drafts on the tiny Llama inside vLLM against --model alspec on the same prompts, d/n for d/n at every position
and layer:

- a user's own draft (tests/user_draft.py, ``approx=pkg.module:Class``), which has no code for vLLM;
- a prompt-scoring draft (snapkv), which reads its prompt's last queries whatever the engine did with the prompt:
  prefilled in several chunks (the tiny engine takes 96 tokens a step: an observation window of 200 positions spans
  three of them, and 48 keys before it are chosen by its queries), or prefilled before by another cell whose blocks
  the prefix cache holds (a cell after a baseline cell equals the same cell alone).
"""

from __future__ import annotations

import re

import pytest

pytest.importorskip("vllm")
import torch
from lm_eval.api.instance import Instance

from alspec_eval.stats import AcceptanceStats
from conftest import TINY, speculating

pytestmark = pytest.mark.slow

# a window of 200 prompt positions, always kept, and 2S - recent - 200 = 48 prompt keys before it chosen by their
# scores from the window's queries
WINDOW = 128
SNAPKV = {"approx": "snapkv", "approx_args": "observe:200;pool:3;recent:8"}
GEN_KWARGS = {"until": ["\n\n"], "max_gen_toks": 10, "do_sample": False}
PROMPTS = ["".join(chr(33 + (i * 7 + j * 13) % 90) for j in range(n)) for i, n in enumerate((500, 420, 40))]


@pytest.fixture(scope="module")
def hf_tiny(tiny_path):
    from alspec_eval.adapter import ALSpecLM

    return ALSpecLM(pretrained=tiny_path, dtype="float32", device="cpu", batch_size=3,
                    max_length=TINY["max_model_len"], window=WINDOW, **{"lambda": 0.0}, **SNAPKV)


def ratios_of(lm, monkeypatch) -> tuple[list, torch.Tensor]:
    """Texts of PROMPTS and every measured d/n, per request in the order of its positions and layers, sorted by
    request (the engines reduce their requests in other orders)."""
    traced = []
    original = AcceptanceStats.from_trace.__func__

    def from_trace(cls, codes, ratios, *args, **kwargs):
        traced.append(ratios.detach().float().cpu().flatten())
        return original(cls, codes, ratios, *args, **kwargs)

    monkeypatch.setattr(AcceptanceStats, "from_trace", classmethod(from_trace))
    texts = lm.generate_until([Instance("generate_until", {}, (p, dict(GEN_KWARGS)), i, ("gen", i, 1))
                               for i, p in enumerate(PROMPTS)])
    monkeypatch.undo()
    return texts, sorted((t for t in traced if len(t)), key=len)


def test_a_prompt_observed_over_three_chunks_scores_as_model_alspec(alspec_tiny, hf_tiny, monkeypatch):
    assert TINY["max_num_batched_tokens"] * 2 < 200 < len(PROMPTS[0]) - 2 * WINDOW  # it spans three prefill steps
    hf_texts, hf = ratios_of(hf_tiny, monkeypatch)
    with speculating(alspec_tiny, lam=0.0, window=WINDOW, **SNAPKV):
        alspec_tiny.model.reset_prefix_cache()
        texts, ours = ratios_of(alspec_tiny, monkeypatch)
    assert texts == hf_texts
    assert [len(t) for t in ours] == [len(t) for t in hf] and sum(map(len, ours)) > 60
    for a, b in zip(ours, hf):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6, equal_nan=True)


def test_a_users_own_draft_runs_in_vllm_as_in_model_alspec(alspec_tiny, tiny_path, monkeypatch):
    from alspec_eval.adapter import ALSpecLM

    user = {"approx": "user_draft:HighestSums"}
    hf = ALSpecLM(pretrained=tiny_path, dtype="float32", device="cpu", batch_size=3, max_length=TINY["max_model_len"],
                  window=WINDOW, **{"lambda": 0.0}, **user)
    hf_texts, expected = ratios_of(hf, monkeypatch)
    with speculating(alspec_tiny, lam=0.0, window=WINDOW, **user):
        texts, ours = ratios_of(alspec_tiny, monkeypatch)
    assert texts == hf_texts and [len(t) for t in ours] == [len(t) for t in expected]
    assert sum(map(len, ours)) > 60
    for a, b in zip(ours, expected):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6, equal_nan=True)


def test_a_snapkv_cell_after_a_baseline_cell_equals_it_alone(alspec_tiny, monkeypatch):
    lm = alspec_tiny
    lm.model.reset_prefix_cache()
    with speculating(lm, lam=0.0, window=WINDOW, **SNAPKV):
        _, calibration = ratios_of(lm, monkeypatch)
    measured = torch.cat(calibration)
    lam = float(measured[~measured.isnan()].median()) * 1.0001
    with speculating(lm, lam=lam, window=WINDOW, **SNAPKV):
        lm.model.reset_prefix_cache()
        lm.reset_statistics()
        alone = ratios_of(lm, monkeypatch)
        alone_stats = lm.statistics()["tasks"]
    lm.model.reset_prefix_cache()
    with speculating(lm, lam=0.0, window=WINDOW):  # the baseline cell: every prompt block now in the prefix cache
        lm.generate_until([Instance("generate_until", {}, (p, dict(GEN_KWARGS)), i, ("gen", i, 1))
                           for i, p in enumerate(PROMPTS)])
    with speculating(lm, lam=lam, window=WINDOW, **SNAPKV):
        lm.reset_statistics()
        after = ratios_of(lm, monkeypatch)
        after_stats = lm.statistics()["tasks"]
    assert after[0] == alone[0]
    assert [len(t) for t in after[1]] == [len(t) for t in alone[1]]
    for a, b in zip(after[1], alone[1]):
        assert torch.equal(a.nan_to_num(-1), b.nan_to_num(-1))
    assert after_stats == alone_stats
    total = after_stats["gen"]["total"]
    assert 0 < total["accepted"] < total["speculated"], total


@pytest.mark.parametrize("draft", ["BeforeContext", "PastQuery"])
def test_a_draft_whose_ranges_leave_the_context_is_refused_in_one_line(alspec_tiny, draft):
    """Users' drafts on local (tests/bounds_drafts.py) whose position_ranges lie 100,000 positions before the
    context (the CPU kernel's SIGSEGV, which vLLM reported as EngineDeadError) or run 4,096 past the query (read the
    cache past it, and results were written): the engine reads them cut to [0, pos] and lives on, and the driver
    refuses the call in one line naming the draft and a position it decided, before any statistics are kept."""
    from alspec_eval.bounds import DraftOutOfBounds

    prompt, new = PROMPTS[0][:100], 4
    kwargs = {"until": ["\n\n"], "max_gen_toks": new, "do_sample": False}
    with speculating(alspec_tiny, lam=0.1, window=16, approx=f"bounds_drafts:{draft}"):
        with pytest.raises(DraftOutOfBounds) as refused:
            alspec_tiny.generate_until([Instance("generate_until", {}, (prompt, dict(kwargs)), 0, ("refused", 0, 1))])
    message, length = str(refused.value), len(alspec_tiny.tok_encode(prompt))
    assert "\n" not in message and message.startswith(f"approx=bounds_drafts:{draft} read keys outside [0, pos]")
    assert length <= int(re.search(r"at position (\d+) ", message)[1]) < length + new - 1  # a generated token fed back
    assert "refused" not in alspec_tiny.statistics()["tasks"]
    assert alspec_tiny.generate_until([Instance("generate_until", {}, (prompt, dict(kwargs)), 0, ("alive", 0, 1))])


def test_a_prompt_seen_again_is_not_observed_again_and_its_window_comes_from_the_prefix_cache(alspec_tiny, monkeypatch):
    """SnapKV's prompts in a later call with the same draft, another draft's settings between them (as a sweep's
    cells): every worker holds their observations, so the driver lets the prefix cache serve their observation
    windows (more tokens cached than in the first call) and the decisions are the first call's, d/n for d/n. Under
    another draft the workers hold none of them."""
    lm = alspec_tiny
    draft = {"approx": "snapkv", "approx_args": "observe:200;pool:3;recent:9"}  # this test's own: nothing kept yet
    cached: list[list[int]] = []
    generate = lm.model.generate

    def counted(*args, **kwargs):
        outputs = generate(*args, **kwargs)
        cached.append([o.num_cached_tokens for o in outputs])
        return outputs

    lm.model.reset_prefix_cache()
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(lm.model, "generate", counted)
        with speculating(lm, lam=0.0, window=WINDOW):  # a baseline cell: every prompt block cached, exact
            lm.generate_until([Instance("generate_until", {}, (p, dict(GEN_KWARGS)), i, ("gen", i, 1))
                               for i, p in enumerate(PROMPTS)])
        with speculating(lm, lam=0.0, window=WINDOW, **draft):
            assert lm._observed == set()  # nothing observed under this draft yet
            first = ratios_of(lm, monkeypatch)
            held = set(lm._observed)
        with speculating(lm, lam=0.0, window=WINDOW, approx="snapkv", approx_args="observe:100;pool:3;recent:9"):
            assert lm._observed == set()  # another draft's observations: none held
        with speculating(lm, lam=0.0, window=WINDOW, **draft):
            assert lm._observed == held and len(held) == len(PROMPTS)
            second = ratios_of(lm, monkeypatch)
    assert second[0] == first[0] and [len(t) for t in second[1]] == [len(t) for t in first[1]]
    for a, b in zip(second[1], first[1]):
        assert torch.equal(a.nan_to_num(-1), b.nan_to_num(-1))
    assert all(again > before for before, again in zip(cached[1], cached[2])), cached
