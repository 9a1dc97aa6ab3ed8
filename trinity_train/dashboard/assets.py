"""The page's files: the dashboard's own (package data under `static/`) and plotly.js, taken
from the installed `plotly` Python package (its bundled `plotly.min.js`), so nothing comes from
a CDN and the dashboard and the report work offline."""

from __future__ import annotations

import importlib.resources
import importlib.util
from functools import cache
from pathlib import Path

# what /static/ serves, by name, with its media type; nothing else is served from disk
SERVED = {"dashboard.js": "text/javascript", "dashboard.css": "text/css", "plotly.min.js": "text/javascript"}


def plotly_js_path() -> Path:
    """plotly.min.js of the installed plotly package (found without importing plotly)."""
    spec = importlib.util.find_spec("plotly")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("the plotly package is not installed (pip install -e .)")
    return Path(list(spec.submodule_search_locations)[0]) / "package_data" / "plotly.min.js"


@cache
def read_bytes(name: str) -> bytes:
    if name == "plotly.min.js":
        return plotly_js_path().read_bytes()
    return (importlib.resources.files("trinity_train.dashboard") / "static" / name).read_bytes()


def read_text(name: str) -> str:
    return read_bytes(name).decode("utf-8")
