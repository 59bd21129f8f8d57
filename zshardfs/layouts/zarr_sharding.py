"""Zarr v3 arrays sharded with the ``sharding_indexed`` codec.

The view of a sharded array (DESIGN.md §2): its ``zarr.json`` shows the
sharding codec's inner ``codecs`` and a regular ``chunk_grid`` of the inner
chunk shape; its chunk files are the inner chunks, named with the array's
own ``chunk_key_encoding``.  Group documents pass through, with the array
documents embedded in ``consolidated_metadata`` rewritten the same way.
Documents written through the view are mapped back (``accept_document``).

Arrays whose codec chain the view cannot express (array->array codecs
before the sharding codec, bytes->bytes codecs after it, an index codec
other than ``bytes`` [+ ``crc32c``]) are shown raw, with one warning.
"""

from __future__ import annotations

import copy
import functools
import json
import logging
from dataclasses import dataclass

from ..backends.base import CorruptData, NotFound, TooLarge, join_key
from ..together import off_loop, outcomes
from .base import NEW_SHARDED, LayoutContext, dump_json, load_json, load_json_async, warn_once
from .grids import GridError, ShardGrid, expand_edges, parse_chunk_grid
from .zarr_common import ChunkKeys, GridDataset, ZarrShardFormat, parse_separator

log = logging.getLogger(__name__)

NAME = "zarr3-sharding"
SHARDING = "sharding_indexed"


class Unsupported(ValueError):
    """A sharded array the view cannot express; it is shown raw."""


@dataclass(frozen=True)
class ShardedArrayMeta:
    """What the view needs to know of a sharded array document."""

    grid: ShardGrid
    keys: ChunkKeys
    fmt: ZarrShardFormat
    inner_codecs: list
    inner_chunk_shape: list


def _index_format(conf: dict) -> ZarrShardFormat:
    codecs = conf.get("index_codecs", [{"name": "bytes", "configuration": {"endian": "little"}}, {"name": "crc32c"}])
    if not isinstance(codecs, list) or not codecs:
        raise Unsupported(f"index_codecs {codecs!r}")
    first = codecs[0] if isinstance(codecs[0], dict) else {"name": codecs[0]}
    if first.get("name") != "bytes":
        raise Unsupported(f"index codec {first.get('name')!r} (only 'bytes' [+ 'crc32c'] is supported)")
    endian = (first.get("configuration") or {}).get("endian", "little")
    rest = [c if isinstance(c, dict) else {"name": c} for c in codecs[1:]]
    if len(rest) > 1 or (rest and rest[0].get("name") != "crc32c"):
        raise Unsupported(f"index codecs after 'bytes': {[c.get('name') for c in rest]}")
    try:
        return ZarrShardFormat(conf.get("index_location", "end"), endian, checksum=bool(rest))
    except ValueError as exc:
        raise Unsupported(str(exc)) from None


def sharded_array_meta(doc: dict) -> ShardedArrayMeta | None:
    """Parse a ``zarr.json``; None if it is not a sharded array.
    Raises Unsupported (with the reason) for sharded arrays the view cannot express."""
    if doc.get("node_type") != "array" or doc.get("zarr_format") != 3:
        return None
    codecs = doc.get("codecs")
    if not isinstance(codecs, list):
        return None
    names = [c.get("name") if isinstance(c, dict) else c for c in codecs]
    if SHARDING not in names:
        return None
    if names != [SHARDING]:
        raise Unsupported(f"codecs {names}: other codecs around '{SHARDING}'")
    conf = codecs[0].get("configuration") or {}
    inner_shape = conf.get("chunk_shape")
    inner_codecs = conf.get("codecs")
    shape = doc.get("shape")
    if not isinstance(shape, list) or not isinstance(inner_shape, list) or not isinstance(inner_codecs, list):
        raise Unsupported("sharding configuration lacks shape, chunk_shape or codecs")
    try:
        shard_grid = parse_chunk_grid(doc.get("chunk_grid"), shape)
        grid = ShardGrid.build(shape, shard_grid, inner_shape)
        enc_name, sep = parse_separator(doc.get("chunk_key_encoding"))
    except (GridError, ValueError, TypeError) as exc:
        raise Unsupported(str(exc)) from None
    prefix = ("c" + sep) if enc_name == "default" else ""
    keys = ChunkKeys(prefix, sep, len(shape), zero_d_key="c" if enc_name == "default" else "0")
    return ShardedArrayMeta(grid, keys, _index_format(conf), inner_codecs, inner_shape)


def view_array_doc(doc: dict, meta: ShardedArrayMeta) -> dict:
    """The contract's rewrite: inner codecs, regular inner grid, all else kept."""
    out = copy.copy(doc)
    out["codecs"] = meta.inner_codecs
    out["chunk_grid"] = {"name": "regular", "configuration": {"chunk_shape": meta.inner_chunk_shape}}
    return out


def _rewrite_array(doc: dict, what: str) -> dict | None:
    try:
        meta = sharded_array_meta(doc)
    except Unsupported as exc:
        warn_once(log, f"{what}: sharded array shown raw: {exc}")
        return None
    return view_array_doc(doc, meta) if meta else None


def is_document(key: str) -> bool:
    return key.rsplit("/", 1)[-1] == "zarr.json"


def dataset_dirs(key: str, data: bytes) -> list[str]:
    """The directory whose dataset a ``zarr.json`` describes: its own."""
    return [key.rpartition("/")[0]]


def rewrite_document(key: str, data: bytes) -> bytes | None:
    """View bytes of a stored ``zarr.json`` (None: unchanged)."""
    if key.rsplit("/", 1)[-1] != "zarr.json":
        return None
    doc = load_json(data, key)
    if doc is None or doc.get("zarr_format") != 3:
        return None
    if doc.get("node_type") == "array":
        new = _rewrite_array(doc, key)
        return dump_json(new, data) if new is not None else None
    cm = doc.get("consolidated_metadata")
    if doc.get("node_type") == "group" and isinstance(cm, dict) and isinstance(cm.get("metadata"), dict):
        changed = False
        members = {}
        for path, member in cm["metadata"].items():
            new = _rewrite_array(member, f"{key} [{path}]") if isinstance(member, dict) else None
            members[path] = new if new is not None else member
            changed |= new is not None
        if changed:
            out = dict(doc)
            out["consolidated_metadata"] = {**cm, "metadata": members}
            return dump_json(out, data)
    return None


async def probe(ctx: LayoutContext, dir_key: str) -> GridDataset | None:
    """A sharded Zarr v3 array rooted at ``dir_key``, or None."""
    try:
        blob = await ctx.store.get_document(join_key(dir_key, "zarr.json"))
    except NotFound:
        return None
    known, meta = ctx.probed_get(NAME, blob.info.key, blob.info.etag, len(blob.data))
    if not known:
        meta = await _sharded_meta(blob)
        ctx.probed_put(NAME, blob.info.key, blob.info.etag, len(blob.data), meta)
    if meta is None:
        return None
    dataset = GridDataset(ctx, dir_key, dir_key, meta.grid, meta.keys, meta.fmt)
    dataset.layout = NAME
    dataset.version = ((blob.info.key, blob.info.etag),)
    return dataset


async def _sharded_meta(blob) -> ShardedArrayMeta | None:
    """What a probe needs of a stored ``zarr.json``: its sharding, if it is
    a sharded array the view can show (None otherwise)."""
    doc = await load_json_async(blob.data, blob.info.key)
    if doc is None:
        return None
    try:
        return sharded_array_meta(doc)
    except Unsupported:
        return None  # rewrite_document logs the reason when the document is read


def _sharded_doc(doc: dict, factors: tuple[int, ...]) -> dict | None:
    """``doc`` (an unsharded regular array) stored sharded with ``factors``
    inner chunks per shard and dimension (``-o shard=K``)."""
    grid = doc.get("chunk_grid") or {}
    inner = (grid.get("configuration") or {}).get("chunk_shape")
    shape = doc.get("shape")
    if grid.get("name") != "regular" or not isinstance(inner, list) or not inner or len(inner) != len(shape or []):
        return None  # 0-d or variable grids are stored as written
    if len(factors) == 1:
        factors = factors * len(inner)
    if len(factors) != len(inner):
        return None  # (the caller says why)
    out = dict(doc)
    # (as asked, also past the array's current shape: arrays made empty and
    # appended to, as xarray and zarr's append do, grow into their shards)
    out["chunk_grid"] = {"name": "regular", "configuration": {"chunk_shape": [c * k for c, k in zip(inner, factors)]}}
    out["codecs"] = [{"name": SHARDING, "configuration": {
        "chunk_shape": inner,
        "codecs": doc.get("codecs") or [{"name": "bytes", "configuration": {"endian": "little"}}],
        "index_codecs": [{"name": "bytes", "configuration": {"endian": "little"}}, {"name": "crc32c"}],
        "index_location": "end",
    }}]
    return out


def _meta_or_none(doc: dict) -> ShardedArrayMeta | None:
    try:
        return sharded_array_meta(doc)
    except Unsupported:
        return None


def _is_v3_array(doc) -> bool:
    return isinstance(doc, dict) and doc.get("node_type") == "array" and doc.get("zarr_format") == 3


def _is_unsharded_array(doc) -> bool:
    """A v3 array document a tool may have written from the view's rendering."""
    if not _is_v3_array(doc):
        return False
    try:
        return sharded_array_meta(doc) is None
    except Unsupported:
        return False  # sharded, in a form the view shows raw: written as stored


def _is_view_form(doc, old: dict, old_meta: ShardedArrayMeta) -> bool:
    """Is ``doc``, written over the stored sharded array ``old``, the view's
    rendering of it (edited by a tool) rather than its stored form?  The view
    shows an unsharded array, except for nested sharding, which it shows one
    level down: still sharded, with the view's inner chunk grid."""
    if _is_unsharded_array(doc):
        return True
    if not isinstance(doc, dict) or doc.get("node_type") != "array":
        return False
    view = view_array_doc(old, old_meta)
    return doc.get("chunk_grid") == view["chunk_grid"] and (
        doc.get("chunk_grid") != old.get("chunk_grid") or doc.get("codecs") == view["codecs"])


def _map_back(doc: dict, old: dict, old_meta: ShardedArrayMeta) -> dict:
    """The stored form of ``doc``, a view of the sharded array ``old`` edited by
    a tool: its sharding put back.  ValueError for a change that would make the
    stored chunks unreadable (inner chunk shape, codecs, data type, key encoding)."""
    view = view_array_doc(old, old_meta)
    if doc == view:
        return old
    for field_name in ("codecs", "chunk_grid", "data_type"):
        if doc.get(field_name) != view.get(field_name):
            raise ValueError(f"changing {field_name} of a sharded array would make its stored chunks unreadable")
    if not _same_key_encoding(doc.get("chunk_key_encoding"), view.get("chunk_key_encoding")):
        raise ValueError("changing chunk_key_encoding of a sharded array would make its stored chunks unreadable")
    out = dict(doc)
    out["codecs"] = old["codecs"]
    out["chunk_grid"] = _grown_grid(old["chunk_grid"], out.get("shape"), old_meta.inner_chunk_shape)
    if "chunk_key_encoding" in old:  # (the stored spelling kept)
        out["chunk_key_encoding"] = old["chunk_key_encoding"]
    try:
        ShardGrid.build(out["shape"], parse_chunk_grid(out["chunk_grid"], out["shape"]),
                        old_meta.inner_chunk_shape)
    except (GridError, TypeError, KeyError) as exc:
        raise ValueError(f"the new shape does not fit the stored shard grid: {exc}") from None
    return out


def _grown_grid(grid: dict, shape, inner) -> dict:
    """The stored shard ``grid``, covering ``shape``: a variable dimension
    whose edges end before its new extent gets one more edge, the growth
    rounded up to whole inner chunks (zarr-python appends the growth as one
    edge).  A shrink keeps every edge: the shards stay where they are."""
    conf = grid.get("configuration") if isinstance(grid, dict) else None
    field = {"rectangular": "chunk_shape", "rectilinear": "chunk_shapes"}.get(grid.get("name")) \
        if isinstance(conf, dict) else None
    specs = conf.get(field) if field else None
    if not (isinstance(specs, list) and isinstance(shape, list) and len(specs) == len(shape) == len(inner)):
        return grid
    grown = list(specs)
    for d, (spec, extent, edge) in enumerate(zip(specs, shape, inner)):
        if isinstance(spec, list) and isinstance(extent, int) and not isinstance(extent, bool):
            try:
                covered = sum(expand_edges(spec, 0, d))
            except GridError:
                return grid  # (the map-back's check says why)
            if extent > covered:
                grown[d] = [*spec, -(-(extent - covered) // edge) * edge]
    return grid if grown == specs else {**grid, "configuration": {**conf, field: grown}}


def _same_sharding(doc: dict, old: dict) -> None:
    """ValueError unless ``doc``, a sharded document written over the stored
    sharded ``old``, lays out the stored shards as ``old`` does (codecs,
    shard grid, data type, key encoding).  Attributes, fill value and shape
    may change, as in the view's form (:func:`_map_back`)."""
    for field_name in ("codecs", "chunk_grid", "data_type"):
        if doc.get(field_name) != old.get(field_name):
            raise ValueError(f"changing {field_name} of a sharded array would make its stored shards unreadable")
    if not _same_key_encoding(doc.get("chunk_key_encoding"), old.get("chunk_key_encoding")):
        raise ValueError("changing chunk_key_encoding of a sharded array would make its stored shards unreadable")


def _same_key_encoding(a, b) -> bool:
    """Two ``chunk_key_encoding`` values that name the same keys, however
    spelled: tensorstore writes ``{"name": "default"}`` where zarr-python
    writes the separator ``/`` out, and each writes its own spelling back."""
    if a == b:
        return True
    try:
        return parse_separator(a) == parse_separator(b)
    except (ValueError, AttributeError, TypeError):
        return False


def _chunk_names(doc: dict, names) -> list[str]:
    """Those of ``names`` (directly below a new array) that its chunk keys
    begin with: ``c``, ``c.*`` (default encoding), ``<n>``, ``<n>.*`` (v2)."""
    try:
        enc, sep = parse_separator(doc.get("chunk_key_encoding"))
    except (ValueError, AttributeError):
        return sorted(names)  # (such an array is not stored sharded anyway)
    if enc == "default":
        return sorted(n for n in names if n == "c" or n.startswith("c" + sep))
    return sorted(n for n in names if n.split(".", 1)[0].isdigit())


def _consolidated(doc: dict | None) -> dict | None:
    cm = doc.get("consolidated_metadata") if isinstance(doc, dict) and doc.get("zarr_format") == 3 else None
    return cm if isinstance(cm, dict) and isinstance(cm.get("metadata"), dict) else None


def _accept_group(key: str, doc: dict, old: dict | None, members: dict | None,
                  previous: dict | None = None) -> dict | None:
    """``doc`` with each consolidated member that the view shows from a
    sharded array mapped back to that array's stored form; None if none is.
    A member with no stored document (renamed away, SEMANTICS 4.18) maps
    back onto the group's stored entry of it: ``old``'s, else, when no
    consolidated document is stored there (removed, emptied), ``previous``'s
    (the last one stored there, which the view remembers); an entry that
    cannot be mapped onto it is stored as written."""
    cm = _consolidated(doc)
    if cm is None:
        return None
    old_members = (_consolidated(old) or _consolidated(previous) or {}).get("metadata") or {}
    out = {}
    changed = False
    for path, member in cm["metadata"].items():
        out[path] = member
        if not _is_v3_array(member):
            continue
        absent = False
        if members is not None:  # read from storage now
            source = members.get(path)
            if source is None:
                # no stored document (the member renamed away, SEMANTICS 4.18): the
                # group's stored entry of it, which the view showed
                absent, source = True, old_members.get(path)
        else:  # accept_document called alone: the group's stored snapshot
            source = old_members.get(path)
        meta = _meta_or_none(source) if isinstance(source, dict) else None
        if meta is None or not _is_view_form(member, source, meta):
            continue  # stored unsharded (or unknown), or the stored form: as written
        try:
            out[path] = _map_back(member, source, meta)
        except ValueError as exc:
            if absent:
                # (an edit of what lays its chunks out: with no stored array to refuse
                # it for, stored as written, as a directory store would store it)
                log.warning("%s: consolidated member %r, whose array is not stored, stored as written: %s",
                            key, path, exc)
                continue
            raise ValueError(f"consolidated member {path!r}: {exc}") from None
        changed = True
    if not changed:
        return None
    return {**doc, "consolidated_metadata": {**cm, "metadata": out}}


def accept_document(key: str, new: bytes, stored: bytes | None, shard_option, *,
                    members: dict | None = None, below=None, restoring: bool = False,
                    parsed: dict | None = None, previous: bytes | None = None) -> bytes | None:
    """What to store when a tool writes ``zarr.json`` through the view.

    - over a sharded array: the view's document mapped back onto the stored
      one (attributes, fill value, shape...); a change that would make the
      stored chunks unreadable (inner chunk shape, codecs, data type, key
      encoding) raises ValueError;
    - a group with consolidated metadata: each member array the view shows
      from a sharded one mapped back the same way (``members``: the members'
      stored documents by path, read now; None: the group's stored snapshot);
    - a NEW unsharded array with ``-o shard=K``: stored sharded, unless
      ``below`` (names in its directory: stored, or made through the mount
      and not stored yet) holds chunk names.  Chunk objects stored plain
      would be unreadable under a sharded document, and so would files
      written later into chunk directories made before the document (to
      the view those are plain directories);
    - anything else, an existing unsharded array included: None (as written).

    ``parsed``: ``new`` already parsed (a large consolidated document is
    parsed once).  ``previous``: the last document stored at ``key``,
    which this mount removed or emptied (a group's, when ``stored`` holds
    none: its consolidated entries of members with no stored document).
    """
    if not is_document(key):
        return None
    doc = parsed if parsed is not None else load_json(new, key)
    if doc is None:
        return None
    if doc.get("node_type") == "group":
        old = load_json(stored, key) if stored is not None else None
        prev = load_json(previous, key) if previous is not None and _consolidated(old) is None else None
        out = _accept_group(key, doc, old, members, prev)
        return dump_json(out, new) if out is not None else None
    if doc.get("node_type") != "array":
        return None
    out = None
    old = load_json(stored, key) if stored is not None else None
    old_meta = _meta_or_none(old) if old is not None else None
    if stored is None and not _is_unsharded_array(doc) and _meta_or_none(doc) is not None:
        if restoring:
            return None  # its shards are stored there already: a document restored (as written)
        raise ValueError(NEW_SHARDED)
    if old_meta is not None:
        if _is_view_form(doc, old, old_meta):
            out = _map_back(doc, old, old_meta)
        else:  # a sharded document (the stored form), over a sharded array: its shards' layout may not change
            _same_sharding(doc, old)
    elif shard_option and stored is None and _is_unsharded_array(doc):
        found = _chunk_names(doc, below) if below is not None else None
        if found:
            log.warning("%s: stored unsharded, as written: its chunks (%s) were made before it, and would be "
                        "unreadable under a sharded document", key, ", ".join(found[:3]))
        else:
            out = _sharded_doc(doc, tuple(shard_option))
            if out is not None and _meta_or_none(out) is None:
                # (a key encoding the view cannot show sharded, too many chunks per shard)
                try:
                    sharded_array_meta(out)
                except Unsupported as exc:
                    log.warning("%s: stored unsharded, as written: sharded, it could not be shown (%s)", key, exc)
                out = None
            ndim = len(doc.get("shape") or [])
            grid = (doc.get("chunk_grid") or {}).get("name") if isinstance(doc.get("chunk_grid"), dict) else None
            if out is None and not ndim:
                # (one chunk, which a shard would only wrap)
                log.warning("%s: stored unsharded, as written: -o shard shards arrays with dimensions, and this "
                            "one is 0-d", key)
            elif out is None and len(shard_option) not in (1, ndim):
                log.warning("%s: stored unsharded, as written: -o shard has %d factors but the array has %d "
                            "dimensions", key, len(shard_option), ndim)
            elif out is None and ndim and grid != "regular":
                # (its chunks differ in size: no regular inner chunk grid could hold them)
                log.warning("%s: stored unsharded, as written: -o shard shards arrays with a regular chunk "
                            "grid, and this one's is %s", key, json.dumps(grid))
    return dump_json(out, new) if out is not None else None


async def _stored_document(ctx: LayoutContext, key: str) -> dict | None:
    try:
        blob = await ctx.store.get_document(key)
    except (NotFound, TooLarge):  # (too large: not read as metadata anywhere)
        return None
    return await load_json_async(blob.data, key)


async def accept_document_async(ctx: LayoutContext, key: str, new: bytes, stored: bytes | None,
                                shard_option, pending=lambda dir_key: (),
                                previous: bytes | None = None) -> bytes | None:
    """``accept_document`` with the facts it needs read from storage: the
    stored documents of a group's consolidated members (all at once), and,
    for a new array under ``-o shard``, the listing of its directory plus
    ``pending(dir_key)``, the names the view holds there only in memory
    (directories made, files being written)."""
    doc = await load_json_async(new, key) if is_document(key) else None
    members = below = None
    restoring = False
    if doc is not None and doc.get("node_type") == "group" and _consolidated(doc) is not None:
        base = key.rpartition("/")[0]
        paths = [p for p, m in _consolidated(doc)["metadata"].items() if _is_v3_array(m)]
        found = await outcomes(*(functools.partial(_stored_document, ctx, join_key(base, p, "zarr.json"))
                                 for p in paths))
        members = {}
        for path, answer in zip(paths, found):
            if isinstance(answer, Exception):
                raise answer
            members[path] = answer
    elif doc is not None and doc.get("node_type") == "array" and stored is None and (
            shard_option or not _is_unsharded_array(doc)):
        # (-o shard: chunks made before it; a sharded document: shards to restore it over)
        listing = await ctx.store.list(key.rpartition("/")[0])
        below = {*listing.dirs, *(f.key.rsplit("/", 1)[-1] for f in listing.files),
                 *pending(key.rpartition("/")[0])}
        if not _is_unsharded_array(doc):
            restoring = await _its_shards_are_stored(ctx, key.rpartition("/")[0], doc, listing)
    return await off_loop(functools.partial(accept_document, key, new, stored, shard_option,
                                            members=members, below=below, restoring=restoring,
                                            parsed=doc, previous=previous), len(new))


async def _its_shards_are_stored(ctx: LayoutContext, dir_key: str, doc: dict, listing) -> bool:
    """Does a stored object below ``dir_key``, named as a key of the sharded
    array ``doc``, read as one of its shards (a plausible index)?  Then
    ``doc`` written there restores the array (after a crash in an editor's
    save), rather than starting one whose shards would come through the view
    as chunks.  Plain chunks, junk or empty directories: no.  A few names
    per level are tried, not the whole tree."""
    try:
        meta = sharded_array_meta(doc)
    except Unsupported:
        return False
    if meta is None:
        return False

    async def look(rel: tuple[str, ...], listing, depth: int) -> bool | None:
        for f in sorted(listing.files, key=lambda f: f.key)[:3]:
            parsed = meta.keys.parse(rel + (f.key.rsplit("/", 1)[-1],))
            if parsed is not None and parsed[1]:
                return await _a_plausible_shard(ctx, meta, f.key, parsed[0])
        if depth > meta.grid.ndim:
            return None
        for name in [n for n in sorted(listing.dirs) if meta.keys.parse(rel + (n,)) is not None][:3]:
            found = await look(rel + (name,), await ctx.store.list(join_key(dir_key, *rel, name)), depth + 1)
            if found is not None:
                return found
        return None

    return bool(await look((), listing, 0))


async def _a_plausible_shard(ctx: LayoutContext, meta: ShardedArrayMeta, key: str, shard) -> bool:
    """Its index loads, holds at least one chunk, and every chunk lies in the
    object outside the index (without a checksum, almost any bytes "load")."""
    try:
        extent = meta.grid.shard_extent(shard)
        index = await meta.fmt.load_index(ctx.store, key, extent)
    except (CorruptData, NotFound, IndexError, ValueError):
        return False
    if index is None:
        return False
    present = index.present_mask()
    if not present.any() or index.damaged_mask().any():
        return False
    isize = meta.fmt.index_size(extent)
    starts, sizes = index.table[present, 0], index.table[present, 1]
    data_start, data_end = (isize, index.info.size) if meta.fmt.index_location == "start" else \
        (0, index.info.size - isize)
    return bool((sizes > 0).any() and (starts >= data_start).all() and (starts + sizes <= data_end).all())
