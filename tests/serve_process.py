"""A ``serve`` process started by a test (a helper module, not collected by pytest)."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import httpx


def wait_until_healthy(proc: subprocess.Popen, url: str, log: Path, timeout_s: float) -> None:
    """Poll ``url/health`` until it answers 200; fail with the process's log if the process
    exits or ``timeout_s`` passes first."""
    deadline = time.monotonic() + timeout_s
    while True:
        assert proc.poll() is None, log.read_text()
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return
        except httpx.TransportError:
            pass
        assert time.monotonic() < deadline, log.read_text()
        time.sleep(0.2)
