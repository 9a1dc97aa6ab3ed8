"""A released size planned at the scale it was trained at: configs/nano.toml as rank 0 of 512 GPUs
in Arcee's HSDP layout (64 replica groups of an 8-GPU node). The trace runs the real model,
parallel and optimizer code at full size on fake tensors; what it reports is checked against
what the layout implies exactly, and against the closed form."""

import json

import pytest

from conftest import run_cli
from trinity_train.config import load_config
from trinity_train.parallel.mesh import ParallelDims
from trinity_train.plan.formula import memory_per_rank

pytestmark = pytest.mark.slow  # one full-size trace: about 2 minutes on this machine

NANO_512 = ["--config", "configs/nano.toml", "--world", "512", "--parallel.dp_replicate=64",
            "--parallel.dp_shard=8"]


@pytest.fixture(scope="module")
def nano_512() -> dict:
    done = run_cli("plan", *NANO_512, "--json", timeout=1200)
    return json.loads(done.stdout)


def test_every_rank_of_the_hsdp_layout_is_alike(nano_512):
    lay = nano_512["layout"]
    assert (lay["world"], lay["dp_replicate"], lay["dp_shard"], lay["ep"]) == (512, 64, 8, 1)
    (only,) = nano_512["rank_classes"]
    assert only["ranks"] == 512
    # 6.1B parameters, a 200,192-row vocabulary and 128 experts per layer: all split evenly 8 ways.
    cfg = load_config("configs/nano.toml", NANO_512[4:])
    model = memory_per_rank(cfg, ParallelDims.from_config(cfg, 512), gpu=True)
    assert only["memory"]["parameters"] == model.by_category["parameters"]
    assert only["peak"] == pytest.approx(model.peak, rel=0.10)


def test_only_the_once_a_step_all_reduce_crosses_nodes(nano_512):
    # Besides the step's few scalars (loss totals, token and expert counts: kilobytes).
    across = [r for r in nano_512["traffic"] if r["across_bytes"] > 0 and not r["collective"].startswith("other")]
    assert {(r["collective"], r["dim"], r["group"]) for r in across} == {("FSDP all-reduce", "dp_replicate", 64)}
    # The shipped config reduces once a step (sync_every_micro_batch = false, the experts gathered
    # once a step): the last of its 8 micro-batches reduce-scatters every FSDP unit inside the node
    # and all-reduces it across, once: 56 blocks, the embedding, the root and 54 MoE layers' experts.
    (scatters,) = [r for r in nano_512["traffic"] if r["collective"] == "FSDP reduce-scatter"]
    (all_reduce,) = across
    assert nano_512["batch"]["grad_accum"] == 8
    assert scatters["calls"] == all_reduce["calls"] == 58 + 54
