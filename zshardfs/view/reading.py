"""Reading: a file's content (in memory, stored, a chunk), the version a
reader is pinned to, what the kernel's page cache holds.

A mixin of ``View`` (``view/__init__.py`` holds the state it uses).
"""

from __future__ import annotations

from dataclasses import replace

import crc32c

from ..backends.base import NotFound, PreconditionFailed
from ..layouts.base import ChunkTarget
from .nodes import Changed, Handle, Node


class ReadingMixin:
    """``View``'s reading methods (the state they use is set up by ``View.__init__``)."""

    def newest_own(self, node: Node) -> Node:
        """``node``, or its key's version this mount wrote since ``node`` was
        learnt: what a plain file's open descriptors read (2.5, :meth:`read`),
        whose size they must be given with it.  No I/O."""
        own = self.own_versions.get(node.key) if node.key is not None else None
        if own is not None and own[0] != node.version and node.created < own[1]:
            return replace(node, version=own[0], size=own[2])
        return node

    def replaced_by_another(self, old: Node, new: Node) -> bool:
        """Is ``new`` (found at ``old``'s path) another stored file than
        ``old``, made by another client: a plain file of the store whose
        version is neither ``old``'s nor one this mount wrote (its reads,
        pinned to ``old``'s version, then answer "replaced by another
        client").  No I/O."""
        if (old.is_dir or new.is_dir or old.target is not None or new.target is not None
                or old.link is not None or new.link is not None or old.key is None or new.key != old.key
                or old.version is None or new.version is None or new.version == old.version
                or self.buffers.get(old.path) is not None):
            return False
        own = self.own_versions.get(new.key)
        return own is None or own[0] != new.version

    def in_memory(self, node: Node) -> Node | None:
        """The node as it is now if its content lives in memory (a write
        buffer, a scratch file, an unflushed chunk); None otherwise.  No I/O."""
        buf = self.buffers.get(node.path)
        if buf is not None:
            return self._buffer_node(buf)
        if node.is_chunk and self.writeback.pending(node.target.shard_key, node.target.chunk_id) is not None:
            return self._chunk_node(node.path, node.dataset, node.rel, None, node.target)
        return None

    # -- reading ------------------------------------------------------------

    async def content(self, node: Node) -> bytes:
        """The whole current content of a chunk file (dirty data first)."""
        t = node.target
        dirty = self.writeback.pending(t.shard_key, t.chunk_id)
        if dirty is not None:
            if dirty.data is None:
                raise NotFound(f"{node.path}: deleted", node.path)
            return bytes(dirty.data)
        try:
            return await node.dataset.read(t)
        except NotFound:
            if self._empty_with_pending(node.dataset, node.rel):
                return b""
            raise

    def _chunk_version(self, t: ChunkTarget) -> tuple:
        return self._chunk_epoch, self._chunk_changes.get((t.shard_key, t.chunk_id), 0)

    def _chunk_changed(self, t: ChunkTarget) -> None:
        if len(self._chunk_changes) > 65536:
            self._chunk_changes.clear()
            self._chunk_epoch += 1
        k = (t.shard_key, t.chunk_id)
        self._chunk_changes[k] = self._chunk_changes.get(k, 0) + 1

    def handed_to_kernel(self, node: Node) -> None:
        """All of ``node``'s bytes are in the kernel's page cache now."""
        if node.is_chunk:
            self.shards.handed_over(node.target.shard_key, node.target.chunk_id)

    def chunk_version(self, node: Node) -> tuple | None:
        """What changes when this mount changes chunk ``node`` (None: not a chunk)."""
        return self._chunk_version(node.target) if node.is_chunk else None

    @staticmethod
    def kernel_holds(data: bytes, version: tuple | None) -> tuple[int, int, tuple] | None:
        """``Handle.kernel_has`` of a chunk whose ``data`` (read at this
        mount's ``version`` of it) the kernel's page cache holds."""
        return None if version is None else (len(data), crc32c.crc32c(data), version)

    async def read(self, handle: Handle | Node, offset: int, size: int, expect_size: int | None = None) -> bytes:
        """Bytes of a file (whole chunks are cached by the shard layer).
        ``expect_size``: the size the reader was given; a stored chunk of
        another size now is another version (raises Changed: its bytes cut
        to the old size would be neither)."""
        node = handle.node if isinstance(handle, Handle) else handle
        buf = handle.buffer if isinstance(handle, Handle) else None
        buf = buf or self.buffers.get(node.path)
        if buf is not None:
            return bytes(buf.data[offset: offset + size])
        chunk = handle.chunk if isinstance(handle, Handle) else None
        if chunk is not None and chunk.data is not None:
            # its own file, as on POSIX, also once unlinked or replaced by a rename
            return bytes(chunk.data[offset: offset + size])
        if node.is_chunk:
            seen = handle.seen if isinstance(handle, Handle) else None
            if seen is not None and seen[1] == self._chunk_version(node.target):
                if expect_size is not None and len(seen[0]) != expect_size:
                    # the kernel was told of another size since: neither version cut to it
                    raise Changed(f"{node.path}: replaced by another client while open; open it again", node.path)
                return seen[0][offset: offset + size]
            data = await self.content(node)
            seen = handle.seen if isinstance(handle, Handle) else None
            if seen is not None and seen[1] == self._chunk_version(node.target):
                # another READ of this open, in flight with this one, fixed
                # its version meanwhile (and checked it): the rest is that one
                if expect_size is not None and len(seen[0]) != expect_size:
                    raise Changed(f"{node.path}: replaced by another client while open; open it again", node.path)
                return seen[0][offset: offset + size]
            if expect_size is not None and len(data) != expect_size and self.in_memory(node) is None:
                raise Changed(f"{node.path}: replaced by another client (now {len(data)} bytes, not "
                              f"{expect_size}); read it again", node.path)
            held = handle.kernel_has if isinstance(handle, Handle) else None
            if (held is not None and held[2] == self._chunk_version(node.target)
                    and (len(data) != held[0] or crc32c.crc32c(data) != held[1])):
                # the kernel dropped pages of the version it holds for this
                # open (memory pressure, fadvise), and another client has
                # replaced the chunk since: its bytes beside the old pages
                # the reader has had would be a mix of two versions
                raise Changed(f"{node.path}: replaced by another client while open; open it again", node.path)
            if isinstance(handle, Handle) and (offset > 0 or offset + size < len(data)):
                # read in pieces: the rest from this version, even if another
                # client replaces the shard meanwhile (its chunk cache entry
                # may go; the bytes stay with the handle until it is closed)
                handle.seen = (data, self._chunk_version(node.target))
            return data[offset: offset + size]
        if node.document is not None:
            return node.document[offset: offset + size]
        if node.key is None:  # (a scratch file gone: only memory held it)
            raise NotFound(f"{node.path}: no longer exists", node.path)
        own = self.own_versions.get(node.key)
        if own is not None and own[0] != node.version and node.created < own[1]:
            # rewritten through this mount since the reader learned of it:
            # visible at once (2.5); a node learned later is of a later version
            # (and its size is the new one's, which the kernel was told: the
            # size the reader opened, even 0, is no end to its reads, this
            # one's or the next's)
            node.version, node.size = own[0], own[2]
        if size <= 0 or offset >= node.size:
            return b""
        try:  # pinned: the version whose size the reader was given, never a mix
            blob = await self.store.get(node.key, offset, size, if_match=node.version)
        except PreconditionFailed:
            raise Changed(f"{node.path}: replaced by another client while being read; open it again",
                          node.key) from None
        return blob.data
