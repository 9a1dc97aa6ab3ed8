"""One panel registry (trinity_train/dashboard/panels.py): a panel declared there once is served
by the live server, kept in the offline report and drawn by the page, live and offline; every
built-in panel's draw function and page slot exist."""

import pytest
from selenium.webdriver.support.ui import WebDriverWait

from trinity_harness.synthetic_run import write_rollback_run
from test_dashboard_api import get, wait_for
from trinity_train.dashboard import assets, browser, panels, views
from trinity_train.dashboard.report import REPORT_WIDTH, snapshot, write_report
from trinity_train.dashboard.server import DashboardServer


def latest_losses(run, x0, x1, width):
    """A new panel's view: the run's last `width` losses (and the range it was asked for)."""
    with run.lock:
        loss = run.metrics.train["loss"]
    return {"run": run.index, "x0": x0, "x1": x1, "width": width, "loss": views.numbers(loss[-width:])}


PANEL = panels.Panel("latest_losses", latest_losses, (panels.RANGE,), draw="latestLosses", slot="plot-latest-losses")

# What a new panel's draw method in dashboard.js would be, brought in by the test.
DRAW = """window.dashboardDraw.latestLosses = (panel) => {
    const payload = window.dashboardState.data[0][panel.name];
    Plotly.react(document.getElementById(panel.slot), [{y: payload.loss, meta: {kind: panel.name}}], {});
};
for (const i of [0, 1]) document.querySelector('#runs .run').click();  // hide and show the run: a redraw"""


@pytest.fixture
def registered(monkeypatch):
    """PANEL declared, once, in the registry."""
    monkeypatch.setattr(panels, "PANELS", (*panels.PANELS, PANEL))


def test_a_panel_declared_once_is_served_and_kept_in_the_report(tmp_path, registered):
    run = write_rollback_run(tmp_path / "run")
    with DashboardServer([run.path], poll_interval=0.05) as server:
        wait_for(lambda: get(server, "/api/runs")[1]["runs"][0]["loaded"])
        assert get(server, "/api/panels")[1]["panels"][-1] == PANEL.describe()
        status, body = get(server, "/api/runs/0/latest_losses?x0=5&width=3")
        assert status == 200 and (body["x0"], body["x1"], body["width"]) == (5, None, 3) and len(body["loss"]) == 3
        status, body = get(server, "/api/runs/0/latest_losses?width=0")  # its query group's checks come with it
        assert status == 400 and "width=0 must be at least 1" in body["error"]
    data = snapshot([run.path], "t")
    assert data["panels"][-1] == PANEL.describe()
    assert data["runs_data"][0]["latest_losses"]["width"] == REPORT_WIDTH


def test_every_panel_has_its_draw_function_and_its_slot_in_the_page():
    js, html = assets.read_text("dashboard.js"), assets.read_text("index.html")
    names = [panel.name for panel in panels.PANELS]
    assert len(set(names)) == len(names) and not {"layers", "incidents"} & set(names)  # the lookups' routes
    for panel in panels.PANELS:
        assert panel.draw is None or f"draw.{panel.draw} = " in js, panel.name
        assert panel.slot is None or f'id="{panel.slot}"' in html, panel.name


@pytest.mark.slow
@pytest.mark.skipif(not browser.available(), reason=f"needs {browser.CHROMIUM} and {browser.CHROMEDRIVER}")
def test_the_page_draws_a_panel_declared_once_live_and_in_the_report(tmp_path, registered):
    run = write_rollback_run(tmp_path / "run")
    out = write_report([run.path], tmp_path / "report.html")
    with DashboardServer([run.path], poll_interval=0.1) as server, browser.headless_chromium() as driver:
        for url in (server.url, out.as_uri()):
            driver.get(url)
            browser.wait_until_rendered(driver)
            driver.execute_script(DRAW)
            WebDriverWait(driver, 60).until(lambda d: d.execute_script(
                "const p = document.getElementById('plot-latest-losses'); return p.data && p.data[0].meta.kind"))
            drawn, payload, train = driver.execute_script(
                "const s = window.dashboardState; return [document.getElementById('plot-latest-losses').data[0].y, "
                "s.data[0].latest_losses, s.runs[0].records.train]")
            assert drawn == payload["loss"] and len(drawn) == min(payload["width"], train) > 0, url
