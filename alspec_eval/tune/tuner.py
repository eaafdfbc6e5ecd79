"""alspec-tune's runs: calibration and held-out documents, candidates as sweep cells, the choice and its validation.

Every run is a cell of a sweep folder under the output (``calibration/``, ``candidates/``, ``heldout/``), so an
interrupted tune resumes without redoing a finished run, and the search, deterministic given the cells, takes the
same path again. The model loads once.
"""

from __future__ import annotations

import dataclasses
import json
import math
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tqdm.auto import tqdm

from ..atomic_json import write_json_atomic
from ..config import ConfigError
from ..latency import LatencyModel, project_layers
from ..rows import BASELINE, Row
from ..schedule import LambdaSchedule
from ..stats import OpenLoop, open_loop
from ..sweep.config import SweepConfig
from .search import Measured, Search, best, schedule_path, start_step

if TYPE_CHECKING:  # lm-eval's import is slow: only where a tune runs
    from lm_eval.tasks import TaskManager


@dataclass(frozen=True)
class TunePlan:
    """What to tune: the sweep settings (tasks, model, window, the uniform lambdas to beat), the budget, the latency
    model, the split, and where it all goes."""

    base: SweepConfig
    max_drop: float
    latency: LatencyModel
    holdout: float = 0.5
    steps: int = 6
    output: Path = Path("results/tune")
    recompute: bool = False  # runs made with other settings are recomputed instead of refused


def split_documents(counts: dict[str, int], holdout: float, seed: int) -> tuple[dict[str, list[int]],
                                                                                 dict[str, list[int]]]:
    """Per task, its doc_ids 0..n-1 split at random (seeded per task) into calibration and held-out."""
    calibration, held = {}, {}
    for task, n in counts.items():
        ids = list(range(n))
        random.Random(f"{seed}:{task}").shuffle(ids)
        k = round(holdout * n)
        if k == 0 or k == n:
            raise ConfigError(f"--holdout {holdout} leaves {'no' if k == 0 else 'all'} of {task}'s {n} documents "
                              "held out; use a fraction that keeps some on both sides, or raise --limit")
        held[task], calibration[task] = sorted(ids[:k]), sorted(ids[k:])
    return calibration, held


def document_counts(config: SweepConfig, tasks: TaskManager) -> dict[str, int]:
    """How many documents of each task a run with ``config.limit`` evaluates (lm-eval's rule: an integer limit caps
    the count, a fraction takes its ceiling share), loaded through the tune's task index ``tasks``."""
    counts = {}
    for task in config.tasks:
        loaded = tasks.load_task_or_group([task])
        obj = loaded.get(task)
        if obj is None or not hasattr(obj, "eval_docs"):
            raise ConfigError(f"tasks: {task!r} is a group; name its tasks (alspec-tune splits each task's documents)")
        n = len(obj.eval_docs)
        limit = config.limit
        counts[task] = n if limit is None else min(n, int(limit) if limit >= 1 else math.ceil(n * limit))
    return counts


@dataclass
class Tuner:
    """Runs the plan: ``lm`` is loaded once for every run."""

    plan: TunePlan
    tasks: TaskManager  # lm-eval's task index, shared by every sweep of the tune (runner.task_manager)
    lm: Any = None
    calibration_docs: dict[str, list[int]] = field(default_factory=dict)
    heldout_docs: dict[str, list[int]] = field(default_factory=dict)
    candidates: list[str] = field(default_factory=list)  # schedule files run on the calibration documents

    # ------------------------------------------------------------------ runs

    def sweep(self, name: str, **changes: Any) -> Path:
        """Run (or resume) one sweep folder of the tune with the plan's settings and ``changes``."""
        from ..sweep.runner import build_lm, run_sweep

        config = dataclasses.replace(self.plan.base, name=f"{self.plan.base.name}_{name}",
                                     output=str(self.plan.output / name), limit=None, **changes)
        if self.lm is None:
            self.lm = build_lm(config)
        return run_sweep(config, lm=self.lm, recompute=self.plan.recompute, tasks=self.tasks)

    def calibrate(self) -> Path:
        return self.sweep("calibration", samples=self.calibration_docs, always=False, static=None, gammas=[])

    def run_candidate(self, lambdas: list[float]) -> Row:
        """One schedule on the calibration documents (a tuned row of ``candidates/``)."""
        schedule = LambdaSchedule.of(lambdas)
        path = self.plan.output / "candidates" / "schedules" / f"{schedule.digest[:16]}.json"
        if not path.exists():
            write_json_atomic(path, schedule.to_json())
        if str(path) not in self.candidates:
            self.candidates.append(str(path))
        self.sweep("candidates", samples=self.calibration_docs, lambdas=[], baseline=False, always=False, static=None,
                   gammas=[], schedules=list(self.candidates), shared_prefill=False)
        return Row.tuned(LambdaSchedule.load(path))

    def validate(self, schedule_file: Path) -> Path:
        return self.sweep("heldout", samples=self.heldout_docs, gammas=[], schedules=[str(schedule_file)])

    # ------------------------------------------------------------------ judging cells

    def measure(self, folder: Path, row: Row) -> Measured:
        """A row's cells in ``folder`` against that folder's baseline (or calibration's): the budget on every task
        (the lower end of the paired bootstrap interval of the score difference), and the projected speedup from
        the measured per-layer hit rates (mean over tasks)."""
        from ..report.cells import load_sweep
        from ..report.frames import document_scores, paired_difference

        cells = load_sweep(folder)
        baselines = cells if cells.cell(self.plan.base.tasks[0], BASELINE) is not None else load_sweep(
            self.plan.output / "calibration")
        details, speedups = {}, []
        for task in self.plan.base.tasks:
            cell, base = cells.cell(task, row), baselines.cell(task, BASELINE)
            diff = paired_difference(document_scores(cell), document_scores(base), False)
            projection, _ = project_layers(self.plan.latency, cell.layer_hit_rates())
            speedups.append(projection.speedup)
            details[task] = {"score": cell.score, "baseline": base.score, "diff": diff["diff"],
                             "diff_low": diff["diff_low"], "diff_high": diff["diff_high"], "n": diff["n_paired"],
                             "hit_rate": cell.hit_rate, "layer_hit_rates": cell.layer_hit_rates(),
                             "speedup": projection.speedup}
        feasible = all(d["diff_low"] >= -self.plan.max_drop for d in details.values())
        return Measured(feasible, sum(speedups) / len(speedups), details)

    def curves(self, folder: Path) -> list[OpenLoop]:
        """Open-loop curves per layer from the smallest uniform lambda's cells, histograms summed over tasks."""
        from ..report.cells import load_sweep

        sweep = load_sweep(folder)
        cells = [sweep.dynamic_cells(task)[0] for task in self.plan.base.tasks]
        hists = [[sum(h) for h in zip(*(c.layers[layer].hist for c in cells))] for layer in range(len(cells[0].layers))]
        return [open_loop(h) for h in hists]

    # ------------------------------------------------------------------ the whole tune

    def run(self) -> dict[str, Any]:
        plan = self.plan
        calibration = self.calibrate()
        curves = self.curves(calibration)
        num_layers = len(curves)
        options: list[Candidate] = [Candidate(f"λ = {lam:g}", [lam] * num_layers,
                                              self.measure(calibration, Row.dynamic(lam)))
                                    for lam in plan.base.lambdas]
        best_uniform = best([(c.name, c.measured) for c in options])
        hit = 0.0
        if best_uniform is not None:
            rates = [d["hit_rate"] or 0.0 for d in best_uniform[1].details.values()]
            hit = sum(rates) / len(rates)
        path = schedule_path(curves)
        start = start_step(path, curves, hit)
        progress = tqdm(total=plan.steps, desc="alspec-tune: candidates", unit="candidate")

        def evaluate(lambdas: list[float]) -> Measured:
            row = self.run_candidate(lambdas)
            measured = self.measure(plan.output / "candidates", row)
            progress.set_postfix_str(f"{row.label}: {'meets' if measured.feasible else 'misses'} the budget, "
                                     f"{measured.speedup:.3f}x")
            progress.update()
            return measured

        search = Search(path, evaluate)
        search.run(plan.steps, start)
        progress.close()
        options += [Candidate(f"path step {step} of {len(path) - 1}", lambdas, measured, step)
                    for step, lambdas, measured in search.tried]
        feasible = [c for c in options if c.measured.feasible]
        if not feasible:
            raise ConfigError(f"no candidate met the budget (--max_drop {plan.max_drop}) on the calibration documents, "
                              "not even the smallest uniform lambda; raise --max_drop or add a smaller lambda")
        chosen = max(feasible, key=lambda c: c.measured.speedup)
        schedule_file = plan.output / "schedule.json"
        write_json_atomic(schedule_file, LambdaSchedule.of(chosen.lambdas).to_json())
        heldout = self.validate(schedule_file)
        held = {"tuned": self.measure(heldout, Row.tuned(LambdaSchedule.load(schedule_file)))}
        held.update({f"λ = {lam:g}": self.measure(heldout, Row.dynamic(lam)) for lam in plan.base.lambdas})
        best_held = best([(k, m) for k, m in held.items() if k != "tuned"])
        return {
            "max_drop": plan.max_drop, "preset": plan.latency.name, "holdout": plan.holdout, "seed": plan.base.seed,
            "documents": {"calibration": self.calibration_docs, "heldout": self.heldout_docs},
            "path": {"steps": len(path), "start": start},
            "candidates": [c.to_dict() for c in options],
            "chosen": {**chosen.to_dict(), "file": str(schedule_file)},
            "heldout": {name: {"feasible": m.feasible, "speedup": m.speedup, "tasks": m.details}
                        for name, m in held.items()},
            "best_uniform_heldout": best_held[0] if best_held else None,
        }


@dataclass(frozen=True)
class Candidate:
    """A schedule run on the calibration documents: a uniform lambda, or a step of the search's path."""

    name: str
    lambdas: list[float]
    measured: Measured
    step: int | None = None

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "lambdas": self.lambdas, "step": self.step, "feasible": self.measured.feasible,
                "speedup": self.measured.speedup, "tasks": self.measured.details}


def summary_markdown(result: dict[str, Any]) -> str:
    """tune.md: the choice, and the held-out comparison with the best uniform lambda that met the budget there."""
    held, budget = result["heldout"], result["max_drop"]
    tuned = held["tuned"]
    lines = [f"# alspec-tune: {result['chosen']['name']}", "",
             f"Budget: score drop at most {budget} (lower end of the paired 95% bootstrap interval, every task); "
             f"latency model {result['preset']} (projected speedups are the paper's latency model on measured "
             "per-layer hit rates, not measured speed).", "",
             f"Schedule: `{result['chosen']['file']}` "
             f"(lambdas {', '.join(f'{x:g}' for x in result['chosen']['lambdas'])}).", "",
             "Held-out documents (never seen by the search):", "",
             "| row | meets budget | projected speedup | " + " | ".join(
                 f"{t}: diff [95%], hit rate" for t in tuned["tasks"]) + " |",
             "| --- | --- | --- | " + " | ".join("---" for _ in tuned["tasks"]) + " |"]
    for name, m in held.items():
        cells = [f"{d['diff']:+.3f} [{d['diff_low']:+.3f}, {d['diff_high']:+.3f}], "
                 f"{100 * (d['hit_rate'] or 0):.1f}%" for d in m["tasks"].values()]
        lines.append(f"| {name} | {'yes' if m['feasible'] else 'no'} | {m['speedup']:.3f}x | " + " | ".join(cells) + " |")
    best_uniform = result["best_uniform_heldout"]
    lines += ["", (f"Best uniform lambda within the budget on the held-out documents: {best_uniform} "
                   f"({held[best_uniform]['speedup']:.3f}x); the tuned schedule: {tuned['speedup']:.3f}x, "
                   f"{'within' if tuned['feasible'] else 'NOT within'} the budget."
                   if best_uniform else "No uniform lambda met the budget on the held-out documents."),
              "", f"Candidates tried on the calibration documents: {len(result['candidates'])} (tune.json)."]
    return "\n".join(lines) + "\n"


def write_outputs(output: Path, result: dict[str, Any]) -> list[Path]:
    tune_json = write_json_atomic(output / "tune.json", json.loads(json.dumps(result, default=str)))
    md = output / "tune.md"
    md.write_text(summary_markdown(result))
    return [output / "schedule.json", tune_json, md]
