"""Small helpers shared by the test suites."""

from __future__ import annotations

import contextlib
import gc
import os
import signal
import subprocess
import time
from pathlib import Path

from zshardfs.cli import process_running

__all__ = ["daemons_of", "event_loop_cpu", "process_running", "wait_for", "take_down"]  # process_running: the CLI's own notion of "still running"


def wait_for(predicate, timeout: float = 10.0, interval: float = 0.02):
    """Poll ``predicate`` until it is truthy or ``timeout`` passes; its last value."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    return predicate()


class _Spent:
    seconds = 0.0


@contextlib.contextmanager
def event_loop_cpu():
    """CPU seconds of this thread (the one running the trio loop) over the
    block, as ``spent.seconds``, the cyclic collector held off.  Tests that
    compare the event loop's cost of two code paths use it: process time
    also counts other threads of a long pytest run, and a collection of its
    heap landing in one side tripled a 34 ms figure once in CI."""
    gc.collect()
    was_on = gc.isenabled()
    gc.disable()
    spent = _Spent()
    started = time.thread_time()
    try:
        yield spent
    finally:
        spent.seconds = time.thread_time() - started
        if was_on:
            gc.enable()


def daemons_of(mountpoint) -> list[int]:
    """The pids of the zshardfs daemons (``zshardfs mount --foreground``) whose mount point is
    ``mountpoint``, mounted yet or not: also one whose ``zshardfs mount`` was interrupted
    before it answered (it goes on starting, detached)."""
    wanted = {os.fsencode(str(mountpoint)), os.fsencode(os.path.abspath(mountpoint))}
    out = []
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            args = Path(f"/proc/{d}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"zshardfs.cli" in args and b"--foreground" in args and len(args) > 1 and args[-2] in wanted:
            out.append(int(d))
    return out


def take_down(mountpoint, pid: int | None = None, gentle: bool = True, timeout: float = 10.0) -> None:
    """A harness's last word on a mount point it used: detached (``fusermount3 -uz``), and every
    daemon serving it ended: ``pid`` (the one the harness started there), and any other
    :func:`daemons_of` finds (one whose ``zshardfs mount`` an abort interrupted goes on,
    detached). ``gentle``: SIGTERM first (a daemon still storing what its unmount could not,
    e.g. with storage unreachable, then gives up and logs what it lost: SEMANTICS 4.8), then
    SIGKILL. Never leaves a daemon behind retrying storage that is gone; a pid that no longer
    names a daemon of ``mountpoint`` is left alone."""
    subprocess.run(["fusermount3", "-uz", str(mountpoint)], capture_output=True)
    pids = {pid, *daemons_of(mountpoint)} - {None}
    for p in pids:
        for sig in (signal.SIGTERM, signal.SIGKILL) if gentle else (signal.SIGKILL,):
            if p not in daemons_of(mountpoint) or not process_running(p):
                break
            try:
                os.kill(p, sig)
            except ProcessLookupError:
                break
            wait_for(lambda: not process_running(p), timeout=timeout, interval=0.05)
    if pids:  # (one may have mounted meanwhile, or died leaving its mount)
        subprocess.run(["fusermount3", "-uz", str(mountpoint)], capture_output=True)


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


#: the ways a tool saves a file over one that exists (``save_as``)
SAVES = ("write", "tmprename", "rmput", "editor", "emptied")


def save_as(path: Path, data: bytes, how: str) -> None:
    """Write ``data`` over the file ``path`` as a tool would: in place (``write``), a
    temporary renamed over it (``tmprename``), removed then written anew (``rmput``),
    an editor's save (renamed to ``~``, written anew, the ``~`` removed: ``editor``), or
    truncated to 0 then written (``emptied``)."""
    path = Path(path)
    if how == "write":
        path.write_bytes(data)
    elif how == "tmprename":
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_bytes(data)
        os.rename(tmp, path)
    elif how == "rmput":
        os.unlink(path)
        path.write_bytes(data)
    elif how == "editor":
        backup = path.with_name(path.name + "~")
        os.rename(path, backup)
        with open(path, "xb") as f:
            f.write(data)
        os.unlink(backup)
    elif how == "emptied":
        os.truncate(path, 0)
        with open(path, "r+b") as f:
            f.write(data)
    else:
        raise ValueError(how)


def assert_below_as_a_scan(table, plain: dict, step: int) -> None:
    """What fuse_ops' path ``table`` (_PathTable, _ForgottenTable) finds at or below a
    few directories is what a scan of the dict ``plain`` holding the same finds."""
    for top in ("", "a", "a/x", "b/y/q"):
        below = top + "/" if top else ""
        assert sorted(table.below(top)) == sorted((p, i) for p, i in plain.items()
                                                  if p == top or p.startswith(below)), (step, top)
