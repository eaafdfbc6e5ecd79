"""The board: per task and context length, each draft's best verified point, the drafts ranked by it.

A draft's best verified point is its dynamic cell (any lambda and window) with the largest projected speedup whose
score is not significantly below the baseline's on the same documents (:func:`.frames.not_worse`: the paired 95%
interval of the difference reaches 0, and McNemar does not reject for 0/1 metrics). Oracle drafts are shown and
not ranked. Where the baseline itself is not above chance (its 95% interval reaches 0, the chance of RULER's string
match), nothing is ranked: a draft cannot lose what the model never had.
"""

from __future__ import annotations

import csv
import math
from dataclasses import asdict, dataclass
from pathlib import Path

import pandas as pd

from ..approximations import Approximation
from ..ruler import split_unit
from .cells import BASELINE, Sweep
from .figures import _figure
from .frames import CHANCE, ROUTINES, args_text, baseline_interval, not_worse
from .styles import ORACLE_MARK, approx_label, oracle_note

@dataclass(frozen=True)
class Entry:
    """One draft's best verified point in one (task, length); ``rank`` None for an oracle or no verified point."""

    task: str
    length: int | None
    approx: Approximation
    rank: int | None
    speedup: float  # NaN: no cell of this draft is free of a significant loss
    lam: float
    window: int
    hit_rate: float
    diff: float
    diff_low: float
    diff_high: float
    n: int
    engine: str = ""  # what ran its best cell (hf or vllm); none where no cell is verified
    promise_dn: float = math.nan  # a promising draft's realized shares in its best cell (NaN: it promises nothing)
    promise_denominator: float = math.nan


@dataclass(frozen=True)
class Unit:
    """One (task, length) of the board, with its baseline and whether it is above chance."""

    task: str
    length: int | None
    baseline: float
    baseline_low: float
    baseline_high: float
    n: int
    entries: tuple[Entry, ...]

    @property
    def ranks(self) -> bool:
        return self.baseline_low > CHANCE


def board(sweep: Sweep, cells: pd.DataFrame, documents: pd.DataFrame,
          speedups: dict[tuple[str, str], float]) -> list[Unit]:
    """The board of a sweep's frames; ``speedups`` maps (task, row label) to the latency model's projection."""
    units = []
    for task in sweep.tasks:
        group = cells[cells["task"] == task]
        mean, low, high = baseline_interval(cells, documents, task)
        if math.isnan(mean):
            continue
        n = int(group.loc[group["row"] == BASELINE.label, "n"].iloc[0])
        dynamic = group[(group["policy"] == "dynamic") & group["lambda"].notna()]
        dynamic = dynamic.assign(speedup=[speedups.get((task, r), math.nan) for r in dynamic["row"]])
        found = []
        for approx in sweep.approximations:
            mine = dynamic[(dynamic["approx"] == approx.name) & (dynamic["approx_args"] == args_text(approx))]
            if mine.empty:
                continue
            ok = mine[not_worse(mine) & mine["speedup"].notna()]
            found.append(_entry(task, approx, ok.loc[ok["speedup"].idxmax()] if not ok.empty else None))
        ranked = sorted((e for e in found if not e.approx.oracle and not math.isnan(e.speedup)),
                        key=lambda e: -e.speedup)
        ranks = {id(e): i + 1 for i, e in enumerate(ranked)} if low > CHANCE else {}
        entries = sorted((_ranked(e, ranks.get(id(e))) for e in found),
                         key=lambda e: (e.rank is None, -e.speedup if not math.isnan(e.speedup) else math.inf))
        name, length = split_unit(task)
        units.append(Unit(name, length, mean, low, high, n, tuple(entries)))
    return units


def _entry(task: str, approx: Approximation, best: pd.Series | None) -> Entry:
    name, length = split_unit(task)
    if best is None:
        return Entry(name, length, approx, None, math.nan, math.nan, 0, math.nan, math.nan, math.nan, math.nan, 0)
    return Entry(name, length, approx, None, float(best["speedup"]), float(best["lambda"]), int(best["window"]),
                 float(best["hit_rate"]), float(best["diff"]), float(best["diff_low"]), float(best["diff_high"]),
                 int(best["n_paired"]), str(best["engine"]), float(best.get("promise_dn", math.nan)),
                 float(best.get("promise_denominator", math.nan)))


def _ranked(entry: Entry, rank: int | None) -> Entry:
    return Entry(**{**asdict(entry), "approx": entry.approx, "rank": rank})


TITLE = "Which draft buys the most verified speed"
PROMISE_NOTE = ("A draft that promises its error (ε, δ: vAttention's) shows in its best cell the share of decisions "
                "whose d/n exceeded ε and of (decision, query head) pairs whose softmax denominator its selection "
                "missed by more than ε of it (D), measured against exact attention; the promise holds where both "
                "stay below δ. Empty for a draft that promises nothing.")
NOTE = ("Per task and context length, each draft's best verified point: its cell (any λ and S) with the largest "
        "projected speedup (an ESTIMATE of the latency model, {model}) whose score is not significantly below the "
        "baseline's on the same documents (paired 95% bootstrap interval of the difference reaching 0; McNemar's "
        "exact test for 0/1 scores). Drafts are ranked by it; an oracle ({mark}) is shown, not ranked. " + ROUTINES)


def _heading(unit: Unit) -> str:
    length = f", {unit.length} tokens" if unit.length is not None else ""
    return (f"## {unit.task}{length}: baseline {unit.baseline:.3f} [{unit.baseline_low:.3f}, "
            f"{unit.baseline_high:.3f}], n = {unit.n}")


ENGINE_NAMES = {"hf": "hf (--model alspec)", "vllm": "vLLM (--model alspec-vllm)"}


def board_markdown(units: list[Unit], model: str) -> str:
    engines = sorted({e.engine for u in units for e in u.entries if e.engine})
    ran = f"Cells run on {', '.join(ENGINE_NAMES.get(e, e) for e in engines)}." if engines else ""
    promised = any(e.approx.promise() is not None for u in units for e in u.entries)  # its columns, else none
    lines = [f"# {TITLE}", "", NOTE.format(model=model, mark=ORACLE_MARK) + (f" {ran}" if ran else "")
             + (f" {PROMISE_NOTE}" if promised else ""), ""]
    for unit in units:
        lines += [_heading(unit), ""]
        if not unit.ranks:
            lines += [f"The baseline is not above chance ({CHANCE:g}): a draft cannot lose what the model never had, "
                      "so nothing is ranked.", ""]
        extra = (" ε missed: d/n | ε missed: D |", " --- | --- |") if promised else ("", "")
        lines += ["| rank | draft | engine | projected speedup | λ | S | hit rate |" + extra[0]
                  + " Δ score [95% CI] | n |",
                  "| --- | --- | --- | --- | --- | --- | --- |" + extra[1] + " --- | --- |"]
        for e in unit.entries:
            name = e.approx.label + (f" {ORACLE_MARK}" if e.approx.oracle else "")
            if math.isnan(e.speedup):
                lines.append(f"| – | {name} | | no cell without a significant loss | | | |"
                             + (" | |" if promised else "") + " | |")
                continue
            shares = "".join(f" {'' if math.isnan(x) else f'{100 * x:.1f}%'} |"
                             for x in (e.promise_dn, e.promise_denominator)) if promised else ""
            lines.append(f"| {e.rank or '–'} | {name} | {e.engine} | {e.speedup:.2f}× | {e.lam:g} | {e.window} | "
                         f"{100 * e.hit_rate:.1f}% |{shares} {e.diff:+.3f} [{e.diff_low:+.3f}, {e.diff_high:+.3f}] | "
                         f"{e.n} |")
        lines.append("")
    notes = dict.fromkeys(oracle_note(e.approx) for u in units for e in u.entries if e.approx.oracle)
    return "\n".join([*lines, *(f"{ORACLE_MARK} {n}" for n in notes)]).rstrip() + "\n"


def write_board_csv(units: list[Unit], path: Path) -> Path:
    fields = ["task", "length", "approx", "approx_args", "oracle", "rank", "speedup", "lam", "window", "hit_rate",
              "diff", "diff_low", "diff_high", "n", "baseline", "baseline_low", "baseline_high", "ranked", "engine"]
    if any(e.approx.promise() is not None for u in units for e in u.entries):  # a promising draft's shares
        fields += ["promise_dn", "promise_denominator"]
    with path.open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=fields)
        writer.writeheader()
        for unit in units:
            for e in unit.entries:
                row = {k: v for k, v in asdict(e).items() if k in fields}
                writer.writerow({**row, "approx": e.approx.name,
                                 "approx_args": args_text(e.approx),
                                 "oracle": e.approx.oracle, "baseline": unit.baseline,
                                 "baseline_low": unit.baseline_low, "baseline_high": unit.baseline_high,
                                 "ranked": unit.ranks})
    return path


def speedup_by_length(units: list[Unit]):
    """Each draft's best verified projected speedup against the context length, a panel per task (the paper's
    claim: speedups grow with the context)."""
    tasks = list(dict.fromkeys(u.task for u in units if u.length is not None))
    fig = _figure(4.2 * max(len(tasks), 1), 3.4)
    axes = fig.subplots(1, max(len(tasks), 1), squeeze=False)[0]
    for ax, task in zip(axes, tasks):
        mine = [u for u in units if u.task == task]
        drafts = {e.approx.label: e.approx for u in mine for e in u.entries}
        for label, approx in drafts.items():
            points = sorted((u.length, e.speedup) for u in mine for e in u.entries
                            if e.approx.label == label and not math.isnan(e.speedup))
            if points:
                ax.plot(*zip(*points), marker=approx.marker, color=approx.colour, label=approx_label(approx),
                        linestyle="--" if approx.oracle else "-")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("context length (tokens)")
        ax.set_ylabel("best verified projected speedup (estimate)")
        ax.set_title(task)
        ax.legend(fontsize=7)
    return fig
