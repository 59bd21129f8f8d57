"""Requests that overlap inside the daemon: the view's state across awaits.

The kernel sends requests concurrently, and every storage call is an
``await`` during which other requests run.  These tests drive the view
(``daemon.build_view``: the same stack a mount uses) over a real local
store whose calls are slowed, as an S3 round trip would be, so that the
overlaps happen every time rather than once in a while.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import threading
import time
import types

import pytest
import trio
import trio.testing

from zshardfs.backends.base import NotFound, Unavailable
from zshardfs.backends.local import LocalBackend
from zshardfs.config import MountConfig
from zshardfs.daemon import build_view
from zshardfs.view import ViewError


class SlowStore(LocalBackend):
    """A local store whose reads answer ``get_delay`` s after they read and
    whose writes land ``put_delay`` s after they are asked for."""

    get_delay = 0.0
    put_delay = 0.0

    def get(self, *args, **kwargs):
        try:
            return super().get(*args, **kwargs)
        finally:
            time.sleep(self.get_delay)

    def put(self, *args, **kwargs):
        time.sleep(self.put_delay)
        return super().put(*args, **kwargs)


def _view(root, **options):
    store = SlowStore(str(root))
    cfg = MountConfig(source=str(root), mountpoint=str(root) + "-mnt", read_only=False, **options)
    return build_view(cfg, store), store


def test_a_write_during_the_store_of_its_file_is_kept(tmp_path):
    """``(cmd1; cmd2) > f``: cmd1's close stores the file while cmd2 writes
    on; that write must be stored by the last close, not marked clean."""
    view, store = _view(tmp_path)
    store.put_delay = 0.3

    async def main():
        root = await view.resolve("")
        shell = await view.create(root, "log.txt")
        await view.write(shell, 0, b"first\n")
        child = await view.open(await view.resolve("log.txt"), write=True, truncate=False)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(view.flush, child)  # cmd1 exits: its close stores the file
            await trio.sleep(0.1)
            await view.write(shell, 6, b"second\n")  # cmd2 writes while that PUT is out
        await view.release(child)
        await view.flush(shell)
        await view.release(shell)

    trio.run(main)
    assert (tmp_path / "log.txt").read_bytes() == b"first\nsecond\n"


def test_two_opens_for_writing_share_one_file(tmp_path):
    """Two writers opening one stored file at once (each open reads it) get
    the same file, as on POSIX: both writes land, neither close undoes the
    other's."""
    (tmp_path / "f.txt").write_bytes(b"0123456789")
    view, store = _view(tmp_path)
    store.get_delay = 0.2
    handles = []

    async def open_and_write(offset, data):
        h = await view.open(await view.resolve("f.txt"), write=True, truncate=False)
        await view.write(h, offset, data)
        handles.append(h)

    async def main():
        async with trio.open_nursery() as nursery:
            nursery.start_soon(open_and_write, 0, b"AA")
            nursery.start_soon(open_and_write, 5, b"BB")
        for h in handles:
            await view.flush(h)
            await view.release(h)

    trio.run(main)
    assert (tmp_path / "f.txt").read_bytes() == b"AA234BB789"


def test_a_probe_overlapping_the_mounts_own_zarr_json_is_not_kept(tmp_path):
    """A lookup in a directory whose new zarr.json this mount is storing may
    ask storage before the PUT lands and hear back after: that "no array"
    answer must not be cached, or files made there next (within
    metadata_ttl) would be stored as plain files under a sharded document."""
    (tmp_path / "new").mkdir()
    view, store = _view(tmp_path, shard=(2,), metadata_ttl=0.2)
    doc = {"zarr_format": 3, "node_type": "array", "shape": [8], "data_type": "uint8",
           "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": [2]}},
           "chunk_key_encoding": {"name": "default", "configuration": {"separator": "."}}, "fill_value": 0,
           "codecs": [{"name": "bytes"}]}

    async def main():
        new = await view.resolve("new")
        h = await view.create(new, "zarr.json")
        await view.write(h, 0, json.dumps(doc).encode())
        store.get_delay, store.put_delay = 0.6, 0.6
        async with trio.open_nursery() as nursery:
            # its GET answers at 0.6 s, the listing then made is trusted
            # until 0.8 s, and the PUT lands at about 1.2 s
            nursery.start_soon(view.flush, h)
            await trio.sleep(1.0)
            nursery.start_soon(view.lookup, new, "c.0")  # its probe reads at 1.0 s, answers at 1.6 s
        await view.release(h)
        store.get_delay = store.put_delay = 0.0
        chunk = await view.create(new, "c.0")
        assert chunk.node.is_chunk, "created as a plain file: the array was not seen"
        await view.write(chunk, 0, b"\x07")
        await view.release(chunk)
        assert await view.sync() == []

    trio.run(main)
    stored = json.loads((tmp_path / "new" / "zarr.json").read_text())
    assert stored["codecs"][0]["name"] == "sharding_indexed"
    # c.0 is the name of the chunk and of its shard (2 chunks per shard):
    # stored sharded, it is the chunk's byte plus an index of 2 entries
    assert (tmp_path / "new" / "c.0").stat().st_size == 1 + 2 * 16 + 4


def test_a_precomputed_flush_that_loses_a_race_reading_minishards_merges_again(tmp_path):
    """Another client replaces a precomputed shard after the flush read its
    shard index and before it read the minishard indexes: the flush starts
    over from the new version (both writers' keys kept), rather than failing."""
    import os

    from zshardfs.layouts.precomputed_format import ShardingSpec, encode_shard, parse_shard

    sharding = {"@type": "neuroglancer_uint64_sharded_v1", "preshift_bits": 0, "hash": "identity",
                "minishard_bits": 1, "shard_bits": 0, "minishard_index_encoding": "raw", "data_encoding": "raw"}
    spec = ShardingSpec.from_json(sharding)
    (tmp_path / "kv").mkdir()
    (tmp_path / "kv" / "info").write_text(json.dumps({"@type": "neuroglancer_skeletons", "sharding": sharding}))
    shard = tmp_path / "kv" / "0.shard"
    shard.write_bytes(encode_shard({1: b"one", 2: b"two"}, spec))
    theirs = encode_shard({1: b"one", 2: b"two", 3: b"three"}, spec)

    class RacingStore(SlowStore):
        gets = 0

        def _count(self, key):
            if key == "kv/0.shard":
                self.gets += 1
                if self.gets == 2:  # the flush's first minishard read: the other client wins
                    tmp = shard.with_name("0.shard.theirs")
                    tmp.write_bytes(theirs)
                    os.replace(tmp, shard)

        def get(self, key, *args, **kwargs):
            self._count(key)
            return super().get(key, *args, **kwargs)

        def get_nowait(self, *args, **kwargs):
            return None  # every read asks the file (as S3 does): a replaced version fails its If-Match

    store = RacingStore(str(tmp_path))
    view = build_view(MountConfig(source=str(tmp_path), mountpoint=str(tmp_path) + "-mnt", read_only=False), store)

    async def main():
        kv = await view.resolve("kv")
        h = await view.create(kv, "4")
        await view.write(h, 0, b"four")
        await view.release(h)
        store.gets = 0
        await view.writeback.flush("kv/0.shard")

    trio.run(main)
    ids, offsets, sizes, _ = parse_shard(shard.read_bytes(), spec)
    assert sorted(ids.tolist()) == [1, 2, 3, 4]


def test_a_listing_that_read_a_shard_before_its_flush_shows_no_chunk_removed_meanwhile(tmp_path):
    """A listing reads a precomputed shard's minishard index, then a flush
    stores the unlink of one of its keys: the listing must not show that key
    from the version it read (its name listed, then ENOENT: found by the
    differential tester, a name renamed away still listed)."""
    from zshardfs.layouts.precomputed_format import ShardingSpec, encode_shard

    sharding = {"@type": "neuroglancer_uint64_sharded_v1", "preshift_bits": 0, "hash": "identity",
                "minishard_bits": 1, "shard_bits": 0, "minishard_index_encoding": "raw", "data_encoding": "raw"}
    (tmp_path / "kv").mkdir()
    (tmp_path / "kv" / "info").write_text(json.dumps({"@type": "neuroglancer_skeletons", "sharding": sharding}))
    (tmp_path / "kv" / "0.shard").write_bytes(encode_shard({1: b"one", 3: b"three"}, ShardingSpec.from_json(sharding)))

    class FlushingStore(LocalBackend):
        """The listing's read of the shard index is answered (the old
        version's), then, before the listing goes on, the flush ends."""

        armed = False

        def get(self, key, start=0, length=None, *args, **kwargs):
            blob = super().get(key, start, length, *args, **kwargs)
            if self.armed and key == "kv/0.shard":
                self.armed = False
                trio.from_thread.run(view.writeback.flush, "kv/0.shard")
            return blob

        def get_nowait(self, *args, **kwargs):
            return None  # every read asks the file (as S3 does)

    store = FlushingStore(str(tmp_path))
    view = build_view(MountConfig(source=str(tmp_path), mountpoint=str(tmp_path) + "-mnt", read_only=False), store)

    async def main():
        kv = await view.resolve("kv")
        await view.unlink(kv, "1")  # (pending: not stored yet)
        view.ctx.shards.forget("kv/0.shard")
        store.armed = True
        names = [node.name async for node in view.listdir(kv)]
        assert not store.armed  # (the flush ran inside the listing)
        assert sorted(names) == ["3", "info"]
        assert await view.resolve("kv/1") is None

    trio.run(main)


def _small_array(root) -> None:
    """arr: 8x8 uint8, shards of 4x4, inner chunks 2x2; shard (0, 0) holds
    its 4 chunks, chunk i filled with bytes i + 1."""
    from tests.handmade_zarr import array_doc, write_array_doc, write_shard

    write_array_doc(root / "arr", array_doc((8, 8), (4, 4), (2, 2)))
    write_shard(root / "arr", (0, 0), (2, 2), {i: bytes([i + 1]) * 4 for i in range(4)})


def test_an_open_for_writing_that_writes_nothing_stores_nothing(tmp_path):
    """``open("r+b")`` of a chunk, or ``touch``, with no write: its close
    stores nothing.  Before, the content read at open was dirty, so its
    shard was rewritten, and a chunk another mount replaced meanwhile (and
    fsynced) was put back to the old bytes."""
    _small_array(tmp_path)
    a, a_store = _view(tmp_path)
    b, _ = _view(tmp_path)

    async def main():
        held = await a.open(await a.resolve("arr/c/0/0"), write=True, truncate=False)
        other = await b.open(await b.resolve("arr/c/0/0"), write=True, truncate=True)
        await b.write(other, 0, b"NEW!")
        await b.fsync(other)
        await b.release(other)
        await a.flush(held)
        await a.release(held)
        assert not await a.sync()
        assert a_store.counters["put"] == 0
        check, _ = _view(tmp_path)
        assert await check.content(await check.resolve("arr/c/0/0")) == b"NEW!"

    trio.run(main)


def test_an_open_for_writing_starts_from_a_write_that_landed_while_it_read(tmp_path):
    """An open for writing reads the chunk (a round trip on S3); a write of
    the same mount that lands, is fsynced and closed meanwhile is what the
    opener's buffer starts from.  Before, it started from the bytes read, so
    its one-byte write undid the other write."""
    _small_array(tmp_path)
    view, store = _view(tmp_path)
    view.store._nowait = None  # every chunk read goes through a worker thread, as on S3

    async def main():
        node = await view.resolve("arr/c/0/0")
        store.get_delay = 0.3
        held = {}

        async def opener():
            held["h"] = await view.open(node, write=True, truncate=False)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(opener)
            await trio.sleep(0.05)
            store.get_delay = 0.0
            other = await view.open(node, write=True, truncate=True)
            await view.write(other, 0, b"NEW!")
            await view.fsync(other)
            await view.release(other)
        await view.write(held["h"], 3, b"X")
        await view.release(held["h"])
        assert not await view.sync()
        check, _ = _view(tmp_path)
        assert await check.content(await check.resolve("arr/c/0/0")) == b"NEWX"

    trio.run(main)


def test_a_file_unlinked_while_its_close_stores_it_stays_gone(tmp_path):
    """``close`` stores a file (its PUT out) while another process unlinks
    it: the unlink waits for that PUT and removes what it stored.  Before,
    the unlink returned first and the PUT then brought the file back, in
    storage and in the view; for a new file and a stored one alike."""
    (tmp_path / "old.txt").write_bytes(b"old")
    view, store = _view(tmp_path)

    async def main():
        root = await view.resolve("")
        for name in ("new.txt", "old.txt"):
            store.put_delay = 0.0
            if name == "new.txt":
                h = await view.create(root, name)
            else:
                h = await view.open(await view.resolve(name), write=True, truncate=True)
            await view.write(h, 0, b"new content")
            store.put_delay = 0.3

            async def close(h=h):
                await view.flush(h)
                await view.release(h)

            async with trio.open_nursery() as nursery:
                nursery.start_soon(close)
                await trio.sleep(0.1)
                await view.unlink(root, name)
            assert not await view.sync()
            assert not (tmp_path / name).exists(), name
            assert await view.lookup(root, name) is None, name

    trio.run(main)


def test_a_write_given_up_at_the_deadline_never_lands_over_a_newer_one(tmp_path):
    """A PUT that outlives ``-o timeout`` fails (EIO) but its worker thread
    goes on, and may land later.  The next write of that file waits for it:
    the file ends with what was stored last.  Before, the late PUT of the
    older text replaced the newer one after its fsync had returned 0."""

    class FirstPutStuck(SlowStore):
        puts = 0

        def put(self, *args, **kwargs):
            FirstPutStuck.puts += 1
            if FirstPutStuck.puts == 1:
                time.sleep(1.5)  # in transit longer than the 0.5 s deadline
            return super().put(*args, **kwargs)

    store = FirstPutStuck(str(tmp_path))
    view = build_view(MountConfig(source=str(tmp_path), mountpoint=str(tmp_path) + "-mnt", read_only=False,
                                  timeout=0.5), store)

    async def main():
        h = await view.create(await view.resolve(""), "notes.txt")
        await view.write(h, 0, b"version 1")
        try:
            await view.fsync(h)
            raise AssertionError("the stuck PUT should have failed the fsync")
        except Exception as exc:  # noqa: BLE001 - the view's error for EIO
            assert "no answer within" in str(exc), exc
        await view.write(h, 0, b"version 2")
        await trio.sleep(0.6)  # past the moment of failing fast
        await view.fsync(h)
        await view.release(h)
        await trio.sleep(1.2)  # the first PUT's thread has ended by now
        assert (tmp_path / "notes.txt").read_bytes() == b"version 2"

    trio.run(main)


def test_writes_during_a_rename_of_their_file_land_under_the_new_name(tmp_path):
    """A write through a handle open on a file another request is renaming
    (the rename copies the bytes, stores the new name, removes the old one,
    then moves the open handles) waits until the handle has moved.  Before,
    a write between the copy and the move went to the old name's buffer
    and was lost; for plain files and chunks alike."""
    _small_array(tmp_path)
    (tmp_path / "f.txt").write_bytes(b"0123456789")

    async def main(src, dst, offset, expected):
        view, store = _view(tmp_path)
        h = await view.open(await view.resolve(src), write=True, truncate=False)
        await view.write(h, 0, b"AAAA")
        store.put_delay = 0.3
        parent = await view.resolve(src.rpartition("/")[0])
        async with trio.open_nursery() as nursery:
            nursery.start_soon(view.rename, parent, src.rpartition("/")[2], parent, dst.rpartition("/")[2])
            await trio.sleep(0.1)  # the rename is storing the new name
            await view.write(h, offset, b"ZZ")
        await view.fsync(h)
        await view.release(h)
        assert not await view.sync()
        check, _ = _view(tmp_path)
        node = await check.resolve(dst)
        got = await check.read(node, 0, 100) if not node.is_chunk else await check.content(node)
        assert got == expected, (src, got)

    trio.run(main, "f.txt", "g.txt", 4, b"AAAAZZ6789")
    trio.run(main, "arr/c/0/0", "arr/c/0/1", 0, b"ZZAA")


def test_a_close_during_a_rename_of_its_file_never_brings_the_old_name_back(tmp_path):
    """close (FLUSH) or fsync through a handle on a file being renamed
    waits, as a write does, until the handle has moved.  Before, one that
    came after the rename removed the old name stored that name again."""
    (tmp_path / "a.txt").write_bytes(b"old")

    class SlowToFindTheNewName(SlowStore):
        slow = False
        stat_nowait = None  # (every stat in a worker thread, where it is slowed)

        def stat(self, key, *args, **kwargs):
            if self.slow and key == "b.txt":
                time.sleep(0.4)  # the rename's lookup of its new name, after it removed a.txt
            return super().stat(key, *args, **kwargs)

    store = SlowToFindTheNewName(str(tmp_path))
    view = build_view(MountConfig(source=str(tmp_path), mountpoint=str(tmp_path) + "-mnt", read_only=False), store)
    view.store.list_ttl = 0

    async def main():
        root = await view.resolve("")
        h = await view.open(await view.resolve("a.txt"), write=True, truncate=True)
        await view.write(h, 0, b"new text")  # stored at close
        store.slow = True
        async with trio.open_nursery() as nursery:
            nursery.start_soon(view.rename, root, "a.txt", root, "b.txt")
            for _ in range(200):
                await trio.sleep(0.005)
                if not (tmp_path / "a.txt").exists():
                    break
            await view.flush(h)
        await view.release(h)
        assert not await view.sync()
        assert sorted(p.name for p in tmp_path.iterdir()) == ["b.txt"]
        assert (tmp_path / "b.txt").read_bytes() == b"new text"
        assert await view.lookup(root, "a.txt") is None

    trio.run(main)


def test_an_unlink_after_a_store_given_up_at_the_deadline_removes_what_lands(tmp_path):
    """A close whose PUT was given up at ``-o timeout`` (EIO) may still have
    stored the file: an unlink then deletes it after that PUT has ended.
    Before, the file counted as never stored, the unlink deleted nothing,
    and the late PUT brought it back."""
    view, store = _view(tmp_path, timeout=0.5)

    async def main():
        root = await view.resolve("")
        h = await view.create(root, "new.txt")
        await view.write(h, 0, b"data")
        store.put_delay = 0.8
        try:
            await view.flush(h)
            raise AssertionError("the slow PUT should have failed the close")
        except Exception as exc:  # noqa: BLE001 - the view's error for EIO
            assert "no answer within" in str(exc), exc
        await view.release(h)
        store.put_delay = 0.0
        await trio.sleep(0.1)
        await view.unlink(root, "new.txt")  # waits for the late PUT, then deletes
        await trio.sleep(0.5)
        assert not (tmp_path / "new.txt").exists()
        assert await view.lookup(root, "new.txt") is None

    trio.run(main)


def test_an_unlink_during_an_unrelated_rename_detaches_its_writers(tmp_path):
    """Whether an unlink moves its file's open handles (a rename's own
    unlink) or detaches them (any other) is the unlink's own business.
    Before, one flag for the whole view told an unrelated unlink, running
    while a rename's unlink was out, to move them: a handle still open on
    the removed file then stored it back at its close."""
    (tmp_path / "a.txt").write_bytes(b"aaa")
    (tmp_path / "x.txt").write_bytes(b"xxx")

    class SlowDelete(SlowStore):
        slow = False

        def delete(self, key, *args, **kwargs):
            if self.slow and key == "a.txt":
                time.sleep(0.4)
            return super().delete(key, *args, **kwargs)

    store = SlowDelete(str(tmp_path))
    view = build_view(MountConfig(source=str(tmp_path), mountpoint=str(tmp_path) + "-mnt", read_only=False), store)

    async def main():
        root = await view.resolve("")
        w = await view.open(await view.resolve("x.txt"), write=True, truncate=False)
        await view.write(w, 0, b"XXX")
        store.slow = True
        async with trio.open_nursery() as nursery:
            nursery.start_soon(view.rename, root, "a.txt", root, "b.txt")
            await trio.sleep(0.2)  # the rename's unlink of a.txt is out
            await view.unlink(root, "x.txt")
        await view.write(w, 3, b"!")
        await view.flush(w)
        await view.release(w)
        assert not (tmp_path / "x.txt").exists()
        assert await view.lookup(root, "x.txt") is None

    trio.run(main)


def test_renames_onto_themselves_and_swapped_at_once_end(tmp_path):
    """``rename(a, a)`` changes nothing; ``a -> b`` and ``b -> a`` at once
    (two requests in different directories could overlap so) both end.
    Before, each waited for itself, or for the other."""
    (tmp_path / "a.txt").write_bytes(b"a")
    (tmp_path / "b.txt").write_bytes(b"b")
    view, store = _view(tmp_path)
    store.get_delay = 0.2

    async def main():
        root = await view.resolve("")
        with trio.fail_after(5):
            await view.rename(root, "a.txt", root, "a.txt")
            assert (tmp_path / "a.txt").read_bytes() == b"a"
            async with trio.open_nursery() as nursery:
                nursery.start_soon(view.rename, root, "a.txt", root, "b.txt")
                nursery.start_soon(view.rename, root, "b.txt", root, "a.txt")
        assert not view._renaming

    trio.run(main)


def test_a_truncate_by_path_that_fails_to_store_leaves_no_handle(tmp_path):
    """``truncate(2)`` of a path (no open file) opens, changes and stores
    the file itself: when storing fails (EIO), its own handle is released
    all the same.  Before, it stayed registered as a writer for good."""
    from zshardfs.backends.base import StoreError

    (tmp_path / "f.txt").write_bytes(b"0123456789")

    class Failing(SlowStore):
        fail = False

        def put(self, *args, **kwargs):
            if self.fail:
                raise StoreError("f.txt: the disk is gone", "f.txt")
            return super().put(*args, **kwargs)

    store = Failing(str(tmp_path))
    view = build_view(MountConfig(source=str(tmp_path), mountpoint=str(tmp_path) + "-mnt", read_only=False), store)

    async def main():
        node = await view.resolve("f.txt")
        store.fail = True
        try:
            await view.truncate(node, 4)
            raise AssertionError("the truncate should have failed")
        except StoreError:
            pass
        assert not view.writers, view.writers
        assert all(b.handles == 0 for b in view.buffers.values())
        store.fail = False
        assert not await view.sync()
        assert (tmp_path / "f.txt").read_bytes() == b"0123"

    trio.run(main)


def test_large_indexes_load_within_the_index_cache_budget(tmp_path):
    """Indexes being loaded at once hold at most the index cache's budget
    (one larger index loads alone): a store declaring shards of 2**24
    chunks (a 256 MiB index each) took gigabytes with a few lookups in
    parallel.  Here: 1 MiB indexes, a 1 MiB budget, four lookups at once:
    one index GET at a time, and every lookup answered."""
    import numpy as np

    n = 256
    (tmp_path / "arr").mkdir()
    (tmp_path / "arr/zarr.json").write_text(json.dumps({
        "zarr_format": 3, "node_type": "array", "shape": [4 * n, n], "data_type": "uint8",
        "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": [n, n]}},
        "chunk_key_encoding": {"name": "default", "configuration": {"separator": "/"}}, "fill_value": 0,
        "codecs": [{"name": "sharding_indexed", "configuration": {
            "chunk_shape": [1, 1], "codecs": [{"name": "bytes"}],
            "index_codecs": [{"name": "bytes", "configuration": {"endian": "little"}}], "index_location": "end"}}],
        "attributes": {}}))
    index = np.full((n * n, 2), 2**64 - 1, "<u8")
    index[0] = (0, 1)
    for i in range(4):
        (tmp_path / f"arr/c/{i}").mkdir(parents=True)
        (tmp_path / f"arr/c/{i}/0").write_bytes(b"\x07" + index.tobytes())
    view, store = _view(tmp_path, index_cache=1 << 20)
    view.store._nowait = None  # (every index read in a worker thread, where it is counted and held)
    at_once, most = [0], [0]
    plain_get = store.get

    def counted_get(*args, **kwargs):
        if not kwargs.get("suffix"):  # (documents, probes: not indexes)
            return plain_get(*args, **kwargs)
        at_once[0] += 1
        most[0] = max(most[0], at_once[0])
        try:
            time.sleep(0.1)
            return plain_get(*args, **kwargs)
        finally:
            at_once[0] -= 1

    store.get = counted_get
    sizes = {}

    async def main():
        async def look(i):
            sizes[i] = (await view.resolve(f"arr/c/{i * n}/0")).size

        async with trio.open_nursery() as nursery:
            for i in range(4):
                nursery.start_soon(look, i)

    trio.run(main)
    assert sizes == {i: 1 for i in range(4)}
    assert most[0] == 1


async def _make_array(view, name):
    """An 8x8 uint8 array of 2x2 chunks, made through ``view`` (sharded by
    its ``shard`` option)."""
    meta = {"zarr_format": 3, "node_type": "array", "shape": [8, 8], "data_type": "uint8",
            "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": [2, 2]}},
            "chunk_key_encoding": {"name": "default", "configuration": {"separator": "/"}},
            "codecs": [{"name": "bytes"}], "fill_value": 0, "attributes": {}}
    doc = await view.create(await view.mkdir(await view.resolve(""), name), "zarr.json")
    await view.write(doc, 0, json.dumps(meta).encode())
    await view.flush(doc)
    await view.release(doc)


def test_datasets_made_here_are_forgotten_once_quiet(tmp_path):
    """An array made through the mount keeps, while it is written, the chunk
    directories made or written there (a copy's mkdir must not meet EEXIST);
    once it has been quiet for BORN_HERE_QUIET with nothing left to store, it
    is like any stored array and those directories are forgotten: the memory
    is bounded by what is being written, not by everything written since the
    mount (a mount writing new arrays for weeks kept them all)."""
    view, _ = _view(tmp_path, shard=(2, 2))

    async def main():
        await _make_array(view, "arr")
        assert "arr" in view.born_here
        view.born_here["arr"] = 0.0  # (long quiet: a mkdir in the array's directory says it is written)
        c = await view.mkdir(await view.resolve("arr"), "c")
        assert view.born_here["arr"] > 0.0
        row = await view.mkdir(c, "0")
        chunk = await view.create(row, "0")
        await view.write(chunk, 0, b"\x07" * 4)
        await view.release(chunk)
        assert await view.resolve("arr/c/1") is None  # made here: not there until made
        assert not await view.sync()
        assert view.born_here and view.written_dirs and "arr/c" in view.new_dirs
        view.BORN_HERE_QUIET = 0
        assert not await view.sync()
        assert not view.born_here and not view.written_dirs and not view.removed_dirs
        assert not [d for d in view.new_dirs if d.startswith("arr/")]
        assert (await view.resolve("arr/c/0/0")).size == 4
        assert (await view.resolve("arr/c/1")).is_dir  # now as in any stored array: inside the grid

    trio.run(main)
    assert (tmp_path / "arr/c/0/0").exists()  # the shard


def test_temporaries_left_by_a_killed_writer_are_discarded(tmp_path, caplog):
    """A temporary inside a chunk directory that is closed and never renamed
    (its writer was killed) lives only in memory: after SCRATCH_KEEP it is
    discarded with one log line, at the next file made, so it holds neither
    memory nor its array (which is then forgotten once quiet) until unmount.
    One still open, or written lately, is kept."""
    view, _ = _view(tmp_path, shard=(2, 2))

    async def main():
        await _make_array(view, "arr")
        row = await view.mkdir(await view.mkdir(await view.resolve("arr"), "c"), "0")
        for name in ("0.tmp-a", "0.tmp-b"):
            h = await view.create(row, name)
            await view.write(h, 0, b"\x01" * 4)
            await view.release(h)
        still_open = await view.create(row, "0.tmp-c")
        assert {"arr/c/0/0.tmp-a", "arr/c/0/0.tmp-b", "arr/c/0/0.tmp-c"} <= set(view.buffers)
        fourth = await view.create(row, "0.tmp-d")  # (too soon: nothing is old enough)
        await view.release(still_open)
        assert len([p for p in view.buffers if p.startswith("arr/c/0/")]) == 4
        view.SCRATCH_KEEP = 0.2
        view.buffers["arr/c/0/0.tmp-c"].mtime_ns = time.time_ns()  # written lately
        for path in ("arr/c/0/0.tmp-a", "arr/c/0/0.tmp-b"):
            view.buffers[path].mtime_ns -= 10**9
        view._scratch_swept_at = 0.0
        newest = await view.create(row, "0.tmp-e")
        assert {p for p in view.buffers if p.startswith("arr/c/0/")} == {
            "arr/c/0/0.tmp-c", "arr/c/0/0.tmp-d", "arr/c/0/0.tmp-e"}
        assert await view.resolve("arr/c/0/0.tmp-a") is None
        lines = [r.getMessage() for r in caplog.records if "discarded" in r.getMessage()]
        assert len(lines) == 1 and "0.tmp-" in lines[0] and "1 more" in lines[0], lines
        await view.release(fourth)
        await view.release(newest)
        for buf in view.buffers.values():
            buf.mtime_ns -= 10**9
        view._scratch_swept_at = 0.0
        await view.create(await view.resolve(""), "elsewhere.txt")  # (any file made sweeps)
        assert not [p for p in view.buffers if p.startswith("arr/")]
        view.BORN_HERE_QUIET = 0
        assert not await view.sync()
        assert "arr" not in view.born_here  # nothing of it left in memory

    trio.run(main)


def test_a_temporary_being_read_is_kept_and_its_reader_keeps_its_bytes(tmp_path):
    """A scratch file (only in memory) open for reading is not discarded as
    abandoned; one unlinked under its reader, or discarded once the reader
    is gone, leaves the open descriptor its bytes and is ENOENT to a new
    open (before: EIO, and a traceback from a read of key None)."""
    view, _ = _view(tmp_path, shard=(2, 2))

    async def main():
        await _make_array(view, "arr")
        row = await view.mkdir(await view.mkdir(await view.resolve("arr"), "c"), "0")
        w = await view.create(row, "0.tmp")
        await view.write(w, 0, b"scratch")
        await view.release(w)
        node = await view.resolve("arr/c/0/0.tmp")
        reader = await view.open(node, write=False, truncate=False)
        view.SCRATCH_KEEP = 0.0
        view.buffers["arr/c/0/0.tmp"].mtime_ns -= 10**9
        view._scratch_swept_at = 0.0
        await view.create(await view.resolve(""), "other.txt")  # (a sweep)
        assert "arr/c/0/0.tmp" in view.buffers  # being read: kept
        second = await view.open(node, write=False, truncate=False)
        await view.unlink(row, "0.tmp")
        assert await view.read(second, 0, 100) == b"scratch"  # its own bytes, as on POSIX
        await view.release(second)
        await view.release(reader)
        assert await view.refresh(node) is None
        with pytest.raises(ViewError) as gone:
            await view.open(node, write=False, truncate=False)
        assert gone.value.errno == errno.ENOENT
        with pytest.raises(NotFound):
            await view.read(node, 0, 100)

    trio.run(main)


def test_shrinking_a_sparse_transformer_array_reads_only_its_stored_shards(tmp_path):
    """The chunks outside a v3-draft array's smaller shape are removed
    (SEMANTICS 4.9) by finding the shards storage holds (listings), not by
    trying every shard position past the shape: a 4096 x 4096 grid of
    one-chunk shards with two stored shrinks at once, reading one index."""
    import numpy as np

    ext = "https://purl.org/zarr/spec/storage_transformers/sharding/1.0"
    doc = {"shape": [4096 * 64, 4096 * 64], "data_type": "|u1",
           "chunk_grid": {"type": "regular", "chunk_shape": [64, 64], "separator": "/"},
           "chunk_memory_layout": "C", "fill_value": 0, "extensions": [], "attributes": {}, "compressor": None,
           "storage_transformers": [{"extension": ext, "type": "indexed",
                                     "configuration": {"chunks_per_shard": [1, 1]}}]}
    (tmp_path / "meta/root").mkdir(parents=True)
    (tmp_path / "meta/root/arr.array.json").write_text(json.dumps(doc))
    shard = b"\x07" * 4096 + np.array([[0, 4096]], "<u8").tobytes()
    for i in (0, 4000):
        (tmp_path / f"data/root/arr/c{i}").mkdir(parents=True)
        (tmp_path / f"data/root/arr/c{i}/0").write_bytes(shard)
    view, store = _view(tmp_path)
    view.store._nowait = None  # (every index read in a worker thread, where it is counted)
    index_reads = [0]
    plain_get = store.get

    def counted_get(*args, **kwargs):
        index_reads[0] += bool(kwargs.get("suffix"))
        return plain_get(*args, **kwargs)

    store.get = counted_get

    async def main():
        meta = await view.resolve("meta/root")
        handle = await view.open(await view.lookup(meta, "arr.array.json"), write=True, truncate=True)
        shown = dict(doc, shape=[2048 * 64, 4096 * 64])
        del shown["storage_transformers"]
        await view.write(handle, 0, json.dumps(shown).encode())
        with trio.fail_after(10):
            await view.flush(handle)
        await view.release(handle)
        assert not await view.sync()

    trio.run(main)
    assert index_reads[0] == 2  # the shard past the shape: to find its chunks, and as its flush removes them
    assert (tmp_path / "data/root/arr/c0/0").exists() and not (tmp_path / "data/root/arr/c4000").exists()


class S3LikeStore(LocalBackend):
    """A local store that, as S3, keeps no empty directories (the view keeps
    the ones it emptied) and whose lookups cost requests."""

    keeps_empty_dirs = False
    lookups_cost_requests = True


def test_rm_r_leaves_no_directories_in_memory(tmp_path):
    """(S3) ``rm -r`` of many trees: the directories it empties are kept for
    the rmdir that follows, then forgotten; nothing stays per removed tree
    (before: an entry per removed directory, for the life of the mount), and
    a directory that lost a subdirectory but holds files is not kept beyond
    EMPTIED_KEEP (before: for ever, also after another client removed it)."""
    root = tmp_path / "store"
    root.mkdir()
    view = build_view(MountConfig(source=str(root), mountpoint=str(root) + "-mnt", read_only=False,
                                  metadata_ttl=0), S3LikeStore(str(root)))
    for i in range(50):
        (root / "top" / f"t{i}" / "a" / "b").mkdir(parents=True)
        (root / "top" / f"t{i}" / "a" / "b" / "f.txt").write_bytes(b"1")
    (root / "keep" / "sub").mkdir(parents=True)
    (root / "keep" / "sub" / "g.txt").write_bytes(b"2")
    (root / "keep" / "f.txt").write_bytes(b"3")

    async def rm_r(parent, name):  # (as rm -r: depth first, unlink then rmdir)
        node = await view.lookup(parent, name)
        if node.is_dir:
            async for child in view.listdir(node):
                await rm_r(node, child.name)
            await view.rmdir(parent, name)
        else:
            await view.unlink(parent, name)

    async def main():
        top = await view.lookup(view.root(), "top")
        for i in range(50):
            await rm_r(top, f"t{i}")
        assert [c.name async for c in view.listdir(top)] == []
        assert sum(map(len, view.new_dirs.values())) == 0 and len(view.new_dirs) <= 1, view.new_dirs
        assert len(view.emptied) <= 1, view.emptied  # (top itself: it lost its last subdirectory)
        await rm_r(await view.lookup(view.root(), "keep"), "sub")
        (root / "keep" / "f.txt").unlink()  # another client removes keep's last file
        (root / "keep").rmdir()
        view.EMPTIED_KEEP = view._emptied_keep = 0.05
        await trio.sleep(0.1)
        assert "keep" not in [c.name async for c in view.listdir(view.root())]
        assert await view.lookup(view.root(), "keep") is None

    trio.run(main)
    view.store.close()


class _HeldPut:
    """A store mix-in whose first PUT of ``held`` stays in flight until the
    test lets it go (``go``), or until a later PUT of that key has landed,
    which it then lands after: the order two PUTs of one key in flight at
    once may take (S3, or a local store's two threads)."""

    held: str | None = None

    def hold(self, key: str) -> None:
        self.held, self._holding = key, False
        self.in_flight, self.go = threading.Event(), threading.Event()
        self._lock = threading.Lock()

    def put(self, key, data, **kwargs):
        with self._lock if self.held is not None else contextlib.nullcontext():
            mine = key == self.held and not self._holding
            overtakes = key == self.held and self._holding
            if mine:
                self._holding = True
        if mine:
            self.in_flight.set()
            self.go.wait(30)
            try:
                return super().put(key, data, **kwargs)
            finally:
                self.held = None
        try:
            return super().put(key, data, **kwargs)
        finally:
            if overtakes:
                self.go.set()


class _HeldLocal(_HeldPut, LocalBackend):
    pass


@pytest.fixture(params=["local", "s3"])
def held_store(request, tmp_path):
    """(backend, seed): a store of ``_HeldPut``, local or S3 (moto);
    ``seed(local_dir)`` puts a local tree's files into it."""
    root = tmp_path / "store"
    root.mkdir()
    if request.param == "local":
        yield _HeldLocal(str(root)), lambda tree: shutil.copytree(tree, root, dirs_exist_ok=True)
        return
    from zshardfs.backends.s3 import S3Backend

    class _HeldS3(_HeldPut, S3Backend):
        pass

    endpoint, bucket = request.getfixturevalue("s3_bucket")
    backend = _HeldS3(bucket, "p", endpoint_url=endpoint, connect_timeout=1, read_timeout=10, max_attempts=2)

    def seed(tree):
        for path in sorted(tree.rglob("*")):
            if path.is_file():
                backend.put(path.relative_to(tree).as_posix(), path.read_bytes())

    yield backend, seed
    backend.close()


async def _until(predicate, timeout: float = 10.0) -> None:
    """Wait until ``predicate()`` holds (a state other tasks reach)."""
    with trio.fail_after(timeout):
        while not predicate():
            await trio.sleep(0.005)


def test_a_rename_over_a_file_whose_close_stores_it_lands_last(held_store, tmp_path):
    """``mv new existing`` while ``existing``'s close is storing it (its PUT
    out): the rename's PUT waits for that one, so ``existing`` ends with
    the renamed bytes, in storage and in the view.  Before, both PUTs were
    out at once and the older could land last: the renamed file was lost
    (``new`` removed, ``existing`` holding the bytes it was replaced over)."""
    backend, seed = held_store
    tree = tmp_path / "tree"
    tree.mkdir()
    (tree / "existing.txt").write_bytes(b"old")
    (tree / "new.txt").write_bytes(b"renamed")
    seed(tree)
    view = build_view(MountConfig(source="held", mountpoint=str(tmp_path / "mnt"), read_only=False), backend)

    async def main():
        root = await view.resolve("")
        h = await view.open(await view.resolve("existing.txt"), write=True, truncate=True)
        await view.write(h, 0, b"written before the rename")
        closing = view.buffers["existing.txt"]
        backend.hold("existing.txt")
        renamed = trio.Event()

        async def close():
            await view.flush(h)
            await view.release(h)

        async def rename():
            await view.rename(root, "new.txt", root, "existing.txt")
            renamed.set()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(close)
            await trio.to_thread.run_sync(backend.in_flight.wait)
            nursery.start_soon(rename)
            # the rename waits for the close's PUT (or, not waiting, sends
            # its own, which the held one then lands after)
            await _until(lambda: renamed.is_set() or closing.storing.statistics().tasks_waiting)
            backend.go.set()
        assert not await view.sync()
        check = build_view(MountConfig(source="held", mountpoint=str(tmp_path / "mnt2")), backend)
        assert await check.lookup(await check.resolve(""), "new.txt") is None
        node = await check.resolve("existing.txt")
        assert await check.read(node, 0, 100) == b"renamed"
        node = await view.resolve("existing.txt")
        assert await view.read(node, 0, 100) == b"renamed"

    trio.run(main)


def test_a_rename_onto_a_chunk_whose_shard_is_being_flushed_lands_last(held_store, tmp_path):
    """A chunk (or a temporary in its directory) renamed over a chunk whose
    shard's flush is out (its PUT in flight), then stored: the renamed bytes
    win.  Safe by design, with no wait in the rename: the rename lands in
    the shard's dirty set with a newer version than the flush wrote, which
    therefore keeps it dirty; the next flush of the shard waits for the
    shard's lock, held by the one out; and shard PUTs are conditional on
    the version they merged onto."""
    backend, seed = held_store
    tree = tmp_path / "tree"
    _small_array(tree)
    seed(tree)
    view = build_view(MountConfig(source="held", mountpoint=str(tmp_path / "mnt"), read_only=False), backend)
    key = "arr/c/0/0"

    async def main(source):
        d = await view.resolve("arr/c/0")
        h = await view.open(await view.resolve(key), write=True, truncate=True)
        await view.write(h, 0, b"BBBB")
        await view.release(h)
        if source == "tmp":
            t = await view.create(d, "tmp")
            await view.write(t, 0, b"\x09" * 4)
            await view.flush(t)
            await view.release(t)
        backend.hold(key)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(view.writeback.flush, key)
            await trio.to_thread.run_sync(backend.in_flight.wait)
            await view.rename(d, "1" if source == "chunk" else "tmp", d, "0")
            nursery.start_soon(view.writeback.flush, key)
            await _until(lambda: backend.go.is_set() or view.writeback.dirty[key].lock.statistics().tasks_waiting)
            backend.go.set()
        assert not await view.sync()
        check = build_view(MountConfig(source="held", mountpoint=str(tmp_path / "mnt2")), backend)
        cd = await check.resolve("arr/c/0")
        assert sorted([c.name async for c in check.listdir(cd)]) == ["0"]  # (1: renamed, in the first run)
        assert await check.content(await check.resolve("arr/c/0/0")) == (b"\x02" if source == "chunk" else b"\x09") * 4

    trio.run(main, "chunk")
    trio.run(main, "tmp")


def test_directories_made_on_s3_are_remembered_within_a_bound_once_storage_holds_them(tmp_path):
    """(S3) Directories made through the mount where no one lists their
    parent: those a file was stored below exist in storage, and past
    NEW_DIRS_MAX the oldest are forgotten (storage answers for them); an
    empty one exists only in memory and stays.  Every one stays a directory
    to lookups and listings.  Before, every mkdir stayed for the life of
    the mount: 200 made, 200 entries."""
    root = tmp_path / "store"
    root.mkdir()
    view = build_view(MountConfig(source=str(root), mountpoint=str(root) + "-mnt", read_only=False,
                                  metadata_ttl=0), S3LikeStore(str(root)))
    view.NEW_DIRS_MAX = 50

    async def main():
        runs = await view.mkdir(view.root(), "runs")
        for i in range(200):
            d = await view.mkdir(runs, f"r{i}")
            h = await view.create(d, "log.txt")
            await view.write(h, 0, b"run %d" % i)
            await view.flush(h)  # (stored at close: storage now holds r<i>)
            await view.release(h)
        for i in range(20):
            await view.mkdir(runs, f"empty{i}")
        held = view.table_sizes()["new_dirs"]
        assert held <= 50 + 20, held
        for i in range(20):
            assert "empty%d" % i in view.new_dirs["runs"]  # (only memory holds them)
        for i in range(200):
            node = await view.resolve(f"runs/r{i}")
            assert node is not None and node.is_dir, i
            assert await view.read(await view.resolve(f"runs/r{i}/log.txt"), 0, 100) == b"run %d" % i
        for i in range(20):
            node = await view.resolve(f"runs/empty{i}")
            assert node is not None and node.is_dir, i
        names = sorted([c.name async for c in view.listdir(runs)])
        assert names == sorted([f"r{i}" for i in range(200)] + [f"empty{i}" for i in range(20)])

    trio.run(main)


def test_writers_of_a_chunk_a_failed_rename_would_have_replaced_write_on_to_it(tmp_path):
    """A chunk open for writing, another renamed onto it, and the rename
    fails after the target was opened anew (its write refused for want of
    room: a flush's error, as a real full disk gives it once the room
    waited for at the start is taken by other writers meanwhile): the
    rename changes nothing, so the open chunk is still the one at the name,
    with its bytes, and what is written through it afterwards lands there.
    Before, the writers stayed on the detached copy (their later writes were
    lost) and the name kept what the failed rename's create emptied it to.
    (In-process: no mount can time the refusal between the two.)"""
    _small_array(tmp_path)
    view, _ = _view(tmp_path)

    async def main():
        d = await view.resolve("arr/c/0")
        w = await view.open(await view.resolve("arr/c/0/1"), write=True, truncate=False)
        await view.write(w, 0, b"WW")
        real, calls = view.writeback.wait_for_room, []

        async def refused_the_second_time():
            calls.append(None)
            if len(calls) == 2:  # (the first: the rename's own, before it changes anything)
                raise Unavailable("no room (the test's)", "arr/c/0/1")
            await real()

        view.writeback.wait_for_room = refused_the_second_time
        with pytest.raises(Unavailable):
            await view.rename(d, "0", d, "1")
        assert len(calls) == 2
        view.writeback.wait_for_room = real
        await view.write(w, 3, b"X")
        await view.release(w)
        assert await view.content(await view.resolve("arr/c/0/1")) == b"WW\x02X"
        assert await view.content(await view.resolve("arr/c/0/0")) == b"\x01" * 4
        assert not await view.sync()
        check, _ = _view(tmp_path)
        assert await check.content(await check.resolve("arr/c/0/1")) == b"WW\x02X"
        assert await check.content(await check.resolve("arr/c/0/0")) == b"\x01" * 4

    trio.run(main)


def _volume_info(size: int, pad: int = 0) -> bytes:
    """A precomputed volume's ``info``: one sharded scale ``s0``."""
    sharding = {"@type": "neuroglancer_uint64_sharded_v1", "preshift_bits": 0, "hash": "identity",
                "minishard_bits": 0, "shard_bits": 0, "minishard_index_encoding": "raw", "data_encoding": "raw"}
    return json.dumps({"@type": "neuroglancer_multiscale_volume", "type": "image", "data_type": "uint8",
                       "num_channels": 1, "pad": "x" * pad,
                       "scales": [{"key": "s0", "size": [size] * 3, "resolution": [1, 1, 1],
                                   "voxel_offset": [0, 0, 0], "chunk_sizes": [[32, 32, 32]], "encoding": "raw",
                                   "sharding": sharding}]}).encode()


def test_a_failed_lookup_in_a_volume_directory_parses_its_info_once_per_version(tmp_path, monkeypatch):
    """(S3) A lookup of a name a volume directory lacks asks whether its
    ``info`` names it (a sharded scale whose last shard is gone): that
    document is parsed once per version, not again for every such lookup
    (a shell's or a tool's probes of missing names cost about 10 ms per MiB
    of info each, on the loop).  A changed ``info`` is parsed anew."""
    from zshardfs.layouts import precomputed

    root = tmp_path / "store"
    (root / "vol").mkdir(parents=True)
    (root / "vol" / "info").write_bytes(_volume_info(64))
    view = build_view(MountConfig(source=str(root), mountpoint=str(root) + "-mnt", read_only=False,
                                  metadata_ttl=0), S3LikeStore(str(root)))
    parses = []
    real = precomputed.dataset_dirs
    monkeypatch.setattr(precomputed, "dataset_dirs", lambda *a: parses.append(a[0]) or real(*a))

    async def main():
        vol = await view.resolve("vol")
        assert (await view.lookup(vol, "s0")).is_dir  # (named by the info: no shard stored)
        for name in ("missing", "nope", ".hidden", "s1"):
            assert await view.lookup(vol, name) is None
        assert parses == ["vol/info"]
        (root / "vol" / "info").write_bytes(_volume_info(128, pad=100))  # another client
        assert await view.lookup(vol, "missing") is None
        assert await view.lookup(vol, "nope") is None
        assert parses == ["vol/info"] * 2

    trio.run(main)


def test_directories_made_here_and_listed_since_leave_the_bounded_memory_of_them(tmp_path):
    """Directories made through the mount that storage holds are remembered
    up to NEW_DIRS_MAX (the oldest forgotten first); one listed since
    (storage shows it now) is forgotten at once, and leaves that count.
    Before, a listed one went on counting until it was the oldest, so
    directories made earlier and never listed were forgotten first: here
    those of ``a``, with only half the bound in use."""
    view, _ = _view(tmp_path)
    view.NEW_DIRS_MAX = 50

    async def main():
        root = await view.resolve("")
        for parent in ("a", "b", "c"):
            d = await view.mkdir(root, parent)
            for i in range(20):
                await view.mkdir(d, f"{parent}{i}")
            if parent == "b":
                assert len([c async for c in view.listdir(d)]) == 20  # (storage shows them: forgotten)
        assert sorted(view.new_dirs["a"]) == sorted(f"a{i}" for i in range(20))
        assert sorted(view.new_dirs["c"]) == sorted(f"c{i}" for i in range(20))
        assert "b" not in view.new_dirs and len(view._new_dirs_stored) == 43  # (a, b, c and their 40)

    trio.run(main)


def _one_shard_array(root, fill: int) -> None:
    """arr: 4x4 uint8, one shard, inner chunks 2x2; chunk i holds 4 bytes
    of ``fill + i``."""
    from tests.handmade_zarr import array_doc, write_array_doc, write_shard

    write_array_doc(root / "arr", array_doc((4, 4), (4, 4), (2, 2)))
    write_shard(root / "arr", (0, 0), (2, 2), {i: bytes([fill + i]) * 4 for i in range(4)})


def _replace_shard(root, fill: int) -> None:
    """Another client replaces the shard (by rename: a new version) with
    chunks of the same sizes and other bytes."""
    from tests.handmade_zarr import shard_bytes

    shard = root / "arr" / "c" / "0" / "0"
    tmp = shard.with_name("new")
    tmp.write_bytes(shard_bytes((2, 2), {i: bytes([fill + i]) * 4 for i in range(4)}))
    os.replace(tmp, shard)


def test_reads_of_one_open_in_flight_together_across_a_replacement_give_one_version(tmp_path):
    """A chunk file read in pieces gives the version of its open's first
    piece (Handle.seen, SEMANTICS 2.2), also when the kernel sends two READs
    of one open at once (read-ahead, threads sharing a descriptor) and
    another client replaces the shard between their fetches: the piece whose
    fetch ends last is cut from the version the other one fixed.  Before,
    each READ that began before the first had ended returned what its own
    fetch found: the first half of one version and the second of the
    other."""
    _one_shard_array(tmp_path, 1)
    view = build_view(MountConfig(source=str(tmp_path), mountpoint=str(tmp_path) + "-mnt", read_only=True,
                                  index_ttl=0), LocalBackend(str(tmp_path)))
    got = {}

    async def main():
        node = await view.resolve("arr/c/0/0")
        handle = view.open_reader(node)
        read = node.dataset.read
        gates = [trio.Event(), trio.Event()]
        calls = []

        async def gated(target):  # (each fetch waits for its gate: the overlap every time)
            gate = gates[len(calls)]
            calls.append(target)
            await gate.wait()
            return await read(target)

        node.dataset.read = gated

        async def piece(offset):
            got[offset] = await view.read(handle, offset, 2)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(piece, 0)
            await trio.testing.wait_all_tasks_blocked()
            nursery.start_soon(piece, 2)
            await trio.testing.wait_all_tasks_blocked()
            assert len(calls) == 2
            gates[0].set()
            while 0 not in got:
                await trio.sleep(0.01)
            _replace_shard(tmp_path, 9)
            gates[1].set()
        del node.dataset.read
        assert got[0] + got[2] == bytes([1]) * 4  # (before: b"\x01\x01\x09\x09")
        assert await view.read(view.open_reader(await view.resolve("arr/c/0/0")), 0, 4) == bytes([9]) * 4

    trio.run(main)


def test_a_whole_chunk_read_again_after_a_page_drop_takes_one_crc32c_and_a_replacement_is_still_eio(
        tmp_path, monkeypatch):
    """A chunk file an open handed to the kernel whole (open_fill) is read
    again by a READ only when the kernel dropped its pages; that READ's bytes
    are checked against the ones handed over (a CRC32C: one version per
    open, SEMANTICS 2.2).  When that one READ gives the whole file back, the
    handler then took a second CRC32C of the very same bytes to remember
    them: now the one checked is kept.  A shard another client replaced
    meanwhile is still EIO for that open, and a new open reads the new
    version."""
    import crc32c
    import pyfuse3

    from zshardfs.fuse_ops import Operations

    monkeypatch.setattr(pyfuse3, "notify_store", lambda *args: None)
    monkeypatch.setattr(pyfuse3, "invalidate_inode", lambda *args, **kwargs: None)
    crcs = []
    real_crc = crc32c.crc32c
    monkeypatch.setattr(crc32c, "crc32c", lambda data, *rest: crcs.append(len(data)) or real_crc(data, *rest))
    _one_shard_array(tmp_path, 1)
    view = build_view(MountConfig(source=str(tmp_path), mountpoint=str(tmp_path) + "-mnt", read_only=True,
                                  index_ttl=0.05), LocalBackend(str(tmp_path)))
    ops = Operations(view, read_only=True, open_fill=1 << 20)

    async def main():
        ino = pyfuse3.ROOT_INODE
        for name in ("arr", "c", "0", "0"):
            ino = (await ops.lookup(ino, name.encode())).st_ino
        fh = (await ops.open(ino, os.O_RDONLY, None)).fh  # (fills the page cache)
        assert ops.open_fills == 1
        del crcs[:]
        assert await ops.read(fh, 0, 4096) == bytes([1]) * 4  # (its pages dropped: the kernel asks)
        assert crcs == [4]  # (before: [4, 4])
        await trio.sleep(0.1)  # (past index_ttl)
        _replace_shard(tmp_path, 9)
        with pytest.raises(pyfuse3.FUSEError) as err:
            await ops.read(fh, 0, 4096)
        assert err.value.errno == errno.EIO
        await ops.release(fh)
        fh = (await ops.open(ino, os.O_RDONLY, None)).fh
        assert await ops.read(fh, 0, 4096) == bytes([9]) * 4
        await ops.release(fh)

    trio.run(main)


def test_chunks_handed_whole_to_the_kernel_are_not_kept_on_a_local_store(tmp_path, monkeypatch):
    """An open that hands a chunk file's bytes to the kernel (open_fill) put
    the chunk in the chunk cache too, evicted first (SEMANTICS 2.4: on S3 a
    second scan after the kernel dropped the pages then costs no GET per
    chunk).  On a local store that copy saves nothing (fetching the chunk
    again is a read of the shard's page cache) and cost the most: each chunk
    a fresh mount read took new memory until the cache was full, about 8
    page faults per 32 KiB chunk, some 20 us of the daemon's CPU per random
    chunk read (docs/PERFORMANCE.md).  Now a local store's chunk cache lets
    go of a chunk handed over whole, and a READ after the kernel dropped its
    pages reads it again from the shard, the same bytes."""
    import pyfuse3

    from zshardfs.fuse_ops import Operations
    from zshardfs.shards import CHUNK_ENTRY_OVERHEAD

    stored = {}
    monkeypatch.setattr(pyfuse3, "notify_store", lambda inode, off, data: stored.__setitem__(inode, bytes(data)))
    _one_shard_array(tmp_path, 1)
    # (read-ahead off: a scan's fetch of the rest of the shard caches the
    # chunks it brings, which stay until read; nothing else is kept)
    view = build_view(MountConfig(source=str(tmp_path), mountpoint=str(tmp_path) + "-mnt", read_only=True,
                                  prefetch="off"), LocalBackend(str(tmp_path)))
    ops = Operations(view, read_only=True, open_fill=1 << 20)

    async def main():
        arr = (await ops.lookup(pyfuse3.ROOT_INODE, b"arr")).st_ino
        c = (await ops.lookup(arr, b"c")).st_ino
        inodes = []
        for i in (b"0", b"1"):
            row = (await ops.lookup(c, i)).st_ino
            inodes += [(await ops.lookup(row, j)).st_ino for j in (b"0", b"1")]
        for n, ino in enumerate(inodes):
            fh = (await ops.open(ino, os.O_RDONLY, None)).fh
            assert stored[ino] == bytes([1 + n]) * 4
            chunks = view.shards.chunks
            assert [k for k in chunks._d if chunks.peek(k) is not None] == [], n  # (before: n + 1 kept)
            assert chunks.bytes == (n + 1) * CHUNK_ENTRY_OVERHEAD  # (keys only: read-ahead fetches them no more)
            await ops.release(fh)
        assert ops.open_fills == 4
        fh = (await ops.open(inodes[2], os.O_RDONLY, None)).fh  # (filled: no fill this time)
        assert await ops.read(fh, 0, 4096) == bytes([3]) * 4  # (its pages dropped: the kernel asks)
        await ops.release(fh)

    trio.run(main)
    assert not view.shards.keep_handed_over


def test_a_listing_begun_before_a_writers_close_gives_the_size_it_wrote(tmp_path, monkeypatch):
    """A writer's close (RELEASE) marks its inode's node stale, its size the one before
    the writes (the next getattr asks the view), and a lookup or listing begun before the
    close keeps that node as newer news. The listing handed the kernel that old size
    (readdirplus: the kernel takes it, as the WRITEs ended before the READDIR was sent),
    so a stat after ``close`` returned showed it: difftest --race 12, basic/local seed
    7010, a scan watcher saw 200 bytes, then 1 (the size before a truncate's pwrite).
    The kernel's RELEASE comes after close(2) has returned. Now the stale node's size is
    asked of the view, as getattr does."""
    import pyfuse3

    from zshardfs.fuse_ops import Operations

    (tmp_path / "plain").mkdir()
    (tmp_path / "plain" / "a.bin").write_bytes(b"x" * 64)
    view, store = _view(tmp_path)
    ops = Operations(view, read_only=False)
    replies = []
    monkeypatch.setattr(pyfuse3, "readdir_reply", lambda token, name, attrs, off: replies.append((name, attrs)) or True)
    monkeypatch.setattr(pyfuse3, "invalidate_inode", lambda *args, **kwargs: None)
    listed, go = trio.Event(), trio.Event()
    real_list = view.store.list

    async def slow_list(*args, **kwargs):
        out = await real_list(*args, **kwargs)
        listed.set()
        await go.wait()
        return out
    monkeypatch.setattr(view.store, "list", slow_list)

    async def main():
        plain = (await ops.lookup(pyfuse3.ROOT_INODE, b"plain")).st_ino
        ino = (await ops.lookup(plain, b"a.bin")).st_ino
        fields = types.SimpleNamespace(**{f"update_{k}": k == "size" for k in
                                          ("size", "mode", "uid", "gid", "atime", "mtime", "ctime")})
        attr = pyfuse3.EntryAttributes()
        attr.st_size = 1
        assert (await ops.setattr(ino, attr, fields, None, None)).st_size == 1  # truncate -s 1
        fh = (await ops.open(ino, os.O_WRONLY, None)).fh
        assert await ops.write(fh, 100, b"y" * 100) == 100
        await ops.flush(fh)  # (close(2) returns after FLUSH; RELEASE follows on its own)
        assert (await ops.getattr(ino)).st_size == 200
        dh = await ops.opendir(plain, None)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(ops.readdir, dh, 0, None)  # the watcher's listing, begun before the RELEASE
            await listed.wait()
            await ops.release(fh)
            go.set()
        await ops.releasedir(dh)
        got = {name: attrs.st_size for name, attrs in replies if name == b"a.bin"}
        assert got == {b"a.bin": 200}, got  # (before: 1, the size before the write)
        assert (await ops.getattr(ino)).st_size == 200
        # a lookup alike (the kernel looks a name up again once its entry expired)
        assert (await ops.setattr(ino, attr, fields, None, None)).st_size == 1
        fh = (await ops.open(ino, os.O_WRONLY, None)).fh
        assert await ops.write(fh, 100, b"z" * 100) == 100
        await ops.flush(fh)
        found, go2 = trio.Event(), trio.Event()
        real_lookup = view.lookup

        async def slow_lookup(*args, **kwargs):
            out = await real_lookup(*args, **kwargs)
            found.set()
            await go2.wait()
            return out
        monkeypatch.setattr(view, "lookup", slow_lookup)
        looked = []

        async def lookup():
            looked.append(await ops.lookup(plain, b"a.bin"))
        async with trio.open_nursery() as nursery:
            nursery.start_soon(lookup)
            await found.wait()
            await ops.release(fh)
            go2.set()
        assert looked[0].st_ino == ino and looked[0].st_size == 200, looked[0].st_size  # (before: 1)

    trio.run(main)
    assert (tmp_path / "plain" / "a.bin").stat().st_size == 200


def test_a_reader_waiting_for_read_ahead_while_its_index_is_evicted_reads_its_chunk(tmp_path):
    """A scan's reader waits (at most its patience) for the chunk read-ahead
    is fetching; if that does not come, it read the chunk itself unless the
    shard's index was no longer the cached one, taken for "the shard was
    replaced": it loaded the index again and retried, and after three tries
    failed with "shard keeps changing while being read" (EIO).  An index
    evicted for room (``index_cache``, here 1K: three of these indexes fit,
    and other readers cycle through four other shards) is no replacement:
    the reader reads its chunk itself, pinned to the version it has (a
    replaced shard fails that read, and the reader then loads the index)."""
    from tests.handmade_zarr import array_doc, write_array_doc, write_shard
    from tests.test_request_deadline import Gated
    from zshardfs.backends.base import AsyncStore
    from zshardfs.shards import ShardCache

    arr = tmp_path / "arr"
    write_array_doc(arr, array_doc([80], [16], [4]))
    for s in range(5):
        write_shard(arr, (s,), (4,), {c: bytes([s, c]) * 2 for c in range(4)})
    backend = Gated(str(tmp_path))
    view = build_view(MountConfig(source=str(tmp_path), mountpoint=str(tmp_path) + "-mnt"), backend)
    store = AsyncStore(backend, timeout=4.0)

    async def main():
        targets = [(await view.resolve(f"arr/c/{4 * s}")).target for s in range(5)]
        fmt = (await view.resolve("arr/c/0")).dataset.shard_format
        cache = ShardCache(store, index_cache_bytes=1024, prefetch=True)
        cache._patience = 0.3  # (three waits end well before read-ahead gives its GET up: 2 s)
        key, ctx = targets[0].shard_key, targets[0].shard_ctx
        done = False

        async def evict():  # other readers: the indexes of four other shards, in turn
            while not done:
                for t in targets[1:]:
                    await cache.index(fmt, t.shard_key, t.shard_ctx)
                await trio.sleep(0.01)

        async with trio.open_nursery() as nursery:
            cache.start(nursery)
            with store.request_deadline():
                assert await cache.read_chunk(fmt, key, 0, ctx) == bytes([0, 0]) * 2
            backend.hold("get", key)  # read-ahead's GET (the next read continues a scan) gets no answer
            nursery.start_soon(evict)
            try:
                with store.request_deadline():
                    assert await cache.read_chunk(fmt, key, 1, ctx) == bytes([0, 1]) * 2
                assert cache.indexes.evicted > 0 and cache.prefetches == 1
            finally:
                done = True
                backend.go.set()
                cache.start(None)

    trio.run(main)
