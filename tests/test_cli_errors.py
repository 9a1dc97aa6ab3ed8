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
    # Numbers that cannot work (reliability v4): each used to train, then fail far from the config.
    (["--train.grad_clip=inf"], ["train.grad_clip: must be a finite number, got inf (0 turns clipping off)"]),
    (["--watchdog.first_s=inf"], ["watchdog.first_s: must be a finite number, got inf", "0 gives"]),
    (["--model.bias_update_rate=nan"], ["model.bias_update_rate: must be a finite number, got nan"]),
    (["--model.rope_theta=nan"], ["model.rope_theta: must be a finite number, got nan"]),
    (["--model.rope_theta=0"], ["model.rope_theta: a RoPE base must be positive, got 0.0"]),
    (["--optim.eps=nan"], ["optim.eps: must be a finite number, got nan"]),
    (["--optim.weight_decay=inf"], ["optim.weight_decay: must be a finite number, got inf"]),
    (["--model.route_scale=inf"], ["model.route_scale: must be a finite number, got inf"]),
    (["--model.init_std=inf"], ["model.init_std: must be a finite number, got inf"]),
    # A layout one process cannot give is refused as under torchrun, not trained as one rank.
    (["--parallel.dp_shard=2"], ["dp_shard=2", "but 1 processes were started", "start 2 processes"]),
    (["--parallel.dp_replicate=2"], ["1 ranks cannot be split into dp_replicate=2"]),
    (["--parallel.tp=2"], ["1 ranks cannot be split into dp_replicate=1 x tp=2"]),
    (["--parallel.ep=2"], ["parallel.ep: ep=2 must divide the expert-data-parallel size dp_shard=1"]),
])
def test_bad_configuration_exits_2_before_any_work(tmp_path, monkeypatch, capsys, args, fragments):
    monkeypatch.chdir(tmp_path)
    assert_one_line_error(*cli_in_process(capsys, "train", "--run.dir=run", *args), 2, *fragments)
    assert not (tmp_path / "run").exists()


def test_a_config_that_is_not_text_is_refused_in_one_line(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "__0_0.distcp").write_bytes(bytes(range(256)) * 8)  # a checkpoint shard given by mistake
    assert_one_line_error(*cli_in_process(capsys, "train", "--config", "__0_0.distcp"), 2,
                          "config file '__0_0.distcp' is not UTF-8 text")


def test_the_home_directory_of_a_run_dir_is_expanded(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    (tmp_path / "home").mkdir()
    (tmp_path / "home" / "taken").write_text("x")  # so that the run is refused before it trains
    assert_one_line_error(*cli_in_process(capsys, "train", "--run.dir=~/taken"), 2,
                          f"run.dir: '{tmp_path / 'home' / 'taken'}' is a file")
    assert not (tmp_path / "~").exists()


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
