"""The synthetic sweep folder, built once per test module."""

from __future__ import annotations

from pathlib import Path

import pytest
from synthetic_sweep import write_sweep


@pytest.fixture(scope="module")
def sweep_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_sweep(tmp_path_factory.mktemp("sweep"))
