"""Every model family people evaluate (alspec_eval/approx_check/families.py), each on a tiny random config that
exercises what is special about its attention: lambda = 0 is the `hf` model bit for bit, the committed A~ is the
family's own attention function called on the first S and last S keys, teacher-forced loglikelihood equals
token-by-token decoding, policy=selfspec is lossless (or refused where the family has sliding-window layers), and
sliding-window layers are reported as not speculated and left out of the hit rates."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from alspec_eval.approx_check.families import BY_NAME, FAMILIES, table_markdown
from alspec_eval.approx_check.models import Family, build, make_config
from alspec_eval.approx_check.properties import median_ratio
from alspec_eval.config import ConfigError
from alspec_eval.region import DecodeRegion
from alspec_eval.speculator import Speculator
from helpers import PROMPTS, TOKENIZER, alspec_lm, gen_requests, hf_lm, ll_requests, stepwise_logprob

WINDOW = 8
pytestmark = pytest.mark.filterwarnings("ignore")
COMMON_HEAD_DIM = 16  # models.COMMON: hidden 64 over 4 heads


@pytest.fixture(scope="module", params=[f.name for f in FAMILIES])
def family(request) -> tuple[Family, torch.nn.Module]:
    f = BY_NAME[request.param]
    return f, build(f)


@pytest.mark.slow
def test_lambda_zero_is_the_hf_model_bit_for_bit(family):
    f, model = family
    lm = alspec_lm(model, window=WINDOW, **{"lambda": 0.0})
    assert lm.generate_until(gen_requests()) == hf_lm(model).generate_until(gen_requests())
    assert lm.loglikelihood(ll_requests()) == hf_lm(model).loglikelihood(ll_requests())


def _own_attention(f: Family, module: torch.nn.Module):
    """The family's own attention function, looked up apart from alspec_eval's hooks."""
    if f.attn == "eager":
        return sys.modules[type(module).__module__].eager_attention_forward
    return ALL_ATTENTION_FUNCTIONS[f.attn]


@pytest.mark.slow
def test_committed_approximation_is_the_familys_attention_on_the_window(family, monkeypatch):
    """Semantics 2 by hand: for every speculated layer and position p (batch 1, no padding), A~ is the model's own
    attention function with every term it applies (scaling, soft-capping, sinks) called on the query and the keys
    [0, S) and (p - S, p]; A on the keys [0, p]. Their d/n equals the recorded ratio to float32 precision, and the
    decisions at a lambda between two measured ratios are d <= lambda n."""
    f, model = family
    lm = alspec_lm(model, window=WINDOW, **{"lambda": 0.0})
    calls = []
    real = Speculator.attend

    def record(self, module, query, key, value, attention_mask, scaling, **kwargs):
        calls.append((module, query.detach().clone(), key.detach().clone(), value.detach().clone(), scaling, kwargs))
        return real(self, module, query, key, value, attention_mask, scaling, **kwargs)

    monkeypatch.setattr(Speculator, "attend", record)
    ids = torch.tensor([TOKENIZER(PROMPTS[0])["input_ids"]])
    with torch.no_grad(), lm.speculator.speculating(DecodeRegion.build([0], [0], tokens=ids), lm.spec_config) as trace:
        lm.model(ids)
    checked = 0
    for module, query, key, value, scaling, kwargs in calls:
        layer = module.layer_idx
        if layer in f.sliding_layers:
            assert torch.isnan(trace.ratios[0, :, layer]).all()
            continue
        fn, extra = _own_attention(f, module), {k: v for k, v in kwargs.items() if k != "sliding_window"}
        for p in range(2 * WINDOW, ids.shape[1]):  # positions whose context exceeds 2S
            window = torch.cat([torch.arange(WINDOW), torch.arange(p - WINDOW + 1, p + 1)])
            q = query[:, :, p:p + 1]
            approx = fn(module, q, key[:, :, window], value[:, :, window], None, scaling=scaling, **extra)[0].float()
            exact = fn(module, q, key[:, :, :p + 1], value[:, :, :p + 1], None, scaling=scaling, **extra)[0].float()
            ratio = float((approx - exact).norm() / exact.norm())
            assert float(trace.ratios[0, p, layer]) == pytest.approx(ratio, rel=1e-4, abs=1e-6), (layer, p)
            checked += 1
    assert checked > 0 or len(f.sliding_layers) == model.config.num_hidden_layers


@pytest.mark.slow
def test_teacher_forced_loglikelihood_is_token_by_token_decoding(family):
    f, model = family
    everywhere_sliding = len(f.sliding_layers) == model.config.num_hidden_layers
    lam = 0.1 if everywhere_sliding else median_ratio(alspec_lm(model, window=WINDOW), PROMPTS[0])
    lm = alspec_lm(model, window=WINDOW, **{"lambda": lam})
    context, continuation = TOKENIZER(PROMPTS[0][:30])["input_ids"], TOKENIZER(PROMPTS[0][30:])["input_ids"]
    stepwise, trace = stepwise_logprob(lm, context, continuation)
    from lm_eval.api.instance import Instance

    request = Instance("loglikelihood", {}, (PROMPTS[0][:30], PROMPTS[0][30:]), 0, ("ll", 0, 1))
    (forced, _), = lm.loglikelihood([request])
    assert forced == pytest.approx(stepwise, abs=1e-4)
    entry = request.arguments[-1]["alspec"]
    stats = trace.row_stats(0, len(context), len(context) + len(continuation) - 1).summary()
    assert (entry["speculated"], entry["accepted"]) == (stats["speculated"], stats["accepted"])
    if not everywhere_sliding:
        assert 0 < entry["accepted"] < entry["speculated"]


@pytest.mark.slow
def test_selfspec_is_lossless_or_refused(family):
    f, model = family
    if f.sliding_layers:
        with pytest.raises(ConfigError, match="does not support sliding-window attention layers"):
            alspec_lm(model, policy="selfspec", gamma=3, window=4)
        return
    lm = alspec_lm(model, policy="selfspec", gamma=3, window=4)
    assert lm.generate_until(gen_requests()) == hf_lm(model).generate_until(gen_requests())


@pytest.mark.slow
def test_sliding_window_layers_are_reported_and_left_out(family):
    f, model = family
    lm = alspec_lm(model, window=WINDOW)
    lm.generate_until(gen_requests())
    stats = lm.statistics()
    assert {int(k) for k in stats["skipped_layers"]} == set(f.sliding_layers)
    layers = stats["tasks"]["gen"]["layers"]
    assert all(layers[i]["speculated"] == layers[i]["accepted"] == 0 for i in f.sliding_layers)
    total = stats["tasks"]["gen"]["total"]
    assert total["speculated"] == sum(x["speculated"] for x in layers)
    assert (total["speculated"] > 0) == (len(f.sliding_layers) < model.config.num_hidden_layers)


@pytest.mark.slow
@pytest.mark.parametrize("name", [f.name for f in FAMILIES if f.attn == "eager"])
@pytest.mark.parametrize("kernel", ["torch", "triton"])
def test_fused_kernels_are_refused_where_the_family_changes_the_attention_formula(name, kernel):
    f = BY_NAME[name]
    with pytest.raises(ConfigError, match=f"kernel={kernel} computes plain softmax attention"):
        alspec_lm(build(f), kernel=kernel)


def test_llama3_family_has_llama3_rope_on_the_installed_transformers():
    """The Llama 3 family's RoPE (rope_type llama3, theta 500000, factor 8) reaches the model whatever the
    transformers version (compat.rope_config): its rotary frequencies are Llama 3's rule, worked out here."""
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    f = BY_NAME["Llama 3"]
    rope, dim = f.kwargs["rope_parameters"], COMMON_HEAD_DIM
    rotary = LlamaRotaryEmbedding(make_config(f))
    assert rotary.rope_type == "llama3"
    base = 1.0 / rope["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    old, factor = rope["original_max_position_embeddings"], rope["factor"]
    low, high = rope["low_freq_factor"], rope["high_freq_factor"]
    wavelen = 2 * torch.pi / base
    smooth = (old / wavelen - low) / (high - low)
    expected = torch.where(wavelen > old / low, base / factor,
                           torch.where(wavelen < old / high, base, (1 - smooth) * base / factor + smooth * base))
    assert torch.allclose(rotary.inv_freq.double(), expected, rtol=1e-5)


def test_docs_family_table_is_the_matrix():
    """docs/models.md's table of model families is the one rendered from this test matrix."""
    page = (Path(__file__).parents[1] / "docs" / "models.md").read_text()
    assert table_markdown() in page


@pytest.mark.slow
def test_refusals_come_before_the_weights_load(tmp_path, monkeypatch):
    """From a checkpoint path: a fused kernel for Gemma 2 (soft-capping) and gpt-oss (sinks), policy=selfspec for a
    family with sliding-window layers; one line each, and no weights loaded."""
    import transformers

    from alspec_eval.adapter import ALSpecLM
    from alspec_eval.approx_check.models import char_tokenizer

    paths = {}
    for name in ("Gemma 2", "gpt-oss"):
        paths[name] = tmp_path / name.replace(" ", "_")
        build(BY_NAME[name]).save_pretrained(paths[name])
        char_tokenizer().save_pretrained(paths[name])

    def no_weights(*args, **kwargs):
        raise AssertionError("the weights were loaded")

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", no_weights)
    with pytest.raises(ConfigError, match="kernel=torch computes plain softmax attention, without the attention "
                                          "logit soft-capping of gemma2; use kernel=model"):
        ALSpecLM(pretrained=str(paths["Gemma 2"]), kernel="torch", device="cpu")
    with pytest.raises(ConfigError, match="without the learned attention sinks of gpt_oss"):
        ALSpecLM(pretrained=str(paths["gpt-oss"]), kernel="triton", device="cpu")
    with pytest.raises(ConfigError, match="does not support sliding-window attention layers"):
        ALSpecLM(pretrained=str(paths["Gemma 2"]), policy="selfspec", device="cpu")
