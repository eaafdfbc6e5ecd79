"""`lm_eval --model alspec`: lm-eval's HFLM with attention-level speculation and its statistics.

Every HFLM option keeps working; the speculation options are read off the same model_args (docs/model_args.md). In the
shape of lm-eval's ``hf_steered``: HFLM does the work. The three request methods are wrapped, not rewritten: each
runs HFLM's own, task by task through the request ledger (:mod:`.ledger`), which knows which request a model input
belongs to and sums the row records per request (logged with the sample) and per task. The two model calls
(``_model_call``, ``_model_generate``) hand each batch to the evaluation's answer source (:mod:`.answers`: HFLM's
call inside one speculation session, self-speculation, or a sweep's shared prefill; :meth:`ALSpecLM.answering`
chooses it) and file its row records. The backend (:mod:`.backends`) checks and installs itself by name.
"""

from __future__ import annotations

import dataclasses
import inspect
import re
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
import transformers
from lm_eval import utils
from lm_eval.api.instance import Instance
from lm_eval.api.registry import register_model
from lm_eval.models.huggingface import HFLM
from lm_eval.models.utils_hf import get_dtype

from .answers import Answers, answers_for
from .atomic_json import write_json_atomic, write_jsonl_atomic
from .backends import load_backend
from .compat import check_lm_eval
from .config import LOAD_TIME_SETTINGS, ConfigError, SpeculationConfig, unknown_model_arg, unloadable_model
from .distributed import gather_statistics
from .ledger import (RequestLedger, RowKey, SampleKey, model_input, row_keys, sample_rows, samples_path,
                     teacher_forced_passes)
from .lm_eval_cli import USE_CACHE_REFUSED
from .provenance import versions
from .rows import Row
from .selfspec import check_model as check_selfspec_model
from .shared_prefill import SharedPrefill
from .smollm2 import SMOLLM2_ALIAS, smollm2_path
from .stats import AcceptanceStats, run_statistics
from .stopping import StopRule

_HFLM_ARGS = set(inspect.signature(HFLM.__init__).parameters)


def unexpected_keyword(err: TypeError) -> str | None:
    """The keyword of Python's "f() got an unexpected keyword argument 'k'", else None."""
    match = re.search(r"unexpected keyword argument '(\w+)'", str(err))
    return match and match[1]


def type_name(err: TypeError) -> str:
    """Who refused the keyword: "LlamaForCausalLM" of "LlamaForCausalLM.__init__() got ..."."""
    return str(err).split(".", 1)[0].split("(", 1)[0] or "the model"


@register_model("alspec")
class ALSpecLM(HFLM):
    """HFLM whose attention speculates: see docs/design.md for what every backend computes."""

    def __init__(self, pretrained: str | transformers.PreTrainedModel, **kwargs: Any) -> None:
        check_lm_eval()
        self.spec_config, hf_kwargs = SpeculationConfig.from_model_args(kwargs, _HFLM_ARGS)
        self._backend = load_backend(self.spec_config)  # its environment checked before anything loads
        batch = str(hf_kwargs.get("batch_size", 1))
        self._fixed_batch = int(batch) if batch.isdigit() else None  # "auto": lm-eval decides later
        if pretrained == SMOLLM2_ALIAS:
            pretrained = str(smollm2_path())
        try:
            super().__init__(pretrained=pretrained, **hf_kwargs)
        except OSError as err:  # transformers' "not a local folder and not a valid model identifier" and kin
            if not isinstance(pretrained, str):
                raise
            raise ConfigError(unloadable_model(pretrained, err)) from None
        if self.spec_config.drafts_tokens:  # a model object skips _create_model
            check_selfspec_model(self.model.config)
        self.speculator = self._backend.install(self.model)
        self.spec_config.check_layers(self.speculator.num_layers)  # a model object skips _create_model
        self.ledger = RequestLedger(self.speculator.num_layers, self.spec_config.trace_tokens)
        self.task_stats: dict[str, AcceptanceStats] = {}  # every rank's, summed (data parallel)
        self.sample_stats: dict[SampleKey, dict[str, Any]] = {}  # every rank's
        self._answers: Answers = self._answers_for(self.spec_config)
        self._probing = False

    def _create_model(self, pretrained: str, *args: Any, **kwargs: Any) -> None:
        """Check what the config alone can tell before the weights load."""
        text_config = self._config.get_text_config()
        self.spec_config.check_layers(text_config.num_hidden_layers)
        if self.spec_config.drafts_tokens:
            check_selfspec_model(self._config)
        dtype = get_dtype(kwargs.get("dtype", "auto"))
        self._backend.check_model(self._config, self._fixed_batch, torch.device(self._device),
                                  None if dtype == "auto" else dtype)
        model_class = transformers.AutoModelForCausalLM._model_mapping.get(type(self._config), None)
        if model_class is not None and not model_class._supports_attention_backend:
            raise ConfigError(
                f"{model_class.__name__} does not dispatch attention through transformers' AttentionInterface, "
                "so speculation cannot be hooked; use a model that does (Llama, Qwen2/3, Mistral, Gemma, ...)"
            )
        try:
            super()._create_model(pretrained, *args, **kwargs)
        except TypeError as err:  # the model class refused a leftover model_arg, before any weight is read
            key = unexpected_keyword(err)
            if key not in kwargs:
                raise
            raise ConfigError(unknown_model_arg(key, kwargs[key], type_name(err), _HFLM_ARGS)) from None

    # ------------------------------------------------------------------ requests, task by task

    def loglikelihood(self, requests: list[Instance], disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        return self._run(requests, lambda batch: self._loglikelihood_passes(batch, disable_tqdm),
                         lambda inst: [self._pair_input(*inst.args[:2])[0]])

    def _loglikelihood_passes(self, requests: list[Instance], disable_tqdm: bool) -> list[tuple[float, bool]]:
        """HFLM's loglikelihood of one task's requests; one input scored from two starts runs in two passes."""
        inputs = [self._pair_input(*inst.args[:2]) for inst in requests]
        results: list = [None] * len(requests)
        for indices in teacher_forced_passes(inputs):
            with self.ledger.teacher_forcing({inputs[i][0]: inputs[i][1] for i in indices}):
                outputs = super().loglikelihood([requests[i] for i in indices], disable_tqdm=disable_tqdm)
            for i, out in zip(indices, outputs, strict=True):
                results[i] = out
        return results

    def loglikelihood_rolling(self, requests: list[Instance], disable_tqdm: bool = False) -> list[float]:
        windows = {id(inst): self._rolling_inputs(inst.args[0]) for inst in requests}
        with self.ledger.teacher_forcing(dict(w for ws in windows.values() for w in ws)):
            return self._run(requests, lambda batch: super(ALSpecLM, self).loglikelihood_rolling(batch, disable_tqdm),
                             lambda inst: [key for key, _ in windows[id(inst)]])

    def generate_until(self, requests: list[Instance], disable_tqdm: bool = False) -> list[str]:
        return self._run(requests, lambda batch: super(ALSpecLM, self).generate_until(batch, disable_tqdm),
                         lambda inst: [self.ledger.prompt_key(self.tok_encode(inst.args[0]))])

    def _run(self, requests: list[Instance], run: Callable[[list[Instance]], list],
             keys_of: Callable[[Instance], list[RowKey]]) -> list:
        """HFLM's request method, task by task through the ledger; then every rank's task statistics (one collective
        per call, on every rank)."""
        results = self.ledger.run(requests, run, keys_of)
        self.task_stats, self.sample_stats = gather_statistics(self.ledger.task_stats, self.ledger.sample_stats,
                                                               self.world_size, self.speculator.num_layers)
        return results

    def reset_statistics(self) -> None:
        """Start counting anew (a sweep's next cell)."""
        self.ledger.reset()
        self.task_stats, self.sample_stats = {}, {}

    @property
    def num_layers(self) -> int:
        return self.speculator.num_layers

    @property
    def skipped_layers(self) -> dict[int, str]:
        """Layers that do not speculate (sliding windows), with why."""
        return self.speculator.skipped_layers

    @property
    def decode_tokens(self) -> int:
        """Generated or teacher-forced tokens answered so far, for progress displays."""
        return self.ledger.decode_tokens

    # ------------------------------------------------------------------ loglikelihood: teacher forcing

    def _pair_input(self, context: str, continuation: str) -> tuple[RowKey, int]:
        """The model input HFLM builds for a pair, and where its speculation starts (docs/design.md, Semantics 6)."""
        if context == "":
            context_enc, continuation_enc = [self.prefix_token_id], self.tok_encode(continuation)
        else:
            context_enc, continuation_enc = self._encode_pair(context, continuation)
        key = model_input(context_enc, continuation_enc, self.max_length)
        if self.spec_config.speculate_prefill:
            return key, 0
        return key, max(len(key) - (len(continuation_enc) - 1), 0)

    def _rolling_inputs(self, string: str) -> list[tuple[RowKey, int]]:
        """A rolling request's windows as HFLM builds them; every scored token speculates (docs/design.md, Semantics 6)."""
        windows = map(utils.make_disjoint_window, utils.get_rolling_token_windows(
            token_list=self.tok_encode(string), prefix_token=self.prefix_token_id,
            max_seq_len=self.max_length, context_len=1))
        return [(model_input(ctx, cont, self.max_length), 0) for ctx, cont in windows]

    def _model_call(self, inps: torch.Tensor, attn_mask: torch.Tensor | None = None,
                    labels: torch.Tensor | None = None) -> torch.Tensor:
        if self._probing:
            return super()._model_call(inps, attn_mask, labels)
        keys = [self.ledger.match(row) for row in inps.tolist()]
        logits, records = self._answers.forward(inps, keys, [self.ledger.starts[k] for k in keys],
                                                lambda: super(ALSpecLM, self)._model_call(inps, attn_mask, labels))
        self.ledger.records.update(zip(keys, records, strict=True))
        return logits

    def _detect_batch_size(self, *args: Any, **kwargs: Any) -> int:
        """lm-eval's probe for --batch_size auto runs forward passes of its own tokens: outside speculation, so
        they count in no statistic."""
        self._probing = True
        try:
            return super()._detect_batch_size(*args, **kwargs)
        finally:
            self._probing = False

    # ------------------------------------------------------------------ generation

    def _model_generate(self, context: torch.Tensor, max_length: int, stop: list[str],
                        **generation_kwargs: Any) -> torch.Tensor:
        keys = row_keys(context, generation_kwargs.get("attention_mask"))
        out, records = self._answers.generate(context, max_length, stop, self._stop_rule(stop), generation_kwargs,
                                              super()._model_generate)
        self.ledger.records.update(zip(keys, records, strict=True))
        return out

    def _stop_rule(self, stop: Sequence[str]) -> StopRule:
        eos = self.model.generation_config.eos_token_id
        eos_ids = set(eos if isinstance(eos, list) else [eos]) | {self.tokenizer.eos_token_id}
        return StopRule(stop, eos_ids, lambda t: self.tok_decode(t, skip_special_tokens=False))

    # ------------------------------------------------------------------ settings

    def set_cache_hook(self, cache_hook: Any) -> None:
        """lm-eval's CachingLM (``use_cache``) registers here: refused, see USE_CACHE_REFUSED."""
        if getattr(cache_hook, "dbdict", None) is not None:
            raise ConfigError(USE_CACHE_REFUSED)
        super().set_cache_hook(cache_hook)

    def _answers_for(self, config: SpeculationConfig) -> Answers:
        return answers_for(config, self.speculator, self.model, self.tokenizer.pad_token_id)

    def reconfigure(self, **changes: Any) -> None:
        """Change speculation settings between evaluations (sweeps load the model once); every later call
        speculates with them. Settings fixed when the model loads (backend, kernel, tt) cannot change."""
        fixed = sorted(set(changes) & set(LOAD_TIME_SETTINGS))
        if fixed:
            raise ConfigError(f"{', '.join(fixed)} cannot change after the model is loaded; load another ALSpecLM")
        self._use(dataclasses.replace(self.spec_config, **changes))

    def _use(self, config: SpeculationConfig, answers: Answers | None = None) -> None:
        config.check_layers(self.speculator.num_layers)
        self.spec_config, self._answers = config, answers or self._answers_for(config)
        self.ledger.trace_tokens = config.trace_tokens

    @contextmanager
    def answering(self, row: Row, static_layers: tuple[int, ...] = (),
                  shared: SharedPrefill | None = None) -> Iterator[SpeculationConfig]:
        """Evaluate as ``row`` inside this block: its own config (the model's, with the row's settings; what its
        results record) and its answer source (``shared``'s replay of the row, else the model itself)."""
        previous = self.spec_config, self._answers
        config = row.config(self.spec_config, tuple(static_layers))
        self._use(config, shared.answers(row) if shared is not None else None)
        try:
            yield config
        finally:
            self.spec_config, self._answers = previous
            self.ledger.trace_tokens = self.spec_config.trace_tokens

    @contextmanager
    def shared_prefill(self, variants: list[Row]) -> Iterator[SharedPrefill]:
        """The rows of a sweep on one exact prefill; each answers through ``answering(row, shared=...)``."""
        if self.spec_config.speculate_prefill:
            raise ConfigError("a shared prefill needs speculate_prefill=false (with a speculated prompt the KV cache "
                              "differs per lambda)")
        if alone := [v.label for v in variants if not v.shares_prefill]:
            raise ValueError(f"rows {alone} cannot share a prefill (static calibrates on the others first): run "
                             "them alone")
        # each approximation and window decodes from the one prefill in a call of its own
        yield SharedPrefill(list(variants), self.model, self.speculator, self.spec_config,
                            self.tokenizer.pad_token_id)

    # ------------------------------------------------------------------ results

    def statistics(self) -> dict[str, Any]:
        """Schema v2: config, histogram edges and per-task, per-layer (and self-speculation) statistics."""
        stats = run_statistics(self.spec_config.to_dict(), self.speculator.num_layers,
                               self.speculator.skipped_layers, self.task_stats)
        stats["provenance"] = {"model": getattr(self.model.config, "_name_or_path", None), "versions": versions(),
                               "engine": "hf", "kernel": self._backend.kernel_line}
        return stats

    def get_model_info(self) -> dict[str, Any]:
        info = super().get_model_info()
        info["alspec"] = self.statistics()
        if self.spec_config.stats_path:
            path = write_json_atomic(self.spec_config.stats_path, info["alspec"])
            write_jsonl_atomic(samples_path(path), sample_rows(self.sample_stats))
        return info
