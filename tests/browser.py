"""A headless Chromium driven over the DevTools protocol (the `websockets` client), for tests of pages we write:
load a file, record every request the page makes, evaluate JavaScript in it, take a screenshot.

    with Browser() as browser:
        browser.load(path)                  # waits for the load event
        browser.evaluate("document.title")  # the value, JSON-decoded
        browser.requests                    # every URL the page asked for (the page itself included)
        browser.screenshot(png_path)

`chromium_path()` is None where no Chromium is installed (the Debian package `chromium`; .ci/run installs it).
"""

from __future__ import annotations

import base64
import contextlib
import itertools
import json
import shutil
import subprocess
import tempfile
import time
import urllib.request
from pathlib import Path

from websockets.sync.client import connect


def chromium_path() -> str | None:
    return next((p for p in map(shutil.which, ("chromium", "chromium-browser", "google-chrome")) if p), None)


class Browser:
    def __init__(self, width: int = 1400, height: int = 1000, timeout_s: float = 60.0):
        self.size, self.timeout_s, self.requests, self.ids = (width, height), timeout_s, [], itertools.count(1)

    def __enter__(self) -> Browser:
        self.profile, self.stack = tempfile.TemporaryDirectory(), contextlib.ExitStack()
        self.proc = subprocess.Popen(
            [
                chromium_path(),
                "--headless=new",
                "--no-sandbox",
                "--disable-gpu",
                "--no-first-run",
                "--disable-extensions",
                "--disable-background-networking",
                "--disable-component-update",
                "--remote-debugging-port=0",
                f"--user-data-dir={self.profile.name}",
                f"--window-size={self.size[0]},{self.size[1]}",
                "about:blank",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        port_file = Path(self.profile.name) / "DevToolsActivePort"
        deadline = time.monotonic() + self.timeout_s
        while not (port_file.exists() and port_file.read_text().strip()):
            if time.monotonic() > deadline or self.proc.poll() is not None:
                self.__exit__()
                raise RuntimeError("chromium did not open its DevTools port")
            time.sleep(0.1)
        port = port_file.read_text().split()[0]
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/json/list", timeout=10) as response:
            page = next(t for t in json.load(response) if t["type"] == "page")
        self.socket = self.stack.enter_context(
            connect(page["webSocketDebuggerUrl"], max_size=None, open_timeout=self.timeout_s)
        )
        self.call("Network.enable")
        self.call("Page.enable")
        self.call("Runtime.enable")
        return self

    def __exit__(self, *exc) -> None:
        self.stack.close()
        self.proc.terminate()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.profile.cleanup()

    def call(self, method: str, **params) -> dict:
        """Send one command and return its result; events that arrive meanwhile are recorded (`_event`)."""
        ident = next(self.ids)
        self.socket.send(json.dumps({"id": ident, "method": method, "params": params}))
        while True:
            message = json.loads(self.socket.recv(timeout=self.timeout_s))
            if message.get("id") == ident:
                if "error" in message:
                    raise RuntimeError(f"{method}: {message['error']}")
                return message["result"]
            self._event(message)

    def _event(self, message: dict) -> str | None:
        if message.get("method") == "Network.requestWillBeSent":
            self.requests.append(message["params"]["request"]["url"])
        return message.get("method")

    def load(self, path: Path, fragment: str = "") -> None:
        """Open the file (afresh: a fragment-only change would not reload it) and wait for its load event."""
        for url in ("about:blank", Path(path).resolve().as_uri() + (f"#{fragment}" if fragment else "")):
            self.call("Page.navigate", url=url)
            deadline = time.monotonic() + self.timeout_s
            while self._event(json.loads(self.socket.recv(timeout=self.timeout_s))) != "Page.loadEventFired":
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{url} did not finish loading")

    def evaluate(self, expression: str):
        """The value of a JavaScript expression in the page (an exception in it raises RuntimeError)."""
        result = self.call("Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True)
        if "exceptionDetails" in result:
            raise RuntimeError(f"{expression}: {result['exceptionDetails']}")
        return result["result"].get("value")

    def screenshot(self, path: Path, full_page: bool = False) -> Path:
        params = {"format": "png", "captureBeyondViewport": full_page}
        if full_page:
            width, height = self.evaluate(
                "[document.documentElement.scrollWidth, document.documentElement.scrollHeight]"
            )
            params["clip"] = {"x": 0, "y": 0, "width": width, "height": height, "scale": 1}
        Path(path).write_bytes(base64.b64decode(self.call("Page.captureScreenshot", **params)["data"]))
        return Path(path)
