"""Muon against AdamW on the debug model and the default data, for the same tokens.

Each optimizer gets a small learning-rate sweep; the best run of each (lowest final validation
loss) is what the two are compared on. AdamW is swept first; Muon's sweep keeps the best AdamW
rate for the parameters AdamW still trains in a Muon run (embedding, head, norms), so the two
differ only in the hidden matrices. Every run uses the same data order, initialisation and
schedule (warmup, then WSD's linear decay), on the real trainer.

    python benchmarks/muon_vs_adamw.py [--steps 60] [--adamw-lrs 1e-3,3e-3,1e-2]
                                       [--muon-lrs 5e-3,1.5e-2,4.5e-2] [--a.b=value overrides...]

The default budget (six runs of 60 steps of 8 x 128 tokens, about 61k tokens each) takes about
six minutes on 2 CPU cores.
"""

from __future__ import annotations

import os

# Before torch starts OpenMP: on a shared CPU, threads spinning at barriers stall each operator
# (2-10x slower, erratic steps). Set OMP_WAIT_POLICY=ACTIVE to measure the spinning default.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse
import sys
import tempfile
from pathlib import Path

from trinity_harness.table import markdown_table
from trinity_train.config import Config, load_config
from trinity_train.train import train

ROOT = Path(__file__).resolve().parent.parent


def run_config(run_dir: Path, steps: int, optimizer: str, adamw_lr: float, muon_lr: float,
               overrides: list[str]) -> Config:
    return load_config(ROOT / "configs" / "debug.toml", [
        f"--train.steps={steps}", "--train.micro_batch_size=8", "--data.seq_len=128",
        f"--eval.every={steps}", "--eval.batches=8", f"--train.log_every={steps}",
        f"--optim.warmup_steps={max(1, steps // 10)}", "--checkpoint.every=0",
        "--metrics.progress_bar=false", f"--run.dir={run_dir}",
        f"--optim.name={optimizer}", f"--optim.lr={adamw_lr}", f"--optim.muon_lr={muon_lr}",
    ] + overrides)


def final_val_loss(cfg: Config) -> float:
    summary = train(cfg)
    return summary.last_val_loss


def sweep(label: str, lrs: list[float], make_cfg,
          results: list[tuple[float, float]] | None = None) -> tuple[float, float]:
    """(best lr, its final validation loss), printing every run; each run's (loss, lr) appended to
    `results` where given."""
    results = [] if results is None else results
    for lr in lrs:
        loss = final_val_loss(make_cfg(lr))
        print(f"   {label} lr {lr:8.1e}: final validation loss {loss:.4f}", flush=True)
        results.append((loss, lr))
    loss, lr = min(results)
    return lr, loss


def _floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",")]


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--adamw-lrs", type=_floats, default=[1e-3, 3e-3, 1e-2])
    parser.add_argument("--muon-lrs", type=_floats, default=[5e-3, 1.5e-2, 4.5e-2])
    args, overrides = parser.parse_known_args(argv)

    with tempfile.TemporaryDirectory() as tmp:
        runs = iter(range(1000))

        def cfg_for(optimizer: str, adamw_lr: float, muon_lr: float) -> Config:
            return run_config(Path(tmp) / f"run{next(runs)}", args.steps, optimizer, adamw_lr,
                              muon_lr, overrides)

        probe = cfg_for("adamw", 1e-3, 1e-3)
        tokens = args.steps * probe.train.micro_batch_size * probe.train.grad_accum * probe.data.seq_len
        print(f"debug model, default data, {args.steps} steps x "
              f"{probe.train.micro_batch_size * probe.train.grad_accum} x {probe.data.seq_len} tokens "
              f"= {tokens} tokens per run", flush=True)

        print("AdamW sweep (optim.lr)", flush=True)
        adamw_runs, muon_runs = [], []
        adamw_lr, adamw_loss = sweep("adamw", args.adamw_lrs, lambda lr: cfg_for("adamw", lr, 1e-3), adamw_runs)
        print(f"Muon sweep (optim.muon_lr; AdamW part at optim.lr={adamw_lr:.1e})", flush=True)
        muon_lr, muon_loss = sweep("muon ", args.muon_lrs, lambda lr: cfg_for("muon", adamw_lr, lr), muon_runs)

    print(f"\nbest AdamW: lr {adamw_lr:.1e}       final validation loss {adamw_loss:.4f}")
    print(f"best Muon:  muon_lr {muon_lr:.1e}  final validation loss {muon_loss:.4f}")
    better = "Muon" if muon_loss < adamw_loss else "AdamW"
    print(f"lower: {better} (Muon - AdamW = {muon_loss - adamw_loss:+.4f})")
    rows = [[name, key, f"{lr:.1e}", f"{loss:.4f}", f"{loss - adamw_loss:+.4f}", "best" if lr == best else ""]
            for name, key, runs, best in (("AdamW", "optim.lr", adamw_runs, adamw_lr),
                                          ("Muon", "optim.muon_lr", muon_runs, muon_lr))
            for loss, lr in runs]
    print(markdown_table(["optimizer", "swept", "learning rate", "final validation loss",
                          "minus the best AdamW's", "best of its sweep"], rows))


if __name__ == "__main__":
    main(sys.argv[1:])
