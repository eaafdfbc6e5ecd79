"""vLLM's compiled mode around the speculating attention (docs/vllm.md, "vLLM's compiled mode").

The engines run compiled in conftest's SmolLM2 pair (no ``enforce_eager``), which the exactness tests use: lambda 0 =
plain vLLM, every draft's counts = ``--model alspec``'s, a sweep's cell = its single run. On the CPU, vLLM compiles
one Dynamo trace with Inductor and no CUDA graphs. What a CUDA engine would do is vLLM's own configuration logic,
which runs here without a GPU: its default (VLLM_COMPILE, ``cudagraph_mode`` FULL_AND_PIECEWISE at optimization level
O2) splits the graph at attention, and with the wrapped backend's builder it keeps piecewise graphs only, so no
graph holds the speculating attention; FlashAttention's and Triton's own builders would get full decode graphs."""

from __future__ import annotations

import importlib

import pytest

pytest.importorskip("vllm")

pytestmark = pytest.mark.slow  # importing vLLM's backends starts a process (the tiers' guard, tests/conftest.py)

ATTENTION = "vllm::unified_attention_with_output"
CUDA_BACKENDS = [("flash_attn", "FlashAttentionBackend", "flash"), ("triton_attn", "TritonAttentionBackend", "triton")]


def cuda_default():
    """The compilation config a CUDA user gets without enforce_eager: VLLM_COMPILE, O2's cudagraph_mode, the split
    vLLM derives from them."""
    from vllm.config import CompilationConfig, CompilationMode
    from vllm.config.vllm import OPTIMIZATION_LEVEL_TO_CONFIG, OptimizationLevel

    mode = OPTIMIZATION_LEVEL_TO_CONFIG[OptimizationLevel.O2]["compilation_config"]["cudagraph_mode"]
    config = CompilationConfig(mode=CompilationMode.VLLM_COMPILE, cudagraph_mode=mode)
    config.set_splitting_ops_for_v1(all2all_backend="", data_parallel_size=1)
    return config


@pytest.mark.parametrize("module,name,ours", CUDA_BACKENDS)
def test_vllms_cuda_default_keeps_the_speculating_attention_out_of_every_graph(module, name, ours):
    from vllm.config import CUDAGraphMode
    from vllm.v1.attention.backend import AttentionCGSupport

    base = getattr(importlib.import_module(f"vllm.v1.attention.backends.{module}"), name)
    config = cuda_default()
    assert config.cudagraph_mode == CUDAGraphMode.FULL_AND_PIECEWISE
    assert ATTENTION in config.splitting_ops  # the graph is cut at every attention: it runs between the pieces
    own = base.get_builder_cls().get_cudagraph_support(None, None)
    assert own != AttentionCGSupport.NEVER
    assert config.resolve_cudagraph_mode_and_sizes(own, name, 1, max_num_reqs=8).has_full_cudagraphs()
    ours = getattr(importlib.import_module(f"alspec_eval.vllm.backends.{ours}"), f"ALSpec{name}")
    support = ours.get_builder_cls().get_cudagraph_support(None, None)
    assert support == AttentionCGSupport.NEVER
    config = cuda_default()
    assert config.resolve_cudagraph_mode_and_sizes(support, ours.__name__, 1, max_num_reqs=8) == CUDAGraphMode.PIECEWISE

