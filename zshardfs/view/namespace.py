"""Names made and removed: create, unlink, mkdir, rmdir, the directories made
here and those emptied here (S3).

A mixin of ``View`` (``view/__init__.py`` holds the state it uses).
"""

from __future__ import annotations

import contextlib
import errno
import functools
import logging
import time

from ..backends.base import NotFound, held_by_deadline, join_key
from ..layouts.base import Dataset
from ..logonce import log_once
from ..together import off_loop
from .nodes import FileBuffer, Handle, Node, ViewError, _json_object, _parent, _prefix

log = logging.getLogger(__package__)  # "zshardfs.view" (as before the split): log lines name it


class NamespaceMixin:
    """``View``'s namespace methods (the state they use is set up by ``View.__init__``)."""

    def _check_name(self, name: str) -> None:
        """A name the store keeps for itself (the local backend's temporary
        files, which it hides and removes once their writer is gone) cannot
        be given to a file or directory: EINVAL, one log line."""
        if self.store.reserved_name(name):
            message = f"{name}: a name zshardfs keeps for its own temporary files"
            log_once(log, logging.WARNING, message)
            raise ViewError(errno.EINVAL, message)

    @staticmethod
    def _outside(dataset: Dataset, directory: str, path: str) -> ViewError:
        """The refusal (ENOENT) of a name spelled as a chunk (file or
        directory) but outside ``dataset``'s grid, and one INFO line per
        directory it would be made in (``directory``; a directory refused is
        its own): a copy of a grown array (``rsync -a``, which makes the new
        chunk directories before it copies ``zarr.json``) learns why."""
        grid = getattr(dataset, "grid", None)
        shape = getattr(grid, "shape", None)
        document = {"precomputed": "info", "zarr-v3-draft-transformer": "array document"}.get(dataset.layout,
                                                                                                "zarr.json")
        message = (f"{directory or '/'}: outside the chunk grid of {dataset.root or 'the root'}"
                   f"{f' (shape {list(shape)})' if shape is not None else ''}: its chunk names there are refused "
                   f"(ENOENT); to grow it, write its larger {document} first")
        log_once(log, logging.INFO, message, tag=f"outside the grid: {directory}")
        return ViewError(errno.ENOENT, f"{path}: outside the chunk grid")

    @staticmethod
    def _no_key_part(dataset: Dataset, path: str) -> ViewError:
        """The refusal (ENOENT) of a directory ``path`` in ``dataset``'s chunk
        namespace that can be no part of a chunk key (``c/0x``: ``cp -r c/0
        c/0x``): whatever were written below it could never be stored.  One
        INFO line per directory, naming the array and a key of it."""
        keys = getattr(dataset, "keys", None)
        example = f" (its chunk keys are like {keys.format((0,) * keys.ndim)})" if keys is not None else ""
        message = (f"{path}: no part of a chunk key of {dataset.root or 'the root'}{example}: no directory can "
                   "be made there (ENOENT)")
        log_once(log, logging.INFO, message, tag=f"no key part: {path}")
        return ViewError(errno.ENOENT, f"{path}: not a name in the chunk grid")

    async def create(self, parent: Node, name: str, exclusive: bool = False) -> Handle:
        """A new empty file ``name`` in ``parent``, opened for writing.
        ``exclusive``: EEXIST if the name is taken, checked after the last
        wait but the lookup, and again (this mount's files in memory) after it,
        with no wait between that and the new file taking the name."""
        self._check_writable()
        self._check_name(name)
        with self._under_way(join_key(parent.path, name)):
            return await self._create(parent, name, exclusive)

    async def _create(self, parent: Node, name: str, exclusive: bool) -> Handle:
        parent = await self._fresh(parent)
        path = join_key(parent.path, name)
        dataset, rel = (parent.dataset, parent.rel + (name,)) if self._in_dataset(parent) else (None, ())
        if dataset is None:
            root_dataset = await self.dataset_at(parent.key)
            if root_dataset is not None and root_dataset.claims((name,)):
                dataset, rel = root_dataset, (name,)
            elif root_dataset is not None and root_dataset.outside((name,)):
                raise self._outside(root_dataset, parent.path, path)
        if dataset is not None:
            target = dataset.target(rel)
            if target is not None:
                if exclusive and await self.lookup(parent, name) is not None:
                    raise ViewError(errno.EEXIST, f"{path}: exists")
                node = Node(path, False, 0, time.time(), dataset=dataset, rel=rel, target=target)
                return await self.open(node, write=True, truncate=True)
            if dataset.outside(rel):
                raise self._outside(dataset, parent.path, path)
            # a shard a sharding-aware tool writes: stored as written; any
            # other name is scratch, a temporary inside the chunk namespace
            key = dataset.stored_as_is(rel)
        else:
            key = join_key(parent.key, name)
        self._drop_abandoned_scratch()
        await self._room_for_files(path)
        if exclusive and (path in self.buffers or await self.lookup(parent, name) is not None
                          or path in self.buffers):
            raise ViewError(errno.EEXIST, f"{path}: exists")
        buf = self.buffers[path] = FileBuffer(path, key, bytearray(), dirty=True, in_store=False)
        self._made_in(_parent(path))
        buf.handles += 1
        return self._writer(Handle(self._buffer_node(buf), True, buffer=buf))

    async def _file_to_change(self, parent: Node, name: str, dir_errno: int) -> Node:
        """The existing file ``name`` that unlink/rename will change."""
        self._check_writable()
        node = await self.lookup(parent, name)
        if node is None:
            raise ViewError(errno.ENOENT, f"{name}: no such file")
        if node.is_dir:
            raise ViewError(dir_errno, f"{name}: is a directory")
        self._check_chunk_writable(node)
        return node

    async def unlink(self, parent: Node, name: str) -> None:
        with self._under_way(join_key(parent.path, name)):
            await self._unlink(parent, name)

    @contextlib.asynccontextmanager
    async def _no_store_of(self, path: str):
        """While held, no store of the file at ``path`` runs or begins (its
        buffer's ``storing``, if it has one): a store a close or a sync
        began is waited for, within the request's deadline, as it may have
        begun after this request and end after it (Unavailable then,
        before the caller changed anything)."""
        while (buf := self.buffers.get(path)) is not None:
            async with held_by_deadline(buf.storing, buf.key or path, "a store of it"):
                if self.buffers.get(path) is buf:  # (else replaced while waiting: that one's)
                    yield
                    return
        yield

    async def _unlink(self, parent: Node, name: str, moving: bool = False) -> None:
        """``moving``: a rename's unlink of its source, whose open handles
        move to the new name (see rename) instead of being detached."""
        node = await self._file_to_change(parent, name, errno.EISDIR)
        if node.is_chunk and not moving:  # (a rename's source: refused before it began, see _rename)
            await self._refuse_removal_if_damaged(node, "an unlink")
        detached, was_dirty = [], False
        async with self._no_store_of(node.path):
            # a store of it lands first, then this delete (else its PUT would
            # bring the file back after it)
            if not moving:
                detached = self._detach_writers(node.path)
            buf = self.buffers.pop(node.path, None)
            if buf is not None:
                # (its bytes go with its name: a close queued to store it stores nothing)
                was_dirty, buf.dirty = buf.dirty, False
        if node.is_chunk:
            await self._keep_for_readers(node)
            t = node.target
            self.writeback.delete(t.shard_key, node.dataset.shard_format, t.shard_ctx, t.chunk_id,
                                  node.dataset.shard_home)
            self._chunk_changed(t)
            self._keep_emptied(parent)
            return
        if buf is not None and (buf.key is None or not (buf.in_store or buf.maybe_stored)):
            return  # scratch, or a new file not stored yet: nothing in storage to remove
        if node.key is not None:
            dir_key = _parent(node.key)
            made_of: list[tuple[str, Dataset]] = []  # the datasets this document describes
            stored = b""
            was_document = False  # (a JSON object: kept as the last document there)
            try:
                if self._is_dataset_document(node.key):
                    stored = await self._stored_document(node.key)
                    made_of = await self._datasets_made_of(node.key, stored) if stored else []
                    was_document = bool(stored) and await off_loop(functools.partial(_json_object, stored),
                                                                   len(stored))
                try:
                    await self.store.delete(node.key)
                except NotFound:
                    if buf is None:
                        raise
            except BaseException as exc:
                self._put_back(node.path, buf, was_dirty, detached, exc)
                raise
            if self._is_dataset_document(node.key):
                # (no await from here on: a lookup in between would find
                # neither the document nor the orphan, and cache that)
                self._document_changed(node.key)
                if made_of:
                    self._orphan(node.key, stored, made_of)
                if was_document:
                    self._keep_previous(node.key, stored)
            self.datasets.pop(dir_key)
            self._keep_emptied(parent)

    #: seconds a directory emptied by this mount on S3 stays without
    #: anything below it (at least; ``metadata_ttl`` if longer)
    EMPTIED_KEEP = 5.0

    #: directories so kept at once (the oldest go first)
    EMPTIED_MAX = 4096

    def _keep_emptied(self, parent: Node) -> None:
        """(S3) ``parent`` just lost a file or a subdirectory: if that was
        its last key, it is gone from storage too, under a tool about to
        rmdir it (``rm -r``, ``find -delete``, ``rm f; rmdir d``).  It stays
        a little while (``emptied``), whether or not it holds more: knowing
        would cost a listing per removal.  Not for ever: then another
        client's removal of what it held would never show.  A chunk or chunk
        directory lost renews the directory its dataset's names are in (a
        chunk directory is found leniently while its dataset is, 4.1): the
        array's directory, whose last shard may have gone with it."""
        if self.store.keeps_empty_dirs:
            return
        path = parent.path
        if self._in_dataset(parent):
            parts = path.split("/")
            path = "/".join(parts[:len(parts) - len(parent.rel)]) if len(parts) > len(parent.rel) else ""
        if path:
            # (its ancestors too: one that held only it is gone from storage
            # as well, and rm -r a/b resolves a again for its last rmdir)
            now = time.monotonic()
            while path:
                self.emptied[path] = now
                self.emptied.move_to_end(path)
                path = _parent(path)
            while len(self.emptied) > self.EMPTIED_MAX:
                self.emptied.popitem(last=False)

    def _made_in(self, path: str) -> None:
        """Something was made in ``path`` (a directory, a file not stored
        yet): directories kept only a moment (``emptied``) become made here."""
        while path and self.emptied.pop(path, None) is not None:
            self._made_dir(_parent(path), path.rsplit("/", 1)[-1], False)
            path = _parent(path)

    def _still_emptied(self, path: str) -> bool:
        """Is ``path`` a directory this mount emptied that is still kept:
        something below it, or below any directory above it, removed within
        ``_emptied_keep``?  (A tree being moved or removed: ``mv`` on S3
        renames each file, then removes the directories left, which ``rm``
        lists and removes one by one; those emptied first must outlast the
        rest of the move.  Kept by its own removals only, one emptied 5 s
        before the end was gone, or listed and then gone, at its rmdir.)"""
        if path not in self.emptied:
            return False
        now, p = time.monotonic(), path
        while p:
            when = self.emptied.get(p)
            if when is not None and now - when < self._emptied_keep:
                return True
            p = _parent(p)
        del self.emptied[path]
        return False

    async def mkdir(self, parent: Node, name: str) -> Node:
        with self._under_way(join_key(parent.path, name)):
            return await self._mkdir(parent, name)

    async def _mkdir(self, parent: Node, name: str) -> Node:
        self._check_writable()
        self._check_name(name)
        parent = await self._fresh(parent)
        if await self.lookup(parent, name) is not None:
            raise ViewError(errno.EEXIST, f"{name}: exists")
        if self._in_dataset(parent) and parent.dataset.outside(parent.rel + (name,)):
            path = join_key(parent.path, name)
            raise self._outside(parent.dataset, path, path)
        if self._in_dataset(parent) and parent.dataset.no_key_part(parent.rel + (name,)):
            raise self._no_key_part(parent.dataset, join_key(parent.path, name))
        dataset, stored = parent.dataset, False
        if not self._in_dataset(parent):
            dataset = await self.dataset_at(parent.key)  # (the array's own directory: its dataset)
            if dataset is not None and dataset.outside((name,)):
                # (``9`` of a ``v2``/``/`` array: its chunk directories begin here)
                path = join_key(parent.path, name)
                raise self._outside(dataset, path, path)
            if dataset is not None and dataset.no_key_part((name,)):
                raise self._no_key_part(dataset, join_key(parent.path, name))
            if dataset is None or not dataset.claims((name,)):
                await self.store.make_dir(join_key(parent.key, name))
                stored = self.store.keeps_empty_dirs
        path = join_key(parent.path, name)
        if path in self.removed_dirs and dataset is not None and dataset.root not in self.born_here:
            # a chunk directory this mount removed, of a stored array: made
            # again, found as before (leniently, Limits), so not remembered
            # as made (that memory would grow with each one, unbounded)
            self.removed_dirs.discard(path)
            if await self.lookup(parent, name) is None:
                self._made_dir(parent.path, name, stored)
        else:
            self._made_dir(parent.path, name, stored)
            self.removed_dirs.discard(path)
        self._made_in(parent.path)
        if dataset is not None and dataset.root in self.born_here:
            self.born_here[dataset.root] = time.monotonic()  # (a copy into it goes on: not quiet)
        node = await self.lookup(parent, name)
        if node is None:  # e.g. a name the dataset claims but that cannot be a directory
            self._forget_made_dirs(parent.path, (name,))
            raise ViewError(errno.EINVAL, f"{name}: cannot be a directory here")
        return node

    #: directories made here that storage holds too, remembered at most (the
    #: least recently made or looked up are forgotten first; storage answers
    #: for them then).  Those storage does not hold (an empty S3 directory, a
    #: chunk directory of an array made here) are not counted, nor forgotten
    NEW_DIRS_MAX = 4096

    def _made_dir(self, parent_path: str, name: str, stored: bool) -> None:
        """Remember the directory ``name`` made in ``parent_path``; ``stored``:
        storage holds it too (see _new_dirs_stored)."""
        self.new_dirs.setdefault(parent_path, set()).add(name)
        path = _prefix(parent_path) + name
        self._made_at[path] = time.time_ns()
        self._made_at.move_to_end(path)
        while len(self._made_at) > self.NEW_DIRS_MAX:
            self._made_at.popitem(last=False)
        if not stored:
            self._new_dirs_stored.pop(path, None)
            return
        self._new_dirs_stored[path] = None
        self._new_dirs_stored.move_to_end(path)
        while len(self._new_dirs_stored) > self.NEW_DIRS_MAX:
            old, _ = self._new_dirs_stored.popitem(last=False)
            made = self.new_dirs.get(_parent(old))
            if made is not None:  # (else forgotten already: a listing, an rmdir)
                made.discard(old.rsplit("/", 1)[-1])
                if not made:
                    del self.new_dirs[_parent(old)]

    def _forget_made_dirs(self, parent_path: str, names) -> None:
        """Forget the directories ``names`` (those made here) of
        ``parent_path``: storage shows them (listed), or they are gone; the
        count that bounds _new_dirs_stored is of those remembered only."""
        made = self.new_dirs.get(parent_path)
        if made is None:
            return
        prefix = _prefix(parent_path)
        for name in names:
            if name in made:
                made.discard(name)
                self._new_dirs_stored.pop(prefix + name, None)
        if not made:
            del self.new_dirs[parent_path]

    def _stored_below(self, key: str) -> None:
        """(S3) A file was stored at ``key`` (a path of the view as well): the
        directories made here above it exist in storage now, and may be
        forgotten (see _made_dir); empty, only memory held them."""
        path = _parent(key)
        while path:
            parent, name = _parent(path), path.rsplit("/", 1)[-1]
            if name in self.new_dirs.get(parent, ()):
                self._made_dir(parent, name, True)
            path = parent

    async def rmdir(self, parent: Node, name: str) -> None:
        with self._under_way(join_key(parent.path, name)):
            await self._rmdir(parent, name)

    async def _rmdir(self, parent: Node, name: str) -> None:
        self._check_writable()
        parent = await self._fresh(parent)
        node = await self.lookup(parent, name)
        if node is None:
            raise ViewError(errno.ENOENT, f"{name}: no such directory")
        if not node.is_dir:
            raise ViewError(errno.ENOTDIR, f"{name}: not a directory")
        if not await self._empty(node):
            raise ViewError(errno.ENOTEMPTY, f"{node.path}: directory not empty")
        if node.key is not None:
            # chunks removed through the view leave their shards to be deleted
            # at the next flush: now, so the stored directory is empty.  The
            # view forgets the directory only after these succeeded, so a
            # failed rmdir leaves it where it was.
            await self._flush_below_first(f"{node.path}: not removed: what was removed below", node.key)
            await self.store.remove_dir(node.key)
            self._forget_orphan(node.key)
            # (a document written in a directory made there again is a new one's)
            for k in list(self._previous_in.get(node.key, ())):
                self._forget_previous(k)
        self._forget_made_dirs(parent.path, (name,))
        self._forget_made_dirs(node.path, list(self.new_dirs.get(node.path, ())))
        self._new_dirs_stored.pop(node.path, None)
        self.emptied.pop(node.path, None)
        self._keep_emptied(parent)
        self.written_dirs.discard(node.path)
        # (a directory made there again is no array the probe found in it)
        self.datasets.pop(node.path)
        if node.key is not None and node.key != node.path:
            self.datasets.pop(node.key)
        if node.dataset is not None:  # (a chunk directory: see _dataset_child)
            if len(self.removed_dirs) > 65536:  # (bounded: forgetting one only lets storage answer)
                self.removed_dirs.clear()
            self.removed_dirs.add(node.path)

    async def _holds_chunks(self, node: Node) -> bool:
        """A chunk file somewhere below ``node`` (plain files do not count),
        or a temporary in a chunk directory: a chunk about to be (tmp+rename
        writers), which only the dataset's chunk directories can hold."""
        async for child in self.listdir(node):
            if child.is_chunk or (child.is_dir and child.dataset is not None and await self._holds_chunks(child)):
                return True
            if child.key is None and not child.is_dir:
                return True  # (scratch, in memory only; a temporary in the dataset's root has a key)
        return False

    async def _empty(self, node: Node) -> bool:
        """No file below ``node``: a directory store's rmdir test.  Chunk
        directories are looked into, since their listings come from storage
        directories that may hold only shards whose chunks were all removed."""
        async for child in self.listdir(node):
            if not child.is_dir or child.dataset is None or not await self._empty(child):
                return False
        return True
