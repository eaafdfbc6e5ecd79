"""Names of approximations, the way lm-eval names models: built-ins registered lazily as ``module:Class``
strings (nothing imports torch until one is used), ``register_approximation`` for a user's class, the
``alspec_eval.approximations`` entry points of other packages, and ``approx=pkg.module:Class`` for a class that
is registered nowhere. The registry's order is the reports' order.
"""

from __future__ import annotations

import importlib
from importlib.metadata import entry_points
from typing import Any

from ..errors import ConfigError
from .base import Approximation, parse_args

ENTRY_POINTS = "alspec_eval.approximations"
_REGISTRY: dict[str, type[Approximation] | str] = {
    "sink": "alspec_eval.approximations.sink:Sink",
    "local": "alspec_eval.approximations.local:Local",
    "quest": "alspec_eval.approximations.quest:Quest",
    "topk": "alspec_eval.approximations.topk:TopK",
    "snapkv": "alspec_eval.approximations.snapkv:SnapKV",
}
# Families: ``approx=family:member`` asks the family's factory for member's class (``kvpress:SnapKVPress``).
_FAMILIES: dict[str, str] = {"kvpress": "alspec_eval.approximations.kvpress:press_draft"}


def register_approximation(name: str, cls: type[Approximation] | str) -> None:
    """Make ``approx=name`` run ``cls`` (a subclass of :class:`Approximation`, or its ``module:Class`` path)."""
    if not name or ":" in name:
        raise ValueError(f"approximation name {name!r}: use a plain name (a ':' means module:Class)")
    if not isinstance(cls, str) and not (isinstance(cls, type) and issubclass(cls, Approximation)):
        raise TypeError(f"register_approximation({name!r}, {cls!r}): not a subclass of Approximation")
    known = _REGISTRY.get(name)
    if known is not None and _path(known) != _path(cls):
        raise ValueError(f"approximation {name!r} is already registered as {_path(known)}")
    _REGISTRY[name] = cls


def names() -> list[str]:
    """Every registered name and entry point, in the reports' order (built-ins first)."""
    return [*_REGISTRY, *(ep.name for ep in entry_points(group=ENTRY_POINTS) if ep.name not in _REGISTRY)]


def approximation_class(name: str) -> type[Approximation]:
    """The class ``approx=name`` runs: a registered name, an entry point, a family's member (``kvpress:Press``) or
    ``pkg.module:Class``."""
    family, sep, member = name.partition(":")
    if sep and family in _FAMILIES:
        module, _, attr = _FAMILIES[family].partition(":")
        return getattr(importlib.import_module(module), attr)(member)
    found = _REGISTRY.get(name)
    if found is None:
        points = {ep.name: ep.value for ep in entry_points(group=ENTRY_POINTS)}
        found = points.get(name, name if ":" in name else None)
    if found is None:
        raise ConfigError(f"approx={name!r} is unknown; use one of {', '.join(names())}, kvpress:<Press> (a kvpress ScorerPress), or pkg.module:Class for "
                          "your own (a subclass of alspec_eval.Approximation)")
    cls = _load(found, name) if isinstance(found, str) else found
    if name in _REGISTRY:
        _REGISTRY[name] = cls
    return cls


def make_approximation(name: str | Approximation, args: str | dict[str, Any] | None = None) -> Approximation:
    """The approximation ``approx=name`` with ``approx_args=args``; a bad name or argument is a ConfigError."""
    if isinstance(name, Approximation):
        if args not in (None, "", {}):
            raise ConfigError(f"approx_args={args!r} given beside an approximation object {name!r}; give one")
        return name
    cls = approximation_class(name)
    return cls(**parse_args(cls, name, args))


def name_of(cls: type[Approximation]) -> str:
    """The name that makes ``cls`` again: its family's name for it, its registered name, else its ``module:Class``
    path."""
    if cls.family_name:
        return cls.family_name
    path = _path(cls)
    return next((name for name, known in _REGISTRY.items() if _path(known) == path), path)


def order(approx: Approximation) -> tuple:
    """Sort key: registry order, then the parameters."""
    known = names()
    return (known.index(approx.name) if approx.name in known else len(known), approx.name, approx.slug)


def _path(cls: type | str) -> str:
    return cls if isinstance(cls, str) else f"{cls.__module__}:{cls.__qualname__}"


def _load(path: str, name: str) -> type[Approximation]:
    module, _, attr = path.partition(":")
    try:
        cls = getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as err:
        raise ConfigError(f"approx={name!r}: cannot load {path} ({err}); give pkg.module:Class of an installed "
                          "module") from None
    if not (isinstance(cls, type) and issubclass(cls, Approximation)):
        raise ConfigError(f"approx={name!r}: {path} is not a subclass of alspec_eval.Approximation; subclass it "
                          "(docs/design.md, Approximations)")
    return cls
