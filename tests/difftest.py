"""Randomized differential testing of the write path (engine; tests/test_differential.py
runs fixed seeds of it, scripts/difftest.py long runs, replays and minimisation).

The same random sequence of file operations is applied to
  (a) a zshardfs mount of a sharded store (local directory or moto S3): a Zarr array
      (regular, ZEP 3 ``rectangular`` or ``rectilinear`` shard grid), a consolidated Zarr
      hierarchy of groups and arrays (``HIERARCHIES``), or Neuroglancer precomputed
      (``pc_*``: a volume's scales and a skeleton directory; ``pc_mesh_*``: a skeleton
      and a multi-resolution mesh directory), and
  (b) the *twin*: an ordinary directory holding the equivalent unsharded store,
and both trees (names, sizes, bytes, listings outside chunk directories, the result or
errno of every op) are compared after every step, after remounts, and after ``kill -9`` of
the daemon (then every file must hold one of the versions it had since the last durable
point: a sync, an fsync of it, an unmount). At the end every chunk is made a valid
encoding, the mount is unmounted and the sharded source is read with zarr-python and
tensorstore (zarr 2.18 for the storage transformer; precomputed: tensorstore) and compared
with the twin.  What differs between layouts (how stores and twins are built, which names
exist, what a valid chunk is, which peers read the result) is behind :class:`Layout`.

The documented differences (docs/SEMANTICS.md, Limits) are emulated on the twin:
  - link(2) makes a copy (EEXIST on a taken name);
  - in-grid chunk directories always exist (lenient lookup); ``mkdir`` of one is
    EEXIST, ``rmdir`` succeeds unless a chunk is below;
  - names outside the grid are ENOENT when created, renamed onto or made (mkdir)
    (precomputed: any name spelled as a chunk of that directory but none of its chunks);
  - precomputed scale directories are not looked up leniently: one removed stays gone;
  - on S3, directories a store may empty (plain ones, precomputed scales) keep a ``.keep``
    file: S3 has no empty directories, nor would an unsharded store there;
  - files with non-chunk names inside chunk directories live in memory only: dropped
    at unmount and by a daemon kill;
  - the ``rename`` op never draws a directory as its source; the ``dirmv`` op renames
    directories (local stores, SEMANTICS 4.18; off unless weighted: ``scripts/difftest.py
    --dirmv W``, test_differential's DIRMV_CASES), see below;
  - (empty) directories below the array's chunk directories are not compared;
  - an editor's save or ``rm`` and put back of the ``zarr.json`` of a sharded array none of
    whose chunks is left makes a new array, stored as written (unsharded; SEMANTICS 4.15):
    not emulated, so such a metadata op is drawn as a rewrite in place instead;
  - a multi-resolution mesh (``pc_mesh_*``: ``<id>.index`` manifest, ``<id>`` fragment
    data) is changed as a pair only (the mesh ops: written whole, either file first or
    through temporaries, the manifest alone with the same fragment sizes, removed by
    ``rm <id>.index``, renamed ``<id>`` first), never by the other ops: a lone file of a
    pair fails its shard's flush (SEMANTICS, Limits). ``meshbad`` writes an inconsistent
    pair on purpose: the twin answers its fsync with EIO while the pair is inconsistent.
Metadata ops (Zarr variable grids and hierarchies, zarr 2.18's consolidated store
``zarr2_consolidated``, ``LAYOUT_WEIGHTS``; :class:`ZarrNames` follows a resize): documents
edited through the mount (attributes, fill value, consolidated members; zarr 2.18's
``.zmetadata`` also with the member's own document renamed away meanwhile; SEMANTICS 1,
4.9, 4.11, 4.15; read through the consolidated metadata at the end), zarr-python's consolidation, and
resizes (chunks past the new shape deleted first, as zarr-python does; names past the
shape are then outside the grid). A kill -9 while an
array is shrunk leaves unknown which of its removed chunks the shards still hold (hidden
past the shape): a resize that shows them again adopts them into the twin (and such an
array is not read through consolidated metadata at the end). Temporaries in a chunk
directory a shrink puts outside the grid stay in the mount's memory, unreachable: the
twin holds them aside until a resize takes the directory back. On S3 the directories
below an unsharded array are not listed and, found empty at a remount, are gone.

Network faults (S3, ``faults`` weight: ``scripts/difftest.py --faults W``): the op ``faults``
turns them on (:class:`tests.s3server.Faults` in the proxy the mount talks through: with
probability ``p`` a request's connection is reset, cut after the server acted, or answered
503/500) for a stretch of 4-15 ops, while the mount applies each (not while trees are
compared), and ``faultsoff`` ends it. Under faults an op may fail with EIO (``FAULT_ERRNOS``)
where the twin's succeeds: it may have done any part of its work, so the files it names are
taken from the mount into the twin, and both what the mount shows and what the twin made of
them count as versions since the last durable point (a kill -9 may find either; an fsync or
sync that succeeded is a durable point as always). Ops that fail otherwise, or succeed
differently, diverge. ``faultsoff``: ``zshardfs sync`` must succeed again (retried for up to
30 s: a storage call that failed fails fast for FAIL_FAST seconds), then the mount and the
twin agree, and a fresh read-only mount of the store shows the twin's files (minus those
living in memory only): every shard whole, none a mix. Under faults a remount's unmount either stores everything (the
durable point) or is refused, leaving the mount as it was (SEMANTICS 4.8), and its mount may
fail (storage unreachable: a message, no traceback; it is then made with the faults off). A
document's edit or a mesh op that failed is followed by what a user would do where the mount
was left in a state the twin does not follow (:meth:`Runner.mend`, faults off): a document
missing or not JSON is written again as the edit meant (a backup moved back first), a mesh pair
left inconsistent is written as the op meant, a resize is tried again. A document's states
since the durable point are then its versions too (compared as JSON after a kill -9). A race
under faults: its watcher's observations that failed with EIO tell nothing and are passed
over, and a mover step that failed (the mover stops there) may have done its work or not, so
the file may end in the state before it or any it passes through (its temporary, when a
rename failed, is taken from the mount too); what the watcher saw must still fit the states
in order, or the op diverges.

The ``race`` op (off unless weighted: ``scripts/difftest.py --race W``, test_differential's
RACE_CASES) has one process change a file while another watches it; the watcher's
observations must be explained by the file's states in order (:meth:`Applier.op_race`).

The ``dirmv`` op renames a directory (a group, an array, a volume, a plain or a chunk
directory; onto a free name, an empty directory it makes first, a full one, a file, into
itself; with RENAME_NOREPLACE through renameat2), sometimes with a file or a listing held open
below (``hold``) or two processes writing by path below the old and the new name meanwhile
(``conc``; with a reader by path of files neither writes, and sometimes the directory moved to
and fro several times), or the daemon killed (``kill -9``) during it (``kill``: a fresh mount
shows it at one name, never both or neither); while one is renamed away, the rename back (made before the final check, if the
run has not). The twin renames only where the mount did, and an EXDEV must be one SEMANTICS
4.18 allows: the kernel's answers first (EEXIST, EINVAL, ENOTDIR), then EXDEV is required on
S3, inside a sharded dataset or a v3-draft store, for chunk directories and precomputed
scales, and with something held open below; it is allowed (the twin follows the mount) only
where something below may live in memory only, or with writers busy below (each of whose
writes must land, below the old name until the rename and below the new one from it, or be
ENOENT; each read the file's bytes, or ENOENT as the renames allow; a temporary a writer below
the old name left, which the writer below the new one may have taken or not, is either absent
or its writer's bytes: :meth:`Applier._late_temporaries`). An accepted rename must move the stored metadata documents unchanged (the arrays'
``zarr.json`` still sharded). While a directory is renamed away the names below its new place
are what they were below the old (:meth:`Names.logical`), and the other ops draw neither place.

The ``other`` op (off unless weighted: ``scripts/difftest.py --other W``, test_differential's
OTHER_CASES; the run's mount then has every TTL 0, ``OTHER_OPTS``) plays another client of the
store (:meth:`Runner.other`): chunks written or removed through a second mount of the store
(local: its flush under the directory's flock; S3: straight to the server, conditional PUTs,
never through the proxy's faults), a whole shard deleted in storage, or an attribute set in a
Zarr v3 array's stored ``zarr.json``; the twin takes the same change, which the mount must show
at once (SEMANTICS 2.5 with TTLs 0), also after ``index_cache=1K`` evicted the shard's index.
With ``sync`` the mount is synced first and holds nothing unstored; without it, chunks the mount
changed since it last held nothing unstored (:attr:`Env.touched`) may still be dirty there: where
the other client changed one of those, the mount shows its own version (its flush re-reads the
shard and merges, its own chunks winning: SEMANTICS 4.5) or, had it stored it already, the other
client's, and the twin takes which; every other chunk of the shard must keep the mount's version
(untouched by the other client) or show the other client's, and a kill -9 may find a chunk as the
other client stored it.

An op is a JSON-able dict (data as ``["pool", i]``, a valid encoded chunk, or
``["rnd", seed, n]``), so a failing sequence can be printed, saved, replayed
(``scripts/difftest.py --replay FILE``) and minimised (``--minimize``).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import functools
import hashlib
import inspect
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import zlib
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from tests import peers_precomputed as pp
from tests import peers_zarr as pz
from tests.conftest import ZSHARDFS as ZS
from tests.conftest import run_mount
from tests.peers_zarr import ZarrCase
from tests.util import process_running, take_down, wait_for

PLAIN_FILES = ["notes.txt", "plain/a.bin", "plain/b.bin", "plain/sub/c.bin", "top.bin"]
PLAIN_DIRS = ["plain", "plain/sub", "plain/new"]


def errname(e: OSError) -> str:
    return errno.errorcode.get(e.errno, str(e.errno))


def h(b: bytes | None) -> str | None:
    return None if b is None else f"{len(b)}:{hashlib.md5(b).hexdigest()[:10]}"


class Divergence(Exception):
    pass


# ------------------------------------------------------------------ the layout of names


class Names:
    """Every name the generator uses, and what each is to the view (filled by a layout):
    ``chunks``/``outside`` (name -> grid position or id), ``chunkdirs`` (directories below a
    dataset root that hold chunk names: split out as in-grid ``inner_dirs`` and ``out_dirs``),
    ``roots`` (dataset root directories: other names there are plain files stored at fsync),
    ``meta`` (metadata documents, compared as JSON)."""

    arr: str
    roots: list[str]
    meta: list[str]
    chunks: dict
    outside: dict
    chunkdirs: set
    #: directories that may lose their last stored object (S3 then has no such directory,
    #: nor would an unsharded store there): given a ``.keep`` file on S3
    keep_dirs: list[str] = []
    #: more directories mkdir/rmdir are drawn for (precomputed scale directories)
    extra_dirs: list[str] = []
    #: does storage make a chunk's parent directory when it is written (Zarr: chunk
    #: directories are looked up leniently)?  Else a removed scale directory stays gone.
    lenient_parents = True
    #: (precomputed) the multi-resolution mesh directory, its ids (stored and new) and the
    #: names of its files: written, renamed and removed as pairs only (the mesh ops), never
    #: by the other ops (a lone file of a pair fails its shard's flush: SEMANTICS, Limits)
    mesh_root: str | None = None
    mesh_ids: list[int] = []
    units: set = set()
    #: (Zarr) the arrays, each at its own path (resize: their shapes now, and the largest each
    #: had); a hierarchy's group documents' neighbours, its consolidated members; the chunks
    #: of unsharded arrays (plain files) and, on S3, the directories below those arrays
    cases: list[ZarrCase] = []
    largest: dict = {}
    group_plain: list[str] = []
    members: list[str] = []
    #: the document holding the consolidated members (a hierarchy's ``zarr.json``, zarr 2.18's
    #: ``meta/root/consolidated/.zmetadata``), or None
    consolidated: str | None = None
    plain_chunks: list[str] = []
    plain_trees: list[str] = []

    def _finish(self) -> None:
        self.inner_dirs = sorted(d for d in self.chunkdirs if self._in_grid_dir(d))
        self.out_dirs = sorted(self.chunkdirs - set(self.inner_dirs))
        self.leaf_dirs = sorted({k.rsplit("/", 1)[0] for k in self.chunks if k.rsplit("/", 1)[0] in self.chunkdirs})
        self.arr_plain = [f"{r}/{n}" for r in self.roots for n in ("extra.txt", ".tmp-arr")]
        self.free_chunks = sorted(k for k in self.chunks if k not in self.units)  # (what the other ops draw)

    def _in_grid_dir(self, d: str) -> bool:
        return any(k.startswith(d + "/") for k in self.chunks)

    #: (local store, the ``dirmv`` op) a directory renamed through the mount and not back
    #: yet: (its name, where it is now); the names below the new place are what they were
    #: below the old one (:meth:`logical`), and the generator draws none of either place
    moved: tuple[str, str] | None = None

    def logical(self, rel: str) -> str:
        """The name ``rel`` had before the directory it is in was renamed (:attr:`moved`)."""
        if self.moved is not None:
            old, new = self.moved
            if rel == new or rel.startswith(new + "/"):
                return old + rel[len(new):]
        return rel

    def is_meta(self, rel: str) -> bool:
        return self.logical(rel) in self.meta

    def kind(self, rel: str) -> str:
        rel = self.logical(rel)
        if rel in self.chunks:
            return "chunk"
        if rel in self.outside:
            return "outside"
        if rel in self.chunkdirs:
            return "chunkdir" if rel in self.inner_dirs else "outdir"
        if (k := self._spelled_outside(rel)):
            return k
        parent = rel.rsplit("/", 1)[0] if "/" in rel else ""
        if parent in self.chunkdirs:
            return "chunktmp"
        if parent in self.roots:
            return "arrplain"
        return "plain"

    def _spelled_outside(self, rel: str) -> str | None:
        """``outside``/``outdir`` for a name spelled as a chunk (directory) past every grid
        listed, though not among ``outside``; None otherwise."""
        return None

    def in_chunk_tree(self, rel: str) -> bool:
        rel = self.logical(rel)
        return any(rel == d or rel.startswith(d + "/") for d in self.chunkdirs)

    def unlisted(self, rel: str) -> bool:
        """A directory whose listing is not compared: chunk trees, and (S3, where an
        emptied directory is gone at a remount) the chunk directories of unsharded arrays."""
        rel = self.logical(rel)
        return self.in_chunk_tree(rel) or any(rel == d or rel.startswith(d + "/") for d in self.plain_trees)

    def on_s3(self) -> None:
        """The store is on S3 (no empty directories): adjust what is compared."""

    def past_shrunk_shapes(self) -> set[str]:
        """Chunk names past the shape an array was shrunk to, within the largest it had (a
        kill -9 leaves unknown which of them the shards still hold)."""
        return set()


#: where zarr 2.18 consolidates a v3-draft store's metadata
ZMETADATA = "meta/root/consolidated/.zmetadata"


class ZarrNames(Names):
    """The names of a Zarr array (``cases``: the arrays of a hierarchy, each at its own path;
    one array otherwise); a resize changes them."""

    def __init__(self, case: ZarrCase, draft: bool, cases: list[ZarrCase] | None = None, zmeta: bool = False):
        self.case, self.draft, self.zmeta = case, draft, zmeta
        self.cases = cases or [case]
        self.largest = {c.path: c.shape for c in self.cases}  # (resize: the largest shape each had)
        self.hier = bool(cases)
        self._build()

    def resize(self, path: str, shape: tuple):
        """An array's document now has ``shape``: chunks past it are outside (ENOENT)."""
        self.cases = [c.with_(shape=tuple(shape)) if c.path == path else c for c in self.cases]
        self.largest[path] = tuple(max(a, b) for a, b in zip(self.largest[path], shape))
        self._build()

    def _build(self):
        self.chunks, self.outside, self.chunkdirs = {}, {}, set()
        self.roots, self.plain_chunks = [], []
        self.meta = ["zarr.json"]
        for c in self.cases:
            self._add(c)
        self.arr = self.roots[0]
        self.group_plain, self.members = [], []
        if self.hier:  # a hierarchy: its groups' documents, files beside them, consolidated members
            cases = self.cases
            groups = sorted({"/".join(c.path.split("/")[:i]) for c in cases for i in range(1, c.path.count("/") + 1)})
            self.meta += [f"{g}/zarr.json" for g in groups]
            self.group_plain = [f"{g}/notes.md" for g in groups]
            self.members = groups + [c.path for c in cases]
            self.consolidated = "zarr.json"
        if self.zmeta:  # zarr 2.18's consolidated metadata: its members are keyed by their documents
            self.meta.append(ZMETADATA)
            self.members = ["meta/root.group.json"] + [f"meta/root/{c.path}.array.json" for c in self.cases]
            self.consolidated = ZMETADATA
        self._finish()

    def _add(self, case: ZarrCase):
        bounds = pz.chunk_bounds(case)
        grid = [len(b) - 1 for b in bounds]
        coords = list(pz.grid_coords(bounds))
        if self.draft:
            arr = f"data/root/{case.path}"
            key = lambda c: pz.draft_chunk_key(case, c)  # noqa: E731
            # (zarr.json, the draft's entry point: zarr 2.18 writes it back when it opens a store)
            self.meta.insert(0, f"meta/root/{case.path}.array.json")
        else:
            arr = case.path
            key = lambda c: f"{case.path}/{pz.chunk_key(case, c)}"  # noqa: E731
            self.meta.append(f"{case.path}/zarr.json")
        if not case.sharded:  # an unsharded array passes through: its chunks are plain files
            self.plain_chunks += [key(c) for c in coords]
            return
        self.roots.append(arr)
        chunks = {key(c): c for c in coords}
        self.chunks.update(chunks)
        out = []
        for d in range(len(grid)):  # one step past the grid in each dimension
            c = [0] * len(grid)
            c[d] = grid[d]
            out.append(tuple(c))
        out.append(tuple(g + 3 for g in grid))
        out += [c for c in pz.grid_coords(pz.chunk_bounds(case.with_(shape=self.largest[case.path])))
                if c not in set(coords)]  # (an array shrunk: the chunks it had)
        outside = {key(c): c for c in out}
        self.outside.update(outside)
        # chunk directories: proper prefixes of chunk keys below the array
        for k in list(chunks) + list(outside):
            parts = k[len(arr) + 1:].split("/")
            for i in range(1, len(parts)):
                self.chunkdirs.add(arr + "/" + "/".join(parts[:i]))

    def _spelled_outside(self, rel: str) -> str | None:
        """A chunk name, chunk directory or a name below one, past every grid listed
        (minimising may drop the resize that made it): outside, as in the view."""
        for c in self.cases:
            if self.draft or not c.sharded or not rel.startswith(c.path + "/"):
                continue
            parts = rel[len(c.path) + 1:].split(c.separator)
            if c.key_encoding == "default":
                if parts[0] != "c":
                    continue
                parts = parts[1:]
            n = 0
            while n < len(parts) and parts[n].isdigit() and str(int(parts[n])) == parts[n]:
                n += 1
            grid = [len(b) - 1 for b in pz.chunk_bounds(c)]
            if not 0 < n <= len(grid) or all(int(x) < g for x, g in zip(parts[:n], grid)):
                continue
            if n == len(grid) == len(parts):
                return "outside"
            if c.separator == "/" and n < len(grid):
                return "outdir" if n == len(parts) else "outside"
        return None

    def on_s3(self):
        """The directories below an unsharded array's own: not listed, and gone when found
        empty at a remount."""
        self.plain_trees = sorted({
            k.rsplit("/", i)[0] for k in self.plain_chunks for i in range(1, k.count("/") + 1)
            if any(k.rsplit("/", i)[0].startswith(c.path + "/") for c in self.cases)})

    def past_shrunk_shapes(self):
        out = set()
        for c in self.cases:
            if c.sharded and tuple(c.shape) != tuple(self.largest[c.path]):
                big = c.with_(shape=self.largest[c.path])
                out |= {f"{c.path}/{pz.chunk_key(c, x)}" for x in pz.grid_coords(pz.chunk_bounds(big))}
        return out


# ------------------------------------------------------------------ data


class Data:
    def __init__(self, pool: list[bytes], layout: "Layout"):
        self.pool, self.layout = pool, layout

    def get(self, spec) -> bytes:
        if spec[0] == "pool":
            return self.pool[spec[1] % len(self.pool)]
        if spec[0] == "valid":  # a valid chunk for that name (the final check's)
            return self.layout.normal(spec[1])
        _, seed, n = spec
        return random.Random(seed).randbytes(n)


class Layout:
    """What the engine needs of one kind of store (one engine, several layouts)."""

    names: Names

    def build(self, src: Path, twin: Path) -> None:
        """Write the sharded store into ``src`` and its unsharded twin into ``twin``."""
        raise NotImplementedError

    def pool(self, twin: Path) -> list[bytes]:
        """Valid chunks to draw data from (after ``build``)."""
        raise NotImplementedError

    def valid(self, rel: str, data: bytes) -> bool:
        """Would a peer read ``data`` as chunk ``rel``?"""
        raise NotImplementedError

    def normal(self, rel: str) -> bytes:
        """A valid chunk for ``rel`` (the final check writes it over an invalid one)."""
        raise NotImplementedError

    def after_mount(self, env: "Env") -> None:
        """Once, after the first mount."""

    def peers_check(self, env: "Env", src: Path, hidden: set[str]) -> list[str]:
        """Peers read the sharded source (a local copy) and the twin: the same?  (``hidden``:
        chunks a kill -9 left hidden past a shrunk shape, see :meth:`Names.past_shrunk_shapes`.)"""
        raise NotImplementedError


class ZarrLayout(Layout):
    """A sharded Zarr v3 array (regular, ZEP 3 ``rectangular`` or ``rectilinear`` shard
    grid), or a consolidated hierarchy of groups and arrays (``cases``); ``draft``: the
    v3-draft storage transformer, zarr-python 2.18."""

    def __init__(self, case: ZarrCase, draft: bool = False, cases: list[ZarrCase] | None = None,
                 zmeta: bool = False):
        self.case, self.draft, self.cases, self.zmeta = case, draft, cases, zmeta
        self.names = ZarrNames(case, draft, cases, zmeta)

    def build(self, src, twin):
        if self.draft:
            pz.write_zarr2_transformer(self.case, src, twin)
            if self.zmeta:  # (zarr 2.18 consolidates each: the twin's is what the view shows of the source's)
                _zarr2_run("zarr.consolidate_metadata(DirectoryStoreV3(sys.argv[1]))", src)
                _zarr2_run("zarr.consolidate_metadata(DirectoryStoreV3(sys.argv[1]))", twin)
        elif self.cases:
            pz.write_zarr_hierarchy(self.cases, src, twin, consolidated=True, root_attributes={"top": 1})
        else:
            pz.write_zarr_python(self.case, src, twin)

    def pool(self, twin: Path, n: int = 4) -> list[bytes]:
        """Valid encoded chunks: the twin's own, and those of random arrays written with the
        metadata of the twin's (first sharded) array."""
        pool = []
        for rel in self.names.chunks:
            p = twin / rel
            if p.is_file():
                pool.append(p.read_bytes())
        if not self.draft:
            import zarr
            with tempfile.TemporaryDirectory() as tmp:
                src = twin / self.names.arr / "zarr.json"
                for i in range(n):
                    d = Path(tmp) / f"p{i}"
                    (d / "a").mkdir(parents=True)
                    shutil.copy(src, d / "a" / "zarr.json")
                    a = zarr.open_array(zarr.storage.LocalStore(d), path="a", mode="r+")
                    rng = np.random.default_rng(i)
                    if a.dtype.kind == "b":
                        v = rng.integers(0, 2, a.shape).astype(bool)
                    elif a.dtype.kind == "f":
                        v = rng.random(a.shape).astype(a.dtype)
                    else:
                        v = rng.integers(1, 100, a.shape).astype(a.dtype)
                    a[...] = v
                    for p in sorted((d / "a").rglob("*")):
                        if p.is_file() and p.name != "zarr.json":
                            pool.append(p.read_bytes())
        self._pool = pool or [b"\0" * 24]
        self._valid = set(self._pool)
        return self._pool

    def valid(self, rel, data):
        return data in self._valid  # (the encoded chunks of the pool)

    def normal(self, rel):
        return self._pool[(zlib.crc32(rel.encode()) & 0xFFFF) % len(self._pool)]

    def after_mount(self, env):
        """The store and the twin are two writes, and numcodecs' gzip stamps
        the time in each chunk's header: where they straddle a second, the
        twin takes the store's header (the chunk as the view shows it)."""
        for rel in sorted(self.names.chunks):
            twin = env.twin / rel
            if not twin.is_file():
                continue
            shown, own = (env.mnt / rel).read_bytes(), twin.read_bytes()
            if shown != own and pz.normalize_gzip(shown) == pz.normalize_gzip(own):
                twin.write_bytes(shown)

    def peers_check(self, env, src, hidden):
        if self.draft:
            return zarr2_compare(env, src)
        out = []
        for case in self.names.cases:
            # (chunks a kill -9 left hidden past a shrunk shape show through a consolidated
            # member that still has the larger one: not compared so)
            held = any(rel.startswith(case.path + "/") for rel in hidden)
            out += peers_compare(env, src, case, consolidated=not held)
        return out


B = ZarrCase(shape=(20, 12), chunks=(4, 3), shards=(8, 6), pattern="sparse")
#: small arrays (a few shards, partial edge chunks where the shape is odd), one per kind of
#: key and index; ``zarr2``: the v3-draft storage transformer, written by zarr-python 2.18.
ZARR_CASES: dict[str, ZarrCase] = {
    "basic": B,
    "start_nocrc_edges": B.with_(shape=(22, 13), index_location="start", index_crc32c=False),
    "be_crc_3d_dot": ZarrCase(shape=(6, 8, 10), chunks=(2, 4, 5), shards=(4, 8, 10), index_endian="big",
                              separator=".", pattern="sparse"),
    "1d_v2_dot": ZarrCase(shape=(100,), chunks=(10,), shards=(40,), key_encoding="v2", separator=".",
                          pattern="sparse"),
    "v2_slash_gzip_edges": B.with_(shape=(22, 13), key_encoding="v2", separator="/", compressor="gzip"),
    "3d_start_be_zstd": ZarrCase(shape=(7, 8, 9), chunks=(2, 4, 3), shards=(4, 8, 6), index_location="start",
                                 index_endian="big", compressor="zstd", pattern="sparse"),
    "be_nocrc_dot_edges": B.with_(shape=(21, 14), index_endian="big", index_crc32c=False, separator="."),
    "zarr2": ZarrCase(shape=(20, 12), chunks=(4, 3), shards=(8, 6), index_crc32c=False, pattern="sparse",
                      separator="/"),
    # (the same, its metadata consolidated by zarr 2.18: meta/root/consolidated/.zmetadata)
    "zarr2_consolidated": ZarrCase(shape=(20, 12), chunks=(4, 3), shards=(8, 6), index_crc32c=False,
                                   pattern="sparse", separator="/"),
    # variable shard grids (ZEP 3 rectangular, rectilinear), shown as the regular inner grid
    # (the twin): edge lists, bare-integer steps, [length, repeat] runs (zarr-python writes
    # [8, 8, 4] as [[8, 2], 4]), shards overhanging the array
    "rectilinear_rle_int": B.with_(grid="rectilinear", shards=((8, 8, 4), 6)),
    "rectilinear_edges_v2_gzip": B.with_(shape=(22, 13), grid="rectilinear", shards=((4, 12, 8), (6, 9)),
                                         key_encoding="v2", separator=".", compressor="gzip"),
    "rectilinear_overhang_start": B.with_(grid="rectilinear", shards=((8, 8, 8), (3, 6, 6)),
                                          index_location="start", index_crc32c=False, write_empty_chunks=True),
    "rectangular_edges_be_dot": B.with_(shape=(21, 14), grid="rectangular", shards=((4, 8, 12), (3, 9, 3)),
                                        index_endian="big", separator="."),
    "rectangular_3d": ZarrCase(shape=(6, 8, 10), chunks=(2, 4, 5), shards=((2, 4), 8, (5, 5)), grid="rectangular",
                               pattern="sparse"),
}

#: hierarchies: a consolidated group with nested groups and several arrays (one list of
#: cases each; the first sharded one's chunks make the pool, so all share dtype, inner
#: chunk shape and inner codecs: a pool chunk is valid in every array of it)
HIERARCHIES: dict[str, list[ZarrCase]] = {
    "hier": [B.with_(path="g/a"),
             B.with_(path="g/sub/r", shape=(22, 13), grid="rectilinear", shards=((8, 4, 12), 6),
                     key_encoding="v2", separator="."),
             B.with_(path="top", shape=(9, 7), shards=(8, 6), index_location="start", separator=".",
                     attributes={"k": 0}),
             B.with_(path="g/plain", shape=(8, 6), shards=None, pattern="full")],
    "hier_rect": [B.with_(path="x/y/rect", grid="rectangular", shards=((8, 4, 8), 6), index_endian="big"),
                  B.with_(path="x/b", shape=(12, 9), shards=(4, 9), key_encoding="v2", separator="/")],
}
#: op weights a layout adds (metadata documents written through the mount, consolidation)
LAYOUT_WEIGHTS: dict[str, dict[str, float]] = {
    **{k: {"meta": 3, "resize": 3} for k, c in ZARR_CASES.items() if c.grid != "regular"},
    **{k: {"meta": 6, "consolidate": 2, "resize": 3} for k in HIERARCHIES},
    "zarr2_consolidated": {"meta": 6},
}
#: (the mesh ops: precomputed layouts with a mesh directory, filled in below PRECOMPUTED_CASES)
MESH_WEIGHTS = {"mesh": 12, "meshrm": 3, "meshmv": 3, "meshbad": 2}


# ------------------------------------------------------------------ Neuroglancer precomputed


@dataclass(frozen=True)
class PrecomputedCase:
    """A precomputed store: a sharded volume at ``vol`` (its scales are the datasets) and/or
    a sharded uint64 key-value directory (skeletons) at ``skel``."""

    volume: pp.VolumeCase | None
    kv: dict | None = None  # the skeleton directory's sharding
    mesh: dict | None = None  # the multi-resolution mesh directory's sharding


#: a few stored skeletons (the uint64 edges, an empty one) and ids not stored yet
KV_STORED = {0: b"s0" * 20, 7: b"seven", 2**32: bytes(range(200)), 12345: b"", 2**64 - 1: b"last" * 30,
             2**40 + 3: b"x" * 77}
KV_NEW = [1, 2, 8, 99, 2**63, 2**64 - 2]
#: stored meshes (id: fragments per level of detail; [] none: an empty ``<id>``) and ids not stored yet
MESH_STORED = {0: [1], 1: [3, 1], 5: [], 6: [2], 77: [2, 2, 1], 2**40 + 9: [4], 2**64 - 1: [1, 1]}
MESH_NEW = [2, 9, 12, 2**63]
#: fragments per level of detail the mesh ops draw
MESH_FRAGS = [[], [1], [3], [3, 1], [2, 2, 1]]


class PrecomputedNames(Names):
    def __init__(self, case: PrecomputedCase):
        self.roots, self.meta, self.chunks, self.outside, self.chunkdirs = [], [], {}, {}, set()
        self.sizes: dict[str, int] = {}  # volume chunk -> bytes of a raw chunk there
        v = case.volume
        if v is not None:
            self.meta.append("vol/info")
            item = np.dtype(v.data_type).itemsize * v.num_channels
            for k in range(v.num_scales):
                size, off, key = pp.scale_params(v, k)
                root = f"vol/{key}"
                self.roots.append(root)
                grid = [-(-s // c) for s, c in zip(size, v.chunk_size)]

                def box(pos, clip=True, shift=0):
                    lo = [o + p * c for o, p, c in zip(off, pos, v.chunk_size)]
                    hi = [o + (min((p + 1) * c, s) if clip else (p + 1) * c) for o, p, c, s in
                          zip(off, pos, v.chunk_size, size)]
                    lo[0] += shift
                    return f"{root}/" + "_".join(f"{a}-{b}" for a, b in zip(lo, hi))
                for pos in np.ndindex(*grid):
                    self.chunks[box(pos)] = (k, pos)
                    self.sizes[box(pos)] = item * int(np.prod([min((p + 1) * c, s) - p * c for p, c, s in
                                                               zip(pos, v.chunk_size, size)]))
                for d in range(3):  # one step past the grid in each dimension
                    pos = [0, 0, 0]
                    pos[d] = grid[d]
                    self.outside[box(pos, clip=False)] = (k, tuple(pos))
                last = tuple(g - 1 for g in grid)
                for name in (box(last, clip=False), box((0, 0, 0), shift=1), f"{root}/7"):
                    if name not in self.chunks:  # (an unclipped edge box, a misaligned one, an id)
                        self.outside[name] = (k, None)
        if case.kv is not None:
            self.meta.append("skel/info")
            self.roots.append("skel")
            for i in sorted(KV_STORED) + KV_NEW:
                self.chunks[f"skel/{i}"] = i
            for name in (str(2**64), "017", "-1", "5.index", "0-8_0-8_0-8"):
                self.outside[f"skel/{name}"] = None
        if case.mesh is not None:
            self.meta.append("mesh/info")
            self.roots.append("mesh")
            self.mesh_root = "mesh"
            self.mesh_ids = sorted(MESH_STORED) + MESH_NEW
            self.units = set()
            for i in self.mesh_ids:
                for name in (f"mesh/{i}", f"mesh/{i}.index"):
                    self.chunks[name] = i
                    self.units.add(name)
            # (``5.index.index`` is no chunk's spelling: a plain file there, stored at fsync)
            for name in (str(2**64), f"{2**64}.index", "017", "017.index", "-1", "0-8_0-8_0-8"):
                self.outside[f"mesh/{name}"] = None
        self.arr = self.roots[0]
        self.keep_dirs = [r for r in self.roots if f"{r}/info" not in self.meta]  # (scales)
        self.extra_dirs = list(self.keep_dirs)
        self.lenient_parents = False
        self._finish()


class PrecomputedLayout(Layout):
    """Neuroglancer precomputed ``neuroglancer_uint64_sharded_v1``, written by tensorstore.

    A raw volume's chunk is valid when it has the size of its (clipped) box; any bytes are
    a valid skeleton.  Other files in a scale or key-value directory are plain files stored
    at fsync/sync/unmount (as in a Zarr array's own directory); ``<hex>.shard`` names
    (stored as written: SEMANTICS 4.9) are not drawn.  A multi-resolution mesh directory
    (``mesh``) holds pairs ``<id>.index`` (manifest) and ``<id>`` (fragment data), changed
    by the mesh ops only; the final check reads every stored mesh from the shards (the
    fragment data just before its manifest) and tensorstore reads the manifests."""

    def __init__(self, case: PrecomputedCase):
        self.case = case
        self.names = PrecomputedNames(case)

    def build(self, src, twin):
        with tempfile.TemporaryDirectory(dir=src.parent) as tmp:
            if self.case.volume is not None:
                t = pp.write_volume_twins(Path(tmp), self.case.volume)
                shutil.move(t.sharded, src / "vol")
                shutil.move(t.unsharded, twin / "vol")
            if self.case.kv is not None:
                t = pp.write_kv_twins(Path(tmp), "skel", self.case.kv, dict(KV_STORED))
                shutil.move(t.sharded, src / "skel")
                shutil.move(t.unsharded, twin / "skel")
            if self.case.mesh is not None:
                meshes = {i: pp.make_mesh(k, f) for k, (i, f) in enumerate(sorted(MESH_STORED.items()))}
                t = pp.write_mesh_twins(Path(tmp) / "mesh", self.case.mesh, meshes)
                shutil.move(t.sharded, src / "mesh")
                shutil.move(t.unsharded, twin / "mesh")

    def pool(self, twin):
        pool = [(twin / rel).read_bytes() for rel in self.names.free_chunks if (twin / rel).is_file()]
        for i, n in enumerate(sorted(set(self.names.sizes.values()))):
            pool.append(random.Random(i).randbytes(n))
        self._pool = pool
        return pool

    def valid(self, rel, data):
        return rel not in self.names.sizes or len(data) == self.names.sizes[rel]

    def normal(self, rel):
        return random.Random(zlib.crc32(rel.encode())).randbytes(self.names.sizes.get(rel, 100))

    def peers_check(self, env, src, hidden):
        out = []
        v = self.case.volume
        if v is not None:
            for k in range(v.num_scales):
                key = pp.scale_params(v, k)[2]
                try:
                    a, b = pp.read_volume(src / "vol", key), pp.read_volume(env.twin / "vol", key)
                    if not np.array_equal(a, b):
                        out.append(f"[final] tensorstore: scale {key} differs at {np.argwhere(a != b)[:5].tolist()}")
                except Exception as e:
                    out.append(f"[final] tensorstore failed on scale {key}: {e!r}"[:500])
        if self.case.kv is not None:
            try:
                got = pp.read_kvstore(src / "skel", self.case.kv)
            except Exception as e:
                return out + [f"[final] tensorstore failed on skel: {e!r}"[:500]]
            want = {int(p.name): p.read_bytes() for p in (env.twin / "skel").iterdir()
                    if p.is_file() and self.names.kind(f"skel/{p.name}") == "chunk"}
            if got != want:
                diff = sorted(k for k in set(got) | set(want) if got.get(k) != want.get(k))
                out.append(f"[final] tensorstore: skeletons differ at ids {diff[:5]}")
        if self.case.mesh is not None:
            twin = env.twin / "mesh"
            want = {i: ((twin / f"{i}.index").read_bytes(), (twin / str(i)).read_bytes())
                    for i in self.names.mesh_ids if (twin / f"{i}.index").is_file()}
            got = pp.read_mesh_shards(src / "mesh", self.case.mesh)
            if got != want:
                diff = sorted(k for k in set(got) | set(want) if got.get(k) != want.get(k))
                out.append(f"[final] stored meshes differ at ids {diff[:5]}: "
                           f"{[got.get(k) if isinstance(got.get(k), str) else None for k in diff[:3]]}")
            try:
                manifests = pp.read_kvstore(src / "mesh", self.case.mesh)
                if manifests != {i: m for i, (m, _) in want.items()}:
                    out.append("[final] tensorstore: mesh manifests differ")
            except Exception as e:
                out.append(f"[final] tensorstore failed on mesh: {e!r}"[:500])
        return out


def _vol(name, data_type, shard, size, chunk, offset=(0, 0, 0), scales=2, channels=1, key_prefix=""):
    return pp.VolumeCase(name, data_type, "raw", shard, size=size, chunk_size=chunk, voxel_offset=offset,
                         num_scales=scales, num_channels=channels, sparse=True, key_prefix=key_prefix)


S = pp.sharding
#: volumes with odd edges and two or three scales, and skeleton directories, across the
#: sharding variants: both hashes, preshift, minishard/shard bits (0 included), raw/gzip
#: minishard indexes and data
PRECOMPUTED_CASES: dict[str, PrecomputedCase] = {
    "pc_identity_raw": PrecomputedCase(
        _vol("v", "uint8", S("identity", 0, 1, 2), (20, 18, 9), (8, 8, 8), (3, 0, 0)),
        S("murmurhash3_x86_128", 0, 2, 3, "gzip", "gzip")),
    "pc_murmur_gzip_preshift": PrecomputedCase(
        _vol("v", "uint8", S("murmurhash3_x86_128", 2, 2, 2, "gzip", "gzip"), (19, 17, 10), (8, 8, 4),
             (-5, 7, 11), channels=2),
        S("identity", 3, 1, 0, "raw", "raw")),
    "pc_u64_datagzip_shard0": PrecomputedCase(
        _vol("v", "uint64", S("identity", 1, 2, 0, "raw", "gzip"), (17, 12, 9), (8, 8, 8), (100, 200, 300)),
        S("murmurhash3_x86_128", 5, 0, 1, "raw", "gzip")),
    "pc_idxgzip_single_3scales": PrecomputedCase(
        _vol("v", "uint16", S("murmurhash3_x86_128", 0, 0, 0, "gzip", "raw"), (20, 20, 12), (8, 8, 8), scales=3),
        S("identity", 0, 1, 1, "gzip", "raw")),
    # scale keys of several names ("s/t/1_1_1"): the scales' directories below plain ones
    "pc_deep_keys": PrecomputedCase(
        _vol("v", "uint8", S("murmurhash3_x86_128", 0, 1, 1, "gzip", "gzip"), (20, 18, 9), (8, 8, 8), (3, 0, 0),
             key_prefix="s/t/"),
        S("identity", 0, 1, 1)),
    # multi-resolution meshes (and a skeleton directory, for the other ops' chunks)
    "pc_mesh_identity_datagzip": PrecomputedCase(None, S("identity", 0, 1, 1), S("identity", 0, 1, 1, "raw", "gzip")),
    "pc_mesh_murmur_idxgzip_single": PrecomputedCase(None, S("murmurhash3_x86_128", 0, 0, 1, "raw", "gzip"),
                                                     S("murmurhash3_x86_128", 1, 2, 0, "gzip", "raw")),
}

LAYOUT_WEIGHTS.update({k: MESH_WEIGHTS for k, c in PRECOMPUTED_CASES.items() if c.mesh is not None})

#: every layout the tester runs, by name
LAYOUTS: dict = {
    **{name: functools.partial(ZarrLayout, case, name.startswith("zarr2"), None, name == "zarr2_consolidated")
       for name, case in ZARR_CASES.items()},
    **{name: functools.partial(ZarrLayout, cases[0], False, cases) for name, cases in HIERARCHIES.items()},
    **{name: functools.partial(PrecomputedLayout, case) for name, case in PRECOMPUTED_CASES.items()},
}


# ------------------------------------------------------------------ environment


class Env:
    def __init__(self, layout: str, backend: str, opts: list[str], work: Path, log=print):
        self.layout, self.backend, self.opts = layout, backend, opts
        self.case: Layout = LAYOUTS[layout]()
        self.work = work
        self.src = work / "src"
        self.twin = work / "twin"
        self.mnt = work / "mnt"
        self.log = log
        self.names = self.case.names
        #: (twin) in-grid chunk directories of stored arrays removed by rmdir through the
        #: mount and not made again: the mount remembers them (gone while empty, SEMANTICS
        #: Limits) until it ends, so every mount starts without them (:meth:`mount`)
        self.removed_chunkdirs: set[str] = set()
        if backend == "s3":
            self.names.on_s3()
        self.server = None
        self.bucket = None
        self.proxy = None  # (S3) the TcpProxy the mount talks through: network faults (op ``faults``)
        self.mount_count = 0
        #: mount point -> pid of the daemon this run started there last (teardown ends each)
        self.daemons: dict[Path, int | None] = {}
        #: (with -o index_cache=) index loads and evictions of the mounts unmounted so far
        self.index_cache = {"loads": 0, "evicted": 0}
        #: (the ``other`` op) names the ops changed since the mount last held nothing unstored
        #: (a sync, an unmount, a kill -9): chunks among them may still be dirty in it, so
        #: another client's change of one may show or not (the mount's own version wins the
        #: merge); ``touched_all``: any chunk may be (a resize or a directory rename was made)
        self.touched: set[str] = set()
        self.touched_all = False
        #: (the ``other`` op) the second mount another client writes chunks through
        self.other_mnt = work / "mnt-other"

    # -- setup
    def setup(self, server=None):
        for d in (self.src, self.twin, self.mnt):
            d.mkdir(parents=True, exist_ok=True)
        self.case.build(self.src, self.twin)
        seeds = [("notes.txt", b"hello\n"), ("plain/a.bin", b"A" * 100)]
        if self.backend == "s3":  # S3 has no empty directories: keep one file in each (never touched)
            seeds += [("plain/.keep", b"k"), ("plain/sub/.keep", b"k")]
            seeds += [(f"{d}/.keep", b"k") for d in self.names.keep_dirs]
        for rel, data in seeds:
            for root in (self.src, self.twin):
                (root / rel).parent.mkdir(parents=True, exist_ok=True)
                (root / rel).write_bytes(data)
        self.pool = self.case.pool(self.twin)
        self.data = Data(self.pool, self.case)
        if self.backend == "s3":
            from tests.s3server import TcpProxy
            self.server = server
            self.bucket = server.create_bucket()
            self.proxy = TcpProxy(server.port)
            items = {f"pfx/{p.relative_to(self.src)}": p.read_bytes() for p in self.src.rglob("*") if p.is_file()}
            server.put_many(self.bucket, items)
        self.mount()
        self.case.after_mount(self)

    @property
    def source(self) -> str:
        return str(self.src) if self.backend == "local" else f"s3://{self.bucket}/pfx"

    def mount(self, mnt: Path | None = None, opts: tuple = (), log: str = "daemon.log", direct: bool = False) -> int:
        """Mount the store (at ``mnt``, default the mount point); the daemon's pid. ``direct``
        (S3): to the server itself, not through the proxy's network faults; ``opts`` replace
        the run's options of the same name."""
        endpoint = self.server.endpoint_url if direct and self.server is not None else \
            self.proxy.endpoint_url if self.proxy is not None else None
        extra = [] if self.backend == "local" else ["--endpoint-url", endpoint]
        if mnt is None:
            self.mount_count += 1
            self.removed_chunkdirs.clear()  # (a new daemon: it remembers no rmdir)
        where = mnt or self.mnt
        try:
            mine = [o for o in self.opts if not ("ro" in opts and o.startswith("shard="))  # (refused on ro)
                    and o.split("=")[0] not in {x.split("=")[0] for x in opts}]
            r = run_mount(self.source, where, *mine, *opts, log=self.work / log, extra=extra, check=False)
        finally:
            if os.path.ismount(where):  # (also when the mount command was interrupted)
                try:
                    self.daemons[where] = int(os.getxattr(where, "user.zshardfs.pid"))
                except (OSError, ValueError):
                    self.daemons[where] = None
        if r.returncode:
            raise RuntimeError(f"mount failed: {r.stderr}")
        pid = self.daemons[where]
        if mnt is None:
            self.pid = pid
        return pid

    def umount(self) -> str:
        if any(o.startswith("index_cache=") for o in self.opts) and os.path.ismount(self.mnt):
            self.count_index_cache()
        r = subprocess.run([*ZS, "umount", str(self.mnt)], capture_output=True, text=True, timeout=180)
        if r.returncode:
            return f"umount rc={r.returncode} {r.stderr.strip()}"
        return "ok"

    def count_index_cache(self) -> None:
        """Add the mount's index loads and evictions so far to ``index_cache`` (asked before
        each unmount where ``-o index_cache=`` is given: a run with a small one shows that
        indexes were evicted; a daemon killed takes its counts with it)."""
        r = subprocess.run([*ZS, "stats", "--json", str(self.mnt)], capture_output=True, text=True, timeout=60)
        if r.returncode == 0:
            c = json.loads(r.stdout)["index_cache"]
            self.index_cache["loads"] += c["misses"]
            self.index_cache["evicted"] += c.get("evicted", 0)

    def kill9(self):
        os.kill(self.pid, signal.SIGKILL)
        if not wait_for(lambda: not process_running(self.pid), timeout=30):
            raise RuntimeError(f"daemon {self.pid} still running 30 s after SIGKILL")
        subprocess.run(["fusermount3", "-uz", str(self.mnt)], capture_output=True)

    def teardown(self):
        """Take down what the run started, however it ended (a divergence, an exception,
        KeyboardInterrupt, SIGTERM through scripts/difftest.py): the mount unmounted, and where
        that is refused (a file it could not store yet: right after network faults storage
        calls fail fast, SEMANTICS 5.5) or fails, each mount point detached and its daemon
        ended (tests.util.take_down), before the proxy it talks through closes: a daemon left
        detached would retry storing every 30 s for ever."""
        try:
            if os.path.ismount(self.mnt):
                self.umount()
        except Exception:
            pass
        finally:
            for mnt in {self.mnt, self.work / "mnt-check", *self.daemons}:
                take_down(mnt, self.daemons.get(mnt))  # (also a daemon whose mount an abort interrupted)
        if self.proxy is not None:
            self.proxy.close()
        if self.server and self.bucket:
            try:
                self.server.delete_bucket(self.bucket)
            except Exception:
                pass

    def source_copy(self) -> Path:
        """A local directory holding the source (S3: downloaded)."""
        if self.backend == "local":
            return self.src
        dest = self.work / "s3copy"
        shutil.rmtree(dest, ignore_errors=True)
        for k, v in self.server.snapshot([self.bucket])[self.bucket].items():
            if k.startswith("pfx/"):
                p = dest / k[4:]
                p.parent.mkdir(parents=True, exist_ok=True)
                p.write_bytes(v)
        return dest

    def daemon_log(self) -> str:
        return "".join(p.read_text(errors="replace") for p in sorted(self.work.glob("daemon*.log")))

    # -- another client (the ``other`` op)
    def clean(self) -> None:
        """The mount holds nothing unstored now (a sync, an unmount, a kill -9)."""
        self.touched = set()
        self.touched_all = False

    def other_mount(self) -> Path:
        """The second mount of the store another client writes chunks through (mounted at the
        first ``other`` op; on S3 straight to the server, never through the proxy's faults)."""
        if not os.path.ismount(self.other_mnt):
            self.other_mnt.mkdir(exist_ok=True)
            self.mount(self.other_mnt, OTHER_OPTS, log="daemon-other.log", direct=True)
        return self.other_mnt

    def store_keys(self) -> list[str]:
        """Every key in storage (relative to the store's root)."""
        if self.backend == "local":
            return sorted(str(p.relative_to(self.src)) for p in self.src.rglob("*") if p.is_file())
        return sorted(k[4:] for k, _ in self.server._iter_objects(self.bucket) if k.startswith("pfx/"))

    def stored_shards(self, meshes: bool = True) -> list[str]:
        """The keys in storage that are shards of the datasets (the ``other`` op's ``rmshard``;
        ``meshes``: a multi-resolution mesh directory's too)."""
        n = self.names
        out = []
        for k in self.store_keys():
            if not meshes and n.mesh_root and k.startswith(n.mesh_root + "/"):
                continue
            base = k.rsplit("/", 1)[-1]
            if k in n.meta or base.startswith(".") or k.endswith(".__lock") or k in n.arr_plain or \
                    not any(k.startswith(r + "/") for r in n.roots):
                continue
            if isinstance(n, PrecomputedNames) and not base.endswith(".shard"):
                continue
            out.append(k)
        return out

    def stored_chunks(self, root: Path) -> set[str]:
        """The chunk names the mount at ``root`` lists (the other client's mount: what storage holds)."""
        out = set()
        for r in self.names.roots:
            for dirpath, _, filenames in os.walk(root / r):
                for fn in filenames:
                    rel = str((Path(dirpath) / fn).relative_to(root))
                    if self.names.kind(rel) == "chunk":
                        out.add(rel)
        return out

    def delete_key(self, key: str) -> None:
        """Another client deletes ``key`` (local: under the directory's flock, as zshardfs
        processes take it for their conditional writes: no flush lands between its check
        and its rename unseen)."""
        if self.backend == "s3":
            self.server.s3.delete_object(Bucket=self.bucket, Key=f"pfx/{key}")
            return
        path = self.src / key
        with _dir_locked(path.parent):
            os.unlink(path)

    def read_key(self, key: str) -> bytes:
        if self.backend == "s3":
            return self.server.s3.get_object(Bucket=self.bucket, Key=f"pfx/{key}")["Body"].read()
        return (self.src / key).read_bytes()

    def put_key(self, key: str, data: bytes) -> None:
        """Another client replaces ``key`` (local: a new file renamed over it, under the
        directory's flock)."""
        if self.backend == "s3":
            self.server.s3.put_object(Bucket=self.bucket, Key=f"pfx/{key}", Body=data)
            return
        path = self.src / key
        with _dir_locked(path.parent):
            tmp = path.with_name(f".other-{os.getpid()}.tmp")
            tmp.write_bytes(data)
            os.replace(tmp, path)


@contextlib.contextmanager
def _dir_locked(directory: Path):
    """Hold ``directory``'s flock (as zshardfs processes take it for their
    conditional writes) while the body changes it; fsync it before letting go."""
    dfd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.flock(dfd, fcntl.LOCK_EX)
        try:
            yield
            os.fsync(dfd)
        finally:
            fcntl.flock(dfd, fcntl.LOCK_UN)
    finally:
        os.close(dfd)


# ------------------------------------------------------------------ operations


def _open(path, flags):
    return os.open(path, flags, 0o644)


class ShortWrite(Exception):
    """A write that wrote less than asked without an error (never right on a regular file of
    the mount, whose write is all of it or an error). The op stops there, its result is
    "short write: n of m bytes" (Applier.apply), which no errno network faults may give
    (fault_failed is false): a divergence from the twin's result, faults or not. Not an
    OSError: no op's ``except OSError`` takes it for an errno."""


def _write(fd: int, data: bytes, off: int | None = None) -> int:
    """os.write (``off`` None) or os.pwrite of all of ``data``, or ShortWrite."""
    n = os.write(fd, data) if off is None else os.pwrite(fd, data, off)
    if n != len(data):
        raise ShortWrite(f"short write: {n} of {len(data)} bytes")
    return n


def _pwritten(data: bytes | None, writes: list[tuple[int, bytes]]) -> bytes:
    """``data`` (None: a file created) after the pwrites (offset, bytes)."""
    out = bytearray(data or b"")
    for off, piece in writes:
        if off > len(out):
            out.extend(bytes(off - len(out)))
        out[off:off + len(piece)] = piece
    return bytes(out)


def _race_step(path: str, kind: str, size, off, data, tmp_tag: str) -> str:
    """One step of a race's mover (in the mover process, or on the twin): "ok", or "short
    write: n of m bytes" when a write wrote less than asked without an error (never right
    on a regular file of the mount, whose write is all of it or an error; the mover stops
    there, and the result, no errno network faults may give, differs from the twin's "ok",
    faults or not). A tmprename whose write was short renames nothing."""
    if kind == "truncate":
        os.truncate(path, size)
    elif kind == "ftruncate":
        fd = os.open(path, os.O_RDWR)
        try:
            os.ftruncate(fd, size)
        finally:
            os.close(fd)
    else:
        tmp = os.path.join(os.path.dirname(path), f".race-tmp.{tmp_tag}") if kind == "tmprename" else path
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | (0 if kind == "pwrite" else os.O_TRUNC), 0o644)
        try:
            n = os.pwrite(fd, data, off) if kind == "pwrite" else os.write(fd, data)
        finally:
            os.close(fd)
        if n != len(data):
            return f"short write: {n} of {len(data)} bytes"
        if kind == "tmprename":
            os.rename(tmp, path)
    return "ok"


#: the race's mover: waits for "go", applies the steps, prints their results (JSON)
_RACE_MOVER = (
    "import os,sys,json,errno\n"
    "path, steps = sys.argv[1], json.loads(sys.argv[2])\n"
    "print('ready', flush=True)\n"
    "sys.stdin.readline()\n"
    "out = []\n"
    "for kind, size, off, data in steps:\n"
    "    try:\n"
    "        out.append(_race_step(path, kind, size, off, bytes.fromhex(data) if data is not None else None,\n"
    "                              str(os.getpid())))\n"
    "    except OSError as e:\n"
    "        out.append(errno.errorcode.get(e.errno, str(e.errno)))\n"
    "    if out[-1] != 'ok':\n"
    "        break\n"
    "print(json.dumps(out), flush=True)\n")
_RACE_MOVER = inspect.getsource(_race_step) + _RACE_MOVER

#: the race's watcher: opens a descriptor (hold), waits for "go", observes until "stop"
#: (sent once the mover has ended; at least 3 rounds), then observes once more: prints
#: [observations, final ones] (JSON). A round the same as the 3 before it is not kept
#: (more copies tell the checker nothing new), nor any past 5000 kept.
_RACE_WATCHER = (
    "import os,sys,json,errno,select,hashlib\n"
    "path, parent, kinds, hold = sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), bool(sys.argv[4])\n"
    "name = os.path.basename(path)\n"
    "try:\n"
    "    fd, no_fd = (os.open(path, os.O_RDONLY) if hold else None), None\n"
    "except OSError as e:\n"
    "    fd, no_fd = None, errno.errorcode.get(e.errno, str(e.errno))\n"
    "def md(b):\n"
    "    return f'{len(b)}:{hashlib.md5(b).hexdigest()[:10]}'\n"
    "def look(kind, exact):\n"
    "    if kind in ('fstat', 'pread') and no_fd:\n"
    "        return no_fd\n"
    "    try:\n"
    "        if kind == 'stat':\n"
    "            return os.stat(path).st_size\n"
    "        if kind == 'fstat':\n"
    "            return os.fstat(fd).st_size\n"
    "        if kind == 'list':\n"
    "            return name in os.listdir(parent)\n"
    "        if kind == 'scan':\n"
    "            return [e.stat().st_size for e in os.scandir(parent) if e.name == name]\n"
    "        if kind == 'pread':\n"
    "            b = os.pread(fd, 1 << 20, 0)\n"
    "        else:\n"
    "            r = os.open(path, os.O_RDONLY)\n"
    "            try:\n"
    "                b = os.read(r, 1 << 20)\n"
    "            finally:\n"
    "                os.close(r)\n"
    "        return md(b) if exact else len(b)\n"
    "    except OSError as e:\n"
    "        return errno.errorcode.get(e.errno, str(e.errno))\n"
    "print('ready', flush=True)\n"
    "sys.stdin.readline()\n"
    "obs, rounds, last, same = [], 0, None, 0\n"
    "while rounds < 3 or not select.select([sys.stdin], [], [], 0)[0]:\n"
    "    rnd = [[k, look(k, False)] for k in kinds]\n"
    "    same = same + 1 if rnd == last else 0\n"
    "    last = rnd\n"
    "    if same < 3 and rounds < 5000:\n"
    "        obs.extend(rnd)\n"
    "        rounds += 1\n"
    "sys.stdin.readline()\n"
    "final = [[k, look(k, True)] for k in ('stat', 'list', 'scan', 'read') + (('fstat', 'pread') if hold else ())]\n"
    "print(json.dumps([obs, final]), flush=True)\n")


#: where the kernel may split one write(2) into several WRITE requests (see _race_verdict)
PAGE_SIZE = os.sysconf("SC_PAGE_SIZE")


def _ok_then(results: list, first: str, then: str) -> bool:
    """Is ``results`` some ``first`` answers followed by ``then`` answers only?"""
    k = 0
    while k < len(results) and results[k] == first:
        k += 1
    return all(r == then for r in results[k:])


def _race_verdict(obs: list, final: list, path_states: list, held_states: list, written: list,
                  faulty: bool = False, ends_from: int | None = None) -> str:
    """``watch ok``, or the first observation no state in order explains (see Applier.op_race).
    ``held_states``: per state, the versions a held descriptor may show (one or two);
    ``written``: per state, whether a write of bytes through a descriptor made it. Under
    network faults (``faulty``) an observation that failed with one of FAULT_ERRNOS tells
    nothing and is passed over; a mover step that failed under them may have done its work
    or not: the states from ``ends_from`` (the one before that step) on may each be the last."""
    def one(kind, value, s, exact):
        if kind in ("stat", "fstat"):
            return value == (len(s) if s is not None else "ENOENT")
        if kind in ("list", "scan") and s is None and value == "ENOENT":
            return True  # (no file, and no directory either: a precomputed scale removed)
        if kind == "list":
            return value == (s is not None)
        if kind == "scan":
            return value == ([len(s)] if s is not None else [])
        if s is None:
            return value == "ENOENT"
        return value == (h(s) if exact else len(s))

    def fits(kind, value, k, exact=False):
        alts = held_states[k] if kind in ("fstat", "pread") else [path_states[k]]
        if any(one(kind, value, s, exact) for s in alts):
            return True
        if exact or k + 1 >= len(path_states):
            return False
        nxt = held_states[k + 1] if kind in ("fstat", "pread") else [path_states[k + 1]]
        if kind in ("stat", "fstat", "scan"):
            # a write(2) that makes the next state may reach the daemon as several
            # WRITE requests (the kernel ends one at a partial page it does not
            # hold: a 4096-byte pwrite at 2000 is 2096 bytes at 2000, then 2000 at
            # 4096), and a size asked between them is the part written so far
            # (SEMANTICS, Limits: a stat may run ahead of reads): a page boundary
            # between the two sizes, never during a truncate (one request)
            size = value[0] if kind == "scan" and isinstance(value, list) and len(value) == 1 else value
            return (written[k + 1] and type(size) is int and size % PAGE_SIZE == 0
                    and any(a is not None and b is not None and len(a) < size < len(b) for a in alts for b in nxt))
        if kind not in ("read", "pread") or not isinstance(value, int):
            return False
        # a read running while the next step changes the size may end between
        # the two sizes (the kernel ends it at a short answer of the daemon)
        return any(a is not None and b is not None and min(len(a), len(b)) <= value <= max(len(a), len(b))
                   for a in alts for b in nxt)

    def sizes(states):
        return [None if s is None else len(s) for s in states]
    k, kr = 0, {}  # the latest state any observation showed; each kind's
    for i, (kind, value) in enumerate(obs):
        if faulty and value in FAULT_ERRNOS:
            continue
        # an observation may show the state before the latest one another
        # showed (the step in flight: SEMANTICS, Limits, "a stat may run ahead
        # of reads": the daemon answers with it, the kernel's own size lags
        # until the call returns; a held descriptor's inode, a file's by path
        # and the listing's lag each on their own), never one before its kind's
        first = max(kr.get(kind, 0), k - 1)
        nxt = next((j for j in range(first, len(path_states)) if fits(kind, value, j)), None)
        if nxt is None:
            return (f"watch: observation {i} {kind} -> {value} fits no state from {first} on "
                    f"(sizes {sizes(path_states)}, held {[sizes(a) for a in held_states]}; "
                    f"before: {obs[max(0, i - 6):i]})")
        k = max(k, nxt)
        kr[kind] = nxt
    last = len(path_states) - 1
    final = [(kind, value) for kind, value in final if not (faulty and value in FAULT_ERRNOS)]
    ends = range(last if ends_from is None else ends_from, last + 1)
    if not any(all(fits(kind, value, e, exact=True) for kind, value in final) for e in ends):
        bad = [(kind, value) for kind, value in final if not fits(kind, value, ends[-1], exact=True)]
        return (f"watch: after the mover {bad} is not its last state "
                f"({h(path_states[last])}, held {[h(s) for s in held_states[last]]}"
                f"{'' if len(ends) == 1 else f'; nor any from state {ends[0]} on'})")
    return "watch ok"


class Applier:
    """Applies one op to one root.  twin=True emulates the documented differences."""

    def __init__(self, env: Env, root: Path, twin: bool):
        self.env, self.root, self.twin, self.names = env, root, twin, env.names
        self.on_the_way: dict[str, list[bytes]] = {}  # (twin) file -> states an op passed through
        self.under_faults = False  # (mount) network faults are on while it applies the op (Runner.step)
        self.stored_now: dict | None = None  # (twin, dirmv) below a directory one rename moved: all stored
        self.late_tmp = 0  # (twin, dirmv) temporaries left below src taken as the mount shows them

    def p(self, rel):
        return self.root / rel

    def _twin_prepare(self, rel: str, creating: bool) -> str | None:
        """Twin emulation before an op that creates `rel`: chunk dirs exist; outside names are ENOENT."""
        if not self.twin:
            return None
        k = self.names.kind(rel)
        if k in ("outside", "outdir") or any(rel.startswith(d + "/") for d in self.names.out_dirs):
            return "ENOENT" if creating else None
        if (k == "chunk" and self.names.lenient_parents) or k == "chunktmp" or \
                (self.names.in_chunk_tree(rel) and k != "chunkdir"):
            if self._below_removed_chunkdir(rel, self_too=False):
                return "ENOENT" if creating else None
            parent = self.p(rel).parent
            parent.mkdir(parents=True, exist_ok=True)
        if k == "chunkdir":
            if self._below_removed_chunkdir(rel, self_too=False):
                return "ENOENT" if creating else None
            self.p(rel).parent.mkdir(parents=True, exist_ok=True)
        return None

    def _below_removed_chunkdir(self, rel: str, self_too: bool = True) -> bool:
        """(twin) Is ``rel`` (or, ``self_too``, ``rel`` itself) below a chunk directory
        removed by rmdir and not made again (:attr:`Env.removed_chunkdirs`), one the twin
        has not made again either?  The mount answers ENOENT there, as a directory store."""
        gone = self.env.removed_chunkdirs
        if not gone:
            return False
        path = rel if self_too else rel.rpartition("/")[0]
        while path:
            if path in gone and not self.p(path).is_dir():
                return True
            path = path.rpartition("/")[0]
        return False

    def apply(self, op: dict):
        kind = op["op"]
        try:
            return getattr(self, "op_" + kind)(op)
        except OSError as e:
            return errname(e)
        except ShortWrite as e:
            return str(e)

    def _on_fd(self, rel: str, flags: int, use=None) -> str:
        """Open ``rel``, pass the descriptor to ``use``, close it."""
        fd = _open(self.p(rel), flags)
        try:
            if use is not None:
                use(fd)
        finally:
            os.close(fd)
        return "ok"

    def op_write(self, op):
        data, cut = self.env.data.get(op["data"]), op.get("pieces", 1)
        step = max(1, len(data) // cut)

        def pieces(fd):
            for i in range(0, len(data), step):
                _write(fd, data[i:i + step])
        return (self._twin_prepare(op["path"], True)
                or self._on_fd(op["path"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, pieces))

    def op_pwrite(self, op):
        data = self.env.data.get(op["data"])
        return (self._twin_prepare(op["path"], True)
                or self._on_fd(op["path"], os.O_WRONLY | os.O_CREAT, lambda fd: _write(fd, data, op["off"])))

    def op_append(self, op):
        data = self.env.data.get(op["data"])
        return (self._twin_prepare(op["path"], True)
                or self._on_fd(op["path"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, lambda fd: _write(fd, data)))

    def op_otrunc(self, op):
        return self._on_fd(op["path"], os.O_WRONLY | os.O_TRUNC)

    def op_truncate(self, op):
        os.truncate(self.p(op["path"]), op["size"])
        return "ok"

    def op_ftruncate(self, op):
        return self._on_fd(op["path"], os.O_RDWR, lambda fd: os.ftruncate(fd, op["size"]))

    def op_unlink(self, op):
        os.unlink(self.p(op["path"]))
        return "ok"

    def op_rename(self, op):
        if self.twin:
            if not self.p(op["src"]).exists():
                return "ENOENT"
            if (r := self._twin_prepare(op["dst"], True)):
                return r
            if self.p(op["src"]).is_dir():
                return "EXDEV" if not self.p(op["dst"]).is_file() else "ENOTDIR"
        os.rename(self.p(op["src"]), self.p(op["dst"]))
        return "ok"

    def op_link(self, op):
        if self.twin:
            s, d = self.p(op["src"]), self.p(op["dst"])
            if not s.exists():
                return "ENOENT"
            if s.is_dir():
                return "EPERM"
            if (r := self._twin_prepare(op["dst"], True)):
                return r
            if d.exists() or d.is_symlink():
                return "EEXIST"
            if not d.parent.is_dir():
                return "ENOENT"
            shutil.copyfile(s, d)
            return "ok"
        os.link(self.p(op["src"]), self.p(op["dst"]))
        return "ok"

    def op_mkdir(self, op):
        rel = op["path"]
        if self.twin:
            k = self.names.kind(rel)
            if k == "chunkdir":
                if self._below_removed_chunkdir(rel, self_too=False):
                    return "ENOENT"
                if self._below_removed_chunkdir(rel):  # (removed by rmdir: made again)
                    self.env.removed_chunkdirs.discard(rel)
                    self.p(rel).mkdir(parents=True, exist_ok=True)
                    return "ok"
                self.p(rel).mkdir(parents=True, exist_ok=True)
                return "EEXIST"  # lenient lookup: an in-grid chunk directory always exists
            if k == "outdir":
                return "ENOENT"
        os.mkdir(self.p(rel))
        return "ok"

    def op_rmdir(self, op):
        rel = op["path"]
        if self.twin and self.names.kind(rel) == "outdir":  # (left empty by a resize: outside the grid)
            shutil.rmtree(self.p(rel), ignore_errors=True)
            return "ENOENT"
        if self.twin and self.names.kind(rel) == "chunkdir":
            p = self.p(rel)
            if self._below_removed_chunkdir(rel):
                return "ENOENT"  # (removed already: the mount remembers its rmdir)
            if p.exists() and any(q.is_file() for q in p.rglob("*")):
                return "ENOTEMPTY"
            shutil.rmtree(p, ignore_errors=True)
            self.env.removed_chunkdirs.add(rel)
            return "ok"
        os.rmdir(self.p(rel))
        return "ok"

    def op_hold(self, op):
        """Open `path` for writing, write a piece, read it and `other` meanwhile, write more, close."""
        if (r := self._twin_prepare(op["path"], True)):
            return r
        out = []
        fd = _open(self.p(op["path"]), os.O_RDWR | os.O_CREAT | (os.O_TRUNC if op.get("trunc") else 0))
        try:
            _write(fd, self.env.data.get(op["d1"]), op["o1"])
            out.append(h(os.pread(fd, 1 << 22, 0)))
            out.append(self._read(op["path"]))
            out.append(self._read(op["other"]))
            out.append(os.fstat(fd).st_size)
            out.append(os.stat(self.p(op["path"])).st_size)
            if op.get("mid") == "rename":
                try:
                    self._rename_mid(op["path"], op["dst"])
                    out.append("renamed")
                    if self.twin:  # (what the rename stored under the new name: a state on the way)
                        self.on_the_way.setdefault(op["dst"], []).append(self.p(op["dst"]).read_bytes())
                except OSError as e:
                    out.append(errname(e))
            elif op.get("mid") == "unlink":
                try:
                    os.unlink(self.p(op["path"]))
                    out.append("unlinked")
                except OSError as e:
                    out.append(errname(e))
            _write(fd, self.env.data.get(op["d2"]), op["o2"])
            out.append(h(os.pread(fd, 1 << 22, 0)))
        finally:
            os.close(fd)
        out.append(self._read(op["path"]))
        if op.get("dst"):
            out.append(self._read(op["dst"]))
        return out

    def _rename_mid(self, a, b):
        if self.twin and (r := self._twin_prepare(b, True)):
            raise OSError(errno.ENOENT, r)
        os.rename(self.p(a), self.p(b))

    def op_readopen(self, op):
        """Open `path` read-only, then unlink/overwrite it by name, and read through the old descriptor."""
        out = []
        fd = os.open(self.p(op["path"]), os.O_RDONLY)
        try:
            if op["then"] == "unlink":
                os.unlink(self.p(op["path"]))
            else:
                self.op_write({"path": op["path"], "data": op["data"]})
            out.append(h(os.pread(fd, 1 << 22, 0)))
        finally:
            os.close(fd)
        out.append(self._read(op["path"]))
        return out

    def op_tmprename(self, op):
        """The write-temporary-then-rename pattern (zarr-python's)."""
        tmp, dst = op["tmp"], op["path"]
        if (r := self._twin_prepare(tmp, True)):
            return r
        data = self.env.data.get(op["data"])

        def write(fd):
            _write(fd, data)
            if op.get("fsync"):
                os.fsync(fd)
        self._on_fd(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, write)
        try:
            if self.twin and (r := self._twin_prepare(dst, True)):
                raise OSError(errno.ENOENT, r)
            os.rename(self.p(tmp), self.p(dst))
        except OSError as e:
            try:
                os.unlink(self.p(tmp))
            except FileNotFoundError:
                # under network faults a failed rename may have done its work (the new name
                # stored, the old one's DELETE given up after an attempt removed it)
                if not (self.under_faults and errname(e) in FAULT_ERRNOS):
                    raise
            return "rename:" + errname(e)
        if op.get("dirfsync"):
            self._on_fd(str(Path(dst).parent), os.O_RDONLY | os.O_DIRECTORY, os.fsync)
        return "ok"

    def op_meta(self, op):
        """A tool's edit of a metadata document through the mount (SEMANTICS 4.9, 4.11, 4.15):
        read it, change attributes (of a consolidated member too) or the fill value, and
        write it back as ``how`` says: in place, in pieces, emptied first (a shell
        redirect after a ``truncate``), a temporary renamed over it, an editor's save
        (rename to ``~``, write anew, unlink the ``~``), removed and put back, or moved
        away and back."""
        rel = op["path"]
        doc = json.loads(self.p(rel).read_bytes())
        target = doc
        if op.get("member"):
            entries = doc.get("metadata") if rel == ZMETADATA else (doc.get("consolidated_metadata") or {}).get("metadata")
            target = (entries or {}).get(op["member"])
            if target is None:
                return "no member"
        target.setdefault("attributes", {}).update(op["attrs"])
        if "fill" in op and (target.get("node_type") == "array" or "storage_transformers" in target
                             or "chunk_memory_layout" in target):  # (v3 or a v3-draft array's)
            target["fill_value"] = op["fill"]
        text = json.dumps(doc, indent=op.get("indent")).encode()
        if op.get("away"):  # zarr 2.18's member document renamed away while the consolidated one is saved
            os.rename(self.p(op["member"]), self.p(op["member"] + ".away"))
            try:
                return self._save_meta(op, rel, text)
            finally:
                os.rename(self.p(op["member"] + ".away"), self.p(op["member"]))
        return self._save_meta(op, rel, text)

    def _save_meta(self, op, rel: str, text: bytes):
        how = op["how"]
        if how in ("write", "pieces"):
            n = max(1, len(text) // (3 if how == "pieces" else 1))

            def pieces(fd):
                for i in range(0, len(text), n):
                    _write(fd, text[i:i + n])
            return self._on_fd(rel, os.O_WRONLY | os.O_TRUNC, pieces)
        if how == "emptied":
            os.truncate(self.p(rel), 0)
            return self._on_fd(rel, os.O_WRONLY, lambda fd: _write(fd, text))
        if how == "tmprename":
            self._on_fd(rel + ".tmp", os.O_WRONLY | os.O_CREAT | os.O_EXCL, lambda fd: _write(fd, text))
            os.rename(self.p(rel + ".tmp"), self.p(rel))
            return "ok"
        if how == "rmput":  # rm, then a saved copy put back by a shell redirect
            os.unlink(self.p(rel))
            return self._on_fd(rel, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, lambda fd: _write(fd, text))
        if how == "mvback":  # mv away, back, then rewritten in place
            os.rename(self.p(rel), self.p(rel + ".bak"))
            os.rename(self.p(rel + ".bak"), self.p(rel))
            return self._on_fd(rel, os.O_WRONLY | os.O_TRUNC, lambda fd: _write(fd, text))
        assert how == "editor", how
        os.rename(self.p(rel), self.p(rel + "~"))
        self._on_fd(rel, os.O_WRONLY | os.O_CREAT | os.O_EXCL, lambda fd: _write(fd, text))
        os.unlink(self.p(rel + "~"))
        return "ok"

    def op_resize(self, op):
        """zarr-python's resize through the mount: the chunks past the new shape are
        deleted first, then the document gets the new shape (SEMANTICS 4.9; a variable
        shard grid grows by one shard edge)."""
        rel = f"{op['path']}/zarr.json"
        doc = json.loads(self.p(rel).read_bytes())
        case = next(c for c in self.names.cases if c.path == op["path"])
        big = case.with_(shape=tuple(max(a, b) for a, b in zip(self.names.largest[case.path], doc["shape"])))
        for c in pz.grid_coords(pz.chunk_bounds(big)):
            if any(i * n >= s for i, n, s in zip(c, case.chunks, op["shape"])):
                key = self.p(f"{case.path}/{pz.chunk_key(case, c)}")
                if os.path.isfile(key):
                    os.unlink(key)
        doc["shape"] = list(op["shape"])
        return self._on_fd(rel, os.O_WRONLY | os.O_TRUNC, lambda fd: _write(fd, json.dumps(doc).encode()))

    def op_consolidate(self, op):
        """zarr-python consolidates the hierarchy's metadata into the root ``zarr.json``."""
        import warnings

        import zarr
        try:
            with warnings.catch_warnings(), zarr.config.set({"array.rectilinear_chunks": True}):
                warnings.simplefilter("ignore")
                zarr.consolidate_metadata(zarr.storage.LocalStore(self.root))
        except OSError:
            raise
        except Exception as e:
            return f"{type(e).__name__}: {str(e).replace(str(self.root), 'ROOT')[:200]}"
        return "ok"

    # -- multi-resolution meshes: a pair of files, changed whole (SEMANTICS 4.10, Limits)

    def _mesh(self, i) -> tuple[Path, Path]:
        d = self.root / self.names.mesh_root
        return d / f"{i}.index", d / str(i)

    def _mesh_fsync(self, i, which: int) -> str:
        """fsync(2) of one file of mesh ``i`` (its shard's flush): the twin's answer is EIO
        while the pair is inconsistent, as the view refuses such a shard (the other meshes
        of that shard are consistent: every other op keeps them so)."""
        path = self._mesh(i)[which]
        if self.twin:
            manifest, frags = (p.read_bytes() if p.is_file() else None for p in self._mesh(i))
            if manifest is None:
                ok = not frags
            else:
                ok = pp.manifest_fragment_bytes(manifest) == len(frags or b"")
            return "ok" if ok else "EIO"
        try:
            self._on_fd(str(path.relative_to(self.root)), os.O_RDONLY, os.fsync)
        except OSError as e:
            return errname(e)
        return "ok"

    def _write_file(self, path: Path, data: bytes, tmp: str | None = None) -> None:
        if tmp is None:
            path.write_bytes(data)
            return
        t = path.parent / tmp
        t.write_bytes(data)
        os.rename(t, path)

    def op_mesh(self, op):
        """A mesh written whole: ``put`` fragment data, then manifest (``put_rev`` the other
        way round; ``tmp`` each through a temporary renamed over it), or ``manifest``: the
        manifest alone, rewritten with another chunk shape (same fragment sizes); then
        (``fsync``) an fsync of the manifest."""
        index, frags = self._mesh(op["id"])
        manifest, data = pp.make_mesh(op["seed"], op["frags"])
        how = op["how"]
        if how == "manifest":
            old = bytearray(index.read_bytes())
            old[:12] = np.array([op["seed"] % 7 + 1] * 3, "<f4").tobytes()
            index.write_bytes(bytes(old))
        elif how == "put_rev":
            index.write_bytes(manifest)
            frags.write_bytes(data)
        else:
            tmp = f".mesh-tmp.{op['seed']}" if how == "tmp" else None
            self._write_file(frags, data, tmp)
            self._write_file(index, manifest, tmp)
        return self._mesh_fsync(op["id"], 0) if op.get("fsync") else "ok"

    def op_meshrm(self, op):
        """``rm <id>.index``: the mesh goes (its fragment data too)."""
        index, frags = self._mesh(op["id"])
        os.unlink(index)
        if self.twin and frags.exists():
            frags.unlink()
        return "ok" if not frags.exists() else "fragments left"

    def op_meshmv(self, op):
        """A mesh renamed onto another id (which it replaces): ``<id>`` first, then
        ``<id>.index`` (SEMANTICS, Limits)."""
        (si, sf), (di, df) = self._mesh(op["src"]), self._mesh(op["dst"])
        if self.twin and not si.exists():
            return "ENOENT"
        os.rename(sf, df)
        os.rename(si, di)
        return "ok" if not sf.exists() else "fragments left"

    def op_meshbad(self, op):
        """An inconsistent pair: a manifest whose fragment sizes the fragment data does not
        match, fsynced (EIO: its shard is not stored), then mended by writing the fragment
        data it describes, fsynced (ok)."""
        index, frags = self._mesh(op["id"])
        manifest, data = pp.make_mesh(op["seed"], op["frags"])
        out = []
        with open(index, "wb") as f:
            f.write(manifest)
        out.append(self._mesh_fsync(op["id"], 0))
        frags.write_bytes(data)
        out.append(self._mesh_fsync(op["id"], 1))
        return out

    def op_fsync(self, op):
        return self._on_fd(op["path"], os.O_RDONLY, os.fsync)

    def op_dirfsync(self, op):
        p = self.p(op["path"])
        if self.twin and not p.exists() and self.names.kind(op["path"]) == "chunkdir":
            return "ok"
        return self._on_fd(op["path"], os.O_RDONLY | os.O_DIRECTORY, os.fsync)

    def op_read(self, op):
        return self._read(op["path"])

    def op_conc(self, op):
        """Two processes pwrite at once (disjoint ranges/files): the result is order-independent.
        Each pwrite closes its file, so every state on the way may be stored (a shard whose
        chunks are all written is stored at once): the twin lists them in ``self.on_the_way``."""
        if self.twin:
            # (each job stops at its first error, as its process does: one whose file cannot be
            # made, ENOENT below a chunk directory removed, leaves the other job's writes done)
            jobs = []
            for job in op["jobs"]:
                jobs.append([])
                for path, off, spec in job:
                    if (r := self._twin_prepare(path, True)):
                        jobs[-1].append((path, r, None))
                        break
                    jobs[-1].append((path, off, spec))
            self.on_the_way = {}
            for path in {path for job in jobs for path, _, spec in job if spec is not None}:
                start = self.p(path).read_bytes() if self.p(path).is_file() else None
                mine = [[(off, self.env.data.get(spec)) for q, off, spec in job if q == path and spec is not None]
                        for job in jobs]
                states = self.on_the_way[path] = []
                for k0 in range(len(mine[0]) + 1):
                    for k1 in range(len(mine[1]) + 1):
                        if k0 or k1:
                            states.append(_pwritten(start, mine[0][:k0] + mine[1][:k1]))
            errs = []
            for job in jobs:  # (each job stops at its first error, as its process does)
                try:
                    for path, off, spec in job:
                        if spec is None:
                            errs.append(off)  # (its _twin_prepare's answer)
                            break
                        fd = _open(self.p(path), os.O_WRONLY | os.O_CREAT)
                        try:
                            _write(fd, self.env.data.get(spec), off)
                        finally:
                            os.close(fd)
                except OSError as e:
                    errs.append(errname(e))
                except ShortWrite as e:
                    errs.append(str(e))
            return "ok" if not errs else "fail:" + ";".join(errs)
        procs = []
        for job in op["jobs"]:
            items = [(str(self.p(path)), off, self.env.data.get(spec).hex()) for path, off, spec in job]
            code = ("import os,sys,json,errno\n"
                    "try:\n"
                    "    for p,o,d in json.loads(sys.argv[1]):\n"
                    "        fd=os.open(p,os.O_WRONLY|os.O_CREAT,0o644)\n"
                    "        try:\n"
                    "            n=os.pwrite(fd,bytes.fromhex(d),o)\n"
                    "            if n!=len(d)//2:\n"
                    "                print(f'short write: {n} of {len(d)//2} bytes'); sys.exit(1)\n"
                    "        finally:\n"
                    "            os.close(fd)\n"
                    "except OSError as e:\n"
                    "    print(errno.errorcode.get(e.errno, e.errno)); sys.exit(1)\n")
            procs.append(subprocess.Popen([sys.executable, "-c", code, json.dumps(items)], stdout=subprocess.PIPE,
                                          stderr=subprocess.PIPE))
        errs = []
        try:
            for pr in procs:
                out, err = pr.communicate(timeout=120)
                if pr.returncode == 1 and out.strip():
                    errs.append(out.decode().strip())
                elif pr.returncode:
                    errs.append("crashed: " + err.decode()[-300:])
        finally:
            for pr in procs:  # (a run aborted meanwhile leaves no writer behind)
                if pr.poll() is None:
                    pr.kill()
        return "ok" if not errs else "fail:" + ";".join(errs)

    # -- directory renames (local store: one rename(2) of the stored directory, SEMANTICS 4.18)

    def _dirmv_structural(self, s: str, d: str) -> bool:
        """Does SEMANTICS 4.18 keep the rename of directory ``s`` to ``d`` (logical names)
        EXDEV whatever is open: on S3; a chunk directory or any directory inside a sharded
        dataset (a Zarr array, a precomputed scale, skeleton or mesh directory), or renamed
        into one; a directory of a v3-draft store (``data``, ``meta`` and below); a
        precomputed scale directory, which its volume's ``info`` names (and those on the
        way to one: a scale key of several names)."""
        n = self.names
        if self.env.backend != "local":
            return True
        for x in (s, d):
            if n.in_chunk_tree(x) or any(x.startswith(r + "/") for r in n.roots):
                return True
            if isinstance(n, ZarrNames) and n.draft and x.split("/")[0] in ("data", "meta"):
                return True
            if any(k == x or k.startswith(x + "/") for k in n.keep_dirs) and "/" in x:
                return True  # (a scale, or a directory on the way to one, inside its volume)
        return False

    def _dirmv_in_memory(self, rel: str) -> bool:
        """Is a file below ``rel`` (twin) one the mount may hold in memory only: a temporary
        in a chunk directory, a plain file in a dataset's root (stored at fsync, sync or
        unmount), a temporary a shrink put outside the grid?"""
        base, n = self.p(rel), self.names
        if base.is_dir():
            for q in base.rglob("*"):
                r = str(q.relative_to(self.root))
                if q.is_file() and n.kind(r) in ("chunktmp", "arrplain") and not n.is_meta(r):
                    return True
            # (a dataset whose document was removed through the mount: its chunks are still held)
            logical = n.logical(rel)
            if any(m.startswith(logical + "/") and not self.p(rel + m[len(logical):]).exists()
                   and (self.p(rel + m[len(logical):]).parent).is_dir() for m in n.meta):
                return True
        hidden = getattr(getattr(self, "runner", None), "hidden_tmp", {})
        return any(t == rel or t.startswith(rel + "/") for t in hidden)

    def _dir_rename(self, src: str, dst: str, noreplace: bool) -> None:
        if not noreplace:
            os.rename(self.p(src), self.p(dst))
            return
        import ctypes
        libc = ctypes.CDLL(None, use_errno=True)
        at = -100  # AT_FDCWD
        if libc.renameat2(at, os.fsencode(str(self.p(src))), at, os.fsencode(str(self.p(dst))), ctypes.c_uint(1)):
            e = ctypes.get_errno()
            raise OSError(e, os.strerror(e))

    def _dirmv_docs(self, rel: str, logical: str) -> dict[str, bytes | None]:
        """(mount, local store) The stored metadata documents below ``rel`` (which holds what
        ``logical`` names), by logical name."""
        out = {}
        for m in self.names.meta:
            if m.startswith(logical + "/"):
                p = self.env.src / (rel + m[len(logical):])
                out[m] = p.read_bytes() if p.is_file() else None
        return out

    def _hold_open(self, hold: dict) -> int:
        p = self.p(hold["path"])
        if hold["kind"] == "d":
            return os.open(p, os.O_RDONLY | os.O_DIRECTORY)
        if hold["kind"] == "r":
            return os.open(p, os.O_RDONLY)
        if self.twin and (r := self._twin_prepare(hold["path"], True)):
            raise OSError(errno.ENOENT, r)
        fd = _open(p, os.O_RDWR | os.O_CREAT)
        try:
            _write(fd, self.env.data.get(hold["data"]), 0)
        except BaseException:
            os.close(fd)
            raise
        return fd

    _DIRMV_WRITER = (
        "import os,sys,json,time,errno\n"
        "out=[]\n"
        "for p,d,g,m in json.loads(sys.argv[1]):\n"
        "    time.sleep(g)\n"
        "    r='ok'\n"
        "    try:\n"
        "        fd=os.open(p+'.tmp-w' if m=='tmp' else p,os.O_WRONLY|os.O_CREAT|os.O_TRUNC,0o644)\n"
        "        try:\n"
        "            b=bytes.fromhex(d)\n"
        "            n=os.write(fd,b)\n"
        "            if n!=len(b): r=f'short write: {n} of {len(b)} bytes'\n"
        "        finally:\n"
        "            os.close(fd)\n"
        "    except OSError as e:\n"
        "        r=errno.errorcode.get(e.errno,str(e.errno))\n"
        "    if m=='tmp' and r=='ok':\n"
        "        try:\n"
        "            os.rename(p+'.tmp-w',p)\n"
        "        except OSError as e:\n"
        "            r='rename:'+errno.errorcode.get(e.errno,str(e.errno))\n"
        "    out.append(r)\n"
        "print(json.dumps(out))\n")

    _DIRMV_READER = (
        "import os,sys,json,time,errno,hashlib\n"
        "out=[]\n"
        "for p,t,g in json.loads(sys.argv[1]):\n"
        "    time.sleep(g)\n"
        "    try:\n"
        "        with open(p,'rb') as f:\n"
        "            b=f.read()\n"
        "        out.append(f'{len(b)}:{hashlib.md5(b).hexdigest()[:10]}')\n"
        "    except OSError as e:\n"
        "        out.append(errno.errorcode.get(e.errno,str(e.errno)))\n"
        "print(json.dumps(out))\n")

    def op_dirmv(self, op):
        """``mv`` of a directory (``src``, by its name now) to ``dst``: a free name, an empty
        directory made first (``how`` empty), a full one, a file, inside itself; with
        ``noreplace`` through renameat2(RENAME_NOREPLACE). ``mid``: ``hold`` a file or
        directory below ``src`` open (read, write, a listing) across the rename, which must
        then be EXDEV; ``conc`` two processes writing files by path meanwhile, ``w1``
        below ``src``, ``w2`` the same below ``dst``: each write either lands or is ENOENT,
        those below ``src`` ok until the rename, those below ``dst`` from it (a write to
        the old name after the rename, or one lost, diverges); ``rd``: a third reads files
        no writer writes, below either name (their bytes, or ENOENT as the renames allow); a
        writer's chunk is sometimes written through a temporary renamed over it (``tmp``);
        ``flips``: the directory moved to and fro that many times (``gap`` between), the
        writers' files then disjoint, each write ok or ENOENT; ``kill``: the daemon killed
        during the rename (:meth:`Runner.dirmv_kill`). The twin follows
        (:meth:`_twin_dirmv`); the mount checks that the stored metadata documents moved
        as they were (its arrays still sharded)."""
        src, dst = op["src"], op["dst"]
        out: dict = {}
        if op["how"] == "empty":
            try:
                os.mkdir(self.p(dst))
                out["mkdir"] = "ok"
            except OSError as e:
                out["mkdir"] = errname(e)
        logical = self.names.logical(src)
        docs = self._dirmv_docs(src, logical) if not self.twin and self.env.backend == "local" else {}
        fd, procs = None, []
        if op.get("mid") == "hold":
            try:
                fd = self._hold_open(op["hold"])
                out["hold"] = "ok"
            except OSError as e:
                out["hold"] = errname(e)
        if self.twin:
            try:
                return self._twin_dirmv(op, out)
            finally:
                if fd is not None:
                    os.close(fd)
        try:
            if op.get("mid") == "conc":
                for key in ("w1", "w2"):
                    items = [(str(self.p(w[0])), self.env.data.get(w[1]).hex(), w[2], w[3] if len(w) > 3 else "put")
                             for w in op[key]]
                    procs.append(subprocess.Popen([sys.executable, "-c", self._DIRMV_WRITER, json.dumps(items)],
                                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE))
                if op.get("rd"):  # (a reader by path of files no writer writes, below both names)
                    items = [(str(self.p(path)), tag, gap) for path, tag, gap in op["rd"]]
                    procs.append(subprocess.Popen([sys.executable, "-c", self._DIRMV_READER, json.dumps(items)],
                                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE))
                time.sleep(op.get("delay", 0))
            try:
                self._dir_rename(src, dst, op.get("noreplace", False))
                out["rename"] = "ok"
            except OSError as e:
                out["rename"] = errname(e)
            if op.get("flips", 1) > 1:  # (moved to and fro while the writers write)
                at_dst, out["flips"] = out["rename"] == "ok", []
                for _ in range(op["flips"] - 1):
                    time.sleep(op.get("gap", 0))
                    try:
                        self._dir_rename(*((dst, src) if at_dst else (src, dst)), False)
                        out["flips"].append("ok")
                        at_dst = not at_dst
                    except OSError as e:
                        out["flips"].append(errname(e))
            if fd is not None and op["hold"]["kind"] != "d":
                out["read"] = h(os.pread(fd, 1 << 22, 0))
            for key, pr in zip(("w1", "w2", "rd"), procs):
                so, se = pr.communicate(timeout=120)
                try:
                    out[key] = json.loads(so)
                except ValueError:
                    out[key] = "crashed: " + se.decode()[-300:]
        finally:
            if fd is not None:
                os.close(fd)
            for pr in procs:
                if pr.poll() is None:
                    pr.kill()
        if docs and (out["rename"] == "ok") != (out.get("flips", []).count("ok") % 2 == 1):
            now = self._dirmv_docs(dst, logical)
            bad = sorted(m for m in docs if docs[m] != now.get(m))
            bad += sorted(f"{m}: not sharded" for m in now if now[m] is not None and m.rsplit("/", 1)[0] in self.names.roots
                          and m.endswith("zarr.json") and b"sharding_indexed" not in now[m])
            if bad:
                out["stored"] = bad
        return out

    def _twin_dirmv(self, op, out: dict):
        """The twin's side of :meth:`op_dirmv`, with the mount's answer (``mount_result``):
        the rename is done where SEMANTICS 4.18 says the mount does it. After the kernel's
        own answers (EEXIST with RENAME_NOREPLACE onto a name that exists, EINVAL into
        itself, ENOTDIR onto a file), EXDEV is the answer (the mount's must be too) on S3,
        for a chunk directory, inside a sharded dataset or a v3-draft store, for a
        precomputed scale, and with a file or directory held open below. EXDEV
        is allowed (taken from the mount) only where something below may live in memory
        (:meth:`_dirmv_in_memory`) or writers are busy below (``conc``); else the twin's own
        rename answers (ENOTEMPTY onto a full directory)."""
        src, dst = op["src"], op["dst"]
        s, d = self.names.logical(src), self.names.logical(dst)
        self.stored_now = None  # (one rename made: what is below it, all stored then)
        rm = getattr(self, "mount_result", None)
        rm = rm if isinstance(rm, dict) else {}
        mount_said = rm.get("rename")
        conc = op.get("mid") == "conc"
        w1 = rm.get("w1") if conc else None
        w2 = rm.get("w2") if conc else None
        if conc and not (isinstance(w1, list) and isinstance(w2, list)
                         and len(w1) == len(op["w1"]) and len(w2) == len(op["w2"])):
            out["rename"] = "(writers failed)"
            out["w1"], out["w2"] = w1, w2
            return out
        flips = op.get("flips", 1) if conc else 1
        rd = rm.get("rd") if conc and op.get("rd") else None
        if rd is not None:  # (what each file the reader reads holds: no writer writes it)
            want = [h(self.p(src + path[len(dst):] if tag == 2 else path).read_bytes()) for path, tag, _ in op["rd"]]
        # (what the writers' files below src held before: a write that landed may have met the
        # directory before the rename and landed after it, in the moved directory, not stored by it)
        before = {path: (self.p(path).read_bytes() if self.p(path).is_file() else None)
                  for path, *_ in (op["w1"] if conc else ())}
        if conc:  # the writes below src that landed: before the rename, in order
            for (path, spec, *rest), r in zip(op["w1"], w1):
                if r == "ok":
                    self._conc_write(path, spec, rest[1:] == ["tmp"])
            if flips > 1:  # (and, with the directory moved to and fro, those below dst: disjoint)
                for (path, spec, *rest), r in zip(op["w2"], w2):
                    if r == "ok":
                        self._conc_write(src + path[len(dst):], spec, rest[1:] == ["tmp"])
                for key, base in (("w1", src), ("w2", dst)):  # (temporaries left: see below)
                    for (path, spec, *_), r in zip(op[key], rm[key]):
                        if r == "rename:ENOENT":
                            self._conc_write(src + path[len(base):] + ".tmp-w", spec)
        sp, dp = self.p(src), self.p(dst)
        if not sp.is_dir() or not dp.parent.is_dir():
            res = "ENOENT" if not sp.exists() or not dp.parent.exists() else "ENOTDIR"
        elif op.get("noreplace") and (dp.exists() or dp.is_symlink()):
            res = "EEXIST"  # (the kernel's answers first: it has looked both names up)
        elif dst == src:
            res = "ok"  # (the kernel's: nothing to do, the mount is not asked; no move: count_dirmv)
        elif dst.startswith(src + "/"):
            res = "EINVAL"
        elif dp.is_file():
            res = "ENOTDIR"
        elif self._dirmv_structural(s, d):
            res = "EXDEV"
        elif out.get("hold") == "ok":
            res = "EXDEV"  # (an open handle below it: SEMANTICS 4.18)
        elif mount_said == "EXDEV" and flips == 1 and \
                (conc or self._dirmv_in_memory(src) or self._dirmv_in_memory(dst)):
            res = "EXDEV"
        else:
            res = "ok" if flips == 1 else "(flips)"
            if flips == 1:
                try:
                    self._dir_rename(src, dst, op.get("noreplace", False))
                    self.stored_now = self._files_below(dst)
                    for (path, *_), r in zip(op["w1"] if conc else (), w1 or ()):
                        if r == "ok":  # (stored by the rename, or landed after it: see ``before``)
                            self.stored_now[dst + path[len(src):]] = before[path]
                except OSError as e:
                    res = errname(e)
        if res == "(flips)":
            # moved to and fro: each move is ok or EXDEV (writers busy below), the twin ends
            # where the mount's moves leave it
            said = [mount_said] + (rm.get("flips") if isinstance(rm.get("flips"), list) else [None])
            if all(x in ("ok", "EXDEV") for x in said) and len(said) == flips:
                res, out["flips"] = mount_said, said[1:]
                if said.count("ok") % 2:
                    self._dir_rename(src, dst, False)
            else:
                res, out["flips"] = "ok or EXDEV", "each ok or EXDEV"
        elif flips > 1:  # (refused for a reason of its own: every move again)
            out["flips"] = [res] * (flips - 1)
        out["rename"] = res
        if op.get("mid") == "hold" and op["hold"]["kind"] != "d" and out.get("hold") == "ok":
            out["read"] = h(self.p(op["hold"]["path"]).read_bytes()) if self.p(op["hold"]["path"]).is_file() else None
        if rd is not None:
            moved = res in ("ok", "EXDEV") and "ok" in [res] + list(out.get("flips") or [])
            good = isinstance(rd, list) and len(rd) == len(want)
            for tag in (1, 2) if good else ():
                seen = [("ok" if r == w else r) for r, w, (_, t, _) in zip(rd, want, op["rd"]) if t == tag]
                if not moved:
                    good = good and all(r == ("ok" if tag == 1 else "ENOENT") for r in seen)
                elif flips > 1:
                    good = good and all(r in ("ok", "ENOENT") for r in seen)
                else:
                    good = good and _ok_then(seen, *(("ok", "ENOENT") if tag == 1 else ("ENOENT", "ok")))
            out["rd"] = rd if good else f"not the file's bytes or ENOENT as the renames allow: {rd} (bytes {want})"
        # A writer's path walk may meet the directory before a rename and its create land after
        # it, in the moved directory (as on any file system): a temporary made so is left there,
        # its rename by the old path ENOENT ("rename:ENOENT"; in memory only: no later rename of
        # the directory until it goes). Never before the directory has moved.
        if conc and flips > 1:
            moved = res in ("ok", "EXDEV") and "ok" in [res] + list(out.get("flips") or [])
            ends = ("ok", "ENOENT", "rename:ENOENT") if moved else ()
            good1 = all(r in ends for r in w1) or all(r == "ok" for r in w1)
            good2 = all(r in ends for r in w2) or all(r == "ENOENT" for r in w2)
            out["w1"] = w1 if good1 else f"not ok or ENOENT (ok while never moved): {w1}"
            out["w2"] = w2 if good2 else f"not ok or ENOENT (ENOENT while never moved): {w2}"
        elif conc:
            # below src: ok until the rename, ENOENT after; below dst: ENOENT until it, ok after
            if res == "ok":
                good1 = _ok_then([r.replace("rename:", "") for r in w1], "ok", "ENOENT")
                good2 = _ok_then(w2, "ENOENT", "ok")
            else:
                good1, good2 = all(r == "ok" for r in w1), all(r == "ENOENT" for r in w2)
            out["w1"] = w1 if good1 else f"not ok until the rename, ENOENT after: {w1}"
            out["w2"] = w2 if good2 else f"not ENOENT until the rename, ok after: {w2}"
            # (the temporaries left below src first: made before the rename, or by a create under
            # way at it, before any write below dst landed; a writer below dst writing the same
            # file through a temporary takes one with it: seed 20010 hier_rect --dirmv 40 --meta 60,
            # test_differential.py::test_a_writers_temporary_left_by_the_rename_is_taken_by_the_other_writers_temporary_after_it)
            if good1 and res == "ok":
                for (path, spec, *_), r in zip(op["w1"], w1):
                    if r == "rename:ENOENT":
                        self._conc_write(dst + path[len(src):] + ".tmp-w", spec)
            if good2 and res == "ok":
                for (path, spec, *rest), r in zip(op["w2"], w2):
                    if r == "ok":
                        self._conc_write(path, spec, rest[1:] == ["tmp"])
            if good1 and good2 and res == "ok":
                self._late_temporaries(op, w1, w2)
        return out

    def _late_temporaries(self, op, w1: list, w2: list) -> None:
        """A temporary a writer below ``src`` left ("rename:ENOENT") may have been made by a
        create under way at the rename (its path walk met the directory before it moved), which
        may land after the writer below ``dst`` wrote the same file through a temporary of that
        name (and took the one there with it): the mount then holds the left temporary, which
        the twin (writing it first) does not; the twin cannot tell the order. For that path in
        that situation only, either state is right (none, or the left writer's bytes): the twin
        takes the mount's (counted: dirmv_late_tmp). Seen as 'x/b/2/2.tmp-w: mount ... twin
        None' (the reverse of seed 20010's order); test_differential.py::
        test_a_writers_temporary_made_after_the_other_writer_took_the_old_one_stays"""
        src, dst = op["src"], op["dst"]
        through_tmp = {path for (path, _, *rest), r in zip(op["w2"], w2) if r == "ok" and rest[1:] == ["tmp"]}
        for (path, spec, *_), r in zip(op["w1"], w1):
            moved = dst + path[len(src):]
            if r != "rename:ENOENT" or moved not in through_tmp:
                continue
            rel = moved + ".tmp-w"
            m, t = self.env.mnt / rel, self.p(rel)
            shown = m.read_bytes() if m.is_file() else None
            own = t.read_bytes() if t.is_file() else None
            if shown != own and shown in (None, self.env.data.get(spec)):
                if shown is None:
                    t.unlink()
                else:
                    t.write_bytes(shown)
                self.late_tmp += 1

    def _files_below(self, rel: str) -> dict[str, bytes]:
        return {str(q.relative_to(self.root)): q.read_bytes() for q in self.p(rel).rglob("*") if q.is_file()}

    def _conc_write(self, path: str, spec, tmp: bool = False) -> None:
        """A writer's write of ``path`` that landed; ``tmp``: through ``<path>.tmp-w`` (O_TRUNC)
        renamed over it, which takes a temporary of that name already there (an earlier
        writer's, left when the directory moved) with it: gone in the mount, so here too
        (seed 12013 hier_rect --dirmv 40, step 21: test_differential.py::
        test_a_writers_temporary_renamed_over_its_file_takes_an_older_temporary_with_it)."""
        self.p(path).parent.mkdir(parents=True, exist_ok=True)  # (it was written in the mount)
        if tmp:
            self.p(path + ".tmp-w").unlink(missing_ok=True)
        with open(self.p(path), "wb") as f:
            f.write(self.env.data.get(spec))

    def _race_states(self, op, done: int | None = None) -> tuple[list, list, list]:
        """The states ``op['path']`` passes through under the mover's steps (index 0: before,
        None: absent), and per state the versions a descriptor held open on it from before
        may show: the same, but a chunk replaced by a rename stays as it was for its
        descriptors (SEMANTICS 4.1), and a plain file's descriptor shows the version replaced
        (as on POSIX) or any the name has had since, in no order (2.5: "the newest version
        this mount wrote", one whole version each, but the kernel keeps the attributes of
        the replaced inode for attr_timeout, and the daemon renews them only when asked:
        test_write.py::test_a_plain_file_replaced_while_open_reads_one_version allows both).
        ``done``: of the first that many steps (those that succeeded). Third: per state, whether
        a write of bytes through a descriptor (pwrite, a write after its O_TRUNC) made it."""
        p = self.env.twin / op["path"]
        cur = p.read_bytes() if p.is_file() else None
        chunk = self.names.kind(op["path"]) == "chunk"
        path, held, frozen = [cur], [[cur]], None  # frozen: [the version a rename replaced]
        written = [False]

        def follow(s):
            if frozen is None:
                return [s]
            if chunk:
                return frozen
            frozen.append(s)  # (any version since, in no order: see the docstring)
            return list(frozen)
        for step in op["mover"][:done]:
            kind = step[0]
            if kind in ("truncate", "ftruncate"):
                cur = (cur or b"")[:step[1]].ljust(step[1], b"\0")
            elif kind == "pwrite":
                if cur is None:  # (created: empty first)
                    path.append(b"")
                    held.append(follow(b""))
                    written.append(False)
                data = self.env.data.get(step[2])  # (a write of no bytes extends nothing)
                cur = _pwritten(cur, [(step[1], data)]) if data else (cur or b"")
            else:  # write (created or O_TRUNC: empty first), tmprename
                if kind == "write":
                    path.append(b"")
                    held.append(follow(b""))
                    written.append(False)
                if kind == "tmprename" and frozen is None:
                    frozen = [cur]
                cur = self.env.data.get(step[1])
            path.append(cur)
            held.append(follow(cur))
            written.append(kind in ("pwrite", "write"))
        return path, held, written

    def op_race(self, op):
        """A mover changes one file (truncate by path, ftruncate, pwrite and O_TRUNC write
        through descriptors of its own, a temporary renamed over it) while a watcher process
        stats it, fstats and preads a descriptor it opened before, lists its directory and
        reads it, over and over until the mover has ended. Checker rule (linearizability,
        but for the FUSE window SEMANTICS' Limits name, "a stat may run ahead of reads"):
        the watcher's observations, taken in its order, must be explained by states the file
        passed through (a size, presence in the listing, a read's length; a held descriptor's
        per :meth:`_race_states`), each no earlier than the latest state any observation
        before it showed, except that it may show the state just before that one (never one
        before an earlier observation of its kind showed), and a read's length may lie
        between the sizes of the state it shows and the next (the step in flight; on Linux
        a read and a size change are not atomic with each other), and a size (stat, fstat,
        a listing's) may be a page boundary between them while the next step is a write (the
        kernel may send one write as several WRITE requests: SEMANTICS, Limits, a stat may
        run ahead of reads); once the mover has ended, every kind of
        observation shows its last state exactly (bytes too). The twin applies the mover's
        steps alone."""
        rel, mover = op["path"], op["mover"]
        if op.get("hold") and not (self.env.twin / rel).is_file():
            return "no file to hold"  # (a replayed op list cut by --minimize)
        if (r := self._twin_prepare(rel, True)):
            return r
        parent = self.p(rel).parent
        steps = [(s[0], s[1] if s[0] in ("truncate", "ftruncate") else None,
                  s[1] if s[0] == "pwrite" else None,
                  self.env.data.get(s[-1]).hex() if s[0] in ("pwrite", "write", "tmprename") else None)
                 for s in mover]
        if self.twin:
            states, res = self._race_states(op)[0], []  # (from the state before)
            for kind, size, off, data in steps:
                try:
                    res.append(_race_step(str(self.p(rel)), kind, size, off,
                                          bytes.fromhex(data) if data is not None else None, "twin"))
                except OSError as e:
                    res.append(errname(e))
                if res[-1] != "ok":
                    break
            for s in states[1:]:
                self.on_the_way.setdefault(rel, []).append(s)
            return [res, "watch ok"]
        m = subprocess.Popen([sys.executable, "-c", _RACE_MOVER, str(self.p(rel)), json.dumps(steps)],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        w = subprocess.Popen([sys.executable, "-c", _RACE_WATCHER, str(self.p(rel)), str(parent),
                              json.dumps(op["watch"]), "1" if op.get("hold") else ""],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            for pr in (m, w):  # both ready (the watcher's descriptor open), then both go
                if pr.stdout.readline().strip() != "ready":
                    raise RuntimeError(f"race helper not ready: {pr.communicate(timeout=30)}")
            for pr in (m, w):
                pr.stdin.write("go\n")
                pr.stdin.flush()
            mout, merr = m.communicate(timeout=120)
            wout, werr = w.communicate("stop\n", timeout=120)
        finally:
            for pr in (m, w):
                if pr.poll() is None:
                    pr.kill()
        if m.returncode or w.returncode:
            return [f"race helper failed: {merr[-300:]} {werr[-300:]}"]
        res = json.loads(mout)
        obs, final = json.loads(wout)
        done = sum(1 for r in res if r == "ok")
        ends_from = None
        if self.under_faults and done < len(res):  # (a step failed: it may have done its work or not)
            ends_from = len(self._race_states(op, done)[0]) - 1
            done += 1
        path_states, held_states, written = self._race_states(op, done)
        return [res, _race_verdict(obs, final, path_states, held_states, written, self.under_faults, ends_from)]

    def op_sync(self, op):
        if self.twin:
            return "ok"
        r = subprocess.run([*ZS, "sync", str(self.root)], capture_output=True, text=True, timeout=180)
        return "ok" if r.returncode == 0 else f"sync rc={r.returncode} {r.stderr.strip()}"

    def _read(self, rel):
        try:
            with open(self.p(rel), "rb") as f:
                return h(f.read())
        except OSError as e:
            return errname(e)


# ------------------------------------------------------------------ comparison


def snapshot(root: Path, names: Names, strict_dirs: bool = True) -> tuple[dict, dict, list]:
    """(files: rel -> bytes, listings of dirs outside chunk trees, problems)."""
    files, dirs, problems = {}, {}, []

    def unlisted(e: OSError):  # (os.walk leaves out a directory it cannot list, silently)
        problems.append(f"{os.path.relpath(e.filename, root)}: listing {errname(e)}")
    for dirpath, dirnames, filenames in os.walk(root, onerror=unlisted):
        rel_d = os.path.relpath(dirpath, root)
        rel_d = "" if rel_d == "." else rel_d
        dirnames.sort()
        for fn in filenames:
            rel = f"{rel_d}/{fn}" if rel_d else fn
            p = Path(dirpath) / fn
            try:
                with open(p, "rb") as f:
                    b = f.read()
                st = os.stat(p)
                if st.st_size != len(b):
                    problems.append(f"{rel}: st_size {st.st_size} != {len(b)} bytes read")
                files[rel] = b
            except OSError as e:
                problems.append(f"{rel}: read {errname(e)}")
        if not names.unlisted(rel_d):
            dirs[rel_d] = sorted(d for d in dirnames if not names.unlisted(f"{rel_d}/{d}" if rel_d else d)) + \
                sorted(filenames)
    return files, dirs, problems


def compare(env: Env, where: str) -> list[str]:
    fm, dm, pm = snapshot(env.mnt, env.names)
    ft, dt, _ = snapshot(env.twin, env.names)
    out = [f"mount: {p}" for p in pm]
    for rel in sorted(set(fm) | set(ft)):
        a, b = fm.get(rel), ft.get(rel)
        if env.names.is_meta(rel):
            if a is not None and b is not None:
                try:
                    if json.loads(a) != json.loads(b):
                        out.append(f"{rel}: metadata differs: {pz.json_diff(json.loads(a), json.loads(b))[:3]}")
                except ValueError:
                    out.append(f"{rel}: not JSON")
                continue
        if a != b:
            out.append(f"{rel}: mount {h(a)} twin {h(b)}")
    for d in sorted(set(dm) | set(dt)):
        if dm.get(d) != dt.get(d):
            out.append(f"listing of '{d}': mount {dm.get(d)} twin {dt.get(d)}")
    return [f"[{where}] {x}" for x in out]


# ------------------------------------------------------------------ generator


#: how often each kind of op is drawn (relative weights)
WEIGHTS = {"write": 18, "pwrite": 10, "append": 5, "otrunc": 3, "truncate": 6, "ftruncate": 2, "unlink": 8,
           "rename": 9, "link": 3, "mkdir": 3, "rmdir": 3, "hold": 6, "readopen": 3, "tmprename": 7, "fsync": 3,
           "dirfsync": 2, "sync": 3, "remount": 2, "read": 2, "kill9": 1.5, "conc": 3,
           "meta": 0, "consolidate": 0, "resize": 0,  # (these and the mesh ops: LAYOUT_WEIGHTS)
           "race": 0,  # (scripts/difftest.py --race W; fixed seeds: test_differential RACE_CASES)
           "mesh": 0, "meshrm": 0, "meshmv": 0, "meshbad": 0,
           "faults": 0,  # (S3 only, when asked: scripts/difftest.py --faults, CASES)
           "dirmv": 0,  # (scripts/difftest.py --dirmv W; fixed seeds: test_differential DIRMV_CASES)
           "other": 0}  # (scripts/difftest.py --other W; fixed seeds: test_differential OTHER_CASES)
#: not drawn while network faults are on (a stretch of them is not started within one)
NOT_UNDER_FAULTS = {"faults"}
#: what an op may answer for a storage call that failed under network faults (SEMANTICS 5.5)
FAULT_ERRNOS = ("EIO",)


class Gen:
    """Draws ops at random, from the names that exist in the twin at the time."""

    def __init__(self, env: Env, rng: random.Random, weights: dict[str, float] | None = None):
        self.env, self.rng, self.n = env, rng, env.names
        self.weights = {**WEIGHTS, **LAYOUT_WEIGHTS.get(env.layout, {}), **(weights or {})}
        if env.backend != "s3":
            self.weights["faults"] = 0
        self.tmpn = 0
        self.faulty = 0  # ops left in the current stretch of network faults

    def existing(self) -> list[str]:
        out = []
        for p in self.env.twin.rglob("*"):
            if p.is_file():
                rel = str(p.relative_to(self.env.twin))
                if rel not in self.n.meta and not rel.endswith(".keep") and rel not in self.n.units:
                    out.append(rel)
        return sorted(out)

    def _holds_nothing(self, root: str) -> bool:
        """Is ``root`` a sharded array's directory that holds no chunk and no temporary in a
        chunk directory (in the twin)?"""
        if not any(c.path == root and c.sharded for c in self.n.cases):
            return False
        base = self.env.twin / root
        return not any(p.is_file() and (p.parent != base or str(p.relative_to(self.env.twin)) in self.n.chunks)
                       for p in base.rglob("*"))

    def data(self):
        r = self.rng
        if r.random() < 0.45:
            return ["pool", r.randrange(1 << 30)]
        return ["rnd", r.randrange(1 << 30), r.choice([0, 1, 5, 17, 64, 100, 200, 333, 1000, 4096])]

    def any_file(self, existing_bias=0.6) -> str:
        r = self.rng
        ex = self.existing()
        if ex and r.random() < existing_bias:
            return r.choice(ex)
        x = r.random()
        if x < 0.65:
            return r.choice(self.n.free_chunks)
        if x < 0.72:
            return r.choice(sorted(self.n.outside))
        if x < 0.85:
            return r.choice(PLAIN_FILES + self.n.group_plain + self.n.plain_chunks)
        if x < 0.93:
            return r.choice(self.n.arr_plain)
        if self.n.leaf_dirs:
            return r.choice(self.n.leaf_dirs) + "/.tmp-" + str(r.randrange(3))
        return r.choice(PLAIN_FILES)

    def op(self) -> dict:
        if self.faulty:
            self.faulty -= 1
            if not self.faulty:
                return {"op": "faultsoff"}
        for _ in range(100):  # (while a directory is renamed away, ops naming either place are drawn again)
            o = self._draw()
            if not self._blocked(o):
                return o
        return {"op": "sync"}

    def _blocked(self, op: dict) -> bool:
        """Does ``op`` name a directory renamed away (:attr:`Names.moved`) or its new place,
        or anything below them (or, a consolidation, the whole hierarchy)?"""
        if self.n.moved is None or op["op"] == "dirmv":
            return False
        if op["op"] in ("consolidate", "other"):
            return True
        if op["op"] == "rmdir" and self.n.moved[0].startswith(op["path"] + "/"):
            return True  # (the rename back needs the old parent)
        # (a consolidated entry of a member renamed away, ``member``, is drawn: the group's
        # document written however, that entry edited or not, maps it back onto the stored
        # entry, SEMANTICS 4.18)
        names = op_names(op, self.n) | {op[k] for k in ("other",) if isinstance(op.get(k), str)}
        if op["op"] == "resize":
            names.add(op["path"])
        return any(x == p or x.startswith(p + "/") for x in names for p in self.n.moved)

    def _draw(self) -> dict:
        r = self.rng
        kinds = [k for k, w in self.weights.items() if w > 0 and not (self.faulty and k in NOT_UNDER_FAULTS)]
        kind = r.choices(kinds, [self.weights[k] for k in kinds])[0]
        if kind == "faults":
            self.faulty = r.randrange(4, 16)
            return {"op": "faults", "p": r.choice([0.2, 0.5, 0.7, 0.9]), "seed": r.randrange(1 << 30),
                    "kinds": r.choice([["reset", "cut", "503", "500"], ["cut"], ["reset", "503"]])}
        if kind == "write":
            return {"op": "write", "path": self.any_file(0.4), "data": self.data(), "pieces": r.choice([1, 1, 3])}
        if kind in ("pwrite", "append"):
            o = {"op": kind, "path": self.any_file(0.7), "data": self.data()}
            if kind == "pwrite":
                o["off"] = r.choice([0, 1, 7, 50, 100, 500, 2000, r.randrange(5000)])
            return o
        if kind == "otrunc":
            return {"op": "otrunc", "path": self.any_file(0.9)}
        if kind in ("truncate", "ftruncate"):
            return {"op": kind, "path": self.any_file(0.9), "size": r.choice([0, 1, 10, 96, 200, 1000, 5000])}
        if kind == "unlink":
            return {"op": "unlink", "path": self.any_file(0.9)}
        if kind in ("rename", "link"):
            return {"op": kind, "src": self.any_file(0.9), "dst": self.any_file(0.3)}
        if kind in ("mkdir", "rmdir"):
            pool = (PLAIN_DIRS if self.env.backend == "local" else []) + self.n.inner_dirs[:6] + \
                self.n.out_dirs[:2] + self.n.extra_dirs
            return {"op": kind, "path": r.choice(pool)} if pool else {"op": "read", "path": self.any_file(0.8)}
        if kind == "hold":
            o = {"op": "hold", "path": self.any_file(0.6), "d1": self.data(), "o1": r.choice([0, 3, 64, 300]),
                 "d2": self.data(), "o2": r.choice([0, 10, 128, 700]), "other": self.any_file(0.9),
                 "trunc": r.random() < 0.3}
            m = r.random()
            if m < 0.25:
                o["mid"], o["dst"] = "rename", self.any_file(0.3)
            elif m < 0.4:
                o["mid"] = "unlink"
            return o
        if kind == "readopen":
            return {"op": "readopen", "path": self.any_file(0.95), "then": r.choice(["unlink", "write"]),
                    "data": self.data()}
        if kind == "tmprename":
            dst = r.choice(self.n.free_chunks) if r.random() < 0.85 else self.any_file(0.3)
            parent = dst.rsplit("/", 1)[0] if "/" in dst else ""
            self.tmpn += 1
            tmp = f"{parent}/.zarr-tmp.{self.tmpn}" if parent else f".zarr-tmp.{self.tmpn}"
            return {"op": "tmprename", "tmp": tmp, "path": dst, "data": self.data(),
                    "fsync": r.random() < 0.3, "dirfsync": r.random() < 0.3}
        if kind == "fsync":
            return {"op": "fsync", "path": self.any_file(0.95)}
        if kind == "dirfsync":
            return {"op": "dirfsync", "path": r.choice(self.n.leaf_dirs + [self.n.arr, "plain"])}
        if kind == "read":
            return {"op": "read", "path": self.any_file(0.8)}
        if kind == "conc":
            files = r.sample(self.n.free_chunks, min(6, len(self.n.free_chunks)))
            jobs = [[], []]
            if r.random() < 0.5:  # disjoint files
                for i, f in enumerate(files):
                    jobs[i % 2].append([f, 0, self.data()])
            else:  # one file, disjoint ranges
                f = files[0]
                for i in range(6):
                    jobs[i % 2].append([f, i * 100, ["rnd", r.randrange(1 << 30), 100]])
            return {"op": "conc", "jobs": jobs}
        if kind == "race":
            return self.race_op()
        if kind == "meta":
            # (not the v3-draft store's entry point ``zarr.json``: zarr 2.18 refuses a key it does
            # not know there, ``attributes`` included, so both sides would fail to open)
            docs = [m for m in self.n.meta if not (getattr(self.n, "draft", False) and m == "zarr.json")]
            o = {"op": "meta", "path": r.choice(docs),
                 "how": r.choice(["write", "pieces", "emptied", "tmprename", "editor", "rmput", "mvback"]),
                 "attrs": {r.choice("abc"): r.choice([0, 1, "x", [1, 2.5], None, {"n": r.randrange(9)}])}}
            if o["path"] == self.n.consolidated and self.n.members and r.random() < 0.5:
                o["member"] = r.choice(self.n.members)
                if o["path"] == ZMETADATA and not self.weights["faults"] and r.random() < 0.5:
                    o["away"] = True  # (the member's own document renamed away meanwhile: SEMANTICS 4.18)
            if r.random() < 0.2:
                o["fill"] = r.randrange(50)
            if o["how"] in ("editor", "rmput") and self._holds_nothing(o["path"].rpartition("/")[0]):
                # a sharded array none of whose chunks (nor temporaries) is left: the document
                # written after it was removed is a new array's, stored as written (SEMANTICS
                # 4.15), which the twin does not follow (it stays sharded there)
                o["how"] = "write"
            return o
        if kind == "resize":
            case = r.choice([c for c in self.n.cases if c.sharded])
            if self.n.moved and (case.path + "/").startswith(self.n.moved[0] + "/"):
                return {"op": "resize", "path": case.path, "shape": []}  # (drawn again: _blocked)
            shape = json.loads((self.env.twin / case.path / "zarr.json").read_bytes())["shape"]
            return {"op": "resize", "path": case.path,
                    "shape": [max(1, s + r.choice([-7, -4, -1, 0, 0, 1, 3, 5, 9])) for s in shape]}
        if kind in ("mesh", "meshrm", "meshmv", "meshbad"):
            return self.mesh_op(kind)
        if kind == "dirmv":
            return self.dirmv_op()
        if kind == "other":
            return self.other_op()
        if kind == "kill9" and r.random() < 0.6:
            return {"op": "kill9", "delay": r.choice([0, 0.001, 0.005, 0.01, 0.02, 0.05])}
        return {"op": kind}


    def other_op(self) -> dict:
        """Another client's change of the store (:meth:`Runner.other`): chunks written or
        removed through a second mount (near one the mount may hold dirty, half the time: the
        write-back then merges onto the other client's version), a shard deleted, or (a Zarr
        v3 array's ``zarr.json``) an attribute set; ``sync``: the mount synced first."""
        r, n = self.rng, self.n
        o = {"op": "other", "sync": r.random() < 0.25}
        x = r.random()
        docs = [f"{c.path}/zarr.json" for c in n.cases if c.sharded] \
            if isinstance(n, ZarrNames) and not n.hier and not n.draft else []
        if x < 0.12 and docs:
            return {**o, "how": "attrs", "path": r.choice(docs),
                    "attrs": {r.choice("xyz"): r.choice([0, 1, "o", [2, 3], None, {"m": r.randrange(9)}])}}
        if x < 0.3:
            return {**o, "how": "rmshard", "pick": r.randrange(1 << 30)}
        pool = n.free_chunks
        touched = sorted(c for c in self.env.touched if c in n.chunks and c not in n.units)
        anchor = r.choice(touched) if touched and r.random() < 0.5 else r.choice(pool)
        d = anchor.rsplit("/", 1)[0]
        near = [c for c in pool if c.rsplit("/", 1)[0] == d and c != anchor]
        picks = [anchor] + r.sample(near, min(len(near), r.randrange(0, 4)))
        o = {**o, "how": "chunks", "changes": [[c, self.data() if r.random() < 0.75 else None] for c in picks]}
        if r.random() < 0.3:  # (one of them, or a chunk beside them, open for writing in the mount meanwhile)
            c = r.choice(picks + near[:2])
            o["held"] = [c, r.choice([0, 3, 64]), self.data(), r.choice([0, 10, 128, 700]), self.data()]
        return o

    def _dirs(self) -> list[str]:
        """The directories a ``dirmv`` draws from (the twin's, logical names): all outside chunk
        trees, and a few in-grid chunk directories (EXDEV)."""
        out = []
        for p in sorted(self.env.twin.rglob("*")):
            rel = str(p.relative_to(self.env.twin))
            if p.is_dir() and not self.n.in_chunk_tree(rel):
                out.append(rel)
        return out + [d for d in self.n.inner_dirs[:3] if (self.env.twin / d).is_dir()]

    def dirmv_op(self) -> dict:
        """A directory's rename (see :meth:`Applier.op_dirmv`); while one is renamed away,
        the rename back (also with writers or a held file)."""
        r, n, twin = self.rng, self.n, self.env.twin
        if n.moved is not None:
            o = {"op": "dirmv", "src": n.moved[1], "dst": n.moved[0], "how": "back", "noreplace": r.random() < 0.3}
            return self._dirmv_mid(o, n.moved[0], free=True)
        dirs = self._dirs()
        if not dirs:
            return {"op": "sync"}
        src = r.choice(dirs)
        out = [d for d in dirs if d != src and not d.startswith(src + "/") and not src.startswith(d + "/")]
        parents = [""] + [d for d in out if not n.in_chunk_tree(d)]
        how = r.choices(["free", "empty", "full", "file", "into"], [8, 2, 2, 1, 1])[0]
        full = [d for d in out if any((twin / d).iterdir())]
        files = [f for f in self.existing() if not f.startswith(src + "/")]
        if how == "full" and full:
            dst = r.choice(full)
        elif how == "file" and files:
            dst = r.choice(files)
        elif how == "into":
            dst = f"{src}/mv{r.randrange(2)}"
        else:
            how = "empty" if how == "empty" and self.env.backend == "local" else "free"  # (S3: no empty dirs)
            parent = r.choice(parents)
            leaf = f"mv{r.randrange(3)}" if how == "free" else f"mt{r.randrange(2)}"
            dst = f"{parent}/{leaf}" if parent else leaf
            if dst == src:  # (an empty directory made by an earlier one: not onto itself)
                dst += "_b"
        o = {"op": "dirmv", "src": src, "dst": dst, "how": how, "noreplace": r.random() < 0.25}
        return self._dirmv_mid(o, src, free=how == "free" and not (twin / dst).exists())

    def _dirmv_mid(self, o: dict, logical: str, free: bool) -> dict:
        """What happens below the directory meanwhile: nothing, a file or directory held open
        (``hold``), or (onto a free name) writers by path below both places (``conc``)."""
        r, n, twin = self.rng, self.n, self.env.twin
        src = o["src"]

        def phys(rel):  # (a logical name below ``logical`` as it is below ``src`` now)
            return src + rel[len(logical):]
        def shown(rel):  # (not a name a shrink put outside the grid: the mount has none there)
            return n.kind(rel) not in ("outside", "outdir") and not any(
                n.logical(rel).startswith(d + "/") for d in n.out_dirs)
        files = sorted(str(p.relative_to(twin)) for p in (twin / src).rglob("*") if p.is_file()
                       and not p.name.endswith(".keep") and shown(str(p.relative_to(twin))))
        chunks = [phys(c) for c in n.free_chunks if c.startswith(logical + "/")
                  and (n.lenient_parents or (twin / phys(c)).parent.is_dir())]
        plain = [f for f in files if n.kind(f) == "plain" and not n.is_meta(f)]
        m = r.random()
        if m < 0.45 and free and (chunks or plain):
            flips = r.choice([1, 1, 2, 3, 4, 6])
            pick = r.sample(chunks + plain, min(len(chunks + plain), r.randrange(2, 9)))
            rest = [p for p in chunks + plain if p not in pick] if flips > 1 else chunks + plain
            pick2 = r.sample(rest, min(len(rest), r.randrange(2, 9)))  # (moved to and fro: disjoint)
            o["mid"] = "conc"
            if flips > 1:
                o["flips"], o["gap"] = flips, r.choice([0, 0.002, 0.01, 0.03])
            tails = {p[len(src):] for p in pick} | {p[len(src):] for p in pick2}
            stable = [f for f in files if f[len(src):] not in tails and not n.is_meta(f)
                      and n.kind(f) in ("chunk", "plain")]
            if stable and r.random() < 0.6:
                o["rd"] = []
                for f in r.sample(stable, min(len(stable), r.randrange(2, 7))):
                    tag = r.choice([1, 2])
                    o["rd"].append([f if tag == 1 else o["dst"] + f[len(src):], tag,
                                    r.choice([0, 0, 0.002, 0.01, 0.03])])
            # (a chunk written zarr-python's way, a temporary renamed over it, now and then: the
            # temporary, in memory in the mount, keeps the directory from moving until it is renamed)
            def mode(p):
                return ["tmp"] if n.kind(p) == "chunk" and r.random() < 0.3 else []
            o["w1"] = [[p, self.data(), r.choice([0, 0, 0.002, 0.01, 0.03]), *mode(p)] for p in pick]
            o["w2"] = [[o["dst"] + p[len(src):], self.data(), r.choice([0, 0, 0.002, 0.01, 0.03]), *mode(p)]
                       for p in pick2]
            o["delay"] = r.choice([0, 0.02, 0.05, 0.08, 0.12, 0.2])
        elif m < 0.52 and free and self.env.backend == "local":
            o["mid"], o["delay"] = "kill", r.choice([0, 0.001, 0.003, 0.01, 0.03, 0.06, 0.1])
        elif m < 0.65:
            dirs = [str(p.relative_to(twin)) for p in (twin / src).rglob("*") if p.is_dir()
                    and shown(str(p.relative_to(twin)))]
            kind = r.choice(["w", "w", "r", "d"])
            if kind == "w" and (chunks or plain):
                path = r.choice(chunks + plain)
            elif kind == "r" and files:
                path = r.choice(files)
            else:
                kind, path = "d", r.choice([src] + dirs)
            o["mid"], o["hold"] = "hold", {"kind": kind, "path": path, "data": self.data()}
        return o

    def race_op(self) -> dict:
        """A file changed by one process while another watches it (see Applier.op_race)."""
        r = self.rng
        ex = [f for f in self.existing() if self.n.kind(f) in ("chunk", "plain") and f not in self.n.units]
        path = r.choice(ex) if ex and r.random() < 0.85 else r.choice(self.n.free_chunks)
        exists = (self.env.twin / path).is_file()
        mover = [] if exists else [["write", self.data()]]
        for _ in range(r.randrange(1, 6)):
            k = r.choice(["truncate", "truncate", "ftruncate", "pwrite", "pwrite", "write", "tmprename"])
            if k in ("truncate", "ftruncate"):
                mover.append([k, r.choice([0, 1, 10, 96, 200, 1000, 5000])])
            elif k == "pwrite":
                mover.append([k, r.choice([0, 7, 100, 500, 2000]), self.data()])
            else:
                mover.append([k, self.data()])
        hold = exists and r.random() < 0.6
        kinds = ["stat", "list", "scan", "read"] + (["fstat", "pread"] if hold else [])
        watch = r.sample(kinds, r.randrange(1, len(kinds) + 1))
        return {"op": "race", "path": path, "mover": mover, "watch": watch, "hold": hold}

    def mesh_op(self, kind: str) -> dict:
        """A mesh op: on a pair of files, whole (see :meth:`Applier.op_mesh`)."""
        r, ids = self.rng, self.n.mesh_ids
        stored = [i for i in ids if (self.env.twin / self.n.mesh_root / f"{i}.index").is_file()]
        pick = lambda: r.choice(stored) if stored and r.random() < 0.7 else r.choice(ids)  # noqa: E731
        if kind == "mesh":
            return {"op": "mesh", "id": pick(), "how": r.choice(["put", "put", "put_rev", "tmp", "manifest"]),
                    "seed": r.randrange(1 << 30), "frags": r.choice(MESH_FRAGS), "fsync": r.random() < 0.3}
        if kind == "meshrm":
            return {"op": "meshrm", "id": pick()}
        if kind == "meshmv":
            src = pick()
            return {"op": "meshmv", "src": src, "dst": r.choice([i for i in ids if i != src])}
        return {"op": "meshbad", "id": pick(), "seed": r.randrange(1 << 30), "frags": r.choice(MESH_FRAGS[1:])}


# ------------------------------------------------------------------ the run


def fault_failed(result) -> bool:
    """Did an op (a list: its steps' results) fail with an errno network faults may give?"""
    if isinstance(result, list):
        return any(fault_failed(x) for x in result)
    if isinstance(result, dict):  # (dirmv: its steps' results by name)
        return any(fault_failed(x) for x in result.values())
    if not isinstance(result, str):
        return False
    if result.startswith(("fail:", "rename:")):
        return any(e in FAULT_ERRNOS for e in result.split(":", 1)[1].split(";"))
    if result.startswith("sync rc="):
        return "Input/output error" in result
    return result in FAULT_ERRNOS


def op_names(op: dict, names: Names, mnt: Path | None = None) -> set[str]:
    """The names an op changes (a resize: its document): a document's edit its temporaries too (a
    consolidation the ``zarr.<hex>.partial`` temporaries zarr-python left in ``mnt``), a
    mesh op both files of each pair it names and its temporary."""
    kind = op["op"]
    if kind == "meta":
        away = {op["member"], op["member"] + ".away"} if op.get("away") else set()
        return {op["path"] + x for x in ("", ".tmp", "~", ".bak")} | away
    if kind == "resize":
        return {f"{op['path']}/zarr.json"}
    if kind == "consolidate":
        return {"zarr.json"} | ({p.name for p in mnt.glob("zarr.*.partial")} if mnt is not None else set())
    if kind == "race":  # (and the temporary of a mover's rename that failed, left in ``mnt``)
        tmps = (mnt / op["path"]).parent.glob(".race-tmp.*") if mnt is not None else ()
        return {op["path"]} | {str(p.relative_to(mnt)) for p in tmps}
    if kind in ("mesh", "meshrm", "meshmv", "meshbad"):
        ids = [op["src"], op["dst"]] if kind == "meshmv" else [op["id"]]
        out = {f"{names.mesh_root}/{i}{x}" for i in ids for x in ("", ".index")}
        if op.get("how") == "tmp":
            out.add(f"{names.mesh_root}/.mesh-tmp.{op['seed']}")
        return out
    out = {op[k] for k in ("path", "src", "dst", "tmp") if isinstance(op.get(k), str)}
    if kind == "dirmv":  # (the file it held, those its writers wrote)
        out |= {op["hold"]["path"]} if op.get("hold") else set()
        out |= {w[0] + x for key in ("w1", "w2") for w in op.get(key, ()) for x in ("", ".tmp-w")[:1 + (w[3:] == ["tmp"])]}
    for job in op.get("jobs", ()):
        out |= {path for path, _, _ in job}
    return out


def _again(fn) -> None:
    """``fn()``, asked again while it fails with EIO (up to 10 s): right after network faults a
    storage call that got no answer fails fast for FAIL_FAST seconds (SEMANTICS 5.5)."""
    deadline = time.monotonic() + 10
    while True:
        try:
            fn()
            return
        except OSError as e:
            if e.errno != errno.EIO or time.monotonic() > deadline:
                raise
            time.sleep(0.3)


def _same_doc(a: bytes | None, b: bytes | None) -> bool:
    """Are two states of a metadata document the same (None: no file; else compared as JSON)?"""
    if a is None or b is None:
        return a is b
    try:
        return json.loads(a) == json.loads(b)
    except ValueError:
        return a == b


class Runner:
    def __init__(self, env: Env, verbose=False):
        self.env, self.verbose = env, verbose
        self.mnt_ap = Applier(env, env.mnt, twin=False)
        self.twin_ap = Applier(env, env.twin, twin=True)
        self.twin_ap.runner = self  # (dirmv: the temporaries it holds aside, hidden_tmp)
        self.durable: dict[str, bytes] = {}   # file -> bytes at the last durable point
        self.versions: dict[str, list] = {}   # file -> versions since then
        self.stats = {"ops": 0, "remounts": 0, "kills": 0, "faults": 0, "failed": 0, "races": 0}
        #: chunks past a shrunk array's shape when the daemon was killed: the mount hides them,
        #: whether or not their removal was stored; a resize showing them again adopts them
        self.hidden: set[str] = set()
        #: (twin) temporaries in chunk directories a resize put outside the grid: the mount
        #: still holds them in memory, unreachable until a resize takes the directory back
        self.hidden_tmp: dict[str, bytes] = {}
        #: the ``faults`` op of the stretch of network faults now on (None: off)
        self.faults: dict | None = None
        #: files an op that failed under network faults named since the last durable point
        #: (a plain file's close may not have stored it: a kill -9 may find an older version)
        self.unsure: set[str] = set()

    def twin_files(self) -> dict[str, bytes]:
        return {str(p.relative_to(self.env.twin)): p.read_bytes() for p in self.env.twin.rglob("*") if p.is_file()}

    def mark_durable(self, files=None):
        self.durable = files if files is not None else self.twin_files()
        self.versions = {}
        self.unsure = set()

    def note_versions(self, before: dict, after: dict):
        for rel in set(before) | set(after):
            if before.get(rel) != after.get(rel):
                self.versions.setdefault(rel, []).append(after.get(rel))

    def drop_chunk_temporaries(self):
        """Documented: non-chunk files inside chunk dirs live in memory only (gone at unmount).
        (And S3 has no empty directories: those below unsharded arrays are gone too.)"""
        self.hidden_tmp = {}
        for d in sorted(self.env.names.plain_trees, key=lambda d: -d.count("/")):
            p = self.env.twin / d
            if p.is_dir() and not any(p.iterdir()):
                p.rmdir()
        for p in list(self.env.twin.rglob("*")):
            rel = str(p.relative_to(self.env.twin))
            if p.is_file() and self.env.names.kind(rel) == "chunktmp":
                p.unlink()

    def step(self, i: int, op: dict) -> list[str]:
        env = self.env
        kind = op["op"]
        self.stats["ops"] += 1
        before = self.twin_files()
        if self.faults is not None and kind != "faultsoff":
            under = self.stats.setdefault("under_faults", {})
            under[kind] = under.get(kind, 0) + 1
        if kind == "remount":
            return self.remount(i)
        if kind == "kill9":
            return self.kill9(i, op)
        if kind == "dirmv" and op.get("mid") == "kill":
            return self.dirmv_kill(i, op)
        if kind == "faults":
            self.faults = op
            self.stats["faults"] += 1
            return []
        if kind == "faultsoff":
            return self.faults_off(i)
        if kind == "other":
            return self.other(i, op)
        env.touched |= op_names(op, env.names) | {env.names.logical(x) for x in op_names(op, env.names)}
        if kind in ("resize", "dirmv"):
            env.touched_all = True
        if kind == "race":
            self.count_race(op)
        self.mnt_ap.under_faults = self.faults is not None
        with self.network_faults(i):
            rm = self.mnt_ap.apply(op)
        self.twin_ap.on_the_way = {}
        self.twin_ap.mount_result = rm
        rt = self.twin_ap.apply(op)
        if kind == "dirmv":
            self.count_dirmv(op, rm, rt, self.twin_ap.stored_now)
        intended = {}
        failed = self.faults is not None and rm != rt and fault_failed(rm)
        if kind == "race" and failed:  # (its mover's steps failed, never what the watcher saw)
            failed = fault_failed(rm[0]) and rm[1] == "watch ok"
        if self.faults is not None:
            self.settle()
        if failed:
            self.unsure |= op_names(op, env.names)
            # failed under network faults: the op may have done any part of its work, and what
            # it stored may land or not; its files are taken from the mount into the twin
            self.stats["failed"] += 1
            self.stats.setdefault("failed_kinds", []).append(kind)
            intended, shown = self.adopt(op)
            self.mend(op, shown, intended)
        if kind == "resize" and rt == "ok":
            tmps = [rel for rel in before if env.names.kind(rel) == "chunktmp"]
            env.names.resize(op["path"], op["shape"])
            for rel in list(self.hidden_tmp):
                if env.names.kind(rel) == "chunktmp" and not (env.twin / rel).exists():
                    (env.twin / rel).parent.mkdir(parents=True, exist_ok=True)
                    (env.twin / rel).write_bytes(self.hidden_tmp.pop(rel))
            for rel in tmps:
                if env.names.kind(rel) != "chunktmp" and (env.twin / rel).is_file():
                    self.hidden_tmp[rel] = (env.twin / rel).read_bytes()
                    (env.twin / rel).unlink()
            for rel in sorted(self.hidden):
                if env.names.kind(rel) == "chunk":
                    self.hidden.discard(rel)
                    if (env.mnt / rel).is_file():
                        (env.twin / rel).parent.mkdir(parents=True, exist_ok=True)
                        (env.twin / rel).write_bytes((env.mnt / rel).read_bytes())
        after = self.twin_files()
        for rel, states in self.twin_ap.on_the_way.items():
            self.versions.setdefault(rel, []).extend(states)
        self.note_versions(before, after)
        for rel, state in intended.items():  # (a failed op's writes may land later: its twin's states too)
            if state != before.get(rel):
                self.versions.setdefault(rel, []).append(state)
        out = []
        if rm != rt and not failed:
            out.append(f"[step {i}] result differs: mount {rm} twin {rt}")
        if failed and self.verbose:
            print(f"  {i}: failed under network faults: mount {rm} twin {rt}", flush=True)
        if kind == "sync" and rm == "ok":
            # a sync stores everything: the durable point (chunk temporaries are memory-only)
            self.mark_durable({k: v for k, v in after.items() if env.names.kind(k) != "chunktmp"})
            env.clean()
        if kind == "fsync" and rm == "ok" and op["path"] in after:
            self.durable[op["path"]] = after[op["path"]]
            self.versions.pop(op["path"], None)
        if self.verbose:
            print(f"  {i}: {json.dumps(op)} -> {rm}", flush=True)
        return out + compare(env, f"step {i}")

    def remount(self, i: int) -> list[str]:
        """Unmount (which stores everything: the durable point) and mount again. Under network
        faults the unmount's sync may fail: ``zshardfs umount`` then refuses and leaves the
        mount, holding every file (SEMANTICS 4.8), and the op counts as failed under faults; the
        mount after a successful unmount may fail (storage unreachable: exit 1 and a message,
        no traceback), and is then made again with the faults off."""
        env = self.env
        with self.network_faults(i):
            r = env.umount()
        if r != "ok":
            if self.faults is None or "not unmounted, the data is still held by the daemon" not in r:
                return [f"[step {i}] umount: {r}"]
            self.stats["failed"] += 1
            self.stats.setdefault("failed_kinds", []).append("umount")
            if self.verbose:
                print(f"  {i}: unmount refused under network faults: {r}", flush=True)
            self.settle()
            return compare(env, f"step {i} after an unmount refused under network faults")
        self.drop_chunk_temporaries()
        self.mark_durable()
        env.clean()
        failed = None
        with self.network_faults(i):
            try:
                env.mount()
            except RuntimeError as e:
                if self.faults is None:
                    raise
                failed = str(e)
        if failed is not None:
            if "Traceback" in failed or os.path.ismount(env.mnt):
                return [f"[step {i}] a mount under network faults failed badly: {failed[-1500:]}"]
            self.stats["failed"] += 1
            self.stats.setdefault("failed_kinds", []).append("mount")
            if self.verbose:
                print(f"  {i}: mount failed under network faults: {failed.strip()[-300:]}", flush=True)
            env.mount()
        self.stats["remounts"] += 1
        if self.faults is not None:
            self.settle()
        return compare(env, f"step {i} after remount")

    def mend(self, op: dict, shown: dict, intended: dict) -> None:
        """After a document's edit or a mesh op failed under network faults (its files taken
        from the mount): what a user does next, with the faults off, where the mount was left
        in a state the tester does not follow: a document missing (an editor's save, ``rm``
        and put back or ``mv`` away and back cut between its steps) or not JSON (emptied first)
        is put back as the edit meant (a backup moved back first: SEMANTICS 4.15), a resize is
        tried again, zarr-python's temporaries of a consolidation are removed, and a mesh
        pair left inconsistent (one file of it written) is written as the op meant (its
        shard's flush is refused until then: SEMANTICS, Limits). ``shown`` (what the mount
        showed of each file) also counts as a version since the durable point; ``intended``:
        what the twin had made of them."""
        env = self.env
        fixes: list[str] = []
        if op["op"] == "resize":  # tried again (the chunks past the shape deleted, the document written)
            fixes.append(op["path"])
            tries = []
            if not wait_for(lambda: tries.append(self.mnt_ap.apply(op)) or tries[-1] != "EIO", timeout=10,
                            interval=0.3) or tries[-1] != "ok":
                raise RuntimeError(f"a resize tried again after it failed under network faults: {tries[-1]}")
        if op["op"] == "consolidate":  # (zarr-python's temporaries: removed)
            for rel in op_names(op, env.names, env.mnt) - {"zarr.json"}:
                fixes.append(rel)
                os.unlink(env.mnt / rel)
        if op["op"] in ("meta", "consolidate"):
            rel = op.get("path", "zarr.json")
            doc = shown.get(rel)
            try:
                good = isinstance(doc, bytes) and json.loads(doc) is not None
            except ValueError:
                good = False
            if not good:
                fixes.append(rel)
                for bak in (rel + "~", rel + ".bak"):
                    if doc is None and (env.mnt / bak).is_file():
                        os.rename(env.mnt / bak, env.mnt / rel)
                        break
                _again(lambda: (env.mnt / rel).write_bytes(intended.get(rel) or b""))
        elif op["op"] in ("mesh", "meshrm", "meshmv", "meshbad"):
            root = self.env.names.mesh_root
            for i in [op["src"], op["dst"]] if op["op"] == "meshmv" else [op["id"]]:
                index, frags = self.mnt_ap._mesh(i)
                m = index.read_bytes() if index.is_file() else None
                f = frags.read_bytes() if frags.is_file() else None
                if (not f) if m is None else pp.manifest_fragment_bytes(m) == len(f or b""):
                    continue
                fixes.append(str(i))
                want_m, want_f = intended.get(f"{root}/{i}.index"), intended.get(f"{root}/{i}")
                if want_m is not None:
                    _again(lambda: frags.write_bytes(want_f or b""))
                    _again(lambda: index.write_bytes(want_m))
                elif m is not None:
                    os.unlink(index)  # (its fragment data goes with it)
                else:
                    os.unlink(frags)
        if not fixes:
            return
        self.stats["mended"] = self.stats.get("mended", 0) + 1
        if self.verbose:
            print(f"  mended {fixes} (faults off)", flush=True)
        for rel, state in shown.items():
            if state != "dir":
                self.versions.setdefault(rel, []).append(state)
        for rel in op_names(op, env.names) | set(shown):  # the twin takes the mended files
            self.adopt_file(rel)

    def adopt_file(self, rel: str) -> None:
        """The twin's ``rel`` becomes what the mount shows (a file, or nothing)."""
        m, t = self.env.mnt / rel, self.env.twin / rel
        if m.is_file():
            t.parent.mkdir(parents=True, exist_ok=True)
            t.write_bytes(m.read_bytes())
        elif t.is_file():
            t.unlink()

    @contextlib.contextmanager
    def network_faults(self, i: int):
        """Network faults on (S3, within a stretch of them) while the mount does step ``i``."""
        f = self.faults
        if f is None or self.env.proxy is None:
            yield
            return
        from tests.s3server import Faults
        self.env.proxy.faults = Faults(f["p"], tuple(f["kinds"]), seed=f["seed"] + i)
        try:
            yield
        finally:
            self.env.proxy.faults = None

    def settle(self) -> None:
        """Wait (up to 10 s) until the mount reads every file again: a storage call that
        failed fails fast for FAIL_FAST seconds, until some call is answered (SEMANTICS 5.5)."""
        wait_for(lambda: not any(p.endswith("EIO") for p in snapshot(self.env.mnt, self.env.names)[2]),
                 timeout=10, interval=0.3)

    def adopt(self, op: dict) -> tuple[dict[str, bytes | None], dict]:
        """The twin takes the files (and directories) ``op`` names as the mount shows them;
        returns what the twin had made of them (the op's intended result), and what the
        mount showed."""
        env, intended = self.env, {}
        shown: dict = {}

        def read_mount() -> bool:  # (a name no listing showed may still fail fast: asked again)
            try:
                for rel in op_names(op, env.names, env.mnt):
                    m = env.mnt / rel
                    shown[rel] = "dir" if m.is_dir() else m.read_bytes() if m.is_file() else None
            except OSError as e:
                if e.errno != errno.EIO:
                    raise
                return False
            return True
        if not wait_for(read_mount, timeout=10, interval=0.3):
            raise RuntimeError(f"the mount still fails (EIO) on {sorted(op_names(op, env.names))} 10 s after the op")
        for rel in sorted(shown):
            m, t = shown[rel], env.twin / rel
            if m == "dir" or t.is_dir():
                if m == "dir" and not t.exists():
                    t.mkdir(parents=True)
                elif m is None and t.is_dir() and not any(t.iterdir()):
                    t.rmdir()
                continue
            intended[rel] = t.read_bytes() if t.is_file() else None
            if m is not None:
                t.parent.mkdir(parents=True, exist_ok=True)
                t.write_bytes(m)
            elif t.is_file():
                t.unlink()
        return intended, shown

    def faults_off(self, i: int) -> list[str]:
        """The end of a stretch of network faults: ``zshardfs sync`` succeeds again (once a
        storage call failed, the same call fails fast for FAIL_FAST seconds: SEMANTICS 5.5),
        then the mount, the store read by a fresh read-only mount and the twin agree."""
        env = self.env
        self.faults = None
        tries = []
        if not wait_for(lambda: tries.append(self.mnt_ap.op_sync({})) or tries[-1] == "ok", timeout=30,
                        interval=0.3):
            return [f"[step {i} faults off] sync: {tries[-1]} ({len(tries)} tries)"]
        self.stats["syncs_after_faults"] = max(self.stats.get("syncs_after_faults", 0), len(tries))
        files = self.twin_files()
        self.mark_durable({k: v for k, v in files.items() if env.names.kind(k) != "chunktmp"})
        out = compare(env, f"step {i} faults off")
        if out:
            return out
        check = env.work / "mnt-check"
        check.mkdir(exist_ok=True)
        pid = env.mount(check, ("ro",), log="daemon-check.log")
        try:
            fs, _, ps = snapshot(check, env.names)
        finally:
            r = subprocess.run([*ZS, "umount", str(check)], capture_output=True, text=True, timeout=180)
            if r.returncode:
                take_down(check, pid)
        out = [f"store: {p}" for p in ps]
        for rel in sorted(set(fs) | set(self.durable)):
            a, b = fs.get(rel), self.durable.get(rel)
            if env.names.is_meta(rel) and a is not None and b is not None:
                if json.loads(a) != json.loads(b):
                    out.append(f"{rel}: metadata differs in the store: {pz.json_diff(json.loads(a), json.loads(b))[:3]}")
            elif a != b:
                out.append(f"{rel}: store {h(a)} twin {h(b)}")
        return [f"[step {i} faults off, the store read afresh] {x}" for x in out]

    def kill9(self, i: int, op: dict | None = None) -> list[str]:
        env = self.env
        syncer = None
        with self.network_faults(i):
            if op and op.get("delay") is not None:  # killed while a sync stores shards
                syncer = subprocess.Popen([*ZS, "sync", str(env.mnt)], stdout=subprocess.DEVNULL,
                                          stderr=subprocess.DEVNULL)
                time.sleep(op["delay"])
            env.kill9()
            if syncer is not None:
                syncer.wait(60)
        self.stats["kills"] += 1
        env.mount()
        return self._after_kill(i)

    def dirmv_kill(self, i: int, op: dict) -> list[str]:
        """A directory's rename (local store) during which the daemon is killed (``kill -9``
        ``delay`` seconds after it was asked): a fresh mount shows the directory at its old
        name or at its new one, never both or neither (SEMANTICS 4.18: rename(2) in storage),
        and at the new one only where 4.18 lets it move; the twin follows, and every file
        holds a version it had since the last durable point (:meth:`kill9`)."""
        env, twin = self.env, self.env.twin
        src, dst = op["src"], op["dst"]
        said: dict = {}

        def mv():
            try:
                os.rename(env.mnt / src, env.mnt / dst)
                said["rename"] = "ok"
            except OSError as e:
                said["rename"] = errname(e)
        mover = threading.Thread(target=mv, daemon=True)
        mover.start()
        time.sleep(op.get("delay", 0))
        env.kill9()
        mover.join(60)
        self.stats["kills"] += 1
        env.mount()
        at_src, at_dst = (env.mnt / src).is_dir(), (env.mnt / dst).is_dir()
        moved = at_dst and not at_src
        mids = self.stats.setdefault("dirmv_mid", {})
        mids["kill"] = mids.get("kill", 0) + 1
        counts = self.stats.setdefault("dirmv_kill", {})
        what = "moved" if moved else "stayed" if at_src and not at_dst else "both" if at_src else "neither"
        counts[what] = counts.get(what, 0) + 1
        out = []
        if at_src == at_dst:
            out.append(f"[step {i}] kill -9 during mv {src} {dst} ({said}): {what} names hold the directory")
        elif moved:
            names = env.names
            if dst.startswith(src + "/") or (twin / dst).exists() or \
                    self.twin_ap._dirmv_structural(names.logical(src), names.logical(dst)):
                out.append(f"[step {i}] kill -9 during mv {src} {dst} ({said}): moved, where SEMANTICS 4.18 "
                           "keeps it EXDEV")
            else:
                before = self.twin_files()
                os.rename(twin / src, twin / dst)
                self.note_versions(before, self.twin_files())
                self.count_dirmv(op, {"rename": "ok"}, {"rename": "ok"}, self.twin_ap._files_below(dst))
        return out + self._after_kill(i)

    def _after_kill(self, i: int) -> list[str]:
        """After a kill -9 and the mount again: each file holds a version it had since the
        last durable point; the twin takes what survived."""
        env = self.env
        self.hidden_tmp = {}  # (memory only: gone with the daemon)
        self.hidden |= env.names.past_shrunk_shapes()
        self.hidden = {rel for rel in self.hidden if env.names.kind(rel) == "outside"}
        fm, _, pm = snapshot(env.mnt, env.names)
        out = [f"[step {i} after kill -9] mount: {p}" for p in pm]
        cur = self.twin_files()
        for rel in sorted(set(fm) | set(cur) | set(self.durable) | set(self.versions)):
            got = fm.get(rel)
            allowed = [self.durable.get(rel)] + self.versions.get(rel, [])
            if env.names.kind(rel) == "chunktmp":
                allowed = [None]
            elif env.names.kind(rel) == "plain" and not env.names.is_meta(rel) and rel not in self.unsure:
                allowed = [cur.get(rel)]  # stored at close (unless storing failed under network faults)
            if env.names.is_meta(rel):
                if rel in self.unsure and not any(_same_doc(got, a) for a in allowed):
                    # (an edit that failed under network faults may not have been stored)
                    out.append(f"[step {i} after kill -9] {rel}: mount {h(got)} not among the document's "
                               f"versions {[h(a) for a in allowed]} (twin now {h(cur.get(rel))})")
                continue
            if not any(got == a for a in allowed):
                out.append(f"[step {i} after kill -9] {rel}: mount {h(got)} not among "
                           f"{[h(a) for a in allowed]} (twin now {h(cur.get(rel))})")
        env.clean()  # (a new daemon: it holds nothing unstored)
        # adopt the surviving state into the twin
        for rel in set(cur) | set(fm):
            if env.names.is_meta(rel) and rel not in self.unsure:
                continue
            p = env.twin / rel
            if rel in fm:
                p.parent.mkdir(parents=True, exist_ok=True)
                p.write_bytes(fm[rel])
            elif p.exists():
                p.unlink()
        self.drop_chunk_temporaries()
        self.mark_durable()
        return out + compare(env, f"step {i} after kill -9 (adopted)")

    def other(self, i: int, op: dict) -> list[str]:
        """Another client changes the store behind the mount (the ``other`` op; the mount runs
        with every TTL 0, ``OTHER_OPTS``, so it must show the change at the next lookup, open
        or listing): chunks written or removed through a second mount of the store (its flush
        re-reads the shard and merges, with conditional writes), a whole shard deleted, or an
        attribute set in a Zarr array's stored ``zarr.json``; the twin takes the same change.
        ``sync`` (always for ``attrs``): ``zshardfs sync`` of the mount first, so it holds
        nothing unstored and the change must show exactly. Without it the mount may hold
        chunks it changed (:attr:`Env.touched`) unstored: where the other client changed one
        of those, the mount shows its own version (its flush merges onto the other client's
        shard, its own chunks winning) or, when it had stored its own already, the other
        client's: either is taken into the twin; every other chunk of the shard must show the
        other client's version (chunks it changed) or the mount's (those it did not). Each
        chunk's new stored state is one of its versions since the durable point (a kill -9 may
        find it under the mount's unstored version)."""
        env, names, twin = self.env, self.env.names, self.env.twin
        stats = self.stats.setdefault("other", {})
        out = []
        synced = False
        if op.get("sync") or op["how"] == "attrs":
            with self.network_faults(i):
                r = self.mnt_ap.apply({"op": "sync"})
            synced = r == "ok"
            if r == "ok":
                self.mark_durable({k: v for k, v in self.twin_files().items() if names.kind(k) != "chunktmp"})
                env.clean()
            elif self.faults is None:
                return [f"[step {i}] other: the mount's sync failed: {r}"]
            elif op["how"] == "attrs":
                stats["skipped"] = stats.get("skipped", 0) + 1
                return []
        if self.faults is not None:
            self.settle()
        stats[op["how"]] = stats.get(op["how"], 0) + 1
        before = self.twin_files()
        new: dict[str, bytes | None] = {}  # chunk -> what storage holds of it now
        maybe: set[str] = set()  # chunks the mount may show either way
        if op["how"] == "attrs":
            key = op["path"]
            doc = json.loads(env.read_key(key))
            doc.setdefault("attributes", {}).update(op["attrs"])
            env.put_key(key, json.dumps(doc, indent=2).encode())
            tdoc = json.loads((twin / key).read_bytes())
            tdoc.setdefault("attributes", {}).update(op["attrs"])
            (twin / key).write_bytes(json.dumps(tdoc, indent=2).encode())
            self.note_versions(before, self.twin_files())
            if self.verbose:
                print(f"  {i}: {json.dumps(op)}", flush=True)
            return compare(env, f"step {i}")
        other = env.other_mount()
        held, hfd = op.get("held"), None
        if held:  # (a chunk the mount has open for writing meanwhile: its own bytes win the merge)
            rel, off1, d1, off2, d2 = held
            want = self.twin_ap._twin_prepare(rel, True)
            try:
                hfd = os.open(env.mnt / rel, os.O_WRONLY | os.O_CREAT, 0o644)
                _write(hfd, env.data.get(d1), off1)
                got = None
            except OSError as e:
                got = errname(e)
            if got != want:
                if hfd is not None:
                    os.close(hfd)
                return [f"[step {i}] other: {rel} opened for writing and written: mount {got or 'ok'} twin {want or 'ok'}"]
        if op["how"] == "chunks":
            for rel, spec in op["changes"]:
                p = other / rel
                try:
                    if spec is None:
                        os.unlink(p)
                        new[rel] = None
                    else:
                        data = env.data.get(spec)
                        fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
                        try:
                            _write(fd, data)
                        finally:
                            os.close(fd)
                        new[rel] = data
                except OSError as e:
                    # (storage has no such chunk to remove, or no such directory: a precomputed
                    # scale directory removed; the other client changes nothing there)
                    if e.errno not in (errno.ENOENT,):
                        return [f"[step {i}] other: the other client's change of {rel}: {errname(e)}"]
            r = subprocess.run([*ZS, "sync", str(other)], capture_output=True, text=True, timeout=180)
            if r.returncode:
                if hfd is not None:
                    os.close(hfd)
                return [f"[step {i}] other: the other client's sync failed: {r.stderr.strip()}"]
        else:  # rmshard
            # (a mesh shard only when the mount holds nothing unstored: deleted under a mesh pair
            # it holds half of, the pair is inconsistent, which fails the flush: SEMANTICS Limits)
            keys = env.stored_shards(meshes=synced)
            if not keys:
                return compare(env, f"step {i}")
            key = keys[op["pick"] % len(keys)]
            had = env.stored_chunks(other)
            env.delete_key(key)
            now = env.stored_chunks(other)
            new = {rel: None for rel in had - now}
            # (a flush of the mount's may have stored a chunk of it between the two listings)
            maybe = {rel for rel in before if rel in names.chunks and rel not in now and rel not in had
                     and (rel in env.touched or env.touched_all)}
            if self.verbose:
                print(f"  {i}: removed shard {key}: {sorted(new)}", flush=True)
        if hfd is not None:
            rel, off1, d1, off2, d2 = held
            stats["held"] = stats.get("held", 0) + 1
            try:
                _write(hfd, env.data.get(d2), off2)
            finally:
                os.close(hfd)
            mine = _pwritten(before.get(rel), [(o, d) for o, d in ((off1, env.data.get(d1)), (off2, env.data.get(d2)))
                                               if d])  # (a write of no bytes past the end makes no hole)
            p = twin / rel
            p.parent.mkdir(parents=True, exist_ok=True)
            p.write_bytes(mine)
            env.touched.add(rel)
            if rel in new:
                self.versions.setdefault(rel, []).append(new[rel])
            new.pop(rel, None)
            maybe.discard(rel)
        for rel, state in sorted(new.items()):
            if state != before.get(rel):
                self.versions.setdefault(rel, []).append(state)
        for rel in sorted(set(new) | maybe):
            state = new.get(rel)
            if rel in env.touched or env.touched_all:
                try:
                    shown = (env.mnt / rel).read_bytes()
                except FileNotFoundError:
                    shown = None
                except OSError as e:
                    out.append(f"[step {i}] other: {rel} (maybe held by the mount unstored): read {errname(e)}")
                    continue
                if shown != state and shown != before.get(rel):
                    out.append(f"[step {i}] other: {rel} (maybe held by the mount unstored): mount {h(shown)}, "
                               f"neither its own {h(before.get(rel))} nor the other client's {h(state)}")
                    continue
                kept = "own" if shown == before.get(rel) and shown != state else "other's"
                stats[f"overlap_{kept}"] = stats.get(f"overlap_{kept}", 0) + 1
                if shown == state and state is None and rel in maybe:
                    self.versions.setdefault(rel, []).append(None)
                state = shown
            p = twin / rel
            if state is None:
                if p.is_file():
                    p.unlink()
            else:
                p.parent.mkdir(parents=True, exist_ok=True)
                p.write_bytes(state)
        self.note_versions(before, self.twin_files())
        if self.verbose:
            print(f"  {i}: {json.dumps(op)} -> {sorted(new)}", flush=True)
        return out + compare(env, f"step {i}")

    def count_race(self, op: dict) -> None:
        """A race op in the run's summary (its coverage): how many, how many with a held
        descriptor, and each kind of observation and of the mover's steps."""
        self.stats["races"] += 1
        self.stats["race_held"] = self.stats.get("race_held", 0) + bool(op.get("hold"))
        for key, kinds in (("race_watch", op["watch"]), ("race_mover", [s[0] for s in op["mover"]])):
            counts = self.stats.setdefault(key, {})
            for k in kinds:
                counts[k] = counts.get(k, 0) + 1
            self.stats[key] = dict(sorted(counts.items()))

    def count_dirmv(self, op: dict, rm, rt, stored: dict | None = None) -> None:
        """A directory rename: the twin's names follow one it made (:attr:`Names.moved`); the
        run's summary counts the mount's answers (dirmv), the variants (dirmv_mid) and the
        concurrent ones whose writers saw the rename happen between their writes (dirmv_split),
        and the temporaries left below src the twin took as the mount shows them (dirmv_late_tmp)."""
        names = self.env.names
        moves = [rt.get("rename")] + list(rt.get("flips") or []) if isinstance(rt, dict) else []
        if moves.count("ok") and op["src"] != op["dst"]:  # (the mount forgets the rmdirs below both names)
            self.env.removed_chunkdirs = {p for p in self.env.removed_chunkdirs if not any(
                p == d or p.startswith(d + "/") for d in (op["src"], op["dst"]))}
        if moves.count("ok") % 2 and op["src"] != op["dst"]:
            old, new = op["src"], op["dst"]
            below = sorted(rel for rel in set(self.durable) | set(self.versions) if rel.startswith(old + "/"))
            if stored is not None:
                # one rename: everything below was stored first (else it is EXDEV), and the
                # rename is durable (both parents fsynced): the old names are gone for good
                for rel in below:
                    self.durable.pop(rel, None)
                    self.versions.pop(rel, None)
                for rel, b in stored.items():
                    if b is None:
                        self.durable.pop(rel, None)
                    else:
                        self.durable[rel] = b
                    self.versions.pop(rel, None)
            else:  # (moved to and fro: below the new place any version the old had since the durable point)
                for rel in below:
                    self.versions.setdefault(new + rel[len(old):], []).extend(
                        [self.durable.get(rel)] + self.versions.get(rel, []))
            if names.moved is None:
                names.moved = (op["src"], op["dst"])
            elif op["dst"] == names.moved[0]:
                names.moved = None
            else:
                names.moved = (names.moved[0], op["dst"])
        said = rm.get("rename") if isinstance(rm, dict) else str(rm)
        for key, what in (("dirmv", said), ("dirmv_mid", op.get("mid") or "none")):
            if op.get("mid") == "kill":
                continue  # (dirmv_kill counts it)
            counts = self.stats.setdefault(key, {})
            counts[what] = counts.get(what, 0) + 1
            self.stats[key] = dict(sorted(counts.items()))
        if op.get("mid") == "conc" and "ok" in moves and isinstance(rm, dict) and \
                ("ENOENT" in (rm.get("w1") or []) or "ok" in (rm.get("w2") or [])):
            self.stats["dirmv_split"] = self.stats.get("dirmv_split", 0) + 1
        if self.twin_ap.late_tmp:  # (temporaries left below src that may be there or not: _late_temporaries)
            self.stats["dirmv_late_tmp"] = self.twin_ap.late_tmp

    def checked_step(self, i: int, op: dict) -> list[str]:
        try:
            return self.step(i, op)
        except Exception:
            return [f"[step {i}] exception: {traceback.format_exc()[-1500:]}"]

    def final_check(self) -> list[str]:
        """Make every chunk a valid encoding, unmount, read the sharded source with zarr-python
        (and tensorstore) and compare with the twin read by zarr-python."""
        env = self.env
        out = self.faults_off(-1) if self.faults is not None else []
        if out:
            return out
        for rel in sorted(env.names.chunks) + env.names.plain_chunks:
            p = env.twin / rel
            if p.is_file() and not env.case.valid(rel, p.read_bytes()):
                op = {"op": "write", "path": rel, "data": ["valid", rel]}
                a, b = self.mnt_ap.apply(op), self.twin_ap.apply(op)
                if a != b:
                    out.append(f"[final] normalising {rel}: mount {a} twin {b}")
        out += compare(env, "final before unmount")
        r = env.umount()
        if r != "ok":
            return out + [f"[final] umount: {r}"]
        self.drop_chunk_temporaries()
        out += env.case.peers_check(env, env.source_copy(), self.hidden)
        env.mount()
        out += compare(env, "final after remount")
        return out


def _as_rectilinear(v):
    """``v`` with every ZEP 3 `rectangular` grid spelled `rectilinear` (same edges)."""
    if isinstance(v, list):
        return [_as_rectilinear(x) for x in v]
    if not isinstance(v, dict):
        return v
    if v.get("name") == "rectangular" and isinstance(v.get("configuration"), dict):
        return {"name": "rectilinear", "configuration": {"kind": "inline",
                                                         "chunk_shapes": v["configuration"]["chunk_shape"]}}
    return {k: _as_rectilinear(x) for k, x in v.items()}


def _zarr_values(root: Path, case: ZarrCase, work: Path, consolidated: bool) -> np.ndarray:
    """zarr-python reads the array (through the root's consolidated metadata when the
    store is a hierarchy); a ZEP 3 `rectangular` grid, which it does not know, from a
    copy of the store that spells it as its successor `rectilinear` (same edges)."""
    import warnings

    import zarr
    for rel in [f"{case.path}/zarr.json"] + (["zarr.json"] if consolidated else []):
        doc = json.loads((root / rel).read_bytes())
        members = [doc] + list(((doc.get("consolidated_metadata") or {}).get("metadata") or {}).values())
        if any((m.get("chunk_grid") or {}).get("name") == "rectangular" for m in members):
            copy = Path(tempfile.mkdtemp(dir=work))
            shutil.copytree(root, copy, dirs_exist_ok=True)
            for rel2 in {f"{case.path}/zarr.json", "zarr.json"}:
                (copy / rel2).write_text(json.dumps(_as_rectilinear(json.loads((copy / rel2).read_bytes()))))
            root = copy
            break
    with warnings.catch_warnings(), zarr.config.set({"array.rectilinear_chunks": True}):
        warnings.simplefilter("ignore")
        store = zarr.storage.LocalStore(root, read_only=True)
        if consolidated:
            return zarr.open_group(store, mode="r", use_consolidated=True)[case.path][...]
        return zarr.open_array(store, path=case.path, mode="r")[...]


def peers_compare(env: Env, src: Path, case: ZarrCase, consolidated: bool = True) -> list[str]:
    """zarr-python (and tensorstore, for regular grids) read the array from the sharded
    source as zarr-python reads it from the twin; a hierarchy's arrays also through its
    consolidated metadata (which the view mapped back)."""
    out = []
    for consolidated in [False, True] if env.names.hier and consolidated else [False]:
        b = _zarr_values(env.twin, case, env.work, consolidated)  # (a stale member: the twin's too)
        try:
            a = _zarr_values(src, case, env.work, consolidated)
        except Exception as e:
            out.append(f"[final] zarr-python failed on {case.path} (consolidated={consolidated}): {e!r}"[:500])
            continue
        if a.shape != b.shape or not np.array_equal(a, b, equal_nan=a.dtype.kind == "f"):
            where = np.argwhere(a != b)[:5].tolist() if a.shape == b.shape else f"shapes {a.shape} {b.shape}"
            out.append(f"[final] zarr-python values of {case.path} differ (consolidated={consolidated}) at {where}")
    if not pz.tensorstore_supports(case):
        return out
    try:
        import tensorstore as ts
        t = ts.open({"driver": "zarr3", "kvstore": {"driver": "file", "path": str(src / case.path)}},
                    read=True).result().read().result()
        b = _zarr_values(env.twin, case, env.work, False)
        if not np.array_equal(np.asarray(t), b, equal_nan=b.dtype.kind == "f"):
            out.append(f"[final] tensorstore values of {case.path} differ from the twin")
    except Exception as e:
        out.append(f"[final] tensorstore failed on {case.path}: {e!r}"[:500])
    return out


def _zarr2_run(code: str, *args) -> subprocess.CompletedProcess:
    """``code`` run by zarr 2.18 (v3-draft sharding on; ``sys``, ``zarr``, ``np`` and
    ``DirectoryStoreV3`` imported), ``args`` its ``sys.argv[1:]``; it must succeed."""
    code = ("import sys, zarr, numpy as np\n"
            "from zarr._storage.v3 import DirectoryStoreV3\n") + code
    envv = {**os.environ, "ZARR_V3_EXPERIMENTAL_API": "1", "ZARR_V3_SHARDING": "1"}
    r = subprocess.run([str(pz.ZARR2_PYTHON), "-c", code, *map(str, args)], capture_output=True, text=True,
                       env=envv, timeout=120)
    if r.returncode:
        raise RuntimeError(f"zarr 2.18 failed: {r.stderr.strip()[-800:]}")
    return r


def zarr2_compare(env: Env, src: Path) -> list[str]:
    """zarr 2.18 reads the array from the source and from the twin (also through their
    consolidated metadata, when the layout has it): equal values?  (On copies: opening a
    store, zarr 2.18 writes its entry point ``zarr.json`` back when it is missing.)"""
    code = ("import sys, zarr, numpy as np\n"
            "from zarr._storage.v3 import DirectoryStoreV3\n"
            "a = zarr.open_array(DirectoryStoreV3(sys.argv[1]), path=sys.argv[3], mode='r', zarr_version=3)[...]\n"
            "b = zarr.open_array(DirectoryStoreV3(sys.argv[2]), path=sys.argv[3], mode='r', zarr_version=3)[...]\n"
            "assert np.array_equal(a, b), 'DIFF'\n")
    if env.names.consolidated == ZMETADATA:
        code += ("c = zarr.open_consolidated(DirectoryStoreV3(sys.argv[1]), zarr_version=3, mode='r')[sys.argv[3]]\n"
                 "d = zarr.open_consolidated(DirectoryStoreV3(sys.argv[2]), zarr_version=3, mode='r')[sys.argv[3]]\n"
                 "assert np.array_equal(c[...], d[...]), 'DIFF (consolidated)'\n"
                 "assert dict(c.attrs) == dict(d.attrs), ('attributes (consolidated)', dict(c.attrs), dict(d.attrs))\n")
    code += "print('EQUAL')\n"
    envv = {**os.environ, "ZARR_V3_EXPERIMENTAL_API": "1", "ZARR_V3_SHARDING": "1"}
    with tempfile.TemporaryDirectory(dir=env.work) as tmp:
        a, b = Path(tmp) / "source", Path(tmp) / "twin"
        shutil.copytree(src, a)
        shutil.copytree(env.twin, b)
        r = subprocess.run([str(pz.ZARR2_PYTHON), "-c", code, str(a), str(b), env.case.case.path],
                           capture_output=True, text=True, env=envv, timeout=120)
    if "EQUAL" not in r.stdout:
        return [f"[final] zarr 2.18 read: {r.stdout.strip()} {r.stderr.strip()[-800:]}"]
    return []


# ------------------------------------------------------------------ driver

DEFAULT_OPTS = ["flush_delay=2"]
#: (the ``other`` op) every TTL 0: another client's change must show at the next lookup, open
#: or listing (SEMANTICS 2.5); added to the run's options when the op is drawn or replayed,
#: and the second mount the other client writes through has them too
OTHER_OPTS = ("metadata_ttl=0", "index_ttl=0", "attr_timeout=0")


@dataclass
class Outcome:
    """One run: the ops applied (up to the first divergence) and what diverged."""

    layout: str
    backend: str
    opts: list[str]
    seed: int | None
    ops: list[dict]
    work: Path
    failure: tuple[int, list[str]] | None = None  # (step, lines); step == len(ops): the final check
    stats: dict = field(default_factory=dict)
    replayed: bool = False  # ops given, not drawn with ``seed``

    @property
    def ok(self) -> bool:
        return self.failure is None

    def repro(self) -> dict:
        """What ``scripts/difftest.py --replay FILE`` reads."""
        return {"seed": self.seed, "layout": self.layout, "backend": self.backend, "opts": self.opts,
                "ops": self.ops}

    def summary(self) -> str:
        return json.dumps({"seed": self.seed, "layout": self.layout, "backend": self.backend, "opts": self.opts,
                           **self.stats})

    def report(self, repro_file: Path | None = None, max_lines: int = 20) -> str:
        """The divergence, the op list (one JSON op per line) and how to replay it."""
        lines = ["DIVERGENCE " + self.summary(), f"work: {self.work}"]
        lines += ["   " + x for x in self.failure[1][:max_lines]]
        lines.append(f"ops ({len(self.ops)}; the divergence at step {self.failure[0]}):")
        lines += ["   " + json.dumps(op) for op in self.ops]
        if repro_file is not None:
            lines.append(f"replay: .venv/bin/python scripts/difftest.py --replay {repro_file} [--minimize]")
        if not self.replayed:
            lines.append(f"(or draw it again: scripts/difftest.py --seed {self.seed} --layout {self.layout} "
                         f"--backend {self.backend} --steps {self.stats.get('ops', len(self.ops))} "
                         f"-o {','.join(self.opts)})")
        return "\n".join(lines)


def run(layout: str, backend: str = "local", *, base: Path, seed: int = 0, steps: int = 100,
        ops: list[dict] | None = None, opts: list[str] | None = None, server=None,
        weights: dict[str, float] | None = None, final: bool = True, verbose: bool = False) -> Outcome:
    """Run ``steps`` random ops drawn with ``seed`` (or replay ``ops``) on a fresh store in a
    new directory below ``base``; S3 needs ``server``, a running :class:`tests.s3server.MotoServer`
    (a bucket is made and deleted). Stops at the first divergence; without one, ``final`` adds
    the final check (valid chunks, unmount, peers read the source)."""
    opts = list(DEFAULT_OPTS if opts is None else opts)
    if (weights or {}).get("other", 0) > 0 or any(o.get("op") == "other" for o in ops or ()):
        opts = [o for o in opts if o.split("=")[0] not in {x.split("=")[0] for x in OTHER_OPTS}] + list(OTHER_OPTS)
    work = Path(tempfile.mkdtemp(prefix=f"dt-{layout}-{backend}-", dir=base))
    env = Env(layout, backend, opts, work)
    runner = Runner(env, verbose)
    gen = Gen(env, random.Random(seed), weights) if ops is None else None
    n = steps if ops is None else len(ops)
    done: list[dict] = []
    failure = None
    try:
        env.setup(server)
        runner.mark_durable()
        for i in range(n):
            op = gen.op() if gen is not None else ops[i]
            done.append(op)
            if (d := runner.checked_step(i, op)):
                failure = (i, d)
                break
        if failure is None and final and env.names.moved is not None:
            # a directory renamed away: back first (the final check reads the arrays where they
            # were), once the temporaries a writer left there (in memory only) are removed
            left = sorted(rel for p in (env.twin / env.names.moved[1]).rglob("*")
                          if p.is_file() and env.names.kind(rel := str(p.relative_to(env.twin))) in ("chunktmp", "arrplain")
                          and not env.names.is_meta(rel))
            tail = [{"op": "unlink", "path": rel} for rel in left]
            tail.append({"op": "dirmv", "src": env.names.moved[1], "dst": env.names.moved[0], "how": "back"})
            for op in tail:
                done.append(op)
                if (d := runner.checked_step(len(done) - 1, op)):
                    failure = (len(done) - 1, d)
                    break
            if failure is None and env.names.moved is not None:
                failure = (len(done) - 1, [f"[final] the rename back of {env.names.moved} was not made"])
        if failure is None and final:
            try:
                f = runner.final_check()
            except Exception:
                f = [f"[final] exception: {traceback.format_exc()[-1500:]}"]
            if f:
                failure = (len(done), f)
        if env.proxy is not None and env.proxy.fault_counts:
            runner.stats["injected"] = dict(env.proxy.fault_counts)
        if any(o.startswith("index_cache=") for o in opts):
            runner.stats["index_cache"] = dict(env.index_cache)
        log = env.daemon_log()
        if failure is None and "Traceback" in log:
            failure = (len(done), ["daemon log has a traceback:\n" + log[log.index("Traceback"):][:3000]])
    finally:
        env.teardown()
    return Outcome(layout, backend, opts, seed, done, work, failure, runner.stats, replayed=ops is not None)


def minimize(outcome: Outcome, *, base: Path, server=None) -> Outcome:
    """Greedy delta debugging: drop runs of ops while some divergence remains (the final check
    too when that is where ``outcome`` diverged); the smallest failing run."""
    final = outcome.failure[0] >= len(outcome.ops)

    def attempt(seq):
        res = run(outcome.layout, outcome.backend, base=base, seed=outcome.seed, ops=seq, opts=outcome.opts,
                  server=server, final=final)
        if res.ok:
            shutil.rmtree(res.work, ignore_errors=True)
        return res

    best, ops, n = outcome, list(outcome.ops), 2
    while len(ops) >= 2:
        size = max(1, len(ops) // n)
        reduced = False
        for start in range(0, len(ops), size):
            cand = ops[:start] + ops[start + size:]
            if cand and not (res := attempt(cand)).ok:
                best, ops, n, reduced = res, res.ops, max(n - 1, 2), True
                break
        if not reduced:
            if size == 1:
                break
            n = min(len(ops), n * 2)
    return best
