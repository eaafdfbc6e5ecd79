"""The acceptance test of every draft inside vLLM: on the embedded SmolLM2 in float32, --model alspec-vllm gives
--model alspec's texts and log-likelihoods, and per task and layer the same speculated, accepted and trivial counts,
for each draft that runs in vLLM (one list parametrizes the test). Each draft's lambda accepts at least 5% of the
positions on both engines, and no measured d/n lies within 1e-4 of it (a decision float noise could flip).

One vLLM engine (conftest's ``alspec_smol``) and one HF model serve every draft; each reconfigures them."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")
import torch
from lm_eval.api.instance import Instance

from alspec_eval.config import SpeculationConfig
from alspec_eval.stats import AcceptanceStats
from conftest import ENGINE, speculating
from default_approximations import approx_args
from default_presses import PRESSES, press_args

pytestmark = pytest.mark.slow

WINDOW = 32
GEN_KWARGS = {"until": ["\n\n"], "max_gen_toks": 12, "do_sample": False}


def _args(name: str) -> dict:
    return press_args(name, WINDOW) if name in PRESSES else approx_args(name, WINDOW)


def _runs_in_vllm(name: str) -> bool:
    return not SpeculationConfig(window=WINDOW, **_args(name)).approx.hf_only


# every draft that runs in vLLM, with a lambda at which it accepts >= 5% and no d/n sits within 1e-4 of it
# (found by running --model alspec at a lambda, moving it into a wide gap between measured ratios, and again)
LAMBDAS = {"sink": 0.10223, "local": 0.2369, "quest": 0.10174, "topk": 0.04214, "snapkv": 0.10512,
           "KnormPress": 0.45413, "KeyDiffPress": 0.3103, "CURPress": 0.39167, "LagKVPress": 0.21339,
           "RandomPress": 0.69153, "StreamingLLMPress": 0.09951}
DRAFTS = ["sink", "local", "quest", "topk", "snapkv"] + [p for p in PRESSES if _runs_in_vllm(p)]


def passage(start: int, length: int) -> str:
    from importlib import resources

    text = " ".join((resources.files("alspec_eval") / "data" / "haystack.txt").read_text(encoding="utf-8").split())
    return text[start:start + length]


def requests() -> dict[str, list[Instance]]:
    """A prompt of about 250 tokens (2S = 64), and two continuations of about 15 and 40 tokens."""
    gen = [Instance("generate_until", {}, (passage(9000 + 1500 * i, 1000 + 800 * i), dict(GEN_KWARGS)), i,
                    ("gen", i, 1)) for i in range(1)]
    ll = [Instance("loglikelihood", {}, (passage(20000, 1200), passage(21200 + 50 * i, 60 + 100 * i)), i,
                   ("ll", i, 1)) for i in range(2)]
    return {"generate_until": gen, "loglikelihood": ll}


@pytest.fixture(scope="module")
def hf_smol(smollm2_path):
    from alspec_eval.adapter import ALSpecLM

    return ALSpecLM(pretrained=smollm2_path, dtype="float32", device="cpu", batch_size=4,
                    max_length=ENGINE["max_model_len"], window=WINDOW, **{"lambda": 0.0})


class Traced:
    """Every (codes, ratios) a request's statistics are reduced from, in the driver (both engines call
    AcceptanceStats.from_trace there)."""

    def __init__(self, monkeypatch) -> None:
        self.ratios: list[torch.Tensor] = []
        original = AcceptanceStats.from_trace.__func__

        def from_trace(cls, codes, ratios, *args, **kwargs):
            self.ratios.append(ratios.detach().float().cpu().flatten())
            return original(cls, codes, ratios, *args, **kwargs)

        monkeypatch.setattr(AcceptanceStats, "from_trace", classmethod(from_trace))

    def measured(self) -> torch.Tensor:
        flat = torch.cat(self.ratios) if self.ratios else torch.zeros(0)
        return flat[~flat.isnan()]


def evaluate(lm, monkeypatch) -> tuple[dict, list, torch.Tensor]:
    traced = Traced(monkeypatch)
    lm.reset_statistics()
    outputs = [getattr(lm, kind)(reqs) for kind, reqs in requests().items()]
    tasks = lm.statistics()["tasks"]
    return tasks, outputs, traced.measured()


def counts(tasks: dict) -> dict:
    return {name: [(layer["speculated"], layer["accepted"], layer["trivial"]) for layer in task["layers"]]
            for name, task in tasks.items()}


@pytest.mark.parametrize("name", DRAFTS)
def test_alspec_vllm_decides_as_model_alspec(alspec_smol, hf_smol, name, monkeypatch):
    lam, args = LAMBDAS[name], _args(name)
    hf_smol.reconfigure(lam=lam, approx=args["approx"], approx_args=args.get("approx_args"))
    hf_tasks, hf_out, hf_ratios = evaluate(hf_smol, monkeypatch)
    with speculating(alspec_smol, lam=lam, window=WINDOW, **args):
        tasks, out, ratios = evaluate(alspec_smol, monkeypatch)
    for measured in (hf_ratios, ratios):
        assert len(measured) and float((measured <= lam).float().mean()) >= 0.05, name
        assert float((measured - lam).abs().min()) > 1e-4, (name, float((measured - lam).abs().min()))
    assert out[0] == hf_out[0]  # texts
    # log-likelihoods, summed over up to 40 tokens in float32 by two engines' kernels; greedy flags exactly
    assert [x[1] for x in out[1]] == [x[1] for x in hf_out[1]]
    assert [x[0] for x in out[1]] == pytest.approx([x[0] for x in hf_out[1]], rel=1e-5)
    assert counts(tasks) == counts(hf_tasks)
    assert sum(t["total"]["accepted"] for t in tasks.values()) > 0
