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

    def pop(self, key) -> None:
        item = self._d.pop(key, None)
        if item is not None:
            self.bytes -= item[1]

    def __len__(self):
        return len(self._d)


@dataclass
class _Cached:
    index: ShardIndex | None  # None: the shard is known to be absent
    checked: float = field(default_factory=time.monotonic)


class ShardCache:
    """Loads shard indexes through a :class:`ShardFormat`, caches them, and
    reads chunks pinned to the cached version."""

    def __init__(self, store: AsyncStore, *, index_cache_bytes: int = 64 << 20, index_ttl: float = 1.0,
                 chunk_cache_bytes: int = 64 << 20):
        self.store = store
        self.indexes = ByteLRU(index_cache_bytes)
        self.chunks = ByteLRU(chunk_cache_bytes)
        self.index_ttl = index_ttl
        # one loader per shard at a time: concurrent readers share one request
        self._loading: dict[str, trio.Event] = {}

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
            if nbytes == 0:
                return fmt.decode_chunk(b"")
            if offset + nbytes > index.info.size:
                raise CorruptData(f"{key}: chunk {chunk_id} at {offset}+{nbytes} lies past the end of the shard "
                                  f"({index.info.size} bytes)", key)
            try:
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
