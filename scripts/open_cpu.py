"""CPU time of the daemon's OPEN and RELEASE handlers for chunk files, between code trees.

    .venv/bin/python scripts/open_cpu.py STORE TREE [--rounds 7] [--rw] [--profile]

STORE holds ``sharded/`` and its unsharded ``twin/`` (scripts/bench_read.py's
workdir; the twin names the chunk files).  With the zshardfs package of TREE (a
checkout), each of --rounds fresh views and handler tables (no FUSE) looks up every chunk file, then opens and
releases each once ("cold": the open fills the page cache, as a cold ``cat``
does; the notification is a copy of the bytes into memory, as the kernel's) and then twice more ("warm": filled already), then once more with a READ of
the whole file ("after a page drop": the kernel asks for it again).  The shards' pages are
read once first, so no disk read is timed.  Prints the median and least
process CPU time per OPEN+RELEASE pair of each kind.  --rw: a read-write
view (``-o rw``).  --profile: cProfile of one round's cold opens.  Run it
for each tree in turn, alternating, both orders.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("store", type=Path)
    ap.add_argument("tree")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--rw", action="store_true")
    ap.add_argument("--profile", action="store_true")
    args = ap.parse_args()
    store = args.store / "sharded"
    sys.path.insert(0, args.tree)
    import pyfuse3
    import trio

    from zshardfs import fuse_ops
    from zshardfs.backends.local import LocalBackend
    from zshardfs.config import MountConfig
    from zshardfs.daemon import build_view

    page_cache = bytearray(64 << 20)  # (notify_store copies the bytes into the kernel's pages: so does this)
    placed = [0]

    def notify_store(inode, offset, data):
        n = len(data)
        if placed[0] + n > len(page_cache):
            placed[0] = 0
        page_cache[placed[0]:placed[0] + n] = data
        placed[0] += n

    pyfuse3.notify_store = notify_store
    pyfuse3.invalidate_inode = lambda *a, **k: None
    files = []
    for dirpath, _, names in os.walk(store):
        for name in names:
            (Path(dirpath) / name).read_bytes()  # (pages cached)
    for dirpath, _, names in os.walk(args.store / "twin"):
        for name in names:
            rel = (Path(dirpath) / name).relative_to(args.store / "twin")
            if "c" in rel.parts[:-1]:
                files.append(rel.parts)
    files.sort()
    cold, warm, dropped = [], [], []

    async def one_round(profile: bool) -> None:
        cfg = MountConfig(source=str(store), mountpoint=str(store) + "-unmounted", read_only=not args.rw)
        view = build_view(cfg, LocalBackend(str(store)))
        ops = fuse_ops.Operations(view, read_only=not args.rw, open_fill=cfg.open_fill)
        inodes, dirs = [], {(): pyfuse3.ROOT_INODE}
        for parts in files:
            for k in range(1, len(parts) + 1):
                if parts[:k] not in dirs:
                    dirs[parts[:k]] = (await ops.lookup(dirs[parts[:k - 1]], os.fsencode(parts[k - 1]))).st_ino
            inodes.append(dirs[parts])
        prof = None
        if profile:
            import cProfile
            prof = cProfile.Profile()
            prof.enable()
        t0 = time.process_time()
        for ino in inodes:
            info = await ops.open(ino, os.O_RDONLY, None)
            await ops.release(info.fh)
        cold.append((time.process_time() - t0) / len(inodes))
        if prof is not None:
            prof.disable()
            import pstats
            pstats.Stats(prof).sort_stats(os.environ.get("SORT", "tottime")).print_stats(int(os.environ.get("TOP", "25")))
        t0 = time.process_time()
        for _ in range(2):
            for ino in inodes:
                info = await ops.open(ino, os.O_RDONLY, None)
                await ops.release(info.fh)
        warm.append((time.process_time() - t0) / (2 * len(inodes)))
        t0 = time.process_time()
        for ino in inodes:  # (an open whose pages the kernel dropped: one READ gives the file back)
            info = await ops.open(ino, os.O_RDONLY, None)
            await ops.read(info.fh, 0, 1 << 17)
            await ops.release(info.fh)
        dropped.append((time.process_time() - t0) / len(inodes))
        assert ops.open_fills == len(inodes), ops.open_fills

    async def run() -> None:
        for r in range(args.rounds):
            await one_round(args.profile and r == args.rounds - 1)

    trio.run(run)
    print(f"{args.tree}{' rw' if args.rw else ''}: {len(files)} files; per OPEN+RELEASE: cold (filling) "
          f"{statistics.median(cold) * 1e6:.2f} us (least {min(cold) * 1e6:.2f}), "
          f"warm {statistics.median(warm) * 1e6:.2f} us (least {min(warm) * 1e6:.2f}); "
          f"OPEN+READ+RELEASE after a page drop {statistics.median(dropped) * 1e6:.2f} us "
          f"(least {min(dropped) * 1e6:.2f})")


if __name__ == "__main__":
    main()
