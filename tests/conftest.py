"""The test tiers, and Triton's CPU interpreter where there is no CUDA.

A test that builds a model (``PreTrainedModel``), runs lm-eval's evaluator or starts a process is ``slow``: it says
so with ``pytest.mark.slow`` on itself or its module. The fast tier, ``pytest -m "not slow"``, is everything else
(the rules, kernels, report, configs and CLIs' argument checks). The guard below keeps the marks true: a test
without the mark that does one of those things fails, naming what it did, so a new test cannot slip a model into
the fast tier unnoticed. (Importing a module that defines models is fine; building one is not.) A test marked
``compiles`` may start ``python -m alspec_eval.kernels.triton_launch`` (which compiles for GPUs with Triton's
ptxas and cuobjdump) in the fast tier, and nothing else.
"""

from __future__ import annotations

import importlib
import multiprocessing.process
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

if not torch.cuda.is_available():  # read when a Triton kernel is first built
    os.environ.setdefault("TRITON_INTERPRET", "1")

SITE = Path(__file__).with_name("subprocess_site")
INDEX_ENV = "ALSPEC_TEST_TASK_INDEX"


def pytest_configure(config: pytest.Config) -> None:
    """lm-eval's task index once per session, for this process and every process it starts (xdist's workers, the
    ``lm_eval`` and ``alspec-*`` commands the tests run): ``subprocess_site/sitecustomize.py``."""
    if not os.environ.get(INDEX_ENV):  # the first process of the session (not an xdist worker) owns the file
        config._alspec_index_dir = tempfile.mkdtemp(prefix="alspec-task-index-")
        os.environ[INDEX_ENV] = os.path.join(config._alspec_index_dir, "index.pickle")
    if SITE.is_dir() and str(SITE) not in os.environ.get("PYTHONPATH", "").split(os.pathsep):  # not in pytester's
        os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(SITE), os.environ.get("PYTHONPATH")]))
        sys.path.insert(0, str(SITE))
    importlib.import_module("sitecustomize").install()
    if os.environ.get("PYTEST_XDIST_WORKER"):  # one of `pytest -n N`'s workers: one core each, not N x the cores
        torch.set_num_threads(1)
        os.environ["OMP_NUM_THREADS"] = "1"  # and the processes it starts


def pytest_unconfigure(config: pytest.Config) -> None:
    if getattr(config, "_alspec_index_dir", None):
        shutil.rmtree(config._alspec_index_dir, ignore_errors=True)


SLOW_BECAUSE = "builds a model, runs lm-eval or starts a process"


def _refusal(nodeid: str, what: str) -> Callable[..., Any]:
    def refuse(*_: Any, **__: Any) -> None:
        pytest.fail(f"{nodeid} {what} but is not marked slow: add @pytest.mark.slow (tests that {SLOW_BECAUSE} are "
                    "the slow tier; tests/conftest.py)", pytrace=False)
    return refuse


COMPILER = "alspec_eval.kernels.triton_launch"  # compiles for GPUs without one (Triton's ptxas, cuobjdump)


def _compiler_only(nodeid: str, popen: Callable[..., None]) -> Callable[..., None]:
    def start(self: subprocess.Popen, args: Any, *rest: Any, **kwargs: Any) -> None:
        if COMPILER not in list(args):
            _refusal(nodeid, f"starts {args} (a compiles test may start python -m {COMPILER} only)")()
        popen(self, args, *rest, **kwargs)
    return start


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Any:
    """Around a test not marked slow (its fixtures included): building a model, running lm-eval's evaluator or
    starting a process fails."""
    if item.get_closest_marker("slow") is not None:
        yield
        return
    with pytest.MonkeyPatch.context() as patch:
        if item.get_closest_marker("compiles") is None:
            patch.setattr(subprocess.Popen, "__init__", _refusal(item.nodeid, "starts a process"))
        else:
            patch.setattr(subprocess.Popen, "__init__", _compiler_only(item.nodeid, subprocess.Popen.__init__))
        patch.setattr(multiprocessing.process.BaseProcess, "start", _refusal(item.nodeid, "starts a process"))
        if "transformers" in sys.modules:  # every test module that builds a model has imported it by now
            from transformers import PreTrainedModel

            patch.setattr(PreTrainedModel, "__init__", _refusal(item.nodeid, "builds a model"))
        if "lm_eval.evaluator" in sys.modules:
            patch.setattr(sys.modules["lm_eval.evaluator"], "evaluate", _refusal(item.nodeid, "runs lm-eval"))
        yield
