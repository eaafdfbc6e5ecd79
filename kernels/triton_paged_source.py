"""The paged decode kernel's source (see :mod:`.triton_paged`), imported only where Triton is installed.

Kept as :mod:`.triton_source` is (module level, no postponed annotations), whose program it runs unchanged: only the
address of a key differs, read through the block table of a vLLM FlashAttention cache, K and V each (num_blocks,
PAGE, Hkv, D) with strides of their own (views of one combined cache among them).
"""

import triton
import triton.language as tl

from .triton_source import speculate


# A binary per PAGE besides the decode kernel's constexprs: a cache's block size is fixed, and a constant divisor
# turns the position's block and slot into a shift (a multiply where it is no power of two).
@triton.jit(do_not_specialize=["cache_len", "WINDOW", "NUM_SPLITS", "GROUP", "LAM_PER_ROW"])
def paged_decode_kernel(
    q_ptr, k_ptr, v_ptr, table_ptr, geom_ptr, o_ptr, ticket_ptr, exact_ptr, lam_ptr, lam, d_ptr, accept_ptr,
    stride_kb, stride_kh, stride_ks, stride_vb, stride_vh, stride_vs, stride_t, cache_len, scale, WINDOW, NUM_SPLITS,
    GROUP, LAM_PER_ROW, HEAD_DIM: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
    EVEN_D: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_H: tl.constexpr, CHUNK_S: tl.constexpr, IEEE: tl.constexpr,
    PAGE: tl.constexpr,
):
    """Key p of row b at block table[b, p // PAGE] (rows ``stride_t`` apart), slot p % PAGE; ``cache_len`` is the
    table's capacity in positions, past which no key is read."""
    speculate(q_ptr, k_ptr, v_ptr, table_ptr, geom_ptr, o_ptr, ticket_ptr, exact_ptr, lam_ptr, lam, d_ptr, accept_ptr,
              stride_kb, stride_kh, stride_ks, stride_vb, stride_vh, stride_vs, stride_t, cache_len, scale, WINDOW,
              GROUP=GROUP, NUM_SPLITS=NUM_SPLITS, LAM_PER_ROW=LAM_PER_ROW, HEAD_DIM=HEAD_DIM, BLOCK_G=BLOCK_G,
              BLOCK_D=BLOCK_D, BLOCK_N=BLOCK_N, EVEN_D=EVEN_D, BLOCK_E=BLOCK_E, BLOCK_H=BLOCK_H, CHUNK_S=CHUNK_S,
              IEEE=IEEE, PAGE=PAGE)
