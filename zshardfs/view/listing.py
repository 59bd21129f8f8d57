"""Listings: a directory's children (stored, of a dataset, written here and
not stored yet), the nodes a listing keeps for the next one, links shown.

A mixin of ``View`` (``view/__init__.py`` holds the state it uses).
"""

from __future__ import annotations

import logging
import time
from typing import AsyncIterator

from ..backends.base import NotFound, ObjectInfo, join_key
from ..layouts.base import ChunkEntry, Dataset, DirEntry
from ..logonce import log_once
from .nodes import LISTED_NODES, Node, _parent, _prefix

log = logging.getLogger(__package__)  # "zshardfs.view" (as before the split): log lines name it


class ListingMixin:
    """``View``'s listing methods (the state they use is set up by ``View.__init__``)."""

    async def _listed_child(self, path: str, dataset: Dataset, rel: tuple[str, ...], entry, mark: int) -> Node | None:
        """A listed entry's node.  A chunk whose shard this mount stored after
        the listing began (``mark``) is looked up again: the listing may have
        read the version before, and that store retired the pending change
        (an unlink, a rename away, a new size) that would have corrected it.
        (Inlined in :meth:`listdir`'s loop over a dataset's directory.)"""
        if isinstance(entry, ChunkEntry) and self.writeback.stored_since(entry.shard_key, mark):
            return await self._dataset_child(path, dataset, rel)
        node = self._virtual(path, dataset, rel, entry)
        if self.removed_dirs and node is not None and node.is_dir and await self._removed_and_empty(node):
            return None  # (as lookup answers)
        return node

    def _virtual(self, path: str, dataset: Dataset, rel: tuple[str, ...], entry) -> Node | None:
        if isinstance(entry, DirEntry):
            return Node(path, True, 0, entry.mtime_ns or self._made_at.get(path, self.started_ns), dataset=dataset, rel=rel)
        return self._chunk_node(path, dataset, rel, entry, None)

    async def _removed_and_empty(self, node: Node) -> bool:
        """Is ``node``, a chunk directory of a dataset not made here, one
        this mount removed (rmdir) and still empty?  Then it is gone, as in
        a directory store, to lookups and listings alike, until made again
        (mkdir) or something is stored below it (another client's chunks:
        then found again, and forgotten as removed).  Else a chunk directory
        found leniently (Limits) was found again right after its rmdir:
        ``mv -T``'s rmdir-then-mkdir of one was EEXIST (the kernel's LOOKUP
        before the mkdir found it), and the move stopped half done."""
        if node.path not in self.removed_dirs or node.dataset.root in self.born_here:
            return False
        if await self._empty(node):
            return True
        self.removed_dirs.discard(node.path)
        return False

    async def _named_by_listed_info(self, dir_key: str, listing) -> list[str]:
        """(S3) The directories of _named_by_info that the listing of
        ``dir_key`` lacks (gone with their last shard), by name."""
        if self.store.keeps_empty_dirs:
            return []
        own = any(f.key.rsplit("/", 1)[-1] == "info" for f in listing.files)
        if not own and not dir_key:
            return []
        listed, prefix = set(listing.dirs), _prefix(dir_key)
        names = {d[len(prefix):] for d in await self._dirs_named_near(dir_key, own) if d.startswith(prefix)}
        return sorted(n for n in names if n and "/" not in n and n not in listed)  # ("": its own)

    async def listdir(self, node: Node) -> AsyncIterator[Node]:
        """Children of a directory, in a stable order, lazily."""
        async for batch in self.listdir_batches(node):
            for child in batch:
                yield child

    async def listdir_batches(self, node: Node) -> AsyncIterator[list[Node]]:
        """:meth:`listdir` in lists (a shard's chunks, a storage listing's
        entries): READDIR takes an async step per list, not per entry (two
        nested generator steps per entry were a good part of a warm
        listing's cost)."""
        node = await self._fresh(node)
        extra = self._pending_children(node.path)
        seen: set[str] | None = set() if extra else None
        mark = self.writeback.store_seq
        buffers = self.buffers
        # names left out of a batch for having a write buffer then: shown from
        # it at the end, with ``extra`` (those that had one when we began; a
        # file opened for writing while storage was listed is in neither)
        held: set[str] = set()

        def unbuffered(children: list[Node]) -> list[Node]:
            out = []
            for child in children:
                if child.path in buffers:
                    held.add(child.name)
                else:
                    out.append(child)
            return out

        if self._in_dataset(node):
            prefix, dataset, rel = _prefix(node.path), node.dataset, node.rel
            stored_since = self.writeback.stored_since
            virtual = self._virtual
            async for batch in dataset.listdir_batches(rel):
                kept = self._listed_slices.get(id(batch))
                if (kept is not None and kept[0] is batch and kept[1] == prefix and kept[2] is dataset
                        and not self.writeback.dirty and not stored_since(batch[0][1].shard_key, mark)):
                    # the very slice listed before (the same index version),
                    # nothing of this mount's pending: the same nodes, as
                    # current now as nodes made anew (else the next getattr
                    # past attr_timeout since the first listing would
                    # re-validate each, which a node made now would not)
                    now = time.monotonic()
                    for c in kept[3]:
                        c.created = now
                    out = unbuffered(kept[3]) if buffers else kept[3]
                    if out:
                        if seen is not None:
                            seen.update(child.name for child in out)
                        yield out
                    continue
                out = []
                for name, entry in batch:
                    # (_listed_child, inlined: a coroutine per entry was a good
                    # part of a warm listing's cost)
                    if isinstance(entry, ChunkEntry) and stored_since(entry.shard_key, mark):
                        child = await self._dataset_child(prefix + name, dataset, rel + (name,))
                    else:
                        child = virtual(prefix + name, dataset, rel + (name,), entry)
                        if (self.removed_dirs and child is not None and child.is_dir
                                and await self._removed_and_empty(child)):
                            child = None  # (as lookup answers)
                    if child is not None:
                        if child.path in buffers:
                            held.add(child.name)
                        else:
                            out.append(child)
                if (out and len(out) == len(batch) and isinstance(batch[0][1], ChunkEntry)
                        and not self.writeback.dirty and not stored_since(batch[0][1].shard_key, mark)):
                    self._keep_listed(batch, prefix, dataset, out)
                if out:
                    if seen is not None:
                        seen.update(child.name for child in out)
                    yield out
        else:
            # listed first: the probes for metadata documents are then
            # answered from the listing, with no request for those it lacks
            listing = await self.store.list(node.key)
            dataset = await self.dataset_at(node.key)
            if self.new_dirs.get(node.path):
                # stored now (local: at once; S3: once a file is below): no longer ours to remember
                self._forget_made_dirs(node.path, listing.dirs)
            # a name that is both an object and a directory is shown once,
            # as lookup answers: the directory if the object is empty (a
            # marker some S3 tools leave), else the file
            dirs = set(listing.dirs)
            both = {name: info.size for info in listing.files
                    if (name := info.key.rsplit("/", 1)[-1]) in dirs} if dirs else {}
            links = self._shown_links(listing, dataset)
            out = []
            for name in [*listing.dirs, *await self._named_by_listed_info(node.key, listing)]:
                if both.get(name) or name in links:
                    continue
                if dataset is None or not dataset.claims((name,)):
                    path = join_key(node.path, name)
                    out.append(Node(path, True, 0, self._made_at.get(path, self.started_ns), key=join_key(node.key, name)))
            for info in listing.files:
                name = info.key.rsplit("/", 1)[-1]
                if both.get(name) == 0 or name in links:
                    continue
                if dataset is None or not dataset.claims((name,)):
                    try:
                        out.append(await self._stored_file(join_key(node.path, name), info))
                    except NotFound:
                        continue
            for name, info in links.items():
                out.append(self._link_node(join_key(node.path, name), info))
            out = unbuffered([child for child in out if child is not None])
            if out:
                if seen is not None:
                    seen.update(child.name for child in out)
                yield out
            if dataset is not None:
                prefix = _prefix(node.path)
                async for batch in dataset.listdir_batches(()):
                    out = []
                    for name, entry in batch:
                        child = await self._listed_child(prefix + name, dataset, (name,), entry, mark)
                        if child is not None:
                            if child.path in buffers:
                                held.add(child.name)
                            else:
                                out.append(child)
                    if out:
                        if seen is not None:
                            seen.update(child.name for child in out)
                        yield out
        for name in sorted(held.union(extra)) if held else extra:
            if seen is None or name not in seen:  # (a held name is in no batch: left out of its own)
                child = await self.lookup(node, name)
                if child is not None:
                    yield [child]

    def _keep_listed(self, batch: list, prefix: str, dataset: Dataset, nodes: list[Node]) -> None:
        """Keep the nodes made of a layout's listed slice of chunks (a list
        the layout keeps while its index version is current) for the next
        listing of it.  The slice is held here, so its id names no other."""
        if self._listed_count + len(nodes) > LISTED_NODES:
            self._listed_slices.clear()
            self._listed_count = 0
            if len(nodes) > LISTED_NODES:
                return
        old = self._listed_slices.get(id(batch))
        if old is not None:
            self._listed_count -= len(old[3])
        self._listed_slices[id(batch)] = (batch, prefix, dataset, nodes)
        self._listed_count += len(nodes)

    def _shown_links(self, listing, dataset: Dataset | None) -> dict[str, ObjectInfo]:
        """The links of a pass-through directory's listing that the view shows
        as links, by name.  The others are at names it derives: followed
        inside the store (the listing's dirs and files), and one that leads
        out or names nothing is left out, with one warning."""
        if not listing.links:
            return {}
        shown, listed = {}, None
        for info in listing.links:
            name = info.key.rsplit("/", 1)[-1]
            if not self._derived(dataset, name, info.key):
                shown[name] = info
                continue
            if listed is None:
                listed = {*listing.dirs, *(f.key.rsplit("/", 1)[-1] for f in listing.files)}
            if name not in listed:
                log_once(log, logging.WARNING, f"{info.key}: a symbolic link (-> {info.link!r}) where the view derives "
                                               "what it shows (a shard, chunk directory or metadata document) leads "
                                               "out of the store, loops or names nothing; left out",
                         tag=f"derived link left out: {info.key}", interval=3600)
        return shown

    def _pending_children(self, path: str) -> list[str]:
        """Names below ``path`` that exist only in memory so far."""
        names = set(self.new_dirs.get(path, ()))
        names.update(self.new_chunks.get(path, ()))
        # the directories leading to chunks written but not stored yet: their
        # shards' storage directories may not exist (an array stored empty, a
        # row whose shards were all deleted), and storage lists only those
        for d in self._new_chunk_dirs.get(path, ()):
            name = d.rsplit("/", 1)[-1]
            if name not in names and self._pending_below(d):
                names.add(name)
        if self.emptied:
            names.update(p[len(_prefix(path)):] for p in list(self.emptied)
                         if _parent(p) == path and self._still_emptied(p))
        prefix = path + "/" if path else ""
        for p in self.buffers:  # (and the directory leading to one further down, which
            if p.startswith(prefix):  # storage may not hold: a temporary in an empty chunk row)
                names.add(p[len(prefix):].split("/", 1)[0])
        return sorted(names)

    def _pending_below(self, path: str) -> bool:
        """Does directory ``path`` or one below it hold a chunk written and
        not stored yet (one with data: an unlink leaves nothing to list)?"""
        todo = [path]
        while todo:
            d = todo.pop()
            chunks = self.new_chunks.get(d)
            if chunks and any((c := self.writeback.pending(t.shard_key, t.chunk_id)) is not None
                              and c.data is not None for _, _, t in chunks.values()):
                return True
            todo.extend(self._new_chunk_dirs.get(d, ()))
        return False
