"""An asynchronous checkpoint is committed as soon as its write finishes (polled every step), its
`checkpoint` event is written then and points at a directory that exists, and a crash loses at
most the steps since it."""

from concurrent.futures import Future

import pytest

from conftest import run_config
from trinity_train.callbacks import TrainerCallback
from trinity_train.checkpoint import dcp_io
from trinity_train.checkpoint.layout import list_checkpoints
from trinity_train.rundir import RunDir
from trinity_train.train import Trainer
from trinity_train.records import EventName


class Crash(Exception):
    pass


def config(corpus, run_dir, **checkpoint):
    return run_config(corpus, run_dir, train={"steps": 6, "micro_batch_size": 2}, eval={"every": 0},
                      checkpoint={"every": 2, "keep": 5, "async_save": True, **checkpoint})


def written_at_once(state, path, *args, **kwargs) -> Future:
    """An asynchronous save whose background write has finished by the time it returns."""
    dcp_io.save(state, path)
    done: Future = Future()
    done.set_result(None)
    return done


def test_an_async_save_is_committed_at_the_first_step_after_its_write(corpus, tmp_path, monkeypatch):
    monkeypatch.setattr(dcp_io, "async_save", written_at_once)
    run = RunDir(tmp_path / "run")
    seen = {}  # step -> (complete checkpoints, checkpoint events) once that step was trained

    class CrashInStep4(TrainerCallback):
        def before_step(self, trainer, batch):
            if trainer.state.step == 3:
                raise Crash()  # the process dies while training step 4

        def after_iteration(self, trainer):
            seen[trainer.state.step] = ([s for s, _ in list_checkpoints(run.checkpoints)],
                                        [e["step"] for e in run.read_events(EventName.CHECKPOINT)])

    trainer = Trainer(config(corpus, run.path), callbacks=[CrashInStep4()])
    with pytest.raises(Crash):
        trainer.run()
    # The step-2 save is complete and logged once step 3 has been trained (it used to be renamed
    # into place only when the step-4 save started).
    assert seen[2] == ([], []) and seen[3] == ([2], [2])
    for event in run.read_events(EventName.CHECKPOINT):
        assert (run.checkpoints / f"step_{event['step']:08d}").is_dir()
    # The crash in step 4 lost step 3 only: the resume starts from step 2.
    assert Trainer(config(corpus, run.path, resume="auto")).resume_from == run.checkpoints / "step_00000002"
