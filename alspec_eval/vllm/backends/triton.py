"""vLLM's TRITON_ATTN, speculating."""

from vllm.v1.attention.backends.triton_attn import (TritonAttentionBackend, TritonAttentionImpl,
                                                    TritonAttentionMetadataBuilder)

from ..backend import SpeculatingImpl
from . import SpeculatingBuilder, Speculating


class ALSpecTritonAttentionImpl(SpeculatingImpl, TritonAttentionImpl):
    pass


class ALSpecTritonAttentionMetadataBuilder(SpeculatingBuilder, TritonAttentionMetadataBuilder):
    pass


class ALSpecTritonAttentionBackend(Speculating, TritonAttentionBackend):
    impl, builder = ALSpecTritonAttentionImpl, ALSpecTritonAttentionMetadataBuilder
