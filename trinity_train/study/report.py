"""The study's report in its output directory: `summary.json` (every measurement, written whole),
`report.md` (the tables), `plots/*.png` and `report.html` (the dashboard's offline report over
every cell's run directory)."""

from __future__ import annotations

from pathlib import Path

from trinity_train.files import atomic_write_json, atomic_write_text, json_safe
from trinity_train.study import aggregate, compare, table
from trinity_train.study.cells import Cell, cell_hash, global_batch
from trinity_train.study.layout import StudyDir
from trinity_train.study.measure import measure_cell
from trinity_train.study.provenance import GitState, provenance
from trinity_train.study.spec import Study, StudyError
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
            "commits": record["commits"], "dirty": record["dirty"], "config_sha256": record["config_sha256"],
            "last_step": measures["last_step"] if measures else None,
            "headline": aggregate.headline_values(measures), "measures": measures}


def check_one_code(cells: list[Cell], out: StudyDir, state: StudyState) -> None:
    """Refuse to aggregate cells that ran at different commits of the code (an unrecorded commit,
    a study of before provenance, counts as one of its own) or with another config than the cell's
    now: a report's numbers must come from one code and one study."""
    by_commit: dict[str, list[str]] = {}
    for cell in cells:
        if not out.cell(cell.name).metrics.is_file():
            continue
        record = state.cell(cell.name)
        for commit in record["commits"] or ["unrecorded"]:
            by_commit.setdefault(commit, []).append(cell.name)
        if record["config_sha256"] not in (None, cell_hash(cell)):
            raise StudyError(f"{out.cell(cell.name).path} ran with another config than the study's cell now (config "
                             f"hash {record['config_sha256'][:12]}, now {cell_hash(cell)[:12]}): delete that directory "
                             f"to run the cell again, or write the study to another --out")
    if len(by_commit) > 1:
        listed = "; ".join(f"{commit[:12]}: {', '.join(names[:3])}{' ...' if len(names) > 3 else ''}"
                           for commit, names in by_commit.items())
        raise StudyError(f"{out.path}: the cells ran at {len(by_commit)} commits of the code ({listed}), and a "
                         f"report must come from one: run the study again into another --out from one clean commit")


def build_summary(study: Study, cells: list[Cell], config_hash: str, out: StudyDir, state: StudyState,
                  run: dict, nproc: int, git: GitState | None = None, allow_dirty: bool = False) -> dict:
    check_one_code(cells, out, state)
    summaries = [cell_summary(cell, out, state) for cell in cells]
    first = cells[0].config
    return {
        "provenance": provenance(git or GitState(None), allow_dirty, first, config_hash),
        "study": {"name": study.name, "file": str(study.path), "base": _shown(study.base), "config_hash": config_hash,
                  "variants": list(study.variants), "seeds": list(study.seeds),
                  "lrs": [lr.as_dict() for lr in study.lrs], "drills": [d.as_dict() for d in study.drills],
                  "budget": {"steps": first.train.steps, "global_batch": global_batch(first, nproc),
                             "seq_len": first.data.seq_len, "tokens": study.tokens,
                             "val_tokens": first.eval.batches * global_batch(first, nproc) * first.data.seq_len,
                             "eval_every": first.eval.every, "data_order": study.data_order,
                             "data_seed": first.data.seed - (study.seeds[0] if study.data_order == "seed" else 0),
                             "guard_mode": first.stability.mode}},
        "run": {**run, "nproc": nproc, "cells_wall_s": sum(c["wall_s"] for c in summaries)},
        "status": aggregate.status_counts(summaries),
        "cells": summaries,
        "groups": aggregate.groups(summaries),
        "comparisons": compare.comparisons(summaries, list(study.variants), [lr.name for lr in study.lrs]),
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
