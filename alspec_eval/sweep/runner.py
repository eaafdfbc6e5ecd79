"""Runs a sweep cell by cell; each finished cell is one JSON file, so a killed sweep resumes where it stopped."""

from __future__ import annotations

import fcntl
import json
import logging
import os
import subprocess
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tqdm.auto import tqdm

from ..config import ConfigError
from ..distributed import barrier, is_main_process
from ..smollm2 import SMOLLM2_ALIAS, smollm2_path
from ..provenance import provenance
from ..atomic_json import write_json_atomic
from ..stats import AcceptanceStats
from .._lmeval_hook import tasks_dir
from ..rows import Row, prefill_groups
from ..ruler import check_buildable, per_length, preload, split_unit, unit_metadata, unit_metric
from ..compat import custom_datasets_built_once, environment_described_once, with_metadata
from .config import SweepConfig, fingerprint

if TYPE_CHECKING:  # lm-eval's import is slow and sets environment variables: only where a sweep runs
    from lm_eval.tasks import TaskManager

CellHook = Callable[[Path], None]
# lm-eval's own stderr of each score (closed form for means; a bootstrap of this size for other aggregations).
BOOTSTRAP_ITERS = 1000


LOG = "lm_eval.log"  # lm-eval's own logging of a sweep's cells, in its output folder


def cell_path(out: Path, task: str, row: Row) -> Path:
    return row.cell_file(out / "cells" / task)  # under its name, or a legacy one that exists (Row.legacy_names)


def resolved_model_args(config: SweepConfig) -> dict[str, Any]:
    args = dict(config.model_args)
    if args.get("pretrained", SMOLLM2_ALIAS) == SMOLLM2_ALIAS:
        args["pretrained"] = str(smollm2_path())
    return args


def build_lm(config: SweepConfig):
    args = resolved_model_args(config)
    if config.engine == "vllm":  # one engine for every cell: each cell's settings reach every worker (reconfigure)
        from ..vllm.model import ALSpecVLLM

        return ALSpecVLLM(**args, window=config.windows[0], window_align=config.window_align)
    from ..adapter import ALSpecLM

    if config.gammas:  # selfspec rows: refuse a model they cannot run before its weights load
        from transformers import AutoConfig

        from ..selfspec import check_model

        check_model(AutoConfig.from_pretrained(args["pretrained"], trust_remote_code=args.get("trust_remote_code") in (True, "true", "True")))
    return ALSpecLM(**args, window=config.windows[0], window_align=config.window_align, device=config.device,
                    batch_size=config.batch_size)


def primary_metric(task: str, metrics: dict[str, Any], chosen: dict[str, str]) -> str | None:
    """The metric a Table 1 cell shows: the configured one, else a RULER unit's length's, else the task's first
    reported metric."""
    wanted = chosen.get(task) or chosen.get(split_unit(task)[0]) or unit_metric(task)
    if wanted:
        if wanted not in metrics:
            raise ConfigError(f"metrics: {task} reports no {wanted!r}; it reports {sorted(metrics)}")
        return wanted
    return next((k for k in metrics if "," in k and "_stderr" not in k), None)  # lm-eval keys are "metric,filter"


def task_metadata(config: SweepConfig) -> dict[str, Any]:
    """What every task of the sweep is given as ``metadata`` (templated tasks such as the needle's read it): the
    model's arguments, then the config's ``metadata``, as ``lm_eval --model_args ... --metadata ...`` gives it."""
    return {**resolved_model_args(config), **config.metadata}


def task_manager(config: SweepConfig) -> TaskManager:
    """lm-eval's task index (its own tasks and the bundled ones) with ``config``'s metadata: built once per sweep,
    needle run or tune and shared by their cells, since indexing lm-eval's ~15,000 task files takes 10-12 s on a
    2-core CPU. Each cell still loads its task afresh from the index, as lm-eval does for each run."""
    from lm_eval.tasks import TaskManager

    return TaskManager(include_path=str(tasks_dir()), metadata=task_metadata(config))


def evaluate_cell(lm, config: SweepConfig, task: str, row: Row, extra: dict[str, Any],
                  tasks: TaskManager) -> dict[str, Any] | None:
    """One lm-eval evaluation of ``task`` as ``row`` (inside ``lm.answering(row)``: the model's config is the row's
    own, and the cell records it) through the sweep's task index ``tasks``; ``extra`` is what the cell file records
    about the row. None on a data-parallel rank other than the main one."""
    from lm_eval import simple_evaluate

    lm.reset_statistics()
    started = time.perf_counter()
    name = split_unit(task)[0]
    if name != task:  # a RULER unit: its task built at its length only
        tasks = with_metadata(tasks, unit_metadata(task, tasks.metadata))
    results = simple_evaluate(
        model=lm, tasks=[name], limit=config.limit, num_fewshot=config.num_fewshot,
        samples={name: config.samples[task]} if config.samples is not None else None,
        apply_chat_template=config.apply_chat_template, gen_kwargs=config.gen_kwargs, log_samples=True,
        task_manager=tasks, random_seed=config.seed, numpy_random_seed=config.seed,
        torch_random_seed=config.seed, fewshot_random_seed=config.seed, bootstrap_iters=BOOTSTRAP_ITERS)
    if results is None:  # a data-parallel rank other than the main one: the main one writes the cell
        return None
    numeric = {name: {k: v for k, v in m.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
               for name, m in results["results"].items()}
    numeric = {task if k == name else k: v for k, v in numeric.items()}
    metric = primary_metric(task, numeric.get(task, {}), config.metrics)
    total = sum(lm.task_stats.values(), AcceptanceStats.zeros(lm.num_layers))
    document = lm.statistics()
    del document["tasks"]
    document.update(total.to_dict(lm.skipped_layers))
    decisions = _per_document(lm.sample_stats)
    samples = [
        {"task": task if sub == name else sub, "doc_id": s["doc_id"], "filter": s.get("filter"),
         "doc": _scalars(s["doc"]), **{k: s[k] for k in s.get("metrics", []) if k in s},
         "alspec": decisions.get((sub, s["doc_id"]), []), "response": s["filtered_resps"]}
        for sub, task_samples in sorted(results.get("samples", {}).items())
        for s in sorted(task_samples, key=lambda s: s["doc_id"])]  # in document order, however ranks split them
    return {"task": task, "cell": row.name, **extra, "engine": config.engine, "fingerprint": fingerprint(config, task, row),
            "provenance": provenance(resolved_model_args(config)), "metric": metric,
            "score": numeric.get(task, {}).get(metric) if metric else None,
            "metrics": numeric.get(task, {}), "subtasks": {k: v for k, v in numeric.items() if k != task},
            "alspec": document, "samples": len(samples), "sample_log": samples,
            "elapsed_s": round(time.perf_counter() - started, 3)}


def _per_document(sample_stats: dict[tuple[str, int, int, int], dict[str, Any]]) -> dict[tuple[str, int], list]:
    """The adapter's per-request statistics by (task, doc_id): one entry per request of the document, in request
    order (of a repeated request, its last repeat's)."""
    by_request = {(task, doc, idx): entry for (task, doc, idx, _), entry in sorted(sample_stats.items())}
    out: dict[tuple[str, int], list] = {}
    for (task, doc, _), entry in sorted(by_request.items()):
        out.setdefault((task, doc), []).append(entry)
    return out


def _scalars(doc: dict[str, Any]) -> dict[str, Any]:
    """A document's short scalar fields (e.g. a needle run's length and depth), to group samples by."""
    return {k: v for k, v in doc.items()
            if isinstance(v, (int, float, bool)) or (isinstance(v, str) and len(v) <= 64)}


def check_tasks(names: list[str], tasks: TaskManager) -> None:
    """Unknown task names fail here, before the model loads, with the closest known name."""
    import difflib

    known = tasks.all_tasks
    for task in dict.fromkeys(split_unit(name)[0] for name in names):
        if task not in known:
            close = difflib.get_close_matches(task, known, n=1)
            hint = f"did you mean {close[0]!r}?" if close else "see `lm_eval ls tasks` for the known names"
            raise ConfigError(f"tasks: {task!r} is not an lm-eval task or group; {hint}")


def static_layers(out: Path, task: str, config: SweepConfig, row: Row) -> list[int]:
    """Layers whose acceptance in the dynamic cell at static.lambda (of the row's approximation) reaches static.p
    (the paper's Figure 2)."""
    assert config.static is not None
    dynamic = json.loads(cell_path(out, task, row.calibration(config.static.lam)).read_text())
    return [layer["layer"] for layer in dynamic["alspec"]["layers"]
            if layer["hit_rate"] is not None and layer["hit_rate"] >= config.static.p]


def existing_cells(config: SweepConfig, recompute: bool) -> list[tuple[str, Row]]:
    """The (task, row) pairs to compute. A cell file is reused only when its fingerprint equals this config's; a
    stale or unreadable one is recomputed with ``recompute``, else refused in one line."""
    out, missing, stale = config.output_dir, [], []
    for task in config.tasks:
        for row in config.rows():
            path = cell_path(out, task, row)
            if not path.exists():
                missing.append((task, row))
                continue
            try:
                found = json.loads(path.read_text()).get("fingerprint")
            except (OSError, ValueError, AttributeError):
                found = "unreadable"
            if not row.same_cell(found, fingerprint(config, task, row)):
                stale.append((path, "unreadable (truncated?)" if found == "unreadable" else "made with other settings"))
                missing.append((task, row))
    if stale and not recompute:
        path, why = stale[0]
        raise ConfigError(f"{path} is {why}{f' (and {len(stale) - 1} more cells)' if len(stale) > 1 else ''}; rerun "
                          "with --recompute to compute them again, or choose another --output_path")
    return missing


def check_writable(out: Path, tasks: list[str]) -> None:
    """The output folders exist or can be made, and can be written: checked before the model loads, creating
    nothing (the nearest existing folder of each must be a writable folder)."""
    for folder in (out, *(out / "cells" / t for t in tasks)):
        existing = next(p for p in (folder, *folder.parents) if p.exists())
        if not existing.is_dir():
            raise ConfigError(f"output {folder}: {existing} is a file, not a folder; choose another --output_path")
        if not os.access(existing, os.W_OK | os.X_OK):
            raise ConfigError(f"output folder {existing} is not writable; fix its permissions or choose another "
                              "--output_path")


@contextmanager
def output_lock(out: Path) -> Iterator[None]:
    """One sweep per output folder at a time: a second one refuses instead of computing every cell twice."""
    if not is_main_process():
        yield
        return
    with open(out / ".alspec-sweep.lock", "w") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise ConfigError(f"another alspec-sweep is writing {out}; wait for it to finish or choose another "
                              "--output_path") from None
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def run_sweep(config: SweepConfig, on_cell: CellHook | None = None, lm: Any = None, recompute: bool = False,
              tasks: TaskManager | None = None) -> Path:
    """Run every missing (or, with ``recompute``, stale) cell of ``config``; returns the output folder.
    ``on_cell`` sees each written file. ``tasks`` is a task index to share with other sweeps of the same model and
    metadata (a tune's); without it the sweep builds its own, once. Everything that can be checked is checked
    before the model loads."""
    if tasks is not None and tasks.metadata != task_metadata(config):
        raise ValueError(f"the task index was built with metadata {tasks.metadata}, not this sweep's "
                         f"{task_metadata(config)}; build it with task_manager(config)")
    out = config.output_dir
    check_writable(out, config.tasks)
    check_buildable(config.tasks)
    if is_main_process():
        out.mkdir(parents=True, exist_ok=True)  # for the lock file
    barrier()
    with output_lock(out):
        return _run_cells(config, on_cell, lm, recompute, tasks)


def _run_cells(config: SweepConfig, on_cell: CellHook | None, lm: Any, recompute: bool,
               tasks: TaskManager | None) -> Path:
    out = config.output_dir
    rows = config.rows()
    missing = existing_cells(config, recompute)
    barrier()  # every rank has read which cells exist before the main one writes any
    if is_main_process():
        write_json_atomic(out / "sweep.json", {**config.to_dict(), "static_p": config.static.p if config.static else None,
                                               "cells": [row.name for row in rows]})
    if not missing:
        return out
    tasks = tasks or task_manager(config)
    check_tasks(config.tasks, tasks)
    lm = lm or build_lm(config)
    progress = tqdm(total=len(config.tasks) * len(rows), initial=len(config.tasks) * len(rows) - len(missing),
                    desc=f"sweep {config.name}", unit="cell")
    preload(config.tasks, out / LOG)
    with lm_eval_logged_to(out / LOG), custom_datasets_built_once(out / LOG, per_length), environment_described_once():
        _run_missing(config, on_cell, lm, tasks, rows, missing, progress)
    progress.close()
    return out


def _run_missing(config: SweepConfig, on_cell: CellHook | None, lm: Any, tasks: TaskManager, rows: list[Row],
                 missing: list[tuple[str, Row]], progress: Any) -> None:
    out = config.output_dir

    def write(task: str, row: Row, extra: dict[str, Any]) -> None:
        progress.set_postfix_str(f"{task}: {row.name}, {lm.decode_tokens} tokens so far")
        result = evaluate_cell(lm, config, task, row, extra, tasks)
        path = cell_path(out, task, row)
        if result is not None:
            write_json_atomic(path, result)
        barrier()  # the cell is on disk for every rank (static calibration reads it)
        progress.set_postfix_str(f"{task}: {row.name}, {lm.decode_tokens} tokens so far")
        progress.update()
        if on_cell and result is not None:
            on_cell(path)

    for task in config.tasks:
        todo = [row for row in rows if (task, row) in missing]
        for variants in prefill_groups(rows):
            group = [row for row in variants if row in todo]
            if group and config.shared_prefill:
                with lm.shared_prefill(variants) as shared:
                    for row in group:
                        with lm.answering(row, shared=shared):
                            write(task, row, row.record())
            else:
                for row in group:
                    with lm.answering(row):
                        write(task, row, row.record())
        for row in (row for row in todo if row.calibrated):
            layers = static_layers(out, task, config, row)
            with lm.answering(row, tuple(layers)):
                write(task, row, {**row.record(layers),
                                  "calibration": {"p": config.static.p, "lambda": config.static.lam}})


@contextmanager
def lm_eval_logged_to(log: Path) -> Iterator[None]:
    """lm-eval's logging inside the block goes to ``log`` (appended), not to the console: it repeats per cell what
    is said once (a task's custom dataset warning, for one), through the progress bar. lm-eval's git commit hash of
    the working folder is read once, with git's complaint outside a checkout kept off the console too."""
    import lm_eval.evaluator

    logger = logging.getLogger("lm_eval")
    handler = logging.FileHandler(log, encoding="utf-8")
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    saved = logger.handlers[:], logger.propagate, lm_eval.evaluator.get_git_commit_hash
    git_hash = _git_hash()
    logger.handlers, logger.propagate = [handler], False
    lm_eval.evaluator.get_git_commit_hash = lambda: git_hash
    try:
        yield
    finally:
        logger.handlers, logger.propagate, lm_eval.evaluator.get_git_commit_hash = saved
        handler.close()


def _git_hash() -> str | None:
    """What lm-eval records as ``git_hash``: ``git describe --always`` of the working folder, else None."""
    try:
        done = subprocess.run(["git", "describe", "--always"], capture_output=True, text=True, check=False)
    except FileNotFoundError:  # no git
        return None
    return (done.stdout.strip() or None) if done.returncode == 0 else None
