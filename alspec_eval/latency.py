"""The paper's decode latency model (Appendix F) and presets with the paper's measured numbers only.

Quantities per token, in microseconds: ``fixed`` (embedding, LM head), ``per_layer`` (a decoder layer's
ops except attention), ``fd`` (flash decode at context K), ``sfd_s`` and ``sfd_r`` (the speculative flash
decode's sender side: exact attention plus verification; receiver side: the early partial the second
device starts from), over L layers.

- full tensor parallelism:  fixed + L (per_layer + FD)
- ALSpec at hit rate r, the paper's N150 estimate (hits rounded down to whole layers):
  fixed + floor(L r) (SFD_R + max(SFD_S - SFD_R, per_layer)) + ceil(L (1 - r)) (per_layer + SFD_S)
- ALSpec with per-layer hit rates h_l: fixed + sum_l [h_l hit + (1 - h_l) miss], hit and miss the two
  brackets above.
- The paper's GPU projection (Table 3, "SP@65% + TP4" on 8 H100s) is the same per-layer form with
  SFD_S = FD and SFD_R = 0 (a hit hides the layer's attention behind the non-attention ops of the second
  device group) and r a fraction of layers, not rounded; ``fixed`` is what the layers do not explain of
  the measured TP4 tokens/s.

Every preset number cites its table; a number the paper does not give is an estimate, listed in
``estimates`` and printed as such.
"""

from __future__ import annotations

import difflib
import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Sequence

DEFAULT_PRESET = "h100-tp4-32k"  # the report's default table: every number measured in the paper (Table 3)
FIELDS = ("fixed_us", "per_layer_us", "fd_us", "sfd_s_us", "sfd_r_us")
PAPER = "ALSpec (ICML 2025)"


class LatencyError(ValueError):
    """A latency table, preset or hit rate that cannot be used; the message names the value and the fix."""


@dataclass(frozen=True)
class LatencyModel:
    """One device setup's latencies (microseconds per token) and where each number comes from."""

    name: str
    num_layers: int
    fixed_us: float
    per_layer_us: float
    fd_us: float
    sfd_s_us: float
    sfd_r_us: float
    round_hits: bool = True  # the N150 estimate floors hits to whole layers; the GPU projection does not
    description: str = ""
    sources: dict[str, str] = field(default_factory=dict)  # field -> the paper's table, or "estimate: why"
    reference_tokens_per_s: dict[str, float] = field(default_factory=dict)  # other measured rates to compare with
    context_tokens: int | None = None  # K of fd_us
    # Measured attention time per layer (us) at other contexts of the same setup, (tokens, us) by context: the
    # draft of self-speculation reads 2S keys, and its attention time is read off these points.
    attention_points: tuple[tuple[int, float], ...] = ()

    @property
    def estimates(self) -> list[str]:
        """The fields the paper does not give (their source starts with "estimate")."""
        return [k for k in FIELDS if self.sources.get(k, "").startswith("estimate")]

    def attention_us(self, keys: int) -> tuple[float, str]:
        """A layer's attention time when it reads ``keys`` keys, and how it was obtained (always an ESTIMATE).

        With two or more measured points: linear interpolation between them, extended beyond the ends along the
        nearest segment (attention time is affine in the keys read near a point: a fixed launch and reduction
        cost plus a memory-bound part; Table 3's points are far from proportional, 13 us at 1K and 29 us at 32K).
        With fewer: FD at K, an upper bound for fewer keys than K."""
        points = sorted(self.attention_points)
        if len(points) < 2:
            return self.fd_us, (f"FD at K = {self.context_tokens or '?'} (an upper bound: the table measures "
                                "attention at one context only)")
        i = min(max(next((j for j, (k, _) in enumerate(points) if k >= keys), len(points) - 1), 1), len(points) - 1)
        (k0, t0), (k1, t1) = points[i - 1], points[i]
        us = max(t0 + (keys - k0) * (t1 - t0) / (k1 - k0), 0.0)
        return us, (f"attention at {keys} keys, linear in the keys read through the measured points "
                    f"({k0} tokens: {t0:g} us, {k1} tokens: {t1:g} us)")

    @property
    def hit_us(self) -> float:
        """A layer whose speculation is accepted: the partial, then the longer of the rest of the exact attention
        (with its verification) and the post-attention ops running on the second device."""
        return self.sfd_r_us + max(self.sfd_s_us - self.sfd_r_us, self.per_layer_us)

    @property
    def miss_us(self) -> float:
        """A rejected layer pays the whole speculative flash decode and then its own ops."""
        return self.per_layer_us + self.sfd_s_us

    def hit_us_reading(self, keys: float, window: int) -> float:
        """A hit whose A~ reads ``keys`` keys (and values) per KV head, against the sink's 2S that SFD_R prices.
        Beyond 2S an ESTIMATE: decode attention is memory bound, FD reads K keys in FD us, so each extra key adds
        FD / K to the partial the second device waits for; reading as much as A (K keys or more) gains nothing:
        a miss's cost."""
        if keys <= 2 * window:
            return self.hit_us
        if self.context_tokens is None:
            raise LatencyError(f"latency table {self.name!r} has no context_tokens (K): give it to price an "
                               "approximation that reads more keys than the sink's 2S")
        partial = self.sfd_r_us + self.fd_us * (keys - 2 * window) / self.context_tokens
        if keys >= self.context_tokens or partial >= self.sfd_s_us:
            return self.miss_us
        return partial + max(self.sfd_s_us - partial, self.per_layer_us)

    def full_tp_us(self) -> float:
        return self.fixed_us + self.num_layers * (self.per_layer_us + self.fd_us)

    def alspec_us(self, hit_rate: float) -> float:
        """Token latency at one hit rate for every layer (floor/ceil form where ``round_hits``)."""
        check_rate(hit_rate)
        if not self.round_hits:
            return self.per_layer_alspec_us([hit_rate] * self.num_layers)
        hits = math.floor(self.num_layers * hit_rate + 1e-9)
        misses = math.ceil(self.num_layers * (1 - hit_rate) - 1e-9)
        return self.fixed_us + hits * self.hit_us + misses * self.miss_us

    def per_layer_alspec_us(self, hit_rates: Sequence[float], hit_us: float | None = None) -> float:
        """Token latency from measured per-layer hit rates (one per layer of this model); ``hit_us``: a hit's cost
        where A~ is not the sink's (:meth:`hit_us_reading`)."""
        if len(hit_rates) != self.num_layers:
            raise LatencyError(f"{len(hit_rates)} per-layer hit rates for a {self.num_layers}-layer latency table")
        for h in hit_rates:
            check_rate(h)
        hit = self.hit_us if hit_us is None else hit_us
        return self.fixed_us + sum(h * hit + (1 - h) * self.miss_us for h in hit_rates)

    @classmethod
    def from_mapping(cls, data: dict[str, Any], default_name: str) -> "LatencyModel":
        """A user's measured table: ``num_layers`` and every field of FIELDS, numbers >= 0 (microseconds)."""
        missing = [k for k in ("num_layers", *FIELDS) if k not in data]
        if missing:
            raise LatencyError(f"latency table {default_name!r} lacks {', '.join(missing)}; give num_layers and "
                               f"microseconds per token for {', '.join(FIELDS)}")
        layers = data["num_layers"]
        if isinstance(layers, bool) or not isinstance(layers, int) or layers < 1:
            raise LatencyError(f"latency table {default_name!r}: num_layers={layers!r} must be an integer >= 1")
        for k in FIELDS:
            v = data[k]
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
                raise LatencyError(f"latency table {default_name!r}: {k}={v!r} must be a number >= 0 (microseconds)")
        context = data.get("context_tokens")
        if context is not None and (isinstance(context, bool) or not isinstance(context, int) or context < 1):
            raise LatencyError(f"latency table {default_name!r}: context_tokens={context!r} must be an integer >= 1 "
                               "(the context of fd_us)")
        points = data.get("attention_points", [])
        if not isinstance(points, list) or not all(
                isinstance(p, (list, tuple)) and len(p) == 2 and isinstance(p[0], int) and not isinstance(p[0], bool)
                and p[0] >= 1 and isinstance(p[1], (int, float)) and not isinstance(p[1], bool) and p[1] >= 0
                for p in points) or len({p[0] for p in points}) != len(points):
            raise LatencyError(f"latency table {default_name!r}: attention_points={points!r} must be a list of "
                               "[context tokens, microseconds] pairs with distinct contexts, e.g. [[1024, 13], [32768, 29]]")
        unknown = set(data) - {"name", "num_layers", "round_hits", "description", "context_tokens",
                               "attention_points", *FIELDS}
        if unknown:
            raise LatencyError(f"latency table {default_name!r}: unknown field(s) {', '.join(sorted(unknown))}; "
                               f"use num_layers, {', '.join(FIELDS)}, round_hits, context_tokens, attention_points, "
                               "name, description")
        return cls(name=str(data.get("name", default_name)), num_layers=layers,
                   round_hits=bool(data.get("round_hits", True)), description=str(data.get("description", "")),
                   context_tokens=context, attention_points=tuple((int(k), float(t)) for k, t in points),
                   sources=dict.fromkeys(FIELDS, "measured by the user"), **{k: float(data[k]) for k in FIELDS})


def check_rate(r: float) -> None:
    if isinstance(r, bool) or not isinstance(r, (int, float)) or not 0 <= r <= 1:
        raise LatencyError(f"hit rate {r!r} is outside [0, 1]; give a fraction, e.g. 0.65")


def load_latency(path: str | Path) -> LatencyModel:
    """A user's measured table from YAML (.yaml/.yml) or JSON."""
    import yaml

    path = Path(path)
    try:
        text = path.read_text()
    except OSError as e:
        raise LatencyError(f"cannot read latency file {path}: {e.strerror}") from None
    try:
        data = yaml.safe_load(text) if path.suffix in (".yaml", ".yml") else json.loads(text)
    except (yaml.YAMLError, json.JSONDecodeError) as e:
        raise LatencyError(f"latency file {path} does not parse: {' '.join(str(e).split())}") from None
    if not isinstance(data, dict):
        raise LatencyError(f"latency file {path} must hold a mapping with num_layers and {', '.join(FIELDS)}")
    return LatencyModel.from_mapping(data, path.stem)


# ---------------------------------------------------------------------------------------------- presets

LLAMA_8B_LAYERS = 32  # Llama 3.1 8B (Appendix F)
SPEC_WINDOW = 128  # S of the authors' op and module (tt_op_contract.md)

# Tables 4-7: per layer without flash decode, flash decode op at 1K, fixed (embedding + LM head); ns.
N150_TABLES = {1: ("Table 4", 846747, 69853, 2313703), 2: ("Table 5", 555015, 64309, 1207636),
               4: ("Table 6", 387584, 56024, 638529), 8: ("Table 7", 440451, 50096, 384460)}

# Table 3 (Llama 3 8B, SGLang + FlashInfer): attention and non-attention per layer on 4xH100 (us),
# TP tokens/s on 4 and 8 H100s, by context.
H100_TABLE3 = {"1k": (13, 95, 244.6, 249.3), "32k": (29, 100, 214.2, 231.3), "64k": (49, 100, 191.4, 209.7),
               "96k": (56, 100, 178.2, 194.2), "128k": (63, 101, 169.3, 184.8)}


def _n150(tp: int) -> LatencyModel:
    table, per_layer, fd, fixed = N150_TABLES[tp]
    context = 1024
    return LatencyModel(
        name=f"n150-tp{tp}", num_layers=LLAMA_8B_LAYERS, fixed_us=fixed / 1e3, per_layer_us=per_layer / 1e3,
        fd_us=fd / 1e3, sfd_s_us=fd / 1e3, sfd_r_us=fd / 1e3 * 2 * SPEC_WINDOW / context, context_tokens=context,
        description=f"Llama 3.1 8B on {tp} x N150, context 1K (Appendix F, {table})",
        sources={"fixed_us": f"{PAPER} Appendix F, {table} (embedding + LM head)",
                 "per_layer_us": f"{PAPER} Appendix F, {table} (per layer without flash decode)",
                 "fd_us": f"{PAPER} Appendix F, {table} (flash decode op at 1K)",
                 "sfd_s_us": "estimate: SFD_S(1K) = FD(1K); the paper only plots it (Figure 12)",
                 "sfd_r_us": f"estimate: SFD_R(1K) = FD(1K) x 2S/K (S = {SPEC_WINDOW}: the first of the op's "
                             "chunks); the paper only plots it (Figure 12)"})


def _h100(context: str) -> LatencyModel:
    attention, non_attention, tp4, tp8 = H100_TABLE3[context]
    fixed = 1e6 / tp4 - LLAMA_8B_LAYERS * (non_attention + attention)
    cite = f"{PAPER} Table 3, {context} context"
    return LatencyModel(
        name=f"h100-tp4-{context}", num_layers=LLAMA_8B_LAYERS, fixed_us=fixed, per_layer_us=non_attention,
        fd_us=attention, sfd_s_us=attention, sfd_r_us=0.0, round_hits=False,
        context_tokens=int(context.removesuffix("k")) * 1024,
        attention_points=tuple((int(c.removesuffix("k")) * 1024, float(row[0])) for c, row in H100_TABLE3.items()),
        description=f"Llama 3 8B, SGLang + FlashInfer: speculative parallel + TP4 on 8 H100s against TP4 "
                    f"({context} context, Table 3)",
        sources={"fixed_us": f"{cite}: 1e6 / TP4 tokens/s ({tp4}) minus the layers' time",
                 "per_layer_us": f"{cite}: non-attention per layer on 4xH100",
                 "fd_us": f"{cite}: attention per layer on 4xH100",
                 "sfd_s_us": f"{cite}: the exact attention (= FD) on the first device group",
                 "sfd_r_us": "the paper's projection: a hit hides the attention (0 on the critical path)"},
        reference_tokens_per_s={"TP4 on 4 H100s (Table 3)": tp4, "TP8 on 8 H100s (Table 3)": tp8})


PRESETS: dict[str, LatencyModel] = {m.name: m for m in
                                   [*(_n150(tp) for tp in N150_TABLES), *(_h100(c) for c in H100_TABLE3)]}


def preset(name: str) -> LatencyModel:
    if name not in PRESETS:
        close = difflib.get_close_matches(name, PRESETS, n=1)
        hint = f"did you mean {close[0]!r}? " if close else ""
        raise LatencyError(f"unknown preset {name!r}; {hint}use one of {', '.join(PRESETS)} (alspec-latency "
                           "--list-presets) or --latency FILE")
    return PRESETS[name]


# ---------------------------------------------------------------------------------------------- projections

@dataclass(frozen=True)
class Projection:
    """ALSpec against full tensor parallelism on one latency model."""

    preset: str
    hit_rate: float  # the mean over layers where per-layer rates were given
    token_latency_us: float
    baseline_token_latency_us: float
    estimates: list[str]

    @property
    def tokens_per_s(self) -> float:
        return 1e6 / self.token_latency_us

    @property
    def baseline_tokens_per_s(self) -> float:
        return 1e6 / self.baseline_token_latency_us

    @property
    def speedup(self) -> float:
        return self.baseline_token_latency_us / self.token_latency_us

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "tokens_per_s": self.tokens_per_s, "baseline_tokens_per_s": self.baseline_tokens_per_s,
                "speedup": self.speedup}


def project(model: LatencyModel, hit_rate: float) -> Projection:
    """One hit rate for every layer."""
    return Projection(model.name, hit_rate, model.alspec_us(hit_rate), model.full_tp_us(), model.estimates)


def full_tp(model: LatencyModel) -> Projection:
    """The baseline itself: full tensor parallelism, no speculation (speedup 1)."""
    return Projection(model.name, 0.0, model.full_tp_us(), model.full_tp_us(), model.estimates)


def project_layers(model: LatencyModel, hit_rates: Sequence[float], keys: float = 0.0,
                   window: int = 0) -> tuple[Projection, bool]:
    """Measured per-layer hit rates; where the measured model has another number of layers than the table,
    every layer gets the measured mean (the flag says so). ``keys``: what a hit's A~ reads per KV head with a
    window of ``window`` (S) tokens; the default prices the sink's (:meth:`LatencyModel.hit_us_reading`)."""
    rates = list(hit_rates)
    averaged = len(rates) != model.num_layers
    if averaged:
        rates = [sum(rates) / len(rates) if rates else 0.0] * model.num_layers
    mean = sum(rates) / len(rates)
    hit = model.hit_us_reading(keys, window)
    return Projection(model.name, mean, model.per_layer_alspec_us(rates, hit), model.full_tp_us(),
                      model.estimates), averaged


# ---------------------------------------------------------------------------------------------- self-speculation

@dataclass(frozen=True)
class SelfSpecProjection:
    """Token-level self-speculation (policy=selfspec) on one latency model, with every input stated.

    The standard expected speedup of speculative decoding (Leviathan et al., 2023) with tau tokens per verification
    step, gamma drafted tokens per step and a draft step costing ``cost_ratio`` verification steps:
    speedup = tau / (gamma * cost_ratio + 1). Both step costs are ESTIMATES from this model's numbers:
    - a draft step is a decode step whose attention reads 2S keys instead of K:
      fixed + L (per_layer + attention(2S)), attention(2S) from :meth:`LatencyModel.attention_us`;
    - verifying gamma + 1 tokens costs one exact decode step, fixed + L (per_layer + FD) (memory bound at small
      gamma: the weights and the KV cache are read once).
    """

    preset: str
    tau: float
    gamma: int
    window: int
    context_tokens: int | None
    draft_attention_us: float
    draft_attention_source: str
    draft_us: float
    verify_us: float

    @property
    def cost_ratio(self) -> float:
        return self.draft_us / self.verify_us

    @property
    def speedup(self) -> float:
        return self.tau / (self.gamma * self.cost_ratio + 1)

    @property
    def token_latency_us(self) -> float:
        return self.verify_us / self.speedup

    @property
    def tokens_per_s(self) -> float:
        return 1e6 / self.token_latency_us

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "cost_ratio": self.cost_ratio, "speedup": self.speedup,
                "tokens_per_s": self.tokens_per_s, "estimates": ["draft_us", "verify_us"]}

    def as_projection(self, estimates: Sequence[str]) -> Projection:
        """The same projection in ALSpec's terms (against full tensor parallelism), for tables that hold both."""
        return Projection(self.preset, 0.0, self.token_latency_us, self.verify_us, [*estimates, "draft_us", "verify_us"])


def project_selfspec(model: LatencyModel, tau: float, gamma: int, window: int,
                     keys: float | None = None) -> SelfSpecProjection:
    """Self-speculation with a sink of ``window`` (S) tokens at each end, at this model's context; ``keys``: what
    the draft's attention reads per KV head where it is not the sink's 2S."""
    keys = 2 * window if keys is None else keys
    keys = keys if model.context_tokens is None else min(keys, model.context_tokens)
    attention, source = model.attention_us(keys)
    draft = model.fixed_us + model.num_layers * (model.per_layer_us + attention)
    return SelfSpecProjection(model.name, tau, gamma, window, model.context_tokens, attention, source, draft,
                              model.full_tp_us())
