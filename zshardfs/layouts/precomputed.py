"""Neuroglancer precomputed ``neuroglancer_uint64_sharded_v1`` stores, shown unsharded.

What is a dataset (DESIGN.md §2): a directory whose shards some ``info``
describes, and the view's file names there:

- a volume scale ``<vol>/<key>`` (``sharding`` inside ``scales[i]`` of
  ``<vol>/info``): ``<x0>-<x1>_<y0>-<y1>_<z0>-<z1>``, chunk id = compressed
  Morton code of the grid position;
- a uint64 key-value directory (top-level ``sharding``: skeletons, legacy
  meshes, ...): ``<id>`` in decimal;
- a multi-resolution mesh directory (``neuroglancer_multilod_draco``):
  ``<id>.index`` is the stored chunk (the manifest) and ``<id>`` the fragment
  data, which sits just before the manifest in the shard and is as long as
  the manifest's fragment sizes add up to (stored raw whatever
  ``data_encoding`` says, as Neuroglancer and cloud-volume read it);
- an annotation index ``<ann>/<key>`` (``by_id``, ``relationships[i]``,
  ``spatial[i]`` with their own ``sharding``): ``<id>`` for the first two,
  ``<x>_<y>_<z>`` (one number per dimension) for spatial cells, whose chunk id
  is the compressed Morton code of the cell in that level's ``grid_shape``.

A ``<id>`` mesh file's size needs its manifest, so listing a mesh directory
reads every manifest (one ranged read each, kept in the chunk cache).

The ``info`` is shown without those ``sharding`` objects; a part whose
sharding the view cannot express (bad parameters, a ``key`` that names no
directory inside the volume's (see ``key_problem``; a relative path of
several names, ``s/8_8_8``, does) or that is another part's directory or one
above or below it, a grid needing more than 64 Morton bits, more than
``MAX_MINISHARD_BITS``) keeps its ``sharding``, its directory passes through,
and the log says why once.

Reads: the fixed shard index (cached with the shard, like Zarr indexes), then
only the minishard index the chunk hashes to (cached in the same byte budget,
keyed by the shard's etag), then the chunk, ranged.  ``stat`` of a chunk with
raw ``data_encoding`` costs those two index reads and nothing else.

gzip ``data_encoding`` and exact sizes: the decoded size is the gzip ISIZE
trailer (last 4 bytes of the stored chunk).  Fetching it chunk by chunk would
cost one request per file; decompressing would read all data just to list.
So trailers are fetched in coalesced ranged reads (neighbours closer than
``TRAILER_GAP``, at most ``TRAILER_SPAN`` per read): a listing fetches those
of a whole shard at once, which with the usual layout (chunks back to back)
is about one read per MiB of chunk data, and a ``stat`` fetches the one read
holding its trailer, which also sizes its neighbours.  ISIZE is trusted only
as far as a read confirms it: a chunk that decodes to another length
(damage, or a multi-member gzip stream, whose ISIZE is its last member's)
is EIO.

Writes go through the shared write-back: a chunk file's target is its shard
and chunk id; ``encode`` builds the whole shard (minishard indexes sorted by
id, delta-encoded, the dataset's own encodings) from the stored payloads it
keeps and the new ones.  A shard holding chunks that hash elsewhere, or with a
damaged index, is not rewritten (the flush fails with EIO and keeps the new
data).

Multi-resolution mesh writes: the stored unit of mesh ``id`` is the pair
(fragment data, chunk id ``id | FRAGMENTS``, stored raw; manifest, chunk id
``id``, stored with ``data_encoding``, as the read side decodes them).  A
rewrite's ``entries`` reads every kept manifest (coalesced, pinned to the
shard version) to add each mesh's fragment range ``[manifest_offset -
fragment_size, manifest_offset)``, so writing one of the two files keeps the
other; ``encode`` lays out fragment data then manifest for every mesh and
points the minishard index at the manifest.  It refuses (CorruptData: the
flush fails with EIO, logged, the writes kept) a manifest whose fragment sizes
do not add up to its fragment data's length (no fragment data counts as
empty) and non-empty fragment data without a manifest.  Unlinking
``<id>.index`` removes both (``deleted_with``); unlinking ``<id>`` alone
empties the fragment data.
"""

from __future__ import annotations

import functools
import json
import logging
import re
from dataclasses import dataclass, field

import numpy as np

from ..backends.base import (AccessDenied, AsyncStore, CorruptData, NotFound, ObjectInfo, PreconditionFailed, join_key,
                             TooLarge, Unstorable, shared_within_deadline)
from ..logonce import report_damage
from ..shards import MAX_CHUNK_BYTES, ByteLRU
from ..singleflight import SingleFlight
from ..together import first_error, off_loop, outcomes
from .base import (ChunkEntry, ChunkTarget, Dataset, LayoutContext, dump_json, load_json, load_json_async,
                   parse_index_name, warn_once)
from .precomputed_format import (
    U64_MAX,
    FormatError,
    ScaleGeometry,
    ShardingSpec,
    compressed_morton_code,
    decode_data,
    decoded_size,
    encode_data,
    encode_shard,
    gzip_isize,
    morton_bits,
    morton_decode_many,
    multilod_fragment_data_range,
    multilod_fragment_data_size,
    parse_minishard_index,
    parse_shard_index,
)

log = logging.getLogger(__name__)

NAME = "precomputed"
MULTILOD = "neuroglancer_multilod_draco"
ANNOTATIONS = "neuroglancer_annotations_v1"

FRAGMENTS = 1 << 64  # chunk-id flag: the multilod fragment data of id ``chunk_id - FRAGMENTS``
MAX_MINISHARD_BITS = 20  # the fixed shard index (16 << bits bytes) is read whole: at most 16 MiB
MAX_MINISHARD_INDEX = 64 << 20  # decoded minishard index bound (gzip bomb guard)
#: stored minishard index bound (gzip may add 5 bytes per 64 KiB to what it cannot
#: compress): a longer range is damage, not read (in a shard another client made a
#: sparse 1 TiB file, it need not point past the end)
MAX_STORED_MINISHARD_INDEX = MAX_MINISHARD_INDEX + (MAX_MINISHARD_INDEX >> 10)
MAX_CHUNK = 1 << 30  # decoded chunk bound
TRAILER_GAP, TRAILER_SPAN = 64 << 10, 1 << 20  # coalescing of gzip trailer reads
INDEX_GAP, INDEX_SPAN = 1 << 20, 16 << 20  # coalescing of minishard index reads (gap: -o prefetch_gap)


def _coalesce(starts: list[int], ends: list[int], todo, gap: int, span: int) -> list[list[int]]:
    """Group byte ranges ``todo`` (indexes into starts/ends) into few reads."""
    groups: list[list[int]] = []
    lo = hi = 0
    for k in sorted(todo, key=starts.__getitem__):
        if groups and starts[k] - hi <= gap and max(hi, ends[k]) - lo <= span:
            groups[-1].append(k)
            hi = max(hi, ends[k])
        else:
            groups.append([k])
            lo, hi = starts[k], ends[k]
    return groups


def _bare(exc: Exception) -> Exception:
    """``exc`` to keep: without its traceback and the exception it was raised
    in, whose frames hold what was read and parsed (a 40 MiB minishard index
    each, kept for as long as the error is)."""
    exc.__traceback__ = exc.__context__ = exc.__cause__ = None
    return exc


def _batches(groups: list[list[int]], starts: list[int], ends: list[int], budget: int) -> list[list[list[int]]]:
    """``groups`` (of ``_coalesce``) in batches read at the same time, each
    spanning at most ``budget`` bytes in all (or one group): the reads of a
    batch are held at once until parsed.  (Minishard index ranges may
    overlap: in a shard another client made a sparse 1 TiB file, a small
    shard index can declare thousands of ranges of up to 64 MiB each; all
    at once, 64 of 60 MiB took a listing to 18 GiB.)"""
    out: list[list[list[int]]] = []
    held = 0
    for group in groups:
        span = max(ends[k] for k in group) - min(starts[k] for k in group)
        if not out or held + span > budget:
            out.append([])
            held = 0
        out[-1].append(group)
        held += span
    return out


# --------------------------------------------------------------------------
# the shard format: a fixed shard index, lazily loaded minishard indexes


@dataclass(eq=False)
class Minishard:
    """One parsed minishard index, sorted by id (only ids that hash here)."""

    ids: np.ndarray
    starts: np.ndarray  # absolute offsets in the shard
    sizes: np.ndarray  # stored sizes
    shown: np.ndarray | None = None  # gzip: decoded sizes; -1 not fetched yet, -2 damaged
    misplaced: int = 0  # stored ids that hash to another shard or minishard

    @property
    def nbytes(self) -> int:
        return 256 + 32 * len(self.ids)

    def view_sizes(self) -> np.ndarray:
        """Sizes the view shows (gzip: as far as fetched; -1 unknown, -2 damaged)."""
        return self.shown if self.shown is not None else self.sizes.astype(np.int64)

    def find(self, chunk_id: int) -> int | None:
        i = int(np.searchsorted(self.ids, np.uint64(chunk_id)))
        return i if i < len(self.ids) and int(self.ids[i]) == chunk_id else None


def _decoded_bytes(raw: bytes, encoding: str) -> int:
    """What a minishard index decodes to, as its gzip trailer says (a gzip
    index of consecutive ids is a thousandth of its decoded size): the work
    parsing it takes.  (A damaged trailer may say less; decoding stops at
    MAX_MINISHARD_INDEX.)"""
    return max(len(raw), gzip_isize(raw[-4:])) if encoding == "gzip" and len(raw) >= 4 else len(raw)


class PrecomputedShardIndex:
    """One version of one shard: its fixed index, and access to its minishards."""

    sync_locate = False  # (ShardIndex: a minishard may have to be read)

    def __init__(self, fmt: "PrecomputedShardFormat", store: AsyncStore, info: ObjectInfo, table: np.ndarray,
                 shard: int | None):
        self.fmt, self.store, self.info, self.table, self.shard = fmt, store, info, table, shard

    @property
    def nbytes(self) -> int:
        return self.table.nbytes

    def nonempty(self) -> list[int]:
        return np.flatnonzero(self.table[:, 0] != self.table[:, 1]).tolist()

    def _parse(self, m: int, raw: bytes) -> Minishard:
        spec, key = self.fmt.spec, self.info.key
        try:
            ids, starts, sizes = parse_minishard_index(raw, spec, self.info.size, max_size=MAX_MINISHARD_INDEX)
        except FormatError as exc:
            raise CorruptData(f"{key}: minishard {m}: {exc}", key) from None
        shards, minishards = spec.shard_and_minishard_many(ids)
        here = minishards == np.uint64(m)
        here &= (shards == np.uint64(self.shard)) if self.shard is not None else False
        ms = Minishard(ids[here], starts[here], sizes[here], misplaced=int((~here).sum()))
        if spec.data_encoding == "gzip":
            ms.shown = np.where(ms.sizes < 20, -2, -1).astype(np.int64)  # < 20 bytes: no gzip stream
        return ms

    def _range(self, m: int) -> tuple[int, int]:
        start, end = (int(v) for v in self.table[m])
        if end > self.info.size:
            raise CorruptData(f"{self.info.key}: minishard {m} index [{start}, {end}) lies past the end of the "
                              f"shard ({self.info.size} bytes)", self.info.key)
        if end - start > MAX_STORED_MINISHARD_INDEX:
            raise CorruptData(f"{self.info.key}: minishard {m} index of {end - start} bytes is larger than the "
                              f"{MAX_STORED_MINISHARD_INDEX >> 20} MiB an index may have", self.info.key)
        return start, end

    async def minishard(self, m: int) -> Minishard:
        """Minishard ``m``, from the cache or one pinned ranged read."""
        start, end = self._range(m)
        if start == end:
            return Minishard(*(np.zeros(0, np.uint64),) * 3)

        async def load():
            return (await self._load([m]))[0]

        return await self.fmt.cached((self.info.key, self.info.etag, m, self.fmt.spec), load)

    async def _load(self, ms: list[int]) -> list[Minishard]:
        """Read minishards ``ms`` in one ranged read; cache and return them."""
        ranges = [self._range(m) for m in ms]
        lo, hi = min(r[0] for r in ranges), max(r[1] for r in ranges)
        blob = await self.store.get(self.info.key, lo, hi - lo, if_match=self.info.etag)
        if len(blob.data) != hi - lo:
            raise CorruptData(f"{self.info.key}: shard truncated at {lo + len(blob.data)}", self.info.key)
        raws = [blob.data[s - lo: e - lo] for s, e in ranges]
        parsed = await off_loop(lambda: [self._parse(m, raw) for m, raw in zip(ms, raws)],
                                sum(_decoded_bytes(raw, self.fmt.spec.minishard_index_encoding) for raw in raws))
        for m, p in zip(ms, parsed):
            self.fmt.cache.put((self.info.key, self.info.etag, m, self.fmt.spec), p, p.nbytes)
        return parsed

    async def minishards(self) -> dict[int, Minishard | CorruptData]:
        """Every non-empty minishard (or why it is unreadable); the uncached
        ones in coalesced reads, so a whole-shard walk is a few requests."""
        out: dict[int, Minishard | CorruptData] = {}
        todo = []
        for m in self.nonempty():
            hit = self.fmt.cache.get((self.info.key, self.info.etag, m, self.fmt.spec))
            if hit is not None:
                out[m] = hit
                continue
            try:
                self._range(m)
                todo.append(m)
            except CorruptData as exc:
                out[m] = exc
        starts, ends = self.table[:, 0].tolist(), self.table[:, 1].tolist()

        async def load(group: list[int]) -> None:
            try:
                out.update(zip(group, await self._load(group)))
                return
            except CorruptData as exc:
                if len(group) == 1:
                    out[group[0]] = _bare(exc)
                    return
            for m in group:  # which one is damaged: one by one (once the failed read is let go)
                try:
                    out[m] = (await self._load([m]))[0]
                except CorruptData as exc:
                    out[m] = _bare(exc)

        groups = _coalesce(starts, ends, todo, self.fmt.gap, INDEX_SPAN)
        for batch in _batches(groups, starts, ends, INDEX_SPAN):
            if len(batch) == 1:
                await load(batch[0])
            else:  # the reads overlap instead of queueing (S3: one round trip, not one each)
                error = first_error(await outcomes(*(functools.partial(load, group) for group in batch)))
                if error is not None:
                    raise error
        return dict(sorted(out.items()))

    async def locate(self, chunk_id: int) -> tuple[int, int] | None:
        if chunk_id > U64_MAX:
            return None
        ms = await self.minishard(self.fmt.spec.shard_and_minishard(chunk_id)[1])
        i = ms.find(chunk_id)
        return None if i is None else (int(ms.starts[i]), int(ms.sizes[i]))

    async def entries(self) -> list[tuple[int, int, int]]:
        """Every stored chunk; refuses (CorruptData) when a rewrite would lose some."""
        out = []
        for m, ms in (await self.minishards()).items():
            if isinstance(ms, CorruptData):
                raise ms
            if ms.misplaced:
                raise CorruptData(f"{self.info.key}: minishard {m} holds {ms.misplaced} chunk(s) that hash "
                                  "elsewhere; not rewriting it", self.info.key)
            out += zip(ms.ids.tolist(), ms.starts.tolist(), ms.sizes.tolist())
        if self.fmt.multilod:
            out += await self._fragment_entries(out)
        return out

    async def _fragment_entries(self, manifests: list[tuple[int, int, int]]) -> list[tuple[int, int, int]]:
        """Multilod: ``(id | FRAGMENTS, start, size)`` of every mesh's fragment
        data (just before its manifest, as long as the manifest's fragment
        sizes add up to), so a rewrite keeps it; the manifests are read in
        coalesced ranged reads pinned to this version of the shard."""
        key, spec = self.info.key, self.fmt.spec
        starts = [off for _, off, _ in manifests]
        ends = [off + n for _, off, n in manifests]
        for cid, _, n in manifests:  # (read whole: damage, as for a read of it)
            if n > MAX_CHUNK_BYTES:
                raise CorruptData(f"{key}: mesh {cid}: manifest of {n} bytes is larger than the "
                                  f"{MAX_CHUNK_BYTES >> 20} MiB a chunk may have; not rewriting the shard", key)
        out = []
        for group in _coalesce(starts, ends, range(len(manifests)), self.fmt.gap, INDEX_SPAN):
            lo, hi = min(starts[k] for k in group), max(ends[k] for k in group)
            blob = await self.store.get(key, lo, hi - lo, if_match=self.info.etag)
            if len(blob.data) != hi - lo:
                raise CorruptData(f"{key}: shard truncated at {lo + len(blob.data)}", key)
            for k in group:
                cid = manifests[k][0]
                try:
                    manifest = decode_data(blob.data[starts[k] - lo: ends[k] - lo], spec, max_size=MAX_CHUNK)
                    start, end = multilod_fragment_data_range(starts[k], manifest, spec)
                except FormatError as exc:
                    raise CorruptData(f"{key}: mesh {cid}: {exc}; not rewriting the shard", key) from None
                out.append((cid | FRAGMENTS, start, end - start))
        return out

    async def fetch_sizes(self, mss: list[Minishard], only: tuple[Minishard, int] | None = None) -> None:
        """Fill in the gzip ISIZE trailers still unknown in ``mss``, in reads
        coalesced across minishards (only the read holding chunk ``only``)."""
        todo = [(ms, k) for ms in mss if ms.shown is not None for k in np.flatnonzero(ms.shown == -1).tolist()]
        ends = [int(ms.starts[k] + ms.sizes[k]) for ms, k in todo]
        starts = [e - 4 for e in ends]
        said_empty = []
        for group in _coalesce(starts, ends, range(len(todo)), TRAILER_GAP, TRAILER_SPAN):
            if only is not None and not any(todo[j][0] is only[0] and todo[j][1] == only[1] for j in group):
                continue
            lo, hi = min(starts[j] for j in group), max(ends[j] for j in group)
            blob = await self.store.get(self.info.key, lo, hi - lo, if_match=self.info.etag)
            for j in group:
                ms, k = todo[j]
                tail = blob.data[starts[j] - lo: ends[j] - lo]
                try:
                    ms.shown[k] = decoded_size(int(ms.sizes[k]), tail, "gzip") if len(tail) == 4 else -2
                except FormatError:
                    ms.shown[k] = -2
                if ms.shown[k] == 0 and ms.sizes[k] > EMPTY_GZIP_BYTES:
                    said_empty.append((ms, k))
        for ms, k in said_empty:
            # A file of size 0 is never read (the kernel knows there is
            # nothing), so a damaged trailer saying 0 would show a silently
            # empty file: such a member is decoded once, here, to be sure.
            start, n = int(ms.starts[k]), int(ms.sizes[k])
            if n > MAX_CHUNK_BYTES:  # (read whole: damage, as for a read of it; in a sparse huge shard
                ms.shown[k] = -2     # another client made, its zeros say 0 and would be read at once)
                continue
            blob = await self.store.get(self.info.key, start, n, if_match=self.info.etag)
            try:
                ms.shown[k] = -2 if len(blob.data) != n or decode_data(blob.data, "gzip", 0) else 0
            except (FormatError, ValueError, OSError, EOFError):
                ms.shown[k] = -2


#: a gzip member of an empty chunk as encoders write it (10-byte header,
#: empty deflate block of 2 or 5 bytes, 8-byte trailer); one longer whose
#: trailer says 0 is decoded before it is shown empty (fetch_sizes)
EMPTY_GZIP_BYTES = 23


class PrecomputedShardFormat:
    """``neuroglancer_uint64_sharded_v1`` shards of one sharding spec
    (``shard_ctx`` is unused: the shard number is in the key).

    ``multilod``: the stored unit of mesh ``id`` is the pair (fragment data,
    chunk ``id | FRAGMENTS``, stored raw; manifest, chunk ``id``, stored with
    ``data_encoding``), laid out fragment data first with the minishard index
    pointing at the manifest."""

    def __init__(self, spec: ShardingSpec, cache: ByteLRU, multilod: bool = False, gap: int = INDEX_GAP):
        self.spec = spec
        self.multilod = multilod
        self.gap = gap  # index ranges closer than this are read in one GET (-o prefetch_gap)
        self.cache = cache  # minishard indexes share the shard index budget
        #: what an index parsed here depends on (ShardCache parses again under another)
        self.parses_as = (spec, multilod)
        self._loads = SingleFlight()

    async def cached(self, key: tuple, load):
        """``cache[key]``, loading it once however many tasks ask at the same time."""
        while True:
            hit = self.cache.get(key)
            if hit is not None:
                return hit
            if not await shared_within_deadline(self._loads, key, key[0]):  # (key: shard, etag, minishard, spec)
                break
        with self._loads.loading(key):
            return await load()

    async def load_index(self, store: AsyncStore, key: str, shard_ctx=None) -> PrecomputedShardIndex | None:
        size = self.spec.shard_index_size
        try:
            blob = await store.get(key, 0, size)
        except NotFound:
            return None
        try:
            table = parse_shard_index(blob.data, self.spec)  # ranges are checked per minishard, when used
        except FormatError as exc:
            raise CorruptData(f"{key}: {exc}", key) from None
        return PrecomputedShardIndex(self, store, blob.info, table, self.spec.parse_shard_key(key.rsplit("/", 1)[-1]))

    def index_size(self, shard_ctx=None) -> int:
        return self.spec.shard_index_size

    def encode(self, chunks: dict[int, bytes], shard_ctx=None) -> bytes:
        fragments = {}
        if self.multilod:
            chunks, fragments = self._mesh_pairs(chunks)
        try:
            return encode_shard({}, self.spec, preencoded=chunks, unindexed=fragments)
        except ValueError as exc:
            raise CorruptData(f"cannot encode shard: {exc}") from None

    def _mesh_pairs(self, chunks: dict[int, bytes]) -> tuple[dict[int, bytes], dict[int, bytes]]:
        """Split stored multilod units into manifests and fragment data, and
        refuse (CorruptData: the flush fails with EIO, keeping the writes) a
        mesh whose manifest does not describe exactly its fragment data, or
        fragment data without a manifest (empty fragment data alone is dropped)."""
        manifests = {c: d for c, d in chunks.items() if c < FRAGMENTS}
        fragments = {c - FRAGMENTS: d for c, d in chunks.items() if c >= FRAGMENTS}
        problems = [f"mesh {c}: {len(d)} bytes of fragment data ({c}) without a manifest ({c}.index)"
                    for c, d in sorted(fragments.items()) if c not in manifests and len(d)]
        for c, stored in sorted(manifests.items()):
            data = fragments.get(c, b"")
            try:
                want = multilod_fragment_data_size(decode_data(stored, self.spec, max_size=MAX_CHUNK))
            except FormatError as exc:
                problems.append(f"mesh {c}: manifest {c}.index: {exc}")
                continue
            if want != len(data):
                problems.append(f"mesh {c}: manifest {c}.index describes {want} bytes of fragment data, "
                                f"{c} holds {len(data)}")
        if problems:
            more = f" (and {len(problems) - 3} more)" if len(problems) > 3 else ""
            raise Unstorable("inconsistent multi-resolution mesh(es), not written: " + "; ".join(problems[:3]) + more)
        return manifests, {c: d for c, d in fragments.items() if c in manifests and len(d)}

    def encode_chunk_for(self, chunk_id: int, data: bytes) -> bytes:
        """Stored form of a chunk written through the view: multilod fragment
        data is stored raw (as Neuroglancer and cloud-volume read it)."""
        return bytes(data) if chunk_id >= FRAGMENTS else self.encode_chunk(data)

    def deleted_with(self, chunk_id: int) -> tuple[int, ...]:
        """Ids an unlink removes: a multilod manifest takes its fragment data along."""
        return (chunk_id, chunk_id | FRAGMENTS) if self.multilod and chunk_id < FRAGMENTS else (chunk_id,)

    @property
    def decodes(self) -> bool:
        return self.spec.data_encoding != "raw"

    def decode_chunk(self, data: bytes) -> bytes:
        try:
            return decode_data(data, self.spec, max_size=MAX_CHUNK)
        except FormatError as exc:
            raise CorruptData(f"{self.spec.data_encoding} chunk data: {exc}") from None

    def encode_chunk(self, data: bytes) -> bytes:
        return encode_data(data, self.spec.data_encoding)


# --------------------------------------------------------------------------
# file names


#: names a chunk file of some precomputed directory could have: decimal ids
#: (``.index`` for mesh manifests), volume boxes, annotation cells
_CHUNK_LIKE = re.compile(r"-?\d+(\.index)?|-?\d+--?\d+(_-?\d+--?\d+)+|\d+(_\d+)+")


def _parse_u64(name: str) -> int | None:
    v = parse_index_name(name)
    return v if v is not None and v <= U64_MAX else None


@dataclass(frozen=True)
class DecimalNames:
    """``<id>``: key-value directories, annotation ``by_id`` and relationships."""

    def parse(self, name: str) -> int | None:
        return _parse_u64(name)

    def names(self, ids: np.ndarray) -> list[tuple[str, int, int]]:
        """(file name, chunk id, position in ``ids``) of every file ``ids`` make."""
        return [(str(c), c, i) for i, c in enumerate(ids.tolist())]


@dataclass(frozen=True)
class MeshNames(DecimalNames):
    """``<id>.index`` (the manifest: the chunk) and ``<id>`` (fragment data)."""

    def parse(self, name: str) -> int | None:
        if name.endswith(".index"):
            return _parse_u64(name[:-6])
        v = _parse_u64(name)
        return None if v is None else v | FRAGMENTS

    def names(self, ids: np.ndarray) -> list[tuple[str, int, int]]:
        return [n for i, c in enumerate(ids.tolist()) for n in ((f"{c}.index", c, i), (str(c), c | FRAGMENTS, i))]


@dataclass(frozen=True)
class VolumeNames:
    """``<x0>-<x1>_<y0>-<y1>_<z0>-<z1>`` of one volume scale."""

    geometry: ScaleGeometry

    def __post_init__(self):
        if sum(morton_bits(self.geometry.grid_shape)) > 64:
            raise ValueError(f"grid {self.geometry.grid_shape} needs more than 64 bits of chunk id")

    def parse(self, name: str) -> int | None:
        pos = self.geometry.parse_chunk_name(name)
        return None if pos is None else self.geometry.chunk_id(pos)

    def names(self, ids: np.ndarray) -> list[tuple[str, int, int]]:
        g = self.geometry
        pos, valid = morton_decode_many(ids, g.grid_shape)
        keep = np.flatnonzero(valid)
        pos = pos[keep]
        lo = np.asarray(g.voxel_offset) + pos * np.asarray(g.chunk_size)
        hi = np.asarray(g.voxel_offset) + np.minimum((pos + 1) * np.asarray(g.chunk_size), np.asarray(g.size))
        return [(f"{a[0]}-{b[0]}_{a[1]}-{b[1]}_{a[2]}-{b[2]}", c, i)
                for c, i, a, b in zip(ids[keep].tolist(), keep.tolist(), lo.tolist(), hi.tolist())]


@dataclass(frozen=True)
class CellNames:
    """``<x>_<y>_<z>`` (any rank) of one annotation spatial index level."""

    grid_shape: tuple[int, ...]

    def __post_init__(self):
        if not self.grid_shape or any(not isinstance(n, int) or isinstance(n, bool) or n < 1 for n in self.grid_shape):
            raise ValueError(f"grid_shape {list(self.grid_shape)} is not a list of positive integers")
        if sum(morton_bits(self.grid_shape)) > 64:
            raise ValueError(f"grid_shape {list(self.grid_shape)} needs more than 64 bits of chunk id")

    def parse(self, name: str) -> int | None:
        parts = name.split("_")
        if len(parts) != len(self.grid_shape):
            return None
        pos = [parse_index_name(p) for p in parts]
        if any(p is None or p >= n for p, n in zip(pos, self.grid_shape)):
            return None
        return compressed_morton_code(pos, self.grid_shape)

    def names(self, ids: np.ndarray) -> list[tuple[str, int, int]]:
        pos, valid = morton_decode_many(ids, self.grid_shape)
        keep = np.flatnonzero(valid)
        return [("_".join(map(str, p)), c, i) for c, i, p in zip(ids[keep].tolist(), keep.tolist(), pos[keep].tolist())]


# --------------------------------------------------------------------------
# the dataset


class PrecomputedDataset(Dataset):
    """One directory of shards, shown as one file per stored chunk."""

    layout = NAME

    def __init__(self, ctx: LayoutContext, root: str, spec: ShardingSpec, naming, writable: bool = True):
        super().__init__(ctx, root)
        self.spec = spec
        self.naming = naming
        self.writable = writable
        self.shard_format = PrecomputedShardFormat(spec, ctx.shards.indexes, multilod=isinstance(naming, MeshNames),
                                                   gap=ctx.shards.prefetch_gap)

    def _shard_key(self, chunk_id: int) -> str:
        return join_key(self.root, self.spec.shard_key(self.spec.shard_and_minishard(chunk_id & U64_MAX)[0]))

    def claims(self, rel) -> bool:
        return len(rel) == 1 and (self.naming.parse(rel[0]) is not None or
                                  self.spec.parse_shard_key(rel[0]) is not None)

    def target(self, rel) -> ChunkTarget | None:
        cid = self.naming.parse(rel[0]) if len(rel) == 1 else None
        if cid is None:
            return None
        return ChunkTarget(self._shard_key(cid), cid, None, None, writable=self.writable)

    def removed_with(self, rel) -> tuple[str, ...] | None:
        """A mesh's fragment data ``<id>`` goes with its manifest ``<id>.index``."""
        if isinstance(self.naming, MeshNames) and len(rel) == 1 and not rel[0].endswith(".index"):
            return (rel[0] + ".index",)
        return None

    def stored_as_is(self, rel) -> str | None:
        """``<hex>.shard``: what tensorstore writes for a sharded scale
        (``cp -r`` of a sharded volume, a new scale written through the
        view) is the stored form; its chunks then show in the listing."""
        if len(rel) == 1 and self.spec.parse_shard_key(rel[0]) is not None:
            return join_key(self.root, rel[0])
        return None

    def outside(self, rel) -> bool:
        """Spelled like this directory's chunk names but none of them (a box
        off the grid or misaligned, an id past 2**64-1): never stored, so
        refused rather than kept as a stray file."""
        return len(rel) == 1 and self.naming.parse(rel[0]) is None and _CHUNK_LIKE.fullmatch(rel[0]) is not None

    async def _pinned(self, key: str, fn):
        """``fn(index)`` on the current index of shard ``key`` (None if there
        is no shard); if the shard is replaced under a pinned read, again."""
        for _ in range(3):
            index = await self.ctx.shards.index(self.shard_format, key)
            if index is None:
                return None
            try:
                return await fn(index)
            except (PreconditionFailed, NotFound):
                self.ctx.shards.forget(key)
        raise CorruptData(f"{key}: shard keeps changing while being read", key)

    async def _find(self, index: PrecomputedShardIndex, cid: int) -> tuple[Minishard, int] | None:
        ms = await index.minishard(self.spec.shard_and_minishard(cid)[1])
        i = ms.find(cid)
        return None if i is None else (ms, i)

    async def _size(self, index: PrecomputedShardIndex, ms: Minishard, i: int, chunk_id: int) -> int:
        if chunk_id >= FRAGMENTS:
            start, end = await self._fragment_range(index, ms, i)
            return end - start
        if ms.shown is not None and ms.shown[i] == -1:
            await index.fetch_sizes([ms], only=(ms, i))
        size = int(ms.view_sizes()[i])
        if size < 0:
            raise CorruptData(f"{index.info.key}: chunk {chunk_id}: damaged gzip trailer", index.info.key)
        return size

    async def _fragment_range(self, index: PrecomputedShardIndex, ms: Minishard, i: int) -> tuple[int, int]:
        cid = int(ms.ids[i])
        manifest = await self.ctx.shards.read_chunk(self.shard_format, index.info.key, cid)
        try:
            return multilod_fragment_data_range(int(ms.starts[i]), manifest or b"", self.spec)
        except FormatError as exc:
            raise CorruptData(f"{index.info.key}: mesh {cid}: {exc}", index.info.key) from None

    # -- namespace ------------------------------------------------------------

    async def lookup(self, rel) -> ChunkEntry | None:
        cid = self.naming.parse(rel[0]) if len(rel) == 1 else None
        if cid is None:
            return None  # a shard name: hidden
        key = self._shard_key(cid)

        async def entry(index):
            found = await self._find(index, cid & U64_MAX)
            if found is None:
                return None
            return ChunkEntry(key, cid, await self._size(index, *found, cid), index.info.mtime_ns)

        return await self._pinned(key, entry)

    async def listdir(self, rel):
        async for batch in self.listdir_batches(rel):
            for item in batch:
                yield item

    async def listdir_batches(self, rel):
        if rel != ():
            return
        listing = await self.ctx.store.list(self.root)
        shards = sorted(f.key for f in listing.files if self.spec.parse_shard_key(f.key.rsplit("/", 1)[-1]) is not None)
        # S3 (read-ahead on): the shard indexes this listing will need, loaded now, together
        self.ctx.shards.preload_soon(self.shard_format, [(key, None) for key in shards])
        for key in shards:
            try:
                entries = await self._pinned(key, self._shard_listing)
            except CorruptData as exc:  # (the words its files' EIO logs: one line for both)
                report_damage(log, exc)
                continue
            except AccessDenied as exc:  # left out like a damaged shard: the rest stays listable
                warn_once(log, f"{exc}; its chunks are not listed")
                continue
            if entries:
                yield entries

    async def _shard_listing(self, index: PrecomputedShardIndex) -> list[tuple[str, ChunkEntry]]:
        """Every readable chunk file of one shard, from its indexes only."""
        minishards = await index.minishards()
        misplaced = {}
        for m, ms in minishards.items():
            if isinstance(ms, CorruptData):
                report_damage(log, ms)
            elif ms.misplaced:
                misplaced[m] = ms.misplaced
        if misplaced:  # (one line a shard: a wrong hash or preshift misplaces the chunks of every minishard)
            first = min(misplaced)
            warn_once(log, f"{index.info.key}: {sum(misplaced.values())} chunk(s) that hash elsewhere are not shown "
                           f"(minishard {first}" + (f" and {len(misplaced) - 1} more)" if len(misplaced) > 1 else ")"))
        good = [ms for ms in minishards.values() if isinstance(ms, Minishard)]
        await index.fetch_sizes(good)
        out = []
        for ms in good:
            sizes = ms.view_sizes().tolist()
            for name, cid, i in self.naming.names(ms.ids):
                try:
                    size = await self._size(index, ms, i, cid) if cid >= FRAGMENTS else sizes[i]
                except CorruptData as exc:
                    report_damage(log, exc)
                    continue
                if size >= 0:
                    out.append((name, ChunkEntry(index.info.key, cid, size, index.info.mtime_ns)))
                else:  # -2: a damaged gzip stream: not listed, EIO on lookup; one line for both
                    report_damage(log, CorruptData(f"{index.info.key}: chunk {cid}: damaged gzip trailer",
                                                   index.info.key))
        return out

    # -- content --------------------------------------------------------------

    async def read(self, entry) -> bytes:
        key, cid = entry.shard_key, entry.chunk_id

        async def whole(index):
            found = await self._find(index, cid & U64_MAX)
            if found is None:
                return None
            if cid >= FRAGMENTS:
                return await self._fragments(index, *found)
            try:
                data = await self.ctx.shards.read_chunk(self.shard_format, key, cid)
            except CorruptData as exc:
                raise CorruptData(f"{key}: chunk {cid}: {exc}" if exc.key is None else str(exc), key) from None
            if data is not None and self.spec.data_encoding == "gzip":
                size = await self._size(index, *found, cid)
                if len(data) != size:
                    current = await self.ctx.shards.index(self.shard_format, key)
                    if current is None or current.info.etag != index.info.etag:
                        # read from a newer version than the size came from: again
                        raise PreconditionFailed(f"{key}: replaced while read", key)
                    raise CorruptData(f"{key}: chunk {cid} decodes to {len(data)} bytes but its gzip trailer says "
                                      f"{size} (damaged, or a multi-member gzip stream)", key)
            return data

        data = await self._pinned(key, whole)
        if data is None:
            raise NotFound(f"{key}: chunk {cid & U64_MAX} is not stored", key)
        return data

    async def _fragments(self, index: PrecomputedShardIndex, ms: Minishard, i: int) -> bytes:
        start, end = await self._fragment_range(index, ms, i)
        if end - start > MAX_CHUNK_BYTES:  # (read whole, like a chunk: a manifest's u32 sizes may add up to TiBs)
            raise CorruptData(f"{index.info.key}: mesh {int(ms.ids[i])}: fragment data of {end - start} bytes is "
                              f"larger than the {MAX_CHUNK_BYTES >> 20} MiB a chunk may have", index.info.key)
        ckey = (index.info.key, index.info.etag, int(ms.ids[i]) | FRAGMENTS)
        data = self.ctx.shards.chunks.get(ckey) if end > start else b""
        if data is None:
            blob = await self.ctx.store.get(index.info.key, start, end - start, if_match=index.info.etag)
            if len(blob.data) != end - start:
                raise CorruptData(f"{index.info.key}: mesh fragment data truncated", index.info.key)
            data = blob.data
            self.ctx.shards.chunks.put(ckey, data, len(data) + 64)
        return data


# --------------------------------------------------------------------------
# info documents


@dataclass(frozen=True)
class Part:
    """A sharded part of an ``info`` that the view shows unsharded."""

    holder: dict = field(compare=False)  # the JSON object holding ``sharding``
    key: str | None  # its directory, relative to the info's; None: the info's own
    spec: ShardingSpec
    naming: object
    writable: bool = True


def _candidates(doc: dict):
    """(holder, key, what, naming factory) of every object that may hold ``sharding``."""
    if isinstance(doc.get("scales"), list):
        for n, s in enumerate(doc["scales"]):
            if isinstance(s, dict):
                yield s, s.get("key"), f"scales[{n}]", lambda s=s: VolumeNames(ScaleGeometry.from_json(s))
        return
    if doc.get("@type") == ANNOTATIONS:
        if isinstance(doc.get("by_id"), dict):
            yield doc["by_id"], doc["by_id"].get("key"), "by_id", DecimalNames
        for name in ("relationships", "spatial"):
            items = doc.get(name)
            for n, s in enumerate(items if isinstance(items, list) else ()):
                if isinstance(s, dict):
                    naming = DecimalNames if name == "relationships" else (
                        lambda s=s: CellNames(tuple(s.get("grid_shape") or ())))
                    yield s, s.get("key"), f"{name}[{n}]", naming
        return
    yield doc, None, "sharding", MeshNames if doc.get("@type") == MULTILOD else DecimalNames


def key_problem(key) -> str | None:
    """Why a part's ``key`` names no directory inside the volume's (None:
    it does; a relative path of one or more names, ``s/8_8_8`` too)."""
    if not isinstance(key, str):
        return f"key {key!r} is not a string"
    if "://" in key:
        return f"key {key!r} is a URL, not a directory of the volume"
    if key.startswith("/"):
        return f"key {key!r} is an absolute path, not a directory of the volume"
    names = key.split("/")
    if any(n in ("", ".", "..") for n in names):
        return f"key {key!r} has an empty, '.' or '..' name"
    if names[0] == "info":
        return f"key {key!r} names a directory inside the volume's info"
    return None


def _nested(a: str, b: str) -> bool:
    """Is one of the keys ``a``, ``b`` the other, or a directory above it?"""
    return a == b or a.startswith(b + "/") or b.startswith(a + "/")


def _first_nested(keys: list[tuple[str, str]]) -> dict[str, str | None]:
    """For each part of ``keys`` ((where, key), in the document's order), the
    first other part whose key is its key or a directory above or below it
    (``_nested``), or None.  In one pass over the keys' directories, not
    each key against every other (an info of 3000 scales took 6.7 s)."""
    at: dict[str, list[int]] = {}  # key -> positions of the parts of that key
    above: dict[str, list[int]] = {}  # directory -> positions of the parts whose keys lie below it
    for pos, (_, key) in enumerate(keys):
        at.setdefault(key, []).append(pos)
        names = key.split("/")
        for n in range(1, len(names)):
            above.setdefault("/".join(names[:n]), []).append(pos)
    out = {}
    for pos, (where, key) in enumerate(keys):
        names = key.split("/")
        first = None
        for found in (at.get(key, ()), above.get(key, ()),
                      *(at.get("/".join(names[:n]), ()) for n in range(1, len(names)))):
            other = next((p for p in found[:2] if p != pos), None)  # (in order; its own at most once)
            if other is not None and (first is None or other < first):
                first = other
        out[where] = None if first is None else keys[first][0]
    return out


def parse_info(doc: dict, what: str) -> list[Part]:
    """The parts of ``doc`` shown unsharded; the others are logged once."""
    parts = []
    scales = doc.get("scales")
    if scales is not None and not isinstance(scales, list):
        warn_once(log, f"{what}: scales is {type(scales).__name__}, not a list: its scales are shown as stored")
    elif isinstance(scales, list) and not all(isinstance(s, dict) for s in scales):
        n = next(n for n, s in enumerate(scales) if not isinstance(s, dict))
        warn_once(log, f"{what}: scales[{n}] is not an object: it is shown as stored")
    candidates = list(_candidates(doc))
    nested = _first_nested([(where, key) for _, key, where, _ in candidates if isinstance(key, str)])
    for holder, key, where, naming in candidates:
        if "sharding" not in holder:
            continue
        try:
            if key is not None:
                problem = key_problem(key)
                if problem is not None:
                    raise ValueError(problem)
                other = nested.get(where)
                if other is not None:
                    raise ValueError(f"key {key!r} is also the directory of {other} (or one above or below it)")
            spec = ShardingSpec.from_json(holder["sharding"])
            if spec.minishard_bits > MAX_MINISHARD_BITS:
                raise ValueError(f"minishard_bits {spec.minishard_bits} > {MAX_MINISHARD_BITS} "
                                 f"(a {spec.shard_index_size}-byte shard index)")
            parts.append(Part(holder, key, spec, naming()))
        except (ValueError, TypeError) as exc:
            warn_once(log, f"{what}: {where}: sharded data shown as stored: {exc}")
    return parts


def is_document(key: str) -> bool:
    return key.rsplit("/", 1)[-1] == "info"


def dataset_dirs(key: str, data: bytes) -> list[str]:
    """The directories whose datasets the ``info`` at ``key`` describes: its
    own (a key-value directory) and those of its sharded parts (scales,
    annotation indexes)."""
    base = key.rpartition("/")[0]
    try:
        doc = json.loads(data)
        parts = [k for holder, k, _, _ in _candidates(doc) if isinstance(doc, dict) and "sharding" in holder
                 and key_problem(k) is None]
    except (ValueError, TypeError, AttributeError, RecursionError):
        parts = []
    return [base, *(join_key(base, k) for k in parts)]


def rewrite_document(key: str, data: bytes) -> bytes | None:
    """The ``info`` without the ``sharding`` of every part shown unsharded."""
    if not is_document(key):
        return None
    doc = load_json(data, key)  # a fresh object: edited in place
    if doc is None:
        return None
    parts = parse_info(doc, key)
    for part in parts:
        del part.holder["sharding"]
    return dump_json(doc, data) if parts else None


def accept_document(key: str, new: bytes, stored: bytes | None, shard_option) -> bytes | None:
    """An ``info`` written through the view: the stored ``sharding`` objects
    are put back into the parts that lost them, so the shards stay readable.
    Changing a sharded part's grid (its chunk ids), or writing another
    ``sharding`` than the stored one, raises ValueError (EPERM)."""
    if not is_document(key) or stored is None:
        return None
    old, doc = load_json(stored, key), load_json(new, key)
    if old is None or doc is None:
        return None
    fresh = {c[1]: c for c in _candidates(doc) if c[1] is None or isinstance(c[1], str)}
    changed = False
    for part in parse_info(old, key):
        found = fresh.get(part.key)
        if found is None:
            continue  # the part is gone
        holder, _, where, naming = found
        if "sharding" in holder:  # the tool wrote a sharding itself: the stored one, or refused
            try:
                same_sharding = ShardingSpec.from_json(holder["sharding"]) == part.spec
            except (ValueError, TypeError, KeyError, AttributeError):
                same_sharding = False
            if not same_sharding:
                raise ValueError(f"{where}: changing the sharding would make the stored shards unreadable "
                                 "(to re-shard, rewrite the store itself)")
            continue
        try:
            same = naming() == part.naming
        except (ValueError, TypeError):
            same = False
        if not same:
            raise ValueError(f"{where}: changing the grid of sharded data would make its stored chunks unreadable")
        holder["sharding"] = part.holder["sharding"]
        changed = True
    return dump_json(doc, new) if changed else None


async def accept_document_async(ctx: LayoutContext, key: str, new: bytes, stored: bytes | None,
                                shard_option, pending=lambda dir_key: (), previous=None) -> bytes | None:
    """``accept_document``, after one check that needs a listing: an ``info``
    that makes a directory sharded is refused (ValueError: EPERM) while that
    directory holds chunk files stored plain, which would vanish from the
    view (as zarr refuses a sharded ``zarr.json`` over plain chunks).  An
    empty directory, or one holding ``.shard`` files, is fine.  ``pending(dir_key)``:
    the names held only in memory in a directory (files being written there)."""
    doc = await load_json_async(new, key) if is_document(key) else None
    if doc is not None:
        old = await load_json_async(stored, key) if stored is not None else None
        before = {p.key for p in parse_info(old, key)} if old is not None else set()
        base = key.rpartition("/")[0]
        for part in parse_info(doc, key):
            if part.key in before:
                continue  # sharded already
            where = join_key(base, part.key) if part.key is not None else base
            listing = await ctx.store.list(where)
            names = [f.key.rsplit("/", 1)[-1] for f in listing.files] + list(pending(where))
            plain = sorted(n for n in names if part.naming.parse(n) is not None)
            if plain:
                raise ValueError(f"{where or '/'} holds chunk files stored unsharded ({', '.join(plain[:3])}"
                                 f"{', ...' if len(plain) > 3 else ''}): under a sharded info they would be "
                                 "unreadable (shard them with a tool, or remove them first)")
    return await off_loop(functools.partial(accept_document, key, new, stored, shard_option), len(new))


async def _info_parts(ctx: LayoutContext, key: str) -> tuple[dict, str] | None:
    """The sharded parts of the ``info`` document at ``key``, by their key
    relative to its directory (None: its own sharding), as (spec, naming,
    writable), and its etag (None: no info, or not JSON).  Parsed once per
    version (etag), whatever its size: every probe below a volume asks for
    its ``info``, and with ``metadata_ttl=0`` reads it each time, while
    parsing one of many scales costs more than that read (400 scales, 136 KB:
    about 7 ms; 40-70 ms while every key was compared with every other)."""
    try:
        blob = await ctx.store.get_document(key)
    except NotFound:
        return None
    etag = blob.info.etag
    known, parts = ctx.probed_get(NAME, key, etag, len(blob.data), min_size=0)
    if not known:
        doc = await load_json_async(blob.data, key)
        parts = None
        if doc is not None:
            parts = {}
            for part in parse_info(doc, key):  # (the first part of a key answers, as before)
                parts.setdefault(part.key, (part.spec, part.naming, part.writable))
        ctx.probed_put(NAME, key, etag, len(blob.data), parts, min_size=0)
    return None if parts is None else (parts, etag)


async def probe(ctx: LayoutContext, dir_key: str) -> PrecomputedDataset | None:
    """A directory of shards: described by its own ``info`` (top-level
    ``sharding``) or by the ``info`` of its parent or of any directory above
    it (a scale or annotation index ``key``: ``8_8_8`` in the parent's,
    ``s/8_8_8`` in the grandparent's...), the nearest first.  All are asked
    for at once: one round trip (most are answered without a request, from
    the probes and listings of the directories above)."""
    names = dir_key.split("/") if dir_key else []
    # (holder directory, the key naming dir_key from there; None: its own info)
    holders = [(dir_key, None)] + [("/".join(names[:k]), "/".join(names[k:])) for k in range(len(names) - 1, -1, -1)]
    keys = [join_key(holder, "info") for holder, _ in holders]
    docs = await outcomes(*(functools.partial(_info_parts, ctx, key) for key in keys))

    for n, ((_, rel), key, found) in enumerate(zip(holders, keys, docs)):
        if isinstance(found, (TooLarge, AccessDenied)) and n > 1:
            # an info above the parent that is too large or not allowed to be read
            # describes nothing: the probes of its directory and children say so
            continue
        if isinstance(found, Exception):
            raise found
        if found is None:
            continue
        part = found[0].get(rel)
        if part is not None:
            dataset = PrecomputedDataset(ctx, dir_key, *part)
            dataset.version = ((key, found[1]),)
            return dataset
    return None
