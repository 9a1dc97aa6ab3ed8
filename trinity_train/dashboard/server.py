"""The live dashboard: a Starlette app over named run directories, served by uvicorn.

Read-only and local by default: it binds 127.0.0.1, answers only GET, addresses runs by their
index on the command line (never by a path from the URL), builds every file path through
`RunDir`, and refuses (404) an incident name of any other form or a file that resolves outside
its run directory. A bad query value is a 400 with a one-line JSON error; nothing answers with a
traceback. A background task re-reads the run directories every `poll_interval` seconds and
pushes what changed to the pages over Server-Sent Events (`/api/stream`); the page then fetches
the views it shows. A route per panel of `panels.PANELS`; the routes are documented in
docs/CONTRACT.md "Dashboard".
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import json
import math
import socket
import sys
import threading
import time
from collections.abc import AsyncIterator
from pathlib import Path

import anyio
import uvicorn
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.trustedhost import TrustedHostMiddleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from trinity_train.dashboard import assets, panels, views
from trinity_train.dashboard.runs import RunView
from trinity_train.errors import ArgumentError, UserError

KEEPALIVE_S = 15.0
MAX_WIDTH = 20000
_HEADERS = {"X-Content-Type-Options": "nosniff", "Referrer-Policy": "no-referrer", "Cache-Control": "no-store"}


class DashboardError(UserError):
    """The dashboard cannot start as asked (a port in use)."""


def bad_request(message: str) -> HTTPException:
    return HTTPException(400, message)


# -- query values ------------------------------------------------------------------------------

def _query(request: Request, name: str, convert, what: str):
    """The query value `name` converted, None when absent; a 400 naming it when it is not `what`."""
    raw = request.query_params.get(name)
    if raw is None or raw == "":
        return None
    try:
        return convert(raw)
    except ValueError:
        raise bad_request(f"query value {name}={raw!r} is not {what}") from None


def _integer(request: Request, name: str, default: int | None = None, minimum: int | None = None) -> int | None:
    value = _query(request, name, int, "an integer")
    if value is None:
        return default
    if minimum is not None and value < minimum:
        raise bad_request(f"query value {name}={value} must be at least {minimum}")
    return value


def _number(request: Request, name: str) -> float | None:
    value = _query(request, name, float, "a number")
    if value is not None and not math.isfinite(value):
        raise bad_request(f"query value {name}={request.query_params[name]!r} is not a finite number")
    return value


def _range(request: Request) -> dict:
    x0, x1 = _number(request, "x0"), _number(request, "x1")
    if x0 is not None and x1 is not None and x0 > x1:
        raise bad_request(f"query values x0={x0:g} > x1={x1:g}: the range is empty")
    width = _integer(request, "width", 1000, minimum=1)
    if width > MAX_WIDTH:
        raise bad_request(f"query value width={width} is above the maximum {MAX_WIDTH}")
    return {"x0": x0, "x1": x1, "width": width}


def _series_names(request: Request) -> dict:
    raw = request.query_params.get("names")
    names = list(views.SERIES) if not raw else raw.split(",")
    unknown = [n for n in names if n not in views.SERIES]
    if unknown:
        raise bad_request(f"unknown series {unknown[0]!r}; known: {', '.join(views.SERIES)}")
    return {"names": names}


# a panel's query group -> its keyword values for the view, read from the request
QUERY = {panels.RANGE: _range, panels.NAMES: _series_names}


# -- the app -----------------------------------------------------------------------------------

class Dashboard:
    """The runs, the pages listening for updates, and the loop that re-reads the runs."""

    def __init__(self, run_dirs: list[str | Path], poll_interval: float = 0.5):
        self.runs = [RunView(i, path) for i, path in enumerate(run_dirs)]
        self.poll_interval = poll_interval
        self.stopping = threading.Event()
        self._listeners: set[asyncio.Queue] = set()

    def run(self, request: Request) -> RunView:
        raw = request.path_params["run"]
        if not (raw.isascii() and raw.isdigit()) or int(raw) >= len(self.runs):
            raise bad_request(f"unknown run index {raw!r}: the dashboard shows runs 0..{len(self.runs) - 1}")
        return self.runs[int(raw)]

    async def poll_forever(self) -> None:
        while not self.stopping.is_set():
            for run in self.runs:
                update = await anyio.to_thread.run_sync(run.refresh)
                if update is not None:
                    if update.reset:
                        self._publish("reset", {"run": update.run, "generation": update.generation})
                    self._publish("update", update.as_message())
            await asyncio.sleep(self.poll_interval)

    def _publish(self, event: str, data: dict) -> None:
        message = f"event: {event}\ndata: {json.dumps(data)}\n\n"
        for queue in list(self._listeners):
            with contextlib.suppress(asyncio.QueueFull):  # a stalled page refetches on its next update
                queue.put_nowait(message)

    async def stream(self, request: Request) -> StreamingResponse:
        queue: asyncio.Queue = asyncio.Queue(maxsize=1000)
        self._listeners.add(queue)

        async def messages() -> AsyncIterator[str]:
            try:
                hello = {"runs": [views.run_summary(r) for r in self.runs]}
                yield f"event: hello\ndata: {json.dumps(hello)}\n\n"
                quiet_since = time.monotonic()
                while not self.stopping.is_set():
                    try:  # wake up now and then to notice a shutdown
                        yield await asyncio.wait_for(queue.get(), timeout=0.25)
                        quiet_since = time.monotonic()
                    except TimeoutError:
                        if time.monotonic() - quiet_since > KEEPALIVE_S:
                            quiet_since = time.monotonic()
                            yield ": keep-alive\n\n"
            finally:
                self._listeners.discard(queue)

        return StreamingResponse(messages(), media_type="text/event-stream",
                                 headers={**_HEADERS, "X-Accel-Buffering": "no"})


def _json(payload: dict) -> JSONResponse:
    return JSONResponse(payload, headers=_HEADERS)


def create_app(run_dirs: list[str | Path], poll_interval: float = 0.5, host: str = "127.0.0.1") -> Starlette:
    dashboard = Dashboard(run_dirs, poll_interval)

    def page(request: Request) -> Response:
        return Response(assets.read_text("index.html"), media_type="text/html", headers=_HEADERS)

    def static(request: Request) -> Response:
        name = request.path_params["name"]
        if name not in assets.SERVED:
            raise HTTPException(404, f"no static file {name!r}")
        return Response(assets.read_bytes(name), media_type=assets.SERVED[name], headers=_HEADERS)

    def runs(request: Request) -> JSONResponse:
        return _json({"runs": [views.run_summary(r) for r in dashboard.runs]})

    def panel_list(request: Request) -> JSONResponse:
        return _json({"panels": [panel.describe() for panel in panels.PANELS]})

    def answer(panel: panels.Panel):
        def route(request: Request) -> JSONResponse:
            run = dashboard.run(request)  # an unknown run is the error, before any query value
            return _json(panel.payload(run, lambda group: QUERY[group](request)))
        return route

    def layer_record(request: Request) -> JSONResponse:
        run = dashboard.run(request)
        return _json(views.layer_record(run, _integer(request, "iter", minimum=0)))

    def incident(request: Request) -> JSONResponse:
        run = dashboard.run(request)
        report = run.incident_report(request.path_params["name"])
        if report is None:
            raise HTTPException(404, "no such incident report in this run")
        return _json(report)

    async def error(request: Request, exc: Exception) -> JSONResponse:
        status = exc.status_code if isinstance(exc, HTTPException) else 500
        detail = exc.detail if isinstance(exc, HTTPException) else "internal error (see the dashboard's console)"
        if status == 500:
            print(f"dashboard: error on {request.url.path}: {exc!r}", file=sys.stderr)
        return JSONResponse({"error": " ".join(str(detail).split())}, status_code=status, headers=_HEADERS)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette):
        poller = asyncio.create_task(dashboard.poll_forever())
        try:
            yield
        finally:
            dashboard.stopping.set()
            poller.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await poller

    routes = [
        Route("/", page), Route("/static/{name}", static), Route("/api/runs", runs), Route("/api/panels", panel_list),
        Route("/api/stream", dashboard.stream),
        *(Route(f"/api/runs/{{run}}/{panel.name}", answer(panel)) for panel in panels.PANELS),
        Route("/api/runs/{run}/layers", layer_record), Route("/api/runs/{run}/incidents/{name:path}", incident),
    ]
    # A page on another site must not read the dashboard through a DNS name that points here.
    middleware = [Middleware(TrustedHostMiddleware, allowed_hosts=["127.0.0.1", "localhost"])] \
        if host in ("127.0.0.1", "localhost") else []
    app = Starlette(debug=False, routes=routes, middleware=middleware, lifespan=lifespan,
                    exception_handlers={HTTPException: error, Exception: error})
    app.state.dashboard = dashboard
    return app


# -- serving -----------------------------------------------------------------------------------

def listen(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OverflowError:
        sock.close()
        raise ArgumentError(f"--port {port}: a port is a number from 0 to 65535") from None
    except OSError as e:
        sock.close()
        if isinstance(e, socket.gaierror) or e.errno == errno.EADDRNOTAVAIL:  # the host, not the port
            raise ArgumentError(f"--host {host}: not an address of this machine ({e.strerror or e}); give one of its "
                                "addresses, e.g. 127.0.0.1 (the default)") from None
        hint = ("is another dashboard running there? choose another --port" if e.errno == errno.EADDRINUSE
                else "choose another --port")
        raise DashboardError(f"cannot listen on {host}:{port}: {e.strerror or e} ({hint})") from None
    sock.listen(128)
    return sock


class _Uvicorn(uvicorn.Server):
    """Ends the event streams when asked to exit, so open pages do not hold the shutdown up."""

    def __init__(self, config: uvicorn.Config, stopping: threading.Event):
        super().__init__(config)
        self.stopping = stopping

    def handle_exit(self, sig, frame) -> None:
        self.stopping.set()
        super().handle_exit(sig, frame)


class DashboardServer:
    """The dashboard on a socket bound now (port 0: a free one, read back as `.port`).
    `serve_forever()` runs it in this thread (the CLI); `with DashboardServer(...) as s:` runs it
    in a background thread until the block ends (tests, scripts)."""

    def __init__(self, run_dirs: list[str | Path], host: str = "127.0.0.1", port: int = 0, poll_interval: float = 0.5):
        self.host = host
        self.app = create_app(run_dirs, poll_interval, host)
        self.socket = listen(host, port)
        self.port = self.socket.getsockname()[1]
        config = uvicorn.Config(self.app, log_level="warning", access_log=False, lifespan="on",
                                timeout_graceful_shutdown=2)
        self.server = _Uvicorn(config, self.app.state.dashboard.stopping)
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/"

    def serve_forever(self) -> None:
        try:
            self.server.run(sockets=[self.socket])
        finally:
            self.socket.close()

    def __enter__(self) -> DashboardServer:
        self._thread = threading.Thread(target=self.serve_forever, name="dashboard", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the dashboard server did not start")
            time.sleep(0.01)
        return self

    def __exit__(self, *exc) -> None:
        self.app.state.dashboard.stopping.set()
        self.server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout=10)
