"""The fast tier tells the truth: a test not marked slow that builds a model or starts a process fails, naming it."""

from __future__ import annotations

from pathlib import Path

import pytest
from transformers import LlamaForCausalLM  # noqa: F401  (imported once here: the in-process runs keep it)

pytestmark = pytest.mark.slow  # the inner runs build a model

INNER = '''
import subprocess, sys
import pytest
import transformers


def build():
    transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=16, hidden_size=8, intermediate_size=8, num_hidden_layers=1, num_attention_heads=2))


def test_builds_unmarked():
    build()


@pytest.mark.slow
def test_builds_marked():
    build()


def test_starts_a_process_unmarked():
    subprocess.run([sys.executable, "-c", "pass"], check=True)


def test_pure():
    assert sum(range(4)) == 6
'''


def test_unmarked_heavy_tests_fail_and_marked_ones_run(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch):
    pytester.makeconftest((Path(__file__).parent / "conftest.py").read_text())
    pytester.makepyfile(test_inner=INNER)
    pytester.makeini("[pytest]\nmarkers =\n    slow: heavy\n")
    # The outer run's own guard does not apply to this test (it is marked slow), so the inner guard alone decides.
    result = pytester.runpytest_inprocess("-p", "no:cacheprovider")
    result.assert_outcomes(passed=2, failed=2)
    result.stdout.fnmatch_lines(["*test_builds_unmarked builds a model but is not marked slow*",
                                 "*test_starts_a_process_unmarked starts a process but is not marked slow*"])
    fast = pytester.runpytest_inprocess("-p", "no:cacheprovider", "-m", "not slow", "-k", "pure")
    fast.assert_outcomes(passed=1)
