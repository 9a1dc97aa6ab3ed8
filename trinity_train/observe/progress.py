"""What the console shows while training: a tqdm bar (step, loss, tokens/s, ETA) or, with
`metrics.progress_bar = false`, one plain line every `train.log_every` iterations."""

from __future__ import annotations

import sys
import time

from tqdm import tqdm


def _duration(seconds: float) -> str:
    seconds = int(max(0, seconds))
    hours, rest = divmod(seconds, 3600)
    return f"{hours}h{rest // 60:02d}m" if hours else f"{rest // 60}m{rest % 60:02d}s"


class ProgressDisplay:
    def __init__(self, total_steps: int, start_step: int, bar: bool, log_every: int):
        self.total = total_steps
        self.start_step = start_step
        self.log_every = log_every
        self.started = time.perf_counter()
        self.last_val: float | None = None
        self.bar = tqdm(total=total_steps, initial=start_step, unit="step", dynamic_ncols=True,
                        file=sys.stderr, desc="train") if bar else None

    def _postfix(self, record: dict) -> dict:
        postfix = {"loss": f"{record['loss']:.4f}", "tok/s": f"{record['tokens_per_s']:,.0f}"}
        if self.last_val is not None:
            postfix["val"] = f"{self.last_val:.4f}"
        return postfix

    def update(self, record: dict) -> None:
        if self.bar is not None:
            self.bar.set_postfix(self._postfix(record), refresh=False)
            self.bar.update(record["step"] - self.bar.n)
        elif record["iter"] % self.log_every == 0 or record["step"] == self.total:
            done = record["step"] - self.start_step
            elapsed = time.perf_counter() - self.started
            eta = elapsed / done * (self.total - record["step"]) if done else 0.0
            fields = " ".join(f"{k} {v}" for k, v in self._postfix(record).items())
            print(f"step {record['step']}/{self.total} {fields} lr {record['lr']:.2e} eta {_duration(eta)}",
                  flush=True)

    def validation(self, val_loss: float, step: int) -> None:
        self.last_val = val_loss
        self.message(f"step {step}: validation loss {val_loss:.4f}")

    def message(self, text: str) -> None:
        """A line above the bar (or among the periodic lines)."""
        if self.bar is not None:
            self.bar.write(text, file=sys.stderr)
        else:
            print(text, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
