#!/usr/bin/env python3
"""Random directory renames (and chunk writes, reads, listings) through a
local mount, against a twin: a plain directory holding the unsharded view,
to which every rename the mount accepted is applied too.  After every step
the mount's tree equals the twin's; at the end, after a remount, too, and
the stored arrays are still sharded.  (SEMANTICS 4.18.)

``--busy``: during every rename, another thread makes and removes groups,
symbolic links and links (copies) in the groups, and writes, truncates (by
path) and unlinks chunks of the arrays, each through a directory descriptor
held from the start (as a shell's working directory: it follows its
directory through renames), in the mount and in the twin alike; the rename
may then be EXDEV (something below is under way), and the two must still
agree.

``--s3``: the store is in a bucket of moto's stand-alone server
(tests/s3server.py), mounted with ``-o shard=2``.  A directory's rename is
EXDEV there (SEMANTICS, Limits), so each rename the mount refuses so is
done as ``mv -T`` does it: copies through the mount, then removes (onto an
empty directory, which it removes first; onto a full one it changes
nothing); the mount must then equal the twin, to which the rename is
applied as one rename(2), and the copied arrays are stored sharded.  S3
keeps no empty directory: one made through the mount lives in its memory
only, so after each remount the twin loses those with no file below; the
store's ``empty`` is made through the mount after its first mount; one the
mount emptied is kept only while it goes on removing near it, and the
twin lets it go when the mount did and might have (``Emptied``: empty in
the twin, nothing stored below it, its time passed; counted).  An
in-grid chunk directory is listed when it holds no chunk (SEMANTICS
Limits): mv copies it out as an empty directory, or stops at it with ENOENT
once its array's zarr.json and last chunk moved; each is counted, and what
mv left undone is done.  (An EEXIST at mv's mkdir of one it had just
removed was taken as that Limit too, until the rmdir was remembered: now
it is a failure.)  A path the mount listed that is gone (or fails) when
read or listed itself is a difference from the twin, named first
(``listed, then gone: ENOENT``), and an empty directory mv copied that is
gone at the rmdir that removes it a failure, never a traceback.

``-o log_level=DEBUG`` (or ``debug``) passes mount options; ``--keep DIR``
copies the daemon's log of each failed seed there.

Ctrl-C, SIGTERM and SIGHUP end a run alike: its mounts are taken down and
moto's server stopped, none left behind.

    .venv/bin/python scripts/fuzz_dir_renames.py --seeds 1-5 --steps 150 [--busy | --s3] [-o OPTS] [--keep DIR]
"""

from __future__ import annotations

import argparse
import errno
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import zarr

ZSHARDFS = [sys.executable, "-m", "zshardfs.cli"]
ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # (tests.s3server, for --s3; zshardfs's constants)

from zshardfs.config import MountConfig  # noqa: E402
from zshardfs.view import View  # noqa: E402

#: (--s3) seconds a directory whose last file or subdirectory the mount
#: removed stays (SEMANTICS 4.6: EMPTIED_KEEP, or metadata_ttl if longer),
#: and the kernel's entry time: past both, one storage holds nothing of is
#: gone for certain
EMPTIED_KEEP = max(View.EMPTIED_KEEP, MountConfig.metadata_ttl)
ATTR_TIMEOUT = MountConfig.attr_timeout


#: what tree() records at a path a listing gave that was gone (or failed) when
#: it was read or listed itself: a divergence from the twin, never a crash
GONE = b"<listed, then gone: "


def tree(root: Path) -> dict[str, bytes | None]:
    """Every path below ``root``: a file's bytes (a link's ``-> target``),
    None for a directory, ``GONE`` + the errno name for one listed that was
    then not found (or failed) when read or listed."""
    out: dict[str, bytes | None] = {}

    def gone(rel: str, exc: OSError) -> None:
        out[os.path.normpath(rel)] = GONE + errno.errorcode.get(exc.errno, str(exc.errno)).encode() + b">"

    def walk_error(exc: OSError) -> None:
        rel = os.path.relpath(exc.filename, root) if exc.filename is not None else "."
        if rel == ".":
            if exc.errno == errno.ENOENT:
                return  # (no tree at all: as os.walk answers)
            raise exc
        gone(rel, exc)

    for dirpath, dirs, files in os.walk(root, onerror=walk_error):
        rel = os.path.relpath(dirpath, root)
        for d in dirs:
            out[os.path.normpath(os.path.join(rel, d))] = None
        for f in files:
            p = Path(dirpath) / f
            try:
                out[os.path.normpath(os.path.join(rel, f))] = (b"-> " + os.fsencode(os.readlink(p))
                                                              if p.is_symlink() else p.read_bytes())
            except OSError as exc:
                gone(os.path.join(rel, f), exc)
    return out


def comparable(t: dict[str, bytes | None]) -> dict[str, bytes | None]:
    """``t`` without the directories inside an array that hold no file (a
    chunk directory whose chunks were all unlinked: the mount shows it only
    while a shard below is stored, a directory store keeps it empty)."""
    arrays = set()
    for p, v in t.items():
        if p.endswith("zarr.json") and v and not v.startswith(b"-> "):
            try:
                if json.loads(v).get("node_type") == "array":
                    arrays.add(os.path.dirname(p))
            except ValueError:
                pass
    full = set()  # (directories with a file below)
    for p, v in t.items():
        if v is not None:
            parts = p.split("/")
            full.update("/".join(parts[:i]) for i in range(1, len(parts)))
    return {p: v for p, v in t.items() if v is not None or p in full or not inside_array(p, sorted(arrays))}


def differences(mount: dict, twin: dict) -> list[str]:
    """The first ten paths where the mount's tree and the twin's differ, each
    marked with where it is (or ``!=`` for other bytes); first those the
    mount listed that were then gone when read (``GONE``), with what the
    twin has there."""
    gone = [p for p, v in mount.items() if v is not None and v.startswith(GONE)]
    out = ([f"{p} (mount: {mount[p][1:-1].decode()}; twin: "
            + ("none" if p not in twin else "a directory" if twin[p] is None else "a file") + ")" for p in sorted(gone)]
           + sorted([f"{p} (mount only)" for p in mount if p not in twin and p not in gone]
                    + [f"{p} (twin only)" for p in twin if p not in mount]
                    + [f"{p} !=" for p in mount if p in twin and mount[p] != twin[p] and p not in gone]))
    return out[:10]


#: names the busy thread makes (never a rename's source or target)
BUSY = "zz"


class Busy:
    """The other thread of ``--busy``: ops through directory descriptors held
    on the same directories of the mount and of the twin (groups, arrays),
    run while the main thread renames; every op's answer in the mount must
    be the twin's."""

    def __init__(self, rng: random.Random, mnt: Path, twin: Path, groups: list[str], arrays: list[str]):
        self.rng, self.mnt, self.twin = rng, mnt, twin
        self.twin_fds = {rel: os.open(twin / rel, os.O_PATH | os.O_DIRECTORY) for rel in groups + arrays}
        self.groups, self.arrays = groups, arrays
        self.mnt_fds: dict[str, int] = {}
        self.failures: list[str] = []
        self.counts: dict[str, int] = {}
        self.n = 0

    def where(self, rel: str) -> str:
        """Where the directory first at ``rel`` is now (the twin's descriptor knows)."""
        return os.path.relpath(os.readlink(f"/proc/self/fd/{self.twin_fds[rel]}"), self.twin)

    def open_mount(self) -> None:
        self.mnt_fds = {rel: os.open(self.mnt / self.where(rel), os.O_PATH | os.O_DIRECTORY) for rel in self.twin_fds}

    def close_mount(self) -> None:
        for fd in self.mnt_fds.values():
            os.close(fd)
        self.mnt_fds = {}

    def both(self, what: str, fn) -> None:
        """``fn(fd)`` in the mount, then in the twin: the same answer."""
        answers = []
        for fds in (self.mnt_fds, self.twin_fds):
            try:
                fn(fds)
                answers.append("ok")
            except OSError as exc:
                answers.append(errno.errorcode.get(exc.errno, str(exc.errno)))
        if os.environ.get("VERBOSE"):
            print(f"     busy {what}: {answers[0]}")
        key = f"{what.split()[0]} {answers[0]}"
        self.counts[key] = self.counts.get(key, 0) + 1
        if answers[0] != answers[1]:
            self.failures.append(f"{what}: mount {answers[0]}, twin {answers[1]}")

    def one(self) -> None:
        rng = self.rng
        x = rng.random()
        if x < 0.45:
            g = rng.choice(self.groups)
            self.n += 1
            name = f"{BUSY}{rng.randrange(4)}"
            kind = rng.choice(["mkdir", "rmdir", "symlink", "link", "unlink"])
            if kind == "mkdir":
                def mkdir(fds):
                    os.mkdir(name, dir_fd=fds[g])
                    fd = os.open(f"{name}/zarr.json", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644, dir_fd=fds[g])
                    try:
                        os.write(fd, json.dumps({"zarr_format": 3, "node_type": "group", "attributes": {}}).encode())
                    finally:
                        os.close(fd)
                self.both(f"mkdir {g}/{name}", mkdir)
            elif kind == "rmdir":
                def rmdir(fds):
                    try:
                        os.unlink(f"{name}/zarr.json", dir_fd=fds[g])
                    except FileNotFoundError:
                        pass
                    os.rmdir(name, dir_fd=fds[g])
                self.both(f"rmdir {g}/{name}", rmdir)
            elif kind == "symlink":
                self.both(f"symlink {g}/{name}l", lambda fds: os.symlink("zarr.json", f"{name}l", dir_fd=fds[g]))
            elif kind == "link":
                self.both(f"link {g}/{name}c", lambda fds: os.link("zarr.json", f"{name}c", src_dir_fd=fds[g],
                                                                   dst_dir_fd=fds[g]))
            else:
                victim = rng.choice([f"{name}l", f"{name}c"])
                self.both(f"unlink {g}/{victim}", lambda fds: os.unlink(victim, dir_fd=fds[g]))
        else:
            a = rng.choice(self.arrays)
            chunk = f"c/{rng.randrange(4)}/{rng.randrange(4)}"
            kind = rng.choice(["write", "truncate", "unlink"])
            if kind == "write":
                data = np.full((4, 4), rng.randrange(1000), "<i4").tobytes()

                def write(fds):
                    fd = os.open(chunk, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644, dir_fd=fds[a])
                    try:
                        os.write(fd, data)
                    finally:
                        os.close(fd)
                self.both(f"write {a}/{chunk}", write)
            elif kind == "truncate":  # (by path: SETATTR without a handle)
                size = rng.choice([0, 16, 64, 80])
                self.both(f"truncate {a}/{chunk} {size}",
                          lambda fds: os.truncate(f"/proc/self/fd/{fds[a]}/{chunk}", size))
            else:
                self.both(f"unlink {a}/{chunk}", lambda fds: os.unlink(chunk, dir_fd=fds[a]))

    def during(self, fn):
        """``fn()`` while this thread runs a few ops; ``fn``'s answer."""
        ops = self.rng.randrange(1, 5)
        thread = threading.Thread(target=lambda: [self.one() for _ in range(ops)])
        thread.start()
        try:
            return fn()
        finally:
            thread.join()


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


def empty_dirs(root: Path) -> list[str]:
    """Directories below ``root`` with no file below them, deepest first."""
    t = tree(root)
    full = set()
    for p, v in t.items():
        if v is not None:
            parts = p.split("/")
            full.update("/".join(parts[:i]) for i in range(1, len(parts)))
    return sorted((p for p, v in t.items() if v is None and p not in full), key=lambda p: -p.count("/"))


def mv(src: Path, dst: Path) -> tuple[str, str]:
    """``mv -T src dst`` (rename(2), else copy and remove): "ok", the errno
    name its (last) message gives, or "mv failed"; and its messages."""
    out = subprocess.run(["mv", "-T", str(src), str(dst)], capture_output=True, text=True, timeout=600)
    msg = out.stderr.strip()
    if out.returncode == 0:
        return "ok", msg
    for code in (errno.ENOTEMPTY, errno.EINVAL, errno.ENOENT, errno.EIO, errno.EEXIST, errno.ENOTDIR,
                 errno.EPERM, errno.EACCES, errno.EXDEV):
        if msg.endswith(os.strerror(code)):
            return errno.errorcode[code], msg
    if "subdirectory of itself" in msg:
        return "EINVAL", msg
    return "mv failed", msg


def vanished(msg: str, src: Path, arrays: list[str]) -> bool:
    """Did ``mv`` stop (ENOENT) only at an in-grid chunk directory of an
    array below ``src``, leaving nothing but directories there?  An empty
    chunk directory's rmdir leaves it found (SEMANTICS Limits: chunk
    directories are looked up leniently); ``mv -T`` of the array lists it,
    and once the array's zarr.json and last chunk are moved it is gone."""
    lines = msg.splitlines()
    if not lines or not all("cannot stat '" in line and line.endswith(os.strerror(errno.ENOENT)) for line in lines):
        return False
    mnt = src.parent
    while not os.path.ismount(mnt):
        mnt = mnt.parent
    for line in lines:
        rel = Path(line.split("cannot stat '", 1)[1].split("'", 1)[0]).relative_to(mnt).as_posix()
        if not (rel.startswith(src.relative_to(mnt).as_posix() + "/") and inside_array(rel, arrays)):
            return False
    return all(v is None for v in tree(src).values())


class Emptied:
    """(--s3) The twin's model of an emptied directory: S3 has none, so one
    whose last file or subdirectory (or chunk) the mount removed stays while
    the mount goes on removing below it or below a directory above it, and
    EMPTIED_KEEP seconds after the last such removal storage decides
    (SEMANTICS 4.6); a directory store keeps it.  The twin drops such a
    directory once the mount no longer shows it, and only then: it is empty
    in the twin, storage holds no key below it, it held a file once (one
    made here that only ever held directories lives in the mount's memory:
    it must stay), and no step that removed something below it or below a
    directory above it began less than EMPTIED_KEEP before the mount's tree
    was read.  A step about to use such a directory (its source, its target,
    anything above or below them) while it may be going waits until it has
    gone or stayed for certain (EMPTIED_KEEP and the kernel's ATTR_TIMEOUT
    after the last step that changed anything there), so that no rename
    races its end."""

    def __init__(self, twin: Path, s3, bucket: str):
        self.twin, self.s3, self.bucket = twin, s3, bucket
        self.removed: dict[str, float] = {}  # dir -> start of the last step that removed something below it
        self.changed: dict[str, float] = {}  # dir -> end of the last step that changed anything at or below it
        self.held_files: set[str] = set()  # directories that had a file below them
        self.dropped: set[str] = set()  # (by drop_gone during a step: no removal of the mount's)

    def reset(self) -> None:
        """A new mount (the twin lost its empty directories): nothing kept."""
        self.removed.clear()
        self.changed.clear()
        self.held_files.clear()
        self.dropped.clear()

    def before(self, t: dict[str, bytes | None]) -> None:
        for p, v in t.items():
            if v is not None:
                self.held_files.update(_ancestors(p))

    def after(self, before: dict[str, bytes | None], after: dict[str, bytes | None], started: float,
              used: list[str]) -> None:
        """A step that began at ``started`` and used the paths ``used``
        (a rename's source and target) changed the twin from ``before`` to
        ``after``."""
        ended = time.monotonic()
        for p in before.keys() - after.keys() - self.dropped:
            for a in _ancestors(p):
                self.removed[a] = started
        self.dropped.clear()
        for p in (before.keys() ^ after.keys()) | {p for p in before.keys() & after.keys() if before[p] != after[p]} \
                | set(used):
            for a in _ancestors(p) + [p]:
                self.changed[a] = ended

    def _may_go(self, p: str) -> bool:
        return (p in self.removed and p in self.held_files and (self.twin / p).is_dir()
                and not any(True for _ in (self.twin / p).iterdir()))

    def wait_for(self, paths: list[str]) -> float:
        """Sleep until no directory that may be going is, or is above or
        below, one of ``paths``; the seconds slept."""
        def near(p: str) -> bool:
            return any(q == p or q.startswith(p + "/") or p.startswith(q + "/") for q in paths)
        until = max((max(self.changed.get(a, 0.0) for a in _ancestors(p) + [p]) + EMPTIED_KEEP + ATTR_TIMEOUT
                     for p in self.removed if near(p) and self._may_go(p)), default=0.0)
        slept = max(0.0, until - time.monotonic())
        if slept:
            time.sleep(slept)
        return slept

    def drop_gone(self, mount: dict, twin: dict, seen: float) -> list[str]:
        """Drop from the twin the directories it alone has (``mount`` and
        ``twin``: their trees, the mount's read by ``seen``) that the mount
        may have let go; those dropped (deepest first)."""
        out = []
        for p in sorted((p for p in twin if p not in mount and twin[p] is None), key=lambda p: -p.count("/")):
            if (self._may_go(p) and seen - max(self.removed.get(a, 0.0) for a in _ancestors(p) + [p]) >= EMPTIED_KEEP
                    and not self.s3.s3.list_objects_v2(Bucket=self.bucket, Prefix=f"pfx/{p}/", MaxKeys=1)["KeyCount"]):
                (self.twin / p).rmdir()
                del self.removed[p]
                self.dropped.add(p)
                out.append(p)
        return out


def _ancestors(p: str) -> list[str]:
    parts = p.split("/")
    return ["/".join(parts[:i]) for i in range(1, len(parts))]


def run(seed: int, steps: int, base: Path, counts: dict[str, int], busy: bool = False, s3=None,
        options: str = "") -> int:
    """Failures of one seed; ``counts``: the renames' answers, by errno name.
    ``s3``: a running tests.s3server.MotoServer to keep the store in;
    ``options``: more mount options (``log_level=DEBUG``)."""
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
    source, opts, bucket = [str(store)], f"flush_delay=5,log_file={log}" + (f",{options}" if options else ""), None
    if s3 is not None:
        bucket = s3.create_bucket()
        s3.put_many(bucket, {f"pfx/{p.relative_to(store).as_posix()}": p.read_bytes()
                             for p in store.rglob("*") if p.is_file()})
        source, opts = [f"s3://{bucket}/pfx", "--endpoint-url", s3.endpoint_url], opts + ",shard=2"

    emptied = Emptied(twin, s3, bucket) if s3 is not None else None

    def mount() -> None:
        subprocess.run([*ZSHARDFS, "mount", source[0], str(mnt), "-o", opts, *source[1:]],
                       check=True, capture_output=True, timeout=120)
        if s3 is not None:  # (S3 keeps no empty directory: those made through the mount are gone)
            for d in empty_dirs(twin) if twin.exists() else ():
                (twin / d).rmdir()
            emptied.reset()

    def count(what: str, n: int = 1) -> None:
        counts[what] = counts.get(what, 0) + n

    def compare() -> tuple[dict, dict]:
        """The mount's tree and the twin's, as compared; (--s3) the twin
        without the emptied directories the mount let go (Emptied)."""
        a = comparable(tree(mnt))
        seen = time.monotonic()
        b = comparable(tree(twin))
        if a != b and emptied is not None:
            dropped = emptied.drop_gone(a, b, seen)
            if dropped:
                count("S3 let an emptied directory go (Limits)", len(dropped))
                print(f"     the mount let go of {dropped}") if os.environ.get("VERBOSE") else None
                b = comparable(tree(twin))
        return a, b

    def umount() -> None:
        subprocess.run([*ZSHARDFS, "umount", str(mnt)], check=True, capture_output=True, timeout=120)

    mount()
    failures = 0
    other = None
    try:
        if s3 is not None:
            (mnt / "empty").mkdir()
        shutil.copytree(mnt, twin)
        if busy:
            other = Busy(random.Random(seed * 7919), mnt, twin, ["g1", "g1/sub", "g2"],
                         ["g1/a", "g1/sub/b", "g2/c", "top"])
            other.open_mount()
        for step in range(steps):
            started = time.monotonic()
            used: list[str] = []  # (a rename's source and target)
            arrays = arrays_in(twin)
            before = tree(twin)
            if emptied is not None:
                emptied.before(before)
            dirs = sorted(p for p, v in before.items()
                          if v is None and not any(n.startswith(BUSY) for n in p.split("/")))
            x = rng.random()
            if x < 0.55 and dirs:
                outer = [d for d in dirs if not inside_array(d, arrays)]  # (mostly those: 4.18's renames)
                src = rng.choice(outer if outer and rng.random() < 0.85 else dirs)
                parents = [""] + [d for d in dirs if not d.startswith(src + "/") and d != src]
                outer_parents = [p for p in parents if p not in arrays and not inside_array(p, arrays)]
                parent = rng.choice(outer_parents if rng.random() < 0.85 else parents)
                dst = os.path.join(parent, rng.choice(["n1", "n2", "empty", "x"])) if rng.random() < 0.8 \
                    else rng.choice(dirs)
                said = []  # (--s3: what mv said)
                used += [src, dst]
                if emptied is not None and emptied.wait_for([src, dst]):
                    count("waited for an emptied directory to go or stay")
                    compare()  # (any other difference: at the step's end)

                def rename() -> str:
                    try:
                        os.rename(mnt / src, mnt / dst)
                        return "ok"
                    except OSError as exc:
                        if exc.errno == errno.EXDEV and s3 is not None:
                            counts["copied"] = counts.get("copied", 0) + 1
                            answer, msg = mv(mnt / src, mnt / dst)  # (copies, then removes)
                            said.append(msg)
                            if answer == "ENOENT" and vanished(msg, mnt / src, arrays):
                                counts["mv ENOENT at a chunk directory rmdir left (Limits)"] = \
                                    counts.get("mv ENOENT at a chunk directory rmdir left (Limits)", 0) + 1
                                for dirpath, _, _ in os.walk(mnt / src, topdown=False):
                                    try:  # (mv's job: what is left, only directories)
                                        os.rmdir(dirpath)
                                    except FileNotFoundError:
                                        pass  # (such a directory again)
                                return "ok"
                            return answer
                        return errno.errorcode[exc.errno]
                got = other.during(rename) if other is not None else rename()
                for failure in other.failures if other is not None else ():
                    print(f"seed {seed} step {step} (during mv {src} {dst}): {failure}")
                    failures += 1
                if other is not None:
                    other.failures.clear()
                # the twin: a plain directory store; the mount answers as it does,
                # or EXDEV where 4.18 says (either place inside an array)
                existed = (twin / dst).is_dir()
                try:
                    os.rename(twin / src, twin / dst)
                    twin_got = "ok"
                except OSError as exc:
                    twin_got = errno.errorcode[exc.errno]
                # (or, --busy, wherever a request of the other thread was under way below)
                exdev = inside_array(src, arrays) or inside_array(dst, arrays) or other is not None
                # (--s3: mv's copy fails at once where it would make a directory
                # named as no part of a chunk key inside an array: ENOENT, 4.1)
                refused = ("EXDEV", "ENOENT") if s3 is not None else ("EXDEV",)
                if got != twin_got and not (exdev and got in refused):
                    print(f"seed {seed} step {step}: rename {src} -> {dst}: mount {got}, twin {twin_got}"
                          + (f" (mv: {said[0][-600:]})" if said and said[0] else ""))
                    failures += 1
                if got != "ok" and twin_got == "ok":
                    os.rename(twin / dst, twin / src)  # (undone: the mount did not rename)
                    if existed:
                        (twin / dst).mkdir()  # (the empty directory it replaced)
                elif got == "ok" and twin_got != "ok":
                    break
                elif got == "ok" and said:
                    # (--s3: mv copied the chunk directories the mount lists, also
                    # those left found after their rmdir or holding no chunk,
                    # Limits: copied out of their array they are plain, empty
                    # directories, which a directory store never had)
                    had = tree(twin / dst)
                    for p in empty_dirs(mnt / dst):  # (deepest first)
                        if p not in had and inside_array(os.path.join(src, p), arrays):
                            count("mv copied an empty chunk directory (Limits)")
                            try:
                                os.rmdir(mnt / dst / p)
                            except FileNotFoundError:  # (listed by empty_dirs, then gone)
                                print(f"seed {seed} step {step}: mv {src} {dst}: {dst}/{p}, an empty directory "
                                      "mv copied and the mount listed, was gone at its rmdir: ENOENT")
                                failures += 1
                counts[got] = counts.get(got, 0) + 1
                print(f"  {step}: mv {src} {dst}: {got}") if os.environ.get("VERBOSE") else None
            elif x < 0.8 and arrays:
                arr = rng.choice(arrays)
                i, j = rng.randrange(4), rng.randrange(4)
                data = np.full((4, 4), rng.randrange(1000), "<i4").tobytes()
                for root in (mnt, twin):
                    (root / arr / f"c/{i}").mkdir(parents=True, exist_ok=True)  # (--s3: c may be moved away)
                    (root / arr / f"c/{i}/{j}").write_bytes(data)
                print(f"  {step}: write {arr}/c/{i}/{j}") if os.environ.get("VERBOSE") else None
            elif x < 0.9:
                subprocess.run([*ZSHARDFS, "sync", str(mnt)], check=True, capture_output=True, timeout=120)
            else:
                if other is not None:
                    other.close_mount()
                umount()
                mount()
                before = None  # (a new mount: nothing emptied in it yet)
                if other is not None:
                    other.open_mount()
            if emptied is not None and before is not None:
                emptied.after(before, tree(twin), started, used)
            a, b = compare()
            if a != b:
                print(f"seed {seed} step {step}: trees differ: {differences(a, b)}")
                failures += 1
                break
        if other is not None:
            other.close_mount()
            counts.update({f"busy {k}": v for k, v in other.counts.items()})
        umount()
        mount()
        a, b = comparable(tree(mnt)), comparable(tree(twin))
        if a != b:
            print(f"seed {seed}: trees differ after a remount: {differences(a, b)}")
            failures += 1
        for arr in arrays_in(twin):
            try:
                doc = json.loads((store / arr / "zarr.json").read_text() if s3 is None else
                                 s3.s3.get_object(Bucket=bucket, Key=f"pfx/{arr}/zarr.json")["Body"].read())
            except (FileNotFoundError, s3.s3.exceptions.NoSuchKey if s3 is not None else FileNotFoundError):
                print(f"seed {seed}: {arr}/zarr.json not stored")
                failures += 1
                continue
            if doc["codecs"][0]["name"] != "sharding_indexed":
                print(f"seed {seed}: {arr} stored unsharded")
                failures += 1
    finally:
        subprocess.run([*ZSHARDFS, "umount", str(mnt)], capture_output=True, timeout=120)
        if bucket is not None:
            s3.delete_bucket(bucket)
    text = log.read_text() if log.exists() else ""
    if "Traceback" in text or " ERROR " in text:
        print(f"seed {seed}: the daemon's log has errors:\n{text[-2000:]}")
        failures += 1
    return failures


def _on_signal(signum, frame):
    raise SystemExit(128 + signum)  # (unwinds through the run's teardown: its mounts and moto's server end)


def main() -> int:
    signal.signal(signal.SIGTERM, _on_signal)
    signal.signal(signal.SIGHUP, _on_signal)
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", default="1-3")
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--busy", action="store_true", help="ops of another thread during the renames")
    ap.add_argument("-o", "--options", default="", help="more mount options (log_level=DEBUG)")
    ap.add_argument("--keep", type=Path, help="copy each failed seed's daemon log here (seed-N.log)")
    ap.add_argument("--s3", action="store_true",
                    help="the store in a bucket of moto's stand-alone server; renames refused EXDEV done as mv does")
    args = ap.parse_args()
    if args.s3 and args.busy:
        ap.error("--busy is for local stores (on S3 a copied directory leaves the descriptors held on it behind)")
    lo, _, hi = args.seeds.partition("-")
    total = 0
    s3 = None
    with tempfile.TemporaryDirectory(prefix="zshardfs-dirfuzz-s3-") as s3tmp:
        if args.s3:
            from tests.s3server import MotoServer, set_dummy_credentials
            set_dummy_credentials()  # (for this process's client and the daemons)
            s3 = MotoServer(Path(s3tmp) / "moto.log")
            s3.start()
        try:
            for seed in range(int(lo), int(hi or lo) + 1):
                counts: dict[str, int] = {}
                with tempfile.TemporaryDirectory(prefix="zshardfs-dirfuzz-") as tmp:
                    failures = run(seed, args.steps, Path(tmp), counts, args.busy, s3, args.options)
                    if failures and args.keep is not None and (Path(tmp) / "log").exists():
                        args.keep.mkdir(parents=True, exist_ok=True)
                        shutil.copy(Path(tmp) / "log", args.keep / f"seed-{seed}.log")
                print(f"seed {seed}: {'ok' if not failures else f'{failures} failures'}; renames: "
                      + ", ".join(f"{k} {v}" for k, v in sorted(counts.items())), flush=True)
                total += failures
        finally:
            if s3 is not None:
                s3.stop()
    return 1 if total else 0


if __name__ == "__main__":
    sys.exit(main())
