"""The layout search (plan/search.py): layouts for the released Nano on 512 H100s, every one
valid, ranked by predicted step time, printed as overrides the config parser takes."""

import json

from trinity_train.config import load_config, parse_overrides
from trinity_train.parallel.mesh import ParallelDims
from trinity_train.plan.hardware import DEFAULT_GPU, GPUS
from trinity_train.plan.search import layouts, search


def test_nano_on_512_h100s_ranked_by_time_with_parseable_overrides():
    cfg = load_config("configs/nano.toml", [])
    found = search(cfg, 512, GPUS["h100"], top=5)
    assert found
    times = [c.time.overlap_s for c in found]
    assert times == sorted(times)
    for c in found:
        assert c.memory_bytes <= GPUS["h100"].memory_bytes
        parsed = parse_overrides(list(c.overrides))
        assert parsed["parallel"]["tp"] == c.dims.tp
        rebuilt = load_config("configs/nano.toml", list(c.overrides))
        assert ParallelDims.from_config(rebuilt, 512) == c.dims


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


def test_a_sequence_too_long_for_one_gpu_fits_with_context_parallelism(capsys):
    """Nano at 256K tokens a row on 64 H100s: no layout without context parallelism fits; with
    --max-cp 8 the search finds layouts that split each row, and they load as configs."""
    from trinity_train import cli

    long_rows = ["--data.seq_len=262144", "--train.global_batch_size=8", "--train.grad_accum=1"]
    cfg = load_config("configs/nano.toml", long_rows)
    assert search(cfg, 64, GPUS["h100"], top=3) == []
    found = search(cfg, 64, GPUS["h100"], top=3, max_cp=8)
    assert found and all(c.dims.cp > 1 for c in found)
    for c in found:
        assert ParallelDims.from_config(load_config("configs/nano.toml", [*long_rows, *c.overrides]), 64) == c.dims
    assert cli.main(["plan", "--config", "configs/nano.toml", "--world", "64", "--gpu", "h100", "--search",
                     "--max-cp", "8", "--top", "2", *long_rows]) == 0
    assert "dp_replicate x dp_shard x cp x tp x ep" in capsys.readouterr().out


def test_large_on_2048_gpus_through_the_cli_ready_to_run(capsys):
    from trinity_train import cli

    code = cli.main(["plan", "--config", "configs/large.toml", "--world", "2048", "--search", "--top", "4",
                     "--json"])
    data = json.loads(capsys.readouterr().out)
    assert code == 0 and data["gpu"] == DEFAULT_GPU and data["world"] == 2048
    assert 0 < len(data["candidates"]) <= 4
    for c in data["candidates"]:
        assert c["memory_with_reserve_bytes"] <= GPUS[DEFAULT_GPU].memory_bytes
        assert c["command"].startswith("trinity-train plan --config configs/large.toml --world 2048 ")
        assert c["command"].endswith(" ".join(c["overrides"]))
        dims = ParallelDims.from_config(load_config("configs/large.toml", c["overrides"]), 2048)
        lay = c["layout"]
        assert (dims.dp_replicate, dims.dp_shard, dims.cp, dims.tp, dims.ep) == (
            lay["dp_replicate"], lay["dp_shard"], lay["cp"], lay["tp"], lay["ep"])
    assert [c["overlap_s"] for c in data["candidates"]] == sorted(c["overlap_s"] for c in data["candidates"])
    # A smaller loss chunk that saves nothing is not listed beside the larger one.
    alike = [(tuple(c["overrides"][:-1]), c["memory_with_reserve_bytes"]) for c in data["candidates"]]
    assert len(set(alike)) == len(alike)


def test_the_search_table_and_a_gpu_nothing_fits(capsys):
    from trinity_train import cli

    assert cli.main(["plan", "--config", "configs/nano.toml", "--world", "64", "--search", "--top", "2"]) == 0
    text = capsys.readouterr().out
    assert "fit on h200" in text and "--parallel.dp_replicate=" in text and "tokens/s/GPU" in text
    tiny = ["--gpu-memory", "1", "--peak-tflops", "989", "--intra-gbps", "450", "--inter-gbps", "400"]
    assert cli.main(["plan", "--config", "configs/nano.toml", "--world", "64", "--search", *tiny]) == 0
    assert "no layout fits on custom" in capsys.readouterr().out
