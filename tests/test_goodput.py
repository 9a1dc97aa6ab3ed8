"""The goodput account (`trinity-train goodput`): where a run's time went, across its attempts.

On a real drill run (tests/drill_run.py: a skipped spike, a rollback, a kill and a resume) the
categories add up to the wall time and the numbers agree with what the events and the metrics
say happened; on hand-written timelines, each rule of the account on its own.
"""

from __future__ import annotations

import json

import pytest

from conftest import assert_one_line_error, cli_in_process, run_cli
from drill_run import write_drill_run
from goodput_check import checked_account
from trinity_train.goodput import CATEGORIES, account, format_table
from trinity_train.records import EventName, TimelineKind, event, timeline_record
from trinity_train.rundir import RunDir


@pytest.fixture(scope="module")
def drill(corpus, tmp_path_factory):
    return write_drill_run(corpus, tmp_path_factory.mktemp("goodput") / "drill")


def test_a_drill_runs_time_adds_up_and_agrees_with_its_events(drill):
    result = checked_account(drill.path)
    assert len(result.attempts) == 2  # killed, then resumed
    assert result.steps["undone"] > 0
    # A rollback restores a checkpoint; checkpoints and validations were written: each has time.
    for category in ("startup", "productive", "undone", "checkpoint", "rollback", "validation"):
        assert result.seconds[category] > 0, category


def test_the_command_prints_the_table_and_the_json(drill):
    done = run_cli("goodput", str(drill.path), ok=True)
    assert "steps kept" in done.stdout and "lost to failures" in done.stdout and "goodput " in done.stdout
    assert "2 attempt(s)" in done.stdout
    as_json = json.loads(run_cli("goodput", str(drill.path), "--json", ok=True).stdout)
    assert set(as_json["seconds"]) == set(CATEGORIES) and len(as_json["attempts"]) == 2
    assert as_json["goodput"] == pytest.approx(as_json["seconds"]["productive"] / as_json["wall_s"])


def test_the_command_refuses_what_it_cannot_account_for(tmp_path, capsys):
    assert_one_line_error(*cli_in_process(capsys, "goodput", tmp_path / "absent"), 2, "does not exist")
    old = tmp_path / "old"  # a run from before timelines
    old.mkdir()
    start = event(EventName.RUN_START, step=0, iter=0, device="cpu", devices=1, resumed_from=None)
    (old / "events.jsonl").write_text(json.dumps(start) + "\n")
    assert_one_line_error(*cli_in_process(capsys, "goodput", old), 1, "has no timeline.jsonl")


def write_timeline(run_dir, *records) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    RunDir(run_dir).timeline.write_text("".join(json.dumps(r) + "\n" for r in records))


def attempt(process_start: float, start: float, iteration: int) -> dict:
    return timeline_record(TimelineKind.ATTEMPT, host="h", pid=1, process_start=process_start, start=start,
                           iter=iteration, step=iteration, devices=1, restart=None)


def iteration(i: int, start: float, end: float, skipped: bool = False, rollback_to_iter: int | None = None,
              **phases: float) -> dict:
    return timeline_record(TimelineKind.ITERATION, iter=i, step=i, batch=i - 1, skipped=skipped, start=start,
                           end=end, phases={"step": end - start, **phases}, rollback_to_iter=rollback_to_iter)


def test_a_killed_attempt_loses_its_steps_after_the_checkpoint_and_the_gap(tmp_path):
    write_timeline(
        tmp_path,
        attempt(0.0, 5.0, 0),                                    # 5 s start-up
        iteration(1, 5.0, 6.0), iteration(2, 6.0, 8.0, checkpoint_save=1.0),
        iteration(3, 8.0, 9.0), iteration(4, 9.0, 10.0),         # then killed: no end record
        attempt(13.0, 15.0, 2),                                  # 3 s lost, resumed at iteration 2
        iteration(3, 15.0, 16.0, data=0.25), iteration(4, 16.0, 17.0),
        timeline_record(TimelineKind.END, iter=4, step=4, end=17.5, status="ended"))
    result = account(tmp_path)
    assert result.wall == 17.5
    assert result.seconds["startup"] == 7.0 and result.seconds["lost"] == 3.0
    assert result.seconds["undone"] == 2.0  # iterations 3 and 4 of the first attempt
    assert result.seconds["checkpoint"] == 1.0 and result.seconds["data"] == 0.25
    assert result.seconds["productive"] == 1.0 + 1.0 + 0.75 + 1.0
    assert result.seconds["shutdown"] == 0.5
    assert result.accounted == pytest.approx(result.wall)
    assert result.steps == {"productive": 4, "undone": 2, "skipped": 0}
    assert [a.status for a in result.attempts] == [None, "ended"]
    assert result.goodput == pytest.approx(3.75 / 17.5)
    assert "killed or lost" in format_table(result)


def test_a_rollback_undoes_the_iterations_after_its_checkpoint_and_its_restore_is_its_own(tmp_path):
    write_timeline(
        tmp_path,
        attempt(0.0, 1.0, 0),
        iteration(1, 1.0, 2.0), iteration(2, 2.0, 3.0), iteration(3, 3.0, 4.0, skipped=True),
        iteration(4, 4.0, 6.0, skipped=True, rollback_to_iter=1, checkpoint_load=0.5),
        iteration(5, 6.0, 7.0), iteration(6, 7.0, 8.0, skipped=True))
    result = account(tmp_path)
    assert result.steps == {"productive": 2, "undone": 3, "skipped": 1}
    assert result.seconds["rollback"] == 0.5
    assert result.seconds["undone"] == 1.0 + 1.0 + 1.5
    assert result.seconds["skipped"] == 1.0
    assert result.accounted == pytest.approx(result.wall)


def test_a_run_without_a_timeline_has_no_account_and_a_torn_line_is_skipped(tmp_path):
    assert account(tmp_path) is None
    write_timeline(tmp_path, attempt(0.0, 1.0, 0), iteration(1, 1.0, 2.0))
    with open(RunDir(tmp_path).timeline, "a") as f:
        f.write('{"kind": "iteration", "iter": 2, "st')  # a writer killed mid-line
    assert account(tmp_path).steps["productive"] == 1
