"""Precomputed benchmark: the mount against tensorstore reading the shards.

    .venv/bin/python scripts/bench_precomputed.py [--repeat 3] [--random-reads 300] [--no-s3] [--latency MS]

tensorstore writes one sharded uint8 volume (512x512x256 voxels, 32^3
chunks of 32 KiB, raw encoding, murmurhash3, gzip minishard indexes; 2048
chunks in 8 shards).  Each run measures, median over --repeat runs:

1. random single-chunk reads: reading one chunk file through a fresh mount
   vs tensorstore reading the same chunk-aligned box from the sharded volume;
2. a full scan: ``cat`` of every chunk file through a fresh mount vs
   tensorstore reading the whole volume;
3. unless --no-s3: on a mount of a moto S3 copy (through a proxy adding
   --latency ms to every request, as a distant region would), the time of
   ``ls -l`` of the scale directory on a fresh mount (the listing reads the
   shard and minishard indexes), then the same scan, with the server-side
   GET count per shard.  The S3 part runs once (no baseline: tensorstore
   has no S3 driver that talks to moto here).
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import tensorstore as ts

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
ZSHARDFS = [sys.executable, "-m", "zshardfs.cli"]

SIZE, CHUNK = (512, 512, 256), (32, 32, 32)
SHARDING = {"@type": "neuroglancer_uint64_sharded_v1", "hash": "murmurhash3_x86_128", "preshift_bits": 0,
            "minishard_bits": 3, "shard_bits": 3, "minishard_index_encoding": "gzip", "data_encoding": "raw"}


def spec(path: Path, create: bool = False) -> dict:
    s = {"driver": "neuroglancer_precomputed", "kvstore": {"driver": "file", "path": str(path) + "/"}}
    if create:
        s["multiscale_metadata"] = {"type": "image", "data_type": "uint8", "num_channels": 1}
        s["scale_metadata"] = {"key": "s0", "size": list(SIZE), "chunk_size": list(CHUNK), "resolution": [1, 1, 1],
                               "encoding": "raw", "sharding": SHARDING}
    else:
        s["scale_metadata"] = {"key": "s0"}
    return s


def build(work: Path) -> Path:
    vol = work / "vol"
    if not (vol / "info").exists():
        data = np.random.default_rng(0).integers(0, 256, size=SIZE + (1,), dtype=np.uint8)
        ts.open(spec(vol, create=True), create=True).result().write(data).result()
    return vol


def mount(source: str, mnt: Path, *extra: str) -> None:
    mnt.mkdir(parents=True, exist_ok=True)
    subprocess.run([*ZSHARDFS, "mount", source, str(mnt), "-o", f"ro,log_file={mnt.parent / (mnt.name + '.log')}",
                    *extra], check=True)


def umount(mnt: Path) -> None:
    subprocess.run([*ZSHARDFS, "umount", str(mnt)], check=True)


def chunk_name(g) -> str:
    return "_".join(f"{g[d] * CHUNK[d]}-{min((g[d] + 1) * CHUNK[d], SIZE[d])}" for d in range(3))


def cat_all(root: Path) -> float:
    t0 = time.perf_counter()
    find = subprocess.Popen(["find", str(root), "-type", "f", "-print0"], stdout=subprocess.PIPE)
    subprocess.run(["xargs", "-0", "cat"], stdin=find.stdout, stdout=subprocess.DEVNULL, check=True)
    find.wait()
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--random-reads", type=int, default=300)
    ap.add_argument("--no-s3", action="store_true")
    ap.add_argument("--latency", type=float, default=0.0, help="ms added to every S3 request (default 0)")
    ap.add_argument("--workdir", default=os.path.join(tempfile.gettempdir(), "zshardfs-bench-precomputed"))
    args = ap.parse_args()
    work = Path(args.workdir)
    vol = build(work)
    grid = tuple(-(-s // c) for s, c in zip(SIZE, CHUNK))
    n_chunks = grid[0] * grid[1] * grid[2]
    n_shards = len(list(vol.glob("s0/*.shard")))
    print(f"volume {SIZE} uint8, {CHUNK} chunks (32 KiB), {n_chunks} chunks in {n_shards} shards")
    mnt = work / "mnt"  # beside the volume, not inside it (a view may not contain itself)
    rng = random.Random(1)
    med = statistics.median
    rand_mount, rand_ts, scan_mount, scan_ts = [], [], [], []
    for _ in range(args.repeat):
        picks = [tuple(rng.randrange(g) for g in grid) for _ in range(args.random_reads)]
        store = ts.open(spec(vol)).result()
        t0 = time.perf_counter()
        for g in picks:
            store[g[0] * 32:(g[0] + 1) * 32, g[1] * 32:(g[1] + 1) * 32, g[2] * 32:(g[2] + 1) * 32].read().result()
        rand_ts.append(time.perf_counter() - t0)
        mount(str(vol), mnt)
        try:
            t0 = time.perf_counter()
            for g in picks:
                (mnt / "s0" / chunk_name(g)).read_bytes()
            rand_mount.append(time.perf_counter() - t0)
        finally:
            umount(mnt)
        t0 = time.perf_counter()
        ts.open(spec(vol)).result().read().result()
        scan_ts.append(time.perf_counter() - t0)
        mount(str(vol), mnt)
        try:
            scan_mount.append(cat_all(mnt / "s0"))
        finally:
            umount(mnt)
    n = args.random_reads
    print(f"\nrandom single chunks ({n}, median of {args.repeat} runs, fresh mount / fresh tensorstore each)")
    print(f"  tensorstore on the sharded volume   {n / med(rand_ts):8.0f} chunks/s")
    print(f"  read of the chunk file via zshardfs {n / med(rand_mount):8.0f} chunks/s   "
          f"ratio {med(rand_ts) / med(rand_mount):.2f}x")
    print(f"\nfull scan (median of {args.repeat} runs)")
    print(f"  tensorstore reads the whole volume  {n_chunks / med(scan_ts):8.0f} chunks/s")
    print(f"  cat of every chunk file via zshardfs {n_chunks / med(scan_mount):7.0f} chunks/s   "
          f"ratio {med(scan_ts) / med(scan_mount):.2f}x")
    if args.no_s3:
        return
    from tests.s3server import MotoServer, TcpProxy, set_dummy_credentials

    set_dummy_credentials(os.environ)
    server = MotoServer()
    server.start()
    try:
        bucket = server.create_bucket("precomputed-bench")
        for p in vol.rglob("*"):
            if p.is_file():
                server.s3.upload_file(str(p), bucket, f"vol/{p.relative_to(vol)}")
        proxy = TcpProxy(server.port, delay=args.latency / 1000) if args.latency > 0 else None
        endpoint = proxy.endpoint_url if proxy else server.endpoint_url
        mark = server.mark()
        mount(f"s3://{bucket}/vol", mnt, "--endpoint-url", endpoint)
        try:
            t0 = time.perf_counter()
            subprocess.run(["ls", "-l", str(mnt / "s0")], stdout=subprocess.DEVNULL, check=True)
            t_list = time.perf_counter() - t0
        finally:
            umount(mnt)
        gets_listing = [r for r in server.requests(since=mark) if r[0] == "GET" and r[1].endswith(".shard")]
        mark = server.mark()
        mount(f"s3://{bucket}/vol", mnt, "--endpoint-url", endpoint)
        try:
            t = cat_all(mnt / "s0")
        finally:
            umount(mnt)
            if proxy:
                proxy.close()
        gets = [r for r in server.requests(since=mark) if r[0] == "GET" and r[1].endswith(".shard")]
        print(f"\nS3 (moto, +{args.latency:g} ms per request): ls -l of the scale on a fresh mount {t_list:.2f} s, "
              f"{len(gets_listing) / n_shards:.2f} GETs per shard")
        print(f"S3 (moto) scan via zshardfs: {n_chunks / t:.0f} chunks/s, {len(gets)} GETs of shard objects "
              f"for {n_shards} shards = {len(gets) / n_shards:.2f} per shard "
              f"(shard index + minishard indexes + data)")
    finally:
        server.stop()


if __name__ == "__main__":
    main()
