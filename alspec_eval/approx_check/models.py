"""The contract's tiny models, built in-process (no hub): three families whose attention differs where an
approximation could go wrong (llama: grouped-query heads; qwen2: q/k/v biases; gemma2: logit soft-capping, eager
attention and sliding-window layers that are not speculated), and a character tokenizer."""

from __future__ import annotations

import string

import torch
import transformers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

COMMON = {"vocab_size": 110, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4,
          "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 1024, "pad_token_id": 0,
          "bos_token_id": 1, "eos_token_id": 2, "tie_word_embeddings": False}
FAMILIES: dict[str, tuple[str, str, dict, str]] = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}, "sdpa"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}, "sdpa"),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM",
               {"head_dim": 16, "query_pre_attn_scalar": 64, "attn_logit_softcapping": 50.0,
                "final_logit_softcapping": 30.0, "sliding_window": 16,
                "layer_types": ["sliding_attention", "full_attention"] * 2}, "eager"),
}


def char_tokenizer() -> PreTrainedTokenizerFast:
    """One token per printable character, so prompts of known length are easy to write."""
    vocab = {tok: i for i, tok in enumerate(["<pad>", "<bos>", "<eos>", *string.printable])}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="?"))
    tok.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<bos>", eos_token="<eos>")


def tiny_model(family: str, seed: int = 0) -> transformers.PreTrainedModel:
    """A float32 model of ``family`` with q and k scaled up, so that attention is peaked and d/n spreads."""
    config_name, model_name, kwargs, attn = FAMILIES[family]
    config = getattr(transformers, config_name)(**COMMON, **kwargs)
    config._attn_implementation = attn
    torch.manual_seed(seed)
    model = getattr(transformers, model_name)(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("q_proj.weight", "k_proj.weight")):
                p.mul_(8.0)
    return model
