#!/usr/bin/env bash
# Set up (if needed) and run the whole test suite: real FUSE mounts, a real
# moto S3 server on 127.0.0.1, and the peer libraries as oracles.
# Extra arguments go to pytest (e.g. scripts/test.sh -k precomputed -x).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
exec .venv/bin/python -m pytest -q "$@"
