"""The speculating backends, one small module per vLLM backend it wraps (each imports only its own, so a platform
never imports another's): each is that backend with :class:`~..backend.SpeculatingImpl` before its impl and
:class:`SpeculatingBuilder` before its metadata builder (:class:`Speculating`), registered over the backend's own
name by :mod:`..plugin` in the engines alspec-vllm starts."""

from __future__ import annotations

from typing import Any

from vllm.v1.attention.backend import AttentionCGSupport

from ..backend import STATE

# the backend each module wraps, by vLLM's AttentionBackendEnum name: module, class
WRAPPED = {"CPU_ATTN": "cpu.ALSpecCPUAttentionBackend", "FLASH_ATTN": "flash.ALSpecFlashAttentionBackend",
           "TRITON_ATTN": "triton.ALSpecTritonAttentionBackend", "FLEX_ATTENTION": "flex.ALSpecFlexAttentionBackend"}


class SpeculatingBuilder:
    """Before a metadata builder: the step's speculating rows built once per step, where vLLM builds the step's
    attention metadata, from its ``CommonAttentionMetadata`` (:meth:`.backend.WorkerState.step`), and attached to
    the metadata every layer of the step receives (``alspec``). No full CUDA-graph capture of the speculating
    attention, whose Python runs every step (piecewise graphs leave attention out of the graph, so nothing stale is
    replayed)."""

    _cudagraph_support = AttentionCGSupport.NEVER

    @classmethod
    def get_cudagraph_support(cls, *args: Any, **kwargs: Any) -> AttentionCGSupport:
        return AttentionCGSupport.NEVER

    def build(self, common_prefix_len: int, common_attn_metadata: Any, *args: Any, **kwargs: Any) -> Any:
        metadata = super().build(common_prefix_len, common_attn_metadata, *args, **kwargs)  # type: ignore[misc]
        metadata.alspec = STATE.step(common_attn_metadata)
        return metadata


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
