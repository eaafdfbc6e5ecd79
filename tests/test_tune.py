"""alspec-tune's search (open-loop curves, the schedule path, bisection and the choice) with a fake evaluator, the
document split, and a real tune on a tiny model that resumes to the same schedule."""

from __future__ import annotations

import json

import pytest

from alspec_eval.config import ConfigError

from alspec_eval.stats import OPEN_LOOP_GRID, RATIO_EDGES, open_loop
from alspec_eval.tune.search import Measured, Search, best, schedule_path, start_step
from alspec_eval.tune.tuner import split_documents


def _hist(centre: int, width: int = 6, total: int = 600) -> list[int]:
    """A d/n histogram with ``total`` decisions spread evenly over the bins around ``centre``."""
    hist = [0] * (len(RATIO_EDGES) + 1)
    for k in range(centre - width // 2, centre + width // 2):
        hist[k] = total // width
    return hist


CURVES = [open_loop(_hist(c)) for c in (40, 55, 70)]  # an easy, a middle and a hard layer


def test_the_path_raises_one_layer_at_a_time_from_zero_to_the_top():
    path = schedule_path(CURVES)
    assert path[0] == [0.0, 0.0, 0.0] and path[-1] == [OPEN_LOOP_GRID[-1]] * 3
    for before, after in zip(path, path[1:]):
        changed = [i for i in range(3) if after[i] != before[i]]
        assert len(changed) == 1 and after[changed[0]] > before[changed[0]]
    first = next(i for i, lambdas in enumerate(path) if lambdas[0] > 0)
    assert all(lambdas[2] == 0 for lambdas in path[:first + 1])  # the easy layer moves before the hard one


def _fake(boundary: int, path: list[list[float]], calls: list[int]):
    """Deterministic: a candidate meets the budget up to the path's step ``boundary``; speedup grows with the step."""
    def evaluate(lambdas: list[float]) -> Measured:
        step = path.index(lambdas)
        calls.append(step)
        return Measured(step <= boundary, 1 + step / len(path))
    return evaluate


def test_bisection_finds_the_last_feasible_step_and_the_choice_respects_the_budget():
    path = schedule_path(CURVES)
    boundary, calls = len(path) // 3, []
    search = Search(path, _fake(boundary, path, calls))
    search.run(steps=12)
    assert boundary in calls and boundary + 1 in calls  # the bracket closed on the boundary
    candidates = [(f"step {step}", m) for step, _, m in search.tried] + [("uniform", Measured(True, 1.01))]
    name, chosen = best(candidates)
    assert chosen.feasible and name == f"step {boundary}"
    assert all(not m.feasible for _, m in candidates if m.speedup > chosen.speedup)  # nothing faster met the budget
    assert best([("fast but over", Measured(False, 9.0))]) is None


def test_the_search_starts_where_the_best_uniform_lambda_was():
    path = schedule_path(CURVES)
    start = start_step(path, CURVES, hit_rate=0.5)
    assert 0 < start < len(path) - 1
    calls = []
    Search(path, _fake(len(path) - 1, path, calls)).run(steps=3, start=start)
    assert min(calls) > start


def test_split_is_seeded_disjoint_and_complete():
    calibration, held = split_documents({"a": 10, "b": 7}, 0.5, seed=3)
    again = split_documents({"a": 10, "b": 7}, 0.5, seed=3)
    assert (calibration, held) == again
    for task, n in (("a", 10), ("b", 7)):
        assert sorted(calibration[task] + held[task]) == list(range(n)) and not set(calibration[task]) & set(held[task])
    with pytest.raises(Exception, match="--holdout 0.01 leaves no"):
        split_documents({"a": 10}, 0.01, seed=3)


def _tune(argv: list[str]) -> int:
    """alspec-tune in this process; how many lm-eval task indexes it built."""
    from alspec_eval.tune.cli import main
    from helpers import task_managers_built

    with task_managers_built() as built:
        main(argv)
    return len(built)


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore")
def test_a_resumed_tune_gives_the_same_schedule(tmp_path):
    from alspec_eval.approx_check.models import save_tiny

    model = save_tiny(tmp_path / "model", max_positions=4096)
    out = tmp_path / "tune"
    argv = ["--tasks", "alspec_recall", "--model_args", f"pretrained={model}", "--window", "16", "--lambdas",
            "0.3,0.9", "--limit", "8", "--steps", "2", "--max_drop", "0.2", "--batch_size", "4", "--output_path",
            str(out)]
    assert _tune(argv) == 1  # one task index for the tune's task check, document counts and every sweep
    schedule = json.loads((out / "schedule.json").read_text())
    result = json.loads((out / "tune.json").read_text())
    assert result["heldout"]["tuned"]["tasks"]["alspec_recall"]["n"] == 4  # the held-out half of 8
    report = out / "heldout" / "report"
    assert "| tuned " in (report / "table1.md").read_text()  # Table 1 of the held-out documents
    assert len(list(report.glob("schedule_tuned_*.png"))) == 1  # the per-layer lambda / hit-rate figure
    cells = sorted((out / "candidates" / "cells").rglob("*.json"))
    stamps = {p: p.stat().st_mtime_ns for p in cells}
    # An interruption after the candidates: the outputs and the held-out run are gone, one candidate cell too.
    for path in (out / "schedule.json", out / "tune.json"):
        path.unlink()
    import shutil

    shutil.rmtree(out / "heldout")
    cells[-1].unlink()
    assert _tune(argv) == 1
    assert json.loads((out / "schedule.json").read_text()) == schedule
    assert json.loads((out / "tune.json").read_text())["chosen"] == result["chosen"]
    assert all(p.stat().st_mtime_ns == stamps[p] for p in cells[:-1])  # finished runs were not redone


def test_every_sweep_of_a_tune_shares_one_task_index(tmp_path, monkeypatch):
    """The calibration, candidate and held-out sweeps of a tune run through the task index (and the model) that the
    command built once, the one that checked the tasks and counted their documents."""
    from alspec_eval.sweep import runner
    from alspec_eval.tune.cli import parser, plan_from_args
    from alspec_eval.tune.tuner import Tuner

    plan = plan_from_args(parser().parse_args(["--tasks", "alspec_recall", "--max_drop", "0.1", "--output_path",
                                               str(tmp_path)]))
    loaded, given = [], []
    monkeypatch.setattr(runner, "build_lm", lambda config: loaded.append(config) or "lm")
    monkeypatch.setattr(runner, "run_sweep", lambda config, lm, recompute, tasks: given.append((lm, tasks)))
    shared = object()
    tuner = Tuner(plan, shared)
    tuner.calibrate()
    tuner.validate(tmp_path / "schedule.json")
    assert given == [("lm", shared), ("lm", shared)] and len(loaded) == 1


def test_a_config_of_other_approximations_is_refused(tmp_path):
    from alspec_eval.tune.cli import parser, plan_from_args

    config = tmp_path / "c.yaml"
    config.write_text("name: c\ntasks: [alspec_recall]\nlambdas: [0.1]\nwindow: 16\napprox: [sink, quest]\napprox_args: {quest: {page: 4}}\n")
    with pytest.raises(ConfigError, match=r"approx \['sink', 'quest P=4'\]: alspec-tune tunes the sink's lambdas"):
        plan_from_args(parser().parse_args([str(config), "--max_drop", "0.02"]))


@pytest.mark.parametrize(("max_drop", "refused"), [(0.0, False), (1.0, False), (1.0000001, True), (-0.01, True)])
def test_a_budget_no_score_can_use_is_refused(max_drop, refused):
    from alspec_eval.tune.cli import parser, plan_from_args

    args = parser().parse_args(["--tasks", "alspec_recall", "--max_drop", str(max_drop)])
    if refused:
        with pytest.raises(ConfigError, match=rf"--max_drop {max_drop}"):
            plan_from_args(args)
    else:
        assert plan_from_args(args).max_drop == max_drop
