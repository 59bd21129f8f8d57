"""Random file operations through a mount behave as on a directory store (SEMANTICS 4.17),
for sharded Zarr arrays (regular and variable shard grids, consolidated hierarchies) and
Neuroglancer precomputed volumes, skeleton directories and multi-resolution meshes.

Fixed seeds of the randomized differential tester (tests/difftest.py): each applies
random ops (writes, pwrites past the end, truncates, renames, links, handles held open
across an unlink or a rename, temporary-then-rename, fsync, sync, two writers at once,
remounts and kill -9 of the daemon, on S3 stretches of network faults; for variable shard grids and consolidated
hierarchies also metadata documents edited, consolidated and resized through the
mount) to a mount of a sharded store and to a directory
holding its unsharded twin, and compares the two after every step, except for the
documented Limits (which the twin emulates). A failure prints the seed, the layout and
the op list, and saves the list for ``scripts/difftest.py --replay FILE``.

Each case's seed was chosen so that its run includes at least one remount and one kill -9
(asserted, so a change of the generator cannot drop them unnoticed); its steps end 25 past
the first step by which a traced run had both (and, for FAULT_CASES, the failures asserted),
or where they ended before (3-4 minutes for the file on two cores then). Fewer steps run
a prefix of the same ops only as long as the twin's files are the same from run to run:
draws read them, and a kill -9, two writers at once or a failure under faults can leave
them otherwise, hence the margin. RACE_CASES add race ops (a file watched by one process while another changes it),
FAULT_CASES stretches of network faults on S3 (each also has an op fail under them,
asserted) and RACE_FAULT_CASES both (a race op failing under them, asserted), DIRMV_CASES
directory renames on local stores (held files and writers below meanwhile, asserted), OTHER_CASES
another client changing the store behind the mount (chunks, shards, an attribute; asserted), which
other runs leave out.
"""

from __future__ import annotations

import errno
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from tests import difftest as dt
from tests import peers_zarr as P
from tests.util import daemons_of, process_running, take_down, wait_for

#: (layout, backend, seed, steps); layouts in tests/difftest.py LAYOUTS.
CASES = [
    ("basic", "local", 3, 150),                # index at the end, crc32c, '/' keys
    ("start_nocrc_edges", "local", 2, 67),    # index at the start, no crc32c, partial edge chunks
    ("be_crc_3d_dot", "local", 3, 112),        # big-endian index, '.' keys, 3-d
    ("v2_slash_gzip_edges", "local", 3, 91),  # v2 keys with '/', gzip, partial edge chunks
    ("1d_v2_dot", "local", 3, 150),            # v2 keys with '.', 1-d
    ("zarr2", "local", 1, 95),                # v3-draft storage transformer (zarr-python 2.18)
    ("zarr2_consolidated", "local", 5, 80),   # its .zmetadata edited, members renamed away meanwhile
    ("basic", "s3", 2, 71),
    ("be_nocrc_dot_edges", "s3", 1, 100),       # big-endian index without crc32c, '.' keys
    # variable shard grids, metadata edits and resizes through the mount
    ("rectilinear_rle_int", "local", 4, 100),  # [length, repeat] runs and a bare-integer step
    ("rectangular_edges_be_dot", "local", 2, 80),  # ZEP 3 rectangular, partial edge chunks
    # consolidated hierarchies: groups, several arrays (one unsharded), consolidation
    ("hier", "local", 1, 100),
    ("hier_rect", "s3", 1, 61),                # a rectangular array among regular ones
    # Neuroglancer precomputed: a volume of 2-3 scales with odd edges and a skeleton directory
    ("pc_murmur_gzip_preshift", "local", 2, 65),  # murmurhash3, preshift, gzip index and data; identity, shard_bits 0
    ("pc_idxgzip_single_3scales", "local", 2, 58),  # one shard of one minishard, gzip index, 3 scales
    ("pc_u64_datagzip_shard0", "s3", 6, 48),      # identity, shard_bits 0, uint64, gzip data; murmurhash3, preshift 5
    ("pc_deep_keys", "local", 2, 57),            # scale keys of several names (s/t/1_1_1): below plain directories
    ("pc_deep_keys", "s3", 2, 57),
    # multi-resolution meshes, changed as pairs (and a skeleton directory)
    ("pc_mesh_identity_datagzip", "local", 1, 108),  # identity, gzip data: two shards of two minishards
    ("pc_mesh_identity_datagzip", "s3", 3, 120),
]
#: (layout, backend, seed, steps, weight) with stretches of network faults between the mount
#: and S3 (the ops faults/faultsoff, drawn at ``weight``; each seed's run has an op fail under
#: them, asserted, and with FAULT_KINDS one of those kinds too)
FAULT_CASES = [
    ("be_nocrc_dot_edges", "s3", 1, 61, 6),  # answers cut in their headers and bodies, resets, 503/500
    ("hier", "s3", 60, 96, 25),  # documents edited (and consolidated, resized, remounts) under faults
    ("pc_mesh_identity_datagzip", "s3", 13, 89, 25),  # mesh pairs changed (and remounts) under faults
]
#: ops that fail under faults in the runs of the layouts named (difftest's stats: failed_kinds;
#: umount: a remount whose unmount was refused, mount: its mount failed)
FAULT_KINDS = {"hier": {"meta", "consolidate", "resize", "umount", "mount"},
               "pc_mesh_identity_datagzip": {"mesh", "meshrm", "meshmv", "meshbad", "umount", "mount"}}


#: the race op (a file watched by one process while another changes it: difftest's
#: Applier.op_race) at RACE_WEIGHT among the others: (layout, backend, seed, steps)
RACE_CASES = [
    ("basic", "local", 1, 100),  # plain files and chunks, held descriptors, temporaries renamed over
    ("basic", "s3", 1, 80),  # the same on S3: its LIST/HEAD answers racing the writer's flushes
]
RACE_WEIGHT = 12


def _run(layout, backend, seed, steps, tmp_path, request, weights=None, opts=None):
    """One run that must pass, remounting and killing the daemon at least once."""
    if layout.startswith("zarr2") and not P.zarr2_available():
        pytest.fail(f"the zarr 2.18 interpreter {P.ZARR2_PYTHON} is missing")
    server = None
    if backend == "s3":
        server = request.getfixturevalue("moto_server")
        server.ensure_running()
    out = dt.run(layout, backend, base=tmp_path, seed=seed, steps=steps, server=server, weights=weights, opts=opts)
    if not out.ok:
        repro = tmp_path / f"repro-{layout}-{backend}-{seed}.json"
        repro.write_text(json.dumps(out.repro(), indent=1))
        pytest.fail(out.report(repro), pytrace=False)
    assert out.stats["remounts"] and out.stats["kills"], (
        f"seed {seed} of {layout}/{backend} no longer remounts and kills within {steps} steps "
        f"({out.summary()}): choose another seed")
    return out


@pytest.mark.parametrize("layout,backend,seed,steps", CASES,
                         ids=[f"{layout}-{backend}-{seed}" for layout, backend, seed, _ in CASES])
def test_random_operations_match_a_directory_store(layout, backend, seed, steps, tmp_path, request):
    """The mount and the unsharded twin agree after every one of ``steps`` random ops, every
    remount and kill -9 (then each file holds a version it had since its last durable point),
    and at the end zarr-python and tensorstore (zarr 2.18; precomputed: tensorstore) read the
    sharded source as the twin."""
    _run(layout, backend, seed, steps, tmp_path, request)


#: runs with the smallest index cache (-o index_cache=1K), which these small arrays' indexes
#: overflow: indexes (precomputed: minishard indexes too) and the listings made of them are
#: evicted all the time while chunks are written, read, listed, replaced and shrunk away (the
#: default 64M, and the 64K minimum before, never evicted one): (layout, backend, seed, steps)
EVICT_CASES = [
    ("basic", "local", 50109, 51),
    ("pc_murmur_gzip_preshift", "s3", 50109, 45),
]


@pytest.mark.parametrize("layout,backend,seed,steps", EVICT_CASES,
                         ids=[f"{layout}-{backend}-{seed}" for layout, backend, seed, _ in EVICT_CASES])
def test_random_operations_with_shard_indexes_evicted(layout, backend, seed, steps, tmp_path, request):
    """As above, with ``index_cache=1K``: every answer is the same when each index is loaded
    again and again (asserted: the mounts evicted some)."""
    out = _run(layout, backend, seed, steps, tmp_path, request, opts=[*dt.DEFAULT_OPTS, "index_cache=1K"])
    assert out.stats["index_cache"]["evicted"] > 0, out.summary()


@pytest.mark.parametrize("layout,backend,seed,steps", RACE_CASES,
                         ids=[f"{layout}-{backend}-{seed}" for layout, backend, seed, _ in RACE_CASES])
def test_a_file_watched_while_another_process_changes_it(layout, backend, seed, steps, tmp_path, request):
    """As above, with race ops among the others: what a watching process sees of a file
    (stat, fstat and pread of a descriptor held from before, a listing, a read) while
    another truncates, writes and renames over it is explained by the states the file
    passed through, in order (the checker rule: difftest's Applier.op_race)."""
    out = _run(layout, backend, seed, steps, tmp_path, request, weights={"race": RACE_WEIGHT})
    races = [op for op in out.ops if op["op"] == "race"]
    plain = [op for op in races if not op["path"].startswith("arr/")]
    assert (len(races) >= 8 and any(op["hold"] for op in plain) and any(op["hold"] for op in races if op not in plain)
            and any(s[0] == "tmprename" for op in races for s in op["mover"])), (
        f"seed {seed} of {layout}/{backend} no longer draws held plain files and chunks and "
        f"temporaries renamed over them in its race ops ({len(races)}): choose another seed")


@pytest.mark.parametrize("layout,backend,seed,steps,weight", FAULT_CASES,
                         ids=[f"{layout}-{backend}-{seed}-faults" for layout, backend, seed, _, _ in FAULT_CASES])
def test_network_faults_lose_nothing(layout, backend, seed, steps, weight, tmp_path, request):
    """As above, with stretches of network faults between the mount and S3 (difftest's ops
    faults/faultsoff): an op may fail with EIO under them (remounts, documents' edits and mesh
    ops among them), and once they end and a sync succeeds, the mount, the twin and the store
    read afresh agree, every shard whole."""
    out = _run(layout, backend, seed, steps, tmp_path, request, weights={"faults": weight})
    assert out.stats["faults"] and out.stats["failed"], (
        f"seed {seed} of {layout}/{backend} no longer has an op fail under network faults "
        f"within {steps} steps ({out.summary()}): choose another seed")
    kinds = FAULT_KINDS.get(layout, set())
    assert not kinds or kinds & set(out.stats.get("failed_kinds", ())), (
        f"seed {seed} of {layout}/{backend} no longer has one of {sorted(kinds)} fail under network "
        f"faults within {steps} steps ({out.summary()}): choose another seed")


#: race ops under network faults (races among the ops of a stretch of faults; each seed's run
#: has a race fail under them, asserted): (layout, backend, seed, steps), both at RACE_WEIGHT
RACE_FAULT_CASES = [
    ("basic", "s3", 5, 40),  # a pwrite and a truncate of a chunk failed, observations EIO
]


@pytest.mark.parametrize("layout,backend,seed,steps", RACE_FAULT_CASES,
                         ids=[f"{layout}-{backend}-{seed}" for layout, backend, seed, _ in RACE_FAULT_CASES])
def test_a_file_watched_while_it_changes_under_network_faults(layout, backend, seed, steps, tmp_path, moto_server):
    """Race ops drawn under network faults too (they were kept out): an observation that failed
    with EIO tells nothing, and a mover step that failed (EIO) may have done its work or not, so
    the file may end in the state before it or any it passes through; every other observation
    still fits the states in order (difftest's Applier.op_race), and the run agrees with the
    twin throughout."""
    moto_server.ensure_running()
    out = dt.run(layout, backend, base=tmp_path, seed=seed, steps=steps, server=moto_server,
                 weights={"faults": RACE_WEIGHT, "race": RACE_WEIGHT})
    if not out.ok:
        repro = tmp_path / f"repro-{layout}-{backend}-{seed}.json"
        repro.write_text(json.dumps(out.repro(), indent=1))
        pytest.fail(out.report(repro), pytrace=False)
    assert out.stats.get("under_faults", {}).get("race") and "race" in out.stats.get("failed_kinds", ()), (
        f"seed {seed} of {layout}/{backend} no longer has a race op fail under network faults within "
        f"{steps} steps ({out.summary()}): choose another seed")


#: directory renames (difftest's Applier.op_dirmv, local stores) at DIRMV_WEIGHT among the other
#: ops: (layout, backend, seed, steps). Their runs together rename directories (and back), have
#: one answered EXDEV, two with writers by path below meanwhile, one with a file or directory
#: held open below and one during which the daemon was killed (asserted over all: what a run
#: draws depends on which of its writers' writes landed, so one run alone may draw less; the
#: runs seen also had writers see a rename happen between their writes, dirmv_split)
DIRMV_CASES = [
    ("hier_rect", "local", 1000, 30),  # groups and arrays (a rectangular grid); consolidated metadata
    ("pc_deep_keys", "local", 1003, 30),  # a volume (its scales EXDEV), a skeleton directory, plain ones
]
DIRMV_WEIGHT = 40


#: another client changing the store behind the mount (difftest's ``other`` op at OTHER_WEIGHT;
#: the mounts have every TTL 0): (layout, backend, seed, steps, options)
OTHER_CASES = [
    ("basic", "local", 51912, 40, ["flush_delay=2", "index_cache=1K"]),  # shards rewritten and deleted, attributes
]
OTHER_WEIGHT = 15


@pytest.mark.parametrize("layout,backend,seed,steps,opts", OTHER_CASES,
                         ids=[f"{layout}-{backend}-{seed}" for layout, backend, seed, _, _ in OTHER_CASES])
def test_changes_by_another_client_show_at_once_and_merge_with_unstored_writes(layout, backend, seed, steps, opts,
                                                                               tmp_path, request):
    """As above, with another client changing the store behind the mount (SEMANTICS 2.5, 4.5):
    chunks rewritten or removed through a second mount, whole shards deleted, an attribute set in
    the stored ``zarr.json``, also while the mount holds chunks of the shard unstored or has one
    open for writing, with the indexes evicted all the time (``index_cache=1K``). With every TTL
    0 the mount shows each change at once; its own unstored chunks win the merge of its flush
    (the twin takes either where the mount may have stored them already), every other chunk
    shows the other client's version, and a kill -9 may find the other client's."""
    server = None
    if backend == "s3":
        server = request.getfixturevalue("moto_server")
        server.ensure_running()
    out = dt.run(layout, backend, base=tmp_path, seed=seed, steps=steps, server=server, opts=opts,
                 weights={"other": OTHER_WEIGHT})
    if not out.ok:
        repro = tmp_path / f"repro-{layout}-{backend}-{seed}.json"
        repro.write_text(json.dumps(out.repro(), indent=1))
        pytest.fail(out.report(repro), pytrace=False)
    other = out.stats.get("other", {})
    assert other.get("chunks") and other.get("rmshard") and other.get("attrs") and other.get("held") and \
        out.stats["index_cache"]["evicted"], (
            f"seed {seed} of {layout}/{backend} no longer rewrites chunks (one open for writing meanwhile), "
            f"deletes a shard and sets an attribute with indexes evicted within {steps} steps ({out.summary()}): "
            "choose another seed")


def test_random_directory_renames_match_a_directory_store(tmp_path):
    """As above, with directories renamed through the mount (SEMANTICS 4.18): groups, arrays,
    volumes, plain and chunk directories, onto free names, empty and full directories, files,
    into themselves, with RENAME_NOREPLACE; a file or listing held open below, writers (and a
    reader) by path below the old and the new name meanwhile, the directory moved to and fro
    under them, or the daemon killed during the rename. The twin renames where the mount did; an
    EXDEV must be one 4.18 names (inside a dataset or a v3-draft store, a chunk directory, a
    precomputed scale, something open or in memory only below; any, with writers busy below),
    the stored documents move unchanged (still sharded), and ops between a rename and the
    rename back (remounts and kill -9 too) agree with the twin."""
    said, mid, kills = {}, {}, 0
    for layout, backend, seed, steps in DIRMV_CASES:
        out = dt.run(layout, backend, base=tmp_path, seed=seed, steps=steps, weights={"dirmv": DIRMV_WEIGHT})
        if not out.ok:
            repro = tmp_path / f"repro-{layout}-{backend}-{seed}.json"
            repro.write_text(json.dumps(out.repro(), indent=1))
            pytest.fail(out.report(repro), pytrace=False)
        for total, counts in ((said, out.stats.get("dirmv", {})), (mid, out.stats.get("dirmv_mid", {}))):
            for k, n in counts.items():
                total[k] = total.get(k, 0) + n
        kills += sum(out.stats.get("dirmv_kill", {}).values())
    assert said.get("ok", 0) >= 2 and said.get("EXDEV") and mid.get("conc", 0) >= 2 and mid.get("hold") \
        and kills, (f"the seeds of DIRMV_CASES no longer rename directories, have one EXDEV, two with writers "
                    f"below, one held open below and one killed ({said}, {mid}, {kills} killed): choose others")


@pytest.mark.parametrize("case", ["exdev_not_allowed", "exdev_for_an_array", "accepted_while_held",
                                  "stored_document_changed"])
def test_the_directory_rename_checker_takes_no_exdev_blindly(case, tmp_path, monkeypatch):
    """The dirmv op's twin follows only an answer SEMANTICS 4.18 allows: a mount that answered
    EXDEV for a plain directory or a sharded array with nothing open or in memory below (its
    zarr.json is no file in memory), or renamed one while a file below was held open, diverges
    (the mount's renames are replaced by these wrong answers here); a rename that left the
    stored zarr.json of an array other than it was (here: rewritten unsharded by hand) too."""
    real = dt.Applier._dir_rename

    def wrong(self, src, dst, noreplace):
        if self.twin:
            return real(self, src, dst, noreplace)
        if case == "stored_document_changed":
            real(self, src, dst, noreplace)
            doc = self.env.src / dst / "zarr.json"
            doc.write_bytes((self.env.twin / src / "zarr.json").read_bytes())  # (the unsharded twin's)
            return None
        if case.startswith("exdev"):
            raise OSError(errno.EXDEV, "refused")
        # (else: answered ok, nothing renamed)

    monkeypatch.setattr(dt.Applier, "_dir_rename", wrong)
    op = {"op": "dirmv", "src": "plain" if case in ("exdev_not_allowed", "accepted_while_held") else "arr",
          "dst": "mv0", "how": "free", "noreplace": False}
    if case == "accepted_while_held":
        op.update(mid="hold", hold={"kind": "r", "path": "plain/a.bin", "data": ["pool", 0]})
    out = dt.run("basic", "local", base=tmp_path, seed=0, ops=[op], final=False)
    assert not out.ok, out.summary()
    want = {"exdev_not_allowed": "mount {'rename': 'EXDEV'} twin {'rename': 'ok'}",
            "exdev_for_an_array": "mount {'rename': 'EXDEV'} twin {'rename': 'ok'}",
            "accepted_while_held": "twin {'hold': 'ok', 'rename': 'EXDEV'",
            "stored_document_changed": "mount {'rename': 'ok', 'stored': ['arr/zarr.json', 'arr/zarr.json: not sharded']}"}[case]
    assert want in "\n".join(out.failure[1]), out.failure


def _race_check(tmp_path, mover, obs, final_size=None, failed_at=None):
    """The race op's verdict on the watcher's observations ``obs`` of a chunk that did not
    exist and that ``mover`` changed (Applier.op_race's checker, without a mount); with
    ``failed_at``, step ``failed_at`` of the mover failed under network faults (EIO)."""
    names = type("Names", (), {"kind": staticmethod(lambda rel: "chunk")})()
    env = type("Env", (), {"twin": tmp_path, "data": dt.Data([], None), "names": names})()
    applier = dt.Applier(env, tmp_path, twin=False)
    op = {"path": "skel/8", "mover": mover}
    path_states, held_states, written = applier._race_states(op, None if failed_at is None else failed_at + 1)
    last = path_states[-1]
    final = [["stat", len(last) if final_size is None else final_size]]
    if failed_at is None:
        return dt._race_verdict(obs, final, path_states, held_states, written)
    ends_from = len(applier._race_states(op, failed_at)[0]) - 1
    return dt._race_verdict(obs, final, path_states, held_states, written, True, ends_from)


def test_the_race_checker_under_network_faults(tmp_path):
    """Under network faults (races are drawn there too) an observation may fail with EIO, which
    tells nothing of the file's state, and the mover's step that failed (EIO; it stops there) may
    have done its work or not: once it has ended the file may hold the state before that step
    or any the step passes through. Without faults both stay divergences, and so does a state
    no step made, or one before the step that failed."""
    mover = [["write", ["rnd", 1, 333]], ["truncate", 100], ["pwrite", 0, ["rnd", 2, 5]]]
    # sizes: absent, 0 (created), 333, 100, 100 (the pwrite)
    assert _race_check(tmp_path, mover, [["stat", "EIO"], ["stat", 333]], final_size=333, failed_at=1) == "watch ok"
    assert _race_check(tmp_path, mover, [["stat", 333], ["read", "EIO"]], final_size=100, failed_at=1) == "watch ok"
    assert _race_check(tmp_path, mover, [["stat", 333]], final_size="EIO", failed_at=1) == "watch ok"
    assert "fits no state" in _race_check(tmp_path, mover, [["stat", "EIO"]])
    assert "is not its last state" in _race_check(tmp_path, mover, [["stat", 333]], final_size=333)
    assert "fits no state" in _race_check(tmp_path, mover, [["stat", 77]], final_size=333, failed_at=1)
    assert "is not its last state" in _race_check(tmp_path, mover, [], final_size=0, failed_at=1)


def test_the_race_checker_allows_a_stat_inside_a_write_the_kernel_split(tmp_path):
    """A pwrite of 4096 bytes at offset 2000 onto a 2005-byte file whose first page the kernel
    does not hold reaches the daemon as two WRITE requests (2096 bytes at 2000, 2000 at 4096:
    the kernel ends a request at a partial page it does not hold; seen on Linux 6.18 with
    ``-o debug``), and a stat between them shows 4096, the part written so far (SEMANTICS,
    Limits: a stat may run ahead of reads; scripts/difftest.py --backend s3 --layout
    pc_mesh_identity_datagzip --seed 405 --race 8 failed 2 runs of 20 on it: "scan -> [4096]
    fits no state"). Only a write does that, only at a page boundary, and only while it runs."""
    page = os.sysconf("SC_PAGE_SIZE")
    mover = [["write", ["rnd", 281462160, 333]], ["pwrite", 2000, ["rnd", 5, 5]],
             ["pwrite", 2000, ["rnd", 151520707, 4096]], ["pwrite", 2000, ["rnd", 373835829, 100]]]
    # sizes: absent, 0 (created), 333, 2005, 6096, 6096
    assert _race_check(tmp_path, mover, [["list", True], ["scan", [page]], ["stat", page], ["stat", 6096]]) \
        == "watch ok"
    assert _race_check(tmp_path, mover, [["stat", 2005], ["stat", page], ["stat", 6096]]) \
        == "watch ok"
    # not a size no write could have stopped at (inside a page), nor one back inside a write
    # whose end a stat of the same kind already showed
    assert "fits no state" in _race_check(tmp_path, mover, [["stat", 3000]])
    assert "fits no state" in _race_check(tmp_path, mover, [["stat", 6096], ["stat", 6096], ["stat", page]])
    # nor inside a truncate, which is one request
    grown = [["write", ["rnd", 1, 2005]], ["truncate", 6096]]
    assert "fits no state" in _race_check(tmp_path, grown, [["stat", 2005], ["stat", page]])


def test_a_short_write_of_the_race_mover_is_a_failed_step(tmp_path):
    """A mover's write that writes less than asked without an error (here: into a 16 KiB
    tmpfs that fills up) was counted as a step done ("ok", as the twin's): the race's results
    agreed and only what the watcher or the final compare saw of the missing bytes, if
    anything, could tell. It is now the step's result, "short write: n of m bytes", and the
    mover stops there; no errno network faults may give, so it is a divergence from the
    twin's "ok" under faults too. The twin's own steps (in this process) say it alike, and a
    temporary written short is not renamed over the file."""
    small = tmp_path / "small"
    small.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16k", "tmpfs", str(small)], check=True)
    try:
        data = bytes(range(256)) * 192  # 48 KiB, more than fits (and its hex an argument)
        steps = [["write", None, None, data.hex()], ["truncate", 10, None, None]]
        mover = subprocess.run([sys.executable, "-c", dt._RACE_MOVER, str(small / "f"), json.dumps(steps)],
                               input="go\n", capture_output=True, text=True, timeout=60)
        assert mover.returncode == 0, mover.stderr
        ready, out = mover.stdout.splitlines()
        res = json.loads(out)
        assert len(res) == 1 and re.fullmatch(r"short write: \d+ of 49152 bytes", res[0]), res
        assert (small / "f").stat().st_size < len(data)  # (not truncated: the mover stopped)
        assert not dt.fault_failed([res, "watch ok"])
        (small / "f").unlink()
        (small / "g").write_bytes(b"old")
        got = dt._race_step(str(small / "g"), "tmprename", None, None, data, "twin")
        assert got.startswith("short write: ") and (small / "g").read_bytes() == b"old"
        (small / ".race-tmp.twin").unlink()
        got = dt._race_step(str(small / "g"), "pwrite", None, 1, data, "twin")
        assert got.startswith("short write: ")
        assert dt._race_step(str(small / "g"), "pwrite", None, 1, b"xy", "twin") == "ok"
    finally:
        subprocess.run(["umount", "-l", str(small)], check=False)


def test_a_short_write_of_an_op_is_a_failed_step(tmp_path):
    """The ops write, pwrite, append, hold, tmprename, meta's writes and conc's writers
    ignored how many bytes os.write/os.pwrite wrote: a write that wrote less than asked
    without an error (here: into a 16 KiB tmpfs that fills up) counted as done ("ok"), so
    only what a later read or the final compare happened to see could tell. Such an op now
    stops there and its result is "short write: n of m bytes" (conc: its writer's "fail:"
    with it), which no errno network faults may give, as for the race mover's steps."""
    small = tmp_path / "small"
    small.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16k", "tmpfs", str(small)], check=True)
    try:
        big = bytes(range(256)) * 192  # 48 KiB, more than fits
        env = SimpleNamespace(names=None, data={"big": big, "small": b"xy"})
        ap = dt.Applier(env, small, twin=False)
        short = re.compile(r"short write: \d+ of (49152|24576) bytes")
        ops = [{"op": "write", "path": "w", "data": "big"},
               {"op": "write", "path": "w", "data": "big", "pieces": 2},
               {"op": "pwrite", "path": "w", "data": "big", "off": 1},
               {"op": "append", "path": "w", "data": "big"},
               {"op": "tmprename", "path": "w", "tmp": "w.tmp", "data": "big"},
               {"op": "hold", "path": "w", "d1": "big", "o1": 0, "d2": "small", "o2": 0, "other": "w"},
               {"op": "hold", "path": "w", "d1": "small", "o1": 0, "d2": "big", "o2": 0, "other": "w"}]
        for op in ops:
            for name in os.listdir(small):
                os.unlink(small / name)
            got = ap.apply(op)
            assert isinstance(got, str) and short.fullmatch(got), (op, got)
            assert not dt.fault_failed(got) and not dt.fault_failed([got, "watch ok"]), got
        for name in os.listdir(small):
            os.unlink(small / name)
        conc = {"op": "conc", "jobs": [[("a", 0, "big")], [("b", 0, "small")]]}
        got = ap.apply(conc)
        assert re.match(r"fail:short write: \d+ of 49152 bytes", got) and not dt.fault_failed(got), got
        for name in os.listdir(small):
            os.unlink(small / name)
        twin = dt.Applier(SimpleNamespace(names=None, data=env.data), small, twin=False)
        twin.twin = True  # (the twin's own writers, in this process; no names to prepare)
        twin._twin_prepare = lambda rel, creating: None
        got = twin.apply(conc)
        assert re.match(r"fail:short write: \d+ of 49152 bytes", got), got
        for name in os.listdir(small):
            os.unlink(small / name)
        assert ap.apply({"op": "pwrite", "path": "w", "data": "small", "off": 1}) == "ok"
    finally:
        subprocess.run(["umount", "-l", str(small)], check=False)


def test_the_run_summary_counts_race_ops(tmp_path):
    """A run's summary (what scripts/difftest.py prints for a run that passed) shows its race
    coverage as it shows remounts and kills: how many race ops, how many held a descriptor,
    and each kind of observation and of mover step (it counted none of them). A short run of
    race ops and writes only, without the final check."""
    weights = {**{k: 0 for k in dt.WEIGHTS}, "race": 3, "write": 1}
    out = dt.run("basic", "local", base=tmp_path, seed=2, steps=8, weights=weights, final=False)
    assert out.ok, out.report()
    races = [op for op in out.ops if op["op"] == "race"]
    assert len(races) >= 3 and any(op["hold"] for op in races), out.ops  # (the seed's draw)
    watch, mover = {}, {}
    for op in races:
        for k in op["watch"]:
            watch[k] = watch.get(k, 0) + 1
        for s in op["mover"]:
            mover[s[0]] = mover.get(s[0], 0) + 1
    summary = json.loads(out.summary())
    assert summary["races"] == len(races), summary
    assert summary["race_held"] == sum(1 for op in races if op["hold"]), summary
    assert (summary["race_watch"], summary["race_mover"]) == (watch, mover), summary


def _daemons(base) -> dict[int, Path]:
    """The daemons of the runs below ``base``: those whose logs name them (``zshardfs[PID]``
    in each line) and those running on a run's mount points: pid -> mount point."""
    out = {int(pid): log.parent / ("mnt-check" if log.name == "daemon-check.log" else "mnt")
           for log in base.rglob("daemon*.log") for pid in re.findall(r"zshardfs\[(\d+)\]", log.read_text())}
    for mnt in [*base.glob("dt-*/mnt"), *base.glob("dt-*/mnt-check")]:
        out.update((pid, mnt) for pid in daemons_of(mnt))
    return out


def _left_behind(base) -> list[str]:
    """Daemons still running and mounts still up below ``base`` (then taken down: a failed
    check leaves nothing either)."""
    daemons = _daemons(base)
    running = [pid for pid in daemons if process_running(pid)]
    with open("/proc/mounts") as f:
        mounts = [line.split()[1] for line in f if line.split()[1].startswith(str(base))]
    for pid, mnt in daemons.items():
        take_down(mnt, pid)
    return [f"daemon {pid}" for pid in running] + mounts


def test_a_run_aborted_while_a_chunk_is_not_stored_leaves_no_daemon(tmp_path, moto_server, monkeypatch):
    """A run interrupted (KeyboardInterrupt) under network faults, a chunk written and not
    stored: the unmount of the teardown is refused (storage calls still fail fast, SEMANTICS
    5.5), and the teardown only detached the mount (fusermount3 -uz): its daemon went on
    retrying the store every 30 s for ever, through a proxy that was gone. Now each daemon the
    run started is ended, and no mount is left."""
    def op_abort(self, op):
        assert "failed" in self.op_sync(op)  # (the write cannot be stored now)
        raise KeyboardInterrupt

    monkeypatch.setattr(dt.Applier, "op_abort", op_abort, raising=False)
    moto_server.ensure_running()
    ops = [{"op": "write", "path": "arr/c/0/0", "data": ["rnd", 2, 17], "pieces": 1},
           {"op": "faults", "p": 1.0, "seed": 1, "kinds": ["reset"]},
           {"op": "abort"}]
    with pytest.raises(KeyboardInterrupt):
        dt.run("basic", "s3", base=tmp_path, ops=ops, server=moto_server)
    assert _daemons(tmp_path)
    assert not _left_behind(tmp_path)


def test_difftest_ended_by_sigterm_leaves_no_daemon_or_mount(tmp_path):
    """scripts/difftest.py ended by SIGTERM (a timeout's kill, a CI job cancelled) died at once,
    its mount and daemon left running. Now SIGTERM unwinds through the run's teardown."""
    script = Path(__file__).resolve().parent.parent / "scripts" / "difftest.py"
    proc = subprocess.Popen([sys.executable, str(script), "--seed", "1", "--steps", "100000", "--base", str(tmp_path)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        assert wait_for(lambda: any(log.read_text().count(" mounted ") for log in tmp_path.rglob("daemon.log")),
                        timeout=60, interval=0.1), "no mount within 60 s"
        time.sleep(1)
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 128 + signal.SIGTERM, proc.stdout.read()[-3000:]
    assert not _left_behind(tmp_path)


def test_a_writers_temporary_renamed_over_its_file_takes_an_older_temporary_with_it(tmp_path):
    """A dirmv writer writing its file through a temporary (``tmp``) opens ``<file>.tmp-w``
    with O_TRUNC and renames it over the file: a temporary of that name already there (one an
    earlier op's writer left, its rename ENOENT after the directory moved) is rewritten and
    renamed away with it. The twin wrote only the file and kept the old temporary, which then
    moved with the directory; the mount has none ("x/b/2/2.tmp-w: mount None twin 24:...":
    scripts/difftest.py --seed 12013 --layout hier_rect --steps 30 --dirmv 40, step 21,
    the temporary left by step 8). Here the old temporary is a plain file written first; the
    writer is done long before the rename (delay 1 s)."""
    ops = [{"op": "write", "path": "plain/b.bin.tmp-w", "data": ["pool", 1], "pieces": 1},
           {"op": "dirmv", "src": "plain", "dst": "mv0", "how": "free", "noreplace": False, "mid": "conc",
            "w1": [["plain/b.bin", ["rnd", 7, 5], 0, "tmp"]], "w2": [], "delay": 1.0}]
    out = dt.run("basic", "local", base=tmp_path, seed=0, ops=ops, final=False)
    assert out.ok, out.failure


def test_a_tmprename_whose_rename_failed_under_faults_after_moving_is_a_failed_step(tmp_path, monkeypatch):
    """Under network faults a rename may fail with EIO having done its work (on S3: the file
    stored at its new name, then the DELETE of the old retried until it gave up, one attempt
    having removed it): the tmprename op's clean-up unlink of its temporary then met ENOENT,
    and the op's result was that ENOENT instead of the rename's EIO, a divergence (seed 20207,
    pc_deep_keys, s3, --faults 3). It is now "rename:EIO", a step failed under faults, whose
    names the runner takes from the mount; without faults the ENOENT still shows."""
    real_rename = os.rename

    def rename_then_eio(a, b):
        real_rename(a, b)
        raise OSError(errno.EIO, "the old name's DELETE failed (after it removed it)")

    monkeypatch.setattr(dt.os, "rename", rename_then_eio)
    env = SimpleNamespace(names=None, data={"d": b"new bytes"})
    ap = dt.Applier(env, tmp_path, twin=False)
    op = {"op": "tmprename", "tmp": ".zarr-tmp.1", "path": "c", "data": "d", "fsync": True, "dirfsync": True}
    ap.under_faults = True
    got = ap.apply(op)
    assert got == "rename:EIO" and dt.fault_failed(got), got
    assert (tmp_path / "c").read_bytes() == b"new bytes" and not (tmp_path / ".zarr-tmp.1").exists()
    (tmp_path / "c").unlink()
    ap.under_faults = False
    assert ap.apply(op) == "ENOENT"


def test_the_read_only_check_mount_leaves_out_options_only_a_read_write_mount_takes(tmp_path, monkeypatch):
    """After a stretch of network faults the runner mounts the store read-only to check it,
    with the run's options plus ``ro``: a run with ``-o shard=K`` then failed there with "option
    shard: only makes sense on a read-write mount" (seed 20269, be_crc_3d_dot, s3, --faults 3,
    -o shard=3,metadata_ttl=0). A read-only mount now leaves ``shard`` out; the others stay."""
    seen = []

    def fake_run_mount(source, where, *opts, **kw):
        seen.append(opts)
        return SimpleNamespace(returncode=1, stderr="not mounted (test)")

    monkeypatch.setattr(dt, "run_mount", fake_run_mount)
    env = dt.Env("basic", "local", ["shard=3", "metadata_ttl=0"], tmp_path)
    for opts in (("ro",), ()):
        with pytest.raises(RuntimeError):
            env.mount(tmp_path / "m", opts)
    assert seen == [("metadata_ttl=0", "ro"), ("shard=3", "metadata_ttl=0")], seen


def _two_writers_around_a_move(tmp_path, monkeypatch, line: str, instead: str):
    """Run one dirmv of ``plain`` to ``mv0`` (1 s in) with a writer below each (``b.bin``
    through a temporary; the one below ``mv0`` 1.5 s in), the writers' script having ``line``
    replaced by ``instead`` (to force an interleaving)."""
    writer = dt.Applier._DIRMV_WRITER.replace(line, instead)
    assert writer != dt.Applier._DIRMV_WRITER
    monkeypatch.setattr(dt.Applier, "_DIRMV_WRITER", writer)
    ops = [{"op": "dirmv", "src": "plain", "dst": "mv0", "how": "free", "noreplace": False, "mid": "conc",
            "w1": [["plain/b.bin", ["rnd", 5, 24], 0, "tmp"]],
            "w2": [["mv0/b.bin", ["rnd", 6, 1], 1.5, "tmp"]], "delay": 1.0}]
    return dt.run("basic", "local", base=tmp_path, seed=0, ops=ops, final=False)


def test_a_writers_temporary_left_by_the_rename_is_taken_by_the_other_writers_temporary_after_it(tmp_path, monkeypatch):
    """A dirmv writer below ``src`` whose temporary (``tmp``) was made before the directory
    moved and whose rename by the old name then fails ("rename:ENOENT") leaves it in the moved
    directory; the writer below ``dst``, writing the same file through a temporary of the same
    name after the rename, opens it (O_TRUNC) and renames it over the file: the mount has no
    temporary. The twin wrote the writers below ``dst`` first and the temporary left after
    them ("x/b/2/2.tmp-w: mount None twin 24:bb23e745bc": scripts/difftest.py --seed 20010
    --layout hier_rect --steps 40 --dirmv 40 --meta 60, step 34, once). Here the interleaving
    is forced: the writers wait (up to 3 s) for the file's directory to be gone before their
    rename, the directory moves 1 s in (its temporary stored by then), the writer below ``dst``
    starts 1.5 s in."""
    wait = ("            t=time.time()\n"
            "            while os.path.isdir(os.path.dirname(p)) and time.time()-t<3: time.sleep(0.01)\n")
    line = "            os.rename(p+'.tmp-w',p)\n"
    out = _two_writers_around_a_move(tmp_path, monkeypatch, line, wait + line)
    assert out.ok, out.failure
    assert out.stats["dirmv"] == {"ok": 1}, out.stats  # (moved: the writer below src left its temporary)


@pytest.mark.parametrize("bytes_", ["its own", "others"])
def test_a_writers_temporary_made_after_the_other_writer_took_the_old_one_stays(bytes_, tmp_path, monkeypatch):
    """The reverse of the interleaving above: the writer below ``src`` met the directory before
    it moved and its create of the temporary lands after the rename, in the moved directory,
    after the writer below ``dst`` wrote the same file through a temporary of that name and
    renamed it over the file; its rename by the old name is then ENOENT ("rename:ENOENT"), as
    when the temporary was made before the rename. The mount holds the temporary, where the
    twin (the left temporary written first, then taken by the other writer's) has none; the
    twin cannot tell the two orders apart, so either state is right for that path
    (Applier._late_temporaries; before: 'mv0/b.bin.tmp-w: mount 24:7ed6e6ce59 twin None').
    Forced here: the writer below ``src`` takes the directory (O_PATH: no open handle, the
    rename is not refused) before the rename, waits (up to 5 s) for the writer below ``dst``
    to have renamed its temporary over the file (1.5 s in; the directory moves 1 s in), then
    creates the temporary through that descriptor. With ``others``, the temporary holds bytes
    its writer did not write (reversed): still a divergence, the twin takes no state blindly."""
    late = ("        if '/plain/' in p:\n"
            "            dd=os.open(os.path.dirname(p),os.O_PATH|os.O_DIRECTORY)\n"
            "            q,t=p.replace('/plain/','/mv0/'),time.time()\n"
            "            while not (os.path.isfile(q) and os.path.getsize(q)==1 and not os.path.exists(q+'.tmp-w'))"
            " and time.time()-t<5: time.sleep(0.01)\n"
            "            fd=os.open(os.path.basename(p)+'.tmp-w',os.O_WRONLY|os.O_CREAT|os.O_TRUNC,0o644,dir_fd=dd)\n"
            "            os.close(dd)\n"
            + ("            d=d[::-1]\n" if bytes_ == "others" else "") +
            "        else:\n"
            "            fd=os.open(p+'.tmp-w' if m=='tmp' else p,os.O_WRONLY|os.O_CREAT|os.O_TRUNC,0o644)\n")
    line = "        fd=os.open(p+'.tmp-w' if m=='tmp' else p,os.O_WRONLY|os.O_CREAT|os.O_TRUNC,0o644)\n"
    out = _two_writers_around_a_move(tmp_path, monkeypatch, line, late)
    if bytes_ == "others":
        assert not out.ok and "mv0/b.bin.tmp-w: mount 24:" in str(out.failure), out.failure
        return
    assert out.ok, out.failure
    assert out.stats["dirmv"] == {"ok": 1}, out.stats
    assert out.stats.get("dirmv_late_tmp") == 1, out.stats  # (the mount held the late temporary)


def test_the_meta_op_of_a_v3_draft_store_leaves_what_zarr_2_18_opens(tmp_path):
    """The meta op (scripts/difftest.py --meta W) on the zarr2 layout drew the store's entry
    point ``zarr.json`` too and added ``attributes`` to it, which zarr 2.18 refuses ("Unexpected
    keys in metadata"), so the final zarr 2.18 read failed on the source and the twin alike, a
    divergence of the checker (seed 40004, zarr2, local, --meta 10). Its edits, drawn at random
    and applied to the twin, now leave a store zarr 2.18 opens, with their attributes in the
    array's document."""
    env = dt.Env("zarr2", "local", [], tmp_path)
    env.case.build(env.src, env.twin)  # (the store and its twin; nothing mounted)
    gen = dt.Gen(env, dt.random.Random(1), {**{k: 0 for k in dt.WEIGHTS}, "meta": 1})
    ap = dt.Applier(env, env.twin, twin=True)
    ops = [gen.op() for _ in range(12)]
    assert {o["op"] for o in ops} == {"meta"}, ops
    assert [ap.apply(o) for o in ops] == ["ok"] * len(ops), ops
    assert dt.zarr2_compare(env, env.twin) == []
    attrs = json.loads((env.twin / "meta/root/arr.array.json").read_bytes())["attributes"]
    assert set(attrs) & {"a", "b", "c"}, attrs


def test_the_zarr2_consolidated_layout_is_read_through_its_consolidated_metadata(tmp_path):
    """zarr 2.18's consolidated metadata (``meta/root/consolidated/.zmetadata``, SEMANTICS 1)
    had no layout in the tester, so no run edited it through the mount (its members' entries,
    their own documents renamed away meanwhile) nor read the stored store consolidated. The
    zarr2_consolidated layout (scripts/difftest.py --layout zarr2_consolidated) has it, and its
    final check reads source and twin through it too: a stored entry that lost its sharding
    transformer (zarr 2.18 then takes the shards for chunks) is a divergence, as is an
    attribute the consolidated entry lost; the store as built passes."""
    if not P.zarr2_available():
        pytest.fail(f"the zarr 2.18 interpreter {P.ZARR2_PYTHON} is missing")
    env = dt.Env("zarr2_consolidated", "local", [], tmp_path)
    env.case.build(env.src, env.twin)  # (the store and its twin; nothing mounted)
    assert dt.ZMETADATA in env.names.meta and env.names.consolidated == dt.ZMETADATA
    assert dt.zarr2_compare(env, env.src) == []
    doc = env.src / dt.ZMETADATA
    good = json.loads(doc.read_bytes())
    for change in ("transformer", "attribute"):
        bad = json.loads(json.dumps(good))
        entry = bad["metadata"]["meta/root/arr.array.json"]
        if change == "transformer":
            del entry["storage_transformers"]
        else:
            twin = json.loads((env.twin / dt.ZMETADATA).read_bytes())
            twin["metadata"]["meta/root/arr.array.json"]["attributes"] = {"k": 1}
            (env.twin / dt.ZMETADATA).write_text(json.dumps(twin))
        doc.write_text(json.dumps(bad))
        out = dt.zarr2_compare(env, env.src)
        assert len(out) == 1 and out[0].startswith("[final] zarr 2.18 read"), out
        if change == "attribute":
            assert "'attributes (consolidated)', {}, {'k': 1}" in out[0], out
        env.names.consolidated = None  # (read as before: not through the consolidated metadata)
        assert dt.zarr2_compare(env, env.src) == []
        env.names.consolidated = dt.ZMETADATA


def test_a_conc_writer_below_a_removed_chunk_directory_fails_alone(tmp_path):
    """conc's twin answered ENOENT for the whole op, writing nothing, when one writer's file lay
    below a chunk directory removed by rmdir (Env.removed_chunkdirs), where the mount runs each
    writer until its first error: the other writer's files were written there, and the run
    diverged (seen in an ``other`` campaign: scripts/difftest.py --seed 51002 --backend s3 --other
    8, step 49). The twin's writers now stop each at its own first error."""
    ops = [{"op": "unlink", "path": f"arr/c/1/{j}"} for j in range(4)]
    ops += [{"op": "rmdir", "path": "arr/c/1"},
            {"op": "conc", "jobs": [[["arr/c/2/0", 0, ["rnd", 1, 100]], ["arr/c/3/0", 0, ["rnd", 2, 100]]],
                                    [["arr/c/4/0", 0, ["rnd", 3, 100]], ["arr/c/1/1", 0, ["rnd", 4, 100]],
                                     ["arr/c/0/1", 0, ["rnd", 5, 100]]]]}]
    out = dt.run("basic", "local", base=tmp_path, ops=ops, final=False)
    assert out.ok, out.report()


def test_the_other_client_checker_sees_a_mount_that_trusts_its_caches(tmp_path, monkeypatch):
    """The ``other`` op's check is not blind: a mount that trusts its listings, indexes and the
    kernel's entries for 1000 s (where OTHER_OPTS sets 0) shows a chunk as it read it before
    another client rewrote it, and the run diverges at that op."""
    monkeypatch.setattr(dt, "OTHER_OPTS", ("metadata_ttl=1000", "index_ttl=1000", "attr_timeout=1000"))
    ops = [{"op": "write", "path": "arr/c/1/1", "data": ["rnd", 1, 100]}, {"op": "sync"},
           {"op": "read", "path": "arr/c/1/1"},
           {"op": "other", "sync": True, "how": "chunks", "changes": [["arr/c/1/1", ["rnd", 2, 64]]]}]
    out = dt.run("basic", "local", base=tmp_path, ops=ops, final=False)
    assert not out.ok and out.failure[0] == 3 and any("arr/c/1/1" in x for x in out.failure[1]), out.report()
