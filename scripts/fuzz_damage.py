#!/usr/bin/env python
"""Damage fuzzer: random damage to good stores of every layout, mounted, walked and read.

Why: SEMANTICS section 5 promises that damaged input (bad checksums, truncated shards,
offsets past the end, malformed or hostile metadata) gives EIO/ENOENT or the part shown
as stored, one log line per damaged object, never a traceback, a crash or a hang, and
that the rest of the store reads as before. The suite checks hand-picked cases; this
draws the damage at random.

For each seed it copies a good store of LAYOUT (built once by the peers in tests/, kept
in --cache, where runs at once sharing it build it once, under a lock; without it, built
into a directory of the run's own), damages 1-3 of its objects (bit flips and byte runs in shard indexes,
minishard indexes and data, truncation, zero-length and extended files, a file where a
directory is expected and the reverse, metadata JSON made malformed or given wrong types
and values), then mounts it read-only and read-write (``-o timeout=5``) and, in a child
process with a deadline, walks it and reads every file. It checks:

- every system call ends within PER_CALL_LIMIT with success or an acceptable errno:
  EIO (damaged data), ENOENT (a name the damage took away), ENOTDIR (a file where a
  directory was); anything else (EINVAL, EPERM, ENOTCONN, ...) is a finding;
- the walk ends within WALK_DEADLINE (a hang is a finding) and the daemon is alive
  after it (the mount root still answers), and ``zshardfs umount`` succeeds;
- the daemon's log has no ``Traceback`` and at most LINES_PER_DAMAGE warning/error
  lines per damaged object beyond those of the good store (a damaged metadata document
  counts each shard it describes: they may now fail their own checks, each logged once);
- every file the damage cannot reach (its shard, metadata and directories undamaged:
  chunk files are traced to the shard files holding their bytes, precomputed ones
  through the sharding spec) reads exactly as in the good store, and every directory
  the damage cannot reach lists the same names;
- in the read-write mount, writes (with fsync) to up to 3 such chunk files succeed and
  read back; writes to up to 2 chunk files the damage made EIO end with success, EIO or
  ENOENT, change no file that read before, and when they fail leave their shard as
  stored (local stores);
- ``zshardfs fsck --data`` of the damaged store ends in time, with 0 or 1, no traceback.

With ``--backend s3`` the stores are copied to buckets of a moto server (tests/s3server.py).

With ``--live`` (SEMANTICS 5.8) the damage is made under a live mount instead: a good copy
is mounted (ro, then rw) with TTLs of LIVE_TTL, read whole (caches warm), damaged underneath
(the kinds above, plus files and directories removed, a directory replaced by a file, and
locally a file made a sparse 1 TiB one, its last bytes moved to the new end and its first
bytes flipped or not, so indexes at either end declare ranges inside the file), read at once (old bytes, new bytes, or an error),
read again past the TTLs (as a fresh mount of the damaged store reads it, or an error;
writes; the daemon's peak memory and bytes read bounded), then the good copy is put back
and everything must read as before, without a remount.

  .venv/bin/python scripts/fuzz_damage.py --layout zarr --seeds 0-49
  .venv/bin/python scripts/fuzz_damage.py --layout all --seeds 7     # one seed, every layout
  .venv/bin/python scripts/fuzz_damage.py --live --layout zarr --seeds 0-9 [--backend s3]

Each finding prints a replay line (``--layout L --seeds N``: the same damage, drawn
from the seed) and the damage applied. Exit 0: no finding; 1: findings.
"""

from __future__ import annotations

import argparse
import atexit
import errno
import fcntl
import hashlib
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

ZSHARDFS = [sys.executable, "-m", "zshardfs.cli"]
ACCEPTABLE = {errno.EIO, errno.ENOENT, errno.ENOTDIR}
PER_CALL_LIMIT = 15.0  # seconds: the mount's timeout (5) plus slack for a loaded machine
WALK_DEADLINE = 120.0
LINES_PER_DAMAGE = 2  # (the promise is one, 5.2; every run so far logged at most one)
HUGE_READ = 1 << 30  # a walk reads the first and last MiB of a file larger than this, not all of it
LAYOUTS = ("zarr", "zarr2", "pc_volume", "pc_kv")
METADATA_NAMES = ("zarr.json", "info")


# ------------------------------------------------------------------ good stores


def _build_zarr(dst: Path) -> None:
    from tests import peers_zarr as pz
    b = pz.ZarrCase()
    cases = [
        b.with_(path="a/basic"),
        b.with_(path="a/start_be_gzip", index_location="start", index_endian="big", index_crc32c=False,
                compressor="gzip", pattern="sparse"),
        b.with_(path="b/rectilinear", grid="rectilinear", shards=((8, 4, 8), 6), index_crc32c=False),
        b.with_(path="b/rectangular", grid="rectangular", shards=((8, 8, 4), (6, 6)), compressor="gzip"),
        pz.ZarrCase(path="nested", shape=(20, 12), chunks=(4, 6), nested=(2, 3), shards=(8, 12)),
        b.with_(path="dot_v2", key_encoding="v2", separator=".", index_endian="big"),
    ]
    twin = dst.parent / (dst.name + "-twin")
    pz.write_zarr_hierarchy(cases, dst, twin, consolidated=True)
    shutil.rmtree(twin)


def _build_zarr2(dst: Path) -> None:
    from tests import peers_zarr as pz
    z = pz.ZarrCase(index_crc32c=False)
    cases = [z.with_(path="arr"), z.with_(path="g/gz", separator=".", compressor="gzip", pattern="sparse"),
             z.with_(path="g/three", shape=(6, 8, 10), chunks=(2, 4, 5), shards=(4, 8, 10))]
    twin = dst.parent / (dst.name + "-twin")
    pz.write_zarr2_hierarchy(cases, dst, twin)
    shutil.rmtree(twin)


def _build_pc_volume(dst: Path) -> None:
    from tests import peers_precomputed as pp
    tmp = dst.parent / (dst.name + "-tmp")
    for case in pp.VOLUME_CASES[:3]:
        twins = pp.write_volume_twins(tmp, case)
        shutil.copytree(twins.sharded, dst / case.name)
    shutil.rmtree(tmp)


def _build_pc_kv(dst: Path) -> None:
    from tests import peers_precomputed as pp
    tmp = dst.parent / (dst.name + "-tmp")
    for name, spec in list(pp.KV_SHARDINGS.items())[:2]:
        twins = pp.write_kv_twins(tmp, name, spec)
        shutil.copytree(twins.sharded, dst / name)
    meshes = {cid: pp.make_mesh(cid, [2, 1]) for cid in (1, 5, 9, 2**40 + 1, 77)}
    twins = pp.write_mesh_twins(tmp / "mesh", pp.sharding("murmurhash3_x86_128", 0, 1, 1, "gzip", "raw"), meshes)
    shutil.copytree(twins.sharded, dst / "mesh")
    shutil.rmtree(tmp)


BUILDERS = {"zarr": _build_zarr, "zarr2": _build_zarr2, "pc_volume": _build_pc_volume, "pc_kv": _build_pc_kv}


def good_store(cache: Path, layout: str) -> Path:
    """The good store of ``layout``, built once into ``cache``: under an exclusive lock of
    ``cache/LAYOUT.lock``, so that runs at once sharing a ``--cache`` build it once (the others
    wait for it) instead of into one another."""
    path = cache / layout
    done = cache / f"{layout}.complete"
    if done.exists():
        return path
    cache.mkdir(parents=True, exist_ok=True)
    with open(cache / f"{layout}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # (released when closed, also by a run that dies)
        if not done.exists():
            shutil.rmtree(path, ignore_errors=True)
            shutil.rmtree(cache / (layout + "-twin"), ignore_errors=True)
            shutil.rmtree(cache / (layout + "-tmp"), ignore_errors=True)
            path.mkdir(parents=True)
            BUILDERS[layout](path)
            done.write_text("")
    return path


def storage_files(root: Path) -> dict[str, bytes]:
    out = {}
    for dirpath, _, files in os.walk(root):
        for f in files:
            p = Path(dirpath) / f
            rel = p.relative_to(root).as_posix()
            out[rel] = p.read_bytes()
    return out


# ------------------------------------------------------------------ walking (child process)


def walk(root: str, writes: list[str], seed: int, probe: list[str] = (), bad_writes: list = ()) -> dict:
    """Walk and read everything below ``root``, then the names in ``probe`` the walk did
    not meet (the good store's files: damage may leave them out of listings); then
    write ``writes`` (rw mounts), then ``bad_writes`` ([rel, size]: chunks the damage made
    unreadable), then read again every file that read before.
    Returns {"files": {rel: sha|-errno}, "dirs": {rel: [names]|-errno}, "slow": [...],
    "writes": {rel: "ok"|error}, "bad_writes": {rel: "ok"|-errno}, "changed": [rel, ...]}."""
    files: dict[str, object] = {}
    dirs: dict[str, object] = {}
    slow: list = []

    def timed(what, fn, *a):
        t = time.monotonic()
        try:
            return fn(*a)
        finally:
            dt = time.monotonic() - t
            if dt > PER_CALL_LIMIT:
                slow.append([what, round(dt, 1)])

    def read_all(path):
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
        try:
            parts = []
            while True:
                b = os.read(fd, 1 << 20)
                if not b:
                    return b"".join(parts)
                parts.append(b)
        finally:
            os.close(fd)

    def read_ends(path, size):
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
        try:
            return os.pread(fd, 1 << 20, 0) + os.pread(fd, 1 << 20, size - (1 << 20))
        finally:
            os.close(fd)

    def list_one(rel):
        path = os.path.join(root, rel) if rel else root
        try:
            names = sorted(timed(f"listdir {rel}", os.listdir, path))
        except OSError as e:
            dirs[rel] = -e.errno
            return
        dirs[rel] = names
        for n in names:
            r = f"{rel}/{n}" if rel else n
            p = os.path.join(root, r)
            try:
                st = timed(f"lstat {r}", os.lstat, p)
            except OSError as e:
                files[r] = -e.errno
                continue
            if os.path.stat.S_ISDIR(st.st_mode):
                todo.append(r)
                continue
            read_one(r, p, st)

    def read_one(r, p, st):
        if st.st_size > HUGE_READ:  # (a sparse huge file shown as stored: its ends, not a TiB of zeros)
            try:
                data = timed(f"read ends {r}", read_ends, p, st.st_size)
                files[r] = f"huge {st.st_size} " + hashlib.sha256(data).hexdigest()
            except OSError as e:
                files[r] = -e.errno
            return
        try:
            data = timed(f"read {r}", read_all, p)
            files[r] = hashlib.sha256(data).hexdigest()
            if len(data) != st.st_size:
                files[r] = f"size {st.st_size} but read {len(data)}"
        except OSError as e:
            files[r] = -e.errno

    todo = [""]
    while todo:
        list_one(todo.pop())
    for r in probe:
        if r not in files:
            p = os.path.join(root, r)
            try:
                st = timed(f"stat {r}", os.stat, p)
                read_one(r, p, st) if not os.path.stat.S_ISDIR(st.st_mode) else None
            except OSError as e:
                files[r] = -e.errno
    done = {}
    rng = random.Random(seed)
    for r in writes:
        p = os.path.join(root, r)
        try:
            size = os.stat(p).st_size
            new = bytes(rng.randrange(256) for _ in range(size))
            fd = timed(f"open-w {r}", os.open, p, os.O_WRONLY | os.O_TRUNC)
            try:
                timed(f"write {r}", os.write, fd, new)
                timed(f"fsync {r}", os.fsync, fd)
            finally:
                os.close(fd)
            back = timed(f"reread {r}", read_all, p)
            done[r] = "ok" if back == new else f"read back {len(back)} bytes, not the {len(new)} written"
        except OSError as e:
            done[r] = f"{errno.errorcode.get(e.errno, e.errno)}: {e.strerror}"
    bad_done: dict[str, object] = {}
    for r, size in bad_writes:
        p = os.path.join(root, r)
        new = bytes(rng.randrange(256) for _ in range(size))
        try:
            fd = timed(f"open-w {r}", os.open, p, os.O_WRONLY | os.O_TRUNC)
            try:
                timed(f"write {r}", os.write, fd, new)
                timed(f"fsync {r}", os.fsync, fd)
            finally:
                timed(f"close {r}", os.close, fd)
            bad_done[r] = "ok"
        except OSError as e:
            bad_done[r] = -e.errno
    changed = []
    if bad_writes:
        for r, v in sorted(files.items()):
            if isinstance(v, str) and not v.startswith(("size", "huge")) and r not in done and r not in bad_done:
                try:
                    now = hashlib.sha256(timed(f"read again {r}", read_all, os.path.join(root, r))).hexdigest()
                except OSError as e:
                    now = -e.errno
                if now != v:
                    changed.append(r)
    return {"files": files, "dirs": dirs, "slow": slow, "writes": done, "bad_writes": bad_done,
            "changed": changed}


def walk_in_child(mnt: Path, writes: list[str], seed: int, probe: list[str], bad_writes: list = ()) -> dict | str:
    """``walk`` in a child process; a string says why it gave no answer (a hang)."""
    out = mnt.parent / (mnt.name + ".walk.json")
    job = json.dumps({"root": str(mnt), "writes": writes, "seed": seed, "out": str(out), "probe": probe,
                      "bad_writes": list(bad_writes)})
    proc = subprocess.Popen([sys.executable, __file__, "--walk-job", job])
    try:
        rc = proc.wait(timeout=WALK_DEADLINE)
    except subprocess.TimeoutExpired:
        return f"walk did not end within {WALK_DEADLINE:.0f} s (a hang)"
    finally:
        if proc.poll() is None:  # (a hang, or this run interrupted)
            proc.kill()
            try:
                proc.wait(timeout=30)  # (a walker stuck in a FUSE call dies once the mount goes)
            except subprocess.TimeoutExpired:
                pass
    if rc != 0:
        return f"walker exited {rc}"
    return json.loads(out.read_text())


# ------------------------------------------------------------------ damage


HOSTILE = [-1, 0, 1, -(2**63), 2**64, 2**64 + 1, 10**30, 1e308, float("nan"), float("inf"), "x", "", None,
           True, [], {}, [0], [-1, -1], [2**63, 1], {"name": "sharding_indexed"},
           [{"name": "sharding_indexed", "configuration": {"chunk_shape": [0], "codecs": [], "index_codecs": []}}],
           [[[[[[[[]]]]]]]], "neuroglancer_uint64_sharded_v1", {"@type": 5}, [1.5, 2.5]]


# Keys whose values the formats give meaning to (Zarr v3, the v3 draft, precomputed):
# "targeted" damage picks one of these, and a value hostile for its kind.
TARGETS = {"shape", "chunk_shape", "chunk_shapes", "chunks_per_shard", "data_type", "fill_value", "codecs",
           "index_codecs", "index_location", "endian", "separator", "name", "node_type", "zarr_format",
           "configuration", "level", "storage_transformers", "compressor", "dimension_names", "kind",
           "size", "chunk_sizes", "voxel_offset", "resolution", "encoding", "key", "sharding", "preshift_bits",
           "minishard_bits", "shard_bits", "hash", "minishard_index_encoding", "data_encoding", "@type",
           "num_channels", "type", "scales", "mesh", "skeletons", "vertex_quantization_bits",
           "lod_scale_multiplier", "chunk_key_encoding", "chunk_grid", "consolidated_metadata", "metadata",
           "chunk_memory_layout", "metadata_key_suffix", "compressed_segmentation_block_size"}


def _hostile_for(rng: random.Random, old):
    """A value of the same kind as ``old`` that makes no sense, or one of another kind."""
    if rng.random() < 0.2:
        return rng.choice(HOSTILE)
    if isinstance(old, bool) or old is None:
        return rng.choice([not old, 0, "true", None])
    if isinstance(old, int):
        return rng.choice([-1, 0, 1, 63, 64, 65, 2**31, 2**53 + 1, 2**64, 10**30, 1.5, float("nan"),
                           float("inf"), str(old), True, -old - 1, old * 2**20])
    if isinstance(old, float):
        return rng.choice([0.0, -1.0, float("nan"), float("inf"), -float("inf"), 1e308, 1e-308, "1.0"])
    if isinstance(old, str):
        return rng.choice(["", "x", "gzip", "raw", "identity", "murmurhash3_x86_128", "big", "start", "end",
                           "sharding_indexed", "bytes", "crc32c", "v2", "default", "/", "..", ".", "../..",
                           "a/b", "\x00", "int64", "float32", "uint8", "bool", "array", "group", old * 1000, 5])
    if isinstance(old, list):
        n = len(old)
        if all(isinstance(x, int) and not isinstance(x, bool) for x in old) and n:
            return rng.choice([[], [0] * n, [-1] * n, [2**62] * n, [2**64] * n, [1] * (n + 1), [1] * max(0, n - 1),
                               [1.5] * n, ["x"] * n, [None] * n, [[1]] * n, [2**31] * n, [65] * n])
        return rng.choice([[], old * 2, old[:1], old[::-1], [old], [None], [{}], ["x"], old + old[-1:] * 50])
    if isinstance(old, dict):
        return rng.choice([{}, [], None, {k: None for k in old}, {**old, "name": "x"},
                           {**old, "configuration": {}}, "x"])
    return rng.choice(HOSTILE)


def _json_paths(doc, here=()):
    yield here
    if isinstance(doc, dict):
        for k, v in doc.items():
            yield from _json_paths(v, here + (k,))
    elif isinstance(doc, list):
        for i, v in enumerate(doc):
            yield from _json_paths(v, here + (i,))


def _set(doc, path, value):
    if not path:
        return value
    node = doc
    for p in path[:-1]:
        node = node[p]
    node[path[-1]] = value
    return doc


def damage_json(rng: random.Random, data: bytes) -> tuple[bytes, str]:
    """A hostile version of a JSON document: malformed text, or valid JSON with wrong
    types and values somewhere in it."""
    kind = rng.choice(["malformed", "value", "value", "targeted", "targeted", "targeted", "delete",
                       "duplicate_list", "nested_sharding"])
    try:
        doc = json.loads(data)
    except ValueError:  # (damaged already)
        kind = "malformed"
    if kind == "malformed":
        cut = rng.randrange(len(data) + 1)
        return data[:cut] + rng.choice([b"", b"{", b"]", b"\x00", b"\xff\xfe", b'"']), f"malformed json cut at {cut}"
    paths = list(_json_paths(doc))
    if kind == "delete":
        paths = [p for p in paths if p and isinstance(p[-1], str)]
        if paths:
            p = rng.choice(paths)
            node = doc
            for k in p[:-1]:
                node = node[k]
            del node[p[-1]]
            return json.dumps(doc).encode(), f"json delete {list(p)}"
        kind = "value"
    if kind == "duplicate_list":
        lists = [p for p in paths if isinstance(_get(doc, p), list) and _get(doc, p)]
        if lists:
            p = rng.choice(lists)
            v = _get(doc, p)
            _set(doc, p, v * rng.choice([2, 1000]) if len(v) < 10 else v[:1])
            return json.dumps(doc).encode(), f"json list {list(p)} resized"
        kind = "value"
    if kind == "nested_sharding":
        codecs = [p for p in paths if p and p[-1] == "codecs"]
        if codecs:
            p = rng.choice(codecs)
            bad = {"name": "sharding_indexed", "configuration": {
                "chunk_shape": rng.choice([[0, 0], [-4, 3], [2**40, 1], [1], "x", [3, 5]]),
                "codecs": rng.choice([[], [{"name": "sharding_indexed"}], _get(doc, p)]),
                "index_codecs": rng.choice([[], [{"name": "bytes"}], [{"name": "crc32c"}]]),
                "index_location": rng.choice(["end", "start", "middle", 3])}}
            _set(doc, p, [bad] + (_get(doc, p) if rng.random() < 0.5 else []))
            return json.dumps(doc).encode(), f"json nested sharding at {list(p)}: {json.dumps(bad)}"
        kind = "value"
    if kind == "targeted":
        keyed = [p for p in paths if p and p[-1] in TARGETS]
        if keyed:
            p = rng.choice(keyed)
            v = _hostile_for(rng, _get(doc, p))
            doc = _set(doc, p, v)
            return json.dumps(doc).encode(), f"json {list(p)} = {json.dumps(v)[:80]}"
    p = rng.choice(paths[1:] or paths)
    v = rng.choice(HOSTILE)
    old = _get(doc, p)
    if isinstance(old, (int, float)) and not isinstance(old, bool) and rng.random() < 0.5:
        v = rng.choice([-old - 1, old * 1000, old + 1, -1, 0, 2**63])
    doc = _set(doc, p, v)
    return json.dumps(doc).encode(), f"json {list(p)} = {json.dumps(v)[:80]}"


def _get(doc, path):
    for p in path:
        doc = doc[p]
    return doc


def damage_bytes(rng: random.Random, data: bytes) -> tuple[bytes, str]:
    """Bit flips or a byte run in the head (shard/minishard index at the start), the
    tail (index at the end) or anywhere; truncation; garbage appended; zero length."""
    n = len(data)
    kind = rng.choice(["flip", "flip", "run", "run", "truncate", "extend", "empty"])
    if kind == "empty" or n == 0:
        return b"", "zero length"
    if kind == "truncate":
        cut = rng.choice([rng.randrange(n), n - 1, max(0, n - 16), rng.randrange(min(n, 64))])
        return data[:cut], f"truncated to {cut} of {n}"
    if kind == "extend":
        extra = bytes(rng.randrange(256) for _ in range(rng.choice([1, 8, 16, 100])))
        return data + extra, f"{len(extra)} bytes appended"
    region = rng.choice(["head", "tail", "any"])
    lo, hi = {"head": (0, min(n, 96)), "tail": (max(0, n - 96), n), "any": (0, n)}[region]
    buf = bytearray(data)
    if kind == "flip":
        bits = sorted(rng.randrange(lo * 8, hi * 8) for _ in range(rng.choice([1, 1, 2, 8])))
        for b in bits:
            buf[b // 8] ^= 1 << (b % 8)
        return bytes(buf), f"bits {bits} flipped ({region})"
    start = rng.randrange(lo, hi)
    length = min(rng.choice([1, 4, 8, 16, 32]), n - start)
    fill = rng.choice(["00", "ff", "random"])
    buf[start:start + length] = (bytes(rng.randrange(256) for _ in range(length)) if fill == "random"
                                 else bytes.fromhex(fill) * length)
    return bytes(buf), f"bytes {start}..{start + length} set to {fill} ({region})"


def is_metadata(rel: str) -> bool:
    name = rel.rsplit("/", 1)[-1]
    return name in METADATA_NAMES or name.endswith(".array.json") or name.endswith(".group.json")


def apply_damage(rng: random.Random, store: Path, files: dict[str, bytes]) -> list[dict]:
    """Damage 1-3 objects of ``store``; each: {"path", "what", "kind": file|tree}."""
    done: list[dict] = []
    names = sorted(files)
    meta = [r for r in names if is_metadata(r)]
    data = [r for r in names if not is_metadata(r)]
    for _ in range(rng.choice([1, 1, 2, 3])):
        choice = rng.random()
        if choice < 0.3 and meta:
            rel = rng.choice(meta)
            if not (store / rel).is_file():
                continue
            new, what = damage_json(rng, (store / rel).read_bytes())
            (store / rel).write_bytes(new)
            done.append({"path": rel, "what": what, "kind": "file"})
        elif choice < 0.85 and data:
            rel = rng.choice(data)
            if not (store / rel).is_file():
                continue
            new, what = damage_bytes(rng, (store / rel).read_bytes())
            (store / rel).write_bytes(new)
            done.append({"path": rel, "what": what, "kind": "file"})
        elif choice < 0.93:
            rel = rng.choice(names)  # a directory where a file is expected
            if not (store / rel).is_file():
                continue
            (store / rel).unlink()
            (store / rel).mkdir()
            if rng.random() < 0.5:
                (store / rel / "x").write_bytes(b"junk")
            done.append({"path": rel, "what": "replaced by a directory", "kind": "file"})
        else:
            dirs = sorted({r.rsplit("/", 1)[0] for r in names if "/" in r})
            if not dirs:
                continue
            rel = rng.choice(dirs)  # a file where a directory is expected
            if not (store / rel).is_dir():
                continue
            shutil.rmtree(store / rel)
            (store / rel).write_bytes(rng.choice([b"", b"{}", b"not a directory"]))
            done.append({"path": rel, "what": "directory replaced by a file", "kind": "tree"})
    return done


# ------------------------------------------------------------------ what damage can reach


def _datasets(files: dict[str, bytes]) -> list[str]:
    """Directories (storage = view paths) whose metadata makes them datasets or groups."""
    out = set()
    for rel in files:
        name = rel.rsplit("/", 1)[-1]
        d = rel.rsplit("/", 1)[0] if "/" in rel else ""
        if name in METADATA_NAMES:
            out.add(d)
    return sorted(out)


def _under(rel: str, d: str) -> bool:
    return d == "" or rel == d or rel.startswith(d + "/")


def dependencies(layout: str, good: dict[str, bytes], view: dict[str, bytes]) -> dict[str, set[str]]:
    """For each view file, the storage files it is made of (a damaged one may change it)."""
    deps: dict[str, set[str]] = {}
    if layout in ("pc_volume", "pc_kv"):
        from zshardfs.layouts import precomputed_format as pf
        for rel in view:
            deps[rel] = {rel} if rel in good else set()
        for rel, doc in good.items():
            if not rel.endswith("info"):
                continue
            base = rel.rsplit("/", 1)[0] if "/" in rel else ""
            info = json.loads(doc)
            if "scales" in info:
                for scale in info["scales"]:
                    spec = pf.ShardingSpec.from_json(scale["sharding"])
                    geo = pf.ScaleGeometry.from_json(scale)
                    d = f"{base}/{scale['key']}"
                    for v in view:
                        if v.startswith(d + "/") and v.count("/") == d.count("/") + 1:
                            pos = geo.parse_chunk_name(v.rsplit("/", 1)[1])
                            if pos is not None:
                                shard, _ = spec.shard_and_minishard(geo.chunk_id(pos))
                                deps[v] = {f"{d}/{spec.shard_key(shard)}"}
            elif "sharding" in info:
                spec = pf.ShardingSpec.from_json(info["sharding"])
                for v in view:
                    if v.startswith(base + "/") and v.count("/") == base.count("/") + 1:
                        name = v.rsplit("/", 1)[1].removesuffix(".index")
                        if name.isdigit():
                            shard, _ = spec.shard_and_minishard(int(name))
                            deps[v] = {f"{base}/{spec.shard_key(shard)}"}
        return deps
    # Zarr: a chunk file's bytes are stored untouched inside one shard: find it.
    shards = {r: b for r, b in good.items() if not is_metadata(r)}
    for rel, data in view.items():
        if rel in good and (is_metadata(rel) or good[rel] == data):
            deps[rel] = {rel}
            continue
        d = rel.rsplit("/", 1)[0] if "/" in rel else ""
        owner = max((x for x in _datasets(good) if _under(rel, x)), key=len, default="")
        if layout == "zarr2":
            owner = "data/root/" + "/".join(rel.split("/")[2:4]) if rel.startswith("data/root/") else d
            owner = next((o for o in sorted(_arrays2(good), key=len, reverse=True) if _under(rel, o)), owner)
        cands = {r for r in shards if _under(r, owner) and r != rel}
        deps[rel] = {r for r in cands if data and data in shards[r]} or cands
    return deps


def _arrays2(good: dict[str, bytes]) -> list[str]:
    return ["data/root/" + r[len("meta/root/"):-len(".array.json")] for r in good
            if r.startswith("meta/root/") and r.endswith(".array.json")]


def affected(layout: str, rel: str, is_dir: bool, damages: list[dict], deps: dict[str, set[str]]) -> bool:
    """May ``rel`` (a view file or directory) differ from the good store's view?"""
    for d in damages:
        p = d["path"]
        if d["kind"] == "tree" and (_under(rel, p) or any(_under(s, p) for s in deps.get(rel, ()))):
            return True
        if d["kind"] == "tree" and layout == "zarr2" and _under(p, "meta"):
            if _under(rel, "data" + p[len("meta"):]):  # (the array documents below went)
                return True
        if is_dir and _under(p, rel):  # a directory holding damage may list other names
            return True
        if p in deps.get(rel, ()) or p == rel:
            return True
        if is_metadata(p):
            d_dir = p.rsplit("/", 1)[0] if "/" in p else ""
            if layout == "zarr2":
                if p.startswith("meta/root/") and p.endswith(".array.json"):
                    if _under(rel, "data/root/" + p[len("meta/root/"):-len(".array.json")]):
                        return True
                else:
                    return True  # the entry point and group documents: everything
            elif _under(rel, d_dir):
                return True
            elif is_metadata(rel) and _under(p, rel.rsplit("/", 1)[0] if "/" in rel else ""):
                return True  # consolidated metadata above the document
    return False


# ------------------------------------------------------------------ one run


_MOUNTED: dict[Path, int | None] = {}  # mount point -> daemon pid: what cleanup() must take down
S3 = None  # --backend s3: the moto server (tests/s3server.py) the stores are copied to
_BUCKETS: dict[Path, str] = {}  # store directory -> its bucket


def source(store: Path) -> list[str]:
    """The source argument(s) for ``store``: the directory, or (S3) a bucket holding its files."""
    if S3 is None:
        return [str(store)]
    if store not in _BUCKETS:
        bucket = S3.create_bucket()
        _BUCKETS[store] = bucket
        S3.put_many(bucket, {f"pfx/{r}": b for r, b in storage_files(store).items()})
    return [f"s3://{_BUCKETS[store]}/pfx", "--endpoint-url", S3.endpoint_url]


def drop_source(store: Path) -> None:
    bucket = _BUCKETS.pop(store, None)
    if bucket is not None:
        S3.delete_bucket(bucket)


def mount(store: Path, mnt: Path, log: Path, ro: bool, extra_opts: tuple = ()) -> str | None:
    mnt.mkdir(parents=True, exist_ok=True)
    opts = ["ro" if ro else "rw", "timeout=5", f"log_file={log}", *extra_opts]
    src, *extra = source(store)
    _MOUNTED[mnt] = None  # (before it: an interrupted mount's daemon goes on, detached, for cleanup to end)
    r = subprocess.run([*ZSHARDFS, "mount", src, str(mnt), "-o", ",".join(opts), *extra],
                       capture_output=True, text=True, timeout=120)
    if os.path.ismount(mnt):  # (also when the mount command failed)
        try:
            _MOUNTED[mnt] = int(os.getxattr(mnt, "user.zshardfs.pid"))
        except (OSError, ValueError):
            pass
    elif r.returncode:
        _MOUNTED.pop(mnt, None)
    return None if r.returncode == 0 else f"mount failed ({r.returncode}): {r.stderr.strip()[-500:]}"


def umount(mnt: Path) -> str | None:
    """``zshardfs umount``; failing that, a lazy unmount and SIGKILL of the daemon (tests.util.take_down).
    The mount stays known (to cleanup) until then: an interrupted unmount may have done nothing."""
    from tests.util import take_down
    try:
        r = subprocess.run([*ZSHARDFS, "umount", str(mnt)], capture_output=True, text=True, timeout=120)
    except subprocess.TimeoutExpired:
        r = None
    pid = _MOUNTED.pop(mnt, None)
    if r is None or r.returncode != 0 or os.path.ismount(mnt):
        take_down(mnt, pid, gentle=False)  # (a daemon that would not unmount may not answer SIGTERM)
        return f"umount failed: {r.stderr.strip()[-500:] if r else 'timeout'}"
    return None


def cleanup() -> None:
    """Take down every mount still up (a failed or interrupted run)."""
    global S3
    for mnt in list(_MOUNTED):
        umount(mnt)
    if S3 is not None:
        S3.stop()
        S3 = None
        _BUCKETS.clear()


def start_s3(log: Path) -> None:
    """Start the moto server (dummy credentials for it in this process and the daemons)."""
    global S3
    from tests.s3server import MotoServer, dummy_credentials_env
    os.environ.update(dummy_credentials_env())
    log.parent.mkdir(parents=True, exist_ok=True)
    S3 = MotoServer(log)
    S3.start()


def _on_signal(signum, frame):
    raise SystemExit(128 + signum)  # (unwinds through the finally clauses, then atexit)


def log_lines(log: Path) -> list[str]:
    return [line for line in (log.read_text(errors="replace").splitlines() if log.exists() else [])]


def noisy(lines: list[str]) -> list[str]:
    return [line for line in lines if " WARNING " in line or " ERROR " in line or " CRITICAL " in line]


def view_of(store: Path, work: Path, ro: bool, writes: list[str], seed: int, tag: str, probe: list[str] = (),
            after=None, bad_writes: list = ()) -> tuple[dict | str, list[str], list[str]]:
    """Mount, walk (and write), ``after(mnt, result)``, unmount: (walk result or failure, log
    lines, problems)."""
    mnt, log = work / f"mnt-{tag}", work / f"{tag}.log"
    problems = []
    err = mount(store, mnt, log, ro)
    if err:
        if mnt in _MOUNTED:
            umount(mnt)
        return err, log_lines(log), [err]
    try:
        res = walk_in_child(mnt, writes, seed, list(probe), bad_writes)
        try:
            os.stat(mnt)
        except OSError as e:
            problems.append(f"{tag}: the daemon is gone after the walk ({e})")
        if after is not None and not isinstance(res, str) and not problems:
            after(mnt, res)
    finally:
        err = umount(mnt)
        if err:
            problems.append(f"{tag}: {err}")
    return res, log_lines(log), problems


def fsck(store: Path) -> list[str]:
    """``zshardfs fsck --data`` of the store: it ends in time, exit 0 or 1, no traceback."""
    try:
        r = subprocess.run([*ZSHARDFS, "fsck", *source(store), "--data", "-o", "timeout=5"],
                           capture_output=True, text=True, timeout=WALK_DEADLINE)
    except subprocess.TimeoutExpired:
        return [f"fsck did not end within {WALK_DEADLINE:.0f} s"]
    out = []
    if r.returncode not in (0, 1):
        out.append(f"fsck exited {r.returncode}: {r.stderr.strip()[-500:]}")
    text = r.stdout + r.stderr
    if "Traceback" in text:
        out.append("fsck: traceback:\n" + text[text.index("Traceback"):][:2500])
    return out


_REFERENCE: dict[str, tuple] = {}
ERRNOS: dict[str, int] = {}  # errors the walks met, for the summary line
NOISE = [0.0]  # the most warning/error lines per damaged object a mount logged


def reference(layout: str, good: Path, work: Path) -> tuple:
    """The good store's view (read-only walk), its files' bytes, its log's noise."""
    if (layout, S3 is not None, good) not in _REFERENCE:
        view: dict[str, bytes] = {}
        res, lines, problems = view_of(good, work, True, [], 0, "good", after=lambda mnt, res: view.update(
            {r: (mnt / r).read_bytes() for r, v in res["files"].items() if isinstance(v, str)}))
        if isinstance(res, str) or problems:
            raise SystemExit(f"the good {layout} store does not mount and read cleanly: {res} {problems}")
        bad = {r: v for r, v in res["files"].items() if not isinstance(v, str) or v.startswith("size")}
        if bad:
            raise SystemExit(f"the good {layout} store has unreadable files: {bad}")
        r = subprocess.run([*ZSHARDFS, "fsck", *source(good), "--data"], capture_output=True, text=True, timeout=120)
        if r.returncode != 0:
            raise SystemExit(f"fsck finds the good {layout} store damaged: {r.stdout[-500:]} {r.stderr[-500:]}")
        _REFERENCE[layout, S3 is not None, good] = (res, view, len(noisy(lines)))
    return _REFERENCE[layout, S3 is not None, good]


def _log_findings(tag: str, lines: list[str], ref_noise: int, reached) -> list[str]:
    """What the daemon's log says wrong: a traceback, or more warning/error lines
    than LINES_PER_DAMAGE per damaged object ``reached`` (beyond the good store's)."""
    out = []
    text = "\n".join(lines)
    if "Traceback" in text:
        i = text.index("Traceback")
        out.append(f"{tag}: traceback in the log:\n{text[max(0, i - 300):i + 2500]}")
    extra = len(noisy(lines)) - ref_noise
    NOISE[0] = max(NOISE[0], extra / max(1, len(reached)))
    if extra > LINES_PER_DAMAGE * max(1, len(reached)):
        out.append(f"{tag}: {extra} warning/error lines for {len(reached)} damaged objects:\n"
                   + "\n".join(noisy(lines)[:12]))
    return out


def _prepared(layout: str, cache: Path, base: Path, name: str):
    """(good store, a fresh work directory ``base/name``, the good store's reference
    view, its tree, its noise, its storage files, the dependencies between them)."""
    good = good_store(cache, layout)
    work = base / name
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    ref, view, ref_noise = reference(layout, good, base / f"{layout}-reference")
    good_files = storage_files(good)
    return good, work, ref, view, ref_noise, good_files, dependencies(layout, good_files, view)


def run_seed(layout: str, seed: int, cache: Path, base: Path, keep: bool = False,
             verbose: bool = False) -> tuple[list[str], list[dict]]:
    """Damage a copy of the good store with ``seed``; return the findings and the damage."""
    good, work, ref, view, ref_noise, good_files, deps = _prepared(layout, cache, base, f"{layout}-{seed}")
    store = work / "store"
    shutil.copytree(good, store)
    rng = random.Random(f"{layout}/{seed}")
    damages = apply_damage(rng, store, good_files)
    findings: list[str] = []
    chunks = sorted(r for r in ref["files"] if not affected(layout, r, False, damages, deps)
                    and not is_metadata(r) and deps.get(r) and deps[r] != {r}
                    and not r.endswith(".index"))  # (a mesh's manifest must stay consistent with its data)
    writes = rng.sample(chunks, min(3, len(chunks)))
    # Damaged objects: the files damaged, and the shards a damaged metadata document
    # describes (each may now fail its own checks, logged once per shard: SEMANTICS 5.2).
    reached = {d["path"] for d in damages} | {
        f for f in good_files if not is_metadata(f)
        and affected(layout, f, False, [d for d in damages if is_metadata(d["path"])], {})}
    bad_writes: list = []
    before: dict[str, bytes] = {}
    for ro in (True, False):
        tag = "ro" if ro else "rw"
        if not ro:
            before = storage_files(store) if S3 is None else {}
        res, lines, problems = view_of(store, work, ro, [] if ro else writes, seed, tag, sorted(ref["files"]),
                                       bad_writes=bad_writes if not ro else ())
        findings += problems
        if isinstance(res, str):
            findings.append(f"{tag}: {res}")
            continue
        if ro:  # the rw mount writes up to 2 of the chunks the damage made EIO, too
            eio = sorted(r for r, v in res["files"].items() if v == -errno.EIO and r in view
                         and not is_metadata(r) and deps.get(r) and deps[r] != {r} and not r.endswith(".index"))
            bad_writes = [[r, len(view[r])] for r in random.Random(f"{layout}/{seed}/bad").sample(eio, min(2, len(eio)))]
        else:
            findings += check_bad_writes(res, bad_writes, before, storage_files(store) if S3 is None else {},
                                         deps, writes)
            if verbose:
                print(f"  writes to damaged chunks: {res.get('bad_writes')}")
        for v in res["files"].values():
            if isinstance(v, int):
                ERRNOS[f"{tag}:{errno.errorcode.get(-v, -v)}"] = ERRNOS.get(f"{tag}:{errno.errorcode.get(-v, -v)}", 0) + 1
        findings += _log_findings(tag, lines, ref_noise, reached)
        for what, dt in res["slow"]:
            findings.append(f"{tag}: {what} took {dt} s")
        for rel, v in sorted(res["files"].items()):
            if isinstance(v, int) and -v not in ACCEPTABLE:
                findings.append(f"{tag}: {rel}: {errno.errorcode.get(-v, -v)}")
            elif isinstance(v, str) and v.startswith("size"):
                findings.append(f"{tag}: {rel}: {v}")
        for rel, v in sorted(res["dirs"].items()):
            if isinstance(v, int) and -v not in ACCEPTABLE:
                findings.append(f"{tag}: listing {rel or '.'}: {errno.errorcode.get(-v, -v)}")
        for rel, v in sorted(ref["files"].items()):
            if affected(layout, rel, False, damages, deps) or rel in res["writes"]:
                continue
            got = res["files"].get(rel, "missing")
            if got != v:
                findings.append(f"{tag}: {rel} (undamaged) reads {got if not isinstance(got, str) or len(got) < 20 else 'other bytes'}")
        hit = [r for r in ref["files"] if affected(layout, r, False, damages, deps)]
        for rel, v in sorted(ref["dirs"].items()):
            if affected(layout, rel, True, damages, deps) or any(_under(r, rel) for r in hit):
                continue  # (a listing shows the names of what is below it)
            got = res["dirs"].get(rel, "missing")
            if got != v:
                findings.append(f"{tag}: listing of {rel or '.'} (undamaged) is {got}, not {v}")
        for rel, v in res["writes"].items():
            if v != "ok":
                findings.append(f"{tag}: write to undamaged {rel}: {v}")
    findings += fsck(store)
    drop_source(store)
    _report(layout, seed, findings, damages, verbose)
    if verbose and not findings:
        hit = sum(affected(layout, r, False, damages, deps) for r in ref["files"])
        print(f"  {len(ref['files']) - hit} of {len(ref['files'])} files undamaged (compared), writes {writes}")
    if not keep and not findings:
        shutil.rmtree(work, ignore_errors=True)
    return findings, damages


def check_bad_writes(res: dict, bad_writes: list, before: dict[str, bytes], after: dict[str, bytes],
                     deps: dict[str, set[str]], writes: list[str]) -> list[str]:
    """Writes to chunks the damage made EIO: each ends with success, EIO or ENOENT; no file
    that read before reads otherwise after them; a damaged shard whose write failed is left
    as stored (SEMANTICS Limits: a write to a damaged shard fails, it never rewrites it
    without the damaged chunks)."""
    out = []
    written = set().union(*(deps.get(w, set()) for w in writes)) if writes else set()
    for rel, v in sorted(res.get("bad_writes", {}).items()):
        if isinstance(v, int) and -v not in (errno.EIO, errno.ENOENT):
            out.append(f"rw: write to damaged {rel}: {errno.errorcode.get(-v, -v)}")
        if isinstance(v, int) and before:
            for shard in sorted(deps.get(rel, set()) - written):
                if before.get(shard) != after.get(shard):
                    out.append(f"rw: write to damaged {rel} failed ({errno.errorcode.get(-v, -v)}) but changed "
                               f"{shard} ({len(before.get(shard, b''))} -> {len(after.get(shard, b''))} bytes)")
    for rel in res.get("changed", []):
        out.append(f"rw: {rel} reads otherwise after the writes to damaged chunks {[r for r, _ in bad_writes]}")
    return out


# ------------------------------------------------------------------ damage while mounted (--live)


LIVE_TTL = 0.2  # metadata_ttl, index_ttl and attr_timeout of the live mounts
LIVE_WAIT = 1.5  # past every TTL (0.2 s), and the 1 s a descriptor kept for a local path answers for it (NOWAIT_TRUST)
HUGE = 1 << 40  # a shard made a sparse file of this size (truncate -s 1T)
LIVE_MEMORY = 256 << 20  # the most the daemon's peak memory, or the bytes it reads, may grow by per phase


def live_damage(rng: random.Random, store: Path, files: dict[str, bytes], s3: bool) -> list[dict]:
    """``apply_damage``, then kinds only live runs draw: a file or a whole directory
    removed, a directory replaced by a file, and (local) a file, mostly a shard, made a
    sparse 1 TiB file (``truncate -s 1T``), which the daemon must not read or allocate."""
    done = apply_damage(rng, store, files)
    data = [r for r in sorted(files) if not is_metadata(r)]
    dirs = sorted({r.rsplit("/", 1)[0] for r in files if "/" in r})
    for _ in range(rng.choice([0, 1, 1, 2])):
        kind = rng.choice(["remove", "rmtree", "dir_file"] + ([] if s3 else ["sparse", "sparse", "sparse"]))
        if kind in ("rmtree", "dir_file"):
            rel = rng.choice(dirs)
            if not (store / rel).is_dir():
                continue
            shutil.rmtree(store / rel)
            if kind == "dir_file":
                (store / rel).write_bytes(rng.choice([b"", b"{}", b"not a directory"]))
            done.append({"path": rel, "kind": "tree", "what": "directory removed" if kind == "rmtree"
                         else "directory replaced by a file"})
            continue
        rel = rng.choice(sorted(files) if kind == "remove" or rng.random() < 0.2 else data)
        if not (store / rel).is_file() or (store / rel).stat().st_size > HUGE // 2:
            continue
        what = "removed"
        if kind == "remove":
            (store / rel).unlink()
        else:
            what = "made a sparse 1 TiB file (truncate -s 1T)"
            tail = (store / rel).read_bytes()[-rng.choice([16, 64, 4096]):]
            with open(store / rel, "rb") as f:
                head = bytearray(f.read(64))
            os.truncate(store / rel, HUGE)
            # its first bytes (an index at the start: a precomputed shard index, a zarr index_location
            # start) with bits flipped: ranges that now end inside the file however long they are.
            # (A generator of its own, drawn from the seed without drawing from ``rng``: the seeds
            # of the suite keep the damage they were chosen for.)
            side = random.Random(f"{rng.getstate()[1][:8]}/{rel}")
            if head and side.random() < 0.5:
                for b in sorted(side.randrange(len(head) * 8) for _ in range(side.choice([1, 2, 8]))):
                    head[b // 8] ^= 1 << (b % 8)
                with open(store / rel, "r+b") as f:
                    f.write(head)
                what += ", bits flipped in its first bytes"
            if tail and rng.random() < 0.5:  # its tail (an index at the end) moved to the new end, bits flipped or not:
                # entries now point inside the file, however long they say their chunks are
                if rng.random() < 0.5:
                    buf = bytearray(tail)
                    for b in sorted(rng.randrange(len(buf) * 8) for _ in range(rng.choice([1, 2, 8]))):
                        buf[b // 8] ^= 1 << (b % 8)
                    tail, what = bytes(buf), what + ", its last bytes moved to the end with bits flipped"
                else:
                    what += ", its last bytes moved to the end"
                with open(store / rel, "r+b") as f:
                    f.seek(HUGE - len(tail))
                    f.write(tail)
        done.append({"path": rel, "kind": "file", "what": what})
    return done


def _remove(p: Path) -> None:
    shutil.rmtree(p) if p.is_dir() and not p.is_symlink() else p.unlink()


def mirror(src: Path, dst: Path) -> None:
    """Make the tree ``dst`` hold what ``src`` holds, as another client would under a live
    mount: files rewritten in place, names removed, files and directories swapped; the
    root of ``dst`` stays (it is mounted). Sparse huge files are copied sparse."""
    have, want = set(os.listdir(dst)), set(os.listdir(src))
    for n in sorted(have - want):
        _remove(dst / n)
    for n in sorted(want):
        s, d = src / n, dst / n
        if s.is_dir():
            if d.exists() and not d.is_dir():
                d.unlink()
            d.mkdir(exist_ok=True)
            mirror(s, d)
            continue
        if d.is_dir():
            shutil.rmtree(d)
        size = s.stat().st_size
        if size > 1 << 30:
            subprocess.run(["cp", "--sparse=always", str(s), str(d)], check=True)
            continue
        new = s.read_bytes()
        if not d.exists() or d.stat().st_size != len(new) or d.read_bytes() != new:
            with open(d, "wb") as f:  # (in place: readers of the old version see it change)
                f.write(new)


def mirror_source(src: Path, store: Path) -> None:
    """Make the live source of ``store`` (its directory, or its bucket) hold what ``src`` holds."""
    if S3 is None:
        mirror(src, store)
        return
    bucket = _BUCKETS[store]
    have = {k for k, _ in S3._iter_objects(bucket)}
    want = {f"pfx/{r}": b for r, b in storage_files(src).items()}
    gone = sorted(have - set(want))
    for i in range(0, len(gone), 1000):
        S3.s3.delete_objects(Bucket=bucket, Delete={"Objects": [{"Key": k} for k in gone[i:i + 1000]], "Quiet": True})
    old = {k: S3.s3.get_object(Bucket=bucket, Key=k)["Body"].read() for k in sorted(have & set(want))}
    S3.put_many(bucket, {k: b for k, b in want.items() if old.get(k) != b})


def small_files(root: Path) -> dict[str, bytes]:
    """``storage_files``, with a sparse huge file given by its size (never read)."""
    out = {}
    for dirpath, _, files in os.walk(root):
        for f in files:
            p = Path(dirpath) / f
            size = p.stat().st_size
            out[p.relative_to(root).as_posix()] = p.read_bytes() if size <= 1 << 30 else f"{size} bytes".encode()
    return out


def _proc(pid: int | None) -> tuple[int, int]:
    """(peak resident bytes, bytes read) of the daemon, (0, 0) when unknown."""
    try:
        hwm = next(int(line.split()[1]) << 10 for line in Path(f"/proc/{pid}/status").read_text().splitlines()
                   if line.startswith("VmHWM:"))
        rchar = next(int(line.split()[1]) for line in Path(f"/proc/{pid}/io").read_text().splitlines()
                     if line.startswith("rchar:"))
        return hwm, rchar
    except (OSError, StopIteration, TypeError):
        return 0, 0


def check_live(tag: str, res: dict | str, ref: dict, fresh: dict, layout: str, damages: list[dict],
               deps: dict[str, set[str]], writes: list[str], old_too: bool = False) -> list[str]:
    """After the damage and the TTLs: every file reads as in the good store if the damage
    cannot reach it, else as a fresh mount of the damaged store reads it, or fails with
    EIO/ENOENT/ENOTDIR; listings likewise. ``fresh`` None: the store was repaired, and
    everything must read as in the good store. ``old_too``: right after the damage, within
    the TTLs, a damaged file may also read as in the good store (its caches are valid)."""
    if isinstance(res, str):
        return [f"{tag}: {res}"]
    out = [f"{tag}: {what} took {dt} s" for what, dt in res["slow"]]
    for kind, got_all, ref_all, fresh_all in (("", res["files"], ref["files"], fresh and fresh["files"]),
                                              ("listing of ", res["dirs"], ref["dirs"], fresh and fresh["dirs"])):
        for rel in sorted(set(got_all) | set(ref_all) | set(fresh_all or ())):
            if rel in writes:
                continue
            got = got_all.get(rel, "missing")
            if isinstance(got, str) and got.startswith("size"):
                out.append(f"{tag}: {rel}: {got}")
                continue
            if isinstance(got, int) and -got not in ACCEPTABLE:
                out.append(f"{tag}: {kind}{rel or '.'}: {errno.errorcode.get(-got, -got)}")
                continue
            old = ref_all.get(rel, -errno.ENOENT)  # (a name probed that is not there: ENOENT)
            got = -errno.ENOENT if got == "missing" or got == -errno.ENOTDIR and rel not in ref_all else got
            if fresh_all is None or rel in ref_all and not (affected(layout, rel, bool(kind), damages, deps)
                                         or kind and any(_under(r, rel) for r in ref["files"]
                                                         if affected(layout, r, False, damages, deps))):
                if got != old:
                    what = "repaired" if fresh_all is None else "undamaged"
                    out.append(f"{tag}: {kind}{rel or '.'} ({what}) is {_short(got)}, not {_short(old)}")
                continue
            new = fresh_all.get(rel, -errno.ENOENT)
            if old_too and kind and got == [] and new == -errno.ENOENT and _removed_whole(rel, damages):
                continue  # (at once: the kernel still holds its entry, SEMANTICS Limits)
            if got != new and not isinstance(got, int) and not (old_too and got == old):
                out.append(f"{tag}: {kind}{rel or '.'} (damaged) is {_short(got)}, where a fresh mount shows "
                           f"{_short(new)} (the good store: {_short(old)})")
    for rel, v in res["writes"].items():
        if v != "ok":
            out.append(f"{tag}: write to undamaged {rel}: {v}")
    return out


def _removed_whole(rel: str, damages: list[dict]) -> bool:
    """Is directory ``rel`` in a tree the damage removed whole?  Right after, while the
    kernel holds its entry (``attr_timeout``), it lists as empty, not ENOENT: storage
    holds nothing below it, and the entry stands until the kernel asks again (SEMANTICS
    Limits)."""
    return any(d["kind"] == "tree" and d["what"] == "directory removed" and _under(rel, d["path"]) for d in damages)


def _short(v) -> str:
    if isinstance(v, int):
        return errno.errorcode.get(-v, str(v))
    return f"bytes {v[:8]}" if isinstance(v, str) and len(v) == 64 else str(v)[:200]


def run_live(layout: str, seed: int, cache: Path, base: Path, keep: bool = False,
             verbose: bool = False) -> tuple[list[str], list[dict]]:
    """Mount a good copy of LAYOUT read-only, then read-write, with short TTLs; read it
    all (warm caches), damage the store underneath, wait past the TTLs, read it all
    again (and write undamaged chunks), restore the good copy, wait, read it all again."""
    good, work, ref, view, ref_noise, good_files, deps = _prepared(layout, cache, base, f"live-{layout}-{seed}")
    damaged = work / "damaged"
    shutil.copytree(good, damaged)
    rng = random.Random(f"live/{layout}/{seed}")
    damages = live_damage(rng, damaged, good_files, S3 is not None)
    findings: list[str] = []
    # What a fresh mount of the damaged store shows: the new bytes a live mount may read.
    fresh, _, problems = view_of(damaged, work, True, [], seed, "fresh", sorted(ref["files"]))
    findings += problems
    if isinstance(fresh, str):
        findings.append(f"fresh: {fresh}")
        fresh = {"files": {}, "dirs": {}}
    probe = sorted(set(ref["files"]) | set(fresh["files"]))
    chunks = sorted(r for r in ref["files"] if not affected(layout, r, False, damages, deps)
                    and not is_metadata(r) and deps.get(r) and deps[r] != {r} and not r.endswith(".index"))
    writes = rng.sample(chunks, min(3, len(chunks)))
    reached = {d["path"] for d in damages} | {
        f for f in good_files if not is_metadata(f)
        and affected(layout, f, False, [d for d in damages if is_metadata(d["path"])], {})}
    # The rw mount also writes up to 2 chunks the damage made EIO (fresh mount).
    eio = sorted(r for r, v in fresh["files"].items() if v == -errno.EIO and r in view and not is_metadata(r)
                 and deps.get(r) and deps[r] != {r} and not r.endswith(".index"))
    bad_writes = [[r, len(view[r])] for r in random.Random(f"live/{layout}/{seed}/bad").sample(eio, min(2, len(eio)))]
    store = work / "store"
    shutil.copytree(good, store)
    warm = during = res = again = None
    opts = (f"metadata_ttl={LIVE_TTL}", f"index_ttl={LIVE_TTL}", f"attr_timeout={LIVE_TTL}")
    for ro in (True, False):
        tag = "ro" if ro else "rw"
        mnt, log = work / f"mnt-{tag}", work / f"{tag}.log"
        err = mount(store, mnt, log, ro, opts)
        if err:
            findings.append(f"{tag}: {err}")
            if mnt in _MOUNTED:
                umount(mnt)
            continue
        try:
            pid = _MOUNTED.get(mnt)
            warm = walk_in_child(mnt, [], seed, sorted(ref["files"]))
            findings += check_live(f"{tag} warm", warm, ref, None, layout, damages, deps, [])
            before = _proc(pid)
            mirror_source(damaged, store)
            during = walk_in_child(mnt, [], seed, probe)  # (at once: old or new bytes, or an error)
            findings += check_live(f"{tag} at once", during, ref, fresh, layout, damages, deps, [], old_too=True)
            time.sleep(LIVE_WAIT)
            stored = {} if ro or S3 is not None else small_files(store)
            res = walk_in_child(mnt, [] if ro else writes, seed, probe, [] if ro else bad_writes)
            after = _proc(pid)
            findings += check_live(f"{tag} damaged", res, ref, fresh, layout, damages, deps,
                                   [] if ro else writes + [r for r, _ in bad_writes])
            if not ro and not isinstance(res, str):
                findings += check_bad_writes(res, bad_writes, stored, small_files(store) if stored else {},
                                             deps, writes)
                if verbose:
                    print(f"  writes to damaged chunks: {res.get('bad_writes')}")
            if before[0] and (after[0] - before[0] > LIVE_MEMORY or after[1] - before[1] > LIVE_MEMORY):
                findings.append(f"{tag}: the daemon's peak memory grew by {(after[0] - before[0]) >> 20} MiB and it "
                                f"read {(after[1] - before[1]) >> 20} MiB while reading the damaged store")
            mirror_source(good, store)
            time.sleep(LIVE_WAIT)
            again = walk_in_child(mnt, [], seed, probe)
            findings += check_live(f"{tag} repaired", again, ref, None, layout, damages, deps,
                                   [] if ro else [r for r, _ in bad_writes])  # (their chunks may be stored yet)
            try:
                os.stat(mnt)
            except OSError as e:
                findings.append(f"{tag}: the daemon is gone ({e})")
        finally:
            err = umount(mnt)
            if err:
                findings.append(f"{tag}: {err}")
        lines = log_lines(log)
        findings += _log_findings(tag, lines, ref_noise, reached)
        for phase in (warm, during, res, again):
            if isinstance(phase, dict):
                for v in phase["files"].values():
                    if isinstance(v, int):
                        k = f"{tag}:{errno.errorcode.get(-v, -v)}"
                        ERRNOS[k] = ERRNOS.get(k, 0) + 1
    findings += fsck(damaged)
    drop_source(damaged)
    drop_source(store)
    _report(layout, seed, findings, damages, verbose, "--live ")
    if not keep and not findings:
        shutil.rmtree(work, ignore_errors=True)
    return findings, damages


def _report(layout: str, seed: int, findings: list[str], damages: list[dict], verbose: bool, flag: str = "") -> None:
    if verbose and not findings:
        for d in damages:
            print(f"  damage: {d['path']}: {d['what']}")
    if findings:
        print(f"FINDING {layout} seed {seed}: replay with\n  .venv/bin/python scripts/fuzz_damage.py {flag}"
              f"--layout {layout} --seeds {seed} --keep", flush=True)
        for d in damages:
            print(f"  damage: {d['path']}: {d['what']}")
        for f in findings[:20]:
            print("  " + f.replace("\n", "\n    "))
        if len(findings) > 20:
            print(f"  ... {len(findings) - 20} more")


def _seeds(text: str) -> list[int]:
    out = []
    for part in text.split(","):
        a, _, b = part.partition("-")
        out += list(range(int(a), int(b) + 1)) if b else [int(a)]
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layout", default="all", choices=[*LAYOUTS, "all"])
    ap.add_argument("--seeds", default="0-9", help="e.g. 7, 0-49, 3,8,20-30")
    ap.add_argument("--cache", help="where good stores are kept, to be used again by later runs (default: built "
                                     "anew into this run's own directory, removed at its end)")
    ap.add_argument("--base", help="where runs go (default: this run's own directory, removed at its end unless "
                                   "it keeps something: --keep, or findings)")
    ap.add_argument("--keep", action="store_true", help="keep the damaged store and logs of every run")
    ap.add_argument("--backend", default="local", choices=["local", "s3"],
                    help="s3: copy each store to a bucket of a moto server (tests/s3server.py)")
    ap.add_argument("--verbose", action="store_true", help="print the damage of every seed")
    ap.add_argument("--live", action="store_true",
                    help="damage the store while it is mounted, after a first read warmed every cache; then repair it")
    ap.add_argument("--walk-job", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.walk_job:
        job = json.loads(args.walk_job)
        Path(job["out"]).write_text(json.dumps(walk(job["root"], job["writes"], job["seed"], job["probe"],
                                                    job.get("bad_writes", []))))
        return 0
    atexit.register(cleanup)
    signal.signal(signal.SIGTERM, _on_signal)
    signal.signal(signal.SIGHUP, _on_signal)
    cache, base, own = run_dirs(args.cache, args.base)
    found = 0
    try:
        if args.backend == "s3":
            start_s3(base / "moto.log")
        layouts = LAYOUTS if args.layout == "all" else (args.layout,)
        for layout in layouts:
            for seed in _seeds(args.seeds):
                t = time.monotonic()
                f, _ = (run_live if args.live else run_seed)(layout, seed, cache, base, args.keep, args.verbose)
                found += bool(f)
                print(f"{layout} seed {seed}: {'%d findings' % len(f) if f else 'ok'} ({time.monotonic() - t:.1f} s)",
                      flush=True)
        print(f"{found} seeds with findings; errors met by the walks: {ERRNOS}; "
              f"at most {NOISE[0]:.1f} log lines per damaged object")
    finally:
        cleanup()  # (the mounts and the S3 server first: they use the directories)
        if own is not None:
            shutil.rmtree(own / "stores", ignore_errors=True)
            if (args.keep or found) and args.base is None:
                print(f"kept in {base}", flush=True)
            else:
                shutil.rmtree(own, ignore_errors=True)
    return 1 if found else 0


#: where a run without --cache or --base makes its own directory
RUNS_ROOT = Path(tempfile.gettempdir()) / "zshardfs-fuzz-damage"


def run_dirs(cache: str | None, base: str | None) -> tuple[Path, Path, Path | None]:
    """(good store cache, base of the runs, this run's own directory or None): the ones
    given, else directories of this run's own, so that runs at once do not build the same
    good store or mount the same reference view in the same place."""
    own = None
    if cache is None or base is None:
        RUNS_ROOT.mkdir(parents=True, exist_ok=True)
        own = Path(tempfile.mkdtemp(prefix="run-", dir=RUNS_ROOT))
    return (Path(cache) if cache is not None else own / "stores",
            Path(base) if base is not None else own / "runs", own)


if __name__ == "__main__":
    sys.exit(main())
