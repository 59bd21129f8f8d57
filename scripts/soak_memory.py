"""Memory soak: does the daemon's memory stay bounded over a long life?

    .venv/bin/python scripts/soak_memory.py [--backend local|s3] [--minutes 4] [--env MALLOC_ARENA_MAX=2]
                                            [--opts chunk_cache=4M,...] [--workdir DIR] [--json OUT]

Writes a sharded store (zarr-python: ``big``, 4096 chunks of 4 KiB in 64
shards, 16 MiB, four times the chunk cache it mounts with; ``flat``, 4096
chunks of 1 KiB in one directory; ``meta``, a small array whose document is
edited), mounts it read-write (local directory, or a moto server from
tests/s3server.py for ``--backend s3``) with small caches and short
timeouts, and runs rounds of a mixed workload until the time is up:

- a full scan of ``big`` (every chunk file read), and random chunk reads;
- chunk writes (random chunks, and one whole shard), a chunk written to a
  temporary file and renamed onto its name, a chunk unlinked and written anew;
- a listing of ``flat`` with a stat of every entry (4096 lookups);
- a directory of its own per round (200 files created, renamed, listed,
  removed with it: lookups the kernel forgets, inodes the daemon drops);
- an edit of ``meta``'s zarr.json (write a temporary, rename it over);
- a new array written through the view each round (stored sharded,
  ``-o shard=4``), removed two rounds later (``rm -r``);
- ``zshardfs sync`` every third round.

Then, with ``--burst MIB``, a write burst: a new array of MIB MiB (32 KiB
chunks) written through the view in four passes, each a quarter of every
shard (so the shards stay in memory, partial, until the last pass; with
``--opts flush_delay=inf`` up to three quarters of MIB are held), ``zshardfs
sync``, and ``--idle`` seconds of nothing: the RSS right after the sync and
at the end of the idle time show whether the memory the write buffers held
is given back to the system (``-o malloc_trim=on``, the default) or kept
(``--opts malloc_trim=off``).

No ``drop_caches``: the kernel forgets what is removed, and what it keeps of
the rest is bounded by the store.  After every round it samples the daemon's
RSS (/proc/PID/status) and ``zshardfs stats --json`` (its caches and the
entries of every internal table), prints one line, and at the end whether RSS
and any table kept growing after the warm-up (the first third of the rounds):
RSS growth is the slope of a least-squares line through the later samples.
``--env`` passes variables to the daemon (allocator experiments:
``MALLOC_ARENA_MAX=2``, ``MALLOC_TRIM_THRESHOLD_=...``).

Exit status 0: bounded; 1: RSS or a table grew past the thresholds
(--max-growth MiB per minute, default 1.0); a table with a cap of its own
that grows towards it in a short run is named, not counted.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

ZSHARDFS = [sys.executable, "-m", "zshardfs.cli"]
BUCKET, PREFIX = "zshardfs-soak", "data"
DEFAULT_OPTS = ("rw,chunk_cache=4M,index_cache=256K,attr_timeout=0.2,metadata_ttl=0.5,index_ttl=0.5,"
                "flush_delay=0.5,shard=4")


def build(src: Path) -> None:
    import zarr

    rng = np.random.default_rng(0)
    zarr.create_array(src / "big", shape=(256, 256, 256), dtype="uint8", chunks=(16, 16, 16), shards=(64, 64, 64),
                      compressors=None, fill_value=0)[:] = rng.integers(0, 256, (256, 256, 256), dtype=np.uint8)
    zarr.create_array(src / "flat", shape=(2048, 2048), dtype="uint8", chunks=(32, 32), shards=(512, 512),
                      compressors=None, fill_value=0, chunk_key_encoding={"name": "v2", "separator": "."}
                      )[:] = rng.integers(0, 256, (2048, 2048), dtype=np.uint8)
    zarr.create_array(src / "meta", shape=(64, 64), dtype="uint8", chunks=(8, 8), shards=(32, 32),
                      compressors=None, fill_value=0)[:] = 1
    (src / "scratch").mkdir()
    (src / "new").mkdir()
    (src / "scratch" / ".keep").write_bytes(b"")  # (S3: the directory exists)
    (src / "new" / ".keep").write_bytes(b"")


def rss(pid: int) -> int:
    """Resident bytes of process ``pid``."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS")


def stats(mnt: Path) -> dict:
    out = subprocess.run([*ZSHARDFS, "stats", "--json", str(mnt)], capture_output=True, text=True, check=True)
    return json.loads(out.stdout)


def chunk_files(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*") if p.is_file() and p.name != "zarr.json")


class Workload:
    def __init__(self, mnt: Path, seed: int = 0):
        self.mnt = mnt
        self.rng = random.Random(seed)
        self.big = [p.relative_to(mnt) for p in chunk_files(mnt / "big")]
        assert len(self.big) == 4096, len(self.big)

    def round(self, i: int) -> None:
        m, rng = self.mnt, self.rng
        # full scan, then random reads
        for p in self.big:
            (m / p).read_bytes()
        for p in rng.sample(self.big, 500):
            (m / p).read_bytes()
        # chunk writes: random chunks, one whole shard (16x16x16 chunks of 4 KiB; 4x4x4 per shard)
        for p in rng.sample(self.big, 64):
            (m / p).write_bytes(os.urandom(4096))
        sx, sy, sz = (rng.randrange(4) for _ in range(3))
        for x in range(4 * sx, 4 * sx + 4):
            for y in range(4 * sy, 4 * sy + 4):
                for z in range(4 * sz, 4 * sz + 4):
                    (m / "big" / "c" / str(x) / str(y) / str(z)).write_bytes(os.urandom(4096))
        # write-then-rename onto a chunk's name; unlink a chunk and write it anew
        p = m / rng.choice(self.big)
        tmp = p.parent / f".tmp{i}"
        tmp.write_bytes(os.urandom(4096))
        os.rename(tmp, p)
        p = m / rng.choice(self.big)
        p.unlink()
        p.write_bytes(os.urandom(4096))
        # a big listing, every entry looked up
        flat = m / "flat"
        names = os.listdir(flat)
        for n in names:
            os.lstat(flat / n)
        # a directory of its own: files made, renamed, listed, removed with it
        d = m / "scratch" / f"r{i}"
        d.mkdir()
        for k in range(200):
            (d / f"f{k}").write_bytes(b"x" * 1024)
        for k in range(200):
            os.rename(d / f"f{k}", d / f"g{k}")
        assert len(os.listdir(d)) == 200
        for k in range(0, 200, 2):
            os.stat(d / f"g{k}")
        shutil.rmtree(d)
        # a metadata edit as an editor saves it
        doc_path = m / "meta" / "zarr.json"
        doc = json.loads(doc_path.read_bytes())
        doc.setdefault("attributes", {})["round"] = i
        tmp = m / "meta" / ".zarr.json.tmp"
        tmp.write_text(json.dumps(doc))
        os.rename(tmp, doc_path)
        # a new array written through the view; the one of two rounds ago removed
        import zarr

        a = zarr.create_array(str(m / "new" / f"r{i}"), shape=(64, 64), dtype="uint8", chunks=(8, 8),
                              compressors=None, fill_value=0)
        a[:] = np.full((64, 64), i % 256, dtype=np.uint8)
        old = m / "new" / f"r{i - 2}"
        if old.exists():
            shutil.rmtree(old)
        if i % 3 == 2:
            subprocess.run([*ZSHARDFS, "sync", str(m)], check=True, capture_output=True)


def burst(mnt: Path, pid: int, mib: int, idle: float) -> None:
    """Write ``mib`` MiB through the view, store it, stay idle (see the docstring)."""
    import zarr

    before = rss(pid)
    side = 32
    n = max(1, (mib << 20) // (256 * 256 * side))
    a = zarr.create_array(str(mnt / "new" / "burst"), shape=(n * side, 256, 256), dtype="uint8",
                          chunks=(side, side, side), compressors=None, fill_value=0)
    peak = before
    for k in sorted(range(n), key=lambda k: (k % 4, k)):  # (shard=4: every shard partial until the last pass)
        a[k * side:(k + 1) * side] = np.random.default_rng(k).integers(0, 256, (side, 256, 256), dtype=np.uint8)
        peak = max(peak, rss(pid))
    subprocess.run([*ZSHARDFS, "sync", str(mnt)], check=True, capture_output=True)
    stored = rss(pid)
    time.sleep(idle)
    trims = stats(mnt).get("malloc_trim", {})
    print(f"burst of {n * side * 256 * 256 >> 20} MiB: RSS {before / 2**20:.1f} MiB before, peak {peak / 2**20:.1f}, "
          f"{stored / 2**20:.1f} once stored, {rss(pid) / 2**20:.1f} after {idle:g} s idle "
          f"(malloc_trim: {trims.get('calls', 0)} calls, {trims.get('returned_bytes', 0) / 2**20:.0f} MiB returned)",
          flush=True)


def caps() -> dict[str, int]:
    """The bound of each table of ``zshardfs stats`` that has one of its own
    (the others follow the store, the open files or the caches' bytes)."""
    from zshardfs import fuse_ops, shards, view, writeback
    from zshardfs.backends import base, local

    return {"datasets": 4096, "documents": 4096, "own_versions": 4096, "chunk_changes": 65536 + 1,
            "removed_dirs": 65536 + 1, "fresh_nodes": 4096 + 1, "listed_nodes": view.LISTED_NODES, "orphans": 1024, "probed": 256,
            "forgotten": fuse_ops.REMEMBERED_INODES, "positions": shards.SCAN_SHARDS, "unread": shards.SCAN_SHARDS,
            "stored": writeback.WriteBack.STORED_KEPT, "emptied": view.View.EMPTIED_MAX,
            "listings": base.AsyncStore.LIST_CACHE_ITEMS, "store_documents": base.AsyncStore.LIST_CACHE_ITEMS,
            "listed_lately": base.AsyncStore.LIST_CACHE_ITEMS, "unanswered": 1024,
            "swept_dirs": local.LocalBackend.SWEPT_DIRS, "kept_fds": 64}


def slope(xs: list[float], ys: list[float]) -> float:
    """Least-squares slope of ys over xs."""
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    den = sum((x - mx) ** 2 for x in xs)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / den if den else 0.0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backend", choices=("local", "s3"), default="local")
    ap.add_argument("--minutes", type=float, default=4.0)
    ap.add_argument("--opts", default="", help="more -o options for the mount (after the defaults)")
    ap.add_argument("--env", action="append", default=[], help="NAME=VALUE for the daemon (repeatable)")
    ap.add_argument("--workdir", type=Path, default=None)
    ap.add_argument("--max-growth", type=float, default=1.0, help="MiB per minute of RSS after warm-up")
    ap.add_argument("--json", type=Path, default=None, help="write every sample here")
    ap.add_argument("--burst", type=int, default=0, help="MiB written in one burst after the rounds")
    ap.add_argument("--idle", type=float, default=15.0, help="seconds idle after the burst")
    args = ap.parse_args()

    work = Path(args.workdir or tempfile.mkdtemp(prefix="zshardfs-soak-"))
    work.mkdir(parents=True, exist_ok=True)
    src, mnt = work / "src", work / "mnt"
    if src.exists():
        shutil.rmtree(src)
    build(src)
    mnt.mkdir(exist_ok=True)
    env = os.environ.copy()
    for item in args.env:
        name, _, value = item.partition("=")
        env[name] = value
    opts = DEFAULT_OPTS + f",log_file={work / 'daemon.log'}" + (f",{args.opts}" if args.opts else "")
    server = None
    if args.backend == "s3":
        from tests.s3server import MotoServer, set_dummy_credentials

        set_dummy_credentials(env)
        set_dummy_credentials(os.environ)
        server = MotoServer(work / "moto.log")
        server.start()
        server.create_bucket(BUCKET)
        server.put_many(BUCKET, {f"{PREFIX}/{p.relative_to(src)}": p.read_bytes()
                                 for p in src.rglob("*") if p.is_file()})
        source, extra = f"s3://{BUCKET}/{PREFIX}", ["--endpoint-url", server.endpoint_url]
    else:
        source, extra = str(src), []
    samples: list[dict] = []
    try:
        subprocess.run([*ZSHARDFS, "mount", source, str(mnt), "-o", opts, *extra], check=True, env=env)
        pid = stats(mnt)["pid"]
        work_load = Workload(mnt)
        start = time.monotonic()
        i = 0
        print(f"daemon {pid}, {args.backend}, -o {opts}, env {args.env or '-'}", flush=True)
        print(" round    min  rss_MiB  chunk_MiB  index_KiB  inodes  tables(nonzero)", flush=True)
        while time.monotonic() - start < args.minutes * 60:
            work_load.round(i)
            s = stats(mnt)
            sample = {"round": i, "t": time.monotonic() - start, "rss": rss(pid), "stats": s}
            samples.append(sample)
            tables = {k: v for k, v in s["tables"].items() if v}
            print(f"{i:6d} {sample['t'] / 60:6.2f} {sample['rss'] / 2**20:8.1f} "
                  f"{s['chunk_cache']['bytes'] / 2**20:10.1f} {s['index_cache']['bytes'] / 1024:10.0f} "
                  f"{s['inodes']:7d}  {tables}", flush=True)
            i += 1
        if args.burst:
            burst(mnt, pid, args.burst, args.idle)
    finally:
        subprocess.run([*ZSHARDFS, "umount", str(mnt)], capture_output=True)
        if server is not None:
            server.stop()
    if args.json:
        args.json.write_text(json.dumps(samples))
    later = samples[len(samples) // 3:]
    if len(later) < 3:
        print("too few rounds to judge (run longer)")
        return 1
    per_min = slope([s["t"] / 60 for s in later], [s["rss"] / 2**20 for s in later])
    print(f"RSS after warm-up: {later[0]['rss'] / 2**20:.1f} -> {later[-1]['rss'] / 2**20:.1f} MiB, "
          f"peak {max(s['rss'] for s in samples) / 2**20:.1f} MiB, slope {per_min:+.2f} MiB/min "
          f"over {len(later)} rounds")
    grown, capped = [], caps()
    for name in later[0]["stats"]["tables"]:
        values = [s["stats"]["tables"][name] for s in later]
        # a table that reached a new high in the last third of the rounds, and
        # more than doubled since warm-up, is still growing
        third = len(values) // 3 or 1
        if max(values[-third:]) > max(values[:-third]) and values[-1] > 2 * max(values[0], 16):
            grown.append(f"{name} {values[0]} -> {values[-1]}" + (f" (capped at {capped[name]})" if name in capped else ""))
    print("tables still growing: " + (", ".join(grown) if grown else "none"))
    grown = [g for g in grown if "capped" not in g]
    bounded = per_min <= args.max_growth and not grown
    print("bounded" if bounded else "GROWING")
    return 0 if bounded else 1


if __name__ == "__main__":
    sys.exit(main())
