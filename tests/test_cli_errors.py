"""User mistakes: one line `error: ...`, exit 2 for configuration, exit 1 for other user errors;
never a traceback. One mistake of each exit code goes through the real console script (a fresh
process, as a user runs it); the rest call the same `main` in this process."""

import os

import pytest

from conftest import assert_fails_in_one_line, assert_one_line_error, cli_in_process, run_cli
from trinity_train.config import load_config, save_config


def test_the_console_script_exits_2_for_a_configuration_mistake_before_any_work(tmp_path):
    result = run_cli("train", "--run.dir=run", "--train.stepz=5", cwd=tmp_path)
    assert_fails_in_one_line(result, 2, "unknown config key 'train.stepz'", "did you mean 'train.steps'")
    assert not (tmp_path / "run").exists()


def test_the_console_script_exits_1_for_a_missing_checkpoint(tmp_path):
    result = run_cli("train", "--run.dir=run", "--checkpoint.resume=gone/step_00000010", cwd=tmp_path)
    assert_fails_in_one_line(result, 1, "checkpoint 'gone/step_00000010' does not exist")


@pytest.mark.parametrize("args, fragments", [
    (["--model.num_heads=5"], ["model.num_heads", "not divisible by model.num_kv_heads=2"]),
    (["--model.num_experts_per_tok=16"], ["model.num_experts_per_tok", "exceeds model.num_experts=8"]),
    (["--model.sliding_window=-4"], ["model.sliding_window: must be positive"]),
    (["--train.micro_batch_size=eight"], ["train.micro_batch_size: expected int"]),
    (["--config", "no/such.toml"], ["config file 'no/such.toml' does not exist"]),
    (["--train.steps"], ["has no value"]),
])
def test_bad_configuration_exits_2_before_any_work(tmp_path, monkeypatch, capsys, args, fragments):
    monkeypatch.chdir(tmp_path)
    assert_one_line_error(*cli_in_process(capsys, "train", "--run.dir=run", *args), 2, *fragments)
    assert not (tmp_path / "run").exists()


def test_a_run_directory_holding_another_run_is_refused(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    save_config(load_config(None, ["--train.steps=10"]), tmp_path / "run" / "config.toml")
    assert_one_line_error(*cli_in_process(capsys, "train", "--run.dir=run", "--train.steps=20"), 2,
                          "run.dir: 'run' already holds a run with a different config", "train.steps: 10 -> 20",
                          "--checkpoint.resume=auto")


def test_missing_or_broken_checkpoints_exit_1(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert_one_line_error(*cli_in_process(capsys, "ckpt", "verify", "nowhere"), 1, "checkpoint 'nowhere' does not exist")
    (tmp_path / "half").mkdir()
    assert_one_line_error(*cli_in_process(capsys, "export-hf", "half", "out"), 1, "not a checkpoint directory")
    (tmp_path / "half" / "__0_0.distcp").write_bytes(b"")  # a save that stopped before its meta.json
    assert_one_line_error(*cli_in_process(capsys, "export-hf", "half", "out"), 1, "incomplete", "meta.json")
    assert_one_line_error(*cli_in_process(capsys, "import-hf", "nothing-here"), 1, "does not exist")


def test_openmp_threads_sleep_while_waiting_unless_the_user_chose(monkeypatch, tmp_path, capsys):
    from trinity_train import cli as cli_module

    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    assert cli_module.main(["ckpt", "verify", "nowhere"]) == 1
    assert "does not exist" in capsys.readouterr().err
    assert os.environ["OMP_WAIT_POLICY"] == "PASSIVE"
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")
    cli_module.main(["ckpt", "verify", "nowhere"])
    assert os.environ["OMP_WAIT_POLICY"] == "ACTIVE"
