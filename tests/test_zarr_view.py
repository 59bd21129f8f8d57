"""The Zarr view conformance suite (DESIGN.md section 2), through real mounts.

Every peer-written case (zarr-python 3.4, tensorstore, zarr-python 2.18's storage
transformer, and zarr-python hierarchies with consolidated metadata) is written sharded
and as its unsharded twin; the sharded store is mounted read-only and must equal the twin
file for file and byte for byte (``peers_zarr.compare_trees``).  Peers then read the
mounted view as ordinary unsharded arrays.  Listing semantics (sparse chunks, missing
shards, edge shards) and damaged input (bad checksum, truncation, offsets past the end,
half-empty entries, malformed or impossible metadata, a shard vanishing mid-listing) are
checked on hand-damaged copies.

Efficiency: all cases of one writer live in ONE store (each case under ``<case id>/``),
written once per session and mounted once per backend; assertions are parametrized per
case.  Every test runs once per backend (``local``, ``s3``): the ``source`` fixture is
the only place that knows how a local tree becomes a mountable source.
"""

from __future__ import annotations

import errno
import json
import math
import os
import re
import subprocess
import textwrap
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from functools import lru_cache
from pathlib import Path

import crc32c
import numpy as np
import pytest

from tests import peers_zarr as P
from tests.sources import BACKENDS, Source
from tests.conftest import ZSHARDFS, Mounted, run_mount

#: the conformance stores never change while mounted: long TTLs keep S3 round trips down
#: (the damage store is mounted with the defaults)
STATIC_OPTS = ("ro", "metadata_ttl=600", "index_ttl=600", "attr_timeout=600")

# --------------------------------------------------------------------------- the stores


def _under(cid: str, case: P.ZarrCase) -> P.ZarrCase:
    return case.with_(path=f"{cid}/{case.path}" if case.path else cid)


#: store name -> [(case id, case as written into the shared store)]
STORE_CASES: dict[str, list[tuple[str, P.ZarrCase]]] = {
    "zarr": [(i, _under(i, c)) for i, c in P.ZARR_CASES],
    "tensorstore": [(i, _under(i, c)) for i, c in P.TENSORSTORE_CASES],
    "zarr2": [(i, _under(i, c)) for i, c in P.ZARR2_CASES],
    "hierarchy": [(c.path, c) for c in P.HIERARCHY_CASES],
}
V3_STORES = ("zarr", "tensorstore", "hierarchy")
#: (store, case id, case) — the per-case parametrization (ALL_CASES + hierarchy)
CASES = [(s, i, c) for s, cases in STORE_CASES.items() for i, c in cases]
CASE_IDS = [f"{s}-{i}" for s, i, _ in CASES]
V3_CASES = [(s, i, c) for s, i, c in CASES if s in V3_STORES]
V3_IDS = [f"{s}-{i}" for s, i, _ in V3_CASES]
# what each peer can read of the view: a raw layout the peer itself cannot read
# is not a case for "the peer reads the view" (the twin comparison covers it)
ZARR_READABLE = [(s, i, c) for s, i, c in V3_CASES if not (c.raw and c.grid == "rectangular")]
TS_READABLE = [(s, i, c) for s, i, c in V3_CASES if not (c.raw and not P.tensorstore_supports(c))]
ZARR2_CASES = [(s, i, c) for s, i, c in CASES if s == "zarr2"]

assert {(w, i) for w, i, _ in P.ALL_CASES} == {(s, i) for s, i, _ in CASES if s != "hierarchy"}, \
    "every case of peers_zarr.ALL_CASES is covered (store names are the writer names)"


def _write_store(name: str, sroot: Path, troot: Path) -> dict[str, np.ndarray]:
    """Write every case of a store; returns case id -> data."""
    cases = STORE_CASES[name]
    if name == "zarr":
        datas = P.write_zarr_hierarchy([c for _, c in cases], sroot, troot, root_attributes={"store": "zarr"})
    elif name == "tensorstore":
        datas = {c.path: P.write_tensorstore(c, sroot, troot) for _, c in cases}
    elif name == "zarr2":
        datas = P.write_zarr2_hierarchy([c for _, c in cases], sroot, troot, root_attributes={"store": "zarr2"})
    else:
        datas = P.write_zarr_hierarchy([c for _, c in cases], sroot, troot, consolidated=True,
                                       root_attributes={"top": 1})
    return {i: datas[c.path] for i, c in cases}


@pytest.fixture(scope="session")
def stores(tmp_path_factory):
    """store name -> (sharded root, twin root, {case id: data}), written once per session."""
    base = tmp_path_factory.mktemp("zarr_view_stores")

    @lru_cache(maxsize=None)
    def get(name: str):
        sroot, troot = base / name / "sharded", base / name / "twin"
        if name == "damage":
            return sroot, troot, _write_damage_store(sroot, troot)
        return sroot, troot, _write_store(name, sroot, troot)

    return get


# --------------------------------------------------------------------------- backends, mounts


@pytest.fixture(scope="module", params=BACKENDS)
def backend(request):
    return request.param


@pytest.fixture(scope="module")
def source(backend, request, tmp_path_factory):
    src = Source(backend, request, tmp_path_factory.mktemp(f"zarr_view_src_{backend}"))
    yield src
    src.close()


@pytest.fixture(scope="module")
def mounted(source, stores, tmp_path_factory):
    """``mounted(store name) -> (Mounted, sharded root, twin root, datas)``: one read-only
    mount per store and backend, unmounted at module end; no daemon log may hold a
    traceback."""
    base = tmp_path_factory.mktemp(f"zarr_view_mnt_{source.backend}")
    made: dict[str, tuple] = {}

    def get(name: str):
        if name not in made:
            sroot, troot, datas = stores(name)
            src, extra, _ = source.publish(sroot, name)
            mnt, log = base / name, base / f"{name}.log"
            mnt.mkdir()
            opts = ("ro",) if name == "damage" else STATIC_OPTS
            run_mount(src, mnt, *opts, "log_level=INFO", log=log, extra=extra)
            made[name] = (Mounted(mnt, log, src), sroot, troot, datas)
        return made[name]

    yield get
    problems = []
    with ThreadPoolExecutor(len(made) or 1) as pool:
        list(pool.map(lambda m: m.umount(check=False), [m for m, *_ in made.values()]))
    for m, *_ in made.values():
        if "Traceback" in m.log_text():
            problems.append(f"daemon log of {m.path} has a traceback:\n{m.log_text()[-4000:]}")
    assert not problems, "\n".join(problems)


# --------------------------------------------------------------------------- 1. view == twin


def _diff_path(line: str) -> str:
    for head in ("only in view: ", "only in twin: "):
        if line.startswith(head):
            return line[len(head):]
    return line.split(":", 1)[0]


def _case_prefixes(store: str, case: P.ZarrCase) -> tuple[str, ...]:
    if store == "zarr2":
        return (f"data/root/{case.path}/", f"meta/root/{case.path}.array.json")
    return (f"{case.path}/",)


def _scan(root: Path, rel: str) -> tuple[list[str], list[str]]:
    dirs, files = [], []
    with os.scandir(root / rel) as it:
        for e in it:
            (dirs if e.is_dir(follow_symlinks=False) else files).append(f"{rel}/{e.name}" if rel else e.name)
    return dirs, files


def mirror(root: Path, dest: Path, threads: int = 16) -> None:
    """Copy the tree under ``root`` to ``dest``: the directory listings (scandir, what
    os.walk does) and the file reads run in parallel, which a FUSE mount serves
    concurrently."""
    dest.mkdir(parents=True)
    with ThreadPoolExecutor(threads) as pool:
        todo, copies = {pool.submit(_scan, root, "")}, []
        while todo:
            done, todo = wait(todo, return_when=FIRST_COMPLETED)
            for fut in done:
                dirs, files = fut.result()
                for d in dirs:
                    (dest / d).mkdir()
                    todo.add(pool.submit(_scan, root, d))
                copies += [pool.submit(lambda r: (dest / r).write_bytes((root / r).read_bytes()), f) for f in files]
        for fut in copies:
            fut.result()


@pytest.fixture(scope="module")
def tree_diff(mounted, tmp_path_factory):
    """store name -> (files of the view, compare_trees(view, twin)), once per store and
    backend, from parallel copies of all the mounted trees."""
    cache: dict[str, tuple[set[str], list[str]]] = {}
    base = tmp_path_factory.mktemp("zarr_view_copies")

    def one(name: str) -> tuple[set[str], list[str]]:
        m, _, troot, _ = mounted(name)
        mirror(m.path, base / name)
        return P.list_files(base / name), P.compare_trees(base / name, troot)

    def get(name: str) -> tuple[set[str], list[str]]:
        if not cache:
            for n in STORE_CASES:  # writers and mounts one at a time, then the copies at once
                mounted(n)
            with ThreadPoolExecutor(len(STORE_CASES)) as pool:
                cache.update(zip(STORE_CASES, pool.map(one, STORE_CASES)))
        return cache[name]

    return get


@pytest.mark.parametrize("store", list(STORE_CASES))
def test_whole_store_equals_twin(tree_diff, mounted, store):
    """Every file (groups, entry points, all arrays) equals the twin's, nothing extra."""
    files, diff = tree_diff(store)
    assert diff == []
    _, _, troot, _ = mounted(store)
    assert files == P.list_files(troot)


@pytest.mark.parametrize("store", list(STORE_CASES))
def test_documents_equal_the_twin_s_byte_for_byte(mounted, store):
    """Every metadata document of the view has the very bytes of the twin's, not
    only its JSON: a rewritten document keeps the stored one's layout (indent,
    separators, key order, final newline), so ``diff -r``, ``cmp`` and
    ``rsync --checksum`` against a twin written by the same peer find nothing.
    (Before, rewritten documents were always indented by 2 in the view's key
    order: every array document of tensorstore (compact, sorted keys) and
    zarr-python 2.18 (indented by 4, sorted keys) differed.)"""
    m, _, troot, _ = mounted(store)
    docs = sorted(f for f in P.list_files(troot) if P.is_metadata_name(f))
    assert docs
    differ = [f for f in docs if (m.path / f).read_bytes() != (troot / f).read_bytes()]
    assert differ == [], f"{len(differ)} of {len(docs)} documents differ, e.g. {differ[0]}:\n" \
        f"view: {(m.path / differ[0]).read_bytes()[:300]!r}\ntwin: {(troot / differ[0]).read_bytes()[:300]!r}"


@pytest.mark.parametrize("store,cid,case", CASES, ids=CASE_IDS)
def test_case_equals_twin(tree_diff, mounted, store, cid, case):
    m, sroot, troot, datas = mounted(store)
    files, diff = tree_diff(store)
    prefixes = _case_prefixes(store, case)
    assert [d for d in diff if _diff_path(d).startswith(prefixes)] == []
    # not vacuous: the case's metadata and chunk files are really there
    mine = {f for f in files if f.startswith(prefixes)}
    if store == "zarr2":
        want = {f"meta/root/{case.path}.array.json"} | {
            P.draft_chunk_key(case, c) for c in P.written_chunks(case, datas[cid])}
    else:
        want = {f"{case.path}/zarr.json"} | P.expected_chunk_keys(case, datas[cid])
    assert mine == want


# --------------------------------------------------------------------------- 2. peers read the view


def _zarr_read(root: Path, path: str):
    import zarr

    with zarr.config.set({"array.rectilinear_chunks": True}):
        arr = zarr.open_array(zarr.storage.LocalStore(root, read_only=True), path=path)
        return arr, arr[...]


@pytest.mark.filterwarnings("ignore")
@pytest.mark.parametrize("store,cid,case", ZARR_READABLE, ids=[f"{s}-{i}" for s, i, _ in ZARR_READABLE])
def test_zarr_python_reads_view(mounted, store, cid, case):
    m, sroot, _, datas = mounted(store)
    arr, got = _zarr_read(m.path, case.path)
    np.testing.assert_array_equal(got, datas[cid])
    assert got.dtype == np.dtype(case.dtype) and got.shape == tuple(case.shape)
    if not case.raw:  # an ordinary unsharded array of the inner chunk shape (nested: one level down)
        assert (arr.shards, arr.chunks) == ((tuple(case.chunks), tuple(case.nested)) if case.nested
                                            else (None, tuple(case.chunks)))
    if case.grid != "rectangular":  # zarr-python reads the sharded original the same
        _, original = _zarr_read(sroot, case.path)
        np.testing.assert_array_equal(got, original)


@pytest.mark.filterwarnings("ignore")
def test_zarr_python_reads_consolidated_hierarchy(mounted):
    """Through the rewritten consolidated metadata alone (no per-array zarr.json read)."""
    import zarr

    m, _, _, datas = mounted("hierarchy")
    group = zarr.open_group(zarr.storage.LocalStore(m.path, read_only=True), mode="r", use_consolidated=True)
    assert group.metadata.consolidated_metadata is not None
    for cid, case in STORE_CASES["hierarchy"]:
        if case.grid == "rectangular" and case.raw:
            continue
        arr = group[case.path]
        np.testing.assert_array_equal(arr[...], datas[cid])
        if not case.raw:
            assert (arr.shards or arr.chunks) == tuple(case.chunks)
    assert dict(group.attrs) == {"top": 1}


@pytest.mark.parametrize("store,cid,case", TS_READABLE, ids=[f"{s}-{i}" for s, i, _ in TS_READABLE])
def test_tensorstore_reads_view(mounted, store, cid, case):
    import tensorstore as ts

    m, _, _, datas = mounted(store)
    spec = {"driver": "zarr3", "kvstore": f"file://{m.path}/{case.path}/", "open": True}
    arr = ts.open(spec, read=True).result()
    np.testing.assert_array_equal(arr.read().result(), datas[cid])
    if not case.raw:
        codecs = arr.spec().to_json()["metadata"]["codecs"]
        assert codecs[0]["name"] != P.SHARDING or case.nested


ZARR2_READER = textwrap.dedent("""
    import json, sys
    import numpy as np, zarr, zarr.meta
    from zarr._storage.v3 import DirectoryStoreV3
    from zarr._storage.v3_storage_transformers import ShardingStorageTransformer

    def _decode(cls, meta):  # see peers_zarr2_script.py: the stock decoder imports pytest
        return ShardingStorageTransformer.from_config(meta["type"], meta.get("configuration", {}))

    zarr.meta.Metadata3._decode_storage_transformer_metadata = classmethod(_decode)
    view, original, paths, out = sys.argv[1:5]
    report = {}
    for i, path in enumerate(json.loads(paths)):
        a = zarr.open_array(DirectoryStoreV3(view), path=path, mode="r", zarr_version=3)
        b = zarr.open_array(DirectoryStoreV3(original), path=path, mode="r", zarr_version=3)
        np.save(f"{out}/{i}.npy", a[...])
        report[path] = {"transformed": a._transformed_chunk_store is not None, "chunks": list(a.chunks),
                        "same_as_original": bool(np.array_equal(a[...], b[...], equal_nan=a.dtype.kind == "f")),
                        "original_transformed": b._transformed_chunk_store is not None}
    print(json.dumps(report))
""")


@pytest.fixture(scope="module")
def zarr2_read(mounted, tmp_path_factory):
    """What zarr 2.18 reads from the mounted transformer store: path -> (values, report)."""
    if not P.zarr2_available():
        pytest.fail(f"the zarr 2.18 interpreter {P.ZARR2_PYTHON} is missing")
    m, sroot, _, _ = mounted("zarr2")
    out = tmp_path_factory.mktemp("zarr2_read")
    paths = [c.path for _, _, c in ZARR2_CASES]
    env = {**os.environ, "ZARR_V3_EXPERIMENTAL_API": "1", "ZARR_V3_SHARDING": "1"}
    proc = subprocess.run([str(P.ZARR2_PYTHON), "-c", ZARR2_READER, str(m.path), str(sroot), json.dumps(paths),
                           str(out)], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    return {p: (np.load(out / f"{i}.npy"), report[p]) for i, p in enumerate(paths)}


@pytest.mark.parametrize("store,cid,case", ZARR2_CASES, ids=[f"zarr2-{i}" for _, i, _ in ZARR2_CASES])
def test_zarr2_reads_view(zarr2_read, mounted, store, cid, case):
    _, _, _, datas = mounted("zarr2")
    values, report = zarr2_read[case.path]
    np.testing.assert_array_equal(values, datas[cid])
    assert report["same_as_original"]
    assert not report["transformed"] and report["original_transformed"]  # the view is unsharded
    assert report["chunks"] == list(case.chunks)


# --------------------------------------------------------------------------- 3. listing semantics


def _enoent(path: Path) -> bool:
    try:
        os.stat(path)
    except FileNotFoundError:
        return True
    return False


def _view_chunk_path(store: str, case: P.ZarrCase, coords) -> str:
    if store == "zarr2":
        return P.draft_chunk_key(case, coords)
    return f"{case.path}/{P.chunk_key(case, coords)}"


SHARDED_CASES = [(s, i, c) for s, i, c in CASES if not c.raw]


@pytest.mark.parametrize("store,cid,case", SHARDED_CASES, ids=[f"{s}-{i}" for s, i, _ in SHARDED_CASES])
def test_chunk_files_exist_exactly_when_stored(mounted, store, cid, case):
    """Stored inner chunks are files; missing chunks and missing shards are ENOENT;
    stat sizes equal the stored chunk sizes (index nbytes = the twin's chunk size)."""
    m, _, troot, datas = mounted(store)
    written = P.written_chunks(case, datas[cid])
    for coords in P.grid_coords(P.chunk_bounds(case)):
        rel = _view_chunk_path(store, case, coords)
        if coords in written:
            st = os.stat(m.path / rel)
            assert st.st_size == (troot / rel).stat().st_size, rel
            assert len((m.path / rel).read_bytes()) == st.st_size, rel
        else:
            assert _enoent(m.path / rel), rel


def _missing_kinds(case: P.ZarrCase, data) -> tuple[int, int]:
    """(chunks missing inside a stored shard, chunks whose whole shard is missing)."""
    written = P.written_chunks(case, data)
    stored_shards = {P.shard_of(case, c) for c in written}
    in_present = in_missing = 0
    for coords in P.grid_coords(P.chunk_bounds(case)):
        if coords not in written:
            if P.shard_of(case, coords) in stored_shards:
                in_present += 1
            else:
                in_missing += 1
    return in_present, in_missing


def test_sparse_cases_cover_both_kinds_of_absence(stores):
    """The ENOENT checks above are not vacuous: sparse cases miss chunks in present shards
    and whole shards, for every writer."""
    for store in ("zarr", "tensorstore", "zarr2"):
        _, _, datas = stores(store)
        kinds = [_missing_kinds(c, datas[i]) for i, c in STORE_CASES[store] if c.pattern == "sparse" and not c.raw]
        assert any(a for a, _ in kinds) and any(b for _, b in kinds), store


EDGE_CASES = [(s, i, c) for s, i, c in SHARDED_CASES if c.shape]


@pytest.mark.parametrize("store,cid,case", EDGE_CASES, ids=[f"{s}-{i}" for s, i, _ in EDGE_CASES])
def test_outside_inner_grid_is_enoent(mounted, store, cid, case):
    """Edge shards have index slots beyond the inner grid: no file there, even when the
    shard is stored (write_empty_chunks cases store every in-grid chunk)."""
    m, _, _, _ = mounted(store)
    counts = [math.ceil(n / k) for n, k in zip(case.shape, case.chunks)]
    checked = 0
    for d, n in enumerate(counts):
        for beyond in (n, n + 1):
            coords = tuple(beyond if e == d else 0 for e in range(len(counts)))
            assert _enoent(m.path / _view_chunk_path(store, case, coords)), coords
            checked += 1
    assert checked


def test_odd_names_are_enoent(mounted):
    m, _, _, _ = mounted("zarr")
    assert (m.path / "basic/arr/c/0").is_dir() and (m.path / "basic/arr/c/0/0").is_file()
    assert _errno_of(lambda: os.stat(m.path / "basic/arr/c/0/0/0")) == errno.ENOTDIR
    for rel in ("basic/arr/c/01/0", "basic/arr/c/+1/0", "basic/arr/c/-1/0", "basic/arr/c/ 1/0", "basic/arr/c/99/0",
                "basic/arr/c/99", "basic/arr/c0/0", "key_default_dot/arr/c.0", "key_default_dot/arr/c.0.0.0",
                "key_default_dot/arr/c.01.0", "key_v2_dot/arr/0.0.0", "key_v2_slash/arr/0/9", "key_v2_slash/arr/9/0",
                "0d/arr/0", "0d/arr/c0", "0d_v2_gzip/arr/c", "0d_v2_gzip/arr/0.0"):
        assert _enoent(m.path / rel), rel


# --------------------------------------------------------------------------- 4. damaged input

B = P.ZarrCase()  # (20, 12) in (4, 3) chunks, (8, 6) shards: 2x2 chunks per shard, crc32c index at the end
EDGE = B.with_(shape=(22, 13))  # shard (2, 2) holds in-grid chunks (4, 4), (5, 4) and out-of-grid slots
ONE_D = P.ZarrCase(shape=(2000,), dtype="uint8", chunks=(1,), shards=(100,), separator=".")

DAMAGE_CASES = {
    "ok": B, "other": B.with_(compressor="gzip"),
    "crc": B, "trunc": B, "trunc_start": B.with_(index_location="start"),
    "trunc_tail": B.with_(index_location="start"),
    "past": B, "half": B, "badjson": B, "baddiv": B, "badidx": B, "after": B,
    "slot": EDGE, "gone": ONE_D,
}


def _shard_index(raw: bytes, case: P.ZarrCase, n: int = 4) -> tuple[np.ndarray, int]:
    size = 16 * n + (4 if case.index_crc32c else 0)
    start = 0 if case.index_location == "start" else len(raw) - size
    return np.frombuffer(raw[start:start + 16 * n], "<u8").reshape(n, 2).copy(), start


def _with_index(raw: bytes, case: P.ZarrCase, table: np.ndarray) -> bytes:
    _, start = _shard_index(raw, case, len(table))
    body = table.astype("<u8").tobytes()
    crc = crc32c.crc32c(body).to_bytes(4, "little")
    return raw[:start] + body + crc + raw[start + len(body) + 4:]


def _edit_doc(path: Path, fn) -> None:
    doc = json.loads(path.read_text())
    fn(doc)
    path.write_text(json.dumps(doc, indent=2))


def _write_damage_store(sroot: Path, troot: Path) -> dict[str, np.ndarray]:
    """One zarr-python store with an array per kind of damage (under ``<kind>/arr``)."""
    cases = [c.with_(path=f"{k}/arr") for k, c in DAMAGE_CASES.items()]
    datas = P.write_zarr_hierarchy(cases, sroot, troot)
    shard = lambda k, key="c/0/0": sroot / k / "arr" / key  # noqa: E731

    raw = shard("crc").read_bytes()  # a flipped index bit, stale checksum
    table, start = _shard_index(raw, B)
    shard("crc").write_bytes(raw[:start] + bytes([raw[start] ^ 1]) + raw[start + 1:])

    for k in ("trunc", "trunc_start"):  # shorter than the index
        shard(k).write_bytes(shard(k).read_bytes()[:30])

    raw = shard("trunc_tail").read_bytes()  # index intact, the last chunk cut short
    table, _ = _shard_index(raw, DAMAGE_CASES["trunc_tail"])
    shard("trunc_tail").write_bytes(raw[:int(table[:, 0].max()) + 1])

    raw = shard("past").read_bytes()  # chunk (0, 1) ends past the end of the shard
    table, _ = _shard_index(raw, B)
    table[1, 1] = len(raw) + 1000
    shard("past").write_bytes(_with_index(raw, B, table))

    raw = shard("half").read_bytes()  # chunk (1, 0): offset empty, nbytes not
    table, _ = _shard_index(raw, B)
    table[2, 0] = P.EMPTY
    shard("half").write_bytes(_with_index(raw, B, table))

    (sroot / "badjson/arr/zarr.json").write_bytes(b'{"zarr_format": 3, "node_type": "array", "shape": [2')
    _edit_doc(sroot / "baddiv/arr/zarr.json",
              lambda d: d["codecs"][0]["configuration"].update(chunk_shape=[3, 3]))
    _edit_doc(sroot / "badidx/arr/zarr.json",
              lambda d: d["codecs"][0]["configuration"].update(index_codecs=[{"name": "frobnicate"}]))
    _edit_doc(sroot / "after/arr/zarr.json",
              lambda d: d["codecs"].append({"name": "gzip", "configuration": {"level": 1}}))

    raw = shard("slot", "c/2/2").read_bytes()  # out-of-grid slot (4, 5) points at chunk (4, 4)
    table, _ = _shard_index(raw, EDGE)
    assert (table[1] == P.EMPTY).all() and (table[0] != P.EMPTY).all()
    table[1] = table[0]
    shard("slot", "c/2/2").write_bytes(_with_index(raw, EDGE, table))
    return datas


def _log_lines(m: Mounted, needle: str) -> list[str]:
    return [line for line in m.log_text().splitlines() if needle in line and " INFO " not in line]


def _errno_of(fn) -> int | None:
    try:
        fn()
    except OSError as exc:
        return exc.errno
    return None


def _still_fine(m: Mounted, troot: Path, kind: str, good_chunk: str | None) -> None:
    """The daemon is up, another array and another chunk of the same array read fine."""
    for rel in ("ok/arr/c/0/0", "ok/arr/c/4/3", "other/arr/c/3/2"):
        assert P.normalize_gzip((m.path / rel).read_bytes()) == P.normalize_gzip((troot / rel).read_bytes()), rel
    if good_chunk:
        rel = f"{kind}/arr/{good_chunk}"
        assert (m.path / rel).read_bytes() == (troot / rel).read_bytes(), rel


def _exercise(m: Mounted, rels: list[str], kind: str) -> list[int | None]:
    """Each damaged file twice: stat, open+read, and a listing of the whole array."""
    out = []
    for _ in range(2):
        for rel in rels:
            out.append(_errno_of(lambda: os.stat(m.path / rel)))
            out.append(_errno_of(lambda: (m.path / rel).read_bytes()))
        for _d, _s, _f in os.walk(m.path / kind):
            pass
    return out


SHARD00 = ["c/0/0", "c/0/1", "c/1/0", "c/1/1"]


@pytest.mark.parametrize("kind", ["crc", "trunc", "trunc_start"])
def test_damaged_index_is_eio_for_its_shard(mounted, kind):
    m, _, troot, _ = mounted("damage")
    results = _exercise(m, [f"{kind}/arr/{c}" for c in SHARD00], kind)
    assert set(results) == {errno.EIO}, results
    # the rest of the array: listed and readable; the damaged shard's chunks are not listed
    listed = {f for f in P.list_files(m.path / kind / "arr")}
    twin = P.list_files(troot / kind / "arr")
    assert listed == twin - set(SHARD00)
    _still_fine(m, troot, kind, "c/2/0")
    assert len(_log_lines(m, f"{kind}/arr/c/0/0")) == 1, _log_lines(m, f"{kind}/arr")
    assert len(_log_lines(m, f"{kind}/arr")) == 1, _log_lines(m, f"{kind}/arr")


@pytest.mark.parametrize("kind,bad", [("past", "c/0/1"), ("half", "c/1/0"), ("trunc_tail", None)])
def test_damaged_index_entry_is_eio_for_that_chunk_only(mounted, kind, bad):
    m, sroot, troot, _ = mounted("damage")
    if bad is None:  # the chunk stored last in the truncated shard
        last = int(np.argmax(_shard_index((sroot / kind / "arr/c/0/0").read_bytes(), DAMAGE_CASES[kind])[0][:, 0]))
        bad = SHARD00[last]
    results = _exercise(m, [f"{kind}/arr/{bad}"], kind)
    # found, with size 0 (so that it can be removed or written over:
    # test_write.py::test_a_damaged_chunk_is_repaired_by_removing_or_overwriting_it); reading it is EIO
    assert results[0::2] == [None, None] and results[1::2] == [errno.EIO, errno.EIO], results
    assert os.stat(m.path / kind / "arr" / bad).st_size == 0
    for good in SHARD00:
        if good != bad:
            rel = f"{kind}/arr/{good}"
            assert os.stat(m.path / rel).st_size == (troot / rel).stat().st_size
            assert (m.path / rel).read_bytes() == (troot / rel).read_bytes(), rel
    listed = P.list_files(m.path / kind / "arr")
    assert listed == P.list_files(troot / kind / "arr") - {bad}
    _still_fine(m, troot, kind, "c/4/3")
    assert len(_log_lines(m, f"{kind}/arr")) == 1, _log_lines(m, f"{kind}/arr")


RAW_DOCS = {
    "badjson": "malformed JSON",
    "baddiv": "not a multiple",
    "badidx": "frobnicate",
    "after": "codecs",
}


@pytest.mark.parametrize("kind", list(RAW_DOCS))
def test_unusable_metadata_is_shown_raw_with_one_warning(mounted, kind):
    """Malformed JSON or impossible sharding options: the array directory passes through
    unchanged (document and shards, byte for byte), with one warning."""
    m, sroot, troot, _ = mounted("damage")
    for _ in range(3):
        assert (m.path / kind / "arr/zarr.json").read_bytes() == (sroot / kind / "arr/zarr.json").read_bytes()
        assert P.list_files(m.path / kind) == P.list_files(sroot / kind)
        for rel in P.list_files(sroot / kind):
            assert (m.path / kind / rel).read_bytes() == (sroot / kind / rel).read_bytes(), rel
    lines = _log_lines(m, f"{kind}/arr")
    assert len(lines) == 1, lines
    assert "WARNING" in lines[0] and RAW_DOCS[kind] in lines[0], lines
    _still_fine(m, troot, kind, None)


def test_stat_size_is_index_nbytes(mounted):
    """st_size of every chunk file is the nbytes of its index entry (parsed by hand)."""
    m, sroot, _, _ = mounted("damage")
    checked = 0
    for shard in ("c/0/0", "c/0/1", "c/2/1"):
        table, _ = _shard_index((sroot / "other/arr" / shard).read_bytes(), B)
        r, c = (int(x) for x in shard.split("/")[1:])
        for i, (_, nbytes) in enumerate(table.tolist()):
            rel = f"other/arr/c/{2 * r + i // 2}/{2 * c + i % 2}"
            if nbytes == P.EMPTY:  # row 5 of the edge shard: outside the 5x4 inner grid
                assert _enoent(m.path / rel), rel
                continue
            assert os.stat(m.path / rel).st_size == nbytes, rel
            checked += 1
    assert checked == 10


def test_occupied_slot_outside_the_grid_is_not_a_file(mounted):
    """Edge shard c/2/2 of a (22, 13) array has an index entry for inner chunk (4, 5),
    outside the 6x5 inner grid: not listed, ENOENT, and no complaint."""
    m, _, troot, _ = mounted("damage")
    assert _enoent(m.path / "slot/arr/c/4/5")
    assert P.list_files(m.path / "slot") == P.list_files(troot / "slot")
    assert (m.path / "slot/arr/c/4/4").read_bytes() == (troot / "slot/arr/c/4/4").read_bytes()
    assert _log_lines(m, "slot/arr") == []


def test_shard_vanishing_mid_listing(mounted, source):
    """A shard deleted while its directory is being listed: the listing finishes without
    its chunks (no error), they are ENOENT afterwards, everything else stays readable."""
    m, sroot, troot, _ = mounted("damage")
    d = m.path / "gone/arr"
    names = []
    with os.scandir(d) as it:
        for entry in it:
            names.append(entry.name)
            if len(names) == 10:
                source.delete("damage", "gone/arr/c.15")
    want = P.list_files(troot / "gone/arr") - {f"c.{i}" for i in range(1500, 1600)}
    assert "c.0" in names and set(names) == want, sorted(set(names) ^ want)[:10]
    assert _enoent(d / "c.1550")
    assert (d / "c.1600").read_bytes() == (troot / "gone/arr/c.1600").read_bytes()
    _still_fine(m, troot, "gone", "c.1499")
    assert len(_log_lines(m, "gone/arr")) <= 1


def _fsck(src: str, *args: str, extra: list[str] = ()) -> tuple[int, dict]:
    result = subprocess.run([*ZSHARDFS, "fsck", src, "--json", *args, *extra], capture_output=True, text=True,
                            timeout=300)
    assert result.returncode in (0, 1), (result.returncode, result.stderr)
    assert "Traceback" not in result.stderr, result.stderr
    return result.returncode, json.loads(result.stdout)


DAMAGED_KINDS = ["crc", "trunc", "trunc_start", "past", "half", "trunc_tail", *RAW_DOCS]


def test_fsck_reports_what_a_mount_logs(stores, source, mount):
    """``zshardfs fsck`` walks the view unmounted and reports, in the mount's
    own words, what a mount of the same store logs when it is listed: every
    damaged index and every document it could not use, and nothing about
    the intact arrays.  Its counts are those of a walk of the mount."""
    sroot, _, _ = stores("damage")
    src, extra, _ = source.publish(sroot)
    code, report = _fsck(src, extra=extra)
    assert code == 1, report
    problems = report["problems"]
    for kind in DAMAGED_KINDS:
        assert any(f"{kind}/arr" in p for p in problems), (kind, problems)
    assert not [p for p in problems if re.search(r"\b(ok|other|slot)/", p)], problems

    m = mount(src, "ro", "log_level=INFO", extra=extra)
    dirs = files = 0
    for _, ds, fs in os.walk(m.path):
        dirs, files = dirs + len(ds), files + len(fs)
    logged = [(g.group(1), g.group(2)) for line in m.log_text().splitlines()
              if (g := re.search(r" (WARNING|ERROR|CRITICAL) zshardfs[\w.]*: (.*)$", line))]
    assert sorted(problems) == sorted({text for _, text in logged}), (problems, logged)
    # errors are the damage (a mount's ERROR lines); the rest is shown as stored (WARNING)
    assert report["errors"] == len({text for level, text in logged if level != "WARNING"}) > 0, report
    assert (report["directories"], report["files"]) == (dirs + 1, files)
    assert report["chunk_files"] > 0 and report["bytes_read"] == 0

    # an intact part alone: nothing to report, exit 0; --data reads every byte
    code, clean = _fsck(f"{src}/other", "--data", extra=extra)
    assert (code, clean["problems"], clean["errors"]) == (0, [], 0)
    assert clean["bytes_read"] == sum(p.stat().st_size for p in (m.path / "other").rglob("*") if p.is_file())


def test_fsck_command_line_errors(tmp_path):
    """A missing source, a bad option, an unreachable S3 endpoint: one line, no
    traceback, exit 1 or 2."""
    env = dict(os.environ, AWS_ACCESS_KEY_ID="testing", AWS_SECRET_ACCESS_KEY="testing")
    for args, code in (([str(tmp_path / "missing")], 1), ([str(tmp_path), "-o", "bogus=1"], 2),
                       ([str(tmp_path), "-o", "timeout=0"], 2), (["s3://"], 1),
                       (["s3://bucket/p", "--endpoint-url", "http://127.0.0.1:1", "-o", "timeout=5"], 1)):
        result = subprocess.run([*ZSHARDFS, "fsck", *args], capture_output=True, text=True, timeout=60, env=env)
        assert result.returncode == code, (args, result)
        assert len(result.stderr.strip().splitlines()) == 1 and "Traceback" not in result.stderr, result.stderr
    result = subprocess.run([*ZSHARDFS, "fsck", str(tmp_path)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0 and "0 problems" in result.stdout, result


def test_fsck_ends_on_loops_and_deep_trees(tmp_path, monkeypatch):
    """A symlink loop in a local store ends the walk: where the view passes
    names through it is a link (counted as a file, never followed, never
    read, no problem); where the view derives names (an array's chunk-key
    directory) it is left out, one problem line.  A tree deeper than
    fsck.MAX_DEPTH is reported, not entered: the walk always ends, and never
    by a Python stack overflow."""
    import trio
    import zarr

    from zshardfs import fsck
    from zshardfs.config import MountConfig
    from zshardfs.daemon import build_view, open_backend

    (tmp_path / "loop/a").mkdir(parents=True)
    (tmp_path / "loop/a/up").symlink_to("..")
    (tmp_path / "loop/a/self").symlink_to(".")
    (tmp_path / "loop/a/f.txt").write_text("x")
    code, report = _fsck(str(tmp_path / "loop"), "--data")
    assert code == 0 and report["problems"] == [], report
    assert (report["directories"], report["files"], report["bytes_read"]) == (2, 3, 1), report
    zarr.create_array(str(tmp_path / "loop/arr"), shape=(4, 4), chunks=(2, 2), shards=(4, 4), dtype="u1")
    (tmp_path / "loop/arr/c").symlink_to(".")
    code, report = _fsck(str(tmp_path / "loop"))
    assert code == 1 and len(report["problems"]) == 1, report
    assert "arr/c: a symbolic link (-> '.') where the view derives" in report["problems"][0], report

    deep = tmp_path / "deep"
    (deep / "/".join("d" * 6)).mkdir(parents=True)
    assert fsck.MAX_DEPTH == 256  # (SEMANTICS 6.5 names it; made 3 below to keep the tree small)
    monkeypatch.setattr(fsck, "MAX_DEPTH", 3)
    cfg = MountConfig(source=str(deep), mountpoint="")
    found = trio.run(lambda: fsck.check(build_view(cfg, open_backend(cfg))))
    assert found.directories == 4 and found.problems == ["d/d/d: more than 3 levels deep (a symlink loop?); "
                                                         "not checked below"], found


def test_damage_left_no_traceback(mounted):
    m, _, _, _ = mounted("damage")
    assert "Traceback" not in m.log_text()
    assert re.search(r"ERROR|WARNING", m.log_text())


# --------------------------------------------------------------------------- logs


@pytest.mark.parametrize("store", list(STORE_CASES))
def test_conformance_logs_are_quiet(mounted, store):
    """After everything above, a mount of intact stores logged warnings only for the
    arrays shown raw on purpose (codecs around sharding_indexed), one line each."""
    m, _, _, _ = mounted(store)
    raw = {c.path for _, c in STORE_CASES[store] if c.raw and c.sharded}
    lines = [line for line in m.log_text().splitlines() if " INFO " not in line]
    for line in lines:
        assert " WARNING " in line and "shown raw" in line and any(p in line for p in raw), line
    for path in raw:
        assert len([line for line in lines if f"{path}/zarr.json" in line]) == 1, path


def _daemon_rss_mb(m, field: str = "VmRSS") -> float:
    """The daemon's resident memory now (VmHWM: at its peak), in MiB."""
    pid = int(os.getxattr(m.path, "user.zshardfs.pid"))
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":")) / 1024


def test_hostile_metadata_is_shown_raw_and_costs_nothing(mount, tmp_path):
    """A few hundred bytes of metadata must not cost gigabytes, tracebacks
    or EIO: a regular grid of 10**9 shards is computed, not listed (a
    sparse array costs what is stored); a shard of 2*10**12 inner chunks,
    a variable grid of 10**10 edges, a configuration given as a list, and
    a document nested 100000 deep, and 2**64 - 1 chunks along one
    dimension (a legal shape; a traceback and EIO before) are shown as stored, each with one
    warning, and their directories stay readable."""
    import time

    import zarr  # (this module's other tests run the peers in their own processes)

    src = tmp_path / "store"
    base = tmp_path / "base"
    zarr.create_array(str(base), shape=(4, 6), chunks=(1, 3), shards=(1, 6), dtype="uint8", fill_value=0,
                      compressors=None)[:] = 7
    doc = json.loads((base / "zarr.json").read_bytes())
    shard = (base / "c/0/0").read_bytes()

    def array(name, edit):
        d = json.loads(json.dumps(doc))
        edit(d)
        (src / name).mkdir(parents=True)
        (src / name / "zarr.json").write_text(json.dumps(d))
        (src / name / "c/0").mkdir(parents=True)
        (src / name / "c/0/0").write_bytes(shard)

    array("huge", lambda d: d.update(shape=[10**9, 6]))
    array("absurd", lambda d: d["chunk_grid"]["configuration"].update(chunk_shape=[10**12, 6]))
    array("runs", lambda d: d.update(chunk_grid={"name": "rectilinear", "configuration": {
        "kind": "inline", "chunk_shapes": [[[1, 10**10]], [6]]}}))
    array("listconf", lambda d: d["codecs"][0].update(configuration=[1, 2]))
    array("beyond", lambda d: d.update(shape=[2**64 - 1, 6]))  # legal, but 2**64 - 1 chunks along one edge
    (src / "plain").mkdir()
    (src / "plain/info").write_text("[" * 100_000 + "]" * 100_000)
    (src / "plain/readme.txt").write_text("fine")

    m = mount(src, "ro")
    rss = _daemon_rss_mb(m)
    t0 = time.monotonic()
    assert json.loads((m.path / "huge/zarr.json").read_bytes())["shape"] == [10**9, 6]
    assert os.listdir(m.path / "huge/c") == ["0"]
    assert sorted(os.listdir(m.path / "huge/c/0")) == ["0", "1"]
    assert (m.path / "huge/c/0/1").read_bytes() == b"\x07" * 3
    assert zarr.open_array(str(m.path / "huge"), mode="r")[0, :].tolist() == [7] * 6
    for name in ("absurd", "runs", "listconf", "beyond"):
        assert (m.path / name / "zarr.json").read_bytes() == (src / name / "zarr.json").read_bytes(), name
        assert (m.path / name / "c/0/0").read_bytes() == shard, name
    assert (m.path / "plain/readme.txt").read_text() == "fine"
    assert os.listdir(m.path / "plain") in (["info", "readme.txt"], ["readme.txt", "info"])
    assert time.monotonic() - t0 < 20
    assert _daemon_rss_mb(m) - rss < 200
    log = m.log_text()
    assert os.listdir(m.path / "beyond/c") == ["0"]
    for name in ("absurd", "runs", "listconf", "beyond", "plain/info"):
        assert len([line for line in log.splitlines() if f"{name}" in line and "WARNING" in line]) == 1, (name, log)
    assert "Traceback" not in log and "ERROR" not in log


def test_huge_metadata_documents_are_not_read(mount, tmp_path):
    """A metadata document over 64 MiB (a stray 1 GiB ``info``, a 100 MiB
    ``zarr.json``) is never read by the probes of its directory: listing
    stays quick and the daemon small, the file is shown as stored (its
    bytes readable), its directory is not a dataset, one warning names it,
    and an ordinary array beside it is served as usual."""
    import time

    import zarr

    src = tmp_path / "store"
    (src / "stray").mkdir(parents=True)
    with open(src / "stray/info", "wb") as f:  # sparse: costs no disk
        f.truncate(1 << 30)
    (src / "stray/notes.txt").write_text("fine")
    (src / "bloated/c/0").mkdir(parents=True)
    with open(src / "bloated/zarr.json", "wb") as f:
        f.write(b'{"zarr_format": 3, "node_type": "array"}')
        f.truncate(100 << 20)
    (src / "bloated/c/0/0").write_bytes(b"stored as is")
    zarr.create_array(str(src / "ok"), shape=(4, 6), chunks=(1, 3), shards=(1, 6), dtype="uint8", fill_value=0,
                      compressors=None)[:] = 7

    m = mount(src, "ro")
    peak = _daemon_rss_mb(m, "VmHWM")
    t0 = time.monotonic()
    assert sorted(os.listdir(m.path)) == ["bloated", "ok", "stray"]
    assert sorted(os.listdir(m.path / "stray")) == ["info", "notes.txt"]
    assert sorted(os.listdir(m.path / "bloated")) == ["c", "zarr.json"]
    assert os.stat(m.path / "stray/info").st_size == 1 << 30
    assert os.stat(m.path / "bloated/zarr.json").st_size == 100 << 20
    with open(m.path / "bloated/zarr.json", "rb") as f:
        assert f.read(16) == b'{"zarr_format": '
    assert (m.path / "bloated/c/0/0").read_bytes() == b"stored as is"  # a plain file: no dataset here
    assert (m.path / "stray/notes.txt").read_text() == "fine"
    assert sorted(os.listdir(m.path / "ok/c/0")) == ["0", "1"]
    assert zarr.open_array(str(m.path / "ok"), mode="r")[:].tolist() == [[7] * 6] * 4
    assert time.monotonic() - t0 < 10
    assert _daemon_rss_mb(m, "VmHWM") - peak < 100  # the most it ever held: nothing was read whole
    log = m.log_text()
    for name in ("stray/info", "bloated/zarr.json"):
        lines = [line for line in log.splitlines() if name in line and "WARNING" in line]
        assert len(lines) == 1 and "64 MiB" in lines[0], (name, log)
    assert "Traceback" not in log and "ERROR" not in log


def test_documents_shown_are_not_kept_once_the_view_is_gone(tmp_path):
    """The sharded array documents a view showed were remembered, as stored,
    in a table of the module (zarr_sharding._shown): shared by every view of
    the process (tests mount several), keyed by store key alone (two stores'
    ``a/zarr.json`` were one entry), kept after the view was gone, up to 16
    MiB for the life of the daemon, and read only by a fallback the view
    never takes (it reads the members' stored documents when consolidated
    metadata is written back: accept_document_async).  Nothing of them is
    kept now once the view is dropped (10 documents of 1 MiB read here: 10
    MiB stayed)."""
    import gc
    import tracemalloc

    import trio

    from tests.handmade_zarr import array_doc, write_array_doc
    from zshardfs.backends.local import LocalBackend
    from zshardfs.config import MountConfig
    from zshardfs.daemon import build_view

    for i in range(10):
        doc = array_doc((8, 8), (4, 4), (2, 2))
        doc["attributes"] = {"blob": "x" * (1 << 20)}
        write_array_doc(tmp_path / f"a{i}", doc)

    async def main(view):
        for i in range(10):
            node = await view.resolve(f"a{i}/zarr.json")
            assert json.loads(node.document)["attributes"]["blob"] == "x" * (1 << 20)

    tracemalloc.start()
    try:
        view = build_view(MountConfig(source=str(tmp_path), mountpoint=str(tmp_path) + "-mnt"),
                          LocalBackend(str(tmp_path)))
        trio.run(main, view)
        view.store.close()
        del view
        gc.collect()
        kept, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert kept < 2 << 20, kept


def test_rewritten_documents_kept_are_bounded_by_bytes(tmp_path):
    """The view keeps the documents it rewrote (keyed by version, so never
    stale) within a byte budget, not only a count: arrays whose
    ``zarr.json`` carry megabytes of attributes, listed one after another,
    must not each stay in memory for an hour (40 of 4 MiB kept 160 MiB)."""
    import trio

    from tests.handmade_zarr import array_doc, write_array_doc
    from zshardfs.backends.local import LocalBackend
    from zshardfs.config import MountConfig
    from zshardfs.daemon import build_view

    for i in range(10):
        doc = array_doc((8, 8), (4, 4), (2, 2))
        doc["attributes"] = {"blob": "x" * (1 << 20)}
        write_array_doc(tmp_path / f"a{i}", doc)
    view = build_view(MountConfig(source=str(tmp_path), mountpoint=str(tmp_path) + "-mnt"),
                      LocalBackend(str(tmp_path)))
    view.documents.max_bytes = 4 << 20  # (the budget of a mount is 64 MiB)

    async def main():
        async for array in view.listdir(await view.resolve("")):
            names = [child.name async for child in view.listdir(array)]
            assert "zarr.json" in names
            node = await view.lookup(array, "zarr.json")
            assert json.loads(node.document)["attributes"]["blob"] == "x" * (1 << 20)

    trio.run(main)
    kept = [v[0] for v in view.documents._d.values() if v[0] is not None]
    assert sum(map(len, kept)) <= 4 << 20
    assert len(kept) >= 2  # (and it still keeps what fits)


def _on_threads(monkeypatch, owner, name: str) -> list[int]:
    """Thread ids ``owner.name`` (a function or method) is called on, from now on."""
    import threading

    calls, real = [], getattr(owner, name)

    def recorded(*args, **kwargs):
        calls.append(threading.get_ident())
        return real(*args, **kwargs)

    monkeypatch.setattr(owner, name, recorded)
    return calls


def test_large_indexes_are_parsed_and_encoded_beside_the_loop(tmp_path, monkeypatch):
    """A shard index of 32768 chunks (512 KiB, crc32c) is checked and
    parsed, and a shard of that extent encoded by a flush, in a worker
    thread even when it holds one small chunk: the work is the index's (4.16)."""
    import threading

    import trio

    from zshardfs.backends.base import AsyncStore
    from zshardfs.backends.local import LocalBackend
    from zshardfs.layouts.zarr_common import ZarrShardFormat
    from zshardfs.shards import ShardCache
    from zshardfs.writeback import WriteBack

    fmt, extent = ZarrShardFormat("end", "little", checksum=True), (32, 32, 32)
    (tmp_path / "c").write_bytes(fmt.encode({7: b"chunk"}, extent))
    parsed = _on_threads(monkeypatch, ZarrShardFormat, "parse_index")
    encoded = _on_threads(monkeypatch, ZarrShardFormat, "encode")
    store = AsyncStore(LocalBackend(str(tmp_path)))

    async def main():
        writeback = WriteBack(store, ShardCache(store))
        writeback.put("c", fmt, extent, 9, b"more")
        await writeback.flush("c")
        return await fmt.load_index(store, "c", extent)

    index = trio.run(main)
    assert parsed and encoded and threading.get_ident() not in parsed + encoded, (parsed, encoded)
    assert index.locate_now(7) == (0, 5) and index.locate_now(9) == (5, 4)
    assert index._damaged is not None  # (the masks listings use: made there too)


def test_a_large_document_is_parsed_beside_the_loop_when_probed(tmp_path, monkeypatch):
    """Probing a directory whose zarr.json is large (a group with 3 MB of
    consolidated metadata) parses it in a worker thread (4.16), and once
    per version of it."""
    import threading

    import trio

    from zshardfs.config import MountConfig
    from zshardfs.daemon import build_view, open_backend

    member = {"zarr_format": 3, "node_type": "array", "shape": [10], "data_type": "uint8",
              "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": [10]}},
              "chunk_key_encoding": {"name": "default"}, "fill_value": 0, "codecs": [{"name": "bytes"}],
              "attributes": {}}
    (tmp_path / "g").mkdir()
    (tmp_path / "g" / "zarr.json").write_text(json.dumps({
        "zarr_format": 3, "node_type": "group", "attributes": {},
        "consolidated_metadata": {"kind": "inline", "must_understand": False,
                                  "metadata": {f"a{i}": member for i in range(10000)}}}))
    assert (tmp_path / "g" / "zarr.json").stat().st_size > 1 << 20
    parsed, loads = [], json.loads

    def recorded(data, *args, **kwargs):
        if len(data) > 1 << 20:
            parsed.append(threading.get_ident())
        return loads(data, *args, **kwargs)

    monkeypatch.setattr(json, "loads", recorded)
    cfg = MountConfig(source=str(tmp_path), mountpoint="")
    view = build_view(cfg, open_backend(cfg))
    assert trio.run(view.dataset_at, "g") is None
    assert parsed and threading.get_ident() not in parsed, parsed
    # asked again after metadata_ttl, unchanged: not parsed again (json.loads
    # holds the GIL in its thread too, so the loop would stop each time)
    first = len(parsed)
    view.datasets.pop("g")
    assert trio.run(view.dataset_at, "g") is None
    assert len(parsed) == first, parsed
    doc = json.loads((tmp_path / "g" / "zarr.json").read_text())
    doc["attributes"] = {"changed": True}
    (tmp_path / "g" / "zarr.json").write_text(json.dumps(doc))
    view.datasets.pop("g")
    assert trio.run(view.dataset_at, "g") is None
    assert len(parsed) > first  # a new version is parsed


def test_a_large_rewritten_document_is_shown_compact(tmp_path, mount):
    """A rewritten document longer than 1 MiB (a consolidated zarr.json of
    many arrays) is shown compact, and equal as JSON to what indenting would
    give (Python's indenting encoder is pure Python: seconds for tens of MiB,
    holding the interpreter); small documents keep their stored layout
    (indented here)."""
    sharded = {"zarr_format": 3, "node_type": "array", "shape": [100], "data_type": "uint8",
               "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": [50]}},
               "chunk_key_encoding": {"name": "default"}, "fill_value": 0,
               "codecs": [{"name": "sharding_indexed", "configuration": {
                   "chunk_shape": [10], "codecs": [{"name": "bytes"}],
                   "index_codecs": [{"name": "bytes", "configuration": {"endian": "little"}}, {"name": "crc32c"}],
                   "index_location": "end"}}],
               "attributes": {}}
    (tmp_path / "g" / "a0").mkdir(parents=True)
    (tmp_path / "g" / "a0" / "zarr.json").write_text(json.dumps(sharded, indent=2))
    (tmp_path / "g" / "zarr.json").write_text(json.dumps({
        "zarr_format": 3, "node_type": "group", "attributes": {},
        "consolidated_metadata": {"kind": "inline", "must_understand": False,
                                  "metadata": {f"a{i}": sharded for i in range(8000)}}}))
    m = mount(tmp_path, "ro")
    small = (m / "g" / "a0" / "zarr.json").read_bytes()
    assert small.startswith(b'{\n  "'), small[:40]
    member = json.loads(small)
    assert member["chunk_grid"]["configuration"]["chunk_shape"] == [10]
    big = (m / "g" / "zarr.json").read_bytes()
    assert len(big) > 1 << 20 and b"\n" not in big, big[:80]
    assert os.stat(m / "g" / "zarr.json").st_size == len(big)
    doc = json.loads(big)
    members = doc["consolidated_metadata"]["metadata"]
    assert len(members) == 8000 and all(v == member for v in members.values())


def test_a_chunk_directory_is_listed_a_shard_at_a_time(tmp_path):
    """The view hands a chunk directory's listing on a shard's slice at a
    time (one list each, which READDIR takes in one async step), not an
    entry at a time: two nested generator steps per entry were a good part
    of a warm listing's cost.  The lists flattened are the listing."""
    import trio

    from tests.handmade_zarr import array_doc, write_array_doc, write_shard
    from zshardfs.backends.local import LocalBackend
    from zshardfs.config import MountConfig
    from zshardfs.daemon import build_view

    root = tmp_path / "a"
    write_array_doc(root, array_doc((2, 16), (2, 8), (1, 1)))
    write_shard(root, (0, 0), (2, 8), {i: bytes([i]) for i in range(16)})
    write_shard(root, (0, 1), (2, 8), {i: bytes([i]) for i in range(0, 16, 2)})
    view = build_view(MountConfig(source=str(tmp_path), mountpoint=str(tmp_path) + "-mnt"),
                      LocalBackend(str(tmp_path)))

    async def main():
        row = await view.resolve("a/c/1")
        batches = [[c.name for c in batch] async for batch in view.listdir_batches(row)]
        assert batches == [[str(i) for i in range(8)], [str(i) for i in range(8, 16, 2)]]
        assert [c.name async for c in view.listdir(row)] == [n for b in batches for n in b]
        assert [[c.name for c in b] async for b in view.listdir_batches(await view.resolve("a/c"))] == [["0", "1"]]

    trio.run(main)


def test_a_chunk_directory_listing_works_out_each_shards_key_once(tmp_path):
    """A listing of a chunk directory spanning several shards needs each
    shard's storage key and extent for three things (loading the indexes
    together, read-ahead's note of the listing, the shard's slice): it works
    them out once per shard, not once for each (three times: about a sixth
    of a warm walk's listing CPU, scripts/list_cpu.py).  The listing is the
    same, and a directory outside the grid lists nothing."""
    import trio

    from tests.handmade_zarr import array_doc, write_array_doc, write_shard
    from zshardfs.backends.local import LocalBackend
    from zshardfs.config import MountConfig
    from zshardfs.daemon import build_view

    root = tmp_path / "a"
    write_array_doc(root, array_doc((2, 24), (2, 8), (1, 1)))
    for s in range(3):
        write_shard(root, (0, s), (2, 8), {i: bytes([i]) for i in range(s, 16, 2)})
    view = build_view(MountConfig(source=str(tmp_path), mountpoint=str(tmp_path) + "-mnt"),
                      LocalBackend(str(tmp_path)))

    async def main():
        dataset = await view.dataset_at("a")
        asked = []
        where = dataset._shard_where
        dataset._shard_where = lambda shard: asked.append(shard) or where(shard)
        row = await view.resolve("a/c/1")
        names = [c.name async for c in view.listdir(row)]
        assert names == [str(i) for i in (0, 2, 4, 6, 9, 11, 13, 15, 16, 18, 20, 22)]
        assert sorted(asked) == [(0, 0), (0, 1), (0, 2)]
        assert [c.name async for c in view.listdir(await view.resolve("a/c"))] == ["0", "1"]
        assert [e async for e in dataset.listdir(("c", "5"))] == []

    trio.run(main)


async def _replaced_rewritten_damaged_restored(shard, size, store, key: str) -> None:
    """The changes the two event-loop index tests below make to the one shard
    of _one_shard_view_counting_threaded between lookups (``size()``: chunk
    a/c/1/3's size as the view finds it): replaced by rename, rewritten in
    place, damaged (EIO), restored; each must be seen, none through a thread."""
    import pytest

    from tests.handmade_zarr import shard_bytes
    from zshardfs.backends.base import CorruptData

    tmp = shard.with_name("new")
    tmp.write_bytes(shard_bytes((2, 8), {i: b"xy" for i in range(16)}))
    os.replace(tmp, shard)  # replaced by rename
    assert await size() == 2
    with open(shard, "r+b") as f:  # rewritten in place (the same inode)
        f.write(shard_bytes((2, 8), {i: b"xyz" for i in range(16)}))
    assert await size() == 3
    assert key not in store.in_thread, store.in_thread
    damaged = bytearray(shard_bytes((2, 8), {i: b"xyzw" for i in range(16)}))
    damaged[-5] ^= 1  # (the last entry's nbytes: the index's checksum no longer matches)
    shard.write_bytes(bytes(damaged))
    with pytest.raises(CorruptData):
        await size()
    shard.write_bytes(shard_bytes((2, 8), {i: b"xyzw" for i in range(16)}))
    assert await size() == 4


def _one_shard_view_counting_threaded(tmp_path, method: str, metadata_ttl: float):
    """(shard path, backend, view) of a local array ``a`` of one 2x8 shard of
    1x1 chunks, read-only, ``index_ttl`` 0.05 s, whose backend records in
    ``in_thread`` the key of each call of ``method`` (``get``, ``stat``): the
    calls that went to a worker thread rather than the event loop."""
    from tests.handmade_zarr import array_doc, write_array_doc, write_shard
    from zshardfs.backends.local import LocalBackend
    from zshardfs.config import MountConfig
    from zshardfs.daemon import build_view

    class Threaded(LocalBackend):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.in_thread: list[str] = []

    def counted(self, key, *args, **kwargs):
        self.in_thread.append(key)
        return getattr(LocalBackend, method)(self, key, *args, **kwargs)

    setattr(Threaded, method, counted)
    root = tmp_path / "a"
    write_array_doc(root, array_doc((2, 8), (2, 8), (1, 1)))
    shard = write_shard(root, (0, 0), (2, 8), {i: bytes([i]) for i in range(16)})
    store = Threaded(str(tmp_path))
    view = build_view(MountConfig(source=str(tmp_path), mountpoint=str(tmp_path) + "-mnt", read_only=True,
                                  metadata_ttl=metadata_ttl, index_ttl=0.05), store)
    return shard, store, view


def test_a_cached_shards_index_loads_without_a_thread_and_changes_are_still_seen(tmp_path):
    """On a local store, loading a shard's index (the first lookup in each
    shard) read it in a worker thread even when its pages were cached: a
    thread hop of 0.4-0.7 ms, most of the lookup.  It is now read on the
    event loop when the paths and bytes are all cached (openat2
    RESOLVE_CACHED, preadv2 RWF_NOWAIT), with the checks the thread makes:
    a shard replaced by rename, or rewritten in place, between two lookups is
    seen; a damaged one is still damage; a removed one is gone."""
    import trio

    shard, store, view = _one_shard_view_counting_threaded(tmp_path, "get", metadata_ttl=0.05)
    key = "a/c/0/0"

    async def size() -> int | None:
        await trio.sleep(0.1)  # (past index_ttl: the next lookup validates the index)
        if shard.is_file():
            shard.read_bytes()  # (its pages cached, as they are moments after a write)
        node = await view.resolve("a/c/1/3")
        return None if node is None else node.size

    async def main():
        assert await size() == 1
        assert key not in store.in_thread, store.in_thread
        await _replaced_rewritten_damaged_restored(shard, size, store, key)
        assert key not in store.in_thread, store.in_thread  # (the damaged version's load too)
        shard.unlink()
        assert await size() is None
        os.mkfifo(shard)  # (not opened on the event loop, where its open could wait: no such shard)
        assert await size() is None

    trio.run(main)


def test_a_cached_shards_revalidation_needs_no_thread_and_changes_are_still_seen(tmp_path):
    """After ``index_ttl`` a lookup validates its shard's cached index again
    (a stat of the shard: on bench_read's store 8 per warm pass).  On a
    local store that stat went to a worker thread even when the kernel had
    the shard's path and inode cached (about 140 us of CPU more per
    validation, scripts/lookup_cpu.py --revalidate).  It is now answered on
    the event loop from those caches (LocalBackend.stat_nowait), and what the
    thread's answer showed still shows: a shard replaced by rename or
    rewritten in place since is loaded again, damage in the new version is
    still damage, a removed shard is gone, a FIFO in its place is no shard."""
    import trio

    shard, store, view = _one_shard_view_counting_threaded(tmp_path, "stat", metadata_ttl=3600)
    key = "a/c/0/0"

    async def main():
        row = await view.resolve("a/c/1")  # (held, as the kernel holds its inode)

        async def size() -> int | None:
            await trio.sleep(0.1)  # (past index_ttl: the lookup validates the index)
            if shard.is_file():
                shard.read_bytes()  # (its pages cached, as they are moments after a write)
            node = await view.lookup(row, "3")
            return None if node is None else node.size

        assert await size() == 1
        heads = store.counters["head"]
        assert await size() == 1
        assert store.counters["head"] == heads + 1  # (validated: asked again)
        assert key not in store.in_thread, store.in_thread
        await _replaced_rewritten_damaged_restored(shard, size, store, key)
        assert key not in store.in_thread, store.in_thread
        shard.unlink()
        assert await size() is None  # (not found from the caches: the thread says so)
        os.mkfifo(shard)  # (never opened on the event loop, where its open could wait: no such shard)
        assert await size() is None

    trio.run(main)


def test_listing_an_unchanged_chunk_directory_again_makes_no_nodes(tmp_path):
    """A warm walk lists every directory again after the TTLs; where a
    shard's index is the same version (validated, not reloaded) the view
    gives the very nodes of the last listing instead of making them again,
    and a shard another client replaced is listed as it is now."""
    import trio

    from tests.handmade_zarr import array_doc, write_array_doc, write_shard
    from zshardfs.backends.local import LocalBackend
    from zshardfs.config import MountConfig
    from zshardfs.daemon import build_view

    root = tmp_path / "a"
    write_array_doc(root, array_doc((2, 16), (2, 8), (1, 1)))
    write_shard(root, (0, 0), (2, 8), {i: bytes([i]) for i in range(16)})
    shard = write_shard(root, (0, 1), (2, 8), {i: bytes([i]) for i in range(16)})
    view = build_view(MountConfig(source=str(tmp_path), mountpoint=str(tmp_path) + "-mnt", metadata_ttl=0.05,
                                 index_ttl=0.05),
                      LocalBackend(str(tmp_path)))

    async def main():
        row = await view.resolve("a/c/1")
        first = [c async for c in view.listdir(row)]
        await trio.sleep(0.1)  # (past the TTLs: the indexes are validated again)
        again = [c async for c in view.listdir(row)]
        assert [c.name for c in again] == [str(i) for i in range(16)]
        assert all(a is b for a, b in zip(first, again))
        # another client stores the second shard anew, with fewer chunks
        mtime = shard.stat().st_mtime_ns
        write_shard(root, (0, 1), (2, 8), {i: b"xy" for i in range(8, 16, 2)})
        os.utime(shard, ns=(mtime + 10**9, mtime + 10**9))
        await trio.sleep(0.1)
        now = [c async for c in view.listdir(row)]
        assert [c.name for c in now] == [str(i) for i in range(8)] + [str(i) for i in range(8, 16, 2)]
        assert all(a is b for a, b in zip(first[:8], now[:8]))
        assert [c.size for c in now[8:]] == [2, 2, 2, 2]

    trio.run(main)


def test_fsck_data_reads_the_ends_of_a_huge_plain_file(tmp_path):
    """A plain file (passed through as stored) that another client made a sparse 1 TiB
    file, here a group's zarr.json: ``fsck --data`` reads its first 64 MiB and its last
    piece, not a TiB of zeros (before: it did not end within the minute), and reports
    it as the mount shows it."""
    (tmp_path / "g").mkdir()
    (tmp_path / "g/zarr.json").write_bytes(b'{"zarr_format": 3, "node_type": "group"}')
    os.truncate(tmp_path / "g/zarr.json", 1 << 40)
    (tmp_path / "notes.txt").write_bytes(b"x" * 100)
    result = subprocess.run([*ZSHARDFS, "fsck", str(tmp_path), "--data", "--json"], capture_output=True, text=True,
                            timeout=60)
    assert result.returncode in (0, 1) and "Traceback" not in result.stderr, result
    report = json.loads(result.stdout)
    assert report["errors"] == 0, report
    assert report["bytes_read"] <= (64 << 20) + (8 << 20) + 100, report
