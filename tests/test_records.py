"""The records module is the run's record contract: docs/CONTRACT.md's tables of events, metrics
records and incident-report fields say what `trinity_train/records.py` builds, field for field and
in order, and the builders refuse a field the contract does not name."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from trinity_train import records
from trinity_train.observe import layer_record
from trinity_train.records import ENDED, HALTED, RUNNING, EventName, IncidentAction, RecordKind, event

CONTRACT = Path(__file__).resolve().parents[1] / "docs" / "CONTRACT.md"


def _names(cell: str) -> tuple[str, ...]:
    return tuple(re.findall(r"`([^`]+)`", cell))


def contract_table(heading: str) -> list[list[str]]:
    """The cells of the first table under the CONTRACT heading that starts with `heading`."""
    text = CONTRACT.read_text(encoding="utf-8")
    section = text[text.index(heading):]
    section = section[:section.index("\n#", 1)]
    rows = [line for line in section.splitlines() if line.startswith("|")]
    return [[c.strip() for c in row.strip("|").split("|")] for row in rows[2:]]  # past header and rule


def shapes_of(heading: str) -> dict[str, tuple[tuple[str, ...], frozenset[str]]]:
    return {_names(name)[0]: (_names(fields), frozenset(_names(optional)))
            for name, fields, optional, _ in contract_table(heading)}


def test_contract_lists_every_event_with_its_fields_in_order():
    documented = shapes_of("### `events.jsonl`")
    built = {str(name): (shape.fields, shape.optional) for name, shape in records.EVENTS.items()}
    assert documented == built
    assert set(built) == {str(name) for name in EventName}


def test_contract_lists_every_record_kind_with_its_fields_in_order():
    documented = shapes_of("### `metrics.jsonl`")
    built = {str(kind): (shape.fields, shape.optional) for kind, shape in records.RECORDS.items()}
    assert documented == built
    assert set(built) == {str(kind) for kind in RecordKind}


def test_contract_lists_every_timeline_kind_with_its_fields_in_order():
    documented = shapes_of("### `timeline.jsonl`")
    built = {str(kind): (shape.fields, shape.optional) for kind, shape in records.TIMELINE.items()}
    assert documented == built
    assert set(built) == {str(kind) for kind in records.TimelineKind}


def test_contract_lists_the_incident_report_fields_in_order():
    rows = contract_table("### `incidents/")
    assert tuple(_names(row[0])[0] for row in rows) == records.INCIDENT.fields
    assert {_names(row[0])[0] for row in rows if "*optional*" in row[1]} == records.INCIDENT.optional
    actions = next(row[1] for row in rows if row[0] == "`action`")
    assert _names(actions) == tuple(IncidentAction)


def test_layers_record_fields_are_those_observe_names():
    observed = (*layer_record.PER_LAYER_FIELDS, "norm_gain", layer_record.MOE_LAYERS, *layer_record.MOE_FIELDS)
    assert records.RECORDS[RecordKind.LAYERS].fields == ("iter", "step", *observed)


def test_builders_write_fields_in_contract_order_and_refuse_unknown_or_missing_ones():
    built = event(EventName.RUN_END, wall_s=1.5, iter=3, step=2)
    assert json.dumps(built) == '{"event": "run_end", "step": 2, "iter": 3, "wall_s": 1.5}'
    with pytest.raises(TypeError, match="unknown fields"):
        event(EventName.RUN_END, step=2, iter=3, wall_s=1.5, extra=1)
    with pytest.raises(TypeError, match=r"missing fields \['wall_s'\]"):
        event(EventName.RUN_END, step=2, iter=3)


def test_optional_fields_are_left_out_when_none_others_are_written_as_null():
    fault = event(EventName.FAULT_INJECTED, iter=1, batch=0, fault="nan_loss", rank=None, factor=None, token=None)
    assert fault == {"event": "fault_injected", "iter": 1, "batch": 0, "fault": "nan_loss", "rank": None}
    report = records.incident_report(iter=1, step=0, action=IncidentAction.SKIP, reason="nonfinite", onset_iter=1,
                                     signals=[], layer_grad_norms={}, batches=[], drill=[], lr={}, rollback=None)
    assert "rollback" not in report and json.dumps(report["action"]) == '"skip"'


def _events(*names: EventName) -> list[dict]:
    return [{"event": name} for name in names]


@pytest.mark.parametrize("names, status", [
    ((), RUNNING),
    ((EventName.RUN_START,), RUNNING),
    ((EventName.RUN_START, EventName.RUN_END), ENDED),
    ((EventName.RUN_START, EventName.HALT, EventName.RUN_END), HALTED),
    ((EventName.RUN_START, EventName.HALT, EventName.RUN_END, EventName.RUN_START), RUNNING),
    ((EventName.RUN_START, EventName.HALT, EventName.RUN_END, EventName.RUN_START, EventName.RUN_END), ENDED),
    ((EventName.RUN_END,), ENDED),
])
def test_run_status_reads_what_followed_the_latest_start(names, status):
    assert records.run_status(_events(*names)) == status
