"""vLLM's FLEX_ATTENTION, speculating."""

from vllm.v1.attention.backends.flex_attention import (FlexAttentionBackend, FlexAttentionImpl,
                                                       FlexAttentionMetadataBuilder)

from ..backend import SpeculatingImpl
from . import NoFullGraphs, Speculating


class ALSpecFlexAttentionImpl(SpeculatingImpl, FlexAttentionImpl):
    pass


class ALSpecFlexAttentionMetadataBuilder(NoFullGraphs, FlexAttentionMetadataBuilder):
    pass


class ALSpecFlexAttentionBackend(Speculating, FlexAttentionBackend):
    impl, builder = ALSpecFlexAttentionImpl, ALSpecFlexAttentionMetadataBuilder
