"""The Triton decode kernel's source (see :mod:`.triton_decode`), imported only where Triton is installed.

Kept apart, at module level and without postponed annotations, so that every Triton from the oldest the package
admits on resolves ``tl.constexpr`` and compiles the same source (also ahead of time, :mod:`.triton_launch`).

One launch per call. Program (b, kv head, split) computes a flash partial of that KV head's query heads over its
keys; split 0's keys are the first and last S positions, so its partial, normalised, is A~. The last split of a
(row, KV head) to finish (an integer ticket per (row, head)) merges that head's partials, in split order, into A and
writes both outputs and the head's squared sums; the last head of a row to finish (a ticket per row) adds the heads'
sums in head order and decides. No float atomics: which program merges depends on scheduling, what it computes
does not, so d, n and both outputs are the same bits run to run. The tickets return to zero for the next call.

The program is :func:`speculate`, shared with the paged kernel (:mod:`.triton_paged_source`): the two differ only in
where a key lives, at its row and position of a contiguous cache or through a block table.
"""

import triton
import triton.language as tl


@triton.jit
def _merge_head(o_ptr, lse_ptr, exact_ptr, spec_ptr, base, out, NUM_SPLITS, GROUP, HEAD_DIM,
                BLOCK_E: tl.constexpr, CHUNK_S: tl.constexpr):
    """A of one (row, KV head) from its partials (split 0's is A~), both outputs stored; returns (d^2, n^2) of the
    head on the outputs as rounded to the model's dtype (what the caller sees). The (query head, dim) elements go
    BLOCK_E at a time, each reading CHUNK_S partials at once, so registers stay bounded for any head size."""
    offs_s = tl.arange(0, CHUNK_S)
    d2 = 0.0
    n2 = 0.0
    for e0 in range(0, GROUP * HEAD_DIM, BLOCK_E):
        offs_e = e0 + tl.arange(0, BLOCK_E)  # (query head of the group, dim) flattened: the outputs' own layout
        e_mask = offs_e < GROUP * HEAD_DIM
        m = tl.full([BLOCK_E], -1e30, tl.float32)
        l = tl.zeros([BLOCK_E], tl.float32)
        acc = tl.zeros([BLOCK_E], tl.float32)
        for first in range(0, NUM_SPLITS, CHUNK_S):  # in split order
            split = first + offs_s
            mask = (split < NUM_SPLITS)[:, None] & e_mask[None, :]
            lse = tl.load(lse_ptr + (base + split)[:, None] * GROUP + (offs_e // HEAD_DIM)[None, :], mask=mask,
                          other=-1e30, cache_modifier=".cg")
            o = tl.load(o_ptr + (base + split)[:, None] * (GROUP * HEAD_DIM) + offs_e[None, :], mask=mask,
                        other=0.0, cache_modifier=".cg")
            m_new = tl.maximum(m, tl.max(lse, axis=0))
            alpha = tl.exp(m - m_new)
            w = tl.exp(lse - m_new[None, :])  # an empty split's lse is -inf: weight 0
            l = l * alpha + tl.sum(w, axis=0)
            acc = acc * alpha + tl.sum(w * o, axis=0)
            m = m_new
        spec = tl.load(o_ptr + base * (GROUP * HEAD_DIM) + offs_e, mask=e_mask, other=0.0, cache_modifier=".cg")
        # A trivial context has no middle: split 0 weighs exp(0) = 1 and the empty splits 0, so A is A~ bit for bit.
        exact = acc / l
        exact = exact.to(exact_ptr.dtype.element_ty)
        spec = spec.to(spec_ptr.dtype.element_ty)
        tl.store(exact_ptr + out + offs_e, exact, mask=e_mask)
        tl.store(spec_ptr + out + offs_e, spec, mask=e_mask)
        e = tl.where(e_mask, exact.to(tl.float32), 0.0)
        diff = tl.where(e_mask, spec.to(tl.float32), 0.0) - e
        d2 += tl.sum(diff * diff, axis=0)
        n2 += tl.sum(e * e, axis=0)
    return d2, n2


@triton.jit
def speculate(
    q_ptr, k_ptr, v_ptr, table_ptr, geom_ptr, o_ptr, ticket_ptr, exact_ptr, lam_ptr, lam, d_ptr, accept_ptr,
    stride_kb, stride_kh, stride_kl, stride_vb, stride_vh, stride_vl, stride_t, cache_len, scale, WINDOW,
    GROUP, NUM_SPLITS, LAM_PER_ROW, HEAD_DIM: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr, EVEN_D: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_H: tl.constexpr, CHUNK_S: tl.constexpr,
    IEEE: tl.constexpr, PAGE: tl.constexpr,
):
    """One program of either kernel, which differ only in where key p of row b lives. PAGE = 0: a contiguous cache,
    at b * stride_kb + p * stride_kl; else a paged one of PAGE slots per block, in block table[b, p // PAGE] (rows
    ``stride_t`` apart) at slot p % PAGE: block * stride_kb + slot * stride_kl (V: the stride_v*)."""
    b = tl.program_id(0)
    h = tl.program_id(1)
    split = tl.program_id(2)
    batch = tl.num_programs(0)
    hkv = tl.num_programs(1)
    # One buffer each, as few arguments as the launcher must look at: the scratch holds the partials' outputs, then
    # their log-sum-exps, then each head's squared sums; the outputs hold A, then A~; the norms hold d, then n.
    parts = batch * hkv * NUM_SPLITS
    lse_ptr = o_ptr + parts * (GROUP * HEAD_DIM)
    sq_ptr = lse_ptr + parts * GROUP
    spec_ptr = exact_ptr + batch * hkv * (GROUP * HEAD_DIM)
    n_ptr = d_ptr + batch
    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    g_mask = offs_g < GROUP
    if EVEN_D:
        d_mask = offs_d < BLOCK_D  # a constant mask keeps loads vectorized
    else:
        d_mask = offs_d < HEAD_DIM
    q = tl.load(
        q_ptr + ((b * hkv + h) * GROUP + offs_g)[:, None] * HEAD_DIM + offs_d[None, :],
        mask=g_mask[:, None] & d_mask[None, :], other=0.0,
    )
    # geom rows: last_start, mid_stop, cur (logical: counted from the first real token), start (physical), trivial.
    last_start = tl.load(geom_ptr + b)
    mid_stop = tl.load(geom_ptr + batch + b)
    cur = tl.load(geom_ptr + 2 * batch + b)
    first = tl.load(geom_ptr + 3 * batch + b)
    if PAGE == 0:
        k_base = k_ptr + b * stride_kb + h * stride_kh
        v_base = v_ptr + b * stride_vb + h * stride_vh
    else:
        k_base = k_ptr + h * stride_kh
        v_base = v_ptr + h * stride_vh

    # Split 0 walks j in [0, 2S) mapped onto the two windows; split i > 0 walks its share of the middle [S, mid_stop).
    is_spec = split == 0
    mid_len = tl.maximum(mid_stop - WINDOW, 0)
    per = (mid_len + NUM_SPLITS - 2) // (NUM_SPLITS - 1)  # ceil(mid_len / middle splits)
    lo = tl.where(is_spec, 0, WINDOW + (split - 1) * per)
    hi = tl.where(is_spec, 2 * WINDOW, tl.minimum(lo + per, WINDOW + mid_len))

    m_i = tl.full([BLOCK_G], -1e30, tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    for start in range(lo, hi, BLOCK_N):
        j = start + offs_n
        pos = tl.where(is_spec & (j >= WINDOW), last_start + j - WINDOW, j)
        phys = pos + first
        valid = (j < hi) & (pos <= cur) & (phys < cache_len)
        kv_mask = valid[:, None] & d_mask[None, :]
        if PAGE == 0:
            k_rows = phys[:, None] * stride_kl
            v_rows = phys[:, None] * stride_vl
        else:  # int64: a large cache's block offsets pass 2^31 elements
            block = tl.load(table_ptr + b * stride_t + phys // PAGE, mask=valid, other=0).to(tl.int64)
            k_rows = (block * stride_kb + (phys % PAGE) * stride_kl)[:, None]
            v_rows = (block * stride_vb + (phys % PAGE) * stride_vl)[:, None]
        k = tl.load(k_base + k_rows + offs_d[None, :], mask=kv_mask, other=0.0)
        v = tl.load(v_base + v_rows + offs_d[None, :], mask=kv_mask, other=0.0)
        if IEEE:
            s = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))
        s = tl.where(valid[None, :], s * scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        if IEEE:
            pv = tl.dot(p.to(v.dtype), v, input_precision="ieee")
        else:
            pv = tl.dot(p.to(v.dtype), v)
        acc = acc * alpha[:, None] + pv
        m_i = m_new

    has = l_i > 0
    o = acc / tl.where(has, l_i, 1.0)[:, None]
    lse = tl.where(has, m_i + tl.log(tl.where(has, l_i, 1.0)), float("-inf"))
    head = b * hkv + h
    row = head * NUM_SPLITS + split
    tl.store(o_ptr + row * (GROUP * HEAD_DIM) + offs_g[:, None] * HEAD_DIM + offs_d[None, :], o,
             mask=g_mask[:, None] & d_mask[None, :])
    tl.store(lse_ptr + row * GROUP + offs_g, lse, mask=g_mask)

    tl.debug_barrier()  # every thread's partial is stored before the ticket releases it (acq_rel, gpu scope)
    if tl.atomic_add(ticket_ptr + head, 1) == NUM_SPLITS - 1:  # the head's last split: merge it
        tl.store(ticket_ptr + head, 0)
        d2, n2 = _merge_head(o_ptr, lse_ptr, exact_ptr, spec_ptr, head * NUM_SPLITS,
                             head * (GROUP * HEAD_DIM), NUM_SPLITS, GROUP, HEAD_DIM, BLOCK_E, CHUNK_S)
        tl.store(sq_ptr + 2 * head, d2)
        tl.store(sq_ptr + 2 * head + 1, n2)
        tl.debug_barrier()
        if tl.atomic_add(ticket_ptr + batch * hkv + b, 1) == hkv - 1:  # the row's last head: verify
            tl.store(ticket_ptr + batch * hkv + b, 0)
            d2 = 0.0
            n2 = 0.0
            for h0 in range(0, hkv, BLOCK_H):  # in head order
                offs_h = h0 + tl.arange(0, BLOCK_H)
                heads = (b * hkv + offs_h) * 2
                h_mask = offs_h < hkv
                d2 += tl.sum(tl.load(sq_ptr + heads, mask=h_mask, other=0.0, cache_modifier=".cg"), axis=0)
                n2 += tl.sum(tl.load(sq_ptr + heads + 1, mask=h_mask, other=0.0, cache_modifier=".cg"), axis=0)
            d = tl.sqrt_rn(d2)
            n = tl.sqrt_rn(n2)
            lam = tl.where(LAM_PER_ROW != 0, tl.load(lam_ptr + b), lam)
            trivial = tl.load(geom_ptr + 4 * batch + b) != 0
            tl.store(d_ptr + b, d)
            tl.store(n_ptr + b, n)
            # semantics.accept in float32: d <= lambda n, lambda = inf accepting all; trivial rows accept
            tl.store(accept_ptr + b, (d <= lam * n) | (lam == float("inf")) | trivial)


# One binary per dtype, head_dim, block sizes and launch settings: the group, window, lengths and whether lambda is
# per row are runtime values (no specialisation on the ones that change as the cache grows). head_dim compiled in
# costs no binary (its block and EVEN_D already take one each) and buys 10-20% on an H100 (benchmarks/bench_kernels).
@triton.jit(do_not_specialize=["cache_len", "WINDOW", "NUM_SPLITS", "GROUP", "LAM_PER_ROW"])
def decode_kernel(
    q_ptr, k_ptr, v_ptr, geom_ptr, o_ptr, ticket_ptr, exact_ptr, lam_ptr, lam, d_ptr, accept_ptr,
    stride_kb, stride_kh, stride_kl, cache_len, scale, WINDOW, NUM_SPLITS, GROUP, LAM_PER_ROW, HEAD_DIM: tl.constexpr,
    BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, EVEN_D: tl.constexpr,
    BLOCK_E: tl.constexpr, BLOCK_H: tl.constexpr, CHUNK_S: tl.constexpr, IEEE: tl.constexpr,
):
    """K and V (B, Hkv, L, D), one set of strides; no block table (``geom_ptr`` stands in, never read)."""
    speculate(q_ptr, k_ptr, v_ptr, geom_ptr, geom_ptr, o_ptr, ticket_ptr, exact_ptr, lam_ptr, lam, d_ptr, accept_ptr,
              stride_kb, stride_kh, stride_kl, stride_kb, stride_kh, stride_kl, 0, cache_len, scale, WINDOW,
              GROUP=GROUP, NUM_SPLITS=NUM_SPLITS, LAM_PER_ROW=LAM_PER_ROW, HEAD_DIM=HEAD_DIM, BLOCK_G=BLOCK_G,
              BLOCK_D=BLOCK_D, BLOCK_N=BLOCK_N, EVEN_D=EVEN_D, BLOCK_E=BLOCK_E, BLOCK_H=BLOCK_H, CHUNK_S=CHUNK_S,
              IEEE=IEEE, PAGE=0)
