"""alspec-vllm on the real SmolLM2 in float32, both engines compiled (vLLM's default mode): at lambda = 0 the texts
and log-probabilities of lm-eval's own ``--model vllm`` with the same engine arguments, bit for bit, through lm-eval's
request methods (generate_until, loglikelihood, loglikelihood_rolling); at lambda > 0 the statistics of ``--model
alspec``'s schema, per task and sample; and the stock ``lm_eval`` command end to end, read by alspec-report."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm")
from lm_eval.api.instance import Instance

pytestmark = pytest.mark.slow

GEN_KWARGS = {"until": ["\n\n"], "max_gen_toks": 20, "do_sample": False}


def passage(start: int, length: int) -> str:
    """Characters of the shipped haystack, whitespace collapsed."""
    from importlib import resources

    text = " ".join((resources.files("alspec_eval") / "data" / "haystack.txt").read_text(encoding="utf-8").split())
    return text[start:start + length]


def requests() -> dict[str, list[Instance]]:
    """Prompts of 300 to 700 tokens (past 2S = 128 at window 64), as lm-eval builds its instances."""
    gen = [Instance("generate_until", {}, (passage(9000 + 1000 * i, 1200 + 600 * i), dict(GEN_KWARGS)), i,
                    ("gen", i, 1)) for i in range(3)]
    context = passage(20000, 1500)
    ll = [Instance("loglikelihood", {}, (context, passage(21500 + 40 * i, 60 + 80 * i)), i, ("ll", i, 1))
          for i in range(3)]
    roll = [Instance("loglikelihood_rolling", {}, (passage(30000, 1400),), 0, ("roll", 0, 1))]
    return {"generate_until": gen, "loglikelihood": ll, "loglikelihood_rolling": roll}


def run(lm, kind: str) -> list:
    return getattr(lm, kind)(requests()[kind])


def compiled(lm) -> bool:
    """Whether ``lm``'s engine runs the model compiled, as vLLM does by default: on the CPU one Dynamo trace compiled
    by Inductor (docs/vllm.md, vLLM's compiled mode)."""
    from vllm.config import CompilationMode

    config = lm.model.llm_engine.vllm_config.compilation_config
    return config.mode == CompilationMode.DYNAMO_TRACE_ONCE and config.backend == "inductor"


@pytest.mark.parametrize("kind", ["generate_until", "loglikelihood", "loglikelihood_rolling"])
def test_lambda_zero_is_plain_vllm_bit_for_bit(alspec_smol, plain_smol, kind):
    assert alspec_smol.spec_config.lam == 0.0
    assert compiled(alspec_smol) and compiled(plain_smol)  # both in vLLM's default mode
    alspec_smol.reset_statistics()  # the engine is shared: count this test's requests alone
    ours, theirs = run(alspec_smol, kind), run(plain_smol, kind)
    assert ours == theirs  # texts, and log-probabilities as floats: bit for bit
    total = alspec_smol.statistics()["tasks"]
    assert sum(t["total"]["speculated"] for t in total.values()) > 0  # the speculating path ran
    assert sum(t["total"]["accepted"] for t in total.values()) == 0


def test_statistics_per_task_and_sample_in_the_schema_of_model_alspec(alspec_smol, tmp_path):
    alspec_smol.reconfigure(lam=0.2, trace_tokens=True, stats_path=str(tmp_path / "stats.json"))
    try:
        alspec_smol.reset_statistics()
        gen = requests()["generate_until"]
        texts = alspec_smol.generate_until(gen)
        info = alspec_smol.get_model_info()
    finally:
        alspec_smol.reconfigure(lam=0.0, trace_tokens=False, stats_path=None)
    stats = json.loads((tmp_path / "stats.json").read_text())
    assert stats == json.loads(json.dumps(info["alspec"]))
    assert stats["schema_version"] == 2 and stats["config"]["lambda"] == 0.2
    assert stats["provenance"]["engine"] == "vllm" and stats["provenance"]["attention_backend"] == "CPU_ATTN"
    task = stats["tasks"]["gen"]
    assert len(task["layers"]) == 30 and 0 < task["total"]["accepted"] < task["total"]["speculated"]
    samples = [json.loads(line) for line in (tmp_path / "stats.samples.jsonl").read_text().splitlines()]
    assert [s["doc_id"] for s in samples] == [0, 1, 2]
    assert sum(s["speculated"] for s in samples) == task["total"]["speculated"]
    for request, text in zip(gen, texts, strict=True):
        entry = request.arguments[-1]["alspec"]
        # one entry per generated token (the first comes from the exact prefill), each at most the layer count
        tokens = entry["accepted_layers_per_token"]
        assert len(tokens) == len(alspec_smol.tok_encode(text)) or len(tokens) <= GEN_KWARGS["max_gen_toks"]
        assert tokens[0] == 0 and max(tokens) <= 30


def test_the_stock_lm_eval_command_and_alspec_report(smollm2_path, tmp_path):
    args = ("pretrained=smollm2,lambda=0.1,window=64,dtype=float32,enforce_eager=True,max_model_len=2048,"
            f"kv_cache_memory_bytes={256 * 2**20}")
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}
    bin_dir = Path(sys.executable).parent
    done = subprocess.run([bin_dir / "lm_eval", "--model", "alspec-vllm", "--model_args", args, "--tasks",
                           "alspec_recall", "--limit", "2", "--output_path", tmp_path / "out"],
                          capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    sidecar = next((tmp_path / "out").rglob("alspec_*.json"))
    stats = json.loads(sidecar.read_text())
    assert stats["provenance"]["engine"] == "vllm" and stats["tasks"]["alspec_recall"]["total"]["speculated"] > 0
    results = json.loads(next((tmp_path / "out").rglob("results_*.json")).read_text())
    assert results["config"]["alspec"]["tasks"] == stats["tasks"]
