"""Command line: ``zshardfs mount | umount | sync | stats | fsck``, and ``mount.zshardfs``.

Every user error ends in one line on stderr and a non-zero exit status,
never a traceback.  Without ``--foreground``, ``mount`` starts the daemon in
a new session and returns only once the file system is mounted (exit 0) or
has failed (exit 1, with the daemon's reason).
"""

from __future__ import annotations

import argparse
import difflib
import errno
import json
import logging
import logging.handlers
import math
import os
import re
import shlex
import shutil
import signal
import socket
import stat
import subprocess
import tempfile
import sys
import time

from . import __version__
from .config import (ConfigError, MountConfig, OptionError, describe_options, parse_options, redact_url,
                     valid_endpoint_url, valid_region_name)

log = logging.getLogger("zshardfs")

EXIT_OK, EXIT_FAIL, EXIT_USAGE = 0, 1, 2
#: the daemon stopped without storing everything written (told to give up)
EXIT_LOST = 3

#: what the kernel answers on a FUSE mount whose daemon died (ECONNABORTED
#: while the connection is being torn down, ENOTCONN after)
DEAD = (errno.ENOTCONN, errno.ECONNABORTED)


def _stderr_is_journal() -> bool:
    """systemd connected stderr to the journal: ``$JOURNAL_STREAM`` names
    its device and inode (a child whose stderr went elsewhere inherits the
    variable, hence the check)."""
    try:
        dev, ino = (int(part) for part in os.environ["JOURNAL_STREAM"].split(":"))
        st = os.fstat(2)
    except (KeyError, ValueError, OSError):
        return False
    return (st.st_dev, st.st_ino) == (dev, ino)


#: sd-daemon(3) priority prefixes, which the journal takes off each line
_PRIORITY = {logging.CRITICAL: 2, logging.ERROR: 3, logging.WARNING: 4, logging.INFO: 6, logging.DEBUG: 7}


def _fail(message: str, status: int = EXIT_FAIL) -> int:
    # under systemd, an error (a status 0 one: a warning) at its own priority,
    # so `journalctl -p err` shows it; the journal stores everything else as info
    prefix = f"<{3 if status != EXIT_OK else 4}>" if _stderr_is_journal() else ""
    print(f"{prefix}zshardfs: {message}", file=sys.stderr)
    return status


_SURROGATE = re.compile("[\ud800-\udfff]")


def _escape_surrogate(m: re.Match) -> str:
    code = ord(m.group())
    # U+DC80..U+DCFF: a byte that was not UTF-8 (os.fsdecode's surrogateescape)
    return f"\\x{code - 0xDC00:02x}" if 0xDC80 <= code <= 0xDCFF else f"\\u{code:04x}"


#: characters of a message that would end its line or steer a terminal
#: (C0 and C1 controls but tab, DEL, Unicode line and paragraph separators)
_CONTROL = re.compile("[\x00-\x08\x0a-\x1f\x7f-\x9f\u2028\u2029]")


def _escape_control(m: re.Match) -> str:
    code = ord(m.group())
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"


def printable(text: str) -> str:
    """``text`` as one line of valid UTF-8: bytes that were not UTF-8 and
    control characters written as ``\\xNN`` (what a log line's message gets)."""
    return _SURROGATE.sub(_escape_surrogate, _CONTROL.sub(_escape_control, text))


def shell_word(text: str) -> str:
    """``text`` as one shell word on one line, to be pasted: shlex.quote;
    holding control characters (a newline) or bytes that are not UTF-8,
    bash's ``$'...'`` with them as ``\\xNN`` (the bytes of the name)."""
    if not _CONTROL.search(text) and not _SURROGATE.search(text):
        return shlex.quote(text)
    out = []
    for ch in text:
        code = ord(ch)
        if ch in "\\'":
            out.append("\\" + ch)
        elif 0xDC80 <= code <= 0xDCFF:
            out.append(f"\\x{code - 0xDC00:02x}")
        elif _CONTROL.match(ch) or _SURROGATE.match(ch):
            out.append("".join(f"\\x{b:02x}" for b in ch.encode("utf-8", "surrogatepass")))
        else:
            out.append(ch)
    return "$'" + "".join(out) + "'"


class _Formatter(logging.Formatter):
    """Log lines name paths, and a path read from disk need not be UTF-8
    (its bytes come as surrogate escapes, which no UTF-8 stream accepts):
    they are written as ``\\xNN``, so the line reaches the file, syslog or
    stderr instead of being lost to an encoding error.  Control characters
    of a message (a name with a newline, made by whoever may write into the
    source) are written as ``\\xNN`` too: one event stays one line, and no
    name can forge a line of its own.  A traceback (logged on purpose, for
    a bug) keeps its own lines, but the text of each exception in it (its
    message and notes, which name store files) is escaped as a message is:
    a name with a newline splits no line there either."""

    journal = False  # (stderr is the journal: each line gets its priority prefix)

    def formatMessage(self, record: logging.LogRecord) -> str:
        message = record.message
        if not _CONTROL.search(message):
            return super().formatMessage(record)
        record.message = _CONTROL.sub(_escape_control, message)
        try:
            return super().formatMessage(record)
        finally:
            record.message = message

    @staticmethod
    def _escape_exception_texts(text: str, exc: BaseException | None) -> str:
        seen, texts = set(), []
        while exc is not None and id(exc) not in seen:  # (the chain the traceback shows)
            seen.add(id(exc))
            try:
                texts += [str(exc), *(str(note) for note in getattr(exc, "__notes__", None) or ())]
            except Exception:  # noqa: BLE001 - (a __str__ that fails: the traceback says so)
                pass
            exc = exc.__cause__ or (None if exc.__suppress_context__ else exc.__context__)
        for part in sorted({t for t in texts if _CONTROL.search(t)}, key=len, reverse=True):
            text = text.replace(part, _CONTROL.sub(_escape_control, part))
        return text

    def format(self, record: logging.LogRecord) -> str:
        text = super().format(record)
        if record.exc_info:  # (its exc_text may have been made by another handler's formatter: not here)
            text = self._escape_exception_texts(text, record.exc_info[1])
        text = _SURROGATE.sub(_escape_surrogate, text)
        if self.journal:
            prefix = f"<{_PRIORITY.get(record.levelno, 6 if record.levelno < logging.WARNING else 3)}>"
            text = "\n".join(prefix + line for line in text.split("\n"))
        return text


#: where a background daemon without ``-o log_file`` logs
SYSLOG = "/dev/log"


#: mode of a log file the daemon makes: its lines name the store's files
#: (and, at -o debug, every request), which a mount without allow_other
#: shows to no other user; an existing file keeps its own (logrotate's create)
LOG_FILE_MODE = 0o640


def open_log_file(path: str) -> int:
    """A descriptor of ``path`` for appending, made with LOG_FILE_MODE if new.
    Never through a symbolic link at ``path`` (O_NOFOLLOW: ELOOP): one put
    there would make the daemon append to, or create, the file it names.
    Never a FIFO (ENXIO): its open for writing waits for a reader, and its
    writes for one that reads, for ever -- the mount command, or the daemon's
    event loop at a reopen (a FIFO put there after a rotation), with it.
    Never a device but /dev/null (ENODEV): a terminal (the command's, gone
    once it ends), a disk, /dev/zero would take the lines and keep none."""
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK
                 | os.O_NOCTTY, LOG_FILE_MODE)  # (O_NONBLOCK: a FIFO without a reader is ENXIO at once)
    try:
        st = os.fstat(fd)
        if stat.S_ISFIFO(st.st_mode):
            raise OSError(errno.ENXIO, "a FIFO", path)
        if not stat.S_ISREG(st.st_mode) and not _is_dev_null(st):
            raise OSError(errno.ENODEV, "a device", path)
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _is_dev_null(st: os.stat_result) -> bool:
    return stat.S_ISCHR(st.st_mode) and st.st_rdev == os.makedev(1, 3)


def _log_open_error(path: str, exc: OSError) -> str:
    try:  # (a device may fail to open at all: /dev/tty without a terminal is ENXIO)
        mode = os.stat(path, follow_symlinks=False).st_mode
        device = stat.S_ISCHR(mode) or stat.S_ISBLK(mode)
    except OSError:
        device = False
    if exc.errno == errno.ENODEV or device:
        return (f"the log file {path!r} is a device; only a regular file (or /dev/null) is written to "
                f"(give the path of a file)")
    if exc.errno == errno.ELOOP:
        return f"the log file {path!r} is a symbolic link; it is not followed (give the path of a file)"
    if exc.errno == errno.ENXIO:
        return f"the log file {path!r} is a FIFO (or a socket); it is not written to (give the path of a file)"
    return f"cannot write the log file {path!r}: {exc.strerror}"


class _LogFile(logging.handlers.WatchedFileHandler):
    """The ``-o log_file`` handler.  Opened anew when logrotate moved the
    file away (WatchedFileHandler: at the next line) and at :meth:`reopen`
    (SIGHUP, a postrotate script's way to say so).  Once :meth:`take_std`
    was called (a background daemon), every opening points descriptors 1
    and 2 at the new file too: libfuse's ``debug`` trace and last-resort
    messages follow the log instead of filling a rotated (or deleted) file."""

    std_too = False
    #: (st_dev, st_ino) of what was at the path when it could not be opened
    #: (said once; tried again only once something else is there), or
    #: _ABSENT: nothing there, and nothing could be made (said once; tried
    #: again at each line, as the directory may come back)
    _refused: tuple | str | None = None
    _ABSENT = "absent"

    def reopenIfNeeded(self):
        """WatchedFileHandler's, but a file that cannot be opened anew (a
        symbolic link now at the path) leaves the one open in use: logging
        goes on there, and one line there says so."""
        try:
            st = os.stat(self.baseFilename, follow_symlinks=False)
        except FileNotFoundError:
            st = None
        if st is not None and (st.st_dev, st.st_ino) in ((self.dev, self.ino), self._refused):
            return
        if self.stream is None:
            return  # (emit opens it)
        self._reopen_keeping_old(st)

    def _reopen_keeping_old(self, st) -> bool:
        try:
            stream = self._open()
        except OSError as exc:
            what = (st.st_dev, st.st_ino) if st is not None else self._ABSENT
            if self._refused != what:  # (said once, not before every line logged)
                self._refused = what
                self._say(f"{_log_open_error(self.baseFilename, exc)}; logging goes on to the file open before")
            return False
        self._refused = None
        old, self.stream = self.stream, stream
        if old is not None:
            try:
                old.flush()
            finally:
                old.close()
        self._statstream()
        return True

    def _say(self, message: str) -> None:
        record = logging.makeLogRecord({"name": __name__, "levelno": logging.ERROR, "levelname": "ERROR",
                                        "msg": message})
        if self.stream is not None:
            self.stream.write(self.format(record) + self.terminator)
            self.stream.flush()

    def _open(self):
        stream = open(open_log_file(self.baseFilename), self.mode, encoding=self.encoding, errors=self.errors)
        if self.std_too:
            for std in (sys.stdout, sys.stderr):
                try:
                    std.flush()
                except (OSError, ValueError):
                    pass
            for fd in (1, 2):
                os.dup2(stream.fileno(), fd)
        return stream

    def take_std(self) -> None:
        """From now on fds 1 and 2 write to the log file (and follow it)."""
        self.std_too = True
        self.reopen()

    def reopen(self) -> bool:
        """Open the path again (rotated or not) and close the file open
        before; False if it could not be opened (then that one stays in
        use, and a line there says why)."""
        self.acquire()
        try:
            try:
                st = os.stat(self.baseFilename, follow_symlinks=False)
            except OSError:
                st = None
            self._refused = None  # (asked for: said again if refused again)
            return self._reopen_keeping_old(st)
        finally:
            self.release()


def _setup_logging(cfg: MountConfig, background: bool) -> logging.Handler:
    root = logging.getLogger()
    root.handlers.clear()
    fmt = "%(asctime)s zshardfs[%(process)d] %(levelname)s %(name)s: %(message)s"
    if cfg.log_file:
        handler: logging.Handler = _LogFile(cfg.log_file, errors="backslashreplace")
    elif background and os.path.exists(SYSLOG):
        handler = logging.handlers.SysLogHandler(SYSLOG)
        fmt = "zshardfs[%(process)d]: %(levelname)s %(name)s: %(message)s"
    else:
        handler = logging.StreamHandler(sys.stderr)
    journal = isinstance(handler, logging.StreamHandler) and handler.stream is sys.stderr and _stderr_is_journal()
    if journal:  # (systemd's journal: its own time and pid, the level as the line's priority)
        fmt = "%(levelname)s %(name)s: %(message)s"
    formatter = _Formatter(fmt)
    formatter.journal = journal
    handler.setFormatter(formatter)
    root.addHandler(handler)
    root.setLevel(cfg.log_level)
    # boto's own chatter (which could include request details) stays quiet
    for noisy in ("botocore", "boto3", "urllib3", "s3transfer"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    # an answer cut within its headers: urllib3 warns with a traceback, and the
    # S3 backend asks again (backends/s3.py, _cut_short)
    logging.getLogger("urllib3.connection").setLevel(logging.ERROR)
    return handler


def check_mountpoint(path: str) -> None:
    if not os.path.exists("/dev/fuse"):
        raise ConfigError("/dev/fuse is missing: load the fuse kernel module (modprobe fuse) or install fuse3")
    if shutil.which("fusermount3") is None:
        raise ConfigError("fusermount3 is not installed (Debian/Ubuntu: apt-get install fuse3)")
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise ConfigError(f"mountpoint {path!r} does not exist") from None
    except OSError as exc:
        if exc.errno in DEAD:  # a FUSE mount whose daemon died
            raise ConfigError(f"mountpoint {path!r} is a dead mount (its daemon is gone); "
                              f"run 'zshardfs umount {path}' first") from None
        raise ConfigError(f"mountpoint {path!r}: {exc.strerror}") from None
    if not stat.S_ISDIR(st.st_mode):
        raise ConfigError(f"mountpoint {path!r} is not a directory")
    if os.path.ismount(path):
        try:
            os.listdir(path)
        except OSError as exc:
            if exc.errno in DEAD:
                raise ConfigError(f"mountpoint {path!r} is a dead mount (its daemon is gone); "
                                  f"run 'zshardfs umount {path}' first") from None
        raise ConfigError(f"mountpoint {path!r} is already a mount point")
    try:
        if os.listdir(path):
            raise ConfigError(f"mountpoint {path!r} is not empty")
    except PermissionError:
        raise ConfigError(f"mountpoint {path!r} is not accessible") from None


def check_not_inside_source(source: str, mountpoint: str) -> None:
    """A mountpoint inside a local source (or the source itself) would put
    the view inside itself: every read of the daemon's own storage would
    come back to it as a FUSE request.  Compared by device and inode, so
    symlinks and bind mounts cannot hide it."""
    if "://" in source:
        return
    try:
        src = os.stat(source)
    except OSError:
        return  # a missing or unreadable source is reported by the daemon
    path = os.path.realpath(mountpoint)
    while True:
        try:
            st = os.stat(path)
        except OSError:
            return
        if (st.st_dev, st.st_ino) == (src.st_dev, src.st_ino):
            where = "is the source" if path == os.path.realpath(mountpoint) else f"is inside the source {source!r}"
            raise ConfigError(f"mountpoint {mountpoint!r} {where}: the view would contain itself; "
                              f"choose a mountpoint outside the source")
        parent = os.path.dirname(path)
        if parent == path:
            return
        path = parent


#: how the background daemon gets ``--endpoint-url``: a ``user:password@``
#: in it must not be on the long-lived daemon's command line, which every
#: user can read (ps); a process's environment only its owner can
ENDPOINT_ENV = "_ZSHARDFS_ENDPOINT_URL"


def _build_config(args) -> MountConfig:
    cfg = MountConfig(source=args.source, mountpoint=os.path.abspath(args.mountpoint))
    cfg.foreground = args.foreground
    cfg.endpoint_url = args.endpoint_url
    if args.ready_fd is not None:  # the daemon _spawn started
        endpoint = os.environ.pop(ENDPOINT_ENV, None)
        if cfg.endpoint_url is None:
            cfg.endpoint_url = endpoint
    cfg.region = args.region
    cfg.profile = args.profile
    parse_options(cfg, args.o or [])
    if not cfg.source.startswith("s3://") and "://" not in cfg.source:
        cfg.source = os.path.abspath(cfg.source)
    if cfg.log_file:
        # the daemon runs in / (it must not keep the caller's directory busy);
        # abspath keeps a leading "//" (POSIX leaves it to the system; Linux
        # takes it as "/"): made "/" so the name checks know //dev/stderr
        cfg.log_file = "/" + os.path.abspath(cfg.log_file).lstrip("/")
    return cfg


#: names of the command's own standard streams (links to its descriptors)
_STD_STREAM = re.compile(r"/dev/(stdin|stdout|stderr)|/dev/fd/\d+|/proc/(self|thread-self|\d+)/fd/\d+")


def check_log_file(cfg: MountConfig) -> None:
    """A log the daemon cannot open must fail here, not in a detached child;
    one inside the mountpoint would be hidden by the mount (and, made
    first, make the mountpoint not empty).  The command's own streams
    (``/dev/stderr``...) are refused by name: a background daemon keeps
    none of them once mounted, and without the option a foreground one
    logs to its stderr already."""
    if not cfg.log_file:
        return
    if _STD_STREAM.fullmatch(cfg.log_file):
        raise OptionError(f"the log file {cfg.log_file!r} is one of the command's standard streams, which a "
                          f"background daemon does not keep once mounted; drop -o log_file: with --foreground "
                          f"the daemon logs to its stderr (under systemd, the journal), in the background to syslog")
    mnt = os.path.realpath(cfg.mountpoint)
    if os.path.realpath(cfg.log_file).startswith(mnt.rstrip("/") + "/"):
        raise ConfigError(f"the log file {cfg.log_file!r} is inside the mountpoint; put it elsewhere")
    try:
        with open(open_log_file(cfg.log_file), "a"):
            pass
    except OSError as exc:
        raise ConfigError(_log_open_error(cfg.log_file, exc)) from None


def cmd_mount(args) -> int:
    if args.ready_fd is not None and not args.foreground:  # (it was ignored: _spawn makes its own)
        return _fail(f"mount: --ready-fd {args.ready_fd} is for the daemon 'zshardfs mount' starts, which serves in "
                     f"the foreground; it needs --foreground (see 'zshardfs mount --help')", EXIT_USAGE)
    if args.ready_fd is not None:  # (internal: _spawn's pipe to its daemon)
        try:
            os.fstat(args.ready_fd)
        except (OSError, OverflowError):
            return _fail(f"--ready-fd {args.ready_fd}: not an open descriptor (it is for 'zshardfs mount' "
                         f"itself, to hear from its daemon)", EXIT_USAGE)
    try:
        cfg = _build_config(args)
        check_mountpoint(cfg.mountpoint)
        check_not_inside_source(cfg.source, cfg.mountpoint)
        check_log_file(cfg)
    except ConfigError as exc:
        return _fail(str(exc), EXIT_USAGE if isinstance(exc, OptionError) else EXIT_FAIL)
    if cfg.foreground:
        return _serve(cfg, args.ready_fd)
    code = _spawn(args, cfg)
    if code == EXIT_OK and not cfg.log_file and not os.path.exists(SYSLOG):
        # (the daemon's errors, a "lost" line included, would go nowhere)
        print(f"zshardfs: warning: no syslog socket ({SYSLOG}): the background daemon's log is discarded; "
              f"give -o log_file=PATH to keep it", file=sys.stderr)
    return code


def _redirect_std(path: str) -> None:
    """Point stdout/stderr at ``path`` (appending): libfuse's ``debug``
    output and any last-resort Python message go there, not to a terminal
    long gone (the log file is followed by :class:`_LogFile` instead)."""
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        for std in (1, 2):
            os.dup2(fd, std)
    finally:
        os.close(fd)


def _serve(cfg: MountConfig, ready_fd: int | None) -> int:
    from .backends.base import StoreError
    from .daemon import run

    background = ready_fd is not None
    pending = [ready_fd] if background else []

    def tell(message: str) -> None:
        # at most once: after close, the descriptor number may be reused
        while pending:
            fd = pending.pop()
            try:
                os.write(fd, message.encode(errors="replace") + b"\n")
            except OSError:
                pass
            finally:
                try:
                    os.close(fd)
                except OSError:
                    pass

    try:
        handler = _setup_logging(cfg, background=background)
    except OSError as exc:
        message = f"cannot write the log file {cfg.log_file!r}: {exc.strerror}"
        tell(f"error: {message}")
        return _fail(message)
    if background:
        os.chdir("/")

    was_ready = []

    def ready() -> None:
        # (not before: until the mount is there, stderr is what _spawn shows
        # as the reason of a failure, such as libfuse's or fusermount3's)
        if background and isinstance(handler, _LogFile):
            handler.take_std()
        elif background:
            _redirect_std(os.devnull)
        tell("ok")
        _sd_notify("READY=1")  # (systemd, Type=notify)
        was_ready.append(True)

    try:
        ended = run(cfg, ready=ready, reopen_log=handler.reopen if isinstance(handler, _LogFile) else None)
    except (ConfigError, StoreError) as exc:
        tell(f"error: {exc}")
        return _fail(str(exc))
    except RuntimeError as exc:  # pyfuse3: fuse_session_mount failed
        tell(f"error: cannot mount on {cfg.mountpoint}: {exc}")
        return _fail(f"cannot mount on {cfg.mountpoint}: {exc}")
    except KeyboardInterrupt:
        if was_ready:
            return EXIT_OK
        tell("error: interrupted before the mount was ready")
        return _fail("interrupted before the mount was ready")
    except Exception as exc:  # a bug: one traceback in the log, one line for the user
        log.exception("the daemon failed")
        message = f"internal error: {type(exc).__name__}: {exc} (see the log)"
        tell(f"error: {message}")
        return _fail(message)
    return {"ok": EXIT_OK, "lost": EXIT_LOST}.get(ended, EXIT_FAIL)


def _sd_notify(message: str) -> None:
    """Tell systemd (``Type=notify``) how the service is: ``READY=1`` once
    the mount is there, so units ordered after it find the view.  Nothing
    without ``$NOTIFY_SOCKET``."""
    address = os.environ.get("NOTIFY_SOCKET")
    if not address:
        return
    if address.startswith("@"):  # an abstract socket
        address = "\0" + address[1:]
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
            sock.connect(address)
            sock.sendall(message.encode())
    except OSError as exc:
        log.warning("cannot notify systemd (%s): %s", os.environ.get("NOTIFY_SOCKET"), exc.strerror)


def _spawn(args, cfg: MountConfig) -> int:
    """Start ``zshardfs mount --foreground`` detached and wait for its word."""
    read_fd, write_fd = os.pipe()
    argv = _daemon_argv(args, write_fd)
    env = dict(os.environ)
    env.pop(ENDPOINT_ENV, None)
    if args.endpoint_url is not None:
        env[ENDPOINT_ENV] = args.endpoint_url
    # The child's stderr goes to an unlinked temporary file until it is
    # ready (then it points it at the log or /dev/null): if it dies first,
    # its last words are the reason we show.
    with open(os.devnull, "rb") as devnull_in, open(os.devnull, "wb") as devnull_out, \
            tempfile.TemporaryFile() as early_err:
        proc = subprocess.Popen(argv, stdin=devnull_in, stdout=devnull_out, stderr=early_err,
                                pass_fds=(write_fd,), start_new_session=True, close_fds=True, env=env)
        os.close(write_fd)
        with os.fdopen(read_fd, "rb") as pipe:
            answer = pipe.readline().decode(errors="replace").strip()
        if answer == "ok":
            return EXIT_OK
        if answer.startswith("error: "):
            # the daemon's words; what libfuse or fusermount3 said before
            # (why the mount failed: "mount failed: Operation not permitted",
            # "failed to open /dev/fuse: Permission denied") is on its stderr
            message = answer[len("error: "):]
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
            lines = [ln for ln in _last_words(early_err) if not ln.startswith("zshardfs: ")]
            if lines and lines[-1] not in message:
                message += f" ({lines[-1]})"
            return _fail(message)
        code = proc.wait()
        lines = _last_words(early_err)
    reason = f": {lines[-1]}" if lines else (f" (see {cfg.log_file})" if cfg.log_file else "")
    return _fail(f"the daemon exited ({code}) before the mount was ready{reason}")


def _last_words(early_err) -> list[str]:
    """The non-empty lines of the end of the daemon's early stderr."""
    fd = early_err.fileno()
    size = os.fstat(fd).st_size
    tail = os.pread(fd, 4096, max(0, size - 4096))  # (pread: the child shares the file offset)
    return [ln.strip() for ln in tail.decode(errors="replace").splitlines() if ln.strip()]


def _daemon_argv(args, ready_fd: int) -> list[str]:
    """The background daemon's command line, rebuilt from the parsed
    arguments, without ``--endpoint-url`` (see :data:`ENDPOINT_ENV`)."""
    argv = [sys.executable, "-m", "zshardfs.cli", "mount", "--foreground", "--ready-fd", str(ready_fd)]
    argv += [f"-o{group}" for group in args.o or [] if group]
    if args.region is not None:
        argv.append(f"--region={args.region}")
    if args.profile is not None:
        argv.append(f"--profile={args.profile}")
    return [*argv, "--", args.source, args.mountpoint]


def _control(mountpoint: str, name: str) -> bytes:
    try:
        return os.getxattr(mountpoint, name)
    except OSError as exc:
        if exc.errno in DEAD:
            raise ConfigError(f"{mountpoint!r} is a dead mount (its daemon is gone); "
                              f"'zshardfs umount {mountpoint}' removes it") from None
        owner = _mount_owner(os.path.realpath(mountpoint)) if exc.errno in (errno.EACCES, errno.EPERM) else None
        if owner is not None and owner != os.getuid():  # (the kernel keeps others out without allow_other)
            raise ConfigError(f"{mountpoint!r} is uid {owner}'s zshardfs mount, mounted without allow_other: "
                              "only that user and root can reach it") from None
        raise ConfigError(f"{mountpoint!r} is not a zshardfs mount point") from None


def _sync(mnt: str) -> str | None:
    """Ask the daemon to store everything it holds; an error text or None."""
    try:  # (a read: unlike setxattr it takes no lock the mount's other users wait for)
        os.getxattr(mnt, "user.zshardfs.sync")
    except OSError as exc:
        if exc.errno == errno.EACCES:  # (the daemon's answer to another user)
            return f"{mnt}: only the mount's owner or root can sync it"
        if exc.errno != errno.ENODATA:
            return f"sync of {mnt} failed: {os.strerror(exc.errno)} (see the daemon's log)"
        try:  # a daemon started by an older zshardfs knows only the setxattr
            os.setxattr(mnt, "user.zshardfs.sync", b"1")
        except OSError as exc2:
            if exc2.errno == errno.EROFS:
                return None
            return f"sync of {mnt} failed: {os.strerror(exc2.errno)} (see the daemon's log)"
    return None


def _damaged_way_out(mnt: str, again: str) -> str:
    """After a refused sync (``zshardfs sync``, or the one ``zshardfs
    umount`` makes: ``again`` names the command): the shards it held writes
    for that no retry stores (damaged in storage, see SEMANTICS Limits), and
    the ways out; "" if none."""
    try:
        damaged = json.loads(_control(mnt, "user.zshardfs.stats"))["writeback"].get("damaged_shards") or []
    except (ConfigError, ValueError, KeyError, TypeError):
        return ""
    if not damaged:
        return ""
    q = shlex.quote(mnt)
    return (f"; no retry can store the writes held for the damaged shard(s) {', '.join(damaged)} "
            f"(damage in storage a rewrite cannot keep, see the daemon's log): repairing or removing the shard "
            f"in storage lets the next retry store them (then 'zshardfs {again} {q}' again), or "
            f"'zshardfs umount -z {q}' then stopping the daemon (SIGTERM twice) discards what it holds")


def _not_owner(mnt: str, what: str) -> str | None:
    """Why the caller may not ``what`` (sync, unmount) the zshardfs mount
    ``mnt``, or None: only its owner (``user_id=`` in /proc/mounts) and
    root may."""
    owner = _mount_owner(mnt)
    if owner is None or os.getuid() in (0, owner):
        return None
    return f"{mnt}: only the mount's owner or root can {what} it (it is uid {owner}'s, you are uid {os.getuid()})"


def cmd_sync(args) -> int:
    mnt = os.path.abspath(args.mountpoint)
    refused = _not_owner(os.path.realpath(mnt), "sync")
    if refused:
        return _fail(refused)
    try:
        _control(mnt, "user.zshardfs.pid")
    except ConfigError as exc:
        return _fail(str(exc))
    problem = _sync(mnt)
    return _fail(problem + _damaged_way_out(mnt, "sync")) if problem else EXIT_OK


def cmd_reopen_log(args) -> int:
    """Have the daemon reopen its ``-o log_file`` (after logrotate moved it
    away) and return once it has: the unit's ExecReload, so ``systemctl
    reload`` is done when it says so (a SIGHUP is asynchronous)."""
    mnt = os.path.abspath(args.mountpoint)
    refused = _not_owner(os.path.realpath(mnt), "reopen the log of")
    if refused:
        return _fail(refused)
    try:
        pid = int(_control(mnt, "user.zshardfs.pid"))
    except (ConfigError, ValueError) as exc:
        return _fail(str(exc))
    try:
        answer = os.getxattr(mnt, "user.zshardfs.reopen_log")
        if answer.startswith(b"kept"):
            return _fail(f"{mnt}: the daemon could not open its log file anew (a line in the file it logs to "
                         "says why); it goes on logging there")
    except OSError as exc:
        if exc.errno == errno.EACCES:  # (the daemon's answer to another user)
            return _fail(f"{mnt}: only the mount's owner or root can reopen its log")
        if exc.errno != errno.ENODATA:
            return _fail(f"reopening the log of {mnt} failed: {os.strerror(exc.errno)}")
        try:  # a daemon started by an older zshardfs: the signal it knows (not waited for)
            os.kill(pid, signal.SIGHUP)
        except OSError as exc2:
            return _fail(f"reopening the log of {mnt} failed: {os.strerror(exc2.errno)}")
    return EXIT_OK


def _unescape_mount_field(field: str) -> str:
    """/proc/mounts writes space, tab, newline and backslash as octal escapes."""
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), field)


def _unescape_fsname(text: str) -> str:
    """A local source as :func:`daemon.fuse_option_value` wrote it into the
    mount's fsname (characters that are not printable ASCII as ``\\xNN``,
    ``\\uNNNN``), as it was."""
    return re.sub(r"\\(x[0-9a-f]{2}|u[0-9a-f]{4}|U[0-9a-f]{8})", lambda m: chr(int(m.group(1)[1:], 16)), text)


def _zshardfs_mounts() -> dict[str, list[str]]:
    """Mount points /proc/mounts lists as zshardfs mounts (it lists them
    also when the daemon is dead and every access fails with ENOTCONN), and
    the mount options of each (``ro``, ``user_id=``...)."""
    found = {}
    try:
        with open("/proc/mounts", encoding="utf-8", errors="surrogateescape") as f:
            for line in f:
                fields = line.split()
                if len(fields) >= 4 and fields[2] == "fuse.zshardfs":
                    found[_unescape_mount_field(fields[1])] = fields[3].split(",")
    except OSError:
        pass
    return found


def _mount_source(mnt: str) -> str | None:
    """The source (store) /proc/mounts names for the zshardfs mount ``mnt``:
    there also when its daemon is dead and the mount answers nothing."""
    try:
        with open("/proc/mounts", encoding="utf-8", errors="surrogateescape") as f:
            for line in f:
                fields = line.split()
                if len(fields) >= 3 and fields[2] == "fuse.zshardfs" and _unescape_mount_field(fields[1]) == mnt:
                    return _unescape_mount_field(fields[0]) or None
    except OSError:
        pass
    return None


def _mount_owner(mnt: str) -> int | None:
    """The uid of the zshardfs mount ``mnt`` (its daemon's), if it is one."""
    for option in _zshardfs_mounts().get(mnt, ()):
        if option.startswith("user_id="):
            try:
                return int(option[len("user_id="):])
            except ValueError:
                return None
    return None


def _is_zshardfs_mount(mnt: str) -> bool:
    return mnt in _zshardfs_mounts()


def _inside_zshardfs_mount(path: str) -> str | None:
    """The zshardfs mount point ``path`` is (or lies below), if any."""
    for mnt in sorted(_zshardfs_mounts(), key=len, reverse=True):
        if path == mnt or path.startswith(mnt.rstrip("/") + "/"):
            return mnt
    return None


def process_running(pid: int) -> bool:
    """True while ``pid`` runs.  A zombie has finished: its parent (often
    init, which may reap late) is none of our business."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            state = f.read().rsplit(b")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in (b"Z", b"X")


def cmd_umount(args) -> int:
    mnt = os.path.realpath(args.mountpoint)  # (fusermount3 wants the mount point itself, not a link)
    if args.if_dead:  # (the systemd unit, before a start: a killed daemon's mount would refuse it)
        if not _is_zshardfs_mount(mnt):
            return EXIT_OK
        try:
            os.getxattr(mnt, "user.zshardfs.pid")  # (never cached by the kernel, unlike stat)
            return EXIT_OK  # it answers: live
        except OSError as exc:
            if exc.errno not in DEAD:
                return EXIT_OK
        args.lazy = True
        dead_ro = "ro" in _zshardfs_mounts().get(mnt, ())
    refused = _not_owner(mnt, "unmount")
    if refused:  # (before its sync: fusermount3 would refuse the unmount after it)
        return _fail(refused)
    if args.lazy and _is_zshardfs_mount(mnt):
        # the escape hatch: asks the daemon nothing (a wedged one would never
        # answer), detaches at once; the daemon stores what it holds and ends
        # when the last open file is closed
        result = subprocess.run(["fusermount3", "-uz", mnt], capture_output=True, text=True)
        if result.returncode != 0:
            return _fail(f"cannot unmount {mnt}: {result.stderr.strip() or 'fusermount3 failed'}")
        if args.if_dead:  # (the unit's start after a crash: the one trace in its journal that data may be lost)
            return _fail(f"removed the dead mount at {mnt} (its daemon had died); anything it had not "
                         f"stored yet is lost{' (a read-only mount: nothing was)' if dead_ro else ''}", EXIT_OK)
        return EXIT_OK
    try:
        pid: int | None = int(_control(mnt, "user.zshardfs.pid"))
    except ConfigError as exc:
        if not _is_zshardfs_mount(mnt):
            return _fail(str(exc))
        pid = None  # the daemon is gone (killed): only the dead mount is left to remove
    read_only = "ro" in _zshardfs_mounts().get(mnt, ())
    lost = f"anything it had not stored yet is lost{' (a read-only mount: nothing was)' if read_only else ''}"
    if pid is not None:
        problem = _sync(mnt)
        if problem and not process_running(pid):  # (killed while it stored: ECONNABORTED)
            subprocess.run(["fusermount3", "-uz", mnt], capture_output=True)
            return _fail(f"the daemon of {mnt} died during the final sync ({problem}); its mount is removed, "
                         f"and {lost}")
        if problem:
            return _fail(problem + "; not unmounted, the data is still held by the daemon"
                         + _damaged_way_out(mnt, "umount"))
        if not args.lazy:
            # the daemon then ends also when a copy of the mount in another mount
            # namespace would keep it serving (see daemon.Mount._watch_unmount)
            try:
                os.getxattr(mnt, "user.zshardfs.unmounting")
            except OSError:
                pass  # (a daemon of an older zshardfs: ENODATA; it is waited for as before)
    result = subprocess.run(["fusermount3", "-u", *(["-z"] if args.lazy else []), mnt],
                            capture_output=True, text=True)
    if result.returncode != 0:
        if pid is not None and not args.lazy:
            try:  # (the daemon's watch for the unmount ends: see daemon.Mount._watch_unmount)
                os.getxattr(mnt, "user.zshardfs.unmount_refused")
            except OSError:
                pass
        why = result.stderr.strip() or "fusermount3 failed"
        if "busy" in why:  # (an open file or a working directory there: whose, and the way out)
            why += (f" (in use: 'fuser -vm {shlex.quote(mnt)}' shows by whom; "
                    f"'zshardfs umount -z {shlex.quote(mnt)}' detaches it now, its daemon ending when they are done)")
        return _fail(f"cannot unmount {mnt}: {why}")
    if pid is None:
        # a dead mount removed: not a clean unmount, unless it held nothing to store
        message = f"the daemon of {mnt} had died; its mount is removed, and {lost}"
        return _fail(message, EXIT_OK) if read_only else _fail(message)
    if args.lazy:
        return EXIT_OK  # lazy: the daemon ends when the last open file is closed
    deadline = time.monotonic() + args.timeout
    while time.monotonic() < deadline:
        if not process_running(pid):
            return EXIT_OK
        time.sleep(0.02)
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
    calls = stats.get("storage_calls", {})
    slots = f"/{calls['slots']}" if "slots" in calls else ""  # (max_connections)
    deadline = f"timeout={calls['timeout_s']:g}s  " if "timeout_s" in calls else ""
    print(f"storage     slots_held={calls.get('slots_held', 0)}{slots}  {deadline}"
          f"given_up_running={calls.get('given_up_running', 0)} (calls given up at their deadline, still running)")
    for name in ("index_cache", "chunk_cache"):
        c = stats[name]
        print(f"{name:<11} hits={c['hits']} misses={c['misses']} evicted={c.get('evicted', 0)} entries={c['entries']} "
              f"bytes={c['bytes']}/{c['max_bytes']}"
              + (f" (+{c['beside_bytes']} kept beside: larger than the budget)" if c.get("beside_bytes") else ""))
    print(f"inodes      {stats['inodes']}")
    print(f"read-ahead  within shards={stats['prefetches']}  shards ahead={stats['read_aheads']}")
    k = stats["kernel"]
    print(f"kernel      reads={k['reads']}  open_fills={k['open_fills']}")
    if "handles" in stats:
        print("handles     " + "  ".join(f"{k}={v}" for k, v in stats["handles"].items()))
    if "writeback" in stats:  # (what only memory holds: a failed flush shows here)
        print("write-back  " + "  ".join(f"{k}={v}" for k, v in stats["writeback"].items()))
    if "gc" in stats:
        print("gc          " + "  ".join(f"{k}={v}" for k, v in stats["gc"].items()))
    if "rss_bytes" in stats:  # (the tables' entries: --json)
        trim = stats.get("malloc_trim", {})
        print(f"memory      rss={stats['rss_bytes'] >> 20}MiB  trims={trim.get('calls', 0)}  "
              f"returned={trim.get('returned_bytes', 0) >> 20}MiB")
    return EXIT_OK


def cmd_fsck(args) -> int:
    """Walk SOURCE's view without mounting it; exit 0 if nothing is wrong,
    1 if something is (each problem one line), 2 for a bad command line."""
    import trio

    from .backends.base import StoreError
    from .daemon import build_view, open_backend
    from .fsck import check

    cfg = MountConfig(source=args.source, mountpoint="")
    cfg.endpoint_url, cfg.region, cfg.profile = args.endpoint_url, args.region, args.profile
    try:
        parse_options(cfg, args.o or [])
        if not cfg.source.startswith("s3://") and "://" not in cfg.source:
            cfg.source = os.path.abspath(cfg.source)
        cfg.read_only = True  # it reports, never repairs
        view_of = _inside_zshardfs_mount(os.path.realpath(cfg.source)) if not cfg.source.startswith("s3://") else None
        if view_of is not None:  # what a mount shows is never damaged: its store may be
            try:
                store = json.loads(_control(view_of, "user.zshardfs.stats"))["source"]
                what = f"run: zshardfs fsck {shell_word(store)}"
            except (ConfigError, ValueError, KeyError):
                # (a dead mount answers nothing: the kernel's table names its source)
                store = _mount_source(view_of)
                if store and "://" not in store:  # (as the daemon wrote it: fuse_option_value)
                    store = next((p for p in (_unescape_fsname(store), store) if os.path.isdir(p)), None)
                what = (f"run: zshardfs fsck {shell_word(store)}" if store
                        else "give it the store that mount shows")
            return _fail(f"{cfg.source!r} is in the view of a zshardfs mount; fsck checks a store: {what}",
                         EXIT_USAGE)
        backend = open_backend(cfg)
    except ConfigError as exc:
        return _fail(str(exc), EXIT_USAGE if isinstance(exc, OptionError) else EXIT_FAIL)
    except StoreError as exc:
        return _fail(str(exc))
    try:
        report = trio.run(lambda: check(build_view(cfg, backend), data=args.data))
    except Exception as exc:  # noqa: BLE001 - one line, never a traceback
        return _fail(f"fsck of {cfg.source} stopped: {type(exc).__name__}: {exc}")
    if args.json:
        print(json.dumps({"source": cfg.source, **report.as_dict()}, indent=2))
    else:
        for problem in report.problems:
            print(f"problem: {printable(problem)}")  # (names from the store: one line each)
        read = f", {report.bytes_read} bytes read" if args.data else ""
        print(f"{cfg.source}: {report.directories} directories, {report.files} files "
              f"({report.chunk_files} chunk files){read}; {len(report.problems)} problems, "
              f"{report.errors} of them errors (damaged or unreadable)")
    return EXIT_FAIL if report.problems else EXIT_OK


class _Parser(argparse.ArgumentParser):
    """argparse, with a user error as one line naming the command (and
    where its help is) and exit status 2, as every other user error:
    not the usage block first (SEMANTICS 6.2)."""

    def error(self, message: str):
        sys.exit(_fail(f"{_usage_error(self.prog, message)}", EXIT_USAGE))


def _usage_error(prog: str, message: str) -> str:
    command = prog.removeprefix("zshardfs").strip()
    return f"{command + ': ' if command else ''}{message} (see '{prog} --help')"


def _wait_seconds(text: str) -> float:
    """``umount --timeout``: seconds, more than 0 (``inf``: wait for ever)."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if math.isnan(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds above 0")
    return value


def _endpoint_url(text: str) -> str:
    """``--endpoint-url``: ``http(s)://host[:port]``, checked here, so that a
    malformed one is a usage error (2) like every other, not a failed mount
    (1) found by a daemon started for nothing."""
    if not valid_endpoint_url(text):
        raise argparse.ArgumentTypeError(f"{redact_url(text)!r} is not an S3 endpoint URL: "
                                         f"expected http(s)://host[:port]")
    return text


def _region(text: str) -> str:
    """``--region``: a host label, checked here (a usage error, 2), as botocore
    would refuse it only once a daemon had been started for it (1)."""
    if not valid_region_name(text):
        raise argparse.ArgumentTypeError(f"{text!r} is not an S3 region name: expected letters, digits and "
                                         f"hyphens, such as us-east-1")
    return text


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="zshardfs", description="Mount a sharded array store as its unsharded view.")
    p.add_argument("-V", "--version", action="version", version=f"zshardfs {__version__}")
    sub = p.add_subparsers(dest="command", required=True)
    m = sub.add_parser("mount", help="mount SOURCE on MOUNTPOINT", formatter_class=argparse.RawDescriptionHelpFormatter,
                       epilog="options (-o; given more than once, the last value counts):\n" + describe_options())
    m.add_argument("source", help="local directory or s3://bucket[/prefix]")
    m.add_argument("mountpoint")
    m.add_argument("-o", action="append", metavar="OPT[,OPT...]", help="mount options (see below)")
    m.add_argument("-f", "--foreground", action="store_true", help="serve in the foreground until unmounted")
    m.add_argument("--endpoint-url", type=_endpoint_url, help="S3-compatible endpoint (MinIO, Ceph, ...)")
    m.add_argument("--region", type=_region, help="S3 region")
    m.add_argument("--profile", help="AWS credentials profile")
    m.add_argument("--ready-fd", type=int, help=argparse.SUPPRESS)
    m.set_defaults(func=cmd_mount)
    u = sub.add_parser("umount", help="unmount (waits until the daemon has finished)")
    u.add_argument("mountpoint")
    u.add_argument("-z", "--lazy", action="store_true", help="lazy unmount")
    u.add_argument("--if-dead", action="store_true",
                   help="only remove a dead mount (its daemon gone); a live one, or none, is left as it is")
    u.add_argument("--timeout", type=_wait_seconds, default=120.0,
                   help="seconds to wait for the daemon to exit (default 120)")
    u.set_defaults(func=cmd_umount)
    y = sub.add_parser("sync", help="store all written data now (what sync(1) cannot ask a FUSE daemon)")
    y.add_argument("mountpoint")
    y.set_defaults(func=cmd_sync)
    r = sub.add_parser("reopen-log", help="reopen the mount's -o log_file (after logrotate moved it), "
                                          "returning once it is (systemctl reload)")
    r.add_argument("mountpoint")
    r.set_defaults(func=cmd_reopen_log)
    s = sub.add_parser("stats", help="request counters and cache figures of a mount")
    s.add_argument("mountpoint")
    s.add_argument("--json", action="store_true", help="every figure, as JSON (also each internal table's size)")
    s.set_defaults(func=cmd_stats)
    f = sub.add_parser("fsck", help="walk SOURCE's view unmounted and report what a mount could not serve",
                       description="Walk the view of SOURCE as a mount shows it (without mounting it) and report, "
                                   "one line each, what a mount would answer with EIO or show as stored: damaged "
                                   "shard indexes, metadata that cannot be parsed, and with --data chunks that "
                                   "cannot be read. Read-only: it never repairs. Exit 0: no problem; 1: problems "
                                   "(or the source cannot be opened); 2: a bad command line.")
    f.add_argument("source", help="local directory or s3://bucket[/prefix]")
    f.add_argument("-o", action="append", metavar="OPT[,OPT...]",
                   help="mount options (a mount's OPTIONS can be given as they are): timeout, max_connections, "
                        "the caches and TTLs, prefetch*, follow_symlinks apply; "
                        f"{', '.join(FSCK_IGNORES)} change nothing")
    f.add_argument("--data", action="store_true", help="read every file too (the data, not only the indexes)")
    f.add_argument("--json", action="store_true", help="the report as JSON")
    f.add_argument("--endpoint-url", type=_endpoint_url, help="S3-compatible endpoint (MinIO, Ceph, ...)")
    f.add_argument("--region", type=_region, help="S3 region")
    f.add_argument("--profile", help="AWS credentials profile")
    f.set_defaults(func=cmd_fsck)
    return p


COMMANDS = ("mount", "umount", "sync", "reopen-log", "stats", "fsck")
#: the mount options fsck accepts (so a mount's own can be passed) that
#: mean nothing to it: it serves nothing, logs nothing, writes nothing
FSCK_IGNORES = ("ro", "rw", "allow_other", "debug", "log_level", "log_file", "fsname", "attr_timeout", "open_fill",
                "max_dirty", "flush_delay", "shard", "malloc_trim")


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] not in COMMANDS and not argv[0].startswith("-"):
        # mount.fuse3 calls "zshardfs SOURCE MOUNTPOINT -o OPTS"; a mistyped
        # command is no source (and "zshardfs umonut /mnt/view" must not
        # try to mount ./umonut there)
        close = [] if "/" in argv[0] else difflib.get_close_matches(argv[0], COMMANDS, n=1)  # (s3://sync: a source)
        if len(argv) < 2 or argv[1].startswith("-") or (close and not os.path.lexists(argv[0])):
            hint = f"did you mean {close[0]}? " if close else ""
            return _fail(f"unknown command {argv[0]!r} ({hint}commands: {', '.join(COMMANDS)}; "
                         f"see 'zshardfs --help')", EXIT_USAGE)
        argv = ["mount", *argv]
    args, extra = parser.parse_known_args(argv)
    if extra:  # (reported by the top-level parser, under its usage: name the command's)
        return _fail(_usage_error(f"zshardfs {args.command}", f"unrecognized arguments: {' '.join(extra)}"),
                     EXIT_USAGE)
    try:
        return args.func(args)
    except KeyboardInterrupt:
        return EXIT_FAIL
    except BrokenPipeError:  # zshardfs stats | head
        try:
            sys.stdout = open(os.devnull, "w")
        except OSError:
            pass
        return EXIT_FAIL


def mount_helper(argv: list[str] | None = None) -> int:
    """``mount.zshardfs SOURCE MOUNTPOINT [-sfnv] [-N ns] [-o opts] [-t type]``
    as mount(8) calls it for ``-t zshardfs`` (fstab type ``zshardfs``).
    ``-f`` (fake: only record the mount) mounts nothing; ``-s``, ``-n``,
    ``-v`` and ``-t`` change nothing here; ``-N`` (another namespace) is
    refused."""
    argv = list(sys.argv[1:] if argv is None else argv)
    positional, options, fake = [], [], False
    it = iter(argv)
    for arg in it:
        if arg in ("-o", "-t", "-N"):
            value = next(it, None)
            if value is None:
                return _fail(f"mount.zshardfs: {arg} needs a value", EXIT_USAGE)
            if arg == "-o":
                options.append(value)
            elif arg == "-N":
                return _fail("mount.zshardfs: -N (mounting in another namespace) is not supported", EXIT_USAGE)
        elif arg.startswith("-o") and len(arg) > 2:
            options.append(arg[2:])
        elif arg.startswith("-") and len(arg) > 1 and set(arg[1:]) <= set("sfnv"):
            fake = fake or "f" in arg
        elif arg.startswith("-") and len(arg) > 1:
            return _fail(f"mount.zshardfs: unknown flag {arg}", EXIT_USAGE)
        else:
            positional.append(arg)
    if len(positional) != 2:
        return _fail("usage: mount.zshardfs SOURCE MOUNTPOINT [-sfnv] [-o OPTIONS]", EXIT_USAGE)
    if fake:
        return EXIT_OK
    return main(["mount", *[f"-o{o}" for o in options], "--", *positional])


if __name__ == "__main__":
    sys.exit(main())
