"""Plugs alspec-eval into the stock `lm_eval` command; imported by a `.pth` line at interpreter start.

lm-eval 0.4.13 has no plugin discovery, so this hook
- registers `--model alspec` as a lazy `module:Class` placeholder. `lm_eval.models` is
  imported first: `get_model` fills the registry with the built-in names only while it
  is empty, so registering into an empty registry would hide `--model hf`;
- in the `lm_eval` console script only, prints a bad alspec setting as one line (`cli_errors`);
- adds the bundled task folder to every `TaskManager`, so `--tasks alspec_*` works
  without `--include_path`. lm-eval's task modules import `datasets` (0.6 s), too slow
  for every interpreter start, so TaskManager is patched when it is first imported.

It must stay cheap (no torch) and silent when lm-eval is absent.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import inspect
import sys
from pathlib import Path
from types import ModuleType

_MANAGER = "lm_eval.tasks.manager"


def tasks_dir() -> Path:
    """The installed `alspec_eval.tasks` folder (top-level `tasks/` in the source tree)."""
    spec = importlib.util.find_spec("alspec_eval.tasks")
    return Path(next(iter(spec.submodule_search_locations)))


def add_task_path(manager_module: ModuleType) -> None:
    """Make every TaskManager also scan the bundled tasks (user include paths still take precedence)."""
    cls = manager_module.TaskManager
    init = cls.__init__
    if getattr(init, "_alspec", False):
        return
    signature = inspect.signature(init)

    def __init__(self, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, N807
        bound = signature.bind(self, *args, **kwargs)
        user = bound.arguments.get("include_path")
        user = [] if user is None else list(user) if isinstance(user, (list, tuple)) else [user]
        bound.arguments["include_path"] = [tasks_dir(), *user]
        init(*bound.args, **bound.kwargs)

    __init__._alspec = True
    cls.__init__ = __init__


class _PatchTaskManagerOnImport(importlib.abc.MetaPathFinder):
    def find_spec(self, name: str, path, target=None):  # noqa: ANN001
        if name != _MANAGER:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        if spec is None or not isinstance(spec.loader, importlib.machinery.SourceFileLoader):
            return spec
        exec_module = spec.loader.exec_module

        def exec_and_patch(module: ModuleType) -> None:
            exec_module(module)
            add_task_path(module)

        spec.loader.exec_module = exec_and_patch
        return spec


def register_model(registry: object, name: str = "alspec", target: str = "alspec_eval.adapter:ALSpecLM") -> bool:
    """Register ``name`` lazily, whichever keyword this lm-eval's ``Registry.register`` takes for the
    placeholder (``target=`` in 0.4.13, ``lazy=`` in others); False where it takes neither."""
    if name in registry:
        return True
    params = inspect.signature(registry.register).parameters
    keyword = next((k for k in ("target", "lazy") if k in params), None)
    if keyword is None:
        return False
    registry.register(name, **{keyword: target})
    return True


def plug_in() -> None:
    """Everything the hook does; every step is guarded, since a failure here would break every interpreter."""
    try:
        import lm_eval.models  # noqa: F401  (registers the built-in names first)
        from lm_eval.api.registry import model_registry
    except Exception:  # lm-eval missing or broken: nothing to plug into
        return
    try:
        register_model(model_registry)
    except Exception:  # an lm-eval whose registry we do not know: `--model alspec` then says it is unknown
        pass
    try:
        if _MANAGER in sys.modules:
            add_task_path(sys.modules[_MANAGER])
        else:
            sys.meta_path.insert(0, _PatchTaskManagerOnImport())
    except Exception:
        pass
    try:
        from . import cli_errors

        cli_errors.install_in_lm_eval(sys.argv)
    except Exception:
        pass


plug_in()
