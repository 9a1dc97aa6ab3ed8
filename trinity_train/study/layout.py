"""The one place that names a study directory's files (`trinity-train ablate --out DIR`).

| name                  | what                                                                  |
|-----------------------|-----------------------------------------------------------------------|
| `cells/NAME/`         | each cell's run directory (`rundir.RunDir`): metrics, events, ...      |
| `configs/NAME.toml`   | each cell's resolved config (`trinity-train train --config` reruns it) |
| `logs/NAME.log`       | each cell's console output, every attempt appended                    |
| `study_state.json`    | what the runner knows of each cell (outcome, exit code, wall time)    |
| `.ablate.lock`        | held by the `ablate` that is running in this directory               |
| `summary.json`        | every measurement of every cell, and the means over seeds             |
| `report.md`           | the tables (mean ± std over seeds; one row per cell)                  |
| `plots/*.png`         | loss curves, gradient norm and residual RMS by layer, spikes by LR    |
| `report.html`         | the dashboard's offline report over every cell                        |
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from trinity_train.rundir import RunDir

STATE_FILE = "study_state.json"
SUMMARY_FILE = "summary.json"
TABLE_FILE = "report.md"
HTML_FILE = "report.html"
PLOTS_DIR = "plots"
LOCK_FILE = ".ablate.lock"


@dataclass(frozen=True)
class StudyDir:
    path: Path

    def __init__(self, path: str | Path):
        # as given: relative to the working directory the cells run in too, so that a study
        # written into the repository (docs/studies/...) names no machine's absolute paths
        object.__setattr__(self, "path", Path(path))

    def cell(self, name: str) -> RunDir:
        return RunDir(self.path / "cells" / name)

    def cell_config(self, name: str) -> Path:
        return self.path / "configs" / f"{name}.toml"

    def cell_log(self, name: str) -> Path:
        return self.path / "logs" / f"{name}.log"

    @property
    def state(self) -> Path:
        return self.path / STATE_FILE

    @property
    def lock(self) -> Path:
        return self.path / LOCK_FILE

    @property
    def summary(self) -> Path:
        return self.path / SUMMARY_FILE

    @property
    def table(self) -> Path:
        return self.path / TABLE_FILE

    @property
    def html(self) -> Path:
        return self.path / HTML_FILE

    def plot(self, name: str) -> Path:
        return self.path / PLOTS_DIR / f"{name}.png"
