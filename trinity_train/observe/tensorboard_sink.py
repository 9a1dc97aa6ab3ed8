"""TensorBoard event files under `<run.dir>/tb/`, one scalar per metric, x axis = iteration."""

from __future__ import annotations

from pathlib import Path

from trinity_train.observe.scalars import named_scalars


class TensorBoardSink:
    def __init__(self, log_dir: Path):
        from torch.utils.tensorboard import SummaryWriter  # imported lazily: slow, and optional

        self.writer = SummaryWriter(log_dir=str(log_dir))

    def write(self, kind: str, record: dict) -> None:
        for name, value in named_scalars(record, kind).items():
            self.writer.add_scalar(name, value, global_step=record["iter"])
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()
