"""The layout search (plan/search.py): layouts for the released Nano on 512 H100s, every one
valid, ranked by predicted step time, printed as overrides the config parser takes."""

from trinity_train.config import load_config, parse_overrides
from trinity_train.parallel.mesh import ParallelDims
from trinity_train.plan.hardware import GPUS
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
    for dp_replicate, dp_shard, tp, ep in layouts(cfg, 64, 8):
        overrides = [f"--parallel.dp_replicate={dp_replicate}", f"--parallel.dp_shard={dp_shard}",
                     f"--parallel.tp={tp}", f"--parallel.ep={ep}", "--train.global_batch_size=512",
                     "--train.micro_batch_size=1", "--train.grad_accum=1"]
        dims = ParallelDims.from_config(load_config("configs/nano.toml", overrides), 64)
        assert (dims.dp_replicate, dims.dp_shard, dims.tp, dims.ep) == (dp_replicate, dp_shard, tp, ep)
