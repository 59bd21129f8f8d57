"""Peer-written Zarr test data ("oracles") and the comparison of a view with its twin.

Every case is written twice by the same peer library: once sharded (the store zshardfs
mounts) and once as its unsharded *twin* (same data, chunk shape = the inner chunk shape,
codecs = the inner codecs). DESIGN.md section 2 requires the mounted tree to equal the twin
file for file and byte for byte, with JSON documents JSON-equal: `compare_trees` checks that.
For cases the view shows raw (array->array codec before `sharding_indexed`, codecs after
it) and for unsharded arrays, the twin is a byte copy of the sharded store.

How the peers spell things on disk (found by running zarr 3.4.2, tensorstore 0.1.86 and
zarr 2.18.7, not from their docs):

zarr-python 3.4.2
  - `zarr.json` key order: shape, data_type, chunk_grid, chunk_key_encoding, fill_value,
    codecs, attributes, [dimension_names], zarr_format, node_type, and always
    `"storage_transformers": []`. Chunk key encoding always has a `configuration`.
  - `shards=` puts `filters` *inside* the sharding codec (`codecs: [transpose, bytes]`);
    an array->array codec *before* `sharding_indexed` needs an explicit
    `serializer=ShardingCodec(...)` plus `filters=`. Its validation checks the inner chunk
    against the untransposed shard while encoding uses the transposed one: keep such
    shards square. `serializer=ShardingCodec` + `compressors=[...]` writes codecs after
    the sharding codec (accepted, with a warning).
  - `bytes` on a 1-byte dtype is written `{"name": "bytes"}` (no configuration); blosc
    gets `typesize` filled in from the dtype, in the sharded doc and the twin alike.
  - Empty chunks (`array.write_empty_chunks`, default False): an inner chunk equal to the
    fill value (NaN compares equal to a NaN fill) is left out of its shard (index entry
    2^64-1), a shard with no chunk left is not written at all. With True, every inner
    chunk inside the array's inner-chunk grid is written; chunks of the last shard that
    lie wholly outside the array are still left out (empty index entries).
  - Rectilinear grids need `zarr.config.set({"array.rectilinear_chunks": True})`; then
    `chunks=[[8, 4, 8], 6]` with `serializer=ShardingCodec(chunk_shape=...)` (or
    `shards=[[...], ...]` with `chunks=inner`) makes variable shards. A bare int stays a bare
    int; edge lists are written run-length encoded when that is shorter
    (`[8, 8, 4]` -> `[[8, 2], 4]`, `[6, 6]` -> `[[6, 2]]`). Edges summing past the extent
    are refused in list form but accepted as `RectilinearChunkGridMetadata(chunk_shapes=...)`.
  - `create_array(store, name="a/b/x")` writes group documents for `a`, `a/b` and the
    root; a 0-d array's chunk key is `c` (`default`) or `0` (`v2`).
  - `zarr.consolidate_metadata(root)` writes `consolidated_metadata` (kind inline,
    must_understand false) into the root `zarr.json` only; embedded group documents carry
    their own, empty, `consolidated_metadata` block.
tensorstore zarr3 driver
  - Sorted keys; no `storage_transformers`; `index_location` is left out when it is
    `end`; `{"name": "default"}` without configuration for the default `/` encoding;
    `attributes`/`dimension_names` only when given.
  - Supports index at start/end, either index endian, with or without crc32c, nested
    sharding, transpose before sharding, 0-d, both key encodings, NaN fill.
    Does NOT support rectilinear/rectangular grids ("Expected regular"), nor bytes->bytes
    codecs after `sharding_indexed`. `store_data_equal_to_fill_value` is its
    write_empty_chunks and behaves like zarr-python's.
zarr-python 2.18.7 (v3 draft, storage transformer): see peers_zarr2_script.py.

Determinism: `gzip` via numcodecs stamps the current time in the header MTIME (bytes
4..7) and OS=255; tensorstore writes MTIME=0, OS=3. `normalize_gzip` canonicalises the
header (never the deflate stream or the CRC/size trailer). A gzip member inside a nested
shard cannot be normalised from outside, so nested cases do not use gzip. zstd (level
fixed, no multithreading in numcodecs) and blosc (blocks are compressed independently, so
thread count does not change the output) are byte-deterministic for a given library
version; the self-check verifies this by comparing twin chunks with shard contents.
"""

from __future__ import annotations

import itertools
import json
import math
import os
import shutil
import subprocess
import tempfile
import warnings
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

EMPTY = 2**64 - 1
SHARDING = "sharding_indexed"
TRANSFORMER_URI = "https://purl.org/zarr/spec/storage_transformers/sharding/1.0"
ZARR2_SCRIPT = Path(__file__).with_name("peers_zarr2_script.py")
ZARR2_PYTHON = Path(
    os.environ.get("ZSHARDFS_ZARR2_PYTHON", Path(__file__).resolve().parents[1] / ".venv-zarr2/bin/python")
)


# --------------------------------------------------------------------------- cases


@dataclass(frozen=True)
class ZarrCase:
    """One array layout. Per-dimension grid specs are an int (regular step) or a tuple of edges."""

    shape: tuple = (20, 12)
    dtype: str = "uint16"
    chunks: tuple = (4, 3)  # inner chunk shape = the view's/twin's chunk shape
    shards: tuple | None = (8, 6)  # shard shape in elements; None: array not sharded
    grid: str = "regular"  # shard grid: regular | rectilinear | rectangular
    index_location: str = "end"
    index_endian: str = "little"
    index_crc32c: bool = True
    endian: str = "little"  # inner `bytes` codec (zarr2: byte order of the dtype)
    compressor: str | None = None  # None | gzip | zstd | blosc (inner bytes->bytes codec)
    key_encoding: str = "default"  # default | v2 (zarr2 draft: always "c" prefix)
    separator: str = "/"
    fill_value: Any = 0
    pattern: str = "full"  # full | sparse (missing chunks and shards) | empty (nothing written)
    write_empty_chunks: bool = False
    attributes: dict | None = None
    dimension_names: tuple | None = None
    nested: tuple | None = None  # nested sharding: innermost chunk shape; `chunks` is the middle level
    inner_transpose: tuple | None = None  # transpose among the inner codecs (normal view)
    pre_transpose: tuple | None = None  # transpose before sharding_indexed: view is raw
    post_codec: str | None = None  # bytes->bytes codec after sharding_indexed ("crc32c"): raw
    path: str = "arr"  # array path inside the store ("" = root array)

    @property
    def sharded(self) -> bool:
        return self.shards is not None

    @property
    def raw(self) -> bool:
        """The view shows this array unchanged (not sharded, or a combination it can't express)."""
        return not self.sharded or self.pre_transpose is not None or self.post_codec is not None

    def with_(self, **kw) -> ZarrCase:
        return replace(self, **kw)


def _bounds(spec: int | tuple, extent: int) -> list[int]:
    """Boundaries [0, b1, ..., extent] of a grid dimension given as a step or an edge list."""
    if isinstance(spec, int):
        return list(range(0, extent, spec)) + [extent] if extent else [0]
    out = [0]
    for e in spec:
        if out[-1] >= extent:
            break
        out.append(min(out[-1] + e, extent))
    return out


def chunk_bounds(case: ZarrCase) -> list[list[int]]:
    """Per-dimension boundaries of the view's chunk grid (inner chunks)."""
    return [_bounds(c, n) for c, n in zip(case.chunks, case.shape)]


def shard_bounds(case: ZarrCase) -> list[list[int]]:
    """Per-dimension boundaries of the shard grid (clipped to the array)."""
    assert case.sharded
    return [_bounds(s, n) for s, n in zip(case.shards, case.shape)]


def grid_coords(bounds: list[list[int]]):
    return itertools.product(*(range(len(b) - 1) for b in bounds))


def shard_of(case: ZarrCase, coords: tuple) -> tuple:
    """Shard grid position holding the inner chunk at `coords`."""
    out = []
    for c, cb, sb in zip(coords, chunk_bounds(case), shard_bounds(case)):
        start = cb[c]
        out.append(max(i for i in range(len(sb) - 1) if sb[i] <= start))
    return tuple(out)


def _is_fill(block: np.ndarray, fill: Any) -> bool:
    if isinstance(fill, float) and math.isnan(fill):
        return bool(np.isnan(block).all())
    return bool((block == fill).all())


def _block(data: np.ndarray, bounds: list[list[int]], coords: tuple) -> np.ndarray:
    return data[tuple(slice(b[c], b[c + 1]) for b, c in zip(bounds, coords))]


def make_data(case: ZarrCase) -> np.ndarray:
    """Deterministic data: `full` has no inner chunk equal to the fill value; `sparse` makes
    every shard whose coordinates sum to 1 mod 3 all-fill, and within the others every
    inner chunk whose coordinates sum to an odd number."""
    dt = np.dtype(case.dtype)
    n = math.prod(case.shape)
    if dt.kind == "b":
        data = np.ones(n, dtype=dt)
    else:
        vals = np.arange(n) % 100 + 1
        if dt.kind in "iu" and 1 <= case.fill_value <= 100:
            vals[vals == case.fill_value] = 101
        data = (vals * (0.5 if dt.kind == "f" else 1)).astype(dt)
    data = data.reshape(case.shape)
    if case.pattern == "full":
        return data
    if case.pattern == "empty":
        return np.full(case.shape, case.fill_value, dtype=dt)
    assert case.pattern == "sparse" and case.shape, case
    bounds = chunk_bounds(case)
    for coords in grid_coords(bounds):
        shard_empty = case.sharded and sum(shard_of(case, coords)) % 3 == 1
        if shard_empty or sum(coords) % 2 == 1:
            _block(data, bounds, coords)[...] = case.fill_value
    return data


def chunk_key(case: ZarrCase, coords: tuple) -> str:
    """Key of a chunk (or shard) at grid `coords` under the array, per its key encoding."""
    sep = case.separator
    if case.key_encoding == "v2":
        return sep.join(map(str, coords)) if coords else "0"
    return sep.join(["c", *map(str, coords)])


def parse_chunk_key(case: ZarrCase, key: str) -> tuple:
    """Inverse of `chunk_key`."""
    if case.key_encoding == "v2":
        return () if key == "0" and not case.shape else tuple(map(int, key.split(case.separator)))
    parts = key.split(case.separator)
    assert parts[0] == "c", key
    return tuple(map(int, parts[1:]))


def draft_chunk_key(case: ZarrCase, coords: tuple) -> str:
    """Storage-transformer draft key: `data/root/<path>/c<i><sep><j>...` (0-d: `c0`)."""
    return f"data/root/{case.path}/c" + case.separator.join(map(str, coords or (0,)))


def _join(path: str, key: str) -> str:
    return f"{path}/{key}" if path else key


def written_chunks(case: ZarrCase, data: np.ndarray) -> set[tuple]:
    """Inner-chunk coordinates a peer writes (the view's chunk files)."""
    if case.pattern == "empty":
        return set()
    bounds = chunk_bounds(case)
    return {
        c
        for c in grid_coords(bounds)
        if case.write_empty_chunks or not _is_fill(_block(data, bounds, c), case.fill_value)
    }


def expected_chunk_keys(case: ZarrCase, data: np.ndarray) -> set[str]:
    """Store-relative paths of the twin's chunk files (for a raw case: of its stored objects)."""
    if case.raw and case.sharded:
        return expected_shard_keys(case, data)
    return {_join(case.path, chunk_key(case, c)) for c in written_chunks(case, data)}


def expected_shard_keys(case: ZarrCase, data: np.ndarray) -> set[str]:
    """Store-relative paths of the objects a peer writes: shards (unsharded array: chunks)."""
    if not case.sharded:
        return {_join(case.path, chunk_key(case, c)) for c in written_chunks(case, data)}
    return {_join(case.path, chunk_key(case, shard_of(case, c))) for c in written_chunks(case, data)}


# ------------------------------------------------------------------ metadata rewrites


def _expand_rle(dim: int | list) -> int | list[int]:
    if isinstance(dim, int):
        return dim
    out: list[int] = []
    for item in dim:
        out.extend([item[0]] * item[1] if isinstance(item, list) else [item])
    return out


def to_rectangular(doc: dict) -> dict:
    """ZEP 3 spelling of a rectilinear array document (runs expanded, bare ints kept)."""
    grid = doc["chunk_grid"]
    assert grid["name"] == "rectilinear", grid
    shapes = [_expand_rle(d) for d in grid["configuration"]["chunk_shapes"]]
    return {**doc, "chunk_grid": {"name": "rectangular", "configuration": {"chunk_shape": shapes}}}


def expected_view_metadata(doc: dict) -> dict:
    """The view contract's rewrite of one metadata document (DESIGN.md section 2).

    v3 array with `sharding_indexed` as its only codec: codecs = inner codecs, chunk_grid =
    regular inner chunk_shape, everything else kept. Other v3 arrays are kept (raw). A v3
    group has the array documents inside `consolidated_metadata` rewritten. A v3-draft
    `*.array.json` loses its sharding storage transformer (and the key when empty)."""
    if "storage_transformers" in doc and "chunk_grid" in doc and "type" in doc["chunk_grid"]:
        rest = [t for t in doc["storage_transformers"] if t.get("extension") != TRANSFORMER_URI]
        out = {k: v for k, v in doc.items() if k != "storage_transformers"}
        return {**out, "storage_transformers": rest} if rest else out
    if doc.get("node_type") == "group":
        cm = doc.get("consolidated_metadata")
        if not isinstance(cm, dict) or not isinstance(cm.get("metadata"), dict):
            return doc
        meta = {k: expected_view_metadata(v) for k, v in cm["metadata"].items()}
        return {**doc, "consolidated_metadata": {**cm, "metadata": meta}}
    codecs = doc.get("codecs") or []
    if doc.get("node_type") != "array" or len(codecs) != 1 or codecs[0].get("name") != SHARDING:
        return doc
    conf = codecs[0]["configuration"]
    grid = {"name": "regular", "configuration": {"chunk_shape": list(conf["chunk_shape"])}}
    return {**doc, "codecs": conf["codecs"], "chunk_grid": grid}


# ------------------------------------------------------------------ comparison


def normalize_gzip(data: bytes) -> bytes:
    """Canonical gzip header (MTIME=0, XFL=0, OS=255, no FEXTRA/FNAME/FCOMMENT/FHCRC) so
    chunks written at different times or by different writers compare equal; the deflate
    stream and the CRC32/ISIZE trailer are kept. Non-gzip input is returned unchanged."""
    if len(data) < 18 or data[:3] != b"\x1f\x8b\x08":
        return data
    flg, pos = data[3], 10
    if flg & 4:  # FEXTRA
        pos += 2 + int.from_bytes(data[pos : pos + 2], "little")
    for bit in (8, 16):  # FNAME, FCOMMENT: zero-terminated
        if flg & bit:
            pos = data.index(b"\0", pos) + 1
    if flg & 2:  # FHCRC
        pos += 2
    return b"\x1f\x8b\x08\x00\x00\x00\x00\x00\x00\xff" + data[pos:]


def _json_kind(v: Any) -> str:
    if isinstance(v, bool) or v is None:
        return repr(v)[:4]
    return "num" if isinstance(v, (int, float)) else type(v).__name__


def json_diff(a: Any, b: Any, where: str = "$") -> list[str]:
    """Differences between two JSON values; key order is ignored, 1 == 1.0, NaN == NaN,
    but `true` != 1."""
    if isinstance(a, dict) and isinstance(b, dict):
        out = []
        for k in sorted(set(a) | set(b)):
            if k not in b:
                out.append(f"{where}.{k}: only in view ({a[k]!r})")
            elif k not in a:
                out.append(f"{where}.{k}: only in twin ({b[k]!r})")
            else:
                out += json_diff(a[k], b[k], f"{where}.{k}")
        return out
    if isinstance(a, list) and isinstance(b, list):
        if len(a) != len(b):
            return [f"{where}: {a!r} != {b!r}"]
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in json_diff(x, y, f"{where}[{i}]")]
    same = _json_kind(a) == _json_kind(b) and (
        a == b or (isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b))
    )
    return [] if same else [f"{where}: {a!r} != {b!r}"]


def list_files(root: os.PathLike | str) -> set[str]:
    """Relative POSIX paths of all files under `root` (directories are not compared)."""
    root = Path(root)
    return {
        (Path(d) / f).relative_to(root).as_posix() for d, _, fs in os.walk(root) for f in fs
    }


def is_metadata_name(rel: str) -> bool:
    name = rel.rsplit("/", 1)[-1]
    return name == "zarr.json" or name.endswith((".array.json", ".group.json")) or name.startswith(".z")


def _owner_doc(root: Path, rel: str) -> dict | None:
    """Metadata document of the array a chunk file belongs to (v3 or v3-draft layout)."""
    parts = rel.split("/")[:-1]
    for i in range(len(parts), -1, -1):
        prefix = "/".join(parts[:i])
        cand = [root / prefix / "zarr.json"]
        if prefix.startswith("data/root/"):
            cand.append(root / f"meta/root/{prefix[len('data/root/'):]}.array.json")
        for p in cand:
            try:
                doc = json.loads(p.read_bytes())
            except (OSError, ValueError):
                continue
            if doc.get("node_type", "array") == "array":
                return doc
    return None


def _uses_gzip(doc: dict | None) -> bool:
    if not doc:
        return False
    names = [c.get("name") for c in doc.get("codecs", []) if isinstance(c, dict)]
    return "gzip" in names or "gzip" in str((doc.get("compressor") or {}).get("codec", ""))


def compare_trees(view_root: os.PathLike | str, twin_root: os.PathLike | str) -> list[str]:
    """Human-readable differences between a view and its twin (empty when equal).

    Files only (a view may show empty intermediate directories); metadata documents are
    compared as JSON, chunk files as bytes, after `normalize_gzip` when their array's
    codecs include gzip (looked up in the twin)."""
    view, twin = Path(view_root), Path(twin_root)
    vf, tf = list_files(view), list_files(twin)
    out = [f"only in view: {p}" for p in sorted(vf - tf)]
    out += [f"only in twin: {p}" for p in sorted(tf - vf)]
    for rel in sorted(vf & tf):
        a, b = (view / rel).read_bytes(), (twin / rel).read_bytes()
        if a == b:
            continue
        if is_metadata_name(rel):
            try:
                ja, jb = json.loads(a), json.loads(b)
            except ValueError as e:
                out.append(f"{rel}: not JSON ({e})")
                continue
            out += [f"{rel}: {d}" for d in json_diff(ja, jb)]
        elif not (_uses_gzip(_owner_doc(twin, rel)) and normalize_gzip(a) == normalize_gzip(b)):
            out.append(f"{rel}: bytes differ ({len(a)} vs {len(b)} bytes)")
    return out


# ------------------------------------------------------------------ zarr-python 3.4


def _zp_parts(case: ZarrCase):
    """((filters, serializer, compressors) of the view's array, sharding codec or None),
    as zarr-python codec objects."""
    from zarr.codecs import (BloscCodec, BytesCodec, Crc32cCodec, GzipCodec, ShardingCodec,
                             TransposeCodec, ZstdCodec)

    comp = {
        None: [],
        "gzip": [GzipCodec(level=5)],
        "zstd": [ZstdCodec(level=3)],
        "blosc": [BloscCodec(cname="lz4", clevel=5, shuffle="shuffle")],
    }[case.compressor]
    filters = [TransposeCodec(order=case.inner_transpose)] if case.inner_transpose else []
    view = (filters, BytesCodec(endian=case.endian), comp)
    if not case.sharded:
        return view, None
    index = [BytesCodec(endian=case.index_endian)] + ([Crc32cCodec()] if case.index_crc32c else [])

    def shard(chunk_shape, codecs):
        return ShardingCodec(chunk_shape=chunk_shape, codecs=codecs, index_codecs=index,
                             index_location=case.index_location)

    inner = [*filters, view[1], *comp]
    if case.nested:  # the view keeps the inner sharding codec
        view = ([], shard(case.nested, inner), [])
        inner = [view[1]]
    return view, shard(case.chunks, inner)


def _zp_write(root: Path, case: ZarrCase, data: np.ndarray, *, twin: bool) -> None:
    import zarr
    from zarr.codecs import Crc32cCodec, TransposeCodec
    from zarr.core.metadata.v3 import RectilinearChunkGridMetadata

    view, sharding = _zp_parts(case)
    if (twin and not case.raw) or not case.sharded:
        (filters, serializer, compressors), grid = view, case.chunks
        variable = not case.sharded and case.grid != "regular"  # a twin's grid is regular
    else:
        filters = [TransposeCodec(order=case.pre_transpose)] if case.pre_transpose else []
        compressors = {None: [], "crc32c": [Crc32cCodec()]}[case.post_codec]
        serializer, grid = sharding, case.shards
        variable = case.grid != "regular"
    if variable:  # also accepts edges summing past the extent, which `chunks=[[...]]` refuses
        grid = RectilinearChunkGridMetadata(chunk_shapes=grid)
    enc = {"name": case.key_encoding, "separator": case.separator}
    with warnings.catch_warnings(), zarr.config.set({"array.rectilinear_chunks": True}):
        warnings.simplefilter("ignore")
        arr = zarr.create_array(
            zarr.storage.LocalStore(root), name=case.path or None, shape=case.shape,
            dtype=case.dtype, chunks=grid, filters=filters, serializer=serializer,
            compressors=compressors, fill_value=case.fill_value,
            attributes=case.attributes, dimension_names=case.dimension_names,
            chunk_key_encoding=enc, config={"write_empty_chunks": case.write_empty_chunks},
            overwrite=True,
        )
        if case.pattern != "empty":
            arr[...] = data


def _rewrite_rectangular(root: Path, path: str) -> None:
    """Rewrite one rectilinear array document, and its entries in consolidated metadata,
    to ZEP 3 `rectangular` (no peer writes it; shard bytes are unchanged)."""
    doc_path = root / path / "zarr.json"
    doc_path.write_text(json.dumps(to_rectangular(json.loads(doc_path.read_text())), indent=2))
    for group_doc in root.rglob("zarr.json"):
        doc = json.loads(group_doc.read_text())
        meta = (doc.get("consolidated_metadata") or {}).get("metadata")
        if doc.get("node_type") != "group" or not meta:
            continue
        prefix = group_doc.parent.relative_to(root).as_posix()
        key = path if prefix == "." else path[len(prefix) + 1 :] if path.startswith(prefix + "/") else None
        if key in meta:
            meta[key] = to_rectangular(meta[key])
            group_doc.write_text(json.dumps(doc, indent=2))


def _copy_array(src_root: Path, dst_root: Path, path: str) -> None:
    src, dst = src_root / path, dst_root / path
    if path:
        shutil.rmtree(dst, ignore_errors=True)
        shutil.copytree(src, dst)
    else:
        shutil.copytree(src, dst, dirs_exist_ok=True)


def write_zarr_hierarchy(
    cases: list[ZarrCase],
    sharded_root: os.PathLike | str,
    twin_root: os.PathLike | str,
    *,
    consolidated: bool = False,
    root_attributes: dict | None = None,
    datas: dict[str, np.ndarray] | None = None,
) -> dict[str, np.ndarray]:
    """Write several arrays (distinct `case.path`s, parents become groups with attributes)
    with zarr-python into both roots, optionally consolidate; returns path -> data."""
    import zarr

    sroot, troot = Path(sharded_root), Path(twin_root)
    out = {}
    for root in (sroot, troot):
        if not any(c.path == "" for c in cases):
            zarr.open_group(zarr.storage.LocalStore(root), mode="a", attributes=root_attributes or {})
        for c in cases:  # parents as explicit groups with attributes
            parts = c.path.split("/")[:-1]
            for i in range(1, len(parts) + 1):
                zarr.open_group(zarr.storage.LocalStore(root), path="/".join(parts[:i]), mode="a",
                                attributes={"group": "/".join(parts[:i])})
    for c in cases:
        data = (datas or {}).get(c.path)
        data = make_data(c) if data is None else data
        out[c.path] = data
        _zp_write(sroot, c, data, twin=False)
        _zp_write(troot, c, data, twin=True)
        if c.raw:  # the view is the stored array itself: byte copy (gzip MTIME included)
            _copy_array(sroot, troot, c.path)
    if consolidated:
        with warnings.catch_warnings(), zarr.config.set({"array.rectilinear_chunks": True}):
            warnings.simplefilter("ignore")
            for root in (sroot, troot):
                zarr.consolidate_metadata(zarr.storage.LocalStore(root))
    for c in cases:
        if c.grid == "rectangular":
            _rewrite_rectangular(sroot, c.path)
            if c.raw:
                _rewrite_rectangular(troot, c.path)
    return out


def write_zarr_python(case: ZarrCase, sharded_root, twin_root, data: np.ndarray | None = None) -> np.ndarray:
    """Write `case` with zarr-python 3.4 sharded into `sharded_root/<path>` and its unsharded
    twin into `twin_root/<path>`; returns the data."""
    return write_zarr_hierarchy([case], sharded_root, twin_root,
                                datas=None if data is None else {case.path: data})[case.path]


# ------------------------------------------------------------------ tensorstore


def tensorstore_supports(case: ZarrCase) -> bool:
    """tensorstore's zarr3 driver knows only regular grids and nothing after sharding."""
    return case.grid == "regular" and case.post_codec is None


def _ts_fill(case: ZarrCase):
    f = case.fill_value
    return "NaN" if isinstance(f, float) and math.isnan(f) else f


def _ts_metadata(case: ZarrCase, *, twin: bool) -> dict:
    itemsize = np.dtype(case.dtype).itemsize
    comp = {
        None: [],
        "gzip": [{"name": "gzip", "configuration": {"level": 5}}],
        "zstd": [{"name": "zstd", "configuration": {"level": 3, "checksum": False}}],
        "blosc": [{"name": "blosc", "configuration": {"cname": "lz4", "clevel": 5, "shuffle": "shuffle",
                                                      "typesize": itemsize, "blocksize": 0}}],
    }[case.compressor]
    inner = [{"name": "transpose", "configuration": {"order": list(case.inner_transpose)}}] if case.inner_transpose else []
    inner += [{"name": "bytes", "configuration": {"endian": case.endian}}, *comp]
    index = [{"name": "bytes", "configuration": {"endian": case.index_endian}}]
    index += [{"name": "crc32c"}] if case.index_crc32c else []

    def shard(chunk_shape, codecs):
        return {"name": SHARDING, "configuration": {"chunk_shape": list(chunk_shape), "codecs": codecs,
                                                    "index_codecs": index, "index_location": case.index_location}}

    if case.nested:
        inner = [shard(case.nested, inner)]
    if not case.sharded or (twin and not case.raw):
        grid, codecs = case.chunks, inner
    else:
        pre = [{"name": "transpose", "configuration": {"order": list(case.pre_transpose)}}] if case.pre_transpose else []
        grid, codecs = case.shards, [*pre, shard(case.chunks, inner)]
    meta = {
        "shape": list(case.shape), "data_type": case.dtype, "fill_value": _ts_fill(case),
        "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": list(grid)}},
        "chunk_key_encoding": {"name": case.key_encoding, "configuration": {"separator": case.separator}},
        "codecs": codecs,
    }
    if case.attributes is not None:
        meta["attributes"] = case.attributes
    if case.dimension_names is not None:
        meta["dimension_names"] = list(case.dimension_names)
    return meta


def write_tensorstore(case: ZarrCase, sharded_root, twin_root, data: np.ndarray | None = None) -> np.ndarray:
    """Write `case` with tensorstore's zarr3 driver (a second, independent writer) sharded
    and as its twin. No group documents: tensorstore writes arrays only."""
    import tensorstore as ts

    if not tensorstore_supports(case):
        raise NotImplementedError(f"tensorstore cannot write {case}")
    data = make_data(case) if data is None else data
    for root, twin in ((Path(sharded_root), False), (Path(twin_root), True)):
        spec = {
            "driver": "zarr3", "kvstore": {"driver": "file", "path": str(root / case.path) + "/"},
            "metadata": _ts_metadata(case, twin=twin), "create": True, "delete_existing": True,
            "store_data_equal_to_fill_value": case.write_empty_chunks,
        }
        store = ts.open(spec).result()
        if case.pattern != "empty":
            store.write(data).result()
    if case.raw:
        _copy_array(Path(sharded_root), Path(twin_root), case.path)
    return data


# ------------------------------------------------------------------ zarr-python 2.18 transformer


def zarr2_supports(case: ZarrCase) -> bool:
    """The v3-draft transformer: regular grid, index always little-endian at the end without
    checksum, a `c` key prefix, no codecs besides one compressor."""
    return (
        case.sharded and case.grid == "regular" and case.index_location == "end"
        and case.index_endian == "little" and not case.index_crc32c
        and case.key_encoding == "default" and case.dimension_names is None
        and not (case.nested or case.inner_transpose or case.pre_transpose or case.post_codec)
        and all(s % c == 0 for s, c in zip(case.shards, case.chunks))
        and bool(case.path)
    )


def zarr2_available() -> bool:
    return ZARR2_PYTHON.exists()


def write_zarr2_hierarchy(cases: list[ZarrCase], sharded_root, twin_root, *,
                          root_attributes: dict | None = None) -> dict[str, np.ndarray]:
    """Write arrays with zarr-python 2.18's sharding storage transformer (v3 draft layout)
    and their twins, by running peers_zarr2_script.py under the zarr 2 interpreter."""
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        arrays = []
        for i, c in enumerate(cases):
            if not zarr2_supports(c):
                raise NotImplementedError(f"zarr 2.18 transformer cannot write {c}")
            out[c.path] = data = make_data(c)
            npy = Path(tmp) / f"{i}.npy"
            np.save(npy, data)
            dt = np.dtype(c.dtype).newbyteorder("<" if c.endian == "little" else ">")
            arrays.append({
                **{k: v for k, v in asdict(c).items() if k in ("shape", "chunks", "compressor", "separator",
                                                                 "fill_value", "attributes", "path", "pattern",
                                                                 "write_empty_chunks")},
                "dtype": dt.str if dt.itemsize > 1 else dt.name,
                "chunks_per_shard": [s // k for s, k in zip(c.shards, c.chunks)],
                "data": str(npy),
            })
        job = {"sharded_root": str(sharded_root), "twin_root": str(twin_root),
               "root_attributes": root_attributes, "arrays": arrays}
        (Path(tmp) / "job.json").write_text(json.dumps(job))
        env = {**os.environ, "ZARR_V3_EXPERIMENTAL_API": "1", "ZARR_V3_SHARDING": "1"}
        proc = subprocess.run([str(ZARR2_PYTHON), str(ZARR2_SCRIPT), str(Path(tmp) / "job.json")],
                              env=env, capture_output=True, text=True)
        if proc.returncode:
            raise RuntimeError(f"zarr2 script failed:\n{proc.stderr}")
    return out


def write_zarr2_transformer(case: ZarrCase, sharded_root, twin_root) -> np.ndarray:
    """One array with the sharding storage transformer, and its twin."""
    return write_zarr2_hierarchy([case], sharded_root, twin_root)[case.path]


# ------------------------------------------------------------------ manifest

B = ZarrCase()
_SPARSE3D = ZarrCase(shape=(6, 8, 10), chunks=(2, 4, 5), shards=(4, 8, 10), pattern="sparse")

#: zarr-python cases covering every variant; conformance tests parametrize over these.
ZARR_CASES: list[tuple[str, ZarrCase]] = [
    ("basic", B),
    ("index_start", B.with_(index_location="start")),
    ("index_be_nocrc", B.with_(index_endian="big", index_crc32c=False)),
    ("index_be_crc_sparse", B.with_(index_endian="big", pattern="sparse", compressor="blosc")),
    ("index_be_crc_start", B.with_(index_endian="big", index_location="start")),
    ("index_le_nocrc", B.with_(index_crc32c=False, compressor="zstd")),
    ("index_le_nocrc_start", B.with_(index_crc32c=False, index_location="start")),
    ("index_be_nocrc_start_gzip", B.with_(index_endian="big", index_crc32c=False, index_location="start",
                                          compressor="gzip", pattern="sparse")),
    ("inner_be_gzip", B.with_(endian="big", compressor="gzip")),
    ("zstd", B.with_(compressor="zstd")),
    ("blosc", B.with_(compressor="blosc", dtype="float32")),
    ("key_default_dot", B.with_(separator=".")),
    ("key_v2_dot", B.with_(key_encoding="v2", separator=".")),
    ("key_v2_slash", B.with_(key_encoding="v2", separator="/")),
    ("sparse", B.with_(pattern="sparse")),
    ("sparse_gzip_v2", B.with_(pattern="sparse", compressor="gzip", key_encoding="v2", separator=".")),
    ("sparse_fill_nonzero_int8", B.with_(pattern="sparse", dtype="int8", fill_value=-3)),
    ("sparse_nan_fill", B.with_(pattern="sparse", dtype="float32", fill_value=float("nan"))),
    ("sparse_bool", B.with_(pattern="sparse", dtype="bool", fill_value=False)),
    ("empty", B.with_(pattern="empty")),
    ("write_empty_chunks", B.with_(shape=(22, 13), pattern="sparse", write_empty_chunks=True)),
    ("partial_edges", B.with_(shape=(22, 13), pattern="sparse")),
    ("shard_larger_than_array", B.with_(shape=(5, 7), chunks=(4, 4), shards=(8, 8))),
    ("attrs_dimnames", B.with_(attributes={"unit": "nm", "nested": {"a": [1, 2.5, None]}},
                               dimension_names=("y", None))),
    ("f8_be_zstd_start", B.with_(dtype="float64", endian="big", compressor="zstd", index_location="start")),
    ("1d", ZarrCase(shape=(100,), chunks=(10,), shards=(40,), pattern="sparse")),
    ("3d_sparse", _SPARSE3D),
    ("3d_dot_gzip", _SPARSE3D.with_(separator=".", compressor="gzip", pattern="full")),
    ("0d", ZarrCase(shape=(), dtype="float32", chunks=(), shards=(), fill_value=0.0)),
    ("0d_empty", ZarrCase(shape=(), dtype="float32", chunks=(), shards=(), fill_value=0.0, pattern="empty")),
    ("0d_v2_gzip", ZarrCase(shape=(), dtype="int32", chunks=(), shards=(), key_encoding="v2", compressor="gzip")),
    ("in_groups", B.with_(path="g1/g2/arr", pattern="sparse")),
    ("rectilinear_edges", B.with_(grid="rectilinear", shards=((8, 4, 8), 6))),
    ("rectilinear_rle_sparse", B.with_(grid="rectilinear", shards=((8, 8, 4), (6, 6)), pattern="sparse")),
    ("rectilinear_overhang", B.with_(grid="rectilinear", shards=((8, 8, 8), 6), pattern="sparse",
                                     write_empty_chunks=True)),
    ("rectilinear_gzip_v2", B.with_(grid="rectilinear", shards=((4, 16), (3, 9)), compressor="gzip",
                                    key_encoding="v2", separator=".", pattern="sparse")),
    ("rectangular_edges", B.with_(grid="rectangular", shards=((8, 4, 8), 6))),
    ("rectangular_rle_sparse_gzip", B.with_(grid="rectangular", shards=((8, 8, 4), (6, 6)),
                                            pattern="sparse", compressor="gzip")),
    ("nested", ZarrCase(shape=(20, 12), chunks=(4, 6), nested=(2, 3), shards=(8, 12))),
    ("nested_sparse_zstd_start", ZarrCase(shape=(20, 12), chunks=(4, 6), nested=(2, 3), shards=(8, 12),
                                          pattern="sparse", compressor="zstd", index_location="start")),
    ("inner_transpose", B.with_(chunks=(4, 4), shards=(8, 8), shape=(16, 12), inner_transpose=(1, 0))),
    ("raw_pre_transpose", B.with_(chunks=(4, 4), shards=(8, 8), shape=(16, 12), pre_transpose=(1, 0))),
    ("raw_post_crc32c", B.with_(post_codec="crc32c", compressor="gzip")),
    ("unsharded", B.with_(shards=None, compressor="gzip", pattern="sparse")),
    ("unsharded_rectilinear", B.with_(shards=None, grid="rectilinear", chunks=((8, 4, 8), 6))),
    ("unsharded_rectangular", B.with_(shards=None, grid="rectangular", chunks=((8, 8, 4), (6, 6)))),
]

#: the subset tensorstore can write (a second, independent writer of the same layouts).
TENSORSTORE_CASES = [(i, c) for i, c in ZARR_CASES if tensorstore_supports(c)]

_Z2 = ZarrCase(index_crc32c=False, path="arr")
#: zarr-python 2.18 storage-transformer cases (v3 draft layout).
ZARR2_CASES: list[tuple[str, ZarrCase]] = [
    ("basic", _Z2),
    ("dot_gzip_sparse", _Z2.with_(separator=".", compressor="gzip", pattern="sparse")),
    ("blosc_be", _Z2.with_(compressor="blosc", endian="big", dtype="float32")),
    ("zstd_fill_nonzero_sparse", _Z2.with_(compressor="zstd", dtype="int8", fill_value=-3, pattern="sparse")),
    ("partial_edges_wec", _Z2.with_(shape=(22, 13), pattern="sparse", write_empty_chunks=True)),
    ("1d", _Z2.with_(shape=(100,), chunks=(10,), shards=(40,), pattern="sparse")),
    ("3d", _Z2.with_(shape=(6, 8, 10), chunks=(2, 4, 5), shards=(4, 8, 10), pattern="sparse", attributes={"k": "v"})),
    ("0d", _Z2.with_(shape=(), dtype="float32", chunks=(), shards=(), fill_value=0.0)),
    ("empty", _Z2.with_(pattern="empty")),
    ("in_groups", _Z2.with_(path="g/sub/arr", attributes={"a": 1})),
]

#: one zarr-python hierarchy: groups, a sharded, a raw, an unsharded and a rectangular array.
HIERARCHY_CASES: list[ZarrCase] = [
    B.with_(path="a/sharded", pattern="sparse", compressor="gzip"),
    B.with_(path="a/b/nested", chunks=(4, 6), nested=(2, 3), shards=(8, 12)),
    B.with_(path="a/b/raw", chunks=(4, 4), shards=(8, 8), shape=(16, 12), pre_transpose=(1, 0)),
    B.with_(path="plain", shards=None),
    B.with_(path="c/rect", grid="rectangular", shards=((8, 4, 8), 6), index_location="start"),
]

#: writer name -> fn(case, sharded_root, twin_root) -> data.
WRITERS = {"zarr": write_zarr_python, "tensorstore": write_tensorstore, "zarr2": write_zarr2_transformer}

#: (writer, case id, case) for every writer: the conformance tests' parametrization.
ALL_CASES: list[tuple[str, str, ZarrCase]] = (
    [("zarr", i, c) for i, c in ZARR_CASES]
    + [("tensorstore", i, c) for i, c in TENSORSTORE_CASES]
    + [("zarr2", i, c) for i, c in ZARR2_CASES]
)
