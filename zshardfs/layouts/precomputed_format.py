"""Neuroglancer precomputed sharded format (``neuroglancer_uint64_sharded_v1``).

Pure codec, no I/O: the precomputed layout (volumes and uint64 key-value
directories) builds on it.  The format in brief (see
``specs/neuroglancer-precomputed-sharded.txt``):

* A uint64 chunk id is hashed (``hash(id >> preshift_bits)``); bits
  ``[0, minishard_bits)`` of the hash pick the minishard, the next
  ``shard_bits`` bits pick the shard file ``<hex>.shard``.
* A shard starts with the *shard index*: ``2**minishard_bits`` pairs of uint64le
  ``(start, end)``, the byte range of each minishard index relative to the end of
  the shard index.  ``start == end`` means an empty minishard.
* A *minishard index* (after ``minishard_index_encoding``) is a C-order
  ``[3, n]`` uint64le array: delta-encoded ids, offsets delta-encoded relative to
  the end of the previous chunk (the first one relative to the end of the shard
  index), and sizes.  Deltas are taken modulo 2**64, so a writer may lay chunks
  out in any order and leave gaps; readers must not assume ascending offsets.
* Chunk payloads are stored after ``data_encoding`` (raw or gzip).

What tensorstore (0.1.x) does on disk, checked by ``tests/test_precomputed_format.py``:

* shard file name: ``"%0*x.shard" % (ceil(shard_bits / 4), shard)``, so
  ``shard_bits == 0`` gives ``0.shard`` and ``shard_bits == 5`` gives ``00.shard``..``1f.shard``;
* layout: shard index, then per non-empty minishard in ascending order its chunks
  sorted by id followed by its minishard index; nothing else, no gaps;
* gzip: a single gzip member, zlib level 9, header mtime 0, OS byte 3.  Our
  deflate output differs from tensorstore's (different zlib builds), so
  :func:`encode_shard` reproduces a tensorstore shard byte for byte only when it
  compresses nothing itself (raw minishard index; gzip chunks passed preencoded);
* an empty value is a legal zero-size entry (tensorstore writes one for ``b""``);
* volume edge chunks are stored clipped to the volume, sharded or not, and an
  unsharded twin's chunk file holds exactly the chunk in the scale's own
  ``encoding`` (never gzip-wrapped), i.e. the sharded payload after removing
  ``data_encoding``;
* its ``neuroglancer_uint64_sharded`` kvstore keys are the id as 8-byte big-endian.
"""

from __future__ import annotations

import re
import struct
import zlib
from collections.abc import Mapping
from dataclasses import dataclass
from functools import cached_property

import mmh3
import numpy as np

__all__ = [
    "FormatError",
    "ShardingSpec",
    "parse_shard_index",
    "parse_minishard_index",
    "parse_shard",
    "encode_shard",
    "encode_data",
    "decode_data",
    "gzip_isize",
    "decoded_size",
    "murmurhash3_x86_128_low64",
    "compressed_morton_code",
    "compressed_morton_codes",
    "morton_decode",
    "morton_decode_many",
    "morton_bits",
    "ScaleGeometry",
    "chunk_name",
    "parse_chunk_name",
    "multilod_fragment_data_size",
    "multilod_fragment_data_range",
]

U64_MAX = (1 << 64) - 1
SHARDING_TYPE = "neuroglancer_uint64_sharded_v1"
HASHES = ("identity", "murmurhash3_x86_128")
ENCODINGS = ("raw", "gzip")
# Level 6 rather than tensorstore's 9: same format, much cheaper on the write
# path; readers do not care.
DEFAULT_GZIP_LEVEL = 6
# tensorstore's bound: 16 << minishard_bits must fit in a uint64.
MAX_MINISHARD_BITS = 60


class FormatError(ValueError):
    """Stored bytes that do not follow the format (damaged or foreign data)."""


# --------------------------------------------------------------------------
# Sharding spec and hashing
# --------------------------------------------------------------------------


def _int_member(obj: Mapping, key: str, lo: int, hi: int) -> int:
    if key not in obj:
        raise ValueError(f"sharding: missing {key!r}")
    v = obj[key]
    # bool is an int subclass; JSON true is not a bit count.
    if not isinstance(v, int) or isinstance(v, bool):
        raise ValueError(f"sharding: {key!r} must be an integer, got {v!r}")
    if not lo <= v <= hi:
        raise ValueError(f"sharding: {key!r} must be in [{lo}, {hi}], got {v}")
    return v


def _choice_member(obj: Mapping, key: str, choices: tuple[str, ...], default: str | None) -> str:
    if key not in obj:
        if default is None:
            raise ValueError(f"sharding: missing {key!r}")
        return default
    v = obj[key]
    if v not in choices or not isinstance(v, str):
        raise ValueError(f"sharding: {key!r} must be one of {list(choices)}, got {v!r}")
    return v


def murmurhash3_x86_128_low64(value: int) -> int:
    """Low 64 bits of MurmurHash3_x86_128 (seed 0) of ``value`` as 8 bytes LE."""
    return mmh3.hash128(value.to_bytes(8, "little"), 0, False) & U64_MAX


def _rotl32(x: np.ndarray, r: int) -> np.ndarray:
    return (x << np.uint32(r)) | (x >> np.uint32(32 - r))


def _fmix32(h: np.ndarray) -> np.ndarray:
    h = h ^ (h >> np.uint32(16))
    h = h * np.uint32(0x85EBCA6B)
    h = h ^ (h >> np.uint32(13))
    h = h * np.uint32(0xC2B2AE35)
    return h ^ (h >> np.uint32(16))


def _murmur_low64_many(values: np.ndarray) -> np.ndarray:
    """Vectorised :func:`murmurhash3_x86_128_low64` for 8-byte keys.

    An 8-byte key has no full 16-byte block, only the tail (k1 = low word,
    k2 = high word), so the hash reduces to a few uint32 operations that numpy
    can do for millions of ids at once (mmh3 has no array interface).
    """
    v = np.asarray(values, dtype=np.uint64)
    k1 = (v & np.uint64(0xFFFFFFFF)).astype(np.uint32)
    k2 = (v >> np.uint64(32)).astype(np.uint32)
    with np.errstate(over="ignore"):
        k2 = _rotl32(k2 * np.uint32(0xAB0E9789), 16) * np.uint32(0x38B34AE5)
        k1 = _rotl32(k1 * np.uint32(0x239B961B), 15) * np.uint32(0xAB0E9789)
        h1 = k1 ^ np.uint32(8)
        h2 = k2 ^ np.uint32(8)
        h3 = np.full_like(h1, 8)
        h4 = np.full_like(h1, 8)
        h1 = h1 + h2 + h3 + h4
        h2 = h2 + h1
        h3 = h3 + h1
        h4 = h4 + h1
        h1, h2, h3, h4 = _fmix32(h1), _fmix32(h2), _fmix32(h3), _fmix32(h4)
        h1 = h1 + h2 + h3 + h4
        h2 = h2 + h1
    return h1.astype(np.uint64) | (h2.astype(np.uint64) << np.uint64(32))


def _check_id(chunk_id: int) -> int:
    if not isinstance(chunk_id, (int, np.integer)) or isinstance(chunk_id, bool):
        raise ValueError(f"chunk id must be an integer, got {chunk_id!r}")
    chunk_id = int(chunk_id)
    if not 0 <= chunk_id <= U64_MAX:
        raise ValueError(f"chunk id {chunk_id} is not a uint64")
    return chunk_id


@dataclass(frozen=True)
class ShardingSpec:
    """A validated ``neuroglancer_uint64_sharded_v1`` sharding object.

    Accepts what tensorstore accepts: ``preshift_bits`` in [0, 64],
    ``minishard_bits`` in [0, 60], ``minishard_bits + shard_bits <= 64`` (the
    hash has 64 bits).  ``preshift_bits`` is not counted in that sum: with
    murmurhash the hash keeps 64 bits whatever the shift, and with identity a
    large shift only leaves high shards unused, which is legal.  Unknown members
    are ignored (Neuroglancer does), missing encodings default to raw.
    """

    preshift_bits: int
    hash: str
    minishard_bits: int
    shard_bits: int
    minishard_index_encoding: str = "raw"
    data_encoding: str = "raw"

    def __post_init__(self) -> None:
        # Run the JSON validation on direct construction too.
        ShardingSpec.from_json(self.to_json())
        object.__setattr__(self, "_hash", self._fields_hash())

    def _fields_hash(self) -> int:
        return hash((self.preshift_bits, self.hash, self.minishard_bits, self.shard_bits,
                     self.minishard_index_encoding, self.data_encoding))

    def __hash__(self) -> int:
        # Computed once: a spec is part of every minishard index cache key, which the
        # cache hashes at each lookup (dataclass' own __hash__ builds a tuple each time).
        return self._hash

    def __reduce__(self):
        # (a copy or an unpickled spec computes its hash anew: str hashes differ between processes)
        return ShardingSpec.from_json, (self.to_json(),)

    @classmethod
    def from_json(cls, obj: object) -> "ShardingSpec":
        if not isinstance(obj, Mapping):
            raise ValueError(f"sharding must be a JSON object, got {type(obj).__name__}")
        if obj.get("@type") != SHARDING_TYPE:
            raise ValueError(f"sharding: '@type' must be {SHARDING_TYPE!r}, got {obj.get('@type')!r}")
        preshift = _int_member(obj, "preshift_bits", 0, 64)
        minishard = _int_member(obj, "minishard_bits", 0, MAX_MINISHARD_BITS)
        shard = _int_member(obj, "shard_bits", 0, 64)
        if minishard + shard > 64:
            raise ValueError(
                f"sharding: minishard_bits + shard_bits = {minishard + shard} exceeds the 64-bit hash"
            )
        hash_ = _choice_member(obj, "hash", HASHES, None)
        mie = _choice_member(obj, "minishard_index_encoding", ENCODINGS, "raw")
        de = _choice_member(obj, "data_encoding", ENCODINGS, "raw")
        spec = object.__new__(cls)
        for k, v in (
            ("preshift_bits", preshift),
            ("hash", hash_),
            ("minishard_bits", minishard),
            ("shard_bits", shard),
            ("minishard_index_encoding", mie),
            ("data_encoding", de),
        ):
            object.__setattr__(spec, k, v)
        object.__setattr__(spec, "_hash", spec._fields_hash())
        return spec

    def to_json(self) -> dict:
        return {
            "@type": SHARDING_TYPE,
            "preshift_bits": self.preshift_bits,
            "hash": self.hash,
            "minishard_bits": self.minishard_bits,
            "shard_bits": self.shard_bits,
            "minishard_index_encoding": self.minishard_index_encoding,
            "data_encoding": self.data_encoding,
        }

    @property
    def num_minishards(self) -> int:
        return 1 << self.minishard_bits

    @property
    def num_shards(self) -> int:
        return 1 << self.shard_bits

    @property
    def shard_index_size(self) -> int:
        """Bytes of the fixed shard index at the start of every shard file."""
        return 16 << self.minishard_bits

    def hash_id(self, chunk_id: int) -> int:
        x = _check_id(chunk_id) >> self.preshift_bits  # Python: >> 64 gives 0
        if self.hash == "identity":
            return x
        return murmurhash3_x86_128_low64(x)

    def shard_and_minishard(self, chunk_id: int) -> tuple[int, int]:
        h = self.hash_id(chunk_id)
        minishard = h & ((1 << self.minishard_bits) - 1)
        shard = (h >> self.minishard_bits) & ((1 << self.shard_bits) - 1)
        return shard, minishard

    def shard_and_minishard_many(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Vectorised :meth:`shard_and_minishard` (uint64 arrays in and out)."""
        ids = np.asarray(ids, dtype=np.uint64)
        if self.preshift_bits >= 64:
            x = np.zeros_like(ids)
        else:
            x = ids >> np.uint64(self.preshift_bits)
        h = x if self.hash == "identity" else _murmur_low64_many(x)
        minishard = h & np.uint64((1 << self.minishard_bits) - 1)
        shard = (h >> np.uint64(self.minishard_bits)) & np.uint64((1 << self.shard_bits) - 1)
        return shard, minishard

    def shard_key(self, shard_number: int) -> str:
        """File name of a shard, as tensorstore and Neuroglancer name it."""
        if not 0 <= shard_number < self.num_shards:
            raise ValueError(f"shard number {shard_number} out of range for shard_bits={self.shard_bits}")
        return f"{shard_number:0{-(-self.shard_bits // 4)}x}.shard"

    def parse_shard_key(self, name: str) -> int | None:
        """Shard number of a file name, or None if it is not exactly a shard of this spec."""
        if not name.endswith(".shard"):
            return None
        stem = name[: -len(".shard")]
        if not stem or len(stem) > 16 or not all(c in "0123456789abcdef" for c in stem):
            return None
        n = int(stem, 16)
        if n >= self.num_shards or self.shard_key(n) != name:
            return None
        return n


# --------------------------------------------------------------------------
# Data encoding
# --------------------------------------------------------------------------


def encode_data(data: bytes, encoding: str, level: int = DEFAULT_GZIP_LEVEL) -> bytes:
    """Apply a sharding encoding; gzip is one member with mtime 0 (deterministic)."""
    if encoding == "raw":
        return bytes(data)
    if encoding == "gzip":
        return zlib.compress(data, level, wbits=31)
    raise ValueError(f"unknown encoding {encoding!r}")


def _gunzip(data: bytes, max_size: int | None) -> bytes:
    out: list[bytes] = []
    total = 0
    rest = memoryview(data)
    # A gzip stream may hold several members (concatenated files); decode them
    # all as gzip(1) does, but refuse anything else after the last one.
    while True:
        d = zlib.decompressobj(wbits=31)
        try:
            if max_size is None:
                chunk = d.decompress(rest)
            else:
                chunk = d.decompress(rest, max_size - total + 1)
        except zlib.error as e:
            raise FormatError(f"bad gzip data: {e}") from None
        total += len(chunk)
        if max_size is not None and (total > max_size or d.unconsumed_tail):
            raise FormatError(f"gzip data decodes to more than {max_size} bytes")
        if not d.eof:
            raise FormatError("truncated gzip data")
        out.append(chunk)
        rest = memoryview(d.unused_data)
        if not rest:
            return b"".join(out)
        if bytes(rest[:2]) != b"\x1f\x8b":
            raise FormatError("trailing bytes after gzip data")


def decode_data(data: bytes, spec_or_encoding: "ShardingSpec | str", max_size: int | None = None) -> bytes:
    """Remove the sharding ``data_encoding`` (or the given encoding) from a payload.

    ``max_size`` bounds the output so a damaged or hostile stream cannot blow up
    memory.  gzip CRC32 and length are checked by zlib.
    """
    encoding = spec_or_encoding.data_encoding if isinstance(spec_or_encoding, ShardingSpec) else spec_or_encoding
    if encoding == "raw":
        if max_size is not None and len(data) > max_size:
            raise FormatError(f"data is larger than {max_size} bytes")
        return bytes(data)
    if encoding == "gzip":
        return _gunzip(data, max_size)
    raise ValueError(f"unknown encoding {encoding!r}")


def gzip_isize(tail: bytes) -> int:
    """Decoded size of a gzip stream from its last 4 bytes (the ISIZE trailer).

    ISIZE is the member's uncompressed length modulo 2**32, so it is the exact
    decoded size only for a single-member stream shorter than 4 GiB.  Everything
    tensorstore, Neuroglancer tools and :func:`encode_data` write is one member,
    and precomputed chunks are far below 4 GiB; a multi-member stream (``cat
    a.gz b.gz``) would report only its last member.  It also trusts unverified
    bytes, so a reader must check ``len(decode_data(...))`` against it and treat
    a mismatch as damage.  The payoff: ``stat`` costs a 4-byte ranged read
    instead of decompressing the chunk.
    """
    if len(tail) < 4:
        raise FormatError("gzip data too short for a trailer")
    return struct.unpack_from("<I", tail, len(tail) - 4)[0]


# Smallest possible gzip member: 10-byte header, 2-byte empty deflate block, 8-byte trailer.
_MIN_GZIP_SIZE = 20


def decoded_size(stored_size: int, tail: bytes, spec_or_encoding: "ShardingSpec | str") -> int:
    """Size a stored payload has after :func:`decode_data`; ``tail`` = its last >= 4 bytes (unused for raw)."""
    encoding = spec_or_encoding.data_encoding if isinstance(spec_or_encoding, ShardingSpec) else spec_or_encoding
    if encoding == "raw":
        return stored_size
    if encoding == "gzip":
        if stored_size < _MIN_GZIP_SIZE:
            raise FormatError(f"{stored_size} bytes cannot be a gzip stream")
        return gzip_isize(tail)
    raise ValueError(f"unknown encoding {encoding!r}")


# --------------------------------------------------------------------------
# Shard and minishard indexes
# --------------------------------------------------------------------------


def parse_shard_index(data: bytes, spec: ShardingSpec | None = None, shard_size: int | None = None) -> np.ndarray:
    """Shard index -> ``(n, 2)`` uint64 array of **absolute** minishard-index byte ranges.

    On disk the ranges are relative to the end of the shard index; they are
    returned already shifted, so callers slice the shard file directly.  An empty
    minishard has ``start == end``.  Without ``spec``, ``data`` must be exactly
    the index; with it, ``data`` may be any prefix of the shard at least as long
    as the index.  ``shard_size`` (when known) bounds every range.
    """
    if spec is not None:
        n_bytes = spec.shard_index_size
        if len(data) < n_bytes:
            raise FormatError(f"shard index needs {n_bytes} bytes, got {len(data)}")
        data = memoryview(data)[:n_bytes]
    else:
        n_bytes = len(data)
        if n_bytes == 0 or n_bytes % 16 or (n_bytes // 16) & (n_bytes // 16 - 1):
            raise FormatError(f"shard index length {n_bytes} is not 16 * 2**k")
    if shard_size is not None and shard_size < n_bytes:
        raise FormatError(f"shard of {shard_size} bytes is shorter than its {n_bytes}-byte index")
    rel = np.frombuffer(data, dtype="<u8").reshape(-1, 2).astype(np.uint64)
    start, end = rel[:, 0], rel[:, 1]
    if np.any(start > end):
        m = int(np.argmax(start > end))
        raise FormatError(f"minishard {m}: index range start {start[m]} > end {end[m]}")
    if np.any(end > np.uint64(U64_MAX - n_bytes)):
        raise FormatError("minishard index range overflows 64 bits")
    absolute = rel + np.uint64(n_bytes)
    if shard_size is not None:
        past = absolute[:, 1] > np.uint64(shard_size)
        if np.any(past):
            m = int(np.argmax(past))
            raise FormatError(f"minishard {m}: index ends at {absolute[m, 1]}, past the shard end {shard_size}")
    return absolute


def parse_minishard_index(
    data: bytes, spec: ShardingSpec, shard_size: int | None = None, max_size: int | None = None
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Encoded minishard index -> ``(ids, offsets, sizes)``, uint64 arrays sorted by id.

    Offsets are absolute positions in the shard file.  Like tensorstore, deltas
    are summed modulo 2**64 (so any chunk order is allowed) and a chunk whose
    range wraps past 2**64 is an error; unlike it, a duplicated id is an error
    here too (readers would disagree about which copy is the chunk).
    ``max_size`` bounds the decoded index (gzip bomb guard).
    """
    raw = decode_data(data, spec.minishard_index_encoding, max_size=max_size)
    if len(raw) % 24:
        raise FormatError(f"minishard index length {len(raw)} is not a multiple of 24")
    a = np.frombuffer(raw, dtype="<u8").reshape(3, -1).astype(np.uint64)
    with np.errstate(over="ignore"):
        ids = np.cumsum(a[0], dtype=np.uint64)
        ends = np.cumsum(a[1] + a[2], dtype=np.uint64)
        starts = ends - a[2]
    if np.any(ends < starts):
        i = int(np.argmax(ends < starts))
        raise FormatError(f"chunk {ids[i]}: byte range wraps past 2**64")
    base = spec.shard_index_size
    if np.any(ends > np.uint64(U64_MAX - base)):
        raise FormatError("chunk byte range overflows 64 bits")
    starts = starts + np.uint64(base)
    sizes = a[2].copy()
    if shard_size is not None:
        past = (starts + sizes) > np.uint64(shard_size)
        if np.any(past):
            i = int(np.argmax(past))
            raise FormatError(
                f"chunk {ids[i]}: bytes [{starts[i]}, {starts[i] + sizes[i]}) past the shard end {shard_size}"
            )
    order = np.argsort(ids, kind="stable")
    ids, starts, sizes = ids[order], starts[order], sizes[order]
    if ids.size > 1 and np.any(ids[1:] == ids[:-1]):
        i = int(np.argmax(ids[1:] == ids[:-1]))
        raise FormatError(f"chunk {ids[i]} appears more than once in the minishard index")
    return ids, starts, sizes


def parse_shard(data: bytes, spec: ShardingSpec) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """A whole shard file -> ``(ids, offsets, sizes, minishards)``, concatenated by minishard.

    Convenience for read-modify-write, checks and tests; the view reads only the
    indexes it needs.
    """
    ranges = parse_shard_index(data, spec, shard_size=len(data))
    parts = []
    for m in np.flatnonzero(ranges[:, 0] != ranges[:, 1]):
        s, e = int(ranges[m, 0]), int(ranges[m, 1])
        ids, offs, sizes = parse_minishard_index(data[s:e], spec, shard_size=len(data))
        parts.append((ids, offs, sizes, np.full(ids.shape, m, dtype=np.uint64)))
    if not parts:
        e = np.zeros(0, dtype=np.uint64)
        return e, e, e, e
    return tuple(np.concatenate(p) for p in zip(*parts))  # type: ignore[return-value]


def _encode_minishard_index(ids: np.ndarray, starts_rel: np.ndarray, sizes: np.ndarray) -> bytes:
    with np.errstate(over="ignore"):
        d_ids = np.diff(ids, prepend=np.uint64(0))
        prev_end = np.concatenate([np.zeros(1, np.uint64), (starts_rel + sizes)[:-1]])
        d_off = starts_rel - prev_end
    return np.stack([d_ids, d_off, sizes]).astype("<u8").tobytes()


def encode_shard(
    chunks: Mapping[int, bytes],
    spec: ShardingSpec,
    *,
    preencoded: Mapping[int, bytes] | None = None,
    gzip_level: int = DEFAULT_GZIP_LEVEL,
    unindexed: Mapping[int, bytes] | None = None,
) -> bytes:
    """Build one complete shard file from chunk payloads.

    ``chunks`` hold plain payloads, to which ``data_encoding`` is applied;
    ``preencoded`` hold payloads already in ``data_encoding`` form (e.g. copied
    from the old shard on a read-modify-write, so untouched chunks are never
    recompressed).  All ids must belong to the same shard.  Layout mirrors
    tensorstore: shard index, then per minishard its chunks by ascending id and
    its minishard index.  No chunks gives ``b""``: an empty shard is deleted,
    not written.

    ``unindexed[id]`` (stored as given, in no index) is laid out immediately
    before chunk ``id``'s payload: a multi-resolution mesh's fragment data
    before its manifest, where Neuroglancer and cloud-volume look for it.
    """
    unindexed = unindexed or {}
    stray = unindexed.keys() - chunks.keys() - (preencoded or {}).keys()
    if stray:
        raise ValueError(f"unindexed data for ids that are not chunks: {sorted(stray)[:5]}")
    preencoded = preencoded or {}
    dup = chunks.keys() & preencoded.keys()
    if dup:
        raise ValueError(f"chunk ids given both plain and preencoded: {sorted(dup)[:5]}")
    payloads: dict[int, bytes] = {}
    for cid, payload in chunks.items():
        payloads[_check_id(cid)] = encode_data(payload, spec.data_encoding, gzip_level)
    for cid, payload in preencoded.items():
        payloads[_check_id(cid)] = bytes(payload)
    if not payloads:
        return b""

    ids = np.fromiter(payloads.keys(), dtype=np.uint64, count=len(payloads))
    shards, minishards = spec.shard_and_minishard_many(ids)
    if np.any(shards != shards[0]):
        found = sorted({int(s) for s in np.unique(shards)})
        raise ValueError(f"chunks belong to several shards {found[:8]}; encode one shard at a time")
    order = np.lexsort((ids, minishards))
    ids, minishards = ids[order], minishards[order]
    sizes = np.fromiter((len(payloads[int(i)]) for i in ids), dtype=np.uint64, count=ids.size)

    shard_index = np.zeros((spec.num_minishards, 2), dtype="<u8")
    out: list[bytes] = []
    pos = 0  # relative to the end of the shard index
    bounds = np.flatnonzero(np.diff(minishards)) + 1
    for sel in np.split(np.arange(ids.size), bounds):
        m_ids, m_sizes = ids[sel], sizes[sel]
        starts = np.zeros(len(m_ids), np.uint64)
        for k, cid in enumerate(m_ids.tolist()):
            before = unindexed.get(cid, b"")
            out.append(bytes(before))
            pos += len(before)
            starts[k] = pos
            out.append(payloads[cid])
            pos += len(payloads[cid])
        index = encode_data(_encode_minishard_index(m_ids, starts, m_sizes), spec.minishard_index_encoding, gzip_level)
        out.append(index)
        shard_index[int(minishards[sel[0]])] = (pos, pos + len(index))
        pos += len(index)
    return shard_index.tobytes() + b"".join(out)


# --------------------------------------------------------------------------
# Volume geometry: compressed Morton codes and chunk file names
# --------------------------------------------------------------------------


def morton_bits(grid_shape) -> tuple[int, ...]:
    """Bits per dimension: ``bit_width(grid_shape[d] - 1)``, i.e. ``ceil(log2(n))``.

    That is what tensorstore and cloud-volume (``2**i < grid_size``) compute and
    what tensorstore-written ids show (tested with a (2, 5, 1) grid).  A copy of
    Neuroglancer's prose reads ``2**i <= grid_size``, which would give a grid of 4
    three bits: do not follow it.
    """
    return tuple(max(int(g) - 1, 0).bit_length() for g in grid_shape)


def _morton_plan(grid_shape) -> tuple[tuple[int, int], ...]:
    """(dimension, source bit) for each output bit, low to high."""
    bits = morton_bits(grid_shape)
    if sum(bits) > 64:
        raise ValueError(f"grid {tuple(grid_shape)} needs {sum(bits)} > 64 bits of chunk id")
    return tuple((d, i) for i in range(max(bits, default=0)) for d in range(len(bits)) if i < bits[d])


def _check_pos(grid_pos, grid_shape) -> tuple[int, ...]:
    if len(grid_pos) != len(grid_shape):
        raise ValueError(f"grid position {tuple(grid_pos)} has the wrong rank for grid {tuple(grid_shape)}")
    pos = tuple(int(p) for p in grid_pos)
    if any(not 0 <= p < g for p, g in zip(pos, grid_shape)):
        raise ValueError(f"grid position {pos} outside grid {tuple(grid_shape)}")
    return pos


def compressed_morton_code(grid_pos, grid_shape) -> int:
    """Neuroglancer's compressed Morton code: x,y,z bits interleaved, exhausted dims skipped."""
    pos = _check_pos(grid_pos, grid_shape)
    code = 0
    for j, (d, i) in enumerate(_morton_plan(grid_shape)):
        code |= ((pos[d] >> i) & 1) << j
    return code


def compressed_morton_codes(grid_pos: np.ndarray, grid_shape) -> np.ndarray:
    """Vectorised :func:`compressed_morton_code`; ``grid_pos`` is ``(n, ndim)``."""
    pos = np.asarray(grid_pos, dtype=np.int64).reshape(-1, len(grid_shape))
    if np.any(pos < 0) or np.any(pos >= np.asarray(grid_shape, dtype=np.int64)):
        raise ValueError("grid position outside the grid")
    upos = pos.astype(np.uint64)
    code = np.zeros(len(pos), dtype=np.uint64)
    one = np.uint64(1)
    for j, (d, i) in enumerate(_morton_plan(grid_shape)):
        code |= ((upos[:, d] >> np.uint64(i)) & one) << np.uint64(j)
    return code


def morton_decode(code: int, grid_shape) -> tuple[int, ...]:
    """Inverse of :func:`compressed_morton_code`; ValueError if ``code`` is no cell of the grid."""
    code = _check_id(code)
    plan = _morton_plan(grid_shape)
    if code >> len(plan):
        raise ValueError(f"chunk id {code} has bits beyond the {len(plan)} of grid {tuple(grid_shape)}")
    pos = [0] * len(grid_shape)
    for j, (d, i) in enumerate(plan):
        pos[d] |= ((code >> j) & 1) << i
    return _check_pos(pos, grid_shape)


def morton_decode_many(codes: np.ndarray, grid_shape) -> tuple[np.ndarray, np.ndarray]:
    """Vectorised :func:`morton_decode` -> ``(positions (n, ndim) int64, valid mask)``.

    Invalid codes (bits beyond the grid, or a position past a non-power-of-two
    edge) are flagged rather than raised: a listing skips them.
    """
    codes = np.asarray(codes, dtype=np.uint64).ravel()
    plan = _morton_plan(grid_shape)
    pos = np.zeros((codes.size, len(grid_shape)), dtype=np.uint64)
    one = np.uint64(1)
    for j, (d, i) in enumerate(plan):
        pos[:, d] |= ((codes >> np.uint64(j)) & one) << np.uint64(i)
    valid = np.all(pos < np.asarray(grid_shape, dtype=np.uint64), axis=1)
    if len(plan) < 64:
        valid &= (codes >> np.uint64(len(plan))) == 0
    return pos.astype(np.int64), valid


def _int_list(scale: Mapping, key: str, default=None) -> tuple[int, ...]:
    v = scale.get(key, default)
    if (
        not isinstance(v, (list, tuple))
        or len(v) != 3
        or not all(isinstance(x, int) and not isinstance(x, bool) for x in v)
    ):
        raise ValueError(f"scale {key!r} must be three integers, got {v!r}")
    return tuple(v)


_NAME_RE = re.compile(r"(-?[0-9]+)-(-?[0-9]+)_(-?[0-9]+)-(-?[0-9]+)_(-?[0-9]+)-(-?[0-9]+)")


@dataclass(frozen=True)
class ScaleGeometry:
    """Chunk grid of one precomputed volume scale (one chunk size, as sharding requires)."""

    size: tuple[int, int, int]
    voxel_offset: tuple[int, int, int]
    chunk_size: tuple[int, int, int]

    @classmethod
    def from_json(cls, scale: Mapping) -> "ScaleGeometry":
        if not isinstance(scale, Mapping):
            raise ValueError("scale must be a JSON object")
        size = _int_list(scale, "size")
        offset = _int_list(scale, "voxel_offset", [0, 0, 0])
        sizes = scale.get("chunk_sizes")
        if not isinstance(sizes, list) or len(sizes) != 1:
            raise ValueError(f"scale 'chunk_sizes' must hold exactly one chunk size, got {sizes!r}")
        chunk = _int_list({"chunk_sizes": sizes[0]}, "chunk_sizes")
        if any(s < 0 for s in size) or any(c <= 0 for c in chunk):
            raise ValueError(f"scale size {size} / chunk size {chunk} invalid")
        return cls(size, offset, chunk)

    @cached_property
    def grid_shape(self) -> tuple[int, int, int]:
        return tuple(-(-s // c) for s, c in zip(self.size, self.chunk_size))  # type: ignore[return-value]

    @cached_property
    def num_chunks(self) -> int:
        g = self.grid_shape
        return g[0] * g[1] * g[2]

    def chunk_bounds(self, grid_pos) -> tuple[tuple[int, ...], tuple[int, ...]]:
        pos = _check_pos(grid_pos, self.grid_shape)
        begin = tuple(o + p * c for o, p, c in zip(self.voxel_offset, pos, self.chunk_size))
        end = tuple(o + min((p + 1) * c, s) for o, p, c, s in zip(self.voxel_offset, pos, self.chunk_size, self.size))
        return begin, end

    def chunk_name(self, grid_pos) -> str:
        b, e = self.chunk_bounds(grid_pos)
        return f"{b[0]}-{e[0]}_{b[1]}-{e[1]}_{b[2]}-{e[2]}"

    def parse_chunk_name(self, name: str) -> tuple[int, int, int] | None:
        """Grid position of ``name``, or None unless it is exactly this scale's name for it."""
        if len(name) > 140:  # 6 numbers of <= 20 digits plus signs and separators
            return None
        m = _NAME_RE.fullmatch(name)
        if m is None:
            return None
        pos = []
        for d in range(3):
            q, r = divmod(int(m.group(2 * d + 1)) - self.voxel_offset[d], self.chunk_size[d])
            if r or not 0 <= q < self.grid_shape[d]:
                return None
            pos.append(q)
        return tuple(pos) if self.chunk_name(pos) == name else None  # type: ignore[return-value]

    def chunk_id(self, grid_pos) -> int:
        return compressed_morton_code(grid_pos, self.grid_shape)

    def grid_pos(self, chunk_id: int) -> tuple[int, ...]:
        return morton_decode(chunk_id, self.grid_shape)


def _geometry(scale: "ScaleGeometry | Mapping") -> ScaleGeometry:
    return scale if isinstance(scale, ScaleGeometry) else ScaleGeometry.from_json(scale)


def chunk_name(grid_pos, scale: "ScaleGeometry | Mapping") -> str:
    """``<x0>-<x1>_<y0>-<y1>_<z0>-<z1>``: voxel_offset included, upper bounds clipped."""
    return _geometry(scale).chunk_name(grid_pos)


def parse_chunk_name(name: str, scale: "ScaleGeometry | Mapping") -> tuple[int, int, int] | None:
    return _geometry(scale).parse_chunk_name(name)


# --------------------------------------------------------------------------
# Multi-resolution mesh manifests (neuroglancer_multilod_draco)
# --------------------------------------------------------------------------


def multilod_fragment_data_size(manifest: bytes) -> int:
    """Total bytes of fragment data a decoded multi-resolution mesh manifest describes.

    Layout: chunk_shape 3f, grid_origin 3f, num_lods u32, lod_scales num_lods f,
    vertex_offsets num_lods*3 f, num_fragments_per_lod num_lods u32, then per lod
    fragment_positions 3*n u32 and fragment_offsets n u32 (the fragment *sizes*).
    The manifest must be exactly that long.
    """
    n_bytes = len(manifest)
    if n_bytes < 28:
        raise FormatError(f"mesh manifest of {n_bytes} bytes is shorter than its header")
    (num_lods,) = struct.unpack_from("<I", manifest, 24)
    head = 28 + 20 * num_lods
    if head > n_bytes:
        raise FormatError(f"mesh manifest too short for {num_lods} levels of detail")
    per_lod = np.frombuffer(manifest, dtype="<u4", count=num_lods, offset=28 + 16 * num_lods).astype(np.int64)
    if head + 16 * int(per_lod.sum()) != n_bytes:
        raise FormatError(
            f"mesh manifest is {n_bytes} bytes, expected {head + 16 * int(per_lod.sum())} for {per_lod.tolist()} fragments"
        )
    total = 0
    pos = head
    for n in per_lod.tolist():
        sizes = np.frombuffer(manifest, dtype="<u4", count=n, offset=pos + 12 * n)
        total += int(sizes.sum(dtype=np.uint64))
        pos += 16 * n
    return total


def multilod_fragment_data_range(manifest_offset: int, manifest: bytes, spec: ShardingSpec | None = None) -> tuple[int, int]:
    """Byte range in the shard of a sharded mesh's fragment data, which ends where its manifest starts."""
    size = multilod_fragment_data_size(manifest)
    start = manifest_offset - size
    floor = spec.shard_index_size if spec is not None else 0
    if start < floor:
        raise FormatError(f"mesh fragment data of {size} bytes would start before the shard data at {floor}")
    return start, manifest_offset
