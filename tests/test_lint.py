"""The repository passes ruff as pyproject.toml configures it, and every noqa comment names its rule and says why."""

from __future__ import annotations

import io
import re
import subprocess
import tokenize
from pathlib import Path

import pytest
from ruff.__main__ import find_ruff_bin

from test_standalone import repository_files

ROOT = Path(__file__).parents[1]
pytestmark = pytest.mark.lints  # starts ruff, in the fast tier


def test_ruff_passes() -> None:
    done = subprocess.run([find_ruff_bin(), "check", "--no-cache", "--output-format", "concise", str(ROOT)],
                          capture_output=True, text=True, cwd=ROOT)
    assert done.returncode == 0, done.stdout + done.stderr


def test_every_noqa_names_its_rule_and_says_why() -> None:
    found = {}
    for path in repository_files():  # pruned while walking: the venvs may be being built beside this test
        if path.suffix != ".py":
            continue
        tokens = tokenize.generate_tokens(io.StringIO(path.read_text(encoding="utf-8")).readline)
        for token in tokens:
            if token.type == tokenize.COMMENT and "noqa" in token.string:
                found[f"{path.relative_to(ROOT)}:{token.start[0]}"] = token.string
    unexplained = {where: comment for where, comment in found.items()
                   if not re.fullmatch(r"# noqa: [A-Z]+[0-9]+(, [A-Z]+[0-9]+)* +\(.+\)", comment)}
    assert found and not unexplained, unexplained
