#!/bin/bash
# A/B of cold scans across checkouts: fresh `-o ro` mounts of one store, one
# from each checkout in turn (the daemon runs from the checkout's package),
# a cold `find | xargs cat` of each, N rounds alternating; prints each
# checkout's pass times, then their medians.  Uses this checkout's .venv.
#   scripts/cold_ab.sh N STORE TREE...      (e.g. STORE=/tmp/zshardfs-bench-read/sharded,
#                                            made by scripts/bench_read.py)
set -euo pipefail
N=$1; STORE=$2; shift 2
PY="$(cd "$(dirname "$0")/.." && pwd)/.venv/bin/python"
MNT=$(mktemp -d /tmp/zshardfs-cold-ab-XXXXXX)
OUT=$(mktemp)
trap 'fusermount3 -uz "$MNT" 2>/dev/null || true; rmdir "$MNT"; rm -f "$OUT"' EXIT
for _ in $(seq "$N"); do
  for T in "$@"; do
    (cd "$T" && "$PY" -m zshardfs.cli mount "$STORE" "$MNT" -o ro,log_file=/dev/null)
    s=$(date +%s.%N); find "$MNT" -type f -print0 | xargs -0 cat > /dev/null; e=$(date +%s.%N)
    (cd "$T" && "$PY" -m zshardfs.cli umount "$MNT")
    echo "$T $(echo "$e - $s" | bc)" >> "$OUT"
  done
done
"$PY" - "$OUT" <<'PY'
import statistics, sys
times = {}
for line in open(sys.argv[1]):
    tree, t = line.split()
    times.setdefault(tree, []).append(float(t))
for tree, ts in times.items():
    print(f"{tree}: median {statistics.median(ts):.3f} s  min {min(ts):.3f} s  ({' '.join(f'{t:.3f}' for t in ts)})")
PY
