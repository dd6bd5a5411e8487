"""Debian's Chromium, headless, driven over its DevTools protocol: what a person would see of a page.

setup.sh installs `chromium` (apt); without it the tests that use this are skipped, and under CI=true they fail. The
flags are the ones this kind of machine needs (a closed network: no background connections, no component updates).
Loopback only: the DevTools port listens on 127.0.0.1, and every wait is bounded.
"""

from __future__ import annotations

import itertools
import json
import os
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--remote-debugging-address=127.0.0.1", "--window-size=1200,900")


def require() -> str:
    """The chromium binary, or a skip (a failure under CI=true) naming what to install."""
    found = shutil.which("chromium")
    if found is None:
        why = "Debian's chromium is not installed: bash setup.sh (or apt-get install chromium)"
        if os.environ.get("CI") == "true":
            pytest.fail(why)
        pytest.skip(why)
    return found


class Page:
    """One page open in a fresh headless Chromium; `evaluate` runs JavaScript in it and returns the value."""

    def __init__(self, url: str, timeout_s: float = 60.0) -> None:
        from websockets.sync.client import connect

        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        self.profile = tempfile.TemporaryDirectory()
        self.proc = subprocess.Popen([require(), *FLAGS, f"--remote-debugging-port={port}",
                                      f"--user-data-dir={self.profile.name}", "about:blank"],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self.timeout_s, self._ids = timeout_s, itertools.count(1)
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                target = httpx.put(f"http://127.0.0.1:{port}/json/new?{url}", timeout=5).json()
                break
            except httpx.HTTPError:
                if time.monotonic() > deadline or self.proc.poll() is not None:
                    self.close()
                    raise RuntimeError(f"chromium did not open its DevTools port {port} within {timeout_s} s") from None
                time.sleep(0.2)
        self.ws = connect(target["webSocketDebuggerUrl"], max_size=None, open_timeout=timeout_s)
        # The new target holds about:blank, already "complete", until the navigation to `url` commits.
        while self.evaluate("location.href !== 'about:blank' && document.readyState") != "complete":
            if time.monotonic() > deadline:
                raise RuntimeError(f"{url} did not finish loading within {timeout_s} s")
            time.sleep(0.1)

    def evaluate(self, expression: str) -> Any:
        call = next(self._ids)
        self.ws.send(json.dumps({"id": call, "method": "Runtime.evaluate",
                                 "params": {"expression": expression, "returnByValue": True}}))
        while True:
            answer = json.loads(self.ws.recv(timeout=self.timeout_s))
            if answer.get("id") == call:
                result = answer["result"]
                if "exceptionDetails" in result:
                    raise RuntimeError(f"{expression!r} raised: {result['exceptionDetails']}")
                return result["result"].get("value")

    def close(self) -> None:
        if getattr(self, "ws", None) is not None:
            self.ws.close()
        self.proc.terminate()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=10)
        self.profile.cleanup()

    def __enter__(self) -> Page:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()


def open_file(path: Path) -> Page:
    return Page(path.resolve().as_uri())
