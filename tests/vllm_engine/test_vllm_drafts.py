"""The acceptance test of every draft inside vLLM: on the embedded SmolLM2 in float32, --model alspec-vllm gives
--model alspec's texts and log-likelihoods, and per task and layer the same speculated, accepted and trivial counts,
for each draft that runs in vLLM (one list parametrizes the test), and per layer the same d/n but for rounding at
nearly every position (a draft that keeps other keys moves some by about 1e-3). Each draft's lambda accepts at least
5% of the positions on both engines, and no measured d/n lies within 1e-4 of it (a decision float noise could flip).
Every draft is compared on a prompt of over 600 tokens with 24 decode steps: at 2S = 64 the fewest-norm keys of its
layer 0 end inside runs of one token's keys, whose norms the two engines' rotations round apart (KnormPress's
near-ties).

One vLLM engine (conftest's ``alspec_smol``) and one HF model serve every draft; each reconfigures them."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")
import torch
from lm_eval.api.instance import Instance

from alspec_eval.config import SpeculationConfig
from alspec_eval.stats import DENSITY, PROMISE_DENOMINATOR, PROMISE_DN, AcceptanceStats
from conftest import ENGINE, speculating
from default_approximations import APPROXIMATIONS, approx_args
from default_presses import PRESSES, press_args

pytestmark = pytest.mark.slow

WINDOW = 32
GEN_KWARGS = {"until": [], "max_gen_toks": 25, "do_sample": False}  # 24 decode steps (the first is prefill's)
DECODE_STEPS = 24
PROMPT_TOKENS = 600
RATIO_TOLERANCE = 2e-5  # d/n of the same keys agree to a few 1e-7 here; a key kept otherwise moves d/n by ~1e-3
# Deep layers' keys differ between the engines by their accumulated rounding, so a near-tie of a score at the 2S cut
# can keep another key there: measured, KeyDiff 2 of 2,400 (layer, position) ratios (layers 22 and 26), CUR 9 (all
# in layer 15), the others none
APART_SHARE = 0.01


def _args(name: str) -> dict:
    return press_args(name, WINDOW) if name in PRESSES else approx_args(name, WINDOW)


def _runs_in_vllm(name: str) -> bool:
    return not SpeculationConfig(window=WINDOW, **_args(name)).approx.hf_only


# every draft that runs in vLLM, with a lambda at which it accepts >= 5% and no d/n sits within 1e-4 of it
# (found by running --model alspec at a lambda, moving it into a wide gap between measured ratios, and again)
LAMBDAS = {"sink": 0.10217, "local": 0.29602, "quest": 0.12267, "topk": 0.04207, "snapkv": 0.13323,
           "KnormPress": 0.50863, "KeyDiffPress": 0.3332, "CURPress": 0.43839, "LagKVPress": 0.24066,
           "RandomPress": 0.76046, "StreamingLLMPress": 0.07684, "vattention": 0.18126}
DRAFTS = APPROXIMATIONS + [p for p in PRESSES if _runs_in_vllm(p)]


def passage(start: int, length: int) -> str:
    from importlib import resources

    text = " ".join((resources.files("alspec_eval") / "data" / "haystack.txt").read_text(encoding="utf-8").split())
    return text[start:start + length]


def long_prompt() -> str:
    """632 tokens of the novel (the package's copy), continued as prose (no end of sequence in 25 tokens): the
    passage on which vLLM's KnormPress once decided apart from hf's, 390 characters longer."""
    return passage(28431, 2760)


def requests() -> dict[str, list[Instance]]:
    """A prompt of 632 tokens (2S = 64) generating 25 tokens, and two continuations of about 15 and 40 tokens."""
    gen = [Instance("generate_until", {}, (long_prompt(), dict(GEN_KWARGS)), 0, ("gen", 0, 1))]
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
            self.ratios.append(ratios.detach().float().cpu().reshape(-1, ratios.shape[-1]))  # (positions, layers)
            return original(cls, codes, ratios, *args, **kwargs)

        monkeypatch.setattr(AcceptanceStats, "from_trace", classmethod(from_trace))

    def measured(self) -> list[torch.Tensor]:
        """Per layer, every measured d/n of the evaluation, in increasing order (the engines order requests
        otherwise)."""
        every = torch.cat(self.ratios) if self.ratios else torch.zeros(0, 0)
        return [column[~column.isnan()].sort().values for column in every.T]


def evaluate(lm, monkeypatch) -> tuple[dict, list, list[torch.Tensor]]:
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
    assert len(hf_smol.tok_encode(long_prompt())) >= PROMPT_TOKENS
    for measured in (torch.cat(hf_ratios), torch.cat(ratios)):
        assert len(measured) and float((measured <= lam).float().mean()) >= 0.05, name
        assert float((measured - lam).abs().min()) > 1e-4, (name, float((measured - lam).abs().min()))
    gen = [(layer["speculated"] + layer["trivial"]) for layer in tasks["gen"]["layers"]]
    assert min(gen) >= DECODE_STEPS, gen  # the long prompt decoded 24 steps in every layer (no early stop)
    assert out[0] == hf_out[0]  # texts
    # log-likelihoods, summed over up to 40 tokens in float32 by two engines' kernels; greedy flags exactly
    assert [x[1] for x in out[1]] == [x[1] for x in hf_out[1]]
    assert [x[0] for x in out[1]] == pytest.approx([x[0] for x in hf_out[1]], rel=1e-5)
    assert counts(tasks) == counts(hf_tasks)
    # the densities of the same positions (where the draft's budget varies, vattention's, from the keys each read)
    assert [t["total"][DENSITY] for t in tasks.values()] == pytest.approx([t["total"][DENSITY]
                                                                            for t in hf_tasks.values()])
    for key in (PROMISE_DN, PROMISE_DENOMINATOR):  # a promising draft's realized shares; none for the others
        assert [t["total"].get(key) for t in tasks.values()] == pytest.approx(
            [t["total"].get(key) for t in hf_tasks.values()], abs=2e-3), key
    assert (PROMISE_DN in tasks["gen"]["total"]) == (name == "vattention")
    assert sum(t["total"]["accepted"] for t in tasks.values()) > 0
    # the same keys: per layer the same d/n but for rounding at nearly every position, not only the same decisions
    assert [len(r) for r in ratios] == [len(r) for r in hf_ratios]
    apart = sum(int(((a - b).abs() > RATIO_TOLERANCE).sum()) for a, b in zip(ratios, hf_ratios))
    assert apart <= APART_SHARE * sum(map(len, ratios)), (name, apart, sum(map(len, ratios)))
