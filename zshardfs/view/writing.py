"""Writing: opens for writing, write buffers, truncate, flush/fsync/sync,
storing the files held in memory (back-pressure, retries), scratch files,
the chunks written here (``new_chunks``) and the datasets made here.

A mixin of ``View`` (``view/__init__.py`` holds the state it uses).
"""

from __future__ import annotations

import contextlib
import copy
import errno
import functools
import logging
import time

from ..backends.base import CorruptData, DirectoryAtKey, NotFound, StoreError, Unavailable, held_by_deadline
from ..layouts import LAYOUTS
from ..logonce import log_once
from ..together import off_loop
from ..writeback import DirtyChunk
from .nodes import (DirectoryInTheWay, FileBuffer, Handle, MAX_FILE, METADATA_ERRORS, Node, ViewError,
                    _could_be_chunk, _json_object, _parent, _prefix)

log = logging.getLogger(__package__)  # "zshardfs.view" (as before the split): log lines name it


class WritingMixin:
    """``View``'s writing methods (the state they use is set up by ``View.__init__``)."""

    # -- writing ------------------------------------------------------------

    def _check_writable(self) -> None:
        if self.read_only:
            raise ViewError(errno.EROFS, "read-only mount")

    def _check_chunk_writable(self, node: Node) -> None:
        if node.is_chunk and not node.target.writable:
            message = f"{node.path}: the view cannot store this file (read-only part of the dataset)"
            log_once(log, logging.WARNING, message)
            raise ViewError(errno.EPERM, message)

    def _index_new_chunk_dir(self, path: str) -> None:
        """``path`` (a directory of ``new_chunks``) and the directories
        leading to it are listed in ``_new_chunk_dirs`` under their parents."""
        while path:
            parent = _parent(path)
            below = self._new_chunk_dirs.setdefault(parent, set())
            if path in below:
                return  # (and so are the ones above)
            below.add(path)
            path = parent

    def _remember_new_chunk(self, node: Node) -> None:
        if _parent(node.path) not in self.new_chunks:
            self._index_new_chunk_dir(_parent(node.path))
        names = self.new_chunks.setdefault(_parent(node.path), {})
        self._new_chunks_count += node.name not in names
        names[node.name] = (node.dataset, node.rel, node.target)
        if node.dataset.root in self.born_here:
            self.born_here[node.dataset.root] = time.monotonic()
            path = _parent(node.path)
            for _ in node.rel[:-1]:
                self.written_dirs.add(path)
                self.removed_dirs.discard(path)
                path = _parent(path)

    def open_reader(self, node: Node) -> Handle:
        """:meth:`open` for reading.  Synchronous (it never waits): the
        kernel's most frequent request after a lookup, and its caller may
        count on nothing changing between its own checks and this."""
        if node.link is not None:  # (the kernel resolves links itself: never asked)
            raise ViewError(errno.ELOOP, f"{node.path}: a symbolic link")
        if node.damage is not None:  # (shown with size 0: the kernel would read nothing and say so)
            raise CorruptData(node.damage, node.target.shard_key)
        handle = Handle(node)
        if node.target is not None and not self.read_only:  # (a chunk: only writes of this mount remove it under them)
            self.readers.setdefault(node.path, set()).add(handle)
        buf = self.buffers.get(node.path)
        if buf is not None and buf.key is None:
            # a scratch file exists only in memory: the reader keeps its
            # bytes, also once it is unlinked or dropped (POSIX), and it
            # is not dropped while read (_drop_abandoned_scratch)
            handle.buffer = buf
            buf.readers += 1
        elif node.key is None and node.target is None and not node.is_dir:
            raise ViewError(errno.ENOENT, f"{node.path}: no longer exists")
        return handle

    async def open(self, node: Node, *, write: bool, truncate: bool) -> Handle:
        if not write:
            return self.open_reader(node)
        if node.link is not None:  # (the kernel resolves links itself: never asked)
            raise ViewError(errno.ELOOP, f"{node.path}: a symbolic link")
        self._check_writable()
        with self._under_way(node.path):
            return await self._open_writer(node, truncate)

    @contextlib.contextmanager
    def _under_way(self, *paths: str):
        """While held, a request at ``paths`` is under way (an open for
        writing, a create, mkdir, rmdir, unlink, symlink, link, truncate, a
        file's rename): it awaits before it acts, and then acts at the paths
        and keys it resolved first, so a directory above one of them is not
        renamed meanwhile (:meth:`_quiet_below`: EXDEV, ``mv`` copies); it
        would make the old directory again, or act on nothing there."""
        for path in paths:
            self._opening[path] = self._opening.get(path, 0) + 1
        try:
            yield
        finally:
            for path in paths:
                if self._opening[path] <= 1:
                    del self._opening[path]
                else:
                    self._opening[path] -= 1

    async def _open_writer(self, node: Node, truncate: bool) -> Handle:
        """open for writing: while it awaits (the node's freshness, the
        chunk's content, room for a buffer) it is counted in ``_opening``, so
        a directory above is not renamed under it: it would then open, and
        store, under the old key (making the old directory again)."""
        node = await self._fresh(node)
        if node.is_chunk:
            t = node.target
            if t.capacity is None:
                t = node.target = node.dataset.target(node.rel) or t
            self._check_chunk_writable(node)
            await self.writeback.refuse_if_damaged(t.shard_key, node.dataset.shard_format, t.shard_ctx,
                                                   (t.chunk_id,), f"a write of {node.path}")
            initial = b""
            for _ in range(8) if not truncate else ():
                # a write of this mount that lands while the content is read
                # (and is flushed and closed meanwhile) must not be undone by
                # a buffer made from what was there before it
                before = self._chunk_version(t)
                initial = await self.content(node)
                if self._chunk_version(t) == before:
                    break
            chunk = self.writeback.open_chunk(t.shard_key, node.dataset.shard_format, t.shard_ctx, t.chunk_id,
                                              initial, t.capacity, node.dataset.shard_home, stored=not truncate,
                                              mtime_ns=node.mtime_ns)
            if truncate and len(chunk.data):
                del chunk.data[:]
                self.writeback.changed(t.shard_key, chunk)
                self._chunk_changed(t)
            self._remember_new_chunk(node)
            return self._writer(Handle(node, True, chunk=chunk))
        buf = self.buffers.get(node.path)
        if buf is None:
            await self._room_for_files(node.path)
            # what the view shows (a rewritten document, mapped back if it
            # is changed), so readers see the same bytes while it is open
            data = b"" if truncate else node.document if node.document is not None else await self._stored_bytes(node)
            # another open may have made one while we read: share it
            buf = self.buffers.get(node.path)
            if buf is None:
                # (its mtime stays the stored one until it changes: an open
                # that writes nothing, ``touch -d``, changes no time)
                buf = self.buffers[node.path] = FileBuffer(node.path, node.key, bytearray(data),
                                                           mtime_ns=node.mtime_ns if not truncate and node.mtime_ns else time.time_ns())
        if truncate and (buf.data or node.size):  # (``: > f`` empties f, written to or not)
            del buf.data[:]
            buf.changed()
        buf.handles += 1
        return self._writer(Handle(node, True, buffer=buf))

    def _writer(self, handle: Handle) -> Handle:
        self.writers.setdefault(handle.node.path, set()).add(handle)
        return handle

    def _not_writer(self, handle: Handle) -> None:
        for registry in (self.writers, self.readers):
            handles = registry.get(handle.node.path)
            if handles is not None:
                handles.discard(handle)
                if not handles:
                    del registry[handle.node.path]

    async def _keep_for_readers(self, node: Node) -> None:
        """Readers that have chunk ``node`` open go on reading what it holds
        now, as on POSIX, once it is unlinked or replaced."""
        handles = self.readers.pop(node.path, ())
        if not handles:
            return
        try:
            data = await self.content(node)
        except StoreError:
            return  # nothing readable to keep; their reads fail as the file's would
        for h in handles:
            h.chunk = DirtyChunk(bytearray(data), 0)

    async def _stored_bytes(self, node: Node, recent_ok: bool = False) -> bytes:
        """The stored bytes of ``node``'s file.  ``recent_ok`` (a rename's
        copy only): bytes this mount stored a moment ago will do, with the
        staleness of a listing (2.5).  An open for an in-place write reads the
        store: else it would write this mount's older bytes back over another
        client's newer version."""
        if node.key is None:
            return b""
        written = self.store.written(node.key) if recent_ok else None
        if written is not None:
            return written
        try:
            return (await self.store.get(node.key)).data
        except NotFound:
            return b""

    async def write(self, handle: Handle, offset: int, data: bytes, held_by_renames: bool = True) -> int:
        if not handle.writable:
            raise ViewError(errno.EBADF, "not open for writing")
        if held_by_renames:
            await self._while_renamed(handle)
        if handle.buffer is None:
            # back-pressure first: a write refused with a flush's error
            # leaves nothing behind to be stored later
            await self.writeback.wait_for_room()
            if held_by_renames:
                await self._while_renamed(handle)  # (a rename may have begun meanwhile)
        target = handle.buffer.data if handle.buffer is not None else handle.chunk.data
        if handle.append and offset > len(target or b""):
            # the kernel appends at the end it holds, past this file's: another
            # client made it shorter within attr_timeout.  Appended at the end
            # here (no hole of zeros).  A lower offset is honoured: the kernel
            # was told a grown end at the open, and writes back a page of a
            # shared mapping of an O_APPEND descriptor where it lies, as ext4
            offset = len(target or b"")
        self._check_size(handle.node, offset + len(data))
        if target is None:  # the chunk was unlinked while open: keep writing into a fresh buffer
            handle.chunk.data = target = bytearray()
        if offset > len(target):
            target.extend(b"\0" * (offset - len(target)))
        target[offset: offset + len(data)] = data
        if handle.buffer is not None:
            handle.buffer.changed()
        else:
            self.writeback.changed(handle.node.target.shard_key, handle.chunk)
            self._chunk_changed(handle.node.target)
        return len(data)

    def _check_size(self, node: Node, size: int) -> None:
        """A file written is held whole in memory until stored (and a chunk
        with its whole shard when that is rewritten): past MAX_FILE, or
        ``max_dirty`` if larger, it is refused (EFBIG), not left to exhaust
        memory (``truncate -s 100G``, a ``dd seek=`` far out)."""
        limit = max(MAX_FILE, self.writeback.max_dirty_bytes)
        if size > limit:
            message = f"{node.path}: {size} bytes is more than a file written through the view may hold ({limit})"
            log_once(log, logging.WARNING, message)
            raise ViewError(errno.EFBIG, message)

    async def truncate(self, node: Node, size: int, handle: Handle | None = None) -> Node:
        with self._under_way(node.path):  # (until the node it answers is made: see _under_way)
            return await self._truncate(node, size, handle)

    async def _truncate(self, node: Node, size: int, handle: Handle | None) -> Node:
        self._check_writable()
        self._check_size(node, size)
        if handle is not None and handle.writable:
            await self._while_renamed(handle)
            node = handle.node  # (moved, if it was renamed meanwhile)
        # (to 0 by path: as O_TRUNC, without reading the old bytes, which a
        # damaged chunk does not have and a large file need not load)
        own = handle if handle is not None and handle.writable else await self.open(node, write=True,
                                                                                     truncate=size == 0)
        data = own.buffer.data if own.buffer is not None else own.chunk.data
        if size < len(data):
            del data[size:]
        else:
            data.extend(b"\0" * (size - len(data)))
        if own.buffer is not None:
            own.buffer.changed()
        else:
            self.writeback.changed(node.target.shard_key, own.chunk)
            self._chunk_changed(node.target)
        if own is not handle:
            try:
                await self.flush(own)
            finally:
                await self.release(own)  # (also when storing failed: no handle left behind)
        return (await self.refresh(node)) or node

    async def flush(self, handle: Handle, held_by_renames: bool = True) -> None:
        """close(2): passthrough files are stored now (errors reach close)."""
        if handle.writable and held_by_renames:
            await self._while_renamed(handle)  # (else it would store the old name again)
        buf = handle.buffer
        if buf is None or not buf.dirty or buf.key is None:
            return
        if await self._not_at_close(buf):
            return
        await self._store_buffer(buf)

    async def _not_at_close(self, buf: FileBuffer) -> bool:
        """Is ``buf`` (dirty, with a key) one a close leaves in memory?"""
        if await self._is_scratch_in_dataset_root(buf):
            return True  # stored at fsync/sync, or moved by a rename before that
        # an emptied metadata document (``> zarr.json``, ``truncate -s 0``):
        # its text is about to follow, and the dataset, which the stored
        # document still describes, keeps its chunk files meanwhile;
        # stored empty only at fsync, sync or unmount
        return self._is_dataset_document(buf.key) and not buf.data.strip() and await self._describes_datasets(buf)

    async def _is_scratch_in_dataset_root(self, buf: FileBuffer) -> bool:
        # asked of the dataset, not of the probe cache: a temporary held open
        # longer than the metadata TTL must not land in the store
        if self._is_dataset_document(buf.key):
            return False
        dataset = await self.dataset_at(_parent(buf.key))
        return dataset is not None and dataset.stored_as_is((buf.key.rsplit("/", 1)[-1],)) is None

    async def _store_buffer(self, buf: FileBuffer) -> None:
        async with held_by_deadline(buf.storing, buf.key or buf.path, "another store of it"):
            if buf.dirty and buf.key is not None:
                try:
                    try:
                        await self._store_buffer_now(buf)
                    except DirectoryAtKey as exc:
                        # another client made a directory at its key: the
                        # close, fsync or sync storing it answers EIO, as a
                        # file system whose write-back fails (ENOENT, a
                        # missing name, for a file open and found, was no
                        # answer, and went unlogged); a rename answers EISDIR
                        raise DirectoryInTheWay(f"{buf.path}: not stored: storage holds a directory at its key "
                                                f"{buf.key} (made by another client); the file stays in memory "
                                                "under its name (rename it through the mount to store it)",
                                                buf.key) from exc
                except ViewError:
                    raise  # (refused for good: not held)
                except StoreError as exc:
                    buf.error = exc
                    if isinstance(exc, Unavailable):
                        buf.maybe_stored = True
                    raise
                buf.error = None

    #: seconds between the tries of creates and opens that find the files
    #: storage refused over ``max_dirty`` to store them (see _room_for_files)
    HELD_RETRY = 1.0

    def _held_over(self) -> tuple[int, StoreError] | None:
        """The bytes of the files storage refused and the last refusal, if
        those, with the dirty chunks, hold more than ``max_dirty``."""
        held, error = 0, None
        for buf in self.buffers.values():
            if buf.error is not None and buf.dirty:
                held += len(buf.data)
                error = buf.error
        if error is None or held + self.writeback.dirty_bytes <= self.writeback.max_dirty_bytes:
            return None
        return held, error

    async def _room_for_files(self, path: str) -> None:
        """Back-pressure on files held whole in memory: while storage refuses
        them (ENOSPC, an S3 outage) and those refused, with the dirty chunks,
        hold more than ``max_dirty``, no other file is made or opened for
        writing.  Such a create or open first tries to store them, as a close
        would (at most one try every HELD_RETRY, stopping at the first
        failure: storage may work again, and nothing else would store them
        before a close, fsync or sync); refused, it gets that failure's
        error, or the last refusal's at once between tries."""
        if self._held_over() is None:
            return
        now = time.monotonic()
        if now - self._held_tried_at >= self.HELD_RETRY:
            self._held_tried_at = now
            for buf in [b for b in self.buffers.values() if b.error is not None and b.dirty]:
                if self.buffers.get(buf.path) is not buf or buf.key is None or not buf.dirty \
                        or await self._not_at_close(buf):
                    continue
                try:
                    await self._store_buffer(buf)
                except ViewError:
                    continue  # (a document refused for good: dropped, not held)
                except StoreError:
                    break  # (storage still refuses: refused below with this error)
        over = self._held_over()
        if over is None:
            return
        held, error = over
        log_once(log, logging.WARNING, f"{path}: refused: {held >> 20} MiB of files storage refused wait in "
                                       f"memory, over max_dirty (the last refusal: {error})",
                 tag="files held for want of storage", interval=60)
        raise copy.copy(error)

    async def _store_buffer_now(self, buf: FileBuffer) -> None:
        version, written = buf.version, bytes(buf.data)
        data = written
        stored = None  # the document replaced: what the key holds now, or the one this mount removed there
        # (an editor's save, rm and put back: the array's directories stay what
        # they were, even if none of its chunks is left; see born_here below)
        removed = self.removed_documents.get(buf.key)
        resaved = removed is not None
        replaced = None  # the document stored there (a JSON object), if any
        for layout in LAYOUTS:
            if layout.is_document(buf.key) and hasattr(layout, "accept_document"):
                blob = await self.store.get_or_none(buf.key)
                # only a document stands for one (an empty or broken file there
                # does not: ``> zarr.json`` stores an empty one first); then the
                # one this mount removed there, if its chunks remain; else none:
                # a new document, as layouts judge one
                a_stored_document = blob is not None and await off_loop(
                    functools.partial(_json_object, blob.data), len(blob.data))
                stored = blob.data if a_stored_document else await self._removed_document(buf.key)
                replaced = blob.data if a_stored_document else None
                if stored is None and removed is not None and data == removed:
                    # the very document this mount removed there, put back (``mv``
                    # away and back) after the last chunk went: not a new array
                    # written through the view, but the store's own document
                    stored = removed
                # a layout that needs to read storage to decide (members'
                # documents, what the directory already holds) offers an
                # async variant
                accept = getattr(layout, "accept_document_async", None)

                async def judge(doc: bytes, layout=layout, accept=accept, stored=stored,
                                a_stored_document=a_stored_document):
                    if accept is not None:
                        return await accept(self.ctx, buf.key, doc, stored, self.shard_option,
                                            self._pending_children,
                                            previous=None if a_stored_document
                                            else self.previous_documents.get(buf.key))
                    return await off_loop(functools.partial(layout.accept_document, buf.key, doc, stored,
                                                            self.shard_option), len(doc))
                try:
                    try:
                        accepted = await judge(data)
                    except ValueError:
                        shown = buf.view_form
                        if shown is None or shown == data or buf.version != version:
                            raise
                        # a renamed document whose stored form is refused here:
                        # what the view showed, as a copy would have written
                        accepted = await judge(shown)
                        data = written = shown
                        buf.data[:] = shown
                except ValueError as exc:
                    self._refuse(buf, str(exc))
                except METADATA_ERRORS as exc:
                    # a document of the wrong shape: stored as written (the
                    # view shows it as stored), unless it would replace the
                    # metadata of a dataset the view serves and hide its chunks
                    if await self.dataset_at(_parent(buf.key)) is not None:
                        self._refuse(buf, f"not a document the view can read ({type(exc).__name__}: {exc}); "
                                          "it would hide the dataset's chunks")
                    accepted = None
                if accepted is not None:
                    data = accepted
                    break
        if not buf.in_store and not resaved and self._is_dataset_document(buf.key):
            # a new dataset, if nothing is stored below it yet (see __init__);
            # not one saved again over the document this mount removed: its
            # chunk directories existed, if storage lost them with their last
            # shard, and may hold temporaries and chunks not stored yet
            root = _parent(buf.key)
            listing = await self.store.list(root)
            if not listing.dirs and not any(_could_be_chunk(f.key.rsplit("/", 1)[-1]) for f in listing.files):
                self.born_here[root] = time.monotonic()
        # (a shard written as is: newer than the chunk writes pending for it,
        # and its chunks show at once)
        made_of = []
        a_document = self._is_dataset_document(buf.key) and await off_loop(
            functools.partial(_json_object, data), len(data))
        if replaced is not None and not a_document:
            # emptied (``truncate``, ``> zarr.json``) or broken: the text to come
            # is judged against the document it replaces too
            self._keep_previous(buf.key, replaced)
        shrinking = [(d, ds) for d, ds in await self._datasets_made_of(buf.key, stored)
                     if ds.prunes_on_shrink] if stored and a_document else []
        if stored and self._is_dataset_document(buf.key) and not a_document:
            # no document any dataset can be made of, over one that was: as if
            # removed (4.15), its datasets keep their chunk files
            made_of = await self._datasets_made_of(buf.key, stored)
        if stored and a_document:
            await self._store_removals_first(buf.key, stored)
        info = await self.writeback.superseding(buf.key, functools.partial(self.store.put, buf.key, data,
                                                                           like=buf.like))
        buf.like = buf.view_form = None
        self.shards.forget(buf.key)
        if self._is_dataset_document(buf.key):
            self._document_changed(buf.key)
            if made_of:
                self._orphan(buf.key, stored, made_of)
            for dir_key, before in shrinking:
                await self._prune_outside(dir_key, before)
            if a_document:  # (not an empty or broken file: the text may be still to come)
                self._forget_removed(buf.key)
                self._forget_previous(buf.key)
        self.own_versions[buf.key] = (info.etag, time.monotonic(), len(data))
        self.own_versions.move_to_end(buf.key)
        if len(self.own_versions) > 4096:
            self.own_versions.popitem(last=False)
        if data != written:
            # mapped back to its stored form: the view goes on showing what
            # was written (the kernel holds that size), not a re-rendering
            self.documents.put((buf.key, info.etag), written)
        if buf.version == version:  # else a write came in meanwhile: still dirty
            buf.dirty = False
        buf.in_store = True
        if self.new_dirs and buf.path == buf.key and not self.store.keeps_empty_dirs:
            self._stored_below(buf.key)
        self.datasets.pop(_parent(buf.key))
        self.datasets.pop(buf.key)

    async def fsync(self, handle: Handle) -> None:
        if handle.writable:
            await self._while_renamed(handle)
        # (a read-only descriptor's fsync stores the file too, as on POSIX:
        # what other handles wrote there is held under its name)
        buf = handle.buffer or self.buffers.get(handle.node.path)
        if buf is not None:
            if buf.dirty and buf.key is not None:
                await self._store_buffer(buf)
            return
        if handle.node.is_chunk:
            await self.writeback.flush(handle.node.target.shard_key)

    async def fsync_dir(self, node: Node) -> None:
        """fsync(2) of a directory: what was renamed into it, written or
        removed there is stored before the answer.  tensorstore (and any
        careful writer) writes a temporary, renames it over the chunk and
        fsyncs the directory, and takes the write as durable then.  A chunk
        directory's names are entries of shard indexes: the dirty shards of
        the chunks opened for writing in it (``new_chunks``) are flushed, and
        those of its dataset holding a removed chunk.  Elsewhere nothing waits:
        plain files are stored at close, renamed and removed at once."""
        if self.read_only:
            return
        keys = {target.shard_key for _, _, target in self.new_chunks.get(node.path, {}).values()}
        dataset = node.dataset
        if dataset is None and node.key is not None:
            dataset = await self.dataset_at(node.key)  # (a dataset's root: precomputed chunks live there)
        if dataset is not None:
            keys.update(self.writeback.removing_below(dataset.shard_home))
        await self.writeback.flush_keys(keys)

    #: seconds a closed scratch file (a temporary inside a chunk directory,
    #: never renamed to a chunk's name) is kept: one a killed writer left
    #: (rsync, zarr-python) would otherwise hold memory, and keep its array
    #: from being forgotten (``_forget_quiet_datasets``), until unmount
    SCRATCH_KEEP = 600.0

    def _drop_abandoned_scratch(self) -> None:
        """Discard scratch files closed and untouched for SCRATCH_KEEP (one
        log line for all), at most every tenth of that: run per create, so
        the memory they hold is bounded by what is being written."""
        now = time.time()
        if now - self._scratch_swept_at < self.SCRATCH_KEEP / 10:
            return
        self._scratch_swept_at = now
        old = [b for b in self.buffers.values()
               if b.key is None and b.handles <= 0 and b.readers <= 0 and now - b.mtime_ns / 1e9 >= self.SCRATCH_KEEP]
        for buf in old:
            del self.buffers[buf.path]
        if old:
            log.warning("%s%s: temporary file%s inside a sharded array, closed %d s ago and never renamed; discarded",
                        old[0].path, f" and {len(old) - 1} more" if len(old) > 1 else "",
                        "s" if len(old) > 1 else "", int(self.SCRATCH_KEEP))

    def release_reader(self, handle: Handle) -> None:
        """:meth:`release` of a handle open for reading: synchronous, as
        :meth:`open_reader`.  A reader's chunk, if any, is its private copy
        (4.1); only the readers' registry can hold a reader, and only on a
        writable mount: the common close costs no look-up at all."""
        if self.readers:
            handles = self.readers.get(handle.node.path)
            if handles is not None:
                handles.discard(handle)
                if not handles:
                    del self.readers[handle.node.path]
        if handle.buffer is not None:
            handle.buffer.readers -= 1

    async def release(self, handle: Handle) -> None:
        """The last close of ``handle``.  Must not wait on storage: RELEASE
        has no request deadline (see fuse_ops.release)."""
        if not handle.writable:
            self.release_reader(handle)
            return
        self._not_writer(handle)
        if handle.buffer is not None:
            buf = handle.buffer
            buf.handles -= 1
            if buf.handles <= 0 and not buf.dirty and self.buffers.get(buf.path) is buf:
                del self.buffers[buf.path]
        elif handle.chunk is not None:
            t = handle.node.target
            self.writeback.close_chunk(t.shard_key, t.chunk_id, handle.chunk)
            # bounded: prune once the table has doubled since the last prune
            if self._new_chunks_count > 2 * max(512, self._new_chunks_pruned_at):
                self._prune_new_chunks()

    async def sync(self, refused: list[ViewError] | None = None, final: bool = False) -> list[StoreError]:
        """Store everything that is only in memory (sync, unmount, SIGTERM).
        Documents refused for good (logged; their buffers are gone, so no
        later round retries them) are added to ``refused``, if given.
        ``final`` (unmount, SIGTERM): temporary files inside sharded arrays
        that were closed but never renamed to a chunk's name are discarded;
        a ``zshardfs sync`` keeps them (zarr-python renames its temporary
        right after closing it: a sync in between must not lose the chunk)."""
        errors, discarded = [], []
        for buf in list(self.buffers.values()):
            if buf.dirty and buf.key is not None:
                try:
                    await self._store_buffer(buf)
                except ViewError as exc:
                    if refused is not None:
                        refused.append(exc)
                except StoreError as exc:
                    errors.append(exc)
                except Exception as exc:  # a bug must not keep the shards below from being stored
                    log.exception("storing %s failed", buf.key)
                    errors.append(StoreError(f"{buf.key}: {type(exc).__name__}: {exc}", buf.key))
            elif buf.key is None and buf.handles <= 0 and final:
                discarded.append(buf.path)
                del self.buffers[buf.path]
        if discarded:  # (one line for all: a cp -r to a name that is no chunk's makes many)
            log.warning("%s%s: temporary file%s inside a sharded array never renamed; discarded", discarded[0],
                        f" and {len(discarded) - 1} more" if len(discarded) > 1 else "",
                        "s" if len(discarded) > 1 else "")
        errors += await self.writeback.sync_all()
        self._prune_new_chunks()
        return errors

    def _prune_new_chunks(self) -> None:
        """Forget created chunk names that storage now lists by itself."""
        self.new_chunks = {d: {n: c for n, c in names.items()
                               if self.writeback.pending(c[2].shard_key, c[2].chunk_id) is not None}
                           for d, names in self.new_chunks.items()}
        self.new_chunks = {d: names for d, names in self.new_chunks.items() if names}
        self._new_chunks_pruned_at = self._new_chunks_count = sum(len(n) for n in self.new_chunks.values())
        self._new_chunk_dirs = {}
        for d in self.new_chunks:
            self._index_new_chunk_dir(d)
        self._forget_quiet_datasets()

    #: seconds a dataset made through this mount must go unwritten (with
    #: nothing of it left to store) before it is treated as any stored one:
    #: a copy into it (``cp -r``, which makes each chunk directory after
    #: writing others) is over by then
    BORN_HERE_QUIET = 60.0

    def _forget_quiet_datasets(self) -> None:
        """Datasets made here that have been quiet long enough become like
        any other: their chunk directories exist where the grid has them, and
        the directories this mount made or wrote there are forgotten.  (Else
        a mount writing new arrays for weeks kept every such directory.)"""
        now = time.monotonic()
        quiet = [root for root, when in self.born_here.items() if now - when >= self.BORN_HERE_QUIET]
        if not quiet:
            return
        busy = {*self.new_chunks, *self.writeback.dirty, *self.buffers}
        for root in quiet:
            below = _prefix(root)
            if any(k.startswith(below) for k in busy):
                continue
            del self.born_here[root]
            self.written_dirs = {p for p in self.written_dirs if not p.startswith(below)}
            self.removed_dirs = {p for p in self.removed_dirs if not p.startswith(below)}
            for d in [d for d in self.new_dirs if d.startswith(below)]:
                self._forget_made_dirs(d, list(self.new_dirs[d]))
