"""Every wait inside one kernel request ends at the request's deadline.

``-o timeout`` is the deadline of one kernel request (SEMANTICS 5.5): its
storage calls share it (test_backends.py, test_s3_mount.py).  These tests
cover the waits between the calls: a request that waits for work another
request (or ``zshardfs sync``) began, which may end after this request's
deadline, and a flush's pause after a lost race.  Each drives the view or
the caches in-process (``daemon.build_view``: the stack a mount uses) over
a local store whose calls are held or slowed, and emulates the kernel
request with ``AsyncStore.request_deadline`` (what ``fuse_ops._translate``
sets).
"""

from __future__ import annotations

import threading

import trio

from zshardfs.backends.base import AsyncStore, PreconditionFailed, StoreError, Unavailable
from zshardfs.backends.local import LocalBackend
from zshardfs.config import MountConfig
from zshardfs.daemon import build_view

#: seconds a request may end after its deadline (trio's scheduling, a
#: loaded CI machine); the waits fixed here overshot it by 0.5 s or more
SLACK = 0.25


def _small_array(root) -> None:
    """arr: 8x8 uint8, shards of 4x4, inner chunks 2x2; shard (0, 0) holds
    its 4 chunks, chunk i filled with bytes i + 1."""
    from tests.handmade_zarr import array_doc, write_array_doc, write_shard

    write_array_doc(root / "arr", array_doc((8, 8), (4, 4), (2, 2)))
    write_shard(root / "arr", (0, 0), (2, 2), {i: bytes([i + 1]) * 4 for i in range(4)})


def _skeletons(root, items: dict[int, bytes]) -> None:
    """A precomputed skeleton directory: one shard of one minishard."""
    import json

    from zshardfs.layouts.precomputed_format import ShardingSpec, encode_shard

    sharding = {"@type": "neuroglancer_uint64_sharded_v1", "preshift_bits": 0, "hash": "identity",
                "minishard_bits": 0, "shard_bits": 0}
    root.mkdir()
    (root / "info").write_text(json.dumps({"@type": "neuroglancer_skeletons", "sharding": sharding}))
    spec = ShardingSpec.from_json(sharding)
    (root / spec.shard_key(0)).write_bytes(encode_shard(items, spec))


class Gated(LocalBackend):
    """A local store whose first call of one kind on one key after
    ``hold(op, key)`` waits for ``go``; ``in_flight`` is set once it waits.
    A call the deadline gives up goes on in its thread: ``go`` ends it."""

    get_nowait = None  # (every read in a worker thread, where it can be held)

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.held: tuple[str, str] | None = None
        self.in_flight = threading.Event()
        self.go = threading.Event()

    async def in_flight_now(self) -> None:
        """Wait until the held call is out."""
        assert await trio.to_thread.run_sync(self.in_flight.wait, 10), self.held

    def hold(self, op: str, key: str) -> None:
        self.held = (op, key)
        self.in_flight.clear()
        self.go.clear()

    def _gate(self, op: str, key: str) -> None:
        if self.held == (op, key) and not self.in_flight.is_set():  # (the first such call only)
            self.in_flight.set()
            self.go.wait(30)

    def get(self, key, *args, **kwargs):
        self._gate("get", key)
        return super().get(key, *args, **kwargs)

    def list(self, prefix, *args, **kwargs):
        self._gate("list", prefix)
        return super().list(prefix, *args, **kwargs)

    def put(self, key, *args, **kwargs):
        self._gate("put", key)
        return super().put(key, *args, **kwargs)


async def _until(predicate, timeout: float = 10.0) -> None:
    """Wait until ``predicate()`` holds (a state other tasks reach)."""
    with trio.fail_after(timeout):
        while not predicate():
            await trio.sleep(0.005)


async def _request(store: AsyncStore, fn, *args):
    """``fn(*args)`` as a kernel request: (seconds it took, its result or
    the StoreError it ended with)."""
    started = trio.current_time()
    with store.request_deadline():
        try:
            out = await fn(*args)
        except StoreError as exc:
            out = exc
    return trio.current_time() - started, out


def test_a_flush_that_lost_a_race_does_not_pause_past_the_deadline(tmp_path, monkeypatch):
    """An fsync whose shard PUT lost a race to another writer pauses before
    merging again (a random backoff of up to 1 s): a pause that would end
    past the request's deadline fails the fsync with EIO at once.  Before,
    the pause was not cut: the fsync slept it out and failed after its
    deadline.  The chunk stays in memory; a later flush stores it."""
    _small_array(tmp_path)
    timeout = 0.5
    lost = []

    class LosesOneRace(LocalBackend):
        def put(self, key, data, **kwargs):
            if key == "arr/c/0/0" and not lost:
                lost.append(key)
                raise PreconditionFailed(f"{key}: replaced meanwhile", key)
            return super().put(key, data, **kwargs)

    backend = LosesOneRace(str(tmp_path))
    view = build_view(MountConfig(source=str(tmp_path), mountpoint=str(tmp_path) + "-mnt", read_only=False,
                                  timeout=timeout), backend)
    monkeypatch.setattr("zshardfs.writeback._backoff", lambda attempt: 2 * timeout)

    async def main():
        h = await view.open(await view.resolve("arr/c/0/1"), write=True, truncate=False)
        await view.write(h, 0, b"NEW!")
        took, out = await _request(view.store, view.fsync, h)
        assert lost and isinstance(out, Unavailable), out
        assert took < timeout + SLACK, took
        assert (await view.read(h, 0, 4)) == b"NEW!"
        await view.fsync(h)  # (no race now: stored)
        await view.release(h)
        check = build_view(MountConfig(source=str(tmp_path), mountpoint=str(tmp_path) + "-mnt2"),
                           LocalBackend(str(tmp_path)))
        for rel, want in (("0/0", b"\x01" * 4), ("0/1", b"NEW!"), ("1/0", b"\x03" * 4), ("1/1", b"\x04" * 4)):
            assert await check.content(await check.resolve(f"arr/c/{rel}")) == want, rel

    trio.run(main)
