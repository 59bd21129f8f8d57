"""Give the memory the daemon freed back to the system.

glibc's malloc keeps the memory Python frees for later use, and returns it
only from the top of its heap: chunk data is allocated there among
long-lived objects, so after the write-back buffers drain it is all kept.
Measured (docs/PERFORMANCE.md, "Memory over time"): 256 MiB written through a
mount with ``flush_delay=inf``, then stored, left an RSS of 268 MiB of which
24 MiB were in use; ``malloc_trim(0)`` gave 190 MiB back, in about 15 ms
(60 ms for 800 MiB; 1.3 ms when there is nothing to give back).

Worker threads (S3 requests, file I/O) each get an arena of their own, up
to eight per core, which trimming leaves fragmented: on S3, a 128 MiB burst
stored left 146 MiB after the trims against 87 before it; with at most
ARENA_MAX arenas, 98 (the threads allocate holding the GIL, so they hardly
contend for them).  The daemon sets that limit itself at start
(:func:`limit_arenas`, ``mallopt(M_ARENA_MAX)``), before it makes threads.

So the daemon calls ``malloc_trim(0)`` (in a worker thread) when the
write-back set has shrunk by SHRUNK bytes from its peak, and once after it
has been busy and then idle for IDLE seconds (nothing read, stored or
looked up), at most once per MIN_INTERVAL seconds.  Where there is no
``malloc_trim`` (not glibc) this does nothing; ``-o malloc_trim=off`` turns
it off.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import time
from typing import Callable

import trio

log = logging.getLogger(__name__)

#: seconds between looks at the daemon's activity and write-back set
TICK = 1.0
#: seconds of no activity (after some) before freed memory is given back
IDLE = 5.0
#: bytes the write-back set must shrink by from its peak to give memory back at once
SHRUNK = 32 << 20
#: seconds between two trims at least (each walks every arena: ~1 ms per
#: call, more when pages are given back)
MIN_INTERVAL = 5.0


def rss_bytes() -> int:
    """This process's resident memory (0 where /proc has no answer)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


#: malloc arenas at most (the main one included; see the module's docstring)
ARENA_MAX = 2
M_ARENA_MAX = -8  # (glibc's malloc.h)


def limit_arenas(limit: int = ARENA_MAX) -> bool:
    """Make glibc use at most ``limit`` arenas from now on (False: not glibc,
    or ``MALLOC_ARENA_MAX`` in the environment says otherwise)."""
    if "MALLOC_ARENA_MAX" in os.environ:
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return mallopt(M_ARENA_MAX, limit) == 1


def malloc_trim() -> Callable[[int], int] | None:
    """glibc's ``malloc_trim``, or None (another C library)."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        fn = libc.malloc_trim
    except (OSError, AttributeError):
        return None
    fn.argtypes, fn.restype = [ctypes.c_size_t], ctypes.c_int
    return fn


class Trimmer:
    """Calls ``trim(0)`` as the module's docstring says.  ``activity()``
    changes whenever the daemon does something; ``dirty_bytes()`` is the
    write-back set's size.  ``in_thread=False``: ``trim`` is called in the
    loop (a test's, under a mock clock that a worker thread would outrun)."""

    def __init__(self, activity: Callable[[], object], dirty_bytes: Callable[[], int],
                 trim: Callable[[int], int] | None = None, in_thread: bool = True):
        self.activity = activity
        self.dirty_bytes = dirty_bytes
        self.trim = trim
        self.in_thread = in_thread
        self.trims = 0  # calls made (for stats)
        self.returned = 0  # bytes of RSS they gave back, summed
        self._limiter = trio.CapacityLimiter(1)

    async def run(self, tick: float = TICK, idle: float = IDLE, shrunk: int = SHRUNK,
                  min_interval: float = MIN_INTERVAL) -> None:
        if self.trim is None:
            return
        seen, quiet, busy = self.activity(), 0.0, False
        peak, last = self.dirty_bytes(), float("-inf")
        while True:
            await trio.sleep(tick)
            now, dirty = self.activity(), self.dirty_bytes()
            if now != seen:
                seen, quiet, busy = now, 0.0, True
            else:
                quiet += tick
            peak = max(peak, dirty)
            due = peak - dirty >= shrunk or (busy and quiet >= idle)
            if due and trio.current_time() - last >= min_interval:
                await self._trim()
                last, busy, peak = trio.current_time(), False, self.dirty_bytes()

    async def _trim(self) -> None:
        before = rss_bytes()
        started = time.monotonic()
        if self.in_thread:
            await trio.to_thread.run_sync(self.trim, 0, limiter=self._limiter)
        else:
            self.trim(0)
        after = rss_bytes()
        self.trims += 1
        self.returned += max(0, before - after)
        log.debug("malloc_trim: RSS %d -> %d MiB in %.1f ms", before >> 20, after >> 20,
                  (time.monotonic() - started) * 1e3)
