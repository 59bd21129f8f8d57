"""Sharded Zarr v3 arrays written by hand (numpy + crc32c), for tests that
need exact control over which chunks exist or stores too big for a peer.

The format is the ``sharding_indexed`` codec with a ``bytes`` inner codec:
chunk bytes, then (``index_location: end``) an index of ``prod(extent)``
little-endian uint64 ``(offset, nbytes)`` pairs in C order followed by its
crc32c, also little-endian.  Empty index entries are ``(2**64-1, 2**64-1)``.
"""

from __future__ import annotations

import json
import math
import os
import zlib
from pathlib import Path

import crc32c
import numpy as np

EMPTY = 2**64 - 1


def array_doc(shape, shard_shape, inner_shape, *, dtype="uint8", separator="/", index_location="end",
              checksum=True, inner_codecs=None) -> dict:
    index_codecs = [{"name": "bytes", "configuration": {"endian": "little"}}]
    if checksum:
        index_codecs.append({"name": "crc32c"})
    return {
        "zarr_format": 3,
        "node_type": "array",
        "shape": list(shape),
        "data_type": dtype,
        "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": list(shard_shape)}},
        "chunk_key_encoding": {"name": "default", "configuration": {"separator": separator}},
        "fill_value": 0,
        "codecs": [{
            "name": "sharding_indexed",
            "configuration": {
                "chunk_shape": list(inner_shape),
                "codecs": inner_codecs or [{"name": "bytes"}],
                "index_codecs": index_codecs,
                "index_location": index_location,
            },
        }],
        "attributes": {},
    }


def write_array_doc(root: Path, doc: dict) -> None:
    root.mkdir(parents=True, exist_ok=True)
    (root / "zarr.json").write_text(json.dumps(doc, indent=2))


def shard_bytes(extent, chunks: dict[int, bytes], *, checksum: bool = True) -> bytes:
    """A complete shard (index at the end) holding ``chunks`` (C-order
    position in the shard -> stored bytes)."""
    n = math.prod(extent)
    table = np.full((n, 2), EMPTY, dtype="<u8")
    parts, pos = [], 0
    for cid in sorted(chunks):
        data = chunks[cid]
        table[cid] = (pos, len(data))
        parts.append(data)
        pos += len(data)
    index = table.tobytes()
    if checksum:
        index += crc32c.crc32c(index).to_bytes(4, "little")
    return b"".join(parts) + index


def shard_path(root: Path, shard_coords, separator: str = "/") -> Path:
    name = "c" + separator + separator.join(str(c) for c in shard_coords)
    return root.joinpath(*name.split("/"))


def write_shard(root: Path, shard_coords, extent, chunks: dict[int, bytes], *, separator: str = "/",
                checksum: bool = True) -> Path:
    path = shard_path(root, shard_coords, separator)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(shard_bytes(extent, chunks, checksum=checksum))
    return path


def linear(pos, extent) -> int:
    i = 0
    for p, e in zip(pos, extent):
        i = i * e + p
    return i


def chunk_name(coords, separator: str = "/") -> str:
    return "c" + separator + separator.join(str(c) for c in coords)


def gzip_member(data: bytes, name: bytes = b"") -> bytes:
    """A gzip member of ``data`` with an optional FNAME field."""
    comp = zlib.compressobj(1, zlib.DEFLATED, -15)
    body = comp.compress(data) + comp.flush()
    flags = 0x08 if name else 0
    header = bytes([0x1F, 0x8B, 8, flags, 0, 0, 0, 0, 0, 255]) + (name + b"\0" if name else b"")
    return header + body + zlib.crc32(data).to_bytes(4, "little") + (len(data) & 0xFFFFFFFF).to_bytes(4, "little")


__all__ = ["EMPTY", "SmallStore", "array_doc", "gzip_member", "chunk_name", "linear", "shard_bytes", "shard_path", "write_array_doc",
           "write_shard"]


# --------------------------------------------------------------------------
# a small store with known content, for CLI and FUSE behaviour tests


class SmallStore:
    """``README.txt`` (passthrough) and ``arr``: a 10x7 uint8 array, inner
    chunks 2x2, shards 4x4 (inner grid 5x4, shard grid 3x2), gzip inner
    codec, '/' separator.  Three of the six shards exist, each with some of
    its chunks missing; shard mtimes are fixed, distinct, in the past.

    ``chunks`` maps each stored chunk's view path to its bytes, ``missing``
    lists view paths of in-grid chunks that are not stored, ``shard_mtime``
    maps a chunk's view path to its shard's mtime.
    """

    SHAPE = (10, 7)
    SHARD = (4, 4)
    INNER = (2, 2)
    SHARDS = {(0, 0): 1_600_000_000.25, (1, 1): 1_600_000_100.5, (2, 0): 1_600_000_200.75}

    def __init__(self, root: Path):
        self.root = root
        root.mkdir(parents=True, exist_ok=True)
        (root / "README.txt").write_text("not an array\n")
        arr = root / "arr"
        write_array_doc(arr, array_doc(self.SHAPE, self.SHARD, self.INNER,
                                       inner_codecs=[{"name": "bytes"}, {"name": "gzip", "configuration": {"level": 1}}]))
        self.chunks: dict[str, bytes] = {}
        self.missing: list[str] = []
        self.shard_mtime: dict[str, float] = {}
        self.shard_files: dict[str, Path] = {}
        rng = np.random.default_rng(7)
        grid = [-(-s // c) for s, c in zip(self.SHAPE, self.INNER)]
        per = [s // c for s, c in zip(self.SHARD, self.INNER)]
        for shard, mtime in self.SHARDS.items():
            stored = {}
            for p0 in range(per[0]):
                for p1 in range(per[1]):
                    coords = (shard[0] * per[0] + p0, shard[1] * per[1] + p1)
                    if coords[0] >= grid[0] or coords[1] >= grid[1]:
                        continue
                    name = "arr/" + chunk_name(coords)
                    if (coords[0] + 2 * coords[1]) % 3 == 1:
                        self.missing.append(name)
                        continue
                    raw = rng.integers(0, 256, size=4, dtype=np.uint8).tobytes()
                    # a valid gzip member whose size varies with the chunk
                    # (a file name of varying length in the header)
                    data = gzip_member(raw, name=b"x" * (3 * coords[0] + coords[1]))
                    stored[linear((p0, p1), per)] = data
                    self.chunks[name] = data
                    self.shard_mtime[name] = mtime
                    self.shard_files[name] = shard_path(arr, shard)
            path = write_shard(arr, shard, per, stored)
            os.utime(path, (mtime, mtime))
        # shards that do not exist: their in-grid chunks are missing too
        for s0 in range(-(-grid[0] // per[0])):
            for s1 in range(-(-grid[1] // per[1])):
                if (s0, s1) in self.SHARDS:
                    continue
                for p0 in range(per[0]):
                    for p1 in range(per[1]):
                        coords = (s0 * per[0] + p0, s1 * per[1] + p1)
                        if coords[0] < grid[0] and coords[1] < grid[1]:
                            self.missing.append("arr/" + chunk_name(coords))
        self.grid = tuple(grid)
