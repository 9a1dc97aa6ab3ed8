"""How fast the dashboard opens a long run, and what it costs.

    .venv/bin/python benchmarks/dashboard_load.py [--lines 1000000] [--keep DIR]

Writes a metrics.jsonl of `--lines` records per the run-directory contract (train records of the
debug model's shape, a `layers` record every 100th line, a few skipped steps and a rollback) and
its columnar mirror `metrics.columns.arrow`, as the trainer's recorder keeps it (the time to build
it from the JSON is what a trainer start spends on a run this long). Then it starts `trinity-train
dashboard` in its own process, on that run and, side by side, on the same metrics.jsonl without
the mirror (the JSON parsed by pyarrow), and measures:

- the time from starting the server to its answer of the first full-range request (what the
  page asks first: every series, downsampled to 1000 buckets), with and without the mirror;
- the time to first render in headless Chromium (navigation start to the charts drawn);
- the server's peak resident memory (VmHWM);
- the bytes the first view sends (the page, its scripts and every API answer).

Sections: `dashboard_load` (above); `layer_stats_overhead`: what the layer statistics cost per
training step on the default model (`layer_stats_cost.measure_layer_stats_overhead`).
"""

from __future__ import annotations

import argparse
import json
import random
import re
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from trinity_harness.jobs import loadavg
from trinity_harness.table import markdown_table, ratio
from trinity_harness.synthetic_run import layers_record, train_record  # the tests' record shapes
from trinity_train.columnar import MirrorWriter
from trinity_train.dashboard import browser
from trinity_train.records import EventName
from trinity_train.rundir import RunDir

REPO = Path(__file__).resolve().parent.parent

SKIPS = (123_457, 500_001)
ROLLBACK = (700_000, 700_050)  # to_iter, iter: 700_001..700_050 abandoned


def write_long_run(path: Path, lines: int) -> int:
    """A run directory whose metrics.jsonl has `lines` lines; returns its size in bytes."""
    rd, rng = RunDir(path), random.Random(0)
    rd.path.mkdir(parents=True, exist_ok=True)
    events = [{"event": EventName.RUN_START, "time": 0.0, "step": 0, "iter": 0, "device": "cpu", "devices": 1, "resumed_from": None}]
    iteration = step = 0
    with open(rd.metrics, "w") as f:
        for n in range(lines):
            if n % 100 == 99:
                f.write(json.dumps(layers_record(iteration, step, rng)) + "\n")
                continue
            iteration += 1
            skipped = iteration in SKIPS or ROLLBACK[1] - 2 <= iteration <= ROLLBACK[1]
            if not skipped:
                step += 1
            f.write(json.dumps(train_record(iteration, step, rng, loss=14.0 if skipped else None, skipped=skipped)) + "\n")
            if skipped:
                events.append({"event": EventName.SKIP, "time": float(iteration), "iter": iteration, "step": step,
                               "batch": iteration - 1, "reason": "loss_spike", "loss": 14.0, "grad_norm": 40.0,
                               "loss_z": 9.0, "grad_norm_z": 7.0, "incident": None})
            if iteration == ROLLBACK[1] and not any(e["event"] == EventName.ROLLBACK for e in events):
                events.append({"event": EventName.ROLLBACK, "time": float(iteration), "iter": ROLLBACK[1], "from_step": step,
                               "to_step": step - 47, "to_iter": ROLLBACK[0], "checkpoint": None,
                               "skipped_batches": [ROLLBACK[0], ROLLBACK[1]], "rollbacks": 1, "lr_scale": 0.5,
                               "incident": None})
                step -= 47
            if iteration % 10_000 == 0:
                events.append({"event": EventName.CHECKPOINT, "time": float(iteration), "step": step, "iter": iteration,
                               "path": f"checkpoints/step_{step:08d}", "async_save": True})
    with open(rd.events, "w") as f:
        f.writelines(json.dumps(e) + "\n" for e in events)
    return rd.metrics.stat().st_size


def fetch(url: str) -> bytes:
    with urllib.request.urlopen(url, timeout=120) as response:
        return response.read()


def peak_rss_mib(pid: int) -> float:
    status = Path(f"/proc/{pid}/status").read_text()
    return int(re.search(r"VmHWM:\s+(\d+) kB", status).group(1)) / 1024


def start_server(run_dir: Path) -> tuple[subprocess.Popen, str, float]:
    """`trinity-train dashboard` on a free port: (process, URL, start time)."""
    started = time.perf_counter()
    process = subprocess.Popen([sys.executable, "-m", "trinity_train.cli", "dashboard", str(run_dir), "--port", "0"],
                               stdout=subprocess.PIPE, text=True)
    url = re.search(r"(http://\S+/)", process.stdout.readline()).group(1)
    return process, url, started


def first_full_range_answer(url: str) -> tuple[float, int]:
    """Waits until the run is loaded, then asks for every series over the full range; returns the
    moment the answer was complete and its size."""
    while not json.loads(fetch(url + "api/runs"))["runs"][0]["loaded"]:
        time.sleep(0.1)
    body = fetch(url + "api/runs/0/series?width=1000")
    return time.perf_counter(), len(body)


def first_view_bytes(driver) -> int:
    """Bytes the page downloaded: the document, its scripts and every API answer so far."""
    return int(driver.execute_script(
        "const nav = performance.getEntriesByType('navigation')[0];"
        "return nav.encodedBodySize + performance.getEntriesByType('resource')"
        ".reduce((n, e) => n + e.encodedBodySize, 0);"))


def without_mirror(run_dir: Path) -> Path:
    """A second run directory holding the same files (hard links) but no columnar mirror."""
    bare = run_dir.with_name(run_dir.name + "-json-only")
    bare.mkdir(exist_ok=True)
    for name in ("metrics.jsonl", "events.jsonl"):
        if not (bare / name).exists():
            (bare / name).hardlink_to(run_dir / name)
    return bare


def dashboard_load(lines: int, keep: Path | None) -> list[list[str]]:
    """Measures, printing a line per figure as it comes, and returns the table's rows."""
    rows = []
    work = keep or Path(tempfile.mkdtemp(prefix="dashboard-bench-"))
    run_dir = work / "long-run"
    t = time.perf_counter()
    size = write_long_run(run_dir, lines)
    print(f"wrote {lines:,} lines ({size / 2**20:.0f} MiB) in {time.perf_counter() - t:.0f} s")
    rows.append(["metrics lines written", f"{lines:,} ({size / 2**20:.0f} MiB)"])
    t = time.perf_counter()
    run = RunDir(run_dir)
    MirrorWriter(run.metrics_mirror, run.metrics).close()
    built = time.perf_counter() - t
    print(f"built the columnar mirror ({run.metrics_mirror.stat().st_size / 2**20:.0f} MiB) from the JSON in "
          f"{built:.1f} s (what a trainer start spends on a run this long)")
    rows.append([f"building the columnar mirror ({run.metrics_mirror.stat().st_size / 2**20:.0f} MiB), s",
                 f"{built:.1f}"])

    bare_process, bare_url, bare_started = start_server(without_mirror(run_dir))
    try:
        answered, _ = first_full_range_answer(bare_url)
        bare_s, bare_rss = answered - bare_started, peak_rss_mib(bare_process.pid)
        print(f"without the mirror: server start to first full-range answer: {bare_s:.2f} s; "
              f"peak RSS {bare_rss:.0f} MiB")
    finally:
        bare_process.terminate()
        bare_process.wait(timeout=30)

    process, url, started = start_server(run_dir)
    try:
        answered, answer_bytes = first_full_range_answer(url)
        mirror_s = answered - started
        print(f"with the mirror: server start to first full-range answer: {mirror_s:.2f} s "
              f"(every series, 1000 buckets: {answer_bytes / 1024:.0f} KiB)")
        rows.append(["server start to first full-range answer, s", f"{mirror_s:.2f}", f"{bare_s:.2f}",
                     ratio(mirror_s, bare_s)])
        rows.append(["first full-range answer (every series, 1000 buckets), KiB", f"{answer_bytes / 1024:.0f}"])
        if browser.available():
            with browser.headless_chromium() as driver:
                driver.get(url)
                browser.wait_until_rendered(driver, timeout=300)
                rendered_ms = driver.execute_script("return window.dashboardRenderedAt")
                print(f"navigation start to charts drawn (headless Chromium, server already loaded): {rendered_ms / 1000:.2f} s")
                view_mib = first_view_bytes(driver) / 2**20
                plotly_mib = len(fetch(url + 'static/plotly.min.js')) / 2**20
                print(f"bytes sent for the first view: {view_mib:.2f} MiB (plotly.min.js alone {plotly_mib:.2f} MiB)")
                rows.append(["navigation start to charts drawn (headless Chromium), s", f"{rendered_ms / 1000:.2f}"])
                rows.append(["bytes sent for the first view, MiB", f"{view_mib:.2f} (plotly.min.js {plotly_mib:.2f})"])
        else:
            print(f"no {browser.CHROMIUM}: time to first render not measured")
            rows.append(["navigation start to charts drawn, s", f"not measured (no {browser.CHROMIUM})"])
        rss = peak_rss_mib(process.pid)
        print(f"with the mirror: server peak RSS: {rss:.0f} MiB")
        rows.append(["server peak RSS, MiB", f"{rss:.0f}", f"{bare_rss:.0f}", ratio(rss, bare_rss)])
    finally:
        process.terminate()
        process.wait(timeout=30)
    return [row + [""] * (4 - len(row)) for row in rows]


def layer_stats_overhead() -> list[list[str]]:
    """Layer-statistics overhead per training step on the default model: the figure of
    benchmarks/layer_stats_cost.py (fewer repetitions: a few minutes on 2 CPU cores)."""
    from layer_stats_cost import measure_layer_stats_overhead

    result = measure_layer_stats_overhead(pairs=10, rounds=4)
    rows = []
    for cost in result.costs:
        for interval, clock, share, quartiles, adds, plain, samples in cost.rows():
            rows.append([f"layer statistics every {interval} iterations ({clock}, configs/debug.toml), % of the step",
                         f"{share} (quartiles {quartiles}; adds {adds} ms to {plain} ms; median of {samples})", "", ""])
            print(f"layer_stats_every={interval} {clock}: {rows[-1][1]} % of the step", flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lines", type=int, default=1_000_000)
    parser.add_argument("--keep", type=Path, help="write the run directory here (default: a temporary one)")
    args = parser.parse_args()
    print(f"load before: {loadavg()}")
    rows = dashboard_load(args.lines, args.keep)
    rows += layer_stats_overhead()
    print(f"load after: {loadavg()}")
    print(markdown_table(["measurement", "figure (with the columnar mirror)", "without the mirror (JSON only)",
                          "ratio with / without"],
                         rows))


if __name__ == "__main__":
    main()
