"""Dirty chunks, merged per shard, written back as whole shards.

Writes to chunk files do not touch storage: they land here, in a per-shard
set of dirty chunks.  A *flush* of a shard reads what it keeps of the old
shard (its index, then only the chunks it keeps, in coalesced ranged reads),
merges, encodes one new shard with the layout's own format and writes it in
one conditional PUT.  So N chunk writes to one shard cost one shard write.

Invariants (docs/SEMANTICS.md names the tests):
- A shard in storage is its old or its new version, never a mix: the
  backend's ``put`` is atomic (rename / single PUT).
- No lost updates between writers: the PUT is conditional on the etag the
  merge was based on (``if_match``, or ``if_none_match`` for a new shard);
  on a mismatch the flush re-reads, re-merges and retries.
- Dirty data is never dropped on failure: a failed flush keeps its chunks,
  is retried later, and the error is reported by the next ``fsync``.
- Memory is bounded: writers wait (back-pressure) while dirty bytes exceed
  ``max_dirty_bytes``, and the flusher writes the oldest shards first.
- A writer never waits forever: once flushes fail and none can make room,
  it gets the flush's error (see ``wait_for_room``).

Flush triggers: ``fsync`` of a chunk in the shard; ``sync_all`` (the
``zshardfs sync`` command, unmount, SIGTERM); a shard whose every chunk has
been written (once no writer has it open); ``idle_delay`` seconds after its
last write (once no writer has it open); and dirty-memory pressure.

Bookkeeping is O(1) per change, never a walk of the dirty set: every chunk
a shard holds is counted into its shard's totals and the mount's
(``WriteBack._count``), at each place it joins or leaves a shard and after
each change of it; ``dirty`` is kept in the order the shards were last
touched, so the idle ones are its head.  ``WriteBack.check`` recounts it
all from scratch (tests).
"""

from __future__ import annotations

import contextlib
import contextvars
import copy
import functools
import logging
import random
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable, TypeVar

import trio

from .backends.base import (AsyncStore, CorruptData, NotFound, PreconditionFailed, StoreError, held_by_deadline,
                            pause_within_deadline)
from .logonce import log_once, report_damage
from .shards import MAX_CHUNK_BYTES, MAX_REWRITE_BYTES, NOT_CACHED, ShardCache, ShardFormat
from .together import off_loop

log = logging.getLogger(__name__)

DELETED = None  # marker value of a dirty chunk that was unlinked

MAX_GAP = 64 << 10  # kept chunks closer than this are read in one range

#: while writers wait for room, a shard whose flush failed is retried this
#: often instead of after its backoff: they learn at once that storage
#: still fails, or go on as soon as it works again
PRESSURE_RETRY = 1.0


T = TypeVar("T")

#: True while the caller logs a failed flush itself (a stop's rounds, one
#: line each: "not stored yet"); the flush then does not log it too
_CALLER_LOGS_FAILURES: contextvars.ContextVar[bool] = contextvars.ContextVar("caller_logs_flush_failures",
                                                                            default=False)


@contextlib.contextmanager
def failures_logged_by_caller():
    """Flushes within (this task's and those it starts) leave the logging of
    their failures to the caller, who gets them back as errors."""
    token = _CALLER_LOGS_FAILURES.set(True)
    try:
        yield
    finally:
        _CALLER_LOGS_FAILURES.reset(token)


#: shards flushed at once by sync, unmount and the background flusher
FLUSH_PARALLEL = 8


def _backoff(attempt: int) -> float:
    """Wait before re-merging after a conflict: exponential with full jitter,
    so two mounts that keep colliding on one shard fall out of step (a fixed
    delay keeps them in lockstep until the attempts run out)."""
    return random.uniform(0, min(1.0, 0.01 * 2 ** attempt))


@dataclass
class DirtyChunk:
    data: bytearray | None  # None: deleted
    version: int = 0  # bumped on every change; a flush only clears what it wrote
    writers: int = 0  # open write handles
    clean: int = -1  # version already in storage (flushed while still open)
    #: its mtime in the view until it is stored: that of the last change, or
    #: of the stored version it was opened from (a stat must not see it
    #: change without a write: ``tar c`` then fails, "file changed as we
    #: read it", and ``rsync`` sends it again)
    mtime_ns: int = field(default_factory=time.time_ns, compare=False)
    # the shard holding it (None: none, e.g. replaced while still open) and
    # what it adds to that shard's totals, as last counted by WriteBack._count:
    # (bytes not in storage, 1 if it has data, writers)
    owner: DirtyShard | None = field(default=None, repr=False, compare=False)
    counted: tuple[int, int, int] = field(default=(0, 0, 0), repr=False, compare=False)


@dataclass
class DirtyShard:
    key: str
    fmt: ShardFormat
    ctx: Any
    capacity: int | None  # chunks a full shard holds (None: unknown/unbounded)
    # the dataset's directory: those between it and the shard hold only
    # shards, and go when the last one is deleted (None: none go)
    home: str | None = None
    chunks: dict[int, DirtyChunk] = field(default_factory=dict)
    since: float = field(default_factory=time.monotonic)
    touched: float = field(default_factory=time.monotonic)
    error: StoreError | None = None
    failures: int = 0
    failed_at: float = 0.0  # monotonic time of the last failed flush
    lock: trio.Lock = field(default_factory=trio.Lock)
    # totals over ``chunks``, kept by WriteBack._count (never summed per call:
    # that made every write cost time in proportion to all dirty chunks)
    unstored_bytes: int = 0
    present: int = 0  # chunks with data (not deleted)
    writers: int = 0  # open write handles on its chunks

    @property
    def nbytes(self) -> int:
        """Bytes not in storage yet (a chunk flushed while still open is not
        dirty until it changes again: counting it would keep a writer waiting
        for room that no flush can make)."""
        return self.unstored_bytes

    @property
    def busy(self) -> bool:
        return self.writers > 0

    @property
    def full(self) -> bool:
        return self.capacity is not None and self.present >= self.capacity


class WriteBack:
    def __init__(self, store: AsyncStore, shards: ShardCache, *, max_dirty_bytes: int = 256 << 20,
                 idle_delay: float = 2.0, max_attempts: int = 12, room_timeout: float = 30.0):
        self.store = store
        self.shards = shards
        self.max_dirty_bytes = max_dirty_bytes
        self.idle_delay = idle_delay
        # conflicting writers of one shard: after this many lost races in a
        # row (about 6 s of backoff), fsync reports EIO; the data stays dirty
        self.max_attempts = max_attempts
        # least recently touched first (``touch`` moves a shard to the end)
        self.dirty: OrderedDict[str, DirtyShard] = OrderedDict()
        self._dirty_bytes = 0  # the sum of every shard's nbytes
        self._maybe_full: set[str] = set()  # shards full when last touched (_due checks them)
        self._wake = trio.Event()
        self._room = trio.Condition()
        self.flushes = 0
        self.flush_errors = 0
        # a writer waiting for room while the last flush failed gets its
        # error after this long, even if failing shards hold less than the cap
        self.room_timeout = room_timeout
        self.last_failure: StoreError | None = None
        self.failing = False  # the latest flush failed
        self._waiting = 0  # writers waiting for room
        # shards this mount stored, each with the number of its last store (a
        # listing that began before it looks their chunks up again: stored_since)
        self._stored: OrderedDict[str, int] = OrderedDict()
        self.store_seq = 0
        self._stored_floor = 0  # the newest number forgotten (the memory is bounded)

    #: shards whose last store is remembered
    STORED_KEPT = 4096

    def _stored_now(self, key: str) -> None:
        self.store_seq += 1
        self._stored[key] = self.store_seq
        self._stored.move_to_end(key)
        while len(self._stored) > self.STORED_KEPT:
            self._stored_floor = max(self._stored_floor, self._stored.popitem(last=False)[1])

    def stored_since(self, key: str, mark: int) -> bool:
        """Did this mount store shard ``key`` after ``mark`` (a ``store_seq``)?
        Then what was read of it before may be older than its pending
        changes, which that store retired."""
        return self._stored.get(key, self._stored_floor) > mark

    def table_sizes(self) -> dict[str, int]:
        """Entries of this layer's tables (see Operations.table_sizes)."""
        return {"dirty_shards": len(self.dirty), "maybe_full": len(self._maybe_full), "stored": len(self._stored)}

    # -- the dirty set ------------------------------------------------------

    @property
    def dirty_bytes(self) -> int:
        return self._dirty_bytes

    @staticmethod
    def _counts(chunk: DirtyChunk) -> tuple[int, int, int]:
        if chunk.owner is None:
            return 0, 0, 0
        return (len(chunk.data) if chunk.data is not None and chunk.clean != chunk.version else 0,
                int(chunk.data is not None), chunk.writers)

    def _count(self, chunk: DirtyChunk) -> None:
        """Bring the totals of ``chunk``'s shard, and the mount's, up to date
        with it: called after every change of its data, version, ``clean``
        or writers (a chunk no shard holds counts nowhere)."""
        new = self._counts(chunk)
        old = chunk.counted
        if new == old:
            return
        shard = chunk.owner
        assert shard is not None
        chunk.counted = new
        shard.unstored_bytes += new[0] - old[0]
        shard.present += new[1] - old[1]
        shard.writers += new[2] - old[2]
        self._dirty_bytes += new[0] - old[0]

    def _uncount(self, chunk: DirtyChunk) -> None:
        """``chunk`` left its shard: it counts nowhere now."""
        shard = chunk.owner
        if shard is None:
            return
        nbytes, present, writers = chunk.counted
        shard.unstored_bytes -= nbytes
        shard.present -= present
        shard.writers -= writers
        self._dirty_bytes -= nbytes
        chunk.owner, chunk.counted = None, (0, 0, 0)

    def _attach(self, shard: DirtyShard, chunk_id: int, chunk: DirtyChunk) -> None:
        """``chunk`` is ``shard``'s chunk ``chunk_id`` now (replacing any)."""
        old = shard.chunks.get(chunk_id)
        if old is not None and old is not chunk:
            self._uncount(old)
        shard.chunks[chunk_id] = chunk
        if chunk.owner is not shard:
            self._uncount(chunk)
            chunk.owner = shard
        self._count(chunk)

    def _detach(self, shard: DirtyShard, chunk_id: int) -> None:
        self._uncount(shard.chunks.pop(chunk_id))

    def _drop_shard(self, key: str) -> None:
        """Forget shard ``key``, which holds no chunk."""
        shard = self.dirty.pop(key)
        assert not shard.chunks, key
        self._maybe_full.discard(key)

    def check(self) -> None:
        """Recount everything from scratch and compare with the running
        totals (tests: a mutation path that misses ``_count`` shows here)."""
        total = 0
        last = float("-inf")
        for key, shard in self.dirty.items():
            assert shard.key == key, (key, shard.key)
            assert shard.touched >= last, f"{key}: out of touch order"
            last = shard.touched
            sums = [0, 0, 0]
            for cid, chunk in shard.chunks.items():
                assert chunk.owner is shard, f"{key}/{cid}: owner"
                assert chunk.counted == self._counts(chunk), (key, cid, chunk.counted, self._counts(chunk))
                for i, n in enumerate(chunk.counted):
                    sums[i] += n
            assert sums[0] == sum(len(c.data) for c in shard.chunks.values()
                                  if c.data is not None and c.clean != c.version), key
            assert sums[1] == sum(1 for c in shard.chunks.values() if c.data is not None), key
            assert sums[2] == sum(c.writers for c in shard.chunks.values()), key
            assert (shard.unstored_bytes, shard.present, shard.writers) == tuple(sums), (
                key, (shard.unstored_bytes, shard.present, shard.writers), sums)
            assert not shard.full or key in self._maybe_full, f"{key}: full, not in _maybe_full"
            total += sums[0]
        assert self._dirty_bytes == total, (self._dirty_bytes, total)

    def damaged(self) -> list[str]:
        """Dirty shards whose last flush was refused for damage in storage
        (no retry stores them until the shard is repaired or removed)."""
        return [k for k, s in self.dirty.items() if isinstance(s.error, CorruptData)]

    def unstored(self) -> tuple[int, int]:
        """(chunks, shards) held in memory only."""
        chunks = sum(1 for s in self.dirty.values() for c in s.chunks.values() if c.clean != c.version)
        return chunks, sum(1 for s in self.dirty.values() if any(c.clean != c.version for c in s.chunks.values()))

    def shard(self, key: str, fmt: ShardFormat, ctx: Any, capacity: int | None = None,
              home: str | None = None) -> DirtyShard:
        shard = self.dirty.get(key)
        if shard is None:
            shard = self.dirty[key] = DirtyShard(key, fmt, ctx, capacity, home=home)  # (touched now: the end)
        return shard

    def pending(self, key: str, chunk_id: int) -> DirtyChunk | None:
        """The dirty state of a chunk, if it has one (reads see it first)."""
        shard = self.dirty.get(key)
        return shard.chunks.get(chunk_id) if shard else None

    def pending_ids(self, key: str) -> dict[int, DirtyChunk]:
        shard = self.dirty.get(key)
        return dict(shard.chunks) if shard else {}

    def open_chunk(self, key: str, fmt: ShardFormat, ctx: Any, chunk_id: int, initial: bytes | None,
                   capacity: int | None = None, home: str | None = None, stored: bool = False,
                   mtime_ns: int | None = None) -> DirtyChunk:
        """A chunk opened for writing: its buffer, starting from ``initial``
        (the current content) unless it is dirty already.  ``stored``:
        ``initial`` is what storage holds, so the chunk is clean until
        written (an open that writes nothing, ``touch``, stores nothing, and
        cannot put back a version another writer replaced meanwhile).
        ``mtime_ns``: that stored version's, kept until the chunk changes."""
        shard = self.shard(key, fmt, ctx, capacity, home)
        chunk = shard.chunks.get(chunk_id)
        if chunk is None or chunk.data is None:
            new = DirtyChunk(bytearray(initial or b""), (chunk.version + 1) if chunk else 0)
            if chunk is None and stored:
                new.clean = new.version  # (before it is counted: clean bytes are not dirty)
                if mtime_ns is not None:
                    new.mtime_ns = mtime_ns
            self._attach(shard, chunk_id, new)
            chunk = new
        chunk.writers += 1
        self._count(chunk)
        self.touch(shard)
        return chunk

    async def refuse_if_damaged(self, key: str, fmt: ShardFormat, ctx: Any, chunk_ids, what: str) -> None:
        """Refuse at once (CorruptData: EIO, the shard's one ``damaged data``
        line) a change of chunks ``chunk_ids`` of shard ``key`` (an open for
        writing, a create, a truncate, a rename onto or away from it, an
        unlink) whose flush would be refused: the shard's index, as this
        mount knows it, declares chunks the rewrite would have to keep and
        cannot (past the end, too large, overlapping; what the flush's
        ``_check_kept`` refuses).  Else the change was accepted, kept in
        memory and retried for ever, and ``zshardfs umount`` refused for
        ever.  Judged from the cached index only (no storage request): once
        per index version for a shard that is whole, per change for a
        damaged one (validated first if its index is older than the TTL: one
        HEAD); a shard not cached, or damaged after it was judged, is left to
        the flush (EIO at fsync, kept, retried)."""
        index = self.shards.index_now(fmt, key, ctx, expired_ok=True)
        if index is NOT_CACHED or index is None:
            return
        verdict = await _rewrite_verdict(index)
        if verdict is None:
            return
        current = await self.shards.index(fmt, key, ctx)  # (a damaged one past its TTL: validated, one HEAD)
        if current is not index:  # (replaced meanwhile, repaired perhaps: judged anew)
            verdict = await _rewrite_verdict(current) if current is not None else None
            if verdict is None:
                return
            index = current
        exc, entries = verdict
        if entries is not None:  # (whose entries the rewrite keeps matters: those changed go)
            changed = set(chunk_ids)
            shard = self.dirty.get(key)
            if shard is not None:
                changed.update(shard.chunks)
            try:
                await off_loop(lambda: _check_kept(key, index.info, [e for e in entries if e[2] not in changed]),
                               32 * len(entries))
                return
            except CorruptData as kept_exc:
                exc = kept_exc
        raise CorruptData(f"{exc} ({what} refused: the shard cannot be rewritten without losing chunks)",
                          exc.key or key)

    def close_chunk(self, key: str, chunk_id: int, chunk: DirtyChunk) -> None:
        chunk.writers = max(0, chunk.writers - 1)
        self._count(chunk)
        shard = self.dirty.get(key)
        if shard is None:
            return
        if not chunk.writers and chunk.clean == chunk.version and shard.chunks.get(chunk_id) is chunk:
            self._detach(shard, chunk_id)  # flushed while open and unchanged since
            if not shard.chunks and not shard.lock.locked():
                self._drop_shard(key)
            return
        self.touch(shard)

    def changed(self, key: str, chunk: DirtyChunk) -> None:
        chunk.version += 1
        chunk.mtime_ns = time.time_ns()
        self._count(chunk)  # (its data changed too: the caller changed it in place)
        shard = self.dirty.get(key)
        if shard is not None:
            self.touch(shard)

    def put(self, key: str, fmt: ShardFormat, ctx: Any, chunk_id: int, data: bytes,
            capacity: int | None = None) -> None:
        """Replace a whole chunk (e.g. a rename onto a chunk name)."""
        shard = self.shard(key, fmt, ctx, capacity)
        old = shard.chunks.get(chunk_id)
        self._attach(shard, chunk_id, DirtyChunk(bytearray(data), (old.version + 1) if old else 0))
        self.touch(shard)

    def delete(self, key: str, fmt: ShardFormat, ctx: Any, chunk_id: int, home: str | None = None) -> None:
        shard = self.shard(key, fmt, ctx, home=home)
        linked = getattr(fmt, "deleted_with", None)
        for cid in linked(chunk_id) if linked else (chunk_id,):
            old = shard.chunks.get(cid)
            self._attach(shard, cid, DirtyChunk(None, (old.version + 1) if old else 0))
        self.touch(shard)

    async def superseding(self, key: str, put: Callable[[], Awaitable[T]]) -> T:
        """``put()``, which replaces shard ``key`` whole (a shard file written
        as is), with the shard's flushes held off; then the chunk writes
        pending for it are older, and dropped (those still open for writing
        go on: their next flush merges onto the new shard)."""
        shard = self.dirty.get(key)
        if shard is None:
            return await put()
        async with held_by_deadline(shard.lock, key, "a flush of it"):
            before = {cid: (chunk, chunk.version) for cid, chunk in shard.chunks.items()}
            result = await put()
            self._stored_now(key)
            for cid, chunk in list(shard.chunks.items()):
                was = before.get(cid)
                if not chunk.writers and was is not None and was[0] is chunk and was[1] == chunk.version:
                    self._detach(shard, cid)  # (untouched during the put: older than the shard)
            if not shard.chunks and self.dirty.get(key) is shard:
                self._drop_shard(key)
        return result

    def touch(self, shard: DirtyShard) -> None:
        shard.touched = time.monotonic()
        if self.dirty.get(shard.key) is shard:
            self.dirty.move_to_end(shard.key)  # (so ``dirty`` stays in touch order)
        if shard.full:
            self._maybe_full.add(shard.key)
        self._wake.set()

    async def wait_for_room(self) -> None:
        """Back-pressure: block a writer while dirty memory is over the cap.

        Never forever (a writer in a FUSE request cannot even be killed): it
        gets the error of a flush that failed while it waited once no flush
        can make room, that is when the failing shards alone hold more than
        the cap, or when the last flush failed and it has waited
        ``room_timeout``.  Flushes that succeed, however slowly, keep it
        waiting."""
        if self.dirty_bytes <= self.max_dirty_bytes:
            return
        started = time.monotonic()
        failures = self.flush_errors
        self._waiting += 1
        try:
            self._wake.set()
            async with self._room:
                while self.dirty_bytes > self.max_dirty_bytes:
                    with trio.move_on_after(1.0):
                        await self._room.wait()
                    if self.dirty_bytes <= self.max_dirty_bytes:
                        return
                    if self.flush_errors != failures and self.last_failure is not None and self._no_room(started):
                        raise copy.copy(self.last_failure)  # one exception object per request
                    self._wake.set()
        finally:
            self._waiting -= 1

    def _no_room(self, waiting_since: float) -> bool:
        failing = sum(s.nbytes for s in self.dirty.values() if s.error is not None)
        return failing > self.max_dirty_bytes or (
            self.failing and time.monotonic() - waiting_since >= self.room_timeout)

    # -- flushing -------------------------------------------------------------

    async def flush(self, key: str) -> None:
        """Write one shard's dirty chunks; raises the StoreError on failure
        (the dirty chunks are kept and retried later).  A flush of it in
        progress (the background flusher's) is waited for within the
        request's deadline only: Unavailable then, nothing changed."""
        shard = self.dirty.get(key)
        if shard is None:
            return
        async with held_by_deadline(shard.lock, key, "a flush of it"):
            if self.dirty.get(key) is not shard:
                return
            # chunks flushed while open and unchanged since are in storage already
            snapshot = {cid: (c.version, None if c.data is None else bytes(c.data))
                        for cid, c in shard.chunks.items() if c.clean != c.version}
            if not snapshot:
                if not shard.chunks:  # (emptied while a flush held the lock)
                    self._drop_shard(key)
                return
            failed = None
            try:
                await self._write_shard(shard, {cid: d for cid, (_, d) in snapshot.items()})
            except StoreError as exc:
                if isinstance(exc, NotFound):
                    # a place to write that vanished (local: a parent that is
                    # a file) is a failed write, not a missing file: EIO
                    exc = StoreError(str(exc), key)
                failed = shard.error = self.last_failure = exc
                shard.failures += 1
                shard.failed_at = time.monotonic()
                self.flush_errors += 1
                self.failing = True
                if isinstance(exc, CorruptData):
                    # damage: the one line about the damaged shard (5.2) says it,
                    # whichever path meets it first (a read, this flush, an fsync)
                    report_damage(log, CorruptData(f"{exc} (a flush of {key} failed: its new chunks are kept "
                                                   "in memory, retried)", exc.key or key))
                elif not _CALLER_LOGS_FAILURES.get():
                    # retried every second while writers wait: one line a minute
                    log_once(log, logging.ERROR, f"flush of {key} failed (kept in memory, retried): {exc}")
                    exc.logged = True  # (its line: a request failing with it adds none, see fuse_ops._translate)
            else:
                shard.error = None
                shard.failures = 0
                self.failing = False
                self.flushes += 1
                self._stored_now(key)
                for cid, (version, _) in snapshot.items():
                    chunk = shard.chunks.get(cid)
                    if chunk is not None and chunk.version == version:
                        if chunk.writers:
                            chunk.clean = version
                            self._count(chunk)
                        else:
                            self._detach(shard, cid)
                if not shard.chunks and self.dirty.get(key) is shard:
                    self._drop_shard(key)
        async with self._room:
            self._room.notify_all()  # waiting writers judge every outcome
        if failed is not None:
            raise failed

    async def _write_shard(self, shard: DirtyShard, changes: dict[int, bytes | None]) -> None:
        fmt, ctx = shard.fmt, shard.ctx
        encode = getattr(fmt, "encode_chunk_for", None) or (lambda _cid, d: fmt.encode_chunk(d))
        encoded = await off_loop(lambda: {cid: (encode(cid, d) if d is not None else None)
                                          for cid, d in changes.items()},
                                 sum(len(d) for d in changes.values() if d is not None))
        for attempt in range(self.max_attempts):
            self.shards.forget(shard.key)
            index = await fmt.load_index(self.store, shard.key, ctx)
            kept: dict[int, bytes] = {}
            if index is not None:
                try:  # (precomputed locate() and entries() read minishard indexes, pinned too)
                    if all(d is None for d in encoded.values()) and not await self._any_stored(index, encoded):
                        return  # only unlinks of chunks never stored (made and removed here): no write
                    entries = [e for e in await index.entries() if e[0] not in encoded]
                    kept = await self._read_kept(shard.key, index.info, entries)
                except (PreconditionFailed, NotFound):  # replaced meanwhile: read it again
                    await pause_within_deadline(_backoff(attempt), shard.key, "replaced while being read")
                    continue
            merged = dict(kept)
            merged.update({cid: d for cid, d in encoded.items() if d is not None})
            try:
                if not merged:
                    if index is not None:
                        await self.store.delete(shard.key, if_match=index.info.etag, prune_below=shard.home)
                else:
                    data = await off_loop(functools.partial(fmt.encode, merged, ctx),
                                          sum(map(len, merged.values())) + fmt.index_size(ctx))
                    if index is None:
                        await self.store.put(shard.key, data, if_none_match=True)
                    else:
                        await self.store.put(shard.key, data, if_match=index.info.etag)
            except PreconditionFailed:
                log.info("%s changed under us; re-reading and merging again", shard.key)
                await pause_within_deadline(_backoff(attempt), shard.key, "replaced by another writer meanwhile")
                continue
            finally:
                self.shards.forget(shard.key)
            return
        raise StoreError(f"{shard.key}: gave up after {self.max_attempts} conflicting concurrent writes", shard.key)

    @staticmethod
    async def _any_stored(index, chunk_ids) -> bool:
        """Does the stored shard hold any of ``chunk_ids``?  (True when its
        index cannot tell: a damaged part is never assumed empty.)"""
        try:
            for cid in chunk_ids:
                if await index.locate(cid) is not None:
                    return True
        except CorruptData:
            return True
        return False

    async def _read_kept(self, key: str, info, entries) -> dict[int, bytes]:
        """The stored bytes of the chunks a rewrite keeps, in few ranged reads
        pinned to the version their index came from."""
        out: dict[int, bytes] = {}
        entries = sorted((off, n, cid) for cid, off, n in entries)
        _check_kept(key, info, entries)
        i = 0
        while i < len(entries):
            start = entries[i][0]
            end = start + entries[i][1]
            j = i + 1
            while j < len(entries) and entries[j][0] - end <= MAX_GAP:
                end = max(end, entries[j][0] + entries[j][1])
                j += 1
            blob = await self.store.get(key, start, end - start, if_match=info.etag)
            for off, n, cid in entries[i:j]:
                out[cid] = blob.data[off - start: off - start + n]
            i = j
        return out

    async def flush_below(self, prefix: str) -> None:
        """Flush every dirty shard whose key is below directory ``prefix``."""
        below = prefix + "/" if prefix else ""
        errors = await self._flush_many([k for k in self.dirty if k.startswith(below)])
        if errors:
            raise errors[0]

    async def flush_keys(self, keys) -> None:
        """Flush those of the shards ``keys`` that are dirty; raises the
        first failure (after trying them all)."""
        errors = await self._flush_many([k for k in keys if k in self.dirty])
        if errors:
            raise errors[0]

    def removing_below(self, prefix: str) -> list[str]:
        """Dirty shards below directory ``prefix`` that hold a removed chunk."""
        below = prefix + "/" if prefix else ""
        return [k for k, shard in self.dirty.items()
                if k.startswith(below) and any(c.data is None for c in shard.chunks.values())]

    async def sync_all(self) -> list[StoreError]:
        """Flush every dirty shard (sync, unmount, SIGTERM); returns failures."""
        return await self._flush_many(list(self.dirty))

    async def _flush_many(self, keys: list[str]) -> list[StoreError]:
        """Flush ``keys``, FLUSH_PARALLEL at a time (one after another, 100
        shards at 50 ms a round trip took seconds; against a hung endpoint,
        shards times the deadline); their failures, in no particular order."""
        errors: list[StoreError] = []
        limiter = trio.CapacityLimiter(FLUSH_PARALLEL)

        async def one(key: str) -> None:
            async with limiter:
                try:
                    await self.flush(key)
                except StoreError as exc:
                    errors.append(exc)
                except Exception as exc:  # a bug: the other shards are still stored
                    log.exception("flush of %s failed", key)
                    errors.append(StoreError(f"{key}: {type(exc).__name__}: {exc}", key))

        if len(keys) == 1:
            await one(keys[0])
        elif keys:
            async with trio.open_nursery() as nursery:
                for key in keys:
                    nursery.start_soon(one, key)
        return errors

    # -- background flusher ---------------------------------------------------

    def _due(self, now: float) -> list[str]:
        """The shards to flush now, oldest first.  Under the cap this looks
        only at the candidates (the idle head of ``dirty``, and the shards
        that were full), not at every dirty shard: it runs after every write."""
        over = self.dirty_bytes > self.max_dirty_bytes
        pressed = over and self._waiting > 0
        if over:
            candidates = list(self.dirty.values())
        else:
            candidates = []
            for shard in self.dirty.values():  # (least recently touched first)
                if now - shard.touched < self.idle_delay:
                    break
                candidates.append(shard)
            for key in list(self._maybe_full):
                shard = self.dirty.get(key)
                if shard is None or not shard.full:
                    self._maybe_full.discard(key)
                elif now - shard.touched < self.idle_delay:  # (else among the idle already)
                    candidates.append(shard)
        due = []
        # over the cap, shards that did not fail go first: they make room
        for shard in sorted(candidates, key=lambda s: (over and s.error is not None, s.since)):
            if (shard.error is not None and now - shard.touched < min(30.0, 0.5 * 2 ** shard.failures)
                    and not (pressed and now - shard.failed_at >= PRESSURE_RETRY)):
                continue  # back off after failures
            if over or (not shard.busy and (shard.full or now - shard.touched >= self.idle_delay)):
                due.append(shard.key)
        return due

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """Background task: flush shards as they become due."""
        task_status.started()
        while True:
            self._wake = trio.Event()
            await self._flush_many(self._due(time.monotonic()))  # (failures logged by flush; kept, retried)
            with trio.move_on_after(min(self.idle_delay, 0.5) if self.dirty else 3600):
                await self._wake.wait()


_UNJUDGED = object()


async def _rewrite_verdict(index) -> tuple[CorruptData, list[tuple[int, int, int]] | None] | None:
    """Would a rewrite of ``index``'s shard be refused?  None: no; else the
    refusal, and the sorted ``(offset, nbytes, id)`` entries when it depends
    on which of them the rewrite keeps (None: any rewrite is refused).
    Judged once per index (one version of one shard), kept on it."""
    verdict = getattr(index, "_rewrite_verdict", _UNJUDGED)
    if verdict is not _UNJUDGED:
        return verdict
    if getattr(getattr(index, "fmt", None), "multilod", False):
        return None  # (its fragments' manifests would be read: requests the write did not need; left to the flush)
    rewritable = getattr(index, "rewritable", None)
    if rewritable is not None and await off_loop(rewritable, index.nbytes):
        verdict = None  # (a whole index, judged at once: what every flush leaves)
        try:
            index._rewrite_verdict = verdict
        except AttributeError:
            pass
        return verdict
    try:
        entries = await index.entries()
    except CorruptData as exc:
        verdict = (exc, None)
    except StoreError:
        return None  # (not judged: the flush will)
    else:
        def judge(found=entries):
            ordered = sorted((off, n, cid) for cid, off, n in found)
            try:
                _check_kept(index.info.key, index.info, ordered)
                return None
            except CorruptData as exc:
                return exc, ordered

        verdict = await off_loop(judge, 32 * len(entries))  # (as the flush's: a big index is not judged on the loop)
    try:
        index._rewrite_verdict = verdict
    except AttributeError:
        pass
    return verdict


def _check_kept(key: str, info, entries: list[tuple[int, int, int]]) -> None:
    """Refuse (CorruptData), before anything is read, a rewrite whose kept
    chunks (``(offset, nbytes, id)``, sorted) are damage: past the end of the
    shard, one longer than MAX_CHUNK_BYTES (read whole: damage, as for a
    read), ranges that overlap (a copy of the range per chunk, in memory and
    in the new shard), or more than MAX_REWRITE_BYTES in all."""
    if any(off + n > info.size for off, n, _ in entries):
        raise CorruptData(f"{key}: index points past the end of the shard; not rewriting it", key)
    if any(n > MAX_CHUNK_BYTES for _, n, _ in entries):
        raise CorruptData(f"{key}: index declares a chunk larger than {MAX_CHUNK_BYTES >> 20} MiB; "
                          "not rewriting it", key)
    end = 0
    for off, n, cid in entries:
        if n and off < end:
            raise CorruptData(f"{key}: index declares chunks whose bytes overlap (chunk {cid} at {off}); "
                              "not rewriting it", key)
        end = max(end, off + n)
    if sum(n for _, n, _ in entries) > MAX_REWRITE_BYTES:
        raise CorruptData(f"{key}: index declares more than the {MAX_REWRITE_BYTES >> 30} GiB a rewrite may keep; "
                          "not rewriting it", key)
