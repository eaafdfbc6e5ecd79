"""A sweep of the sink alone reports exactly as before approximations reached the report: every file the committed
code wrote (tests/report/golden/, see golden.py), text byte for byte and figures by sha256."""

from __future__ import annotations

from pathlib import Path

import matplotlib
from golden import recorded, render


def test_sink_only_report_is_unchanged(tmp_path: Path) -> None:
    files = render(tmp_path / "sweep")
    golden, drawn_with = recorded()
    assert sorted(files) == sorted(golden)
    for name, data in golden.items():
        if name.endswith(".png.sha256") and matplotlib.__version__ != drawn_with:
            continue  # another matplotlib draws other pixels: the text files still hold every number
        assert files[name] == data, name
