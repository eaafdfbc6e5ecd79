"""Every decision and A~ of alspec-vllm equal a float64 reference computed from the same cache contents, on the tiny
Llama: chunked prefills beside decodes in one step, trivial rows and the first non-trivial one, windows at both edges
of the context, and requests that share prefix-cache blocks. The reference is written here from the definition
(docs/design.md, Semantics 2-4), not from alspec_eval.semantics."""

from __future__ import annotations

import math

import pytest

pytest.importorskip("vllm")
import torch

from conftest import dumps_of, speculating

pytestmark = pytest.mark.slow

ACCEPTED, REJECTED, TRIVIAL = 3, 2, 1


def reference_positions(pos: int, window: int, approx: str) -> list[int]:
    """The keys A~ reads: the first S and the last S (sink), or the last 2S (local)."""
    if approx == "local":
        return list(range(pos - 2 * window + 1, pos + 1))
    return sorted(set(range(window)) | set(range(pos - window + 1, pos + 1)))


def attention64(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float,
                positions: list[int]) -> torch.Tensor:
    """softmax(q k scale) v over ``positions`` in float64; query head h reads KV head h // (Hq / Hkv)."""
    heads, kv_heads = q.shape[0], keys.shape[0]
    kv = torch.arange(heads) // (heads // kv_heads)
    k, v = keys[kv][:, positions].double(), values[kv][:, positions].double()
    weights = torch.softmax(torch.einsum("hd,hpd->hp", q.double(), k) * scale, dim=-1)
    return torch.einsum("hp,hpd->hd", weights, v)


def check_dumps(dumps: list[dict], lam: float, window: int, approx: str) -> dict[str, int]:
    """Compare every dumped row with the reference; returns what was covered."""
    seen = {"accepted": 0, "rejected": 0, "trivial": 0, "first_nontrivial": 0, "mixed_steps": 0}
    for dump in dumps:
        tags = dump["tag"].tolist()
        per_tag = {t: tags.count(t) for t in set(tags)}
        if len(per_tag) > 1 and max(per_tag.values()) > 1 and min(per_tag.values()) == 1:
            seen["mixed_steps"] += 1  # a prefill chunk beside a decode
        for m, pos in enumerate(dump["pos"].tolist()):
            q, keys, values = dump["query"][m], dump["keys"][m], dump["values"][m]
            exact = attention64(q, keys, values, dump["scale"], list(range(pos + 1)))
            # A as vLLM's kernel computed it, from the keys the adapter reads: the layout and block table read right
            torch.testing.assert_close(dump["exact"][m].double(), exact, rtol=1e-4, atol=1e-5)
            code = int(dump["code"][m])
            if pos + 1 <= 2 * window:
                assert code == TRIVIAL, (pos, code)
                torch.testing.assert_close(dump["committed"][m], dump["exact"][m], rtol=0, atol=0)
                seen["trivial"] += 1
                continue
            seen["first_nontrivial"] += pos + 1 == 2 * window + 1
            approx64 = attention64(q, keys, values, dump["scale"], reference_positions(pos, window, approx))
            a = dump["exact"][m].double()
            ratio = float((approx64 - a).norm() / a.norm())
            assert math.isclose(float(dump["ratio"][m]), ratio, rel_tol=1e-4), (pos, dump["layer"])
            if abs(ratio - lam) < 1e-5 * lam:
                continue  # a tie within float32's rounding: either decision is the definition's
            assert code == (ACCEPTED if ratio <= lam else REJECTED), (pos, ratio, lam)
            if code == ACCEPTED:
                torch.testing.assert_close(dump["committed"][m].double(), approx64, rtol=1e-4, atol=1e-5)
                seen["accepted"] += 1
            else:
                assert torch.equal(dump["committed"][m], dump["exact"][m])
                seen["rejected"] += 1
    return seen


def text_tokens(n: int, seed: int) -> list[int]:
    """n tokens of the character tokenizer (ids 3.. are printable characters)."""
    g = torch.Generator().manual_seed(seed)
    return (torch.randint(3, 100, (n,), generator=g)).tolist()


@pytest.mark.parametrize("approx", ["sink", "local"])
def test_decisions_and_approximations_equal_a_float64_reference(alspec_tiny, approx):
    from vllm import SamplingParams

    lm = alspec_tiny
    window = lm.spec_config.window
    long_a, short, long_b = text_tokens(300, 1), text_tokens(40, 2), text_tokens(90, 3)
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    # calibrate lambda to the median ratio of this model, so that rows accept and reject
    with speculating(lm, dump=True, lam=math.inf, approx=approx, speculate_prefill=True):
        lm._model_generate([long_a[:120]], generate=True, sampling_params=[greedy])
        ratios = torch.cat([d["ratio"] for d in dumps_of(lm)])
    lam = float(ratios[~ratios.isnan()].median()) * 1.0001
    with speculating(lm, dump=True, lam=lam, approx=approx, speculate_prefill=True):
        first = lm._model_generate([long_a, short, long_b], generate=True, sampling_params=[greedy] * 3)
        # the second call reuses long_a's prompt blocks from the prefix cache: same tokens, same salt
        second = lm._model_generate([long_a[:250] + short, long_a[:200]], generate=True, sampling_params=[greedy] * 2)
        dumps = dumps_of(lm)
    assert [o.num_cached_tokens for o in second] != [0, 0]  # prefix-cache blocks were shared
    assert all(len(o.outputs[0].token_ids) == 12 for o in first + second)
    seen = check_dumps(dumps, lam, window, approx)
    assert all(seen.values()), seen


def test_lambda_zero_commits_nothing_and_sink_policy_accepts_every_row(alspec_tiny):
    from vllm import SamplingParams

    lm = alspec_tiny
    greedy = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    prompts = [text_tokens(150, 7), text_tokens(60, 8)]
    with speculating(lm, dump=True, lam=0.0):
        exact = lm._model_generate(prompts, generate=True, sampling_params=[greedy] * 2)
        dumps = dumps_of(lm)
    assert all(torch.equal(d["committed"], d["exact"]) for d in dumps)
    with speculating(lm, policy="always"):
        lm._model_generate(prompts, generate=True, sampling_params=[greedy] * 2)
    for prompt in prompts:
        stats = lm.ledger.records[tuple(prompt)].stats
        assert int(stats.speculated.sum()) == int(stats.accepted.sum()) > 0
    assert [len(o.outputs[0].token_ids) for o in exact] == [10, 10]
