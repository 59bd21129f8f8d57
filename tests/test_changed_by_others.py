"""Stores that another client changes while they are mounted.

SEMANTICS 2.5: changes by others show within the TTLs, and a read never
hands out a mix of two versions, nor a new version cut to the old size.
Each test mounts for real; the other client writes straight into the
storage (moto over HTTP, or the local directory).
"""

from __future__ import annotations

import contextlib
import errno
import gzip
import json
import os
import shutil
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest
import zarr
from zarr.codecs import GzipCodec

PREFIX = "data"


class Storage:
    """The mounted storage, written around zshardfs by "another client"."""

    def __init__(self, kind: str, root: Path | None = None, server=None, bucket: str | None = None):
        self.kind, self.root, self.server, self.bucket = kind, root, server, bucket

    def mount(self, mount, *opts: str, mode: str = "ro"):
        if self.kind == "local":
            return mount(self.root, mode, *opts)
        return mount(f"s3://{self.bucket}/{PREFIX}", mode, *opts, extra=["--endpoint-url", self.server.endpoint_url])

    def put(self, key: str, data: bytes) -> None:
        if self.kind == "local":
            path = self.root / key
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_name(path.name + ".new")
            tmp.write_bytes(data)
            os.replace(tmp, path)  # as tools replace files: a new inode
        else:
            self.server.s3.put_object(Bucket=self.bucket, Key=f"{PREFIX}/{key}", Body=data)

    def rename(self, old: str, new: str) -> None:
        """``mv old new`` (S3: a copy, then the old object's delete, as ``aws s3 mv``)."""
        if self.kind == "local":
            os.rename(self.root / old, self.root / new)
        else:
            s3 = self.server.s3
            s3.copy_object(Bucket=self.bucket, Key=f"{PREFIX}/{new}",
                           CopySource={"Bucket": self.bucket, "Key": f"{PREFIX}/{old}"})
            s3.delete_object(Bucket=self.bucket, Key=f"{PREFIX}/{old}")


@pytest.fixture(params=["local", "s3"])
def storage(request, tmp_path) -> Storage:
    if request.param == "local":
        root = tmp_path / "store"
        root.mkdir()
        return Storage("local", root=root)
    _, bucket = request.getfixturevalue("s3_bucket")
    return Storage("s3", server=request.getfixturevalue("moto_server"), bucket=bucket)


@contextlib.contextmanager
def mounted_without_file_mode_override(src: Path, mnt: Path, log: Path):
    """A read-only mount by a daemon that file modes bind (root without
    CAP_DAC_OVERRIDE and CAP_DAC_READ_SEARCH, as any other user is)."""
    from tests.conftest import ZSHARDFS

    mnt.mkdir()
    drop = "-dac_override,-dac_read_search"
    subprocess.run(["setpriv", f"--bounding-set={drop}", f"--inh-caps={drop}", *ZSHARDFS, "mount", str(src),
                    str(mnt), "-o", f"ro,log_file={log}"], check=True, timeout=60)
    try:
        yield mnt
    finally:
        subprocess.run([*ZSHARDFS, "umount", str(mnt)], timeout=60)
    assert "Traceback" not in log.read_text()


def gzip_array(path: Path, values: np.ndarray) -> None:
    zarr.create_array(str(path), shape=values.shape, chunks=(32,), shards=(64,), dtype="uint8",
                      compressors=GzipCodec(), fill_value=0)[:] = values


def test_a_chunk_replaced_with_another_size_is_read_whole(storage, mount, tmp_path):
    """The kernel knows a chunk file's size (stat); another client replaces
    the shard, and the chunk's size changes (gzip: 23 bytes to 55).  A read
    within ``attr_timeout`` gets a whole chunk: the new one when the kernel
    held only the size (the open notices the change, updates the kernel's
    size and drops its pages; before, the new bytes came cut to the old
    size, a gzip stream that does not decode), the old one when it held
    its pages too.  After ``attr_timeout``, the new one."""
    small = np.zeros(64, "uint8")
    small[0] = 1
    big = np.random.default_rng(0).integers(1, 255, 64).astype("uint8")
    gzip_array(tmp_path / "A", small)
    gzip_array(tmp_path / "B", big)
    for name in ("a", "b"):  # one shard each, of chunks c/0 and c/1
        storage.put(f"{name}/zarr.json", (tmp_path / "A/zarr.json").read_bytes())
        storage.put(f"{name}/c/0", (tmp_path / "A/c/0").read_bytes())
    m = storage.mount(mount, "attr_timeout=3")
    stat_only, read_before = m / "a/c/0", m / "b/c/0"

    def chunk(data: bytes) -> np.ndarray:
        return np.frombuffer(gzip.decompress(data), "uint8")

    before = os.stat(stat_only).st_size
    assert np.array_equal(chunk(read_before.read_bytes()), small[:32])
    for name in ("a", "b"):
        storage.put(f"{name}/c/0", (tmp_path / "B/c/0").read_bytes())
    t0 = time.monotonic()
    time.sleep(1.5)  # past index_ttl (1 s; local: and the kept descriptor's 1 s), inside attr_timeout
    got = stat_only.read_bytes()
    assert len(got) != before and np.array_equal(chunk(got), big[:32])
    assert os.stat(stat_only).st_size == len(got)
    old_or_new = chunk(read_before.read_bytes())
    assert np.array_equal(old_or_new, small[:32]) or np.array_equal(old_or_new, big[:32])
    assert time.monotonic() - t0 < 3, "too slow to test inside attr_timeout"
    time.sleep(3)
    assert np.array_equal(chunk(read_before.read_bytes()), big[:32])
    assert np.array_equal(zarr.open_array(str(m / "a"), mode="r")[:], big)


def test_a_file_replaced_while_it_is_read_is_never_mixed(storage, mount):
    """A plain file larger than ``open_fill`` is read through READ requests,
    each pinned to the version the reader opened.  If another client
    replaces it mid-read, the reader gets the old version whole (local: the
    open file, as on POSIX) or EIO for the rest with one log line (S3: the
    old version is gone), never a mix of the two.  Opened again once the
    kernel's attributes have expired, it is the new version whole."""
    old, new = b"O" * (4 << 20), b"N" * (3 << 20)
    storage.put("big.bin", old)
    m = storage.mount(mount, "attr_timeout=1")
    got, failed = b"", None
    with open(m / "big.bin", "rb", buffering=0) as f:
        got += f.read(1 << 20)
        storage.put("big.bin", new)
        time.sleep(0.2)
        try:
            while piece := f.read(1 << 20):
                got += piece
        except OSError as exc:
            failed = exc.errno
    assert set(got) == {ord("O")}, "a mix of two versions"
    if storage.kind == "s3":
        assert failed == 5
        assert len([line for line in m.log_text().splitlines() if "replaced by another client" in line]) == 1
    else:  # the open file while its kept descriptor answers (1 s), then EIO
        assert failed is None and got == old
    time.sleep(1.5)
    assert (m / "big.bin").read_bytes() == new


def test_an_object_named_like_a_directory_is_shown_once(moto_server, s3_bucket, mount, tmp_path):
    """S3 can hold an object ``arr`` beside objects ``arr/...`` (some tools
    leave empty "directory marker" objects).  Each name is shown once: an
    empty object gives way to the directory, so the array stays reachable;
    a non-empty object is the file (and its namesake directory is hidden)."""
    _, bucket = s3_bucket
    s3 = moto_server.s3
    src = tmp_path / "arr"
    zarr.create_array(str(src), shape=(4,), chunks=(2,), shards=(4,), dtype="uint8", fill_value=0)[:] = [1, 2, 3, 4]
    for p in src.rglob("*"):
        if p.is_file():
            s3.put_object(Bucket=bucket, Key=f"{PREFIX}/arr/{p.relative_to(src)}", Body=p.read_bytes())
    s3.put_object(Bucket=bucket, Key=f"{PREFIX}/arr", Body=b"")
    s3.put_object(Bucket=bucket, Key=f"{PREFIX}/notes", Body=b"text")
    s3.put_object(Bucket=bucket, Key=f"{PREFIX}/notes/hidden.txt", Body=b"x")
    m = mount(f"s3://{bucket}/{PREFIX}", "ro", extra=["--endpoint-url", moto_server.endpoint_url])
    assert sorted(os.listdir(m.path)) == ["arr", "notes"]
    assert (m / "arr").is_dir() and (m / "notes").is_file()
    assert (m / "notes").read_bytes() == b"text"
    assert list(zarr.open_array(str(m / "arr"), mode="r")[:]) == [1, 2, 3, 4]
    m2 = mount(f"s3://{bucket}/{PREFIX}", "ro", extra=["--endpoint-url", moto_server.endpoint_url])
    # looked up before anything was listed: the same answers
    assert (m2 / "arr").is_dir() and (m2 / "notes").is_file()
    assert sorted(os.listdir(m2.path)) == ["arr", "notes"]
    shutil.rmtree(tmp_path / "arr")


def test_a_shard_replaced_within_the_same_second_is_seen(moto_server, s3_bucket, mount, tmp_path):
    """S3 gives Last-Modified in whole seconds, and uncompressed chunks
    keep their size: a shard replaced within the second it was read would
    look unchanged to the kernel (size and mtime), which would serve its
    old pages for good.  The sub-second part of mtime comes from the ETag,
    so the change shows once the attributes expire."""
    _, bucket = s3_bucket
    s3 = moto_server.s3
    for name, value in (("A", 1), ("B", 2)):
        zarr.create_array(str(tmp_path / name), shape=(64,), chunks=(32,), shards=(64,), dtype="uint8",
                          compressors=None, fill_value=0)[:] = value
    s3.put_object(Bucket=bucket, Key=f"{PREFIX}/arr/zarr.json", Body=(tmp_path / "A/zarr.json").read_bytes())
    m = mount(f"s3://{bucket}/{PREFIX}", "ro", "attr_timeout=1",
              extra=["--endpoint-url", moto_server.endpoint_url])
    chunk = m / "arr/c/0"
    for attempt in range(5):  # until both writes fall in one second (the case in point)
        time.sleep(1.2)  # the previous attempt's attributes expire
        time.sleep(1 - time.time() % 1 + 0.02)
        s3.put_object(Bucket=bucket, Key=f"{PREFIX}/arr/c/0", Body=(tmp_path / "A/c/0").read_bytes())
        before = os.stat(chunk)
        assert chunk.read_bytes() == bytes([1] * 32)
        s3.put_object(Bucket=bucket, Key=f"{PREFIX}/arr/c/0", Body=(tmp_path / "B/c/0").read_bytes())
        head = s3.head_object(Bucket=bucket, Key=f"{PREFIX}/arr/c/0")["LastModified"].timestamp()
        if int(head) == int(before.st_mtime):
            break
    else:
        pytest.fail("could not replace the shard within one second")
    time.sleep(2.5)  # past attr_timeout and index_ttl
    after = os.stat(chunk)
    assert after.st_size == before.st_size and int(after.st_mtime) == int(before.st_mtime)
    assert after.st_mtime_ns != before.st_mtime_ns
    assert chunk.read_bytes() == bytes([2] * 32)


def test_a_shard_rewritten_in_place_gives_old_or_new_bytes(mount, tmp_path):
    """Local: a shard rewritten in place (same inode, same size, another
    layout: ``rsync --inplace``, ``open(..., "r+b")``) by another process.
    The descriptors kept for reads without a thread hop are checked against
    the file before use, so a chunk read later is the old or the new chunk,
    never bytes at the old offsets of the new file."""
    import crc32c

    src = tmp_path / "store"

    def write(path, base):
        zarr.create_array(str(path), shape=(4,), chunks=(2,), shards=(4,), dtype="uint8", compressors=None,
                          fill_value=0)[:] = np.arange(4, dtype="uint8") + base

    write(src / "arr", 10)
    write(tmp_path / "v2", 100)
    shard = (tmp_path / "v2/c/0").read_bytes()
    table = np.frombuffer(shard[-36:-4], "<u8").reshape(2, 2)
    c0, c1 = (shard[int(o):int(o + n)] for o, n in table)
    index = np.array([[len(c1), len(c0)], [0, len(c1)]], "<u8").tobytes()  # chunk 1 first now
    swapped = c1 + c0 + index + crc32c.crc32c(index).to_bytes(4, "little")
    assert len(swapped) == (src / "arr/c/0").stat().st_size
    m = mount(src, "ro", "open_fill=0", "index_ttl=0.3", "attr_timeout=2")
    assert (m / "arr/c/0").read_bytes() == bytes([10, 11])
    os.stat(m / "arr/c/1")
    with open(src / "arr/c/0", "r+b") as f:
        f.write(swapped)
    time.sleep(0.6)  # past index_ttl (0.3 s)
    assert (m / "arr/c/1").read_bytes() in (bytes([12, 13]), bytes([102, 103]))
    time.sleep(2.2)  # past attr_timeout (2 s): the new version
    assert (m / "arr/c/1").read_bytes() == bytes([102, 103])


def test_special_files_and_a_vanished_source_are_answered(mount, tmp_path):
    """Local: named pipes where shards or files belong are not files (a
    blocking open of one used to hold a worker thread for good, and enough
    of them took the whole mount down); ``statfs`` of a source that was
    removed is an error, not a traceback."""
    src = tmp_path / "store"
    zarr.create_array(str(src / "arr"), shape=(8,), chunks=(2,), shards=(4,), dtype="uint8", compressors=None,
                      fill_value=0)[:] = np.arange(8, dtype="uint8")
    os.unlink(src / "arr/c/1")
    os.mkfifo(src / "arr/c/1")
    for i in range(24):
        os.mkfifo(src / f"pipe{i}")
    m = mount(src, "ro", "max_connections=4", "timeout=3")
    for _ in range(3):
        for i in (4, 5):
            with pytest.raises(FileNotFoundError):
                (m / f"arr/c/{i}").read_bytes()
    for i in range(24):
        assert not (m / f"pipe{i}").exists()
    assert (m / "arr/c/1").read_bytes() == bytes([2, 3])
    assert zarr.open_array(str(m / "arr"), mode="r")[:4].tolist() == [0, 1, 2, 3]
    shutil.rmtree(src)
    with pytest.raises(OSError):
        os.statvfs(m.path)
    assert "Traceback" not in m.log_text()


def test_unreadable_files_leave_the_rest_readable(tmp_path):
    """Local, the daemon unable to read some files (here: root without the
    capabilities that override file modes, as any other user): an
    unreadable shard is left out of listings with one warning, as a damaged
    one is, and an unreadable ``info`` (a layout's probe document) leaves its
    directory a plain one: no EACCES for everything around them."""
    src, mnt, log = tmp_path / "store", tmp_path / "mnt", tmp_path / "log"
    zarr.create_array(str(src / "arr"), shape=(4, 12), chunks=(2, 3), shards=(4, 6), dtype="uint8",
                      compressors=None, fill_value=0)[:] = 1
    os.chmod(src / "arr/c/0/0", 0)  # shard (0, 0): chunks c/0/0, c/0/1, c/1/0, c/1/1
    (src / "plain/sub").mkdir(parents=True)
    (src / "plain/ok.txt").write_text("ok")
    (src / "plain/sub/f.txt").write_text("f")
    (src / "plain/info").write_text("notes")
    os.chmod(src / "plain/info", 0)
    with mounted_without_file_mode_override(src, mnt, log):
        assert sorted(os.listdir(mnt / "arr/c/0")) == ["2", "3"]
        assert (mnt / "arr/c/0/2").read_bytes() == b"\x01" * 6
        with pytest.raises(PermissionError):
            (mnt / "arr/c/0/0").read_bytes()
        assert sorted(os.listdir(mnt / "plain")) == ["info", "ok.txt", "sub"]
        assert (mnt / "plain/ok.txt").read_text() == "ok" and (mnt / "plain/sub/f.txt").read_text() == "f"
        with pytest.raises(PermissionError):
            (mnt / "plain/info").read_bytes()
    text = log.read_text()
    assert len([line for line in text.splitlines() if "arr/c/0/0" in line and "not listed" in line]) == 1


def test_a_garbage_index_and_a_symlink_loop_are_one_line_each(mount, tmp_path):
    """A shard whose index (no checksum) is garbage: every chunk read by its
    path is EIO, and the log has one line for the shard, not one per chunk
    (zarr-python and tensorstore read by path; a 4096-chunk shard made 4097
    lines).  A shard that is a symlink loop is left out of its directory's
    listing, as a damaged shard is, and the rest stays listed (before: the
    whole listing failed with ELOOP)."""
    from zarr.codecs import BytesCodec, ShardingCodec

    src = tmp_path / "store"
    zarr.create_array(str(src / "garbage"), shape=(8, 12), dtype="u1", chunks=(8, 12), fill_value=0,
                      serializer=ShardingCodec(chunk_shape=(2, 3), codecs=[BytesCodec()],
                                               index_codecs=[BytesCodec()]), compressors=None)[...] = 1
    shard = src / "garbage/c/0/0"
    data = shard.read_bytes()
    past = np.full((16, 2), len(data) + 100, "<u8")  # every entry past the end of the shard
    shard.write_bytes(data[:-past.nbytes] + past.tobytes())
    zarr.create_array(str(src / "loop"), shape=(4, 12), chunks=(2, 3), shards=(4, 6), dtype="u1",
                      compressors=None, fill_value=0)[...] = 2
    (src / "loop/c/0/1").unlink()
    os.symlink("1", src / "loop/c/0/1")  # (the shard of chunks c/0/2, c/0/3, c/1/2, c/1/3)
    m = mount(src, "ro")
    for i in range(4):
        for j in range(4):
            with pytest.raises(OSError) as raised:
                (m / f"garbage/c/{i}/{j}").read_bytes()
            assert raised.value.errno == errno.EIO
    assert sorted(os.listdir(m / "loop/c/0")) == ["0", "1"]
    assert (m / "loop/c/0/1").read_bytes() == b"\x02" * 6
    m.umount()
    lines = m.log_text().splitlines()
    assert len([line for line in lines if "garbage/c/0/0" in line]) == 1, lines
    assert len([line for line in lines if "loop/c/0/1" in line]) == 1, lines


def _read_or_eio(path: Path) -> bytes | None:
    try:
        return path.read_bytes()
    except OSError as exc:
        assert exc.errno == 5, exc
        return None


def test_a_chunk_read_while_another_handle_is_open_is_whole_or_eio(storage, mount, tmp_path):
    """Another process holds the chunk open (its pages dropped, as memory
    pressure may do), so the open cannot renew the kernel's view; another
    client replaces the shard with a bigger chunk.  A read gets a whole
    version or EIO (one log line; the kernel is told to ask again), never
    the new bytes cut to the old size; the next read is the new chunk."""
    small = np.zeros(64, "uint8")
    small[0] = 1
    big = np.random.default_rng(1).integers(1, 255, 64).astype("uint8")
    gzip_array(tmp_path / "A", small)
    gzip_array(tmp_path / "B", big)
    storage.put("arr/zarr.json", (tmp_path / "A/zarr.json").read_bytes())
    storage.put("arr/c/0", (tmp_path / "A/c/0").read_bytes())
    m = storage.mount(mount, "attr_timeout=30", "index_ttl=0.3")
    chunk = m / "arr/c/0"
    old = chunk.read_bytes()
    new = None
    with open(chunk, "rb") as held:
        assert held.read() == old
        os.posix_fadvise(held.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
        storage.put("arr/c/0", (tmp_path / "B/c/0").read_bytes())
        # past index_ttl (0.3 s; local: and the kept descriptor's 1 s, a new inode), inside attr_timeout
        time.sleep(0.6 if storage.kind == "s3" else 1.5)
        got = _read_or_eio(chunk)
        assert got is None or got == old or np.array_equal(np.frombuffer(gzip.decompress(got), "uint8"), big[:32])
    for _ in range(2):
        new = _read_or_eio(chunk)
        if new is not None:
            break
    assert new is not None and np.array_equal(np.frombuffer(gzip.decompress(new), "uint8"), big[:32])


def test_precomputed_names_outside_the_grid_and_unreadable_shards(mount, tmp_path):
    """Precomputed, local: a file spelled as a chunk of the directory but none
    of its chunks (a box off the volume or misaligned, an id past 2**64-1)
    is refused at create and as a rename target, never stored as a stray
    file; an unreadable shard (the daemon without the capabilities that
    override file modes) is left out of the listing, the rest listed."""
    import json

    from zshardfs.layouts.precomputed_format import ShardingSpec, encode_shard

    src = tmp_path / "store"
    (src / "pc/s0").mkdir(parents=True)
    sharding = {"@type": "neuroglancer_uint64_sharded_v1", "preshift_bits": 0, "hash": "identity",
                "minishard_bits": 1, "shard_bits": 1}
    (src / "pc/info").write_text(json.dumps({
        "@type": "neuroglancer_multiscale_volume", "data_type": "uint8", "num_channels": 1, "type": "image",
        "scales": [{"key": "s0", "size": [8, 8, 8], "chunk_sizes": [[4, 4, 4]], "encoding": "raw",
                    "resolution": [1, 1, 1], "voxel_offset": [0, 0, 0], "sharding": sharding}]}))
    m = mount(src, "flush_delay=60")
    (m / "pc/s0/0-4_0-4_0-4").write_bytes(b"\x05" * 64)
    for name in ("8-12_0-4_0-4", "0-4_0-4_0-3", "4-9_4-8_4-8"):
        with pytest.raises(FileNotFoundError):
            (m / "pc/s0" / name).write_bytes(b"\x06" * 64)
    with pytest.raises(FileNotFoundError):
        os.rename(m / "pc/s0/0-4_0-4_0-4", m / "pc/s0/12-16_0-4_0-4")
    assert os.listdir(m / "pc/s0") == ["0-4_0-4_0-4"]
    m.umount()
    assert all(name.endswith(".shard") for name in os.listdir(src / "pc/s0"))

    (src / "skel").mkdir()
    kv = {"@type": "neuroglancer_uint64_sharded_v1", "preshift_bits": 0, "hash": "identity", "minishard_bits": 0,
          "shard_bits": 1}
    (src / "skel/info").write_text(json.dumps({"@type": "neuroglancer_skeletons", "sharding": kv}))
    spec = ShardingSpec.from_json(kv)
    (src / "skel" / spec.shard_key(0)).write_bytes(encode_shard({2: b"x" * 10}, spec))
    (src / "skel" / spec.shard_key(1)).write_bytes(encode_shard({1: b"y" * 10}, spec))
    os.chmod(src / "skel" / spec.shard_key(1), 0)
    with mounted_without_file_mode_override(src, tmp_path / "mnt", tmp_path / "log") as mnt:
        assert sorted(os.listdir(mnt / "skel")) == ["2", "info"]
        assert (mnt / "skel/2").read_bytes() == b"x" * 10
        with pytest.raises(PermissionError):
            (mnt / "skel/1").read_bytes()


@pytest.mark.parametrize("first", ["path", "descriptor"])
def test_a_file_rotated_by_another_client_while_open_gets_a_new_number_at_its_path(storage, mount, first):
    """``tail -F`` and logrotate's readers tell a rotation by comparing the
    path's ``st_ino`` with their open descriptor's.  Another client moves
    ``log`` (open through the mount) to ``log.1`` and writes a new ``log``:
    once the mount sees it, the path has a new number, and the descriptor
    keeps its own and its file's size (its reads answer EIO, 2.5): never two
    files with one number at once.  Seen first through the path (a lookup:
    ``attr_timeout=0``), or first through the descriptor (its attributes
    expired: ``getattr`` finds the new file).  A file the mount itself
    rewrote keeps its number."""
    timeout = "0" if first == "path" else "1"
    storage.put("log", b"old log")
    storage.put("other", b"other")
    m = storage.mount(mount, f"attr_timeout={timeout},metadata_ttl=0,index_ttl=0", mode="rw")
    fd, kept = os.open(m / "log", os.O_RDONLY), os.open(m / "other", os.O_RDONLY)
    try:
        number, other = os.fstat(fd).st_ino, os.stat(m / "other").st_ino
        assert os.stat(m / "log").st_ino == number and os.fstat(kept).st_ino == other
        with open(m / "other", "ab") as f:  # (the mount's own write: the same file)
            f.write(b"!")
        storage.rename("log", "log.1")
        storage.put("log", b"the new log")
        if first == "descriptor":
            time.sleep(1.3)
            assert (os.fstat(fd).st_ino, os.fstat(fd).st_size) == (number, len(b"old log"))
        now = os.stat(m / "log")
        assert now.st_ino != number, "the new file has the open one's number"
        assert now.st_size == len(b"the new log")
        assert (os.fstat(fd).st_ino, os.fstat(fd).st_size) == (number, len(b"old log"))
        assert os.stat(m / "log.1").st_ino not in (number, now.st_ino)
        assert os.stat(m / "log").st_ino == now.st_ino  # (its new number stays)
        assert os.stat(m / "other").st_ino == other == os.fstat(kept).st_ino
    finally:
        os.close(fd)
        os.close(kept)
    assert os.stat(m / "log").st_ino == now.st_ino
    assert (m / "log").read_bytes() == b"the new log"


def test_a_file_replaced_after_the_mounts_own_write_is_read_in_the_later_version(storage, mount):
    """The mount's own rewrite is visible at once to readers that had the
    file open; a reader that learned of the file after another client
    replaced it again reads that later version (not pinned back to the
    mount's own, which would fail with EIO)."""
    opts = ["attr_timeout=1"]
    if storage.kind == "local":
        m = mount(storage.root, "rw", *opts)
    else:
        m = mount(f"s3://{storage.bucket}/{PREFIX}", "rw", *opts,
                  extra=["--endpoint-url", storage.server.endpoint_url])
    (m / "big.bin").write_bytes(b"M" * (2 << 20))  # the mount's own version
    time.sleep(1.5)
    storage.put("big.bin", b"O" * (3 << 20))  # then another client's
    time.sleep(2.5)  # past attr_timeout, metadata_ttl and the kept descriptor's 1 s
    assert (m / "big.bin").read_bytes() == b"O" * (3 << 20)


@pytest.mark.parametrize("own_write", [False, True], ids=["", "own_write_of_another_chunk"])
def test_a_chunk_read_in_pieces_while_its_shard_is_replaced_is_one_version(storage, mount, tmp_path, own_write):
    """A chunk larger than ``open_fill`` is read in pieces; another client
    replaces its shard between them with one of the same layout (same
    sizes, other bytes). The reader gets one version whole, never the first
    MiB of one and the rest of the other; also when this mount meanwhile
    writes another chunk of that shard."""
    versions = []
    for v in (1, 2):
        a = zarr.create_array(str(tmp_path / f"v{v}"), shape=(2048, 1024), chunks=(1024, 1024),
                              shards=(2048, 1024), dtype="<u4", compressors=None, fill_value=0)
        a[:] = v
        versions.append((tmp_path / f"v{v}" / "c" / "0" / "0").read_bytes())
    assert len(versions[0]) == len(versions[1])
    storage.put("a/zarr.json", (tmp_path / "v1" / "zarr.json").read_bytes())
    storage.put("a/c/0/0", versions[0])
    m = storage.mount(mount, "index_ttl=0.3", mode="rw" if own_write else "ro")
    with open(m / "a" / "c" / "0" / "0", "rb", buffering=0) as f:
        first = f.read(1 << 20)
        storage.put("a/c/0/0", versions[1])
        # past index_ttl (0.3 s; local: and the kept descriptor's 1 s, a new inode): the mount knows of
        # the new version
        time.sleep(0.6 if storage.kind == "s3" else 1.3)
        if own_write:
            (m / "a" / "c" / "1" / "0").write_bytes(versions[0][:4 << 20])
        rest = b""
        while piece := f.read(1 << 20):
            rest += piece
    got = np.unique(np.frombuffer(first + rest, "<u4"))
    assert got.tolist() in ([1], [2]), got
    assert len(first + rest) == 4 << 20


@pytest.mark.parametrize("opened", ["filling", "while_filled"])
def test_a_chunk_whose_pages_the_kernel_dropped_while_replaced_is_one_version(storage, mount, tmp_path, opened):
    """A chunk up to ``open_fill`` is handed to the kernel whole at its open,
    and its reads are served from the page cache; pages the kernel drops
    while the file is open (memory pressure; here ``POSIX_FADV_DONTNEED``,
    as a ``mmap`` reader saw happen by itself) are asked for again.  If
    another client replaced the shard meanwhile (same sizes, other bytes),
    such a read is EIO with one log line, never the new bytes beside the old
    ones the reader has had; a new open reads the new version whole.  The
    same for a file opened while the kernel still held the pages another
    open filled.  Before, the reader got the first page of one version and
    the rest of the other."""
    versions = []
    for v in (1, 2):
        a = zarr.create_array(str(tmp_path / f"v{v}"), shape=(256, 256), chunks=(256, 256), shards=(256, 256),
                              dtype="<u4", compressors=None, fill_value=0)
        a[:] = v
        versions.append((tmp_path / f"v{v}" / "c" / "0" / "0").read_bytes())
    storage.put("a/zarr.json", (tmp_path / "v1" / "zarr.json").read_bytes())
    storage.put("a/c/0/0", versions[0])
    m = storage.mount(mount, "index_ttl=0.3")
    p = m / "a" / "c" / "0" / "0"
    if opened == "while_filled":
        assert np.unique(np.frombuffer(p.read_bytes(), "<u4")).tolist() == [1]  # (fills the page cache; the next open does not)
    fd = os.open(p, os.O_RDONLY)
    try:
        assert np.unique(np.frombuffer(os.pread(fd, 4096, 0), "<u4")).tolist() == [1]
        storage.put("a/c/0/0", versions[1])
        # past index_ttl (0.3 s; local: and the kept descriptor's 1 s, a new inode): the mount knows of
        # the new version
        time.sleep(0.6 if storage.kind == "s3" else 1.3)
        os.posix_fadvise(fd, 4096, 0, os.POSIX_FADV_DONTNEED)
        with pytest.raises(OSError) as err:
            got = os.pread(fd, 4096, 8192)
            print("read", np.unique(np.frombuffer(got, "<u4")))
        assert err.value.errno == errno.EIO
    finally:
        os.close(fd)
    assert np.unique(np.frombuffer(p.read_bytes(), "<u4")).tolist() == [2]
    assert m.log_text().count("replaced by another client while open") == 1


def test_an_in_place_write_patches_the_newest_stored_version(storage, mount):
    """A file the mount stored, then replaced by another client, and then
    opened for an in-place write (no ``O_TRUNC``) through the mount: the
    write patches the other client's version, read from storage at the open,
    even within the listing TTL.  (Bytes the mount keeps of its own recent
    PUTs serve a rename's copy only; used here, they wrote the mount's older
    version back over the newer one.)"""
    m = storage.mount(mount, "metadata_ttl=30", "attr_timeout=0", mode="rw")
    (m / "log.txt").write_bytes(b"mine v1\n")
    storage.put("log.txt", b"OTHER CLIENT v2, much longer\n")
    fd = os.open(m / "log.txt", os.O_WRONLY)
    try:
        os.pwrite(fd, b"o", 0)
    finally:
        os.close(fd)
    m.umount()
    if storage.kind == "local":
        stored = (storage.root / "log.txt").read_bytes()
    else:
        stored = storage.server.s3.get_object(Bucket=storage.bucket, Key=f"{PREFIX}/log.txt")["Body"].read()
    assert stored == b"oTHER CLIENT v2, much longer\n"


def test_tensorstore_writing_the_same_shard_directly_loses_no_write(mount, tmp_path):
    """tensorstore writes one chunk of a shard straight into a local store
    while the mount writes another chunk of it and syncs.  Both take
    tensorstore's lock of the shard (``<key>.__lock``) for their
    check-and-replace, so each write is merged onto the other's, and none
    is lost (before, about one mount write in fifteen was replaced by
    tensorstore's shard, built on the older version, with no error)."""
    import threading

    import tensorstore as ts

    from tests.conftest import ZSHARDFS

    root = tmp_path / "store"
    zarr.create_array(str(root / "arr"), shape=(16, 16), chunks=(4, 4), shards=(16, 16), dtype="<i4",
                      compressors=None, fill_value=0)[...] = 7
    m = mount(root, "rw", "flush_delay=inf")
    direct = ts.open({"driver": "zarr3", "kvstore": {"driver": "file", "path": str(root / "arr")}}).result()
    for r in range(30):
        stop = threading.Event()

        def tensorstore_writes():
            k = 0
            while not stop.is_set():
                k += 1
                direct[0:4, 0:4].write(np.full((4, 4), k, "<i4")).result()
                time.sleep(0.005)

        writer = threading.Thread(target=tensorstore_writes)
        writer.start()
        try:
            time.sleep(0.03)
            (m / "arr/c/1/1").write_bytes(np.full((4, 4), 1000 + r, "<i4").tobytes())
            for _ in range(3):  # (a flush that loses the race 12 times in a row fails its round: EIO, data kept)
                if subprocess.run([*ZSHARDFS, "sync", str(m.path)], capture_output=True, timeout=60).returncode == 0:
                    break
            else:
                pytest.fail(f"round {r}: three syncs in a row lost every race")
        finally:
            stop.set()
            writer.join()
        stored = zarr.open_array(str(root / "arr"), mode="r")
        assert (stored[4:8, 4:8] == 1000 + r).all(), f"round {r}: the mount's stored write was lost"
    assert not list(root.rglob("*.__lock"))


def test_a_chunk_declared_huge_in_a_sparse_huge_shard_is_neither_read_nor_allocated(mount, tmp_path):
    """Another client makes a shard a sparse 1 TiB file (``truncate -s 1T``) under a live
    mount and writes an index (no checksum) at its end that keeps the chunks' entries but
    declares one chunk 64 GiB long, starting at 0: no longer past the end of the shard.
    Reading that chunk is EIO with one log line (before: the daemon asked for 64 GiB at
    once, a MemoryError and a traceback per read); the other chunks read as stored; a
    write to another chunk of the shard fails (at the open: the damage is known) and
    leaves the shard as it is
    (it would read the 64 GiB to keep them), and the daemon neither reads nor allocates
    such sizes."""
    from zarr.codecs import BytesCodec, ShardingCodec

    src = tmp_path / "store"
    zarr.create_array(str(src / "a"), shape=(8, 12), dtype="u1", chunks=(8, 12), fill_value=0,
                      serializer=ShardingCodec(chunk_shape=(2, 3), codecs=[BytesCodec()],
                                               index_codecs=[BytesCodec()]), compressors=None)[...] = 7
    m = mount(src, "rw", "metadata_ttl=0.2", "index_ttl=0.2", "attr_timeout=0.2")
    pid = int(os.getxattr(m.path, "user.zshardfs.pid"))
    good = {f"{i}/{j}": (m / f"a/c/{i}/{j}").read_bytes() for i in range(4) for j in range(4)}
    shard = src / "a/c/0/0"
    stored = shard.read_bytes()
    index = np.frombuffer(stored[-256:], "<u8").reshape(16, 2).copy()
    index[0] = (0, 64 << 30)
    os.truncate(shard, 1 << 40)
    with open(shard, "r+b") as f:
        f.seek((1 << 40) - 256)
        f.write(index.tobytes())
    time.sleep(0.6)  # (past the TTLs, 0.2 s)
    assert (m / "a/c/0/0").stat().st_size == 64 << 30
    fd = os.open(m / "a/c/0/0", os.O_RDONLY)
    try:
        with pytest.raises(OSError) as raised:
            os.read(fd, 4096)  # (a 64 GiB file: not read_bytes, which would allocate it here)
    finally:
        os.close(fd)
    assert raised.value.errno == errno.EIO
    for rel, data in good.items():
        if rel != "0/0":
            assert (m / f"a/c/{rel}").read_bytes() == data, rel
    assert not _write_fails_at_fsync(m / "a/c/1/1", b"\x09" * 6)  # (its damage known: refused at the open)
    assert shard.stat().st_size == 1 << 40
    status = Path(f"/proc/{pid}/status").read_text()
    peak = next(int(line.split()[1]) for line in status.splitlines() if line.startswith("VmHWM:")) << 10
    assert peak < 512 << 20, status
    shard.write_bytes(stored)  # repaired: nothing was held for it
    time.sleep(0.5)
    m.umount()
    assert zarr.open_array(str(src / "a"), mode="r")[2:4, 3:6].tolist() == [[7] * 3] * 2
    assert "Traceback" not in m.log_text(), m.log_text()[-3000:]
    # one line for the damaged shard, whichever path met it (reads, the flush, the fsync)
    lines = [line for line in m.log_text().splitlines() if "a/c/0/0" in line]
    assert len(lines) == 1 and "damaged data: a/c/0/0" in lines[0] and "larger than" in lines[0], lines


def _write_fails_at_fsync(path: Path, data: bytes, mode: str = "r+b") -> bool:
    """Write ``data`` at the start of ``path`` and fsync: the fsync must be EIO,
    or the open, when the mount knew the damage already (nothing is held then,
    SEMANTICS Limits).  True if the write was held (EIO at the fsync)."""
    held = False
    with pytest.raises(OSError) as raised:
        with open(path, mode) as f:
            held = True
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
    assert raised.value.errno == errno.EIO
    return held


def _unchanged(shard: Path, before: os.stat_result) -> None:
    after = shard.stat()
    assert (after.st_size, after.st_mtime_ns, after.st_ino) == (before.st_size, before.st_mtime_ns, before.st_ino)


def _rewrite_refused(mount, tmp_path, declare, reason: str) -> None:
    """A 4x4-chunk shard that another client makes a sparse 1 TiB file with an
    index at its end whose rows ``declare`` changes: a write to chunk 1/1 and
    fsync is EIO with one log line giving ``reason``, the shard is left as it is,
    another shard stays writable and the daemon's peak memory grows by less than
    256 MiB."""
    from zarr.codecs import BytesCodec, ShardingCodec

    src = tmp_path / "store"
    zarr.create_array(str(src / "a"), shape=(16, 12), dtype="u1", chunks=(8, 12), fill_value=0,
                      serializer=ShardingCodec(chunk_shape=(2, 3), codecs=[BytesCodec()],
                                               index_codecs=[BytesCodec()]), compressors=None)[...] = 7
    m = mount(src, "rw", "metadata_ttl=0.2", "index_ttl=0.2", "attr_timeout=0.2")
    pid = int(os.getxattr(m.path, "user.zshardfs.pid"))

    def peak() -> int:
        status = Path(f"/proc/{pid}/status").read_text()
        return next(int(line.split()[1]) for line in status.splitlines() if line.startswith("VmHWM:")) << 10

    assert (m / "a/c/0/0").read_bytes() == b"\x07" * 6
    before = peak()
    shard = src / "a/c/0/0"
    index = np.frombuffer(shard.read_bytes()[-256:], "<u8").reshape(16, 2).copy()
    declare(index)
    os.truncate(shard, 1 << 40)
    with open(shard, "r+b") as f:
        f.seek((1 << 40) - 256)
        f.write(index.tobytes())
    damaged = shard.stat()
    time.sleep(0.6)  # (past the TTLs, 0.2 s)
    held = _write_fails_at_fsync(m / "a/c/1/1", b"\x09" * 6)
    _unchanged(shard, damaged)
    with open(shard, "rb") as f:
        f.seek((1 << 40) - 256)
        assert f.read() == index.tobytes()
    with open(m / "a/c/4/1", "r+b") as f:  # (in the other shard: still written)
        f.write(b"\x05" * 6)
        f.flush()
        os.fsync(f.fileno())
    assert peak() - before < 256 << 20, (peak(), before)
    shard.unlink()  # (gone: the chunk written is stored alone at unmount)
    m.umount()
    stored = zarr.open_array(str(src / "a"), mode="r")
    assert stored[8:10, 3:6].tolist() == [[5] * 3] * 2
    assert stored[2:4, 3:6].tolist() == [[9 if held else 0] * 3] * 2  # (refused at the open: nothing held)
    assert "Traceback" not in m.log_text(), m.log_text()[-3000:]
    # one line for the damaged shard, whichever path met it (the flush, the fsync)
    lines = [line for line in m.log_text().splitlines() if "a/c/0/0" in line]
    assert len(lines) == 1 and "damaged data: a/c/0/0" in lines[0] and reason in lines[0], lines


def test_a_sparse_huge_shard_declaring_every_chunk_at_one_range_is_not_rewritten(mount, tmp_path):
    """Another client makes a shard a sparse 1 TiB file whose index declares 15 of its
    16 chunks at the same 64 MiB range inside it: a write to the 16th fails at fsync and
    leaves the shard as it is (before: the range was read once but kept as one copy per
    chunk, 15 x 64 MiB, and a shard of 960 MiB written)."""
    def declare(index):
        index[[k for k in range(16) if k != 5]] = (1 << 30, 64 << 20)  # (5: chunk 1/1, written)

    _rewrite_refused(mount, tmp_path, declare, "overlap")


def test_a_sparse_huge_shard_declaring_chunks_of_1_gib_each_is_not_rewritten(mount, tmp_path):
    """Another client makes a shard a sparse 1 TiB file whose index declares 5 of its
    chunks 1 GiB long each, at distinct ranges inside it (no one larger than the 1 GiB a
    chunk may have): a write to another chunk fails at fsync and leaves the shard as it
    is (before: the rewrite read them, 5 GiB in one range)."""
    def declare(index):
        for k in range(5):
            index[10 + k] = ((1 << 30) * (k + 1), 1 << 30)

    _rewrite_refused(mount, tmp_path, declare, "a rewrite may keep")


def test_a_sparse_huge_precomputed_shard_declaring_every_chunk_at_one_range_is_not_rewritten(mount, tmp_path):
    """The same for a key-value precomputed shard (its rewrite keeps chunks the same
    way): another client makes it a sparse 1 TiB file whose minishard index declares
    its 15 chunks at the same 64 MiB range; writing a 16th chunk fails at fsync with one
    line, leaves the shard as it is and the daemon's peak memory grows by less than
    256 MiB (before: 15 copies of the range kept, a shard of 960 MiB written)."""
    from zshardfs.layouts.precomputed_format import ShardingSpec, encode_shard

    sharding = {"@type": "neuroglancer_uint64_sharded_v1", "preshift_bits": 0, "hash": "identity",
                "minishard_bits": 0, "shard_bits": 0, "minishard_index_encoding": "raw", "data_encoding": "raw"}
    src = tmp_path / "kv"
    src.mkdir()
    (src / "info").write_text(json.dumps({"@type": "neuroglancer_skeletons", "sharding": sharding}))
    shard = src / "0.shard"
    shard.write_bytes(encode_shard({k: b"x" * 10 for k in range(15)}, ShardingSpec.from_json(sharding)))
    m = mount(src, "rw", "metadata_ttl=0.2", "index_ttl=0.2", "attr_timeout=0.2")
    pid = int(os.getxattr(m.path, "user.zshardfs.pid"))

    def peak() -> int:
        status = Path(f"/proc/{pid}/status").read_text()
        return next(int(line.split()[1]) for line in status.splitlines() if line.startswith("VmHWM:")) << 10

    assert (m / "3").read_bytes() == b"x" * 10
    before = peak()
    rows = np.zeros((3, 15), "<u8")
    rows[0, 1:] = 1  # ids 0..14
    rows[1] = np.uint64(2**64 - (64 << 20))  # each at the start of the one before
    rows[1, 0] = 1 << 30
    rows[2] = 64 << 20
    at = (1 << 40) - 4096  # (the minishard index, near the end)
    os.truncate(shard, 1 << 40)
    with open(shard, "r+b") as f:
        f.write(np.array([at - 16, at - 16 + rows.nbytes], "<u8").tobytes())
        f.seek(at)
        f.write(rows.tobytes())
    damaged = shard.stat()
    time.sleep(0.6)  # (past the TTLs, 0.2 s)
    _write_fails_at_fsync(m / "15", b"y" * 10, "wb")
    _unchanged(shard, damaged)
    assert peak() - before < 256 << 20, (peak(), before)
    shard.unlink()  # (gone: the chunk written is stored alone at unmount)
    m.umount()
    assert "Traceback" not in m.log_text(), m.log_text()[-3000:]
    lines = [line for line in m.log_text().splitlines() if "0.shard" in line]
    assert len(lines) == 1 and "damaged data: 0.shard" in lines[0] and "overlap" in lines[0], lines


def test_a_zarr_json_whose_index_location_another_client_changes_applies_to_shards_already_read(mount, tmp_path):
    """Another client's ``zarr.json`` that moves the shard index (``end`` to
    ``start``) while the shards stay as they were applies to those shards once
    the TTLs have passed, as in a fresh mount: an index cached under the old
    metadata is parsed again (read at the start it fails its crc32c: EIO), and
    the old metadata put back reads them as before."""
    src = tmp_path / "store"
    values = np.arange(256, dtype=np.uint8)
    zarr.create_array(str(src / "a"), shape=values.shape, chunks=(32,), shards=(128,), dtype="uint8",
                      compressors=None, fill_value=0)[:] = values
    good = (src / "a" / "zarr.json").read_text()
    moved = json.loads(good)
    sharding = moved["codecs"][0]
    assert sharding["name"] == "sharding_indexed" and sharding["configuration"].get("index_location", "end") == "end"
    sharding["configuration"]["index_location"] = "start"
    m = mount(src, "ro", "metadata_ttl=0.2,index_ttl=0.2,attr_timeout=0.2")
    names = [f"c/{i}" for i in range(8)]
    assert b"".join((m.path / "a" / n).read_bytes() for n in names) == values.tobytes()
    (src / "a" / "zarr.json").write_text(json.dumps(moved))
    time.sleep(0.7)  # (past the TTLs, 0.2 s)
    for n in names:
        assert _read_or_eio(m.path / "a" / n) is None, n
    (src / "a" / "zarr.json").write_text(good)
    time.sleep(0.7)
    assert b"".join((m.path / "a" / n).read_bytes() for n in names) == values.tobytes()
    m.umount()
    assert "Traceback" not in m.log_text()


def _manifest_of_huge_fragments(count: int = 16) -> bytes:
    """A multi-resolution mesh manifest (one level of detail) whose ``count``
    fragments are 4 GiB - 1 bytes each: 64 GiB of fragment data for 16."""
    import struct

    return b"".join([np.zeros(6, "<f4").tobytes(), struct.pack("<I", 1), np.ones(1, "<f4").tobytes(),
                     np.zeros(3, "<f4").tobytes(), struct.pack("<I", count), np.zeros(3 * count, "<u4").tobytes(),
                     np.full(count, 2**32 - 1, "<u4").tobytes()])


def test_a_mesh_shard_made_huge_declaring_huge_parts_is_neither_read_nor_allocated(mount, tmp_path):
    """Another client makes the shards of a sharded multi-resolution mesh
    directory (gzip data) sparse 1 TiB files (``truncate -s 1T``) and writes new
    indexes into them that keep most meshes but declare, inside the file, a
    manifest whose fragments add up to 64 GiB (mesh 4), a manifest 64 GiB long
    ending in zeros, so its gzip trailer says 0 (mesh 8), and a minishard index
    64 GiB long (shard 1, minishard 1: mesh 3).  Listing, ``stat``, reading
    each file, a write to another mesh of the shard (a rewrite reads every kept
    manifest) and ``zshardfs fsck --data`` neither read nor allocate those
    sizes (before: a 64 GiB read at once, a MemoryError and a traceback, in
    ``_fragments``, ``_fragment_entries``, the minishard index load and the
    decode of a gzip chunk said empty): the damaged files are EIO (or not
    listed), one log line per shard, the rest read as stored, the write fails
    at fsync and leaves the shard as it is."""
    from tests import peers_precomputed as peers
    from tests.conftest import ZSHARDFS
    from zshardfs.layouts.precomputed_format import ShardingSpec, _encode_minishard_index

    sharding = peers.sharding("identity", 0, 1, 1, "raw", "gzip")
    spec = ShardingSpec.from_json(sharding)
    meshes = {cid: peers.make_mesh(cid, [2, 1]) for cid in (0, 1, 2, 3, 4, 5, 6, 8)}
    src = peers.write_mesh_twins(tmp_path / "t", sharding, meshes).sharded
    m = mount(src, "rw", "metadata_ttl=0.2", "index_ttl=0.2", "attr_timeout=0.2")
    pid = int(os.getxattr(m.path, "user.zshardfs.pid"))
    good = {name: (m / name).read_bytes() for name in os.listdir(m.path)}
    assert {n for n in good if n != "info"} == {f"{c}{e}" for c in meshes for e in ("", ".index")}
    stored = {k: (src / spec.shard_key(k)).read_bytes() for k in (0, 1)}

    size, hdr, gz = 1 << 40, spec.shard_index_size, lambda b: gzip.compress(b, mtime=0)
    huge = _manifest_of_huge_fragments()
    for shard in (0, 1):
        at = size - (1 << 20)
        tail, entries = bytearray(), {0: [], 1: []}

        def put(data: bytes) -> int:
            tail.extend(data)
            return at + len(tail) - len(data)

        for cid in sorted(c for c in meshes if spec.shard_and_minishard(c)[0] == shard and c not in (4, 8)):
            put(meshes[cid][1])
            manifest = gz(meshes[cid][0])
            entries[cid & 1].append((cid, put(manifest), len(manifest)))
        if shard == 0:
            manifest = gz(huge)
            entries[0].append((4, put(manifest), len(manifest)))
            entries[0].append((8, hdr, 64 << 30))  # zeros: its trailer says 0
        table = np.zeros((2, 2), "<u8")
        for k, items in entries.items():
            items.sort()
            index = _encode_minishard_index(*(np.array(v, np.uint64) for v in
                                              ([c for c, _, _ in items], [s - hdr for _, s, _ in items],
                                               [n for _, _, n in items])))
            start = put(index) - hdr
            table[k] = (start, start + len(index))
        if shard == 1:
            table[1] = (0, 64 << 30)
        path = src / spec.shard_key(shard)
        os.truncate(path, size)
        with open(path, "r+b") as f:
            f.write(table.tobytes())
            f.seek(at)
            f.write(tail)
    time.sleep(0.6)  # (past the TTLs, 0.2 s)

    damaged = {"4", "8", "8.index", "3", "3.index"}
    listed = set(os.listdir(m.path))
    assert listed <= set(good) and set(good) - listed <= damaged, listed
    assert (m / "4").stat().st_size == 16 * (2**32 - 1)
    for name in sorted(damaged):
        with pytest.raises(OSError) as raised:
            fd = os.open(m / name, os.O_RDONLY)  # (not read_bytes: a 64 GiB file would be allocated here)
            try:
                os.read(fd, 4096)
            finally:
                os.close(fd)
        assert raised.value.errno == errno.EIO, name
    assert (m / "4.index").read_bytes() == huge
    for name, data in good.items():
        if name not in damaged and name != "4.index":
            assert (m / name).read_bytes() == data, name
    _write_fails_at_fsync(m / "1", good["1"][:1])
    fsck = subprocess.run([*ZSHARDFS, "fsck", str(src), "--data", "--json"], capture_output=True, text=True,
                          timeout=120)
    assert fsck.returncode == 1 and "Traceback" not in fsck.stderr, (fsck.returncode, fsck.stderr[-3000:])
    problems = json.loads(fsck.stdout)["problems"]
    for needle in ("4: cannot be read: 0.shard: mesh 4: fragment data", "0.shard: chunk 8", "1.shard: minishard 1"):
        assert sum(needle in p for p in problems) == 1, (needle, problems)
    assert all((src / spec.shard_key(k)).stat().st_size == size for k in (0, 1))
    status = Path(f"/proc/{pid}/status").read_text()
    peak = next(int(line.split()[1]) for line in status.splitlines() if line.startswith("VmHWM:")) << 10
    assert peak < 512 << 20, status
    for k, data in stored.items():  # repaired: the write is stored at unmount
        (src / spec.shard_key(k)).write_bytes(data)
    time.sleep(0.5)
    m.umount()
    assert peers.read_mesh_shards(src, sharding) == meshes
    log = m.log_text()
    assert "Traceback" not in log, log[-3000:]
    for k in (0, 1):
        lines = [line for line in log.splitlines() if f"damaged data: {spec.shard_key(k)}" in line]
        assert len(lines) == 1, (k, lines)


def test_a_sparse_huge_shard_declaring_overlapping_minishard_indexes_is_listed_in_bounded_memory(mount, tmp_path):
    """Another client makes a key-value shard of 16 minishards a sparse 1 TiB file and
    rewrites its shard index so every minishard's index is the same 40 MiB of zeros,
    inside the file (ranges may overlap).  A listing leaves the shard out with one line
    and a read of one of its chunks is EIO, the daemon's peak memory growing by less
    than 256 MiB (before: +1.3 GiB, the errors kept for the listing held the frames,
    and so the bytes, of every read; without them, +470 MiB, the 16 reads at once;
    64 of 60 MiB took a listing to 18 GiB)."""
    from zshardfs.layouts.precomputed_format import ShardingSpec, encode_shard

    sharding = {"@type": "neuroglancer_uint64_sharded_v1", "preshift_bits": 0, "hash": "identity",
                "minishard_bits": 4, "shard_bits": 0, "minishard_index_encoding": "raw", "data_encoding": "raw"}
    src = tmp_path / "kv"
    src.mkdir()
    (src / "info").write_text(json.dumps({"@type": "neuroglancer_skeletons", "sharding": sharding}))
    (src / "0.shard").write_bytes(encode_shard({k: b"x" * 10 for k in range(16)}, ShardingSpec.from_json(sharding)))
    m = mount(src, "ro", "metadata_ttl=0.2", "index_ttl=0.2", "attr_timeout=0.2")
    pid = int(os.getxattr(m.path, "user.zshardfs.pid"))
    assert len(os.listdir(m.path)) == 17

    def peak() -> int:
        status = Path(f"/proc/{pid}/status").read_text()
        return next(int(line.split()[1]) for line in status.splitlines() if line.startswith("VmHWM:")) << 10

    before = peak()
    os.truncate(src / "0.shard", 1 << 40)
    table = np.zeros((16, 2), "<u8")
    table[:, 1] = 40 << 20
    with open(src / "0.shard", "r+b") as f:
        f.write(table.tobytes())
    time.sleep(0.6)  # (past the TTLs, 0.2 s)
    assert os.listdir(m.path) == ["info"]
    with pytest.raises(OSError) as raised:
        (m / "3").read_bytes()
    assert raised.value.errno in (errno.EIO, errno.ENOENT)  # (the kernel may remember the listing: no such file)
    assert peak() - before < 256 << 20, (peak(), before)
    m.umount()
    lines = [line for line in m.log_text().splitlines() if "damaged data: 0.shard" in line]
    assert len(lines) == 1, lines


def test_an_unreadable_info_above_a_deep_tree_is_said_where_it_is_probed(tmp_path):
    """An ``info`` the daemon cannot read, above a tree of plain directories:
    probes look for a precomputed scale ``key`` in the ``info`` of every
    directory above, but one that cannot be read is said only by the probes
    of its own directory and of its children (as before keys of several
    names were read), not once more by every directory below, and the tree
    stays walkable."""
    src, mnt, log = tmp_path / "store", tmp_path / "mnt", tmp_path / "log"
    (src / "plain/a/b/c/d").mkdir(parents=True)
    (src / "plain/a/b/c/d/f.txt").write_text("f")
    (src / "plain/info").write_text("notes")
    os.chmod(src / "plain/info", 0)
    with mounted_without_file_mode_override(src, mnt, log):
        out = subprocess.run(["find", str(mnt)], capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        assert str(mnt / "plain/a/b/c/d/f.txt") in out.stdout.split()
        assert (mnt / "plain/a/b/c/d/f.txt").read_text() == "f"
    said = [line for line in log.read_text().splitlines() if "plain/info" in line]
    assert len(said) <= 2 and not any(d in line for line in said for d in ("plain/a/b", "plain/a/b/c")), said
