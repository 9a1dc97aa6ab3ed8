"""The dashboard and the report in headless Chromium, on real fault-drill runs (tests/drill_run.py:
a skipped loss spike, a rollback of poisoned batches, a kill and a resume): charts drawn, the
rollback band and the abandoned segment there, the superseded records faded, one heatmap row per
MoE layer, two runs overlaid, the incident report on a click, a live update, the report offline,
and where the time of each run's attempts went; and on a real two-rank `slow_rank` drill run
(tests/rank_health_run.py) the rank x iteration heatmap: host-labelled rows, the straggler
starred on its rank, the drill outlined, and below it a line per rank of its exposed
communication."""

import os
import random

import pytest
from selenium.webdriver.support.ui import WebDriverWait

from drill_run import STEPS, write_drill_run
from rank_health_run import SLOW_FIRST, SLOW_LAST, SLOW_RANK
from trinity_harness.synthetic_run import MOE_LAYERS, append_jsonl, train_record
from trinity_train.dashboard import browser
from trinity_train.dashboard.report import write_report
from trinity_train.dashboard.server import DashboardServer
from trinity_train.goodput import CATEGORIES, account
from trinity_train.records import EventName
from trinity_train.rundir import RunDir

if not browser.available():
    if os.environ.get("CI"):
        pytest.fail(f"CI must have {browser.CHROMIUM} and {browser.CHROMEDRIVER} (.ci/run installs them)",
                    pytrace=False)
    pytest.skip(f"needs {browser.CHROMIUM} and {browser.CHROMEDRIVER} (apt-get install chromium chromium-driver)",
                allow_module_level=True)

pytestmark = pytest.mark.slow

FIGURE = "const d = document.getElementById(arguments[0]); return {data: d.data, layout: d.layout};"


@pytest.fixture(scope="module")
def drill_runs(corpus, tmp_path_factory):
    """Two drill runs of different initialisations: run-a and run-b."""
    root = tmp_path_factory.mktemp("drills")
    return [write_drill_run(corpus, root / "run-a", seed=0), write_drill_run(corpus, root / "run-b", seed=1)]


def figure(driver, plot_id):
    fig = driver.execute_script(FIGURE, plot_id)
    assert fig["data"], f"{plot_id} has no traces"
    return fig


def check_rollback_views(driver, run):
    loss = figure(driver, "plot-loss")
    bands = [s for s in loss["layout"]["shapes"] if s.get("name") == f"rollback: {run.path.name}"]
    assert sorted((b["x0"], b["x1"]) for b in bands) == sorted((lo - 0.5, hi + 0.5) for lo, hi in run.abandoned)
    ours = [t for t in loss["data"] if t["meta"]["run"] == 0]
    faded = [t for t in ours if t["meta"]["kind"] == "abandoned" and t["meta"]["series"] == "loss"]
    undone = {x for t in faded if t["meta"]["source"] == "rollback" for x in t["x"] if x is not None}
    # every undone iteration that trained is drawn faded (skipped ones are markers, not line points)
    assert undone and undone <= {i for lo, hi in run.abandoned for i in range(lo, hi + 1)}
    assert all(t["opacity"] < 1 for t in faded)
    superseded = [x for t in faded if t["meta"]["source"] == "superseded" for x in t["x"] if x is not None]
    assert sorted(superseded) == run.superseded
    skips = [x for t in ours if t["meta"]["kind"] == "skip" for x in t["x"]]
    assert sorted(skips) == run.skipped
    # checkpoints and the resume after the kill are marked where their events say
    for kind, name in (("checkpoint", EventName.CHECKPOINT), ("resume", EventName.RESUME)):
        drawn = [x for t in ours if t["meta"]["kind"] == kind for x in t["x"]]
        assert drawn and drawn == [e["iter"] for e in RunDir(run.path).read_events(name)], kind
    heat = figure(driver, "plot-moe-heat")["data"][0]
    assert heat["type"] == "heatmap" and len(heat["z"]) == len(MOE_LAYERS)
    check_goodput_panel(driver, run)


def check_goodput_panel(driver, run):
    """Where the time went: a stacked bar per category, a row for the run's total and one per
    attempt (the killed one and its resume), the seconds `goodput` accounts."""
    expected = account(run.path)
    bars = {t["meta"]["category"]: t for t in figure(driver, "plot-goodput")["data"]}
    assert list(bars) == list(CATEGORIES)
    rows = bars["productive"]["y"]
    ours = [i for i, label in enumerate(rows) if label.startswith(f"{run.path.name} ")]
    assert [rows[i].split(" ")[1] for i in ours] == ["total", "#0", "#1"]
    assert f"goodput {100 * expected.goodput:.1f}%" in rows[ours[0]]
    for category in CATEGORIES:
        assert bars[category]["x"][ours[0]] == pytest.approx(expected.seconds[category], abs=1e-6)
    assert len(figure(driver, "plot-experts")["data"][0]["z"]) == len(MOE_LAYERS)
    for plot_id in ("plot-grad-norm", "plot-lr", "plot-throughput", "plot-moe-lines", "plot-depth-grad", "plot-depth-rms"):
        figure(driver, plot_id)


def run_lines(driver):
    """name -> colour of each run's main loss line."""
    return {t["name"]: t["line"]["color"] for t in figure(driver, "plot-loss")["data"]
            if t["meta"]["kind"] == "main" and t["meta"]["series"] == "loss"}


def test_the_live_dashboard_draws_a_rollback_run_and_overlays_a_second(tmp_path, drill_runs):
    first, second = drill_runs
    with DashboardServer([first.path, second.path], poll_interval=0.1) as server, \
            browser.headless_chromium() as driver:
        driver.get(server.url)
        browser.wait_until_rendered(driver)
        check_rollback_views(driver, first)
        lines = run_lines(driver)
        assert set(lines) == {"run-a", "run-b"} and len(set(lines.values())) == 2
        legend = driver.find_element("id", "runs").text
        assert "run-a" in legend and "run-b" in legend and f"ended at iter {first.last_iter}" in legend

        # a click on the skipped step opens its incident report, fetched from the server
        driver.execute_script("""const d = document.getElementById('plot-loss');
            const t = d.data.find((t) => t.meta.kind === 'skip');
            d.emit('plotly_click', {points: [{data: t, customdata: t.customdata[0]}]});""")
        # the report arrives by a fetch: wait for its text (a loaded machine answers late)
        expected = f"Skipped step at iteration {first.skipped[0]}"
        WebDriverWait(driver, 60).until(lambda d: expected in d.find_element("id", "incident-body").text)
        assert driver.find_element("id", "incident").is_displayed()

        # a line appended to run-b shows up without a reload
        appended = second.last_iter + 1
        append_jsonl(second.path / "metrics.jsonl", [train_record(appended, STEPS + 1, random.Random(0))])
        WebDriverWait(driver, 60).until(lambda d: appended in [x for t in figure(d, "plot-loss")["data"]
                                                          if t["name"] == "run-b" for x in t["x"]])
        driver.save_screenshot(str(tmp_path / "dashboard.png"))
    assert (tmp_path / "dashboard.png").stat().st_size > 10_000


def test_a_run_without_layer_statistics_or_data_says_so(tmp_path):
    run = tmp_path / "no-layers"
    append_jsonl(run / "metrics.jsonl", [{**train_record(i, i, random.Random(i)), "moe_max_load_per_layer": None}
                                         for i in range(1, 20)])
    with DashboardServer([run, tmp_path / "not-started"], poll_interval=0.1) as server, \
            browser.headless_chromium() as driver:
        driver.get(server.url)
        browser.wait_until_rendered(driver)
        figure(driver, "plot-loss")
        notes = driver.execute_script("return [...document.querySelectorAll('.empty')].filter((e) => !e.hidden)"
                                      ".map((e) => e.dataset.for + ': ' + e.textContent)")
        assert any(n.startswith("plot-depth-grad: No layer statistics") for n in notes), notes
        assert any(n.startswith("plot-moe-heat: No MoE layers") for n in notes), notes
        assert "Waiting for the run to start: not-started" in driver.find_element("id", "waiting").text


def test_the_report_renders_offline(tmp_path, drill_runs):
    first, second = drill_runs
    out = write_report([first.path, second.path], tmp_path / "report.html", title="drill")
    with browser.headless_chromium(offline=True) as driver:
        driver.get(out.as_uri())
        browser.wait_until_rendered(driver)
        check_rollback_views(driver, first)
        assert set(run_lines(driver)) == {"run-a", "run-b"}
        fetched = driver.execute_script("return performance.getEntriesByType('resource').map((e) => e.name)")
        assert [name for name in fetched if not name.startswith("data:")] == []
        driver.save_screenshot(str(tmp_path / "report.png"))


def check_rank_heatmap(driver, run):
    fig = figure(driver, "plot-ranks")
    (heat,) = [t for t in fig["data"] if t["meta"]["kind"] == "rank-compute"]
    assert heat["y"] == [f"rank {r} · {host}" for r, host in enumerate(run.hosts)]
    assert heat["x"][1:] == [r["iter"] + 0.5 for r in run.reports]  # cells span the iterations they average
    for rank, row in enumerate(heat["z"]):
        assert row == pytest.approx([r["compute_s"][rank] for r in run.reports], rel=1e-5)  # float32 columns
    (stars,) = [t for t in fig["data"] if t["meta"]["kind"] == "straggler"]
    assert stars["x"] == [s["iter"] for s in run.stragglers] and stars["y"] == [heat["y"][SLOW_RANK]]
    boxes = [(b["x0"], b["x1"], b["y0"], b["y1"]) for b in fig["layout"]["shapes"] if b.get("name") == "drill: slow_rank"]
    assert boxes == [(SLOW_FIRST - 0.5, SLOW_LAST + 0.5, SLOW_RANK - 0.5, SLOW_RANK + 0.5)]
    comm = sorted((t for t in fig["data"] if t["meta"]["kind"] == "rank-comm"), key=lambda t: t["meta"]["rank"])
    assert [t["name"] for t in comm] == heat["y"] and all(t["yaxis"] == "y2" for t in comm)
    for rank, line in enumerate(comm):
        assert line["x"] == [r["iter"] for r in run.reports]
        assert line["y"] == pytest.approx([r["comm_exposed_s"][rank] for r in run.reports], rel=1e-5)
    heat_rows, comm_rows = fig["layout"]["yaxis"]["domain"], fig["layout"]["yaxis2"]["domain"]
    assert comm_rows[1] < heat_rows[0]  # the lines sit below the heatmap, not over it


def test_the_rank_heatmap_shows_a_slow_rank_drill_live_and_in_the_report(tmp_path, slow_rank_run):
    out = write_report([slow_rank_run.path], tmp_path / "report.html")
    with DashboardServer([slow_rank_run.path], poll_interval=0.1) as server, \
            browser.headless_chromium() as driver:
        driver.get(server.url)
        browser.wait_until_rendered(driver)
        check_rank_heatmap(driver, slow_rank_run)
        driver.save_screenshot(str(tmp_path / "ranks.png"))
        driver.get(out.as_uri())
        browser.wait_until_rendered(driver)
        check_rank_heatmap(driver, slow_rank_run)
