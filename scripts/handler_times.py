"""Time every FUSE handler of a zshardfs mount, for finding where a workload's
time goes inside the daemon.

    .venv/bin/python scripts/handler_times.py SOURCE MOUNTPOINT [-o OPTS] [--endpoint-url URL]

Serves the mount in the foreground (as ``zshardfs mount -f``) with each
handler wrapped: its calls, the wall time spent inside it (waits for
storage included) and the event loop thread's CPU time meanwhile (the
handler's own, as long as requests come one at a time, as from one reader;
a worker thread's is not in it) are summed.  ``kill -USR1 PID`` (or ``-HUP``: the
daemon's signals for reopening its log, which they still do) prints the sums
so far to stderr and starts new ones; so does unmounting.  Used for docs/PERFORMANCE.md
("where the time goes"); not a benchmark: the wrapping itself costs about
0.5 us per request.
"""

from __future__ import annotations

import collections
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from zshardfs import daemon, fuse_ops  # noqa: E402
from zshardfs.cli import main  # noqa: E402

HANDLERS = ("lookup", "getattr", "open", "read", "release", "opendir", "readdir", "releasedir", "write", "flush",
            "fsync", "create", "unlink", "rename")
sums: dict[str, list] = collections.defaultdict(lambda: [0, 0.0, 0.0])


def timed(name: str):
    handler = getattr(fuse_ops.Operations, name)

    async def wrapper(self, *args):
        t0, c0 = time.perf_counter(), time.thread_time()
        try:
            return await handler(self, *args)
        finally:
            entry = sums[name]
            entry[0] += 1
            entry[1] += time.perf_counter() - t0
            entry[2] += time.thread_time() - c0

    wrapper.__name__ = name
    return wrapper


def report(*_) -> None:
    lines = [f"{'handler':12s} {'calls':>7s} {'total ms':>10s} {'per call us':>12s} {'cpu us':>8s}"]
    for name, (calls, seconds, cpu) in sorted(sums.items()):
        lines.append(f"{name:12s} {calls:7d} {seconds * 1e3:10.1f} {seconds / calls * 1e6:12.1f} "
                     f"{cpu / calls * 1e6:8.1f}")
    print("\n".join(lines), file=sys.stderr, flush=True)
    sums.clear()


def report_at_reopen(reopen_log):
    """The daemon's reopening of its log (SIGUSR1, SIGHUP), then a report:
    a handler of our own for USR1 would be replaced by the daemon's."""
    def wrapper(self, signum: int) -> None:
        reopen_log(self, signum)
        report()

    return wrapper


if __name__ == "__main__":
    for name in HANDLERS:
        setattr(fuse_ops.Operations, name, timed(name))
    daemon.Mount._reopen_log = report_at_reopen(daemon.Mount._reopen_log)
    sys.argv = ["zshardfs", "mount", *sys.argv[1:], "--foreground"]
    try:
        main()
    finally:
        report()
