"""`lm_eval --model alspec`: lm-eval's HFLM with attention-level speculation and its statistics.

Every HFLM option keeps working; the speculation options are read off the same
model_args (see README). Requests run task by task so statistics are kept per task;
each forward pass runs inside a decode region (DESIGN.md, Semantics 6) and each
sample's decisions are reduced to per-layer counts and logged with the sample.
"""

from __future__ import annotations

import dataclasses
import inspect
import sys
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
import transformers
from transformers import DynamicCache
from lm_eval import utils
from lm_eval.api.instance import Instance
from lm_eval.api.registry import register_model
from lm_eval.models.huggingface import HFLM

from .compat import check_lm_eval
from .config import LOAD_TIME_SETTINGS, ConfigError, SpeculationConfig
from .hooks import check_fused_kernel
from .rows import Row
from .shared_prefill import RowKey, SharedPrefill, row_keys
from .models import SMOLLM2_ALIAS, smollm2_path
from .region import DecodeRegion, Trace
from .selfspec import check_model as check_selfspec_model, selfspec_generate
from .provenance import versions
from .report_io import write_json_atomic
from .sidecar import cli_option, register_sidecar
from .distributed import gather_task_stats, is_main_process
from .stats import AcceptanceStats, run_statistics
from .stopping import own_length, stop_length

_HFLM_ARGS = set(inspect.signature(HFLM.__init__).parameters)
# lm-eval's request cache (CachingLM) is keyed by the request alone and answers cached requests without calling
# the model: another lambda's answers would be served, and the cached samples would have no decisions.
USE_CACHE_REFUSED = ("--use_cache is not supported with --model alspec: lm-eval keys its cache by the request alone, "
                     "so answers cached under one lambda, window or policy would be served for another, without "
                     "their acceptance statistics; drop --use_cache (alspec-sweep shares one exact prefill per "
                     "request across a sweep's cells instead)")


@register_model("alspec")
class ALSpecLM(HFLM):
    """HFLM whose attention speculates: see DESIGN.md for what every backend computes."""

    def __init__(self, pretrained: str | transformers.PreTrainedModel, **kwargs: Any) -> None:
        check_lm_eval()
        self.spec_config, hf_kwargs = SpeculationConfig.from_model_args(kwargs, _HFLM_ARGS)
        if cli_option(sys.argv, "--use_cache", "-c") is not None:  # the stock CLI: refuse before the weights load
            raise ConfigError(USE_CACHE_REFUSED)
        # Checks --output_path now; writes at exit, if the model got loaded, from the main process only.
        register_sidecar(self.statistics, lambda: hasattr(self, "speculator") and is_main_process(self.rank))
        self._tt_runtime = None
        if self.spec_config.backend == "tt":
            from .backends.tt import prepare

            self._tt_runtime = prepare(self.spec_config)  # no ttnn or no device: stop before the weights load
        batch = str(hf_kwargs.get("batch_size", 1))
        self._fixed_batch = int(batch) if batch.isdigit() else None  # "auto": lm-eval decides later
        if pretrained == SMOLLM2_ALIAS:
            pretrained = str(smollm2_path())
        try:
            super().__init__(pretrained=pretrained, **hf_kwargs)
        except OSError as err:  # transformers' "not a local folder and not a valid model identifier" and kin
            if not isinstance(pretrained, str):
                raise
            raise ConfigError(f"pretrained={pretrained!r} cannot be loaded ({str(err).splitlines()[0]}); give a local "
                              "folder with config.json, a model id in the local hub cache, or pretrained=smollm2") from None
        if self.spec_config.policy == "selfspec":  # a model object skips _create_model
            check_selfspec_model(self.model.config)
        if self._tt_runtime is not None:
            from .backends.tt import install as install_tt

            self.speculator = install_tt(self.model, self.spec_config, self._tt_runtime)
        else:
            from .backends.sim import install

            self.speculator = install(self.model, self.spec_config.kernel)
        self.spec_config.check_layers(self.speculator.num_layers)  # a model object skips _create_model
        self.task_stats: dict[str, AcceptanceStats] = {}  # every rank's, summed (data parallel)
        self._local_stats: dict[str, AcceptanceStats] = {}  # this rank's
        self.decode_tokens = 0  # generated or teacher-forced tokens answered so far, for progress displays
        self._row_stats: dict[RowKey, dict[str, Any]] = {}
        self._row_starts: dict[RowKey, int] = {}
        self._row_lengths: list[int] = []
        self._probing = False
        self._rolling = False
        self.fork: SharedPrefill | None = None

    def _create_model(self, pretrained: str, *args: Any, **kwargs: Any) -> None:
        """Check what the config alone can tell before the weights load."""
        text_config = self._config.get_text_config()
        self.spec_config.check_layers(text_config.num_hidden_layers)
        if self.spec_config.policy == "selfspec":
            check_selfspec_model(self._config)
        if self.spec_config.kernel in ("torch", "triton"):
            check_fused_kernel(f"kernel={self.spec_config.kernel}", self._config)
        if self.spec_config.backend == "tt":
            check_fused_kernel("the TT op (backend=tt)", self._config)
        if self._tt_runtime is not None:
            from .backends.tt import check_model

            check_model(self._tt_runtime, self._config, self._fixed_batch)
        model_class = transformers.AutoModelForCausalLM._model_mapping.get(type(self._config), None)
        if model_class is not None and not model_class._supports_attention_backend:
            raise ConfigError(
                f"{model_class.__name__} does not dispatch attention through transformers' AttentionInterface, "
                "so speculation cannot be hooked; use a model that does (Llama, Qwen2/3, Mistral, Gemma, ...)"
            )
        super()._create_model(pretrained, *args, **kwargs)

    # ------------------------------------------------------------------ requests, task by task

    def loglikelihood(self, requests: list[Instance], disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        return self._run_by_task(requests, super().loglikelihood, disable_tqdm,
                                 lambda inst: [self._pair_key(*inst.args[:2])])

    def loglikelihood_rolling(self, requests: list[Instance], disable_tqdm: bool = False) -> list[float]:
        self._rolling = True
        try:
            return self._run_by_task(requests, super().loglikelihood_rolling, disable_tqdm,
                                     lambda inst: self._rolling_keys(inst.args[0]))
        finally:
            self._rolling = False

    def generate_until(self, requests: list[Instance], disable_tqdm: bool = False) -> list[str]:
        return self._run_by_task(requests, super().generate_until, disable_tqdm,
                                 lambda inst: [self._prompt_key(inst.args[0])])

    def _run_by_task(self, requests: list[Instance], run: Callable, disable_tqdm: bool,
                     keys_of: Callable[[Instance], list[RowKey]]) -> list:
        """Run each task's requests apart, then log every sample's statistics and add them to its task."""
        by_task: dict[str, list[int]] = defaultdict(list)
        for i, inst in enumerate(requests):
            by_task[inst.task_name or "default"].append(i)
        results: list = [None] * len(requests)
        seen: Counter[int] = Counter()
        for task, indices in by_task.items():
            self._row_stats.clear()
            outputs = run([requests[i] for i in indices], disable_tqdm=disable_tqdm)
            total = self._local_stats.get(task, AcceptanceStats.zeros(self.speculator.num_layers))
            for i, out in zip(indices, outputs, strict=True):
                results[i] = out
                inst = requests[i]
                seen[id(inst)] += 1
                if seen[id(inst)] > inst.repeats:  # lm-eval's padding of a data-parallel rank: not a request
                    continue
                rows = [self._row_stats[key] for key in keys_of(inst)]
                self.decode_tokens += sum(len(r["tokens"]) for r in rows)
                sample = sum((r["stats"] for r in rows), AcceptanceStats.zeros(self.speculator.num_layers))
                total = total + sample
                self._log_sample(inst, sample, rows)
            self._local_stats[task] = total
        self.task_stats = gather_task_stats(self._local_stats, self.world_size, self.speculator.num_layers)
        return results

    def reset_statistics(self) -> None:
        """Start counting anew (a sweep's next cell)."""
        self._local_stats, self.task_stats = {}, {}

    def _log_sample(self, inst: Instance, sample: AcceptanceStats, rows: list[dict[str, Any]]) -> None:
        """Per-sample statistics go into the samples log as an extra entry of the request's arguments."""
        entry = sample.summary()
        if self.spec_config.trace_tokens:
            entry["accepted_layers_per_token"] = [t for r in rows for t in r["tokens"]]
        args = inst.arguments if isinstance(inst.arguments, tuple) else (inst.arguments,)
        if args and isinstance(args[-1], dict) and "alspec" in args[-1]:  # a repeated request: log it once
            args = args[:-1]
        inst.arguments = (*args, {"alspec": entry})

    # ------------------------------------------------------------------ loglikelihood: teacher forcing

    def _input_key(self, context_enc: list[int], continuation_enc: list[int]) -> tuple[RowKey, int]:
        """The model input HFLM builds for a pair, and where its speculation starts (DESIGN.md 6)."""
        inp = tuple((context_enc + continuation_enc)[-(self.max_length + 1):][:-1])
        if self._rolling or self.spec_config.speculate_prefill:
            return inp, 0
        return inp, max(len(inp) - (len(continuation_enc) - 1), 0)

    def _pair_key(self, context: str, continuation: str) -> RowKey:
        if context == "":
            context_enc, continuation_enc = [self.prefix_token_id], self.tok_encode(continuation)
        else:
            context_enc, continuation_enc = self._encode_pair(context, continuation)
        return self._input_key(context_enc, continuation_enc)[0]

    def _rolling_keys(self, string: str) -> list[RowKey]:
        windows = map(utils.make_disjoint_window, utils.get_rolling_token_windows(
            token_list=self.tok_encode(string), prefix_token=self.prefix_token_id,
            max_seq_len=self.max_length, context_len=1))
        return [self._input_key(ctx, cont)[0] for ctx, cont in windows]

    def _loglikelihood_tokens(self, requests: list, disable_tqdm: bool = False,
                              override_bs: int | None = None) -> list[tuple[float, bool]]:
        """Remember where each input speculates; inputs that repeat with another start run in a later pass."""
        passes: list[list[int]] = []
        starts: list[dict[RowKey, int]] = []
        for i, (_, context_enc, continuation_enc) in enumerate(requests):
            key, start = self._input_key(context_enc, continuation_enc)
            slot = next((p for p, seen in enumerate(starts) if seen.get(key, start) == start), len(passes))
            if slot == len(passes):
                passes.append([])
                starts.append({})
            passes[slot].append(i)
            starts[slot][key] = start
        results: list = [None] * len(requests)
        for indices, self._row_starts in zip(passes, starts, strict=True):
            self._row_lengths = sorted({len(k) for k in self._row_starts}, reverse=True)
            outputs = super()._loglikelihood_tokens([requests[i] for i in indices], disable_tqdm, override_bs)
            for i, out in zip(indices, outputs, strict=True):
                results[i] = out
        return results

    def _model_call(self, inps: torch.Tensor, attn_mask: torch.Tensor | None = None,
                    labels: torch.Tensor | None = None) -> torch.Tensor:
        if self._probing:
            return super()._model_call(inps, attn_mask, labels)
        keys = [self._match_row(row) for row in inps.tolist()]
        starts = [self._row_starts[k] for k in keys]
        if self.fork is not None:
            logits, entries = self.fork.forward(self, inps, keys, starts)
            self._row_stats.update(zip(keys, entries, strict=True))
            return logits
        region = DecodeRegion.build([0] * len(keys), starts, [len(k) for k in keys], device=inps.device)
        with self.speculator.speculating(region, self.spec_config) as trace:
            logits = super()._model_call(inps, attn_mask, labels)
        for b, (key, start) in enumerate(zip(keys, starts, strict=True)):
            self._row_stats[key] = self.teacher_forced_stats(trace, b, start, len(key))
        return logits

    def teacher_forced_stats(self, trace: Trace, row: int, start: int, end: int) -> dict[str, Any]:
        """A teacher-forced row's statistics entry: its decisions over [start, end)."""
        return {"stats": trace.row_stats(row, start, end), "tokens": trace.accepted_layers(row, start, end)}

    def _match_row(self, row: list[int]) -> RowKey:
        """The known input that this right-padded batch row holds: the longest known input the row starts with,
        followed only by one repeated (padding) token. Needs no pad id and no knowledge of lm-eval's batching."""
        for length in self._row_lengths:
            if length <= len(row) and len(set(row[length:])) <= 1 and tuple(row[:length]) in self._row_starts:
                return tuple(row[:length])
        raise RuntimeError("a loglikelihood batch row matches no request of this pass")

    def _detect_batch_size(self, *args: Any, **kwargs: Any) -> int:
        """lm-eval's probe for --batch_size auto runs forward passes of its own tokens: outside speculation, so
        they count in no statistic."""
        self._probing = True
        try:
            return super()._detect_batch_size(*args, **kwargs)
        finally:
            self._probing = False

    def _prompt_key(self, context: str) -> RowKey:
        key = tuple(self.tok_encode(context))
        if key in self._row_stats:
            return key
        return next(k for k in self._row_stats if key[-len(k):] == k)  # HFLM truncated the prompt on the left

    def _model_generate(self, context: torch.Tensor, max_length: int, stop: list[str],
                        **generation_kwargs: Any) -> torch.Tensor:
        if self.fork is not None:
            out, entries = self.fork.generate(self, context, max_length, stop, generation_kwargs)
            self._row_stats.update(zip(row_keys(context, generation_kwargs.get("attention_mask")), entries, strict=True))
            return out
        if self.spec_config.policy == "selfspec":
            return self._selfspec_generate(context, max_length, stop, generation_kwargs)
        mask = generation_kwargs.get("attention_mask")
        region = DecodeRegion.from_left_padded(torch.ones_like(context) if mask is None else mask,
                                               self.spec_config.speculate_prefill)
        with self.speculator.speculating(region, self.spec_config) as trace:
            out = self.generate_rows(context, max_length, stop, **generation_kwargs)
        for b in range(len(context)):
            key = tuple(context[b, int(region.pad[b]):].tolist())
            self._row_stats[key] = self.generation_stats(trace, region, b, out[b], context.shape[1], stop)
        return out

    def _selfspec_generate(self, context: torch.Tensor, max_length: int, stop: list[str],
                           generation_kwargs: dict[str, Any]) -> torch.Tensor:
        """policy=selfspec: each row decoded alone by greedy self-speculation, laid out as HF's generate would."""
        keys = row_keys(context, generation_kwargs.get("attention_mask"))
        rows = []
        for key in keys:
            tokens, entry = self.selfspec_row(None, list(key), max_length - context.shape[1], stop, generation_kwargs)
            self._row_stats[key] = entry
            rows.append(tokens)
        out = context.new_full((len(context), context.shape[1] + max(map(len, rows))), self.tokenizer.pad_token_id)
        out[:, :context.shape[1]] = context
        for b, tokens in enumerate(rows):
            out[b, context.shape[1]:context.shape[1] + len(tokens)] = context.new_tensor(tokens)
        return out

    def selfspec_row(self, cache: DynamicCache | None, pending: list[int], max_new: int, stop: Sequence[str],
                     generation_kwargs: dict[str, Any], gamma: int | None = None) -> tuple[list[int], dict[str, Any]]:
        """One row's greedy self-speculative generation (after ``cache``, from ``pending`` on) and its statistics
        entry; ``gamma`` overrides the config's (a sweep's shared prefill runs every gamma)."""
        if generation_kwargs.get("do_sample"):
            raise ConfigError("policy=selfspec decodes greedily (it is lossless against greedy decoding); "
                              "drop do_sample=true from the task's or --gen_kwargs' generation settings")
        eos_ids = self._eos_ids()
        decode = lambda t: self.tok_decode(t, skip_special_tokens=False)  # noqa: E731
        tokens, draft = selfspec_generate(self.model, self.speculator, self.spec_config, pending, max_new,
                                          gamma or self.spec_config.gamma,
                                          lambda t: stop_length(t, stop, eos_ids, decode), cache)
        return tokens, {"stats": dataclasses.replace(AcceptanceStats.zeros(self.speculator.num_layers), draft=draft),
                        "tokens": []}

    def generate_rows(self, context: torch.Tensor, max_length: int, stop: list[str], **kwargs: Any) -> torch.Tensor:
        """HFLM's own generation (the shared prefill calls it for its forked batch)."""
        return super()._model_generate(context, max_length, stop, **kwargs)

    def generation_stats(self, trace: Trace, region: DecodeRegion, row: int, out: torch.Tensor, prompt_len: int,
                         stop: Sequence[str]) -> dict[str, Any]:
        """A row's decisions up to where it would have stopped alone; the last new token is never fed back."""
        end = prompt_len + self._own_length(out[prompt_len:].tolist(), stop) - 1
        return {"stats": trace.row_stats(row, int(region.spec_start[row]), end),
                "tokens": trace.accepted_layers(row, prompt_len - 1, end)}

    def set_cache_hook(self, cache_hook: Any) -> None:
        """lm-eval's CachingLM (``use_cache``) registers here: refused, see USE_CACHE_REFUSED."""
        if getattr(cache_hook, "dbdict", None) is not None:
            raise ConfigError(USE_CACHE_REFUSED)
        super().set_cache_hook(cache_hook)

    def reconfigure(self, **changes: Any) -> None:
        """Change speculation settings between evaluations (sweeps load the model once); every later call
        speculates with them. Settings fixed when the model loads (backend, kernel, tt_*) cannot change."""
        fixed = sorted(set(changes) & set(LOAD_TIME_SETTINGS))
        if fixed:
            raise ConfigError(f"{', '.join(fixed)} cannot change after the model is loaded; load another ALSpecLM")
        config = dataclasses.replace(self.spec_config, **changes)
        config.check_layers(self.speculator.num_layers)
        self.spec_config = config

    @contextmanager
    def shared_prefill(self, variants: list[Row]) -> Iterator[SharedPrefill]:
        """Run the variants of a sweep on one exact prefill; set ``replay`` to choose which one answers."""
        if self.spec_config.speculate_prefill or self.spec_config.policy != "dynamic":
            raise ConfigError("a shared prefill needs policy=dynamic and speculate_prefill=false "
                              "(with a speculated prompt the KV cache differs per lambda)")
        self.fork = SharedPrefill(list(variants))
        try:
            yield self.fork
        finally:
            self.fork = None

    def _eos_ids(self) -> set[int]:
        eos = self.model.generation_config.eos_token_id
        return set(eos if isinstance(eos, list) else [eos]) | {self.tokenizer.eos_token_id}

    def _own_length(self, tokens: list[int], stop: Sequence[str]) -> int:
        return own_length(tokens, stop, self._eos_ids(), lambda t: self.tok_decode(t, skip_special_tokens=False))

    # ------------------------------------------------------------------ results

    def statistics(self) -> dict[str, Any]:
        """Schema v2: config, histogram edges and per-task, per-layer (and self-speculation) statistics."""
        stats = run_statistics(self.spec_config.to_dict(), self.speculator.num_layers,
                               self.speculator.skipped_layers, self.task_stats)
        stats["provenance"] = {"model": getattr(self.model.config, "_name_or_path", None), "versions": versions()}
        return stats

    def get_model_info(self) -> dict[str, Any]:
        info = super().get_model_info()
        info["alspec"] = self.statistics()
        if self.spec_config.stats_path:
            write_json_atomic(self.spec_config.stats_path, info["alspec"])
        return info
