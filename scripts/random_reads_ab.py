"""zarr-python's random single-chunk reads: through fresh mounts of one or
more checkouts against zarr-python on the sharded store, alternating.

    .venv/bin/python scripts/random_reads_ab.py [TREE[@OPT,OPT...]...] [--runs 5] [--reads 300] [--workdir DIR]

Builds (or reuses) scripts/bench_read.py's store.  Each run draws 300 chunks,
reads them with zarr-python directly from the sharded store, then through a
fresh ``-o ro`` mount of each TREE (a checkout; default: this one), and
prints per read: wall time, the daemon's CPU (utime+stime of all its
threads, /proc/PID/stat) and the FUSE requests by kind (from a ``-o debug``
trace of a separate, untimed mount).  Medians over runs; on a noisy shared
machine the CPU and request counts are the figures to trust.
"""

from __future__ import annotations

import argparse
import collections
import os
import random
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from bench_read import build, pin  # noqa: E402



def cpu_of(pid: int) -> float:
    """Seconds of CPU all of the daemon's threads ran (schedstat: ns, where
    /proc/PID/stat's utime+stime count 10 ms ticks, too coarse here); a
    thread that ended is in /proc/PID/stat only, which adds its ticks."""
    total = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            total += int((task / "schedstat").read_text().split()[0])
        except (FileNotFoundError, ProcessLookupError):
            pass
    return total / 1e9


def mount(tree: Path, source: Path, mnt: Path, *opts: str) -> int:
    mnt.mkdir(parents=True, exist_ok=True)
    log = mnt.parent / (mnt.name + ".log")
    log.unlink(missing_ok=True)
    py = tree / ".venv/bin/python"
    subprocess.run([str(py), "-m", "zshardfs.cli", "mount", str(source), str(mnt), "-o",
                    ",".join(["ro", f"log_file={log}", *opts])], check=True, cwd=tree)
    return int(os.getxattr(mnt, "user.zshardfs.pid"))


def umount(mnt: Path) -> None:
    subprocess.run(["fusermount3", "-u", str(mnt)], check=True)
    time.sleep(0.3)


def reads(path: Path, picks) -> float:
    import zarr

    arr = zarr.open_array(path, mode="r")
    t0 = time.perf_counter()
    for i, j, k in picks:
        arr[i * 32:(i + 1) * 32, j * 32:(j + 1) * 32, k * 32:(k + 1) * 32]
    return time.perf_counter() - t0


def requests(tree: Path, source: Path, mnt: Path, picks, *opts: str) -> collections.Counter:
    """FUSE requests by kind of the timed part, from a -o debug trace."""
    pid = mount(tree, source, mnt, "debug", *opts)
    log = mnt.parent / (mnt.name + ".log")
    try:
        import zarr

        arr = zarr.open_array(mnt / "a", mode="r")
        start = log.stat().st_size
        for i, j, k in picks:
            arr[i * 32:(i + 1) * 32, j * 32:(j + 1) * 32, k * 32:(k + 1) * 32]
        time.sleep(0.3)
    finally:
        umount(mnt)
    del pid
    text = log.read_text()[start:]
    return collections.Counter(m.group(1) for m in re.finditer(r"\b(\w+)\(.*\) -> .* in [\d.]+ ms", text))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("trees", nargs="*", default=[str(HERE.parent)])
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--reads", type=int, default=300)
    ap.add_argument("--chunks", type=int, default=4096)
    ap.add_argument("--no-trace", action="store_true", help="skip the -o debug run that counts requests")
    ap.add_argument("--pin", action="store_true", help="lock the sharded store in memory (bench_read --pin)")
    ap.add_argument("--workdir", default=os.path.join(tempfile.gettempdir(), "zshardfs-bench-read"))
    args = ap.parse_args()
    workdir = Path(args.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    sharded, _, shape = build(workdir, args.chunks)
    grid = tuple(s // 32 for s in shape)
    pinned = pin(sharded) if args.pin else []  # (held for the run)
    if pinned:
        print(f"pinned {len(pinned)} files of the sharded store in memory")
    trees = [Path(t.partition("@")[0]).resolve() for t in args.trees]
    opts = [tuple(filter(None, t.partition("@")[2].split(","))) for t in args.trees]
    rng = random.Random(1)
    n = args.reads
    wall = collections.defaultdict(list)
    cpu = collections.defaultdict(list)
    for run in range(args.runs):
        picks = [tuple(rng.randrange(g) for g in grid) for _ in range(n)]
        wall["direct"].append(reads(sharded / "a", picks))
        for t, tree in enumerate(trees):
            mnt = workdir / f"mnt-ab{t}"
            pid = mount(tree, sharded, mnt, *opts[t])
            try:
                c0 = cpu_of(pid)
                wall[t].append(reads(mnt / "a", picks))
                cpu[t].append(cpu_of(pid) - c0)
            finally:
                umount(mnt)
        print(f"run {run}: direct {wall['direct'][-1] / n * 1e6:.0f} us/read; "
              + "; ".join(f"tree{t} {wall[t][-1] / n * 1e6:.0f} us wall, {cpu[t][-1] / n * 1e6:.0f} us cpu"
                          for t in range(len(trees))), flush=True)
    med = statistics.median
    print(f"\nmedians of {args.runs} runs, {n} random chunks each, per read:")
    print(f"  zarr-python direct         {med(wall['direct']) / n * 1e6:7.0f} us wall")
    for t, tree in enumerate(trees):
        print(f"  tree{t} {str(tree):20s} {med(wall[t]) / n * 1e6:7.0f} us wall  "
              f"{med(cpu[t]) / n * 1e6:6.0f} us daemon cpu  ratio {med(wall['direct']) / med(wall[t]):.2f}x")
    if not args.no_trace:
        picks = [tuple(rng.randrange(g) for g in grid) for _ in range(n)]
        for t, tree in enumerate(trees):
            c = requests(tree, sharded, workdir / f"mnt-ab{t}", picks, *opts[t])
            print(f"  tree{t} requests per read: " + ", ".join(f"{k} {v / n:.2f}" for k, v in sorted(c.items())))


if __name__ == "__main__":
    main()
