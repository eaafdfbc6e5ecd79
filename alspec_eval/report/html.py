"""One self-contained HTML page: tables inline, figures embedded as base64 PNG data URIs."""

from __future__ import annotations

import base64
import html
from pathlib import Path
from typing import TYPE_CHECKING, Sequence

if TYPE_CHECKING:
    import pandas as pd

from alspec_eval.report.latency import SweepProjection, projection_note, projection_rows
from alspec_eval.report.cells import Sweep
from alspec_eval.report.frames import ROUTINES
from alspec_eval.report.density import NOTE as DENSITY_NOTE, TITLE as DENSITY_TITLE
from alspec_eval.report.density import Pairing, density_notes, density_rows
from alspec_eval.report.gains import NOTE as GAINS_NOTE, TITLE as GAINS_TITLE, Gain, gains_notes, gains_rows
from alspec_eval.report.paper import NOTE, PaperSection
from alspec_eval.report.table import approximation_notes, beyond_sink, table1_rows

_STYLE = """
body { font-family: system-ui, sans-serif; max-width: 1100px; margin: 2em auto; color: #222; }
table { border-collapse: collapse; margin: 1em 0; font-size: 14px; }
th, td { border: 1px solid #ccc; padding: 4px 10px; text-align: right; }
th:first-child, td:first-child { text-align: left; }
thead th { background: #f2f2f2; }
img { max-width: 100%; margin: 0.5em 0; }
.note { color: #555; font-size: 13px; }
"""


def html_table(rows: list[list[str]]) -> str:
    head = "".join(f"<th>{html.escape(c)}</th>" for c in rows[0])
    body = "".join("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in r) + "</tr>" for r in rows[1:])
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def _image(path: Path) -> str:
    data = base64.b64encode(path.read_bytes()).decode("ascii")
    return f'<img alt="{html.escape(path.stem)}" src="data:image/png;base64,{data}">'


def _projection(p: SweepProjection) -> str:
    return (f"<h3>{html.escape(p.spec.name)}</h3><p class='note'>{html.escape(p.spec.description)}<br>"
            f"{html.escape(projection_note(p))}</p>" + html_table(projection_rows(p)))


def render_html(sweep: Sweep, figures: dict[str, list[Path]], projections: Sequence[SweepProjection],
                cells: "pd.DataFrame | None" = None, choices: Sequence[str] = (),
                paper: PaperSection | None = None, gains: Sequence[Gain] = (),
                pairings: Sequence[Pairing] = ()) -> str:
    """The report page; ``figures`` maps a section title to its PNG files."""
    meta = sweep.meta
    approximations = ", ".join(a.label for a in sweep.approximations)
    facts = ", ".join(f"{k} {html.escape(str(v))}" for k, v in
                      (("model", sweep.model), ("window", meta.get("window")), ("static_p", meta.get("static_p")),
                       ("approx", approximations if beyond_sink(sweep) else None)) if v is not None)
    replaced_by = "the row's approximation A~" if beyond_sink(sweep) else "the sink approximation"
    parts = [f"<!doctype html><html><head><meta charset='utf-8'><title>ALSpec sweep {html.escape(str(meta.get('name', sweep.outdir.name)))}</title>",
             f"<style>{_STYLE}</style></head><body>",
             f"<h1>ALSpec sweep: {html.escape(str(meta.get('name', sweep.outdir.name)))}</h1>",
             f"<p class='note'>{facts}; {len(sweep.cells)} cells from {html.escape(str(sweep.outdir))}</p>",
             "<h2>Table 1: score / hit rate</h2>",
             "<p class='note'>Score as lm-eval reports it; hit rate = share of non-trivial decode attention "
             f"replaced by {replaced_by}. – marks a cell not (yet) run.</p>",
             html_table(table1_rows(sweep, cells)),
             *(f"<p class='note'>{html.escape(line)}</p>" for line in approximation_notes(sweep)),
             f"<p class='note'>{html.escape(ROUTINES)}</p>",
             *(f"<p>{html.escape(c)}</p>" for c in choices)]
    if gains:
        parts += [f"<h2>{html.escape(GAINS_TITLE)}</h2><p class='note'>{html.escape(GAINS_NOTE)}</p>",
                  html_table(gains_rows(list(gains))),
                  *(f"<p class='note'>{html.escape(n)}</p>" for n in gains_notes(list(gains)))]
    if pairings:
        parts += [f"<h2>{html.escape(DENSITY_TITLE)}</h2><p class='note'>{html.escape(DENSITY_NOTE)}</p>",
                  html_table(density_rows(list(pairings))),
                  *(f"<p class='note'>{html.escape(n)}</p>" for n in density_notes(list(pairings)))]
    if paper is not None:
        parts.append(f"<h2>Beside the paper</h2><p class='note'>{html.escape(paper.line)}"
                     f"{' ' + html.escape(NOTE) if paper.rows else ''}</p>")
        if paper.rows:
            parts.append(html_table(paper.rows) + "".join(f"<p>{html.escape(s)}</p>" for s in paper.sentences))
    for title, paths in figures.items():
        parts.append(f"<h2>{html.escape(title)}</h2>" + "".join(_image(p) for p in paths))
    parts.append("<h2>Projected decode speed (the paper's latency model, Appendix F)</h2><p class='note'>Per layer: "
                 "a hit costs SFD_R + max(SFD_S − SFD_R, per_layer), a miss per_layer + SFD_S; token latency = fixed "
                 "+ Σ layers from each cell's measured per-layer hit rates; speedup against full tensor parallelism, "
                 "fixed + L (per_layer + FD), on the same table.</p>")
    parts += [_projection(p) for p in projections]
    parts.append("</body></html>\n")
    return "\n".join(parts)
