"""The context-extension phase (docs/guides/context-extension.md): a run started from another
run's checkpoint at a longer `data.seq_len` takes its weights and optimizer state and nothing else
(its schedule, data position and spike-guard windows are its own), records `context_extended`,
resumes bit-exactly after a kill, and a level change of the loss at the phase change is not a
spike while a real spike inside the phase still is. A resume that changes `data.seq_len` is
refused in one line that names the phase."""

from __future__ import annotations

import pytest
import torch

from conftest import CONFIGS, RUN_MODEL, assert_one_line_error, cli_in_process, run_config
from drill_run import drill_config
from helpers import StopAfterStep, stop_after
from trinity_train.checkpoint import ModelState, OptimizerState, save_model_checkpoint
from trinity_train.checkpoint.compat import model_architecture
from trinity_train.checkpoint.layout import list_checkpoints
from trinity_train.config import load_config
from trinity_train.errors import ConfigError
from trinity_train.records import EventName, RecordKind
from trinity_train.rundir import RunDir
from trinity_train.stability import TrainingDivergedError
from trinity_train.stability.incidents import read_incidents
from trinity_train.train import Trainer, build_model_for_training

BASE_SEQ, LONG_SEQ = 16, 32


def base_config(corpus, run_dir, **sections):
    """The run a phase extends: 8 steps at sequences of 16, a checkpoint every 4."""
    base = {"train": {"steps": 8, "micro_batch_size": 2, "grad_accum": 1}, "eval": {"every": 0},
            "optim": {"lr": 3e-3, "warmup_steps": 2}, "checkpoint": {"every": 4, "keep": 3},
            "data": {"seq_len": BASE_SEQ}}
    for section, values in sections.items():
        base[section] = {**base.get(section, {}), **values}
    return run_config(corpus, run_dir, **base)


def phase_config(corpus, run_dir, source, **sections):
    """A phase of 6 steps at sequences of 32 from `source`: Trinity Nano/Mini's curve (linear
    re-warm-up to 1/10 of the peak, then a linear decay to 0), the optimizer continued."""
    phase = {"train": {"steps": 6}, "data": {"seq_len": LONG_SEQ},
             "optim": {"schedule": "linear", "warmup_steps": 2, "peak_lr_ratio": 0.1, "min_lr_ratio": 0.0},
             "checkpoint": {"every": 2, "keep": 5, "init_from": str(source), "init_optimizer": True}}
    for section, values in sections.items():
        phase[section] = {**phase.get(section, {}), **values}
    return base_config(corpus, run_dir, **phase)


@pytest.fixture(scope="module")
def base_run(corpus, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("base")
    trainer = Trainer(base_config(corpus, run_dir))
    trainer.run()
    return run_dir, trainer


def train_losses(run_dir):
    return [(r["step"], r["loss"], r["grad_norm"], r["lr"]) for r in RunDir(run_dir).read_metrics(RecordKind.TRAIN)]


def test_a_phase_takes_the_weights_and_optimizer_of_the_newest_checkpoint_and_nothing_else(corpus, tmp_path, base_run):
    base_dir, base = base_run
    phase = Trainer(phase_config(corpus, tmp_path / "phase", base_dir))  # a run directory: its newest checkpoint
    assert phase.init_from == list_checkpoints(base_dir / "checkpoints")[-1][1]
    events = phase.restore()
    for (name, a), (_, b) in zip(ModelState(base.model).state_dict().items(),
                                 ModelState(phase.model).state_dict().items()):
        assert torch.equal(a, b), name
    theirs = OptimizerState(base.model, base.optimizer).state_dict()["state"]
    ours = OptimizerState(phase.model, phase.optimizer).state_dict()["state"]
    assert theirs.keys() == ours.keys()
    for name in theirs:
        for key, value in theirs[name].items():
            assert torch.equal(torch.as_tensor(value), torch.as_tensor(ours[name][key])), (name, key)
    # The phase's own: schedule from its step 0 (half of 1/10 of the peak: its warm-up), data
    # position, counters and an empty guard.
    assert phase.scheduler.last_epoch == 0 and phase.state.step == 0 and phase.train_loader.position == 0
    assert {g["kind"]: g["lr"] for g in phase.optimizer.param_groups} == pytest.approx(
        {"adamw": 3e-3 * 0.05, "muon": 1.5e-2 * 0.05})
    assert all(not course.points for course in phase.guard.courses.values())
    assert any(course.points for course in base.guard.courses.values())
    assert [e["event"] for e in events] == [EventName.INIT_FROM, EventName.CONTEXT_EXTENDED]
    extended = events[1]
    assert extended == {"event": EventName.CONTEXT_EXTENDED, "checkpoint": str(phase.init_from), "step": 8,
                        "from_seq_len": BASE_SEQ, "to_seq_len": LONG_SEQ, "optimizer": True}


def test_the_phase_resumes_bit_exactly_after_a_kill(corpus, tmp_path, base_run):
    source = base_run[0] / "checkpoints" / "step_00000004"
    Trainer(phase_config(corpus, tmp_path / "straight", source)).run()
    expected = train_losses(tmp_path / "straight")
    assert [s for s, *_ in expected] == [1, 2, 3, 4, 5, 6]
    assert expected[1][3] == pytest.approx(3e-3 * 0.1) and expected[5][3] == pytest.approx(3e-3 * 0.1 / 4)

    with pytest.raises(StopAfterStep):
        Trainer(phase_config(corpus, tmp_path / "killed", source), callbacks=[stop_after(3)]).run()
    resumed = Trainer(phase_config(corpus, tmp_path / "killed", source, checkpoint={"resume": "auto"}))
    assert resumed.resume_from.name == "step_00000002" and resumed.init_from is None
    resumed.run()
    assert train_losses(tmp_path / "killed") == expected
    assert len(RunDir(tmp_path / "killed").read_events(EventName.CONTEXT_EXTENDED)) == 1  # the first start's


def test_a_new_loss_level_at_the_phase_change_is_no_spike_but_a_spike_inside_the_phase_is(corpus, tmp_path):
    base_dir = tmp_path / "base"
    Trainer(drill_config(corpus, base_dir, train={"steps": 10})).run()
    source = base_dir / "checkpoints" / "step_00000010"
    # From the checkpoint on, the loss is 1.3x its level (as a longer context's loss may differ).
    # A run that continues judges that against its windows: spikes, until it gives up.
    control = drill_config(corpus, tmp_path / "continued", {"fault": "loss_spike", "first": 11, "last": 20,
                                                             "factor": 1.3}, train={"steps": 20})
    control.checkpoint.resume = str(source)
    with pytest.raises(TrainingDivergedError):
        Trainer(control).run()
    assert RunDir(tmp_path / "continued").read_events(EventName.INCIDENT_OPEN)[0]["iter"] == 11
    # The phase's windows start with it: the new level is its baseline, and a real spike (x10 on
    # top) at iteration 14, once they judge again, is one.
    phase_dir = tmp_path / "phase"
    cfg = drill_config(corpus, phase_dir, {"fault": "loss_spike", "first": 1, "last": 20, "factor": 1.3},
                       {"fault": "loss_spike", "first": 14, "factor": 10.0}, train={"steps": 20})
    cfg.data.seq_len, cfg.checkpoint.init_from, cfg.checkpoint.init_optimizer = LONG_SEQ, str(source), True
    Trainer(cfg).run()
    records = RunDir(phase_dir).read_metrics(RecordKind.TRAIN)
    assert [r["iter"] for r in records if r["skipped"]] == [14]
    assert sum(r["loss_z"] is not None for r in records) >= 10  # the phase's guard did judge
    opened = RunDir(phase_dir).read_events(EventName.INCIDENT_OPEN)
    assert [(e["iter"], e["signal"]) for e in opened] == [(14, "loss")]
    assert [r["reason"] for r in read_incidents(RunDir(phase_dir))] == ["loss_spike"]


def test_a_resume_at_another_seq_len_is_refused_naming_the_phase(corpus, tmp_path, base_run):
    cfg = base_config(corpus, tmp_path / "run", data={"seq_len": LONG_SEQ}, checkpoint={
        "resume": str(base_run[0] / "checkpoints" / "step_00000008")})
    with pytest.raises(ConfigError, match=r"data.seq_len: checkpoint .* was trained at data.seq_len=16, this run "
                                          r"asks for 32.*--checkpoint.init_from="):
        Trainer(cfg)


def test_init_optimizer_needs_a_checkpoint_with_the_same_optimizer(corpus, tmp_path, base_run):
    cfg = base_config(corpus, tmp_path / "weights")
    save_model_checkpoint(build_model_for_training(cfg, torch.device("cpu")), cfg, tmp_path / "weights_only")
    with pytest.raises(ConfigError, match="checkpoint.init_optimizer: .* holds no optimizer state"):
        Trainer(phase_config(corpus, tmp_path / "a", tmp_path / "weights_only"))
    with pytest.raises(ConfigError, match="optim.name: the optimizer state of .* is for optim.name='muon'"):
        Trainer(phase_config(corpus, tmp_path / "b", base_run[0], optim={"name": "adamw"}))
    # Weights alone load whatever the optimizer.
    Trainer(phase_config(corpus, tmp_path / "c", base_run[0], optim={"name": "adamw"},
                         checkpoint={"init_optimizer": False})).restore()


def test_init_from_a_run_directory_without_checkpoints_is_refused(corpus, tmp_path):
    (tmp_path / "empty" / "checkpoints").mkdir(parents=True)
    with pytest.raises(ConfigError, match="checkpoint.init_from: the run directory .* holds no sound checkpoint"):
        Trainer(phase_config(corpus, tmp_path / "phase", tmp_path / "empty"))


def test_the_shipped_phase_extends_the_default_model_keeping_its_window_and_rope():
    default, phase = load_config(CONFIGS / "debug.toml"), load_config(CONFIGS / "extend_context.toml")
    assert model_architecture(phase.model) == model_architecture(default.model)  # window and RoPE included
    assert (default.data.seq_len, phase.data.seq_len) == (256, 4096)
    assert (phase.checkpoint.init_from, phase.checkpoint.init_optimizer) == (default.run.dir, True)
    assert (phase.optim.schedule, phase.optim.peak_lr_ratio, phase.optim.min_lr_ratio) == ("linear", 0.1, 0.0)
    assert phase.run.dir != default.run.dir


@pytest.mark.slow  # two runs through the CLI
def test_the_shipped_configs_extend_a_run_through_the_cli(corpus, tmp_path, capsys):
    # The shipped files on the tiny model and corpus: the default job, then its extension from its run directory.
    tiny = [f"--model.{k}={v}" for k, v in RUN_MODEL.items()] + [
        f"--data.path={corpus}", "--train.steps=4", "--train.micro_batch_size=2", "--eval.every=0",
        "--checkpoint.every=2", "--metrics.progress_bar=false", "--metrics.peak_flops=1e11"]
    base, phase = tmp_path / "base", tmp_path / "phase"
    code, err = cli_in_process(capsys, "train", "--config", CONFIGS / "debug.toml", *tiny, "--data.seq_len=16",
                               f"--run.dir={base}")
    assert code == 0, err
    # In this one process (the file's cp = 2 needs two), and without the passkey probe (its prompts
    # are longer than these 64-token rows).
    code, err = cli_in_process(capsys, "train", "--config", CONFIGS / "extend_context.toml", *tiny,
                               "--data.seq_len=64", "--parallel.cp=1", "--eval.passkey_every=0",
                               f"--checkpoint.init_from={base}", f"--run.dir={phase}")
    assert code == 0, err
    (extended,) = RunDir(phase).read_events(EventName.CONTEXT_EXTENDED)
    assert (extended["step"], extended["from_seq_len"], extended["to_seq_len"]) == (4, 16, 64)
    assert [r["tokens"] for r in RunDir(phase).read_metrics(RecordKind.TRAIN)] == [2 * 64] * 4
    # A resume of the finished base run at the phase's length is refused in one line.
    code, err = cli_in_process(capsys, "train", "--config", CONFIGS / "debug.toml", *tiny, "--data.seq_len=64",
                               f"--run.dir={base}", "--checkpoint.resume=auto")
    assert_one_line_error(code, err, 2, "data.seq_len", "--checkpoint.init_from=")
