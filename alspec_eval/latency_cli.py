"""``alspec-latency``: projected decode speed under ALSpec, from the paper's latency model (Appendix F).

    alspec-latency --preset h100-tp4-128k --hit-rate 0.65 [--json]
    alspec-latency --preset n150-tp1 --from results/demo        (measured per-layer hit rates of every cell;
                                                                 selfspec cells from their tau, as in the report)
    alspec-latency --latency my_table.yaml --hit-rate 0.9       (your own measured table)
    alspec-latency --list-presets
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any, Sequence

from .cli_errors import bad_input


class _Formatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """The usage examples as written, and every option's default."""


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="alspec-latency", description=__doc__, formatter_class=_Formatter)
    p.add_argument("--preset", metavar="NAME", help="a latency table with the paper's numbers (--list-presets)")
    p.add_argument("--latency", metavar="FILE", help="your own table, YAML or JSON: num_layers, fixed_us, "
                   "per_layer_us, fd_us, sfd_s_us, sfd_r_us (microseconds per token), optional round_hits")
    p.add_argument("--hit-rate", type=float, metavar="R", help="one hit rate in [0, 1] for every layer")
    p.add_argument("--from", dest="sweep", metavar="SWEEP_OUTDIR",
                   help="a sweep's output folder: every cell's measured per-layer hit rates")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    p.add_argument("--list-presets", action="store_true", help="list the presets with their sources and exit")
    return p


def _presets_text() -> str:
    from .latency import PRESETS

    lines = []
    for m in PRESETS.values():
        lines.append(f"{m.name}: {m.description}")
        lines.append(f"    K = {m.context_tokens} tokens (the context of fd_us)")
        for k, src in m.sources.items():
            lines.append(f"    {k} = {getattr(m, k):.6g}  [{src}]")
        if m.attention_points:
            points = ", ".join(f"{k}: {t:g}" for k, t in m.attention_points)
            lines.append(f"    attention us by context (selfspec's draft at 2S keys is read off these) = {points}")
    return "\n".join(lines)


def _sweep_rows(model: Any, outdir: str) -> list[dict[str, Any]]:
    """One projection per (task, measured cell) of a sweep: the report's own (``alspec_eval.report.latency``), so
    a cell projects the same here and there (self-speculation cells from their tau)."""
    from .report.cells import load_sweep
    from .report.latency import project_sweep

    p = project_sweep(load_sweep(outdir), model)
    rows = []
    for task in p.tasks:
        for row in p.rows:
            if (row, task) in p.entries:
                ss = p.selfspec.get((row, task))
                entry = p.entries[(row, task)].to_dict()
                if ss is not None:  # token-level: no hit rate, tau instead
                    entry = {**entry, "hit_rate": None, "tau": ss.tau, "gamma": ss.gamma, "cost_ratio": ss.cost_ratio}
                rows.append({"task": task, "cell": row.label, **entry, "layers_averaged": p.averaged and ss is None})
    return rows


def _table(rows: list[dict[str, Any]], model: Any) -> str:
    head = f"{model.name}: {model.description}"
    if model.estimates:
        head += f"\nESTIMATES (not measured in the paper): {', '.join(model.estimates)}; see --list-presets"
    cols = [("task", "task"), ("cell", "cell"), ("hit_rate", "hit rate"), ("tau", "τ"),
            ("baseline_tokens_per_s", "full TP tok/s"), ("tokens_per_s", "tok/s"), ("speedup", "speedup"),
            ("token_latency_us", "token us")]
    cols = [c for c in cols if any(c[0] in r for r in rows)]
    cells = [[f"{r[k]:.4g}" if isinstance(r.get(k), float) else "–" if r.get(k) is None else str(r[k])
              for k, _ in cols] for r in rows]
    widths = [max(len(h), *(len(c[i]) for c in cells)) for i, (_, h) in enumerate(cols)]
    lines = ["  ".join(h.ljust(w) for (_, h), w in zip(cols, widths))]
    lines += ["  ".join(c.ljust(w) for c, w in zip(cell, widths)) for cell in cells]
    refs = "".join(f"\n{name}: {rate} tok/s" for name, rate in model.reference_tokens_per_s.items())
    return f"{head}\n{chr(10).join(lines)}{refs}"


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if not any(vars(args).values()):
        parser.error("give a latency table (--preset NAME or --latency FILE) and --hit-rate R or --from SWEEP_OUTDIR, "
                     "or --list-presets")
    if args.list_presets:
        print(_presets_text())
        return 0
    from .latency import LatencyError, load_latency, preset, project

    try:
        if (args.preset is None) == (args.latency is None):
            raise LatencyError("give one latency table: --preset NAME (see --list-presets) or --latency FILE")
        if (args.hit_rate is None) == (args.sweep is None):
            raise LatencyError("give --hit-rate R (one rate for every layer) or --from SWEEP_OUTDIR (measured rates)")
        model = preset(args.preset) if args.preset is not None else load_latency(args.latency)
        if args.hit_rate is not None:
            rows = [project(model, args.hit_rate).to_dict()]
        else:
            rows = _sweep_rows(model, args.sweep)
    except (LatencyError, FileNotFoundError, ValueError) as err:
        return bad_input("alspec-latency", err)
    if args.json:
        out: Any = rows[0] if args.hit_rate is not None else {"preset": model.name, "cells": rows}
        if args.hit_rate is not None:
            out["reference_tokens_per_s"] = model.reference_tokens_per_s
        print(json.dumps(out, indent=2))
    else:
        print(_table(rows, model))
    return 0


if __name__ == "__main__":
    sys.exit(main())
