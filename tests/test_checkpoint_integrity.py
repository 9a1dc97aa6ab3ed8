"""Checkpoints prove their integrity: every file's checksum in meta.json, `check_integrity` and
`ckpt verify` (`--deep`: every tensor finite), and resumes that pass over a damaged checkpoint to
the newest sound one, or refuse a damaged named one while naming the alternative."""

import json
import shutil
import struct

import pytest
from torch.distributed.checkpoint import FileSystemReader

from conftest import run_config
from helpers import flip_byte
from trinity_train.checkpoint import verify_checkpoint
from trinity_train.checkpoint.integrity import CHECKSUM, check_integrity, find_sound_checkpoint
from trinity_train.errors import CheckpointError
from trinity_train.rundir import RunDir
from trinity_train.train import Trainer
from trinity_train.records import EventName, RecordKind


def config(corpus, run_dir, steps=6, **checkpoint):
    return run_config(corpus, run_dir, train={"steps": steps, "micro_batch_size": 2}, eval={"every": 0},
                      checkpoint={"every": 2, "keep": 5, **checkpoint})


@pytest.fixture(scope="module")
def trained(corpus, tmp_path_factory):
    """A finished 6-step run with checkpoints at steps 2, 4 and 6; tests damage copies of it."""
    run = tmp_path_factory.mktemp("trained") / "run"
    Trainer(config(corpus, run)).run()
    return run


@pytest.fixture
def run(trained, tmp_path):
    copy = tmp_path / "run"
    shutil.copytree(trained, copy)
    return copy


def ckpt(run, step):
    return RunDir(run).checkpoints / f"step_{step:08d}"


def shard(path):
    return next(path.glob("*.distcp"))


def tensor_location(path, fqn):
    """(file, offset, length) of a tensor's bytes in a DCP checkpoint."""
    md = FileSystemReader(str(path)).read_metadata()
    (info,) = [info for index, info in md.storage_data.items() if index.fqn == fqn]
    return path / info.relative_path, info.offset, info.length


def test_every_file_is_checksummed_in_meta_json(run):
    meta = json.loads((ckpt(run, 6) / "meta.json").read_text())
    files = {p.name for p in ckpt(run, 6).iterdir() if p.name != "meta.json"}
    assert set(meta["files"]) == files and ".metadata" in files
    assert all(set(record) == {"bytes", CHECKSUM} for record in meta["files"].values())
    check_integrity(ckpt(run, 6))
    check_integrity(ckpt(run, 6), deep=True)


def test_a_flipped_byte_in_optimizer_state_fails_verification(run):
    # The byte the fault-injection pass flipped: inside an optimizer moment, which still loads.
    file, offset, length = tensor_location(ckpt(run, 6), "optim.state.lm_head.weight.exp_avg_sq")
    flip_byte(file, offset + length // 2)
    with pytest.raises(CheckpointError, match=f"damaged: '{file.name}' does not match its {CHECKSUM}"):
        verify_checkpoint(ckpt(run, 6))
    with pytest.raises(CheckpointError, match="damaged"):
        check_integrity(ckpt(run, 6))


def test_a_weight_edited_in_the_file_fails_verification(run):
    file, offset, _ = tensor_location(ckpt(run, 6), "model.norm.weight")
    data = bytearray(file.read_bytes())
    data[offset:offset + 4] = struct.pack("<f", 1e30)  # finite, so only the checksum can tell
    file.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="does not match its"):
        verify_checkpoint(ckpt(run, 6))


def test_deep_verification_finds_non_finite_optimizer_state(corpus, tmp_path):
    trainer = Trainer(config(corpus, tmp_path / "run", steps=2))
    trainer.run()
    state = trainer.optimizer.state[trainer.model.lm_head.weight]
    state["exp_avg_sq"][0, 0] = float("nan")  # a bad value written faithfully: checksums match
    path = trainer.checkpoints.save(2, trainer.checkpoint_state(), trainer.cfg)
    verify_checkpoint(path)  # the model is finite
    with pytest.raises(CheckpointError, match="non-finite values in 1 optim tensor.*exp_avg_sq"):
        verify_checkpoint(path, deep=True)
    with pytest.raises(CheckpointError, match="non-finite"):
        check_integrity(path, deep=True)


def truncate_shard(path):
    file = shard(path)
    file.write_bytes(file.read_bytes()[:-64])


def garble_metadata(path):
    (path / ".metadata").write_bytes(b"\x80\x04garbage")


def drop_config(path):
    meta = json.loads((path / "meta.json").read_text())
    del meta["config"]
    (path / "meta.json").write_text(json.dumps(meta))


@pytest.mark.parametrize("damage, reason", [(truncate_shard, "truncated"), (garble_metadata, "'.metadata'"),
                                            (drop_config, "has no config")])
def test_resume_auto_passes_over_a_damaged_newest_checkpoint(corpus, run, damage, reason, capsys):
    damage(ckpt(run, 6))
    trainer = Trainer(config(corpus, run, steps=8, resume="auto"))
    assert trainer.resume_from == ckpt(run, 4)
    trainer.run()
    passed = RunDir(run).read_events(EventName.CHECKPOINT_PASSED_OVER)
    assert [e["path"] for e in passed] == [str(ckpt(run, 6))] and reason in passed[0]["reason"]
    warned = [line for line in capsys.readouterr().err.splitlines() if line.startswith("warning: passed over")]
    assert len(warned) == 1 and str(ckpt(run, 6)) in warned[0] and reason in warned[0] and str(ckpt(run, 4)) in warned[0]
    assert RunDir(run).read_events(EventName.RESUME)[-1]["checkpoint"] == str(ckpt(run, 4))
    assert [r["step"] for r in RunDir(run).read_metrics(RecordKind.TRAIN)][-4:] == [5, 6, 7, 8]


def test_a_damaged_named_checkpoint_is_refused_naming_the_newest_sound_one(corpus, run):
    truncate_shard(ckpt(run, 4))
    truncate_shard(ckpt(run, 6))
    with pytest.raises(CheckpointError) as refused:
        Trainer(config(corpus, run, steps=8, resume=str(ckpt(run, 6))))
    message = str(refused.value)
    assert "truncated" in message and f"--checkpoint.resume={ckpt(run, 2)}" in message


def test_resume_auto_refuses_when_every_checkpoint_is_damaged(corpus, run):
    for step in (2, 4, 6):
        garble_metadata(ckpt(run, step))
    with pytest.raises(CheckpointError, match="all 3 are damaged"):
        Trainer(config(corpus, run, steps=8, resume="auto"))


def test_find_sound_checkpoint_honours_max_step_and_reports_what_it_passed_over(run):
    truncate_shard(ckpt(run, 4))
    (ckpt(run, 2) / "meta.json").unlink()  # a directory that never finished
    seen = []
    found = find_sound_checkpoint(RunDir(run).checkpoints, on_passed_over=lambda p, why: seen.append((p, why)))
    assert found == ckpt(run, 6) and seen == []
    assert find_sound_checkpoint(RunDir(run).checkpoints, max_step=5,
                                 on_passed_over=lambda p, why: seen.append((p, why))) is None
    assert [p for p, _ in seen] == [ckpt(run, 4), ckpt(run, 2)]
    assert "truncated" in seen[0][1] and "meta.json" in seen[1][1]
    assert find_sound_checkpoint(run / "nowhere") is None
