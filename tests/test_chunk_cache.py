"""The chunk cache's budget with chunks cached as views of read-ahead GETs
(shards.Shared): the memory its values really hold, buffers included, never
exceeds ``chunk_cache``, and read-ahead's chunks are not copies."""

from __future__ import annotations

import random

import trio

from zshardfs.backends.base import AsyncStore
from zshardfs.backends.local import LocalBackend
from zshardfs.layouts.zarr_common import ZarrShardFormat
from zshardfs.shards import ByteLRU, ShardCache


def held(lru: ByteLRU) -> int:
    """Bytes the cache's values hold as ByteLRU should count them: each
    entry's declared size, and each buffer its views keep alive once."""
    total, buffers = 0, {}
    for value, nbytes, *_ in lru._d.values():
        total += nbytes
        if isinstance(value, memoryview):
            buffers[id(value.obj)] = len(value.obj)
    return total + sum(buffers.values())


def check(lru: ByteLRU) -> None:
    assert held(lru) <= lru.max_bytes, (held(lru), lru.max_bytes)
    assert lru.bytes == held(lru)
    live: dict[int, list] = {}
    for value, *_ in lru._d.values():
        if isinstance(value, memoryview):
            live.setdefault(id(value.obj), [len(value.obj), 0])[1] += len(value)
    for size, used in live.values():  # (the rest copied out: no buffer kept for a few chunks)
        assert 2 * used >= size, (used, size)


def test_views_are_counted_with_their_buffer_within_the_budget():
    from zshardfs.shards import Shared

    rnd = random.Random(5)
    lru = ByteLRU(64 << 10)
    keys = []
    for step in range(3000):
        op = rnd.random()
        if op < 0.3:  # a GET's bytes, cut into views
            n = rnd.randint(1, 8)
            size = rnd.randint(1, 2 << 10)
            buf = bytes(rnd.getrandbits(8) for _ in range(8)) * (n * size // 8 + 1)
            shared, whole = Shared(len(buf)), memoryview(buf)
            for i in range(n):
                key = ("v", step, i)
                lru.put(key, whole[i * size: (i + 1) * size], 100, shared)
                keys.append(key)
        elif op < 0.5:
            key = ("b", step)
            lru.put(key, bytes(rnd.randint(0, 4 << 10)), 0)
            lru.put(key, b"x" * rnd.randint(0, 4 << 10), 100)  # (again: replaces it)
            keys.append(key)
        elif op < 0.7 and keys:
            lru.demote(rnd.choice(keys))
        elif op < 0.85 and keys:
            lru.pop(rnd.choice(keys))
        elif keys:
            key = rnd.choice(keys)
            value = lru.get(key)
            assert value is None or len(value) >= 0
        check(lru)
    assert any(isinstance(v, memoryview) for v, _, _ in lru._d.values())


def test_a_buffer_goes_with_its_last_view_or_is_copied_out():
    from zshardfs.shards import Shared

    lru = ByteLRU(10_000)
    buf = bytes(range(100)) * 40  # 4000 bytes
    shared, whole = Shared(len(buf)), memoryview(buf)
    for i in range(4):
        lru.put(i, whole[i * 1000: (i + 1) * 1000], 10, shared)
    assert lru.bytes == 4000 + 40
    lru.pop(0)
    assert lru.bytes == 4000 + 30 and isinstance(lru.peek(1), memoryview)
    lru.pop(1)  # half left: still shared
    assert lru.bytes == 4000 + 20
    lru.pop(2)  # a quarter left: copied out, the buffer let go of
    assert lru.peek(3) == buf[3000:] and isinstance(lru.peek(3), bytes)
    assert lru.bytes == 1000 + 10
    check(lru)
    lru.pop(3)
    assert lru.bytes == 0


def test_read_ahead_caches_views_within_the_chunk_cache(tmp_path):
    """A walk through shards reads them ahead; the chunks it caches are
    views of each GET's bytes (no copy of every byte a scan reads), and the
    cache, those buffers counted, stays within its budget at every step."""
    fmt = ZarrShardFormat()
    n, size, shards = 8, 4 << 10, 6
    budget = 100 << 10
    data = {(s, i): bytes([s * n + i]) * size for s in range(shards) for i in range(n)}
    for s in range(shards):
        (tmp_path / f"s{s}").write_bytes(fmt.encode({i: data[s, i] for i in range(n)}, (n,)))
    store = AsyncStore(LocalBackend(str(tmp_path)), timeout=30)
    cache = ShardCache(store, chunk_cache_bytes=budget, prefetch=True)
    shared_seen = False

    async def main():
        nonlocal shared_seen
        for s in range(shards):
            for i in range(n):
                assert bytes(await cache.read_chunk(fmt, f"s{s}", i, (n,))) == data[s, i]
                check(cache.chunks)
                shared_seen = shared_seen or any(isinstance(v, memoryview) for v, *_ in cache.chunks._d.values())

    trio.run(main)
    assert cache.prefetches >= shards
    assert shared_seen, "read-ahead copied its chunks out of each GET"
