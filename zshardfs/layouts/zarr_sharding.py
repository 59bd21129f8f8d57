"""Zarr v3 arrays sharded with the ``sharding_indexed`` codec.

The view of a sharded array (DESIGN.md §2): its ``zarr.json`` shows the
sharding codec's inner ``codecs`` and a regular ``chunk_grid`` of the inner
chunk shape; its chunk files are the inner chunks, named with the array's
own ``chunk_key_encoding``.  Group documents pass through, with the array
documents embedded in ``consolidated_metadata`` rewritten the same way.

Arrays whose codec chain the view cannot express (array->array codecs
before the sharding codec, bytes->bytes codecs after it, an index codec
other than ``bytes`` [+ ``crc32c``]) are shown raw, with one warning.
"""

from __future__ import annotations

import copy
import logging
from dataclasses import dataclass

from ..backends.base import NotFound, join_key
from .base import LayoutContext, dump_json, load_json, warn_once
from .grids import GridError, ShardGrid, parse_chunk_grid
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


def rewrite_document(key: str, data: bytes) -> bytes | None:
    """View bytes of a stored ``zarr.json`` (None: unchanged)."""
    if key.rsplit("/", 1)[-1] != "zarr.json":
        return None
    doc = load_json(data, key)
    if doc is None or doc.get("zarr_format") != 3:
        return None
    if doc.get("node_type") == "array":
        new = _rewrite_array(doc, key)
        return dump_json(new) if new is not None else None
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
            return dump_json(out)
    return None


async def probe(ctx: LayoutContext, dir_key: str) -> GridDataset | None:
    """A sharded Zarr v3 array rooted at ``dir_key``, or None."""
    try:
        blob = await ctx.store.get_document(join_key(dir_key, "zarr.json"))
    except NotFound:
        return None
    doc = load_json(blob.data, blob.info.key)
    if doc is None:
        return None
    try:
        meta = sharded_array_meta(doc)
    except Unsupported:
        return None  # rewrite_document logs the reason when the document is read
    if meta is None:
        return None
    dataset = GridDataset(ctx, dir_key, dir_key, meta.grid, meta.keys, meta.fmt)
    dataset.layout = NAME
    return dataset


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
        raise ValueError(f"-o shard has {len(factors)} factors but the array has {len(inner)} dimensions")
    out = dict(doc)
    out["chunk_grid"] = {"name": "regular", "configuration": {"chunk_shape": [c * k for c, k in zip(inner, factors)]}}
    out["codecs"] = [{"name": SHARDING, "configuration": {
        "chunk_shape": inner,
        "codecs": doc.get("codecs") or [{"name": "bytes", "configuration": {"endian": "little"}}],
        "index_codecs": [{"name": "bytes", "configuration": {"endian": "little"}}, {"name": "crc32c"}],
        "index_location": "end",
    }}]
    return out


def accept_document(key: str, new: bytes, stored: bytes | None, shard_option) -> bytes | None:
    """What to store when a tool writes ``zarr.json`` through the view.

    - over a sharded array: the view's document mapped back onto the stored
      one (attributes, fill value, shape...); a change that would make the
      stored chunks unreadable (inner chunk shape, codecs, data type, key
      encoding) raises ValueError;
    - a new unsharded array with ``-o shard=K``: stored sharded;
    - anything else: None (stored as written).
    """
    if key.rsplit("/", 1)[-1] != "zarr.json":
        return None
    doc = load_json(new, key)
    if doc is None or doc.get("node_type") != "array":
        return None
    old = load_json(stored, key) if stored is not None else None
    old_meta = None
    if old is not None:
        try:
            old_meta = sharded_array_meta(old)
        except Unsupported:
            old_meta = None
    if old_meta is not None:
        try:
            if sharded_array_meta(doc) is not None:
                return None  # the tool wrote a sharded document itself
        except Unsupported:
            return None
        view = view_array_doc(old, old_meta)
        for field_name in ("codecs", "chunk_grid", "data_type", "chunk_key_encoding"):
            if doc.get(field_name) != view.get(field_name):
                raise ValueError(f"changing {field_name} of a sharded array would make its stored chunks unreadable")
        out = dict(doc)
        out["codecs"] = old["codecs"]
        out["chunk_grid"] = old["chunk_grid"]
        try:
            ShardGrid.build(out["shape"], parse_chunk_grid(out["chunk_grid"], out["shape"]),
                            old_meta.inner_chunk_shape)
        except (GridError, TypeError, KeyError) as exc:
            raise ValueError(f"the new shape does not fit the stored shard grid: {exc}") from None
        return dump_json(out)
    if shard_option:
        try:
            if sharded_array_meta(doc) is not None:
                return None
        except Unsupported:
            return None
        sharded = _sharded_doc(doc, tuple(shard_option))
        return dump_json(sharded) if sharded is not None else None
    return None
