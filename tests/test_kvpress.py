"""kvpress's presses as drafts (approx=kvpress:<Press>): importing kvpress leaves transformers' attention functions
as they were; refused presses and bad arguments are one line before any model is built; every supported press keeps
alspec-check-approx's contract on the three families; and three presses equal drafts written independently of
kvpress: KnormPress the keys of smallest norm, StreamingLLMPress with n_sink = S the sink, SnapKVPress this
package's own SnapKV (docs/design.md, "kvpress's presses")."""

from __future__ import annotations

import dataclasses
import math
import sys
from dataclasses import dataclass

import pytest
import torch

from alspec_eval.approximations import Approximation, kvpress as drafts, make_approximation
from alspec_eval.config import SpeculationConfig
from alspec_eval.errors import ConfigError
from default_presses import PRESSES, press_args

# No skip without kvpress: scripts/bootstrap.sh installs it (pip install --no-deps kvpress), and these tests fail
# where it is missing.


def test_the_default_list_covers_every_supported_press():
    assert PRESSES == list(drafts.PRESSES)  # a press supported without its entry in the one list fails here


def test_importing_kvpress_leaves_the_attention_functions_as_they_were(monkeypatch):
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    for name in [m for m in sys.modules if m == "kvpress" or m.startswith("kvpress.")]:
        monkeypatch.delitem(sys.modules, name)  # import it afresh: its __init__ patches every attention function
    before = {name: ALL_ATTENTION_FUNCTIONS[name] for name in ALL_ATTENTION_FUNCTIONS}
    drafts.import_kvpress()
    assert "kvpress" in sys.modules
    assert {name: ALL_ATTENTION_FUNCTIONS[name] for name in ALL_ATTENTION_FUNCTIONS} == before


@pytest.mark.parametrize(("name", "says"), [
    ("kvpress:TOVAPress", "an oracle; use approx=topk"),
    ("kvpress:ObservedAttentionPress", "an oracle; use approx=topk"),
    ("kvpress:KVzapPress", "hub"),
    ("kvpress:QFilterPress", "hub"),
    ("kvpress:ExpectedAttentionStatsPress", "use kvpress:ExpectedAttentionPress"),
    ("kvpress:AdaKVPress", "is not a ScorerPress; use one of kvpress:KnormPress"),
    ("kvpress:Knorm", "is not a class of kvpress"),
])
def test_presses_it_cannot_run_are_refused_in_one_line(name, says):
    with pytest.raises(ConfigError, match=says) as err:
        SpeculationConfig(approx=name)
    assert "\n" not in str(err.value) and name in str(err.value)


def test_a_press_takes_its_own_arguments_typed_and_refuses_others():
    approx = SpeculationConfig(approx="kvpress:SnapKVPress", approx_args="window_size:4;kernel_size:3;recent:2",
                               window=8).approx
    assert (approx.window_size, approx.kernel_size, approx.recent) == (4, 3, 2)
    assert approx.name == "kvpress:SnapKVPress" and make_approximation(approx.name, approx.args()) == approx
    assert SpeculationConfig(approx="kvpress:RandomPress", approx_args="seed:none").approx.seed is None
    with pytest.raises(ConfigError, match="has no parameter 'page'"):
        SpeculationConfig(approx="kvpress:KnormPress", approx_args="page:4")
    with pytest.raises(ConfigError, match="recent:16 leaves no prompt key"):
        SpeculationConfig(approx="kvpress:SnapKVPress", approx_args="recent:16", window=8)
    with pytest.raises(ConfigError, match="is not a key-only press"):
        SpeculationConfig(approx="kvpress:CriticalKVPress", approx_args="press:SnapKVPress", window=8)


def test_labels_name_the_arguments_given_and_the_cost_follows_what_a_press_reads():
    snap = make_approximation("kvpress:SnapKVPress", "window_size:8")
    assert (snap.label, snap.slug) == ("kvpress:SnapKVPress window_size=8", "kvpress-SnapKVPress_window_size8")
    assert make_approximation("kvpress:KnormPress").label == "kvpress:KnormPress"
    assert make_approximation("kvpress:SnapKVPress", "recent:4").slug == "kvpress-SnapKVPress_r4"
    costs = {p: make_approximation(f"kvpress:{p}").keys_read(1000, 16) for p in ("KnormPress", "KeyDiffPress",
                                                                            "StreamingLLMPress", "RandomPress",
                                                                            "SnapKVPress")}
    assert costs == {"KnormPress": 1000, "KeyDiffPress": 1000, "StreamingLLMPress": 32, "RandomPress": 32,
                     "SnapKVPress": 32}


def test_a_draft_pickles_by_reference():
    import pickle

    approx = SpeculationConfig(**press_args("LagKVPress", 8), window=8).approx
    assert pickle.loads(pickle.dumps(approx)) == approx


def test_a_press_draws_the_same_random_numbers_whatever_the_callers_random_state():
    """RandomPress (and LeverageScore's sketch) draw from the global generator: seeded at every call, so a decode
    step and a scoring pass rank alike, and the caller's own random state is left as it was."""
    press = drafts.import_kvpress().RandomPress()
    keys = torch.zeros(1, 2, 10, 4)
    draws = []
    for seed in (1, 2):
        torch.manual_seed(seed)
        before = torch.get_rng_state()
        draws.append(drafts.score(press, None, None, keys, keys, {}))
        assert torch.equal(torch.get_rng_state(), before)
    assert torch.equal(*draws)


@pytest.mark.slow
@pytest.mark.parametrize("press", PRESSES)
def test_every_supported_press_keeps_the_contract(press, capsys):
    from alspec_eval.approx_check.cli import check

    approx = SpeculationConfig(window=8, **press_args(press, 8)).approx
    assert check(approx, 8, ["llama", "qwen2", "gemma2"])
    lines = capsys.readouterr().out.splitlines()[1:]
    paged = [line for line in lines if "a paged cache (vLLM)" in line]
    assert len(lines) == 3 * 7 and all(line.endswith(": ok") for line in lines if line not in paged), lines
    # a press that runs in vLLM selects there as from a contiguous cache; one that cannot says why
    assert all(line.endswith(f"not run ({approx.hf_only})" if approx.hf_only else ": ok") for line in paged), paged


@dataclass(frozen=True)
class SmallestNorms(Approximation):
    """The oracle of KnormPress, from its paper's rule alone: per KV head the 2S keys of smallest L2 norm among those
    a position sees, the earlier key first where norms tie (a norm within 2^-16 of the next smaller one ties with
    it: rounding apart)."""

    def keys_read(self, context, window):
        return context

    def select(self, query, key, rows, pos, pad, window, passed, prepared):
        chosen = []
        for row, p, a in zip(rows.tolist(), pos.tolist(), pad.tolist()):
            norms = torch.linalg.vector_norm(key[row, :, a:a + p + 1], dim=-1, dtype=torch.float32)
            chosen.append(torch.stack([a + torch.tensor(_tied_first([float(x) for x in n])[:2 * window])
                                       for n in norms]))
        return torch.stack(chosen), None


def _tied_first(norms: list[float]) -> list[int]:
    """Positions by norm, smallest first, a run of norms each within 2^-16 of the one before ordered by position."""
    order = sorted(range(len(norms)), key=lambda j: (norms[j], j))
    groups, group = [], 0
    for before, j in zip([None, *order], order):
        if before is not None and norms[j] - norms[before] > 2 ** -16 * max(abs(norms[j]), abs(norms[before])):
            group += 1
        groups.append((group, j))
    return [j for _, j in sorted(groups)]


def _rotated(key: torch.Tensor, positions: torch.Tensor, wide: bool) -> torch.Tensor:
    """RoPE of one key (D,) at ``positions``, rotated in float32 (HF's arithmetic) or in float64 and rounded (another
    engine's): the same norm but for rounding."""
    dim = key.shape[-1]
    kind = torch.float64 if wide else torch.float32
    angle = positions.to(kind)[:, None] / 10000 ** (torch.arange(0, dim, 2, dtype=kind) / dim)
    cos, sin = torch.cat([angle.cos()] * 2, -1), torch.cat([angle.sin()] * 2, -1)
    k = key.to(kind)
    return (k * cos + torch.cat([-k[dim // 2:], k[:dim // 2]]) * sin).float()


def test_knorm_keeps_the_same_keys_of_a_repeated_token_however_its_rotation_rounds():
    """A token's keys at layer 0 are one key rotated to each of its positions, their norms equal but for
    how an engine rounds the rotation; where the 2S cut falls inside that run, both roundings keep the token's
    earliest keys (a plain sort of the norms keeps others: the case this guards)."""
    torch.manual_seed(0)
    token, others = torch.randn(64), torch.randn(8, 64) * 3  # others: larger norms, ranked after the token's keys
    positions = torch.arange(40)
    repeated = positions[positions % 3 == 1]  # 13 occurrences; window 4 keeps 8 of them
    draft = make_approximation("kvpress:KnormPress")
    kept, plain = [], []
    for wide in (False, True):
        keys = torch.zeros(1, 1, 40, 64)
        keys[0, 0] = others[positions % 8]
        keys[0, 0, repeated] = _rotated(token, repeated, wide)
        layer = drafts.LayerInputs(None, torch.zeros_like(keys))
        index, _ = draft.select(None, keys, torch.tensor([0]), torch.tensor([39]), torch.tensor([0]), 4, (),
                                draft.prepare(keys, torch.tensor([0]), 4, None, layer))
        kept.append(index[0, 0].tolist())
        plain.append(keys[0, 0].norm(dim=-1).sort(stable=True).indices[:8].tolist())
    assert set(plain[0]) != set(plain[1])  # rounding alone reorders the run: a plain sort keeps other keys
    assert kept[0] == kept[1] == repeated[:8].tolist()


def test_ranked_ties_scores_within_rounding_and_nothing_wider():
    scores = torch.tensor([[2.0, -1.0, 2.0 * (1 - 2 ** -20), float("nan"), 2.0 * (1 - 2 ** -10), -float("inf"), 2.0]])
    assert drafts.ranked(scores, 7).tolist() == [[0, 2, 6, 4, 1, 5, 3]]  # -inf before NaN, which ranks last
    assert drafts.ranked(scores, 3).tolist() == [[0, 2, 6]] and drafts.ranked(scores, 9).shape[-1] == 7
    # a few best of many, runs of near-ties among them: the first of the whole ranking, in its order
    many = torch.randn(3, 2, 500, generator=torch.Generator().manual_seed(0)).round(decimals=1)
    many[..., ::7] *= 1 + 2 ** -20
    assert torch.equal(drafts.ranked(many, 40), drafts.ranked(many, 500)[..., :40])
    # a run of near-ties past the 2 keep best (one token's keys): every score sorted, the run earlier key first
    flat = torch.ones(2, 300)
    flat[:, ::3] += 2 ** -20
    flat[1, 250] = 2.0
    assert drafts.ranked(flat, 20).tolist() == [list(range(20)), [250, *range(19)]]
    # such a run starting at place keep: its earliest key (here its lowest score) is the last one kept
    run = torch.zeros(1, 300)
    run[0, 200:219] = torch.arange(29.0, 10.0, -1)  # places 0 to 18
    run[0, :100] = 1 + torch.arange(100) * 2 ** -22  # one group from place 19 to 118
    assert drafts.ranked(run, 20).tolist() == [[*range(200, 219), 0]]


def test_rows_ranked_in_one_call_rank_as_each_alone():
    """Rows of several lengths and left paddings ranked in one call (``outside`` their other keys) keep each row's
    own ranking, where a row scores its own keys -inf or NaN (CUR's and LagKV's can), past the fast path's
    candidates (a row of 20 keys, 16 kept) and within them."""
    g = torch.Generator().manual_seed(1)
    length, keep = 64, 16
    pad, pos = torch.tensor([0, 10, 3, 30]), torch.tensor([63, 40, 19, 33])
    scores = torch.randn(4, 2, length, generator=g).round(decimals=1)
    scores[0, 0, 5:30] = -math.inf
    scores[1, 1, 12:20] = math.nan
    scores[2, :, 5:15] = math.nan  # half a short row's keys: NaN ranks last, and before another row's keys
    own = drafts._outside(length, pos, pad)
    together = drafts.ranked(scores.masked_fill(own, 7.0), keep, own)  # outside scores are never read
    for r in range(4):
        alone = drafts.ranked(scores[r:r + 1, :, pad[r]:pad[r] + pos[r] + 1], keep) + pad[r]
        assert torch.equal(together[r:r + 1], alone), r


@pytest.fixture(scope="module")
def lam(model):
    """A lambda that accepts about half of the sink's decisions, so that both branches run."""
    from alspec_eval.approx_check.properties import median_ratio
    from helpers import PROMPTS, alspec_lm

    return median_ratio(alspec_lm(model, window=8), PROMPTS[0])


def _prompts() -> list[str]:
    from helpers import PROMPTS

    return [PROMPTS[0] * 3, PROMPTS[2]]  # one batch, the second row left padded by some 160 positions


PADDED = _prompts()


def _answers(model, approx, lam):
    from helpers import alspec_lm, gen_requests, ll_requests, sample_stats

    lm = alspec_lm(model, batch_size=2, window=8, approx=approx, **{"lambda": lam})
    gen, ll = gen_requests(PADDED, "padded") + gen_requests(), ll_requests()
    return lm.generate_until(gen), lm.loglikelihood(ll), sample_stats(gen), sample_stats(ll)


@pytest.mark.slow
@pytest.mark.parametrize(("press", "args", "oracle"), [
    ("KnormPress", {}, SmallestNorms()),
    ("StreamingLLMPress", {"n_sink": 8}, "sink"),
    ("SnapKVPress", {"window_size": 6, "kernel_size": 3, "recent": 4}, ("snapkv", {"observe": 6, "pool": 3, "recent": 4})),
])
def test_a_press_equals_a_draft_written_without_kvpress(model, lam, press, args, oracle):
    if isinstance(oracle, tuple):
        oracle = make_approximation(*oracle)
    draft = make_approximation(f"kvpress:{press}", args)
    got, want = _answers(model, draft, lam), _answers(model, oracle, lam)
    assert got[0] == want[0] and got[1] == want[1]  # generations and log-likelihoods, bit for bit
    assert got[2] == want[2] and got[3] == want[3]  # every request's decisions, per layer
    speculated = sum(stats["speculated"] for stats in got[2] + got[3])
    accepted = sum(stats["accepted"] for stats in got[2] + got[3])
    assert 0 < accepted < speculated, (accepted, speculated)  # both branches ran


def test_drafts_differ_from_their_press_defaults_only_where_asked():
    """A prompt-time draft's own parameter (recent) comes first; the rest are the press's, with its defaults."""
    fields = [f.name for f in dataclasses.fields(drafts.press_draft("SnapKVPress"))]
    assert fields == ["recent", "window_size", "kernel_size"]
    assert drafts.press_draft("SnapKVPress")().window_size == 64


@pytest.mark.slow  # builds a model
def test_a_family_whose_queries_kvpress_gets_wrong_is_refused(model):
    """Prompt-time presses recompute queries with q_norm for Qwen3 and Gemma 3 only: another family's query norm is
    refused, naming the family and the fix; Qwen3's is kept."""
    import copy

    import transformers

    draft = SpeculationConfig(**press_args("SnapKVPress", 8), window=8).approx
    module = copy.deepcopy(model.model.layers[0].self_attn)
    module.q_norm = torch.nn.Identity()  # a Llama attention with a query norm of its own, as OLMo 2's
    key = torch.zeros(1, 2, 12, 16)
    layer = drafts.LayerInputs(module, key, torch.zeros(1, 12, 64), (torch.zeros(1, 12, 16), torch.zeros(1, 12, 16)))
    with pytest.raises(ConfigError, match="LlamaAttention normalizes its queries"):
        draft.observe_prompt(None, key, 1.0, torch.tensor([12]), torch.tensor([0]), 0, layer)
    qwen3 = transformers.Qwen3Config(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    drafts.check_queries(transformers.models.qwen3.modeling_qwen3.Qwen3Attention(qwen3, 0))


@pytest.mark.slow
def test_a_prompt_time_press_scores_at_the_ratio_that_keeps_2s_minus_r_prompt_keys(model):
    """CompactorPress blends its two scores by the compression ratio unless told: the draft's ratio keeps 2S - R of
    the P prompt keys, 1 - (2S - R + 1/2) / P, so blending at that ratio changes nothing, and blending at 0 does
    (policy=always: A~ always, so the generations show which keys it chose)."""
    from helpers import PROMPTS, alspec_lm, gen_requests, sample_stats

    given = {"sink_size_start": 2, "sink_size_end": 2, "chunk_size": 8, "sketch_dimension": 8, "recent": 12}
    prompt = PROMPTS[0]  # 2S - R = 4 of some 80 keys: a ratio that forgot R (16 of them) blends otherwise
    runs = {}
    for blending in ("default", "ratio", 0.0):
        prompt_keys = len(alspec_lm(model, window=8).tok_encode(prompt))
        value = {"default": None, "ratio": 1 - (2 * 8 - 12 + 0.5) / prompt_keys}.get(blending, blending)
        lm = alspec_lm(model, window=8, policy="always",
                       approx=make_approximation("kvpress:CompactorPress", {**given, "blending": value}))
        requests = gen_requests([prompt])
        runs[blending] = (lm.generate_until(requests), sample_stats(requests))
    assert runs["default"] == runs["ratio"] and runs["default"] != runs[0.0]


def test_knorm_scores_each_key_once_and_selects_as_position_by_position(monkeypatch):
    """KnormPress's score of a key reads that key alone, so its draft scores every key of a layer once (prepare: one
    call of the press for every row), and each position ranks its own keys: the keys the press keeps scoring at
    every position (the key-only presses' rule), on left-padded rows with many positions each."""
    torch.manual_seed(0)
    draft = make_approximation("kvpress:KnormPress")
    assert type(draft).__mro__[1] is drafts.KeyAlonePress
    keys = torch.randn(2, 2, 60, 16)
    pad = torch.tensor([0, 7])
    rows = torch.tensor([0, 0, 1, 1, 0, 1, 1])
    pos = torch.tensor([20, 59, 9, 40, 33, 52, 16])  # out of order, two rows interleaved
    calls = []
    scored = drafts.score
    monkeypatch.setattr(drafts, "score", lambda *a, **k: calls.append(tuple(a[3].shape[:3])) or scored(*a, **k))
    prepared = draft.prepare(keys, pad, 4, None)
    once, _ = draft.select(None, keys, rows, pos, pad[rows], 4, (), prepared)
    assert calls == [(2, 2, 60)]  # the layer's keys, once, and none at a position
    each, _ = drafts.KeyScoredPress.select(draft, None, keys, rows, pos, pad[rows], 4, (),
                                           (drafts.LayerInputs(None, keys.clone()), None))
    assert len(calls) == 1 + len(pos) and torch.equal(once, each)
    assert all(bool((once[m] - pad[rows[m]] <= pos[m]).all()) for m in range(len(pos)))  # never a later key


@pytest.mark.parametrize("cross_scoring", [False, True])
def test_lagkv_scores_kept_across_steps_are_kvpress_s_own_and_each_chunk_is_scored_once(cross_scoring, monkeypatch):
    """LagKV's scores assembled from a kept store (a chunk scored once, when its next chunk is whole; the sinks and
    the two newest chunks 1) against kvpress's call on all of a context's keys, bit for bit, at every length from
    the contexts it scores by position to eleven chunks: the first settled length exactly, one short of it and one
    past, and a store first filled at a long context then extended. Scoring calls: one where a chunk settles."""
    approx = SpeculationConfig(approx="kvpress:LagKVPress", window=4,
                               approx_args=f"n_sink:2;lag_size:4;cross_scoring:{str(cross_scoring).lower()}").approx
    torch.manual_seed(0)
    keys, values = torch.randn(1, 2, 46, 8), torch.randn(1, 2, 46, 8)
    calls = []
    monkeypatch.setattr(drafts, "score", lambda *a: calls.append(a[3].shape[2]) or _kvpress_score(*a))

    def full(length):
        return _kvpress_score(approx.make_press(8, length), None, None, keys[:, :, :length], values[:, :, :length],
                              {})[0]

    for start in (1, 30):  # a store filled from the first step, and one first filled at 30 keys
        kept: dict = {}
        for length in range(start, 47):
            calls.clear()
            got = approx.row_scores(keys[:, :, :length], values[:, :, :length], 4, None, kept)
            assert torch.equal(got, full(length)), (start, length)
            settled = approx.settled(length)
            assert settled == (0 if length < 10 else 2 + ((length - 2) // 4 - 1) * 4)
            grew = settled and settled != approx.settled(length - 1)
            assert len(calls) == (1 if not settled or grew or length == start else 0), (length, calls)
        assert kept["scores"].shape[-1] == approx.settled(46) == 42
    assert approx.settled(9) == 0 and approx.settled(10) == 6 and approx.settled(14) == 10  # 2 + 2 x 4: the first


_kvpress_score = drafts.score


@pytest.mark.parametrize("n_sink", [0, 1, 15])
def test_streamingllm_reads_as_ranges_the_keys_its_press_keeps(n_sink):
    """StreamingLLMPress declares keys_by_position: vLLM reads its ranges, the first n_sink keys and the newest
    2S - n_sink, and never calls the press; on a paged cache those are the keys the press keeps on a contiguous one
    (alspec-check-approx's paged property), with no sink, one, and all but one of the 2S; n_sink = 2S is refused."""
    from alspec_eval.approx_check.paged import paged_equals_contiguous

    approx = SpeculationConfig(approx="kvpress:StreamingLLMPress", approx_args=f"n_sink:{n_sink}", window=8).approx
    assert approx.keys_by_position and paged_equals_contiguous(approx, 4, 2, 16, 8) == []
    starts, ends, widths = approx.position_ranges(torch.tensor([16, 40]), 8, 1)
    assert sum(widths) == 16 and ((ends - starts) == torch.tensor(widths)).all()
    with pytest.raises(ConfigError, match="n_sink:16 leaves no recent key"):
        SpeculationConfig(approx="kvpress:StreamingLLMPress", approx_args="n_sink:16", window=8)


def test_knorm_scores_its_keys_without_the_seeded_random_state():
    """Knorm's score reads its keys alone and draws nothing, so its draft calls the press without forking and
    seeding the random state (vLLM scores every key a step writes, at every layer): the same scores as the seeded
    call, and the caller's random state untouched."""
    approx = make_approximation("kvpress:KnormPress")
    keys = torch.randn(2, 3, 40, 16, generator=torch.Generator().manual_seed(4))
    torch.manual_seed(11)
    before = torch.get_rng_state()
    got = approx.scores(keys)
    assert torch.equal(torch.get_rng_state(), before)
    want = drafts.score(approx.make_press(40, 40), None, None, keys, None, {})
    assert torch.equal(got, want)


@pytest.mark.parametrize("args", ["", "num_sinks:2;local_window_size:5;leverage_type:key",
                                  "use_local_approximation:false;leverage_type:value;num_sinks:0"])
def test_cur_scores_from_its_keys_norms_are_kvpress_s_own(args):
    """CURPress's draft scores a row from each key's and value's squared norms (what a paged cache keeps beside
    them): bit for bit kvpress's call on the row's keys and values, in float32 and bfloat16, at lengths around its
    local window and its sinks and past 4K; rows of several lengths scored in one call (junk past a shorter row's
    length) score as each alone; and its select keeps what the press's own call on each row's keys keeps, on
    left-padded rows. With use_random_leverage nothing is kept: the press is called."""
    approx = SpeculationConfig(approx="kvpress:CURPress", approx_args=args or None, window=4).approx
    g = torch.Generator().manual_seed(2)
    for dtype in (torch.float32, torch.bfloat16):
        for n in (1, 2, 4, 5, 6, 15, 16, 17, 33, 4099):
            keys = (3 * torch.randn(1, 3, n, 16, generator=g)).to(dtype)
            values = torch.randn(1, 3, n, 16, generator=g).to(dtype)
            want = drafts.score(approx.make_press(8, n), None, None, keys, values, {})
            norms = approx.summarize(keys[0].transpose(0, 1)[:, None], values[0].transpose(0, 1)[:, None])
            alone = approx.leverage(norms.transpose(0, 1)[None], [n])
            junk = torch.cat([norms.transpose(0, 1)[None], torch.rand(1, 3, 9, 2, generator=g).to(dtype)], 2)
            together = approx.leverage(torch.cat([junk, junk]), [n, n + 9])[:1, :, :n]
            assert torch.equal(alone, want) and torch.equal(together, want), (dtype, n)
    keys, values = torch.randn(2, 2, 50, 8, generator=g), torch.randn(2, 2, 50, 8, generator=g)
    pad, rows = torch.tensor([0, 7]), torch.tensor([0, 1, 1, 0])
    pos = torch.tensor([49, 42, 9, 3])
    layer = drafts.LayerInputs(None, values)
    got, _ = approx.select(None, keys, rows, pos, pad[rows], 4, (), approx.prepare(keys, pad, 4, None, layer))
    each, _ = drafts.KeyScoredPress.select(approx, None, keys, rows, pos, pad[rows], 4, (), (layer, None))
    assert torch.equal(got, each)
    projected = SpeculationConfig(approx="kvpress:CURPress", approx_args="use_random_leverage:true", window=4).approx
    assert projected.kept_page() is None
    assert torch.equal(projected.select(None, keys, rows, pos, pad[rows], 4, (),
                                        projected.prepare(keys, pad, 4, None, layer))[0],
                       drafts.KeyScoredPress.select(projected, None, keys, rows, pos, pad[rows], 4, (),
                                                    (layer, None))[0])


def test_keydiff_scores_as_kvpress_s_own_call_with_its_common_passes_taken_once():
    """KeyDiff's draft scores a row with kvpress's normalize-then-cosine operations, the norm and unit keys they share
    taken once: bit for bit the press's own call, in float32 and bfloat16, at lengths 1 to past 4K, on a row sliced
    out of a left-padded batch (as both engines hand it), with keys of norm 0, between F.normalize's eps and the
    cosine's, and below both, and a row whose mean unit key is shorter than the cosine's eps."""
    approx = make_approximation("kvpress:KeyDiffPress")
    g = torch.Generator().manual_seed(4)
    for dtype in (torch.float32, torch.bfloat16):
        for n in (1, 2, 3, 17, 64, 4099):
            batch = (3 * torch.randn(2, 3, n + 9, 64, generator=g)).to(dtype)
            for keys in (batch[1:, :, 9:], batch[:1, :, :n]):
                if n >= 4:
                    keys = keys.clone()
                    keys[0, 0, 1], keys[0, 1, 2], keys[0, 2, 3] = 0, keys[0, 1, 2] * 1e-10, keys[0, 2, 3] * 1e-20
                want = drafts.score(approx.make_press(8, n), None, None, keys, None, {})[0]
                got = approx.row_scores(keys, None, 4, None, None)
                assert got.dtype == want.dtype and torch.equal(got, want), (dtype, n)
        key = batch[0, :, :1]
        cancelled = torch.cat([key, -key, key * 1e-22], 1)[None]  # mean unit key: a third of the last's, below eps
        want = drafts.score(approx.make_press(8, 3), None, None, cancelled, None, {})[0]
        assert torch.equal(approx.row_scores(cancelled, None, 4, None, None), want), dtype
