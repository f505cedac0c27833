"""Headless Chromium driven over the DevTools protocol, for pages that must be measured
as a browser lays them out (widths, scrolling) and not only read as HTML.

One browser per :class:`Browser`; :meth:`Browser.page` opens a tab at a viewport size,
:meth:`Page.eval` runs an expression in it and returns its value, :meth:`Page.screenshot`
writes a PNG.
"""

from __future__ import annotations

import base64
import itertools
import json
import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from websockets.sync.client import connect


def chromium() -> str:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        path = shutil.which(name)
        if path:
            return path
    pytest.fail("headless Chromium is needed for the status page test: apt-get install -y chromium")


class Page:
    def __init__(self, ws_url: str) -> None:
        self.ws = connect(ws_url, max_size=64 * 1024 * 1024, open_timeout=30)
        self._ids = itertools.count(1)

    def call(self, method: str, **params: Any) -> dict:
        mid = next(self._ids)
        self.ws.send(json.dumps({"id": mid, "method": method, "params": params}))
        while True:
            msg = json.loads(self.ws.recv(timeout=60))
            if msg.get("id") == mid:
                if "error" in msg:
                    raise RuntimeError(f"{method}: {msg['error']}")
                return msg.get("result", {})

    def eval(self, expression: str) -> Any:
        got = self.call(
            "Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True
        )
        if "exceptionDetails" in got:
            raise RuntimeError(f"{expression}: {got['exceptionDetails']}")
        return got["result"].get("value")

    def wait(self, expression: str, timeout: float = 30.0) -> Any:
        """Poll `expression` until it is truthy (bounded); while the page is still loading
        (no document.body yet) it may throw, which counts as not yet."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                value, error = self.eval(expression), None
            except RuntimeError as exc:
                value, error = None, exc
            if value:
                return value
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out waiting for {expression}: {error}")
            time.sleep(0.1)

    def screenshot(self, path: Path) -> None:
        data = self.call("Page.captureScreenshot", format="png", captureBeyondViewport=True)
        path.write_bytes(base64.b64decode(data["data"]))

    def close(self) -> None:
        self.ws.close()


class Browser:
    def __init__(self) -> None:
        self.profile = Path(tempfile.mkdtemp(prefix="pw-chromium-"))
        self.proc = subprocess.Popen(
            [
                chromium(),
                "--headless",
                "--no-sandbox",
                "--disable-gpu",
                "--disable-quic",
                "--no-first-run",
                "--disable-background-networking",
                "--disable-component-update",
                "--disable-sync",
                "--disable-dev-shm-usage",
                "--hide-scrollbars",
                "--remote-debugging-port=0",
                f"--user-data-dir={self.profile}",
                "about:blank",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        port_file = self.profile / "DevToolsActivePort"
        deadline = time.monotonic() + 60
        while not (port_file.exists() and port_file.read_text().count("\n") >= 1):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.close()
                raise RuntimeError("Chromium did not open its DevTools port")
            time.sleep(0.1)
        self.base = f"http://127.0.0.1:{port_file.read_text().splitlines()[0]}"

    def page(self, url: str, width: int, height: int) -> Page:
        target = httpx.put(f"{self.base}/json/new?about:blank", timeout=30).json()
        page = Page(target["webSocketDebuggerUrl"])
        page.call(
            "Emulation.setDeviceMetricsOverride",
            width=width,
            height=height,
            deviceScaleFactor=1,
            mobile=False,
        )
        page.call("Page.enable")
        page.call("Page.navigate", url=url)
        return page

    def close(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        shutil.rmtree(self.profile, ignore_errors=True)
