"""TensorBoard event files under `<run.dir>/tb/`, one scalar per metric (and a histogram per row of
a list of lists, e.g. tokens per expert), x axis = iteration."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from trinity_train.observe.scalars import named_values


class TensorBoardSink:
    def __init__(self, log_dir: Path):
        from torch.utils.tensorboard import SummaryWriter  # imported lazily: slow, and optional

        self.writer = SummaryWriter(log_dir=str(log_dir))

    def write(self, kind: str, record: dict) -> None:
        scalars, histograms = named_values(record, kind)
        for name, value in scalars.items():
            self.writer.add_scalar(name, value, global_step=record["iter"])
        for name, values in histograms.items():
            self.writer.add_histogram(name, np.asarray(values), global_step=record["iter"])
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()
