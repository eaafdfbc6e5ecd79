"""Which decode kernel runs, decided before anything launches: kernel=auto takes kernel=model where the Triton
kernels cannot run (and the results say why in one line); kernel=triton that cannot run is refused before the
model loads. The fit itself comes from compiled binaries (tests/kernels/test_triton_compile.py); here it is a
stand-in, since no GPU is here."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig

from alspec_eval.backends import sim
from alspec_eval.config import ConfigError, SpeculationConfig
from alspec_eval.kernels import triton_launch

CUDA = torch.device("cuda")
LLAMA3_8B = LlamaConfig(hidden_size=4096, num_attention_heads=32, num_key_value_heads=8)


@pytest.fixture
def sm86(monkeypatch: pytest.MonkeyPatch) -> list[tuple]:
    """An sm_86 GPU where fp32 does not fit; the shapes asked about, in order."""
    asked = []
    monkeypatch.setattr(triton_launch, "arch_of", lambda device: triton_launch.ARCHS[86])

    def misfit(dtype, group, head_dim, arch):
        asked.append((dtype, group, head_dim, arch.capability))
        return "the decode kernel needs 143424 bytes of shared memory per block, sm_86 allows 101376" \
            if dtype == torch.float32 else None

    monkeypatch.setattr(triton_launch, "misfit", misfit)
    return asked


def test_the_attention_shape_of_a_config() -> None:
    assert sim.attention_shape(LLAMA3_8B) == (128, 4)
    assert sim.attention_shape(LlamaConfig(hidden_size=64, num_attention_heads=4, head_dim=32)) == (32, 1)


def test_auto_runs_triton_where_the_shape_fits(sm86) -> None:
    assert sim.choose_kernel("auto", CUDA, True, torch.bfloat16, LLAMA3_8B) == (
        "triton", "triton: kernel=auto, and it fits sm_86")
    assert sm86 == [(torch.bfloat16, 4, 128, 86)]  # scalar and per-row lambda share one binary


def test_auto_takes_the_model_kernel_where_triton_does_not_fit_and_says_why(sm86) -> None:
    assert sim.choose_kernel("auto", CUDA, True, torch.float32, LLAMA3_8B) == (
        "model", "model: kernel=auto found that the decode kernel needs 143424 bytes of shared memory per block, "
                 "sm_86 allows 101376 (torch.float32, head_dim 128, 4 query heads per KV head)")


def test_auto_takes_the_model_kernel_off_cuda_without_triton_or_for_other_formulas(sm86, monkeypatch) -> None:
    assert sim.choose_kernel("auto", CUDA, False, torch.bfloat16, LLAMA3_8B)[0] == "model"
    assert sim.choose_kernel("auto", torch.device("cpu"), True, torch.bfloat16, LLAMA3_8B)[0] == "model"
    monkeypatch.setattr(sim.importlib.util, "find_spec", lambda name: None)
    assert sim.choose_kernel("auto", CUDA, True, torch.bfloat16, LLAMA3_8B) == (
        "model", "model: kernel=auto found no triton (pip install triton)")
    assert not sm86  # nothing compiled


def test_kernel_triton_that_cannot_run_is_refused_before_loading(sm86) -> None:
    backend = sim.SimBackend(SpeculationConfig(kernel="triton"))
    with pytest.raises(ConfigError, match=r"^kernel=triton cannot run here: the decode kernel needs 143424 bytes .* "
                                          r"\(torch.float32, head_dim 128, 4 query heads per KV head\); use kernel=auto"):
        backend.check_model(LLAMA3_8B, 1, CUDA, torch.float32)
    backend.check_model(LLAMA3_8B, 1, CUDA, torch.bfloat16)  # fits
    LLAMA3_8B_FP32 = LlamaConfig(hidden_size=4096, num_attention_heads=32, num_key_value_heads=8, dtype="float32")
    with pytest.raises(ConfigError, match="kernel=triton cannot run here"):
        backend.check_model(LLAMA3_8B_FP32, 1, CUDA, None)  # dtype=auto: the config's


def test_dtype_auto_checks_the_configs_dtype(sm86) -> None:
    bf16 = LlamaConfig(hidden_size=4096, num_attention_heads=32, num_key_value_heads=8, dtype="bfloat16")
    sim.SimBackend(SpeculationConfig(kernel="triton")).check_model(bf16, 1, CUDA, None)  # fits: bf16, not fp32
    assert {shape[0] for shape in sm86} == {torch.bfloat16}


def test_kernel_triton_off_cuda_is_refused_before_loading(monkeypatch) -> None:
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="kernel=triton runs on CUDA"):
        sim.SimBackend(SpeculationConfig(kernel="triton")).check_model(LLAMA3_8B, 1, torch.device("cpu"), None)


@pytest.mark.slow
def test_the_results_say_which_kernel_ran_and_why() -> None:
    from helpers import alspec_lm
    from alspec_eval.approx_check.models import tiny_model

    stats = alspec_lm(tiny_model(layers=1)).statistics()
    assert stats["provenance"]["kernel"] == "model: kernel=auto runs triton on CUDA only, not on cpu"


@pytest.mark.slow
def test_the_adapter_refuses_kernel_triton_before_the_weights_load(tmp_path, monkeypatch, sm86) -> None:
    """The adapter hands the backend its device and dtype before loading: kernel=triton off CUDA, and on a GPU where
    the kernels do not fit, stop there."""
    import transformers

    from alspec_eval.adapter import ALSpecLM
    from alspec_eval.approx_check.models import save_tiny

    path = save_tiny(tmp_path / "tiny")

    def no_weights(*args, **kwargs):
        raise AssertionError("the weights were loaded")

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", no_weights)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="kernel=triton runs on CUDA"):
        ALSpecLM(pretrained=path, kernel="triton", device="cpu")
    seen = []
    real = sim.SimBackend.check_model
    monkeypatch.setattr(sim.SimBackend, "check_model", lambda self, *args: seen.append(args[2:]) or real(self, *args))
    with pytest.raises(ValueError, match="kernel=triton runs on CUDA"):
        ALSpecLM(pretrained=path, kernel="triton", device="cpu", dtype="bfloat16")
    assert seen == [(torch.device("cpu"), torch.bfloat16)]
