"""The precomputed sharded format layer against tensorstore-written data.

Oracles: tensorstore writes every volume twice (sharded and unsharded) and a few
uint64 key-value directories (see peers_precomputed.py); our parser must find
exactly the unsharded twin's files, with the same bytes, and tensorstore must
read back what encode_shard writes.
"""

from __future__ import annotations

import gzip
import json
import os
import shutil
import struct
import subprocess
import zlib
from pathlib import Path

import mmh3
import numpy as np
import pytest

from tests import peers_precomputed as peers
from zshardfs.layouts import precomputed_format as pf
from zshardfs.layouts.precomputed_format import (
    FormatError,
    ScaleGeometry,
    ShardingSpec,
    chunk_name,
    compressed_morton_code,
    compressed_morton_codes,
    decode_data,
    decoded_size,
    encode_shard,
    gzip_isize,
    morton_bits,
    morton_decode,
    morton_decode_many,
    multilod_fragment_data_range,
    multilod_fragment_data_size,
    parse_chunk_name,
    parse_minishard_index,
    parse_shard,
    parse_shard_index,
)

CASE_IDS = [c.name for c in peers.VOLUME_CASES]
KV_IDS = list(peers.KV_SHARDINGS)


# --------------------------------------------------------------------------
# fixtures and helpers
# --------------------------------------------------------------------------


@pytest.fixture(scope="session")
def volumes(tmp_path_factory) -> dict[str, peers.VolumeTwins]:
    root = tmp_path_factory.mktemp("precomputed_volumes")
    return {c.name: peers.write_volume_twins(root, c) for c in peers.VOLUME_CASES}


@pytest.fixture(scope="session")
def kvs(tmp_path_factory) -> dict[str, peers.KvTwins]:
    root = tmp_path_factory.mktemp("precomputed_kv")
    return {n: peers.write_kv_twins(root, n, s) for n, s in peers.KV_SHARDINGS.items()}


def scales(twins: peers.VolumeTwins):
    """(scale json, spec, geometry, sharded dir, unsharded dir) per scale."""
    for s_info, u_info in zip(twins.info("sharded")["scales"], twins.info("unsharded")["scales"]):
        assert "sharding" not in u_info
        yield (
            s_info,
            ShardingSpec.from_json(s_info["sharding"]),
            ScaleGeometry.from_json(s_info),
            twins.sharded / s_info["key"],
            twins.unsharded / u_info["key"],
        )


def stored_chunks(directory: Path, spec: ShardingSpec) -> dict[int, tuple[bytes, int, int]]:
    """id -> (stored payload, shard number, minishard) over every shard file in ``directory``."""
    out: dict[int, tuple[bytes, int, int]] = {}
    for name in sorted(os.listdir(directory)):
        shard = spec.parse_shard_key(name)
        if shard is None:
            continue
        data = (directory / name).read_bytes()
        ids, offs, sizes, minishards = parse_shard(data, spec)
        for cid, off, size, m in zip(ids.tolist(), offs.tolist(), sizes.tolist(), minishards.tolist()):
            assert cid not in out
            out[cid] = (data[off : off + size], shard, m)
    return out


def group_by_shard(ids, spec: ShardingSpec) -> dict[int, list[int]]:
    groups: dict[int, list[int]] = {}
    for cid in ids:
        groups.setdefault(spec.shard_and_minishard(cid)[0], []).append(cid)
    return groups


# --------------------------------------------------------------------------
# sharding spec
# --------------------------------------------------------------------------

GOOD = peers.sharding("murmurhash3_x86_128", 2, 3, 4, "gzip", "raw")


def test_spec_round_trips_tensorstore_info(volumes, kvs):
    for twins in volumes.values():
        for s_info, spec, *_ in scales(twins):
            assert spec.to_json() == s_info["sharding"]
    for kv in kvs.values():
        info = json.loads((kv.sharded / "info").read_text())
        assert ShardingSpec.from_json(info["sharding"]).to_json() == info["sharding"]


def test_spec_defaults_and_edges():
    spec = ShardingSpec.from_json(
        {"@type": pf.SHARDING_TYPE, "preshift_bits": 0, "hash": "identity", "minishard_bits": 0, "shard_bits": 0}
    )
    assert (spec.minishard_index_encoding, spec.data_encoding) == ("raw", "raw")
    assert spec.shard_index_size == 16 and spec.num_shards == 1
    # Legal per tensorstore: preshift is not part of the 64-bit budget.
    ShardingSpec.from_json(peers.sharding("identity", 64, 0, 64))
    ShardingSpec.from_json(peers.sharding("murmurhash3_x86_128", 20, 30, 34))
    assert ShardingSpec.from_json(dict(GOOD, extra="ignored")) == ShardingSpec.from_json(GOOD)
    assert ShardingSpec(2, "murmurhash3_x86_128", 3, 4, "gzip", "raw") == ShardingSpec.from_json(GOOD)
    with pytest.raises(ValueError):
        ShardingSpec(2, "sha1", 3, 4)


def test_specs_hash_as_their_values_made_any_way():
    """A spec keys the minishard index cache and hashes once (its hash kept): specs equal in
    value are equal and hash equal whether parsed, constructed, copied, pickled (in this
    process: a hash of text differs between processes) or replaced, and a changed value
    makes another key."""
    import copy as copy_module
    import dataclasses
    import pickle
    spec = ShardingSpec.from_json(GOOD)
    made = [ShardingSpec(2, "murmurhash3_x86_128", 3, 4, "gzip", "raw"), copy_module.copy(spec),
            copy_module.deepcopy(spec), pickle.loads(pickle.dumps(spec)),
            dataclasses.replace(ShardingSpec.from_json(dict(GOOD, minishard_bits=5)), minishard_bits=3)]
    for other in made:
        assert other == spec and hash(other) == hash(spec) and {spec: 1}[other] == 1, other
    changed = dataclasses.replace(spec, minishard_bits=5)
    assert changed != spec and changed == ShardingSpec.from_json(dict(GOOD, minishard_bits=5))
    assert hash(changed) == hash(ShardingSpec.from_json(dict(GOOD, minishard_bits=5)))
    assert {(k, "etag", 1, spec): k for k in "ab"}.get(("a", "etag", 1, changed)) is None


@pytest.mark.parametrize(
    "bad",
    [
        None,
        [],
        "sharding",
        {k: v for k, v in GOOD.items() if k != "@type"},
        dict(GOOD, **{"@type": "neuroglancer_uint64_sharded_v2"}),
        {k: v for k, v in GOOD.items() if k != "hash"},
        {k: v for k, v in GOOD.items() if k != "minishard_bits"},
        dict(GOOD, hash="murmurhash3_x64_128"),
        dict(GOOD, hash=None),
        dict(GOOD, preshift_bits=-1),
        dict(GOOD, preshift_bits=65),
        dict(GOOD, minishard_bits=-1),
        dict(GOOD, minishard_bits=61),
        dict(GOOD, shard_bits=-2),
        dict(GOOD, minishard_bits=40, shard_bits=25),
        dict(GOOD, shard_bits="4"),
        dict(GOOD, shard_bits=4.0),
        dict(GOOD, shard_bits=True),
        dict(GOOD, minishard_index_encoding="zstd"),
        dict(GOOD, data_encoding="GZIP"),
        dict(GOOD, data_encoding=None),
    ],
)
def test_spec_rejects(bad):
    with pytest.raises(ValueError):
        ShardingSpec.from_json(bad)


# --------------------------------------------------------------------------
# hashing and shard names
# --------------------------------------------------------------------------


def test_murmur_vectorised_matches_mmh3():
    rng = np.random.default_rng(3)
    ids = np.concatenate(
        [
            np.array([0, 1, 2**32 - 1, 2**32, 2**63, 2**64 - 1], dtype=np.uint64),
            rng.integers(0, 2**64 - 1, size=5000, dtype=np.uint64, endpoint=True),
        ]
    )
    expect = [mmh3.hash128(int(i).to_bytes(8, "little"), 0, False) & pf.U64_MAX for i in ids]
    assert pf._murmur_low64_many(ids).tolist() == expect
    spec = ShardingSpec.from_json(GOOD)
    shards, minishards = spec.shard_and_minishard_many(ids)
    assert list(zip(shards.tolist(), minishards.tolist())) == [spec.shard_and_minishard(int(i)) for i in ids]


def _all_shard_dirs(volumes, kvs):
    for twins in volumes.values():
        for _, spec, _, sdir, _ in scales(twins):
            yield spec, sdir
    for kv in kvs.values():
        yield ShardingSpec.from_json(kv.sharding), kv.sharded


def test_hash_places_ids_where_tensorstore_did(volumes, kvs):
    """Every id sits in the shard file and minishard our hash predicts."""
    n = 0
    for spec, directory in _all_shard_dirs(volumes, kvs):
        chunks = stored_chunks(directory, spec)
        for cid, (_, shard, minishard) in chunks.items():
            assert spec.shard_and_minishard(cid) == (shard, minishard), (directory, cid)
        ids = np.array(sorted(chunks), dtype=np.uint64)
        s, m = spec.shard_and_minishard_many(ids)
        assert [(chunks[i][1], chunks[i][2]) for i in ids.tolist()] == list(zip(s.tolist(), m.tolist()))
        n += len(chunks)
    assert n > 300


def test_shard_file_names_match_tensorstore(volumes, kvs):
    seen_bits = set()
    for spec, directory in _all_shard_dirs(volumes, kvs):
        files = {f for f in os.listdir(directory) if f != "info"}
        ids = stored_chunks(directory, spec)
        assert files == {spec.shard_key(s) for s in group_by_shard(ids, spec)}
        seen_bits.add(spec.shard_bits)
    assert {0, 5} <= seen_bits


@pytest.mark.parametrize(
    "bits,number,name",
    [(0, 0, "0.shard"), (1, 1, "1.shard"), (4, 15, "f.shard"), (5, 0, "00.shard"), (5, 31, "1f.shard"), (9, 0x1AB, "1ab.shard")],
)
def test_shard_key(bits, number, name):
    spec = ShardingSpec.from_json(peers.sharding(shard_bits=bits, minishard_bits=0))
    assert spec.shard_key(number) == name
    assert spec.parse_shard_key(name) == number


def test_parse_shard_key_rejects():
    spec = ShardingSpec.from_json(peers.sharding(shard_bits=5, minishard_bits=0))
    for name in ["0.shard", "000.shard", "1F.shard", "20.shard", "0x.shard", ".shard", "00.index", "00.shard.tmp", "info"]:
        assert spec.parse_shard_key(name) is None, name
    with pytest.raises(ValueError):
        spec.shard_key(32)
    zero = ShardingSpec.from_json(peers.sharding(shard_bits=0, minishard_bits=0))
    assert zero.parse_shard_key("1.shard") is None and zero.parse_shard_key("00.shard") is None


# --------------------------------------------------------------------------
# volumes: sharded chunks == unsharded twin files
# --------------------------------------------------------------------------


@pytest.mark.parametrize("case", CASE_IDS)
def test_sharded_chunks_equal_unsharded_files(volumes, case):
    """The view contract: one file per stored chunk, named by its clipped box,
    content = stored payload minus data_encoding = tensorstore's unsharded file."""
    for _, spec, geom, sdir, udir in scales(volumes[case]):
        chunks = stored_chunks(sdir, spec)
        files = {f: (udir / f).read_bytes() for f in os.listdir(udir)}
        assert chunks and len(chunks) == len(files)
        names = {}
        for cid, (stored, _, _) in chunks.items():
            name = geom.chunk_name(geom.grid_pos(cid))
            names[name] = cid
            plain = decode_data(stored, spec)
            assert plain == files[name], (case, name)
            tail = stored[-4:]
            assert decoded_size(len(stored), tail, spec) == len(plain)
            if spec.data_encoding == "gzip":
                assert gzip_isize(tail) == len(plain)
                assert stored[:2] == b"\x1f\x8b"
        assert set(names) == set(files)
        # and back: every unsharded name parses to the id tensorstore used
        for name in files:
            assert geom.chunk_id(parse_chunk_name(name, geom)) == names[name]
        if volumes[case].case.sparse:
            assert len(chunks) < geom.num_chunks


def test_unsharded_twin_files_are_plain(volumes):
    """tensorstore never gzip-wraps an unsharded chunk file, whatever the encoding."""
    seen = set()
    for twins in volumes.values():
        for s_info, _, _, _, udir in scales(twins):
            seen.add(s_info["encoding"])
            for f in os.listdir(udir):
                assert (udir / f).read_bytes()[:2] != b"\x1f\x8b"
    assert seen == {"raw", "jpeg", "png", "compressed_segmentation"}


def test_raw_edge_chunks_are_clipped(volumes):
    twins = volumes["img_u8_identity_raw"]
    s_info, spec, geom, sdir, _ = next(scales(twins))
    for cid, (stored, _, _) in stored_chunks(sdir, spec).items():
        b, e = geom.chunk_bounds(geom.grid_pos(cid))
        assert len(stored) == int(np.prod(np.subtract(e, b))) * twins.case.num_channels


@pytest.mark.parametrize("case", CASE_IDS)
def test_tensorstore_shard_layout(volumes, case):
    """tensorstore's layout: index, then per minishard its chunks by id and its index,
    contiguous; encode_shard reproduces it byte for byte wherever no gzip of ours
    is involved (stored gzip chunks passed through as preencoded)."""
    for _, spec, _, sdir, _ in scales(volumes[case]):
        for name in sorted(os.listdir(sdir)):
            data = (sdir / name).read_bytes()
            ranges = parse_shard_index(data, spec, shard_size=len(data))
            pos = spec.shard_index_size
            stored = {}
            for m in range(spec.num_minishards):
                s, e = (int(x) for x in ranges[m])
                if s == e:
                    continue
                ids, offs, sizes = parse_minishard_index(data[s:e], spec, shard_size=len(data))
                # chunks back to back from where the previous minishard ended ...
                assert offs.tolist() == (pos + np.concatenate([[0], np.cumsum(sizes)[:-1]])).tolist()
                # ... then this minishard's index
                assert s == int(offs[-1] + sizes[-1])
                pos = e
                stored.update({int(i): data[int(o) : int(o + z)] for i, o, z in zip(ids, offs, sizes)})
            assert pos == len(data)
            if spec.minishard_index_encoding == "raw":
                assert encode_shard({}, spec, preencoded=stored) == data
                if spec.data_encoding == "raw":
                    assert encode_shard(stored, spec) == data


def test_parse_shard_index_exact_bytes_and_empty_minishards(volumes):
    twins = volumes["seg_u64_murmur_gzip_sparse_many"]
    _, spec, _, sdir, _ = next(scales(twins))
    data = (sdir / "0.shard").read_bytes()
    index = data[: spec.shard_index_size]
    a = parse_shard_index(index)
    assert a.shape == (8, 2) and a.dtype == np.uint64
    assert np.array_equal(a, parse_shard_index(data, spec))
    rel = np.frombuffer(index, "<u8").reshape(-1, 2)
    assert np.array_equal(a, rel + spec.shard_index_size)
    empty = a[:, 0] == a[:, 1]
    assert empty.any() and not empty.all()


# --------------------------------------------------------------------------
# Morton codes and chunk names
# --------------------------------------------------------------------------


def reference_morton(pos, grid):
    """Straight transcription of tensorstore's EncodeCompressedZIndex (bit_width(n-1) bits)."""
    bits = [max(g - 1, 0).bit_length() for g in grid]
    code, j = 0, 0
    for i in range(max(bits)):
        for d in range(3):
            if i < bits[d]:
                code |= ((pos[d] >> i) & 1) << j
                j += 1
    return code


@pytest.mark.parametrize("grid", [(1, 1, 1), (2, 5, 1), (4, 3, 2), (3, 3, 5), (8, 1, 7), (1, 16, 9), (5, 6, 7)])
def test_morton_round_trip(grid):
    positions = list(np.ndindex(*grid))
    codes = [compressed_morton_code(p, grid) for p in positions]
    assert codes == [reference_morton(p, grid) for p in positions]
    assert len(set(codes)) == len(codes) and max(codes) < 2 ** sum(morton_bits(grid))
    assert [morton_decode(c, grid) for c in codes] == positions
    vec = compressed_morton_codes(np.array(positions), grid)
    assert vec.dtype == np.uint64 and vec.tolist() == codes
    dec, valid = morton_decode_many(np.arange(2 ** sum(morton_bits(grid)) + 3, dtype=np.uint64), grid)
    assert valid.sum() == len(positions)
    assert sorted(map(tuple, dec[valid].tolist())) == sorted(positions)
    for c in np.flatnonzero(~valid).tolist():
        with pytest.raises(ValueError):
            morton_decode(c, grid)


def test_morton_bits_rule():
    # grid (2, 5, 1): x 1 bit, y 3 bits, z none -> x0 y0 y1 y2; ids 0..9 contiguous.
    assert morton_bits((2, 5, 1)) == (1, 3, 0)
    assert compressed_morton_code((1, 4, 0), (2, 5, 1)) == 9
    assert morton_bits((4, 4, 4)) == (2, 2, 2) and morton_bits((0, 1, 2)) == (0, 0, 1)


def test_morton_large_grid():
    grid = (2**21, 2**21, 2**22)  # exactly 64 bits
    pos = (2**21 - 1, 12345, 2**22 - 1)
    code = compressed_morton_code(pos, grid)
    assert morton_decode(code, grid) == pos
    assert compressed_morton_code((2**21 - 1, 2**21 - 1, 2**22 - 1), grid) == 2**64 - 1
    dec, valid = morton_decode_many(np.array([code, 2**64 - 1], dtype=np.uint64), grid)
    assert valid.all() and tuple(dec[0]) == pos
    with pytest.raises(ValueError):
        compressed_morton_code((0, 0, 0), (2**21, 2**21, 2**22 + 1))


def test_morton_rejects():
    with pytest.raises(ValueError):
        compressed_morton_code((4, 0, 0), (4, 3, 2))
    with pytest.raises(ValueError):
        compressed_morton_code((-1, 0, 0), (4, 3, 2))
    with pytest.raises(ValueError):
        compressed_morton_code((0, 0), (4, 3, 2))
    with pytest.raises(ValueError):
        morton_decode(2**5, (4, 3, 2))  # bit beyond the grid's 5 bits
    with pytest.raises(ValueError):
        morton_decode(2**64, (4, 3, 2))
    with pytest.raises(ValueError):
        compressed_morton_codes(np.array([[0, 3, 0]]), (4, 3, 2))


SCALE = {"size": [50, 40, 30], "voxel_offset": [-5, 7, 0], "chunk_sizes": [[16, 16, 16]], "key": "s"}


def test_chunk_names():
    geom = ScaleGeometry.from_json(SCALE)
    assert geom.grid_shape == (4, 3, 2)
    assert chunk_name((0, 0, 0), SCALE) == "-5-11_7-23_0-16"
    assert chunk_name((3, 2, 1), geom) == "43-45_39-47_16-30"  # clipped on every axis
    for pos in np.ndindex(*geom.grid_shape):
        assert parse_chunk_name(chunk_name(pos, geom), SCALE) == pos
    assert ScaleGeometry.from_json({"size": [1, 1, 1], "chunk_sizes": [[64, 64, 64]]}).chunk_name((0, 0, 0)) == "0-1_0-1_0-1"


@pytest.mark.parametrize(
    "name",
    [
        "",
        "-5-11_7-23",
        "-5-11_7-23_0-16_0-1",
        "-5-11_7-23_0-17",  # wrong upper bound
        "-5-11_7-23_0-15",
        "43-59_39-47_16-30",  # edge chunk not clipped
        "-4-12_7-23_0-16",  # misaligned
        "59-75_7-23_0-16",  # outside the grid
        "-21--5_7-23_0-16",  # before the grid
        "-05-11_7-23_0-16",  # leading zero
        "-5-11_07-23_0-16",
        "-5-11_+7-23_0-16",
        "-5-11_7-23_-0-16",  # "-0"
        " -5-11_7-23_0-16",
        "-5-11_7-23_0-16\n",
        "-5-11_7-23_0-16.gz",
        "-5-11_7-23_\u0660-16",  # Arabic-Indic zero: int() accepts it, we do not
        "-5-11_7-23_0-16/",
        "1" * 5000 + "-11_7-23_0-16",
        "info",
    ],
)
def test_parse_chunk_name_rejects(name):
    assert parse_chunk_name(name, SCALE) is None


def test_scale_geometry_rejects():
    for bad in [
        {"size": [1, 1], "chunk_sizes": [[1, 1, 1]]},
        {"size": [1, 1, 1], "chunk_sizes": [[1, 1, 1], [2, 2, 2]]},
        {"size": [1, 1, 1], "chunk_sizes": [[0, 1, 1]]},
        {"size": [1, 1, 1.5], "chunk_sizes": [[1, 1, 1]]},
        {"size": [1, 1, 1], "voxel_offset": [0, 0, True], "chunk_sizes": [[1, 1, 1]]},
        {"chunk_sizes": [[1, 1, 1]]},
    ]:
        with pytest.raises(ValueError):
            ScaleGeometry.from_json(bad)


# --------------------------------------------------------------------------
# encode_shard read back by tensorstore
# --------------------------------------------------------------------------


def reencode_copy(twins: peers.VolumeTwins, dest: Path) -> Path:
    """Copy of the sharded volume whose every shard is rebuilt by encode_shard from plain chunks."""
    shutil.copytree(twins.sharded, dest)
    for s_info, spec, _, sdir, _ in scales(twins):
        chunks = {cid: decode_data(stored, spec) for cid, (stored, _, _) in stored_chunks(sdir, spec).items()}
        for f in os.listdir(dest / s_info["key"]):
            os.unlink(dest / s_info["key"] / f)
        for shard, ids in group_by_shard(chunks, spec).items():
            ours = encode_shard({i: chunks[i] for i in ids}, spec)
            (dest / s_info["key"] / spec.shard_key(shard)).write_bytes(ours)
        assert {k: decode_data(v[0], spec) for k, v in stored_chunks(dest / s_info["key"], spec).items()} == chunks
    return dest


@pytest.mark.parametrize("case", CASE_IDS)
def test_encode_shard_read_by_tensorstore(volumes, case, tmp_path):
    """Replace every shard with ours: tensorstore reads the same volume."""
    twins = volumes[case]
    ours = reencode_copy(twins, tmp_path / "sharded")
    for s_info, *_ in scales(twins):
        expect = peers.read_volume(twins.unsharded, s_info["key"])
        assert np.array_equal(peers.read_volume(ours, s_info["key"]), expect)
        assert np.array_equal(peers.read_volume(twins.sharded, s_info["key"]), expect)


CV_READ = r"""
import sys, numpy as np
from cloudvolume import CloudVolume
path, mip, out = sys.argv[1], int(sys.argv[2]), sys.argv[3]
vol = CloudVolume("file://" + path, mip=mip, fill_missing=True, progress=False, cache=False)
np.save(out, np.asarray(vol.download(vol.bounds, mip=mip)))
"""


@pytest.mark.parametrize(
    "case", ["img_u8_identity_raw", "seg_u64_identity_datagzip_shard0_sparse", "seg_u64_cseg_murmur_indexgzip_single", "seg_u64_murmur_gzip_sparse_many"]
)
def test_encode_shard_read_by_cloudvolume(volumes, case, tmp_path):
    """Second oracle: cloud-volume's own shard reader (its own gzip, hashing and
    Morton code) reads our shards as tensorstore reads the unsharded twin."""
    python = peers.cloudvolume_python()
    twins = volumes[case]
    ours = reencode_copy(twins, tmp_path / "sharded")
    for mip, (s_info, *_) in enumerate(scales(twins)):
        out = tmp_path / f"mip{mip}.npy"
        r = subprocess.run([python, "-c", CV_READ, str(ours), str(mip), str(out)], capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stderr[-2000:]
        assert np.array_equal(np.load(out), peers.read_volume(twins.unsharded, s_info["key"]))


@pytest.mark.parametrize("name", KV_IDS)
def test_kv_store(kvs, name, tmp_path):
    kv = kvs[name]
    spec = ShardingSpec.from_json(kv.sharding)
    stored = stored_chunks(kv.sharded, spec)
    assert {k: decode_data(v[0], spec) for k, v in stored.items()} == kv.items
    assert {0, 2**64 - 1} <= set(stored)
    # the unsharded twin: one file per key, decimal names, info without sharding
    assert set(os.listdir(kv.unsharded)) == {"info"} | {str(k) for k in kv.items}
    info = json.loads((kv.unsharded / "info").read_text())
    assert "sharding" not in info and info["@type"] == "neuroglancer_skeletons"
    # tensorstore's own keys are 8-byte big-endian ids
    keys = peers.open_kvstore(kv.sharded, kv.sharding).list().result()
    assert sorted(keys) == sorted(struct.pack(">Q", k) for k in kv.items)

    # Our shards, with one value changed, one added and one removed, read by tensorstore.
    items = dict(kv.items)
    items[2**64 - 1] = b"changed"
    items[424242] = b"added"
    del items[1]
    out = tmp_path / "ours"
    out.mkdir()
    for shard, ids in group_by_shard(items, spec).items():
        (out / spec.shard_key(shard)).write_bytes(encode_shard({i: items[i] for i in ids}, spec))
    assert peers.read_kvstore(out, kv.sharding) == items


def test_any_layout_with_gaps_is_read_by_both(tmp_path):
    """A shard laid out unlike tensorstore: all chunks first in reverse id order with
    junk gaps (so offset deltas go negative), then the minishard indexes in reverse
    minishard order.  tensorstore and our parser must agree on every value."""
    spec = ShardingSpec.from_json(peers.sharding("identity", 0, 2, 0, "gzip", "gzip"))
    rng = np.random.default_rng(5)
    keys = rng.integers(0, 2**64 - 1, size=60, dtype=np.uint64, endpoint=True).tolist() + [0, 2**64 - 1]
    items = {int(k): rng.integers(0, 256, size=int(rng.integers(0, 100)), dtype=np.uint8).tobytes() for k in keys}

    body = bytearray()  # everything after the shard index
    where = {}
    for k in sorted(items, reverse=True):
        body += b"JUNKJUN"
        encoded = gzip.compress(items[k], mtime=0)
        where[k] = (len(body), len(encoded))
        body += encoded
    by_minishard: dict[int, list[int]] = {}
    for k in sorted(items):
        by_minishard.setdefault(spec.shard_and_minishard(k)[1], []).append(k)
    table = np.zeros((spec.num_minishards, 2), np.uint64)
    for m in sorted(by_minishard, reverse=True):
        ids = by_minishard[m]
        offs = np.array([where[k][0] for k in ids], np.uint64)  # relative to the index end
        sizes = np.array([where[k][1] for k in ids], np.uint64)
        prev_end = np.concatenate([[0], offs[:-1] + sizes[:-1]]).astype(np.uint64)
        with np.errstate(over="ignore"):
            arr = np.stack([np.diff(np.array(ids, np.uint64), prepend=np.uint64(0)), offs - prev_end, sizes])
        body += b"GAP"
        enc = gzip.compress(arr.astype("<u8").tobytes())
        table[m] = (len(body), len(body) + len(enc))
        body += enc
    body += b"trailing junk"
    shard = table.astype("<u8").tobytes() + bytes(body)
    (tmp_path / "0.shard").write_bytes(shard)

    ids, offs, sizes, _ = parse_shard(shard, spec)
    ours = {int(i): decode_data(shard[int(o) : int(o + s)], spec) for i, o, s in zip(ids, offs, sizes)}
    assert ours == items
    assert peers.read_kvstore(tmp_path, spec.to_json()) == items


# --------------------------------------------------------------------------
# encode_shard details
# --------------------------------------------------------------------------


def test_encode_shard_basics():
    spec = ShardingSpec.from_json(peers.sharding("identity", 0, 2, 1, "gzip", "gzip"))
    assert encode_shard({}, spec) == b""
    with pytest.raises(ValueError):
        encode_shard({0: b"a", 4: b"b"}, spec)  # id 4 -> shard 1, id 0 -> shard 0
    with pytest.raises(ValueError):
        encode_shard({2**64: b"a"}, spec)
    with pytest.raises(ValueError):
        encode_shard({0: b"a"}, spec, preencoded={0: b"a"})
    a = encode_shard({0: b"x" * 1000, 1: b"", 3: b"y"}, spec)
    assert a == encode_shard({3: b"y", 1: b"", 0: b"x" * 1000}, spec)  # deterministic, order-free
    ids, offs, sizes, mini = parse_shard(a, spec)
    assert ids.tolist() == [0, 1, 3] and mini.tolist() == [0, 1, 3]
    assert [decode_data(a[int(o) : int(o + s)], spec) for o, s in zip(offs, sizes)] == [b"x" * 1000, b"", b"y"]
    # preencoded payloads are copied verbatim, not recompressed
    b = encode_shard({0: b"x" * 1000}, spec, preencoded={1: a[int(offs[1]) : int(offs[1] + sizes[1])], 3: pf.encode_data(b"y", "gzip")})
    assert b == a


# --------------------------------------------------------------------------
# bad input
# --------------------------------------------------------------------------

SPEC_RAW = ShardingSpec.from_json(peers.sharding("identity", 0, 1, 0, "raw", "raw"))
SPEC_GZ = ShardingSpec.from_json(peers.sharding("identity", 0, 1, 0, "gzip", "gzip"))


def _minishard(ids, offs, sizes) -> bytes:
    return np.array([ids, offs, sizes], dtype="<u8").tobytes()


def test_parse_shard_index_rejects():
    for n in (0, 8, 24, 48, 17):
        with pytest.raises(FormatError):
            parse_shard_index(b"\0" * n)
    with pytest.raises(FormatError):
        parse_shard_index(b"\0" * 16, SPEC_RAW)  # needs 32
    with pytest.raises(FormatError):
        parse_shard_index(np.array([[5, 4], [0, 0]], "<u8").tobytes())  # start > end
    with pytest.raises(FormatError):
        parse_shard_index(np.array([[0, 10], [0, 0]], "<u8").tobytes(), SPEC_RAW, shard_size=41)
    assert parse_shard_index(np.array([[0, 10], [0, 0]], "<u8").tobytes(), SPEC_RAW, shard_size=42)[0].tolist() == [32, 42]
    with pytest.raises(FormatError):
        parse_shard_index(np.array([[0, 2**64 - 1], [0, 0]], "<u8").tobytes())  # overflow
    with pytest.raises(FormatError):
        parse_shard_index(b"\0" * 32, SPEC_RAW, shard_size=31)


def test_parse_minishard_index_rejects():
    ok = _minishard([5, 2], [0, 0], [3, 4])
    ids, offs, sizes = parse_minishard_index(ok, SPEC_RAW, shard_size=39)
    assert (ids.tolist(), offs.tolist(), sizes.tolist()) == ([5, 7], [32, 35], [3, 4])
    with pytest.raises(FormatError):
        parse_minishard_index(ok, SPEC_RAW, shard_size=38)  # past the end
    with pytest.raises(FormatError):
        parse_minishard_index(ok[:-1], SPEC_RAW)
    with pytest.raises(FormatError):
        parse_minishard_index(ok + b"\0" * 8, SPEC_RAW)
    with pytest.raises(FormatError):
        parse_minishard_index(ok, SPEC_GZ)  # not gzip
    with pytest.raises(FormatError):
        parse_minishard_index(gzip.compress(ok)[:-3], SPEC_GZ)  # truncated
    with pytest.raises(FormatError):
        parse_minishard_index(_minishard([5, 0], [0, 0], [3, 4]), SPEC_RAW)  # duplicate id
    with pytest.raises(FormatError):
        parse_minishard_index(_minishard([1], [2**64 - 10], [20]), SPEC_RAW)  # wraps
    with pytest.raises(FormatError):
        parse_minishard_index(_minishard([1], [2**64 - 20], [1]), SPEC_RAW)  # + index size overflows
    bomb = gzip.compress(b"\0" * 24 * 100000)
    with pytest.raises(FormatError):
        parse_minishard_index(bomb, SPEC_GZ, max_size=24 * 1000)
    # a negative delta (chunk before the previous one) is legal
    ids, offs, _ = parse_minishard_index(_minishard([1, 1], [10, 2**64 - 14], [4, 4]), SPEC_RAW)
    assert offs.tolist() == [42, 32]
    # wrapped id deltas are legal too (tensorstore sums modulo 2**64, then sorts)
    ids, offs, _ = parse_minishard_index(_minishard([9, 2**64 - 4], [0, 0], [1, 1]), SPEC_RAW)
    assert ids.tolist() == [5, 9] and offs.tolist() == [33, 32]
    assert issubclass(FormatError, ValueError)


def test_parse_shard_rejects_truncation(volumes):
    _, spec, _, sdir, _ = next(scales(volumes["img_u8_jpeg_murmur_gzip"]))
    data = (sdir / sorted(os.listdir(sdir))[0]).read_bytes()
    for cut in (len(data) - 1, len(data) // 2, spec.shard_index_size - 1, 0):
        with pytest.raises(FormatError):
            parse_shard(data[:cut], spec)


def test_decode_data():
    payload = b"hello" * 100
    one = zlib.compress(payload, 6, wbits=31)
    assert decode_data(one, SPEC_GZ) == payload and decode_data(one, "gzip") == payload
    assert decode_data(payload, SPEC_RAW) == payload
    assert decode_data(one + one, "gzip") == payload * 2  # multi-member, like gzip(1)
    for bad in (b"", one[:-1], one[:-8], one + b"\0", b"\x1f\x8b" + one[2:-4] + b"\0\0\0\0", payload):
        with pytest.raises(FormatError):
            decode_data(bad, "gzip")
    bad_crc = bytearray(one)
    bad_crc[-8] ^= 1
    with pytest.raises(FormatError):
        decode_data(bytes(bad_crc), "gzip")
    with pytest.raises(FormatError):
        decode_data(one, "gzip", max_size=len(payload) - 1)
    assert decode_data(one, "gzip", max_size=len(payload)) == payload
    with pytest.raises(FormatError):
        decode_data(payload, "raw", max_size=3)


def test_gzip_isize_and_its_limits():
    payload = b"abc" * 1000
    one = zlib.compress(payload, 6, wbits=31)
    assert gzip_isize(one) == gzip_isize(one[-4:]) == len(payload)
    assert decoded_size(len(one), one[-4:], "gzip") == len(payload)
    assert decoded_size(17, b"", "raw") == 17
    # documented limit: a multi-member stream reports only its last member
    assert gzip_isize(one + zlib.compress(b"xy", 6, wbits=31)) == 2
    with pytest.raises(FormatError):
        gzip_isize(b"abc")
    with pytest.raises(FormatError):
        decoded_size(19, one[-4:], "gzip")
    assert decoded_size(20, zlib.compress(b"", 6, wbits=31)[-4:], "gzip") == 0
    assert len(zlib.compress(b"", 9, wbits=31)) == 20


# --------------------------------------------------------------------------
# multi-resolution mesh manifests
# --------------------------------------------------------------------------


def make_manifest(frags_per_lod: list[int], seed: int = 0) -> tuple[bytes, int]:
    rng = np.random.default_rng(seed)
    n = len(frags_per_lod)
    parts = [
        np.array([16, 16, 16], "<f4").tobytes(),
        np.array([1.5, -2, 3], "<f4").tobytes(),
        struct.pack("<I", n),
        (2.0 ** np.arange(n)).astype("<f4").tobytes(),
        np.zeros(3 * n, "<f4").tobytes(),
        np.array(frags_per_lod, "<u4").tobytes(),
    ]
    total = 0
    for k in frags_per_lod:
        parts.append(rng.integers(0, 100, size=3 * k).astype("<u4").tobytes())
        sizes = rng.integers(0, 2**31, size=k).astype("<u4")
        total += int(sizes.astype(np.uint64).sum())
        parts.append(sizes.tobytes())
    return b"".join(parts), total


def test_multilod_manifest_size():
    for lods in ([], [0], [1], [8, 1], [64, 8, 1], [3, 0, 2]):
        manifest, total = make_manifest(lods)
        assert multilod_fragment_data_size(manifest) == total
    manifest, total = make_manifest([8, 1])
    assert multilod_fragment_data_range(total + 100, manifest) == (100, total + 100)
    with pytest.raises(FormatError):
        multilod_fragment_data_range(total + 15, manifest, SPEC_RAW)  # would overlap the shard index
    for bad in (manifest[:-1], manifest + b"\0" * 4, manifest[:27], b""):
        with pytest.raises(FormatError):
            multilod_fragment_data_size(bad)
    huge = bytearray(manifest)
    huge[24:28] = struct.pack("<I", 2**32 - 1)
    with pytest.raises(FormatError):
        multilod_fragment_data_size(bytes(huge))


def test_multilod_manifest_matches_cloudvolume():
    """cloud-volume's own manifest encoder/decoder agrees with our fragment-size sum."""
    script = r"""
import sys, numpy as np
from cloudvolume.datasource.precomputed.mesh.multilod import MultiLevelPrecomputedMeshManifest as M
rng = np.random.default_rng(1)
lods = [27, 4, 1]
m = M(7, chunk_shape=np.array([8, 8, 8], np.float32), grid_origin=np.zeros(3, np.float32),
      num_lods=3, lod_scales=np.array([1, 2, 4], np.float32), vertex_offsets=np.zeros((3, 3), np.float32),
      num_fragments_per_lod=np.array(lods, np.uint32),
      fragment_positions=[rng.integers(0, 9, size=(n, 3)).astype(np.uint32) for n in lods],
      # to_binary wants the sizes of all lods as one flat array
      fragment_offsets=rng.integers(0, 10**6, size=sum(lods)).astype(np.uint32))
b = m.to_binary()
m2 = M.from_binary(b, 7)
sys.stdout.write(b.hex() + " " + str(sum(int(x.sum()) for x in m2.fragment_offsets)))
"""
    out = subprocess.run([peers.cloudvolume_python(), "-c", script], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    hex_, total = out.stdout.split()
    assert multilod_fragment_data_size(bytes.fromhex(hex_)) == int(total)


def test_encode_shard_unindexed_bytes_sit_just_before_their_chunk():
    """``unindexed`` (multilod fragment data) is laid out immediately before
    its chunk and appears in no index; ids that are no chunk are refused."""
    spec = ShardingSpec.from_json(peers.sharding("identity", 0, 1, 1, "raw", "gzip"))
    chunks = {0: b"manifest 0", 5: b"manifest 5", 4: b"m4", 1: b"manifest 1"}  # one shard, two minishards
    before = {0: b"fragments of 0", 4: b"frag 4 " * 30, 1: b"f1"}
    data = encode_shard(chunks, spec, unindexed=before)
    ids, offs, sizes, _ = parse_shard(data, spec)
    assert sorted(ids.tolist()) == sorted(chunks)
    for cid, off, n in zip(ids.tolist(), offs.tolist(), sizes.tolist()):
        assert gzip.decompress(data[off: off + n]) == chunks[cid]
        frag = before.get(cid, b"")
        assert data[off - len(frag): off] == frag
    assert encode_shard(chunks, spec) != data
    with pytest.raises(ValueError, match="not chunks"):
        encode_shard(chunks, spec, unindexed={7: b"x"})
