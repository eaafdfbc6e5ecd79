"""Writing JSON result files so that an interrupted run never leaves a half-written file behind."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any


def write_json_atomic(path: str | os.PathLike, data: Any) -> Path:
    """Write JSON to a temporary file in the same folder, then rename it over ``path``."""
    return _write_atomic(path, json.dumps(data, indent=2, sort_keys=True) + "\n")


def write_jsonl_atomic(path: str | os.PathLike, rows: list[dict[str, Any]]) -> Path:
    """Write one JSON object per line, atomically as :func:`write_json_atomic`."""
    return _write_atomic(path, "".join(json.dumps(row, sort_keys=True) + "\n" for row in rows))


def _write_atomic(path: str | os.PathLike, text: str) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.chmod(tmp, 0o666 & ~_umask())  # as a plain open() would, like lm-eval's own result files
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def _umask() -> int:
    """The process umask (reading it means setting it; it is set straight back)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return mask
