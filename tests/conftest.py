"""Without CUDA, Triton kernels run in Triton's CPU interpreter (read when a kernel is first built)."""

import os
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


# The fast tier, `pytest -m "not slow"` (about a minute): the rules, kernels, report and config. Every other test
# loads a model, runs lm-eval or starts a process, and is marked slow here; the README's test command runs all.
FAST = ("test_semantics.py", "test_config.py", "test_rows.py", "test_ledger.py", "test_tt_golden.py", "kernels/",
        "report/", "niah/test_generator.py", "niah/test_scoring.py")
TESTS = Path(__file__).parent


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if not item.path.relative_to(TESTS).as_posix().startswith(FAST):
            item.add_marker(pytest.mark.slow)
