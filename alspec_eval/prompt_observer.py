"""What an approximation that scores the prompt (``prompt_keys``: snapkv, kvpress's prompt-time presses) sees of it,
kept in one place so that the speculator's attention call stays locate, approximate, verify, commit, record.

Per call (:class:`PromptState`): each layer's input and rotary terms until the layer has observed the prompt (for
those that also read the layer, ``reads_layer``), what each layer kept of the prompt (``observe_prompt``), and the
prompt positions a shared prefill computed before the call (:class:`PromptPrefix`), joined to the call's first
pass so that a fork observes the whole prompt as a prefill of its own would. Per speculator (:class:`PromptObserver`):
the shared prefill's capture, and the model's rotary embedding.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from .approximations import LayerInputs, Site, draw_inputs

if TYPE_CHECKING:
    from .speculator import Session


@dataclass
class PromptPrefix:
    """What a shared prefill's pass over the first ``length`` prompt positions gives the approximations that score
    the prompt, per layer: the queries after RoPE, the attention module's input and its rotary terms."""

    length: int
    layers: dict[int, dict[str, object]] = field(default_factory=dict)

    def repeated(self, times: int) -> PromptPrefix:
        """Each batch row ``times`` times over, as a fork repeats the prefill's cache (a row of rotary terms
        shared by every batch row stays one)."""
        def rows(t: object, shared_row: bool) -> object:
            if isinstance(t, tuple):
                return tuple(rows(x, True) for x in t)
            return t if t is None or (shared_row and t.shape[0] == 1) else t.repeat_interleave(times, 0)
        return PromptPrefix(self.length, {layer: {k: rows(v, False) for k, v in kept.items()}
                                          for layer, kept in self.layers.items()})


@dataclass
class PromptState:
    """One call's view of the prompt: ``prefix`` (a shared prefill's, or None), per layer what the approximation kept
    of the prompt (``observed``) and, until then, the layer's input and rotary terms (``hidden``); ``holds`` says
    whether the pass that ``holds`` names holds every row's prompt end."""

    prefix: PromptPrefix | None = None
    observed: dict[int, object] = field(default_factory=dict)
    hidden: dict[int, tuple] = field(default_factory=dict)
    holds: tuple[int, bool] | None = None


class PromptObserver:
    """The prompt as the approximations of a speculator's sessions see it (module docstring)."""

    def __init__(self) -> None:
        self.rotary_emb: torch.nn.Module | None = None  # the model's, for approximations that read the layer
        self.capture: PromptPrefix | None = None  # while a shared prefill keeps its prompt positions (capturing)

    @contextmanager
    def capturing(self, length: int) -> Iterator[PromptPrefix]:
        """Keep, per layer, the queries, input and rotary terms of the passes in this block (a shared prefill over
        the first ``length`` positions, run outside any session), for the forks after it."""
        self.capture = PromptPrefix(length)
        try:
            yield self.capture
        finally:
            self.capture = None

    def layer_input(self, session: Session | None, speculates: bool, module: torch.nn.Module, hidden: torch.Tensor,
                    terms: Any) -> None:
        """A layer's input and rotary terms, before its attention: kept while a shared prefill captures, or for the
        session's approximation where it reads the layer and the layer has not observed the prompt yet."""
        if self.capture is not None and session is None:
            self.capture.layers.setdefault(module.layer_idx, {}).update(hidden=hidden, terms=terms)
            return
        approx = session.config.approx if session is not None else None
        if approx is None or not (approx.reads_layer and approx.prompt_keys) or not speculates \
                or module.layer_idx in session.prompt.observed:
            return
        session.prompt.hidden[module.layer_idx] = (hidden, terms)

    def attention(self, session: Session | None, speculates: bool, module: torch.nn.Module, query: torch.Tensor,
                  key: torch.Tensor, value: torch.Tensor, scaling: float) -> None:
        """A layer's attention call: its queries kept while a shared prefill captures; the prompt observed where the
        session's approximation scores it and this layer has not yet."""
        if self.capture is not None and session is None:
            self.capture.layers.setdefault(module.layer_idx, {})["query"] = query
        elif speculates and session.config.approx.prompt_keys and module.layer_idx not in session.prompt.observed:
            self._observe(session, module, query, key, value, scaling)

    def prepare(self, session: Session, module: torch.nn.Module, key: torch.Tensor, value: torch.Tensor,
                pad: torch.Tensor) -> object:
        """What the session's approximation prepares for this layer's positions (Approximation.prepare), with what
        it kept of the prompt and, where it reads the layer, the layer."""
        approx = session.config.approx
        extra = {"layer": LayerInputs(module, value, rotary_emb=self.rotary_emb)} if approx.reads_layer else {}
        return approx.prepare(key, pad, session.config.window, session.prompt.observed.get(module.layer_idx), **extra,
                              **draw_inputs(approx, site=lambda: Site(module.layer_idx)))

    def _observe(self, session: Session, module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                 value: torch.Tensor, scaling: float) -> None:
        """Let the approximation see the prompt in the pass that holds the last (up to) ``prompt_window()`` prompt
        positions of every row, once per layer (Approximation.observe_prompt)."""
        layer, region, approx, state = module.layer_idx, session.region, session.config.approx, session.prompt
        offset = key.shape[2] - query.shape[2]
        prefix = state.prefix if state.prefix is not None and state.prefix.length == offset else None
        if prefix is not None:  # the first pass after a shared prefill: the prompt's positions from 0
            kept = prefix.layers[layer]
            query, offset = torch.cat([kept["query"], query], 2), 0
        if state.holds is None or state.holds[0] != len(session.passes):  # once per pass
            start, pad = region.spec_start.cpu(), region.pad.cpu()
            first = start - (start - pad).clamp(max=approx.prompt_window())
            held = (start <= key.shape[2]) & ((first >= offset) | (start == pad))
            state.holds = (len(session.passes), bool(held.all()))
        if not state.holds[1]:
            return
        extra = {}
        if approx.reads_layer:
            hidden, terms = state.hidden.pop(layer, (None, None))
            if prefix is not None:
                hidden = torch.cat([kept["hidden"], hidden], 1)
                terms = tuple(_joined(a, b) for a, b in zip(kept["terms"], terms))
            extra = {"layer": LayerInputs(module, value, hidden, terms, self.rotary_emb)}
        pad, spec_start = session.on(key.device)[:2]
        state.observed[layer] = approx.observe_prompt(query, key, scaling, spec_start, pad, offset, **extra)


def _joined(first: torch.Tensor, then: torch.Tensor) -> torch.Tensor:
    """Rotary terms (rows, positions, D) of a prefix and the pass after it, one row shared by every batch row
    expanded to the other's rows."""
    rows = max(len(first), len(then))
    return torch.cat([first.expand(rows, *first.shape[1:]), then.expand(rows, *then.shape[1:])], 1)
