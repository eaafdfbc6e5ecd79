"""Named classes registered the way lm-eval registers its models: a class, or lazily its ``"module:Class"`` path, so
that naming one imports nothing of the others until it is used. The backends and the approximations each keep one.
Torch-free and a leaf (it imports nothing of the package): the lm-eval hook imports it at every interpreter start.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterator


def path_of(cls: type | str) -> str:
    """``"module:Class"`` of a class (a path stays itself)."""
    return cls if isinstance(cls, str) else f"{cls.__module__}:{cls.__qualname__}"


def import_path(path: str) -> object:
    """What ``"module:attr"`` names, imported."""
    module, _, attr = path.partition(":")
    return getattr(importlib.import_module(module), attr)


class LazyRegistry:
    """Name -> class or its path, in registration order; a path is imported on first :meth:`load` and kept."""

    def __init__(self, kind: str, entries: dict[str, type | str]) -> None:
        self.kind = kind
        self._entries: dict[str, type | str] = dict(entries)

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def register(self, name: str, target: type | str) -> None:
        """Make ``name`` load ``target``; a name already taken by another class is refused."""
        known = self._entries.get(name)
        if known is not None and path_of(known) != path_of(target):
            raise ValueError(f"{self.kind} {name!r} is already registered as {path_of(known)}")
        self._entries[name] = target

    def get(self, name: str) -> type | str | None:
        """The class or path registered as ``name`` (None if none), nothing imported."""
        return self._entries.get(name)

    def load(self, name: str) -> type:
        """The class registered as ``name``, imported on first use."""
        found = self._entries[name]
        if isinstance(found, str):
            found = self._entries[name] = import_path(found)
        return found

    def name_of(self, cls: type) -> str | None:
        """The name ``cls`` is registered under (by its path: a registered path need not be imported), else None."""
        path = path_of(cls)
        return next((name for name, known in self._entries.items() if path_of(known) == path), None)
