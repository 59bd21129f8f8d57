#!/usr/bin/env python
"""Long runs of the randomized differential tester (engine: tests/difftest.py).

Why: the suite's own tests check one behaviour each; this applies long random
sequences of file operations (writes, truncates, renames, links, held-open handles,
temporary-then-rename, fsync, sync, remounts, kill -9 of the daemon, on S3 with --faults stretches of network faults,
with --dirmv renames of directories (local: held files or writers below meanwhile); metadata edits,
consolidation and resizes in variable shard grids and hierarchies) to a zshardfs mount
of a sharded store (Zarr: regular and variable shard grids, consolidated hierarchies;
Neuroglancer precomputed: the pc_* layouts, pc_mesh_* with multi-resolution meshes) and to a directory holding its unsharded
twin, and compares them after every step. tests/test_differential.py runs a few fixed seeds;
run more seeds and steps here after changing the write path.

  .venv/bin/python scripts/difftest.py --seed 7 --layout basic --steps 200 [--backend s3 [--faults 3]]
  .venv/bin/python scripts/difftest.py --replay repro.json [--minimize]

With ``-o flush_delay=2,index_cache=1K`` (the smallest index cache) the shard indexes of
these small arrays are evicted all the time, while chunks are written, read, listed and
replaced: the summary then counts the index loads and evictions of the mounts unmounted
(``index_cache``; a daemon killed takes its counts with it).

On a divergence it prints what differed and the op list, saves it as
repro-LAYOUT-BACKEND-SEED.json in --base (which --replay reads: the same ops, no
generator), and with --minimize the smallest subsequence that still diverges.
A run that passes prints PASS and its summary: ops, remounts, kills, stretches of
faults, ops failed under them, race ops (races; race_held: with a descriptor held;
race_watch, race_mover: each kind of observation and of the mover's steps), directory
renames (dirmv: the mount's answers; dirmv_mid: none, hold, conc, kill; dirmv_split: those
whose writers saw the rename between their writes; dirmv_late_tmp: temporaries a writer below
the old name left that the mount may hold or not, taken as it shows them; dirmv_kill: where a
kill -9 during one left the directory). A replay of dirmv ops with writers or a kill (like race ops) may take
another course: their timing is not in the op.
Exit 0: no divergence; 1: a divergence. Ctrl-C, SIGTERM and SIGHUP end a run as a
divergence does: its mounts are taken down and its daemons ended, none left behind.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests import difftest as dt  # noqa: E402


def _on_signal(signum, frame):
    raise SystemExit(128 + signum)  # (unwinds through the run's teardown: its mounts and daemons end)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--layout", default="basic", choices=sorted(dt.LAYOUTS))
    ap.add_argument("--backend", default="local", choices=["local", "s3"])
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("-o", dest="opts", default=",".join(dt.DEFAULT_OPTS), help="mount options; they replace the default (%(default)s), so repeat what you want of it")
    ap.add_argument("--no-kill", action="store_true", help="no kill -9 of the daemon")
    ap.add_argument("--no-conc", action="store_true", help="no concurrent writers")
    ap.add_argument("--faults", type=float, default=0, metavar="W",
                    help="(S3) weight of the op that turns network faults on for a stretch of ops (e.g. 3); "
                         "every op is drawn under them, remounts, document edits, resizes, mesh ops and races too")
    ap.add_argument("--race", type=float, default=0, metavar="W",
                    help="weight of the race op (a file watched while another process changes it; off: 0)")
    ap.add_argument("--dirmv", type=float, default=0, metavar="W",
                    help="(local) weight of the op that renames a directory: a group, an array, a plain or a chunk "
                         "directory, onto a free name, an empty or a full directory, a file, into itself, with "
                         "RENAME_NOREPLACE, a file held open below or writers by path meanwhile (off: 0)")
    ap.add_argument("--other", type=float, default=0, metavar="W",
                    help="weight of the op that plays another client: chunks rewritten or removed through a "
                         "second mount, a shard deleted, an attribute set in a stored zarr.json, also over "
                         "chunks the mount holds unstored (adds -o metadata_ttl=0,index_ttl=0,attr_timeout=0; off: 0)")
    ap.add_argument("--meta", type=float, default=None, metavar="W",
                    help="weight of the metadata document edit (hierarchies, zarr2_consolidated: 6 unless told; with --dirmv, "
                         "e.g. 60 draws the group's document saved every way while a member is renamed away)")
    ap.add_argument("--replay", metavar="FILE", help="replay the ops saved in FILE (layout, backend, opts too)")
    ap.add_argument("--minimize", action="store_true", help="on a divergence, find a minimal op sequence")
    ap.add_argument("--verbose", action="store_true", help="print every op and its result")
    ap.add_argument("--base", default="/tmp/zshardfs-difftest", help="where runs and repro files go")
    ap.add_argument("--keep", action="store_true", help="keep the work directory of a run that passed")
    args = ap.parse_args()
    signal.signal(signal.SIGTERM, _on_signal)
    signal.signal(signal.SIGHUP, _on_signal)
    base = Path(args.base)
    base.mkdir(parents=True, exist_ok=True)
    layout, backend, opts = args.layout, args.backend, [o for o in args.opts.split(",") if o]
    ops, seed = None, args.seed
    if args.replay:
        spec = json.loads(Path(args.replay).read_text())
        ops, seed = spec["ops"], spec.get("seed")
        layout, backend, opts = spec.get("layout", layout), spec.get("backend", backend), spec.get("opts", opts)
    weights = {}
    if args.no_kill:
        weights["kill9"] = 0
    if args.no_conc:
        weights["conc"] = 0
    if args.faults:
        weights["faults"] = args.faults
    if args.race:
        weights["race"] = args.race
    if args.dirmv:
        weights["dirmv"] = args.dirmv
    if args.other:
        weights["other"] = args.other
    if args.meta is not None:
        weights["meta"] = args.meta
    server = None
    if backend == "s3":
        from tests.s3server import MotoServer, set_dummy_credentials
        set_dummy_credentials(os.environ)
        server = MotoServer(base / "moto-access.log")
        server.start()
    try:
        out = dt.run(layout, backend, base=base, seed=seed, steps=args.steps, ops=ops, opts=opts, server=server,
                     weights=weights, verbose=args.verbose)
        if out.ok:
            print("PASS", out.summary(), flush=True)
            if not args.keep:
                shutil.rmtree(out.work, ignore_errors=True)
            return 0
        repro = base / f"repro-{layout}-{backend}-{seed}.json"
        repro.write_text(json.dumps(out.repro(), indent=1))
        print(out.report(repro), flush=True)
        if args.minimize:
            small = dt.minimize(out, base=base, server=server)
            repro = base / f"repro-{layout}-{backend}-{seed}-min.json"
            repro.write_text(json.dumps(small.repro(), indent=1))
            print(f"MINIMAL: {len(small.ops)} ops")
            print(small.report(repro), flush=True)
        return 1
    finally:
        if server:
            server.stop()


if __name__ == "__main__":
    sys.exit(main())
