"""The speculating backends, one small module per vLLM backend it wraps (each imports only its own, so a platform
never imports another's): each is that backend with :class:`~..backend.SpeculatingImpl` before its impl and
:class:`SpeculatingBuilder` before its metadata builder (:class:`Speculating`), registered over the backend's own
name by :mod:`..plugin` in the engines alspec-vllm starts."""

from __future__ import annotations

from typing import Any

from vllm.v1.attention.backend import AttentionCGSupport

from ..backend import SpeculatingImpl, WorkerState

class SpeculatingBuilder:
    """Before a metadata builder: the step's speculating rows built once per step, where vLLM builds the step's
    attention metadata, from its ``CommonAttentionMetadata`` (:meth:`.backend.WorkerState.step`), and attached to
    the metadata every layer of the step receives (``alspec``). The worker's state is the one the worker extension
    handed its layers' impls, found as vLLM's own builders find their layers (``get_layers_from_vllm_config``). No
    full CUDA-graph capture of the speculating attention, whose Python runs every step (piecewise graphs leave
    attention out of the graph, so nothing stale is replayed)."""

    _cudagraph_support = AttentionCGSupport.NEVER

    @classmethod
    def get_cudagraph_support(cls, *args: Any, **kwargs: Any) -> AttentionCGSupport:
        return AttentionCGSupport.NEVER

    def build(self, common_prefix_len: int, common_attn_metadata: Any, *args: Any, **kwargs: Any) -> Any:
        metadata = super().build(common_prefix_len, common_attn_metadata, *args, **kwargs)  # type: ignore[misc]
        state = self._alspec_state()
        metadata.alspec = state.step(common_attn_metadata) if state is not None else None
        return metadata

    def _alspec_state(self) -> WorkerState | None:
        """The worker's state, from the impl of the first of this builder's layers (None before the driver
        configures the worker)."""
        from vllm.config import get_layers_from_vllm_config
        from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase

        first = self.layer_names[:1]  # type: ignore[attr-defined]
        layers = get_layers_from_vllm_config(self.vllm_config, AttentionLayerBase, first)  # type: ignore[attr-defined]
        impl = next((getattr(layer, "impl", None) for layer in layers.values()), None)
        return impl.alspec_state if isinstance(impl, SpeculatingImpl) else None


class Speculating:
    """Before a backend class: its impl and builder are the speculating ones the subclass names."""

    impl: type
    builder: type

    @classmethod
    def get_impl_cls(cls) -> type:
        return cls.impl

    @classmethod
    def get_builder_cls(cls) -> type:
        return cls.builder
