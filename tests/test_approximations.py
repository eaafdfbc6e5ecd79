"""The approximations' own rules where the model-based tests cannot reach them (real scores never tie, the real
selections' masks never differ between KV heads, CPU runs install no fused kernel): ties take the earlier page or
key, a selection's per-KV-head mask reaches each query head as HF's repeat_kv maps it, and a fused decode kernel
(which computes the sink A~) never answers for another approximation."""

from __future__ import annotations

import math
import types
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from alspec_eval import semantics
from alspec_eval.approximations import Approximation
from alspec_eval.config import SpeculationConfig
from alspec_eval.plan import Plan
from alspec_eval.region import DecodeRegion
from default_approximations import APPROXIMATIONS, approx_args
from alspec_eval.passes import Pass
from alspec_eval.speculator import Session, Speculator


# S4: quest's sort must be stable (ties: the earlier page), on the code path, not only in the oracle
def test_quest_positions_ties_take_the_earlier_pages():
    window, page, pages = 8, 4, 30
    bounds = torch.zeros(2, 2, pages)  # every candidate page ties
    pos = torch.tensor([pages * page - 2, 50])
    positions, valid = semantics.quest_positions(bounds, pos, window, page)
    for r in range(2):
        cur = int(pos[r]) // page
        expected = [0, cur, 1, 2]  # page 0, the current page, then the smallest candidate pages
        for h in range(2):
            assert positions[r, h, ::page].tolist() == [p * page for p in expected]


# S12: topk's sort must be stable (ties: the earlier key) on the code path
def test_topk_positions_ties_take_the_earlier_keys():
    scores = torch.zeros(1, 2, 100)
    scores[..., 90:] = -torch.inf  # keys past pos
    assert semantics.topk_positions(scores, 8).tolist() == [[list(range(16))] * 2]


@pytest.mark.parametrize("keep", [1, 7, 63, 64, 65])
def test_best_first_is_the_stable_sorts_head(keep):
    """The partial selection against the sort it replaces, where ties are the rule: scores on a grid of 5 values,
    with -inf, -0.0 beside 0.0, and NaN of either sign; keep below, at and past L (64)."""
    torch.manual_seed(keep)
    scores = (torch.randint(-2, 3, (3, 4, 64)).float() * 0.5)
    scores[0, 0, ::3] = -torch.inf
    scores[0, 1, ::2] = -0.0
    scores[1, 0, 5], scores[1, 0, 9] = math.nan, -math.nan
    scores[2] = torch.randn(4, 64)  # no ties
    expected = scores.sort(dim=-1, descending=True, stable=True).indices[..., :keep]
    assert torch.equal(semantics.best_first(scores, keep), expected)


# P1: a selection's valid mask is per KV head; query head h must use KV head h // g's mask (repeat_kv)
@dataclass(frozen=True)
class _HeadMask(Approximation):
    """Keys 0..2S-1 for every KV head; KV head 1 marks its first 5 keys invalid, KV head 0 none."""

    def select(self, query, key, rows, pos, pad, window, passed, prepared):
        index = torch.arange(2 * window).expand(len(rows), key.shape[1], -1)
        valid = torch.ones_like(index, dtype=torch.bool)
        valid[:, 1, :5] = False
        return index, valid


def test_selection_masks_follow_repeat_kv():
    torch.manual_seed(0)
    hq, hkv, length, d = 4, 2, 40, 8
    q, k, v = torch.randn(1, hq, 1, d), torch.randn(1, hkv, length, d), torch.randn(1, hkv, length, d)
    spec = Speculator(1, {}, sdpa_attention_forward)
    config = SpeculationConfig(window=8, approx=_HeadMask())
    region = DecodeRegion.build([0], [0])
    spec._sessions.append(Session(config, region, Plan.uniform([0.0], 1)))
    step = Pass(1, length - 1, None, rows=torch.tensor([0]), cols=torch.tensor([0]), pos=torch.tensor([length - 1]),
                 pad=torch.tensor([0]))
    module = types.SimpleNamespace(is_causal=False, training=False, num_key_value_groups=hq // hkv)
    ours, _ = spec._approximate_rows(module, step, slice(0, 1), q, k, v, d ** -0.5, {})
    for h in range(hq):
        keys = range(16) if h // 2 == 0 else range(5, 16)
        kk, vv = k[0, h // 2, list(keys)], v[0, h // 2, list(keys)]
        expected = F.softmax(q[0, h, 0] @ kk.T * d ** -0.5, -1) @ vv
        torch.testing.assert_close(ours[0, h], expected, rtol=1e-5, atol=1e-6)


# P4: a fused (sink) decode kernel is never used for a selection
def test_fused_decode_is_the_sinks_only():
    from alspec_eval.kernels import select_kernel
    spec = Speculator(1, {}, sdpa_attention_forward, decode_kernel=select_kernel("torch", torch.device("cpu")))
    region = DecodeRegion.build([0], [0])
    for approx in APPROXIMATIONS:
        config = SpeculationConfig(window=8, **approx_args(approx, 8))
        fused = approx == "sink"
        with spec.speculating(region, config):
            assert spec.has_fused_decode() == fused, approx


# snapkv: ties between observation-window keys (all +inf) take the earlier key where the budget cuts through them
def test_snapkv_ties_in_the_observation_window_take_the_earlier_keys():
    from alspec_eval.approximations.prompt_scored import PromptRanking
    from alspec_eval.approximations.snapkv import SnapKV

    import approx_oracle as oracle

    snapkv, window, prompt, pos = SnapKV(observe=8, pool=3, recent=12), 8, 30, 40
    scores = torch.full((1, 1, prompt), 0.0)
    scores[..., :prompt - 8] = torch.arange(prompt - 8, dtype=torch.float)  # later prompt keys score higher
    scores[..., prompt - 8:] = torch.inf  # the observation window
    key = torch.zeros(1, 1, pos + 1, 4)
    index, valid = snapkv.select(torch.zeros(1, 1, 4), key, torch.tensor([0]), torch.tensor([pos]), torch.tensor([0]),
                                 window, (), PromptRanking.of(scores))
    kept = sorted(index[0, 0][valid[0, 0]].tolist())
    expected = oracle.snapkv_kept_keys([scores[0, 0].tolist()], pos, prompt, window, 12)[0]
    assert kept == expected and kept[:4] == [22, 23, 24, 25]



def test_host_values_come_from_the_hosts_copy_while_the_tensor_lives() -> None:
    """A tensor an engine made from the host's values (known_on_host) is read from that copy, by identity: another
    tensor with equal values reads its own, and the copy goes with the tensor."""
    import gc

    kept = len(semantics._HOST_VALUES)
    made = torch.tensor([5, 6])
    given = semantics.known_on_host(made, torch.tensor([1, 2]))  # values that differ: the test sees which is read
    assert given is made
    assert semantics.host_values(given) == [1, 2]
    assert semantics.host_values(torch.tensor([5, 6])) == [5, 6]
    del given, made
    gc.collect()
    assert len(semantics._HOST_VALUES) == kept


@pytest.mark.parametrize("rows", [[0, 1, 2], [2, 0, 1], [0, 0, 1], [1, 1, 1], [0, 1], [0, 2], "in order", "two in order"])
def test_rows_of_is_index_select(rows) -> None:
    """A draft's rows of a per-row tensor: the tensor itself, uncopied, exactly where the engine handed the rows in
    order (semantics.rows_in_order, for the whole batch; known on the host, nothing read back), else gathered, the
    rows 0, 1, 2 built otherwise among them."""
    batch = torch.randn(3, 2, 5)
    named = {"in order": 3, "two in order": 2}
    given = semantics.rows_in_order(named[rows], batch.device) if isinstance(rows, str) else torch.tensor(rows)
    got = semantics.rows_of(batch, given)
    assert torch.equal(got, batch.index_select(0, given))
    assert (got.data_ptr() == batch.data_ptr()) == (rows == "in order")
    assert torch.equal(semantics.rows_in_order(3, batch.device), torch.arange(3))
