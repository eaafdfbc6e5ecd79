"""Putting a speculator into a transformers model and taking it out again (kvpress-style).

The attention function is registered with transformers' ``AttentionInterface`` (and its mask function
with ``AttentionMaskInterface``: without it causal masking is silently dropped) under
``alspec_<base>``; the model's attention modules point at the speculator; a forward pre-hook marks
each forward pass. :func:`remove` undoes all of it, :func:`speculation` is the ``with`` form::

    with speculation(model) as speculator:
        region = DecodeRegion.build([0], [prompt_len], tokens=ids)  # tokens: what a draft that draws seeds from
        with speculator.speculating(region, SpeculationConfig(lam=0.1)) as trace:
            model(ids)
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
from transformers import AttentionInterface, PretrainedConfig, PreTrainedModel
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from .config import ConfigError
from .speculator import ATTR, Speculator, alspec_attention

_HOOKS = "_alspec_hooks"  # on the model: (forward pre-hook handles, base attention implementation)


def attention_modules(model: PreTrainedModel) -> dict[int, torch.nn.Module]:
    """Self-attention modules by layer index (the modules that call the attention interface)."""
    def has_layer_idx(module: torch.nn.Module) -> bool:
        return isinstance(getattr(module, "layer_idx", None), int)

    return {m.layer_idx: m for m in model.modules()
            if has_layer_idx(m) and not any(has_layer_idx(c) for c in m.modules() if c is not m)}


def sliding_layers(config: PretrainedConfig, num_layers: int) -> dict[int, str]:
    """Sliding-window layers are not speculated (their window already bounds the cache)."""
    config = config.get_text_config()
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None:
        return {i: "sliding_window" for i, t in enumerate(layer_types) if t == "sliding_attention"}
    if getattr(config, "sliding_window", None) and getattr(config, "use_sliding_window", True):
        return dict.fromkeys(range(num_layers), "sliding_window")
    return {}


SINK_FAMILIES = ("gpt_oss",)  # model types whose attention adds learned per-head sink logits


def formula_terms(config: PretrainedConfig, model: PreTrainedModel | None = None) -> list[str]:
    """What a family adds to plain softmax attention, which the fused decode kernels (torch, triton, the TT op)
    do not compute: attention logit soft-capping (Gemma 2), learned per-head sinks (gpt-oss). From the config
    before the weights load; with the model also from its attention modules (a ``sinks`` parameter)."""
    text = config.get_text_config()
    terms = []
    if getattr(text, "attn_logit_softcapping", None) is not None:
        terms.append("attention logit soft-capping")
    sinks = text.model_type in SINK_FAMILIES or (
        model is not None and any(isinstance(getattr(m, "sinks", None), torch.nn.Parameter) for m in model.modules()))
    if sinks:
        terms.append("learned attention sinks")
    return terms


def check_fused_kernel(kernel: str, config: PretrainedConfig, model: PreTrainedModel | None = None) -> None:
    """A fused kernel computes plain softmax attention: refuse it for a family that changes the formula."""
    terms = formula_terms(config, model)
    if terms:
        family = config.get_text_config().model_type
        raise ConfigError(f"{kernel} computes plain softmax attention, without the {' and '.join(terms)} of "
                          f"{family}; use kernel=model (the model's own attention for A and A~) and backend=sim")


def base_attention(model: PreTrainedModel, attention_module: torch.nn.Module) -> tuple[str, Callable]:
    """The attention implementation the model runs without speculation (name and function)."""
    name = (model.config._attn_implementation or "sdpa").removeprefix("alspec_")
    if name == "eager":  # eager attention is model-specific and lives in the modeling module
        return name, sys.modules[type(attention_module).__module__].eager_attention_forward
    if name not in ALL_ATTENTION_FUNCTIONS:
        raise ConfigError(f"attention implementation {name!r} cannot be wrapped; load the model with "
                          "attn_implementation=sdpa or eager")
    return name, ALL_ATTENTION_FUNCTIONS[name]


def install(model: PreTrainedModel, speculator_cls: Callable[..., Speculator] = Speculator,
            **speculator_args: object) -> Speculator:
    """Route the model's attention through its speculator; :func:`remove` takes it out. What to speculate is
    given per call (``speculator.speculating(region, config)``).

    ``speculator_cls`` and ``speculator_args`` let a backend bring its own decode kernel and verification.
    """
    if getattr(model, _HOOKS, None) is not None:
        raise RuntimeError("this model already speculates; remove() the installed speculator first")
    if not (model._supports_attention_backend and model._can_set_attn_implementation()):
        raise ConfigError(
            f"{type(model).__name__} does not dispatch attention through transformers' AttentionInterface, "
            "so speculation cannot be hooked; use a model that does (Llama, Qwen2/3, Mistral, Gemma, ...)"
        )
    modules = attention_modules(model)
    num_layers = model.config.get_text_config().num_hidden_layers
    if sorted(modules) != list(range(num_layers)):
        raise ConfigError(f"found attention modules for layers {sorted(modules)} of {num_layers}; "
                          f"{type(model).__name__} cannot be hooked layer by layer")
    base_name, base_fn = base_attention(model, modules[0])
    name = f"alspec_{base_name}"
    AttentionInterface.register(name, alspec_attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register(name, ALL_MASK_ATTENTION_FUNCTIONS[base_name])
    speculator = speculator_cls(num_layers, sliding_layers(model.config, num_layers), base_fn,
                                additive_mask=base_name == "eager", **speculator_args)
    speculator.prompts.rotary_emb = next((m for name, m in model.named_modules() if name.endswith("rotary_emb")), None)
    for module in modules.values():
        setattr(module, ATTR, speculator)
    handles = [model.register_forward_pre_hook(speculator.new_forward),
               *(module.register_forward_pre_hook(speculator.layer_inputs, with_kwargs=True)
                 for module in modules.values())]
    setattr(model, _HOOKS, (handles, base_name))
    model.set_attn_implementation(name)
    return speculator


def remove(model: PreTrainedModel) -> None:
    """Give the model back its own attention: the hook, the module references and the implementation name."""
    hooks = getattr(model, _HOOKS, None)
    if hooks is None:
        return
    handles, base_name = hooks
    for handle in handles:
        handle.remove()
    for module in attention_modules(model).values():
        if hasattr(module, ATTR):
            delattr(module, ATTR)
    model.set_attn_implementation(base_name)
    setattr(model, _HOOKS, None)


@contextmanager
def speculation(model: PreTrainedModel, speculator_cls: Callable[..., Speculator] = Speculator,
                **speculator_args: object) -> Iterator[Speculator]:
    """``with`` form of :func:`install` / :func:`remove`."""
    speculator = install(model, speculator_cls, **speculator_args)
    try:
        yield speculator
    finally:
        remove(model)
