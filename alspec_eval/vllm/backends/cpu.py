"""vLLM's CPU_ATTN, speculating."""

from vllm.v1.attention.backends.cpu_attn import (CPUAttentionBackend, CPUAttentionBackendImpl,
                                                 CPUAttentionMetadataBuilder)

from ..backend import SpeculatingImpl
from . import SpeculatingBuilder, Speculating


class ALSpecCPUAttentionImpl(SpeculatingImpl, CPUAttentionBackendImpl):
    pass


class ALSpecCPUAttentionMetadataBuilder(SpeculatingBuilder, CPUAttentionMetadataBuilder):
    pass


class ALSpecCPUAttentionBackend(Speculating, CPUAttentionBackend):
    impl, builder = ALSpecCPUAttentionImpl, ALSpecCPUAttentionMetadataBuilder
