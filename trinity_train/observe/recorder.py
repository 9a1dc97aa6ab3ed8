"""Fan a run's records out to every configured sink.

- `metrics.jsonl`: one object per training iteration (kind `train`), one per validation
  (`val`), one per layer-statistics iteration (`layers`) and one per rank-statistics report
  (`ranks`), built by `records`; TensorBoard and
  W&B get the same numbers as scalars (and lists of lists as histograms, `observe/scalars.py`).
- `events.jsonl`: what happened to the run (start, resume, checkpoint saved, step skipped, end).
- the console: progress bar or periodic lines.
Only the main process (rank 0) writes; the others get a recorder that discards.
"""

from __future__ import annotations

import time
from pathlib import Path

from trinity_train.callbacks import TrainerCallback
from trinity_train.columnar import MirrorWriter
from trinity_train.config import Config
from trinity_train.observe.jsonl import JsonlWriter, move_records
from trinity_train.observe.progress import ProgressDisplay
from trinity_train.records import FAILED, EventName, RecordKind, event, layers_record
from trinity_train.rundir import RunDir


def supersede_records_after(run_dir: RunDir, iteration: int) -> int:
    """On a resume from iteration `iteration`, move what an interrupted or earlier run logged past
    it from metrics.jsonl to metrics.superseded.jsonl (each record marked `superseded_at`), so
    metrics.jsonl reads exactly like an uninterrupted run's and nothing is lost. Returns how many
    records moved."""
    return move_records(run_dir.metrics, run_dir.superseded, lambda r: r.get("iter", 0) > iteration,
                        mark={"superseded_at": iteration})


class MetricsRecorder:
    def __init__(self, cfg: Config, run_dir: Path, start_step: int, is_main: bool = True):
        self.is_main = is_main
        self.sinks: list = []
        self.metrics = None
        self.mirror = None
        self.event_log = None
        self.progress = None
        if not is_main:
            return
        run = RunDir(run_dir)
        self.event_log = JsonlWriter(run.events)
        if cfg.metrics.jsonl:
            self.metrics = JsonlWriter(run.metrics)
            self.mirror = MirrorWriter(run.metrics_mirror, run.metrics)
        if cfg.metrics.tensorboard:
            from trinity_train.observe.tensorboard_sink import TensorBoardSink

            self.sinks.append(TensorBoardSink(run.tensorboard))
        if cfg.metrics.wandb:
            from trinity_train.observe.wandb_sink import WandbSink

            self.sinks.append(WandbSink(cfg, run.path))
        self.progress = ProgressDisplay(cfg.train.steps, start_step, cfg.metrics.progress_bar, cfg.train.log_every)

    def _write(self, kind: RecordKind, record: dict) -> None:
        record = {"kind": kind, **record}
        if self.metrics is not None:
            self.mirror.append(record, self.metrics.write(record))
        for sink in self.sinks:
            sink.write(kind, record)

    def train(self, record: dict) -> None:
        if self.is_main:
            self._write(RecordKind.TRAIN, record)
            self.progress.update(record)

    def validation(self, record: dict) -> None:
        if self.is_main:
            self._write(RecordKind.VAL, record)
            self.progress.validation(record["val_loss"], record["step"])

    def layers(self, record: dict) -> None:
        """A per-layer statistics record (`observe/layer_stats.py`)."""
        if self.is_main:
            self._write(RecordKind.LAYERS, record)

    def ranks(self, record: dict) -> None:
        """A per-rank statistics record (`health/rank_stats.py`)."""
        if self.is_main:
            self._write(RecordKind.RANKS, record)

    def passkey(self, record: dict) -> None:
        """A passkey retrieval probe's record (`evaluation/passkey.py`)."""
        if self.is_main:
            self._write(RecordKind.PASSKEY, record)

    def notice(self, text: str) -> None:
        """Tell the person watching the console (skips, rollbacks, drills)."""
        if self.is_main:
            self.progress.message(text)

    def event(self, built: dict) -> None:
        """Record one event (built by `records.event`), stamped with the time after its name."""
        if self.is_main:
            self.event_log.write({"event": built["event"], "time": time.time(),
                                  **{k: v for k, v in built.items() if k != "event"}})

    def events(self, events) -> None:
        for built in events:
            self.event(built)

    def close(self) -> None:
        if not self.is_main:
            return
        self.progress.close()
        for sink in self.sinks:
            sink.close()
        if self.mirror is not None:
            self.mirror.close()
        for writer in (self.metrics, self.event_log):
            if writer is not None:
                writer.close()


class RecordingCallback(TrainerCallback):
    """Writes what the loop reports to the trainer's recorder: each step's `train` record (and
    its `layers` record on statistics iterations), each committed checkpoint, the halt and the
    end. The trainer closes the recorder after every `on_end`."""

    def after_step(self, trainer, result, record) -> None:
        trainer.recorder.train(record)
        if result.layer_stats is not None:
            trainer.recorder.layers(layers_record(iter=trainer.state.iteration, step=trainer.state.step,
                                                  **result.layer_stats))

    def after_checkpoint(self, trainer, step, iteration, path) -> None:
        trainer.recorder.event(event(EventName.CHECKPOINT, step=step, iter=iteration, path=str(path),
                                     async_save=trainer.cfg.checkpoint.async_save))

    def on_halt(self, trainer, error) -> None:
        trainer.recorder.event(event(EventName.HALT, iter=trainer.state.iteration, step=trainer.state.step,
                                     reason=" ".join(str(error).split()), exit_code=error.exit_code))

    def on_end(self, trainer, summary) -> None:
        # A loop that raised (a lost peer, a crash) did not end: its run reads as a killed one
        # (records.run_status: running) and its attempt's timeline says failed.
        if summary.status == FAILED:
            return
        trainer.recorder.event(event(EventName.RUN_END, step=summary.step, iter=summary.iteration,
                                     wall_s=summary.wall_s))
