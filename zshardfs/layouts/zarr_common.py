"""What the Zarr sharding codec and the v3-draft storage transformer share:
the indexed binary shard format and a chunk namespace over a regular inner
grid.  The two layouts differ only in where their metadata lives and how
chunk keys are spelled.
"""

from __future__ import annotations

import functools
import logging
import math
import time
import weakref
from dataclasses import dataclass, field
from typing import Any, AsyncIterator

import crc32c
import numpy as np
import trio

from ..backends.base import AccessDenied, AsyncStore, CorruptData, NotFound, ObjectInfo
from ..logonce import log_once, report_damage
from ..shards import EMPTY, MAX_CHUNK_BYTES, MAX_REWRITE_BYTES, NOT_CACHED
from ..together import off_loop, outcomes
from .base import ChunkEntry, ChunkTarget, Dataset, DirEntry, Entry, LayoutContext, parse_index_name
from .grids import ShardGrid, linear_index, unravel_index

log = logging.getLogger(__name__)


# --------------------------------------------------------------------------
# the binary shard format


@dataclass
class ZarrShardIndex:
    """One loaded index: an (n, 2) array of (offset, nbytes), native order.

    An index is one immutable version of a shard: the masks listings use are
    computed once per index, not once per listed directory."""

    info: ObjectInfo
    table: np.ndarray
    _present: np.ndarray | None = field(default=None, init=False, repr=False, compare=False)
    _damaged: np.ndarray | None = field(default=None, init=False, repr=False, compare=False)

    @property
    def nbytes(self) -> int:
        return self.table.nbytes + 2 * len(self.table)  # the table, and the two masks listings add

    sync_locate = True  # (ShardIndex: read_chunk calls locate_now)

    async def locate(self, chunk_id: int) -> tuple[int, int] | None:
        return self.locate_now(chunk_id)

    def locate_now(self, chunk_id: int) -> tuple[int, int] | None:
        if chunk_id >= len(self.table):
            return None
        item = self.table.item  # Python ints, no numpy scalars
        offset, nbytes = item(chunk_id, 0), item(chunk_id, 1)
        if offset == EMPTY and nbytes == EMPTY:
            return None
        if offset == EMPTY or nbytes == EMPTY:
            raise CorruptData(f"{self.info.key}: index entry {chunk_id} is half empty", self.info.key)
        if offset + nbytes > self.info.size:
            raise CorruptData(f"{self.info.key}: chunk {chunk_id} at {offset}+{nbytes} lies past the end of the "
                              f"shard ({self.info.size} bytes)", self.info.key)
        return offset, nbytes

    async def entries(self) -> list[tuple[int, int, int]]:
        # (asked at every read-ahead: built with numpy, not per entry; a
        # 32**3 index takes a few ms this way, tens of ms the other)
        ids = np.nonzero(self.present_mask())[0]
        rows = self.table[ids]
        return list(zip(ids.tolist(), rows[:, 0].tolist(), rows[:, 1].tolist()))

    def rewritable(self) -> bool:
        """Would a rewrite keeping every stored chunk pass the flush's check
        (writeback._check_kept: none past the end or half empty, none longer
        than MAX_CHUNK_BYTES, none overlapping, at most MAX_REWRITE_BYTES in
        all)?  With numpy: every first write after a flush asks it of the
        new index version (WriteBack.refuse_if_damaged), where the entries
        listed, sorted and checked one by one took 0.45 ms for 64 chunks,
        180 ms for 32**3.  False: judged entry by entry."""
        if self.damaged_mask().any():
            return False
        rows = self.table[self.present_mask()]
        if not len(rows):
            return True
        off, n = rows[:, 0], rows[:, 1]
        # (no overflow: nothing ends past the shard, and at most 2**24 entries of at most 2**30)
        if (n > MAX_CHUNK_BYTES).any() or int(n.sum(dtype=np.uint64)) > MAX_REWRITE_BYTES:
            return False
        order = np.lexsort((n, off))  # (the flush's order: by offset, then length)
        off, n = off[order], n[order]
        ends = np.maximum.accumulate(off + n)
        return not bool(((n[1:] > 0) & (off[1:] < ends[:-1])).any())

    def present_mask(self) -> np.ndarray:
        if self._present is None:
            self._present = ~((self.table[:, 0] == EMPTY) & (self.table[:, 1] == EMPTY))
        return self._present

    def damaged_mask(self) -> np.ndarray:
        """Entries ``locate_now`` refuses: half empty, or ending past the shard."""
        if self._damaged is None:
            self._damaged = self._damaged_mask()
        return self._damaged

    def _damaged_mask(self) -> np.ndarray:
        off, n = self.table[:, 0], self.table[:, 1]
        size = np.uint64(self.info.size)
        half = (off == EMPTY) != (n == EMPTY)
        past = (n > size) | (off > size - np.minimum(n, size))  # offset + nbytes > size, without overflow
        return half | (past & ~((off == EMPTY) & (n == EMPTY)))


class ZarrShardFormat:
    """``sharding_indexed`` shards: chunks, plus an index of ``prod(extent)``
    (offset, nbytes) uint64 pairs in C order, optionally followed by a
    crc32c, at the start or the end of the shard.

    ``shard_ctx`` is the shard's extent in inner chunks (the index shape).
    """

    def __init__(self, index_location: str = "end", endian: str = "little", checksum: bool = False):
        if index_location not in ("start", "end"):
            raise ValueError(f"index_location {index_location!r} must be 'start' or 'end'")
        if endian not in ("little", "big"):
            raise ValueError(f"index endian {endian!r} must be 'little' or 'big'")
        self.index_location = index_location
        self.endian = endian
        self.checksum = checksum
        self.dtype = np.dtype("<u8" if endian == "little" else ">u8")
        #: what an index parsed here depends on (ShardCache parses again under another)
        self.parses_as = (index_location, endian, checksum)

    def index_size(self, extent) -> int:
        return math.prod(extent) * 16 + (4 if self.checksum else 0)

    async def load_index(self, store: AsyncStore, key: str, extent) -> ZarrShardIndex | None:
        size = self.index_size(extent)
        try:
            if self.index_location == "end":
                blob = await store.get(key, suffix=size)
            else:
                blob = await store.get(key, 0, size)
        except NotFound:
            return None

        def parse() -> ZarrShardIndex:
            index = self.parse_index(blob.data, blob.info, extent)
            index.present_mask()  # (the masks listings use: made here too)
            index.damaged_mask()
            return index

        # (up to 2**24 chunks a shard: a 256 MiB index to check and copy)
        return await off_loop(parse, len(blob.data))

    def parse_index(self, raw: bytes, info: ObjectInfo, extent) -> ZarrShardIndex:
        size = self.index_size(extent)
        if len(raw) != size or info.size < size:
            raise CorruptData(f"{info.key}: shard of {info.size} bytes is too short for its {size}-byte index", info.key)
        body = raw
        if self.checksum:
            # (a view: copying 256 MiB would hold the interpreter lock)
            body, stored = memoryview(raw)[:-4], int.from_bytes(raw[-4:], "little")
            if crc32c.crc32c(body) != stored:
                raise CorruptData(f"{info.key}: shard index checksum mismatch", info.key)
        # (little-endian: a read-only view of ``raw``, not a copy)
        table = np.frombuffer(body, dtype=self.dtype).reshape(-1, 2).astype(np.uint64, copy=False)
        return ZarrShardIndex(info, table)

    def encode(self, chunks: dict[int, bytes], extent) -> bytes:
        n = math.prod(extent)
        table = np.full((n, 2), EMPTY, dtype=np.uint64)
        isize = self.index_size(extent)
        pos = isize if self.index_location == "start" else 0
        parts = []
        for cid in sorted(chunks):
            data = chunks[cid]
            table[cid] = (pos, len(data))
            parts.append(data)
            pos += len(data)
        index = table.astype(self.dtype).tobytes()
        if self.checksum:
            index += crc32c.crc32c(index).to_bytes(4, "little")
        body = b"".join(parts)
        return index + body if self.index_location == "start" else body + index

    decodes = False  # chunk bytes pass through untouched

    @staticmethod
    def decode_chunk(data: bytes) -> bytes:
        return data

    @staticmethod
    def encode_chunk(data: bytes) -> bytes:
        return data


# --------------------------------------------------------------------------
# chunk keys


@dataclass(frozen=True)
class ChunkKeys:
    """How chunk (and shard) coordinates are spelled as keys.

    ``prefix`` is 'c/' (v3 default with '/'), 'c.' (v3 default with '.'),
    'c' (storage transformer: ``c0/1/2``) or '' (v2 encoding).
    """

    prefix: str
    sep: str
    ndim: int
    zero_d_key: str = "c"

    def format(self, coords) -> str:
        if self.ndim == 0:
            return self.zero_d_key
        return self.prefix + self.sep.join(str(c) for c in coords)

    def parse(self, rel: tuple[str, ...]):
        """(coords, complete) for a path that is, or leads to, a key; None if
        it cannot be one.  Bounds are not checked here."""
        if not rel:
            return None
        if self.ndim == 0:
            return ((), True) if rel == (self.zero_d_key,) else None
        if self.sep != "/":
            if len(rel) != 1 or not rel[0].startswith(self.prefix):
                return None
            parts = rel[0][len(self.prefix):].split(self.sep)
            if len(parts) != self.ndim:
                return None
        elif self.prefix == "c/":
            if rel[0] != "c":
                return None
            parts = list(rel[1:])
        elif self.prefix:
            if not rel[0].startswith(self.prefix):
                return None
            parts = [rel[0][len(self.prefix):], *rel[1:]]
        else:
            parts = list(rel)
        if len(parts) > self.ndim:
            return None
        coords = []
        for p in parts:  # parse_index_name, inlined: asked on every lookup
            if not (p.isascii() and p.isdigit()) or (p[0] == "0" and len(p) > 1):
                return None
            coords.append(int(p))
        return tuple(coords), len(coords) == self.ndim

    def dir_components(self, coords) -> tuple[str, ...]:
        """Path components of the directory holding keys that start with
        ``coords`` ('/' separator only)."""
        head = ("c",) if self.prefix == "c/" else ()
        if not coords:
            return head
        names = [str(c) for c in coords]
        if self.prefix == "c":
            names[0] = "c" + names[0]
        return head + tuple(names)

    def parse_level(self, m: int, name: str) -> int | None:
        """The coordinate a '/'-separated key holds at coordinate level m."""
        if m == 0 and self.prefix == "c":
            return parse_index_name(name[1:]) if name.startswith("c") else None
        return parse_index_name(name)

    def level_name(self, m: int, coord: int) -> str:
        return f"c{coord}" if m == 0 and self.prefix == "c" else str(coord)

    def claims(self, rel: tuple[str, ...]) -> bool:
        if self.ndim == 0 or self.sep != "/":
            return self.parse(rel) is not None
        if self.prefix == "c/":
            return rel[0] == "c"
        return self.parse(rel[:1]) is not None


# --------------------------------------------------------------------------
# the dataset: a sharded array over a regular inner grid

#: listings of at most this many chunks of one shard are computed without numpy
SMALL_LISTING = 256
#: what one kept listing entry is counted as in the index cache (see
#: GridDataset._shard_chunks)
LISTED_ENTRY_BYTES = 200


def _report_shard_damage(key: str, index: ZarrShardIndex) -> None:
    """One line per damaged shard, not one per damaged chunk slot (a garbage
    index can damage thousands, and every chunk directory lists a slice of
    its shard): one damaged entry is reported as a read of it would be (so
    the two share one line), more as the shard's (log_once keeps one)."""
    damaged = np.flatnonzero(index.damaged_mask())
    if len(damaged) == 1:
        try:
            index.locate_now(int(damaged[0]))
        except CorruptData as exc:
            report_damage(log, exc)
        return
    report_damage(log, CorruptData(f"{key}: {len(damaged)} index entries lie past the end of the shard or are "
                                   "half-empty; those chunks are not listed, and reading one gives EIO", key))


class GridDataset(Dataset):
    """A sharded Zarr array: virtual chunk files on the inner grid, stored
    in shards on the shard grid, both spelled with ``keys``."""

    def __init__(self, ctx: LayoutContext, root: str, data_root: str, grid: ShardGrid, keys: ChunkKeys,
                 fmt: ZarrShardFormat):
        super().__init__(ctx, root)
        self.data_root = data_root  # storage dir the keys are relative to
        self.grid = grid
        self.keys = keys
        self.shard_format = fmt

    @property
    def shard_home(self) -> str:
        return self.data_root

    def _key(self, rel_key: str) -> str:
        return f"{self.data_root}/{rel_key}" if self.data_root else rel_key

    def _shard_where(self, shard: tuple[int, ...]) -> tuple[str, Any]:
        """(storage key, extent) of a shard."""
        return self._key(self.keys.format(shard)), self.grid.shard_extent(shard)

    def claims(self, rel):
        return self.keys.claims(rel)

    def target(self, rel) -> ChunkTarget | None:
        parsed = self.keys.parse(rel)
        if parsed is None or not parsed[1] or not self.grid.contains(parsed[0]):
            return None
        shard, pos = self.grid.locate(parsed[0])
        extent = self.grid.shard_extent(shard)
        return ChunkTarget(self._key(self.keys.format(shard)), linear_index(pos, extent), extent,
                           self.grid.capacity(shard))

    def outside(self, rel) -> bool:
        parsed = self.keys.parse(rel)
        return parsed is not None and not all(0 <= c < n for c, n in zip(parsed[0], self.grid.inner_counts))

    def no_key_part(self, rel) -> bool:
        return self.keys.claims(rel) and self.keys.parse(rel) is None

    async def stored_outside(self, smaller: Dataset, pending) -> list[ChunkTarget]:
        counts = getattr(getattr(smaller, "grid", None), "inner_counts", None)
        old = self.grid.inner_counts
        if counts is None or len(counts) != len(old) or all(n >= o for n, o in zip(counts, old)):
            return []
        bounds = self.grid.bounds

        def past(d: int, s: int) -> bool:  # shard s reaches past the smaller grid along d
            return bounds[d][s + 1] > counts[d]

        # only the shards storage holds (a sparse array may have a handful of
        # its millions of grid positions), and those the mount has pending
        shards = {c for c in await self._stored_shards(past, [n < o for n, o in zip(counts, old)])}
        shards |= {p[0] for key in pending if (p := self._shard_of_key(key)) is not None}
        shards = sorted(c for c in shards if any(past(d, s) for d, s in enumerate(c)))
        out = []
        for start in range(0, len(shards), 32):  # (indexes read 32 at a time)
            batch = shards[start:start + 32]
            wheres = [self._shard_where(c) for c in batch]
            indexes = await outcomes(*(functools.partial(self.ctx.shards.index, self.shard_format, key, extent)
                                       for key, extent in wheres))
            for shard, (key, extent), index in zip(batch, wheres, indexes):
                if isinstance(index, Exception):
                    raise index
                ids = set(np.nonzero(index.present_mask())[0].tolist()) if index is not None else set()
                origin = self.grid.shard_origin(shard)
                for cid in sorted(ids | set(pending.get(key, ()))):
                    coords = [o + p for o, p in zip(origin, unravel_index(cid, extent))]
                    if any(c >= n for c, n in zip(coords, counts)):
                        out.append(ChunkTarget(key, cid, extent, self.grid.capacity(shard)))
            await trio.lowlevel.checkpoint()
        return out

    def _shard_of_key(self, key: str):
        """(shard coords,) of a storage key of this dataset's shards, or None."""
        head = self._key("")
        if not key.startswith(head):
            return None
        parsed = self.keys.parse(tuple(key[len(head):].split("/")))
        return (parsed[0],) if parsed is not None and parsed[1] and self.grid.shard_contains(parsed[0]) else None

    async def _stored_shards(self, past, shrunk: list[bool]) -> list[tuple[int, ...]]:
        """Coordinates of the shards storage holds that may reach past a
        smaller grid (``past(dim, shard coord)``; ``shrunk``: the dimensions
        that shrank), found by listing the directories that can hold them:
        a subtree whose leading coordinates are inside, with no shrunk
        dimension left below, is not listed."""
        found = []

        async def walk(rel: tuple[str, ...], coords: tuple[int, ...]) -> None:
            listing = await self.ctx.store.list(self._key("/".join(rel)).rstrip("/"))
            for f in listing.files:
                parsed = self.keys.parse(rel + (f.key.rsplit("/", 1)[-1],))
                if parsed is not None and parsed[1] and self.grid.shard_contains(parsed[0]):
                    found.append(parsed[0])
            for d in listing.dirs:
                parsed = self.keys.parse(rel + (d,))
                if parsed is None or parsed[1]:
                    continue
                below = parsed[0]
                if any(past(i, s) for i, s in enumerate(below) if s < self.grid.shard_count(i)) or \
                        any(shrunk[len(below):]):
                    await walk(rel + (d,), below)

        await walk((), ())
        return found

    # -- lookup -------------------------------------------------------------

    async def chunk_entry(self, coords) -> ChunkEntry | None:
        """The chunk file at inner ``coords`` if it is stored."""
        if not self.grid.contains(coords):
            return None
        shard, pos = self.grid.locate(coords)
        extent = self.grid.shard_extent(shard)
        key = self._key(self.keys.format(shard))
        index = self.ctx.shards.index_now(self.shard_format, key, extent)
        if index is NOT_CACHED:
            index = await self.ctx.shards.index(self.shard_format, key, extent)
        if index is None:
            return None
        cid = linear_index(pos, extent)
        try:
            where = index.locate_now(cid)
        except CorruptData as exc:
            # its own entry is damaged: found all the same (ChunkEntry.damage),
            # else `rm` of it and `cp good.bin` onto it stop at the lookup
            report_damage(log, exc)
            return ChunkEntry(key, cid, 0, index.info.mtime_ns, extent, str(exc))
        if where is None:
            return None
        return ChunkEntry(key, cid, where[1], index.info.mtime_ns, extent)

    async def lookup(self, rel) -> Entry | None:
        parsed = self.keys.parse(rel)
        if parsed is None:
            return None
        coords, complete = parsed
        if complete:
            return await self.chunk_entry(coords)
        # An intermediate directory exists when it is inside the grid; we do
        # not read indexes to prove it holds a chunk (docs: "lenient dirs").
        counts = self.grid.inner_counts
        if all(0 <= c < n for c, n in zip(coords, counts)):
            return DirEntry()
        return None

    # -- listing ------------------------------------------------------------

    async def _shard_chunks(self, shard, fixed, since: float | None = None,
                            where: tuple[str, Any] | None = None) -> list[tuple[str, ChunkEntry]]:
        """Stored chunks of one shard whose leading coordinates are ``fixed``,
        named as the listing shows them (a list: one shard's slice is
        bounded, and :meth:`listdir_batches` hands it on whole, so that a
        listing entry costs no async step of its own).  The caller must not
        change it: a small one is kept for the next listing of the same
        index version.

        Kept where: in the index cache, whose byte budget it shares, keyed
        by the shard's storage key; a slice is a pure function of one
        immutable index version (and of the grid, which the key's dataset
        version fixes), so listing the directory again (a warm walk, ``ls``
        after ``find``) costs a look-up per shard instead of a walk over its
        index entries.  ``since``: the listing's start (an index loaded or
        validated since then is not validated again).  ``where``: the
        shard's :meth:`_shard_where`, if the caller has it (then the shard
        is known to lie in the grid)."""
        if where is None:
            if not self.grid.shard_contains(shard):
                return []
            where = self._shard_where(shard)
        key, extent = where
        try:
            index = await self.ctx.shards.index(self.shard_format, key, extent, checked_since=since)
        except CorruptData as exc:
            report_damage(log, exc)
            return []
        except AccessDenied as exc:  # left out, like a damaged one: the rest stays listable
            log_once(log, logging.WARNING, f"{exc}; its chunks are not listed")
            return []
        if index is None:
            return []
        cache = self.ctx.shards.indexes
        slice_key = ("listed", key, fixed)
        kept = cache.peek(slice_key)
        if kept is not None and kept[0]() is index and kept[2]() is self.grid:
            cache.mark_used(slice_key)
            return kept[1]
        mtime = index.info.mtime_ns
        small = self.grid.chunks_in_shard_list(shard, fixed, SMALL_LISTING)
        if small is None:
            return self._large_slice(key, extent, index, shard, fixed)
        name = self._namer(len(fixed))
        # a chunk directory's slice of a shard (a few chunks): plain Python
        # beats the vectorised path's fixed cost many times over
        out, damaged = [], False
        for c, cid in small:
            try:
                where = index.locate_now(cid)
            except CorruptData:  # not listed; a lookup gives EIO
                damaged = True
                continue
            if where is not None:
                out.append((name(c), ChunkEntry(key, cid, where[1], mtime, extent)))
        if damaged:
            _report_shard_damage(key, index)
        # (weak references: an index the cache evicts must not live on here,
        # outside its budget)
        cache.put(slice_key, (weakref.ref(index), out, weakref.ref(self.grid)), LISTED_ENTRY_BYTES * (1 + len(out)))
        return out

    def _large_slice(self, key: str, extent, index: ZarrShardIndex, shard, fixed) -> list:
        """:meth:`_shard_chunks` of a slice too large to keep: vectorised."""
        coords, linear = self.grid.chunks_in_shard(shard, fixed)
        keep = index.present_mask()[linear]
        damaged = keep & index.damaged_mask()[linear]
        if damaged.any():  # not listed; a lookup gives EIO
            _report_shard_damage(key, index)
        keep &= ~damaged
        sizes = index.table[linear[keep], 1].tolist()
        mtime = index.info.mtime_ns
        name = self._namer(len(fixed))
        return [(name(tuple(c)), ChunkEntry(key, cid, size, mtime, extent))
                for c, cid, size in zip(coords[keep].tolist(), linear[keep].tolist(), sizes)]

    def _namer(self, m: int):
        """The name a listing gives a chunk from its coordinates: its whole
        key in a flat ('.'-separated) array, else its last level's name."""
        keys = self.keys
        if keys.sep != "/":
            return keys.format
        return lambda coords: keys.level_name(m, coords[-1])

    def _leaf_shards(self, prefix: tuple[int, ...], coords) -> list[tuple[str, Any]]:
        """(key, extent) of every shard below ``prefix + (c,)`` for c in
        ``coords``: the shards of the chunk directories one level down."""
        last = self.grid.shard_count(self.grid.ndim - 1)
        shards = (prefix + (c, k) for c in coords for k in range(last))
        return [(self._key(self.keys.format(s)), self.grid.shard_extent(s)) for s in shards]

    async def _warm_below(self, prefix: tuple[int, ...], coords) -> None:
        """Background: list the storage directories ``prefix + (c,)`` at
        once, then load the indexes of the shards they hold (in the order a
        walk reaches them: :meth:`ShardCache.preload`)."""
        shards: list[tuple[str, Any]] = []

        async def one(c: int) -> None:
            storage_dir = "/".join(self.keys.dir_components(prefix + (c,)))
            try:
                listing = await self.ctx.store.list(self._key(storage_dir))
            except Exception as exc:  # noqa: BLE001 - the walk's own listing reports it
                log.debug("listing ahead %s: %s", storage_dir, exc)
                return
            m = len(prefix) + 1
            found = sorted(s for name in listing.dirs
                           if (s := self.keys.parse_level(m, name)) is not None and 0 <= s < self.grid.shard_count(m))
            shards.extend(self._leaf_shards(prefix + (c,), found))

        async with trio.open_nursery() as nursery:
            for c in coords:
                nursery.start_soon(one, c)
        await self.ctx.shards.preload(self.shard_format, shards)

    async def listdir(self, rel) -> AsyncIterator[tuple[str, Entry]]:
        async for batch in self.listdir_batches(rel):
            for item in batch:
                yield item

    async def listdir_batches(self, rel) -> AsyncIterator[list[tuple[str, Entry]]]:
        keys, grid = self.keys, self.grid
        started = time.monotonic()  # (indexes this listing loads are current for it)
        if keys.ndim == 0:
            if rel == ():
                entry = await self.chunk_entry(())
                if entry is not None and entry.damage is None:  # (a damaged one is not listed)
                    yield [(keys.zero_d_key, entry)]
            return
        if keys.sep != "/":
            if rel != ():
                return
            listing = await self.ctx.store.list(self.data_root)
            shards = sorted(
                p[0] for f in listing.files if (p := keys.parse((f.key.rsplit("/", 1)[-1],))) is not None
            )
            for shard in shards:  # streamed: a flat listing may span thousands of shards
                batch = await self._shard_chunks(shard, (), started)
                if batch:
                    yield batch
            return
        if rel == ():
            if keys.prefix == "c/":
                # the array's directory was just listed (by the view): ask that listing
                if "c" in (await self.ctx.store.list(self.data_root)).dirs:
                    yield [("c", DirEntry())]
                return
            fixed: tuple[int, ...] = ()
        else:
            parsed = keys.parse(rel)
            if parsed is None or parsed[1]:
                return
            fixed = parsed[0]
        m = len(fixed)
        shard_prefix = grid.locate(fixed + (0,) * (grid.ndim - m))[0][:m]
        last = m == grid.ndim - 1
        if last and grid.shard_count(m) <= DIRECT_SHARDS:
            # a chunk directory's few shards: asking for their indexes (a
            # missing shard answers "absent") is as cheap as listing them,
            # and saves a request in a row on every directory of a walk
            shard_coords = list(range(grid.shard_count(m)))
        else:
            storage_dir = "/".join(keys.dir_components(shard_prefix))
            listing = await self.ctx.store.list(self._key(storage_dir) if storage_dir else self.data_root)
            names = [f.key.rsplit("/", 1)[-1] for f in listing.files] if last else listing.dirs
            shard_coords = sorted(
                s for name in names
                if (s := keys.parse_level(m, name)) is not None and 0 <= s < grid.shard_count(m)
            )
        if last:
            # each shard's (key, extent), worked out once for the preload,
            # read-ahead's note and the slices below (three times before: a
            # sixth of a warm walk's listing CPU)
            wheres = {s: self._shard_where(shard) for s in shard_coords
                      if grid.shard_contains(shard := shard_prefix + (s,))}
            if len(wheres) > 1:  # (the indexes this listing is about to need, loaded at once)
                await self.ctx.shards.preload(self.shard_format, list(wheres.values()))
            self.ctx.shards.listed(fixed, [key for key, _ in wheres.values()])
        elif self.ctx.shards.prefetch_ahead and grid.shard_count(grid.ndim - 1) <= DIRECT_SHARDS:
            # Work ahead of a walk (S3: read-ahead on), so that its listings
            # find what they need instead of asking for it one at a time:
            # the chunk directories below will each need their few shards'
            # indexes, loaded now, together; one level higher, the storage
            # listings they come from, too (two levels: no more).
            if m == grid.ndim - 2:
                self.ctx.shards.preload_soon(self.shard_format, self._leaf_shards(shard_prefix, shard_coords))
            elif m == grid.ndim - 3:
                self.ctx.shards.soon(self._warm_below, shard_prefix, shard_coords[:WARM_DIRS])
        for s in shard_coords:
            if not last:
                yield [(keys.level_name(m, c), DirEntry()) for c in grid.shard_range(m, s)]
                continue
            where = wheres.get(s)
            if where is None:  # (outside the grid)
                continue
            batch = await self._shard_chunks(shard_prefix + (s,), fixed, started, where)
            if batch:
                yield batch


#: a chunk directory spanning at most this many shards is listed from their
#: indexes alone, without listing storage
DIRECT_SHARDS = 4
#: storage directories one listing lists ahead of a walk, at most
WARM_DIRS = 16


def parse_separator(encoding: dict | None, default_name: str = "default") -> tuple[str, str]:
    """(encoding name, separator) of a ``chunk_key_encoding``."""
    encoding = encoding or {"name": default_name}
    name = encoding.get("name", default_name)
    conf = encoding.get("configuration") or {}
    if name == "default":
        sep = conf.get("separator", "/")
    elif name == "v2":
        sep = conf.get("separator", ".")
    else:
        raise ValueError(f"chunk_key_encoding {name!r} is not supported")
    if sep not in ("/", "."):
        raise ValueError(f"chunk key separator {sep!r} is not supported")
    return name, sep
