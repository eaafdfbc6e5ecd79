"""The host work of a decode step, counted on the CPU: what a GPU would pay in stalls and launches.

On a GPU each read of a tensor on the host (``.item()``, ``int``/``bool``/``float`` of a tensor, ``.cpu()``,
``.tolist()``, ``nonzero``, boolean-mask indexing) stalls the stream, and each tensor op is a kernel launch that an
eager, host-bound decode pays in wall time. Over ``generate_until`` on tiny models of 2 and 8 layers, the difference
between them is what each layer adds: no read-back, and few ops over ``--model hf`` on the same requests. Triton's
launch runs through its interpreter outside the count and counts one op.
"""

from __future__ import annotations

import collections
import copy
import itertools
import weakref
from collections.abc import Callable
from typing import Any, NamedTuple

import pytest
import torch
from lm_eval.api.instance import Instance
from lm_eval.models.huggingface import HFLM
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from alspec_eval.approx_check.models import tiny_model
from alspec_eval.kernels import triton_decode
from alspec_eval.config import SpeculationConfig
from alspec_eval.plan import Plan
from default_approximations import APPROXIMATIONS, PROMPT_SCORING, approx_args
from helpers import PROMPTS, TOKENIZER, alspec_lm, sample_stats
from row_kinds import examples

pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore")]  # builds models, runs lm-eval requests

READ_BACKS = {"item", "__bool__", "__int__", "__float__", "__index__", "cpu", "tolist", "nonzero", "numpy"}
NOT_LAUNCHES = {"empty", "empty_like", "empty_strided", "detach", "lift_fresh"}  # allocation and aliasing
LAYERS = (2, 8)
# Ops per layer and decode step over hf's, at most, by (kernel, approx), for each registered approximation
# (default_approximations.py); approximations other than the sink choose keys per layer, so they cost more. kernel=triton
# launches one kernel in place of the model's attention call and adds one op to commit: none over hf. The sink with
# kernel=model: its A~ call, a gather each of keys and values, d, n, the decision and the commit (9), and the draft's
# keys kept in [0, pos], whatever it returns (passes.Pass.readable: a clamp, the keys it moved, per position, kept for
# the call's end: 4, 5 with a mask). quest: at most 61 (its page bounds copy whole keys by row and position: a row
# index, then one index); transformers 4.56's sdpa copies K and V per query head (repeat_kv: a clone and a view each)
# for a single-query GQA call with a mask, as Quest's A~ call is, where 5.x packs the query heads instead (snapkv: 42
# on 5.x and 46 on 4.56). topk: 34, its 2S best by a partial selection of unique keys made from the scores' bits (nine
# elementwise ops and a topk, where a stable sort of all L was one op and about 6x the time on the CPU at 4K).
STEP_OPS = {("model", "sink"): 13, ("triton", "sink"): 0, ("model", "local"): 13, ("model", "quest"): 61,
            ("model", "topk"): 34, ("model", "snapkv"): 47}


class Count(TorchFunctionMode):
    """Host read-backs and uploads, by name (``paused`` while a counted stand-in runs).

    An upload is a copy to the compute device of a tensor the host made during the call, as a GPU would pay it
    (a blocking host-to-device copy synchronizes the stream as a read-back does): ``.to(device)``, ``.cuda()``,
    ``copy_`` or ``new_tensor`` of host data onto a device tensor, and ``torch.tensor``/``as_tensor`` of Python
    data with a ``device``, of at least one element. Host-made tensors are those factories made without a device, and what ops made of
    host-made tensors alone; the model's weights and inputs are the device's.
    """

    def __init__(self) -> None:
        super().__init__()
        self.reads: collections.Counter = collections.Counter()
        self.uploads: collections.Counter = collections.Counter()
        self._host: dict[int, weakref.ref] = {}  # host-made tensors by id (a tensor's == is elementwise)
        self.paused = False

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if not self.paused:
            if name in READ_BACKS:
                self.reads[name] += 1
            elif name in ("__getitem__", "__setitem__") and len(args) > 1:
                index = args[1] if isinstance(args[1], tuple) else (args[1],)
                if any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in index):
                    self.reads["boolean mask index"] += 1
        out = func(*args, **kwargs)
        if not self.paused and isinstance(out, torch.Tensor) and self._uploads(name, args, kwargs, out) and \
                out is (args[0] if args else None):
            out = out.clone()  # on a GPU the upload is a new tensor, and the host's stays the host's
        return out

    def _uploads(self, name: str, args: tuple, kwargs: dict, out: torch.Tensor) -> bool:
        """Count ``out`` if it is an upload (and say so), else note whether the host made it."""
        if out.numel() == 0:
            return False  # nothing to copy (transformers' DynamicCache starts a layer with torch.tensor([], device=))
        tensors = [a for a in itertools.chain(args, kwargs.values()) for a in (a if isinstance(a, (list, tuple))
                   else (a,)) if isinstance(a, torch.Tensor)]
        source = args[0] if args and isinstance(args[0], torch.Tensor) else None
        device = kwargs.get("device", next((a for a in args[1:] if isinstance(a, (torch.device, str))), None))
        if name == "to" and device is None:
            device = next((a.device for a in args[1:] if isinstance(a, torch.Tensor)), None)
        to_device = device is not None and device != "cpu"  # a torch.device is the compute device, here the CPU
        if name in ("to", "cuda", "as_tensor") and source is not None and (to_device or name == "cuda"):
            if self.made_on_host(source):
                self.uploads[f"{name} of a host tensor"] += 1
                return True
            return False
        if name == "copy_" and len(args) > 1 and self.made_on_host(args[1]) and not self.made_on_host(source):
            self.uploads["copy_ of a host tensor"] += 1
            return True
        if name == "new_tensor" and not self.made_on_host(source) or name in ("tensor", "as_tensor") and to_device:
            self.uploads[f"{name} of host data"] += 1
            return True
        if (not tensors and not to_device) or (tensors and all(map(self.made_on_host, tensors))):
            self._host[id(out)] = weakref.ref(out)  # a factory without a device, or an op on host-made tensors alone
        return False

    def made_on_host(self, tensor: torch.Tensor | None) -> bool:
        ref = self._host.get(id(tensor))
        return ref is not None and ref() is tensor


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
    """Triton's kernel, each launch one op, run by the interpreter outside the count."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.count: Count | None = None
        self.ops: Ops | None = None
        stand_in = self._stand_in(triton_decode.kernel(), "decode kernel")
        monkeypatch.setattr(triton_decode, "kernel", lambda: stand_in)

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


def _requests(batch: int = 2, tokens: int = 6) -> list[Instance]:
    kwargs = {"until": ["\n\n"], "max_gen_toks": tokens, "do_sample": False}
    return [Instance("generate_until", {}, (p * 2, dict(kwargs)), i, ("gen", i, 1))
            for i, p in enumerate(PROMPTS[:batch])]


class Counted(NamedTuple):
    reads: collections.Counter
    uploads: collections.Counter
    ops: collections.Counter
    steps: int
    requests: list[Instance]


def _count(lm, launches: Launches | None, call: Callable[[list[Instance]], object] | None = None,
           batch: int = 2) -> Counted:
    """What one generate_until call of ``batch`` requests did on the host (``call`` runs it: lm.generate_until by
    default), after a first call that warms every path."""
    call = call or lm.generate_until
    call(_requests(batch, tokens=3))  # a prefill and decode steps, self-speculation's drafts and verification
    steps = []
    hook = lm.model.register_forward_pre_hook(
        lambda _, args, kwargs: steps.append((kwargs.get("input_ids", args[0] if args else None)).shape[1] == 1),
        with_kwargs=True)
    requests = _requests(batch)
    count = Count()
    ops = Ops(count)
    if launches is not None:
        launches.count, launches.ops = count, ops
    try:
        with count, ops:
            call(requests)
    finally:
        hook.remove()
        if launches is not None:
            launches.count = launches.ops = None
    return Counted(count.reads, count.uploads, ops.ops, sum(steps), requests)


def _grown(small: collections.Counter, large: collections.Counter) -> dict[str, int]:
    """What the larger model did more (or less) than the smaller, by name: what its extra layers cost."""
    grown = collections.Counter(large)
    grown.subtract(small)
    return {name: n for name, n in grown.items() if n}


@pytest.mark.parametrize(("kernel", "approx"), sorted(STEP_OPS))
def test_a_decode_layer_reads_nothing_back_and_launches_few_ops(kernel, approx, monkeypatch):
    launches = Launches(monkeypatch) if kernel == "triton" else None
    runs = {}
    for layers in LAYERS:
        model = tiny_model(layers=layers)
        hf = HFLM(pretrained=model, tokenizer=TOKENIZER, batch_size=2, max_length=1024, device="cpu")
        runs["hf", layers] = _count(hf, None)
        args = approx_args(approx, 8)
        runs["alspec", layers] = _count(alspec_lm(model, batch_size=2, window=8, kernel=kernel, **args), launches)
        assert sum(s["speculated"] for s in sample_stats(runs["alspec", layers].requests)) > 0, "nothing speculated"
    steps = runs["alspec", LAYERS[1]].steps
    assert steps == runs["alspec", LAYERS[0]].steps == runs["hf", LAYERS[1]].steps > 0
    added = LAYERS[1] - LAYERS[0]

    def per_layer(kind: str, i: int) -> collections.Counter:
        grown = collections.Counter(runs[kind, LAYERS[1]][i])
        grown.subtract(runs[kind, LAYERS[0]][i])
        return grown

    reads = per_layer("alspec", 0)
    assert not +reads and not -reads, f"read-backs that grow with the layers: {dict(+reads)}"
    uploads = per_layer("alspec", 1)
    uploads.subtract(per_layer("hf", 1))  # the model's own: its cache's empty tensors
    assert not +uploads and not -uploads, f"uploads that grow with the layers: {dict(+uploads)}"
    ops = per_layer("alspec", 2)
    ops.subtract(per_layer("hf", 2))
    over_hf = sum(ops.values()) / (added * steps)
    grown = {name: n for name, n in ops.items() if n}
    assert over_hf <= STEP_OPS[kernel, approx], f"{over_hf} ops per layer and step over hf: {grown}"
    if kernel == "triton":
        assert ops["decode kernel"] == added * steps  # one launch per layer and step


ROW_LAYERS = (2, 3)  # a model, and the same with a layer more


def deepened(model: torch.nn.Module, layers: int) -> torch.nn.Module:
    """``model`` with layers appended that add nothing to the residual stream (their output projections zero):
    the same tokens, so the same decode steps (self-speculation's included), and attention in every layer."""
    config = copy.deepcopy(model.config)
    config.num_hidden_layers = layers
    deeper = type(model)(config).eval()
    deeper.load_state_dict(model.state_dict(), strict=False)
    with torch.no_grad():
        for layer in deeper.model.layers[model.config.num_hidden_layers:]:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
    return deeper


@pytest.mark.parametrize(("kernel", "approx"), [("model", a) for a in APPROXIMATIONS] + [("triton", "sink")])
def test_no_row_kind_uploads_or_reads_back_per_layer(kernel, approx, monkeypatch, tmp_path):
    """Every kind of row (row_kinds.py) run alone from its model_args, and the rows that share a prefill decoded as
    one batch with a line of thresholds per row (a sweep's per-row lambdas), 4 requests per call: what a GPU would
    pay per layer in stalls, none. Under kernel=triton (Triton's interpreter, slow) the rows run alone are those that
    do not share the prefill (static): the shared run decodes every other kind through the same kernel."""
    launches = Launches(monkeypatch) if kernel == "triton" else None
    per_row: list[bool] = []  # per layer call: whether its rows had thresholds of their own
    layer = Plan.layer
    monkeypatch.setattr(Plan, "layer", lambda self, *a: per_row.append(isinstance(out := layer(self, *a),
                                                                                   torch.Tensor)) or out)
    runs: dict[tuple[str, int], Counted] = {}
    for layers in ROW_LAYERS:
        model = deepened(tiny_model(layers=ROW_LAYERS[0]), layers)
        hf = HFLM(pretrained=model, tokenizer=TOKENIZER, batch_size=4, max_length=1024, device="cpu")
        runs["hf", layers] = _count(hf, None, batch=4)  # the model's own (its cache's empty tensors per layer)
        (tmp_path / str(layers)).mkdir()
        kinds = [e for e in examples(0.3, layers=layers, folder=tmp_path / str(layers))
                 if approx not in PROMPT_SCORING or not e.row.drafts_tokens]  # it drafts no tokens: refused
        for example in (kinds if kernel == "model" else [e for e in kinds if not e.row.shares_prefill]):
            exact = example.row.exact_attention and example.row.kind == "baseline"
            args = {**example.model_args, "kernel": kernel, **({} if exact else approx_args(approx, 8))}
            runs[example.id, layers] = _count(alspec_lm(model, batch_size=4, **args), launches, batch=4)
        made = SpeculationConfig(**approx_args(approx, 8)).approx
        variants = [row for row in (e.row if e.row.kind == "baseline" else e.row.approximated(made) for e in kinds)
                    if row.shares_prefill]
        lm = alspec_lm(model, batch_size=4, kernel=kernel)
        assert len(variants) > 2  # every approximation's rows share one prefill (prompt scorers observe it)

        def shared(requests: list[Instance]) -> object:
            with lm.shared_prefill(variants) as fork, lm.answering(variants[1], shared=fork):  # every variant decodes
                return lm.generate_until(requests)

        per_row.clear()
        runs["shared prefill", layers] = _count(lm, launches, shared, batch=4)
        assert any(per_row), "the shared prefill's layers had one threshold for every row"
    model_uploads = _grown(runs["hf", ROW_LAYERS[0]].uploads, runs["hf", ROW_LAYERS[1]].uploads)
    for name in {name for name, _ in runs} - {"hf"}:
        small, large = runs[name, ROW_LAYERS[0]], runs[name, ROW_LAYERS[1]]
        assert large.steps == small.steps > 0, name
        assert not _grown(small.reads, large.reads), (name, "read-backs per layer", _grown(small.reads, large.reads))
        uploads = _grown(small.uploads, large.uploads)
        assert uploads == model_uploads, (name, "uploads per layer over hf's", uploads, model_uploads)
    speculated = {name: sum(s["speculated"] for s in sample_stats(run.requests)) for (name, layers), run in runs.items()
                  if layers == ROW_LAYERS[1] and name != "hf"}
    assert speculated["shared prefill"] > 0 and speculated["static"] > 0
    if kernel == "model":
        assert speculated["dynamic"] > 0 and speculated["always"] > 0 and speculated["baseline"] == 0
