"""A minimal read-only pyfuse3 file system serving a directory tree from memory.

    python scripts/minimal_fs.py SOURCE MOUNTPOINT

The yardstick for scripts/bench_read.py: it loads every file of SOURCE into
memory at start and answers lookup/getattr/readdir/open/read with no work
beyond dictionary look-ups, so its speed is what pyfuse3 + trio themselves
allow on this machine.  zshardfs cannot be faster than this.  Unmount with
``fusermount3 -u MOUNTPOINT``; it exits then.
"""

from __future__ import annotations

import errno
import os
import stat
import sys

import pyfuse3
import trio


class MemoryFS(pyfuse3.Operations):
    def __init__(self, source: str):
        super().__init__()
        self.paths = {pyfuse3.ROOT_INODE: source}
        self.children: dict[int, dict[bytes, int]] = {}
        self.data: dict[int, bytes] = {}
        self.dirs: set[int] = {pyfuse3.ROOT_INODE}
        self._load(pyfuse3.ROOT_INODE, source)

    def _load(self, ino: int, path: str) -> None:
        kids = self.children[ino] = {}
        for entry in sorted(os.scandir(path), key=lambda e: e.name):
            child = len(self.paths) + 1
            self.paths[child] = entry.path
            kids[os.fsencode(entry.name)] = child
            if entry.is_dir():
                self.dirs.add(child)
                self._load(child, entry.path)
            else:
                with open(entry.path, "rb") as f:
                    self.data[child] = f.read()

    def _attr(self, ino: int) -> pyfuse3.EntryAttributes:
        a = pyfuse3.EntryAttributes()
        a.st_ino = ino
        a.entry_timeout = a.attr_timeout = 5
        if ino in self.dirs:
            a.st_mode, a.st_nlink = stat.S_IFDIR | 0o555, 2
        else:
            a.st_mode, a.st_nlink, a.st_size = stat.S_IFREG | 0o444, 1, len(self.data[ino])
        a.st_blksize = 1 << 17
        return a

    async def lookup(self, parent_inode, name, ctx=None):
        ino = self.children.get(parent_inode, {}).get(name)
        if ino is None:
            raise pyfuse3.FUSEError(errno.ENOENT)
        return self._attr(ino)

    async def getattr(self, inode, ctx=None):
        return self._attr(inode)

    async def opendir(self, inode, ctx):
        return inode

    async def readdir(self, fh, start_id, token):
        items = list(self.children[fh].items())
        for i in range(start_id, len(items)):
            name, ino = items[i]
            if not pyfuse3.readdir_reply(token, name, self._attr(ino), i + 1):
                return

    async def open(self, inode, flags, ctx):
        return pyfuse3.FileInfo(fh=inode, keep_cache=True)

    async def read(self, fh, off, size):
        return self.data[fh][off: off + size]

    async def flush(self, fh):
        raise pyfuse3.FUSEError(errno.ENOSYS)


def main() -> None:
    source, mountpoint = sys.argv[1], sys.argv[2]
    fs = MemoryFS(source)
    pyfuse3.init(fs, mountpoint, {"ro", "fsname=minimalfs", "default_permissions"})
    print("ready", flush=True)
    try:
        trio.run(pyfuse3.main)
    finally:
        pyfuse3.close(unmount=True)


if __name__ == "__main__":
    main()
