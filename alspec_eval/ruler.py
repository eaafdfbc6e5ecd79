"""Tasks whose metrics are per context length (lm-eval's RULER): a sweep runs each (task, length) as a unit of its
own, named ``task@length``, so that cells, paired differences, hit rates and densities never mix lengths.

A RULER task reports one metric per length (``4096,none``, ``8192,none``) and builds its documents from the model's
tokenizer at the lengths of ``metadata.max_seq_lengths``. A unit runs one length (``max_seq_lengths: [L]``): its
documents are those of ``lm_eval --metadata '{"max_seq_lengths": [L]}'``, its metric ``L,none``. Seven of RULER's
thirteen tasks download data while they build; they are refused before anything loads when the machine is offline.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import socket
from pathlib import Path
from typing import Any

import yaml

from .config import ConfigError

DEFAULT_LENGTHS = [4096]  # lm-eval's RULER default (its common_utils.DEFAULT_SEQ_LENGTHS)
GROUP = "ruler"
ESSAYS = "Paul Graham's essays (the hub dataset baber/paul_graham_essays)"
# What the other tasks download while they build (lm-eval 0.4.13's tasks/ruler: the essay haystacks and the QA sets).
DOWNLOADS = {
    "niah_single_2": ESSAYS, "niah_single_3": ESSAYS, "niah_multikey_1": ESSAYS, "niah_multiquery": ESSAYS,
    "niah_multivalue": ESSAYS,
    "ruler_qa_squad": "SQuAD v2 (rajpurkar.github.io)",
    "ruler_qa_hotpot": "HotpotQA (huggingface.co)",
}
EXTRAS = ("wonderwords", "nltk")  # what RULER's builders import: alspec-eval[ruler]


class _Tags(yaml.SafeLoader):
    """lm-eval's task YAML with its ``!function`` tags read as plain strings."""


_Tags.add_multi_constructor("!", lambda loader, suffix, node: None)


@functools.cache
def _ruler_configs() -> dict[str, dict[str, Any]]:
    """lm-eval's RULER task and group files by name, read as YAML without importing lm-eval."""
    spec = importlib.util.find_spec("lm_eval")
    if spec is None or not spec.submodule_search_locations:
        return {}
    folder = Path(next(iter(spec.submodule_search_locations))) / "tasks" / "ruler"
    def read(path: Path) -> dict[str, Any]:  # with the files it includes, as lm-eval reads it
        config = yaml.load(path.read_text(), Loader=_Tags) or {}
        included = config.pop("include", None)
        return {**read(path.parent / included), **config} if included else config

    configs = {}
    for path in sorted(folder.glob("*.yaml")):
        config = read(path)
        name = config.get("task") if isinstance(config.get("task"), str) else config.get("group")
        if name:
            configs[name] = config
    return configs


def per_length(task: str) -> bool:
    """A task whose metrics are named by context lengths ("4096", "8192", ...)."""
    metrics = _ruler_configs().get(task, {}).get("metric_list") or []
    return bool(metrics) and all(str(m.get("metric", "")).isdigit() for m in metrics)


def offline_tasks() -> list[str]:
    """RULER's tasks that build without a download."""
    return [t for t in _ruler_configs().get(GROUP, {}).get("task", []) if per_length(t) and t not in DOWNLOADS]


def units(tasks: list[str], metadata: dict[str, Any]) -> list[str]:
    """The sweep's tasks with the RULER group expanded into its tasks and each per-length task split into a unit
    per length of ``metadata.max_seq_lengths`` (lm-eval's default [4096] without it)."""
    lengths = metadata.get("max_seq_lengths", DEFAULT_LENGTHS)
    if not isinstance(lengths, list) or not lengths or not all(
            isinstance(n, int) and not isinstance(n, bool) and n > 0 for n in lengths):
        raise ConfigError(f"metadata: max_seq_lengths={lengths!r} must be a list of context lengths in tokens, "
                          "e.g. max_seq_lengths: [4096, 8192]")
    out: list[str] = []
    for task in tasks:
        members = _ruler_configs()[GROUP]["task"] if task == GROUP and GROUP in _ruler_configs() else [task]
        for member in members:
            out += [f"{member}@{n}" for n in sorted(set(lengths))] if per_length(member) else [member]
    return list(dict.fromkeys(out))


def split_unit(unit: str) -> tuple[str, int | None]:
    """(task, length) of a unit ``task@length``; (task, None) for a task of one figure."""
    task, at, length = unit.rpartition("@")
    return (task, int(length)) if at and length.isdigit() else (unit, None)


def unit_metadata(unit: str, metadata: dict[str, Any]) -> dict[str, Any]:
    """The metadata a unit's task is built with: its own length only."""
    length = split_unit(unit)[1]
    return metadata if length is None else {**metadata, "max_seq_lengths": [length]}


def unit_metric(unit: str) -> str | None:
    """The metric a unit's cells show: its length's (``4096,none``); None for a task of one figure."""
    length = split_unit(unit)[1]
    return None if length is None else f"{length},none"


def check_buildable(units_: list[str]) -> None:
    """Refuse, before anything loads, a RULER task that downloads while the machine is offline, and RULER without
    the packages its builders import."""
    tasks = list(dict.fromkeys(split_unit(u)[0] for u in units_))
    ruler = [t for t in tasks if per_length(t)]
    missing = [name for name in EXTRAS if ruler and importlib.util.find_spec(name) is None]
    if missing:
        raise ConfigError(f"tasks: {ruler[0]} builds its documents with {' and '.join(missing)}, which are not "
                          "installed; pip install 'alspec-eval[ruler]'")
    hub = [t for t in tasks if t in DOWNLOADS]
    if hub and offline():
        remaining = ", ".join(offline_tasks())
        raise ConfigError(f"tasks: {hub[0]} downloads {DOWNLOADS[hub[0]]} while it builds, and this machine is "
                          f"offline; the RULER tasks that build offline are {remaining}")


def preload(units_: list[str], log: Path) -> None:
    """Import RULER's builders once with their console output sent to ``log``: at import they try to download nltk's
    ``punkt_tab`` (which only the essay haystacks use) and print the failure offline."""
    if not any(per_length(split_unit(u)[0]) for u in units_):
        return
    from contextlib import redirect_stderr, redirect_stdout

    with open(log, "a", encoding="utf-8") as out, redirect_stdout(out), redirect_stderr(out):
        importlib.import_module("lm_eval.tasks.ruler.prepare_niah")


def offline() -> bool:
    """Hugging Face's offline switches, else whether huggingface.co can be reached (one connection, 3 s)."""
    if any(os.environ.get(name, "").lower() in ("1", "true", "yes", "on")
           for name in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")):
        return True
    try:
        socket.create_connection(("huggingface.co", 443), timeout=3).close()
    except OSError:
        return True
    return False
