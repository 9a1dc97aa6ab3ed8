"""Decide whether an optimizer step is applied, skipped, or ends in a rollback (DESIGN §7).

The verdict depends only on the step's global loss, global pre-clip gradient norm and global
tokens per expert (reduced over all ranks before this is called) and on the guard's own history,
which is identical on every rank, so every rank takes the same branch without further
communication.

- A step whose loss or gradient norm is not finite is skipped (`skip_nonfinite`).
- The steps the z-scores cannot judge are judged without a course (`early.EarlyChecks`): a loss
  above the untrained model's, ln(vocab) + `loss_ceiling_margin`, is skipped at any step
  (`loss_ceiling`); while the gradient norm has no z verdict, a norm `warmup_grad_ratio` times
  the median of the normal norms so far is skipped (`grad_jump`).
- Each signal (`signals.SIGNALS`: the loss and the gradient norm) is judged by a robust one-sided
  z-score on log values against the course (a robust line) of its last `window` normal steps
  (`detector.RollingSignal`, its own `sigma_floor`); a z of at least `spike_zscore` on any skips
  the step (the reason: that signal's spike). No z-based verdict during the learning-rate warm-up (`optim.warmup_steps`): the
  windows start filling when it ends, and judge once they hold `min_history` values.
- A step at `incident_zscore` or above (or any skip) opens an incident at that step, its onset;
  `calm_steps` normal steps in a row close it. While a signal is at incident level its values stay
  out of its window, so a slow divergence cannot drag the window up after it: it keeps rising
  against the calm baseline until it crosses `spike_zscore` and is skipped.
- A divergence too slow for `spike_zscore` (measured: the default model's learning rate x20 late
  in its cosine kept the loss at z 3-5, 50 % above its course, for 80 steps without one skip)
  shows as an incident whose steps stay at incident level: its `calm_steps`-th step at incident
  level (as many as it takes calm ones to close it) is refused (`drift`) and asks for a rollback
  at once (unless `spike_zscore` or `rollback_after` is 0: z-scores skip nothing, or there is no
  rollback to ask for). Clean runs' incidents hold one or two such steps (the default model over
  1,000 steps: at most 2), a drifting one dozens.
- A MoE layer collapsed (`routing.RoutingWatch`: one expert takes `routing_max_load` times the
  mean, or `routing_dead_experts` get no token) for `routing_steps` steps in a row is a
  `routing_collapse` event naming the layer, and opens an incident that stays open while it lasts.
  It never skips: skipping does not mend a router.
- A spike seen at step t was caused by an update already applied, so skipping t cannot undo it.
  When skips do not bring the signal back (`rollback_after` skips in a row, or that many in one
  open incident), the trainer is asked to roll back to a checkpoint from before the incident's
  onset (it restores this guard with everything else, but keeps the windows it had built up to the
  incident); `max_consecutive_skips` in a row halt the run. Since `rollback_after` is below
  `max_consecutive_skips` (config validation), every halt for skips is preceded by rollback
  requests, which the trainer answers whenever a checkpoint from before the onset exists.
- `mode = "observe"`: the guard judges every step exactly as above (its windows, incidents and
  streaks follow the same signals the same way) but every verdict it returns applies the step;
  a step it would have refused carries the acting verdict in `observed` and a `guard_observed`
  event (`action`: skip, rollback or halt) instead. Training is then what it is with the guard
  off, and the events say what the guard would have done: for a study that counts spikes without
  its recovery changing what follows, or for a user who wants to see the verdicts before trusting
  them. (It judges the timeline that actually trains: after a would-be rollback nothing is
  restored, so the streak goes on, and a would-be halt is followed by more.)
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from trinity_train import exit_codes, signals
from trinity_train.config import StabilityConfig
from trinity_train.errors import UserError
from trinity_train.records import EventName, event
from trinity_train.stability.detector import RollingSignal
from trinity_train.stability.early import EarlyChecks
from trinity_train.stability.routing import RoutingWatch

HALT_EXIT_CODE = exit_codes.DIVERGED  # the run stopped itself; distinct from bad input (1) and config (2)


class TrainingDivergedError(UserError):
    """Training cannot continue: the guard or the rollback policy gave up."""

    exit_code = HALT_EXIT_CODE


@dataclass
class Incident:
    """An open episode of abnormal steps, from its onset on."""

    onset_iter: int
    onset_step: int  # optimizer steps applied before the onset step
    signal: str  # "nonfinite", a signal's name ("loss", "grad_norm") or "routing": what first looked wrong
    z: float | None  # None where no z-score judged it (non-finite, ceiling, warm-up, routing)
    calm: int = 0  # normal steps in a row since the last abnormal one
    skips: int = 0  # skipped steps since the onset: skips that do not end it ask for a rollback
    drifting: int = 0  # steps at incident level by z since the onset (or since it last asked for a rollback)


@dataclass(frozen=True)
class Verdict:
    apply: bool
    reason: str = ""  # why a step is skipped: "nonfinite", a signal's spike ("loss_spike", "grad_spike"),
    #                   "loss_ceiling", "grad_jump" or "drift"
    zscores: dict[str, float | None] = field(default_factory=dict, hash=False)  # by signal name; read as `<name>_z`
    rollback: bool = False  # skipped, and the streak of skips asks for a rollback
    onset_iter: int | None = None  # the open incident's onset, if any
    onset_step: int | None = None
    events: tuple[dict, ...] = field(default=(), compare=False)  # incident_open/close, routing_collapse
    halt: str = ""  # why this skip ends the run (`max_consecutive_skips`), once it is recorded
    observed: "Verdict | None" = field(default=None, compare=False)  # observe mode: the refusal it
    #                                                                  would have made (applied anyway)

    def __getattr__(self, name: str) -> float | None:
        """`<signal>_z` (`loss_z`, `grad_norm_z`): that signal's z-score, None where none judged it."""
        signal = name[:-2] if name.endswith("_z") else None
        if signal in {s.name for s in signals.SIGNALS}:
            return self.zscores.get(signal)
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    @property
    def action(self) -> str:
        """What the verdict does: "apply", "skip", "rollback" or "halt"."""
        return "apply" if self.apply else "halt" if self.halt else "rollback" if self.rollback else "skip"


def _at_least(z: float | None, threshold: float) -> bool:
    return threshold > 0 and z is not None and z >= threshold


def _first_signal(finite: bool, reason: str, z_odd: bool,
                  zscores: dict[str, float | None]) -> tuple[str, float | None]:
    """(signal, z) of an incident's onset: what looked wrong first, and its z if one judged it
    (`z_odd`: a z-score is at incident level, or skipped the step)."""
    if not finite:
        return "nonfinite", None
    if reason == "loss_ceiling":
        return "loss", None
    if reason == "grad_jump":
        return "grad_norm", None
    if not (reason or z_odd):
        return "routing", None  # nothing else is abnormal
    highest = max(signals.SIGNALS, key=lambda s: zscores[s.name] or 0)  # the first of equals
    return highest.name, zscores[highest.name]


class StepGuard:
    def __init__(self, cfg: StabilityConfig, warmup_steps: int = 0, vocab_size: int = 0,
                 first_moe_layer: int = 0):
        """`vocab_size` sets the loss ceiling (0: none); `first_moe_layer` is the model layer of
        the first row of the tokens per expert, so routing events name model layers."""
        self.cfg = cfg
        self.warmup_steps = warmup_steps
        # Each signal's course of normal values (`signals.SIGNALS`), by name.
        self.courses = {s.name: RollingSignal(cfg.window, cfg.min_history, getattr(cfg, s.sigma_floor))
                        for s in signals.SIGNALS}
        self.early = EarlyChecks(cfg, vocab_size)
        self.routing = RoutingWatch(cfg, first_moe_layer)
        self.consecutive_skips = 0
        self.incident: Incident | None = None

    def __getattr__(self, name: str) -> RollingSignal:
        """A signal's course by the signal's name (`guard.loss`, `guard.grad_norm`)."""
        courses = self.__dict__.get("courses", {})
        if name in courses:
            return courses[name]
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    @classmethod
    def for_config(cls, cfg) -> "StepGuard":
        """The guard of a run of `cfg` (a whole `Config`)."""
        return cls(cfg.stability, warmup_steps=cfg.optim.warmup_steps, vocab_size=cfg.model.vocab_size,
                   first_moe_layer=cfg.model.num_dense_layers)

    def _reason(self, finite: bool, values: dict[str, float], zscores: dict[str, float | None]) -> str:
        """Why the step is skipped, or "": z-verdicts first, then the checks that need no course."""
        cfg = self.cfg
        if cfg.skip_nonfinite and not finite:
            return "nonfinite"
        for s in signals.SIGNALS:
            if _at_least(zscores[s.name], cfg.spike_zscore):
                return s.spike
        if finite and self.early.above_ceiling(values["loss"]):
            return "loss_ceiling"
        if finite and zscores["grad_norm"] is None and self.early.grad_jump(values["grad_norm"]) is not None:
            return "grad_jump"
        return ""

    def judge(self, loss: float, grad_norm: float, iteration: int, steps_applied: int,
              tokens_per_expert=None) -> Verdict:
        """`judge_signals` of a step measured by the loss and gradient norm alone."""
        return self.judge_signals({"loss": loss, "grad_norm": grad_norm}, iteration, steps_applied, tokens_per_expert)

    def judge_signals(self, values: dict[str, float], iteration: int, steps_applied: int,
                      tokens_per_expert=None) -> Verdict:
        """The verdict for one step with the signals' `values` (by name, `signals.SIGNALS`)
        (`_acting_verdict`); in observe mode a refusal is turned into an applied step that carries
        it (`observed`) and says so in a `guard_observed` event."""
        verdict = self._acting_verdict(values, iteration, steps_applied, tokens_per_expert)
        if verdict.apply or self.cfg.mode != "observe":
            return verdict
        observed = event(EventName.GUARD_OBSERVED, iter=iteration, step=steps_applied, action=verdict.action,
                         reason=verdict.reason, **signals.fields(values, verdict.zscores),
                         onset_iter=verdict.onset_iter)
        return replace(verdict, apply=True, reason="", rollback=False, halt="", events=verdict.events + (observed,),
                       observed=verdict)

    def _acting_verdict(self, values: dict[str, float], iteration: int, steps_applied: int,
                        tokens_per_expert=None) -> Verdict:
        """The verdict for one step (`steps_applied` optimizer steps came before it;
        `tokens_per_expert` [MoE layers, experts], global, or None to not judge routing). The
        `max_consecutive_skips`-th skip in a row carries `halt`, the reason the run stops: the
        step is recorded like any skip (record, event, ledger, incident report), then the run
        raises TrainingDivergedError with it."""
        cfg = self.cfg
        finite = all(math.isfinite(v) for v in values.values())
        judging = steps_applied >= self.warmup_steps
        zscores = {name: course.zscore(values[name], steps_applied) if judging else None
                   for name, course in self.courses.items()}

        reason = self._reason(finite, values, zscores)
        apply = not reason
        odd = {name for name, z in zscores.items() if _at_least(z, cfg.incident_zscore)}  # at incident level
        collapses = self.routing.observe(tokens_per_expert) if tokens_per_expert is not None else []
        signal = _first_signal(finite, reason, bool(odd), zscores)
        events = self._follow_incident(iteration, steps_applied, signal, skipped=not apply,
                                       abnormal=not finite or not apply or bool(odd) or self.routing.collapsed)
        drift = False
        # A z-based refusal whose point is the rollback: off where z-scores skip nothing or
        # rollbacks are off.
        if apply and odd and cfg.spike_zscore > 0 and cfg.rollback_after > 0:
            drift = self._drifted()
        if drift:
            reason, apply = "drift", False
        events += [event(EventName.ROUTING_COLLAPSE, iter=iteration, step=steps_applied, layer=c.layer,
                         max_load=c.max_load, dead_experts=c.dead_experts) for c in collapses]

        if apply:
            self.consecutive_skips = 0
            if zscores["grad_norm"] is None:  # the course that judges gradient jumps until the z-score can
                self.early.add(values["grad_norm"])
            if judging:  # only normal values of steps after warm-up judge later steps
                for name, course in self.courses.items():
                    if name not in odd:
                        course.add(values[name], steps_applied)
        halt = ""
        if not apply:
            self.consecutive_skips += 1
            if self.consecutive_skips >= cfg.max_consecutive_skips:
                halt = (f"training diverged: {self.consecutive_skips} steps in a row were skipped (last at "
                        f"iteration {iteration}, reason: {reason}; stability.max_consecutive_skips); lower "
                        "optim.lr or train.grad_clip and resume with --checkpoint.resume=auto, or resume from "
                        "an earlier checkpoint with --checkpoint.resume=PATH")
        incident = self.incident
        unrecovered = max(self.consecutive_skips, incident.skips if incident else 0)
        return Verdict(apply, reason, zscores,
                       rollback=not apply and not halt and (drift or 0 < cfg.rollback_after <= unrecovered),
                       onset_iter=incident.onset_iter if incident else None,
                       onset_step=incident.onset_step if incident else None, events=tuple(events), halt=halt)

    def _drifted(self) -> bool:
        """A step at incident level by z, in the open incident: is it the `calm_steps`-th? (The
        count starts again, so observe mode, which restores nothing, reports each such stretch.)"""
        incident = self.incident
        incident.drifting += 1
        if incident.drifting < self.cfg.calm_steps:
            return False
        incident.drifting = 0
        return True

    def _follow_incident(self, iteration: int, steps_applied: int, signal: tuple[str, float | None],
                         skipped: bool, abnormal: bool) -> list[dict]:
        if abnormal:
            opened = []
            if self.incident is None:
                name, z = signal
                self.incident = Incident(iteration, steps_applied, name, z)
                opened = [event(EventName.INCIDENT_OPEN, iter=iteration, step=steps_applied, signal=name, z=z)]
            self.incident.calm = 0
            self.incident.skips += skipped
            return opened
        if self.incident is not None:
            self.incident.calm += 1
            if self.incident.calm >= self.cfg.calm_steps:
                closed, self.incident = self.incident, None
                return [event(EventName.INCIDENT_CLOSE, iter=iteration, onset_iter=closed.onset_iter,
                              calm_steps=closed.calm)]
        return []

    def windows(self) -> dict:
        """The normal history of every signal, by its name (to carry across a rollback)."""
        return {**{name: course.state_dict() for name, course in self.courses.items()},
                "early": self.early.state_dict()}

    def keep_windows(self, windows: dict) -> None:
        """Judge on from `windows` rather than the restored ones: after a rollback the history
        up to the incident (normal steps the undone timeline took too) is the best baseline, and a
        checkpoint from early in the run may hold too little history to judge at all."""
        for name, course in self.courses.items():
            course.load_state_dict(windows[name])
        self.early.load_state_dict(windows["early"])

    def state_dict(self) -> dict:
        # The same keys whether or not an incident is open (DCP loads into the current keys), so
        # the incident is one list value: empty, or its fields in order.
        incident = [] if self.incident is None else list(vars(self.incident).values())
        return {**self.windows(), "routing": self.routing.state_dict(),
                "consecutive_skips": self.consecutive_skips, "incident": incident}

    def load_state_dict(self, state: dict) -> None:
        self.keep_windows(state)
        self.routing.load_state_dict(state["routing"])
        self.consecutive_skips = state["consecutive_skips"]
        self.incident = Incident(*state["incident"]) if state["incident"] else None
