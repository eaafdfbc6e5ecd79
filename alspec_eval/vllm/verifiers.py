"""How a speculating layer's A~ is computed over vLLM's paged cache and decided: one class per way, behind one
interface (:class:`Verifier`), listed in :data:`VERIFIERS` and chosen once per engine (:func:`choose`) from what the
draft declares (``Approximation.keys_by_position``) and what the platform and the cache's layout offer (a compiler,
CUDA and Triton, the dtype). A new way is one more class in :data:`VERIFIERS`; tests/vllm_engine/test_paged.py runs
every one on the same steps against the gathered reference and an outside oracle.

Every way runs the same three steps per layer: measure (A~, d^2, n^2), sum d^2 and n^2 over the tensor-parallel
ranks (each holds some heads), decide and commit (:mod:`alspec_eval.semantics`).
"""

from __future__ import annotations

import functools
import importlib.util
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from .. import semantics
from ..approximations.base import Site
from ..stats import ACCEPTED, REJECTED, TRIVIAL
from . import native, tiled
from .native import NativeRows
from .paged import Contexts, Settings, StepRows, gathered, position_keys, readable_ranges, selected_positions

Reduce = Callable[[torch.Tensor], torch.Tensor]  # a tensor-parallel sum over ranks


@dataclass(frozen=True)
class Layer:
    """One layer's call: the step's queries and exact outputs (A, (T, Hq, D); the accepted A~ is committed into
    ``output`` in place), its paged cache and how to read it."""

    query: torch.Tensor
    output: torch.Tensor
    kv_cache: torch.Tensor
    layout: Any
    block_table: torch.Tensor
    block_size: int
    scale: float
    kept: torch.Tensor | None = None  # the page summaries of a draft that keeps them (:mod:`.kept`)
    site: Site = Site(0)  # the layer's index and this rank's first KV head: where a draft that draws draws


@dataclass(frozen=True)
class Plan:
    """One step's verification, the same at every layer, built on the host from the step's rows and copied to the
    device once: which rows are measured (``live``: not trivial), their tokens, the codes and ratios every layer
    starts from (TRIVIAL or REJECTED, NaN), and what the verifier itself built for the step (``prepared``)."""

    live: torch.Tensor  # host: indices into the step's rows
    live_device: torch.Tensor
    token: torch.Tensor  # device: the measured rows' tokens
    codes: torch.Tensor  # device (rows,) int8
    ratios: torch.Tensor  # device (rows,) float32
    prepared: Any


class Verifier:
    """One way of computing the verified rows' A~. ``prepare`` runs once per step on the host; ``verify`` once per
    layer, on the device, reading nothing back: ``approximate``, then d^2 and n^2, then :func:`decide`."""

    name: ClassVar[str]
    by_position: ClassVar[bool] = True  # it reads a draft's position_ranges: drafts that declare keys_by_position

    @classmethod
    def offered(cls, layout: Any, kv_cache: torch.Tensor) -> bool:
        """Whether the platform and this cache (its layout, device, dtype) offer this way."""
        return True

    def prepare(self, rows: StepRows, live: torch.Tensor, settings: Settings, layer: Layer) -> Any:
        """What every layer of the step shares, built on the host at its first layer (``layer``: its cache's
        geometry, the device)."""
        return None

    def approximate(self, layer: Layer, rows: StepRows, plan: Plan, settings: Settings,
                    observed: dict[int, Any]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """A~ of the live rows, and what the draft's declarations ask each to measure (:func:`.measures.measure`)."""
        raise NotImplementedError

    def verify(self, layer: Layer, rows: StepRows, plan: Plan, settings: Settings, observed: dict[int, Any],
               lam: float, reduce: Reduce | None) -> Decided:
        """A~ of the live rows, then d^2 and n^2 against their A, then :func:`decide`."""
        approx, measures = self.approximate(layer, rows, plan, settings, observed)
        exact = layer.output[plan.token]
        return decide(layer, plan, approx, exact, *semantics.squared_distances(approx, exact), lam, reduce, measures)


# a layer's codes and d/n of the step's rows, and its measures by name (:func:`.measures.measure`; NaN where none)
Decided = tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]


def decide(layer: Layer, plan: Plan, approx: torch.Tensor, exact: torch.Tensor, d2: torch.Tensor, n2: torch.Tensor,
           lam: float, reduce: Reduce | None, measures: dict[str, torch.Tensor] | None = None) -> Decided:
    """Every way's last steps: d^2 and n^2 (this rank's heads) summed over the tensor-parallel ranks (``reduce``;
    None: every head is here), the decision at ``lam`` and the commit of the accepted A~ into the layer's output;
    returns the step's codes and d/n with the live rows' filled in, and its measures (each a mean over this rank's
    heads; over every rank's, in the same sum)."""
    measures = measures or {}
    if reduce is not None and measures:  # the ranks counted in the same sum, for the measures' means
        d2, n2, *summed, ranks = reduce(torch.stack([d2, n2, *measures.values(), torch.ones_like(d2)]))
        measures = {name: total / ranks for name, total in zip(measures, summed, strict=True)}
    elif reduce is not None:
        d2, n2 = reduce(torch.stack([d2, n2]))
    d, n = d2.sqrt(), n2.sqrt()
    accepted = semantics.accept(d, n, lam)
    layer.output[plan.token] = semantics.commit(exact, approx, accepted)
    codes = plan.codes.index_put((plan.live_device,), torch.where(accepted, ACCEPTED, REJECTED).to(torch.int8))
    return codes, plan.ratios.index_put((plan.live_device,), d / n), _step_measures(plan, measures)


def _step_measures(plan: Plan, measures: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The live rows' measures as the step's (NaN where a row was not measured)."""
    return {name: torch.full_like(plan.ratios, math.nan).index_put((plan.live_device,), value.float())
            for name, value in measures.items()}


def _native_rows(rows: StepRows, live: torch.Tensor, settings: Settings, device: torch.device) -> NativeRows:
    """The live rows with their key ranges, as the kernels read them (host tensors)."""
    starts, ends, _ = position_keys(settings, rows.pos[live], device)
    return NativeRows.build(rows.token[live], rows.request[live], starts, ends, live, rows.pos[live])


class Native(Verifier):
    """One pass in C over the CPU's cache (:mod:`.native`), measuring, deciding and committing in one call where
    every head is on this rank. Its scratch buffers are the engine's (one verifier per engine)."""

    name = "native"

    def __init__(self) -> None:
        self.scratch = native.Scratch()

    @classmethod
    def offered(cls, layout: Any, kv_cache: torch.Tensor) -> bool:
        return native.usable(layout, kv_cache)

    def prepare(self, rows: StepRows, live: torch.Tensor, settings: Settings, layer: Layer) -> NativeRows:
        return _native_rows(rows, live, settings, layer.output.device)

    def verify(self, layer: Layer, rows: StepRows, plan: Plan, settings: Settings, observed: dict[int, Any],
               lam: float, reduce: Reduce | None) -> Decided:
        if reduce is None:  # every head is here: measured, decided and committed in the kernel's one call
            return *native.verify_and_decide(layer.query, layer.output, layer.kv_cache, layer.block_table,
                                             plan.prepared, layer.scale, lam, plan.codes, plan.ratios,
                                             self.scratch), {}
        approx, d2, n2 = native.verify(layer.query, layer.output, layer.kv_cache, layer.block_table, plan.prepared,
                                       layer.scale, self.scratch)
        return decide(layer, plan, approx, layer.output[plan.token], d2, n2, lam, reduce)


TRITON_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@functools.cache
def _triton_installed() -> bool:
    return importlib.util.find_spec("triton") is not None


class Triton(Verifier):
    """The paged Triton verifier on a CUDA cache of a plain layout, read in place (any of vLLM's strides)."""

    name = "triton"

    @classmethod
    def offered(cls, layout: Any, kv_cache: torch.Tensor) -> bool:
        return (layout.triton and kv_cache.is_cuda and kv_cache.dtype in TRITON_DTYPES and kv_cache.stride(-1) == 1
                and _triton_installed())

    def prepare(self, rows: StepRows, live: torch.Tensor, settings: Settings, layer: Layer) -> NativeRows:
        return _native_rows(rows, live, settings, layer.output.device).to(layer.output.device)

    def approximate(self, layer: Layer, rows: StepRows, plan: Plan, settings: Settings,
                    observed: dict[int, Any]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        from ..kernels.triton_verify import paged_approximation

        ranges = plan.prepared
        return paged_approximation(layer.query, *layer.layout.halves(layer.kv_cache), layer.block_table, ranges.token,
                                   ranges.request, ranges.pos, ranges.starts, ranges.ends, layer.scale), {}


class Tiles(Verifier):
    """Torch ops over tiles of consecutive queries, each reading the union of its queries' ranges once
    (:mod:`.tiled`): any layout, any device."""

    name = "tiles"

    def prepare(self, rows: StepRows, live: torch.Tensor, settings: Settings, layer: Layer) -> tiled.Tiles:
        position_keys(settings, rows.pos[live], layer.output.device)  # the breaches, counted as the other ways do
        approx, window, align = settings.approx, settings.window, settings.window_align
        return tiled.Tiles.build(rows.token[live], rows.request[live], rows.pos[live], rows.prompt[live],
                                 lambda at: readable_ranges(approx, at, window, align), window,
                                 layer.block_size).to(layer.output.device)

    def approximate(self, layer: Layer, rows: StepRows, plan: Plan, settings: Settings,
                    observed: dict[int, Any]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        return tiled.approximate(layer.query, layer.kv_cache, layer.layout, layer.block_table, layer.block_size,
                                 plan.prepared, layer.scale), {}


def _contexts(rows: StepRows, live: torch.Tensor, settings: Settings, layer: Layer) -> Contexts | None:
    """Which contexts the step's live rows read, grouped (None: a draft fixed by position reads its ranges)."""
    if settings.approx.keys_by_position:
        return None
    return Contexts.build(rows.request[live], rows.pos[live], settings.approx, layer.kv_cache)


class Gathered(Verifier):
    """Each row's selected keys gathered from the cache (:func:`.paged.gathered`): every draft, including those
    that select by content; the reference the others are tested against."""

    name = "gathered"
    by_position = False

    def prepare(self, rows: StepRows, live: torch.Tensor, settings: Settings, layer: Layer) -> Contexts | None:
        return _contexts(rows, live, settings, layer)

    def approximate(self, layer: Layer, rows: StepRows, plan: Plan, settings: Settings,
                    observed: dict[int, Any]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        return gathered(layer.query[plan.token], layer.kv_cache, layer.layout, layer.block_table, layer.block_size,
                        rows.request[plan.live], rows.pos[plan.live], settings, observed, layer.scale, plan.prepared,
                        layer.kept, rows.seed[plan.live], layer.site)


class Listed(Verifier):
    """Each row's selected keys (:func:`.paged.selected_positions`, as the gathered path selects them) verified in
    one pass in C over the CPU's cache (:func:`.native.verify_listed`): every draft, no key copied; measured, decided
    and committed in one call where every head is on this rank."""

    name = "listed"
    by_position = False

    def __init__(self) -> None:
        self.scratch = native.Scratch()

    @classmethod
    def offered(cls, layout: Any, kv_cache: torch.Tensor) -> bool:
        return native.usable(layout, kv_cache)

    def prepare(self, rows: StepRows, live: torch.Tensor, settings: Settings,
                layer: Layer) -> tuple[torch.Tensor, torch.Tensor, Contexts | None]:
        """The live rows' tokens and batch rows as the kernel reads them, and the contexts they read (as
        :class:`Gathered`'s)."""
        return (rows.token[live].long().contiguous(), rows.request[live].long().contiguous(),
                _contexts(rows, live, settings, layer))

    def verify(self, layer: Layer, rows: StepRows, plan: Plan, settings: Settings, observed: dict[int, Any],
               lam: float, reduce: Reduce | None) -> Decided:
        token, request, contexts = plan.prepared
        read: list[tuple[torch.Tensor, torch.Tensor]] = []
        positions, valid, log_weight, measures = selected_positions(
            layer.query[plan.token], layer.kv_cache, layer.layout, layer.block_table, layer.block_size, request,
            rows.pos[plan.live], settings, observed, contexts, layer.kept, rows.seed[plan.live], layer.site,
            layer.scale, functools.partial(native.key_scores, layer.kv_cache, layer.block_table), read, native=True)
        listed = native.Listed(token, request, plan.live, positions, valid, log_weight, *_read_keys(read, request))
        if reduce is None:
            return *native.verify_listed_and_decide(layer.query, layer.output, layer.kv_cache, layer.block_table,
                                                    listed, layer.scale, lam, plan.codes, plan.ratios,
                                                    self.scratch), _step_measures(plan, measures)
        approx, d2, n2 = native.verify_listed(layer.query, layer.output, layer.kv_cache, layer.block_table, listed,
                                              layer.scale, self.scratch)
        return decide(layer, plan, approx, layer.output[plan.token], d2, n2, lam, reduce, measures)


def _read_keys(read: list[tuple[torch.Tensor, torch.Tensor]],
               request: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The contexts a draft read to select (one group of requests: the keys as the listed kernel reads them), and
    each row's among them (-1: none); (None, None) where it read none, or several groups (each row then gathers its
    keys from the cache: the same bits)."""
    if len(read) != 1 or not len(request):
        return None, None
    requests, keys = read[0]
    where = torch.full((int(max(request.max(), requests.max())) + 1,), -1, dtype=torch.long)
    where[requests.long()] = torch.arange(len(requests))
    return keys, where[request]


# by preference: the first a draft and a cache admit is the engine's
VERIFIERS: dict[str, type[Verifier]] = {v.name: v for v in (Native, Triton, Tiles, Listed, Gathered)}


def choose(approx: Any, layout: Any, kv_cache: torch.Tensor) -> Verifier:
    """The engine's verifier for this draft (by its ``keys_by_position``) on this cache: the first of
    :data:`VERIFIERS` both admit. Decided from declarations and the cache's properties, never by running code."""
    return next(v() for v in VERIFIERS.values()
                if (approx.keys_by_position or not v.by_position) and v.offered(layout, kv_cache))


def plan(rows: StepRows, settings: Settings, layer: Layer, verifier: Verifier) -> Plan:
    """The step's :class:`Plan` for ``verifier``, built on the step's first layer and kept with its rows (the
    layers of a step that share a cache's geometry share it)."""
    cache = layer.kv_cache
    key = (settings.window, settings.window_align, settings.approx, str(layer.output.device), layer.block_size,
           tuple(cache.shape[1:]), cache.dtype, verifier.name)
    built = rows.plans.get(key)
    if built is None:
        trivial = semantics.is_trivial(rows.pos, settings.window)
        live = (~trivial).nonzero().squeeze(1)
        codes = torch.where(trivial, TRIVIAL, REJECTED).to(torch.int8)
        ratios = torch.full(rows.pos.shape, math.nan)
        prepared = verifier.prepare(rows, live, settings, layer) if len(live) else None
        device = layer.output.device
        built = rows.plans[key] = Plan(live, live.to(device), rows.token[live].to(device), codes.to(device),
                                       ratios.to(device), prepared)
    return built


def verify_and_count(query: torch.Tensor, output: torch.Tensor, kv_cache: torch.Tensor, layout: Any,
                     block_table: torch.Tensor, block_size: int, rows: StepRows, settings: Settings, layer: int,
                     scale: float, reduce: Reduce | None = None, observed: dict[int, Any] | None = None,
                     verifier: Verifier | None = None, kept: torch.Tensor | None = None) -> Decided | None:
    """Verify one layer's speculating tokens and commit the accepted A~ into ``output`` (A, (T, Hq, D)), in place.
    ``observed``: per batch row, what a prompt-scoring draft kept of the row's prompt at this layer. ``verifier``:
    the engine's (None: :func:`choose`). ``kept``: the layer's page summaries of a draft that keeps them.

    Returns each row's decision code and d/n (NaN where not measured) and its measures by name
    (:func:`.measures.measure`), on the output's device, nothing read back, or None where the layer does not
    speculate (threshold OFF). Under tensor parallelism each rank holds some heads: ``reduce`` sums d^2 and n^2 over
    the ranks before any decides, so every rank commits the same rows.
    """
    lam = settings.thresholds[layer]
    if math.isnan(lam) or not len(rows.token):
        return None
    verifier = verifier or choose(settings.approx, layout, kv_cache)
    layer_call = Layer(query, output, kv_cache, layout, block_table, block_size, scale, kept,
                       Site(layer, settings.first_kv_head))
    step = plan(rows, settings, layer_call, verifier)
    if lam == -math.inf or not len(step.live):  # static's exact layers: decided, not measured
        return step.codes, step.ratios, {}
    return verifier.verify(layer_call, rows, step, settings, observed or {}, lam, reduce)


def verify_layer(*args: Any, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor] | None:
    """:func:`verify_and_count`'s codes and d/n alone (what a caller that prices no keys reads)."""
    decided = verify_and_count(*args, **kwargs)
    return None if decided is None else decided[:2]
