"""Run several storage-bound calls at once and get their outcomes in order.

A trio nursery raises an ``ExceptionGroup`` when a child fails; the callers
here need the error itself (a ``StoreError`` becomes an errno, a
``CorruptData`` a log line and EIO), and often the one an ordered, one-by-one
run would have met first.  So every outcome is kept: a result, or the
exception in its place, and the caller decides what to raise.
"""

from __future__ import annotations

from typing import Any, Awaitable, Callable

import trio


async def outcomes(*calls: Callable[[], Awaitable[Any]]) -> list[Any]:
    """Await every call at once; their results in call order, an exception
    (``Exception``, not cancellation) standing in for a call that raised."""
    results: list[Any] = [None] * len(calls)

    async def one(i: int, call) -> None:
        try:
            results[i] = await call()
        except Exception as exc:  # noqa: BLE001 - handed to the caller, not raised as a group
            results[i] = exc

    if len(calls) == 1:
        await one(0, calls[0])
        return results
    async with trio.open_nursery() as nursery:
        for i, call in enumerate(calls):
            nursery.start_soon(one, i, call)
    return results


def first_error(results: list[Any]) -> Exception | None:
    """The first exception among :func:`outcomes`' results, if any."""
    return next((r for r in results if isinstance(r, Exception)), None)


#: bytes of input above which CPU work (gzip, JSON) leaves the event loop
HEAVY = 256 << 10

#: at most this many such jobs at once: the rest wait (cores are few)
_cpu_limiter = trio.CapacityLimiter(2)


async def off_loop(fn: Callable[[], Any], nbytes: int) -> Any:
    """``fn()`` (pure CPU work on ``nbytes`` of input): in a worker thread
    when that is large, so the loop goes on answering the kernel while a
    shard is gzipped or hashed (zlib, zstd and crc32c release the GIL) or
    a document's rewrite runs (Python code: the interpreter switches
    threads every few ms); inline when small, where the thread hop would
    cost more than the work.  What holds the GIL throughout still stops
    the loop: ``json.loads`` of a document, about 10 ms per MiB (see
    SEMANTICS, Limits)."""
    if nbytes <= HEAVY:
        return fn()
    return await trio.to_thread.run_sync(fn, limiter=_cpu_limiter)
