"""Renames: of files (and the handles open on them moving along), of
directories (prepare, commit, the memory below carried or forgotten), of
symbolic links; link and symlink.

A mixin of ``View`` (``view/__init__.py`` holds the state it uses).
"""

from __future__ import annotations

import errno
import time
from dataclasses import dataclass

import trio

from ..backends.base import (CorruptData, DirectoryAtKey, StoreError, Unavailable, held_by_deadline, join_key,
                             waited_within_deadline)
from ..writeback import DirtyChunk, failures_logged_by_caller
from .nodes import DirectoryInTheWay, FileBuffer, Handle, Node, ViewError, _parent, _stays_in_view


@dataclass(frozen=True)
class DirMove:
    """A directory rename prepared (View.prepare_dir_rename)."""

    old_path: str
    new_path: str
    old_key: str
    new_key: str
    noreplace: bool  # the new name was free (a file made at it in memory meanwhile: refused)
    asked: bool = False  # the caller asked RENAME_NOREPLACE: a name taken meanwhile is EEXIST


def _ancestors(key: str) -> list[str]:
    """The directories above ``key``, its parent first, the root ('') last."""
    out = []
    while key:
        key = key.rpartition("/")[0]
        out.append(key)
    return out


def _in_draft_store(key: str) -> bool:
    """Is ``key`` (a directory) at or below a v3-draft store's ``meta/root``
    or ``data/root``?"""
    k = "/" + key + "/"
    return "/meta/root/" in k or "/data/root/" in k



class RenamesMixin:
    """``View``'s renames methods (the state they use is set up by ``View.__init__``)."""

    async def rename(self, parent: Node, name: str, new_parent: Node, new_name: str,
                     noreplace: bool = False) -> None:
        """Rename a file (directories: EXDEV, so tools copy instead).  Writes
        through the file's open handles wait while it moves (its bytes are
        copied to the new name first): else one landing between the copy and
        the move of the handles would go to the old name's buffer, and be lost.
        ``noreplace`` (RENAME_NOREPLACE): EEXIST if the new name is taken,
        checked last where the new file takes it (see :meth:`create`)."""
        path = join_key(parent.path, name)
        if path == join_key(new_parent.path, new_name):
            await self._file_to_change(parent, name, errno.EXDEV)  # (it must exist)
            if noreplace:
                raise ViewError(errno.EEXIST, f"{path}: exists")
            return
        self._check_name(new_name)
        with self._under_way(path, join_key(new_parent.path, new_name)):
            while (earlier := self._renaming.get(path)) is not None:
                await waited_within_deadline(earlier, path, "a rename of it")
            done = self._renaming[path] = trio.Event()
            try:
                await self._rename(parent, name, new_parent, new_name, noreplace)
            finally:
                del self._renaming[path]
                done.set()

    # -- renaming a directory (local stores) ---------------------------------

    async def prepare_dir_rename(self, parent: Node, name: str, new_parent: Node, new_name: str,
                                 noreplace: bool = False) -> "DirMove":
        """The checks of a directory's rename, and the flush of what is
        waiting to be stored below it and below the name it takes.  A
        directory is renamed in storage (one rename(2): its array keeps its
        layout, shards and metadata as stored) only where that is all the
        rename changes: a stored directory (not a chunk directory, which is
        virtual), neither place inside a sharded dataset (a precomputed
        volume names its scale directories in its ``info``) nor in a v3-draft
        store (an array is two places there: ``meta/root/<p>.array.json`` and
        ``data/root/<p>``), on a store that renames directories (local; S3
        has no directory to rename), and nothing below it open, held in
        memory only or still to be stored once flushed (see :meth:`_quiet_below`).
        Everything else: EXDEV, and ``mv`` copies, as before.
        :meth:`commit_dir_rename` then renames, on the event loop."""
        self._check_writable()
        node = await self.lookup(parent, name)
        if node is None:
            raise ViewError(errno.ENOENT, f"{name}: no such directory")
        if not node.is_dir:  # (replaced by a file meanwhile, in storage: copied, as any rename across)
            raise ViewError(errno.EXDEV, f"{node.path}: no longer a directory")
        old_path, new_path = node.path, join_key(new_parent.path, new_name)
        if new_path.startswith(old_path + "/"):
            raise ViewError(errno.EINVAL, f"{old_path}: cannot be moved into itself")
        self._check_name(new_name)
        if not self.store.moves_dirs:
            raise ViewError(errno.EXDEV, f"{old_path}: directories are not renamed in this store (copied instead)")
        new_parent = await self._fresh(new_parent)
        if node.key is None or node.dataset is not None or node.link is not None or new_parent.key is None \
                or self._in_dataset(new_parent):
            raise ViewError(errno.EXDEV, f"{old_path} -> {new_path}: a directory of a dataset's namespace")
        new_key = join_key(new_parent.key, new_name)
        for key in (node.key, new_key):
            if _in_draft_store(key) or await self._at_or_below_draft_top(key):
                raise ViewError(errno.EXDEV, f"{key}: inside a v3-draft store (an array is two places there)")
        for key in {*_ancestors(node.key), *_ancestors(new_key)}:
            if await self.dataset_at(key) is not None:
                raise ViewError(errno.EXDEV, f"{key or '/'}: a sharded dataset; its directories are not renamed")
        for key in (node.key, new_key):
            # a directory another directory's document names or describes (a
            # precomputed scale: its volume's ``info``), also unsharded
            dataset = await self.dataset_at(key) if key == node.key else None
            outside = dataset is not None and any(not d.startswith(key + "/") for d, _ in dataset.version)
            if outside or key in await self._dirs_named_near(_parent(key)):
                raise ViewError(errno.EXDEV, f"{key}: named by a document outside it (a precomputed scale)")
        existing = await self.lookup(new_parent, new_name)
        if noreplace and existing is not None:
            raise ViewError(errno.EEXIST, f"{new_path}: exists")
        if existing is not None and not existing.is_dir:
            raise ViewError(errno.ENOTDIR, f"{new_path}: not a directory")
        if existing is not None and (existing.key is None or existing.link is not None):
            raise ViewError(errno.EXDEV, f"{new_path}: not a stored directory")
        move = DirMove(old_path, new_path, node.key, new_key, existing is None, noreplace)
        self._quiet_below(move, flushed=False)
        await self._flush_below_first(f"{old_path} -> {new_path}: not renamed: what was written below", node.key,
                                      new_key)
        return move

    async def _flush_below_first(self, what: str, *keys: str) -> None:
        """Flush the dirty shards below the directories ``keys`` before a
        request that needs them stored (a directory's rename or removal).
        A failure is the request's one line (``what`` could not be stored
        first, and why), not also one of each shard's flush."""
        try:
            with failures_logged_by_caller():
                for key in keys:
                    await self.writeback.flush_below(key)
        except (CorruptData, ViewError, Unavailable):
            raise  # (damage has its own line, 5.2; a deadline is said as such)
        except StoreError as exc:
            err = StoreError(f"{what} could not be stored first (kept in memory, retried): {exc}", exc.key)
            err.errno = exc.errno
            raise err from None

    async def _at_or_below_draft_top(self, key: str) -> bool:
        """Is ``key`` a v3-draft store's ``meta`` or ``data`` (a directory of
        that name holding ``root``), or below one (outside its ``root`` too)?"""
        parts = key.split("/") if key else []
        for i in range(len(parts), 0, -1):
            if parts[i - 1] in ("meta", "data") and await self.store.is_dir(join_key("/".join(parts[:i]), "root")):
                return True
        return False

    def _quiet_below(self, move: "DirMove", flushed: bool = True) -> None:
        """EXDEV (``mv`` then copies) if anything below either place lives
        in memory: a file open or held (a buffer, a scratch file), an open
        handle, a rename under way, a dataset whose document this mount
        removed, a write given up that may still land; and, once
        ``flushed``, a chunk still to be stored (or being stored)."""
        for path, key in ((move.old_path, move.old_key), (move.new_path, move.new_key)):
            below, key_below = path + "/", key + "/"
            busy = (any(p.startswith(below) for p in self.buffers)
                    or any(p.startswith(below) and hs for p, hs in self.writers.items())
                    or any(p.startswith(below) and hs for p, hs in self.readers.items())
                    or any(p.startswith(below) for p in self._renaming)
                    or any(p.startswith(below) for p in self._opening)
                    or any(k == key or k.startswith(key_below) for k in self.orphans)
                    or (flushed and any(k.startswith(key_below) for k in self.writeback.dirty))
                    or self.store.landing_below(key))  # (a late write would make the old place again)
            if busy:
                raise ViewError(errno.EXDEV, f"{path}: something below it is open or not stored yet; not renamed "
                                             "(copied instead)")

    def commit_dir_rename(self, move: "DirMove") -> None:
        """The rename itself, after :meth:`prepare_dir_rename`: synchronous
        (no other request runs between the last check and the rename), then
        every memory of both places is dropped: storage answers for them."""
        self._check_writable()
        self._quiet_below(move)
        if move.noreplace and move.new_path in self.buffers:
            # a file made at the free name meanwhile, in memory only (storage's
            # RENAME_NOREPLACE cannot see it)
            raise ViewError(errno.EEXIST if move.asked else errno.ENOTDIR, f"{move.new_path}: a file now")
        try:
            # RENAME_NOREPLACE only where the client asked it: else an empty
            # directory another process made at the free name meanwhile is
            # replaced (a file there: ENOTDIR), as rename(2) does
            self.store.move_dir_now(move.old_key, move.new_key, noreplace=move.asked)
        except StoreError as exc:
            if exc.errno in (errno.ENOTEMPTY, errno.EEXIST, errno.EINVAL, errno.ENOTDIR, errno.EISDIR, errno.EXDEV,
                             errno.EBUSY):
                raise ViewError(exc.errno, str(exc)) from None  # (an answer, not a failure: no error line)
            raise
        self._forget_below(move.new_path, move.new_key)
        self._carry_made_here(move)
        self._forget_below(move.old_path, move.old_key)
        self._made_in(_parent(move.new_path))

    def _carry_made_here(self, move: "DirMove") -> None:
        """What this mount knows of datasets it made below the old place
        (made here: chunk directories exist once made or written to, as in a
        directory store) holds for the new place: ``ls`` shows the same."""
        def moved(p: str, old: str, new: str) -> str | None:
            return new + p[len(old):] if p == old or p.startswith(old + "/") else None

        op, np_, ok, nk = move.old_path, move.new_path, move.old_key, move.new_key
        for root, when in list(self.born_here.items()):
            if (to := moved(root, ok, nk)) is not None:
                self.born_here[to] = when
        for table in ("written_dirs", "removed_dirs"):
            old = getattr(self, table)
            old |= {to for p in old if (to := moved(p, op, np_)) is not None}
        for d, names in list(self.new_dirs.items()):
            if (to := moved(d, op, np_)) is not None:
                self.new_dirs[to] = set(names)
        for p, when in list(self._made_at.items()):
            if (to := moved(p, op, np_)) is not None:
                self._made_at[to] = when

    def _forget_below(self, path: str, key: str) -> None:
        below, key_below = path + "/", key + "/"

        def at(p: str) -> bool:
            return p == path or p.startswith(below)

        def at_key(k) -> bool:
            return isinstance(k, str) and (k == key or k.startswith(key_below))

        for k in [k for k in self.datasets._d if at_key(k)]:
            self.datasets.pop(k)
        for k in [k for k in self.documents._d if at_key(k[0])]:
            self.documents.pop(k)
        for table in (self.ctx.probed, self.ctx.probed_small):
            for k in [k for k in table if at_key(k[1])]:
                del table[k]
        # (loads under way too: one landing after the rename would be kept
        # under the old key, and used by whatever is made there next)
        self.shards.forget_where(lambda k: at_key(k if isinstance(k, str) else k[0]))
        self.shards.chunks.pop_where(lambda k: at_key(k if isinstance(k, str) else k[0]))
        for table in (self.shards._unread, self.shards._positions, self.shards._ahead):
            for k in [k for k in table if at_key(k)]:
                del table[k]
        self.new_chunks = {d: n for d, n in self.new_chunks.items() if not at(d)}
        self._prune_new_chunks()
        name = path.rpartition("/")[2]
        self.new_dirs.get(_parent(path), set()).discard(name)
        for table in (self.new_dirs, self._new_dirs_stored, self._made_at, self.emptied, self.writers,
                      self.readers, self._fresh_nodes):
            for p in [p for p in table if at(p)]:
                del table[p]
        self.written_dirs = {p for p in self.written_dirs if not at(p)}
        self.removed_dirs = {p for p in self.removed_dirs if not at(p)}
        for table in (self.born_here, self.own_versions, self.orphans, self.removed_documents, self._info_dirs_kept):
            for k in [k for k in table if at_key(k)]:
                del table[k]
        for k in [k for k in self.previous_documents if at_key(k)]:
            self._forget_previous(k)
        for k in [k for k in self._chunk_changes if at_key(k[0])]:
            del self._chunk_changes[k]
        self._chunk_epoch += 1
        # nodes made before now may name a dataset or a key that moved: looked up again by path (_fresh)
        self.document_writes += 1
        self._documents_changed_at = time.monotonic()
        self._fresh_nodes.clear()
        self._listed_slices.clear()
        self._listed_count = 0

    async def dir_renamed(self, move: "DirMove") -> None:
        """The rename made durable (its two parent directories fsynced)."""
        await self.store.sync_dirs(_parent(move.old_key), _parent(move.new_key))

    async def _while_renamed(self, handle: Handle) -> None:
        """Wait while the file ``handle`` writes is being renamed (see rename)."""
        while (renaming := self._renaming.get(handle.node.path)) is not None:
            await waited_within_deadline(renaming, handle.node.path, "a rename of it")

    async def _refuse_removal_if_damaged(self, node: Node, what: str) -> None:
        t = node.target
        linked = getattr(node.dataset.shard_format, "deleted_with", None)
        await self.writeback.refuse_if_damaged(t.shard_key, node.dataset.shard_format, t.shard_ctx,
                                               linked(t.chunk_id) if linked else (t.chunk_id,),
                                               f"{what} of {node.path}")

    async def _rename(self, parent: Node, name: str, new_parent: Node, new_name: str,
                      noreplace: bool = False) -> None:
        node = await self._file_to_change(parent, name, errno.EXDEV)
        if node.is_chunk:  # (its removal would be kept for ever: refused before the new name is written)
            await self._refuse_removal_if_damaged(node, "a rename")
        if node.link is not None:
            await self._rename_link(node, new_parent, new_name, noreplace)
            return
        buf = self.buffers.get(node.path)
        data = bytes(buf.data) if buf is not None else (
            await self.content(node) if node.is_chunk else await self._stored_bytes(node, recent_ok=True))
        existing = await self.lookup(new_parent, new_name)
        if noreplace and existing is not None:
            raise ViewError(errno.EEXIST, f"{join_key(new_parent.path, new_name)}: exists")
        if existing is not None and existing.is_dir:
            raise ViewError(errno.EISDIR, f"{new_name}: is a directory")
        # room first: a rename refused for it must leave the target as it was
        await self.writeback.wait_for_room()
        if existing is not None:
            async with self._no_store_of(existing.path):
                pass  # (a store of the target out: waited for before anything changes)
        detached: list = []  # the target's writers moved to the old file (put back if this fails)
        try:
            if existing is not None and existing.is_chunk:
                detached = self._detach_writers(existing.path)
                await self._keep_for_readers(existing)
            replaced = self.buffers.get(existing.path) if existing is not None else None
            was_dirty = False
            handle = await self.create(new_parent, new_name, exclusive=noreplace)
        except BaseException:
            self._reattach_writers(detached)
            raise
        try:
            if replaced is not None and replaced.storing.locked():
                # a store of the file this one replaces began meanwhile (a
                # sync, while the new file was made): its PUT lands first,
                # then this one (both out at once, the older could land last
                # and bring back the bytes this rename replaced).  Waited for
                # once the new buffer holds the name, so opens meanwhile
                # share the new file, not the old one
                async with held_by_deadline(replaced.storing, replaced.key or replaced.path, "a store of it"):
                    pass
            if existing is not None and not existing.is_chunk:
                # its writers go on with the old file only now, after every
                # wait: a rename given up at its deadline changes nothing
                # (the old buffer is put back below, its writers still on it)
                detached = self._detach_writers(existing.path, keep=handle)
                if replaced is not None:
                    was_dirty, replaced.dirty = replaced.dirty, False  # (a close queued to store it stores nothing)
            if existing is not None and not existing.is_chunk and handle.buffer is not None:
                # the name holds a file already, perhaps stored: the new one is no
                # new file, and its unlink must remove what storage holds there
                handle.buffer.in_store = replaced is None or replaced.in_store or replaced.maybe_stored
            if existing is None and handle.buffer is not None and node.key is not None and not node.is_chunk \
                    and (buf is None or buf.in_store):
                # a stored file moved to a free name: its copy there is that
                # file (its mode and owner), as rename(2) keeps them
                handle.buffer.like = node.key
            if handle.buffer is not None and buf is None and node.key is not None and not node.is_chunk \
                    and self._is_dataset_document(node.key) and self._is_dataset_document(handle.buffer.key):
                handle.buffer.view_form = await self._shown_form(node.key, data)
            # (not held while its new name is itself being renamed: the
            # renames of a->b and b->a at once would wait for each other)
            await self.write(handle, 0, data, held_by_renames=False)
            if handle.buffer is not None and handle.buffer.key is not None and node.key is not None \
                    and (buf is None or buf.in_store):
                # a stored file renamed: stored under its new name before the
                # old one goes, whatever the new name (a zarr.json renamed to
                # zarr.json~ must never be in memory only)
                await self._store_buffer(handle.buffer)
            else:
                await self.flush(handle, held_by_renames=False)
        except BaseException as exc:
            # a rename that fails changes nothing: the new name holds what it
            # held (unless the new bytes may have been stored there after all),
            # and its writers write on to it
            made = handle.buffer
            if made is not None and not made.maybe_stored and self.buffers.get(made.path) in (made, None):
                if replaced is not None:
                    self.buffers[made.path] = replaced
                    replaced.dirty = replaced.dirty or was_dirty
                else:
                    self.buffers.pop(made.path, None)
                self._reattach_writers(detached)
            elif made is None:  # (a chunk: the name's buffer is its shard's, see _reattach_writers)
                self._reattach_writers(detached)
            if isinstance(exc, (DirectoryAtKey, DirectoryInTheWay)):
                # a directory made at the new name since the lookup (another
                # process): rename(2)'s answer, not a missing name
                raise ViewError(errno.EISDIR, f"{join_key(new_parent.path, new_name)}: is a directory") from None
            raise
        finally:
            await self.release(handle)
        if buf is not None and buf.key is None:
            self.buffers.pop(node.path, None)  # scratch: nothing stored to remove
        else:
            await self._unlink(parent, name, moving=True)
        await self._move_writers(node.path, new_parent, new_name)

    async def _rename_link(self, node: Node, new_parent: Node, new_name: str, noreplace: bool = False) -> None:
        """rename(2) of a symbolic link: the link itself moves (renameat),
        replacing a file at the new name; never what it names."""
        new_parent = await self._fresh(new_parent)
        new_key = await self._link_key(new_parent, new_name, node.link)
        existing = await self.lookup(new_parent, new_name)
        if noreplace and (existing is not None or join_key(new_parent.path, new_name) in self.buffers):
            raise ViewError(errno.EEXIST, f"{join_key(new_parent.path, new_name)}: exists")
        if existing is not None and existing.is_dir:
            raise ViewError(errno.EISDIR, f"{new_name}: is a directory")
        detached, buf, was_dirty = [], None, False
        if existing is not None:
            async with self._no_store_of(existing.path):  # (its PUT lands first, then the link replaces it)
                detached = self._detach_writers(existing.path)
                buf = self.buffers.pop(existing.path, None)
                if buf is not None:
                    # (replaced: a close queued to store it stores nothing)
                    was_dirty, buf.dirty = buf.dirty, False
        try:
            # (noreplace: in storage too, where another process may have taken the name since the lookup)
            await self.store.move_link(node.key, new_key, noreplace=noreplace)
        except BaseException as exc:
            if existing is not None:
                self._put_back(existing.path, buf, was_dirty, detached, exc)
            if isinstance(exc, StoreError) and exc.errno in (errno.EXDEV, errno.EEXIST, errno.EISDIR):
                # (another file system mounted inside the store: an answer, mv copies the link; the
                # name taken meanwhile, RENAME_NOREPLACE; a directory made there since the lookup)
                raise ViewError(exc.errno, str(exc)) from None
            raise

    async def _link_key(self, parent: Node, name: str, target: str | None) -> str:
        """The store key a symbolic link named ``name`` in ``parent``, holding
        ``target``, is made at: only where the view passes names through
        (EPERM in a sharded array's chunk namespace and at a metadata
        document's name, which the view derives; and where the store has no
        links: S3, or every link followed by -o follow_symlinks), and only if
        the view would show it (EPERM for one leading out of the mount)."""
        if not self.store.symlinks:
            raise ViewError(errno.EPERM, f"{name}: this mount shows no symbolic links (an S3 store has none; "
                                         "-o follow_symlinks follows them)")
        if self._in_dataset(parent):
            raise ViewError(errno.EPERM, f"{join_key(parent.path, name)}: no symbolic links in a chunk namespace")
        key = join_key(parent.key, name)
        if self._derived(await self.dataset_at(parent.key), name, key):
            raise ViewError(errno.EPERM, f"{join_key(parent.path, name)}: a name the view derives; no symbolic link")
        if target is not None and not _stays_in_view(parent.path, target):
            raise ViewError(errno.EPERM, f"{join_key(parent.path, name)} -> {target!r}: a symbolic link there would "
                                         "lead out of the mount (absolute, climbing above its root, or '..' after "
                                         "a name)")
        return key

    async def symlink(self, parent: Node, name: str, target: str) -> Node:
        """symlink(2): a link holding ``target`` as given (the client's
        kernel resolves it), made only where names pass through and only if
        it stays in the view (see :func:`_stays_in_view`)."""
        with self._under_way(join_key(parent.path, name)):
            return await self._symlink(parent, name, target)

    async def _symlink(self, parent: Node, name: str, target: str) -> Node:
        self._check_writable()
        self._check_name(name)
        parent = await self._fresh(parent)
        key = await self._link_key(parent, name, target)
        if await self.lookup(parent, name) is not None:
            raise ViewError(errno.EEXIST, f"{name}: exists")
        info = await self.store.symlink(key, target)
        self._made_in(parent.path)
        return self._link_node(join_key(parent.path, name), info)

    async def link(self, node: Node, new_parent: Node, new_name: str) -> Node:
        """A hard link, made as a copy: a new file ``new_name`` holding the
        bytes ``node`` holds now; EEXIST if the name is taken.  The view's
        files cannot have two names (a chunk is a slot in a shard), but the
        pattern that links is write-once: zarr-python's exclusive create
        writes a temporary, links it to the name (failing if it exists) and
        unlinks the temporary.  Links are made one at a time, so two made
        at once cannot both find the name free."""
        with self._under_way(node.path, join_key(new_parent.path, new_name)):
            return await self._link(node, new_parent, new_name)

    async def _link(self, node: Node, new_parent: Node, new_name: str) -> Node:
        self._check_writable()
        self._check_name(new_name)
        if node.is_dir:
            raise ViewError(errno.EPERM, f"{node.path}: a directory cannot be linked")
        if node.link is not None:  # (a copy of a symbolic link: another link of the same text)
            return await self.symlink(new_parent, new_name, node.link)
        async with self._linking:
            if await self.lookup(new_parent, new_name) is not None:
                raise ViewError(errno.EEXIST, f"{new_name}: exists")
            self._check_size(node, node.size)  # (the copy is held whole, as any file written)
            buf = self.buffers.get(node.path)
            # the bytes the view shows: a rewritten document as rewritten
            # (unlike a rename, whose copy keeps the stored form), so that
            # ``cp -al`` of an array makes the array it shows
            data = bytes(buf.data) if buf is not None else await self.content(node) if node.is_chunk else \
                node.document if node.document is not None else await self._stored_bytes(node, recent_ok=True)
            await self.writeback.wait_for_room()
            handle = await self.create(new_parent, new_name)
            try:
                await self.write(handle, 0, data, held_by_renames=False)
                await self.flush(handle, held_by_renames=False)
            finally:
                await self.release(handle)
            made = await self.lookup(new_parent, new_name)
        if made is None:
            raise ViewError(errno.ENOENT, f"{new_name}: gone as soon as linked")
        return made

    def _detach_writers(self, path: str, keep: Handle | None = None) -> list[tuple[Handle, object, object]]:
        """Handles still open for writing on a file that is being unlinked or
        replaced by a rename write to that old file from now on, as on POSIX:
        what they write afterwards is lost with it, and never overwrites or
        brings back the name.  ``keep``: a handle of the new file at the name
        (a rename detaches the old one's writers once its new file holds the
        name), which stays, with the handles sharing its file.  Returns what
        it did, (handle, its file before, the old file's copy) each, for
        :meth:`_reattach_writers` to undo if the change then fails."""
        handles = self.writers.pop(path, ())
        if keep is not None:
            stay = {h for h in handles if h is keep or (keep.buffer is not None and h.buffer is keep.buffer)}
            if stay:
                self.writers[path] = stay
            handles = [h for h in handles if h not in stay]
        # handles that shared one file go on sharing one (the old file)
        old_files: dict[int, tuple[object, FileBuffer | DirtyChunk]] = {}  # id of the shared -> it, its copy
        done = []
        for h in handles:
            if h.buffer is not None:
                shared = h.buffer
                shared.handles -= 1
                h.buffer = old_files.setdefault(id(shared), (shared, FileBuffer(
                    shared.path, None, bytearray(shared.data), handles=0)))[1]
                h.buffer.handles += 1
                done.append((h, shared, h.buffer))
            elif h.chunk is not None:
                t, shared = h.node.target, h.chunk
                self.writeback.close_chunk(t.shard_key, t.chunk_id, shared)
                h.chunk = old_files.setdefault(id(shared), (shared, DirtyChunk(bytearray(shared.data or b""), 0)))[1]
                done.append((h, shared, h.chunk))
        return done

    def _put_back(self, path: str, buf: FileBuffer | None, was_dirty: bool,
                  detached: list[tuple[Handle, object, object]], exc: BaseException) -> None:
        """An unlink or a rename onto ``path`` that failed changes nothing: the
        file keeps its name, its unstored bytes (``buf``, taken off the name
        with its dirty state ``was_dirty``) and its writers (``detached``) --
        unless the request was given up at its deadline (Unavailable) and may
        land after all, or the name holds another file meanwhile."""
        if buf is not None and not isinstance(exc, Unavailable) and path not in self.buffers:
            self.buffers[path] = buf
            buf.dirty = buf.dirty or was_dirty
            self._reattach_writers(detached)

    def _reattach_writers(self, detached: list[tuple[Handle, object, object]]) -> None:
        """Undo :meth:`_detach_writers` (the unlink or rename failed, so the
        file is still the one at its name): its handles write to it again,
        with what they wrote meanwhile to the old file.  A plain
        file's buffer must be the name's again (the caller puts it back); a
        chunk's is its shard's pending chunk, opened again (a failed
        rename's create may have emptied it: it gets the old file's bytes)."""
        for h, shared, old in detached:
            if h.buffer is old:
                old.handles -= 1
                h.buffer = shared
                shared.handles += 1
                if old.version and shared.data != old.data:  # (written meanwhile)
                    shared.data[:] = old.data
                    shared.changed()
            elif h.chunk is old:
                t, dataset = h.node.target, h.node.dataset
                chunk = self.writeback.open_chunk(t.shard_key, dataset.shard_format, t.shard_ctx, t.chunk_id,
                                                  bytes(old.data), t.capacity, dataset.shard_home)
                if chunk.data != old.data:
                    chunk.data[:] = old.data
                    self.writeback.changed(t.shard_key, chunk)
                    self._chunk_changed(t)
                h.chunk = chunk
            else:
                continue  # (moved on since: not the detached one's)
            self._writer(h)

    async def _move_writers(self, path: str, new_parent: Node, new_name: str) -> None:
        """Handles still open for writing on a renamed file write to its new
        name from now on, as on POSIX, where the open file is what moved.
        (Python's ``with open(tmp) as f: ...; os.replace(tmp, final)`` writes
        its buffered bytes only after the rename.)"""
        handles = self.writers.pop(path, ())
        if not handles:
            return
        node = await self.lookup(new_parent, new_name) or await self._stored_as_is_node(new_parent, new_name)
        if node is None:  # (a name just written: not expected; never a crash if it happens)
            self.writers[path] = set(handles)
            self._detach_writers(path)
            return
        for h in handles:
            moved = await self.open(node, write=True, truncate=False)
            self._not_writer(moved)
            if h.buffer is not None:
                h.buffer.handles -= 1  # the old name's buffer: removed by the rename
            elif h.chunk is not None:
                t = h.node.target
                self.writeback.close_chunk(t.shard_key, t.chunk_id, h.chunk)
            h.node, h.buffer, h.chunk = moved.node, moved.buffer, moved.chunk
            self._writer(h)

    async def _stored_as_is_node(self, parent: Node, name: str) -> Node | None:
        """A shard written as is (a name the view hides: not looked up, not
        listed), as a plain stored file: what a handle renamed onto it (as
        tensorstore renames each shard into place while still open) goes on
        writing to."""
        parent = await self._fresh(parent)
        dataset, rel = (parent.dataset, parent.rel + (name,)) if self._in_dataset(parent) else (
            await self.dataset_at(parent.key), (name,))
        key = dataset.stored_as_is(rel) if dataset is not None else None
        if key is None:
            return None
        info = await self.store.stat(key)
        return await self._stored_file(join_key(parent.path, name), info) if info is not None else None
