"""The registered approximations by name: a leaf (torch-free, importing nothing of the package but the lazy registry),
so that an approximation finds its own name here and the registry (registry.py) the classes, with no import
between them at run time. The registry's order is the reports' order.
"""

from __future__ import annotations

from ..lazy import LazyRegistry, path_of

APPROXIMATIONS = LazyRegistry("approximation", {
    "sink": "alspec_eval.approximations.sink:Sink",
    "local": "alspec_eval.approximations.local:Local",
    "quest": "alspec_eval.approximations.quest:Quest",
    "topk": "alspec_eval.approximations.topk:TopK",
    "snapkv": "alspec_eval.approximations.snapkv:SnapKV",
    "vattention": "alspec_eval.approximations.vattention:VAttention",
})
# The default approximation, named here only: the paper's sink windows. Its rows keep the paper's names ("lambda_0.1",
# "sink": Approximation.is_default); every other name of it (config, cells, CLIs) is this constant.
DEFAULT = "sink"
# Families: ``approx=family:member`` asks the family's factory for member's class (``kvpress:SnapKVPress``).
FAMILIES: dict[str, str] = {"kvpress": "alspec_eval.approximations.kvpress:press_draft"}


def name_of(cls: type) -> str:
    """The name that makes ``cls`` again: its family's name for it, its registered name, else its ``module:Class``
    path."""
    return getattr(cls, "family_name", None) or APPROXIMATIONS.name_of(cls) or path_of(cls)
