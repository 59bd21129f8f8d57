"""The benchmark scripts' own machinery (their figures are only as good as it)."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

SCRIPTS = Path(__file__).resolve().parent.parent / "scripts"


def _bench_read():
    spec = importlib.util.spec_from_file_location("bench_read", SCRIPTS / "bench_read.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_pin_keeps_the_files_pages_in_the_page_cache(tmp_path):
    """--pin must lock the page cache's own pages: a locked private copy of
    them (a writable MAP_PRIVATE mapping, whose mlock breaks copy-on-write)
    leaves the file's pages to reclaim, and the mount then reads from disk."""
    path = tmp_path / "shard"
    path.write_bytes(os.urandom(1 << 20))
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        pinned = _bench_read().pin(tmp_path)
        assert pinned
        # what reclaim would do: drop the file's clean, unmapped pages
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        buf = bytearray(1 << 20)
        try:  # fails (EAGAIN, or a short read) for pages not in the page cache
            n = os.preadv(fd, [buf], 0, os.RWF_NOWAIT)
        except BlockingIOError:
            n = 0
        assert n == len(buf), "the file's pages left the page cache although pinned"
    finally:
        os.close(fd)
