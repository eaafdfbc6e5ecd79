"""vLLM's TRITON_ATTN, speculating."""

from vllm.v1.attention.backends.triton_attn import (TritonAttentionBackend, TritonAttentionImpl,
                                                    TritonAttentionMetadataBuilder)

from ..backend import SpeculatingImpl
from . import NoFullGraphs, Speculating


class ALSpecTritonAttentionImpl(SpeculatingImpl, TritonAttentionImpl):
    pass


class ALSpecTritonAttentionMetadataBuilder(NoFullGraphs, TritonAttentionMetadataBuilder):
    pass


class ALSpecTritonAttentionBackend(Speculating, TritonAttentionBackend):
    impl, builder = ALSpecTritonAttentionImpl, ALSpecTritonAttentionMetadataBuilder
