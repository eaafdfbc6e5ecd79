"""The host work of a decode step, counted on the CPU: what a GPU would pay in stalls and launches.

On a GPU each read of a tensor on the host (``.item()``, ``int``/``bool``/``float`` of a tensor, ``.cpu()``,
``.tolist()``, ``nonzero``, boolean-mask indexing) stalls the stream, and each tensor op is a kernel launch that an
eager, host-bound decode pays in wall time. Over ``generate_until`` on tiny models of 2 and 8 layers, the difference
between them is what each layer adds: no read-back, and few ops over ``--model hf`` on the same requests. Triton's
two launches run through its interpreter outside the count and count one op each.
"""

from __future__ import annotations

import collections
from typing import Any

import pytest
import torch
from lm_eval.api.instance import Instance
from lm_eval.models.huggingface import HFLM
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from alspec_eval.kernels import triton_decode
from helpers import PROMPTS, TOKENIZER, alspec_lm, sample_stats
from tiny import tiny_model

pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore")]  # builds models, runs lm-eval requests

READ_BACKS = {"item", "__bool__", "__int__", "__float__", "__index__", "cpu", "tolist", "nonzero", "numpy"}
NOT_LAUNCHES = {"empty", "empty_like", "empty_strided", "detach", "lift_fresh"}  # allocation and aliasing
LAYERS = (2, 8)
# at most, per layer and decode step over hf, by (kernel, approx): the other approximations choose keys per layer
STEP_OPS = {("model", "sink"): 12, ("triton", "sink"): 4, ("model", "quest"): 56, ("model", "topk"): 26}


class Count(TorchFunctionMode):
    """Host read-backs, by name (``paused`` while a counted stand-in runs)."""

    def __init__(self) -> None:
        super().__init__()
        self.reads: collections.Counter = collections.Counter()
        self.paused = False

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if not self.paused:
            if name in READ_BACKS:
                self.reads[name] += 1
            elif name in ("__getitem__", "__setitem__") and len(args) > 1:
                index = args[1] if isinstance(args[1], tuple) else (args[1],)
                if any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in index):
                    self.reads["boolean mask index"] += 1
        return func(*args, **(kwargs or {}))


class Ops(TorchDispatchMode):
    """Tensor ops that would be launches (views and allocations are not), by name."""

    def __init__(self, count: Count) -> None:
        super().__init__()
        self.ops: collections.Counter = collections.Counter()
        self.count = count

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not self.count.paused and not func.is_view and func.__name__.split(".")[0] not in NOT_LAUNCHES:
            self.ops[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


class Launches:
    """Triton's kernels, each launch one op, run by the interpreter outside the count."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.count: Count | None = None
        self.ops: Ops | None = None
        kernels = triton_decode._kernels()
        monkeypatch.setattr(triton_decode, "_kernels", lambda: tuple(self._stand_in(k, n) for k, n in
                                                                   zip(kernels, ("partial kernel", "reduce kernel"))))

    def _stand_in(self, kernel: Any, name: str) -> Any:
        launches = self

        class Launch:
            def __getitem__(self, grid):
                def launch(*args, **kwargs):
                    if launches.count is None:
                        return kernel[grid](*args, **kwargs)
                    launches.ops.ops[name] += 1
                    launches.count.paused = True
                    try:
                        return kernel[grid](*args, **kwargs)
                    finally:
                        launches.count.paused = False
                return launch

        return Launch()


def _requests() -> list[Instance]:
    kwargs = {"until": ["\n\n"], "max_gen_toks": 6, "do_sample": False}
    return [Instance("generate_until", {}, (p * 2, dict(kwargs)), i, ("gen", i, 1)) for i, p in enumerate(PROMPTS[:2])]


def _count(lm, launches: Launches | None) -> tuple[collections.Counter, collections.Counter, int]:
    """(read-backs, ops, decode steps) of one generate_until call, after a first one that warms every path."""
    lm.generate_until(_requests())
    steps = []
    hook = lm.model.register_forward_pre_hook(
        lambda _, args, kwargs: steps.append((kwargs.get("input_ids", args[0] if args else None)).shape[1] == 1),
        with_kwargs=True)
    requests = _requests()
    count = Count()
    ops = Ops(count)
    if launches is not None:
        launches.count, launches.ops = count, ops
    try:
        with count, ops:
            lm.generate_until(requests)
    finally:
        hook.remove()
        if launches is not None:
            launches.count = launches.ops = None
    if hasattr(lm, "spec_config"):  # alspec: the counted call ran the speculating path
        assert sum(s["speculated"] for s in sample_stats(requests)) > 0, "no decode step speculated"
    return count.reads, ops.ops, sum(steps)


@pytest.mark.parametrize(("kernel", "approx"), sorted(STEP_OPS))
def test_a_decode_layer_reads_nothing_back_and_launches_few_ops(kernel, approx, monkeypatch):
    launches = Launches(monkeypatch) if kernel == "triton" else None
    runs = {}
    for layers in LAYERS:
        model = tiny_model(layers=layers)
        hf = HFLM(pretrained=model, tokenizer=TOKENIZER, batch_size=2, max_length=1024, device="cpu")
        runs["hf", layers] = _count(hf, None)
        args = {"approx": approx, **({"page": 4} if approx == "quest" else {})}
        runs["alspec", layers] = _count(alspec_lm(model, batch_size=2, window=8, kernel=kernel, **args), launches)
    steps = runs["alspec", LAYERS[1]][2]
    assert steps == runs["alspec", LAYERS[0]][2] == runs["hf", LAYERS[1]][2] > 0
    added = LAYERS[1] - LAYERS[0]

    def per_layer(kind: str, i: int) -> collections.Counter:
        grown = collections.Counter(runs[kind, LAYERS[1]][i])
        grown.subtract(runs[kind, LAYERS[0]][i])
        return grown

    reads = per_layer("alspec", 0)
    assert not +reads and not -reads, f"read-backs that grow with the layers: {dict(+reads)}"
    ops = per_layer("alspec", 1)
    ops.subtract(per_layer("hf", 1))
    over_hf = sum(ops.values()) / (added * steps)
    grown = {name: n for name, n in ops.items() if n}
    assert over_hf <= STEP_OPS[kernel, approx], f"{over_hf} ops per layer and step over hf: {grown}"
    if kernel == "triton":
        assert ops["partial kernel"] == ops["reduce kernel"] == added * steps  # one launch each per layer and step
