"""Small helpers shared by the test suites."""

from __future__ import annotations

import time

from zshardfs.cli import process_running

__all__ = ["process_running", "wait_for"]  # process_running: the CLI's own notion of "still running"


def wait_for(predicate, timeout: float = 10.0, interval: float = 0.02):
    """Poll ``predicate`` until it is truthy or ``timeout`` passes; its last value."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    return predicate()
