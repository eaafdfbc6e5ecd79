"""Tables, figures and latency projections of a lambda sweep's output folder (``alspec-report``).

``load(OUTDIR)`` returns the sweep as tidy pandas frames (see :mod:`.frames`). Modules: ``cells`` (the folder's
files as dataclasses), ``frames`` (tidy frames, paired differences), ``table`` (Table 1), ``figures``,
``latency`` (the paper's latency model on every cell), ``html``, ``build`` (``write_report``), ``cli``.
Importing the package imports none of them: ``load`` pulls in pandas only when called.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any


def load(outdir: str | Path) -> Any:
    """The sweep in ``outdir`` as ``Frames(cells, layers, documents)``: see :func:`.frames.load`."""
    from .frames import load as load_frames

    return load_frames(outdir)
