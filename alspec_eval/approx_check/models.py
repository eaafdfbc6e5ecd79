"""The tiny random models, built in-process (no hub), and a character tokenizer: the one source of them, for the
contract (families.CONTRACT) and for the tests (tiny_model, save_tiny; families.FAMILIES, docs/models.md's matrix)."""

from __future__ import annotations

import string
from dataclasses import dataclass, field
from typing import Any

import torch
import transformers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from ..compat import rope_config

SPECIALS = ["<pad>", "<bos>", "<eos>"]
PROMPTS = [  # 8 to 80 characters, one token each
    "It was the best of times, it was the worst of times, it was the age of wisdom",
    "A wonderful fact to reflect upon, that every human creature is constituted to be",
    "There were a king with a large jaw and a queen with a plain face, on the throne",
    "Hundreds",
]
COMMON = {"vocab_size": 110, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4,
          "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 1024, "pad_token_id": 0,
          "bos_token_id": 1, "eos_token_id": 2, "tie_word_embeddings": False}


def char_tokenizer() -> PreTrainedTokenizerFast:
    """One token per printable character, so prompts of known length are easy to write."""
    vocab = {tok: i for i, tok in enumerate([*SPECIALS, *string.printable])}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="?"))
    tok.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<bos>", eos_token="<eos>")


@dataclass(frozen=True)
class Family:
    """A decoder family's tiny config: its transformers classes, what it sets over COMMON, its attention function;
    ``special`` and ``status`` are the columns of docs/models.md (families.py)."""

    name: str
    config: str  # transformers config class
    model: str  # transformers causal LM class
    special: str = ""  # what is special about its attention
    status: str = ""  # "exact" or "refused: why"
    kwargs: dict[str, Any] = field(default_factory=dict)
    attn: str = "sdpa"
    sliding_layers: tuple[int, ...] = ()  # layers the statistics must report as not speculated


ARCHS = {  # tiny_model's: plain GQA models
    "llama": Family("llama", "LlamaConfig", "LlamaForCausalLM"),
    "qwen2": Family("qwen2", "Qwen2Config", "Qwen2ForCausalLM"),
    "mistral": Family("mistral", "MistralConfig", "MistralForCausalLM"),
}


def make_config(family: Family, **overrides: Any) -> transformers.PretrainedConfig:
    """The family's tiny config (COMMON, its own keywords, then ``overrides``). Its RoPE is written as 5.x's
    ``rope_parameters``: compat.rope_config passes it as the installed transformers takes it (4.x takes an unknown
    ``rope_parameters`` silently and keeps default RoPE)."""
    config_class, kwargs = getattr(transformers, family.config), {**COMMON, **family.kwargs, **overrides}
    if "rope_parameters" in kwargs:
        kwargs.update(rope_config(config_class, kwargs.pop("rope_parameters")))
    config = config_class(**kwargs)
    config._attn_implementation = family.attn
    return config


def build(family: Family, seed: int = 0, **overrides: Any) -> transformers.PreTrainedModel:
    """The family's tiny float32 model, q and k scaled up so that attention is peaked (a range of d/n ratios), and
    learned attention sinks (gpt-oss) spread so that they matter."""
    config = make_config(family, **overrides)
    torch.manual_seed(seed)
    model = getattr(transformers, family.model)(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("q_proj.weight", "k_proj.weight", "qkv_proj.weight")):
                p.mul_(8.0)
            if name.endswith("sinks"):
                p.copy_(torch.linspace(-1.0, 2.0, p.numel()))
    return model


def tiny_model(arch: str = "llama", seed: int = 0, layers: int = 3, vocab: int = 110,
               max_positions: int = 1024, sliding_window: int | None = None) -> transformers.PreTrainedModel:
    """A float32 GQA model (4 query heads, 2 KV heads) with weights large enough that attention is peaked
    (Mistral: with ``sliding_window`` if given, else without one)."""
    overrides: dict[str, Any] = {"num_hidden_layers": layers, "vocab_size": vocab,
                                 "max_position_embeddings": max_positions}
    if arch == "mistral":
        overrides["sliding_window"] = sliding_window
    return build(ARCHS[arch], seed, **overrides)


def save_tiny(path, **kwargs: Any) -> str:
    """A tiny model and the character tokenizer saved as a local checkpoint, for `pretrained=PATH` runs."""
    tiny_model(**kwargs).save_pretrained(path)
    char_tokenizer().save_pretrained(path)
    return str(path)
