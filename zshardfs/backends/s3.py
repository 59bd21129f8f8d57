"""An S3 bucket/prefix (AWS or any S3-compatible endpoint) as a store.

One PUT replaces an object atomically, so a shard is always its old or its
new version.  Versions are S3 ETags, kept exactly as S3 returns them
(*with* the surrounding double quotes) and sent back verbatim in
``If-Match``; callers must treat them as opaque strings.

Conditional requests map onto the protocol like this:

- ``get(if_match=)``   -> GET with ``If-Match``; 412 -> PreconditionFailed
- ``put(if_match=)``   -> PUT with ``If-Match``; 412, 409 (concurrent
  conditional writes) or 404 (object gone) -> PreconditionFailed
- ``put(if_none_match=True)`` -> PUT with ``If-None-Match: *``
- ``delete(if_match=)`` -> DELETE with ``If-Match``; 412/404 -> PreconditionFailed

Retries, timeouts and the connection pool are botocore's (standard retry
mode).  A failed *body* read is not retried by botocore, so ``get`` repeats
the whole request itself; bytes of two responses are never stitched together.

Error messages are written here, never copied from botocore, and mapped
errors are raised ``from None``: no credential, signature or request header
can reach a log through them.
"""

from __future__ import annotations

import logging
import math
import re
import threading
import time
import zlib
from collections import Counter
from datetime import datetime
from email.utils import parsedate_to_datetime
from urllib.parse import urlsplit

import boto3
import botocore
import botocore.exceptions as bce
import botocore.utils
from botocore.config import Config

from .. import __version__
from ..config import redact_url, valid_endpoint_url
from ..logonce import log_once
from .base import (
    AccessDenied,
    Blob,
    Listing,
    NotFound,
    ObjectInfo,
    PreconditionFailed,
    StoreError,
    TooLarge,
    Unavailable,
    bump,
    call_deadline,
)

log = logging.getLogger(__name__)

# check() must answer within seconds even if the endpoint is a black hole.
CHECK_CONNECT_TIMEOUT = 2.0
CHECK_READ_TIMEOUT = 3.0
CHECK_ATTEMPTS = 2

_DENIED_CODES = {
    "AccessDenied", "AllAccessDisabled", "InvalidAccessKeyId", "SignatureDoesNotMatch",
    "ExpiredToken", "InvalidToken", "TokenRefreshRequired", "AccountProblem",
    "InvalidSecurity", "RequestTimeTooSkewed",
}
_UNAVAILABLE_CODES = {
    "InternalError", "ServiceUnavailable", "SlowDown", "RequestTimeout", "Throttling",
    "ThrottlingException",
}
_TRANSPORT_ERRORS = (
    bce.HTTPClientError,  # connection closed, read timeout, streaming errors
    bce.ConnectionError,  # endpoint unreachable, connect timeout, SSL, proxy
    bce.IncompleteReadError,
    OSError,
)
_CREDENTIAL_ERRORS = (
    bce.NoCredentialsError,
    bce.PartialCredentialsError,
    bce.CredentialRetrievalError,
    bce.UnknownCredentialError,
)
# Today's naming rules for new buckets (3-63 characters: lower-case letters,
# digits, dots and hyphens, starting and ending with a letter or digit). Older
# buckets and other services may use other names, so a name outside them is
# only named in the message when the bucket is not found, never refused.
_BUCKET_NAME = re.compile(r"[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]")
_USER_AGENT = f"zshardfs/{__version__} botocore/{botocore.__version__}"
_CONTENT_RANGE = re.compile(r"bytes\s+(?:(\d+)-(\d+)|\*)/(\d+|\*)")


class _PastDeadline(Exception):
    """Raised by the ``before-send`` hook in place of an attempt that would
    begin after the call's deadline: botocore does not retry it."""


class S3URLError(StoreError, ValueError):
    """A malformed ``s3://`` source; a ValueError for callers that parse
    arguments, a StoreError for those that report storage problems."""


def parse_s3_url(url: str) -> tuple[str, str]:
    """``s3://bucket[/prefix]`` -> ``(bucket, prefix)``, '' for the bucket
    root.  S3 keys are opaque strings, so the prefix is kept exactly as
    written (``s3://b/a//b`` is ``a//b``, not ``a/b``, like the AWS CLI
    reads it); only one trailing '/' is dropped (``s3://b/a/`` is ``a``:
    the objects below ``a/``)."""
    try:
        parts = urlsplit(url)
    except ValueError:
        parts = None
    if parts is None or parts.scheme != "s3" or not parts.netloc or "@" in parts.netloc:
        raise S3URLError(f"{url!r} is not an S3 URL of the form s3://bucket[/prefix].")
    if parts.query or parts.fragment:
        raise S3URLError(f"The S3 URL {url!r} must not have a query or fragment.")
    prefix = parts.path[1:]
    if prefix.endswith("/"):
        prefix = prefix[:-1]
    if not prefix and parts.path not in ("", "/"):
        raise S3URLError(f"The S3 URL {url!r} names the prefix '/' (keys starting with '/'), which cannot be "
                         f"mounted; write s3://{parts.netloc} for the bucket root.")
    return parts.netloc, prefix


def version_mtime_ns(last_modified: float, etag: str) -> int:
    """Last-Modified in whole seconds (all S3 gives), plus a fraction of a
    second derived from the ETag.  The kernel (and rsync, make) tell a
    changed file by its size and mtime; an object replaced within the same
    second by one of the same size (uncompressed chunks always are) would
    otherwise look unchanged, and stale pages would be served for good.
    The same version always gives the same mtime (HEAD, GET and LIST agree).
    In nanoseconds: whole microseconds, as the kernel shows them exactly."""
    return math.floor(last_modified) * 1_000_000_000 + (zlib.crc32(etag.encode()) % 1_000_000) * 1000


def parse_timestamp(value: str) -> datetime:
    """An S3 timestamp, as botocore's own parser would read it, faster:
    ISO 8601 in XML bodies, RFC 1123 in headers; anything else goes to
    botocore's (dateutil) parser.  ISO 8601 starts with the year; a header
    with the day's name ("Tue, ..., GMT": a "T" is no sign of ISO)."""
    try:
        if value[:1].isdigit():
            return datetime.fromisoformat(value)
        return parsedate_to_datetime(value)
    except (TypeError, ValueError, IndexError):
        return botocore.utils.parse_timestamp(value)


class S3Backend:
    """Thread-safe; one botocore client (and its connection pool) shared by
    all worker threads.  The client is built on first use, so configuration
    problems (bad endpoint URL, unknown profile) surface as StoreError from
    :meth:`check` like every other mount-time problem."""

    keeps_empty_dirs = False  # a prefix exists while an object is below it
    put_info_exact = False  # (PutObject answers no LastModified: listings show another mtime)
    lookups_cost_requests = True
    symlinks = False  # (S3 has no links)

    def __init__(
        self,
        bucket: str,
        prefix: str = "",
        endpoint_url: str | None = None,
        region: str | None = None,
        profile: str | None = None,
        connect_timeout: float = 5.0,
        read_timeout: float = 10.0,
        max_attempts: int = 3,
        max_pool_connections: int = 32,
        addressing_style: str | None = None,
    ):
        """``max_attempts`` counts the first try too (botocore's
        ``total_max_attempts``).  Against a hung endpoint one call could take
        ``max_attempts * (connect_timeout + read_timeout)`` plus backoff;
        AsyncStore gives it up at its deadline (EIO), and no attempt begins
        after that deadline (``base.call_deadline``, checked before every
        attempt is sent), so its worker thread ends at most one attempt
        (``connect_timeout + read_timeout``) after it.

        ``addressing_style`` defaults to "path" with a custom endpoint
        (MinIO, Ceph, moto need it) and to botocore's choice for AWS.

        ``prefix`` is taken exactly (as :func:`parse_s3_url` gives it): the
        objects are those below ``prefix + "/"``, or all with ``""``."""
        self.bucket = bucket
        self.prefix = prefix  # exact: "a//b" and "a/b" are different prefixes
        self.endpoint_url = endpoint_url
        self.region = region
        self.profile = profile
        self.connect_timeout = connect_timeout
        self.read_timeout = read_timeout
        self.max_attempts = max(1, int(max_attempts))
        self.max_pool_connections = max_pool_connections
        self.addressing_style = addressing_style or ("path" if endpoint_url else None)
        self.url = f"s3://{bucket}/{self.prefix}" if self.prefix else f"s3://{bucket}"
        self.counters: Counter = Counter()
        self._lock = threading.Lock()
        self._session = None
        self._client = None
        self._tls = threading.local()

    # -- client ----------------------------------------------------------------

    @property
    def _where(self) -> str:
        return f"S3 endpoint {redact_url(self.endpoint_url)}" if self.endpoint_url else "AWS S3"

    def _new_client(self, connect_timeout, read_timeout, attempts, pool):
        """Build a client; the caller holds ``self._lock`` (sessions are not
        thread-safe)."""
        if self.endpoint_url is not None and not valid_endpoint_url(self.endpoint_url):
            raise StoreError(
                f"Invalid S3 endpoint URL {redact_url(self.endpoint_url)!r}: expected http(s)://host[:port]."
            )
        try:
            if self._session is None:
                self._session = boto3.Session(profile_name=self.profile)
                # botocore parses every timestamp (Last-Modified of each GET,
                # HEAD, and each key of a LIST) with dateutil: about 0.3 ms
                # each, most of a request's CPU and most of a listing's
                self._session._session.get_component("response_parser_factory").set_parser_defaults(
                    timestamp_parser=parse_timestamp)
            config = Config(
                connect_timeout=connect_timeout,
                read_timeout=read_timeout,
                retries={"mode": "standard", "total_max_attempts": attempts},
                max_pool_connections=pool,
                s3={"addressing_style": self.addressing_style} if self.addressing_style else None,
                # Third-party S3 servers often reject the default trailing
                # checksums of botocore >= 1.36; TLS/TCP and the shard
                # checksums already protect the bytes.
                request_checksum_calculation="when_required",
                response_checksum_validation="when_required",
                # A fixed User-Agent: botocore's own is assembled anew twice
                # per request (about 0.1 ms of CPU each time)
                user_agent=_USER_AGENT,
            )
            client = self._session.client(
                "s3", endpoint_url=self.endpoint_url, region_name=self.region, config=config
            )
        except bce.ProfileNotFound:
            raise AccessDenied(f"The AWS profile {self.profile!r} is not defined in the AWS config files.") from None
        except bce.InvalidRegionError as exc:  # a ValueError too: before the endpoint URL's
            region = exc.kwargs.get("region_name", self.region)
            raise StoreError(
                f"Invalid AWS region {region!r} (from --region, AWS_DEFAULT_REGION or the AWS profile): "
                f"expected a name like 'eu-west-1'."
            ) from None
        except ValueError as exc:
            if self.endpoint_url is None:
                raise StoreError(f"Cannot set up the S3 client for {self.url}: {type(exc).__name__}.") from None
            raise StoreError(
                f"Invalid S3 endpoint URL {redact_url(self.endpoint_url)!r}: expected http(s)://host[:port]."
            ) from None
        except bce.BotoCoreError as exc:
            raise StoreError(f"Cannot set up the S3 client for {self.url}: {type(exc).__name__}.") from None
        # Count every attempt botocore sends, so that retries are known even
        # when all of them fail without a response (RetryAttempts is only in
        # ResponseMetadata when a response arrived).
        client.meta.events.register("before-send.s3", self._count_attempt)
        client.meta.events.register("before-parse.s3", _short_body)
        client.meta.events.register("before-call.s3.HeadBucket", _no_redirect_of_a_region_lookup)
        return client

    def _count_attempt(self, request=None, **kwargs):
        if time.monotonic() >= call_deadline():
            # Given up by AsyncStore (EIO, the slot given back): botocore's
            # next attempt would only keep this thread asking a dead
            # endpoint for up to max_attempts * (connect + read timeout)
            raise _PastDeadline()
        self._tls.attempts = getattr(self._tls, "attempts", 0) + 1
        if request is not None:
            # botocore's wait for ``100 Continue`` reads lines until an empty
            # one, for ever once the connection closed after the status line
            # (a worker spinning, and a PUT that never ends); the header is
            # not signed, and a body sent to a refused PUT costs less
            request.headers.pop("Expect", None)
        return None  # anything else would replace the HTTP response

    @property
    def client(self):
        client = self._client
        if client is None:
            with self._lock:
                if self._client is None:
                    self._client = self._new_client(
                        self.connect_timeout, self.read_timeout, self.max_attempts, self.max_pool_connections
                    )
                client = self._client
        return client

    # -- keys ------------------------------------------------------------------

    def _obj(self, key: str) -> str:
        """Store key -> S3 object key."""
        key = key.strip("/")
        if not self.prefix:
            return key
        return f"{self.prefix}/{key}" if key else self.prefix

    def _dir(self, key: str) -> str:
        """Store directory -> S3 listing prefix ('' or ending in '/')."""
        obj = self._obj(key)
        return f"{obj}/" if obj else ""

    def _rel(self, obj_key: str) -> str:
        """S3 object key -> store key."""
        return obj_key[len(self.prefix) + 1:] if self.prefix else obj_key

    # -- request plumbing ------------------------------------------------------

    def _call(self, counter: str, op: str, key: str, *, tolerate: tuple[int, ...] = (),
              gone_is_conflict: bool = False, **params):
        """One botocore call: counts it and its retries, maps errors.

        A status in ``tolerate`` is an expected answer, not an error: the
        call returns None.  ``gone_is_conflict``: a 404 means the pinned
        version is gone (conditional writes), i.e. PreconditionFailed.
        """
        bump(self.counters, counter)
        self._tls.attempts = 0
        try:
            for _ in range(self.max_attempts):
                resp = getattr(self.client, op)(Bucket=self.bucket, **params)
                if not _cut_short(op, resp):
                    return resp
                if "Body" in resp:
                    resp["Body"].close()
            bump(self.counters, "errors")
            where = f"{self.url}: {key}" if key else self.url
            raise Unavailable(f"{where}: the {self._where}'s answers were cut short "
                              f"({self.max_attempts} attempts)", key)
        except StoreError:
            raise  # from building the client
        except bce.ClientError as exc:
            status, code = _status(exc)
            if status in tolerate and code != "NoSuchBucket":
                return None
            raise self._map(exc, key, op, gone_is_conflict) from None
        except _PastDeadline:
            # (AsyncStore counted the error when it gave the call up)
            where = f"{self.url}: {key}" if key else self.url
            raise Unavailable(f"{where}: given up at its deadline; no further attempt sent", key) from None
        except Exception as exc:
            raise self._map(exc, key, op) from None
        finally:
            if self._tls.attempts > 1:
                bump(self.counters, "retries", self._tls.attempts - 1)

    def _map(self, exc: Exception, key: str, op: str, gone_is_conflict: bool = False) -> StoreError:
        """botocore exception -> StoreError with a message of our own."""
        where = f"{self.url}: {key}" if key else self.url
        if isinstance(exc, bce.ClientError):
            status, code = _status(exc)
            what = code or str(status)
            missing = code != "NoSuchBucket" and (status == 404 or code in ("NoSuchKey", "NotFound"))
            if (status == 412 or code in ("PreconditionFailed", "ConditionalRequestConflict")
                    or (status == 409 and op in ("put_object", "delete_object"))
                    or (missing and gone_is_conflict)):
                bump(self.counters, "precondition_failed")
                return PreconditionFailed(f"{where}: changed since it was read ({what})", key)
            if missing:  # an answer, not an error (lookups of absent chunks are normal)
                return NotFound(f"{where}: not found", key)
            bump(self.counters, "errors")
            if code == "NoSuchBucket":
                # (the mount checked it at the start: deleted since. Every name
                # is then ENOENT and every listing empty, which alone would
                # look like an empty store: said once a minute, not per request)
                log_once(log, logging.ERROR, f"{self.url}: the bucket {self.bucket!r} does not exist (deleted "
                         f"since the mount began?): every name of the view is answered ENOENT",
                         tag=f"no bucket {self.bucket}")
                return NotFound(f"{self.url}: bucket {self.bucket!r} does not exist", key)
            if status == 403 or code in _DENIED_CODES:
                return AccessDenied(f"{where}: access denied ({what})", key)
            if status >= 500 or code in _UNAVAILABLE_CODES:
                return Unavailable(f"{where}: server error ({what}) after {self.max_attempts} attempts", key)
            return StoreError(f"{where}: {op} failed ({what})", key)
        bump(self.counters, "errors")
        if isinstance(exc, _CREDENTIAL_ERRORS):
            return AccessDenied(f"{self.url}: no usable AWS credentials ({type(exc).__name__})", key)
        if isinstance(exc, _TRANSPORT_ERRORS):
            return Unavailable(f"{where}: {self._where} unreachable or not answering ({_reason(exc)})", key)
        if isinstance(exc, bce.ParamValidationError):
            return StoreError(f"{where}: invalid request parameters for {op}", key)
        return StoreError(f"{where}: {op} failed ({type(exc).__name__})", key)

    @staticmethod
    def _info(key: str, meta: dict, size: int) -> ObjectInfo:
        modified = meta.get("LastModified")
        etag = meta.get("ETag", "")
        mtime = modified.timestamp() if modified is not None else time.time()
        return ObjectInfo(key, size, etag, version_mtime_ns(mtime, etag))

    # -- reads -----------------------------------------------------------------

    def _head(self, key: str, if_match: str | None = None) -> ObjectInfo | None:
        params = {"Key": self._obj(key)}
        if if_match is not None:
            params["IfMatch"] = if_match
        resp = self._call("head", "head_object", key, tolerate=(404,), **params)
        if resp is None:
            return None
        return self._info(key, resp, resp.get("ContentLength", 0))

    def stat(self, key: str) -> ObjectInfo | None:
        if not key:
            return None
        return self._head(key)

    def is_dir(self, key: str) -> bool:
        if not key:
            return True
        resp = self._call("list", "list_objects_v2", key, Prefix=self._dir(key), MaxKeys=1)
        return resp.get("KeyCount", 0) > 0 or bool(resp.get("Contents"))

    def dir_page(self, key: str) -> tuple[bool, Listing | None]:
        """Is ``key`` a directory, and its listing if one page holds all of
        it.  One LIST either way: the lookup of a directory is nearly always
        followed by its listing, which then costs no request of its own."""
        if not key:
            return True, None
        dir_prefix = self._dir(key)
        resp = self._call("list", "list_objects_v2", key, Prefix=dir_prefix, Delimiter="/")
        exists = bool(resp.get("CommonPrefixes") or resp.get("Contents"))
        if resp.get("IsTruncated"):
            return exists, None
        dirs, files = self._page(resp, dir_prefix)
        return exists, Listing(sorted(dirs), sorted(files, key=lambda f: f.key))

    def _empty(self, key: str, if_match: str | None) -> Blob:
        """Zero bytes requested or available: S3 cannot express that as a
        range (416), so the version comes from a HEAD."""
        info = self._head(key, if_match)
        if info is None:
            raise NotFound(f"{self.url}: {key}: not found", key)
        return Blob(b"", info)

    def get(self, key, start=0, length=None, *, suffix=None, if_match=None, max_size=None) -> Blob:
        if length == 0 or suffix == 0:
            return self._empty(key, if_match)
        if suffix is not None:
            rng = f"bytes=-{suffix}"
        elif start > 0 or length is not None:
            rng = f"bytes={start}-{start + length - 1}" if length is not None else f"bytes={start}-"
        else:
            rng = None
        params = {"Key": self._obj(key)}
        if rng:
            params["Range"] = rng
        if if_match is not None:
            params["IfMatch"] = if_match
        kind = "get_range" if rng else "get"

        for attempt in range(1, self.max_attempts + 1):
            resp = self._call(kind, "get_object", key, tolerate=(416,), **params)
            if resp is None:  # range starts at or past the end (or object empty)
                return self._empty(key, if_match)
            body = resp["Body"]
            if max_size is not None and resp.get("ContentLength", 0) > max_size:
                body.close()  # (its bytes are never read)
                raise TooLarge(f"{key}: {resp['ContentLength']} bytes", key, resp["ContentLength"])
            try:
                data = body.read()
                break
            except _TRANSPORT_ERRORS as exc:
                # botocore retries requests, not body reads: repeat the GET.
                if attempt == self.max_attempts:
                    bump(self.counters, "errors")
                    raise Unavailable(
                        f"{self.url}: {key}: response body lost ({type(exc).__name__}) after {attempt} attempts", key
                    ) from None
                bump(self.counters, "retries")
            finally:
                body.close()

        total = None
        content_range = resp.get("ContentRange")
        if content_range:
            m = _CONTENT_RANGE.match(content_range)
            if m and m.group(3) != "*":
                total = int(m.group(3))
        elif rng:
            # The server ignored Range and sent the whole object: cut it here.
            total = len(data)
            data = data[-suffix:] if suffix is not None else data[start:None if length is None else start + length]
        if total is None:  # no range asked, or an unparsable Content-Range
            total = start + len(data)
        bump(self.counters, "bytes_read", len(data))
        return Blob(data, self._info(key, resp, total))

    def list(self, prefix: str) -> Listing:
        """Immediate children, following continuation tokens (1000 entries
        per page; one ``list`` count per page)."""
        dir_prefix = self._dir(prefix)
        dirs: list[str] = []
        files: list[ObjectInfo] = []
        params = {"Prefix": dir_prefix, "Delimiter": "/"}
        while True:
            resp = self._call("list", "list_objects_v2", prefix, **params)
            page_dirs, page_files = self._page(resp, dir_prefix)
            dirs += page_dirs
            files += page_files
            token = resp.get("NextContinuationToken")
            if not resp.get("IsTruncated") or not token:
                break
            params["ContinuationToken"] = token
        dirs.sort()
        files.sort(key=lambda f: f.key)
        return Listing(dirs, files)

    def _page(self, resp: dict, dir_prefix: str) -> tuple[list[str], list[ObjectInfo]]:
        """The directories and files of one ListObjectsV2 page."""
        dirs = []
        for cp in resp.get("CommonPrefixes", ()):
            name = cp["Prefix"][len(dir_prefix):].rstrip("/")
            if name:
                dirs.append(name)
        files = []
        for obj in resp.get("Contents", ()):
            name = obj["Key"][len(dir_prefix):]
            if not name or name.endswith("/"):
                continue  # "directory marker" objects written by some tools
            files.append(self._info(self._rel(obj["Key"]), obj, obj.get("Size", 0)))
        return dirs, files

    # -- writes ----------------------------------------------------------------

    def put(self, key, data, *, if_match=None, if_none_match=False) -> ObjectInfo:
        data = bytes(data)
        params = {"Key": self._obj(key), "Body": data}
        if if_match is not None:
            params["IfMatch"] = if_match
        if if_none_match:
            params["IfNoneMatch"] = "*"
        resp = self._call("put", "put_object", key, gone_is_conflict=if_match is not None, **params)
        bump(self.counters, "bytes_written", len(data))
        # PutObject does not return LastModified; "now" is close enough.
        return ObjectInfo(key, len(data), resp.get("ETag", ""), time.time_ns())

    def delete(self, key, *, if_match=None, prune_below=None) -> None:
        params = {"Key": self._obj(key)}
        if if_match is not None:
            params["IfMatch"] = if_match
        # Absent is fine without a condition (S3 answers 204 anyway); with
        # If-Match a 404 means the pinned version is gone.
        self._call("delete", "delete_object", key, tolerate=() if if_match is not None else (404,),
                   gone_is_conflict=if_match is not None, **params)

    # -- mount-time check ------------------------------------------------------

    def check(self) -> bool:
        """Prove the bucket is reachable and readable, quickly.

        Uses its own client with short timeouts and few attempts, so a dead
        or black-holed endpoint fails in seconds.  Raises a StoreError whose
        message is one sentence meant for the user.  Returns True when some
        object exists below the prefix (False: an empty store).
        """
        with self._lock:
            client = self._new_client(
                min(self.connect_timeout, CHECK_CONNECT_TIMEOUT),
                min(self.read_timeout, CHECK_READ_TIMEOUT),
                min(self.max_attempts, CHECK_ATTEMPTS),
                1,
            )
        bump(self.counters, "list")
        try:
            resp = client.list_objects_v2(Bucket=self.bucket, Prefix=self._dir(""), MaxKeys=1)
            found = resp.get("KeyCount", 0) > 0 or bool(resp.get("Contents"))
            # (nothing below the prefix: is it an object's key, the S3 form of
            # a source that is a file? one HEAD more, only for an empty store)
            is_object = not found and bool(self.prefix) and ("KeyCount" in resp or "Name" in resp) \
                and self._is_object(client, self._obj(""))
        except bce.ClientError as exc:
            status, code = _status(exc)
            bump(self.counters, "errors")
            if code == "NoSuchBucket" or (status == 404 and code in ("", "404", "NotFound")):
                hint = ("" if _BUCKET_NAME.fullmatch(self.bucket) else
                        " (nor is it a valid S3 bucket name: 3-63 lower-case letters, digits, dots, hyphens)")
                if code != "NoSuchBucket" and self.endpoint_url:
                    # (S3 answers a listing of a missing bucket with NoSuchBucket;
                    # a bare 404 is as likely a web server, or a wrong port)
                    hint += (", or there is no S3 endpoint at that address (it answered 404 without an S3 "
                             "error code): check --endpoint-url")
                raise NotFound(f"The S3 bucket {self.bucket!r} does not exist at {self._where}{hint}.") from None
            if status in (301, 302, 303, 307, 308):
                location = _answer_headers(exc).get("location")
                raise StoreError(
                    f"The {self._where} answered a listing of {self.url} with a redirect (HTTP {status}"
                    f"{' to ' + _shown(location) if location else ''}{', ' + code if code not in ('', str(status)) else ''}"
                    f"): give the address it redirects to as --endpoint-url"
                    f"{', or the bucket' + chr(39) + 's region as --region' if not location else ''}."
                ) from None
            if status == 403 or code in _DENIED_CODES:
                raise AccessDenied(
                    f"Access to {self.url} was denied ({code or status}): check the AWS credentials, "
                    f"profile and bucket policy."
                ) from None
            if code in ("InvalidBucketName",):
                raise StoreError(f"{self.bucket!r} is not a valid S3 bucket name.") from None
            if status >= 500 or code in _UNAVAILABLE_CODES:
                raise Unavailable(f"The {self._where} answered with a server error ({code or status}).") from None
            raise StoreError(f"Reading {self.url} failed with HTTP {status}"
                             f"{' (' + code + ')' if code not in ('', str(status)) else ''}.") from None
        except _CREDENTIAL_ERRORS:
            bump(self.counters, "errors")
            raise AccessDenied(
                "No AWS credentials were found: set AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, "
                "a profile, or another source of the standard credential chain."
            ) from None
        except bce.ParamValidationError:
            bump(self.counters, "errors")
            raise StoreError(f"{self.bucket!r} is not a valid S3 bucket name.") from None
        except _TRANSPORT_ERRORS as exc:
            bump(self.counters, "errors")
            raise Unavailable(
                f"Cannot reach the {self._where} ({_reason(exc)}); check the endpoint URL and the network."
            ) from None
        except bce.BotoCoreError as exc:
            bump(self.counters, "errors")
            raise StoreError(f"Checking {self.url} failed ({type(exc).__name__}).") from None
        finally:
            client.close()
        if "KeyCount" not in resp and "Name" not in resp:  # (every ListObjectsV2 answer of S3 names its bucket)
            kind = resp.get("ResponseMetadata", {}).get("HTTPHeaders", {}).get("content-type")
            raise StoreError(
                f"The {self._where} did not answer a listing as S3 does (HTTP "
                f"{resp.get('ResponseMetadata', {}).get('HTTPStatusCode', 200)} without a ListBucketResult"
                f"{', ' + _shown(kind, 60) if kind else ''}): is it an S3 endpoint? check --endpoint-url."
            )
        if is_object:
            parent = self.prefix.rpartition("/")[0]
            raise NotFound(f"{self.url} is an object, not a prefix of objects: give the prefix of the store "
                           f"(the object's own is s3://{self.bucket}{'/' + parent if parent else ''}).")
        self.client  # built now, while the mount is being set up, not by the first request (15 ms)
        return found

    def _is_object(self, client, key: str) -> bool:
        """Does the object ``key`` exist (for check(): any failure is no)?"""
        try:
            client.head_object(Bucket=self.bucket, Key=key)
        except (bce.ClientError, bce.BotoCoreError, OSError):
            return False
        return True

    def make_dir(self, key: str) -> None:
        """S3 has no directories: a prefix exists once an object is below it."""

    def remove_dir(self, key: str) -> None:
        """S3 has no directories to remove."""

    def close(self) -> None:
        with self._lock:
            client, self._client = self._client, None
        if client is not None:
            client.close()


#: headers every answer of an operation carries (S3 and the S3-compatible
#: servers): an answer without them lost the rest of its headers to a
#: connection closed mid-answer (http.client takes the headers it got before
#: the close as all of them, and without a length the body ends at the
#: close), which would read as an object of no bytes or an empty listing
_LENGTH = ("content-length", "transfer-encoding")
_NEEDED_HEADERS = {
    "get_object": (("etag",), _LENGTH),
    "head_object": (("etag",), ("content-length",)),
    "put_object": (("etag",),),
    "list_objects_v2": (_LENGTH,),
}


def _cut_short(op: str, resp: dict) -> bool:
    """Does the successful answer ``resp`` to ``op`` lack a header it always
    has, or bytes of its body (see _short_body)?"""
    if resp.get(_SHORT):
        return True
    headers = resp.get("ResponseMetadata", {}).get("HTTPHeaders", {})
    return any(not any(h in headers for h in one_of) for one_of in _NEEDED_HEADERS.get(op, ()))


_SHORT = "ZshardfsShortBody"


def _short_body(response_dict=None, customized_response_dict=None, operation_model=None, **kwargs):
    """botocore takes an answer's body (a LIST's XML) as it came, also one a
    closed connection cut short of its Content-Length: cut to nothing, it
    parsed as a listing of no objects (so did one whose Content-Length was
    cut to nothing).  Such a body is not parsed (the answer is marked, and
    _call asks again)."""
    if operation_model is None or operation_model.name == "HeadObject" or response_dict.get("status_code") != 200:
        return  # (a HEAD's Content-Length is the object's: it has no body)
    body = response_dict.get("body")
    length = response_dict.get("headers", {}).get("content-length")
    if isinstance(body, bytes) and length is not None and (not length.isdigit() or len(body) < int(length)):
        response_dict["body"] = b""
        customized_response_dict[_SHORT] = True


def _no_redirect_of_a_region_lookup(context=None, **kwargs):
    """botocore's S3 region redirector answers a redirect (301, 302, 307)
    that carries no ``x-amz-bucket-region`` header with a HEAD of the bucket
    to learn its region, and that HEAD, redirected too, with another, until
    Python's recursion limit: an endpoint that is no S3 server (an
    http-to-https redirect) cost about 330 requests and a RecursionError.
    The redirector takes a request marked redirected for one it must not
    redirect again; the HEAD still reads the region S3 puts in its answer
    (AWS's own wrong-region redirects keep working), and the zshardfs calls
    themselves (never a HeadBucket) are redirected as before."""
    if context is not None:
        context.setdefault("s3_redirect", {})["redirected"] = True


def _answer_headers(exc: bce.ClientError) -> dict:
    return exc.response.get("ResponseMetadata", {}).get("HTTPHeaders", {}) or {}


def _shown(text: str, limit: int = 200) -> str:
    """A value a server sent (a Location header), fit for one line."""
    text = "".join(c for c in redact_url(str(text)) if c.isprintable())
    return text if len(text) <= limit else text[:limit] + "..."


def _status(exc: bce.ClientError) -> tuple[int, str]:
    status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0) or 0
    code = str(exc.response.get("Error", {}).get("Code", "") or "")
    return int(status), code


def _reason(exc: Exception) -> str:
    if isinstance(exc, (bce.ConnectTimeoutError, bce.ReadTimeoutError)):
        return "timed out"
    if isinstance(exc, bce.SSLError):
        return "TLS handshake failed"
    if isinstance(exc, bce.ProxyConnectionError):
        return "proxy connection failed"
    if isinstance(exc, bce.EndpointConnectionError):
        return "connection failed"
    return "connection lost"


__all__ = ["S3Backend", "S3URLError", "parse_s3_url"]
