#!/usr/bin/env python3
"""What copying plain files into an S3 mount costs in requests, per tool.

Against a local moto server (started here): ``--files`` files of 5 kB are
copied into a fresh directory of one mount with ``cp -r``, ``rsync -a`` and
``rsync -a --inplace``; the server counts every request.  The baseline,
measured in the same run, is boto3 uploading the same files (one PUT each):
each tool's figure is printed with its ratio to it.

    .venv/bin/python scripts/bench_copy_s3.py [--files 50] [--repeat 3]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.s3server import MotoServer, set_dummy_credentials  # noqa: E402

ZSHARDFS = [sys.executable, "-m", "zshardfs.cli"]
TOOLS = {
    "cp -r": lambda src, dst: ["cp", "-r", str(src), str(dst)],
    "rsync -a": lambda src, dst: ["rsync", "-a", f"{src}/", f"{dst}/"],
    "rsync -a --inplace": lambda src, dst: ["rsync", "-a", "--inplace", f"{src}/", f"{dst}/"],
}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--files", type=int, default=50)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    set_dummy_credentials(os.environ)
    server = MotoServer()
    server.start()
    work = Path(tempfile.mkdtemp(prefix="zshardfs-bench-copy-"))
    src = work / "src"
    src.mkdir()
    for i in range(args.files):
        (src / f"f{i:04d}").write_bytes(os.urandom(5000))
    per_tool: dict[str, list[int]] = {"boto3 upload (baseline)": [], **{t: [] for t in TOOLS}}
    seconds: dict[str, list[float]] = {t: [] for t in per_tool}
    try:
        for run in range(args.repeat):
            bucket = server.create_bucket(f"copy{run}")
            mark, t0 = server.mark(), time.perf_counter()
            for p in sorted(src.iterdir()):
                server.s3.upload_file(str(p), bucket, f"boto3/{p.name}")
            seconds["boto3 upload (baseline)"].append(time.perf_counter() - t0)
            per_tool["boto3 upload (baseline)"].append(len(server.requests(since=mark)))
            mnt = work / "mnt"
            mnt.mkdir(exist_ok=True)
            subprocess.run([*ZSHARDFS, "mount", f"s3://{bucket}/data", str(mnt), "--endpoint-url",
                            server.endpoint_url, "-o", f"log_file={work / 'log'}"], check=True)
            try:
                for name, argv in TOOLS.items():
                    dst = mnt / name.replace(" ", "").replace("-", "")
                    mark, t0 = server.mark(), time.perf_counter()
                    subprocess.run(argv(src, dst), check=True)
                    os.getxattr(mnt, "user.zshardfs.sync")  # (nothing is held back: plain files are stored at close)
                    seconds[name].append(time.perf_counter() - t0)
                    per_tool[name].append(len(server.requests(since=mark)))
                    for p in src.iterdir():
                        if (dst / p.name).read_bytes() != p.read_bytes():
                            raise SystemExit(f"{name}: {p.name} differs")
            finally:
                subprocess.run([*ZSHARDFS, "umount", str(mnt)], check=True)
    finally:
        server.stop()
        shutil.rmtree(work, ignore_errors=True)
    base = statistics.median(per_tool["boto3 upload (baseline)"])
    print(f"{args.files} files of 5 kB into an S3 mount (moto), server-side requests, median of {args.repeat}")
    for name, counts in per_tool.items():
        med = statistics.median(counts)
        print(f"  {name:<24} {med:6.0f} requests ({med / args.files:5.2f} per file, {med / base:5.2f}x the "
              f"baseline)   {statistics.median(seconds[name]):6.2f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
