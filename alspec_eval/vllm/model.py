"""`lm_eval --model alspec-vllm`: lm-eval's VLLM whose attention speculates, with the statistics of ``--model alspec``.

In the shape of the adapter (:mod:`alspec_eval.adapter`): lm-eval's ``VLLM`` does the work and every vLLM model_arg
still works. The request methods run task by task through the request ledger; ``_model_generate`` tags each request
with where its speculation starts (docs/design.md, Semantics 6) and reads the workers' decisions back after each
call. The engine's attention backend (:mod:`.backend`) verifies and commits inside vLLM.
"""

from __future__ import annotations

import dataclasses
import hashlib
import inspect
import itertools
import json
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from lm_eval import utils
from lm_eval.api.instance import Instance
from lm_eval.api.registry import register_model

from .. import semantics
from ..atomic_json import write_json_atomic, write_jsonl_atomic
from ..bounds import refuse
from ..compat import check_lm_eval, check_torch_companions
from ..config import SpeculationConfig
from ..distributed import gather_statistics
from ..errors import ConfigError
from ..ledger import RequestLedger, RowKey, RowRecord, SampleKey, sample_rows, samples_path, teacher_forced_passes
from ..lm_eval_cli import USE_CACHE_REFUSED
from ..provenance import versions
from ..rows import Row
from ..smollm2 import SMOLLM2_ALIAS, smollm2_path
from ..region import Trace
from ..stats import AcceptanceStats, run_statistics
from .paged import LayoutError, layout_for, observation_first
from .prefix_cache import TAG, prompt_digest
from .worker import taken as taken_from
from .checks import (check_cpu_cache, check_data_parallel, check_engine_args, check_model_config, check_speculation,
                     vllm_model_class)
from .plugin import ENGINE_FLAG
from .replicas import Replicas

VLLM = vllm_model_class()  # lm-eval's VLLM; where vLLM is missing, one line naming the extra

_VLLM_ARGS = set(inspect.signature(VLLM.__init__).parameters)
CHECK_LAYOUT = "ALSPEC_VLLM_CHECK_LAYOUT"  # 1: compare the newest key read back with the incoming one at every step


@register_model("alspec-vllm")
class ALSpecVLLM(VLLM):
    """lm-eval's VLLM with attention-level speculation inside vLLM's attention (docs/design.md)."""

    def __init__(self, pretrained: str, **kwargs: Any) -> None:
        check_lm_eval()
        self.spec_config, vllm_kwargs = SpeculationConfig.from_model_args(kwargs, _VLLM_ARGS)
        check_speculation(kwargs, self.spec_config)
        if pretrained == SMOLLM2_ALIAS:
            pretrained = str(smollm2_path())
        from transformers import AutoConfig

        try:
            config = AutoConfig.from_pretrained(pretrained, trust_remote_code=bool(vllm_kwargs.get("trust_remote_code")))
        except OSError as err:
            raise ConfigError(f"pretrained={pretrained!r} cannot be loaded ({str(err).splitlines()[0]}); give a local "
                              "folder with config.json, a model id in the local hub cache, or pretrained=smollm2") from None
        text = config.get_text_config()
        check_model_config(text)
        self.spec_config.check_layers(text.num_hidden_layers)
        self.num_layers = int(text.num_hidden_layers)
        check_engine_args(vllm_kwargs)
        check_data_parallel(vllm_kwargs)
        check_cpu_cache(text, vllm_kwargs)
        check_torch_companions()
        vllm_kwargs["worker_extension_cls"] = "alspec_eval.vllm.worker.ALSpecWorker"
        self.ledger = RequestLedger(self.num_layers, self.spec_config.trace_tokens)
        self.task_stats: dict[str, AcceptanceStats] = {}
        self.sample_stats: dict[SampleKey, dict[str, Any]] = {}
        self._ids = itertools.count()
        self._starts: dict[RowKey, int] = {}  # loglikelihood: where each input of this pass speculates
        self._rolling = False
        self.redecided = 0  # positions decided in more than one pass (vLLM preempted and recomputed their request)
        self.dump = False  # tests: the workers keep what an outside reference recomputes (worker.alspec_dumps)
        with _engine_flag():
            super().__init__(pretrained=pretrained, **vllm_kwargs)
        if self.data_parallel_size > 1:  # lm-eval's VLLM started no engine: replicas that live for the whole run
            self.model = Replicas(self.model_args, self.data_parallel_size, self.tensor_parallel_size,
                                  torch.cuda.is_available())
            self._max_length = self._max_length or self.model.max_model_len
        self.attention_backend: str | None = None
        self._configure()

    # ------------------------------------------------------------------ settings

    def reconfigure(self, dump: bool | None = None, **changes: Any) -> None:
        """Speculate with other settings from the next request on, on the same engine (every worker)."""
        if dump is not None:
            self.dump = dump
        config = dataclasses.replace(self.spec_config, **changes)
        check_speculation(changes, config)
        self._use(config)

    def _use(self, config: SpeculationConfig) -> None:
        config.check_layers(self.num_layers)
        self.spec_config = config
        self.ledger.trace_tokens = config.trace_tokens
        self._configure()

    def _configure(self) -> None:
        """Send the settings to every worker (tensor-parallel ranks included) before any request."""
        config = self.spec_config
        rules = {"thresholds": config.thresholds(self.num_layers), "window": config.window,
                 "window_align": config.window_align, "approx": config.approx.name, "approx_args": config.approx.args()}
        # the prefix cache keys blocks by their tokens: a speculated block is reused only under the same rules
        self._salt = hashlib.sha256(json.dumps(rules, sort_keys=True, default=str).encode()).hexdigest()[:16]
        plain = self.model.collective_rpc("alspec_configure", args=({
            **rules, "check_layout": os.environ.get(CHECK_LAYOUT) == "1", "dump": self.dump},))
        # the prompts whose observation every worker holds, whose observation windows the prefix cache may serve
        self._observed: set[int] = set.intersection(*map(set, self.model.collective_rpc("alspec_observed")))
        for name in sorted(set(itertools.chain(*plain))):
            layout_for(name)  # a backend whose cache it cannot read: one line naming it and those it reads
            raise LayoutError(f"vLLM's {name} in this engine is not alspec-vllm's (a later register_backend replaced "
                              "it), so it would not speculate; leave vLLM's own backend registered")

    @property
    def _live(self) -> bool:
        """Whether any layer can commit A~ (a non-zero threshold): only then can a speculated KV entry differ from
        the exact one. The blocks that hold speculated positions (a prompt's from its speculation start, generated
        tokens fed back, which vLLM caches too) are then keyed in the prefix cache by the rules and that start
        (:mod:`.prefix_cache`), so they serve only requests that compute them alike; blocks before the start are
        exact and shared by every cell of a sweep."""
        return any(t > 0 for t in self.spec_config.thresholds(self.num_layers))

    def set_cache_hook(self, cache_hook: Any) -> None:
        """lm-eval's CachingLM (``use_cache``) registers here: refused, see USE_CACHE_REFUSED."""
        if getattr(cache_hook, "dbdict", None) is not None:
            raise ConfigError(USE_CACHE_REFUSED.replace("--model alspec", "--model alspec-vllm"))
        super().set_cache_hook(cache_hook)

    # ------------------------------------------------------------------ requests, task by task

    def loglikelihood(self, requests: list[Instance], disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        pairs: dict[tuple[str, str], RowKey] = {}
        self._pairs = pairs
        return self._run(requests, lambda batch: super(ALSpecVLLM, self).loglikelihood(batch, disable_tqdm),
                         lambda inst: [pairs[inst.args[:2]]])

    def loglikelihood_rolling(self, requests: list[Instance], disable_tqdm: bool = False) -> list[float]:
        windows = {id(inst): self._rolling_keys(inst.args[0]) for inst in requests}
        self._rolling = True
        try:
            return self._run(requests, lambda batch: super(ALSpecVLLM, self).loglikelihood_rolling(batch, disable_tqdm),
                             lambda inst: windows[id(inst)])
        finally:
            self._rolling = False

    def generate_until(self, requests: list[Instance], disable_tqdm: bool = False) -> list[str]:
        return self._run(requests, lambda batch: super(ALSpecVLLM, self).generate_until(batch, disable_tqdm),
                         lambda inst: [self.ledger.prompt_key(self.tok_encode(inst.args[0]))])

    def _run(self, requests: list[Instance], run: Callable[[list[Instance]], list],
             keys_of: Callable[[Instance], list[RowKey]]) -> list:
        results = self.ledger.run(requests, run, keys_of)
        self.task_stats, self.sample_stats = gather_statistics(self.ledger.task_stats, self.ledger.sample_stats,
                                                               self.world_size, self.num_layers)
        return results

    def reset_statistics(self) -> None:
        """Start counting anew (a sweep's next cell)."""
        self.ledger.reset()
        self.task_stats, self.sample_stats = {}, {}
        self.redecided = 0

    @property
    def decode_tokens(self) -> int:
        """Generated or teacher-forced tokens answered so far, for progress displays."""
        return self.ledger.decode_tokens

    @property
    def skipped_layers(self) -> dict[int, str]:
        """None: a model with sliding-window layers is refused before the engine starts."""
        return {}

    # ------------------------------------------------------------------ a sweep's cells on one engine

    @contextmanager
    def answering(self, row: Row, static_layers: tuple[int, ...] = (), shared: None = None) -> Iterator[SpeculationConfig]:
        """Evaluate as ``row`` inside this block: its settings reach every worker before its first request, and the
        engine's settings come back after. ``shared`` is hf's; here the prefix cache keeps the exact prompts."""
        previous = self.spec_config
        self._use(row.config(self.spec_config, tuple(static_layers)))
        try:
            yield self.spec_config
        finally:
            self._use(previous)

    @contextmanager
    def shared_prefill(self, variants: list[Row]) -> Iterator[None]:
        """hf's shared prefill, which vLLM's prefix cache makes: exact prompt blocks are reused across the rows."""
        yield None

    # ------------------------------------------------------------------ loglikelihood: where each input speculates

    def _truncated(self, context_enc: list[int], continuation_enc: list[int]) -> tuple[RowKey, int]:
        """VLLM's input of a pair (``VLLM._loglikelihood_tokens``: cut to its last max_length - 1 tokens) and the
        first position that speculates: the first continuation token fed in, every position when rolling
        (docs/design.md, Semantics 6), or 0 with speculate_prefill."""
        most = self.max_length - 1
        key = tuple((context_enc + continuation_enc)[-most:])
        ctxlen = len(context_enc) - max(0, len(context_enc) + len(continuation_enc) - most)
        return key, 0 if self._rolling or self.spec_config.speculate_prefill else ctxlen

    def _rolling_keys(self, string: str) -> list[RowKey]:
        """A rolling request's windows as VLLM builds them."""
        windows = map(utils.make_disjoint_window, utils.get_rolling_token_windows(
            token_list=self.tok_encode(string), prefix_token=self.prefix_token_id,
            max_seq_len=self.max_length - 2, context_len=1))
        return [tuple((ctx + cont)[-(self.max_length - 1):]) for ctx, cont in windows]

    def _loglikelihood_tokens(self, requests: list, disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        """VLLM's own, in passes where each input has one speculation start (one text split two ways runs twice)."""
        inputs = [self._truncated(ctx, cont) for _, ctx, cont in requests]
        for (cache_key, _, _), (key, _) in zip(requests, inputs, strict=True):
            if cache_key is not None:
                self._pairs[cache_key] = key
        results: list = [None] * len(requests)
        for indices in teacher_forced_passes(inputs):
            self._starts = {inputs[i][0]: inputs[i][1] for i in indices}
            outputs = super()._loglikelihood_tokens([requests[i] for i in indices], disable_tqdm)
            for i, out in zip(indices, outputs, strict=True):
                results[i] = out
        return results

    # ------------------------------------------------------------------ the engine call

    def _model_generate(self, requests: list[list[int]], generate: bool = False,
                        sampling_params: list[Any] | Any | None = None) -> list:
        """VLLM's call with every request tagged (where it speculates, its id and, where speculation can change a KV
        entry, the rules that key its speculated blocks in the prefix cache); then the workers' decisions, per
        request, or the run refused where the draft read keys outside [0, pos] (:mod:`alspec_eval.bounds`)."""
        from vllm import SamplingParams, TokensPrompt

        if not generate or sampling_params is None:
            sampling_params = SamplingParams(temperature=0, prompt_logprobs=1, max_tokens=1, detokenize=False)
        if not isinstance(sampling_params, list):
            sampling_params = [sampling_params] * len(requests)
        starts = [self._start(tokens, generate) for tokens in requests]
        tags = [next(self._ids) for _ in requests]
        prompts, params = [], []
        salt = self._salt if self._live else None  # blocks that hold speculated positions: .prefix_cache
        for tokens, params_of, start, tag in zip(requests, sampling_params, starts, tags, strict=True):
            tagged = params_of.clone()
            first = self._observed_from(start)
            # a prompt-scoring draft's observation reads the prompt's keys up to its end: kept by them across calls
            digest = None if first is None else prompt_digest(tokens, start)
            tagged.extra_args = {**(tagged.extra_args or {}), TAG: [start, tag, salt, first,
                                                                    semantics.request_seed(tokens[:start]), digest,
                                                                    digest in self._observed]}
            params.append(tagged)
            prompts.append(TokensPrompt(prompt_token_ids=list(tokens)))
        outputs = self.model.generate(prompts, sampling_params=params, use_tqdm=self.batch_size == "auto",
                                      lora_request=self.lora_request)
        decisions: dict[int, tuple] = {}
        breaches = [0, -1]  # the draft's selections outside [0, pos], and the largest position among them
        every = [taken_from(t) for t in self.model.collective_rpc("alspec_take")]
        self._observed = set.intersection(*(set(taken.observed) for taken in every))  # what every worker holds
        for taken in every[::self.tensor_parallel_size]:
            decisions.update(taken.by_request())  # each replica's first rank (the ranks of one replica decide alike)
            self.redecided += taken.redecided
            breaches = [breaches[0] + taken.out_of_bounds, max(breaches[1], taken.out_of_bounds_at)]
        refuse(self.spec_config.approx, *breaches)  # before anything of this call is recorded
        if self.attention_backend is None:
            self.attention_backend = self.model.collective_rpc("alspec_backend")[0]
        for tokens, start, tag, out in zip(requests, starts, tags, outputs, strict=True):
            new = len(out.outputs[0].token_ids) if generate else 0
            self.ledger.records[tuple(tokens)] = self._record(decisions.get(tag), len(tokens), start, new, generate)
        return outputs

    def _observed_from(self, start: int) -> int | None:
        """Where the prompt positions a prompt-scoring draft reads the queries of begin (its observation window), so
        that their prefill runs in this call whatever the prefix cache holds (.prefix_cache); None for other drafts."""
        approx = self.spec_config.approx
        return observation_first(start, approx.prompt_window()) if approx.prompt_keys else None

    def _start(self, tokens: list[int], generate: bool) -> int:
        if generate:  # the prompt is exact; every generated token fed back speculates
            return 0 if self.spec_config.speculate_prefill else len(tokens)
        return self._starts[tuple(tokens)]

    def _record(self, decided: tuple | None, prompt_len: int, start: int, new: int, generate: bool) -> RowRecord:
        """One request's decisions as the HF engine records a row (:class:`.region.Trace`, :class:`.ledger.RowRecord`):
        statistics over the speculated positions whose outputs are read, up to the last token fed back (a
        generation's last token and a loglikelihood input's last token feed nothing that is scored), and accepted
        layers per token from the prompt's last token (generation) or the speculation's start (scoring)."""
        end = prompt_len + new - 1
        first = prompt_len - 1 if generate else start
        lo = min(start, first)
        codes = torch.zeros(1, max(end - lo, 0), self.num_layers, dtype=torch.int8)
        ratios = torch.full(codes.shape, float("nan"))
        config = self.spec_config
        measures: dict[str, torch.Tensor] = {}
        if decided is not None:
            pos, decided_codes, decided_ratios, decided_measures = decided
            keep = (pos >= start) & (pos < end)
            codes[0, pos[keep] - lo], ratios[0, pos[keep] - lo] = decided_codes[keep], decided_ratios[keep].float()
            for name, values in decided_measures.items():
                measures[name] = torch.full(codes.shape, float("nan"))
                measures[name][0, pos[keep] - lo] = values[keep].float()
        promise = config.approx.promise()
        trace = Trace(codes, ratios, offset=lo, pad=torch.zeros(1, dtype=torch.long),
                      budget=config.approx.max_keys(config.window), measures=measures,
                      epsilon=None if promise is None else promise.epsilon)
        return RowRecord(trace.row_stats(0, start, end), trace.accepted_layers(0, first, end))

    # ------------------------------------------------------------------ results

    def statistics(self) -> dict[str, Any]:
        """Schema v2, as ``--model alspec`` writes it; provenance names the engine and what gave A."""
        import vllm

        stats = run_statistics(self.spec_config.to_dict(), self.num_layers, {}, self.task_stats)
        stats["provenance"] = {"model": self.model_args["model"], "versions": {**versions(), "vllm": vllm.__version__},
                               "engine": "vllm", "attention_backend": self.attention_backend,
                               "redecided_positions": self.redecided, "data_parallel_size": self.data_parallel_size}
        return stats

    def get_model_info(self) -> dict[str, Any]:
        info = {"alspec": self.statistics()}
        if self.spec_config.stats_path:
            path = write_json_atomic(self.spec_config.stats_path, info["alspec"])
            write_jsonl_atomic(samples_path(path), sample_rows(self.sample_stats))
        return info


@contextmanager
def _engine_flag() -> Iterator[None]:
    """The environment the engine's processes spawn with names this engine as alspec-vllm's (:mod:`.plugin`); the
    driver's own environment is as it was afterwards."""
    before = os.environ.get(ENGINE_FLAG)
    os.environ[ENGINE_FLAG] = "1"
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(ENGINE_FLAG, None)
        else:
            os.environ[ENGINE_FLAG] = before
