"""CPU time of the view's listings alone (no FUSE), between code trees.

    .venv/bin/python scripts/list_cpu.py SOURCE TREE [--ttl 0.2] [--walks 15]

Builds a read-only view of the local store SOURCE with the zshardfs package
of TREE (a checkout), walks every directory once (cold), then --walks times,
each after the TTLs (``metadata_ttl`` and ``index_ttl``, set to --ttl) have
expired, as a warm ``find`` taken a second after the last one does: every
listing and index is validated again.  Prints the median and least process
CPU time of a walk.  Run it for each tree in turn, alternating, on a quiet
moment: one process, one core, no kernel in the way.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("source")
    ap.add_argument("tree")
    ap.add_argument("--ttl", type=float, default=0.2)
    ap.add_argument("--walks", type=int, default=15)
    args = ap.parse_args()
    sys.path.insert(0, args.tree)
    import trio

    from zshardfs.backends.local import LocalBackend
    from zshardfs.config import MountConfig
    from zshardfs.daemon import build_view

    view = build_view(MountConfig(source=args.source, mountpoint=args.source.rstrip("/") + "-unmounted",
                                  metadata_ttl=args.ttl, index_ttl=args.ttl, read_only=True),
                      LocalBackend(args.source))
    batched = hasattr(view, "listdir_batches")  # (code from before it lists entry by entry)

    async def walk(node) -> int:
        n = 0
        children = ([c async for b in view.listdir_batches(node) for c in b] if batched
                    else [c async for c in view.listdir(node)])
        for child in children:
            n += 1 + (await walk(child) if child.is_dir else 0)
        return n

    async def run() -> None:
        entries = await walk(view.root())
        times = []
        for _ in range(args.walks):
            await trio.sleep(args.ttl * 1.05)
            t0 = time.process_time()
            await walk(view.root())
            times.append(time.process_time() - t0)
        print(f"{args.tree}: {entries} entries, a walk after the TTLs {statistics.median(times) * 1e3:.1f} ms "
              f"(median; least {min(times) * 1e3:.1f} ms)")

    trio.run(run)


if __name__ == "__main__":
    main()
