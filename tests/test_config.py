"""The config tree: TOML loading, dotted overrides, validation messages, the shipped configs."""

import re

import pytest

from conftest import CONFIGS, shipped_training_configs
from trinity_train.config import (Config, config_from_dict, config_to_dict, load_config, parse_overrides, save_config,
                                  upgrade_stored_config)
from trinity_train.errors import ConfigError
from trinity_train.run_config import load_run_config


def test_debug_toml_equals_the_dataclass_defaults():
    # `trinity-train train` without the source tree falls back to the defaults: they must agree.
    assert config_to_dict(load_config(CONFIGS / "debug.toml")) == config_to_dict(Config())


# The released sizes (DESIGN §3): layers, dense layers, hidden, heads, kv heads, head_dim, dense
# FFN, experts, top-k, expert FFN, route_scale, window; the vocabulary is 200192 for all three.
RELEASED = {
    "nano": (56, 2, 1024, 8, 2, 128, 3072, 128, 8, 256, 2.826, 2048),
    "mini": (32, 2, 2048, 32, 4, 128, 6144, 128, 8, 1024, 2.826, 2048),
    "large": (60, 6, 3072, 48, 8, 128, 12288, 256, 4, 3072, 2.448, 4096),
}


@pytest.mark.parametrize("name", RELEASED)
def test_shipped_release_configs_are_the_released_architectures(name):
    cfg = load_config(CONFIGS / f"{name}.toml")
    m = cfg.model
    assert (m.num_layers, m.num_dense_layers, m.hidden_size, m.num_heads, m.num_kv_heads, m.head_dim,
            m.intermediate_size, m.num_experts, m.num_experts_per_tok, m.moe_intermediate_size,
            m.route_scale, m.sliding_window) == RELEASED[name]
    assert m.vocab_size == cfg.data.vocab_size == 200192 and m.block == "trinity"
    assert m.sliding_window * 2 == cfg.data.seq_len  # the window is half the training length
    assert cfg.train.dtype == "bf16" and cfg.optim.name == "muon"


@pytest.mark.parametrize("path", sorted((CONFIGS / "ablations").glob("*.toml")), ids=lambda p: p.stem)
def test_ablation_configs_change_only_the_block_and_the_run(path):
    """A norm-placement ablation is comparable to the default run: same data, model size,
    optimizer and steps; only model.block and where it writes differ."""
    base, variant = config_to_dict(load_config(CONFIGS / "debug.toml")), config_to_dict(load_config(path))
    assert variant["model"]["block"] == path.stem
    for section in base:
        for key in base[section]:
            if (section, key) not in {("model", "block"), ("run", "dir"), ("run", "name")}:
                assert variant[section][key] == base[section][key], f"{section}.{key}"


def test_overrides_in_both_spellings_and_types():
    cfg = load_config(CONFIGS / "debug.toml", ["--train.steps=50", "--run.dir", "runs/x", "--optim.lr=1e-4",
                                                "--metrics.wandb=true", "--data.skip_ranges=[[1, 3]]"])
    assert cfg.train.steps == 50 and cfg.run.dir == "runs/x" and cfg.optim.lr == 1e-4
    assert cfg.metrics.wandb is True and cfg.data.skip_ranges == [[1, 3]]
    assert isinstance(load_config(None, ["--optim.lr=1"]).optim.lr, float)  # an int where a float goes


def test_override_values_read_as_toml_with_bare_strings():
    assert parse_overrides(["--model.block=gemma3", "--a.b=\"quoted\"", "--a.c=2.5"]) == {
        "model": {"block": "gemma3"}, "a": {"b": "quoted", "c": 2.5}}


@pytest.mark.parametrize("overrides, message", [
    (["--train.stepz=5"], "unknown config key 'train.stepz' (did you mean 'train.steps'?)"),
    (["--modle.hidden_size=5"], "unknown config key 'modle' (did you mean 'model'?)"),
    (["--train.steps=many"], "train.steps: expected int, got 'many'"),
    (["--metrics.wandb=1"], "metrics.wandb: expected bool, got 1"),
    (["--model.num_heads=5"], "model.num_heads: 5 heads are not divisible by model.num_kv_heads=2"),
    (["--model.num_experts_per_tok=9"], "model.num_experts_per_tok: top-k 9 exceeds model.num_experts=8"),
    (["--model.sliding_window=0"], "model.sliding_window: must be positive, got 0"),
    (["--optim.schedule=step"], "optim.schedule: must be one of 'wsd', 'cosine', 'linear', 'constant', got 'step'"),
    (["--optim.peak_lr_ratio=0"], "optim.peak_lr_ratio: must be in (0, 1], got 0.0"),
    (["--optim.peak_lr_ratio=0.1", "--optim.min_lr_ratio=0.2"],
     "optim.min_lr_ratio: must be in [0, optim.peak_lr_ratio=0.1]"),
    (["--checkpoint.init_optimizer=true"], "checkpoint.init_optimizer: needs checkpoint.init_from"),
    (["--checkpoint.keep=0"], "checkpoint.keep: must be >= 1"),
    (["--metrics.wandb_mode=sometimes"], "metrics.wandb_mode: must be one of"),
    (["--stability.max_consecutive_skips=0"], "stability.max_consecutive_skips: must be >= 1"),
    (["--stability.rollback_after=10"], "stability.rollback_after: must be below stability.max_consecutive_skips (10)"),
    (["--stability.incident_zscore=7"], "stability.incident_zscore: must not exceed stability.spike_zscore (6.0)"),
    (["--stability.lr_backoff=0"], "stability.lr_backoff: must be in (0, 1]"),
    (["--stability.warmup_grad_ratio=1"], "stability.warmup_grad_ratio: must be above 1 (or 0 to disable)"),
    (["--stability.routing_max_load=-1"], "stability.routing_max_load: must be >= 0 (0 disables)"),
    (["--stability.routing_dead_experts=9"], "stability.routing_dead_experts: must not exceed model.num_experts (8)"),
    (["--stability.routing_steps=0"], "stability.routing_steps: must be >= 1"),
    (["--stability.inject=[{fault='nan', first=3}]"], "stability.inject[0].fault: must be one of 'nan_loss'"),
    (["--stability.inject=[{fault='nan_loss', first=0}]"], "stability.inject[0].first: must be an iteration >= 1"),
    (["--stability.inject=[{fault='poison_random', first=5, last=4}]"], "stability.inject[0].last: must be -1 or >= first (5)"),
    (["--stability.inject=[{fault='poison_repeat', first=5, token=9000}]"], "stability.inject[0].token: must be a token id below model.vocab_size (8192)"),
    (["--model.block=postnorm"], "model.block: must be one of 'trinity'"),
    (["--parallel.tp=3"], "parallel.tp: tp=3 must divide model.num_heads=4"),
    (["--parallel.reduce_wire_dtype=fp16"], "parallel.reduce_wire_dtype: must be one of 'full', 'bf16', got 'fp16'"),
    (["--parallel.ep_wire_dtype=fp32"], "parallel.ep_wire_dtype: must be one of 'full', 'bf16', got 'fp32'"),
    (["--train.steps"], "override '--train.steps' has no value"),
    (["steps=5"], "unexpected argument 'steps=5'"),
])
def test_bad_values_name_the_key(overrides, message):
    # The field checks (load_config) and the rules of the packages that own a setting (the fault
    # drills', the block variants', the layout's) are both part of loading a run's config.
    with pytest.raises(ConfigError) as info:
        load_run_config(CONFIGS / "debug.toml", overrides)
    assert message in str(info.value)
    assert "\n" not in str(info.value)


def test_bad_files(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "missing.toml")
    broken = tmp_path / "broken.toml"
    broken.write_text("[train\nsteps = 3")
    with pytest.raises(ConfigError, match="is not valid TOML"):
        load_config(broken)


def test_resolved_config_round_trips_through_toml(tmp_path):
    cfg = load_config(CONFIGS / "debug.toml", ["--train.steps=7", "--data.skip_ranges=[[0, 2]]"])
    save_config(cfg, tmp_path / "config.toml")
    assert config_to_dict(load_config(tmp_path / "config.toml")) == config_to_dict(cfg)


@pytest.mark.parametrize("path", shipped_training_configs(), ids=lambda p: str(p.relative_to(CONFIGS)))
def test_every_shipped_config_runs_with_the_spike_guard_and_rollbacks(path):
    cfg = load_config(path)
    s = cfg.stability
    assert s.skip_nonfinite and s.spike_zscore > 0 and s.rollback_after > 0
    assert cfg.checkpoint.every > 0  # something to roll back to
    assert s.rollback_lookback < cfg.checkpoint.every * cfg.checkpoint.keep  # and it is kept


@pytest.mark.parametrize("override, replacement", [
    ("--train.eval_every=10", "config key 'train.eval_every' moved: use eval.every"),
    ("--train.eval_batches=2", "config key 'train.eval_batches' moved: use eval.batches"),
    ("--metrics.passkey_every=5", "config key 'metrics.passkey_every' moved: use eval.passkey_every"),
    ("--metrics.position_buckets=[0, 64]", "config key 'metrics.position_buckets' moved: use eval.position_buckets"),
    ("--parallel.reshard_after_forward=false", "keep_gathered_gib = inf"),
    ("--parallel.overlap_reduce_scatter=false", "config key 'parallel.overlap_reduce_scatter' was removed"),
    ("--parallel.prefetch_all_gather=false", "config key 'parallel.prefetch_all_gather' was removed"),
    ("--parallel.ep_waves=1", "config key 'parallel.ep_waves' was removed"),
    ("--data.sample_order=1", "config key 'data.sample_order' was removed"),
    ("--parallel.ep_wire_dtype=compute", "parallel.ep_wire_dtype: 'compute' is now spelled 'full'"),
    ("--parallel.reduce_wire_dtype=fp32", "parallel.reduce_wire_dtype: 'fp32' is now spelled 'full'"),
])
def test_a_retired_key_or_value_is_refused_in_one_line_naming_its_replacement(override, replacement):
    with pytest.raises(ConfigError) as info:
        load_config(CONFIGS / "debug.toml", [override])
    assert replacement in str(info.value) and "\n" not in str(info.value)


def test_keep_gathered_gib_takes_inf_and_round_trips_through_toml_and_json(tmp_path):
    import json

    cfg = load_config(CONFIGS / "debug.toml", ["--parallel.keep_gathered_gib=inf"])
    assert cfg.parallel.keep_gathered_gib == float("inf")
    table = json.loads(json.dumps(config_to_dict(cfg), allow_nan=False))  # a checkpoint's meta.json
    assert config_from_dict(table) == cfg
    save_config(cfg, tmp_path / "c.toml")
    assert load_config(tmp_path / "c.toml") == cfg
    with pytest.raises(ConfigError, match="train.grad_clip: must be a finite number"):
        load_config(CONFIGS / "debug.toml", ["--train.grad_clip=inf"])


def test_a_stored_config_of_an_earlier_version_is_upgraded_not_refused():
    # A checkpoint's meta.json written before the [eval] section and the parallel keys' removal.
    old = config_to_dict(load_config(CONFIGS / "debug.toml"))
    new_eval = old.pop("eval")
    old["train"].update(eval_every=new_eval["every"], eval_batches=new_eval["batches"])
    old["metrics"].update({k: v for k, v in new_eval.items() if k not in ("every", "batches")})
    old["parallel"].update(reshard_after_forward=False, overlap_reduce_scatter=True, prefetch_all_gather=True,
                           ep_waves=2, ep_wire_dtype="compute", reduce_wire_dtype="fp32")
    old["data"]["sample_order"] = 2
    upgraded = config_from_dict(upgrade_stored_config(old))
    assert upgraded.eval == load_config(CONFIGS / "debug.toml").eval
    assert upgraded.parallel.keep_gathered_gib == float("inf")
    assert (upgraded.parallel.ep_wire_dtype, upgraded.parallel.reduce_wire_dtype) == ("full", "full")


def test_parallel_has_at_most_14_keys_and_none_only_for_cpu_jobs():
    # A config key is one a GPU user could want: CPU-only switches (the gloo room's overlaps) have
    # no key (parallel/gloo; a benchmark's ablation uses GlooOverlap).
    import dataclasses

    from conftest import ROOT
    from test_docs_site import docs_site  # the config reference's reader of the keys' comments
    from trinity_train.config import ParallelConfig

    assert len(dataclasses.fields(ParallelConfig)) <= 14  # 13 after house v5, + expert_gather (layouts)
    comments = docs_site.field_comments((ROOT / "trinity_train" / "config.py").read_text())
    meanings = {f"{cls}.{key}": text for cls, (_, keys) in comments.items() for key, text in keys.items()}
    assert len(meanings) > 100  # every key's comment was read
    cpu_only = [key for key, text in meanings.items()
                if re.search(r"CPU \(gloo\) jobs:|only (on|for|matters on) CPU|CPU jobs only", text)]
    assert cpu_only == []
