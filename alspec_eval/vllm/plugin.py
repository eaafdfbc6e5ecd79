"""The ``vllm.general_plugins`` entry point: vLLM loads it in the driver, the engine core and every worker before the
model is built. Only an engine that alspec-vllm starts (``ENGINE_FLAG`` in the environment it spawns with) gets the
speculating backends; a plain ``--model vllm`` in the same environment is untouched."""

from __future__ import annotations

import os

ENGINE_FLAG = "ALSPEC_VLLM_ENGINE"


def register() -> None:
    """Register each speculating backend (:mod:`.backends`, listed in :data:`.paged.BACKENDS`) over the name of the
    backend it wraps, with vLLM's ``register_backend``: whichever of them the platform chooses (the CPU platform
    always CPU_ATTN) then speculates. And key speculated blocks in the prefix cache by their rules
    (:mod:`.prefix_cache`)."""
    if os.environ.get(ENGINE_FLAG) != "1":
        return
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    from . import backends
    from .paged import BACKENDS
    from .prefix_cache import install

    install()
    for name, wrapped in BACKENDS.items():
        register_backend(AttentionBackendEnum[name], f"{backends.__name__}.{wrapped.wrapper}")
