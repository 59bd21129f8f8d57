"""The one small interface every sharded layout implements.

The view walks the store as a directory tree.  At each directory it asks the
layouts whether that directory is the root of a sharded *dataset* (a Zarr
array, a precomputed volume, a key-value directory...).  A dataset then owns
part of the names below its root — its *virtual namespace* of chunk files —
and the view merges those with whatever else is stored there (passthrough).

A layout module provides:

- ``async probe(ctx, dir_key) -> Dataset | None``: is ``dir_key`` a dataset root?
- ``rewrite_document(key, data) -> bytes | None``: the view's version of a
  stored metadata document (None: show it unchanged).

Paths below a dataset root are tuples of names (``rel``); ``()`` is the root.
"""

from __future__ import annotations

import functools
import json
import logging
from abc import ABC, abstractmethod
from collections import OrderedDict
from dataclasses import dataclass, field
from functools import cached_property
from typing import AsyncIterator

from ..backends.base import AsyncStore
from ..shards import ShardCache
from ..together import off_loop

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ChunkEntry:
    """A chunk file of the view: one stored chunk inside one shard."""

    shard_key: str
    chunk_id: int  # the chunk's identity inside its shard (layout-defined)
    size: int  # bytes the view shows
    mtime_ns: int  # the shard's mtime, in nanoseconds
    shard_ctx: object = None  # what the shard format needs to know (index shape...)
    #: its own index entry is damaged (past the end of the shard, half
    #: empty): why.  Found by its name, so that it can be removed or written
    #: over (a rewrite dropping or replacing exactly that entry loses
    #: nothing), with size 0; an open that reads it is EIO; not listed.
    damage: str | None = None

    @cached_property
    def target(self) -> ChunkTarget:
        """Where it is stored, as reads need it (a write asks the dataset
        for the capacity).  Kept: a listed entry may be listed again."""
        return ChunkTarget(self.shard_key, self.chunk_id, self.shard_ctx, None)


@dataclass(frozen=True)
class ChunkTarget:
    """Where a chunk file of the view is (or would be) stored."""

    shard_key: str
    chunk_id: int
    shard_ctx: object
    capacity: int | None  # chunks a complete shard holds (flush when all written)
    writable: bool = True  # False: writes, unlink and rename give EPERM (the view cannot express them)


@dataclass(frozen=True)
class DirEntry:
    """A virtual directory (e.g. ``c/3`` of a '/'-separated chunk key)."""

    mtime_ns: int = 0


Entry = ChunkEntry | DirEntry


@dataclass
class LayoutContext:
    """What layouts may use: the store, the shard cache, and the mount's
    options (read-only, TTLs...).  Layouts get nothing of FUSE."""

    store: AsyncStore
    shards: ShardCache
    read_only: bool = True
    #: what probes concluded from large documents, by (layout, key, etag):
    #: parsing tens of MiB of JSON holds the interpreter (the GIL) even in a
    #: worker thread, so an unchanged one is not parsed again at every probe
    probed: OrderedDict = field(default_factory=OrderedDict)
    #: the same for the smaller documents a layout keeps too (``min_size``
    #: below PROBED_MIN: a precomputed ``info``, asked at every probe below
    #: its volume): a table of their own, so that many of them never push
    #: the large ones out of ``probed``
    probed_small: OrderedDict = field(default_factory=OrderedDict)

    #: documents smaller than this are parsed again (it costs less than a lookup)
    PROBED_MIN = 256 << 10
    PROBED_MAX_ITEMS = 256
    PROBED_SMALL_MAX_ITEMS = 256

    def probed_get(self, layout: str, key: str, etag: str | None, size: int, min_size: int = PROBED_MIN):
        """(True, result) if a probe of this version concluded before; else
        (False, None).  ``min_size``: documents smaller are not kept (a layout
        whose parse costs more than a lookup even when small passes 0)."""
        if size < min_size or etag is None:
            return False, None
        table = self.probed if size >= self.PROBED_MIN else self.probed_small
        entry = table.get((layout, key, etag))
        if entry is None:
            return False, None
        table.move_to_end((layout, key, etag))
        return True, entry[0]

    def probed_put(self, layout: str, key: str, etag: str | None, size: int, result,
                   min_size: int = PROBED_MIN) -> None:
        if size < min_size or etag is None:
            return
        table, bound = ((self.probed, self.PROBED_MAX_ITEMS) if size >= self.PROBED_MIN
                        else (self.probed_small, self.PROBED_SMALL_MAX_ITEMS))
        table[(layout, key, etag)] = (result,)
        while len(table) > bound:
            table.popitem(last=False)


class Dataset(ABC):
    """A sharded dataset rooted at a directory of the view."""

    #: short name of the layout for logs and ``stats``
    layout: str = "?"
    #: ((key, etag), ...) of the documents the dataset was made from; the
    #: view keeps using a dataset whose documents are unchanged when it asks
    #: again (after metadata_ttl), with what it has learnt (listings...).
    #: Empty: made anew each time.
    version: tuple = ()

    def __init__(self, ctx: LayoutContext, root: str):
        self.ctx = ctx
        self.root = root  # storage key of the root directory

    # -- namespace -----------------------------------------------------------

    @abstractmethod
    def claims(self, rel: tuple[str, ...]) -> bool:
        """True if ``rel`` (non-empty) is in the virtual namespace: the view
        then asks only this dataset about it, and hides a stored object of
        that name (a shard).  Must be cheap: a name check, no I/O."""

    @abstractmethod
    async def lookup(self, rel: tuple[str, ...]) -> Entry | None:
        """The claimed entry at ``rel``, or None if it does not exist."""

    @abstractmethod
    def listdir(self, rel: tuple[str, ...]) -> AsyncIterator[tuple[str, Entry]]:
        """Claimed entries directly below ``rel`` (``()``: the root's claimed
        entries, which the view merges with the stored ones), in a stable
        order; lazily, so huge directories stream."""

    async def listdir_batches(self, rel: tuple[str, ...]) -> AsyncIterator[list[tuple[str, Entry]]]:
        """:meth:`listdir` in lists, each the entries a layout has at once (a
        shard's): the view and the kernel's READDIR then take an async step
        per list, not per entry.  The caller must not change a list."""
        async for item in self.listdir(rel):
            yield [item]

    def target(self, rel: tuple[str, ...]) -> ChunkTarget | None:
        """Where the chunk file ``rel`` lives, whether or not it is stored
        yet; None if ``rel`` is not a valid chunk file name.  No I/O."""
        return None

    def removed_with(self, rel: tuple[str, ...]) -> tuple[str, ...] | None:
        """The other file whose unlink removes the file ``rel`` too (a
        multi-resolution mesh's manifest, for its fragment data); None if
        none.  No I/O."""
        return None

    def stored_as_is(self, rel: tuple[str, ...]) -> str | None:
        """The storage key under which a file created at ``rel`` is stored
        as written, where a name of the namespace is the storage form itself
        (a precomputed shard a sharding-aware tool writes); None otherwise."""
        return None

    def outside(self, rel: tuple[str, ...]) -> bool:
        """True if ``rel`` is spelled as a chunk file or chunk directory but
        lies outside the dataset's grid: it can never exist, so creating it
        is refused (a temporary name would be kept in memory and dropped)."""
        return False

    def no_key_part(self, rel: tuple[str, ...]) -> bool:
        """True if ``rel`` is claimed (in the chunk namespace) yet can never
        be a chunk file or a directory on the way to one (``c/0x``): a
        directory made there could hold nothing ever stored, so making one
        is refused (files there are temporaries, see 4.1)."""
        return False

    #: does a document written through the view with a smaller shape remove
    #: the stored chunks outside it?  (Where the layout's writer deletes them
    #: right after storing that document, by names the view no longer shows.)
    prunes_on_shrink = False

    async def stored_outside(self, smaller: "Dataset", pending: dict) -> list[ChunkTarget]:
        """Chunks stored in this dataset (or in ``pending``: shard key -> ids
        of chunks written but not stored yet) that lie outside ``smaller``,
        the same dataset after its shape shrank."""
        return []

    async def read(self, entry: ChunkEntry | ChunkTarget) -> bytes:
        """The whole content of a chunk file (the view reads every chunk file
        through here, so a layout can show more than one stored chunk)."""
        data = await self.ctx.shards.read_chunk(self.shard_format, entry.shard_key, entry.chunk_id, entry.shard_ctx)
        if data is None:
            from ..backends.base import NotFound

            raise NotFound(f"{entry.shard_key}: chunk {entry.chunk_id} is gone", entry.shard_key)
        return data

    shard_format = None  # set by subclasses (a shards.ShardFormat)

    @property
    def shard_home(self) -> str:
        """The storage directory the shards' keys are below: directories
        between it and a shard hold only shards (pruned with the last)."""
        return self.root


_warned: set[str] = set()


#: why a new sharded array document written through the view is refused
NEW_SHARDED = ("a new sharded array written through the view would have its shards stored as chunks "
               "(the view is the unsharded store); write it unsharded (with -o shard=K the mount stores it "
               "sharded), or write sharded data into the store itself")


def warn_once(logger: logging.Logger, message: str) -> None:
    """Log a warning about a document once per daemon, not once per lookup."""
    if message not in _warned:
        if len(_warned) > 10000:
            _warned.clear()
        _warned.add(message)
        logger.warning("%s", message)


def load_json(data: bytes, what: str) -> dict | None:
    """Parse a metadata document; None (and one log line) if it is not a JSON object.
    An empty one is None without a word: a tool writing the file (O_TRUNC)
    shows it empty for a moment."""
    if not data.strip():
        return None
    try:
        doc = json.loads(data)
    except (ValueError, UnicodeDecodeError, RecursionError) as exc:
        warn_once(log, f"{what}: malformed JSON ({exc}); shown unchanged")
        return None
    if not isinstance(doc, dict):
        warn_once(log, f"{what}: not a JSON object; shown unchanged")
        return None
    return doc


async def load_json_async(data: bytes, what: str) -> dict | None:
    """:func:`load_json` for the loop's callers (probes): a large document
    (a consolidated group can be tens of MiB) is parsed beside the loop."""
    return await off_loop(functools.partial(load_json, data, what), len(data))


#: rewritten documents longer than this (compact) are shown compact, not indented
COMPACT_ABOVE = 1 << 20


def dump_json(doc: dict, like: bytes | None = None) -> bytes:
    """How rewritten documents are serialised: in the layout of ``like`` (the
    document it is rewritten from: the stored one for the view, the written one
    for storage) when :func:`json_style` can tell it, so the view of a sharded
    array has the very bytes of the unsharded twin its peer writes
    (tensorstore: compact with sorted keys; zarr-python 2.18: indented by 4,
    sorted keys); else indented by 2 (zarr-python 3's own style) for people
    reading them. Compact above :data:`COMPACT_ABOVE` (a large consolidated
    ``zarr.json``), where indenting is Python's pure-Python encoder, which
    holds the loop about 7x longer (47 MiB: 2.7 s against 0.4 s) and makes the
    document 2-3x larger for a reader that is a program."""
    style = json_style(like) if like is not None else None
    if style is not None and style[0].get("indent") is None:
        return (json.dumps(doc, **style[0]) + style[1]).encode()
    compact = json.dumps(doc)
    if len(compact) > COMPACT_ABOVE:
        return compact.encode()
    if style is not None:
        return (json.dumps(doc, **style[0]) + style[1]).encode()
    return json.dumps(doc, indent=2).encode()


def _keys_sorted(value) -> bool:
    if isinstance(value, dict):
        keys = list(value)
        return keys == sorted(keys) and all(_keys_sorted(v) for v in value.values())
    if isinstance(value, list):
        return all(_keys_sorted(v) for v in value)
    return True


def json_style(data: bytes) -> tuple[dict, str] | None:
    """(``json.dumps`` arguments, text after it) that give back ``data``, a
    JSON object, exactly: indent (or compact, with or without spaces),
    sorted keys when every object in it has them sorted, non-ASCII text
    escaped or not.  None when ``json.dumps`` cannot reproduce it (another
    serialiser's spacing or number format) or it is larger than
    :data:`COMPACT_ABOVE`.  Only the layout is guessed: whichever is used,
    the output is the same JSON."""
    if len(data) > COMPACT_ABOVE or not data.startswith(b"{"):
        return None
    try:
        text = data.decode()
        doc = json.loads(text)
    except (ValueError, RecursionError):
        return None
    if not isinstance(doc, dict) or not doc:
        return None
    body = text.rstrip("\n")
    tail = text[len(body):]
    if body.startswith("{\n"):
        line = body[2:body.find("\n", 2)] if body.find("\n", 2) > 0 else ""
        indent = len(line) - len(line.lstrip(" "))
        if not indent:
            return None
        kwargs = {"indent": indent, "separators": (",", ": ")}
    else:
        pair = (", ", ": ") if '": ' in body else (",", ":")
        kwargs = {"indent": None, "separators": pair}
    kwargs["sort_keys"] = _keys_sorted(doc)
    kwargs["ensure_ascii"] = text.isascii()
    try:
        if json.dumps(doc, **kwargs) != body:
            return None
    except (ValueError, RecursionError):
        return None
    return kwargs, tail


def parse_index_name(name: str) -> int | None:
    """A canonical non-negative decimal ('0', '17'; not '017', '+1', '-1')."""
    if not name or not name.isascii() or not name.isdigit():
        return None
    if len(name) > 1 and name[0] == "0":
        return None
    return int(name)
