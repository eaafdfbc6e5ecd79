"""The report beside the paper's Tables 1 and 2: a synthetic sweep whose cells carry the paper's own numbers is
reproduced everywhere; one task's scores shifted by 0.05 are flagged, with the gap named."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest

from alspec_eval.report.build import write_report
from alspec_eval.report.cells import load_sweep
from alspec_eval.report.paper import matching_table
from alspec_eval.stats import NUM_BINS

PAPER_CSV = Path(__file__).parents[1] / "data" / "paper_table1_table2.csv"  # a copy apart from the packaged one
LAMBDAS = [0.05, 0.1, 0.15, 0.2, 0.25]
DOCUMENTS, DECISIONS = 1000, 40  # per cell; decisions per document
TASKS = {"ifeval": "ifeval", "gpqa_main_cot_zeroshot": "gpqa_cot"}  # lm-eval task -> the paper's name


def paper_numbers(model: str) -> dict[tuple[str, str], tuple[float, float | None]]:
    """Read here from the tests' own copy of the paper's tables, apart from the packaged one the report reads."""
    with PAPER_CSV.open() as f:
        rows = csv.DictReader(line for line in f if not line.startswith("#"))
        return {(r["task"], r["lambda"]): (float(r["score"]), float(r["hit_rate_pct"]) / 100 if r["hit_rate_pct"] else None)
                for r in rows if r["model"] == model}


def cell(task: str, name: str, policy: str, lam, score: float, hit: float | None) -> dict:
    right = round(score * DOCUMENTS)
    speculated = DOCUMENTS * DECISIONS if hit is not None else 0
    accepted = round(hit * speculated) if hit is not None else 0
    per_doc = [accepted // DOCUMENTS + (i < accepted % DOCUMENTS) for i in range(DOCUMENTS)]
    layer = {"layer": 0, "speculated": speculated, "accepted": accepted, "trivial": 0,
             "hit_rate": accepted / speculated if speculated else None, "hist": [0] * NUM_BINS}
    return {"task": task, "cell": name, "policy": policy, "lambda": lam, "metric": "acc,none", "score": right / DOCUMENTS,
            "metrics": {"acc,none": right / DOCUMENTS}, "samples": DOCUMENTS,
            "alspec": {"schema_version": 2, "num_layers": 1, "layers": [layer], "total": {k: v for k, v in layer.items() if k != "layer"}},
            "sample_log": [{"doc_id": i, "filter": "none", "acc": float(i < right),
                            "alspec": [{"speculated": DECISIONS if speculated else 0, "accepted": per_doc[i], "trivial": 0}]}
                           for i in range(DOCUMENTS)]}


def write(out: Path, model: str, shift: dict[str, float] | None = None, paper_model: str = "llama-3.1-8b") -> Path:
    numbers = paper_numbers(paper_model)
    (out / "cells").mkdir(parents=True)
    (out / "sweep.json").write_text(json.dumps({"name": "paper", "model": model, "tasks": list(TASKS),
                                                "lambdas": LAMBDAS, "window": 128, "static_p": None}))
    for task, paper_task in TASKS.items():
        if (paper_task, "baseline") not in numbers:  # Table 2 has three tasks only
            continue
        (out / "cells" / task).mkdir()
        delta = (shift or {}).get(task, 0.0)
        cells = {"baseline": cell(task, "baseline", "exact", None, numbers[(paper_task, "baseline")][0] + delta, None)}
        for lam in LAMBDAS:
            score, hit = numbers[(paper_task, f"{lam:.2f}")]
            cells[f"lambda_{lam:g}"] = cell(task, f"lambda_{lam:g}", "dynamic", lam, score + delta, hit)
        for name, data in cells.items():
            (out / "cells" / task / f"{name}.json").write_text(json.dumps(data))
    return out


def sentences(out: Path) -> dict[str, str]:
    text = (out / "report" / "paper.md").read_text()
    return {line[2:].split(":")[0]: line[2:] for line in text.splitlines() if line.startswith("- ")}


def test_the_papers_own_numbers_are_reproduced(tmp_path):
    out = write(tmp_path / "sweep", "meta-llama/Llama-3.1-8B-Instruct")
    write_report(out, latency=[])
    said = sentences(out)
    assert set(said) == set(TASKS)
    assert all(s.startswith(f"{t}: reproduced: all 11 numbers of the paper's Table 1") for t, s in said.items())
    text = (out / "report" / "paper.md").read_text()
    assert "Beside the paper's Table 1 (Llama 3.1 8B" in text
    assert not any(" *" in line for line in text.splitlines() if line.startswith("|"))
    assert "| ifeval | λ = 0.1 | 0.812 [" in text  # the paper's Table 1: ifeval 0.812 at lambda 0.10, 89.8%
    assert "| 0.812 | +0.000 | 89.8% [" in text
    assert said["ifeval"] in (out / "report" / "table1.md").read_text()
    assert "Beside the paper" in (out / "report" / "report.html").read_text()


def test_a_task_shifted_by_five_points_is_flagged(tmp_path):
    out = write(tmp_path / "sweep", "/models/Meta-Llama-3.1-8B-Instruct", shift={"gpqa_main_cot_zeroshot": -0.05})
    write_report(out, latency=[])
    said = sentences(out)
    assert said["ifeval"].startswith("ifeval: reproduced")
    flagged = said["gpqa_main_cot_zeroshot"]
    assert flagged.startswith("gpqa_main_cot_zeroshot: not reproduced: 6 of 11 numbers")
    assert "score at λ = 0.1 0.187 against 0.237 (-0.050)" in flagged  # Table 1: gpqa_cot 0.237 at lambda 0.10
    assert "hit rate" not in flagged  # the hit rates still match


def test_which_table(tmp_path):
    assert matching_table("meta-llama/Llama-3.1-70B-Instruct") == "table2"
    assert matching_table("meta-llama/Meta-Llama-3.1-8B") == "table1"
    assert matching_table("Qwen/Qwen2.5-7B-Instruct") is None and matching_table(None) is None
    out = write(tmp_path / "sweep", "Qwen/Qwen2.5-7B-Instruct")
    write_report(out, latency=[])
    assert (out / "report" / "paper.md").read_text().startswith(
        "No paper column: the sweep's model 'Qwen/Qwen2.5-7B-Instruct' is neither of the paper's")
    write_report(out, latency=[], paper="table1")  # forced: compared anyway
    assert sentences(out)["ifeval"].startswith("ifeval: reproduced")
    write_report(out, latency=[], paper="none")
    assert (out / "report" / "paper.md").read_text() == "No comparison with the paper (--paper none).\n"
    seventy = write(tmp_path / "seventy", "meta-llama/Llama-3.1-70B-Instruct", paper_model="llama-3.1-70b")
    write_report(seventy, latency=[])
    said = sentences(seventy)
    assert list(said) == ["gpqa_main_cot_zeroshot"]  # Table 2 has no ifeval
    assert said["gpqa_main_cot_zeroshot"].startswith("gpqa_main_cot_zeroshot: reproduced: all 11 numbers of the "
                                                     "paper's Table 2")
    assert load_sweep(seventy).model.endswith("70B-Instruct")


def test_report_cli_takes_paper(tmp_path, capsys):
    from alspec_eval.report.cli import main

    out = write(tmp_path / "sweep", "meta-llama/Llama-3.1-8B-Instruct")
    assert main([str(out), "--paper", "none"]) == 0
    assert (out / "report" / "paper.md").read_text().startswith("No comparison")
    with pytest.raises(SystemExit) as exit_:
        main([str(out), "--paper", "table3"])
    assert exit_.value.code == 2


def test_paper_task_names_are_the_sweep_configs():
    """The paper's twelve tasks map onto exactly the lm-eval tasks configs/paper_table1.yaml runs."""
    from alspec_eval.report.paper import LM_EVAL_TASKS
    from alspec_eval.sweep.config import load_config

    config = load_config(Path(__file__).parents[2] / "configs" / "paper_table1.yaml")
    assert sorted(LM_EVAL_TASKS.values()) == sorted(config.tasks)
    assert {task for task, _ in paper_numbers("llama-3.1-8b")} == set(LM_EVAL_TASKS)
