"""The virtual tree: path -> node.

The view walks the store as directories.  A stored directory is *plain*
unless a layout's ``probe`` says it is the root of a sharded dataset; then
names the dataset ``claims`` are answered by the dataset (virtual chunk files
and directories) and everything else passes through.  Stored metadata
documents are passed through each layout's ``rewrite_document``.

Nothing here knows about FUSE (inodes, handles, errno): ``fuse_ops`` does
that translation.  Nothing here knows a shard format: layouts do.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import AsyncIterator

from .backends.base import AsyncStore, CorruptData, NotFound, ObjectInfo, join_key
from .layouts import LAYOUTS
from .layouts.base import ChunkEntry, Dataset, DirEntry, LayoutContext
from .shards import ShardCache

log = logging.getLogger(__name__)


@dataclass
class Node:
    """One entry of the view.  ``path`` is its virtual path ('' = root)."""

    path: str
    is_dir: bool
    size: int = 0
    mtime: float = 0.0
    # where it comes from: exactly one of these describes it
    key: str | None = None  # a stored object or directory (passthrough)
    document: bytes | None = None  # rewritten metadata shown instead of the stored bytes
    dataset: Dataset | None = None  # owner of a virtual entry
    rel: tuple[str, ...] = ()  # path below the dataset root
    chunk: ChunkEntry | None = None
    created: float = field(default_factory=time.monotonic)

    @property
    def name(self) -> str:
        return self.path.rsplit("/", 1)[-1]


class _TTLCache:
    """Small LRU with expiry for probes and documents (bounded by count)."""

    def __init__(self, max_items: int, ttl: float):
        self.max_items = max_items
        self.ttl = ttl
        self._d: OrderedDict = OrderedDict()

    def get(self, key):
        item = self._d.get(key)
        if item is None or time.monotonic() - item[1] > self.ttl:
            return None
        self._d.move_to_end(key)
        return item

    def put(self, key, value):
        self._d[key] = (value, time.monotonic())
        self._d.move_to_end(key)
        while len(self._d) > self.max_items:
            self._d.popitem(last=False)

    def pop(self, key):
        self._d.pop(key, None)

    def clear(self):
        self._d.clear()


class View:
    def __init__(self, store: AsyncStore, shards: ShardCache, *, metadata_ttl: float = 1.0, read_only: bool = True):
        self.store = store
        self.shards = shards
        self.ctx = LayoutContext(store, shards, read_only)
        self.datasets = _TTLCache(4096, metadata_ttl)
        self.documents = _TTLCache(4096, 3600.0)  # keyed by (key, etag): never stale
        self.started = time.time()

    # -- datasets -----------------------------------------------------------

    async def dataset_at(self, dir_key: str) -> Dataset | None:
        """The sharded dataset rooted at a stored directory, if any (cached)."""
        cached = self.datasets.get(dir_key)
        if cached is not None:
            return cached[0]
        found = None
        for layout in LAYOUTS:
            try:
                found = await layout.probe(self.ctx, dir_key)
            except (CorruptData, NotFound) as exc:
                log.warning("%s: %s", dir_key or "/", exc)
                found = None
            if found is not None:
                break
        self.datasets.put(dir_key, found)
        return found

    # -- nodes --------------------------------------------------------------

    def root(self) -> Node:
        return Node("", True, mtime=self.started, key="")

    async def _document(self, info: ObjectInfo) -> bytes | None:
        """Rewritten bytes of a stored metadata document, or None if shown as is."""
        if not any(layout.is_document(info.key) for layout in LAYOUTS):
            return None
        cached = self.documents.get((info.key, info.etag))
        if cached is not None:
            return cached[0]
        blob = await self.store.get(info.key)
        new = None
        for layout in LAYOUTS:
            if layout.is_document(info.key):
                new = layout.rewrite_document(info.key, blob.data)
                if new is not None:
                    break
        # cache under the etag actually read, so a racing replace is not masked
        self.documents.put((info.key, blob.info.etag), new)
        if blob.info.etag != info.etag:
            return await self._document(blob.info)
        return new

    async def _stored_file(self, path: str, info: ObjectInfo) -> Node:
        doc = await self._document(info)
        size = len(doc) if doc is not None else info.size
        return Node(path, False, size, info.mtime, key=info.key, document=doc)

    def _virtual(self, path: str, dataset: Dataset, rel: tuple[str, ...], entry) -> Node:
        if isinstance(entry, DirEntry):
            return Node(path, True, 0, entry.mtime or self.started, dataset=dataset, rel=rel)
        return Node(path, False, entry.size, entry.mtime, dataset=dataset, rel=rel, chunk=entry)

    async def lookup(self, parent: Node, name: str) -> Node | None:
        """The child ``name`` of directory ``parent``, or None."""
        path = join_key(parent.path, name)
        if parent.dataset is not None and parent.key is None:
            rel = parent.rel + (name,)
            entry = await parent.dataset.lookup(rel)
            return self._virtual(path, parent.dataset, rel, entry) if entry is not None else None
        dataset = await self.dataset_at(parent.key)
        if dataset is not None and dataset.claims((name,)):
            entry = await dataset.lookup((name,))
            return self._virtual(path, dataset, (name,), entry) if entry is not None else None
        key = join_key(parent.key, name)
        info = await self.store.stat(key)
        if info is not None:
            return await self._stored_file(path, info)
        if await self.store.is_dir(key):
            return Node(path, True, 0, self.started, key=key)
        return None

    async def refresh(self, node: Node) -> Node | None:
        """The node as it is now (None: it is gone), for getattr after a TTL."""
        if node.chunk is not None:
            entry = await node.dataset.lookup(node.rel)
            return self._virtual(node.path, node.dataset, node.rel, entry) if entry is not None else None
        if node.key is not None and not node.is_dir:
            info = await self.store.stat(node.key)
            return await self._stored_file(node.path, info) if info is not None else None
        return node

    async def resolve(self, path: str) -> Node | None:
        """Walk from the root (used by refresh and by tools, not by the kernel)."""
        node = self.root()
        for name in filter(None, path.split("/")):
            if not node.is_dir:
                return None
            node = await self.lookup(node, name)
            if node is None:
                return None
        return node

    async def listdir(self, node: Node) -> AsyncIterator[Node]:
        """Children of a directory, in a stable order, lazily."""
        if node.dataset is not None and node.key is None:
            async for name, entry in node.dataset.listdir(node.rel):
                yield self._virtual(join_key(node.path, name), node.dataset, node.rel + (name,), entry)
            return
        dataset = await self.dataset_at(node.key)
        listing = await self.store.list(node.key)
        for name in listing.dirs:
            if dataset is None or not dataset.claims((name,)):
                yield Node(join_key(node.path, name), True, 0, self.started, key=join_key(node.key, name))
        for info in listing.files:
            name = info.key.rsplit("/", 1)[-1]
            if dataset is None or not dataset.claims((name,)):
                try:
                    yield await self._stored_file(join_key(node.path, name), info)
                except NotFound:
                    continue
        if dataset is not None:
            async for name, entry in dataset.listdir(()):
                yield self._virtual(join_key(node.path, name), dataset, (name,), entry)

    async def read(self, node: Node, offset: int, size: int) -> bytes:
        """Bytes of a file node (whole chunks are cached by the shard layer)."""
        if node.chunk is not None:
            data = await node.dataset.read(node.chunk)
            return data[offset: offset + size]
        if node.document is not None:
            return node.document[offset: offset + size]
        if size <= 0 or offset >= node.size:
            return b""
        blob = await self.store.get(node.key, offset, size)
        return blob.data
