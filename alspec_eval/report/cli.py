"""``alspec-report OUTDIR [--latency FILE] [--preset NAME] [--paper auto|table1|table2|none] [--lambda LAM]``: write
OUTDIR/report/ from a sweep's cells."""

from __future__ import annotations

import argparse
import sys
from typing import Sequence

from alspec_eval.cli_errors import bad_input
from alspec_eval.latency import DEFAULT_PRESET, PRESETS, LatencyModel, load_latency, preset


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="alspec-report", description="Table 1, figures and projected latency of a lambda sweep.",
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("outdir", help="the sweep's output folder (holds sweep.json and cells/<task>/<cell>.json)")
    p.add_argument("--latency", metavar="FILE", help="your measured latency table, YAML or JSON (as alspec-latency "
                   "--latency: num_layers, fixed_us, per_layer_us, fd_us, sfd_s_us, sfd_r_us)")
    p.add_argument("--preset", metavar="NAME", action="append", help=f"a table with the paper's numbers: "
                   f"{', '.join(PRESETS)} (repeatable; default {DEFAULT_PRESET} unless --latency is given)")
    p.add_argument("--paper", choices=("auto", "table1", "table2", "none"), default="auto",
                   help="set the cells beside the paper's Table 1 (Llama 3.1 8B) or Table 2 (70B); auto: the table "
                        "of the sweep's model, if it is one of them")
    p.add_argument("--lambda", dest="lam", type=float, metavar="LAM",
                   help="the lambda at which a sweep of several approximations (approx: [sink, quest, topk]) draws "
                        "each one's per-layer hit rate (default: the sweep's middle lambda)")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    from alspec_eval.report.build import write_report
    from alspec_eval.report.cells import NoCellsError

    specs: list[LatencyModel] = []
    try:
        specs += [preset(name) for name in args.preset or []]
        if args.latency is not None:
            specs.append(load_latency(args.latency))
        paths = write_report(args.outdir, specs or None, args.paper, args.lam)
    except (NoCellsError, ValueError) as e:  # bad cells or latency tables carry a one-line message with the fix
        return bad_input("alspec-report", e)
    print(f"alspec-report: wrote {len(paths)} files under {paths[-1].parent}; open {paths[-1]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
