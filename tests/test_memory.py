"""The daemon's memory over a long life: what it frees goes back to the
system (zshardfs/memtrim.py); the tables' bounds are tested where each table
lives, and scripts/soak_memory.py runs the long mixed workload."""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
import subprocess
import sys

import trio
import trio.testing
import zarr

from zshardfs import memtrim
from zshardfs.memtrim import Trimmer

from .util import wait_for


def test_the_trimmer_gives_memory_back_after_a_drain_and_once_idle():
    """A trim when the write-back set has shrunk by SHRUNK from its peak,
    and one when a busy daemon has been idle for IDLE; none while it is busy
    with nothing drained, nor again while it stays idle."""
    state = {"activity": 0, "dirty": 0}
    calls = []
    clock = trio.testing.MockClock(autojump_threshold=0)
    trimmer = Trimmer(lambda: state["activity"], lambda: state["dirty"],
                      trim=lambda pad: calls.append(clock.current_time()) or 1, in_thread=False)

    async def main():
        async with trio.open_nursery() as nursery:
            nursery.start_soon(trimmer.run)
            await trio.sleep(memtrim.TICK / 2)  # (changes between its looks)
            for _ in range(20):  # busy, dirty data growing: nothing to give back
                state["activity"] += 1
                state["dirty"] += 8 << 20
                await trio.sleep(1)
            assert calls == []
            state["dirty"] = 16 << 20  # stored: 144 MiB freed
            state["activity"] += 1
            await trio.sleep(memtrim.TICK)
            assert len(calls) == 1 and trimmer.trims == 1
            for _ in range(3):
                await trio.sleep(1)
                state["activity"] += 1
            idle_from = trio.current_time()
            await trio.sleep(memtrim.IDLE + memtrim.TICK)
            assert len(calls) == 2 and calls[1] - idle_from >= memtrim.IDLE
            await trio.sleep(60)  # still idle: nothing new to give back
            assert len(calls) == 2
            nursery.cancel_scope.cancel()

    trio.run(main, clock=clock)
    assert calls[1] - calls[0] >= memtrim.MIN_INTERVAL


def test_memory_of_stored_writes_goes_back_to_the_system(tmp_path, mount):
    """128 MiB written through the mount into partial shards (held in memory
    until stored), then stored: glibc kept nearly all of it (RSS 271 MiB after
    256 MiB, 24 MiB of it in use); the daemon now gives it back
    (malloc_trim) once the write-back set has drained."""
    source = tmp_path / "store"
    source.mkdir()
    m = mount(source, "rw", "flush_delay=inf", "shard=4")
    side = 32
    zarr.create_array(str(m / "a"), shape=(16 * side, 16 * side, 16 * side), dtype="uint8",
                      chunks=(side, side, side), compressors=None, fill_value=0)
    chunk = os.urandom(side ** 3)
    # four passes over x, each writing a quarter of every shard's chunks: the
    # shards stay partial (in memory) until the last pass
    for p in range(4):
        if p == 3:
            peak = m.stats()["rss_bytes"]  # (three quarters held: 96 MiB)
            assert m.stats()["writeback"]["dirty_bytes"] >= 96 << 20
        for x in range(p, 16, 4):
            for y in range(16):
                (m / "a" / "c" / str(x) / str(y)).mkdir(parents=True, exist_ok=True)
                for z in range(16):
                    (m / "a" / "c" / str(x) / str(y) / str(z)).write_bytes(chunk)
    subprocess.run([sys.executable, "-m", "zshardfs.cli", "sync", str(m.path)], check=True, timeout=60)
    # (no event to wait for in another process: its RSS, asked until it drops or 15 s pass)
    wait_for(lambda: m.stats()["rss_bytes"] < peak - (48 << 20), timeout=15, interval=0.2)
    stats = m.stats()
    assert stats["rss_bytes"] < peak - (48 << 20), (peak >> 20, stats["rss_bytes"] >> 20, stats.get("malloc_trim"))
    assert stats["malloc_trim"]["calls"] >= 1 and stats["malloc_trim"]["returned_bytes"] >= 48 << 20


def _arenas(pid: int) -> int:
    """glibc arenas of process ``pid`` besides the main one.  Each such arena
    lives in heaps, anonymous mappings aligned to HEAP_MAX_SIZE (64 MiB), and
    one arena grows into a second heap when the first is full (as under a
    burst of writes on a loaded machine), so heaps are not arenas: each heap
    starts with its ``heap_info``, whose first word points to its arena, and
    the arenas are the distinct pointers.  An arena's struct lies in its
    first heap, just after the ``heap_info``: a pointer counts only where it
    points into a heap whose own first word is that pointer, so another
    anonymous mapping that happens to start 64 MiB-aligned (first word 0, or
    anything) is not taken for an arena (CI counted one once: 2 against 1)."""
    heap_size = 64 << 20
    first_words = {}
    with open(f"/proc/{pid}/maps") as maps, open(f"/proc/{pid}/mem", "rb", buffering=0) as mem:
        for line in maps:
            fields = line.split()
            start = int(fields[0].split("-")[0], 16)
            if len(fields) == 5 and fields[1] == "rw-p" and start % heap_size == 0:
                mem.seek(start)
                first_words[start] = int.from_bytes(mem.read(8), sys.byteorder)
    return len({ptr for ptr in first_words.values()
                if first_words.get(ptr - ptr % heap_size) == ptr and 0 < ptr % heap_size < 4096})


def test_the_daemon_keeps_few_malloc_arenas(tmp_path, mount, monkeypatch):
    """Worker threads each got a malloc arena of their own (up to eight per
    core), which trimming leaves fragmented (on S3 a 128 MiB burst stored
    left 146 MiB after the trims against 98 with two arenas): the daemon
    now limits them to memtrim.ARENA_MAX."""
    assert memtrim.ARENA_MAX == 2  # (SEMANTICS 2.3: "at most two malloc arenas")

    def arenas_after_a_burst(name: str, *opts: str) -> int:
        source = tmp_path / name
        source.mkdir()
        m = mount(source, "rw", "max_connections=16", *opts)
        pid = m.stats()["pid"]

        def write(i: int) -> None:
            for k in range(20):
                (m / f"f{i}-{k}.bin").write_bytes(os.urandom(256 << 10))

        with ThreadPoolExecutor(16) as pool:
            list(pool.map(write, range(16)))
        return _arenas(pid)

    assert arenas_after_a_burst("store") <= memtrim.ARENA_MAX - 1
    # glibc's default (one arena per thread, up to eight per core) with malloc_trim=off, and
    # with MALLOC_ARENA_MAX in the daemon's environment, which decides then
    assert arenas_after_a_burst("off", "malloc_trim=off") > memtrim.ARENA_MAX
    monkeypatch.setenv("MALLOC_ARENA_MAX", "4")
    # (4, the main one included: at most 3 others; more than the daemon's own limit
    # leaves, 1; how many of the 3 a burst makes depends on how many worker threads it
    # starts, fewer on a loaded machine)
    assert memtrim.ARENA_MAX - 1 < arenas_after_a_burst("env") <= 3
