"""Runs a sweep cell by cell; each finished cell is one JSON file, so a killed sweep resumes where it stopped."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

from ..config import ConfigError
from ..distributed import barrier, is_main_process
from ..shared_prefill import sweep_variants
from ..models import SMOLLM2_ALIAS, smollm2_path
from ..report_io import write_json_atomic
from ..stats import AcceptanceStats
from .config import SweepConfig, lambda_cell

CellHook = Callable[[Path], None]


def cell_path(out: Path, task: str, cell: str) -> Path:
    return out / "cells" / task / f"{cell}.json"


def resolved_model_args(config: SweepConfig) -> dict[str, Any]:
    args = dict(config.model_args)
    if args.get("pretrained", SMOLLM2_ALIAS) == SMOLLM2_ALIAS:
        args["pretrained"] = str(smollm2_path())
    return args


def build_lm(config: SweepConfig):  # noqa: ANN201 (ALSpecLM; imported late: it pulls in torch)
    from ..adapter import ALSpecLM

    return ALSpecLM(**resolved_model_args(config), window=config.window, window_align=config.window_align,
                    device=config.device, batch_size=config.batch_size, **{"lambda": config.lambdas[0]})


def primary_metric(task: str, metrics: dict[str, Any], chosen: dict[str, str]) -> str | None:
    """The metric a Table 1 cell shows: the configured one, else the task's first reported metric."""
    if task in chosen:
        if chosen[task] not in metrics:
            raise ConfigError(f"metrics: {task} reports no {chosen[task]!r}; it reports {sorted(metrics)}")
        return chosen[task]
    return next((k for k in metrics if "," in k and "_stderr" not in k), None)  # lm-eval keys are "metric,filter"


def evaluate_cell(lm, config: SweepConfig, task: str, cell: str, extra: dict[str, Any]) -> dict[str, Any] | None:
    """One lm-eval evaluation of ``task`` with the model's current speculation settings (None on a data-parallel
    rank other than the main one)."""
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    lm.reset_statistics()
    started = time.perf_counter()
    metadata = {**resolved_model_args(config), **config.metadata}
    results = simple_evaluate(
        model=lm, tasks=[task], limit=config.limit, num_fewshot=config.num_fewshot,
        apply_chat_template=config.apply_chat_template, gen_kwargs=config.gen_kwargs, log_samples=True,
        task_manager=TaskManager(metadata=metadata), random_seed=config.seed, numpy_random_seed=config.seed,
        torch_random_seed=config.seed, fewshot_random_seed=config.seed, bootstrap_iters=0)
    if results is None:  # a data-parallel rank other than the main one: the main one writes the cell
        return None
    numeric = {name: {k: v for k, v in m.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
               for name, m in results["results"].items()}
    metric = primary_metric(task, numeric.get(task, {}), config.metrics)
    total = sum(lm.task_stats.values(), AcceptanceStats.zeros(lm.speculator.num_layers))
    document = lm.statistics()
    del document["tasks"]
    document.update(total.to_dict(lm.speculator.skipped_layers))
    samples = [
        {"task": name, "doc_id": s["doc_id"], "doc": _scalars(s["doc"]),
         **{k: s[k] for k in s.get("metrics", []) if k in s},
         "alspec": [args[-1]["alspec"] for args in s["arguments"] if isinstance(args[-1], dict)],
         "response": s["filtered_resps"]}
        for name, task_samples in sorted(results.get("samples", {}).items())
        for s in sorted(task_samples, key=lambda s: s["doc_id"])]  # in document order, however ranks split them
    return {"task": task, "cell": cell, **extra, "metric": metric,
            "score": numeric.get(task, {}).get(metric) if metric else None,
            "metrics": numeric.get(task, {}), "subtasks": {k: v for k, v in numeric.items() if k != task},
            "alspec": document, "samples": len(samples), "sample_log": samples,
            "elapsed_s": round(time.perf_counter() - started, 3)}


def _scalars(doc: dict[str, Any]) -> dict[str, Any]:
    """A document's short scalar fields (e.g. a needle run's length and depth), to group samples by."""
    return {k: v for k, v in doc.items()
            if isinstance(v, (int, float, bool)) or (isinstance(v, str) and len(v) <= 64)}


def check_tasks(tasks: list[str]) -> None:
    """Unknown task names fail here, before the model loads, with the closest known name."""
    import difflib

    from lm_eval.tasks import TaskManager

    known = TaskManager().all_tasks
    for task in tasks:
        if task not in known:
            close = difflib.get_close_matches(task, known, n=1)
            hint = f"did you mean {close[0]!r}?" if close else "see `lm_eval ls tasks` for the known names"
            raise ConfigError(f"tasks: {task!r} is not an lm-eval task or group; {hint}")


def static_layers(out: Path, task: str, config: SweepConfig) -> list[int]:
    """Layers whose acceptance in the dynamic cell at static.lambda reaches static.p (the paper's Figure 2)."""
    assert config.static is not None
    dynamic = json.loads(cell_path(out, task, lambda_cell(config.static.lam)).read_text())
    return [layer["layer"] for layer in dynamic["alspec"]["layers"]
            if layer["hit_rate"] is not None and layer["hit_rate"] >= config.static.p]


def _cell_settings(name: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """Speculation settings for a shared-group cell, and what its JSON records about them."""
    if name == "baseline":
        return {"policy": "exact"}, {"policy": "exact", "lambda": None, "static_layers": None}
    if name == "sink":
        return {"policy": "sink"}, {"policy": "sink", "lambda": "inf", "static_layers": None}
    lam = float(name.removeprefix("lambda_"))
    return {"policy": "dynamic", "lam": lam}, {"policy": "dynamic", "lambda": lam, "static_layers": None}


def run_sweep(config: SweepConfig, on_cell: CellHook | None = None, lm: Any = None) -> Path:
    """Run every missing cell of ``config``; returns the output folder. ``on_cell`` sees each written file."""
    out = config.output_dir
    cells = config.cell_names()
    missing = [(t, c) for t in config.tasks for c in cells if not cell_path(out, t, c).exists()]
    barrier()  # every rank has read which cells exist before the main one writes any
    if is_main_process():
        write_json_atomic(out / "sweep.json", {**asdict(config), "static_p": config.static.p if config.static else None,
                                               "cells": cells})
    if not missing:
        return out
    check_tasks(config.tasks)
    lm = lm or build_lm(config)
    progress = tqdm(total=len(config.tasks) * len(cells), initial=len(config.tasks) * len(cells) - len(missing),
                    desc=f"sweep {config.name}", unit="cell")

    def write(task: str, cell: str, extra: dict[str, Any]) -> None:
        progress.set_postfix_str(f"{task}: {cell}, {lm.decode_tokens} tokens so far")
        result = evaluate_cell(lm, config, task, cell, extra)
        path = cell_path(out, task, cell)
        if result is not None:
            write_json_atomic(path, result)
        barrier()  # the cell is on disk for every rank (static calibration reads it)
        progress.set_postfix_str(f"{task}: {cell}, {lm.decode_tokens} tokens so far")
        progress.update()
        if on_cell and result is not None:
            on_cell(path)

    for task in config.tasks:
        todo = [c for c in cells if (task, c) in missing]
        group = [c for c in todo if c != "static"]
        if group and config.shared_prefill:
            variants = sweep_variants(config.lambdas, baseline=config.baseline, sink=config.sink)
            lm.reconfigure(policy="dynamic", static_layers=())
            with lm.shared_prefill(variants) as fork:
                for index, variant in enumerate(variants):
                    if variant.name in group:
                        fork.replay = index
                        write(task, variant.name, _cell_settings(variant.name)[1])
        else:
            for name in group:
                settings, extra = _cell_settings(name)
                lm.reconfigure(static_layers=(), **settings)
                write(task, name, extra)
        if "static" in todo:
            layers = static_layers(out, task, config)
            # No layer reaching p leaves nothing to approximate: the exact model is that policy.
            lm.reconfigure(policy="static" if layers else "exact", static_layers=tuple(layers))
            write(task, "static", {"policy": "static", "lambda": None, "static_layers": layers,
                                   "calibration": {"p": config.static.p, "lambda": config.static.lam}})
    progress.close()
    return out
