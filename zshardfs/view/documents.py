"""Metadata documents this mount stores or removes: datasets out of date,
orphans (a removed document's datasets) and removed documents, previous
documents, chunks pruned when a shape shrinks, documents refused.

A mixin of ``View`` (``view/__init__.py`` holds the state it uses).
"""

from __future__ import annotations

import errno
import logging
import time

import trio

from ..backends.base import NotFound, StoreError, TooLarge
from ..layouts import LAYOUTS
from ..layouts.base import Dataset
from ..together import off_loop
from .nodes import (FileBuffer, Node, PREVIOUS_DOCUMENTS, PREVIOUS_DOCUMENTS_BYTES, REMOVED_DOCUMENTS_BYTES,
                    ViewError, _json_object, _parent, _prefix)

log = logging.getLogger(__package__)  # "zshardfs.view" (as before the split): log lines name it


class DocumentsMixin:
    """``View``'s documents methods (the state they use is set up by ``View.__init__``)."""

    def _document_changed(self, key: str) -> None:
        """This mount stored or removed metadata document ``key``: every
        dataset made of it is out of date, wherever it is cached (a
        storage-transformer array's document is not in its directory, a
        precomputed scale's is its parent's), and so may be any "no dataset
        here" answer (cheap to ask again; documents change seldom)."""
        self.document_writes += 1
        self._documents_changed_at = time.monotonic()
        self._fresh_nodes.clear()
        self._listed_slices.clear()
        self._listed_count = 0
        for dir_key, (dataset, _) in list(self.datasets._d.items()):
            if dataset is None or any(k == key for k, _ in dataset.version):
                self.datasets.pop(dir_key)

    async def _describes_datasets(self, buf: FileBuffer) -> bool:
        """Does the document ``buf`` replaces describe datasets (stored, or
        removed by this mount while chunks of it remain)?"""
        if buf.key in self.removed_documents:
            return await self._removed_document(buf.key) is not None
        stored = await self._stored_document(buf.key) if buf.in_store else None
        return bool(stored) and bool(await self._datasets_made_of(buf.key, stored))

    async def _store_removals_first(self, key: str, stored: bytes) -> None:
        """Store the chunk removals pending in the datasets the document
        ``key`` replaces before the document itself.  A resize is written
        so (zarr-python deletes the chunks past the new shape, then writes
        the document); stored the other way round, a kill -9 between the two
        left those chunks in their shards, hidden past the new shape, and a
        later grow showed them again.  A failure fails the document's store:
        it is not stored ahead of what came before it."""
        removing = []
        for dir_key, _ in await self._datasets_made_of(key, stored):
            removing += self.writeback.removing_below(dir_key)
        if removing:
            await self.writeback.flush_keys(removing)

    def _orphan_at(self, dir_key: str) -> Dataset | None:
        orphan = self.orphans.get(dir_key)
        return orphan[0] if orphan is not None else None

    def _forget_orphan(self, dir_key: str) -> None:
        orphan = self.orphans.pop(dir_key, None)
        if orphan is not None and not any(k == orphan[1] for _, k in self.orphans.values()):
            self.removed_documents.pop(orphan[1], None)

    def _keep_previous(self, key: str, data: bytes) -> None:
        """``data`` (a JSON object) was the document stored at ``key``, which
        this mount is removing or emptying (see ``previous_documents``)."""
        self._forget_previous(key)
        if len(data) > PREVIOUS_DOCUMENTS_BYTES:
            return
        self.previous_documents[key] = data
        self._previous_bytes += len(data)
        self._previous_in.setdefault(_parent(key), set()).add(key)
        while len(self.previous_documents) > PREVIOUS_DOCUMENTS or self._previous_bytes > PREVIOUS_DOCUMENTS_BYTES:
            self._forget_previous(next(iter(self.previous_documents)))

    def _forget_previous(self, key: str) -> None:
        data = self.previous_documents.pop(key, None)
        if data is not None:
            self._previous_bytes -= len(data)
            keys = self._previous_in.get(_parent(key))
            if keys is not None:
                keys.discard(key)
                if not keys:
                    del self._previous_in[_parent(key)]

    def _forget_removed(self, key: str) -> None:
        """A document is at ``key`` again: its removed predecessor is past."""
        self.removed_documents.pop(key, None)
        for dir_key in [d for d, (_, k) in self.orphans.items() if k == key]:
            del self.orphans[dir_key]

    async def _prune_outside(self, dir_key: str, before: Dataset) -> None:
        """Remove the chunks of ``before`` that lie outside the dataset now at
        ``dir_key`` (its shape shrank), as its writer would (see
        ``Dataset.prunes_on_shrink``).  A failure is logged: the document is
        stored, and the chunks stay, hidden, as the view found them."""
        try:
            after = await self.dataset_at(dir_key)
            pending = {key: self.writeback.pending_ids(key) for key in self.writeback.dirty
                       if key.startswith(_prefix(before.shard_home))}
            gone = await before.stored_outside(after, pending) if after is not None else []
        except StoreError as exc:
            log.warning("%s: shape shrank, but the chunks outside it could not be removed: %s", dir_key, exc)
            return
        for t in gone:
            self.writeback.delete(t.shard_key, before.shard_format, t.shard_ctx, t.chunk_id, before.shard_home)
            self._chunk_changed(t)
        if gone and sum(len(ids) for by_root in self.removed_here.values()
                        for ids in by_root.values()) < 1 << 20:  # (else they time out, attr_timeout)
            self.removed_here.setdefault(trio.lowlevel.current_task(), {}).setdefault(before.root, set()).update(
                (t.shard_key, t.chunk_id) for t in gone)
        if gone:
            log.info("%s: shape shrank: %d chunks outside it removed", dir_key, len(gone))

    async def _stored_document(self, key: str) -> bytes | None:
        """The stored document at ``key`` (None: absent, or over the size a
        document may have: then it describes no dataset either)."""
        try:
            return (await self.store.get_document(key)).data
        except (NotFound, TooLarge):
            return None

    async def _datasets_made_of(self, key: str, stored: bytes) -> list[tuple[str, Dataset]]:
        """(dir key, dataset) of the datasets the document ``stored`` at
        ``key`` describes (the layouts name their directories)."""
        out = []
        dirs = await off_loop(lambda: [d for layout in LAYOUTS if layout.is_document(key)
                                       for d in layout.dataset_dirs(key, stored)], len(stored))
        for d in dict.fromkeys(dirs):
            if (dataset := await self.dataset_at(d)) is not None:
                out.append((d, dataset))
        return out

    def _orphan(self, key: str, stored: bytes, datasets: list[tuple[str, Dataset]]) -> None:
        """Keep ``datasets`` (made of the document ``key``, just removed)."""
        for dir_key, dataset in datasets:
            self.orphans[dir_key] = (dataset, key)
            self.orphans.move_to_end(dir_key)
        if _json_object(stored) or key not in self.removed_documents:
            # (an empty or broken one never replaces the document it stands in for)
            self.removed_documents[key] = stored
        self.removed_documents.move_to_end(key)
        while len(self.orphans) > 1024:
            self._forget_orphan(next(iter(self.orphans)))
        while sum(map(len, self.removed_documents.values())) > REMOVED_DOCUMENTS_BYTES:
            self._forget_removed(next(iter(self.removed_documents)))

    async def _removed_document(self, key: str) -> bytes | None:
        """The stored bytes of the document this mount removed from ``key``,
        if a dataset made of it still holds chunks (a new document there is
        then that dataset's, mapped back); None if nothing of it is left."""
        data = self.removed_documents.get(key)
        if data is None:
            return None
        dirs = [d for d, (_, k) in self.orphans.items() if k == key]
        for dir_key in dirs:
            if await self._holds_chunks(Node(dir_key, True, key=dir_key)):
                return data
        for dir_key in dirs:  # all gone: their shards' deletions are stored before a new document
            await self.writeback.flush_below(dir_key)
        # (and the directories storage lost with them, which a directory
        # store keeps: the kernel, which may hold them, is told to forget them)
        gone = {(d, self.orphans[d][0].version) for d in dirs if d in self.orphans and self.orphans[d][0].version}
        if gone:
            self.datasets_gone.setdefault(trio.lowlevel.current_task(), set()).update(gone)
        self._forget_removed(key)  # ...which is new
        return None

    @staticmethod
    def _is_dataset_document(key: str) -> bool:
        return any(layout.is_document(key) for layout in LAYOUTS)

    def _refuse(self, buf: FileBuffer, reason: str) -> None:
        """A document refused for good: the view shows the stored one again,
        and sync/unmount do not retry it forever."""
        log.error("refused to store %s: %s", buf.key, reason)
        buf.dirty = False
        if self.buffers.get(buf.path) is buf:
            del self.buffers[buf.path]
        raise ViewError(errno.EPERM, f"{buf.key}: {reason}")
