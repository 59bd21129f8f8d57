#!/usr/bin/env bash
# Set up (if needed), write a small sharded sample store and mount it
# read-only at sample/mnt so you can browse its unsharded view.
# Unmount with: .venv/bin/zshardfs umount sample/mnt
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
mkdir -p sample/mnt
.venv/bin/python scripts/make_sample.py sample/store
if mountpoint -q sample/mnt; then .venv/bin/zshardfs umount sample/mnt; fi
.venv/bin/zshardfs mount sample/store sample/mnt -o ro
cat <<MSG

Mounted sample/store (sharded) at sample/mnt (its unsharded view). From $PWD, try:
  find sample/mnt | head                    # one plain file per inner chunk
  cat sample/mnt/image/zarr.json            # metadata rewritten: inner chunks, inner codecs
  ls sample/store/image/c/0/0               # ...while the store holds shards
  .venv/bin/python -c "import zarr; print(zarr.open_array('sample/mnt/labels')[95:105, 595:605])"
  .venv/bin/zshardfs stats sample/mnt       # request and cache counters
  .venv/bin/zshardfs fsck sample/store      # check a store (indexes, metadata) without mounting it
  .venv/bin/zshardfs umount sample/mnt
MSG
