"""Triton kernel against the torch reference: Triton's interpreter on CPU, compiled on CUDA."""

from __future__ import annotations

import pytest
import torch

# tests/conftest.py sets TRITON_INTERPRET=1 without CUDA, before any kernel is built.
pytest.importorskip("triton", reason="triton is not installed (pip install triton)")

from kernel_oracle import fill_padding, make_inputs, padded_oracle

from alspec_eval.kernels import speculative_flash_decode
from alspec_eval.kernels import triton_decode, triton_launch

POSITIONS = [150, 16, 15, 3, 97]
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # the interpreter on the CPU, compiled on a GPU


def _compare(device: str, dtype: torch.dtype, align: int, window: int, chunk: int, atol: float) -> None:
    q, k, v, cur_pos = (t.to(device) for t in make_inputs(len(POSITIONS), 6, 2, 160, 32, POSITIONS, dtype=dtype))
    ref = speculative_flash_decode(q, k, v, cur_pos, window, 0.5, window_align=align)
    out = triton_decode.speculative_flash_decode_triton(q, k, v, cur_pos, window, 0.5, chunk_size=chunk, window_align=align)
    torch.testing.assert_close(out.exact, ref.exact, atol=atol, rtol=atol)
    torch.testing.assert_close(out.spec, ref.spec, atol=atol, rtol=atol)
    torch.testing.assert_close(out.d, ref.d, atol=atol * 10, rtol=atol * 10)
    torch.testing.assert_close(out.n, ref.n, atol=atol * 10, rtol=atol * 10)
    assert torch.equal(out.trivial, ref.trivial)
    assert torch.equal(out.spec[out.trivial], out.exact[out.trivial])


@pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter test; CUDA runs the compiled kernel instead")
@pytest.mark.parametrize("align,window", [(1, 8), (32, 32)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])  # the interpreter's tl.dot mishandles bfloat16
def test_interpreter_matches_reference(align: int, window: int, dtype: torch.dtype) -> None:
    _compare("cpu", dtype, align, window, 16, 1e-5 if dtype == torch.float32 else 2e-3)


# Left padding: physical start per row and logical positions (deep, first non-trivial,
# last trivial, short, a ceil32 window that keeps 56..60 logically but nothing physically).
PAD_START = [0, 5, 17, 3, 40]
PAD_LOGICAL = [100, 16, 15, 3, 60]
PAD_CUR = [s + p for s, p in zip(PAD_START, PAD_LOGICAL)]


def _compare_padded(device: str, dtype: torch.dtype, align: int, chunk: int, atol: float) -> None:
    q, k, v, cur_pos = make_inputs(len(PAD_CUR), 6, 2, 112, 32, PAD_CUR, dtype=dtype, start=PAD_START)
    start = torch.tensor(PAD_START)
    q, k, v, cur_pos, start = (t.to(device) for t in (q, k, v, cur_pos, start))
    out = triton_decode.speculative_flash_decode_triton(q, k, v, cur_pos, 8, 0.5, chunk_size=chunk, window_align=align, start=start)
    exact, spec = padded_oracle(q.cpu(), k.cpu(), v.cpu(), PAD_CUR, PAD_START, 8, align)
    torch.testing.assert_close(out.exact.float().cpu(), exact, atol=atol, rtol=atol)
    torch.testing.assert_close(out.spec.float().cpu(), spec, atol=atol, rtol=atol)
    assert out.trivial.tolist() == [p + 1 <= 16 for p in PAD_LOGICAL]
    ref = speculative_flash_decode(q, k, v, cur_pos, 8, 0.5, window_align=align, start=start)
    torch.testing.assert_close(out.d, ref.d, atol=atol * 10, rtol=atol * 10)
    torch.testing.assert_close(out.n, ref.n, atol=atol * 10, rtol=atol * 10)
    assert torch.equal(out.spec[out.trivial], out.exact[out.trivial])
    # Other garbage in the padding: the same outputs.
    k2, v2 = fill_padding(k.cpu(), v.cpu(), PAD_START, seed=7)
    other = triton_decode.speculative_flash_decode_triton(
        q, k2.to(device), v2.to(device), cur_pos, 8, 0.5, chunk_size=chunk, window_align=align, start=start
    )
    torch.testing.assert_close(other.exact, out.exact, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(other.spec, out.spec, atol=1e-6, rtol=1e-6)


@pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter test")
@pytest.mark.parametrize("align", [1, 32])
def test_interpreter_left_padding(align: int) -> None:
    _compare_padded("cpu", torch.float32, align, 16, 1e-5)


@pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter test")
def test_interpreter_start_zeros_equals_none() -> None:
    q, k, v, cur_pos = make_inputs(3, 6, 2, 64, 32, [50, 20, 7])
    plain = triton_decode.speculative_flash_decode_triton(q, k, v, cur_pos, 8, 0.5, chunk_size=16)
    zeros = triton_decode.speculative_flash_decode_triton(q, k, v, cur_pos, 8, 0.5, chunk_size=16, start=torch.zeros(3, dtype=torch.long))
    for a, b in zip(plain, zeros):
        assert torch.equal(a, b)


@pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter test")
def test_accept_decision_matches_reference() -> None:
    q, k, v, cur_pos = make_inputs(len(POSITIONS), 6, 2, 160, 32, POSITIONS, seed=5)
    ratio = speculative_flash_decode(q, k, v, cur_pos, 8, 0.0).d / speculative_flash_decode(q, k, v, cur_pos, 8, 0.0).n
    lam = float(ratio[0]) * 1.001  # row 0 just accepted; row 4 checked against the reference
    ref = speculative_flash_decode(q, k, v, cur_pos, 8, lam)
    out = triton_decode.speculative_flash_decode_triton(q, k, v, cur_pos, 8, lam, chunk_size=16)
    assert out.accept[0]
    assert torch.equal(out.accept, ref.accept)


def test_missing_triton_raises_clearly(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(__import__("sys").modules, "triton", None)
    monkeypatch.delitem(__import__("sys").modules, "alspec_eval.kernels.triton_source", raising=False)
    triton_launch.kernel.cache_clear()
    q, k, v, cur_pos = make_inputs(1, 2, 1, 8, 16, [7])
    try:
        with pytest.raises(RuntimeError, match="needs the `triton` package"):
            triton_decode.speculative_flash_decode_triton(q, k, v, cur_pos, 2, 0.1)
    finally:
        triton_launch.kernel.cache_clear()


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("align,window", [(1, 8), (32, 32)])
def test_cuda_matches_reference(dtype: torch.dtype, align: int, window: int) -> None:
    _compare("cuda", dtype, align, window, 64, 1e-5 if dtype == torch.float32 else 2e-2)


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("align", [1, 32])
def test_cuda_left_padding(dtype: torch.dtype, align: int) -> None:
    _compare_padded("cuda", dtype, align, 64, 1e-5 if dtype == torch.float32 else 2e-2)


@needs_cuda
def test_auto_selects_triton_on_cuda() -> None:
    from transformers import LlamaConfig

    from alspec_eval.backends.sim import choose_kernel

    config = LlamaConfig(hidden_size=4096, num_attention_heads=32, num_key_value_heads=8)
    assert choose_kernel("auto", torch.device("cuda"), True, torch.bfloat16, config)[0] == "triton"


@pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter test")
def test_interpreter_decides_per_row_as_semantics_and_a_shared_geometry_changes_nothing() -> None:
    """The kernel's decision is semantics.accept on its own d and n (per-row lambdas, inf, trivial rows
    accepted whatever lambda), and a pass's prepared geometry gives the very outputs computed per call."""
    from alspec_eval import semantics

    q, k, v, cur_pos = make_inputs(len(POSITIONS), 6, 2, 160, 32, POSITIONS)  # rows 2 and 3 trivial at S = 8
    plain = triton_decode.speculative_flash_decode_triton(q, k, v, cur_pos, 8, 0.5, chunk_size=16)
    ratio = plain.d / plain.n
    # rows 2 and 3 are trivial: accepted whatever their threshold, a plan's REJECT (-inf) and OFF (NaN) included
    lam = torch.stack([ratio[0] * 1.001, ratio[1] * 0.999, torch.tensor(float("-inf")), torch.tensor(float("nan")),
                       torch.tensor(float("inf"))])
    out = triton_decode.speculative_flash_decode_triton(q, k, v, cur_pos, 8, lam, chunk_size=16)
    assert out.accept.tolist() == [True, False, True, True, True]
    assert torch.equal(out.accept, semantics.accept(out.d, out.n, lam) | out.trivial)
    for scalar in (0.0, float(ratio[4]) * 0.999, float(ratio[4]) * 1.001, float("inf")):
        one = triton_decode.speculative_flash_decode_triton(q, k, v, cur_pos, 8, scalar, chunk_size=16)
        assert torch.equal(one.accept, semantics.accept(one.d, one.n, scalar) | one.trivial)
    geometry = triton_decode.prepare(cur_pos, 8, 1, None)
    shared = triton_decode.speculative_flash_decode_triton(q, k, v, cur_pos, 8, lam, chunk_size=16, geometry=geometry)
    for a, b in zip(shared, out):
        assert torch.equal(a, b)


def _check_defaults(q, k, v, cur_pos, window, align, chunk, atol=1e-5):
    ref = speculative_flash_decode(q, k, v, cur_pos, window, 0.5, window_align=align)
    out = triton_decode.speculative_flash_decode_triton(q, k, v, cur_pos, window, 0.5, chunk_size=chunk,
                                                        window_align=align)
    torch.testing.assert_close(out.exact, ref.exact, atol=atol, rtol=atol)
    torch.testing.assert_close(out.spec, ref.spec, atol=atol, rtol=atol)
    torch.testing.assert_close(out.d, ref.d, atol=atol * 10, rtol=atol * 10)


@pytest.mark.parametrize("dim", [24, 80])  # Qwen3 tiny family's 24; Phi/StableLM-like 80: BLOCK_D > head_dim
def test_head_dim_not_a_power_of_two(dim):
    q, k, v, cur_pos = (t.to(DEVICE) for t in make_inputs(3, 6, 2, 160, dim, [150, 20, 97]))
    _check_defaults(q, k, v, cur_pos, 8, 1, 16)


@pytest.mark.parametrize("align", [1, 32])
def test_many_middle_splits(align, monkeypatch):
    """One row, one KV head: _num_splits asks for several middle splits, the middle not a multiple of them."""
    monkeypatch.setattr(triton_decode, "_processors", lambda device: 16)
    monkeypatch.setattr(triton_decode, "SPLIT_BLOCKS", 1)  # a split per key block
    q, k, v, cur_pos = (t.to(DEVICE) for t in make_inputs(1, 4, 1, 300, 32, [283]))
    geometry_splits = triton_decode._num_splits(1, 300 - 8, 16, q.device)
    assert geometry_splits > 3
    _check_defaults(q, k, v, cur_pos, 8, align, 16)


@pytest.mark.parametrize(("chunk", "elements", "heads"), [(1, 16, 2), (2, 32, 2), (4, 1024, 16)])
def test_the_merge_reads_partials_elements_and_heads_in_blocks_of_any_size(chunk, elements, heads, monkeypatch):
    """More middle splits than the merge reads at once (its running maximum carries across chunks, each chunk's
    partials rescaled onto the next), more (query head, dim) elements than it holds at once (3 KV heads of 2 query
    heads of 32: 64 per head) and more KV heads than the verdict adds at once: the reference's outputs, d and n."""
    monkeypatch.setattr(triton_decode, "_processors", lambda device: 64)
    monkeypatch.setattr(triton_decode, "SPLIT_BLOCKS", 1)
    monkeypatch.setitem(triton_launch.MERGE, "CHUNK_S", chunk)
    monkeypatch.setitem(triton_launch.MERGE, "BLOCK_E", elements)
    monkeypatch.setitem(triton_launch.MERGE, "BLOCK_H", heads)
    triton_decode._static.cache_clear()
    try:
        q, k, v, cur_pos = (t.to(DEVICE) for t in make_inputs(2, 6, 3, 300, 32, [283, 250]))
        assert triton_decode._num_splits(2 * 3, 300 - 8, 16, q.device) > 2 * chunk
        _check_defaults(q, k, v, cur_pos, 8, 1, 16)
        ref = speculative_flash_decode(q, k, v, cur_pos, 8, 0.5)
        out = triton_decode.speculative_flash_decode_triton(q, k, v, cur_pos, 8, 0.5, chunk_size=16)
        torch.testing.assert_close(out.n, ref.n, atol=1e-5, rtol=1e-5)
    finally:
        triton_decode._static.cache_clear()


def test_repeated_calls_give_the_same_bits_and_leave_the_tickets_at_zero():
    """Which program merges depends on scheduling (on a GPU), what it computes does not: d, n and both outputs are
    the same bits call after call, per-row lambda, trivial rows and left padding included; every ticket is back at
    zero when a call ends, so the next call (another layer, another shape) starts clean."""
    q, k, v, cur_pos = make_inputs(len(PAD_CUR), 6, 2, 112, 32, PAD_CUR, start=PAD_START)
    start = torch.tensor(PAD_START)
    q, k, v, cur_pos, start = (t.to(DEVICE) for t in (q, k, v, cur_pos, start))
    lam = torch.tensor([0.1, 0.5, 1.0, 0.0, float("inf")], device=DEVICE)
    runs = [triton_decode.speculative_flash_decode_triton(q, k, v, cur_pos, 8, lam, chunk_size=16, start=start)
            for _ in range(5 if DEVICE == "cpu" else 20)]
    for run in runs[1:]:
        for a, b in zip(run, runs[0]):
            assert torch.equal(a, b)
    assert not triton_decode._scratch.tickets[q.device].any()
    smaller = triton_decode.speculative_flash_decode_triton(q[:2], k[:2, :, :60], v[:2, :, :60], cur_pos[:2] - 50,
                                                            8, 0.5, chunk_size=16)
    reference = speculative_flash_decode(q[:2], k[:2, :, :60], v[:2, :, :60], cur_pos[:2] - 50, 8, 0.5)
    torch.testing.assert_close(smaller.exact, reference.exact, atol=1e-5, rtol=1e-5)
    assert not triton_decode._scratch.tickets[q.device].any()


def test_a_middle_split_streams_at_least_split_blocks_blocks(monkeypatch):
    """Short contexts take fewer, longer splits (the merge then reads fewer partials); long ones as many as fill
    SPLIT_WAVES programs per processor."""
    monkeypatch.setattr(triton_decode, "_processors", lambda device: 132)
    cpu = torch.device("cpu")
    blocks = triton_decode.SPLIT_BLOCKS * 64
    assert triton_decode._num_splits(8, 1984, 64, cpu) == 1 + -(-1984 // blocks)
    assert triton_decode._num_splits(8, 4 * blocks, 64, cpu) == 1 + 4
    assert triton_decode._num_splits(8, 4 * blocks + 1, 64, cpu) == 1 + 5
    assert triton_decode._num_splits(8, 2**17, 64, cpu) == 1 + -(-triton_decode.SPLIT_WAVES * 132 // 8)
    assert triton_decode._num_splits(8, 0, 64, cpu) == 2
