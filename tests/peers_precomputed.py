"""Oracle data for Neuroglancer precomputed, written by tensorstore.

Each generator writes the same data twice, sharded and unsharded, so a test can
compare the view of the sharded store with the unsharded twin byte for byte.
Everything returns paths; nothing here knows about zshardfs.

What the twins contain (tensorstore 0.1.x, checked by test_precomputed_format):
- unsharded scale dir: one file per stored chunk, ``<x0>-<x1>_<y0>-<y1>_<z0>-<z1>``
  (voxel_offset included, upper bound clipped to the volume, negative numbers
  printed with a minus sign), content = the chunk in the scale's ``encoding``,
  clipped at the volume edge, never gzip-wrapped;
- sharded scale dir: ``<hex>.shard`` files; decoding ``data_encoding`` gives
  exactly the unsharded file's bytes;
- chunks never written exist in neither twin.
(cloud-volume, by contrast, writes unsharded raw chunks as ``<name>.gz`` on
``file://`` unless ``compress=False``: tensorstore cannot read those.)
"""

from __future__ import annotations

import copy
import json
import re
import struct
import zlib
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import tensorstore as ts

SHARDING_TYPE = "neuroglancer_uint64_sharded_v1"


def sharding(
    hash: str = "identity",
    preshift_bits: int = 0,
    minishard_bits: int = 1,
    shard_bits: int = 2,
    minishard_index_encoding: str = "raw",
    data_encoding: str = "raw",
) -> dict:
    return {
        "@type": SHARDING_TYPE,
        "preshift_bits": preshift_bits,
        "hash": hash,
        "minishard_bits": minishard_bits,
        "shard_bits": shard_bits,
        "minishard_index_encoding": minishard_index_encoding,
        "data_encoding": data_encoding,
    }


@dataclass(frozen=True)
class VolumeCase:
    """One volume of the matrix; scale k halves the previous scale (rounded up)."""

    name: str
    data_type: str  # uint8, uint16, uint64
    encoding: str  # raw, jpeg, png, compressed_segmentation
    sharding: dict
    size: tuple[int, int, int]
    chunk_size: tuple[int, int, int]
    voxel_offset: tuple[int, int, int] = (0, 0, 0)
    num_scales: int = 1
    num_channels: int = 1
    sparse: bool = False  # write a few boxes only: most chunks never exist
    extra_scale: dict = field(default_factory=dict)
    key_prefix: str = ""  # before every scale key: "s/t/" makes keys of several names ("s/t/1_1_1")

    @property
    def volume_type(self) -> str:
        return "segmentation" if self.data_type == "uint64" else "image"


VOLUME_CASES: list[VolumeCase] = [
    # uint8 raw, identity, everything raw, edge chunks clipped, one offset axis.
    VolumeCase(
        "img_u8_identity_raw",
        "uint8",
        "raw",
        sharding("identity", 0, 1, 2),
        size=(50, 40, 30),
        chunk_size=(16, 16, 16),
        voxel_offset=(3, 0, 0),
        num_scales=2,
    ),
    # jpeg, 3 channels, murmur, gzip both, preshift, negative offsets.
    VolumeCase(
        "img_u8_jpeg_murmur_gzip",
        "uint8",
        "jpeg",
        sharding("murmurhash3_x86_128", 2, 2, 2, "gzip", "gzip"),
        size=(37, 29, 18),
        chunk_size=(8, 8, 8),
        voxel_offset=(-5, 7, 11),
        num_scales=2,
        num_channels=3,
    ),
    # uint64 ids > 2**32, data gzip only, shard_bits 0 ("0.shard"), sparse.
    VolumeCase(
        "seg_u64_identity_datagzip_shard0_sparse",
        "uint64",
        "raw",
        sharding("identity", 1, 2, 0, "raw", "gzip"),
        size=(33, 20, 17),
        chunk_size=(8, 8, 8),
        voxel_offset=(100, 200, 300),
        sparse=True,
    ),
    # compressed_segmentation, murmur, index gzip only, one shard of one minishard, 3 scales.
    VolumeCase(
        "seg_u64_cseg_murmur_indexgzip_single",
        "uint64",
        "compressed_segmentation",
        sharding("murmurhash3_x86_128", 0, 0, 0, "gzip", "raw"),
        size=(40, 40, 40),
        chunk_size=(16, 16, 16),
        num_scales=3,
        extra_scale={"compressed_segmentation_block_size": [8, 8, 8]},
    ),
    # many shards and minishards, most empty: sparse murmur, gzip both.
    VolumeCase(
        "seg_u64_murmur_gzip_sparse_many",
        "uint64",
        "raw",
        sharding("murmurhash3_x86_128", 0, 3, 3, "gzip", "gzip"),
        size=(64, 48, 40),
        chunk_size=(8, 8, 8),
        voxel_offset=(1, 2, 3),
        sparse=True,
    ),
    # grid (2, 5, 1): tells the ceil(log2) Morton rule from the "2**i <= n" prose;
    # shard_bits 5 -> two hex digits; png uint16, negative offsets.
    VolumeCase(
        "img_u16_png_identity_shard5",
        "uint16",
        "png",
        sharding("identity", 0, 0, 5, "raw", "gzip"),
        size=(32, 80, 16),
        chunk_size=(16, 16, 16),
        voxel_offset=(-5, 7, -20),
    ),
]


@dataclass(frozen=True)
class VolumeTwins:
    case: VolumeCase
    sharded: Path  # directory holding `info`
    unsharded: Path

    def info(self, which: str = "sharded") -> dict:
        return json.loads((getattr(self, which) / "info").read_text())


def scale_params(case: VolumeCase, k: int) -> tuple[tuple[int, ...], tuple[int, ...], str]:
    """(size, voxel_offset, key) of scale ``k``."""
    f = 2**k
    size = tuple(-(-s // f) for s in case.size)
    offset = tuple(o // f for o in case.voxel_offset)
    return size, offset, f"{case.key_prefix}{f}_{f}_{f}"


def volume_data(case: VolumeCase, k: int) -> np.ndarray:
    """Deterministic xyzc data for scale ``k``: noise for images, blocky ids > 2**32 for segmentation."""
    size, _, _ = scale_params(case, k)
    shape = size + (case.num_channels,)
    rng = np.random.default_rng(zlib.crc32(f"{case.name}/{k}".encode()))
    if case.data_type == "uint64":
        x, y, z = np.meshgrid(*(np.arange(s) for s in size), indexing="ij")
        labels = (x // 5) + 7 * (y // 6) + 49 * (z // 4)
        data = (np.uint64(2**40) + labels.astype(np.uint64) * np.uint64(2**33 + 1))[..., None]
        data[0, 0, 0, 0] = np.uint64(2**64 - 1)
        return np.broadcast_to(data, shape).copy()
    info = np.iinfo(case.data_type)
    return rng.integers(0, int(info.max) + 1, size=shape, dtype=case.data_type)


def _sparse_boxes(size: tuple[int, ...], chunk: tuple[int, ...]) -> list[tuple[slice, ...]]:
    """Partial boxes: the first chunk, the clipped far corner, and a 2-voxel box in
    every chunk whose grid coordinates sum to a multiple of 3 (about a third)."""
    grid = [-(-s // c) for s, c in zip(size, chunk)]
    boxes = [
        tuple(slice(0, min(3, s)) for s in size),
        tuple(slice(max(0, s - 2), s) for s in size),
    ]
    for g in np.ndindex(*grid):
        if sum(g) % 3 == 0:
            lo = [gi * c + 1 for gi, c in zip(g, chunk)]
            boxes.append(tuple(slice(min(l, s - 1), min(l + 2, s)) for l, s in zip(lo, size)))
    return boxes


def _open_scale(path: Path, case: VolumeCase, k: int, sharded: bool):
    size, offset, key = scale_params(case, k)
    scale = {
        "key": key,
        "size": list(size),
        "voxel_offset": list(offset),
        "chunk_size": list(case.chunk_size),
        "resolution": [float(2**k)] * 3,
        "encoding": case.encoding,
        **case.extra_scale,
    }
    if sharded:
        scale["sharding"] = case.sharding
    spec = {
        "driver": "neuroglancer_precomputed",
        "kvstore": {"driver": "file", "path": str(path) + "/"},
        "multiscale_metadata": {
            "type": case.volume_type,
            "data_type": case.data_type,
            "num_channels": case.num_channels,
        },
        "scale_metadata": scale,
    }
    return ts.open(spec, create=True, open=True).result()


def write_volume_twins(root: Path, case: VolumeCase) -> VolumeTwins:
    """Write ``case`` sharded and unsharded under ``root/<name>/``; every scale, same data."""
    base = Path(root) / case.name
    twins = VolumeTwins(case, base / "sharded", base / "unsharded")
    for k in range(case.num_scales):
        data = volume_data(case, k)
        size, _, _ = scale_params(case, k)
        for path, sharded in ((twins.sharded, True), (twins.unsharded, False)):
            path.mkdir(parents=True, exist_ok=True)
            t = _open_scale(path, case, k, sharded)
            # tensorstore's domain starts at voxel_offset; index from there.
            t = t.translate_to[0, 0, 0, 0]
            if case.sparse:
                for box in _sparse_boxes(size, case.chunk_size):
                    t[box].write(data[box]).result()
            else:
                t.write(data).result()
    return twins


def read_volume(path: Path, scale_key: str) -> np.ndarray:
    """The whole scale as tensorstore reads it (fill value where no chunk exists)."""
    t = ts.open(
        {
            "driver": "neuroglancer_precomputed",
            "kvstore": {"driver": "file", "path": str(path) + "/"},
            "scale_metadata": {"key": scale_key},
        },
        open=True,
    ).result()
    return t.translate_to[0, 0, 0, 0].read().result()


# --------------------------------------------------------------------------
# uint64 key-value directories (skeletons, meshes, annotations by id)
# --------------------------------------------------------------------------

KV_SHARDINGS: dict[str, dict] = {
    "kv_murmur_gzip": sharding("murmurhash3_x86_128", 0, 2, 3, "gzip", "gzip"),
    "kv_identity_raw_shard0": sharding("identity", 3, 1, 0, "raw", "raw"),
    "kv_murmur_preshift_idxraw_datagzip": sharding("murmurhash3_x86_128", 5, 0, 1, "raw", "gzip"),
}


def default_kv_items() -> dict[int, bytes]:
    """Keys at the uint64 edges and in between, one empty value, varied lengths."""
    rng = np.random.default_rng(7)
    keys = [0, 1, 2, 7, 8, 2**32 - 1, 2**32, 2**40 + 3, 2**63, 2**64 - 2, 2**64 - 1]
    keys += [int(k) for k in rng.integers(0, 2**63, size=40, dtype=np.uint64)]
    items = {k: rng.integers(0, 256, size=int(rng.integers(1, 300)), dtype=np.uint8).tobytes() for k in keys}
    items[12345] = b""  # zero-length values are legal and stored as size-0 chunks
    return items


def kv_key(chunk_id: int) -> bytes:
    """tensorstore's key for a chunk id in the neuroglancer_uint64_sharded kvstore: 8 bytes big-endian."""
    return struct.pack(">Q", chunk_id)


def open_kvstore(path: Path, sharding_json: dict) -> ts.KvStore:
    return ts.KvStore.open(
        {
            "driver": "neuroglancer_uint64_sharded",
            "base": {"driver": "file", "path": str(path) + "/"},
            "metadata": sharding_json,
        }
    ).result()


@dataclass(frozen=True)
class KvTwins:
    sharding: dict
    items: dict
    sharded: Path
    unsharded: Path


def write_kv_twins(
    root: Path,
    name: str,
    sharding_json: dict,
    items: dict[int, bytes] | None = None,
    info_type: str = "neuroglancer_skeletons",
) -> KvTwins:
    """A sharded uint64 key-value directory (tensorstore) and its unsharded twin.

    The sharded dir has an ``info`` with a top-level ``sharding``; the twin has
    the same ``info`` without it and one file per key, named by the key in
    decimal (the unsharded skeleton/annotation convention).
    """
    items = default_kv_items() if items is None else items
    base = Path(root) / name
    sharded, unsharded = base / "sharded", base / "unsharded"
    info = {"@type": info_type, "transform": [1, 0, 0, 0, 0, 1, 0, 0, 0, 0, 1, 0], "vertex_attributes": []}
    for d in (sharded, unsharded):
        d.mkdir(parents=True, exist_ok=True)
    sharded_info = copy.deepcopy(info)
    sharded_info["sharding"] = sharding_json
    (sharded / "info").write_text(json.dumps(sharded_info))
    (unsharded / "info").write_text(json.dumps(info))

    kv = open_kvstore(sharded, sharding_json)
    txn = ts.Transaction()
    for k, v in items.items():
        kv.with_transaction(txn).write(kv_key(k), v).result()
    txn.commit_async().result()
    for k, v in items.items():
        (unsharded / str(k)).write_bytes(v)
    return KvTwins(sharding_json, dict(items), sharded, unsharded)


def read_kvstore(path: Path, sharding_json: dict) -> dict[int, bytes]:
    """All entries as tensorstore lists and reads them."""
    kv = open_kvstore(path, sharding_json)
    out = {}
    for key in kv.list().result():
        assert len(key) == 8, key
        (cid,) = struct.unpack(">Q", key)
        r = kv.read(key).result()
        assert r.state == "value", (cid, r.state)
        out[cid] = bytes(r.value)
    return out


def cloudvolume_python() -> str:
    """The interpreter that runs cloud-volume (a subprocess: it is slow to
    import and has its own threads).  cloud-volume is in the test extras, so
    it is this one; missing is a failure, never a skip."""
    import importlib.util
    import sys

    assert importlib.util.find_spec("cloudvolume") is not None, (
        "cloud-volume is required by the tests: pip install -e '.[test]' (scripts/setup.sh does)")
    return sys.executable


# --------------------------------------------------------------------------- multi-resolution meshes


def make_manifest(frags_per_lod: list[int], rng) -> tuple[bytes, int]:
    """A multi-resolution mesh manifest (``neuroglancer_multilod_draco``) with small
    random fragment sizes, and the bytes of fragment data those sizes add up to."""
    n = len(frags_per_lod)
    parts = [np.array([16, 16, 16], "<f4").tobytes(), np.zeros(3, "<f4").tobytes(), struct.pack("<I", n),
             (2.0 ** np.arange(n)).astype("<f4").tobytes(), np.zeros(3 * n, "<f4").tobytes(),
             np.array(frags_per_lod, "<u4").tobytes()]
    total = 0
    for k in frags_per_lod:
        parts.append(rng.integers(0, 50, size=3 * k).astype("<u4").tobytes())
        sizes = rng.integers(0, 200, size=k).astype("<u4")
        total += int(sizes.sum())
        parts.append(sizes.tobytes())
    return b"".join(parts), total


def make_mesh(seed: int, frags_per_lod: list[int]) -> tuple[bytes, bytes]:
    """(manifest, fragment data) of one consistent mesh, drawn with ``seed``."""
    rng = np.random.default_rng(seed)
    manifest, total = make_manifest(frags_per_lod, rng)
    return manifest, rng.integers(0, 256, size=total, dtype=np.uint8).tobytes()


def manifest_fragment_bytes(manifest: bytes) -> int | None:
    """The bytes of fragment data a manifest describes (None: not a manifest).
    Written from the format's description, independently of zshardfs's parser."""
    if len(manifest) < 28:
        return None
    (lods,) = struct.unpack_from("<I", manifest, 24)
    pos = 28 + 20 * lods  # (lod scales, vertex offsets, fragments per lod)
    if pos > len(manifest):
        return None
    counts = struct.unpack_from(f"<{lods}I", manifest, 28 + 16 * lods)
    total = 0
    for n in counts:
        if pos + 16 * n > len(manifest):
            return None
        total += sum(struct.unpack_from(f"<{n}I", manifest, pos + 12 * n))
        pos += 16 * n
    return total if pos == len(manifest) else None


def write_mesh_twins(root: Path, sharding_json: dict, meshes: dict[int, tuple[bytes, bytes]]) -> KvTwins:
    """A sharded multi-resolution mesh directory as Neuroglancer and cloud-volume read it
    (each mesh's fragment data, raw, immediately before its manifest, the chunk, in
    ``data_encoding``; minishard indexes sorted, delta-encoded, after the data) and its
    unsharded twin (``<id>.index`` the manifest, ``<id>`` the fragment data)."""
    import gzip

    from zshardfs.layouts.precomputed_format import ShardingSpec  # (shard and minishard of an id, both hashes)
    spec = ShardingSpec.from_json(sharding_json)
    info = {"@type": "neuroglancer_multilod_draco", "vertex_quantization_bits": 10,
            "transform": [1, 0, 0, 0, 0, 1, 0, 0, 0, 0, 1, 0], "lod_scale_multiplier": 1.0}
    sharded, twin = Path(root) / "sharded", Path(root) / "unsharded"
    sharded.mkdir(parents=True)
    twin.mkdir(parents=True)
    (sharded / "info").write_text(json.dumps({**info, "sharding": sharding_json}))
    (twin / "info").write_text(json.dumps(info))
    gz = lambda b: gzip.compress(b, mtime=0)  # noqa: E731
    by_shard: dict[int, dict[int, list[int]]] = {}
    for cid in sorted(meshes):
        shard, mini = spec.shard_and_minishard(cid)
        by_shard.setdefault(shard, {}).setdefault(mini, []).append(cid)
        (twin / f"{cid}.index").write_bytes(meshes[cid][0])
        (twin / str(cid)).write_bytes(meshes[cid][1])
    for shard, minis in by_shard.items():
        body, table = bytearray(), np.zeros((spec.num_minishards, 2), np.uint64)
        for mini, ids in sorted(minis.items()):
            starts, sizes = [], []
            for cid in ids:
                body += meshes[cid][1]
                encoded = gz(meshes[cid][0]) if sharding_json["data_encoding"] == "gzip" else meshes[cid][0]
                starts.append(len(body))
                sizes.append(len(encoded))
                body += encoded
            prev_end = [0] + [s + n for s, n in zip(starts, sizes)][:-1]
            index = np.array([np.diff(np.array(ids, np.uint64), prepend=np.uint64(0)),
                              np.array(starts, np.uint64) - np.array(prev_end, np.uint64), sizes], "<u8").tobytes()
            if sharding_json["minishard_index_encoding"] == "gzip":
                index = gz(index)
            table[mini] = (len(body), len(body) + len(index))
            body += index
        (sharded / spec.shard_key(shard)).write_bytes(table.astype("<u8").tobytes() + bytes(body))
    return KvTwins(sharding_json, dict(meshes), sharded, twin)


def read_mesh_shards(directory: Path, sharding_json: dict) -> dict[int, tuple[bytes, bytes] | str]:
    """(manifest, fragment data) of every mesh stored in ``directory``'s shards, read
    from the format's description (every minishard of every shard file; the fragment
    data is the bytes just before the manifest, as many as it describes), or a string
    saying what is wrong with that mesh."""
    import gzip
    n = 1 << sharding_json["minishard_bits"]
    head = 16 * n
    out: dict[int, tuple[bytes, bytes] | str] = {}
    for shard in sorted(Path(directory).glob("*.shard")):
        if not re.fullmatch(r"[0-9a-f]+\.shard", shard.name):
            continue  # (a killed daemon's temporary, ``.zshardfs-tmp-...``: not a shard)
        data = shard.read_bytes()
        table = struct.unpack_from(f"<{2 * n}Q", data, 0)
        for m in range(n):
            start, end = table[2 * m], table[2 * m + 1]
            if start == end:
                continue
            raw = data[head + start: head + end]
            if sharding_json["minishard_index_encoding"] == "gzip":
                raw = gzip.decompress(raw)
            k = len(raw) // 24
            vals = struct.unpack(f"<{3 * k}Q", raw)
            cid, pos = 0, 0
            for i in range(k):
                cid = (cid + vals[i]) % 2**64
                off = pos + vals[k + i]
                size = vals[2 * k + i]
                pos = off + size
                manifest = data[head + off: head + off + size]
                if sharding_json["data_encoding"] == "gzip":
                    manifest = gzip.decompress(manifest)
                total = manifest_fragment_bytes(manifest)
                if total is None or total > off:
                    out[cid] = f"{shard.name}: mesh {cid}: manifest of {len(manifest)} bytes describes {total}"
                    continue
                out[cid] = (manifest, data[head + off - total: head + off])
    return out
