"""End to end on the real model: the stock `lm_eval` command on a bundled local task (about two minutes)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from alspec_eval import compat
from alspec_eval.smollm2 import smollm2_path

LM_EVAL = str(Path(sys.executable).with_name("lm_eval"))  # the venv's script, activated or not
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}


def run_lm_eval(out, model_args: str) -> tuple[dict, dict, list[dict]]:
    subprocess.run(
        [LM_EVAL, "--model", "alspec", "--model_args", model_args, "--tasks", "alspec_recall", "--limit", "4",
         "--batch_size", "4", "--device", "cpu", "--output_path", str(out), "--log_samples"],
        check=True, env=ENV, capture_output=True)
    (results,) = out.rglob("results_*.json")
    (sidecar,) = out.rglob("alspec_*.json")
    (samples,) = out.rglob("samples_alspec_recall_*.jsonl")
    return (json.loads(results.read_text()), json.loads(sidecar.read_text()),
            [json.loads(line) for line in samples.read_text().splitlines()])


@pytest.mark.slow
def test_lm_eval_alspec_on_smollm2(tmp_path):
    model = smollm2_path()
    hit_rates = {}
    for lam in (0.05, 0.4):
        results, sidecar, samples = run_lm_eval(tmp_path / str(lam), f"pretrained={model},lambda={lam},window=64")
        stats = results["config"]["alspec"]
        assert stats == sidecar and stats["schema_version"] == 2 and stats["config"]["lambda"] == lam
        task = stats["tasks"]["alspec_recall"]
        assert [layer["layer"] for layer in task["layers"]] == list(range(30))
        assert task["total"]["speculated"] == sum(layer["speculated"] for layer in task["layers"]) > 0
        per_sample = [s["arguments"]["gen_args_0"]["arg_2"]["alspec"] for s in samples]
        assert sum(s["accepted"] for s in per_sample) == task["total"]["accepted"]
        hit_rates[lam] = task["total"]["hit_rate"]
    assert hit_rates[0.05] < hit_rates[0.4]


@pytest.mark.slow
def test_bundled_hellaswag_is_above_chance_and_sink_attention_moves_it():
    """The demo's benchmark: a real multiple-choice task (teacher-forced loglikelihood) on which the embedded model
    scores well above chance (0.25) and whose score speculation can change."""
    from lm_eval import simple_evaluate

    runs = {}
    for policy in ("exact", "always"):
        out = simple_evaluate(model="alspec", model_args=f"pretrained={smollm2_path()},policy={policy},window=16",
                              tasks=["alspec_hellaswag"], limit=40, batch_size=4, device="cpu", log_samples=True,
                              bootstrap_iters=0)
        runs[policy] = ({s["doc_id"]: s["acc_norm"] for s in out["samples"]["alspec_hellaswag"]},
                        out["config"]["alspec"]["tasks"]["alspec_hellaswag"]["total"])
    (exact, exact_total), (sink, sink_total) = runs["exact"], runs["always"]
    assert sum(exact.values()) / len(exact) >= 0.4 and exact_total["speculated"] == 0
    assert sink_total["speculated"] == sink_total["accepted"] > 0
    assert sum(exact[d] != sink[d] for d in exact) > 0


def cli_responses(out, model: str, model_args: str, *args: str) -> tuple[dict[int, str], dict[int, dict]]:
    """The stock `lm_eval` command on the bundled recall task: the scored text and the alspec entry per document."""
    subprocess.run([LM_EVAL, "--model", model, "--model_args", model_args, "--tasks", "alspec_recall", "--device", "cpu",
                    "--output_path", str(out), "--log_samples", *args], check=True, env=ENV, capture_output=True)
    (samples,) = out.rglob("samples_alspec_recall_*.jsonl")
    docs = [json.loads(line) for line in samples.read_text().splitlines()]
    return ({d["doc_id"]: d["resps"][0][0] for d in docs},
            {d["doc_id"]: d["arguments"]["gen_args_0"].get("arg_2", {}).get("alspec") for d in docs})


@pytest.mark.slow
@pytest.mark.parametrize("stops, args", [
    # chat turns end with <|im_end|>, SmolLM2's end-of-sequence: at gamma 4 it falls inside a verification step
    ("eos", ["--apply_chat_template", "--limit", "6", "--gen_kwargs", "max_gen_toks=48,until=<nostop>"]),
    # the task's own stop strings ("\n", ".") and max_gen_toks = 8
    ("until and max_gen_toks", ["--limit", "4"]),
])
def test_selfspec_on_smollm2_is_lossless(tmp_path, stops, args):
    """Token-level self-speculation with the sink draft: the text lm-eval scores equals `--model hf`'s, document for
    document, where the exact model stops; tau is 1 + accepted / steps in every sample."""
    model = smollm2_path()
    expected, _ = cli_responses(tmp_path / "hf", "hf", f"pretrained={model}", "--batch_size", "1", *args)
    got, entries = cli_responses(tmp_path / "selfspec", "alspec", f"pretrained={model},policy=selfspec,window=32",
                                 "--batch_size", "4", *args)
    assert got == expected
    draft = [e["selfspec"] for e in entries.values()]
    assert all(d["gamma"] == 4 and d["steps"] > 0 and d["accepted"] <= d["drafted"] for d in draft)
    assert all(d["tau"] == pytest.approx(1 + d["accepted"] / d["steps"]) for d in draft)


def test_processes_asking_at_once_convert_the_model_once(tmp_path, monkeypatch):
    """The ranks of `accelerate launch` (or test workers) on a fresh machine: one converts, the others wait for it
    instead of converting too and failing to rename onto its folder."""
    import threading
    import time

    from alspec_eval import smollm2

    monkeypatch.setenv("ALSPEC_CACHE", str(tmp_path))
    converted = []

    def convert(target):  # slow enough that every caller arrives while the first converts
        converted.append(target)
        time.sleep(0.3)
        target.mkdir()
        (target / "model.safetensors").write_text("weights")

    monkeypatch.setattr(smollm2, "_convert", convert)
    found = []
    callers = [threading.Thread(target=lambda: found.append(smollm2.smollm2_path())) for _ in range(3)]
    for caller in callers:
        caller.start()
    for caller in callers:
        caller.join()
    target = tmp_path / f"{smollm2.SMOLLM2}{compat.saved_model_suffix()}"
    assert smollm2.smollm2_folder() == target
    assert found == [target] * 3 and converted == [target]


def test_each_transformers_major_version_keeps_its_own_converted_model(monkeypatch):
    """A folder 5.x saved is not one 4.x reads right (its tokenizer class, its RoPE as rope_parameters): 5.x keeps
    the folder name it had, 4.x one of its own."""
    monkeypatch.setattr(compat, "version", lambda name: {"transformers": "5.24.0"}[name])
    assert compat.saved_model_suffix() == ""
    monkeypatch.setattr(compat, "version", lambda name: {"transformers": "4.56.0"}[name])
    assert compat.saved_model_suffix() == "-transformers4"
