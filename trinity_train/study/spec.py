"""The study file (`trinity-train ablate --study FILE`): what to compare, read and checked whole
before anything runs.

A study is a base config and a grid: every variant (`model.block`) x every learning-rate setting
x every seed. A seed sets the initialisation (`train.seed`) and, with `data_order = "seed"` (the
default), the data order too (`data.seed` = the base's + the seed), so the spread over seeds is
the run-to-run spread; the cells of one seed share both, so variants and learning rates compare
seed by seed (paired). `data_order = "fixed"` keeps the base's `data.seed` in every cell (v1).
`tokens` states the budget, steps x global batch x seq_len, and must equal what the base trains;
`val_tokens` (optional) states the validation set, eval.batches x global batch x seq_len, checked
the same way. `pinned = true` makes the base config state every setting itself (no `base =`
chain, no key left to the code's defaults), so a default changed in the code or in another config
file cannot change the study without its file changing: a key it leaves out is refused, by name.
`drills` rehearse a diverging cell: they add `stability` settings (e.g. a `stability.inject` fault)
to the cells they select.

    name = "norm_placement"
    base = "norm_placement_base.toml"           # relative to the study file
    variants = ["prenorm", "sandwich", "trinity", "gemma3", "normformer"]
    seeds = [0, 1, 2]                           # train.seed, and data.seed = base + seed
    tokens = 51200                              # 100 steps x 4 sequences x 128 tokens
    val_tokens = 32768                          # optional: 64 eval.batches x 4 x 128
    pinned = true                               # optional: the base states every setting

    [[lrs]]
    name = "normal"
    lr = 3e-3                                   # optim.lr (AdamW: embedding, head, norms)
    muon_lr = 1.5e-2                            # optim.muon_lr
    # variants = ["normformer"]                 # only these variants (a per-variant sweep)

    [[drills]]
    variant = "sandwich"                        # optional: lr = "normal", seed = 0
    stability = {inject = [{fault = "nan_loss", first = 3, last = 100}], rollback_after = 0, max_consecutive_skips = 2}

Every mistake is one `StudyError` naming the file and the key (the CLI: one line, exit 2).
"""

from __future__ import annotations

import difflib
import math
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trinity_train.model.blocks import BLOCK_VARIANTS
from trinity_train.errors import ConfigError


class StudyError(ConfigError):
    """A study file that cannot run: the message names the file and the key."""


@dataclass(frozen=True)
class LRSetting:
    name: str  # names the cells: `prenorm-<name>-s0`
    lr: float | None  # optim.lr; None keeps the base's
    muon_lr: float | None  # optim.muon_lr; None keeps the base's
    variants: tuple[str, ...] = ()  # the variants it applies to; empty: all

    def applies_to(self, variant: str) -> bool:
        return not self.variants or variant in self.variants

    def as_dict(self) -> dict:
        return {"name": self.name, "lr": self.lr, "muon_lr": self.muon_lr, "variants": list(self.variants)}


@dataclass(frozen=True)
class Drill:
    variant: str | None  # the cells it selects (None: any)
    lr: str | None
    seed: int | None
    stability: dict  # [stability] overrides of the selected cells

    def selects(self, variant: str, lr: str, seed: int) -> bool:
        return ((self.variant is None or self.variant == variant) and (self.lr is None or self.lr == lr)
                and (self.seed is None or self.seed == seed))

    def as_dict(self) -> dict:
        return {"variant": self.variant, "lr": self.lr, "seed": self.seed, "stability": self.stability}


@dataclass(frozen=True)
class Study:
    path: Path
    name: str
    base: Path
    variants: tuple[str, ...]
    seeds: tuple[int, ...]
    lrs: tuple[LRSetting, ...]
    tokens: int
    keep_checkpoints: bool  # False: a cell's checkpoints are deleted once it is done (the report needs none)
    drills: tuple[Drill, ...]
    data_order: str = "seed"  # "seed": data.seed = base + seed; "fixed": the base's data.seed in every cell
    val_tokens: int | None = None  # the validation set the base must evaluate (None: not checked)
    pinned: bool = False  # the base states every setting itself (cells.check_pinned)


DATA_ORDERS = ("seed", "fixed")
STUDY_KEYS = ("name", "base", "variants", "seeds", "lrs", "tokens", "val_tokens", "data_order", "pinned",
              "keep_checkpoints", "drills")
LR_KEYS = ("name", "lr", "muon_lr", "variants")
DRILL_KEYS = ("variant", "lr", "seed", "stability")


class _Reader:
    """Typed access to one table of the study file, every error naming the file and the key."""

    def __init__(self, path: Path, table: dict, prefix: str, keys: tuple[str, ...]):
        self.path, self.table, self.prefix = path, table, prefix
        for key in table:
            if key not in keys:
                close = difflib.get_close_matches(key, keys, n=1)
                hint = f" (did you mean '{self._name(close[0])}'?)" if close else ""
                self.fail(key, f"unknown key{hint}; the keys here are {', '.join(keys)}")

    def _name(self, key: str) -> str:
        return f"{self.prefix}{key}"

    def fail(self, key: str, message: str):
        raise StudyError(f"{self.path}: {self._name(key)}: {message}")

    def get(self, key: str, kind: type | tuple[type, ...], what: str, default: Any = ...) -> Any:
        """`table[key]`, checked to be a `kind`; `default` when absent (without one: required)."""
        if key not in self.table:
            if default is ...:
                self.fail(key, f"missing: give {what}")
            return default
        value = self.table[key]
        kinds = kind if isinstance(kind, tuple) else (kind,)
        if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds):  # TOML true is no number
            self.fail(key, f"expected {what}, got {value!r}")
        return value

    def positive_float(self, key: str) -> float | None:
        value = self.get(key, (int, float), "a positive number", None)
        if value is not None and not (value > 0 and math.isfinite(value)):
            self.fail(key, f"must be a positive finite number, got {value!r}")
        return None if value is None else float(value)

    def variant_list(self, key: str, default: Any = ...) -> tuple[str, ...]:
        values = self.get(key, list, "a list of variants", default)
        for v in values:
            self.variant(key, v)
        if len(set(values)) != len(values):
            self.fail(key, f"lists a variant twice: {values}")
        return tuple(values)

    def variant(self, key: str, value: Any) -> str:
        if value not in BLOCK_VARIANTS:
            close = difflib.get_close_matches(str(value), BLOCK_VARIANTS, n=1)
            hint = f" (did you mean '{close[0]}'?)" if close else ""
            self.fail(key, f"unknown variant {value!r}{hint}; the variants (model.block) are "
                           f"{', '.join(BLOCK_VARIANTS)}")
        return value


def _read_lrs(path: Path, tables: list, variants: tuple[str, ...]) -> tuple[LRSetting, ...]:
    if not tables:
        raise StudyError(f"{path}: lrs: must list at least one learning-rate setting ([[lrs]] with name, lr, muon_lr)")
    settings = []
    for i, table in enumerate(tables):
        if not isinstance(table, dict):
            raise StudyError(f"{path}: lrs[{i}]: expected a table ([[lrs]]), got {table!r}")
        r = _Reader(path, table, f"lrs[{i}].", LR_KEYS)
        name = r.get("name", str, "a name for the cells' directories, e.g. \"normal\"")
        if not name or not name.replace("_", "").isalnum():
            r.fail("name", f"must be letters, digits and '_' (it names directories), got {name!r}")
        lr, muon_lr = r.positive_float("lr"), r.positive_float("muon_lr")
        if lr is None and muon_lr is None:
            r.fail("lr", "give lr (optim.lr), muon_lr (optim.muon_lr) or both")
        only = r.variant_list("variants", [])
        for v in only:
            if v not in variants:
                r.fail("variants", f"variant {v!r} is not one of the study's variants ({', '.join(variants)})")
        settings.append(LRSetting(name, lr, muon_lr, only))
    names = [s.name for s in settings]
    if len(set(names)) != len(names):
        raise StudyError(f"{path}: lrs: two settings share a name: {names}")
    return tuple(settings)


def _read_drills(path: Path, tables: list, study_variants: tuple[str, ...], lrs: tuple[LRSetting, ...],
                 seeds: tuple[int, ...]) -> tuple[Drill, ...]:
    drills = []
    for i, table in enumerate(tables):
        if not isinstance(table, dict):
            raise StudyError(f"{path}: drills[{i}]: expected a table ([[drills]]), got {table!r}")
        r = _Reader(path, table, f"drills[{i}].", DRILL_KEYS)
        variant = r.get("variant", str, "a variant", None)
        if variant is not None and r.variant("variant", variant) not in study_variants:
            r.fail("variant", f"{variant!r} is not one of the study's variants ({', '.join(study_variants)})")
        lr = r.get("lr", str, "the name of one of the [[lrs]]", None)
        if lr is not None and lr not in [s.name for s in lrs]:
            r.fail("lr", f"no [[lrs]] setting is named {lr!r}")
        seed = r.get("seed", int, "one of the study's seeds", None)
        if seed is not None and seed not in seeds:
            r.fail("seed", f"{seed} is not one of the study's seeds {list(seeds)}")
        stability = r.get("stability", dict, "a table of [stability] settings, e.g. {inject = [...]}")
        drills.append(Drill(variant, lr, seed, stability))
    return tuple(drills)


def load_study(path: str | Path) -> Study:
    """Read and check a study file (the configs of its cells are checked by `cells.study_cells`)."""
    path = Path(path)
    if not path.is_file():
        raise StudyError(f"study file '{path}' does not exist")
    try:
        table = tomllib.loads(path.read_text(encoding="utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise StudyError(f"study file '{path}' is not valid TOML: {e}") from None
    r = _Reader(path, table, "", STUDY_KEYS)
    name = r.get("name", str, "a name", path.stem)
    if not name or not name.replace("_", "").replace("-", "").isalnum():
        r.fail("name", f"must be letters, digits, '_' and '-' (it names the default output directory), got {name!r}")
    base_name = r.get("base", str, 'the base config\'s path, relative to the study file (base = "base.toml")')
    base = (path.parent / base_name).resolve()
    if not base.is_file():
        r.fail("base", f"the base config '{base_name}' does not exist (looked for {base})")
    variants = r.variant_list("variants")
    if not variants:
        r.fail("variants", f"must list at least one variant of {', '.join(BLOCK_VARIANTS)}")
    seeds = r.get("seeds", list, "a list of train.seed values, e.g. seeds = [0, 1, 2]")
    if not seeds:
        r.fail("seeds", "must list at least one train.seed, e.g. seeds = [0, 1, 2]")
    if not all(isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in seeds) or len(set(seeds)) != len(seeds):
        r.fail("seeds", f"must be distinct integers >= 0, got {seeds}")
    tokens = r.get("tokens", int, "the token budget, steps x global batch x seq_len (e.g. tokens = 51200)")
    if tokens <= 0:
        r.fail("tokens", f"must be positive, got {tokens}")
    lrs = _read_lrs(path, r.get("lrs", list, "the learning-rate settings ([[lrs]] tables)"), variants)
    drills = _read_drills(path, r.get("drills", list, "a list of [[drills]] tables", []), variants, lrs, tuple(seeds))
    val_tokens = r.get("val_tokens", int, "the validation tokens, eval.batches x global batch x seq_len", None)
    if val_tokens is not None and val_tokens <= 0:
        r.fail("val_tokens", f"must be positive, got {val_tokens}")
    data_order = r.get("data_order", str, f"one of {', '.join(DATA_ORDERS)}", "seed")
    if data_order not in DATA_ORDERS:
        r.fail("data_order", f"must be one of {', '.join(DATA_ORDERS)} (\"seed\": each seed its own data order), "
                             f"got {data_order!r}")
    keep = r.get("keep_checkpoints", bool, "true or false", False)
    return Study(path=path, name=name, base=base, variants=variants, seeds=tuple(seeds), lrs=lrs, tokens=tokens,
                 keep_checkpoints=keep, drills=drills, data_order=data_order, val_tokens=val_tokens,
                 pinned=r.get("pinned", bool, "true or false", False))
