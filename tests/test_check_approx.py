"""alspec-check-approx: every registered approximation keeps the contract on the three families, a deliberately
broken one (broken_approximation.py) fails it with one line per broken property and exit status 1, and bad input is
one line with status 2 before any model is built."""

from __future__ import annotations

import os
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

from alspec_eval.approx_check.cli import check, holds_or_says_why
from alspec_eval.approximations import catalog as registered
from alspec_eval.config import SpeculationConfig
from default_approximations import APPROXIMATIONS, approx_args

pytestmark = pytest.mark.slow
TESTS = Path(__file__).parent


def _run(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, "-m", "alspec_eval.approx_check.cli", *args], capture_output=True,
                          text=True, env=env)


@pytest.mark.parametrize("name", APPROXIMATIONS)
def test_every_registered_approximation_keeps_the_contract(name, capsys):
    approx = SpeculationConfig(window=8, **approx_args(name, 8)).approx
    assert check(approx, 8, ["llama", "qwen2", "gemma2"])
    lines = capsys.readouterr().out.splitlines()[1:]
    assert len(lines) == 3 * 7 and all(line.endswith(": ok") for line in lines), lines
    assert sum("a paged cache (vLLM) selects as a contiguous one: ok" in line for line in lines) == 3


def test_an_engine_that_drops_the_weights_breaks_the_weights_property(monkeypatch, capsys):
    """The float64 recomputation of A~ from each selection's keys and weights: the HF engine with a weighted draft's
    log-weights dropped (its keys kept) computes another A~, and the property says so in its one line."""
    from alspec_eval import speculator
    from alspec_eval.approximations import selection

    monkeypatch.setattr(speculator, "selection", lambda approx, selected: (*selection(approx, selected)[:2], None))
    approx = SpeculationConfig(window=8, **approx_args("vattention", 8)).approx
    assert not check(approx, 8, ["llama"])
    broken = [line for line in capsys.readouterr().out.splitlines() if "BROKEN" in line]
    assert len(broken) == 1 and broken[0].startswith("llama: A~ attends to the selected keys with their weights: "
                                                     "BROKEN: A~ differs from the softmax"), broken


def test_a_draft_whose_generator_is_seeded_per_call_breaks_the_contract(monkeypatch, capsys):
    """vAttention with its draws from a generator seeded once per select call (a position's draws then depend on
    which positions the call holds, not on the position): teacher forcing no longer decodes as token by token, and
    the contract says so."""
    from alspec_eval.approximations import vattention

    def per_call(seed, request, layer, pos, heads, logical):
        shape = (len(pos), len(heads), logical.shape[-1])
        return torch.randint(0, 2**32, shape, generator=torch.Generator().manual_seed(seed))

    monkeypatch.setattr(vattention, "_priority", per_call)
    approx = SpeculationConfig(window=8, **approx_args("vattention", 8)).approx
    assert not check(approx, 8, ["llama"])
    broken = [line for line in capsys.readouterr().out.splitlines() if "BROKEN" in line]
    assert any(line.startswith("llama: teacher forcing") for line in broken), broken


def test_a_draft_whose_scored_selection_differs_breaks_the_paged_property(capsys):
    """A draft that ranks by scores selects through select_scored where the engine scores its keys in place (vLLM's
    CPU kernel): one whose select_scored ranks otherwise than its select breaks the paged property, in one line."""
    from dataclasses import dataclass

    from alspec_eval import semantics
    from alspec_eval.approximations.topk import TopK

    @dataclass(frozen=True)
    class ScoredOtherwise(TopK):
        def select(self, query, key, rows, pos, pad, window, passed, prepared):
            scores = semantics.key_scores(query, key.index_select(0, rows))
            return TopK.select_scored(self, scores, rows, pos, pad, window, passed, prepared)

        def select_scored(self, scores, *rest):
            return super().select_scored(-scores, *rest)  # the worst keys, where the engine scores them

    assert not check(ScoredOtherwise(), 8, ["llama"])
    broken = [line for line in capsys.readouterr().out.splitlines() if "BROKEN" in line]
    assert len(broken) == 1 and broken[0].startswith("llama: a paged cache (vLLM) selects as a contiguous one"), broken


def test_the_documented_example_keeps_the_contract(monkeypatch, capsys):
    """docs/design.md's own approximation, run as written: registered, made from approx_args, and it passes."""
    text = (TESTS.parent / "docs" / "design.md").read_text()
    code = text.split("## Approximations", 1)[1].split("```python\n", 1)[1].split("```", 1)[0]
    monkeypatch.setattr(registered.APPROXIMATIONS, "_entries", dict(registered.APPROXIMATIONS._entries))
    module = types.ModuleType("design_example")
    monkeypatch.setitem(sys.modules, module.__name__, module)
    exec(compile(code, "design.md", "exec"), module.__dict__)
    approx = SpeculationConfig(approx="strided", approx_args="stride:3", window=8).approx
    assert check(approx, 8, ["llama"]), capsys.readouterr().out


def test_a_broken_approximation_fails_with_one_line_per_broken_property():
    run = _run("broken_approximation:PeeksAhead", "--families", "llama,gemma2")
    assert run.returncode == 1, run.stderr
    broken = [line for line in run.stdout.splitlines() if ": BROKEN: " in line]
    refused = ": BROKEN: DraftOutOfBounds: approx=broken_approximation:PeeksAhead read keys outside [0, pos]"
    for family in ("llama", "gemma2"):  # the engine refuses every run that scores a continuation (it reads ahead)
        for prop in ("lambda 0 is --model hf", "teacher forcing is token-by-token decoding",
                     "batch size and left padding change nothing"):
            assert any(line.startswith(f"{family}: {prop}{refused}") for line in broken), (family, prop)
        assert f"{family}: position_ranges lie in [0, pos], none wider than its width: ok" in run.stdout
        assert any(line.startswith(f"{family}: never a future or padding key") and "a future key" in line
                   and "a key selected twice" in line for line in broken)
    assert "Traceback" not in run.stderr


def test_a_draft_of_2s_plus_1_keys_is_one_broken_line_not_a_traceback():
    """A user's draft of four sinks, the recent keys and one from the middle: the paged property reads its 2S + 1
    keys as the hf engine does (it used to end the run in a traceback), and the key rules break, in one line."""
    run = _run("bounds_drafts:OneMore", "--families", "llama")
    assert run.returncode == 1 and "Traceback" not in run.stderr, run.stderr
    assert [line for line in run.stdout.splitlines() if ": BROKEN: " in line] == [
        "llama: never a future or padding key, at most max_keys (2S) keys, none twice: BROKEN: more than max_keys = 16 "
        "keys: up to 17 per KV head"]
    assert "llama: a paged cache (vLLM) selects as a contiguous one: ok" in run.stdout


def test_a_property_the_draft_raises_in_is_one_broken_line():
    """Whatever a draft's code raises inside a property is that property's one line, whitespace folded."""
    def raises(contract):
        raise IndexError(f"index 40 is out of bounds\nfor dimension 2 of {contract}")

    assert holds_or_says_why(raises, "size 33") == ["IndexError: index 40 is out of bounds for dimension 2 of size 33"]
    assert holds_or_says_why(lambda contract: [contract], "broken") == ["broken"]


@pytest.mark.parametrize(("args", "message"), [
    (["snapkvv"], "alspec-check-approx: approx='snapkvv' is unknown"),
    (["quest", "--approx_args", "page:16"], "alspec-check-approx: approx_args page:16 does not divide"),
    (["sink", "--families", "llama,gpt2"], "alspec-check-approx: --families gpt2: unknown"),
])
def test_bad_input_is_one_line_and_status_2(args, message):
    run = _run(*args)
    assert run.returncode == 2 and run.stderr.startswith(message) and len(run.stderr.splitlines()) == 1, run.stderr
    assert run.stdout == ""
