"""The simulation against its definition: baseline at lambda 0, sink reference, trivial windows,
teacher forcing against token-by-token decoding, batch invariance, and statistics that add up."""

from __future__ import annotations

import math

import pytest
import torch
from lm_eval.api.instance import Instance

from alspec_eval.approx_check.models import ARCHS, tiny_model
from alspec_eval.approx_check.properties import median_ratio
from alspec_eval.region import DecodeRegion
from alspec_eval.stats import ACCEPTED, REJECTED
from helpers import (PROMPTS, TOKENIZER, alspec_lm, gen_requests, hf_lm, ll_requests, sample_stats,
                     stepwise_logprob)
from default_approximations import APPROXIMATIONS, BEYOND_SINK, DRAFTS, approx_args
from row_kinds import Example, examples

pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore")]
KINDS = [e.id for e in examples(0.1)]


def _example(kind: str, lam: float, model: torch.nn.Module, folder) -> Example:
    """row_kinds.py's row of this kind for this model, at ``lam``."""
    return next(e for e in examples(lam, model.config.num_hidden_layers, folder) if e.id == kind)


@pytest.fixture(scope="module", params=sorted(ARCHS))
def model(request):
    return tiny_model(request.param)


@pytest.fixture(params=["one gather", "chunks of 3"])
def chunks(request, monkeypatch):
    """A~'s window keys gathered for all speculated positions of a layer at once, or in chunks of 3 positions (as
    long scoring does under its memory bound): the same decisions and outputs either way."""
    if request.param == "chunks of 3":
        monkeypatch.setattr("alspec_eval.speculator.gather_chunk", lambda *_: 3)
    return request.param


@pytest.mark.parametrize("approx", APPROXIMATIONS)
def test_lambda_zero_is_the_baseline(model, approx):
    baseline = hf_lm(model, batch_size=2)
    spec = alspec_lm(model, batch_size=2, **approx_args(approx, 8), **{"lambda": 0.0})
    assert spec.generate_until(gen_requests()) == baseline.generate_until(gen_requests())
    assert spec.loglikelihood(ll_requests()) == baseline.loglikelihood(ll_requests())
    total = spec.statistics()["tasks"]["gen"]["total"]
    assert total["speculated"] > 0 and total["accepted"] == 0


def _sink_mask(length: int, spec_start: int, window: int, align: int) -> torch.Tensor:
    """Reference boolean mask: causal, except decode rows see only the first S and the last S positions."""
    mask = torch.ones(length, length).tril().bool()
    for pos in range(spec_start, length):
        if pos + 1 > 2 * window:
            end = pos + 1 if align == 1 else math.ceil((pos + 1) / align) * align
            row = torch.zeros(length, dtype=torch.bool)
            row[:window] = True
            row[end - window:pos + 1] = True
            mask[pos] = row
    return mask[None, None]


@pytest.mark.parametrize("align", [1, 32])
def test_sink_policy_equals_reference_sink_attention(model, chunks, align):
    window = 32 if align == 32 else 8
    spec = alspec_lm(model, policy="always", window=window, window_align=align)
    plain = hf_lm(model).model
    text = (" ".join(["the age of wisdom, the age of foolishness"] * 6))[:230]
    ids = torch.tensor([TOKENIZER(text)["input_ids"]])
    start = 40
    with torch.no_grad():
        reference = plain(ids, attention_mask=_sink_mask(ids.shape[1], start, window, align)).logits
        with spec.speculator.speculating(DecodeRegion.build([0], [start], tokens=ids), spec.spec_config) as trace:
            ours = spec.model(ids).logits
    torch.testing.assert_close(ours, reference, atol=2e-5, rtol=1e-5)
    decided = trace.codes[0, start:]
    assert (decided == ACCEPTED).any() and not (decided == REJECTED).any()


@pytest.mark.parametrize("approx", APPROXIMATIONS)
def test_window_covering_context_is_exact_and_trivial(model, approx):
    baseline = hf_lm(model)
    spec = alspec_lm(model, policy="always", window=512, **approx_args(approx, 512))
    assert spec.generate_until(gen_requests()) == baseline.generate_until(gen_requests())
    assert spec.loglikelihood(ll_requests()) == baseline.loglikelihood(ll_requests())
    for task in ("gen", "ll"):
        total = spec.statistics()["tasks"][task]["total"]
        assert total["speculated"] == 0 and total["trivial"] > 0 and total["hit_rate"] is None


@pytest.mark.parametrize(("kind", "approx"), [(kind, "sink") for kind in KINDS] +
                         [(kind, approx) for kind in ("dynamic", "always") for approx in BEYOND_SINK])
def test_teacher_forcing_equals_token_by_token_decoding(model, chunks, kind, approx, tmp_path):
    """Every kind of row (row_kinds.py), run from its own model_args: scoring a continuation in one pass gives the
    log-probability and the per-layer decisions of decoding it token by token with a KV cache, and each layer
    decides as its plan line says (off: nothing recorded; always: all accepted; reject: none; a lambda: mixed).
    Every approximation of A~ too (its keys chosen per KV head from the cache as it stood at each token)."""
    probe = alspec_lm(model, window=4, **approx_args(approx, 4))
    context, continuation = "It was the best of times, it was the", " worst of times, it was the age of wisdom"
    lam = median_ratio(probe, context + continuation)
    example = _example(kind, lam, model, tmp_path)
    spec = alspec_lm(model, window=4, **example.model_args, **approx_args(approx, 4))
    requests = ll_requests(task="tf")
    requests[0].arguments = (context, continuation)
    (teacher, _), *_ = spec.loglikelihood(requests[:1])
    layers = spec.task_stats["tf"]

    ctx_ids, cont_ids = spec._encode_pair(context, continuation)
    stepwise, trace = stepwise_logprob(spec, ctx_ids, cont_ids)
    stats = trace.row_stats(0, len(ctx_ids), len(ctx_ids) + len(cont_ids) - 1)
    assert teacher == pytest.approx(stepwise, abs=1e-4)
    assert torch.equal(stats.accepted, layers.accepted)
    assert torch.equal(stats.speculated, layers.speculated)

    plan = spec.spec_config.thresholds(model.config.num_hidden_layers)
    for lam_i, accepted, speculated in zip(plan, layers.accepted.tolist(), layers.speculated.tolist(), strict=True):
        if math.isnan(lam_i):
            assert speculated == 0
        elif lam_i == math.inf:
            assert 0 < accepted == speculated
        elif lam_i == -math.inf:
            assert accepted == 0 < speculated
    if any(math.isfinite(t) for t in plan):
        assert 0 < int(layers.accepted.sum()) < int(layers.speculated.sum()), "lambda should give mixed decisions"


@pytest.mark.parametrize("kind", KINDS)
def test_exactly_the_kinds_that_never_accept_at_lambda_zero_equal_hf(model, kind, tmp_path):
    """At lambda 0 a row answers as `--model hf` iff its plan never takes A~ (baseline, selfspec, a lambda or a
    schedule of zeros); always and static, which take A~ whatever lambda, answer differently."""
    example = _example(kind, 0.0, model, tmp_path)
    baseline, spec = hf_lm(model, batch_size=2), alspec_lm(model, batch_size=2, **example.model_args)
    exact = not any(t > 0 for t in spec.spec_config.thresholds(model.config.num_hidden_layers))
    assert exact == (kind not in ("always", "static"))
    lls, expected = spec.loglikelihood(ll_requests()), baseline.loglikelihood(ll_requests())
    if exact:
        assert spec.generate_until(gen_requests()) == baseline.generate_until(gen_requests())
        assert lls == expected
    else:
        assert lls != expected


@pytest.mark.parametrize(("kind", "trace_tokens", "approx"),
                         [(kind, True, "sink") for kind in KINDS] + [("dynamic", False, "sink")] +
                         [(kind, True, approx) for kind in ("dynamic", "selfspec") for approx in BEYOND_SINK
                          if kind == "dynamic" or approx in DRAFTS])
def test_batch_size_and_left_padding_do_not_change_decisions(model, kind, trace_tokens, approx, tmp_path):
    probe = alspec_lm(model, **approx_args(approx, 8))
    lam = median_ratio(probe, PROMPT_FOR_LAMBDA)
    args = {**_example(kind, lam, model, tmp_path).model_args, **approx_args(approx, 8)}
    runs = {}
    for batch_size in (1, 4):
        spec = alspec_lm(model, batch_size=batch_size, trace_tokens=trace_tokens, **args)
        gen, ll = gen_requests(), ll_requests()
        runs[batch_size] = (spec.generate_until(gen), sample_stats(gen), spec.loglikelihood(ll), sample_stats(ll))
    assert runs[1][0] == runs[4][0]
    assert runs[1][1] == runs[4][1]
    assert [ll for ll, _ in runs[1][2]] == pytest.approx([ll for ll, _ in runs[4][2]], abs=1e-4)
    assert runs[1][3] == runs[4][3]
    accepted = sum(s["accepted"] for s in runs[1][1])
    if kind in ("dynamic", "tuned"):
        assert 0 < accepted < sum(s["speculated"] for s in runs[1][1])
    if trace_tokens:
        for sample, text in zip(runs[1][1], runs[1][0], strict=True):
            assert len(sample["accepted_layers_per_token"]) >= len(TOKENIZER(text)["input_ids"])
            assert sum(sample["accepted_layers_per_token"]) == sample["accepted"]


@pytest.mark.parametrize("approx", ["sink", "quest"])
def test_a_decode_step_of_a_full_batch_decides_whole_or_in_chunks_as_each_row_alone(model, chunks, approx):
    """At batch 4 every row speculates at a decode step, so the step takes whole tensors (no gather or scatter of
    rows); in chunks of 3 its last chunk is one row. Either way each row generates and decides as it does alone,
    for keys fixed by position (sink) and keys chosen per KV head (quest)."""
    args = approx_args(approx, 8)
    lam = median_ratio(alspec_lm(model, **args), PROMPT_FOR_LAMBDA)
    runs = {}
    for batch_size in (1, 4):
        spec = alspec_lm(model, batch_size=batch_size, **{"lambda": lam}, **args)
        gen = gen_requests()
        runs[batch_size] = (spec.generate_until(gen), sample_stats(gen))
    assert runs[1] == runs[4]
    accepted = [s["accepted"] for s in runs[4][1]]
    assert 0 < sum(accepted) < sum(s["speculated"] for s in runs[4][1])


PROMPT_FOR_LAMBDA = "It was the best of times, it was the worst of times, it was the age of wisdom, it was"


def test_statistics_add_up(model):
    spec = alspec_lm(model, **{"lambda": median_ratio(alspec_lm(model), PROMPT_FOR_LAMBDA)})
    gen = gen_requests()
    spec.generate_until(gen)
    task = spec.statistics()["tasks"]["gen"]
    for layer in task["layers"]:
        assert 0 <= layer["accepted"] <= layer["speculated"]
        assert sum(layer["hist"]) == layer["speculated"]
        assert layer["hit_rate"] == pytest.approx(layer["accepted"] / layer["speculated"])
    for key in ("speculated", "accepted", "trivial"):
        assert task["total"][key] == sum(layer[key] for layer in task["layers"])
        assert task["total"][key] == sum(s[key] for s in sample_stats(gen))
    assert task["total"]["trivial"] > 0  # the first tokens after short prompts fit in 2S
    assert task["total"]["hist"] == [sum(col) for col in zip(*(layer["hist"] for layer in task["layers"]))]


def test_rolling_loglikelihood_speculates_every_position(model, chunks):
    text = PROMPTS[0] + " " + PROMPTS[1]
    def requests() -> list[Instance]:
        return [Instance("loglikelihood_rolling", {}, (text,), 0, ("roll", 0, 1))]

    assert alspec_lm(model, **{"lambda": 0.0}).loglikelihood_rolling(requests()) == \
        hf_lm(model).loglikelihood_rolling(requests())
    sink = alspec_lm(model, policy="always", window=8)
    rolled = requests()
    sink.loglikelihood_rolling(rolled)
    tokens, layers = len(TOKENIZER(text)["input_ids"]), model.config.num_hidden_layers
    # One window: the prefix token and the text, minus its last token; every position speculates.
    assert sample_stats(rolled) == [{"speculated": layers * (tokens - 16), "accepted": layers * (tokens - 16),
                                     "trivial": layers * 16, "hit_rate": 1.0}]


def test_sliding_window_layers_are_skipped_and_reported():
    model = tiny_model("mistral")
    model.config.sliding_window = 32
    baseline, spec = hf_lm(model), alspec_lm(model, policy="always")
    assert spec.generate_until(gen_requests()) == baseline.generate_until(gen_requests())
    stats = spec.statistics()
    assert stats["skipped_layers"] == {str(i): "sliding_window" for i in range(3)}
    assert all(layer["skipped"] == "sliding_window" and layer["speculated"] == 0
               for layer in stats["tasks"]["gen"]["layers"])


def test_ratio_and_acceptance_follow_the_definition(model, chunks):
    """Layer 0's d/n against A and A~ taken from the plain model, and accept iff d <= lambda * n everywhere."""
    text = (" ".join(["the age of wisdom, the age of foolishness"] * 4))[:150]
    ids = torch.tensor([TOKENIZER(text)["input_ids"]])
    start, window = 40, 8
    plain = hf_lm(model).model
    captured = []
    hook = plain.model.layers[0].self_attn.o_proj.register_forward_pre_hook(lambda m, args: captured.append(args[0]))
    with torch.no_grad():
        plain(ids)
        plain(ids, attention_mask=_sink_mask(ids.shape[1], start, window, 1))
    hook.remove()
    exact, approx = (c[0, start:].float() for c in captured)
    reference = (approx - exact).norm(dim=-1) / exact.norm(dim=-1)

    ordered = reference.sort().values  # lambda between two ratios: no decision sits on the threshold
    lam = float(ordered[len(ordered) // 2 - 1] + ordered[len(ordered) // 2]) / 2
    spec = alspec_lm(model, window=window, **{"lambda": lam})
    region = DecodeRegion.build([0], [start], tokens=ids)
    with torch.no_grad(), spec.speculator.speculating(region, spec.spec_config) as trace:
        spec.model(ids)
    torch.testing.assert_close(trace.ratios[0, start:, 0], reference, rtol=1e-5, atol=1e-6)
    decided = (trace.codes == ACCEPTED) | (trace.codes == REJECTED)
    assert torch.equal((trace.codes == ACCEPTED)[decided], (trace.ratios <= lam)[decided])
    assert (trace.codes == ACCEPTED).any() and (trace.codes == REJECTED).any()
