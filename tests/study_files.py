"""Study files written by the study tests: a base config training the conftest run model on the
tiny corpus, and a study over it."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import tomli_w

from conftest import RUN_MODEL, cli_in_process, run_cli

STEPS, MICRO_BATCH, SEQ_LEN = 6, 2, 16
TOKENS = STEPS * MICRO_BATCH * SEQ_LEN
DIVERGING = {"inject": [{"fault": "nan_loss", "first": 3, "last": 100}], "max_consecutive_skips": 2,
             "rollback_after": 0}


def write_base(corpus: Path, folder: Path, **sections: dict) -> Path:
    """A base config of a few steps on `corpus`; `sections` override its tables."""
    table = {
        "model": dict(RUN_MODEL),
        "data": {"path": str(corpus), "seq_len": SEQ_LEN},
        "train": {"steps": STEPS, "micro_batch_size": MICRO_BATCH}, "eval": {"every": 3, "batches": 1},
        "optim": {"warmup_steps": 2},
        "checkpoint": {"every": 3},
        "metrics": {"progress_bar": False, "peak_flops": 1e11},
    }
    for section, values in sections.items():
        table[section] = {**table.get(section, {}), **values}
    path = folder / "base.toml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(tomli_w.dumps(table))
    return path


def write_study(folder: Path, **keys) -> Path:
    """A study of `base.toml` beside it: two variants, one seed, one learning rate, unless `keys`
    say otherwise (a key given as None is left out)."""
    table = {"name": "tiny", "base": "base.toml", "variants": ["sandwich", "prenorm"], "seeds": [0],
             "tokens": TOKENS, "lrs": [{"name": "normal", "lr": 3e-3, "muon_lr": 1.5e-2}]}
    table.update(keys)
    path = folder / "study.toml"
    path.write_text(tomli_w.dumps({k: v for k, v in table.items() if v is not None}))
    return path


def ablate_refused(capsys, monkeypatch, *args, cwd: Path) -> SimpleNamespace:
    """`trinity-train ablate ARGS --allow-dirty` in this process (`cli_in_process`), for what it
    refuses before any cell runs: its exit code and stderr."""
    monkeypatch.chdir(cwd)
    capsys.readouterr()
    code, err = cli_in_process(capsys, "ablate", *args, "--allow-dirty")
    return SimpleNamespace(returncode=code, stderr=err)


def ablate(*args, cwd: Path, allow_dirty: bool = True):
    """`trinity-train ablate ARGS` in a fresh process; with `allow_dirty` (the default: the tests
    run on whatever checkout they are in, committed or not) `--allow-dirty` too."""
    return run_cli("ablate", *args, *(["--allow-dirty"] if allow_dirty else []), cwd=cwd)
