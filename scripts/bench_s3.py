"""S3 read benchmark: zshardfs over S3 against zarr-python reading the same
sharded array directly from the same server.

    .venv/bin/python scripts/bench_s3.py [--repeat 3] [--random 100] [--latency MS] [--workdir DIR]

Starts its own moto server on 127.0.0.1 (tests/s3server.py), writes a Zarr v3
array with zarr-python (uint8, shape 512x512x256, inner chunks 32^3 = 32 KiB
uncompressed, shards 128^3 = 64 chunks = 2 MiB: 2048 chunks in 32 shards) and
uploads it.  Then, --repeat times (medians are printed):

1. full scan of the view on a fresh mount (cold caches):
   ``find MNT -type f -print0 | xargs -0 cat`` (one reader), and the same
   with ``xargs -P 8`` (eight readers), and zarr-python reading the view
   (the unsharded array) through the mount as a local store; and a second scan of one mount after
   the kernel dropped its pages (``posix_fadvise(DONTNEED)`` of every file), which the daemon's chunk
   cache answers as far as it holds the store, and a third with the kernel's
   caches warm (the floor of a scan through FUSE on this machine);
   zarr-python: ``zarr.open_array(...)[:]`` straight from S3, the open
   timed too (zarr.storage.ObjectStore over obstore's S3Store);
2. random single-chunk reads (--random of them, same picks for both):
   a fresh mount reading chunk files one after another; zarr-python reading
   ``arr[chunk]`` one after another.

--latency MS (default 0): both sides, zshardfs and zarr-python, reach the
server through a TCP proxy (tests/s3server.py's TcpProxy) that waits MS
milliseconds before forwarding each HTTP request: one-way latency added per
request, as to a distant S3 region (connection set-up is not delayed).  On
loopback moto a request costs almost nothing; with latency the wall times
show what request counts and overlapping requests cost against real S3.  The
proxy's copying costs some CPU on both sides.

Reported per case: GET requests per shard (scan) or per read (random),
counted by the *server* (its access log); bytes the server sent (response
bytes through a counting TCP proxy, one extra untimed pass per case, with the
same --latency, HTTP headers included); wall time.  zshardfs' own counters
are shown beside the server's for the scans.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.s3server import (  # noqa: E402
    DUMMY_ACCESS_KEY, DUMMY_REGION, DUMMY_SECRET_KEY, MotoServer, TcpProxy, set_dummy_credentials,
)

ZSHARDFS = [sys.executable, "-m", "zshardfs.cli"]
SHAPE, CHUNK, SHARD = (512, 512, 256), (32, 32, 32), (128, 128, 128)
BUCKET, PREFIX = "zshardfs-bench", "data"


# --------------------------------------------------------------------------
# set-up


def build(workdir: Path) -> Path:
    import zarr

    src = workdir / "src"
    if not (src / "arr" / "zarr.json").exists():
        shutil.rmtree(src, ignore_errors=True)
        data = np.random.default_rng(0).integers(0, 256, size=SHAPE, dtype=np.uint8)
        zarr.create_array(src / "arr", shape=SHAPE, dtype="uint8", chunks=CHUNK, shards=SHARD,
                          compressors=None, fill_value=0)[:] = data
    return src


def upload(server: MotoServer, src: Path) -> dict[str, int]:
    """Object key -> size."""
    server.create_bucket(BUCKET)
    items = {f"{PREFIX}/{p.relative_to(src)}": p.read_bytes() for p in src.rglob("*") if p.is_file()}
    server.put_many(BUCKET, items)
    return {k: len(v) for k, v in items.items()}


# --------------------------------------------------------------------------
# zshardfs


class Mount:
    def __init__(self, workdir: Path, endpoint: str, opts: str = ""):
        self.path = workdir / "mnt"
        self.path.mkdir(exist_ok=True)
        log = workdir / "daemon.log"
        subprocess.run([*ZSHARDFS, "mount", f"s3://{BUCKET}/{PREFIX}", str(self.path), "-o",
                        f"ro,log_file={log}{opts}", "--endpoint-url", endpoint], check=True)

    def stats(self) -> dict:
        out = subprocess.run([*ZSHARDFS, "stats", "--json", str(self.path)], capture_output=True, text=True, check=True)
        return json.loads(out.stdout)

    def close(self) -> None:
        subprocess.run([*ZSHARDFS, "umount", str(self.path)], check=True)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def cat_all(root: Path, parallel: int = 1) -> int:
    find = subprocess.Popen(["find", str(root), "-type", "f", "-print0"], stdout=subprocess.PIPE)
    xargs = ["xargs", "-0"] + (["-P", str(parallel), "-n", "32"] if parallel > 1 else []) + ["cat"]
    out = subprocess.run(xargs, stdin=find.stdout, stdout=subprocess.PIPE, check=True)
    find.wait()
    return len(out.stdout)


def fuse_scan(workdir: Path, endpoint: str, parallel: int, reader: str = "cat") -> dict:
    """``reader``: "cat" (``find | xargs cat``, ``parallel`` readers), or
    "zarr": zarr-python opening the view (the unsharded array) as a local
    store and reading all of it, as a tool that reads chunk files does."""
    with Mount(workdir, endpoint) as m:
        before = m.stats()
        t0 = time.perf_counter()
        if reader == "zarr":
            import zarr

            data = zarr.open_array(str(m.path / "arr"), mode="r")[:]
            nbytes = data.nbytes
        else:
            nbytes = cat_all(m.path / "arr", parallel)
        wall = time.perf_counter() - t0
        after = m.stats()
    if reader == "zarr":
        assert nbytes == np.prod(SHAPE), nbytes
    else:
        assert 0 < nbytes - np.prod(SHAPE) < 4096, nbytes  # every chunk, and the view's zarr.json
    d = {k: after["requests"][k] - before["requests"][k] for k in after["requests"]}
    return {"wall": wall, "client_gets": d["get"] + d["get_range"],
            "index_reads": after["index_cache"]["misses"] - before["index_cache"]["misses"],
            "client_bytes": after["bytes"]["read"] - before["bytes"]["read"], "lists": d["list"], "heads": d["head"]}


def drop_pages(root: Path) -> None:
    """The kernel drops its pages of every file below ``root`` (it keeps the inodes)."""
    for p in root.rglob("*"):
        if p.is_file():
            fd = os.open(p, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def fuse_rescan(server: MotoServer, workdir: Path, endpoint: str) -> dict:
    """A scan, then the kernel drops its pages of the view
    (``posix_fadvise(DONTNEED)`` of every file: not the whole machine's
    caches, as ``drop_caches`` would, which other work here shares), then the
    same scan again, timed and counted: the daemon's chunk cache (the default
    64 MiB, the store's size) answers what it can.  Long TTLs, so that the
    second pass re-validates nothing."""
    with Mount(workdir, endpoint, ",index_ttl=600,metadata_ttl=600,attr_timeout=600") as m:
        cat_all(m.path / "arr")
        drop_pages(m.path / "arr")
        mark = server.mark()
        t0 = time.perf_counter()
        cat_all(m.path / "arr")
        wall = time.perf_counter() - t0
        per_shard, _ = server_gets(server, mark)
        # and once more with the kernel's caches warm: no storage, little
        # daemon work; what a scan through FUSE costs on this machine at best
        t0 = time.perf_counter()
        cat_all(m.path / "arr")
        warm = time.perf_counter() - t0
    return {"wall": wall, "rescan_gets": sum(per_shard.values()), "warm": warm}


def fuse_random(workdir: Path, endpoint: str, picks) -> dict:
    with Mount(workdir, endpoint) as m:
        root = m.path / "arr"
        (root / "zarr.json").read_bytes()
        t0 = time.perf_counter()
        for p in picks:
            with open(root / "c" / "/".join(map(str, p)), "rb") as f:
                assert len(f.read()) == np.prod(CHUNK)
        wall = time.perf_counter() - t0
    return {"wall": wall}


# --------------------------------------------------------------------------
# zarr-python, straight from S3


def zarr_array(endpoint: str):
    import zarr
    from obstore.store import S3Store
    from zarr.storage import ObjectStore

    store = S3Store(BUCKET, prefix=PREFIX, endpoint=endpoint, region=DUMMY_REGION, access_key_id=DUMMY_ACCESS_KEY,
                    secret_access_key=DUMMY_SECRET_KEY, client_options={"allow_http": True},
                    virtual_hosted_style_request=False)
    return zarr.open_array(ObjectStore(store, read_only=True), path="arr", mode="r")


def zarr_scan(endpoint: str) -> dict:
    """Opening the array is timed too: the mount's scan starts from nothing
    either (its walk reads ``zarr.json`` and lists the store)."""
    t0 = time.perf_counter()
    data = zarr_array(endpoint)[:]
    wall = time.perf_counter() - t0
    assert data.shape == SHAPE
    return {"wall": wall}


def zarr_random(endpoint: str, picks) -> dict:
    arr = zarr_array(endpoint)
    t0 = time.perf_counter()
    for p in picks:
        arr[tuple(slice(i * c, (i + 1) * c) for i, c in zip(p, CHUNK))]
    return {"wall": time.perf_counter() - t0}


# --------------------------------------------------------------------------
# accounting by the server


def server_gets(server: MotoServer, since: int) -> tuple[Counter, int]:
    """(GETs per shard key, other requests) the server logged since a mark."""
    per_shard, other = Counter(), 0
    for r in server.requests(since):
        if r.method == "GET" and "/arr/c/" in r.route:
            per_shard[r.route] += 1
        elif not r.route.startswith("/moto-api"):
            other += 1
    return per_shard, other


def measure(server: MotoServer, fn, *args) -> dict:
    mark = server.mark()
    out = fn(*args)
    per_shard, other = server_gets(server, mark)
    out.update(server_gets=sum(per_shard.values()), shards_read=len(per_shard), other_requests=other)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--random", type=int, default=100, help="random single-chunk reads per run")
    ap.add_argument("--parallel", type=int, default=8, help="readers of the parallel scan")
    ap.add_argument("--latency", type=float, default=0.0, metavar="MS",
                    help="milliseconds added before each S3 request, both sides (default 0: none)")
    ap.add_argument("--workdir", default=None, help="default: a temporary directory")
    args = ap.parse_args()

    set_dummy_credentials()
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="zshardfs-bench-s3-"))
    workdir.mkdir(parents=True, exist_ok=True)
    src = build(workdir)
    server = MotoServer(workdir / "moto-access.log")
    server.start()
    delay = args.latency / 1000
    slow = TcpProxy(server.port, delay=delay) if delay > 0 else None
    try:
        sizes = upload(server, src)
        shards = [k for k in sizes if "/arr/c/" in k]
        n_chunks = int(np.prod([s // c for s, c in zip(SHAPE, CHUNK)]))
        url = slow.endpoint_url if slow else server.endpoint_url
        print(f"array: {SHAPE} uint8, {n_chunks} chunks of {np.prod(CHUNK) >> 10} KiB in {len(shards)} shards of "
              f"{sizes[shards[0]] / 2**20:.1f} MiB; moto {server.endpoint_url}, added latency {args.latency:g} ms "
              f"per request{f' (proxy {url})' if slow else ''}; workdir {workdir}")
        grid = [s // c for s, c in zip(SHAPE, CHUNK)]
        rnd = random.Random(1)
        runs: dict[str, list[dict]] = {k: [] for k in ("fuse", "fuse_par", "fuse_zarr", "zarr", "fuse_rand",
                                                       "zarr_rand", "rescan")}
        for i in range(args.repeat):
            picks = [tuple(rnd.randrange(g) for g in grid) for _ in range(args.random)]
            runs["fuse"].append(measure(server, fuse_scan, workdir, url, 1))
            runs["fuse_par"].append(measure(server, fuse_scan, workdir, url, args.parallel))
            runs["fuse_zarr"].append(measure(server, fuse_scan, workdir, url, 1, "zarr"))
            runs["zarr"].append(measure(server, zarr_scan, url))
            runs["fuse_rand"].append(measure(server, fuse_random, workdir, url, picks))
            runs["zarr_rand"].append(measure(server, zarr_random, url, picks))
            runs["rescan"].append(fuse_rescan(server, workdir, url))
            print(f"  run {i + 1}: scan zshardfs {runs['fuse'][-1]['wall']:.2f}s "
                  f"(x{args.parallel}: {runs['fuse_par'][-1]['wall']:.2f}s, zarr-python through it: "
                  f"{runs['fuse_zarr'][-1]['wall']:.2f}s), zarr-python {runs['zarr'][-1]['wall']:.2f}s; "
                  f"random zshardfs {runs['fuse_rand'][-1]['wall']:.2f}s, zarr-python {runs['zarr_rand'][-1]['wall']:.2f}s")

        # bytes on the wire: one more pass of each case through a counting proxy
        picks = [tuple(rnd.randrange(g) for g in grid) for _ in range(args.random)]
        wire = {}
        for name, fn, extra in (("fuse", fuse_scan, (workdir,)), ("zarr", zarr_scan, ()),
                                ("fuse_rand", fuse_random, (workdir,)), ("zarr_rand", zarr_random, ())):
            proxy = TcpProxy(server.port, delay=delay)
            try:
                if name == "fuse":
                    fn(workdir, proxy.endpoint_url, 1)
                elif name == "fuse_rand":
                    fn(workdir, proxy.endpoint_url, picks)
                elif name == "zarr":
                    fn(proxy.endpoint_url)
                else:
                    fn(proxy.endpoint_url, picks)
            finally:
                proxy.close()
            wire[name] = proxy.bytes
    finally:
        if slow:
            slow.close()
        server.stop()

    med = lambda rs, k: statistics.median(r[k] for r in rs)  # noqa: E731
    n = len(shards)
    total = sum(sizes[k] for k in shards)
    print(f"\nfull scan, median of {args.repeat} runs (fresh mount / fresh store each run); "
          f"{total / 2**20:.1f} MiB of shards")
    print(f"  {'':34} {'GETs/shard':>10} {'(data+index)':>13} {'MiB sent':>9} {'wall s':>7} {'MiB/s':>7}")
    for name, label in (("fuse", "zshardfs, find | xargs cat"),
                        ("fuse_par", f"zshardfs, xargs -P {args.parallel} cat"),
                        ("fuse_zarr", "zshardfs, zarr-python arr[:] of view"),
                        ("zarr", "zarr-python open + arr[:]")):
        rs = runs[name]
        per = med(rs, "server_gets") / n
        split = ""
        if "index_reads" in rs[0]:
            idx = med(rs, "index_reads")
            split = f"({(med(rs, 'server_gets') - idx) / n:.2f}+{idx / n:.2f})"
        sent = f"{wire[name] / 2**20:9.1f}" if name in wire else f"{'':>9}"
        print(f"  {label:34} {per:10.2f} {split:>13} {sent} {med(rs, 'wall'):7.2f} {total / 2**20 / med(rs, 'wall'):7.0f}")
    f = runs["fuse"]
    print(f"  zshardfs' own counters (median): {med(f, 'client_gets'):.0f} GETs, {med(f, 'lists'):.0f} LISTs, "
          f"{med(f, 'heads'):.0f} HEADs, {med(f, 'client_bytes') / 2**20:.1f} MiB read; "
          f"server saw {med(f, 'server_gets'):.0f} GETs of shards + {med(f, 'other_requests'):.0f} other requests")

    rs = runs["rescan"]
    print(f"  second scan of one mount after the kernel dropped its pages: {med(rs, 'rescan_gets') / n:.2f} data "
          f"GETs/shard, {med(rs, 'wall'):.2f} s (the daemon's 64 MiB chunk cache answers what it holds)")
    print(f"  a third scan, kernel caches warm (no storage; the floor of a scan through FUSE here): "
          f"{med(rs, 'warm'):.2f} s")

    k = args.random
    print(f"\n{k} random single-chunk reads, one after another, median of {args.repeat} runs (fresh mount each)")
    print(f"  {'':34} {'GETs/read':>10} {'MiB sent':>9} {'wall s':>7} {'ms/read':>8}")
    for name, label in (("fuse_rand", "zshardfs (cat a chunk file)"), ("zarr_rand", "zarr-python arr[chunk]")):
        rs = runs[name]
        print(f"  {label:34} {med(rs, 'server_gets') / k:10.2f} {wire[name] / 2**20:9.2f} {med(rs, 'wall'):7.2f} "
              f"{1000 * med(rs, 'wall') / k:8.1f}")
    print(f"  (shards touched per run: {med(runs['fuse_rand'], 'shards_read'):.0f}: zshardfs reads each index once, "
          f"zarr-python reads the index with every chunk)")


if __name__ == "__main__":
    main()
