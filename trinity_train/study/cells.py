"""The cells of a study: one training run per (learning-rate setting, seed, variant), each the
base config with only `model.block`, `train.seed`, `data.seed` (the base's + the seed, unless the
study's `data_order` is "fixed") and the learning rates changed (and, for a drilled cell, its
drill's `stability` settings).

Every cell's config is resolved and validated here, before anything runs, and the resolved
configs are what the study's config hash covers: two studies with the same hash train the same
cells on the same data.
"""

from __future__ import annotations

import hashlib
import json
import tomllib
from dataclasses import dataclass

from trinity_train.config import (Config, config_differences, config_to_dict, describe_differences,
                                  grad_accum_for, load_config, load_stored_config, rows_per_rank)
from trinity_train.errors import ConfigError
from trinity_train.run_config import load_run_config
from trinity_train.study.layout import StudyDir
from trinity_train.study.spec import LRSetting, Study, StudyError

# Keys that may differ between a cell's recorded config and its config now without changing what
# it computes: where its directory is, how it resumes, what the console shows.
IGNORED_KEYS = frozenset({"run.dir", "checkpoint.resume", "metrics.progress_bar", "train.log_every"})


@dataclass(frozen=True)
class Cell:
    name: str  # `<variant>-<lr setting>-s<seed>`: its directory names
    variant: str
    lr: str  # the name of its learning-rate setting
    seed: int
    drilled: bool  # a drill ([[drills]]) acts on it: its result is a rehearsal, not a measurement
    config: Config

    @property
    def group(self) -> tuple[str, str]:
        """The cells that differ only in their seed share a group (the report's rows)."""
        return self.variant, self.lr


def cell_name(variant: str, lr: str, seed: int) -> str:
    return f"{variant}-{lr}-s{seed}"


def global_batch(cfg: Config, nproc: int) -> int:
    """Sequences per optimizer step over all data-parallel ranks."""
    dp = nproc // cfg.parallel.tp
    return rows_per_rank(cfg.train, dp) * dp


def _lr_overrides(setting: LRSetting) -> dict:
    values = {"lr": setting.lr, "muon_lr": setting.muon_lr}
    return {k: v for k, v in values.items() if v is not None}


def _spread_over_ranks(table: dict, base: Config, nproc: int) -> None:
    """With `nproc` ranks, each data-parallel rank takes its share of the base's global batch, so
    that every cell trains on the same batches as on one process: `train.global_batch_size`, when
    the base sets it, does that by itself; otherwise each rank's micro-batch is divided."""
    dp = nproc // base.parallel.tp
    if base.train.global_batch_size > 0:
        try:
            grad_accum_for(base.train, dp)
        except ConfigError as e:
            raise StudyError(f"--nproc {nproc}: {e}") from None
        return
    micro = base.train.micro_batch_size
    if micro % dp:
        raise StudyError(f"--nproc {nproc}: the base config's train.micro_batch_size={micro} cannot be split over "
                         f"{dp} data-parallel ranks (each takes an equal share of every batch); choose an --nproc "
                         f"whose data-parallel size divides it")
    table.setdefault("train", {})["micro_batch_size"] = micro // dp


def _check_budget(study: Study, cfg: Config, nproc: int) -> None:
    sequences = global_batch(cfg, nproc)
    tokens = cfg.train.steps * sequences * cfg.data.seq_len
    if tokens != study.tokens:
        raise StudyError(f"{study.path}: tokens: the study states {study.tokens} tokens but its base config trains "
                         f"{cfg.train.steps} steps x {sequences} sequences x {cfg.data.seq_len} tokens = {tokens}; "
                         f"state that (tokens = {tokens}) or change the base config")


def _check_validation(study: Study, cfg: Config, nproc: int) -> None:
    if study.val_tokens is None:
        return
    tokens = cfg.eval.batches * global_batch(cfg, nproc) * cfg.data.seq_len
    if tokens != study.val_tokens:
        raise StudyError(f"{study.path}: val_tokens: the study states {study.val_tokens} validation tokens but its base "
                         f"config evaluates {cfg.eval.batches} batches x {global_batch(cfg, nproc)} sequences x "
                         f"{cfg.data.seq_len} tokens = {tokens}; state that or change eval.batches")


def _leaves(table: dict, prefix: str = "") -> set[str]:
    keys = set()
    for key, value in table.items():
        if isinstance(value, dict):
            keys |= _leaves(value, f"{prefix}{key}.")
        else:
            keys.add(f"{prefix}{key}")
    return keys


def check_pinned(study: Study) -> None:
    """With `pinned = true`: the base file itself sets every key of the config (no `base =` chain),
    so the study's cells do not move when a default does."""
    if not study.pinned:
        return
    try:
        raw = tomllib.loads(study.base.read_text(encoding="utf-8"))
    except (OSError, tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise StudyError(f"{study.path}: base config: {e}") from None
    if "base" in raw:
        raise StudyError(f"{study.base}: base: a pinned study's base states every setting itself (pinned = true in "
                         f"{study.path}); write out the settings of '{raw['base']}' instead of naming it")
    missing = sorted(_leaves(config_to_dict(Config())) - _leaves(raw))
    if missing:
        shown = ", ".join(missing[:6]) + (f" and {len(missing) - 6} more" if len(missing) > 6 else "")
        raise StudyError(f"{study.base}: does not pin {shown} (pinned = true in {study.path}): its value would "
                         f"come from the code's default, which can change without the study's files; set it in the "
                         f"base config (a run's config.toml lists every key with the value it ran with)")


def study_cells(study: Study, out: StudyDir, nproc: int = 1) -> list[Cell]:
    """Every cell, in running order: the learning-rate settings in turn, within one every seed, and
    within a seed every variant, so that a study stopped early has compared all variants at least
    once. Raises StudyError for a base config or a cell config that does not validate."""
    try:
        base = load_config(study.base)
    except ConfigError as e:
        raise StudyError(f"{study.path}: base config: {e}") from None
    check_pinned(study)
    if nproc % base.parallel.tp:  # also nproc < tp: a cell runs on --nproc ranks
        raise StudyError(f"--nproc {nproc}: the base config's parallel.tp={base.parallel.tp} must divide it")
    cells = []
    for setting in study.lrs:
        for seed in study.seeds:
            for variant in study.variants:
                if not setting.applies_to(variant):
                    continue
                name = cell_name(variant, setting.name, seed)
                data_seed = base.data.seed + seed if study.data_order == "seed" else base.data.seed
                table: dict = {"model": {"block": variant}, "train": {"seed": seed}, "data": {"seed": data_seed},
                               "optim": _lr_overrides(setting),
                               "checkpoint": {"resume": "auto"},  # an interrupted cell goes on from its checkpoint
                               "run": {"dir": str(out.cell(name).path), "name": name}}
                if nproc > 1:
                    _spread_over_ranks(table, base, nproc)
                drills = [d for d in study.drills if d.selects(variant, setting.name, seed)]
                if drills:
                    table["stability"] = _merged_drills(drills)
                try:
                    cfg = load_run_config(study.base, table)  # every package's rules, before any cell runs
                except ConfigError as e:
                    raise StudyError(f"{study.path}: cell {name}: {e}") from None
                _check_budget(study, cfg, nproc)
                _check_validation(study, cfg, nproc)
                cells.append(Cell(name, variant, setting.name, seed, bool(drills), cfg))
    for i, drill in enumerate(study.drills):
        if not any(drill.selects(c.variant, c.lr, c.seed) for c in cells):
            raise StudyError(f"{study.path}: drills[{i}]: selects no cell of the study ({drill.as_dict()}); "
                             f"name a variant, lr setting and seed the study runs")
    return cells


def _merged_drills(drills: list) -> dict:
    """The [stability] settings of every drill acting on one cell: later settings win, and the
    faults of all of them are injected."""
    merged: dict = {}
    faults: list = []
    for drill in drills:
        merged.update(drill.stability)
        faults += list(drill.stability.get("inject", []))
    if faults:
        merged["inject"] = faults
    return merged


def _comparable(cfg: Config) -> dict:
    table = config_to_dict(cfg)
    del table["run"]["dir"]
    return table


def cell_hash(cell: Cell) -> str:
    """sha256 of one cell's resolved config (less where its directory is)."""
    return hashlib.sha256(json.dumps(_comparable(cell.config), sort_keys=True).encode()).hexdigest()


def study_hash(cells: list[Cell]) -> str:
    """sha256 of the resolved study: every cell's resolved config (less where its directory is)."""
    resolved = {cell.name: _comparable(cell.config) for cell in cells}
    return hashlib.sha256(json.dumps(resolved, sort_keys=True).encode()).hexdigest()


def recorded_config_mismatch(cell: Cell, out: StudyDir) -> str | None:
    """How the run in the cell's directory was configured differently from the cell now (None when
    it was not, or when the directory holds no run yet)."""
    recorded = out.cell(cell.name).config
    if not recorded.is_file():
        return None
    try:
        previous = config_to_dict(load_stored_config(recorded))
    except ConfigError as e:
        return f"its config.toml cannot be read ({e})"
    diffs = [d for d in config_differences(previous, config_to_dict(cell.config)) if d[0] not in IGNORED_KEYS]
    return describe_differences(diffs) if diffs else None
