"""``alspec-report OUTDIR [--latency FILE] [--preset NAME]``: write OUTDIR/report/ from a sweep's cells."""

from __future__ import annotations

import argparse
import sys
from typing import Sequence

from alspec_eval.report.build import write_report
from alspec_eval.report.latency import LatencyError, LatencySpec, load_latency
from alspec_eval.report.load import NoCellsError
from alspec_eval.report.presets import PRESETS


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="alspec-report", description="Table 1, figures and projected latency of a lambda sweep.")
    p.add_argument("outdir", help="the sweep's output folder (holds sweep.json and cells/<task>/<cell>.json)")
    p.add_argument("--latency", metavar="FILE", help="YAML or JSON with per-layer non_attention_us, attention_us, "
                   "speculative_us (numbers or per-layer lists), optional num_layers, miss_overhead_us, description")
    p.add_argument("--preset", metavar="NAME", help=f"built-in latency table: {', '.join(PRESETS)} "
                   "(illustrative estimates, not measured); default: all presets unless --latency is given")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    specs: list[LatencySpec] = []
    try:
        if args.preset is not None:
            if args.preset not in PRESETS:
                raise LatencyError(f"unknown preset {args.preset!r}; use one of {', '.join(PRESETS)} or --latency FILE")
            specs.append(PRESETS[args.preset])
        if args.latency is not None:
            specs.append(load_latency(args.latency))
        paths = write_report(args.outdir, specs or None)
    except (NoCellsError, ValueError) as e:  # bad cells or latency tables carry a one-line message with the fix
        print(f"alspec-report: {e}", file=sys.stderr)
        return 2
    print(f"alspec-report: wrote {len(paths)} files under {paths[-1].parent}; open {paths[-1]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
