"""Drafts whose keys leave [0, pos] (tests/bounds_drafts.py) on every verification path over a paged
cache: each path reads the keys cut to [0, pos] (on the CPU kernel a range 100,000 positions before the context
was a SIGSEGV; ranges past the query read later keys, the next request's blocks or garbage), and every breach is
counted in ``Settings.breaches`` for the driver. Torch only (the float64 oracle of test_paged.py); no vLLM."""

from __future__ import annotations

import pytest
import torch

from alspec_eval.approximations.local import Local
from alspec_eval.stats import ACCEPTED, REJECTED
from alspec_eval.vllm.paged import Settings, StepRows
from alspec_eval.vllm.verifiers import VERIFIERS, verify_layer
from bounds_drafts import BeforeContext, PastQuery
from broken_approximation import PeeksAhead
from test_paged import attend64, build_step, oracle, paths, split_lambda

S = 8


def verified(step: dict, approx, lam: float, path: str) -> tuple[torch.Tensor, torch.Tensor, tuple[int, int]]:
    """verify_layer on one layer of the step: codes and d/n per token (-1 and NaN where not a row), and what the
    settings counted."""
    settings = Settings(thresholds=(lam,), window=S, window_align=1, approx=approx)
    rows = StepRows.build(step["qsl"], step["seq_lens"], step["starts"], torch.arange(5))
    codes, ratios = verify_layer(step["query"], step["output"].clone(), step["cache"], step["layout"], step["table"],
                                 step["N"], rows, settings, 0, step["scale"], verifier=VERIFIERS[path]())
    by_token = torch.full((len(step["tok"]),), -1, dtype=codes.dtype), torch.full((len(step["tok"]),), torch.nan)
    by_token[0][rows.token], by_token[1][rows.token] = codes, ratios
    return *by_token, settings.breaches.take()


def live(step: dict) -> list[tuple[int, int]]:
    """(token, position) of the step's measured rows (at or past their start, past the trivial edge)."""
    return [(t, p) for t, (r, p) in enumerate(step["tok"]) if p >= step["starts"][r] and p + 1 > 2 * S]


@pytest.mark.parametrize("layout", ["plain", "cpu-vec"])
def test_ranges_past_the_query_are_read_as_local_on_every_path(layout):
    """PastQuery's ranges end 4,096 positions past each query; cut to [0, pos] they are local's: every path (the CPU
    kernel, the Triton verifier, the tiles, the gathered keys) gives the oracle's local d/n, and counts every
    measured row once, at the step's last position."""
    step = build_step(layout, S)
    want = oracle(step, "local", 1)
    rows = live(step)
    lam = split_lambda([want[t][2] / want[t][3] for t, _ in rows])
    for path in paths(layout):
        codes, ratios, counted = verified(step, PastQuery(), lam, path)
        assert counted == (len(rows), max(p for _, p in rows)), path
        expected = torch.tensor([want[t][2] / want[t][3] for t, _ in rows], dtype=torch.float32)
        mine = [t for t, _ in rows]
        torch.testing.assert_close(ratios[mine], expected, rtol=1e-4, atol=0, msg=path)
        assert codes[mine].tolist() == [ACCEPTED if r <= lam else REJECTED for r in expected.tolist()], path


@pytest.mark.parametrize("layout", ["plain", "cpu-vec"])
def test_ranges_before_the_context_read_the_query_s_own_key_on_every_path(layout):
    """BeforeContext's ranges lie 100,000 positions before the context: nothing of them is readable, so each row
    reads its own key (A~ its value), on every path, and every measured row is counted once."""
    step = build_step(layout, S)
    rows = live(step)
    for path in paths(layout):
        _, ratios, counted = verified(step, BeforeContext(), 0.5, path)
        assert counted == (len(rows), max(p for _, p in rows)), path
        for t, p in rows:
            r = step["tok"][t][0]
            own = attend64(step["query"][t], step["K"][r], step["V"][r], [p], step["scale"])
            expected = ((own - step["A"][t]).norm() / step["A"][t].norm()).item()
            assert ratios[t].item() == pytest.approx(expected, rel=1e-4), (path, t)


class CutAhead(PeeksAhead):
    """PeeksAhead's keys moved into [0, pos] by the draft itself."""

    def select(self, query, key, rows, pos, pad, window, passed, prepared):
        index, valid = super().select(query, key, rows, pos, pad, window, passed, prepared)
        return torch.minimum(index, (pad + pos)[:, None, None]), valid


@pytest.mark.parametrize("layout", ["plain", "cpu-vec"])
def test_keys_a_draft_selects_past_the_query_are_read_cut(layout):
    """A draft that selects by content (PeeksAhead: the 2S keys ending one past the query, cut at the longest context
    read) reads, inside vLLM, the keys moved into [0, pos]: a draft that moves them itself decides the same bits;
    every row whose key past it exists in the read contexts (all but the step's longest) is counted."""
    step = build_step(layout, S)
    rows = live(step)
    longest = max(p for _, p in rows)
    _, ratios, counted = verified(step, PeeksAhead(), 0.5, "gathered")
    _, cut, clean = verified(step, CutAhead(), 0.5, "gathered")
    ahead = [p for _, p in rows if p < longest]
    assert clean == (0, -1) and counted == (len(ahead), max(ahead))
    assert ratios.isfinite().sum() == len(rows) and torch.equal(ratios.nan_to_num(-1), cut.nan_to_num(-1))


def test_a_draft_within_bounds_counts_nothing():
    """Local's ranges and keys lie in [0, pos]: nothing counted on any path (take reads (0, -1))."""
    step = build_step("cpu-vec", S)
    for path in paths("cpu-vec"):
        assert verified(step, Local(), 0.5, path)[2] == (0, -1), path
