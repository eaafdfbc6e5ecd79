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
# Installed without its pins (it pins transformers<5.3): setup.cfg's kvpress extra brings what it imports, and
# scripts/bootstrap.sh installs it with --no-deps, as the README says.
NO_DEPS = {"kvpress": "pip install --no-deps \"kvpress==0.5.5\""}


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
    missing = {normal(DISTRIBUTIONS.get(name, name)) for name in imported_packages()} - declared() - set(NO_DEPS)
    assert not missing, f"imported but not declared in setup.cfg: {sorted(missing)}"
    for name, install in NO_DEPS.items():  # and installed where the tests run
        assert install in (ROOT / "scripts" / "bootstrap.sh").read_text(), name


def packages_on_disk() -> set[str]:
    """Every folder of the code that holds a module, as the package name a wheel installs it under."""
    roots = {"alspec_eval": ROOT / "alspec_eval", "alspec_eval.kernels": ROOT / "kernels",
             "alspec_eval.tasks": ROOT / "tasks"}
    names = set()
    for name, root in roots.items():
        for module in root.rglob("*.py"):
            parts = module.parent.relative_to(root).parts
            names.add(".".join((name, *parts)))
    return names


def test_every_package_is_in_the_wheel():
    """setup.cfg lists its packages by name: one left out is missing from a wheel, and `pip install alspec-eval`
    (not editable) fails at `import alspec_eval` (approximations/ and approx_check/ were left out once)."""
    config = configparser.ConfigParser()
    config.read(ROOT / "setup.cfg")
    listed = set(config["options"]["packages"].split())
    missing = packages_on_disk() - listed
    assert not missing, f"folders with modules that setup.cfg's packages leave out of the wheel: {sorted(missing)}"
