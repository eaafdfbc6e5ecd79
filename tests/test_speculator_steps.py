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
from alspec_eval.stats import ACCEPTED
from helpers import alspec_lm

pytestmark = pytest.mark.slow  # builds models

PATHS = ["model", "torch"]  # gathered A~ from the model's attention; the fused decode kernel
PROMPT = 40  # tokens before the decode step: past 2S = 16, so every layer speculates


@pytest.fixture(scope="module")
def model() -> torch.nn.Module:
    return tiny_model(layers=3)


def decode_step(lm, speculate: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The logits of one decode step (one query per row, the fused path where the kernel has one) after an exact
    prefill, and its decision codes per layer (None: not speculated)."""
    ids = torch.arange(3, 3 + PROMPT + 1)[None] % 90 + 3
    with torch.no_grad():
        cache = with_cache(lm.model, lm.model(ids[:, :-1], use_cache=True).past_key_values)
        if not speculate:
            return lm.model(ids[:, -1:], **cache).logits, None
        with lm.speculator.speculating(DecodeRegion.build([0], [PROMPT]), lm.spec_config) as trace:
            logits = lm.model(ids[:, -1:], **cache).logits
    return logits, trace.codes[0, -1]


@pytest.mark.parametrize("kernel", PATHS)
def test_both_paths_commit_through_the_one_commit(model, kernel, monkeypatch):
    lm = alspec_lm(model, policy="always", kernel=kernel)
    exact, _ = decode_step(lm, speculate=False)
    committed, codes = decode_step(lm, speculate=True)
    assert (codes == ACCEPTED).all() and not torch.allclose(committed, exact, atol=1e-4)  # A~ went on
    monkeypatch.setattr(semantics, "commit", lambda exact, approx, accept: exact)  # a commit that keeps A
    kept, codes = decode_step(lm, speculate=True)
    assert (codes == ACCEPTED).all()
    torch.testing.assert_close(kept, exact, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kernel", PATHS)
def test_both_paths_record_through_the_one_record(model, kernel, monkeypatch):
    lm = alspec_lm(model, policy="always", kernel=kernel)
    recorded = []
    record = Speculator.record
    monkeypatch.setattr(Speculator, "record", staticmethod(
        lambda step, layer, decisions: recorded.append(layer) or record(step, layer, decisions)))
    _, codes = decode_step(lm, speculate=True)
    assert recorded == [0, 1, 2] and (codes == ACCEPTED).all()


def test_the_kernel_the_draft_returns_is_the_kernel_that_runs(model, monkeypatch):
    """A draft may hand back another kernel than the one it is offered (one of its own, a wrapped one)."""
    lm = alspec_lm(model, policy="always", kernel="torch")
    plain, _ = decode_step(lm, speculate=True)
    calls = []
    offered = Sink.fused_decode

    def fused_decode(self, kernel):
        given = offered(self, kernel)
        return None if given is None else lambda *args, **kwargs: calls.append(1) or given(*args, **kwargs)

    monkeypatch.setattr(Sink, "fused_decode", fused_decode)
    wrapped, codes = decode_step(lm, speculate=True)
    assert len(calls) == 3 and (codes == ACCEPTED).all()  # once per layer
    torch.testing.assert_close(wrapped, plain, atol=0, rtol=0)
