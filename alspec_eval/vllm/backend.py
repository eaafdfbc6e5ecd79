"""The speculating attention: the platform's own backend (CPU_ATTN, FlashAttention, Triton, FlexAttention) computes A
into ``output``, then every speculating token of the step is verified and committed by
:func:`.verifiers.verify_and_count` (:class:`SpeculatingImpl`, mixed into each backend's impl by :mod:`.backends`).

Which tokens speculate comes from the requests: the driver tags each with ``SamplingParams.extra_args["alspec"]``
(where its speculation starts, and its id), and the speculating metadata builder (:mod:`.backends`) builds the
step's rows once per step, where vLLM builds its attention metadata, and attaches them to it (``alspec``). A step
without tags (vLLM's warm-up and profiling passes) runs the platform's backend alone.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch

from . import kept
from .prefix_cache import TAG
from .paged import (PromptRows, Prompts, Settings, StepRows, check_newest, contexts, layout_for, observation_scope,
                    observe_layer)
from .tiled import reserve
from .verifiers import Verifier, choose, verify_and_count

NEVER = 1 << 62  # a start past any context: the request does not speculate


@dataclass
class WorkerState:
    """One vLLM worker's speculation: its settings (None until the driver configures it), the step it last read,
    and the decisions recorded since the driver last took them."""

    runner: Any = None
    settings: Settings | None = None
    # per layer call: the rows' tags and positions, the layer, its codes, d/n and measures (verifiers.Decided)
    records: list[tuple[torch.Tensor, torch.Tensor, int, torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]] = field(
        default_factory=list)
    prompts: Prompts = field(default_factory=Prompts)  # a prompt-scoring draft's observations (paged.observe_layer)
    checked: set[str] = field(default_factory=set)  # layers whose cache layout was checked once
    dumps: list[dict[str, Any]] = field(default_factory=list)  # Settings.dump: what an outside reference reads
    backend: str | None = None  # the platform backend that gives A (provenance)
    verifier: Verifier | None = None  # how this engine verifies (verifiers.choose), chosen at its first layer call
    kept: dict[str, torch.Tensor | None] = field(default_factory=dict)  # per layer, a draft's summaries (kept.py)
    # per block table (its buffer) of a CPU cache: the physical blocks whose summaries every layer holds
    summarized: dict[int, torch.Tensor] = field(default_factory=dict)

    def step(self, common: Any) -> Step | None:
        """The step's speculating tokens and the tokens in an observation window, built once per step by the
        speculating metadata builder (:mod:`.backends`) from vLLM's ``CommonAttentionMetadata`` (its host copies of
        ``query_start_loc`` and the sequence lengths: nothing read back from the device) and the requests' tags
        (:meth:`_tags`); None before the driver configures the engine. Observations of requests no longer in the
        engine are dropped."""
        if self.settings is None or self.runner is None:
            return None
        requests = common.num_reqs
        # an upper bound only for async speculative decoding's rows, which checks.py refuses: here the lengths
        query_start_loc, seq_lens = common.query_start_loc_cpu, common.seq_lens_cpu_upper_bound
        if query_start_loc is None or seq_lens is None:
            raise RuntimeError("alspec-vllm reads the step's host query_start_loc_cpu and seq_lens_cpu_upper_bound "
                               "from vLLM's CommonAttentionMetadata, which this vLLM does not give; use a vLLM "
                               "alspec-eval is tested with (the [vllm] extra)")
        query_start_loc, seq_lens = query_start_loc[:requests + 1], seq_lens[:requests]
        starts, tags, firsts, prompt_lens, seeds = self._tags(requests)
        if self.prompts.queries or self.prompts.observed or self.prompts.settled or self.prompts.digests:
            self.prompts.prune({args[TAG][1] for args in map(_extra_args, self.runner.requests.values())
                                if TAG in args})
        return Step(StepRows.build(query_start_loc, seq_lens, starts, tags, prompt_lens, seeds),
                    PromptRows.build(query_start_loc, seq_lens, firsts, starts, tags), query_start_loc, seq_lens)

    def _tags(self, requests: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Per batch row: where its speculation starts, its tag, where its observation window begins (NEVER where
        it has none), its prompt's length and its request seed (the driver's). The one adapter to the model runner's
        state that no builder input carries: the batch's request ids (``input_batch.req_ids``) and each request's
        sampling parameters and prompt length (``requests``); tests/vllm_engine/test_backend_registration.py fails
        where vLLM stops giving them."""
        batch = self.runner.input_batch.req_ids
        starts, tags, firsts, prompts = [NEVER] * requests, [-1] * requests, [NEVER] * requests, [0] * requests
        seeds = [0] * requests
        for row, req_id in enumerate(batch[:requests]):
            state = self.runner.requests.get(req_id)
            args = _extra_args(state)
            if TAG in args:
                starts[row], tags[row] = args[TAG][:2]
                prompts[row] = state.num_prompt_tokens
                if len(args[TAG]) > 3 and args[TAG][3] is not None:
                    firsts[row] = args[TAG][3]
                if len(args[TAG]) > 4:
                    seeds[row] = args[TAG][4]
                if len(args[TAG]) > 6 and args[TAG][5] is not None:  # a prompt-scoring draft's prompt digest
                    self.prompts.digests[tags[row]] = (args[TAG][5], bool(args[TAG][6]))
        return (torch.tensor(starts), torch.tensor(tags), torch.tensor(firsts), torch.tensor(prompts),
                torch.tensor(seeds))

    def layout(self, layer: Any) -> Any:
        """How ``layer``'s cache is read (its backend's adapter), the backend kept for provenance."""
        self.backend = layer.attn_backend.get_name()
        return layout_for(self.backend, getattr(layer, "isa", None) if self.backend == "CPU_ATTN" else None)

    def keep(self, name: str, kv_cache: torch.Tensor, layout: Any, block_table: torch.Tensor,
             step: Step) -> torch.Tensor | None:
        """Layer ``name``'s page summaries of a draft that keeps them (:mod:`.kept`), with the parts this step filled
        summarized again; None where they would take more than :data:`.kept.SHARE` of the keys (the layer reads
        keys). On a GPU every block's are made at the layer's first step after the driver configured the
        draft. On the CPU a block's are made at the first step that holds it, at every layer (found once a step:
        the blocks the step's requests hold that no step held before), so a configuration costs the blocks in use,
        not the whole cache. The parts filled and their blocks are found once per step (per block table) and copied
        to the device once."""
        approx = self.settings.approx
        if name not in self.kept and not kept.keeps(approx, kv_cache):
            self.kept[name] = None
        if name in self.kept and self.kept[name] is None:
            return None
        if kv_cache.device.type != "cpu":
            if name not in self.kept:
                self.kept[name] = kept.allocate(approx, kv_cache, layout)
                return self.kept[name]
        else:
            done = self.summarized.get(block_table.data_ptr())
            if done is None:
                done = self.summarized[block_table.data_ptr()] = torch.zeros(kv_cache.shape[0], dtype=torch.bool)
            missing = step.rows.plans.get(("unsummarized", block_table.data_ptr()))
            if missing is None:  # the step's first layer
                held = kept.held_blocks(block_table, step.seq_lens, kv_cache.shape[2])
                missing = step.rows.plans[("unsummarized", block_table.data_ptr())] = held[~done[held]]
                done[missing] = True
            if name not in self.kept:  # what the other layers hold already (nothing after a configuration)
                earlier = done.clone()
                earlier[missing] = False
                self.kept[name] = kept.allocate(approx, kv_cache, layout, earlier.nonzero().squeeze(1))
            if len(missing):
                kept.summarize_blocks(self.kept[name], approx, kv_cache, layout, missing)
        size = kept.part_size(approx, kv_cache.shape[2])
        plan = ("written", size, block_table.device.type, block_table.data_ptr())
        blocks = step.rows.plans.get(plan)
        if blocks is None:
            found = kept.written_parts(step.query_start_loc, step.seq_lens, size)
            blocks = step.rows.plans[plan] = kept.written_blocks(
                block_table, tuple(t.to(block_table.device) for t in found), kv_cache.shape[2] // size)
        kept.keep_written(self.kept[name], approx, kv_cache, layout, blocks)
        return self.kept[name]

    def take(self) -> Taken:
        """The decisions since the last take, packed (:class:`Taken`): one row per (request id, position), sorted,
        every layer's code and d/n (code 0 where the layer did not speculate); read from the device once. A position
        decided in more than one pass (recomputed after vLLM preempted its request, a step run again) keeps the
        decision of its first pass, whose output was read: a recompute re-reads positions only to rebuild their KV
        entries. How many were decided again is counted, and, in the same read, how many of the draft's selections
        reached outside [0, pos] and where (``Settings.breaches``)."""
        records, self.records = self.records, []
        layers = len(self.settings.thresholds) if self.settings else 0
        breaches = self.settings.breaches.pending() if self.settings else None
        held = self.observations_held()
        if not records:
            count, last = (0, -1) if breaches is None else breaches.tolist()
            return Taken(torch.empty(0, dtype=torch.long), torch.empty(0, dtype=torch.long),
                         torch.empty(0, layers, dtype=torch.int8), torch.empty(0, layers), 0, count, last,
                         observed=held)
        steps: list[list[tuple]] = []
        for record in records:  # one pass's layers share its rows' tensors
            if not steps or steps[-1][0][0] is not record[0]:
                steps.append([])
            steps[-1].append(record)
        names = tuple(sorted({name for record in records for name in record[5]}))  # what the draft measures
        grids: list[list[torch.Tensor]] = [[] for _ in range(2 + len(names))]
        for step in steps:
            grid = torch.zeros(len(step[0][0]), layers, dtype=torch.int8, device=step[0][3].device)
            values = [torch.full(grid.shape, math.nan, device=grid.device) for _ in range(1 + len(names))]
            for _, _, layer, code, ratio, measures in step:
                grid[:, layer], values[0][:, layer] = code, ratio
                for i, name in enumerate(names):
                    if name in measures:
                        values[1 + i][:, layer] = measures[name]
            for grown, made in zip(grids, (grid, *values), strict=True):
                grown.append(made)
        packed = torch.cat([torch.cat(grids[0]).float(), *(torch.cat(g) for g in grids[1:])], 1)
        found = torch.tensor([0, -1]) if breaches is None else breaches
        flat = torch.cat([packed.flatten(), found.to(packed)]).cpu()  # the one read-back
        packed, (count, last) = flat[:-2].view(packed.shape), flat[-2:].long().tolist()
        codes, ratios = packed[:, :layers].to(torch.int8), packed[:, layers:2 * layers]
        measured = packed[:, 2 * layers:].reshape(len(packed), len(names), layers)
        tags = torch.cat([step[0][0] for step in steps]).long()
        pos = torch.cat([step[0][1] for step in steps]).long()
        keys, inverse = (tags << 32 | pos).unique(return_inverse=True)  # sorted by request id, then position
        order = torch.arange(len(inverse))
        first = torch.full((len(keys),), len(inverse)).scatter_reduce(0, inverse, order, "amin")
        again = int((torch.bincount(inverse, minlength=len(keys)) > 1).sum())
        return Taken(keys >> 32, keys & 0xFFFFFFFF, codes[first], ratios[first], again, count, last,
                     measured[first], names, held)

    def observations_held(self) -> tuple[int, ...]:
        """The prompts (digests) whose observation this worker holds at every layer that observes (one whose
        threshold speculates), what the driver may count on at the next call; none for a draft that observes
        nothing."""
        settings = self.settings
        if settings is None or not settings.approx.prompt_keys:
            return ()
        observing = [i for i, lam in enumerate(settings.thresholds) if not math.isnan(lam) and lam != -math.inf]
        return tuple(self.prompts.held(observation_scope(settings), observing))


class Step(NamedTuple):
    """What the speculating metadata builder attaches to a step's attention metadata (``alspec``): the step's rows
    and, for the layout check, its host ``query_start_loc`` and sequence lengths."""

    rows: StepRows
    prompt_rows: PromptRows
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor


class Taken(NamedTuple):
    """What the driver takes from a worker: one row per (request id, position) decided since the last take, sorted
    by request id then position, every layer's code and d/n; and how many (request, position) pairs were decided in
    more than one pass. Packed tensors: no Python object per position."""

    tags: torch.Tensor  # (N,)
    pos: torch.Tensor  # (N,)
    codes: torch.Tensor  # (N, layers) int8
    ratios: torch.Tensor  # (N, layers) float32
    redecided: int
    out_of_bounds: int  # the draft's selections that reached outside [0, pos] (each cut to it: bounds.py)
    out_of_bounds_at: int  # the largest position among them (-1: none)
    measures: torch.Tensor | None = None  # (N, len(names), layers): each decision's measures (NaN: none)
    names: tuple[str, ...] = ()  # the measures' names (:func:`alspec_eval.measures.measure`), in that order
    observed: tuple[int, ...] = ()  # the prompts whose observation the worker holds (WorkerState.observations_held)

    def by_request(self) -> dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]]:
        """Per request id its positions, codes, d/n and measures by name: views of the packed rows, one slice a
        request."""
        ids, counts = self.tags.unique_consecutive(return_counts=True)
        split = [t.split(counts.tolist()) for t in (self.pos, self.codes, self.ratios)]
        parts = self.measures.split(counts.tolist()) if self.measures is not None else [None] * len(ids)
        measured = [{} if part is None else {name: part[:, i] for i, name in enumerate(self.names)} for part in parts]
        return dict(zip(ids.tolist(), zip(*split, measured)))


def _extra_args(state: Any) -> dict[str, Any]:
    """A request's ``SamplingParams.extra_args`` as the model runner holds them ({} where it has none)."""
    params = state and state.sampling_params
    return (params and params.extra_args) or {}


@functools.cache
def layer_index(name: str) -> int:
    """vLLM's index of an attention layer's decoder layer, parsed once per layer, not at every step."""
    from vllm.model_executor.models.utils import extract_layer_index

    return extract_layer_index(name)


def _reduce(stacked: torch.Tensor) -> torch.Tensor:
    """d^2 and n^2 summed over the tensor-parallel ranks (each holds some heads)."""
    from vllm.distributed import tensor_model_parallel_all_reduce

    return tensor_model_parallel_all_reduce(stacked)


class SpeculatingImpl:
    """Mixed in before the platform's impl class: its forward computes A, then the step's speculating tokens of this
    layer are verified and the accepted A~ committed into ``output``. ``alspec_state`` is its worker's
    :class:`WorkerState`, handed to every layer by the worker extension when the driver configures it (None before:
    the platform's backend alone)."""

    alspec_state: WorkerState | None = None

    def forward(self, layer: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                attn_metadata: Any, output: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        result = super().forward(layer, query, key, value, kv_cache, attn_metadata, output, *args, **kwargs)
        if attn_metadata is None:  # vLLM's profiling and warm-up passes: the verification's peak, for the profiler
            reserve(query)
            return result
        step, state = getattr(attn_metadata, "alspec", None), self.alspec_state
        if step is None or state is None or state.settings is None:  # built before the driver configured the engine
            return result
        settings = state.settings
        rows, prompt_rows = step.rows, step.prompt_rows
        layout = state.layout(layer)
        pages = (state.keep(layer.layer_name, kv_cache, layout, attn_metadata.block_table, step)
                 if settings.approx.kept_page() else None)
        if not len(rows.token) and not len(prompt_rows.token):
            return result
        block_size = kv_cache.shape[2]
        if settings.check_layout or layer.layer_name not in state.checked:
            check_newest(kv_cache, layout, attn_metadata.block_table, block_size, key,
                         *rows.newest(step.query_start_loc, step.seq_lens))
            state.checked.add(layer.layer_name)
        from vllm.distributed import get_tensor_model_parallel_world_size

        index = layer_index(layer.layer_name)
        out = output.view(output.shape[0], self.num_heads, -1)
        queries = query.view(query.shape[0], self.num_heads, -1)
        if len(prompt_rows.token):
            observe_layer(queries, kv_cache, layout, attn_metadata.block_table, block_size, prompt_rows, settings,
                          index, self.scale, state.prompts)
        exact = out[rows.token.to(out.device)].clone() if settings.dump else None
        observed = {row: state.prompts.observed.get((tag, index)) for row, tag in
                    zip(rows.request.tolist(), rows.tag.tolist())} if state.prompts.observed else None
        if settings.approx.keeps_scores:
            observed = {row: state.prompts.settled.setdefault((tag, index), {}) for row, tag in
                        zip(rows.request.tolist(), rows.tag.tolist())}
        if state.verifier is None:
            state.verifier = choose(settings.approx, layout, kv_cache)
        decided = verify_and_count(queries, out, kv_cache, layout, attn_metadata.block_table, block_size, rows,
                                   settings, index, self.scale,
                                   _reduce if get_tensor_model_parallel_world_size() > 1 else None, observed,
                                   state.verifier, pages)
        if decided is not None:
            state.records.append((rows.tag, rows.pos, index, *decided))
            if settings.dump:
                keys, values = contexts(kv_cache, layout, attn_metadata.block_table, block_size, rows)
                token = rows.token.to(out.device)
                state.dumps.append({"layer": index, "tag": rows.tag, "pos": rows.pos, "query": queries[token].cpu(),
                                    "exact": exact.cpu(), "committed": out[token].cpu(), "keys": keys.cpu(),
                                    "values": values.cpu(), "scale": self.scale, "code": decided[0],
                                    "ratio": decided[1], **{f"measure:{k}": v for k, v in decided[2].items()}})
        return result
