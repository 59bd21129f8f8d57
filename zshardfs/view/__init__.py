"""The virtual tree: path -> node, and what reading and writing them means.

The view walks the store as directories.  A stored directory is *plain*
unless a layout's ``probe`` says it is the root of a sharded dataset; then
names the dataset ``claims`` are answered by the dataset (virtual chunk files
and directories) and everything else passes through.  Stored metadata
documents are passed through each layout's ``rewrite_document``.

Writes (when mounted rw):
- a chunk file's bytes live in the write-back buffer of its shard until the
  shard is flushed (``writeback.py``); reads and listings see them at once;
- a passthrough file is buffered whole while open and stored on close;
- a *scratch* file — a new name inside a dataset that is not a valid chunk
  name, such as the temporary file a tool writes before renaming it onto a
  chunk — lives only in memory until it is renamed or unlinked, so it never
  lands in the store as a stray object.

Symbolic links (local stores): a name the view passes through that is a
link in the store is shown as that link (``Node.link``) if the client's
kernel, which resolves it, stays in the view doing so (``_stays_in_view``);
the daemon never follows it for the client (``rm -rf`` of a link to a
directory removes the link).  Links leading out are left out.  Names the
view derives (chunk files and directories made from shards, metadata
documents) are read through links that stay inside the store, as the
backend resolves every key, and links leading out are left out.

Nothing here knows about FUSE (inodes, handles, errno numbers): ``fuse_ops``
translates.  Nothing here knows a shard format: layouts do.

The view is one class, ``View`` (here: its state, ``__init__``), composed of
one mixin per concern, each in its own module:

- ``nodes``: Node, FileBuffer, Handle, the errors, _TTLCache, limits, helpers;
- ``lookup``: path -> node (datasets, documents, links, lookup, refresh);
- ``listing``: listings;
- ``reading``: content, reads and the versions readers are pinned to;
- ``writing``: opens for writing, buffers, flush/fsync/sync, storing files;
- ``namespace``: create, unlink, mkdir, rmdir;
- ``documents``: documents stored or removed here (orphans, previous ones);
- ``renames``: renames of files and directories, links, writers moving.

The names other modules and tests import (``View``, ``Node``, ``Handle``,
``ViewError``, ...) are still ``zshardfs.view.NAME``.  A module's limits are
names of the module whose code reads them: a test patches them there
(``zshardfs.view.writing.MAX_FILE``).
"""

from __future__ import annotations

import time
from collections import OrderedDict

import trio

from ..backends.base import AsyncStore
from ..layouts.base import ChunkTarget, Dataset, LayoutContext
from ..shards import ShardCache
from ..writeback import WriteBack
from .nodes import (Changed, DOCUMENTS_BYTES, DirectoryInTheWay, FileBuffer, Handle, LISTED_NODES, MAX_FILE,
                    METADATA_ERRORS, Node, PREVIOUS_DOCUMENTS, PREVIOUS_DOCUMENTS_BYTES,
                    REMOVED_DOCUMENTS_BYTES, ViewError, _TTLCache, _could_be_chunk, _json_object,
                    _not_understood, _parent, _prefix, _stays_in_view, log)
from .lookup import LookupMixin
from .listing import ListingMixin
from .reading import ReadingMixin
from .writing import WritingMixin
from .namespace import NamespaceMixin
from .documents import DocumentsMixin
from .renames import DirMove, RenamesMixin, _ancestors, _in_draft_store

__all__ = ["Changed", "DOCUMENTS_BYTES", "DirMove", "DirectoryInTheWay", "FileBuffer", "Handle",
           "LISTED_NODES", "MAX_FILE", "METADATA_ERRORS", "Node", "PREVIOUS_DOCUMENTS",
           "PREVIOUS_DOCUMENTS_BYTES", "REMOVED_DOCUMENTS_BYTES", "View", "ViewError", "_TTLCache",
           "_ancestors", "_could_be_chunk", "_in_draft_store", "_json_object", "_not_understood", "_parent",
           "_prefix", "_stays_in_view", "log"]


class View(LookupMixin, ListingMixin, ReadingMixin, WritingMixin, NamespaceMixin, DocumentsMixin, RenamesMixin):
    def __init__(self, store: AsyncStore, shards: ShardCache, writeback: WriteBack | None = None, *,
                 metadata_ttl: float = 1.0, read_only: bool = True, shard_option=None):
        self.store = store
        self.shards = shards
        self.writeback = writeback or WriteBack(store, shards)
        self.read_only = read_only
        self.shard_option = shard_option  # -o shard=K: store new arrays sharded
        self.ctx = LayoutContext(store, shards, read_only)
        self.datasets = _TTLCache(4096, metadata_ttl)
        # keyed by (key, etag): never stale; bounded by bytes too, since a
        # rewritten document may be megabytes (consolidated metadata)
        self.documents = _TTLCache(4096, 3600.0, max_bytes=DOCUMENTS_BYTES)
        self.started_ns = time.time_ns()
        # names that exist in the view but not (yet) in storage
        self.buffers: dict[str, FileBuffer] = {}  # path -> open/scratch file
        self._scratch_swept_at = time.time()
        self.new_chunks: dict[str, dict[str, tuple[Dataset, tuple, ChunkTarget]]] = {}  # dir -> name -> chunk
        self._new_chunks_pruned_at = 0
        self._new_chunks_count = 0  # names in new_chunks (not summed per release: it runs per chunk written)
        # the directories of new_chunks and those leading to them, by parent:
        # a listing looks only at its own subdirectories (a scan of every
        # directory of new_chunks per listing made ``find`` quadratic)
        self._new_chunk_dirs: dict[str, set[str]] = {}
        self.new_dirs: dict[str, set[str]] = {}  # dir -> names of directories made here
        # ...the paths of those storage holds too (a local directory made,
        # an S3 one a file was stored below), least recently made first:
        # past NEW_DIRS_MAX the oldest are forgotten (storage answers for
        # them).  Held, not forgotten at once: a lookup answered from memory
        # is quicker than a stat in a worker thread, and without them readers
        # of a file replaced by rename over and over met ESTALE ten times as
        # often (the kernel's lookups again after one, slower, let the next
        # rename land inside them)
        self._new_dirs_stored: OrderedDict[str, None] = OrderedDict()
        # when each directory made here was made (its mtime while only this
        # mount knows it: the same at every lookup; the last NEW_DIRS_MAX)
        self._made_at: OrderedDict[str, int] = OrderedDict()
        # (S3) directories whose last file or subdirectory this mount just
        # removed: path -> when.  Storage has nothing left to show them by;
        # they stay for the rmdir that follows (rm -r), briefly
        # (EMPTIED_KEEP, or metadata_ttl if longer), then storage decides
        self.emptied: OrderedDict[str, float] = OrderedDict()
        self._emptied_keep = max(self.EMPTIED_KEEP, metadata_ttl)
        # path -> handles open for writing there: a rename moves them along
        self.writers: dict[str, set[Handle]] = {}
        # Datasets whose metadata this mount created, and the chunk
        # directories it wrote chunks into.  A chunk directory of any other
        # dataset exists as soon as it is inside the grid (cheap: no index is
        # read to prove it); in a dataset made here it exists only once made
        # or written to, as in a directory store, because a tool copying an
        # array in (``cp -r``) makes each directory after writing others and
        # expects no EEXIST (which the kernel answers itself for a name that a
        # lookup found).  All of its content came through this mount.
        # (root -> when it was last written or made into: one quiet for
        # BORN_HERE_QUIET with nothing left to store is forgotten, with its
        # directories, so this memory is bounded by what is being written)
        self.born_here: dict[str, float] = {}
        self.written_dirs: set[str] = set()
        # ...and those it removed there since: gone, though storage may list
        # them until the deletions below are flushed
        self.removed_dirs: set[str] = set()
        # key -> etag of the version this mount stored last: a reader pinned
        # to an older version reads on in this one (the mount's own writes
        # are visible at once, 2.5), not EIO as for another client's
        # key -> (etag, when stored, size)
        self.own_versions: OrderedDict[str, tuple[str, float, int]] = OrderedDict()
        # files being renamed, by path: writes through their open handles
        # wait until the handles have moved to the new name (see rename)
        self._renaming: dict[str, trio.Event] = {}
        # path -> opens for writing and creates under way there (they await
        # before the handle exists, and then store under the key they
        # resolved): a directory above one is not renamed meanwhile (see
        # _quiet_below)
        self._opening: dict[str, int] = {}
        self._linking = trio.Lock()  # (see link)
        self._held_tried_at = float("-inf")  # (see _room_for_files)
        self.readers: dict[str, set[Handle]] = {}  # path -> read-only handles of chunk files
        self.document_writes = 0  # metadata documents this mount stored or removed
        # (shard key, chunk id) -> writes and unlinks of that chunk through
        # this mount (visible at once, 2.5: they end a reader's pin); bounded,
        # with an epoch so that forgetting them all never looks like no change
        self._chunk_changes: dict[tuple[str, int], int] = {}
        self._chunk_epoch = 0
        # ...and when it last did: nodes made before then may name a dataset
        # that is no more (the kernel holds them), so they are looked up again
        # (:meth:`_fresh`), once per path and change
        self._documents_changed_at = float("-inf")
        self._fresh_nodes: dict[str, Node] = {}
        # id(a layout's listed slice) -> (that slice, its directory, dataset,
        # nodes): listing an unchanged directory again (a warm walk after
        # metadata_ttl) makes no node again (bounded: LISTED_NODES)
        self._listed_slices: dict[int, tuple[list, str, Dataset, list[Node]]] = {}
        self._listed_count = 0
        # Datasets whose metadata document this mount removed (unlink, or a
        # rename away): dir key -> (dataset, the document's key), and that
        # document's stored bytes by key.  As on a directory store, the chunk
        # files stay (listable, readable, removable), and a document stored
        # there again while chunks remain is mapped back onto the removed
        # one, as a rewrite would be.  Without this, ``rm -r`` (which may
        # remove zarr.json first) and an editor's save (rename the old file
        # away, write a new one) would meet raw shards.  Bounded: 1024
        # datasets, REMOVED_DOCUMENTS_BYTES of documents.
        self.orphans: OrderedDict[str, tuple[Dataset, str]] = OrderedDict()
        self.removed_documents: OrderedDict[str, bytes] = OrderedDict()
        # The last document (a JSON object) stored at a key that this mount
        # removed (rm, an editor's save renaming it away) or emptied (a
        # truncate before the text), by key: a document written there while
        # none is stored is judged against it too (a group's consolidated
        # entries of members renamed away map back onto their stored form,
        # SEMANTICS 4.18).  Forgotten once a document is stored there again.
        # Bounded: PREVIOUS_DOCUMENTS documents, PREVIOUS_DOCUMENTS_BYTES.
        self.previous_documents: OrderedDict[str, bytes] = OrderedDict()
        self._previous_bytes = 0
        self._previous_in: dict[str, set[str]] = {}  # dir key -> its keys in previous_documents
        # chunks this mount removed by itself, not by a request naming them
        # (_prune_outside), by the task whose work removed them (the pyfuse3
        # worker serving the request): task -> dataset root -> {(shard key,
        # chunk id)}.  The kernel may hold their entries (a reader looked
        # them up): Operations makes it forget them after that request,
        # looking below the roots (see Operations._forget_removed_here).
        # Each request forgets its own only: another's entries may lie in a
        # directory whose lock the kernel holds for that other request, still
        # at work (its invalidation waited 2 s for it)
        self.removed_here: dict[trio.lowlevel.Task, dict[str, set[tuple[str, int]]]] = {}
        # (dataset root, version) of the datasets whose document this mount
        # removed and whose last chunk went before a new document took its
        # place (_removed_document), by task likewise: the entries the kernel
        # holds of their chunk files and directories are forgotten likewise
        self.datasets_gone: dict[trio.lowlevel.Task, set[tuple[str, tuple]]] = {}
        # (S3) info key -> (etag, the directories it names): see _info_dirs
        self._info_dirs_kept: OrderedDict[str, tuple[str, frozenset[str]]] = OrderedDict()

    def table_sizes(self) -> dict[str, int]:
        """Entries of this layer's tables (see Operations.table_sizes)."""
        return {"datasets": len(self.datasets), "documents": len(self.documents),
                "buffers": len(self.buffers), "new_chunks": self._new_chunks_count,
                "new_chunk_dirs": len(self._new_chunk_dirs), "new_dirs": sum(map(len, self.new_dirs.values())),
                "emptied": len(self.emptied), "writers": len(self.writers), "readers": len(self.readers),
                "born_here": len(self.born_here), "written_dirs": len(self.written_dirs),
                "removed_dirs": len(self.removed_dirs), "own_versions": len(self.own_versions),
                "renaming": len(self._renaming), "opening": len(self._opening),
                "chunk_changes": len(self._chunk_changes),
                "fresh_nodes": len(self._fresh_nodes), "listed_nodes": self._listed_count,
                "orphans": len(self.orphans),
                "removed_documents": len(self.removed_documents),
                "previous_documents": len(self.previous_documents),
                "probed": len(self.ctx.probed) + len(self.ctx.probed_small),
                "info_dirs": len(self._info_dirs_kept)}
