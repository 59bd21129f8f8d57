"""One load per key at a time: whoever asks while it runs shares it.

Three caches need this (shard indexes, precomputed minishard indexes, storage
listings): look in the cache; if the key is absent and a load of it is
running, wait for that load and look again (its result may not have been
kept: uncacheable, or dropped because the object changed meanwhile); else
load it yourself while marked as loading.
"""

from __future__ import annotations

import contextlib
import math
from typing import Any, Iterator

import trio


class SingleFlight:
    def __init__(self) -> None:
        self._running: dict[Any, trio.Event] = {}

    def __contains__(self, key) -> bool:
        """True while a load of ``key`` runs."""
        return key in self._running

    def __len__(self) -> int:
        """Loads running (for stats)."""
        return len(self._running)

    def keys(self) -> list:
        """The keys whose loads run now."""
        return list(self._running)

    async def wait(self, key, deadline: float = math.inf) -> bool | None:
        """Wait for the load of ``key`` that runs, if one does (then True);
        None: it still runs at ``deadline`` (``trio.current_time()``)."""
        event = self._running.get(key)
        if event is None:
            return False
        with trio.move_on_at(deadline):
            await event.wait()
            return True
        return None

    @contextlib.contextmanager
    def loading(self, key) -> Iterator[None]:
        """Mark ``key`` as loading for the duration of the block.  A caller
        that must not share (listings with ``list_ttl`` 0) may start a load
        while another of ``key`` runs: its mark replaces the other's, and
        each load removes only its own (the first to end would otherwise
        remove the later one's, and the later one's end fail); each wakes
        its own waiters."""
        event = self._running[key] = trio.Event()
        try:
            yield
        finally:
            if self._running.get(key) is event:
                del self._running[key]
            event.set()
