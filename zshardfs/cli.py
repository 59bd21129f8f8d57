"""Command line: ``zshardfs mount | umount | stats``, and ``mount.zshardfs``.

Every user error ends in one line on stderr and a non-zero exit status,
never a traceback.  Without ``--foreground``, ``mount`` starts the daemon in
a new session and returns only once the file system is mounted (exit 0) or
has failed (exit 1, with the daemon's reason).
"""

from __future__ import annotations

import argparse
import errno
import json
import logging
import logging.handlers
import os
import shutil
import subprocess
import sys
import time

from .config import ConfigError, MountConfig, describe_options, parse_options

log = logging.getLogger("zshardfs")

EXIT_OK, EXIT_FAIL, EXIT_USAGE = 0, 1, 2


def _fail(message: str, status: int = EXIT_FAIL) -> int:
    print(f"zshardfs: {message}", file=sys.stderr)
    return status


def _setup_logging(cfg: MountConfig, background: bool) -> None:
    root = logging.getLogger()
    root.handlers.clear()
    fmt = "%(asctime)s zshardfs[%(process)d] %(levelname)s %(name)s: %(message)s"
    if cfg.log_file:
        handler: logging.Handler = logging.FileHandler(cfg.log_file)
    elif background and os.path.exists("/dev/log"):
        handler = logging.handlers.SysLogHandler("/dev/log")
        fmt = "zshardfs[%(process)d]: %(levelname)s %(name)s: %(message)s"
    else:
        handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(fmt))
    root.addHandler(handler)
    root.setLevel(cfg.log_level)
    # boto's own chatter (which could include request details) stays quiet
    for noisy in ("botocore", "boto3", "urllib3", "s3transfer"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


def check_mountpoint(path: str) -> None:
    if not os.path.exists("/dev/fuse"):
        raise ConfigError("/dev/fuse is missing: load the fuse kernel module (modprobe fuse) or install fuse3")
    if shutil.which("fusermount3") is None:
        raise ConfigError("fusermount3 is not installed (Debian/Ubuntu: apt-get install fuse3)")
    if not os.path.isdir(path):
        raise ConfigError(f"mountpoint {path!r} is not a directory")
    if os.path.ismount(path):
        raise ConfigError(f"mountpoint {path!r} is already a mount point")
    try:
        if os.listdir(path):
            raise ConfigError(f"mountpoint {path!r} is not empty")
    except PermissionError:
        raise ConfigError(f"mountpoint {path!r} is not accessible") from None


def _build_config(args) -> MountConfig:
    cfg = MountConfig(source=args.source, mountpoint=os.path.abspath(args.mountpoint))
    cfg.foreground = args.foreground
    cfg.endpoint_url = args.endpoint_url
    cfg.region = args.region
    cfg.profile = args.profile
    parse_options(cfg, args.o or [])
    if not cfg.source.startswith("s3://") and "://" not in cfg.source:
        cfg.source = os.path.abspath(cfg.source)
    return cfg


def cmd_mount(args) -> int:
    try:
        cfg = _build_config(args)
        check_mountpoint(cfg.mountpoint)
    except ConfigError as exc:
        return _fail(str(exc), EXIT_USAGE if "option" in str(exc) else EXIT_FAIL)
    if cfg.foreground:
        return _serve(cfg, args.ready_fd)
    return _spawn(args, cfg)


def _serve(cfg: MountConfig, ready_fd: int | None) -> int:
    from .backends.base import StoreError
    from .daemon import run

    _setup_logging(cfg, background=ready_fd is not None)

    def tell(message: str) -> None:
        if ready_fd is not None:
            try:
                os.write(ready_fd, message.encode() + b"\n")
                os.close(ready_fd)
            except OSError:
                pass

    try:
        run(cfg, ready=lambda: tell("ok"))
    except (ConfigError, StoreError) as exc:
        tell(f"error: {exc}")
        return _fail(str(exc))
    except RuntimeError as exc:  # pyfuse3: fuse_session_mount failed
        tell(f"error: cannot mount on {cfg.mountpoint}: {exc}")
        return _fail(f"cannot mount on {cfg.mountpoint}: {exc}")
    except KeyboardInterrupt:
        return EXIT_OK
    return EXIT_OK


def _spawn(args, cfg: MountConfig) -> int:
    """Start ``zshardfs mount --foreground`` detached and wait for its word."""
    read_fd, write_fd = os.pipe()
    argv = [sys.executable, "-m", "zshardfs.cli", *args.raw_argv, "--foreground", "--ready-fd", str(write_fd)]
    with open(os.devnull, "rb") as devnull_in, open(os.devnull, "wb") as devnull_out:
        proc = subprocess.Popen(argv, stdin=devnull_in, stdout=devnull_out, stderr=devnull_out,
                                pass_fds=(write_fd,), start_new_session=True, close_fds=True)
    os.close(write_fd)
    with os.fdopen(read_fd, "rb") as pipe:
        answer = pipe.readline().decode(errors="replace").strip()
    if answer == "ok":
        return EXIT_OK
    if answer.startswith("error: "):
        return _fail(answer[len("error: "):])
    code = proc.wait()
    return _fail(f"the daemon exited ({code}) before the mount was ready")


def _control(mountpoint: str, name: str) -> bytes:
    try:
        return os.getxattr(mountpoint, name)
    except OSError:
        raise ConfigError(f"{mountpoint!r} is not a zshardfs mount point") from None


def _sync(mnt: str) -> str | None:
    """Ask the daemon to store everything it holds; an error text or None."""
    try:
        os.setxattr(mnt, "user.zshardfs.sync", b"1")
    except OSError as exc:
        if exc.errno == errno.EROFS:
            return None
        return f"sync of {mnt} failed: {os.strerror(exc.errno)} (see the daemon's log)"
    return None


def cmd_sync(args) -> int:
    mnt = os.path.abspath(args.mountpoint)
    try:
        _control(mnt, "user.zshardfs.pid")
    except ConfigError as exc:
        return _fail(str(exc))
    problem = _sync(mnt)
    return _fail(problem) if problem else EXIT_OK


def cmd_umount(args) -> int:
    mnt = os.path.abspath(args.mountpoint)
    try:
        pid = int(_control(mnt, "user.zshardfs.pid"))
    except ConfigError as exc:
        return _fail(str(exc))
    problem = _sync(mnt)
    if problem:
        return _fail(problem + "; not unmounted, the data is still held by the daemon")
    result = subprocess.run(["fusermount3", "-u", *(["-z"] if args.lazy else []), mnt],
                            capture_output=True, text=True)
    if result.returncode != 0:
        return _fail(f"cannot unmount {mnt}: {result.stderr.strip() or 'fusermount3 failed'}")
    deadline = time.monotonic() + args.timeout
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return EXIT_OK
        except PermissionError:
            return EXIT_OK
        time.sleep(0.05)
    return _fail(f"unmounted, but daemon {pid} is still running after {args.timeout:g}s")


def cmd_stats(args) -> int:
    mnt = os.path.abspath(args.mountpoint)
    try:
        stats = json.loads(_control(mnt, "user.zshardfs.stats"))
    except ConfigError as exc:
        return _fail(str(exc))
    if args.json:
        print(json.dumps(stats, indent=2))
        return EXIT_OK
    print(f"source      {stats['source']}")
    print(f"mountpoint  {stats['mountpoint']}  (pid {stats['pid']}, up {stats['uptime_s']:.0f}s)")
    print("requests    " + "  ".join(f"{k}={v}" for k, v in stats["requests"].items()))
    print(f"bytes       read={stats['bytes']['read']}  written={stats['bytes']['written']}")
    print(f"errors      {stats['errors']}  retries={stats['retries']}  "
          f"precondition_failed={stats['precondition_failed']}")
    for name in ("index_cache", "chunk_cache"):
        c = stats[name]
        print(f"{name:<11} hits={c['hits']} misses={c['misses']} entries={c['entries']} "
              f"bytes={c['bytes']}/{c['max_bytes']}")
    print(f"inodes      {stats['inodes']}")
    return EXIT_OK


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="zshardfs", description="Mount a sharded array store as its unsharded view.")
    sub = p.add_subparsers(dest="command", required=True)
    m = sub.add_parser("mount", help="mount SOURCE on MOUNTPOINT", formatter_class=argparse.RawDescriptionHelpFormatter,
                       epilog="options (-o):\n" + describe_options())
    m.add_argument("source", help="local directory or s3://bucket[/prefix]")
    m.add_argument("mountpoint")
    m.add_argument("-o", action="append", metavar="OPT[,OPT...]", help="mount options (see below)")
    m.add_argument("-f", "--foreground", action="store_true", help="serve in the foreground until unmounted")
    m.add_argument("--endpoint-url", help="S3-compatible endpoint (MinIO, Ceph, ...)")
    m.add_argument("--region", help="S3 region")
    m.add_argument("--profile", help="AWS credentials profile")
    m.add_argument("--ready-fd", type=int, help=argparse.SUPPRESS)
    m.set_defaults(func=cmd_mount)
    u = sub.add_parser("umount", help="unmount (waits until the daemon has finished)")
    u.add_argument("mountpoint")
    u.add_argument("-z", "--lazy", action="store_true", help="lazy unmount")
    u.add_argument("--timeout", type=float, default=120.0, help="seconds to wait for the daemon to exit")
    u.set_defaults(func=cmd_umount)
    y = sub.add_parser("sync", help="store all written data now (what sync(1) cannot ask a FUSE daemon)")
    y.add_argument("mountpoint")
    y.set_defaults(func=cmd_sync)
    s = sub.add_parser("stats", help="request counters and cache figures of a mount")
    s.add_argument("mountpoint")
    s.add_argument("--json", action="store_true")
    s.set_defaults(func=cmd_stats)
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    args.raw_argv = list(sys.argv[1:] if argv is None else argv)
    try:
        return args.func(args)
    except KeyboardInterrupt:
        return EXIT_FAIL


def mount_helper(argv: list[str] | None = None) -> int:
    """``mount.zshardfs SOURCE MOUNTPOINT [-o opts]`` as mount(8) and fstab call it."""
    argv = list(sys.argv[1:] if argv is None else argv)
    return main(["mount", *argv])


if __name__ == "__main__":
    sys.exit(main())
