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


def store_with_links_out(tmp_path):
    """A store holding symbolic links that lead out of it (absolute, and
    relative ones climbing out), one that stays inside, and the files
    outside they name."""
    root, outside = tmp_path / "store", tmp_path / "outside"
    (root / "sub").mkdir(parents=True)
    (outside / "etc").mkdir(parents=True)
    (outside / "secret").write_bytes(b"secret")
    (outside / "etc" / "passwd").write_bytes(b"root:x:0:0")
    (root / "sub" / "file").write_bytes(b"inside")
    (root / "leak").symlink_to(outside / "secret")
    (root / "etc").symlink_to(outside / "etc")
    (root / "climb").symlink_to("../outside/secret")
    (root / "up").symlink_to("..")
    (root / "inside").symlink_to("sub/file")
    (root / "sub" / "back").symlink_to("../sub")
    return root, outside
