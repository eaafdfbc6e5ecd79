"""On a CUDA GPU (skipped without one): alspec-vllm's verification of one layer, per draft, on a cache in vLLM's
FlashAttention layout (NHD, a permuted view) on the GPU decides as the same call on the CPU, row for row, and commits
the same A~, in float32. vLLM itself cannot be installed beside the GPU machines' torch, so the verifiers are called
as the engine calls them (benchmarks/bench_paged_drafts.py's setup). A decode step's rows in order (the drafts' keys
read in place) and a step whose rows repeat a request (gathered) both run. RandomPress is left out: its draws come
from the device's own generator."""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest
import torch

from alspec_eval.host_waits import host_waits
from default_approximations import APPROXIMATIONS, approx_args
from default_presses import PRESSES, press_args

pytestmark = [pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
              pytest.mark.filterwarnings("ignore")]

WINDOW, BLOCK, HQ, HKV, DIM, SHARPNESS = 16, 16, 4, 2, 32, 4.0
CONTEXTS = [300, 527, 1024]  # contexts that end inside a block and at its end
# (query_start_loc, tokens per request): one decode row each; the last request three rows (a chunk of its prompt)
STEPS = {"decode": [0, 1, 2, 3], "chunk": [0, 1, 2, 5]}


def _config(name: str) -> dict:
    return press_args(name, WINDOW) if name in PRESSES else approx_args(name, WINDOW)


def _approx(name: str):
    from alspec_eval.approximations import make_approximation

    config = _config(name)
    return make_approximation(config["approx"], config.get("approx_args"))


# every draft alspec-vllm runs without a prompt observed (prompt-scoring drafts need vLLM's prefill)
DRAFTS = [n for n in APPROXIMATIONS + [p for p in PRESSES if p != "RandomPress"]
          if not _approx(n).hf_only and not _approx(n).prompt_keys]


def _layer(name: str, device: str, step: str, lam: float) -> tuple[Callable[[], tuple], str]:
    """One layer's verification of ``step`` as the engine calls it (its first call builds the step's plan), and the
    verifier the engine chose: each call returns the codes, d/n and output, on the CPU."""
    from alspec_eval.vllm import kept
    from alspec_eval.vllm.paged import Settings, StepRows, layout_for
    from alspec_eval.vllm.verifiers import choose, verify_and_count

    generator = torch.Generator().manual_seed(0)
    blocks = -(-max(CONTEXTS) // BLOCK)
    memory = torch.randn(len(CONTEXTS) * blocks, BLOCK, HKV, 2 * DIM, generator=generator)
    table = torch.randperm(len(memory), generator=generator).view(len(CONTEXTS), blocks).int().to(device)
    qsl = torch.tensor(STEPS[step])
    tokens = int(qsl[-1])
    query = SHARPNESS * torch.randn(tokens, HQ, DIM, generator=generator).to(device)  # peaked: some rows accept
    exact = torch.randn(tokens, HQ, DIM, generator=generator).to(device)
    approx = _approx(name)
    cache = memory.to(device).permute(0, 2, 1, 3)  # (blocks, Hkv, N, 2D) in NHD memory: FlashAttention's forward's
    layout = layout_for("FLASH_ATTN")
    verifier = choose(approx, layout, cache)
    summaries = kept.allocate(approx, cache, layout) if approx.kept_page() else None
    rows = StepRows.build(qsl, torch.tensor(CONTEXTS), torch.zeros(len(CONTEXTS), dtype=torch.long),
                          torch.arange(len(CONTEXTS)), prompt_lens=torch.zeros(len(CONTEXTS), dtype=torch.long),
                          seeds=torch.arange(len(CONTEXTS)) + 7)
    settings = Settings(thresholds=(lam,), window=WINDOW, window_align=1, approx=approx)

    def call() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        output = exact.clone()
        codes, ratios, _ = verify_and_count(query, output, cache, layout, table, BLOCK, rows, settings, 0,
                                            DIM ** -0.5, verifier=verifier, kept=summaries)
        return codes, ratios, output

    return call, verifier.name


def _verify(name: str, device: str, step: str, lam: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, str]:
    call, path = _layer(name, device, step, lam)
    return *(t.cpu() for t in call()), path


@pytest.mark.parametrize("step", list(STEPS))
@pytest.mark.parametrize("name", DRAFTS)
def test_a_draft_verified_on_the_gpu_decides_as_on_the_cpu(name: str, step: str) -> None:
    """Lambda between the CPU's ratios (so that rows accept and reject, away from ties): the same rows measured,
    d/n within float32 rounding, the same decisions, the same output (A~ where accepted, A elsewhere)."""
    torch.backends.cuda.matmul.allow_tf32 = False
    ratios = sorted(r for r in _verify(name, "cpu", step, 0.1)[1].tolist() if not math.isnan(r))
    assert len(ratios) >= 2, "fewer than two rows measured: the test would compare nothing"
    middle = len(ratios) // 2
    lam = (ratios[middle - 1] + ratios[middle]) / 2
    cpu_codes, cpu_ratios, cpu_out, _ = _verify(name, "cpu", step, lam)
    codes, ratios_gpu, out, path = _verify(name, "cuda", step, lam)
    measured = ~torch.isnan(cpu_ratios)
    assert torch.equal(torch.isnan(ratios_gpu), ~measured), path
    torch.testing.assert_close(ratios_gpu[measured], cpu_ratios[measured], rtol=1e-4, atol=1e-6)
    near = (cpu_ratios - lam).abs() < 1e-4  # a decision within float32 rounding of lambda may go either way
    assert torch.equal(codes[~near], cpu_codes[~near]), path
    assert len(set(cpu_codes[measured].tolist())) == 2, "lambda split no rows: nothing accepted or rejected"
    torch.testing.assert_close(out, cpu_out, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("step", list(STEPS))
@pytest.mark.parametrize("name", DRAFTS)
def test_a_layer_after_the_steps_first_waits_for_nothing(name: str, step: str) -> None:
    """Once the step's plan is built (its first layer), a layer's verification never makes the host wait for the
    GPU (torch's sync debug mode: a read-back, a blocking copy): each wait would stall every layer of a decode step."""
    call, path = _layer(name, "cuda", step, 0.5)
    call()
    torch.cuda.synchronize()
    assert len(host_waits(lambda: torch.ones(1, device="cuda").item())) == 1  # the count sees a read-back
    assert host_waits(call) == [], path
