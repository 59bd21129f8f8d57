"""The view's data: nodes, open files and their buffers, the errors it raises,
its small caches, its limits, and the helpers every part of it uses.
"""

from __future__ import annotations

import errno
import json
import logging
import time
from collections import OrderedDict
from dataclasses import dataclass, field

import trio

from ..backends.base import StoreError
from ..layouts.base import ChunkTarget, Dataset
from ..logonce import log_once

log = logging.getLogger(__package__)  # "zshardfs.view" (as before the split): log lines name it


class DirectoryInTheWay(StoreError):
    """A file held in memory (written, or a scratch file in a dataset's
    root) whose store found a directory another client made at its key:
    EIO to the close, fsync or sync that stored it (rename: EISDIR); the
    file stays held, dirty, as after any failed store."""

    errno = errno.EIO


class ViewError(StoreError):
    """A request the view refuses, with the errno to report."""

    def __init__(self, err: int, message: str):
        super().__init__(message)
        self.errno = err


class Changed(StoreError):
    """The file's content is no longer the version its size was given for:
    serving it would hand the reader a mix, or the new bytes cut to the old
    size.  The opener re-reads the node; a reader that had it open gets EIO."""


@dataclass(eq=False, slots=True)
class Node:
    """One entry of the view.  ``path`` is its virtual path ('' = root)."""

    path: str
    is_dir: bool
    size: int = 0
    mtime_ns: int = 0  # (integer nanoseconds from storage to the kernel: a float loses up to ~240 ns)
    # where it comes from
    key: str | None = None  # a stored object or directory (passthrough)
    document: bytes | None = None  # rewritten metadata shown instead of the stored bytes
    dataset: Dataset | None = None  # owner of a virtual entry
    rel: tuple[str, ...] = ()  # path below the dataset root
    target: ChunkTarget | None = None  # for chunk files: where the chunk is stored
    version: str | None = None  # passthrough files: the etag their reads are pinned to
    link: str | None = None  # a symbolic link of the store: its target (the kernel resolves it)
    damage: str | None = None  # a chunk whose own index entry is damaged: why (ChunkEntry.damage)
    created: float = field(default_factory=time.monotonic)

    @property
    def name(self) -> str:
        return self.path.rsplit("/", 1)[-1]

    @property
    def is_chunk(self) -> bool:
        return self.target is not None


@dataclass(eq=False)
class FileBuffer:
    """A passthrough or scratch file held whole in memory while written."""

    path: str
    key: str | None  # where it is stored on close; None: scratch (memory only)
    data: bytearray
    dirty: bool = False
    handles: int = 0
    readers: int = 0  # read-only handles of a scratch file (see View.open)
    mtime_ns: int = field(default_factory=time.time_ns)
    in_store: bool = True  # False: created here and not stored yet (nothing to delete)
    # bumped by every change: a store clears ``dirty`` only if no write came
    # in while its PUT was in flight (else that write would be lost)
    version: int = 0
    storing: trio.Lock = field(default_factory=trio.Lock)  # one store at a time: PUTs land in order
    # a store of it was given up at the deadline: its PUT may still land
    # (an unlink must then delete the key, see AsyncStore._run)
    maybe_stored: bool = False
    # why its last store failed (None: it did not): such files wait in
    # memory for a later close, fsync or sync, and count against max_dirty
    error: StoreError | None = None
    # the stored file it is a copy of (a rename's source): its first store
    # onto a free key takes that file's mode and owner (local stores)
    like: str | None = None
    # a dataset's stored document a rename copied here: the form the view
    # showed it in, stored instead where the stored form is refused (a new
    # sharded array, none of its shards below: ``mv -T`` on S3 moves
    # ``zarr.json`` into a directory of its own); cleared by its first store
    view_form: bytes | None = None

    def changed(self) -> None:
        self.dirty = True
        self.version += 1
        self.mtime_ns = time.time_ns()


@dataclass(eq=False, slots=True)
class Handle:
    """An open file of the view (fuse_ops maps fh numbers to these)."""

    node: Node
    writable: bool = False
    buffer: FileBuffer | None = None  # passthrough / scratch writes
    chunk: object = None  # writeback.DirtyChunk for chunk writes
    # a stored chunk read in pieces: the version its first piece came from
    # (bytes, and View._chunk_version of it then), so the rest is never another's
    seen: tuple[bytes, tuple] | None = None
    # a stored chunk whose bytes the kernel's page cache holds for this open
    # (put there at an open, View.kernel_holds): (length, crc32c, and
    # View._chunk_version then).  A READ comes only for pages the kernel
    # dropped since; other bytes then would mix two versions in one open.
    kernel_has: tuple[int, int, tuple] | None = None
    # opened with O_APPEND: the kernel gives each write the end it holds of
    # the file (libfuse leaves O_APPEND to the file system when the kernel
    # does not cache writes), which may be from before another client's
    # change: see write
    append: bool = False


class _TTLCache:
    """Small LRU with expiry for probes and documents (bounded by count, and
    by the bytes of its ``bytes`` values if ``max_bytes`` is given)."""

    def __init__(self, max_items: int, ttl: float, max_bytes: int | None = None):
        self.max_items = max_items
        self.ttl = ttl
        self.max_bytes = max_bytes
        self.nbytes = 0  # of the bytes values kept
        self._d: OrderedDict = OrderedDict()

    @staticmethod
    def _size(item) -> int:
        return len(item[0]) if isinstance(item[0], (bytes, bytearray)) else 0

    def get(self, key):
        item = self._d.get(key)
        if item is None or time.monotonic() - item[1] > self.ttl:
            return None
        self._d.move_to_end(key)
        return item

    def put(self, key, value):
        self.pop(key)
        item = self._d[key] = (value, time.monotonic())
        self.nbytes += self._size(item)
        while len(self._d) > self.max_items or (
                self.max_bytes is not None and self.nbytes > self.max_bytes and len(self._d) > 1):
            self.nbytes -= self._size(self._d.popitem(last=False)[1])

    def pop(self, key):
        item = self._d.pop(key, None)
        if item is not None:
            self.nbytes -= self._size(item)

    def __len__(self) -> int:
        return len(self._d)

    def expired(self, key):
        """The value kept for ``key`` even if it expired (None if none)."""
        item = self._d.get(key)
        return None if item is None else item[0]


#: the largest file written through the view (or ``max_dirty``, if larger)
MAX_FILE = 1 << 30


#: bytes of rewritten metadata documents kept (View.documents)
DOCUMENTS_BYTES = 64 << 20


#: bytes of removed metadata documents kept to map a new one back (View.orphans)
REMOVED_DOCUMENTS_BYTES = 64 << 20


#: documents, and bytes of them, kept as the last stored at their keys (View.previous_documents)
PREVIOUS_DOCUMENTS = 1024


PREVIOUS_DOCUMENTS_BYTES = 16 << 20


#: what parsing a malformed metadata document can raise, beyond the layouts'
#: own checks (a list where an object belongs, a document nested 100000
#: deep, ...): the document is then shown as stored, with one warning
#: chunk nodes a listing keeps for the next listing of the same shard slice
#: (see View.listdir_batches); all are dropped once more are kept
LISTED_NODES = 1 << 14


METADATA_ERRORS = (TypeError, AttributeError, KeyError, IndexError, ValueError, RecursionError, OverflowError)


def _not_understood(where: str, exc: Exception) -> None:
    log_once(log, logging.WARNING, f"{where}: metadata not understood ({type(exc).__name__}: {exc}); "
                                   "shown as stored")


def _json_object(data: bytes) -> bool:
    """Is ``data`` a JSON object (what any metadata document is)?"""
    try:
        return isinstance(json.loads(data), dict)
    except (ValueError, UnicodeDecodeError, RecursionError):
        return False


def _could_be_chunk(name: str) -> bool:
    """A stored file name a Zarr chunk key could have (``c``, ``c.1.2``,
    ``1.2``): a tool's temporary metadata file next to a new array is not."""
    return name == "c" or name.startswith("c.") or all(p.isdigit() for p in name.split("."))


def _stays_in_view(dir_path: str, target: str) -> bool:
    """Does a symbolic link in the view directory ``dir_path`` holding
    ``target`` lead, as the client's kernel resolves it, only to names of
    this view?  So when it is relative, its ``..`` all come first and climb
    no higher than the mount's root, and no ``..`` follows a name (a name
    may be a link landing elsewhere, from where ``..`` would climb on).
    The kernel resolves every link shown by the same rule, so each step of
    a resolution stays inside: what the client does through the mount never
    leaves it, whoever planted the link (an ``allow_other`` mount's users
    write through links other users made)."""
    if not target or target.startswith("/"):
        return False
    parts = [p for p in target.split("/") if p not in ("", ".")]
    ups = 0
    while ups < len(parts) and parts[ups] == "..":
        ups += 1
    depth = len(dir_path.split("/")) if dir_path else 0
    return ups <= depth and ".." not in parts[ups:]


def _parent(path: str) -> str:
    return path.rpartition("/")[0]


def _prefix(path: str) -> str:
    """What a child's name is appended to (``join_key`` for a one-component
    name, without its per-part stripping: listings ask it per entry)."""
    return path + "/" if path else ""

