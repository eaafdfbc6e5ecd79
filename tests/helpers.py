"""Shared builders for the adapter tests: tiny models behind HFLM and ALSpecLM, and request lists."""

from __future__ import annotations

import copy
import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch
from lm_eval.api.instance import Instance
from lm_eval.models.huggingface import HFLM
from transformers import DynamicCache

from alspec_eval.adapter import ALSpecLM
from alspec_eval.approx_check.models import PROMPTS, char_tokenizer
from alspec_eval.compat import with_cache
from alspec_eval.region import DecodeRegion
from alspec_eval.stats import OUTPUT_ERROR

TOKENIZER = char_tokenizer()
GEN_KWARGS = {"until": ["\n\n"], "max_gen_toks": 24, "do_sample": False}


def hf_lm(model: torch.nn.Module, batch_size: int = 1) -> HFLM:
    return HFLM(pretrained=copy.deepcopy(model), tokenizer=TOKENIZER, batch_size=batch_size, device="cpu",
                max_length=1024)


def alspec_lm(model: torch.nn.Module, batch_size: int = 1, **args: Any) -> ALSpecLM:
    args = {"lambda": 0.1, "window": 8, "device": "cpu", **args}
    return ALSpecLM(pretrained=copy.deepcopy(model), tokenizer=TOKENIZER, batch_size=batch_size, max_length=1024,
                    **args)


def gen_requests(prompts: list[str] = PROMPTS, task: str = "gen") -> list[Instance]:
    return [Instance("generate_until", {}, (p, dict(GEN_KWARGS)), i, (task, i, 1)) for i, p in enumerate(prompts)]


def ll_requests(task: str = "ll") -> list[Instance]:
    pairs = [(p[:30], p[30:]) for p in PROMPTS[:3]] + [("Hundreds", " of people went by"), ("A", " wonderful fact")]
    return [Instance("loglikelihood", {}, pair, i, (task, i, 1)) for i, pair in enumerate(pairs)]


def sample_stats(requests: list[Instance]) -> list[dict[str, Any]]:
    """The per-sample entry the adapter appended to each request's arguments."""
    return [r.arguments[-1]["alspec"] for r in requests]


def stepwise_logprob(lm: ALSpecLM, context: list[int], continuation: list[int]):
    """Decode the continuation one token at a time with a KV cache; returns (log-prob, trace)."""
    model = lm.model
    cache = DynamicCache(config=model.config)
    region = DecodeRegion.build([0], [len(context)], tokens=torch.tensor([context]))
    total = 0.0
    with torch.no_grad(), lm.speculator.speculating(region, lm.spec_config) as trace:
        logits = model(torch.tensor([context]), **with_cache(model, cache), use_cache=True).logits[0, -1]
        for i, token in enumerate(continuation):
            total += float(torch.log_softmax(logits.double(), -1)[token])
            if i + 1 < len(continuation):
                logits = model(torch.tensor([[token]]), **with_cache(model, cache), use_cache=True).logits[0, -1]
    return total, trace


def read_cells(out: Path) -> dict[str, dict]:
    """A sweep folder's cells by "task/cell", without the wall time (the one field two equal runs differ in), their
    mean d/n rounded (:func:`comparable`)."""
    cells = {}
    for path in sorted((out / "cells").rglob("*.json")):
        cell = json.loads(path.read_text())
        cell.pop("elapsed_s")
        cells[f"{path.parent.name}/{path.stem}"] = comparable(cell)
    return cells


def comparable(stats: Any, rel: float = 1e-4) -> Any:
    """Statistics with every mean d/n (research_attention_output_error) as a ``pytest.approx`` to ``rel``: d/n is a
    float32 quantity, and batches of another composition (a shared prefill, another rank) move it in the 7th digit;
    the counts and histograms stay exact."""
    if isinstance(stats, dict):
        return {k: (pytest.approx(v, rel=rel) if k == OUTPUT_ERROR and v is not None else comparable(v, rel))
                for k, v in stats.items()}
    if isinstance(stats, list):
        return [comparable(v, rel) for v in stats]
    return stats


@contextmanager
def recorded(lm: ALSpecLM) -> Iterator[list]:
    """Every trace the speculator fills inside the block (codes: accepted, rejected or trivial per row, position and
    layer; ratios: d/n), in the order the calls ended."""
    traces = []
    opened = lm.speculator.speculating

    @contextmanager
    def speculating(*args: Any, **kwargs: Any) -> Iterator[Any]:
        with opened(*args, **kwargs) as trace:
            yield trace
        traces.append(trace)

    lm.speculator.speculating = speculating
    try:
        yield traces
    finally:
        del lm.speculator.speculating


@contextmanager
def task_managers_built() -> Iterator[list[dict[str, Any]]]:
    """The lm-eval TaskManagers built inside the block (their keyword arguments), as a list filled while it runs."""
    import lm_eval.tasks

    built: list[dict[str, Any]] = []
    init = lm_eval.tasks.TaskManager.__init__
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(lm_eval.tasks.TaskManager, "__init__",
                      lambda self, *args, **kwargs: built.append(kwargs) or init(self, *args, **kwargs))
        yield built
