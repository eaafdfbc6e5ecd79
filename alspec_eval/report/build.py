"""``write_report``: every table, figure and projection of a sweep under OUTDIR/report/."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Sequence

from alspec_eval.latency import LatencyModel, preset
from alspec_eval.report.figures import (acceptance_heatmap, attention_vs_token_speculation, frontier,
                                        hit_rate_by_approximation, middle_lambda, open_loop_acceptance_figure, save,
                                        schedule_profile, score_vs_density, score_vs_hit_rate, speedup_vs_score)
from alspec_eval.report.frames import frontier_choice, load
from alspec_eval.report.html import render_html
from alspec_eval.ruler import split_unit
from alspec_eval.report.board import board, board_markdown, speedup_by_length, write_board_csv
from alspec_eval.report.density import density_markdown, equal_density, write_density_csv
from alspec_eval.report.gains import approximation_gains, gains_markdown, write_gains_csv
from alspec_eval.report.latency import DEFAULT_PRESET, project_sweep, projection_markdown, write_projection_csv
from alspec_eval.report.cells import SINK, load_sweep
from alspec_eval.report.paper import paper_section
from alspec_eval.report.table import table1_markdown, write_table1_csv


def _slug(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", name)


def write_report(outdir: str | Path, latency: Sequence[LatencyModel] | None = None, paper: str = "auto",
                 lam: float | None = None) -> list[Path]:
    """Write the report of ``outdir`` and return the files written.

    ``latency`` defaults to the DEFAULT_PRESET (the paper's measured H100 numbers), so a report always shows a
    projection; the speedup-against-score figure uses the first table. ``paper`` picks the paper's table to set
    the cells beside (``auto``: the one whose model the sweep ran, if any; ``table1``, ``table2``, ``none``).
    A sweep of several approximations of A~ also gets their per-layer hit rates at ``lam`` (default: the sweep's
    middle lambda) in ``hit_rate_by_approximation.png``. A sweep of several approximations, or of RULER's units per
    length, gets the board (``board.md``, ``board.csv``; :mod:`.board`), and per length its figure. A budget axis
    with a draft whose budget varies (vAttention) gets it beside the others at equal density (``density.md``,
    ``density.csv``; :mod:`.density`).
    """
    sweep = load_sweep(outdir)
    if lam is not None and lam not in sweep.lambdas:
        lambdas = ", ".join(f"{x:g}" for x in sweep.lambdas)
        raise ValueError(f"lambda {lam:g} is not one of the sweep's lambdas ({lambdas}); the per-layer hit rate by "
                         "approximation is drawn at one of them")
    frames = load(sweep.outdir)
    cells = frames.cells
    specs = [preset(DEFAULT_PRESET)] if latency is None else list(latency)
    report = sweep.outdir / "report"
    report.mkdir(exist_ok=True)
    written = [report / "table1.md", write_table1_csv(sweep, report / "table1.csv", cells)]
    written[0].write_text(table1_markdown(sweep, cells))

    heatmaps = [save(acceptance_heatmap(sweep, task, approx, window), report / f"heatmap_{_slug(task)}{suffix}.png")
                for approx, window in sweep.curves  # the sink's named as before, the others' "_quest_p16", "_S32"
                for suffix in [SINK.approximated(approx, window).name_suffix]
                for task in sweep.tasks if sweep.dynamic_cells(task, approx, window)]
    score_fig = [save(score_vs_hit_rate(sweep), report / "score_vs_hit_rate.png")]
    by_approx = []
    if len(sweep.approximations) > 1 and sweep.lambdas:
        lam = middle_lambda(sweep) if lam is None else lam
        by_approx = [save(hit_rate_by_approximation(sweep, lam), report / "hit_rate_by_approximation.png")]
    open_loop = [save(open_loop_acceptance_figure(sweep), report / "open_loop_acceptance.png")]
    figures = {"Score against hit rate": score_fig, "Per-layer acceptance": heatmaps,
               "Open-loop acceptance": open_loop}
    if by_approx:
        figures = {"Score against hit rate": score_fig,
                   f"Per-layer hit rate by approximation of A~ (λ = {lam:g})": by_approx, **figures}
    density = []
    dynamic = cells[(cells["policy"] == "dynamic") & cells["effective_density"].notna() & cells["diff"].notna()]
    if len(dynamic):  # cells from before densities were recorded have none
        density = [save(score_vs_density(cells), report / "score_vs_density.png")]
        figures["Score against effective density"] = density

    projections = [project_sweep(sweep, spec) for spec in specs]
    trade_off = [save(speedup_vs_score(sweep, projections[0]), report / "speedup_vs_score.png")] if projections else []
    if trade_off:
        figures["Projected speedup against score"] = trade_off
    choices: dict[str, str] = {}
    if projections and cells["diff"].notna().any():
        speedups = {(t, row.label): e.speedup for (row, t), e in projections[0].entries.items()}
        choices = frontier_choice(cells, speedups, frames.documents)
        trade_off.append(save(frontier(cells, projections[0]), report / "frontier.png"))
        figures["Projected speedup against score"] = trade_off[:1]  # not the frontier too (it has its own section)
        figures["Speed against paired score difference"] = trade_off[-1:]
        written[0].write_text(written[0].read_text() + "\n" + "\n".join(choices.values()) + "\n")
    comparison = [save(attention_vs_token_speculation(sweep, task, projections[0]),
                       report / f"alspec_vs_selfspec_{_slug(task)}.png")
                  for task in sweep.tasks if projections and any(
                      (c := sweep.cell(task, r)) is not None and c.tau is not None for r in sweep.rows
                      if r.drafts_tokens and r.approx.is_default)]
    if comparison:
        figures["Attention-level against token-level speculation"] = comparison
    profiles = [save(schedule_profile(sweep, row), report / f"schedule_{row.name}.png")
                for row in sweep.rows if row.schedule is not None]
    if profiles:
        figures["Tuned per-layer schedules"] = profiles
    paper_md = report / "paper.md"
    beside_paper = paper_section(sweep, cells, frames.documents, paper)
    paper_md.write_text(beside_paper.markdown())
    if beside_paper.sentences:
        written[0].write_text(written[0].read_text() + "\n" + "\n".join(beside_paper.sentences) + "\n")
    latency_md = report / "latency.md"
    latency_md.write_text("\n".join(projection_markdown(p) for p in projections))
    latency_csv = write_projection_csv(projections, report / "latency.csv")

    per_length = any(split_unit(task)[1] is not None for task in sweep.tasks)
    if projections and cells["diff"].notna().any() and (len(sweep.approximations) > 1 or per_length):
        units = board(sweep, cells, frames.documents, speedups)
        if any(u.entries for u in units):
            (report / "board.md").write_text(board_markdown(units, specs[0].name))
            written += [report / "board.md", write_board_csv(units, report / "board.csv")]
            if per_length:
                written.append(save(speedup_by_length(units), report / "board_speedup_by_length.png"))
                figures["Best verified speedup against context length"] = written[-1:]

    gains = approximation_gains(sweep, projections[0].entries if projections else None)
    if gains:
        (report / "approximations.md").write_text(gains_markdown(gains))
        written += [report / "approximations.md", write_gains_csv(gains, report / "approximations.csv")]
    pairings = equal_density(sweep)
    if pairings:
        (report / "density.md").write_text(density_markdown(pairings))
        written += [report / "density.md", write_density_csv(pairings, report / "density.csv")]

    page = report / "report.html"
    page.write_text(render_html(sweep, figures, projections, cells, list(choices.values()), beside_paper, gains,
                                pairings))
    return [*written, *score_fig, *by_approx, *density, *heatmaps, *open_loop, *trade_off, *comparison, *profiles, paper_md,
            latency_md, latency_csv, page]
