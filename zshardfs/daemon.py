"""The trio main program of one mount.

Order of things: open the backend and check it (a bad source fails here,
before anything is mounted), mount, tell the waiting parent we are ready,
serve until unmounted or signalled, then flush and unmount cleanly.

Stopping never drops data silently: SIGTERM/SIGINT (or an unmount from
outside) stores everything first, retrying while storage fails; only the
same signal again gives up, and the log names what is lost.  SIGHUP and
SIGUSR1 never end the daemon: they reopen the log file (after logrotate
moved it away); SIGUSR2 is ignored.

Control channel: extended attributes of the mount's root directory
(``user.zshardfs.stats``, ``user.zshardfs.pid``) — no extra socket to
secure, no extra file in the view.  Anyone who may read the root may read
those; ``user.zshardfs.sync`` (store everything now) only the daemon's user
and root may ask for (EACCES): another user of an ``allow_other`` mount
syncing after each of the owner's writes would defeat write merging.
``user.zshardfs.unmounting`` (the same users): ``zshardfs umount`` says an
unmount follows, after which the daemon ends also when a copy of the mount
in another mount namespace would keep it serving (see _watch_unmount).
"""

from __future__ import annotations

import errno
import gc
import json
import logging
import os
import re
import select
import signal
import sys
import tempfile
import time

import pyfuse3
import trio

from . import gcpolicy
from .backends.base import AsyncStore, CorruptData, StoreError, no_request_deadline
from .config import ConfigError, MountConfig
from .fuse_ops import Operations
from .logonce import log_once
from .memtrim import Trimmer, limit_arenas, malloc_trim, rss_bytes
from .shards import ShardCache
from .view import View
from .writeback import WriteBack, failures_logged_by_caller

log = logging.getLogger(__name__)

XATTR_STATS = "user.zshardfs.stats"
XATTR_PID = "user.zshardfs.pid"
XATTR_SYNC = "user.zshardfs.sync"
#: ``zshardfs umount`` reads it right before its ``fusermount3 -u``: see
#: Mount._watch_unmount
XATTR_UNMOUNTING = "user.zshardfs.unmounting"
#: ... and this one when that ``fusermount3 -u`` failed (busy): the watch
#: ends (a ``umount -z`` after it must leave the daemon serving open files)
XATTR_UNMOUNT_REFUSED = "user.zshardfs.unmount_refused"
#: ``zshardfs reopen-log`` (the unit's ExecReload) reads it: the log file is
#: reopened before the answer, so ``systemctl reload`` returns once it is
#: (a SIGHUP is asynchronous: systemd said "Reloaded" before the daemon had)
XATTR_REOPEN_LOG = "user.zshardfs.reopen_log"
#: seconds an unmount announced so is watched for
UNMOUNT_WATCH = 30.0
#: seconds the FUSE connection may outlive the mount here before it is
#: taken as held by a copy of the mount in another mount namespace (the
#: kernel ends it as the unmount returns: at once)
CONNECTION_GRACE = 1.0

#: "reopen your log file" (what logrotate postrotate scripts send: HUP, or
#: USR1 as for nginx); never a stop
REOPEN_SIGNALS = (signal.SIGHUP, signal.SIGUSR1)
#: signals whose default action would end the daemon without its final sync
IGNORED_SIGNALS = (signal.SIGUSR2,)


def open_backend(cfg: MountConfig):
    """The backend for ``cfg.source`` (a path or ``s3://bucket/prefix``)."""
    if cfg.source.startswith("s3://"):
        from .backends.s3 import S3Backend, parse_s3_url

        bucket, prefix = parse_s3_url(cfg.source)
        # Per attempt: a connection must be made within a tenth of the
        # deadline (a dead host is retried on another connection), and an
        # answer may take half of it: a server that answers slowly but within
        # -o timeout is waited for, not cut short and retried into EIO.  The
        # deadline itself is kept by the store (AsyncStore), whatever the
        # attempts still have left; a call given up there sends no attempt
        # after it, and gives its max_connections slot back at once.
        backend = S3Backend(bucket, prefix, endpoint_url=cfg.endpoint_url, region=cfg.region, profile=cfg.profile,
                            connect_timeout=max(1.0, cfg.timeout / 10), read_timeout=max(2.0, cfg.timeout / 2),
                            max_attempts=3,
                            # (calls given up at their deadline, as many again, run without a slot)
                            max_pool_connections=max(10, 2 * cfg.max_connections))
        if not backend.check() and cfg.read_only and cfg.mountpoint:  # (fsck counts the files itself)
            # (a local source that does not exist is refused; S3 has no
            # directories, and a prefix holding nothing is a new store's)
            log.warning("%s holds no object: the read-only view is empty (is the prefix right?)", cfg.source)
        return backend
    if "://" in cfg.source:
        raise ConfigError(f"source {cfg.source!r}: only local paths and s3:// URLs are supported")
    from .backends.local import LocalBackend, openat2_missing

    if not os.path.exists(cfg.source):
        raise ConfigError(f"source {cfg.source!r} does not exist")
    if not os.path.isdir(cfg.source):
        raise ConfigError(f"source {cfg.source!r} is not a directory")
    if not os.access(cfg.source, os.R_OK | os.X_OK):
        raise ConfigError(f"source {cfg.source!r} is not readable")
    if not cfg.follow_symlinks:
        why = openat2_missing()
        if why:
            raise ConfigError(f"cannot keep paths inside the source: {why}; mount with -o follow_symlinks "
                              "if no one else can write into the source")
    # (a read-only mount writes nothing)
    return LocalBackend(cfg.source, tidy=not cfg.read_only, confine=not cfg.follow_symlinks)


def fuse_option_value(text: str) -> str:
    """``text`` as the value of one libfuse ``-o`` option: libfuse splits
    options at ',' (escape: backslash) and pyfuse3 passes them as ASCII, so a
    source path with a comma or an accent must not end the mount."""
    text = text.encode("ascii", "backslashreplace").decode("ascii") if not text.isascii() else text
    text = "".join(ch if ch.isprintable() else f"\\x{ord(ch):02x}" for ch in text)
    return text.replace("\\", "\\\\").replace(",", "\\,")


def fuse_options(cfg: MountConfig) -> set[str]:
    opts = {"default_permissions", f"fsname={fuse_option_value(cfg.fsname or cfg.source)}", "subtype=zshardfs"}
    if cfg.read_only:
        opts.add("ro")
    if cfg.allow_other:
        opts.add("allow_other")
    if cfg.debug:
        opts.add("debug")
    return opts


def prefetch_ahead(cfg: MountConfig) -> int:
    """Read-ahead across shards hides request latency; a local source has
    little to hide, and the work would compete with the reader's."""
    if cfg.prefetch_ahead is not None:
        return cfg.prefetch_ahead
    return cfg.chunk_cache // 2 if cfg.source.startswith("s3://") else 0


def build_view(cfg: MountConfig, backend) -> View:
    """The layers below the kernel's, wired bottom-up as ``cfg`` says:
    store, shard cache, write-back, view (``view.store``, ``view.shards``,
    ``view.writeback``).  A mount serves it; ``zshardfs fsck`` walks it."""
    # listings are kept for metadata_ttl: a scan lists each shard
    # directory once per chunk directory below it (S3: a LIST each; local:
    # a thread hop each, which dominates a warm walk)
    store = AsyncStore(backend, max_connections=cfg.max_connections, timeout=cfg.timeout, list_ttl=cfg.metadata_ttl)
    shards = ShardCache(store, index_cache_bytes=cfg.index_cache, index_ttl=cfg.index_ttl,
                        chunk_cache_bytes=cfg.chunk_cache, prefetch=cfg.prefetch == "on",
                        prefetch_max=cfg.prefetch_max, prefetch_gap=cfg.prefetch_gap,
                        prefetch_ahead=prefetch_ahead(cfg), keep_handed_over=cfg.source.startswith("s3://"))
    writeback = WriteBack(store, shards, max_dirty_bytes=cfg.max_dirty, idle_delay=cfg.flush_delay,
                          room_timeout=cfg.timeout)
    return View(store, shards, writeback, metadata_ttl=cfg.metadata_ttl, read_only=cfg.read_only,
                shard_option=cfg.shard)


def _fuse_fd() -> int | None:
    """This process's /dev/fuse descriptor (the session's), or None."""
    try:
        for name in os.listdir("/proc/self/fd"):
            try:
                if os.readlink(f"/proc/self/fd/{name}") == "/dev/fuse":
                    return int(name)
            except OSError:
                continue
    except OSError:
        pass
    return None


def _connection_alive(fd: int) -> bool:
    """Whether the kernel still serves the FUSE connection of ``fd`` (it
    reports POLLERR once the connection ended: the last mount of it gone)."""
    p = select.poll()
    p.register(fd, 0)
    return not any(ev & (select.POLLERR | select.POLLNVAL) for _, ev in p.poll(0))


def _fuse_init(ops, mountpoint: str, options) -> None:
    """``pyfuse3.init``, with what libfuse (or the fusermount3 it runs) writes
    to stderr when the mount fails taken into the RuntimeError ("fuse: failed
    to open /dev/fuse: Operation not permitted"): one line says why, also in
    a foreground daemon's log (the systemd unit's journal), where that was a
    line of its own, at priority info, before a bare "fuse_session_mount
    failed". Anything said by a mount that worked is passed on as it was."""
    with tempfile.TemporaryFile() as said:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
        saved = os.dup(2)
        os.dup2(said.fileno(), 2)
        try:
            pyfuse3.init(ops, mountpoint, options)
            failure = None
        except RuntimeError as exc:
            failure = exc
        finally:
            os.dup2(saved, 2)
            os.close(saved)
        said.seek(0)
        text = said.read()
    if failure is None:
        if text:
            os.write(2, text)
        return
    lines = [ln.strip() for ln in text.decode(errors="replace").splitlines() if ln.strip()]
    raise RuntimeError(f"{failure} ({'; '.join(lines)})" if lines else str(failure)) from None


def _unescape_mount_field(field: str) -> str:
    """/proc/self/mountinfo writes space, tab, newline and backslash as octal escapes."""
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), field)


def _fuse_mounts_at(mountpoint: str) -> list[tuple[str, str]]:
    """(mount ID, device) of each zshardfs mount on ``mountpoint`` that this
    process's /proc/self/mountinfo lists, the topmost last; [] if it cannot
    be read."""
    found = []
    try:
        with open("/proc/self/mountinfo", encoding="utf-8", errors="surrogateescape") as f:
            for line in f:
                fields = line.split()
                try:
                    fstype = fields[fields.index("-", 6) + 1]
                except (ValueError, IndexError):
                    continue
                if fstype == "fuse.zshardfs" and _unescape_mount_field(fields[4]) == mountpoint:
                    found.append((fields[0], fields[2]))
    except OSError:
        pass
    return found


class Mount:
    """Everything one mount owns, wired bottom-up."""

    def __init__(self, cfg: MountConfig, backend, reopen_log=None):
        self.cfg = cfg
        #: SIGHUP/SIGUSR1: open the log file anew (logrotate moved it away)
        self.reopen_log = reopen_log
        self.started = time.time()
        self.view = build_view(cfg, backend)
        self.store, self.shards, self.writeback = self.view.store, self.view.shards, self.view.writeback
        self.ops = Operations(self.view, read_only=cfg.read_only, entry_timeout=cfg.attr_timeout,
                              attr_timeout=cfg.attr_timeout, open_fill=cfg.open_fill, control=self)
        if cfg.debug:
            self.ops.trace_requests()
        # freed memory given back to the system (see memtrim)
        self.trimmer = Trimmer(self._activity, lambda: self.writeback.dirty_bytes,
                               malloc_trim() if cfg.malloc_trim == "on" else None)
        self._give_up = False  # a second SIGTERM/SIGINT: exit without storing the rest
        self.lost = False  # exited without storing everything (the exit status says so)
        self._nursery = None  # (serve's, while it runs)
        self._stopping: trio.CancelScope | None = None  # a stop (SIGTERM...) under way
        self._watching: trio.CancelScope | None = None  # an unmount ``zshardfs umount`` announced is watched for
        self._unmounted_here = False  # ended while only a copy elsewhere held the mount
        self._mount = None  # (mount ID, device) of the mount this daemon made (see serve)
        self._where = self.cfg.mountpoint  # its mount point as mountinfo names it
        #: its mount was still there after the unmount (libfuse says nothing
        #: when the fusermount3 that unmounts for a user other than root fails)
        self.left_mounted = False

    def _activity(self) -> tuple:
        """Changes whenever the mount reads, looks up, lists or stores."""
        return (self.ops.reads, self.shards.chunks.hits, self.shards.chunks.misses, self.shards.indexes.hits,
                self.shards.indexes.misses, sum(self.store.counters.values()), self.writeback.flushes,
                len(self.ops.inodes), self.ops.open_handles)

    def stats(self) -> dict:
        c = self.store.counters
        return {
            "source": self.store.url,
            "mountpoint": os.path.abspath(self.cfg.mountpoint),
            "pid": os.getpid(),
            "uptime_s": round(time.time() - self.started, 3),
            "requests": {k: c.get(k, 0) for k in ("get", "get_range", "head", "list", "put", "delete")},
            "bytes": {"read": c.get("bytes_read", 0), "written": c.get("bytes_written", 0)},
            "errors": c.get("errors", 0),
            # storage calls running (at most max_connections, ``slots``, hold a
            # slot), the deadline of a request (-o timeout), and the calls
            # given up at their deadline whose worker thread still runs
            "storage_calls": {"slots_held": self.store.limiter.borrowed_tokens,
                              "slots": int(self.store.limiter.total_tokens), "timeout_s": self.store.timeout,
                              "given_up_running": self.store.given_up_running},
            "retries": c.get("retries", 0),
            "precondition_failed": c.get("precondition_failed", 0),
            "index_cache": {"hits": self.shards.indexes.hits, "misses": self.shards.indexes.misses,
                            "entries": len(self.shards.indexes), "bytes": self.shards.indexes.bytes,
                            "max_bytes": self.shards.indexes.max_bytes,
                            "beside_bytes": self.shards.indexes.beside_bytes, "evicted": self.shards.indexes.evicted},
            "chunk_cache": {"hits": self.shards.chunks.hits, "misses": self.shards.chunks.misses,
                            "entries": len(self.shards.chunks), "bytes": self.shards.chunks.bytes,
                            "max_bytes": self.shards.chunks.max_bytes,
                            "beside_bytes": self.shards.chunks.beside_bytes, "evicted": self.shards.chunks.evicted},
            "prefetches": self.shards.prefetches,
            "read_aheads": self.shards.read_aheads,
            "inodes": len(self.ops.inodes),
            "kernel": {"reads": self.ops.reads, "open_fills": self.ops.open_fills},
            "made_dirs": sum(map(len, self.view.new_dirs.values())),
            # open file handles, and those the view keeps track of (writers,
            # and readers of chunk files, which an unlink or rename affects)
            "handles": {"open": self.ops.open_handles,
                        "tracked": sum(map(len, self.view.writers.values()))
                        + sum(map(len, self.view.readers.values()))},
            "writeback": {"dirty_shards": len(self.writeback.dirty), "dirty_bytes": self.writeback.dirty_bytes,
                          "flushes": self.writeback.flushes, "flush_errors": self.writeback.flush_errors,
                          # (first 10: zshardfs umount names them, and the way out)
                          "damaged_shards": self.writeback.damaged()[:10]},
            # the collector's permanent generation (see gcpolicy)
            "gc": {"frozen_objects": gc.get_freeze_count(), "full_collections": gc.get_stats()[2]["collections"]},
            "rss_bytes": rss_bytes(),
            "malloc_trim": {"calls": self.trimmer.trims, "returned_bytes": self.trimmer.returned},
            # entries of every table of every layer: what a long life makes grow shows here
            "tables": {**self.ops.table_sizes(), **self.view.table_sizes(), **self.shards.table_sizes(),
                       **self.writeback.table_sizes(), **self.store.table_sizes()},
        }

    def _may_sync(self, uid: int, what: str = "a sync") -> None:
        """Only the daemon's user and root may make it store now (EACCES),
        or do ``what`` else the control channel asks (reopen its log)."""
        if uid not in (0, os.getuid()):
            log_once(log, logging.INFO, f"{what} asked by uid {uid} refused: only the mount's owner "
                                        f"(uid {os.getuid()}) or root may ask it")
            raise pyfuse3.FUSEError(errno.EACCES)

    async def set(self, name: str, value: bytes, uid: int = 0) -> bool:
        """Control writes (setxattr on the root); True if ``name`` is ours.
        (Sync by setxattr is kept for older clients: the kernel holds the
        root directory's lock through a setxattr, so lookups there wait.)"""
        if name != XATTR_SYNC:
            return False
        self._may_sync(uid)
        await self._sync()
        return True

    async def _sync(self) -> None:
        """``zshardfs sync``: fails if anything could not be stored, or was
        refused (a document the stored chunks cannot live with: EPERM)."""
        refused = []
        # (every shard: rounds of FLUSH_PARALLEL, each call with its own
        # deadline; the flushes leave their failure lines to the one below)
        with no_request_deadline(), failures_logged_by_caller():
            errors = await self.view.sync(refused)
        if errors:
            # one line for the failed sync (and ``zshardfs umount``, whose
            # sync it is), not also the flush's and the getxattr's; a
            # damaged shard has had its own line (report_damage) already
            plain = [e for e in errors if not isinstance(e, CorruptData)]
            if plain:
                log_once(log, logging.ERROR, f"sync failed: {self._unstored() or 'nothing'} only in memory, "
                                             f"retried later ({plain[0]})")
            raise pyfuse3.FUSEError(errors[0].errno or errno.EIO)
        if refused:
            raise refused[0]

    async def get(self, name: str, uid: int = 0) -> bytes | None:
        """Control reads (getxattr on the root) by user ``uid``.  ``zshardfs
        sync`` reads XATTR_SYNC: a getxattr takes no lock, so the mount goes
        on answering lookups in its root while everything is stored."""
        if name == XATTR_SYNC:
            self._may_sync(uid)
            await self._sync()
            return b"stored"
        if name == XATTR_STATS:
            return json.dumps(self.stats()).encode()
        if name == XATTR_PID:
            return str(os.getpid()).encode()
        if name == XATTR_UNMOUNTING:
            self._may_sync(uid)
            if self._nursery is None or self._mount is None:
                return None  # (cannot watch: as an older daemon)
            if self._watching is None:
                self._watching = trio.CancelScope()
                self._nursery.start_soon(self._watch_unmount, self._watching)
            return b"watching"
        if name == XATTR_REOPEN_LOG:
            self._may_sync(uid, "a reopen of the log file")
            if self.reopen_log is None:
                return b"no log file"  # (stderr, syslog or the journal: nothing to reopen)
            if self.reopen_log() is False:  # (the old file, still in use, says why)
                return b"kept the old log file"
            log.info("log file reopened (zshardfs reopen-log)")
            return b"reopened"
        if name == XATTR_UNMOUNT_REFUSED:
            self._may_sync(uid)
            if self._watching is not None:
                self._watching.cancel()
                self._watching = None
            return b"not watching"
        return None

    async def _watch_unmount(self, scope: trio.CancelScope) -> None:
        """``zshardfs umount`` announces its ``fusermount3 -u`` (which only
        succeeds when nothing in its mount namespace uses the mount): once
        the mount is gone from this namespace, the kernel ends the FUSE
        connection and ``pyfuse3.main`` returns, unless a copy of the mount
        lives on in another mount namespace, made while it was mounted (by
        ``unshare -m``, a container: a private namespace copies every mount
        there is, and an unmount here does not reach it). The daemon then
        served that copy for as long as it lived, and the unmount waited its
        whole ``--timeout`` for it to end ("still running"). The owner asked
        for the end: the daemon stores what it holds and ends, as at
        SIGTERM (that copy then fails, ENOTCONN), without unmounting its
        mount point by name: something else may be mounted there by then."""
        with scope:
            await self._watch_unmount_now()
        if self._watching is scope:
            self._watching = None

    async def _watch_unmount_now(self) -> None:
        fd = _fuse_fd()
        if fd is None:
            return
        end = trio.current_time() + UNMOUNT_WATCH
        while trio.current_time() < end:
            await trio.sleep(0.05)
            if self._mount in _fuse_mounts_at(self._where):
                continue
            gone = trio.current_time()
            while trio.current_time() - gone < CONNECTION_GRACE:
                if not _connection_alive(fd):
                    return  # the usual end: pyfuse3.main returns
                await trio.sleep(0.02)
            self._unmounted_here = True
            if self._stopping is None:
                log.warning("unmounted %s, but a copy of the mount lives on in another mount namespace (made "
                            "while it was mounted: unshare -m, a container); ending as asked: storing what is "
                            "in memory, then exiting (that copy fails from now on: ENOTCONN)", self.cfg.mountpoint)
                self._begin_stop(self._nursery)
            return

    async def serve(self, ready=None) -> None:
        # SIGTERM/SIGINT are received from before the mount: one that comes
        # as soon as the mount is there (``systemctl stop`` right after a
        # start returned) is a stop like any other; it met the default
        # action, which killed the daemon and left a dead mount
        with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM, *REOPEN_SIGNALS) as signals:
            await self._serve(ready, signals)

    async def _serve(self, ready, signals) -> None:
        # (resolved before the mount: a stat of its root then would wait for
        # an answer from this very process)
        where = os.path.realpath(self.cfg.mountpoint)
        _fuse_init(self.ops, self.cfg.mountpoint, fuse_options(self.cfg))
        # (the one just made is the topmost: what must be gone after the unmount)
        made = _fuse_mounts_at(where)[-1:]
        log.info("mounted %s on %s (%s)", self.store.url, self.cfg.mountpoint, "ro" if self.cfg.read_only else "rw")
        if ready is not None:
            ready()
        self._where, self._mount = where, made[0] if made else None  # (see _watch_unmount)
        try:
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                nursery.start_soon(self._signals, nursery, signals)
                await nursery.start(self.writeback.run)
                self.shards.start(nursery)
                nursery.start_soon(self.trimmer.run)
                await pyfuse3.main()
                nursery.cancel_scope.cancel()
        except BaseException:
            log.exception("main loop failed")
            raise
        finally:
            self._nursery = None
            self.shards.start(None)  # (its nursery is closed)
            await self._final_sync()
            # (not by name when the mount here is gone: see _watch_unmount)
            pyfuse3.close(unmount=not self._unmounted_here)
            self.store.close()
            if made and made[0] in _fuse_mounts_at(where):
                self.left_mounted = True
                log.error("the unmount of %s failed (fusermount3 failed or was killed): its mount is left, dead; "
                          "remove it with 'zshardfs umount %s'", self.cfg.mountpoint, self.cfg.mountpoint)
            else:
                log.info("unmounted %s", self.cfg.mountpoint)

    def _reopen_log(self, signum: int) -> None:
        if self.reopen_log is None:  # (stderr, syslog or the journal: said, not silently ignored)
            log.info("signal %s: no log file to reopen (this mount has no -o log_file); nothing done",
                     signal.Signals(signum).name)
            return
        if self.reopen_log() is not False:  # (else the old file says why it stays)
            log.info("signal %s: log file reopened", signal.Signals(signum).name)

    async def _signals(self, nursery, signals) -> None:
        """SIGTERM/SIGINT: store everything, then unmount; the same signal
        again gives up storing (systemd sends it after TimeoutStopSec, see
        systemd/zshardfs@.service).  SIGHUP, SIGUSR1: reopen the log file."""
        async for signum in signals:
            if signum in REOPEN_SIGNALS:
                self._reopen_log(signum)
                continue
            name = signal.Signals(signum).name
            if self._stopping is None:
                log.info("signal %s: storing what is in memory, then unmounting", name)
                self._begin_stop(nursery)
            else:
                log.warning("signal %s again: exiting without storing what is left", name)
                self._give_up = True
                self._stopping.cancel()

    def _begin_stop(self, nursery) -> None:
        self._stopping = trio.CancelScope()
        nursery.start_soon(self._stop, self._stopping)

    async def _stop(self, scope: trio.CancelScope) -> None:
        with scope:
            await self._store_all("SIGTERM or SIGINT again exits without them")
        pyfuse3.terminate()

    async def _store_all(self, how_to_give_up: str) -> None:
        """Store everything still in memory, in rounds until one succeeds: a
        transient storage failure must not lose data.  One log line per
        failed round (the first as well: the flushes leave their failures to
        it); rounds 1 s apart, doubling up to 30 s."""
        delay, failed = 1.0, 0
        while True:
            with failures_logged_by_caller():
                errors = await self.view.sync(final=True)
            if not errors:
                if failed:
                    log.info("stored everything after %d failed rounds", failed)
                return
            failed += 1
            log.error("not stored yet: %s (%s); retrying in %gs, %s",
                      self._unstored(), errors[0], delay, how_to_give_up)
            await trio.sleep(delay)
            delay = min(30.0, 2 * delay)

    def _unstored(self) -> str:
        """What only memory holds, for the log ("" if nothing)."""
        chunks, shards = self.writeback.unstored()
        files = [b.key for b in self.view.buffers.values() if b.dirty and b.key is not None]
        if not chunks and not files:
            return ""
        text = f"{chunks} chunks in {shards} shards"
        return text + (f" and {len(files)} files ({', '.join(files[:5])})" if files else "")

    async def _final_sync(self) -> None:
        """Store everything still in memory before exit, retrying like a stop
        (the mount may be gone already: the data is nowhere else) until
        stored or SIGTERM/SIGINT; what is given up is logged."""
        with trio.CancelScope(shield=True):
            if not self._give_up:
                with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM, *REOPEN_SIGNALS) as signals:
                    async with trio.open_nursery() as nursery:
                        async def give_up():
                            async for signum in signals:
                                if signum in REOPEN_SIGNALS:
                                    self._reopen_log(signum)
                                    continue
                                log.warning("signal %s: exiting without storing what is left",
                                            signal.Signals(signum).name)
                                nursery.cancel_scope.cancel()

                        nursery.start_soon(give_up)
                        await self._store_all("SIGTERM or SIGINT exits without them")
                        nursery.cancel_scope.cancel()
            lost = self._unstored()
            if lost:
                self.lost = True
                keys = list(self.writeback.dirty)
                log.error("exiting without storing %s: lost (shards %s%s)", lost, ", ".join(keys[:10]),
                          ", ..." if len(keys) > 10 else "")


def run(cfg: MountConfig, ready=None, reopen_log=None) -> str:
    """Open the source, mount and serve (blocks until unmounted).  "lost" if
    it exited without storing everything written (given up at a stop),
    else "left mounted" if its unmount failed (a dead mount is left), else "ok".
    ``reopen_log()``: what SIGHUP and SIGUSR1 do (open the log file anew)."""
    # SIGHUP (a closed terminal, a log rotation's habit), SIGUSR1 (another
    # one's) and SIGUSR2 never end the daemon, whose default action they
    # are: dirty data would be lost and a dead mount left.  Also not outside
    # its signal receivers (before the mount, and between serving and the
    # final sync); within them HUP and USR1 reopen the log file, which is
    # also reopened by itself at its next line once rotated
    for signum in (*REOPEN_SIGNALS, *IGNORED_SIGNALS):
        signal.signal(signum, signal.SIG_IGN)
    if cfg.malloc_trim == "on":
        limit_arenas()  # (before the backend's first threads: see memtrim)
    backend = open_backend(cfg)
    mount = Mount(cfg, backend, reopen_log=reopen_log)
    gcpolicy.install()  # (short collector pauses with a big inode table)
    trio.run(mount.serve, ready)
    return "lost" if mount.lost else "left mounted" if mount.left_mounted else "ok"


__all__ = ["ConfigError", "Mount", "StoreError", "XATTR_PID", "XATTR_REOPEN_LOG", "XATTR_STATS", "open_backend", "run"]
