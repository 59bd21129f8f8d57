"""Read benchmark: the mount against the native file system and zarr-python.

    .venv/bin/python scripts/bench_read.py [--chunks 4096] [--repeat 5] [--warm 3] [--pin] [--workdir DIR]

Builds (once, in --workdir) a Zarr v3 array of 32 KiB uncompressed inner
chunks, sharded (512 chunks per shard), and its unsharded twin written by
zarr-python.  Then, repeated --repeat times, it measures:

1. ``cat`` of every chunk file (find | xargs cat):
   - native: the unsharded twin on the local file system, page cache warm
     (the median of --warm passes);
   - cold: through a fresh zshardfs mount of the sharded store (``-o ro``);
   - warm: the same again on that mount (kernel caches warm; the median of
     --warm passes right after the cold one), with the READ requests each
     warm pass still cost (pages the kernel dropped meanwhile);
   - the same cold and warm on scripts/minimal_fs.py serving the unsharded
     twin from memory: the ceiling pyfuse3 + trio allow on this machine;
   and prints files/s and the ratio to native.
2. zarr-python reading random single chunks: through the mount (as an
   unsharded array) against zarr-python reading the sharded store directly.

Medians over the repeats are printed; these machines are noisy.  --pin locks
both stores' files in memory for the run (the machine's proactive reclaim
otherwise pages out some of them between passes).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
ZSHARDFS = [sys.executable, "-m", "zshardfs.cli"]


def build(workdir: Path, n_chunks: int) -> tuple[Path, Path, tuple]:
    import zarr

    side = round(n_chunks ** (1 / 3))
    while side ** 3 < n_chunks:
        side += 1
    grid = (side, side, max(1, n_chunks // (side * side)))
    shape = tuple(g * 32 for g in grid)
    sharded, twin = workdir / "sharded", workdir / "twin"
    if (sharded / "a" / "zarr.json").exists() and (twin / "a" / "zarr.json").exists():
        return sharded, twin, shape
    rng = np.random.default_rng(0)
    data = rng.integers(0, 256, size=shape, dtype=np.uint8)
    kw = dict(shape=shape, dtype="uint8", chunks=(32, 32, 32), compressors=None, fill_value=0)
    zarr.create_array(sharded / "a", shards=(256, 256, 256 if shape[2] >= 256 else shape[2]), **kw)[:] = data
    zarr.create_array(twin / "a", **kw)[:] = data
    return sharded, twin, shape


def cat_all(root: Path) -> tuple[float, int]:
    """Seconds to cat every file below ``root`` (find | xargs cat)."""
    t0 = time.perf_counter()
    find = subprocess.Popen(["find", str(root), "-type", "f", "-print0"], stdout=subprocess.PIPE)
    out = subprocess.run(["xargs", "-0", "cat"], stdin=find.stdout, stdout=subprocess.PIPE, check=True)
    find.wait()
    return time.perf_counter() - t0, len(out.stdout)


def pin(*roots: Path) -> list:
    """Lock every file below ``roots`` in memory for as long as the returned
    maps live: this machine's proactive reclaim then cannot page the stores
    out between passes (``--pin``; see docs/PERFORMANCE.md).  The maps are
    shared and read-only, so what is locked is the page cache's own pages
    (mlock of a writable private map would lock private copies of them,
    leaving the files' pages to reclaim)."""
    import ctypes
    import mmap

    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.mlock.argtypes = libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]

    class Pinned:
        def __init__(self, addr: int, size: int):
            self.addr, self.size = addr, size

        def __del__(self):
            libc.munmap(self.addr, self.size)

    maps = []
    for root in roots:
        for path in root.rglob("*"):
            if path.is_file() and path.stat().st_size:
                size = path.stat().st_size
                with open(path, "rb") as f:
                    addr = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, f.fileno(), 0)
                if addr == ctypes.c_void_p(-1).value:
                    raise OSError(ctypes.get_errno(), f"mmap of {path}")
                maps.append(Pinned(addr, size))
                if libc.mlock(addr, size) != 0:
                    raise OSError(ctypes.get_errno(), f"mlock of {path}")
    return maps


def kernel_reads(mnt: Path) -> int:
    """READ requests the mount has served: in a warm pass, each is a page
    the kernel dropped (this machine's proactive reclaim pages out page
    cache that looks idle, see docs/PERFORMANCE.md)."""
    return json.loads(os.getxattr(mnt, "user.zshardfs.stats"))["kernel"]["reads"]


def count_files(root: Path) -> int:
    return sum(len(files) for _, _, files in os.walk(root))


def mount(source: Path, mnt: Path, *opts: str) -> None:
    mnt.mkdir(parents=True, exist_ok=True)
    subprocess.run([*ZSHARDFS, "mount", str(source), str(mnt), "-o",
                    ",".join(["ro", f"log_file={mnt.parent / (mnt.name + '.log')}", *opts])], check=True)


def umount(mnt: Path) -> None:
    subprocess.run([*ZSHARDFS, "umount", str(mnt)], check=True)


def warm_passes(root: Path, n: int) -> float:
    """The median seconds of ``n`` passes of cat_all (each one a few tenths
    of a second: one pass is at the mercy of a noisy machine)."""
    return statistics.median(cat_all(root)[0] for _ in range(n))


def minimal_fs(twin: Path, mnt: Path, passes: int) -> tuple[float, float]:
    """(cold, warm) seconds of cat_all on the minimal in-memory pyfuse3 fs."""
    mnt.mkdir(parents=True, exist_ok=True)
    proc = subprocess.Popen([sys.executable, str(HERE / "minimal_fs.py"), str(twin), str(mnt)],
                            stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "ready"
        cold = cat_all(mnt)[0]
        warm = warm_passes(mnt, passes)
    finally:
        subprocess.run(["fusermount3", "-u", str(mnt)], check=False)
        proc.wait(timeout=30)
    return cold, warm


def zarr_random_reads(path: Path, shape, picks) -> float:
    import zarr

    arr = zarr.open_array(path, mode="r")
    t0 = time.perf_counter()
    for i, j, k in picks:
        arr[i * 32:(i + 1) * 32, j * 32:(j + 1) * 32, k * 32:(k + 1) * 32]
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--chunks", type=int, default=4096)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--warm", type=int, default=3, help="warm passes per mount (and native), median taken")
    ap.add_argument("--random-reads", type=int, default=300)
    ap.add_argument("--pin", action="store_true", help="lock the stores' files in memory during the run")
    ap.add_argument("--workdir", default=os.path.join(tempfile.gettempdir(), "zshardfs-bench-read"))
    args = ap.parse_args()
    workdir = Path(args.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    sharded, twin, shape = build(workdir, args.chunks)
    files = count_files(twin / "a")
    print(f"store: shape {shape}, 32 KiB chunks, {files} files incl. zarr.json, shards of 512 chunks")

    pinned = pin(sharded, twin) if args.pin else []
    if pinned:
        print(f"pinned {len(pinned)} files of the two stores in memory")
    native, cold, warm, base_cold, base_warm, warm_reads = [], [], [], [], [], []
    cat_all(twin)  # warm the page cache of the twin and of the shards
    cat_all(sharded)
    mnt = workdir / "mnt"
    for _ in range(args.repeat):
        native.append(warm_passes(twin, args.warm))
        mount(sharded, mnt)
        try:
            t, nbytes = cat_all(mnt)
            cold.append(t)
            before = kernel_reads(mnt)
            warm.append(warm_passes(mnt, args.warm))
            warm_reads.append((kernel_reads(mnt) - before) / args.warm)
        finally:
            umount(mnt)
        c, w = minimal_fs(twin, workdir / "mnt-minimal", args.warm)
        base_cold.append(c)
        base_warm.append(w)
    med = statistics.median
    print("\ncat of every chunk file (median of %d runs)" % args.repeat)
    print(f"  native twin (warm page cache) {files / med(native):10.0f} files/s")
    print(f"  zshardfs cold                 {files / med(cold):10.0f} files/s   ratio {med(native) / med(cold):.2f}x native")
    print(f"  zshardfs warm                 {files / med(warm):10.0f} files/s   ratio {med(native) / med(warm):.2f}x native")
    print(f"    READ requests per warm pass: {', '.join(f'{r:.0f}' for r in warm_reads)} (pages the kernel "
          "dropped since the cold pass)")
    print(f"  minimal pyfuse3 fs, cold      {files / med(base_cold):10.0f} files/s   ratio "
          f"{med(native) / med(base_cold):.2f}x native (zshardfs: {med(base_cold) / med(cold):.2f}x of it)")
    print(f"  minimal pyfuse3 fs, warm      {files / med(base_warm):10.0f} files/s   ratio "
          f"{med(native) / med(base_warm):.2f}x native (zshardfs: {med(base_warm) / med(warm):.2f}x of it)")

    rng = random.Random(1)
    grid = tuple(s // 32 for s in shape)
    direct, through = [], []
    for _ in range(args.repeat):
        picks = [tuple(rng.randrange(g) for g in grid) for _ in range(args.random_reads)]
        direct.append(zarr_random_reads(sharded / "a", shape, picks))
        mount(sharded, mnt)
        try:
            through.append(zarr_random_reads(mnt / "a", shape, picks))
        finally:
            umount(mnt)
    n = args.random_reads
    print(f"\nzarr-python, {n} random single chunks (median of {args.repeat} runs, fresh mount each)")
    print(f"  zarr-python on the sharded store  {n / med(direct):8.0f} chunks/s")
    print(f"  zarr-python through zshardfs      {n / med(through):8.0f} chunks/s   "
          f"ratio {med(direct) / med(through):.2f}x")


if __name__ == "__main__":
    main()
