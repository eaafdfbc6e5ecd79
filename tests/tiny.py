"""Tiny random models and a character tokenizer, built in-process (no hub)."""

from __future__ import annotations

import string

import torch
import transformers
from tokenizers import Tokenizer, models, pre_tokenizers, decoders
from transformers import PreTrainedTokenizerFast

SPECIALS = ["<pad>", "<bos>", "<eos>"]


def char_tokenizer() -> PreTrainedTokenizerFast:
    """One token per printable character, so prompts of known length are easy to write."""
    vocab = {tok: i for i, tok in enumerate(SPECIALS + list(string.printable))}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="?"))
    tok.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<bos>", eos_token="<eos>")


ARCHS = {
    "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
    "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
    "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
}


def tiny_model(arch: str = "llama", seed: int = 0, layers: int = 3, vocab: int = 110,
               max_positions: int = 1024, sliding_window: int | None = None) -> transformers.PreTrainedModel:
    """A float32 GQA model (4 query heads, 2 KV heads) with weights large enough that attention is peaked
    (Mistral: with ``sliding_window`` if given, else without one)."""
    config_cls, model_cls = ARCHS[arch]
    config = config_cls(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=max_positions,
                        pad_token_id=0, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False,
                        attn_implementation="sdpa")
    if arch == "mistral":
        config.sliding_window = sliding_window
    torch.manual_seed(seed)
    model = model_cls(config).eval()
    with torch.no_grad():  # sharper attention than the 0.02-std default, so lambda sweeps see a range of ratios
        for name, p in model.named_parameters():
            if name.endswith(("q_proj.weight", "k_proj.weight")):
                p.mul_(8.0)
    return model


def save_tiny(path, **kwargs) -> str:
    """A tiny model and the character tokenizer saved as a local checkpoint, for `pretrained=PATH` runs."""
    tiny_model(**kwargs).save_pretrained(path)
    char_tokenizer().save_pretrained(path)
    return str(path)
