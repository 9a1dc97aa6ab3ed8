"""One mistake, one exit code, whichever command it is made in (docs/reference/exit-codes.md): an output
path that is a file, sits under a file or (for a new one) is not empty is a usage mistake (2) in
prepare-data, export-hf, import-hf, ablate and report; a RUN_DIR that is not a run directory is
one (2) in report, incidents and goodput; a dashboard --host that is not this machine's is one
(2), not a busy port. Nothing is written by a refused command."""

from __future__ import annotations

import pytest

from conftest import CONFIGS, assert_one_line_error, cli_in_process

OUT_COMMANDS = {
    "prepare-data": lambda out, tmp: ["prepare-data", "--input", tmp / "docs.txt", "--train-tokenizer", 300,
                                      "--out", out, "--no-progress"],
    "export-hf": lambda out, tmp: ["export-hf", tmp / "no-checkpoint", out],
    "import-hf": lambda out, tmp: ["import-hf", tmp / "no-hf-model", "--out", out],
    "ablate": lambda out, tmp: ["ablate", "--study", CONFIGS / "studies" / "norm_placement.toml", "--out", out,
                                "--allow-dirty"],
}


@pytest.fixture
def workdir(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "docs.txt").write_text("some words\n")
    (tmp_path / "afile").write_text("x")
    return tmp_path


def entries(tmp_path) -> set[str]:
    return {p.name for p in tmp_path.iterdir()}


@pytest.mark.parametrize("command", sorted(OUT_COMMANDS))
def test_an_output_that_is_a_file_is_a_usage_mistake_in_every_command(command, workdir, capsys):
    before = entries(workdir)
    for out, fragment in ((workdir / "afile", "afile' is a file"),
                          (workdir / "afile" / "sub", f"cannot be created: '{workdir / 'afile'}' is a file")):
        args = OUT_COMMANDS[command](out, workdir)
        assert_one_line_error(*cli_in_process(capsys, *args), 2, fragment)
    assert entries(workdir) == before


@pytest.mark.parametrize("command", ["export-hf", "import-hf"])
def test_a_new_output_directory_that_is_not_empty_is_a_usage_mistake(command, workdir, capsys):
    (workdir / "full").mkdir()
    (workdir / "full" / "x").write_text("x")
    args = OUT_COMMANDS[command](workdir / "full", workdir)
    assert_one_line_error(*cli_in_process(capsys, *args), 2, "full' is a directory that is not empty")


@pytest.mark.parametrize("command", ["report", "incidents", "goodput"])
def test_a_run_dir_that_is_not_a_run_is_a_usage_mistake_in_every_command(command, workdir, capsys):
    (workdir / "plain").mkdir()
    extra = ["--out", workdir / "r.html"] if command == "report" else []
    for path, fragment in (("plain", "plain' is not a run directory"), ("afile", "afile' is a file"),
                           ("nowhere", "nowhere' does not exist")):
        assert_one_line_error(*cli_in_process(capsys, command, workdir / path, *extra), 2,
                              fragment, "pass the run's directory")
    assert not (workdir / "r.html").exists()


def test_a_dashboard_host_that_is_not_this_machines_is_named_not_the_port(workdir, capsys):
    # "::2" is a numeric address (no name lookup) that no interface of this machine holds.
    code, err = cli_in_process(capsys, "dashboard", workdir, "--host", "::2", "--port", 0)
    assert code == 2 and err.strip().splitlines()[-1].startswith("error: --host ::2: not an address of this machine")
    assert "--port" not in err.strip().splitlines()[-1]


def test_home_is_expanded_in_output_paths(workdir, capsys, monkeypatch):
    monkeypatch.setenv("HOME", str(workdir))
    assert_one_line_error(*cli_in_process(capsys, "export-hf", workdir / "no-checkpoint", "~/afile"), 2,
                          f"'{workdir / 'afile'}' is a file")
    assert_one_line_error(*cli_in_process(capsys, "incidents", "~/plain-missing"), 2,
                          f"'{workdir / 'plain-missing'}' does not exist")
    assert not (workdir / "~").exists()
