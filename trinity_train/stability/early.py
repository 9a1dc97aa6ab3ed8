"""The guard's verdicts where its z-scores are blind: an absolute loss ceiling, and gradient-norm
jumps during the warm-up (DESIGN §7).

The z-scores judge nothing during the learning-rate warm-up and until their windows hold
`min_history` steps, yet a learning rate far too high diverges right there. Two checks need no
course:

- Loss ceiling: an untrained model's loss is about ln(vocab size) (a uniform guess). A loss above
  ln V + `loss_ceiling_margin` is worse than guessing, so it is skipped at any step; at init the
  loss is a little above ln V (logits are not exactly zero), which the margin covers.
- Warm-up gradient jump: while the gradient norm has no z verdict, a norm `warmup_grad_ratio`
  times the median of the normal norms before it (at least `MIN_NORMS` of them) is skipped. The
  median of the warm-up's own course, not a fixed bound: norms differ by model and data, and fall
  or rise over the warm-up by a few times, never ten in one step.
"""

from __future__ import annotations

import math
from collections import deque
from statistics import median

from trinity_train.config import StabilityConfig

MIN_NORMS = 3  # normal norms before a jump can be judged: the first steps' norms vary most


class EarlyChecks:
    """The loss ceiling and the warm-up's gradient norms; `add` only the norms of normal steps."""

    def __init__(self, cfg: StabilityConfig, vocab_size: int):
        on = cfg.loss_ceiling_margin > 0 and vocab_size > 1
        self.loss_ceiling = math.log(vocab_size) + cfg.loss_ceiling_margin if on else math.inf
        self.grad_ratio = cfg.warmup_grad_ratio
        self.grad_norms: deque[float] = deque(maxlen=cfg.window)

    def above_ceiling(self, loss: float) -> bool:
        return loss > self.loss_ceiling

    def grad_jump(self, grad_norm: float) -> float | None:
        """`grad_norm` over the median of the normal norms so far, when that is a jump; else None."""
        if self.grad_ratio <= 0 or len(self.grad_norms) < MIN_NORMS:
            return None
        ratio = grad_norm / max(median(self.grad_norms), 1e-30)
        return ratio if ratio >= self.grad_ratio else None

    def add(self, grad_norm: float) -> None:
        if math.isfinite(grad_norm) and grad_norm > 0:
            self.grad_norms.append(grad_norm)

    def state_dict(self) -> dict:
        return {"grad_norms": list(self.grad_norms)}

    def load_state_dict(self, state: dict) -> None:
        self.grad_norms = deque(state["grad_norms"], maxlen=self.grad_norms.maxlen)
