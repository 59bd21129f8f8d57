#!/usr/bin/env bash
# Set up everything zshardfs needs on a fresh Debian-like machine:
# FUSE (Debian fuse3, libfuse3-dev; rsync and systemd-container for the tests), a Python 3.12 virtualenv in .venv with
# zshardfs and its test peers, and .venv-zarr2 with zarr-python 2.18 (the
# storage-transformer oracle, which cannot share an environment with zarr 3).
# Idempotent: a second run only checks.
set -euo pipefail
cd "$(dirname "$0")/.."

need_apt=()
command -v fusermount3 >/dev/null 2>&1 || need_apt+=(fuse3)
dpkg -s libfuse3-dev >/dev/null 2>&1 || need_apt+=(libfuse3-dev)
command -v pkg-config >/dev/null 2>&1 || need_apt+=(pkg-config)
command -v rsync >/dev/null 2>&1 || need_apt+=(rsync)  # tests and scripts/bench_copy_s3.py copy with it
# tests/test_systemd_unit.py boots this machine's root with systemd as PID 1 (tests/nspawn.py)
command -v systemd-nspawn >/dev/null 2>&1 || need_apt+=(systemd-container)
if [ ${#need_apt[@]} -gt 0 ]; then
    echo "setup: installing ${need_apt[*]}"
    SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO="sudo"
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${need_apt[@]}" >/dev/null
fi

find_python() {
    for cand in python3.12 "$(command -v pyenv >/dev/null 2>&1 && echo "$(pyenv root)/versions/3.12"*/bin/python3.12)" \
                /root/.pyenv/versions/3.12*/bin/python3.12 /usr/bin/python3.12; do
        [ -n "$cand" ] || continue
        if "$cand" -c 'import sys; assert sys.version_info[:2] == (3, 12)' >/dev/null 2>&1; then
            command -v "$cand" 2>/dev/null || echo "$cand"; return 0
        fi
    done
    return 1
}
# looked for only when an environment is to be built: a user who cannot see
# pyenv's Python can still run scripts/try.sh on a checkout set up by another
PY=""
need_python() {
    [ -n "$PY" ] && return 0
    PY=$(find_python) || { echo "setup: Python 3.12 is needed (zarr-python 3.4, the test oracle, requires it)" >&2; exit 1; }
}

stamp_ok() { [ -f "$1/.stamp" ] && [ "$(cat "$1/.stamp")" = "$2" ]; }
# built for these dependencies, and its python runs and imports what it is for
venv_ok() { stamp_ok "$1" "$deps_hash" && "$1/bin/python" -c "$2" >/dev/null 2>&1; }
deps_hash=$(cat pyproject.toml scripts/setup.sh | sha256sum | cut -c1-16)

if ! venv_ok .venv 'import zshardfs'; then
    need_python
    echo "setup: creating .venv with $PY"
    "$PY" -m venv .venv
    .venv/bin/pip install -q --upgrade pip 2>&1 | grep -v '^WARNING: Location' || true
    .venv/bin/pip install -q -e '.[test]' 2>&1 | grep -v '^WARNING: Location' || true
    .venv/bin/python -c 'import zshardfs, pyfuse3, zarr, tensorstore, moto' 
    echo "$deps_hash" > .venv/.stamp
fi
if ! venv_ok .venv-zarr2 'import zarr'; then
    need_python
    echo "setup: creating .venv-zarr2 (zarr-python 2.18)"
    "$PY" -m venv .venv-zarr2
    .venv-zarr2/bin/pip install -q 'zarr==2.18.7' 'numcodecs<0.16' numpy crc32c pytest 2>&1 | grep -v '^WARNING: Location' || true
    .venv-zarr2/bin/python -c 'import zarr; assert zarr.__version__.startswith("2.18")'
    echo "$deps_hash" > .venv-zarr2/.stamp
fi
echo "setup: ready (.venv: $(.venv/bin/python --version))"
