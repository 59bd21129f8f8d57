#!/usr/bin/env bash
# Set up (if needed), write a small sharded sample store and mount it
# read-only so you can browse its unsharded view.
#
#   scripts/try.sh [DIR]     (DIR: default sample, in the repository)
#
# DIR/store gets the sharded store, DIR/mnt its view, DIR/zshardfs.log the
# daemon's log. Unmount with: .venv/bin/zshardfs umount DIR/mnt
set -euo pipefail
DIR=sample
if [ $# -gt 0 ]; then DIR=$(realpath -m -- "$1"); fi  # (a path given is taken from where you are)
cd "$(dirname "$0")/.."
case "$DIR" in *,*) echo "try.sh: '$DIR' has a comma, which -o log_file= cannot take" >&2; exit 2;; esac
scripts/setup.sh
mkdir -p "$DIR/mnt"
.venv/bin/python scripts/make_sample.py "$DIR/store"
if mountpoint -q "$DIR/mnt"; then .venv/bin/zshardfs umount "$DIR/mnt"; fi
# (a log file of its own: without one a background daemon logs to syslog, or
# nowhere on a machine without a syslog socket, as containers often are)
.venv/bin/zshardfs mount "$DIR/store" "$DIR/mnt" -o "ro,log_file=$DIR/zshardfs.log"
cat <<MSG

Mounted $DIR/store (sharded) at $DIR/mnt (its unsharded view). From $PWD, try:
  find $DIR/mnt | head                    # one plain file per inner chunk
  cat $DIR/mnt/image/zarr.json            # metadata rewritten: inner chunks, inner codecs
  ls $DIR/store/image/c/0/0               # ...while the store holds shards
  .venv/bin/python -c "import zarr; print(zarr.open_array('$DIR/mnt/labels')[95:105, 595:605])"
  .venv/bin/zshardfs stats $DIR/mnt       # request and cache counters
  .venv/bin/zshardfs fsck $DIR/store      # check a store (indexes, metadata) without mounting it
  cat $DIR/zshardfs.log                   # the daemon's log (one line per problem)
  .venv/bin/zshardfs umount $DIR/mnt
MSG
