"""The hang watchdog (health/): the limit of each phase, the heartbeats that name the ranks behind,
which errors are a lost peer, the machine drills spent by an earlier attempt, and one process
whose `hang_rank` drill the watchdog ends with its one line, a stack file naming the drill's
function, a `hang` event and exit code 75. The drills under torchrun: tests/test_restarts.py."""

from __future__ import annotations

import threading
import time

import pytest
import torch.distributed as dist

from conftest import ONE_THREAD_ENV, run_cli, run_config
from trinity_train import exit_codes
from trinity_train.config import FaultConfig, WatchdogConfig, save_config
from trinity_train.health.heartbeat import Heartbeat, Progress, behind
from trinity_train.health.limits import PhaseLimits
from trinity_train.health.lost_peer import is_lost_peer
from trinity_train.records import EventName, Phase
from trinity_train.rundir import RunDir
from trinity_train.stability.drills import BEFORE_STEP, FaultInjector
from trinity_train.train import Trainer


def test_a_phase_may_last_a_multiple_of_its_longest_above_a_floor_and_first_s_before_it_was_seen():
    limits = PhaseLimits(WatchdogConfig(multiple=5, floor_s=120, first_s=1800))
    assert limits.limit(Phase.STEP) == 1800  # never seen: the first step compiles
    limits.observe(Phase.STEP, 10.0)
    assert limits.limit(Phase.STEP) == 120  # 5 x 10 s is under the floor
    limits.observe(Phase.STEP, 40.0)
    limits.observe(Phase.STEP, 30.0)  # the longest counts, not the latest
    assert limits.limit(Phase.STEP) == 200
    assert limits.limit(Phase.DATA) == 1800  # each phase its own


def test_the_ranks_behind_are_those_with_the_least_progress():
    p = lambda beats: Progress(beats, "step", 3)  # noqa: E731
    assert behind({0: p(7), 1: Progress(6, "data", 3), 2: p(7)}) == [1]
    assert behind({0: p(7), 1: p(6), 2: p(6)}) == [1, 2]
    assert behind({0: p(7), 1: None}) == [1]  # never reported: no progress at all
    assert behind({0: p(7), 1: p(7)}) is None  # level: nobody is behind
    assert behind({0: p(7)}) is None  # one rank: nothing to compare


def test_heartbeats_go_through_the_store_and_a_store_that_does_not_answer_says_nothing():
    store = dist.HashStore()
    ranks = [Heartbeat(rank, 3, store) for rank in range(3)]
    for rank, beats in ((0, 3), (1, 2), (2, 3)):
        for _ in range(beats):
            ranks[rank].beat(Phase.DATA if rank == 1 else Phase.STEP, 5)
        ranks[rank].publish()
    assert ranks[0].read_all(5.0)[1] == Progress(2, "data", 5)
    assert [hb.behind(5.0) for hb in ranks] == [[1], [1], [1]]

    class Silent:
        def check(self, keys):
            time.sleep(30)

    started = time.monotonic()
    assert Heartbeat(0, 2, Silent()).behind(0.2) is None
    assert time.monotonic() - started < 5
    assert Heartbeat(0, 1, store).behind(1.0) is None and Heartbeat(0, 2, None).behind(1.0) is None


def test_a_lost_peer_is_told_from_a_bug():
    assert is_lost_peer(dist.DistNetworkError("Connection reset by peer"))
    assert is_lost_peer(dist.DistBackendError("watchdog timeout"))
    assert is_lost_peer(RuntimeError("[../third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer "
                                     "[127.0.0.1]:9927. This is typically caused by a remote worker crashing."))
    assert not is_lost_peer(RuntimeError("mat1 and mat2 shapes cannot be multiplied (see /gloo/ later)"))
    assert not is_lost_peer(ValueError("[x/gloo/y] not a runtime error"))


def test_a_machine_drill_an_earlier_attempt_injected_is_spent():
    faults = [FaultConfig(fault="kill_rank", first=3, rank=1), FaultConfig(fault="hang_rank", first=3, last=4, rank=-1)]
    injector = FaultInjector(faults, rank=1, vocab_size=64)
    assert [f.fault for f in injector.machine_faults(3, BEFORE_STEP)] == ["kill_rank", "hang_rank"]
    assert injector.machine_event(faults[1], 3, batch_index=2)["seconds"] == 3600.0  # the default
    injector = FaultInjector(faults, rank=1, vocab_size=64)
    injector.spend([{"event": EventName.FAULT_INJECTED, "fault": "kill_rank", "iter": 3, "rank": 1},
                    {"event": EventName.FAULT_INJECTED, "fault": "hang_rank", "iter": 3, "rank": 0},  # another rank's
                    {"event": EventName.FAULT_INJECTED, "fault": "nan_loss", "iter": 3, "rank": None}])
    assert [f.fault for f in injector.machine_faults(3, BEFORE_STEP)] == ["hang_rank"]
    assert [f.fault for f in injector.machine_faults(4, BEFORE_STEP)] == ["hang_rank"]  # each iteration once
    assert injector.events(3, 2) == []  # a machine fault's event is its rank's, not rank 0's for all


def watchdog_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "trinity-watchdog"]


def test_the_watchdog_of_a_clean_run_learns_its_phases_and_stops_with_it(corpus, tmp_path):
    trainer = Trainer(run_config(corpus, tmp_path / "run", train={"steps": 2, "micro_batch_size": 2}, eval={"every": 2},
                                 checkpoint={"every": 2}))
    assert not watchdog_threads()  # a trainer never started watches nothing
    trainer.run()
    watchdog = trainer.watchdog.watchdog
    assert {Phase.DATA, Phase.STEP, Phase.VALIDATION, Phase.CHECKPOINT_SAVE} <= watchdog.limits.longest.keys()
    assert watchdog.heartbeat.beats >= 6
    watchdog._thread.join(timeout=5)
    assert not watchdog_threads() and not RunDir(tmp_path / "run").read_events(EventName.HANG)


@pytest.mark.slow  # a console-script run left to hang (~8 s)
def test_a_hung_rank_is_ended_by_its_watchdog_with_one_line_its_stacks_and_exit_75(corpus, tmp_path):
    config = tmp_path / "hang.toml"
    save_config(run_config(corpus, tmp_path / "unused", train={"steps": 6, "micro_batch_size": 2}, eval={"every": 0},
                           checkpoint={"every": 2}, watchdog={"floor_s": 3.0, "multiple": 2.0},
                           stability={"inject": [{"fault": "hang_rank", "first": 3, "seconds": 120}]}), config)
    run = RunDir(tmp_path / "run")
    done = run_cli("train", "--config", config, f"--run.dir={run.path}", env=ONE_THREAD_ENV, timeout=300)
    assert done.returncode == exit_codes.RESTARTABLE, done.stderr[-3000:]
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("watchdog: rank 0 on "), done.stderr
    assert "hung in phase 'data' at iteration 3" in lines[0] and "--checkpoint.resume=auto" in lines[0]
    (hang,) = run.read_events(EventName.HANG)
    assert hang["rank"] == 0 and hang["phase"] == "data" and hang["iter"] == 3 and hang["behind"] is None
    assert hang["limit_s"] == 3.0 and 3.0 <= hang["waited_s"] < 60 and hang["exit_code"] == 75
    stacks = run.path / hang["stacks"]
    assert str(stacks) in lines[0] and stacks.parent == run.hangs
    assert " in hang_rank\n" in stacks.read_text()  # the main thread, standing still in the drill
    (drill,) = run.read_events(EventName.FAULT_INJECTED)
    assert drill["fault"] == "hang_rank" and drill["rank"] == 0 and drill["seconds"] == 120
