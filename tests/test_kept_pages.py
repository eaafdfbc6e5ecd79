"""Quest's page bounds, Knorm's key scores and CUR's squared norms kept beside a paged cache (alspec_eval.vllm.kept)
as an engine keeps them: made from the cache when the draft is configured (on a CPU worker, a block's when a step
first holds it), then the parts each step fills summarized again. After every step, every request's full pages have
the summaries the draft's own ``prepare`` computes from its contiguous keys, bit for bit: through prompts prefilled
in chunks, decode steps, a prefix shared by two requests, a block freed and written by another request, pages of one
key, pages within a block and across blocks, in both layouts (the plain one also as the non-contiguous view of an
NHD allocation, FlashAttention's default on CUDA). Torch only, no vLLM."""

from __future__ import annotations

import math

import pytest
import torch

from alspec_eval.approx_check.paged import _write
from alspec_eval.approximations import LayerInputs
from alspec_eval.config import SpeculationConfig
from alspec_eval.vllm import kept
from alspec_eval.vllm.paged import CpuVecLayout, PlainLayout

HEADS, DIM = 2, 8
PRESS = {"knorm": "KnormPress", "cur": "CURPress"}  # kvpress's presses that keep a summary of each key
LAYOUTS = [(PlainLayout(), False), (PlainLayout(), True), (CpuVecLayout(), False)]


class Engine:
    """A paged cache of junk, requests written step by step through a block table, and the kept summaries."""

    def __init__(self, approx, layout, block_size: int, blocks: int = 40, seed: int = 0, nhd: bool = False,
                 dtype: torch.dtype = torch.float32) -> None:
        self.g = torch.Generator().manual_seed(seed)
        self.approx, self.layout, self.block_size, self.dtype = approx, layout, block_size, dtype
        self.cache = torch.randn(blocks, HEADS, block_size, 2 * DIM, generator=self.g).to(dtype)  # junk nothing wrote
        if nhd:  # FlashAttention's default on CUDA: the (blocks, Hkv, N, 2D) view of an NHD allocation
            self.cache = self.cache.transpose(1, 2).contiguous().transpose(1, 2)
        self.free = torch.randperm(blocks, generator=self.g).tolist()
        self.table = torch.zeros(4, blocks, dtype=torch.int32)
        self.keys: list[torch.Tensor] = [torch.empty(HEADS, 0, DIM, dtype=dtype) for _ in range(4)]
        self.values: list[torch.Tensor] = [torch.empty(HEADS, 0, DIM, dtype=dtype) for _ in range(4)]
        self.kept = kept.allocate(approx, self.cache, layout)

    def share(self, row: int, source: int, blocks: int) -> None:
        """Row ``row`` starts with the first full ``blocks`` of ``source`` (the prefix cache)."""
        self.table[row, :blocks] = self.table[source, :blocks]
        self.keys[row] = self.keys[source][:, :blocks * self.block_size].clone()
        self.values[row] = self.values[source][:, :blocks * self.block_size].clone()

    def release(self, row: int) -> None:
        """Row ``row`` leaves; its blocks go back to the free list (first to be handed out again)."""
        count = -(-self.keys[row].shape[1] // self.block_size)
        self.free = self.table[row, :count].tolist() + self.free
        self.keys[row] = torch.empty(HEADS, 0, DIM, dtype=self.dtype)
        self.values[row] = torch.empty(HEADS, 0, DIM, dtype=self.dtype)

    def step(self, tokens: dict[int, int]) -> None:
        """One engine step: ``tokens[row]`` new keys for each row, written, then the written blocks summarized."""
        rows = sorted(tokens)
        for row in rows:
            start = self.keys[row].shape[1]
            new = torch.randn(HEADS, tokens[row], DIM, generator=self.g).to(self.dtype)
            value = torch.randn(HEADS, tokens[row], DIM, generator=self.g).to(self.dtype)
            for t in range(start, start + tokens[row]):
                if t % self.block_size == 0:
                    self.table[row, t // self.block_size] = self.free.pop(0)
                block = int(self.table[row, t // self.block_size])
                _write(self.cache, self.layout, block, t % self.block_size, new[:, t - start], value[:, t - start])
            self.keys[row] = torch.cat([self.keys[row], new], 1)
            self.values[row] = torch.cat([self.values[row], value], 1)
        lengths = torch.tensor([tokens.get(r, 0) for r in range(4)])
        seq_lens = torch.tensor([self.keys[r].shape[1] for r in range(4)])
        query_start_loc = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)])
        written = kept.written_parts(query_start_loc, seq_lens, kept.part_size(self.approx, self.block_size))
        kept.keep_written(self.kept, self.approx, self.cache, self.layout,
                          kept.written_blocks(self.table, written, self.kept.shape[1]))

    def check(self, rows: list[int] | None = None) -> None:
        """Every row's full pages (of ``rows``, None: all): the kept summaries equal the draft's prepare on its
        contiguous keys, bit for bit."""
        for row in range(4) if rows is None else rows:
            length = self.keys[row].shape[1]
            if length < self.approx.kept_page():
                continue
            got = self.approx.prepare_pages(kept.page_summaries(self.kept, self.approx, self.table, self.block_size,
                                                                torch.tensor([row]), length))
            layer = {"layer": LayerInputs(None, self.values[row][None])} if self.approx.reads_layer else {}
            want = self.approx.prepare(self.keys[row][None], torch.zeros(1, dtype=torch.long), 16, **layer)
            for g, w in zip(tensors(got), tensors(want), strict=True):
                assert torch.equal(g, w), (row, length)


def tensors(prepared) -> tuple[torch.Tensor, ...]:
    """What a draft prepared, as a tuple (Quest's bounds are two tensors, Knorm's scores one)."""
    return prepared if isinstance(prepared, tuple) else (prepared,)


@pytest.mark.parametrize("layout, nhd", LAYOUTS, ids=["plain", "plain-nhd", "cpu-vec"])
@pytest.mark.parametrize("block_size, page", [(16, 1), (16, 4), (16, 16), (8, 24), (16, 32), (8, "knorm"),
                                              (16, "cur")])
def test_kept_bounds_follow_the_cache_step_by_step(layout, nhd, block_size, page):
    approx = (SpeculationConfig(window=16, approx=f"kvpress:{PRESS[page]}").approx if page in PRESS else
              SpeculationConfig(window=max(page, 16), approx="quest", approx_args=f"page:{page}").approx)
    engine = Engine(approx, layout, block_size, nhd=nhd)
    assert engine.cache.is_contiguous() != nhd
    engine.step({0: 37, 1: 5})  # a prompt's first chunk, and a short one
    engine.check()
    engine.step({0: 50, 1: 1})  # its second chunk, a decode step
    engine.check()
    engine.share(2, 0, 87 // block_size)  # a request that starts from row 0's full blocks
    engine.step({2: 11, 0: 1, 1: 1})
    engine.check()
    for _ in range(block_size + 3):  # decode steps across block ends
        engine.step({0: 1, 1: 1, 2: 1})
        engine.check()
    engine.release(1)  # its blocks go to a new request, which writes other keys into them
    engine.step({3: 3 * block_size + 5, 0: 1})
    engine.check()


def test_knorm_keeps_float32_scores_of_a_bfloat16_cache():
    """Knorm's scores are kvpress's, in float32 for bfloat16 keys: kept so (not rounded to the cache's dtype), they
    equal the HF engine's scores of the same keys bit for bit."""
    approx = SpeculationConfig(window=16, approx="kvpress:KnormPress").approx
    engine = Engine(approx, PlainLayout(), 16, dtype=torch.bfloat16)
    assert engine.kept.dtype == torch.float32
    engine.step({0: 40, 1: 17})
    engine.step({0: 1, 1: 1})
    engine.check()


@pytest.mark.parametrize("layout, nhd", LAYOUTS, ids=["plain", "plain-nhd", "cpu-vec"])
@pytest.mark.parametrize("draft", ["quest", "knorm", "cur"])
def test_summaries_of_blocks_written_before_they_were_kept_are_made_from_the_cache(layout, nhd, draft, monkeypatch):
    """A draft configured on an engine whose cache already holds requests (the prefix cache) keeps their summaries
    from the start: allocate summarizes every block as the cache holds it (whole blocks read in place, a few at a
    time here), as a step's parts are summarized."""
    monkeypatch.setattr(kept, "CPU_CHUNK", 6000)  # a few blocks at a time
    approx = (SpeculationConfig(window=16, approx=f"kvpress:{PRESS[draft]}").approx if draft in PRESS else
              SpeculationConfig(window=16, approx="quest", approx_args="page:8").approx)
    engine = Engine(approx, layout, 16, nhd=nhd)
    engine.step({0: 70, 1: 33})
    engine.kept = kept.allocate(approx, engine.cache, engine.layout)  # configured now
    engine.check()


def test_written_parts_are_every_part_the_step_fills():
    # a decode at a part's last slot; none; a chunk over two parts, filling one; one whole; a chunk of exactly one
    # part; a decode one slot short of a part's end; one slot into the next part
    seq_lens = torch.tensor([16, 9, 40, 32, 48, 15, 17])
    query_start_loc = torch.tensor([0, 1, 1, 21, 53, 69, 70, 71])
    row, block = kept.written_parts(query_start_loc, seq_lens, 16)
    assert list(zip(row.tolist(), block.tolist())) == [(0, 0), (2, 1), (3, 0), (3, 1), (4, 2)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_size, page, window", [(16, 16, 64), (16, 4, 16), (8, 24, 48), (16, 32, 64),
                                                      (16, 1, 8), (16, 16, 16)])
def test_quest_pages_chosen_in_c_are_quests_own(dtype, block_size, page, window):
    """The CPU kernel that bounds Quest's pages straight from the summaries kept beside the cache and chooses them
    (native.quest_pages, what the listed verifier calls) lists the keys Quest's select lists from page_summaries,
    slot for slot: pages within and across blocks, a page of one key, a page of S keys (page 0 and the current one,
    nothing ranked), rows with fewer candidates than the budget, a
    position at a page's first and last key, tied pages (the earlier first), a page whose bound is NaN (first), a
    query head of NaN (every bound NaN: the earliest pages), positions past the longest row's context clamped."""
    from alspec_eval.vllm import native

    approx = SpeculationConfig(window=window, approx="quest", approx_args=f"page:{page}").approx
    engine = Engine(approx, PlainLayout(), block_size, blocks=120, dtype=dtype)
    engine.step({0: 200, 1: 9 * page + 3, 2: 3 * page, 3: 37})
    parts = engine.kept.view(-1, *engine.kept.shape[2:])
    per_block, g = engine.kept.shape[1], block_size // engine.kept.shape[1]

    def part_row(row: int, first: int) -> int:  # the flattened summaries' row of the part at position ``first``
        return int(engine.table[row, first // block_size]) * per_block + first % block_size // g

    for k in range(page // g):  # row 0: page 7 a copy of page 2 (a tie); page 4's first channel NaN
        parts[part_row(0, 7 * page + k * g)] = parts[part_row(0, 2 * page + k * g)]
    parts[part_row(0, 4 * page), 0, 0] = float("nan")
    request = torch.tensor([0, 0, 0, 1, 1, 2, 3, 0])
    pos = torch.tensor([199, 8 * page, 8 * page - 1, 9 * page + 2, 5 * page, 3 * page - 1, 36, 150])
    query = torch.randn(len(pos), 3 * HEADS, DIM, generator=torch.Generator().manual_seed(3)).to(dtype)
    query[7, 4] = float("nan")  # KV head 1's group: every bound of row 7 at that head NaN
    length = int(pos.max()) + 1
    prepared = approx.prepare_pages(kept.page_summaries(engine.kept, approx, engine.table, block_size, request,
                                                        length))
    want = approx.select(query, torch.empty(len(pos), HEADS, length, DIM), torch.arange(len(pos)), pos,
                         torch.zeros_like(pos), window, (), prepared)
    got = native.quest_pages(query, engine.kept, engine.table, block_size, request, pos, page, window, length)
    assert got is not None
    assert torch.equal(got[1], want[1])
    assert torch.equal(got[0], want[0])
    assert want[1].any(-1).all()  # every row lists keys


def test_kept_scores_ranked_in_c_are_kvpress_ranking():
    """The CPU kernel that reads Knorm's kept scores and ranks them (native.rank_kept, what the listed verifier calls)
    keeps kvpress.ranked's keys in its order, key for key: scores at random, a run of near-ties longer than twice the
    budget (every key sorted), NaN (as -inf), infinities, exact and signed-zero ties (the earlier key first), a row
    shorter than the budget (its keys, then those past it, earlier first), rows sharing blocks."""
    from alspec_eval.approximations.kvpress import TIE, _outside, ranked
    from alspec_eval.vllm import native

    g = torch.Generator().manual_seed(5)
    block_size, kv_heads, blocks, keep = 16, 2, 90, 32
    kept_scores = torch.randn(blocks, block_size, kv_heads, 1, generator=g)
    table = torch.randperm(blocks, generator=g)[:4 * 20].view(4, 20).to(torch.int32)
    table[3, :5] = table[0, :5]  # row 3 starts with row 0's blocks
    flat = kept_scores.view(-1, kv_heads)

    def slot(row: int, j: int) -> int:
        return int(table[row, j // block_size]) * block_size + j % block_size

    for j in range(40, 140):  # row 1, head 0: near-ties (2^-20 apart, within TIE) at the top, longer than 2 keep
        flat[slot(1, j), 0] = 5.0 * (1 + (j % 7) * 2.0 ** -20)
    for j, x in zip(range(10, 20), [math.nan, math.inf, -math.inf, 3.0, 3.0, 0.0, -0.0, math.nan, 9.0, 9.0]):
        flat[slot(2, j), 1] = x
    request = torch.tensor([0, 1, 2, 3, 0, 1])
    pos = torch.tensor([300, 250, 120, 20, 31, 180])
    length = int(pos.max()) + 1
    dense = torch.stack([torch.stack([flat[slot(int(r), j)] for j in range(length)], -1) for r in request])
    want = ranked(dense, keep, _outside(length, pos, torch.zeros_like(pos)))
    got = native.rank_kept(kept_scores, table, block_size, request, pos, keep, length, TIE)
    assert got is not None and torch.equal(got, want)
    assert native.rank_kept(kept_scores, table, block_size, request, pos, keep, keep - 1, TIE) is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("args", ["num_sinks:2;local_window_size:4", "",
                                  "use_local_approximation:false;leverage_type:kv_avg"])
def test_cur_selected_in_one_call_from_kept_norms_is_its_own_selection(dtype, args):
    """CUR's selection straight from the norms kept beside the cache (select_kept: every row scored at once, then
    ranked by the CPU kernel, what the listed verifier calls) keeps the keys its select keeps row by row from
    page_summaries, key for key: rows of several lengths in one call (a shorter row's slots past its length hold
    other blocks' norms), a request at several positions, positions inside a local window and at its last key, a row
    with fewer keys than the budget, a window of zero norms (NaN scores)."""
    approx = SpeculationConfig(window=8, approx="kvpress:CURPress", approx_args=args or None).approx
    engine = Engine(approx, PlainLayout(), 16, blocks=60, dtype=dtype)
    engine.step({0: 200, 1: 37, 2: 16, 3: 90})
    engine.kept[int(engine.table[3, 1])] = 0  # row 3's keys 16 to 31: norms of zero
    request = torch.tensor([0, 0, 1, 1, 2, 3, 0, 3])
    pos = torch.tensor([199, 64, 36, 10, 15, 89, 3, 31])
    from alspec_eval.approximations.kvpress import _outside, ranked

    def own(pos: torch.Tensor, length: int) -> torch.Tensor:  # row by row from page_summaries, ranked in torch
        prepared = approx.prepare_pages(kept.page_summaries(engine.kept, approx, engine.table, 16, request, length))
        scored = torch.zeros(len(pos), HEADS, length)
        for i, p in enumerate(pos.tolist()):
            scored[i, :, :p + 1] = approx.leverage(prepared[i:i + 1, :, :p + 1], [p + 1])[0]
        return ranked(scored, 16, _outside(length, pos, torch.zeros_like(pos)))

    length = int(pos.max()) + 1
    got = approx.select_kept(None, engine.kept, engine.table, 16, request, pos, 8, length)
    assert got[0].shape == (len(pos), HEADS, 16)
    assert torch.equal(got[0], own(pos, length))
    short = pos.clamp(max=14)  # contexts read to 15 keys, fewer than 2S: ranked in torch
    assert torch.equal(approx.select_kept(None, engine.kept, engine.table, 16, request, short, 8, 15)[0],
                       own(short, 15))


@pytest.mark.parametrize("layout", [PlainLayout(), CpuVecLayout()], ids=["plain", "cpu-vec"])
@pytest.mark.parametrize("draft", ["quest", "cur"])
def test_a_cpu_worker_makes_a_blocks_summaries_at_the_first_step_that_holds_it(layout, draft, monkeypatch):
    """On the CPU a worker makes a block's summaries at the first step whose requests hold it, at every layer, not
    the whole cache's at its configuration: requests written before the draft was configured (the prefix cache),
    one of them first held steps later, a block freed and written by a new request, a request that starts from
    another's blocks. After every step, both layers' summaries of each held request's full pages are the draft's
    prepare on its keys, bit for bit; each block is made once per layer, and a block no step held never."""
    from types import SimpleNamespace

    from alspec_eval.vllm.backend import WorkerState
    from alspec_eval.vllm.paged import Settings

    approx = (SpeculationConfig(window=16, approx=f"kvpress:{PRESS[draft]}").approx if draft in PRESS else
              SpeculationConfig(window=16, approx="quest", approx_args="page:8").approx)
    engine = Engine(approx, layout, 16, blocks=60)
    engine.step({0: 70, 1: 33, 2: 40})  # written before the configuration
    state = WorkerState(settings=Settings((0.0,), 16, 1, approx))
    table = torch.zeros_like(engine.table)  # the step's rows, in vLLM's persistent block table
    made: dict[str, list[int]] = {"a": [], "b": []}  # layer "c" first runs at the third step
    summarize = kept.summarize_blocks

    def step(tokens: dict[int, int]) -> None:
        engine.step(tokens)
        rows = sorted(tokens)
        table[:len(rows)] = engine.table[rows]
        lengths = torch.tensor([tokens[r] for r in rows])
        ran = SimpleNamespace(rows=SimpleNamespace(plans={}),
                              seq_lens=torch.tensor([engine.keys[r].shape[1] for r in rows]),
                              query_start_loc=torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)]))
        for name in made:
            monkeypatch.setattr(kept, "summarize_blocks", lambda k, a, c, lay, blocks, name=name: (
                made[name].extend([] if blocks is None else blocks.tolist()), summarize(k, a, c, lay, blocks)))
            state.keep(name, engine.cache, layout, table, ran)
        for name in made:
            engine_kept, engine.kept = engine.kept, state.kept[name]
            engine.check(rows)
            engine.kept = engine_kept

    def blocks_of(row: int) -> list[int]:
        return engine.table[row, :-(-engine.keys[row].shape[1] // 16)].tolist()

    step({0: 1, 1: 1})
    assert sorted(made["a"]) == sorted(blocks_of(0) + blocks_of(1)) == sorted(made["b"])
    step({0: 1, 1: 1})
    made["c"] = []
    step({2: 1, 0: 1})  # row 2, written before the configuration, first held now
    assert sorted(made["a"]) == sorted(blocks_of(0) + blocks_of(1) + blocks_of(2)) == sorted(made["b"])
    assert sorted(made["c"]) == sorted(made["a"])  # a layer first run now makes what the others hold
    engine.release(1)
    step({3: 40, 0: 1})  # row 3 writes row 1's freed blocks
    engine.share(1, 0, 4)
    step({1: 5, 3: 1})  # a request that starts from row 0's first four blocks
    assert sorted(made["a"]) == sorted(set(made["a"])) == sorted(made["b"]) == sorted(made["c"])  # once a layer
    assert set(made["a"]) < set(range(60))  # blocks no step held: never made


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_summaries_are_kept_only_up_to_half_the_bytes_of_the_keys(dtype):
    """A draft keeps its summaries of a cache only where they take at most ``kept.SHARE`` of its keys' bytes: Quest's
    bounds (2D numbers a page) of pages of 4 keys, exactly half, are kept, of 2 keys (the keys' size) and 1 not;
    Knorm's float32 scores and CUR's norms always. A worker's layer then keeps nothing and reads keys."""
    from types import SimpleNamespace

    from alspec_eval.vllm.backend import WorkerState
    from alspec_eval.vllm.paged import Settings

    cache = torch.zeros(10, HEADS, 16, 2 * DIM, dtype=dtype)
    keys = cache.numel() // 2 * cache.element_size()
    for page, share in ((16, 1 / 8), (8, 1 / 4), (4, 1 / 2), (2, 1), (1, 2)):
        approx = SpeculationConfig(window=16, approx="quest", approx_args=f"page:{page}").approx
        assert kept.summary_bytes(approx, cache) == share * keys
        assert kept.keeps(approx, cache) == (share <= 0.5), page
        state = WorkerState(settings=Settings((0.0,), 16, 1, approx))
        step = SimpleNamespace(rows=SimpleNamespace(plans={}), seq_lens=torch.tensor([20]),
                               query_start_loc=torch.tensor([0, 1]))
        got = state.keep("a", cache, PlainLayout(), torch.arange(10, dtype=torch.int32)[None], step)
        assert (got is None) == (share > 0.5) and (state.kept["a"] is None) == (share > 0.5), page
    for press in PRESS.values():
        approx = SpeculationConfig(window=16, approx=f"kvpress:{press}").approx
        assert kept.keeps(approx, cache) and kept.summary_bytes(approx, cache) < keys / 2


def test_summaries_a_device_has_no_room_for_name_their_share_of_the_cache_and_the_fix(monkeypatch):
    """vLLM sizes a GPU's KV cache to the memory it may use, and the summaries come after: where they do not fit, the
    error names the draft, their share of the cache (Quest's pages of 8 keys: 2D numbers a page, 1/8 of the keys and
    values) and the engine argument that leaves room."""
    approx = SpeculationConfig(window=16, approx="quest", approx_args="page:8").approx
    cache = torch.zeros(10, HEADS, 16, 2 * DIM)

    def full(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    monkeypatch.setattr(torch.Tensor, "new_empty", full)
    with pytest.raises(torch.OutOfMemoryError, match=r"approx=quest keeps summaries .* 12\.5% of its size, .*Tried "
                                                     r"to allocate 2\.00 GiB.*lower gpu_memory_utilization"):
        kept.allocate(approx, cache, PlainLayout())
