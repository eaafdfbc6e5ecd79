"""vLLM's FLEX_ATTENTION, speculating."""

from vllm.v1.attention.backends.flex_attention import (FlexAttentionBackend, FlexAttentionImpl,
                                                       FlexAttentionMetadataBuilder)

from ..backend import SpeculatingImpl
from . import SpeculatingBuilder, Speculating


class ALSpecFlexAttentionImpl(SpeculatingImpl, FlexAttentionImpl):
    pass


class ALSpecFlexAttentionMetadataBuilder(SpeculatingBuilder, FlexAttentionMetadataBuilder):
    pass


class ALSpecFlexAttentionBackend(Speculating, FlexAttentionBackend):
    impl, builder = ALSpecFlexAttentionImpl, ALSpecFlexAttentionMetadataBuilder
