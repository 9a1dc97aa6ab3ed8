"""The layout search (plan/search.py, plan/search_space.py): every candidate valid and loadable as
overrides, ranked by predicted step time, the config's numerics apart from bf16 on the wire,
sizes given on the command line kept, layouts across nodes only when asked."""

import json
import math

import pytest

from conftest import assert_one_line_error, cli_in_process
from trinity_train import exit_codes
from trinity_train.config import load_config, parse_overrides
from trinity_train.errors import ConfigError
from trinity_train.parallel.mesh import ParallelDims
from trinity_train.plan.hardware import DEFAULT_GPU, GPUS
from trinity_train.plan.search import layouts, search
from trinity_train.plan.search_space import Layout, Policy, micro_batch_sizes, policies, reshard_values

ARCEE = {"dp_replicate": 16, "dp_shard": 128, "ep": 8}  # Arcee's Large layout on 2,048 GPUs


@pytest.fixture(scope="module")
def large():
    return load_config("configs/large.toml", [])


@pytest.fixture(scope="module")
def arcee_all(large):
    """Every fitting candidate of Arcee's mesh on 2,048 B300s (top large enough to open them all)."""
    return search(large, 2048, GPUS["b300"], fixed=ARCEE, top=10_000)


def loads_as(path: str, c, world: int, extra=()) -> None:
    """The candidate's overrides load with load_config and give its layout."""
    rebuilt = load_config(path, [*extra, *c.overrides])
    assert ParallelDims.from_config(rebuilt, world) == c.dims
    assert rebuilt.train.micro_batch_size == c.setting.micro_batch_size


def test_nano_on_512_h100s_ranked_by_time_with_parseable_overrides():
    cfg = load_config("configs/nano.toml", [])
    found = search(cfg, 512, GPUS["h100"], top=5)
    assert found.candidates
    keys = [c.key for c in found.candidates]
    assert keys == sorted(keys)
    for c in found.candidates + found.other_numerics:
        assert c.memory_bytes <= GPUS["h100"].memory_bytes
        assert parse_overrides(list(c.overrides))["parallel"]["tp"] == c.dims.tp
        loads_as("configs/nano.toml", c, 512)


def test_the_pruned_search_lists_what_pricing_everything_lists(large, arcee_all):
    """Bases are opened best bound first and the search stops early: the top it returns is the top
    of every candidate priced."""
    every = arcee_all
    pruned = search(large, 2048, GPUS["b300"], fixed=ARCEE, top=4)
    assert pruned.priced < every.priced
    assert [c.key for c in pruned.candidates] == [c.key for c in every.candidates[:4]]
    assert [c.key for c in pruned.other_numerics] == [c.key for c in every.other_numerics[:4]]


def test_every_enumerated_layout_is_valid():
    cfg = load_config("configs/nano.toml", [])
    found = layouts(cfg, 64, 8, max_cp=4)
    assert {lay.cp for lay in found} == {1, 2, 4}
    assert {lay for lay in found if lay.cp == 1} == set(layouts(cfg, 64, 8))
    for lay in found:
        overrides = [f"--parallel.dp_replicate={lay.dp_replicate}", f"--parallel.dp_shard={lay.dp_shard}",
                     f"--parallel.cp={lay.cp}", f"--parallel.tp={lay.tp}", f"--parallel.ep={lay.ep}",
                     "--train.global_batch_size=512", "--train.micro_batch_size=1", "--train.grad_accum=1"]
        dims = ParallelDims.from_config(load_config("configs/nano.toml", overrides), 64)
        assert (dims.dp_replicate, dims.dp_shard, dims.cp, dims.tp, dims.ep) == (
            lay.dp_replicate, lay.dp_shard, lay.cp, lay.tp, lay.ep)


def test_every_micro_batch_that_splits_a_ranks_rows():
    assert micro_batch_sizes(12288, 2048) == [1, 2, 3, 6]  # accumulating 6, 3, 2, 1 micro-batches
    assert micro_batch_sizes(100, 8) == []  # the global batch does not split over 8 ranks


def test_large_acceptance_arcee_mesh_on_2048_b300s(large, arcee_all):
    """Only the given mesh; micro-batches with and without accumulation priced; the best
    same-numerics candidate fits, sends at most 0.6 TB across nodes, and overlaps to within 15 %
    of its compute."""
    found = arcee_all
    assert found.layouts == 1
    assert {(c.dims.dp_replicate, c.dims.dp_shard, c.dims.ep) for c in found.candidates} == {(16, 128, 8)}
    assert {c.grad_accum for c in found.candidates} >= {1, 2, 3, 6}
    best = found.candidates[0]
    assert best.memory_bytes <= GPUS["b300"].memory_bytes
    assert best.time.inter_bytes <= 0.6e12
    assert best.time.overlap_s <= 1.15 * best.time.compute_s
    # Searching every layout finds one at least as fast.
    free = search(large, 2048, GPUS["b300"], top=1)
    assert free.candidates[0].time.overlap_s <= best.time.overlap_s


def test_policies_ride_in_the_overrides_and_load(arcee_all):
    found = arcee_all
    every = found.candidates + found.other_numerics
    for c in every[::7]:  # a spread of them: each loads as its layout
        loads_as("configs/large.toml", c, 2048)
    texts = {o for c in every for o in c.overrides}
    assert "--parallel.keep_gathered_gib=inf" in texts  # (0 keeps what the config's 1 GiB keeps: not listed)
    assert "--parallel.sync_every_micro_batch=false" in texts
    inf = next(c for c in every if "--parallel.keep_gathered_gib=inf" in c.overrides)
    assert load_config("configs/large.toml", list(inf.overrides)).parallel.keep_gathered_gib == float("inf")
    # One micro-batch a step: when to reduce is no choice, so no duplicate is listed.
    assert not any(c.grad_accum == 1 and "--parallel.sync_every_micro_batch=false" in c.overrides for c in every)


def test_policies_only_where_they_can_change_something(large):
    """expert_gather for sharded experts (whichever it prices: "step" may equal "micro_batch" until
    the formula prices it, and then equal candidates list once); sync only with accumulation."""
    arcee = Layout(16, 128, 1, 1, 8).dims(2048)
    reshard = reshard_values(large, arcee, gpu=True)
    assert math.inf in reshard and reshard[math.inf]
    six = policies(large, arcee, 6, reshard, gpu=True)
    assert {p.expert_gather for p in six} == {"micro_batch", "step"}
    assert {p.sync_every_micro_batch for p in six} == {True, False}
    assert {p.sync_every_micro_batch for p in policies(large, arcee, 1, reshard, gpu=True)} == {True}
    assert six[0] == Policy(large.parallel.keep_gathered_gib, True, "micro_batch", "full", "full")  # the config's first
    # Experts neither sharded nor replicated (ep over every rank, one replica): one expert_gather.
    whole = Layout(1, 8, 1, 1, 8).dims(8)
    assert {p.expert_gather for p in policies(large, whole, 2, reshard_values(large, whole, True), True)} == {
        "micro_batch"}


def test_numerics_are_listed_apart(large, arcee_all):
    p = large.parallel
    for c in arcee_all.candidates:
        assert c.setting.policy.same_numerics(large)
        assert not any("wire_dtype" in o for o in c.overrides)
    assert arcee_all.other_numerics
    for c in arcee_all.other_numerics:
        assert not c.setting.policy.same_numerics(large)
        rebuilt = load_config("configs/large.toml", list(c.overrides)).parallel
        assert (rebuilt.reduce_wire_dtype, rebuilt.ep_wire_dtype) != (p.reduce_wire_dtype, p.ep_wire_dtype)


def test_across_nodes_is_opt_in_and_its_layer_collectives_exposed():
    cfg = load_config("configs/nano.toml", [])
    with pytest.raises(ConfigError, match="add --across-nodes"):  # ep 16 cannot stay inside a node of 8
        search(cfg, 64, GPUS["h100"], fixed={"ep": 16})
    across = search(cfg, 64, GPUS["h100"], top=3, fixed={"ep": 16}, across_nodes=True)
    assert across.candidates
    for c in across.candidates:
        assert "--parallel.allow_ep_tp_across_nodes=true" in c.overrides
        assert 0 < c.time.exposed_s <= c.time.comm_s
        assert c.time.overlap_s >= max(c.time.compute_s, c.time.comm_s - c.time.exposed_s) + c.time.exposed_s - 1e-12
        loads_as("configs/nano.toml", c, 64)
    # Inside nodes nothing is exposed, and no config asks to cross them.
    for c in search(cfg, 64, GPUS["h100"], top=3).candidates:
        assert c.time.exposed_s == 0 and "--parallel.allow_ep_tp_across_nodes=true" not in c.overrides


def test_a_sequence_too_long_for_one_gpu_fits_with_context_parallelism(capsys):
    """Nano at 256K tokens a row on 64 H100s: no layout without context parallelism fits; with
    --max-cp 8 the search finds layouts that split each row, and they load as configs."""
    from trinity_train import cli

    long_rows = ["--data.seq_len=262144", "--train.global_batch_size=8", "--train.grad_accum=1"]
    cfg = load_config("configs/nano.toml", long_rows)
    nothing = search(cfg, 64, GPUS["h100"], top=3)
    assert nothing.candidates == [] and nothing.other_numerics == []
    found = search(cfg, 64, GPUS["h100"], top=3, max_cp=8).candidates
    assert found and all(c.dims.cp > 1 for c in found)
    for c in found:
        loads_as("configs/nano.toml", c, 64, long_rows)
    assert cli.main(["plan", "--config", "configs/nano.toml", "--world", "64", "--gpu", "h100", "--search",
                     "--max-cp", "8", "--top", "2", *long_rows]) == 0
    assert "dp_replicate x dp_shard x cp x tp x ep" in capsys.readouterr().out


def test_large_on_2048_gpus_through_the_cli_ready_to_run(capsys):
    from trinity_train import cli

    code = cli.main(["plan", "--config", "configs/large.toml", "--world", "2048", "--search", "--top", "4",
                     "--json", "--parallel.dp_replicate=16", "--parallel.ep=8"])
    data = json.loads(capsys.readouterr().out)
    assert code == 0 and data["gpu"] == DEFAULT_GPU and data["world"] == 2048
    assert 0 < len(data["candidates"]) <= 4 and len(data["other_numerics"]) <= 4
    for c in data["candidates"] + data["other_numerics"]:
        assert c["memory_with_reserve_bytes"] <= GPUS[DEFAULT_GPU].memory_bytes
        assert c["command"].startswith("trinity-train plan --config configs/large.toml --world 2048 ")
        assert c["command"].endswith(" ".join(c["overrides"]))
        assert c["bound"] == "compute-bound" or c["bound"].startswith("bound by ")
        dims = ParallelDims.from_config(load_config("configs/large.toml", c["overrides"]), 2048)
        lay = c["layout"]
        assert (lay["dp_replicate"], lay["ep"]) == (16, 8)  # the given sizes kept
        assert (dims.dp_replicate, dims.dp_shard, dims.cp, dims.tp, dims.ep) == (
            lay["dp_replicate"], lay["dp_shard"], lay["cp"], lay["tp"], lay["ep"])
    assert [c["overlap_s"] for c in data["candidates"]] == sorted(c["overlap_s"] for c in data["candidates"])
    # A smaller loss chunk that saves nothing is not listed beside the larger one.
    alike = [(tuple(o for o in c["overrides"] if "loss_chunk" not in o), c["memory_with_reserve_bytes"])
             for c in data["candidates"]]
    assert len(set(alike)) == len(alike)


def test_the_search_table_and_a_gpu_nothing_fits(capsys):
    from trinity_train import cli

    assert cli.main(["plan", "--config", "configs/nano.toml", "--world", "64", "--search", "--top", "2"]) == 0
    text = capsys.readouterr().out
    assert "fit on h200" in text and "--parallel.dp_replicate=" in text and "tokens/s/GPU" in text
    assert "other numerics: bf16 on the wire" in text and "micro x accum" in text
    tiny = ["--gpu-memory", "1", "--peak-tflops", "989", "--intra-gbps", "450", "--inter-gbps", "400"]
    assert cli.main(["plan", "--config", "configs/nano.toml", "--world", "64", "--search", *tiny]) == 0
    assert "no layout fits on custom" in capsys.readouterr().out


@pytest.mark.parametrize("args,fragments", [
    (["--parallel.dp_replicate=3"], ["--parallel.dp_replicate=3", "does not divide the world (2048)"]),
    (["--parallel.tp=8", "--parallel.ep=16"], ["--parallel.tp=8 --parallel.ep=16", "--across-nodes"]),
    (["--parallel.ep=3"], ["ep=3 must divide"]),  # the config's own check comes first
])
def test_given_sizes_that_admit_no_layout_are_one_line(capsys, args, fragments):
    code, err = cli_in_process(capsys, "plan", "--config", "configs/large.toml", "--world", "2048", "--search",
                               *args)
    assert_one_line_error(code, err, exit_codes.CONFIG, *fragments)


def test_across_nodes_needs_search(capsys):
    code, err = cli_in_process(capsys, "plan", "--across-nodes")
    assert_one_line_error(code, err, exit_codes.CONFIG, "--across-nodes", "add --search")
