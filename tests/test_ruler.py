"""RULER, lm-eval's long-context suite, as a board: a unit per (task, length), the offline and missing-package
refusals, the board's choice against a hand computation, and a RULER sweep's cells against separate runs."""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path
from types import SimpleNamespace

import pandas as pd
import pytest

from alspec_eval import ruler
from alspec_eval.approximations import make_approximation
from alspec_eval.config import ConfigError
from alspec_eval.report.board import board, board_markdown, write_board_csv
from alspec_eval.report.frames import BASELINE, frontier_choice, paired_difference
from alspec_eval.sweep.config import fingerprint, load_config, parse_config
from alspec_eval.sweep.runner import primary_metric

CONFIGS = Path(__file__).parents[1] / "configs"
OFFLINE = ["niah_single_1", "niah_multikey_2", "niah_multikey_3", "ruler_vt", "ruler_cwe", "ruler_fwe"]


def test_a_ruler_task_is_a_unit_per_length_and_the_group_its_thirteen_tasks():
    config = parse_config({"name": "x", "tasks": ["niah_single_1", "alspec_recall"], "lambdas": [0.1],
                           "metadata": {"max_seq_lengths": [8192, 4096]}})
    assert config.tasks == ["niah_single_1@4096", "niah_single_1@8192", "alspec_recall"]
    default = parse_config({"name": "x", "tasks": ["ruler"], "lambdas": [0.1]}).tasks
    assert len(default) == 13 and all(t.endswith("@4096") for t in default) and "ruler_qa_hotpot@4096" in default
    assert ruler.offline_tasks() == OFFLINE
    assert ruler.split_unit("niah_single_1@4096") == ("niah_single_1", 4096)
    assert ruler.split_unit("alspec_recall") == ("alspec_recall", None)
    row = config.rows()[1]
    four, eight = (fingerprint(config, t, row) for t in config.tasks[:2])
    assert four["metadata"]["max_seq_lengths"] == [4096] and eight["metadata"]["max_seq_lengths"] == [8192]
    assert fingerprint(config, "alspec_recall", row)["metadata"] == {"max_seq_lengths": [8192, 4096]}


def test_a_units_primary_metric_is_its_lengths_without_metrics():
    metrics = {"4096,none": 0.5, "8192,none": -1, "4096_stderr,none": 0.1}
    assert primary_metric("niah_single_1@4096", metrics, {}) == "4096,none"
    assert primary_metric("alspec_recall", {"exact_match,none": 1.0}, {}) == "exact_match,none"
    with pytest.raises(ConfigError, match="niah_single_1@8192 reports no '8192,none'"):
        primary_metric("niah_single_1@8192", {"4096,none": 1.0}, {})


@pytest.mark.parametrize("lengths", [[], [0], "4096", [True]])
def test_bad_lengths_name_the_value_and_the_fix(lengths):
    with pytest.raises(ConfigError, match=r"config: metadata: max_seq_lengths=.* must be a list of context lengths"):
        parse_config({"name": "x", "tasks": ["niah_single_1"], "lambdas": [0.1],
                      "metadata": {"max_seq_lengths": lengths}})


def test_an_essay_task_offline_is_refused_in_one_line_before_anything_loads(tmp_path, monkeypatch):
    from alspec_eval.sweep import runner

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(runner, "build_lm", lambda config: pytest.fail("the model loaded"))
    config = parse_config({"name": "x", "tasks": ["niah_single_1", "niah_multivalue"], "lambdas": [0.1],
                           "output": str(tmp_path / "out")})
    with pytest.raises(ConfigError) as err:
        runner.run_sweep(config)
    message = str(err.value)
    assert "\n" not in message and message.startswith("tasks: niah_multivalue downloads Paul Graham's essays")
    assert message.endswith("offline; the RULER tasks that build offline are " + ", ".join(OFFLINE))
    assert not (tmp_path / "out").exists()
    ruler.check_buildable(["niah_single_1@4096", "ruler_cwe@4096"])  # the offline ones pass
    monkeypatch.delenv("HF_HUB_OFFLINE")
    monkeypatch.setattr(ruler.socket, "create_connection", lambda *a, **k: (_ for _ in ()).throw(OSError("down")))
    with pytest.raises(ConfigError, match="ruler_qa_squad downloads SQuAD"):
        ruler.check_buildable(["ruler_qa_squad@4096"])


def test_ruler_without_its_packages_is_one_line_with_the_install(monkeypatch):
    real = ruler.importlib.util.find_spec
    monkeypatch.setattr(ruler.importlib.util, "find_spec", lambda name: None if name == "wonderwords" else real(name))
    with pytest.raises(ConfigError, match=r"^tasks: ruler_vt builds its documents with wonderwords, which are not "
                                          r"installed; pip install 'alspec-eval\[ruler\]'$"):
        ruler.check_buildable(["alspec_recall", "ruler_vt@4096"])
    ruler.check_buildable(["alspec_recall"])  # a sweep without RULER needs neither


# The board's choice, by hand. Eight documents per unit; baseline right on all of them. Projected speedups:
SPEEDUPS = {"sink": {0.1: 1.2, 0.4: 1.6}, "quest": {0.1: 1.3, 0.4: 1.5}, "topk": {0.4: 2.0}}
SCORES = {  # per document, against the baseline's eight 1s
    ("sink", 0.1): [1] * 8,  # no loss: verified at 1.2
    ("sink", 0.4): [0, 0, 0, 0, 1, 1, 1, 1],  # -0.5, its interval below 0: lost
    ("quest", 0.1): [1] * 8,
    ("quest", 0.4): [1] * 7 + [0],  # -0.125: the interval reaches 0 and McNemar (1 discordant) does not reject
    ("topk", 0.4): [1] * 8,  # the oracle: shown at 2.0, not ranked
}


def _frames(task: str, baseline: list[int], engines: dict[str, str] | None = None
            ) -> tuple[pd.DataFrame, pd.DataFrame, dict, list]:
    """A board's frames; ``engines``: which engine ran each draft's cells (hf where not named)."""
    approx = {name: make_approximation(name) for name in ("sink", "quest", "topk")}
    engines = engines or {}
    base = pd.Series(baseline, index=range(8), dtype=float)
    cells = [{"task": task, "row": BASELINE.label, "cell": "baseline", "engine": engines.get("baseline", "hf"),
              "policy": "baseline", "lambda": math.nan,
              "approx": "sink", "approx_args": "", "window": 64, "hit_rate": math.nan, "n": 8,
              **paired_difference(base, None, True)}]
    documents = [{"task": task, "cell": "baseline", "doc_id": i, "score": s} for i, s in base.items()]
    speedups = {}
    for (name, lam), scores in SCORES.items():
        label = f"{name} λ={lam}"
        docs = pd.Series(scores, index=range(8), dtype=float)
        cells.append({"task": task, "row": label, "cell": label, "engine": engines.get(name, "hf"),
                      "policy": "dynamic", "lambda": lam, "approx": name,
                      "approx_args": ";".join(f"{k}:{v}" for k, v in approx[name].args().items()), "window": 64,
                      "hit_rate": lam, "n": 8, **paired_difference(docs, base, False)})
        documents += [{"task": task, "cell": label, "doc_id": i, "score": s} for i, s in docs.items()]
        speedups[(task, label)] = SPEEDUPS[name][lam]
    return pd.DataFrame(cells), pd.DataFrame(documents), speedups, list(approx.values())


def test_the_board_picks_each_drafts_fastest_verified_point_and_ranks_the_drafts(tmp_path):
    cells, documents, speedups, approx = _frames("niah_single_1@4096", [1] * 8)
    sweep = SimpleNamespace(tasks=["niah_single_1@4096"], approximations=approx)
    (unit,) = board(sweep, cells, documents, speedups)
    assert (unit.task, unit.length, unit.baseline, unit.n, unit.ranks) == ("niah_single_1", 4096, 1.0, 8, True)
    found = {e.approx.name: e for e in unit.entries}
    assert [e.approx.name for e in unit.entries] == ["quest", "sink", "topk"]
    assert (found["quest"].rank, found["quest"].speedup, found["quest"].lam) == (1, 1.5, 0.4)
    assert found["quest"].diff == pytest.approx(-1 / 8) and found["quest"].diff_high >= 0 > found["quest"].diff_low
    assert (found["sink"].rank, found["sink"].speedup, found["sink"].lam, found["sink"].diff) == (2, 1.2, 0.1, 0)
    assert (found["topk"].rank, found["topk"].speedup) == (None, 2.0)
    text = board_markdown([unit], "h100")
    assert "## niah_single_1, 4096 tokens: baseline 1.000 [1.000, 1.000], n = 8" in text
    assert "| 1 | quest P=16 | hf | 1.50× | 0.4 | 64 | 40.0% | -0.125 [" in text
    assert "| 2 | sink | hf | 1.20× | 0.1 | 64 | 10.0% | +0.000 [+0.000, +0.000] | 8 |" in text
    assert "| – | topk † | hf | 2.00× |" in text and "ORACLE" in text
    rows = list(csv.DictReader(write_board_csv([unit], tmp_path / "board.csv").open()))
    assert [(r["approx"], r["rank"], float(r["speedup"])) for r in rows] == [
        ("quest", "1", 1.5), ("sink", "2", 1.2), ("topk", "", 2.0)]


def test_one_board_of_both_engines_cells_names_each_cells_engine(tmp_path):
    """The same configuration's cells, some run through vLLM (--model alspec-vllm) and some through hf: one board,
    read alike, each entry naming the engine of its cell."""
    cells, documents, speedups, approx = _frames("niah_single_1@4096", [1] * 8, {"sink": "vllm", "baseline": "vllm"})
    (unit,) = board(SimpleNamespace(tasks=["niah_single_1@4096"], approximations=approx), cells, documents, speedups)
    assert {e.approx.name: e.engine for e in unit.entries} == {"quest": "hf", "sink": "vllm", "topk": "hf"}
    assert [e.approx.name for e in unit.entries] == ["quest", "sink", "topk"]  # ranked as an hf-only board ranks
    text = board_markdown([unit], "h100")
    assert "Cells run on hf (--model alspec), vLLM (--model alspec-vllm)." in text
    assert "| 2 | sink | vllm | 1.20× |" in text and "| 1 | quest P=16 | hf | 1.50× |" in text  # each row's engine
    rows = list(csv.DictReader(write_board_csv([unit], tmp_path / "board.csv").open()))
    assert [(r["approx"], r["engine"]) for r in rows] == [("quest", "hf"), ("sink", "vllm"), ("topk", "hf")]
    hf_only, *_ = _frames("niah_single_1@4096", [1] * 8)
    assert "vLLM" not in board_markdown(board(SimpleNamespace(tasks=["niah_single_1@4096"], approximations=approx),
                                              hf_only, documents, speedups), "h100")


def test_a_baseline_at_chance_ranks_nothing_and_names_no_cell():
    """SmolLM2 scores 0 on niah_multikey_2 at 4K: no draft can lose what the model never had."""
    cells, documents, speedups, approx = _frames("niah_multikey_2@4096", [0] * 7 + [1])
    (unit,) = board(SimpleNamespace(tasks=["niah_multikey_2@4096"], approximations=approx), cells, documents,
                    speedups)
    assert not unit.ranks and all(e.rank is None for e in unit.entries)
    assert "not above chance (0): a draft cannot lose what the model never had" in board_markdown([unit], "h100")
    sentence = frontier_choice(cells, speedups, documents)["niah_multikey_2@4096"]
    assert "not above chance" in sentence and "gives the largest" not in sentence
    cells, documents, speedups, _ = _frames("niah_single_1@4096", [1] * 8)
    assert "sink λ=0.4" not in frontier_choice(cells, speedups, documents)["niah_single_1@4096"]


def test_the_shipped_ruler_config_is_the_offline_tasks_at_4k():
    config = load_config(CONFIGS / "ruler.yaml")
    assert config.tasks == [f"{t}@4096" for t in OFFLINE]
    big = load_config(CONFIGS / "ruler_llama3.yaml")
    assert {ruler.split_unit(t)[0] for t in big.tasks} == set(ruler._ruler_configs()["ruler"]["task"])
    assert {ruler.split_unit(t)[1] for t in big.tasks} == {4096, 8192, 16384, 32768, 65536, 131072}
    # the same boards through vLLM: the same tasks and lengths, every draft that runs inside vLLM (the built-ins and
    # kvpress's presses that read no more than keys and values), the same drafts at both sizes
    from alspec_eval.approximations.kvpress import PRESSES, press_draft
    from alspec_eval.approximations.registry import names

    runs = {*names(), *(f"kvpress:{p}" for p in PRESSES if not press_draft(p).hf_only)}
    drafts = []
    for small, large in (("ruler", "ruler_vllm"), ("ruler_llama3", "ruler_llama3_vllm")):
        hf, vllm = load_config(CONFIGS / f"{small}.yaml"), load_config(CONFIGS / f"{large}.yaml")
        assert vllm.tasks == hf.tasks and vllm.engine == "vllm"
        drafts.append({a.family_name or a.name for a in vllm.approx})
    assert drafts[0] == drafts[1] == runs


@pytest.mark.slow
def test_a_ruler_sweep_is_a_cell_per_length_equal_to_separate_runs(tmp_path, capfd):
    """niah_single_1 at two lengths through a tiny model with SmolLM2's tokenizer: each length's cells are those of
    separate lm-eval runs at that length alone (documents, scores, answers and every decision), and the report's
    board splits them. The builders' progress bars and nltk's download attempt go to the run's log."""
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager
    from transformers import AutoTokenizer

    from alspec_eval.adapter import ALSpecLM
    from alspec_eval.approx_check.models import tiny_model
    from alspec_eval.report.build import write_report
    from alspec_eval.smollm2 import smollm2_path
    from alspec_eval.sweep.runner import run_sweep

    path = tmp_path / "model"
    tiny_model(vocab=49152, max_positions=1024).save_pretrained(path)
    AutoTokenizer.from_pretrained(smollm2_path()).save_pretrained(path)
    config = parse_config({
        "name": "ruler_tiny", "tasks": ["niah_single_1"], "metadata": {"max_seq_lengths": [384, 512]},
        "lambdas": [1.25], "window": 16, "model_args": {"pretrained": str(path), "dtype": "float32"},
        "batch_size": 2, "limit": 2, "gen_kwargs": {"max_gen_toks": 6}, "static": False,
        "output": str(tmp_path / "out")})
    out = run_sweep(config)
    console, log = capfd.readouterr(), (out / "lm_eval.log").read_text()
    assert "Generating synthetic samples" in log and "Generating synthetic samples" not in console.err + console.out
    assert "nltk" not in console.err + console.out
    assert [log.count(f"repeat | {n}:   0%") for n in (384, 512)] == [1, 1]  # built once for its 3 cells
    own = {"baseline": {"policy": "exact"}, "lambda_1.25": {"lambda": 1.25}, "sink": {"policy": "always"}}
    assert [row.name for row in config.rows()] == list(own)
    for length in (384, 512):
        index = TaskManager(metadata={"pretrained": str(path), "max_seq_lengths": [length]})
        for row in config.rows():
            cell = json.loads((out / "cells" / f"niah_single_1@{length}" / f"{row.name}.json").read_text())
            assert cell["metric"] == f"{length},none"
            assert {s["doc"]["max_length"] for s in cell["sample_log"]} == {length}
            lm = ALSpecLM(pretrained=str(path), dtype="float32", batch_size=2, device="cpu", window=16, **own[row.name])
            alone = simple_evaluate(model=lm, tasks=["niah_single_1"], limit=2, gen_kwargs={"max_gen_toks": 6},
                                    task_manager=index, log_samples=True, random_seed=1234, numpy_random_seed=1234,
                                    torch_random_seed=1234, fewshot_random_seed=1234, bootstrap_iters=0)
            assert alone["results"]["niah_single_1"][f"{length},none"] == cell["score"]
            samples = sorted(alone["samples"]["niah_single_1"], key=lambda s: s["doc_id"])
            assert [s["filtered_resps"] for s in samples] == [s["response"] for s in cell["sample_log"]]
            assert [s["doc"]["max_length"] for s in samples] == [length, length]
            stats = lm.statistics()["tasks"]["niah_single_1"]
            for mine, theirs in zip([*stats["layers"], stats["total"]], [*cell["alspec"]["layers"], cell["alspec"]["total"]]):
                floats = {k for k, v in mine.items() if isinstance(v, float)}  # means of float32 d/n: to its precision
                assert {k: v for k, v in mine.items() if k not in floats} == {k: theirs.get(k) for k in mine
                                                                            if k not in floats}
                assert {k: mine[k] for k in floats} == pytest.approx({k: theirs[k] for k in floats}, rel=1e-6)
        lam = json.loads((out / "cells" / f"niah_single_1@{length}" / "lambda_1.25.json").read_text())["alspec"]
        assert 0 < lam["total"]["accepted"] < lam["total"]["speculated"]  # decisions of both kinds were compared
    write_report(out)
    text = (out / "report" / "board.md").read_text()
    assert "## niah_single_1, 384 tokens" in text and "## niah_single_1, 512 tokens" in text


def test_a_units_name_splits_at_its_last_at_and_only_on_digits():
    assert ruler.split_unit("a@b@4096") == ("a@b", 4096)
    assert ruler.split_unit("task@abc") == ("task@abc", None) and ruler.split_unit("task@") == ("task@", None)
    assert ruler.unit_metadata("task@abc", {"max_seq_lengths": [1, 2]}) == {"max_seq_lengths": [1, 2]}


def test_a_metric_chosen_for_the_task_holds_for_each_of_its_units():
    metrics = {"4096,none": 1.0, "x,none": 0.0}
    assert primary_metric("niah_single_1@4096", metrics, {"niah_single_1": "x,none"}) == "x,none"
    assert primary_metric("niah_single_1@4096", metrics, {"niah_single_1@4096": "x,none"}) == "x,none"


@pytest.mark.parametrize("switch", ["HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"])
def test_either_offline_switch_is_offline_without_asking_the_network(switch, monkeypatch):
    for name in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(ruler.socket, "create_connection", lambda *a, **k: SimpleNamespace(close=lambda: None))
    assert not ruler.offline()
    monkeypatch.setenv(switch, "1")
    assert ruler.offline()
    with pytest.raises(ConfigError, match="niah_multivalue downloads"):
        ruler.check_buildable(["niah_multivalue@4096"])


def test_a_unit_is_evaluated_at_its_own_length_through_a_view_of_the_shared_index(monkeypatch):
    """evaluate_cell hands lm-eval the task's own name and an index whose metadata has the unit's length only; the
    sweep's index is left as it was (another task's cells still read all of it)."""
    import lm_eval
    from lm_eval.tasks._factory import TaskFactory

    from alspec_eval.compat import with_metadata
    from alspec_eval.sweep.runner import check_tasks, evaluate_cell

    shared = SimpleNamespace(metadata={"pretrained": "m", "max_seq_lengths": [4096, 8192]}, all_tasks=["niah_single_1"])
    shared._factory = TaskFactory(meta=shared.metadata)
    seen = {}
    monkeypatch.setattr(lm_eval, "simple_evaluate", lambda **kw: seen.update(kw))
    config = parse_config({"name": "x", "tasks": ["niah_single_1"], "lambdas": [0.1],
                           "metadata": {"max_seq_lengths": [4096, 8192]}})
    lm = SimpleNamespace(reset_statistics=lambda: None)
    assert evaluate_cell(lm, config, "niah_single_1@8192", config.rows()[0], {}, shared) is None
    assert seen["tasks"] == ["niah_single_1"]
    assert seen["task_manager"].metadata == {"pretrained": "m", "max_seq_lengths": [8192]}
    assert seen["task_manager"]._factory._meta == {"pretrained": "m", "max_seq_lengths": [8192]}
    assert shared.metadata["max_seq_lengths"] == [4096, 8192] and shared._factory._meta is shared.metadata
    view = with_metadata(shared, {"a": 1})
    assert view is not shared and view.all_tasks is shared.all_tasks
    check_tasks(config.tasks, shared)  # a unit is its task's name


def test_a_ruler_task_is_built_once_per_metadata_and_other_custom_datasets_each_time(tmp_path):
    """Within a sweep a RULER unit's documents are built once for its cells (the build is seeded, so every cell
    would build the same), per length; a task the predicate does not name builds each time, as lm-eval does."""
    from lm_eval.api.task import ConfigurableTask

    from alspec_eval.compat import custom_datasets_built_once

    builds = []

    def task(name: str, lengths: list[int]) -> ConfigurableTask:
        made = ConfigurableTask.__new__(ConfigurableTask)
        made._config = SimpleNamespace(task=name, metadata={"max_seq_lengths": lengths}, dataset_kwargs=None,
                                      custom_dataset=lambda **kw: builds.append((name, kw["max_seq_lengths"])) or kw)
        return made

    with custom_datasets_built_once(tmp_path / "log", lambda name: name == "niah_single_1"):
        first = [task("niah_single_1", [n]) for n in (384, 384, 512)] + [task("other", [1]), task("other", [1])]
        for made in first:
            made.download()
    assert builds == [("niah_single_1", [384]), ("niah_single_1", [512]), ("other", [1]), ("other", [1])]
    assert first[0].dataset is first[1].dataset and first[0].dataset != first[2].dataset
    assert ConfigurableTask.download.__name__ == "download" and ConfigurableTask.download.__qualname__.startswith(
        "ConfigurableTask")  # restored


def test_each_unit_is_judged_on_its_own_baseline():
    """Two lengths of one task in one sweep: each unit's baseline, documents and ranking are its own."""
    four = _frames("niah_single_1@4096", [1] * 8)
    eight = _frames("niah_single_1@8192", [0] * 8)
    cells, documents = (pd.concat([a, b], ignore_index=True) for a, b in zip(four[:2], eight[:2]))
    sweep = SimpleNamespace(tasks=["niah_single_1@4096", "niah_single_1@8192"], approximations=four[3])
    units = board(sweep, cells, documents, {**four[2], **eight[2]})
    assert [(u.length, u.baseline, u.ranks) for u in units] == [(4096, 1.0, True), (8192, 0.0, False)]
    assert [e.rank for e in units[0].entries] == [1, 2, None] and [e.rank for e in units[1].entries] == [None] * 3
