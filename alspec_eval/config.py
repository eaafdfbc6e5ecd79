"""The speculation settings shared by every backend, validated before any model is loaded."""

from __future__ import annotations

import difflib
import math
import re
from dataclasses import asdict, dataclass, replace
from typing import Any, Literal

from .approximations.catalog import DEFAULT
from .backends import BACKENDS
from .constants import TILE, WINDOW_ALIGNS
from .errors import ConfigError
from .schedule import DEFAULT_LAMBDA, LambdaSchedule

__all__ = ["ConfigError", "LambdaSchedule", "SpeculationConfig", "parse_layers"]

Policy = Literal["dynamic", "always", "static", "exact", "selfspec"]
POLICIES: tuple[str, ...] = ("dynamic", "always", "static", "exact", "selfspec")
# Old names a policy is still read under (model_args, configs, cell and result files written before): "sink" named
# the policy that accepts A~ always (lambda = inf) whatever the approximation, as the approximation "sink" is named.
POLICY_ALIASES = {"sink": "always"}
DEFAULT_GAMMA = 4  # draft tokens per verification step under policy=selfspec
KERNELS: tuple[str, ...] = ("auto", "model", "torch", "triton")  # backends/sim/__init__.py says what each computes
KERNEL_ALIASES = {"sdpa": "model"}  # the name kernel=model had before it also covered eager attention
TT_MODES: tuple[str, ...] = ("device", "host")
TT_KV_DTYPES: tuple[str, ...] = ("bfloat8_b", "bfloat16")
TT_KERNELS: tuple[str, ...] = ("ttnn", "ttlang")
# A plan's thresholds (plan.py): besides a lambda >= 0 (accept iff d <= lambda n), three values say what else a
# (row, layer) does. semantics.accept rejects NaN and -inf by itself, so a kernel needs no case for them.
OFF = math.nan  # exact attention, nothing recorded (baseline; policy=exact and selfspec's verifier; sliding layers)
REJECT = -math.inf  # exact attention, recorded as rejected (policy=static's exact layers: decided, not measured)
ALWAYS = math.inf  # A~ always (policy=always; policy=static's approximated layers)
# Settings fixed when the model loads (its hooks, kernel and device); the others may change from call to call.
LOAD_TIME_SETTINGS: tuple[str, ...] = ("backend", "kernel", "tt")
TT_ARGS = {"tt_mode": "mode", "tt_device_id": "device_id", "tt_kv_dtype": "kv_dtype", "tt_kernel": "kernel"}


MODEL_ARGS: dict[str, str] = {
    "lambda": "lam", "lam": "lam", "window": "window", "policy": "policy", "static_layers": "static_layers",
    "backend": "backend", "window_align": "window_align", "speculate_prefill": "speculate_prefill",
    "trace_tokens": "trace_tokens", "kernel": "kernel", "stats_path": "stats_path",
    **{arg: arg for arg in TT_ARGS},  # backend=tt's own: TTSettings
    "gamma": "gamma", "lambda_schedule": "lambda_schedule", "approx": "approx", "approx_args": "approx_args",
}


def unloadable_model(pretrained: str, err: OSError) -> str:
    """One line for transformers' "not a local folder and not a valid model identifier" and kin."""
    return (f"pretrained={pretrained!r} cannot be loaded ({str(err).splitlines()[0]}); give a local folder with "
            "config.json, a model id in the local hub cache, or pretrained=smollm2")


def unknown_model_arg(key: str, value: Any, rejected_by: str, hf_keys: set[str]) -> str:
    """One line for a model_arg that no one takes: HFLM passed it on to ``from_pretrained``, whose model class
    (``rejected_by``) refused it. Names the key meant where it is a near miss of ours or HFLM's."""
    close = difflib.get_close_matches(key, [*MODEL_ARGS, *sorted(hf_keys - {"self", "kwargs"})], n=1, cutoff=0.75)
    meant = f"did you mean {close[0]!r}? " if close else ""
    return (f"unknown model_arg {key}={value!r}: {meant}alspec's own are {', '.join(sorted(set(MODEL_ARGS) - {'lam'}))}; "
            f"HFLM takes its own (batch_size, dtype, max_length, ...) and passes the rest to from_pretrained, where "
            f"{rejected_by} does not take {key!r}; drop it or fix its name")


def tt_window_problem(window: int) -> str | None:
    """Why S cannot be the TT op's window (its program_config.k_chunk_size: a power of 2 and a multiple of 32)."""
    if window % TILE or window & (window - 1):
        return (f"window={window} is not a power of 2 that is a multiple of {TILE}: with backend=tt the window is the "
                f"TT op's k_chunk_size; use window=32, 64, 128 (the authors' default), 256 or 512 "
                "(backend=sim takes any S)")
    return None


def canonical_policy(policy: Any) -> Any:
    """A policy under its name of today (``POLICY_ALIASES``); anything else as given, for the caller to check."""
    return POLICY_ALIASES.get(policy, policy) if isinstance(policy, str) else policy


def parse_layers(spec: str | int | list[int] | tuple[int, ...] | None) -> tuple[int, ...]:
    """Parse a layer set such as ``"0;3;7-9"`` (``,`` separates lm-eval's model_args, so it cannot)."""
    if spec is None or spec == "":
        return ()
    if isinstance(spec, int):
        return (spec,)
    if isinstance(spec, (list, tuple)):
        return tuple(sorted({int(x) for x in spec}))
    layers: set[int] = set()
    for part in re.split(r"[;+\s]+", str(spec).strip()):
        if not part:
            continue
        match = re.fullmatch(r"(\d+)(?:-(\d+))?", part)
        if match is None:
            raise ConfigError(
                f"static_layers: cannot read {part!r} in {spec!r}; "
                "write layer indices separated by ';' with optional ranges, e.g. static_layers=0;3;7-9"
            )
        lo, hi = int(match[1]), int(match[2] or match[1])
        if hi < lo:
            raise ConfigError(f"static_layers: range {part!r} is reversed; write it as {hi}-{lo}")
        layers.update(range(lo, hi + 1))
    return tuple(sorted(layers))


def _as_bool(name: str, value: Any) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.lower() in ("true", "false", "1", "0"):
        return value.lower() in ("true", "1")
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    raise ConfigError(f"{name}={value!r} is not a boolean; use {name}=true or {name}=false")


@dataclass(frozen=True)
class TTSettings:
    """backend=tt's own settings (model_args tt_mode, tt_device_id, tt_kv_dtype, tt_kernel), fixed when the model
    loads; backend=sim ignores them."""

    mode: str = "device"
    device_id: int = 0
    kv_dtype: str = "bfloat8_b"
    kernel: str = "ttnn"

    def __post_init__(self) -> None:
        if self.mode not in TT_MODES:
            raise ConfigError(f"tt_mode={self.mode!r} is unknown; use device (a Tenstorrent card) or host (ttnn's golden functions, no card)")
        if self.kv_dtype not in TT_KV_DTYPES:
            raise ConfigError(f"tt_kv_dtype={self.kv_dtype!r} is unknown; use one of {', '.join(TT_KV_DTYPES)}")
        if self.kernel not in TT_KERNELS:
            raise ConfigError(f"tt_kernel={self.kernel!r} is unknown; use ttnn (ttnn's SDPA decode op) or ttlang (the TT-Lang speculative flash decode kernel)")
        device_id = self.device_id
        if isinstance(device_id, str) and device_id.isdigit():
            object.__setattr__(self, "device_id", int(device_id))
        elif isinstance(device_id, bool) or not isinstance(device_id, int) or device_id < 0:
            raise ConfigError(f"tt_device_id={device_id!r} is invalid; use a device index >= 0, e.g. tt_device_id=0")

    def to_dict(self) -> dict[str, Any]:
        """Under their model_args names."""
        return {arg: getattr(self, name) for arg, name in TT_ARGS.items()}


@dataclass(frozen=True)
class SpeculationConfig:
    """What to speculate and how to verify it (docs/design.md, Semantics 1-7).

    ``lam`` is the paper's lambda: a position is accepted iff ||A~ - A|| <= lam * ||A||. ``policy=selfspec`` is
    token-level self-speculation instead (``gamma`` drafted tokens per step, the sink A~ as draft; selfspec.py).
    """

    lam: float = DEFAULT_LAMBDA
    window: int = 128
    policy: Policy = "dynamic"
    static_layers: tuple[int, ...] = ()
    backend: str = "sim"
    window_align: int = 1
    speculate_prefill: bool = False
    trace_tokens: bool = False
    kernel: str = "auto"
    stats_path: str | None = None
    tt: TTSettings = TTSettings()
    gamma: int | None = None  # policy=selfspec only; DEFAULT_GAMMA when not given
    lambda_schedule: LambdaSchedule | str | None = None  # per-layer lambdas (a path, read here); schedule.py
    approx: Any = DEFAULT  # which <= 2S keys A~ attends to: a name or an Approximation (alspec_eval.approximations)
    approx_args: str | dict[str, Any] | None = None  # its parameters (page:16); folded into ``approx``

    def __post_init__(self) -> None:
        lam = self.lam
        if isinstance(lam, str):
            try:
                lam = float(lam)
            except ValueError:
                raise ConfigError(f"lambda={self.lam!r} is not a number; use a float >= 0 or inf, e.g. lambda=0.1") from None
        if isinstance(lam, bool) or not isinstance(lam, (int, float)) or math.isnan(lam) or lam < 0:
            raise ConfigError(f"lambda={self.lam!r} is invalid; use a float >= 0 or inf, e.g. lambda=0.1")
        object.__setattr__(self, "lam", float(lam))
        if isinstance(self.window, bool) or not isinstance(self.window, int) or self.window < 1:
            raise ConfigError(f"window={self.window!r} is invalid; use an integer >= 1 (S, tokens per sink window), e.g. window=128")
        object.__setattr__(self, "policy", canonical_policy(self.policy))
        if self.policy not in POLICIES:
            raise ConfigError(f"policy={self.policy!r} is unknown; use one of {', '.join(POLICIES)}")
        if self.backend not in BACKENDS:
            raise ConfigError(f"backend={self.backend!r} is unknown; use one of {', '.join(BACKENDS)}")
        object.__setattr__(self, "kernel", KERNEL_ALIASES.get(self.kernel, self.kernel))
        if self.kernel not in KERNELS:
            raise ConfigError(f"kernel={self.kernel!r} is unknown; use one of {', '.join(KERNELS)}")
        if self.backend == "tt":  # the TT op's windows are tile-aligned by definition
            object.__setattr__(self, "window_align", 32)
        if self.window_align not in WINDOW_ALIGNS:
            raise ConfigError(f"window_align={self.window_align!r} is invalid; use 1 (exact windows) or 32 (the TT kernel's tile-aligned window)")
        if self.backend == "tt" and tt_window_problem(self.window):
            raise ConfigError(tt_window_problem(self.window))
        if self.window_align == 32 and self.window % 32:
            raise ConfigError(f"window={self.window} with window_align=32{' (forced by backend=tt)' if self.backend == 'tt' else ''} must be a multiple of 32; use e.g. window={max(32, self.window // 32 * 32)}")
        object.__setattr__(self, "static_layers", parse_layers(self.static_layers))
        if self.policy == "static" and not self.static_layers:
            raise ConfigError("policy=static needs the layers to approximate; pass e.g. static_layers=0;3;7-9")
        if self.policy != "static" and self.static_layers:
            raise ConfigError(f"static_layers={';'.join(map(str, self.static_layers))} only applies to policy=static; drop it or set policy=static")
        self._check_gamma()
        self._check_schedule()
        self._check_approx()
        object.__setattr__(self, "speculate_prefill", _as_bool("speculate_prefill", self.speculate_prefill))
        object.__setattr__(self, "trace_tokens", _as_bool("trace_tokens", self.trace_tokens))

    def _check_gamma(self) -> None:
        gamma = self.gamma
        if self.policy != "selfspec":
            if gamma is not None:
                raise ConfigError(f"gamma={gamma} only applies to policy=selfspec; drop it or set policy=selfspec")
            return
        if isinstance(gamma, str) and gamma.isdigit():
            gamma = int(gamma)
        gamma = DEFAULT_GAMMA if gamma is None else gamma
        if isinstance(gamma, bool) or not isinstance(gamma, int) or gamma < 1:
            raise ConfigError(f"gamma={self.gamma!r} is invalid; use an integer >= 1 (draft tokens per verification "
                              f"step), e.g. gamma={DEFAULT_GAMMA}")
        if self.backend != "sim":
            raise ConfigError("policy=selfspec runs on backend=sim only (the TT op speculates attention, not tokens)")
        object.__setattr__(self, "gamma", gamma)

    def _check_schedule(self) -> None:
        schedule = self.lambda_schedule
        if schedule in (None, ""):
            object.__setattr__(self, "lambda_schedule", None)
            return
        if not isinstance(schedule, LambdaSchedule):
            schedule = LambdaSchedule.load(str(schedule))
            object.__setattr__(self, "lambda_schedule", schedule)
        if self.lam != DEFAULT_LAMBDA:
            raise ConfigError(f"lambda={self.lam:g} and lambda_schedule={schedule.path} both set the threshold; drop "
                              "one (a schedule gives every layer its own lambda)")
        if self.policy != "dynamic":
            raise ConfigError(f"lambda_schedule only applies to policy=dynamic, not policy={self.policy}; drop it")

    def _check_approx(self) -> None:
        from .approximations import make_approximation  # torch-free; the built-ins load when used

        approx = make_approximation(self.approx, self.approx_args)
        approx.check(self.window)
        object.__setattr__(self, "approx", approx)
        object.__setattr__(self, "approx_args", None)
        if self.backend != "sim" and not approx.tt_op:
            raise ConfigError(f"approx={approx.name} runs on backend=sim only (the TT op computes the sink A~); "
                              "drop approx or use backend=sim")
        if self.window_align not in approx.window_aligns:
            raise ConfigError(f"approx={approx.name} with window_align={self.window_align}: an aligned last window "
                              "is the sink's (the TT op's); use window_align=1")
        if self.policy == "selfspec" and approx.prompt_keys:
            raise ConfigError(f"approx={approx.name} scores the prompt at prefill, which self-speculation's drafts do "
                              "not see; use another approx with policy=selfspec")
        if self.kernel in ("torch", "triton") and not approx.fused_kernel:
            raise ConfigError(f"approx={approx.name} has no fused decode kernel (kernel={self.kernel} computes the "
                              "sink A~); use kernel=model or kernel=auto")

    def layer_lambda(self, layer: int) -> float:
        """The threshold of ``layer``: the schedule's, else ``lam``."""
        return self.lam if self.lambda_schedule is None else self.lambda_schedule.layer_lambda(layer)

    def thresholds(self, num_layers: int) -> list[float]:
        """The policy compiled into one row of a decision plan: its threshold at every layer (OFF, REJECT, ALWAYS
        or a lambda). Every path reads the plan, never the policy's name."""
        if self.policy in ("exact", "selfspec"):  # selfspec's own passes verify exactly; its drafts: sink_draft()
            return [OFF] * num_layers
        if self.policy == "always":
            return [ALWAYS] * num_layers
        if self.policy == "static":
            return [ALWAYS if i in self.static_layers else REJECT for i in range(num_layers)]
        return [self.layer_lambda(i) for i in range(num_layers)]

    @property
    def drafts_tokens(self) -> bool:
        """Token-level self-speculation: generations are drafted and verified token by token (selfspec.py)."""
        return self.policy == "selfspec"

    def sink_draft(self) -> "SpeculationConfig":
        """What self-speculation drafts with: A~ always (policy=always), of the same window and approximation."""
        return replace(self, policy="always", gamma=None)

    @property
    def recorded_lambda(self) -> float | str | None:
        """The lambda a result records: the one that decides (dynamic), "inf" for always, None where none decides
        (exact, static, selfspec, a schedule)."""
        if self.policy == "always":
            return "inf"
        if self.policy != "dynamic" or self.lambda_schedule is not None:
            return None
        return self.lam if math.isfinite(self.lam) else "inf"

    @classmethod
    def from_model_args(cls, args: dict[str, Any], known: set[str] = frozenset()) -> tuple["SpeculationConfig", dict[str, Any]]:
        """Split lm-eval model_args into the speculation config and the rest (for HFLM).

        ``known`` names the other accepted arguments; an unknown one that looks like a misspelt
        speculation argument is an error (it would otherwise reach from_pretrained and be ignored).
        """
        ours = {MODEL_ARGS[k]: v for k, v in args.items() if k in MODEL_ARGS and k not in TT_ARGS}
        tt = {TT_ARGS[k]: v for k, v in args.items() if k in TT_ARGS}
        if tt:
            ours["tt"] = TTSettings(**tt)
        rest = {k: v for k, v in args.items() if k not in MODEL_ARGS}
        for key in rest:
            close = difflib.get_close_matches(key, MODEL_ARGS, n=1, cutoff=0.75)
            if close and key not in known:
                raise ConfigError(f"unknown model_arg {key!r}; did you mean {close[0]!r}?")
        return cls(**ours), rest

    def check_layers(self, num_layers: int) -> None:
        """Layer indices can only be checked once the model config is known (still before the weights load)."""
        if self.lambda_schedule is not None:
            self.lambda_schedule.check_layers(num_layers)
        bad = [i for i in self.static_layers if i >= num_layers]
        if bad:
            raise ConfigError(
                f"static_layers contains {bad}, but the model has {num_layers} layers (0..{num_layers - 1}); "
                "drop the out-of-range indices"
            )

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form (lambda under its paper name)."""
        out: dict[str, Any] = {"lambda": self.recorded_lambda}
        for key, value in asdict(self).items():
            if key == "tt":
                out.update(self.tt.to_dict())
            elif key == "approx":
                out["approx"], out["approx_args"] = self.approx.name, self.approx.args()
            elif key not in ("lam", "lambda_schedule", "approx_args"):
                out[key] = value
        out["static_layers"] = list(self.static_layers)
        if self.lambda_schedule is not None:  # the schedule sets every threshold
            out["lambda_schedule"] = self.lambda_schedule.to_dict()
        return out
