"""backend=tt, tt_mode=host, tt_kernel=ttlang on tt-lang-sim against the sim backend (window_align=32).

Run by test_tt_ttlang.py in a subprocess (the simulator rebinds torch.bfloat16 to float32 process-wide);
prints one JSON object. Everything is float32 (the simulator computes in float32), so the two paths differ
only by float rounding.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: tiny, helpers

import torch
from transformers import DynamicCache

from helpers import PROMPTS, TOKENIZER, alspec_lm, gen_requests, sample_stats

from alspec_eval.approx_check.models import tiny_model
from alspec_eval.kernels import speculative_flash_decode
from alspec_eval.region import DecodeRegion

WINDOW = 32
STEPS = 10
TT = {"backend": "tt", "tt_mode": "host", "tt_kernel": "ttlang", "tt_kv_dtype": "bfloat16"}
SIM = {"window_align": 32}
# Two left-padded rows past 2S = 64 tokens, so every decode step speculates.
GREEDY_PROMPTS = [(PROMPTS[0] + " " + PROMPTS[1])[:100], PROMPTS[2][:70]]


def pcc(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(torch.corrcoef(torch.stack([a.flatten().double(), b.flatten().double()]))[0, 1])


def greedy(lm, steps: int = STEPS) -> dict:
    """Prefill (exact) then ``steps`` greedy decode steps of a left-padded batch; the trace of every step."""
    model = lm.model
    batch = TOKENIZER(GREEDY_PROMPTS, padding=True, return_tensors="pt", padding_side="left")
    ids, mask = batch["input_ids"], batch["attention_mask"]
    region = DecodeRegion.build(mask.shape[1] - mask.sum(-1), [ids.shape[1]] * len(ids))
    positions = (mask.cumsum(-1) - 1).clamp_min(0)
    cache = DynamicCache(config=model.config)
    tokens, logits = [], []
    with torch.no_grad(), lm.speculator.speculating(region, lm.spec_config) as trace:
        out = model(ids, attention_mask=mask, position_ids=positions, past_key_values=cache, use_cache=True)
        for _ in range(steps):
            nxt = out.logits[:, -1].argmax(-1, keepdim=True)
            tokens.append(nxt)
            mask = torch.cat([mask, torch.ones_like(nxt)], 1)
            positions = positions[:, -1:] + 1
            out = model(nxt, attention_mask=mask, position_ids=positions, past_key_values=cache, use_cache=True)
            logits.append(out.logits[:, -1])
    decode = slice(ids.shape[1] - trace.offset, None)  # the decode steps' positions in the trace
    return {"tokens": torch.cat(tokens, 1), "logits": torch.stack(logits, 1),
            "codes": trace.codes[:, decode], "ratios": trace.ratios[:, decode]}


def kernel_check(lm) -> dict:
    """One decode step of random GQA inputs (head_dim 64, left padding) through the tt backend's decode
    against the torch reference of the speculative flash decode (window_align=32)."""
    torch.manual_seed(0)
    q = torch.randn(2, 4, 1, 64) * 2
    k, v = torch.randn(2, 2, 150, 64) * 2, torch.randn(2, 2, 150, 64)
    pad = torch.tensor([0, 7])
    speculator, config = lm.speculator, lm.spec_config
    out = speculator.decode(0, q[:, :, 0], k, v, pad, k.shape[2] - 1 - pad, config.lam, 0.125, config)
    exact, approx, d, n = out.exact[:, None], out.spec[:, None], out.d, out.n
    ref = speculative_flash_decode(q[:, :, 0], k, v, torch.full((2,), k.shape[2] - 1), WINDOW, math.inf,
                                   window_align=32, scale=0.125, start=pad)
    return {"pcc_exact": pcc(exact[:, 0], ref.exact), "pcc_spec": pcc(approx[:, 0], ref.spec),
            "max_abs_exact": float((exact[:, 0] - ref.exact).abs().max()),
            "max_abs_spec": float((approx[:, 0] - ref.spec).abs().max()),
            "d": d.tolist(), "d_reference": ref.d.tolist(),
            "n": n.tolist(), "n_reference": ref.n.tolist()}


def main() -> None:
    model = tiny_model()  # float32, 3 layers, 4 query heads over 2 KV heads, head_dim 16 (padded to a tile)
    # Open loop (lambda=0: exact commits): lambda halfway between the two middle ratios.
    open_loop = greedy(alspec_lm(model, window=WINDOW, **SIM, **{"lambda": 0.0}))["ratios"]
    ratios = open_loop[~torch.isnan(open_loop)].sort().values
    lam = float(ratios[len(ratios) // 2 - 1] + ratios[len(ratios) // 2]) / 2

    runs, calls = {}, []
    for name, args in (("sim", SIM), ("tt", TT)):
        lm = alspec_lm(model, batch_size=2, window=WINDOW, trace_tokens=True, **args, **{"lambda": lam})
        if name == "tt":
            kernel = lm.speculator.runtime.ttlang

            def counted(*a, **kw):
                calls.append(1)
                return kernel(*a, **kw)

            lm.speculator.runtime.ttlang = counted
        requests = gen_requests([p * 2 for p in PROMPTS[:2]])
        generations = lm.generate_until(requests)
        stats = lm.statistics()["tasks"]["gen"]["layers"]
        runs[name] = {"greedy": greedy(lm), "generations": generations, "samples": sample_stats(requests),
                      "layers": [{k: layer[k] for k in ("speculated", "accepted", "trivial")} for layer in stats]}
    sim, tt = runs["sim"], runs["tt"]
    both = torch.cat([r["greedy"]["ratios"].flatten() for r in (sim, tt)])
    both = both[~torch.isnan(both)]
    result = {
        "lambda": lam,
        "speculator": type(lm.speculator).__name__,
        "kernel_calls": len(calls),
        "margin": float(((both - lam).abs() / lam).min()),  # closest any ratio came to the threshold
        "codes_sim": sim["greedy"]["codes"].tolist(), "codes_tt": tt["greedy"]["codes"].tolist(),
        "tokens_equal": torch.equal(sim["greedy"]["tokens"], tt["greedy"]["tokens"]),
        "max_abs_logits": float((sim["greedy"]["logits"] - tt["greedy"]["logits"]).abs().max()),
        "max_rel_ratio": float(((tt["greedy"]["ratios"] - sim["greedy"]["ratios"]).abs()
                                / sim["greedy"]["ratios"]).nan_to_num(0.0).max()),
        "generations_sim": sim["generations"], "generations_tt": tt["generations"],
        "samples_sim": sim["samples"], "samples_tt": tt["samples"],
        "layers_sim": sim["layers"], "layers_tt": tt["layers"],
        "kernel": kernel_check(lm),
    }
    json.dump(result, sys.stdout)


if __name__ == "__main__":
    main()
