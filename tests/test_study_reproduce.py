"""A committed study cell runs again from its stored config (`configs/NAME.toml` of the study
directory) and gives its recorded losses and gradient norms.

A v2 cell (docs/studies/norm_placement_v2, run from one clean commit of this code) must match bit
for bit: training on one CPU process is deterministic, and the stored config pins every setting.
It does so on the data it trained on: the default corpus this interpreter builds, checked against
the sha256s the study's summary recorded (another Python's standard library builds another corpus:
the test says so and skips). The v1 cells (docs/studies/norm_placement) trained in the removed
sample order 1 and cannot run again; their records stay as v1's report.

The runs train only the first iterations in process (`Trainer.start` and `train_one_iteration`),
without validation or checkpoints, which change nothing the steps compute.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from trinity_train.config import load_config
from trinity_train.records import RecordKind
from trinity_train.rundir import RunDir
from trinity_train.study.layout import StudyDir
from trinity_train.train import Trainer

ROOT = Path(__file__).resolve().parents[1]
V2 = ROOT / "docs" / "studies" / "norm_placement_v2"
ITERATIONS = 4


def committed_cell() -> tuple[StudyDir, str]:
    """(study directory, cell): the first finished, undrilled cell of the committed v2 study."""
    summary = json.loads((V2 / "summary.json").read_text())
    return StudyDir(V2), next(c["name"] for c in summary["cells"] if c["status"] == "finished" and not c["drilled"])


def train_from_stored_config(study: StudyDir, name: str, run_dir: Path) -> list[tuple[int, float, float]]:
    cfg = load_config(study.cell_config(name), {"run": {"dir": str(run_dir)}, "checkpoint": {"every": 0},
                                               "eval": {"every": 0}, "metrics": {"progress_bar": False}})
    trainer = Trainer(cfg)
    trainer.start()
    for _ in range(ITERATIONS):
        trainer.train_one_iteration()
    trainer.finish()
    return signals(RunDir(run_dir))


def signals(run: RunDir) -> list[tuple[int, float, float]]:
    return [(r["iter"], r["loss"], r["grad_norm"]) for r in run.read_metrics(RecordKind.TRAIN)][:ITERATIONS]


def other_data_than_recorded(study: StudyDir, name: str) -> str | None:
    """Why this machine's data differs from what the committed cells trained on (their summary's
    provenance: the sha256 of each dataset's manifest and tokenizer), or None when it is the same.
    The default corpus is built from the running interpreter's standard library, so another
    Python builds another one; this machine (and CI on it) builds the recorded one."""
    from trinity_train.study.provenance import data_hashes

    summary = json.loads((study.path / "summary.json").read_text())
    recorded = [{k: d[k] for k in ("manifest_sha256", "tokenizer_sha256")} for d in summary["provenance"]["data"]]
    cfg = load_config(study.cell_config(name), {})
    from trinity_train.data.default_corpus import default_dataset

    default_dataset(cfg.data, progress=False)  # built here if missing, as the cell's run would
    here = [{k: d[k] for k in ("manifest_sha256", "tokenizer_sha256")} for d in data_hashes(cfg)]
    return None if here == recorded else f"recorded {recorded}, here {here}"


def test_a_committed_cell_runs_again_from_its_stored_config(tmp_path):
    study, name = committed_cell()
    differs = other_data_than_recorded(study, name)
    if differs is not None:
        pytest.skip(f"this machine's default corpus is not the one the committed cells trained on ({differs}): "
                    "another Python's standard library builds another corpus")
    recorded = signals(study.cell(name))
    assert len(recorded) == ITERATIONS
    assert train_from_stored_config(study, name, tmp_path / "again") == recorded
