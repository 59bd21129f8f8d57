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


def test_random_reads_ab_counts_the_requests_libfuse_answers_itself():
    """random_reads_ab.py counted requests from the daemon's ``-o debug``
    trace, which logs only the requests a Python handler answers: the IOCTL
    that Python's ``open()`` sends for every file (``isatty``), answered
    ENOSYS by libfuse and sent again by the kernel at every open, was not in
    the counts.  It now reads them off /dev/fuse (an strace of the daemon):
    each read there is one request, its header's second word the opcode;
    reads of other files are not counted."""
    spec = importlib.util.spec_from_file_location("random_reads_ab", SCRIPTS / "random_reads_ab.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)

    def read(fd: int, length: int, opcode: int, got: int | None = None) -> str:
        head = length.to_bytes(4, "little") + opcode.to_bytes(4, "little")
        return f'1234 read({fd}, "{"".join(f"\\x{b:02x}" for b in head)}"..., 1052672) = {got or length}\n'

    trace = (read(13, 48, 1) + read(13, 48, 14) + read(13, 72, 39) + read(13, 64, 18) + read(13, 48, 1)
             + read(7, 48, 1, got=4096)  # (a file's bytes that happen to start like a header)
             + '1234 read(13, 0x7f00, 1052672) = -1 EAGAIN (Resource temporarily unavailable)\n')
    assert module.fuse_requests(trace) == {"lookup": 2, "open": 1, "ioctl": 1, "release": 1}
