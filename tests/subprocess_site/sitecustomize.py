"""lm-eval's task index, built once per test session and shared by every process of it.

Every ``TaskManager`` indexes lm-eval's ~15,000 task files (10-12 s on a 2-core CPU), and the tests make hundreds of
them: each ``simple_evaluate`` without a task manager, each sweep, each ``lm_eval`` or ``alspec-*`` process they
start. The index depends only on the files, so ``TaskIndex.build`` is memoized here: in memory, and in the pickle
file named by ``ALSPEC_TEST_TASK_INDEX`` for the session's other processes. Each caller gets its own copy of the
mapping (lm-eval's factory adds namespaced entries to it). The key names each folder and, except lm-eval's own
installed one, its YAML files with their sizes and modification times, so a test that writes or edits a task folder
gets a fresh index.

``tests/conftest.py`` sets the variable and puts this folder on ``PYTHONPATH``, so the processes that tests start
import this module at interpreter start (Python's ``sitecustomize``). It patches nothing until lm-eval's index
module is imported, and nothing at all without the variable.
"""

from __future__ import annotations

import os
import pickle
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

ENV = "ALSPEC_TEST_TASK_INDEX"
_memory: dict[tuple, dict[str, Any]] = {}
_installed = False


def _key(paths: list[Path], resolve_includes: bool, own: Path) -> tuple:
    def files(root: Path) -> tuple:
        if root.resolve() == own:
            return ()
        return tuple(sorted((str(p), p.stat().st_mtime_ns, p.stat().st_size) for p in root.glob("**/*.yaml")))

    return tuple((str(p), files(p)) for p in paths), resolve_includes


def _stored(file: Path) -> dict[tuple, dict[str, Any]]:
    try:
        return pickle.loads(file.read_bytes())
    except (OSError, EOFError, pickle.UnpicklingError):
        return {}


def memoize(module: ModuleType) -> None:
    """Make ``module.TaskIndex.build`` (``lm_eval.tasks._index``) look each index up before it builds one."""
    build = module.TaskIndex.build
    if getattr(build, "memoized", False):
        return
    own = Path(module.__file__).parent.resolve()
    file = Path(os.environ[ENV])

    def cached_build(paths, *, resolve_includes=True):
        paths = [Path(p) for p in paths]
        key = _key(paths, resolve_includes, own)
        if key not in _memory:
            _memory.update(_stored(file))
        if key not in _memory:
            _memory[key] = build(paths, resolve_includes=resolve_includes)
            stored = {**_stored(file), key: _memory[key]}
            partial = file.with_name(f"{file.name}.{os.getpid()}")
            partial.write_bytes(pickle.dumps(stored))
            os.replace(partial, file)  # whole, for the processes reading it at the same time
        return dict(_memory[key])

    cached_build.memoized = True
    module.TaskIndex.build = staticmethod(cached_build)


def install() -> None:
    """Memoize lm-eval's index now if it is imported, else when it is; only under the variable, and once."""
    global _installed
    if _installed or not os.environ.get(ENV):
        return
    _installed = True
    if "lm_eval.tasks._index" in sys.modules:
        memoize(sys.modules["lm_eval.tasks._index"])
        return
    try:
        from alspec_eval._lmeval_hook import _PatchOnImport
    except ImportError:  # a process of another Python (a fresh venv in a packaging test)
        return
    sys.meta_path.insert(0, _PatchOnImport({"lm_eval.tasks._index": memoize}))


install()
