"""CPU time of the first lookup in each shard (its index's load), between code trees.

    .venv/bin/python scripts/lookup_cpu.py STORE TREE [--views 7] [--revalidate]

STORE is made if missing: a Zarr v3 array of 1024 shards (32 x 32, each 2 x 2
chunks of 8 x 8 bytes), written by zarr-python.  With the zshardfs package
of TREE (a checkout), each of --views fresh read-only views (no FUSE) looks
up one chunk in every shard, through the chunk directories' nodes (held, as
the kernel holds their inodes), after reading every shard once so that
their pages are cached.  Prints the median and least process CPU time
(every thread's) and wall time per lookup.  Run it for each tree in turn,
alternating, both orders.

--revalidate: the lookups timed are those of a second round, made after
``index_ttl`` (with ``index_ttl=0.2``): each shard's cached index is
validated again (a stat of the shard), as in a warm pass a second later.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

GRID = 32  # shards per dimension


def build(store: Path) -> None:
    import numpy as np
    import zarr

    if (store / "a" / "zarr.json").exists():
        return
    data = np.arange(GRID * 16 * GRID * 16, dtype=np.uint32).astype(np.uint8).reshape(GRID * 16, GRID * 16)
    zarr.create_array(store / "a", shape=data.shape, dtype="uint8", chunks=(8, 8), shards=(16, 16),
                      compressors=None, fill_value=0)[:] = data


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("store", type=Path)
    ap.add_argument("tree")
    ap.add_argument("--views", type=int, default=7)
    ap.add_argument("--revalidate", action="store_true")
    args = ap.parse_args()
    build(args.store)
    sys.path.insert(0, args.tree)
    import trio

    from zshardfs.backends.local import LocalBackend
    from zshardfs.config import MountConfig
    from zshardfs.daemon import build_view

    source = str(args.store)
    shards = [(i, j) for i in range(GRID) for j in range(GRID)]
    cpu, wall = [], []

    async def run() -> None:
        for _ in range(args.views):
            for i, j in shards:  # (every shard's pages cached, as moments after a scan or a write)
                (args.store / "a" / "c" / str(i) / str(j)).read_bytes()
            ttl = {"index_ttl": 0.2, "metadata_ttl": 3600.0} if args.revalidate else {}
            view = build_view(MountConfig(source=source, mountpoint=source.rstrip("/") + "-unmounted",
                                          read_only=True, **ttl), LocalBackend(source))
            await view.resolve("a/c/0/0")  # (the array's documents, the first shard's index)
            rows = {i: await view.resolve(f"a/c/{2 * i}") for i in range(GRID)}
            if args.revalidate:
                for i, j in shards[1:]:
                    assert await view.lookup(rows[i], str(2 * j)) is not None
                await trio.sleep(0.3)  # (past index_ttl)
            t0, w0 = time.process_time(), time.perf_counter()
            for i, j in shards[1:]:
                assert await view.lookup(rows[i], str(2 * j)) is not None
            cpu.append((time.process_time() - t0) / (len(shards) - 1))
            wall.append((time.perf_counter() - w0) / (len(shards) - 1))

    trio.run(run)
    what = "lookup revalidating its shard's index" if args.revalidate else "first lookup in a shard"
    print(f"{args.tree}: per {what}: cpu {statistics.median(cpu) * 1e6:.1f} us (median; least "
          f"{min(cpu) * 1e6:.1f} us), wall {statistics.median(wall) * 1e6:.1f} us")


if __name__ == "__main__":
    main()
