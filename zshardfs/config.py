"""Mount options: parsed once, validated with clear messages, then frozen.

Every ``-o`` option a user can give is listed in :data:`OPTIONS` with its
meaning; ``zshardfs mount --help`` prints that table (README.md names the main ones).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field, fields
from urllib.parse import urlsplit


class ConfigError(ValueError):
    """A bad option or source; the message is shown to the user as is."""


class OptionError(ConfigError):
    """A bad ``-o`` option: a usage error (exit status 2)."""


def redact_url(url: str) -> str:
    """Drop any ``user:password@`` from an endpoint URL before showing it.
    Plain string surgery, so malformed URLs are redacted too."""
    scheme, sep, rest = url.partition("://")
    if not sep:
        scheme, rest = "", url
    authority, slash, path = rest.partition("/")
    authority = authority.rpartition("@")[2]
    return f"{scheme}{sep}{authority}{slash}{path}"


def valid_endpoint_url(url: str) -> bool:
    """``url`` can be an S3 endpoint: ``http(s)://host[:port][/...]``."""
    try:
        parts = urlsplit(url)
        parts.port  # raises ValueError on a bad port
    except ValueError:
        return False
    return parts.scheme in ("http", "https") and bool(parts.hostname) and not any(c.isspace() for c in url)


#: what botocore accepts as a region name (``botocore.utils.validate_region_name``:
#: a host label), here so that the command line need not load botocore
_REGION = re.compile(r"^(?![0-9]+$)(?!-)[a-zA-Z0-9-]{1,63}(?<!-)$")


def valid_region_name(name: str) -> bool:
    """``name`` can be an S3 region (``us-east-1``, a MinIO/Ceph zone name)."""
    return bool(_REGION.match(name))


#: ``<number>[unit]``: B, or K/M/G/T alone or followed by B or iB (binary either way)
_SIZE = re.compile(r"^(\d+(?:\.\d+)?)(?:([kKmMgGtT])(?:i?[bB])?|[bB])?$")
_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def parse_size(text: str, name: str) -> int:
    m = _SIZE.match(text.strip())
    if not m:
        raise OptionError(f"option {name}: {text!r} is not a size (examples: 65536, 64M, 1G)")
    return int(float(m.group(1)) * _UNITS[(m.group(2) or "").lower()])


#: the longest ``timeout`` accepted: a day is "never" for one storage
#: operation, and far larger values overflow socket timeouts on S3
MAX_TIMEOUT = 86400.0
#: the shortest: below it no S3 request and few disk reads could ever finish,
#: and every operation would fail at once with EIO
MIN_TIMEOUT = 0.1


def parse_seconds(text: str, name: str) -> float:
    """A duration: 0 or more seconds, ``inf`` for "never" (a TTL that never
    expires, a flush that never happens by itself); never NaN."""
    try:
        value = float(text)
    except ValueError:
        raise OptionError(f"option {name}: {text!r} is not a number of seconds") from None
    if math.isnan(value):
        raise OptionError(f"option {name}: {text!r} is not a number of seconds")
    if value < 0:
        raise OptionError(f"option {name}: must not be negative")
    return value


def parse_timeout(text: str, name: str) -> float:
    """A deadline: at least :data:`MIN_TIMEOUT` and at most :data:`MAX_TIMEOUT` seconds."""
    value = parse_seconds(text, name)
    if not MIN_TIMEOUT <= value <= MAX_TIMEOUT:
        raise OptionError(f"option {name}: must be at least {MIN_TIMEOUT:g} and at most {MAX_TIMEOUT:g} seconds")
    return value


def parse_int(text: str, name: str, minimum: int = 1, maximum: int | None = None) -> int:
    try:
        value = int(text)
    except ValueError:
        raise OptionError(f"option {name}: {text!r} is not a whole number") from None
    if value < minimum or (maximum is not None and value > maximum):
        raise OptionError(f"option {name}: must be at least {minimum}"
                          + (f" and at most {maximum}" if maximum is not None else ""))
    return value


#: storage requests in flight at most (each S3 connection pool is sized by
#: it; botocore fills the pool's queue up front, so 10**20 would never start)
MAX_CONNECTIONS = 1024
#: inner chunks per shard and dimension ``-o shard=K`` may ask for
MAX_SHARD_FACTOR = 4096
#: the smallest ``-o index_cache``: an index larger than the budget is still
#: used, kept beside it (one at a time, shards.ByteLRU), so any budget is
#: correct; a smaller one would only evict at once. Small budgets let tests
#: (scripts/difftest.py -o index_cache=1K) evict the indexes of small arrays.
MIN_INDEX_CACHE = 1 << 10


def parse_connections(text: str, name: str) -> int:
    return parse_int(text, name, maximum=MAX_CONNECTIONS)


@dataclass
class MountConfig:
    source: str
    mountpoint: str
    read_only: bool = False
    allow_other: bool = False
    follow_symlinks: bool = False
    debug: bool = False
    foreground: bool = False
    index_cache: int = 64 << 20
    chunk_cache: int = 64 << 20
    metadata_ttl: float = 1.0
    index_ttl: float = 1.0
    attr_timeout: float = 5.0
    max_connections: int = 16
    timeout: float = 30.0
    log_level: str = "INFO"
    log_file: str | None = None
    fsname: str | None = None
    prefetch: str = "on"
    prefetch_max: int = 16 << 20
    prefetch_gap: int = 1 << 20
    prefetch_ahead: int | None = None  # None: half the chunk cache on S3, 0 on local sources
    open_fill: int = 1 << 20
    max_dirty: int = 256 << 20
    flush_delay: float = 2.0
    shard: tuple[int, ...] | None = None
    malloc_trim: str = "on"
    # S3
    endpoint_url: str | None = None
    region: str | None = None
    profile: str | None = None
    extra: dict = field(default_factory=dict)


#: option name -> (field, parser, help)
OPTIONS = {
    "ro": ("read_only", None, "read-only mount: every mutation returns EROFS"),
    "rw": ("read_only", None, "read-write mount (the default)"),
    "allow_other": ("allow_other", None, "let other users access the mount (needs user_allow_other for non-root)"),
    "debug": ("debug", None, "log every request (implies log_level=DEBUG)"),
    "follow_symlinks": ("follow_symlinks", None, "local sources: follow symbolic links that lead out of the source "
                                                 "(only for sources no one else can write into)"),
    "index_cache": ("index_cache", parse_size,
                    "bytes of parsed shard indexes (and listings made of them) kept in memory, at least 1K "
                    "(default 64M)"),
    "chunk_cache": ("chunk_cache", parse_size, "bytes of chunk data kept in memory (default 64M)"),
    "metadata_ttl": ("metadata_ttl", parse_seconds, "seconds a metadata document/probe/listing is trusted, 0 to inf "
                     "(default 1)"),
    "index_ttl": ("index_ttl", parse_seconds, "seconds a shard index is trusted before re-validation, 0 to inf "
                  "(default 1)"),
    "attr_timeout": ("attr_timeout", parse_seconds, "kernel entry/attribute cache time in seconds, 0 to inf "
                     "(default 5)"),
    "max_connections": ("max_connections", parse_connections,
                        f"storage requests in flight at once, 1 to {MAX_CONNECTIONS}, and as many "
                        f"more given up at their deadline and not yet ended (default 16)"),
    "timeout": ("timeout", parse_timeout, f"deadline of one file-system request (all its storage calls together) "
                f"in seconds, at least {MIN_TIMEOUT:g} and at most {MAX_TIMEOUT:g}; then EIO (default 30)"),
    "log_level": ("log_level", str, "DEBUG, INFO, WARNING or ERROR (default INFO)"),
    "log_file": ("log_file", str, "write the log to this file (default: stderr in --foreground, else syslog); "
                                  "reopened at SIGHUP or SIGUSR1"),
    "fsname": ("fsname", str, "name shown in /proc/mounts (default: the source)"),
    "prefetch": ("prefetch", str, "read-ahead within shards during scans: on, off (default on)"),
    "prefetch_max": ("prefetch_max", parse_size, "bytes one read-ahead fetches at most (default 16M; at most a quarter of chunk_cache)"),
    "prefetch_gap": ("prefetch_gap", parse_size, "gap between chunks (or precomputed minishard indexes) still read in "
                     "one range (default 1M)"),
    "prefetch_ahead": ("prefetch_ahead", parse_size, "bytes of shards a scan fetches ahead of the reader, in the "
                       "background (default: half of chunk_cache on S3, 0 on local sources)"),
    "open_fill": ("open_fill", parse_size, "files up to this size are put in the kernel's page cache when opened, "
                  "saving the read round trip; 0 turns it off (default 1M)"),
    "max_dirty": ("max_dirty", parse_size, "written-but-unflushed bytes before writers wait (default 256M)"),
    "flush_delay": ("flush_delay", parse_seconds, "seconds after its last write (and close) a shard is flushed, 0 to "
                    "inf (inf: only when full, at max_dirty, fsync, sync or unmount; default 2)"),
    "malloc_trim": ("malloc_trim", str, "give memory freed back to the system once idle or after the write-back "
                    "set drained: on, off (default on)"),
    "shard": ("shard", None, "K or K1xK2x...: store new Zarr v3 arrays sharded, K inner chunks per shard and "
                             "dimension (at most 4096)"),
}


def parse_shard(text: str, name: str) -> tuple[int, ...]:
    try:
        parts = tuple(int(p) for p in text.lower().split("x"))
    except ValueError:
        raise OptionError(f"option {name}: {text!r} is not K or K1xK2x... (whole numbers)") from None
    if not parts or any(not 1 <= p <= MAX_SHARD_FACTOR for p in parts):
        raise OptionError(f"option {name}: every factor must be at least 1 and at most {MAX_SHARD_FACTOR}")
    return parts


OPTIONS["shard"] = ("shard", parse_shard, OPTIONS["shard"][2])


#: fstab and mount(8) options that mean nothing to a FUSE view (the kernel
#: keeps no atime for it; mount(8) handles ``user``, ``nofail`` and the like;
#: ``x-*`` and ``comment=`` are for other tools, e.g. ``x-systemd.*``)
IGNORED_OPTIONS = frozenset((
    "defaults", "_netdev", "nofail", "auto", "noauto", "user", "users", "nouser", "owner", "group",
    "nodev", "nosuid", "exec", "noexec", "dev", "suid",
    "atime", "noatime", "relatime", "norelatime", "strictatime", "nostrictatime", "lazytime", "nolazytime",
    "diratime", "nodiratime", "async",
))


def parse_options(cfg: MountConfig, opts: list[str]) -> MountConfig:
    """Apply ``-o a,b=c`` option strings to ``cfg``."""
    for group in opts:
        for item in filter(None, (s.strip() for s in group.split(","))):
            name, has_value, value = item.partition("=")
            if name in IGNORED_OPTIONS or name.startswith(("x-", "comment")):
                continue  # fstab/mount(8) options that mean nothing to us
            spec = OPTIONS.get(name)
            if spec is None:
                raise OptionError(f"unknown option {name!r} (see 'zshardfs mount --help')")
            attr, parser, _ = spec
            if parser is None:
                if has_value:
                    raise OptionError(f"option {name} takes no value")
                setattr(cfg, attr, name != "rw" if attr == "read_only" else True)
            else:
                if not has_value or value == "":
                    raise OptionError(f"option {name} needs a value ({name}=...)")
                setattr(cfg, attr, parser(value, name) if parser is not str else value)
    cfg.log_level = cfg.log_level.upper()
    if cfg.debug:
        cfg.log_level = "DEBUG"
    if cfg.log_level not in ("DEBUG", "INFO", "WARNING", "ERROR"):
        raise OptionError(f"option log_level: {cfg.log_level!r} is not one of DEBUG, INFO, WARNING, ERROR")
    if cfg.prefetch not in ("on", "off"):
        raise OptionError(f"option prefetch: {cfg.prefetch!r} is not on or off")
    if cfg.malloc_trim not in ("on", "off"):
        raise OptionError(f"option malloc_trim: {cfg.malloc_trim!r} is not on or off")
    if cfg.shard is not None and cfg.read_only:
        raise OptionError("option shard: only makes sense on a read-write mount (add -o rw)")
    if cfg.follow_symlinks and "://" in cfg.source:
        raise OptionError("option follow_symlinks: only for local sources")
    if cfg.index_cache < MIN_INDEX_CACHE:
        raise OptionError(f"option index_cache: must be at least {MIN_INDEX_CACHE >> 10}K")
    return cfg


def describe_options() -> str:
    ignored = ", ".join(sorted(IGNORED_OPTIONS)) + ", x-*, comment=..."
    return ("\n".join(f"  {name:<16} {help}" for name, (_, _, help) in OPTIONS.items())
            + f"\n\naccepted and ignored (fstab and mount(8) words; the view is always nosuid, nodev):\n  {ignored}")


__all__ = ["ConfigError", "MountConfig", "OptionError", "OPTIONS", "describe_options", "fields", "parse_options", "parse_size"]
