"""`report.md`: how the study was run (command, config hash, provenance, design), the mean ± std
over seeds of every (variant, LR) group, the seed-paired differences (`compare.py`) and which of
them are within noise, one row per cell, and the plots."""

from __future__ import annotations

from trinity_train.study.aggregate import DEPTH, STABILITY, Headline

PLOTS = (("loss_curves", "Loss curves (train loss smoothed; validation loss at matched token counts)"),
         ("grad_norm_by_layer", "Gradient norm by layer at 10, 50 and 100 % of training"),
         ("residual_rms_by_layer", "Residual-stream RMS by layer at the end of training (absolute)"),
         ("activations_by_layer", "Activation kurtosis and max|a|/median by layer at the end of training"),
         ("post_norm_gains", "Learned post-norm gains by layer at the end of training"),
         ("lr_sensitivity", "Final validation loss by learning rate (mean, seeds and their range)"),
         ("spikes_by_lr", "Spikes by learning rate (observed by the guard in observe mode; else skips and rollbacks)"))


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
    missing = {"mean": None, "std": None, "n": 0}  # a headline a summary of an older study lacks
    rows = [[g["variant"], g["lr"], _outcomes(g["status"], g["drilled"])]
            + [_mean_std_text(g["values"].get(h.key, missing), h.fmt) for h in headlines] for g in groups]
    return _markdown_table(["variant", "LR", "cells"] + [h.header for h in headlines], rows)


def _cell_status(cell: dict) -> str:
    status = cell["status"]
    if status != "finished" and cell.get("last_step") is not None:
        status += f" at step {cell['last_step']}"
    return status + (" (drill)" if cell["drilled"] else "")


def cell_table(cells: list[dict], headlines: tuple[Headline, ...]) -> list[str]:
    rows = [[c["name"], _cell_status(c)] + [_cell_text(c["headline"].get(h.key), h.fmt) for h in headlines]
            for c in cells]
    return _markdown_table(["cell", "outcome"] + [h.header for h in headlines], rows)


def _lr_text(lr: dict) -> str:
    parts = [f"{k} {lr[k]:g}" for k in ("lr", "muon_lr") if lr[k] is not None]
    only = f" ({', '.join(lr['variants'])} only)" if lr["variants"] else ""
    return f"`{lr['name']}`: " + ", ".join(parts) + only


def _data_text(budget: dict) -> str:
    if budget.get("data_order", "fixed") == "seed":
        return (f"each seed its own data order (data.seed = {budget['data_seed']} + seed) and initialisation "
                f"(train.seed = seed); the cells of one seed share both, so they compare seed by seed")
    return f"the same batches in every cell (data.seed {budget['data_seed']}) unless a guard skipped some"


def _provenance_lines(p: dict | None) -> list[str]:
    if not p:
        return ["- Provenance: not recorded (a study run before `ablate` recorded it)"]
    commit = p["commit"] or "none (no git checkout)"
    tree = "clean" if p["dirty"] is False else "dirty" if p["dirty"] else "unknown"
    data = "; ".join(f"`{d['path']}`: manifest sha256 `{d['manifest_sha256']}`, tokenizer sha256 "
                     f"`{d['tokenizer_sha256']}`" for d in p["data"])
    return [f"- Code: commit `{commit}`, working tree {tree}" + (" (run with --allow-dirty)" if p["allow_dirty"] else ""),
            f"- Python {p['python']}, torch {p['torch']}, numpy {p['numpy']}; CPU {p['cpu_model']}, "
            f"{p['cpu_count']} cores ({p['cpus_usable']} usable)",
            f"- Dataset hashes: {data}"]


def comparison_table(comparisons: list[dict], metric: str, kind: str) -> list[str]:
    rows = []
    for c in comparisons:
        if c["metric"] != metric or c["kind"] != kind:
            continue
        where = c["lr"] if kind == "variants" else c["variant"]
        interval = "–" if c["low"] is None else f"[{c['low']:+.3g}, {c['high']:+.3g}]"
        noise = "–" if c["within_noise"] is None else "yes" if c["within_noise"] else "no"
        rows.append([where, f"{c['a']} − {c['b']}", f"{c['mean']:+.3g}", interval,
                     "–" if c["p"] is None else f"{c['p']:.2g}", str(c["n"]), noise])
    first = "LR" if kind == "variants" else "variant"
    return _markdown_table([first, "difference", "mean", "95% interval", "p (paired t)", "seeds", "within noise"], rows)


COMPARED_TEXT = {"val_loss_100": "validation loss at the end", "residual_last_100": "residual RMS after the last block"}


def _comparison_lines(comparisons: list[dict]) -> list[str]:
    if not comparisons:
        return []
    within = sum(1 for c in comparisons if c["within_noise"])
    judged = sum(1 for c in comparisons if c["within_noise"] is not None)
    lines = ["## Seed-paired differences", "",
             "Each difference a − b is taken seed by seed (the cells of a seed share initialisation and data), "
             "with a 95 % Student-t interval and the paired t-test's p. *Within noise* means the interval holds 0: "
             f"such a difference is no ranking. {within} of {judged} differences below are within noise.", ""]
    for metric in dict.fromkeys(c["metric"] for c in comparisons):
        text = COMPARED_TEXT.get(metric, metric)
        lines += [f"{text[0].upper() + text[1:]}, between variants at each learning rate:", ""]
        lines += comparison_table(comparisons, metric, "variants")
        lines += ["", f"{text[0].upper() + text[1:]}, between learning rates of each variant:", ""]
        lines += comparison_table(comparisons, metric, "lrs") + [""]
    return lines


def render_markdown(summary: dict) -> str:
    study, run = summary["study"], summary["run"]
    budget = study["budget"]
    val = (f"; validation on {budget['val_tokens']:,} tokens every {budget['eval_every']} steps"
           if budget.get("val_tokens") else "")
    guard = {"observe": "observe mode: it judges every step and records what it would have done, nothing is "
                        "skipped, so spikes are counted without recovery changing what follows",
             "act": "acting: skips and rollbacks change what a cell trains on"}.get(budget.get("guard_mode", "act"))
    lines = [f"# Study `{study['name']}`", "",
             f"- Command: `{run['command']}`",
             f"- Study file: `{study['file']}`; config hash (sha256 of the resolved study): `{study['config_hash']}`",
             *_provenance_lines(summary.get("provenance")),
             f"- Budget per cell: {budget['steps']} steps x {budget['global_batch']} sequences x {budget['seq_len']} "
             f"tokens = {budget['tokens']:,} tokens{val}",
             f"- Data: {_data_text(budget)}",
             f"- Spike guard: {guard}",
             f"- Cells: {len(summary['cells'])} ({len(study['variants'])} variants, seeds {study['seeds']}); "
             + ", ".join(f"{n} {s}" for s, n in summary["status"].items()),
             "- Learning rates: " + "; ".join(_lr_text(lr) for lr in study["lrs"]),
             f"- Wall time: {run['cells_wall_s'] / 60:.1f} min of training over all cells and attempts; "
             f"this invocation {run['wall_s'] / 60:.1f} min on {run['cpus']} CPUs, load average "
             f"{run['load_start']} at its start and {run['load_end']} at its end",
             ""]
    lines += ["## Mean ± std over seeds", "", "Loss and stability:", ""] + group_table(summary["groups"], STABILITY)
    lines += ["", "Depth profile and cost:", ""] + group_table(summary["groups"], DEPTH)
    lines += [""] + _comparison_lines(summary.get("comparisons", []))
    lines += ["## Every cell", ""] + cell_table(summary["cells"], STABILITY)
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
              "- Definitions (trinity_train/study/measure.py): validation loss at exactly 50 / 100 % of the steps "
              "(– where no validation ran at that step); skipped, rollbacks and non-finite count steps; spikes "
              "(observed) are the steps the guard in observe mode would have refused, would-be rollbacks the "
              "incidents in which it would have rolled back or halted (– when the guard acted); clipped is the "
              "fraction of applied steps with a pre-clip gradient norm above train.grad_clip; grad max/min and "
              "ln-slope are the spread across depth of the per-layer gradient norm (attention and FFN together) "
              "and the least-squares slope of its logarithm per layer; residual RMS after block 0 / after the last "
              "block are absolute values, last/first their ratio; kurtosis (excess) and max|a|/median are of the "
              "blocks' outputs, their maximum over layers; MoE max load is the busiest expert's tokens over the "
              "mean in the worst layer, averaged over the second half.",
              ""]
    return "\n".join(lines)
