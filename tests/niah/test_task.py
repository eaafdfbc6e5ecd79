"""The lm-eval tasks: config loads through TaskManager, docs come from metadata, and
scores land under one metric per length."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import pytest

lm_eval = pytest.importorskip("lm_eval")
from lm_eval.api.model import LM
from lm_eval.tasks import TaskManager

from alspec_eval.niah import tolerance

# Wherever the package maps `alspec_eval.tasks` from (a source folder or the installed copy).
TASKS = Path(next(iter(importlib.util.find_spec("alspec_eval.tasks").submodule_search_locations)))


class ScriptedLM(LM):
    """Answers every prompt with `reply(prompt)`: an echo finds every needle, a refusal none."""

    def __init__(self, reply: Any) -> None:
        super().__init__()
        self.reply = reply

    def generate_until(self, requests: list[Any], disable_tqdm: bool = False) -> list[str]:
        return [self.reply(r.args[0]) for r in requests]

    def loglikelihood(self, requests: list[Any], disable_tqdm: bool = False) -> list[Any]:
        raise NotImplementedError

    def loglikelihood_rolling(self, requests: list[Any], disable_tqdm: bool = False) -> list[Any]:
        raise NotImplementedError


@pytest.fixture(scope="module")
def metadata(smollm2_gguf: tuple[str, str]) -> dict[str, Any]:
    folder, name = smollm2_gguf
    return {"pretrained": folder, "gguf_file": name, "max_seq_lengths": [1024, 2048], "niah_samples": 2}


def load(task: str, metadata: dict[str, Any]) -> Any:
    manager = TaskManager(include_path=str(TASKS), include_defaults=False, metadata=metadata)
    return manager.load([task])["tasks"][task]


def test_paper_task_builds_docs_from_metadata(metadata: dict[str, Any]) -> None:
    docs = list(load("alspec_niah", metadata).test_docs())
    assert [(d["max_length"], d["seed"]) for d in docs] == [(1024, 0), (1024, 1), (2048, 0), (2048, 1)]
    for doc in docs:
        assert doc["mode"] == "paper" and len(doc["needles"]) == 10
        assert doc["max_length"] - tolerance(doc["max_length"]) <= doc["context_tokens"] <= doc["max_length"]
        assert all(n["text"] in doc["input"] for n in doc["needles"])
        assert doc["input"].startswith("<|im_start|>")  # niah_chat auto: the tokenizer has a template


def test_single_task_grid_and_options(metadata: dict[str, Any]) -> None:
    options = {"niah_depths": [0.0, 1.0], "niah_samples": 1, "niah_needle": "fact", "niah_chat": True, "niah_seed": 4}
    docs = list(load("alspec_niah_single", metadata | options).test_docs())
    assert [(d["max_length"], d["depth"], d["seed"]) for d in docs] == [
        (1024, 0.0, 4), (1024, 1.0, 4), (2048, 0.0, 4), (2048, 1.0, 4),
    ]
    assert all(d["needles"][0]["kind"] == "fact" and d["input"].startswith("<|im_start|>") for d in docs)


def test_unsupported_length_is_refused(metadata: dict[str, Any]) -> None:
    with pytest.raises(ValueError, match="1000"):
        load("alspec_niah", metadata | {"max_seq_lengths": [1000]})


@pytest.mark.parametrize(("task", "reply", "expected"), [
    ("alspec_niah", lambda prompt: prompt, 1.0),
    ("alspec_niah", lambda prompt: "I don't know.", 0.0),
    ("alspec_niah_single", lambda prompt: prompt, 1.0),
])
@pytest.mark.slow
def test_scores_reported_per_length(metadata: dict[str, Any], task: str, reply: Any, expected: float) -> None:
    manager = TaskManager(
        include_path=str(TASKS), include_defaults=False, metadata=metadata | {"niah_depths": [0.5], "niah_samples": 1}
    )
    results = lm_eval.simple_evaluate(model=ScriptedLM(reply), tasks=[task], task_manager=manager)
    metrics = results["results"][task]
    assert metrics["1024,none"] == expected and metrics["2048,none"] == expected
    assert "4096,none" not in metrics  # lengths not run report nothing
