"""`trinity-train dashboard` and `trinity-train report` through the console script."""

import socket
import subprocess
import sys

from trinity_harness.synthetic_run import write_rollback_run
from conftest import assert_fails_in_one_line, run_cli


def test_a_run_dir_that_is_a_file_exits_2(tmp_path):
    (tmp_path / "metrics.jsonl").write_text("{}\n")
    for command in (["dashboard", "metrics.jsonl", "--port", "0"], ["report", "metrics.jsonl", "--out", "r.html"]):
        assert_fails_in_one_line(run_cli(*command, cwd=tmp_path), 2, "RUN_DIR 'metrics.jsonl' is a file, not a run directory")
    assert not (tmp_path / "r.html").exists()


def test_a_port_in_use_is_one_line_and_a_non_zero_exit(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = run_cli("dashboard", "run", "--port", str(port), cwd=tmp_path)
    assert_fails_in_one_line(result, 1, f"cannot listen on 127.0.0.1:{port}", "choose another --port")
    assert_fails_in_one_line(run_cli("dashboard", "run", "--port", "99999", cwd=tmp_path), 2, "from 0 to 65535")


def test_another_host_warns_that_others_can_reach_it(tmp_path):
    process = subprocess.Popen([sys.executable, "-m", "trinity_train.cli", "dashboard", "run", "--host", "0.0.0.0",
                                "--port", "0"], cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        warning = process.stderr.readline()
        started = process.stdout.readline()
    finally:
        process.terminate()
        process.wait(timeout=30)
    assert warning.startswith("warning: --host 0.0.0.0: the dashboard is then reachable by others")
    assert started.startswith("dashboard of 1 run(s) on http://0.0.0.0:")


def test_report_writes_one_self_contained_file(tmp_path):
    write_rollback_run(tmp_path / "a")
    result = run_cli("report", "a", "--out", "out/report.html", "--title", "drill <1>", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    html = (tmp_path / "out" / "report.html").read_text()
    assert "<title>drill &lt;1&gt;</title>" in html and "window.TRINITY_SNAPSHOT" in html
    assert 'src="static/' not in html and 'href="static/' not in html  # everything inline
    assert [p.name for p in (tmp_path / "out").iterdir()] == ["report.html"]  # no temporary left
