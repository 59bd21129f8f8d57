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
garbage after its freeze would stay.  To bound that, the frozen objects are
handed back (``gc.unfreeze``) every REFRESH seconds, and as soon as there
are GROWTH times as many as the last walk of everything found alive (and
more than FLOOR): the next full collection walks everything once and frees
such cycles; then it freezes again.  So what is kept for nothing stays below
a few times the live heap, a safety net: the daemon's requests leave no
such cycles behind (measured), and a growing table is walked whole once per
GROWTH-fold growth, not at every quarter of growth as by default.
"""

from __future__ import annotations

import gc
import time

#: seconds between full collections that walk every object
REFRESH = 600.0
#: how many times the objects alive at the last walk of everything the
#: frozen ones may become before they are walked again
GROWTH = 4
#: frozen objects below which growth alone never hands them back (a
#: million objects take about 0.1 s to walk)
FLOOR = 2_000_000


class FreezeAfterFullCollections:
    """A ``gc.callbacks`` entry (see the module's docstring)."""

    def __init__(self, refresh: float = REFRESH, floor: int = FLOOR):
        self.refresh = refresh
        self.floor = floor
        self.unfrozen_at = time.monotonic()
        self.walking = True  # the next full collection walks everything (nothing of ours frozen yet)
        self.alive = 0  # what the last walk of everything left alive (then frozen)
        self.freezes = 0

    def __call__(self, phase: str, info: dict) -> None:
        if phase != "stop" or info.get("generation") != 2:
            return
        if self.walking:  # (this one walked everything: what survived is alive)
            self.walking = False
            gc.freeze()
            self.alive = gc.get_freeze_count()
            self.freezes += 1
            return
        now = time.monotonic()
        if now - self.unfrozen_at > self.refresh or gc.get_freeze_count() > max(GROWTH * self.alive, self.floor):
            gc.unfreeze()  # (the next full collection walks everything once)
            self.unfrozen_at = now
            self.walking = True
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
