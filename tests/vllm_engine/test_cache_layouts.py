"""Every verification path over every KV-cache layout vLLM allocates, against the float64 oracle of test_paged.py.

vLLM allocates its KV caches by ``KVCacheLayout`` and hands each attention layer a (num_blocks, Hkv, N, 2D) view of
one shared buffer whose strides are the layout's: on CUDA, FlashAttention and Triton declare no layout, so vLLM's
default order gives them LBNHC (NHD), a permuted view; CPU_ATTN declares LBHNC. The caches here are built by vLLM's
own allocation code (``compute_layout_strides``, ``create_kv_cache_views``), so a vLLM that changes its layouts or
their views turns these tests red; the step is test_paged.py's (shuffled and shared blocks, garbage in every
unwritten slot), written into layer 1 of three, the other layers garbage too.
"""

from __future__ import annotations

import math

import pytest
import torch

kv_cache_layout = pytest.importorskip("vllm.v1.kv_cache_layout", reason="vLLM is not installed (.venv-vllm)")
pytest.importorskip("triton", reason="triton is not installed")

from test_paged import LAYOUTS, build_step, oracle, row_index, split_lambda

from alspec_eval.approximations import make_approximation
from alspec_eval.stats import ACCEPTED, REJECTED, TRIVIAL
from alspec_eval.vllm.paged import Settings, StepRows
from alspec_eval.vllm.verifiers import VERIFIERS, choose, verify_layer

KVCacheLayout = kv_cache_layout.KVCacheLayout
LAYERS, LAYER = 3, 1


def vllm_view(cache: torch.Tensor, layout: "KVCacheLayout") -> torch.Tensor:
    """``cache`` (num_blocks, Hkv, N, 2D) copied into layer LAYER of a LAYERS-layer allocation made as vLLM's worker
    makes it in ``layout`` (its strides, its views), every other byte of the buffer garbage; returns that layer's
    view."""
    from vllm.v1.kv_cache_interface import (FullAttentionSpec, KVCacheTensor, compute_layout_strides,
                                            create_kv_cache_views)

    blocks, heads, size, twice = cache.shape
    spec = FullAttentionSpec(block_size=size, num_kv_heads=heads, head_size=twice // 2, dtype=cache.dtype)
    layer_stride, block_stride, *_ = compute_layout_strides(spec, blocks, LAYERS, layout)
    total = LAYERS * blocks * spec.page_size_bytes
    raw = torch.full((total // cache.element_size(),), -3e4, dtype=cache.dtype).view(torch.int8)
    views = create_kv_cache_views(raw, spec, blocks, layout, KVCacheTensor(
        size=total, layers=[f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)], layer_stride=layer_stride,
        block_stride=block_stride))
    view = views[LAYER]
    assert view.shape == cache.shape and view.dtype == cache.dtype
    view.copy_(cache)
    return view


@pytest.mark.slow  # vLLM's platform detection starts a process
def test_the_layouts_users_get() -> None:
    """What these tests stand for: vLLM's default order (FlashAttention and Triton declare none) puts NHD first, a
    view that is not contiguous; CPU_ATTN declares HND (LBHNC), contiguous per layer."""
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend
    from vllm.v1.attention.backends.utils import get_supported_kv_cache_layouts

    assert get_supported_kv_cache_layouts([])[0] == KVCacheLayout.LBNHC
    assert tuple(CPUAttentionBackend.supported_kv_cache_layouts()) == (KVCacheLayout.LBHNC,)
    step = build_step("plain", 8)
    assert not vllm_view(step["cache"], KVCacheLayout.LBNHC).is_contiguous()
    assert vllm_view(step["cache"], KVCacheLayout.LBHNC).is_contiguous()


# (block size, head dim), draft, window, alignment: blocks of 16 and of 32 (vLLM's CPU default and more)
CASES = [((16, 8), "sink", 8, 1), ((32, 8), "local", 8, 1), ((32, 16), "sink", 32, 32)]


def decide(step: dict, cache: torch.Tensor, approx: str, S: int, align: int, lam: float, path: str):
    out = step["output"].clone()
    rows = StepRows.build(step["qsl"], step["seq_lens"], step["starts"], torch.arange(5))
    settings = Settings(thresholds=(lam,), window=S, window_align=align, approx=make_approximation(approx))
    codes, ratios = verify_layer(step["query"], out, cache, step["layout"], step["table"], step["N"], rows, settings,
                                 0, step["scale"], verifier=VERIFIERS[path]())
    return codes, ratios, out, rows


def check_against_oracle(step: dict, cache: torch.Tensor, approx: str, S: int, align: int, paths: list[str]) -> None:
    """Each path's codes equal the oracle's decisions row by row (lambda between the ratios, away from ties), its
    d/n to float32 rounding, accepted rows committed A~ and the rest A untouched; the paths agree with each other."""
    want = oracle(step, approx, align)
    rows_tok = [t for t, (r, p) in enumerate(step["tok"]) if p >= step["starts"][r]]
    lam = split_lambda([want[t][2] / want[t][3] for t in rows_tok if not want[t][0]])
    got = {}
    for path in paths:
        codes, ratios, out, rows = decide(step, cache, approx, S, align, lam, path)
        for i, t in enumerate(row_index(step, rows)):
            trivial, At, d, n = want[t]
            if trivial:
                assert codes[i] == TRIVIAL and math.isnan(ratios[i]), path
                continue
            assert ratios[i].item() == pytest.approx(d / n, rel=1e-5), path
            assert codes[i] == (ACCEPTED if d <= lam * n else REJECTED), path
            if d <= lam * n:
                torch.testing.assert_close(out[t].double(), At, rtol=0, atol=1e-5)
            else:
                assert torch.equal(out[t], step["output"][t]), path
        assert set(codes.tolist()) == {TRIVIAL, ACCEPTED, REJECTED}, path
        got[path] = codes
    assert all(torch.equal(codes, got[paths[0]]) for codes in got.values())


# every layout at blocks of 16 and 32; the aligned window of 32 (its tiles' reads span blocks) on CUDA's default
# layout and on the block-outermost one whose per-layer view read right by accident at blocks of 16 only
PLAIN = [(layout, *case) for layout in KVCacheLayout for case in CASES[:2]] + \
    [(layout, *CASES[2]) for layout in (KVCacheLayout.LBNHC, KVCacheLayout.BHLNC)]


@pytest.mark.parametrize("layout,geometry,approx,S,align", PLAIN,
                         ids=[f"{c[0].name}-{c[1][0]}-{c[2]}-{c[4]}" for c in PLAIN])
def test_plain_paths_read_every_layout(layout: "KVCacheLayout", geometry, approx: str, S: int, align: int) -> None:
    """FlashAttention's and Triton's packing in each of vLLM's six layouts: the gathered path, the tiles and the
    paged Triton verifier (Triton's interpreter here) decide as the oracle."""
    step = build_step("plain", S, geometry=geometry)
    check_against_oracle(step, vllm_view(step["cache"], layout), approx, S, align, ["gathered", "tiles", "triton"])


@pytest.mark.parametrize("geometry,approx,S,align", CASES, ids=["16-sink", "32-local", "32-sink-aligned"])
def test_cpu_attn_paths_read_its_layout(geometry, approx: str, S: int, align: int) -> None:
    """CPU_ATTN's packing (keys transposed per block) in the layout it declares, LBHNC, in vLLM's allocation: the C
    kernel, its listed keys' kernel, the tiles and the gathered path decide as the oracle; ``choose`` picks the C
    kernel there, and the listed keys' kernel for a draft that selects by content."""
    step = build_step("cpu-vec", S, geometry=(geometry[0], 16))
    cache = vllm_view(step["cache"], KVCacheLayout.LBHNC)
    settings = Settings(thresholds=(0.1,), window=S, window_align=align, approx=make_approximation(approx))
    assert choose(settings.approx, LAYOUTS["cpu-vec"], cache).name == "native"
    assert choose(make_approximation("topk"), LAYOUTS["cpu-vec"], cache).name == "listed"
    check_against_oracle(step, cache, approx, S, align, ["native", "listed", "tiles", "gathered"])


def test_the_verifier_chosen_on_a_plain_cuda_cache(monkeypatch: pytest.MonkeyPatch) -> None:
    """On a CUDA cache of a plain layout a draft that declares keys_by_position goes to the Triton verifier, in
    every layout; a draft that selects by content is gathered; without Triton, tiles. (A CPU tensor stands in for
    CUDA here.)"""
    import alspec_eval.vllm.verifiers as verifiers

    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    step = build_step("plain", 8)
    sink, topk = make_approximation("sink"), make_approximation("topk")
    for layout in KVCacheLayout:
        cache = vllm_view(step["cache"], layout)
        assert choose(sink, LAYOUTS["plain"], cache).name == "triton", layout
        assert choose(topk, LAYOUTS["plain"], cache).name == "gathered", layout
    monkeypatch.setattr(verifiers, "_triton_installed", lambda: False)
    assert choose(sink, LAYOUTS["plain"], cache).name == "tiles"
