#!/usr/bin/env python3
"""What one chunk write costs as dirty chunks pile up (write-back bookkeeping).

Drives the view in process (``daemon.build_view``: the stack a mount uses,
without FUSE, so only zshardfs's own cost is measured) over a local store:
an array of 256x256 inner chunks in 256 shards of 16x16, every chunk file
created, written (4 bytes) and closed in C order with ``flush_delay=inf``, so
nothing is flushed and every chunk stays dirty.  Prints the median cost of a
write() around 1k, 8k, 32k and 60k dirty chunks and the ratio of the last to
the first (the baseline, measured in the same run): 1 means a write costs the
same however much is dirty.

    .venv/bin/python scripts/bench_dirty.py [--chunks 60000]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import trio

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.handmade_zarr import array_doc, write_array_doc  # noqa: E402
from zshardfs.backends.local import LocalBackend  # noqa: E402
from zshardfs.config import MountConfig  # noqa: E402
from zshardfs.daemon import build_view  # noqa: E402

MARKS = (1000, 8000, 32000, 60000)
WINDOW = 200  # writes around each mark whose times are taken


async def run(root: Path, chunks: int) -> dict[int, float]:
    write_array_doc(root / "arr", array_doc((512, 512), (32, 32), (2, 2)))
    cfg = MountConfig(source=str(root), mountpoint=str(root) + "-mnt", read_only=False, flush_delay=float("inf"))
    view = build_view(cfg, LocalBackend(str(root)))
    c = await view.lookup(await view.resolve("arr"), "c")
    marks = [m for m in MARKS if m <= chunks]
    times: dict[int, list[float]] = {m: [] for m in marks}
    n = 0
    for i in range(256):
        row = await view.lookup(c, str(i))
        for j in range(256):
            handle = await view.create(row, str(j))
            t = time.perf_counter()
            await view.write(handle, 0, b"abcd")
            dt = time.perf_counter() - t
            await view.release(handle)
            n += 1
            for m in marks:
                if m - WINDOW < n <= m:
                    times[m].append(dt)
            if n >= chunks:
                return {m: statistics.median(ts) for m, ts in times.items()}
    return {m: statistics.median(ts) for m, ts in times.items() if ts}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--chunks", type=int, default=60000, help="chunks written (at most 65536)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        t0, c0 = time.perf_counter(), time.process_time()
        medians = trio.run(run, Path(tmp), min(args.chunks, 65536))
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    first = next(iter(medians.values()))
    for m, t in medians.items():
        print(f"{m:>6} dirty chunks: median write() {t * 1e6:8.1f} us   ratio to {next(iter(medians))}: {t / first:5.2f}")
    print(f"all {args.chunks} chunks: {wall:.1f} s wall, {cpu:.1f} s CPU")
    return 0


if __name__ == "__main__":
    sys.exit(main())
