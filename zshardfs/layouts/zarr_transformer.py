"""The v3-draft sharding *storage transformer* (zarr-python 2.18's
``ZARR_V3_SHARDING``).

Store layout: ``zarr.json`` (the draft's entry point), array documents at
``meta/root/<path>.array.json``, chunk keys at ``data/root/<path>/c<i>/<j>``
(all below the store's root, anywhere in the mounted tree)
(or ``c<i>.<j>`` with the '.' separator; a 0-d array's key is ``c0``).  With
the transformer the same keys name shards: the chunk key floored by
``chunks_per_shard``.  Shards use the indexed format with the index at the
end, little-endian, no checksum.

The view drops the transformer from ``storage_transformers`` (and the key
when the list becomes empty) and shows every inner chunk at its own key.
"""

from __future__ import annotations

import functools
import logging

from ..backends.base import NotFound
from ..together import off_loop
from .base import NEW_SHARDED, LayoutContext, dump_json, load_json, load_json_async, warn_once
from .grids import GridError, ShardGrid
from .zarr_common import ChunkKeys, GridDataset, ZarrShardFormat

log = logging.getLogger(__name__)

NAME = "zarr-v3-draft-transformer"
META_ROOT = "meta/root/"
DATA_ROOT = "data/root/"
SUFFIX = ".array.json"
EXTENSION_SUFFIX = "/storage_transformers/sharding/1.0"


def _is_sharding(entry) -> bool:
    return isinstance(entry, dict) and str(entry.get("extension", "")).endswith(EXTENSION_SUFFIX)


def _transformer(doc: dict):
    found = [t for t in doc.get("storage_transformers") or [] if _is_sharding(t)]
    return found[0] if found else None


def _splits(key: str, root: str) -> list[tuple[str, str]]:
    """Every (store prefix, rest) reading of a key below ``<prefix>meta/root/``
    or ``<prefix>data/root/`` (``root``), outermost first: a v3-draft store
    may sit anywhere in the mounted tree, also in a directory itself named
    so (``proj/data/root/`` holding ``meta/root/`` and ``data/root/``); its
    document then tells which reading is the store."""
    out = [("", key[len(root):])] if key.startswith(root) else []
    at = key.find("/" + root)
    while at >= 0:
        out.append((key[:at + 1], key[at + 1 + len(root):]))
        at = key.find("/" + root, at + 1)
    return out


#: zarr 2.18's consolidated metadata (``consolidate_metadata``'s default
#: key): {"zarr_consolidated_format": 1, "metadata": {key: document}}, every
#: array and group document of the store by its key
CONSOLIDATED = "/.zmetadata"


def _is_consolidated(key: str) -> bool:
    return key.endswith(CONSOLIDATED) and bool(_splits(key, META_ROOT))


def is_document(key: str) -> bool:
    return (key.endswith(SUFFIX) or key.endswith(CONSOLIDATED)) and bool(_splits(key, META_ROOT))


def dataset_dirs(key: str, data: bytes) -> list[str]:
    """``<prefix>meta/root/<p>.array.json`` describes the array under
    ``<prefix>data/root/<p>`` (each reading of the key: the view keeps
    those that are datasets).  (Consolidated metadata describes none: its
    arrays are their own documents'.)"""
    if not key.endswith(SUFFIX):
        return []
    return [prefix + DATA_ROOT + rest[:-len(SUFFIX)] for prefix, rest in _splits(key, META_ROOT)]


def _unsharded(doc: dict) -> dict:
    out = dict(doc)
    rest = [t for t in doc["storage_transformers"] if not _is_sharding(t)]
    if rest:
        out["storage_transformers"] = rest
    else:
        del out["storage_transformers"]
    return out


def _members(doc) -> dict | None:
    members = doc.get("metadata") if isinstance(doc, dict) else None
    return members if isinstance(members, dict) else None


def rewrite_document(key: str, data: bytes) -> bytes | None:
    doc = load_json(data, key)
    if doc is None:
        return None
    if _is_consolidated(key):
        # each sharded array member shown as its own document is
        members = _members(doc)
        if members is None:
            return None
        out = {k: _unsharded(v) if k.endswith(SUFFIX) and isinstance(v, dict) and _transformer(v) is not None
               and _dataset_params(v, f"{key}: {k}") is not None else v for k, v in members.items()}
        if all(out[k] is members[k] for k in members):
            return None
        return dump_json({**doc, "metadata": out}, data)
    if _transformer(doc) is None:
        return None
    if _dataset_params(doc, key) is None:
        return None  # shown raw; _dataset_params logged why
    return dump_json(_unsharded(doc), data)


#: fields the stored shards are laid out by: a document written through the
#: view may not change them (the shards would no longer read as written)
_FIXED = ("chunk_grid", "data_type", "compressor", "chunk_memory_layout")


def accept_document(key: str, new: bytes, stored: bytes | None, shard_option=None) -> bytes | None:
    """What to store when a tool writes an array document through the view:
    over a transformer-sharded array, the view's document with the sharding
    transformer put back (attributes, fill value, shape may change; a change
    of the fields in ``_FIXED`` raises ValueError, refused with EPERM).
    A new transformer-sharded array is refused (ValueError): its shards
    would come through the view as chunks.  Anything else, an emptied or
    non-JSON document included: None (as written; the view orphans the
    array, as when the document is removed)."""
    if not is_document(key):
        return None
    if stored is None:
        doc = load_json(new, key)
        if doc is not None and _transformer(doc) is not None and _dataset_params(doc, key) is not None:
            raise ValueError(NEW_SHARDED)
        if shard_option and isinstance(doc, dict) and isinstance(doc.get("shape"), list) and doc["shape"]:
            # (a new array: the transformer is not added, as -o shard adds the codec to a zarr.json)
            warn_once(log, f"{key}: stored unsharded, as written: -o shard shards Zarr v3 arrays (zarr.json), "
                           "not v3-draft storage-transformer ones")
        return None
    old = load_json(stored, key)
    if old is None or _transformer(old) is None or _dataset_params(old, key) is None:
        return None
    doc = load_json(new, key)
    if doc is None:
        return None  # no document (emptied, or not JSON): as written; the view keeps the chunks (4.15)
    if _transformer(doc) is not None:
        return None  # the stored form itself, written back
    return dump_json(_map_back(doc, old), new)


def _map_back(doc: dict, old: dict) -> dict:
    """The view's document ``doc`` of the transformer-sharded array stored
    as ``old``, with the sharding transformer put back (ValueError: a
    change the stored shards cannot take)."""
    changed = [f for f in _FIXED if doc.get(f) != old.get(f)]
    if changed:
        raise ValueError(f"changing {', '.join(changed)} would make the stored shards unreadable")
    out = dict(doc)
    out["storage_transformers"] = [_transformer(old), *(doc.get("storage_transformers") or [])]
    return out


async def accept_document_async(ctx: LayoutContext, key: str, new: bytes, stored: bytes | None,
                                shard_option, pending=None, previous=None) -> bytes | None:
    """``accept_document``; and for consolidated metadata written through
    the view (zarr 2.18's ``consolidate_metadata``, which copies the view's
    documents), each member that is the view's form of a transformer-sharded
    array mapped back onto that array's stored document, as the document
    itself is (else zarr 2.18 opening the store consolidated would take its
    shards for chunks).  A member whose document is not stored (renamed
    away, SEMANTICS 4.18) maps back onto the stored consolidated entry of
    it: ``stored``'s, else, when none is stored there (removed, emptied),
    ``previous``'s (the last one stored there, which the view remembers);
    one that cannot be mapped onto it (an edit of what lays its shards
    out), or that has no such entry, or is not sharded, is stored as
    written."""
    if not _is_consolidated(key):
        return await off_loop(functools.partial(accept_document, key, new, stored, shard_option), len(new))
    doc = await load_json_async(new, key)
    members = _members(doc)
    if members is None:
        return None
    out = dict(members)
    old_members = None  # the stored (or previous) consolidated entries, read once needed

    async def stored_entry(name: str):
        nonlocal old_members
        if old_members is None:
            old_members = (_members(await load_json_async(stored, key)) if stored is not None else None) or \
                (_members(await load_json_async(previous, key)) if previous is not None else None) or {}
        entry = old_members.get(name)
        return entry if isinstance(entry, dict) and _transformer(entry) is not None \
            and _dataset_params(entry, f"{key} [{name}]") is not None else None
    for name, member in members.items():
        if not (name.startswith(META_ROOT) and name.endswith(SUFFIX) and isinstance(member, dict)) \
                or _transformer(member) is not None:
            continue
        for prefix, _ in _splits(key, META_ROOT):  # (the store's place: each reading, as probe)
            try:
                blob = await ctx.store.get_document(prefix + name)
                break
            except NotFound:
                continue
        else:
            # no stored document (renamed away): the stored consolidated entry of it
            if (old := await stored_entry(name)) is not None:
                try:
                    out[name] = _map_back(member, old)
                except ValueError as exc:
                    log.warning("%s: consolidated member %r, whose array is not stored, stored as written: %s",
                                key, name, exc)
            continue
        old = await load_json_async(blob.data, blob.info.key)
        if old is None or _transformer(old) is None or _dataset_params(old, blob.info.key) is None:
            continue
        try:
            out[name] = _map_back(member, old)
        except ValueError as exc:
            raise ValueError(f"consolidated member {name!r}: {exc}") from None
    if all(out[k] is members[k] for k in members):
        return None
    return dump_json({**doc, "metadata": out}, new)


def _dataset_params(doc: dict, what: str):
    """(ShardGrid, ChunkKeys) of a transformer-sharded array, or None (logged)."""
    transformer = _transformer(doc)
    if transformer is None:
        return None
    try:
        if transformer.get("type", "indexed") != "indexed":
            raise GridError(f"shard format {transformer.get('type')!r} (only 'indexed' exists)")
        if len(doc["storage_transformers"]) != 1:
            raise GridError("other storage transformers next to sharding")
        cps = (transformer.get("configuration") or {}).get("chunks_per_shard")
        shape = doc.get("shape")
        grid_doc = doc.get("chunk_grid") or {}
        chunks = grid_doc.get("chunk_shape")
        if not isinstance(shape, list) or not isinstance(chunks, list) or not isinstance(cps, list):
            raise GridError("shape, chunk_shape or chunks_per_shard missing")
        if not shape and cps in ([], [1]):
            cps = []  # zarr 2.18 writes [1] for a 0-d array
        if len(cps) != len(shape) or any(not isinstance(k, int) or k <= 0 for k in cps):
            raise GridError(f"chunks_per_shard {cps} does not fit shape {shape}")
        sep = grid_doc.get("separator", "/")
        if sep not in ("/", "."):
            raise GridError(f"separator {sep!r}")
        grid = ShardGrid.build(shape, [c * k for c, k in zip(chunks, cps)], chunks)
    except (GridError, TypeError, ValueError) as exc:
        warn_once(log, f"{what}: sharded array shown raw: {exc}")
        return None
    return grid, ChunkKeys("c", sep, len(shape), zero_d_key="c0")


async def probe(ctx: LayoutContext, dir_key: str) -> GridDataset | None:
    for prefix, path in _splits(dir_key, DATA_ROOT):
        if path:
            try:
                blob = await ctx.store.get_document(f"{prefix}{META_ROOT}{path}{SUFFIX}")
                break
            except NotFound:
                continue
    else:
        return None
    doc = await load_json_async(blob.data, blob.info.key)
    params = _dataset_params(doc, blob.info.key) if doc is not None else None
    if params is None:
        return None
    grid, keys = params
    dataset = GridDataset(ctx, dir_key, dir_key, grid, keys, ZarrShardFormat("end", "little", checksum=False))
    dataset.layout = NAME
    # zarr-python 2.18, this layout's writer, resizes by storing the smaller
    # document first, then deleting the chunks outside it: by names the
    # view no longer shows (ENOENT, which it ignores), so the view does it
    dataset.prunes_on_shrink = True
    dataset.version = ((blob.info.key, blob.info.etag),)
    return dataset
