#!/usr/bin/env python3
"""Screenshot the live dashboard of run directories in headless Chromium (the picture in docs/guides/dashboard.md).

    .venv/bin/python scripts/screenshot_dashboard.py RUN_DIR [RUN_DIR ...] OUT.png

Serves the dashboard on a free local port, waits until the page has drawn its charts, saves a
full-page PNG and prints the page's console errors, if any.
"""

from __future__ import annotations

import argparse
import sys

from trinity_train.dashboard import browser
from trinity_train.dashboard.server import DashboardServer


def screenshot(run_dirs: list[str], out: str, width: int = 1600) -> list[str]:
    """Save the screenshot; returns the browser console's error messages."""
    with DashboardServer(run_dirs) as server, browser.headless_chromium(width=width, height=1000) as driver:
        driver.get(server.url)
        browser.wait_until_rendered(driver)
        height = driver.execute_script("return document.documentElement.scrollHeight")
        # a viewport as tall as the page, so the screenshot holds all of it
        driver.execute_cdp_cmd("Emulation.setDeviceMetricsOverride",
                               {"width": width, "height": height, "deviceScaleFactor": 1, "mobile": False})
        driver.execute_async_script("setTimeout(arguments[0], 800)")  # let plotly resize
        driver.save_screenshot(out)
        return [e["message"] for e in driver.get_log("browser") if e["level"] == "SEVERE"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("run_dirs", nargs="+", metavar="RUN_DIR")
    parser.add_argument("out", metavar="OUT.png")
    args = parser.parse_args()
    if not browser.available():
        print(f"error: needs {browser.CHROMIUM} and {browser.CHROMEDRIVER} (apt-get install chromium chromium-driver)",
              file=sys.stderr)
        return 1
    errors = screenshot(args.run_dirs, args.out)
    for message in errors:
        print(f"console: {message}", file=sys.stderr)
    print(f"wrote {args.out}")
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
