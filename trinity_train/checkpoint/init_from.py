"""Starting a run from another run's checkpoint (`checkpoint.init_from`): a later phase.

A phase is a run of its own (its run directory, its step count from 0, its schedule over its own
`train.steps`, its own data position and spike-guard history) whose model weights, and with
`checkpoint.init_optimizer` the optimizer's state, come from a checkpoint of the run it
continues. Trinity's context extension is such a phase at a longer `data.seq_len`: the model is
the same (window and RoPE are model settings, so they cannot change), only the sequences grow, so
the global (NoPE) layers see more context (docs/guides/context-extension.md). A resume inside the
phase loads the phase's own checkpoints and never looks at `init_from` again.
"""

from __future__ import annotations

from pathlib import Path

from trinity_train.checkpoint.compat import config_from_meta
from trinity_train.checkpoint.integrity import find_sound_checkpoint, require_sound
from trinity_train.checkpoint.layout import META_FILE
from trinity_train.checkpoint.manager import read_compatible_meta
from trinity_train.config import Config
from trinity_train.errors import ConfigError
from trinity_train.records import EventName, event
from trinity_train.rundir import RunDir

# Optimizer settings that decide which state each parameter has (AdamW moments or a Muon
# momentum buffer): continuing a state needs them equal.
OPTIMIZER_LAYOUT_KEYS = ("name", "muon_router")


def init_checkpoint(path: str | Path) -> Path:
    """The checkpoint `checkpoint.init_from` names: that checkpoint, or a run directory's newest
    sound one (collective in a distributed run: rank 0 looks)."""
    path = Path(path)
    if (path / META_FILE).is_file() or not RunDir(path).checkpoints.is_dir():
        return path  # a checkpoint (require_sound says what is wrong with anything else)
    found = find_sound_checkpoint(RunDir(path).checkpoints)
    if found is None:
        raise ConfigError(f"checkpoint.init_from: the run directory '{path}' holds no sound checkpoint to start "
                          "from; name a checkpoint directory (RUN/checkpoints/step_XXXXXXXX) instead")
    return found


def check_init_from(path: Path, cfg: Config) -> Config:
    """The config of the checkpoint `path` a run of `cfg` starts from, once it is found whole and
    holds this run's model (and, with `checkpoint.init_optimizer`, an optimizer state this run's
    optimizer can continue); checked before any work."""
    require_sound(path)
    meta = read_compatible_meta(path, cfg)
    source = config_from_meta(meta, path)
    if cfg.checkpoint.init_optimizer:
        if "optim" not in meta.get("components", []):
            raise ConfigError(f"checkpoint.init_optimizer: '{path}' holds no optimizer state (a weights-only "
                              "checkpoint, e.g. from import-hf); start from its weights alone with "
                              "--checkpoint.init_optimizer=false")
        for key in OPTIMIZER_LAYOUT_KEYS:
            theirs, ours = getattr(source.optim, key), getattr(cfg.optim, key)
            if theirs != ours:
                raise ConfigError(f"optim.{key}: the optimizer state of '{path}' is for optim.{key}={theirs!r}, "
                                  f"this run has {ours!r}; set --optim.{key}={theirs!r}, or start with a fresh "
                                  "optimizer (--checkpoint.init_optimizer=false)")
    return source


def start_events(path: Path, source: Config, step: int, cfg: Config) -> list[dict]:
    """The events of a start from checkpoint `path` (of step `step`, written by a run of
    `source`): `init_from`, and `context_extended` when this run's sequences are longer."""
    events = [event(EventName.INIT_FROM, checkpoint=str(path))]
    if cfg.data.seq_len > source.data.seq_len:
        events.append(event(EventName.CONTEXT_EXTENDED, checkpoint=str(path), step=step,
                            from_seq_len=source.data.seq_len, to_seq_len=cfg.data.seq_len,
                            optimizer=cfg.checkpoint.init_optimizer))
    return events
