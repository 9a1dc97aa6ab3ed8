"""Shared test fixtures and builders: the tiny word-salad corpus, tiny model configs and tiny run
configs. Test modules take the `corpus` fixture and build configs with `tiny_model(...)` and
`run_config(...)`, overriding only what the test is about."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from trinity_harness.corpus import prepare_word_corpus
from trinity_train.config import Config, ModelConfig, load_config

WORDS = ("the quick brown fox jumps over a lazy dog while one small cat sat on the warm mat and "
         "birds sang in tall green trees near old stone walls").split()

# The model of unit tests of the model code: 4 layers (1 dense, 3 MoE with 4 experts top-2),
# sliding window 4, so 16-token sequences exercise local and global attention.
TINY_MODEL = dict(vocab_size=64, hidden_size=32, num_layers=4, num_dense_layers=1, num_heads=4,
                  num_kv_heads=2, head_dim=8, intermediate_size=48, num_experts=4,
                  num_experts_per_tok=2, moe_intermediate_size=16, sliding_window=4)

# The model of training runs on the `corpus` (its BPE has 300 tokens): 4 layers, 4 experts top-2.
RUN_MODEL = dict(vocab_size=320, hidden_size=32, num_layers=4, num_dense_layers=1, num_heads=2,
                 num_kv_heads=1, head_dim=16, intermediate_size=64, num_experts=4,
                 num_experts_per_tok=2, moe_intermediate_size=16, sliding_window=8,
                 bias_update_rate=1e-2)


ROOT = Path(__file__).resolve().parent.parent
CONFIGS = ROOT / "configs"

# The environment of the tests' subprocesses: the console script and torchrun of the interpreter
# running the tests come first on PATH. ONE_THREAD_ENV also fixes one OpenMP thread that sleeps
# while it waits: the same math in every process, and no stalls on a shared CPU.
SUBPROCESS_ENV = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
ONE_THREAD_ENV = {**SUBPROCESS_ENV, "OMP_NUM_THREADS": "1", "OMP_WAIT_POLICY": "PASSIVE"}


def benchmark_module(name: str):
    """benchmarks/NAME.py imported as a module (the benchmarks are scripts, not a package; those the
    tests import take their shared code from trinity_harness, not from each other)."""
    spec = importlib.util.spec_from_file_location(f"benchmark_{name}", ROOT / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # (dataclasses look their module up there)
    spec.loader.exec_module(module)
    return module


def run_python(*args, cwd: Path = ROOT, env: dict | None = None, timeout: float = 600,
               ok: bool = False) -> subprocess.CompletedProcess:
    """`python ARGS` with the tests' interpreter, output captured as text; `ok` asserts exit 0,
    showing the tail of what it printed otherwise. The one subprocess helper of the tests."""
    done = subprocess.run([sys.executable, *map(str, args)], cwd=cwd, env=env or SUBPROCESS_ENV,
                          capture_output=True, text=True, timeout=timeout)
    if ok:
        assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    return done


def last_table(out: str) -> list[str]:
    """The markdown table a benchmark script ends its output with (benchmarks/README.md): its
    header, separator and rows, asserting there is one and nothing follows it."""
    lines = out.rstrip("\n").splitlines()
    start = len(lines)
    while start > 0 and lines[start - 1].startswith("|"):
        start -= 1
    table = lines[start:]
    assert len(table) >= 3 and re.fullmatch(r"\|(-{3,}:?\|)+", table[1]), out[-3000:]
    return table


def run_cli(*args, **options) -> subprocess.CompletedProcess:
    """`trinity-train ARGS` as a user runs it, in a fresh process (options: `run_python`'s)."""
    return run_python("-m", "trinity_train.cli", *args, **options)


def assert_one_line_error(code: int, stderr: str, expected_code: int, *fragments: str) -> None:
    """A user's mistake: exit `expected_code` and one line `error: ...` holding every fragment."""
    lines = stderr.strip().splitlines()
    assert code == expected_code and len(lines) == 1 and lines[0].startswith("error: "), stderr
    for fragment in fragments:
        assert fragment in lines[0], lines[0]


def assert_fails_in_one_line(result: subprocess.CompletedProcess, expected_code: int, *fragments: str) -> None:
    """`assert_one_line_error` of a finished process (`run_cli`)."""
    assert_one_line_error(result.returncode, result.stderr, expected_code, *fragments)


def cli_in_process(capsys, *args) -> tuple[int, str]:
    """`trinity-train ARGS` called in this process (no interpreter to start): (exit code, what
    it printed on stderr). The console script itself is `run_cli`'s."""
    from trinity_train import cli

    code = cli.main([str(a) for a in args])
    return code, capsys.readouterr().err


def shipped_training_configs() -> list[Path]:
    """Every training config under configs/, the study's base included (a study file, which
    names variants, is not one)."""
    return sorted(p for p in CONFIGS.rglob("*.toml") if "variants" not in tomllib.loads(p.read_text()))


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """Files holding slow tests go first: under pytest-xdist (`scripts/test.sh` runs two workers,
    `--dist loadfile`, so that a file's module fixtures are built once, in one worker) the last
    file to finish is then a short one."""
    slow = {item.module.__name__ for item in items if item.get_closest_marker("slow")}
    items.sort(key=lambda item: item.module.__name__ not in slow)  # stable: file order kept within


@pytest.fixture(scope="session")
def corpus(tmp_path_factory) -> Path:
    """~14k tokens of word salad with a 300-token BPE: enough for ~100 batches of 2x2x16 tokens."""
    return prepare_word_corpus(tmp_path_factory.mktemp("corpus"), WORDS, seed=0, num_docs=40)


def tiny_model(**overrides) -> ModelConfig:
    return ModelConfig(**{**TINY_MODEL, **overrides})


def run_config(corpus: Path, run_dir: Path, **sections: dict) -> Config:
    """A validated config training `RUN_MODEL` on `corpus` into `run_dir`, quietly (no progress
    bar, a fixed peak for MFU); each keyword is a config section whose keys override the base."""
    table: dict = {
        "model": dict(RUN_MODEL),
        "data": {"path": str(corpus), "seq_len": 16},
        "metrics": {"progress_bar": False, "peak_flops": 1e11},
        "run": {"dir": str(run_dir)},
    }
    for section, values in sections.items():
        table[section] = {**table.get(section, {}), **values}
    return load_config(None, table)


LAYOUT_GLOBAL_ROWS = 4


def layout_config(corpus: Path, run_dir: Path, changes: dict, world: int) -> Config:
    """The run the parallel-layout tests compare: three AdamW steps on 4-row global batches for any
    number of ranks (grad_accum makes up for fewer data-parallel ranks), with `changes` (config
    sections) naming the layout."""
    parallel = changes.get("parallel", {})
    dp = world // (parallel.get("tp", 1) * parallel.get("cp", 1))
    table = {
        "model": {"num_layers": 3, "num_kv_heads": 2, "route_scale": 2.0, "global_every": 2},
        "train": {"steps": 3, "micro_batch_size": 1, "grad_accum": LAYOUT_GLOBAL_ROWS // dp,
                  "grad_clip": 0.5, "seed": 5}, "eval": {"every": 0},
        # Adam's eps is raised from 1e-8: near-zero gradients (sums that cancel to ~1e-6) differ
        # in their last bits between summation orders, and a tiny eps turns that noise into whole
        # lr-sized steps of either sign. 1e-4 keeps real gradients at full Adam steps.
        "optim": {"name": "adamw", "lr": 1e-2, "eps": 1e-4, "schedule": "constant",
                  "warmup_steps": 0},
        "checkpoint": {"every": 0},
    }
    for section, values in changes.items():
        table[section] = {**table.get(section, {}), **values}
    return run_config(corpus, run_dir, **table)


# The layouts the distributed tests compare with one process (name: the config sections it
# changes): FSDP, TP and EP on two ranks, with TP also for the block variants whose norms TP
# treats specially (NormFormer's width and head norms, Gemma 3's (1 + g) norms); HSDP and the
# combinations on four (ep taken from dp_shard=4; TP x EP with activation checkpointing), and EP
# of six experts over dp_shard=4, whose three local experts FSDP shards along dim 1 (dim 0 would
# split them 2 + 1, padded); HSDP x EP on ranks said to be 2 nodes of 2, which the node rule admits.
TWO_RANK_LAYOUTS = {
    "fsdp2": {"parallel": {"dp_shard": 2}},
    "tp2": {"parallel": {"tp": 2}},
    "ep2": {"parallel": {"ep": 2}},
    "tp2_normformer": {"parallel": {"tp": 2}, "model": {"block": "normformer"}},
    "tp2_gemma3": {"parallel": {"tp": 2}, "model": {"block": "gemma3"}},
    # HSDP with two micro-batches per rank: the all-reduce across replicas waits for the last one.
    "hsdp2_accum": {"parallel": {"dp_replicate": 2, "dp_shard": 1}},
    # FSDP and HSDP (two micro-batches per rank) reducing the gradients once a step, after the last.
    "fsdp2_sync_last": {"parallel": {"dp_shard": 2, "sync_every_micro_batch": False}},
    "hsdp2_sync_last": {"parallel": {"dp_replicate": 2, "dp_shard": 1, "sync_every_micro_batch": False}},
    # FSDP keeping every block gathered from its forward to its backward (no all-gather in backward).
    "fsdp2_no_reshard": {"parallel": {"dp_shard": 2, "keep_gathered_gib": float("inf")}},
}
FOUR_RANK_LAYOUTS = {
    "hsdp2x2": {"parallel": {"dp_replicate": 2, "dp_shard": 2}},
    "tp2_fsdp2": {"parallel": {"tp": 2}},
    "ep2_fsdp2": {"parallel": {"ep": 2}},
    "tp2_ep2": {"parallel": {"tp": 2, "ep": 2}, "train": {"activation_checkpointing": True}},
    "ep2_six_experts": {"parallel": {"ep": 2}, "model": {"num_experts": 6}},
    # The cluster layout on 2 "nodes" of 2 ranks: shards and experts inside a node, replicas across.
    "hsdp2x2_ep2_two_nodes": {"parallel": {"dp_replicate": 2, "dp_shard": 2, "ep": 2, "ranks_per_node": 2}},
}
# The single-process runs the layouts above are compared with (name: the model section): one per
# block variant, and the model with six experts.
LAYOUT_REFERENCES = {"trinity": {}, "normformer": {"block": "normformer"},
                     "gemma3": {"block": "gemma3"}, "six_experts": {"num_experts": 6}}


def layout_reference(layout: str) -> str:
    """The name of the reference whose model `layout` trains."""
    model = {**TWO_RANK_LAYOUTS, **FOUR_RANK_LAYOUTS}[layout].get("model", {})
    return next(name for name, changes in LAYOUT_REFERENCES.items() if changes == model)


def merge_sections(base: dict, changes: dict) -> dict:
    """Config sections of `base` with those of `changes` laid over them, key by key."""
    return {s: {**base.get(s, {}), **changes.get(s, {})} for s in {*base, *changes}}


def run_layouts(corpus: Path, root: Path, layouts: dict, run, common: dict | None = None) -> dict:
    """In each rank of a `ranks.RankPool` job: join the gloo group, build a Trainer for every layout
    (`layout_config` with `common` sections under the layout's) and return {layout: run(trainer)}."""
    import torch.distributed as dist

    from trinity_harness.ranks import init_gloo, rank_trainer

    init_gloo()
    results = {}
    for name, changes in layouts.items():
        cfg = layout_config(corpus, root / name, merge_sections(common or {}, changes), dist.get_world_size())
        results[name] = run(rank_trainer(cfg))
    return results


@pytest.fixture(scope="session")
def rank_pool():
    """`rank_pool(n)`: n gloo ranks spawned once for the whole session (`ranks.RankPool`)."""
    from trinity_harness.ranks import RankPool

    pools: dict[int, RankPool] = {}

    def get(world: int) -> RankPool:
        return pools.setdefault(world, RankPool(world))

    yield get
    for pool in pools.values():
        pool.close()


@pytest.fixture(scope="module")
def slow_rank_run(corpus, tmp_path_factory, rank_pool):
    """A real two-rank run with a `slow_rank` drill on rank 1 (`rank_health_run.write_slow_rank_run`),
    trained once per test module that reads it."""
    from rank_health_run import write_slow_rank_run

    return write_slow_rank_run(corpus, tmp_path_factory.mktemp("slow_rank") / "run", rank_pool)
