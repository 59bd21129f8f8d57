"""Shared fixtures: real FUSE mounts through the real command line.

A mount test never skips: if /dev/fuse or fusermount3 is missing the
session fails at once with a clear message, because a skipped mount test
would hide exactly the failures this project exists to prevent.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.util import take_down

ROOT = Path(__file__).resolve().parent.parent
ZSHARDFS = [sys.executable, "-m", "zshardfs.cli"]

pytest_plugins = ["tests.conftest_s3"]


def pytest_sessionstart(session):
    # Dummy AWS credentials (and no ~/.aws) for the whole session: boto3
    # clients in tests and the daemons they spawn only ever talk to the
    # local moto server.  Set once here, not per test, so that no fixture's
    # teardown can take them away from a later test's daemon.
    from tests.s3server import set_dummy_credentials

    set_dummy_credentials(os.environ)
    problems = []
    if not os.path.exists("/dev/fuse"):
        problems.append("/dev/fuse is missing")
    if shutil.which("fusermount3") is None:
        problems.append("fusermount3 is not installed (apt-get install fuse3)")
    if problems:
        raise pytest.UsageError("real FUSE mounts are required for this suite: " + "; ".join(problems))


class Mounted:
    """One running zshardfs mount made by the ``mount`` fixture."""

    def __init__(self, path: Path, log: Path, source: str):
        self.path = path
        self.log = log
        self.source = source
        self.mounted = True
        try:  # (the daemon, ended by umount if it will not unmount)
            self.pid: int | None = int(os.getxattr(path, "user.zshardfs.pid"))
        except (OSError, ValueError):
            self.pid = None

    def __truediv__(self, other) -> Path:
        return self.path / other

    def __fspath__(self) -> str:
        return str(self.path)

    def stats(self) -> dict:
        out = subprocess.run([*ZSHARDFS, "stats", "--json", str(self.path)], capture_output=True, text=True,
                             check=True, timeout=30)
        return json.loads(out.stdout)

    def log_text(self) -> str:
        return self.log.read_text() if self.log.exists() else ""

    def umount(self, check: bool = True) -> subprocess.CompletedProcess:
        result = subprocess.run([*ZSHARDFS, "umount", str(self.path)], capture_output=True, text=True, timeout=180)
        if result.returncode != 0:
            # (refused: it holds what it cannot store; a daemon left detached would retry for ever)
            take_down(self.path, self.pid)
            if check:
                raise AssertionError(f"umount failed: {result.stderr}")
        self.mounted = False
        return result


def run_mount(source, mountpoint, *opts: str, log: Path | None = None, extra: list[str] | None = None,
              check: bool = True) -> subprocess.CompletedProcess:
    options = list(opts)
    if log is not None:
        options.append(f"log_file={log}")
    cmd = [*ZSHARDFS, "mount", str(source), str(mountpoint)]
    if options:
        cmd += ["-o", ",".join(options)]
    cmd += extra or []
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    if check and result.returncode != 0:
        raise AssertionError(f"mount failed ({result.returncode}): {result.stderr}")
    return result


@pytest.fixture
def mount(tmp_path_factory):
    """``mount(source, *opts, extra=[...]) -> Mounted``; unmounted at teardown,
    and the daemon's log must hold no traceback."""
    made: list[Mounted] = []
    base = tmp_path_factory.mktemp("mnt")

    def _mount(source, *opts: str, extra: list[str] | None = None) -> Mounted:
        i = len(made)
        mnt = base / f"m{i}"
        mnt.mkdir()
        log = base / f"m{i}.log"
        run_mount(source, mnt, *opts, log=log, extra=extra)
        handle = Mounted(mnt, log, str(source))
        made.append(handle)
        return handle

    yield _mount
    for handle in made:
        if handle.mounted:
            handle.umount(check=False)
    for handle in made:
        text = handle.log_text()
        assert "Traceback" not in text, f"daemon log of {handle.path} has a traceback:\n{text[-4000:]}"
