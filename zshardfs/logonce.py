"""Rate-limited log lines shared by every layer.

Damaged data is met on several paths (a lookup, a read, a listing); all of
them report it through :func:`log_once` with the same text, so a damaged
shard read or listed a thousand times is one log line, not a thousand.
"""

from __future__ import annotations

import logging
import time

_last_logged: dict[str, float] = {}


def log_once(logger: logging.Logger, level: int, msg: str, interval: float = 60.0, tag: str | None = None) -> None:
    """Log ``msg`` unless the same text (or the same ``tag``, if given) was
    logged (by any logger) less than ``interval`` seconds ago."""
    now = time.monotonic()
    tag = msg if tag is None else tag
    if now - _last_logged.get(tag, -1e9) > interval:
        if len(_last_logged) > 10000:  # forget what is old enough to be logged again anyway
            for old in [m for m, t in _last_logged.items() if now - t > interval]:
                del _last_logged[old]
            if len(_last_logged) > 10000:
                _last_logged.clear()
        _last_logged[tag] = now
        logger.log(level, msg)


def report_damage(logger: logging.Logger, exc: Exception) -> None:
    """The one line about damaged stored data (the file itself gives EIO):
    one per damaged object (a shard), whichever of its chunks is read, since
    a garbage index damages thousands of them, each read by its own path."""
    key = getattr(exc, "key", None)
    log_once(logger, logging.ERROR, f"damaged data: {exc}", tag=f"damaged data in {key}" if key else None)
