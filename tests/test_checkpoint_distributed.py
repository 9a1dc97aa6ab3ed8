"""Checkpoints of a distributed run (FSDP over two gloo ranks): sharded async saves commit and
verify, a resume continues exactly, one process can resume the two-rank checkpoint (DCP reshards
it: the optimizer state is keyed by parameter name), also when the gradients are reduced once a
step (`parallel.sync_every_micro_batch = false`), and a rollback over poisoned batches equals a
run that skipped them."""

import functools
import shutil

import pytest
import torch
import torch.distributed as dist

from conftest import run_config
from helpers import poison_batches
from trinity_train.checkpoint import verify_checkpoint
from trinity_train.files import read_jsonl
from trinity_harness.ranks import init_gloo
from trinity_train.parallel.mesh import ParallelDims
from trinity_train.train import Trainer, build_model_for_training
from trinity_train.records import RecordKind

def config(corpus, run_dir, dp: int, steps: int = 4, stability: dict | None = None, data: dict | None = None,
           parallel: dict | None = None, **checkpoint):
    return run_config(
        corpus, run_dir,
        model={"num_layers": 2, "global_every": 2},
        parallel=parallel or {},
        data=data or {},
        # The same 4-row global batch for any number of data-parallel ranks.
        train={"steps": steps, "micro_batch_size": 1, "grad_accum": 4 // dp}, eval={"every": 0},
        optim={"lr": 1e-2, "eps": 1e-4, "warmup_steps": 2},
        checkpoint={"every": 2, **checkpoint},
        stability=stability or {})


def losses(run_dir):
    return [(r["step"], r["loss"], r["grad_norm"]) for r in read_jsonl(run_dir / "metrics.jsonl")
            if r["kind"] == RecordKind.TRAIN]


def fsdp_trainer(cfg):
    dims = ParallelDims.from_config(cfg, dist.get_world_size())
    dims.build_mesh("cpu")
    return Trainer(cfg, dims, torch.device("cpu"),
                   model_builder=functools.partial(build_model_for_training, dims=dims))


def two_rank_runs(corpus, root, parallel: dict | None = None):
    """On each of two ranks: an uninterrupted run with async saves, then a resume from its step-2
    checkpoint into a fresh directory (`parallel`: config keys beside the layout)."""
    init_gloo()
    straight = root / "straight"
    fsdp_trainer(config(corpus, straight, dp=2, async_save=True, parallel=parallel)).run()

    resumed = root / "resumed"
    if dist.get_rank() == 0:  # a copy of the run as it stood at step 2
        (resumed / "checkpoints").mkdir(parents=True)
        shutil.copytree(straight / "checkpoints" / "step_00000002", resumed / "checkpoints" / "step_00000002")
        (resumed / "metrics.jsonl").write_text(
            "".join(line + "\n" for line in (straight / "metrics.jsonl").read_text().splitlines()[:2]))
    dist.barrier()
    fsdp_trainer(config(corpus, resumed, dp=2, resume="auto", parallel=parallel)).run()
    dist.barrier()
    return dist.get_rank()


def test_two_rank_checkpoints_resume_exactly_and_reshard_to_one_process(corpus, tmp_path, rank_pool):
    rank_pool(2).run(two_rank_runs, corpus, tmp_path)
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    expected = losses(straight)
    assert [s for s, _, _ in expected] == [1, 2, 3, 4]
    assert losses(resumed) == expected  # same layout: bit-identical

    for step in ("step_00000002", "step_00000004"):
        summary = verify_checkpoint(straight / "checkpoints" / step)
        assert summary["components"]["model"]["tensors"] > 0

    # One process resumes the sharded two-rank checkpoint and continues like the two ranks did.
    single = tmp_path / "single"
    (single / "checkpoints").mkdir(parents=True)
    shutil.copytree(straight / "checkpoints" / "step_00000002", single / "checkpoints" / "step_00000002")
    Trainer(config(corpus, single, dp=1, resume="auto")).run()
    ours = losses(single)
    assert [s for s, _, _ in ours] == [3, 4]
    for (_, loss, norm), (_, ref_loss, ref_norm) in zip(ours, expected[2:]):
        assert loss == pytest.approx(ref_loss, rel=1e-5) and norm == pytest.approx(ref_norm, rel=1e-4)


@pytest.mark.slow  # two two-rank runs (~12 s); the fast loop resumes the default layout
def test_two_rank_runs_reducing_once_a_step_resume_exactly(corpus, tmp_path, rank_pool):
    # Two micro-batches a step, reduced after the last only: nothing unsharded outlives a step.
    rank_pool(2).run(two_rank_runs, corpus, tmp_path, {"sync_every_micro_batch": False})
    expected = losses(tmp_path / "straight")
    assert [s for s, _, _ in expected] == [1, 2, 3, 4]
    assert losses(tmp_path / "resumed") == expected  # bit-identical


@pytest.mark.slow  # two two-rank runs (~12 s)
def test_two_rank_runs_gathering_experts_once_a_step_resume_exactly(corpus, tmp_path, rank_pool):
    # Two micro-batches a step, the experts held gathered from the first to the last and their
    # gradients reduced once (parallel.expert_gather = "step"): nothing gathered outlives a step.
    rank_pool(2).run(two_rank_runs, corpus, tmp_path, {"expert_gather": "step"})
    expected = losses(tmp_path / "straight")
    assert [s for s, _, _ in expected] == [1, 2, 3, 4]
    assert losses(tmp_path / "resumed") == expected  # bit-identical


def two_rank_rollback(corpus, root):
    """Batches 3 and 4 poisoned on rank 1 only: the global loss is NaN, so both ranks skip, and
    the second skip rolls both back to the (asynchronously saved) step-2 checkpoint. Then the
    same layout told to skip batches 2-4 from the start."""
    init_gloo()
    stability = {"rollback_after": 2, "max_consecutive_skips": 4, "rollback_lookback": 0, "skip_extra_batches": 0,
                 "lr_backoff": 1.0}  # no back-off: the two runs must be bit-identical
    rolled = fsdp_trainer(config(corpus, root / "rolled", dp=2, async_save=True, steps=6, stability=stability))
    if dist.get_rank() == 1:
        poison_batches(rolled, {3, 4})
    rolled.run()
    fsdp_trainer(config(corpus, root / "skipped", dp=2, async_save=True, steps=6,
                        data={"skip_ranges": [[2, 5]]})).run()
    dist.barrier()
    return dist.get_rank()


@pytest.mark.slow  # two two-rank runs (~8 s); one-process rollback is in the fast loop
def test_two_rank_rollback_equals_a_run_that_skipped_those_batches(corpus, tmp_path, rank_pool):
    rank_pool(2).run(two_rank_rollback, corpus, tmp_path)
    rolled, skipped = losses(tmp_path / "rolled"), losses(tmp_path / "skipped")
    assert [s for s, _, _ in rolled] == [1, 2, 3, 3, 3, 3, 4, 5, 6]  # two skips after step 3, back to 2
    assert rolled[-4:] == skipped[-4:]  # steps 3-6 after the rollback: bit-identical
    ledger = (tmp_path / "rolled" / "skip_ledger.json").read_text()
    assert '"start": 2' in ledger and '"end": 5' in ledger
