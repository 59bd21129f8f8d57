"""Write benchmark: chunk files through the mount against the alternatives.

    .venv/bin/python scripts/bench_write.py [--chunks 512] [--per-shard 4] [--repeat 3] [--s3]

One array of 32 KiB uncompressed uint8 chunks (``--chunks`` of them), stored
sharded with ``--per-shard``^3 chunks per shard.  Each run measures, writing
every chunk once:

1. native: the unsharded twin written as plain files on the local disk;
2. zarr-python writing the same chunks one ``a[chunk] = data`` call each,
   directly into the sharded array (each call rewrites its shard);
3. zshardfs: every chunk file written through a mount of the sharded
   array (open, write, close), then a sync (the xattr ``zshardfs sync``
   sets) — the time includes storing every shard;
4. with ``--s3``: the same through a mount of a moto S3 bucket (a local
   moto server started here), with the PUT count from the server's log.

Medians over ``--repeat`` runs; ratios are to zarr-python's chunk-wise writes.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
ZSHARDFS = [sys.executable, "-m", "zshardfs.cli"]


def geometry(n_chunks: int) -> tuple[int, int, int]:
    side = max(1, round(n_chunks ** (1 / 3)))
    return (side, side, max(1, n_chunks // (side * side)))


def create_sharded(path: Path, grid, per_shard: int) -> None:
    import zarr

    shape = tuple(g * 32 for g in grid)
    shards = tuple(min(per_shard, g) * 32 for g in grid)
    zarr.create_array(path, shape=shape, chunks=(32, 32, 32), shards=shards, dtype="uint8",
                      compressors=None, fill_value=0)


def chunks(grid, seed=0):
    rng = np.random.default_rng(seed)
    for i in range(grid[0]):
        for j in range(grid[1]):
            for k in range(grid[2]):
                yield (i, j, k), rng.integers(0, 256, size=(32, 32, 32), dtype=np.uint8)


def write_native(root: Path, grid) -> float:
    t0 = time.perf_counter()
    for (i, j, k), data in chunks(grid):
        d = root / "c" / str(i) / str(j)
        d.mkdir(parents=True, exist_ok=True)
        with open(d / str(k), "wb") as f:
            f.write(data.tobytes())
    return time.perf_counter() - t0


def write_zarr_chunkwise(path: Path, grid) -> float:
    import zarr

    a = zarr.open_array(path, mode="r+")
    t0 = time.perf_counter()
    for (i, j, k), data in chunks(grid):
        a[i * 32:(i + 1) * 32, j * 32:(j + 1) * 32, k * 32:(k + 1) * 32] = data
    return time.perf_counter() - t0


def write_zarr_chunkwise_s3(server, bucket: str, prefix: str, grid) -> float:
    """zarr-python writing chunk by chunk straight into the sharded array on
    S3 (ObjectStore over obstore): every call reads and rewrites its shard."""
    import zarr
    from obstore.store import S3Store
    from zarr.storage import ObjectStore

    from tests.s3server import DUMMY_ACCESS_KEY, DUMMY_REGION, DUMMY_SECRET_KEY

    store = S3Store(bucket, prefix=prefix, endpoint=server.endpoint_url, region=DUMMY_REGION,
                    access_key_id=DUMMY_ACCESS_KEY, secret_access_key=DUMMY_SECRET_KEY, client_options={"allow_http": True})
    a = zarr.open_array(ObjectStore(store), path="a", mode="r+")
    t0 = time.perf_counter()
    for (i, j, k), data in chunks(grid):
        a[i * 32:(i + 1) * 32, j * 32:(j + 1) * 32, k * 32:(k + 1) * 32] = data
    return time.perf_counter() - t0


def write_through_mount(source: str, mnt: Path, grid, extra=()) -> tuple[float, dict]:
    mnt.mkdir(parents=True, exist_ok=True)
    subprocess.run([*ZSHARDFS, "mount", source, str(mnt), "-o",
                    f"flush_delay=30,log_file={mnt.parent / (mnt.name + '.log')}", *extra], check=True)
    try:
        t0 = time.perf_counter()
        for (i, j, k), data in chunks(grid):
            d = mnt / "a" / "c" / str(i) / str(j)
            with open(d / str(k), "wb") as f:
                f.write(data.tobytes())
        os.setxattr(mnt, "user.zshardfs.sync", b"1")  # what `zshardfs sync` does, minus its start-up
        elapsed = time.perf_counter() - t0
        stats = json.loads(subprocess.run([*ZSHARDFS, "stats", "--json", str(mnt)], check=True,
                                          capture_output=True, text=True).stdout)
    finally:
        subprocess.run([*ZSHARDFS, "umount", str(mnt)], check=True)
    return elapsed, stats


def verify(path_or_store, grid) -> None:
    import zarr

    a = zarr.open_array(path_or_store, mode="r")
    for (i, j, k), data in chunks(grid):
        got = a[i * 32:(i + 1) * 32, j * 32:(j + 1) * 32, k * 32:(k + 1) * 32]
        if not np.array_equal(got, data):
            raise SystemExit(f"verification failed at chunk {(i, j, k)}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--chunks", type=int, default=512)
    ap.add_argument("--per-shard", type=int, default=4)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--s3", action="store_true")
    args = ap.parse_args()
    grid = geometry(args.chunks)
    n = grid[0] * grid[1] * grid[2]
    n_shards = 1
    for g in grid:
        n_shards *= -(-g // min(args.per_shard, g))
    work = Path(tempfile.mkdtemp(prefix="zshardfs-bench-write-"))
    print(f"{n} chunks of 32 KiB, {n_shards} shards of {min(args.per_shard, grid[0])}^3 chunks; workdir {work}")
    native, zarr_t, mount_t, s3_t, s3_puts, zarr_s3_t, zarr_s3_puts = [], [], [], [], [], [], []
    server = None
    if args.s3:
        from tests.s3server import MotoServer, set_dummy_credentials

        set_dummy_credentials(os.environ)  # the mount's boto3 finds them in its environment
        server = MotoServer()
        server.start()
    try:
        for run in range(args.repeat):
            twin = work / f"twin{run}"
            native.append(write_native(twin, grid))
            zdir = work / f"zarr{run}" / "a"
            create_sharded(zdir, grid, args.per_shard)
            zarr_t.append(write_zarr_chunkwise(zdir, grid))
            store = work / f"mnt-store{run}"
            create_sharded(store / "a", grid, args.per_shard)
            elapsed, stats = write_through_mount(str(store), work / "mnt", grid)
            mount_t.append(elapsed)
            if run == 0:
                verify(store / "a", grid)
                print(f"  local mount: {stats['requests']['put']} shard writes for {n_shards} shards")
            if server is not None:
                bucket = server.create_bucket(f"bench{run}")
                s3 = server.s3
                seed = work / f"s3seed{run}"
                create_sharded(seed / "a", grid, args.per_shard)
                for p in seed.rglob("*"):
                    if p.is_file():
                        s3.upload_file(str(p), bucket, f"data/{p.relative_to(seed)}")
                mark = server.mark()
                elapsed, stats = write_through_mount(f"s3://{bucket}/data", work / "mnt", grid,
                                                     ["--endpoint-url", server.endpoint_url])
                s3_t.append(elapsed)
                s3_puts.append(sum(1 for r in server.requests(since=mark) if r[0] == "PUT"))
                zbucket = server.create_bucket(f"benchzarr{run}")
                for p in seed.rglob("*"):
                    if p.is_file():
                        s3.upload_file(str(p), zbucket, f"data/{p.relative_to(seed)}")
                mark = server.mark()
                zarr_s3_t.append(write_zarr_chunkwise_s3(server, zbucket, "data", grid))
                zarr_s3_puts.append(sum(1 for r in server.requests(since=mark) if r[0] == "PUT"))
            shutil.rmtree(twin, ignore_errors=True)
    finally:
        if server is not None:
            server.stop()
    med = statistics.median
    print(f"\nwriting {n} chunks (median of {args.repeat} runs)")
    print(f"  native unsharded twin (plain files)     {n / med(native):8.0f} chunks/s")
    print(f"  zarr-python, one call per chunk, sharded {n / med(zarr_t):8.0f} chunks/s   (baseline)")
    print(f"  zshardfs local mount + sync              {n / med(mount_t):8.0f} chunks/s   "
          f"{med(zarr_t) / med(mount_t):.1f}x zarr-python")
    if s3_t:
        print("\nS3 (local moto server)")
        print(f"  zarr-python, one call per chunk, sharded {n / med(zarr_s3_t):8.0f} chunks/s   (baseline; "
              f"PUTs {zarr_s3_puts})")
        print(f"  zshardfs S3 mount + sync                 {n / med(s3_t):8.0f} chunks/s   "
              f"{med(zarr_s3_t) / med(s3_t):.1f}x zarr-python; PUTs {s3_puts} for {n_shards} shards")
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
