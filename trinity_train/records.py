"""The one owner of what a run records (docs/CONTRACT.md "Run directory"): the names and fields of
the events in `events.jsonl`, of the `train` / `val` / `layers` records in `metrics.jsonl`, and of
the incident reports in `incidents/`, and the run's status read back from its events.

Writers build every record here (`event`, `train_record`, `val_record`, `layers_record`,
`passkey_record`, `incident_report`): each kind has one `Shape`, its fields in the order they are written, and a
record with a field the shape does not know, or without one it requires, is a bug caught where it
is built. Readers name what they look for by the constants (`EventName.ROLLBACK`,
`RecordKind.TRAIN`, `IncidentAction.HALT`); they are `str`s, so comparisons with what a JSON file
holds and the JSON written are the plain strings. tests/test_records.py holds the tables of
docs/CONTRACT.md against the shapes below.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import Any, Iterable

from trinity_train import signals


class EventName(StrEnum):
    """The `event` of each line of events.jsonl."""

    RUN_START = "run_start"
    RESUME = "resume"
    INIT_FROM = "init_from"
    CONTEXT_EXTENDED = "context_extended"
    CONFIG_CHANGED = "config_changed"
    SCHEDULE_REPLANNED = "schedule_replanned"
    SUPERSEDED = "superseded"
    CHECKPOINT = "checkpoint"
    CHECKPOINT_PASSED_OVER = "checkpoint_passed_over"
    CHECKPOINTS_ABANDONED = "checkpoints_abandoned"
    FAULT_INJECTED = "fault_injected"
    INCIDENT_OPEN = "incident_open"
    INCIDENT_CLOSE = "incident_close"
    ROUTING_COLLAPSE = "routing_collapse"
    SKIP = "skip"
    GUARD_OBSERVED = "guard_observed"
    ROLLBACK = "rollback"
    ROLLBACK_UNAVAILABLE = "rollback_unavailable"
    LR_BACKOFF = "lr_backoff"
    HALT = "halt"
    CHECKPOINT_FAILED = "checkpoint_failed"
    RANK_HOSTS = "rank_hosts"
    STRAGGLER = "straggler"
    HANG = "hang"
    RUN_END = "run_end"


class RecordKind(StrEnum):
    """The `kind` of each line of metrics.jsonl."""

    TRAIN = "train"
    VAL = "val"
    LAYERS = "layers"
    RANKS = "ranks"
    PASSKEY = "passkey"


class Phase(StrEnum):
    """What a rank is doing (the training loop's phases: `callbacks.TrainerCallback.phase_begin`);
    the timeline's spans and the watchdog's limits are per phase."""

    STARTUP = "startup"  # process start to the first iteration: imports, build, restore
    DATA = "data"  # drawing the next batch (and the drills acting before the step)
    STEP = "step"  # forward, backward, optimizer; the step's records
    VALIDATION = "validation"
    CHECKPOINT_SAVE = "checkpoint_save"  # the blocking part of a save (an async save's copy)
    CHECKPOINT_LOAD = "checkpoint_load"  # a resume's or a rollback's restore
    STATISTICS = "statistics"  # gathering the ranks' statistics
    SHUTDOWN = "shutdown"  # the end: waiting for the last save, closing the records


class TimelineKind(StrEnum):
    """The `kind` of each line of timeline.jsonl: where every second of every attempt went."""

    ATTEMPT = "attempt"
    ITERATION = "iteration"
    SPAN = "span"
    END = "end"


class IncidentAction(StrEnum):
    """What the guard did about an incident (the report's `action`)."""

    SKIP = "skip"
    ROLLBACK = "rollback"
    HALT = "halt"


RUNNING, ENDED, HALTED = "running", "ended", "halted"
FAILED = "failed"  # an attempt that ended with an error (timeline.jsonl's `end`)


# Stand-ins in a shape for the guard's signals' fields (signals.SIGNALS, read when a record is
# built): their values (those the shape does not name already) and their z-scores.
SIGNAL_VALUES, SIGNAL_ZS = "<signals>", "<signals_z>"


@dataclass(frozen=True)
class Shape:
    """The fields of one kind of record, in the order they are written. An `optional` field given
    as None is left out (a train record has `lr_muon` only with Muon); every other field is
    written, null included."""

    template: tuple[str, ...]  # the fields, the signals' stand-ins included
    optional: frozenset[str] = frozenset()

    @property
    def fields(self) -> tuple[str, ...]:
        out: list[str] = []
        for name in self.template:
            if name == SIGNAL_VALUES:
                out += [s.name for s in signals.SIGNALS if s.name not in self.template]
            elif name == SIGNAL_ZS:
                out += [s.z for s in signals.SIGNALS]
            else:
                out.append(name)
        return tuple(out)

    def build(self, what: str, values: dict[str, Any]) -> dict[str, Any]:
        fields = self.fields
        unknown = values.keys() - set(fields)
        missing = set(fields) - self.optional - values.keys()
        if unknown or missing:
            raise TypeError(f"{what}: unknown fields {sorted(unknown)}, missing fields {sorted(missing)}")
        return {k: values[k] for k in fields if k in values and not (k in self.optional and values[k] is None)}


def _shape(fields: str, optional: str = "") -> Shape:
    return Shape(tuple(fields.split()), frozenset(optional.split()))


EVENTS: dict[EventName, Shape] = {
    EventName.RUN_START: _shape("step iter device devices resumed_from"),
    EventName.RESUME: _shape("checkpoint step iter sample_order", optional="sample_order"),
    EventName.INIT_FROM: _shape("checkpoint"),
    EventName.CONTEXT_EXTENDED: _shape("checkpoint step from_seq_len to_seq_len optimizer"),
    EventName.CONFIG_CHANGED: _shape("changes"),
    EventName.SCHEDULE_REPLANNED: _shape("step schedule from_steps to_steps lr_from lr_to"),
    EventName.SUPERSEDED: _shape("from_iter records"),
    EventName.CHECKPOINT: _shape("step iter path async_save"),
    EventName.CHECKPOINT_PASSED_OVER: _shape("path reason"),
    EventName.CHECKPOINTS_ABANDONED: _shape("step checkpoints moved_to"),
    EventName.FAULT_INJECTED: _shape("iter batch fault rank factor token seconds", optional="factor token seconds"),
    EventName.INCIDENT_OPEN: _shape("iter step signal z"),
    EventName.INCIDENT_CLOSE: _shape("iter onset_iter calm_steps"),
    EventName.ROUTING_COLLAPSE: _shape("iter step layer max_load dead_experts"),
    EventName.SKIP: _shape(f"iter step batch reason {SIGNAL_VALUES} {SIGNAL_ZS} incident"),
    EventName.GUARD_OBSERVED: _shape(f"iter step action reason {SIGNAL_VALUES} {SIGNAL_ZS} onset_iter"),
    EventName.ROLLBACK: _shape("iter from_step to_step to_iter checkpoint skipped_batches rollbacks onset_iter "
                               "repeat lr_scale discarded_checkpoints incident"),
    EventName.ROLLBACK_UNAVAILABLE: _shape("iter step reason"),
    EventName.LR_BACKOFF: _shape("iter scale ramp_steps"),
    EventName.HALT: _shape("iter step reason exit_code"),
    EventName.CHECKPOINT_FAILED: _shape("step iter error"),
    EventName.RANK_HOSTS: _shape("hosts"),
    EventName.STRAGGLER: _shape("iter step rank host compute_s median_s ratio reports"),
    EventName.HANG: _shape("iter rank host phase waited_s limit_s stacks behind exit_code"),
    EventName.RUN_END: _shape("step iter wall_s"),
}

_MOE_LOAD = "moe_max_load moe_min_load moe_cv moe_max_load_per_layer moe_min_load_per_layer moe_cv_per_layer"
RECORDS: dict[RecordKind, Shape] = {
    RecordKind.TRAIN: _shape("iter step batch loss aux_loss z_loss grad_norm lr lr_muon tokens tokens_seen "
                             f"tokens_per_s step_time_s mfu skipped {SIGNAL_ZS} skip_reason lr_scale {_MOE_LOAD} "
                             f"{SIGNAL_VALUES}",
                             optional=f"lr_muon skip_reason lr_scale {_MOE_LOAD}"),
    RecordKind.VAL: _shape("iter step val_loss val_ppl val_tokens val_position_starts val_loss_by_position "
                           "val_tokens_by_position",
                           optional="val_position_starts val_loss_by_position val_tokens_by_position"),
    RecordKind.LAYERS: _shape("iter step grad_norm_attn grad_norm_ffn residual_rms attn_out_rms attn_post_rms "
                              "ffn_out_rms ffn_post_rms act_max_over_median act_kurtosis norm_gain moe_layers "
                              "tokens_per_expert expert_bias_spread router_entropy experts_without_tokens"),
    RecordKind.RANKS: _shape("iter step iterations iter_s compute_s wait_s data_s comm_exposed_s"),
    RecordKind.PASSKEY: _shape("iter step passkey_lengths passkey_accuracy passkey_logprob passkey_logprob_other_key "
                               "passkey_prompts"),
}

TIMELINE: dict[TimelineKind, Shape] = {
    TimelineKind.ATTEMPT: _shape("host pid process_start start iter step devices restart"),
    TimelineKind.ITERATION: _shape("iter step batch skipped start end phases rollback_to_iter failed",
                                   optional="rollback_to_iter failed"),
    TimelineKind.SPAN: _shape("phase iter start end"),
    TimelineKind.END: _shape("iter step end status"),
}

# List fields whose positions another field of the record names (a position bucket's first
# position, a prompt length): a sink labels each value by it, e.g. `val_loss_by_position/1024`.
INDEXED_BY = {"val_loss_by_position": "val_position_starts", "val_tokens_by_position": "val_position_starts",
              "passkey_accuracy": "passkey_lengths", "passkey_logprob": "passkey_lengths",
              "passkey_logprob_other_key": "passkey_lengths", "passkey_prompts": "passkey_lengths"}

ROLLBACK_OF = "rollback"  # the incident report's field holding its rollback event's fields
INCIDENT = _shape(f"iter step action reason onset_iter signals layer_grad_norms batches drill lr {ROLLBACK_OF}",
                  optional=ROLLBACK_OF)


def event(name: EventName, **fields: Any) -> dict[str, Any]:
    """The event `name` as written to events.jsonl (less the `time` the recorder stamps on it)."""
    return {"event": name, **EVENTS[name].build(f"event {name}", fields)}


def fields_of(event_: dict[str, Any]) -> dict[str, Any]:
    """An event's fields without its name (what an incident report holds of its rollback)."""
    return {k: v for k, v in event_.items() if k != "event"}


def train_record(**fields: Any) -> dict[str, Any]:
    """A `train` record of metrics.jsonl (the recorder adds its `kind`)."""
    return RECORDS[RecordKind.TRAIN].build("train record", fields)


def val_record(**fields: Any) -> dict[str, Any]:
    return RECORDS[RecordKind.VAL].build("val record", fields)


def layers_record(**fields: Any) -> dict[str, Any]:
    return RECORDS[RecordKind.LAYERS].build("layers record", fields)


def ranks_record(**fields: Any) -> dict[str, Any]:
    """A `ranks` record of metrics.jsonl: per-rank lists (index = rank) of the mean seconds per
    iteration over the `iterations` since the previous one."""
    return RECORDS[RecordKind.RANKS].build("ranks record", fields)


def passkey_record(**fields: Any) -> dict[str, Any]:
    """A `passkey` record of metrics.jsonl: the passkey retrieval probe, lists by prompt length."""
    return RECORDS[RecordKind.PASSKEY].build("passkey record", fields)


def timeline_record(kind: TimelineKind, **fields: Any) -> dict[str, Any]:
    """A line of timeline.jsonl (`kind` first); times are Unix seconds, `phases` maps a `Phase`
    to its seconds inside an iteration."""
    return {"kind": kind, **TIMELINE[kind].build(f"timeline {kind}", fields)}


def incident_report(**fields: Any) -> dict[str, Any]:
    """The report of one incident (`incidents/XXXXXXXX.json`); `action` is an IncidentAction."""
    return INCIDENT.build("incident report", fields)


def named(events: Iterable[dict], *names: EventName) -> list[dict]:
    """The events among `events` with one of `names`, in order."""
    return [e for e in events if e.get("event") in names]


def latest_start(events: list[dict]) -> list[dict] | None:
    """The events from the latest `run_start` on (the latest start of the run and what followed
    it), or None before any start."""
    starts = [i for i, e in enumerate(events) if e.get("event") == EventName.RUN_START]
    return events[starts[-1]:] if starts else None


def run_status(events: list[dict]) -> str:
    """RUNNING, ENDED or HALTED, from what followed the latest `run_start`: HALTED when the trainer
    halted it (a halted run's `run_end` follows its `halt`), ENDED after a `run_end`, RUNNING
    otherwise (still going, or killed before it could write its end); a log without a start is
    read whole."""
    latest = latest_start(events) or events
    if named(latest, EventName.HALT):
        return HALTED
    return ENDED if named(latest, EventName.RUN_END) else RUNNING
