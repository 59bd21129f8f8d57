"""A local directory as a store.

Atomic replace: data goes to a temporary file in the same directory, is
fsynced, renamed over the key, and the directory is fsynced.  A reader (or a
crash) therefore sees the old or the new object, never a mix.  Directories
a put makes are fsynced into their parents (:func:`_make_dirs`), and the
directory an unlink or a directory's removal changed is fsynced, so what a
put or delete reported done survives a power loss.  A put that
fails removes its temporary file; one left by a writer that died (kill -9)
is removed by the first put into its directory (or a listing of it) once
no live process can be writing it (:func:`_writer_gone`) and it is
STALE_AGE seconds old.  A backend opened with ``tidy=False`` (a read-only
mount, ``zshardfs fsck``) removes nothing: it logs one warning per such file
its listings meet instead.

The etag is ``<inode>-<mtime_ns>-<size>``: a rename-replace always changes
the inode, so a pinned read notices a replaced shard.  Conditional writes are
checked under an ``flock`` on the shard's directory, which serialises
zshardfs processes on one machine, and under tensorstore's lock of the key
(:func:`_key_lock`), which serialises them with tensorstore's writers.
Writers that take no lock (zarr-python) can still overwrite a write.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import stat
import struct
import threading
import time
from collections import Counter, OrderedDict
from contextlib import contextmanager

from .base import (AccessDenied, Blob, CorruptData, Listing, NotFound, ObjectInfo, PreconditionFailed, StoreError,
                   TooLarge, bump)

log = logging.getLogger(__name__)

TMP_PREFIX = ".zshardfs-tmp-"

#: longest file name (bytes) local file systems take: a temporary name is cut
#: to fit (:func:`_tmp_name`)
NAME_MAX = 255

#: a dead writer's temporary file is removed only once it is this old: a put
#: in flight in another pid namespace sharing the store (whose pid means
#: nothing here) has written it within moments
STALE_AGE = 60.0

#: temporary files this process is writing now (its pid alone does not prove
#: a file is its own: a restarted container's daemon often gets the same pid)
_writing: set[str] = set()
_writing_lock = threading.Lock()


def _is_internal(name: str) -> bool:
    return name.startswith(TMP_PREFIX)


#: tensorstore's lock files (its file kvstore's ``kLockSuffix``)
LOCK_SUFFIX = ".__lock"
#: seconds a conditional write waits for another writer's lock of its key
LOCK_WAIT = 10.0
# struct flock for fcntl (glibc, 64-bit: short, short, pad, off_t, off_t, pid_t, pad)
_OFD_WRLCK = struct.pack("=hh4xqqi4x", fcntl.F_WRLCK, os.SEEK_SET, 0, 0, 0)
_OFD_UNLCK = struct.pack("=hh4xqqi4x", fcntl.F_UNLCK, os.SEEK_SET, 0, 0, 0)


@contextmanager
def _key_lock(path: str):
    """tensorstore's lock of the key at ``path`` (its file kvstore, default
    ``os`` mode): an open-file-description write lock on ``<path>.__lock``,
    held on the file that is at that path once locked.  tensorstore checks
    a key's generation and renames its new value over it under this lock; a
    conditional write of ours that did not take it could land between the
    two, and tensorstore's rename would then throw it away unseen.  Waits
    LOCK_WAIT at most (EBUSY).  The lock file is removed when done, as
    tensorstore removes it after a write that did not rename it."""
    lock_path = path + LOCK_SUFFIX
    fd = os.open(lock_path, os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC, 0o666)
    try:
        deadline, delay = time.monotonic() + LOCK_WAIT, 0.001
        while True:
            try:
                fcntl.fcntl(fd, fcntl.F_OFD_SETLK, _OFD_WRLCK)
            except OSError as exc:
                if exc.errno not in (errno.EAGAIN, errno.EACCES):
                    raise
                if time.monotonic() > deadline:
                    raise OSError(errno.EBUSY, f"locked by another writer for {LOCK_WAIT:g} s", lock_path) from None
                time.sleep(delay)
                delay = min(0.05, 2 * delay)
                continue
            try:
                held = os.path.samestat(os.fstat(fd), os.stat(lock_path))
            except FileNotFoundError:
                held = False
            if held:
                break
            # the holder before us removed or renamed it: lock the file there now
            fcntl.fcntl(fd, fcntl.F_OFD_SETLK, _OFD_UNLCK)
            os.close(fd)
            fd = -1  # (closed: an open below that fails must not close it again)
            fd = os.open(lock_path, os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC, 0o666)
        try:
            yield
        finally:
            try:
                os.unlink(lock_path)  # (ours while locked)
            except FileNotFoundError:
                pass
    finally:
        if fd >= 0:
            os.close(fd)  # (releases the lock)


def _is_key_lock(name: str, size: int) -> bool:
    """A key's lock file, ours or tensorstore's: empty, named ``<key>.__lock``.
    One with data (tensorstore died writing a value into it, or a user's
    file of such a name) is left as it is, and listed."""
    return size == 0 and name.endswith(LOCK_SUFFIX) and len(name) > len(LOCK_SUFFIX)


def _remove_lock_if_stale(path: str) -> bool:
    """Remove a key's lock file that a killed writer left: STALE_AGE old and
    held by no one now (taken without waiting, as tensorstore does: a writer
    that opened it meanwhile finds it gone when it checks, and retries).
    True if it is gone."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return True
    except OSError:
        return False
    try:
        st = os.fstat(fd)
        if time.time() - st.st_mtime < STALE_AGE:
            return False
        try:
            fcntl.fcntl(fd, fcntl.F_OFD_SETLK, _OFD_WRLCK)
        except OSError:
            return False  # held: a live writer's
        if os.path.samestat(st, os.stat(path)):
            os.unlink(path)
        return True
    except FileNotFoundError:
        return True
    except OSError:
        return False
    finally:
        os.close(fd)


def _tmp_name(basename: str) -> str:
    """``.zshardfs-tmp-<pid>-<thread>-<basename>``, the basename cut so that
    the name fits NAME_MAX: a key whose own name is legal must be storable.
    The pid and thread make it unique (a thread writes one put at a time); the
    pid is what :func:`_writer_gone` reads."""
    head = f"{TMP_PREFIX}{os.getpid()}-{threading.get_ident()}-"
    room = NAME_MAX - len(head)  # (ASCII)
    tail = os.fsencode(basename)
    if len(tail) <= room:
        return head + basename
    # cut: a character split at the end, or bytes that are no UTF-8, are left out
    return head + tail[:room].decode("utf-8", "ignore")


#: directories this process made whose entry may not be durable in their
#: parent yet (made, parent not yet fsynced): a put into one fsyncs that
#: parent itself rather than trust the maker's fsync to have happened
_unsynced_dirs: set[str] = set()
_unsynced_lock = threading.Lock()


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _make_dirs(path: str, top: str) -> None:
    """``os.makedirs(path, exist_ok=True)``, durably: each directory made
    (from the deepest existing ancestor down) is fsynced into its parent.
    Never makes ``top`` (the store's root) or anything above it: a source
    removed or unmounted is not made anew (FileNotFoundError).  Costs one
    ``stat`` when ``path`` exists (the common case)."""
    missing = []
    while True:
        with _unsynced_lock:
            unsynced = path in _unsynced_dirs
        if not unsynced and os.path.isdir(path):
            break
        if path == top or not path.startswith(top.rstrip(os.sep) + os.sep):
            raise FileNotFoundError(errno.ENOENT, "the store's directory is gone", top)
        parent = os.path.dirname(path)
        missing.append(path)
        path = parent
    for d in reversed(missing):
        with _unsynced_lock:
            _unsynced_dirs.add(d)
        try:
            os.mkdir(d)
        except FileExistsError:
            if not os.path.isdir(d):  # a file: as os.makedirs, EEXIST for the
                with _unsynced_lock:  # path itself, ENOTDIR (the next mkdir) above it
                    _unsynced_dirs.discard(d)
                if d == missing[0]:
                    raise
                continue
        except BaseException:
            with _unsynced_lock:
                _unsynced_dirs.discard(d)
            raise
        # (made here or by another writer just now: fsynced here either way;
        # on failure it stays listed, so the next put into it tries again)
        _fsync_dir(os.path.dirname(d))
        with _unsynced_lock:
            _unsynced_dirs.discard(d)


def _writer_gone(path: str, name: str) -> bool:
    """True if no live writer can be writing this temporary file: the pid in
    its name is no running process, or is this process, which is not."""
    try:
        pid = int(name[len(TMP_PREFIX):].split("-", 1)[0])
    except ValueError:
        return False
    if pid == os.getpid():
        with _writing_lock:
            return path not in _writing
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except OSError:
        pass  # EPERM: running, as another user
    return False


#: dead writers' temporary files already told of (a long-lived read-only
#: mount lists the same directories again and again: one line each, ever)
_told: set[str] = set()


def _tell_if_old(path: str) -> None:
    """What a backend that must not write does with a dead writer's old
    temporary file: one warning (a writable mount would remove it)."""
    if path in _told:
        return
    try:
        if time.time() - os.stat(path).st_mtime < STALE_AGE:
            return
    except OSError:
        return
    if len(_told) > 10000:
        _told.clear()
    _told.add(path)
    log.warning("%s: a temporary file left by a writer that died; a writable mount removes it when it lists "
                "or writes into its directory", path)


def _remove_if_old(path: str) -> bool:
    """Remove a dead writer's temporary file once it is STALE_AGE old; True
    if it is gone."""
    try:
        if time.time() - os.stat(path).st_mtime < STALE_AGE:
            return False
        os.unlink(path)
    except FileNotFoundError:
        return True
    except OSError:
        return False
    log.info("removed %s, a temporary file left by a writer that died", path)
    return True


class LocalBackend:
    keeps_empty_dirs = True
    put_info_exact = True  # (put answers with os.stat of what it wrote)
    lookups_cost_requests = False  # (a stat)
    #: open descriptors kept for pinned reads without a thread hop
    FD_CACHE = 64
    #: seconds a kept descriptor answers for its path without a look at the
    #: path: a file replaced by rename keeps its old content on an open
    #: descriptor, so only the path tells that the version is no longer
    #: current (then the pinned read fails, and the index is read again)
    NOWAIT_TRUST = 1.0
    #: directories swept of dead writers' temporary files (see _sweep)
    SWEPT_DIRS = 1 << 16

    def __init__(self, root: str, *, tidy: bool = True):
        self.root = os.path.abspath(root)
        self.tidy = tidy  # remove dead writers' temporary files (False: only tell of them)
        self.url = self.root
        self.counters: Counter = Counter()
        # (key, etag) -> [fd, when the path last showed that version]
        self._fds: OrderedDict[tuple[str, str], list] = OrderedDict()
        self._fd_lock = threading.Lock()
        self._swept: OrderedDict[str, None] = OrderedDict()
        self._swept_lock = threading.Lock()
        # the root directory mounted, held open for the mount's life: its
        # inode cannot be freed, so no directory made in its place later can
        # reuse its number (ext4 hands a freed one to the next mkdir)
        try:
            self._root_fd: int | None = os.open(self.root, os.O_RDONLY | os.O_DIRECTORY)
        except OSError:
            self._root_fd = None  # (check() tells)
        self._root_lock = threading.Lock()
        self._old_root_fds: list[int] = []  # (given up for a file system mounted there: closed at close())

    # -- helpers -------------------------------------------------------------

    def _path(self, key: str) -> str:
        if key.startswith("/") or ".." in key.split("/"):
            raise NotFound(f"invalid key {key!r}", key)
        return os.path.join(self.root, key) if key else self.root

    @staticmethod
    def _info(key: str, st: os.stat_result) -> ObjectInfo:
        return ObjectInfo(key, st.st_size, f"{st.st_ino:x}-{st.st_mtime_ns:x}-{st.st_size:x}", st.st_mtime)

    @staticmethod
    def reserved_name(name: str) -> bool:
        """Temporary files' names: hidden from listings, removed once their
        writer is gone; a user's file of such a name would vanish.  (Not
        tensorstore's lock files: tensorstore writing through the mount makes
        them, and renames them over its keys.)"""
        return _is_internal(name)

    def _check_root(self, key: str, doing: str = "written") -> None:
        """Before a write, a listing or a lookup: the store's root directory
        is still the one mounted.  Removed (``rm -rf``), or another directory
        in its place (``mv new current``; the file system it was on unmounted
        with ``umount -l``, which leaves the directory underneath): EIO, and
        one line that says so (it names no key, so the log says it once, not
        once per name).  Writes stay in memory instead of landing in a
        directory made anew or in the one left underneath; reads do not show
        a tree the mount was not given (an empty one under an unmounted file
        system would tell ``rsync --delete`` to delete everything)."""
        if self._root_fd is None:
            return
        try:
            mounted, now = os.fstat(self._root_fd), os.stat(self.root)
            same = (now.st_dev, now.st_ino) == (mounted.st_dev, mounted.st_ino)
        except OSError:
            mounted = now = None
            same = False
        if same or (now is not None and self._adopt_mounted(mounted, now)):
            return
        bump(self.counters, "errors")
        raise StoreError(f"the store's directory {self.root} is gone or was replaced (removed, unmounted, or "
                         f"another directory moved there); nothing is {doing} there: unmount this mount, and "
                         "mount the store again", key)

    def _adopt_mounted(self, mounted: os.stat_result, now: os.stat_result) -> bool:
        """A file system mounted on the source's path after the mount began
        (at boot, a service that started before the disk or the NFS share
        came up), over the directory held, which is empty: serve the file
        system from now on.  The empty directory showed nothing, so nothing
        read before mixes with it.  Mounted *over* it: the directory held is
        still in the path's parent (a file system's root unmounted with
        ``umount -l``, or a removed directory, is in none), and the source is
        no symlink (one moved names another tree).  Any other directory in
        its place is refused."""
        if now.st_dev == mounted.st_dev or not stat.S_ISDIR(now.st_mode):
            return False
        with self._root_lock:
            held = self._root_fd
            if held is None:
                return True
            try:
                if (os.fstat(held).st_dev, os.fstat(held).st_ino) == (now.st_dev, now.st_ino):
                    return True  # (adopted meanwhile by another thread)
                with os.scandir(held) as entries:
                    if next(entries, None) is not None:
                        return False
                up_held, up_now = os.stat("..", dir_fd=held), os.stat(os.path.join(self.root, ".."))
                if os.path.islink(self.root) or (up_held.st_dev, up_held.st_ino) != (up_now.st_dev, up_now.st_ino):
                    return False
                fd = os.open(self.root, os.O_RDONLY | os.O_DIRECTORY)
            except OSError:
                return False
            self._old_root_fds.append(held)  # (not closed now: another thread may be fstat-ing it)
            self._root_fd = fd
        log.warning("%s: a file system was mounted on the store's directory after this mount began; serving it",
                    self.root)
        return True

    def _fail(self, key: str, exc: OSError) -> StoreError:
        if exc.errno in (errno.ENOENT, errno.ENOTDIR, errno.EISDIR):
            return NotFound(f"{key}: not found", key)
        if exc.errno in (errno.EACCES, errno.EPERM):
            bump(self.counters, "errors")
            return AccessDenied(f"{key}: {exc.strerror}", key)
        bump(self.counters, "errors")
        if exc.errno == errno.ELOOP:  # (a symlink loop where an object should be: damaged, left out of listings)
            return CorruptData(f"{key}: {exc.strerror}", key)
        err = StoreError(f"{key}: {exc.strerror}", key)
        err.errno = exc.errno or errno.EIO
        return err

    # -- reads ---------------------------------------------------------------

    def stat(self, key: str) -> ObjectInfo | None:
        bump(self.counters, "head")
        self._check_root(key, "looked up")
        try:
            st = os.stat(self._path(key))
        except (FileNotFoundError, NotADirectoryError):
            return None
        except OSError as exc:
            raise self._fail(key, exc) from None
        if not os.path.isfile(self._path(key)):
            return None
        return self._info(key, st)

    def is_dir(self, key: str) -> bool:
        self._check_root(key, "looked up")
        return os.path.isdir(self._path(key))

    def get(self, key, start=0, length=None, *, suffix=None, if_match=None, max_size=None) -> Blob:
        path = self._path(key)
        self._check_root(key, "read")  # (nowait reads of descriptors kept open read the tree mounted)
        try:  # non-blocking: a FIFO in the store must not hold a worker forever
            fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
        except OSError as exc:
            raise self._fail(key, exc) from None
        keep = False
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):  # listings show regular files only
                raise NotFound(f"{key}: not a regular file", key)
            info = self._info(key, st)
            if max_size is not None and st.st_size > max_size:
                raise TooLarge(f"{key}: {st.st_size} bytes", key, st.st_size)
            if if_match is not None and info.etag != if_match:
                bump(self.counters, "precondition_failed")
                raise PreconditionFailed(f"{key}: changed since it was read", key)
            if suffix is not None:
                start = max(0, st.st_size - suffix)
                length = st.st_size - start
            if length is None:
                length = max(0, st.st_size - start)
            data = os.pread(fd, length, start) if length > 0 else b""
            keep = self._keep_fd(key, info.etag, fd)
        except OSError as exc:
            raise self._fail(key, exc) from None
        finally:
            if not keep:
                os.close(fd)
        return self._count_read(info, start, data, suffix)

    def _count_read(self, info: ObjectInfo, start: int, data: bytes, suffix) -> Blob:
        ranged = suffix is not None or start > 0 or len(data) < info.size
        bump(self.counters, "get_range" if ranged else "get")
        bump(self.counters, "bytes_read", len(data))
        return Blob(data, info)

    def _keep_fd(self, key: str, etag: str, fd: int) -> bool:
        """Keep ``fd`` of this version for later nowait reads (LRU-bounded).
        Other versions of ``key`` are let go: a replaced file's descriptor
        would hold its disk space."""
        with self._fd_lock:
            kept = self._fds.get((key, etag))
            if kept is not None:
                kept[1] = time.monotonic()  # the path still shows this version
                return False
            gone = [self._fds.pop(k)[0] for k in [k for k in self._fds if k[0] == key]]
            self._fds[(key, etag)] = [fd, time.monotonic()]
            while len(self._fds) > self.FD_CACHE:
                gone.append(self._fds.popitem(last=False)[1][0])
        for old in gone:  # (closing the last link of a big file frees its blocks: not under the lock)
            os.close(old)
        return True

    def _forget_fds(self, key: str) -> None:
        """``key`` was replaced or removed: let go of its kept descriptors."""
        with self._fd_lock:
            gone = [self._fds.pop(k)[0] for k in [k for k in self._fds if k[0] == key]]
        for fd in gone:
            os.close(fd)

    def get_nowait(self, key: str, start: int, length: int, if_match: str) -> Blob | None:
        """A pinned ranged read served from the page cache without blocking,
        or None when it would block (then the caller uses a thread).

        ``preadv2(RWF_NOWAIT)`` fails with EAGAIN instead of waiting for the
        disk, so this is safe to call on the event loop; it saves the thread
        hop that otherwise dominates reading a small cached chunk."""
        with self._fd_lock:
            kept = self._fds.get((key, if_match))
            if kept is None or time.monotonic() - kept[1] > self.NOWAIT_TRUST:
                return None
            fd = kept[0]
            try:  # rewritten in place (same inode): no longer that version
                if self._info(key, os.fstat(fd)).etag != if_match:
                    del self._fds[(key, if_match)]
                    os.close(fd)
                    return None
            except OSError:
                return None
            self._fds.move_to_end((key, if_match))
            buf = bytearray(length)
            try:
                n = os.preadv(fd, [buf], start, os.RWF_NOWAIT)
            except (BlockingIOError, OSError, AttributeError):
                return None
        if n != length:
            return None  # partly cached, or past the end: the slow path decides
        etag_size = int(if_match.rsplit("-", 1)[1], 16)
        info = ObjectInfo(key, etag_size, if_match, 0.0)
        return self._count_read(info, start, bytes(buf), None)

    def list(self, prefix: str) -> Listing:
        bump(self.counters, "list")
        self._check_root(prefix, "listed")
        dirs, files = [], []
        try:
            with os.scandir(self._path(prefix)) as it:
                for entry in it:
                    if entry.name.endswith(LOCK_SUFFIX) and entry.is_file() and \
                            _is_key_lock(entry.name, entry.stat().st_size):
                        if self.tidy:  # (a key's lock, held now or left by a writer killed)
                            _remove_lock_if_stale(entry.path)
                        continue
                    if _is_internal(entry.name):
                        if _writer_gone(entry.path, entry.name):
                            if self.tidy:
                                _remove_if_old(entry.path)
                            else:
                                _tell_if_old(entry.path)
                        continue
                    try:
                        if entry.is_dir():
                            dirs.append(entry.name)
                        elif entry.is_file():
                            key = f"{prefix}/{entry.name}" if prefix else entry.name
                            files.append(self._info(key, entry.stat()))
                    except FileNotFoundError:
                        continue
        except (FileNotFoundError, NotADirectoryError):
            return Listing([], [])
        except OSError as exc:
            raise self._fail(prefix, exc) from None
        dirs.sort()
        files.sort(key=lambda f: f.key)
        return Listing(dirs, files)

    # -- writes --------------------------------------------------------------

    @contextmanager
    def _dir_lock(self, dirpath: str):
        """flock on the directory itself: no lock file is left in the store."""
        fd = os.open(dirpath, os.O_RDONLY | os.O_DIRECTORY)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)

    def _check(self, key: str, path: str, if_match, if_none_match) -> None:
        try:
            current = self._info(key, os.stat(path))
        except FileNotFoundError:
            current = None
        if if_none_match and current is not None:
            bump(self.counters, "precondition_failed")
            raise PreconditionFailed(f"{key}: exists already", key)
        if if_match is not None and (current is None or current.etag != if_match):
            bump(self.counters, "precondition_failed")
            raise PreconditionFailed(f"{key}: changed since it was read", key)

    def _sweep(self, dirpath: str) -> None:
        """Before the first put into a directory, remove the temporary files
        dead writers left there: chunk directories are listed from shard
        indexes, so no listing would ever meet them, and on a full disk they
        hold the space the put needs.  Done again on later puts while a dead
        writer's file there is still too young to remove."""
        with self._swept_lock:
            if dirpath in self._swept:
                return
        again = False
        try:
            with os.scandir(dirpath) as it:
                for entry in it:
                    if _is_internal(entry.name) and _writer_gone(entry.path, entry.name):
                        again |= not _remove_if_old(entry.path)
                    elif entry.name.endswith(LOCK_SUFFIX) and _is_key_lock(entry.name, entry.stat().st_size):
                        again |= not _remove_lock_if_stale(entry.path)
        except OSError:
            return
        if not again:
            with self._swept_lock:
                self._swept[dirpath] = None
                while len(self._swept) > self.SWEPT_DIRS:
                    self._swept.popitem(last=False)

    def put(self, key, data, *, if_match=None, if_none_match=False) -> ObjectInfo:
        path = self._path(key)
        dirpath = os.path.dirname(path)
        tmp = os.path.join(dirpath, _tmp_name(os.path.basename(path)))
        self._check_root(key)
        with _writing_lock:
            _writing.add(tmp)
        try:
            _make_dirs(dirpath, self.root)
            self._sweep(dirpath)
            try:
                try:
                    f = open(tmp, "wb")
                except FileNotFoundError:  # pruned meanwhile by the delete of its last shard
                    _make_dirs(dirpath, self.root)
                    f = open(tmp, "wb")
                with f:
                    f.write(data)
                    f.flush()
                    os.fsync(f.fileno())
                if if_match is not None or if_none_match:
                    with _key_lock(path), self._dir_lock(dirpath):
                        self._check(key, path, if_match, if_none_match)
                        os.rename(tmp, path)
                else:
                    os.rename(tmp, path)
            except BaseException:
                # a partial temporary file (ENOSPC mid-write) would hold the
                # space a retry needs, and nothing else would ever remove it
                try:
                    os.unlink(tmp)
                except OSError:
                    pass
                raise
            _fsync_dir(dirpath)
            st = os.stat(path)
        except OSError as exc:
            raise self._fail(key, exc) from None
        finally:
            with _writing_lock:
                _writing.discard(tmp)
        bump(self.counters, "put")
        self._forget_fds(key)
        bump(self.counters, "bytes_written", len(data))
        return self._info(key, st)

    def delete(self, key, *, if_match=None, prune_below=None) -> None:
        path = self._path(key)
        self._check_root(key)
        changed = None  # the directory whose change must be made durable
        try:
            if if_match is not None:
                with _key_lock(path), self._dir_lock(os.path.dirname(path)):
                    self._check(key, path, if_match, False)
                    os.unlink(path)
            else:
                os.unlink(path)
            changed = os.path.dirname(path)
        except FileNotFoundError:
            if if_match is not None:
                raise PreconditionFailed(f"{key}: gone", key) from None
        except OSError as exc:
            raise self._fail(key, exc) from None
        bump(self.counters, "delete")
        self._forget_fds(key)
        # Otherwise directories left empty stay, as in zarr-python's LocalStore:
        # they may be a user's (made with mkdir through the mount: real at once).
        if prune_below is not None:
            stop = self._path(prune_below)
            parent = os.path.dirname(path)
            while parent != stop and parent.startswith(stop + os.sep):
                try:
                    os.rmdir(parent)  # fails unless empty
                except OSError:
                    break
                parent = os.path.dirname(parent)
                changed = parent
        # one fsync: the deepest directory still there that changed (those
        # removed below it are gone with their entry in it)
        if changed is not None:
            self._sync_dir(key, changed)

    def _sync_dir(self, key: str, dirpath: str) -> None:
        """fsync a directory an unlink or rmdir changed; one removed meanwhile
        (another writer pruning) took the change with it."""
        try:
            _fsync_dir(dirpath)
        except (FileNotFoundError, NotADirectoryError):
            pass
        except OSError as exc:
            raise self._fail(key, exc) from None

    def statfs(self) -> os.statvfs_result:
        """The file system holding the store (``df`` on the mount shows it)."""
        try:
            return os.statvfs(self.root)
        except OSError as exc:  # the source directory was removed
            raise self._fail("", exc) from None

    def make_dir(self, key: str) -> None:
        self._check_root(key)
        try:
            _make_dirs(self._path(key), self.root)
        except OSError as exc:
            raise self._fail(key, exc) from None

    def remove_dir(self, key: str) -> None:
        path = self._path(key)
        self._check_root(key)
        try:
            os.rmdir(path)
        except FileNotFoundError:
            return
        except OSError as exc:
            raise self._fail(key, exc) from None
        self._sync_dir(key, os.path.dirname(path))

    def close(self) -> None:
        with self._fd_lock:
            for fd, _ in self._fds.values():
                os.close(fd)
            self._fds.clear()
            for fd in [self._root_fd, *self._old_root_fds] if self._root_fd is not None else self._old_root_fds:
                os.close(fd)
            self._root_fd, self._old_root_fds = None, []
