"""policy=selfspec: token-level self-speculation with the same sink, to set against attention-level speculation.

TriForce and MagicDec's StreamingLLM self-speculation draft with the model itself, its attention restricted to
the first S and the last S positions (the sink A~ of docs/design.md, Semantics 2), and verify the drafted tokens with
exact attention in one pass. Greedy, so lossless: the output is the exact model's, cut where it stops (EOS, a stop
string, max_gen_toks), also inside a step. One cache serves both: the draft attends over the verifier's KV entries
of the committed tokens and its own of the tokens drafted in this step (the first draft pass computes the entry of
the verifier's newest token under sink attention, since that token has none yet); the draft's entries are cut off
before verification, and the accepted tokens keep the verifier's entries.

Rows decode one at a time (no padding), so a row's tokens and statistics do not depend on its batch mates.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from transformers import DynamicCache, PretrainedConfig, PreTrainedModel

from .compat import crop_cache, with_cache
from .config import ConfigError, SpeculationConfig
from .hooks import sliding_layers
from .region import DecodeRegion
from .speculator import Speculator
from .stats import DraftStats


def check_model(config: PretrainedConfig) -> None:
    """Refuse, before the weights load, a model with sliding-window layers: a step's draft and verifier entries are
    cut back after it, and a sliding-window layer's cache (the last W positions only) cannot be cut back or sliced
    per row as this module does; lossless decoding there is not tested, so it is refused rather than run."""
    text = config.get_text_config()
    layers = sliding_layers(text, text.num_hidden_layers)
    if layers:
        raise ConfigError(f"policy=selfspec (a sweep's gammas too) does not support sliding-window attention layers "
                          f"({text.model_type}: {len(layers)} of {text.num_hidden_layers} layers); use policy=dynamic, "
                          "sink, static or exact with this model, or a model without sliding windows")


def check_greedy(generation_kwargs: dict) -> None:
    """Self-speculation is lossless against greedy decoding, and only that: refuse sampling in one line."""
    if generation_kwargs.get("do_sample"):
        raise ConfigError("policy=selfspec decodes greedily (it is lossless against greedy decoding); "
                          "drop do_sample=true from the task's or --gen_kwargs' generation settings")


def row_cache(model: PreTrainedModel, cache: DynamicCache, row: int, start: int) -> DynamicCache:
    """Batch row ``row`` of a left-padded cache, from its first real position ``start`` on, as a cache of its own."""
    out = DynamicCache(config=model.config)
    for i, layer in enumerate(cache.layers):
        out.update(layer.keys[row:row + 1, :, start:].clone(), layer.values[row:row + 1, :, start:].clone(), i)
    return out


def truncate(cache: DynamicCache, length: int) -> None:
    """Keep the first ``length`` positions (compat.crop_cache: transformers' crop differs between versions)."""
    crop_cache(cache, length)


@torch.no_grad()
def selfspec_generate(model: PreTrainedModel, speculator: Speculator, config: SpeculationConfig, pending: list[int],
                      max_new: int, gamma: int, stop_length: Callable[[list[int]], int | None],
                      cache: DynamicCache | None = None) -> tuple[list[int], DraftStats]:
    """Greedy self-speculative decoding of one row: up to ``max_new`` new tokens, cut where greedy decoding stops
    (``stop_length`` of the tokens so far: how many to keep, None while not stopped), even inside a step.
    ``cache`` holds the exact KV entries of the prompt before ``pending`` (none: the whole prompt is pending); the
    pending tokens are prefilled exactly and give the first token. ``accepted`` counts only the drafted tokens
    kept in the output (docs/design.md, Token-level self-speculation). The draft speculates with ``config``'s window
    under policy=always."""
    cache = DynamicCache(config=model.config) if cache is None else cache
    device = model.device
    logits = model(torch.tensor([pending], device=device), **with_cache(model, cache), use_cache=True,
                   logits_to_keep=1).logits
    token = int(logits[0, -1].argmax())
    out, stats = [token], DraftStats.zeros(gamma)
    sink = config.sink_draft()
    end = stop_length(out)
    while end is None and len(out) < max_new:
        drafts = _draft(model, speculator, sink, cache, token, min(gamma, max_new - len(out) - 1))
        committed = cache.get_seq_length()
        logits = model(torch.tensor([[token, *drafts]], device=device), **with_cache(model, cache),
                       use_cache=True).logits
        verified = logits[0].argmax(-1).tolist()
        accepted = next((i for i, (d, v) in enumerate(zip(drafts, verified)) if d != v), len(drafts))
        truncate(cache, committed + accepted + 1)  # the fed token and the accepted drafts, with the verifier's entries
        token, before = verified[accepted], len(out)
        out += [*drafts[:accepted], token]
        end = stop_length(out)
        stats.record(len(drafts), accepted if end is None else min(accepted, end - before))
    return out[:end], stats


def _draft(model: PreTrainedModel, speculator: Speculator, sink: SpeculationConfig, cache: DynamicCache, token: int,
           count: int) -> list[int]:
    """``count`` greedy tokens from sink attention (a session of its own) after ``token``; the cache is left as
    it was."""
    committed, drafts = cache.get_seq_length(), []
    try:
        # speculation starts at the cache's first position: no token comes before it (a drawing draft's seed is 0)
        region = DecodeRegion.build([0], [0], device=model.device, tokens=torch.zeros(1, 0, dtype=torch.long))
        with speculator.speculating(region, sink):
            for _ in range(count):
                logits = model(torch.tensor([[token]], device=model.device), **with_cache(model, cache),
                               use_cache=True).logits
                token = int(logits[0, -1].argmax())
                drafts.append(token)
    finally:
        truncate(cache, committed)
    return drafts
