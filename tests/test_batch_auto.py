"""--batch_size auto: lm-eval's probe batch runs outside speculation, and every output and statistic equals
batch size 1's."""

from __future__ import annotations

import pytest
from lm_eval.api.instance import Instance
from lm_eval.models.huggingface import HFLM

from default_approximations import APPROXIMATIONS, approx_args
from helpers import PROMPTS, alspec_lm, comparable, gen_requests, ll_requests, sample_stats
from alspec_eval.approx_check.models import tiny_model

pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore")]


def _rolling_requests() -> list[Instance]:
    return [Instance("loglikelihood_rolling", {}, (p * 2,), i, ("roll", i, 1)) for i, p in enumerate(PROMPTS)]


def _run(batch_size, **args):
    lm = alspec_lm(tiny_model(), batch_size=batch_size, window=4, **args)
    runs = {}
    for name, requests, method in (("gen", gen_requests(), lm.generate_until), ("ll", ll_requests(), lm.loglikelihood),
                                   ("roll", _rolling_requests(), lm.loglikelihood_rolling)):
        runs[name] = (method(requests), sample_stats(requests))
    return runs, lm.statistics()["tasks"], lm


@pytest.mark.parametrize("approx", APPROXIMATIONS)
def test_batch_auto_equals_batch_one(approx, monkeypatch):
    one, one_stats, _ = _run(1, **approx_args(approx, 4))
    probe_rows = []  # rows of every model call made inside lm-eval's probe
    model_call = HFLM._model_call

    def spy(self, inps, *args, **kwargs):
        if self._probing:
            probe_rows.append(inps.shape[0])
        return model_call(self, inps, *args, **kwargs)

    monkeypatch.setattr(HFLM, "_model_call", spy)
    auto, auto_stats, lm = _run("auto", max_batch_size=4, **approx_args(approx, 4))
    assert probe_rows and max(probe_rows) == 4  # lm-eval's probe ran, up to max_batch_size rows, through the adapter
    for name in one:  # the same text, decisions and (to float32 noise between batch shapes) log-likelihoods
        (answers, stats), (answers_one, stats_one) = auto[name], one[name]
        assert stats == stats_one, name
        if name == "gen":
            assert answers == answers_one
        else:
            assert [a if isinstance(a, float) else a[0] for a in answers] == pytest.approx(
                [a if isinstance(a, float) else a[0] for a in answers_one], abs=1e-4), name
    assert comparable(auto_stats) == one_stats
    assert all(t["total"]["speculated"] > 0 for t in one_stats.values())

