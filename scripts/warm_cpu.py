"""CPU time the daemon spends per request in warm passes, A/B between code trees.

    .venv/bin/python scripts/warm_cpu.py STORE TREE [TREE...] [--rounds 5] [--passes 6] [--minimal] [--find]

STORE holds ``sharded/`` (a sharded Zarr store) and ``twin/`` (its unsharded
twin), as scripts/bench_read.py builds them.  Each TREE is a checkout of
zshardfs whose ``zshardfs/`` package is the one imported (``TREE+VAR=VALUE``
adds a variable to that daemon's environment, for experiments); --minimal
adds scripts/minimal_fs.py serving the twin.  Each round mounts every subject
at once (``-o ro``, fresh mounts), makes one cold pass of ``find | xargs
cat`` on each, then --passes warm passes on each, alternating between the
mounts so that all see the same load, each measured by the daemon's CPU time
(schedstat of all its threads) and the wall time.

Wall time on a shared, noisy machine says little; the daemon's CPU time per
request says what the daemon costs.  A warm pass is OPEN and RELEASE per
file plus OPENDIR, two READDIRs and RELEASEDIR per directory (READs only for
pages the kernel dropped), so "per request" divides by 2 * files + 4 * dirs
(--find: the passes only list, 4 * dirs).  "paired" is the median, over the
passes, of a subject's CPU time over the first subject's in the same turn.

Never drops caches; builds nothing (bench_read.py's --workdir holds a STORE).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def cpu_seconds(pid: int) -> float:
    """Time on a CPU of the live threads of ``pid`` (schedstat, in ns: the
    ticks of /proc/PID/stat, 10 ms, are coarse for a pass of a few tenths of
    a second).  A warm pass hops to no worker thread."""
    total = 0
    for task in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{task}/schedstat") as f:
                total += int(f.read().split()[0])
        except FileNotFoundError:  # (a thread that ended meanwhile)
            pass
    return total / 1e9


def cat_all(root: Path, listing_only: bool = False) -> float:
    """Seconds to cat every file below ``root`` (only list them: ``find``)."""
    t0 = time.perf_counter()
    if listing_only:
        subprocess.run(["find", str(root), "-type", "f"], stdout=subprocess.DEVNULL, check=True)
        return time.perf_counter() - t0
    find = subprocess.Popen(["find", str(root), "-type", "f", "-print0"], stdout=subprocess.PIPE)
    subprocess.run(["xargs", "-0", "cat"], stdin=find.stdout, stdout=subprocess.DEVNULL, check=True)
    find.wait()
    return time.perf_counter() - t0


def wait_mounted(mnt: Path, proc: subprocess.Popen) -> None:
    deadline = time.monotonic() + 60
    while not os.path.ismount(mnt):
        if proc.poll() is not None or time.monotonic() > deadline:
            raise SystemExit(f"{mnt}: not mounted (exit {proc.returncode})")
        time.sleep(0.05)


def serve(what: str, store: Path, mnt: Path) -> subprocess.Popen:
    mnt.mkdir(parents=True, exist_ok=True)
    if what == "minimal":
        proc = subprocess.Popen([sys.executable, str(HERE / "minimal_fs.py"), str(store / "twin"), str(mnt)],
                                stdout=subprocess.DEVNULL)
    else:
        tree, _, extra = what.partition("+")  # (TREE+VAR=VALUE+...: an environment for experiments)
        env = dict(os.environ, PYTHONPATH=tree, **dict(e.split("=", 1) for e in extra.split("+") if e))
        proc = subprocess.Popen([sys.executable, "-m", "zshardfs.cli", "mount", "-f", str(store / "sharded"),
                                 str(mnt), "-o", f"ro,log_file={mnt}.log"], cwd=tree, env=env)
    wait_mounted(mnt, proc)
    return proc


def mounted(subjects: list[str], store: Path) -> list[tuple[subprocess.Popen, Path]]:
    """Every subject mounted at once (a fresh mount each), after one cold pass."""
    out = []
    try:
        for i, s in enumerate(subjects):
            mnt = store / f"mnt{i}"
            out.append((serve(s, store, mnt), mnt))
            cat_all(mnt)  # cold
    except BaseException:
        unmount(out)
        raise
    return out


def unmount(mounts) -> None:
    for proc, mnt in mounts:
        subprocess.run(["fusermount3", "-u", str(mnt)], check=False)
        proc.wait(timeout=60)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("store", type=Path)
    ap.add_argument("trees", nargs="+")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--passes", type=int, default=5)
    ap.add_argument("--minimal", action="store_true")
    ap.add_argument("--find", action="store_true", help="warm passes list only (find): OPENDIR, READDIR, "
                                                         "RELEASEDIR")
    args = ap.parse_args()
    files = sum(len(f) for _, _, f in os.walk(args.store / "twin"))
    dirs = sum(1 for _ in os.walk(args.store / "twin"))
    requests = 4 * dirs if args.find else 2 * files + 4 * dirs
    subjects = list(args.trees) + (["minimal"] if args.minimal else [])
    results = {s: [] for s in subjects}
    cat_all(args.store / "twin")
    cat_all(args.store / "sharded")
    for r in range(args.rounds):
        mounts = mounted(subjects, args.store)
        try:
            # passes alternate between the mounts, so each sees the same load
            for p in range(args.passes):
                order = list(range(len(subjects)))
                order = order[p % len(order):] + order[:p % len(order)]
                for i in order:
                    proc, mnt = mounts[i]
                    c0 = cpu_seconds(proc.pid)
                    wall = cat_all(mnt, args.find)
                    results[subjects[i]].append((cpu_seconds(proc.pid) - c0, wall))
        finally:
            unmount(mounts)
        line = ", ".join(f"{statistics.median(c for c, _ in results[s][-args.passes:]) / requests * 1e6:.2f}"
                         for s in subjects)
        print(f"round {r}: us/request {line}", flush=True)
    print(f"\n{files} files, {dirs} dirs, {requests} requests per warm pass; medians of all passes")
    first = results[subjects[0]]
    for s in subjects:
        cpu = statistics.median(c for c, _ in results[s])
        wall = statistics.median(w for _, w in results[s])
        paired = statistics.median(c / c0 for (c, _), (c0, _) in zip(results[s], first))
        print(f"{s}: cpu {cpu * 1e3:.0f} ms = {cpu / requests * 1e6:.2f} us/request, wall {wall * 1e3:.0f} ms; "
              f"paired with the first: {paired:.3f}x")


if __name__ == "__main__":
    main()
