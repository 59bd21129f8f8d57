"""The oracles check themselves: the sharded stores really hold shards (index parsed by hand,
crc32c verified), the twins really hold one file per non-empty inner chunk with exactly
the shards' chunk bytes, sparse stores really miss chunks and shards, grids are spelled as
claimed, and compare_trees can fail. Everything here runs without FUSE, in seconds."""

from __future__ import annotations

import gzip
import json
import math
import shutil
from functools import lru_cache
from pathlib import Path

import crc32c
import numpy as np
import pytest

from tests import peers_zarr as P

V3_CASES = [(w, i, c) for w, i, c in P.ALL_CASES if w != "zarr2"]
CASES_BY_ID = dict(P.ZARR_CASES)


@pytest.fixture(scope="session")
def written(tmp_path_factory):
    """(writer, case id) -> (sharded root, twin root, data), each written once per session."""
    base = tmp_path_factory.mktemp("peers")
    cases = {(w, i): c for w, i, c in P.ALL_CASES}

    @lru_cache(maxsize=None)
    def get(writer: str, cid: str):
        s, t = base / writer / cid / "sharded", base / writer / cid / "twin"
        return s, t, P.WRITERS[writer](cases[(writer, cid)], s, t)

    return get


# ------------------------------------------------------------------ hand-made shard parsing


def parse_index(raw: bytes, n: int, location: str, endian: str, crc: bool) -> np.ndarray:
    """(n, 2) uint64 (offset, nbytes) from a shard, crc32c checked when present."""
    size = 16 * n + (4 if crc else 0)
    assert len(raw) >= size, "shard shorter than its index"
    blob = raw[:size] if location == "start" else raw[len(raw) - size :]
    body = blob[: 16 * n]
    if crc:
        assert crc32c.crc32c(body) == int.from_bytes(blob[16 * n :], "little"), "bad index crc32c"
    return np.frombuffer(body, dtype="<u8" if endian == "little" else ">u8").reshape(n, 2)


def full_edges(spec, extent: int) -> list[int]:
    """Unclipped shard edges along a dimension (an int step repeats; RLE runs expanded)."""
    if isinstance(spec, int):
        return [spec] * max(1, math.ceil(extent / spec))
    return P._expand_rle(spec)


def shard_contents(doc: dict, shard_coords: tuple) -> tuple[list[tuple], dict]:
    """Global inner-chunk coordinates (C order) of a shard, and the sharding configuration."""
    conf = doc["codecs"][0]["configuration"]
    inner, grid = conf["chunk_shape"], doc["chunk_grid"]
    if grid["name"] == "regular":
        specs = grid["configuration"]["chunk_shape"]
    elif grid["name"] == "rectilinear":
        specs = grid["configuration"]["chunk_shapes"]
    else:
        specs = grid["configuration"]["chunk_shape"]
    ranges = []
    for spec, extent, step, i in zip(specs, doc["shape"], inner, shard_coords):
        edges = full_edges(spec, extent)
        assert all(e % step == 0 for e in edges)
        start = sum(edges[:i]) // step
        ranges.append(range(start, start + edges[i] // step))
    coords = [tuple(int(x) for x in c) for c in np.ndindex(*(len(r) for r in ranges))]
    return [tuple(r[k] for r, k in zip(ranges, c)) for c in coords], conf


def index_config(conf: dict) -> tuple[str, str, bool]:
    idx = conf["index_codecs"]
    endian = (idx[0].get("configuration") or {}).get("endian", "little")
    return conf.get("index_location", "end"), endian, [c["name"] for c in idx[1:]] == ["crc32c"]


def chunk_files(root: Path, prefix: str) -> set[str]:
    return {f for f in P.list_files(root / prefix) if not P.is_metadata_name(f)} if (root / prefix).exists() else set()


# ------------------------------------------------------------------ v3 (zarr-python, tensorstore)


@pytest.mark.parametrize("writer,cid,case", V3_CASES, ids=[f"{w}-{i}" for w, i, _ in V3_CASES])
def test_twin_is_the_contract_view_of_the_sharded_store(written, writer, cid, case):
    s, t, data = written(writer, cid)
    # every metadata document of the twin is the contract's rewrite of the sharded one
    for rel in sorted(f for f in P.list_files(s) if P.is_metadata_name(f)):
        doc = json.loads((s / rel).read_text())
        assert P.json_diff(P.expected_view_metadata(doc), json.loads((t / rel).read_text())) == [], rel
    assert P.list_files(t) == {f for f in P.list_files(s) if P.is_metadata_name(f)} | P.expected_chunk_keys(case, data)
    assert chunk_files(s, case.path) == {k.removeprefix(case.path + "/") for k in P.expected_shard_keys(case, data)}
    if case.raw:
        assert P.compare_trees(s, t) == []
        return

    doc = json.loads((s / case.path / "zarr.json").read_text())
    grid = [math.ceil(n / c) for n, c in zip(case.shape, case.chunks)]
    seen, empty_in_present_shard = set(), 0
    for key in sorted(chunk_files(s, case.path)):
        coords, conf = shard_contents(doc, P.parse_chunk_key(case, key))
        location, endian, crc = index_config(conf)
        assert (location, endian, crc) == (case.index_location, case.index_endian, case.index_crc32c)
        raw = (s / case.path / key).read_bytes()
        index = parse_index(raw, len(coords), location, endian, crc)
        for inner, (off, nbytes) in zip(coords, index.tolist()):
            twin_key = f"{case.path}/{P.chunk_key(case, inner)}"
            if (off, nbytes) == (P.EMPTY, P.EMPTY):
                empty_in_present_shard += all(c < g for c, g in zip(inner, grid))
                assert not (t / twin_key).exists(), twin_key
                continue
            assert all(c < g for c, g in zip(inner, grid)), f"{key}: chunk {inner} outside the grid"
            chunk = raw[off : off + nbytes]
            assert len(chunk) == nbytes
            assert P.normalize_gzip(chunk) == P.normalize_gzip((t / twin_key).read_bytes()), twin_key
            seen.add(twin_key)
    assert seen == P.expected_chunk_keys(case, data)
    assert P.compare_trees(t, t) == []
    if case.pattern == "sparse" and not case.write_empty_chunks:
        shard_grid = math.prod(len(b) - 1 for b in P.shard_bounds(case))
        assert len(chunk_files(s, case.path)) < shard_grid, "sparse case without a missing shard"
        assert empty_in_present_shard, "sparse case without a missing chunk in a present shard"


def test_manifest_covers_every_variant():
    cases = [c for _, c in P.ZARR_CASES]
    have = lambda f: any(f(c) for c in cases)  # noqa: E731
    for loc in ("start", "end"):
        for endian in ("little", "big"):
            for crc in (True, False):
                assert have(lambda c: (c.index_location, c.index_endian, c.index_crc32c) == (loc, endian, crc)
                            and c.sharded), (loc, endian, crc)
    assert {c.compressor for c in cases} >= {None, "gzip", "zstd", "blosc"}
    assert {c.endian for c in cases} == {"little", "big"}
    assert {(c.key_encoding, c.separator) for c in cases} == {("default", "/"), ("default", "."), ("v2", "."), ("v2", "/")}
    assert {c.grid for c in cases if c.sharded} == {"regular", "rectilinear", "rectangular"}
    assert {c.pattern for c in cases} == {"full", "sparse", "empty"}
    assert have(lambda c: c.shape == ()) and have(lambda c: c.nested) and have(lambda c: c.pre_transpose)
    assert have(lambda c: c.post_codec) and have(lambda c: c.inner_transpose) and have(lambda c: not c.sharded)
    assert have(lambda c: c.attributes) and have(lambda c: c.dimension_names) and have(lambda c: "/" in c.path)
    assert have(lambda c: c.write_empty_chunks) and have(lambda c: c.fill_value != 0)
    assert len({i for i, _ in P.ZARR_CASES}) == len(P.ZARR_CASES)


def test_arrays_stay_small(written):
    for cid, case in P.ZARR_CASES:
        s, _, _ = written("zarr", cid)
        assert sum((s / f).stat().st_size for f in P.list_files(s)) < 300_000, cid


@pytest.mark.parametrize(
    "cid,grid",
    [
        ("rectilinear_edges", {"name": "rectilinear", "configuration": {"kind": "inline", "chunk_shapes": [[8, 4, 8], 6]}}),
        ("rectilinear_rle_sparse", {"name": "rectilinear",
                                    "configuration": {"kind": "inline", "chunk_shapes": [[[8, 2], 4], [[6, 2]]]}}),
        ("rectilinear_overhang", {"name": "rectilinear", "configuration": {"kind": "inline", "chunk_shapes": [[[8, 3]], 6]}}),
        ("rectangular_edges", {"name": "rectangular", "configuration": {"chunk_shape": [[8, 4, 8], 6]}}),
        ("rectangular_rle_sparse_gzip", {"name": "rectangular", "configuration": {"chunk_shape": [[8, 8, 4], [6, 6]]}}),
        ("unsharded_rectangular", {"name": "rectangular", "configuration": {"chunk_shape": [[8, 8, 4], [6, 6]]}}),
    ],
)
def test_variable_grids_are_spelled_as_claimed(written, cid, grid):
    s, t, _ = written("zarr", cid)
    doc = json.loads((s / "arr/zarr.json").read_text())
    assert doc["chunk_grid"] == grid
    if CASES_BY_ID[cid].sharded:
        assert json.loads((t / "arr/zarr.json").read_text())["chunk_grid"] == {
            "name": "regular", "configuration": {"chunk_shape": [4, 3]}}


def test_nested_and_raw_metadata(written):
    s, t, _ = written("zarr", "nested")
    sdoc, tdoc = (json.loads((r / "arr/zarr.json").read_text()) for r in (s, t))
    outer = sdoc["codecs"][0]["configuration"]
    assert outer["codecs"][0]["name"] == P.SHARDING and tdoc["codecs"] == outer["codecs"]
    assert tdoc["chunk_grid"]["configuration"]["chunk_shape"] == outer["chunk_shape"] == [4, 6]
    for cid in ("raw_pre_transpose", "raw_post_crc32c"):
        s, t, _ = written("zarr", cid)
        doc = json.loads((s / "arr/zarr.json").read_text())
        assert P.SHARDING in [c["name"] for c in doc["codecs"]] and P.expected_view_metadata(doc) == doc


def test_expected_view_metadata_by_hand():
    sharded = {
        "zarr_format": 3, "node_type": "array", "shape": [8], "data_type": "uint8", "fill_value": 0,
        "chunk_grid": {"name": "rectangular", "configuration": {"chunk_shape": [[4, 4]]}},
        "chunk_key_encoding": {"name": "default"}, "attributes": {"x": 1},
        "codecs": [{"name": P.SHARDING, "configuration": {"chunk_shape": [2], "codecs": [{"name": "bytes"}],
                                                          "index_codecs": [{"name": "bytes"}]}}],
    }
    view = P.expected_view_metadata(sharded)
    assert view == {**sharded, "codecs": [{"name": "bytes"}],
                    "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": [2]}}}
    group = {"zarr_format": 3, "node_type": "group",
             "consolidated_metadata": {"kind": "inline", "metadata": {"a": sharded}}}
    assert P.expected_view_metadata(group)["consolidated_metadata"]["metadata"]["a"] == view
    draft = {"chunk_grid": {"type": "regular", "chunk_shape": [2], "separator": "/"},
             "storage_transformers": [{"extension": P.TRANSFORMER_URI, "type": "indexed",
                                       "configuration": {"chunks_per_shard": [2]}}]}
    assert P.expected_view_metadata(draft) == {"chunk_grid": draft["chunk_grid"]}


def test_writers_are_deterministic(tmp_path, monkeypatch):
    """Writing a case twice gives trees compare_trees calls equal (gzip, zstd, blosc).

    gzip (numcodecs, through Python's gzip module) stamps the current second
    in every member's header, and a shard holds several members, which
    compare_trees cannot normalise from outside: the clock gzip reads is
    frozen here, or two writes on either side of a second would differ."""
    import gzip
    import types

    monkeypatch.setattr(gzip, "time", types.SimpleNamespace(time=lambda: 1_700_000_000.0))
    for cid in ("inner_be_gzip", "zstd", "blosc", "nested_sparse_zstd_start"):
        case = CASES_BY_ID[cid]
        for writer in ("zarr", "tensorstore"):
            fn = P.WRITERS[writer]
            a, b = tmp_path / writer / cid / "a", tmp_path / writer / cid / "b"
            fn(case, a / "s", a / "t")
            fn(case, b / "s", b / "t")
            assert P.compare_trees(a, b) == [], (writer, cid)


# ------------------------------------------------------------------ hierarchy, consolidated


def test_hierarchy_with_consolidated_metadata(tmp_path):
    s, t = tmp_path / "s", tmp_path / "t"
    datas = P.write_zarr_hierarchy(P.HIERARCHY_CASES, s, t, consolidated=True, root_attributes={"top": 1})
    assert set(datas) == {c.path for c in P.HIERARCHY_CASES}
    sroot, troot = (json.loads((r / "zarr.json").read_text()) for r in (s, t))
    assert sroot["attributes"] == {"top": 1}
    meta = sroot["consolidated_metadata"]["metadata"]
    assert meta["c/rect"]["chunk_grid"]["name"] == "rectangular"
    assert meta["a/sharded"]["codecs"][0]["name"] == P.SHARDING
    assert P.json_diff(P.expected_view_metadata(sroot), troot) == []
    assert json.loads((s / "a/b/zarr.json").read_text())["attributes"] == {"group": "a/b"}
    for case in P.HIERARCHY_CASES:
        expected = P.expected_chunk_keys(case, datas[case.path])
        assert chunk_files(t, case.path) == {k.removeprefix(case.path + "/") for k in expected}, case.path
        assert P.json_diff(P.expected_view_metadata(json.loads((s / case.path / "zarr.json").read_text())),
                           json.loads((t / case.path / "zarr.json").read_text())) == []


# ------------------------------------------------------------------ zarr 2.18 storage transformer


@pytest.mark.parametrize("cid,case", P.ZARR2_CASES, ids=[i for i, _ in P.ZARR2_CASES])
def test_zarr2_transformer_layout(written, cid, case):
    s, t, data = written("zarr2", cid)
    meta = f"meta/root/{case.path}.array.json"
    sdoc, tdoc = (json.loads((r / meta).read_text()) for r in (s, t))
    cps = [sh // ch for sh, ch in zip(case.shards, case.chunks)] or [1]
    assert sdoc["storage_transformers"] == [
        {"extension": P.TRANSFORMER_URI, "type": "indexed", "configuration": {"chunks_per_shard": cps}}]
    assert "storage_transformers" not in tdoc and P.expected_view_metadata(sdoc) == tdoc
    assert sdoc["chunk_grid"] == {"type": "regular", "chunk_shape": list(case.chunks), "separator": case.separator}
    assert json.loads((s / "zarr.json").read_text())["zarr_format"] == "https://purl.org/zarr/spec/protocol/core/3.0"
    assert (s / "meta/root.group.json").exists()
    for rel in (f for f in P.list_files(s) if P.is_metadata_name(f)):
        assert P.json_diff(P.expected_view_metadata(json.loads((s / rel).read_text())),
                           json.loads((t / rel).read_text())) == [], rel

    written_chunks = P.written_chunks(case, data)
    want_twin = {P.draft_chunk_key(case, c) for c in written_chunks}
    want_shards = {P.draft_chunk_key(case, tuple(x // k for x, k in zip(c, cps))) for c in written_chunks}
    prefix = f"data/root/{case.path}"
    assert {f"{prefix}/{k}" for k in chunk_files(t, prefix)} == want_twin
    assert {f"{prefix}/{k}" for k in chunk_files(s, prefix)} == want_shards
    seen = set()
    for key in sorted(want_shards):
        raw = (s / key).read_bytes()
        shard = tuple(map(int, key.rsplit("/c", 1)[1].split(case.separator))) if case.shape else (0,)
        index = parse_index(raw, math.prod(cps), "end", "little", False)
        for local, (off, nbytes) in zip(np.ndindex(*cps), index.tolist()):
            coords = tuple(sh * k + int(l) for sh, k, l in zip(shard, cps, local))[: len(case.shape)]
            if (off, nbytes) == (P.EMPTY, P.EMPTY):
                assert not (t / P.draft_chunk_key(case, coords)).exists()
                continue
            chunk = raw[off : off + nbytes]
            assert P.normalize_gzip(chunk) == P.normalize_gzip((t / P.draft_chunk_key(case, coords)).read_bytes())
            seen.add(P.draft_chunk_key(case, coords))
    assert seen == want_twin
    if case.pattern == "sparse" and not case.write_empty_chunks:
        assert len(want_shards) < math.prod(math.ceil(n / (k * c)) for n, k, c in zip(case.shape, cps, case.chunks))


# ------------------------------------------------------------------ compare_trees, normalize_gzip


def test_normalize_gzip():
    a, b = gzip.compress(b"x" * 100, mtime=1), gzip.compress(b"x" * 100, mtime=2_000_000_000)
    assert a != b and P.normalize_gzip(a) == P.normalize_gzip(b)
    assert P.normalize_gzip(gzip.compress(b"y" * 100, mtime=1)) != P.normalize_gzip(a)
    named = bytearray(a[:10]) + b"name\0" + a[10:]
    named[3] |= 8  # FNAME
    assert P.normalize_gzip(bytes(named)) == P.normalize_gzip(a)
    assert gzip.decompress(P.normalize_gzip(bytes(named))) == b"x" * 100
    assert P.normalize_gzip(b"not gzip") == b"not gzip"


MUTATIONS = {  # name -> must compare_trees report it?
    "flip_chunk_byte": True,
    "remove_chunk": True,
    "add_chunk": True,
    "change_json_value": True,
    "json_number_to_bool": True,
    "reorder_json_keys": False,
    "extra_empty_directory": False,
    "change_gzip_mtime": False,
}


def mutate(root: Path, name: str) -> None:
    chunk = next(p for p in sorted(root.rglob("c/*/*")) if p.is_file())
    doc_path = root / "arr/zarr.json"
    doc = json.loads(doc_path.read_text())
    raw = bytearray(chunk.read_bytes())
    if name == "flip_chunk_byte":
        raw[-1] ^= 1
    elif name == "change_gzip_mtime":
        raw[4:8] = b"\x01\x02\x03\x04"
    elif name == "remove_chunk":
        chunk.unlink()
    elif name == "add_chunk":
        (root / "arr/c/99").mkdir(parents=True)
        (root / "arr/c/99/0").write_bytes(b"x")
    elif name == "extra_empty_directory":
        (root / "arr/c/77").mkdir(parents=True)
    elif name == "change_json_value":
        doc["fill_value"] = 1
    elif name == "json_number_to_bool":
        doc["fill_value"] = False  # 0 == False in Python, not in JSON
    elif name == "reorder_json_keys":
        doc = dict(reversed(doc.items()))
    if chunk.exists():
        chunk.write_bytes(bytes(raw))
    doc_path.write_text(json.dumps(doc))


@pytest.mark.parametrize("name,must_differ", MUTATIONS.items())
def test_compare_trees_sees_real_differences_only(written, tmp_path, name, must_differ):
    _, t, _ = written("zarr", "inner_be_gzip")
    assert P.compare_trees(t, t) == []
    copy = tmp_path / "copy"
    shutil.copytree(t, copy)
    mutate(copy, name)
    assert bool(P.compare_trees(copy, t)) == must_differ, P.compare_trees(copy, t)


def test_gzip_normalisation_only_for_gzip_arrays(written, tmp_path):
    """A chunk of an uncompressed array that merely looks like gzip is compared raw."""
    _, t, _ = written("zarr", "basic")
    a, b = tmp_path / "a", tmp_path / "b"
    for root, mtime in ((a, 1), (b, 2)):
        shutil.copytree(t, root)
        (root / "arr/c/0/0").write_bytes(gzip.compress(b"z" * 50, mtime=mtime))
    assert [d.split(":")[0] for d in P.compare_trees(a, b)] == ["arr/c/0/0"]
