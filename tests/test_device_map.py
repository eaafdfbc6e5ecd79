"""A model dispatched with a device map (accelerate's hooks on every layer; what the CPU allows: one layer offloaded
to disk) speculates exactly as the same model loaded plainly."""

from __future__ import annotations

import pytest
import transformers

from helpers import alspec_lm, gen_requests, ll_requests, sample_stats
from alspec_eval.approx_check.models import save_tiny

pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore")]


def test_device_map_equals_plain_model(tmp_path):
    path = save_tiny(tmp_path / "model")
    plain = transformers.AutoModelForCausalLM.from_pretrained(path)
    device_map = {"model.embed_tokens": "cpu", "model.layers.0": "cpu", "model.layers.1": "disk",
                  "model.layers.2": "cpu", "model.norm": "cpu", "model.rotary_emb": "cpu", "lm_head": "cpu"}
    mapped = transformers.AutoModelForCausalLM.from_pretrained(path, device_map=device_map,
                                                               offload_folder=str(tmp_path / "offload"))
    assert mapped.hf_device_map["model.layers.1"] == "disk"
    runs = []
    for model in (plain, mapped):
        lm = alspec_lm(model, batch_size=2, window=4, **{"lambda": 0.5})
        gen, ll = gen_requests(), ll_requests()
        runs.append((lm.generate_until(gen), sample_stats(gen), lm.loglikelihood(ll), sample_stats(ll)))
    assert runs[1] == runs[0]
    assert 0 < sum(s["accepted"] for s in runs[0][1]) < sum(s["speculated"] for s in runs[0][1])
