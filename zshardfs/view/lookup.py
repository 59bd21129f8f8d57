"""Path -> node: datasets probed and cached, metadata documents rewritten,
stored files, links and chunk files as nodes, ``lookup``/``resolve``/``refresh``.

A mixin of ``View`` (``view/__init__.py`` holds the state it uses).
"""

from __future__ import annotations

import errno
import functools
import logging
import time

from ..backends.base import AccessDenied, CorruptData, NotFound, ObjectInfo, TooLarge, join_key
from ..layouts import LAYOUTS, precomputed
from ..layouts.base import ChunkEntry, ChunkTarget, Dataset, DirEntry
from ..logonce import log_once
from ..together import first_error, off_loop, outcomes
from .nodes import (FileBuffer, METADATA_ERRORS, Node, ViewError, _not_understood, _parent, _prefix,
                    _stays_in_view)

log = logging.getLogger(__package__)  # "zshardfs.view" (as before the split): log lines name it


class LookupMixin:
    """``View``'s lookup methods (the state they use is set up by ``View.__init__``)."""

    # -- datasets -----------------------------------------------------------

    async def dataset_at(self, dir_key: str) -> Dataset | None:
        """The sharded dataset rooted at a stored directory, if any (cached)."""
        cached = self.datasets.get(dir_key)
        if cached is not None:
            return cached[0]
        previous = self.datasets.expired(dir_key)
        # A probe that was out while this mount stored or removed a document
        # may answer from before that change: not cached, asked again.
        for _ in range(3):
            writes = self.document_writes
            dataset = await self._probe(dir_key)
            if self.document_writes == writes:
                break
        else:
            return dataset or self._orphan_at(dir_key)
        if dataset is None:
            dataset = self._orphan_at(dir_key)
        else:
            self._forget_orphan(dir_key)  # a document is there again (another client's)
        if (dataset is not None and previous is not None and type(previous) is type(dataset)
                and dataset.version and previous.version == dataset.version):
            dataset = previous  # made of the same documents: keep what it has learnt
        self.datasets.put(dir_key, dataset)
        return dataset

    async def _fresh(self, node: Node) -> Node:
        """``node`` as the view resolves it now, if the mount changed a
        metadata document since it was made (its dataset, or its being
        none, may be out of date): the mount's own writes show at once."""
        if node.created >= self._documents_changed_at:
            return node
        fresh = self._fresh_nodes.get(node.path)
        if fresh is None:
            writes = self.document_writes
            fresh = await self.resolve(node.path) if node.path else self.root()
            if fresh is None and self._in_dataset(node):
                # a chunk name (directory, file) the dataset no longer has, its
                # shape shrunk: the kernel may still hold its entry, whose old
                # grid would take chunks the new one hides (stored, never shown)
                raise ViewError(errno.ENOENT, f"{node.path}: outside the chunk grid now")
            if fresh is None and node.is_dir and self.store.keeps_empty_dirs:
                # a directory renamed or removed since (a listing's entry
                # handed to the kernel after its rename): a file or directory
                # made in it would make the old directory again in storage.
                # (On S3 a directory is there while a key is below it: one
                # emptied is made again by a file stored in it, as before)
                raise ViewError(errno.ENOENT, f"{node.path}: no longer exists")
            if fresh is None and "/" in node.path and self.store.keeps_empty_dirs \
                    and await self.resolve(_parent(node.path)) is None:
                # a file whose directory was renamed or removed since: opened
                # for writing, its flush would make the old directory again
                raise ViewError(errno.ENOENT, f"{node.path}: its directory no longer exists")
            if fresh is None:
                return node
            if self.document_writes == writes:  # (else resolved partly before another change)
                if len(self._fresh_nodes) > 4096:
                    self._fresh_nodes.clear()
                self._fresh_nodes[node.path] = fresh
        return fresh

    async def _probe(self, dir_key: str) -> Dataset | None:
        """Every layout asks at once: a directory that is no dataset costs one
        round trip, not one per layout.  The answer is the one asking in
        LAYOUTS order would give: the first dataset found, unless an earlier
        layout's probe failed (that error is raised)."""
        dataset = None
        for answer in await outcomes(*(functools.partial(layout.probe, self.ctx, dir_key) for layout in LAYOUTS)):
            if isinstance(answer, TooLarge):
                log_once(log, logging.WARNING, str(answer))
            elif isinstance(answer, (CorruptData, NotFound, AccessDenied)):
                log.warning("%s: %s", dir_key or "/", answer)
            elif isinstance(answer, METADATA_ERRORS):
                _not_understood(dir_key or "/", answer)
            elif isinstance(answer, Exception):
                raise answer
            elif answer is not None:
                dataset = answer
                break
        return dataset

    # -- nodes --------------------------------------------------------------

    def root(self) -> Node:
        return Node("", True, mtime_ns=self.started_ns, key="")

    async def _document(self, info: ObjectInfo) -> bytes | None:
        """Rewritten bytes of a stored metadata document, or None if shown as is."""
        if not self._is_dataset_document(info.key):
            return None
        cached = self.documents.get((info.key, info.etag))
        if cached is not None:
            return cached[0]
        if info.size > self.store.DOCUMENT_LIMIT:
            log_once(log, logging.WARNING, str(self.store.too_large(info.key, info.size)))
            return None
        try:
            blob = await self.store.get_document(info.key, info.etag)
        except TooLarge as exc:  # grew since it was listed
            log_once(log, logging.WARNING, str(exc))
            return None
        new = None
        for layout in LAYOUTS:
            if layout.is_document(info.key):
                try:  # (a consolidated document can be megabytes of JSON: not on the loop)
                    new = await off_loop(functools.partial(layout.rewrite_document, info.key, blob.data),
                                         len(blob.data))
                except METADATA_ERRORS as exc:
                    _not_understood(_parent(info.key) or "/", exc)  # the probe's words: one line
                    new = None
                if new is not None:
                    break
        # cached under the etag actually read, so a racing replace is not masked
        self.documents.put((info.key, blob.info.etag), new)
        if blob.info.etag != info.etag:
            return await self._document(blob.info)
        return new

    @staticmethod
    async def _shown_form(key: str, data: bytes) -> bytes | None:
        """The bytes the view shows for the document ``data`` stored at
        ``key`` (None: shown as stored)."""
        for layout in LAYOUTS:
            if layout.is_document(key):
                try:
                    new = await off_loop(functools.partial(layout.rewrite_document, key, data), len(data))
                except METADATA_ERRORS:
                    new = None
                if new is not None:
                    return new
        return None

    async def _stored_file(self, path: str, info: ObjectInfo) -> Node:
        try:
            doc = await self._document(info)
        except AccessDenied:  # listed as stored; reading it gives EACCES
            doc = None
        size = len(doc) if doc is not None else info.size
        return Node(path, False, size, info.mtime_ns, key=info.key, document=doc, version=info.etag)

    @staticmethod
    def _link_node(path: str, info: ObjectInfo) -> Node | None:
        """The node of a symbolic link at ``path``, or None (left out, one
        warning) if it would lead the client out of the view."""
        if not _stays_in_view(_parent(path), info.link):
            log_once(log, logging.WARNING, f"{info.key}: a symbolic link (-> {info.link!r}) that leads out of the "
                                           "mount; left out (-o follow_symlinks follows it, for a source no one "
                                           "else can write into)", tag=f"link out: {info.key}", interval=3600)
            return None
        return Node(path, False, info.size, info.mtime_ns, key=info.key, link=info.link)

    def _derived(self, dataset: Dataset | None, name: str, key: str) -> bool:
        """Is ``name`` (stored at ``key``) in a pass-through directory one the
        view derives rather than shows as stored (a dataset's claimed name,
        a metadata document)?  A link there is followed inside the store."""
        return (dataset is not None and dataset.claims((name,))) or self._is_dataset_document(key)

    def _buffer_node(self, buf: FileBuffer) -> Node:
        return Node(buf.path, False, len(buf.data), buf.mtime_ns, key=buf.key)

    def _chunk_node(self, path: str, dataset: Dataset, rel: tuple, entry: ChunkEntry | None,
                    target: ChunkTarget | None) -> Node | None:
        """A chunk file, with unflushed writes taking precedence over storage."""
        if target is None and entry is not None:
            # capacity is only needed for writes; open() asks the dataset then
            target = entry.target
        if target is not None and self.writeback.dirty:
            dirty = self.writeback.pending(target.shard_key, target.chunk_id)
            if dirty is not None:
                if dirty.data is None:
                    return None
                return Node(path, False, len(dirty.data), dirty.mtime_ns, dataset=dataset, rel=rel, target=target)
        if entry is None:
            return None
        return Node(path, False, entry.size, entry.mtime_ns, dataset=dataset, rel=rel, target=target,
                    damage=entry.damage)

    async def _dataset_child(self, path: str, dataset: Dataset, rel: tuple) -> Node | None:
        # read-only: nothing is ever dirty, and the target (with its capacity
        # and writability, which only writes need) comes from the entry
        target = None if self.read_only else dataset.target(rel)
        if target is not None and self.writeback.pending(target.shard_key, target.chunk_id) is not None:
            return self._chunk_node(path, dataset, rel, None, target)
        entry = await dataset.lookup(rel)
        if entry is None:
            if target is not None and self._empty_with_pending(dataset, rel):
                return Node(path, False, 0, time.time_ns(), dataset=dataset, rel=rel, target=target)
            return None
        if isinstance(entry, DirEntry):
            if (dataset.root in self.born_here and path not in self.written_dirs
                    and (path in self.removed_dirs or not await self._listed(dataset, rel))):
                return None  # (made here: as in a directory store, not there until made or stored)
            node = Node(path, True, 0, entry.mtime_ns or self._made_at.get(path, self.started_ns), dataset=dataset,
                        rel=rel)
            if self.removed_dirs and await self._removed_and_empty(node):
                return None
            return node
        return self._chunk_node(path, dataset, rel, entry, target)

    @staticmethod
    async def _listed(dataset: Dataset, rel: tuple) -> bool:
        """Does the listing of ``rel``'s parent show it (something stored
        below it: chunks another client wrote into an array made here)?"""
        async for name, _ in dataset.listdir(rel[:-1]):
            if name == rel[-1]:
                return True
        return False

    def _in_dataset(self, parent: Node) -> bool:
        return parent.dataset is not None and parent.key is None

    async def lookup(self, parent: Node, name: str) -> Node | None:
        """The child ``name`` of directory ``parent``, or None."""
        if parent.created < self._documents_changed_at:  # (else _fresh answers it as it is: no coroutine)
            parent = await self._fresh(parent)
        path = _prefix(parent.path) + name if name and "/" not in name else join_key(parent.path, name)
        buf = self.buffers.get(path)
        if buf is not None:
            return self._buffer_node(buf)
        made = name in self.new_dirs.get(parent.path, ()) or self._still_emptied(path)
        if made and path in self._new_dirs_stored:
            self._new_dirs_stored.move_to_end(path)  # (used: the last to be forgotten)
        if made and self._in_dataset(parent):
            return Node(path, True, 0, self._made_at.get(path, self.started_ns), dataset=parent.dataset,
                        rel=parent.rel + (name,))
        if self._in_dataset(parent):
            return await self._dataset_child(path, parent.dataset, parent.rel + (name,))
        dataset = await self.dataset_at(parent.key)
        if dataset is not None and dataset.claims((name,)):
            if made:  # the chunk directory of an array, made before it held anything
                return Node(path, True, 0, self._made_at.get(path, self.started_ns), dataset=dataset, rel=(name,))
            return await self._dataset_child(path, dataset, (name,))
        if made:
            return Node(path, True, 0, self._made_at.get(path, self.started_ns), key=join_key(parent.key, name))
        key = join_key(parent.key, name)
        info = await self.store.stat(key, listed_ok=True, links=not self._is_dataset_document(key))
        if info is not None and info.link is not None:
            return self._link_node(path, info)
        if info is not None and not (info.size == 0 and await self.store.is_dir(key)):
            return await self._stored_file(path, info)
        if info is not None or await self.store.is_dir(key) or await self._named_by_info(parent.key, name):
            # (an empty object named like a directory, as some S3 tools leave: the directory wins)
            return Node(path, True, 0, self._made_at.get(path, self.started_ns), key=key)
        if self._buffered_below(path):
            # (S3) a file below it is only in memory (its store failed, or is
            # still to come) and storage holds nothing there any more: the
            # directory's last stored file was removed (4.6: never hidden)
            return Node(path, True, 0, self._made_at.get(path, self.started_ns), key=key)
        return None

    def _buffered_below(self, path: str) -> bool:
        """Does a file below directory ``path`` have a write buffer (a file
        made or written here, held in memory until stored)?"""
        prefix = path + "/"
        return any(p.startswith(prefix) for p in self.buffers)

    async def _named_by_info(self, dir_key: str, name: str) -> bool:
        """(S3) Is ``name`` a sharded scale (or annotation index) directory
        that a precomputed ``info`` names, or one on the way to it (a scale
        ``key`` of several names: "s/8_8_8" names ``s`` too)?  It holds only
        shards: with the last one deleted, S3 has nothing left to show it by,
        yet the document still names it, and a chunk written there (``cp``,
        an open for create) needs it, as a local store, which keeps the
        directory, has it.  The documents are those in ``dir_key`` and in
        every directory above it, which the probe of ``dir_key`` has just
        asked for: within ``metadata_ttl`` they cost no request."""
        if self.store.keeps_empty_dirs:
            return False
        return join_key(dir_key, name) in await self._dirs_named_near(dir_key)

    async def _dirs_named_near(self, dir_key: str, own: bool = True) -> set[str]:
        """The directories _info_dirs finds in the ``info`` of ``dir_key``
        (unless not ``own``: the listing shows none) and of every directory
        above it (a scale ``key`` may have any number of names), with every
        directory on the way to each; the documents asked for at once."""
        found: set[str] = set()
        names = dir_key.split("/") if dir_key else []
        holders = ([dir_key] if own else []) + ["/".join(names[:k]) for k in range(len(names) - 1, -1, -1)]

        near = {dir_key, dir_key.rpartition("/")[0]}

        async def dirs(holder: str) -> frozenset[str]:
            key = join_key(holder, "info")
            try:
                blob = await self.store.get_document(key)
            except (NotFound, TooLarge):
                return frozenset()
            except AccessDenied:
                if holder in near:
                    raise
                return frozenset()  # (as the probe takes it: said where it is probed)
            return await self._info_dirs(key, blob)

        answers = await outcomes(*(functools.partial(dirs, holder) for holder in holders))
        error = first_error(answers)
        if error is not None:
            raise error
        for named in answers:
            for d in named:
                while d and d not in found:
                    found.add(d)
                    d = d.rpartition("/")[0]
        return found

    #: parsed ``info`` documents kept by _info_dirs (the least recently used go first)
    INFO_DIRS_KEPT = 256

    async def _info_dirs(self, key: str, blob) -> frozenset[str]:
        """``precomputed.dataset_dirs`` of the ``info`` at ``key`` read as
        ``blob``, parsed once per version (etag): every failed lookup in an
        S3 volume directory asks, and parsing costs about 10 ms per MiB of
        info (off the loop when large, as a document's rewrite)."""
        version = blob.info.etag
        kept = self._info_dirs_kept.get(key)
        if kept is not None and version is not None and kept[0] == version:
            self._info_dirs_kept.move_to_end(key)
            return kept[1]
        dirs = frozenset(await off_loop(functools.partial(precomputed.dataset_dirs, key, blob.data),
                                        len(blob.data)))
        if version is not None:
            self._info_dirs_kept[key] = (version, dirs)
            self._info_dirs_kept.move_to_end(key)
            while len(self._info_dirs_kept) > self.INFO_DIRS_KEPT:
                self._info_dirs_kept.popitem(last=False)
        return dirs

    async def refresh(self, node: Node) -> Node | None:
        """The node as it is now (None: it is gone), for getattr after a TTL."""
        buf = self.buffers.get(node.path)
        if buf is not None:
            return self._buffer_node(buf)
        if node.is_chunk:
            try:  # (a dataset renamed or changed since the node was made: looked up by its path)
                node = await self._fresh(node)
            except ViewError:
                return None
            if not node.is_chunk:
                return await self.refresh(node)
            return await self._dataset_child(node.path, node.dataset, node.rel)
        if node.link is not None:
            link = await self.store.stat(node.key, links=True)
            return self._link_node(node.path, link) if link is not None and link.link is not None else None
        if node.key is not None and not node.is_dir:
            info = await self.store.stat(node.key)
            return await self._stored_file(node.path, info) if info is not None else None
        if node.key is None and not node.is_dir:
            return None  # a scratch file gone (unlinked, or dropped): only memory held it
        return node

    def _empty_with_pending(self, dataset: Dataset, rel: tuple) -> bool:
        """Is ``rel`` a file stored with another (a mesh's fragment data, with
        its manifest) that storage does not hold, while that other is written
        and not stored yet?  It is then empty, not absent: a new mesh's empty
        fragment data, flushed before its manifest, stores nothing."""
        other = dataset.removed_with(rel)
        t = dataset.target(other) if other is not None else None
        pending = self.writeback.pending(t.shard_key, t.chunk_id) if t is not None else None
        return pending is not None and pending.data is not None

    @staticmethod
    def goes_with_another(node: Node) -> bool:
        """Can an unlink of another file remove ``node`` (a mesh's fragment
        data, with its manifest)?  The kernel must then not keep its entry:
        no I/O."""
        return node.is_chunk and node.dataset is not None and node.dataset.removed_with(node.rel) is not None

    async def resolve(self, path: str) -> Node | None:
        """Walk from the root (for tools and tests, not for the kernel)."""
        node = self.root()
        for name in filter(None, path.split("/")):
            if not node.is_dir:
                return None
            node = await self.lookup(node, name)
            if node is None:
                return None
        return node

    async def statfs(self):
        """Capacity of the storage (``os.statvfs_result``), or None if unknown."""
        return await self.store.statfs()
