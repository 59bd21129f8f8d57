"""Issue 4 §6: the write path, end to end, through real mounts.

Every test mounts with the real command line (``tests/conftest.py``) and
checks the *backend* afterwards with independent tools: zarr-python reads
the stored (sharded) arrays, and shard indexes are parsed here with numpy
and crc32c, never with zshardfs' own code.  Each test runs against a local
directory and against S3 (moto's stand-alone server over HTTP, whose access
log gives server-side request counts).
"""

from __future__ import annotations

import errno
import functools
import json
import math
import mmap
import os
import signal
import shutil
import stat
import subprocess
import sys
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import crc32c
import numpy as np
import pytest
import zarr

from tests import util
from tests.conftest import ZSHARDFS
from tests.handmade_zarr import shard_bytes
from tests.util import SAVES, assert_below_as_a_scan, event_loop_cpu, process_running, save_as

EMPTY = 2**64 - 1
PREFIX = "store"  # S3: the mounted prefix inside the test bucket


# ---------------------------------------------------------------------------
# the backend, seen directly


class Store:
    """The storage a test mounts, read and written *around* zshardfs."""

    def __init__(self, kind: str, root: Path | None = None, server=None, bucket: str | None = None):
        self.kind = kind
        self.root = root
        self.server = server
        self.bucket = bucket

    @property
    def source(self) -> str:
        return str(self.root) if self.kind == "local" else f"s3://{self.bucket}/{PREFIX}"

    @property
    def extra(self) -> list[str]:
        return [] if self.kind == "local" else ["--endpoint-url", self.server.endpoint_url]

    def keys(self) -> set[str]:
        """Every object (local: every file, hidden ones included)."""
        if self.kind == "local":
            return {str(p.relative_to(self.root)) for p in self.root.rglob("*") if p.is_file()}
        out = set()
        for page in self.server.s3.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=PREFIX + "/"):
            out.update(o["Key"][len(PREFIX) + 1:] for o in page.get("Contents", ()))
        return out

    def get(self, key: str) -> bytes | None:
        if self.kind == "local":
            p = self.root / key
            return p.read_bytes() if p.is_file() else None
        try:
            return self.server.s3.get_object(Bucket=self.bucket, Key=f"{PREFIX}/{key}")["Body"].read()
        except self.server.s3.exceptions.NoSuchKey:
            return None

    def put(self, key: str, data: bytes) -> None:
        if self.kind == "local":
            p = self.root / key
            p.parent.mkdir(parents=True, exist_ok=True)
            p.write_bytes(data)
        else:
            self.server.s3.put_object(Bucket=self.bucket, Key=f"{PREFIX}/{key}", Body=data)

    def put_tree(self, src: Path, under: str) -> None:
        for p in src.rglob("*"):
            if p.is_file():
                self.put(f"{under}/{p.relative_to(src)}", p.read_bytes())

    def local_copy(self, dest: Path) -> Path:
        """A directory zarr-python can open (local: the store itself)."""
        if self.kind == "local":
            return self.root
        for key in self.keys():
            p = dest / key
            p.parent.mkdir(parents=True, exist_ok=True)
            p.write_bytes(self.get(key))
        return dest

    def puts(self, since: int) -> list[str]:
        """S3: object keys of the PUT requests the server received since a mark."""
        return [r.route.split("/", 2)[2][len(PREFIX) + 1:] for r in self.server.requests(since)
                if r.method == "PUT" and r.route.count("/") >= 2]


@pytest.fixture(params=["local", "s3"])
def store(request, tmp_path) -> Store:
    if request.param == "local":
        root = tmp_path / "store"
        root.mkdir()
        return Store("local", root=root)
    server = request.getfixturevalue("moto_server")
    _, bucket = request.getfixturevalue("s3_bucket")
    return Store("s3", server=server, bucket=bucket)


# ---------------------------------------------------------------------------
# helpers


def read_shard(data: bytes, n: int, what: str = "shard") -> dict[int, bytes]:
    """Parse a sharding_indexed shard (index at the end, bytes little endian
    + crc32c) independently of zshardfs; every check failing is an assert."""
    isize = n * 16 + 4
    assert len(data) >= isize, f"{what}: {len(data)} bytes, shorter than its index"
    raw = data[-isize:]
    assert crc32c.crc32c(raw[:-4]) == int.from_bytes(raw[-4:], "little"), f"{what}: index checksum mismatch"
    table = np.frombuffer(raw[:-4], "<u8").reshape(n, 2).tolist()
    out, spans = {}, []
    for cid, (off, nb) in enumerate(table):
        if off == EMPTY and nb == EMPTY:
            continue
        assert off != EMPTY and nb != EMPTY, f"{what}: half-empty entry {cid}"
        assert off + nb <= len(data) - isize, f"{what}: chunk {cid} at {off}+{nb} runs into the index"
        spans.append((off, off + nb))
        out[cid] = data[off: off + nb]
    spans.sort()
    assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:])), f"{what}: overlapping chunks"
    return out


def chunk_name(coords, sep: str) -> str:
    return "c" + sep + sep.join(str(c) for c in coords)


def shard_of(coords, per_shard):
    """(shard coords, chunk id inside the shard in C order)."""
    shard = tuple(c // k for c, k in zip(coords, per_shard))
    pos = tuple(c % k for c, k in zip(coords, per_shard))
    return shard, int(np.ravel_multi_index(pos, per_shard))


def stored_chunks(store: Store, array: str, per_shard, sep: str = "/") -> dict[tuple, bytes]:
    """Every chunk stored in the sharded array ``array`` by its inner
    coordinates, read straight from the backend's shards."""
    n = math.prod(per_shard)
    out = {}
    for key in store.keys():
        if not key.startswith(array + "/c" + sep) or key.endswith((".json", ".__lock")) or ".zshardfs-tmp-" in key:
            continue  # (the local backend's temporaries and lock files, left by a kill -9, are hidden by it)
        shard = tuple(int(p) for p in key[len(array) + 3:].split(sep))
        for cid, data in read_shard(store.get(key), n, key).items():
            pos = np.unravel_index(cid, per_shard)
            out[tuple(int(s * k + p) for s, k, p in zip(shard, per_shard, pos))] = data
    return out


def seed_array(store: Store, tmp_path: Path, path: str, shape, chunks, shards, dtype, *, data=None, sep="/",
               compressors=None, fill_value=0):
    """A sharded array written by zarr-python straight into the backend."""
    local = tmp_path / "seed" / uuid.uuid4().hex
    a = zarr.create_array(store=str(local), shape=shape, chunks=chunks, shards=shards, dtype=dtype,
                          compressors=compressors, fill_value=fill_value,
                          chunk_key_encoding={"name": "default", "separator": sep})
    if data is not None:
        a[...] = data
    store.put_tree(local, path)


def raw_chunk(value: int, shape=(2, 2), dtype="<i4") -> bytes:
    return np.full(shape, value, dtype=dtype).tobytes()


def zs(*args, check=True) -> subprocess.CompletedProcess:
    result = subprocess.run([*ZSHARDFS, *map(str, args)], capture_output=True, text=True, timeout=120)
    if check and result.returncode != 0:
        raise AssertionError(f"zshardfs {' '.join(map(str, args))} failed: {result.stderr}")
    return result


def xstats(m) -> dict:
    """The stats document, fetched without starting a process (for polling)."""
    return json.loads(os.getxattr(m.path, "user.zshardfs.stats"))


def write_file(path, data: bytes, fsync: bool = False) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        os.write(fd, data)
        if fsync:
            os.fsync(fd)
    finally:
        os.close(fd)


def wait_for(cond, timeout: float = 20.0, what: str = "condition"):
    """Like tests.util.wait_for, but a timeout fails the test with ``what``."""
    value = util.wait_for(cond, timeout)
    if not value:
        raise AssertionError(f"timed out waiting for {what}")
    return value


def assert_no_strays(store: Store, allowed) -> None:
    """Nothing but the expected objects: no temporary file of a tool, no
    backend temporary, no stray chunk object."""
    stray = sorted(k for k in store.keys() if k not in allowed)
    assert not stray, f"unexpected objects in the store: {stray}"


# ---------------------------------------------------------------------------
# zarr-python writes an unsharded array into a ``-o shard=K`` mount


ARRAYS = [
    # path, shape, chunks, dtype, compressor, separator
    ("g/a", (10, 7), (4, 3), "int16", zarr.codecs.GzipCodec(level=1), "/"),
    ("g/b", (9, 10, 5), (2, 3, 5), "float32", zarr.codecs.ZstdCodec(level=1), "."),
    ("c", (33,), (5,), "uint8", None, "/"),
    ("d", (6, 6), (3, 3), ">u4", zarr.codecs.ZstdCodec(level=1), "."),
]


def _values(shape, dtype, seed):
    rng = np.random.default_rng(seed)
    v = rng.integers(1, 100, size=shape)  # no chunk is all fill value
    return v.astype(dtype)


def _check_sharded(store: Store, tmp_path: Path, expected: dict[str, np.ndarray], k: int):
    root = store.local_copy(tmp_path / f"copy-{uuid.uuid4().hex}")
    allowed = {"g/zarr.json"}
    for path, shape, chunks, dtype, _, sep in ARRAYS:
        a = zarr.open_array(str(root / path), mode="r")
        per_shard = (k,) * len(shape)
        assert a.shards == tuple(c * k for c in chunks), f"{path} is not stored sharded"
        assert a.chunks == chunks
        doc = json.loads(store.get(f"{path}/zarr.json"))
        assert [c["name"] for c in doc["codecs"]] == ["sharding_indexed"]
        np.testing.assert_array_equal(a[...], expected[path], err_msg=path)
        # every shard parses, and holds exactly the chunks that are not all fill value
        chunks_stored = stored_chunks(store, path, per_shard, sep)
        grid = [math.ceil(s / c) for s, c in zip(shape, chunks)]
        want = set()
        for coords in np.ndindex(*grid):
            block = expected[path][tuple(slice(i * c, (i + 1) * c) for i, c in zip(coords, chunks))]
            if (block != 0).any():
                want.add(tuple(coords))
        assert set(chunks_stored) == want, path
        allowed.add(f"{path}/zarr.json")
        allowed.update(f"{path}/{chunk_name(shard_of(c, per_shard)[0], sep)}" for c in want)
    assert_no_strays(store, allowed)


def test_zarr_python_creates_arrays_in_groups_not_made_yet(store, mount, tmp_path):
    """zarr-python's LocalStore writes the implicit parent groups of a new
    array with an exclusive create: a temporary, ``link`` to the name
    (EEXIST if taken), unlink of the temporary.  A link is made as a copy
    (a new file with the bytes the old one holds), so this works through a
    mount; the store ends with the groups and the sharded array, and no
    temporary."""
    from zarr.core.sync import sync as zarr_sync

    data = np.arange(64, dtype="u1").reshape(8, 8)
    m = mount(store.source, "shard=2", extra=store.extra)
    zarr.create_array(zarr.storage.LocalStore(str(m.path)), name="g/h/a", shape=data.shape, chunks=(2, 2),
                      dtype=data.dtype, fill_value=0, compressors=None)[...] = data
    group_doc = (m / "g/zarr.json").read_bytes()
    # an exclusive create of a name taken leaves it as it was (link: EEXIST)
    zarr_sync(zarr.storage.LocalStore(str(m.path)).set_if_not_exists(
        "g/zarr.json", zarr.core.buffer.default_buffer_prototype().buffer.from_bytes(b"{}")))
    assert (m / "g/zarr.json").read_bytes() == group_doc
    m.umount()
    for group in ("zarr.json", "g/zarr.json", "g/h/zarr.json"):
        assert json.loads(store.get(group))["node_type"] == "group", group
    stored = zarr.open_array(str(store.local_copy(tmp_path / "copy") / "g/h/a"), mode="r")
    assert stored.shards == (4, 4)
    np.testing.assert_array_equal(stored[...], data)
    assert_no_strays(store, {"zarr.json", "g/zarr.json", "g/h/zarr.json", "g/h/a/zarr.json",
                             *(f"g/h/a/c/{i}/{j}" for i in (0, 1) for j in (0, 1))})


def test_links_are_made_as_copies(store, mount, tmp_path):
    """``ln`` (link(2)): the new name holds the bytes the old one held, as a
    file of its own (each has one link; a change of one leaves the other);
    a name taken is EEXIST, a directory EPERM; a chunk linked to another
    chunk's name is written there."""
    seed_array(store, tmp_path, "arr", (4, 4), (2, 2), (4, 4), "u1", data=np.arange(16, dtype="u1").reshape(4, 4))
    store.put("notes.txt", b"first")
    m = mount(store.source, "flush_delay=60", extra=store.extra)
    os.link(m / "notes.txt", m / "copy.txt")
    assert (m / "copy.txt").read_bytes() == b"first"
    assert os.stat(m / "copy.txt").st_nlink == os.stat(m / "notes.txt").st_nlink == 1
    (m / "notes.txt").write_bytes(b"second")
    assert (m / "copy.txt").read_bytes() == b"first"
    with pytest.raises(FileExistsError):
        os.link(m / "notes.txt", m / "copy.txt")
    with pytest.raises(PermissionError):
        os.link(m / "arr", m / "arr2")
    chunk = (m / "arr/c/0/0").read_bytes()
    os.unlink(m / "arr/c/1/1")
    os.link(m / "arr/c/0/0", m / "arr/c/1/1")
    assert (m / "arr/c/1/1").read_bytes() == chunk
    # a rewritten document: the link holds what the view shows, so cp -al
    # of an array makes the array it shows (the stored, sharded document
    # would be refused over the copy's chunk files)
    os.link(m / "arr/zarr.json", m / "arr/zarr.json.bak")
    assert (m / "arr/zarr.json.bak").read_bytes() == (m / "arr/zarr.json").read_bytes()
    out = subprocess.run(["cp", "-al", str(m / "arr"), str(m / "arr2")], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    np.testing.assert_array_equal(zarr.open_array(str(m / "arr2"), mode="r")[...],
                                  zarr.open_array(str(m / "arr"), mode="r")[...])
    m.umount()
    assert store.get("copy.txt") == b"first" and store.get("notes.txt") == b"second"
    chunks = stored_chunks(store, "arr", (2, 2))
    assert chunks[(1, 1)] == chunks[(0, 0)] == chunk


def test_zarr_python_writes_unsharded_into_shard_mount(store, mount, tmp_path):
    m = mount(store.source, "shard=2", extra=store.extra)
    zarr.create_group(store=str(m / "g"))
    expected = {}
    for i, (path, shape, chunks, dtype, compressor, sep) in enumerate(ARRAYS):
        a = zarr.create_array(store=str(m / path), shape=shape, chunks=chunks, dtype=dtype,
                              compressors=compressor, fill_value=0,
                              chunk_key_encoding={"name": "default", "separator": sep})
        expected[path] = _values(shape, dtype, i)
        a[...] = expected[path]
    for path, *_ in ARRAYS:  # the view answers with the new data before anything is flushed
        np.testing.assert_array_equal(zarr.open_array(str(m / path), mode="r")[...], expected[path])
    m.umount()
    _check_sharded(store, tmp_path, expected, 2)

    # overwrite and delete chunks through a new mount
    m2 = mount(store.source, "shard=2", extra=store.extra)
    a = zarr.open_array(str(m2 / "g/a"), mode="r+")
    a[0:4, 0:3] = -5  # overwrite one chunk
    a[4:8, :] = 0  # all fill value: zarr-python deletes these chunks
    expected["g/a"][0:4, 0:3] = -5
    expected["g/a"][4:8, :] = 0
    c = zarr.open_array(str(m2 / "c"), mode="r+")
    c[10:20] = 0  # both chunks of shard 1: the shard object must go
    c[30:33] = 7  # the partial edge chunk
    expected["c"][10:20] = 0
    expected["c"][30:33] = 7
    b = zarr.open_array(str(m2 / "g/b"), mode="r+")
    b[1:8, 2:9, :] = 3.5  # partial updates of many chunks (read-modify-write through the view)
    expected["g/b"][1:8, 2:9, :] = 3.5
    os.unlink(m2 / "d" / "c.1.1")  # a tool removing a chunk file
    expected["d"][3:6, 3:6] = 0
    np.testing.assert_array_equal(zarr.open_array(str(m2 / "g/a"), mode="r")[...], expected["g/a"])
    m2.umount()
    assert store.get("c/c/1") is None
    _check_sharded(store, tmp_path, expected, 2)


# ---------------------------------------------------------------------------
# legacy tools: cp, shell redirection, rm, truncate, pwrite, append, rename


def test_legacy_tools_on_chunk_files(store, mount, tmp_path):
    data = np.arange(64, dtype="<i4").reshape(8, 8)
    for name, sep in (("arr", "/"), ("dot", ".")):
        seed_array(store, tmp_path, name, (8, 8), (2, 2), (4, 4), "<i4", data=data, sep=sep)
    m = mount(store.source, "flush_delay=60", extra=store.extra)
    mark = store.server.mark() if store.kind == "s3" else 0
    src = tmp_path / "src.bin"
    expected = {name: {(i, j): data[2 * i:2 * i + 2, 2 * j:2 * j + 2].tobytes() for i in range(4) for j in range(4)}
                for name in ("arr", "dot")}

    def path(name, i, j):
        return m / name / chunk_name((i, j), "/" if name == "arr" else ".")

    for name in ("arr", "dot"):
        exp = expected[name]
        # cp from outside, and from chunk to chunk
        src.write_bytes(raw_chunk(1000))
        subprocess.run(["cp", src, path(name, 0, 1)], check=True)
        exp[0, 1] = raw_chunk(1000)
        subprocess.run(["cp", path(name, 0, 0), path(name, 3, 3)], check=True)
        exp[3, 3] = exp[0, 0]
        # shell redirection (create-or-truncate) and append
        src.write_bytes(raw_chunk(2000))
        subprocess.run(["sh", "-c", f"cat '{src}' > '{path(name, 1, 0)}'"], check=True)
        exp[1, 0] = raw_chunk(2000)
        subprocess.run(["sh", "-c", f"printf 'tail' >> '{path(name, 1, 0)}'"], check=True)
        exp[1, 0] += b"tail"
        # rm
        subprocess.run(["rm", path(name, 1, 1)], check=True)
        del exp[1, 1]
        assert not path(name, 1, 1).exists()
        # truncate, shorter and longer
        subprocess.run(["truncate", "-s", "6", path(name, 2, 0)], check=True)
        exp[2, 0] = exp[2, 0][:6]
        subprocess.run(["truncate", "-s", "20", path(name, 2, 1)], check=True)
        exp[2, 1] = exp[2, 1] + b"\0" * 4
        # a partial write at an offset, and reading it back while it is dirty
        fd = os.open(path(name, 2, 2), os.O_RDWR)
        try:
            assert os.pwrite(fd, b"\xff\xfe", 5) == 2
            exp[2, 2] = exp[2, 2][:5] + b"\xff\xfe" + exp[2, 2][7:]
            assert os.pread(fd, 100, 0) == exp[2, 2]
            assert path(name, 2, 2).read_bytes() == exp[2, 2]  # another open file, same mount
            assert os.stat(path(name, 2, 2)).st_size == 16
        finally:
            os.close(fd)
        # a chunk that did not exist (its slot was removed above) comes back
        write_file(path(name, 1, 1), b"new")
        exp[1, 1] = b"new"
        # zarr-python 2 DirectoryStore: temporary beside the chunk, then os.replace
        final = path(name, 3, 2)
        tmp = final.parent / f".{final.name}.{uuid.uuid4().hex}.partial"
        tmp.write_bytes(raw_chunk(3000))
        assert tmp.read_bytes() == raw_chunk(3000)
        os.replace(tmp, final)
        exp[3, 2] = raw_chunk(3000)
        assert not tmp.exists()
        # zarr-python 3 LocalStore style (Path.with_suffix: in the array root for
        # '.'), held open longer than the metadata TTL before the rename
        final = path(name, 0, 2)
        tmp = final.with_suffix(f".{uuid.uuid4().hex}.partial")
        with open(tmp, "wb") as f:
            f.write(raw_chunk(4000))
            time.sleep(1.2)
        os.replace(tmp, final)
        exp[0, 2] = raw_chunk(4000)
        # a temporary that is removed instead of renamed
        junk = final.parent / f".junk.{uuid.uuid4().hex}.partial"
        junk.write_bytes(b"junk")
        junk.unlink()

    for name in ("arr", "dot"):
        for i in range(4):
            for j in range(4):
                p = path(name, i, j)
                if (i, j) in expected[name]:
                    assert p.read_bytes() == expected[name][i, j], (name, i, j)
                else:
                    assert not p.exists(), (name, i, j)
    m.umount()
    if store.kind == "s3":  # temporaries never reached storage, not even for a while
        touched = [r for r in store.server.requests(mark)
                   if r.method in ("PUT", "POST", "DELETE") and (".partial" in r.path or "junk" in r.path)]
        assert not touched, "\n".join(f"{r.method} {r.path}" for r in touched)

    allowed = set()
    for name, sep in (("arr", "/"), ("dot", ".")):
        assert stored_chunks(store, name, (2, 2), sep) == expected[name], name
        allowed.add(f"{name}/zarr.json")
        allowed.update(f"{name}/{chunk_name((i, j), sep)}" for i in range(2) for j in range(2))
    assert_no_strays(store, allowed)
    # and a new mount shows the same
    m2 = mount(store.source, "ro", extra=store.extra)
    for name in ("arr", "dot"):
        for (i, j), content in expected[name].items():
            assert (m2 / name / chunk_name((i, j), "/" if name == "arr" else ".")).read_bytes() == content


# ---------------------------------------------------------------------------
# concurrency inside one mount


WRITER = r"""
import json, os, sys
jobs = json.loads(sys.stdin.readline())
print("ready", flush=True)
sys.stdin.readline()  # go
for path, hexdata, fsync in jobs:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        os.write(fd, bytes.fromhex(hexdata))
        if fsync:
            os.fsync(fd)
    finally:
        os.close(fd)
"""


def test_threads_and_processes_write_one_shard(store, mount, tmp_path):
    """64 chunks of one shard, each written twice, by 6 threads and 2
    processes at once, while the flusher runs every 50 ms: nothing is lost."""
    seed_array(store, tmp_path, "arr", (16, 16), (2, 2), (16, 16), "<i4")
    m = mount(store.source, "flush_delay=0.05", extra=store.extra)
    coords = [(i, j) for i in range(8) for j in range(8)]
    final = {c: raw_chunk(c[0] * 100 + c[1] + 1) for c in coords}
    groups = [[] for _ in range(8)]  # each writer owns 8 chunks and writes them twice, in order
    for rnd in range(2):
        for n, c in enumerate(coords):
            content = final[c] if rnd else raw_chunk(-1 - n) + b"first"
            groups[n % 8].append((str(m / "arr" / chunk_name(c, "/")), content.hex(), n % 3 == 0))
    procs = [subprocess.Popen([sys.executable, "-c", WRITER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              text=True) for _ in range(2)]
    for p, g in zip(procs, groups[:2]):
        p.stdin.write(json.dumps(g) + "\n")
        p.stdin.flush()
    for p in procs:
        assert p.stdout.readline().strip() == "ready"
    for p in procs:
        p.stdin.write("go\n")
        p.stdin.close()

    def thread_writer(group):
        for path, hexdata, fsync in group:
            write_file(path, bytes.fromhex(hexdata), fsync)

    with ThreadPoolExecutor(6) as pool:
        list(pool.map(thread_writer, groups[2:]))
    for p in procs:
        assert p.wait(60) == 0
    for c in coords:
        assert (m / "arr" / chunk_name(c, "/")).read_bytes() == final[c], c
    m.umount()
    assert stored_chunks(store, "arr", (8, 8)) == final
    assert_no_strays(store, {"arr/zarr.json", "arr/c/0/0"})


# ---------------------------------------------------------------------------
# two mounts, one shard


def test_moto_honours_conditional_put(moto_server, s3_bucket):
    """What the two-mount test relies on: moto answers If-Match and
    If-None-Match on PUT (and If-Match on DELETE) like S3."""
    s3, bucket = moto_server.s3, s3_bucket[1]
    v1 = s3.put_object(Bucket=bucket, Key="k", Body=b"1")["ETag"]
    v2 = s3.put_object(Bucket=bucket, Key="k", Body=b"2", IfMatch=v1)["ETag"]
    for kwargs in ({"IfMatch": v1}, {"IfNoneMatch": "*"}):
        with pytest.raises(s3.exceptions.ClientError) as info:
            s3.put_object(Bucket=bucket, Key="k", Body=b"3", **kwargs)
        assert info.value.response["ResponseMetadata"]["HTTPStatusCode"] == 412
    with pytest.raises(s3.exceptions.ClientError) as info:
        s3.put_object(Bucket=bucket, Key="absent", Body=b"3", IfMatch=v2)
    assert info.value.response["ResponseMetadata"]["HTTPStatusCode"] == 404
    with pytest.raises(s3.exceptions.ClientError) as info:
        s3.delete_object(Bucket=bucket, Key="k", IfMatch=v1)
    assert info.value.response["ResponseMetadata"]["HTTPStatusCode"] == 412
    assert s3.get_object(Bucket=bucket, Key="k")["Body"].read() == b"2"


def test_two_mounts_write_one_shard(store, mount, tmp_path):
    """Two daemons on one store, each fsyncing its own chunks of one shard
    at once: every flush races the other mount's, and none loses a chunk."""
    seed_array(store, tmp_path, "arr", (16, 16), (2, 2), (16, 16), "<i4")
    m1 = mount(store.source, "flush_delay=0.05", extra=store.extra)
    m2 = mount(store.source, "flush_delay=0.05", extra=store.extra)
    coords = [(i, j) for i in range(8) for j in range(8)]
    final = {c: raw_chunk(c[0] * 100 + c[1] + 1) for c in coords}
    barrier = threading.Barrier(4)

    def writer(mnt, mine):
        barrier.wait()
        for c in mine:
            write_file(mnt / "arr" / chunk_name(c, "/"), final[c], fsync=True)

    with ThreadPoolExecutor(4) as pool:
        futures = [pool.submit(writer, mnt, coords[k::4]) for k, mnt in enumerate((m1, m2, m1, m2))]
        for f in futures:
            f.result()
    conflicts = xstats(m1)["precondition_failed"] + xstats(m2)["precondition_failed"]
    m1.umount()
    m2.umount()
    assert stored_chunks(store, "arr", (8, 8)) == final
    # the race was real: some conditional writes found the other mount's version
    assert conflicts > 0


# ---------------------------------------------------------------------------
# kill -9 during a write storm


STORM = r"""
import json, os, random, sys, threading
mnt, out, seed = sys.argv[1], sys.argv[2], int(sys.argv[3])
coords = [(i, j) for i in range(32) for j in range(32)]
random.Random(seed).shuffle(coords)
lock = threading.Lock()
log = open(out, "a")

def work(part):
    for n, (i, j) in enumerate(part):
        data = (b"%04d-%04d:" % (i, j)) * (1 + (i * 7 + j) % 50)
        fsync = n % 2 == 0
        try:
            fd = os.open(f"{mnt}/arr/c/{i}/{j}", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            with lock:
                log.write(json.dumps(["start", i, j, len(data)]) + "\n"); log.flush()
            try:
                os.write(fd, data)
                if fsync:
                    os.fsync(fd)
                    with lock:
                        log.write(json.dumps(["fsynced", i, j, len(data)]) + "\n"); log.flush()
            finally:
                os.close(fd)
        except OSError:
            return

threads = [threading.Thread(target=work, args=(coords[k::4],)) for k in range(4)]
for t in threads: t.start()
for t in threads: t.join()
"""


def test_kill_9_during_write_storm(store, mount, tmp_path):
    seed_array(store, tmp_path, "arr", (64, 64), (2, 2), (16, 16), "<i4")
    m = mount(store.source, "flush_delay=0.1", extra=store.extra)
    pid = int(os.getxattr(m.path, "user.zshardfs.pid"))
    record = tmp_path / "storm.jsonl"
    writer = subprocess.Popen([sys.executable, "-c", STORM, str(m.path), str(record), "7"])
    try:
        wait_for(lambda: record.exists() and record.read_text().count("fsynced") >= 40, 60, "fsynced writes")
        time.sleep(0.3)
        os.kill(pid, signal.SIGKILL)
        wait_for(lambda: not process_running(pid), 10, "the daemon to die")
        writer.wait(60)
    finally:
        if writer.poll() is None:
            writer.kill()
        subprocess.run(["fusermount3", "-uz", str(m.path)], capture_output=True)
        m.mounted = False
    events = [json.loads(line) for line in record.read_text().splitlines()]
    fsynced = {(i, j): n for kind, i, j, n in events if kind == "fsynced"}
    started = {(i, j) for kind, i, j, n in events}
    assert len(fsynced) >= 40

    # every shard parses (checksum, bounds, no overlap) ...
    chunks = stored_chunks(store, "arr", (8, 8))

    def content(i, j):
        return (b"%04d-%04d:" % (i, j)) * (1 + (i * 7 + j) % 50)

    # ... every fsynced chunk is there with its content, and nothing else is
    # there but chunks a writer opened, in a state they had: just created
    # (O_TRUNC, flushed by a sibling's fsync) or whole
    for c in fsynced:
        assert chunks.get(c) == content(*c), c
    for c, data in chunks.items():
        assert c in started and data in (b"", content(*c)), c
    internal = [k for k in store.keys() if k != "arr/zarr.json" and not k.startswith("arr/c/")]
    assert all(".zshardfs-tmp-" in k for k in internal), internal
    assert all(store.get(k) == b"" for k in store.keys() if k.endswith(".__lock"))  # (empty locks only)

    # a new mount reads the store (and its log stays free of tracebacks)
    m2 = mount(store.source, "ro", extra=store.extra)
    for c in list(fsynced)[:20]:
        assert (m2 / "arr" / chunk_name(c, "/")).read_bytes() == content(*c)


# ---------------------------------------------------------------------------
# one PUT per shard per flush


def test_one_put_per_shard_per_flush(store, mount, tmp_path):
    seed_array(store, tmp_path, "arr", (8, 12), (2, 2), (4, 4), "<i4")  # 2 x 3 shards of 2 x 2 chunks
    m = mount(store.source, "flush_delay=60", extra=store.extra)

    def chunk(i, j):
        return m / "arr" / chunk_name((i, j), "/")

    def phase(writes, want_shards):
        mark = store.server.mark() if store.kind == "s3" else 0
        before = m.stats()
        if callable(writes):
            writes()
        for (i, j), value in [] if callable(writes) else writes:
            write_file(chunk(i, j), raw_chunk(value))
        zs("sync", m.path)
        after = m.stats()
        assert after["requests"]["put"] - before["requests"]["put"] == len(want_shards)
        assert after["writeback"]["flushes"] - before["writeback"]["flushes"] == len(want_shards)
        assert after["writeback"]["dirty_bytes"] == 0
        if store.kind == "s3":
            assert sorted(store.puts(mark)) == sorted(f"arr/c/{s}/{t}" for s, t in want_shards)

    # all chunks of 3 shards (complete shards flush as soon as they are complete)
    phase([((i, j), 10 * i + j) for i in range(4) for j in range(6) if (i // 2, j // 2) in ((0, 0), (0, 1), (1, 2))],
          [(0, 0), (0, 1), (1, 2)])
    # part of 3 other shards, nothing of it written before the sync
    phase([((i, j), 100 + 10 * i + j) for i, j in ((0, 4), (1, 5), (2, 0), (3, 1), (2, 2), (3, 3))],
          [(0, 2), (1, 0), (1, 1)])
    # the same chunk written many times between two syncs is one PUT of its shard
    phase([((0, 0), v) for v in range(5)] + [((2, 2), v) for v in range(5)], [(0, 0), (1, 1)])

    def fsync_while_open():  # stored by the fsync: the syncs after it have nothing to write
        fd = os.open(chunk(3, 5), os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        try:
            os.write(fd, raw_chunk(55))
            os.fsync(fd)
            zs("sync", m.path)
        finally:
            os.close(fd)

    phase(fsync_while_open, [(1, 2)])
    m.umount()
    got = stored_chunks(store, "arr", (2, 2))
    assert got[0, 0] == raw_chunk(4) and got[2, 2] == raw_chunk(4) and got[1, 5] == raw_chunk(115)
    assert got[3, 5] == raw_chunk(55)
    assert len(got) == 18


# ---------------------------------------------------------------------------
# unmount and SIGTERM flush


@pytest.mark.parametrize("how", ["umount", "sigterm"])
def test_stop_flushes_dirty_data(store, mount, tmp_path, how):
    seed_array(store, tmp_path, "arr", (8, 8), (2, 2), (4, 4), "<i4")
    m = mount(store.source, "flush_delay=60", extra=store.extra)
    for i, j in ((0, 0), (1, 3), (3, 3)):
        write_file(m / "arr" / chunk_name((i, j), "/"), raw_chunk(i * 10 + j + 1))
    assert m.stats()["writeback"]["dirty_bytes"] == 48
    assert store.keys() == {"arr/zarr.json"}  # nothing stored yet: the stop must do it
    if how == "umount":
        m.umount()
    else:
        pid = int(os.getxattr(m.path, "user.zshardfs.pid"))
        os.kill(pid, signal.SIGTERM)
        wait_for(lambda: not process_running(pid), 30, "the daemon to exit")
        assert not os.path.ismount(m.path)
        m.mounted = False
        assert "SIGTERM" in m.log_text()
    assert stored_chunks(store, "arr", (2, 2)) == {(i, j): raw_chunk(i * 10 + j + 1) for i, j in ((0, 0), (1, 3), (3, 3))}


def test_an_unmount_from_outside_stores_what_needs_a_listing(store, mount, tmp_path):
    """``fusermount3 -u`` (or root's ``umount``) ends the FUSE loop before
    anything is stored: the final sync runs after the daemon's nursery has
    closed.  Storing a document emptied after its removal (``rm zarr.json;
    : > zarr.json``) lists the array, which with read-ahead on started work
    in that closed nursery: the final sync failed, round after round, and
    the daemon never exited."""
    seed_array(store, tmp_path, "arr", (8, 8), (2, 2), (4, 4), "<i4", data=np.ones((8, 8), "<i4"))
    m = mount(store.source, "flush_delay=60", "prefetch_ahead=1M", extra=store.extra)
    pid = int(os.getxattr(m.path, "user.zshardfs.pid"))
    os.unlink(m / "arr" / "zarr.json")
    os.close(os.open(m / "arr" / "zarr.json", os.O_WRONLY | os.O_CREAT | os.O_TRUNC))
    subprocess.run(["fusermount3", "-u", str(m.path)], check=True)
    m.mounted = False
    try:
        wait_for(lambda: not process_running(pid), 30, "the daemon to exit")
    finally:
        if process_running(pid):
            os.kill(pid, signal.SIGKILL)
    log = m.log_text()
    assert "not stored yet" not in log and "Traceback" not in log, log
    assert store.get("arr/zarr.json") == b""


# ---------------------------------------------------------------------------
# flush failures


def test_flush_failure_eio_keeps_data(store, mount, tmp_path):
    seed_array(store, tmp_path, "arr", (8, 8), (2, 2), (4, 4), "<i4")
    m = mount(store.source, "flush_delay=60", extra=store.extra)
    chunk = m / "arr" / chunk_name((0, 1), "/")
    saved = None

    def break_storage():
        nonlocal saved
        if store.kind == "local":
            (store.root / "arr" / "c").write_bytes(b"a file where the shard directory must go")
        else:
            saved = store.server.snapshot([store.bucket])
            store.server.kill()

    def repair_storage():
        if store.kind == "local":
            (store.root / "arr" / "c").unlink()
        else:
            store.server.start()
            store.server.restore(saved)

    fd = os.open(chunk, os.O_RDWR | os.O_CREAT | os.O_TRUNC)
    try:
        os.write(fd, raw_chunk(77))
        break_storage()
        try:
            with pytest.raises(OSError) as info:
                os.fsync(fd)
            assert info.value.errno == errno.EIO
            assert os.pread(fd, 100, 0) == raw_chunk(77)  # kept
            os.pwrite(fd, b"\x01", 0)  # and still writable
        finally:
            os.close(fd)
        assert chunk.read_bytes() == b"\x01" + raw_chunk(77)[1:]
        assert zs("sync", m.path, check=False).returncode != 0
        refused = zs("umount", m.path, check=False)
        assert refused.returncode != 0 and os.path.ismount(m.path), "umount must not drop unstored data"
        assert m.stats()["writeback"]["flush_errors"] >= 2
    finally:
        repair_storage()
    # a later sync stores it (AsyncStore does not repeat an unanswered call
    # for FAIL_FAST seconds, so the first try right after the repair may fail)
    wait_for(lambda: zs("sync", m.path, check=False).returncode == 0, 15, "a sync after the repair")
    assert m.stats()["writeback"]["dirty_bytes"] == 0
    assert stored_chunks(store, "arr", (2, 2)) == {(0, 1): b"\x01" + raw_chunk(77)[1:]}
    assert "flush of arr/c/0/0 failed" in m.log_text()
    m.umount()


def _point_past_the_end(store: Store, key: str, n: int, entry: int) -> bytes:
    """Shard ``key`` (``n`` chunks, index at the end with its crc32c) with
    index entry ``entry`` pointed past the end of the file, the checksum
    recomputed (the index itself is valid); returns the damaged bytes."""
    raw = store.get(key)
    isize = n * 16 + 4
    table = np.frombuffer(raw[-isize:-4], "<u8").reshape(n, 2).copy()
    table[entry] = (len(raw) + 100, 8)
    index = table.astype("<u8").tobytes()
    damaged = raw[:-isize] + index + crc32c.crc32c(index).to_bytes(4, "little")
    store.put(key, damaged)
    return damaged


def test_a_change_of_a_shard_that_cannot_be_rewritten_is_refused_at_once(store, mount, tmp_path):
    """A write into a shard whose index points past its end (a rewrite
    would lose that chunk: the flush refuses it) was accepted, then EIO at
    fsync, kept and retried for ever: ``zshardfs umount`` refused for ever.
    Now the open (O_TRUNC, create, truncate, unlink, a rename onto or away)
    is EIO at once with the shard's one damage line, nothing is kept, the
    umount succeeds; and the check costs undamaged shards no request."""
    data = np.arange(64, dtype="<i4").reshape(8, 8)
    seed_array(store, tmp_path, "arr", (8, 8), (2, 2), (4, 4), "<i4", data=data)
    damaged = _point_past_the_end(store, "arr/c/0/0", 4, 1)  # chunk (0, 1) of shard (0, 0)
    m = mount(store.source, "flush_delay=60", extra=store.extra)
    c = m / "arr" / "c"
    os.stat(c / "1/1")  # (as a writer's lookup does: the shard's index is known)
    for what, act in (("O_TRUNC", lambda: os.open(c / "1/1", os.O_WRONLY | os.O_TRUNC)),
                      ("O_RDWR", lambda: os.open(c / "1/0", os.O_RDWR)),
                      ("truncate", lambda: os.truncate(c / "0/0", 0)),
                      ("unlink", lambda: os.unlink(c / "1/0")),
                      ("rename onto", lambda: os.rename(c / "2/2", c / "1/1")),
                      ("rename away", lambda: os.rename(c / "1/1", c / "3/3"))):
        with pytest.raises(OSError) as info:
            fd = act()
            os.close(fd) if isinstance(fd, int) else None
        assert info.value.errno == errno.EIO, what
    assert m.stats()["writeback"]["dirty_bytes"] == 0
    lines = [line for line in m.log_text().splitlines() if "damaged data" in line]
    assert len(lines) == 1 and "arr/c/0/0" in lines[0] and "past the end" in lines[0], lines
    # another shard's write lands, and costs no request beyond the open's (its index is known)
    os.stat(c / "2/3")
    before = xstats(m)["requests"]
    write_file(c / "2/3", raw_chunk(23))
    after = xstats(m)["requests"]
    assert [after[k] - before[k] for k in ("get", "get_range", "list", "put")] == [0, 0, 0, 0], (before, after)
    zs("umount", m.path)  # (refused for ever before: the write was kept)
    m.mounted = False
    assert store.get("arr/c/0/0") == damaged
    got = read_shard(store.get("arr/c/1/1"), 4)  # (chunks (2, 2) and (2, 3) are its 0 and 1)
    assert got[1] == raw_chunk(23) and got[0] == data[4:6, 4:6].tobytes()


def test_a_damaged_chunk_is_repaired_by_removing_or_overwriting_it(store, mount, tmp_path):
    """A chunk whose own index entry points past the end of its shard was EIO
    at its lookup, so ``rm`` of it and ``cp good.bin`` onto it failed before
    they reached the view, though a rewrite that drops or replaces exactly
    that entry loses nothing.  Now it is found (size 0, not listed; reading
    it, an open for writing that keeps its bytes, a truncate or a rename of
    it are EIO; a truncate to 0 is not), and its unlink
    or an ``O_TRUNC`` write of it is stored: the shard reads clean, its other
    chunks byte for byte.  A change of another chunk of such a shard is
    still refused (the rewrite would have to keep the damaged entry)."""
    data = np.arange(1, 65, dtype="<i4").reshape(8, 8)
    seed_array(store, tmp_path, "arr", (8, 8), (2, 2), (4, 4), "<i4", data=data)
    _point_past_the_end(store, "arr/c/0/0", 4, 1)  # chunk (0, 1) of shard (0, 0)
    _point_past_the_end(store, "arr/c/1/1", 4, 3)  # chunk (3, 3) of shard (1, 1)
    untouched = {k: store.get(k) for k in ("arr/c/0/1", "arr/c/1/0")}
    m = mount(store.source, "flush_delay=60", extra=store.extra)
    c = m / "arr" / "c"
    for bad in ("0/1", "3/3"):
        assert os.stat(c / bad).st_size == 0, bad  # (was EIO: rm and cp stopped there)
        for what, act in (("read", lambda: (c / bad).read_bytes()),
                          ("O_RDWR", lambda: os.close(os.open(c / bad, os.O_RDWR))),
                          ("O_APPEND", lambda: os.close(os.open(c / bad, os.O_WRONLY | os.O_APPEND))),
                          ("truncate", lambda: os.truncate(c / bad, 1)),
                          ("rename away", lambda: os.rename(c / bad, c / "2/0"))):
            with pytest.raises(OSError) as info:
                act()
            assert info.value.errno == errno.EIO, (bad, what)
    assert sorted(os.listdir(c / "0")) == ["0", "2", "3"] and sorted(os.listdir(c / "3")) == ["0", "1", "2"]
    for what, act in (("another chunk's write", lambda: write_file(c / "1/1", raw_chunk(5))),
                      ("another chunk's unlink", lambda: os.unlink(c / "2/2"))):
        with pytest.raises(OSError) as info:
            act()
        assert info.value.errno == errno.EIO, what
    assert m.stats()["writeback"]["dirty_bytes"] == 0
    good = tmp_path / "good.bin"
    good.write_bytes(raw_chunk(33))
    os.truncate(c / "0/1", 0)  # (to 0 by path needs no old bytes, as O_TRUNC: was EIO)
    assert os.stat(c / "0/1").st_size == 0 and (c / "0/1").read_bytes() == b""
    subprocess.run(["rm", str(c / "0/1")], check=True, capture_output=True)
    subprocess.run(["cp", str(good), str(c / "3/3")], check=True, capture_output=True)
    assert not (c / "0/1").exists() and (c / "3/3").read_bytes() == raw_chunk(33)
    write_file(c / "1/1", raw_chunk(11))  # (the damaged entry is dropped by the same rewrite: no longer refused)
    zs("sync", m.path)
    assert m.stats()["writeback"]["dirty_bytes"] == 0
    assert sorted(os.listdir(c / "0")) == ["0", "2", "3"] and sorted(os.listdir(c / "3")) == ["0", "1", "2", "3"]
    lines = [line for line in m.log_text().splitlines() if "damaged data" in line]
    assert len(lines) == 2 and all("past the end" in line for line in lines), lines
    zs("umount", m.path)
    m.mounted = False
    expected = data.copy()
    expected[0:2, 2:4] = 0
    expected[6:8, 6:8] = 33
    expected[2:4, 2:4] = 11
    a = zarr.open_array(str(store.local_copy(tmp_path / "copy") / "arr"), mode="r")
    np.testing.assert_array_equal(a[...], expected)
    got = read_shard(store.get("arr/c/0/0"), 4)
    assert got == {0: data[0:2, 0:2].tobytes(), 2: data[2:4, 0:2].tobytes(), 3: raw_chunk(11)}
    got = read_shard(store.get("arr/c/1/1"), 4)
    assert got == {0: data[4:6, 4:6].tobytes(), 1: data[4:6, 6:8].tobytes(), 2: data[6:8, 4:6].tobytes(),
                   3: raw_chunk(33)}
    assert {k: store.get(k) for k in untouched} == untouched


# ---------------------------------------------------------------------------
# metadata documents


def test_metadata_rewrites_map_back(store, mount, tmp_path):
    data = np.arange(64, dtype="<i4").reshape(8, 8) + 1
    seed_array(store, tmp_path, "arr", (8, 8), (2, 2), (4, 4), "<i4", data=data,
               compressors=zarr.codecs.GzipCodec(level=1))
    m = mount(store.source, extra=store.extra)
    doc_path = m / "arr" / "zarr.json"
    view = json.loads(doc_path.read_text())
    assert view["chunk_grid"]["configuration"]["chunk_shape"] == [2, 2]
    stored_before = store.get("arr/zarr.json")

    # refused: the inner codecs and the inner chunk shape
    for change in ({"codecs": [{"name": "bytes", "configuration": {"endian": "little"}}]},
                   {"chunk_grid": {"name": "regular", "configuration": {"chunk_shape": [4, 2]}}}):
        with pytest.raises(PermissionError):
            with open(doc_path, "w") as f:
                json.dump({**view, **change}, f)
        assert store.get("arr/zarr.json") == stored_before
        assert json.loads(doc_path.read_text()) == view  # the view still shows the stored document
    assert m.log_text().count("refused to store arr/zarr.json") == 2

    # attributes (zarr-python), fill value (an editor), shape (zarr-python resize)
    a = zarr.open_array(str(m / "arr"), mode="r+")
    a.attrs["note"] = "hello"
    edited = json.loads(doc_path.read_text())
    assert edited["attributes"] == {"note": "hello"}
    edited["fill_value"] = 7
    doc_path.write_text(json.dumps(edited))
    zarr.open_array(str(m / "arr"), mode="r+").resize((12, 8))
    view = json.loads(doc_path.read_text())
    assert view["shape"] == [12, 8] and view["fill_value"] == 7 and view["attributes"] == {"note": "hello"}
    assert view["codecs"][-1]["name"] == "gzip"
    m.umount()

    stored = json.loads(store.get("arr/zarr.json"))
    assert stored["shape"] == [12, 8] and stored["fill_value"] == 7 and stored["attributes"] == {"note": "hello"}
    assert [c["name"] for c in stored["codecs"]] == ["sharding_indexed"]
    assert stored["chunk_grid"]["configuration"]["chunk_shape"] == [4, 4]
    b = zarr.open_array(str(store.local_copy(tmp_path / "copy") / "arr"), mode="r")
    assert b.shards == (4, 4)
    np.testing.assert_array_equal(b[:8], data)
    np.testing.assert_array_equal(b[8:], 7)

    # deleting zarr.json deletes it
    m2 = mount(store.source, extra=store.extra)
    os.unlink(m2 / "arr" / "zarr.json")
    assert not (m2 / "arr" / "zarr.json").exists()
    assert store.get("arr/zarr.json") is None
    m2.umount()


def test_documents_of_the_wrong_shape_written_through_the_view(store, mount, tmp_path):
    """JSON that is no valid array document: over a sharded array it is
    refused (it would hide the chunks), elsewhere stored as written, as
    unparseable JSON is; either way one log line, and sync goes on to
    store everything else."""
    data = np.arange(64, dtype="<i4").reshape(8, 8) + 1
    seed_array(store, tmp_path, "arr", (8, 8), (2, 2), (4, 4), "<i4", data=data)
    m = mount(store.source, "flush_delay=60", "shard=2", extra=store.extra)
    write_file(m / "arr" / "c" / "0" / "1", raw_chunk(99))  # dirty, not stored until sync
    stored_before = store.get("arr/zarr.json")
    view = json.loads((m / "arr" / "zarr.json").read_text())
    with pytest.raises(PermissionError):
        (m / "arr" / "zarr.json").write_text(json.dumps({**view, "codecs": ["sharding_indexed"]}))
    assert store.get("arr/zarr.json") == stored_before
    (m / "bad").mkdir()
    odd = {"zarr_format": 3, "node_type": "array", "shape": [4], "chunk_grid": "regular", "data_type": "uint8"}
    (m / "bad" / "zarr.json").write_text(json.dumps(odd))
    zs("sync", m.path)
    assert json.loads(store.get("bad/zarr.json")) == odd
    assert stored_chunks(store, "arr", (2, 2))[(0, 1)] == raw_chunk(99)
    m.umount()
    assert m.log_text().count("refused to store arr/zarr.json") == 1


def test_sync_fails_when_it_refused_a_document(store, mount, tmp_path):
    """A document still open for writing when ``zshardfs sync`` runs, whose
    text the stored chunks cannot live with, is refused then: sync says so
    (EPERM) instead of answering 0 while the daemon logs an ERROR;
    everything else is stored, and the next sync succeeds."""
    data = np.arange(64, dtype="<i4").reshape(8, 8) + 1
    seed_array(store, tmp_path, "arr", (8, 8), (2, 2), (4, 4), "<i4", data=data)
    m = mount(store.source, "flush_delay=60", extra=store.extra)
    write_file(m / "arr" / "c" / "0" / "1", raw_chunk(99))
    view = json.loads((m / "arr" / "zarr.json").read_text())
    stored_before = store.get("arr/zarr.json")
    with open(m / "arr" / "zarr.json", "w") as f:
        f.write(json.dumps({**view, "codecs": ["sharding_indexed"]}))
        f.flush()
        # what `zshardfs sync` asks, from this process: a child process
        # would close its copy of the descriptor first, and that close
        # (FLUSH) stores the document before the sync
        with pytest.raises(PermissionError):
            os.getxattr(m.path, "user.zshardfs.sync")
    assert store.get("arr/zarr.json") == stored_before
    assert stored_chunks(store, "arr", (2, 2))[(0, 1)] == raw_chunk(99)
    zs("sync", m.path)
    np.testing.assert_array_equal(zarr.open_array(str(m / "arr"), mode="r")[0:2, 0:2], [[1, 2], [9, 10]])
    m.umount()
    assert m.log_text().count("refused to store arr/zarr.json") == 1


def test_closed_files_leave_no_handle_behind(store, mount, tmp_path):
    """Every open file's handle goes at its close: read-only opens of chunk
    files on a writable mount (which an unlink must know about while they
    are open) included, so reading a chunk over and over costs no memory."""
    seed_array(store, tmp_path, "arr", (8, 8), (2, 2), (4, 4), "<i4", data=np.ones((8, 8), "<i4"))
    m = mount(store.source, extra=store.extra)
    for _ in range(50):
        (m / "arr" / "c" / "0" / "1").read_bytes()
    with open(m / "arr" / "c" / "1" / "1", "rb") as f:
        f.read()
        assert util.wait_for(lambda: xstats(m)["handles"] == {"open": 1, "tracked": 1})
    write_file(m / "arr" / "c" / "0" / "0", raw_chunk(3))
    assert util.wait_for(lambda: xstats(m)["handles"] == {"open": 0, "tracked": 0}), xstats(m)["handles"]


def test_files_too_large_to_hold_are_refused(store, mount, tmp_path):
    seed_array(store, tmp_path, "arr", (8, 8), (2, 2), (4, 4), "<i4", data=np.ones((8, 8), "<i4"))
    m = mount(store.source, extra=store.extra)
    for path in (m / "notes.txt", m / "arr" / "c" / "0" / "1"):
        with open(path, "ab") as f:
            with pytest.raises(OSError) as info:
                os.truncate(f.fileno(), 100 << 30)
        assert info.value.errno == errno.EFBIG
        fd = os.open(path, os.O_WRONLY | os.O_CREAT)
        try:
            with pytest.raises(OSError) as info:
                os.pwrite(fd, b"x", 5 << 30)
            assert info.value.errno == errno.EFBIG
        finally:
            os.close(fd)
    assert (m / "arr" / "c" / "0" / "1").read_bytes() == np.ones((2, 2), "<i4").tobytes()
    m.umount()
    assert sum("more than a file written through the view may hold" in line
               for line in m.log_text().splitlines()) == 4  # one per refusal


def test_a_new_sharded_array_written_through_the_view_is_refused(store, mount, tmp_path):
    """zarr-python creating a *sharded* array inside the mount would write
    shard objects under chunk names: the view would store them as chunks
    (corrupt data). Its zarr.json is refused instead (EPERM, one log line)
    and nothing is stored; an unsharded array is stored as usual."""
    seed_array(store, tmp_path, "s", (8, 8), (2, 2), (4, 4), "<i4")
    sharded_doc = store.get("s/zarr.json")
    m = mount(store.source, extra=store.extra)
    with pytest.raises(PermissionError):
        zarr.create_array(str(m / "x"), shape=(8, 8), chunks=(2, 2), shards=(4, 4), dtype="<i4")
    zarr.create_array(str(m / "y"), shape=(8, 8), chunks=(2, 2), dtype="<i4")[:] = 5
    # neither an empty chunk directory (rsync makes c/ first) nor plain chunk
    # objects below make it a restore: only shards of that document do
    os.makedirs(m / "w" / "c" / "0")
    zarr.create_array(str(m / "z"), shape=(8, 8), chunks=(2, 2), dtype="<i4")[:] = 6
    # (plain chunks larger than an index without a checksum: they "load" as one)
    zarr.create_array(str(m / "u"), shape=(16, 16), chunks=(8, 8), dtype="<i4", compressors=None)[:] = 6
    zs("sync", m.path)
    os.unlink(m / "z" / "zarr.json")
    os.unlink(m / "u" / "zarr.json")
    no_crc = json.loads(sharded_doc)
    no_crc["codecs"][0]["configuration"]["index_codecs"] = [{"name": "bytes", "configuration": {"endian": "little"}}]
    (m / "t").mkdir()
    (m / "t" / "zarr.json").touch()  # an empty file first (touch, or a tool's create then write)
    for name, doc in (("w", sharded_doc), ("z", sharded_doc), ("u", json.dumps(no_crc).encode()),
                      ("t", sharded_doc)):
        with pytest.raises(PermissionError):
            (m / name / "zarr.json").write_bytes(doc)
    m.umount()
    assert not [k for k in store.keys() if k.startswith("x/")]
    assert all(store.get(f"{n}/zarr.json") in (None, b"") for n in "wzut")
    log = m.log_text()
    for name in ("x", "w", "z", "u", "t"):
        assert log.count(f"refused to store {name}/zarr.json: a new sharded array written through the view") == 1
    np.testing.assert_array_equal(zarr.open_array(str(store.local_copy(tmp_path / "copy") / "y"))[:], 5)


# ---------------------------------------------------------------------------
# unlink


def test_unlink_of_last_chunk_deletes_the_shard(store, mount, tmp_path):
    data = np.arange(64, dtype="<i4").reshape(8, 8) + 1
    seed_array(store, tmp_path, "arr", (8, 8), (2, 2), (4, 4), "<i4", data=data)
    m = mount(store.source, "flush_delay=60", extra=store.extra)
    for i, j in ((0, 0), (0, 1), (1, 0)):
        os.unlink(m / "arr" / chunk_name((i, j), "/"))
    zs("sync", m.path)
    assert set(read_shard(store.get("arr/c/0/0"), 4)) == {3}
    os.unlink(m / "arr" / chunk_name((1, 1), "/"))
    assert sorted(os.listdir(m / "arr" / "c" / "0")) == ["2", "3"]
    zs("sync", m.path)
    assert store.get("arr/c/0/0") is None
    assert sorted(os.listdir(m / "arr" / "c" / "1")) == ["2", "3"]
    assert sorted(os.listdir(m / "arr" / "c" / "2")) == ["0", "1", "2", "3"]
    m.umount()
    assert store.keys() == {"arr/zarr.json", "arr/c/0/1", "arr/c/1/0", "arr/c/1/1"}
    got = stored_chunks(store, "arr", (2, 2))
    assert len(got) == 12 and (0, 0) not in got and got[3, 3] == data[6:8, 6:8].tobytes()


def test_chunks_written_where_storage_has_no_directory_are_listed_at_once(store, mount, tmp_path):
    """A chunk written (closed, not stored yet) is listed at once at every
    level above it, also where storage holds no directory for its shard: an
    array stored empty, or a row whose shards were all deleted.  (Only its own
    chunk directory listed it: ``ls arr`` showed no ``c``, ``find`` and
    ``cp -r`` out of the view missed the chunk until its shard was stored.)
    So is a temporary file being written in a row that holds no chunk
    (before, found by tests/difftest.py: its row was not listed)."""
    seed_array(store, tmp_path, "empty", (8, 8), (2, 2), (4, 4), "<i4")
    seed_array(store, tmp_path, "arr", (8, 8), (2, 2), (4, 4), "<i4", data=np.arange(64, dtype="<i4").reshape(8, 8))
    m = mount(store.source, "flush_delay=60", extra=store.extra)

    def walked(top):
        return sorted(os.path.relpath(os.path.join(d, f), m / top) for d, _, fs in os.walk(m / top) for f in fs)

    write_file(m / "empty/c/1/3", raw_chunk(7))
    assert sorted(os.listdir(m / "empty")) == ["c", "zarr.json"]
    assert os.listdir(m / "empty/c") == ["1"]
    assert walked("empty") == ["c/1/3", "zarr.json"]
    # so is a temporary (held in memory) in a row that holds no chunk
    fd = os.open(m / "empty/c/2/.3.partial", os.O_WRONLY | os.O_CREAT)
    try:
        os.write(fd, b"part")
        assert sorted(os.listdir(m / "empty/c")) == ["1", "2"]
        assert walked("empty") == ["c/1/3", "c/2/.3.partial", "zarr.json"]
    finally:
        os.close(fd)
    os.unlink(m / "empty/c/2/.3.partial")
    # the first row of shards removed chunk by chunk and stored: storage's c/0 is gone
    for i in range(2):
        for j in range(4):
            os.unlink(m / "arr" / chunk_name((i, j), "/"))
    zs("sync", m.path)
    assert all(not k.startswith("arr/c/0/") for k in store.keys())
    write_file(m / "arr/c/1/2", raw_chunk(9))
    assert sorted(os.listdir(m / "arr/c")) == ["1", "2", "3"]
    assert "c/1/2" in walked("arr")
    m.umount()
    assert stored_chunks(store, "empty", (2, 2)) == {(1, 3): raw_chunk(7)}
    assert stored_chunks(store, "arr", (2, 2))[1, 2] == raw_chunk(9)


def test_chunk_directories_behave_like_a_directory_store(store, mount, tmp_path):
    data = np.arange(64, dtype="<i4").reshape(8, 8) + 1
    seed_array(store, tmp_path, "arr", (8, 8), (2, 2), (4, 4), "<i4", data=data)
    m = mount(store.source, "flush_delay=60", extra=store.extra)
    c = m / "arr" / "c"
    os.makedirs(c / "3", exist_ok=True)  # what zarr-python 2's DirectoryStore does before each write
    with pytest.raises(FileExistsError):
        os.mkdir(c / "3")
    with pytest.raises(OSError) as exc:
        os.rmdir(c / "0")
    assert exc.value.errno == errno.ENOTEMPTY
    for j in range(4):
        os.unlink(c / "0" / str(j))
    os.rmdir(c / "0")  # empty now: removable, as on a directory store
    with pytest.raises(FileNotFoundError):  # outside the grid: no such directory to write into
        (c / "9" / "0").write_bytes(b"x")
    with pytest.raises(NotADirectoryError):
        (c / "1" / "0" / "x").write_bytes(b"x")
    m.umount()
    got = stored_chunks(store, "arr", (2, 2))
    assert len(got) == 12 and not any(i == 0 for i, _ in got)


def test_an_in_grid_chunk_directory_removed_stays_removed_while_empty(store, mount, tmp_path):
    """An empty in-grid chunk directory of a stored array (looked up
    leniently, Limits: it exists as soon as it is inside the grid) removed
    by rmdir is gone, as on a directory store, to stat, listings and a file
    made in it (ENOENT), until mkdir makes it again or something is stored
    below it (another client's chunk: found again).  Before, it was still
    found after its rmdir and mkdir was EEXIST (the kernel's LOOKUP before
    the MKDIR found it), so ``mv -T`` of an array on S3 stopped half done
    (scripts/fuzz_dir_renames.py --s3, seeds 60002, 60007, 60012, 60052,
    60062).  In an array created through this mount the same holds."""
    data = np.zeros((8, 8), "<i4")
    data[:4, :4] = 1  # (one shard of four stored: c/2 and c/3 hold no chunk)
    seed_array(store, tmp_path, "arr", (8, 8), (2, 2), (4, 4), "<i4", data=data)
    rows = np.zeros((8, 8), "<i4")
    rows[6:, :2] = 9  # (chunk (3, 0) only: row 2 of shard (1, 0) holds no chunk)
    seed_array(store, tmp_path, "rows", (8, 8), (2, 2), (4, 4), "<i4", data=rows)
    m = mount(store.source, "flush_delay=60", "shard=2", extra=store.extra)
    assert sorted(os.listdir(m / "rows/c")) == ["2", "3"]  # (2: listed, empty, Limits)
    os.rmdir(m / "rows/c/2")
    assert sorted(os.listdir(m / "rows/c")) == ["3"]  # (as lookup answers)
    assert not (m / "rows/c/2").exists()
    c = m / "arr" / "c"
    assert (c / "3").is_dir()  # (found leniently)
    os.rmdir(c / "3")  # empty: removable
    assert not (c / "3").exists()  # (still there before)
    assert "3" not in os.listdir(c)
    new = np.full((2, 2), 7, "<i4").tobytes()
    with pytest.raises(FileNotFoundError):
        (c / "3" / "1").write_bytes(new)
    os.mkdir(c / "3")  # (EEXIST before)
    (c / "3" / "1").write_bytes(new)
    os.rmdir(c / "2")
    assert not (c / "2").exists()
    # another client stores a chunk below the removed directory: found again
    other = np.zeros((8, 8), "<i4")
    other[:4, :4] = 1
    other[4:6, 4:6] = 5  # (chunk (2, 2): shard (1, 1))
    seed_array(store, tmp_path / "other", "arr", (8, 8), (2, 2), (4, 4), "<i4", data=other)
    time.sleep(1.5)  # (metadata_ttl: the new shard is listed)
    assert (c / "2" / "2").read_bytes() == np.full((2, 2), 5, "<i4").tobytes()
    zarr.create_array(store=str(m / "made"), shape=(8, 8), chunks=(2, 2), dtype="<i4")  # (-o shard: (4, 4))
    os.makedirs(m / "made/c/3")
    os.rmdir(m / "made/c/3")
    assert not (m / "made/c/3").exists()
    with pytest.raises(FileNotFoundError):
        (m / "made/c/3/1").write_bytes(new)
    os.makedirs(m / "made/c/3")  # (zarr-python and tensorstore make a chunk's directories first)
    (m / "made/c/3/1").write_bytes(new)
    m.umount()
    assert stored_chunks(store, "arr", (2, 2))[(3, 1)] == new
    assert stored_chunks(store, "made", (2, 2)) == {(3, 1): new}


def test_mv_t_of_an_array_holding_a_plain_directory(store, mount, tmp_path):
    """``mv -T`` of a sharded array whose directory holds a plain directory
    (a name outside the grid) besides ``c``: GNU mv 9.1 renames each file
    into the new directory, ``zarr.json`` before ``c``; the new directory,
    holding a stored directory already, is then an array whose ``c`` is
    found leniently, so mv's renameat2(RENAME_NOREPLACE) of ``c`` is EEXIST
    and mv removes the ``c`` it found and makes it again.  Before, that
    mkdir was EEXIST (the rmdir was not remembered: the kernel's LOOKUP
    found ``c`` again): mv exited 1, the array split between the two names
    (scripts/fuzz_dir_renames.py --s3, seed 60052 step 35)."""
    data = np.arange(16 * 16, dtype="<i4").reshape(16, 16) + 1
    store.put("g/zarr.json", json.dumps({"zarr_format": 3, "node_type": "group", "attributes": {}}).encode())
    seed_array(store, tmp_path, "g/arr", (16, 16), (4, 4), (8, 8), "<i4", data=data)
    store.put("g/arr/x/notes", b"kept")
    m = mount(store.source, "flush_delay=60", "shard=2", extra=store.extra)
    before = {p.relative_to(m / "g/arr").as_posix(): p.read_bytes() for p in (m / "g/arr").rglob("*") if p.is_file()}
    out = subprocess.run(["mv", "-T", str(m / "g/arr"), str(m / "g/moved")], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert not (m / "g/arr").exists()
    after = {p.relative_to(m / "g/moved").as_posix(): p.read_bytes() for p in (m / "g/moved").rglob("*")
             if p.is_file()}
    assert after == before
    np.testing.assert_array_equal(zarr.open_array(str(m / "g/moved"), mode="r")[...], data)
    zs("sync", m.path)
    assert " ERROR " not in m.log_text(), m.log_text()[-2000:]
    m.umount()
    root = store.local_copy(tmp_path / "copy")
    np.testing.assert_array_equal(zarr.open_array(str(root / "g/moved"), mode="r")[...], data)
    assert (root / "g/moved/x/notes").read_bytes() == b"kept"
    assert not any(k.startswith("g/arr/") for k in store.keys())


def test_never_renamed_files_inside_an_array(store, mount, tmp_path):
    """A file that is not a chunk, written inside a sharded array and never
    renamed: in the array's own directory it is a plain file, stored at
    unmount (not at close); in a chunk directory it cannot be shown once
    stored, so it is discarded at unmount with one log line, also for many
    (a ``cp -r`` of chunk directories to a name that is no chunk's: before,
    one line per file, 16 for one such directory of zarr-python's)."""
    seed_array(store, tmp_path, "arr", (8, 8), (2, 2), (4, 4), "<i4")
    before = set(store.keys())
    m = mount(store.source, "flush_delay=60", extra=store.extra)
    (m / "arr" / "notes.txt").write_bytes(b"kept")
    (m / "arr" / "c" / "0" / "stray.tmp").write_bytes(b"dropped")
    for i in range(4):
        (m / "arr" / "c" / str(i) / "more.tmp").write_bytes(b"dropped too")
    assert (m / "arr" / "notes.txt").read_bytes() == b"kept"
    assert (m / "arr" / "c" / "0" / "stray.tmp").read_bytes() == b"dropped"
    assert "arr/notes.txt" not in store.keys()  # not at close
    m.umount()
    assert set(store.keys()) == before | {"arr/notes.txt"}
    assert store.get("arr/notes.txt") == b"kept"
    lines = [line for line in m.log_text().splitlines() if ".tmp" in line]
    assert len(lines) == 1 and "and 4 more" in lines[0] and " WARNING " in lines[0], lines


def test_a_sync_between_close_and_rename_keeps_the_temporary(store, mount, tmp_path):
    """zarr-python writes a chunk to a temporary name, closes it and renames
    it over the chunk.  A ``zshardfs sync`` (anyone's) in between keeps the
    temporary (it used to discard it: the rename then failed with ENOENT and
    the chunk was lost); only unmount discards one never renamed."""
    seed_array(store, tmp_path, "arr", (8, 8), (2, 2), (4, 4), "<i4")
    m = mount(store.source, "flush_delay=60", extra=store.extra)
    new = np.full((2, 2), 5, "<i4").tobytes()
    (m / "arr/c/0/1.partial").write_bytes(new)
    zs("sync", m.path)
    os.rename(m / "arr/c/0/1.partial", m / "arr/c/0/1")
    zs("sync", m.path)
    assert "discarded" not in m.log_text()
    m.umount()
    assert stored_chunks(store, "arr", (2, 2))[(0, 1)] == new


def test_a_file_held_in_an_array_s_root_meets_a_directory_another_client_made_at_its_name(store, mount, tmp_path):
    """A file in an array's own directory, written as a temporary and
    renamed (``arr/notes.tmp`` -> ``arr/notes.txt``), is held in memory
    until fsync, sync or unmount; meanwhile another client makes a
    directory at its name in the store.  Local store: fsync answers EIO
    (before: ENOENT, which fsync(2) never answers, and no log line), one
    ERROR line names the file, ``zshardfs sync`` fails with EIO and
    ``zshardfs umount`` refuses (the data is held), the daemon stays up,
    the file keeps its bytes, and a rename through the mount stores it
    under the new name.  Nothing else is harmed: a plain file and a chunk
    written meanwhile are stored, the other client's directory is kept.
    S3: an object and a prefix of one name coexist, so the file is stored
    and the mount shows it, a file (the other client's objects below it
    are not shown)."""
    seed_array(store, tmp_path, "arr", (8, 8), (2, 2), (4, 4), "<i4")
    m = mount(store.source, "flush_delay=60", extra=store.extra)
    (m / "arr" / "notes.tmp").write_bytes(b"the notes")
    os.rename(m / "arr" / "notes.tmp", m / "arr" / "notes.txt")
    assert store.get("arr/notes.txt") is None  # (held in memory, as documented)
    (m / "plain.txt").write_bytes(b"unharmed")
    (m / "arr" / "c" / "0" / "1").write_bytes(raw_chunk(5))
    store.put("arr/notes.txt/inner", b"another client's")  # (a directory, on a local store)
    fd = os.open(m / "arr" / "notes.txt", os.O_RDONLY)
    try:
        if store.kind == "local":
            with pytest.raises(OSError) as info:
                os.fsync(fd)
            assert info.value.errno == errno.EIO, info.value  # (before: ENOENT)
        else:
            os.fsync(fd)
    finally:
        os.close(fd)
    if store.kind == "local":
        lines = [line for line in m.log_text().splitlines() if "arr/notes.txt" in line]
        assert len(lines) == 1 and " ERROR " in lines[0] and "directory" in lines[0], lines
        # (so does the close of any file written, stored at its close)
        fd = os.open(m / "late.txt", os.O_WRONLY | os.O_CREAT)
        os.write(fd, b"late bytes")
        (store.root / "late.txt").mkdir()
        with pytest.raises(OSError) as info:
            os.close(fd)
        assert info.value.errno == errno.EIO, info.value  # (before: ENOENT)
        os.rename(m / "late.txt", m / "late.kept")
        result = zs("sync", m.path, check=False)
        assert result.returncode != 0 and os.strerror(errno.EIO) in result.stderr, result.stderr
        result = zs("umount", m.path, check=False)
        assert result.returncode != 0 and "still held" in result.stderr, result.stderr
        assert (m / "arr" / "notes.txt").read_bytes() == b"the notes"  # (served: the daemon is up)
        os.rename(m / "arr" / "notes.txt", m / "arr" / "notes.kept")
        assert "failed unexpectedly" not in m.log_text()
    else:
        assert store.get("arr/notes.txt") == b"the notes"
        assert (m / "arr" / "notes.txt").read_bytes() == b"the notes"
    m.umount()
    assert store.get("arr/notes.txt/inner") == b"another client's"
    assert store.get("plain.txt") == b"unharmed" and stored_chunks(store, "arr", (2, 2))[(0, 1)] == raw_chunk(5)
    if store.kind == "local":
        assert store.get("arr/notes.kept") == b"the notes" and (store.root / "arr" / "notes.txt").is_dir()
        assert store.get("late.kept") == b"late bytes" and (store.root / "late.txt").is_dir()
        assert "lost" not in m.log_text()
    else:
        assert store.get("arr/notes.txt") == b"the notes"


def test_arrays_are_removed_as_from_a_directory_store(store, mount, tmp_path):
    """rm -r, shutil.rmtree, zarr-python's delete and overwrite, and mv of an
    array (local: a rename; S3: EXDEV, mv copies, then removes) succeed, whatever order they
    remove zarr.json and the chunks in: chunks whose shards are still to be
    deleted do not keep their directories from being removed, and an array
    whose zarr.json went first keeps its chunk files until they are gone."""
    data = np.arange(1600, dtype="<i4").reshape(40, 40) + 1
    for name, sep in (("slash", "/"), ("dot", "."), ("tree", "/"), ("group/member", "/"), ("ow", "/"), ("tomove", "."),
                      ("plain/arr", "/")):
        seed_array(store, tmp_path, name, (40, 40), (10, 10), (20, 20), "<i4", data=data, sep=sep)
    seed_array(store, tmp_path, "sparse", (512, 512), (32, 32), (128, 128), "<i4",
               data=np.pad(np.ones((170, 170), "<i4"), ((0, 342), (0, 342))))
    store.put("group/zarr.json", json.dumps({"zarr_format": 3, "node_type": "group", "attributes": {}}).encode())
    m = mount(store.source, "flush_delay=60", extra=store.extra)
    names = os.listdir(m / "dot")
    assert "zarr.json" in names and len(names) == 17
    for name in ("slash", "dot", "sparse", "plain/arr"):
        subprocess.run(["rm", "-r", str(m / name)], check=True, capture_output=True)
        assert not (m / name).exists()
    zs("sync", m.path)
    import shutil

    shutil.rmtree(m / "tree")
    del zarr.open_group(str(m / "group"), mode="r+")["member"]
    assert list(zarr.open_group(str(m / "group"), mode="r").keys()) == []
    new = np.full((30, 30), 5, "<i4")
    zarr.create_array(str(m / "ow"), shape=(30, 30), chunks=(10, 10), dtype="<i4", overwrite=True)[:] = new
    subprocess.run(["mv", str(m / "tomove"), str(m / "moved")], check=True, capture_output=True)
    np.testing.assert_array_equal(zarr.open_array(str(m / "moved"), mode="r")[:], data)
    np.testing.assert_array_equal(zarr.open_array(str(m / "ow"), mode="r")[:], new)
    m.umount()
    gone = ("slash/", "dot/", "sparse/", "tree/", "group/member/", "tomove/")
    assert not [k for k in store.keys() if k.startswith(gone)]
    if store.kind == "local":  # no directory of theirs is left behind, and none above them goes
        assert sorted(os.listdir(store.root)) == ["group", "moved", "ow", "plain"]
        assert os.listdir(store.root / "plain") == []
        assert os.listdir(store.root / "group") == ["zarr.json"]
    stored = store.local_copy(tmp_path / "copy")
    np.testing.assert_array_equal(zarr.open_array(str(stored / "moved"), mode="r")[:], data)
    np.testing.assert_array_equal(zarr.open_array(str(stored / "ow"), mode="r")[:], new)


@pytest.mark.parametrize("how", ["editor", "rm_and_restore", "mv_away_and_back", "shell_redirect",
                                 "truncate_then_append", "garbage_then_restore", "emptied_synced_removed_restored"])
def test_zarr_json_removed_and_written_again_keeps_the_array(store, mount, tmp_path, how):
    """An editor's save (rename zarr.json to zarr.json~, write a new
    zarr.json), a copy put back after rm, and a move away and back: the
    chunk files stay what they were meanwhile, and the document written
    again is mapped back onto the sharded one, as a rewrite in place is."""
    data = np.arange(1600, dtype="<i4").reshape(40, 40) + 1
    seed_array(store, tmp_path, "a", (40, 40), (10, 10), (20, 20), "<i4", data=data,
               compressors=zarr.codecs.ZstdCodec(level=1))
    m = mount(store.source, extra=store.extra)
    doc = m / "a" / "zarr.json"
    view = json.loads(doc.read_text())
    chunk = (m / "a" / "c" / "0" / "0").read_bytes()
    if how == "editor":
        os.rename(doc, m / "a" / "zarr.json~")
        assert (m / "a" / "c" / "0" / "0").read_bytes() == chunk
        doc.write_text(json.dumps({**view, "attributes": {"name": "new"}}))
    elif how == "rm_and_restore":
        saved = doc.read_bytes()
        os.unlink(doc)
        assert sorted(os.listdir(m / "a" / "c" / "3")) == ["0", "1", "2", "3"]
        doc.write_bytes(saved)
    elif how == "garbage_then_restore":  # echo oops > zarr.json; cp saved zarr.json
        saved = doc.read_bytes()
        doc.write_bytes(b"oops\n")
        doc.write_bytes(saved)
    elif how == "emptied_synced_removed_restored":  # : > zarr.json; sync; rm zarr.json; cp saved zarr.json
        saved = doc.read_bytes()
        os.close(os.open(doc, os.O_WRONLY | os.O_TRUNC))
        zs("sync", m.path)
        os.unlink(doc)
        doc.write_bytes(saved)
    elif how == "truncate_then_append":  # truncate -s 0 zarr.json; (a chunk written); cat saved >> zarr.json
        saved = doc.read_bytes()
        os.truncate(doc, 0)
        assert sorted(os.listdir(m / "a" / "c" / "0")) == ["0", "1", "2", "3"]  # chunk files all along
        (m / "a" / "c" / "0" / "0").write_bytes(chunk)
        with open(doc, "ab") as f:
            f.write(saved)
    elif how == "shell_redirect":  # rm zarr.json; cat saved > zarr.json
        saved = doc.read_bytes()
        os.unlink(doc)
        fd = os.open(doc, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        child = os.dup(fd)
        os.close(fd)  # the shell's copy closes first: an empty zarr.json is flushed
        os.write(child, saved)
        os.close(child)
    else:
        os.rename(doc, m / "a" / "zarr.json.bak")
        # stored under its new name at once, never in memory only
        assert json.loads(store.get("a/zarr.json.bak"))["codecs"][0]["name"] == "sharding_indexed"
        assert [p.name for p in (m / "a" / "c").rglob("*") if p.is_file()]  # listed meanwhile
        os.rename(m / "a" / "zarr.json.bak", doc)
    assert (m / "a" / "c" / "0" / "0").read_bytes() == chunk
    np.testing.assert_array_equal(zarr.open_array(str(m / "a"), mode="r")[:], data)
    m.umount()
    stored = json.loads(store.get("a/zarr.json"))
    assert [c["name"] for c in stored["codecs"]] == ["sharding_indexed"]
    assert stored["attributes"] == ({"name": "new"} if how == "editor" else {})
    np.testing.assert_array_equal(zarr.open_array(str(store.local_copy(tmp_path / "copy") / "a"), mode="r")[:], data)


def test_an_array_made_here_shows_chunks_other_clients_store(store, mount):
    """In an array this mount created, chunk directories exist once made or
    written here (as in a directory store) or once storage holds something
    below them: chunks another client stores show within the TTLs."""
    a = mount(store.source, "shard=4", extra=store.extra)
    zarr.create_array(str(a / "arr"), shape=(64, 64), chunks=(4, 4), dtype="uint8", fill_value=0, compressors=None)
    zs("sync", a.path)
    b = mount(store.source, "shard=4", extra=store.extra)
    os.makedirs(b / "arr" / "c" / "0", exist_ok=True)
    (b / "arr" / "c" / "0" / "0").write_bytes(bytes(range(1, 17)))
    zs("sync", b.path)
    time.sleep(1.5)  # past metadata_ttl and index_ttl
    assert os.listdir(a / "arr" / "c" / "0") == ["0"]
    assert (a / "arr" / "c" / "0" / "0").read_bytes() == bytes(range(1, 17))
    got = zarr.open_array(str(a / "arr"), mode="r")[0:4, 0:4]
    assert got.ravel().tolist() == list(range(1, 17))
    (a / "arr" / "c" / "0" / "1").write_bytes(bytes(16))  # and written into without a mkdir


def test_plain_directories_are_removed_as_on_a_file_system(store, mount):
    """``rm -r`` of a tree of plain files, and ``rm`` then ``rmdir``: on S3 a
    directory whose last file went stays (in memory) until removed, so the
    tool's rmdir finds it, as on any file system."""
    m = mount(store.source, extra=store.extra)
    (m / "t" / "a" / "b").mkdir(parents=True)
    (m / "t" / "a" / "b" / "f.txt").write_bytes(b"1")
    (m / "t" / "a" / "g.txt").write_bytes(b"2")
    subprocess.run(["rm", "-r", str(m / "t")], check=True, capture_output=True)
    assert not (m / "t").exists()
    (m / "e").mkdir()
    (m / "e" / "only.txt").write_bytes(b"3")
    os.unlink(m / "e" / "only.txt")
    assert os.listdir(m / "e") == []
    os.rmdir(m / "e")
    assert not (m / "e").exists()
    # directories that hold only directories: each stays while its last
    # subdirectory goes, for the rmdir that follows it
    for top in ("u", "v", "w"):
        (m / top / "d" / "e").mkdir(parents=True)
        (m / top / "d" / "e" / "f.txt").write_bytes(b"4")
    m.umount()
    m = mount(store.source, extra=store.extra)  # (stored ones, as another client's, made nothing here)
    subprocess.run(["rm", "-r", str(m / "u")], check=True, capture_output=True)
    shutil.rmtree(m / "v")
    subprocess.run(["find", str(m / "w"), "-delete"], check=True, capture_output=True)
    (m / "x" / "d" / "e").mkdir(parents=True)  # (and made here)
    (m / "x" / "d" / "e" / "f.txt").write_bytes(b"5")
    subprocess.run(["rm", "-r", str(m / "x")], check=True, capture_output=True)
    assert sorted(os.listdir(m.path)) == []
    m.umount()
    assert not [k for k in store.keys() if k.startswith(("t/", "e/", "u/", "v/", "w/", "x/"))]


def test_a_directory_that_lost_a_subdirectory_shows_what_storage_holds(store, mount):
    """``rm -r a/b`` where ``a`` holds files too: on S3 ``a`` is kept a
    moment (in case it was emptied), not for good, so once another client
    removed its files, the mount shows it gone, as every other client does.
    (Kept for good, it showed for the life of the mount.)"""
    store.put("a/f.txt", b"1")
    store.put("a/b/g.txt", b"2")
    m = mount(store.source, "attr_timeout=1", extra=store.extra)
    subprocess.run(["rm", "-r", str(m / "a" / "b")], check=True)
    assert os.listdir(m / "a") == ["f.txt"]
    if store.kind == "local":
        os.unlink(store.root / "a" / "f.txt")
        os.rmdir(store.root / "a")
    else:
        store.server.s3.delete_object(Bucket=store.bucket, Key=f"{PREFIX}/a/f.txt")
    assert wait_for(lambda: os.listdir(m.path) == [] and not (m / "a").exists(), timeout=15)


def test_what_is_made_in_a_directory_just_emptied_stays(store, mount):
    """On S3 a directory whose last file or subdirectory went is kept only a
    moment (``emptied``); a directory made in it, or a file being written
    there, makes it a directory made here, which stays: ``rm -r out/old;
    mkdir out/new`` (or ``rm out/f; mkdir out/new``), and a log opened in a
    directory just emptied.  (Before, out, and what was in it, vanished
    after 5 s: a later write into out/new was ENOENT.)"""
    store.put("out1/old/f.txt", b"1")
    store.put("out2/f.txt", b"1")
    store.put("out3/f.txt", b"1")
    m = mount(store.source, "attr_timeout=0", extra=store.extra)
    subprocess.run(["rm", "-r", "old"], cwd=m / "out1", check=True)
    (m / "out1" / "new").mkdir()
    os.unlink(m / "out2" / "f.txt")
    (m / "out2" / "new").mkdir()
    os.unlink(m / "out3" / "f.txt")
    with open(m / "out3" / "log.txt", "wb") as log:
        log.write(b"a")
        log.flush()
        if store.kind == "s3":  # (a local store keeps empty directories: nothing is kept for a while there)
            time.sleep(6.5)  # (past EMPTIED_KEEP, 5 s)
        assert sorted(os.listdir(m.path)) == ["out1", "out2", "out3"]
        assert os.listdir(m / "out3") == ["log.txt"]
    for d in ("out1", "out2"):
        assert os.listdir(m / d) == ["new"] and (m / d / "new").is_dir()
        (m / d / "new" / "g.txt").write_bytes(b"2")
    m.umount()
    assert sorted(k for k in store.keys() if k.startswith("out")) == ["out1/new/g.txt", "out2/new/g.txt",
                                                                       "out3/log.txt"]


@pytest.mark.parametrize("files", [1, 200])
def test_rm_r_of_a_directory_s_only_subdirectory(store, mount, files):
    """``rm -r out/old`` where out holds only old: rm's last rmdir looks out
    up again, after the kernel's entry for it expired (attr_timeout 0, or a
    tree that takes longer to remove than attr_timeout).  On S3 out has no
    key left by then: the ancestors of what is removed are kept a moment,
    renewed by each removal below them.  (Before: ENOENT.)"""
    for i in range(files):
        store.put(f"out/old/f{i}.txt", b"1")
    m = mount(store.source, f"attr_timeout={0 if files == 1 else 1}", extra=store.extra)
    result = subprocess.run(["rm", "-r", str(m / "out" / "old")], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert not [k for k in store.keys() if k.startswith("out/")]


def test_a_directory_emptied_stays_while_the_tree_above_it_is_being_moved(store, mount):
    """``mv -T src dst`` where the directory's rename is EXDEV (S3) renames
    each file into the new tree, then removes the directories left (rm -r):
    ``src/d``, emptied first, must still be there for that rm when moving
    the rest of ``src`` took longer than EMPTIED_KEEP (5 s).  On S3 a
    directory this mount emptied now stays while this mount goes on removing
    below any directory above it (5 s after the last such removal, storage
    decides).  Before, ``src/d`` went 5 s after its own last file: rm listed
    it (a moment before) and its rmdir was ENOENT, ``mv`` exited 1
    (scripts/fuzz_dir_renames.py --s3 seed 60009 under load: "mv: cannot
    remove '.../n1/n1/0': No such file or directory")."""
    store.put("src/d/f.txt", b"1")
    for i in range(8):
        store.put(f"src/e/g{i}.txt", b"2")
    m = mount(store.source, "attr_timeout=0.5", extra=store.extra)
    (m / "dst" / "d").mkdir(parents=True)
    os.rename(m / "src/d/f.txt", m / "dst/d/f.txt")  # (src/d emptied)
    (m / "dst" / "e").mkdir()
    for i in range(8):  # (the rest of the move: 8 s, a file a second)
        time.sleep(1)
        os.rename(m / f"src/e/g{i}.txt", m / f"dst/e/g{i}.txt")
    assert sorted(os.listdir(m / "src")) == ["d", "e"]
    assert os.listdir(m / "src/d") == [] and os.listdir(m / "src/e") == []
    for d in ("src/d", "src/e", "src"):
        os.rmdir(m / d)
    assert os.listdir(m.path) == ["dst"]
    m.umount()
    assert sorted(store.keys()) == ["dst/d/f.txt"] + [f"dst/e/g{i}.txt" for i in range(8)]


def test_an_array_moved_chunk_by_chunk_keeps_its_old_directories_for_the_rm_that_follows(store, mount, tmp_path):
    """``mv -T`` of an array on S3 renames its ``zarr.json`` and then each
    chunk into the new directory, and then removes the old directories:
    the old array's directory (its document gone, its shards deleted as
    they empty) must still be there for that rm when moving the chunks
    took longer than EMPTIED_KEEP (5 s).  A chunk's removal (unlink, rename
    away) now renews, as a file's does, the array's directory and those
    above it.  Before, nothing below the array renewed it: 5 s after its
    ``zarr.json`` went, with its last shard deleted, the rmdir of
    ``c/0`` was ENOENT and mv exited 1 (scripts/fuzz_dir_renames.py --s3
    seeds 60006, 60011: "mv: cannot remove '.../c/0': No such file or
    directory")."""
    data = np.arange(16 * 16, dtype="<i4").reshape(16, 16) + 1
    seed_array(store, tmp_path, "src/arr", (16, 16), (4, 4), (8, 8), "<i4", data=data)
    m = mount(store.source, "attr_timeout=0.5", "flush_delay=0.2", extra=store.extra)
    (m / "dst" / "arr").mkdir(parents=True)
    os.rename(m / "src/arr/zarr.json", m / "dst/arr/zarr.json")
    for i in range(4):  # (8 s: a chunk each half second; each shard deleted once its four chunks moved)
        (m / f"dst/arr/c/{i}").mkdir(parents=True)
        for j in range(4):
            time.sleep(0.5)
            os.rename(m / f"src/arr/c/{i}/{j}", m / f"dst/arr/c/{i}/{j}")
    time.sleep(0.5)  # (the last shard's deletion: flush_delay)
    for i in range(4):
        assert os.listdir(m / f"src/arr/c/{i}") == []
        os.rmdir(m / f"src/arr/c/{i}")
    for d in ("src/arr/c", "src/arr", "src"):
        os.rmdir(m / d)
    assert os.listdir(m.path) == ["dst"]
    np.testing.assert_array_equal(zarr.open_array(str(m / "dst/arr"), mode="r")[...], data)
    m.umount()
    assert not [k for k in store.keys() if k.startswith("src/")]
    np.testing.assert_array_equal(zarr.open_array(str(store.local_copy(tmp_path / "copy") / "dst/arr"),
                                                  mode="r")[...], data)


def test_an_o_trunc_open_empties_the_file(store, mount):
    """``: > f`` empties f, even though nothing is written."""
    m = mount(store.source, extra=store.extra)
    (m / "g").mkdir()
    for name in ("f.txt", "info", "g/zarr.json"):  # (documents of no dataset: plain files)
        (m / name).write_bytes(b'{"zarr_format": 3, "node_type": "group"}' if name.endswith("json") else b"hi\n")
        os.close(os.open(m / name, os.O_WRONLY | os.O_TRUNC))
        assert (m / name).read_bytes() == b""
        assert store.get(name) == b""  # stored at close
    m.umount()


def test_names_up_to_the_longest_legal_one_are_stored(store, mount):
    """A file name of up to 255 bytes (NAME_MAX) is stored: the local
    backend's temporary name (``.zshardfs-tmp-<pid>-<thread>-<name>``) is cut
    to fit, so close and unmount succeed and the store holds the name."""
    m = mount(store.source, extra=store.extra)
    (m / "d").mkdir()
    names = ["a" * 250, "b" * 255, "\u00e9" * 127, "d/" + "c" * 255]  # (127 two-byte characters: 254 bytes)
    for i, name in enumerate(names):
        (m / name).write_bytes(b"hello %d" % i)
    zs("sync", m.path)
    for i, name in enumerate(names):
        assert store.get(name) == b"hello %d" % i, name
        assert (m / name).read_bytes() == b"hello %d" % i
    m.umount()
    assert store.keys() == set(names)


def test_a_sharded_document_restored_over_its_shards_is_stored(store, mount, tmp_path):
    """After a crash in an editor's save (``zarr.json`` renamed to
    ``zarr.json~``, nothing written yet), a remounted view restores it with
    ``mv zarr.json~ zarr.json``: a sharded document over shards already
    stored is a restore, not a new sharded array."""
    data = np.arange(64, dtype="<i4").reshape(8, 8) + 1
    seed_array(store, tmp_path, "arr", (8, 8), (2, 2), (4, 4), "<i4", data=data)
    store.put("arr/zarr.json~", store.get("arr/zarr.json"))
    store.put("arr/c/.DS_Store", b"junk")  # (names that are no shard's are passed over)
    if store.kind == "local":
        (store.root / "arr" / "zarr.json").unlink()
    else:
        store.server.s3.delete_object(Bucket=store.bucket, Key=f"{PREFIX}/arr/zarr.json")
    m = mount(store.source, extra=store.extra)
    os.rename(m / "arr" / "zarr.json~", m / "arr" / "zarr.json")
    np.testing.assert_array_equal(zarr.open_array(str(m / "arr"), mode="r")[:], data)
    m.umount()
    np.testing.assert_array_equal(zarr.open_array(str(store.local_copy(tmp_path / "copy") / "arr"))[:], data)


def test_a_new_array_where_a_removed_one_left_nothing_is_new(store, mount, tmp_path):
    """Once every chunk of an array is removed along with its zarr.json, the
    directory holds nothing of it: a different array written there is
    stored as written, not mapped back onto the removed one."""
    seed_array(store, tmp_path, "arr", (8, 8), (2, 2), (4, 4), "<i4", data=np.ones((8, 8), "<i4"))
    m = mount(store.source, extra=store.extra)
    for p in sorted((m / "arr").rglob("*"), reverse=True):
        (os.rmdir if p.is_dir() else os.unlink)(p)
    zarr.create_array(str(m / "arr"), shape=(6,), chunks=(3,), dtype="uint8", fill_value=0)[:] = 4
    m.umount()
    np.testing.assert_array_equal(zarr.open_array(str(store.local_copy(tmp_path / "copy") / "arr"))[:], 4)


def test_a_zarr_json_moved_away_and_back_after_its_last_chunk_went_is_put_back(store, mount, tmp_path):
    """``mv zarr.json x; mv x zarr.json`` of an array none of whose chunks is
    left: the file moved away holds the stored (sharded) document, and
    moved back it is that document again, stored as it was. Before, no
    chunk being left, it was taken for a new sharded array written through
    the view and refused (EPERM): the array had no zarr.json any more
    (found by tests/difftest.py)."""
    data = np.zeros((8, 8), "<i4")
    data[0:2, 0:2] = 7
    seed_array(store, tmp_path, "arr", (8, 8), (2, 2), (4, 4), "<i4", data=data)
    stored = store.get("arr/zarr.json")
    m = mount(store.source, extra=store.extra)
    a = m / "arr"
    os.unlink(a / "c" / "0" / "0")
    os.rename(a / "zarr.json", a / "zarr.json.bak")
    os.rename(a / "zarr.json.bak", a / "zarr.json")
    assert "zarr.json" in os.listdir(a) and "zarr.json.bak" not in os.listdir(a)
    assert json.loads((a / "zarr.json").read_bytes())["shape"] == [8, 8]
    m.umount()
    assert store.get("arr/zarr.json") == stored
    got = zarr.open_array(str(store.local_copy(tmp_path / "copy") / "arr"))
    assert got.shards == (4, 4)
    np.testing.assert_array_equal(got[:], np.zeros((8, 8), "<i4"))


def test_an_editor_s_save_keeps_chunk_directories_whose_chunks_are_not_stored_yet(store, mount, tmp_path):
    """An editor's save of the zarr.json of an array whose only chunk is one
    written and not stored yet (storage holds nothing below the array) keeps
    that chunk's directory: before, the saved document was taken for a new
    array's, whose chunk directories exist only once made, and the chunk
    was ENOENT until its flush (the listing of its directory too)."""
    data = np.zeros((8, 8), "<i4")
    data[0:2, 0:2] = 7
    seed_array(store, tmp_path, "arr", (8, 8), (2, 2), (4, 4), "<i4", data=data)
    m = mount(store.source, "flush_delay=60", extra=store.extra)
    a = m / "arr"
    os.unlink(a / "c" / "0" / "0")
    fd = os.open(a / "c" / "0", os.O_RDONLY)
    try:
        os.fsync(fd)  # (the removal stored: so are the shard's and its directories')
    finally:
        os.close(fd)
    (a / "c" / "3" / "3").write_bytes(raw_chunk(5))
    doc = a / "zarr.json"
    view = json.loads(doc.read_text())
    os.rename(doc, a / "zarr.json~")
    doc.write_text(json.dumps({**view, "attributes": {"saved": 1}}))
    os.unlink(a / "zarr.json~")
    assert os.listdir(a / "c" / "3") == ["3"]
    assert (a / "c" / "3" / "3").read_bytes() == raw_chunk(5)
    (a / "c" / "2" / "1").write_bytes(raw_chunk(6))
    m.umount()
    got = zarr.open_array(str(store.local_copy(tmp_path / "copy") / "arr"))
    assert got.shards == (4, 4)
    expected = np.zeros((8, 8), "<i4")
    expected[6:8, 6:8] = 5
    expected[4:6, 2:4] = 6
    np.testing.assert_array_equal(got[:], expected)


def test_an_editor_s_save_of_an_array_emptied_of_chunks_keeps_its_chunk_directories(store, mount, tmp_path):
    """An array whose every chunk was removed (their shards and the
    directories that held only them are gone from storage) keeps its chunk
    directories when an editor saves its zarr.json (rename to zarr.json~,
    write anew), as a directory store would: a temporary held in one stays
    listed and readable, and a chunk can be written into another. Before,
    the new document was taken for a new array's (storage held nothing
    below it), whose chunk directories exist only once made: the temporary
    vanished and the write was ENOENT (found by tests/difftest.py)."""
    data = np.zeros((8, 8), "<i4")
    data[0:2, 0:2] = 7
    seed_array(store, tmp_path, "arr", (8, 8), (2, 2), (4, 4), "<i4", data=data)
    m = mount(store.source, "flush_delay=60", extra=store.extra)
    a = m / "arr"
    os.rename(a / "c" / "0" / "0", a / "c" / "1" / ".tmp-1")  # (held in memory: a temporary)
    doc = a / "zarr.json"
    view = json.loads(doc.read_text())
    os.rename(doc, a / "zarr.json~")
    doc.write_text(json.dumps({**view, "attributes": {"saved": 1}}))
    os.unlink(a / "zarr.json~")
    assert (a / "c" / "1" / ".tmp-1").read_bytes() == data[0:2, 0:2].tobytes()
    assert os.listdir(a / "c" / "1") == [".tmp-1"]
    assert sorted(os.listdir(a)) == ["c", "zarr.json"]
    (a / "c" / "2" / "3").write_bytes(raw_chunk(5))
    os.rename(a / "c" / "1" / ".tmp-1", a / "c" / "1" / "1")
    m.umount()
    got = zarr.open_array(str(store.local_copy(tmp_path / "copy") / "arr"))[:]
    expected = np.zeros((8, 8), "<i4")
    expected[2:4, 2:4] = 7
    expected[4:6, 6:8] = 5
    np.testing.assert_array_equal(got, expected)


def test_a_file_a_chunk_was_renamed_over_is_gone_once_unlinked(store, mount, tmp_path):
    """A chunk renamed over a stored plain file in the array's own directory
    replaces it (held in memory a while there: it may be a tool's temporary);
    unlinking that name then removes the file from storage too, at once or
    while a handle still writes to it. Before, the renamed chunk was taken
    for a new file not stored yet, so its unlink left the stored file, whose
    old bytes came back (found by tests/difftest.py)."""
    data = np.arange(64, dtype="<i4").reshape(8, 8)
    seed_array(store, tmp_path, "arr", (8, 8), (2, 2), (4, 4), "<i4", data=data)
    store.put("arr/old.txt", b"stored before")
    store.put("arr/held.txt", b"stored before too")
    m = mount(store.source, "flush_delay=60", extra=store.extra)
    a = m / "arr"
    os.rename(a / "c" / "0" / "0", a / "old.txt")
    assert (a / "old.txt").read_bytes() == data[0:2, 0:2].tobytes()
    os.unlink(a / "old.txt")
    assert not (a / "old.txt").exists()
    os.rename(a / "c" / "1" / "1", a / "held.txt")
    fd = os.open(a / "held.txt", os.O_WRONLY | os.O_TRUNC)
    try:
        os.write(fd, b"abc")
        os.unlink(a / "held.txt")
        os.write(fd, b"def")
    finally:
        os.close(fd)
    assert not (a / "held.txt").exists()
    assert sorted(os.listdir(a)) == ["c", "zarr.json"]
    m.umount()
    assert store.get("arr/old.txt") is None and store.get("arr/held.txt") is None


def test_fsync_of_a_read_only_descriptor_stores_the_file(store, mount, tmp_path):
    """fsync(2) stores what was written to a file whichever descriptor asks,
    as on POSIX, also one open read-only: here a file in the array's own
    directory (held in memory until fsync or sync: it may be a tool's
    temporary), written and closed by one descriptor, fsynced through
    another. Before, a read-only descriptor's fsync stored nothing, and a
    kill -9 after it lost the file (found by tests/difftest.py)."""
    seed_array(store, tmp_path, "arr", (8, 8), (2, 2), (4, 4), "<i4", data=np.ones((8, 8), "<i4"))
    m = mount(store.source, "flush_delay=60", extra=store.extra)
    (m / "arr" / "notes.txt").write_bytes(b"kept by fsync")
    assert store.get("arr/notes.txt") is None  # (held)
    fd = os.open(m / "arr" / "notes.txt", os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    assert store.get("arr/notes.txt") == b"kept by fsync"


def test_made_directories_are_remembered_only_while_empty(store, mount):
    """mkdir of plain directories: on S3 (no directories there) an empty one
    exists in the mount's memory; once a file is stored below it, the
    listing shows it and the mount forgets it (bounded memory). Local
    directories are real at once."""
    m = mount(store.source, "flush_delay=60", extra=store.extra)
    (m / "top").mkdir()
    for i in range(20):
        (m / "top" / f"d{i}").mkdir()
        (m / "top" / f"d{i}" / "f.txt").write_bytes(b"x%d" % i)  # passthrough: stored at close
    (m / "top" / "empty").mkdir()
    assert sorted(os.listdir(m / "top")) == sorted([f"d{i}" for i in range(20)] + ["empty"])
    assert os.listdir(m / "top" / "empty") == []
    os.listdir(m)
    made = m.stats()["made_dirs"]
    assert made == (1 if store.source.startswith("s3://") else 0), made
    assert (m / "top" / "d7" / "f.txt").read_bytes() == b"x7"
    os.rmdir(m / "top" / "empty")
    os.listdir(m / "top")
    assert m.stats()["made_dirs"] == 0
    # a local directory stays when its last file goes, as on any file system
    # (on S3 it has nothing left to exist by, once the kernel's entry expires)
    os.unlink(m / "top" / "d3" / "f.txt")
    if store.kind == "local":
        assert (m / "top" / "d3").is_dir() and (store.root / "top" / "d3").is_dir()


def test_directories_made_where_no_one_lists_are_remembered_within_a_bound(mount, tmp_path):
    """A service making a directory per run, where nothing lists: a local
    store holds each directory made, so the mount remembers at most
    View.NEW_DIRS_MAX of them (4096; the least recently made or looked up
    go first, and storage answers for them), and every one is still there
    to stat and listings.  Before, each mkdir stayed in memory for the life
    of the mount: 5000 made, 5000 entries."""
    (tmp_path / "src").mkdir()
    m = mount(tmp_path / "src")
    (m / "runs").mkdir()
    for i in range(5000):
        os.mkdir(m / "runs" / f"r{i}")
    held = m.stats()["tables"]["new_dirs"]
    assert held <= 4096, held
    for i in range(5000):
        assert stat.S_ISDIR(os.stat(m / "runs" / f"r{i}").st_mode), i
    assert sorted(os.listdir(m / "runs")) == sorted(f"r{i}" for i in range(5000))
    assert sorted(os.listdir(tmp_path / "src" / "runs")) == sorted(f"r{i}" for i in range(5000))


def test_rename_moves_the_open_file_with_it(store, mount, tmp_path):
    """As on POSIX, a file renamed while open for writing keeps receiving
    that handle's writes under its new name: a plain file, a temporary
    renamed onto a chunk, a chunk renamed onto a chunk, and Python's
    ``os.replace`` inside the ``with`` block (its buffered bytes are written
    after the rename).  Nothing reappears under the old names."""
    data = np.arange(64, dtype="<i4").reshape(8, 8)
    seed_array(store, tmp_path, "arr", (8, 8), (2, 2), (4, 4), "<i4", data=data)
    m = mount(store.source, "flush_delay=60", extra=store.extra)
    c = m / "arr" / "c"
    chunk = raw_chunk(7)
    cases = [(m / "notes.tmp", m / "notes.txt", b"11112222"),
             (c / "0" / ".0.partial", c / "0" / "0", chunk),
             (c / "1" / "1", c / "2" / "2", chunk)]
    for old, new, content in cases:
        fd = os.open(old, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        try:
            os.write(fd, content[:6])
            os.rename(old, new)
            os.write(fd, content[6:])
        finally:
            os.close(fd)
        assert new.read_bytes() == content, new
        assert not old.exists(), old
    with open(c / "3" / "3.tmp", "wb") as f:
        f.write(raw_chunk(9))
        os.replace(c / "3" / "3.tmp", c / "3" / "3")
    assert (c / "3" / "3").read_bytes() == raw_chunk(9)
    m.umount()
    assert store.get("notes.txt") == b"11112222" and store.get("notes.tmp") is None
    got = stored_chunks(store, "arr", (2, 2))
    assert got[0, 0] == chunk and got[2, 2] == chunk and got[3, 3] == raw_chunk(9)
    assert (1, 1) not in got
    assert got[0, 1] == data[0:2, 2:4].tobytes()


def test_names_outside_the_grid_are_refused(store, mount, tmp_path):
    """A name spelled as a chunk but outside the array's grid can never be
    stored: creating it, renaming onto it or making it a directory fails
    at once with ENOENT (it was once accepted, kept in memory and dropped
    at the next sync, after fsync had returned 0)."""
    data = np.arange(64, dtype="<i4").reshape(8, 8)
    seed_array(store, tmp_path, "arr", (8, 8), (2, 2), (4, 4), "<i4", data=data)
    seed_array(store, tmp_path, "dot", (8, 8), (2, 2), (4, 4), "<i4", data=data, sep=".")
    m = mount(store.source, "flush_delay=60", extra=store.extra)
    for name in ("arr/c/0/4", "arr/c/0/17", "dot/c.0.4", "dot/c.4.0"):
        with pytest.raises(FileNotFoundError):
            write_file(m / name, raw_chunk(1), fsync=True)
    with pytest.raises(FileNotFoundError):
        os.rename(m / "arr/c/2/3", m / "arr/c/2/5")
    with pytest.raises(FileNotFoundError):
        os.mkdir(m / "arr/c/4")
    assert (m / "arr/c/2/3").read_bytes() == data[4:6, 6:8].tobytes()
    (m / "arr/c/0/0.tmp").write_bytes(b"a temporary name is still fine")
    os.unlink(m / "arr/c/0/0.tmp")
    m.umount()
    assert stored_chunks(store, "arr", (2, 2))[2, 3] == data[4:6, 6:8].tobytes()
    assert "discarded" not in m.log_text()  # nothing was kept only to be dropped


def test_names_outside_a_shrunk_grid_are_refused_through_directories_the_kernel_holds(store, mount, tmp_path):
    """A chunk directory (and chunk) the kernel looked up while the array was
    larger, then outside the shape a ``zarr.json`` written through the view
    shrank: its cached entry still leads the kernel to it, yet names below it
    are refused (ENOENT), as after a fresh lookup.  (A create, an open for
    writing and a rename onto a name there were accepted: written into the
    shard with the old grid, never listed; found by the differential tester.)"""
    data = np.arange(64, dtype="<i4").reshape(8, 8)
    seed_array(store, tmp_path, "arr", (8, 8), (2, 2), (4, 4), "<i4", data=data)
    m = mount(store.source, "flush_delay=60", "attr_timeout=3600", extra=store.extra)
    assert os.path.isdir(m / "arr/c/3") and os.path.isfile(m / "arr/c/3/0")  # (the kernel holds both)
    doc = json.loads((m / "arr/zarr.json").read_bytes())
    doc["shape"] = [6, 8]  # by the document only: the stored chunks of row 3 stay, hidden
    (m / "arr/zarr.json").write_text(json.dumps(doc))
    with pytest.raises(FileNotFoundError):
        write_file(m / "arr/c/3/1", raw_chunk(7))
    with pytest.raises(FileNotFoundError):
        write_file(m / "arr/c/3/0", raw_chunk(7))
    with pytest.raises(FileNotFoundError):
        os.rename(m / "arr/c/0/0", m / "arr/c/3/2")
    assert sorted(os.listdir(m / "arr/c")) == ["0", "1", "2"]
    assert (m / "arr/c/0/0").read_bytes() == data[0:2, 0:2].tobytes()
    m.umount()
    stored = stored_chunks(store, "arr", (2, 2))
    assert [stored[3, j] for j in range(3)] == [data[6:8, 2 * j:2 * j + 2].tobytes() for j in range(3)]  # as they were


def test_directories_outside_the_grid_of_a_v2_keyed_array_are_refused(store, mount, tmp_path):
    """With the ``v2`` key encoding and ``/`` the chunk directories begin in
    the array's own directory (``arr/9``): one outside the grid is ENOENT at
    ``mkdir``, as ``arr/c/9`` is with the default encoding.  (It was made, in
    memory only: listed, yet refusing every file below, and gone at unmount.)"""
    local = tmp_path / "seed"
    a = zarr.create_array(store=str(local), shape=(8, 8), chunks=(2, 2), shards=(4, 4), dtype="<i4",
                          compressors=None, fill_value=0, chunk_key_encoding={"name": "v2", "separator": "/"})
    a[...] = np.arange(64, dtype="<i4").reshape(8, 8)
    store.put_tree(local, "arr")
    m = mount(store.source, "flush_delay=60", extra=store.extra)
    for name in ("4", "9"):
        with pytest.raises(FileNotFoundError):
            os.mkdir(m / "arr" / name)
        assert not (m / "arr" / name).exists()
    with pytest.raises(FileExistsError):
        os.mkdir(m / "arr/3")
    assert sorted(os.listdir(m / "arr")) == ["0", "1", "2", "3", "zarr.json"]
    assert "arr/9: outside the chunk grid" in m.log_text()


def test_directories_that_can_be_no_part_of_a_chunk_key_are_refused_at_once(store, mount, tmp_path):
    """``cp -r MNT/arr/c/0 MNT/arr/c/0x``: ``0x`` is in the array's chunk
    tree (claimed) but can never be part of a chunk key.  Its ``mkdir``
    is ENOENT at once, with one INFO line per directory naming the array,
    so ``cp`` fails loudly; before, it was made in memory, the files went
    into it as temporaries, ``cp`` exited 0 and unmounting dropped them
    all (one warning line).  For every encoding whose chunk keys make
    directories (default ``/``, v2 ``/``, the v3-draft transformer); where
    a name is no chunk key of the array's own directory (``c.0x`` with
    ``.``, ``0x`` of a v2 ``/`` array) it is a plain directory, stored as
    a directory store would.  Temporaries in valid chunk directories
    (rsync's ``.0.XXXXXX``) stay fine."""
    data = np.arange(64, dtype="<i4").reshape(8, 8)
    seed_array(store, tmp_path, "arr", (8, 8), (2, 2), (4, 4), "<i4", data=data)
    seed_array(store, tmp_path, "dot", (8, 8), (2, 2), (4, 4), "<i4", data=data, sep=".")
    local = tmp_path / "seed-v2"
    a = zarr.create_array(store=str(local), shape=(8, 8), chunks=(2, 2), shards=(4, 4), dtype="<i4",
                          compressors=None, fill_value=0, chunk_key_encoding={"name": "v2", "separator": "/"})
    a[...] = data
    store.put_tree(local, "v2")
    _put_transformer_array(store)
    m = mount(store.source, "flush_delay=60", extra=store.extra)
    src = tmp_path / "src"
    src.mkdir()
    (src / "0").write_bytes(raw_chunk(5))
    os.makedirs(m / "data/root/arr/c0", exist_ok=True)  # (the transformer array's data directory: its first chunk)
    (m / "data/root/arr/c0/0").write_bytes(b"\x07" * 6)

    copy = subprocess.run(["cp", "-r", str(m / "arr/c/0"), str(m / "arr/c/0x")], capture_output=True, text=True)
    assert copy.returncode != 0 and "arr/c/0x" in copy.stderr, copy
    refused = ["arr/c/0x", "arr/c/0/.d", "v2/0/0x", "data/root/arr/c0/0x", "data/root/arr/c1/x"]
    for bad in refused[1:]:
        copy = subprocess.run(["cp", "-r", str(src), str(m / bad)], capture_output=True, text=True)
        assert copy.returncode != 0 and bad in copy.stderr, (bad, copy)
    for bad in refused:
        assert not (m / bad).exists(), bad
        with pytest.raises(FileNotFoundError):
            os.mkdir(m / bad)
    assert sorted(os.listdir(m / "arr/c")) == ["0", "1", "2", "3"]
    text = m.log_text()
    for bad in refused:
        lines = [ln for ln in text.splitlines() if f"{bad}: " in ln and "no part of a chunk key" in ln]
        assert len(lines) == 1 and " INFO " in lines[0], (bad, text)

    for plain in ("dot/c.0x", "v2/0x"):  # (no chunk key's name: plain directories)
        copy = subprocess.run(["cp", "-r", str(src), str(m / plain)], capture_output=True, text=True)
        assert copy.returncode == 0, (plain, copy)
    (m / "arr/c/0/.0.Xa1b2c").write_bytes(raw_chunk(9))  # rsync's temporary, then its rename
    os.rename(m / "arr/c/0/.0.Xa1b2c", m / "arr/c/0/0")
    m.umount()
    assert "discarded" not in m.log_text()  # nothing was kept only to be dropped
    assert stored_chunks(store, "arr", (2, 2))[0, 0] == raw_chunk(9)
    for plain in ("dot/c.0x/0", "v2/0x/0"):
        assert store.get(plain) == raw_chunk(5), plain


def test_rsync_of_a_grown_array_and_the_line_that_says_why(store, mount, tmp_path):
    """``rsync -a`` of an unsharded twin whose array grew makes the new chunk
    directories before it copies ``zarr.json`` (sorted order): the mount
    refuses them (ENOENT, outside the stored grid), with one INFO line per
    directory naming the array's shape and the way out; copying the
    metadata first (SEMANTICS, Limits), or a second pass, copies it all."""
    data = np.arange(64, dtype="<i4").reshape(8, 8)
    seed_array(store, tmp_path, "arr", (8, 8), (2, 2), (4, 4), "<i4", data=data)
    m = mount(store.source, "flush_delay=60", extra=store.extra)
    twin = tmp_path / "twin"
    subprocess.run(["rsync", "-a", f"{m.path}/", f"{twin}/"], check=True, capture_output=True, timeout=120)
    grown = zarr.open_array(str(twin / "arr"), mode="r+")
    grown.resize((12, 8))
    grown[8:12, :] = 7
    assert (twin / "arr/c/5/3").is_file()

    first = subprocess.run(["rsync", "-a", f"{twin}/", f"{m.path}/"], capture_output=True, text=True, timeout=120)
    assert first.returncode != 0 and "arr/c/4" in first.stderr, first
    text = m.log_text()
    for d in ("arr/c/4", "arr/c/5"):
        lines = [ln for ln in text.splitlines() if f"{d}: outside the chunk grid" in ln]
        assert len(lines) == 1, (d, lines)  # one per directory, not per file
        assert " INFO " in lines[0] and "of arr (shape [8, 8])" in lines[0], lines[0]
        assert "write its larger zarr.json first" in lines[0], lines[0]
    assert not any("outside the chunk grid" in ln for ln in text.splitlines()
                   if not ("arr/c/4:" in ln or "arr/c/5:" in ln)), text

    # the metadata first (-m: no directory without a zarr.json in it), then the rest
    meta = subprocess.run(["rsync", "-a", "-m", "--include=*/", "--include=zarr.json", "--exclude=*",
                           f"{twin}/", f"{m.path}/"], capture_output=True, text=True, timeout=120)
    assert meta.returncode == 0, meta.stderr
    again = subprocess.run(["rsync", "-a", f"{twin}/", f"{m.path}/"], capture_output=True, text=True, timeout=120)
    assert again.returncode == 0, again.stderr
    m.umount()
    got = zarr.open_array(str(store.local_copy(tmp_path / "copy") / "arr"), mode="r")
    assert got.shape == (12, 8) and got.metadata.to_dict()["codecs"][0]["name"] == "sharding_indexed"
    assert (got[:8] == data).all() and (got[8:] == 7).all()


def test_open_for_writing_shows_what_the_view_shows(store, mount, tmp_path):
    """Opening a sharded array's zarr.json read-write (an editor, ``r+``)
    starts from the view's document, so other readers keep seeing valid
    metadata while it is open; closing it unchanged stores nothing.  A
    chunk file opened read-write and then unlinked by another process is
    still readable through its descriptor, as on POSIX."""
    data = np.arange(64, dtype="<i4").reshape(8, 8)
    seed_array(store, tmp_path, "arr", (8, 8), (2, 2), (4, 4), "<i4", data=data)
    stored_doc = store.get("arr/zarr.json")
    m = mount(store.source, "flush_delay=60", "open_fill=0", extra=store.extra)
    shown = (m / "arr/zarr.json").read_bytes()
    fd = os.open(m / "arr/zarr.json", os.O_RDWR)
    try:
        assert os.pread(fd, len(shown) + 10, 0) == shown
        out = subprocess.run([sys.executable, "-c", "import sys, zarr; "
                              f"print(int(zarr.open_array({str(m / 'arr')!r}, mode='r')[...].sum()))"],
                             capture_output=True, text=True, timeout=60)
        assert out.stdout.strip() == str(int(data.sum())), out.stderr
    finally:
        os.close(fd)
    m.umount()
    assert store.get("arr/zarr.json") == stored_doc

    m = mount(store.source, "flush_delay=60", extra=store.extra)
    chunk = m / "arr/c/1/2"
    fd = os.open(chunk, os.O_RDWR)
    try:
        os.pwrite(fd, b"ZZ", 0)
        os.unlink(chunk)
        assert os.pread(fd, 100, 0) == b"ZZ" + data[2:4, 4:6].tobytes()[2:]
    finally:
        os.close(fd)
    assert not chunk.exists()
    m.umount()

    # read-only descriptors too (nothing in the page cache to hide behind)
    m = mount(store.source, "flush_delay=60", "open_fill=0", extra=store.extra)
    fd = os.open(m / "arr/c/3/3", os.O_RDONLY)
    try:
        os.unlink(m / "arr/c/3/3")
        assert os.pread(fd, 100, 0) == data[6:8, 6:8].tobytes()
    finally:
        os.close(fd)


def test_cp_r_copies_an_array_into_a_shard_mount(store, mount, tmp_path):
    """``cp -r`` of an unsharded array into a ``-o shard=2`` mount stores it
    sharded.  cp makes each directory of the new array with mkdir right
    after writing chunks elsewhere, and treats EEXIST as an error: in an
    array made through the mount, a chunk directory exists only once made
    or written to, as in a directory store."""
    data = np.arange(8 * 8 * 4, dtype="<i4").reshape(8, 8, 4)
    src = tmp_path / "unsharded"
    zarr.create_array(store=str(src / "arr"), shape=data.shape, chunks=(2, 2, 2), dtype="<i4",
                      fill_value=0, compressors=None)[...] = data
    m = mount(store.source, "shard=2", "flush_delay=60", extra=store.extra)
    out = subprocess.run(["cp", "-r", src / "arr", m / "arr"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert not (m / "arr/c/0/7").exists()  # inside the grid, never written: no such directory
    np.testing.assert_array_equal(zarr.open_array(str(m / "arr"), mode="r")[...], data)
    m.umount()
    root = store.local_copy(tmp_path / "copy")
    stored = zarr.open_array(str(root / "arr"), mode="r")
    # GNU cp copies a directory's entries in inode order (gnulib savedir,
    # SAVEDIR_SORT_FASTREAD), not readdir's: chunks before zarr.json make the
    # array plain (never a sharded document over plain chunks, SEMANTICS 4.12)
    first = min(os.scandir(src / "arr"), key=lambda e: e.inode()).name
    assert stored.shards == ((4, 4, 4) if first == "zarr.json" else None)
    np.testing.assert_array_equal(stored[...], data)
    m = mount(store.source, "ro", extra=store.extra)
    assert (m / "arr/c/3/3").is_dir()  # an array found in storage: as before
    np.testing.assert_array_equal(zarr.open_array(str(m / "arr"), mode="r")[...], data)


@pytest.mark.parametrize("shard", [None, "2"])
def test_mv_of_a_sharded_array_within_the_mount_renames_it_locally_and_copies_it_on_s3(store, mount, tmp_path,
                                                                                       shard):
    """``mv`` of a sharded array to another name in the same mount: on a
    local store the stored directory is renamed (SEMANTICS 4.18), so it keeps
    its shards whatever ``-o shard`` says; on S3 (a limit, SEMANTICS Limits)
    rename gets EXDEV and ``mv`` copies, so the copy is a new array written
    through the view: stored unsharded (one object per chunk) without ``-o
    shard``, sharded by K with it (not by the shard shape it had).  Either
    way its data and the view of it are the same, and the old array is gone."""
    data = np.arange(8 * 8, dtype="<i4").reshape(8, 8)
    seed_array(store, tmp_path, "arr", (8, 8), (2, 2), (8, 8), "<i4", data=data)
    assert {k for k in store.keys() if k.startswith("arr/c/")} == {"arr/c/0/0"}
    m = mount(store.source, "flush_delay=60", *([f"shard={shard}"] if shard else []), extra=store.extra)
    out = subprocess.run(["mv", str(m / "arr"), str(m / "moved")], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert not (m / "arr").exists()
    np.testing.assert_array_equal(zarr.open_array(str(m / "moved"), mode="r")[...], data)
    m.umount()
    root = store.local_copy(tmp_path / "copy")
    stored = zarr.open_array(str(root / "moved"), mode="r")
    np.testing.assert_array_equal(stored[...], data)
    chunks = {k for k in store.keys() if k.startswith("moved/c/")}
    if store.kind == "local":
        assert stored.shards == (8, 8) and chunks == {"moved/c/0/0"}, chunks
    elif shard is None:
        assert stored.shards is None and len(chunks) == 16, chunks
    else:
        assert stored.shards == (4, 4) and len(chunks) == 4, chunks
    assert not any(k.startswith("arr/") for k in store.keys())



@pytest.mark.parametrize("shard", [None, "2"])
def test_mv_t_of_a_sharded_array_moves_it_file_by_file(store, mount, tmp_path, shard):
    """``mv -T`` of a sharded array (below a group) to a new name, where the
    directory's rename is EXDEV (S3: SEMANTICS Limits): GNU mv 9.1 makes the
    new directory, then renames each file into it, ``zarr.json`` too.  That
    rename stores the document at the new name in the form the view shows
    (as a copy would), where its stored form, a new sharded array with none
    of its shards there, is refused.  Before, it was EPERM (one ERROR line):
    ``mv`` failed half done, the chunks at the new name as plain files of a
    plain directory, the old array left with no chunk
    (scripts/fuzz_dir_renames.py --s3, seed 1 step 0)."""
    data = np.arange(16 * 16, dtype="<i4").reshape(16, 16) + 1
    group = json.dumps({"zarr_format": 3, "node_type": "group", "attributes": {}}).encode()
    store.put("g/zarr.json", group)
    seed_array(store, tmp_path, "g/arr", (16, 16), (4, 4), (8, 8), "<i4", data=data)
    m = mount(store.source, "flush_delay=60", *([f"shard={shard}"] if shard else []), extra=store.extra)
    before = {p.relative_to(m / "g/arr").as_posix(): p.read_bytes() for p in (m / "g/arr").rglob("*") if p.is_file()}
    out = subprocess.run(["mv", "-T", str(m / "g/arr"), str(m / "moved")], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert not (m / "g/arr").exists()
    after = {p.relative_to(m / "moved").as_posix(): p.read_bytes() for p in (m / "moved").rglob("*") if p.is_file()}
    assert after == before
    np.testing.assert_array_equal(zarr.open_array(str(m / "moved"), mode="r")[...], data)
    zs("sync", m.path)
    assert " ERROR " not in m.log_text(), m.log_text()[-2000:]
    m.umount()
    root = store.local_copy(tmp_path / "copy")
    np.testing.assert_array_equal(zarr.open_array(str(root / "moved"), mode="r")[...], data)
    assert not any(k.startswith("g/arr/") for k in store.keys())


def test_a_directory_made_where_an_array_was_moved_away_holds_nothing(store, mount, tmp_path):
    """``mv -T`` of an array (on S3 a copy: its files renamed one by one,
    then its directories removed), then ``mkdir`` at its old name: the new
    directory holds nothing, as on a directory store.  Before, the array
    probed there (cached for metadata_ttl) outlived the rmdir: ``c`` was
    found in the new, empty directory (stat answered, mkdir was EEXIST), so
    a second ``mv -T`` to that name failed half done
    (scripts/fuzz_dir_renames.py --s3, seed 60036 step 13)."""
    store.put("g/zarr.json", json.dumps({"zarr_format": 3, "node_type": "group", "attributes": {}}).encode())
    seed_array(store, tmp_path, "g/arr", (16, 16), (4, 4), (8, 8), "<i4", data=np.ones((16, 16), "<i4"))
    m = mount(store.source, "flush_delay=60", "shard=2", extra=store.extra)
    out = subprocess.run(["mv", "-T", str(m / "g/arr"), str(m / "g/moved")], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    os.mkdir(m / "g/arr")
    assert not (m / "g/arr/c").exists()
    os.mkdir(m / "g/arr/c")  # (EEXIST before)
    assert os.listdir(m / "g/arr") == ["c"]


# ---------------------------------------------------------------------------
# back-pressure


def test_back_pressure_bounds_dirty_memory(store, mount, tmp_path):
    """20 MiB of 64 KiB chunks into 4 MiB shards with max_dirty=1M: the
    writer waits instead of holding more, and everything lands."""
    seed_array(store, tmp_path, "big", (320, 65536), (1, 65536), (64, 65536), "uint8")
    seed_array(store, tmp_path, "huge", (2, 3 << 20), (1, 3 << 20), (2, 3 << 20), "uint8")
    m = mount(store.source, "max_dirty=1M,flush_delay=60", extra=store.extra)
    chunk = 65536
    content = {i: (i.to_bytes(2, "little") * (chunk // 2)) for i in range(320)}
    peak = [0]
    done = threading.Event()

    def watch():
        while not done.is_set():
            peak[0] = max(peak[0], xstats(m)["writeback"]["dirty_bytes"])
            time.sleep(0.005)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        for i in range(320):
            write_file(m / "big" / chunk_name((i, 0), "/"), content[i])
            if i % 100 == 50:
                peak[0] = max(peak[0], m.stats()["writeback"]["dirty_bytes"])  # the CLI says the same
    finally:
        done.set()
        watcher.join()
    assert 0 < peak[0] <= (1 << 20) + 2 * chunk, peak[0]

    # one chunk larger than the cap, in 128 KiB writes: flushed while open,
    # it must not keep its writer waiting for room that no flush can make
    huge = b"".join(bytes([i]) * (128 << 10) for i in range(24))
    before = xstats(m)["writeback"]["flushes"]

    def write_huge():
        with open(m / "huge" / chunk_name((0, 0), "/"), "wb", buffering=0) as f:
            for i in range(24):
                f.write(huge[i << 17: (i + 1) << 17])

    writer = threading.Thread(target=write_huge, daemon=True)
    writer.start()
    writer.join(60)
    if writer.is_alive():  # stuck in the kernel: abort the mount so the failure does not hang pytest
        os.kill(int(os.getxattr(m.path, "user.zshardfs.pid")), signal.SIGKILL)
        subprocess.run(["fusermount3", "-uz", str(m.path)], capture_output=True)
        m.mounted = False
        pytest.fail("a writer of a chunk larger than max_dirty never finished")
    assert xstats(m)["writeback"]["flushes"] - before < 40  # no flush storm either
    assert (m / "huge" / chunk_name((0, 0), "/")).read_bytes() == huge
    zs("sync", m.path)
    m.umount()
    got = stored_chunks(store, "big", (64, 1))
    assert got.keys() == {(i, 0) for i in range(320)}
    assert all(got[i, 0] == content[i] for i in range(320))
    assert stored_chunks(store, "huge", (2, 1)) == {(0, 0): huge}


# ---------------------------------------------------------------------------
# read-your-writes after a flush (found by the thread/process test above, which
# hits it only now and then; this reproduces it deterministically, in process)


def test_index_load_overlapping_a_flush_is_not_cached(tmp_path):
    """An index load that read the shard before a flush replaced it, and
    answered after the flush dropped the cache, must not be cached: reads
    after the flush would see the old chunks for ``index_ttl``."""
    import trio

    from zshardfs.backends.base import AsyncStore
    from zshardfs.backends.local import LocalBackend
    from zshardfs.layouts.zarr_common import ZarrShardFormat
    from zshardfs.shards import ShardCache

    async def main():
        store = AsyncStore(LocalBackend(str(tmp_path)))
        fmt = ZarrShardFormat("end", "little", checksum=True)
        await store.put("s", fmt.encode({0: b"old"}, (2,)))
        cache = ShardCache(store)
        real_get, answer = store.get, trio.Event()

        async def late_get(*args, **kwargs):
            blob = await real_get(*args, **kwargs)  # reads the old version ...
            await answer.wait()  # ... and answers after the flush
            return blob

        store.get = late_get
        async with trio.open_nursery() as nursery:
            nursery.start_soon(cache.index, fmt, "s", (2,))
            await trio.sleep(0.05)
            store.get = real_get
            await store.put("s", fmt.encode({0: b"new"}, (2,)))  # what a flush does: PUT, then forget
            cache.forget("s")
            answer.set()
        assert await cache.read_chunk(fmt, "s", 0, (2,)) == b"new"

    trio.run(main)


def test_a_sharded_zarr_json_with_another_sharding_is_refused(store, mount, tmp_path):
    """A sharded ``zarr.json`` written through the view over a sharded
    array (a sharding-aware tool, or a saved copy put back) is stored when it
    lays the shards out as the stored one does, whatever its attributes or
    shape; with other sharding (here the index at the start) it is refused
    with EPERM: the stored shards would all read as damaged."""
    data = np.arange(64, dtype="<i4").reshape(8, 8) + 1
    seed_array(store, tmp_path, "arr", (8, 8), (2, 2), (4, 4), "<i4", data=data)
    stored = json.loads(store.get("arr/zarr.json"))
    m = mount(store.source, extra=store.extra)
    other = json.loads(json.dumps(stored))
    other["codecs"][0]["configuration"]["index_location"] = "start"
    with pytest.raises(PermissionError):
        (m / "arr" / "zarr.json").write_text(json.dumps(other))
    (m / "arr" / "zarr.json").write_text(json.dumps(dict(stored, attributes={"kept": 1})))
    np.testing.assert_array_equal(zarr.open_array(str(m / "arr"), mode="r")[:], data)
    m.umount()
    assert m.log_text().count("would make its stored shards unreadable") == 1
    assert json.loads(store.get("arr/zarr.json")) == dict(stored, attributes={"kept": 1})


#: a writer process: replaces ``argv[1]`` by temp + rename, as zarr-python's
#: LocalStore writes chunks, with versions of varying size that name their
#: own number and length, until killed
REPLACE_FOREVER = """
import os, sys
path, k = sys.argv[1], 0
while True:
    k += 1
    n = 64 + (k * 37) % 4000
    with open(f"{path}.{k}.partial", "wb") as f:
        f.write(k.to_bytes(4, "little") + n.to_bytes(4, "little") + bytes([k % 251]) * n)
    os.replace(f"{path}.{k}.partial", path)
"""


def test_readers_of_a_file_replaced_by_rename_get_one_whole_version(mount, tmp_path):
    """While another process replaces a chunk file (temp + rename) over and
    over, every read of it is one whole version, as on a directory store.
    Before, about one read in 300 came back as one version's bytes cut to
    another's size: a reader's open of the file the rename had just
    replaced got the new bytes, while the kernel held the old size (and a
    lookup running across the rename could give the new file the old
    size).  Such an open now answers ESTALE, on which the kernel looks the
    name up again and opens the new file; twice in a row, rarely, the error
    reaches the reader."""
    (tmp_path / "src").mkdir()  # (the race is the kernel's and the view's: one store is enough)
    m = mount(tmp_path / "src", "shard=4")
    zarr.create_array(str(m / "arr"), shape=(64 * 16,), chunks=(64,), dtype="u1", compressors=None)[:] = 1
    chunk = str(m / "arr" / "c" / "0")
    writer = subprocess.Popen([sys.executable, "-c", REPLACE_FOREVER, chunk])
    torn, whole, stale = [], 0, 0
    try:
        # 2000 whole reads, or as many as 30 s give (a loaded machine): before
        # the fix one read in about 300 was torn
        deadline = time.monotonic() + 30
        while whole < 2000 and time.monotonic() < deadline:
            try:
                with open(chunk, "rb") as f:
                    data = f.read()
            except OSError as exc:
                assert exc.errno == errno.ESTALE, exc
                stale += 1
                continue
            if len(data) == 64 and data == b"\x01" * 64:
                continue  # the first version, zarr's
            k, n = int.from_bytes(data[:4], "little"), int.from_bytes(data[4:8], "little")
            if len(data) == 8 + n and data[8:] == bytes([k % 251]) * n:
                whole += 1
            else:
                torn.append((len(data), n))
    finally:
        writer.kill()
        writer.wait(30)
    print(f"{whole} whole reads, {stale} ESTALE, {len(torn)} torn")
    assert whole > 1000, (whole, stale, len(torn))
    assert not torn, f"{len(torn)} of {whole + len(torn)} reads torn: {torn[:5]}"
    assert stale <= whole // 100, (stale, whole)


def test_mode_and_time_changes_on_a_written_file_keep_its_size(store, mount, tmp_path):
    """``fchmod``/``futimens`` after writing (``cp -p``, ``cp -a``,
    ``install``, vim) answer with the file's size as it is now, bytes not
    yet stored included.  Before, the answer carried the size from before
    the write, which the kernel believed: readers saw the file empty or cut,
    and an append after ``cp -p`` landed at the old end, leaving zeros."""
    data = np.arange(64, dtype="<i4").reshape(8, 8)
    seed_array(store, tmp_path, "arr", (8, 8), (2, 2), (4, 4), "<i4", data=data)
    m = mount(store.source, "flush_delay=60", extra=store.extra)
    (m / "notes.txt").write_bytes(b"0123456789")
    (tmp_path / "short.txt").write_bytes(b"hello\n")
    subprocess.run(["cp", "-p", str(tmp_path / "short.txt"), str(m / "notes.txt")], check=True)
    with open(m / "notes.txt", "ab") as f:
        f.write(b"world\n")
    assert (m / "notes.txt").read_bytes() == b"hello\nworld\n"
    for rel, body in (("arr/c/1/1", raw_chunk(42)), ("arr/zarr.json", (m / "arr" / "zarr.json").read_bytes()),
                      ("plain.txt", b"x" * 100)):
        fd = os.open(m / rel, os.O_WRONLY | os.O_CREAT, 0o644)
        try:
            os.ftruncate(fd, 0)
            os.write(fd, body)
            os.fchmod(fd, 0o644)
            os.utime(fd, (1_000_000_000, 1_000_000_000))
            assert os.fstat(fd).st_size == len(body), rel
        finally:
            os.close(fd)
        assert os.stat(m / rel).st_size == len(body), rel
        assert (m / rel).read_bytes() == body, rel
    subprocess.run(["install", "-m", "644", str(tmp_path / "short.txt"), str(m / "arr" / "c" / "2" / "2")], check=True)
    assert (m / "arr" / "c" / "2" / "2").read_bytes() == b"hello\n"
    zs("sync", m.path)
    assert store.get("notes.txt") == b"hello\nworld\n"


def test_a_chunk_not_stored_yet_keeps_one_mtime_and_touch_changes_none(store, mount, tmp_path):
    """A chunk written and not stored yet shows the time of its last write,
    the same at every stat; one opened for writing and left unwritten
    (``touch``, ``touch -d``) keeps its stored mtime.  Before, every answer
    for a chunk pending in the write-back gave the time of that answer:
    ``tar c`` of the directory failed ("file changed as we read it", exit
    1), ``rsync -a`` sent the chunk at every run, and ``touch -d 2001-01-01``
    showed the time of the touch (until ``attr_timeout``), not the stored
    one."""
    data = np.arange(64, dtype="<i4").reshape(8, 8)
    seed_array(store, tmp_path, "arr", (8, 8), (2, 2), (4, 4), "<i4", data=data)
    m = mount(store.source, "flush_delay=60", "attr_timeout=0", extra=store.extra)
    stored = os.stat(m / "arr/c/0/1").st_mtime
    write_file(m / "arr/c/0/0", raw_chunk(7))
    written = os.stat(m / "arr/c/0/0").st_mtime
    time.sleep(0.3)
    assert os.stat(m / "arr/c/0/0").st_mtime == written
    tar = subprocess.run(["tar", "cf", str(tmp_path / "a.tar"), "-C", str(m.path), "arr"], capture_output=True, text=True)
    assert tar.returncode == 0, tar.stderr
    for cmd in (["touch", "-d", "2001-01-01"], ["touch"], ["touch", "-m"]):
        subprocess.run([*cmd, str(m / "arr/c/0/1")], check=True)
        assert os.stat(m / "arr/c/0/1").st_mtime == stored, cmd
    assert os.stat(m / "arr/c/0/0").st_mtime == written
    rsync = subprocess.run(f"rsync -a '{m / 'arr'}/' '{tmp_path}/copy/' && rsync -ai '{m / 'arr'}/' '{tmp_path}/copy/'",
                           shell=True, capture_output=True, text=True)
    assert rsync.returncode == 0 and not rsync.stdout.strip(), rsync.stdout + rsync.stderr
    m.umount()
    assert stored_chunks(store, "arr", (2, 2))[0, 0] == raw_chunk(7)


def test_a_directory_made_here_keeps_one_mtime(store, mount, tmp_path):
    """A directory made through the mount that only the mount knows of yet
    (its parent not listed since; on S3 an empty one) shows the time it was
    made, the same at every stat.  Before, every lookup gave the time of
    that lookup (``find -newer`` found it newer than anything, ``rsync -a``
    out of the mount set its time at every run)."""
    m = mount(store.source, "flush_delay=60", "shard=2", "attr_timeout=0", extra=store.extra)
    local = tmp_path / "t"
    zarr.create_array(store=str(local), shape=(8, 8), chunks=(2, 2), dtype="<i4", compressors=None)
    (m / "new").mkdir()
    (m / "new/zarr.json").write_bytes((local / "zarr.json").read_bytes())
    (m / "new/c/0").mkdir(parents=True)
    (m / "empty").mkdir()
    seen = {p: os.stat(m / p).st_mtime for p in ("new/c", "new/c/0", "empty")}
    time.sleep(0.3)
    assert {p: os.stat(m / p).st_mtime for p in seen} == seen
    assert all(0 < time.time() - t < 60 for t in seen.values()), seen
    # and once their parents are listed (``ls``, ``find``): the same time,
    # in the listing and in a lookup after it, not the mount's start
    # (it went back to that: ``find -newer``/``rsync -a`` saw it change)
    listed = {}
    for parent in ("", "new", "new/c"):
        with os.scandir(m / parent) as it:
            listed.update({f"{parent}/{e.name}".lstrip("/"): e.stat().st_mtime for e in it if e.is_dir()})
    assert {p: listed[p] for p in seen} == seen
    assert {p: os.stat(m / p).st_mtime for p in seen} == seen


def test_touch_of_a_plain_file_keeps_its_stored_mtime(store, mount, tmp_path):
    """``touch``/``touch -d`` of a stored plain file (an open for writing,
    then ``futimens``) changes no time: the answer to the ``futimens``,
    which the kernel keeps for ``attr_timeout``, gives the stored mtime.
    Before, it gave the time of the open (the buffer the open made took
    it), and ``stat`` showed that for 5 s, then the stored time again."""
    store.put("notes.txt", b"0123456789")
    m = mount(store.source, "flush_delay=60", extra=store.extra)
    stored = os.stat(m / "notes.txt").st_mtime
    time.sleep(1.1)
    for cmd in (["touch", "-d", "2001-01-01"], ["touch"]):
        subprocess.run([*cmd, str(m / "notes.txt")], check=True)
        assert os.stat(m / "notes.txt").st_mtime == stored, cmd
    assert (m / "notes.txt").read_bytes() == b"0123456789"


def test_an_append_after_another_client_grew_the_file_lands_at_its_end(store, mount, tmp_path):
    """``>>`` (``O_APPEND``) through the mount, shortly after another client
    made the file longer (within ``attr_timeout``, while the kernel still
    held the old size), lands at the file's end, a plain file's and a
    chunk's.  Before, the kernel wrote at the end it knew, which the
    daemon took as an offset: the append overwrote the other client's last
    bytes (``line 1\nline 3\nby another client\n``)."""
    store.put("log.txt", b"line 1\n")
    values = np.arange(64, dtype="<i4").reshape(8, 8)
    seed_array(store, tmp_path, "arr", (8, 8), (2, 2), (4, 4), "<i4", data=values,
               compressors=zarr.codecs.GzipCodec(level=1))
    m = mount(store.source, "flush_delay=60", "metadata_ttl=0.3", "index_ttl=0.3", extra=store.extra)
    assert (m / "log.txt").read_bytes() == b"line 1\n"  # (the kernel holds its size now)
    old_chunk = (m / "arr/c/0/0").read_bytes()
    store.put("log.txt", b"line 1\nline 2 by another client\n")
    grown = tmp_path / "grown"
    seed_array(Store("local", root=grown), tmp_path, "arr", (8, 8), (2, 2), (4, 4), "<i4",
               data=np.random.default_rng(1).integers(0, 2**31, (8, 8)).astype("<i4"),
               compressors=zarr.codecs.GzipCodec(level=1))
    store.put("arr/c/0/0", (grown / "arr/c/0/0").read_bytes())
    new_chunk = stored_chunks(store, "arr", (2, 2))[0, 0]
    assert len(new_chunk) > len(old_chunk)
    time.sleep(0.6)  # past metadata_ttl and index_ttl (0.3 s), within attr_timeout (5 s)
    with open(m / "log.txt", "ab") as f:
        f.write(b"line 3\n")
    fd = os.open(m / "arr/c/0/0", os.O_WRONLY | os.O_APPEND)
    try:
        os.write(fd, b"TAIL")
    finally:
        os.close(fd)
    assert (m / "log.txt").read_bytes() == b"line 1\nline 2 by another client\nline 3\n"
    assert (m / "arr/c/0/0").read_bytes() == new_chunk + b"TAIL"
    m.umount()
    assert store.get("log.txt") == b"line 1\nline 2 by another client\nline 3\n"
    assert stored_chunks(store, "arr", (2, 2))[0, 0] == new_chunk + b"TAIL"


@pytest.mark.parametrize("case", ["shorter", "grown_while_open", "own_handles", "mapped"])
def test_an_append_lands_at_the_end_this_mount_holds(store, mount, tmp_path, case):
    """Each ``O_APPEND`` write lands at the end of the file as this mount
    holds it (libfuse: without the writeback cache the file system appends,
    the kernel's offset is its cached end), a plain file's and a chunk's:
    after another client made the file shorter (within ``attr_timeout``, the
    kernel still holding the longer size), after another client made it
    longer while another handle of it was open (the kernel not told the new
    end), and for this mount's own handles appending in turn.  Before, the
    kernel's end was taken as the offset: the first left a hole of zeros
    (``line 1\\n\\0\\0...line 3\\n``), the second overwrote the other
    client's last bytes.  The kernel's offset is not simply ignored: the
    pages of a shared writable mapping of an ``O_APPEND`` descriptor are
    written back through it, and land where they lie, as on ext4
    (``mapped``: appending every write doubled the file)."""
    values = np.arange(64, dtype="<i4").reshape(8, 8)
    seed_array(store, tmp_path, "arr", (8, 8), (2, 2), (4, 4), "<i4", data=values)
    store.put("log.txt", b"line 1\nline 2 by another client\n")
    m = mount(store.source, "flush_delay=60", "metadata_ttl=0.3", "index_ttl=0.3", extra=store.extra)
    chunk = m / "arr/c/0/0"
    old_log, old_chunk = (m / "log.txt").read_bytes(), chunk.read_bytes()  # (the kernel holds their sizes)
    readers = []

    def put_chunk(body):  # (the view passes a chunk's bytes through: any bytes will do)
        chunks = stored_chunks(store, "arr", (2, 2))
        store.put("arr/c/0/0", shard_bytes((2, 2), {2 * i + j: body if (i, j) == (0, 0) else chunks[i, j]
                                                    for i in range(2) for j in range(2)}))

    if case == "shorter":
        store.put("log.txt", b"line 1\n")
        put_chunk(b"short")
        base_log = b"line 1\n"
    elif case == "grown_while_open":
        readers = [os.open(m / "log.txt", os.O_RDONLY), os.open(chunk, os.O_RDONLY)]
        store.put("log.txt", old_log + b"line 3 by another client\n")
        put_chunk(old_chunk + b"grown by another client")
        base_log = old_log + b"line 3 by another client\n"
    else:
        base_log = old_log
    base_chunk = stored_chunks(store, "arr", (2, 2))[0, 0]
    assert (base_chunk != old_chunk) == (case in ("shorter", "grown_while_open"))
    time.sleep(0.6)  # past metadata_ttl and index_ttl (0.3 s), within attr_timeout (5 s)
    try:
        for path, base in ((m / "log.txt", base_log), (chunk, base_chunk)):
            a = os.open(path, os.O_WRONLY | os.O_APPEND)
            b = os.open(path, os.O_RDWR | os.O_APPEND) if case in ("own_handles", "mapped") else a
            try:
                os.write(a, b"A1\n")
                os.write(b, b"B1\n")
                if case == "mapped":
                    mapped = mmap.mmap(b, 0)
                    mapped[0:2] = b"M0"
                    mapped.close()  # (munmap: the page is written back through b)
                    base = b"M0" + base[2:]
                os.write(a, b"A2\n")
            finally:
                os.close(a)
                if b != a:
                    os.close(b)
            assert path.read_bytes() == base + b"A1\nB1\nA2\n", (case, path)
            if path.name == "log.txt":
                base_log = base
            else:
                base_chunk = base
    finally:
        for fd in readers:
            os.close(fd)
    m.umount()
    assert store.get("log.txt") == base_log + b"A1\nB1\nA2\n"
    assert stored_chunks(store, "arr", (2, 2))[0, 0] == base_chunk + b"A1\nB1\nA2\n"


def test_mapped_direct_and_kernel_side_copies_of_chunks(store, mount, tmp_path):
    """Tools that map files or move bytes inside the kernel work on chunk
    files as on a local file system: ``numpy.memmap`` and ``mmap`` read a
    chunk (read-only mounts too); ``MAP_SHARED`` writes on a writable mount
    reach the daemon at ``msync``/``munmap`` and are stored like any write
    (the kernel sends them as writes); ``O_DIRECT`` reads and writes (``dd
    iflag=direct``, ``oflag=direct``; unaligned: the next test); ``copy_file_range`` and
    ``sendfile`` within the mount and into it; ``cp --reflink=auto`` copies,
    ``--reflink=always`` fails with EOPNOTSUPP (no clones here)."""
    data = np.arange(64, dtype="<i4").reshape(8, 8)
    seed_array(store, tmp_path, "arr", (8, 8), (2, 2), (4, 4), "<i4", data=data)
    ro = mount(store.source, "ro", extra=store.extra)
    m = mount(store.source, "flush_delay=60", extra=store.extra)

    def chunk(i, j):
        return data[2 * i:2 * i + 2, 2 * j:2 * j + 2].tobytes()

    for mnt in (ro, m):
        a = np.memmap(mnt / "arr/c/1/1", dtype="<i4", mode="r", shape=(2, 2))
        assert a.tobytes() == chunk(1, 1)
        del a
    a = np.memmap(m / "arr/c/1/2", dtype="<i4", mode="r+", shape=(2, 2))
    a[:] = 777
    a.flush()
    del a
    with open(m / "arr/c/1/3", "r+b") as f:
        mp = mmap.mmap(f.fileno(), 0)
        mp[0:4] = b"\x01\x02\x03\x04"
        mp.close()  # (munmap, no msync)
    expected = {(1, 2): np.full((2, 2), 777, "<i4").tobytes(), (1, 3): b"\x01\x02\x03\x04" + chunk(1, 3)[4:]}
    src = tmp_path / "src"
    src.write_bytes(b"D" * 16)
    run = functools.partial(subprocess.run, capture_output=True, text=True)
    r = run(["dd", f"if={ro / 'arr/c/0/1'}", f"of={tmp_path / 'dd.out'}", "iflag=direct", "bs=4096"])
    assert r.returncode == 0 and (tmp_path / "dd.out").read_bytes() == chunk(0, 1), r.stderr
    r = run(["dd", f"if={src}", f"of={m / 'arr/c/2/0'}", "oflag=direct", "bs=4096"])
    assert r.returncode == 0, r.stderr
    expected[2, 0] = b"D" * 16
    r = run(["cp", "--reflink=auto", str(m / "arr/c/0/0"), str(m / "arr/c/2/1")])
    assert r.returncode == 0, r.stderr
    expected[2, 1] = chunk(0, 0)
    r = run(["cp", "--reflink=always", str(m / "arr/c/0/0"), str(m / "arr/c/2/2")])
    assert r.returncode != 0 and "Operation not supported" in r.stderr, r
    fin, fout = os.open(m / "arr/c/0/1", os.O_RDONLY), os.open(m / "arr/c/3/0", os.O_WRONLY | os.O_TRUNC)
    try:
        assert os.copy_file_range(fin, fout, 100) == 16
    finally:
        os.close(fin)
        os.close(fout)
    expected[3, 0] = chunk(0, 1)
    fin, fout = os.open(src, os.O_RDONLY), os.open(m / "arr/c/3/1", os.O_WRONLY | os.O_TRUNC)
    try:
        assert os.sendfile(fout, fin, 0, 100) == 16
    finally:
        os.close(fin)
        os.close(fout)
    expected[3, 1] = b"D" * 16
    for (i, j), body in expected.items():
        assert (m / f"arr/c/{i}/{j}").read_bytes() == body, (i, j)
    m.umount()
    stored = stored_chunks(store, "arr", (2, 2))
    for (i, j), body in expected.items():
        assert stored[i, j] == body, (i, j)


def test_o_direct_reads_and_writes_of_any_alignment(store, mount, tmp_path):
    """``O_DIRECT`` I/O at any offset, of any length, from any buffer address
    is served, as on NFS and other FUSE file systems: the kernel's FUSE
    module passes it on unaligned (there are no blocks here to align to),
    where ext4 refuses it with EINVAL.  A buffered reader of the file, whose
    pages its open filled, then reads what the direct write wrote (the
    kernel drops the pages it covers), as does a direct read; past the end a
    direct read gives nothing.  A direct write is held as any write (as a
    disk's volatile cache may hold one); with ``O_DSYNC`` it is stored when
    it returns.  (``dd oflag=direct`` of a short file does not show this:
    dd turns O_DIRECT off for a short last block.)"""
    data = np.arange(64, dtype="<i4").reshape(8, 8)
    seed_array(store, tmp_path, "arr", (8, 8), (2, 2), (4, 4), "<i4", data=data)
    store.put("plain.bin", bytes(range(100)))
    m = mount(store.source, "flush_delay=60", extra=store.extra)
    expected = {}
    for name in ("plain.bin", "arr/c/1/1"):
        path = m / name
        body = bytearray(path.read_bytes())
        reader = os.open(path, os.O_RDONLY)  # (its open fills the page cache)
        direct = os.open(path, os.O_RDWR | os.O_DIRECT)
        try:
            assert os.pread(reader, 200, 0) == body
            payload = memoryview(b"_XYZWV")[1:]  # (an odd buffer address)
            assert os.pwrite(direct, payload, 3) == 5
            body[3:8] = b"XYZWV"
            assert os.pwrite(direct, b"!", len(body) + 2) == 1  # (past the end: zeros between)
            body += b"\0\0!"
            assert os.pread(direct, 7, 1) == body[1:8]
            assert os.pread(direct, 4096, 0) == body
            assert os.pread(direct, 10, len(body)) == b""
            assert os.pread(reader, 200, 0) == body
            synced = os.open(path, os.O_WRONLY | os.O_DIRECT | os.O_DSYNC)
            try:  # (stored when it returns, as any O_DSYNC write: the kernel asks FSYNC)
                assert os.pwrite(synced, b"S", 0) == 1
                body[0:1] = b"S"
                assert (store.get(name) if name == "plain.bin" else stored_chunks(store, "arr", (2, 2))[1, 1]) == body
            finally:
                os.close(synced)
        finally:
            os.close(direct)
            os.close(reader)
        assert path.read_bytes() == body
        expected[name] = bytes(body)
    m.umount()
    assert store.get("plain.bin") == expected["plain.bin"]
    assert stored_chunks(store, "arr", (2, 2))[1, 1] == expected["arr/c/1/1"]


def test_tar_xattrs_extracts_files_it_makes_with_mknod(store, mount, tmp_path):
    """``tar --xattrs -x`` makes each file with ``mknod(S_IFREG)`` (to set
    its attributes before its bytes), then opens it: a regular file made so
    is an empty file, as after ``create`` and ``close``, a plain file's and
    a chunk's.  Before, ``mknod`` was EPERM for every type: tar extracted
    nothing ("f: Cannot open: Operation not permitted", exit 2).  Its
    extended attributes are not kept (ENOTSUP, a warning of tar's; exit 0),
    removing one is ENODATA (there are none), and FIFOs stay EPERM."""
    seed_array(store, tmp_path, "arr", (8, 8), (2, 2), (4, 4), "<i4", data=np.ones((8, 8), "<i4"))
    m = mount(store.source, "flush_delay=60", extra=store.extra)
    src = tmp_path / "src"
    src.mkdir()
    (src / "f").write_bytes(b"hello")
    os.setxattr(src / "f", "user.origin", b"lab")
    subprocess.run(["tar", "--xattrs", "-cf", str(tmp_path / "t.tar"), "-C", str(src), "f"], check=True)
    (m / "d").mkdir()
    for where, transform in ((m / "d", []), (m / "arr/c/0", ["--transform", "s,f,1,"])):
        r = subprocess.run(["tar", "--xattrs", "-xf", str(tmp_path / "t.tar"), "-C", str(where), *transform],
                           capture_output=True, text=True)
        assert r.returncode == 0, r.stderr
    assert (m / "d/f").read_bytes() == b"hello"
    assert (m / "arr/c/0/1").read_bytes() == b"hello"
    os.mknod(m / "empty")
    assert (m / "empty").read_bytes() == b"" and stat.S_ISREG(os.stat(m / "empty").st_mode)
    with pytest.raises(OSError) as err:
        os.removexattr(m / "d/f", "user.origin")
    assert err.value.errno == errno.ENODATA
    with pytest.raises(OSError) as err:
        os.mkfifo(m / "fifo")
    assert err.value.errno == errno.EPERM
    m.umount()
    assert store.get("d/f") == b"hello" and store.get("empty") == b""
    assert stored_chunks(store, "arr", (2, 2))[0, 1] == b"hello"


def test_a_failed_rename_leaves_its_target_as_it_was(tmp_path, mount):
    """A rename that fails (here: its source was removed behind the mount's
    back) leaves the target's open file as it was: appends through a
    descriptor held on it land at its end.  (A first version of the inode
    bookkeeping took the name from the target before the rename and never
    gave it back: the kernel was told the size from before the last append,
    and the next append overwrote it.)"""
    src = tmp_path / "src"
    (src / "fr").mkdir(parents=True)
    m = mount(src, "metadata_ttl=0", "attr_timeout=0.5")
    d = m.path / "fr"
    (d / "a").write_bytes(b"A")
    (d / "b").write_bytes(b"B" * 10)
    os.stat(d / "a")
    w = os.open(d / "b", os.O_WRONLY | os.O_APPEND)
    try:
        os.write(w, b"1" * 10)
        (src / "fr" / "a").unlink()  # another client
        with pytest.raises(OSError):
            os.rename(d / "a", d / "b")
        os.write(w, b"2" * 10)
        time.sleep(0.7)  # past attr_timeout: the kernel asks for the size again
        assert os.fstat(w).st_size == 30
        os.write(w, b"3" * 10)
    finally:
        os.close(w)
    assert (d / "b").read_bytes() == b"B" * 10 + b"1" * 10 + b"2" * 10 + b"3" * 10

def test_a_failed_rename_of_a_link_leaves_its_target_open_as_it_was(tmp_path, mount):
    """A symbolic link renamed over a file open for writing, and the rename
    fails (here: another client made the link a file, which the mount,
    trusting a fresh listing, learns only when moving it): the file keeps
    its name, its bytes and its writers, whose later writes are stored at
    their close.  Before, the failed rename had taken the file's buffer and
    writers off the name: what was written was lost, the bytes stored
    before stayed."""
    src = tmp_path / "src"
    src.mkdir()
    (src / "b").write_bytes(b"OLD")
    os.symlink("b", src / "l")
    m = mount(src, "metadata_ttl=60")
    assert sorted(os.listdir(m.path)) == ["b", "l"]  # (the listing the rename's lookup trusts)
    fd = os.open(m.path / "b", os.O_WRONLY)
    try:
        os.write(fd, b"NEW")
        (src / "l").unlink()  # another client
        (src / "l").write_bytes(b"a file now")
        with pytest.raises(OSError):
            os.rename(m.path / "l", m.path / "b")
        os.write(fd, b"MORE")
    finally:
        os.close(fd)
    assert (m.path / "b").read_bytes() == b"NEWMORE"
    assert (src / "b").read_bytes() == b"NEWMORE" and (src / "l").read_bytes() == b"a file now"


def test_a_plain_file_replaced_while_open_reads_one_version(tmp_path, mount):
    """A plain file replaced by temp + rename while a descriptor is open on
    it: that descriptor reads one whole version, its size and bytes agreeing
    (here the newer one, which this mount wrote)."""
    src = tmp_path / "src"
    (src / "mx").mkdir(parents=True)
    m = mount(src, "attr_timeout=1")
    d = m.path / "mx"
    (d / "f").write_bytes(b"o" * 10)
    fd = os.open(d / "f", os.O_RDONLY)
    try:
        (d / ".f.tmp").write_bytes(b"N" * 100)
        os.replace(d / ".f.tmp", d / "f")
        time.sleep(1.3)
        size, data = os.fstat(fd).st_size, os.pread(fd, 1000, 0)
        assert (size, data) in ((10, b"o" * 10), (100, b"N" * 100)), (size, data[:20])
    finally:
        os.close(fd)


def test_a_plain_file_replaced_while_open_unread_is_read_at_its_new_size(tmp_path, mount):
    """A descriptor open on a plain file that has none of its pages in the
    kernel (``open_fill=0``), the file then replaced by temp + rename through
    this mount and later truncated there: the descriptor reads the newest
    version (2.5) with its size, whole.  Before, the kernel kept the size it
    held for the replaced inode (100) while the daemon served the new bytes:
    a read got the new version cut to the old size (found by
    tests/difftest.py's race op)."""
    src = tmp_path / "src"
    (src / "plain").mkdir(parents=True)
    (src / "plain" / "a.bin").write_bytes(b"o" * 100)
    m = mount(src, "open_fill=0", "attr_timeout=60")
    p = m.path / "plain" / "a.bin"
    fd = os.open(p, os.O_RDONLY)
    try:
        (p.parent / ".a.tmp").write_bytes(b"N" * 200)
        os.replace(p.parent / ".a.tmp", p)
        assert (os.fstat(fd).st_size, os.pread(fd, 1 << 20, 0)) == (200, b"N" * 200)
        os.truncate(p, 150)
        assert (os.fstat(fd).st_size, os.pread(fd, 1 << 20, 0)) == (150, b"N" * 150)
        os.truncate(p, 300)
        assert (os.fstat(fd).st_size, os.pread(fd, 1 << 20, 0)) == (300, b"N" * 150 + bytes(150))
    finally:
        os.close(fd)
    assert "Traceback" not in m.log_text()


@pytest.mark.parametrize("before", [b"", b"0123456789"])
def test_a_plain_file_rewritten_in_place_is_read_by_a_descriptor_open_on_it(tmp_path, mount, before):
    """A descriptor open for reading on a plain file that this mount then
    rewrites in place (``open(O_TRUNC)``, write, close: the same file, as on
    POSIX) reads the new bytes, its size and bytes agreeing, also when the
    file was empty when the descriptor was opened. Before, that descriptor
    read nothing at all: the size at its open (0) ended its reads (found by
    tests/difftest.py)."""
    src = tmp_path / "src"
    src.mkdir()
    (src / "a.bin").write_bytes(before)
    m = mount(src)
    fd = os.open(m / "a.bin", os.O_RDONLY)
    try:
        for new in (b"x" * 20, b"y" * 30, b"z" * 5):
            (m / "a.bin").write_bytes(new)
            assert (os.fstat(fd).st_size, os.pread(fd, 1000, 0)) == (len(new), new)
    finally:
        os.close(fd)


@pytest.mark.parametrize("before", [b"", b"0123456789"])
def test_a_plain_file_rewritten_in_place_is_read_whole_in_pieces(tmp_path, mount, before):
    """The descriptor of the test above reads all of the new version when
    it reads in pieces (``pread`` of 4 KiB, ``read`` of 64 KiB, the kernel
    asking up to 128 KiB at a time).  Before, only the first piece came:
    the version was renewed by the first read, and the size at the open
    (0, 10) ended the next ones (16 KiB of 300000 bytes, 128 KiB of 2 MiB)."""
    src = tmp_path / "src"
    src.mkdir()
    (src / "a.bin").write_bytes(before)
    m = mount(src)
    for new, piece in [(b"x" * 300000, 4096), (bytes(range(256)) * 8192, 65536)]:
        fd = os.open(m / "a.bin", os.O_RDONLY)
        try:
            with open(m / "a.bin", "r+b") as w:  # (no truncate: a setattr made the handle look again)
                w.write(new)
            got = b""
            while chunk := os.pread(fd, piece, len(got)):
                got += chunk
            assert (os.fstat(fd).st_size, len(got), got == new) == (len(new), len(new), True)
        finally:
            os.close(fd)
        (m / "a.bin").write_bytes(before)


def test_a_listing_begun_before_a_file_was_written_gives_its_size(tmp_path, mount):
    """A directory opened before a file in it is created and written, then
    read (``ls -l`` of a directory held open): the entry carries the
    written size, not the empty file of the create."""
    src = tmp_path / "src"
    (src / "dir").mkdir(parents=True)
    m = mount(src)
    d = m.path / "dir"
    (d / "seed").write_bytes(b"s")
    fd = os.open(d, os.O_RDONLY | os.O_DIRECTORY)
    try:
        time.sleep(0.05)
        (d / "f").write_bytes(b"x" * 1000)
        assert sorted(e.name for e in os.scandir(fd)) == ["f", "seed"]
        assert os.stat(d / "f").st_size == 1000
    finally:
        os.close(fd)


def test_a_file_written_shows_one_mtime_whoever_answers(store, mount):
    """A file this mount wrote into a directory whose listing it keeps shows
    one mtime, whether a lookup is answered from that listing or by asking
    storage.  On S3 a PUT answers no LastModified: the listing's entry for
    it only proves the name exists, its attributes are asked for.  (A first
    version put the PUT's own clock in the listing: the mtime changed from
    one stat to the next, and the kernel dropped the file's pages.)"""
    m = mount(store.source, "metadata_ttl=30", "attr_timeout=0.3", extra=store.extra)
    (m / "d").mkdir()
    (m / "d" / "seed").write_bytes(b"s")
    os.listdir(m)
    os.listdir(m / "d")
    (m / "d" / "f").write_bytes(b"x" * 100)
    seen = set()
    for _ in range(4):
        seen.add(os.stat(m / "d" / "f").st_mtime_ns)
        os.listdir(m / "d")
        time.sleep(0.4)
    assert len(seen) == 1, seen


def _put_transformer_array(store) -> None:
    """A v3-draft storage-transformer array ``arr`` (4x6 uint8, 2x3 chunks,
    2x2 chunks per shard), its metadata only, as zarr-python 2.18 writes it."""
    ext = "https://purl.org/zarr/spec/storage_transformers/sharding/1.0"
    store.put("zarr.json", json.dumps({
        "zarr_format": "https://purl.org/zarr/spec/protocol/core/3.0",
        "metadata_encoding": "https://purl.org/zarr/spec/protocol/core/3.0",
        "metadata_key_suffix": ".json", "extensions": []}).encode())
    store.put("meta/root/arr.array.json", json.dumps({
        "shape": [4, 6], "data_type": "|u1",
        "chunk_grid": {"type": "regular", "chunk_shape": [2, 3], "separator": "/"},
        "chunk_memory_layout": "C", "fill_value": 0, "extensions": [], "attributes": {}, "compressor": None,
        "storage_transformers": [{"extension": ext, "type": "indexed",
                                  "configuration": {"chunks_per_shard": [2, 2]}}]}).encode())


def test_transformer_documents_written_through_the_view_keep_their_sharding(store, mount, tmp_path):
    """The v3-draft storage transformer: an array document rewritten through
    the view (zarr-python 2.18 rewrites it whole to set attributes) is
    stored with its sharding transformer put back, so the stored shards
    still read as written; changing what the shards are laid out by
    (chunk grid, data type, compressor) is refused with EPERM."""
    _put_transformer_array(store)
    m = mount(store.source, "flush_delay=60", extra=store.extra)
    chunks = {(i, j): bytes([10 * i + j + 1]) * 6 for i in range(2) for j in range(2)}
    for (i, j), data in chunks.items():
        os.makedirs(m / f"data/root/arr/c{i}", exist_ok=True)
        (m / f"data/root/arr/c{i}/{j}").write_bytes(data)
    doc_path = m / "meta/root/arr.array.json"
    doc = json.loads(doc_path.read_bytes())
    assert "storage_transformers" not in doc
    doc["attributes"] = {"note": "hello"}
    doc_path.write_bytes(json.dumps(doc).encode())
    bad = dict(doc, chunk_grid={"type": "regular", "chunk_shape": [4, 3], "separator": "/"})
    with pytest.raises(PermissionError):
        with open(doc_path, "wb") as f:
            f.write(json.dumps(bad).encode())
    # grown (zarr 2.18's resize), then written at once where the old shape
    # ended: the mount's own document write shows at once in data/root
    doc_path.write_bytes(json.dumps(dict(doc, shape=[6, 6])).encode())
    os.makedirs(m / "data/root/arr/c2", exist_ok=True)
    (m / "data/root/arr/c2/1.partial").write_bytes(b"\x63" * 6)
    os.rename(m / "data/root/arr/c2/1.partial", m / "data/root/arr/c2/1")
    chunks[2, 1] = b"\x63" * 6
    # a new transformer-sharded array: its shards would come as chunks
    with pytest.raises(PermissionError):
        (m / "meta/root/new.array.json").write_bytes(store.get("meta/root/arr.array.json"))
    m.umount()
    assert store.get("meta/root/new.array.json") is None
    stored = json.loads(store.get("meta/root/arr.array.json"))
    assert stored["shape"] == [6, 6]
    assert stored["attributes"] == {"note": "hello"}
    assert stored["storage_transformers"][0]["configuration"]["chunks_per_shard"] == [2, 2]
    assert stored["chunk_grid"]["chunk_shape"] == [2, 3]
    m = mount(store.source, "ro", extra=store.extra)
    for (i, j), data in chunks.items():
        assert (m / f"data/root/arr/c{i}/{j}").read_bytes() == data
    assert json.loads((m / "meta/root/arr.array.json").read_bytes())["attributes"] == {"note": "hello"}


_ZARR2_RESIZE = r"""
import sys
import numpy as np
sys.path.insert(0, sys.argv[1])
import peers_zarr2_script  # noqa: F401 (teaches zarr 2.18 to read the transformer back)
import zarr
from zarr._storage.v3 import DirectoryStoreV3
from zarr._storage.v3_storage_transformers import ShardingStorageTransformer

root, what = sys.argv[2], sys.argv[3]
store = DirectoryStoreV3(root)
if what.startswith("create"):
    tr = [ShardingStorageTransformer("indexed", chunks_per_shard=(2, 2))] if what.startswith("create-sharded") else []
    n = 40 if what.endswith("-40") else 8
    z = zarr.create(shape=(n, n), chunks=(2, 2), dtype="u2", store=store, path="arr", zarr_version=3,
                    storage_transformers=tr, compressor=None, fill_value=0)
    z[...] = np.arange(n * n, dtype="u2").reshape(n, n) + 1
elif what == "shrink-grow":
    z = zarr.open_array(store=store, path="arr", mode="r+", zarr_version=3)
    z.resize(5, 3)
    z.resize(8, 8)
elif what.startswith("overwrite"):  # (zarr.create(overwrite=True): erase the document, then each chunk)
    shape, chunks = ((8, 8), (2, 2)) if what == "overwrite-same" else ((7, 9, 2), (2, 2, 2))
    z = zarr.create(shape=shape, chunks=chunks, dtype="u2", store=store, path="arr", zarr_version=3,
                    compressor=None, fill_value=5, overwrite=True)
    z[...] = np.arange(z.size, dtype="u2").reshape(shape) % 7
elif what == "consolidate":  # (an attribute changed first, then meta/root/consolidated/.zmetadata)
    zarr.group(store=store, zarr_version=3)  # (open_consolidated opens the root group)
    zarr.open_array(store=store, path="arr", mode="r+", zarr_version=3).attrs["note"] = "consolidated"
    zarr.consolidate_metadata(store)
elif what == "read-consolidated":
    z = zarr.open_consolidated(store, zarr_version=3, mode="r")["arr"]
    assert z.attrs.get("note") == "consolidated", dict(z.attrs)
    np.save(sys.stdout.buffer, z[...])
else:
    z = zarr.open_array(store=store, path="arr", mode="r", zarr_version=3)
    np.save(sys.stdout.buffer, z[...])
"""


def _zarr2_resize_runner(tmp_path: Path):
    """``zarr2(root, what)``: runs _ZARR2_RESIZE's step ``what`` with zarr
    2.18 (v3-draft sharding enabled) on the store at ``root``; a ``read...``
    step gives the array's values."""
    import io

    from tests.peers_zarr import ZARR2_PYTHON

    script = tmp_path / "resize.py"
    script.write_text(_ZARR2_RESIZE)
    env = {**os.environ, "ZARR_V3_EXPERIMENTAL_API": "1", "ZARR_V3_SHARDING": "1"}

    def zarr2(root, what) -> np.ndarray | None:
        out = subprocess.run([str(ZARR2_PYTHON), str(script), str(Path(__file__).parent), str(root), what],
                             env=env, capture_output=True, timeout=120)
        assert out.returncode == 0, out.stderr.decode()[-600:]
        return np.load(io.BytesIO(out.stdout)) if what.startswith("read") else None
    return zarr2


def test_chunk_removals_before_a_shrinking_document_are_stored_before_it(store, mount, tmp_path):
    """A resize as zarr-python writes it (delete the chunks past the new
    shape, then write zarr.json), with shard writes held in memory
    (``flush_delay=inf``), then ``kill -9``: the stored document is the new
    one and the removed chunks are gone from their shards.  (The document
    was stored at close ahead of the removals, which a kill then lost: the
    chunks stayed, hidden past the new shape, and a later grow showed them
    again.)"""
    data = np.arange(64, dtype="<i4").reshape(8, 8)
    seed_array(store, tmp_path, "arr", (8, 8), (2, 2), (4, 4), "<i4", data=data)
    m = mount(store.source, "flush_delay=inf", extra=store.extra)
    pid = int(os.getxattr(m.path, "user.zshardfs.pid"))
    for i in range(4):
        for j in (2, 3):
            os.unlink(m / "arr" / "c" / str(i) / str(j))
    doc = json.loads((m / "arr" / "zarr.json").read_bytes())
    doc["shape"] = [8, 4]
    (m / "arr" / "zarr.json").write_text(json.dumps(doc))
    os.kill(pid, signal.SIGKILL)
    wait_for(lambda: not process_running(pid), 10, "the daemon to die")
    subprocess.run(["fusermount3", "-uz", str(m.path)], capture_output=True)
    m.mounted = False
    assert json.loads(store.get("arr/zarr.json"))["shape"] == [8, 4]
    chunks = stored_chunks(store, "arr", (2, 2))
    assert sorted(chunks) == [(i, j) for i in range(4) for j in (0, 1)], sorted(chunks)


def test_zarr2_shrinking_a_transformer_array_removes_the_chunks_outside(store, mount, tmp_path):
    """zarr-python 2.18 resizes by storing the smaller document, then
    deleting the chunks outside it, by names the view no longer shows (it
    ignores the ENOENT).  The mount removes them itself: shrunk and grown
    again, the array reads as its directory-store twin does (fill outside
    the small shape, not the old values), and shards wholly outside are
    deleted."""
    zarr2 = _zarr2_resize_runner(tmp_path)

    zarr2(tmp_path / "seed" / "t", "create-sharded")
    zarr2(tmp_path / "twin", "create-plain")
    store.put_tree(tmp_path / "seed" / "t", "t")
    assert {k for k in store.keys() if "/data/" in k} == {f"t/data/root/arr/c{i}/{j}" for i in (0, 1) for j in (0, 1)}
    m = mount(store.source, "flush_delay=60", extra=store.extra)
    zarr2(m / "t", "shrink-grow")
    zarr2(tmp_path / "twin", "shrink-grow")
    expected = zarr2(tmp_path / "twin", "read")
    assert expected[6:].sum() == 0 and expected[:, 4:].sum() == 0 and expected[:5, :3].all()
    np.testing.assert_array_equal(zarr2(m / "t", "read"), expected)
    assert "shape shrank: 10 chunks outside it removed" in m.log_text()
    # the document zarr 2.18 wrote (indented by 4, sorted keys) is stored in its
    # layout, with the transformer put back, so the view shows the twin's bytes
    doc = "meta/root/arr.array.json"
    assert (m / "t" / doc).read_bytes() == (tmp_path / "twin" / doc).read_bytes()
    m.umount()
    stored = store.get(f"t/{doc}")
    assert stored.startswith(b'{\n    "attributes"') and json.loads(stored)["storage_transformers"], stored[:60]
    np.testing.assert_array_equal(zarr2(store.local_copy(tmp_path / "copy") / "t", "read"), expected)
    # of the shards (2x2 chunks each), those wholly outside (5, 3) are gone
    assert {k for k in store.keys() if "/data/" in k and k.startswith("t/")} == {"t/data/root/arr/c0/0",
                                                                                 "t/data/root/arr/c1/0"}

    # a store in a directory itself named data/root: each reading of the
    # path is tried, and the one whose document exists is the store
    zarr2(tmp_path / "seed" / "proj/data/root", "create-sharded")
    store.put_tree(tmp_path / "seed" / "proj", "proj")
    m = mount(store.source, "ro", extra=store.extra)
    assert sorted(os.listdir(m / "proj/data/root/data/root/arr")) == ["c0", "c1", "c2", "c3"]
    np.testing.assert_array_equal(zarr2(m / "proj/data/root", "read"), np.arange(64, dtype="u2").reshape(8, 8) + 1)


def test_zarr2_shrinking_an_array_whose_chunks_the_kernel_holds(store, mount, tmp_path):
    """The chunks the mount removes itself when zarr 2.18 shrinks a
    transformer array (above) are forgotten by the kernel at once.  Read
    through the mount first, every chunk's entry is in the kernel's cache;
    zarr 2.18 then deletes the chunks outside the new shape by name, and a
    chunk the kernel still showed (``isfile``) but the mount had removed made
    its ``os.remove`` fail: the resize raised FileNotFoundError, and reads of
    the array grown again raised it too until ``attr_timeout`` passed."""
    zarr2 = _zarr2_resize_runner(tmp_path)

    size = "-40" if store.kind == "local" else ""  # (400 chunks: 394 the kernel must forget; S3: 64)
    zarr2(tmp_path / "seed" / "t", "create-sharded" + size)
    zarr2(tmp_path / "twin", "create-plain" + size)
    store.put_tree(tmp_path / "seed" / "t", "t")
    m = mount(store.source, "attr_timeout=60", extra=store.extra)
    np.testing.assert_array_equal(zarr2(m / "t", "read"), zarr2(tmp_path / "twin", "read"))
    zarr2(m / "t", "shrink-grow")
    zarr2(tmp_path / "twin", "shrink-grow")
    np.testing.assert_array_equal(zarr2(m / "t", "read"), zarr2(tmp_path / "twin", "read"))
    for name in ("c3/0", "c0/3", "c2/2", "c19/19"):  # (outside (5, 3) in chunks of 2)
        assert not os.path.exists(m / "t/data/root/arr" / name), name
    m.umount()
    np.testing.assert_array_equal(zarr2(store.local_copy(tmp_path / "copy") / "t", "read"),
                                  zarr2(tmp_path / "twin", "read"))


def test_an_entry_notification_waiting_for_the_kernel_never_holds_up_a_rename_s(tmp_path, monkeypatch):
    """The kernel entries of chunks the mount removed itself (a shrink, above)
    are invalidated from a worker thread before the request is answered;
    ``pyfuse3.invalidate_entry`` waits for the lock of the entry's directory,
    which the kernel holds while a request there waits for its answer, and
    after 2 s the thread is left to finish on its own.  It shared the one
    notification limiter with the inode invalidation of a RENAME replacing
    a file that is open: a rename holding that directory's lock then waited
    for the limiter, held by the thread, which waited for the rename's
    answer -- for ever (that rename, its directory, every later such
    rename).  The entries' thread now has a limiter of its own: the rename
    is answered, and the thread then finishes."""
    import threading

    import pyfuse3
    import trio

    from tests.test_rename_dir import _ops_on

    st = Store("local", root=tmp_path / "store")
    st.root.mkdir()
    seed_array(st, tmp_path, "arr", (16, 16), (4, 4), (8, 8), "<i4", data=np.ones((16, 16), "<i4"))
    (st.root / "a.txt").write_bytes(b"new")
    (st.root / "b.txt").write_bytes(b"old")
    view, ops = _ops_on(st)
    entered, answered = threading.Event(), threading.Event()

    def invalidate_entry(parent_inode, name):  # (the kernel: the directory's lock, held until the rename is answered)
        entered.set()
        answered.wait(30)
    monkeypatch.setattr(pyfuse3, "invalidate_entry", invalidate_entry)
    monkeypatch.setattr(pyfuse3, "invalidate_entry_async", lambda *args, **kw: None)
    monkeypatch.setattr(pyfuse3, "invalidate_inode", lambda *args, **kw: None)

    async def main():
        ino = {}
        for path in ("arr", "arr/c", "arr/c/0", "arr/c/0/1", "a.txt", "b.txt"):
            parent, _, leaf = path.rpartition("/")
            ino[path] = (await ops.lookup(ino.get(parent, pyfuse3.ROOT_INODE), leaf.encode())).st_ino
        held_open = (await ops.open(ino["b.txt"], os.O_RDONLY, None)).fh  # (its rename tells the kernel)
        chunk = ops.inodes[ino["arr/c/0/1"]].node.target

        async def removing():  # (a request whose work removed a chunk, as a shrink's does: it forgets it at its end)
            view.removed_here[trio.lowlevel.current_task()] = {"arr": {(chunk.shard_key, chunk.chunk_id)}}
            await ops.getattr(pyfuse3.ROOT_INODE, None)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(removing)
            await trio.to_thread.run_sync(entered.wait, 10)
            with trio.fail_after(10):  # (before: for ever)
                await ops.rename(pyfuse3.ROOT_INODE, b"a.txt", pyfuse3.ROOT_INODE, b"b.txt", 0, None)
            answered.set()
        await ops.release(held_open)

    try:
        trio.run(main)
    finally:
        answered.set()
    assert (st.root / "b.txt").read_bytes() == b"new" and not (st.root / "a.txt").exists()


def test_forgetting_the_chunks_a_shrink_removed_costs_what_they_are_not_every_inode(tmp_path, monkeypatch):
    """After a request that removed chunks by itself (a v3-draft shrink,
    above), the kernel's entries of those chunks were found by scanning
    every inode the kernel holds, on the event loop (54 ms per 100k, per
    such request).  They are now found below the datasets concerned
    (Operations' by_path keeps each directory's known children): a shrink
    with 300k other inodes known costs what it does with none, and the
    same entries are invalidated."""
    import pyfuse3
    import trio

    from tests.test_rename_dir import _draft_store, _ops_on
    from zshardfs.view import Node

    st = Store("local", root=tmp_path / "store")
    st.root.mkdir()
    for prefix in ("a", "b"):
        _draft_store(st.root, prefix)
    view, ops = _ops_on(st)
    invalidated: list[tuple[int, bytes]] = []
    monkeypatch.setattr(pyfuse3, "invalidate_entry", lambda parent, name: invalidated.append((parent, name)))
    monkeypatch.setattr(pyfuse3, "invalidate_entry_async", lambda *args, **kw: None)
    monkeypatch.setattr(pyfuse3, "invalidate_inode", lambda *args, **kw: None)
    doc = json.loads((st.root / "a/meta/root/arr.array.json").read_text())
    del doc["storage_transformers"]
    doc["shape"] = [2, 6]  # (chunks c1/0 and c1/1 outside it)

    async def walk(path: str) -> dict[str, int]:
        ino, parent = {}, pyfuse3.ROOT_INODE
        for i, name in enumerate(path.split("/")):
            parent = ino["/".join(path.split("/")[:i + 1])] = (await ops.lookup(parent, name.encode())).st_ino
        return ino

    async def shrink(prefix: str) -> tuple[float, set]:
        """CPU seconds of the FLUSH storing the smaller document; the
        entries it invalidated."""
        ino = {}
        for chunk in ("c0/0", "c0/1", "c1/0", "c1/1"):
            ino |= await walk(f"{prefix}/data/root/arr/{chunk}")
        fh = (await ops.open((await walk(f"{prefix}/meta/root/arr.array.json"))[f"{prefix}/meta/root/arr.array.json"],
                             os.O_WRONLY | os.O_TRUNC, None)).fh
        await ops.write(fh, 0, json.dumps(doc).encode())
        invalidated.clear()
        with event_loop_cpu() as cpu:
            await ops.flush(fh)
        spent = cpu.seconds
        await ops.release(fh)
        c1 = ino[f"{prefix}/data/root/arr/c1"]
        assert set(invalidated) == {(c1, b"0"), (c1, b"1")}, invalidated
        return spent

    async def main():
        alone = await shrink("a")
        for i in range(300_000):  # (the inodes of a tree the kernel holds elsewhere)
            ops._inode_for(Node(f"other/d{i // 1000}/f{i}", False, 1, key=f"other/d{i // 1000}/f{i}"))
        many = await shrink("b")
        assert many < 2 * alone + 0.01, (many, alone)  # (before: 0.070 s against 0.004 s)

    trio.run(main)
    assert json.loads((st.root / "b/meta/root/arr.array.json").read_text())["shape"] == [2, 6]


def test_the_path_table_finds_what_is_below_a_directory_as_a_scan_would():
    """Operations.by_path's index of children (used above): after random
    adds and removals (paths whose directories are held or not), what it
    finds at or below each directory is what a scan of every path finds."""
    import random

    from zshardfs.fuse_ops import _PathTable

    rng = random.Random(7)
    table, plain = _PathTable({"": 1}), {"": 1}
    names = [f"{a}/{b}/{c}"[: rng.choice((1, 3, 5))] for a in "ab" for b in "xy" for c in "pq"]
    for step in range(5000):
        path = rng.choice(names)
        how = rng.random()
        if how < 0.5:
            table[path] = plain[path] = step
        elif how < 0.75:
            assert table.pop(path, None) == plain.pop(path, None)
        elif path in plain:
            del table[path], plain[path]
        assert dict(table) == plain
        assert_below_as_a_scan(table, plain, step)
    for path in list(plain):
        del table[path]
    assert table._kids == {}


def test_only_the_inodes_a_request_names_keep_its_forgotten_chunks_queued(tmp_path, monkeypatch):
    """The entries of chunks removed by the mount itself are invalidated
    before the request is answered, except those in a directory (or of an
    inode) the request names: the kernel holds its lock, so they are
    queued.  Any integer argument equal to an inode number was taken for
    one (a READ's offset, a mode, flags, a file handle): those entries
    were queued, the kernel showing them until it got round to it.  Only
    the arguments that are inodes (or directory handles) of each request
    kind count now."""
    import pyfuse3
    import trio

    from tests.test_rename_dir import _draft_store, _ops_on

    st = Store("local", root=tmp_path / "store")
    st.root.mkdir()
    _draft_store(st.root, "a")
    (st.root / "notes.txt").write_bytes(b"0123456789")
    view, ops = _ops_on(st)
    now, queued = [], []
    monkeypatch.setattr(pyfuse3, "invalidate_entry", lambda parent, name: now.append((parent, name)))
    monkeypatch.setattr(pyfuse3, "invalidate_entry_async", lambda parent, name, **kw: queued.append((parent, name)))
    monkeypatch.setattr(pyfuse3, "invalidate_inode", lambda *args, **kw: None)

    async def main():
        ino, parent = {}, pyfuse3.ROOT_INODE
        for name in "a/data/root/arr/c1/0".split("/"):
            parent = ino[name] = (await ops.lookup(parent, name.encode())).st_ino
        chunk = ops.inodes[ino["0"]].node
        notes = (await ops.lookup(pyfuse3.ROOT_INODE, b"notes.txt")).st_ino
        fh = (await ops.open(notes, os.O_RDONLY, None)).fh

        async def forgets(request, *args):
            now.clear(), queued.clear()
            # (as the request's own work would: the task serving it removed them)
            view.removed_here[trio.lowlevel.current_task()] = {
                chunk.dataset.root: {(chunk.target.shard_key, chunk.target.chunk_id)}}
            await request(*args)
            return now[:], queued[:]

        # a READ at an offset that is c1's number: c1 is no directory of the request's
        assert await forgets(ops.read, fh, ino["c1"], 1) == ([(ino["c1"], b"0")], [])  # (before: queued)
        # a LOOKUP in c1: its directory is held, queued
        assert await forgets(ops.lookup, ino["c1"], b"1") == ([], [(ino["c1"], b"0")])
        await ops.release(fh)

    trio.run(main)


@pytest.mark.parametrize("meanwhile", ["rmdir", "lookup-of-a-rename"])
def test_a_request_ending_while_another_shrinks_an_array_is_not_held_up(moto_server, s3_bucket, mount, tmp_path,
                                                                         meanwhile):
    """zarr 2.18 shrinks a transformer array (its document written to a
    temporary and renamed into place); the rename's request removes the
    chunks outside, and makes the kernel forget their entries before it
    answers.  Any request ending meanwhile (here: while the rename's
    DELETE of the temporary is held back) did so instead, and one holding a
    lock those invalidations need though its arguments do not name it
    waited 2 s for itself: an rmdir of the chunk directory c0 (the kernel
    locks the victim), a LOOKUP the kernel makes for a rename out of c0
    (holding both directories).  Only the request that removed them
    forgets them now: each of those is answered at once, and the removed
    chunks' entries are still forgotten before the shrinking rename is
    answered.  (A rename moving c0 itself, which locks it, is preceded by
    the kernel's LOOKUP of its target, asked every time: that LOOKUP, not
    holding c0, was the one to end first.)"""
    from tests.s3server import TcpProxy

    _, bucket = s3_bucket
    store = Store("s3", server=moto_server, bucket=bucket)
    zarr2 = _zarr2_resize_runner(tmp_path)
    zarr2(tmp_path / "seed" / "t", "create-sharded")
    store.put_tree(tmp_path / "seed" / "t", "t")
    with TcpProxy(moto_server.port) as proxy:
        m = mount(store.source, "attr_timeout=60", extra=["--endpoint-url", proxy.endpoint_url])
        arr, meta = m / "t/data/root/arr", m / "t/meta/root"
        for i in range(4):
            for j in range(4):
                assert os.path.isfile(arr / f"c{i}/{j}")  # (the kernel holds every chunk's entry)
        os.mkdir(m / "t/elsewhere")
        doc = json.loads((meta / "arr.array.json").read_bytes())
        (meta / "arr.array.json.x.partial").write_text(json.dumps(dict(doc, shape=[5, 3])))
        proxy.hold(lambda first: first.startswith(f"DELETE /{bucket}/{PREFIX}/t/meta/root/arr.array.json.x.partial "
                                                  .encode()))
        with ThreadPoolExecutor(1) as pool:
            shrunk = pool.submit(os.replace, meta / "arr.array.json.x.partial", meta / "arr.array.json")
            assert proxy.holding.wait(10), "the shrink did not remove its temporary"
            started = time.monotonic()
            try:
                if meanwhile == "rmdir":
                    os.rmdir(arr / "c0")
                else:
                    os.rename(arr / "c0/1", m / "t/elsewhere/c0-1")
            except OSError as exc:  # (refused: ENOTEMPTY, EXDEV...; its time is what counts)
                assert exc.errno in (errno.ENOTEMPTY, errno.EXDEV, errno.EPERM), exc
            took = time.monotonic() - started
            proxy.go()
            shrunk.result(timeout=30)
        # the defect's wait is the 2 s cap on invalidating (fuse_ops'
        # _forget_removed_here: trio.move_on_after(2.0)) after the request's
        # own work: at least 2 s however fast the machine (before: 2.05 s,
        # 2.26 s).  The work alone: 0.04 s, 0.18 s idle; 0.08-0.23 s and
        # 0.34-1.15 s with two busy loops beside the test (the old bound,
        # 1.0 s, failed there)
        assert took < 1.9, f"{meanwhile} took {took:.2f} s"
        assert "shape shrank: 10 chunks outside it removed" in m.log_text()
        for rel in ("c0/3", "c2/2", "c3/0", "c3/3"):  # (outside (5, 3) in chunks of 2)
            assert not os.path.exists(arr / rel), rel
        assert os.path.isfile(arr / "c2/0")


def test_two_arrays_recreated_at_once_are_not_held_up_by_each_other(moto_server, s3_bucket, mount, tmp_path):
    """Two arrays each emptied (zarr.json and every chunk file removed
    through the mount, as a store deleting keys does) and given a new
    zarr.json at once, each by renaming a temporary onto it: each rename's
    request makes the kernel forget the entries of its array's old chunk
    directories (View.datasets_gone), which it holds (``x/c``), before it
    answers.  The first rename to end took the other's set too, and the
    other's entry ``y/c`` is in ``y``, whose lock the kernel holds for the
    other rename, still at work (its PUT held back): the first waited 2 s
    for it.  Each forgets only its own set now: the first is answered at
    once, and after both, no old chunk directory of either is seen."""
    from tests.s3server import TcpProxy

    _, bucket = s3_bucket
    store = Store("s3", server=moto_server, bucket=bucket)
    for name in ("x", "y"):
        seed_array(store, tmp_path, name, (8, 8), (2, 2), (4, 4), "<i4", data=np.ones((8, 8), "<i4"))
    with TcpProxy(moto_server.port) as proxy:
        m = mount(store.source, "attr_timeout=60", extra=["--endpoint-url", proxy.endpoint_url])
        docs = {}
        for name in ("x", "y"):
            for i in range(4):
                for j in range(4):
                    assert os.path.isfile(m / f"{name}/c/{i}/{j}")  # (the kernel holds every chunk's entry)
            docs[name] = (m / f"{name}/zarr.json").read_bytes()
            os.unlink(m / f"{name}/zarr.json")
            for i in range(4):
                for j in range(4):
                    os.unlink(m / f"{name}/c/{i}/{j}")
            assert os.path.isdir(m / f"{name}/c/0")  # (the kernel still holds the chunk directories)
            (m / f"{name}/zarr.json.tmp").write_bytes(docs[name])
        proxy.hold(lambda first: first.startswith(f"PUT /{bucket}/{PREFIX}/y/zarr.json ".encode()))
        with ThreadPoolExecutor(1) as pool:
            other = pool.submit(os.replace, m / "y/zarr.json.tmp", m / "y/zarr.json")
            assert proxy.holding.wait(10), "the other rename did not store its document"
            started = time.monotonic()
            os.replace(m / "x/zarr.json.tmp", m / "x/zarr.json")
            took = time.monotonic() - started
            proxy.go()
            other.result(timeout=30)
        assert took < 1.0, f"the first rename took {took:.2f} s"  # (before: 2.07 s)
        assert [name for name in ("x", "y") if os.path.exists(m / f"{name}/c/0")] == []
        for name in ("x", "y"):
            assert (m / f"{name}/zarr.json").read_bytes() == docs[name]
        assert "Traceback" not in m.log_text()


def test_zarr2_arrays_made_in_a_shard_mount_are_stored_as_written_and_said(store, mount, tmp_path):
    """``-o shard=K`` shards new Zarr v3 arrays (their ``zarr.json``); a new
    v3-draft array zarr 2.18 makes through the mount is stored unsharded,
    as written, with one log line (before: no line, though shard=K was
    asked); it reads back as written, from the mount and from the store."""
    zarr2 = _zarr2_resize_runner(tmp_path)

    m = mount(store.source, "shard=2", extra=store.extra)
    zarr2(m / "t", "create-plain")
    zarr2(m / "t", "shrink-grow")
    zarr2(tmp_path / "twin", "create-plain")
    zarr2(tmp_path / "twin", "shrink-grow")
    expected = zarr2(tmp_path / "twin", "read")
    np.testing.assert_array_equal(zarr2(m / "t", "read"), expected)
    m.umount()
    assert m.log_text().count("t/meta/root/arr.array.json: stored unsharded, as written: -o shard shards "
                              "Zarr v3 arrays") == 1, m.log_text()
    assert "storage_transformers" not in json.loads(store.get("t/meta/root/arr.array.json"))
    np.testing.assert_array_equal(zarr2(store.local_copy(tmp_path / "copy") / "t", "read"), expected)


def _zarr2_consolidated_seed_and_twin(tmp_path):
    """zarr 2.18's sharded array (``seed/t``) and its unsharded twin (``twin``), both
    consolidated: (the runner, the twin's values read consolidated)."""
    zarr2 = _zarr2_resize_runner(tmp_path)
    for root, kind in ((tmp_path / "seed" / "t", "create-sharded"), (tmp_path / "twin", "create-plain")):
        zarr2(root, kind)
        zarr2(root, "consolidate")
    return zarr2, zarr2(tmp_path / "twin", "read-consolidated")


def test_zarr2_consolidated_metadata_of_transformer_arrays_is_shown_and_stored_mapped(store, mount, tmp_path):
    """zarr 2.18's consolidated metadata (``meta/root/consolidated/.zmetadata``:
    every array and group document of the store, one JSON object) holds
    the array documents with their sharding transformer.  Shown as stored,
    zarr 2.18 reading the mount consolidated took the view's chunk files
    for shards (ValueError: cannot reshape); consolidated through the
    mount, it was stored with the view's documents, without the
    transformer, and zarr 2.18 reading the store itself consolidated took
    its shards for chunks (the same error).  Each member is now shown
    without the transformer, as its own document is, and stored with it
    put back (attributes carried over), as its own document is."""
    zarr2, expected = _zarr2_consolidated_seed_and_twin(tmp_path)
    store.put_tree(tmp_path / "seed" / "t", "t")
    m = mount(store.source, extra=store.extra)
    doc = "meta/root/consolidated/.zmetadata"
    np.testing.assert_array_equal(zarr2(m / "t", "read-consolidated"), expected)
    assert json.loads((m / "t" / doc).read_bytes()) == json.loads((tmp_path / "twin" / doc).read_bytes())
    zarr2(m / "t", "consolidate")  # (again, through the mount)
    np.testing.assert_array_equal(zarr2(m / "t", "read-consolidated"), expected)
    m.umount()
    stored = json.loads(store.get(f"t/{doc}"))["metadata"]["meta/root/arr.array.json"]
    assert stored["storage_transformers"][0]["configuration"] == {"chunks_per_shard": [2, 2]}, stored
    np.testing.assert_array_equal(zarr2(store.local_copy(tmp_path / "copy") / "t", "read-consolidated"), expected)


@pytest.mark.parametrize("how", [h for h in SAVES if h != "editor"])
def test_zarr2_consolidated_members_renamed_away_keep_their_transformer(store, mount, tmp_path, how):
    """zarr 2.18's ``meta/root/consolidated/.zmetadata`` written back through the mount
    (in place, a temporary renamed over it, ``rm`` then a saved copy put back, ``truncate`` to 0 then written; its
    member's entry edited: an attribute added) while the member's document is renamed
    away (``meta/root/arr.array.json`` moved to a name that is no document, as 4.18's
    members are): with no stored document to map the entry back to, it was stored as the
    view shows it, without the sharding transformer, and once the document was back zarr
    2.18 reading the store consolidated took the shards for chunks.  The entry now maps
    back onto the stored ``.zmetadata``'s entry of it (the one this mount removed or
    emptied there, while none is stored)."""
    zarr2, expected = _zarr2_consolidated_seed_and_twin(tmp_path)
    store.put_tree(tmp_path / "seed" / "t", "t")
    m = mount(store.source, extra=store.extra)
    doc = m / "t/meta/root/consolidated/.zmetadata"
    member = "meta/root/arr.array.json"
    edit = json.loads(doc.read_bytes())
    edit["metadata"][member]["attributes"]["k"] = 1
    os.rename(m / "t" / member, m / "t/meta/root/arr.array.json.away")
    save_as(doc, json.dumps(edit).encode(), how)
    assert json.loads(doc.read_bytes()) == edit
    os.rename(m / "t/meta/root/arr.array.json.away", m / "t" / member)
    np.testing.assert_array_equal(zarr2(m / "t", "read-consolidated"), expected)
    m.umount()
    stored = json.loads(store.get("t/meta/root/consolidated/.zmetadata"))["metadata"][member]
    assert stored == {**json.loads(store.get(f"t/{member}")), "attributes": edit["metadata"][member]["attributes"]}
    assert stored["storage_transformers"][0]["configuration"] == {"chunks_per_shard": [2, 2]}, stored
    np.testing.assert_array_equal(zarr2(store.local_copy(tmp_path / "copy") / "t", "read-consolidated"), expected)


def test_zarr2_consolidated_entry_of_a_member_renamed_away_that_cannot_be_mapped_is_stored_as_written(
        mount, tmp_path):
    """As above, the member's entry edited where it lays the shards out (its chunk
    grid): no stored document to refuse it for (a present one's is refused, EPERM),
    and it cannot be mapped onto the stored entry: stored as written, one warning line."""
    zarr2 = _zarr2_resize_runner(tmp_path)
    zarr2(tmp_path / "seed" / "t", "create-sharded")
    zarr2(tmp_path / "seed" / "t", "consolidate")
    root = tmp_path / "store"
    root.mkdir()
    local = Store("local", root=root)
    local.put_tree(tmp_path / "seed" / "t", "t")
    m = mount(local.source, extra=local.extra)
    doc = m / "t/meta/root/consolidated/.zmetadata"
    member = "meta/root/arr.array.json"
    edit = json.loads(doc.read_bytes())
    edit["metadata"][member]["chunk_grid"]["chunk_shape"] = [4, 4]
    os.rename(m / "t" / member, m / "t/meta/root/arr.array.json.away")
    doc.write_bytes(json.dumps(edit).encode())
    os.rename(m / "t/meta/root/arr.array.json.away", m / "t" / member)
    m.umount()
    assert json.loads(local.get("t/meta/root/consolidated/.zmetadata"))["metadata"][member] == \
        edit["metadata"][member]
    lines = [line for line in m.log_text().splitlines() if "stored as written" in line]
    assert len(lines) == 1 and repr(member) in lines[0] and "chunk_grid" in lines[0], lines


@pytest.mark.parametrize("how", ["overwrite", "overwrite-same"])
def test_zarr2_overwriting_a_transformer_array_through_the_mount(store, mount, tmp_path, how):
    """``zarr.create(..., overwrite=True)`` of zarr 2.18 over a v3-draft
    transformer array: it erases the array's document, then every chunk
    file it lists (its directories stay, as in a directory store), then
    writes the new document and chunks.  The last chunk of each shard gone,
    the mount deleted the shards and their directories with them (stored
    before the new document), while the kernel still held those chunk
    directories from the listing: the new array's first chunk write found
    ``data/root/arr/c0`` there (cached) and its ``makedirs``/``open`` below
    it got ENOENT (KeyError / FileNotFoundError out of zarr; nothing in the
    log).  The kernel now forgets the entries of a dataset whose last chunk
    went with its document, once a new document takes its place."""
    zarr2 = _zarr2_resize_runner(tmp_path)

    zarr2(tmp_path / "seed" / "t", "create-sharded")
    zarr2(tmp_path / "twin", "create-plain")
    store.put_tree(tmp_path / "seed" / "t", "t")
    m = mount(store.source, "attr_timeout=60", extra=store.extra)
    zarr2(m / "t", how)
    zarr2(tmp_path / "twin", how)
    expected = zarr2(tmp_path / "twin", "read")
    np.testing.assert_array_equal(zarr2(m / "t", "read"), expected)
    m.umount()
    np.testing.assert_array_equal(zarr2(store.local_copy(tmp_path / "copy") / "t", "read"), expected)
    assert "Traceback" not in m.log_text()


@pytest.mark.parametrize("how", ["garbage_then_restore", "emptied_synced_restored"])
def test_a_transformer_document_emptied_and_restored_keeps_the_array(store, mount, tmp_path, how):
    """``echo oops > meta/root/arr.array.json`` or ``: > ...; zshardfs sync``,
    then the saved text written back: as with ``zarr.json`` (4.15), the chunk
    files stay meanwhile and the document written again is mapped back onto
    the sharded one.  Before, the emptied document was refused at sync (an
    ERROR line, yet sync answered 0) and a garbage one with EPERM."""
    _put_transformer_array(store)
    m = mount(store.source, extra=store.extra)
    chunks = {(i, j): bytes([10 * i + j + 1]) * 6 for i in range(2) for j in range(2)}
    for (i, j), data in chunks.items():
        os.makedirs(m / f"data/root/arr/c{i}", exist_ok=True)
        (m / f"data/root/arr/c{i}/{j}").write_bytes(data)
    zs("sync", m.path)
    doc = m / "meta/root/arr.array.json"
    saved = doc.read_bytes()
    if how == "garbage_then_restore":
        doc.write_bytes(b"oops\n")
    else:
        os.close(os.open(doc, os.O_WRONLY | os.O_TRUNC))
    zs("sync", m.path)
    assert store.get("meta/root/arr.array.json") in (b"oops\n", b"")
    for (i, j), data in chunks.items():  # chunk files all along
        assert (m / f"data/root/arr/c{i}/{j}").read_bytes() == data
    doc.write_bytes(saved)
    m.umount()
    assert "refused" not in m.log_text()
    stored = json.loads(store.get("meta/root/arr.array.json"))
    assert stored["storage_transformers"][0]["configuration"]["chunks_per_shard"] == [2, 2]
    m = mount(store.source, "ro", extra=store.extra)
    assert (m / "meta/root/arr.array.json").read_bytes() == saved
    for (i, j), data in chunks.items():
        assert (m / f"data/root/arr/c{i}/{j}").read_bytes() == data


@pytest.mark.parametrize("flags", [os.O_WRONLY, os.O_RDWR])
def test_a_document_edited_in_place_reads_back_as_written(store, mount, tmp_path, flags):
    """zarr.json of a sharded array edited in place (no O_TRUNC: write at 0,
    then ftruncate) is stored mapped back to its sharded form, and the view
    goes on showing exactly what was written: the size the kernel holds
    (before, the view re-rendered the stored document: longer than that
    size, so readers got JSON cut short)."""
    data = np.arange(64, dtype="<i4").reshape(8, 8)
    seed_array(store, tmp_path, "arr", (8, 8), (2, 2), (4, 4), "<i4", data=data)
    m = mount(store.source, "flush_delay=60", extra=store.extra)
    path = m / "arr/zarr.json"
    doc = json.loads(path.read_bytes())
    doc["attributes"] = {"k": 1}
    new = json.dumps(doc).encode()  # compact: shorter than the view's document
    fd = os.open(path, flags)
    try:
        os.pwrite(fd, new, 0)
        os.ftruncate(fd, len(new))
    finally:
        os.close(fd)
    assert os.stat(path).st_size == len(new)
    assert path.read_bytes() == new
    np.testing.assert_array_equal(zarr.open_array(str(m / "arr"), mode="r")[...], data)
    m.umount()
    stored = json.loads(store.get("arr/zarr.json"))
    assert stored["attributes"] == {"k": 1} and stored["codecs"][0]["name"] == "sharding_indexed"


def test_open_files_unlinked_or_replaced_behave_as_on_posix(store, mount, tmp_path):
    """A handle still open for writing on a file that is unlinked, or
    replaced by a rename, writes to that old file: it never brings the name
    back nor overwrites the rename's result.  A reader of a file the mount
    itself rewrites reads on in the new version (pinned reads fail only for
    other clients' changes).  A chunk directory of an array made through the
    mount is gone once removed."""
    data = np.arange(64, dtype="<i4").reshape(8, 8)
    seed_array(store, tmp_path, "arr", (8, 8), (2, 2), (4, 4), "<i4", data=data)
    m = mount(store.source, "flush_delay=60", extra=store.extra)
    # unlinked while open for writing
    fd = os.open(m / "gone.txt", os.O_WRONLY | os.O_CREAT)
    os.write(fd, b"first")
    os.fsync(fd)
    os.unlink(m / "gone.txt")
    os.write(fd, b" more")
    os.close(fd)
    assert not (m / "gone.txt").exists()
    # replaced by a rename while open for writing: plain file, then chunk
    (m / "src.txt").write_bytes(b"AAAA")
    fd = os.open(m / "dst.txt", os.O_WRONLY | os.O_CREAT)
    os.write(fd, b"old")
    os.rename(m / "src.txt", m / "dst.txt")
    os.write(fd, b"-late")
    os.close(fd)
    assert (m / "dst.txt").read_bytes() == b"AAAA"
    fd = os.open(m / "arr/c/1/1", os.O_WRONLY)
    os.rename(m / "arr/c/0/0", m / "arr/c/1/1")
    os.pwrite(fd, b"\x99" * 4, 0)
    os.close(fd)
    assert (m / "arr/c/1/1").read_bytes() == data[0:2, 0:2].tobytes()
    # a reader of a file this mount rewrites
    big = b"1" * (2 << 20)
    (m / "big.bin").write_bytes(big)
    with open(m / "big.bin", "rb", buffering=0) as reader:
        assert reader.read(4096) == big[:4096]
        (m / "big.bin").write_bytes(b"2" * (2 << 20))
        rest = reader.read()
    assert set(rest) == {ord("2")}
    m.umount()
    assert store.get("gone.txt") is None and store.get("dst.txt") == b"AAAA"
    got = stored_chunks(store, "arr", (2, 2))
    assert got[1, 1] == data[0:2, 0:2].tobytes() and (0, 0) not in got

    # an array made here: a chunk directory emptied and removed is gone
    m = mount(store.source, "shard=2", "flush_delay=60", extra=store.extra)
    zarr.create_array(store=str(m / "new"), shape=(4, 4), chunks=(2, 2), dtype="<i4", fill_value=0,
                      compressors=None)[0:2, 2:4] = 5
    zs("sync", m.path)
    os.unlink(m / "new/c/0/1")
    os.rmdir(m / "new/c/0")
    assert not (m / "new/c/0").exists()
    os.mkdir(m / "new/c/0")


def test_a_handle_writing_on_after_its_file_was_unlinked_reads_what_it_wrote(store, mount, tmp_path):
    """POSIX: the old file lives on for its descriptors.  A read-write handle
    that goes on writing once its file was unlinked (or replaced by a rename)
    sees its own writes through fstat and pread, whatever size the file had
    (the mount answered the size at the unlink, so the kernel cut every read
    of the handle there: writes past it vanished)."""
    data = np.arange(64, dtype="<i4").reshape(8, 8)
    seed_array(store, tmp_path, "arr", (8, 8), (2, 2), (4, 4), "<i4", data=data)
    m = mount(store.source, "flush_delay=60", extra=store.extra)
    (m / "plain.bin").write_bytes(b"p" * 10)
    for name, flags in [("arr/c/0/0", os.O_RDWR), ("arr/c/3/3", os.O_RDWR | os.O_CREAT | os.O_TRUNC),
                        ("plain.bin", os.O_RDWR), ("arr/new.txt", os.O_RDWR | os.O_CREAT)]:
        fd = os.open(m / name, flags, 0o644)
        try:
            os.pwrite(fd, b"x" * 4, 20)
            os.unlink(m / name)
            os.pwrite(fd, b"y" * 100, 0)
            assert os.fstat(fd).st_size == 100, name
            assert os.pread(fd, 1000, 0) == b"y" * 100, name
        finally:
            os.close(fd)
        assert not (m / name).exists(), name
    # replaced by a rename while open for writing: the handle's own file
    (m / "src.txt").write_bytes(b"AAAA")
    fd = os.open(m / "dst.txt", os.O_RDWR | os.O_CREAT)
    try:
        os.write(fd, b"old")
        os.rename(m / "src.txt", m / "dst.txt")
        os.pwrite(fd, b"-late-and-longer", 3)
        assert os.fstat(fd).st_size == 19
        assert os.pread(fd, 100, 0) == b"old-late-and-longer"
    finally:
        os.close(fd)
    assert (m / "dst.txt").read_bytes() == b"AAAA"
    m.umount()
    got = stored_chunks(store, "arr", (2, 2))
    assert (0, 0) not in got and (3, 3) not in got and store.get("plain.bin") is None


def test_two_handles_writing_on_after_their_file_was_unlinked_share_it(store, mount, tmp_path):
    """POSIX: the old file is one file for all its descriptors.  Two handles
    open for writing on a file (plain, chunk) that is then unlinked or
    replaced by a rename write to that one old file: each reads what the
    other wrote.  Before, each handle got a copy of its own at the unlink,
    so the second one's write was lost to the first (and, through the page
    cache the two share, to itself)."""
    data = np.arange(64, dtype="<i4").reshape(8, 8)
    seed_array(store, tmp_path, "arr", (8, 8), (2, 2), (4, 4), "<i4", data=data)
    m = mount(store.source, "flush_delay=60", extra=store.extra)
    (m / "plain.bin").write_bytes(b"p" * 10)
    (m / "other.bin").write_bytes(b"o" * 10)
    for name, gone in [("plain.bin", "unlink"), ("arr/c/0/0", "unlink"), ("other.bin", "rename")]:
        a, b = os.open(m / name, os.O_RDWR), os.open(m / name, os.O_RDWR)
        try:
            if gone == "unlink":
                os.unlink(m / name)
            else:
                (m / "new.bin").write_bytes(b"new")
                os.rename(m / "new.bin", m / name)
            os.pwrite(a, b"A" * 100, 0)
            os.pwrite(b, b"BBB", 0)
            for fd in (a, b):
                assert os.fstat(fd).st_size == 100, name
                assert os.pread(fd, 1000, 0) == b"BBB" + b"A" * 97, name
        finally:
            os.close(a)
            os.close(b)
    assert not (m / "plain.bin").exists() and (m / "other.bin").read_bytes() == b"new"
    m.umount()
    assert (0, 0) not in stored_chunks(store, "arr", (2, 2)) and store.get("other.bin") == b"new"


# ---------------------------------------------------------------------------
# directory fsync


def _kill_daemon(m) -> None:
    pid = int(os.getxattr(m.path, "user.zshardfs.pid"))
    os.kill(pid, signal.SIGKILL)
    assert util.wait_for(lambda: not process_running(pid), 10), "the daemon did not die"
    subprocess.run(["fusermount3", "-uz", str(m.path)], capture_output=True)
    m.mounted = False


def test_a_rename_is_stored_by_an_fsync_of_its_directory(store, mount, tmp_path):
    """The careful writer's pattern (tensorstore's): write a temporary in the
    chunk directory, fsync it, rename it over the chunk, fsync the directory.
    When the directory's fsync returns, the chunk is stored: a daemon killed
    right after loses nothing.  (Without FSYNCDIR the kernel answered every
    directory fsync itself and the chunk was only in memory.)"""
    seed_array(store, tmp_path, "arr", (8, 8), (2, 2), (4, 4), "<i4", data=np.arange(64, dtype="<i4").reshape(8, 8))
    m = mount(store.source, "flush_delay=inf", extra=store.extra)
    new = np.full((2, 2), 77, "<i4").tobytes()
    tmp = m / "arr/c/1/.0.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        os.write(fd, new)
        os.fsync(fd)
    finally:
        os.close(fd)
    os.rename(tmp, m / "arr/c/1/0")
    dfd = os.open(m / "arr/c/1", os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)
    # a removal in another directory of the array, made durable the same way
    os.unlink(m / "arr/c/3/3")
    dfd = os.open(m / "arr/c/3", os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)
    _kill_daemon(m)
    got = stored_chunks(store, "arr", (2, 2))
    assert got[(1, 0)] == new
    assert (3, 3) not in got and (0, 0) in got


def test_tensorstore_writes_through_the_mount_are_durable_when_it_returns(store, mount, tmp_path):
    """tensorstore's file driver fsyncs a chunk's temporary and its
    directory before a write's future completes: what it reported written
    survives a daemon killed right after."""
    import tensorstore as ts

    seed_array(store, tmp_path, "arr", (8, 8), (2, 2), (4, 4), "<i4")
    m = mount(store.source, "flush_delay=inf", extra=store.extra)
    arr = ts.open({"driver": "zarr3", "kvstore": {"driver": "file", "path": str(m / "arr")}}).result()
    arr[2:6, 0:4].write(np.full((4, 4), 9, "<i4")).result()
    _kill_daemon(m)
    got = stored_chunks(store, "arr", (2, 2))
    for i in (1, 2):
        for j in (0, 1):
            assert got[(i, j)] == np.full((2, 2), 9, "<i4").tobytes(), (i, j)


def test_a_shard_rewritten_through_a_root_mount_keeps_its_mode_and_owner(tmp_path, mount):
    """A chunk written through a root daemon's mount into a local shard
    another user owns, kept private (0600), left the shard root's and
    world-readable (0644: the daemon's umask); now it keeps its mode and
    owner (tests/test_backends.py has the rule's cases)."""
    src = tmp_path / "src"
    src.mkdir()
    m = mount(src, "rw", "shard=2")
    zarr.create_array(str(m / "a"), shape=(4, 4), chunks=(2, 2), dtype="u1", fill_value=0,
                      compressors=None)[...] = 1
    m.umount()
    shard = src / "a" / "c" / "0" / "0"
    assert shard.is_file()
    os.chown(shard, 65534, 65534)
    os.chmod(shard, 0o600)
    m = mount(src, "rw", "allow_other")
    (m / "a" / "c" / "0" / "1").write_bytes(bytes([7] * 4))
    m.umount()
    st = os.stat(shard)
    assert (stat.S_IMODE(st.st_mode), st.st_uid, st.st_gid) == (0o600, 65534, 65534)
    assert zarr.open_array(str(src / "a"), mode="r")[0, 2] == 7


def test_a_file_renamed_through_a_root_mount_to_a_free_name_keeps_its_mode_and_owner(tmp_path, mount):
    """A rename of a plain file is stored as a copy under the new name
    (then the old one removed): through a root daemon's mount, another
    user's private (0600) file renamed to a free name became root's and
    world-readable (0644: the daemon's umask) in the store, where rename(2)
    keeps the file.  Now the copy takes the renamed file's mode and owner
    before a byte is written (onto a taken name: that file's, as any file
    stored again); a file made through the mount, renamed, is new."""
    src = tmp_path / "src"
    (src / "d").mkdir(parents=True)
    (src / "d/secret.txt").write_bytes(b"secret")
    os.chown(src / "d/secret.txt", 65534, 65534)
    os.chmod(src / "d/secret.txt", 0o600)
    m = mount(src, "rw", "allow_other")
    os.rename(m / "d/secret.txt", m / "d/moved.txt")
    os.rename(m / "d/moved.txt", m / "moved.txt")  # (another directory too)
    write_file(m / "new.txt", b"new")
    os.rename(m / "new.txt", m / "renamed-new.txt")
    m.umount()
    st = os.stat(src / "moved.txt")
    assert (stat.S_IMODE(st.st_mode), st.st_uid, st.st_gid) == (0o600, 65534, 65534)
    assert (src / "moved.txt").read_bytes() == b"secret"
    assert sorted(os.listdir(src)) == ["d", "moved.txt", "renamed-new.txt"] and os.listdir(src / "d") == []
    st = os.stat(src / "renamed-new.txt")
    assert (st.st_uid, stat.S_IMODE(st.st_mode) & 0o7000) == (0, 0)


def test_rename_noreplace_of_files_on_both_stores(store, mount, tmp_path):
    """renameat2(RENAME_NOREPLACE) of files and chunks (SEMANTICS 4.19):
    EEXIST onto a taken name (a stored file, one made through the mount and
    not stored yet, a chunk); a plain rename onto a free name, stored."""
    from tests.test_rename_dir import _RENAME_NOREPLACE, _renameat2

    data = np.arange(64, dtype="<i4").reshape(8, 8)
    seed_array(store, tmp_path, "arr", (8, 8), (2, 2), (4, 4), "<i4", data=data)
    store.put("a", b"a")
    store.put("b", b"b")
    m = mount(store.source, "flush_delay=60", extra=store.extra)
    assert _renameat2(m / "a", m / "b", _RENAME_NOREPLACE) == errno.EEXIST
    write_file(m / "new", b"n")  # held in memory (flush_delay)
    assert _renameat2(m / "a", m / "new", _RENAME_NOREPLACE) == errno.EEXIST
    assert (m / "a").read_bytes() == b"a" and (m / "new").read_bytes() == b"n"
    assert _renameat2(m / "a", m / "c", _RENAME_NOREPLACE) == 0
    assert (m / "c").read_bytes() == b"a" and not (m / "a").exists()
    chunk = (m / "arr/c/0/0").read_bytes()
    assert _renameat2(m / "arr/c/0/0", m / "arr/c/0/1", _RENAME_NOREPLACE) == errno.EEXIST
    assert _renameat2(m / "arr/c/0/0", m / "arr/c/0/0.tmp", _RENAME_NOREPLACE) == 0
    assert _renameat2(m / "arr/c/0/0.tmp", m / "arr/c/0/0", _RENAME_NOREPLACE) == 0
    assert (m / "arr/c/0/0").read_bytes() == chunk
    m.umount()  # (stores what flush_delay held)
    assert store.get("c") == b"a" and store.get("a") is None and store.get("b") == b"b" and store.get("new") == b"n"


def test_a_directory_another_client_removed_lists_empty_while_the_kernel_holds_it(store, mount):
    """A directory another client removed whole (S3: every key below it
    deleted) lists as empty, not ENOENT, while the kernel holds its entry
    (``attr_timeout``; the listing itself is asked anew past
    ``metadata_ttl``): storage has nothing below it, and the directory is
    gone only once the kernel asks for its entry again, as any change by
    others shows within ``attr_timeout``.  (The live damage fuzzer met it:
    pc_kv seed 405 on S3.)"""
    for key, data in (("gone/x.txt", b"x"), ("gone/sub/y.txt", b"y"), ("kept.txt", b"k")):
        store.put(key, data)
    m = mount(store.source, "ro", "metadata_ttl=0.2", "attr_timeout=2", extra=store.extra)
    assert sorted(os.listdir(m.path / "gone")) == ["sub", "x.txt"] and os.listdir(m.path / "gone/sub") == ["y.txt"]
    if store.kind == "local":
        shutil.rmtree(store.root / "gone")
    else:
        for key in ("gone/x.txt", "gone/sub/y.txt"):
            store.server.s3.delete_object(Bucket=store.bucket, Key=f"{PREFIX}/{key}")
    time.sleep(0.5)  # (past metadata_ttl, within attr_timeout)
    assert os.listdir(m.path / "gone") == [] and os.listdir(m.path / "gone/sub") == []
    assert util.wait_for(lambda: not os.path.lexists(m.path / "gone"), timeout=15)
    with pytest.raises(FileNotFoundError):
        os.listdir(m.path / "gone")
    assert sorted(os.listdir(m.path)) == ["kept.txt"]
