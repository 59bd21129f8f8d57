"""Writes while storage fails: full disks, broken stores, stops.

Real mounts of local stores (a small tmpfs for ENOSPC); stored data is read
back with zarr-python, never with zshardfs' own code.  Every wait is
bounded, and a writer that hangs is released (storage repaired) before the
test fails, so a regression fails the test instead of hanging the suite.
"""

from __future__ import annotations

import errno
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import crc32c
import numpy as np
import pytest
import zarr

from tests.conftest import ZSHARDFS
from tests.util import process_running, wait_for

pytestmark = pytest.mark.timeout(300)

TMP = ".zshardfs-tmp-"


# ---------------------------------------------------------------------------
# helpers


@pytest.fixture
def small_fs(tmp_path):
    """A 2 MiB tmpfs, a file system that fills up (request it before
    ``mount``, so that the mount is gone before it is)."""
    path = tmp_path / "small"
    path.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(path)], check=True)
    yield path
    subprocess.run(["umount", "-l", str(path)], check=False)


@pytest.fixture
def other_fs(tmp_path):
    """A tmpfs: another file system than the source's (request it before
    ``mount``, so that the mount is gone before it is)."""
    path = tmp_path / "otherfs"
    path.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "tmpfs", str(path)], check=True)
    yield path
    subprocess.run(["umount", "-l", str(path)], capture_output=True)


def free_bytes(path) -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def fill(path: Path, leave: int) -> Path:
    """Fill the file system holding ``path`` until ``leave`` bytes are free."""
    filler = path / "filler"
    filler.write_bytes(b"f" * max(0, free_bytes(path) - leave))
    return filler


def temporaries(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob(TMP + "*"))


def zs(*args, check: bool = True) -> subprocess.CompletedProcess:
    result = subprocess.run([*ZSHARDFS, *map(str, args)], capture_output=True, text=True, timeout=120)
    if check and result.returncode:
        raise AssertionError(f"zshardfs {' '.join(map(str, args))} failed: {result.stderr}")
    return result


def must(cond, timeout: float, what: str):
    value = wait_for(cond, timeout)
    if not value:
        raise AssertionError(f"timed out ({timeout:g}s) waiting for {what}")
    return value


def daemon_pid(m) -> int:
    return int(os.getxattr(m.path, "user.zshardfs.pid"))


def dirty_bytes(m) -> int:
    return json.loads(os.getxattr(m.path, "user.zshardfs.stats"))["writeback"]["dirty_bytes"]


def chunk_bytes(value: int) -> bytes:
    """A 16x16 <i4 chunk (1 KiB), every byte ``value``."""
    return bytes([value % 256]) * 1024


def grid_array(root: Path):
    """256x256 <i4 in 16x16 chunks, 4x4 chunks (16 KiB) per shard, nothing stored."""
    return zarr.create_array(str(root / "arr"), shape=(256, 256), chunks=(16, 16), shards=(64, 64),
                             dtype="<i4", fill_value=0, compressors=None)


def stored_chunk(root: Path, i: int, j: int, size: int = 16) -> bytes:
    a = zarr.open_array(str(root / "arr"), mode="r")
    return a[i * size:(i + 1) * size, j * size:(j + 1) * size].astype("<i4").tobytes()


# ---------------------------------------------------------------------------
# A. temporary shard files


def test_enospc_leaves_no_temporary_file_and_keeps_the_data(small_fs, mount):
    a = zarr.create_array(str(small_fs / "arr"), shape=(256, 256), chunks=(64, 64), shards=(128, 128),
                          dtype="<i4", fill_value=0, compressors=None)  # 4 shards of 4 x 16 KiB
    data = np.arange(256 * 256, dtype="<i4").reshape(256, 256)
    a[...] = data
    old_shard = (small_fs / "arr/c/0/0").read_bytes()
    filler = fill(small_fs, 20 << 10)  # less than a shard
    free = free_bytes(small_fs)
    m = mount(small_fs, "flush_delay=60")
    new = b"\x07" * (16 << 10)
    fd = os.open(m / "arr/c/0/0", os.O_WRONLY | os.O_TRUNC)
    try:
        os.write(fd, new)
        with pytest.raises(OSError) as info:
            os.fsync(fd)
        assert info.value.errno == errno.ENOSPC
    finally:
        os.close(fd)
    # the failed put took its partial shard with it: the space is free again
    assert temporaries(small_fs) == []
    assert free_bytes(small_fs) >= free - 4096
    assert (small_fs / "arr/c/0/0").read_bytes() == old_shard
    assert (m / "arr/c/0/0").read_bytes() == new  # kept in memory
    filler.unlink()
    zs("sync", m.path)
    m.umount()
    assert temporaries(small_fs) == []
    data[0:64, 0:64] = 0x07070707
    np.testing.assert_array_equal(zarr.open_array(str(small_fs / "arr"), mode="r")[...], data)


def test_replaced_shards_are_not_held_open(tmp_path, mount):
    """The daemon keeps descriptors of shards it read (page-cache reads
    without a thread hop), but never of a version that was replaced or
    removed: an open descriptor would hold a deleted file's disk space."""
    a = zarr.create_array(str(tmp_path / "arr"), shape=(64, 64), chunks=(8, 8), shards=(32, 32),
                          dtype="<i4", fill_value=0, compressors=None)
    a[...] = np.arange(64 * 64, dtype="<i4").reshape(64, 64)
    m = mount(tmp_path, "flush_delay=60")
    pid = json.loads(subprocess.run([*ZSHARDFS, "stats", "--json", str(m.path)], capture_output=True,
                                    text=True, check=True).stdout)["pid"]
    for i in range(20):
        for shard in ("0/0", "1/1"):
            chunk = m / "arr" / "c" / shard.replace("1", "4")
            fd = os.open(chunk, os.O_WRONLY)
            try:
                os.write(fd, np.full((8, 8), i, "<i4").tobytes())
                os.fsync(fd)  # a new version of the shard replaces the old one
            finally:
                os.close(fd)
            other = m / "arr" / "c" / shard.replace("1", "5").replace("0", "1")
            assert len(other.read_bytes()) == 256  # (read from the shard: its descriptor is kept)
    held = [os.readlink(f"/proc/{pid}/fd/{fd}") for fd in os.listdir(f"/proc/{pid}/fd")]
    assert [p for p in held if p.endswith("(deleted)")] == []
    assert len([p for p in held if "/arr/c/" in p]) <= 2


def test_temporary_files_of_dead_writers_are_removed_where_shards_are_written(tmp_path, mount):
    """kill -9 between a temporary shard's write and its rename leaves it
    behind; chunk directories are listed from shard indexes, so only the
    next put into its directory can meet it."""
    store = tmp_path / "store"
    a = zarr.create_array(str(store / "arr"), shape=(8, 8), chunks=(2, 2), shards=(4, 4), dtype="<i4",
                          fill_value=0, compressors=None)
    a[...] = np.arange(64, dtype="<i4").reshape(8, 8)
    gone = subprocess.Popen(["true"])
    gone.wait()
    assert not process_running(gone.pid)
    m = mount(store, "flush_delay=60")
    shard_dir = store / "arr/c/0"
    hour_ago = time.time() - 3600

    def leftover(name: str, old: bool = True) -> Path:
        p = shard_dir / name
        p.write_bytes(b"partial shard")
        if old:
            os.utime(p, (hour_ago, hour_ago))
        return p

    dead = leftover(f"{TMP}{gone.pid}-1-0")
    young = leftover(f"{TMP}{gone.pid}-2-1", old=False)  # another pid namespace's put may be writing it
    live = leftover(f"{TMP}{os.getpid()}-3-0")  # a running process's
    # the daemon's own pid, not a file it is writing: a restarted container's
    # daemon often has the pid of the one that died
    same_pid = leftover(f"{TMP}{daemon_pid(m)}-4-1")
    assert sorted(os.listdir(m / "arr/c/0")) == ["0", "1", "2", "3"]  # never shown

    (m / "arr/c/0/0").write_bytes(b"\x01" * 16)
    zs("sync", m.path)
    assert not dead.exists() and not same_pid.exists()
    assert young.exists() and live.exists()
    # the directory is swept again on a later put while a dead writer's file is too young
    os.utime(young, (hour_ago, hour_ago))
    (m / "arr/c/0/1").write_bytes(b"\x02" * 16)
    zs("sync", m.path)
    assert not young.exists() and live.exists()
    m.umount()
    assert "left by a writer that died" in m.log_text()
    stored = zarr.open_array(str(store / "arr"), mode="r")
    assert stored[0:2, 0:2].tobytes() == b"\x01" * 16 and stored[0:2, 2:4].tobytes() == b"\x02" * 16


def test_read_only_mounts_and_fsck_leave_dead_writers_files_and_tell_of_them(tmp_path, mount):
    """A read-only mount and ``zshardfs fsck`` write nothing to the store, not
    even the removal of a dead writer's temporary file: they log one warning
    naming it (fsck: one problem, not an error).  A writable mount's listing
    removes it."""
    store = tmp_path / "store"
    zarr.create_array(str(store / "arr"), shape=(4, 4), chunks=(2, 2), shards=(4, 4), dtype="u1",
                      fill_value=0)[...] = 1
    gone = subprocess.Popen(["true"])
    gone.wait()
    left = store / "arr" / f"{TMP}{gone.pid}-1-0"
    left.write_bytes(b"partial shard")
    hour_ago = time.time() - 3600
    os.utime(left, (hour_ago, hour_ago))

    m = mount(store, "ro")
    assert sorted(os.listdir(m / "arr")) == ["c", "zarr.json"]
    m.umount()
    assert left.exists()
    assert sum(left.name in line and "WARNING" in line for line in m.log_text().splitlines()) == 1, m.log_text()

    result = subprocess.run([*ZSHARDFS, "fsck", str(store), "--json"], capture_output=True, text=True, timeout=60)
    report = json.loads(result.stdout)
    assert result.returncode == 1 and report["errors"] == 0, (result, report)
    assert len(report["problems"]) == 1 and left.name in report["problems"][0], report
    assert left.exists()

    m = mount(store)
    assert sorted(os.listdir(m / "arr")) == ["c", "zarr.json"]
    assert not left.exists()
    m.umount()


# ---------------------------------------------------------------------------
# B. back-pressure while every flush fails


WRITER = r"""
import errno, os, sys
root, seed = sys.argv[1], int(sys.argv[2])
n = 0
for i in range(16):
    for j in range(16):
        fd = os.open(f"{root}/arr/c/{i}/{j}", os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        try:
            os.write(fd, bytes([(16 * i + j + seed) % 256]) * 1024)
        except OSError as exc:
            print(errno.errorcode[exc.errno], n, flush=True)
            sys.exit(0)
        finally:
            os.close(fd)
        n += 1
print("ok", n, flush=True)
"""


def _break(kind: str, root: Path):
    """Make every flush into ``root/arr`` fail; returns the repair."""
    if kind == "enospc":
        filler = fill(root, 0)
        return filler.unlink
    blocker = root / "arr" / "c"
    blocker.write_bytes(b"a file where the shard directories must go")  # every put: EIO
    return blocker.unlink


@pytest.mark.parametrize("kind", ["enospc", "broken"])
def test_writers_get_the_flush_error_instead_of_waiting_forever(kind, small_fs, mount):
    grid_array(small_fs)
    repair = _break(kind, small_fs)
    m = mount(small_fs, "max_dirty=64k,flush_delay=0.5")
    writer = subprocess.Popen([sys.executable, "-c", WRITER, str(m.path), "0"], stdout=subprocess.PIPE, text=True)
    try:
        out, _ = writer.communicate(timeout=90)
    except subprocess.TimeoutExpired:
        repair()  # lets the flushes make room, so the writer can end
        writer.communicate(timeout=60)
        pytest.fail("a writer over max_dirty waited forever while every flush failed")
    name, written = out.split()
    assert name == ("ENOSPC" if kind == "enospc" else "EIO")
    assert int(written) >= 64  # max_dirty of 1 KiB chunks were taken before any wait

    # storage recovers: writes go on, and everything is stored
    repair()
    writer = subprocess.Popen([sys.executable, "-c", WRITER, str(m.path), "1"], stdout=subprocess.PIPE, text=True)
    out, _ = writer.communicate(timeout=120)
    assert out.split() == ["ok", "256"]
    zs("sync", m.path)
    assert dirty_bytes(m) == 0
    m.umount()
    assert temporaries(small_fs) == []
    for i in range(16):
        for j in range(16):
            assert stored_chunk(small_fs, i, j) == chunk_bytes(16 * i + j + 1), (i, j)


def test_files_storage_refuses_are_held_up_to_max_dirty(small_fs, mount):
    """Plain files whose close fails (ENOSPC here) wait in memory for a later
    sync, counted against ``max_dirty``: past it, no other file is made or
    opened for writing (the refusal's own error, at once, one log line),
    and once storage has room a sync stores them all and writes go on.
    Before, they were counted nowhere: a writer going on while storage
    refused grew the daemon without bound (300 MiB for 300 files of 1 MiB)."""
    filler = fill(small_fs, 64 << 10)
    m = mount(small_fs, "max_dirty=1M")
    blob = b"p" * (256 << 10)
    written = refused_at_create = 0
    for i in range(12):
        try:
            fd = os.open(m / f"f{i}", os.O_WRONLY | os.O_CREAT)
        except OSError as exc:
            assert exc.errno == errno.ENOSPC
            refused_at_create += 1
            continue
        try:
            os.write(fd, blob)
        finally:
            with pytest.raises(OSError) as closing:
                os.close(fd)
            assert closing.value.errno == errno.ENOSPC
        written += 1
    assert 4 <= written <= 6 and refused_at_create == 12 - written, (written, refused_at_create)
    with pytest.raises(OSError) as opening:
        open(m / "plain-existing", "wb")
    assert opening.value.errno == errno.ENOSPC
    assert all((m / f"f{i}").stat().st_size == len(blob) for i in range(written))  # held, readable
    filler.unlink()
    zs("sync", m.path)
    assert all((small_fs / f"f{i}").read_bytes() == blob for i in range(written))
    (m / "after").write_bytes(b"room again")
    m.umount()
    assert m.log_text().count("files storage refused wait in memory, over max_dirty") == 1
    assert (small_fs / "after").read_bytes() == b"room again"


def test_writers_waiting_on_a_hung_store_get_eio_within_the_timeout(moto_server, s3_bucket, tmp_path, mount):
    """A hung endpoint fails one flush per ``timeout`` (the flusher writes one
    shard at a time): waiting until the failing shards alone hold more than
    max_dirty would take 33 failed flushes, over a minute."""
    _, bucket = s3_bucket
    seed = tmp_path / "seed"
    zarr.create_array(str(seed / "arr"), shape=(128, 96), chunks=(16, 16), shards=(16, 16), dtype="<i4",
                      fill_value=0, compressors=None)  # 48 shards of one 1 KiB chunk
    moto_server.s3.put_object(Bucket=bucket, Key="store/arr/zarr.json", Body=(seed / "arr/zarr.json").read_bytes())
    m = mount(f"s3://{bucket}/store", "max_dirty=32k,flush_delay=60,timeout=2",
              extra=["--endpoint-url", moto_server.endpoint_url])
    fds = [os.open(m / f"arr/c/{i}/{j}", os.O_WRONLY | os.O_CREAT | os.O_TRUNC) for i in range(8) for j in range(6)]
    outcomes: dict[int, str] = {}

    def write(k: int) -> None:
        try:
            os.write(fds[k], chunk_bytes(k))
            outcomes[k] = "ok"
        except OSError as exc:
            outcomes[k] = errno.errorcode[exc.errno]

    threads = [threading.Thread(target=write, args=(k,), daemon=True) for k in range(len(fds))]
    moto_server.pause()
    try:
        t0 = time.monotonic()
        for t in threads:
            t.start()
        for t in threads:
            t.join(max(0.1, t0 + 30 - time.monotonic()))
        took = time.monotonic() - t0
    finally:
        moto_server.resume()
    for t in threads:
        t.join(60)
    for fd in fds:
        os.close(fd)
    assert took < 30, f"writers waited {took:.0f}s for room on a hung store"
    assert set(outcomes.values()) <= {"ok", "EIO"} and "EIO" in outcomes.values(), outcomes
    must(lambda: zs("sync", m.path, check=False).returncode == 0, 30, "a sync once the endpoint is back")
    assert dirty_bytes(m) == 0
    m.umount()


KEEPS_WRITING = r"""
import os, sys
root, progress = sys.argv[1], sys.argv[2]
k = 0
while True:
    i, j = divmod(k % 256, 16)
    k += 1
    try:
        fd = os.open(f"{root}/arr/c/{i}/{j}", os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        try:
            os.write(fd, b"k" * 1024)
        finally:
            os.close(fd)
    except OSError:
        pass
    with open(progress, "a") as f:
        f.write(".")
"""


def test_a_writer_waiting_for_room_can_be_killed(tmp_path, mount):
    """The kernel ends a killed process only once the daemon answers its
    request: a wait for room with no end made writers unkillable."""
    store = tmp_path / "store"
    grid_array(store)
    repair = _break("broken", store)
    m = mount(store, "max_dirty=16k,flush_delay=0.5")
    progress = tmp_path / "progress"
    writer = subprocess.Popen([sys.executable, "-c", KEEPS_WRITING, str(m.path), str(progress)])
    try:
        must(lambda: progress.exists() and len(progress.read_text()) >= 12, 30, "the writer's first writes")
        time.sleep(3)  # past max_dirty: every write now waits for room
        writer.kill()
        try:
            writer.wait(30)
        except subprocess.TimeoutExpired:
            repair()
            writer.wait(60)
            pytest.fail("SIGKILL did not end a writer waiting for room")
    finally:
        if writer.poll() is None:
            writer.kill()
    repair()
    zs("sync", m.path)
    m.umount()


# ---------------------------------------------------------------------------
# C. stopping while storage fails


def _seeded(tmp_path) -> tuple[Path, np.ndarray]:
    store = tmp_path / "store"
    data = np.arange(64, dtype="<i4").reshape(8, 8)
    a = zarr.create_array(str(store / "arr"), shape=(8, 8), chunks=(2, 2), shards=(4, 4), dtype="<i4",
                          fill_value=0, compressors=None)
    a[...] = data
    return store, data


def _break_shards(store: Path):
    """Every flush of arr fails (its shard directory is a file); returns the repair."""
    (store / "arr/c").rename(store / "arr/c.kept")
    (store / "arr/c").write_bytes(b"blocker")

    def repair():
        (store / "arr/c").unlink()
        (store / "arr/c.kept").rename(store / "arr/c")

    return repair


@pytest.mark.parametrize("how", ["sigterm", "sigint", "unmounted"])
def test_stop_while_storage_fails_keeps_retrying_until_stored(tmp_path, mount, how):
    store, data = _seeded(tmp_path)
    m = mount(store, "flush_delay=60")
    precious = np.array([[1001, 1002], [1003, 1004]], "<i4")
    (m / "arr/c/0/0").write_bytes(precious.tobytes())
    pid = daemon_pid(m)
    repair = _break_shards(store)
    try:
        assert zs("umount", m.path, check=False).returncode != 0  # refuses: the data is only in memory
        if how in ("sigterm", "sigint"):
            os.kill(pid, signal.SIGTERM if how == "sigterm" else signal.SIGINT)
        else:
            subprocess.run(["fusermount3", "-uz", str(m.path)], check=True)
            m.mounted = False
        must(lambda: "not stored yet: 1 chunks in 1 shards" in m.log_text(), 30, "a failed round in the log")
        time.sleep(3)
        assert process_running(pid), "the daemon exited with data it could not store"
        assert os.path.ismount(m.path) == (how != "unmounted")  # a stop unmounts once stored
    finally:
        repair()
    must(lambda: not process_running(pid), 90, "the daemon to store and exit")
    m.mounted = False
    assert not os.path.ismount(m.path)
    assert "lost" not in m.log_text()
    data[0:2, 0:2] = precious
    np.testing.assert_array_equal(zarr.open_array(str(store / "arr"), mode="r")[...], data)


def test_a_second_sigterm_exits_without_the_unstored_data_and_says_so(tmp_path, mount):
    store, data = _seeded(tmp_path)
    m = mount(store, "flush_delay=60")
    (m / "arr/c/0/0").write_bytes(b"\x09" * 16)
    pid = daemon_pid(m)
    repair = _break_shards(store)
    try:
        os.kill(pid, signal.SIGTERM)
        must(lambda: m.log_text().count("not stored yet: 1 chunks in 1 shards") >= 2, 30, "two failed rounds in the log")
        assert process_running(pid)
        # one line per failed round, the first as well: not the flush's own
        # line too (its shard had not failed before, so that line was new)
        stop = m.log_text().split("signal SIGTERM: storing what is in memory, then unmounting", 1)[1]
        lines = [line for line in stop.splitlines() if " ERROR " in line or " WARNING " in line]
        assert len(lines) >= 2 and all("not stored yet: 1 chunks in 1 shards" in line for line in lines), lines
        os.kill(pid, signal.SIGTERM)
        must(lambda: not process_running(pid), 30, "the daemon to exit on the second SIGTERM")
        m.mounted = False
        assert not os.path.ismount(m.path)  # unmounted, not left as a dead mount
    finally:
        repair()
    log = m.log_text()
    assert "exiting without storing 1 chunks in 1 shards: lost (shards arr/c/0/0)" in log
    np.testing.assert_array_equal(zarr.open_array(str(store / "arr"), mode="r")[...], data)  # as it was


def _problems_since(m, mark: int) -> list[str]:
    return [line for line in m.log_text()[mark:].splitlines() if " ERROR " in line or " WARNING " in line]


def test_a_refused_sync_or_umount_logs_one_line_that_says_what_failed(tmp_path, mount):
    """``zshardfs sync`` and ``zshardfs umount`` refused because storage
    fails (here a file where the shard directory should be) each log ONE
    line, which names the failure: it was two, the flush's own line and
    ``fuse_ops: getxattr: arr/c/0/0: not found``, and "not found" besides,
    although it is a write that failed (EIO)."""
    store, data = _seeded(tmp_path)
    m = mount(store, "flush_delay=60")
    (m / "arr/c/0/0").write_bytes(b"\x09" * 16)
    repair = _break_shards(store)
    try:
        for what, chunk, counted in (("sync", None, "1 chunks in 1 shards"),
                                     ("umount", "arr/c/2/2", "2 chunks in 2 shards")):
            if chunk is not None:  # (another shard too: not a repeat of the line before)
                (m / chunk).write_bytes(b"\x08" * 16)
            mark = len(m.log_text())
            result = zs(what, m.path, check=False)
            assert result.returncode != 0 and "Input/output error" in result.stderr, result.stderr
            lines = _problems_since(m, mark)
            assert len(lines) == 1, (what, lines)
            assert f"sync failed: {counted} only in memory" in lines[0], lines
            assert f"{store / 'arr/c'} is not a directory" in lines[0] and "not found" not in lines[0], lines
        assert os.path.ismount(m.path)
    finally:
        repair()
    m.umount()
    data[0:2, 0:2] = 0x09090909
    data[4:6, 4:6] = 0x08080808
    np.testing.assert_array_equal(zarr.open_array(str(store / "arr"), mode="r")[...], data)


def _point_past_the_end(shard: Path, n: int, entry: int) -> bytes:
    """Point index entry ``entry`` of ``shard`` (``n`` chunks, index at the
    end with its crc32c) past the end of the file, the checksum recomputed;
    returns the bytes it had."""
    raw = shard.read_bytes()
    isize = n * 16 + 4
    table = np.frombuffer(raw[-isize:-4], "<u8").reshape(n, 2).copy()
    table[entry] = (len(raw) + 100, 8)
    index = table.astype("<u8").tobytes()
    shard.write_bytes(raw[:-isize] + index + crc32c.crc32c(index).to_bytes(4, "little"))
    return raw


@pytest.mark.parametrize("command", ["umount", "sync"])
def test_a_umount_or_sync_refused_for_a_shard_damaged_under_a_write_names_it_and_the_way_out(
        command, tmp_path, mount):
    """A shard another client damages (an index entry past its end) after a
    write into it was accepted: the flush is refused (EIO at fsync, kept,
    retried) and so are ``zshardfs umount`` and ``zshardfs sync``, which said
    only 'Input/output error'.  Their message now names the shard and both
    ways out (one function): repair or remove it (the retry stores; then the
    same command again), or ``umount -z`` and two SIGTERMs (lost)."""
    store, data = _seeded(tmp_path)
    m = mount(store, "flush_delay=60")
    (m / "arr/c/0/0").write_bytes(b"\x09" * 16)
    good = _point_past_the_end(store / "arr/c/0/0", 4, 1)
    try:
        refused = zs(command, m.path, check=False)
        assert refused.returncode != 0 and os.path.ismount(m.path), refused.stderr
        said = " ".join(refused.stderr.split())
        if command == "sync":
            assert f"sync of {m.path} failed: Input/output error" in said, said
        assert "damaged shard(s) arr/c/0/0" in said, said
        assert f"repairing or removing the shard in storage lets the next retry store them (then 'zshardfs " \
               f"{command} {m.path}' again)" in said, said
        assert f"'zshardfs umount -z {m.path}' then stopping the daemon (SIGTERM twice) discards" in said, said
    finally:
        (store / "arr/c/0/0").write_bytes(good)  # repaired: the retry stores
    must(lambda: zs(command, m.path, check=False).returncode == 0, 30, f"the {command} after the repair")
    if command == "sync":
        m.umount()
    m.mounted = False
    data[0:2, 0:2] = 0x09090909
    np.testing.assert_array_equal(zarr.open_array(str(store / "arr"), mode="r")[...], data)


def test_a_foreground_daemon_that_gave_up_exits_with_status_3(tmp_path):
    """Under systemd (``--foreground``) the exit status tells that written
    data was given up at a stop (3), so the unit is marked failed; a stop
    that stored everything exits 0."""
    store, data = _seeded(tmp_path)
    mnt = tmp_path / "fg"
    mnt.mkdir()
    for give_up in (False, True):
        proc = subprocess.Popen([*ZSHARDFS, "mount", str(store), str(mnt), "--foreground", "-o",
                                 f"flush_delay=60,log_file={tmp_path / 'fg.log'}"])
        try:
            must(lambda: os.path.ismount(mnt), 30, "the mount")
            (mnt / "arr/c/0/0").write_bytes(b"\x09" * 16)
            repair = _break_shards(store) if give_up else (lambda: None)
            try:
                proc.send_signal(signal.SIGTERM)
                if give_up:
                    must(lambda: "not stored yet" in (tmp_path / "fg.log").read_text(), 30, "a failed round")
                    proc.send_signal(signal.SIGTERM)
                assert proc.wait(timeout=60) == (3 if give_up else 0)
            finally:
                repair()
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            subprocess.run(["fusermount3", "-uz", str(mnt)], capture_output=True)


def test_a_rename_refused_for_want_of_room_changes_nothing(small_fs, mount):
    """A rename onto an existing chunk while flushes fail and dirty memory is
    over ``max_dirty``: the rename fails with the flush's error and the
    target keeps its content (it used to be emptied first)."""
    a = grid_array(small_fs)
    a[0:16, 0:16] = 1  # chunk c/0/0
    a[0:16, 16:32] = 2  # chunk c/0/1
    fill(small_fs, 0)
    m = mount(small_fs, "max_dirty=1k,flush_delay=0.2")
    (m / "arr/c/1/0").write_bytes(chunk_bytes(7) * 4)  # over the cap; its flush fails (ENOSPC)
    must(lambda: "No space left" in m.log_text(), 30, "a failed flush")
    with pytest.raises(OSError) as exc:
        os.rename(m / "arr/c/0/0", m / "arr/c/0/1")
    assert exc.value.errno == errno.ENOSPC
    one, two = np.full((16, 16), 1, "<i4").tobytes(), np.full((16, 16), 2, "<i4").tobytes()
    assert (m / "arr/c/0/0").read_bytes() == one and (m / "arr/c/0/1").read_bytes() == two
    (small_fs / "filler").unlink()
    zs("sync", m.path)
    m.umount()
    assert stored_chunk(small_fs, 0, 0) == one and stored_chunk(small_fs, 0, 1) == two


def test_a_rename_storage_refuses_changes_nothing(small_fs, mount):
    """A plain file renamed over another, or to a new name, while the disk
    is full: the rename fails (ENOSPC) and changes nothing, in the view and
    in storage once there is room again (the target keeps its bytes, a new
    name does not appear).  Before, the failed rename left the source's
    bytes held in memory at the target, shown there and stored later: the
    target's own bytes were lost."""
    (small_fs / "a").write_bytes(b"AAAA")
    (small_fs / "b").write_bytes(b"OLD")
    m = mount(small_fs)
    filler = fill(small_fs, 0)
    for target in ("b", "c"):
        with pytest.raises(OSError) as exc:
            os.rename(m / "a", m / target)
        assert exc.value.errno == errno.ENOSPC
        assert (m / "a").read_bytes() == b"AAAA" and (m / "b").read_bytes() == b"OLD"
        assert not (m / "c").exists() and sorted(os.listdir(m.path)) == ["a", "b", "filler"]
    filler.unlink()
    zs("sync", m.path)
    m.umount()
    assert (small_fs / "b").read_bytes() == b"OLD" and not (small_fs / "c").exists()
    assert (small_fs / "a").read_bytes() == b"AAAA"


def test_writers_of_the_target_of_a_failed_rename_write_on_to_it(small_fs, mount):
    """A file open for writing, another renamed onto it while the disk is
    full: the rename fails (ENOSPC) and changes nothing, so the open file is
    still the one at the name, and what is written through it afterwards is
    stored there at close.  Before, the failed rename put the file back but
    left its writers on a detached copy (as if it had been replaced): their
    later writes went to memory no one stores, lost at close."""
    (small_fs / "a").write_bytes(b"AAAA")
    (small_fs / "b").write_bytes(b"OLD")
    m = mount(small_fs)
    fd = os.open(m / "b", os.O_WRONLY)
    try:
        os.write(fd, b"NEW")
        filler = fill(small_fs, 0)
        with pytest.raises(OSError) as exc:
            os.rename(m / "a", m / "b")
        assert exc.value.errno == errno.ENOSPC
        filler.unlink()
        os.write(fd, b"MORE")
    finally:
        os.close(fd)
    assert (m / "b").read_bytes() == b"NEWMORE" and (m / "a").read_bytes() == b"AAAA"
    assert (small_fs / "b").read_bytes() == b"NEWMORE"
    m.umount()
    assert (small_fs / "b").read_bytes() == b"NEWMORE" and (small_fs / "a").read_bytes() == b"AAAA"


# ---------------------------------------------------------------------------
# E. the source itself gone


def _write_chunk_and_sync_fails(m) -> bool:
    """Writing a chunk, or storing it (``zshardfs sync``), fails with EIO."""
    try:
        (m / "arr/c/0/0").write_bytes(chunk_bytes(5))
    except OSError as exc:
        assert exc.errno == errno.EIO, exc
        return True
    result = zs("sync", m.path, check=False)
    return result.returncode != 0


def _abandon(m) -> None:
    """Kill the daemon (it holds data it cannot store) and clear its mount."""
    pid = daemon_pid(m)
    os.kill(pid, signal.SIGKILL)
    must(lambda: not process_running(pid), 10, "the daemon to die")
    subprocess.run(["fusermount3", "-uz", str(m.path)], capture_output=True)
    m.mounted = False


@pytest.mark.parametrize("how", ["removed", "unmounted"])
def test_a_source_gone_while_mounted_is_not_made_anew(how, tmp_path, small_fs, mount):
    """The source directory removed (``rm -rf``), or the file system it is
    on unmounted (``umount -l``: its path now names the directory under it):
    writes fail with EIO and one line naming the store, ``sync`` fails, and
    nothing is written where the store was; listings and lookups fail with
    EIO too, instead of showing an empty tree.  Before, the daemon made the
    path anew (or wrote into the directory underneath) and answered success:
    a shard of only the new chunks, away from the real store."""
    source = small_fs if how == "unmounted" else tmp_path / "src"
    grid_array(source)
    (source / "other").mkdir()
    m = mount(source, "flush_delay=60")
    assert (m / "arr/zarr.json").exists()
    fd = os.open(m / "arr/c/0/0", os.O_WRONLY | os.O_CREAT)  # (open before: its write is refused when stored)
    if how == "unmounted":
        subprocess.run(["umount", "-l", str(source)], check=True)
    else:
        subprocess.run(["rm", "-rf", str(source)], check=True)
    try:
        os.write(fd, chunk_bytes(6))
        os.close(fd)
        assert zs("sync", m.path, check=False).returncode != 0
        assert _write_chunk_and_sync_fails(m)
        assert "gone or was replaced" in m.log_text(), m.log_text()[-3000:]
        assert "Traceback" not in m.log_text()
        if how == "unmounted":
            assert os.listdir(source) == []  # the directory under the mount point: untouched
        else:
            assert not source.exists()
        with pytest.raises(OSError) as info:  # a directory not listed before: EIO, not an empty listing
            os.listdir(m / "other")
        assert info.value.errno == errno.EIO
        # (the lookup of "other" reads its probe's documents again once
        # metadata_ttl has passed, as under load: then the line says "read")
        assert any(f"nothing is {doing} there" in m.log_text() for doing in ("looked up", "listed", "read")), \
            m.log_text()[-3000:]
    finally:
        _abandon(m)


def test_a_source_swapped_while_mounted_is_refused(tmp_path, mount):
    """Another directory renamed into the source's path (``mv new current``)
    is not the store mounted: reads and writes there fail with EIO, and the
    log says it once (not once per name) and how to go on (mount again).
    Nothing of the mount's pending chunks lands in the tree swapped in, and
    no read shows it (an empty directory under an unmounted file system would
    tell ``rsync --delete`` from the mount to delete everything)."""
    source, fresh = tmp_path / "src", tmp_path / "fresh"
    grid_array(source)
    grid_array(fresh)
    (fresh / "added").mkdir()
    (fresh / "added/notes.txt").write_bytes(b"new tree")

    def files(root):
        return {p.relative_to(root): p.read_bytes() for p in root.rglob("*") if p.is_file()}

    m = mount(source, "metadata_ttl=0", "index_ttl=0", "attr_timeout=0", "flush_delay=60")
    assert (m / "arr/zarr.json").exists()
    before = files(fresh)
    os.rename(source, tmp_path / "old")
    os.rename(fresh, source)
    try:
        for attempt in [lambda: os.listdir(m / "added"), lambda: os.listdir(m.path)] + [
                lambda i=i: os.stat(m / f"x{i}") for i in range(40)]:
            with pytest.raises(OSError) as info:
                attempt()
            assert info.value.errno == errno.EIO
        assert _write_chunk_and_sync_fails(m)
        assert files(source) == before  # (nothing of the write landed in the tree swapped in)
        lines = [line for line in m.log_text().splitlines() if "gone or was replaced" in line]
        assert 1 <= len(lines) <= 6, lines  # (one per kind of operation: lookup, readdir, write, sync)
        assert "mount the store again" in lines[0]
        assert "Traceback" not in m.log_text()
    finally:
        _abandon(m)


def test_a_source_whose_file_system_comes_up_after_the_mount_is_read(tmp_path, mount):
    """At boot a service may mount before the source's file system (a disk,
    an NFS share) is mounted on the source's directory: the mount then holds
    the empty directory underneath.  Once the file system is there, the mount
    serves it (one warning), rather than refusing it as a replaced source.
    Writes go there too."""
    source = tmp_path / "data"  # (an empty mount point, its file system not there yet)
    source.mkdir()
    m = mount(source, "metadata_ttl=0", "attr_timeout=0")
    assert os.listdir(m.path) == []
    subprocess.run(["mount", "-t", "tmpfs", "tmpfs", str(source)], check=True)
    try:
        grid_array(source)
        assert os.listdir(m.path) == ["arr"]
        assert (m / "arr/zarr.json").exists()
        (m / "notes.txt").write_bytes(b"on the file system mounted")
        assert (source / "notes.txt").read_bytes() == b"on the file system mounted"
        assert "a file system was mounted on the store's directory" in m.log_text()
        assert "Traceback" not in m.log_text()
        m.umount()
    finally:
        subprocess.run(["umount", "-l", str(source)], check=True)


def test_umount_l_of_a_source_fs_whose_root_is_empty_is_refused(tmp_path, mount):
    """The source is a file system (empty so far: a new store) mounted on
    tmp_path/data; it is unmounted (umount -l) while mounted.  The path now
    names the empty directory underneath, on another file system: writes
    must fail (as for a non-empty store), not land on the root file system."""
    source = tmp_path / "data"
    source.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "tmpfs", str(source)], check=True)
    m = mount(source, "metadata_ttl=0", "attr_timeout=0")
    try:
        assert os.listdir(m.path) == []
        subprocess.run(["umount", "-l", str(source)], check=True)
        try:
            (m / "notes.txt").write_bytes(b"should not land under the mount point")
            written = None
        except OSError as exc:
            written = exc.errno
    finally:
        landed = os.listdir(source)
        _abandon(m)
        subprocess.run(["umount", "-l", str(source)], capture_output=True)
    assert landed == [], f"written into the directory under the unmounted file system: {landed}"
    assert written == errno.EIO


def _assert_refused_not_adopted(m) -> None:
    """The mount's root lists with EIO, and no file system was adopted."""
    with pytest.raises(OSError) as info:
        os.listdir(m.path)
    assert info.value.errno == errno.EIO
    assert "a file system was mounted on the store's directory" not in m.log_text()


def test_a_symlinked_source_pointed_elsewhere_is_refused(tmp_path, other_fs, mount):
    """The source given as a symlink (``current -> v1``, v1 empty).  The link
    is moved to another tree on another file system (``ln -sfn``): that tree
    is not the store mounted (test_a_source_swapped_while_mounted_is_refused),
    and must be refused, not served."""
    (tmp_path / "v1").mkdir()
    grid_array(other_fs / "v2")
    (other_fs / "v2" / "secret.txt").write_bytes(b"another tree")
    link = tmp_path / "current"
    link.symlink_to(tmp_path / "v1")
    m = mount(link, "metadata_ttl=0", "attr_timeout=0")
    try:
        assert os.listdir(m.path) == []
        tmp = tmp_path / "current.new"
        tmp.symlink_to(other_fs / "v2")
        os.rename(tmp, link)
        _assert_refused_not_adopted(m)
    finally:
        _abandon(m)


def test_an_empty_source_removed_and_replaced_by_a_symlink_is_refused(tmp_path, other_fs, mount):
    """The (empty) source directory removed (rmdir) and a symlink to a tree on
    another file system put at its path: the removed directory is refused
    (test_a_local_source_removed_and_made_again_is_refused), so must this be."""
    source = tmp_path / "src"
    source.mkdir()
    (other_fs / "tree").mkdir()
    (other_fs / "tree" / "secret.txt").write_bytes(b"another tree")
    m = mount(source, "metadata_ttl=0", "attr_timeout=0")
    try:
        assert os.listdir(m.path) == []
        source.rmdir()
        source.symlink_to(other_fs / "tree")
        _assert_refused_not_adopted(m)
    finally:
        _abandon(m)


def test_names_of_temporary_files_are_refused(tmp_path, mount):
    """A local store's temporary files (``.zshardfs-tmp-<pid>-...``) are
    hidden from listings and removed once their writer is gone: a user's file
    or directory of such a name would vanish, so the name is refused
    (EINVAL, one log line) at create, mkdir and as a rename's target."""
    source = tmp_path / "src"
    grid_array(source)
    m = mount(source)
    name = TMP + "999999-notes.txt"
    (m / "notes.txt").write_bytes(b"mine")
    for attempt in (lambda: (m / name).write_bytes(b"x"), lambda: (m / name).mkdir(),
                    lambda: os.rename(m / "notes.txt", m / name)):
        with pytest.raises(OSError) as info:
            attempt()
        assert info.value.errno == errno.EINVAL
    assert (m / "notes.txt").read_bytes() == b"mine"
    assert sorted(os.listdir(source)) == ["arr", "notes.txt"]
    assert "a name zshardfs keeps for its own temporary files" in m.log_text()


def test_a_file_refused_once_refuses_no_file_once_storage_works_again(small_fs, mount):
    """A plain file whose close failed (ENOSPC) is held in memory, counted
    against ``max_dirty`` with the dirty chunks; once storage works again a
    create that finds them over it first stores them (at most one try a
    second), and only if that fails too is refused, with that failure's
    error.  Before, it was refused at once with the old refusal's error for
    as long as nothing synced: a file held from a past outage, plus chunks
    written as usual (dirty below ``max_dirty``, as the flusher keeps them),
    failed every plain create, temporaries of chunk writers included."""
    zarr.create_array(str(small_fs / "arr"), shape=(64, 8192), chunks=(1, 4096), shards=(8, 8192), dtype="u1",
                      fill_value=0, compressors=None)
    filler = fill(small_fs, 64 << 10)
    m = mount(small_fs, "max_dirty=1M,flush_delay=600")
    with pytest.raises(OSError) as closing:
        with open(m / "held", "wb") as f:
            f.write(b"h" * (800 << 10))
    assert closing.value.errno == errno.ENOSPC
    filler.unlink()  # storage works again
    for i in range(64):  # 256 KiB of dirty chunks (no shard full): below max_dirty, over it with the held file
        (m / f"arr/c/{i}/0").write_bytes(bytes([i]) * 4096)
    (m / "arr" / "c" / "5" / ".tmp-chunk").write_bytes(b"a chunk writer's temporary")
    os.rename(m / "arr" / "c" / "5" / ".tmp-chunk", m / "arr" / "c" / "5" / "0")
    (m / "after").write_bytes(b"room again")
    assert (small_fs / "held").read_bytes() == b"h" * (800 << 10)  # stored by the first create
    m.umount()
    assert (small_fs / "after").read_bytes() == b"room again"


def test_a_directory_rename_whose_flush_fails_logs_one_line(tmp_path, mount):
    """mv of an array whose chunks written below cannot be stored (its
    shard directory is a file): the rename fails (EIO, nothing moved) and
    logs ONE line that says what failed -- it was two, the flush's own
    'flush of arr/c/0/0 failed' and fuse_ops' 'rename: arr/c/0/0: ...' for
    the same event.  Once storage works again, the rename goes through."""
    store, data = _seeded(tmp_path)
    m = mount(store, "flush_delay=60")
    (m / "arr/c/0/0").write_bytes(b"\x09" * 16)
    repair = _break_shards(store)
    try:
        mark = len(m.log_text())
        with pytest.raises(OSError) as info:
            os.rename(m / "arr", m / "moved")
        assert info.value.errno == errno.EIO
        lines = _problems_since(m, mark)
        assert len(lines) == 1, lines
        assert f"{store / 'arr/c'} is not a directory" in lines[0], lines
        assert (store / "arr").is_dir() and not (store / "moved").exists()
    finally:
        repair()
    os.rename(m / "arr", m / "moved")
    m.umount()
    data[0:2, 0:2] = 0x09090909
    np.testing.assert_array_equal(zarr.open_array(str(store / "moved"), mode="r")[...], data)


def test_an_rmdir_whose_flush_fails_logs_one_line(tmp_path, mount):
    """rm -r of an array whose chunk removals cannot be stored (its shard
    directory made read-only by a bind mount): the rmdir that must store
    them first fails (EROFS, the array's directory kept) and logs ONE line
    that says what failed -- it was five, the flush's own line for each of
    the four shards and fuse_ops' 'rmdir: arr/c/1/1: Read-only file system'.
    Once storage works again, everything is stored."""
    store, data = _seeded(tmp_path)
    m = mount(store, "flush_delay=60")
    shards = store / "arr/c"
    subprocess.run(["mount", "--bind", str(shards), str(shards)], check=True)
    try:
        subprocess.run(["mount", "-o", "remount,ro,bind", str(shards)], check=True)
        mark = len(m.log_text())
        out = subprocess.run(["rm", "-r", str(m / "arr")], capture_output=True, text=True, timeout=60)
        assert out.returncode != 0 and "Read-only file system" in out.stderr, out.stderr
        lines = _problems_since(m, mark)
        assert len(lines) == 1, lines
        assert "not removed" in lines[0] and "Read-only file system" in lines[0], lines
        assert (store / "arr/c/0/0").exists()
    finally:
        subprocess.run(["umount", "-l", str(shards)], check=False)
    m.umount()
    assert not (store / "arr/c/0/0").exists() and not (store / "arr/zarr.json").exists()


def test_an_fsync_whose_flush_fails_logs_one_line(tmp_path, mount):
    """fsync(2) of a chunk file whose shard cannot be stored (its shard
    directory is a file) is EIO and logs ONE line, the flush's ('flush of
    arr/c/0/0 failed (kept in memory, retried): ... is not a directory'):
    fuse_ops' 'fsync: arr/c/0/0: ...' for the same failure came with it,
    and an fsync of the directory right after (tensorstore's, after its
    rename), EIO too, added 'fsyncdir: ...': three lines, now the one (the
    flush's line is said once a minute)."""
    store, data = _seeded(tmp_path)
    m = mount(store, "flush_delay=60")
    fd = os.open(m / "arr/c/0/0", os.O_WRONLY)
    dfd = os.open(m / "arr/c/0", os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.write(fd, b"\x09" * 16)
        os.unlink(m / "arr/c/1/1")  # (a removal pending: the directory's fsync stores it)
        repair = _break_shards(store)
        try:
            mark = len(m.log_text())
            for target in (fd, dfd):
                with pytest.raises(OSError) as info:
                    os.fsync(target)
                assert info.value.errno == errno.EIO
            lines = _problems_since(m, mark)
            assert len(lines) == 1, lines
            assert "flush of arr/c/0/0 failed" in lines[0] and "is not a directory" in lines[0], lines
        finally:
            repair()
        os.fsync(fd)
    finally:
        os.close(fd)
        os.close(dfd)
    m.umount()
