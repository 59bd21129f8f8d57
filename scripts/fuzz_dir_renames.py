#!/usr/bin/env python3
"""Random directory renames (and chunk writes, reads, listings) through a
local mount, against a twin: a plain directory holding the unsharded view,
to which every rename the mount accepted is applied too.  After every step
the mount's tree equals the twin's; at the end, after a remount, too, and
the stored arrays are still sharded.  (SEMANTICS 4.18.)

    .venv/bin/python scripts/fuzz_dir_renames.py --seeds 1-5 --steps 150
"""

from __future__ import annotations

import argparse
import errno
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import zarr

ZSHARDFS = [sys.executable, "-m", "zshardfs.cli"]


def tree(root: Path) -> dict[str, bytes | None]:
    out: dict[str, bytes | None] = {}
    for dirpath, dirs, files in os.walk(root):
        rel = os.path.relpath(dirpath, root)
        for d in dirs:
            out[os.path.normpath(os.path.join(rel, d))] = None
        for f in files:
            out[os.path.normpath(os.path.join(rel, f))] = (Path(dirpath) / f).read_bytes()
    return out


def arrays_in(root: Path) -> list[str]:
    """Directories of arrays (a zarr.json with node_type array) below root."""
    out = []
    for dirpath, _, files in os.walk(root):
        if "zarr.json" in files:
            doc = json.loads((Path(dirpath) / "zarr.json").read_text())
            if doc.get("node_type") == "array":
                out.append(os.path.relpath(dirpath, root))
    return out


def inside_array(rel: str, arrays: list[str]) -> bool:
    return any(rel.startswith(a + "/") for a in arrays)


def run(seed: int, steps: int, base: Path, counts: dict[str, int]) -> int:
    """Failures of one seed; ``counts``: the renames' answers, by errno name."""
    rng = random.Random(seed)
    store, mnt, twin = base / "store", base / "mnt", base / "twin"
    for p in (store, mnt):
        p.mkdir()
    group = {"zarr_format": 3, "node_type": "group", "attributes": {}}
    for g in ("g1", "g1/sub", "g2"):
        (store / g).mkdir(parents=True, exist_ok=True)
        (store / g / "zarr.json").write_text(json.dumps(group))
    (store / "empty").mkdir()
    for i, name in enumerate(("g1/a", "g1/sub/b", "g2/c", "top")):
        a = zarr.create_array(store=str(store / name), shape=(16, 16), chunks=(4, 4), shards=(8, 8), dtype="<i4",
                              fill_value=0)
        a[...] = np.arange(256, dtype="<i4").reshape(16, 16) * (i + 1)
    log = base / "log"

    def mount() -> None:
        subprocess.run([*ZSHARDFS, "mount", str(store), str(mnt), "-o", f"flush_delay=5,log_file={log}"],
                       check=True, capture_output=True, timeout=120)

    def umount() -> None:
        subprocess.run([*ZSHARDFS, "umount", str(mnt)], check=True, capture_output=True, timeout=120)

    mount()
    failures = 0
    try:
        shutil.copytree(mnt, twin)
        for step in range(steps):
            arrays = arrays_in(twin)
            dirs = sorted(p for p, v in tree(twin).items() if v is None)
            x = rng.random()
            if x < 0.55 and dirs:
                outer = [d for d in dirs if not inside_array(d, arrays)]  # (mostly those: 4.18's renames)
                src = rng.choice(outer if outer and rng.random() < 0.85 else dirs)
                parents = [""] + [d for d in dirs if not d.startswith(src + "/") and d != src]
                outer_parents = [p for p in parents if p not in arrays and not inside_array(p, arrays)]
                parent = rng.choice(outer_parents if rng.random() < 0.85 else parents)
                dst = os.path.join(parent, rng.choice(["n1", "n2", "empty", "x"])) if rng.random() < 0.8 \
                    else rng.choice(dirs)
                try:
                    os.rename(mnt / src, mnt / dst)
                    got = "ok"
                except OSError as exc:
                    got = errno.errorcode[exc.errno]
                # the twin: a plain directory store; the mount answers as it does,
                # or EXDEV where 4.18 says (either place inside an array)
                existed = (twin / dst).is_dir()
                try:
                    os.rename(twin / src, twin / dst)
                    twin_got = "ok"
                except OSError as exc:
                    twin_got = errno.errorcode[exc.errno]
                exdev = inside_array(src, arrays) or inside_array(dst, arrays)
                if got != twin_got and not (exdev and got == "EXDEV"):
                    print(f"seed {seed} step {step}: rename {src} -> {dst}: mount {got}, twin {twin_got}")
                    failures += 1
                if got != "ok" and twin_got == "ok":
                    os.rename(twin / dst, twin / src)  # (undone: the mount did not rename)
                    if existed:
                        (twin / dst).mkdir()  # (the empty directory it replaced)
                elif got == "ok" and twin_got != "ok":
                    break
                counts[got] = counts.get(got, 0) + 1
                print(f"  {step}: mv {src} {dst}: {got}") if os.environ.get("VERBOSE") else None
            elif x < 0.8 and arrays:
                arr = rng.choice(arrays)
                i, j = rng.randrange(4), rng.randrange(4)
                data = np.full((4, 4), rng.randrange(1000), "<i4").tobytes()
                for root in (mnt, twin):
                    (root / arr / f"c/{i}").mkdir(exist_ok=True)
                    (root / arr / f"c/{i}/{j}").write_bytes(data)
            elif x < 0.9:
                subprocess.run([*ZSHARDFS, "sync", str(mnt)], check=True, capture_output=True, timeout=120)
            else:
                umount()
                mount()
            a, b = tree(mnt), tree(twin)
            if a != b:
                diff = sorted(set(a) ^ set(b)) + sorted(k for k in set(a) & set(b) if a[k] != b[k])
                print(f"seed {seed} step {step}: trees differ: {diff[:10]}")
                failures += 1
                break
        umount()
        mount()
        if tree(mnt) != tree(twin):
            print(f"seed {seed}: trees differ after a remount")
            failures += 1
        for arr in arrays_in(twin):
            doc = json.loads((store / arr / "zarr.json").read_text())
            if doc["codecs"][0]["name"] != "sharding_indexed":
                print(f"seed {seed}: {arr} stored unsharded")
                failures += 1
    finally:
        subprocess.run([*ZSHARDFS, "umount", str(mnt)], capture_output=True, timeout=120)
    text = log.read_text() if log.exists() else ""
    if "Traceback" in text or " ERROR " in text:
        print(f"seed {seed}: the daemon's log has errors:\n{text[-2000:]}")
        failures += 1
    return failures


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", default="1-3")
    ap.add_argument("--steps", type=int, default=100)
    args = ap.parse_args()
    lo, _, hi = args.seeds.partition("-")
    total = 0
    for seed in range(int(lo), int(hi or lo) + 1):
        counts: dict[str, int] = {}
        with tempfile.TemporaryDirectory(prefix="zshardfs-dirfuzz-") as tmp:
            failures = run(seed, args.steps, Path(tmp), counts)
        print(f"seed {seed}: {'ok' if not failures else f'{failures} failures'}; renames: "
              + ", ".join(f"{k} {v}" for k, v in sorted(counts.items())))
        total += failures
    return 1 if total else 0


if __name__ == "__main__":
    sys.exit(main())
