"""Rank health: every rank's iteration, compute, wait, data and exposed-communication seconds in `ranks` records, the
hosts at start, and the straggler rule: a `slow_rank` drill on rank 1 is flagged on rank 1 within
`metrics.straggler_reports` reports, once, and `incidents` lists it; a clean two-rank run of 300
steps flags nobody, however loaded the machine."""

import threading

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch._C._distributed_c10d import Work

from rank_health_run import (EVERY, REPORTS, SLOW_FIRST, SLOW_LAST, SLOW_RANK, SLOW_SECONDS, SLOW_STEPS,
                             train_two_ranks, two_rank_config)
from trinity_train.cli import main
from trinity_train.health.collective_waits import CollectiveWaits
from trinity_train.health.straggler import StragglerRule
from trinity_train.records import EventName, RecordKind
from trinity_train.rundir import RunDir
from trinity_train.train import Trainer

# ---------------------------------------------------------------------------- the rule


def test_a_rank_slower_than_the_others_median_for_m_reports_is_flagged_once_per_episode():
    rule = StragglerRule(ratio=1.5, reports=3)
    slow = [1.0, 1.1, 0.9, 2.0]  # rank 3: 2.0 / median(1.0, 1.1, 0.9) = 2.0
    assert rule.judge(slow) == [] and rule.judge(slow) == []
    (found,) = rule.judge(slow)
    assert (found.rank, found.compute_s, found.median_s, found.ratio, found.reports) == (3, 2.0, 1.0, 2.0, 3)
    assert rule.judge(slow) == []  # the same episode
    assert rule.judge([1.0, 1.1, 0.9, 1.2]) == []  # recovered: the episode ends
    assert [rule.judge(slow) for _ in range(3)][-1][0].rank == 3  # a new episode, flagged again


def test_the_streak_must_be_unbroken_and_above_the_ratio():
    rule = StragglerRule(ratio=1.5, reports=2)
    assert rule.judge([1.0, 1.6]) == [] and rule.judge([1.0, 1.5]) == []  # 1.5x is not above 1.5x
    assert rule.judge([1.0, 1.6]) == []  # the streak started again
    assert [s.rank for s in rule.judge([1.0, 1.6])] == [1]


def test_one_rank_or_idle_others_are_never_stragglers():
    rule = StragglerRule(ratio=1.5, reports=1)
    assert rule.judge([5.0]) == [] and rule.judge([0.0, 5.0]) == []
    # two slow ranks of four: each is compared with the others' median, which holds the other slow one
    assert {s.rank for s in rule.judge([1.0, 1.0, 4.0, 4.0])} == {2, 3}


# ---------------------------------------------------------------------------- exposed communication


def test_collective_waits_time_the_installing_thread_only_and_give_torch_its_waits_back():
    group = dist.ProcessGroupGloo(dist.HashStore(), 0, 1)  # a world of one, outside the default group
    originals = (Work.wait, funcol.wait_tensor)

    def all_reduce():
        group.allreduce([torch.ones(3)]).wait()

    with CollectiveWaits() as outer:
        with CollectiveWaits() as inner:
            all_reduce()
            other = threading.Thread(target=all_reduce)  # another thread's wait is not this one's
            other.start()
            other.join()
        all_reduce()  # the inner one is gone, the wrappers stay for the outer one
        assert (Work.wait, funcol.wait_tensor) != originals
    assert (inner.calls, outer.calls) == (1, 2) and 0 < inner.seconds <= outer.seconds
    assert (Work.wait, funcol.wait_tensor) == originals


# ---------------------------------------------------------------------------- one process


def test_one_process_records_lists_of_one_and_its_host(corpus, tmp_path):
    cfg = two_rank_config(corpus, tmp_path / "run", 12, {"fault": "slow_rank", "first": 4, "last": 5,
                                                          "seconds": 0.05}, rank_stats_every=EVERY)
    Trainer(cfg).run()
    run = RunDir(tmp_path / "run")
    reports = run.read_metrics(RecordKind.RANKS)
    assert [r["iter"] for r in reports] == [5, 10] and [r["iterations"] for r in reports] == [5, 5]
    for r in reports:
        assert all(len(r[k]) == 1 and r[k][0] >= 0 for k in ("iter_s", "compute_s", "wait_s", "data_s"))
        assert r["compute_s"][0] + r["wait_s"][0] >= r["iter_s"][0] * 0.999
        assert r["comm_exposed_s"] == [0.0]  # one process: no collective to wait for
    # the drill's 2 x 0.05 s of work is in the data phase of the first report's iterations
    assert reports[0]["data_s"][0] >= 2 * 0.05 / EVERY > reports[1]["data_s"][0]
    (hosts,) = run.read_events(EventName.RANK_HOSTS)
    assert len(hosts["hosts"]) == 1 and run.read_events(EventName.STRAGGLER) == []
    drills = run.read_events(EventName.FAULT_INJECTED)
    assert [(e["iter"], e["fault"], e["seconds"]) for e in drills] == [(4, "slow_rank", 0.05), (5, "slow_rank", 0.05)]


def test_rank_statistics_can_be_turned_off(corpus, tmp_path):
    Trainer(two_rank_config(corpus, tmp_path / "run", 5, rank_stats_every=0)).run()
    run = RunDir(tmp_path / "run")
    assert run.read_metrics(RecordKind.RANKS) == [] and run.read_events(EventName.RANK_HOSTS) == []


# ---------------------------------------------------------------------------- two ranks


def test_a_slow_rank_is_flagged_on_that_rank_within_m_reports(slow_rank_run):
    assert len(slow_rank_run.hosts) == 2
    assert [r["iter"] for r in slow_rank_run.reports] == list(range(EVERY, SLOW_STEPS + 1, EVERY))
    assert all(len(r["compute_s"]) == 2 for r in slow_rank_run.reports)
    (straggler,) = slow_rank_run.stragglers  # one episode: flagged once
    first_slow_report = -(-SLOW_FIRST // EVERY) * EVERY
    assert straggler["rank"] == SLOW_RANK and straggler["host"] == slow_rank_run.hosts[SLOW_RANK]
    assert straggler["iter"] <= first_slow_report + (REPORTS - 1) * EVERY and straggler["reports"] == REPORTS
    assert straggler["ratio"] > 1.5 and straggler["compute_s"] > straggler["median_s"]
    # the drill's seconds are rank 1's data time; rank 0 waited for it in the step's collectives
    during = [r for r in slow_rank_run.reports if SLOW_FIRST <= r["iter"] - EVERY + 1 and r["iter"] <= SLOW_LAST]
    assert during and all(r["data_s"][SLOW_RANK] >= SLOW_SECONDS * 0.9 for r in during)
    assert all(r["wait_s"][0] > r["wait_s"][SLOW_RANK] for r in during)


def test_exposed_communication_is_in_every_report_and_holds_the_wait_for_a_late_rank(slow_rank_run):
    for r in slow_rank_run.reports:
        for rank in range(2):
            assert 0 <= r["comm_exposed_s"][rank] <= r["iter_s"][rank] + 1e-6  # rounded to the microsecond
    # rank 1's drill makes it late to every step's first collective: rank 0 waits there, blocked
    during = [r for r in slow_rank_run.reports if SLOW_FIRST <= r["iter"] - EVERY + 1 and r["iter"] <= SLOW_LAST]
    for r in during:
        late = r["data_s"][SLOW_RANK] - r["data_s"][0]
        assert r["comm_exposed_s"][0] >= 0.5 * late and r["comm_exposed_s"][0] > r["comm_exposed_s"][SLOW_RANK]


def test_incidents_lists_the_straggler(slow_rank_run, capsys):
    assert main(["incidents", str(slow_rank_run.path)]) == 0
    out = capsys.readouterr().out
    (line,) = [line for line in out.splitlines() if "straggler" in line]
    assert f"rank {SLOW_RANK}" in line and slow_rank_run.hosts[SLOW_RANK] in line
    assert main(["incidents", str(slow_rank_run.path), "--json"]) == 0
    assert '"action": "straggler"' in capsys.readouterr().out


@pytest.mark.slow
def test_a_clean_two_rank_run_of_300_steps_flags_nobody(corpus, tmp_path, rank_pool):
    rank_pool(2).run(train_two_ranks, corpus, tmp_path / "run", 300, [], {})
    run = RunDir(tmp_path / "run")
    assert len(run.read_metrics(RecordKind.RANKS)) == 30
    assert run.read_events(EventName.STRAGGLER) == []


def test_no_module_waits_for_a_collective_behind_the_exposed_communication_timer():
    """`CollectiveWaits` wraps `_functional_collectives.wait_tensor` where callers look it up:
    a name bound at import (`from ... import wait_tensor`) or torch's op called directly would
    wait untimed, and the collective's wait would be missing from `comm_exposed_s`."""
    import ast
    from pathlib import Path

    import trinity_train

    root = Path(trinity_train.__file__).parent
    found = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            bound = isinstance(node, ast.ImportFrom) and any(a.name == "wait_tensor" for a in node.names)
            direct = (isinstance(node, ast.Attribute) and node.attr == "wait_tensor"
                      and isinstance(node.value, ast.Attribute) and node.value.attr == "_c10d_functional")
            if bound or direct:
                found.append(f"{path.relative_to(root)}:{node.lineno}")
    assert found == []
