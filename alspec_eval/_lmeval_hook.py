"""Plugs alspec-eval into the stock `lm_eval` command; imported by a `.pth` line at interpreter start.

lm-eval 0.4.13 has no plugin discovery (no entry points for models or task folders, no
environment variable for include paths), so this hook
- registers `--model alspec` as a lazy `module:Class` placeholder. `lm_eval.models` is
  imported first: `get_model` fills the registry with the built-in names only while it
  is empty, so registering into an empty registry would hide `--model hf`;
- adds the bundled task folder to every `TaskManager`, so the stock `lm_eval --tasks
  alspec_recall` works without `--include_path` (this project's own calls pass
  `include_path` themselves);
- wraps the `lm_eval run` command and lm-eval's results writer (`lm_eval_cli`): one-line
  errors and argument checks before the model loads, the statistics sidecar beside the
  results file.
Each module is patched when it is first imported: lm-eval's task and CLI modules import
`datasets` and more (0.6 s), too slow for every interpreter start.

It must stay cheap (no torch) and silent when lm-eval is absent.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import inspect
import sys
from pathlib import Path
from collections.abc import Callable
from types import ModuleType



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
        ours = tasks_dir()
        bound.arguments["include_path"] = [ours, *(p for p in user if Path(p) != ours)]
        init(*bound.args, **bound.kwargs)

    __init__._alspec = True
    cls.__init__ = __init__


def _patches() -> dict[str, Callable[[ModuleType], None]]:
    """lm-eval module -> what to do to it once it is imported."""
    from . import lm_eval_cli

    return {"lm_eval.tasks.manager": add_task_path, "lm_eval._cli.run": lm_eval_cli.patch_run_command,
            "lm_eval.loggers.evaluation_tracker": lm_eval_cli.patch_tracker}


class _PatchOnImport(importlib.abc.MetaPathFinder):
    """Runs a module's patch right after the module's own code, the first time it is imported."""

    def __init__(self, patches: dict[str, Callable[[ModuleType], None]]) -> None:
        self.patches = patches

    def find_spec(self, name: str, path, target=None):  # noqa: ANN001
        patch = self.patches.pop(name, None)
        if patch is None:
            return None
        if not self.patches:
            sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        if spec is None or not isinstance(spec.loader, importlib.machinery.SourceFileLoader):
            return spec
        exec_module = spec.loader.exec_module

        def exec_and_patch(module: ModuleType) -> None:
            exec_module(module)
            patch(module)

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
        pending = {}
        for name, patch in _patches().items():
            if name in sys.modules:
                patch(sys.modules[name])
            else:
                pending[name] = patch
        if pending:
            sys.meta_path.insert(0, _PatchOnImport(pending))
    except Exception:
        pass


plug_in()
