"""A config file can name a `base` file and override only what differs (the ablation configs)."""

from pathlib import Path

import pytest

from trinity_train.config import load_config
from trinity_train.errors import ConfigError

REPO = Path(__file__).resolve().parents[1]


def test_ablation_differs_from_debug_only_in_block_and_run():
    debug = load_config(REPO / "configs/debug.toml")
    for variant in ("prenorm", "sandwich", "gemma3", "normformer"):
        ablation = load_config(REPO / f"configs/ablations/{variant}.toml")
        assert ablation.model.block == variant
        ablation.model.block = debug.model.block
        assert ablation.model == debug.model
        assert ablation.data == debug.data and ablation.train == debug.train
        assert ablation.optim == debug.optim
        assert ablation.run.dir != debug.run.dir


def test_base_is_relative_to_the_file_and_overrides_still_win(tmp_path):
    (tmp_path / "sub").mkdir()
    (tmp_path / "root.toml").write_text("[train]\nsteps = 7\nseed = 3\n")
    (tmp_path / "sub" / "child.toml").write_text('base = "../root.toml"\n[train]\nsteps = 9\n')
    cfg = load_config(tmp_path / "sub" / "child.toml", ["--train.seed=5"])
    assert (cfg.train.steps, cfg.train.seed) == (9, 5)


def test_base_cycle_and_missing_base_are_clear_errors(tmp_path):
    (tmp_path / "a.toml").write_text('base = "b.toml"\n')
    (tmp_path / "b.toml").write_text('base = "a.toml"\n')
    with pytest.raises(ConfigError, match="includes itself"):
        load_config(tmp_path / "a.toml")
    (tmp_path / "c.toml").write_text('base = "missing.toml"\n')
    with pytest.raises(ConfigError, match="missing.toml' does not exist"):
        load_config(tmp_path / "c.toml")
