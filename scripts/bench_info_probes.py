"""What probes of precomputed ``info`` documents cost with ``-o metadata_ttl=0`` on S3.

    .venv/bin/python scripts/bench_info_probes.py [--scales 400] [--depth 8] [--walks 3] [--tree DIR] [--ttl 0] [--options attr_timeout=0]

Puts into a moto S3 server a precomputed volume ``vol`` whose ``info`` has
--scales sharded scales (keys ``s0``... , about 330 bytes each: 400 scales
are about 130 KiB), one shard object in ``s0``, and beside the scales a
plain tree ``vol/extra`` --depth directories deep, two wide at each level
below the first, with one file in each (as meshes or skeletons kept beside
a volume).  Mounts it read-only with ``-o metadata_ttl=--ttl`` (and --options, such
as ``attr_timeout=0``, with which the kernel looks every component of a
path up again at each access) and runs ``find`` of ``vol/extra`` --walks
times.  Prints per walk: the requests the
server logged (and the ``info`` GETs among them, by status), the daemon's
storage calls (``zshardfs stats --json``) and its CPU time
(/proc/PID/stat, every thread's).  --tree: the checkout whose zshardfs the
daemon runs (default: this one), to compare code trees on the same store.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

SHARDING = {"@type": "neuroglancer_uint64_sharded_v1", "hash": "identity", "preshift_bits": 0,
            "minishard_bits": 0, "shard_bits": 0, "minishard_index_encoding": "raw", "data_encoding": "raw"}


def info(scales: int) -> bytes:
    return json.dumps({
        "@type": "neuroglancer_multiscale_volume", "type": "image", "data_type": "uint8", "num_channels": 1,
        "scales": [{"key": f"s{i}", "size": [64, 64, 64], "chunk_sizes": [[32, 32, 32]], "resolution": [i + 1] * 3,
                    "voxel_offset": [0, 0, 0], "encoding": "raw", "sharding": SHARDING} for i in range(scales)],
    }).encode()


def tree(depth: int) -> dict[str, bytes]:
    """vol/extra/d0/..., two subdirectories per directory below d0, cut to
    ``depth`` levels; one small file in every directory."""
    out, level = {}, ["vol/extra"]
    for d in range(depth):
        level = [f"{p}/d{d}" for p in level] if d == 0 else [f"{p}/d{d}{w}" for p in level for w in "ab"][:8]
        for p in level:
            out[f"{p}/f.txt"] = b"x"
    return out


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--scales", type=int, default=400)
    ap.add_argument("--depth", type=int, default=8)
    ap.add_argument("--walks", type=int, default=3)
    ap.add_argument("--ttl", default="0", help="-o metadata_ttl (default 0)")
    ap.add_argument("--options", default="", help="more -o options, comma-separated")
    ap.add_argument("--tree", default=str(ROOT), help="checkout whose zshardfs the daemon runs")
    args = ap.parse_args()
    from tests.s3server import MotoServer, set_dummy_credentials

    set_dummy_credentials(os.environ)
    env = dict(os.environ, PYTHONPATH=args.tree)
    zshardfs = [sys.executable, "-m", "zshardfs.cli"]
    work = Path(tempfile.mkdtemp(prefix="bench-info-probes-"))
    print(f"work directory {work}")
    mnt = work / "mnt"
    mnt.mkdir()
    server = MotoServer(work / "moto.log")
    server.start()
    try:
        bucket = server.create_bucket("probes")
        doc = info(args.scales)
        server.put_many(bucket, {"vol/info": doc, "vol/s0/0.shard": b"\0" * 16, **tree(args.depth)})
        subprocess.run([*zshardfs, "mount", f"s3://{bucket}", str(mnt), "--endpoint-url", server.endpoint_url,
                        "-o", f"ro,metadata_ttl={args.ttl},log_file={work / 'mount.log'}"
                        + (f",{args.options}" if args.options else "")],
                       check=True, env=env, cwd=args.tree)
        try:
            pid = int(os.getxattr(mnt, "user.zshardfs.pid"))
            print(f"info of {args.scales} scales ({len(doc)} bytes), plain tree {args.depth} deep, "
                  f"metadata_ttl={args.ttl}, daemon from {args.tree}")
            for walk in range(args.walks):
                mark, cpu0 = server.mark(), cpu_seconds(pid)
                stats0 = json.loads(subprocess.run([*zshardfs, "stats", "--json", str(mnt)], capture_output=True,
                                                   text=True, check=True, env=env, cwd=args.tree).stdout)
                t0 = time.perf_counter()
                found = subprocess.run(["find", str(mnt / "vol/extra")], capture_output=True, text=True,
                                       check=True).stdout.split()
                wall = time.perf_counter() - t0
                cpu = cpu_seconds(pid) - cpu0
                stats1 = json.loads(subprocess.run([*zshardfs, "stats", "--json", str(mnt)], capture_output=True,
                                                   text=True, check=True, env=env, cwd=args.tree).stdout)
                reqs = server.requests(since=mark)
                infos = Counter(r.status for r in reqs if r.method == "GET" and r.route.endswith("/info"))
                calls = {k: v - stats0["requests"].get(k, 0) for k, v in stats1["requests"].items()
                         if v != stats0["requests"].get(k, 0)}
                print(f"walk {walk + 1}: {len(found)} paths, {len(reqs)} requests (server log), info GETs "
                      f"{sum(infos.values())} ({', '.join(f'{n} x {s}' for s, n in sorted(infos.items()))}); "
                      f"stats: {calls}; daemon CPU {cpu:.2f} s, wall {wall:.2f} s")
        finally:
            subprocess.run([*zshardfs, "umount", str(mnt)], env=env, cwd=args.tree)
    finally:
        server.stop()


if __name__ == "__main__":
    main()
