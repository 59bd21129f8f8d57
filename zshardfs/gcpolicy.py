"""Keep the cyclic garbage collector's pauses short for a daemon that holds
many long-lived objects.

The inode table holds a few objects per path the kernel remembers (a
``find`` over 200k chunk files: about a million).  CPython's full (gen-2)
collection walks every tracked object, on whichever thread allocates, so
while the table grows, the event loop stops for a time that grows with it
(measured: about 50 ms at 25k paths, 0.5 s at 600k), and every request waits.

So, after each full collection, what survived it (the long-lived objects)
is moved to the permanent generation (``gc.freeze``): later collections walk
only what is newer.  Frozen objects are still freed by reference counting
(a forgotten inode goes at once); only a *cycle* among them that became
garbage after its freeze would stay.  To bound that, every REFRESH seconds
the frozen objects are handed back (``gc.unfreeze``), so that the next full
collection walks everything once and frees such cycles; then it freezes again.
"""

from __future__ import annotations

import gc
import time

#: seconds between full collections that walk every object
REFRESH = 600.0


class FreezeAfterFullCollections:
    """A ``gc.callbacks`` entry (see the module's docstring)."""

    def __init__(self, refresh: float = REFRESH):
        self.refresh = refresh
        self.unfrozen_at = time.monotonic()
        self.freezes = 0

    def __call__(self, phase: str, info: dict) -> None:
        if phase != "stop" or info.get("generation") != 2:
            return
        now = time.monotonic()
        if now - self.unfrozen_at > self.refresh:
            gc.unfreeze()  # (the next full collection walks everything once)
            self.unfrozen_at = now
        else:
            gc.freeze()
            self.freezes += 1


def install(refresh: float = REFRESH) -> FreezeAfterFullCollections:
    """Install the policy for this process (once); returns it."""
    for cb in gc.callbacks:
        if isinstance(cb, FreezeAfterFullCollections):
            return cb
    policy = FreezeAfterFullCollections(refresh)
    gc.callbacks.append(policy)
    return policy
