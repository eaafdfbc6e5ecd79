"""What every approximation of A is: a frozen dataclass whose fields are its parameters (``Quest(page=16)``), the
way kvpress's presses are, and whose class says what the rest of the code would otherwise ask by its name: whether
a fused kernel or the TT op computes it, whether it is an oracle, what a decode step reads (the latency model's
cost), and how reports draw it. docs/design.md, "Approximations", is the contract.

Torch-free on purpose: the package imports this module at every interpreter start (the lm-eval hook).
"""

from __future__ import annotations

import dataclasses
import re
import typing
from dataclasses import dataclass
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, ClassVar

from ..errors import ConfigError
from .catalog import DEFAULT, name_of

if TYPE_CHECKING:
    import torch

# What ``select`` returns: per speculated position and KV head (or one row for every head), physical key indices
# into the layer's (B, Hkv, L, D) cache, (r, Hkv or 1, at most max_keys), and which of them count (None: all of them);
# a ``weighted`` draft adds each key's log-weight (float32, the indices' shape), added to its score.
Selected = tuple["torch.Tensor", "torch.Tensor | None"] | tuple["torch.Tensor", "torch.Tensor | None", "torch.Tensor"]
# What ``position_ranges`` returns: per query K ranges of logical key positions, [starts, ends), (R, K) each, and the
# most keys each range holds (fixed by the window: a paged read of them has the same shape whatever the batch).
Ranges = tuple["torch.Tensor", "torch.Tensor", tuple[int, ...]]


@dataclass(frozen=True)
class Approximation:
    """One way to choose the at most 2S keys that A~ attends to, under ALSpec's verification.

    Subclass it as a frozen dataclass, its parameters as fields with defaults, and register it
    (``alspec_eval.register_approximation``, the ``alspec_eval.approximations`` entry points, or
    ``approx=pkg.module:Class``). The speculator calls, per forward pass: :meth:`per_pass` once, then per layer
    :meth:`prepare` once and :meth:`select` per chunk of speculated positions; it gathers the selected keys and
    values and calls the model's own attention on them. Positions given are logical (from each row's first real
    token); indices returned are physical (``logical + pad``).
    """

    description: ClassVar[str] = "a user's approximation"  # what A~ attends to, for captions; may name fields
    marker: ClassVar[str] = "o"  # its lambda rows' marker and colour where figures tell approximations apart
    colour: ClassVar[str] = "tab:gray"
    oracle: ClassVar[bool] = False  # it reads every exact score: a ceiling, marked wherever reported
    fused_kernel: ClassVar[bool] = False  # kernel=torch|triton compute its A~ in the decode step's one call
    keys_by_position: ClassVar[bool] = False  # position_ranges gives its keys (vLLM reads them in one pass)
    tt_op: ClassVar[bool] = False  # the authors' TT op computes its A~ (backend=tt)
    window_aligns: ClassVar[tuple[int, ...]] = (1,)  # the window_align values it defines A~ for
    prompt_keys: ClassVar[bool] = False  # it scores the prompt once, at prefill (observe_prompt: SnapKV's family)
    # a prompt_keys draft whose prepare results of several prompts observed apart stack into one (stack_prepared),
    # so that vLLM, which observes each request's prompt alone, selects for their rows at once
    stacks_prepared: ClassVar[bool] = False
    reads_layer: ClassVar[bool] = False  # prepare and observe_prompt also get the layer (LayerInputs: kvpress's)
    # prepare and select read the context's keys; False: only its shape, dtype and device (a prompt-time scorer's
    # selection comes from what it observed), and vLLM then reads no context from its paged cache (keys of NaN)
    reads_keys: ClassVar[bool] = True
    family_name: ClassVar[str] = ""  # the name a family's factory made it under ("kvpress:SnapKVPress")
    names_defaults: ClassVar[bool] = True  # labels and slugs name every parameter (False: those given otherwise)
    # what it reads that only the HF engine's layer has (its attention module, the layer's input): why it cannot run
    # inside vLLM, whose attention sees queries, keys and values only; "" where it reads nothing else
    hf_only: ClassVar[str] = ""
    # select returns a log-weight per key, added to its score (sampling estimators: vAttention); such a draft selects
    # by content (no keys_by_position, fused_kernel or tt_op: those paths read no weights)
    weighted: ClassVar[bool] = False
    # a row's first keys' scores settle as later keys come (LagKV's chunk scores, once the next chunk is whole): an
    # engine that keeps state across steps (vLLM) hands prepare, as ``observed``, a dict per row of the batch, kept
    # per request and layer, in which select keeps what settled; None elsewhere (the HF engine: scored again)
    keeps_scores: ClassVar[bool] = False
    # its select draws at random: per_pass also gets each position's request seed (seed=) and prepare the layer's
    # Site (site=), so that every engine, tensor-parallel rank and rerun draws alike (vAttention's sample)
    draws: ClassVar[bool] = False
    # select reads the positions and the keys' shape alone (no query, key, value or layer; reads_keys False, no
    # draws): every layer of a step selects the same keys, so an engine that verifies layer by layer (vLLM) may
    # select once a step (kvpress's RandomPress: its numbers are drawn from one fixed seed)
    same_at_every_layer: ClassVar[bool] = False
    # select reads the keys only through their scores (semantics.key_scores: q.k, per KV head the largest over its
    # group) and selects from them in select_scored, so an engine that scores keys where they lie (vLLM's CPU kernel)
    # copies no context for it (top-k)
    ranks_by_scores: ClassVar[bool] = False

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        fixed = [a for a in ("keys_by_position", "fused_kernel", "tt_op") if getattr(cls, a)]
        if cls.weighted and fixed:
            raise TypeError(f"{cls.__qualname__} declares weighted and {', '.join(fixed)}: the tiles, the kernels and "
                            "the TT op read no weights; a weighted draft selects its keys in select")
        if cls.draws and fixed:
            raise TypeError(f"{cls.__qualname__} declares draws and {', '.join(fixed)}: the tiles, the kernels and "
                            "the TT op give no request seed or layer; a draft that draws selects its keys in select")
        if cls.same_at_every_layer and (cls.reads_keys or cls.draws):
            raise TypeError(f"{cls.__qualname__} declares same_at_every_layer but reads keys or draws per layer: "
                            "declare it only where select reads the positions and the keys' shape alone")
        if cls.ranks_by_scores and cls.select_scored is Approximation.select_scored:
            raise TypeError(f"{cls.__qualname__} declares ranks_by_scores but no select_scored: define it (select "
                            "then calls it with semantics.key_scores of its keys)")

    # ------------------------------------------------------------------ settings

    def check(self, window: int) -> None:
        """Raise ConfigError (naming the value and the fix) where the parameters do not fit the budget 2S."""

    def args(self) -> dict[str, Any]:
        """Its parameters, as ``approx_args`` and the results record them."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    @property
    def name(self) -> str:
        return name_of(type(self))

    @property
    def label(self) -> str:
        """How tables and legends name it: "sink", "quest P=16"."""
        parts = [f"{_short(f, 'label')}={getattr(self, f.name)}" for f in self._named()]
        return " ".join([self.name, *parts])

    @property
    def slug(self) -> str:
        """Its part of a cell's file name: "quest_p16" (any name made file-safe)."""
        parts = [f"{_short(f, 'short')}{getattr(self, f.name)}" for f in self._named()]
        return re.sub(r"[^A-Za-z0-9._=-]+", "-", "_".join([self.name, *parts]))

    @property
    def is_default(self) -> bool:
        """Whether it is the registry's default (``approximations.DEFAULT``, its parameters as made by name): its rows
        keep the paper's names, "lambda_0.1" and "sink", with no part of their own (:meth:`row_part`)."""
        return self.name == DEFAULT and self == type(self)()

    def row_part(self, sep: str, label: bool = False) -> str:
        """Its part of a row's file name (``sep`` + its slug, "_quest_p16") or of its label (``sep`` + its label,
        " · quest P=16"); none for the default (:attr:`is_default`)."""
        return "" if self.is_default else sep + (self.label if label else self.slug)

    def _named(self) -> list[dataclasses.Field]:
        """The parameters its label and slug name (kvpress's presses have many: only those given otherwise)."""
        return [f for f in dataclasses.fields(self) if self.names_defaults or getattr(self, f.name) != f.default]

    def caption(self) -> str:
        """"quest P=16: Quest's query-aware pages of 16 tokens"."""
        return f"{self.label}: {self.description.format(**self.args())}"

    # ------------------------------------------------------------------ the cost (the latency model)

    def max_keys(self, window: int) -> int | None:
        """The most keys one position's selection counts per KV head: the paper's 2S, or None where the budget varies
        per head and query up to the whole context (vAttention's). Buffers and ``alspec-check-approx`` read it."""
        return 2 * window

    def keys_read(self, context: int, window: int) -> float:
        """Keys and values A~ reads per KV head and decode step at context ``context`` (L), in units of one key
        and its value (2 D elements): what the latency model prices a verified hit from. An approximation that
        reads every key (an oracle) says ``context``: it can start no earlier than A, so it buys nothing."""
        raise NotImplementedError(f"{self.name} declares no cost (keys_read)")

    def promise(self) -> Promise | None:
        """What the draft promises of its error without verification (vAttention's epsilon and delta), for the
        statistics to measure against exact attention; None (the default): it promises nothing."""
        return None

    def fused_decode(self, kernel: Any) -> Any:
        """The decode kernel its decode steps take (``kernel``, which computes the sink's A~ in the same call as A),
        else None: a draft whose A~ the kernel does not compute takes its layers' own path."""
        return kernel if self.fused_kernel else None

    def position_ranges(self, pos: torch.Tensor, window: int, window_align: int) -> Ranges | None:
        """Where A~'s keys are when they depend on the query's logical position alone: [starts, ends) (R, K) each,
        K disjoint ranges of logical positions per query, none past it, and the most keys each can hold (ints), so
        that a paged cache (vLLM) is read at those keys only, shared by a tile of consecutive queries; a draft that
        gives them declares ``keys_by_position = True`` (vLLM chooses how it verifies from that declaration). None
        (the default) where A~ needs more than the position: vLLM then reads each row's context from its paged cache
        and selects through :meth:`per_pass`, :meth:`prepare` and :meth:`select`, as the HF engine does. Ranges
        that leave [0, pos] are cut to it and the run refused after the call (:mod:`alspec_eval.bounds`)."""
        return None

    # ------------------------------------------------------------------ one call's selections

    def per_pass(self, pos: torch.Tensor, pad: torch.Tensor, key_len: int, window: int,
                 window_align: int, seed: torch.Tensor | None = None) -> tuple[torch.Tensor | None, ...]:
        """Once per forward pass, for its speculated positions (``pos``, ``pad``: (R,)): what every layer shares,
        as tensors whose first dimension is R (the speculator slices them per chunk and copies them to each
        device of a device map). Keys fixed by position (the sink's windows) are computed here. A draft that
        ``draws`` also gets ``seed``: each position's request seed (R,) (:func:`alspec_eval.semantics.request_seed`)."""
        return ()

    def observe_prompt(self, query: torch.Tensor, key: torch.Tensor, scaling: float, start: torch.Tensor,
                       pad: torch.Tensor, offset: int, layer: LayerInputs | None = None) -> Any:
        """Once per layer, in the forward pass that holds the end of every row's prompt (``prompt_keys``
        approximations only): what it keeps of the prompt for the decode steps (SnapKV's key scores). ``query``
        (B, Hq, q_len, D) after RoPE holds physical positions from ``offset``, ``key`` is the layer's cache so far,
        ``start`` (B,) each row's first speculated position (physical; the prompt is [pad, start)); ``layer``
        (``reads_layer`` approximations only) the module, values and the pass's hidden states."""
        return None

    def kept_observation(self, observed: Any, window: int) -> Any:
        """What an engine keeps of :meth:`observe_prompt`'s result for the decode steps at a window of ``window``
        (inside vLLM, also across calls, per prompt): all of it, unless a draft reads less of it."""
        return observed

    def prompt_window(self) -> int:
        """How many of each prompt's last positions :meth:`observe_prompt` reads (one pass must hold them)."""
        return 0

    def prepare(self, key: torch.Tensor, pad: torch.Tensor, window: int, observed: Any = None,
                layer: LayerInputs | None = None, site: Site | None = None) -> Any:
        """Once per layer and pass: what that layer's selections share (Quest's page bounds), from the layer's
        (B, Hkv, L, D) cache and each batch row's left padding (B,); ``observed``: what :meth:`observe_prompt`
        returned for this layer; ``layer`` (``reads_layer`` approximations only): the module and its values;
        ``site`` (``draws`` approximations only): where the layer's draws are made."""
        return observed

    def needs_keys(self, kept: dict | None, length: int) -> bool:
        """Whether :meth:`select` reads the keys of a row whose store (``keeps_scores`` drafts) is ``kept``, at a
        context of ``length`` keys: an engine that keeps the stores reads no context where no row of it does (its
        keys then NaN, as where ``reads_keys`` is False)."""
        return self.reads_keys

    def stack_prepared(self, prepared: list[Any], window: int) -> Any:
        """``prepare``'s results for prompts observed one at a time (one row each), as one for those rows in order
        (``stacks_prepared`` drafts): what select reads for a row must be what it read from that row's own."""
        raise NotImplementedError(f"{self.name} does not stack its prepared prompts (stacks_prepared is False)")

    def kept_page(self) -> int | None:
        """Where :meth:`prepare` summarizes each page of this many keys, and page summaries merge (Quest's bounds:
        the minimum of minima), so that a paged cache (vLLM) keeps them per block as its keys are written and
        prepares from them without reading a key (:meth:`summarize`, :meth:`merge`, :meth:`prepare_pages`; select
        then gets the keys' shape only, as where ``reads_keys`` is False). None (the default): nothing is kept."""
        return None

    def summarize(self, keys: torch.Tensor, values: torch.Tensor | None = None) -> torch.Tensor:
        """Consecutive keys of one page, (..., n, Hkv, D), summarized: (..., Hkv, F); ``values`` (the same shape),
        for a draft that ``reads_layer``."""
        raise NotImplementedError

    def merge(self, parts: torch.Tensor) -> torch.Tensor:
        """The summaries of consecutive parts of a page, (..., m, Hkv, F), as one: (..., Hkv, F), bit for bit the
        summary of all their keys."""
        raise NotImplementedError

    def prepare_pages(self, pages: torch.Tensor) -> Any:
        """Every full page's summary of each row, (B, Hkv, pages, F), as :meth:`prepare` makes it from the keys,
        bit for bit."""
        raise NotImplementedError

    def select_kept(self, query: torch.Tensor, kept: torch.Tensor, block_table: torch.Tensor, block_size: int,
                    request: torch.Tensor, pos: torch.Tensor, window: int, length: int) -> Selected | None:
        """:meth:`select` straight from the summaries a paged cache keeps (:meth:`kept_page`; ``kept`` (blocks, parts
        a block, Hkv, F) through ``block_table``), in one native call, for positions ``pos`` of batch rows
        ``request`` (host) without left padding, their contexts read to ``length`` keys: what an engine's native
        verifier asks first. None (the default, and where no kernel reads these tensors): it prepares
        (:meth:`prepare_pages`) and selects."""
        return None

    def select(self, query: torch.Tensor, key: torch.Tensor, rows: torch.Tensor, pos: torch.Tensor,
               pad: torch.Tensor, window: int, passed: tuple[torch.Tensor | None, ...], prepared: Any) -> Selected:
        """For speculated positions (their queries (r, Hq, D) after RoPE, batch rows ``rows``, logical positions
        ``pos``, left padding ``pad``, and their slice of :meth:`per_pass`): the keys A~ attends to per KV head.
        Never a key past ``pos`` or of the padding, at most 2S of them (``alspec-check-approx`` checks; a key outside
        [0, pos] is read as the nearest inside and the run refused after the call: :mod:`alspec_eval.bounds`)."""
        raise NotImplementedError

    def select_scored(self, scores: torch.Tensor, rows: torch.Tensor, pos: torch.Tensor, pad: torch.Tensor,
                      window: int, passed: tuple[torch.Tensor | None, ...], prepared: Any) -> Selected:
        """:meth:`select` of a draft that ``ranks_by_scores``, from its rows' scores (r, Hkv, L): each row's query
        against its own keys (:func:`alspec_eval.semantics.key_scores`), any slot past ``pos`` whatever the engine
        holds there (-inf, or another row's key's score): the draft never keeps it."""
        raise NotImplementedError

    def position_bytes(self, key: torch.Tensor, query_heads: int) -> int:
        """Bytes one speculated position's selection holds at its peak (the speculator sizes its chunks by it)."""
        return 0


def selection(approx: Approximation, selected: Selected) -> tuple[torch.Tensor, torch.Tensor | None,
                                                                  torch.Tensor | None]:
    """What ``select`` returned as (index, valid, log_weight), log_weight None for an unweighted draft; a draft that
    returns weights without declaring ``weighted`` (or the reverse) is told so."""
    if len(selected) != (3 if approx.weighted else 2):
        raise TypeError(f"{approx.name}.select returned {len(selected)} tensors: a draft returns (index, valid), and "
                        "(index, valid, log_weight) exactly where it declares weighted = True")
    return (*selected, None) if len(selected) == 2 else tuple(selected)


def scores_bytes(key: torch.Tensor) -> int:
    """What ranking one position's keys by score holds: a row's float32 scores, and the sort's values and indices."""
    return key.shape[2] * key.shape[1] * 16


@dataclasses.dataclass(frozen=True)
class Promise:
    """A draft's promise: with probability at least 1 - ``delta``, each quantity it bounds stays within a relative
    error of ``epsilon``. ``denominator``: the softmax denominator of each query head, |D~ - D| <= epsilon D (D~ the
    sum of the selected keys' weighted exponentials, D every key's). Both engines measure, per layer, the share of
    verified positions where it fails, and the share where ALSpec's own d/n exceeds epsilon."""

    epsilon: float
    delta: float
    denominator: bool = False


@dataclasses.dataclass(frozen=True)
class Site:
    """Where a layer's selections are drawn, for a draft that draws at random (``draws``): the layer's index in the
    model, and the model's index of the first KV head the cache holds (a tensor-parallel rank holds some of them;
    0 on the HF engine), so that every engine and rank draws a KV head's keys alike."""

    layer: int
    first_kv_head: int = 0


def draw_inputs(approx: Approximation, **given: Callable[[], Any]) -> dict[str, Any]:
    """The keyword arguments a draft that draws at random (``draws``) gets and no other draft does: ``seed=`` of
    ``per_pass``, ``site=`` of ``prepare``, each made (by its function) only for such a draft. Every engine calls its
    draft through this one rule."""
    return {name: make() for name, make in given.items()} if approx.draws else {}


@dataclasses.dataclass
class LayerInputs:
    """What a ``reads_layer`` approximation sees of a layer beyond its keys: the attention module (its projections
    and config), the (B, Hkv, L, D) values, and, while the prompt is observed, the pass's (B, q_len, hidden) input
    and its rotary ``position_embeddings`` (cos, sin) as the module's forward received them, and the model's
    rotary embedding module."""

    module: torch.nn.Module | None  # None inside vLLM, whose layer has no HF module (drafts that read it: hf_only)
    value: torch.Tensor | None  # None for a draft that reads no value (kvpress.MeanKeyPress: KeyDiff)
    hidden_states: torch.Tensor | None = None
    position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None
    rotary_emb: torch.nn.Module | None = None  # the model's rotary embedding module, where it has one


def _short(field: dataclasses.Field, kind: str) -> str:
    return field.metadata.get(kind, field.name)


def parse_args(cls: type[Approximation], name: str, args: str | dict[str, Any] | None) -> dict[str, Any]:
    """``approx_args`` (``page:16;refresh:64``, the static_layers syntax, or a mapping) as keyword arguments of
    ``cls``, each converted to its field's type; an unknown key or a bad value is a ConfigError naming the fix."""
    if args in (None, ""):
        return {}
    if isinstance(args, str):
        pairs = {}
        for item in filter(None, (part.strip() for part in args.split(";"))):
            key, sep, value = item.partition(":")
            if not sep:
                raise ConfigError(f"approx_args={args!r}: {item!r} is not key:value; write e.g. "
                                  f"approx_args={_example(cls)}")
            pairs[key.strip()] = value.strip()
        args = pairs
    if not isinstance(args, dict):
        raise ConfigError(f"approx_args={args!r} is neither key:value;... nor a mapping; write e.g. "
                          f"approx_args={_example(cls)}")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    hints = typing.get_type_hints(cls)
    out = {}
    for key, value in args.items():
        if key not in fields:
            known = ", ".join(f"{f.name} (default {f.default})" for f in fields.values()) or "none"
            raise ConfigError(f"approx_args {key}={value!r}: {name} has no parameter {key!r}; its parameters: {known}")
        out[key] = _convert(hints[key], value, name, key)
    return out


def _convert(kind: Any, value: Any, name: str, key: str) -> Any:
    optional = [arg for arg in typing.get_args(kind) if arg is not type(None)]
    if len(optional) == 1 and type(None) in typing.get_args(kind):  # Optional[X]: "none" or an X
        if value is None or (isinstance(value, str) and value.lower() == "none"):
            return None
        kind = optional[0]
    if kind is bool and isinstance(value, str) and value.lower() in ("true", "false"):
        return value.lower() == "true"
    if kind in (int, float) and isinstance(value, str):
        try:
            return kind(value)
        except ValueError:
            pass
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if kind in (int, float, bool, str) and (type(value) is not kind):
        raise ConfigError(f"approx_args {key}={value!r} is not {'an' if kind is int else 'a'} {kind.__name__} "
                          f"({name}'s {key}); give e.g. {key}:{ {int: 16, float: 0.5, bool: 'true', str: 'x'}[kind]}")
    return value


def _example(cls: type[Approximation]) -> str:
    fields = dataclasses.fields(cls)
    return ";".join(f"{f.name}:{f.default}" for f in fields) if fields else "(none: it takes no parameters)"
