"""`trinity-train ablate` end to end through the console script: a two-variant, one-seed study of
a few steps on the tiny corpus, one of its cells drilled to diverge. The report has one row per
cell with its values and every plot, the diverged cell is recorded as such while the study goes
on, and a second invocation runs nothing again."""

from __future__ import annotations

import json

import pytest
from PIL import Image

from study_files import DIVERGING, STEPS, ablate, write_base, write_study
from trinity_train.rundir import RunDir
from trinity_train.stability import HALT_EXIT_CODE
from trinity_train.study import runner
from trinity_train.study.table import PLOTS
from trinity_train.records import EventName, RecordKind


def run_starts(out) -> dict[str, int]:
    return {cell.name: len(RunDir(cell).read_events(EventName.RUN_START)) for cell in sorted((out / "cells").iterdir())}


@pytest.fixture(scope="module")
def study_run(corpus, tmp_path_factory):
    """The study, run once (the drilled cell first, so the study must go on past it)."""
    folder = tmp_path_factory.mktemp("study")
    write_base(corpus, folder)
    study = write_study(folder, drills=[{"variant": "sandwich", "stability": DIVERGING}])
    out = folder / "out"
    first = ablate("--study", study, "--out", out, cwd=folder)
    return folder, study, out, first


@pytest.mark.slow  # the study end to end, cells in subprocesses
def test_the_study_runs_every_cell_and_records_the_diverged_one(study_run):
    _, _, out, first = study_run
    assert first.returncode == 0, first.stdout + first.stderr
    summary = json.loads((out / "summary.json").read_text())
    cells = {c["name"]: c for c in summary["cells"]}
    assert list(cells) == ["sandwich-normal-s0", "prenorm-normal-s0"]

    diverged, finished = cells["sandwich-normal-s0"], cells["prenorm-normal-s0"]
    assert diverged["status"] == "diverged" and diverged["drilled"]
    assert diverged["exit_code"] == HALT_EXIT_CODE and "stability.max_consecutive_skips" in diverged["reason"]
    assert diverged["headline"]["nonfinite_steps"] >= 1 and diverged["headline"]["val_loss_100"] is None
    assert diverged["measures"]["halt"]["iter"] == 4  # the drill's second NaN in a row
    assert finished["status"] == "finished" and finished["exit_code"] == 0 and not finished["drilled"]
    assert finished["last_step"] == STEPS and finished["headline"]["skipped_steps"] == 0
    assert 0 < finished["headline"]["val_loss_100"] < 7 and finished["headline"]["tokens_per_s"] > 0
    assert [p["step"] for p in finished["measures"]["val"]] == [0, 3, 6]
    assert summary["status"] == {"diverged": 1, "finished": 1}
    assert len(summary["study"]["config_hash"]) == 64
    # the code each cell ran, and what the numbers depend on besides the config
    provenance = summary["provenance"]
    assert provenance["allow_dirty"] is True and provenance["config_hash"] == summary["study"]["config_hash"]
    assert {"commit", "dirty", "python", "torch", "numpy", "cpu_model", "cpu_count", "data"} <= provenance.keys()
    assert all(c["commits"] == [provenance["commit"]] and len(c["config_sha256"]) == 64 for c in cells.values())
    # a done cell keeps no checkpoints (the report needs only its metrics)
    assert not RunDir(out / "cells" / "prenorm-normal-s0").checkpoints.exists()
    assert "[1/2] sandwich-normal-s0: diverged" in first.stdout and "[2/2] prenorm-normal-s0: finished" in first.stdout


@pytest.mark.slow  # the study end to end, cells in subprocesses
def test_the_report_has_one_row_per_cell_the_plots_and_the_html(study_run):
    _, study, out, _ = study_run
    report = (out / "report.md").read_text()
    summary = json.loads((out / "summary.json").read_text())
    assert f"`trinity-train ablate --study {study} --out {out} --allow-dirty`" in report
    assert "- Code: commit `" in report and "(run with --allow-dirty)" in report
    assert summary["study"]["config_hash"] in report and "Wall time:" in report
    finished = next(c for c in summary["cells"] if c["name"] == "prenorm-normal-s0")
    rows = [line for line in report.splitlines() if line.startswith("| prenorm-normal-s0 |")]
    assert len(rows) == 2  # the loss-and-stability table and the depth-and-cost table
    assert f"| {finished['headline']['val_loss_100']:.3f} |" in rows[0] and rows[0].count("| finished |") == 1
    assert any(line.startswith("| sandwich-normal-s0 | diverged at step") and "(drill)" in line
               for line in report.splitlines())
    group_rows = [line for line in report.splitlines() if line.startswith("| prenorm | normal | 1 finished |")]
    assert len(group_rows) == 2
    for name, _ in PLOTS:
        with Image.open(out / "plots" / f"{name}.png") as image:
            image.verify()  # a PNG that decodes
        assert f"(plots/{name}.png)" in report
    html = (out / "report.html").read_text()
    assert "TRINITY_SNAPSHOT" in html and "prenorm-normal-s0" in html


@pytest.mark.slow  # the study end to end, cells in subprocesses
def test_a_second_invocation_runs_nothing_again(study_run):
    folder, study, out, _ = study_run
    before = run_starts(out)
    assert before == {"prenorm-normal-s0": 1, "sandwich-normal-s0": 1}
    again = ablate("--study", study, "--out", out, cwd=folder)
    assert again.returncode == 0, again.stderr
    assert run_starts(out) == before
    assert again.stdout.count("before, not run again") == 2 and "training" not in again.stdout
    state = json.loads((out / "study_state.json").read_text())
    assert [c["attempts"] for c in state["cells"].values()] == [1, 1]
    assert len(state["invocations"]) == 2


@pytest.mark.slow  # the study end to end, cells in subprocesses
def test_a_changed_study_is_refused_before_anything_runs(study_run, tmp_path):
    folder, _, out, _ = study_run
    before = run_starts(out)
    changed = write_study(tmp_path, base=str(folder / "base.toml"), drills=[{"variant": "sandwich", "stability": DIVERGING}],
                          lrs=[{"name": "normal", "lr": 1e-2, "muon_lr": 1.5e-2}])
    result = ablate("--study", changed, "--out", out, cwd=folder)
    assert result.returncode == 2, result.stderr
    assert result.stderr.startswith("error: ") and len(result.stderr.strip().splitlines()) == 1
    assert "holds a run of another config (optim.lr: 0.003 -> 0.01)" in result.stderr
    assert run_starts(out) == before


def test_the_runner_knows_the_trainers_halt_exit_code():
    assert runner.HALT_EXIT_CODE == HALT_EXIT_CODE


@pytest.mark.slow
def test_cells_as_torchrun_jobs_train_on_the_same_batches(corpus, tmp_path):
    """--nproc 2: each cell is its own two-rank job (launch/local.sh 2), each rank taking half of
    every batch, and it computes what the one-process cell computes."""
    write_base(corpus, tmp_path)
    study = write_study(tmp_path, variants=["prenorm"])
    for out, nproc in (("one", 1), ("two", 2)):
        result = ablate("--study", study, "--out", tmp_path / out, "--nproc", nproc, cwd=tmp_path)
        assert result.returncode == 0, result.stdout + result.stderr
    one, two = (RunDir(tmp_path / out / "cells" / "prenorm-normal-s0") for out in ("one", "two"))
    assert [e["devices"] for e in two.read_events(EventName.RUN_START)] == [2]
    train_one, train_two = one.read_metrics(RecordKind.TRAIN), two.read_metrics(RecordKind.TRAIN)
    assert [r["batch"] for r in train_two] == [r["batch"] for r in train_one] and len(train_one) == STEPS
    assert [r["loss"] for r in train_two] == pytest.approx([r["loss"] for r in train_one], rel=1e-5)
    summary = json.loads((tmp_path / "two" / "summary.json").read_text())
    assert summary["run"]["nproc"] == 2 and summary["study"]["budget"]["global_batch"] == 2
    assert "--nproc 2" in (tmp_path / "two" / "report.md").read_text()


@pytest.mark.slow  # the study end to end, cells in subprocesses
def test_a_failed_cell_is_reported_and_run_again_next_time(corpus, tmp_path):
    """A cell that crashes (here: its data is missing) is not a divergence: the report is written,
    the command exits 1 naming it, and the next invocation tries it again."""
    write_base(corpus, tmp_path, data={"path": str(tmp_path / "no-such-data")})
    study, out = write_study(tmp_path, variants=["prenorm"]), tmp_path / "out"
    for attempt in (1, 2):
        result = ablate("--study", study, "--out", out, cwd=tmp_path)
        assert result.returncode == 1, result.stdout + result.stderr
        assert result.stderr.strip().splitlines() == [
            f"error: 1 of 1 cells failed (prenorm-normal-s0); their consoles are in {out / 'logs'}; run the same "
            "command again to retry them"]
        cell = json.loads((out / "summary.json").read_text())["cells"][0]
        assert cell["status"] == "failed" and cell["exit_code"] == 1 and cell["attempts"] == attempt
        assert cell["reason"].startswith("exit code 1: error: ") and "no-such-data" in cell["reason"]
    assert "failed" in (out / "report.md").read_text()
