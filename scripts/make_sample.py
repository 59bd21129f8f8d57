"""Write a small sharded sample store for newcomers to browse.

    python scripts/make_sample.py DIR

DIR gets a Zarr v3 hierarchy (a group with two sharded arrays, one of them
sparse, and consolidated metadata).  Mounted with zshardfs, every array
shows up unsharded: one plain file per inner chunk.
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import numpy as np
import zarr


def main(out: str) -> None:
    root = Path(out)
    if (root / "zarr.json").exists():
        print(f"{root} already holds a store; leaving it as it is")
        return
    group = zarr.open_group(root, mode="w", attributes={"description": "zshardfs sample store"})
    image = group.create_array("image", shape=(256, 256, 64), chunks=(32, 32, 32), shards=(128, 128, 64),
                               dtype="uint16", compressors=zarr.codecs.ZstdCodec(level=3))
    x, y, z = np.meshgrid(np.arange(256), np.arange(256), np.arange(64), indexing="ij")
    image[:] = ((x * 7 + y * 3 + z) % 4096).astype("uint16")
    labels = group.create_array("labels", shape=(1000, 1000), chunks=(50, 50), shards=(250, 500), dtype="uint32",
                                fill_value=0)
    labels[100:300, 600:700] = 7  # sparse: most chunks and shards are never written
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "consolidated metadata is not in the v3 spec": we know
        zarr.consolidate_metadata(root)
    print(f"wrote a sharded sample store to {root}")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "sample/store")
