"""The daemon's CPU time and the wall time of a cold S3 scan, A/B between
code trees (issue 3: on two cores shared by moto, the daemon, the readers
and the kernel, a cold scan is largely CPU-bound).

    .venv/bin/python scripts/ab_s3_scan.py TREE [TREE...] [--rounds 8] [--pyspy PREFIX]

Each TREE is a checkout of zshardfs (e.g. a ``git worktree`` of an older
commit); its daemon runs with ``PYTHONPATH=TREE``.  One moto server and
bench_s3.py's store (2048 chunks of 32 KiB in 32 shards of 2 MiB); each round
runs one cold scan (``find MNT -type f | xargs cat`` on a fresh mount) per
tree, the order alternating.  The daemon's CPU is its utime + stime of
``/proc/PID/stat`` (all threads) across the scan only, mount and unmount
excluded.  Reports per tree the medians, and per tree against the first the
median of the per-round differences (paired: the machine's load changes
between rounds more than between the two scans of one round).
``--pyspy PREFIX``: record each scan with py-spy (``--gil --native``; raw
collapsed stacks in PREFIX-TREE-ROUND.txt; it slows the daemon: for
profiles, not for the figures).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_s3 as b  # noqa: E402

from tests.s3server import MotoServer, set_dummy_credentials  # noqa: E402

TICK = os.sysconf("SC_CLK_TCK")
PYSPY = os.environ.get("PYSPY", "py-spy")


def cpu(pid: int) -> tuple[float, float]:
    """(user, system) CPU seconds of a process, all its threads."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return int(fields[11]) / TICK, int(fields[12]) / TICK


def scan(tree: str, workdir: Path, url: str, pyspy: str | None) -> tuple[float, float, float]:
    """(user, system, wall) seconds of one cold scan on a fresh mount."""
    env = dict(os.environ, PYTHONPATH=tree)
    mnt = workdir / "mnt"
    mnt.mkdir(exist_ok=True)
    zs = [sys.executable, "-m", "zshardfs.cli"]
    subprocess.run([*zs, "mount", f"s3://{b.BUCKET}/{b.PREFIX}", str(mnt), "-o", f"ro,log_file={workdir}/daemon.log",
                    "--endpoint-url", url], check=True, env=env, cwd=tree)
    try:
        pid = int(os.getxattr(mnt, "user.zshardfs.pid"))
        spy = None
        if pyspy:
            spy = subprocess.Popen([PYSPY, "record", "--gil", "--native", "-f", "raw", "-o", pyspy, "-p", str(pid)],
                                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            time.sleep(1.0)  # (py-spy attaching: nothing to wait on)
        u0, s0 = cpu(pid)
        t0 = time.perf_counter()
        n = b.cat_all(mnt / "arr", 1)
        wall = time.perf_counter() - t0
        u1, s1 = cpu(pid)
        assert 0 < n - 512 * 512 * 256 < 4096, n
        if spy:
            spy.send_signal(2)
            spy.wait()
    finally:
        subprocess.run([*zs, "umount", str(mnt)], check=True, env=env, cwd=tree)
    return u1 - u0, s1 - s0, wall


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("trees", nargs="+")
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--pyspy", default=None, metavar="PREFIX")
    ap.add_argument("--workdir", default=None)
    args = ap.parse_args()
    set_dummy_credentials()
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="zshardfs-ab-s3-"))
    workdir.mkdir(parents=True, exist_ok=True)
    src = b.build(workdir)
    server = MotoServer(workdir / "moto-access.log")
    server.start()
    runs: dict[str, list[tuple[float, float, float]]] = {t: [] for t in args.trees}
    try:
        b.upload(server, src)
        for i in range(args.rounds):
            for tree in args.trees if i % 2 == 0 else args.trees[::-1]:
                out = f"{args.pyspy}-{Path(tree).name}-{i}.txt" if args.pyspy else None
                u, s, w = scan(tree, workdir, server.endpoint_url, out)
                runs[tree].append((u, s, w))
                print(f"round {i + 1} {tree}: cpu {u + s:.2f} s (user {u:.2f}, sys {s:.2f}), wall {w:.2f} s", flush=True)
    finally:
        server.stop()
    med = statistics.median
    for tree, rs in runs.items():
        print(f"{tree}: median cpu {med(u + s for u, s, _ in rs):.3f} s (user {med(u for u, _, _ in rs):.3f}, "
              f"sys {med(s for _, s, _ in rs):.3f}), wall {med(w for _, _, w in rs):.3f} s")
    first = runs[args.trees[0]]
    for tree in args.trees[1:]:
        rs = runs[tree]
        dc = med(rs[i][0] + rs[i][1] - first[i][0] - first[i][1] for i in range(len(rs)))
        dw = med(rs[i][2] - first[i][2] for i in range(len(rs)))
        print(f"{tree} against {args.trees[0]}: paired median difference cpu {dc:+.3f} s, wall {dw:+.3f} s")


if __name__ == "__main__":
    main()
