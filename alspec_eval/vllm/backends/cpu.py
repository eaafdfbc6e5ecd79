"""vLLM's CPU_ATTN, speculating."""

from vllm.v1.attention.backends.cpu_attn import (CPUAttentionBackend, CPUAttentionBackendImpl,
                                                 CPUAttentionMetadataBuilder)

from ..backend import SpeculatingImpl
from . import NoFullGraphs, Speculating


class ALSpecCPUAttentionImpl(SpeculatingImpl, CPUAttentionBackendImpl):
    pass


class ALSpecCPUAttentionMetadataBuilder(NoFullGraphs, CPUAttentionMetadataBuilder):
    pass


class ALSpecCPUAttentionBackend(Speculating, CPUAttentionBackend):
    impl, builder = ALSpecCPUAttentionImpl, ALSpecCPUAttentionMetadataBuilder
