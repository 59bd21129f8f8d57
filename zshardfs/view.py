"""The virtual tree: path -> node, and what reading and writing them means.

The view walks the store as directories.  A stored directory is *plain*
unless a layout's ``probe`` says it is the root of a sharded dataset; then
names the dataset ``claims`` are answered by the dataset (virtual chunk files
and directories) and everything else passes through.  Stored metadata
documents are passed through each layout's ``rewrite_document``.

Writes (when mounted rw):
- a chunk file's bytes live in the write-back buffer of its shard until the
  shard is flushed (``writeback.py``); reads and listings see them at once;
- a passthrough file is buffered whole while open and stored on close;
- a *scratch* file — a new name inside a dataset that is not a valid chunk
  name, such as the temporary file a tool writes before renaming it onto a
  chunk — lives only in memory until it is renamed or unlinked, so it never
  lands in the store as a stray object.

Symbolic links (local stores): a name the view passes through that is a
link in the store is shown as that link (``Node.link``) if the client's
kernel, which resolves it, stays in the view doing so (``_stays_in_view``);
the daemon never follows it for the client (``rm -rf`` of a link to a
directory removes the link).  Links leading out are left out.  Names the
view derives (chunk files and directories made from shards, metadata
documents) are read through links that stay inside the store, as the
backend resolves every key, and links leading out are left out.

Nothing here knows about FUSE (inodes, handles, errno numbers): ``fuse_ops``
translates.  Nothing here knows a shard format: layouts do.
"""

from __future__ import annotations

import contextlib
import copy
import errno
import functools
import json
import logging
import time
from collections import OrderedDict
from dataclasses import dataclass, field, replace
from typing import AsyncIterator

import crc32c
import trio

from .backends.base import (AccessDenied, AsyncStore, CorruptData, DirectoryAtKey, NotFound, ObjectInfo,
                            PreconditionFailed, StoreError, TooLarge, Unavailable, held_by_deadline, join_key,
                            waited_within_deadline)
from .layouts import LAYOUTS, precomputed
from .layouts.base import ChunkEntry, ChunkTarget, Dataset, DirEntry, LayoutContext
from .shards import ShardCache
from .logonce import log_once
from .together import first_error, off_loop, outcomes
from .writeback import DirtyChunk, WriteBack, failures_logged_by_caller

log = logging.getLogger(__name__)


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


@dataclass(frozen=True)
class DirMove:
    """A directory rename prepared (View.prepare_dir_rename)."""

    old_path: str
    new_path: str
    old_key: str
    new_key: str
    noreplace: bool  # the new name was free (a file made at it in memory meanwhile: refused)
    asked: bool = False  # the caller asked RENAME_NOREPLACE: a name taken meanwhile is EEXIST


def _ancestors(key: str) -> list[str]:
    """The directories above ``key``, its parent first, the root ('') last."""
    out = []
    while key:
        key = key.rpartition("/")[0]
        out.append(key)
    return out


def _in_draft_store(key: str) -> bool:
    """Is ``key`` (a directory) at or below a v3-draft store's ``meta/root``
    or ``data/root``?"""
    k = "/" + key + "/"
    return "/meta/root/" in k or "/data/root/" in k


def _parent(path: str) -> str:
    return path.rpartition("/")[0]


def _prefix(path: str) -> str:
    """What a child's name is appended to (``join_key`` for a one-component
    name, without its per-part stripping: listings ask it per entry)."""
    return path + "/" if path else ""


class View:
    def __init__(self, store: AsyncStore, shards: ShardCache, writeback: WriteBack | None = None, *,
                 metadata_ttl: float = 1.0, read_only: bool = True, shard_option=None):
        self.store = store
        self.shards = shards
        self.writeback = writeback or WriteBack(store, shards)
        self.read_only = read_only
        self.shard_option = shard_option  # -o shard=K: store new arrays sharded
        self.ctx = LayoutContext(store, shards, read_only)
        self.datasets = _TTLCache(4096, metadata_ttl)
        # keyed by (key, etag): never stale; bounded by bytes too, since a
        # rewritten document may be megabytes (consolidated metadata)
        self.documents = _TTLCache(4096, 3600.0, max_bytes=DOCUMENTS_BYTES)
        self.started_ns = time.time_ns()
        # names that exist in the view but not (yet) in storage
        self.buffers: dict[str, FileBuffer] = {}  # path -> open/scratch file
        self._scratch_swept_at = time.time()
        self.new_chunks: dict[str, dict[str, tuple[Dataset, tuple, ChunkTarget]]] = {}  # dir -> name -> chunk
        self._new_chunks_pruned_at = 0
        self._new_chunks_count = 0  # names in new_chunks (not summed per release: it runs per chunk written)
        # the directories of new_chunks and those leading to them, by parent:
        # a listing looks only at its own subdirectories (a scan of every
        # directory of new_chunks per listing made ``find`` quadratic)
        self._new_chunk_dirs: dict[str, set[str]] = {}
        self.new_dirs: dict[str, set[str]] = {}  # dir -> names of directories made here
        # ...the paths of those storage holds too (a local directory made,
        # an S3 one a file was stored below), least recently made first:
        # past NEW_DIRS_MAX the oldest are forgotten (storage answers for
        # them).  Held, not forgotten at once: a lookup answered from memory
        # is quicker than a stat in a worker thread, and without them readers
        # of a file replaced by rename over and over met ESTALE ten times as
        # often (the kernel's lookups again after one, slower, let the next
        # rename land inside them)
        self._new_dirs_stored: OrderedDict[str, None] = OrderedDict()
        # when each directory made here was made (its mtime while only this
        # mount knows it: the same at every lookup; the last NEW_DIRS_MAX)
        self._made_at: OrderedDict[str, int] = OrderedDict()
        # (S3) directories whose last file or subdirectory this mount just
        # removed: path -> when.  Storage has nothing left to show them by;
        # they stay for the rmdir that follows (rm -r), briefly
        # (EMPTIED_KEEP, or metadata_ttl if longer), then storage decides
        self.emptied: OrderedDict[str, float] = OrderedDict()
        self._emptied_keep = max(self.EMPTIED_KEEP, metadata_ttl)
        # path -> handles open for writing there: a rename moves them along
        self.writers: dict[str, set[Handle]] = {}
        # Datasets whose metadata this mount created, and the chunk
        # directories it wrote chunks into.  A chunk directory of any other
        # dataset exists as soon as it is inside the grid (cheap: no index is
        # read to prove it); in a dataset made here it exists only once made
        # or written to, as in a directory store, because a tool copying an
        # array in (``cp -r``) makes each directory after writing others and
        # expects no EEXIST (which the kernel answers itself for a name that a
        # lookup found).  All of its content came through this mount.
        # (root -> when it was last written or made into: one quiet for
        # BORN_HERE_QUIET with nothing left to store is forgotten, with its
        # directories, so this memory is bounded by what is being written)
        self.born_here: dict[str, float] = {}
        self.written_dirs: set[str] = set()
        # ...and those it removed there since: gone, though storage may list
        # them until the deletions below are flushed
        self.removed_dirs: set[str] = set()
        # key -> etag of the version this mount stored last: a reader pinned
        # to an older version reads on in this one (the mount's own writes
        # are visible at once, 2.5), not EIO as for another client's
        # key -> (etag, when stored, size)
        self.own_versions: OrderedDict[str, tuple[str, float, int]] = OrderedDict()
        # files being renamed, by path: writes through their open handles
        # wait until the handles have moved to the new name (see rename)
        self._renaming: dict[str, trio.Event] = {}
        # path -> opens for writing and creates under way there (they await
        # before the handle exists, and then store under the key they
        # resolved): a directory above one is not renamed meanwhile (see
        # _quiet_below)
        self._opening: dict[str, int] = {}
        self._linking = trio.Lock()  # (see link)
        self._held_tried_at = float("-inf")  # (see _room_for_files)
        self.readers: dict[str, set[Handle]] = {}  # path -> read-only handles of chunk files
        self.document_writes = 0  # metadata documents this mount stored or removed
        # (shard key, chunk id) -> writes and unlinks of that chunk through
        # this mount (visible at once, 2.5: they end a reader's pin); bounded,
        # with an epoch so that forgetting them all never looks like no change
        self._chunk_changes: dict[tuple[str, int], int] = {}
        self._chunk_epoch = 0
        # ...and when it last did: nodes made before then may name a dataset
        # that is no more (the kernel holds them), so they are looked up again
        # (:meth:`_fresh`), once per path and change
        self._documents_changed_at = float("-inf")
        self._fresh_nodes: dict[str, Node] = {}
        # id(a layout's listed slice) -> (that slice, its directory, dataset,
        # nodes): listing an unchanged directory again (a warm walk after
        # metadata_ttl) makes no node again (bounded: LISTED_NODES)
        self._listed_slices: dict[int, tuple[list, str, Dataset, list[Node]]] = {}
        self._listed_count = 0
        # Datasets whose metadata document this mount removed (unlink, or a
        # rename away): dir key -> (dataset, the document's key), and that
        # document's stored bytes by key.  As on a directory store, the chunk
        # files stay (listable, readable, removable), and a document stored
        # there again while chunks remain is mapped back onto the removed
        # one, as a rewrite would be.  Without this, ``rm -r`` (which may
        # remove zarr.json first) and an editor's save (rename the old file
        # away, write a new one) would meet raw shards.  Bounded: 1024
        # datasets, REMOVED_DOCUMENTS_BYTES of documents.
        self.orphans: OrderedDict[str, tuple[Dataset, str]] = OrderedDict()
        self.removed_documents: OrderedDict[str, bytes] = OrderedDict()
        # The last document (a JSON object) stored at a key that this mount
        # removed (rm, an editor's save renaming it away) or emptied (a
        # truncate before the text), by key: a document written there while
        # none is stored is judged against it too (a group's consolidated
        # entries of members renamed away map back onto their stored form,
        # SEMANTICS 4.18).  Forgotten once a document is stored there again.
        # Bounded: PREVIOUS_DOCUMENTS documents, PREVIOUS_DOCUMENTS_BYTES.
        self.previous_documents: OrderedDict[str, bytes] = OrderedDict()
        self._previous_bytes = 0
        self._previous_in: dict[str, set[str]] = {}  # dir key -> its keys in previous_documents
        # chunks this mount removed by itself, not by a request naming them
        # (_prune_outside), by the task whose work removed them (the pyfuse3
        # worker serving the request): task -> dataset root -> {(shard key,
        # chunk id)}.  The kernel may hold their entries (a reader looked
        # them up): Operations makes it forget them after that request,
        # looking below the roots (see Operations._forget_removed_here).
        # Each request forgets its own only: another's entries may lie in a
        # directory whose lock the kernel holds for that other request, still
        # at work (its invalidation waited 2 s for it)
        self.removed_here: dict[trio.lowlevel.Task, dict[str, set[tuple[str, int]]]] = {}
        # (dataset root, version) of the datasets whose document this mount
        # removed and whose last chunk went before a new document took its
        # place (_removed_document), by task likewise: the entries the kernel
        # holds of their chunk files and directories are forgotten likewise
        self.datasets_gone: dict[trio.lowlevel.Task, set[tuple[str, tuple]]] = {}
        # (S3) info key -> (etag, the directories it names): see _info_dirs
        self._info_dirs_kept: OrderedDict[str, tuple[str, frozenset[str]]] = OrderedDict()

    def table_sizes(self) -> dict[str, int]:
        """Entries of this layer's tables (see Operations.table_sizes)."""
        return {"datasets": len(self.datasets), "documents": len(self.documents),
                "buffers": len(self.buffers), "new_chunks": self._new_chunks_count,
                "new_chunk_dirs": len(self._new_chunk_dirs), "new_dirs": sum(map(len, self.new_dirs.values())),
                "emptied": len(self.emptied), "writers": len(self.writers), "readers": len(self.readers),
                "born_here": len(self.born_here), "written_dirs": len(self.written_dirs),
                "removed_dirs": len(self.removed_dirs), "own_versions": len(self.own_versions),
                "renaming": len(self._renaming), "opening": len(self._opening),
                "chunk_changes": len(self._chunk_changes),
                "fresh_nodes": len(self._fresh_nodes), "listed_nodes": self._listed_count,
                "orphans": len(self.orphans),
                "removed_documents": len(self.removed_documents),
                "previous_documents": len(self.previous_documents),
                "probed": len(self.ctx.probed) + len(self.ctx.probed_small),
                "info_dirs": len(self._info_dirs_kept)}

    # -- datasets -----------------------------------------------------------

    async def dataset_at(self, dir_key: str) -> Dataset | None:
        """The sharded dataset rooted at a stored directory, if any (cached)."""
        cached = self.datasets.get(dir_key)
        if cached is not None:
            return cached[0]
        previous = self.datasets.expired(dir_key)
        # A probe that was out while this mount stored or removed a document
        # may answer from before that change: not cached, asked again.
        for _ in range(3):
            writes = self.document_writes
            dataset = await self._probe(dir_key)
            if self.document_writes == writes:
                break
        else:
            return dataset or self._orphan_at(dir_key)
        if dataset is None:
            dataset = self._orphan_at(dir_key)
        else:
            self._forget_orphan(dir_key)  # a document is there again (another client's)
        if (dataset is not None and previous is not None and type(previous) is type(dataset)
                and dataset.version and previous.version == dataset.version):
            dataset = previous  # made of the same documents: keep what it has learnt
        self.datasets.put(dir_key, dataset)
        return dataset

    def _document_changed(self, key: str) -> None:
        """This mount stored or removed metadata document ``key``: every
        dataset made of it is out of date, wherever it is cached (a
        storage-transformer array's document is not in its directory, a
        precomputed scale's is its parent's), and so may be any "no dataset
        here" answer (cheap to ask again; documents change seldom)."""
        self.document_writes += 1
        self._documents_changed_at = time.monotonic()
        self._fresh_nodes.clear()
        self._listed_slices.clear()
        self._listed_count = 0
        for dir_key, (dataset, _) in list(self.datasets._d.items()):
            if dataset is None or any(k == key for k, _ in dataset.version):
                self.datasets.pop(dir_key)

    async def _fresh(self, node: Node) -> Node:
        """``node`` as the view resolves it now, if the mount changed a
        metadata document since it was made (its dataset, or its being
        none, may be out of date): the mount's own writes show at once."""
        if node.created >= self._documents_changed_at:
            return node
        fresh = self._fresh_nodes.get(node.path)
        if fresh is None:
            writes = self.document_writes
            fresh = await self.resolve(node.path) if node.path else self.root()
            if fresh is None and self._in_dataset(node):
                # a chunk name (directory, file) the dataset no longer has, its
                # shape shrunk: the kernel may still hold its entry, whose old
                # grid would take chunks the new one hides (stored, never shown)
                raise ViewError(errno.ENOENT, f"{node.path}: outside the chunk grid now")
            if fresh is None and node.is_dir and self.store.keeps_empty_dirs:
                # a directory renamed or removed since (a listing's entry
                # handed to the kernel after its rename): a file or directory
                # made in it would make the old directory again in storage.
                # (On S3 a directory is there while a key is below it: one
                # emptied is made again by a file stored in it, as before)
                raise ViewError(errno.ENOENT, f"{node.path}: no longer exists")
            if fresh is None and "/" in node.path and self.store.keeps_empty_dirs \
                    and await self.resolve(_parent(node.path)) is None:
                # a file whose directory was renamed or removed since: opened
                # for writing, its flush would make the old directory again
                raise ViewError(errno.ENOENT, f"{node.path}: its directory no longer exists")
            if fresh is None:
                return node
            if self.document_writes == writes:  # (else resolved partly before another change)
                if len(self._fresh_nodes) > 4096:
                    self._fresh_nodes.clear()
                self._fresh_nodes[node.path] = fresh
        return fresh

    async def _probe(self, dir_key: str) -> Dataset | None:
        """Every layout asks at once: a directory that is no dataset costs one
        round trip, not one per layout.  The answer is the one asking in
        LAYOUTS order would give: the first dataset found, unless an earlier
        layout's probe failed (that error is raised)."""
        dataset = None
        for answer in await outcomes(*(functools.partial(layout.probe, self.ctx, dir_key) for layout in LAYOUTS)):
            if isinstance(answer, TooLarge):
                log_once(log, logging.WARNING, str(answer))
            elif isinstance(answer, (CorruptData, NotFound, AccessDenied)):
                log.warning("%s: %s", dir_key or "/", answer)
            elif isinstance(answer, METADATA_ERRORS):
                _not_understood(dir_key or "/", answer)
            elif isinstance(answer, Exception):
                raise answer
            elif answer is not None:
                dataset = answer
                break
        return dataset

    # -- nodes --------------------------------------------------------------

    def root(self) -> Node:
        return Node("", True, mtime_ns=self.started_ns, key="")

    async def _document(self, info: ObjectInfo) -> bytes | None:
        """Rewritten bytes of a stored metadata document, or None if shown as is."""
        if not self._is_dataset_document(info.key):
            return None
        cached = self.documents.get((info.key, info.etag))
        if cached is not None:
            return cached[0]
        if info.size > self.store.DOCUMENT_LIMIT:
            log_once(log, logging.WARNING, str(self.store.too_large(info.key, info.size)))
            return None
        try:
            blob = await self.store.get_document(info.key, info.etag)
        except TooLarge as exc:  # grew since it was listed
            log_once(log, logging.WARNING, str(exc))
            return None
        new = None
        for layout in LAYOUTS:
            if layout.is_document(info.key):
                try:  # (a consolidated document can be megabytes of JSON: not on the loop)
                    new = await off_loop(functools.partial(layout.rewrite_document, info.key, blob.data),
                                         len(blob.data))
                except METADATA_ERRORS as exc:
                    _not_understood(_parent(info.key) or "/", exc)  # the probe's words: one line
                    new = None
                if new is not None:
                    break
        # cached under the etag actually read, so a racing replace is not masked
        self.documents.put((info.key, blob.info.etag), new)
        if blob.info.etag != info.etag:
            return await self._document(blob.info)
        return new

    @staticmethod
    async def _shown_form(key: str, data: bytes) -> bytes | None:
        """The bytes the view shows for the document ``data`` stored at
        ``key`` (None: shown as stored)."""
        for layout in LAYOUTS:
            if layout.is_document(key):
                try:
                    new = await off_loop(functools.partial(layout.rewrite_document, key, data), len(data))
                except METADATA_ERRORS:
                    new = None
                if new is not None:
                    return new
        return None

    async def _stored_file(self, path: str, info: ObjectInfo) -> Node:
        try:
            doc = await self._document(info)
        except AccessDenied:  # listed as stored; reading it gives EACCES
            doc = None
        size = len(doc) if doc is not None else info.size
        return Node(path, False, size, info.mtime_ns, key=info.key, document=doc, version=info.etag)

    @staticmethod
    def _link_node(path: str, info: ObjectInfo) -> Node | None:
        """The node of a symbolic link at ``path``, or None (left out, one
        warning) if it would lead the client out of the view."""
        if not _stays_in_view(_parent(path), info.link):
            log_once(log, logging.WARNING, f"{info.key}: a symbolic link (-> {info.link!r}) that leads out of the "
                                           "mount; left out (-o follow_symlinks follows it, for a source no one "
                                           "else can write into)", tag=f"link out: {info.key}", interval=3600)
            return None
        return Node(path, False, info.size, info.mtime_ns, key=info.key, link=info.link)

    def _derived(self, dataset: Dataset | None, name: str, key: str) -> bool:
        """Is ``name`` (stored at ``key``) in a pass-through directory one the
        view derives rather than shows as stored (a dataset's claimed name,
        a metadata document)?  A link there is followed inside the store."""
        return (dataset is not None and dataset.claims((name,))) or self._is_dataset_document(key)

    def _buffer_node(self, buf: FileBuffer) -> Node:
        return Node(buf.path, False, len(buf.data), buf.mtime_ns, key=buf.key)

    def _chunk_node(self, path: str, dataset: Dataset, rel: tuple, entry: ChunkEntry | None,
                    target: ChunkTarget | None) -> Node | None:
        """A chunk file, with unflushed writes taking precedence over storage."""
        if target is None and entry is not None:
            # capacity is only needed for writes; open() asks the dataset then
            target = entry.target
        if target is not None and self.writeback.dirty:
            dirty = self.writeback.pending(target.shard_key, target.chunk_id)
            if dirty is not None:
                if dirty.data is None:
                    return None
                return Node(path, False, len(dirty.data), dirty.mtime_ns, dataset=dataset, rel=rel, target=target)
        if entry is None:
            return None
        return Node(path, False, entry.size, entry.mtime_ns, dataset=dataset, rel=rel, target=target,
                    damage=entry.damage)

    async def _listed_child(self, path: str, dataset: Dataset, rel: tuple[str, ...], entry, mark: int) -> Node | None:
        """A listed entry's node.  A chunk whose shard this mount stored after
        the listing began (``mark``) is looked up again: the listing may have
        read the version before, and that store retired the pending change
        (an unlink, a rename away, a new size) that would have corrected it.
        (Inlined in :meth:`listdir`'s loop over a dataset's directory.)"""
        if isinstance(entry, ChunkEntry) and self.writeback.stored_since(entry.shard_key, mark):
            return await self._dataset_child(path, dataset, rel)
        node = self._virtual(path, dataset, rel, entry)
        if self.removed_dirs and node is not None and node.is_dir and await self._removed_and_empty(node):
            return None  # (as lookup answers)
        return node

    def _virtual(self, path: str, dataset: Dataset, rel: tuple[str, ...], entry) -> Node | None:
        if isinstance(entry, DirEntry):
            return Node(path, True, 0, entry.mtime_ns or self._made_at.get(path, self.started_ns), dataset=dataset, rel=rel)
        return self._chunk_node(path, dataset, rel, entry, None)

    async def _dataset_child(self, path: str, dataset: Dataset, rel: tuple) -> Node | None:
        # read-only: nothing is ever dirty, and the target (with its capacity
        # and writability, which only writes need) comes from the entry
        target = None if self.read_only else dataset.target(rel)
        if target is not None and self.writeback.pending(target.shard_key, target.chunk_id) is not None:
            return self._chunk_node(path, dataset, rel, None, target)
        entry = await dataset.lookup(rel)
        if entry is None:
            if target is not None and self._empty_with_pending(dataset, rel):
                return Node(path, False, 0, time.time_ns(), dataset=dataset, rel=rel, target=target)
            return None
        if isinstance(entry, DirEntry):
            if (dataset.root in self.born_here and path not in self.written_dirs
                    and (path in self.removed_dirs or not await self._listed(dataset, rel))):
                return None  # (made here: as in a directory store, not there until made or stored)
            node = Node(path, True, 0, entry.mtime_ns or self._made_at.get(path, self.started_ns), dataset=dataset,
                        rel=rel)
            if self.removed_dirs and await self._removed_and_empty(node):
                return None
            return node
        return self._chunk_node(path, dataset, rel, entry, target)

    async def _removed_and_empty(self, node: Node) -> bool:
        """Is ``node``, a chunk directory of a dataset not made here, one
        this mount removed (rmdir) and still empty?  Then it is gone, as in
        a directory store, to lookups and listings alike, until made again
        (mkdir) or something is stored below it (another client's chunks:
        then found again, and forgotten as removed).  Else a chunk directory
        found leniently (Limits) was found again right after its rmdir:
        ``mv -T``'s rmdir-then-mkdir of one was EEXIST (the kernel's LOOKUP
        before the mkdir found it), and the move stopped half done."""
        if node.path not in self.removed_dirs or node.dataset.root in self.born_here:
            return False
        if await self._empty(node):
            return True
        self.removed_dirs.discard(node.path)
        return False

    @staticmethod
    async def _listed(dataset: Dataset, rel: tuple) -> bool:
        """Does the listing of ``rel``'s parent show it (something stored
        below it: chunks another client wrote into an array made here)?"""
        async for name, _ in dataset.listdir(rel[:-1]):
            if name == rel[-1]:
                return True
        return False

    def _in_dataset(self, parent: Node) -> bool:
        return parent.dataset is not None and parent.key is None

    async def lookup(self, parent: Node, name: str) -> Node | None:
        """The child ``name`` of directory ``parent``, or None."""
        if parent.created < self._documents_changed_at:  # (else _fresh answers it as it is: no coroutine)
            parent = await self._fresh(parent)
        path = _prefix(parent.path) + name if name and "/" not in name else join_key(parent.path, name)
        buf = self.buffers.get(path)
        if buf is not None:
            return self._buffer_node(buf)
        made = name in self.new_dirs.get(parent.path, ()) or self._still_emptied(path)
        if made and path in self._new_dirs_stored:
            self._new_dirs_stored.move_to_end(path)  # (used: the last to be forgotten)
        if made and self._in_dataset(parent):
            return Node(path, True, 0, self._made_at.get(path, self.started_ns), dataset=parent.dataset,
                        rel=parent.rel + (name,))
        if self._in_dataset(parent):
            return await self._dataset_child(path, parent.dataset, parent.rel + (name,))
        dataset = await self.dataset_at(parent.key)
        if dataset is not None and dataset.claims((name,)):
            if made:  # the chunk directory of an array, made before it held anything
                return Node(path, True, 0, self._made_at.get(path, self.started_ns), dataset=dataset, rel=(name,))
            return await self._dataset_child(path, dataset, (name,))
        if made:
            return Node(path, True, 0, self._made_at.get(path, self.started_ns), key=join_key(parent.key, name))
        key = join_key(parent.key, name)
        info = await self.store.stat(key, listed_ok=True, links=not self._is_dataset_document(key))
        if info is not None and info.link is not None:
            return self._link_node(path, info)
        if info is not None and not (info.size == 0 and await self.store.is_dir(key)):
            return await self._stored_file(path, info)
        if info is not None or await self.store.is_dir(key) or await self._named_by_info(parent.key, name):
            # (an empty object named like a directory, as some S3 tools leave: the directory wins)
            return Node(path, True, 0, self._made_at.get(path, self.started_ns), key=key)
        if self._buffered_below(path):
            # (S3) a file below it is only in memory (its store failed, or is
            # still to come) and storage holds nothing there any more: the
            # directory's last stored file was removed (4.6: never hidden)
            return Node(path, True, 0, self._made_at.get(path, self.started_ns), key=key)
        return None

    def _buffered_below(self, path: str) -> bool:
        """Does a file below directory ``path`` have a write buffer (a file
        made or written here, held in memory until stored)?"""
        prefix = path + "/"
        return any(p.startswith(prefix) for p in self.buffers)

    async def _named_by_listed_info(self, dir_key: str, listing) -> list[str]:
        """(S3) The directories of _named_by_info that the listing of
        ``dir_key`` lacks (gone with their last shard), by name."""
        if self.store.keeps_empty_dirs:
            return []
        own = any(f.key.rsplit("/", 1)[-1] == "info" for f in listing.files)
        if not own and not dir_key:
            return []
        listed, prefix = set(listing.dirs), _prefix(dir_key)
        names = {d[len(prefix):] for d in await self._dirs_named_near(dir_key, own) if d.startswith(prefix)}
        return sorted(n for n in names if n and "/" not in n and n not in listed)  # ("": its own)

    async def _named_by_info(self, dir_key: str, name: str) -> bool:
        """(S3) Is ``name`` a sharded scale (or annotation index) directory
        that a precomputed ``info`` names, or one on the way to it (a scale
        ``key`` of several names: "s/8_8_8" names ``s`` too)?  It holds only
        shards: with the last one deleted, S3 has nothing left to show it by,
        yet the document still names it, and a chunk written there (``cp``,
        an open for create) needs it, as a local store, which keeps the
        directory, has it.  The documents are those in ``dir_key`` and in
        every directory above it, which the probe of ``dir_key`` has just
        asked for: within ``metadata_ttl`` they cost no request."""
        if self.store.keeps_empty_dirs:
            return False
        return join_key(dir_key, name) in await self._dirs_named_near(dir_key)

    async def _dirs_named_near(self, dir_key: str, own: bool = True) -> set[str]:
        """The directories _info_dirs finds in the ``info`` of ``dir_key``
        (unless not ``own``: the listing shows none) and of every directory
        above it (a scale ``key`` may have any number of names), with every
        directory on the way to each; the documents asked for at once."""
        found: set[str] = set()
        names = dir_key.split("/") if dir_key else []
        holders = ([dir_key] if own else []) + ["/".join(names[:k]) for k in range(len(names) - 1, -1, -1)]

        near = {dir_key, dir_key.rpartition("/")[0]}

        async def dirs(holder: str) -> frozenset[str]:
            key = join_key(holder, "info")
            try:
                blob = await self.store.get_document(key)
            except (NotFound, TooLarge):
                return frozenset()
            except AccessDenied:
                if holder in near:
                    raise
                return frozenset()  # (as the probe takes it: said where it is probed)
            return await self._info_dirs(key, blob)

        answers = await outcomes(*(functools.partial(dirs, holder) for holder in holders))
        error = first_error(answers)
        if error is not None:
            raise error
        for named in answers:
            for d in named:
                while d and d not in found:
                    found.add(d)
                    d = d.rpartition("/")[0]
        return found

    #: parsed ``info`` documents kept by _info_dirs (the least recently used go first)
    INFO_DIRS_KEPT = 256

    async def _info_dirs(self, key: str, blob) -> frozenset[str]:
        """``precomputed.dataset_dirs`` of the ``info`` at ``key`` read as
        ``blob``, parsed once per version (etag): every failed lookup in an
        S3 volume directory asks, and parsing costs about 10 ms per MiB of
        info (off the loop when large, as a document's rewrite)."""
        version = blob.info.etag
        kept = self._info_dirs_kept.get(key)
        if kept is not None and version is not None and kept[0] == version:
            self._info_dirs_kept.move_to_end(key)
            return kept[1]
        dirs = frozenset(await off_loop(functools.partial(precomputed.dataset_dirs, key, blob.data),
                                        len(blob.data)))
        if version is not None:
            self._info_dirs_kept[key] = (version, dirs)
            self._info_dirs_kept.move_to_end(key)
            while len(self._info_dirs_kept) > self.INFO_DIRS_KEPT:
                self._info_dirs_kept.popitem(last=False)
        return dirs

    async def refresh(self, node: Node) -> Node | None:
        """The node as it is now (None: it is gone), for getattr after a TTL."""
        buf = self.buffers.get(node.path)
        if buf is not None:
            return self._buffer_node(buf)
        if node.is_chunk:
            try:  # (a dataset renamed or changed since the node was made: looked up by its path)
                node = await self._fresh(node)
            except ViewError:
                return None
            if not node.is_chunk:
                return await self.refresh(node)
            return await self._dataset_child(node.path, node.dataset, node.rel)
        if node.link is not None:
            link = await self.store.stat(node.key, links=True)
            return self._link_node(node.path, link) if link is not None and link.link is not None else None
        if node.key is not None and not node.is_dir:
            info = await self.store.stat(node.key)
            return await self._stored_file(node.path, info) if info is not None else None
        if node.key is None and not node.is_dir:
            return None  # a scratch file gone (unlinked, or dropped): only memory held it
        return node

    def _empty_with_pending(self, dataset: Dataset, rel: tuple) -> bool:
        """Is ``rel`` a file stored with another (a mesh's fragment data, with
        its manifest) that storage does not hold, while that other is written
        and not stored yet?  It is then empty, not absent: a new mesh's empty
        fragment data, flushed before its manifest, stores nothing."""
        other = dataset.removed_with(rel)
        t = dataset.target(other) if other is not None else None
        pending = self.writeback.pending(t.shard_key, t.chunk_id) if t is not None else None
        return pending is not None and pending.data is not None

    @staticmethod
    def goes_with_another(node: Node) -> bool:
        """Can an unlink of another file remove ``node`` (a mesh's fragment
        data, with its manifest)?  The kernel must then not keep its entry:
        no I/O."""
        return node.is_chunk and node.dataset is not None and node.dataset.removed_with(node.rel) is not None

    def newest_own(self, node: Node) -> Node:
        """``node``, or its key's version this mount wrote since ``node`` was
        learnt: what a plain file's open descriptors read (2.5, :meth:`read`),
        whose size they must be given with it.  No I/O."""
        own = self.own_versions.get(node.key) if node.key is not None else None
        if own is not None and own[0] != node.version and node.created < own[1]:
            return replace(node, version=own[0], size=own[2])
        return node

    def replaced_by_another(self, old: Node, new: Node) -> bool:
        """Is ``new`` (found at ``old``'s path) another stored file than
        ``old``, made by another client: a plain file of the store whose
        version is neither ``old``'s nor one this mount wrote (its reads,
        pinned to ``old``'s version, then answer "replaced by another
        client").  No I/O."""
        if (old.is_dir or new.is_dir or old.target is not None or new.target is not None
                or old.link is not None or new.link is not None or old.key is None or new.key != old.key
                or old.version is None or new.version is None or new.version == old.version
                or self.buffers.get(old.path) is not None):
            return False
        own = self.own_versions.get(new.key)
        return own is None or own[0] != new.version

    def in_memory(self, node: Node) -> Node | None:
        """The node as it is now if its content lives in memory (a write
        buffer, a scratch file, an unflushed chunk); None otherwise.  No I/O."""
        buf = self.buffers.get(node.path)
        if buf is not None:
            return self._buffer_node(buf)
        if node.is_chunk and self.writeback.pending(node.target.shard_key, node.target.chunk_id) is not None:
            return self._chunk_node(node.path, node.dataset, node.rel, None, node.target)
        return None

    async def resolve(self, path: str) -> Node | None:
        """Walk from the root (for tools and tests, not for the kernel)."""
        node = self.root()
        for name in filter(None, path.split("/")):
            if not node.is_dir:
                return None
            node = await self.lookup(node, name)
            if node is None:
                return None
        return node

    async def statfs(self):
        """Capacity of the storage (``os.statvfs_result``), or None if unknown."""
        return await self.store.statfs()

    async def listdir(self, node: Node) -> AsyncIterator[Node]:
        """Children of a directory, in a stable order, lazily."""
        async for batch in self.listdir_batches(node):
            for child in batch:
                yield child

    async def listdir_batches(self, node: Node) -> AsyncIterator[list[Node]]:
        """:meth:`listdir` in lists (a shard's chunks, a storage listing's
        entries): READDIR takes an async step per list, not per entry (two
        nested generator steps per entry were a good part of a warm
        listing's cost)."""
        node = await self._fresh(node)
        extra = self._pending_children(node.path)
        seen: set[str] | None = set() if extra else None
        mark = self.writeback.store_seq
        buffers = self.buffers
        # names left out of a batch for having a write buffer then: shown from
        # it at the end, with ``extra`` (those that had one when we began; a
        # file opened for writing while storage was listed is in neither)
        held: set[str] = set()

        def unbuffered(children: list[Node]) -> list[Node]:
            out = []
            for child in children:
                if child.path in buffers:
                    held.add(child.name)
                else:
                    out.append(child)
            return out

        if self._in_dataset(node):
            prefix, dataset, rel = _prefix(node.path), node.dataset, node.rel
            stored_since = self.writeback.stored_since
            virtual = self._virtual
            async for batch in dataset.listdir_batches(rel):
                kept = self._listed_slices.get(id(batch))
                if (kept is not None and kept[0] is batch and kept[1] == prefix and kept[2] is dataset
                        and not self.writeback.dirty and not stored_since(batch[0][1].shard_key, mark)):
                    # the very slice listed before (the same index version),
                    # nothing of this mount's pending: the same nodes, as
                    # current now as nodes made anew (else the next getattr
                    # past attr_timeout since the first listing would
                    # re-validate each, which a node made now would not)
                    now = time.monotonic()
                    for c in kept[3]:
                        c.created = now
                    out = unbuffered(kept[3]) if buffers else kept[3]
                    if out:
                        if seen is not None:
                            seen.update(child.name for child in out)
                        yield out
                    continue
                out = []
                for name, entry in batch:
                    # (_listed_child, inlined: a coroutine per entry was a good
                    # part of a warm listing's cost)
                    if isinstance(entry, ChunkEntry) and stored_since(entry.shard_key, mark):
                        child = await self._dataset_child(prefix + name, dataset, rel + (name,))
                    else:
                        child = virtual(prefix + name, dataset, rel + (name,), entry)
                        if (self.removed_dirs and child is not None and child.is_dir
                                and await self._removed_and_empty(child)):
                            child = None  # (as lookup answers)
                    if child is not None:
                        if child.path in buffers:
                            held.add(child.name)
                        else:
                            out.append(child)
                if (out and len(out) == len(batch) and isinstance(batch[0][1], ChunkEntry)
                        and not self.writeback.dirty and not stored_since(batch[0][1].shard_key, mark)):
                    self._keep_listed(batch, prefix, dataset, out)
                if out:
                    if seen is not None:
                        seen.update(child.name for child in out)
                    yield out
        else:
            # listed first: the probes for metadata documents are then
            # answered from the listing, with no request for those it lacks
            listing = await self.store.list(node.key)
            dataset = await self.dataset_at(node.key)
            if self.new_dirs.get(node.path):
                # stored now (local: at once; S3: once a file is below): no longer ours to remember
                self._forget_made_dirs(node.path, listing.dirs)
            # a name that is both an object and a directory is shown once,
            # as lookup answers: the directory if the object is empty (a
            # marker some S3 tools leave), else the file
            dirs = set(listing.dirs)
            both = {name: info.size for info in listing.files
                    if (name := info.key.rsplit("/", 1)[-1]) in dirs} if dirs else {}
            links = self._shown_links(listing, dataset)
            out = []
            for name in [*listing.dirs, *await self._named_by_listed_info(node.key, listing)]:
                if both.get(name) or name in links:
                    continue
                if dataset is None or not dataset.claims((name,)):
                    path = join_key(node.path, name)
                    out.append(Node(path, True, 0, self._made_at.get(path, self.started_ns), key=join_key(node.key, name)))
            for info in listing.files:
                name = info.key.rsplit("/", 1)[-1]
                if both.get(name) == 0 or name in links:
                    continue
                if dataset is None or not dataset.claims((name,)):
                    try:
                        out.append(await self._stored_file(join_key(node.path, name), info))
                    except NotFound:
                        continue
            for name, info in links.items():
                out.append(self._link_node(join_key(node.path, name), info))
            out = unbuffered([child for child in out if child is not None])
            if out:
                if seen is not None:
                    seen.update(child.name for child in out)
                yield out
            if dataset is not None:
                prefix = _prefix(node.path)
                async for batch in dataset.listdir_batches(()):
                    out = []
                    for name, entry in batch:
                        child = await self._listed_child(prefix + name, dataset, (name,), entry, mark)
                        if child is not None:
                            if child.path in buffers:
                                held.add(child.name)
                            else:
                                out.append(child)
                    if out:
                        if seen is not None:
                            seen.update(child.name for child in out)
                        yield out
        for name in sorted(held.union(extra)) if held else extra:
            if seen is None or name not in seen:  # (a held name is in no batch: left out of its own)
                child = await self.lookup(node, name)
                if child is not None:
                    yield [child]

    def _keep_listed(self, batch: list, prefix: str, dataset: Dataset, nodes: list[Node]) -> None:
        """Keep the nodes made of a layout's listed slice of chunks (a list
        the layout keeps while its index version is current) for the next
        listing of it.  The slice is held here, so its id names no other."""
        if self._listed_count + len(nodes) > LISTED_NODES:
            self._listed_slices.clear()
            self._listed_count = 0
            if len(nodes) > LISTED_NODES:
                return
        old = self._listed_slices.get(id(batch))
        if old is not None:
            self._listed_count -= len(old[3])
        self._listed_slices[id(batch)] = (batch, prefix, dataset, nodes)
        self._listed_count += len(nodes)

    def _shown_links(self, listing, dataset: Dataset | None) -> dict[str, ObjectInfo]:
        """The links of a pass-through directory's listing that the view shows
        as links, by name.  The others are at names it derives: followed
        inside the store (the listing's dirs and files), and one that leads
        out or names nothing is left out, with one warning."""
        if not listing.links:
            return {}
        shown, listed = {}, None
        for info in listing.links:
            name = info.key.rsplit("/", 1)[-1]
            if not self._derived(dataset, name, info.key):
                shown[name] = info
                continue
            if listed is None:
                listed = {*listing.dirs, *(f.key.rsplit("/", 1)[-1] for f in listing.files)}
            if name not in listed:
                log_once(log, logging.WARNING, f"{info.key}: a symbolic link (-> {info.link!r}) where the view derives "
                                               "what it shows (a shard, chunk directory or metadata document) leads "
                                               "out of the store, loops or names nothing; left out",
                         tag=f"derived link left out: {info.key}", interval=3600)
        return shown

    def _pending_children(self, path: str) -> list[str]:
        """Names below ``path`` that exist only in memory so far."""
        names = set(self.new_dirs.get(path, ()))
        names.update(self.new_chunks.get(path, ()))
        # the directories leading to chunks written but not stored yet: their
        # shards' storage directories may not exist (an array stored empty, a
        # row whose shards were all deleted), and storage lists only those
        for d in self._new_chunk_dirs.get(path, ()):
            name = d.rsplit("/", 1)[-1]
            if name not in names and self._pending_below(d):
                names.add(name)
        if self.emptied:
            names.update(p[len(_prefix(path)):] for p in list(self.emptied)
                         if _parent(p) == path and self._still_emptied(p))
        prefix = path + "/" if path else ""
        for p in self.buffers:  # (and the directory leading to one further down, which
            if p.startswith(prefix):  # storage may not hold: a temporary in an empty chunk row)
                names.add(p[len(prefix):].split("/", 1)[0])
        return sorted(names)

    # -- reading ------------------------------------------------------------

    async def content(self, node: Node) -> bytes:
        """The whole current content of a chunk file (dirty data first)."""
        t = node.target
        dirty = self.writeback.pending(t.shard_key, t.chunk_id)
        if dirty is not None:
            if dirty.data is None:
                raise NotFound(f"{node.path}: deleted", node.path)
            return bytes(dirty.data)
        try:
            return await node.dataset.read(t)
        except NotFound:
            if self._empty_with_pending(node.dataset, node.rel):
                return b""
            raise

    def _chunk_version(self, t: ChunkTarget) -> tuple:
        return self._chunk_epoch, self._chunk_changes.get((t.shard_key, t.chunk_id), 0)

    def _chunk_changed(self, t: ChunkTarget) -> None:
        if len(self._chunk_changes) > 65536:
            self._chunk_changes.clear()
            self._chunk_epoch += 1
        k = (t.shard_key, t.chunk_id)
        self._chunk_changes[k] = self._chunk_changes.get(k, 0) + 1

    def handed_to_kernel(self, node: Node) -> None:
        """All of ``node``'s bytes are in the kernel's page cache now."""
        if node.is_chunk:
            self.shards.handed_over(node.target.shard_key, node.target.chunk_id)

    def chunk_version(self, node: Node) -> tuple | None:
        """What changes when this mount changes chunk ``node`` (None: not a chunk)."""
        return self._chunk_version(node.target) if node.is_chunk else None

    @staticmethod
    def kernel_holds(data: bytes, version: tuple | None) -> tuple[int, int, tuple] | None:
        """``Handle.kernel_has`` of a chunk whose ``data`` (read at this
        mount's ``version`` of it) the kernel's page cache holds."""
        return None if version is None else (len(data), crc32c.crc32c(data), version)

    async def read(self, handle: Handle | Node, offset: int, size: int, expect_size: int | None = None) -> bytes:
        """Bytes of a file (whole chunks are cached by the shard layer).
        ``expect_size``: the size the reader was given; a stored chunk of
        another size now is another version (raises Changed: its bytes cut
        to the old size would be neither)."""
        node = handle.node if isinstance(handle, Handle) else handle
        buf = handle.buffer if isinstance(handle, Handle) else None
        buf = buf or self.buffers.get(node.path)
        if buf is not None:
            return bytes(buf.data[offset: offset + size])
        chunk = handle.chunk if isinstance(handle, Handle) else None
        if chunk is not None and chunk.data is not None:
            # its own file, as on POSIX, also once unlinked or replaced by a rename
            return bytes(chunk.data[offset: offset + size])
        if node.is_chunk:
            seen = handle.seen if isinstance(handle, Handle) else None
            if seen is not None and seen[1] == self._chunk_version(node.target):
                if expect_size is not None and len(seen[0]) != expect_size:
                    # the kernel was told of another size since: neither version cut to it
                    raise Changed(f"{node.path}: replaced by another client while open; open it again", node.path)
                return seen[0][offset: offset + size]
            data = await self.content(node)
            seen = handle.seen if isinstance(handle, Handle) else None
            if seen is not None and seen[1] == self._chunk_version(node.target):
                # another READ of this open, in flight with this one, fixed
                # its version meanwhile (and checked it): the rest is that one
                if expect_size is not None and len(seen[0]) != expect_size:
                    raise Changed(f"{node.path}: replaced by another client while open; open it again", node.path)
                return seen[0][offset: offset + size]
            if expect_size is not None and len(data) != expect_size and self.in_memory(node) is None:
                raise Changed(f"{node.path}: replaced by another client (now {len(data)} bytes, not "
                              f"{expect_size}); read it again", node.path)
            held = handle.kernel_has if isinstance(handle, Handle) else None
            if (held is not None and held[2] == self._chunk_version(node.target)
                    and (len(data) != held[0] or crc32c.crc32c(data) != held[1])):
                # the kernel dropped pages of the version it holds for this
                # open (memory pressure, fadvise), and another client has
                # replaced the chunk since: its bytes beside the old pages
                # the reader has had would be a mix of two versions
                raise Changed(f"{node.path}: replaced by another client while open; open it again", node.path)
            if isinstance(handle, Handle) and (offset > 0 or offset + size < len(data)):
                # read in pieces: the rest from this version, even if another
                # client replaces the shard meanwhile (its chunk cache entry
                # may go; the bytes stay with the handle until it is closed)
                handle.seen = (data, self._chunk_version(node.target))
            return data[offset: offset + size]
        if node.document is not None:
            return node.document[offset: offset + size]
        if node.key is None:  # (a scratch file gone: only memory held it)
            raise NotFound(f"{node.path}: no longer exists", node.path)
        own = self.own_versions.get(node.key)
        if own is not None and own[0] != node.version and node.created < own[1]:
            # rewritten through this mount since the reader learned of it:
            # visible at once (2.5); a node learned later is of a later version
            # (and its size is the new one's, which the kernel was told: the
            # size the reader opened, even 0, is no end to its reads, this
            # one's or the next's)
            node.version, node.size = own[0], own[2]
        if size <= 0 or offset >= node.size:
            return b""
        try:  # pinned: the version whose size the reader was given, never a mix
            blob = await self.store.get(node.key, offset, size, if_match=node.version)
        except PreconditionFailed:
            raise Changed(f"{node.path}: replaced by another client while being read; open it again",
                          node.key) from None
        return blob.data

    # -- writing ------------------------------------------------------------

    def _check_writable(self) -> None:
        if self.read_only:
            raise ViewError(errno.EROFS, "read-only mount")

    def _check_chunk_writable(self, node: Node) -> None:
        if node.is_chunk and not node.target.writable:
            message = f"{node.path}: the view cannot store this file (read-only part of the dataset)"
            log_once(log, logging.WARNING, message)
            raise ViewError(errno.EPERM, message)

    def _index_new_chunk_dir(self, path: str) -> None:
        """``path`` (a directory of ``new_chunks``) and the directories
        leading to it are listed in ``_new_chunk_dirs`` under their parents."""
        while path:
            parent = _parent(path)
            below = self._new_chunk_dirs.setdefault(parent, set())
            if path in below:
                return  # (and so are the ones above)
            below.add(path)
            path = parent

    def _pending_below(self, path: str) -> bool:
        """Does directory ``path`` or one below it hold a chunk written and
        not stored yet (one with data: an unlink leaves nothing to list)?"""
        todo = [path]
        while todo:
            d = todo.pop()
            chunks = self.new_chunks.get(d)
            if chunks and any((c := self.writeback.pending(t.shard_key, t.chunk_id)) is not None
                              and c.data is not None for _, _, t in chunks.values()):
                return True
            todo.extend(self._new_chunk_dirs.get(d, ()))
        return False

    def _remember_new_chunk(self, node: Node) -> None:
        if _parent(node.path) not in self.new_chunks:
            self._index_new_chunk_dir(_parent(node.path))
        names = self.new_chunks.setdefault(_parent(node.path), {})
        self._new_chunks_count += node.name not in names
        names[node.name] = (node.dataset, node.rel, node.target)
        if node.dataset.root in self.born_here:
            self.born_here[node.dataset.root] = time.monotonic()
            path = _parent(node.path)
            for _ in node.rel[:-1]:
                self.written_dirs.add(path)
                self.removed_dirs.discard(path)
                path = _parent(path)

    def open_reader(self, node: Node) -> Handle:
        """:meth:`open` for reading.  Synchronous (it never waits): the
        kernel's most frequent request after a lookup, and its caller may
        count on nothing changing between its own checks and this."""
        if node.link is not None:  # (the kernel resolves links itself: never asked)
            raise ViewError(errno.ELOOP, f"{node.path}: a symbolic link")
        if node.damage is not None:  # (shown with size 0: the kernel would read nothing and say so)
            raise CorruptData(node.damage, node.target.shard_key)
        handle = Handle(node)
        if node.target is not None and not self.read_only:  # (a chunk: only writes of this mount remove it under them)
            self.readers.setdefault(node.path, set()).add(handle)
        buf = self.buffers.get(node.path)
        if buf is not None and buf.key is None:
            # a scratch file exists only in memory: the reader keeps its
            # bytes, also once it is unlinked or dropped (POSIX), and it
            # is not dropped while read (_drop_abandoned_scratch)
            handle.buffer = buf
            buf.readers += 1
        elif node.key is None and node.target is None and not node.is_dir:
            raise ViewError(errno.ENOENT, f"{node.path}: no longer exists")
        return handle

    async def open(self, node: Node, *, write: bool, truncate: bool) -> Handle:
        if not write:
            return self.open_reader(node)
        if node.link is not None:  # (the kernel resolves links itself: never asked)
            raise ViewError(errno.ELOOP, f"{node.path}: a symbolic link")
        self._check_writable()
        with self._under_way(node.path):
            return await self._open_writer(node, truncate)

    @contextlib.contextmanager
    def _under_way(self, *paths: str):
        """While held, a request at ``paths`` is under way (an open for
        writing, a create, mkdir, rmdir, unlink, symlink, link, truncate, a
        file's rename): it awaits before it acts, and then acts at the paths
        and keys it resolved first, so a directory above one of them is not
        renamed meanwhile (:meth:`_quiet_below`: EXDEV, ``mv`` copies); it
        would make the old directory again, or act on nothing there."""
        for path in paths:
            self._opening[path] = self._opening.get(path, 0) + 1
        try:
            yield
        finally:
            for path in paths:
                if self._opening[path] <= 1:
                    del self._opening[path]
                else:
                    self._opening[path] -= 1

    async def _open_writer(self, node: Node, truncate: bool) -> Handle:
        """open for writing: while it awaits (the node's freshness, the
        chunk's content, room for a buffer) it is counted in ``_opening``, so
        a directory above is not renamed under it: it would then open, and
        store, under the old key (making the old directory again)."""
        node = await self._fresh(node)
        if node.is_chunk:
            t = node.target
            if t.capacity is None:
                t = node.target = node.dataset.target(node.rel) or t
            self._check_chunk_writable(node)
            await self.writeback.refuse_if_damaged(t.shard_key, node.dataset.shard_format, t.shard_ctx,
                                                   (t.chunk_id,), f"a write of {node.path}")
            initial = b""
            for _ in range(8) if not truncate else ():
                # a write of this mount that lands while the content is read
                # (and is flushed and closed meanwhile) must not be undone by
                # a buffer made from what was there before it
                before = self._chunk_version(t)
                initial = await self.content(node)
                if self._chunk_version(t) == before:
                    break
            chunk = self.writeback.open_chunk(t.shard_key, node.dataset.shard_format, t.shard_ctx, t.chunk_id,
                                              initial, t.capacity, node.dataset.shard_home, stored=not truncate,
                                              mtime_ns=node.mtime_ns)
            if truncate and len(chunk.data):
                del chunk.data[:]
                self.writeback.changed(t.shard_key, chunk)
                self._chunk_changed(t)
            self._remember_new_chunk(node)
            return self._writer(Handle(node, True, chunk=chunk))
        buf = self.buffers.get(node.path)
        if buf is None:
            await self._room_for_files(node.path)
            # what the view shows (a rewritten document, mapped back if it
            # is changed), so readers see the same bytes while it is open
            data = b"" if truncate else node.document if node.document is not None else await self._stored_bytes(node)
            # another open may have made one while we read: share it
            buf = self.buffers.get(node.path)
            if buf is None:
                # (its mtime stays the stored one until it changes: an open
                # that writes nothing, ``touch -d``, changes no time)
                buf = self.buffers[node.path] = FileBuffer(node.path, node.key, bytearray(data),
                                                           mtime_ns=node.mtime_ns if not truncate and node.mtime_ns else time.time_ns())
        if truncate and (buf.data or node.size):  # (``: > f`` empties f, written to or not)
            del buf.data[:]
            buf.changed()
        buf.handles += 1
        return self._writer(Handle(node, True, buffer=buf))

    def _writer(self, handle: Handle) -> Handle:
        self.writers.setdefault(handle.node.path, set()).add(handle)
        return handle

    def _not_writer(self, handle: Handle) -> None:
        for registry in (self.writers, self.readers):
            handles = registry.get(handle.node.path)
            if handles is not None:
                handles.discard(handle)
                if not handles:
                    del registry[handle.node.path]

    async def _keep_for_readers(self, node: Node) -> None:
        """Readers that have chunk ``node`` open go on reading what it holds
        now, as on POSIX, once it is unlinked or replaced."""
        handles = self.readers.pop(node.path, ())
        if not handles:
            return
        try:
            data = await self.content(node)
        except StoreError:
            return  # nothing readable to keep; their reads fail as the file's would
        for h in handles:
            h.chunk = DirtyChunk(bytearray(data), 0)

    async def _stored_bytes(self, node: Node, recent_ok: bool = False) -> bytes:
        """The stored bytes of ``node``'s file.  ``recent_ok`` (a rename's
        copy only): bytes this mount stored a moment ago will do, with the
        staleness of a listing (2.5).  An open for an in-place write reads the
        store: else it would write this mount's older bytes back over another
        client's newer version."""
        if node.key is None:
            return b""
        written = self.store.written(node.key) if recent_ok else None
        if written is not None:
            return written
        try:
            return (await self.store.get(node.key)).data
        except NotFound:
            return b""

    def _check_name(self, name: str) -> None:
        """A name the store keeps for itself (the local backend's temporary
        files, which it hides and removes once their writer is gone) cannot
        be given to a file or directory: EINVAL, one log line."""
        if self.store.reserved_name(name):
            message = f"{name}: a name zshardfs keeps for its own temporary files"
            log_once(log, logging.WARNING, message)
            raise ViewError(errno.EINVAL, message)

    @staticmethod
    def _outside(dataset: Dataset, directory: str, path: str) -> ViewError:
        """The refusal (ENOENT) of a name spelled as a chunk (file or
        directory) but outside ``dataset``'s grid, and one INFO line per
        directory it would be made in (``directory``; a directory refused is
        its own): a copy of a grown array (``rsync -a``, which makes the new
        chunk directories before it copies ``zarr.json``) learns why."""
        grid = getattr(dataset, "grid", None)
        shape = getattr(grid, "shape", None)
        document = {"precomputed": "info", "zarr-v3-draft-transformer": "array document"}.get(dataset.layout,
                                                                                                "zarr.json")
        message = (f"{directory or '/'}: outside the chunk grid of {dataset.root or 'the root'}"
                   f"{f' (shape {list(shape)})' if shape is not None else ''}: its chunk names there are refused "
                   f"(ENOENT); to grow it, write its larger {document} first")
        log_once(log, logging.INFO, message, tag=f"outside the grid: {directory}")
        return ViewError(errno.ENOENT, f"{path}: outside the chunk grid")

    @staticmethod
    def _no_key_part(dataset: Dataset, path: str) -> ViewError:
        """The refusal (ENOENT) of a directory ``path`` in ``dataset``'s chunk
        namespace that can be no part of a chunk key (``c/0x``: ``cp -r c/0
        c/0x``): whatever were written below it could never be stored.  One
        INFO line per directory, naming the array and a key of it."""
        keys = getattr(dataset, "keys", None)
        example = f" (its chunk keys are like {keys.format((0,) * keys.ndim)})" if keys is not None else ""
        message = (f"{path}: no part of a chunk key of {dataset.root or 'the root'}{example}: no directory can "
                   "be made there (ENOENT)")
        log_once(log, logging.INFO, message, tag=f"no key part: {path}")
        return ViewError(errno.ENOENT, f"{path}: not a name in the chunk grid")

    async def create(self, parent: Node, name: str, exclusive: bool = False) -> Handle:
        """A new empty file ``name`` in ``parent``, opened for writing.
        ``exclusive``: EEXIST if the name is taken, checked after the last
        wait but the lookup, and again (this mount's files in memory) after it,
        with no wait between that and the new file taking the name."""
        self._check_writable()
        self._check_name(name)
        with self._under_way(join_key(parent.path, name)):
            return await self._create(parent, name, exclusive)

    async def _create(self, parent: Node, name: str, exclusive: bool) -> Handle:
        parent = await self._fresh(parent)
        path = join_key(parent.path, name)
        dataset, rel = (parent.dataset, parent.rel + (name,)) if self._in_dataset(parent) else (None, ())
        if dataset is None:
            root_dataset = await self.dataset_at(parent.key)
            if root_dataset is not None and root_dataset.claims((name,)):
                dataset, rel = root_dataset, (name,)
            elif root_dataset is not None and root_dataset.outside((name,)):
                raise self._outside(root_dataset, parent.path, path)
        if dataset is not None:
            target = dataset.target(rel)
            if target is not None:
                if exclusive and await self.lookup(parent, name) is not None:
                    raise ViewError(errno.EEXIST, f"{path}: exists")
                node = Node(path, False, 0, time.time(), dataset=dataset, rel=rel, target=target)
                return await self.open(node, write=True, truncate=True)
            if dataset.outside(rel):
                raise self._outside(dataset, parent.path, path)
            # a shard a sharding-aware tool writes: stored as written; any
            # other name is scratch, a temporary inside the chunk namespace
            key = dataset.stored_as_is(rel)
        else:
            key = join_key(parent.key, name)
        self._drop_abandoned_scratch()
        await self._room_for_files(path)
        if exclusive and (path in self.buffers or await self.lookup(parent, name) is not None
                          or path in self.buffers):
            raise ViewError(errno.EEXIST, f"{path}: exists")
        buf = self.buffers[path] = FileBuffer(path, key, bytearray(), dirty=True, in_store=False)
        self._made_in(_parent(path))
        buf.handles += 1
        return self._writer(Handle(self._buffer_node(buf), True, buffer=buf))

    async def write(self, handle: Handle, offset: int, data: bytes, held_by_renames: bool = True) -> int:
        if not handle.writable:
            raise ViewError(errno.EBADF, "not open for writing")
        if held_by_renames:
            await self._while_renamed(handle)
        if handle.buffer is None:
            # back-pressure first: a write refused with a flush's error
            # leaves nothing behind to be stored later
            await self.writeback.wait_for_room()
            if held_by_renames:
                await self._while_renamed(handle)  # (a rename may have begun meanwhile)
        target = handle.buffer.data if handle.buffer is not None else handle.chunk.data
        if handle.append and offset > len(target or b""):
            # the kernel appends at the end it holds, past this file's: another
            # client made it shorter within attr_timeout.  Appended at the end
            # here (no hole of zeros).  A lower offset is honoured: the kernel
            # was told a grown end at the open, and writes back a page of a
            # shared mapping of an O_APPEND descriptor where it lies, as ext4
            offset = len(target or b"")
        self._check_size(handle.node, offset + len(data))
        if target is None:  # the chunk was unlinked while open: keep writing into a fresh buffer
            handle.chunk.data = target = bytearray()
        if offset > len(target):
            target.extend(b"\0" * (offset - len(target)))
        target[offset: offset + len(data)] = data
        if handle.buffer is not None:
            handle.buffer.changed()
        else:
            self.writeback.changed(handle.node.target.shard_key, handle.chunk)
            self._chunk_changed(handle.node.target)
        return len(data)

    def _check_size(self, node: Node, size: int) -> None:
        """A file written is held whole in memory until stored (and a chunk
        with its whole shard when that is rewritten): past MAX_FILE, or
        ``max_dirty`` if larger, it is refused (EFBIG), not left to exhaust
        memory (``truncate -s 100G``, a ``dd seek=`` far out)."""
        limit = max(MAX_FILE, self.writeback.max_dirty_bytes)
        if size > limit:
            message = f"{node.path}: {size} bytes is more than a file written through the view may hold ({limit})"
            log_once(log, logging.WARNING, message)
            raise ViewError(errno.EFBIG, message)

    async def truncate(self, node: Node, size: int, handle: Handle | None = None) -> Node:
        with self._under_way(node.path):  # (until the node it answers is made: see _under_way)
            return await self._truncate(node, size, handle)

    async def _truncate(self, node: Node, size: int, handle: Handle | None) -> Node:
        self._check_writable()
        self._check_size(node, size)
        if handle is not None and handle.writable:
            await self._while_renamed(handle)
            node = handle.node  # (moved, if it was renamed meanwhile)
        own = handle if handle is not None and handle.writable else await self.open(node, write=True, truncate=False)
        data = own.buffer.data if own.buffer is not None else own.chunk.data
        if size < len(data):
            del data[size:]
        else:
            data.extend(b"\0" * (size - len(data)))
        if own.buffer is not None:
            own.buffer.changed()
        else:
            self.writeback.changed(node.target.shard_key, own.chunk)
            self._chunk_changed(node.target)
        if own is not handle:
            try:
                await self.flush(own)
            finally:
                await self.release(own)  # (also when storing failed: no handle left behind)
        return (await self.refresh(node)) or node

    async def flush(self, handle: Handle, held_by_renames: bool = True) -> None:
        """close(2): passthrough files are stored now (errors reach close)."""
        if handle.writable and held_by_renames:
            await self._while_renamed(handle)  # (else it would store the old name again)
        buf = handle.buffer
        if buf is None or not buf.dirty or buf.key is None:
            return
        if await self._not_at_close(buf):
            return
        await self._store_buffer(buf)

    async def _not_at_close(self, buf: FileBuffer) -> bool:
        """Is ``buf`` (dirty, with a key) one a close leaves in memory?"""
        if await self._is_scratch_in_dataset_root(buf):
            return True  # stored at fsync/sync, or moved by a rename before that
        # an emptied metadata document (``> zarr.json``, ``truncate -s 0``):
        # its text is about to follow, and the dataset, which the stored
        # document still describes, keeps its chunk files meanwhile;
        # stored empty only at fsync, sync or unmount
        return self._is_dataset_document(buf.key) and not buf.data.strip() and await self._describes_datasets(buf)

    async def _describes_datasets(self, buf: FileBuffer) -> bool:
        """Does the document ``buf`` replaces describe datasets (stored, or
        removed by this mount while chunks of it remain)?"""
        if buf.key in self.removed_documents:
            return await self._removed_document(buf.key) is not None
        stored = await self._stored_document(buf.key) if buf.in_store else None
        return bool(stored) and bool(await self._datasets_made_of(buf.key, stored))

    async def _is_scratch_in_dataset_root(self, buf: FileBuffer) -> bool:
        # asked of the dataset, not of the probe cache: a temporary held open
        # longer than the metadata TTL must not land in the store
        if self._is_dataset_document(buf.key):
            return False
        dataset = await self.dataset_at(_parent(buf.key))
        return dataset is not None and dataset.stored_as_is((buf.key.rsplit("/", 1)[-1],)) is None

    async def _store_buffer(self, buf: FileBuffer) -> None:
        async with held_by_deadline(buf.storing, buf.key or buf.path, "another store of it"):
            if buf.dirty and buf.key is not None:
                try:
                    try:
                        await self._store_buffer_now(buf)
                    except DirectoryAtKey as exc:
                        # another client made a directory at its key: the
                        # close, fsync or sync storing it answers EIO, as a
                        # file system whose write-back fails (ENOENT, a
                        # missing name, for a file open and found, was no
                        # answer, and went unlogged); a rename answers EISDIR
                        raise DirectoryInTheWay(f"{buf.path}: not stored: storage holds a directory at its key "
                                                f"{buf.key} (made by another client); the file stays in memory "
                                                "under its name (rename it through the mount to store it)",
                                                buf.key) from exc
                except ViewError:
                    raise  # (refused for good: not held)
                except StoreError as exc:
                    buf.error = exc
                    if isinstance(exc, Unavailable):
                        buf.maybe_stored = True
                    raise
                buf.error = None

    #: seconds between the tries of creates and opens that find the files
    #: storage refused over ``max_dirty`` to store them (see _room_for_files)
    HELD_RETRY = 1.0

    def _held_over(self) -> tuple[int, StoreError] | None:
        """The bytes of the files storage refused and the last refusal, if
        those, with the dirty chunks, hold more than ``max_dirty``."""
        held, error = 0, None
        for buf in self.buffers.values():
            if buf.error is not None and buf.dirty:
                held += len(buf.data)
                error = buf.error
        if error is None or held + self.writeback.dirty_bytes <= self.writeback.max_dirty_bytes:
            return None
        return held, error

    async def _room_for_files(self, path: str) -> None:
        """Back-pressure on files held whole in memory: while storage refuses
        them (ENOSPC, an S3 outage) and those refused, with the dirty chunks,
        hold more than ``max_dirty``, no other file is made or opened for
        writing.  Such a create or open first tries to store them, as a close
        would (at most one try every HELD_RETRY, stopping at the first
        failure: storage may work again, and nothing else would store them
        before a close, fsync or sync); refused, it gets that failure's
        error, or the last refusal's at once between tries."""
        if self._held_over() is None:
            return
        now = time.monotonic()
        if now - self._held_tried_at >= self.HELD_RETRY:
            self._held_tried_at = now
            for buf in [b for b in self.buffers.values() if b.error is not None and b.dirty]:
                if self.buffers.get(buf.path) is not buf or buf.key is None or not buf.dirty \
                        or await self._not_at_close(buf):
                    continue
                try:
                    await self._store_buffer(buf)
                except ViewError:
                    continue  # (a document refused for good: dropped, not held)
                except StoreError:
                    break  # (storage still refuses: refused below with this error)
        over = self._held_over()
        if over is None:
            return
        held, error = over
        log_once(log, logging.WARNING, f"{path}: refused: {held >> 20} MiB of files storage refused wait in "
                                       f"memory, over max_dirty (the last refusal: {error})",
                 tag="files held for want of storage", interval=60)
        raise copy.copy(error)

    async def _store_buffer_now(self, buf: FileBuffer) -> None:
        version, written = buf.version, bytes(buf.data)
        data = written
        stored = None  # the document replaced: what the key holds now, or the one this mount removed there
        # (an editor's save, rm and put back: the array's directories stay what
        # they were, even if none of its chunks is left; see born_here below)
        removed = self.removed_documents.get(buf.key)
        resaved = removed is not None
        replaced = None  # the document stored there (a JSON object), if any
        for layout in LAYOUTS:
            if layout.is_document(buf.key) and hasattr(layout, "accept_document"):
                blob = await self.store.get_or_none(buf.key)
                # only a document stands for one (an empty or broken file there
                # does not: ``> zarr.json`` stores an empty one first); then the
                # one this mount removed there, if its chunks remain; else none:
                # a new document, as layouts judge one
                a_stored_document = blob is not None and await off_loop(
                    functools.partial(_json_object, blob.data), len(blob.data))
                stored = blob.data if a_stored_document else await self._removed_document(buf.key)
                replaced = blob.data if a_stored_document else None
                if stored is None and removed is not None and data == removed:
                    # the very document this mount removed there, put back (``mv``
                    # away and back) after the last chunk went: not a new array
                    # written through the view, but the store's own document
                    stored = removed
                # a layout that needs to read storage to decide (members'
                # documents, what the directory already holds) offers an
                # async variant
                accept = getattr(layout, "accept_document_async", None)

                async def judge(doc: bytes, layout=layout, accept=accept, stored=stored,
                                a_stored_document=a_stored_document):
                    if accept is not None:
                        return await accept(self.ctx, buf.key, doc, stored, self.shard_option,
                                            self._pending_children,
                                            previous=None if a_stored_document
                                            else self.previous_documents.get(buf.key))
                    return await off_loop(functools.partial(layout.accept_document, buf.key, doc, stored,
                                                            self.shard_option), len(doc))
                try:
                    try:
                        accepted = await judge(data)
                    except ValueError:
                        shown = buf.view_form
                        if shown is None or shown == data or buf.version != version:
                            raise
                        # a renamed document whose stored form is refused here:
                        # what the view showed, as a copy would have written
                        accepted = await judge(shown)
                        data = written = shown
                        buf.data[:] = shown
                except ValueError as exc:
                    self._refuse(buf, str(exc))
                except METADATA_ERRORS as exc:
                    # a document of the wrong shape: stored as written (the
                    # view shows it as stored), unless it would replace the
                    # metadata of a dataset the view serves and hide its chunks
                    if await self.dataset_at(_parent(buf.key)) is not None:
                        self._refuse(buf, f"not a document the view can read ({type(exc).__name__}: {exc}); "
                                          "it would hide the dataset's chunks")
                    accepted = None
                if accepted is not None:
                    data = accepted
                    break
        if not buf.in_store and not resaved and self._is_dataset_document(buf.key):
            # a new dataset, if nothing is stored below it yet (see __init__);
            # not one saved again over the document this mount removed: its
            # chunk directories existed, if storage lost them with their last
            # shard, and may hold temporaries and chunks not stored yet
            root = _parent(buf.key)
            listing = await self.store.list(root)
            if not listing.dirs and not any(_could_be_chunk(f.key.rsplit("/", 1)[-1]) for f in listing.files):
                self.born_here[root] = time.monotonic()
        # (a shard written as is: newer than the chunk writes pending for it,
        # and its chunks show at once)
        made_of = []
        a_document = self._is_dataset_document(buf.key) and await off_loop(
            functools.partial(_json_object, data), len(data))
        if replaced is not None and not a_document:
            # emptied (``truncate``, ``> zarr.json``) or broken: the text to come
            # is judged against the document it replaces too
            self._keep_previous(buf.key, replaced)
        shrinking = [(d, ds) for d, ds in await self._datasets_made_of(buf.key, stored)
                     if ds.prunes_on_shrink] if stored and a_document else []
        if stored and self._is_dataset_document(buf.key) and not a_document:
            # no document any dataset can be made of, over one that was: as if
            # removed (4.15), its datasets keep their chunk files
            made_of = await self._datasets_made_of(buf.key, stored)
        if stored and a_document:
            await self._store_removals_first(buf.key, stored)
        info = await self.writeback.superseding(buf.key, functools.partial(self.store.put, buf.key, data,
                                                                           like=buf.like))
        buf.like = buf.view_form = None
        self.shards.forget(buf.key)
        if self._is_dataset_document(buf.key):
            self._document_changed(buf.key)
            if made_of:
                self._orphan(buf.key, stored, made_of)
            for dir_key, before in shrinking:
                await self._prune_outside(dir_key, before)
            if a_document:  # (not an empty or broken file: the text may be still to come)
                self._forget_removed(buf.key)
                self._forget_previous(buf.key)
        self.own_versions[buf.key] = (info.etag, time.monotonic(), len(data))
        self.own_versions.move_to_end(buf.key)
        if len(self.own_versions) > 4096:
            self.own_versions.popitem(last=False)
        if data != written:
            # mapped back to its stored form: the view goes on showing what
            # was written (the kernel holds that size), not a re-rendering
            self.documents.put((buf.key, info.etag), written)
        if buf.version == version:  # else a write came in meanwhile: still dirty
            buf.dirty = False
        buf.in_store = True
        if self.new_dirs and buf.path == buf.key and not self.store.keeps_empty_dirs:
            self._stored_below(buf.key)
        self.datasets.pop(_parent(buf.key))
        self.datasets.pop(buf.key)

    async def _store_removals_first(self, key: str, stored: bytes) -> None:
        """Store the chunk removals pending in the datasets the document
        ``key`` replaces before the document itself.  A resize is written
        so (zarr-python deletes the chunks past the new shape, then writes
        the document); stored the other way round, a kill -9 between the two
        left those chunks in their shards, hidden past the new shape, and a
        later grow showed them again.  A failure fails the document's store:
        it is not stored ahead of what came before it."""
        removing = []
        for dir_key, _ in await self._datasets_made_of(key, stored):
            removing += self.writeback.removing_below(dir_key)
        if removing:
            await self.writeback.flush_keys(removing)

    def _orphan_at(self, dir_key: str) -> Dataset | None:
        orphan = self.orphans.get(dir_key)
        return orphan[0] if orphan is not None else None

    def _forget_orphan(self, dir_key: str) -> None:
        orphan = self.orphans.pop(dir_key, None)
        if orphan is not None and not any(k == orphan[1] for _, k in self.orphans.values()):
            self.removed_documents.pop(orphan[1], None)

    def _keep_previous(self, key: str, data: bytes) -> None:
        """``data`` (a JSON object) was the document stored at ``key``, which
        this mount is removing or emptying (see ``previous_documents``)."""
        self._forget_previous(key)
        if len(data) > PREVIOUS_DOCUMENTS_BYTES:
            return
        self.previous_documents[key] = data
        self._previous_bytes += len(data)
        self._previous_in.setdefault(_parent(key), set()).add(key)
        while len(self.previous_documents) > PREVIOUS_DOCUMENTS or self._previous_bytes > PREVIOUS_DOCUMENTS_BYTES:
            self._forget_previous(next(iter(self.previous_documents)))

    def _forget_previous(self, key: str) -> None:
        data = self.previous_documents.pop(key, None)
        if data is not None:
            self._previous_bytes -= len(data)
            keys = self._previous_in.get(_parent(key))
            if keys is not None:
                keys.discard(key)
                if not keys:
                    del self._previous_in[_parent(key)]

    def _forget_removed(self, key: str) -> None:
        """A document is at ``key`` again: its removed predecessor is past."""
        self.removed_documents.pop(key, None)
        for dir_key in [d for d, (_, k) in self.orphans.items() if k == key]:
            del self.orphans[dir_key]

    async def _prune_outside(self, dir_key: str, before: Dataset) -> None:
        """Remove the chunks of ``before`` that lie outside the dataset now at
        ``dir_key`` (its shape shrank), as its writer would (see
        ``Dataset.prunes_on_shrink``).  A failure is logged: the document is
        stored, and the chunks stay, hidden, as the view found them."""
        try:
            after = await self.dataset_at(dir_key)
            pending = {key: self.writeback.pending_ids(key) for key in self.writeback.dirty
                       if key.startswith(_prefix(before.shard_home))}
            gone = await before.stored_outside(after, pending) if after is not None else []
        except StoreError as exc:
            log.warning("%s: shape shrank, but the chunks outside it could not be removed: %s", dir_key, exc)
            return
        for t in gone:
            self.writeback.delete(t.shard_key, before.shard_format, t.shard_ctx, t.chunk_id, before.shard_home)
            self._chunk_changed(t)
        if gone and sum(len(ids) for by_root in self.removed_here.values()
                        for ids in by_root.values()) < 1 << 20:  # (else they time out, attr_timeout)
            self.removed_here.setdefault(trio.lowlevel.current_task(), {}).setdefault(before.root, set()).update(
                (t.shard_key, t.chunk_id) for t in gone)
        if gone:
            log.info("%s: shape shrank: %d chunks outside it removed", dir_key, len(gone))

    async def _stored_document(self, key: str) -> bytes | None:
        """The stored document at ``key`` (None: absent, or over the size a
        document may have: then it describes no dataset either)."""
        try:
            return (await self.store.get_document(key)).data
        except (NotFound, TooLarge):
            return None

    async def _datasets_made_of(self, key: str, stored: bytes) -> list[tuple[str, Dataset]]:
        """(dir key, dataset) of the datasets the document ``stored`` at
        ``key`` describes (the layouts name their directories)."""
        out = []
        dirs = await off_loop(lambda: [d for layout in LAYOUTS if layout.is_document(key)
                                       for d in layout.dataset_dirs(key, stored)], len(stored))
        for d in dict.fromkeys(dirs):
            if (dataset := await self.dataset_at(d)) is not None:
                out.append((d, dataset))
        return out

    def _orphan(self, key: str, stored: bytes, datasets: list[tuple[str, Dataset]]) -> None:
        """Keep ``datasets`` (made of the document ``key``, just removed)."""
        for dir_key, dataset in datasets:
            self.orphans[dir_key] = (dataset, key)
            self.orphans.move_to_end(dir_key)
        if _json_object(stored) or key not in self.removed_documents:
            # (an empty or broken one never replaces the document it stands in for)
            self.removed_documents[key] = stored
        self.removed_documents.move_to_end(key)
        while len(self.orphans) > 1024:
            self._forget_orphan(next(iter(self.orphans)))
        while sum(map(len, self.removed_documents.values())) > REMOVED_DOCUMENTS_BYTES:
            self._forget_removed(next(iter(self.removed_documents)))

    async def _removed_document(self, key: str) -> bytes | None:
        """The stored bytes of the document this mount removed from ``key``,
        if a dataset made of it still holds chunks (a new document there is
        then that dataset's, mapped back); None if nothing of it is left."""
        data = self.removed_documents.get(key)
        if data is None:
            return None
        dirs = [d for d, (_, k) in self.orphans.items() if k == key]
        for dir_key in dirs:
            if await self._holds_chunks(Node(dir_key, True, key=dir_key)):
                return data
        for dir_key in dirs:  # all gone: their shards' deletions are stored before a new document
            await self.writeback.flush_below(dir_key)
        # (and the directories storage lost with them, which a directory
        # store keeps: the kernel, which may hold them, is told to forget them)
        gone = {(d, self.orphans[d][0].version) for d in dirs if d in self.orphans and self.orphans[d][0].version}
        if gone:
            self.datasets_gone.setdefault(trio.lowlevel.current_task(), set()).update(gone)
        self._forget_removed(key)  # ...which is new
        return None

    @staticmethod
    def _is_dataset_document(key: str) -> bool:
        return any(layout.is_document(key) for layout in LAYOUTS)

    def _refuse(self, buf: FileBuffer, reason: str) -> None:
        """A document refused for good: the view shows the stored one again,
        and sync/unmount do not retry it forever."""
        log.error("refused to store %s: %s", buf.key, reason)
        buf.dirty = False
        if self.buffers.get(buf.path) is buf:
            del self.buffers[buf.path]
        raise ViewError(errno.EPERM, f"{buf.key}: {reason}")

    async def fsync(self, handle: Handle) -> None:
        if handle.writable:
            await self._while_renamed(handle)
        # (a read-only descriptor's fsync stores the file too, as on POSIX:
        # what other handles wrote there is held under its name)
        buf = handle.buffer or self.buffers.get(handle.node.path)
        if buf is not None:
            if buf.dirty and buf.key is not None:
                await self._store_buffer(buf)
            return
        if handle.node.is_chunk:
            await self.writeback.flush(handle.node.target.shard_key)

    async def fsync_dir(self, node: Node) -> None:
        """fsync(2) of a directory: what was renamed into it, written or
        removed there is stored before the answer.  tensorstore (and any
        careful writer) writes a temporary, renames it over the chunk and
        fsyncs the directory, and takes the write as durable then.  A chunk
        directory's names are entries of shard indexes: the dirty shards of
        the chunks opened for writing in it (``new_chunks``) are flushed, and
        those of its dataset holding a removed chunk.  Elsewhere nothing waits:
        plain files are stored at close, renamed and removed at once."""
        if self.read_only:
            return
        keys = {target.shard_key for _, _, target in self.new_chunks.get(node.path, {}).values()}
        dataset = node.dataset
        if dataset is None and node.key is not None:
            dataset = await self.dataset_at(node.key)  # (a dataset's root: precomputed chunks live there)
        if dataset is not None:
            keys.update(self.writeback.removing_below(dataset.shard_home))
        await self.writeback.flush_keys(keys)

    #: seconds a closed scratch file (a temporary inside a chunk directory,
    #: never renamed to a chunk's name) is kept: one a killed writer left
    #: (rsync, zarr-python) would otherwise hold memory, and keep its array
    #: from being forgotten (``_forget_quiet_datasets``), until unmount
    SCRATCH_KEEP = 600.0

    def _drop_abandoned_scratch(self) -> None:
        """Discard scratch files closed and untouched for SCRATCH_KEEP (one
        log line for all), at most every tenth of that: run per create, so
        the memory they hold is bounded by what is being written."""
        now = time.time()
        if now - self._scratch_swept_at < self.SCRATCH_KEEP / 10:
            return
        self._scratch_swept_at = now
        old = [b for b in self.buffers.values()
               if b.key is None and b.handles <= 0 and b.readers <= 0 and now - b.mtime_ns / 1e9 >= self.SCRATCH_KEEP]
        for buf in old:
            del self.buffers[buf.path]
        if old:
            log.warning("%s%s: temporary file%s inside a sharded array, closed %d s ago and never renamed; discarded",
                        old[0].path, f" and {len(old) - 1} more" if len(old) > 1 else "",
                        "s" if len(old) > 1 else "", int(self.SCRATCH_KEEP))

    def release_reader(self, handle: Handle) -> None:
        """:meth:`release` of a handle open for reading: synchronous, as
        :meth:`open_reader`.  A reader's chunk, if any, is its private copy
        (4.1); only the readers' registry can hold a reader, and only on a
        writable mount: the common close costs no look-up at all."""
        if self.readers:
            handles = self.readers.get(handle.node.path)
            if handles is not None:
                handles.discard(handle)
                if not handles:
                    del self.readers[handle.node.path]
        if handle.buffer is not None:
            handle.buffer.readers -= 1

    async def release(self, handle: Handle) -> None:
        """The last close of ``handle``.  Must not wait on storage: RELEASE
        has no request deadline (see fuse_ops.release)."""
        if not handle.writable:
            self.release_reader(handle)
            return
        self._not_writer(handle)
        if handle.buffer is not None:
            buf = handle.buffer
            buf.handles -= 1
            if buf.handles <= 0 and not buf.dirty and self.buffers.get(buf.path) is buf:
                del self.buffers[buf.path]
        elif handle.chunk is not None:
            t = handle.node.target
            self.writeback.close_chunk(t.shard_key, t.chunk_id, handle.chunk)
            # bounded: prune once the table has doubled since the last prune
            if self._new_chunks_count > 2 * max(512, self._new_chunks_pruned_at):
                self._prune_new_chunks()

    async def _file_to_change(self, parent: Node, name: str, dir_errno: int) -> Node:
        """The existing file ``name`` that unlink/rename will change."""
        self._check_writable()
        node = await self.lookup(parent, name)
        if node is None:
            raise ViewError(errno.ENOENT, f"{name}: no such file")
        if node.is_dir:
            raise ViewError(dir_errno, f"{name}: is a directory")
        self._check_chunk_writable(node)
        return node

    async def unlink(self, parent: Node, name: str) -> None:
        with self._under_way(join_key(parent.path, name)):
            await self._unlink(parent, name)

    @contextlib.asynccontextmanager
    async def _no_store_of(self, path: str):
        """While held, no store of the file at ``path`` runs or begins (its
        buffer's ``storing``, if it has one): a store a close or a sync
        began is waited for, within the request's deadline, as it may have
        begun after this request and end after it (Unavailable then,
        before the caller changed anything)."""
        while (buf := self.buffers.get(path)) is not None:
            async with held_by_deadline(buf.storing, buf.key or path, "a store of it"):
                if self.buffers.get(path) is buf:  # (else replaced while waiting: that one's)
                    yield
                    return
        yield

    async def _unlink(self, parent: Node, name: str, moving: bool = False) -> None:
        """``moving``: a rename's unlink of its source, whose open handles
        move to the new name (see rename) instead of being detached."""
        node = await self._file_to_change(parent, name, errno.EISDIR)
        if node.is_chunk and not moving:  # (a rename's source: refused before it began, see _rename)
            await self._refuse_removal_if_damaged(node, "an unlink")
        detached, was_dirty = [], False
        async with self._no_store_of(node.path):
            # a store of it lands first, then this delete (else its PUT would
            # bring the file back after it)
            if not moving:
                detached = self._detach_writers(node.path)
            buf = self.buffers.pop(node.path, None)
            if buf is not None:
                # (its bytes go with its name: a close queued to store it stores nothing)
                was_dirty, buf.dirty = buf.dirty, False
        if node.is_chunk:
            await self._keep_for_readers(node)
            t = node.target
            self.writeback.delete(t.shard_key, node.dataset.shard_format, t.shard_ctx, t.chunk_id,
                                  node.dataset.shard_home)
            self._chunk_changed(t)
            self._keep_emptied(parent)
            return
        if buf is not None and (buf.key is None or not (buf.in_store or buf.maybe_stored)):
            return  # scratch, or a new file not stored yet: nothing in storage to remove
        if node.key is not None:
            dir_key = _parent(node.key)
            made_of: list[tuple[str, Dataset]] = []  # the datasets this document describes
            stored = b""
            was_document = False  # (a JSON object: kept as the last document there)
            try:
                if self._is_dataset_document(node.key):
                    stored = await self._stored_document(node.key)
                    made_of = await self._datasets_made_of(node.key, stored) if stored else []
                    was_document = bool(stored) and await off_loop(functools.partial(_json_object, stored),
                                                                   len(stored))
                try:
                    await self.store.delete(node.key)
                except NotFound:
                    if buf is None:
                        raise
            except BaseException as exc:
                self._put_back(node.path, buf, was_dirty, detached, exc)
                raise
            if self._is_dataset_document(node.key):
                # (no await from here on: a lookup in between would find
                # neither the document nor the orphan, and cache that)
                self._document_changed(node.key)
                if made_of:
                    self._orphan(node.key, stored, made_of)
                if was_document:
                    self._keep_previous(node.key, stored)
            self.datasets.pop(dir_key)
            self._keep_emptied(parent)

    #: seconds a directory emptied by this mount on S3 stays without
    #: anything below it (at least; ``metadata_ttl`` if longer)
    EMPTIED_KEEP = 5.0
    #: directories so kept at once (the oldest go first)
    EMPTIED_MAX = 4096

    def _keep_emptied(self, parent: Node) -> None:
        """(S3) ``parent`` just lost a file or a subdirectory: if that was
        its last key, it is gone from storage too, under a tool about to
        rmdir it (``rm -r``, ``find -delete``, ``rm f; rmdir d``).  It stays
        a little while (``emptied``), whether or not it holds more: knowing
        would cost a listing per removal.  Not for ever: then another
        client's removal of what it held would never show.  A chunk or chunk
        directory lost renews the directory its dataset's names are in (a
        chunk directory is found leniently while its dataset is, 4.1): the
        array's directory, whose last shard may have gone with it."""
        if self.store.keeps_empty_dirs:
            return
        path = parent.path
        if self._in_dataset(parent):
            parts = path.split("/")
            path = "/".join(parts[:len(parts) - len(parent.rel)]) if len(parts) > len(parent.rel) else ""
        if path:
            # (its ancestors too: one that held only it is gone from storage
            # as well, and rm -r a/b resolves a again for its last rmdir)
            now = time.monotonic()
            while path:
                self.emptied[path] = now
                self.emptied.move_to_end(path)
                path = _parent(path)
            while len(self.emptied) > self.EMPTIED_MAX:
                self.emptied.popitem(last=False)

    def _made_in(self, path: str) -> None:
        """Something was made in ``path`` (a directory, a file not stored
        yet): directories kept only a moment (``emptied``) become made here."""
        while path and self.emptied.pop(path, None) is not None:
            self._made_dir(_parent(path), path.rsplit("/", 1)[-1], False)
            path = _parent(path)

    def _still_emptied(self, path: str) -> bool:
        """Is ``path`` a directory this mount emptied that is still kept:
        something below it, or below any directory above it, removed within
        ``_emptied_keep``?  (A tree being moved or removed: ``mv`` on S3
        renames each file, then removes the directories left, which ``rm``
        lists and removes one by one; those emptied first must outlast the
        rest of the move.  Kept by its own removals only, one emptied 5 s
        before the end was gone, or listed and then gone, at its rmdir.)"""
        if path not in self.emptied:
            return False
        now, p = time.monotonic(), path
        while p:
            when = self.emptied.get(p)
            if when is not None and now - when < self._emptied_keep:
                return True
            p = _parent(p)
        del self.emptied[path]
        return False

    async def mkdir(self, parent: Node, name: str) -> Node:
        with self._under_way(join_key(parent.path, name)):
            return await self._mkdir(parent, name)

    async def _mkdir(self, parent: Node, name: str) -> Node:
        self._check_writable()
        self._check_name(name)
        parent = await self._fresh(parent)
        if await self.lookup(parent, name) is not None:
            raise ViewError(errno.EEXIST, f"{name}: exists")
        if self._in_dataset(parent) and parent.dataset.outside(parent.rel + (name,)):
            path = join_key(parent.path, name)
            raise self._outside(parent.dataset, path, path)
        if self._in_dataset(parent) and parent.dataset.no_key_part(parent.rel + (name,)):
            raise self._no_key_part(parent.dataset, join_key(parent.path, name))
        dataset, stored = parent.dataset, False
        if not self._in_dataset(parent):
            dataset = await self.dataset_at(parent.key)  # (the array's own directory: its dataset)
            if dataset is not None and dataset.outside((name,)):
                # (``9`` of a ``v2``/``/`` array: its chunk directories begin here)
                path = join_key(parent.path, name)
                raise self._outside(dataset, path, path)
            if dataset is not None and dataset.no_key_part((name,)):
                raise self._no_key_part(dataset, join_key(parent.path, name))
            if dataset is None or not dataset.claims((name,)):
                await self.store.make_dir(join_key(parent.key, name))
                stored = self.store.keeps_empty_dirs
        path = join_key(parent.path, name)
        if path in self.removed_dirs and dataset is not None and dataset.root not in self.born_here:
            # a chunk directory this mount removed, of a stored array: made
            # again, found as before (leniently, Limits), so not remembered
            # as made (that memory would grow with each one, unbounded)
            self.removed_dirs.discard(path)
            if await self.lookup(parent, name) is None:
                self._made_dir(parent.path, name, stored)
        else:
            self._made_dir(parent.path, name, stored)
            self.removed_dirs.discard(path)
        self._made_in(parent.path)
        if dataset is not None and dataset.root in self.born_here:
            self.born_here[dataset.root] = time.monotonic()  # (a copy into it goes on: not quiet)
        node = await self.lookup(parent, name)
        if node is None:  # e.g. a name the dataset claims but that cannot be a directory
            self._forget_made_dirs(parent.path, (name,))
            raise ViewError(errno.EINVAL, f"{name}: cannot be a directory here")
        return node

    #: directories made here that storage holds too, remembered at most (the
    #: least recently made or looked up are forgotten first; storage answers
    #: for them then).  Those storage does not hold (an empty S3 directory, a
    #: chunk directory of an array made here) are not counted, nor forgotten
    NEW_DIRS_MAX = 4096

    def _made_dir(self, parent_path: str, name: str, stored: bool) -> None:
        """Remember the directory ``name`` made in ``parent_path``; ``stored``:
        storage holds it too (see _new_dirs_stored)."""
        self.new_dirs.setdefault(parent_path, set()).add(name)
        path = _prefix(parent_path) + name
        self._made_at[path] = time.time_ns()
        self._made_at.move_to_end(path)
        while len(self._made_at) > self.NEW_DIRS_MAX:
            self._made_at.popitem(last=False)
        if not stored:
            self._new_dirs_stored.pop(path, None)
            return
        self._new_dirs_stored[path] = None
        self._new_dirs_stored.move_to_end(path)
        while len(self._new_dirs_stored) > self.NEW_DIRS_MAX:
            old, _ = self._new_dirs_stored.popitem(last=False)
            made = self.new_dirs.get(_parent(old))
            if made is not None:  # (else forgotten already: a listing, an rmdir)
                made.discard(old.rsplit("/", 1)[-1])
                if not made:
                    del self.new_dirs[_parent(old)]

    def _forget_made_dirs(self, parent_path: str, names) -> None:
        """Forget the directories ``names`` (those made here) of
        ``parent_path``: storage shows them (listed), or they are gone; the
        count that bounds _new_dirs_stored is of those remembered only."""
        made = self.new_dirs.get(parent_path)
        if made is None:
            return
        prefix = _prefix(parent_path)
        for name in names:
            if name in made:
                made.discard(name)
                self._new_dirs_stored.pop(prefix + name, None)
        if not made:
            del self.new_dirs[parent_path]

    def _stored_below(self, key: str) -> None:
        """(S3) A file was stored at ``key`` (a path of the view as well): the
        directories made here above it exist in storage now, and may be
        forgotten (see _made_dir); empty, only memory held them."""
        path = _parent(key)
        while path:
            parent, name = _parent(path), path.rsplit("/", 1)[-1]
            if name in self.new_dirs.get(parent, ()):
                self._made_dir(parent, name, True)
            path = parent

    async def rmdir(self, parent: Node, name: str) -> None:
        with self._under_way(join_key(parent.path, name)):
            await self._rmdir(parent, name)

    async def _rmdir(self, parent: Node, name: str) -> None:
        self._check_writable()
        parent = await self._fresh(parent)
        node = await self.lookup(parent, name)
        if node is None:
            raise ViewError(errno.ENOENT, f"{name}: no such directory")
        if not node.is_dir:
            raise ViewError(errno.ENOTDIR, f"{name}: not a directory")
        if not await self._empty(node):
            raise ViewError(errno.ENOTEMPTY, f"{node.path}: directory not empty")
        if node.key is not None:
            # chunks removed through the view leave their shards to be deleted
            # at the next flush: now, so the stored directory is empty.  The
            # view forgets the directory only after these succeeded, so a
            # failed rmdir leaves it where it was.
            await self._flush_below_first(f"{node.path}: not removed: what was removed below", node.key)
            await self.store.remove_dir(node.key)
            self._forget_orphan(node.key)
            # (a document written in a directory made there again is a new one's)
            for k in list(self._previous_in.get(node.key, ())):
                self._forget_previous(k)
        self._forget_made_dirs(parent.path, (name,))
        self._forget_made_dirs(node.path, list(self.new_dirs.get(node.path, ())))
        self._new_dirs_stored.pop(node.path, None)
        self.emptied.pop(node.path, None)
        self._keep_emptied(parent)
        self.written_dirs.discard(node.path)
        # (a directory made there again is no array the probe found in it)
        self.datasets.pop(node.path)
        if node.key is not None and node.key != node.path:
            self.datasets.pop(node.key)
        if node.dataset is not None:  # (a chunk directory: see _dataset_child)
            if len(self.removed_dirs) > 65536:  # (bounded: forgetting one only lets storage answer)
                self.removed_dirs.clear()
            self.removed_dirs.add(node.path)

    async def _holds_chunks(self, node: Node) -> bool:
        """A chunk file somewhere below ``node`` (plain files do not count),
        or a temporary in a chunk directory: a chunk about to be (tmp+rename
        writers), which only the dataset's chunk directories can hold."""
        async for child in self.listdir(node):
            if child.is_chunk or (child.is_dir and child.dataset is not None and await self._holds_chunks(child)):
                return True
            if child.key is None and not child.is_dir:
                return True  # (scratch, in memory only; a temporary in the dataset's root has a key)
        return False

    async def _empty(self, node: Node) -> bool:
        """No file below ``node``: a directory store's rmdir test.  Chunk
        directories are looked into, since their listings come from storage
        directories that may hold only shards whose chunks were all removed."""
        async for child in self.listdir(node):
            if not child.is_dir or child.dataset is None or not await self._empty(child):
                return False
        return True

    async def rename(self, parent: Node, name: str, new_parent: Node, new_name: str,
                     noreplace: bool = False) -> None:
        """Rename a file (directories: EXDEV, so tools copy instead).  Writes
        through the file's open handles wait while it moves (its bytes are
        copied to the new name first): else one landing between the copy and
        the move of the handles would go to the old name's buffer, and be lost.
        ``noreplace`` (RENAME_NOREPLACE): EEXIST if the new name is taken,
        checked last where the new file takes it (see :meth:`create`)."""
        path = join_key(parent.path, name)
        if path == join_key(new_parent.path, new_name):
            await self._file_to_change(parent, name, errno.EXDEV)  # (it must exist)
            if noreplace:
                raise ViewError(errno.EEXIST, f"{path}: exists")
            return
        self._check_name(new_name)
        with self._under_way(path, join_key(new_parent.path, new_name)):
            while (earlier := self._renaming.get(path)) is not None:
                await waited_within_deadline(earlier, path, "a rename of it")
            done = self._renaming[path] = trio.Event()
            try:
                await self._rename(parent, name, new_parent, new_name, noreplace)
            finally:
                del self._renaming[path]
                done.set()

    # -- renaming a directory (local stores) ---------------------------------

    async def prepare_dir_rename(self, parent: Node, name: str, new_parent: Node, new_name: str,
                                 noreplace: bool = False) -> "DirMove":
        """The checks of a directory's rename, and the flush of what is
        waiting to be stored below it and below the name it takes.  A
        directory is renamed in storage (one rename(2): its array keeps its
        layout, shards and metadata as stored) only where that is all the
        rename changes: a stored directory (not a chunk directory, which is
        virtual), neither place inside a sharded dataset (a precomputed
        volume names its scale directories in its ``info``) nor in a v3-draft
        store (an array is two places there: ``meta/root/<p>.array.json`` and
        ``data/root/<p>``), on a store that renames directories (local; S3
        has no directory to rename), and nothing below it open, held in
        memory only or still to be stored once flushed (see :meth:`_quiet_below`).
        Everything else: EXDEV, and ``mv`` copies, as before.
        :meth:`commit_dir_rename` then renames, on the event loop."""
        self._check_writable()
        node = await self.lookup(parent, name)
        if node is None:
            raise ViewError(errno.ENOENT, f"{name}: no such directory")
        if not node.is_dir:  # (replaced by a file meanwhile, in storage: copied, as any rename across)
            raise ViewError(errno.EXDEV, f"{node.path}: no longer a directory")
        old_path, new_path = node.path, join_key(new_parent.path, new_name)
        if new_path.startswith(old_path + "/"):
            raise ViewError(errno.EINVAL, f"{old_path}: cannot be moved into itself")
        self._check_name(new_name)
        if not self.store.moves_dirs:
            raise ViewError(errno.EXDEV, f"{old_path}: directories are not renamed in this store (copied instead)")
        new_parent = await self._fresh(new_parent)
        if node.key is None or node.dataset is not None or node.link is not None or new_parent.key is None \
                or self._in_dataset(new_parent):
            raise ViewError(errno.EXDEV, f"{old_path} -> {new_path}: a directory of a dataset's namespace")
        new_key = join_key(new_parent.key, new_name)
        for key in (node.key, new_key):
            if _in_draft_store(key) or await self._at_or_below_draft_top(key):
                raise ViewError(errno.EXDEV, f"{key}: inside a v3-draft store (an array is two places there)")
        for key in {*_ancestors(node.key), *_ancestors(new_key)}:
            if await self.dataset_at(key) is not None:
                raise ViewError(errno.EXDEV, f"{key or '/'}: a sharded dataset; its directories are not renamed")
        for key in (node.key, new_key):
            # a directory another directory's document names or describes (a
            # precomputed scale: its volume's ``info``), also unsharded
            dataset = await self.dataset_at(key) if key == node.key else None
            outside = dataset is not None and any(not d.startswith(key + "/") for d, _ in dataset.version)
            if outside or key in await self._dirs_named_near(_parent(key)):
                raise ViewError(errno.EXDEV, f"{key}: named by a document outside it (a precomputed scale)")
        existing = await self.lookup(new_parent, new_name)
        if noreplace and existing is not None:
            raise ViewError(errno.EEXIST, f"{new_path}: exists")
        if existing is not None and not existing.is_dir:
            raise ViewError(errno.ENOTDIR, f"{new_path}: not a directory")
        if existing is not None and (existing.key is None or existing.link is not None):
            raise ViewError(errno.EXDEV, f"{new_path}: not a stored directory")
        move = DirMove(old_path, new_path, node.key, new_key, existing is None, noreplace)
        self._quiet_below(move, flushed=False)
        await self._flush_below_first(f"{old_path} -> {new_path}: not renamed: what was written below", node.key,
                                      new_key)
        return move

    async def _flush_below_first(self, what: str, *keys: str) -> None:
        """Flush the dirty shards below the directories ``keys`` before a
        request that needs them stored (a directory's rename or removal).
        A failure is the request's one line (``what`` could not be stored
        first, and why), not also one of each shard's flush."""
        try:
            with failures_logged_by_caller():
                for key in keys:
                    await self.writeback.flush_below(key)
        except (CorruptData, ViewError, Unavailable):
            raise  # (damage has its own line, 5.2; a deadline is said as such)
        except StoreError as exc:
            err = StoreError(f"{what} could not be stored first (kept in memory, retried): {exc}", exc.key)
            err.errno = exc.errno
            raise err from None

    async def _at_or_below_draft_top(self, key: str) -> bool:
        """Is ``key`` a v3-draft store's ``meta`` or ``data`` (a directory of
        that name holding ``root``), or below one (outside its ``root`` too)?"""
        parts = key.split("/") if key else []
        for i in range(len(parts), 0, -1):
            if parts[i - 1] in ("meta", "data") and await self.store.is_dir(join_key("/".join(parts[:i]), "root")):
                return True
        return False

    def _quiet_below(self, move: "DirMove", flushed: bool = True) -> None:
        """EXDEV (``mv`` then copies) if anything below either place lives
        in memory: a file open or held (a buffer, a scratch file), an open
        handle, a rename under way, a dataset whose document this mount
        removed, a write given up that may still land; and, once
        ``flushed``, a chunk still to be stored (or being stored)."""
        for path, key in ((move.old_path, move.old_key), (move.new_path, move.new_key)):
            below, key_below = path + "/", key + "/"
            busy = (any(p.startswith(below) for p in self.buffers)
                    or any(p.startswith(below) and hs for p, hs in self.writers.items())
                    or any(p.startswith(below) and hs for p, hs in self.readers.items())
                    or any(p.startswith(below) for p in self._renaming)
                    or any(p.startswith(below) for p in self._opening)
                    or any(k == key or k.startswith(key_below) for k in self.orphans)
                    or (flushed and any(k.startswith(key_below) for k in self.writeback.dirty))
                    or self.store.landing_below(key))  # (a late write would make the old place again)
            if busy:
                raise ViewError(errno.EXDEV, f"{path}: something below it is open or not stored yet; not renamed "
                                             "(copied instead)")

    def commit_dir_rename(self, move: "DirMove") -> None:
        """The rename itself, after :meth:`prepare_dir_rename`: synchronous
        (no other request runs between the last check and the rename), then
        every memory of both places is dropped: storage answers for them."""
        self._check_writable()
        self._quiet_below(move)
        if move.noreplace and move.new_path in self.buffers:
            # a file made at the free name meanwhile, in memory only (storage's
            # RENAME_NOREPLACE cannot see it)
            raise ViewError(errno.EEXIST if move.asked else errno.ENOTDIR, f"{move.new_path}: a file now")
        try:
            # RENAME_NOREPLACE only where the client asked it: else an empty
            # directory another process made at the free name meanwhile is
            # replaced (a file there: ENOTDIR), as rename(2) does
            self.store.move_dir_now(move.old_key, move.new_key, noreplace=move.asked)
        except StoreError as exc:
            if exc.errno in (errno.ENOTEMPTY, errno.EEXIST, errno.EINVAL, errno.ENOTDIR, errno.EISDIR, errno.EXDEV,
                             errno.EBUSY):
                raise ViewError(exc.errno, str(exc)) from None  # (an answer, not a failure: no error line)
            raise
        self._forget_below(move.new_path, move.new_key)
        self._carry_made_here(move)
        self._forget_below(move.old_path, move.old_key)
        self._made_in(_parent(move.new_path))

    def _carry_made_here(self, move: "DirMove") -> None:
        """What this mount knows of datasets it made below the old place
        (made here: chunk directories exist once made or written to, as in a
        directory store) holds for the new place: ``ls`` shows the same."""
        def moved(p: str, old: str, new: str) -> str | None:
            return new + p[len(old):] if p == old or p.startswith(old + "/") else None

        op, np_, ok, nk = move.old_path, move.new_path, move.old_key, move.new_key
        for root, when in list(self.born_here.items()):
            if (to := moved(root, ok, nk)) is not None:
                self.born_here[to] = when
        for table in ("written_dirs", "removed_dirs"):
            old = getattr(self, table)
            old |= {to for p in old if (to := moved(p, op, np_)) is not None}
        for d, names in list(self.new_dirs.items()):
            if (to := moved(d, op, np_)) is not None:
                self.new_dirs[to] = set(names)
        for p, when in list(self._made_at.items()):
            if (to := moved(p, op, np_)) is not None:
                self._made_at[to] = when

    def _forget_below(self, path: str, key: str) -> None:
        below, key_below = path + "/", key + "/"

        def at(p: str) -> bool:
            return p == path or p.startswith(below)

        def at_key(k) -> bool:
            return isinstance(k, str) and (k == key or k.startswith(key_below))

        for k in [k for k in self.datasets._d if at_key(k)]:
            self.datasets.pop(k)
        for k in [k for k in self.documents._d if at_key(k[0])]:
            self.documents.pop(k)
        for table in (self.ctx.probed, self.ctx.probed_small):
            for k in [k for k in table if at_key(k[1])]:
                del table[k]
        # (loads under way too: one landing after the rename would be kept
        # under the old key, and used by whatever is made there next)
        self.shards.forget_where(lambda k: at_key(k if isinstance(k, str) else k[0]))
        self.shards.chunks.pop_where(lambda k: at_key(k if isinstance(k, str) else k[0]))
        for table in (self.shards._unread, self.shards._positions, self.shards._ahead):
            for k in [k for k in table if at_key(k)]:
                del table[k]
        self.new_chunks = {d: n for d, n in self.new_chunks.items() if not at(d)}
        self._prune_new_chunks()
        name = path.rpartition("/")[2]
        self.new_dirs.get(_parent(path), set()).discard(name)
        for table in (self.new_dirs, self._new_dirs_stored, self._made_at, self.emptied, self.writers,
                      self.readers, self._fresh_nodes):
            for p in [p for p in table if at(p)]:
                del table[p]
        self.written_dirs = {p for p in self.written_dirs if not at(p)}
        self.removed_dirs = {p for p in self.removed_dirs if not at(p)}
        for table in (self.born_here, self.own_versions, self.orphans, self.removed_documents, self._info_dirs_kept):
            for k in [k for k in table if at_key(k)]:
                del table[k]
        for k in [k for k in self.previous_documents if at_key(k)]:
            self._forget_previous(k)
        for k in [k for k in self._chunk_changes if at_key(k[0])]:
            del self._chunk_changes[k]
        self._chunk_epoch += 1
        # nodes made before now may name a dataset or a key that moved: looked up again by path (_fresh)
        self.document_writes += 1
        self._documents_changed_at = time.monotonic()
        self._fresh_nodes.clear()
        self._listed_slices.clear()
        self._listed_count = 0

    async def dir_renamed(self, move: "DirMove") -> None:
        """The rename made durable (its two parent directories fsynced)."""
        await self.store.sync_dirs(_parent(move.old_key), _parent(move.new_key))

    async def _while_renamed(self, handle: Handle) -> None:
        """Wait while the file ``handle`` writes is being renamed (see rename)."""
        while (renaming := self._renaming.get(handle.node.path)) is not None:
            await waited_within_deadline(renaming, handle.node.path, "a rename of it")

    async def _refuse_removal_if_damaged(self, node: Node, what: str) -> None:
        t = node.target
        linked = getattr(node.dataset.shard_format, "deleted_with", None)
        await self.writeback.refuse_if_damaged(t.shard_key, node.dataset.shard_format, t.shard_ctx,
                                               linked(t.chunk_id) if linked else (t.chunk_id,),
                                               f"{what} of {node.path}")

    async def _rename(self, parent: Node, name: str, new_parent: Node, new_name: str,
                      noreplace: bool = False) -> None:
        node = await self._file_to_change(parent, name, errno.EXDEV)
        if node.is_chunk:  # (its removal would be kept for ever: refused before the new name is written)
            await self._refuse_removal_if_damaged(node, "a rename")
        if node.link is not None:
            await self._rename_link(node, new_parent, new_name, noreplace)
            return
        buf = self.buffers.get(node.path)
        data = bytes(buf.data) if buf is not None else (
            await self.content(node) if node.is_chunk else await self._stored_bytes(node, recent_ok=True))
        existing = await self.lookup(new_parent, new_name)
        if noreplace and existing is not None:
            raise ViewError(errno.EEXIST, f"{join_key(new_parent.path, new_name)}: exists")
        if existing is not None and existing.is_dir:
            raise ViewError(errno.EISDIR, f"{new_name}: is a directory")
        # room first: a rename refused for it must leave the target as it was
        await self.writeback.wait_for_room()
        if existing is not None:
            async with self._no_store_of(existing.path):
                pass  # (a store of the target out: waited for before anything changes)
        detached: list = []  # the target's writers moved to the old file (put back if this fails)
        try:
            if existing is not None and existing.is_chunk:
                detached = self._detach_writers(existing.path)
                await self._keep_for_readers(existing)
            replaced = self.buffers.get(existing.path) if existing is not None else None
            was_dirty = False
            handle = await self.create(new_parent, new_name, exclusive=noreplace)
        except BaseException:
            self._reattach_writers(detached)
            raise
        try:
            if replaced is not None and replaced.storing.locked():
                # a store of the file this one replaces began meanwhile (a
                # sync, while the new file was made): its PUT lands first,
                # then this one (both out at once, the older could land last
                # and bring back the bytes this rename replaced).  Waited for
                # once the new buffer holds the name, so opens meanwhile
                # share the new file, not the old one
                async with held_by_deadline(replaced.storing, replaced.key or replaced.path, "a store of it"):
                    pass
            if existing is not None and not existing.is_chunk:
                # its writers go on with the old file only now, after every
                # wait: a rename given up at its deadline changes nothing
                # (the old buffer is put back below, its writers still on it)
                detached = self._detach_writers(existing.path, keep=handle)
                if replaced is not None:
                    was_dirty, replaced.dirty = replaced.dirty, False  # (a close queued to store it stores nothing)
            if existing is not None and not existing.is_chunk and handle.buffer is not None:
                # the name holds a file already, perhaps stored: the new one is no
                # new file, and its unlink must remove what storage holds there
                handle.buffer.in_store = replaced is None or replaced.in_store or replaced.maybe_stored
            if existing is None and handle.buffer is not None and node.key is not None and not node.is_chunk \
                    and (buf is None or buf.in_store):
                # a stored file moved to a free name: its copy there is that
                # file (its mode and owner), as rename(2) keeps them
                handle.buffer.like = node.key
            if handle.buffer is not None and buf is None and node.key is not None and not node.is_chunk \
                    and self._is_dataset_document(node.key) and self._is_dataset_document(handle.buffer.key):
                handle.buffer.view_form = await self._shown_form(node.key, data)
            # (not held while its new name is itself being renamed: the
            # renames of a->b and b->a at once would wait for each other)
            await self.write(handle, 0, data, held_by_renames=False)
            if handle.buffer is not None and handle.buffer.key is not None and node.key is not None \
                    and (buf is None or buf.in_store):
                # a stored file renamed: stored under its new name before the
                # old one goes, whatever the new name (a zarr.json renamed to
                # zarr.json~ must never be in memory only)
                await self._store_buffer(handle.buffer)
            else:
                await self.flush(handle, held_by_renames=False)
        except BaseException as exc:
            # a rename that fails changes nothing: the new name holds what it
            # held (unless the new bytes may have been stored there after all),
            # and its writers write on to it
            made = handle.buffer
            if made is not None and not made.maybe_stored and self.buffers.get(made.path) in (made, None):
                if replaced is not None:
                    self.buffers[made.path] = replaced
                    replaced.dirty = replaced.dirty or was_dirty
                else:
                    self.buffers.pop(made.path, None)
                self._reattach_writers(detached)
            elif made is None:  # (a chunk: the name's buffer is its shard's, see _reattach_writers)
                self._reattach_writers(detached)
            if isinstance(exc, (DirectoryAtKey, DirectoryInTheWay)):
                # a directory made at the new name since the lookup (another
                # process): rename(2)'s answer, not a missing name
                raise ViewError(errno.EISDIR, f"{join_key(new_parent.path, new_name)}: is a directory") from None
            raise
        finally:
            await self.release(handle)
        if buf is not None and buf.key is None:
            self.buffers.pop(node.path, None)  # scratch: nothing stored to remove
        else:
            await self._unlink(parent, name, moving=True)
        await self._move_writers(node.path, new_parent, new_name)

    async def _rename_link(self, node: Node, new_parent: Node, new_name: str, noreplace: bool = False) -> None:
        """rename(2) of a symbolic link: the link itself moves (renameat),
        replacing a file at the new name; never what it names."""
        new_parent = await self._fresh(new_parent)
        new_key = await self._link_key(new_parent, new_name, node.link)
        existing = await self.lookup(new_parent, new_name)
        if noreplace and (existing is not None or join_key(new_parent.path, new_name) in self.buffers):
            raise ViewError(errno.EEXIST, f"{join_key(new_parent.path, new_name)}: exists")
        if existing is not None and existing.is_dir:
            raise ViewError(errno.EISDIR, f"{new_name}: is a directory")
        detached, buf, was_dirty = [], None, False
        if existing is not None:
            async with self._no_store_of(existing.path):  # (its PUT lands first, then the link replaces it)
                detached = self._detach_writers(existing.path)
                buf = self.buffers.pop(existing.path, None)
                if buf is not None:
                    # (replaced: a close queued to store it stores nothing)
                    was_dirty, buf.dirty = buf.dirty, False
        try:
            # (noreplace: in storage too, where another process may have taken the name since the lookup)
            await self.store.move_link(node.key, new_key, noreplace=noreplace)
        except BaseException as exc:
            if existing is not None:
                self._put_back(existing.path, buf, was_dirty, detached, exc)
            if isinstance(exc, StoreError) and exc.errno in (errno.EXDEV, errno.EEXIST, errno.EISDIR):
                # (another file system mounted inside the store: an answer, mv copies the link; the
                # name taken meanwhile, RENAME_NOREPLACE; a directory made there since the lookup)
                raise ViewError(exc.errno, str(exc)) from None
            raise

    async def _link_key(self, parent: Node, name: str, target: str | None) -> str:
        """The store key a symbolic link named ``name`` in ``parent``, holding
        ``target``, is made at: only where the view passes names through
        (EPERM in a sharded array's chunk namespace and at a metadata
        document's name, which the view derives; and where the store has no
        links: S3, or every link followed by -o follow_symlinks), and only if
        the view would show it (EPERM for one leading out of the mount)."""
        if not self.store.symlinks:
            raise ViewError(errno.EPERM, f"{name}: this mount shows no symbolic links (an S3 store has none; "
                                         "-o follow_symlinks follows them)")
        if self._in_dataset(parent):
            raise ViewError(errno.EPERM, f"{join_key(parent.path, name)}: no symbolic links in a chunk namespace")
        key = join_key(parent.key, name)
        if self._derived(await self.dataset_at(parent.key), name, key):
            raise ViewError(errno.EPERM, f"{join_key(parent.path, name)}: a name the view derives; no symbolic link")
        if target is not None and not _stays_in_view(parent.path, target):
            raise ViewError(errno.EPERM, f"{join_key(parent.path, name)} -> {target!r}: a symbolic link there would "
                                         "lead out of the mount (absolute, climbing above its root, or '..' after "
                                         "a name)")
        return key

    async def symlink(self, parent: Node, name: str, target: str) -> Node:
        """symlink(2): a link holding ``target`` as given (the client's
        kernel resolves it), made only where names pass through and only if
        it stays in the view (see :func:`_stays_in_view`)."""
        with self._under_way(join_key(parent.path, name)):
            return await self._symlink(parent, name, target)

    async def _symlink(self, parent: Node, name: str, target: str) -> Node:
        self._check_writable()
        self._check_name(name)
        parent = await self._fresh(parent)
        key = await self._link_key(parent, name, target)
        if await self.lookup(parent, name) is not None:
            raise ViewError(errno.EEXIST, f"{name}: exists")
        info = await self.store.symlink(key, target)
        self._made_in(parent.path)
        return self._link_node(join_key(parent.path, name), info)

    async def link(self, node: Node, new_parent: Node, new_name: str) -> Node:
        """A hard link, made as a copy: a new file ``new_name`` holding the
        bytes ``node`` holds now; EEXIST if the name is taken.  The view's
        files cannot have two names (a chunk is a slot in a shard), but the
        pattern that links is write-once: zarr-python's exclusive create
        writes a temporary, links it to the name (failing if it exists) and
        unlinks the temporary.  Links are made one at a time, so two made
        at once cannot both find the name free."""
        with self._under_way(node.path, join_key(new_parent.path, new_name)):
            return await self._link(node, new_parent, new_name)

    async def _link(self, node: Node, new_parent: Node, new_name: str) -> Node:
        self._check_writable()
        self._check_name(new_name)
        if node.is_dir:
            raise ViewError(errno.EPERM, f"{node.path}: a directory cannot be linked")
        if node.link is not None:  # (a copy of a symbolic link: another link of the same text)
            return await self.symlink(new_parent, new_name, node.link)
        async with self._linking:
            if await self.lookup(new_parent, new_name) is not None:
                raise ViewError(errno.EEXIST, f"{new_name}: exists")
            self._check_size(node, node.size)  # (the copy is held whole, as any file written)
            buf = self.buffers.get(node.path)
            # the bytes the view shows: a rewritten document as rewritten
            # (unlike a rename, whose copy keeps the stored form), so that
            # ``cp -al`` of an array makes the array it shows
            data = bytes(buf.data) if buf is not None else await self.content(node) if node.is_chunk else \
                node.document if node.document is not None else await self._stored_bytes(node, recent_ok=True)
            await self.writeback.wait_for_room()
            handle = await self.create(new_parent, new_name)
            try:
                await self.write(handle, 0, data, held_by_renames=False)
                await self.flush(handle, held_by_renames=False)
            finally:
                await self.release(handle)
            made = await self.lookup(new_parent, new_name)
        if made is None:
            raise ViewError(errno.ENOENT, f"{new_name}: gone as soon as linked")
        return made

    def _detach_writers(self, path: str, keep: Handle | None = None) -> list[tuple[Handle, object, object]]:
        """Handles still open for writing on a file that is being unlinked or
        replaced by a rename write to that old file from now on, as on POSIX:
        what they write afterwards is lost with it, and never overwrites or
        brings back the name.  ``keep``: a handle of the new file at the name
        (a rename detaches the old one's writers once its new file holds the
        name), which stays, with the handles sharing its file.  Returns what
        it did, (handle, its file before, the old file's copy) each, for
        :meth:`_reattach_writers` to undo if the change then fails."""
        handles = self.writers.pop(path, ())
        if keep is not None:
            stay = {h for h in handles if h is keep or (keep.buffer is not None and h.buffer is keep.buffer)}
            if stay:
                self.writers[path] = stay
            handles = [h for h in handles if h not in stay]
        # handles that shared one file go on sharing one (the old file)
        old_files: dict[int, tuple[object, FileBuffer | DirtyChunk]] = {}  # id of the shared -> it, its copy
        done = []
        for h in handles:
            if h.buffer is not None:
                shared = h.buffer
                shared.handles -= 1
                h.buffer = old_files.setdefault(id(shared), (shared, FileBuffer(
                    shared.path, None, bytearray(shared.data), handles=0)))[1]
                h.buffer.handles += 1
                done.append((h, shared, h.buffer))
            elif h.chunk is not None:
                t, shared = h.node.target, h.chunk
                self.writeback.close_chunk(t.shard_key, t.chunk_id, shared)
                h.chunk = old_files.setdefault(id(shared), (shared, DirtyChunk(bytearray(shared.data or b""), 0)))[1]
                done.append((h, shared, h.chunk))
        return done

    def _put_back(self, path: str, buf: FileBuffer | None, was_dirty: bool,
                  detached: list[tuple[Handle, object, object]], exc: BaseException) -> None:
        """An unlink or a rename onto ``path`` that failed changes nothing: the
        file keeps its name, its unstored bytes (``buf``, taken off the name
        with its dirty state ``was_dirty``) and its writers (``detached``) --
        unless the request was given up at its deadline (Unavailable) and may
        land after all, or the name holds another file meanwhile."""
        if buf is not None and not isinstance(exc, Unavailable) and path not in self.buffers:
            self.buffers[path] = buf
            buf.dirty = buf.dirty or was_dirty
            self._reattach_writers(detached)

    def _reattach_writers(self, detached: list[tuple[Handle, object, object]]) -> None:
        """Undo :meth:`_detach_writers` (the unlink or rename failed, so the
        file is still the one at its name): its handles write to it again,
        with what they wrote meanwhile to the old file.  A plain
        file's buffer must be the name's again (the caller puts it back); a
        chunk's is its shard's pending chunk, opened again (a failed
        rename's create may have emptied it: it gets the old file's bytes)."""
        for h, shared, old in detached:
            if h.buffer is old:
                old.handles -= 1
                h.buffer = shared
                shared.handles += 1
                if old.version and shared.data != old.data:  # (written meanwhile)
                    shared.data[:] = old.data
                    shared.changed()
            elif h.chunk is old:
                t, dataset = h.node.target, h.node.dataset
                chunk = self.writeback.open_chunk(t.shard_key, dataset.shard_format, t.shard_ctx, t.chunk_id,
                                                  bytes(old.data), t.capacity, dataset.shard_home)
                if chunk.data != old.data:
                    chunk.data[:] = old.data
                    self.writeback.changed(t.shard_key, chunk)
                    self._chunk_changed(t)
                h.chunk = chunk
            else:
                continue  # (moved on since: not the detached one's)
            self._writer(h)

    async def _move_writers(self, path: str, new_parent: Node, new_name: str) -> None:
        """Handles still open for writing on a renamed file write to its new
        name from now on, as on POSIX, where the open file is what moved.
        (Python's ``with open(tmp) as f: ...; os.replace(tmp, final)`` writes
        its buffered bytes only after the rename.)"""
        handles = self.writers.pop(path, ())
        if not handles:
            return
        node = await self.lookup(new_parent, new_name) or await self._stored_as_is_node(new_parent, new_name)
        if node is None:  # (a name just written: not expected; never a crash if it happens)
            self.writers[path] = set(handles)
            self._detach_writers(path)
            return
        for h in handles:
            moved = await self.open(node, write=True, truncate=False)
            self._not_writer(moved)
            if h.buffer is not None:
                h.buffer.handles -= 1  # the old name's buffer: removed by the rename
            elif h.chunk is not None:
                t = h.node.target
                self.writeback.close_chunk(t.shard_key, t.chunk_id, h.chunk)
            h.node, h.buffer, h.chunk = moved.node, moved.buffer, moved.chunk
            self._writer(h)

    async def _stored_as_is_node(self, parent: Node, name: str) -> Node | None:
        """A shard written as is (a name the view hides: not looked up, not
        listed), as a plain stored file: what a handle renamed onto it (as
        tensorstore renames each shard into place while still open) goes on
        writing to."""
        parent = await self._fresh(parent)
        dataset, rel = (parent.dataset, parent.rel + (name,)) if self._in_dataset(parent) else (
            await self.dataset_at(parent.key), (name,))
        key = dataset.stored_as_is(rel) if dataset is not None else None
        if key is None:
            return None
        info = await self.store.stat(key)
        return await self._stored_file(join_key(parent.path, name), info) if info is not None else None

    async def sync(self, refused: list[ViewError] | None = None, final: bool = False) -> list[StoreError]:
        """Store everything that is only in memory (sync, unmount, SIGTERM).
        Documents refused for good (logged; their buffers are gone, so no
        later round retries them) are added to ``refused``, if given.
        ``final`` (unmount, SIGTERM): temporary files inside sharded arrays
        that were closed but never renamed to a chunk's name are discarded;
        a ``zshardfs sync`` keeps them (zarr-python renames its temporary
        right after closing it: a sync in between must not lose the chunk)."""
        errors, discarded = [], []
        for buf in list(self.buffers.values()):
            if buf.dirty and buf.key is not None:
                try:
                    await self._store_buffer(buf)
                except ViewError as exc:
                    if refused is not None:
                        refused.append(exc)
                except StoreError as exc:
                    errors.append(exc)
                except Exception as exc:  # a bug must not keep the shards below from being stored
                    log.exception("storing %s failed", buf.key)
                    errors.append(StoreError(f"{buf.key}: {type(exc).__name__}: {exc}", buf.key))
            elif buf.key is None and buf.handles <= 0 and final:
                discarded.append(buf.path)
                del self.buffers[buf.path]
        if discarded:  # (one line for all: a cp -r to a name that is no chunk's makes many)
            log.warning("%s%s: temporary file%s inside a sharded array never renamed; discarded", discarded[0],
                        f" and {len(discarded) - 1} more" if len(discarded) > 1 else "",
                        "s" if len(discarded) > 1 else "")
        errors += await self.writeback.sync_all()
        self._prune_new_chunks()
        return errors

    def _prune_new_chunks(self) -> None:
        """Forget created chunk names that storage now lists by itself."""
        self.new_chunks = {d: {n: c for n, c in names.items()
                               if self.writeback.pending(c[2].shard_key, c[2].chunk_id) is not None}
                           for d, names in self.new_chunks.items()}
        self.new_chunks = {d: names for d, names in self.new_chunks.items() if names}
        self._new_chunks_pruned_at = self._new_chunks_count = sum(len(n) for n in self.new_chunks.values())
        self._new_chunk_dirs = {}
        for d in self.new_chunks:
            self._index_new_chunk_dir(d)
        self._forget_quiet_datasets()

    #: seconds a dataset made through this mount must go unwritten (with
    #: nothing of it left to store) before it is treated as any stored one:
    #: a copy into it (``cp -r``, which makes each chunk directory after
    #: writing others) is over by then
    BORN_HERE_QUIET = 60.0

    def _forget_quiet_datasets(self) -> None:
        """Datasets made here that have been quiet long enough become like
        any other: their chunk directories exist where the grid has them, and
        the directories this mount made or wrote there are forgotten.  (Else
        a mount writing new arrays for weeks kept every such directory.)"""
        now = time.monotonic()
        quiet = [root for root, when in self.born_here.items() if now - when >= self.BORN_HERE_QUIET]
        if not quiet:
            return
        busy = {*self.new_chunks, *self.writeback.dirty, *self.buffers}
        for root in quiet:
            below = _prefix(root)
            if any(k.startswith(below) for k in busy):
                continue
            del self.born_here[root]
            self.written_dirs = {p for p in self.written_dirs if not p.startswith(below)}
            self.removed_dirs = {p for p in self.removed_dirs if not p.startswith(below)}
            for d in [d for d in self.new_dirs if d.startswith(below)]:
                self._forget_made_dirs(d, list(self.new_dirs[d]))
