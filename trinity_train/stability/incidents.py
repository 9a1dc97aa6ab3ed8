"""Incident reports: one JSON file per skipped step and per rollback, and the `incidents` table.

A report (`<run.dir>/incidents/XXXXXXXX.json`, named by its iteration; the format is in
docs/CONTRACT.md) says what the guard saw (the signals and z-scores of the steps before it), where
in the model the gradient was (per-layer norms of the offending step), which data it came from
(global batch indices, datasets, shards, documents, first tokens), whether a fault drill caused
it, and what the guard did. `trinity-train incidents RUN_DIR` prints them as a table, with a
`watched` row for each incident the guard opened without refusing a step (a z-score above
`incident_zscore`, a routing collapse), which has no report: it is known from its events; and a
`straggler` row for each rank the straggler rule flagged (a `straggler` event).
"""

from __future__ import annotations

from pathlib import Path

from trinity_train import signals
from trinity_train.errors import UserError
from trinity_train.files import atomic_write_json, json_safe, read_json_object
from trinity_train.records import ROLLBACK_OF, EventName, IncidentAction, named
from trinity_train.rundir import RunDir

def signal_fields() -> tuple[str, ...]:
    """The fields of a report's `signals` rows: the guard's signals (`signals.SIGNALS`) and z-scores."""
    return ("iter", "step", *(s.name for s in signals.SIGNALS), *(s.z for s in signals.SIGNALS), "skipped")


def signal_rows(records: list[dict]) -> list[dict]:
    """The guard's view of train records: their signals only."""
    fields = signal_fields()
    return [{k: r.get(k) for k in fields} for r in records]


def write_incident(run: RunDir, report: dict) -> Path:
    """Write `report` (complete or not at all) as the incident of its iteration."""
    path = run.incident(report["iter"])
    atomic_write_json(path, json_safe(report))
    return path


def read_incidents(run: RunDir) -> list[dict]:
    """Every incident report of the run, in iteration order."""
    return [read_json_object(path, UserError, "incident report") for _, path in run.incident_files()]


WATCHED = "watched"  # the table's action for an incident no step of which was refused


def watched_incidents(events: list[dict], reports: list[dict]) -> list[dict]:
    """The incidents the guard opened (`incident_open` events) that no report belongs to, as
    rows for the table: onset iteration and step, the signal as the reason, its z, and the
    iteration that closed it (None: still open)."""
    reported = {r.get("onset_iter") for r in reports} | {r["iter"] for r in reports}
    closed = {e.get("onset_iter"): e.get("iter") for e in named(events, EventName.INCIDENT_CLOSE)}
    return [{"iter": e["iter"], "step": e.get("step"), "action": WATCHED, "reason": e.get("signal"), "z": e.get("z"),
             "closed_iter": closed.get(e["iter"])}
            for e in named(events, EventName.INCIDENT_OPEN) if e.get("iter") not in reported]


STRAGGLER = "straggler"  # the table's action for a `straggler` event (health/straggler.py)


def straggler_rows(events: list[dict]) -> list[dict]:
    """The `straggler` events as rows for the table: the event's fields, action `straggler`."""
    return [{"iter": e["iter"], "step": e.get("step"), "action": STRAGGLER,
             **{k: e.get(k) for k in ("rank", "host", "compute_s", "median_s", "ratio", "reports")}}
            for e in named(events, EventName.STRAGGLER)]


def incident_rows(run: RunDir) -> list[dict]:
    """Every incident of the run in iteration order: its reports, its watched incidents and its
    stragglers."""
    reports = read_incidents(run)
    events = run.read_events()
    return sorted(reports + watched_incidents(events, reports) + straggler_rows(events), key=lambda r: r["iter"])


def _number(value, fmt: str) -> str:
    """`value` formatted, or a dash as wide as the format."""
    width = int(fmt.split(".")[0]) if fmt[0].isdigit() else 0
    return f"{'-':>{width}}" if value is None else format(value, fmt)


def _signal_columns(row: dict) -> str:
    """The table's columns of the guard's signals in `row` (a report's `signals` row): value and z."""
    return " ".join(f"{_number(row.get(s.name), s.fmt)} {_number(row.get(s.z), '7.1f')}" for s in signals.SIGNALS)


def _data(report: dict) -> str:
    batches = report.get("batches") or []
    if not batches:
        return "-"
    first = batches[0]
    docs = first.get("documents") or []
    where = ""
    if docs:
        d = docs[0]
        where = f" {Path(d['dataset']).name} shard {d['shard']} doc {d['document']}"
        if len(docs) > 1:
            where += f" (+{len(docs) - 1} rows)"
    more = f" +{len(batches) - 1} batches" if len(batches) > 1 else ""
    return f"batch {first['index']}{more}:{where}"


def format_table(reports: list[dict]) -> str:
    """One line per incident (`incident_rows`): iteration, step, action, reason, signals, z-scores,
    drill, data."""
    if not reports:
        return "no incidents"
    titles = " ".join(f"{s.label:>{s.width}} {s.z_label:>7}" for s in signals.SIGNALS)
    header = f"{'iter':>7} {'step':>6}  {'action':<14} {'reason':<12} {titles}  {'drill':<14} data"
    none = _signal_columns({})
    lines = [header]
    for r in reports:
        if r["action"] == WATCHED:
            z = "" if r.get("z") is None else f"z {r['z']:.1f}, "
            until = "still open" if r.get("closed_iter") is None else f"closed at iteration {r['closed_iter']}"
            lines.append(f"{r['iter']:>7} {_number(r.get('step'), '6')}  {WATCHED:<14} {r.get('reason') or '-':<12} "
                         f"{none}  {'-':<14} {z}{until}, no step refused")
            continue
        if r["action"] == STRAGGLER:
            lines.append(f"{r['iter']:>7} {_number(r.get('step'), '6')}  {STRAGGLER:<14} {'slow rank':<12} "
                         f"{none}  {'-':<14} rank {r['rank']} (host {r['host']}): "
                         f"compute {r['compute_s']:.3g} s per iteration, {r['ratio']:.1f}x the other ranks' median "
                         f"{r['median_s']:.3g} s, {r['reports']} reports in a row")
            continue
        current = next((s for s in reversed(r.get("signals") or []) if s.get("iter") == r["iter"]), {})
        drill = ",".join(f["fault"] for f in r.get("drill") or []) or "-"
        action = r["action"]
        if action == IncidentAction.ROLLBACK and r.get(ROLLBACK_OF):
            action = f"{action}->{r[ROLLBACK_OF]['to_step']}"
        lines.append(f"{r['iter']:>7} {r['step']:>6}  {action:<14} {r.get('reason') or '-':<12} "
                     f"{_signal_columns(current)}  {drill:<14} {_data(r)}")
    return "\n".join(lines)
