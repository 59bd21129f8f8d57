"""``zshardfs fsck``: walk a store's view, as a mount shows it, and report
what a mount would refuse or could not make sense of.

It reports and never repairs: it opens the store read-only.  It walks the
view itself (no FUSE), so it finds exactly what a mount finds, and says it
in the same words:
- every log line a mount writes, at WARNING or above, while its tree is
  listed: a shard index that fails its checksum or points past the shard's
  end, a ``zarr.json`` or ``info`` that cannot be parsed, parts shown as
  stored, ... (each damaged thing is one line, as in a mount's log);
- with ``--data``, every file read whole: a chunk whose bytes cannot be
  read (a truncated shard, a damaged gzip member, a size that does not
  match its index) is a problem too, named by its path in the view.

Without ``--data`` a shard costs its index (one ranged read), as listing it
through a mount does; with it, the data too (a scan, with read-ahead on S3).
Memory stays bounded by the caches' budgets: the walk is depth-first, and
directories are listed lazily.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import trio

from .backends.base import StoreError
from .view import Node, View

#: directories deeper than this are not entered (a real hierarchy, chunk
#: directories included, is a few dozen levels at most)
MAX_DEPTH = 256

#: bytes read at a time from a file that is not a chunk (a passthrough file
#: may be large; a chunk is read whole, as the shard layer caches it)
PIECE = 8 << 20

#: a file that is not a chunk is passed through as stored (nothing to decode):
#: past this many bytes only its last piece is read, so a sparse 1 TiB file
#: another client made does not take hours of zeros
PLAIN_SKIM = 64 << 20


@dataclass
class Report:
    directories: int = 0
    files: int = 0
    chunk_files: int = 0
    bytes_read: int = 0
    problems: list[str] = field(default_factory=list)
    #: how many problems are errors (damaged data, files that cannot be read
    #: or listed); the others are warnings: parts shown as stored (metadata
    #: not understood, or valid but not shown unsharded) or left unlisted
    errors: int = 0

    def as_dict(self) -> dict:
        return {"directories": self.directories, "files": self.files, "chunk_files": self.chunk_files,
                "bytes_read": self.bytes_read, "problems": list(self.problems), "errors": self.errors}

    def error(self, message: str) -> None:
        self.problems.append(message)
        self.errors += 1


class _Collect(logging.Handler):
    """The walk's log lines at WARNING and above, in order, once each (those
    at ERROR and above are errors)."""

    def __init__(self, report: Report):
        super().__init__(logging.WARNING)
        self.report = report
        self._seen: set[str] = set()

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if message not in self._seen:
            self._seen.add(message)
            if record.levelno >= logging.ERROR:
                self.report.error(message)
            else:
                self.report.problems.append(message)


async def check(view: View, *, data: bool = False) -> Report:
    """Walk the whole view of ``view``'s store; see the module's docstring."""
    report = Report()
    logger = logging.getLogger("zshardfs")
    collect = _Collect(report)
    propagate, level = logger.propagate, logger.level
    # the lines are the findings: reported once, by the caller, not also on stderr
    logger.addHandler(collect)
    logger.propagate = False
    if logger.getEffectiveLevel() > logging.WARNING:
        logger.setLevel(logging.WARNING)
    try:
        async with trio.open_nursery() as nursery:
            view.shards.start(nursery)  # read-ahead runs there (S3 scans)
            await _walk(view, view.root(), report, data)
            nursery.cancel_scope.cancel()
    finally:
        logger.removeHandler(collect)
        logger.propagate, logger.level = propagate, level
        view.store.close()
    return report


async def _walk(view: View, root: Node, report: Report, data: bool) -> None:
    """Depth-first, with a stack of its own (no recursion: a deep tree is not
    a Python stack overflow); directories deeper than MAX_DEPTH (a symlink
    loop in a local store, most likely) are reported, not entered."""
    stack = [(root, 0)]
    while stack:
        directory, depth = stack.pop()
        report.directories += 1
        subdirs = []
        try:
            async for child in view.listdir(directory):
                if child.is_dir:
                    subdirs.append(child)
                    continue
                report.files += 1  # (symbolic links too: shown, never followed)
                report.chunk_files += child.is_chunk
                if data and child.link is None:
                    await _read(view, child, report)
        except StoreError as exc:
            report.error(f"{directory.path or '/'}: cannot be listed: {exc}")
        if subdirs and depth == MAX_DEPTH:
            report.problems.append(f"{directory.path}: more than {MAX_DEPTH} levels deep (a symlink loop?); "
                                   "not checked below")
            continue
        stack.extend((sub, depth + 1) for sub in reversed(subdirs))  # in listing order


async def _read(view: View, node: Node, report: Report) -> None:
    """Read ``node`` whole, as a reader of the mounted file would."""
    got = skipped = 0
    try:
        if node.is_chunk:
            got = len(await view.read(node, 0, node.size + 1))
        else:
            while True:
                if got - skipped >= PLAIN_SKIM and node.size - got > PIECE:
                    skipped += node.size - PIECE - got
                    got = node.size - PIECE
                piece = await view.read(node, got, PIECE)
                got += len(piece)
                if len(piece) < PIECE:
                    break
    except StoreError as exc:
        report.error(f"{node.path}: cannot be read: {exc}")
        return
    finally:
        report.bytes_read += got - skipped
    if got != node.size:
        report.error(f"{node.path}: {got} bytes read, {node.size} listed")
