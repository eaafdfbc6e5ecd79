"""The speculator: per layer and token, A or A~, decided as docs/design.md, Semantics 1-5, say.

One hooked attention call runs the model's own attention (so exact positions are bit-identical to
the plain model) and then, for the positions of the active decode region, the steps of the paper's
Algorithm 1, each a method: locate the pass's positions, approximate, verify, commit, record. What each
(row, layer) decides comes from the region's plan (plan.py), never from a policy's name. A fused decode
kernel (kernel=torch|triton, the TT op) computes A, A~, d, n and the decision in one call; its numbers
are the ones recorded. A pass and its decisions, and the record assembled from them, are passes.py's; what an
approximation that scores the prompt sees of it is prompt_observer.py's.

Backends (alspec_eval.backends) bring their decode kernel or subclass :class:`Speculator`; this module and
:mod:`alspec_eval.hooks` are the same for all.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from . import semantics
from .approximations import draw_inputs, selection
from .bounds import refuse
from .config import SpeculationConfig
from .kernels import DecodeKernel, SpecDecodeOutput
from .measures import Selection, measure
from .passes import Decision, Pass, assemble, out_of_bounds
from .plan import EXACT_REJECTED, IDLE, Plan
from .prompt_observer import PromptObserver, PromptPrefix, PromptState
from .region import DecodeRegion, Trace

ATTR = "alspec_speculator"  # the attribute of each attention module that holds its speculator

@dataclass
class Session:
    """One call's speculation: its config (window and alignment), its decode region and plan (the region's, else the
    config's for every row, with the speculator's skipped layers off), the passes run so far, and its trace (filled
    on exit).

    ``first_speculated``: the region's smallest spec_start; passes that end before it are idle.
    """

    config: SpeculationConfig  # its ``approx`` chooses A~'s keys (alspec_eval.approximations)
    region: DecodeRegion
    plan: Plan
    passes: list[Pass | None] = field(default_factory=list)
    prompt: PromptState = field(default_factory=PromptState)  # what an approximation that scores it sees of the prompt
    trace: Trace = field(default_factory=lambda: Trace(torch.empty(0), torch.empty(0)))
    _on: dict = field(default_factory=dict, repr=False)

    def on(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """The region's pad, spec_start and row_end and the plan's active rows on ``device``, copied there once per
        call (a copy from the host per pass would synchronise a GPU's stream each decode step)."""
        if device not in self._on:
            region = self.region
            self._on[device] = tuple(t.to(device) for t in (region.pad, region.spec_start, region.row_end,
                                                             self.plan.active_rows))
        return self._on[device]

    def seeds(self, device: torch.device) -> torch.Tensor:
        """Each row's request seed (:meth:`.region.DecodeRegion.seeds`) on ``device``, made once per call (for a
        draft that draws at random only)."""
        if ("seeds", device) not in self._on:
            self._on[("seeds", device)] = self.region.seeds().to(device)
        return self._on[("seeds", device)]

    @property
    def first_speculated(self) -> int:
        return int(self.region.spec_start.min()) if len(self.region.spec_start) else 0


class Speculator:
    """What does not change between calls (the layers, the base attention, the decode kernel), and the sessions
    (:meth:`speculating`) of the calls running now, the innermost active."""

    def __init__(self, num_layers: int, skipped_layers: dict[int, str], base_attention: Callable,
                 decode_kernel: DecodeKernel | None = None, additive_mask: bool = False) -> None:
        self.num_layers = num_layers
        self.skipped_layers = skipped_layers
        self.base_attention = base_attention
        self.decode_kernel = decode_kernel
        self.additive_mask = additive_mask  # the base attention takes a float mask added to the logits (eager)
        self._sessions: list[Session] = []
        self.prompts = PromptObserver()  # the prompt as the sessions' approximations see it (prompt_observer.py)

    # ------------------------------------------------------------------ sessions and passes

    @contextmanager
    def speculating(self, region: DecodeRegion, config: SpeculationConfig,
                    prefix: PromptPrefix | None = None) -> Iterator[Trace]:
        """Speculate with ``config`` inside ``region`` for the forward passes run in this block; the trace fills on
        exit. Sessions nest (self-speculation drafts in a sink session inside its exact one): the innermost runs.
        ``prefix``: the prompt positions a shared prefill computed before this block (PromptObserver.capturing).
        A draft that selected keys outside [0, pos] in the block is refused on exit (:mod:`.bounds`)."""
        config.check_layers(self.num_layers)
        plan = region.plan or Plan.uniform(config.thresholds(self.num_layers), len(region.pad))
        session = Session(config, region, plan.without(sorted(self.skipped_layers)), prompt=PromptState(prefix))
        self._sessions.append(session)
        try:
            yield session.trace
        finally:
            self._sessions.pop()
            passes = [p for p in session.passes if p is not None]
            session.trace.codes, session.trace.ratios, session.trace.measures = assemble(session.plan, passes,
                                                                                         self.num_layers)
            session.trace.offset = passes[0].offset if passes else 0
            session.trace.pad, session.trace.budget = region.pad.cpu(), config.approx.max_keys(config.window)
            promise = config.approx.promise()
            session.trace.epsilon = None if promise is None else promise.epsilon
        refuse(config.approx, *out_of_bounds(passes))  # once the call is done: a draft that read outside

    @property
    def session(self) -> Session | None:
        """The innermost open session, or None outside :meth:`speculating`."""
        return self._sessions[-1] if self._sessions else None

    def new_forward(self, *_: object) -> None:
        """Forward pre-hook of the model: each forward pass appends its query positions to the trace."""
        if self._sessions:
            self._sessions[-1].passes.append(None)

    def layer_inputs(self, module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        """Forward pre-hook of each attention module: its input and rotary terms, for the prompt observer."""
        hidden = args[0] if args else kwargs.get("hidden_states")
        self.prompts.layer_input(self.session, self.speculates(module.layer_idx), module, hidden,
                                 kwargs.get("position_embeddings"))

    def speculates(self, layer: int) -> bool:
        """Whether ``layer`` decides anything in this call (the plan is on the host: no read-back)."""
        return self.session is not None and self.session.plan.layer_kinds[layer] != IDLE

    # ------------------------------------------------------------------ the attention call

    def attend(self, module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               attention_mask: torch.Tensor | None, scaling: float, **kwargs) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The committed attention output (B, q_len, Hq, D) of one layer, and the base attention's weights: the
        paper's steps, locate, approximate, verify, commit and record, either gathered (the speculated positions'
        A~ from the model's own attention over the keys their approximation selects) or fused (a decode step's
        A, A~, d, n and decision of every batch row from the draft's decode kernel)."""
        layer = module.layer_idx
        self.prompts.attention(self.session, self.speculates(layer), module, query, key, value, scaling)
        if not self.speculates(layer):
            return self.base_attention(module, query, key, value, attention_mask, scaling=scaling, **kwargs)
        step = self.locate(query, key).on(query.device)
        if step.trivial is None:  # an idle pass (a prompt's exact prefill): the model's own attention, nothing kept
            return self.base_attention(module, query, key, value, attention_mask, scaling=scaling, **kwargs)
        measured = self.session.plan.layer_kinds[layer] != EXACT_REJECTED  # else nothing to measure: A, rejected
        if step.dense:  # every batch row at once: A~ where the kernel accepted a speculated row (no gather per layer)
            fused = self.fused_decode(layer, step, query, key, value, scaling)
            if not measured:
                self.record(step, layer, None)
                return fused.exact[:, None], None
            self.record(step, layer, (fused.accept, fused.d, fused.n, {}))
            return self.commit(fused.exact, fused.spec, fused.accept & step.speculated)[:, None], None
        exact, weights = self.base_attention(module, query, key, value, attention_mask, scaling=scaling, **kwargs)
        if not measured:
            self.record(step, layer, None)
            return exact, weights
        rows, cols = step.rows, step.cols
        if not len(rows):
            self.record(step, layer, (torch.empty(0, dtype=torch.bool), torch.empty(0), torch.empty(0), {}))
            return exact, weights
        approx, measures = self.approximate(module, step, query, key, value, scaling, kwargs)
        current = exact[:, 0] if step.every_row else exact[rows, cols]
        accept, d, n = self.verify(approx, current, self.thresholds(rows, layer))
        self.record(step, layer, (accept, d, n, measures))
        committed = self.commit(current, approx, accept)
        if step.every_row:  # no scatter back: the committed rows are the output
            return committed[:, None], weights
        exact[rows, cols] = committed
        return exact, weights

    def locate(self, query: torch.Tensor, key: torch.Tensor) -> Pass:
        """Which positions of this pass speculate, and what the approximation computes once per pass for them (at
        the pass's first layer)."""
        session = self.session
        if session.passes[-1] is not None:
            return session.passes[-1]
        cfg = session.config
        q_len, k_len = query.shape[2], key.shape[2]
        if k_len <= session.first_speculated:  # no position of this pass is in the region: allocate nothing for it
            session.passes[-1] = Pass(q_len, k_len - q_len, None)
            return session.passes[-1]
        phys = torch.arange(k_len - q_len, k_len, device=query.device)
        pad, spec_start, row_end, active = session.on(query.device)
        pos = phys - pad[:, None]  # (B, Tq) position within the sequence
        in_region = (phys >= spec_start[:, None]) & (phys < row_end[:, None])
        in_region &= active[:, None]  # rows off at every layer: as the model
        trivial = in_region & semantics.is_trivial(pos, cfg.window)
        speculated = in_region & ~trivial
        if q_len == 1 and self.has_fused_decode():  # every row at once, by mask: no read-back of the positions
            session.passes[-1] = Pass(q_len, k_len - q_len, trivial, speculated=speculated[:, 0], dense=True)
            return session.passes[-1]
        rows, cols = speculated.nonzero(as_tuple=True)
        pos, pad = pos[rows, cols], pad[rows]
        keys = cfg.approx.per_pass(pos, pad, k_len, cfg.window, cfg.window_align,
                                   **draw_inputs(cfg.approx, seed=lambda: session.seeds(query.device)[rows]))
        session.passes[-1] = Pass(q_len, k_len - q_len, trivial, rows, cols, pos, pad, keys=keys,
                                  every_row=q_len == 1 and len(rows) == query.shape[0])
        return session.passes[-1]

    def thresholds(self, rows: torch.Tensor | None, layer: int, device: torch.device | str = "cpu") -> float | torch.Tensor:
        """The plan's threshold at ``layer`` of each batch row in ``rows`` (None: every row, on ``device``): one float
        where all rows share it."""
        lam = self.session.plan.layer(layer, rows.device if rows is not None else device)
        return lam if rows is None or not isinstance(lam, torch.Tensor) else lam[rows]

    def draft_kernel(self) -> DecodeKernel | None:
        """The decode kernel the session's draft takes (Approximation.fused_decode, offered this backend's kernel),
        which is the one that runs; None where the draft's A~ takes the gathered path."""
        return self.session.config.approx.fused_decode(self.decode_kernel)

    def has_fused_decode(self) -> bool:
        """Whether decode steps (one query per row) compute A, A~, d, n and the decision in one call."""
        return self.draft_kernel() is not None

    def fused_decode(self, layer: int, step: Pass, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     scaling: float) -> SpecDecodeOutput:
        """A decode step through the fused kernel: A, A~, d, n and the decision of every batch row at once."""
        cfg, kernel = self.session.config, self.draft_kernel()
        if step.kernel_inputs is None:  # once per pass: every layer has the same positions
            pad = self.session.on(query.device)[0]
            cur_pos = torch.full_like(pad, key.shape[2] - 1)
            step.kernel_inputs = {"cur_pos": cur_pos, "start": pad}
            prepare = getattr(kernel, "prepare", None)
            if prepare is not None:
                step.kernel_inputs["geometry"] = prepare(cur_pos, cfg.window, cfg.window_align, pad)
        lam = self.thresholds(None, layer, query.device)
        inputs = step.kernel_inputs
        return kernel(query[:, :, 0], key, value, inputs["cur_pos"], cfg.window, lam,
                                  window_align=cfg.window_align, scale=scaling, start=inputs["start"],
                                  **({"geometry": inputs["geometry"]} if "geometry" in inputs else {}))

    def approximate(self, module: torch.nn.Module, step: Pass, query: torch.Tensor, key: torch.Tensor,
                    value: torch.Tensor, scaling: float, kwargs: dict) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """A~ (R, Hq, D) of the speculated positions: the model's own attention function (with every term its family
        applies: scaling, soft-capping, sinks) called on each position's query and the at most 2S keys its
        approximation selects per KV head, gathered from the (B, Hkv, L, D) cache (no O(L^2) buffer), in the model
        dtype; and what else the draft's declarations ask each decision to measure (:func:`.measures.measure`), (R,)
        each. Positions go in chunks (:func:`gather_chunk`), so scoring where every position speculates holds one
        chunk's selected keys at a time."""
        cfg = self.session.config
        shared = self.prompts.prepare(self.session, module, key, value, self.session.on(key.device)[0])
        budget = cfg.approx.max_keys(cfg.window) or key.shape[2]  # None: up to the whole context
        chunk = gather_chunk(key, budget, query.shape[1], cfg.approx.position_bytes(key, query.shape[1]))
        parts = [self._approximate_rows(module, step, slice(lo, lo + chunk), query, key, value, scaling, kwargs, shared)
                 for lo in range(0, len(step.rows), chunk)]
        if len(parts) == 1:
            return parts[0]
        return torch.cat([a for a, _ in parts]), {name: torch.cat([m[name] for _, m in parts]) for name in parts[0][1]}

    def _approximate_rows(self, module: torch.nn.Module, step: Pass, part: slice, query: torch.Tensor,
                          key: torch.Tensor, value: torch.Tensor, scaling: float, kwargs: dict,
                          shared: object = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """A~ of the speculated positions ``part`` (a slice of ``step.rows``): the keys the session's approximation
        selects per KV head (``shared``: what it prepared for this layer), cut to [0, pos] (:mod:`.bounds`: one
        that reached outside is counted, and the call refused when it ends); and its measures
        (:func:`.measures.measure`)."""
        rows = step.rows[part]
        whole = step.every_row and len(rows) == query.shape[0]  # the batch in order: no gather of rows
        q = query if whole else query[rows, :, step.cols[part]][:, :, None, :]  # (r, Hq, 1, D): one query a position
        cfg = self.session.config
        passed = tuple(None if t is None else t[part] for t in step.keys)
        given = semantics.rows_in_order(len(rows), rows.device) if whole else rows  # known here: none read back
        index, valid, log_weight = selection(cfg.approx, cfg.approx.select(q[:, :, 0], key, given, step.pos[part],
                                                                           step.pad[part], cfg.window, passed, shared))
        index = step.readable(index, valid, part)  # never a key outside [0, pos]
        k, v = selected(key, rows, index, whole), selected(value, rows, index, whole)  # (r, Hkv, n, D), n <= max_keys
        mask = None if valid is None else valid[:, :, None, :]  # (r, 1, 1, n) holds for every head
        if log_weight is not None:  # a weighted draft's keys: its log-weights as an additive mask, in the model dtype
            mask = torch.ones_like(log_weight, dtype=torch.bool)[:, :, None, :] if mask is None else mask
            weights = log_weight.to(q.dtype)[:, :, None, :].expand(mask.shape)
            mask = weights.masked_fill(~mask, torch.finfo(q.dtype).min)
        if mask is not None and mask.shape[1] > 1:  # a KV head's mask for each of its query heads
            mask = mask.repeat_interleave(query.shape[1] // key.shape[1], 1)
        if mask is not None and mask.dtype == torch.bool and self.additive_mask:
            mask = torch.zeros(mask.shape, dtype=q.dtype, device=q.device).masked_fill(~mask, torch.finfo(q.dtype).min)
        out, _ = self.base_attention(module, q, k, v, mask, scaling=scaling, **kwargs)
        taken = Selection(q[:, :, 0], key, given, step.low[part], step.high[part], index, valid, log_weight)
        return out[:, 0], measure(cfg.approx, cfg.window, taken, scaling, kwargs.get("softcap"))  # out: (r, 1, Hq, D)

    def verify(self, approx: torch.Tensor, exact: torch.Tensor,
               lam: float | torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(accept, d, n) of the speculated positions, in float32 (docs/design.md, Semantics 4)."""
        d, n = semantics.distances(approx, exact)
        return semantics.accept(d, n, lam), d, n

    @staticmethod
    def commit(exact: torch.Tensor, approx: torch.Tensor, accept: torch.Tensor) -> torch.Tensor:
        """The output the speculated positions continue with (docs/design.md, Semantics 5): A~ where accepted, A
        elsewhere, (R, Hq, D) in the model dtype."""
        return semantics.commit(exact, approx, accept)

    @staticmethod
    def record(step: Pass, layer: int, decisions: Decision) -> None:
        """Keep ``layer``'s decisions in its pass, where the layer computed them (no read-back per layer): the session
        assembles its record from them when it ends (passes.assemble)."""
        step.decisions[layer] = decisions


def alspec_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
                     **kwargs) -> tuple[torch.Tensor, torch.Tensor | None]:
    """AttentionInterface entry (transformers calls it by the registered name): the module's speculator."""
    scaling = query.shape[-1] ** -0.5 if scaling is None else scaling
    return getattr(module, ATTR).attend(module, query, key, value, attention_mask, scaling, dropout=dropout, **kwargs)


def selected(cache: torch.Tensor, rows: torch.Tensor, index: torch.Tensor, whole: bool) -> torch.Tensor:
    """The keys (or values) ``index`` selects, (r, Hkv, 2S, D), from a layer's (B, Hkv, L, D) cache for batch rows
    ``rows``; ``index`` (r, Hkv or 1, 2S) one row for every KV head where the keys are fixed by position (no copy per
    head). ``whole``: ``rows`` is the whole batch in order, so one gather along the keys takes them."""
    if whole:
        return cache.gather(2, index[..., None].expand(-1, cache.shape[1], -1, cache.shape[3]))
    if index.shape[1] == 1:
        return cache[rows[:, None], :, index[:, 0]].transpose(1, 2)
    heads = torch.arange(cache.shape[1], device=cache.device)[None, :, None]
    return cache[rows[:, None, None], heads, index]


GATHER_BUDGET = 128 * 2**20  # bytes of gathered window keys and values per chunk, unless one layer's cache is larger


def gather_chunk(key: torch.Tensor, window_keys: int, query_heads: int, selection_bytes: int = 0) -> int:
    """Speculated positions per chunk of :meth:`Speculator.approximate`: their gathered keys and values (2S each,
    counted per query head, as the model's attention may repeat them for grouped-query heads) take at most
    max(GATHER_BUDGET, the layer's own keys and values), so the peak stays near the plain model's wherever every
    position speculates (rolling and long-continuation scoring), in few chunks per layer. ``selection_bytes``: what
    choosing one position's keys holds besides (approximations.py)."""
    dim = key.shape[3]
    per_position = 2 * max(query_heads, key.shape[1]) * window_keys * dim * key.element_size() + selection_bytes
    return max(1, max(GATHER_BUDGET, 2 * key.numel() * key.element_size()) // per_position)
