"""`report.md`: how the study was run, the mean ± std over seeds of every (variant, LR) group, one
row per cell, and the plots."""

from __future__ import annotations

from trinity_train.study.aggregate import DEPTH, STABILITY, Headline

PLOTS = (("loss_curves", "Loss curves (train loss smoothed; validation loss at matched token counts)"),
         ("grad_norm_by_layer", "Gradient norm by layer at 10, 50 and 100 % of training"),
         ("residual_rms_by_layer", "Residual-stream RMS by layer at the end of training"),
         ("activations_by_layer", "Activation kurtosis and max|a|/median by layer at the end of training"),
         ("post_norm_gains", "Learned post-norm gains by layer at the end of training"),
         ("spikes_by_lr", "Skipped steps and rollbacks by learning rate"))


def _cell_text(value: float | None, fmt: str) -> str:
    return "–" if value is None else fmt.format(value)


def _mean_std_text(stat: dict, fmt: str) -> str:
    if stat["mean"] is None:
        return "–"
    text = fmt.format(stat["mean"])
    return text if stat["std"] is None else f"{text} ± {fmt.format(stat['std'])}"


def _markdown_table(header: list[str], rows: list[list[str]]) -> list[str]:
    def line(cells: list[str]) -> str:
        return "| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |"  # a "|" in a cell ends it
    return [line(header), "|" + "|".join("---" for _ in header) + "|"] + [line(row) for row in rows]


def _outcomes(status: dict[str, int], drilled: int) -> str:
    text = ", ".join(f"{n} {s}" for s, n in status.items())
    return text + (f" ({drilled} drilled)" if drilled else "")


def group_table(groups: list[dict], headlines: tuple[Headline, ...]) -> list[str]:
    rows = [[g["variant"], g["lr"], _outcomes(g["status"], g["drilled"])]
            + [_mean_std_text(g["values"][h.key], h.fmt) for h in headlines] for g in groups]
    return _markdown_table(["variant", "LR", "cells"] + [h.header for h in headlines], rows)


def _cell_status(cell: dict) -> str:
    status = cell["status"]
    if status != "finished" and cell.get("last_step") is not None:
        status += f" at step {cell['last_step']}"
    return status + (" (drill)" if cell["drilled"] else "")


def cell_table(cells: list[dict], headlines: tuple[Headline, ...]) -> list[str]:
    rows = [[c["name"], _cell_status(c)] + [_cell_text(c["headline"][h.key], h.fmt) for h in headlines] for c in cells]
    return _markdown_table(["cell", "outcome"] + [h.header for h in headlines], rows)


def _lr_text(lr: dict) -> str:
    parts = [f"{k} {lr[k]:g}" for k in ("lr", "muon_lr") if lr[k] is not None]
    only = f" ({', '.join(lr['variants'])} only)" if lr["variants"] else ""
    return f"`{lr['name']}`: " + ", ".join(parts) + only


def render_markdown(summary: dict) -> str:
    study, run = summary["study"], summary["run"]
    budget = study["budget"]
    lines = [f"# Study `{study['name']}`", "",
             f"- Command: `{run['command']}`",
             f"- Study file: `{study['file']}`; config hash (sha256 of the resolved study): `{study['config_hash']}`",
             f"- Budget per cell: {budget['steps']} steps x {budget['global_batch']} sequences x {budget['seq_len']} "
             f"tokens = {budget['tokens']:,} tokens, on the same batches in every cell (data.seed {budget['data_seed']})",
             f"- Cells: {len(summary['cells'])} ({len(study['variants'])} variants, seeds {study['seeds']}); "
             + ", ".join(f"{n} {s}" for s, n in summary["status"].items()),
             "- Learning rates: " + "; ".join(_lr_text(lr) for lr in study["lrs"]),
             f"- Wall time: {run['cells_wall_s'] / 60:.1f} min of training over all cells and attempts; "
             f"this invocation {run['wall_s'] / 60:.1f} min on {run['cpus']} CPUs, load average "
             f"{run['load_start']} at its start and {run['load_end']} at its end",
             ""]
    lines += ["## Mean ± std over seeds", "", "Loss and stability:", ""] + group_table(summary["groups"], STABILITY)
    lines += ["", "Depth profile and cost:", ""] + group_table(summary["groups"], DEPTH)
    lines += ["", "## Every cell", ""] + cell_table(summary["cells"], STABILITY)
    lines += [""] + cell_table(summary["cells"], DEPTH)
    lines += ["", "## Plots", ""]
    for name, caption in PLOTS:
        lines += [f"{caption}:", "", f"![{caption}](plots/{name}.png)", ""]
    lines += ["## More", "",
              "- `summary.json`: every measurement of every cell (per-layer lists included) and the group means.",
              "- [report.html](report.html): the dashboard's offline report over every cell; live: "
              "`trinity-train dashboard cells/*` in this directory.",
              "- `configs/`: each cell's resolved config (`trinity-train train --config configs/NAME.toml` re-runs it); "
              "`logs/`: each cell's console.",
              "- Definitions (trinity_train/study/measure.py): validation loss at 50 / 100 % of the steps; skipped, "
              "rollbacks and non-finite count steps; the max loss jump is the largest rise of the train loss from one "
              "iteration to the next; clipped is the fraction of applied steps with a pre-clip gradient norm above "
              "train.grad_clip; grad max/min and ln-slope are the spread across depth of the per-layer gradient norm "
              "(attention and FFN together) and the least-squares slope of its logarithm per layer; kurtosis "
              "(excess) and max|a|/median are of the blocks' outputs, their maximum over layers; MoE max load is "
              "the busiest expert's tokens over the mean in the worst layer, averaged over the second half.",
              ""]
    return "\n".join(lines)
