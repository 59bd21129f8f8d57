"""The first open for writing after a flush: what judging the shard's new index costs.

    .venv/bin/python scripts/bench_reopen.py [--side 64] [--opens 25]

One local sharded array whose single shard holds ``--side``^2 chunks of
8 bytes (zarr-python writes it, every chunk stored).  Through a mount
(``flush_delay=60``), ``--opens`` times: look a chunk file up (``stat``; not
timed: it loads the shard's index, as every writer's lookup does), open it
``O_WRONLY|O_TRUNC`` (timed), write, ``fsync`` (a flush: the next open meets
a new index version), close.  Each open asks ``WriteBack.refuse_if_damaged``,
which judges each index version once (SEMANTICS, Limits).  Prints the median
and the fastest open, and, as baselines measured in the same run, the same
opens of a plain file through the same mount (no index to judge) and of a
native file.  To compare code trees, run it with ``PYTHONPATH``
pointing at the other tree (the mount runs ``python -m zshardfs.cli`` there).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--side", type=int, default=64, help="the shard holds side x side chunks")
    ap.add_argument("--opens", type=int, default=25)
    args = ap.parse_args()
    import zarr

    side = args.side
    work = Path(tempfile.mkdtemp(prefix="zshardfs-bench-reopen-"))
    src, mnt = work / "src", work / "mnt"
    mnt.mkdir()
    a = zarr.create_array(str(src / "a"), shape=(side * 2, side * 2, 2), chunks=(2, 2, 2),
                          shards=(side * 2, side * 2, 2), dtype="uint8", compressors=None, fill_value=0)
    a[...] = 1
    cli = [sys.executable, "-m", "zshardfs.cli"]
    subprocess.run([*cli, "mount", str(src), str(mnt), "-o", f"flush_delay=60,log_file={work / 'log'}"], check=True)
    (src / "plain.bin").write_bytes(bytes(8))
    (work / "native.bin").write_bytes(bytes(8))

    def opens(path_of) -> list[float]:
        """Seconds of each ``open(O_WRONLY|O_TRUNC)`` of ``path_of(i)``, each
        followed by a write and an fsync (a flush, for a chunk)."""
        times = []
        for i in range(args.opens):
            path = path_of(i)
            os.stat(path)
            t0 = time.perf_counter()
            fd = os.open(path, os.O_WRONLY | os.O_TRUNC)
            times.append(time.perf_counter() - t0)
            try:
                os.write(fd, bytes([i % 250 + 2]) * 8)
                os.fsync(fd)
            finally:
                os.close(fd)
        return times

    try:
        chunk = opens(lambda i: mnt / "a" / "c" / str(i % side) / str((i * 7) % side) / "0")
        plain = opens(lambda i: mnt / "plain.bin")  # the same mount, no shard index to judge
        native = opens(lambda i: work / "native.bin")
    finally:
        subprocess.run([*cli, "umount", str(mnt)], check=True)
        shutil.rmtree(work, ignore_errors=True)
    med = {name: statistics.median(t) for name, t in (("chunk", chunk), ("plain", plain), ("native", native))}
    print(f"{side * side} chunks a shard: an open for writing after a flush: median "
          f"{med['chunk'] * 1e3:.2f} ms, fastest {min(chunk) * 1e3:.2f} ms ({len(chunk)} opens)")
    print(f"baselines, the same opens: a plain file through the same mount {med['plain'] * 1e3:.2f} ms "
          f"(the chunk's {med['chunk'] / med['plain']:.1f}x), native {med['native'] * 1e3:.3f} ms "
          f"(the chunk's {med['chunk'] / med['native']:.2f}x)")


if __name__ == "__main__":
    main()
