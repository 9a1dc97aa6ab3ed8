"""The errata tables of this (v1) report, recomputed from the committed cells' records with the
current measurements (trinity_train/study/measure.py, compare.py): run from the repository root,

    python docs/studies/norm_placement/errata.py > /tmp/errata.md

and it prints the markdown that report.md's "Errata" section holds."""

from __future__ import annotations

import statistics
from pathlib import Path

from trinity_train.config import load_config
from trinity_train.study import aggregate, compare
from trinity_train.study.layout import StudyDir
from trinity_train.study.measure import measure_cell
from trinity_train.study.table import comparison_table

HERE = StudyDir(Path(__file__).resolve().parent)
VARIANTS = ["prenorm", "sandwich", "trinity", "gemma3", "normformer"]
LRS = ["normal", "aggressive"]


def cells() -> list[dict]:
    out = []
    for lr in LRS:
        for seed in (0, 1, 2):
            for variant in VARIANTS:
                name = f"{variant}-{lr}-s{seed}"
                measures = measure_cell(HERE.cell(name), load_config(HERE.cell_config(name)))
                out.append({"name": name, "variant": variant, "lr": lr, "seed": seed, "drilled": False,
                            "measures": measures, "headline": aggregate.headline_values(measures)})
    return out


def _range(values: list[float], fmt: str) -> str:
    def text(v: float) -> str:
        return f"{v:,.0f}" if v >= 1000 else fmt.format(v)
    return f"{text(statistics.fmean(values))} ({text(min(values))}–{text(max(values))})"


def main() -> None:
    measured = cells()
    print("| variant | LR | val loss at step 40 (40 %) | residual RMS after block 0 | residual RMS after block 11 "
          "| last/first | last batch trained, per seed | batch of the max loss jump, per seed |")
    print("|---|---|---|---|---|---|---|---|")
    for lr in LRS:
        for variant in VARIANTS:
            group = [c for c in measured if c["variant"] == variant and c["lr"] == lr]
            at_40 = [next(p["val_loss"] for p in c["measures"]["val"] if p["step"] == 40) for c in group]
            layers = [c["measures"]["layers"]["100%"] for c in group]
            last_batch = [max(r["batch"] for r in HERE.cell(c["name"]).read_metrics("train")) for c in group]
            print(f"| {variant} | {lr} | {_range(at_40, '{:.3f}')} | {_range([x['residual_first'] for x in layers], '{:.3g}')} "
                  f"| {_range([x['residual_last'] for x in layers], '{:.3g}')} "
                  f"| {_range([x['residual_ratio'] for x in layers], '{:.2f}')} | {', '.join(map(str, last_batch))} "
                  f"| {', '.join(str(c['measures']['max_loss_jump_batch']) for c in group)} |")
    comparisons = compare.comparisons(measured, VARIANTS, LRS)
    print("\nSeed-paired differences of the final validation loss (cells of one seed share initialisation and "
          "data order), between variants at each learning rate:\n")
    print("\n".join(comparison_table(comparisons, "val_loss_100", "variants")))
    print("\nBetween the two learning rates of each variant, and the best group against Pre-Norm at the normal rate:\n")
    by_seed = lambda variant, lr: {c["seed"]: c["headline"]["val_loss_100"] for c in measured  # noqa: E731
                                   if c["variant"] == variant and c["lr"] == lr}
    best = {"metric": "val_loss_100", "kind": "lrs", "variant": "across rates", "a": "trinity-aggressive",
            "b": "prenorm-normal", **compare.paired(by_seed("trinity", "aggressive"), by_seed("prenorm", "normal"))}
    print("\n".join(comparison_table(comparisons + [best], "val_loss_100", "lrs")))


if __name__ == "__main__":
    main()
