"""backend=tt against sim, call by call: runs of one request list on both backends, sim's A, A~, d and n recorded per
layer, decode step and row, the fake card's log read back by branch of ``TTSpeculator.decode``.

sim runs with ``window_align=32`` (the op's windows); with a bfloat8_b KV cache its decode steps attend to K and V
rounded by the fake card's own bfloat8_b (what a card holds; prefill stays exact, as on the device path), so both
backends see the same keys and their A, A~, d and n differ only by bfloat16 rounding.
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass
from typing import Any

import torch
from lm_eval.api.instance import Instance

import fake_card
from helpers import GEN_KWARGS, PROMPTS, TOKENIZER, alspec_lm, gen_requests, sample_stats

from alspec_eval import semantics

# The tolerance of a call-by-call comparison, per row, relative to the row's ||A|| (sim's): A and A~ within
# TOL * ||A|| in the L2 norm over heads x head_dim, d and n within TOL * ||A||. bfloat16 keeps 8 significant bits
# (2^-8 relative); two computations of one attention output in bfloat16 (the model's sdpa on a masked cache, the
# card's per row) differ by a few units of the last place, and their d by as much again, so TOL = 2^-6. Measured on
# these runs (compare_calls and compare_committed return the worst of each): at most 0.6% for A, A~ and the committed
# outputs, 0.2% for d and n; the single bugs of test_tt_branches.py move some row by more than 2.7%.
TOL = 2.0 ** -6
MARGIN = 1.015  # a decision this close to lambda (relative) could flip between the backends
TEXT = " ".join(PROMPTS[:3]) * 6  # about 1400 characters (one token each)


@dataclass
class SimCall:
    """sim at one layer and decode step: its speculated rows (batch rows), their A and A~ (R, Hq, D), d and n."""

    layer: int
    length: int  # the host cache's length at that step
    rows: list[int]
    exact: torch.Tensor
    approx: torch.Tensor
    d: torch.Tensor
    n: torch.Tensor


def long_prompts(window: int, batch: int, shortest: int | None = None) -> list[str]:
    """``batch`` prompts of distinct lengths (left padding in a batch), the shortest ``shortest`` characters
    (default 2S: every row past 2S from the first decode step, whose position is the prompt's length)."""
    shortest = 2 * window if shortest is None else shortest
    return [TEXT[7 * i: 7 * i + shortest + 9 * (batch - 1 - i)] for i in range(batch)]


def requests(prompts: list[str], max_gen_toks: int = GEN_KWARGS["max_gen_toks"]) -> list[Instance]:
    if max_gen_toks == GEN_KWARGS["max_gen_toks"]:
        return gen_requests(prompts)
    kwargs = {**GEN_KWARGS, "max_gen_toks": max_gen_toks}
    return [Instance("generate_until", {}, (p, dict(kwargs)), i, ("gen", i, 1)) for i, p in enumerate(prompts)]


def gap_lambda(model, window: int, text: str | None = None) -> float:
    """A lambda in the widest gap between measured ratios near the median (sim, window_align=32, teacher-forced over
    ``text``), so that no decision sits within bfloat16 rounding of the threshold."""
    from alspec_eval.region import DecodeRegion

    text = TEXT[: 2 * window + 160] if text is None else text
    lm = alspec_lm(model, window=window, window_align=32, **{"lambda": 0.0})
    ids = torch.tensor([TOKENIZER(text)["input_ids"]])
    with torch.no_grad(), lm.speculator.speculating(DecodeRegion.build([0], [0]), lm.spec_config) as trace:
        lm.model(ids)
    ratios = trace.ratios[~torch.isnan(trace.ratios)].sort().values
    middle = ratios[len(ratios) // 4: 3 * len(ratios) // 4]
    gaps = middle[1:] / middle[:-1]
    i = int(gaps.argmax())
    assert gaps[i] > 1.01, "no gap wider than the bfloat16 rounding near the median"
    return float((middle[i] * middle[i + 1]).sqrt())


def record_sim(lm, kv_dtype: str) -> list[SimCall]:
    """Record sim's A, A~, d, n at every decode step's speculated rows (and round K and V as a bfloat8_b card)."""
    speculator, calls, now = lm.speculator, [], {}
    attend, approximate, verify = speculator.attend, speculator.approximate, speculator.verify

    def attend_(module, query, key, value, *args, **kwargs):
        now.clear()
        if query.shape[2] == 1 and speculator.session is not None:
            now.update(layer=module.layer_idx, length=key.shape[2])
            if kv_dtype == "bfloat8_b":
                key, value = fake_card.bfloat8_b(key).to(key.dtype), fake_card.bfloat8_b(value).to(value.dtype)
        return attend(module, query, key, value, *args, **kwargs)

    def approximate_(module, plan, *args, **kwargs):
        if now:
            now["rows"] = plan.rows.tolist()
        return approximate(module, plan, *args, **kwargs)

    def verify_(approx, exact, lam):
        if now:
            d, n = semantics.distances(approx, exact)
            calls.append(SimCall(now["layer"], now["length"], now["rows"], exact.clone(), approx.clone(), d, n))
        return verify(approx, exact, lam)

    speculator.attend, speculator.approximate, speculator.verify = attend_, approximate_, verify_
    return calls


def record_committed(lm) -> list[tuple[int, int, torch.Tensor]]:
    """(layer, host cache length, committed output (B, Hq, D)) of every decode step: what each layer continued with,
    A~ where accepted and A elsewhere."""
    speculator, committed = lm.speculator, []
    attend = speculator.attend

    def attend_(module, query, key, value, *args, **kwargs):
        out = attend(module, query, key, value, *args, **kwargs)
        if query.shape[2] == 1 and speculator.session is not None:
            committed.append((module.layer_idx, key.shape[2], out[0][:, 0].float().clone()))
        return out

    speculator.attend = attend_
    return committed


def compare_committed(tt: list, sim: list) -> float:
    """tt's committed outputs against sim's, layer by layer and step by step, each row within TOL of its norm;
    returns the largest deviation seen (relative)."""
    assert [(layer, length) for layer, length, _ in tt] == [(layer, length) for layer, length, _ in sim], \
        "committed outputs: the backends decoded other layers or steps"
    worst = 0.0
    for (layer, length, out), (_, _, ref) in zip(tt, sim, strict=True):
        deviation = ((out - ref).norm(dim=(1, 2)) / ref.norm(dim=(1, 2))).max()
        assert deviation <= TOL, f"layer {layer}, host length {length}: a committed output off by {deviation:.4f}"
        worst = max(worst, float(deviation))
    return worst


def run(model, lam: float, window: int, prompts: list[str], batch: int, kv_dtype: str = "bfloat16",
        max_gen_toks: int = GEN_KWARGS["max_gen_toks"], **args: Any):
    """One backend's generations, per-sample decisions and per-layer counts, (sim) its recorded calls, and its
    committed outputs."""
    tt = args.get("backend") == "tt"
    if tt:
        args = {"tt_mode": "device", "tt_kv_dtype": kv_dtype, **args}
    else:
        args = {"window_align": 32, **args}
    lm = alspec_lm(model, batch_size=batch, window=window, **args, **{"lambda": lam})
    calls = None if tt else record_sim(lm, kv_dtype)
    committed = record_committed(lm)
    reqs = requests(prompts, max_gen_toks)
    outputs = lm.generate_until(reqs)
    decisions = [(s["speculated"], s["accepted"]) for s in sample_stats(reqs)]
    layers = [(e["speculated"], e["accepted"], e["trivial"]) for e in lm.statistics()["tasks"]["gen"]["layers"]]
    return (outputs, decisions, layers), calls, committed


def settled(model, window: int, prompts: list[str], batch: int, kv_dtype: str = "bfloat16",
            max_gen_toks: int = GEN_KWARGS["max_gen_toks"], margin: float = MARGIN, **args: Any):
    """(lambda, sim's run, sim's calls, sim's committed outputs) with every decision of the run at least ``margin``
    (relative) away from lambda, and some accepted and some rejected: sim runs again with lambda in the widest gap of
    its own ratios d/n near the middle until none lies closer (a decision changed changes what later tokens and layers see). The two backends'
    ratios differ by bfloat16 rounding (up to about 0.5% here), so equal decisions are then expected, not lucky."""
    lam = gap_lambda(model, window)
    for attempt in range(6):
        sim, calls, committed = run(model, lam, window, prompts, batch, kv_dtype, max_gen_toks, **args)
        ratios = torch.cat([c.d / c.n for c in calls]).sort().values
        nearest = float((ratios / lam).log().abs().min())
        if nearest > math.log(margin) and 0 < sum(a for _, a in sim[1]) < sum(s for s, _ in sim[1]):
            print(f"settled at lambda {lam:.4f} after {attempt + 1} sim run(s)")
            return lam, sim, calls, committed
        middle = ratios[len(ratios) // 10: len(ratios) - len(ratios) // 10]
        gaps = middle[1:] / middle[:-1]
        i = int(gaps.argmax())
        lam = float((middle[i] * middle[i + 1]).sqrt())
    raise AssertionError(f"no lambda leaves every decision {margin - 1:.0%} away from it")


def steps(card: fake_card.FakeDevice) -> dict[int, list[tuple[str, dict]]]:
    """The card's op calls (not cache updates) grouped by step: one layer's decode step."""
    by_step = defaultdict(list)
    for kind, call in card.calls:
        if kind != "update":
            assert "step" in call, f"a {kind} call outside the model's attention call"
            by_step[call["step"]].append((kind, call))
    return by_step


def branch(calls: list[tuple[str, dict]]) -> str:
    """Which branch of TTSpeculator.decode one step took, from the card's log alone."""
    kinds = sorted(kind for kind, _ in calls)
    if kinds == ["speculative"]:
        return "all past 2S"
    if kinds == ["decode", "speculative"]:
        return "mixed"
    if kinds == ["decode"]:
        return "all within 2S"
    if kinds == ["decode", "decode"] and sorted(c["window"] for _, c in calls) == [False, True]:
        return "fallback"
    raise AssertionError(f"a step the backend has no branch for: {kinds}")


def expected_branch(call: dict, window: int, pad: list[int]) -> str:
    """The branch a step must take, from the host's positions: pos + 1 = length - pad against 2S."""
    past = [call["length"] - p > 2 * window for p in pad]
    return "all past 2S" if all(past) else "all within 2S" if not any(past) else "mixed"


def branches(card: fake_card.FakeDevice) -> dict[str, int]:
    counts = defaultdict(int)
    for calls in steps(card).values():
        counts[branch(calls)] += 1
    return dict(counts)


def compare_calls(card: fake_card.FakeDevice, sim_calls: list[SimCall], heads: int = 4) -> dict[str, float]:
    """Every speculative-op call against sim's A, A~, d, n of the same layer, step and rows, within TOL (module
    docstring); returns the largest deviations seen, relative to ||A||."""
    ops = [call for kind, call in card.calls if kind == "speculative"]
    assert [(c["layer"], c["length"]) for c in ops] == [(s.layer, s.length) for s in sim_calls], \
        "call by call: the op ran at other layers or steps than sim speculated"
    worst = defaultdict(float)
    for op, sim in zip(ops, sim_calls, strict=True):
        where = f"call by call: layer {sim.layer}, host length {sim.length}"
        assert sorted(op["rows"]) == sim.rows, f"{where}: the op computed host rows {op['rows']}, sim {sim.rows}"
        full, spec, d2, n2 = op["out"]
        for i, row in enumerate(op["rows"]):
            j = sim.rows.index(row)
            norm = float(sim.n[j])
            deviations = {
                "A": float((full[0, i, :heads].float() - sim.exact[j].float()).norm()) / norm,
                "A~": float((spec[0, i, :heads].float() - sim.approx[j].float()).norm()) / norm,
                "d": abs(float(d2.flatten()[i].float().sqrt()) - float(sim.d[j])) / norm,
                "n": abs(float(n2.flatten()[i].float().sqrt()) - norm) / norm,
            }
            for name, value in deviations.items():
                assert value <= TOL, f"{where}, host row {row}: {name} off by {value:.4f} of ||A|| (> {TOL})"
                worst[name] = max(worst[name], value)
    return dict(worst)
