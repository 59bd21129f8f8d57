"""One conformance suite for every storage backend, plus S3-only failure tests.

The same tests run against a local directory and against S3 (moto's
stand-alone server over HTTP), through the sync API and through
:class:`AsyncStore` on trio.  The S3 failure tests pause or kill the real
server process, so "unreachable" and "hung" mean what they mean in
production: refused connections and silent sockets.
"""

from __future__ import annotations

import errno
import os
import shutil
import socket
import stat
import threading
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable

import botocore.exceptions as bce
import pytest
import trio

from tests.s3server import DUMMY_ACCESS_KEY, DUMMY_SECRET_KEY, MotoServer, free_port
from zshardfs.backends.base import (
    AccessDenied,
    AsyncStore,
    Listing,
    NotFound,
    PreconditionFailed,
    StoreError,
    Unavailable,
    no_request_deadline,
)
from zshardfs.backends.local import LocalBackend
from tests.util import store_with_links_out, wait_for
from zshardfs.backends.s3 import S3Backend, S3URLError, parse_s3_url

DATA = bytes(range(256)) * 4  # 1024 bytes, every offset distinguishable
PREFIX = "store/root"


@dataclass
class Store:
    kind: str
    backend: object
    seed: Callable[[dict[str, bytes]], None]  # write objects behind the backend's back


def s3_backend(endpoint: str, bucket: str, prefix: str = PREFIX, **kw) -> S3Backend:
    """Short timeouts so failure tests finish quickly."""
    opts = dict(connect_timeout=1, read_timeout=5, max_attempts=2)
    opts.update(kw)
    return S3Backend(bucket, prefix, endpoint_url=endpoint, **opts)


@pytest.fixture(params=["local", "s3"])
def store(request, tmp_path):
    if request.param == "local":
        root = tmp_path / "store"
        root.mkdir()

        def seed(items):
            for key, data in items.items():
                path = root / key
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_bytes(data)

        yield Store("local", LocalBackend(str(root)), seed)
    else:
        server = request.getfixturevalue("moto_server")
        endpoint, bucket = request.getfixturevalue("s3_bucket")
        backend = s3_backend(endpoint, bucket)

        def seed(items):
            server.put_many(bucket, {f"{PREFIX}/{k}": v for k, v in items.items()})

        yield Store("s3", backend, seed)
        backend.close()


@pytest.fixture
def s3(moto_server, s3_bucket):
    """(server, bucket, backend) for S3-only tests."""
    endpoint, bucket = s3_bucket
    backend = s3_backend(endpoint, bucket)
    yield moto_server, bucket, backend
    backend.close()


def assert_clean_message(exc: BaseException) -> None:
    """One sentence for a human; no credential anywhere in the report."""
    msg = str(exc)
    assert msg and "\n" not in msg and msg.endswith("."), msg
    assert ". " not in msg.rstrip("."), f"more than one sentence: {msg}"
    report = "".join(traceback.format_exception(exc))
    for secret in (DUMMY_SECRET_KEY, DUMMY_ACCESS_KEY):
        assert secret not in report


# ---------------------------------------------------------------------------
# conformance: reads


def test_get_whole_range_suffix_past_end(store):
    b = store.backend
    put = b.put("a/obj", DATA)
    assert put.size == len(DATA) and put.etag

    def check(blob, data):
        assert blob.data == data
        assert blob.info.size == len(DATA)  # total size, also for ranges
        assert blob.info.etag == put.etag
        assert blob.info.key == "a/obj"
        assert blob.info.mtime_ns > 0

    check(b.get("a/obj"), DATA)
    check(b.get("a/obj", 10, 20), DATA[10:30])
    check(b.get("a/obj", 1000), DATA[1000:])
    check(b.get("a/obj", 1000, 100), DATA[1000:])  # short read at the end only
    check(b.get("a/obj", 1024, 10), b"")
    check(b.get("a/obj", 5000), b"")  # past the end: empty, size still known
    check(b.get("a/obj", 3, 0), b"")
    check(b.get("a/obj", suffix=16), DATA[-16:])
    check(b.get("a/obj", suffix=5000), DATA)
    check(b.get("a/obj", suffix=0), b"")


def test_get_empty_object(store):
    b = store.backend
    b.put("empty", b"")
    for blob in (b.get("empty"), b.get("empty", 0, 10), b.get("empty", 5), b.get("empty", suffix=4)):
        assert blob.data == b""
        assert blob.info.size == 0


def test_get_if_match(store):
    b = store.backend
    v1 = b.put("k", DATA)
    assert b.get("k", if_match=v1.etag).data == DATA
    assert b.get("k", 4, 4, if_match=v1.etag).data == DATA[4:8]
    assert b.get("k", suffix=4, if_match=v1.etag).data == DATA[-4:]
    v2 = b.put("k", DATA[::-1])
    assert v2.etag != v1.etag
    for call in (lambda: b.get("k", if_match=v1.etag), lambda: b.get("k", 4, 4, if_match=v1.etag),
                 lambda: b.get("k", 5000, if_match=v1.etag)):
        with pytest.raises(PreconditionFailed) as info:
            call()
        assert info.value.errno == errno.EAGAIN
    assert b.counters["precondition_failed"] == 3


def test_missing_key(store):
    b = store.backend
    for call in (lambda: b.get("nope"), lambda: b.get("nope", 0, 10), lambda: b.get("nope", suffix=3),
                 lambda: b.get("nope", 10, 0), lambda: b.get("no/such/dir/key")):
        with pytest.raises(NotFound) as info:
            call()
        assert info.value.errno == errno.ENOENT
    assert b.stat("nope") is None
    b.delete("nope")  # absent is fine without a condition


def test_stat(store):
    b = store.backend
    put = b.put("d/e/f", b"xyz")
    info = b.stat("d/e/f")
    assert (info.key, info.size, info.etag) == ("d/e/f", 3, put.etag)
    assert abs(info.mtime_ns / 1e9 - time.time()) < 300
    assert b.stat("d/e") is None  # a "directory" is not an object
    assert b.stat("d/e/f/g") is None
    assert b.stat("missing") is None


def test_listing_and_stat_agree_on_mtime(store):
    """The mtime of a listing's entry (S3: ISO 8601 in the XML) is the one
    stat gives (S3: the RFC 1123 Last-Modified header), and it is now."""
    b = store.backend
    b.put("t/one", b"1")
    listed = b.list("t").files[0]
    assert listed.mtime_ns == b.stat("t/one").mtime_ns
    assert abs(listed.mtime_ns / 1e9 - time.time()) < 300


@pytest.mark.parametrize("value", [
    "2026-11-22T22:00:00.000Z", "2026-11-22T22:00:00Z", "2026-11-22T22:00:00.123456+01:00",
    "Sun, 22 Nov 2026 22:00:00 GMT", "1700000000", "1700000000.5",
])
def test_s3_timestamps_parse_as_botocore_does(value):
    import botocore.utils

    from zshardfs.backends.s3 import parse_timestamp

    assert parse_timestamp(value) == botocore.utils.parse_timestamp(value)
    with pytest.raises(ValueError):
        parse_timestamp("not a time")


@pytest.mark.parametrize("value", [
    "Tue, 24 Nov 2026 05:14:52 GMT", "Thu, 26 Nov 2026 05:14:52 GMT", "Sun, 22 Nov 2026 22:00:00 GMT",
    "2026-11-22T22:00:00.000Z",
])
def test_s3_timestamps_of_every_weekday_parse_without_botocore(value, monkeypatch):
    """Every GET and HEAD answer has a Last-Modified header; botocore's
    (dateutil) parser costs about 0.3 ms of CPU each.  A "T" in the value
    was taken for ISO 8601, and every header has one ("GMT"): each failed
    fromisoformat, then went to botocore's parser."""
    import botocore.utils

    from zshardfs.backends.s3 import parse_timestamp

    expected = botocore.utils.parse_timestamp(value)

    def slow(v):
        raise AssertionError(f"botocore's parser asked for {v!r}")

    monkeypatch.setattr(botocore.utils, "parse_timestamp", slow)
    assert parse_timestamp(value) == expected


def test_s3_user_agent_is_not_assembled_per_request(s3, monkeypatch):
    """botocore builds its User-Agent from a dozen sanitised components,
    twice for every request (about 0.2 ms of CPU); the backend's is fixed."""
    import botocore.useragent

    from zshardfs import __version__

    server, bucket, b = s3
    server.put_many(bucket, {f"{PREFIX}/k": b"data"})
    sent = []
    b.client.meta.events.register("before-send.s3", lambda request, **kw: sent.append(request.headers["User-Agent"]))

    def assembled(self):
        raise AssertionError("User-Agent assembled from its components")

    monkeypatch.setattr(botocore.useragent.UserAgentString, "_build_sdk_metadata", assembled)
    assert b.get("k").data == b"data"
    assert b.stat("k").size == 4
    assert sent and all(ua.startswith(f"zshardfs/{__version__} ".encode()) for ua in sent), sent


def test_is_dir(store):
    b = store.backend
    b.put("a/b/c", b"1")
    assert b.is_dir("")
    assert b.is_dir("a")
    assert b.is_dir("a/b")
    assert not b.is_dir("a/b/c")
    assert not b.is_dir("a/x")
    assert not b.is_dir("ab")


def test_list_nested(store):
    b = store.backend
    store.seed({"top": b"1", "a/x": b"22", "a/b/c": b"333", "a/b/d": b"4444", "z/q": b""})
    root = b.list("")
    assert root.dirs == ["a", "z"]
    assert [f.key for f in root.files] == ["top"]
    a = b.list("a")
    assert a.dirs == ["b"]
    assert [(f.key, f.size) for f in a.files] == [("a/x", 2)]
    ab = b.list("a/b")
    assert ab.dirs == []
    assert [(f.key, f.size) for f in ab.files] == [("a/b/c", 3), ("a/b/d", 4)]
    assert ab.files[0].etag == b.stat("a/b/c").etag
    assert b.list("nope").dirs == [] and b.list("nope").files == []
    assert b.list("a/b/c").files == []  # a file is not a directory


def test_list_many(store):
    """More than one S3 page (1000 entries) of files and sub-directories."""
    b = store.backend
    items = {f"many/f{i:05d}": b"x" for i in range(1010)}
    items.update({f"many/d{i:02d}/inner": b"y" for i in range(20)})
    store.seed(items)
    before = b.counters["list"]
    listing = b.list("many")
    assert listing.dirs == [f"d{i:02d}" for i in range(20)]
    assert [f.key for f in listing.files] == [f"many/f{i:05d}" for i in range(1010)]
    if store.kind == "s3":
        assert b.counters["list"] - before == 2  # one count per page


def test_a_directory_found_is_listed_and_answers_lookups_below(store):
    """With listings kept (``metadata_ttl``), the request that finds a
    directory (S3: a LIST) keeps its listing when one page holds it: the
    listing, and the lookups below it (stat, is_dir), then cost nothing.  A
    directory of more than one page is only found.  Re-validation (stat
    without ``listed_ok``) always asks."""
    b = store.backend
    items = {"d/x": b"1", "d/sub/y": b"22"}
    items.update({f"big/f{i:04d}": b"z" for i in range(1001)})
    store.seed(items)
    astore = AsyncStore(b, timeout=30, list_ttl=60)

    def requests():
        return sum(b.counters[k] for k in ("list", "head", "get", "get_range"))

    async def main():
        assert await astore.is_dir("d")
        after_found = requests()
        listing = await astore.list("d")
        assert listing.dirs == ["sub"] and [f.key for f in listing.files] == ["d/x"]
        assert (await astore.stat("d/x", listed_ok=True)).size == 1
        assert await astore.stat("d/nope", listed_ok=True) is None
        assert await astore.is_dir("d/sub") and not await astore.is_dir("d/x")
        if store.kind == "s3":
            assert requests() == after_found, "the listing of a directory just found was asked again"
        assert (await astore.stat("d/x")).size == 1  # asks
        if store.kind == "s3":
            assert requests() == after_found + 1
            lists = b.counters["list"]
            assert await astore.is_dir("big")
            await astore.list("big")  # two pages: the one that found it was not kept
            assert b.counters["list"] - lists == 3

    trio.run(main)


# ---------------------------------------------------------------------------
# conformance: writes


def test_put_conditional(store):
    b = store.backend
    v1 = b.put("s/shard", b"one", if_none_match=True)
    with pytest.raises(PreconditionFailed):
        b.put("s/shard", b"two", if_none_match=True)
    assert b.get("s/shard").data == b"one"
    v2 = b.put("s/shard", b"two", if_match=v1.etag)
    assert v2.etag != v1.etag and v2.size == 3
    with pytest.raises(PreconditionFailed):
        b.put("s/shard", b"three", if_match=v1.etag)  # stale version
    assert b.get("s/shard").data == b"two"
    with pytest.raises(PreconditionFailed):
        b.put("s/missing", b"x", if_match=v2.etag)  # pinned object gone
    assert b.stat("s/missing") is None
    v3 = b.put("s/shard", b"three")  # unconditional replace
    assert b.get("s/shard", if_match=v3.etag).data == b"three"
    assert b.stat("s/shard").etag == v3.etag
    assert b.counters["precondition_failed"] == 3


def test_delete(store):
    b = store.backend
    v1 = b.put("d/x", b"1")
    b.put("d/keep", b"2")
    v2 = b.put("d/x", b"11")
    with pytest.raises(PreconditionFailed):
        b.delete("d/x", if_match=v1.etag)
    assert b.get("d/x").data == b"11"
    b.delete("d/x", if_match=v2.etag)
    assert b.stat("d/x") is None
    with pytest.raises(PreconditionFailed):
        b.delete("d/x", if_match=v2.etag)  # already gone
    b.delete("d/keep")
    assert b.stat("d/keep") is None
    # a directory left empty stays (it may be a user's), unless asked to go
    # (a dataset's shard directories: the write-back deletes shards with
    # prune_below=the dataset's directory, which stays, as do those above)
    assert b.list("").dirs == (["d"] if store.kind == "local" else [])
    b.put("g/e/f/x", b"1")
    b.delete("g/e/f/x", prune_below="g")
    assert not b.is_dir("g/e/f") and not b.is_dir("g/e")
    assert b.list("").dirs == (["d", "g"] if store.kind == "local" else [])


def test_counters(store):
    b = store.backend
    b.put("c/k", DATA[:100])
    b.get("c/k")
    b.get("c/k", 10, 10)
    b.get("c/k", suffix=5)
    b.stat("c/k")
    b.list("c")
    c = b.counters
    assert c["put"] == 1 and c["bytes_written"] == 100
    assert c["get"] == 1 and c["get_range"] == 2
    assert c["bytes_read"] == 100 + 10 + 5
    assert c["head"] == 1 and c["list"] == 1
    assert c["errors"] == c["retries"] == c["precondition_failed"] == 0
    # Neither a lost race nor a missing key is an error.  (Whether a failed
    # request also counts as "put"/"get" is backend-specific: S3 counts
    # requests sent, the local backend operations completed.)
    with pytest.raises(PreconditionFailed):
        b.put("c/k", b"x", if_match="bogus")
    with pytest.raises(NotFound):
        b.get("c/nope")
    assert b.stat("c/nope") is None
    assert c["precondition_failed"] == 1 and c["errors"] == 0
    assert c["bytes_written"] == 100 and c["bytes_read"] == 115


# ---------------------------------------------------------------------------
# local only: durability of directory changes


def fsynced_dirs(monkeypatch) -> list[str]:
    """Record the path of every directory ``os.fsync`` is called on."""
    seen: list[str] = []
    real = os.fsync

    def fsync(fd):
        if stat.S_ISDIR(os.fstat(fd).st_mode):
            seen.append(os.readlink(f"/proc/self/fd/{fd}"))
        return real(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    return seen


def test_local_directory_changes_are_fsynced(tmp_path, monkeypatch):
    """A shard that put reported stored survives a power loss with the
    directories put made for it: each new directory is fsynced into its
    parent (from the deepest existing one down), and only those.  An unlink,
    and the pruning of directories it emptied, fsync the directory still
    there that changed; so do make_dir and remove_dir."""
    root = tmp_path / "store"
    root.mkdir()
    b = LocalBackend(str(root))
    seen = fsynced_dirs(monkeypatch)

    def dirs_synced() -> set[str]:
        got = {os.path.relpath(p, root) for p in seen}
        seen.clear()
        return got

    b.put("arr/c/7/3", b"shard", if_none_match=True)
    assert dirs_synced() == {".", "arr", "arr/c", "arr/c/7"}
    b.put("arr/c/7/4", b"shard")  # an existing directory: nothing above it again
    assert dirs_synced() == {"arr/c/7"}
    b.put("arr/c/8/0", b"shard")
    assert dirs_synced() == {"arr/c", "arr/c/8"}

    b.delete("arr/c/7/3", if_match=b.stat("arr/c/7/3").etag)
    assert dirs_synced() == {"arr/c/7"}
    b.delete("arr/c/7/4", prune_below="arr")  # c/7 goes: c changed, c/7 is gone
    assert not (root / "arr/c/7").exists() and (root / "arr/c").is_dir()
    assert dirs_synced() == {"arr/c"}
    b.delete("arr/c/8/0", prune_below="arr")  # c/8 and c go: arr changed
    assert not (root / "arr/c").exists()
    assert dirs_synced() == {"arr"}
    b.delete("arr/c/8/0", prune_below="arr")  # nothing there: nothing changed
    assert dirs_synced() == set()

    b.make_dir("u/v")
    assert dirs_synced() == {".", "u"}
    b.remove_dir("u/v")
    assert dirs_synced() == {"u"}
    b.close()


def test_local_put_survives_the_pruning_of_the_directory_it_is_making_below(tmp_path, monkeypatch):
    """A put making directories below an existing one that a concurrent
    delete prunes meanwhile (the write-back flushes shards in parallel: the
    delete of a dataset's last shard prunes ``arr/c`` once empty, while the
    put of a new shard is about to make ``arr/c/1`` in it) makes the path
    anew and stores the shard.  It failed with "arr/c/1/0/0: not found"
    (mkdir in the removed directory: ENOENT), so ``zshardfs sync`` failed
    (difftest --seed 13010 --layout rectangular_3d --dirmv 15 --race 6)."""
    root = tmp_path / "store"
    root.mkdir()
    b = LocalBackend(str(root))
    b.put("arr/c/0/0/0", b"last shard")
    real_open = b._open
    pruned = []

    def open_then_pruned(key, flags, mode=0):
        fd = real_open(key, flags, mode)
        if key == "arr/c" and not pruned:  # the put holds arr/c: the delete prunes it now
            pruned.append(key)
            b.delete("arr/c/0/0/0", prune_below="arr")
            assert not (root / "arr/c").exists()
        return fd

    monkeypatch.setattr(b, "_open", open_then_pruned)
    b.put("arr/c/1/0/0", b"new shard", if_none_match=True)
    assert pruned == ["arr/c"]
    assert (root / "arr/c/1/0/0").read_bytes() == b"new shard"
    assert b.get("arr/c/1/0/0").data == b"new shard"
    b.close()


def test_local_directories_made_by_a_put_still_in_progress_are_fsynced_again(tmp_path, monkeypatch):
    """Two puts into one new directory (a flush stores 8 shards at once): the
    second finds the directories made but must not report its shard stored
    before they are durable, so it fsyncs their parents itself rather than
    trust the first put, which may not have got there yet."""
    root = tmp_path / "store"
    root.mkdir()
    b = LocalBackend(str(root))
    seen = fsynced_dirs(monkeypatch)
    main = threading.get_ident()
    made, go_on = threading.Event(), threading.Event()
    fsync = os.fsync

    def stalls_first_put(fd):
        if threading.get_ident() != main:  # the put in the pool
            made.set()
            assert go_on.wait(10)  # the first put stalls in its first fsync
        return fsync(fd)

    monkeypatch.setattr(os, "fsync", stalls_first_put)
    with ThreadPoolExecutor(1) as pool:
        stalled = pool.submit(b.put, "arr/c/0/0", b"shard")
        assert made.wait(10)
        other = len(seen)
        b.put("arr/c/0/1", b"shard")
        mine = {os.path.relpath(p, root) for p in seen[other:]}
        go_on.set()
        stalled.result()
    assert {".", "arr", "arr/c", "arr/c/0"} <= mine, mine
    assert (root / "arr/c/0/0").read_bytes() == (root / "arr/c/0/1").read_bytes() == b"shard"
    b.close()


# ---------------------------------------------------------------------------
# conformance: AsyncStore on trio


def test_async_store(store):
    astore = AsyncStore(store.backend, max_connections=4, timeout=30)

    async def main():
        v1 = await astore.put("x/shard", DATA)
        results = {}

        async def read(i):
            results[i] = (await astore.get("x/shard", i * 100, 100, if_match=v1.etag)).data

        async with trio.open_nursery() as nursery:
            for i in range(10):
                nursery.start_soon(read, i)
        assert b"".join(results[i] for i in range(10)) == DATA[:1000]
        assert (await astore.get("x/shard", suffix=24)).data == DATA[-24:]
        assert (await astore.stat("x/shard")).etag == v1.etag
        assert await astore.is_dir("x")
        assert [f.key for f in (await astore.list("x")).files] == ["x/shard"]
        with pytest.raises(PreconditionFailed):
            await astore.put("x/shard", b"new", if_match="bogus")
        await astore.delete("x/shard", if_match=v1.etag)
        assert await astore.get_or_none("x/shard") is None
        assert await astore.stat("x/shard") is None

    trio.run(main)
    assert astore.counters is store.backend.counters


def test_async_store_timeout(store, monkeypatch):
    """A call that does not finish in time is EIO, and the loop is free."""
    b = store.backend
    b.put("slow", b"1")

    def slow_get(*args, **kwargs):
        time.sleep(6)
        return None

    monkeypatch.setattr(b, "get", slow_get)
    astore = AsyncStore(b, timeout=1.0)  # (room for a loaded machine's stat below)

    async def main():
        t0 = trio.current_time()
        with pytest.raises(Unavailable) as info:
            await astore.get("slow")
        assert trio.current_time() - t0 < 4.0
        assert info.value.errno == errno.EIO
        assert (await astore.stat("slow")).size == 1  # other calls still work

    trio.run(main)
    assert b.counters["errors"] == 1


def test_async_store_fails_fast_after_no_answer(store, monkeypatch):
    """After a call got no answer, the same call fails at once for a moment
    (the kernel repeats a failed page read many times); an unreachable
    endpoint reported for another key does not reset that, an answer does."""
    b = store.backend
    b.put("k", b"1")
    calls = []

    def unreachable(key, *args, **kwargs):
        calls.append(key)
        raise Unavailable("no route")

    monkeypatch.setattr(b, "get", unreachable)
    astore = AsyncStore(b, timeout=5)

    async def main():
        for key in ("a", "b", "a", "b"):
            with pytest.raises(Unavailable):
                await astore.get(key)
        assert calls == ["a", "b"]  # the repeats were answered from memory
        monkeypatch.undo()
        assert (await astore.stat("k")).size == 1  # an answer: the endpoint is back...
        with pytest.raises(NotFound):  # ...so "a" is asked again (and is missing)
            await astore.get("a")

    trio.run(main)


def test_speculative_calls_leave_no_fail_fast_mark(store, monkeypatch):
    """Read-ahead's GETs are speculative: one that gets no answer neither
    makes the reader's GET of the same shard fail at once, nor is refused
    itself because of an earlier failure."""
    b = store.backend
    calls = []

    def unreachable(key, *args, **kwargs):
        calls.append(key)
        raise Unavailable("503 after retries")

    monkeypatch.setattr(b, "get", unreachable)
    astore = AsyncStore(b, timeout=5)

    async def main():
        with pytest.raises(Unavailable):
            await astore.get("s", 0, 10, speculative=True)
        with pytest.raises(Unavailable):
            await astore.get("s", 0, 10)  # asked: the speculative failure left no mark
        with pytest.raises(Unavailable):
            await astore.get("s", 0, 10, speculative=True)  # asked despite the reader's mark
        with pytest.raises(Unavailable):
            await astore.get("s", 0, 10)  # the reader's own mark: answered from memory
        assert calls == ["s", "s", "s"]

    trio.run(main)


# ---------------------------------------------------------------------------
# S3 only: layout, requests on the wire


def test_parse_s3_url():
    assert parse_s3_url("s3://bucket") == ("bucket", "")
    assert parse_s3_url("s3://bucket/") == ("bucket", "")
    assert parse_s3_url("s3://bucket/a/b/") == ("bucket", "a/b")
    # S3 keys are opaque: the prefix is kept exactly, as the AWS CLI reads
    # it; only the one '/' before the objects' names is dropped
    assert parse_s3_url("s3://bucket/a//b") == ("bucket", "a//b")
    assert parse_s3_url("s3://bucket/a//b/") == ("bucket", "a//b")
    assert parse_s3_url("s3://bucket//a//b") == ("bucket", "/a//b")
    assert parse_s3_url("s3://bucket/a//") == ("bucket", "a/")
    assert parse_s3_url("s3://bucket/a/./b") == ("bucket", "a/./b")
    for bad in ("s3://", "http://bucket/a", "bucket/a", "s3://bucket/a?x=1", "s3://key:secret@bucket/a",
                "s3://bucket//"):
        with pytest.raises(ValueError):
            parse_s3_url(bad)
        with pytest.raises(S3URLError):
            parse_s3_url(bad)


def test_s3_key_layout(moto_server, s3_bucket):
    endpoint, bucket = s3_bucket
    raw = moto_server.s3

    def raw_keys():
        return sorted(o["Key"] for o in raw.list_objects_v2(Bucket=bucket).get("Contents", []))

    b = s3_backend(endpoint, bucket, prefix="deep/prefix")
    assert b.url == f"s3://{bucket}/deep/prefix"
    b.put("a/b", b"1")
    assert raw_keys() == ["deep/prefix/a/b"]
    root = s3_backend(endpoint, bucket, prefix="")
    assert root.url == f"s3://{bucket}"
    root.put("top", b"2")
    assert raw_keys() == ["deep/prefix/a/b", "top"]
    assert root.list("").dirs == ["deep"]
    assert [f.key for f in root.list("").files] == ["top"]
    assert [f.key for f in root.list("deep/prefix/a").files] == ["deep/prefix/a/b"]
    assert [f.key for f in b.list("a").files] == ["a/b"]
    # A "directory marker" object some tools write is a directory, not a file.
    raw.put_object(Bucket=bucket, Key="deep/prefix/m/", Body=b"")
    assert b.list("").dirs == ["a", "m"]
    assert b.list("m").files == []


def test_s3_prefix_is_kept_exactly(moto_server, s3_bucket):
    """``a//b``, ``a/b`` and ``/a/b`` are three different S3 prefixes: a
    mount of each shows its own objects only."""
    endpoint, bucket = s3_bucket
    moto_server.put_many(bucket, {"a//b/double": b"1", "a/b/single": b"2", "/a/b/leading": b"3",
                                  "a/double-slash-dir//x": b"4"})
    seen = {}
    for url in (f"s3://{bucket}/a//b", f"s3://{bucket}/a//b/", f"s3://{bucket}/a/b", f"s3://{bucket}//a/b",
                f"s3://{bucket}/a/double-slash-dir//"):
        name, prefix = parse_s3_url(url)
        b = s3_backend(endpoint, name, prefix=prefix)
        try:
            listing = b.list("")
            seen[url] = [f.key for f in listing.files]
            for key in seen[url]:
                assert b.get(key).data in (b"1", b"2", b"3", b"4")
        finally:
            b.close()
    assert seen == {
        f"s3://{bucket}/a//b": ["double"],
        f"s3://{bucket}/a//b/": ["double"],
        f"s3://{bucket}/a/b": ["single"],
        f"s3://{bucket}//a/b": ["leading"],
        f"s3://{bucket}/a/double-slash-dir//": ["x"],
    }


def test_check_invalid_region():
    """botocore's InvalidRegionError is a ValueError too: it must not be
    reported as a bad endpoint URL."""
    for endpoint in (None, "http://127.0.0.1:9"):
        b = S3Backend("bucket", "", endpoint_url=endpoint, region="eu west 1")
        with pytest.raises(StoreError) as info:
            b.check()
        assert "region 'eu west 1'" in str(info.value) and "endpoint" not in str(info.value)
        assert_clean_message(info.value)


def test_s3_one_request_per_call(s3):
    server, bucket, b = s3
    b.put("k", DATA)
    mark = server.mark()
    b.get("k", 100, 50)
    b.get("k")
    b.stat("k")
    b.list("")
    b.is_dir("x")
    b.delete("k")
    reqs = server.requests(since=mark)
    key_path = f"/{bucket}/{PREFIX}/k"
    assert [(r.method, r.route, r.status) for r in reqs] == [
        ("GET", key_path, 206), ("GET", key_path, 200), ("HEAD", key_path, 200),
        ("GET", f"/{bucket}", 200), ("GET", f"/{bucket}", 200), ("DELETE", key_path, 204),
    ]
    assert reqs[3].query["prefix"] == [f"{PREFIX}/"] and reqs[3].query["delimiter"] == ["/"]
    assert reqs[4].query["max-keys"] == ["1"]


def test_s3_body_read_is_retried(s3, monkeypatch):
    """botocore does not retry a body that breaks mid-stream; get() does."""
    server, bucket, b = s3
    b.put("k", DATA)
    real = b.client.get_object
    broken = []

    class BrokenBody:
        def read(self):
            raise bce.ResponseStreamingError(error="connection reset")

        def close(self):
            pass

    def flaky(**kwargs):
        resp = real(**kwargs)
        if not broken:
            broken.append(True)
            resp["Body"].close()
            resp["Body"] = BrokenBody()
        return resp

    monkeypatch.setattr(b.client, "get_object", flaky)
    assert b.get("k", 1, 10).data == DATA[1:11]
    assert b.counters["get_range"] == 2 and b.counters["retries"] == 1
    broken.clear()
    monkeypatch.setattr(b, "max_attempts", 1)
    with pytest.raises(Unavailable):
        b.get("k")


# ---------------------------------------------------------------------------
# S3 only: mount-time check()


def test_check_ok(s3):
    server, bucket, b = s3
    assert b.check() is False  # reachable, readable, empty
    b.put("x", b"1")
    assert b.check() is True


def test_check_missing_bucket(moto_server):
    b = s3_backend(moto_server.endpoint_url, "zs-no-such-bucket")
    with pytest.raises(NotFound) as info:
        b.check()
    assert "zs-no-such-bucket" in str(info.value)
    assert_clean_message(info.value)


def test_check_unreachable_endpoint_fails_fast():
    port = free_port()  # nothing listens there
    b = S3Backend("bucket", "p", endpoint_url=f"http://127.0.0.1:{port}",
                  connect_timeout=60, read_timeout=60, max_attempts=10)
    t0 = time.monotonic()
    with pytest.raises(Unavailable) as info:
        b.check()
    assert time.monotonic() - t0 < 5
    assert f"127.0.0.1:{port}" in str(info.value)
    assert_clean_message(info.value)


def test_check_silent_endpoint_fails_fast():
    """An endpoint that accepts connections but never answers."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen(16)
        port = sock.getsockname()[1]
        b = S3Backend("bucket", "", endpoint_url=f"http://127.0.0.1:{port}",
                      connect_timeout=60, read_timeout=60, max_attempts=10)
        t0 = time.monotonic()
        with pytest.raises(Unavailable) as info:
            b.check()
        assert time.monotonic() - t0 < 10
    assert "timed out" in str(info.value)
    assert_clean_message(info.value)


@pytest.mark.parametrize("url", ["not a url", "ftp://host", "http://", "http://host:port", "127.0.0.1:9000"])
def test_check_invalid_endpoint_url(url):
    b = S3Backend("bucket", "", endpoint_url=url)
    with pytest.raises(StoreError) as info:
        b.check()
    assert "endpoint URL" in str(info.value)
    assert_clean_message(info.value)
    with pytest.raises(StoreError):
        b.get("x")


@pytest.mark.parametrize("template", ["http://user:{secret}@127.0.0.1:{port}", "user:{secret}@127.0.0.1:{port}",
                                      "http://user:{secret}@127.0.0.1:bad"])
def test_check_endpoint_url_credentials_are_redacted(template):
    url = template.format(secret=DUMMY_SECRET_KEY, port=free_port())
    with pytest.raises(StoreError) as info:
        S3Backend("bucket", "", endpoint_url=url).check()
    assert_clean_message(info.value)


@pytest.fixture(scope="module")
def auth_server(tmp_path_factory, moto_server):
    """A second moto server that checks credentials (dummy keys are unknown)."""
    server = MotoServer(tmp_path_factory.mktemp("moto-auth") / "access.log",
                        env={"INITIAL_NO_AUTH_ACTION_COUNT": "0"})
    server.start()
    yield server
    server.stop()


def test_check_bad_credentials(auth_server):
    b = s3_backend(auth_server.endpoint_url, "some-bucket")
    with pytest.raises(AccessDenied) as info:
        b.check()
    assert "InvalidAccessKeyId" in str(info.value)
    assert_clean_message(info.value)
    with pytest.raises(AccessDenied) as info:
        b.get("x")
    assert info.value.errno == errno.EACCES
    assert DUMMY_SECRET_KEY not in str(info.value) and DUMMY_ACCESS_KEY not in str(info.value)


def test_check_no_credentials(moto_server, monkeypatch):
    monkeypatch.delenv("AWS_ACCESS_KEY_ID")
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    b = s3_backend(moto_server.endpoint_url, "some-bucket")
    t0 = time.monotonic()
    with pytest.raises(AccessDenied) as info:
        b.check()
    assert time.monotonic() - t0 < 5
    assert "credentials" in str(info.value)
    assert_clean_message(info.value)


def test_check_unknown_profile(moto_server):
    b = s3_backend(moto_server.endpoint_url, "some-bucket", profile="zs-no-such-profile")
    with pytest.raises(AccessDenied) as info:
        b.check()
    assert "zs-no-such-profile" in str(info.value)
    assert_clean_message(info.value)


# ---------------------------------------------------------------------------
# S3 only: a hung or dying server


def test_async_timeout_on_hung_server(s3):
    server, bucket, b = s3
    b.put("k", DATA)
    astore = AsyncStore(b, timeout=0.5)
    server.pause()
    try:
        async def main():
            t0 = trio.current_time()
            with pytest.raises(Unavailable):
                await astore.get("k")
            assert trio.current_time() - t0 < 2

        trio.run(main)
    finally:
        server.resume()
    assert b.get("k").data == DATA


def test_server_killed_during_call_then_restarted(s3):
    """A call in flight when the server dies fails promptly with Unavailable
    (after botocore's retries); once the server is back the same call works
    on the same backend (its pooled connections are dead and replaced)."""
    server, bucket, b = s3
    b = s3_backend(server.endpoint_url, bucket, connect_timeout=1, read_timeout=10, max_attempts=3)
    payload = os.urandom(1 << 20)
    b.put("shard", payload)
    b.get("shard", 0, 10)  # leave a pooled keep-alive connection
    state = server.snapshot([bucket])
    server.pause()  # the next request waits inside the server...
    try:
        with ThreadPoolExecutor(1) as pool:
            call = pool.submit(b.get, "shard", 4096, 65536)
            time.sleep(0.3)
            t0 = time.monotonic()
            server.kill()  # ...which dies under it
            with pytest.raises(Unavailable) as info:
                call.result(timeout=20)
            assert time.monotonic() - t0 < 5
        assert info.value.errno == errno.EIO
        assert b.counters["retries"] == 2  # all three attempts were made
        assert b.counters["errors"] == 1
        with pytest.raises(Unavailable):  # dead server: refused at once
            b.stat("shard")
    finally:
        server.start()
        server.restore(state)
    blob = b.get("shard", 4096, 65536)
    assert blob.data == payload[4096:4096 + 65536]
    assert blob.info.size == len(payload)
    b.close()


def test_outcomes_keep_each_error_itself_in_call_order():
    """zshardfs.together.outcomes: calls run at once (the slow first one does
    not hold up the others), results come back in call order, and a failure
    is the exception itself in its place, not an ExceptionGroup."""
    from zshardfs.backends.base import NotFound
    from zshardfs.together import first_error, outcomes

    finished = []

    async def slow():
        await trio.sleep(0.05)
        finished.append("slow")
        return 1

    async def fails():
        finished.append("fails")
        raise NotFound("gone", "k")

    async def fast():
        finished.append("fast")
        return 3

    async def main():
        return await outcomes(slow, fails, fast)

    results = trio.run(main)
    assert results[0] == 1 and isinstance(results[1], NotFound) and results[2] == 3
    assert finished[-1] == "slow"  # the others did not wait for it
    assert first_error(results) is results[1] and first_error([1, None]) is None


def test_a_write_given_up_before_it_began_never_blocks_its_key(tmp_path):
    """A write that reaches the deadline while it still waits for a worker
    (all of them stuck on a hung endpoint: the first call given up gives its
    slot back, the second, beyond ``max_connections`` such calls, keeps it)
    never asked anything: it cannot land later, so the next write of its key
    does not wait for it.  Before, it was remembered as "may still land" for
    good: every later write of the key waited the whole deadline and failed,
    until a remount."""
    gate = threading.Event()

    class Hung(LocalBackend):
        def put(self, key, *args, **kwargs):
            if key.startswith("hang"):
                gate.wait()
            return super().put(key, *args, **kwargs)

    store = AsyncStore(Hung(str(tmp_path)), max_connections=1, timeout=0.5)

    async def main():
        async with trio.open_nursery() as nursery:
            async def hang(key):
                with pytest.raises(Unavailable):
                    await store.put(key, b"x")

            nursery.start_soon(hang, "hang-1")  # given up at 0.5 s: its slot comes back
            await trio.sleep(0.2)
            nursery.start_soon(hang, "hang-2")  # runs from 0.5 s, given up at 0.7 s: keeps it
            await trio.sleep(0.05)
            with pytest.raises(Unavailable):
                await store.put("b", b"1")  # waits for the only worker, given up before it began
        gate.set()  # the endpoint answers again
        await trio.sleep(store.FAIL_FAST + 0.1)
        started = time.monotonic()
        await store.put("b", b"2")
        assert time.monotonic() - started < 0.4
        assert (tmp_path / "b").read_bytes() == b"2"
        await store.delete("b")

    trio.run(main)


def test_the_calls_of_one_request_share_its_deadline(tmp_path):
    """The storage calls of one kernel request (``request_deadline``) end
    ``timeout`` after the request began, together: a call cut short by it
    fails with EIO, the next is not even asked.  Before, each call had the
    whole deadline, and a server answering each in just under it made a
    request of k calls take k times the deadline.  A call cut after less
    than half its own deadline leaves no fail-fast mark; work the request
    started in the background (``no_request_deadline``) keeps its own."""
    for key, data in (("a", b"1"), ("b", b"2"), ("c", b"3")):
        (tmp_path / key).write_bytes(data)
    asked = []

    class Slow(LocalBackend):
        def get(self, key, *args, **kwargs):
            asked.append(key)
            threading.Event().wait(0.3)  # a server that answers each call in 0.3 s
            return super().get(key, *args, **kwargs)

    store = AsyncStore(Slow(str(tmp_path)), timeout=0.5)

    async def main():
        started = trio.current_time()
        with store.request_deadline():
            assert (await store.get("a")).data == b"1"
            with pytest.raises(Unavailable, match="deadline"):
                await store.get("b")  # cut at 0.5 s, after 0.2 s of its own
            with pytest.raises(Unavailable, match="not asked"):
                await store.get("c")
            assert trio.current_time() - started < 0.5 + 0.15
            with no_request_deadline():
                assert (await store.get("c")).data == b"3"
        assert asked == ["a", "b", "c"]
        assert (await store.get("b")).data == b"2"  # asked again at once: no mark

    trio.run(main)


def test_calls_answered_on_the_event_loop_keep_the_deadline_and_clear_fail_fast_marks(tmp_path):
    """A local store answers a shard index's load and a stat of a regular
    file on the event loop when the kernel's caches hold all they need
    (get_nowait, stat_nowait); they take the deadline and the fail-fast
    marks as the calls a thread makes: past the request's deadline such a
    call is not asked, and an answer is news that the store answers, which
    ends the fail-fast window of every call (before: the load was made
    after the deadline too, and left the marks as they were)."""
    (tmp_path / "s").write_bytes(b"0123456789")
    (tmp_path / "s").read_bytes()  # (its pages cached)
    backend = LocalBackend(str(tmp_path))
    store = AsyncStore(backend, timeout=0.05)

    async def main():
        assert (await store.get("s", suffix=4)).data == b"6789"  # (on the loop: all cached)
        assert (await store.stat("s")).size == 10
        with store.request_deadline():
            await trio.sleep(0.1)  # (the request's deadline passes)
            gets, heads = backend.counters["get_range"], backend.counters["head"]
            with pytest.raises(Unavailable, match="not asked"):
                await store.get("s", suffix=4)
            with pytest.raises(Unavailable, match="not asked"):
                await store.stat("s")
            assert (backend.counters["get_range"], backend.counters["head"]) == (gets, heads)
        for answered in (lambda: store.get("s", suffix=4), lambda: store.stat("s")):
            store._unanswered[("get", "other")] = time.monotonic()  # (a call that got no answer a moment ago)
            await answered()
            assert not store._unanswered

    trio.run(main)


def test_own_writes_keep_listings_fresh_instead_of_dropping_them(tmp_path):
    """A listing kept for ``list_ttl`` is brought up to date by the mount's
    own writes: a file stored joins its directory's listing (and the new
    directories those above), a file deleted leaves it.  So a tool writing
    file after file into one directory (rsync, cp -r) has its lookups there
    answered without a request; before, every write dropped the listing, and
    each lookup then cost a LIST and a HEAD on S3."""
    backend = LocalBackend(str(tmp_path))
    store = AsyncStore(backend, timeout=30, list_ttl=60)
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "old").write_bytes(b"1")

    async def main():
        assert [f.key for f in (await store.list("d")).files] == ["d/old"]
        await store.list("")
        await store.put("d/new", b"22")
        await store.put("d/sub/x", b"333")
        lists = backend.counters["list"]
        listing = await store.list("d")
        assert [f.key for f in listing.files] == ["d/new", "d/old"] and listing.dirs == ["sub"]
        assert listing.file("d/new").size == 2
        assert await store.stat("d/absent", listed_ok=True) is None
        assert (await store.list("")).dirs == ["d"]
        await store.delete("d/old")
        assert [f.key for f in (await store.list("d")).files] == ["d/new"]
        assert backend.counters["list"] == lists  # all of it answered by the kept listings
        assert backend.counters["head"] == 0
        assert [f.key for f in (await store.list("d")).files] == [f.key for f in backend.list("d").files]

    trio.run(main)


def test_only_small_fresh_listings_are_patched(tmp_path):
    """Patching a listing copies it: only listings still within
    ``list_ttl`` and of at most LIST_PATCH_ENTRIES entries are patched by a
    write; others are dropped (listed again when asked), so writing many
    files into a big directory costs no time per write that grows with it."""
    backend = LocalBackend(str(tmp_path))
    store = AsyncStore(backend, timeout=30, list_ttl=60)
    assert store.LIST_PATCH_ENTRIES == 1000  # (SEMANTICS 4: "at most 1000 entries"; 5 here, to keep it small)
    store.LIST_PATCH_ENTRIES = 5
    (tmp_path / "big").mkdir()
    (tmp_path / "small").mkdir()
    for i in range(6):
        (tmp_path / "big" / f"f{i}").write_bytes(b"1")
    (tmp_path / "small" / "f").write_bytes(b"1")

    async def main():
        await store.list("big")
        await store.list("small")
        await store.put("big/new", b"2")
        await store.put("small/new", b"2")
        assert "big" not in store._listings and "small" in store._listings
        store.list_ttl = 0.01
        await trio.sleep(0.02)
        await store.put("small/newer", b"3")
        assert "small" not in store._listings  # (expired: dropped, not patched)

    trio.run(main)


class Costly(LocalBackend):
    """A local store whose lookups count as costing requests, as S3's do."""
    lookups_cost_requests = True


class PutInfoInexact(LocalBackend):
    """A local store whose PUT answers, as S3's do, lack what a HEAD shows."""
    put_info_exact = False


def _s3_like_store(tmp_path):
    """A PutInfoInexact store with listings kept a minute, and a directory d."""
    backend = PutInfoInexact(str(tmp_path))
    (tmp_path / "d").mkdir()
    return backend, AsyncStore(backend, timeout=30, list_ttl=60)


def test_a_head_confirms_an_entry_the_mount_stored(tmp_path):
    """On S3 a PUT's answer is not what a listing or HEAD shows (the mtime):
    the entry it adds to a kept listing is unconfirmed, so lookups ask.  The
    first HEAD's answer replaces the entry; the lookups after it (rsync's
    rename of its temporary, then the unlink of the old name) and listings
    are answered by the kept listing again."""
    backend, store = _s3_like_store(tmp_path)

    async def main():
        await store.list("d")
        await store.put("d/new", b"22")
        assert "d/new" in store._listings["d"][0].unconfirmed
        heads, lists = backend.counters["head"], backend.counters["list"]
        info = await store.stat("d/new", listed_ok=True)  # asks
        assert backend.counters["head"] == heads + 1 and info.size == 2
        assert await store.stat("d/new", listed_ok=True) == info  # answered by the listing
        assert [f.key for f in (await store.list("d")).files] == ["d/new"]
        assert backend.counters["head"] == heads + 1 and backend.counters["list"] == lists

    trio.run(main)


def test_a_head_racing_a_write_does_not_confirm_the_older_version(tmp_path):
    """A HEAD that was answered while another write of the mount's own ran
    may describe the version before it: its answer is not kept."""
    backend, store = _s3_like_store(tmp_path)

    async def main():
        await store.list("d")
        await store.put("d/f", b"1")
        generation = store._list_generation
        old = backend.stat("d/f")
        await store.put("d/f", b"333")
        store._confirm("d/f", old, generation)  # (the HEAD begun before the second PUT)
        assert "d/f" in store._listings["d"][0].unconfirmed
        assert (await store.stat("d/f", listed_ok=True)).size == 3

    trio.run(main)


def test_bytes_the_mount_wrote_are_kept_briefly(tmp_path):
    """``written``: a small object's bytes, from the mount's own PUT, for
    ``list_ttl`` seconds; not after it was deleted, not for objects over
    WRITTEN_MAX, and within WRITTEN_BYTES; and only where reading back
    costs a request (S3), not on local stores."""
    store = AsyncStore(Costly(str(tmp_path)), timeout=30, list_ttl=60)
    store.WRITTEN_MAX, store.WRITTEN_BYTES = 10, 16

    async def main():
        await store.put("a", b"12345")
        assert store.written("a") == b"12345"
        await store.put("big", b"x" * 11)
        assert store.written("big") is None
        await store.put("b", b"678")
        await store.put("c", b"9" * 10)  # 18 bytes kept: the oldest goes
        assert store.written("a") is None and store.written("b") == b"678" and store.written("c") == b"9" * 10
        assert store._written_bytes == 13
        await store.delete("b")
        assert store.written("b") is None and store._written_bytes == 10
        store.list_ttl = 0.01
        await trio.sleep(0.02)
        assert store.written("c") is None

    trio.run(main)
    quiet = AsyncStore(Costly(str(tmp_path)), timeout=30, list_ttl=0)
    trio.run(quiet.put, "d", b"1")
    assert quiet.written("d") is None
    local = AsyncStore(LocalBackend(str(tmp_path)), timeout=30, list_ttl=60)
    trio.run(local.put, "e", b"1")
    assert local.written("e") is None


def test_a_directory_listed_lately_is_listed_again_for_lookups(tmp_path):
    """Where a lookup costs requests (S3: a HEAD, and a LIST for a name that
    is not a file), a small directory listed within RELIST_WINDOW is listed
    again when its listing has expired: one LIST answers the lookups of the
    next ``list_ttl``.  Not a big directory (more than one page), nor one
    not listed lately, nor where lookups are local stats."""
    backend = Costly(str(tmp_path))
    store = AsyncStore(backend, timeout=30, list_ttl=0.05)
    store.LIST_PATCH_ENTRIES = 5
    for d, n in (("small", 2), ("big", 6)):
        (tmp_path / d).mkdir()
        for i in range(n):
            (tmp_path / d / f"f{i}").write_bytes(b"1")

    async def main():
        await store.list("small")
        await store.list("big")
        await trio.sleep(0.06)  # both expired
        lists, heads = backend.counters["list"], backend.counters["head"]
        for name in ("a", "b", "c"):
            assert await store.stat(f"small/{name}", listed_ok=True) is None
            assert not await store.is_dir(f"small/{name}")
        assert (await store.stat("small/f1", listed_ok=True)).size == 1
        assert backend.counters["list"] == lists + 1 and backend.counters["head"] == heads
        assert await store.stat("big/a", listed_ok=True) is None
        assert backend.counters["head"] == heads + 1  # asked by name: too big to list again
        store.RELIST_WINDOW = 0.01
        await trio.sleep(0.06)
        assert await store.stat("small/a", listed_ok=True) is None
        assert backend.counters["head"] == heads + 2  # not listed lately
        # one that grew past what is kept is not listed whole for lookups again
        store.RELIST_WINDOW, store.LIST_CACHE_ENTRIES = 30, 5
        await store.list("small")
        for i in range(2, 7):
            (tmp_path / "small" / f"f{i}").write_bytes(b"1")
        await trio.sleep(0.06)
        assert await store.stat("small/a", listed_ok=True) is None  # (listed again: 7 entries, too many to keep)
        lists = backend.counters["list"]
        assert await store.stat("small/b", listed_ok=True) is None
        assert backend.counters["list"] == lists  # asked by name

    trio.run(main)
    local = AsyncStore(LocalBackend(str(tmp_path)), timeout=30, list_ttl=0.05)

    async def local_main():
        await local.list("small")
        await trio.sleep(0.06)
        lists = local.backend.counters["list"]
        assert await local.stat("small/a", listed_ok=True) is None
        assert local.backend.counters["list"] == lists

    trio.run(local_main)


def test_a_local_source_removed_and_made_again_is_refused(tmp_path):
    """``rm -rf src && mkdir src`` while mounted: the new, empty directory is
    not the store mounted, though a file system may give it the removed
    one's inode number (ext4 does, at once): the backend holds the mounted
    root open, so its number is not free to reuse, and refuses writes and
    reads there (EIO).  Before, a write stored a shard of only the new chunks
    beside no ``zarr.json``."""
    root = tmp_path / "pub" / "src"
    (root / "arr").mkdir(parents=True)
    (root / "arr" / "zarr.json").write_text("{}")
    backend = LocalBackend(str(root))
    backend.put("arr/c/0/0", b"old shard")
    for _ in range(3):  # (made again three times: a reuse of the number is likely on ext4 without the fix)
        shutil.rmtree(root)
        root.mkdir()
        for attempt in (lambda: backend.put("arr/c/0/1", b"new shard"), lambda: backend.list(""),
                        lambda: backend.stat("arr/zarr.json"), lambda: backend.get("arr/zarr.json")):
            with pytest.raises(StoreError) as info:
                attempt()
            assert "gone or was replaced" in str(info.value) and info.value.errno == errno.EIO
        assert os.listdir(root) == []
    backend.close()


def test_listings_not_kept_do_not_extend_the_relist_window(tmp_path):
    """A listing that a write of the mount's own raced is not kept, and does
    not count as "listed lately" either: under steady writes elsewhere in
    the mount, lookups of missing names go back to HEADs once RELIST_WINDOW
    has passed, instead of a whole LIST each for ever."""
    class RacedList(Costly):
        racing = False

        def list(self, prefix):
            if self.racing:  # a write of the mount's own lands while this LIST runs, every time
                trio.from_thread.run(store.put, "other/f", b"x")
            return super().list(prefix)

    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "a").write_bytes(b"1")
    backend = RacedList(str(tmp_path))
    store = AsyncStore(backend, timeout=30, list_ttl=0.02)
    store.RELIST_WINDOW = 0.2

    async def main():
        await store.list("d")  # kept: d was listed lately
        backend.racing = True
        t0 = trio.current_time()
        raced = 0
        while trio.current_time() - t0 < 0.6:  # (three RELIST_WINDOWs)
            await trio.sleep(0.025)
            before = backend.counters["list"]
            await store.stat(f"d/missing{int((trio.current_time() - t0) * 1000)}", listed_ok=True)
            raced += backend.counters["list"] - before
        assert raced >= 1  # (the window was open at first: a lookup listed, and was raced)
        lists = backend.counters["list"]
        for i in range(20):  # past the window: lookups by name again
            await trio.sleep(0.025)
            await store.stat(f"d/late{i}", listed_ok=True)
        return backend.counters["list"] - lists

    assert trio.run(main) == 0


def _tensorstore_lock(path: str) -> int:
    """Hold ``<path>.__lock`` as tensorstore's file kvstore does (an
    open-file-description write lock); close the descriptor to release."""
    import fcntl
    import struct

    fd = os.open(path + ".__lock", os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC, 0o666)
    fcntl.fcntl(fd, fcntl.F_OFD_SETLKW, struct.pack("=hh4xqqi4x", fcntl.F_WRLCK, os.SEEK_SET, 0, 0, 0))
    return fd


def test_local_conditional_writes_take_tensorstore_s_lock(tmp_path, monkeypatch):
    """tensorstore checks a key's generation and renames its new value over
    it under a lock on ``<key>.__lock``.  A conditional put (a shard flush)
    waits for that lock, so it never lands between tensorstore's check and
    rename (where tensorstore's rename would throw it away unseen): a
    change tensorstore makes under the lock fails the put's precondition.
    The lock file is gone afterwards and never listed; a lock held too long
    is EBUSY, not a hang."""
    import zshardfs.backends.local as local_module

    backend = LocalBackend(str(tmp_path))
    old = backend.put("arr/shard", b"old")
    path = str(tmp_path / "arr/shard")
    fd = _tensorstore_lock(path)
    done = []
    worker = threading.Thread(target=lambda: done.append(_outcome(
        lambda: backend.put("arr/shard", b"mount", if_match=old.etag))))
    worker.start()
    time.sleep(0.3)
    assert not done and (tmp_path / "arr/shard").read_bytes() == b"old"  # waiting for the lock
    (tmp_path / "arr/shard.ts").write_bytes(b"tensorstore")
    os.rename(tmp_path / "arr/shard.ts", path)  # tensorstore's write, under its lock
    os.close(fd)
    worker.join(10)
    assert isinstance(done[0], PreconditionFailed)
    assert (tmp_path / "arr/shard").read_bytes() == b"tensorstore"
    assert not (tmp_path / "arr/shard.__lock").exists()

    current = backend.stat("arr/shard")
    fd = _tensorstore_lock(path)
    assert [f.key for f in backend.list("arr").files] == ["arr/shard"]  # (the lock file is not listed)
    assert not backend.reserved_name("shard.__lock")  # (tensorstore through a mount makes such files)
    monkeypatch.setattr(local_module, "LOCK_WAIT", 0.2)
    with pytest.raises(StoreError, match="locked by another writer"):
        backend.delete("arr/shard", if_match=current.etag)
    os.close(fd)
    backend.put("arr/shard", b"mount", if_match=current.etag)
    assert (tmp_path / "arr/shard").read_bytes() == b"mount"
    assert sorted(os.listdir(tmp_path / "arr")) == ["shard"]


def _outcome(fn):
    try:
        return fn()
    except Exception as exc:
        return exc


def test_local_lock_files_left_by_killed_writers_are_removed(tmp_path):
    """A kill -9 in the middle of a conditional write leaves the key's empty
    lock file (tensorstore's crashes do too).  Listings never show an empty
    ``<key>.__lock``; a put into its directory removes it once it is
    STALE_AGE old and no one holds it.  A lock held now, or a file of that
    name with data in it, is left alone (and the latter is listed).  A key
    removed, with its lock file and directory, while a write waits for the
    lock is a failed precondition (before: EBADF from a double close)."""
    import zshardfs.backends.local as local_module

    backend = LocalBackend(str(tmp_path))
    backend.put("arr/a", b"1")
    old = time.time() - 2 * local_module.STALE_AGE
    for name, data in (("a.__lock", b""), ("b.__lock", b""), ("c.__lock", b"tensorstore died writing")):
        (tmp_path / "arr" / name).write_bytes(data)
        os.utime(tmp_path / "arr" / name, (old, old))
    held = _tensorstore_lock(str(tmp_path / "arr/b"))
    assert [f.key for f in backend.list("arr").files] == ["arr/a", "arr/c.__lock"]
    fresh = LocalBackend(str(tmp_path))  # (its first put into the directory sweeps it)
    fresh.put("arr/d", b"4")
    assert sorted(os.listdir(tmp_path / "arr")) == ["a", "b.__lock", "c.__lock", "d"]
    os.close(held)

    info = backend.put("d/s", b"x")
    held = _tensorstore_lock(str(tmp_path / "d/s"))
    done = []
    worker = threading.Thread(target=lambda: done.append(_outcome(
        lambda: backend.delete("d/s", if_match=info.etag))))
    worker.start()
    time.sleep(0.3)
    os.unlink(tmp_path / "d/s")
    os.unlink(tmp_path / "d/s.__lock")
    os.rmdir(tmp_path / "d")
    os.close(held)
    worker.join(10)
    assert isinstance(done[0], PreconditionFailed), done


def test_a_local_listing_that_meets_a_lock_file_removed_meanwhile_lists_the_rest(tmp_path, monkeypatch):
    """A conditional write (every shard flush) makes ``<key>.__lock`` and
    removes it when done; a listing of that directory may read its name,
    then find it gone when it looks at its size. That lock is simply not
    listed. Before, the listing's ENOENT was taken for the whole
    directory's: the listing came back empty, and a walk of the mount
    showed none of an array's chunks while the array's own shards were
    being flushed (found by reading the code after a difftest run, seed
    302 of rectilinear_edges_v2_gzip, showed every chunk missing). A
    sweep before a put goes on past such a file as well."""
    import zshardfs.backends.local as local_module

    backend = LocalBackend(str(tmp_path))
    for key in ("arr/0.0", "arr/0.1", "arr/zarr.json"):
        backend.put(key, b"x")
    real_scandir = os.scandir

    class Racing:
        """os.scandir whose lock entries are removed right after they are read
        (as a writer done with its lock removes it)."""

        def __init__(self, fd):
            self.it = real_scandir(fd)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.it.close()

        def __iter__(self):
            # (locks first: the sweep below meets one before the temporary behind it)
            for entry in sorted(self.it, key=lambda e: not e.name.endswith(".__lock")):
                if entry.name.endswith(".__lock"):
                    os.unlink(entry.name, dir_fd=fd_of[0])
                yield entry

    fd_of = []

    def racing_scandir(fd):
        fd_of[:] = [fd]
        return Racing(fd)

    (tmp_path / "arr" / "0.1.__lock").write_bytes(b"")
    monkeypatch.setattr(local_module.os, "scandir", racing_scandir)
    assert [f.key for f in backend.list("arr").files] == ["arr/0.0", "arr/0.1", "arr/zarr.json"]
    # the sweep before a first put into a directory: past the lock gone, on to a dead writer's temporary
    (tmp_path / "arr" / "0.0.__lock").write_bytes(b"")
    dead = tmp_path / "arr" / f"{local_module.TMP_PREFIX}999999999-0-zz"
    dead.write_bytes(b"left by a writer killed")
    old = time.time() - 2 * local_module.STALE_AGE
    os.utime(dead, (old, old))
    LocalBackend(str(tmp_path)).put("arr/1.0", b"y")
    assert not dead.exists()


def test_local_keys_never_resolve_outside_the_store(tmp_path):
    """A symbolic link in a local store that leads out of it (absolute, or
    climbing with ``..``) is not followed by any operation: not read,
    listed, written through or deleted through; one that stays inside is
    followed. Before, every link was followed: through a root daemon's
    ``allow_other`` mount any user read any file of the machine, and
    ``rm -rf`` through the mount deleted what a link's directory held."""
    root, outside = store_with_links_out(tmp_path)
    b = LocalBackend(str(root))
    for key in ("leak", "climb", "etc/passwd", "up/outside/secret"):
        assert b.stat(key) is None
        with pytest.raises(NotFound):
            b.get(key)
    assert not b.is_dir("etc") and not b.is_dir("up")
    listing = b.list("")
    assert listing.dirs == ["sub"] and [f.key for f in listing.files] == ["inside"]
    assert b.list("etc").files == [] and b.list("up").dirs == []
    assert b.get("inside").data == b"inside" and b.get("sub/back/file").data == b"inside"
    assert b.list("sub").dirs == []  # (back -> ../sub: a loop, left out of listings; its path still reads)
    with pytest.raises(NotFound):
        b.put("etc/new", b"x")
    with pytest.raises(NotFound):
        b.make_dir("etc/newdir")
    with pytest.raises(NotFound):
        b.delete("etc/passwd")
    with pytest.raises(NotFound):
        b.remove_dir("etc")  # (a link, not a directory of the store)
    assert sorted(os.listdir(outside / "etc")) == ["passwd"] and (root / "etc").is_symlink()
    b.put("sub/new", b"y")  # inside: as ever
    assert (root / "sub" / "new").read_bytes() == b"y"
    b.close()
    free = LocalBackend(str(root), confine=False)  # -o follow_symlinks
    assert free.get("leak").data == b"secret" and free.get("etc/passwd").data == b"root:x:0:0"
    free.close()


def test_local_links_are_reported_as_themselves(tmp_path):
    """Every symbolic link of a local store is reported as the link itself
    (``Listing.links``, ``stat(links=True)``: its target text, never followed), whatever
    it names: leading out, a loop, dangling; ``dirs`` and ``files`` go on
    showing the links that stay inside as what they name (for the names the
    view derives).  ``symlink`` makes a link (EEXIST if the name is taken),
    ``move_link`` renames the link itself, ``delete`` removes the link and
    never its target.  ``-o follow_symlinks`` (confine=False) reports none.
    Before, there was no such thing: links were followed or left out."""
    root, outside = store_with_links_out(tmp_path)
    (root / "dangling").symlink_to("nothing")
    b = LocalBackend(str(root))
    assert b.symlinks
    listing = b.list("")
    targets = {info.key: info.link for info in listing.links}
    assert targets == {"climb": "../outside/secret", "dangling": "nothing", "etc": str(outside / "etc"),
                       "inside": "sub/file", "leak": str(outside / "secret"), "up": ".."}
    assert all(info.size == len(os.fsencode(info.link)) for info in listing.links)
    assert listing.dirs == ["sub"] and [f.key for f in listing.files] == ["inside"]  # (as before)
    assert [(i.key, i.link) for i in b.list("sub").links] == [("sub/back", "../sub")]
    assert b.stat("leak", links=True).link == str(outside / "secret")
    assert b.stat("sub/back", links=True).link == "../sub" and b.stat("inside", links=True).link == "sub/file"
    assert b.stat("inside").link is None and b.stat("inside").size == 6  # (followed: a name the view derives)
    assert b.stat("sub/file", links=True).link is None and b.stat("sub/back/file", links=True).size == 6
    for key in ("sub", "missing", "etc/passwd", "up/outside"):
        assert b.stat(key, links=True) is None, key  # (no file; or below a link leading out: never resolved)
    made = b.symlink("sub/new", "/anything at all")
    assert made.link == "/anything at all" and os.readlink(root / "sub" / "new") == "/anything at all"
    with pytest.raises(StoreError) as taken:
        b.symlink("sub/new", "x")
    assert taken.value.errno == errno.EEXIST
    b.move_link("etc", "sub/moved")
    assert os.readlink(root / "sub" / "moved") == str(outside / "etc") and not os.path.lexists(root / "etc")
    (root / "sub" / "plain").write_bytes(b"replaced")
    b.move_link("sub/moved", "sub/plain")  # (as rename(2): the file at the new name is replaced)
    assert os.readlink(root / "sub" / "plain") == str(outside / "etc")
    with pytest.raises(NotFound):
        b.move_link("sub/file", "sub/x")  # (no longer a link: not moved)
    b.delete("sub/plain")
    b.delete("leak")
    assert not os.path.lexists(root / "sub" / "plain") and not os.path.lexists(root / "leak")
    assert (outside / "secret").read_bytes() == b"secret" and os.listdir(outside / "etc") == ["passwd"]
    b.close()
    free = LocalBackend(str(root), confine=False)
    assert not free.symlinks and free.list("").links == () and free.stat("inside", links=True).link is None
    free.close()


def test_kept_listings_follow_the_mount_s_own_link_changes(tmp_path):
    """A listing kept for ``list_ttl`` answers lookups of links, and the
    mount's own changes of a link show at once: an unlink removes it from
    the listing, a file stored over it replaces it, a link made or moved
    drops the listing (S3, without links, is never asked)."""
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "a").symlink_to("x")
    (tmp_path / "d" / "b").symlink_to("y")
    backend = LocalBackend(str(tmp_path))
    store = AsyncStore(backend, list_ttl=60)

    async def link(key):
        info = await store.stat(key, listed_ok=True, links=True)
        return info.link if info is not None else None

    async def main():
        await store.list("d")
        asked = backend.counters["head"]
        assert await link("d/a") == "x" and await link("d/nothing") is None
        assert backend.counters["head"] == asked  # (answered by the listing)
        await store.delete("d/a")
        assert await link("d/a") is None and not os.path.lexists(tmp_path / "d" / "a")
        await store.put("d/b", b"file")
        assert await link("d/b") is None and (await store.stat("d/b", listed_ok=True, links=True)).size == 4
        assert backend.counters["head"] == asked
        await store.symlink("d/c", "z")
        assert await link("d/c") == "z"
        await store.move_link("d/c", "d/e")
        assert await link("d/c") is None and await link("d/e") == "z"

    trio.run(main)
    store.close()


def test_s3_has_no_links(s3):
    """S3 has no symbolic links: its backend says so, its listings report
    none, and a lookup asking for links asks S3 as any lookup does."""
    _, _, backend = s3
    assert backend.symlinks is False
    backend.put("a/b", b"x")
    assert backend.list("a").links == ()
    store = AsyncStore(backend)
    before = sum(backend.counters.values())
    assert trio.run(lambda: store.stat("a/b", links=True)).link is None  # (S3 is asked as ever: no links kwarg)
    assert sum(backend.counters.values()) == before + 1


def test_local_conditional_write_is_judged_in_the_directory_it_lands_in(tmp_path, monkeypatch):
    """A conditional put judges its precondition in the directory it renames
    into: when the key's directory is moved away and another made in its
    place meanwhile (``mv d x && mkdir d``), the put fails its precondition
    (and is retried by the write-back) instead of replacing, unseen, the
    object that moved along. Before, the check looked at the new directory
    and an ``if_none_match`` put overwrote ``x/k``."""
    import zshardfs.backends.local as local

    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "k").write_bytes(b"precious")
    b = LocalBackend(str(tmp_path))
    real_lock = local._key_lock

    def swapping_lock(dfd, name, *args):
        os.rename(tmp_path / "d", tmp_path / "x")
        (tmp_path / "d").mkdir()
        return real_lock(dfd, name, *args)

    monkeypatch.setattr(local, "_key_lock", swapping_lock)
    with pytest.raises(PreconditionFailed):
        b.put("d/k", b"clobber", if_none_match=True)
    assert (tmp_path / "x" / "k").read_bytes() == b"precious"
    b.close()


def test_local_listing_leaves_out_links_that_name_nothing(tmp_path):
    """A symbolic link loop, or a link through a file, is left out of its
    directory's listing (a loop with one warning); the rest is listed.
    Before, the whole listing failed (EIO for ``ls`` of the directory)."""
    (tmp_path / "a").write_bytes(b"a")
    (tmp_path / "d").mkdir()
    (tmp_path / "loop").symlink_to("loop")
    (tmp_path / "through").symlink_to("a/x")
    (tmp_path / "dangling").symlink_to("nothing")
    b = LocalBackend(str(tmp_path))
    listing = b.list("")
    assert listing.dirs == ["d"] and [f.key for f in listing.files] == ["a"]
    b.close()


def test_local_links_to_a_directory_above_are_left_out_as_loops(tmp_path):
    """Symbolic links to the directory they are in, or to one above it, are
    left out of listings (one warning each), and a listing through such a
    link is empty: a walk down the tree (``fsck``, ``find``, ``rm -rf``)
    ends. Before, three links to ``.`` made ``zshardfs fsck`` walk about
    3^40 paths, and ``rm -rf MNT/loop`` with ``loop -> .`` emptied the whole
    source."""
    (tmp_path / "d" / "e").mkdir(parents=True)
    (tmp_path / "d" / "e" / "f").write_bytes(b"f")
    for i in range(3):
        (tmp_path / "d" / f"self{i}").symlink_to(".")
    (tmp_path / "d" / "e" / "up").symlink_to("../..")
    (tmp_path / "d" / "sib").symlink_to("e")  # (not a loop: listed)
    b = LocalBackend(str(tmp_path))
    assert b.list("d").dirs == ["e", "sib"]
    assert b.list("d/e").dirs == [] and [f.key for f in b.list("d/e").files] == ["d/e/f"]
    assert b.list("d/self0") == b.list("d/e/up") == b.list("d/self1/self2") == Listing([], [])
    assert [f.key for f in b.list("d/sib").files] == ["d/sib/f"]
    assert b.get("d/self0/e/f").data == b"f"  # (a path named outright still reads)
    b.close()


def test_local_writes_never_wait_forever_on_what_other_users_put_there(tmp_path, monkeypatch):
    """What any user who can read (or write) the store can do does not hold
    a conditional write's thread for good: a directory flock held by
    another process is waited for LOCK_WAIT at most (EBUSY, the flush is
    retried); a FIFO at a key's lock name is refused at once, also by the
    sweep of stale lock files; a FIFO or a hard link at a temporary file's
    name is never opened (the names are random and made with O_EXCL).
    Before, each of them blocked a worker thread forever or (the hard link)
    wrote the shard into the file elsewhere."""
    import fcntl

    import zshardfs.backends.local as local

    monkeypatch.setattr(local, "LOCK_WAIT", 0.3)
    (tmp_path / "d").mkdir()
    b = LocalBackend(str(tmp_path))
    b.put("d/k", b"v0")
    held = os.open(tmp_path / "d", os.O_RDONLY | os.O_DIRECTORY)
    fcntl.flock(held, fcntl.LOCK_EX)  # (another process's, to the backend: an open file description of its own)
    started = time.monotonic()
    with pytest.raises(StoreError) as raised:
        b.put("d/k", b"v1", if_match=b.stat("d/k").etag)
    assert raised.value.errno == errno.EBUSY and time.monotonic() - started < 5
    os.close(held)
    os.mkfifo(tmp_path / "d" / "k.__lock")
    with pytest.raises(StoreError):
        b.put("d/k", b"v1", if_match=b.stat("d/k").etag)
    dfd = os.open(tmp_path / "d", os.O_RDONLY)
    assert not local._remove_lock_if_stale(dfd, "k.__lock")
    os.close(dfd)
    os.unlink(tmp_path / "d" / "k.__lock")
    outside = tmp_path / "outside"
    outside.write_bytes(b"precious")
    names = iter(["planted-fifo", "planted-link"])
    real_name = local._tmp_name
    monkeypatch.setattr(local, "_tmp_name", lambda base: next(names, None) or real_name(base))
    os.mkfifo(tmp_path / "d" / "planted-fifo")
    os.link(outside, tmp_path / "d" / "planted-link")
    b.put("d/k", b"v2", if_match=b.stat("d/k").etag)
    assert b.get("d/k").data == b"v2" and outside.read_bytes() == b"precious"
    b.close()


def test_local_entries_the_view_cannot_see_are_replaced_by_a_write(tmp_path):
    """A FIFO, or a link leading out, at a shard's name shows as nothing,
    and a write there (if_none_match) replaces the entry itself; the link's
    target is left alone. Before, every flush of it failed (12 "conflicting
    writes"), and unmount was refused for as long as the entry was there."""
    outside = tmp_path / "outside"
    outside.write_bytes(b"precious")
    (tmp_path / "s" / "c").mkdir(parents=True)
    (tmp_path / "s" / "c" / "link").symlink_to(outside)
    os.mkfifo(tmp_path / "s" / "c" / "fifo")
    b = LocalBackend(str(tmp_path / "s"))
    for name in ("link", "fifo"):
        assert b.stat(f"c/{name}") is None
        b.put(f"c/{name}", b"shard", if_none_match=True)
        assert b.get(f"c/{name}").data == b"shard"
    assert outside.read_bytes() == b"precious"
    b.close()


def test_local_a_live_put_s_temporary_survives_a_listing_by_another_path(tmp_path):
    """A put's temporary file (its write and fsync slow, or its key locked by
    tensorstore, so its mtime is STALE_AGE old) is not taken for a dead
    writer's by a listing of its directory reached by another path (a
    relative symlink inside the store): the process knows its own
    temporaries by name. Before, by path: the listing removed it and the
    put failed (NotFound, retried)."""
    import fcntl
    import threading

    import zshardfs.backends.local as local

    (tmp_path / "real" / "c").mkdir(parents=True)
    (tmp_path / "alias").symlink_to("real")
    b = LocalBackend(str(tmp_path))
    b.put("real/c/0", b"v0")
    etag = b.stat("real/c/0").etag
    lock = os.open(tmp_path / "real" / "c" / "0.__lock", os.O_RDWR | os.O_CREAT)
    fcntl.fcntl(lock, fcntl.F_OFD_SETLK, local._OFD_WRLCK)  # (another writer's lock of the key)
    out = {}

    def writer():
        try:
            out["info"] = b.put("real/c/0", b"v1", if_match=etag)
        except Exception as exc:  # noqa: BLE001 (reported below)
            out["exc"] = exc

    t = threading.Thread(target=writer)
    t.start()
    assert wait_for(lambda: any(n.startswith(local.TMP_PREFIX) for n in os.listdir(tmp_path / "real" / "c")),
                    timeout=5)
    tmp = next(n for n in os.listdir(tmp_path / "real" / "c") if n.startswith(local.TMP_PREFIX))
    old = time.time() - 2 * local.STALE_AGE
    os.utime(tmp_path / "real" / "c" / tmp, (old, old))
    b.list("alias/c")
    assert (tmp_path / "real" / "c" / tmp).exists()
    fcntl.fcntl(lock, fcntl.F_OFD_SETLK, local._OFD_UNLCK)
    os.close(lock)
    t.join(timeout=30)
    assert "exc" not in out, out
    assert b.get("real/c/0").data == b"v1"
    b.close()


class _FreeDescriptors:
    """This process's soft RLIMIT_NOFILE set, while in the block, so that
    exactly ``n`` descriptor numbers below it are free (the numbers in use
    found with fstat, which opens none)."""

    def __init__(self, n: int):
        self.n = n

    def __enter__(self):
        import resource

        self.saved = resource.getrlimit(resource.RLIMIT_NOFILE)
        free, fd = [], 0
        while len(free) <= self.n:
            try:
                os.fstat(fd)
            except OSError:
                free.append(fd)
            fd += 1
        resource.setrlimit(resource.RLIMIT_NOFILE, (free[self.n], self.saved[1]))
        return self

    def __exit__(self, *exc):
        import resource

        resource.setrlimit(resource.RLIMIT_NOFILE, self.saved)


def test_a_local_listing_at_the_open_file_limit_lets_go_of_kept_descriptors(tmp_path):
    """At the open-file limit, the descriptors a local store keeps for fast
    reads are let go of when a listing's copy of its directory's descriptor
    (``scandir``) meets EMFILE, as when an open does.  Before, the listing
    failed with EMFILE, for good: its open found the last free number, and
    the copy none."""
    root = tmp_path / "store"
    (root / "r").mkdir(parents=True)
    for i in range(40):
        (root / "r" / str(i)).write_bytes(b"x")
    (root / "d").mkdir()
    (root / "d" / "a").write_bytes(b"a")
    b = LocalBackend(str(root))
    try:
        for i in range(40):
            b.get(f"r/{i}")
        assert len(b._fds) >= 8
        with _FreeDescriptors(1):
            listing = b.list("d")
        assert [f.key for f in listing.files] == ["d/a"] and not b._fds
    finally:
        b.close()


def test_a_key_lock_opened_at_the_open_file_limit_lets_go_of_kept_descriptors(tmp_path, monkeypatch):
    """A conditional write's open of its key's lock file that meets EMFILE
    (another thread took the last free descriptor number after the write's
    own opens: simulated here, as that race cannot be timed) lets go of the
    descriptors kept for reads and opens again, as every other open of a
    local store does.  Before, the write failed."""
    from zshardfs.backends.local import LOCK_SUFFIX

    root = tmp_path / "store"
    (root / "r").mkdir(parents=True)
    for i in range(10):
        (root / "r" / str(i)).write_bytes(b"x")
    (root / "d").mkdir()
    b = LocalBackend(str(root))
    real_open, refused = os.open, []

    def open_(path, *args, **kwargs):
        if str(path).endswith(LOCK_SUFFIX) and not refused:
            refused.append(path)
            raise OSError(errno.EMFILE, "Too many open files")
        return real_open(path, *args, **kwargs)

    try:
        for i in range(10):
            b.get(f"r/{i}")
        assert b._fds
        monkeypatch.setattr(os, "open", open_)
        info = b.put("d/new", b"data", if_none_match=True)
        monkeypatch.undo()
        assert refused and not b._fds
        assert info.size == 4 and (root / "d" / "new").read_bytes() == b"data"
        assert not any(p.name.endswith(LOCK_SUFFIX) for p in (root / "d").iterdir())
    finally:
        b.close()


def test_local_conditional_writes_of_the_longest_names_need_no_lock_file(tmp_path):
    """A key whose name is legal but leaves no room for ``.__lock`` (over
    248 bytes; a shard of a many-dimensional array with ``.`` keys) is
    written and deleted conditionally all the same (before: ENAMETOOLONG
    from the lock file's name).  tensorstore cannot lock such a key either,
    so there is no lock to honour; the directory lock still orders our own
    writers."""
    backend = LocalBackend(str(tmp_path))
    for name in ("c" + ".1" * 126, "s" * 255):  # (253 and 255 bytes)
        key = "arr/" + name
        made = backend.put(key, b"one", if_none_match=True)
        with pytest.raises(PreconditionFailed):
            backend.put(key, b"two", if_none_match=True)
        again = backend.put(key, b"three", if_match=made.etag)
        assert (tmp_path / key).read_bytes() == b"three"
        with pytest.raises(PreconditionFailed):
            backend.delete(key, if_match=made.etag)
        backend.delete(key, if_match=again.etag)
        assert not (tmp_path / key).exists()
    assert os.listdir(tmp_path / "arr") == []


def test_a_document_a_fresh_listing_shows_unchanged_is_not_read_again(tmp_path):
    """A metadata document read longer ago than ``list_ttl`` is not read
    again (a GET per array per warm walk on S3) when a listing made within
    it shows the version read; a listing showing another version, or none
    made lately, has it read again."""
    class Counting(LocalBackend):
        gets = 0

        def get(self, *args, **kwargs):
            Counting.gets += 1
            return super().get(*args, **kwargs)

    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "zarr.json").write_bytes(b"{}")
    backend = Counting(str(tmp_path))
    store = AsyncStore(backend, timeout=30, list_ttl=0.05)

    async def main():
        await store.list("d")
        assert (await store.get_document("d/zarr.json")).data == b"{}"
        await trio.sleep(0.06)
        await store.list("d")
        gets = backend.gets
        assert (await store.get_document("d/zarr.json")).data == b"{}"
        assert backend.gets == gets  # (the listing shows the version read)
        (tmp_path / "d" / "zarr.json").write_bytes(b'{"a": 1}')  # another client's
        await trio.sleep(0.06)
        await store.list("d")
        assert (await store.get_document("d/zarr.json")).data == b'{"a": 1}'
        assert backend.gets == gets + 1
        await trio.sleep(0.06)  # no listing lately: read again
        assert (await store.get_document("d/zarr.json")).data == b'{"a": 1}'
        assert backend.gets == gets + 2

    trio.run(main)


def test_calls_given_up_give_their_slot_back_up_to_max_connections(tmp_path):
    """A call given up at its deadline goes on in its thread (it cannot be
    stopped) but gives its ``max_connections`` slot back at once, so later
    calls do not queue behind a dead endpoint's threads; for at most
    ``max_connections`` such calls at a time: beyond, a given-up call keeps
    its slot until its thread ends (no more than twice ``max_connections``
    calls ever run at once).  Before, every given-up call kept its slot."""
    (tmp_path / "k").write_bytes(b"1")
    backend = LocalBackend(str(tmp_path))
    release = threading.Event()
    running = []
    get = backend.get

    def hung(key, *args, **kwargs):
        if key.startswith("hang"):
            running.append(key)
            release.wait(30)
        return get("k", *args, **kwargs)

    backend.get = hung
    astore = AsyncStore(backend, max_connections=2, timeout=0.3)

    async def one(key):
        try:
            await astore.get(key)
            return "ok"
        except Unavailable as exc:
            return str(exc)

    async def main():
        for key in ("hang-a", "hang-b"):  # given up: their slots come back
            assert "no answer" in await one(key)
        assert astore.given_up_running == 2 and astore.limiter.borrowed_tokens == 0
        assert await one("k1") == "ok"  # at once, with a slot
        for key in ("hang-c", "hang-d"):  # given up too, beyond max_connections: they keep their slots
            assert "no answer" in await one(key)
        assert astore.given_up_running == 4 and astore.limiter.borrowed_tokens == 2
        t0 = trio.current_time()
        assert "no answer" in await one("k2")  # no slot until its deadline: never asked
        assert trio.current_time() - t0 >= 0.29 and sorted(running) == ["hang-a", "hang-b", "hang-c", "hang-d"]
        release.set()
        with trio.fail_after(10):
            while astore.given_up_running or astore.limiter.borrowed_tokens:
                await trio.sleep(0.01)
        assert await one("k3") == "ok"

    trio.run(main)


class SlowList(LocalBackend):
    """A local store whose LIST takes a while (in its worker thread), as a far S3's does."""

    def list(self, prefix):
        time.sleep(0.3)
        return super().list(prefix)


def test_overlapping_listings_of_one_directory_without_list_ttl(tmp_path):
    """With ``list_ttl`` 0 (``metadata_ttl=0``) listings are not shared, so
    two of one directory may run at once, each marked as loading.  Before,
    the second mark replaced the first, and the first to end removed the
    second's: the second then failed with KeyError (a mount's ``find`` of a
    Zarr array on S3 with ``metadata_ttl=0``: "readdir failed unexpectedly",
    a traceback, EIO).  Both listings now answer, and no mark is left."""
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "x").write_bytes(b"1")
    store = AsyncStore(SlowList(str(tmp_path)), timeout=30, list_ttl=0)
    got = []

    async def one(delay):
        await trio.sleep(delay)
        got.append([f.key for f in (await store.list("d")).files])

    async def main():
        async with trio.open_nursery() as nursery:
            nursery.start_soon(one, 0)
            nursery.start_soon(one, 0.1)  # (starts while the first runs, ends after it)
        assert got == [["d/x"], ["d/x"]]
        assert "d" not in store._lists

    trio.run(main)


class CountedGets(LocalBackend):
    """A local store that counts its GETs by key."""

    def __init__(self, root):
        super().__init__(root)
        self.gets: list[str] = []

    def get(self, key, *args, **kwargs):
        self.gets.append(key)
        return super().get(key, *args, **kwargs)


def test_without_list_ttl_a_request_reads_a_document_once_and_the_next_reads_it_again(tmp_path):
    """With ``list_ttl`` 0 (``metadata_ttl=0``) nothing read is kept for
    later requests, but one request reads a document (or finds it missing)
    once, however many of its probes ask (a probe at depth d asks for d + 1
    ``info``s, the look for the directories they name for the same ones
    again).  The next request reads it again and sees another client's new
    version; a write of the mount's own within the request is seen at once;
    outside requests every call reads."""
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "info").write_bytes(b"one")
    backend = CountedGets(str(tmp_path))
    store = AsyncStore(backend, timeout=30, list_ttl=0)

    async def main():
        with store.request_deadline():
            assert [(await store.get_document("d/info")).data for _ in range(3)] == [b"one"] * 3
            for _ in range(2):
                with pytest.raises(NotFound):
                    await store.get_document("e/info")
            assert backend.gets == ["d/info", "e/info"]  # (before: each call a GET)
        (tmp_path / "d" / "info").write_bytes(b"two!")  # (another client)
        with store.request_deadline():
            assert (await store.get_document("d/info")).data == b"two!"
            with pytest.raises(NotFound):
                await store.get_document("e/info")
            await store.put("e/info", b"made here")  # (the mount's own write: seen at once)
            assert (await store.get_document("e/info")).data == b"made here"
        assert backend.gets == ["d/info", "e/info", "d/info", "e/info", "e/info"]
        for _ in range(2):
            await store.get_document("d/info")
        assert backend.gets[5:] == ["d/info", "d/info"]

    trio.run(main)


def test_a_local_rewrite_keeps_the_stored_files_mode_and_owner(tmp_path):
    """A local put replaces its file with a new one (a temporary file
    renamed over it), which took the daemon's umask and user: a shard
    another user kept private (0600) became world-readable 0644 at the
    first chunk written through a root daemon's mount, a group-writable
    one lost its group's write, and one its owner owned became root's.
    The new file now takes the old one's permission bits (never setuid or
    setgid) and, where the daemon may (root), its owner and group; a new
    key gets the umask's mode, the daemon's user."""
    os.makedirs(tmp_path / "arr")
    private, shared = tmp_path / "arr" / "private", tmp_path / "arr" / "shared"
    private.write_bytes(b"old")
    shared.write_bytes(b"old")
    os.chmod(private, 0o600)
    os.chmod(shared, 0o6664)  # (setuid/setgid: not carried over)
    if os.geteuid() == 0:
        os.chown(private, 65534, 65534)
        os.chown(shared, 1234, 4321)
    b = LocalBackend(str(tmp_path))
    b.put("arr/private", b"new")
    b.put("arr/shared", b"new", if_match=b.stat("arr/shared").etag)
    old_umask = os.umask(0o022)
    try:
        b.put("arr/fresh", b"new")
    finally:
        os.umask(old_umask)
    st_p, st_s, st_f = (os.stat(tmp_path / "arr" / n) for n in ("private", "shared", "fresh"))
    assert private.read_bytes() == shared.read_bytes() == b"new"
    assert stat.S_IMODE(st_p.st_mode) == 0o600
    assert stat.S_IMODE(st_s.st_mode) == 0o664
    assert stat.S_IMODE(st_f.st_mode) == 0o644
    if os.geteuid() == 0:
        assert (st_p.st_uid, st_p.st_gid) == (65534, 65534)
        assert (st_s.st_uid, st_s.st_gid) == (1234, 4321)
        assert (st_f.st_uid, st_f.st_gid) == (0, 0)


def test_a_directory_renamed_or_removed_is_swept_anew_at_its_name(tmp_path):
    """The directories already swept of dead writers' temporaries (once
    each, before the first put) were remembered by key after the directory
    was renamed away, replaced by a rename onto its name, or removed
    (pruned by a delete, or rmdir): a directory later at that name (made
    again, or moved there with a dead writer's temporary in it) was never
    swept, the temporary holding its space for good (chunk directories are
    listed from shard indexes: no listing meets it either).  Kept
    descriptors below a renamed or removed directory are let go too."""
    import zshardfs.backends.local as local_module

    old = time.time() - 2 * local_module.STALE_AGE

    def dead_writer_in(d):
        d.mkdir(parents=True, exist_ok=True)
        dead = d / f"{local_module.TMP_PREFIX}999999999-0-zz"
        dead.write_bytes(b"left by a writer killed")
        os.utime(dead, (old, old))
        return dead

    backend = LocalBackend(str(tmp_path))
    # renamed away, another directory made at its name
    backend.put("a/c/0", b"1")
    assert backend.get_nowait("a/c/0", 0, 1, None) is not None and backend.table_sizes()["kept_fds"] == 1
    backend.move_dir("a", "z", noreplace=True)
    assert backend.table_sizes()["kept_fds"] == 0
    dead = dead_writer_in(tmp_path / "a" / "c")
    backend.put("a/c/1", b"2")
    assert not dead.exists()
    # replaced by a rename onto its (empty) name
    backend.put("d/e/0", b"1")
    os.unlink(tmp_path / "d/e/0")
    os.rmdir(tmp_path / "d/e")
    dead = dead_writer_in(tmp_path / "q" / "e")
    backend.move_dir("q", "d", noreplace=False)
    backend.put("d/e/1", b"2")
    assert not (tmp_path / "d/e" / dead.name).exists()
    # pruned by a delete, then made again
    backend.put("p/e/0", b"1")
    backend.delete("p/e/0", prune_below="")
    assert not (tmp_path / "p").exists()
    dead = dead_writer_in(tmp_path / "p" / "e")
    backend.put("p/e/1", b"2")
    assert not dead.exists()
    # removed (rmdir), then made again
    backend.put("r/e/0", b"1")
    backend.delete("r/e/0")
    backend.remove_dir("r/e")
    dead = dead_writer_in(tmp_path / "r" / "e")
    backend.put("r/e/1", b"2")
    assert not dead.exists()


def test_a_chunk_read_from_the_page_cache_makes_no_single_flight_mark(tmp_path):
    """A local chunk whose shard's pages are cached is read and kept with
    no await in between (AsyncStore.get_pinned_nowait), so no other reader
    can be fetching it meanwhile and the single flight that shares a fetch
    among readers is skipped: its mark (a trio.Event and a context manager
    per chunk) was about 6 us of a random chunk OPEN's 48 in process
    (docs/PERFORMANCE.md).  A read that takes a thread still marks it."""
    from zshardfs.layouts.zarr_common import ZarrShardFormat
    from zshardfs.shards import ShardCache

    fmt = ZarrShardFormat("end", "little", checksum=True)
    (tmp_path / "s").write_bytes(fmt.encode({0: b"zero", 1: b"one"}, (2,)))
    (tmp_path / "s").read_bytes()  # (its pages cached)

    async def main(nowait: bool) -> list:
        store = AsyncStore(LocalBackend(str(tmp_path)))
        if not nowait:
            store._nowait = None  # (every read in a worker thread, as on S3)
        cache = ShardCache(store)
        marked, loading = [], cache._fetching.loading

        def counted(key):
            marked.append(key)
            return loading(key)

        cache._fetching.loading = counted
        await cache.index(fmt, "s", (2,))
        assert await cache.read_chunk(fmt, "s", 1, (2,)) == b"one"
        assert await cache.read_chunk(fmt, "s", 1, (2,)) == b"one"  # (then a hit)
        return marked

    assert trio.run(main, True) == []
    assert len(trio.run(main, False)) == 1


def test_a_kept_descriptor_answers_nowait_reads_of_its_version_only(tmp_path):
    """A pinned read keeps its descriptor; a nowait read through it answers
    with that version's etag and size (and is counted) until the file is
    rewritten in place (the same inode: only its mtime and size tell), then
    leaves it to the slow path, which fails the pin."""
    b = LocalBackend(str(tmp_path))
    v1 = b.put("s/shard", b"0123456789")
    assert b.get("s/shard", 2, 4, if_match=v1.etag).data == b"2345"  # (keeps its descriptor)
    before = dict(b.counters)
    blob = b.get_nowait("s/shard", 2, 4, v1.etag)
    assert blob.data == b"2345" and (blob.info.key, blob.info.etag, blob.info.size) == ("s/shard", v1.etag, 10)
    assert b.counters["get_range"] == before.get("get_range", 0) + 1
    assert b.counters["bytes_read"] == before.get("bytes_read", 0) + 4
    assert b.get_nowait("s/shard", 0, 10, v1.etag).data == b"0123456789"
    assert b.counters["get"] == before.get("get", 0) + 1
    ino = os.stat(tmp_path / "s/shard").st_ino
    with open(tmp_path / "s/shard", "r+b") as f:  # same inode, same size, another mtime
        f.write(b"abcdefghij")
    os.utime(tmp_path / "s/shard", ns=(v1.mtime_ns + 10**9, v1.mtime_ns + 10**9))
    assert os.stat(tmp_path / "s/shard").st_ino == ino
    assert b.get_nowait("s/shard", 2, 4, v1.etag) is None
    assert b.table_sizes()["kept_fds"] == 0
    with pytest.raises(PreconditionFailed):
        b.get("s/shard", 2, 4, if_match=v1.etag)
