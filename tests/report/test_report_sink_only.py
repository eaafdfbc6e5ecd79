"""A sweep of the sink alone reports exactly as before approximations reached the report: every file the committed
code wrote (tests/report/golden/, see golden.py), text byte for byte and figures by what they draw."""

from __future__ import annotations

from pathlib import Path

from golden import recorded, render


def test_sink_only_report_is_unchanged(tmp_path: Path) -> None:
    files = render(tmp_path / "sweep")
    golden = recorded()
    assert sorted(files) == sorted(golden)
    for name, data in golden.items():
        assert files[name].decode() == data.decode(), name
