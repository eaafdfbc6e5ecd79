"""Every package the code imports is declared in setup.cfg (install_requires, or an extra for optional backends)."""

from __future__ import annotations

import ast
import configparser
import re
import sys
from pathlib import Path

ROOT = Path(__file__).parents[1]
# Import names whose distribution is named otherwise.
DISTRIBUTIONS = {"yaml": "pyyaml", "ttl": "tt-lang-sim"}


def imported_packages() -> set[str]:
    names = set()
    for path in [*(ROOT / "alspec_eval").rglob("*.py"), *(ROOT / "kernels").rglob("*.py"), *(ROOT / "tasks").rglob("*.py")]:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names |= {alias.name.split(".")[0] for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names.add(node.module.split(".")[0])
    return names - set(sys.stdlib_module_names) - {"alspec_eval", "kernels", "__future__"}


def declared() -> set[str]:
    config = configparser.ConfigParser()
    config.read(ROOT / "setup.cfg")
    options = config["options"]
    lines = options["install_requires"].split("\n") + [
        line for extra in config["options.extras_require"].values() for line in extra.split("\n")]
    return {normal(re.split(r"[<>=!\[; ]", line.strip())[0]) for line in lines if line.strip()}


def normal(name: str) -> str:
    """Distribution names compare as pip compares them (PEP 503)."""
    return re.sub(r"[-_.]+", "-", name).lower()


def test_every_imported_package_is_declared():
    missing = {normal(DISTRIBUTIONS.get(name, name)) for name in imported_packages()} - declared()
    assert not missing, f"imported but not declared in setup.cfg: {sorted(missing)}"
