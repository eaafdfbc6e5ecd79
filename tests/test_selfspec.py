"""policy=selfspec: greedy self-speculative decoding with a sink-attention draft.

Lossless against greedy decoding; tau against a step-by-step reference that shares no code with the decoder's
loop (fresh caches for every drafted token, verification by one uncached exact forward of the whole sequence).
"""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import DynamicCache

from alspec_eval.adapter import ALSpecLM
from alspec_eval.approx_check.models import tiny_model
from alspec_eval.compat import with_cache
from alspec_eval.config import ConfigError, SpeculationConfig
from alspec_eval.hooks import speculation
from alspec_eval.region import DecodeRegion
from alspec_eval.selfspec import selfspec_generate
from lm_eval.api.instance import Instance

from helpers import GEN_KWARGS, PROMPTS, TOKENIZER, alspec_lm, gen_requests, hf_lm, sample_stats

WINDOW = 4


def reference(model, prompt: list[int], max_new: int, gamma: int) -> tuple[list[int], list[int]]:
    """Generated tokens and accepted drafts per step, one token at a time: each draft token from a fresh exact
    prefill of the committed tokens, then sink attention over it; each drafted token verified by the argmax of an
    uncached exact forward over everything before it."""
    def exact_next(tokens: list[int]) -> list[int]:
        with torch.no_grad():
            return model(torch.tensor([tokens])).logits[0].argmax(-1).tolist()

    out, steps = [exact_next(prompt)[-1]], []
    with speculation(model) as speculator:
        while len(out) < max_new:
            committed, drafts = prompt + out, []
            for _ in range(min(gamma, max_new - len(out) - 1)):
                cache = DynamicCache(config=model.config)
                with torch.no_grad():
                    model(torch.tensor([committed[:-1]]), **with_cache(model, cache), use_cache=True)
                    with speculator.speculating(DecodeRegion.build([0], [0]), SpeculationConfig(policy="always", window=WINDOW)):
                        logits = model(torch.tensor([[committed[-1], *drafts]]), **with_cache(model, cache)).logits
                drafts.append(int(logits[0, -1].argmax()))
            verified = exact_next(committed + drafts)[len(committed) - 1:]
            accepted = 0
            while accepted < len(drafts) and drafts[accepted] == verified[accepted]:
                accepted += 1
            out += drafts[:accepted] + [verified[accepted]]
            steps.append(accepted)
    return out, steps


@pytest.mark.slow
@pytest.mark.parametrize("gamma", [1, 3])
def test_tau_matches_the_step_by_step_reference(gamma):
    model = tiny_model(layers=3)
    prompt = TOKENIZER(PROMPTS[0])["input_ids"]
    expected_tokens, expected_steps = reference(copy.deepcopy(model), prompt, 20, gamma)
    config = SpeculationConfig(policy="selfspec", window=WINDOW, gamma=gamma)
    with speculation(model) as speculator:
        tokens, stats = selfspec_generate(model, speculator, config, prompt, 20, gamma, lambda t: None)
    assert tokens == expected_tokens
    assert stats.hist == [expected_steps.count(k) for k in range(gamma + 1)]
    assert stats.tau == pytest.approx(len(tokens[1:]) / len(expected_steps))  # every step's tokens, then 1 prefill
    assert 0 < stats.accepted < stats.drafted  # the draft is neither always right nor always wrong here


# transformers 5.24 renamed the cache argument: the project passes the installed version's name (compat.py)
@pytest.mark.filterwarnings("error:`past_key_values` is deprecated:FutureWarning")
@pytest.mark.slow
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_outputs_equal_greedy_baseline_and_batches_agree(arch):
    model = tiny_model(arch, layers=3)
    baseline = alspec_lm(model, policy="exact").generate_until(gen_requests())
    per_batch = {}
    for batch in (1, 4):
        requests = gen_requests()
        assert alspec_lm(model, batch_size=batch, policy="selfspec", gamma=3, window=WINDOW).generate_until(requests) == baseline
        per_batch[batch] = sample_stats(requests)
    assert per_batch[1] == per_batch[4]
    assert all(s["selfspec"]["steps"] > 0 and s["speculated"] == 0 for s in per_batch[1])


@pytest.mark.slow
def test_task_statistics_sum_the_samples_and_loglikelihood_is_exact():
    from helpers import ll_requests

    model = tiny_model(layers=3)
    lm = alspec_lm(model, policy="selfspec", gamma=2, window=WINDOW)
    requests = gen_requests()
    lm.generate_until(requests)
    task = lm.statistics()["tasks"]["gen"]
    assert task["selfspec"]["steps"] == sum(s["selfspec"]["steps"] for s in sample_stats(requests))
    assert task["selfspec"]["accepted"] == sum(k * n for k, n in enumerate(task["selfspec"]["hist"]))
    assert task["selfspec"]["tau"] == pytest.approx(1 + task["selfspec"]["accepted"] / task["selfspec"]["steps"])
    exact = alspec_lm(model, policy="exact").loglikelihood(ll_requests())
    assert lm.loglikelihood(ll_requests()) == exact


@pytest.mark.parametrize("args, message", [
    ({"policy": "dynamic", "gamma": 4}, "gamma=4 only applies to policy=selfspec"),
    ({"policy": "selfspec", "gamma": 0}, "gamma=0 is invalid"),
    ({"policy": "selfspec", "gamma": "two"}, "gamma='two' is invalid"),
])
def test_bad_gamma_is_one_line(args, message):
    with pytest.raises(ConfigError, match=message):
        SpeculationConfig(**args)


@pytest.mark.slow
def test_sampling_is_refused():
    lm = alspec_lm(tiny_model(layers=2), policy="selfspec")
    requests = gen_requests()
    for r in requests:
        r.arguments = (r.arguments[0], {**GEN_KWARGS, "do_sample": True})
    with pytest.raises(ConfigError, match="decodes greedily"):
        lm.generate_until(requests)


# ---------------------------------------------------------------------------------------------- stops inside a step

STOP_GAMMA, STOP_MAX_NEW = 3, 40


def _steps_layout(steps: list[int]) -> list[tuple[int, int]]:
    """(first output position, accepted drafts) of each step; position 0 is the prefill's token."""
    layout, position = [], 1
    for accepted in steps:
        layout.append((position, accepted))
        position += accepted + 1
    return layout


def _stop_inside_a_step(tokens: list[int], steps: list[int]) -> int:
    """An output position holding an accepted draft whose token appears nowhere before it: stopping there cuts a
    step short (its later drafts and the verifier's own token follow it in the step)."""
    return next(start + j for start, accepted in _steps_layout(steps) for j in range(accepted)
                if tokens[start + j] not in tokens[:start + j] and tokens[start + j] > 2)


def _expected_counts(steps: list[int], end: int, budget: bool) -> tuple[int, int]:
    """Steps run and drafted tokens kept when the output ends after ``end`` tokens. Where ``end`` is the token
    budget (max_gen_toks), the last step drafts only up to the position before it and the verifier adds the last."""
    kept = [(start, min(accepted, end - start - budget)) for start, accepted in _steps_layout(steps) if start < end]
    return len(kept), sum(k for _, k in kept)


@pytest.mark.slow
@pytest.mark.parametrize("where", ["eos", "until", "max_gen_toks"])
def test_a_stop_inside_a_step_gives_hf_text_and_counts_only_kept_drafts(where):
    """The exact model stops inside a verification step (on an end-of-sequence id of the generation config, on a
    stop string, or at max_gen_toks): the text lm-eval scores equals `--model hf`'s, and accepted counts only the
    drafted tokens before the stop (oracle: the step-by-step reference, cut by hand)."""
    model = tiny_model(layers=3)
    prompt = TOKENIZER(PROMPTS[0])["input_ids"]
    tokens, steps = reference(copy.deepcopy(model), prompt, STOP_MAX_NEW, STOP_GAMMA)
    q = _stop_inside_a_step(tokens, steps)
    kwargs = {"until": ["\n\n"], "max_gen_toks": STOP_MAX_NEW, "do_sample": False}
    if where == "eos":
        model.generation_config.eos_token_id = [2, tokens[q]]
    elif where == "until":
        kwargs["until"] = [TOKENIZER.decode(tokens[q - 1:q + 1])]
        assert kwargs["until"][0] not in TOKENIZER.decode(tokens[:q])
    else:
        kwargs["max_gen_toks"] = q + 1
    def requests() -> list[Instance]:
        return [Instance("generate_until", {}, (PROMPTS[0], dict(kwargs)), 0, ("gen", 0, 1))]

    expected = hf_lm(model).generate_until(requests())
    assert expected[0] == TOKENIZER.decode(tokens[:q + (where != "until")])[:len(expected[0])]  # hf stops at q
    selfspec = requests()
    assert alspec_lm(model, policy="selfspec", gamma=STOP_GAMMA, window=WINDOW).generate_until(selfspec) == expected
    counts = sample_stats(selfspec)[0]["selfspec"]
    assert (counts["steps"], counts["accepted"]) == _expected_counts(steps, q + 1, where == "max_gen_toks")
    assert counts["tau"] == pytest.approx(1 + counts["accepted"] / counts["steps"])


@pytest.mark.slow
def test_sliding_window_models_are_refused_before_the_weights_load(tmp_path, monkeypatch):
    """policy=selfspec (and a sweep's gammas) on a model with sliding-window layers: one line, no weights loaded."""
    import transformers

    from alspec_eval.sweep.config import parse_config
    from alspec_eval.sweep.runner import run_sweep
    from alspec_eval.approx_check.models import save_tiny

    path = save_tiny(tmp_path / "mistral", arch="mistral", sliding_window=16)

    def no_weights(*args, **kwargs):
        raise AssertionError("the weights were loaded")

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", no_weights)
    message = r"policy=selfspec \(a sweep's gammas too\) does not support sliding-window attention layers \(mistral: 3 of 3"
    with pytest.raises(ConfigError, match=message):
        ALSpecLM(pretrained=path, policy="selfspec", device="cpu")
    config = parse_config({"name": "x", "tasks": ["alspec_recall"], "lambdas": [0.1], "gammas": [2],
                           "output": str(tmp_path / "out"), "model_args": {"pretrained": path}})
    with pytest.raises(ConfigError, match=message):
        run_sweep(config)
    assert not (tmp_path / "out" / "cells").exists()
