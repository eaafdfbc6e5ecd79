"""The backends behind ``--model alspec``, by name: ``sim`` simulates speculative attention in torch, ``tt`` runs it
through ttnn. A backend is a class with three steps around the model's load (its settings and environment checked
before anything loads, the model's config checked before the weights load, its speculator installed into the
loaded model); the adapter calls them and knows no backend by name. Registered like lm-eval's models, lazily
(``"module:Class"``), so choosing one imports nothing of another.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ..lazy import LazyRegistry

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedModel

    from ..config import SpeculationConfig
    from ..speculator import Speculator

BACKENDS = LazyRegistry("backend", {"sim": "alspec_eval.backends.sim:SimBackend", "tt": "alspec_eval.backends.tt:TTBackend"})


class Backend:
    """One model's backend. Constructing it checks the environment (before the model loads); subclasses override
    :meth:`check_model` where the config alone can refuse a model, and :meth:`install`."""

    def __init__(self, config: SpeculationConfig) -> None:
        self.config = config
        self.kernel_line = ""  # which decode kernel runs and why, for the results (set by install)

    def check_model(self, model_config: Any, batch_size: int | None, device: torch.device | None = None,
                    dtype: torch.dtype | None = None) -> None:
        """Refuse, from the model's config (before the weights load), what this backend cannot run on ``device``
        in ``dtype`` (None: the config's)."""

    def install(self, model: PreTrainedModel) -> Speculator:
        """Route the loaded model's attention through this backend's speculator."""
        raise NotImplementedError


def register_backend(name: str, target: str) -> None:
    """Make ``backend=name`` load ``target`` (``"package.module:Class"``, a :class:`Backend`)."""
    BACKENDS.register(name, target)


def load_backend(config: SpeculationConfig) -> Backend:
    """The backend ``config.backend`` names, its environment checked."""
    return BACKENDS.load(config.backend)(config)
