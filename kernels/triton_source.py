"""The Triton decode kernels' source (see :mod:`.triton_decode`), imported only where Triton is installed.

Kept apart, at module level and without postponed annotations, so that every Triton from the oldest the package
admits on resolves ``tl.constexpr`` and compiles the same source (also ahead of time, :mod:`.triton_launch`).
"""

import triton
import triton.language as tl


@triton.jit
def partial_kernel(
    q_ptr, k_ptr, v_ptr, last_start_ptr, mid_stop_ptr, cur_pos_ptr, start_ptr, o_ptr, lse_ptr,
    stride_qb, stride_qh, stride_kb, stride_kh, stride_kl, stride_vb, stride_vh, stride_vl,
    cache_len, scale, GROUP, HEAD_DIM, WINDOW, NUM_SPLITS,
    BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, EVEN_D: tl.constexpr,
    IEEE: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    split = tl.program_id(2)
    hkv = tl.num_programs(1)
    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    g_mask = offs_g < GROUP
    d_mask = (offs_d < BLOCK_D) if EVEN_D else (offs_d < HEAD_DIM)  # a constant mask keeps loads vectorized
    q = tl.load(
        q_ptr + b * stride_qb + (h * GROUP + offs_g)[:, None] * stride_qh + offs_d[None, :],
        mask=g_mask[:, None] & d_mask[None, :], other=0.0,
    )
    # cur, last_start, mid_stop are logical (counted from the first real token); physical = logical + start.
    cur = tl.load(cur_pos_ptr + b)
    last_start = tl.load(last_start_ptr + b)
    first = tl.load(start_ptr + b)
    k_base = k_ptr + b * stride_kb + h * stride_kh
    v_base = v_ptr + b * stride_vb + h * stride_vh

    # Split 0 walks j in [0, 2S) mapped onto the two windows; split i > 0
    # walks its share of the middle [S, mid_stop).
    is_spec = split == 0
    mid_len = tl.maximum(tl.load(mid_stop_ptr + b) - WINDOW, 0)
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
        k = tl.load(k_base + phys[:, None] * stride_kl + offs_d[None, :], mask=kv_mask, other=0.0)
        v = tl.load(v_base + phys[:, None] * stride_vl + offs_d[None, :], mask=kv_mask, other=0.0)
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
    row = (b * hkv + h) * NUM_SPLITS + split
    tl.store(
        o_ptr + (row * BLOCK_G + offs_g)[:, None] * BLOCK_D + offs_d[None, :], o,
    )
    tl.store(lse_ptr + row * BLOCK_G + offs_g, lse)

@triton.jit
def reduce_kernel(
    o_ptr, lse_ptr, exact_ptr, spec_ptr, trivial_ptr, lam_ptr, lam, d_ptr, n_ptr, accept_ptr,
    HKV, GROUP, HEAD_DIM, NUM_SPLITS,
    BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr, LAM_PER_ROW: tl.constexpr,
):
    b = tl.program_id(0)
    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_g < GROUP)[:, None] & (offs_d < HEAD_DIM)[None, :]
    tile = offs_g[:, None] * BLOCK_D + offs_d[None, :]
    trivial = tl.load(trivial_ptr + b)
    d2 = 0.0
    n2 = 0.0
    for h in range(HKV):
        base = (b * HKV + h) * NUM_SPLITS
        # The speculative partial is the running state the middle merges into.
        spec = tl.load(o_ptr + base * BLOCK_G * BLOCK_D + tile)
        lse = tl.load(lse_ptr + base * BLOCK_G + offs_g)
        acc = spec
        for split in range(1, NUM_SPLITS):
            o_s = tl.load(o_ptr + (base + split) * BLOCK_G * BLOCK_D + tile)
            lse_s = tl.load(lse_ptr + (base + split) * BLOCK_G + offs_g)
            new = tl.maximum(lse, lse_s) + tl.log(1.0 + tl.exp(-tl.abs(lse - lse_s)))
            w_s = tl.where(lse_s > float("-inf"), tl.exp(lse_s - new), 0.0)
            acc = acc * tl.exp(lse - new)[:, None] + o_s * w_s[:, None]
            lse = new
        acc = tl.where(trivial, spec, acc)  # a trivial context: A~ is A, bit for bit

        out = (b * HKV + h) * GROUP * HEAD_DIM + offs_g[:, None] * HEAD_DIM + offs_d[None, :]
        tl.store(spec_ptr + out, spec.to(spec_ptr.dtype.element_ty), mask=mask)
        tl.store(exact_ptr + out, acc.to(exact_ptr.dtype.element_ty), mask=mask)
        # Verification on the rounded outputs, as the caller sees them.
        e = tl.where(mask, acc.to(exact_ptr.dtype.element_ty).to(tl.float32), 0.0)
        sp = tl.where(mask, spec.to(spec_ptr.dtype.element_ty).to(tl.float32), 0.0)
        diff = sp - e
        d2 += tl.sum(tl.sum(diff * diff, axis=1), axis=0)
        n2 += tl.sum(tl.sum(e * e, axis=1), axis=0)
    # semantics.accept in float32: d <= lambda n, lambda = inf accepting all; trivial rows accept
    d = tl.sqrt_rn(d2)
    n = tl.sqrt_rn(n2)
    if LAM_PER_ROW:
        lam = tl.load(lam_ptr + b)
    tl.store(d_ptr + b, d)
    tl.store(n_ptr + b, n)
    tl.store(accept_ptr + b, (d <= lam * n) | (lam == float("inf")) | trivial)
