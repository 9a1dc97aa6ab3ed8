"""A number that cannot work is refused at load, in one line naming the key: every float key of
every section (lists of tables included) is walked with nan, inf and -inf, so a key added later
is covered without a new test; the keys where "no limit" is a natural wish name the spelling
that says it. Paths the config names expand `~`; a config file that is not text is refused."""

from __future__ import annotations

import dataclasses
import math
import typing
from pathlib import Path

import pytest

from trinity_train.config import NO_LIMIT_SPELLING, UNBOUNDED_KEYS, Config, load_config
from trinity_train.errors import ConfigError
from trinity_train.health.limits import PhaseLimits

# A list of tables needs one entry to hold a float key; these are its other required values.
LIST_ENTRY = {"data.mix": {"path": "somewhere"}, "data.phases": {}, "stability.inject": {"fault": "nan_loss", "first": 1}}


def float_keys(cls: type = Config, prefix: str = "") -> list[tuple[str, ...]]:
    """The path of every float field under `cls`, as its table keys ('[]' for a list's entry)."""
    keys = []
    for f in dataclasses.fields(cls):
        tp = typing.get_type_hints(cls)[f.name]
        path = (*prefix, f.name) if prefix else (f.name,)
        if tp is float:
            keys.append(path)
        elif dataclasses.is_dataclass(tp):
            keys += float_keys(tp, path)
        elif typing.get_origin(tp) is list and dataclasses.is_dataclass(typing.get_args(tp)[0]):
            keys += float_keys(typing.get_args(tp)[0], (*path, "[]"))
    return keys


def table_with(path: tuple[str, ...], value: float) -> tuple[dict, str]:
    """The override table setting the float at `path` to `value`, and its dotted key as errors spell it."""
    if "[]" in path:
        cut = path.index("[]")
        owner = ".".join(path[:cut])
        entry = {**LIST_ENTRY[owner], path[cut + 1]: value}
        table: dict = {path[cut - 1]: [entry]}
        for part in reversed(path[:cut - 1]):
            table = {part: table}
        return table, f"{owner}[0].{path[cut + 1]}"
    table = {path[-1]: value}
    for part in reversed(path[:-1]):
        table = {part: table}
    return table, ".".join(path)


FLOAT_KEYS = float_keys()


def test_the_walk_reaches_every_section_and_the_lists_of_tables():
    dotted = {".".join(p) for p in FLOAT_KEYS}
    assert {"train.grad_clip", "model.rope_theta", "optim.eps", "watchdog.first_s", "data.mix.[].weight",
            "stability.inject.[].factor", "stability.inject.[].seconds"} <= dotted
    assert len(FLOAT_KEYS) >= 40  # 40 when this test was written


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf], ids=["nan", "inf", "-inf"])
@pytest.mark.parametrize("path", FLOAT_KEYS, ids=[".".join(p) for p in FLOAT_KEYS])
def test_every_float_key_refuses_a_non_finite_number(path, value):
    table, key = table_with(path, value)
    if key in UNBOUNDED_KEYS and value == math.inf:  # inf is its "no limit" (test_config.py)
        assert load_config(None, table)
        return
    with pytest.raises(ConfigError) as refused:
        load_config(None, table)
    message = str(refused.value)
    assert message.startswith(f"{key}: must be a finite number") and "\n" not in message
    spelling = NO_LIMIT_SPELLING.get(".".join(p for p in path if p != "[]"))
    if spelling is not None:  # the no-limit wish is answered with the spelling that says it
        assert spelling in message


@pytest.mark.parametrize("path", FLOAT_KEYS, ids=[".".join(p) for p in FLOAT_KEYS])
def test_no_float_key_takes_a_negative_number(path):
    table, key = table_with(path, -1.0)
    with pytest.raises(ConfigError) as refused:
        load_config(None, table)
    assert str(refused.value).startswith(f"{key}: ")


@pytest.mark.parametrize("overrides, fragment", [
    (["--model.rope_theta=0"], "model.rope_theta: a RoPE base must be positive"),
    (["--model.global_rope_theta=0"], "model.global_rope_theta: a RoPE base must be positive"),
    (["--optim.eps=0"], "optim.eps: must be positive"),
    (["--model.smebu_beta=1"], "model.smebu_beta: a momentum must be in [0, 1)"),
])
def test_numbers_outside_their_meaning_are_refused(overrides, fragment):
    with pytest.raises(ConfigError) as refused:
        load_config(None, overrides)
    assert str(refused.value).startswith(fragment)


def test_the_spellings_of_no_limit_mean_no_limit():
    cfg = load_config(None, ["--train.grad_clip=0", "--watchdog.first_s=0"])
    assert cfg.train.grad_clip == 0.0
    limits = PhaseLimits(cfg.watchdog)
    assert limits.limit("step") == math.inf  # a phase not seen yet
    limits.observe("step", 2.0)
    assert limits.limit("step") == cfg.watchdog.floor_s  # seen phases keep their limits


def test_the_spellings_name_real_keys():
    for key in NO_LIMIT_SPELLING:
        section, name = key.split(".")
        assert hasattr(getattr(Config(), section), name), key


def test_paths_in_the_config_expand_the_home_directory(monkeypatch, tmp_path):
    monkeypatch.setenv("HOME", str(tmp_path))
    cfg = load_config(None, ["--run.dir=~/runs/x", "--checkpoint.init_from=~/ckpt", "--data.path=~/data",
                             "--data.mix=[{path='~/a'}]", "--checkpoint.resume=auto"])
    assert cfg.run.dir == str(tmp_path / "runs" / "x")
    assert (cfg.checkpoint.init_from, cfg.data.path) == (str(tmp_path / "ckpt"), str(tmp_path / "data"))
    assert cfg.data.mix[0].path == str(tmp_path / "a") and cfg.checkpoint.resume == "auto"


def test_a_config_file_that_is_not_text_is_refused_in_one_line(tmp_path):
    binary = tmp_path / "__0_0.distcp"
    binary.write_bytes(bytes(range(256)) * 4)
    with pytest.raises(ConfigError, match=r"is not UTF-8 text .*pass a \.toml file"):
        load_config(binary)


def test_the_config_path_expands_the_home_directory(monkeypatch, tmp_path):
    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / "c.toml").write_text("[train]\nsteps = 7\n")
    assert load_config(Path("~/c.toml")).train.steps == 7
