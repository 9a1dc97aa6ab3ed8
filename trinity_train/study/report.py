"""The study's report in its output directory: `summary.json` (every measurement, written whole),
`report.md` (the tables), `plots/*.png` and `report.html` (the dashboard's offline report over
every cell's run directory)."""

from __future__ import annotations

from pathlib import Path

from trinity_train.files import atomic_write_json, atomic_write_text, json_safe
from trinity_train.study import aggregate, table
from trinity_train.study.cells import Cell, global_batch
from trinity_train.study.layout import StudyDir
from trinity_train.study.measure import measure_cell
from trinity_train.study.spec import Study
from trinity_train.study.state import FAILED, PENDING, StudyState, run_outcome


def _shown(path: Path) -> str:
    """`path` relative to the working directory when it is inside it (a report committed to the
    repository then names no machine's directories)."""
    try:
        return str(path.relative_to(Path.cwd()))
    except ValueError:
        return str(path)


def cell_summary(cell: Cell, out: StudyDir, state: StudyState) -> dict:
    """A cell's outcome (its run directory first, the state file for failures) and measurements."""
    run = out.cell(cell.name)
    record = state.cell(cell.name)
    outcome = run_outcome(run, cell.config.train.steps)
    status = outcome.status if outcome else (FAILED if record["status"] == FAILED else PENDING)
    measures = measure_cell(run, cell.config) if run.metrics.is_file() else None
    return {"name": cell.name, "variant": cell.variant, "lr": cell.lr, "seed": cell.seed, "drilled": cell.drilled,
            "status": status, "reason": outcome.reason if outcome else record["reason"],
            "exit_code": record["exit_code"], "attempts": record["attempts"], "wall_s": record["wall_s"],
            "last_step": measures["last_step"] if measures else None,
            "headline": aggregate.headline_values(measures), "measures": measures}


def build_summary(study: Study, cells: list[Cell], config_hash: str, out: StudyDir, state: StudyState,
                  run: dict, nproc: int) -> dict:
    summaries = [cell_summary(cell, out, state) for cell in cells]
    first = cells[0].config
    return {
        "study": {"name": study.name, "file": str(study.path), "base": _shown(study.base), "config_hash": config_hash,
                  "variants": list(study.variants), "seeds": list(study.seeds),
                  "lrs": [lr.as_dict() for lr in study.lrs], "drills": [d.as_dict() for d in study.drills],
                  "budget": {"steps": first.train.steps, "global_batch": global_batch(first, nproc),
                             "seq_len": first.data.seq_len, "tokens": study.tokens, "data_seed": first.data.seed}},
        "run": {**run, "nproc": nproc, "cells_wall_s": sum(c["wall_s"] for c in summaries)},
        "status": aggregate.status_counts(summaries),
        "cells": summaries,
        "groups": aggregate.groups(summaries),
    }


def write_study_report(summary: dict, out: StudyDir) -> None:
    # matplotlib, numpy, plotly's bundle: loaded only to report, so a bad study file fails at once
    from trinity_train.dashboard.report import write_report
    from trinity_train.study import plots

    atomic_write_json(out.summary, json_safe(summary))  # a NaN or inf in a drill's settings is null, not a crash
    plots.write_plots(summary["cells"], [lr["name"] for lr in summary["study"]["lrs"]], summary["study"]["variants"],
                      out.plot)
    atomic_write_text(out.table, table.render_markdown(summary))
    run_dirs = [out.cell(c["name"]).path for c in summary["cells"] if out.cell(c["name"]).metrics.is_file()]
    if run_dirs:
        write_report(run_dirs, out.html, title=f"Study {summary['study']['name']} ({len(run_dirs)} cells)")
