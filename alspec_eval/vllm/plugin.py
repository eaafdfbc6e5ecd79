"""The ``vllm.general_plugins`` entry point: vLLM loads it in the driver, the engine core and every worker before the
model is built. Only an engine that alspec-vllm starts (``ENGINE_FLAG`` in the environment it spawns with) gets the
speculating backend; a plain ``--model vllm`` in the same environment is untouched."""

from __future__ import annotations

import os
from typing import Any

ENGINE_FLAG = "ALSPEC_VLLM_ENGINE"


def register() -> None:
    """Wrap the platform's attention backend choice, whatever it chooses (the CPU platform ignores
    ``attention_backend`` and always picks CPU_ATTN, so the wrapper sits on the platform's own selector), and key
    speculated blocks in the prefix cache by their rules (:mod:`.prefix_cache`)."""
    if os.environ.get(ENGINE_FLAG) != "1":
        return
    from .prefix_cache import install

    install()
    from vllm.platforms import current_platform

    platform = type(current_platform)
    chooser = platform.get_attn_backend_cls
    if getattr(chooser, "_alspec", False):
        return

    def get_attn_backend_cls(cls: type, *args: Any, **kwargs: Any) -> str:
        from .backend import wrap_backend

        return wrap_backend(chooser(*args, **kwargs))

    get_attn_backend_cls._alspec = True  # type: ignore[attr-defined]
    platform.get_attn_backend_cls = classmethod(get_attn_backend_cls)
