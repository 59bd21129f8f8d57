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
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Protocol

import trio

from .backends.base import AsyncStore, CorruptData, NotFound, ObjectInfo, PreconditionFailed

log = logging.getLogger(__name__)

EMPTY = 2**64 - 1


class ShardIndex(Protocol):
    """A loaded shard index (one version of one shard)."""

    info: ObjectInfo  # the shard object's version (etag, size, mtime)
    nbytes: int  # memory it costs, for the cache budget

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

    def decode_chunk(self, data: bytes) -> bytes:
        """Stored chunk bytes -> the bytes the view shows (identity for Zarr)."""

    def encode_chunk(self, data: bytes) -> bytes:
        """The inverse of decode_chunk, for chunks written through the view."""


class ByteLRU:
    """An LRU mapping bounded by the sum of its values' declared sizes."""

    def __init__(self, max_bytes: int):
        self.max_bytes = max_bytes
        self.bytes = 0
        self._d: OrderedDict[Any, tuple[Any, int]] = OrderedDict()
        self.hits = 0
        self.misses = 0

    def get(self, key):
        item = self._d.get(key)
        if item is None:
            self.misses += 1
            return None
        self._d.move_to_end(key)
        self.hits += 1
        return item[0]

    def put(self, key, value, nbytes: int) -> None:
        self.pop(key)
        if nbytes > self.max_bytes:
            return
        self._d[key] = (value, nbytes)
        self.bytes += nbytes
        while self.bytes > self.max_bytes:
            _, (_, n) = self._d.popitem(last=False)
            self.bytes -= n

    def __contains__(self, key) -> bool:
        return key in self._d

    def pop(self, key) -> None:
        item = self._d.pop(key, None)
        if item is not None:
            self.bytes -= item[1]

    def __len__(self):
        return len(self._d)


@dataclass
class _Stream:
    """Recent reads below one directory of shards (about one dataset)."""

    shard: str = ""
    last_id: int = -2  # the chunk read last from ``shard``...
    last_end: int = -1  # ...and where it ends in the shard
    sequential: bool = False  # two neighbouring chunks of ``shard`` were read
    previous_sequential: bool = False  # ... of the shard read before it
    prefetched: bool = False


@dataclass
class _Cached:
    index: ShardIndex | None  # None: the shard is known to be absent
    checked: float = field(default_factory=time.monotonic)


class ShardCache:
    """Loads shard indexes through a :class:`ShardFormat`, caches them, and
    reads chunks pinned to the cached version."""

    def __init__(self, store: AsyncStore, *, index_cache_bytes: int = 64 << 20, index_ttl: float = 1.0,
                 chunk_cache_bytes: int = 64 << 20, prefetch: bool = False, prefetch_max: int = 16 << 20,
                 prefetch_gap: int = 1 << 20):
        self.store = store
        self.indexes = ByteLRU(index_cache_bytes)
        self.chunks = ByteLRU(chunk_cache_bytes)
        self.index_ttl = index_ttl
        # one loader per shard at a time: concurrent readers share one request
        self._loading: dict[str, trio.Event] = {}
        # read-ahead: a scan through shards fetches each shard's chunks in a
        # few coalesced ranged GETs instead of one GET per chunk
        self.prefetch = prefetch
        self.prefetch_max = min(prefetch_max, max(chunk_cache_bytes // 4, 1))
        self.prefetch_gap = prefetch_gap
        self._streams: OrderedDict[str, _Stream] = OrderedDict()
        self._prefetching: dict[tuple[str, str], tuple[set[int], trio.Event]] = {}
        self.prefetches = 0

    async def index(self, fmt: ShardFormat, key: str, shard_ctx: Any = None) -> ShardIndex | None:
        """The current index of shard ``key`` (None: no such shard)."""
        while True:
            cached: _Cached | None = self.indexes.get(key)
            if cached is not None:
                if time.monotonic() - cached.checked < self.index_ttl:
                    return cached.index
                if await self._still_valid(key, cached):
                    cached.checked = time.monotonic()
                    return cached.index
                self.indexes.pop(key)
            pending = self._loading.get(key)
            if pending is None:
                break
            await pending.wait()
        event = self._loading[key] = trio.Event()
        try:
            index = await fmt.load_index(self.store, key, shard_ctx)
            self.indexes.put(key, _Cached(index), 256 + (index.nbytes if index else 0))
            return index
        finally:
            del self._loading[key]
            event.set()

    async def _still_valid(self, key: str, cached: _Cached) -> bool:
        info = await self.store.stat(key)
        if cached.index is None:
            return info is None
        return info is not None and info.etag == cached.index.info.etag

    def forget(self, key: str) -> None:
        """Drop what is cached of one shard (after a write, or a mismatch)."""
        self.indexes.pop(key)

    async def locate(self, fmt: ShardFormat, key: str, chunk_id: int, shard_ctx: Any = None):
        """(index, offset, nbytes) of a stored chunk, or None."""
        index = await self.index(fmt, key, shard_ctx)
        if index is None:
            return None
        where = await index.locate(chunk_id)
        if where is None:
            return None
        return index, where[0], where[1]

    async def read_chunk(self, fmt: ShardFormat, key: str, chunk_id: int, shard_ctx: Any = None) -> bytes | None:
        """The whole stored chunk as the view shows it, or None if absent."""
        for attempt in range(3):
            found = await self.locate(fmt, key, chunk_id, shard_ctx)
            if found is None:
                return None
            index, offset, nbytes = found
            ckey = (key, index.info.etag, chunk_id)
            data = self.chunks.get(ckey)
            if data is not None:
                return data
            inflight = self._prefetching.get((key, index.info.etag))
            if inflight is not None and chunk_id in inflight[0]:
                await inflight[1].wait()
                data = self.chunks.get(ckey)
                if data is not None:
                    return data
            if nbytes == 0:
                return fmt.decode_chunk(b"")
            if offset + nbytes > index.info.size:
                raise CorruptData(f"{key}: chunk {chunk_id} at {offset}+{nbytes} lies past the end of the shard "
                                  f"({index.info.size} bytes)", key)
            try:
                if self.prefetch and self._scanning(key, chunk_id, offset, nbytes):
                    data = await self._prefetch(fmt, key, index, chunk_id, offset)
                    if data is not None:
                        return data
                blob = await self.store.get(key, offset, nbytes, if_match=index.info.etag)
            except (PreconditionFailed, NotFound):
                log.debug("%s changed while reading; reloading its index", key)
                self.forget(key)
                continue
            if len(blob.data) != nbytes:
                raise CorruptData(f"{key}: chunk {chunk_id} is truncated ({len(blob.data)} of {nbytes} bytes)", key)
            data = fmt.decode_chunk(blob.data)
            self.chunks.put(ckey, data, len(data) + 64)
            return data
        raise CorruptData(f"{key}: shard keeps changing while being read", key)

    def _scanning(self, key: str, chunk_id: int, offset: int, nbytes: int) -> bool:
        """Record a chunk read (a cache miss); True when reads walk through
        shards, so the rest of this shard is worth fetching now: a read of a
        neighbour (next chunk id, or next bytes) of the previous read in the
        same shard, or the first read of a shard whose predecessor was read
        that way.  Random single-chunk reads rarely look like that."""
        name = key.rpartition("/")[0]
        stream = self._streams.get(name)
        if stream is None:
            stream = self._streams[name] = _Stream()
            while len(self._streams) > 256:
                self._streams.popitem(last=False)
        self._streams.move_to_end(name)
        if stream.shard != key:
            stream.previous_sequential = stream.sequential
            stream.shard, stream.sequential, stream.prefetched = key, False, False
        elif abs(chunk_id - stream.last_id) == 1 or offset == stream.last_end:
            stream.sequential = True
        stream.last_id, stream.last_end = chunk_id, offset + nbytes
        if stream.prefetched or not (stream.sequential or stream.previous_sequential):
            return False
        stream.prefetched = True
        return True

    async def _prefetch(self, fmt: ShardFormat, key: str, index: ShardIndex, chunk_id: int, offset: int):
        """Fetch the shard's stored chunks from ``offset`` on (wrapping to the
        start) that are not cached, in coalesced ranged GETs of at most
        ``prefetch_max`` bytes in all; returns the wanted chunk's data."""
        entries = sorted((off, n, cid) for cid, off, n in await index.entries()
                         if n and off + n <= index.info.size and (key, index.info.etag, cid) not in self.chunks)
        entries = [e for e in entries if e[0] >= offset] + [e for e in entries if e[0] < offset]
        chosen, total = [], 0
        for e in entries:
            if total + e[1] > self.prefetch_max and chosen:
                break
            chosen.append(e)
            total += e[1]
        chosen.sort()
        ids = {cid for _, _, cid in chosen}
        event = trio.Event()
        self._prefetching[(key, index.info.etag)] = (ids, event)
        self.prefetches += 1
        try:
            i = 0
            while i < len(chosen):
                start, end, j = chosen[i][0], chosen[i][0] + chosen[i][1], i + 1
                while j < len(chosen) and chosen[j][0] - end <= self.prefetch_gap:
                    end = max(end, chosen[j][0] + chosen[j][1])
                    j += 1
                blob = await self.store.get(key, start, end - start, if_match=index.info.etag)
                for off, n, cid in chosen[i:j]:
                    piece = blob.data[off - start: off - start + n]
                    if len(piece) != n:
                        continue
                    try:
                        decoded = fmt.decode_chunk(piece)
                    except (CorruptData, ValueError, OSError):
                        continue  # reported if and when that chunk itself is read
                    self.chunks.put((key, index.info.etag, cid), decoded, len(decoded) + 64)
                i = j
        finally:
            del self._prefetching[(key, index.info.etag)]
            event.set()
        return self.chunks.get((key, index.info.etag, chunk_id))
