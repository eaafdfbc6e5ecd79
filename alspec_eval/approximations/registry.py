"""Names of approximations, the way lm-eval names models: built-ins registered lazily as ``module:Class``
strings (nothing imports torch until one is used), ``register_approximation`` for a user's class, the
``alspec_eval.approximations`` entry points of other packages, and ``approx=pkg.module:Class`` for a class that
is registered nowhere. The registry's order is the reports' order.
"""

from __future__ import annotations

import functools
from importlib.metadata import entry_points
from typing import Any

from ..errors import ConfigError
from ..lazy import import_path, path_of
from .base import Approximation, parse_args
from .catalog import APPROXIMATIONS, DEFAULT, FAMILIES

ENTRY_POINTS = "alspec_eval.approximations"


def register_approximation(name: str, cls: type[Approximation] | str) -> None:
    """Make ``approx=name`` run ``cls`` (a subclass of :class:`Approximation`, or its ``module:Class`` path)."""
    if not name or ":" in name:
        raise ValueError(f"approximation name {name!r}: use a plain name (a ':' means module:Class)")
    if not isinstance(cls, str) and not (isinstance(cls, type) and issubclass(cls, Approximation)):
        raise TypeError(f"register_approximation({name!r}, {cls!r}): not a subclass of Approximation")
    APPROXIMATIONS.register(name, cls)


def names() -> list[str]:
    """Every registered name and entry point, in the reports' order (built-ins first)."""
    return [*APPROXIMATIONS, *(ep.name for ep in entry_points(group=ENTRY_POINTS) if ep.name not in APPROXIMATIONS)]


def approximation_class(name: str) -> type[Approximation]:
    """The class ``approx=name`` runs: a registered name, an entry point, a family's member (``kvpress:Press``) or
    ``pkg.module:Class``."""
    family, sep, member = name.partition(":")
    if sep and family in FAMILIES:
        return import_path(FAMILIES[family])(member)
    if name in APPROXIMATIONS:
        try:
            cls = APPROXIMATIONS.load(name)
        except (ImportError, AttributeError) as err:
            raise ConfigError(f"approx={name!r}: cannot load {path_of(APPROXIMATIONS.get(name))} ({err}); give "
                              "pkg.module:Class of an installed module") from None
        return _checked(cls, path_of(cls), name)
    points = {ep.name: ep.value for ep in entry_points(group=ENTRY_POINTS)}
    found = points.get(name, name if ":" in name else None)
    if found is None:
        raise ConfigError(f"approx={name!r} is unknown; use one of {', '.join(names())}, kvpress:<Press> (a kvpress ScorerPress), or pkg.module:Class for "
                          "your own (a subclass of alspec_eval.Approximation)")
    return _load(found, name)


def make_approximation(name: str | Approximation, args: str | dict[str, Any] | None = None) -> Approximation:
    """The approximation ``approx=name`` with ``approx_args=args``; a bad name or argument is a ConfigError."""
    if isinstance(name, Approximation):
        if args not in (None, "", {}):
            raise ConfigError(f"approx_args={args!r} given beside an approximation object {name!r}; give one")
        return name
    cls = approximation_class(name)
    return cls(**parse_args(cls, name, args))


@functools.cache
def default_approximation() -> Approximation:
    """The approximation a row, a config or a cell runs without one: ``approx=DEFAULT`` (the sink windows), made once
    (an approximation object is immutable and shared; a registered name is never registered again)."""
    return make_approximation(DEFAULT)


def order(approx: Approximation, known: list[str] | None = None) -> tuple:
    """Sort key: registry order (``known``: :func:`names`, where a caller sorting many has it), then the
    parameters."""
    known = names() if known is None else known
    return (known.index(approx.name) if approx.name in known else len(known), approx.name, approx.slug)


def _load(path: str, name: str) -> type[Approximation]:
    try:
        cls = import_path(path)
    except (ImportError, AttributeError) as err:
        raise ConfigError(f"approx={name!r}: cannot load {path} ({err}); give pkg.module:Class of an installed "
                          "module") from None
    return _checked(cls, path, name)


def _checked(cls: object, path: str, name: str) -> type[Approximation]:
    """``cls`` if it is an approximation class, else the ConfigError that names ``path`` and the fix."""
    if not (isinstance(cls, type) and issubclass(cls, Approximation)):
        raise ConfigError(f"approx={name!r}: {path} is not a subclass of alspec_eval.Approximation; subclass it "
                          "(docs/design.md, Approximations)")
    return cls
