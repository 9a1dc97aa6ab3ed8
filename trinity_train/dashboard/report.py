"""The dashboard's views in one self-contained HTML file (`trinity-train report`).

The page is the live dashboard's own (static/index.html and dashboard.js) with plotly.min.js,
the style sheet and the data inlined: `window.TRINITY_SNAPSHOT` holds the payloads the server
would answer (docs/CONTRACT.md "Dashboard"): every panel's of `panels.PANELS` and a selection of
the layer records and incident reports, so the file opens offline and makes no request.
The series are downsampled once for a wide screen (min and max per bucket, so spikes stay);
zooming in the report magnifies those points rather than fetching more.
"""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import numpy as np

from trinity_train.dashboard import assets, panels, views
from trinity_train.dashboard.runs import RunView
from trinity_train.files import atomic_write_text

REPORT_WIDTH = 2000         # buckets per series: about a wide screen's pixels
MAX_LAYER_RECORDS = 200     # layer-statistics steps kept for the step slider (evenly spaced)
MAX_INCIDENTS = 500         # incident reports inlined per run
# a panel's query group -> its keyword values for the view: the whole run
QUERY = {panels.RANGE: {"x0": None, "x1": None, "width": REPORT_WIDTH}, panels.NAMES: {"names": list(views.SERIES)}}


def snapshot(run_dirs: list[str | Path], title: str) -> dict:
    """What the report's page draws: for each run the payloads of the dashboard's routes."""
    runs = [RunView(i, path) for i, path in enumerate(run_dirs)]
    for run in runs:
        run.refresh()
    return {"title": title, "written": time.strftime("%Y-%m-%d %H:%M"),
            "panels": [panel.describe() for panel in panels.PANELS],
            "runs": [views.run_summary(run) for run in runs],
            "runs_data": [_run_data(run) for run in runs]}


def _run_data(run: RunView) -> dict:
    data = {panel.name: panel.payload(run, QUERY.__getitem__) for panel in panels.PANELS}
    # The slider's steps cut to those whose layer records the file keeps; the reports of the
    # incidents the markers name.
    steps = data["layer_steps"]
    kept = _evenly_spaced(steps["iters"], MAX_LAYER_RECORDS)
    data["layer_steps"] = {**steps, "iters": kept,
                           "abandoned": [steps["abandoned"][steps["iters"].index(i)] for i in kept]}
    data["layer_records"] = [views.layer_record(run, i) for i in kept]
    markers = data["markers"]
    names = sorted({m["incident"] for m in markers["skipped"] + markers["rollbacks"] if m["incident"]})[:MAX_INCIDENTS]
    data["incidents"] = {name: report for name in names if (report := run.incident_report(name)) is not None}
    return data


def _evenly_spaced(values: list[int], limit: int) -> list[int]:
    """At most `limit` of `values`, evenly spaced, always with the last one."""
    if len(values) <= limit:
        return list(values)
    picks = np.unique(np.linspace(0, len(values) - 1, limit).round().astype(int))
    return [values[i] for i in picks]


def _script(text: str) -> str:
    """`text` in an inline script element. Only "</script" would end the element early (and
    "<!--" make the parser look for one); neither is in plotly.min.js or dashboard.js, and the
    data escapes every "<"."""
    if re.search(r"</script|<!--", text, re.IGNORECASE):
        raise RuntimeError("a script to inline holds '</script' or '<!--'")
    return "<script>" + text + "</script>"


def render_html(data: dict) -> str:
    page = assets.read_text("index.html")
    inlined = {
        '<link rel="stylesheet" href="static/dashboard.css">': "<style>" + assets.read_text("dashboard.css") + "</style>",
        '<script src="static/plotly.min.js"></script>': _script(assets.read_text("plotly.min.js")),
        '<script src="static/dashboard.js"></script>':
            # "<" escaped in the data: no text of a run (a document's first tokens) can end the script
            _script("window.TRINITY_SNAPSHOT = " + json.dumps(data, allow_nan=False).replace("<", "\\u003c") + ";")
            + _script(assets.read_text("dashboard.js")),
    }
    for tag, replacement in inlined.items():
        if tag not in page:
            raise RuntimeError(f"static/index.html no longer holds {tag!r}: the report cannot inline it")
        page = page.replace(tag, replacement)
    return page.replace("<title>trinity-train dashboard</title>", f"<title>{_escape(data['title'])}</title>")


def _escape(text: str) -> str:
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


def write_report(run_dirs: list[str | Path], out_path: str | Path, title: str | None = None) -> Path:
    """Write the report of `run_dirs` to `out_path` (atomically: complete or absent) and return
    its path. Missing or empty run directories are shown as waiting, as in the dashboard."""
    names = ", ".join(Path(p).resolve().name for p in run_dirs)
    data = snapshot(run_dirs, title or f"trinity-train report: {names}")
    out_path = Path(out_path)
    atomic_write_text(out_path, render_html(data))
    return out_path
