"""Study files: the shipped norm-placement study is a controlled comparison (only the block, the
seeds of initialisation and data order, and the learning rates change between cells), pinned so
that it resolves to the same cells whatever the code's defaults, and a bad study file is one line
`error: ...` with exit code 2 before anything runs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import tomli_w
from filelock import FileLock

from study_files import DIVERGING, TOKENS, ablate, ablate_refused, write_base, write_study
from trinity_train.config import config_differences, config_to_dict, load_config
from trinity_train.model.blocks import BLOCK_VARIANTS
from trinity_train.study.cells import global_batch, recorded_config_mismatch, study_cells, study_hash
from trinity_train.study.layout import StudyDir
from trinity_train.study.spec import StudyError, load_study

ROOT = Path(__file__).resolve().parents[1]
SHIPPED = ROOT / "configs" / "studies" / "norm_placement.toml"
COMMITTED_V2 = ROOT / "docs" / "studies" / "norm_placement_v2" / "summary.json"
# What a cell may change relative to its base: the block, the seeds of the initialisation and the
# data order, the learning rates (and where it runs and how it resumes).
CELL_KEYS = {"model.block", "train.seed", "data.seed", "optim.lr", "optim.muon_lr", "run.dir", "run.name",
             "checkpoint.resume"}


def test_the_shipped_study_compares_every_variant_seed_by_seed_at_three_learning_rates(tmp_path):
    study = load_study(SHIPPED)
    assert set(study.variants) == set(BLOCK_VARIANTS) and len(study.seeds) >= 3 and len(study.lrs) >= 3
    assert study.pinned and study.data_order == "seed" and study.val_tokens >= 32768
    cells = study_cells(study, StudyDir(tmp_path))
    assert len(cells) == len(study.variants) * len(study.seeds) * len(study.lrs)
    base = config_to_dict(load_config(study.base))
    for cell in cells:
        changed = {key for key, _, _ in config_differences(base, config_to_dict(cell.config))}
        assert changed <= CELL_KEYS, (cell.name, changed - CELL_KEYS)
        assert cell.config.model.block == cell.variant and cell.config.train.seed == cell.seed
        assert cell.config.data.seed == base["data"]["seed"] + cell.seed  # each seed its own data order ...
        assert cell.config.stability.mode == "observe"  # ... which no skip changes: spikes are only counted
        assert not cell.drilled
    first = cells[0].config
    assert first.model.num_layers > load_config(ROOT / "configs" / "debug.toml").model.num_layers
    assert study.tokens == first.train.steps * global_batch(first, 1) * first.data.seq_len
    assert study.val_tokens == first.eval.batches * global_batch(first, 1) * first.data.seq_len
    assert first.metrics.layer_stats_every > 0  # the depth profile needs the "layers" records
    assert first.train.steps % first.eval.every == 0 and (first.train.steps // 2) % first.eval.every == 0
    rates = [(setting.lr, setting.muon_lr) for setting in study.lrs]
    assert rates == sorted(rates) and len(set(rates)) == len(rates)  # a sensitivity curve, low to high


def test_the_shipped_command_resolves_to_the_committed_cells(tmp_path):
    """The base pins every setting, so the study resolves to the same cells whatever the code's
    defaults: each cell's config is the committed v2 cell's config.toml, read as a run's (a
    setting added to the code since is pinned in the base at the default that reproduces the old
    behaviour, e.g. parallel.sync_every_micro_batch). The config hash the report recorded covers
    every key, so it moves with each setting added: it is checked against the committed cells'
    own configs, not the shipped study's."""
    study = load_study(SHIPPED)
    cells = study_cells(study, StudyDir(tmp_path))  # refuses a base that leaves a key to the code's defaults
    if not COMMITTED_V2.is_file():
        pytest.skip("docs/studies/norm_placement_v2 is not committed yet")
    committed_dir = StudyDir(COMMITTED_V2.parent)
    assert {c.name for c in cells} == {p.name for p in (COMMITTED_V2.parent / "cells").iterdir()}
    for cell in cells:
        assert recorded_config_mismatch(cell, committed_dir) is None, cell.name
    committed = json.loads(COMMITTED_V2.read_text())
    assert committed["provenance"]["dirty"] is False and committed["provenance"]["commit"]


def test_a_pinned_study_refuses_a_base_that_leaves_a_setting_to_the_code(corpus, tmp_path):
    write_base(corpus, tmp_path)
    study = load_study(write_study(tmp_path, pinned=True))
    with pytest.raises(StudyError, match=r"base.toml: does not pin checkpoint\.async_save, .* and \d+ more "
                                         r"\(pinned = true in .*study.toml\): its value would come from the code's"):
        study_cells(study, StudyDir(tmp_path / "out"))
    pinned = config_to_dict(load_config(tmp_path / "base.toml"))  # every key, as a run's config.toml has them
    (tmp_path / "base.toml").write_text(tomli_w.dumps(pinned))
    assert len(study_cells(study, StudyDir(tmp_path / "out"))) == 2
    del pinned["stability"]["mode"]
    (tmp_path / "base.toml").write_text(tomli_w.dumps(pinned))
    with pytest.raises(StudyError, match=r"does not pin stability\.mode \(pinned"):
        study_cells(study, StudyDir(tmp_path / "out"))
    (tmp_path / "chained.toml").write_text('base = "base.toml"\n')
    with pytest.raises(StudyError, match="base: a pinned study's base states every setting itself"):
        study_cells(load_study(write_study(tmp_path, pinned=True, base="chained.toml")), StudyDir(tmp_path / "out"))


def test_seeds_vary_the_data_order_unless_it_is_fixed(corpus, tmp_path):
    write_base(corpus, tmp_path, data={"seed": 7})
    cells = study_cells(load_study(write_study(tmp_path, seeds=[0, 3])), StudyDir(tmp_path / "out"))
    assert [(c.seed, c.config.data.seed) for c in cells] == [(0, 7), (0, 7), (3, 10), (3, 10)]
    fixed = study_cells(load_study(write_study(tmp_path, seeds=[0, 3], data_order="fixed")), StudyDir(tmp_path / "out"))
    assert {c.config.data.seed for c in fixed} == {7}


def test_cells_run_seed_by_seed_and_the_hash_covers_what_they_compute(corpus, tmp_path):
    write_base(corpus, tmp_path)
    study = load_study(write_study(tmp_path, seeds=[0, 1], lrs=[
        {"name": "normal", "lr": 3e-3}, {"name": "high", "lr": 1e-2, "variants": ["prenorm"]}]))
    cells = study_cells(study, StudyDir(tmp_path / "out"))
    assert [c.name for c in cells] == ["sandwich-normal-s0", "prenorm-normal-s0", "sandwich-normal-s1",
                                       "prenorm-normal-s1", "prenorm-high-s0", "prenorm-high-s1"]
    assert cells[-1].config.optim.lr == 1e-2 and cells[-1].config.optim.muon_lr == cells[0].config.optim.muon_lr
    assert cells[0].config.run.dir == str(tmp_path / "out" / "cells" / "sandwich-normal-s0")
    # where the study is written does not change its hash; what a cell computes does
    moved = study_cells(study, StudyDir(tmp_path / "elsewhere"))
    assert study_hash(moved) == study_hash(cells)
    other = load_study(write_study(tmp_path, seeds=[0, 2], lrs=[
        {"name": "normal", "lr": 3e-3}, {"name": "high", "lr": 1e-2, "variants": ["prenorm"]}]))
    assert study_hash(study_cells(other, StudyDir(tmp_path / "out"))) != study_hash(cells)


def test_a_drill_changes_only_the_stability_of_the_cells_it_selects(corpus, tmp_path):
    write_base(corpus, tmp_path)
    study = load_study(write_study(tmp_path, drills=[{"variant": "prenorm", "stability": DIVERGING}]))
    sandwich, prenorm = study_cells(study, StudyDir(tmp_path / "out"))
    assert prenorm.drilled and not sandwich.drilled
    assert prenorm.config.stability.inject[0].fault == "nan_loss" and not sandwich.config.stability.inject
    changed = {k for k, _, _ in config_differences(config_to_dict(sandwich.config), config_to_dict(prenorm.config))}
    assert {k.split(".")[0] for k in changed} == {"model", "run", "stability"}


def test_more_ranks_split_each_batch_so_the_cells_see_the_same_tokens(corpus, tmp_path):
    write_base(corpus, tmp_path)
    study = load_study(write_study(tmp_path))
    one, two = study_cells(study, StudyDir(tmp_path)), study_cells(study, StudyDir(tmp_path), nproc=2)
    assert two[0].config.train.micro_batch_size * 2 == one[0].config.train.micro_batch_size
    assert global_batch(two[0].config, 2) == global_batch(one[0].config, 1)
    with pytest.raises(StudyError, match="--nproc 4: the base config's train.micro_batch_size=2 cannot be split"):
        study_cells(study, StudyDir(tmp_path), nproc=4)
    # a base with a fixed global batch keeps its micro-batch: each rank accumulates fewer of them
    write_base(corpus, tmp_path, train={"micro_batch_size": 1, "global_batch_size": 2, "steps": 6})
    one, two = study_cells(study, StudyDir(tmp_path)), study_cells(study, StudyDir(tmp_path), nproc=2)
    assert two[0].config.train == one[0].config.train and global_batch(two[0].config, 2) == 2
    with pytest.raises(StudyError, match="--nproc 4: train.global_batch_size: 2 sequences cannot be split"):
        study_cells(study, StudyDir(tmp_path), nproc=4)


BAD_STUDIES = [
    ({"variants": ["sandwich", "prenrom"]}, ["variants: unknown variant 'prenrom'", "did you mean 'prenorm'"]),
    ({"variants": []}, ["variants: must list at least one variant"]),
    ({"seeds": []}, ["seeds: must list at least one train.seed"]),
    ({"seeds": None}, ["seeds: missing"]),
    ({"base": "nowhere.toml"}, ["base: the base config 'nowhere.toml' does not exist"]),
    ({"sedes": [0]}, ["sedes: unknown key (did you mean 'seeds'?)"]),
    ({"lrs": [{"name": "normal", "lr": 3e-3, "mun_lr": 1e-2}]}, ["lrs[0].mun_lr: unknown key (did you mean 'lrs[0].muon_lr'?)"]),
    ({"lrs": [{"name": "normal", "lr": -1.0}]}, ["lrs[0].lr: must be a positive finite number"]),
    ({"lrs": [{"name": "normal", "lr": float("inf")}]}, ["lrs[0].lr: must be a positive finite number, got inf"]),
    ({"lrs": []}, ["lrs: must list at least one learning-rate setting"]),
    ({"val_tokens": 100}, ["val_tokens: the study states 100 validation tokens but its base config evaluates 1 "
                           "batches x 2 sequences x 16 tokens = 32"]),
    ({"data_order": "shuffled"}, ["data_order: must be one of seed, fixed"]),
    ({"tokens": 1000}, [f"tokens: the study states 1000 tokens but its base config trains 6 steps x 2 sequences x 16 "
                        f"tokens = {TOKENS}"]),
    ({"drills": [{"variant": "gemma3", "stability": DIVERGING}]}, ["drills[0].variant: 'gemma3' is not one of the study's"]),
    ({"drills": [{"stability": {"injct": []}}]}, ["cell sandwich-normal-s0: unknown config key 'stability.injct'"]),
    # A rule of the package that owns it (stability.drills), checked for every cell before any runs.
    ({"drills": [{"stability": {"inject": [{"fault": "nan_lss", "first": 2}]}}]},
     ["cell sandwich-normal-s0: stability.inject[0].fault", "nan_lss"]),
    ({"lrs": [{"name": "normal", "lr": 3e-3}, {"name": "high", "lr": 1e-2, "variants": ["prenorm"]}],
      "drills": [{"variant": "sandwich", "lr": "high", "stability": DIVERGING}]}, ["drills[0]: selects no cell"]),
]


@pytest.mark.parametrize("keys, fragments", BAD_STUDIES, ids=[f[0].split(":")[0] for _, f in BAD_STUDIES])
def test_a_bad_study_file_is_one_line_before_anything_runs(corpus, tmp_path, capsys, monkeypatch, keys, fragments):
    write_base(corpus, tmp_path)
    study = write_study(tmp_path, **keys)
    result = ablate_refused(capsys, monkeypatch, "--study", study, "--out", tmp_path / "out", cwd=tmp_path)
    assert result.returncode == 2, result.stdout + result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: {study}: "), result.stderr
    for fragment in fragments:
        assert fragment in lines[0]
    assert not (tmp_path / "out").exists()


def test_a_bad_base_config_or_study_path_is_one_line(corpus, tmp_path, capsys, monkeypatch):
    def ablate(*args, cwd):
        return ablate_refused(capsys, monkeypatch, *args, cwd=cwd)

    write_base(corpus, tmp_path, train={"stepz": 3})
    result = ablate("--study", write_study(tmp_path), "--out", tmp_path / "out", cwd=tmp_path)
    assert result.returncode == 2 and "base config: unknown config key 'train.stepz'" in result.stderr
    result = ablate("--study", tmp_path / "missing.toml", cwd=tmp_path)
    assert result.returncode == 2 and result.stderr.strip() == f"error: study file '{tmp_path / 'missing.toml'}' does not exist"
    (tmp_path / "broken.toml").write_text("variants = [")
    result = ablate("--study", tmp_path / "broken.toml", cwd=tmp_path)
    assert result.returncode == 2 and "is not valid TOML" in result.stderr and len(result.stderr.strip().splitlines()) == 1
    result = ablate("--study", write_study(tmp_path), "--nproc", "0", cwd=tmp_path)
    assert result.returncode == 2 and "--nproc must be at least 1" in result.stderr
    (tmp_path / "a-file").write_text("")
    result = ablate("--study", write_study(tmp_path), "--out", tmp_path / "a-file" / "out", cwd=tmp_path)
    assert result.returncode == 2 and f"cannot be created: '{tmp_path / 'a-file'}' is a file" in result.stderr
    write_base(corpus, tmp_path, model={"num_kv_heads": 2}, parallel={"tp": 2})
    result = ablate("--study", write_study(tmp_path), "--out", tmp_path / "out", cwd=tmp_path)
    assert result.returncode == 2 and "--nproc 1: the base config's parallel.tp=2 must divide it" in result.stderr
    assert not (tmp_path / "runs").exists() and not (tmp_path / "out").exists()


@pytest.mark.slow  # ~8 s
def test_a_second_ablate_in_the_same_directory_is_refused(corpus, tmp_path):
    write_base(corpus, tmp_path)
    out = StudyDir(tmp_path / "out")
    out.path.mkdir()
    with FileLock(out.lock):  # as the first ablate holds it while its cells train
        result = ablate("--study", write_study(tmp_path), "--out", out.path, cwd=tmp_path)
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip() == (f"error: another `trinity-train ablate` is running in {out.path}; wait for it to "
                                     f"finish, or write this one to another --out")
    assert not (out.path / "cells").exists()
