"""A start continues the run the user chose: a resume from an earlier checkpoint (or a fresh start)
moves the run's later checkpoints into `checkpoints/abandoned/`, so that `resume = auto` and every
torchrun restart continue it, not the future it left behind; retention counts and deletes only
sound checkpoints, so it never removes the newest one a resume can load."""

import json
import shutil
from pathlib import Path

import pytest
import torch

from conftest import ONE_THREAD_ENV, run_config, run_python
from helpers import StopAfterStep, flip_byte, stop_after
from trinity_train.checkpoint import load_model_checkpoint
from trinity_train.checkpoint.integrity import check_integrity
from trinity_train.config import save_config
from trinity_train.records import EventName
from trinity_train.rundir import RunDir
from trinity_train.train import train

HERE = Path(__file__).parent
NEW_LR = 1e-3  # the resumed run's: its weights differ from the abandoned run's from the first step on


def config(corpus, run_dir, **sections):
    """12 steps, a checkpoint every 4 (4, 8, 12), no validation; `sections` override."""
    base = {"train": {"steps": 12, "micro_batch_size": 2}, "eval": {"every": 0},
            "optim": {"warmup_steps": 2}, "checkpoint": {"every": 4, "keep": 5}}
    for section, values in sections.items():
        base[section] = {**base.get(section, {}), **values}
    return run_config(corpus, run_dir, **base)


@pytest.fixture(scope="module")
def finished(corpus, tmp_path_factory):
    """A run that reached step 12 (checkpoints 4, 8, 12); each test works on a copy."""
    run_dir = tmp_path_factory.mktemp("finished") / "run"
    train(config(corpus, run_dir))
    return run_dir


@pytest.fixture
def run_dir(corpus, finished, tmp_path):
    run_dir = tmp_path / "run"
    shutil.copytree(finished, run_dir)
    save_config(config(corpus, run_dir), RunDir(run_dir).config)  # as if trained here
    return run_dir


def weights(checkpoint):
    return load_model_checkpoint(checkpoint)[0].state_dict()


def names(directory):
    return sorted(p.name for p in directory.iterdir())


def test_a_resume_from_an_earlier_checkpoint_abandons_the_later_ones(corpus, finished, run_dir, tmp_path):
    checkpoints = RunDir(run_dir).checkpoints
    with pytest.raises(StopAfterStep):  # the chosen run crashes right after its step-8 checkpoint
        train(config(corpus, run_dir, optim={"lr": NEW_LR}, checkpoint={"resume": str(checkpoints / "step_00000004")}),
              callbacks=[stop_after(8)])
    (abandoned,) = RunDir(run_dir).read_events(EventName.CHECKPOINTS_ABANDONED)
    assert abandoned["step"] == 4 and [p.rsplit("/", 1)[-1] for p in abandoned["checkpoints"]] == \
        ["step_00000008", "step_00000012"]
    assert names(checkpoints / "abandoned") == ["step_00000008", "step_00000012"]

    summary = train(config(corpus, run_dir, optim={"lr": NEW_LR}, checkpoint={"resume": "auto"}))
    assert (summary.start_step, summary.step) == (8, 12)  # the chosen run's step 8, not the old step 12

    reference = tmp_path / "reference"  # the chosen run, never interrupted
    train(config(corpus, reference, optim={"lr": NEW_LR},
                 checkpoint={"resume": str(RunDir(finished).checkpoints / "step_00000004")}))
    got, want = weights(checkpoints / "step_00000012"), weights(RunDir(reference).checkpoints / "step_00000012")
    old = weights(checkpoints / "abandoned" / "step_00000012")
    assert all(torch.equal(got[k], want[k]) for k in want)
    assert not all(torch.equal(got[k], old[k]) for k in old)
    for path in [*checkpoints.glob("step_*"), *(checkpoints / "abandoned").iterdir()]:
        check_integrity(path)  # nothing sound was deleted or broken on the way


def test_retention_never_deletes_the_newest_sound_checkpoint(corpus, run_dir):
    checkpoints = RunDir(run_dir).checkpoints
    flip_byte(next((checkpoints / "step_00000012").glob("*.distcp")), 100)
    summary = train(config(corpus, run_dir, train={"steps": 10}, stability={"rollback_after": 0},
                           checkpoint={"keep": 1, "resume": "auto"}))
    assert (summary.start_step, summary.step) == (8, 10)
    # auto passed over the damaged step 12 and moved it aside; keep=1 kept the sound step 10
    assert names(checkpoints) == ["abandoned", "step_00000010"]
    assert names(checkpoints / "abandoned") == ["step_00000012"]
    check_integrity(checkpoints / "step_00000010")
    again = train(config(corpus, run_dir, train={"steps": 10}, checkpoint={"keep": 1, "resume": "auto"}))
    assert again.start_step == 10


def test_a_fresh_start_abandons_every_checkpoint_of_the_run_before_it(corpus, run_dir):
    with pytest.raises(StopAfterStep):
        train(config(corpus, run_dir), callbacks=[stop_after(1)])  # resume = none: the same run, from scratch
    checkpoints = RunDir(run_dir).checkpoints
    assert names(checkpoints) == ["abandoned"]
    assert names(checkpoints / "abandoned") == ["step_00000004", "step_00000008", "step_00000012"]
    (abandoned,) = RunDir(run_dir).read_events(EventName.CHECKPOINTS_ABANDONED)
    assert abandoned["step"] == 0 and len(abandoned["moved_to"]) == 3


@pytest.mark.slow
def test_a_torchrun_restart_after_a_resume_from_an_earlier_checkpoint_continues_it(corpus, run_dir, tmp_path):
    # Two gloo ranks resume step 4 with another lr; rank 1 is killed after the step-8 checkpoint,
    # torchrun restarts both, and the restart (which forces `auto`) must load that new step 8.
    config_file = tmp_path / "two_ranks.toml"
    save_config(config(corpus, run_dir, optim={"lr": NEW_LR}, parallel={"collective_timeout_s": 120},
                       checkpoint={"resume": str(RunDir(run_dir).checkpoints / "step_00000004")}), config_file)
    done = run_python("-m", "torch.distributed.run", "--standalone", "--nnodes=1", "--nproc-per-node=2",
                      "--max-restarts=1", HERE / "rank_dies.py", 1, 8, "train", "--config", config_file,
                      env={**ONE_THREAD_ENV, "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}, timeout=900)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    run = RunDir(run_dir)
    assert [Path(e["checkpoint"]).name for e in run.read_events(EventName.RESUME)][-2:] == \
        ["step_00000004", "step_00000008"]
    assert run.read_events(EventName.RUN_END)[-1]["step"] == 12
    resumed_meta = json.loads((run.checkpoints / "step_00000008" / "meta.json").read_text())
    assert resumed_meta["config"]["optim"]["lr"] == NEW_LR  # the chosen run's, not the abandoned one's
    assert names(run.checkpoints / "abandoned") == ["step_00000008", "step_00000012"]
    got, old = weights(run.checkpoints / "step_00000012"), weights(run.checkpoints / "abandoned" / "step_00000012")
    assert not all(torch.equal(got[k], old[k]) for k in old)
