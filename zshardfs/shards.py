"""Shard indexes and chunk reads, common to every layout.

A layout describes its binary shard format with a :class:`ShardFormat`
(how to load an index, how to encode a shard); this module caches the loaded
indexes in a byte-bounded LRU and reads chunk bytes *pinned to the version
the index came from* (``if_match`` with the shard's etag).  If the shard was
replaced between the index read and the chunk read, the index is dropped and
the read is retried, so a reader never gets bytes mixed from two versions.

Invariants:
- The cache holds at most ``index_cache_bytes`` of parsed indexes (by their
  ``nbytes`` estimate); memory does not grow with the size of the store.
- A cached index is reused for ``index_ttl`` seconds; after that its shard is
  re-validated (a local ``stat`` or S3 ``HEAD`` — cheaper than re-reading).
- Read-ahead is speculative and never what makes a read slow or fail: it runs
  in the background in GETs sized by observed throughput, a reader waits for
  it only briefly (then reads its chunk alone), and a read-ahead GET with no
  answer is given up at half the deadline, before the store's deadline would
  end it and fail-fast would fail the reader's next call on that key.
"""

from __future__ import annotations

import bisect
import contextlib
import functools
import heapq
import logging
import math
import re
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Protocol

import trio

from .backends.base import (AsyncStore, CorruptData, NotFound, ObjectInfo, PreconditionFailed, StoreError,
                            Unavailable, no_request_deadline, request_deadline_at, shared_within_deadline)
from .singleflight import SingleFlight
from .together import HEAVY, off_loop

log = logging.getLogger(__name__)

EMPTY = 2**64 - 1

#: bytes a chunk cache entry costs beyond its data, counted against
#: ``chunk_cache``: its key (shard key, etag, chunk id), the bytes object's
#: header and the LRU's links, about 330 bytes measured with 8-byte chunks
#: (64 was counted before: a cache of tiny chunks took 4.6x its budget)
CHUNK_ENTRY_OVERHEAD = 320

#: the largest stored chunk read (chunks are read whole, into memory): an index
#: entry longer is damage, EIO. Without it, an index (without checksum) at the end
#: of a shard another client made a sparse 1 TiB file could declare a 64 GiB chunk
#: inside the file, and every read asked for 64 GiB at once (a MemoryError).
MAX_CHUNK_BYTES = 1 << 30

#: the most stored bytes a shard rewrite keeps (reads, holds and encodes again):
#: more is damage, as are kept chunks whose ranges overlap. A shard another
#: client made a sparse 1 TiB file may declare many chunks under
#: MAX_CHUNK_BYTES each (read in one range of up to a TiB), or every chunk at
#: the same range (one copy per chunk in memory and in the new shard).
MAX_REWRITE_BYTES = 4 << 30


class ShardIndex(Protocol):
    """A loaded shard index (one version of one shard)."""

    info: ObjectInfo  # the shard object's version (etag, size, mtime)
    nbytes: int  # memory it costs, for the cache budget

    #: True: ``locate_now`` answers what ``locate`` would, without awaiting
    sync_locate: bool

    async def locate(self, chunk_id: int) -> tuple[int, int] | None:
        """(offset, nbytes) of a stored chunk in the shard, or None."""

    async def entries(self) -> list[tuple[int, int, int]]:
        """All stored chunks as (chunk_id, offset, nbytes)."""


class ShardFormat(Protocol):
    """How one layout reads and writes its shards.  ``shard_ctx`` is whatever
    the layout needs to know about one shard (e.g. its index shape)."""

    async def load_index(self, store: AsyncStore, key: str, shard_ctx: Any) -> ShardIndex | None:
        """Read and parse the index of shard ``key``; None if the shard does
        not exist.  Raises CorruptData for an index that cannot be valid."""

    def encode(self, chunks: dict[int, bytes], shard_ctx: Any) -> bytes:
        """A complete shard holding ``chunks`` (chunk_id -> stored bytes)."""

    def index_size(self, shard_ctx: Any) -> int:
        """Bytes of the index ``encode`` writes besides the chunks (its work too)."""

    #: False where decode_chunk is the identity (Zarr): no work to move off the loop
    decodes: bool

    def decode_chunk(self, data: bytes) -> bytes:
        """Stored chunk bytes -> the bytes the view shows (identity for Zarr)."""

    def encode_chunk(self, data: bytes) -> bytes:
        """The inverse of decode_chunk, for chunks written through the view."""


def _decoding(fmt: ShardFormat, nbytes: int) -> int:
    """Bytes of real decoding work (0 where decode_chunk is the identity,
    as for Zarr: chunk bytes pass through untouched)."""
    return nbytes if getattr(fmt, "decodes", True) else 0


class ByteLRU:
    """An LRU mapping bounded by the sum of its values' declared sizes.

    The last value larger than the whole budget is kept beside it (one,
    outside the budget): callers ask for such a value again at once (the
    kernel reads a large chunk in 128 KiB pieces; every chunk of a shard
    whose index exceeds ``index_cache`` needs that index), and without it
    each ask would load the whole value anew."""

    def __init__(self, max_bytes: int):
        self.max_bytes = max_bytes
        self.bytes = 0
        self._d: OrderedDict[Any, tuple[Any, int]] = OrderedDict()
        self._beside: tuple[Any, Any, int] | None = None  # (key, value, nbytes)
        self.hits = 0
        self.misses = 0
        self.evicted = 0  # entries dropped for room (not popped): ``zshardfs stats``

    def _oversized(self, key):
        beside = self._beside
        return beside if beside is not None and beside[0] == key else None

    def get(self, key):
        item = self._d.get(key)
        if item is None:
            beside = self._oversized(key)
            if beside is None:
                self.misses += 1
                return None
            self.hits += 1
            return beside[1]
        if item[0] is None:  # (let go of: see let_go)
            self.misses += 1
            return None
        self._d.move_to_end(key)
        self.hits += 1
        return item[0]

    def let_go(self, key, nbytes: int) -> None:
        """Drop ``key``'s value but remember the key, counted as ``nbytes``,
        first to be evicted: ``get`` and ``peek`` answer None (a miss), ``in``
        says no, and :meth:`known` still says yes (so read-ahead does not
        fetch it again); a ``put`` gives it a value again."""
        item = self._d.get(key)
        if item is not None:
            self._d[key] = (None, nbytes)
            self.bytes += nbytes - item[1]
            self._d.move_to_end(key, last=False)
        if self._oversized(key) is not None:
            self._beside = None

    def known(self, key) -> bool:
        """``key`` is cached, or was and :meth:`let_go` of since."""
        return key in self._d or self._oversized(key) is not None

    def put(self, key, value, nbytes: int) -> None:
        self.pop(key)
        if nbytes > self.max_bytes:
            self._beside = (key, value, nbytes)
            return
        self._d[key] = (value, nbytes)
        self.bytes += nbytes
        while self.bytes > self.max_bytes:
            _, (_, n) = self._d.popitem(last=False)
            self.bytes -= n
            self.evicted += 1

    def __contains__(self, key) -> bool:
        item = self._d.get(key)
        return (item is not None and item[0] is not None) or self._oversized(key) is not None

    def touch(self, key) -> None:
        """Count a hit on ``key`` and mark it recently used."""
        if key in self._d:
            self._d.move_to_end(key)
            self.hits += 1
        elif self._oversized(key) is not None:
            self.hits += 1

    def demote(self, key) -> None:
        """Make ``key`` the first to be evicted (it is kept while there is
        room: a read of it is still a hit)."""
        if key in self._d:
            self._d.move_to_end(key, last=False)

    def mark_used(self, key) -> None:
        """Mark ``key`` recently used without counting a hit (for entries
        other than what the counters count)."""
        if key in self._d:
            self._d.move_to_end(key)

    def peek(self, key):
        """The value without touching the LRU order or the hit counters."""
        item = self._d.get(key)
        if item is None:
            beside = self._oversized(key)
            return None if beside is None else beside[1]
        return item[0]

    def pop(self, key) -> None:
        item = self._d.pop(key, None)
        if item is not None:
            self.bytes -= item[1]
        if self._oversized(key) is not None:
            self._beside = None

    @property
    def beside_bytes(self) -> int:
        """Bytes of the value kept beside the budget (0: none)."""
        return 0 if self._beside is None else self._beside[2]

    def __len__(self):
        return len(self._d)

    def pop_where(self, match) -> None:
        """Drop every entry whose key ``match`` accepts (a walk of them all:
        for rare events, such as a shard whose format changed)."""
        for key in [k for k in self._d if match(k)]:
            self.pop(key)
        if self._beside is not None and match(self._beside[0]):
            self._beside = None


#: shards whose last read position the scan detector remembers
SCAN_SHARDS = 4096
#: seconds a shard fetched ahead counts against the read-ahead budget if
#: no chunk of it is read (a scan that went elsewhere)
AHEAD_STALE = 10.0
#: shard indexes one listing loads at once (storage requests are bounded
#: separately, by max_connections)
PRELOAD_MAX = 64
#: shards fetched ahead of the reader at the same time: enough to keep a
#: distant store's pipe full, few enough that the shard the reader needs
#: next is not slowed by a dozen others sharing the bandwidth
AHEAD_PARALLEL = 4
#: shards a walk that lists (see ShardCache.listed) has fetched ahead before
#: it reads anything: a walk that only lists (``du``, ``find -name``) costs
#: at most these GETs of data, once, however long it lists
LIST_AHEAD = AHEAD_PARALLEL
#: chunk directories listed in a row in walk order that make a walk (fewer:
#: someone looking at a few directories, who reads nothing ahead)
LIST_WALK = 4
#: read-ahead is speculative: each of its GETs is sized, by the throughput
#: storage has shown, to take about this long (at most; and at most an
#: eighth of ``-o timeout``), so a reader waiting for the piece that holds
#: its chunk waits about as long as for a plain read, on any link
PIECE_TIME = 1.0
#: bytes of the first read-ahead GET, before any GET has been timed
PIECE_FIRST = 1 << 20
#: bytes a read-ahead GET may always ask for: on any link worth the name
#: they cost about one round trip, which is all a small GET's time tells
#: (a 512-byte chunk read in 50 ms says little about bandwidth)
PIECE_MIN = 64 << 10

_DIGITS = re.compile(r"(\d+)")


def scan_order(key: str) -> tuple:
    """A shard key's place in the order a scan of the view reaches shards.

    The view lists chunks in C order over the inner-chunk grid, and the
    first chunk of shard (a, b, c) comes before that of every shard after
    it in C order over the shard grid: numeric order of the key's
    coordinates ("c/0/10" after "c/0/9")."""
    parts = _DIGITS.split(key)
    parts[1::2] = [int(p) for p in parts[1::2]]
    return tuple(parts)


async def _guarded(fn, *args) -> None:
    """Background work: an error is a log line, not the end of the mount.
    Not bound by the deadline of the request that started it (its task
    inherits the request's context): its calls have their own."""
    try:
        with no_request_deadline():
            await fn(*args)
    except Exception:  # noqa: BLE001 - a bug in work ahead must not unmount
        log.exception("work ahead of the reader failed")


@dataclass
class _Cached:
    index: ShardIndex | None  # None: the shard is known to be absent
    parsed_as: Any = None  # (the format's parses_as, shard_ctx) it was parsed with
    checked: float = field(default_factory=time.monotonic)


#: index_now's answer when the cache alone cannot answer (index() must)
NOT_CACHED = object()


def _parsed_as(fmt: ShardFormat, shard_ctx: Any) -> Any:
    """What an index parsed by ``fmt`` for ``shard_ctx`` depends on."""
    return getattr(fmt, "parses_as", None), shard_ctx


class ShardCache:
    """Loads shard indexes through a :class:`ShardFormat`, caches them, and
    reads chunks pinned to the cached version."""

    def __init__(self, store: AsyncStore, *, index_cache_bytes: int = 64 << 20, index_ttl: float = 1.0,
                 chunk_cache_bytes: int = 64 << 20, prefetch: bool = False, prefetch_max: int = 16 << 20,
                 prefetch_gap: int = 1 << 20, prefetch_ahead: int = 0, keep_handed_over: bool = True):
        self.store = store
        self.indexes = ByteLRU(index_cache_bytes)
        self.chunks = ByteLRU(chunk_cache_bytes)
        # a chunk the kernel's page cache holds whole is kept (evicted
        # first) where fetching it again costs a request (S3), and let go
        # of where it costs a read of the page cache (see handed_over)
        self.keep_handed_over = keep_handed_over
        # (the last chunk or index larger than its whole cache is kept beside
        # it: see ByteLRU)
        self.index_ttl = index_ttl
        # one loader per shard at a time: concurrent readers share one request
        self._loads = SingleFlight()
        # bytes of indexes being loaded at once, at most the index cache's
        # budget (one larger index loads alone): each load holds its raw
        # bytes and its table, and a store declaring 2**24-chunk shards would
        # otherwise take gigabytes with a few parallel lookups
        self._loading_bytes = 0
        self._loading_room = trio.Condition()
        # shards forgotten (rewritten) while their index was loading: that
        # load may have read the old version and must not be cached
        self._forgotten: set[str] = set()
        # read-ahead: a scan through shards fetches each shard's chunks in a
        # few coalesced ranged GETs instead of one GET per chunk; one fetch
        # lands in the chunk cache, so it takes at most a quarter of it
        self.prefetch = prefetch
        self.prefetch_max = min(prefetch_max, max(chunk_cache_bytes // 4, 1))
        self.prefetch_gap = prefetch_gap
        # scan detection: where the last read of each recent shard ended
        # (chunk id, end offset), and how many reads in a row continued one
        self._positions: OrderedDict[str, tuple[int, int]] = OrderedDict()
        self._walk = 0
        #: the last miss that had a predecessor in its shard did not continue it
        self._strayed = False
        # listings of chunk directories in walk order in a row (see listed),
        # and the last one's coordinates
        self._list_walk, self._listed = 0, ()
        self._list_granted = 0  # shards read ahead for a listing walk since the last read (at most LIST_AHEAD)
        # chunks read-ahead is fetching, by shard version: chunk id -> set
        # once that chunk is cached (or its fetch given up)
        self._coming: dict[tuple[str, str], dict[int, trio.Event]] = {}
        self._fetching = SingleFlight()  # chunk GETs in flight, by (key, etag, chunk id): concurrent readers share one
        self.prefetches = 0
        # bytes per second a GET of chunk data achieved (an estimate that
        # errs low: see _observed), which sizes read-ahead's GETs; None: none timed yet
        self._rate: float | None = None
        timeout = float(getattr(store, "timeout", 60.0))
        # read-ahead GETs aim at piece_time each, and are given up (no answer
        # awaited, no error) after half the deadline: a call the deadline ends
        # fails the same key at once for a moment (AsyncStore.FAIL_FAST), the
        # reader's included.  A reader waits for a piece at most `patience`,
        # then reads its chunk itself.
        self._piece_time = min(PIECE_TIME, timeout / 8)
        self._give_up = timeout / 2
        self._patience = 2 * self._piece_time
        # read-ahead across shards (see _read_ahead): shards whose index was
        # loaded (by a listing or lookup) and none of whose chunks was read
        # yet, in load order (for expiry), each with its scan_order; and
        # those fetched in the background but not read yet
        self.prefetch_ahead = min(prefetch_ahead, chunk_cache_bytes // 2) if prefetch else 0
        self._unread: OrderedDict[str, tuple[ShardFormat, Any, int, float, tuple]] = OrderedDict()
        self._ahead: dict[str, tuple[float, int]] = {}  # key -> (started, bytes)
        self._ahead_running = 0
        self._reading_key, self._reading = "", ()  # the shard read last, its scan_order
        self._nursery: trio.Nursery | None = None
        self.read_aheads = 0
        # any fresh answer from storage about a shard re-validates its index
        observers = getattr(store, "observers", None)
        if observers is not None:
            observers.append(self._observe)

    async def index(self, fmt: ShardFormat, key: str, shard_ctx: Any = None, *,
                    expired_ok: bool = False, checked_since: float | None = None) -> ShardIndex | None:
        """The current index of shard ``key`` (None: no such shard).

        ``expired_ok``: a cached index past ``index_ttl`` is returned without
        re-validation, for a caller that pins its next read to that version
        (the pinned GET re-validates it, or fails with 412 and the caller
        reloads): a HEAD saved.  ``checked_since`` (a ``time.monotonic()``):
        one loaded or validated since then is current enough, whatever
        ``index_ttl`` (a listing that loaded its shards' indexes together
        does not validate them again one by one when their loads outlasted
        the TTL: on a slow link, a HEAD per shard in a row)."""
        while True:
            found = self.index_now(fmt, key, shard_ctx, expired_ok=expired_ok, checked_since=checked_since)
            if found is not NOT_CACHED:
                return found
            # hits and misses count answers, not callers: a caller that waits
            # for another's load is neither
            cached: _Cached | None = self.indexes.peek(key)
            if cached is not None and cached.parsed_as != _parsed_as(fmt, shard_ctx):
                # the layout's metadata changed (another client's zarr.json or
                # info) while the shard did not: what was parsed under the old
                # format, index and decoded chunks, is parsed again
                self.forget(key)
                self.chunks.pop_where(lambda k: k[0] == key)
                cached = None
            if cached is not None:  # (due for validation: index_now answered a fresh one)
                if await self._still_valid(key, cached):
                    cached.checked = time.monotonic()
                    self.indexes.touch(key)
                    return cached.index
                self.indexes.pop(key)
            if not await shared_within_deadline(self._loads, key, key):
                break
        self.indexes.misses += 1
        with self._loads.loading(key):
            try:
                async with self._index_room(fmt, shard_ctx, key):
                    index = await fmt.load_index(self.store, key, shard_ctx)
            finally:
                forgotten = key in self._forgotten
                self._forgotten.discard(key)
            if not forgotten:  # else replaced meanwhile: waiters load again
                self.indexes.put(key, _Cached(index, _parsed_as(fmt, shard_ctx)), 256 + (index.nbytes if index else 0))
                if index is not None and self.prefetch_ahead:
                    self._unread[key] = (fmt, shard_ctx, min(index.info.size, self.prefetch_max), time.monotonic(),
                                         scan_order(key))
                    self._unread.move_to_end(key)
                    if len(self._unread) > SCAN_SHARDS:
                        self._unread.popitem(last=False)
            return index

    def index_now(self, fmt: ShardFormat, key: str, shard_ctx: Any = None, *, expired_ok: bool = False,
                  checked_since: float | None = None) -> ShardIndex | None | object:
        """What :meth:`index` answers from the cache alone, with no I/O and
        no await: the cached index (None: the shard is known to be absent),
        counted as a hit; NOT_CACHED when :meth:`index` must look further
        (not cached, parsed under another format, or due for validation).
        Every lookup and read of a chunk asks first: a coroutine fewer each."""
        cached: _Cached | None = self.indexes.peek(key)
        if cached is None or cached.parsed_as != _parsed_as(fmt, shard_ctx):
            return NOT_CACHED
        if (time.monotonic() - cached.checked < self.index_ttl or (expired_ok and cached.index is not None)
                or (checked_since is not None and cached.checked >= checked_since)):
            self.indexes.touch(key)
            return cached.index
        return NOT_CACHED

    @contextlib.asynccontextmanager
    async def _index_room(self, fmt: ShardFormat, shard_ctx: Any, key: str):
        """Wait until an index of this size may load (see ``_loading_bytes``)."""
        size = fmt.index_size(shard_ctx) if hasattr(fmt, "index_size") else 0
        async with self._loading_room:
            if self._loading_bytes and self._loading_bytes + size > self.indexes.max_bytes:
                # the loads that hold the room may have begun after this
                # request, and end after its deadline: waited for until then
                with trio.move_on_at(request_deadline_at()):
                    while self._loading_bytes and self._loading_bytes + size > self.indexes.max_bytes:
                        await self._loading_room.wait()
                if self._loading_bytes and self._loading_bytes + size > self.indexes.max_bytes:
                    raise Unavailable(f"{key}: other index loads still hold the room for its index at the "
                                      "request's deadline", key)
            self._loading_bytes += size
        try:
            yield
        finally:
            with trio.CancelScope(shield=True):
                async with self._loading_room:
                    self._loading_bytes -= size
                    self._loading_room.notify_all()

    async def _still_valid(self, key: str, cached: _Cached) -> bool:
        info = await self.store.stat(key)
        if cached.index is None:
            return info is None
        return info is not None and info.etag == cached.index.info.etag

    def _observe(self, info: ObjectInfo) -> None:
        """Storage just told us the current version of ``info.key`` (a
        listing, a HEAD, a pinned GET): a cached index of that version is
        valid for another ``index_ttl``, one of another version is dropped.
        This is what saves a scan its re-validation HEADs."""
        cached: _Cached | None = self.indexes.peek(info.key)
        if cached is None or cached.index is None:
            return
        if cached.index.info.etag == info.etag:
            cached.checked = time.monotonic()
        else:
            self.indexes.pop(info.key)

    def forget(self, key: str) -> None:
        """Drop what is cached of one shard (after a write, or a mismatch)."""
        self.indexes.pop(key)
        if key in self._loads:
            self._forgotten.add(key)

    def forget_where(self, match) -> None:
        """:meth:`forget` every shard whose key ``match`` accepts, loads under
        way included (a walk of them all: a directory's rename)."""
        self.indexes.pop_where(match)
        self._forgotten.update(k for k in self._loads.keys() if match(k))

    def _expired(self, key: str) -> bool:
        cached: _Cached | None = self.indexes.peek(key)
        return cached is not None and time.monotonic() - cached.checked >= self.index_ttl

    async def locate(self, fmt: ShardFormat, key: str, chunk_id: int, shard_ctx: Any = None):
        """(index, offset, nbytes) of a stored chunk, or None."""
        index = await self.index(fmt, key, shard_ctx)
        if index is None:
            return None
        where = await index.locate(chunk_id)
        if where is None:
            return None
        return index, where[0], where[1]

    def handed_over(self, key: str, chunk_id: int) -> None:
        """The reader holds all of this chunk now (the kernel's page cache
        has it): evict it before anything not yet read.  A scan of a store
        about the chunk cache's size would otherwise evict, with every chunk
        it fetches, the oldest cached one, which is the next one a second
        scan reads: one GET per chunk instead of per shard.

        Without ``keep_handed_over`` (a local store) its bytes go at once:
        the kernel would only ask for it again after dropping its pages, and
        then a read of the shard's pages costs about what a hit does.  Kept,
        every chunk a fresh mount reads took new memory until the cache was
        full, 8 page faults per 32 KiB (about 20 us of the daemon's CPU per
        random chunk read, docs/PERFORMANCE.md); let go of, the next chunk's
        bytes reuse its memory.  The key stays known (ByteLRU.let_go), so
        read-ahead, which fetches the chunks of a shard not cached, does not
        fetch it again."""
        cached: _Cached | None = self.indexes.peek(key)
        if cached is not None and cached.index is not None:
            if self.keep_handed_over:
                self.chunks.demote((key, cached.index.info.etag, chunk_id))
            else:
                self.chunks.let_go((key, cached.index.info.etag, chunk_id), CHUNK_ENTRY_OVERHEAD)

    async def read_chunk(self, fmt: ShardFormat, key: str, chunk_id: int, shard_ctx: Any = None) -> bytes | None:
        """The whole stored chunk as the view shows it, or None if absent."""
        if self.prefetch_ahead:
            self._unread.pop(key, None)
            self._list_granted = 0
            if key != self._reading_key:  # (runs of reads in one shard: parse its key once)
                self._reading_key, self._reading = key, scan_order(key)
            if self._ahead.pop(key, None) is not None or self._walk >= 2:
                self._read_ahead()
        scan = None
        for attempt in range(3):
            index = self.index_now(fmt, key, shard_ctx, expired_ok=True)
            if index is NOT_CACHED:
                index = await self.index(fmt, key, shard_ctx, expired_ok=True)
            try:
                where = (None if index is None else index.locate_now(chunk_id) if getattr(index, "sync_locate", False)
                         else await index.locate(chunk_id))
            except CorruptData:
                if not self._expired(key):
                    raise
                # damage found (and kept) in a version that may have been
                # replaced since: only the current one may say so
                index = await self.index(fmt, key, shard_ctx)
                where = await index.locate(chunk_id) if index is not None else None
            if ((where is None or where[1] == 0 or (key, index.info.etag, chunk_id) in self.chunks)
                    and self._expired(key)):
                # answered from caches alone (no pinned GET): only a current version may do that
                index = await self.index(fmt, key, shard_ctx)
                where = await index.locate(chunk_id) if index is not None else None
            if where is None:
                return None
            offset, nbytes = where
            ckey = (key, index.info.etag, chunk_id)
            data = self.chunks.get(ckey)
            if scan is None and self.prefetch:
                scan = self._scanning(key, chunk_id, offset, nbytes, hit=data is not None)
            if data is not None:
                return data
            coming = self._coming.get((key, index.info.etag), {}).get(chunk_id)
            if coming is not None:  # read-ahead is fetching it: wait a little, not for its deadline
                data = await self._wait(coming, ckey)
                if data is not None:
                    return data
                if not self._current(key, index):
                    continue  # the fetch found the shard changed
            if nbytes == 0:
                return fmt.decode_chunk(b"")
            if offset + nbytes > index.info.size:
                raise CorruptData(f"{key}: chunk {chunk_id} at {offset}+{nbytes} lies past the end of the shard "
                                  f"({index.info.size} bytes)", key)
            if nbytes > MAX_CHUNK_BYTES:
                raise CorruptData(f"{key}: chunk {chunk_id} of {nbytes} bytes is larger than the "
                                  f"{MAX_CHUNK_BYTES >> 20} MiB a chunk may have", key)
            if scan and coming is None:
                data = await self._read_ahead_from(fmt, key, index, chunk_id)
                if data is not None:
                    return data
                if not self._current(key, index):
                    continue
            if ckey not in self._fetching and _decoding(fmt, nbytes) <= HEAVY:
                # a page-cache hit (local store): read and kept with no await
                # in between, so no other reader can be fetching it meanwhile,
                # and the single flight's marks are not needed
                t0 = time.monotonic()
                blob = self.store.get_pinned_nowait(key, offset, nbytes, index.info.etag)
                if blob is not None and len(blob.data) == nbytes:
                    self._observed(nbytes, time.monotonic() - t0)
                    data = fmt.decode_chunk(blob.data)
                    self.chunks.put(ckey, data, len(data) + CHUNK_ENTRY_OVERHEAD)
                    return data
            while await shared_within_deadline(self._fetching, ckey, key):  # another reader fetches it: share it
                data = self.chunks.get(ckey)
                if data is not None:
                    return data
            with self._fetching.loading(ckey):
                try:
                    blob = await self._timed(key, offset, nbytes, index.info.etag)
                except (PreconditionFailed, NotFound):
                    log.debug("%s changed while reading; reloading its index", key)
                    self.forget(key)
                    continue
                if len(blob.data) != nbytes:
                    raise CorruptData(f"{key}: chunk {chunk_id} is truncated ({len(blob.data)} of {nbytes} bytes)",
                                      key)
                data = await off_loop(functools.partial(fmt.decode_chunk, blob.data), _decoding(fmt, len(blob.data)))
                self.chunks.put(ckey, data, len(data) + CHUNK_ENTRY_OVERHEAD)
                return data
        raise CorruptData(f"{key}: shard keeps changing while being read", key)

    def _scanning(self, key: str, chunk_id: int, offset: int, nbytes: int, hit: bool) -> bool:
        """Record a chunk read; True when a miss should fetch ahead.

        Reads *walk* when a read continues the previous read of the same
        shard (the next chunk id, or the bytes right after it), whatever was
        read from other shards in between.  That matters: the view lists a
        multi-dimensional array in C order over the inner-chunk grid, so a
        scan (``cp -r``, ``find | xargs cat``) visits each shard in many
        short runs, interleaved with the runs of all its neighbours along the
        last dimensions; "the previous read" must be per shard.

        A miss that continues its shard's previous read fetches ahead in
        that shard; once two reads in a row have walked, so does the first
        read of a shard (which is how a scan gets one GET per shard).  A
        miss that does not continue its shard's previous read ends the walk
        (random reads), and the continuation that comes right after such a
        stray is taken for chance, fetching nothing ahead: among random
        reads about one in a shard's chunk count meets its predecessor so,
        and each fetched a whole shard (``prefetch_max``) for one chunk.
        Only a second continuation in a row then fetches ahead.  A scan's
        start (no stray before it) fetches at its first continuation.
        Cache hits never end a walk (sparse shards and chunks clipped at the
        array's edge skip ids)."""
        prev = self._positions.pop(key, None)
        self._positions[key] = (chunk_id, offset + nbytes)
        if len(self._positions) > SCAN_SHARDS:
            self._positions.popitem(last=False)
        if hit:
            if prev is not None and (chunk_id == prev[0] + 1 or (offset == prev[1] and chunk_id != prev[0])):
                self._walk += 1
            return False
        if prev is None:
            return self._walk >= 2
        if chunk_id == prev[0] + 1 or (offset == prev[1] and chunk_id != prev[0]):
            self._walk += 1
            chance, self._strayed = self._strayed, False
            return not chance or self._walk >= 2
        self._walk = self._list_walk = 0
        self._strayed = True
        return False

    async def preload(self, fmt: ShardFormat, shards: list[tuple[str, Any]], ahead: bool = False) -> None:
        """Load the indexes of several shards at once, for a listing that
        needs them all: their requests overlap instead of queueing one after
        another.  They are sent in :func:`scan_order`, no more at a time
        than the store has connections, so that the directories a walk lists
        first get theirs first.  Errors are left to the caller's own
        :meth:`index` call, which reports them.

        ``ahead``: nobody needs them yet (:meth:`preload_soon`); a load with
        no answer after half the deadline is given up, before the deadline
        ends it and fail-fast fails the reader's own load of that index."""
        todo = sorted(((k, c) for k, c in shards if self.indexes.peek(k) is None),
                      key=lambda kc: scan_order(kc[0]))[:PRELOAD_MAX]
        if len(todo) < 2:
            return
        slots = trio.Semaphore(max(2, int(self.store.limiter.total_tokens)))

        async def one(key: str, ctx: Any) -> None:
            try:
                with trio.move_on_after(self._give_up if ahead else math.inf):
                    await self.index(fmt, key, ctx)
            except Exception as exc:  # noqa: BLE001 - reported by the caller's own load
                log.debug("preload of %s: %s", key, exc)
            finally:
                slots.release()

        async with trio.open_nursery() as nursery:
            for key, ctx in todo:
                await slots.acquire()
                nursery.start_soon(one, key, ctx)

    def listed(self, where: tuple, keys: list[str]) -> None:
        """A listing of the chunk directory at ``where`` (its coordinates)
        loaded the indexes of its shards ``keys``.  LIST_WALK listings in a
        row, each of a directory after the last (C order: how a walk meets
        them), are a walk (``find``, ``cp -r``) that lists before it reads:
        read-ahead starts with the first shards now, while the walk lists
        on, instead of at its first reads."""
        if not keys or not self.prefetch_ahead:
            return
        self._list_walk = self._list_walk + 1 if where > self._listed else 0
        self._listed = where
        self._read_ahead()

    def soon(self, fn, *args) -> None:
        """Run ``fn(*args)`` in the background, when read-ahead is on: work
        ahead of a walk (loading indexes of directories it is about to
        list).  Nobody waits for it: its failures are logged, never raised
        into the daemon's nursery."""
        if self._nursery is not None and self.prefetch_ahead:
            self._nursery.start_soon(_guarded, fn, *args)

    def preload_soon(self, fmt: ShardFormat, shards: list[tuple[str, Any]]) -> None:
        """:meth:`preload` in the background (see :meth:`soon`)."""
        self.soon(self.preload, fmt, shards, True)

    def table_sizes(self) -> dict[str, int]:
        """Entries of this layer's tables (see Operations.table_sizes)."""
        return {"indexes": len(self.indexes), "chunks": len(self.chunks), "index_loads": len(self._loads),
                "forgotten_loads": len(self._forgotten), "positions": len(self._positions),
                "coming": sum(map(len, self._coming.values())), "chunk_fetches": len(self._fetching),
                "unread": len(self._unread), "ahead": len(self._ahead)}

    def start(self, nursery: trio.Nursery | None) -> None:
        """Where background read-ahead runs (the daemon's nursery); None
        once that nursery is closed (the final sync at unmount reads without
        read-ahead: a closed nursery takes no new tasks)."""
        self._nursery = nursery

    def _read_ahead(self) -> None:
        """While reads walk (a scan), fetch whole shards ahead of the reader
        in the background, so that their GETs overlap the reader's work
        instead of each stalling it.

        Which shards: those whose index was loaded (listings run ahead of a
        scan's reads: ``find``, ``cp -r``, ``rsync`` list a directory before
        reading its files) within AHEAD_STALE seconds and none of whose
        chunks was read yet; the next ones after the reader's current shard
        in :func:`scan_order` first, then those behind it.  How many: at
        most AHEAD_PARALLEL GETs at a time, and at most ``prefetch_ahead``
        bytes fetched but not yet read (a shard counts until its first chunk
        is read, or for AHEAD_STALE seconds), so read-ahead cannot evict
        what the reader is about to use.  Best effort: failures are left to
        the real reads."""
        listing = self._walk < 2  # (else reads walk)
        if (self._nursery is None or (listing and (self._list_walk < LIST_WALK or self._list_granted >= LIST_AHEAD))
                or self._ahead_running >= AHEAD_PARALLEL or not self._unread):
            return
        now = time.monotonic()
        for key in [k for k, (t, _) in self._ahead.items() if now - t > AHEAD_STALE]:
            del self._ahead[key]
        pending = sum(n for _, n in self._ahead.values())
        if self._ahead and pending >= self.prefetch_ahead:
            return
        while self._unread and next(iter(self._unread.values()))[3] < now - AHEAD_STALE:
            self._unread.popitem(last=False)  # listed long ago: not what this scan follows
        slots = AHEAD_PARALLEL - self._ahead_running
        if self._rate is None:
            # no GET timed yet: every shard's GETs would be PIECE_FIRST
            # each (two or more per shard); one shard until the first is
            slots = 1 - self._ahead_running
            if slots <= 0:
                return
        if listing:
            slots = min(slots, LIST_AHEAD - self._list_granted)
        ahead = [(v[4], k) for k, v in self._unread.items() if v[4] > self._reading]
        behind = [(v[4], k) for k, v in self._unread.items() if v[4] <= self._reading] if len(ahead) < slots else []
        for _, key in heapq.nsmallest(slots, ahead) + heapq.nsmallest(slots - min(len(ahead), slots), behind):
            fmt, ctx, nbytes, _, _ = self._unread[key]
            if self._ahead and pending + nbytes > self.prefetch_ahead:
                return
            del self._unread[key]
            self._ahead[key] = (now, nbytes)
            pending += nbytes
            self._ahead_running += 1
            self._list_granted += listing
            self.read_aheads += 1
            self._nursery.start_soon(_guarded, self._fetch_ahead, fmt, key, ctx)

    async def _fetch_ahead(self, fmt: ShardFormat, key: str, shard_ctx: Any) -> None:
        try:
            index = None
            with trio.move_on_after(self._give_up):  # (loaded by a listing, usually: no request)
                index = await self.index(fmt, key, shard_ctx, expired_ok=True)
            if index is not None and key in self._ahead:
                await self._prefetch(fmt, key, index, 0)
        except Exception as exc:  # noqa: BLE001 - best effort; the reader's own read reports errors
            log.debug("read-ahead of %s: %s", key, exc)
            if isinstance(exc, (PreconditionFailed, NotFound)):
                self.forget(key)
        finally:
            self._ahead_running -= 1
        self._read_ahead()  # the next one, if the reader still walks

    async def _read_ahead_from(self, fmt: ShardFormat, key: str, index: ShardIndex, chunk_id: int) -> bytes | None:
        """A scan's miss: fetch this chunk and the ones after it
        (:meth:`_prefetch`) in the background, and wait for this one at most
        ``patience``.  None: not there in time, or not fetched (the reader
        then reads it alone; the fetch goes on and caches what it gets).

        The first GET holds this chunk and is sized to take about
        ``piece_time``, so the reader waits about as long as for a plain
        read; what follows comes in GETs of the same size, one after
        another, while the reader reads.  On a fast link that is one GET of
        up to ``prefetch_max``, as before; on a slow one, where a GET of
        ``prefetch_max`` would outlast ``-o timeout``, a reader used to wait
        for the whole deadline, and then fail: that GET's missing answer was
        its error, and fail-fast then failed its next read of the shard."""
        if self._nursery is None:  # a cache used on its own: the reader's piece only, in its own request
            return await self._prefetch(fmt, key, index, chunk_id, pieces=1)
        event = trio.Event()
        self._coming.setdefault((key, index.info.etag), {})[chunk_id] = event
        self._nursery.start_soon(_guarded, self._prefetch, fmt, key, index, chunk_id, event)
        return await self._wait(event, (key, index.info.etag, chunk_id))

    async def _wait(self, event: trio.Event, ckey: tuple) -> bytes | None:
        """The chunk read-ahead is fetching, if it comes within ``patience``."""
        with trio.move_on_after(self._patience):
            await event.wait()
        return self.chunks.get(ckey)

    def _current(self, key: str, index: ShardIndex) -> bool:
        """May a reader go on with ``index`` after waiting for read-ahead:
        no other index of ``key`` is cached?  None cached is not "replaced":
        an index evicted for room (a small ``index_cache``) says nothing of
        the shard, nor does one forgotten because read-ahead found it
        changed, since the reader's own read is pinned to ``index``'s version
        (a replaced shard fails it, and the reader loads the index again).
        Taking no index for a replacement, a reader whose index was evicted
        during each of its three waits failed with "shard keeps changing"."""
        cached: _Cached | None = self.indexes.peek(key)
        return cached is None or cached.index is index

    async def _timed(self, key: str, start: int, length: int, etag: str):
        """A pinned GET of chunk data whose throughput feeds the estimate
        that sizes read-ahead's GETs (:meth:`_observed`)."""
        t0 = time.monotonic()
        blob = await self.store.get(key, start, length, if_match=etag)
        self._observed(len(blob.data), time.monotonic() - t0)
        return blob

    def _observed(self, nbytes: int, seconds: float) -> None:
        """A GET of ``nbytes`` took ``seconds``.  The time includes the round
        trip (and any wait for a connection), so bytes/seconds errs low, on
        the safe side: a GET k times as large takes at most k times as long.
        The estimate is the best rate seen, so it grows with the GETs (a
        4 KiB chunk's says little about bandwidth), except that a GET large
        enough to be bound by bandwidth that was slower pulls it down (the
        link got slower, or is shared now)."""
        if nbytes < PIECE_MIN:
            return  # a round trip's worth: says nothing of bandwidth (and would size the first pieces tiny)
        rate = nbytes / max(seconds, 1e-6)
        if self._rate is None or rate > self._rate:
            self._rate = rate
        elif nbytes >= self._piece_bytes() // 4:
            self._rate = (self._rate + rate) / 2

    def _piece_bytes(self) -> int:
        """Bytes one read-ahead GET may ask for: about ``piece_time`` worth."""
        if self._rate is None:
            return PIECE_FIRST
        return max(PIECE_MIN, int(self._rate * self._piece_time))

    def _piece(self, near: list[tuple[int, int, int]], i: int, fetched: list[tuple[int, int]]) -> tuple[int, int]:
        """The byte range of the next read-ahead GET: chunk ``near[i]`` (the
        one the reader needs soonest; ``near`` is sorted by offset) and the
        chunks around it in the shard, after it first, as long as the gaps
        are at most ``prefetch_gap``, the range at most ``_piece_bytes``,
        and it takes in no range ``fetched`` before."""
        budget = self._piece_bytes()
        start = near[i][1]
        end = start + near[i][2]

        def fits(lo: int, hi: int) -> bool:
            return hi - lo <= budget and not any(a < hi and b > lo for a, b in fetched)

        for k in range(i + 1, len(near)):
            _, off, n = near[k]
            if off - end > self.prefetch_gap or not fits(start, max(end, off + n)):
                break
            end = max(end, off + n)
        for k in range(i - 1, -1, -1):
            _, off, n = near[k]
            if start - (off + n) > self.prefetch_gap or not fits(off, max(end, off + n)):
                break
            start, end = off, max(end, off + n)
        return start, end

    def _release(self, key: str, etag: str, events: dict[int, trio.Event]) -> None:
        """These chunks are no longer coming (cached, or given up): wake
        their readers."""
        coming = self._coming.get((key, etag))
        for cid, event in events.items():
            if coming is not None and coming.get(cid) is event:
                del coming[cid]
            event.set()
        if coming is not None and not coming:
            del self._coming[(key, etag)]
        events.clear()

    async def _prefetch(self, fmt: ShardFormat, key: str, index: ShardIndex, chunk_id: int,
                        event: trio.Event | None = None, pieces: int | None = None) -> bytes | None:
        """Fetch stored chunks of the shard that are not cached, in the order
        a scan reads them (ascending chunk id from ``chunk_id``, then the
        ones before it), at most ``prefetch_max`` bytes; in ranged GETs of
        about ``piece_time`` each (:meth:`_piece`), one after another, the
        one holding ``chunk_id`` first (``pieces``: at most that many).
        Every chunk that lies whole in a fetched range is cached.  Readers of
        the chunks it will fetch wait for them (``_coming``; ``event`` is
        ``chunk_id``'s, registered by the caller).

        Best effort, and never what makes a read fail: errors are logged (a
        changed shard is forgotten, so its readers reload the index), a GET
        with no answer after half the deadline is given up.  Returns the
        wanted chunk's data (None: not fetched)."""
        etag, size = index.info.etag, index.info.size
        mine: dict[int, trio.Event] = {} if event is None else {chunk_id: event}
        try:
            with trio.move_on_after(self._give_up) as scope:  # precomputed: may read minishard indexes
                entries = [(cid, off, n) for cid, off, n in await index.entries()
                           if n and off + n <= size and n <= MAX_CHUNK_BYTES]
            if scope.cancelled_caught:
                return None
            coming = self._coming.setdefault((key, etag), {})
            todo = sorted((e for e in entries if (e[0] not in coming or e[0] in mine)
                           and not self.chunks.known((key, etag, e[0]))),
                          key=lambda e: (e[0] < chunk_id, e[0]))
            chosen, total = [], 0
            for e in todo:
                if total + e[2] > self.prefetch_max and chosen:
                    break
                chosen.append(e)
                total += e[2]
            for cid, _, _ in chosen:
                if cid not in mine:
                    mine[cid] = coming[cid] = trio.Event()
            if chosen:
                self.prefetches += 1
                await self._fetch(fmt, key, etag, entries, chosen, mine, pieces)
        except StoreError as exc:  # (CorruptData: damage elsewhere in the shard is not this chunk's)
            log.debug("read-ahead of %s: %s", key, exc)
            if isinstance(exc, (PreconditionFailed, NotFound)):
                self.forget(key)
        finally:
            self._release(key, etag, mine)
        return self.chunks.peek((key, etag, chunk_id))

    async def _fetch(self, fmt: ShardFormat, key: str, etag: str, entries: list[tuple[int, int, int]],
                     chosen: list[tuple[int, int, int]], mine: dict[int, trio.Event], pieces: int | None) -> None:
        """:meth:`_prefetch`'s GETs: ``chosen`` (in the order the reader
        needs them) in pieces (:meth:`_piece`) one after another."""
        by_offset = sorted(entries, key=lambda e: e[1])
        offsets = [off for _, off, _ in by_offset]
        near = sorted(chosen, key=lambda e: e[1])
        near_offsets = [off for _, off, _ in near]
        place = {cid: i for i, (cid, _, _) in enumerate(near)}
        fetched: list[tuple[int, int]] = []  # byte ranges asked for
        done: set[int] = set()  # chosen chunks that lay whole in one
        head = 0
        while pieces != 0:
            while head < len(chosen) and chosen[head][0] in done:
                head += 1
            if head == len(chosen):
                return
            start, end = self._piece(near, place[chosen[head][0]], fetched)
            fetched.append((start, end))
            t0 = time.monotonic()
            with trio.move_on_after(self._give_up) as scope:
                blob = await self.store.get(key, start, end - start, if_match=etag, speculative=True)
            took = time.monotonic() - t0
            if scope.cancelled_caught:
                # Given up before the deadline ends it: that would fail this
                # shard's next GET (the reader's) at once, for a moment.
                rate = (end - start) / took  # more than the link gives now
                self._rate = min(self._rate or rate, rate) / 2
                log.debug("read-ahead of %s: no answer for %d bytes in %.1fs; given up", key, end - start, took)
                return
            self._observed(len(blob.data), took)
            got = start + len(blob.data)
            arrived_raw = []
            for i in range(bisect.bisect_left(offsets, start), len(by_offset)):
                cid, off, n = by_offset[i]
                if off >= got:
                    break
                if off + n > got or self.chunks.known((key, etag, cid)):
                    continue
                arrived_raw.append((cid, blob.data[off - start: off - start + n]))

            def decode_all(raw=arrived_raw):
                out = []
                for cid, data in raw:
                    try:
                        out.append((cid, fmt.decode_chunk(data)))
                    except (CorruptData, ValueError, OSError):
                        pass  # reported if and when that chunk itself is read
                return out

            for cid, decoded in await off_loop(decode_all, _decoding(fmt, sum(len(d) for _, d in arrived_raw))):
                self.chunks.put((key, etag, cid), decoded, len(decoded) + CHUNK_ENTRY_OVERHEAD)
            arrived = {}
            for i in range(bisect.bisect_left(near_offsets, start), len(near)):
                cid, off, n = near[i]
                if off >= end:
                    break
                if off + n <= end:
                    done.add(cid)
                    if cid in mine:
                        arrived[cid] = mine.pop(cid)
            self._release(key, etag, arrived)  # (not cached: damaged, or the shard was shorter)
            if pieces is not None:
                pieces -= 1
