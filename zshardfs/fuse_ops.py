"""pyfuse3 operations: inodes, handles and errno, nothing else.

Translates kernel requests into calls on the :class:`~zshardfs.view.View`.

Inode invariants:
- An inode number names one virtual path for as long as the kernel holds a
  lookup count on it (or a handle is open); it is never reused for another
  path while alive.  ``forget`` drops entries whose count reaches zero, so
  the table is bounded by what the kernel caches, not by the store.
  Numbers increase in the order paths are first seen (listing order), and a
  recently forgotten path gets its number back (see ``_inode_for``).
- ``readdir`` offsets index a per-handle snapshot that is filled lazily, so a
  listing resumed at any offset neither skips nor repeats entries.  Every
  listing starts with ``.`` and ``..`` (offsets 1 and 2), which take no
  lookup count (the kernel does not count them either).

Every handler goes through :func:`_translate`: a storage error becomes its
errno and at most one log line; an unexpected bug becomes EIO and one
traceback in the log, never a dead daemon.  It also gives the request one
deadline, ``-o timeout`` from its start, which all its storage calls share.
"""

from __future__ import annotations

import dataclasses
import errno
import functools
import logging
import os
import stat
import sys
import time
from collections import OrderedDict, deque
from dataclasses import dataclass, field

import pyfuse3
import trio

from .backends.base import CorruptData, StoreError, end_request
from .logonce import log_once, report_damage
from .view import Changed, Handle, Node, View, ViewError

log = logging.getLogger(__name__)

#: forgotten paths whose inode numbers are kept for their next lookup
REMEMBERED_INODES = 1 << 16

#: Node.created of a node written through a handle since (re-asked at open)
_STALE = float("-inf")

#: readdir offsets of ``.`` and ``..``, listed before a directory's entries
_DOTS = 2

#: renameat2's flag (linux/fs.h) the mount honours: EEXIST if the new name is
#: taken; RENAME_EXCHANGE and RENAME_WHITEOUT are EINVAL
_RENAME_NOREPLACE = 1

#: open flags that ask for writing
_WRITING = os.O_WRONLY | os.O_RDWR

#: what os.fsencode encodes names with
_FS_ENCODING, _FS_ERRORS = sys.getfilesystemencoding(), sys.getfilesystemencodeerrors()


def _log_once(level: int, msg: str) -> None:
    """One log line per distinct message per minute: a damaged shard read a
    thousand times is one line, not a thousand (shared with the layouts'
    listings, see logonce.py)."""
    log_once(log, level, msg)


def _translate(fn):
    @functools.wraps(fn)
    async def wrapper(self, *args, **kwargs):
        token = self._begin_request()  # (one -o timeout for the whole request)
        try:
            return await fn(self, *args, **kwargs)
        except pyfuse3.FUSEError:
            raise
        except CorruptData as exc:
            report_damage(log, exc)
            raise pyfuse3.FUSEError(errno.EIO) from None
        except ViewError as exc:
            # the answer to the request (ENOTEMPTY, EXDEV, EEXIST...), not a
            # failure; refusals worth a word are logged where they are made
            log.debug("%s: %s", fn.__name__, exc)
            raise pyfuse3.FUSEError(exc.errno) from None
        except StoreError as exc:
            if exc.errno not in (errno.ENOENT,) and not getattr(exc, "logged", False):
                # (a flush's failure has had its line, writeback: not one more per request meeting it)
                _log_once(logging.ERROR, f"{fn.__name__}: {exc}")
            raise pyfuse3.FUSEError(exc.errno or errno.EIO) from None
        except Exception:
            log.exception("%s failed unexpectedly", fn.__name__)
            raise pyfuse3.FUSEError(errno.EIO) from None
        finally:
            end_request(token)
            if self.view.removed_here or self.view.datasets_gone:
                await self._forget_removed_here(fn.__name__, args)

    return wrapper


#: request kind -> (positions of its arguments that are inodes, of those
#: that are directory handles): the directories whose locks the kernel
#: holds while it waits for the answer (see _forget_removed_here)
_HELD_ARGS: dict[str, tuple[tuple[int, ...], tuple[int, ...]]] = {
    "lookup": ((0,), ()), "getattr": ((0,), ()), "opendir": ((0,), ()), "open": ((0,), ()),
    "getxattr": ((0,), ()), "setxattr": ((0,), ()), "removexattr": ((0,), ()), "readlink": ((0,), ()),
    "create": ((0,), ()), "setattr": ((0,), ()), "unlink": ((0,), ()), "mkdir": ((0,), ()),
    "rmdir": ((0,), ()), "mknod": ((0,), ()), "symlink": ((0,), ()),
    "rename": ((0, 2), ()), "link": ((0, 1), ()),
    "readdir": ((), (0,)), "fsyncdir": ((), (0,)),
}


# -- ``-o debug``: one log line per request ------------------------------------

request_log = logging.getLogger("zshardfs.requests")

#: the pyfuse3 handlers worth tracing (all of them but init/destroy)
TRACED = ("lookup", "forget", "getattr", "setattr", "readlink", "mknod", "mkdir", "unlink", "rmdir", "symlink",
          "rename", "link", "open", "read", "write", "flush", "release", "fsync", "opendir", "readdir",
          "releasedir", "fsyncdir", "statfs", "setxattr", "getxattr", "listxattr", "removexattr", "access",
          "create")


#: handlers whose bytes are a file's contents (READ's answer, WRITE's
#: data): logged by their size only, never as text (the log may be read by
#: others than those who may read the files)
CONTENTS = frozenset({"read", "write"})


def _show(value, contents: bool = False) -> str:
    if isinstance(value, (bytes, bytearray, memoryview)):
        if len(value) <= 255 and not contents:  # a name, or a short xattr value
            try:
                text = bytes(value).decode("utf-8")
            except UnicodeDecodeError:
                text = None
            if text is not None and text.isprintable():
                return repr(text)
        return f"<{len(value)} bytes>"
    if isinstance(value, pyfuse3.EntryAttributes):
        return f"ino={value.st_ino} mode={value.st_mode:o} size={value.st_size}"
    if isinstance(value, pyfuse3.FileInfo):
        return f"fh={value.fh}"
    if isinstance(value, (pyfuse3.RequestContext, pyfuse3.ReaddirToken, pyfuse3.StatvfsData)):
        return type(value).__name__
    text = repr(value)
    return text if len(text) <= 200 else text[:200] + "..."


def _traced(name: str, handler):
    async def traced(*args):
        contents = name in CONTENTS
        shown = ", ".join(_show(a, contents) for a in args if not isinstance(a, pyfuse3.RequestContext))
        started = time.monotonic()  # (the time shown: which request waited, and how long)
        try:
            result = await handler(*args)
        except pyfuse3.FUSEError as exc:
            request_log.debug("%s(%s) -> %s in %.1f ms", name, shown, errno.errorcode.get(exc.errno, exc.errno),
                              1000 * (time.monotonic() - started))
            raise
        except BaseException as exc:
            request_log.debug("%s(%s) -> %s in %.1f ms", name, shown, type(exc).__name__,
                              1000 * (time.monotonic() - started))
            raise
        request_log.debug("%s(%s) -> %s in %.1f ms", name, shown, _show(result, contents),
                          1000 * (time.monotonic() - started))
        return result

    traced.__name__ = name
    return traced


@dataclass
class _Inode:
    node: Node
    lookups: int = 0
    handles: int = 0
    #: (size, mtime) of the bytes last put in the kernel's page cache at open:
    #: the kernel keeps them (keep_cache) until it sees either change, or
    #: drops them under memory pressure, which a READ then shows (see read)
    filled: tuple | None = None
    #: Handle.kernel_has of those bytes: a handle opened while the kernel
    #: holds them is served from them as well
    kernel_has: tuple | None = None
    #: the attributes last given for this inode, and the (is_dir, size,
    #: mtime) they were made of: a listing gives them again (never changed
    #: after they are made, so sharing them is safe)
    attrs: pyfuse3.EntryAttributes | None = None
    attrs_of: tuple | None = None
    #: the chunk node they were last given for (a listing giving that very
    #: node again, View._listed_slices, is answered without looking further)
    attrs_for: Node | None = None
    #: monotonic time a change made through this mount (rename, create) set
    #: ``node``: a lookup or listing begun before then brings older news,
    #: which must not replace it (see _inode_for)
    changed: float = 0.0


class _MovedAway:
    """The places directories were renamed away from since ``since`` (of
    Operations._moved_from), gathered once for the entries of a listing's
    batch made then: each entry is then checked in constant time, not
    against every rename since (up to 1024, for each entry of a batch of
    thousands: seconds of the event loop)."""

    def __init__(self, moved_from, since: float):
        self.since, self.last = since, moved_from[-1]
        self.old: set[str] = set()
        for when, old in reversed(moved_from):
            if when < since:
                break
            self.old.add(old)
        self._parents: dict[str, bool] = {}  # directory -> at or below an old place

    def holds(self, since: float, last) -> bool:
        """Made for these entries, and no directory renamed since it was?"""
        return since == self.since and last is self.last

    def moved(self, path: str) -> bool:
        """Was ``path`` at or below a place renamed away?"""
        if path in self.old:
            return True
        parent = path.rpartition("/")[0]
        if not parent:
            return False
        known = self._parents.get(parent)
        if known is None:
            known = self._parents[parent] = self.moved(parent)
        return known


class _PathTable(dict):
    """Operations.by_path (path -> inode) that also keeps, for each
    directory, its children it holds (or that lead to one it holds): the
    entries at or below a directory are found in time proportional to
    their number (:meth:`below`), not by scanning every inode the kernel
    holds.  Reads are the plain dict's; only adding and removing a path
    keep the children (``__setitem__``, ``__delitem__``, ``pop``: the only
    changes Operations makes; and _ForgottenTable's ``popitem``)."""

    def __init__(self, items=()):
        super().__init__()
        self._kids: dict[str, set[str]] = {}
        for path, ino in dict(items).items():
            self[path] = ino

    def __setitem__(self, path: str, ino: int) -> None:
        new = path not in self
        super().__setitem__(path, ino)
        if new:
            self._link(path)

    def __delitem__(self, path: str) -> None:
        super().__delitem__(path)
        self._unlink(path)

    def pop(self, path: str, *default):
        if path not in self:
            return super().pop(path, *default)
        ino = self[path]
        del self[path]  # (the index kept by __delitem__ alone, whichever base is under it)
        return ino

    def _unsupported(self, *args, **kwargs):
        raise NotImplementedError("_PathTable: use [] =, del or pop")

    popitem = clear = setdefault = update = __ior__ = _unsupported

    def _link(self, path: str) -> None:
        kids = self._kids
        while path:
            parent = path.rpartition("/")[0]
            siblings = kids.get(parent)
            if siblings is not None:
                siblings.add(path)
                return
            kids[parent] = {path}
            if parent in self:  # (else the parent is linked in turn, as on the way to a path held)
                return
            path = parent

    def _unlink(self, path: str) -> None:
        kids = self._kids
        while path and path not in kids and path not in self:
            parent = path.rpartition("/")[0]
            siblings = kids[parent]
            siblings.discard(path)
            if siblings:
                return
            del kids[parent]
            path = parent

    def below(self, path: str) -> list[tuple[str, int]]:
        """(path, inode) of ``path`` and of every path held below it."""
        out, todo = [], [path]
        while todo:
            p = todo.pop()
            ino = self.get(p)
            if ino is not None:
                out.append((p, ino))
            todo.extend(self._kids.get(p, ()))
        return out


class _ForgottenTable(_PathTable, OrderedDict):
    """Operations._forgotten (path -> inode number kept after the kernel
    forgot it, oldest first, at most REMEMBERED_INODES): the same index of
    children as by_path (:meth:`below`, for a directory's rename), and
    :meth:`popitem` (the oldest first) keeps it in step."""

    def popitem(self, last: bool = True) -> tuple[str, int]:
        path = next(reversed(self)) if last else next(iter(self))
        ino = self[path]
        del self[path]
        return path, ino


@dataclass
class _DirHandle:
    inode: int
    source: object  # async iterator of lists of Nodes (View.listdir_batches)
    entries: list = field(default_factory=list)
    done: bool = False
    # the listing failed: later readdirs on this handle fail alike (a listing
    # that ended early would otherwise look complete)
    failed: Exception | None = None


class Operations(pyfuse3.Operations):
    supports_dot_lookup = False
    enable_writeback_cache = False

    def __init__(self, view: View, *, read_only: bool = True, entry_timeout: float = 1.0,
                 attr_timeout: float = 1.0, uid: int | None = None, gid: int | None = None,
                 open_fill: int = 0, control=None):
        super().__init__()
        # (a kernel notification waits for the inode's pages, which a READ in
        # flight holds until the event loop answers it: sent from a thread)
        self._notify_limiter = trio.CapacityLimiter(1)
        # (_forget_removed_here's: its thread waits for the locks of the
        # entries' directories, and is left running after 2 s; sharing the
        # one above, a request holding such a lock and then waiting for that
        # limiter -- a rename replacing an open file -- waited for ever)
        self._entries_limiter = trio.CapacityLimiter(1)
        self.open_fill = open_fill
        #: READ requests served, and opens that filled the page cache instead
        self.reads = self.open_fills = 0
        self.control = control  # async .get(name, uid) / .set(name, value, uid): xattrs of the root
        self.view = view
        self._begin_request = view.store.begin_request  # (every request: one attribute, not three)
        self.read_only = read_only
        self.entry_timeout = entry_timeout
        self.attr_timeout = attr_timeout
        self.uid = os.getuid() if uid is None else uid
        self.gid = os.getgid() if gid is None else gid
        self.inodes: dict[int, _Inode] = {pyfuse3.ROOT_INODE: _Inode(view.root(), lookups=1)}
        self.by_path = _PathTable({"": pyfuse3.ROOT_INODE})
        self._next_inode = pyfuse3.ROOT_INODE + 1
        # path -> number of paths the kernel forgot, most recent last (bounded)
        self._forgotten = _ForgottenTable()
        self._handles: dict[int, _DirHandle | tuple[int, Handle]] = {}
        self._next_fh = 1
        self._dir_moves = 0  # directories renamed in storage (see lookup)
        # (when, old path) of the last directories renamed in storage: a
        # listing's entries made before one are not given for its old places
        # (see readdir)
        self._moved_from: deque[tuple[float, str]] = deque(maxlen=1024)
        w = 0 if read_only else 0o200
        self._dir_mode = stat.S_IFDIR | 0o555 | w
        self._file_mode = stat.S_IFREG | 0o444 | w

    @property
    def open_handles(self) -> int:
        """Files and directories the kernel has open (for stats)."""
        return len(self._handles)

    def table_sizes(self) -> dict[str, int]:
        """Entries of this layer's tables (``zshardfs stats --json``: a
        long-lived daemon's memory is found growing by these)."""
        return {"inodes": len(self.inodes), "by_path": len(self.by_path),
                "forgotten": len(self._forgotten), "handles": len(self._handles)}

    def trace_requests(self) -> None:
        """``-o debug``: log every kernel request and its answer (pyfuse3 looks
        handlers up on the instance, so wrapping them there is enough)."""
        for name in TRACED:
            handler = getattr(self, name, None)
            if handler is not None:
                setattr(self, name, _traced(name, handler))

    # -- inode table --------------------------------------------------------

    def _inode_for(self, node: Node, since: float | None = None) -> int:
        """The inode of ``node``'s path, creating the entry if needed (count 0).

        Numbers are handed out in increasing order as paths are first seen,
        so sorting a directory's entries by inode number gives its listing
        order: ``cp -r`` (which sorts by inode to read "in disk order") then
        walks shards in order instead of at random.  A path the kernel
        forgot gets its number back while it is among the last
        REMEMBERED_INODES forgotten ones (stable across forgets for find
        -inum, git, backup tools), and no number ever names two paths.

        ``since``: when the lookup or listing that found ``node`` began.  If a
        rename, create, truncate or a writer's close through this mount set
        the inode's node after that (a close: marked stale, asked again),
        the node kept is that newer one: the kernel would otherwise be told
        the old size for the new file (a reader then gets the new bytes cut
        to the old size, or the reverse)."""
        ino = self.by_path.get(node.path)
        if ino is not None and ino not in self.inodes:  # (forgotten while a rename moved it)
            del self.by_path[node.path]
            ino = None
        if ino is not None and self._replaced_while_open(ino, node, since):
            ino = None
        if ino is None:
            ino = self._forgotten.pop(node.path, None)
            if ino is None:
                ino = self._next_inode
                self._next_inode += 1
            self.inodes[ino] = _Inode(node)
            self.by_path[node.path] = ino
        else:
            entry = self.inodes[ino]
            if since is None or entry.changed <= since:
                entry.node = node
        return ino

    def _replaced_while_open(self, ino: int, node: Node, since: float | None = None) -> bool:
        """Is ``node`` (found at the path of ``ino``, which the kernel has
        open) another file than the one ``ino`` numbers, made by another
        client (View.replaced_by_another: a rotation's ``mv log log.1`` and
        new ``log``)?  The path then leaves ``ino``, whose descriptors keep
        it and their file's attributes (see _getattr), and gets a new number
        at its next lookup, as on a local file system: two files never show
        one number at once (``tail -F`` compares the path's with its
        descriptor's).  A file the kernel only knows by name keeps its
        number (nothing else holds the old one).  ``since``: as for
        _inode_for (older news than a change through this mount: no)."""
        entry = self.inodes[ino]
        if (entry.handles <= 0 or (since is not None and entry.changed > since)
                or not self.view.replaced_by_another(entry.node, node)):
            return False
        del self.by_path[node.path]
        return True

    def _drop_if_unused(self, ino: int) -> None:
        entry = self.inodes.get(ino)
        if entry and ino != pyfuse3.ROOT_INODE and entry.lookups <= 0 and entry.handles <= 0:
            del self.inodes[ino]
            path = entry.node.path
            if self.by_path.get(path) == ino:
                del self.by_path[path]
                self._forgotten[path] = ino
                if len(self._forgotten) > REMEMBERED_INODES:
                    self._forgotten.popitem(last=False)

    def _node(self, ino: int) -> Node:
        entry = self.inodes.get(ino)
        if entry is None:
            raise pyfuse3.FUSEError(errno.ESTALE)
        return entry.node

    def _attrs(self, ino: int, node: Node) -> pyfuse3.EntryAttributes:
        # asked for every lookup and every readdir entry: made once per
        # inode and state; constants are precomputed, and fields left at
        # their zero default are not set
        entry = self.inodes.get(ino)
        made_of = (node.is_dir, node.size, node.mtime_ns, node.link is not None)
        if entry is not None and entry.attrs_of == made_of:
            if node.target is not None:  # (a chunk node: its attributes' fields never change)
                entry.attrs_for = node
            return entry.attrs
        a = pyfuse3.EntryAttributes()
        a.st_ino = ino
        # (a file another's unlink removes, a mesh's fragment data: looked up
        # again at each use, else the kernel shows it for entry_timeout after
        # that unlink, stat finding a file whose open is ENOENT)
        a.entry_timeout = 0 if node.target is not None and self.view.goes_with_another(node) else self.entry_timeout
        a.attr_timeout = self.attr_timeout
        if node.is_dir:
            a.st_mode = self._dir_mode
            a.st_nlink = 2
        elif node.link is not None:  # (as every file system shows a link: its permissions are never checked)
            a.st_mode = stat.S_IFLNK | 0o777
            a.st_nlink = 1
        else:
            a.st_mode = self._file_mode
            a.st_nlink = 1
        size = node.size
        a.st_size = size
        a.st_blksize = 1 << 17
        a.st_blocks = (size + 511) // 512
        a.st_uid = self.uid
        a.st_gid = self.gid
        a.st_atime_ns = a.st_mtime_ns = a.st_ctime_ns = node.mtime_ns
        if entry is not None:
            entry.attrs, entry.attrs_of = a, made_of
            entry.attrs_for = node if node.target is not None else None
        return a

    # -- lookups ------------------------------------------------------------

    @_translate
    async def lookup(self, parent_inode, name, ctx=None):
        started = time.monotonic()
        for _ in range(64):
            parent, moves = self._node(parent_inode), self._dir_moves
            node = await self.view.lookup(parent, os.fsdecode(name))
            if self._dir_moves == moves:
                break
            # a directory was renamed while the view looked: what it found
            # may be at the old path, whose key is gone (an open of it would
            # store under the old key and make the old directory again), or
            # the parent (moved: the kernel's parent inode) now has another
            # path; asked again from the parent's node as it is now
        else:
            raise pyfuse3.FUSEError(errno.ESTALE)
        if node is None:
            raise pyfuse3.FUSEError(errno.ENOENT)
        ino = self._inode_for(node, since=started)
        entry = self.inodes[ino]
        attrs = self._attrs(ino, entry.node)
        if entry.node.created == _STALE:  # (a writer closed it since the lookup began)
            attrs = await self._current_attrs(ino, attrs)
            if self.inodes.get(ino) is not entry:  # (forgotten meanwhile: as found)
                ino = self._inode_for(node, since=started)
                entry = self.inodes[ino]
                attrs = self._attrs(ino, entry.node)
        entry.lookups += 1
        return attrs

    async def forget(self, inode_list):
        for ino, nlookup in inode_list:
            entry = self.inodes.get(ino)
            if entry is None:
                continue
            entry.lookups -= nlookup
            self._drop_if_unused(ino)

    @_translate
    async def getattr(self, inode, ctx=None):
        return await self._getattr(inode)

    async def _current_attrs(self, ino: int, fallback: pyfuse3.EntryAttributes) -> pyfuse3.EntryAttributes:
        """For a lookup or listing whose inode kept a node marked stale (a
        writer's close, a read that found it changed: newer news than what the
        lookup or listing began with, see _inode_for): the attributes the view
        gives now, as getattr asks.  That node's size is the one before the
        writes, and the kernel takes it from the reply (readdirplus, lookup) when
        the WRITEs ended before the request was sent, which they did: RELEASE
        comes after close(2) returned.  ``fallback`` if storage cannot say."""
        try:
            return await self._getattr(ino)
        except (StoreError, CorruptData, ViewError, pyfuse3.FUSEError) as exc:
            log.debug("attributes of %d for a lookup or listing: %s", ino, exc)
            return fallback

    async def _getattr(self, inode):
        node = self._node(inode)
        if self.by_path.get(node.path) != inode and not node.is_dir:
            # unlinked or replaced while open for writing: its writers write
            # to the old file (view._detach_writers), whose size is theirs
            # (else the kernel would cut their reads at the size it had)
            own = self._detached_size(inode)
            if own is not None:
                return self._attrs(inode, dataclasses.replace(node, size=own))
        if node.is_chunk and self.by_path.get(node.path) != inode:
            # a chunk file replaced (rename onto its name) or unlinked while
            # open: its descriptors read what it held (view._keep_for_readers),
            # so its size stays that; the name's new file is another inode.
            # (A plain file's open descriptors read the name's newest version
            # this mount wrote, so its size follows the name.)
            return self._attrs(inode, node)
        if not node.is_dir and node.link is None and self.by_path.get(node.path) != inode:
            # a plain file replaced (a rename onto its name) while open: its
            # descriptors read the name's newest version this mount wrote
            # (view.read), so that is its size, asked again at each read past
            # it (the name may change again, and no request tells this inode)
            live = self.view.in_memory(node)
            attrs = self._attrs(inode, live if live is not None else self.view.newest_own(node))
            attrs.attr_timeout = 0
            return attrs
        if not node.is_dir:
            # Written data lives in memory: its size is known without I/O and
            # must not wait for the attribute TTL (the kernel asks right after
            # each write, then reads only that many bytes).  Not kept in the
            # table: the memory state ends with a flush or a refusal.
            live = self.view.in_memory(node)
            if live is not None:
                return self._attrs(inode, live)
            if time.monotonic() - node.created > self.attr_timeout:
                fresh = await self.view.refresh(node)
                entry = self.inodes.get(inode)
                if entry is not None and entry.node is not node:
                    # the inode took another node while the refresh was out
                    # (a truncate, a rename, a lookup): newer news than what
                    # the refresh began with, which must not replace it
                    return await self._getattr(inode)
                if fresh is not None and entry is not None and self.by_path.get(node.path) == inode \
                        and self._replaced_while_open(inode, fresh):
                    # (the open file keeps its attributes; the kernel looks
                    # the path up again, and finds the new file's number)
                    parent, _, name = node.path.rpartition("/")
                    parent_inode = self.by_path.get(parent)
                    if parent_inode is not None:
                        self._in_doubt((parent_inode, name.encode(_FS_ENCODING, _FS_ERRORS)))
                    return await self._getattr(inode)
                if fresh is not None and entry is not None:
                    node = entry.node = fresh
            elif node.target is None and node.link is None:
                # a version this mount stored since the node was learnt: a
                # truncate's (or close's) store whose own answer, asked of
                # storage after it, is still out; the node's size is older
                # than the buffer's the stats before answered
                node = self.view.newest_own(node)
        return self._attrs(inode, node)

    # -- directories --------------------------------------------------------

    @_translate
    async def opendir(self, inode, ctx):
        node = self._node(inode)
        if not node.is_dir:
            raise pyfuse3.FUSEError(errno.ENOTDIR)
        fh = self._next_fh
        self._next_fh += 1
        self._handles[fh] = _DirHandle(inode, self.view.listdir_batches(node).__aiter__())
        self.inodes[inode].handles += 1
        return fh

    def _dots(self, handle: _DirHandle) -> list[tuple[bytes, pyfuse3.EntryAttributes]]:
        """``.`` and ``..`` of a listing (the root's ``..`` is the root), as
        every file system lists them first.  Only their numbers and type
        matter: the kernel takes no lookup count from them (it does not link
        them, fuse_direntplus_link), so neither does this table."""
        here = self.inodes[handle.inode].node.path if handle.inode in self.inodes else ""
        up = self._number_of(here.rpartition("/")[0]) if here else pyfuse3.ROOT_INODE
        out = []
        for name, ino in ((b".", handle.inode), (b"..", up)):
            a = pyfuse3.EntryAttributes()
            a.st_ino, a.st_mode, a.st_nlink = ino, self._dir_mode, 2
            out.append((name, a))
        return out

    def _number_of(self, path: str) -> int:
        """The inode number ``path`` has, or gets at its next lookup (kept
        with the forgotten paths' numbers), without an entry in the table."""
        ino = self.by_path.get(path)
        if ino is not None and ino in self.inodes:
            return ino
        ino = self._forgotten.get(path)
        if ino is None:
            ino = self._forgotten[path] = self._next_inode
            self._next_inode += 1
            if len(self._forgotten) > REMEMBERED_INODES:
                self._forgotten.popitem(last=False)
        return ino

    @_translate
    async def readdir(self, fh, start_id, token):
        handle = self._handles[fh]
        if start_id < _DOTS:  # (offsets 1 and 2 follow them; a listed entry i has offset i + 3)
            for i, (name, attrs) in enumerate(self._dots(handle)[start_id:], start_id):
                if not pyfuse3.readdir_reply(token, name, attrs, i + 1):
                    return
            start_id = _DOTS
        entries = handle.entries
        inodes, by_path = self.inodes, self.by_path
        i = start_id - _DOTS
        away: _MovedAway | None = None
        while True:
            while i >= len(entries) and not handle.done:
                if handle.failed is not None:  # (a fresh error: re-raising one object grows its traceback)
                    raise pyfuse3.FUSEError(getattr(handle.failed, "errno", None) or errno.EIO)
                try:
                    asked = time.monotonic()
                    entries.extend([(child, asked) for child in await handle.source.__anext__()])
                except StopAsyncIteration:
                    handle.done = True
                except Exception as exc:
                    handle.failed = exc
                    raise
            if i >= len(entries):
                return
            listed, asked = entries[i]
            if self._moved_from and self._moved_from[-1][0] >= asked and (
                    away if away is not None and away.holds(asked, self._moved_from[-1])
                    else (away := _MovedAway(self._moved_from, asked))).moved(listed.path):
                # listed before a directory's rename moved it away: given, its
                # inode would name the old place, where the kernel would hold a
                # directory that is gone (a mkdir in it would make it again)
                i += 1
                continue
            ino = by_path.get(listed.path)
            entry = inodes.get(ino) if ino is not None else None
            if entry is not None and entry.attrs_for is listed and entry.node is listed:
                # the node the kernel was last given for this inode, listed
                # again (a warm walk): nothing to update, attributes as given
                node, attrs = listed, entry.attrs
            else:
                ino = self._inode_for(listed, since=asked)
                entry = inodes[ino]
                node = entry.node
                attrs = self._attrs(ino, node)
                if node.created == _STALE:  # (a writer closed it since the listing began)
                    attrs = await self._current_attrs(ino, attrs)
                    if inodes.get(ino) is not entry:  # (forgotten meanwhile: as listed)
                        ino = self._inode_for(listed, since=asked)
                        entry = inodes[ino]
                        node = entry.node
                        attrs = self._attrs(ino, node)
                    node = entry.node
            # (os.fsencode(node.name), without its two Python calls: every entry of every listing)
            name = node.path.rpartition("/")[2].encode(_FS_ENCODING, _FS_ERRORS)
            if not pyfuse3.readdir_reply(token, name, attrs, i + 1 + _DOTS):
                self._drop_if_unused(ino)
                return
            entry.lookups += 1
            i += 1

    async def releasedir(self, fh):
        handle = self._handles.pop(fh, None)
        if handle is not None:
            entry = self.inodes.get(handle.inode)
            if entry:
                entry.handles -= 1
                self._drop_if_unused(handle.inode)
            aclose = getattr(handle.source, "aclose", None)
            if aclose is not None:
                try:
                    await aclose()
                except Exception:  # pragma: no cover - closing a generator
                    pass

    # -- files --------------------------------------------------------------

    def _new_fh(self, inode: int, handle: Handle) -> int:
        fh = self._next_fh
        self._next_fh += 1
        self._handles[fh] = (inode, handle)
        self.inodes[inode].handles += 1
        return fh

    def _detached_size(self, inode: int) -> int | None:
        """Size of the file a handle open for writing on ``inode`` holds,
        once no name leads to that inode (unlinked, or replaced by a rename)."""
        entry = self.inodes.get(inode)
        if entry is None or not entry.handles:
            return None
        for value in self._handles.values():  # (rare: only such inodes ask)
            if not isinstance(value, tuple) or value[0] != inode or not value[1].writable:
                continue
            handle = value[1]
            if handle.buffer is not None:
                return len(handle.buffer.data)
            if handle.chunk is not None and handle.chunk.data is not None:
                return len(handle.chunk.data)
        return None

    def _handle(self, fh: int) -> Handle:
        entry = self._handles.get(fh)
        if entry is None or not isinstance(entry, tuple):
            raise pyfuse3.FUSEError(errno.EBADF)
        return entry[1]

    @_translate
    async def open(self, inode, flags, ctx):
        entry = self.inodes.get(inode)
        if entry is None:
            raise pyfuse3.FUSEError(errno.ESTALE)
        node = entry.node
        if node.is_dir:
            raise pyfuse3.FUSEError(errno.EISDIR)
        if self.by_path.get(node.path) != inode:
            # Replaced (a rename onto its name: temp+rename writers) since the
            # kernel found it: what the view shows at that name is the new
            # file, whose bytes this inode's size does not describe.  ESTALE
            # makes the kernel look the name up afresh and open again (the
            # VFS retries an open once with LOOKUP_REVAL), where a local file
            # system would open the old file, which no longer exists here.
            raise pyfuse3.FUSEError(errno.ESTALE)
        if node.created == _STALE:  # written through a handle since: what is it now?
            fresh = await self.view.refresh(node)
            if entry.node is node:  # (else newer news came meanwhile: see getattr)
                entry.node = fresh or node
            node = entry.node
        elif not flags & _WRITING:
            # The common open (a warm `cat` is OPEN and RELEASE per file):
            # nothing was awaited since the checks above, and open_reader
            # never waits, so no other request ran in between and the
            # re-checks after the general path's await below are moot.
            handle = self.view.open_reader(node)
            if 0 < node.size <= self.open_fill and entry.handles == 0 and entry.filled != (node.size, node.mtime_ns):
                await self._fill_page_cache(inode, entry, handle)
                return pyfuse3.FileInfo(fh=self._new_fh(inode, handle), keep_cache=True)
            if entry.filled is not None and entry.filled == (node.size, node.mtime_ns):
                handle.kernel_has = entry.kernel_has
            fh = self._next_fh
            self._next_fh = fh + 1
            self._handles[fh] = (inode, handle)
            entry.handles += 1
            return pyfuse3.FileInfo(fh=fh, keep_cache=True)
        write = bool(flags & _WRITING)
        if write and self.read_only:
            raise pyfuse3.FUSEError(errno.EROFS)
        handle = await self.view.open(node, write=write, truncate=bool(flags & os.O_TRUNC))
        handle.append = write and bool(flags & os.O_APPEND)
        if self.by_path.get(node.path) != inode or inode not in self.inodes:
            await self.view.release(handle)  # replaced while it was opened (see above)
            raise pyfuse3.FUSEError(errno.ESTALE)
        entry = self.inodes[inode]
        if (not write and 0 < node.size <= self.open_fill and entry.handles == 0
                and entry.filled != (node.size, node.mtime_ns)):
            await self._fill_page_cache(inode, entry, handle)
        elif not write and entry.filled is not None and entry.filled == (node.size, node.mtime_ns):
            handle.kernel_has = entry.kernel_has
        elif write and flags & os.O_APPEND:
            await self._show_grown_end(inode, entry, handle)
            if self.by_path.get(node.path) != inode or self.inodes.get(inode) is not entry:
                await self.view.release(handle)  # (replaced while the kernel was told: as above)
                raise pyfuse3.FUSEError(errno.ESTALE)
        # The page cache stays valid across opens: content only changes with
        # the shard's version (through this mount, or noticed by mtime/size).
        return pyfuse3.FileInfo(fh=self._new_fh(inode, handle), keep_cache=True)

    async def _show_grown_end(self, inode: int, entry: _Inode, handle: Handle) -> None:
        """An open for appending of a file another client made longer since
        the kernel learned its size: the kernel appends at the end it knows
        (it does not ask again before an ``O_APPEND`` write), which would
        overwrite the other client's last bytes.  Tell it the new end: drop
        what it holds of the file, and store the last page of what the file
        holds now, which moves its size there (``notify_store`` grows it).
        With another handle of the file open, from a thread (see
        ``_notify_limiter``): a READ of it in flight holds the pages.  (A
        file made shorter cannot be told so: View.write appends at its end.)"""
        data = handle.buffer.data if handle.buffer is not None else handle.chunk.data if handle.chunk is not None else None
        told = entry.attrs.st_size if entry.attrs is not None else entry.node.size
        if not data or len(data) <= told:
            return
        start = (len(data) - 1) // 4096 * 4096
        tail = bytes(data[start:])

        def notify():
            pyfuse3.invalidate_inode(inode)
            pyfuse3.notify_store(inode, start, tail)

        try:
            if entry.handles == 0:
                notify()  # (no READ can be in flight: nothing holds the pages)
            else:
                await trio.to_thread.run_sync(notify, limiter=self._notify_limiter)
        except OSError as exc:
            log.debug("notify of the end of %d: %s", inode, exc)
            return
        entry.filled = entry.kernel_has = None

    async def _fill_page_cache(self, inode: int, entry: _Inode, handle: Handle) -> None:
        """Hand a small file's bytes to the kernel while it waits for OPEN.

        The reader's ``read`` then hits the page cache: one FUSE round trip
        less per file (a chunk file is almost always read whole right after
        it is opened; the kernel's read-ahead would fetch all of a small
        file at the first read anyway).

        Deadlock-free by construction: ``notify_store`` locks the inode's
        pages, and only a READ in flight holds them; no READ can be in
        flight for an inode that has no open handle (this opener waits for
        our reply).  Other opens may complete while the bytes are fetched,
        so the check is repeated after that wait, and nothing is awaited
        between it and the (synchronous) ``notify_store``.  Errors are not
        the open's: the READ that follows reports them.
        """
        node = handle.node
        if self.view.in_memory(node) is not None:
            return  # being written: the size the kernel knows may differ
        version = self.view.chunk_version(node)  # (before the read: a change of ours meanwhile skips the check)
        try:  # one byte more than the kernel knows of: a grown file shows
            data = await self.view.read(handle, 0, node.size + 1)
        except Changed:
            data = None
        except (StoreError, CorruptData):
            return
        if data is None or len(data) != node.size:
            # Another client replaced it since the kernel was given its size:
            # the kernel's attributes and pages are of the old version, and a
            # read would get the new bytes cut to the old size.  Tell the
            # kernel what it is now (safe here for the reason above).
            data = await self._renew(inode, entry, handle)
            if data is None:
                return
            node = handle.node
            version = None  # (renewed: no check, as before)
        if len(data) != node.size or entry.handles or self.inodes.get(inode) is not entry:
            return  # changed under us, or another open got in while we waited
        try:
            pyfuse3.notify_store(inode, 0, data)
        except OSError as exc:  # the kernel dropped the inode meanwhile, or no support
            log.debug("notify_store(%d): %s", inode, exc)
            return
        entry.filled = (node.size, node.mtime_ns)
        entry.kernel_has = handle.kernel_has = self.view.kernel_holds(data, version)
        self.open_fills += 1
        self.view.handed_to_kernel(node)

    async def _renew(self, inode: int, entry: _Inode, handle: Handle) -> bytes | None:
        """The current version of an opened file whose stored content changed
        since the kernel learned its size: the table and the handle take it,
        the kernel forgets its attributes and pages; its bytes if small
        enough to fill the page cache with (None otherwise)."""
        began = entry.node
        try:
            fresh = await self.view.refresh(handle.node)
        except StoreError:
            return None
        if fresh is None or entry.handles or self.inodes.get(inode) is not entry or entry.node is not began:
            return None  # (the inode took another node meanwhile, a truncate's: newer news, see getattr)
        entry.node = handle.node = fresh
        entry.filled = entry.kernel_has = None
        try:
            pyfuse3.invalidate_inode(inode)
        except OSError as exc:
            log.debug("invalidate_inode(%d): %s", inode, exc)
        if not 0 < fresh.size <= self.open_fill:
            return None
        try:
            return await self.view.read(handle, 0, fresh.size + 1)
        except (StoreError, CorruptData):
            return None

    @_translate
    async def read(self, fh, off, size):
        self.reads += 1
        entry = self._handles.get(fh)
        if entry is None or not isinstance(entry, tuple):
            raise pyfuse3.FUSEError(errno.EBADF)
        inode, handle = entry
        ino = self.inodes.get(inode)
        if ino is not None:
            # A filled file's reads are answered by the page cache: a READ
            # means the kernel dropped (some of) those pages, so the next
            # open fills them again instead of leaving every read of that
            # open to a request (unless this READ gives it all back: below).
            ino.filled = ino.kernel_has = None
        # the size the kernel holds for a chunk it reads: another client may
        # have replaced the shard since (writes of our own change the table)
        expect = (ino.node.size if ino is not None and handle.node.is_chunk and not handle.writable
                  and ino.node.created != _STALE else None)
        version = self.view.chunk_version(handle.node)
        try:
            data = await self.view.read(handle, off, size, expect)
        except Changed:
            # Better EIO than the new bytes cut to the old size.  The kernel
            # forgets the attributes (no page lock involved: safe while this
            # READ is in flight) and the next getattr asks the view again.
            if ino is not None:
                ino.node = dataclasses.replace(ino.node, created=_STALE)
            try:
                pyfuse3.invalidate_inode(inode, attr_only=True)
            except OSError as exc:
                log.debug("invalidate_inode(%d): %s", inode, exc)
            raise
        if (off == 0 and ino is not None and not handle.writable and self.inodes.get(inode) is ino
                and ino.node.created != _STALE and len(data) == ino.node.size > 0
                and (handle.node.size, handle.node.mtime_ns) == (ino.node.size, ino.node.mtime_ns)):
            # This one READ gave the kernel the whole file, which it keeps
            # (keep_cache): the next open need not fill it again.  Marking it
            # unfilled made every open after a page drop refill (a copy and
            # notify_store per file, a third of a warm scan's daemon CPU).
            ino.filled = (ino.node.size, ino.node.mtime_ns)
            held = handle.kernel_has
            if (held is not None and held[2] == version and held[0] == len(data)
                    and self.view.chunk_version(handle.node) == version):
                ino.kernel_has = held  # (view.read found these bytes to be the ones held: no second CRC32C)
            else:
                ino.kernel_has = self.view.kernel_holds(data, version)
            if handle.kernel_has is None:  # (its reader has this version now: the rest must be it too)
                handle.kernel_has = ino.kernel_has
        return data

    async def release(self, fh):
        # No _translate, so no request deadline (-o timeout): none is needed,
        # as nothing here waits on storage. view.release and release_reader
        # await nothing that asks it (tables, and a chunk handed to the
        # write-back, which stores it later); what a close must store is
        # stored by FLUSH, which has its deadline. Keep it so (SEMANTICS 5.5,
        # test_s3_mount.py::test_release_of_writable_handles_ends_at_once_while_the_endpoint_is_silent)
        entry = self._handles.pop(fh, None)
        if entry is None:
            return
        inode, handle = entry
        try:
            if handle.writable:
                await self.view.release(handle)
            else:  # (the common close: no coroutine to make and run)
                self.view.release_reader(handle)
        except Exception:  # release cannot report errors; flush/fsync did
            log.exception("release failed")
        ino = self.inodes.get(inode)
        if ino is not None:
            if handle.writable:  # its size may have changed: ask the view on the next getattr
                ino.node = dataclasses.replace(ino.node, created=_STALE)
                ino.changed = time.monotonic()  # (lookups and listings begun before bring older news)
            ino.handles -= 1
            if ino.handles <= 0 and ino.lookups <= 0:  # (the kernel still knows the name: nothing to drop)
                self._drop_if_unused(inode)

    @_translate
    async def statfs(self, ctx):
        """The storage's own figures (a local store's file system); for S3,
        which has no capacity, large constant ones."""
        s = pyfuse3.StatvfsData()
        s.f_namemax = 255
        real = await self.view.statfs()
        if real is None:
            s.f_bsize = s.f_frsize = 4096
            s.f_blocks = s.f_bfree = s.f_bavail = 1 << 30
            s.f_files = s.f_ffree = s.f_favail = 1 << 30
            return s
        s.f_bsize, s.f_frsize = real.f_bsize, real.f_frsize
        s.f_blocks, s.f_bfree, s.f_bavail = real.f_blocks, real.f_bfree, real.f_bavail
        s.f_files, s.f_ffree, s.f_favail = real.f_files, real.f_ffree, real.f_favail
        return s

    # -- control channel: xattrs of the root directory -----------------------

    @_translate
    async def getxattr(self, inode, name, ctx):
        if inode == pyfuse3.ROOT_INODE and self.control is not None:
            value = await self.control.get(os.fsdecode(name), ctx.uid)
            if value is not None:
                return value
        raise pyfuse3.FUSEError(pyfuse3.ENOATTR)

    async def listxattr(self, inode, ctx):
        return []

    # -- mutations ----------------------------------------------------------

    def _writable(self) -> None:
        if self.read_only:
            raise pyfuse3.FUSEError(errno.EROFS)

    def _forget_path(self, path: str) -> None:
        """A name now means something else: new lookups get a new inode."""
        self._forgotten.pop(path, None)
        ino = self.by_path.pop(path, None)
        if ino is not None:
            self._drop_if_unused(ino)

    def _entry(self, node: Node) -> pyfuse3.EntryAttributes:
        self._forget_path(node.path)
        ino = self._inode_for(node)
        self.inodes[ino].lookups += 1
        self.inodes[ino].changed = time.monotonic()
        return self._attrs(ino, node)

    @_translate
    async def create(self, parent_inode, name, mode, flags, ctx):
        self._writable()
        handle = await self.view.create(self._node(parent_inode), os.fsdecode(name))
        handle.append = bool(flags & os.O_APPEND)
        attrs = self._entry(handle.node)
        return pyfuse3.FileInfo(fh=self._new_fh(attrs.st_ino, handle), keep_cache=True), attrs

    @_translate
    async def write(self, fh, off, buf):
        self._writable()
        return await self.view.write(self._handle(fh), off, buf)

    @_translate
    async def flush(self, fh):
        if self.read_only:
            # ENOSYS once tells the kernel never to send FLUSH again: one
            # request less per close on read-only mounts.
            raise pyfuse3.FUSEError(errno.ENOSYS)
        await self.view.flush(self._handle(fh))

    @_translate
    async def fsync(self, fh, datasync):
        await self.view.fsync(self._handle(fh))

    @_translate
    async def fsyncdir(self, fh, datasync):
        # (pyfuse3's default, ENOSYS, makes the kernel answer every later
        # directory fsync with success by itself: renames that a careful
        # writer then takes as durable were only in memory)
        handle = self._handles.get(fh)
        if handle is not None:
            await self.view.fsync_dir(self._node(handle.inode))

    @_translate
    async def setattr(self, inode, attr, fields, fh, ctx):
        node = self._node(inode)
        if (fields.update_size or fields.update_mode or fields.update_uid or fields.update_gid
                or fields.update_atime or fields.update_mtime or fields.update_ctime):
            self._writable()
        if fields.update_size:
            self._writable()
            if node.is_dir:
                raise pyfuse3.FUSEError(errno.EISDIR)
            handle = self._handle(fh) if fh is not None and fh in self._handles else None
            try:
                node = await self.view.truncate(node, attr.st_size, handle)
            except BaseException:
                self._truncate_failed(inode)
                raise
            entry = self.inodes[inode]
            entry.node, entry.changed = node, time.monotonic()  # (see _inode_for and getattr)
            return self._attrs(inode, node)
        # modes, owners and times are the mount's: accepted and ignored (cp -p,
        # rsync, install, vim); the answer is the file's attributes as they
        # are now, bytes written and not yet stored included (the kernel
        # takes its size from this answer: an older one would cut the file)
        return await self.getattr(inode)

    def _truncate_failed(self, inode: int) -> None:
        """A truncate whose store failed keeps its new size in memory, stored
        by a later flush (as a write's close, 4.6); the kernel keeps its
        attributes and pages when a SETATTR fails, and would show the old
        size until ``attr_timeout`` while the store gets the new one.  The
        inode's node is marked stale and the kernel forgets its attributes:
        the next getattr asks the view (no page lock involved: safe while
        this SETATTR is in flight)."""
        entry = self.inodes.get(inode)
        if entry is not None:
            entry.node = dataclasses.replace(entry.node, created=_STALE)
            entry.changed = time.monotonic()
        try:
            pyfuse3.invalidate_inode(inode, attr_only=True)
        except OSError as exc:
            log.debug("invalidate_inode(%d): %s", inode, exc)

    @_translate
    async def unlink(self, parent_inode, name, ctx):
        self._writable()
        parent = self._node(parent_inode)
        try:
            await self.view.unlink(parent, os.fsdecode(name))
        except StoreError:
            self._in_doubt((parent_inode, name))
            raise
        self._forget_path(f"{parent.path}/{os.fsdecode(name)}".lstrip("/"))

    async def _forget_removed_here(self, request: str = "", args: tuple = ()) -> None:
        """The kernel forgets its entries of the chunks the view removed by
        itself (View.removed_here: zarr 2.18's shrink of a transformer
        array), which it would show for ``attr_timeout``: a writer deleting
        them by name found them (``isfile``) and its ``os.remove`` failed
        (ENOENT), and a reader opening one got ENOENT instead of the fill.
        So it does of the chunk files and directories of a dataset that is
        gone (View.datasets_gone: its document and every chunk removed, a
        new document in its place; zarr 2.18's ``overwrite=True``): storage
        lost those directories with their last shard, and a writer making
        the new array's chunks below one the kernel still showed got ENOENT.

        Before the request is answered: the writer's next call comes at
        once, and a notification queued for pyfuse3's thread may not have
        reached the kernel by then.  An entry in a directory (or of an
        inode) this request names cannot be invalidated while the kernel
        waits for it (it holds their locks): that one is queued instead
        (the request's arguments that are inodes or directory handles, by
        its kind: _HELD_ARGS); and the wait ends after 2 s whatever
        happened (a related request holding a lock for longer), the rest
        queued.

        Only the request whose work removed them does so, and only those
        (both tables are by task: the pyfuse3 worker serving the request).
        Another request ending meanwhile may hold locks not among its
        arguments (an rmdir's victim, a directory moved to another, a LOOKUP
        a rename makes while holding both directories), and its answer
        waited 2 s for its own lock; and another remover's entries may lie
        in a directory the kernel holds for that remover, still at work (a
        rename onto ``y/zarr.json`` holds ``y``, where its ``y/c`` is): the
        first to end waited 2 s for it.  (What the final stores at a stop
        or unmount remove, outside any request, is not forgotten: the mount
        ends with them.)"""
        task = trio.lowlevel.current_task()
        removed = self.view.removed_here.pop(task, None) or {}
        datasets = self.view.datasets_gone.pop(task, None) or set()
        if not removed and not datasets:
            return  # (another's: each invalidates its own before its answer)
        inodes, handles = _HELD_ARGS.get(request, ((), ()))
        held = {args[i] for i in inodes if i < len(args)}
        held |= {h.inode for i in handles if i < len(args)
                 and isinstance(h := self._handles.get(args[i]), _DirHandle)}
        gone = set().union(*removed.values())
        # (the entries the kernel holds below those datasets' roots -- their
        # directories' paths are their storage keys --, not every inode)
        found = {ino for root in {*removed, *(root for root, _ in datasets)}
                 for _, ino in self.by_path.below(root)}
        now, later = [], []
        for ino in sorted(found):  # (as before: in the order the kernel was given them)
            entry = self.inodes.get(ino)
            if entry is None:
                continue
            node, t = entry.node, entry.node.target
            if t is not None and (t.shard_key, t.chunk_id) in gone:
                pass
            elif not (datasets and node.dataset is not None and node.key is None
                      and (node.dataset.root, node.dataset.version) in datasets):
                continue
            parent, _, name = node.path.rpartition("/")
            parent_inode = self.by_path.get(parent)
            if parent_inode is not None:
                (later if parent_inode in held or ino in held else now).append((parent_inode, os.fsencode(name)))
        done = []

        def invalidate() -> None:
            for parent_inode, name in now:
                try:
                    pyfuse3.invalidate_entry(parent_inode, name)
                except OSError:  # (ENOENT: the kernel does not hold it)
                    pass
                done.append(name)

        with trio.move_on_after(2.0):
            await trio.to_thread.run_sync(invalidate, limiter=self._entries_limiter, abandon_on_cancel=True)
        self._in_doubt(*later, *now[len(done):])

    def _in_doubt(self, *entries: tuple[int, bytes]) -> None:
        """A rename or unlink failed in storage after part of its work (a
        copy stored, a DELETE that may have landed): the kernel, told of a
        failure, keeps the names' entries as they were, and would show them
        for ``entry_timeout`` whatever the view holds now.  It forgets them
        (asynchronously: the kernel holds the directories' locks during this
        request) and looks them up again."""
        for parent_inode, name in entries:
            try:
                pyfuse3.invalidate_entry_async(parent_inode, name, ignore_enoent=True)
            except OSError as exc:  # (no such support)
                log.debug("invalidate_entry_async(%d): %s", parent_inode, exc)

    @_translate
    async def mkdir(self, parent_inode, name, mode, ctx):
        self._writable()
        node = await self.view.mkdir(self._node(parent_inode), os.fsdecode(name))
        return self._entry(node)

    @_translate
    async def rmdir(self, parent_inode, name, ctx):
        self._writable()
        parent = self._node(parent_inode)
        await self.view.rmdir(parent, os.fsdecode(name))
        self._forget_path(f"{parent.path}/{os.fsdecode(name)}".lstrip("/"))

    @_translate
    async def rename(self, parent_inode_old, name_old, parent_inode_new, name_new, flags, ctx):
        self._writable()
        if flags & ~_RENAME_NOREPLACE:
            raise pyfuse3.FUSEError(errno.EINVAL)  # RENAME_EXCHANGE / RENAME_WHITEOUT are not offered
        noreplace = bool(flags & _RENAME_NOREPLACE)
        old, new = os.fsdecode(name_old), os.fsdecode(name_new)
        for _ in range(64):
            # (a directory renamed while this one awaits, as in lookup: its
            # parents' nodes may name the old place, where the rename would
            # make the old directory again; asked again as they are now.  From
            # the view's rename on, its places are counted as under way)
            moves = self._dir_moves
            old_parent, new_parent = self._node(parent_inode_old), self._node(parent_inode_new)
            if noreplace and await self.view.lookup(new_parent, new) is not None:
                if self._dir_moves != moves:
                    continue
                # (the kernel refuses a name it knows taken itself; this one it
                # did not know, or not yet.  Checked again where the name is taken)
                raise pyfuse3.FUSEError(errno.EEXIST)
            if self._dir_moves != moves:
                continue
            old_path, new_path = f"{old_parent.path}/{old}".lstrip("/"), f"{new_parent.path}/{new}".lstrip("/")
            known = self.inodes.get(self.by_path.get(old_path, -1))
            if not (known is not None and known.node.is_dir and old_path != new_path):
                break
            if await self._rename_dir(old_parent, old, new_parent, new,
                                      ((parent_inode_old, name_old), (parent_inode_new, name_new)), noreplace,
                                      moves):
                return
        else:
            raise pyfuse3.FUSEError(errno.ESTALE)
        # The file the new name held is no longer that name's from now on:
        # descriptors open on it keep reading what it held, at its size (see
        # getattr), while the view already shows the new bytes there.
        replaced = self.by_path.get(new_path)
        self._forget_path(new_path)
        try:
            await self.view.rename(old_parent, old, new_parent, new, noreplace=noreplace)
        except BaseException as exc:
            # nothing was replaced: the name is its file's again
            if replaced is not None and replaced in self.inodes and new_path not in self.by_path:
                self.by_path[new_path] = replaced
            if isinstance(exc, StoreError):
                self._in_doubt((parent_inode_old, name_old), (parent_inode_new, name_new))
            raise
        gone = self.inodes.get(replaced) if replaced is not None else None
        try:
            await self._renamed(old_path, new_path, new_parent, new)
        finally:
            if gone is not None and gone.handles and not gone.node.is_chunk and not gone.node.is_dir:
                # its descriptors now read the new file (see getattr): the
                # kernel must forget the size and pages it holds for the old
                # one, else a read gets the new bytes cut to the old size
                await self._invalidate(replaced)

    async def _rename_dir(self, old_parent: Node, old: str, new_parent: Node, new: str,
                          entries: tuple[tuple[int, bytes], tuple[int, bytes]], noreplace: bool = False,
                          moves: int | None = None) -> bool:
        """A directory's rename: one rename in storage where the view can
        (a local store; see View.prepare_dir_rename), else EXDEV and ``mv``
        copies.  Open handles below either place (this table's) make it
        EXDEV too.  The view's last checks, the rename and the move of this
        table's inodes to the new paths run without a wait in between: no
        request sees the one without the other.  The kernel moves its
        entries itself (the dentry and those below it); the nodes of the
        inodes below are looked up again by their new paths at their next
        use (marked stale, and View._fresh for directories).  False: another
        directory's rename (``moves``: their count when the parents' nodes
        were taken) overtook the checks, which are to be made again."""
        move = await self.view.prepare_dir_rename(old_parent, old, new_parent, new, noreplace=noreplace)
        if moves is not None and self._dir_moves != moves:
            return False
        self._no_handles_below(move.old_path)
        self._no_handles_below(move.new_path)
        self.view.commit_dir_rename(move)
        self._dir_moves += 1
        self._moved_from.append((time.monotonic(), move.old_path))
        self._move_inodes(move)
        try:
            await self.view.dir_renamed(move)
        except BaseException:
            # renamed, not known to be durable: the kernel, told of a failure,
            # keeps the old entry, which must go (and the new name be looked up)
            self._in_doubt(*entries)
            raise
        return True

    def _no_handles_below(self, path: str) -> None:
        below = path + "/"
        for value in self._handles.values():
            ino = value[0] if isinstance(value, tuple) else value.inode
            entry = self.inodes.get(ino)
            if entry is not None and (entry.node.path == path or entry.node.path.startswith(below)):
                raise pyfuse3.FUSEError(errno.EXDEV)  # (mv copies, as for any directory before)

    def _move_inodes(self, move) -> None:
        """After a directory's rename in storage: the inodes of the old
        paths answer for the new ones; what the new name held is forgotten,
        and so are the numbers kept for forgotten paths below either place
        (below the new one they were files gone from there, removed by
        another client: kept, the moved files at those paths were handed
        them).  Only the paths at or below either place are visited
        (by_path.below, _forgotten.below), not every inode the kernel holds
        or forgot."""
        for p, _ in self.by_path.below(move.new_path):
            self._forget_path(p)
        key_below, now = move.old_key + "/", time.monotonic()
        for p, _ in [*self._forgotten.below(move.old_path), *self._forgotten.below(move.new_path)]:
            self._forgotten.pop(p, None)
        for p, ino in sorted(self.by_path.below(move.old_path), key=lambda item: item[1]):
            del self.by_path[p]
            entry = self.inodes.get(ino)
            if entry is None:
                continue
            node, path = entry.node, move.new_path + p[len(move.old_path):]
            key = node.key
            if key is not None and (key == move.old_key or key.startswith(key_below)):
                key = move.new_key + key[len(move.old_key):]
            entry.node = dataclasses.replace(node, path=path, key=key,
                                             created=node.created if node.is_dir else _STALE)
            entry.changed = now
            entry.attrs_for = None
            self.by_path[path] = ino

    async def _renamed(self, old_path: str, new_path: str, new_parent: Node, new: str) -> None:
        """After the view's rename: the source's inode answers for the new name."""
        # The kernel now shows the *source's* inode under the new name (it
        # moves the dentry, it does not look the name up again): that inode
        # must answer for the new path, or reads right after a tmp+rename
        # write (zarr-python, DirectoryStore) see the vanished temporary.
        ino = self.by_path.pop(old_path, None)
        self._forget_path(new_path)  # (a lookup during the rename may have named it anew)
        if ino is not None and ino in self.inodes:
            entry = self.inodes[ino]
            self.by_path[new_path] = ino
            entry.changed = time.monotonic()  # (lookups begun before bring older news)
            try:
                node = await self.view.lookup(new_parent, new)
            except StoreError:
                node = None
            if self.by_path.get(new_path) != ino or ino not in self.inodes:
                if self.by_path.get(new_path) == ino:
                    del self.by_path[new_path]  # (forgotten by the kernel meanwhile)
                return  # renamed or replaced again meanwhile
            if node is not None:
                entry.node = node
                entry.changed = time.monotonic()
            else:
                del self.by_path[new_path]
                self._drop_if_unused(ino)

    async def _invalidate(self, inode: int) -> None:
        """The kernel forgets ``inode``'s attributes and pages (from a thread:
        see ``_notify_limiter``)."""
        try:
            await trio.to_thread.run_sync(pyfuse3.invalidate_inode, inode, limiter=self._notify_limiter)
        except OSError as exc:  # (the kernel dropped the inode meanwhile)
            log.debug("invalidate_inode(%d): %s", inode, exc)

    async def _unsupported(self, *args, **kwargs):
        raise pyfuse3.FUSEError(errno.EROFS if self.read_only else errno.EPERM)

    @_translate
    async def mknod(self, parent_inode, name, mode, rdev, ctx):
        """A regular file is made empty, as ``create`` then ``close`` would
        (``tar --xattrs -x`` makes files so, to set their attributes before
        their bytes); device nodes, FIFOs and sockets are refused (EPERM)."""
        if stat.S_IFMT(mode) not in (0, stat.S_IFREG):
            await self._unsupported()
        self._writable()
        handle = await self.view.create(self._node(parent_inode), os.fsdecode(name))
        try:
            attrs = self._entry(handle.node)
        finally:
            await self.view.release(handle)
        return attrs

    @_translate
    async def removexattr(self, inode, name, ctx):
        # (there are none to remove: listxattr shows none, getxattr finds none)
        self._writable()
        raise pyfuse3.FUSEError(pyfuse3.ENOATTR)

    @_translate
    async def readlink(self, inode, ctx):
        node = self._node(inode)
        if node.link is None:
            raise pyfuse3.FUSEError(errno.EINVAL)
        return os.fsencode(node.link)

    @_translate
    async def symlink(self, parent_inode, name, target, ctx):
        self._writable()
        node = await self.view.symlink(self._node(parent_inode), os.fsdecode(name), os.fsdecode(target))
        return self._entry(node)

    @_translate
    async def link(self, inode, new_parent_inode, new_name, ctx):
        """A copy under the new name (see View.link): the entry is a new inode."""
        self._writable()
        node = await self.view.link(self._node(inode), self._node(new_parent_inode), os.fsdecode(new_name))
        return self._entry(node)

    @_translate
    async def setxattr(self, inode, name, value, ctx):
        if inode == pyfuse3.ROOT_INODE and self.control is not None:
            if await self.control.set(os.fsdecode(name), value, ctx.uid):
                return
        self._writable()
        raise pyfuse3.FUSEError(errno.ENOTSUP)
