"""A study's provenance: summary.json names the code's commit and whether its tree was clean, the
interpreter, torch and numpy, the CPU and the data's hashes; `ablate` refuses a dirty tree unless
told (`--allow-dirty`, recorded), and refuses to mix cells of two commits or configs, each in one
line; a study committed before any of this (v1, docs/studies/norm_placement) still reads."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from conftest import assert_one_line_error
from study_files import write_base, write_study
from trinity_train import cli
from trinity_train.study import provenance as provenance_module
from trinity_train.study.cells import cell_hash, study_cells, study_hash
from trinity_train.study.command import check_cells_commit, check_code
from trinity_train.study.layout import StudyDir
from trinity_train.study.measure import measure_cell
from trinity_train.study.provenance import GitState, git_state
from trinity_train.study.report import build_summary, check_one_code
from trinity_train.study.spec import StudyError, load_study
from trinity_train.study.state import FINISHED, StudyState
from trinity_train.study.table import render_markdown

ROOT = Path(__file__).resolve().parents[1]
V1 = ROOT / "docs" / "studies" / "norm_placement"


def git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True, text=True).stdout


@pytest.fixture
def checkout(tmp_path, monkeypatch) -> Path:
    """A git checkout with one commit, standing in for the code's own."""
    repo = tmp_path / "code"
    repo.mkdir()
    git(repo, "init", "-q")
    (repo / "model.py").write_text("x = 1\n")
    git(repo, "add", ".")
    git(repo, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "one")
    monkeypatch.setattr(provenance_module, "CHECKOUT", repo)
    return repo


def test_a_dirty_tree_is_refused_in_one_line_unless_allowed(corpus, tmp_path, checkout, capsys):
    write_base(corpus, tmp_path)
    study = write_study(tmp_path)
    (checkout / "model.py").write_text("x = 2\n")
    code = cli.main(["ablate", "--study", str(study), "--out", str(tmp_path / "out")])
    assert_one_line_error(code, capsys.readouterr().err, 2, "uncommitted changes (M model.py)", "commit or stash",
                          "--allow-dirty")
    assert not (tmp_path / "out").exists()
    check_code(git_state(), allow_dirty=True)  # told: it runs, and summary.json says so
    git(checkout, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qam", "two")
    check_code(git_state(), allow_dirty=False)


def test_the_study_output_inside_the_checkout_is_not_a_change(checkout):
    out = checkout / "docs" / "studies" / "x"
    (out / "cells").mkdir(parents=True)
    (out / "cells" / "metrics.jsonl").write_text("{}\n")
    assert git_state(out).dirty is False and git_state().dirty is True
    assert git_state(out).commit == git(checkout, "rev-parse", "HEAD").strip()


def test_code_outside_a_checkout_is_refused_unless_allowed(tmp_path, monkeypatch):
    monkeypatch.setattr(provenance_module, "CHECKOUT", tmp_path)
    state = git_state()
    assert state.commit is None and state.dirty is None
    with pytest.raises(StudyError, match="does not run from a git checkout, so the report could not name its commit"):
        check_code(state, allow_dirty=False)
    check_code(state, allow_dirty=True)


def _done(out: StudyDir, state: StudyState, cell, commit: str, config_sha256: str | None = None) -> None:
    out.cell(cell.name).path.mkdir(parents=True, exist_ok=True)
    out.cell(cell.name).metrics.write_text("")
    state.attempt(cell.name, commit=commit, dirty=False, config_sha256=config_sha256 or cell_hash(cell))
    state.record(cell.name, FINISHED, exit_code=0, wall_s=1.0)


def test_cells_of_two_commits_or_another_config_are_refused(corpus, tmp_path):
    write_base(corpus, tmp_path)
    out = StudyDir(tmp_path / "out")
    cells = study_cells(load_study(write_study(tmp_path)), out)
    state = StudyState(out.path / "study_state.json")
    _done(out, state, cells[0], "a" * 40)
    check_one_code(cells, out, state)
    with pytest.raises(StudyError, match=r"sandwich-normal-s0 ran at commit aaaaaaaaaaaa but the code is at "
                                         r"bbbbbbbbbbbb now, and a report must come from one commit"):
        check_cells_commit(cells, out, state, GitState("b" * 40))
    _done(out, state, cells[1], "b" * 40)
    with pytest.raises(StudyError, match=r"the cells ran at 2 commits of the code \(aaaaaaaaaaaa: sandwich-normal-s0; "
                                         r"bbbbbbbbbbbb: prenorm-normal-s0\)"):
        check_one_code(cells, out, state)
    _done(out, state, cells[1], "a" * 40, config_sha256="c" * 64)
    state.cells[cells[1].name]["commits"] = ["a" * 40]
    with pytest.raises(StudyError, match="prenorm-normal-s0 ran with another config than the study's cell now"):
        check_one_code(cells, out, state)


def test_summary_json_carries_the_provenance(corpus, tmp_path, checkout):
    write_base(corpus, tmp_path)
    study = load_study(write_study(tmp_path))
    out = StudyDir(tmp_path / "out")
    cells = study_cells(study, out)
    run = {"command": "c", "started": 0.0, "wall_s": 1.0, "load_start": "0", "load_end": "0", "cpus": 2}
    summary = build_summary(study, cells, study_hash(cells), out, StudyState(out.path / "s.json"), run, 1,
                            git=git_state(out.path), allow_dirty=False)
    p = summary["provenance"]
    assert p["commit"] == git(checkout, "rev-parse", "HEAD").strip() and p["dirty"] is False
    assert p["allow_dirty"] is False and p["config_hash"] == study_hash(cells)
    assert p["python"].count(".") == 2 and p["torch"] and p["numpy"] and p["cpu_model"] and p["cpu_count"] >= 1
    assert p["data"] == [{"path": str(corpus), "manifest_sha256": provenance_module._sha256(corpus / "manifest.json"),
                          "tokenizer_sha256": provenance_module._sha256(corpus / "tokenizer.json")}]
    assert p["data"][0]["manifest_sha256"] and p["data"][0]["tokenizer_sha256"]
    text = render_markdown(json.loads(json.dumps(summary)))
    assert f"commit `{p['commit']}`, working tree clean" in text and f"torch {p['torch']}" in text


def test_a_study_committed_before_provenance_still_reads():
    state = StudyState(V1 / "study_state.json")
    record = state.cell("prenorm-normal-s0")
    assert record["status"] == FINISHED and record["commits"] == [] and record["config_sha256"] is None
    from trinity_train.config import load_stored_config
    measures = measure_cell(StudyDir(V1).cell("prenorm-normal-s0"), load_stored_config(V1 / "configs" / "prenorm-normal-s0.toml"))
    assert measures["val_loss_at"]["100%"]["val_loss"] == pytest.approx(6.449, abs=5e-4)  # its report's number
    assert measures["val_loss_at"]["50%"] is None  # v1 validated at step 40, not at 50 %
    assert measures["observed_spikes"] is None  # its guard acted
    summary = json.loads((V1 / "summary.json").read_text())
    assert "Provenance: not recorded" in render_markdown(summary)
