"""The cost of listing directories that hold chunks written but not stored.

Writes one chunk into each of ``--rows`` chunk directories of a local array
through the view (no mount, no FUSE: ``daemon.build_view``), then walks the
whole view twice while those chunks are unstored and once after a sync, and
prints the time of each walk.  Each listing used to scan every directory
holding unstored chunks (``View._pending_children``): the walk was quadratic
in the rows.  Prints times only; the test that guards it counts entries
(``tests/test_writeback_accounting.py``).

    .venv/bin/python scripts/walk_pending.py --rows 10000
"""

from __future__ import annotations

import argparse
import pathlib
import sys
import tempfile
import time

import trio

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

from tests.handmade_zarr import array_doc, write_array_doc  # noqa: E402
from zshardfs.backends.local import LocalBackend  # noqa: E402
from zshardfs.config import MountConfig  # noqa: E402
from zshardfs.daemon import build_view  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=10000, help="chunk directories holding an unstored chunk")
    rows = parser.parse_args().rows
    with tempfile.TemporaryDirectory() as tmp:
        root = pathlib.Path(tmp)
        write_array_doc(root / "arr", array_doc((2 * rows, 2), (2, 2), (2, 2)))  # a shard per chunk, a row each
        view = build_view(MountConfig(source=str(root), mountpoint=str(root) + "-mnt", read_only=False,
                                      flush_delay=float("inf"), max_dirty=1 << 30), LocalBackend(str(root)))

        async def walk(node) -> int:
            n = 0
            async for child in view.listdir(node):
                n += 1
                if child.is_dir:
                    n += await walk(child)
            return n

        async def run() -> None:
            for i in range(rows):
                h = await view.create(await view.resolve(f"arr/c/{i}"), "0")
                await view.write(h, 0, b"abcd")
                await view.release(h)
            for label in ("unstored", "unstored", "stored"):
                if label == "stored":
                    assert not await view.sync()
                started = time.perf_counter()
                n = await walk(await view.resolve(""))
                print(f"{label:>9}: a walk of {n} entries ({rows} rows): {time.perf_counter() - started:.2f} s")

        trio.run(run)


if __name__ == "__main__":
    main()
