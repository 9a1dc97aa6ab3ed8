"""Headless Debian Chromium driven by selenium, the one way the tests, the screenshot script and
the benchmark open the dashboard: `/usr/bin/chromium` with `/usr/bin/chromedriver` (never a
browser download), a fresh profile each time, and optionally no network at all."""

from __future__ import annotations

import contextlib
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

CHROMIUM = Path("/usr/bin/chromium")
CHROMEDRIVER = Path("/usr/bin/chromedriver")
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
         "--disable-component-update", "--disable-dev-shm-usage"]
# Every host name fails to resolve and every connection goes to a closed port: no request leaves.
OFFLINE_FLAGS = ["--host-resolver-rules=MAP * ~NOTFOUND", "--proxy-server=127.0.0.1:9", "--proxy-bypass-list=<-loopback>"]


def available() -> bool:
    return CHROMIUM.is_file() and CHROMEDRIVER.is_file()


@contextlib.contextmanager
def headless_chromium(width: int = 1600, height: int = 1400, offline: bool = False) -> Iterator:
    """A selenium Chrome driver on a fresh user-data directory, quit and removed afterwards."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    profile = tempfile.mkdtemp(prefix="trinity-chromium-")
    options = webdriver.ChromeOptions()
    options.binary_location = str(CHROMIUM)
    for flag in FLAGS + (OFFLINE_FLAGS if offline else []) + [f"--user-data-dir={profile}", f"--window-size={width},{height}"]:
        options.add_argument(flag)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(service=Service(str(CHROMEDRIVER)), options=options)
    try:
        yield driver
    finally:
        driver.quit()
        shutil.rmtree(profile, ignore_errors=True)


def wait_until_rendered(driver, timeout: float = 60.0) -> None:
    """Until the page says its charts are drawn (dashboard.js sets body[data-rendered])."""
    from selenium.webdriver.support.ui import WebDriverWait

    WebDriverWait(driver, timeout).until(
        lambda d: d.execute_script("return document.body && document.body.dataset.rendered === 'true'"))
