"""What a run's goodput account must agree with (tests/test_goodput.py, tests/test_restarts.py):
its categories add up to the wall time, which runs from the first process start to the last
attempt's `run_end`, and its kept / undone / skipped iterations are those the events and the
records say."""

from __future__ import annotations

import pytest

from trinity_train.files import read_jsonl
from trinity_train.goodput import GoodputAccount, account
from trinity_train.records import EventName, RecordKind
from trinity_train.rundir import RunDir


def checked_account(run_dir) -> GoodputAccount:
    run = RunDir(run_dir)
    result = account(run.path)
    assert result.accounted == pytest.approx(result.wall, rel=0.01)
    for attempt in result.attempts:
        assert sum(attempt.seconds.values()) == pytest.approx(attempt.wall + attempt.lost_before, rel=0.01)
    run_end = run.read_events(EventName.RUN_END)[-1]["time"]
    assert result.wall == pytest.approx(run_end - result.attempts[0].process_start, abs=0.5)

    events = read_jsonl(run.events)
    undone_by_rollbacks = {i for e in events if e["event"] == EventName.ROLLBACK
                           for i in range(e["to_iter"] + 1, e["iter"] + 1)}
    superseded = [r["iter"] for r in read_jsonl(run.superseded) if r.get("kind") == RecordKind.TRAIN]
    assert result.steps["undone"] == len(undone_by_rollbacks) + len(superseded)
    skips = {e["iter"] for e in events if e["event"] == EventName.SKIP}
    assert result.steps["skipped"] == len(skips - undone_by_rollbacks)
    kept = [r for r in run.read_metrics(RecordKind.TRAIN) if not r["skipped"] and r["iter"] not in undone_by_rollbacks]
    assert result.steps["productive"] == len(kept) == run.read_events(EventName.RUN_END)[-1]["step"]
    assert 0 < result.goodput < 1
    return result
