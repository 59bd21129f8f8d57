"""A local directory as a store.

Atomic replace: data goes to a temporary file in the same directory, is
fsynced, renamed over the key, and the directory is fsynced.  A reader (or a
crash) therefore sees the old or the new object, never a mix.  Directories
a put makes are fsynced into their parents (:meth:`LocalBackend._open_dir`), and the
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

Every key is resolved from the root directory held open, by ``openat2(2)``
with ``RESOLVE_BENEATH``: the kernel refuses (EXDEV) a path that would leave
the store, through ``..`` or a symbolic link (absolute links included), so a
user who can write into the source cannot make the daemon read, list, write
or delete anything outside it, nor send it into its own mount.  Links that
stay inside (relative ones) are followed for the names the view derives
(shards, chunk directories, metadata documents).  Every link is also
reported as itself (``Listing.links``, ``stat(links=True)``): the view
shows the names it passes through as links, which the client's kernel
resolves, so the daemon never follows those.  Changes are made relative to
the descriptor of the directory resolved (``*at`` calls), never by a path
resolved again.  ``confine=False`` (``-o follow_symlinks``) follows every
link, as the file system does, and reports none.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import logging
import os
import resource
import secrets
import stat
import struct
import threading
import time
from collections import Counter, OrderedDict
from contextlib import contextmanager

from ..logonce import log_once
from .base import (AccessDenied, Blob, CorruptData, DirectoryAtKey, Listing, NotFound, ObjectInfo,
                   PreconditionFailed, StoreError, TooLarge, bump, bump_read, join_key)

log = logging.getLogger(__name__)

# -- openat2(2) ----------------------------------------------------------------

#: the system call's number: the same on every architecture of the generic
#: table (x86_64, arm64, riscv...) since Linux 5.6
_SYS_OPENAT2 = 437
_RESOLVE_NO_MAGICLINKS = 0x02
_RESOLVE_NO_SYMLINKS = 0x04
_RESOLVE_BENEATH = 0x08
_RESOLVE_CACHED = 0x20  # (Linux 5.12: EAGAIN where the walk would need I/O or a revalidation)
_AT_FDCWD = -100


class _OpenHow(ctypes.Structure):
    _fields_ = [("flags", ctypes.c_uint64), ("mode", ctypes.c_uint64), ("resolve", ctypes.c_uint64)]


_libc = ctypes.CDLL(None, use_errno=True)
_syscall = _libc.syscall
_syscall.restype = ctypes.c_long


def openat2_beneath(dirfd: int, path: str, flags: int, mode: int = 0, no_symlinks: bool = False) -> int:
    """``openat(dirfd, path, flags)`` that fails with EXDEV rather than
    resolve outside ``dirfd``'s directory (``..``, symlinks, absolute ones
    too).  Python has no ``os.openat2``; ctypes releases the GIL for it."""
    how = _OpenHow(flags | os.O_CLOEXEC, mode,
                   _RESOLVE_BENEATH | _RESOLVE_NO_MAGICLINKS | (_RESOLVE_NO_SYMLINKS if no_symlinks else 0))
    name = os.fsencode(path)
    for _ in range(16):  # EAGAIN: a rename raced the kernel's walk of "..": walk again
        fd = _syscall(ctypes.c_long(_SYS_OPENAT2), ctypes.c_int(dirfd), ctypes.c_char_p(name),
                      ctypes.byref(how), ctypes.c_size_t(ctypes.sizeof(how)))
        if fd >= 0:
            return fd
        err = ctypes.get_errno()
        if err != errno.EAGAIN:
            break
    raise OSError(err, os.strerror(err), path)


def openat2_cached(dirfd: int, path: str, flags: int, resolve: int) -> int | None:
    """``openat2(dirfd, path, flags)`` resolved from the kernel's dentry
    cache alone (``RESOLVE_CACHED`` and ``resolve``), so that it never waits
    for the disk: safe on the event loop.  None when that cannot be (EAGAIN:
    a component not cached; an older kernel) or the call fails: the caller
    then asks in a worker thread, which says what is wrong."""
    how = _OpenHow(flags | os.O_CLOEXEC, 0, resolve | _RESOLVE_CACHED)
    fd = _syscall(ctypes.c_long(_SYS_OPENAT2), ctypes.c_int(dirfd), ctypes.c_char_p(os.fsencode(path)),
                  ctypes.byref(how), ctypes.c_size_t(ctypes.sizeof(how)))
    return fd if fd >= 0 else None


def openat2_missing() -> str | None:
    """Why this kernel cannot confine paths (None: it can)."""
    top = os.open("/", os.O_PATH | os.O_CLOEXEC)
    try:
        os.close(openat2_beneath(top, ".", os.O_PATH))
    except OSError as exc:
        return f"openat2 with RESOLVE_BENEATH (Linux 5.6 and later) failed: {exc.strerror}"
    finally:
        os.close(top)
    return None


TMP_PREFIX = ".zshardfs-tmp-"

#: longest file name (bytes) local file systems take: a temporary name is cut
#: to fit (:func:`_tmp_name`)
NAME_MAX = 255

#: a dead writer's temporary file is removed only once it is this old: a put
#: in flight in another pid namespace sharing the store (whose pid means
#: nothing here) has written it within moments
STALE_AGE = 60.0

#: names of the temporary files this process is writing now (its pid alone
#: does not prove a file is its own: a restarted container's daemon often
#: gets the same pid).  By name, not path: the random part makes a name
#: unique, and one directory can be reached by several paths (a relative
#: symlink inside the store, a case-folding file system), each of which a
#: listing or sweep would see it by
_writing: set[str] = set()
_writing_lock = threading.Lock()


_RENAME_NOREPLACE = 1  # (linux/fs.h)


def _renameat2(olddirfd: int, old: str, newdirfd: int, new: str, flags: int, key: str) -> None:
    """renameat2(2) (glibc >= 2.28); os.rename when no flag is asked.  Its
    EXDEV (the two places on different file systems: one mounted inside the
    store) names ``key``, the store's key of ``old``: the callers' answer
    EXDEV (``mv`` copies), unlike an EXDEV of openat2, a path that would
    leave the store."""
    try:
        if not flags:
            os.rename(old, new, src_dir_fd=olddirfd, dst_dir_fd=newdirfd)
            return
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.renameat2(olddirfd, os.fsencode(old), newdirfd, os.fsencode(new), ctypes.c_uint(flags)) != 0:
            err = ctypes.get_errno()
            raise OSError(err, os.strerror(err), old)
    except OSError as exc:
        if exc.errno == errno.EXDEV:
            raise OSError(errno.EXDEV, "on another file system (mounted inside the store)", key) from None
        raise


def _is_internal(name: str) -> bool:
    return name.startswith(TMP_PREFIX)


#: tensorstore's lock files (its file kvstore's ``kLockSuffix``)
LOCK_SUFFIX = ".__lock"
#: seconds a conditional write waits for another writer's lock of its key
LOCK_WAIT = 10.0
# struct flock for fcntl (glibc, 64-bit: short, short, pad, off_t, off_t, pid_t, pad)
_OFD_WRLCK = struct.pack("=hh4xqqi4x", fcntl.F_WRLCK, os.SEEK_SET, 0, 0, 0)
_OFD_UNLCK = struct.pack("=hh4xqqi4x", fcntl.F_UNLCK, os.SEEK_SET, 0, 0, 0)


def _direct(opener, *args, **kwargs) -> int:
    return opener(*args, **kwargs)


@contextmanager
def _key_lock(dfd: int, name: str, retry=_direct):
    """tensorstore's lock of the key ``name`` in the directory ``dfd`` (its
    file kvstore, default ``os`` mode): an open-file-description write lock
    on ``<name>.__lock``,
    held on the file that is at that path once locked.  tensorstore checks
    a key's generation and renames its new value over it under this lock; a
    conditional write of ours that did not take it could land between the
    two, and tensorstore's rename would then throw it away unseen.  Waits
    LOCK_WAIT at most (EBUSY).  The lock file is removed when done, as
    tensorstore removes it after a write that did not rename it.  ``retry``:
    how its opens meet EMFILE (the store's ``_fd_or_room``: another thread
    may take the last free descriptor number between our opens)."""
    lock_name = name + LOCK_SUFFIX
    if len(os.fsencode(lock_name)) > NAME_MAX:
        # a key this long cannot have a lock file: tensorstore cannot lock
        # it either (its open fails), so there is no writer to wait for;
        # the caller's directory lock still orders this process's writers
        yield
        return
    # (a symlink planted there: ELOOP; a FIFO: ENXIO or not a regular file,
    # never an open that waits for a reader)
    flags = os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK
    fd = _open_regular(lock_name, flags, dfd, retry)
    try:
        deadline, delay = time.monotonic() + LOCK_WAIT, 0.001
        while True:
            try:
                fcntl.fcntl(fd, fcntl.F_OFD_SETLK, _OFD_WRLCK)
            except OSError as exc:
                if exc.errno not in (errno.EAGAIN, errno.EACCES):
                    raise
                if time.monotonic() > deadline:
                    raise OSError(errno.EBUSY, f"locked by another writer for {LOCK_WAIT:g} s", lock_name) from None
                time.sleep(delay)
                delay = min(0.05, 2 * delay)
                continue
            try:
                held = os.path.samestat(os.fstat(fd), os.stat(lock_name, dir_fd=dfd, follow_symlinks=False))
            except FileNotFoundError:
                held = False
            if held:
                break
            # the holder before us removed or renamed it: lock the file there now
            fcntl.fcntl(fd, fcntl.F_OFD_SETLK, _OFD_UNLCK)
            os.close(fd)
            fd = -1  # (closed: an open below that fails must not close it again)
            fd = _open_regular(lock_name, flags, dfd, retry)
        try:
            yield
        finally:
            try:
                os.unlink(lock_name, dir_fd=dfd)  # (ours while locked)
            except FileNotFoundError:
                pass
    finally:
        if fd >= 0:
            os.close(fd)  # (releases the lock)


def _take_mode_of(fd: int, name: str, dfd: int) -> None:
    """Give the new file ``fd``, about to replace ``name`` in ``dfd``, the
    permission bits of the regular file there (never setuid/setgid: bits
    nobody gave the bytes written through the mount) and, where this
    process may (root; a group it is in), its owner and group: before any
    byte is written, so a private shard is never readable by others, nor
    left root's by a root daemon.  Nothing there (a new key): the umask's
    mode, the daemon's user, as any new file."""
    try:
        st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
    except OSError:
        return
    _give_mode(fd, st)


def _give_mode(fd: int, st: os.stat_result) -> None:
    """The new file ``fd`` gets the mode and owner of the regular file
    ``st`` describes (see :func:`_take_mode_of`); nothing if it is none."""
    if not stat.S_ISREG(st.st_mode):
        return
    mine = os.fstat(fd)
    if (st.st_uid, st.st_gid) != (mine.st_uid, mine.st_gid):
        for uid, gid in ((st.st_uid, st.st_gid), (-1, st.st_gid)):
            try:
                os.fchown(fd, uid, gid)
                break
            except OSError:
                continue
    os.fchmod(fd, stat.S_IMODE(st.st_mode) & 0o1777)


def _exists(name: str, dfd: int) -> bool:
    try:
        os.stat(name, dir_fd=dfd, follow_symlinks=False)
    except FileNotFoundError:
        return False
    except OSError:
        return True  # (something there: it decides, see _take_mode_of)
    return True


def _open_regular(name: str, flags: int, dfd: int, retry=_direct) -> int:
    """``os.open`` in ``dfd`` that accepts a regular file only (EBUSY for
    anything else another user may have put there)."""
    fd = retry(os.open, name, flags, 0o666, dir_fd=dfd)
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise OSError(errno.EBUSY, "not a regular file", name)
    return fd


def _is_key_lock(name: str, size: int) -> bool:
    """A key's lock file, ours or tensorstore's: empty, named ``<key>.__lock``.
    One with data (tensorstore died writing a value into it, or a user's
    file of such a name) is left as it is, and listed."""
    return size == 0 and name.endswith(LOCK_SUFFIX) and len(name) > len(LOCK_SUFFIX)


def _remove_lock_if_stale(dfd: int, name: str) -> bool:
    """Remove a key's lock file that a killed writer left: STALE_AGE old and
    held by no one now (taken without waiting, as tensorstore does: a writer
    that opened it meanwhile finds it gone when it checks, and retries).
    True if it is gone."""
    try:
        fd = _open_regular(name, os.O_WRONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK, dfd)
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
        if os.path.samestat(st, os.stat(name, dir_fd=dfd, follow_symlinks=False)):
            os.unlink(name, dir_fd=dfd)
        return True
    except FileNotFoundError:
        return True
    except OSError:
        return False
    finally:
        os.close(fd)


def _tmp_name(basename: str) -> str:
    """``.zshardfs-tmp-<pid>-<random>-<basename>``, the basename cut so that
    the name fits NAME_MAX: a key whose own name is legal must be storable.
    The random part makes it unique and unguessable (it is created with
    O_EXCL: whatever another user put at a name they foresaw, a FIFO or a
    hard link to a file elsewhere, is never opened); the pid is what
    :func:`_writer_gone` reads."""
    head = f"{TMP_PREFIX}{os.getpid()}-{secrets.token_hex(8)}-"
    room = NAME_MAX - len(head)  # (ASCII)
    tail = os.fsencode(basename)
    if len(tail) <= room:
        return head + basename
    # cut: a character split at the end, or bytes that are no UTF-8, are left out
    return head + tail[:room].decode("utf-8", "ignore")


#: directories this process made whose entry may not be durable in their
#: parent yet (made, parent not yet fsynced), by (store root, key): a put
#: into one fsyncs that parent itself rather than trust the maker's fsync to
#: have happened
_unsynced_dirs: set[tuple[str, str]] = set()
_unsynced_lock = threading.Lock()


class _PrunedMeanwhile(Exception):
    """A directory being made below one that a concurrent delete pruned
    (``error``: the ENOENT it met); :meth:`LocalBackend._open_dir` walks again."""

    def __init__(self, error: OSError):
        super().__init__(str(error))
        self.error = error


def _writer_gone(path: str, name: str) -> bool:
    """True if no live writer can be writing this temporary file: the pid in
    its name is no running process, or is this process, which is not."""
    try:
        pid = int(name[len(TMP_PREFIX):].split("-", 1)[0])
    except ValueError:
        return False
    if pid == os.getpid():
        with _writing_lock:
            return name not in _writing
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


def _tell_if_old(dfd: int, name: str, path: str) -> None:
    """What a backend that must not write does with a dead writer's old
    temporary file ``name`` in ``dfd`` (``path``, for the log): one warning
    (a writable mount would remove it)."""
    if path in _told:
        return
    try:
        if time.time() - os.stat(name, dir_fd=dfd, follow_symlinks=False).st_mtime < STALE_AGE:
            return
    except OSError:
        return
    if len(_told) > 10000:
        _told.clear()
    _told.add(path)
    log.warning("%s: a temporary file left by a writer that died; a writable mount removes it when it lists "
                "or writes into its directory", path)


def _remove_if_old(dfd: int, name: str, path: str) -> bool:
    """Remove a dead writer's temporary file ``name`` in ``dfd`` once it is
    STALE_AGE old; True if it is gone."""
    try:
        if time.time() - os.stat(name, dir_fd=dfd, follow_symlinks=False).st_mtime < STALE_AGE:
            return False
        os.unlink(name, dir_fd=dfd)
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

    def __init__(self, root: str, *, tidy: bool = True, confine: bool = True):
        self.root = os.path.abspath(root)
        self.tidy = tidy  # remove dead writers' temporary files (False: only tell of them)
        self.confine = confine  # keys resolve below the root only (see the module's docstring)
        self.symlinks = confine  # links reported as links (-o follow_symlinks: followed, never shown)
        self.url = self.root
        self.counters: Counter = Counter()
        # (key, etag) -> [fd, when the path last showed that version, its
        # (st_ino, st_mtime_ns, st_size): what the etag is made of, the
        # ObjectInfo its nowait reads answer with]
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
        """The path of ``key``, for log lines and names; never opened."""
        if key.startswith("/") or ".." in key.split("/"):
            raise NotFound(f"invalid key {key!r}", key)
        return os.path.join(self.root, key) if key else self.root

    def _open(self, key: str, flags: int, mode: int = 0) -> int:
        """A descriptor of ``key``, resolved from the root directory held
        open; with ``confine``, never outside it (EXDEV)."""
        self._path(key)
        root = self._root_fd
        if root is None:
            raise FileNotFoundError(errno.ENOENT, "the store's directory is gone", self.root)
        if self.confine:
            return self._fd_or_room(openat2_beneath, root, key or ".", flags, mode)
        return self._fd_or_room(os.open, key or ".", flags | os.O_CLOEXEC, mode, dir_fd=root)

    def _fd_or_room(self, opener, *args, **kwargs) -> int:
        """``opener(*args)``; when the process is out of descriptors
        (EMFILE, ENFILE), once more after letting go of those kept for
        nowait reads (a speed-up only): else a daemon whose kept descriptors
        fill its ``ulimit -n`` fails every open for good."""
        try:
            return opener(*args, **kwargs)
        except OSError as exc:
            if exc.errno not in (errno.EMFILE, errno.ENFILE) or not self._let_go_of_kept_fds(exc):
                raise
        return opener(*args, **kwargs)

    def _let_go_of_kept_fds(self, exc: OSError) -> bool:
        """Close every descriptor kept for nowait reads; True if there were any."""
        with self._fd_lock:
            gone = [kept[0] for kept in self._fds.values()]
            self._fds.clear()
        for fd in gone:
            os.close(fd)
        if gone:
            log_once(log, logging.WARNING,
                     f"{self.root}: out of file descriptors ({exc.strerror}; limit "
                     f"{resource.getrlimit(resource.RLIMIT_NOFILE)[0]}): closed the {len(gone)} kept open "
                     "for reads; raise the daemon's limit (LimitNOFILE=) if this recurs", tag="local fd limit")
        return bool(gone)

    def _fd_cache_size(self) -> int:
        """Descriptors kept for nowait reads: FD_CACHE, but at most a quarter
        of the open-file limit (read now: ``prlimit`` may change it), so
        that they never take what requests need."""
        return min(self.FD_CACHE, resource.getrlimit(resource.RLIMIT_NOFILE)[0] // 4)

    def _stat(self, key: str) -> os.stat_result:
        """``os.stat`` of ``key`` (symlinks followed as ``_open`` does)."""
        fd = self._open(key, os.O_PATH)
        try:
            return os.fstat(fd)
        finally:
            os.close(fd)

    def _open_dir(self, key: str, make: bool = False) -> int:
        """A descriptor of the directory ``key`` (O_RDONLY: flock and fsync
        work on it).  ``make``: the missing directories are made, from the
        deepest existing one down, each fsynced into its parent; never the
        root itself (a source removed is not made anew: ENOENT).  Costs one
        ``openat2`` when the directory exists (the common case)."""
        flags = os.O_RDONLY | os.O_DIRECTORY
        if not make:
            return self._open(key, flags)
        with _unsynced_lock:
            unsynced = (self.root, key) in _unsynced_dirs
        if not unsynced:
            try:
                return self._open(key, flags)
            except FileNotFoundError:
                if not key:
                    raise
        parts = key.split("/")
        for _ in range(7):
            try:
                return self._make_dirs(parts, flags)
            except _PrunedMeanwhile:
                pass  # (a concurrent delete pruned an empty directory on the path: made again from the root)
        try:
            return self._make_dirs(parts, flags)
        except _PrunedMeanwhile as exc:
            raise exc.error from None

    def _make_dirs(self, parts: list[str], flags: int) -> int:
        """:meth:`_open_dir`'s making of the directories ``parts``, from the
        deepest existing one down.  A directory it holds (found, or just made)
        may be pruned meanwhile by a delete of the last shard below it
        (``prune_below``: the write-back flushes several shards at once), and
        nothing can be made in a removed directory (ENOENT):
        :class:`_PrunedMeanwhile`, and the caller walks again."""
        fd = self._open("", flags)
        try:
            for i, name in enumerate(parts):
                here = "/".join(parts[:i + 1])
                with _unsynced_lock:
                    unsynced = (self.root, here) in _unsynced_dirs
                if not unsynced:
                    try:
                        child = self._open(here, flags)
                    except FileNotFoundError:
                        child = -1
                    if child >= 0:
                        os.close(fd)
                        fd = child
                        continue
                with _unsynced_lock:
                    _unsynced_dirs.add((self.root, here))
                try:
                    os.mkdir(name, dir_fd=fd)
                except FileExistsError:
                    pass  # (made by another writer just now: fsynced here too; a file: ENOTDIR below)
                except BaseException as exc:
                    with _unsynced_lock:
                        _unsynced_dirs.discard((self.root, here))
                    if isinstance(exc, FileNotFoundError):  # (the directory it is in was pruned)
                        raise _PrunedMeanwhile(exc) from None
                    raise
                os.fsync(fd)  # (on failure it stays listed: the next put into it tries again)
                with _unsynced_lock:
                    _unsynced_dirs.discard((self.root, here))
                try:
                    child = self._open(here, flags)
                except FileNotFoundError as exc:  # (made, and pruned at once: still empty)
                    raise _PrunedMeanwhile(exc) from None
                except NotADirectoryError:
                    if i == len(parts) - 1:  # (as os.makedirs: EEXIST for the path itself, ENOTDIR above)
                        raise FileExistsError(errno.EEXIST, "a file of that name exists", here) from None
                    raise
                os.close(fd)
                fd = child
            return fd
        except BaseException:
            os.close(fd)
            raise

    @staticmethod
    def _info(key: str, st: os.stat_result) -> ObjectInfo:
        return ObjectInfo(key, st.st_size, f"{st.st_ino:x}-{st.st_mtime_ns:x}-{st.st_size:x}", st.st_mtime_ns)

    @staticmethod
    def _link_info(key: str, st: os.stat_result, target: str) -> ObjectInfo:
        size = len(os.fsencode(target))
        return ObjectInfo(key, size, f"{st.st_ino:x}-{st.st_mtime_ns:x}-l{size:x}", st.st_mtime_ns, link=target)

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

    def _outside(self, key: str) -> None:
        """One warning for a key whose path leaves the store (EXDEV)."""
        log_once(log, logging.WARNING, f"{self._path(key)}: a symbolic link on this path leads out of the store; "
                                       "not followed (-o follow_symlinks follows it)",
                 tag=f"symlink out of {self.root}: {key}", interval=3600)

    def _fail(self, key: str, exc: OSError) -> StoreError:
        if exc.errno == errno.EXDEV:  # (openat2: out of the store)
            self._outside(key)
            return NotFound(f"{key}: not found (a symbolic link out of the store)", key)
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

    def stat(self, key: str, *, links: bool = False) -> ObjectInfo | None:
        bump(self.counters, "head")
        self._check_root(key, "looked up")
        try:
            if links and self.symlinks and key:
                # (O_PATH | O_NOFOLLOW: a descriptor of the link itself, never of what it names)
                fd = self._open(key, os.O_PATH | os.O_NOFOLLOW)
                try:
                    st = os.fstat(fd)
                    if stat.S_ISLNK(st.st_mode):
                        return self._link_info(key, st, os.readlink("", dir_fd=fd))
                finally:
                    os.close(fd)
            else:
                st = self._stat(key)
        except (FileNotFoundError, NotADirectoryError):
            return None
        except OSError as exc:
            if exc.errno == errno.EXDEV:
                self._outside(key)
                return None
            raise self._fail(key, exc) from None
        if not stat.S_ISREG(st.st_mode):
            return None
        return self._info(key, st)

    def is_dir(self, key: str) -> bool:
        self._check_root(key, "looked up")
        try:
            return stat.S_ISDIR(self._stat(key).st_mode)
        except OSError as exc:
            if exc.errno == errno.EXDEV:
                self._outside(key)
            return False

    def get(self, key, start=0, length=None, *, suffix=None, if_match=None, max_size=None) -> Blob:
        self._check_root(key, "read")  # (nowait reads of descriptors kept open read the tree mounted)
        try:  # non-blocking: a FIFO in the store must not hold a worker forever
            fd = self._open(key, os.O_RDONLY | os.O_NONBLOCK)
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
            keep = self._keep_fd(key, info.etag, fd, st)
        except OSError as exc:
            raise self._fail(key, exc) from None
        finally:
            if not keep:
                os.close(fd)
        return self._count_read(info, start, data, suffix)

    def _count_read(self, info: ObjectInfo, start: int, data: bytes, suffix) -> Blob:
        ranged = suffix is not None or start > 0 or len(data) < info.size
        bump_read(self.counters, "get_range" if ranged else "get", len(data))
        return Blob(data, info)

    def _keep_fd(self, key: str, etag: str, fd: int, st: os.stat_result) -> bool:
        """Keep ``fd`` of this version for later nowait reads (LRU-bounded).
        Other versions of ``key`` are let go: a replaced file's descriptor
        would hold its disk space."""
        with self._fd_lock:
            kept = self._fds.get((key, etag))
            if kept is not None:
                kept[1] = time.monotonic()  # the path still shows this version
                return False
            gone = [self._fds.pop(k)[0] for k in [k for k in self._fds if k[0] == key]]
            cap = self._fd_cache_size()
            if cap > 0:
                self._fds[(key, etag)] = [fd, time.monotonic(), (st.st_ino, st.st_mtime_ns, st.st_size),
                                          ObjectInfo(key, st.st_size, etag, 0)]
            while len(self._fds) > cap:
                gone.append(self._fds.popitem(last=False)[1][0])
        for old in gone:  # (closing the last link of a big file frees its blocks: not under the lock)
            os.close(old)
        return cap > 0

    def _forget_fds(self, key: str) -> None:
        """``key`` was replaced or removed: let go of its kept descriptors."""
        with self._fd_lock:
            gone = [self._fds.pop(k)[0] for k in [k for k in self._fds if k[0] == key]]
        for fd in gone:
            os.close(fd)

    def _forget_dirs(self, *dir_keys: str) -> None:
        """The directories ``dir_keys`` were renamed or removed: what is kept
        of them and below by key (swept of dead writers' temporaries, kept
        descriptors) is dropped, as a directory at that name later is
        another one (made again, or moved there with a dead writer's
        temporary inside)."""
        def below(key: str) -> bool:
            return any(key == d or key.startswith(d + "/") for d in dir_keys)

        with self._swept_lock:
            for key in [k for k in self._swept if below(k)]:
                del self._swept[key]
        with self._fd_lock:
            gone = [self._fds.pop(k)[0] for k in [k for k in self._fds if below(k[0])]]
        for fd in gone:
            os.close(fd)

    def get_nowait(self, key: str, start: int, length: int | None, if_match: str | None,
                   suffix: int | None = None) -> Blob | None:
        """A ranged read served from the page cache without blocking, or
        None when it would block (then the caller uses a thread).

        ``preadv2(RWF_NOWAIT)`` fails with EAGAIN instead of waiting for the
        disk, so this is safe to call on the event loop; it saves the thread
        hop that otherwise dominates reading a small cached chunk.  With
        ``if_match``: pinned to that version, from a descriptor kept open.
        Without: the current version (``suffix`` as :meth:`get`), see
        :meth:`_get_current_nowait`."""
        if if_match is None:
            return self._get_current_nowait(key, start, length, suffix)
        with self._fd_lock:
            kept = self._fds.get((key, if_match))
            if kept is None or time.monotonic() - kept[1] > self.NOWAIT_TRUST:
                return None
            fd, _, made_of, info = kept
            try:  # rewritten in place (same inode): no longer that version
                st = os.fstat(fd)
                if (st.st_ino, st.st_mtime_ns, st.st_size) != made_of:  # (what _info's etag is made of)
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
        # (a random chunk's read through the mount is this: each step here
        # costs a few us of the event loop's time, docs/PERFORMANCE.md)
        bump_read(self.counters, "get_range" if start > 0 or length < info.size else "get", length)
        return Blob(bytes(buf), info)

    def _get_current_nowait(self, key: str, start: int, length: int | None, suffix: int | None) -> Blob | None:
        """:meth:`get` of the current version of ``key`` (a shard index's
        load) on the event loop: what it does, each step asked not to wait
        (the root directory's and the key's paths resolved from the dentry
        cache alone, the bytes from the page cache), or None the moment one
        would wait or finds anything unusual (not a regular file, too short,
        an error, the root replaced): then :meth:`get`, in a thread, does it
        all again and answers, its log lines and errors included.  So a
        first lookup in a shard whose pages are cached costs no thread hop
        (0.4-0.7 ms, most of the request)."""
        if length is None and suffix is None:
            return None
        found = self._regular_cached(key)
        if found is None:
            return None
        root, resolve, _ = found
        fd = openat2_cached(root, key or ".", os.O_RDONLY | os.O_NONBLOCK, resolve)
        if fd is None:
            return None
        keep = False
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                return None
            info = self._info(key, st)
            if suffix is not None:
                start = max(0, st.st_size - suffix)
                length = st.st_size - start
            data = b""
            if length > 0:
                buf = bytearray(length)
                if os.preadv(fd, [buf], start, os.RWF_NOWAIT) != length:
                    return None  # partly cached, or past the end: the slow path decides
                data = bytes(buf)
            keep = self._keep_fd(key, info.etag, fd, st)
        except (OSError, AttributeError):  # (BlockingIOError: not all cached; no RWF_NOWAIT)
            return None
        finally:
            if not keep:
                os.close(fd)
        return self._count_read(info, start, data, suffix)

    def _regular_cached(self, key: str) -> tuple[int, int, os.stat_result] | None:
        """``key`` resolved from the dentry cache alone, as :meth:`_open`
        resolves it, if it is a regular file: (the root's descriptor, the
        ``resolve`` flags, its ``fstat``); None the moment that would wait or
        finds anything unusual (not a regular file, not found, an error, the
        root replaced: :meth:`_check_root`'s case).  Only a regular file is
        ever opened on the loop after this: a device's open may wait."""
        root = self._root_fd
        if root is None:
            return None
        try:
            self._path(key)
        except NotFound:
            return None
        fd = openat2_cached(_AT_FDCWD, self.root, os.O_PATH, 0)  # (_check_root, not waiting)
        if fd is None:
            return None
        try:
            now, mounted = os.fstat(fd), os.fstat(root)
        except OSError:
            return None
        finally:
            os.close(fd)
        if (now.st_dev, now.st_ino) != (mounted.st_dev, mounted.st_ino):
            return None
        resolve = _RESOLVE_BENEATH | _RESOLVE_NO_MAGICLINKS if self.confine else 0
        fd = openat2_cached(root, key or ".", os.O_PATH, resolve)
        if fd is None:
            return None
        try:
            st = os.fstat(fd)
        except OSError:
            return None
        finally:
            os.close(fd)
        return (root, resolve, st) if stat.S_ISREG(st.st_mode) else None

    def stat_nowait(self, key: str) -> ObjectInfo | None:
        """:meth:`stat` of a regular file on the event loop (a cached shard
        index's re-validation after ``index_ttl``), from the dentry and inode
        caches alone; None when that cannot answer (anything but a regular
        file found so: then :meth:`stat`, in a thread, answers, its log lines
        and errors included).  Saves the thread hop, most of such a call."""
        found = self._regular_cached(key)
        if found is None:
            return None
        bump(self.counters, "head")
        return self._info(key, found[2])

    def _ancestry(self, prefix: str) -> set[tuple[int, int]]:
        """(st_dev, st_ino) of ``prefix``'s directory and of every directory
        above it up to the root: a symlink to one of them is a loop."""
        parts = prefix.split("/") if prefix else []
        out = set()
        for i in range(len(parts) + 1):
            st = self._stat("/".join(parts[:i]))
            out.add((st.st_dev, st.st_ino))
        return out

    def _loop(self, key: str) -> None:
        log_once(log, logging.WARNING, f"{self._path(key)}: a symbolic link to a directory above it (a loop); "
                                       "left out", tag=f"symlink loop: {self._path(key)}", interval=3600)

    def list(self, prefix: str) -> Listing:
        bump(self.counters, "list")
        self._check_root(prefix, "listed")
        dirs, files, links = [], [], []
        ancestry = None  # (computed when a symlink may make a loop)
        try:
            try:  # (the common case: no symlink on the way, so no loop either; with or
                # without confine: a key has no "..", so no symlink means beneath)
                if self._root_fd is None:
                    raise OSError(errno.ELOOP, "")
                self._path(prefix)
                dfd = self._fd_or_room(openat2_beneath, self._root_fd, prefix or ".", os.O_RDONLY | os.O_DIRECTORY,
                                       no_symlinks=True)
            except OSError as exc:
                if exc.errno not in (errno.ELOOP, errno.ENOSYS):  # (ENOSYS: -o follow_symlinks before Linux 5.6)
                    raise
                dfd = self._open_dir(prefix)
                try:
                    ancestry = self._ancestry(prefix.rpartition("/")[0]) if prefix else set()
                    here = os.fstat(dfd)
                    if prefix and (here.st_dev, here.st_ino) in ancestry:  # (a walk down it would never end)
                        self._loop(prefix)
                        os.close(dfd)
                        return Listing([], [])
                    ancestry.add((here.st_dev, here.st_ino))
                except BaseException:
                    os.close(dfd)
                    raise
        except (FileNotFoundError, NotADirectoryError):
            return Listing([], [])
        except OSError as exc:
            if exc.errno == errno.EXDEV:
                self._outside(prefix)
                return Listing([], [])
            raise self._fail(prefix, exc) from None
        try:
            # (scandir reads a copy of ``dfd``: a descriptor of its own, which
            # can meet the open-file limit as an open can)
            with self._fd_or_room(os.scandir, dfd) as it:
                for entry in it:
                    name = entry.name
                    key = f"{prefix}/{name}" if prefix else name
                    if name.endswith(LOCK_SUFFIX) and entry.is_file(follow_symlinks=False):
                        try:
                            size = entry.stat(follow_symlinks=False).st_size
                        except FileNotFoundError:
                            # a writer done with its lock removed it since the name
                            # was read (every conditional write does): not listed,
                            # and no reason to end the listing
                            continue
                        if _is_key_lock(name, size):
                            if self.tidy:  # (a key's lock, held now or left by a writer killed)
                                _remove_lock_if_stale(dfd, name)
                            continue
                    if _is_internal(name):
                        path = self._path(key)
                        if _writer_gone(path, name):
                            if self.tidy:
                                _remove_if_old(dfd, name, path)
                            else:
                                _tell_if_old(dfd, name, path)
                        continue
                    try:
                        if entry.is_symlink():
                            if self.symlinks:  # the link itself: what the view shows where it passes names through
                                try:
                                    links.append(self._link_info(key, entry.stat(follow_symlinks=False),
                                                                 os.readlink(name, dir_fd=dfd)))
                                except OSError:  # (replaced or removed meanwhile: as if not there)
                                    continue
                            try:  # followed as a lookup would, inside the store only: for derived names
                                st = self._stat(key)
                            except OSError as exc:
                                # (left out of dirs and files; told of only where no link is
                                # reported: the view warns for the names it derives)
                                if exc.errno == errno.EXDEV:
                                    if not self.symlinks:
                                        self._outside(key)
                                elif exc.errno == errno.ELOOP:  # (left out, as a damaged object is)
                                    if not self.symlinks:
                                        log_once(log, logging.WARNING, f"{self._path(key)}: a symbolic link loop; "
                                                 "left out", tag=f"symlink loop: {self._path(key)}", interval=3600)
                                elif exc.errno not in (errno.ENOTDIR, errno.ENOENT) and not self.symlinks:
                                    # (ENOTDIR: a link through a file, which names nothing; any other
                                    # failure to follow, e.g. ENAMETOOLONG for a target naming a
                                    # component over NAME_MAX, is this link's, never the listing's)
                                    log_once(log, logging.WARNING, f"{self._path(key)}: a symbolic link that "
                                             f"cannot be followed ({exc.strerror}); left out",
                                             tag=f"symlink unfollowed: {self._path(key)}", interval=3600)
                                continue
                            if stat.S_ISDIR(st.st_mode):
                                if ancestry is None:
                                    ancestry = self._ancestry(prefix)
                                if (st.st_dev, st.st_ino) in ancestry:
                                    if not self.symlinks:
                                        self._loop(key)
                                    continue
                        else:
                            st = entry.stat(follow_symlinks=False)
                        if stat.S_ISDIR(st.st_mode):
                            dirs.append(name)
                        elif stat.S_ISREG(st.st_mode):
                            files.append(self._info(key, st))
                    except FileNotFoundError:
                        continue
        except (FileNotFoundError, NotADirectoryError):
            return Listing([], [])
        except OSError as exc:
            raise self._fail(prefix, exc) from None
        finally:
            os.close(dfd)
        dirs.sort()
        files.sort(key=lambda f: f.key)
        links.sort(key=lambda f: f.key)
        return Listing(dirs, files, links=tuple(links))

    # -- writes --------------------------------------------------------------

    @staticmethod
    @contextmanager
    def _dir_lock(dfd: int):
        """flock on the directory itself: no lock file is left in the store.
        Waits LOCK_WAIT at most (EBUSY; the flush is retried): anyone who
        can read the directory can flock it, and a wait without end would
        hold a worker thread for good."""
        deadline, delay = time.monotonic() + LOCK_WAIT, 0.001
        while True:
            try:
                fcntl.flock(dfd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise OSError(errno.EBUSY, f"directory locked by another process for {LOCK_WAIT:g} s") from None
                time.sleep(delay)
                delay = min(0.05, 2 * delay)
        try:
            yield
        finally:
            fcntl.flock(dfd, fcntl.LOCK_UN)

    def _check(self, key: str, dfd: int, if_match, if_none_match) -> None:
        """The precondition, judged in the directory ``dfd`` the change is
        made in: the key's path must still lead there (a directory moved
        away meanwhile, another in its place: judged, and retried, anew)."""
        try:
            held, now = os.fstat(dfd), self._stat(key.rpartition("/")[0])
        except (FileNotFoundError, NotADirectoryError):
            now = None
        if now is None or (held.st_dev, held.st_ino) != (now.st_dev, now.st_ino):
            bump(self.counters, "precondition_failed")
            raise PreconditionFailed(f"{key}: its directory was moved or replaced", key)
        try:
            st = self._stat(key)
            # (a FIFO, or a link leading out, named like the key: the view
            # shows nothing there, and the rename replaces the entry itself)
            current = self._info(key, st) if stat.S_ISREG(st.st_mode) else None
        except OSError as exc:
            if exc.errno not in (errno.ENOENT, errno.EXDEV, errno.ELOOP):
                raise
            current = None
        if if_none_match and current is not None:
            bump(self.counters, "precondition_failed")
            raise PreconditionFailed(f"{key}: exists already", key)
        if if_match is not None and (current is None or current.etag != if_match):
            bump(self.counters, "precondition_failed")
            raise PreconditionFailed(f"{key}: changed since it was read", key)

    def _sweep(self, dir_key: str, dfd: int) -> None:
        """Before the first put into a directory, remove the temporary files
        dead writers left there: chunk directories are listed from shard
        indexes, so no listing would ever meet them, and on a full disk they
        hold the space the put needs.  Done again on later puts while a dead
        writer's file there is still too young to remove."""
        with self._swept_lock:
            if dir_key in self._swept:
                return
        again = False
        try:
            with os.scandir(dfd) as it:
                for entry in it:
                    name = entry.name
                    if _is_internal(name):
                        path = self._path(join_key(dir_key, name))
                        if _writer_gone(path, name):
                            again |= not _remove_if_old(dfd, name, path)
                    elif name.endswith(LOCK_SUFFIX) and entry.is_file(follow_symlinks=False):
                        try:
                            size = entry.stat(follow_symlinks=False).st_size
                        except FileNotFoundError:
                            continue  # (a writer's, done with it: see list)
                        if _is_key_lock(name, size):
                            again |= not _remove_lock_if_stale(dfd, name)
        except OSError:
            return
        if not again:
            with self._swept_lock:
                self._swept[dir_key] = None
                while len(self._swept) > self.SWEPT_DIRS:
                    self._swept.popitem(last=False)

    #: put takes ``like``: the key of a stored file a new one is a copy of
    keeps_modes = True

    def put(self, key, data, *, if_match=None, if_none_match=False, like: str | None = None) -> ObjectInfo:
        """``like``: the key of the stored file whose mode and owner a new
        file (none at ``key``) takes, as the one at ``key`` is taken when
        replaced (a file renamed through the view is stored as a copy under
        its new name: rename(2) would keep them); gone, or no regular file:
        the umask's, as any new file."""
        dir_key, _, name = key.rpartition("/")
        self._path(key)
        self._check_root(key)
        like_st = self._lstat_or_none(like) if like is not None else None
        # (O_EXCL: a new file of a random name, never one that was there)
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        dfd, tmp, shown = -1, None, None
        try:
            dfd = self._open_dir(dir_key, make=True)
            self._sweep(dir_key, dfd)
            try:
                for _ in range(8):
                    tmp = _tmp_name(name)
                    shown = tmp  # (what _writer_gone knows it by)
                    with _writing_lock:
                        _writing.add(shown)
                    try:
                        fd = self._fd_or_room(os.open, tmp, flags, 0o666, dir_fd=dfd)
                        break
                    except (FileExistsError, FileNotFoundError) as exc:
                        with _writing_lock:
                            _writing.discard(shown)
                        tmp = None
                        if isinstance(exc, FileNotFoundError):  # pruned meanwhile by the delete of its last shard
                            os.close(dfd)
                            dfd = -1
                            dfd = self._open_dir(dir_key, make=True)
                else:
                    raise FileExistsError(errno.EEXIST, "no free temporary name", dir_key)
                _take_mode_of(fd, name, dfd)
                if like_st is not None and not _exists(name, dfd):
                    _give_mode(fd, like_st)
                with open(fd, "wb") as f:
                    f.write(data)
                    f.flush()
                    os.fsync(f.fileno())
                if if_match is not None or if_none_match:
                    with _key_lock(dfd, name, self._fd_or_room), self._dir_lock(dfd):
                        self._check(key, dfd, if_match, if_none_match)
                        os.rename(tmp, name, src_dir_fd=dfd, dst_dir_fd=dfd)
                else:
                    os.rename(tmp, name, src_dir_fd=dfd, dst_dir_fd=dfd)
            except BaseException:
                # a partial temporary file (ENOSPC mid-write) would hold the
                # space a retry needs, and nothing else would ever remove it
                if dfd >= 0 and tmp is not None:
                    try:
                        os.unlink(tmp, dir_fd=dfd)
                    except OSError:
                        pass
                raise
            os.fsync(dfd)
            st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
        except OSError as exc:
            if exc.errno == errno.ENOTDIR:
                raise self._path_blocked(key, dir_key) from None
            if exc.errno == errno.EISDIR:  # (a directory at the key: NotFound still, told apart for a rename)
                raise DirectoryAtKey(f"{key}: not found (a directory)", key) from None
            raise self._fail(key, exc) from None
        finally:
            if dfd >= 0:
                os.close(dfd)
            if shown is not None:
                with _writing_lock:
                    _writing.discard(shown)
        bump(self.counters, "put")
        self._forget_fds(key)
        bump(self.counters, "bytes_written", len(data))
        return self._info(key, st)

    def _lstat_or_none(self, key: str) -> os.stat_result | None:
        """``lstat`` of ``key`` (resolved below the root), None if it cannot be."""
        try:
            fd = self._open(key, os.O_PATH | os.O_NOFOLLOW)
        except (OSError, StoreError):
            return None
        try:
            return os.fstat(fd)
        finally:
            os.close(fd)

    def _path_blocked(self, key: str, dir_key: str) -> StoreError:
        """A put whose directory cannot be made or opened because something
        not a directory (a file) has the name of one on its path: a failed
        write (EIO), not a missing key (ENOTDIR was reported as "not found")."""
        bump(self.counters, "errors")
        parts, blocker = dir_key.split("/"), dir_key
        for i in range(1, len(parts) + 1):
            here = "/".join(parts[:i])
            try:
                if not stat.S_ISDIR(os.stat(self._path(here)).st_mode):
                    blocker = here
                    break
            except OSError:
                break
        return StoreError(f"{key}: cannot be written: {self._path(blocker)} is not a directory "
                          "(a file has the name of a directory on its path)", key)

    def delete(self, key, *, if_match=None, prune_below=None) -> None:
        dir_key, _, name = key.rpartition("/")
        self._path(key)
        self._check_root(key)
        changed = None  # the directory whose change must be made durable
        try:
            dfd = self._open_dir(dir_key)
        except FileNotFoundError:
            dfd = -1
        except OSError as exc:
            raise self._fail(key, exc) from None
        try:
            if dfd < 0:
                raise FileNotFoundError(errno.ENOENT, "no such directory", dir_key)
            if if_match is not None:
                with _key_lock(dfd, name, self._fd_or_room), self._dir_lock(dfd):
                    self._check(key, dfd, if_match, False)
                    os.unlink(name, dir_fd=dfd)
            else:
                os.unlink(name, dir_fd=dfd)
            changed = dir_key
        except FileNotFoundError:
            if if_match is not None:
                raise PreconditionFailed(f"{key}: gone", key) from None
        except OSError as exc:
            raise self._fail(key, exc) from None
        finally:
            if dfd >= 0:
                os.close(dfd)
        bump(self.counters, "delete")
        self._forget_fds(key)
        # Otherwise directories left empty stay, as in zarr-python's LocalStore:
        # they may be a user's (made with mkdir through the mount: real at once).
        if prune_below is not None and changed is not None:
            below = prune_below + "/" if prune_below else ""
            while changed != prune_below and changed.startswith(below):
                parent, _, child = changed.rpartition("/")
                try:
                    pfd = self._open_dir(parent)
                except OSError:
                    break
                try:
                    os.rmdir(child, dir_fd=pfd)  # fails unless empty
                except OSError:
                    break
                finally:
                    os.close(pfd)
                self._forget_dirs(changed)
                changed = parent
        # one fsync: the deepest directory still there that changed (those
        # removed below it are gone with their entry in it)
        if changed is not None:
            self._sync_dir(key, changed)

    def _sync_dir(self, key: str, dir_key: str) -> None:
        """fsync a directory an unlink or rmdir changed; one removed meanwhile
        (another writer pruning) took the change with it."""
        try:
            fd = self._open_dir(dir_key)
        except (FileNotFoundError, NotADirectoryError):
            return
        except OSError as exc:
            raise self._fail(key, exc) from None
        try:
            os.fsync(fd)
        except OSError as exc:
            raise self._fail(key, exc) from None
        finally:
            os.close(fd)

    def statfs(self) -> os.statvfs_result:
        """The file system holding the store (``df`` on the mount shows it)."""
        try:
            return os.statvfs(self.root)
        except OSError as exc:  # the source directory was removed
            raise self._fail("", exc) from None

    def make_dir(self, key: str) -> None:
        self._check_root(key)
        try:
            os.close(self._open_dir(key, make=True))
        except OSError as exc:
            raise self._fail(key, exc) from None

    def remove_dir(self, key: str) -> None:
        parent, _, name = key.rpartition("/")
        self._path(key)
        self._check_root(key)
        try:
            pfd = self._open_dir(parent)
        except FileNotFoundError:
            return
        except OSError as exc:
            raise self._fail(key, exc) from None
        try:
            os.rmdir(name, dir_fd=pfd)
            self._forget_dirs(key)
            os.fsync(pfd)
        except FileNotFoundError:
            return
        except OSError as exc:
            raise self._fail(key, exc) from None
        finally:
            os.close(pfd)

    def symlink(self, key: str, target: str) -> ObjectInfo:
        dir_key, _, name = key.rpartition("/")
        self._path(key)
        self._check_root(key)
        try:
            dfd = self._open_dir(dir_key)
        except OSError as exc:
            raise self._fail(key, exc) from None
        try:
            os.symlink(target, name, dir_fd=dfd)  # (symlinkat: the text as given, never resolved here)
            os.fsync(dfd)
            st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
        except FileExistsError:
            err = StoreError(f"{key}: exists", key)
            err.errno = errno.EEXIST
            raise err from None
        except OSError as exc:
            raise self._fail(key, exc) from None
        finally:
            os.close(dfd)
        bump(self.counters, "put")
        return self._link_info(key, st, target)

    def _move_ends(self, key: str, new_key: str) -> tuple[str, str, str, str]:
        """(source directory, source name, target directory, target name)
        of a move of ``key`` to ``new_key``, both checked as store paths."""
        (src_dir, _, src), (dst_dir, _, dst) = key.rpartition("/"), new_key.rpartition("/")
        self._path(key)
        self._path(new_key)
        self._check_root(key)
        return src_dir, src, dst_dir, dst

    @contextmanager
    def _two_dirs(self, src_dir: str, dst_dir: str):
        """Descriptors of a move's two directories (OSError as _open_dir
        raises it), both closed when the block ends."""
        sfd = dfd = -1
        try:
            sfd = self._open_dir(src_dir)
            dfd = self._open_dir(dst_dir)
            yield sfd, dfd
        finally:
            for fd in (sfd, dfd):
                if fd >= 0:
                    os.close(fd)

    def move_link(self, key: str, new_key: str, *, noreplace: bool = False) -> None:
        """rename(2) of the link ``key`` itself to ``new_key``, replacing a
        file there; ``noreplace``: never (renameat2 RENAME_NOREPLACE, EEXIST)."""
        src_dir, src, dst_dir, dst = self._move_ends(key, new_key)
        try:
            with self._two_dirs(src_dir, dst_dir) as (sfd, dfd):
                if not stat.S_ISLNK(os.stat(src, dir_fd=sfd, follow_symlinks=False).st_mode):
                    raise FileNotFoundError(errno.ENOENT, "no longer a symbolic link", key)
                _renameat2(sfd, src, dfd, dst, _RENAME_NOREPLACE if noreplace else 0, key)  # (the link itself moves)
                os.fsync(dfd)
                if src_dir != dst_dir:
                    os.fsync(sfd)
        except OSError as exc:
            if (exc.errno == errno.EXDEV and exc.filename == key) or (noreplace and exc.errno == errno.EEXIST) \
                    or exc.errno == errno.EISDIR:
                # (across file systems: the caller copies; the new name taken
                # meanwhile; a directory made at the new name since the
                # caller's lookup: rename(2)'s answer, not a missing name)
                err = StoreError(f"{key} -> {new_key}: {exc.strerror}", key)
                err.errno = exc.errno
                raise err from None
            raise self._fail(key, exc) from None
        bump(self.counters, "put")
        self._forget_fds(new_key)  # (a file it replaced)

    def move_dir(self, key: str, new_key: str, *, noreplace: bool) -> None:
        """rename(2) of the directory ``key`` to ``new_key``: one atomic step
        of the file system (a kill at any moment leaves it at one name or the
        other).  ``noreplace``: the new name must be free (renameat2 with
        RENAME_NOREPLACE: EEXIST if anything took it meanwhile); else an
        empty directory there is replaced, as rename(2) does (ENOTEMPTY if
        it is not empty).  Run on the event loop by the caller (so nothing
        it holds of the old paths can change meanwhile): no fsync here, see
        :meth:`sync_dirs`."""
        src_dir, src, dst_dir, dst = self._move_ends(key, new_key)
        if not src or not dst:
            raise self._fail(key, OSError(errno.EINVAL, "not a directory of the store"))
        try:
            with self._two_dirs(src_dir, dst_dir) as (sfd, dfd):
                if not stat.S_ISDIR(os.stat(src, dir_fd=sfd, follow_symlinks=False).st_mode):
                    # (a link to a directory, followed by -o follow_symlinks: not renamed, copied)
                    raise OSError(errno.EXDEV, "not a directory of the store (a symbolic link to one)", key)
                _renameat2(sfd, src, dfd, dst, _RENAME_NOREPLACE if noreplace else 0, key)
        except OSError as exc:
            # (EBUSY: either place is a mount point, as rename(2) says: the
            # user's answer too, not a failure of the store)
            if exc.errno in (errno.ENOTEMPTY, errno.EEXIST, errno.EINVAL, errno.ENOTDIR, errno.EISDIR,
                             errno.EBUSY) or (exc.errno == errno.EXDEV and exc.filename == key):
                err = StoreError(f"{key} -> {new_key}: {exc.strerror}", key)
                err.errno = exc.errno
                raise err from None
            raise self._fail(key, exc) from None
        bump(self.counters, "put")
        # (kept descriptors answer for a path without a look: not for the old
        # ones; a directory replaced at the new name was swept, not this one)
        self._forget_dirs(key, new_key)

    def sync_dirs(self, *keys: str) -> None:
        """fsync the directories ``keys`` (a rename's two parents): the
        rename is then durable.  One gone meanwhile is passed over."""
        for key in dict.fromkeys(keys):
            self._sync_dir(key, key)

    def table_sizes(self) -> dict[str, int]:
        """Entries of this backend's tables (see AsyncStore.table_sizes)."""
        return {"kept_fds": len(self._fds), "swept_dirs": len(self._swept)}

    def close(self) -> None:
        with self._fd_lock:
            for kept in self._fds.values():
                os.close(kept[0])
            self._fds.clear()
            for fd in [self._root_fd, *self._old_root_fds] if self._root_fd is not None else self._old_root_fds:
                os.close(fd)
            self._root_fd, self._old_root_fds = None, []
