"""The registry of approximations: every built-in is an entry of one interface (the one list of
default_approximations.py covers it, and the independent oracle has each), a user's class is found by
register_approximation, by an entry point of another package or by pkg.module:Class, its parameters come from
approx_args in the static_layers syntax, and a row, a cell record and a config round-trip it."""

from __future__ import annotations

import importlib.metadata
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

import approx_oracle as oracle
from alspec_eval import Approximation, register_approximation
from alspec_eval.approximations import make_approximation, name_of, names, registry
from alspec_eval.approximations import catalog as registered
from alspec_eval.config import ConfigError, SpeculationConfig
from alspec_eval.rows import Row
from default_approximations import APPROXIMATIONS, approx_args

TESTS = Path(__file__).parent


@dataclass(frozen=True)
class Every(Approximation):
    """A user's approximation with a parameter of each type approx_args converts."""

    stride: int = 2
    scale: float = field(default=0.5, metadata={"short": "s", "label": "σ"})
    causal: bool = True
    tag: str = "x"
    description = "every {stride}th key"

    def keys_read(self, context: int, window: int) -> float:
        return 2 * window

    def select(self, query, key, rows, pos, pad, window, passed, prepared):
        index = pad[:, None] + (pos[:, None] - self.stride * torch.arange(2 * window)).clamp(min=0)
        return index[:, None, :], None


def test_the_default_list_and_the_oracle_cover_the_registry():
    assert APPROXIMATIONS == names()  # a built-in added to the registry needs its entry in the one list
    for name in APPROXIMATIONS:  # and its independent reference (approx_oracle.py, or one module of its own)
        assert name in oracle.APPROXES or hasattr(oracle, f"{name}_ratio") or (TESTS / f"{name}_oracle.py").exists(), name
    for name in APPROXIMATIONS:
        approx = SpeculationConfig(window=8, **approx_args(name, 8)).approx
        assert approx.name == name and name_of(type(approx)) == name and make_approximation(name).name == name


def test_registering_a_class_makes_its_name_an_approx(monkeypatch):
    monkeypatch.setattr(registered.APPROXIMATIONS, "_entries", dict(registered.APPROXIMATIONS._entries))
    register_approximation("every", Every)
    config = SpeculationConfig(approx="every", approx_args="stride:3;scale:0.25;causal:false;tag:y")
    assert config.approx == Every(stride=3, scale=0.25, causal=False, tag="y")
    assert config.to_dict()["approx"] == "every"
    assert config.to_dict()["approx_args"] == {"stride": 3, "scale": 0.25, "causal": False, "tag": "y"}
    assert names()[-1] == "every"
    row = Row.dynamic(0.1, config.approx)
    assert (row.name, row.label) == ("lambda_0.1_every_stride3_s0.25_causalFalse_tagy",
                                     "λ = 0.1 · every stride=3 σ=0.25 causal=False tag=y")
    record = row.record()
    assert Row.from_record(record["policy"], record["lambda"], approx=record["approx"],
                           approx_args=record["approx_args"]) == row
    register_approximation("every", Every)  # the same class again: nothing changes
    with pytest.raises(ValueError, match="already registered as test_approximation_registry:Every"):
        register_approximation("every", "somewhere:Else")
    with pytest.raises(TypeError, match="not a subclass of Approximation"):
        register_approximation("bad", int)
    with pytest.raises(ValueError, match="plain name"):
        register_approximation("a:b", Every)


def test_a_class_by_its_path_and_by_an_entry_point(monkeypatch):
    by_path = SpeculationConfig(approx="test_approximation_registry:Every", approx_args={"stride": 4}).approx
    assert by_path == Every(stride=4) and by_path.name == "test_approximation_registry:Every"
    assert Row.dynamic(0.1, by_path).name == "lambda_0.1_test_approximation_registry-Every_stride4_s0.5_causalTrue_tagx"
    point = importlib.metadata.EntryPoint("every", "test_approximation_registry:Every", registry.ENTRY_POINTS)
    monkeypatch.setattr(registry, "entry_points", lambda group: [point] if group == registry.ENTRY_POINTS else [])
    assert "every" in names() and SpeculationConfig(approx="every").approx == Every()


@pytest.mark.parametrize(("approx", "args", "message"), [
    ("every2", None, "approx='every2' is unknown; use one of sink, local, quest, topk, snapkv, vattention, kvpress:<Press> (a kvpress ScorerPress), or pkg.module:Class"),
    ("test_approximation_registry:Every", "stride:two", "approx_args stride='two' is not an int"),
    ("test_approximation_registry:Every", "scale:x", "approx_args scale='x' is not a float"),
    ("test_approximation_registry:Every", "causal:maybe", "approx_args causal='maybe' is not a bool"),
    ("test_approximation_registry:Every", "strides:2", "has no parameter 'strides'; its parameters: stride (default 2)"),
    ("test_approximation_registry:Every", "stride", "'stride' is not key:value; write e.g. approx_args=stride:2;scale:0.5"),
    ("test_approximation_registry:Nothing", None, "cannot load test_approximation_registry:Nothing"),
    ("sink", "page:4", "sink has no parameter 'page'; its parameters: none"),
])
def test_bad_approximations_and_arguments_name_the_value_and_the_fix(approx, args, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        SpeculationConfig(approx=approx, approx_args=args)


def test_weights_are_declared_and_only_where_select_computes_the_keys():
    """A draft returns (index, valid, log_weight) exactly where it declares weighted; one that also declares a path
    that reads no weights (keys by position, a fused kernel, the TT op) is refused when its class is defined."""
    from alspec_eval.approximations import selection
    from alspec_eval.approximations.sink import Sink
    from alspec_eval.approximations.vattention import VAttention

    index, valid, weight = torch.zeros(1, 1, 2, dtype=torch.long), None, torch.zeros(1, 1, 2)
    assert selection(Sink(), (index, valid))[2] is None
    assert selection(VAttention(), (index, valid, weight))[2] is weight
    with pytest.raises(TypeError, match=r"sink.select returned 3 tensors: .* where it declares weighted = True"):
        selection(Sink(), (index, valid, weight))
    with pytest.raises(TypeError, match=r"vattention.select returned 2 tensors"):
        selection(VAttention(), (index, valid))
    for declared in ("keys_by_position", "fused_kernel", "tt_op"):
        with pytest.raises(TypeError, match=f"declares weighted and {declared}: .* read no weights"):
            dataclass(frozen=True)(type("Both", (Approximation,), {"weighted": True, declared: True}))


@pytest.mark.slow
def test_importing_the_package_loads_no_approximation_and_no_torch():
    code = ("import sys, alspec_eval; from alspec_eval.approximations import names; names(); "
            "print('torch' in sys.modules, any(m.startswith('alspec_eval.approximations.') and "
            "m.rsplit('.', 1)[1] in ('sink', 'local', 'quest', 'topk') for m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["False", "False"]


def test_a_draft_that_ranks_by_scores_defines_how():
    """ranks_by_scores without select_scored is refused when the class is defined; top-k's select is its
    select_scored on semantics.key_scores of its keys."""
    from alspec_eval import semantics
    from alspec_eval.approximations.topk import TopK

    with pytest.raises(TypeError, match="declares ranks_by_scores but no select_scored"):
        dataclass(frozen=True)(type("Scored", (Approximation,), {"ranks_by_scores": True}))
    g = torch.Generator().manual_seed(0)
    query, key = torch.randn(3, 6, 8, generator=g), torch.randn(2, 2, 40, 8, generator=g)
    rows, pos, pad = torch.tensor([0, 1, 1]), torch.tensor([30, 20, 35]), torch.tensor([0, 3])[[0, 1, 1]]
    scores = semantics.key_scores(query, key.index_select(0, rows))
    assert torch.equal(TopK().select(query, key, rows, pos, pad, 4, (), None)[0],
                       TopK().select_scored(scores, rows, pos, pad, 4, (), None)[0])
