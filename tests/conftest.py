"""The test tiers, the tiny models tests share, and Triton's CPU interpreter where there is no CUDA.

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
import importlib.util
import multiprocessing.process
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
import torch

if TYPE_CHECKING:
    from transformers import PreTrainedModel

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
    _task_index_site().install()
    # matplotlib's font list, built once per machine with fc-list (a process, which a fast test may not start):
    # here, before any test, on a machine that has none yet
    importlib.import_module("matplotlib.font_manager")
    if os.environ.get("PYTEST_XDIST_WORKER"):  # one of `pytest -n N`'s workers: one core each, not N x the cores
        torch.set_num_threads(1)
        os.environ["OMP_NUM_THREADS"] = "1"  # and the processes it starts


def _task_index_site() -> Any:
    """Our ``sitecustomize``: the one Python imported at start, or, where the environment has its own (a CUDA image's
    ``sitecustomize`` comes before our folder joined ``sys.path``), ours loaded from its file."""
    site = importlib.import_module("sitecustomize")
    if hasattr(site, "install"):
        return site
    if "alspec_task_index_site" not in sys.modules:
        spec = importlib.util.spec_from_file_location("alspec_task_index_site", SITE / "sitecustomize.py")
        sys.modules[spec.name] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(sys.modules[spec.name])
    return sys.modules["alspec_task_index_site"]


def pytest_unconfigure(config: pytest.Config) -> None:
    if getattr(config, "_alspec_index_dir", None):
        shutil.rmtree(config._alspec_index_dir, ignore_errors=True)


@pytest.fixture(scope="session")
def model() -> PreTrainedModel:
    """The default tiny model (llama, float32, 3 layers, seed 0), built once per process: the tests that take it pass
    it to alspec_lm and hf_lm, which work on a copy, so it stays as built."""
    from alspec_eval.approx_check.models import tiny_model

    return tiny_model()


@pytest.fixture(scope="session")
def bf16_model() -> PreTrainedModel:
    """The same model in bfloat16 (the TT backend's tests), also only ever copied."""
    from alspec_eval.approx_check.models import tiny_model

    return tiny_model().to(torch.bfloat16)


SLOW_BECAUSE = "builds a model, runs lm-eval or starts a process"


def _refusal(nodeid: str, what: str) -> Callable[..., Any]:
    def refuse(*_: Any, **__: Any) -> None:
        pytest.fail(f"{nodeid} {what} but is not marked slow: add @pytest.mark.slow (tests that {SLOW_BECAUSE} are "
                    "the slow tier; tests/conftest.py)", pytrace=False)
    return refuse


COMPILER = "alspec_eval.kernels.triton_launch"  # compiles for GPUs without one (Triton's ptxas, cuobjdump)


def _triton_process(args: Any) -> bool:
    """Whether this is one of Triton's compiler processes: on a GPU its JIT runs ptxas and builds its launcher with
    the C compiler in any test that launches a kernel, and kernel=auto reads a compiled kernel's resources with
    Triton's cuobjdump."""
    spec = importlib.util.find_spec("triton") if "triton" in sys.modules else None
    tool = str(args[0] if isinstance(args, (list, tuple)) else args)
    if spec is not None and spec.submodule_search_locations and any(
            tool.startswith(folder) for folder in spec.submodule_search_locations):
        return True
    frame = sys._getframe(2)
    while frame is not None:
        if f"{os.sep}triton{os.sep}" in frame.f_code.co_filename:
            return True
        frame = frame.f_back
    return False


NATIVE = os.path.join("alspec_eval", "vllm", "native.py")  # builds the CPU verification kernel, once per machine


def _native_build() -> bool:
    """Whether alspec_eval.vllm.native is building its C kernel (the C compiler, well under a second, once)."""
    frame = sys._getframe(2)
    while frame is not None:
        if frame.f_code.co_filename.endswith(NATIVE):
            return True
        frame = frame.f_back
    return False


def _processes_refused(nodeid: str, popen: Callable[..., None], compiles: bool, lints: bool) -> Callable[..., None]:
    """Popen.__init__ for a fast test: Triton's compiler processes, the CPU verification kernel's build, a compiles
    test's python -m COMPILER, a lints test's ruff, and nothing else."""
    def start(self: subprocess.Popen, args: Any, *rest: Any, **kwargs: Any) -> None:
        if lints and os.path.basename(str(list(args)[0])).startswith("ruff"):
            pass
        elif not _triton_process(args) and not _native_build():
            if not compiles:
                _refusal(nodeid, "starts a process")()
            elif COMPILER not in list(args):
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
        compiles = item.get_closest_marker("compiles") is not None
        lints = item.get_closest_marker("lints") is not None
        patch.setattr(subprocess.Popen, "__init__",
                      _processes_refused(item.nodeid, subprocess.Popen.__init__, compiles, lints))
        patch.setattr(multiprocessing.process.BaseProcess, "start", _refusal(item.nodeid, "starts a process"))
        if "transformers" in sys.modules:  # every test module that builds a model has imported it by now
            from transformers import PreTrainedModel

            patch.setattr(PreTrainedModel, "__init__", _refusal(item.nodeid, "builds a model"))
        if "lm_eval.evaluator" in sys.modules:
            patch.setattr(sys.modules["lm_eval.evaluator"], "evaluate", _refusal(item.nodeid, "runs lm-eval"))
        yield
