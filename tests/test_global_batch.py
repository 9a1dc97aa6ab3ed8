"""`train.global_batch_size` fixes the global batch whatever the layout: grad_accum is derived per
layout, a layout it cannot be split over is one config error before any process starts, and a
run resumed on another number of ranks trains on the same batches with the same losses."""

import functools
import shutil

import pytest
import torch
import torch.distributed as dist

from conftest import run_config, run_python
from helpers import StopWhen
from trinity_harness.ranks import init_gloo
from trinity_train.config import grad_accum_for, load_config
from trinity_train.errors import ConfigError
from trinity_train.parallel.mesh import ParallelDims
from trinity_train.rundir import RunDir
from trinity_train.train import Trainer, build_model_for_training
from trinity_train.records import RecordKind


def test_grad_accum_is_derived_per_layout():
    cfg = load_config(None, ["--train.global_batch_size=16", "--train.micro_batch_size=2"])
    assert [grad_accum_for(cfg.train, dp) for dp in (1, 2, 4, 8)] == [8, 4, 2, 1]
    assert ParallelDims.from_config(cfg, 4).dp == 4
    assert grad_accum_for(load_config(None, ["--train.grad_accum=3"]).train, 4) == 3  # 0: as before


def test_a_layout_the_global_batch_cannot_split_over_is_one_config_error(tmp_path):
    cfg = load_config(None, ["--train.global_batch_size=12", "--train.micro_batch_size=2"])
    with pytest.raises(ConfigError, match="12 sequences cannot be split over 4 data-parallel rank.*multiple of "
                                          "micro_batch_size x dp = 8"):
        ParallelDims.from_config(cfg, 4)
    with pytest.raises(ConfigError, match="train.global_batch_size: 5 sequences cannot be split over 1"):
        load_config(None, ["--train.global_batch_size=5", "--train.micro_batch_size=2"])
    with pytest.raises(ConfigError, match="train.grad_accum: is derived from train.global_batch_size"):
        load_config(None, ["--train.global_batch_size=8", "--train.grad_accum=2"])
    # The launchers' preflight says so before torchrun starts anything.
    done = run_python("-m", "trinity_train.parallel.preflight", "4", "--train.global_batch_size=12",
                      "--train.micro_batch_size=2", timeout=120, cwd=tmp_path)
    assert done.returncode == 2 and done.stderr.count("\n") == 1
    assert done.stderr.startswith("error: train.global_batch_size: 12 sequences cannot be split")


def config(corpus, run_dir, resume="none"):
    return run_config(corpus, run_dir, model={"num_layers": 2, "global_every": 2},
                      train={"steps": 6, "micro_batch_size": 1, "global_batch_size": 4}, eval={"every": 0},
                      optim={"name": "adamw", "lr": 1e-2, "eps": 1e-4, "warmup_steps": 2},
                      checkpoint={"every": 2, "keep": 5, "resume": resume})


def trainer_for(cfg):
    if not dist.is_initialized():
        return Trainer(cfg)
    dims = ParallelDims.from_config(cfg, dist.get_world_size())
    dims.build_mesh("cpu")
    return Trainer(cfg, dims, torch.device("cpu"), model_builder=functools.partial(build_model_for_training, dims=dims))


def two_ranks(corpus, run_dir, resume):
    init_gloo()
    trainer_for(config(corpus, run_dir, resume)).run()
    dist.barrier()
    return dist.get_rank()


def records(run_dir):
    return [(r["step"], r["tokens"], r["loss"], r["grad_norm"]) for r in RunDir(run_dir).read_metrics(RecordKind.TRAIN)]


@pytest.mark.slow
def test_a_run_resumed_on_another_number_of_ranks_trains_on_the_same_batches(corpus, tmp_path, rank_pool):
    straight, moved = tmp_path / "straight", tmp_path / "moved"
    rank_pool(2).run(two_ranks, corpus, straight, "none")  # 2 ranks x 2 micro-batches of 1

    # Steps 3-4 in one process (4 micro-batches of 1) from the two-rank step-2 checkpoint ...
    (moved / "checkpoints").mkdir(parents=True)
    shutil.copytree(straight / "checkpoints" / "step_00000002", moved / "checkpoints" / "step_00000002")
    # Stopped after step 4, as if the one-process job were stopped there.
    single = Trainer(config(corpus, moved, resume="auto"),
                     callbacks=[StopWhen(lambda trainer: trainer.state.step == 4, KeyboardInterrupt)])
    with pytest.raises(KeyboardInterrupt):
        single.run()
    # ... and steps 5-6 on two ranks again, from the one-process step-4 checkpoint.
    rank_pool(2).run(two_ranks, corpus, moved, "auto")

    expected, ours = records(straight), records(moved)
    assert [r[0] for r in ours] == [3, 4, 5, 6]
    for (step, tokens, loss, norm), (_, ref_tokens, ref_loss, ref_norm) in zip(ours, expected[2:]):
        assert tokens == ref_tokens == 4 * 16  # the same 4-sequence global batch on 1 or 2 ranks
        assert loss == pytest.approx(ref_loss, rel=1e-5) and norm == pytest.approx(ref_norm, rel=1e-4), step
