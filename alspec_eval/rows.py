"""The rows of a sweep (the paper's Table 1): one small frozen record that the sweep config, its runner, the shared
prefill, the report and the needle figures hand around. A row knows its cell's file name, its label, the settings it
runs with and what its cell file records; no name is ever parsed back into a row.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from .approximations import DEFAULT, Approximation, default_approximation, make_approximation
from .config import SpeculationConfig, canonical_policy
from .schedule import DEFAULT_LAMBDA, LambdaSchedule

# The paper's row order, then token-level self-speculation, then a tuned per-layer schedule (alspec-tune).
KINDS: tuple[str, ...] = ("baseline", "dynamic", "always", "static", "selfspec", "tuned")
POLICY_OF_KIND = {"baseline": "exact", "dynamic": "dynamic", "always": "always", "static": "static",
                  "selfspec": "selfspec", "tuned": "dynamic"}
# A~ always (kind "always", lambda = inf) of the default approximation is the paper's pure attention-sink baseline,
# named "sink" as the paper names it; of another approximation it is no sink: that approximation accepted unverified,
# named by what it is ("inf_quest_p16", "λ = ∞ · quest P=16"). Its cells of before keep "sink_".
SINK_NAME, INF_NAME, INF_LABEL = "sink", "inf", "λ = ∞"


@dataclass(frozen=True)
class Row:
    """Baseline (exact), one lambda (dynamic), A~ always (lambda = inf: the pure sink), the static layer baseline, token-level
    self-speculation with draft length ``gamma``, or a per-layer lambda ``schedule`` (tuned). Every kind but the
    baseline takes A~ from an Approximation ``approx`` (None: the registry's default, the sink windows; a name is
    made into one where it is read: config, cell files), with a budget of 2 ``window`` keys where a sweep has
    several (None: the sweep's one)."""

    kind: str
    lam: float | None = None  # dynamic rows only
    gamma: int | None = None  # selfspec rows only
    schedule: LambdaSchedule | None = field(default=None, compare=False)  # tuned rows only (compared by digest)
    digest: str | None = None  # the schedule's, which identifies a tuned row
    approx: Approximation | None = None
    window: int | None = None

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"row kind {self.kind!r} is not one of {', '.join(KINDS)}")
        if (self.kind == "dynamic") != (self.lam is not None):
            raise ValueError(f"a {self.kind} row {'needs' if self.kind == 'dynamic' else 'takes no'} lambda")
        if (self.kind == "selfspec") != (self.gamma is not None):
            raise ValueError(f"a {self.kind} row {'needs' if self.kind == 'selfspec' else 'takes no'} gamma")
        if (self.kind == "tuned") != (self.schedule is not None):
            raise ValueError(f"a {self.kind} row {'needs' if self.kind == 'tuned' else 'takes no'} schedule")
        if self.approx is None:
            object.__setattr__(self, "approx", default_approximation())
        elif not isinstance(self.approx, Approximation):
            raise TypeError(f"a row's approx is an Approximation, not {self.approx!r}; make one with "
                            "alspec_eval.approximations.make_approximation(name, args)")
        if self.kind == "baseline" and (not self.approx.is_default or self.window is not None):
            raise ValueError(f"a baseline row cannot take approx {self.approx.label!r} or a window")
        if self.lam is not None:
            object.__setattr__(self, "lam", float(self.lam))
        if self.schedule is not None:
            object.__setattr__(self, "digest", self.schedule.digest)

    @classmethod
    def dynamic(cls, lam: float, approx: Approximation | None = None) -> Row:
        return cls("dynamic", lam=lam, approx=approx)

    @classmethod
    def selfspec(cls, gamma: int, approx: Approximation | None = None) -> Row:
        return cls("selfspec", gamma=int(gamma), approx=approx)

    @classmethod
    def tuned(cls, schedule: LambdaSchedule, approx: Approximation | None = None) -> Row:
        return cls("tuned", schedule=schedule, approx=approx)

    def approximated(self, approx: Approximation | None, window: int | None = None) -> Row:
        """The same row with A~ from ``approx`` (None: the default) and a budget of 2 ``window`` keys of its own."""
        return replace(self, approx=approx, window=window)

    # ------------------------------------------------------------------ names

    @property
    def name(self) -> str:
        """The cell's file name (``cells/<task>/<name>.json``): the kind's, then its approximation's slug and its
        window (:attr:`name_suffix`); the default approximation's rows keep the paper's names ("lambda_0.1", "sink")."""
        if self.kind == "dynamic":
            name = f"lambda_{self.lam:g}"
        elif self.kind == "selfspec":
            name = f"selfspec_g{self.gamma}"
        elif self.kind == "tuned":
            name = f"tuned_{self.digest[:10]}"
        elif self.kind == "always":
            name = INF_NAME if self.unverified else SINK_NAME
        else:
            name = self.kind
        return name + self.name_suffix

    @property
    def name_suffix(self) -> str:
        """Its approximation's and window's part of :attr:`name`: "" (the default at the sweep's window),
        "_quest_p16", "_S32"."""
        return self._approx_suffix("_", label=False)

    @property
    def legacy_names(self) -> tuple[str, ...]:
        """The names its cell file had before, which a sweep resumes from and the report reads: a λ = ∞ row of an
        approximation other than the default was "sink_<slug>" (now "inf_<slug>")."""
        return (SINK_NAME + self.name_suffix,) if self.unverified else ()

    @property
    def file_names(self) -> tuple[str, ...]:
        """Its name, then its :attr:`legacy_names`."""
        return (self.name, *self.legacy_names)

    def cell_file(self, folder: Path) -> Path:
        """Its cell file in ``folder`` (``cells/<task>``): under its name, else under a legacy name that exists (a
        resumed sweep reuses it, a recomputed one writes it there: one file per row), else under its name."""
        return next((path for name in self.file_names if (path := folder / f"{name}.json").exists()),
                    folder / f"{self.name}.json")

    def same_cell(self, found: Any, expected: dict[str, Any]) -> bool:
        """Whether a cell file's fingerprint ``found`` is ``expected`` (this row's), the ``cell`` it records being
        any of the row's :attr:`file_names`."""
        return (isinstance(found, dict) and found.get("cell") in self.file_names
                and {**found, "cell": expected.get("cell")} == expected)

    @property
    def kind_label(self) -> str:
        """The row without its approximation and window: "λ = 0.1", "sink", "selfspec γ = 2"; A~ always of an
        approximation other than the default reads "λ = ∞" (that approximation accepted unverified, no sink)."""
        if self.kind == "dynamic":
            return f"λ = {self.lam:g}"
        if self.kind == "selfspec":
            return f"selfspec γ = {self.gamma}"
        if self.kind == "tuned":
            return f"tuned {self.digest[:6]}"
        if self.kind == "always":
            return INF_LABEL if self.unverified else SINK_NAME
        return self.kind

    @property
    def label(self) -> str:
        """How tables and figures name the row: "λ = 0.1", "sink", "λ = ∞ · quest P=16", "static · S=32"."""
        return self.kind_label + self._approx_suffix(" · ", label=True)

    @property
    def unverified(self) -> bool:
        """A~ always of an approximation other than the default: no sink (INF_NAME, INF_LABEL)."""
        return self.kind == "always" and not self.approx.is_default

    def _approx_suffix(self, sep: str, label: bool) -> str:
        suffix = self.approx.row_part(sep, label)
        if self.window is not None:
            suffix += f"{sep}S={self.window}" if label else f"{sep}S{self.window}"
        return suffix

    @property
    def order(self) -> int:
        """The row's place in Table 1 (kinds in the paper's order); rows of one kind sort by lambda or gamma."""
        return KINDS.index(self.kind)

    @property
    def policy(self) -> str:
        return POLICY_OF_KIND[self.kind]

    # ------------------------------------------------------------------ how it runs

    @property
    def shares_prefill(self) -> bool:
        """Whether the row can run on a sweep's shared exact prefill (static calibrates on the others first; an
        approximation that scores the prompt observes it from what the prefill kept)."""
        return self.kind != "static"

    @property
    def calibrated(self) -> bool:
        """The static row: its layers come from the dynamic cell at the static lambda of the same approximation."""
        return self.kind == "static"

    def calibration(self, lam: float) -> Row:
        """The dynamic row a calibrated row reads its layers from."""
        return Row.dynamic(lam, self.approx).approximated(self.approx, self.window)

    @property
    def exact_attention(self) -> bool:
        """Rows whose attention is always exact (baseline; self-speculation's verifier)."""
        return self.kind in ("baseline", "selfspec")

    @property
    def by_lambda(self) -> bool:
        """Rows that decide by a lambda, one or a schedule's per layer (their token traces are worth drawing)."""
        return self.kind in ("dynamic", "tuned")

    @property
    def drafts_tokens(self) -> bool:
        """Token-level self-speculation: a draft-acceptance rate (tau), no attention hit rate."""
        return self.kind == "selfspec"

    def settings(self, static_layers: tuple[int, ...] = ()) -> dict[str, Any]:
        """The speculation settings the row runs with (changes to a ``SpeculationConfig``), all of them, so a row's
        config never keeps another row's. A static row without layers runs exact: no layer reached the
        calibration's hit rate, so the exact model is that policy."""
        policy = "exact" if self.kind == "static" and not static_layers else self.policy
        return {"policy": policy, "static_layers": tuple(static_layers), "gamma": self.gamma,
                "lambda_schedule": self.schedule, "lam": self.lam if self.kind == "dynamic" else DEFAULT_LAMBDA,
                "approx": self.approx, "approx_args": None, **({"window": self.window} if self.window else {})}

    def config(self, base: SpeculationConfig, static_layers: tuple[int, ...] = ()) -> SpeculationConfig:
        """The row's own config: ``base``'s window, kernel and backend with the row's settings; its
        ``thresholds`` are the row's line of a decision plan."""
        return replace(base, **self.settings(static_layers))

    def record(self, static_layers: list[int] | None = None) -> dict[str, Any]:
        """What the row's cell file records about how it was made."""
        lam = {"dynamic": self.lam, "always": "inf"}.get(self.kind)
        out: dict[str, Any] = {"policy": self.policy, "lambda": lam, "static_layers": static_layers}
        if self.kind == "selfspec":
            out["gamma"] = self.gamma
        if self.kind == "tuned":
            out["lambda_schedule"] = self.schedule.to_dict()
        if not self.approx.is_default:
            out["approx"], out["approx_args"] = self.approx.name, self.approx.args()
        if self.window is not None:
            out["window"] = self.window
        return out

    # ------------------------------------------------------------------ reading cell files

    @classmethod
    def from_record(cls, policy: str, lam: Any = None, gamma: Any = None, schedule: Any = None,
                    approx: str | None = None, approx_args: dict[str, Any] | None = None,
                    page: int | None = None, window: int | None = None) -> Row:
        """The row a cell file records (``policy``, ``lambda``, ``gamma``, ``lambda_schedule``, ``approx``,
        ``approx_args``, ``window`` where the sweep has several; cells before approximations were the default's, cells
        before the registry record quest's ``page`` beside it): the edge where a recorded name becomes an
        Approximation."""
        args = approx_args if approx_args is not None else ({"page": page} if page is not None else None)
        return cls._from_record(policy, lam, gamma, schedule).approximated(make_approximation(approx or DEFAULT, args),
                                                                           window)

    @classmethod
    def _from_record(cls, policy: str, lam: Any, gamma: Any, schedule: Any) -> Row:
        if policy == "dynamic" and schedule is not None:
            return cls.tuned(LambdaSchedule.from_json(schedule["schedule"], path=schedule.get("path")))
        if policy == "dynamic":
            if lam is None or lam == "inf":
                raise ValueError("a dynamic cell needs a numeric lambda")
            return cls.dynamic(float(lam))
        if policy == "selfspec":
            if gamma is None:
                raise ValueError("a selfspec cell needs its gamma")
            return cls.selfspec(int(gamma))
        kind = {"exact": "baseline", "always": "always", "static": "static"}.get(canonical_policy(policy))
        if kind is None:
            raise ValueError(f"a cell with policy {policy!r} is no row of a sweep")
        return cls(kind)


BASELINE, SINK, STATIC = Row("baseline"), Row("always"), Row("static")


def sweep_rows(lambdas: list[float], baseline: bool = True, always: bool = True, gammas: list[int] = (),
               approximations: list[Approximation | None] = (None,), windows: list[int | None] = (None,)
               ) -> list[Row]:
    """The rows of a sweep that share one exact prefill, in run order: the baseline, then per approximation (None:
    the default) and window (None: the sweep's one) its lambdas, its lambda = inf row (A~ always: the sink's is the
    paper's sink row) and its self-speculation rows."""
    return [*([BASELINE] if baseline else []),
            *(row.approximated(approx, window) for approx in approximations for window in windows
              for row in [*map(Row.dynamic, lambdas), *([SINK] if always else []), *map(Row.selfspec, gammas)])]


def prefill_groups(rows: list[Row]) -> list[list[Row]]:
    """The rows that share one exact prefill per document, in run order: every row but the static one, which
    calibrates on the others first. The shared prefill forks its cache once per approximation and window, each
    decoding in a call of its own (SharedPrefill); an approximation that scores the prompt observes it from the
    queries and inputs the prefill kept."""
    shared = [row for row in rows if row.shares_prefill]
    return [shared] if shared else []
