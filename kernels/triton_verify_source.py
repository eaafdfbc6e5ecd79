"""The paged verifier's source (see :mod:`.triton_verify`), imported only where Triton is installed.

Kept as :mod:`.triton_source` is (module level, no postponed annotations), so that every Triton the package admits
compiles it. One program per (verified row, KV head): the row's query heads of that KV head attend, in one online
softmax, to the keys of the row's ranges [starts, ends), each cut to [0, pos] (nothing outside a row's own context is
read, whatever a draft returned), read through the block table from a cache whose block, head and slot strides are
the layout's own (every ``KVCacheLayout`` vLLM allocates); head_dim is contiguous.
"""

import triton
import triton.language as tl


# A binary per dtype, head_dim, block sizes and PAGE; the group, the ranges per row and every stride are runtime
# values (a cache layout is a set of strides, not a binary).
@triton.jit(do_not_specialize=["RANGES", "GROUP"])
def paged_verify_kernel(
    q_ptr, k_ptr, v_ptr, table_ptr, token_ptr, request_ptr, starts_ptr, ends_ptr, pos_ptr, out_ptr,
    stride_qt, stride_qh, stride_kb, stride_kh, stride_ks, stride_vb, stride_vh, stride_vs, stride_t, scale, RANGES,
    GROUP, HEAD_DIM: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
    EVEN_D: tl.constexpr, IEEE: tl.constexpr, PAGE: tl.constexpr,
):
    """A~ of row m, KV head h, float32, at out[m, h * GROUP + g, :] (rows of Hq * HEAD_DIM). Key p of the row is in
    block table[request, p // PAGE] (table rows ``stride_t`` apart) at slot p % PAGE. A row with no key left gives
    NaN, as :func:`alspec_eval.semantics.attend` does."""
    m = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    heads = tl.num_programs(1) * GROUP
    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    g_mask = offs_g < GROUP
    if EVEN_D:
        d_mask = offs_d < BLOCK_D  # a constant mask keeps loads vectorized
    else:
        d_mask = offs_d < HEAD_DIM
    token = tl.load(token_ptr + m)
    request = tl.load(request_ptr + m)
    pos = tl.load(pos_ptr + m)
    q = tl.load(q_ptr + token * stride_qt + (h * GROUP + offs_g)[:, None] * stride_qh + offs_d[None, :],
                mask=g_mask[:, None] & d_mask[None, :], other=0.0)
    k_base = k_ptr + h * stride_kh
    v_base = v_ptr + h * stride_vh
    m_i = tl.full([BLOCK_G], -1e30, tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    for r in range(0, RANGES):
        lo = tl.maximum(tl.load(starts_ptr + m * RANGES + r), 0)  # the bounds: [0, pos], whatever the draft said
        hi = tl.minimum(tl.load(ends_ptr + m * RANGES + r), pos + 1)
        for start in range(lo, hi, BLOCK_N):
            p = start + offs_n
            valid = p < hi
            block = tl.load(table_ptr + request * stride_t + p // PAGE, mask=valid, other=0).to(tl.int64)
            slot = p % PAGE
            kv_mask = valid[:, None] & d_mask[None, :]
            k = tl.load(k_base + (block * stride_kb + slot * stride_ks)[:, None] + offs_d[None, :], mask=kv_mask,
                        other=0.0)
            v = tl.load(v_base + (block * stride_vb + slot * stride_vs)[:, None] + offs_d[None, :], mask=kv_mask,
                        other=0.0)
            if IEEE:
                s = tl.dot(q, tl.trans(k), input_precision="ieee")
            else:
                s = tl.dot(q, tl.trans(k))
            s = tl.where(valid[None, :], s * scale, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            alpha = tl.exp(m_i - m_new)
            weights = tl.exp(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(weights, axis=1)
            if IEEE:  # the probabilities rounded to the values' dtype, P @ V accumulated in float32 (semantics.attend)
                pv = tl.dot(weights.to(v.dtype), v, input_precision="ieee")
            else:
                pv = tl.dot(weights.to(v.dtype), v)
            acc = acc * alpha[:, None] + pv
            m_i = m_new
    out = acc / l_i[:, None]
    tl.store(out_ptr + (m * heads + h * GROUP + offs_g)[:, None] * HEAD_DIM + offs_d[None, :], out,
             mask=g_mask[:, None] & d_mask[None, :])
