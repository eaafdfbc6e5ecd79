"""The contract's properties, each a function of an approximation and a tiny model that returns what broke (one
line each; empty: it holds). They run the approximation through the adapter, as lm-eval does."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch
from lm_eval.api.instance import Instance
from lm_eval.models.huggingface import HFLM
from transformers import DynamicCache, PreTrainedModel, PreTrainedTokenizerFast

from .. import semantics
from ..adapter import ALSpecLM
from ..approximations import Approximation
from ..compat import with_cache
from ..region import DecodeRegion
from .models import PROMPTS
from .paged import paged_equals_contiguous
from .watch import watched

PAGED = "a paged cache (vLLM) selects as a contiguous one"
RANGES = "position_ranges lie in [0, pos], none wider than its width"
RANGE_POSITIONS = 512  # the speculated positions position_ranges is checked at, from the first (2S) on
GEN_KWARGS = {"until": ["\n\n"], "max_gen_toks": 16, "do_sample": False}
CONTEXT, CONTINUATION = "It was the best of times, it was the", " worst of times, it was the age of wisdom"


class Contract:
    """One approximation and one tiny model: the lm-eval instances and requests its properties share."""

    def __init__(self, approx: Approximation, model: PreTrainedModel, tokenizer: PreTrainedTokenizerFast,
                 window: int) -> None:
        self.approx, self.model, self.tokenizer, self.window = approx, model, tokenizer, window
        self.broken_keys: list[str] = []
        self.selections: list = []  # every selection the watched draft made (selections_are_attended)
        self.lam = 0.0
        try:
            self.lam = median_ratio(self.lm(), CONTEXT + CONTINUATION)
        except Exception:  # the draft broke the measuring run: each property runs it again and says how (cli.check)
            self.lam = 0.1

    def lm(self, batch_size: int = 1, **args: Any) -> ALSpecLM:
        """The adapter on a copy of the model, the approximation watched (key_rules)."""
        args = {"lambda": self.lam, "window": self.window, "device": "cpu", **args}
        return ALSpecLM(pretrained=copy.deepcopy(self.model), tokenizer=self.tokenizer, batch_size=batch_size,
                        max_length=1024, approx=watched(self.approx, self.broken_keys, self.selections), **args)


def median_ratio(lm: ALSpecLM, text: str) -> float:
    """A lambda near the median d/n of ``text`` (measured at lambda 0, exact commits), so that both branches run;
    halfway between two measured ratios, so that no decision sits on the threshold, where float noise between
    equivalent computations could flip it (0.1 if nothing was measured). The contract's and the tests' one."""
    ids = torch.tensor([lm.tokenizer(text)["input_ids"]])
    config = lm.spec_config
    measuring = type(config)(lam=0.0, window=config.window, approx=config.approx)
    region = DecodeRegion.build([0], [ids.shape[1] // 3], tokens=ids)
    with torch.no_grad(), lm.speculator.speculating(region, measuring) as trace:
        lm.model(ids)
    ratios = trace.ratios[~torch.isnan(trace.ratios)].sort().values
    if not len(ratios):
        return 0.1
    middle = len(ratios) // 2
    return float(ratios[max(middle - 1, 0)] + ratios[middle]) / 2


def generate_requests() -> list[Instance]:
    return [Instance("generate_until", {}, (p, dict(GEN_KWARGS)), i, ("gen", i, 1)) for i, p in enumerate(PROMPTS)]


def loglikelihood_requests() -> list[Instance]:
    pairs = [(p[:30], p[30:]) for p in PROMPTS[:3]] + [("Hundreds", " of people went by")]
    return [Instance("loglikelihood", {}, pair, i, ("ll", i, 1)) for i, pair in enumerate(pairs)]


def _stats(requests: list[Instance]) -> list[dict[str, Any]]:
    return [r.arguments[-1]["alspec"] for r in requests]


def lambda_zero_is_the_model(c: Contract) -> list[str]:
    """At lambda 0 every position is measured and A committed: the outputs of --model hf, exactly."""
    hf = HFLM(pretrained=copy.deepcopy(c.model), tokenizer=c.tokenizer, batch_size=2, device="cpu", max_length=1024)
    spec = c.lm(batch_size=2, **{"lambda": 0.0})
    broken = []
    if spec.generate_until(generate_requests(), True) != hf.generate_until(generate_requests(), True):
        broken.append("lambda 0 generates other text than --model hf")
    if spec.loglikelihood(loglikelihood_requests(), True) != hf.loglikelihood(loglikelihood_requests(), True):
        broken.append("lambda 0 scores other log-likelihoods than --model hf")
    if not spec.statistics()["tasks"]["gen"]["total"]["speculated"]:
        broken.append("nothing speculated at lambda 0 (the prompts are longer than 2S)")
    return broken


def teacher_forcing_is_token_by_token(c: Contract) -> list[str]:
    """A continuation scored in one pass gives the log-probability and the per-layer decisions of decoding it one
    token at a time with a KV cache (each position's keys chosen from the cache as it stood then)."""
    lm = c.lm()
    context, continuation = (c.tokenizer(t)["input_ids"] for t in (CONTEXT, CONTINUATION))
    ids = torch.tensor([context + continuation[:-1]])  # as lm-eval scores it: the last token is never fed
    region = DecodeRegion.build([0], [len(context)], tokens=ids)
    with torch.no_grad(), lm.speculator.speculating(region, lm.spec_config) as tf:
        logits = lm.model(ids).logits[0, len(context) - 1:].double().log_softmax(-1)
    teacher = float(logits.gather(-1, torch.tensor(continuation)[:, None]).sum())
    cache, stepwise = DynamicCache(config=lm.model.config), 0.0
    with torch.no_grad(), lm.speculator.speculating(region, lm.spec_config) as tb:
        out = lm.model(torch.tensor([context]), **with_cache(lm.model, cache), use_cache=True).logits[0, -1]
        for i, token in enumerate(continuation):
            stepwise += float(out.double().log_softmax(-1)[token])
            if i + 1 < len(continuation):
                out = lm.model(torch.tensor([[token]]), **with_cache(lm.model, cache), use_cache=True).logits[0, -1]
    broken = []
    if abs(teacher - stepwise) > 1e-4:
        broken.append(f"teacher forcing scores {teacher:.6f}, token by token {stepwise:.6f}")
    decided = tf.codes[0, len(context):], tb.codes[0, len(context):]
    if decided[0].shape != decided[1].shape or not torch.equal(*decided):
        broken.append("teacher forcing decides other layers than token-by-token decoding")
    return broken


def batch_and_padding_change_nothing(c: Contract) -> list[str]:
    """Requests alone and four to a left-padded batch: the same text, log-likelihoods and decisions."""
    runs = []
    for batch_size in (1, 4):
        lm = c.lm(batch_size=batch_size, trace_tokens=True)
        gen, ll = generate_requests(), loglikelihood_requests()
        runs.append((lm.generate_until(gen, True), _stats(gen), lm.loglikelihood(ll, True), _stats(ll)))
    (text1, gen1, ll1, llstats1), (text4, gen4, ll4, llstats4) = runs
    broken = []
    if text1 != text4:
        broken.append("batch size 4 with left padding generates other text than batch size 1")
    if gen1 != gen4 or llstats1 != llstats4:
        broken.append("batch size 4 with left padding decides other layers than batch size 1")
    if any(abs(a[0] - b[0]) > 1e-4 for a, b in zip(ll1, ll4)):
        broken.append("batch size 4 with left padding scores other log-likelihoods than batch size 1")
    return broken


def paged_cache_selects_as_contiguous(c: Contract) -> list[str]:
    """Inside vLLM the draft reads each row's context from a paged cache (blocks of 16 and 128, shuffled, shared,
    both layouts, a prompt prefilled in three steps): the same keys as from the HF engine's left-padded cache, on
    random keys of the family's head geometry. A draft that cannot run in vLLM (``hf_only``) says why instead."""
    if c.approx.hf_only:
        return []
    config = c.model.config
    heads = config.num_attention_heads
    dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return paged_equals_contiguous(c.approx, heads, config.num_key_value_heads, dim, c.window)


def ranges_lie_in_the_context(c: Contract) -> list[str]:
    """Where the draft's keys are fixed by position, vLLM reads its ``position_ranges`` (not ``select``): at each
    speculated position of a long context and each window_align it takes, K ranges (R, K) for its K widths, inside
    [0, pos] (the engines' rule, ``semantics.readable_ranges``; they cut a range that is not, and refuse the run),
    none holding more keys than its width (a paged read takes that many); and it gives ranges exactly where the draft
    declares ``keys_by_position``."""
    pos = torch.arange(2 * c.window, 2 * c.window + RANGE_POSITIONS)
    broken = []
    for align in c.approx.window_aligns:
        ranges = c.approx.position_ranges(pos, c.window, align)
        at = f"window_align={align}"
        if (ranges is not None) != c.approx.keys_by_position:
            return [f"{at}: position_ranges returned {'None' if ranges is None else 'ranges'}, but the draft declares "
                    f"keys_by_position = {c.approx.keys_by_position}: declare it True exactly where position_ranges "
                    "gives the keys (vLLM chooses how it verifies from the declaration)"]
        if ranges is None:  # its keys depend on more than the position: select's keys are checked (KEY_RULES)
            return []
        starts, ends, widths = ranges
        if tuple(starts.shape) != (len(pos), len(widths)) or starts.shape != ends.shape:
            broken.append(f"{at}: ranges of shapes {tuple(starts.shape)} and {tuple(ends.shape)} for {len(pos)} "
                          f"positions and {len(widths)} widths: return (positions, K) each and K widths")
            continue
        outside = semantics.readable_ranges(starts, ends, pos)[2]
        if bool(outside.any()):
            row = int(outside.nonzero()[0])
            shown = ", ".join(f"[{int(a)}, {int(b)})" for a, b in zip(starts[row], ends[row]))
            broken.append(f"{at}: at position {int(pos[row])} the ranges {shown} reach outside [0, {int(pos[row])}]")
        wide = (ends - starts > torch.tensor(widths)).any(0)
        for k in wide.nonzero().flatten().tolist():
            most = int((ends - starts)[:, k].max())
            broken.append(f"{at}: range {k} holds up to {most} keys, more than its width {widths[k]}")
    return broken


def selections_are_attended(c: Contract) -> list[str]:
    """A~ as the engine computed it is the softmax over the keys each selection counted, of the family's scores (its
    scaling and soft-capping) plus the selection's log-weights, recomputed in float64 position by position: an
    engine that dropped a weighted draft's weights, or read other keys than it selected, breaks it."""
    lm, recomputed = c.lm(), []
    speculator = lm.speculator
    rows_of = speculator._approximate_rows

    def spied(module: torch.nn.Module, step: Any, part: slice, query: torch.Tensor, key: torch.Tensor,
              value: torch.Tensor, scaling: float, kwargs: dict, shared: Any = None) -> tuple[torch.Tensor, Any]:
        out, counted = rows_of(module, step, part, query, key, value, scaling, kwargs, shared)
        recomputed.append((out, _attended(query, key, value, step, part, scaling, kwargs.get("softcap"),
                                          c.selections[-1])))
        return out, counted

    speculator._approximate_rows = spied
    ids = torch.tensor([lm.tokenizer(CONTEXT + CONTINUATION)["input_ids"]])
    region = DecodeRegion.build([0], [ids.shape[1] // 3], tokens=ids)
    with torch.no_grad(), speculator.speculating(region, lm.spec_config):
        lm.model(ids)
    if not recomputed:
        return ["no position speculated (the text is longer than 2S)"]
    worst = max(float(((out.double() - want).norm(dim=-1) / want.norm(dim=-1)).max()) for out, want in recomputed)
    return [] if worst <= 1e-4 else [f"A~ differs from the softmax over the selected keys and their weights by "
                                     f"{worst:.2e} of its norm"]


def _attended(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, step: Any, part: slice, scaling: float,
              softcap: float | None, selected: tuple) -> torch.Tensor:
    """The float64 softmax of each speculated position's selected keys: (r, Hq, D)."""
    index, valid, log_weight = selected
    rows, cols = step.rows[part], step.cols[part]
    out = []
    for r in range(len(rows)):
        q = query[rows[r], :, cols[r]].double()  # (Hq, D)
        group = q.shape[0] // key.shape[1]
        heads = []
        for h in range(q.shape[0]):
            kv = h // group if index.shape[1] > 1 else 0
            keep = torch.ones(index.shape[2], dtype=torch.bool) if valid is None else valid[r, kv]
            at = index[r, kv][keep]
            scores = (key[rows[r], h // group, at].double() @ q[h]) * scaling
            if softcap:
                scores = softcap * torch.tanh(scores / softcap)
            if log_weight is not None:
                scores = scores + log_weight[r, kv][keep].double()
            heads.append(scores.softmax(0) @ value[rows[r], h // group, at].double())
        out.append(torch.stack(heads))
    return torch.stack(out)


PROPERTIES: dict[str, Callable[[Contract], list[str]]] = {
    "lambda 0 is --model hf": lambda_zero_is_the_model,
    "teacher forcing is token-by-token decoding": teacher_forcing_is_token_by_token,
    "batch size and left padding change nothing": batch_and_padding_change_nothing,
    PAGED: paged_cache_selects_as_contiguous,
    RANGES: ranges_lie_in_the_context,
    "A~ attends to the selected keys with their weights": selections_are_attended,
}
KEY_RULES = "never a future or padding key, at most max_keys (2S) keys, none twice"
