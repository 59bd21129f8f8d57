"""Metadata documents written through the view (SEMANTICS.md §4.11, §4.12): consolidated
metadata, unsharded arrays copied into a ``-o shard=K`` mount, and existing
unsharded arrays there.  The oracle is zarr-python reading the *store*
directly; a fresh mount must read the same."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import warnings
from pathlib import Path

import numpy as np
import pytest
import zarr

from tests import test_write as tw
from tests.test_write import assert_no_strays, chunk_name
from tests.util import SAVES, save_as

store = tw.store  # the local directory and the S3 bucket of test_write.py

DATA = np.arange(64, dtype="<i4").reshape(8, 8) + 1
SERIES = np.linspace(0, 1, 12)


def _doc(path) -> dict:
    return json.loads(Path(path).read_text())


def _hierarchy(root: Path, sharded: bool) -> None:
    """A group holding a sharded 2-d array, a group with a sharded 1-d array
    (attributes, dimension names) and an unsharded array; or its unsharded twin."""
    g = zarr.open_group(str(root), mode="w")
    g.create_group("sub")
    for path, data, chunks, shards, extra in (
            ("arr", DATA, (2, 2), (4, 4), {"compressors": zarr.codecs.GzipCodec(level=1)}),
            ("sub/b", SERIES, (3,), (6,), {"attributes": {"units": "m"}, "dimension_names": ["t"],
                                           "compressors": None})):
        a = zarr.create_array(str(root / path), shape=data.shape, chunks=chunks, dtype=data.dtype,
                              shards=shards if sharded else None, fill_value=0, **extra)
        a[...] = data
    zarr.create_array(str(root / "plain"), shape=(5,), chunks=(2,), dtype="u1", fill_value=0)[...] = np.arange(5)


def _consolidate(path) -> None:
    with warnings.catch_warnings():  # "not part of the Zarr format 3 specification"
        warnings.simplefilter("ignore")
        zarr.consolidate_metadata(str(path))


def _open_consolidated(path):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return zarr.open_consolidated(str(path), mode="r")


def _check_consolidated_store(store, tmp_path, attrs) -> None:
    """zarr-python reads the stored hierarchy through its consolidated metadata."""
    g = _open_consolidated(store.local_copy(tmp_path / f"copy-{os.urandom(4).hex()}") / "h")
    assert g.metadata.consolidated_metadata is not None
    assert g["arr"].shards == (4, 4) and g["sub/b"].shards == (6,)
    assert dict(g["arr"].attrs) == attrs  # from the consolidated metadata, not arr/zarr.json
    np.testing.assert_array_equal(g["arr"][...], DATA)
    np.testing.assert_array_equal(g["sub/b"][...], SERIES)
    np.testing.assert_array_equal(g["plain"][...], np.arange(5))


def test_consolidated_metadata_maps_back_to_the_stored_arrays(store, mount, tmp_path):
    """zarr.consolidate_metadata through the view, then a tool editing the
    consolidated document: the stored group embeds the arrays' stored (sharded)
    documents, the view shows exactly what was written, and zarr-python opens
    the store consolidated."""
    _hierarchy(tmp_path / "seed", sharded=True)
    store.put_tree(tmp_path / "seed", "h")
    m = mount(store.source, extra=store.extra)
    _consolidate(m / "h")
    written = _doc(m / "h/zarr.json")
    members = written["consolidated_metadata"]["metadata"]
    for path in ("arr", "sub/b", "plain"):  # what the tool read of each member is what the view shows back
        assert members[path] == _doc(m / "h" / path / "zarr.json"), path
    assert members["arr"]["chunk_grid"]["configuration"]["chunk_shape"] == [2, 2]

    # a tool edits the consolidated document itself (group and member attributes)
    edit = json.loads(json.dumps(written))
    edit["attributes"] = {"k": 1}
    edit["consolidated_metadata"]["metadata"]["arr"]["attributes"] = {"note": "consolidated"}
    (m / "h/zarr.json").write_text(json.dumps(edit))
    assert _doc(m / "h/zarr.json") == edit
    # a member change the stored chunks cannot follow is refused, as for the array's own document
    bad = json.loads(json.dumps(edit))
    bad["consolidated_metadata"]["metadata"]["sub/b"]["chunk_grid"]["configuration"]["chunk_shape"] = [4]
    with pytest.raises(PermissionError):
        (m / "h/zarr.json").write_text(json.dumps(bad))
    assert _doc(m / "h/zarr.json") == edit
    assert "refused to store h/zarr.json: consolidated member 'sub/b'" in m.log_text()
    m.umount()

    stored = json.loads(store.get("h/zarr.json"))["consolidated_metadata"]["metadata"]
    for path in ("arr", "sub/b"):
        own = json.loads(store.get(f"h/{path}/zarr.json"))
        assert [c["name"] for c in stored[path]["codecs"]] == ["sharding_indexed"], path
        assert (stored[path]["codecs"], stored[path]["chunk_grid"]) == (own["codecs"], own["chunk_grid"])
    assert stored["sub/b"] == json.loads(store.get("h/sub/b/zarr.json"))
    assert stored["plain"] == members["plain"]  # unsharded: as written
    _check_consolidated_store(store, tmp_path, {"note": "consolidated"})

    # a fresh daemon: the same view, and a rewrite that never read the members
    # maps back onto the stored consolidated snapshot
    m = mount(store.source, extra=store.extra)
    assert _doc(m / "h/zarr.json") == edit
    edit["attributes"] = {"k": 2}
    (m / "h/zarr.json").write_text(json.dumps(edit))
    assert _doc(m / "h/zarr.json") == edit
    m.umount()
    _check_consolidated_store(store, tmp_path, {"note": "consolidated"})


def test_nested_sharded_arrays_are_edited_through_the_view(store, mount, tmp_path):
    """Nested sharding is shown one level down, still sharded.  zarr-python
    editing such an array through the view (attributes, resize) and
    consolidating its group there: each document maps back onto the stored
    outer sharding (before, every rewrite was refused with EPERM, and the
    consolidated member was stored in the view's form, which zarr-python
    could not read the source by)."""
    from zarr.codecs import BytesCodec, ShardingCodec

    seed = tmp_path / "seed"
    data = np.arange(240, dtype="<u2").reshape(20, 12)
    g = zarr.open_group(str(seed / "h"), mode="w")
    inner = ShardingCodec(chunk_shape=(2, 3), codecs=[BytesCodec()])
    g.create_array("arr", shape=data.shape, dtype=data.dtype, chunks=(8, 12), fill_value=0,
                   serializer=ShardingCodec(chunk_shape=(4, 6), codecs=[inner]), compressors=None)[...] = data
    stored_before = json.loads((seed / "h/arr/zarr.json").read_text())
    store.put_tree(seed / "h", "h")
    m = mount(store.source, extra=store.extra)
    view = zarr.open_array(str(m / "h/arr"), mode="r+")
    assert _doc(m / "h/arr/zarr.json")["chunk_grid"]["configuration"]["chunk_shape"] == [4, 6]
    view.attrs["unit"] = "nm"
    view.resize((24, 12))
    _consolidate(m / "h")
    assert _doc(m / "h/zarr.json")["consolidated_metadata"]["metadata"]["arr"] == _doc(m / "h/arr/zarr.json")
    m.umount()

    own = json.loads(store.get("h/arr/zarr.json"))
    assert (own["codecs"], own["chunk_grid"]) == (stored_before["codecs"], stored_before["chunk_grid"])
    assert own["shape"] == [24, 12] and own["attributes"] == {"unit": "nm"}
    assert json.loads(store.get("h/zarr.json"))["consolidated_metadata"]["metadata"]["arr"] == own
    copy = store.local_copy(tmp_path / "copy") / "h"
    for arr in (zarr.open_array(str(copy / "arr"), mode="r"), _open_consolidated(copy)["arr"]):
        np.testing.assert_array_equal(arr[:20], data)
        assert arr.shape == (24, 12) and not arr[20:].any()


def test_variable_grids_grow_through_the_view(store, mount, tmp_path):
    """A rectilinear-sharded array grown through the view (zarr-python's
    resize) past the end of its last shard: the stored grid gets one more
    shard edge, the growth rounded up to whole inner chunks, as zarr-python
    appends the growth as one edge; new rows written there are stored.
    Shrinking keeps the edges.  (Before: refused with EPERM.)"""
    from zarr.codecs import BytesCodec, ShardingCodec
    from zarr.core.metadata.v3 import RectilinearChunkGridMetadata

    data = np.arange(240, dtype="<u2").reshape(20, 12)
    with zarr.config.set({"array.rectilinear_chunks": True}):
        zarr.create_array(str(tmp_path / "seed/arr"), shape=data.shape, dtype=data.dtype, fill_value=0,
                          chunks=RectilinearChunkGridMetadata(chunk_shapes=((8, 4, 8), 6)),
                          serializer=ShardingCodec(chunk_shape=(4, 3), codecs=[BytesCodec()]),
                          compressors=None)[...] = data
    store.put_tree(tmp_path / "seed/arr", "arr")
    m = mount(store.source, extra=store.extra)
    view = zarr.open_array(str(m / "arr"), mode="r+")
    view.resize((30, 12))
    view[20:] = 7
    view.resize((26, 12))
    m.umount()
    stored = json.loads(store.get("arr/zarr.json"))
    assert stored["shape"] == [26, 12]
    assert stored["chunk_grid"]["configuration"]["chunk_shapes"][0] == [8, 4, 8, 12]  # (growth 10, chunks of 4)
    with zarr.config.set({"array.rectilinear_chunks": True}):
        values = zarr.open_array(str(store.local_copy(tmp_path / "copy") / "arr"), mode="r")[...]
    np.testing.assert_array_equal(values[:20], data)
    assert (values[20:] == 7).all() and values.shape == (26, 12)


def test_consolidated_document_copied_in_maps_back(store, mount, tmp_path):
    """A consolidated group document made elsewhere (the unsharded twin's) and
    copied onto the store's group through a fresh mount, which has shown none
    of the members: each member is mapped back to its array's stored document,
    read from storage then.  Needs view.py to call accept_document_async."""
    _hierarchy(tmp_path / "seed", sharded=True)
    store.put_tree(tmp_path / "seed", "h")
    _hierarchy(tmp_path / "twin", sharded=False)
    _consolidate(tmp_path / "twin")
    m = mount(store.source, extra=store.extra)
    subprocess.run(["cp", tmp_path / "twin/zarr.json", m / "h/zarr.json"], check=True)
    assert _doc(m / "h/zarr.json") == _doc(tmp_path / "twin/zarr.json")
    m.umount()
    _check_consolidated_store(store, tmp_path, {})


def test_existing_unsharded_array_stays_unsharded_in_a_shard_mount(store, mount, tmp_path):
    """``-o shard=K`` stores NEW arrays sharded; rewriting the metadata of an
    array stored unsharded (attributes, resize) keeps it unsharded, since its
    chunks are plain objects."""
    zarr.create_array(str(tmp_path / "seed/arr"), shape=(8, 8), chunks=(2, 2), dtype="<i4", fill_value=0,
                      compressors=None)[...] = DATA
    store.put_tree(tmp_path / "seed/arr", "arr")
    m = mount(store.source, "shard=2", extra=store.extra)
    a = zarr.open_array(str(m / "arr"), mode="r+")
    a.attrs["note"] = "kept"
    a.resize((10, 8))
    m.umount()
    stored = json.loads(store.get("arr/zarr.json"))
    assert [c["name"] for c in stored["codecs"]] == ["bytes"]
    assert stored["attributes"] == {"note": "kept"} and stored["shape"] == [10, 8]
    b = zarr.open_array(str(store.local_copy(tmp_path / "copy") / "arr"), mode="r")
    np.testing.assert_array_equal(b[:8], DATA)
    np.testing.assert_array_equal(b[8:], 0)


def test_shard_factors_for_other_dimensions_store_the_array_as_written(store, mount, tmp_path):
    """``-o shard=2x2x2`` names three factors: a 2-d array written into that
    mount is stored unsharded, as written, with one log line (before, its
    ``zarr.json`` was refused, and the tool failed)."""
    m = mount(store.source, "shard=2x2x2", extra=store.extra)
    a = zarr.create_array(str(m / "flat"), shape=(8, 8), chunks=(2, 2), dtype="<i4", fill_value=0,
                          compressors=None)
    a[...] = DATA
    cube = zarr.create_array(str(m / "cube"), shape=(4, 4, 4), chunks=(2, 2, 2), dtype="u1", fill_value=0,
                             compressors=None)
    cube[...] = 7
    m.umount()
    assert m.log_text().count("-o shard has 3 factors but the array has 2 dimensions") == 1
    root = store.local_copy(tmp_path / "copy")
    flat, stored_cube = zarr.open_array(str(root / "flat"), mode="r"), zarr.open_array(str(root / "cube"), mode="r")
    assert flat.shards is None and stored_cube.shards == (4, 4, 4)
    np.testing.assert_array_equal(flat[...], DATA)
    np.testing.assert_array_equal(stored_cube[...], 7)


def test_an_array_with_a_variable_chunk_grid_is_stored_as_written_and_said(store, mount, tmp_path):
    """``-o shard=K`` shards arrays whose chunk grid is regular: a new
    array with a ``rectilinear`` chunk grid (zarr-python 3.4's
    ``chunks=[[10, 20, 30], [25, 25]]``), whose chunks differ in size, is
    stored unsharded, as written, with one log line (before: no line, the
    array silently unsharded); grown and shrunk it reads as written."""
    m = mount(store.source, "shard=2", extra=store.extra)
    with zarr.config.set({"array.rectilinear_chunks": True}):
        a = zarr.create_array(str(m / "var"), shape=(60, 50), chunks=[[10, 20, 30], [25, 25]], dtype="<i4",
                              fill_value=0, compressors=None)
        a[...] = np.arange(3000, dtype="<i4").reshape(60, 50)
        a.resize((80, 50))
        a[60:80] = 4
        a.resize((30, 40))
        m.umount()
        assert m.log_text().count("var/zarr.json: stored unsharded, as written: -o shard shards arrays with a "
                                  'regular chunk grid, and this one\'s is "rectilinear"') == 1
        stored = zarr.open_array(str(store.local_copy(tmp_path / "copy") / "var"), mode="r")
        assert [c["name"] for c in stored.metadata.to_dict()["codecs"]] == ["bytes"]
        np.testing.assert_array_equal(stored[...], np.arange(3000, dtype="<i4").reshape(60, 50)[:30, :40])


def test_a_scalar_array_is_stored_as_written_and_said(store, mount, tmp_path):
    """``-o shard=K`` shards arrays with dimensions: a new 0-d array has
    one chunk, which a shard would only wrap (zarr-python can store it so,
    to no gain), so it is stored unsharded, as written, with one log line
    per array, for any number of factors (before: no line, the array
    silently unsharded); written again, it reads as written."""
    m = mount(store.source, "shard=2x2", extra=store.extra)
    for name in ("s", "t"):
        a = zarr.create_array(str(m / name), shape=(), dtype="<f8", fill_value=0, compressors=None)
        a[...] = 2.5
        a.attrs["units"] = "m"
        a[...] = 3.5
    m.umount()
    for name in ("s", "t"):
        assert m.log_text().count(f"{name}/zarr.json: stored unsharded, as written: -o shard shards arrays with "
                                  f"dimensions, and this one is 0-d") == 1, m.log_text()
        stored = zarr.open_array(str(store.local_copy(tmp_path / f"copy_{name}") / name), mode="r")
        assert [c["name"] for c in stored.metadata.to_dict()["codecs"]] == ["bytes"]
        assert stored[...] == 3.5 and stored.attrs["units"] == "m"


def test_shard_factors_are_kept_and_too_large_shards_are_logged(store, mount, tmp_path):
    """``-o shard=K`` shards hold K chunks per dimension as asked, also past
    the array's shape when it is made (an array made empty and appended to
    grows into its shards); an array whose shards would hold more than
    2**24 chunks is stored unsharded, as written, with one log line
    (before: no line)."""
    m = mount(store.source, "shard=16", extra=store.extra)
    grown = zarr.create_array(str(m / "grown"), shape=(0,), chunks=(10,), dtype="u1", fill_value=0,
                              compressors=None)
    grown.append(np.arange(1600, dtype="u1") % 251)
    m.umount()
    m = mount(store.source, "shard=4000", extra=store.extra)
    zarr.create_array(str(m / "vast"), shape=(300, 300, 300), chunks=(1, 1, 1), dtype="u1", fill_value=0,
                      compressors=None)
    m.umount()
    assert m.log_text().count("vast/zarr.json: stored unsharded, as written: sharded, it could not be shown") == 1
    root = store.local_copy(tmp_path / "copy")
    stored = zarr.open_array(str(root / "grown"), mode="r")
    assert stored.shards == (160,)
    np.testing.assert_array_equal(stored[...], np.arange(1600, dtype="u1") % 251)
    assert len([k for k in store.keys() if k.startswith("grown/c/")]) == 10
    assert zarr.open_array(str(root / "vast"), mode="r").shards is None


def _unsharded_source(tmp_path: Path) -> Path:
    src = tmp_path / "unsharded"
    zarr.create_array(str(src / "arr"), shape=(8, 8), chunks=(2, 2), dtype="<i4", fill_value=0,
                      compressors=None)[...] = DATA
    return src / "arr"


def test_rsync_into_a_shard_mount_never_shards_over_stored_chunks(store, mount, tmp_path):
    """``rsync -a`` copies in sorted order: the chunks (``c/...``) are stored
    before ``zarr.json`` arrives.  That array is stored unsharded, as written,
    with one log line; an array whose metadata arrives first is stored sharded.
    Needs view.py to call accept_document_async."""
    src = _unsharded_source(tmp_path)
    m = mount(store.source, "shard=2", extra=store.extra)
    subprocess.run(["rsync", "-a", f"{src}/", f"{m / 'arr'}/"], check=True, capture_output=True)
    subprocess.run(["rsync", "-a", src / "zarr.json", f"{m / 'first'}/"], check=True, capture_output=True)
    subprocess.run(["rsync", "-a", f"{src}/", f"{m / 'first'}/"], check=True, capture_output=True)
    for name in ("arr", "first"):
        np.testing.assert_array_equal(zarr.open_array(str(m / name), mode="r")[...], DATA, err_msg=name)
    m.umount()
    assert m.log_text().count("stored unsharded") == 1
    assert "arr/zarr.json: stored unsharded" in m.log_text()

    root = store.local_copy(tmp_path / "copy")
    arr, first = zarr.open_array(str(root / "arr"), mode="r"), zarr.open_array(str(root / "first"), mode="r")
    assert arr.shards is None and first.shards == (4, 4)
    np.testing.assert_array_equal(arr[...], DATA)
    np.testing.assert_array_equal(first[...], DATA)
    allowed = {"arr/zarr.json", "first/zarr.json"}
    allowed.update(f"arr/{chunk_name((i, j), '/')}" for i in range(4) for j in range(4))
    allowed.update(f"first/{chunk_name((i, j), '/')}" for i in range(2) for j in range(2))
    assert_no_strays(store, allowed)
    m = mount(store.source, "ro", extra=store.extra)
    for name in ("arr", "first"):
        np.testing.assert_array_equal(zarr.open_array(str(m / name), mode="r")[...], DATA, err_msg=name)


def test_chunk_directories_of_a_new_array_can_be_made(store, mount, tmp_path):
    """What ``cp -r`` does when it copies ``zarr.json`` first: mkdir of each
    chunk directory of the array that document just created must succeed (the
    kernel answers EEXIST itself when a lookup finds the name).  Then a real
    ``cp -r``, in whatever order the source directory lists.  Needs the
    view.py change for chunk directories of arrays made through the mount."""
    src = _unsharded_source(tmp_path)
    m = mount(store.source, "shard=2", extra=store.extra)
    os.mkdir(m / "arr")
    shutil.copyfile(src / "zarr.json", m / "arr/zarr.json")
    os.mkdir(m / "arr/c")
    for i in range(4):
        os.mkdir(m / f"arr/c/{i}")
        for j in range(4):
            shutil.copyfile(src / f"c/{i}/{j}", m / f"arr/c/{i}/{j}")
    subprocess.run(["cp", "-r", src, m / "copy"], check=True, capture_output=True)
    for name in ("arr", "copy"):
        np.testing.assert_array_equal(zarr.open_array(str(m / name), mode="r")[...], DATA, err_msg=name)
    m.umount()
    root = store.local_copy(tmp_path / "copy")
    arr = zarr.open_array(str(root / "arr"), mode="r")
    assert arr.shards == (4, 4)
    np.testing.assert_array_equal(arr[...], DATA)
    np.testing.assert_array_equal(zarr.open_array(str(root / "copy"), mode="r")[...], DATA)


def test_peers_edit_each_others_arrays_through_the_view(store, mount, tmp_path):
    """tensorstore stores ``chunk_key_encoding`` as ``{"name": "default"}``,
    zarr-python writes the separator out: the same keys.  Each peer's edits of
    the other's sharded array through the view (attributes, resize,
    consolidation) map back, and the stored spelling is kept.  Before, the
    two spellings compared unequal and every such write was refused (EPERM)."""
    import tensorstore as ts

    shard = {"name": "sharding_indexed", "configuration": {
        "chunk_shape": [4, 4], "codecs": [{"name": "bytes", "configuration": {"endian": "little"}}],
        "index_codecs": [{"name": "bytes", "configuration": {"endian": "little"}}, {"name": "crc32c"}]}}
    seed = tmp_path / "seed"
    t = ts.open({"driver": "zarr3", "kvstore": {"driver": "file", "path": f"{seed}/g/ts/"}, "create": True,
                 "metadata": {"shape": [16, 16], "data_type": "uint16", "codecs": [shard],
                              "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": [8, 8]}}}}).result()
    data = np.arange(256, dtype="uint16").reshape(16, 16)
    t.write(data).result()
    (seed / "g" / "zarr.json").write_text(json.dumps({"zarr_format": 3, "node_type": "group", "attributes": {}}))
    zarr.create_array(str(seed / "g" / "zp"), shape=(16, 16), chunks=(4, 4), shards=(8, 8), dtype="uint16",
                      compressors=None, fill_value=0)[...] = data
    assert "configuration" not in _doc(seed / "g/ts/zarr.json")["chunk_key_encoding"]
    store.put_tree(seed / "g", "g")
    m = mount(store.source, extra=store.extra)
    a = zarr.open_array(str(m / "g/ts"), mode="r+")
    a.attrs["note"] = "by zarr-python"
    a.resize((24, 16))
    _consolidate(m / "g")
    view = f"{m / 'g/zp'}/"
    ts.open({"driver": "zarr3", "kvstore": {"driver": "file", "path": view}}).result().resize(
        exclusive_max=[24, 16]).result()
    assert "refused" not in m.log_text()
    m.umount()
    stored = json.loads(store.get("g/ts/zarr.json"))
    assert stored["chunk_key_encoding"] == {"name": "default"}
    assert stored["attributes"] == {"note": "by zarr-python"} and stored["shape"] == [24, 16]
    assert stored["codecs"][0]["name"] == "sharding_indexed"
    assert json.loads(store.get("g/zp/zarr.json"))["shape"] == [24, 16]
    root = store.local_copy(tmp_path / "copy")
    for name in ("ts", "zp"):
        got = ts.open({"driver": "zarr3", "kvstore": {"driver": "file", "path": f"{root}/g/{name}/"}}).result()
        np.testing.assert_array_equal(got[:16].read().result(), data, err_msg=name)
    members = _open_consolidated(root / "g").metadata.consolidated_metadata.metadata
    assert members["ts"].shards == (8, 8)


def _consolidated_on_a_local_mount(tmp_path, mount):
    """A local store holding the sharded hierarchy ``h``, mounted, and consolidated
    through the mount: (the store, the mount)."""
    root = tmp_path / "store"
    root.mkdir()
    local = tw.Store("local", root=root)
    _hierarchy(tmp_path / "seed", sharded=True)
    local.put_tree(tmp_path / "seed", "h")
    m = mount(local.source, extra=local.extra)
    _consolidate(m / "h")
    return local, m


def test_consolidated_members_renamed_away_keep_their_stored_entries(tmp_path, mount):
    """A group's zarr.json written through the mount (its attributes edited, the
    consolidated entries as the view showed them) while a member group is renamed away
    (local store, SEMANTICS 4.18): the absent members' entries have no stored document to
    map back to, and were stored as the view shows them, unsharded; once the member was
    back, zarr-python's consolidated read of it failed ("scripts/difftest.py --seed 10004
    --layout hier_rect --steps 30 --dirmv 40", op 26). An entry written as the view shows
    the group's stored entry keeps that stored entry, as a directory store would."""
    local, m = _consolidated_on_a_local_mount(tmp_path, mount)
    os.rename(m / "h/sub", m / "away")
    edit = _doc(m / "h/zarr.json")
    edit["attributes"] = {"k": 1}
    (m / "h/zarr.json").write_text(json.dumps(edit))
    assert _doc(m / "h/zarr.json") == edit
    os.rename(m / "away", m / "h/sub")
    assert _doc(m / "h/zarr.json") == edit
    m.umount()
    stored = json.loads(local.get("h/zarr.json"))["consolidated_metadata"]["metadata"]
    assert stored["sub/b"] == json.loads(local.get("h/sub/b/zarr.json"))
    _check_consolidated_store(local, tmp_path, {})


@pytest.mark.parametrize("edit_member", [False, True], ids=["group", "member"])
@pytest.mark.parametrize("how", SAVES)
def test_consolidated_members_renamed_away_keep_their_stored_entries_however_saved(tmp_path, mount, how,
                                                                                  edit_member):
    """The group's zarr.json written back however a tool saves it (in place, a temporary
    renamed over it, ``rm`` then a saved copy put back, an editor's save: renamed to
    ``~``, written anew, the ``~`` removed; ``truncate`` to 0 then written), its own
    attributes edited, or the entry of a member renamed away (attributes, fill value),
    while a member group is renamed away (local store, SEMANTICS 4.18).  The absent
    member's entry was stored as the view shows it (unsharded) after a removal or an
    emptying, or after any edit of that entry: once the member was back, zarr-python's
    consolidated read of the stored hierarchy failed.  Its entry now maps back onto the
    group's last stored entry of that member (remembered across the removal)."""
    local, m = _consolidated_on_a_local_mount(tmp_path, mount)
    stored_b = json.loads(local.get("h/zarr.json"))["consolidated_metadata"]["metadata"]["sub/b"]
    os.rename(m / "h/sub", m / "away")
    doc = m / "h/zarr.json"
    edit = _doc(doc)
    edit["attributes"] = {"k": 1}
    want_b = stored_b
    if edit_member:
        edit["consolidated_metadata"]["metadata"]["sub/b"]["attributes"] = {"units": "km"}
        edit["consolidated_metadata"]["metadata"]["sub/b"]["fill_value"] = 7.0
        want_b = {**stored_b, "attributes": {"units": "km"}, "fill_value": 7.0}
    save_as(doc, json.dumps(edit).encode(), how)
    assert _doc(doc) == edit
    os.rename(m / "away", m / "h/sub")
    assert _doc(doc) == edit
    g = _open_consolidated(m / "h")  # through the mount, the members back
    np.testing.assert_array_equal(g["sub/b"][...], SERIES)
    assert dict(g["sub/b"].attrs) == want_b["attributes"]
    m.umount()
    stored = json.loads(local.get("h/zarr.json"))
    assert stored["attributes"] == {"k": 1}
    assert stored["consolidated_metadata"]["metadata"]["sub/b"] == want_b
    _check_consolidated_store(local, tmp_path, {})
    g = _open_consolidated(local.local_copy(tmp_path / "again") / "h")
    assert dict(g["sub/b"].attrs) == want_b["attributes"] and g["sub/b"].fill_value == want_b["fill_value"]


def test_an_entry_of_a_member_renamed_away_that_cannot_be_mapped_back_is_stored_as_written(tmp_path, mount):
    """The entry of a member renamed away (SEMANTICS 4.18) edited where it lays the
    chunks out (the view's inner chunk shape): there is no stored array to refuse it
    for (a present one's would be refused, EPERM), and it cannot be mapped onto the
    group's stored entry: stored as written, as a directory store would store it,
    with one warning line."""
    local, m = _consolidated_on_a_local_mount(tmp_path, mount)
    os.rename(m / "h/sub", m / "away")
    edit = _doc(m / "h/zarr.json")
    edit["consolidated_metadata"]["metadata"]["sub/b"]["chunk_grid"]["configuration"]["chunk_shape"] = [2]
    os.unlink(m / "h/zarr.json")
    (m / "h/zarr.json").write_text(json.dumps(edit))
    assert _doc(m / "h/zarr.json") == edit
    os.rename(m / "away", m / "h/sub")
    m.umount()
    stored = json.loads(local.get("h/zarr.json"))["consolidated_metadata"]["metadata"]
    assert stored["sub/b"] == edit["consolidated_metadata"]["metadata"]["sub/b"]
    assert stored["arr"] == json.loads(local.get("h/arr/zarr.json"))  # (present: mapped back)
    lines = [line for line in m.log_text().splitlines() if "stored as written" in line]
    assert len(lines) == 1 and "'sub/b'" in lines[0] and "chunk_grid" in lines[0], lines


def test_a_group_removed_and_made_again_takes_no_entry_of_the_removed_one(tmp_path, mount):
    """The view remembers a group's document it removed (SEMANTICS 4.18), but not past
    the removal of its directory: a hierarchy copied out of the view, removed (``rm -r``)
    and copied back group document first (its members are new unsharded arrays, written
    after it) keeps its entries as written (unsharded), which describe those arrays;
    mapped onto the removed group's sharded entries, zarr-python's consolidated read of
    the store would fail."""
    local, m = _consolidated_on_a_local_mount(tmp_path, mount)
    shutil.copytree(m / "h", tmp_path / "backup")
    shutil.rmtree(m / "h")
    (m / "h").mkdir()
    shutil.copy(tmp_path / "backup/zarr.json", m / "h/zarr.json")
    for name in sorted(os.listdir(tmp_path / "backup")):
        if name != "zarr.json":
            shutil.copytree(tmp_path / "backup" / name, m / "h" / name)
    m.umount()
    stored = json.loads(local.get("h/zarr.json"))["consolidated_metadata"]["metadata"]
    assert stored["sub/b"] == json.loads(local.get("h/sub/b/zarr.json"))
    assert stored["sub/b"]["chunk_grid"]["configuration"]["chunk_shape"] == [3]
    g = _open_consolidated(local.local_copy(tmp_path / "copy") / "h")
    np.testing.assert_array_equal(g["arr"][...], DATA)
    np.testing.assert_array_equal(g["sub/b"][...], SERIES)
