"""Every wait inside one kernel request ends at the request's deadline.

``-o timeout`` is the deadline of one kernel request (SEMANTICS 5.5): its
storage calls share it (test_backends.py, test_s3_mount.py).  These tests
cover the waits between the calls: a request that waits for work another
request (or ``zshardfs sync``) began, which may end after this request's
deadline, and a flush's pause after a lost race.  Each drives the view or
the caches in-process (``daemon.build_view``: the stack a mount uses) over
a local store whose calls are held or slowed, and emulates the kernel
request with ``AsyncStore.request_deadline`` (what ``fuse_ops._translate``
sets).
"""

from __future__ import annotations

import threading

import pytest
import trio

from zshardfs.backends.base import AsyncStore, PreconditionFailed, StoreError, Unavailable
from zshardfs.backends.local import LocalBackend
from zshardfs.config import MountConfig
from zshardfs.daemon import build_view
from zshardfs.shards import ShardCache

#: seconds a request may end after its deadline (trio's scheduling, a
#: loaded CI machine); the waits fixed here overshot it by 0.5 s or more
SLACK = 0.25


def _small_array(root) -> None:
    """arr: 8x8 uint8, shards of 4x4, inner chunks 2x2; shard (0, 0) holds
    its 4 chunks, chunk i filled with bytes i + 1."""
    from tests.handmade_zarr import array_doc, write_array_doc, write_shard

    write_array_doc(root / "arr", array_doc((8, 8), (4, 4), (2, 2)))
    write_shard(root / "arr", (0, 0), (2, 2), {i: bytes([i + 1]) * 4 for i in range(4)})


def _skeletons(root, items: dict[int, bytes]) -> None:
    """A precomputed skeleton directory: one shard of one minishard."""
    import json

    from zshardfs.layouts.precomputed_format import ShardingSpec, encode_shard

    sharding = {"@type": "neuroglancer_uint64_sharded_v1", "preshift_bits": 0, "hash": "identity",
                "minishard_bits": 0, "shard_bits": 0}
    root.mkdir()
    (root / "info").write_text(json.dumps({"@type": "neuroglancer_skeletons", "sharding": sharding}))
    spec = ShardingSpec.from_json(sharding)
    (root / spec.shard_key(0)).write_bytes(encode_shard(items, spec))


class Gated(LocalBackend):
    """A local store whose first call of one kind on one key after
    ``hold(op, key)`` waits for ``go``; ``in_flight`` is set once it waits.
    A call the deadline gives up goes on in its thread: ``go`` ends it."""

    get_nowait = None  # (every read in a worker thread, where it can be held)

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.held: tuple[str, str] | None = None
        self.in_flight = threading.Event()
        self.go = threading.Event()

    async def in_flight_now(self) -> None:
        """Wait until the held call is out."""
        assert await trio.to_thread.run_sync(self.in_flight.wait, 10), self.held

    def hold(self, op: str, key: str) -> None:
        self.held = (op, key)
        self.in_flight.clear()
        self.go.clear()

    def _gate(self, op: str, key: str) -> None:
        if self.held == (op, key) and not self.in_flight.is_set():  # (the first such call only)
            self.in_flight.set()
            self.go.wait(30)

    def get(self, key, *args, **kwargs):
        self._gate("get", key)
        return super().get(key, *args, **kwargs)

    def list(self, prefix, *args, **kwargs):
        self._gate("list", prefix)
        return super().list(prefix, *args, **kwargs)

    def put(self, key, *args, **kwargs):
        self._gate("put", key)
        return super().put(key, *args, **kwargs)


def _gated_view(root, timeout: float) -> tuple[Gated, object]:
    """A writable view (the stack a mount uses) of ``root`` over a ``Gated``
    local store, with ``timeout`` as the deadline of one request."""
    backend = Gated(str(root))
    return backend, build_view(MountConfig(source=str(root), mountpoint=str(root) + "-mnt", read_only=False,
                                           timeout=timeout), backend)


async def _until(predicate, timeout: float = 10.0) -> None:
    """Wait until ``predicate()`` holds (a state other tasks reach)."""
    with trio.fail_after(timeout):
        while not predicate():
            await trio.sleep(0.005)


async def _request(store: AsyncStore, fn, *args):
    """``fn(*args)`` as a kernel request: (seconds it took, its result or
    the StoreError it ended with)."""
    started = trio.current_time()
    with store.request_deadline():
        try:
            out = await fn(*args)
        except StoreError as exc:
            out = exc
    return trio.current_time() - started, out


async def _f_stored_then_written(view, root):
    """A handle on a new ``f.txt`` whose ``written`` is stored and whose
    ``WRITTEN`` is not yet."""
    h = await view.create(root, "f.txt")
    await view.write(h, 0, b"written")
    await view.fsync(h)
    await view.write(h, 0, b"WRITTEN")
    return h


async def _behind_a_later_request(view, backend, timeout: float, request, later) -> None:
    """``request`` waits for a held PUT (``backend.hold``) that ``later``,
    a request begun ``timeout / 2`` after it (so its deadline is later),
    is making: ``request`` ends at its own deadline (Unavailable, EIO),
    ``later`` once the PUT is let go, without an error."""
    results = {}
    began = trio.Event()

    async def waiting():
        with view.store.request_deadline():
            began.set()
            await backend.in_flight_now()  # the later request's PUT is out
            results["waiter"] = await _request(view.store, *request)

    async def begin_later():
        await began.wait()
        await trio.sleep(timeout / 2)  # (begins later: its deadline is later)
        results["later"] = await _request(view.store, *later)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(waiting)
        nursery.start_soon(begin_later)
        await _until(lambda: "waiter" in results)
        backend.go.set()
    took, out = results["waiter"]
    assert isinstance(out, Unavailable) and "deadline" in str(out), out
    assert took < timeout / 2 + SLACK, took
    assert results["later"][1] is None, results["later"]


def test_a_flush_that_lost_a_race_does_not_pause_past_the_deadline(tmp_path, monkeypatch):
    """An fsync whose shard PUT lost a race to another writer pauses before
    merging again (a random backoff of up to 1 s): a pause that would end
    past the request's deadline fails the fsync with EIO at once.  Before,
    the pause was not cut: the fsync slept it out and failed after its
    deadline.  The chunk stays in memory; a later flush stores it."""
    _small_array(tmp_path)
    timeout = 0.5
    lost = []

    class LosesOneRace(LocalBackend):
        def put(self, key, data, **kwargs):
            if key == "arr/c/0/0" and not lost:
                lost.append(key)
                raise PreconditionFailed(f"{key}: replaced meanwhile", key)
            return super().put(key, data, **kwargs)

    backend = LosesOneRace(str(tmp_path))
    view = build_view(MountConfig(source=str(tmp_path), mountpoint=str(tmp_path) + "-mnt", read_only=False,
                                  timeout=timeout), backend)
    monkeypatch.setattr("zshardfs.writeback._backoff", lambda attempt: 2 * timeout)

    async def main():
        h = await view.open(await view.resolve("arr/c/0/1"), write=True, truncate=False)
        await view.write(h, 0, b"NEW!")
        took, out = await _request(view.store, view.fsync, h)
        assert lost and isinstance(out, Unavailable), out
        assert took < timeout + SLACK, took
        assert (await view.read(h, 0, 4)) == b"NEW!"
        await view.fsync(h)  # (no race now: stored)
        await view.release(h)
        check = build_view(MountConfig(source=str(tmp_path), mountpoint=str(tmp_path) + "-mnt2"),
                           LocalBackend(str(tmp_path)))
        for rel, want in (("0/0", b"\x01" * 4), ("0/1", b"NEW!"), ("1/0", b"\x03" * 4), ("1/1", b"\x04" * 4)):
            assert await check.content(await check.resolve(f"arr/c/{rel}")) == want, rel

    trio.run(main)


@pytest.mark.parametrize("what", ["listing", "shard index", "chunk", "room for an index", "minishard index"])
def test_a_request_sharing_a_later_requests_load_ends_at_its_own_deadline(tmp_path, what):
    """A request that needs what another request is loading (a listing, a
    shard's index, a chunk, a precomputed minishard's index) shares that
    load; one that loads an index while other loads hold the room that
    indexes being loaded may take waits for them.  That request may have
    begun later, so its load may end after
    this request's deadline: the wait for it ends there (EIO).  Before,
    the request waited for the whole load (0.5 of the deadline too long
    here).  The load itself goes on and is kept: a later request finds it."""
    _small_array(tmp_path)
    from tests.handmade_zarr import write_shard

    write_shard(tmp_path / "arr", (0, 1), (2, 2), {i: bytes([i + 5]) * 4 for i in range(4)})
    if what == "minishard index":
        _skeletons(tmp_path / "skel", {2: b"x" * 10, 5: b"y" * 10})
    timeout = 1.0
    backend = Gated(str(tmp_path))
    store = AsyncStore(backend, timeout=timeout, list_ttl=60)
    view = build_view(MountConfig(source=str(tmp_path), mountpoint=str(tmp_path) + "-mnt"), backend)
    key, other = "arr/c/0/0", "arr/c/0/1"

    async def main():
        nonlocal key
        node, node2 = await view.resolve("arr/c/0/1"), await view.resolve("arr/c/0/2")
        fmt, ctx, cid = node.dataset.shard_format, node.target.shard_ctx, node.target.chunk_id
        # (room for one index load at a time)
        cache = ShardCache(store, index_cache_bytes=fmt.index_size(ctx) + 1 if what == "room for an index" else 1 << 20)
        assert node2.target.shard_key == other
        if what == "minishard index":
            skeletons = await view.dataset_at("skel")  # (its minishard indexes not read yet)
            fmt, target = skeletons.shard_format, skeletons.target(("2",))
            key, ctx, cid = target.shard_key, target.shard_ctx, target.chunk_id
            await cache.index(fmt, key, ctx)  # (the shard's index is cached: its minishard's is shared)

        async def load(whose):
            if what == "listing":
                return [f.key for f in (await store.list("arr")).files]
            if what == "shard index":
                return (await cache.index(fmt, key, ctx)).info.size
            if what == "room for an index":
                shard, c = (key, ctx) if whose == "second" else (other, node2.target.shard_ctx)
                return (await cache.index(fmt, shard, c)).info.size
            if what == "minishard index":
                return await (await cache.index(fmt, key, ctx)).locate(cid)
            return await cache.read_chunk(fmt, key, cid, ctx)

        if what == "chunk":
            await cache.index(fmt, key, ctx)  # (the index is cached: the chunk's GET is shared)
        backend.hold("list" if what == "listing" else "get", "arr" if what == "listing" else key)
        first_began = trio.Event()
        results = {}

        async def first():
            with store.request_deadline():
                first_began.set()
                await backend.in_flight_now()  # the second's load is out
                results["first"] = await _request(store, load, "first")

        async def second():
            await first_began.wait()
            await trio.sleep(timeout / 2)  # (begins later: its deadline is later)
            results["second"] = await _request(store, load, "second")

        async with trio.open_nursery() as nursery:
            nursery.start_soon(first)
            nursery.start_soon(second)
            await _until(lambda: "first" in results)
            backend.go.set()  # (the second's load is answered, after the first's deadline)
        took, out = results["first"]
        assert isinstance(out, Unavailable) and "deadline" in str(out), out
        assert took < timeout / 2 + SLACK, took  # (what was left of its deadline)
        assert not isinstance(results["second"][1], Exception), results["second"]
        backend.held = None
        for whose in ("second", "first"):  # (both work now)
            _, out = await _request(store, load, whose)
            assert not isinstance(out, Exception), out
        if what != "room for an index":
            assert out == results["second"][1]

    trio.run(main)


@pytest.mark.parametrize("waiter", ["unlink", "rename", "fsync", "link"])
def test_a_request_waiting_for_the_store_of_a_plain_file_ends_at_its_deadline(tmp_path, waiter):
    """An unlink of a file, a rename onto it (of a file or a symbolic link),
    and an fsync through another handle on it, while a close stores it,
    wait for that store (so that
    PUTs and deletes land in order).  That close may have begun after the
    waiting request, and its store end after this request's deadline: the
    wait ends there (EIO), and changes nothing (the file, its handles).
    Before, each waited for the whole store.  Once the store ends, the same
    request works."""
    timeout = 1.0
    backend, view = _gated_view(tmp_path, timeout)
    (tmp_path / "other.txt").write_bytes(b"other")
    (tmp_path / "link").symlink_to("other.txt")

    async def main():
        root = await view.resolve("")
        h = await _f_stored_then_written(view, root)
        reader = await view.open(await view.resolve("f.txt"), write=False, truncate=False)
        backend.hold("put", "f.txt")
        request = {"unlink": (view.unlink, root, "f.txt"),
                   "rename": (view.rename, root, "other.txt", root, "f.txt"),
                   "fsync": (view.fsync, reader),
                   "link": (view.rename, root, "link", root, "f.txt")}[waiter]
        await _behind_a_later_request(view, backend, timeout, request, (view.flush, h))  # (the close's PUT)
        assert (tmp_path / "f.txt").read_bytes() == b"WRITTEN"
        # nothing changed: the file and its handles are as they were
        await view.write(h, 7, b"!")
        await view.flush(h)
        assert (tmp_path / "f.txt").read_bytes() == b"WRITTEN!"
        assert await view.read(await view.resolve("other.txt"), 0, 100) == b"other"
        _, out = await _request(view.store, *request)  # (works now)
        assert out is None, out
        await view.release(h)
        await view.release(reader)
        assert not await view.sync()
        names = sorted(p.name for p in tmp_path.iterdir())
        if waiter == "unlink":
            assert names == ["link", "other.txt"]
        elif waiter == "link":
            assert names == ["f.txt", "other.txt"] and (tmp_path / "f.txt").is_symlink()
        elif waiter == "rename":
            assert names == ["f.txt", "link"] and (tmp_path / "f.txt").read_bytes() == b"other"
        else:
            assert names == ["f.txt", "link", "other.txt"] and (tmp_path / "f.txt").read_bytes() == b"WRITTEN!"

    trio.run(main)


def test_a_rename_whose_wait_for_a_store_of_its_target_ends_at_the_deadline_keeps_the_target_s_writers(tmp_path):
    """``mv other f`` while a handle writes ``f``, and a sync begins storing
    ``f`` while the rename makes its new file (after the wait for stores
    of ``f`` before it): the rename waits for that store, and ends at its
    deadline (EIO) having changed nothing.  Before, the handle's writes had
    already been detached onto the old file when that wait came: the
    failed rename put ``f``'s buffer back but not its writer, whose later
    writes then went to a copy no one stores (``f`` stayed ``WRITTEN``)."""
    timeout = 1.0
    backend, view = _gated_view(tmp_path, timeout)
    (tmp_path / "other.txt").write_bytes(b"other")

    async def main():
        root = await view.resolve("")
        h = await _f_stored_then_written(view, root)
        synced, begin = {}, trio.Event()
        create = view.create

        async def create_as_a_sync_begins(parent, name, **kwargs):
            if name == "f.txt" and not begin.is_set():
                # a sync (a request of its own) begins storing f.txt now, its PUT held
                backend.hold("put", "f.txt")
                begin.set()
                await backend.in_flight_now()
            return await create(parent, name, **kwargs)

        async def sync():
            await begin.wait()
            synced["errors"] = await view.sync()

        view.create = create_as_a_sync_begins
        async with trio.open_nursery() as nursery:
            nursery.start_soon(sync)
            took, out = await _request(view.store, view.rename, root, "other.txt", root, "f.txt")
            backend.go.set()
        view.create = create
        assert isinstance(out, Unavailable) and "deadline" in str(out), out
        assert took < timeout + SLACK, took
        # (the sync's PUT, held to the rename's deadline, may have been given up at its own)
        assert all(isinstance(e, Unavailable) for e in synced["errors"]), synced
        # nothing changed: the file and its writer are as they were
        await view.write(h, 7, b"!")
        await view.flush(h)
        assert (tmp_path / "f.txt").read_bytes() == b"WRITTEN!"
        assert await view.read(await view.resolve("f.txt"), 0, 100) == b"WRITTEN!"
        assert await view.read(await view.resolve("other.txt"), 0, 100) == b"other"
        _, out = await _request(view.store, view.rename, root, "other.txt", root, "f.txt")  # (works now)
        assert out is None, out
        await view.write(h, 0, b"lost with the old file")
        await view.release(h)
        assert not await view.sync()
        assert sorted(p.name for p in tmp_path.iterdir()) == ["f.txt"]
        assert (tmp_path / "f.txt").read_bytes() == b"other"

    trio.run(main)


@pytest.mark.parametrize("waiter", ["write", "close", "fsync", "truncate", "rename"])
def test_a_request_waiting_for_a_rename_of_its_file_ends_at_its_deadline(tmp_path, waiter):
    """A write, a close, an fsync or a truncate through a handle on a file
    another request is renaming, and a second rename of it, wait until the
    rename has moved the file (else a write would land under the old name).
    The rename may have begun after the waiting request, and end after its
    deadline: the wait ends there (EIO), having changed nothing.  Before,
    each waited for the whole rename.  The rename lands whole, and the
    same request works afterwards, on the new name."""
    timeout = 1.0
    backend, view = _gated_view(tmp_path, timeout)
    (tmp_path / "f.txt").write_bytes(b"0123456789")

    async def main():
        root = await view.resolve("")
        h = await view.open(await view.resolve("f.txt"), write=True, truncate=False)
        await view.write(h, 0, b"AAAA")
        backend.hold("put", "g.txt")  # (the rename's store of its new name)
        request = {"write": (view.write, h, 4, b"ZZ"), "close": (view.flush, h), "fsync": (view.fsync, h),
                   "truncate": (view.truncate, h.node, 12, h),
                   "rename": (view.rename, root, "f.txt", root, "h.txt")}[waiter]
        await _behind_a_later_request(view, backend, timeout, request, (view.rename, root, "f.txt", root, "g.txt"))
        assert sorted(p.name for p in tmp_path.iterdir()) == ["g.txt"]
        assert (tmp_path / "g.txt").read_bytes() == b"AAAA456789"
        if waiter == "rename":
            request = (view.rename, root, "g.txt", root, "h.txt")
        _, out = await _request(view.store, *request)  # (works now, on the new name)
        assert not isinstance(out, Exception), out
        await view.write(h, 4, b"ZZ")
        await view.release(h)
        assert not await view.sync()
        names = sorted(p.name for p in tmp_path.iterdir())
        assert names == (["h.txt"] if waiter == "rename" else ["g.txt"]), names
        assert (tmp_path / names[0]).read_bytes() == b"AAAAZZ6789" + b"\0\0" * (waiter == "truncate")

    trio.run(main)


@pytest.mark.parametrize("on_the_loop", [True, False])
def test_a_pinned_read_after_the_requests_deadline_is_not_asked_on_the_loop_either(tmp_path, on_the_loop):
    """A read pinned to a version (``if_match``: a chunk's fetch from its
    shard) that a request makes after its deadline is "not asked" (EIO),
    whether it would be answered on the event loop (a descriptor kept open,
    its pages cached: ``get_nowait``) or in a worker thread, as every other
    call is.  Before, the loop's answer came anyway, past the deadline."""
    (tmp_path / "shard").write_bytes(bytes(range(256)) * 16)
    backend = LocalBackend(str(tmp_path))
    if not on_the_loop:
        backend.get_nowait = None
    threaded = []
    get = backend.get
    backend.get = lambda *args, **kwargs: threaded.append(args) or get(*args, **kwargs)
    store = AsyncStore(backend, max_connections=4, timeout=0.05)

    async def main():
        first = await store.get("shard", 0, 4096)  # (keeps its descriptor, reads its pages)
        etag, before = first.info.etag, len(threaded)
        with store.request_deadline():  # in time: answered (on the loop, if it can)
            assert (await store.get("shard", 16, 16, if_match=etag)).data == bytes(range(16, 32))
        assert len(threaded) == before + (0 if on_the_loop else 1)
        errors = backend.counters["errors"]
        with store.request_deadline():
            await trio.sleep(0.1)
            with pytest.raises(Unavailable, match="not asked"):
                await store.get("shard", 16, 16, if_match=etag)
        assert backend.counters["errors"] == errors + 1
        assert len(threaded) == before + (0 if on_the_loop else 1)  # (not asked in a thread either)

    trio.run(main)
