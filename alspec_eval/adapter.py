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
from collections import defaultdict
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
import transformers
from lm_eval import utils
from lm_eval.api.instance import Instance
from lm_eval.api.registry import register_model
from lm_eval.models.huggingface import HFLM

from .config import ConfigError, SpeculationConfig
from .fork import RowKey, SharedPrefill, Variant, forward_all, generate_all
from .models import SMOLLM2_ALIAS, smollm2_path
from .region import DecodeRegion, Trace
from .report_io import write_json_atomic
from .sidecar import register_sidecar
from .stats import RATIO_EDGES, SCHEMA_VERSION, AcceptanceStats

_HFLM_ARGS = set(inspect.signature(HFLM.__init__).parameters)


def _print_config_errors(hook: Callable) -> Callable:
    """A bad model_arg ends the run with its one-line message instead of a traceback through lm-eval."""

    def excepthook(exc_type: type[BaseException], exc: BaseException, tb: Any) -> None:
        if issubclass(exc_type, ConfigError):
            print(f"alspec: {exc}", file=sys.stderr)
        else:
            hook(exc_type, exc, tb)

    return excepthook


sys.excepthook = _print_config_errors(sys.excepthook)


@register_model("alspec")
class ALSpecLM(HFLM):
    """HFLM whose attention speculates: see DESIGN.md for what every backend computes."""

    def __init__(self, pretrained: str | transformers.PreTrainedModel, **kwargs: Any) -> None:
        self.spec_config, hf_kwargs = SpeculationConfig.from_model_args(kwargs, _HFLM_ARGS)
        if self.spec_config.backend == "tt":
            from .backends.tt import check_environment

            check_environment(self.spec_config)  # no ttnn or no device: stop before the weights load
        if pretrained == SMOLLM2_ALIAS:
            pretrained = str(smollm2_path())
        super().__init__(pretrained=pretrained, **hf_kwargs)
        if self.spec_config.backend == "tt":
            from .backends.tt import install
        else:
            from .backends.sim import install

        self.speculator = install(self.model, self.spec_config)
        self.task_stats: dict[str, AcceptanceStats] = {}
        self.decode_tokens = 0  # generated or teacher-forced tokens answered so far, for progress displays
        self._row_stats: dict[RowKey, dict[str, Any]] = {}
        self._row_starts: dict[RowKey, int] = {}
        self._rolling = False
        self.fork: SharedPrefill | None = None
        register_sidecar(self.statistics)

    def _create_model(self, pretrained: str, *args: Any, **kwargs: Any) -> None:
        """Check what the config alone can tell before the weights load."""
        text_config = self._config.get_text_config()
        self.spec_config.check_layers(text_config.num_hidden_layers)
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
        for task, indices in by_task.items():
            self._row_stats.clear()
            outputs = run([requests[i] for i in indices], disable_tqdm=disable_tqdm)
            total = self.task_stats.get(task, AcceptanceStats.zeros(self.speculator.num_layers))
            for i, out in zip(indices, outputs, strict=True):
                results[i] = out
                rows = [self._row_stats[key] for key in keys_of(requests[i])]
                self.decode_tokens += sum(len(r["tokens"]) for r in rows)
                sample = sum((r["stats"] for r in rows), AcceptanceStats.zeros(self.speculator.num_layers))
                total = total + sample
                self._log_sample(requests[i], sample, rows)
            self.task_stats[task] = total
        return results

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
            outputs = super()._loglikelihood_tokens([requests[i] for i in indices], disable_tqdm, override_bs)
            for i, out in zip(indices, outputs, strict=True):
                results[i] = out
        return results

    def _model_call(self, inps: torch.Tensor, attn_mask: torch.Tensor | None = None,
                    labels: torch.Tensor | None = None) -> torch.Tensor:
        keys = [self._match_row(row) for row in inps.tolist()]
        starts = [self._row_starts[k] for k in keys]
        if self.fork is not None:
            return self._forked_call(inps, keys, starts)
        region = DecodeRegion.build([0] * len(keys), starts, [len(k) for k in keys], device=inps.device)
        with self.speculator.speculating(region) as trace:
            logits = super()._model_call(inps, attn_mask, labels)
        for b, (key, start) in enumerate(zip(keys, starts, strict=True)):
            self._row_stats[key] = self._teacher_forced_stats(trace, b, start, len(key))
        return logits

    def _teacher_forced_stats(self, trace: Trace, row: int, start: int, end: int) -> dict[str, Any]:
        return {"stats": trace.row_stats(row, start, end), "tokens": trace.accepted_layers(row, start, end)}

    def _forked_call(self, inps: torch.Tensor, keys: list[RowKey], starts: list[int]) -> torch.Tensor:
        """Logits of the variant being replayed; the first pass computes every variant at once."""
        fork = self.fork
        if any((key, 0) not in fork.rows for key in keys):
            logits, stats = forward_all(self, fork, inps, keys, starts)
            for r, entry in enumerate(stats):
                key, start = keys[r // len(fork.variants)], starts[r // len(fork.variants)]
                lo = max(start - 1, 0)  # HFLM reads the logits from the last context token on
                fork.rows[key, r % len(fork.variants)] = {**entry, "lo": lo, "logits": logits[r, lo:len(key)]}
        entries = [fork.rows[key, fork.replay] for key in keys]
        out = inps.new_zeros((*inps.shape, entries[0]["logits"].shape[-1]), dtype=entries[0]["logits"].dtype)
        for b, (key, entry) in enumerate(zip(keys, entries, strict=True)):
            out[b, entry["lo"]:len(key)] = entry["logits"]
            self._row_stats[key] = entry
        return out

    def _match_row(self, row: list[int]) -> RowKey:
        """The known input that this right-padded batch row holds."""
        end = len(row)
        while end > 1 and row[end - 1] == 0:
            end -= 1
        for length in range(end, len(row) + 1):
            if tuple(row[:length]) in self._row_starts:
                return tuple(row[:length])
        raise RuntimeError("a loglikelihood batch row matches no request; this lm-eval version batches differently")

    # ------------------------------------------------------------------ generation

    def _prompt_key(self, context: str) -> RowKey:
        key = tuple(self.tok_encode(context))
        if key in self._row_stats:
            return key
        return next(k for k in self._row_stats if key[-len(k):] == k)  # HFLM truncated the prompt on the left

    def _model_generate(self, context: torch.Tensor, max_length: int, stop: list[str],
                        **generation_kwargs: Any) -> torch.Tensor:
        if self.fork is not None:
            return self._forked_generate(context, max_length, stop, generation_kwargs)
        mask = generation_kwargs.get("attention_mask")
        region = DecodeRegion.from_left_padded(torch.ones_like(context) if mask is None else mask,
                                               self.spec_config.speculate_prefill)
        with self.speculator.speculating(region) as trace:
            out = super()._model_generate(context, max_length, stop, **generation_kwargs)
        for b in range(len(context)):
            key = tuple(context[b, int(region.pad[b]):].tolist())
            self._row_stats[key] = self._generation_stats(trace, region, b, out[b], context.shape[1], stop)
        return out

    def _generation_stats(self, trace: Trace, region: DecodeRegion, row: int, out: torch.Tensor, prompt_len: int,
                          stop: Sequence[str]) -> dict[str, Any]:
        """A row's decisions up to where it would have stopped alone; the last new token is never fed back."""
        end = prompt_len + self._own_length(out[prompt_len:].tolist(), stop) - 1
        return {"stats": trace.row_stats(row, int(region.spec_start[row]), end),
                "tokens": trace.accepted_layers(row, prompt_len - 1, end)}

    def _forked_generate(self, context: torch.Tensor, max_length: int, stop: list[str],
                         generation_kwargs: dict[str, Any]) -> torch.Tensor:
        """Generations of the variant being replayed; the first pass generates every variant at once."""
        fork = self.fork
        mask = generation_kwargs.get("attention_mask")
        pads = [0] * len(context) if mask is None else (mask.shape[1] - mask.long().sum(-1)).tolist()
        keys = [tuple(row[pad:].tolist()) for row, pad in zip(context, pads, strict=True)]
        if any((key, 0) not in fork.rows for key in keys):
            out, rows = generate_all(self, fork, context, max_length, stop, dict(generation_kwargs))
            for r, (key, variant, entry) in enumerate(rows):
                fork.rows[key, variant] = {**entry, "generated": out[r, context.shape[1]:]}
        entries = [fork.rows[key, fork.replay] for key in keys]
        width = max(len(e["generated"]) for e in entries)
        out = context.new_full((len(context), context.shape[1] + width), self.tokenizer.pad_token_id)
        out[:, :context.shape[1]] = context
        for b, (key, entry) in enumerate(zip(keys, entries, strict=True)):
            out[b, context.shape[1]:context.shape[1] + len(entry["generated"])] = entry["generated"]
            self._row_stats[key] = entry
        return out

    def reconfigure(self, **changes: Any) -> None:
        """Change speculation settings between evaluations (sweeps load the model once)."""
        self.spec_config = dataclasses.replace(self.spec_config, **changes)
        self.spec_config.check_layers(self.speculator.num_layers)
        self.speculator.config = self.spec_config

    @contextmanager
    def shared_prefill(self, variants: list[Variant]) -> Iterator[SharedPrefill]:
        """Run the variants of a sweep on one exact prefill; set ``replay`` to choose which one answers."""
        if self.spec_config.speculate_prefill or self.spec_config.policy != "dynamic":
            raise ConfigError("a shared prefill needs policy=dynamic and speculate_prefill=false "
                              "(with a speculated prompt the KV cache differs per lambda)")
        self.fork = SharedPrefill(list(variants))
        try:
            yield self.fork
        finally:
            self.fork = None

    def _own_length(self, tokens: list[int], stop: Sequence[str]) -> int:
        """How many tokens this row would have generated alone (batch mates keep it running past its stop)."""
        eos = self.model.generation_config.eos_token_id
        eos_ids = set(eos if isinstance(eos, list) else [eos]) | {self.tokenizer.eos_token_id}
        length = next((i + 1 for i, t in enumerate(tokens) if t in eos_ids), len(tokens))
        strings = [s for s in stop if s]

        def stopped(n: int) -> bool:
            text = self.tok_decode(tokens[:n], skip_special_tokens=False)
            return any(s in text for s in strings)

        if not strings or not stopped(length):
            return length
        lo, hi = 1, length  # smallest n with stopped(n): the decoded prefix grows with n
        while lo < hi:
            mid = (lo + hi) // 2
            lo, hi = (lo, mid) if stopped(mid) else (mid + 1, hi)
        return lo

    # ------------------------------------------------------------------ results

    def statistics(self) -> dict[str, Any]:
        """Schema v1: config, histogram edges and per-task, per-layer statistics."""
        skipped = self.speculator.skipped_layers
        return {
            "schema_version": SCHEMA_VERSION,
            "config": self.spec_config.to_dict(),
            "num_layers": self.speculator.num_layers,
            "skipped_layers": {str(k): v for k, v in sorted(skipped.items())},
            "ratio_edges": list(RATIO_EDGES),
            "tasks": {task: stats.to_dict(skipped) for task, stats in sorted(self.task_stats.items())},
        }

    def get_model_info(self) -> dict[str, Any]:
        info = super().get_model_info()
        info["alspec"] = self.statistics()
        if self.spec_config.stats_path:
            write_json_atomic(self.spec_config.stats_path, info["alspec"])
        return info
