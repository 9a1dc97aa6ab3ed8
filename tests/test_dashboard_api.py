"""The dashboard's HTTP API on a real server (127.0.0.1, a free port, stopped after each test):
live updates over Server-Sent Events, resets, refusals."""

import http.client
import json
import os
import random
import time

import pytest

from conftest import run_python
from trinity_harness.synthetic_run import append_jsonl, train_record, write_rollback_run
from trinity_train.dashboard.server import DashboardServer
from trinity_train.records import IncidentAction


@pytest.fixture
def serve():
    servers = []

    def start(*run_dirs):
        server = DashboardServer(list(run_dirs), poll_interval=0.05).__enter__()
        servers.append(server)
        return server

    yield start
    for server in servers:
        server.__exit__(None, None, None)


def get(server, path, headers=None):
    """(status, parsed JSON or text) for a raw request path (nothing normalised on the way)."""
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=10)
    conn.request("GET", path, headers=headers or {})
    response = conn.getresponse()
    body = response.read().decode()
    conn.close()
    kind = response.getheader("Content-Type", "")
    return response.status, json.loads(body) if kind.startswith("application/json") else body


class EventStream:
    """The `event:`/`data:` messages of /api/stream, read as they arrive."""

    def __init__(self, server):
        self.conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=10)
        self.conn.request("GET", "/api/stream")
        self.response = self.conn.getresponse()
        assert self.response.getheader("Content-Type").startswith("text/event-stream")

    def next(self, event: str, timeout: float = 10.0, where=lambda data: True) -> dict:
        deadline = time.monotonic() + timeout
        name, data = None, None
        while time.monotonic() < deadline:
            line = self.response.fp.readline().decode().rstrip("\n")
            if line.startswith("event: "):
                name = line[7:]
            elif line.startswith("data: "):
                data = json.loads(line[6:])
            elif line == "" and name is not None:
                if name == event and where(data):
                    return data
                name, data = None, None
        raise AssertionError(f"no {event!r} message within {timeout} s")

    def close(self):
        self.conn.close()


def wait_for(predicate, timeout=10.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.05)
    raise AssertionError("condition not met in time")


def loss_iters(server, run=0):
    status, body = get(server, f"/api/runs/{run}/series?names=loss&width=5000")
    assert status == 200
    return [x for x in body["series"]["loss"]["main"]["x"] if x is not None]


def test_an_appended_line_arrives_over_sse_and_a_partial_line_waits(tmp_path, serve):
    run = tmp_path / "run"
    rng = random.Random(0)
    append_jsonl(run / "metrics.jsonl", [train_record(i, i, rng) for i in (1, 2)])
    server = serve(run)
    stream = EventStream(server)
    try:
        hello = stream.next("hello")
        assert hello["runs"][0]["name"] == "run"
        wait_for(lambda: loss_iters(server) == [1, 2])
        line = json.dumps(train_record(3, 3, rng))
        with open(run / "metrics.jsonl", "a") as f:
            f.write(line[:40])
            f.flush()
            time.sleep(0.5)  # several polls see the partial line
            assert loss_iters(server) == [1, 2]
            f.write(line[40:] + "\n")
        update = stream.next("update", where=lambda d: d["last_iter"] == 3)
        assert update["new"] == {"train": 1} and update["run"] == 0 and not update["reset"]
        assert loss_iters(server) == [1, 2, 3]
    finally:
        stream.close()


def test_a_rewritten_or_truncated_file_tells_the_page_to_reset(tmp_path, serve):
    run = tmp_path / "run"
    rng = random.Random(0)
    append_jsonl(run / "metrics.jsonl", [train_record(i, i, rng) for i in range(1, 51)])
    server = serve(run)
    stream = EventStream(server)
    try:
        wait_for(lambda: len(loss_iters(server)) == 50)
        replacement = run / "new.jsonl"
        append_jsonl(replacement, [train_record(i, i, rng) for i in range(1, 11)])
        os.replace(replacement, run / "metrics.jsonl")  # the trainer's rewrite on a resume
        reset = stream.next("reset")
        assert reset["run"] == 0 and reset["generation"] == 1
        wait_for(lambda: loss_iters(server) == list(range(1, 11)))
        with open(run / "metrics.jsonl", "r+") as f:
            f.truncate(0)
        assert stream.next("reset")["generation"] == 2
        wait_for(lambda: loss_iters(server) == [])
        append_jsonl(run / "metrics.jsonl", [train_record(7, 7, rng)])
        stream.next("update", where=lambda d: d["last_iter"] == 7)
        assert loss_iters(server) == [7]
    finally:
        stream.close()


def test_a_run_that_has_not_started_is_waiting_until_it_appears(tmp_path, serve):
    server = serve(tmp_path / "later")
    stream = EventStream(server)
    try:
        assert stream.next("hello")["runs"][0]["state"] == "waiting"
        write_rollback_run(tmp_path / "later")
        stream.next("update", where=lambda d: d["last_iter"] == 300)
        status, body = get(server, "/api/runs")
        assert body["runs"][0]["state"] == "ended" and body["runs"][0]["records"]["superseded"] == 40
    finally:
        stream.close()


def test_incident_reports_are_served_and_nothing_outside_the_run(tmp_path, serve):
    fake = write_rollback_run(tmp_path / "run")
    outside = tmp_path / "secret.json"
    outside.write_text('{"secret": true}')
    (fake.path / "incidents" / "00000099.json").symlink_to(outside)
    server = serve(fake.path)
    wait_for(lambda: get(server, "/api/runs")[1]["runs"][0]["loaded"])
    status, report = get(server, "/api/runs/0/incidents/00000080.json")
    assert status == 200 and report["action"] == IncidentAction.SKIP and report["iter"] == 80
    for path in ["/api/runs/0/incidents/../../etc/passwd", "/api/runs/0/incidents/%2e%2e/%2e%2e/etc/passwd",
                 "/api/runs/0/incidents/..%2f..%2fsecret.json", "/api/runs/0/incidents/%2fetc%2fpasswd",
                 "/api/runs/0/incidents//etc/passwd", "/api/runs/0/incidents/00000099.json",
                 "/api/runs/0/incidents/00000081.json", "/api/runs/0/incidents/%30%30%30%30%30%30%39%39.json",
                 "/static/../rundir.py", "/static/%2e%2e%2frundir.py", "/static/index.html", "/no/such/route",
                 "/api/runs/0/nothing"]:
        status, body = get(server, path)
        assert status == 404, path
        assert "secret" not in json.dumps(body) and "root:" not in json.dumps(body)


@pytest.mark.parametrize("query, fragment", [
    ("/api/runs/0/series?width=-3", "width=-3 must be at least 1"),
    ("/api/runs/0/series?width=wide", "width='wide' is not an integer"),
    ("/api/runs/0/series?width=999999", "above the maximum"),
    ("/api/runs/0/series?x0=abc", "x0='abc' is not a number"),
    ("/api/runs/0/series?x0=nan", "not a finite number"),
    ("/api/runs/0/series?x0=10&x1=5", "the range is empty"),
    ("/api/runs/0/series?names=loss,bogus", "unknown series 'bogus'"),
    ("/api/runs/7/series", "unknown run index '7'"),
    ("/api/runs/-1/markers", "unknown run index '-1'"),
    ("/api/runs/x/markers", "unknown run index 'x'"),
    ("/api/runs/0/layers?iter=1.5", "iter='1.5' is not an integer"),
    ("/api/runs/0/expert_load?width=0", "width=0 must be at least 1"),
])
def test_bad_query_values_get_a_400_with_a_one_line_json_error(tmp_path, serve, query, fragment):
    server = serve(write_rollback_run(tmp_path / "run").path)
    status, body = get(server, query)
    assert status == 400 and set(body) == {"error"}
    assert fragment in body["error"] and "\n" not in body["error"] and "Traceback" not in body["error"]


def test_routes_answer_the_view_payloads(tmp_path, serve):
    fake = write_rollback_run(tmp_path / "run")
    server = serve(fake.path, tmp_path / "absent")
    wait_for(lambda: get(server, "/api/runs")[1]["runs"][0]["loaded"])
    runs = get(server, "/api/runs")[1]["runs"]
    assert [r["name"] for r in runs] == ["run", "absent"] and runs[1]["state"] == "waiting"
    zoomed = get(server, "/api/runs/0/series?names=loss,val_loss&x0=100&x1=120&width=800")[1]["series"]["loss"]
    assert zoomed["main"]["x"] == list(range(99, 122)) and not zoomed["main"]["downsampled"]  # every point
    wide = get(server, "/api/runs/0/series?names=loss&width=10")[1]["series"]["loss"]
    assert wide["main"]["downsampled"] and 12.0 in wide["main"]["y"]
    assert len(wide["main"]["x"]) <= 2 * 10 + 1 and None in wide["main"]["x"]  # each bucket's extremes, the break
    assert get(server, "/api/runs/0/markers")[1]["rollbacks"][0]["to_iter"] == 150
    assert len(get(server, "/api/runs/0/expert_load?width=20")[1]["z"]) == 3
    assert get(server, "/api/runs/0/layers?iter=155")[1]["iter"] == 150
    assert get(server, "/api/runs/0/layer_steps")[1]["iters"][0] == 10
    status, page = get(server, "/")
    assert status == 200 and "plotly.min.js" in page
    status, js = get(server, "/static/plotly.min.js")
    assert status == 200 and "plotly.js" in js[:200]


def test_the_ranks_route_answers_the_heatmap_with_hosts_stragglers_and_drill_spans(tmp_path, serve):
    run = tmp_path / "run"
    append_jsonl(run / "metrics.jsonl", [
        {"kind": "ranks", "iter": i, "step": i, "iterations": 10, "iter_s": [0.5, 0.5], "compute_s": [0.2, 0.9 if i == 70 else 0.2],
         "wait_s": [0.3, 0.1], "data_s": [0.01, 0.01],
         **({"comm_exposed_s": [0.05, 0.4]} if i > 100 else {})}  # a run from before the field, then with it
        for i in range(10, 210, 10)])
    drill = [{"event": "fault_injected", "iter": i, "batch": i - 1, "fault": "slow_rank", "rank": 1, "seconds": 0.5}
             for i in (61, 62, 63, 90)] + [{"event": "fault_injected", "iter": 5, "batch": 4, "fault": "nan_loss", "rank": None}]
    straggler = {"event": "straggler", "iter": 70, "step": 70, "rank": 1, "host": "b", "compute_s": 0.9, "median_s": 0.2,
                 "ratio": 4.5, "reports": 1}
    append_jsonl(run / "events.jsonl", [{"event": "rank_hosts", "hosts": ["a", "b"]}, *drill, straggler])
    server = serve(run)
    wait_for(lambda: get(server, "/api/runs")[1]["runs"][0]["records"]["ranks"] == 20)
    ranks = get(server, "/api/runs/0/ranks")[1]
    assert ranks["ranks"] == [0, 1] and ranks["hosts"] == ["a", "b"] and ranks["x"] == list(range(10, 210, 10))
    assert ranks["compute_s"][1][6] == 0.9 and ranks["wait_s"][0] == [0.3] * 20
    assert ranks["comm_exposed_s"] == [[None] * 10 + [0.05] * 10, [None] * 10 + [0.4] * 10]  # the panel's lines
    assert ranks["stragglers"] == [{k: v for k, v in straggler.items() if k != "event"}]
    assert [(d["fault"], d["rank"], d["first"], d["last"]) for d in ranks["drills"]] == [
        ("slow_rank", 1, 61, 63), ("slow_rank", 1, 90, 90), ("nan_loss", None, 5, 5)]
    narrow = get(server, "/api/runs/0/ranks?width=5")[1]  # bucket maxima: the slow report survives
    assert len(narrow["x"]) == 5 and max(narrow["compute_s"][1]) == 0.9
    assert get(server, "/api/runs/0/ranks?x0=100&x1=120")[1]["x"] == [90, 100, 110, 120, 130]
    assert get(server, "/api/runs/0/ranks?width=0")[0] == 400


def test_a_foreign_host_name_is_refused_on_loopback(tmp_path, serve):
    server = serve(tmp_path / "run")
    assert get(server, "/api/runs", headers={"Host": "evil.example:80"})[0] == 400
    assert get(server, "/api/runs", headers={"Host": f"localhost:{server.port}"})[0] == 200


def test_the_server_module_does_not_load_torch():
    result = run_python("-c", "import sys, trinity_train.dashboard.server, trinity_train.dashboard.report; "
                        "print('torch' in sys.modules)", timeout=120)
    assert result.stdout.strip() == "False", result.stderr
