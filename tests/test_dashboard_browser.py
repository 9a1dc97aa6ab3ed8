"""The dashboard and the report in headless Chromium, on real fault-drill runs (tests/drill_run.py:
a skipped loss spike, a rollback of poisoned batches, a kill and a resume): charts drawn, the
rollback band and the abandoned segment there, the superseded records faded, one heatmap row per
MoE layer, two runs overlaid, the incident report on a click, a live update, the report offline,
and where the time of each run's attempts went; and on a real two-rank `slow_rank` drill run
(tests/rank_health_run.py) the rank x iteration heatmap: host-labelled rows, the straggler
starred on its rank, the drill outlined, and below it a line per rank of its exposed
communication. In a wide and a narrow window, no chart's legend covers its axes' titles or tick
labels."""

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


# Each drawn chart's legend box, axis titles and tick labels, in page pixels; in plotly's SVG the
# legend is `g.legend` (its `rect.bg` the box), an axis title `g.g-xtitle`, `g.g-y2title`..., a tick
# label `g.xtick`, `g.y2tick`...
CHART_TEXT = """
const box = (e) => { const r = e.getBoundingClientRect(); return [r.left, r.top, r.right, r.bottom]; };
const texts = (d, pattern) => [...d.querySelectorAll('g[class] > text')]
  .filter((t) => pattern.test(t.parentNode.getAttribute('class')) && t.textContent.trim())
  .map((t) => [t.parentNode.getAttribute('class'), t.textContent, box(t)]);
const charts = {};
for (const d of document.querySelectorAll('.js-plotly-plot')) {
  if (d.offsetParent === null) continue;  // hidden: the panel shows its note instead
  const legend = d.querySelector('.legend rect.bg');
  charts[d.id] = {legend: legend ? box(legend) : null, titles: texts(d, /^g-[xy][0-9]*title$/), ticks: texts(d, /^[xy][0-9]*tick$/)};
}
return charts;
"""
# after a resize, until plotly has redrawn every chart at its div's new width
RESIZED = """
return window.innerWidth <= arguments[0] && [...document.querySelectorAll('.js-plotly-plot')]
  .filter((d) => d.offsetParent !== null)
  .every((d) => Math.abs(d._fullLayout.width - d.getBoundingClientRect().width) < 2);
"""


def covered_text(driver) -> tuple[dict, list[str]]:
    """(each drawn chart's boxes, "chart: what covers what" for a legend over an axis title or tick
    label, and for an axis title over a tick label)."""
    charts = driver.execute_script(CHART_TEXT)
    covered = []
    for plot_id, chart in charts.items():
        over = [("legend", chart["legend"])] if chart["legend"] else []
        pairs = [(a, b) for a in over for b in chart["titles"] + chart["ticks"]]
        pairs += [((f"{kind} {text!r}", rect), b) for kind, text, rect in chart["titles"] for b in chart["ticks"]]
        covered += [f"{plot_id}: {name} at {rect} over {kind} {text!r} at {under}"
                    for (name, rect), (kind, text, under) in pairs if boxes_overlap(rect, under)]
    return charts, covered


def boxes_overlap(a, b) -> bool:
    return a[0] < b[2] and b[0] < a[2] and a[1] < b[3] and b[1] < a[3]


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


def test_no_chart_draws_its_legend_over_its_axis_titles_or_tick_labels(drill_runs):
    """Issue 48: the goodput chart of a run of few attempts wrote "seconds" over its legend. Every
    chart, in a wide and a narrow window (which wraps the legends onto more rows), and no axis title
    over tick labels either (where plotly puts a title squeezed for room); the goodput chart's
    legend, axis title and tick labels must be there, so that it cannot pass on a chart that drew
    none of them."""
    with DashboardServer([drill_runs[0].path]) as server, browser.headless_chromium() as driver:
        driver.get(server.url)
        browser.wait_until_rendered(driver)
        for width in (1600, 700):
            driver.set_window_size(width, 1400)
            WebDriverWait(driver, 30).until(lambda d: d.execute_script(RESIZED, width))
            charts, covered = covered_text(driver)
            goodput = charts["plot-goodput"]
            assert goodput["legend"] and [t[:2] for t in goodput["titles"]] == [["g-xtitle", "seconds"]], (width, goodput)
            assert {t[0] for t in goodput["ticks"]} == {"xtick", "ytick"}, (width, goodput)
            assert len(charts) > 5, charts  # the other charts were checked too
            assert not covered, (width, covered)
