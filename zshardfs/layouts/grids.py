"""Chunk grids: regular, ZEP 3 ``rectangular`` and ``rectilinear``.

A sharded array has two grids: the *shard* grid (the array's
``chunk_grid``, possibly variable) and the *inner* grid (the sharding codec's
``chunk_shape``, always regular).  The view shows the inner grid; this module
maps an inner-chunk coordinate to its shard and its position in the shard.

A variable shard grid is accepted when every shard edge is a multiple of the
inner chunk edge; then each shard holds a whole block of inner chunks and
the view can still be the regular inner grid (DESIGN.md §2).
"""

from __future__ import annotations

import bisect
import functools
import itertools
import math
from dataclasses import dataclass

import numpy as np


class GridError(ValueError):
    """A chunk grid the view cannot express (reason in the message)."""


#: Limits on what a metadata document may declare, so that a few hundred
#: bytes of JSON cannot make the daemon build huge tables: shards listed edge
#: by edge along one dimension (variable grids; regular ones are computed,
#: not listed), and inner chunks in one shard (its index alone would be 16
#: bytes each).  Arrays beyond them are shown as stored, with one warning.
MAX_VARIABLE_EDGES = 1_000_000
MAX_CHUNKS_PER_SHARD = 1 << 24
#: chunks along one dimension: chunk coordinates are int64 in listings, and
#: Python's ``len`` of a range stops at 2**63 (a shape of 2**64 - 1 is legal)
MAX_CHUNKS_PER_DIM = 1 << 62


def expand_edges(spec, extent: int, dim: int) -> list[int]:
    """Edge lengths of one dimension, covering ``extent``.

    ``spec`` is an int (regular step), or a list whose items are ints or
    ``[length, repeat]`` runs (rectilinear run-length form).
    """
    if isinstance(spec, bool):
        raise GridError(f"dimension {dim}: bad chunk edge {spec!r}")
    if isinstance(spec, int):
        if spec <= 0:
            raise GridError(f"dimension {dim}: chunk edge must be positive, got {spec}")
        count = max(1, math.ceil(extent / spec)) if extent else 1
        if count > MAX_VARIABLE_EDGES:
            raise GridError(f"dimension {dim}: {count} chunks along one dimension of a variable grid "
                            f"(at most {MAX_VARIABLE_EDGES} are supported)")
        return [spec] * count
    if not isinstance(spec, list):
        raise GridError(f"dimension {dim}: bad chunk edges {spec!r}")
    edges: list[int] = []
    for item in spec:
        if isinstance(item, list) and len(item) == 2 and all(isinstance(v, int) and not isinstance(v, bool) for v in item):
            length, repeat = item
            if length <= 0 or repeat < 0:
                raise GridError(f"dimension {dim}: bad run {item!r}")
            if len(edges) + repeat > MAX_VARIABLE_EDGES:
                raise GridError(f"dimension {dim}: more than {MAX_VARIABLE_EDGES} chunks along one dimension "
                                f"of a variable grid")
            edges.extend([length] * repeat)
        elif isinstance(item, int) and not isinstance(item, bool) and item > 0:
            edges.append(item)
        else:
            raise GridError(f"dimension {dim}: bad chunk edge {item!r}")
        if len(edges) > MAX_VARIABLE_EDGES:
            raise GridError(f"dimension {dim}: more than {MAX_VARIABLE_EDGES} chunks along one dimension "
                            f"of a variable grid")
    if sum(edges) < extent:
        raise GridError(f"dimension {dim}: edges sum to {sum(edges)}, less than the extent {extent}")
    return edges


def parse_chunk_grid(doc: dict, shape: list[int]) -> list[list[int]] | list[int]:
    """Return the per-dimension edge lists of a variable grid, or the chunk
    shape of a regular one (a list of ints)."""
    if not isinstance(doc, dict):
        raise GridError(f"chunk_grid must be an object, got {doc!r}")
    name = doc.get("name")
    conf = doc.get("configuration") or {}
    if name == "regular":
        cs = conf.get("chunk_shape")
        if not isinstance(cs, list) or len(cs) != len(shape) or not all(
            isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in cs
        ):
            raise GridError(f"regular chunk_shape {cs!r} does not fit shape {shape}")
        return list(cs)
    if name == "rectangular":
        cs = conf.get("chunk_shape")
    elif name == "rectilinear":
        kind = conf.get("kind", "inline")
        if kind != "inline":
            raise GridError(f"rectilinear chunk grid kind {kind!r} is not supported")
        cs = conf.get("chunk_shapes")
    else:
        raise GridError(f"chunk grid {name!r} is not supported")
    if not isinstance(cs, list) or len(cs) != len(shape):
        raise GridError(f"{name} chunk shapes {cs!r} do not fit shape {shape}")
    return [expand_edges(spec, extent, d) for d, (spec, extent) in enumerate(zip(cs, shape))]


def _check_chunks_per_shard(per_dim) -> None:
    if math.prod(per_dim) > MAX_CHUNKS_PER_SHARD:
        raise GridError(f"{math.prod(per_dim)} inner chunks per shard (at most {MAX_CHUNKS_PER_SHARD} are supported)")


@dataclass(frozen=True)
class ShardGrid:
    """Maps inner-chunk coordinates to (shard coordinates, position in shard).

    ``bounds[d]`` holds the cumulative inner-chunk boundaries of the shards
    along dimension d (``[0, b1, b2, ...]``), which covers regular and
    variable shard grids with the same code.
    """

    shape: tuple[int, ...]  # array shape
    inner: tuple[int, ...]  # inner chunk shape
    bounds: tuple[tuple[int, ...], ...]  # per dim, shard boundaries in inner chunks
    regular: tuple[int, ...] | None  # chunks per shard when the shard grid is regular

    @classmethod
    def build(cls, shape, shard_grid, inner_shape) -> "ShardGrid":
        shape = tuple(shape)
        inner = tuple(inner_shape)
        if len(inner) != len(shape):
            raise GridError(f"inner chunk_shape {list(inner)} does not fit shape {list(shape)}")
        if any(not isinstance(v, int) or isinstance(v, bool) or v <= 0 for v in inner):
            raise GridError(f"bad inner chunk_shape {list(inner)}")
        n_inner = tuple(-(-s // c) if isinstance(s, int) and s >= 0 else math.ceil(s / c)
                        for s, c in zip(shape, inner))
        for d, n in enumerate(n_inner):
            if n > MAX_CHUNKS_PER_DIM:
                raise GridError(f"{n} chunks along dimension {d} (at most 2**62 are supported)")
        if shard_grid and isinstance(shard_grid[0], int):  # regular
            cps = []
            for d, (s, c) in enumerate(zip(shard_grid, inner)):
                if s % c:
                    raise GridError(f"shard edge {s} is not a multiple of inner chunk edge {c} (dimension {d})")
                cps.append(s // c)
            _check_chunks_per_shard(cps)
            # ranges, not tuples: a regular grid of 10**9 shards costs nothing
            bounds = tuple(range(0, max(1, math.ceil(n / k)) * k + 1, k) for n, k in zip(n_inner, cps))
            return cls(shape, inner, bounds, tuple(cps))
        bounds_l = []
        for d, (edges, c) in enumerate(zip(shard_grid, inner)):
            acc = [0]
            for e in edges:
                if e % c:
                    raise GridError(f"shard edge {e} is not a multiple of inner chunk edge {c} (dimension {d})")
                acc.append(acc[-1] + e // c)
            bounds_l.append(tuple(acc))
        _check_chunks_per_shard([max(b - a for a, b in zip(acc, acc[1:])) if len(acc) > 1 else 1 for acc in bounds_l])
        return cls(shape, inner, tuple(bounds_l), None)

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @functools.cached_property
    def inner_counts(self) -> tuple[int, ...]:
        """Number of inner chunks along each dimension (the view's grid);
        computed once (asked on every lookup)."""
        return tuple(-(-s // c) for s, c in zip(self.shape, self.inner))

    def contains(self, coords) -> bool:
        if len(coords) != len(self.shape):
            return False
        for c, n in zip(coords, self.inner_counts):
            if not 0 <= c < n:
                return False
        return True

    def capacity(self, shard) -> int:
        """In-array inner chunks of one shard (what a complete shard holds)."""
        n = 1
        for s, b, count in zip(shard, self.bounds, self.inner_counts):
            n *= max(0, min(b[s + 1], count) - b[s])
        return n

    def locate(self, coords) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """(shard coordinates, position inside the shard) of an inner chunk."""
        if self.regular is not None:
            return (
                tuple(c // k for c, k in zip(coords, self.regular)),
                tuple(c % k for c, k in zip(coords, self.regular)),
            )
        shard, pos = [], []
        for c, b in zip(coords, self.bounds):
            s = bisect.bisect_right(b, c) - 1
            shard.append(s)
            pos.append(c - b[s])
        return tuple(shard), tuple(pos)

    def shard_extent(self, shard) -> tuple[int, ...]:
        """Inner chunks per dimension in this shard (the shape of its index)."""
        if self.regular is not None:
            return self.regular
        return tuple(b[s + 1] - b[s] for s, b in zip(shard, self.bounds))

    def shard_origin(self, shard) -> tuple[int, ...]:
        return tuple(b[s] for s, b in zip(shard, self.bounds))

    def shard_count(self, dim: int) -> int:
        return len(self.bounds[dim]) - 1

    def shard_contains(self, shard) -> bool:
        return len(shard) == self.ndim and all(0 <= s < self.shard_count(d) for d, s in enumerate(shard))

    def shard_range(self, dim: int, shard_coord: int) -> range:
        """Inner-chunk coordinates of one shard along ``dim``, clipped to the array."""
        b = self.bounds[dim]
        return range(b[shard_coord], min(b[shard_coord + 1], self.inner_counts[dim]))

    def chunks_in_shard_list(self, shard, fixed, limit: int) -> list[tuple[tuple[int, ...], int]] | None:
        """What :meth:`chunks_in_shard` gives, as a list of (coords, linear)
        in C order, when there are at most ``limit`` of them; else None."""
        ext = self.shard_extent(shard)
        ranges, n = [], 1
        for d, (s, b, count) in enumerate(zip(shard, self.bounds, self.inner_counts)):
            r = range(b[s], min(b[s + 1], count))
            if d < len(fixed):
                r = range(fixed[d], fixed[d] + 1) if fixed[d] in r else range(0)
            ranges.append(r)
            n *= len(r)
            if n > limit:
                return None
        if not ranges:
            return [((), 0)]
        origin = [r_b[s] for s, r_b in zip(shard, self.bounds)]
        out = []
        for coords in itertools.product(*ranges):
            i = 0
            for c, o, e in zip(coords, origin, ext):
                i = i * e + (c - o)
            out.append((coords, i))
        return out

    def chunks_in_shard(self, shard, fixed=()) -> tuple[np.ndarray, np.ndarray]:
        """In-array inner chunks of a shard whose leading coordinates are
        ``fixed``: (coords as an (n, ndim) array in C order, their linear
        positions in the shard's index).  Vectorised: listings of big
        shards must not loop in Python per chunk."""
        ext = self.shard_extent(shard)
        origin = self.shard_origin(shard)
        ranges = []
        for d, s in enumerate(shard):
            r = self.shard_range(d, s)
            if d < len(fixed):
                r = range(fixed[d], fixed[d] + 1) if fixed[d] in r else range(0)
            ranges.append(np.arange(r.start, r.stop, dtype=np.int64))
        if not ranges:
            return np.zeros((1, 0), dtype=np.int64), np.zeros(1, dtype=np.int64)
        mesh = np.meshgrid(*ranges, indexing="ij")
        coords = np.stack([m.ravel() for m in mesh], axis=1)
        linear = np.zeros(len(coords), dtype=np.int64)
        for d in range(len(ext)):
            linear = linear * ext[d] + (coords[:, d] - origin[d])
        return coords, linear


def linear_index(pos, extent) -> int:
    """C-order position of ``pos`` in a block of shape ``extent``."""
    i = 0
    for p, e in zip(pos, extent):
        i = i * e + p
    return i


def unravel_index(i: int, extent) -> tuple[int, ...]:
    out = []
    for e in reversed(extent):
        out.append(i % e)
        i //= e
    return tuple(reversed(out))
