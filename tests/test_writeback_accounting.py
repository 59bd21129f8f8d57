"""The write-back's bookkeeping: what one write costs, and that the running
totals stay equal to what they total.

``WriteBack`` keeps the dirty bytes (the back-pressure test every write
makes) and what the flusher asks after every write as running totals per
shard and per mount.  Summing them per call made every chunk write cost time
in proportion to all dirty chunks: writing 60k small chunks took minutes.
The first test counts the dirty-state records one write looks at (not
time); the second drives a mixed workload, with storage failing part of the
time, and recounts everything after every step (``WriteBack.check``).
"""

from __future__ import annotations

import random
import time

import numpy as np
import pytest
import trio

from tests.handmade_zarr import array_doc, linear, shard_bytes, write_array_doc
from zshardfs import writeback
from zshardfs.backends.base import CorruptData, StoreError
from zshardfs.backends.local import LocalBackend
from zshardfs.config import MountConfig
from zshardfs.daemon import build_view
from zshardfs.shards import EMPTY, MAX_CHUNK_BYTES
from zshardfs.writeback import WriteBack

pytestmark = pytest.mark.timeout(300)


# ---------------------------------------------------------------------------
# (a) one write's cost does not grow with the dirty set


class _Reads:
    """Counts attribute reads of DirtyChunk and DirtyShard records while on."""

    def __init__(self, monkeypatch):
        self.n = 0
        self.on = False
        counter = self
        for cls in (writeback.DirtyChunk, writeback.DirtyShard):
            def counting(obj, name, _get=object.__getattribute__):
                if _get(counter, "on"):
                    counter.n += 1
                return _get(obj, name)
            monkeypatch.setattr(cls, "__getattribute__", counting)


def _reads_per_write(reads: _Reads, dirty_chunks: int, writes: int = 50, per_shard: int = 100) -> float:
    """Attribute reads of dirty-state records per chunk write (back-pressure
    check, write, close, and the flusher's look for due shards) with
    ``dirty_chunks`` small chunks dirty, ``per_shard`` to a shard."""
    wb = WriteBack(None, None, max_dirty_bytes=1 << 40, idle_delay=3600.0)  # (no flush is due)

    def write_one(n: int) -> None:
        key = f"arr/c/{n // per_shard}"
        chunk = wb.open_chunk(key, None, None, n % per_shard, b"")
        chunk.data[0:4] = b"abcd"  # (as View.write: in place, then ``changed``)
        wb.changed(key, chunk)
        wb.close_chunk(key, n % per_shard, chunk)

    async def main():
        for n in range(dirty_chunks):
            write_one(n)
        reads.n, reads.on = 0, True
        try:
            for n in range(dirty_chunks, dirty_chunks + writes):
                await wb.wait_for_room()
                write_one(n)
                wb._due(time.monotonic())
        finally:
            reads.on = False
        assert wb.dirty_bytes == 4 * (dirty_chunks + writes)

    trio.run(main)
    return reads.n / writes


def test_one_write_costs_the_same_with_20000_chunks_dirty_as_with_1000(monkeypatch):
    """The back-pressure check of every write and the flusher's pass after
    it look at a bounded number of dirty-state records, whatever the number
    of dirty chunks (the old code summed over all of them: 20x the reads at
    20x the chunks, and writing 60k chunks took minutes)."""
    reads = _Reads(monkeypatch)
    few = _reads_per_write(reads, 1000)
    many = _reads_per_write(reads, 20000)
    assert few < 100, few
    assert many <= 1.5 * few, (few, many)


# ---------------------------------------------------------------------------
# (b) the totals after a mixed workload with failures


class FlakyStore(LocalBackend):
    """A local store whose writes fail (as a full disk or a broken endpoint)
    while ``broken``."""

    broken = False

    def put(self, key, *args, **kwargs):
        if self.broken:
            raise StoreError(f"{key}: injected write failure", key)
        return super().put(key, *args, **kwargs)

    def delete(self, key, *args, **kwargs):
        if self.broken:
            raise StoreError(f"{key}: injected delete failure", key)
        return super().delete(key, *args, **kwargs)


GRID, PER = 16, 4  # 16x16 chunks of 4x4 uint8 (16 bytes), 4x4 chunks to a shard


def _chunk_shard(name: str) -> tuple[str, int]:
    i, j = map(int, name.split("/")[1:])
    return f"arr/c/{i // PER}/{j // PER}", linear((i % PER, j % PER), (PER, PER))


def test_dirty_totals_stay_exact_through_writes_failures_and_flushes(tmp_path):
    """Creates, writes through handles kept open across flushes, truncates,
    unlinks, renames, fsyncs, shards replaced whole (``superseding``),
    back-pressure refusals and flushes that fail while storage is broken,
    with the background flusher running: after every step the running
    totals equal a recount (``WriteBack.check``); at the end everything is
    stored, nothing is dirty, and every chunk reads back as written."""
    write_array_doc(tmp_path / "arr", array_doc((GRID * 4, GRID * 4), (PER * 4, PER * 4), (4, 4)))
    store = FlakyStore(str(tmp_path))
    cfg = MountConfig(source=str(tmp_path), mountpoint=str(tmp_path) + "-mnt", read_only=False,
                      flush_delay=0.02, max_dirty=600)
    view = build_view(cfg, store)
    wb = view.writeback
    wb.room_timeout = 0.05
    rng = random.Random(1234)
    names = [f"c/{i}/{j}" for i in range(GRID) for j in range(GRID)]
    model: dict[str, bytes] = {}  # chunk name -> content (absent: none)
    kept: dict[str, list] = {}  # chunk name -> handles kept open
    counts: dict[str, int] = {}

    def did(what: str) -> None:
        counts[what] = counts.get(what, 0) + 1
        wb.check()

    async def node_of(name):
        return await view.resolve("arr/" + name)

    async def parent_of(name):
        return await view.resolve("arr/" + name.rsplit("/", 1)[0])

    async def close_all(name):
        for h in kept.pop(name, []):
            await view.release(h)
            did("release")

    async def write(h, name, offset, data):
        try:
            await view.write(h, offset, data)
        except StoreError:
            did("write refused")  # back-pressure gave up: nothing written
            return
        old = bytearray(model.get(name, b""))
        if offset > len(old):
            old.extend(b"\0" * (offset - len(old)))
        old[offset: offset + len(data)] = data
        model[name] = bytes(old)
        did("write")

    async def step():
        name = rng.choice(names)
        op = rng.random()
        if op < 0.35:  # write (new file, or into an existing one), maybe keeping it open
            if name in model and rng.random() < 0.5:
                truncate = rng.random() < 0.3
                h = await view.open(await node_of(name), write=True, truncate=truncate)
                if truncate:
                    model[name] = b""
            else:
                h = await view.create(await parent_of(name), name.rsplit("/", 1)[1])
                model[name] = b""
            did("open")
            await write(h, name, rng.randrange(0, 20), bytes([rng.randrange(256)]) * rng.randrange(1, 17))
            if rng.random() < 0.3:
                kept.setdefault(name, []).append(h)
            else:
                await view.release(h)
                did("release")
        elif op < 0.45:  # write through a handle kept open (flushed meanwhile, maybe)
            if not kept:
                return
            name = rng.choice(sorted(kept))
            await write(rng.choice(kept[name]), name, rng.randrange(0, 16), bytes([rng.randrange(256)]) * 4)
        elif op < 0.52:
            if kept:
                await close_all(rng.choice(sorted(kept)))
        elif op < 0.6:  # truncate, through a kept handle or not
            if name not in model:
                return
            size = rng.randrange(0, 24)
            handles = kept.get(name)
            await view.truncate(await node_of(name), size, rng.choice(handles) if handles else None)
            model[name] = model[name][:size] + b"\0" * max(0, size - len(model[name]))
            did("truncate")
        elif op < 0.68:
            if name not in model:
                return
            await close_all(name)
            await view.unlink(await parent_of(name), name.rsplit("/", 1)[1])
            del model[name]
            did("unlink")
        elif op < 0.74:
            other = rng.choice(names)
            if name in model and other != name:
                await close_all(name)
                await close_all(other)
                try:
                    await view.rename(await parent_of(name), name.rsplit("/", 1)[1],
                                      await parent_of(other), other.rsplit("/", 1)[1])
                except StoreError:
                    did("rename refused")  # (back-pressure: both names as they were)
                    return
                model[other] = model.pop(name)
                did("rename")
        elif op < 0.8:
            if not kept:
                return
            try:
                await view.fsync(kept[rng.choice(sorted(kept))][0])
                did("fsync")
            except StoreError:
                did("fsync failed")
        elif op < 0.86:  # a shard written whole, as is: what was pending for it is older, dropped
            key, _ = _chunk_shard(name)
            if not any(_chunk_shard(n)[0] == key for n in kept):
                await supersede(name)
        elif op < 0.89:
            store.broken = not store.broken
            did("broken" if store.broken else "repaired")
        elif op < 0.91:
            errors = await wb.sync_all()
            did("sync failed" if errors else "sync")
        await trio.sleep(rng.choice((0, 0, 0.001, 0.03)))  # the flusher runs meanwhile

    async def supersede(name):
        key, _ = _chunk_shard(name)
        content = {cid: model[n] for n in model for k, cid in [_chunk_shard(n)] if k == key}
        data = shard_bytes((PER, PER), content)
        try:
            await wb.superseding(key, lambda: view.store.put(key, data))
            did("superseded")
        except StoreError:
            did("supersede failed")

    async def scripted():
        """Each failure path at least once, whatever the random steps did."""
        store.broken = False
        for name in list(kept):
            await close_all(name)
        name = names[0]
        h = await view.create(await parent_of(name), name.rsplit("/", 1)[1])
        model[name] = b""
        await write(h, name, 0, b"k" * 16)
        await view.fsync(h)  # stored while open: not dirty until written again
        did("fsync")
        await write(h, name, 4, b"K" * 4)
        kept[name] = [h]
        store.broken = True
        with pytest.raises(StoreError):
            await view.fsync(h)
        did("fsync failed")
        assert await wb.sync_all()
        did("sync failed")
        await supersede(names[5])
        for name in names[20:200]:  # past max_dirty, with every flush failing: refused
            h = await view.create(await parent_of(name), name.rsplit("/", 1)[1])
            model[name] = b""
            refused = counts.get("write refused", 0)
            await write(h, name, 0, b"r" * 16)
            await view.release(h)
            did("release")
            if counts.get("write refused", 0) > refused:
                break
        store.broken = False
        await supersede(names[5])
        assert not await wb.sync_all()
        did("sync")

    async def main():
        async with trio.open_nursery() as nursery:
            await nursery.start(wb.run)
            for _ in range(600):
                await step()
            await scripted()
            store.broken = False
            for name in list(kept):
                await close_all(name)
            errors = await view.sync()
            assert not errors, errors
            wb.check()
            assert wb.dirty_bytes == 0 and not wb.dirty, (wb.dirty_bytes, list(wb.dirty))
            nursery.cancel_scope.cancel()
        fresh = build_view(cfg, LocalBackend(str(tmp_path)))
        for name in names:
            node = await fresh.resolve("arr/" + name)
            if name in model and model[name]:
                assert node is not None and await fresh.content(node) == model[name], name
            elif name not in model:
                assert node is None, name

    trio.run(main)
    print(counts)
    # the workload did reach every path it is meant to
    for what in ("write", "write refused", "release", "truncate", "unlink", "rename", "fsync", "fsync failed",
                 "superseded", "supersede failed", "sync", "sync failed", "broken"):
        assert counts.get(what), (what, counts)



# ---------------------------------------------------------------------------
# (c) a listing's cost does not grow with the directories holding unstored chunks


class _CountingDict(dict):
    """A dict that counts the entries looked at (lookups, and each entry a
    walk over it yields)."""

    looked = 0

    def get(self, key, default=None):
        self.looked += 1
        return super().get(key, default)

    def __getitem__(self, key):
        self.looked += 1
        return super().__getitem__(key)

    def __contains__(self, key):
        self.looked += 1
        return super().__contains__(key)

    def __iter__(self):
        for key in super().__iter__():
            self.looked += 1
            yield key

    def items(self):
        for item in super().items():
            self.looked += 1
            yield item

    def keys(self):
        return iter(self)

    def values(self):
        for _, value in self.items():
            yield value


def test_a_listing_looks_only_at_its_own_directory_s_unstored_chunks(tmp_path):
    """Chunks written and not stored yet are listed at once at every level
    above them (``View._pending_children``).  Listing one directory looks
    only at its own subdirectories' entries of that table, not at every
    directory holding such chunks: before, each listing scanned them all (a
    walk of an array with 10k such rows took 32-37 s against 10 s once
    stored: quadratic; now 6 s; ``scripts/walk_pending.py``)."""
    rows = 1000
    write_array_doc(tmp_path / "arr", array_doc((2 * rows, 2), (2, 2), (2, 2)))  # a shard per chunk, a row each
    cfg = MountConfig(source=str(tmp_path), mountpoint=str(tmp_path) + "-mnt", read_only=False,
                      flush_delay=float("inf"), max_dirty=1 << 30)
    view = build_view(cfg, LocalBackend(str(tmp_path)))

    async def names(path):
        return sorted([c.name async for c in view.listdir(await view.resolve(path))])

    async def main():
        for i in range(rows):
            h = await view.create(await view.resolve(f"arr/c/{i}"), "0")
            await view.write(h, 0, b"abcd")
            await view.release(h)
        table = view.new_chunks = _CountingDict(view.new_chunks)
        looked = {}
        for path in ("", "arr", "arr/c", "arr/c/7"):
            table.looked = 0
            listed = await names(path)
            looked[path] = table.looked
            assert listed == {"": ["arr"], "arr": ["c", "zarr.json"], "arr/c": sorted(map(str, range(rows))),
                              "arr/c/7": ["0"]}[path], path
        assert looked["arr/c/7"] <= 3, looked
        assert looked[""] <= 10 and looked["arr"] <= 10, looked  # (the first row with an unstored chunk will do)
        assert looked["arr/c"] <= 3 * rows, looked  # (its own rows)
        # stored: nothing is listed for them any more but what storage holds
        assert not await view.sync()
        assert await names("arr/c/7") == ["0"]

    trio.run(main)


# ---------------------------------------------------------------------------
# (c) the judgement of a shard's index at a write's open (WriteBack.refuse_if_damaged)


def _index(table: list[tuple[int, int]], size: int):
    from zshardfs.backends.base import ObjectInfo
    from zshardfs.layouts.zarr_common import ZarrShardIndex

    return ZarrShardIndex(ObjectInfo("arr/c/0/0", size, "e", 0), np.array(table, dtype=np.uint64).reshape(-1, 2))


def _reference(index) -> bool:
    """What the flush's own check (writeback._check_kept) says of a rewrite
    keeping every stored chunk: True if it passes."""
    t = index.table.tolist()
    entries = sorted((off, n, cid) for cid, (off, n) in enumerate(t) if (off, n) != (EMPTY, EMPTY))
    try:
        writeback._check_kept(index.info.key, index.info, entries)
        return True
    except CorruptData:
        return False


def test_a_whole_zarr_index_is_judged_without_walking_its_entries(monkeypatch):
    """Every first open for writing after a flush judged the shard's new
    index version entry by entry in Python (its entries as a list, sorted,
    then the flush's check): 0.45 ms for 64 chunks, 28 ms for 4096, 180 ms
    for 32**3 (a thread).  A whole Zarr index (what a flush writes) is now
    judged with numpy, its entries never listed; the verdict is the flush's
    own check's on whole and damaged tables alike (past the end, half empty,
    longer than MAX_CHUNK_BYTES, overlapping, zero-length at one offset, more
    than MAX_REWRITE_BYTES in all), and a damaged one is still judged entry
    by entry (which entries a change leaves matters)."""
    rng = random.Random(7)
    big = 1 << 40  # (a sparse huge shard: its index may declare anything inside it)
    cases = {
        "empty": ([(EMPTY, EMPTY)] * 4, 100),
        "whole": ([(0, 10), (10, 5), (EMPTY, EMPTY), (15, 0)], 100),
        "zero-length at one offset": ([(10, 0), (10, 5), (10, 0), (0, 10)], 100),
        "touching": ([(5, 5), (0, 5), (10, 90)], 100),
        "past the end": ([(0, 10), (95, 10)], 100),
        "half empty": ([(0, 10), (EMPTY, 3)], 100),
        "overlapping": ([(0, 10), (9, 5)], 100),
        "same range": ([(0, 10), (0, 10)], 100),
        "longer than 1 GiB": ([(0, MAX_CHUNK_BYTES + 1)], big),
        "more than 4 GiB in all": ([(i * MAX_CHUNK_BYTES, MAX_CHUNK_BYTES) for i in range(5)], big),
    }
    for i in range(300):  # random small tables, some damaged
        n = rng.randint(1, 12)
        size = rng.randint(1, 200)
        table = []
        for _ in range(n):
            kind = rng.random()
            if kind < 0.2:
                table.append((EMPTY, EMPTY))
            else:
                off = rng.randint(0, size + (5 if kind < 0.3 else 0))
                table.append((off, rng.randint(0, max(0, size - off) + (5 if kind < 0.35 else 0))))
        cases[f"random {i}"] = (table, size)

    async def main():
        judged_whole = 0
        for what, (table, size) in cases.items():
            index = _index(table, size)
            want = _reference(index)
            if want:  # (a whole index: its entries are not listed)
                def listed():
                    raise AssertionError(f"{what}: its entries were listed to judge it")

                monkeypatch.setattr(index, "entries", listed, raising=False)
                judged_whole += 1
            verdict = await writeback._rewrite_verdict(index)
            assert (verdict is None) == want, (what, table, size, verdict)
            if verdict is not None:  # (refused: the entries, for the exclusion of those a change replaces)
                assert verdict[1] is not None and len(verdict[1]) == int(index.present_mask().sum()), what
        assert judged_whole >= 50  # (58 of the 310 tables)

    trio.run(main)
