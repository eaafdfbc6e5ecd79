"""Torch reference kernel against SDPA computed independently (kernel_oracle)."""

from __future__ import annotations

import math

import pytest
import torch
from kernel_oracle import fill_padding, make_inputs, padded_oracle, sdpa_over, window_positions

from alspec_eval.kernels import reference, select_kernel, speculative_flash_decode, torch_kernel
from alspec_eval.kernels.reference import partial_flash_cpu, partial_math
from alspec_eval.kernels.unfused import unfused_decode

S = 8
# Per-sequence positions: deep context, 2S + 1 (first non-trivial), 2S (last trivial), short.
POSITIONS = [150, 2 * S, 2 * S - 1, 5, 97]


def oracle(q, k, v, cur_pos, align):
    exact = sdpa_over(q, k, v, [list(range(p + 1)) for p in cur_pos.tolist()])
    spec = sdpa_over(q, k, v, [window_positions(p, S, align) for p in cur_pos.tolist()])
    return exact, spec


@pytest.mark.parametrize("align", [1, 32])
@pytest.mark.parametrize("chunk_size", [None, 13])
@pytest.mark.parametrize("hq,hkv", [(6, 2), (4, 4), (3, 1)])
def test_matches_sdpa(align: int, chunk_size: int | None, hq: int, hkv: int) -> None:
    q, k, v, cur_pos = make_inputs(len(POSITIONS), hq, hkv, 160, 16, POSITIONS)
    out = speculative_flash_decode(q, k, v, cur_pos, S, 0.5, chunk_size=chunk_size, window_align=align)
    exact, spec = oracle(q, k, v, cur_pos, align)
    torch.testing.assert_close(out.exact, exact, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out.spec, spec, atol=1e-5, rtol=1e-5)
    assert out.trivial.tolist() == [p + 1 <= 2 * S for p in POSITIONS]
    e, s = exact.reshape(len(POSITIONS), -1), spec.reshape(len(POSITIONS), -1)
    torch.testing.assert_close(out.n, e.norm(dim=1), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out.d, (s - e).norm(dim=1), atol=1e-5, rtol=1e-4)


def test_trivial_rows_are_exact_copies() -> None:
    q, k, v, cur_pos = make_inputs(3, 4, 2, 40, 8, [2 * S - 1, 0, 2 * S])
    out = speculative_flash_decode(q, k, v, cur_pos, S, 0.0)
    assert out.trivial.tolist() == [True, True, False]
    assert torch.equal(out.spec[:2], out.exact[:2])
    assert out.d[:2].tolist() == [0.0, 0.0]
    assert out.accept.tolist() == [True, True, False]  # lambda = 0 rejects every real approximation


def test_accept_around_measured_ratio() -> None:
    q, k, v, cur_pos = make_inputs(len(POSITIONS), 6, 2, 160, 16, POSITIONS, seed=3)
    nontrivial = torch.tensor([p + 1 > 2 * S for p in POSITIONS])
    for align in (1, 32):
        r = speculative_flash_decode(q, k, v, cur_pos, S, 0.0, window_align=align)
        ratio = (r.d / r.n)[nontrivial]
        assert (ratio > 0).all()
        for i, rho in zip(nontrivial.nonzero().flatten().tolist(), ratio.tolist()):
            above = speculative_flash_decode(q, k, v, cur_pos, S, rho * 1.001, window_align=align).accept
            below = speculative_flash_decode(q, k, v, cur_pos, S, rho * 0.999, window_align=align).accept
            assert above[i] and not below[i]
            assert above[~nontrivial].all() and below[~nontrivial].all()
    assert speculative_flash_decode(q, k, v, cur_pos, S, math.inf).accept.all()


def test_window_align_32_masks_past_cur_pos() -> None:
    # cur_pos 70, S = 32: the TT window is [96 - 32, 96) and keeps 64..70; the exact one is [39, 71).
    q, k, v, cur_pos = make_inputs(1, 4, 2, 128, 16, [70])
    aligned = speculative_flash_decode(q, k, v, cur_pos, 32, 0.5, window_align=32)
    plain = speculative_flash_decode(q, k, v, cur_pos, 32, 0.5)
    want = sdpa_over(q, k, v, [list(range(32)) + list(range(64, 71))])
    torch.testing.assert_close(aligned.spec, want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(plain.spec, sdpa_over(q, k, v, [list(range(32)) + list(range(39, 71))]), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(aligned.exact, plain.exact)


def test_window_end_past_cache_length() -> None:
    # ceil32(cur_pos + 1) = 128 > L = 100: the window runs off the cache and is clipped.
    q, k, v, cur_pos = make_inputs(1, 2, 1, 100, 8, [99])
    out = speculative_flash_decode(q, k, v, cur_pos, 32, 0.5, window_align=32)
    torch.testing.assert_close(out.spec, sdpa_over(q, k, v, [list(range(32)) + list(range(96, 100))]), atol=1e-5, rtol=1e-5)


def test_bfloat16_close_to_float32_oracle() -> None:
    q, k, v, cur_pos = make_inputs(2, 6, 2, 300, 32, [299, 180], dtype=torch.bfloat16)
    out = speculative_flash_decode(q, k, v, cur_pos, 16, 0.5)
    assert out.exact.dtype == out.spec.dtype == torch.bfloat16 and out.d.dtype == torch.float32
    exact = sdpa_over(q, k, v, [list(range(300)), list(range(181))])
    spec = sdpa_over(q, k, v, [window_positions(299, 16, 1), window_positions(180, 16, 1)])
    torch.testing.assert_close(out.exact.float(), exact, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(out.spec.float(), spec, atol=2e-2, rtol=2e-2)


def test_math_and_fused_partials_agree() -> None:
    g = torch.Generator().manual_seed(1)
    q, k, v = torch.randn(2, 2, 3, 16, generator=g), torch.randn(2, 2, 40, 16, generator=g), torch.randn(2, 2, 40, 16, generator=g)
    bias = torch.zeros(2, 1, 1, 40)
    bias[0] = float("-inf")  # row without any valid key
    bias[1, ..., 25:] = float("-inf")
    o1, lse1 = partial_math(q, k, v, bias, 0.3)
    o2, lse2 = partial_flash_cpu(q, k, v, bias, 0.3)
    assert torch.isneginf(lse1[0]).all() and torch.isneginf(lse2[0]).all()
    torch.testing.assert_close(o1[1], o2[1], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse1[1], lse2[1], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse1[1], torch.logsumexp(q[1] @ k[1, :, :25].mT * 0.3, dim=-1), atol=1e-5, rtol=1e-5)


def test_sdpa_kernel_and_selection() -> None:
    q, k, v, cur_pos = make_inputs(len(POSITIONS), 6, 2, 160, 16, POSITIONS)
    ref = speculative_flash_decode(q, k, v, cur_pos, S, 0.7, window_align=32)
    alt = unfused_decode(q, k, v, cur_pos, S, 0.7, window_align=32)
    torch.testing.assert_close(alt.exact, ref.exact, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(alt.spec, ref.spec, atol=1e-5, rtol=1e-5)
    assert torch.equal(alt.trivial, ref.trivial)
    from alspec_eval.backends.sim import choose_kernel

    # kernel=auto on the CPU: the model's own attention, and the results say why
    assert choose_kernel("auto", torch.device("cpu"), True, torch.float32, None) == (
        "model", "model: kernel=auto runs triton on CUDA only, not on cpu")
    assert choose_kernel("torch", torch.device("cpu"), True, torch.float32, None) == ("torch", "torch: as asked")
    assert select_kernel("torch", "cpu") is torch_kernel
    assert select_kernel("unfused", torch.device("cpu")) is unfused_decode
    for name in ("flash", "auto"):  # auto is the sim backend's choice, not a kernel
        with pytest.raises(ValueError, match="unknown kernel"):
            select_kernel(name, "cpu")


def test_rejects_bad_shapes() -> None:
    q, k, v, cur_pos = make_inputs(2, 6, 4, 20, 8, [5, 6])
    with pytest.raises(ValueError, match="GQA"):
        speculative_flash_decode(q, k, v, cur_pos, 4, 0.1)


# Left padding: row b's real tokens start at physical index PAD_START[b]; logical positions
# (counted from there): deep, 2S (first non-trivial), 2S - 1 (last trivial, but physically
# past 2S), short, 60 (its ceil32 window keeps 56..60 logically, nothing physically), 97.
PAD_START = [0, 5, 17, 3, 40, 9]
PAD_LOGICAL = [150, 2 * S, 2 * S - 1, 5, 60, 97]
PAD_CUR = [s + p for s, p in zip(PAD_START, PAD_LOGICAL)]
KERNELS = {"torch": speculative_flash_decode, "unfused": unfused_decode}


def padded_inputs(hq: int, hkv: int, dtype: torch.dtype = torch.float32, seed: int = 0):
    q, k, v, cur_pos = make_inputs(len(PAD_CUR), hq, hkv, 160, 16, PAD_CUR, dtype=dtype, seed=seed, start=PAD_START)
    return q, k, v, cur_pos, torch.tensor(PAD_START)


@pytest.mark.parametrize("kernel", sorted(KERNELS))
@pytest.mark.parametrize("align", [1, 32])
@pytest.mark.parametrize("chunk_size", [None, 13])
@pytest.mark.parametrize("hq,hkv", [(6, 2), (3, 1)])
def test_left_padding_matches_oracle(kernel: str, align: int, chunk_size: int | None, hq: int, hkv: int) -> None:
    q, k, v, cur_pos, start = padded_inputs(hq, hkv)
    out = KERNELS[kernel](q, k, v, cur_pos, S, 0.5, chunk_size=chunk_size, window_align=align, start=start)
    exact, spec = padded_oracle(q, k, v, PAD_CUR, PAD_START, S, align)
    torch.testing.assert_close(out.exact, exact, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out.spec, spec, atol=1e-5, rtol=1e-5)
    assert out.trivial.tolist() == [p + 1 <= 2 * S for p in PAD_LOGICAL]
    e, sp = exact.reshape(len(PAD_CUR), -1), spec.reshape(len(PAD_CUR), -1)
    torch.testing.assert_close(out.n, e.norm(dim=1), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out.d, (sp - e).norm(dim=1), atol=1e-5, rtol=1e-4)
    assert torch.equal(out.spec[out.trivial], out.exact[out.trivial])


@pytest.mark.parametrize("kernel", sorted(KERNELS))
@pytest.mark.parametrize("align", [1, 32])
def test_left_padding_garbage_is_ignored(kernel: str, align: int) -> None:
    """Other padding garbage, same outputs; and each row equals its unpadded sequence alone."""
    fn = KERNELS[kernel]
    q, k, v, cur_pos, start = padded_inputs(6, 2)
    out = fn(q, k, v, cur_pos, S, 0.3, window_align=align, start=start)
    k2, v2 = fill_padding(k, v, PAD_START, seed=99)
    assert not torch.equal(k2, k)
    other = fn(q, k2, v2, cur_pos, S, 0.3, window_align=align, start=start)
    for a, b in zip(out, other):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)
    for b, (s, p) in enumerate(zip(PAD_START, PAD_LOGICAL)):
        alone = fn(q[b : b + 1], k[b : b + 1, :, s:], v[b : b + 1, :, s:], torch.tensor([p]), S, 0.3, window_align=align)
        torch.testing.assert_close(out.exact[b : b + 1], alone.exact, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(out.spec[b : b + 1], alone.spec, atol=1e-5, rtol=1e-5)
        assert out.trivial[b] == alone.trivial[0] and out.accept[b] == alone.accept[0]


def test_left_padding_window_align_32_tail() -> None:
    # S = 32; logical 69 -> TT window logical [64, 96) keeps 64..69 = physical 94..99 (the cache end).
    q, k, v, cur_pos = make_inputs(2, 4, 2, 100, 16, [99, 99], start=[30, 0])
    start = torch.tensor([30, 0])
    out = speculative_flash_decode(q, k, v, cur_pos, 32, 0.5, window_align=32, start=start)
    want = sdpa_over(q[:1], k[:1], v[:1], [list(range(30, 62)) + list(range(94, 100))])
    torch.testing.assert_close(out.spec[:1], want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out.exact[:1], sdpa_over(q[:1], k[:1], v[:1], [list(range(30, 100))]), atol=1e-5, rtol=1e-5)
    unpadded = sdpa_over(q[1:], k[1:], v[1:], [list(range(32)) + list(range(96, 100))])
    torch.testing.assert_close(out.spec[1:], unpadded, atol=1e-5, rtol=1e-5)


def test_left_padding_bfloat16_close_to_float32_oracle() -> None:
    q, k, v, cur_pos, start = padded_inputs(6, 2, dtype=torch.bfloat16)
    out = speculative_flash_decode(q, k, v, cur_pos, S, 0.5, start=start)
    exact, spec = padded_oracle(q, k, v, PAD_CUR, PAD_START, S, 1)
    torch.testing.assert_close(out.exact.float(), exact, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(out.spec.float(), spec, atol=2e-2, rtol=2e-2)


def _record_biases(monkeypatch: pytest.MonkeyPatch) -> list:
    seen: list = []

    def spy(qg, k, v, bias, scale):
        seen.append(bias)
        return partial_flash_cpu(qg, k, v, bias, scale)

    monkeypatch.setattr(reference, "partial_flash_cpu", spy)
    return seen


def test_start_none_and_zeros_take_the_unshifted_path(monkeypatch: pytest.MonkeyPatch) -> None:
    q, k, v, cur_pos = make_inputs(2, 6, 2, 160, 16, [150, 150])
    plain = speculative_flash_decode(q, k, v, cur_pos, S, 0.5)
    seen = _record_biases(monkeypatch)
    zeros = speculative_flash_decode(q, k, v, cur_pos, S, 0.5, start=torch.zeros(2, dtype=torch.long))
    for a, b in zip(plain, zeros):
        assert torch.equal(a, b)
    assert len(seen) == 2 and seen[1] is None  # windows, then the middle as a plain slice


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_uniform_padded_batch_slices_without_mask(monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype) -> None:
    """Rows sharing start and cur_pos (e.g. one padded sequence) keep the mask-free middle."""
    q, k, v, cur_pos = make_inputs(2, 6, 2, 160, 16, [150, 150], dtype=dtype, start=[7, 7])
    seen = _record_biases(monkeypatch)
    out = speculative_flash_decode(q, k, v, cur_pos, S, 0.5, start=torch.tensor([7, 7]))
    assert len(seen) == 2 and seen[1] is None
    exact, spec = padded_oracle(q, k, v, [150, 150], [7, 7], S, 1)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.exact.float(), exact, atol=tol, rtol=tol)
    torch.testing.assert_close(out.spec.float(), spec, atol=tol, rtol=tol)


@pytest.mark.parametrize("kernel", sorted(KERNELS))
@pytest.mark.parametrize("start", [None, [0, 4, 11]])
def test_all_trivial_batch(kernel: str, start: list[int] | None) -> None:
    # Logical positions 2S - 1, 3, 0: no row has a middle (this used to crash the torch kernel).
    logical = [2 * S - 1, 3, 0]
    first = start or [0, 0, 0]
    cur = [s + p for s, p in zip(first, logical)]
    q, k, v, cur_pos = make_inputs(3, 4, 2, 40, 8, cur, start=start)
    out = KERNELS[kernel](q, k, v, cur_pos, S, 0.0, start=None if start is None else torch.tensor(start))
    assert out.trivial.all() and out.accept.all()
    assert torch.equal(out.spec, out.exact)
    torch.testing.assert_close(out.exact, padded_oracle(q, k, v, cur, first, S, 1)[0], atol=1e-5, rtol=1e-5)


def test_rejects_bad_start() -> None:
    q, k, v, cur_pos = make_inputs(2, 4, 2, 20, 8, [5, 6])
    with pytest.raises(ValueError, match="start"):
        speculative_flash_decode(q, k, v, cur_pos, 4, 0.1, start=torch.tensor([0, 7]))
    with pytest.raises(ValueError, match="start"):
        speculative_flash_decode(q, k, v, cur_pos, 4, 0.1, start=torch.tensor([0]))
    with pytest.raises(ValueError, match="start"):
        unfused_decode(q, k, v, cur_pos, 4, 0.1, start=torch.tensor([-1, 0]))


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("cur_pos", [4095, 3001])  # a middle that splits evenly, and one with a tail
def test_long_single_sequence_split_along_keys(threads: int, cur_pos: int) -> None:
    """One sequence with one KV head: the middle runs as several key blocks reduced split-K."""
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        q, k, v, pos = make_inputs(1, 3, 1, 4096, 16, [cur_pos])
        out = speculative_flash_decode(q, k, v, pos, S, 0.5)
    finally:
        torch.set_num_threads(previous)
    exact, spec = oracle(q, k, v, pos, 1)
    torch.testing.assert_close(out.exact, exact, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out.spec, spec, atol=1e-5, rtol=1e-5)
