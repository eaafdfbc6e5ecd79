"""vLLM's FLASH_ATTN, speculating."""

from vllm.v1.attention.backends.flash_attn import (FlashAttentionBackend, FlashAttentionImpl,
                                                   FlashAttentionMetadataBuilder)

from ..backend import SpeculatingImpl
from . import SpeculatingBuilder, Speculating


class ALSpecFlashAttentionImpl(SpeculatingImpl, FlashAttentionImpl):
    pass


class ALSpecFlashAttentionMetadataBuilder(SpeculatingBuilder, FlashAttentionMetadataBuilder):
    pass


class ALSpecFlashAttentionBackend(Speculating, FlashAttentionBackend):
    impl, builder = ALSpecFlashAttentionImpl, ALSpecFlashAttentionMetadataBuilder
