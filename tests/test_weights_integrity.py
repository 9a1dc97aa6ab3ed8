"""Every reader of a checkpoint's weights checks it first (`checkpoint.integrity.require_sound`):
`export-hf`, `--checkpoint.init_from`, `ckpt inspect`, a resume and a rollback refuse a
checkpoint with one flipped byte, naming the file, and write nothing. A verdict reached by hashing
is not hashed again while the files are unchanged (a resume checks, then loads)."""

from __future__ import annotations

import pytest

from conftest import assert_one_line_error, cli_in_process, run_config
from trinity_train.checkpoint import integrity, save_model_checkpoint
from trinity_train.checkpoint.integrity import require_sound
from trinity_train.errors import CheckpointError
from trinity_train.model import build_model


@pytest.fixture
def damaged(corpus, tmp_path):
    """A model checkpoint of the tests' run model with one byte flipped in its weights file."""
    cfg = run_config(corpus, tmp_path / "unused")
    path = save_model_checkpoint(build_model(cfg.model), cfg, tmp_path / "weights")
    (shard,) = path.glob("*.distcp")
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x01
    shard.write_bytes(bytes(data))
    return path, shard.name


def test_export_hf_refuses_a_damaged_checkpoint_naming_the_file(damaged, tmp_path, capsys):
    path, shard = damaged
    assert_one_line_error(*cli_in_process(capsys, "export-hf", path, tmp_path / "hf", "--no-tokenizer"), 1,
                          f"checkpoint '{path}' is damaged: '{shard}' does not match its xxh3_128 checksum")
    assert not (tmp_path / "hf").exists()


def test_ckpt_inspect_refuses_a_damaged_checkpoint(damaged, capsys):
    path, shard = damaged
    assert_one_line_error(*cli_in_process(capsys, "ckpt", "inspect", path), 1, f"'{shard}' does not match")


def test_init_from_a_damaged_checkpoint_is_refused_before_any_work(damaged, corpus, tmp_path, capsys):
    path, shard = damaged
    run_dir = tmp_path / "run"
    config = tmp_path / "run.toml"
    from trinity_train.config import save_config

    save_config(run_config(corpus, run_dir, train={"steps": 2}), config)
    assert_one_line_error(*cli_in_process(capsys, "train", "--config", config, f"--checkpoint.init_from={path}"), 1,
                          f"checkpoint '{path}' is damaged: '{shard}'")
    assert not run_dir.exists()


def test_a_verdict_is_reused_until_a_file_changes(damaged, monkeypatch):
    path, _ = damaged
    hashed = []
    real = integrity._check_integrity
    monkeypatch.setattr(integrity, "_check_integrity", lambda p, deep: hashed.append(p) or real(p, deep))
    for _ in range(2):
        with pytest.raises(CheckpointError, match="does not match"):
            require_sound(path)
    assert len(hashed) == 1  # the second refusal came from the remembered verdict
    (path / "meta.json").touch()  # a file changed: checked again
    with pytest.raises(CheckpointError):
        require_sound(path)
    assert len(hashed) == 2
