"""The speculator's last steps are one code for every path: a decode step through a fused kernel (kernel=torch)
commits and records through the same methods as the gathered path (kernel=model), and the kernel that runs is the
one the draft returns from ``fused_decode``. Each test changes one of them and watches both paths follow."""

from __future__ import annotations

import pytest
import torch

from alspec_eval import semantics
from alspec_eval.approx_check.models import tiny_model
from alspec_eval.compat import with_cache
from alspec_eval.approximations.sink import Sink
from alspec_eval.region import DecodeRegion
from alspec_eval.speculator import Speculator
from alspec_eval.stats import ACCEPTED, REJECTED
from helpers import alspec_lm

pytestmark = pytest.mark.slow  # builds models

PATHS = ["model", "torch"]  # gathered A~ from the model's attention; the fused decode kernel
PROMPT = 40  # tokens before the decode step: past 2S = 16, so every layer speculates


@pytest.fixture(scope="module")
def model() -> torch.nn.Module:
    return tiny_model(layers=3)


def decode_step(lm, spec_start: list[int] | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The logits of one decode step (one query per row, the fused path where the kernel has one) of identical rows,
    one per ``spec_start`` (the row's region starts there; None: one row, not speculated), after an exact prefill,
    and the step's decision codes (row, layer)."""
    rows = 1 if spec_start is None else len(spec_start)
    ids = (torch.arange(3, 3 + PROMPT + 1)[None] % 90 + 3).expand(rows, -1)
    with torch.no_grad():
        cache = with_cache(lm.model, lm.model(ids[:, :-1], use_cache=True).past_key_values)
        if spec_start is None:
            return lm.model(ids[:, -1:], **cache).logits, None
        with lm.speculator.speculating(DecodeRegion.build([0] * rows, spec_start, tokens=ids), lm.spec_config) as trace:
            logits = lm.model(ids[:, -1:], **cache).logits
    return logits, trace.codes[:, -1]


@pytest.mark.parametrize("kernel", PATHS)
def test_both_paths_commit_through_the_one_commit(model, kernel, monkeypatch):
    lm = alspec_lm(model, policy="always", kernel=kernel)
    exact, _ = decode_step(lm)
    committed, codes = decode_step(lm, [PROMPT])
    assert (codes == ACCEPTED).all() and not torch.allclose(committed, exact, atol=1e-4)  # A~ went on
    monkeypatch.setattr(semantics, "commit", lambda exact, approx, accept: exact)  # a commit that keeps A
    kept, codes = decode_step(lm, [PROMPT])
    assert (codes == ACCEPTED).all()
    torch.testing.assert_close(kept, exact, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kernel", PATHS)
def test_both_paths_record_through_the_one_record(model, kernel, monkeypatch):
    lm = alspec_lm(model, policy="always", kernel=kernel)
    recorded = []
    record = Speculator.record
    monkeypatch.setattr(Speculator, "record", staticmethod(
        lambda step, layer, decisions: recorded.append(layer) or record(step, layer, decisions)))
    _, codes = decode_step(lm, [PROMPT])
    assert recorded == [0, 1, 2] and (codes == ACCEPTED).all()


@pytest.mark.parametrize("kernel", PATHS)
def test_a_layer_decided_without_measuring_is_recorded_rejected_on_both_paths(model, kernel):
    """policy=static's exact layers: A, recorded as rejected (the plan's -inf), as its approximated layer is accepted."""
    lm = alspec_lm(model, policy="static", static_layers="1", kernel=kernel)
    _, codes = decode_step(lm, [PROMPT])
    assert codes[0].tolist() == [REJECTED, ACCEPTED, REJECTED]


@pytest.mark.parametrize("kernel", PATHS)
def test_a_row_outside_its_region_continues_with_a_even_where_lambda_is_inf(model, kernel):
    """The fused kernel decides every batch row; only the speculated ones may continue with A~ (under lambda = inf
    the kernel accepts the others all the same)."""
    lm = alspec_lm(model, policy="always", kernel=kernel)
    assert (lm.speculator.decode_kernel is None) == (kernel == "model")  # the fused path takes decode steps
    exact, _ = decode_step(lm)
    ours, codes = decode_step(lm, [PROMPT, PROMPT + 5])  # row 1's region starts later: this step is outside it
    assert (codes[0] == ACCEPTED).all() and not (codes[1] == ACCEPTED).any()
    assert not torch.allclose(ours[0], exact[0], atol=1e-4)  # A~ went on in row 0
    torch.testing.assert_close(ours[1], exact[0], atol=1e-5, rtol=1e-5)  # row 1: A, as the model


def test_the_kernel_the_draft_returns_is_the_kernel_that_runs(model, monkeypatch):
    """A draft may hand back another kernel than the one it is offered (one of its own, a wrapped one)."""
    lm = alspec_lm(model, policy="always", kernel="torch")
    plain, _ = decode_step(lm, [PROMPT])
    calls = []
    offered = Sink.fused_decode

    def fused_decode(self, kernel):
        given = offered(self, kernel)
        return None if given is None else lambda *args, **kwargs: calls.append(1) or given(*args, **kwargs)

    monkeypatch.setattr(Sink, "fused_decode", fused_decode)
    wrapped, codes = decode_step(lm, [PROMPT])
    assert len(calls) == 3 and (codes == ACCEPTED).all()  # once per layer
    torch.testing.assert_close(wrapped, plain, atol=0, rtol=0)


def test_the_geometry_comes_from_the_kernel_that_runs(model, monkeypatch):
    """A draft's kernel with a ``prepare`` of its own gets that geometry once per pass, whatever the offered kernel
    has (kernel=torch: no prepare)."""
    lm = alspec_lm(model, policy="always", kernel="torch")
    assert getattr(lm.speculator.decode_kernel, "prepare", None) is None
    plain, _ = decode_step(lm, [PROMPT])
    prepared, seen = [], []
    offered = Sink.fused_decode

    class Own:
        def __init__(self, given):
            self.given = given

        def prepare(self, cur_pos, window, window_align, start):
            prepared.append(1)
            return "geometry of the draft's kernel"

        def __call__(self, *args, geometry=None, **kwargs):
            seen.append(geometry)
            return self.given(*args, **kwargs)

    monkeypatch.setattr(Sink, "fused_decode", lambda self, kernel: (lambda k: None if k is None else Own(k))(
        offered(self, kernel)))
    ours, codes = decode_step(lm, [PROMPT])
    assert prepared == [1] and seen == ["geometry of the draft's kernel"] * 3 and (codes == ACCEPTED).all()
    torch.testing.assert_close(ours, plain, atol=0, rtol=0)
