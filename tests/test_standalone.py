"""A user clones the repository alone: no file of it points outside it (the team's folders, one machine's paths) or
at a tracker's issue numbers."""

from __future__ import annotations

import os
import re
from pathlib import Path

ROOT = Path(__file__).parents[1]
SKIP_DIRS = {".git", "__pycache__", "build", "dist", "results", ".pytest_cache", ".cache", ".triton-floor"}
OUTSIDE = re.compile("|".join([
    r"\.\./" + "shared",                  # the team's folder beside the clone
    r"/" + r"(?:root|home|work)/",          # one machine's home or work tree
    r"\." + r"pyenv/",                      # one machine's interpreters
    r"\bissues? #?\d+", r"\bthe issue's\b",  # a tracker's numbers (PR numbers of other projects are citations)
]), re.IGNORECASE)


def repository_files() -> list[Path]:
    """Every file of the checkout, outside version control's, build and installed packages' folders (pruned
    while walking: a .venv holds hundreds of thousands of files)."""
    files = []
    for folder, dirs, names in os.walk(ROOT):
        dirs[:] = [d for d in dirs if not (d in SKIP_DIRS or d.startswith(".venv") or d.endswith(".egg-info"))]
        files.extend(Path(folder) / name for name in names)
    return files


def test_no_file_points_outside_the_repository():
    offending = []
    for path in repository_files():
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            continue  # binary
        for number, line in enumerate(text.splitlines(), 1):
            if match := OUTSIDE.search(line):
                offending.append(f"{path.relative_to(ROOT)}:{number}: {match[0]!r}")
    assert not offending, "\n".join(offending)


def test_the_contract_ships_with_the_repository():
    for doc in ("design.md", "tt_op_contract.md", "paper.md"):
        assert (ROOT / "docs" / doc).stat().st_size > 1000
    cited = {m for path in repository_files() if path.suffix in (".py", ".md")
             for m in re.findall(r"docs/([\w.]+\.md)", path.read_text(encoding="utf-8"))}
    assert cited and all((ROOT / "docs" / name).is_file() for name in cited), cited
