"""Engines shared by a pytest session (each start costs about 30 s on the CPU): SmolLM2 in float32 through
alspec-vllm and through lm-eval's plain VLLM with the same engine arguments, and a tiny random Llama (head_dim 32,
the smallest CPU_ATTN takes) whose workers keep what the float64 reference recomputes. Run in .venv-vllm
(scripts/vllm_env.sh); elsewhere the engine tests skip."""

from __future__ import annotations

import os
from contextlib import contextmanager

import pytest

# every step compares the newest key read back from the cache with the incoming one (paged.check_newest)
os.environ["ALSPEC_VLLM_CHECK_LAYOUT"] = "1"
# vLLM's CPU attention splits a row's keys across threads when a step has few rows, so A (and d/n) could differ in
# the last bits with how the engine, by timing, batched the requests; the tests compare runs bit for bit
os.environ["VLLM_CPU_ATTN_SPLIT_KV"] = "0"

# vLLM 0.32 saves the compiled model for the next engine start but cannot load it in the CPU's mode (DYNAMO_TRACE_ONCE:
# "'function' object has no attribute 'finalize_loading'", then it compiles again); without that cache torch's own
# Inductor caches serve a second start with the same graph (the SmolLM2 pair below, each xdist worker's)
os.environ.setdefault("VLLM_USE_AOT_COMPILE", "0")

# SmolLM2's engines run in vLLM's default mode, compiled (no enforce_eager: on the CPU one Dynamo trace compiled by
# Inductor, attention an opaque op called from the compiled code; docs/vllm.md); the tiny Llama's start eagerly (one
# engine start each, several per session)
ENGINE = {"dtype": "float32", "kv_cache_memory_bytes": 256 * 2**20, "seed": 0, "block_size": 32, "max_model_len": 2048}
TINY = {**ENGINE, "enforce_eager": True, "block_size": 32, "max_num_batched_tokens": 96, "max_model_len": 1024}

# what a test may not leave changed in its process: with the engine core in-process, the next engine shares vLLM's
# distributed groups with the session's, and its shutdown destroys them (the session's engines then fail at their
# next step); without Dynamo, the compiled-mode tests would run eagerly
PROCESS_ENV = ("VLLM_ENABLE_V1_MULTIPROCESSING", "TORCHDYNAMO_DISABLE")


@pytest.fixture(autouse=True)
def process_env_kept():
    before = {name: os.environ.get(name) for name in PROCESS_ENV}
    yield
    after = {name: os.environ.get(name) for name in PROCESS_ENV}
    assert after == before, f"a test changed its process's engine environment: {before} -> {after}"


@pytest.fixture(scope="session")
def smollm2_path() -> str:
    from alspec_eval.smollm2 import smollm2_path

    return str(smollm2_path())


@pytest.fixture(scope="session")
def alspec_smol(smollm2_path):
    """alspec-vllm on SmolLM2 at lambda = 0, window 64 (tests reconfigure it and put it back), compiled."""
    from alspec_eval.vllm.model import ALSpecVLLM

    return ALSpecVLLM(smollm2_path, window=64, **{"lambda": 0.0}, **ENGINE)


@pytest.fixture(scope="session")
def plain_smol(smollm2_path):
    """lm-eval's own VLLM with the same engine arguments (compiled too)."""
    from alspec_eval.compat import lm_eval_vllm

    return lm_eval_vllm().VLLM(pretrained=smollm2_path, **ENGINE)


@pytest.fixture(scope="session")
def tiny_path(tmp_path_factory) -> str:
    from alspec_eval.approx_check.models import ARCHS, build, char_tokenizer

    path = tmp_path_factory.mktemp("tiny-llama")
    build(ARCHS["llama"], 0, hidden_size=128, intermediate_size=256, num_hidden_layers=3).save_pretrained(path)
    char_tokenizer().save_pretrained(path)
    return str(path)


@pytest.fixture(scope="session")
def alspec_tiny(tiny_path):
    """alspec-vllm on the tiny Llama: 32-token blocks, chunked prefill of 96 tokens a step (so steps mix prefill
    chunks and decodes), window 16."""
    from alspec_eval.vllm.model import ALSpecVLLM

    return ALSpecVLLM(tiny_path, window=16, **TINY)


@contextmanager
def speculating(lm, dump: bool = False, **changes):
    """``lm`` with other speculation settings inside the block (every worker), its own again after."""
    previous, dumped = lm.spec_config, lm.dump
    lm.reconfigure(dump=dump, **changes)
    try:
        yield lm
    finally:
        lm.dump = dumped
        lm._use(previous)


def dumps_of(lm) -> list[dict]:
    """The workers' dumps, their tensors as tensors again (the RPC carries their bytes)."""
    from alspec_eval.vllm.worker import unpacked

    return [{k: unpacked(v) if isinstance(v, dict) else v for k, v in d.items()}
            for d in lm.model.collective_rpc("alspec_dumps")[0]]
