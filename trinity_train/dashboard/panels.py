"""The dashboard's panels, each declared once: the live server's routes, the offline report's
payloads and the page's loaders all follow from `PANELS`.

A panel is its view (the function that builds its JSON from a `RunView`), the query values
the view reads, the function of dashboard.js's `draw` object that draws it and the page element
it fills (static/index.html lays out the built-in ones; the page adds a plot for any other).
Its payload is answered at `/api/runs/RUN/NAME`, kept as `runs_data[RUN][NAME]` in the report,
and held as `state.data[RUN][NAME]` by the page. A panel without `draw` is data the others
draw with (the markers go on every iteration plot).

The layer record of one step and the incident reports are not panels: the page asks for them
one key at a time (a slider position, a click), and the report keeps a selection of them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from trinity_train.dashboard import goodput_view, views
from trinity_train.dashboard.runs import RunView

# The query values a view may read, by group; the server parses each group from the request
# and the report fills it for the whole run.
RANGE = "range"   # x0, x1 (the iterations shown), width (buckets across them)
NAMES = "names"   # names (which series)


@dataclass(frozen=True)
class Panel:
    name: str                      # route segment and payload key
    view: Callable[..., dict]      # view(run, **the keyword values of its query groups)
    query: tuple[str, ...] = ()
    draw: str | None = None        # a method of dashboard.js's `draw` object
    slot: str | None = None        # the id of the page element it fills

    def payload(self, run: RunView, values_of: Callable[[str], dict]) -> dict:
        """The view's payload for `run`, given the keyword values of each query group it reads."""
        values = {}
        for group in self.query:
            values.update(values_of(group))
        return self.view(run, **values)

    def describe(self) -> dict:
        """What the page needs to load and draw it (served at /api/panels, embedded in a report)."""
        return {"name": self.name, "query": list(self.query), "draw": self.draw, "slot": self.slot}


# In page order: the iteration plots first, with the markers they all carry.
PANELS: tuple[Panel, ...] = (
    Panel("series", views.series, (NAMES, RANGE), draw="timePlots", slot="time-plots"),
    Panel("markers", views.markers),
    Panel("expert_load", views.expert_load, (RANGE,), draw="expertLoad", slot="expert-load"),
    Panel("goodput", goodput_view.goodput, draw="goodput", slot="goodput"),
    Panel("ranks", views.rank_health, (RANGE,), draw="rankHealth", slot="rank-health"),
    Panel("layer_steps", views.layer_steps, draw="layers", slot="layer-statistics"),
    Panel("long_context", views.long_context, draw="longContext", slot="long-context"),
)
