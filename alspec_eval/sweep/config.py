"""Sweep configs (configs/*.yaml), validated with one clear message per mistake before anything loads."""

from __future__ import annotations

import difflib
import json
import math
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

import yaml

from ..approximations import DEFAULT, Approximation, default_approximation, make_approximation
from ..config import MODEL_ARGS, ConfigError, SpeculationConfig
from ..rows import STATIC, Row, sweep_rows
from ..ruler import unit_metadata, units
from ..schedule import LambdaSchedule


@dataclass(frozen=True)
class StaticBaseline:
    """The paper's static layer policy: approximate the layers whose dynamic acceptance at ``lam`` is >= ``p``."""

    p: float = 0.8
    lam: float = 0.1


@dataclass(frozen=True)
class SweepConfig:
    name: str
    tasks: list[str]  # lm-eval task or group names; a RULER task as a unit per length, "niah_single_1@4096"
    lambdas: list[float]
    model_args: dict[str, Any] = field(default_factory=lambda: {"pretrained": "smollm2"})
    window: int | list[int] = 128  # S; a list is a budget axis: every row of every approximation at each
    window_align: int = 1
    baseline: bool = True
    always: bool = True  # the lambda = inf row (A~ always) of each approximation: the sink's is the paper's sink row
    static: StaticBaseline | None = field(default_factory=StaticBaseline)
    gammas: list[int] = field(default_factory=list)  # a policy=selfspec row per draft length
    schedules: list[str] = field(default_factory=list)  # a tuned row per lambda_schedule file (alspec-tune)
    # the rows of each approximation of A~ (model_args approx), with the config's approx_args {name: args} folded in
    approx: list[Approximation] = field(default_factory=lambda: [default_approximation()])
    shared_prefill: bool = True
    device: str = "cpu"
    batch_size: int = 1
    limit: int | float | None = None
    samples: dict[str, list[int]] | None = None  # the doc_ids to evaluate per task (lm-eval's samples), not with limit
    num_fewshot: int | None = None
    apply_chat_template: bool = False
    gen_kwargs: dict[str, Any] | None = None
    metadata: dict[str, Any] = field(default_factory=dict)
    metrics: dict[str, str] = field(default_factory=dict)  # task -> primary metric key, e.g. "exact_match,strict-match"
    seed: int = 1234
    output: str | None = None
    engine: str = "hf"  # hf (--model alspec) or vllm (--model alspec-vllm): every cell on one model of it

    @property
    def output_dir(self) -> Path:
        return Path(self.output or f"results/{self.name}")

    def to_dict(self) -> dict[str, Any]:
        """sweep.json's form: approximations by name, their parameters in ``approx_args``, as a config gives them (a
        name at several settings: the list of them, in order), so that the report reads back every setting."""
        approx = [make_approximation(a) for a in self.approx]
        settings: dict[str, list[dict[str, Any]]] = {}
        for a in approx:
            settings.setdefault(a.name, []).append(a.args())
        return {**asdict(self), "approx": list(settings),
                "approx_args": {name: args if len(args) > 1 else args[0] for name, args in settings.items()
                                if len(args) > 1 or args[0]}}

    @property
    def windows(self) -> list[int]:
        return list(self.window) if isinstance(self.window, list) else [self.window]

    def window_of(self, row: Row) -> int:
        """The S a row runs with: its own on a budget axis, else the sweep's."""
        return self.windows[0] if row.window is None else row.window

    def rows(self) -> list[Row]:
        """Rows per task, in run order: the shared-prefill group first, static last (it calibrates on them). On a
        budget axis (``window`` a list) each row but the baseline once per window."""
        axis = self.windows if isinstance(self.window, list) else [None]
        tuned = [Row.tuned(LambdaSchedule.load(path)) for path in self.schedules]
        static = [STATIC.approximated(approx, w) for approx in self.approx for w in axis] if self.static else []
        return [*sweep_rows(self.lambdas, self.baseline, self.always, self.gammas, self.approx, axis), *tuned, *static]


def _check_keys(where: str, given: dict[str, Any], allowed: list[str]) -> None:
    for key in given:
        if key not in allowed:
            close = difflib.get_close_matches(key, allowed, n=1)
            hint = f"did you mean {close[0]!r}?" if close else f"allowed keys: {', '.join(allowed)}"
            raise ConfigError(f"{where}: unknown key {key!r}; {hint}")


OLD_KEYS = {"sink": "always"}  # keys of configs written before, read under their names of today


def _renamed(raw: Any, source: str) -> Any:
    """``raw`` with its old keys (OLD_KEYS) under their names of today; both given is an error."""
    if not isinstance(raw, dict):
        return raw
    out = dict(raw)
    for old, new in OLD_KEYS.items():
        if old in out:
            if new in out:
                raise ConfigError(f"{source}: {old} is the old name of {new}; keep {new}: {out[new]} and drop {old}")
            out[new] = out.pop(old)
    return out


def parse_config(raw: dict[str, Any], source: str = "config") -> SweepConfig:
    """Validate a config dict: unknown keys, types and ranges, each with the fix."""
    if not isinstance(raw, dict):
        raise ConfigError(f"{source}: expected a mapping of keys to values, got {type(raw).__name__}")
    if "page" in raw:
        raise ConfigError(f"{source}: page={raw['page']!r}: a sweep gives quest's page as approx_args: "
                          f"{{quest: {{page: {raw['page']}}}}}; move it there")
    raw = _renamed(raw, source)
    names = [f.name for f in fields(SweepConfig)]
    _check_keys(source, raw, [*names, "approx_args", "model"])
    for key in ("name", "tasks", "lambdas"):
        if key not in raw:
            raise ConfigError(f"{source}: missing {key!r}; see configs/demo.yaml for a complete example")
    raw = dict(raw)
    tasks = raw["tasks"]
    if isinstance(tasks, str):
        tasks = [tasks]
    if not tasks or not all(isinstance(t, str) for t in tasks):
        raise ConfigError(f"{source}: tasks must be a list of lm-eval task or group names, got {raw['tasks']!r}")
    if not isinstance(raw.get("metadata") or {}, dict):
        raise ConfigError(f"{source}: metadata must be a mapping, got {raw['metadata']!r}")
    try:
        raw["tasks"] = units(list(tasks), raw.get("metadata") or {})  # RULER's tasks: a unit per length
    except ConfigError as err:
        raise ConfigError(f"{source}: {err}") from None
    lambdas = raw["lambdas"]
    if not isinstance(lambdas, list) or not all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in lambdas):
        raise ConfigError(f"{source}: lambdas must be a list of numbers, e.g. [0.05, 0.1, 0.2], got {lambdas!r}")
    if any(math.isnan(x) or x <= 0 or math.isinf(x) for x in lambdas):
        raise ConfigError(f"{source}: lambdas must be finite and > 0 (baseline and sink are cells of their own), got {lambdas}")
    raw["lambdas"] = sorted({float(x) for x in lambdas})
    static = raw.get("static", {})
    if not lambdas and static not in (False, None):
        raise ConfigError(f"{source}: lambdas is empty ([]), but the static baseline calibrates its layers on a dynamic "
                          "cell; give at least one lambda, e.g. lambdas: [0.1], or set static: false")
    if static is False or static is None:
        raw["static"] = None
    elif isinstance(static, dict):
        _check_keys(f"{source}: static", static, ["p", "lambda"])
        p, lam = static.get("p", 0.8), static.get("lambda", raw["lambdas"][len(raw["lambdas"]) // 2] if raw["lambdas"] else 0.1)
        if not (isinstance(p, (int, float)) and 0 < p <= 1):
            raise ConfigError(f"{source}: static.p={p!r} must be in (0, 1], e.g. 0.8")
        if float(lam) not in raw["lambdas"]:
            raise ConfigError(f"{source}: static.lambda={lam} must be one of lambdas {raw['lambdas']} "
                              "(static layers are calibrated on that dynamic cell)")
        raw["static"] = StaticBaseline(p=float(p), lam=float(lam))
    else:
        raise ConfigError(f"{source}: static must be a mapping like {{p: 0.8, lambda: 0.1}} or false, got {static!r}")
    gammas = raw.get("gammas", [])
    if not isinstance(gammas, list) or not all(isinstance(g, int) and not isinstance(g, bool) and g >= 1
                                               for g in gammas):
        raise ConfigError(f"{source}: gammas must be a list of draft lengths (integers >= 1), e.g. [2, 4], "
                          f"got {gammas!r}")
    raw["gammas"] = sorted(set(gammas))
    if not isinstance(raw.get("model_args", {}), dict):
        raise ConfigError(f"{source}: model_args must be a mapping, e.g. {{pretrained: smollm2, dtype: float32}}")
    if "batch_size" in raw and (not isinstance(raw["batch_size"], int) or isinstance(raw["batch_size"], bool)
                                or raw["batch_size"] < 1):
        raise ConfigError(f"{source}: batch_size={raw['batch_size']!r} must be an integer >= 1")
    window = raw.get("window", 128)
    given = window if isinstance(window, list) else [window]
    if not given or any(not isinstance(w, int) or isinstance(w, bool) or w < 1 for w in given):
        raise ConfigError(f"{source}: window={window!r} must be an integer >= 1 or a list of them (a budget axis), "
                          "e.g. window: [16, 32]")
    if isinstance(window, list):
        raw["window"] = sorted(set(window))
    limit = raw.get("limit")
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, (int, float)) or limit <= 0
                              or (isinstance(limit, float) and limit > 1 and not limit.is_integer())):
        raise ConfigError(f"{source}: limit={limit!r} must be a number of samples (an integer >= 1) or a fraction "
                          "in (0, 1], e.g. limit: 8")
    samples = raw.get("samples")
    if samples is not None:
        if limit is not None:
            raise ConfigError(f"{source}: limit and samples both choose documents; give one of them")
        if not isinstance(samples, dict) or not all(
                isinstance(ids, list) and all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids)
                for ids in samples.values()):
            raise ConfigError(f"{source}: samples must map each task to a list of doc_ids, e.g. {{alspec_recall: [0, 3]}}")
    schedules = raw.get("schedules", [])
    if not isinstance(schedules, list) or not all(isinstance(p, str) for p in schedules):
        raise ConfigError(f"{source}: schedules must be a list of lambda_schedule files, got {schedules!r}")
    for path in schedules:
        LambdaSchedule.load(path)  # each mistake in one line, before anything loads
    for key in ("num_fewshot", "seed"):
        if raw.get(key) is not None and (isinstance(raw[key], bool) or not isinstance(raw[key], int) or raw[key] < 0):
            raise ConfigError(f"{source}: {key}={raw[key]!r} must be an integer >= 0")
    for key in ("gen_kwargs", "metadata", "metrics"):
        if raw.get(key) is not None and not isinstance(raw[key], dict):
            raise ConfigError(f"{source}: {key} must be a mapping, got {raw[key]!r}")
    if "window_align" in raw and raw["window_align"] not in (1, 32):
        raise ConfigError(f"{source}: window_align={raw['window_align']!r} must be 1 or 32")
    _check_engine(raw, source)
    _check_approximations(raw, source)
    if raw["engine"] == "vllm":
        _check_paged(raw["approx"], source)
    return SweepConfig(**raw)


def _check_paged(approx: list[Approximation], source: str) -> None:
    """Every approximation of a vLLM sweep runs inside vLLM (none reads what only the HF engine's layer has)."""
    from ..vllm.checks import check_runs_in_vllm

    for a in approx:
        check_runs_in_vllm(a, f"{source}: ")


ENGINES = {"hf": "alspec", "vllm": "alspec-vllm"}  # a sweep's engine -> the lm-eval model it runs


def _check_engine(raw: dict[str, Any], source: str) -> None:
    """``engine: vllm``, or ``model: alspec-vllm`` as lm-eval names it; one engine per sweep. What vLLM cannot do
    per cell is refused here, before any engine starts."""
    model = raw.pop("model", None)
    engine = raw.get("engine", "hf")
    by_model = {v: k for k, v in ENGINES.items()}
    if model is not None and model not in by_model:
        raise ConfigError(f"{source}: model={model!r} is not one a sweep runs; use {' or '.join(by_model)}")
    if engine not in ENGINES:
        raise ConfigError(f"{source}: engine={engine!r} is unknown; use hf (--model alspec) or vllm (--model "
                          "alspec-vllm)")
    if model is not None and "engine" in raw and by_model[model] != engine:
        raise ConfigError(f"{source}: model={model} and engine={engine} name two engines; a sweep runs every cell on "
                          "one, so give one of them (run a second sweep for the other engine)")
    raw["engine"] = engine = by_model.get(model, engine)
    if engine != "vllm":
        return
    if raw.get("gammas"):
        raise ConfigError(f"{source}: gammas={raw['gammas']}: self-speculation rows run on engine hf only; drop "
                          "gammas or run them in an hf sweep")
    from ..vllm.checks import HF_ONLY

    for key in HF_ONLY:
        if key in raw.get("model_args", {}):
            raise ConfigError(f"{source}: model_args {key}={raw['model_args'][key]} is --model alspec's ({HF_ONLY[key]}); "
                              "drop it for engine: vllm")
    for key in ("device", "batch_size"):
        if key in raw:
            raise ConfigError(f"{source}: {key} is the hf engine's; with engine: vllm give vLLM's own in model_args "
                              "(tensor_parallel_size, max_num_seqs, ...)")


def _check_approximations(raw: dict[str, Any], source: str) -> None:
    """approx: a list of approximations (names or pkg.module:Class), approx_args: {name: their arguments}, or {name:
    [arguments, ...]} for that approximation once per setting, in order; each valid with the sweep's window and
    model_args (backend, kernel). ``raw["approx"]`` becomes the objects, one per setting."""
    approx = raw.get("approx", [DEFAULT])
    if isinstance(approx, str):
        approx = [approx]
    if not isinstance(approx, list) or not approx or not all(isinstance(a, str) for a in approx):
        raise ConfigError(f"{source}: approx must be a list of approximations, e.g. [sink, quest, topk], got {approx!r}")
    approx = list(dict.fromkeys(approx))
    given = raw.pop("approx_args", None) or {}
    if not isinstance(given, dict) or set(given) - set(approx):
        raise ConfigError(f"{source}: approx_args={given!r} must map approximations of approx ({', '.join(approx)}) "
                          "to their arguments, e.g. approx_args: {quest: {page: 16}}, or to a list of them, one "
                          "setting each, e.g. {quest: [{page: 8}, {page: 16}]}")
    ours = {k: v for k, v in raw.get("model_args", {}).items() if k in MODEL_ARGS}
    if "approx" in ours or "approx_args" in ours:
        raise ConfigError(f"{source}: model_args approx/approx_args: a sweep's approximations are its approx and "
                          "approx_args keys; move them there")
    made: list[Approximation] = []
    given_as: dict[Approximation, tuple[str, Any]] = {}  # each object's name and setting as the config gives them
    window = raw.get("window", 128)
    for name in approx:
        for setting in _settings(name, given.get(name), source):
            for w in window if isinstance(window, list) else [window]:
                args = {**ours, "window": w, "window_align": raw.get("window_align", 1), "approx": name,
                        "approx_args": setting}
                try:
                    config = SpeculationConfig.from_model_args(args)[0]
                except ConfigError as err:
                    raise ConfigError(f"{source}: {err}") from None
            _check_distinct(config.approx, (name, setting), given_as, source)
            made.append(config.approx)
    raw["approx"] = made


def _settings(name: str, given: Any, source: str) -> list[Any]:
    """``approx_args``'s value for ``name`` as a list of settings: a list is one setting per entry (a mapping, or
    ``key:value;...``), anything else the one setting (None: the defaults)."""
    if not isinstance(given, list):
        return [given]
    if not given:
        raise ConfigError(f"{source}: approx_args {name}: [] lists no setting; give one mapping of its parameters per "
                          f"setting, e.g. quest: [{{page: 8}}, {{page: 16}}], or drop {name} for its defaults")
    for setting in given:
        if not isinstance(setting, (dict, str)):
            raise ConfigError(f"{source}: approx_args {name}: {setting!r} in the list is not a setting; give each as a "
                              "mapping of its parameters, e.g. quest: [{page: 8}, {page: 16}]")
    return given


def _check_distinct(approx: Approximation, given: tuple[str, Any], seen: dict[Approximation, tuple[str, Any]],
                    source: str) -> None:
    """Every approximation of a sweep is a row set of its own: none twice (two settings that make one, defaults
    filled in), and no two under one cell file name or label. ``seen`` gains ``approx``."""
    name, setting = given
    if approx in seen:
        other, before = seen[approx]
        if other == name:
            raise ConfigError(f"{source}: approx_args {name}: {setting!r} is the setting {before!r} again "
                              f"({approx.label}); list each setting once")
        raise ConfigError(f"{source}: approx {name!r} is {other!r} again ({approx.label}); list it once")
    for known in seen:
        if known.slug == approx.slug or known.label == approx.label:
            shared = f"cell name {approx.slug}" if known.slug == approx.slug else f"label {approx.label}"
            raise ConfigError(f"{source}: approx {_as_given(*given)} and {_as_given(*seen[known])} share the {shared}, "
                              "so their cells would overwrite each other; give values that the name tells apart")
    seen[approx] = given


def _as_given(name: str, setting: Any) -> str:
    """An approximation as the config gives it, for messages: "quest {'page': 8}", "sink"."""
    return name if setting is None else f"{name} {setting!r}"


def fingerprint(config: SweepConfig, task: str, row: Row) -> dict[str, Any]:
    """Everything that decides a cell's numbers: a cell is reused only when a rerun's fingerprint equals it."""
    out = {"task": task, "cell": row.name, "model_args": config.model_args, "window": config.window_of(row),
           "window_align": config.window_align, "limit": config.limit, "num_fewshot": config.num_fewshot,
           **({"samples": config.samples.get(task)} if config.samples is not None else {}),
           "apply_chat_template": config.apply_chat_template, "gen_kwargs": config.gen_kwargs,
           "metadata": unit_metadata(task, config.metadata), "seed": config.seed,
           **({"engine": config.engine} if config.engine != "hf" else {})}  # hf cells keep their fingerprints
    if row.calibrated and config.static is not None:
        out["static"] = {"p": config.static.p, "lambda": config.static.lam}
    return json.loads(json.dumps(out, sort_keys=True, default=str))


def load_config(path: str | Path, overrides: dict[str, Any] | None = None) -> SweepConfig:
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"sweep config {str(path)!r} does not exist; pass a YAML file such as configs/demo.yaml")
    try:
        raw = yaml.safe_load(path.read_text())
    except yaml.YAMLError as err:
        raise ConfigError(f"{path}: not valid YAML ({err})") from None
    return parse_config({**(raw or {}), **(overrides or {})}, source=str(path))


def parse_model_args(text: str, flag: str = "--model_args") -> dict[str, str]:
    """lm-eval's ``key=value,key=value`` model_args string of a command line."""
    pairs = [item.split("=", 1) for item in text.split(",") if item]
    if any(len(p) != 2 for p in pairs):
        raise ConfigError(f"{flag} {text!r}: write key=value pairs separated by commas, e.g. pretrained=smollm2")
    return dict(pairs)
