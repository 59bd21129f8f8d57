"""The storage contract every backend (local directory, S3) fulfils.

Backends are *synchronous* classes: they are simple to write and to test, and
boto3 is synchronous anyway.  The daemon never calls them on the trio loop;
it goes through :class:`AsyncStore`, which runs each call in a worker thread
under a capacity limiter and a deadline, and keeps the request counters.

Keys are '/'-separated, relative to the store root, never start or end with
'/'.  The root directory is the empty key ''.

Versioning: every object has an opaque ``etag`` that changes whenever its
content changes.  Reads can be pinned to a version (``if_match``) and writes
can be conditional (``if_match`` / ``if_none_match``), which is what lets the
shard layer never mix bytes of two versions and never lose a concurrent
writer's chunks.
"""

from __future__ import annotations

import bisect
import contextlib
import contextvars
import errno
import logging
import math
import threading
import time
from collections import Counter, OrderedDict
from dataclasses import dataclass
from typing import Callable, Protocol, TypeVar

import trio

from ..singleflight import SingleFlight

log = logging.getLogger(__name__)

T = TypeVar("T")

#: reads up to this size may be served on the event loop when they cannot block
NOWAIT_MAX = 1 << 20

#: when (``time.monotonic()``) the kernel request being served must be
#: answered: every storage call it makes ends by then, whatever the calls
#: before it took (see AsyncStore.request_deadline); inf outside requests.
#: Kept in monotonic time, not trio's: every kernel request sets it, most
#: never reach storage, and ``trio.current_time()`` is four Python calls
#: (see :func:`request_deadline_now`, which converts it where it is used)
_request_deadline: contextvars.ContextVar[float] = contextvars.ContextVar("zshardfs_request_deadline",
                                                                           default=math.inf)


#: when (``time.monotonic()``) the storage call a worker thread runs is
#: given up by :meth:`AsyncStore._run` (its deadline, or the request's, or
#: an enclosing cancel scope's: read-ahead's); inf outside such calls.  Set
#: in the worker thread's own context (see :func:`call_deadline`)
_call_deadline: contextvars.ContextVar[float] = contextvars.ContextVar("zshardfs_call_deadline", default=math.inf)


def call_deadline() -> float:
    """In a backend's worker thread: when (``time.monotonic()``) nobody
    waits for the call it runs any longer.  A backend that retries (S3)
    begins no attempt after it: the call was given up, and its thread
    would otherwise go on asking a dead endpoint for the time of all its
    attempts."""
    return _call_deadline.get()


def request_deadline_now() -> float:
    """The request's deadline in ``trio.current_time()`` terms (inf if none):
    trio's clock is the monotonic clock plus an offset."""
    deadline = _request_deadline.get()
    return deadline if deadline == math.inf else deadline - time.monotonic() + trio.current_time()


@contextlib.asynccontextmanager
async def held_by_deadline(lock: trio.Lock, key: str, what: str):
    """``lock``, waited for no longer than the request's deadline: work a
    request waits for (the background flusher's flush of the same shard)
    has a deadline per call, not the request's.  Unavailable (EIO) at it."""
    with trio.move_on_at(request_deadline_now()) as waited:
        await lock.acquire()  # (cancelled: not acquired)
    if waited.cancelled_caught:
        raise Unavailable(f"{key}: {what} still running at the request's deadline", key)
    try:
        yield
    finally:
        lock.release()


def request_deadline_at() -> float:
    """When (``trio.current_time()``) the request being served must be
    answered; inf outside requests."""
    return request_deadline_now()


async def pause_within_deadline(seconds: float, key: str, what: str) -> None:
    """``trio.sleep(seconds)`` (a backoff before trying again), unless the
    request's deadline comes first: then Unavailable (EIO) at once, as the
    try that would follow the pause could not be sent anyway."""
    if trio.current_time() + seconds >= request_deadline_now():
        raise Unavailable(f"{key}: {what}; the request's deadline comes before the next try", key)
    await trio.sleep(seconds)


async def shared_within_deadline(flight: SingleFlight, key, name: str) -> bool:
    """``flight.wait(key)``: another request's load of the same thing (a
    listing, a shard index, a chunk), waited for no longer than this
    request's deadline, since that request may have begun later and its
    load end after it.  Unavailable (EIO) at it; the load goes on."""
    waited = await flight.wait(key, request_deadline_now())
    if waited is None:
        raise Unavailable(f"{name}: another request's load of it still running at the request's deadline", name)
    return waited


async def waited_within_deadline(event: trio.Event, key: str, what: str) -> None:
    """``event.wait()`` for work another request began (which may have
    begun after this one, and end after its deadline), no longer than the
    request's deadline.  Unavailable (EIO) at it."""
    with trio.move_on_at(request_deadline_now()):
        await event.wait()
        return
    raise Unavailable(f"{key}: {what} still running at the request's deadline", key)


class _RequestDocuments:
    """With ``metadata_ttl=0`` (nothing kept for later requests), the
    metadata documents each kernel request has read or found missing, by
    request: one request asks for a document once, however many of its
    probes want it (a probe at depth d asks for the ``info`` of d + 1
    directories, and the lookup's next probe, or the listing's next
    directory's, for the same ones again).  Every read is made after the
    request began, so the answer is as fresh as "ask storage each time"
    promises.  A request is known by its deadline (the value every call it
    makes shares; a nested one keeps the earlier); none outside requests.
    Bounded: the most recent REQUESTS requests, BYTES of documents, each
    dropped at its deadline."""

    REQUESTS = 64
    BYTES = 16 << 20

    def __init__(self) -> None:
        self._by_request: OrderedDict[float, list] = OrderedDict()  # deadline -> [{key: (blob, generation)}, bytes]
        self._bytes = 0

    def __len__(self) -> int:
        return len(self._by_request)

    def get(self, key: str) -> tuple[Blob | None, int] | None:
        kept = self._by_request.get(_request_deadline.get())
        return None if kept is None else kept[0].get(key)

    def put(self, key: str, blob: Blob | None, generation: int, max_size: int) -> None:
        deadline = _request_deadline.get()
        size = 0 if blob is None else len(blob.data)
        if deadline == math.inf or size > max_size:
            return
        kept = self._by_request.get(deadline)
        if kept is None:
            now = time.monotonic()
            while self._by_request and (len(self._by_request) >= self.REQUESTS
                                        or next(iter(self._by_request)) <= now):
                self._bytes -= self._by_request.popitem(last=False)[1][1]
            kept = self._by_request[deadline] = [{}, 0]
        old = kept[0].get(key)
        grown = size - (0 if old is None or old[0] is None else len(old[0].data))
        kept[0][key] = (blob, generation)
        kept[1] += grown
        self._bytes += grown
        while self._bytes > self.BYTES and self._by_request:
            self._bytes -= self._by_request.popitem(last=False)[1][1]


#: ``end_request(token)``: the end of the request
#: :meth:`AsyncStore.begin_request` began (the C method itself: every kernel
#: request calls it, and a Python function around it would double its cost)
end_request = _request_deadline.reset


@contextlib.contextmanager
def no_request_deadline():
    """Work nobody's request waits for (read-ahead, a sync of everything):
    its calls get the store's deadline each, not a request's."""
    token = _request_deadline.set(math.inf)
    try:
        yield
    finally:
        _request_deadline.reset(token)


# --------------------------------------------------------------------------
# errors


class StoreError(Exception):
    """A storage failure, carrying the errno the file system should report."""

    errno = errno.EIO

    def __init__(self, message: str, key: str | None = None):
        super().__init__(message)
        self.key = key


class NotFound(StoreError):
    errno = errno.ENOENT


class DirectoryAtKey(NotFound):
    """A put whose key is a directory in storage (made by another process):
    a missing name to every caller, as any NotFound (a flush, a write-back),
    but a file's rename through the view answers it EISDIR, as rename(2)."""


class PreconditionFailed(StoreError):
    """The object is not at the version the caller pinned (or exists when
    ``if_none_match`` said it must not)."""

    errno = errno.EAGAIN


class AccessDenied(StoreError):
    errno = errno.EACCES


class Unavailable(StoreError):
    """Endpoint unreachable, timed out, or answering with server errors."""

    errno = errno.EIO


class TooLarge(StoreError):
    """A whole-object read (a metadata document) of an object larger than
    the caller allows: refused before its bytes are read."""

    errno = errno.EFBIG

    def __init__(self, message: str, key: str | None = None, size: int = 0):
        super().__init__(message, key)
        self.size = size


class CorruptData(StoreError):
    """Stored bytes that cannot be what they claim (bad index, checksum...)."""

    errno = errno.EIO


class Unstorable(StoreError):
    """Bytes written through the view that their format cannot store as they
    are (a mesh's manifest and fragment data that disagree): nothing stored is
    damaged, so it is not logged as damage; the flush fails with EIO and keeps
    the writes, for the writer to mend."""

    errno = errno.EIO


# --------------------------------------------------------------------------
# values


@dataclass(frozen=True)
class ObjectInfo:
    key: str
    size: int
    etag: str
    mtime_ns: int  # nanoseconds since the epoch (the stored file's st_mtime_ns, exactly)
    #: a symbolic link's target: the object is the link itself (``size`` is
    #: the target's length in bytes), which the view shows as a link
    link: str | None = None


@dataclass(frozen=True)
class Blob:
    """Bytes read from one object, with the version they came from."""

    data: bytes
    info: ObjectInfo


@dataclass(frozen=True)
class Listing:
    """One level of a '/'-delimited listing."""

    dirs: list[str]  # immediate sub-"directory" names (common prefixes)
    files: list[ObjectInfo]  # immediate objects, ``key`` is the full key
    #: keys this mount stored since the listing was made, whose entries are
    #: what the write answered, not what a listing or HEAD would (on S3 the
    #: mtime differs): they prove a name exists, their attributes are asked for
    unconfirmed: frozenset = frozenset()
    #: every entry that is a symbolic link, as the link itself (``link`` set),
    #: whatever it names; ``dirs`` and ``files`` show the links that stay
    #: inside the store as what they name, for the names the view derives
    #: (backends that have links and show them: local, not -o follow_symlinks)
    links: tuple[ObjectInfo, ...] = ()

    def file(self, key: str) -> ObjectInfo | None:
        """The entry of the object ``key`` (a full key), if listed."""
        by_key = self.__dict__.get("_by_key")
        if by_key is None:  # built on first use: most listings are only walked
            by_key = {info.key: info for info in self.files}
            object.__setattr__(self, "_by_key", by_key)
        return by_key.get(key)

    def link(self, key: str) -> ObjectInfo | None:
        """The symbolic link at ``key`` (a full key), if listed."""
        if not self.links:
            return None
        by_key = self.__dict__.get("_links_by_key")
        if by_key is None:
            by_key = {info.key: info for info in self.links}
            object.__setattr__(self, "_links_by_key", by_key)
        return by_key.get(key)

    def without(self, key: str) -> tuple[ObjectInfo, ...]:
        """``links`` without the one at ``key`` (a write replaced or removed it)."""
        return tuple(info for info in self.links if info.key != key) if self.links else ()


class Backend(Protocol):
    """Synchronous storage primitives.  Implementations must be thread-safe."""

    #: short description for logs ("/data/store", "s3://bucket/prefix")
    url: str
    #: requests by kind, bytes and errors; see :data:`COUNTER_NAMES`
    counters: Counter
    #: a directory exists by itself, empty or not (local); False where one is
    #: only implied by the keys below it (S3)
    keeps_empty_dirs: bool
    #: what ``put`` returns is what a listing or stat would show (local); False
    #: where a listing would show another mtime (S3's LastModified)
    put_info_exact: bool
    #: a lookup costs a request (S3: a HEAD, and a LIST for a name that is
    #: not a file); False where it is a local ``stat``
    lookups_cost_requests: bool
    #: the store has symbolic links and shows them as links (``stat(links=)``,
    #: ``symlink``, ``move_link``, ``Listing.links``): local, unless every
    #: link is followed (-o follow_symlinks); S3 has none
    symlinks: bool

    def stat(self, key: str, *, links: bool = False) -> ObjectInfo | None:
        """Info of the object at ``key``, or None if there is none.
        ``links`` (only where ``symlinks``): a symbolic link at ``key`` is
        answered as itself (``link`` set), never followed; the path to it is
        resolved as any key's."""

    def is_dir(self, key: str) -> bool:
        """True if some object exists below ``key + '/'`` (or key is '')."""

    def get(
        self,
        key: str,
        start: int = 0,
        length: int | None = None,
        *,
        suffix: int | None = None,
        if_match: str | None = None,
        max_size: int | None = None,
    ) -> Blob:
        """Read ``length`` bytes at ``start`` (None: to the end), or the last
        ``suffix`` bytes.  Short reads happen only at the end of the object.
        Raises NotFound, PreconditionFailed (etag differs from ``if_match``),
        TooLarge (the object is larger than ``max_size``: nothing is read)."""

    def list(self, prefix: str) -> Listing:
        """Immediate children of directory ``prefix`` ('' is the root)."""

    def symlink(self, key: str, target: str) -> ObjectInfo:
        """Make a symbolic link ``key`` holding ``target`` (any text; EEXIST
        if the name is taken).  Only where ``symlinks``."""

    def move_link(self, key: str, new_key: str, *, noreplace: bool = False) -> None:
        """Rename the symbolic link ``key`` itself to ``new_key`` (replacing
        a file there, as rename(2); ``noreplace``: EEXIST instead).  Only
        where ``symlinks``."""

    def put(
        self,
        key: str,
        data: bytes,
        *,
        if_match: str | None = None,
        if_none_match: bool = False,
    ) -> ObjectInfo:
        """Replace the object atomically: readers see the old or the new
        bytes, never a mix.  Raises PreconditionFailed when ``if_match`` is
        given and the current etag differs (or the object is gone), or when
        ``if_none_match`` is set and the object exists."""

    def delete(self, key: str, *, if_match: str | None = None, prune_below: str | None = None) -> None:
        """Remove the object (absent is not an error unless if_match given).
        ``prune_below``: also remove the directories this leaves empty, up to
        but not including that one (local; S3 has none): a dataset's shard
        directories, which exist only to hold its shards."""

    def make_dir(self, key: str) -> None:
        """Create an (empty) directory where the store has such a thing
        (local); a no-op where directories are implied by keys (S3)."""

    def remove_dir(self, key: str) -> None:
        """Remove an empty directory (local); a no-op on S3."""

    def close(self) -> None:
        """Release connections."""


COUNTER_NAMES = (
    "get",  # whole-object GETs
    "get_range",  # ranged GETs
    "head",
    "list",
    "put",
    "delete",
    "bytes_read",
    "bytes_written",
    "errors",
    "retries",
    "precondition_failed",
)


# --------------------------------------------------------------------------
# async adapter


class _Slot:
    """The ``max_connections`` slot of one storage call, as the limiter
    ``trio.to_thread.run_sync`` takes.  trio releases it when the call's
    thread ends, also a thread given up long before; :meth:`given_up`
    gives it back at once instead: a thread given up at its deadline goes
    on (it cannot be stopped) until botocore's timeouts end its attempt,
    and later calls (the endpoint back, or answers for other keys) must
    not queue behind it.  At most ``max_connections`` given-up calls run
    without a slot; beyond that they keep theirs, so no more than twice
    ``max_connections`` calls ever run at once."""

    __slots__ = ("store", "borrower", "abandoned")

    def __init__(self, store: "AsyncStore"):
        self.store = store
        self.borrower = None  # trio's placeholder for the thread, while the slot is held
        self.abandoned = False  # given up while its thread ran

    async def acquire_on_behalf_of(self, borrower) -> None:
        await self.store.limiter.acquire_on_behalf_of(borrower)
        self.borrower = borrower

    def release_on_behalf_of(self, borrower) -> None:
        """(trio, on its loop: the thread has ended)"""
        if self.abandoned:
            self.store.given_up_running -= 1
        if self.borrower is not None:
            self.borrower = None
            self.store.limiter.release_on_behalf_of(borrower)

    def given_up(self) -> None:
        """The call was given up at its deadline (on the loop)."""
        if self.borrower is None or self.abandoned:  # (no thread began, or it has ended)
            return
        self.abandoned = True
        store = self.store
        store.given_up_running += 1
        if store.given_up_running <= store.limiter.total_tokens:
            borrower, self.borrower = self.borrower, None
            store.limiter.release_on_behalf_of(borrower)


class AsyncStore:
    """Runs backend calls off the trio loop, bounded and with a deadline.

    Every blocking call goes through ``trio.to_thread.run_sync`` with one
    shared :class:`trio.CapacityLimiter` (``max_connections``), so many
    readers overlap their requests but never more than the limit.  A call
    that has not finished after ``timeout`` seconds fails with ``Unavailable``
    (EIO); the worker thread is abandoned, the loop never hangs.

    ``list_ttl`` > 0 keeps listings that long (S3: a LIST is slow and dear,
    and a scan of the view lists each shard directory once per chunk
    directory below it).  Writes through this store drop the listings of
    their key's ancestors at once, so the mount always sees its own writes;
    other clients' changes show within ``list_ttl``.

    ``observers`` are called with every :class:`ObjectInfo` storage has just
    answered (HEAD, listing, GET; not cached listings): fresh evidence of
    an object's current version, which the shard cache uses to re-validate
    indexes without requests of its own.
    """

    #: seconds a call that got no answer is not repeated (the same operation
    #: on the same key fails at once, until then or until any call gets an
    #: answer): the kernel repeats a failed page read immediately, and a read
    #: would otherwise take twice the deadline to fail
    FAIL_FAST = 2.0

    #: listings kept at most (each bounded by LIST_CACHE_ENTRIES names)
    LIST_CACHE_ITEMS = 256
    LIST_CACHE_ENTRIES = 10_000
    #: listings patched by the mount's own writes (larger ones are dropped)
    LIST_PATCH_ENTRIES = 1_000
    #: a directory whose listing (of at most LIST_PATCH_ENTRIES entries: one
    #: page on S3) was made within this many seconds is listed again for a
    #: lookup in it, rather than asked name by name (see _listing_for_lookup)
    RELIST_WINDOW = 30.0
    #: documents larger than this are not kept (get_document)
    DOCUMENT_MAX = 1 << 20
    #: documents larger than this are not read at all (get_document raises
    #: TooLarge): a stray multi-gigabyte ``info`` must not be read whole, and
    #: parsed, by every probe of its directory
    DOCUMENT_LIMIT = 64 << 20
    #: objects this mount wrote that are kept (see ``written``): each at most
    #: WRITTEN_MAX bytes, all together at most WRITTEN_BYTES
    WRITTEN_MAX = 1 << 20
    WRITTEN_BYTES = 16 << 20

    def __init__(self, backend: Backend, *, max_connections: int = 16, timeout: float = 60.0,
                 list_ttl: float = 0.0):
        self.backend = backend
        self.url = backend.url
        self.keeps_empty_dirs = backend.keeps_empty_dirs
        self.symlinks = getattr(backend, "symlinks", False)
        self.limiter = trio.CapacityLimiter(max_connections)
        #: calls given up at their deadline whose worker thread has not ended
        self.given_up_running = 0
        self.timeout = timeout
        # optional non-blocking fast path (local files in the page cache)
        self._nowait = getattr(backend, "get_nowait", None)
        self._stat_nowait = getattr(backend, "stat_nowait", None)
        self.observers: list[Callable[[ObjectInfo], None]] = []
        self.list_ttl = list_ttl
        self._listings: OrderedDict[str, tuple[Listing, float]] = OrderedDict()
        self._list_generation = 0  # bumped by every write: a listing begun before it is not kept
        self._lists = SingleFlight()  # LISTs in flight, by prefix
        self._unanswered: OrderedDict[tuple, float] = OrderedDict()  # (operation, key) -> when it failed
        # writes given up at the deadline whose worker thread may still land
        # them, by key: the next write of that key waits for it (see _run)
        self._landing: dict[str, list[threading.Event]] = {}
        # small whole objects (metadata documents) read in the last list_ttl
        # seconds: a probe and the listing that shows the document share one GET
        self._documents: OrderedDict[str, tuple[Blob | None, float]] = OrderedDict()
        # list_ttl 0: the documents each request read, for the rest of it
        self._request_documents = _RequestDocuments()
        # small directories listed lately: prefix -> when (see _listing_for_lookup)
        self._listed_lately: OrderedDict[str, float] = OrderedDict()
        # small objects this mount wrote in the last list_ttl seconds (see written)
        self._written: OrderedDict[str, tuple[Blob, float]] = OrderedDict()
        self._written_bytes = 0

    def table_sizes(self) -> dict[str, int]:
        """Entries of this layer's tables and its backend's (see Operations.table_sizes)."""
        own = {"listings": len(self._listings), "list_loads": len(self._lists), "unanswered": len(self._unanswered),
               "landing": len(self._landing), "store_documents": len(self._documents),
               "request_documents": len(self._request_documents),
               "listed_lately": len(self._listed_lately), "written": len(self._written)}
        sizes = getattr(self.backend, "table_sizes", None)
        return {**own, **(sizes() if sizes is not None else {})}

    @property
    def counters(self) -> Counter:
        return self.backend.counters

    def reserved_name(self, name: str) -> bool:
        """True for a name the backend keeps for itself (see View._check_name)."""
        reserved = getattr(self.backend, "reserved_name", None)
        return reserved is not None and reserved(name)

    @contextlib.contextmanager
    def request_deadline(self):
        """One deadline, ``timeout`` from now, for a whole kernel request:
        the storage calls it makes share it (a read of a chunk whose index
        is not cached, a lookup's HEAD then LIST, a listing's pages, a
        flush's reads, PUT and retries).  Each call alone would get the
        whole ``timeout``, and a request of several, each answered just in
        time, took several times the deadline.  Nested: the earlier wins."""
        token = self.begin_request()
        try:
            yield
        finally:
            end_request(token)

    def begin_request(self) -> contextvars.Token:
        """:meth:`request_deadline` without a context manager, for the path
        every kernel request takes (0.5 us against 1.5 us; the monotonic clock
        instead of trio's halves it again); the token goes to
        :func:`end_request`."""
        deadline = time.monotonic() + self.timeout
        earlier = _request_deadline.get()
        return _request_deadline.set(deadline if deadline < earlier else earlier)

    async def _run(self, fn: Callable[..., T], *args, _speculative: bool = False, _writes: bool = False,
                   **kwargs) -> T:
        """``fn(*args, **kwargs)`` in a worker thread, within the deadline.
        ``_speculative``: work nobody waits for (read-ahead) neither fails
        fast nor leaves a fail-fast mark on its key for the reader's call.
        ``_writes``: a write (PUT, DELETE) of key ``args[0]``.  A write given
        up at the deadline goes on in its thread (a thread cannot be
        stopped) and may land later: the next write of that key waits for it
        first, so a late PUT never replaces a newer one (plain files and
        documents are written without conditions)."""
        done = threading.Event()
        begun = threading.Lock()  # guards ``state``: begun, or given up before it began
        state = {"begun": False, "given_up": False}

        until = math.inf  # (monotonic: see call_deadline)

        def call():
            with begun:
                if state["given_up"]:  # (given up while waiting for a thread: never asks)
                    done.set()
                    return None
                state["begun"] = True
            _call_deadline.set(until)  # (the thread's own copy of the context)
            try:
                return fn(*args, **kwargs)
            finally:
                done.set()

        what = (getattr(fn, "__name__", ""), args[0] if args else None)
        # (the key in the words: the line names what failed, and failures of
        # other keys are lines of their own, not repeats log_once drops)
        # (the store's root, key "": "/", not an empty word)
        where = f"{self.url}: {what[0]} {what[1] or '/'}" if what[1] is not None else f"{self.url}: {what[0]}"
        deadline = request_deadline_now()
        if trio.current_time() >= deadline:  # (never asked: nothing to wait for or mark)
            bump(self.backend.counters, "errors")
            raise Unavailable(f"{where}: not asked, the request's {self.timeout:g}s deadline has passed", what[1])
        if _writes:
            await self._after_landing(what[1], where, deadline)
        failed = None if _speculative else self._unanswered.get(what)
        if failed is not None:
            if time.monotonic() - failed < min(self.FAIL_FAST, self.timeout):
                bump(self.backend.counters, "errors")
                raise Unavailable(f"{where}: no answer a moment ago; not asking again yet", what[1])
            del self._unanswered[what]
        started = time.monotonic()
        # a call cut short by its request's deadline, after less than half
        # of its own, proves little against the endpoint: it leaves no
        # fail-fast mark (the kernel's repeat of a failed read then asks)
        mark = not _speculative
        try:
            with trio.move_on_at(min(trio.current_time() + self.timeout, deadline)) as scope:
                until = trio.current_effective_deadline() - trio.current_time() + time.monotonic()
                slot = _Slot(self)
                try:
                    result = await trio.to_thread.run_sync(call, limiter=slot, abandon_on_cancel=True)
                except StoreError as exc:
                    if not isinstance(exc, Unavailable):  # an answer too (not found, denied, ...)
                        self._unanswered.clear()
                    self._trace(what, args, started, type(exc).__name__)
                    raise
                self._unanswered.clear()  # an answer: the endpoint is back for everyone
                self._trace(what, args, started)
                return result
            if scope.cancelled_caught:
                slot.given_up()
                bump(self.backend.counters, "errors")  # worker threads bump concurrently
                with begun:
                    state["given_up"] = True
                    asked = state["begun"]
                if _writes and asked:  # (one never begun cannot land)
                    self._landing.setdefault(what[1], []).append(done)
                waited = time.monotonic() - started
                if waited < self.timeout / 2:
                    mark = False
                if waited < self.timeout * 0.99:
                    raise Unavailable(f"{where}: no answer within the request's {self.timeout:g}s deadline "
                                      f"(this call waited {waited:.1f}s)", what[1])
                raise Unavailable(f"{where}: no answer within {self.timeout:g}s", what[1])
            raise AssertionError("unreachable")  # pragma: no cover
        except Unavailable:
            if mark:
                self._unanswered[what] = time.monotonic()
                while len(self._unanswered) > 1024:
                    self._unanswered.popitem(last=False)
            raise

    def _answered_nowait(self, what: tuple, args: tuple, started: float) -> None:
        """A call answered on the event loop (a backend's ``*_nowait``), as
        :meth:`_run` takes an answer: the storage is back for everyone (the
        fail-fast marks go), and the trace line.  The caller asks only
        before the request's deadline (after it, :meth:`_run` says "not
        asked").  A fail-fast mark of the same call does not stop it: it
        waits for nothing, so there is no dead endpoint to spare it."""
        if self._unanswered:
            self._unanswered.clear()
        self._trace(what, args, started)

    async def _after_landing(self, key: str, where: str, deadline: float = math.inf) -> None:
        """Wait (up to the deadline, or the request's) for a write of ``key``
        given up earlier to end; Unavailable if it does not."""
        earlier = self._landing.get(key)
        if earlier is None:
            return
        with trio.move_on_at(min(trio.current_time() + self.timeout, deadline)):
            while not all(e.is_set() for e in earlier):
                await trio.sleep(0.02)
        if not all(e.is_set() for e in earlier):
            bump(self.backend.counters, "errors")
            raise Unavailable(f"{where}: an earlier write of it, given up, has not ended yet", key)
        if self._landing.get(key) is earlier:
            del self._landing[key]
        for k in [k for k, events in self._landing.items() if all(e.is_set() for e in events)]:
            del self._landing[k]  # (ended, of keys not written again)

    @staticmethod
    def _trace(what: tuple, args: tuple, started: float, outcome: str = "") -> None:
        """``-o log_level=DEBUG``: one line per storage call, with its time."""
        if log.isEnabledFor(logging.DEBUG):
            # (a payload is shown by its size: a PUT's bytes do not belong in a log)
            shown = tuple(f"<{len(a)} bytes>" if isinstance(a, (bytes, bytearray, memoryview)) else a
                          for a in args[1:3])
            log.debug("storage %s %s %s: %s%.1f ms", what[0], what[1], shown if shown else "",
                      f"{outcome} after " if outcome else "", 1000 * (time.monotonic() - started))

    def _seen(self, info: ObjectInfo | None) -> None:
        if info is not None:
            for observer in self.observers:
                observer(info)

    def _changed(self, key: str, stored: ObjectInfo | None = None, deleted: bool = False) -> None:
        """A write to ``key``: listings of its ancestors are stale, except
        what this write itself tells.  ``stored``: it now holds that object,
        so its directory's listing gets the entry and those above it the
        directory (a tool writing file after file into one directory, as
        rsync does, then looks names up in a listing that stays fresh rather
        than listing again for each).  ``deleted``: it is gone (the listing
        of its directory loses the entry; above, a directory may have gone
        with it, so those listings are dropped)."""
        self._list_generation += 1
        self._documents.pop(key, None)
        self._forget_written(key)
        if not self._listings:
            return
        parts = key.split("/")
        ancestors = ["/".join(parts[:i]) for i in range(len(parts))]  # '', then down to the parent
        now = time.monotonic()
        for i, prefix in enumerate(ancestors):
            cached = self._listings.get(prefix)
            if cached is None:
                continue
            listing, when = cached
            child = parts[i]
            if now - when >= self.list_ttl or len(listing.files) + len(listing.dirs) > self.LIST_PATCH_ENTRIES:
                del self._listings[prefix]  # (patching costs its size: only small, fresh ones)
            elif stored is not None and prefix != ancestors[-1]:
                if child not in listing.dirs:
                    listing = Listing(sorted([*listing.dirs, child]), listing.files, listing.unconfirmed,
                                      listing.links)
                self._listings[prefix] = (listing, when)
            elif (stored is not None or deleted) and prefix == ancestors[-1]:
                files = [f for f in listing.files if f.key != key]
                unconfirmed = listing.unconfirmed - {key}
                if stored is not None:
                    bisect.insort(files, stored, key=lambda f: f.key)
                    if not getattr(self.backend, "put_info_exact", False):
                        unconfirmed = unconfirmed | {key}
                dirs = listing.dirs
                if listing.link(key) is not None and child in dirs:
                    # a link to a directory, listed as that directory too: the
                    # name was the link's, so the directory goes with it
                    dirs = [d for d in dirs if d != child]
                self._listings[prefix] = (Listing(dirs, files, unconfirmed, listing.without(key)), when)
            else:
                del self._listings[prefix]

    async def stat(self, key: str, *, listed_ok: bool = False, links: bool = False) -> ObjectInfo | None:
        """Info of the object ``key``, asked now; with ``listed_ok``, from a
        listing of its directory made within ``list_ttl`` if there is one (a
        lookup after a listing, as in ``ls`` then ``cat``, costs no request).
        Re-validation of a cached version must ask: a listing may be older.
        ``links``: a symbolic link at ``key`` is answered as itself (a name
        the view passes through), in stores that have links."""
        links = links and self.symlinks
        if listed_ok:
            listing = await self._listing_for_lookup(key.rpartition("/")[0])
            if listing is not None and key not in listing.unconfirmed:
                return (links and listing.link(key)) or listing.file(key)
        generation = self._list_generation
        info = None
        if not links and self._stat_nowait is not None and time.monotonic() < _request_deadline.get():
            # (a cached shard index's re-validation, mostly: a regular file
            # found from the kernel's caches alone needs no thread)
            started = time.monotonic()
            info = self._stat_nowait(key)
            if info is not None:
                self._answered_nowait(("stat", key), (key,), started)
        if info is None:
            info = await self._run(self.backend.stat, key, **({"links": True} if links else {}))
        if info is not None and info.link is not None:
            return info  # (the link itself: no version of an object, nothing to confirm)
        self._seen(info)
        self._confirm(key, info, generation)
        return info

    def _confirm(self, key: str, info: ObjectInfo | None, generation: int) -> None:
        """A HEAD answered for a key this mount stored (an unconfirmed entry
        of a kept listing): the entry becomes that answer, so the lookups
        that follow (rsync's rename of its temporary, then the unlink of the
        old name) find it there instead of asking again.  Not if any write
        happened while the HEAD ran: its answer may predate that write."""
        prefix = key.rpartition("/")[0]
        cached = self._listings.get(prefix)
        if cached is None or generation != self._list_generation or key not in cached[0].unconfirmed:
            return
        listing, when = cached
        files = [f for f in listing.files if f.key != key]
        if info is not None:
            bisect.insort(files, info, key=lambda f: f.key)
        self._listings[prefix] = (Listing(listing.dirs, files, listing.unconfirmed - {key}, listing.links), when)

    async def _listing_for_lookup(self, prefix: str) -> Listing | None:
        """The listing that answers a lookup in ``prefix``: a fresh one, or,
        where lookups cost requests, a new one if the directory was listed
        lately and is small.  A tool writing file after file into a directory
        (rsync, cp -r) looks each name up before it creates it: past
        ``list_ttl`` each of those cost a HEAD and, the name being no file, a
        LIST (is it a directory?); now one LIST answers them all for another
        ``list_ttl``.  A lookup of an existing file costs one request either
        way (a LIST instead of a HEAD)."""
        listing = self._fresh_listing(prefix)
        if listing is not None or not getattr(self.backend, "lookups_cost_requests", False):
            return listing
        when = self._listed_lately.get(prefix)
        if when is None or time.monotonic() - when > self.RELIST_WINDOW:
            return None
        return await self.list(prefix)

    def _fresh_listing(self, prefix: str) -> Listing | None:
        """The listing of ``prefix`` if one was made within ``list_ttl``."""
        cached = self._listings.get(prefix) if self.list_ttl > 0 else None
        if cached is not None and time.monotonic() - cached[1] < self.list_ttl:
            return cached[0]
        return None

    async def symlink(self, key: str, target: str) -> ObjectInfo:
        try:
            return await self._run(self.backend.symlink, key, target, _writes=True)
        finally:
            self._changed(key)

    async def move_link(self, key: str, new_key: str, *, noreplace: bool = False) -> None:
        """``noreplace``: EEXIST (a StoreError of that errno) if anything is at
        ``new_key`` (RENAME_NOREPLACE in storage)."""
        more = {"noreplace": True} if noreplace else {}
        try:
            await self._run(self.backend.move_link, key, new_key, _writes=True, **more)
        finally:
            self._changed(key)
            self._changed(new_key)

    @property
    def moves_dirs(self) -> bool:
        """Can a directory be renamed in one atomic step (local: rename(2);
        S3 has no directories to rename)?"""
        return getattr(self.backend, "move_dir", None) is not None

    def landing_below(self, key: str) -> bool:
        """Is a write given up at its deadline, whose worker may still land
        it, out for a key at or below directory ``key``?"""
        below = key + "/"
        return any((k == key or k.startswith(below)) and not all(e.is_set() for e in events)
                   for k, events in self._landing.items() if isinstance(k, str))

    def move_dir_now(self, key: str, new_key: str, *, noreplace: bool) -> None:
        """Rename the directory ``key`` to ``new_key`` (see LocalBackend.move_dir),
        on the caller's thread: the event loop, so that no request runs
        between the caller's checks and the rename.  What is kept of both
        places (listings, documents, objects written) is dropped."""
        try:
            self.backend.move_dir(key, new_key, noreplace=noreplace)
        finally:
            self._changed(key)  # (the listings that name either: dropped)
            self._changed(new_key)
            for place in (key, new_key):
                below = place + "/"
                for table in (self._listings, self._documents, self._listed_lately):
                    for k in [k for k in table if k == place or k.startswith(below)]:
                        del table[k]
                for k in [k for k in self._written if k.startswith(below)]:
                    self._forget_written(k)
                for what in [w for w in self._unanswered if isinstance(w, tuple) and len(w) > 1
                             and isinstance(w[1], str) and (w[1] == place or w[1].startswith(below))]:
                    del self._unanswered[what]

    async def sync_dirs(self, key: str, *more: str) -> None:
        """fsync the directories ``key`` and ``more`` (after move_dir_now)."""
        await self._run(self.backend.sync_dirs, key, *more, _writes=True)

    async def is_dir(self, key: str) -> bool:
        parent, _, name = key.rpartition("/")
        listing = await self._listing_for_lookup(parent)
        if listing is not None:
            return name in listing.dirs  # a walk's lookups after its listing: no request
        dir_page = getattr(self.backend, "dir_page", None)
        if dir_page is None or self.list_ttl <= 0:
            return await self._run(self.backend.is_dir, key)
        generation = self._list_generation
        exists, listing = await self._run(dir_page, key)
        if listing is not None:  # its listing, which usually comes next
            self._keep_listing(key, listing, generation)
        return exists

    def get_pinned_nowait(self, key: str, start: int, length: int, if_match: str) -> Blob | None:
        """What :meth:`get` answers without a thread for a ranged read
        pinned to version ``if_match`` (a page-cache hit through a kept
        descriptor), synchronously; None where :meth:`get` would take a
        thread.  For a caller that must not await before using the bytes
        (ShardCache.read_chunk: no other task then fetches the same chunk)."""
        if (0 < length <= NOWAIT_MAX and self._nowait is not None
                and time.monotonic() < _request_deadline.get()):
            return self._nowait(key, start, length, if_match)
        return None

    async def get(self, key: str, start: int = 0, length: int | None = None, *,
                  suffix: int | None = None, if_match: str | None = None, speculative: bool = False,
                  max_size: int | None = None) -> Blob:
        asked = length if suffix is None else suffix
        if (asked and asked <= NOWAIT_MAX and max_size is None and self._nowait is not None
                and time.monotonic() < _request_deadline.get()):  # (past it: _run's "not asked", as in a thread)
            if if_match is not None:
                if suffix is None:
                    blob = self._nowait(key, start, length, if_match)  # page-cache hit: no thread hop
                    if blob is not None:
                        return blob  # an open file of that version, not news of the current one
            else:  # (a shard index's load)
                started = time.monotonic()
                blob = self._nowait(key, start, length, None, suffix=suffix)  # path and bytes cached: no thread
                if blob is not None:
                    self._answered_nowait(("get", key), (key, start, length), started)
                    self._seen(blob.info)
                    return blob
        extra = {} if max_size is None else {"max_size": max_size}
        blob = await self._run(self.backend.get, key, start, length, suffix=suffix, if_match=if_match,
                               _speculative=speculative, **extra)
        self._seen(blob.info)
        return blob

    async def get_document(self, key: str, etag: str | None = None) -> Blob:
        """The whole object ``key`` (a metadata document), from a read made
        within the last ``list_ttl`` seconds if there was one (and it was of
        version ``etag``, when given), or from an older read of the version
        a listing made within ``list_ttl`` shows; else read now.  Without ``etag``,
        NotFound without a request when, within ``list_ttl``, a read found it
        missing or a listing of its directory did not show it (most
        directories are not datasets, and a probe asks for several documents
        in each).  TooLarge for one over DOCUMENT_LIMIT bytes, before
        reading it.  With ``list_ttl`` 0, a document this kernel request
        read (or found missing) already is not asked for again by it
        (_RequestDocuments), unless the mount wrote anything meanwhile."""
        if self.list_ttl <= 0:
            kept = self._request_documents.get(key)
            if kept is not None and kept[1] == self._list_generation:
                if kept[0] is None:
                    if etag is None:
                        raise NotFound(f"{key}: not found earlier in this request", key)
                elif etag is None or kept[0].info.etag == etag:
                    return kept[0]
        cached = self._documents.get(key) if self.list_ttl > 0 else None
        if cached is not None and time.monotonic() - cached[1] < self.list_ttl:
            if cached[0] is None:
                if etag is None:  # (a caller with a version in hand saw it since)
                    raise NotFound(f"{key}: not found a moment ago", key)
            elif etag is None or cached[0].info.etag == etag:
                self._documents.move_to_end(key)
                return cached[0]
        if etag is None:
            listing = self._fresh_listing(key.rpartition("/")[0])
            listed = listing.file(key) if listing is not None else None
            if listing is not None and listed is None:
                raise NotFound(f"{key}: not in the listing of its directory", key)
            if listed is not None and listed.size > self.DOCUMENT_LIMIT:
                raise self.too_large(key, listed.size)
            if (listed is not None and cached is not None and cached[0] is not None
                    and cached[0].info.etag == listed.etag and key not in listing.unconfirmed):
                # read longer ago than list_ttl, but a listing made within it
                # shows that very version: still current (a warm walk lists an
                # array's directory, then probes its document: no GET again)
                return cached[0]
        generation = self._list_generation
        try:
            blob = await self.get(key, max_size=self.DOCUMENT_LIMIT)
        except NotFound:
            self._keep_document(key, None, generation)
            raise
        except TooLarge as exc:
            raise self.too_large(key, exc.size) from None
        if len(blob.data) <= self.DOCUMENT_MAX:
            self._keep_document(key, blob, generation)
        return blob

    def _keep_document(self, key: str, blob: Blob | None, generation: int) -> None:
        """Remember a document read (None: found missing) for ``list_ttl``
        (for the rest of the request with ``list_ttl`` 0), unless a write
        of the mount's own happened while it was read."""
        if generation != self._list_generation:
            return
        if self.list_ttl <= 0:
            self._request_documents.put(key, blob, generation, self.DOCUMENT_MAX)
            return
        self._documents[key] = (blob, time.monotonic())
        self._documents.move_to_end(key)
        while len(self._documents) > self.LIST_CACHE_ITEMS:
            self._documents.popitem(last=False)

    def too_large(self, key: str, size: int) -> TooLarge:
        """The error (and log line) for a document of ``size`` bytes."""
        return TooLarge(f"{key}: {size} bytes, more than the {self.DOCUMENT_LIMIT >> 20} MiB a metadata document "
                        "may have; shown as stored, not read as metadata", key, size)


    async def get_or_none(self, key: str) -> Blob | None:
        try:
            return await self.get(key)
        except NotFound:
            return None

    async def list(self, prefix: str) -> Listing:
        while self.list_ttl > 0:
            cached = self._listings.get(prefix)
            if cached is not None and time.monotonic() - cached[1] < self.list_ttl and not cached[0].unconfirmed:
                self._listings.move_to_end(prefix)
                return cached[0]
            if not await shared_within_deadline(self._lists, prefix, prefix or "/"):  # one LIST per prefix at a time
                break
        generation = self._list_generation
        with self._lists.loading(prefix):
            listing = await self._run(self.backend.list, prefix)
        self._keep_listing(prefix, listing, generation)
        return listing

    def _keep_listing(self, prefix: str, listing: Listing, generation: int) -> None:
        """Pass on the versions a listing shows, and keep it for ``list_ttl``
        unless a write of the mount's own happened while it was made."""
        for info in listing.files:
            self._seen(info)
        if self.list_ttl <= 0:
            return
        entries = len(listing.files) + len(listing.dirs)
        if entries > self.LIST_PATCH_ENTRIES:  # (grown: its lookups are asked by name again)
            self._listed_lately.pop(prefix, None)
        if generation != self._list_generation or entries > self.LIST_CACHE_ENTRIES:
            return  # (not kept: nor does it renew the window, or writes elsewhere made every miss a LIST)
        self._listings[prefix] = (listing, time.monotonic())
        self._listings.move_to_end(prefix)
        while len(self._listings) > self.LIST_CACHE_ITEMS:
            self._listings.popitem(last=False)
        if entries <= self.LIST_PATCH_ENTRIES:
            self._listed_lately[prefix] = time.monotonic()
            self._listed_lately.move_to_end(prefix)
            while len(self._listed_lately) > self.LIST_CACHE_ITEMS:
                self._listed_lately.popitem(last=False)

    async def put(self, key: str, data: bytes, *, if_match: str | None = None,
                  if_none_match: bool = False, like: str | None = None) -> ObjectInfo:
        """``like``: the key of a stored file the new one is a copy of (a
        file renamed): where files have modes and owners (local), a new one
        takes that file's (see LocalBackend.put)."""
        info = None
        more = {"like": like} if like is not None and getattr(self.backend, "keeps_modes", False) else {}
        try:
            info = await self._run(self.backend.put, key, data, if_match=if_match, if_none_match=if_none_match,
                                   _writes=True, **more)
            return info
        finally:
            self._changed(key, stored=info)
            if info is not None and if_match is None and not if_none_match:
                self._keep_written(key, data, info)  # (plain files and documents; not shards)

    def written(self, key: str) -> bytes | None:
        """The bytes of ``key`` if this mount wrote it within the last
        ``list_ttl`` seconds and nothing of the mount's own changed it since
        (a small object: see WRITTEN_MAX).  A rename of a file the mount has
        just stored (rsync's temporary, renamed right after its close) copies
        them instead of reading the object back; as with listings, another
        client's change within ``list_ttl`` is not seen."""
        kept = self._written.get(key)
        if kept is None or time.monotonic() - kept[1] >= self.list_ttl:
            return None
        return kept[0].data

    def _keep_written(self, key: str, data: bytes, info: ObjectInfo) -> None:
        # (only where reading back costs a request: a local read is a pread,
        # and it sees another process's change at once)
        if (self.list_ttl <= 0 or len(data) > self.WRITTEN_MAX
                or not getattr(self.backend, "lookups_cost_requests", False)):
            return
        self._forget_written(key)
        self._written[key] = (Blob(bytes(data), info), time.monotonic())
        self._written_bytes += len(data)
        while self._written_bytes > self.WRITTEN_BYTES:
            self._forget_written(next(iter(self._written)))

    def _forget_written(self, key: str) -> None:
        kept = self._written.pop(key, None)
        if kept is not None:
            self._written_bytes -= len(kept[0].data)

    async def delete(self, key: str, *, if_match: str | None = None, prune_below: str | None = None) -> None:
        done = False
        try:
            await self._run(self.backend.delete, key, if_match=if_match, prune_below=prune_below, _writes=True)
            done = prune_below is None  # (pruned directories: the listings above are dropped)
        finally:
            self._changed(key, deleted=done)

    async def make_dir(self, key: str) -> None:
        try:
            return await self._run(self.backend.make_dir, key)
        finally:
            self._changed(key)

    async def remove_dir(self, key: str) -> None:
        try:
            return await self._run(self.backend.remove_dir, key)
        finally:
            self._changed(key)

    async def statfs(self):
        """``os.statvfs`` of the storage, if it has such a thing (S3 has not)."""
        fn = getattr(self.backend, "statfs", None)
        return None if fn is None else await self._run(fn)

    def close(self) -> None:
        self.backend.close()


def join_key(*parts: str) -> str:
    """Join key fragments with '/', skipping empty ones."""
    return "/".join(p.strip("/") for p in parts if p and p.strip("/"))


_lock = threading.Lock()


def bump(counters: Counter, name: str, n: int = 1) -> None:
    """Thread-safe counter increment (backends are called from many threads)."""
    with _lock:
        counters[name] += n


def bump_read(counters: Counter, name: str, nbytes: int) -> None:
    """:func:`bump` of ``name`` and of ``bytes_read`` by ``nbytes``, under one
    taking of the lock (every read counts both)."""
    with _lock:
        counters[name] += 1
        counters["bytes_read"] += nbytes


__all__ = [
    "AccessDenied", "AsyncStore", "Backend", "Blob", "COUNTER_NAMES", "CorruptData",
    "Listing", "NotFound", "ObjectInfo", "PreconditionFailed", "StoreError",
    "Unavailable", "bump", "bump_read", "call_deadline", "end_request", "held_by_deadline", "join_key", "no_request_deadline",
    "pause_within_deadline", "request_deadline_at", "shared_within_deadline", "waited_within_deadline",
]
