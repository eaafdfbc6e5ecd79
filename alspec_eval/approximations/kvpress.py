"""kvpress's presses as drafts of A (``approx=kvpress:SnapKVPress``, the press's own arguments in ``approx_args``):
each ``ScorerPress`` ranks a layer's keys per KV head, A~ attends to its top 2S, and ALSpec verifies A~ as it
verifies the sink. Install with ``pip install 'alspec-eval[kvpress]'`` (docs/design.md, "kvpress's presses").

Two ways of scoring, as the presses are written:
- **key-only** presses (Knorm, KeyDiff, CUR, LagKV, Random, StreamingLLM, and CriticalKV around one of them) score
  the keys a position can see, at every position: a score that reads later keys (KeyDiff's mean, LagKV's next
  chunk) would otherwise leak the future into a scoring pass;
- **prompt-time** presses (SnapKV, PyramidKV, ExpectedAttention, Cap, LeverageScore, NonCausalAttn, Compactor) score
  the prompt once, at prefill, from the layer's input; each decode step keeps the newest ``recent`` tokens and the
  top 2S - recent prompt keys (SnapKV's rule, :class:`.prompt_scored.PromptScored`).
Each row is scored on its own unpadded keys (kvpress assumes no left padding), but for a press whose score of a key
reads that key alone (Knorm: every key scored at once, each position ranking its own); ties go to the earlier key, and a
key-only press's scores that lie within float32's rounding of the next better one are ties (:func:`ranked`).
Importing kvpress patches every transformers attention function; :func:`import_kvpress` undoes that.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import importlib
import math
import sys
import typing
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from .. import semantics
from ..errors import ConfigError
from .base import Approximation, LayerInputs, Ranges, Selected, scores_bytes
from .prompt_scored import PromptRanking, PromptScored

INSTALL = "pip install 'alspec-eval[kvpress]' && pip install --no-deps kvpress==0.5.5"
REFUSED = {
    "TOVAPress": "it ranks keys by the current query's exact attention, every step: an oracle; use approx=topk",
    "ObservedAttentionPress": "it needs the exact attention weights of every query (eager attention): an oracle; "
                              "use approx=topk",
    "KVzapPress": "it downloads its scoring model from the Hugging Face hub",
    "QFilterPress": "it downloads its query filters from the Hugging Face hub",
    "ExpectedAttentionStatsPress": "it downloads or computes query statistics from a hub dataset; use "
                                   "kvpress:ExpectedAttentionPress",
}
MARKERS = "osv^<>pP*XdhH8"
COLOURS = ("tab:blue", "tab:orange", "tab:green", "tab:red", "tab:purple", "tab:brown", "tab:pink")
SEED = 0  # presses that draw random numbers (Random, LeverageScore's sketch) draw the same ones at every call
# key-only presses: a score within this fraction of the next better one ties with it (:func:`ranked`). Rounding
# alone separates such scores: Knorm's norms of one token's keys at layer 0 (its key before RoPE is the token's
# own; the rotation keeps the norm) differ by an ulp or two with how an engine rotates, 2^-16 is 128 ulps
TIE = 2.0 ** -16
COSINE_EPS, NORMALIZE_EPS = 1e-8, 1e-12  # the defaults of F.cosine_similarity and F.normalize, as KeyDiff calls them


def import_kvpress() -> Any:
    """The ``kvpress`` package, imported with transformers' attention functions as they were before: its
    ``__init__`` wraps every one of them (``patch_attention_functions``), once: imported, it is taken as it is (a
    press made at every layer and step, as Knorm's summaries are, pays no restoring)."""
    from ..compat import attention_functions_kept

    if "kvpress" in sys.modules:
        return sys.modules["kvpress"]
    try:
        with attention_functions_kept():
            return importlib.import_module("kvpress")
    except ImportError as err:
        raise ConfigError(f"approx=kvpress:... needs kvpress ({err}); install it with {INSTALL}") from None


@functools.cache
def press_draft(press: str) -> type[Approximation]:
    """The approximation class of ``approx=kvpress:<press>``: its fields are the press's own arguments."""
    if press in REFUSED:
        raise ConfigError(f"approx=kvpress:{press} is not supported: {REFUSED[press]}")
    kvpress = import_kvpress()
    if press not in PRESSES:
        found = getattr(kvpress, press, None)
        what = ("is not a class of kvpress" if not isinstance(found, type) else
                "is not a ScorerPress" if not issubclass(found, kvpress.ScorerPress) else
                "is a ScorerPress that alspec-eval does not run yet")
        raise ConfigError(f"approx=kvpress:{press} {what}; use one of "
                          f"{', '.join(f'kvpress:{name}' for name in PRESSES)}")
    base = PRESSES[press]
    index = list(PRESSES).index(press)
    namespace = {"press_name": press, "family_name": f"kvpress:{press}", "__module__": __name__,
                 "names_defaults": False, "marker": MARKERS[index % len(MARKERS)],
                 "colour": COLOURS[index % len(COLOURS)], "description": f"kvpress's {press} ({base.kind})"}
    cls = dataclasses.make_dataclass(_class_name(press), base.fields_of(getattr(kvpress, press)), bases=(base,),
                                     frozen=True, namespace=namespace)
    cls.__qualname__ = cls.__name__
    return cls


def press_view(layer: LayerInputs) -> torch.nn.Module | None:
    """The attention module as presses read it, the model untouched: a shallow copy (its class, so kvpress's
    family checks hold, and its weights) that has the model's ``rotary_emb`` (ExpectedAttention and Cap read it from
    the module; transformers 5 keeps it on the model) and a config with ``head_dim`` (CriticalKV reads it; Qwen2's
    config has none)."""
    if layer.module is None:  # vLLM's layer: key-only presses read the keys and values alone
        return None
    view = copy.copy(layer.module)
    config = copy.copy(view.config)
    object.__setattr__(config, "head_dim", view.head_dim)
    object.__setattr__(view, "config", config)
    if layer.rotary_emb is not None:
        object.__setattr__(view, "rotary_emb", layer.rotary_emb)
    return view


def check_queries(module: torch.nn.Module) -> None:
    """A prompt-time press recomputes the queries from the layer's input as kvpress's ``get_prerope_query_states``
    does: q_proj (Phi-3's qkv_proj), then q_norm for Qwen3 and Gemma 3 only. A family with a query norm of its own
    (Qwen3-MoE, OLMo 2, ...) would be scored with queries it never computes: refused."""
    from kvpress.utils import Gemma3Attention, Phi3Attention, Qwen3Attention

    family = type(module).__name__
    if not (hasattr(module, "q_proj") or isinstance(module, Phi3Attention)):
        raise ConfigError(f"{family} has no q_proj: kvpress's prompt-time presses cannot compute its queries; use a "
                          "key-only press (kvpress:KnormPress, ...) or approx=snapkv")
    if hasattr(module, "q_norm") and not isinstance(module, (Qwen3Attention, Gemma3Attention)):
        raise ConfigError(f"{family} normalizes its queries (q_norm), which kvpress applies for Qwen3 and Gemma 3 "
                          "only: its prompt-time presses would score with other queries than the model's; use a "
                          "key-only press (kvpress:KnormPress, ...) or approx=snapkv")


def score(press: Any, module: torch.nn.Module, hidden: torch.Tensor | None, keys: torch.Tensor,
          values: torch.Tensor, kwargs: dict, seeded: bool = True) -> torch.Tensor:
    """``press.score`` with the global random state forked and seeded: a press that draws random numbers draws the
    same ones at every call, and the caller's random state is as it was. ``seeded`` False: a press whose score is
    its keys' alone (it draws nothing), called as it is (forking the state costs more than Knorm's score of a few
    keys, which vLLM takes at every layer and step)."""
    if not seeded:
        return press.score(module, hidden, keys, values, None, kwargs)
    devices = [keys.device] if keys.device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        # the generators of the keys' device only: torch.manual_seed also queues every other backend's seed with a
        # formatted stack trace, which costs more than a key-only press's score inside vLLM's deep call stack
        torch.default_generator.manual_seed(SEED)
        if devices:
            torch.cuda.manual_seed(SEED)
        return press.score(module, hidden, keys, values, None, kwargs)


def ranked(scores: torch.Tensor, keep: int, outside: torch.Tensor | None = None) -> torch.Tensor:
    """The indices of the ``keep`` best of (..., L) scores per row, best first; NaN ranks last, and after it the keys
    ``outside`` marks (a mask broadcast to the scores: another row's keys, which rank after every score of the row's
    own, -inf and NaN too, so that rows of several lengths rank in one call as each would alone). Scores are ranked in
    groups: a score within :data:`TIE` (relative) of the next better one is in its group, and a group's keys go
    earlier key first. So keys whose scores are equal but for rounding (one token's key norms at layer 0) rank alike
    in every engine, however each rounds its keys: on the HF engine and inside vLLM a key-only press keeps the same
    keys (tests/vllm_engine/test_vllm_drafts.py).

    The best 2 ``keep`` scores are ranked first (a partial selection, not a sort of all L): where every row's group
    at place ``keep`` ends before the last of them, the groups that reach the first ``keep`` places are whole among
    them, and that is the answer; else (a run of near-ties that long: one token's keys at layer 0) every score is
    sorted. Deciding which reads one flag back, so on a GPU, where a read-back waits for the stream, every score is
    sorted: the same answer, with nothing read back."""
    values = scores.float().nan_to_num(nan=-math.inf)
    if outside is not None:
        outside = outside.expand_as(values)
        values = values.masked_fill(outside, -math.inf)
    length = values.shape[-1]
    if 2 * keep < length and values.device.type == "cpu":
        best = values.topk(2 * keep, dim=-1)  # sorted, best first
        group = _groups(best.values)
        if bool((group[..., -1] != group[..., keep - 1]).all()):
            return _first(_after(group, outside, best.indices, length), best.indices, keep, length)
    order = values.sort(dim=-1, descending=True, stable=True)
    return _first(_after(_groups(order.values), outside, order.indices, length), order.indices, keep, length)


def ranked_rows(scores: torch.Tensor, keep: int, pos: torch.Tensor, pad: torch.Tensor) -> torch.Tensor:
    """:func:`ranked` of rows of (r, Hkv, L) scores, each among its own keys [pad, pad + pos]: on the CPU, where no row
    is left-padded (vLLM's contexts), in one call of the C kernel that ranks kept scores (``native.rank_kept``, key
    for key kvpress's ranking: tests/test_kept_pages.py), else in torch."""
    length = scores.shape[-1]
    if scores.device.type == "cpu" and not any(semantics.host_values(pad)):
        from ..vllm.native import rank_kept

        rows = torch.arange(len(scores))
        chosen = rank_kept(scores.float().transpose(1, 2).contiguous()[..., None], rows.to(torch.int32)[:, None],
                           length, rows, torch.tensor(semantics.host_values(pos)), keep, length, TIE)
        if chosen is not None:
            return chosen
    return ranked(scores, keep, _outside(length, pos, pad))


def _after(group: torch.Tensor, outside: torch.Tensor | None, index: torch.Tensor, length: int) -> torch.Tensor:
    """The groups of keys at ``index``, those ``outside`` moved past every group (there are at most L)."""
    return group if outside is None else group + outside.gather(-1, index) * (length + 1)


def _groups(ordered: torch.Tensor) -> torch.Tensor:
    """The group of each of (..., n) scores sorted best first: 0 for the first, one more after each gap wider than
    :data:`TIE` (relative) between neighbours (equal scores, -inf among them, are one group)."""
    better, worse = ordered[..., :-1], ordered[..., 1:]
    near = (better - worse <= TIE * torch.maximum(better.abs(), worse.abs())) & worse.isfinite() & better.isfinite()
    group = (~(near | (better == worse))).cumsum(-1)
    return torch.cat([torch.zeros_like(group[..., :1]), group], -1)


def _first(group: torch.Tensor, index: torch.Tensor, keep: int, length: int) -> torch.Tensor:
    """The first ``keep`` keys by (group, key): unique ranks, so their smallest ``keep`` are one answer."""
    rank = group * length + index
    return rank.topk(min(keep, rank.shape[-1]), dim=-1, largest=False).values % length


def _outside(length: int, pos: torch.Tensor, pad: torch.Tensor) -> torch.Tensor:
    """Which of ``length`` physical keys lie outside each row's own [0, pos] (r, 1, L), for :func:`ranked`."""
    logical = torch.arange(length, device=pos.device) - pad[:, None]
    return ((logical < 0) | (logical > pos[:, None]))[:, None, :]


def _class_name(press: str) -> str:
    return f"Draft_{press}"


def __getattr__(name: str) -> type[Approximation]:
    """``Draft_<Press>`` resolves to :func:`press_draft` (so drafts pickle by reference, as classes do)."""
    if name.startswith("Draft_"):
        return press_draft(name[len("Draft_"):])
    raise AttributeError(name)


@dataclass(frozen=True)
class _PressDraft(Approximation):
    """What every press's draft shares: making the press with a compression ratio that keeps 2S of L keys."""

    press_name: ClassVar[str] = ""
    kind: ClassVar[str] = ""  # how its description names the kind of press
    reads_layer = True

    @classmethod
    def fields_of(cls, press: type) -> list[tuple]:
        """The draft's fields: the press's own arguments with their defaults, but the compression ratio (the
        draft sets it from the budget)."""
        hints = typing.get_type_hints(press)
        return [(f.name, hints[f.name], field(default=f.default)) for f in dataclasses.fields(press)
                if f.init and f.name != "compression_ratio" and not f.name.startswith("_")]

    def make_press(self, keep: int, length: int) -> Any:
        """The press, its compression ratio keeping ``keep`` of ``length`` keys (kvpress keeps int(length * (1 -
        ratio)): half a key more makes that exact in floating point)."""
        ratio = max(0.0, 1.0 - (keep + 0.5) / length) if length else 0.0
        return self.build(import_kvpress(), ratio)

    def build(self, kvpress: Any, ratio: float) -> Any:
        """The press at ``ratio``, from the draft's own arguments."""
        return getattr(kvpress, self.press_name)(compression_ratio=ratio, **self.args())


@dataclass(frozen=True)
class KeyScoredPress(_PressDraft):
    """A key-only press: at each speculated position, the press scores that row's keys up to it, A~ takes the top
    2S per KV head."""

    kind = "key-only"

    def keys_read(self, context: int, window: int) -> float:
        """Every key is scored at every step (a miss)."""
        return context

    def prepare(self, key: torch.Tensor, pad: torch.Tensor, window: int, observed: list[dict] | None = None,
                layer: LayerInputs | None = None) -> tuple[LayerInputs, list[dict] | None]:
        """The layer as the press reads it, and each row's store where the draft ``keeps_scores`` (else None)."""
        return dataclasses.replace(layer, module=press_view(layer)), observed

    def select(self, query: torch.Tensor, key: torch.Tensor, rows: torch.Tensor, pos: torch.Tensor,
               pad: torch.Tensor, window: int, passed: tuple, prepared: tuple[LayerInputs, list[dict] | None]
               ) -> Selected:
        """Each row's own unpadded keys up to its position scored (:meth:`row_scores`), then every row ranked in
        one call, each among its own keys (the rest ``outside``: a press may score its own keys NaN or -inf)."""
        layer, kept = prepared
        length = key.shape[2]
        scored = torch.zeros(len(rows), key.shape[1], length, device=key.device)
        for i, (row, p, a) in enumerate(zip(*map(semantics.host_values, (rows, pos, pad)))):
            keys = key[row:row + 1, :, a:a + p + 1]
            values = None if layer.value is None else layer.value[row:row + 1, :, a:a + p + 1]
            scored[i, :, a:a + p + 1] = self.row_scores(keys, values, window, layer.module,
                                                        None if kept is None else kept[row])
        return ranked_rows(scored, 2 * window, pos, pad), None

    def row_scores(self, keys: torch.Tensor, values: torch.Tensor, window: int, module: torch.nn.Module | None,
                   kept: dict | None) -> torch.Tensor:
        """The press's scores of one row's keys and values (1, Hkv, L, D): (Hkv, L)."""
        return score(self.make_press(2 * window, keys.shape[2]), module, None, keys, values, {})[0]

    def position_bytes(self, key: torch.Tensor, query_heads: int) -> int:
        return scores_bytes(key)


@dataclass(frozen=True)
class KeyAlonePress(KeyScoredPress):
    """A key-only press whose score of a key reads that key alone (Knorm: its norm): every key is scored once per
    layer and pass (:meth:`prepare`), and every position ranks its own keys' scores. A paged cache keeps each key's
    score beside it as the key is written (``kept_page`` 1), so inside vLLM a step reads scores, not keys."""

    reads_layer = False  # the keys alone

    def scores(self, keys: torch.Tensor) -> torch.Tensor:
        """The press's score of each key of (B, Hkv, L, D): (B, Hkv, L), in float32 or wider whatever the keys' dtype
        (kvpress's own rule); no other key enters a key's score."""
        return score(self.make_press(keys.shape[2], keys.shape[2]), None, None, keys, None, {}, seeded=False)

    def prepare(self, key: torch.Tensor, pad: torch.Tensor, window: int, observed: Any = None,
                layer: LayerInputs | None = None) -> torch.Tensor:
        return self.scores(key)

    def kept_page(self) -> int:
        return 1

    def summarize(self, keys: torch.Tensor, values: None = None) -> torch.Tensor:
        """A page of one key, (..., 1, Hkv, D): its score, (..., Hkv, 1)."""
        return self.scores(keys.movedim(-3, -2).flatten(0, -4)).view(*keys.shape[:-3], keys.shape[-2], 1)

    def prepare_pages(self, pages: torch.Tensor) -> torch.Tensor:
        return pages[..., 0]

    def select_kept(self, query: torch.Tensor, kept: torch.Tensor, block_table: torch.Tensor, block_size: int,
                    request: torch.Tensor, pos: torch.Tensor, window: int, length: int) -> Selected | None:
        from ..vllm.native import rank_kept  # the CPU kernel: every row's kept scores read and ranked in one call

        chosen = rank_kept(kept, block_table, block_size, request, pos, 2 * window, length, TIE)
        return None if chosen is None else (chosen, None)

    def select(self, query: torch.Tensor, key: torch.Tensor, rows: torch.Tensor, pos: torch.Tensor,
               pad: torch.Tensor, window: int, passed: tuple, prepared: torch.Tensor) -> Selected:
        """Every position at once (:func:`ranked` reads one flag back): a row's keys outside its own [0, p] rank
        last, which ranks the rest as the row's own keys up to p alone would rank."""
        return ranked(prepared.index_select(0, rows), 2 * window, _outside(prepared.shape[-1], pos, pad)), None


@dataclass(frozen=True)
class MeanKeyPress(KeyScoredPress):
    """KeyDiff: a key's score is minus its cosine with the row's mean unit key, so a new key moves every score and a
    step reads every key, and no value (vLLM reads none for it). Scored with kvpress's operations in their order, bit
    for bit its ``F.normalize`` then ``F.cosine_similarity`` (tests/test_kvpress.py), their common passes taken once:
    each key's norm, and its unit key, which both divide by the same norm unless the key is shorter than the cosine's
    eps."""

    reads_layer = False

    def prepare(self, key: torch.Tensor, pad: torch.Tensor, window: int, observed: list[dict] | None = None,
                layer: LayerInputs | None = None) -> tuple[LayerInputs, list[dict] | None]:
        return LayerInputs(None, None), observed

    def row_scores(self, keys: torch.Tensor, values: torch.Tensor, window: int, module: torch.nn.Module | None,
                   kept: dict | None) -> torch.Tensor:
        norm = torch.linalg.vector_norm(keys, 2, -1, keepdim=True)
        unit = keys / norm.clamp_min(COSINE_EPS)  # cosine_similarity's x / max(|x|, eps)
        short = norm < COSINE_EPS
        normalized = unit  # F.normalize's x / max(|x|, its own eps), where no key is shorter than the cosine's eps
        if keys.device.type != "cpu" or bool(short.any()):  # the check reads a flag back: on the CPU only
            normalized = torch.where(short, keys / norm.clamp_min(NORMALIZE_EPS), unit)
        anchor = normalized.mean(2, keepdim=True)
        along = anchor / torch.linalg.vector_norm(anchor, 2, -1, keepdim=True).clamp_min(COSINE_EPS)
        return -(unit * along).sum(-1)[0]


@dataclass(frozen=True)
class ChunkPairPress(KeyScoredPress):
    """A key-only press whose score of a key reads the key's chunk of ``lag_size`` keys after the ``n_sink`` sinks and
    the next chunk (LagKV): once that chunk is whole, the score is final, the sinks' and the two newest chunks' are
    1, and a context shorter than two chunks is scored by position. Where the engine keeps a row's settled scores
    across steps (vLLM: ``keeps_scores``), each chunk is scored once per request and layer, not at every step."""

    keeps_scores = True

    def settled(self, length: int) -> int:
        """How many first keys of a context of ``length`` keys have final scores (0 while it is scored by
        position)."""
        if length < self.n_sink + 2 * self.lag_size:
            return 0
        return self.n_sink + ((length - self.n_sink) // self.lag_size - 1) * self.lag_size

    def needs_keys(self, kept: dict | None, length: int) -> bool:
        """Until its store holds every score that settled at ``length`` keys (and while it is scored by position)."""
        settled = self.settled(length)
        return kept is None or not settled or kept.get("scores") is None or kept["scores"].shape[-1] < settled

    def row_scores(self, keys: torch.Tensor, values: torch.Tensor, window: int, module: torch.nn.Module | None,
                   kept: dict | None) -> torch.Tensor:
        """As the press's call on all L keys gives them. ``kept``: where this row's settled scores are kept
        ("scores", (Hkv, n)), extended here by a call on the sinks and the chunks from the first unsettled one on."""
        length = keys.shape[2]
        settled = self.settled(length)
        if kept is None or not settled:
            return super().row_scores(keys, values, window, module, None)
        have = kept.get("scores")
        done = 0 if have is None else have.shape[-1]
        if done < settled:
            sinks, first = slice(0, self.n_sink), max(done - self.n_sink, 0) + self.n_sink
            part = [torch.cat([t[:, :, sinks], t[:, :, first:settled + self.lag_size]], 2) for t in (keys, values)]
            new = score(self.make_press(2 * window, part[0].shape[2]), None, None, *part, {})[0]
            have = kept["scores"] = (new[:, :settled] if have is None
                                     else torch.cat([have, new[:, self.n_sink:self.n_sink + settled - done]], -1))
        return torch.cat([have[:, :settled], have.new_ones(have.shape[0], length - settled)], -1)


@dataclass(frozen=True)
class LeveragePress(KeyScoredPress):
    """kvpress's CURPress: a key's score is its squared key and value norms, each normalized over its local window of
    ``local_window_size`` keys, combined (``leverage_type``), normalized over the row, the first ``num_sinks`` 1. A
    key's norms read that key alone, so a paged cache keeps them beside it (``kept_page`` 1: every key's two norms,
    written with it) and a step scores each row from its norms, reading no key or value; the windows and the row's
    total are taken at every position from its own keys, in the press's operations and order (bit for bit its call
    on the row's keys). With ``use_random_leverage`` the keys are projected first (a product whose rounding may
    depend on how many keys are multiplied): then nothing is kept and the press is called on the keys."""

    def check(self, window: int) -> None:
        super().check(window)
        kinds = typing.get_args(self.__dataclass_fields__["leverage_type"].type)
        if self.leverage_type not in kinds:
            raise ConfigError(f"approx=kvpress:CURPress: leverage_type:{self.leverage_type} is not one of the press's; "
                              f"use one of {', '.join(f'leverage_type:{k}' for k in kinds)}")

    def kept_page(self) -> int | None:
        return None if self.use_random_leverage else 1

    def summarize(self, keys: torch.Tensor, values: torch.Tensor | None = None) -> torch.Tensor:
        """A page of one key and its value, (..., 1, Hkv, D) each: their squared norms, (..., Hkv, 2)."""
        return self.norms(keys, values)[..., 0, :, :]

    def norms(self, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        """Each key's and value's squared norm, as the press computes them (each a sum over a contiguous last
        dimension): (..., 2)."""
        return (torch.stack([keys, values], -2) ** 2).sum(dim=-1)

    def prepare(self, key: torch.Tensor, pad: torch.Tensor, window: int, observed: list[dict] | None = None,
                layer: LayerInputs | None = None) -> Any:
        if self.kept_page() is None:
            return super().prepare(key, pad, window, observed, layer)
        return self.norms(key, layer.value)  # (B, Hkv, L, 2): what prepare_pages makes of the kept norms

    def prepare_pages(self, pages: torch.Tensor) -> torch.Tensor:
        return pages

    def leverage(self, norms: torch.Tensor, lengths: list[int]) -> torch.Tensor:
        """The press's scores of rows whose keys' and values' squared norms are ``norms`` (b, Hkv, n, 2), the first
        ``lengths[i]`` of row i its own: (b, Hkv, n), a row's own bit for bit the press's call on its keys alone
        (its windows summed over its own keys and the zeros the press pads them with, its total over its own)."""
        both = norms.transpose(-1, -2).contiguous()  # (b, Hkv, 2, n): the keys' norms, then the values'
        length = both.shape[-1]
        if self.use_local_approximation:
            if min(lengths) < length:
                beyond = torch.arange(length, device=norms.device) >= torch.tensor(lengths, device=norms.device)[
                    :, None, None, None]
                both = both.masked_fill(beyond, 0)
            both = self._windowed(both)
        k2, v2 = both.unbind(2)
        scores = {"key": lambda: k2, "value": lambda: v2, "kv_avg": lambda: (k2 + v2) / 2,
                  "kv_product": lambda: k2 * v2}[self.leverage_type]()
        total = torch.stack([scores[i, :, :n].sum(dim=-1, keepdim=True) for i, n in enumerate(lengths)])
        scores = scores / total
        scores[:, :, :self.num_sinks] = 1.0
        return scores

    def _windowed(self, norms: torch.Tensor) -> torch.Tensor:
        """(..., n) squared norms over their local windows' sums, as the press pads, sums and divides them."""
        length, w = norms.shape[-1], self.local_window_size
        norms = torch.nn.functional.pad(norms, (0, (w - length % w) % w)).unflatten(-1, (-1, w))
        return (norms / norms.sum(dim=-1, keepdim=True)).flatten(-2)[..., :length]

    def select(self, query: torch.Tensor, key: torch.Tensor, rows: torch.Tensor, pos: torch.Tensor,
               pad: torch.Tensor, window: int, passed: tuple, prepared: Any) -> Selected:
        """Each row's scores from its own norms up to its position (:meth:`leverage`), then every row ranked in one
        call, each among its own keys. Rows without left padding (vLLM's contexts) are scored together."""
        if self.kept_page() is None:
            return super().select(query, key, rows, pos, pad, window, passed, prepared)
        if not any(semantics.host_values(pad)):
            return self._ranked(semantics.rows_of(prepared, rows), pos, window), None
        length = key.shape[2]
        scored = torch.zeros(len(rows), key.shape[1], length, device=key.device)
        for i, (row, p, a) in enumerate(zip(*map(semantics.host_values, (rows, pos, pad)))):
            scored[i, :, a:a + p + 1] = self.leverage(prepared[row:row + 1, :, a:a + p + 1], [p + 1])[0]
        return ranked_rows(scored, 2 * window, pos, pad), None

    def select_kept(self, query: torch.Tensor, kept: torch.Tensor, block_table: torch.Tensor, block_size: int,
                    request: torch.Tensor, pos: torch.Tensor, window: int, length: int) -> Selected | None:
        """Every row's norms read from the kept ones at once, scored together and ranked (on the CPU by the C
        kernel: :func:`ranked_rows`)."""
        from ..vllm.kept import page_summaries

        return self._ranked(page_summaries(kept, self, block_table, block_size, request, length), pos, window), None

    def _ranked(self, norms: torch.Tensor, pos: torch.Tensor, window: int) -> torch.Tensor:
        """The 2S best keys of rows whose keys from 0 have ``norms`` (r, Hkv, L, 2), each scored to its position."""
        scores = self.leverage(norms, [p + 1 for p in semantics.host_values(pos)])
        return ranked_rows(scores, 2 * window, pos, torch.zeros_like(pos))


@dataclass(frozen=True)
class PositionRankedPress(KeyScoredPress):
    """A key-only press that ranks by position or by chance: it reads no key to rank (only the keys' shape), so a
    step costs 2S and vLLM reads no context for it. Its score draws from one fixed seed (:func:`score`), so every
    layer ranks alike."""

    reads_keys = False
    same_at_every_layer = True

    def keys_read(self, context: int, window: int) -> float:
        return min(2 * window, context)


@dataclass(frozen=True)
class SinkAndRecentPress(PositionRankedPress):
    """kvpress's StreamingLLMPress: its score keeps the first ``n_sink`` keys and the newest 2S - n_sink, by
    position alone, so it declares ``keys_by_position`` and vLLM reads those two ranges as it reads the sink's
    windows (no context, no press call). ``select`` still calls the press; ``alspec-check-approx`` compares the
    ranges with the keys the press keeps."""

    keys_by_position = True

    def check(self, window: int) -> None:
        if not 0 <= self.n_sink < 2 * window:
            raise ConfigError(f"approx_args n_sink:{self.n_sink} leaves no recent key in the budget 2S = "
                              f"{2 * window}; use 0 <= n_sink < {2 * window}, e.g. n_sink:{min(4, 2 * window - 1)}")
        super().check(window)

    def position_ranges(self, pos: torch.Tensor, window: int, window_align: int) -> Ranges:
        recent = 2 * window - self.n_sink
        first = [(torch.zeros_like(pos), torch.full_like(pos, self.n_sink))] if self.n_sink else []
        parts = [*first, (pos + 1 - recent, pos + 1)]
        return (torch.stack([a for a, _ in parts], 1), torch.stack([b for _, b in parts], 1),
                (self.n_sink, recent) if self.n_sink else (recent,))


@dataclass(frozen=True)
class WrappingPress(KeyScoredPress):
    """A press around a key-only press (CriticalKV): the inner one by name, with its defaults."""

    hf_only = "it weighs values by the HF attention module's o_proj weight, which vLLM's attention layer does not have"

    @classmethod
    def fields_of(cls, press: type) -> list[tuple]:
        return [("press", str, field(default="KnormPress", metadata={"short": "of", "label": "of"})),
                ("epsilon", float, field(default=1e-4)), ("first_stage_ratio", float, field(default=0.5))]

    def build(self, kvpress: Any, ratio: float) -> Any:
        args = self.args()
        made = getattr(kvpress, self.press_name)(getattr(kvpress, args.pop("press"))(), **args)
        made.compression_ratio = ratio
        return made

    def check(self, window: int) -> None:
        wrapped = [name for name, kind in PRESSES.items() if issubclass(kind, KeyScoredPress)
                   and not issubclass(kind, WrappingPress)]
        if self.press not in wrapped:
            raise ConfigError(f"approx_args press:{self.press} is not a key-only press; {self.press_name} wraps one "
                              f"of {', '.join(wrapped)}")
        super().check(window)


@dataclass
class _Prompt:
    """One layer's prompt, as observed at prefill: per row (pad, start, input, keys, values, rotary terms), until
    :meth:`PromptScoredPress.prepare` scores it."""

    module: torch.nn.Module
    shape: tuple[int, int, int]  # the (B, Hkv, L) of the scores
    rows: list[tuple]
    ranking: PromptRanking | None = None


@dataclass(frozen=True)
class PromptScoredPress(_PressDraft, PromptScored):
    """A prompt-time press: the press scores each row's prompt once, at prefill, from the layer's input; each step
    keeps the newest ``recent`` tokens and the top 2S - recent prompt keys."""

    recent: int = field(default=8, metadata={"short": "r", "label": "R"})
    kind = "prompt-time"
    hf_only = ("it scores the prompt from the layer's input hidden states through the HF attention module's q_proj "
               "and rotary embedding, which vLLM's attention layer does not expose")

    def shortest(self) -> int:
        """Prompts of at most this many tokens are too short for the press to score: their keys rank newest first."""
        return 0

    def build(self, kvpress: Any, ratio: float) -> Any:
        args = self.args()
        del args["recent"]  # the draft's, not the press's
        return getattr(kvpress, self.press_name)(compression_ratio=ratio, **args)

    def prompt_window(self) -> int:
        return 1 << 62  # the whole prompt: one pass must hold all of it

    def observe_prompt(self, query: torch.Tensor, key: torch.Tensor, scaling: float, start: torch.Tensor,
                       pad: torch.Tensor, offset: int, layer: LayerInputs | None = None) -> _Prompt:
        """Each row's prompt as the press reads it (its input, keys, values and rotary terms), scored at the first
        decode step, where the budget is known (:meth:`prepare`)."""
        check_queries(layer.module)
        cos, sin = layer.position_embeddings
        rows = []
        for row, (a, s) in enumerate(zip(pad.tolist(), start.tolist())):
            part, terms = slice(a - offset, s - offset), row if cos.shape[0] > 1 else 0  # one row of terms: shared
            rows.append((a, s, layer.hidden_states[row:row + 1, part], key[row:row + 1, :, a:s],
                         layer.value[row:row + 1, :, a:s], (cos[terms:terms + 1, part], sin[terms:terms + 1, part])))
        return _Prompt(press_view(layer), tuple(key.shape[:3]), rows)

    def prepare(self, key: torch.Tensor, pad: torch.Tensor, window: int, observed: _Prompt | None = None,
                layer: LayerInputs | None = None) -> PromptRanking:
        """Each prompt key's score (B, Hkv, L), -inf past the prompt and on padding, ranked: the press's, at a
        compression ratio that keeps the 2S - recent keys this draft takes of the prompt."""
        if observed is None:
            raise RuntimeError(f"kvpress:{self.press_name} scored no prompt: no forward pass of this call held the "
                               "whole prompt (a prompt prefilled outside the call)")
        if observed.ranking is None:
            scores = torch.full(observed.shape, -math.inf, device=key.device)
            shortest = self.shortest()
            for row, (a, s, hidden, keys, values, terms) in enumerate(observed.rows):
                if s - a <= shortest:  # too short for the press: newest first
                    scores[row, :, a:s] = torch.arange(s - a, device=key.device, dtype=scores.dtype)
                    continue
                press = self.make_press(2 * window - self.recent, s - a)
                scored = score(press, observed.module, hidden, keys, values, {"position_embeddings": terms})
                scores[row, :, a:s] = scored[0].float().nan_to_num(nan=-math.inf)
            observed.ranking, observed.rows = PromptRanking.of(scores), []  # the prompt's inputs are no longer held
        return observed.ranking


@dataclass(frozen=True)
class WindowedPromptPress(PromptScoredPress):
    """A prompt-time press that scores with the prompt's last ``window_size`` queries (SnapKV asserts more tokens)."""

    def shortest(self) -> int:
        return self.window_size


@dataclass(frozen=True)
class SinkPromptPress(PromptScoredPress):
    """A prompt-time press that keeps ``n_sink`` first tokens apart."""

    def shortest(self) -> int:
        return self.n_sink


@dataclass(frozen=True)
class TwoSinkPromptPress(PromptScoredPress):
    """A prompt-time press that keeps sinks at both ends (Compactor)."""

    def shortest(self) -> int:
        return self.sink_size_start + self.sink_size_end


# Every press alspec-eval runs, by kvpress's name, with the kind of draft it runs as; the order is the reports'.
PRESSES: dict[str, type[_PressDraft]] = {
    "KnormPress": KeyAlonePress, "KeyDiffPress": MeanKeyPress, "CURPress": LeveragePress,
    "LagKVPress": ChunkPairPress, "RandomPress": PositionRankedPress, "StreamingLLMPress": SinkAndRecentPress,
    "CriticalKVPress": WrappingPress,
    "SnapKVPress": WindowedPromptPress, "PyramidKVPress": WindowedPromptPress,
    "ExpectedAttentionPress": SinkPromptPress, "CapPress": SinkPromptPress, "LeverageScorePress": PromptScoredPress,
    "NonCausalAttnPress": PromptScoredPress, "CompactorPress": TwoSinkPromptPress,
}
