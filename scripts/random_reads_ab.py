"""zarr-python's random single-chunk reads: through fresh mounts of one or
more checkouts against zarr-python on the sharded store, alternating.

    .venv/bin/python scripts/random_reads_ab.py [TREE[@OPT,OPT...]...] [--runs 5] [--reads 300]
                                                [--minimal] [--twin] [--workdir DIR]

Builds (or reuses) scripts/bench_read.py's store.  Each run draws 300 chunks,
reads them with zarr-python directly from the sharded store, then through a
fresh ``-o ro`` mount of each TREE (a checkout; default: this one), and
prints per read: wall time, the daemon's CPU (schedstat of all its
threads), its minor page faults and the FUSE requests by kind (every request the kernel sent,
read off /dev/fuse by ``strace`` of a separate, untimed mount: a ``-o
debug`` trace misses those libfuse answers itself, such as the IOCTL that
Python's ``open()`` sends to ask ``isatty``).  --minimal adds
scripts/minimal_fs.py serving the unsharded twin (the ceiling of any pyfuse3
file system), --twin zarr-python reading the twin on the local disk.  The
subjects' order turns by one each run, so each comes first in turn.
Medians over runs; on a noisy shared machine the CPU and request counts are
the figures to trust.
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


def faults_of(pid: int) -> int:
    """Minor page faults of the daemon so far (/proc/PID/stat: new memory
    touched, among others)."""
    stat = Path(f"/proc/{pid}/stat").read_text()
    return int(stat[stat.rindex(")") + 2:].split()[7])


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


def serve_minimal(twin: Path, mnt: Path) -> subprocess.Popen:
    """scripts/minimal_fs.py serving ``twin`` at ``mnt``, ready."""
    mnt.mkdir(parents=True, exist_ok=True)
    proc = subprocess.Popen([sys.executable, str(HERE / "minimal_fs.py"), str(twin), str(mnt)],
                            stdout=subprocess.PIPE, text=True)
    if proc.stdout.readline().strip() != "ready":
        proc.kill()
        raise SystemExit(f"{mnt}: the minimal fs did not start (exit {proc.wait()})")
    return proc


def reads(path: Path, picks) -> float:
    import zarr

    arr = zarr.open_array(path, mode="r")
    t0 = time.perf_counter()
    for i, j, k in picks:
        arr[i * 32:(i + 1) * 32, j * 32:(j + 1) * 32, k * 32:(k + 1) * 32]
    return time.perf_counter() - t0


# FUSE opcodes (linux/fuse.h) of the requests these reads can cause
OPCODES = {1: "lookup", 2: "forget", 3: "getattr", 14: "open", 15: "read", 18: "release", 22: "getxattr",
           25: "flush", 27: "opendir", 28: "readdir", 29: "releasedir", 39: "ioctl", 42: "batch_forget",
           44: "readdirplus", 46: "lseek"}


def fuse_requests(trace: str) -> collections.Counter:
    """Requests by kind in an ``strace -xx`` of a daemon's reads: each
    request is one read of /dev/fuse, whose header holds the opcode
    (``struct fuse_in_header``: len, then opcode, little-endian u32s).
    Reads of any other file cannot look like that: they are not 40+ bytes
    whose first word is their own length."""
    counts = collections.Counter()
    for m in re.finditer(r'\bread\(\d+, "((?:\\x[0-9a-f]{2}){8})[^)]*\) = (\d+)', trace):
        head = bytes.fromhex(m.group(1).replace("\\x", ""))
        length, opcode = int.from_bytes(head[:4], "little"), int.from_bytes(head[4:], "little")
        if length == int(m.group(2)) and length >= 40:
            counts[OPCODES.get(opcode, f"opcode{opcode}")] += 1
    return counts


def requests(pid: int, path: Path, picks) -> collections.Counter:
    """FUSE requests by kind that reading ``picks`` from ``path`` (served by
    the daemon ``pid``) causes, off the daemon's /dev/fuse (strace)."""
    import zarr

    arr = zarr.open_array(path, mode="r")
    with tempfile.NamedTemporaryFile("r", suffix=".strace") as out:
        tracer = subprocess.Popen(["strace", "-f", "-p", str(pid), "-e", "trace=read", "-xx", "-s", "8",
                                   "-o", out.name], stderr=subprocess.PIPE, text=True)
        try:
            # strace says "attached" (once per thread) before it traces
            deadline = time.monotonic() + 30
            while "attached" not in tracer.stderr.readline():
                if tracer.poll() is not None or time.monotonic() > deadline:
                    raise SystemExit(f"strace -p {pid} did not start")
            time.sleep(0.5)
            for i, j, k in picks:
                arr[i * 32:(i + 1) * 32, j * 32:(j + 1) * 32, k * 32:(k + 1) * 32]
            time.sleep(0.3)
        finally:
            tracer.terminate()
            tracer.wait(timeout=30)
        return fuse_requests(out.read())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("trees", nargs="*", default=[str(HERE.parent)])
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--reads", type=int, default=300)
    ap.add_argument("--chunks", type=int, default=4096)
    ap.add_argument("--minimal", action="store_true", help="add the minimal pyfuse3 fs serving the twin")
    ap.add_argument("--twin", action="store_true", help="add zarr-python reading the unsharded twin directly")
    ap.add_argument("--no-trace", action="store_true", help="skip the strace run that counts requests")
    ap.add_argument("--pin", action="store_true", help="lock the stores in memory (bench_read --pin)")
    ap.add_argument("--workdir", default=os.path.join(tempfile.gettempdir(), "zshardfs-bench-read"))
    args = ap.parse_args()
    workdir = Path(args.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    sharded, twin, shape = build(workdir, args.chunks)
    grid = tuple(s // 32 for s in shape)
    pinned = pin(sharded, twin) if args.pin else []  # (held for the run)
    if pinned:
        print(f"pinned {len(pinned)} files of the two stores in memory")
    trees = [Path(t.partition("@")[0]).resolve() for t in args.trees]
    opts = [tuple(filter(None, t.partition("@")[2].split(","))) for t in args.trees]
    subjects = ["direct"] + (["twin"] if args.twin else []) + list(range(len(trees))) \
        + (["minimal"] if args.minimal else [])
    names = {"direct": "zarr-python direct (sharded)", "twin": "zarr-python on the twin",
             "minimal": "minimal fs (twin)", **{t: f"tree{t} {tree}" for t, tree in enumerate(trees)}}

    def start(s, mnt: Path) -> tuple[int, subprocess.Popen | None]:
        if s == "minimal":
            proc = serve_minimal(twin, mnt)
            return proc.pid, proc
        return mount(trees[s], sharded, mnt, *opts[s]), None

    def stop(mnt: Path, proc) -> None:
        umount(mnt)
        if proc is not None:
            proc.wait(timeout=30)

    rng = random.Random(1)
    n = args.reads
    wall = collections.defaultdict(list)
    cpu = collections.defaultdict(list)
    faults = collections.defaultdict(list)
    for run in range(args.runs):
        picks = [tuple(rng.randrange(g) for g in grid) for _ in range(n)]
        for s in subjects[run % len(subjects):] + subjects[:run % len(subjects)]:
            if s in ("direct", "twin"):
                wall[s].append(reads((sharded if s == "direct" else twin) / "a", picks))
                continue
            mnt = workdir / f"mnt-ab{s}"
            pid, proc = start(s, mnt)
            try:
                c0, f0 = cpu_of(pid), faults_of(pid)
                wall[s].append(reads(mnt / "a", picks))
                cpu[s].append(cpu_of(pid) - c0)
                faults[s].append(faults_of(pid) - f0)
            finally:
                stop(mnt, proc)
        print(f"run {run}: " + "; ".join(
            f"{s if isinstance(s, str) else f'tree{s}'} {wall[s][-1] / n * 1e6:.0f} us wall"
            + (f", {cpu[s][-1] / n * 1e6:.0f} us cpu" if cpu[s] else "") for s in subjects), flush=True)
    med = statistics.median
    print(f"\nmedians of {args.runs} runs, {n} random chunks each, per read "
          f"(ratio: zarr-python direct over it, >1 is faster):")
    for s in subjects:
        print(f"  {names[s]:36s} {med(wall[s]) / n * 1e6:7.0f} us wall"
              + (f"  {med(cpu[s]) / n * 1e6:6.0f} us daemon cpu, {med(faults[s]) / n:4.1f} page faults"
                 if cpu[s] else " " * 41)
              + f"  ratio {med(wall['direct']) / med(wall[s]):.2f}x")
    for t in range(1, len(trees)):
        paired = [b / a for a, b in zip(cpu[0], cpu[t])]
        print(f"  tree{t} over tree0, daemon cpu paired by run: median {med(paired):.3f}x, "
              f"lower in {sum(p < 1 for p in paired)} of {len(paired)} runs")
    if not args.no_trace:
        picks = [tuple(rng.randrange(g) for g in grid) for _ in range(n)]
        for s in subjects:
            if s in ("direct", "twin"):
                continue
            mnt = workdir / f"mnt-ab{s}"
            pid, proc = start(s, mnt)
            try:
                c = requests(pid, mnt / "a", picks)
            finally:
                stop(mnt, proc)
            print(f"  {names[s]} requests per read: "
                  + ", ".join(f"{k} {v / n:.2f}" for k, v in sorted(c.items())))


if __name__ == "__main__":
    main()
