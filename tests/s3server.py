"""moto's stand-alone S3 server in a child process, for tests.

Tests talk to it over real HTTP on 127.0.0.1, exactly as the daemon talks to
S3; moto's in-process mocks are never used.  The child can be paused
(SIGSTOP: connections are accepted by the kernel but never answered), killed
and restarted on the same port, which is how tests simulate a hung or dead
endpoint.  Its access log goes to a file, so tests can count the requests
the server really received (:meth:`MotoServer.requests`).

moto keeps its state in memory: a restarted server is empty.  Use
:meth:`MotoServer.snapshot` before and :meth:`MotoServer.restore` after a
restart (single-PUT ETags are MD5s, so restored objects keep their ETags).

Serialised writes: moto checks ``If-Match`` / ``If-None-Match`` on PUT and
DELETE and then stores, without a lock; with concurrent writers two
conditional PUTs on one version can both succeed (see docs/S3-NOTES.md).
S3 itself is atomic here, so by default the child runs moto's own WSGI app
behind a one-lock middleware that serialises PUT/POST/DELETE requests.
``serialize_writes=False`` runs the unmodified ``python -m moto.server``.

:class:`TcpProxy` goes between a client and the server: it delays every HTTP
request (added latency, as to a distant region), can limit the bandwidth of the
answers (a slow link), and counts requests in flight and the bytes the server
sends back.

Run as a script (``python tests/s3server.py --serve HOST PORT``) it is that
child process.
"""

from __future__ import annotations

import os
import random
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple
from urllib.parse import parse_qs

DUMMY_ACCESS_KEY = "AKIAZSHARDFSTEST0000"
DUMMY_SECRET_KEY = "zshardfs-dummy-secret-must-never-be-logged"
DUMMY_REGION = "us-east-1"


def dummy_credentials_env() -> dict[str, str]:
    """Environment for clients of the test server: dummy credentials and
    nothing from the user's ~/.aws (profiles, endpoints, SSO)."""
    return {
        "AWS_ACCESS_KEY_ID": DUMMY_ACCESS_KEY,
        "AWS_SECRET_ACCESS_KEY": DUMMY_SECRET_KEY,
        "AWS_DEFAULT_REGION": DUMMY_REGION,
        "AWS_REGION": DUMMY_REGION,
        "AWS_CONFIG_FILE": os.devnull,
        "AWS_SHARED_CREDENTIALS_FILE": os.devnull,
        "AWS_EC2_METADATA_DISABLED": "true",
    }


#: variables that would override the dummy credentials or redirect clients
CLEARED_ENV = (
    "AWS_PROFILE", "AWS_DEFAULT_PROFILE", "AWS_SESSION_TOKEN", "AWS_SECURITY_TOKEN",
    "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI",
    "AWS_CONTAINER_CREDENTIALS_FULL_URI", "AWS_WEB_IDENTITY_TOKEN_FILE", "AWS_ROLE_ARN",
)


def set_dummy_credentials(environ=os.environ) -> None:
    """Point every boto3 client created afterwards (and child processes such
    as the daemon) at dummy credentials."""
    for name in CLEARED_ENV:
        environ.pop(name, None)
    environ.update(dummy_credentials_env())


# --------------------------------------------------------------------------
# access log


class Request(NamedTuple):
    """One request as the server logged it.  ``path`` is the raw request
    target, query string included (``/bucket/key``, ``/bucket?list-type=2``)."""

    method: str
    path: str
    status: int

    @property
    def route(self) -> str:
        """The path without the query string."""
        return self.path.split("?", 1)[0]

    @property
    def query(self) -> dict[str, list[str]]:
        return parse_qs(self.path.split("?", 1)[1], keep_blank_values=True) if "?" in self.path else {}


_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_LOG_LINE = re.compile(r'"(?P<method>[A-Z]+) (?P<path>\S+) HTTP/[\d.]+" (?P<status>\d{3}) ')


def parse_access_log(text: str) -> list[Request]:
    """werkzeug access-log lines -> Requests (other lines are skipped)."""
    out = []
    for line in _ANSI.sub("", text).splitlines():
        m = _LOG_LINE.search(line + " ")
        if m:
            out.append(Request(m["method"], m["path"], int(m["status"])))
    return out


# --------------------------------------------------------------------------
# the server


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class MotoServer:
    """One moto server child process on a fixed port (kept across restarts)."""

    def __init__(self, log_path: str | os.PathLike | None = None, *, host: str = "127.0.0.1",
                 port: int | None = None, serialize_writes: bool = True, env: dict[str, str] | None = None):
        """``env``: extra environment for the server, e.g.
        ``{"INITIAL_NO_AUTH_ACTION_COUNT": "0"}`` makes moto check
        credentials (unknown keys then get 403 InvalidAccessKeyId)."""
        self.host = host
        self.port = port or free_port(host)
        self.serialize_writes = serialize_writes
        self.extra_env = dict(env or {})
        if log_path is None:
            log_path = Path(os.environ.get("TMPDIR", "/tmp")) / f"moto-{self.port}-{uuid.uuid4().hex[:8]}.log"
        self.log_path = Path(log_path)
        self.proc: subprocess.Popen | None = None
        self._paused = False
        self._client = None

    @property
    def endpoint_url(self) -> str:
        return f"http://{self.host}:{self.port}"

    # -- process control -------------------------------------------------------

    def _command(self) -> list[str]:
        if self.serialize_writes:
            return [sys.executable, str(Path(__file__).resolve()), "--serve", self.host, str(self.port)]
        return [sys.executable, "-m", "moto.server", "-H", self.host, "-p", str(self.port)]

    def start(self, timeout: float = 30.0) -> None:
        """Start the child and wait until it answers HTTP."""
        if self.alive:
            return
        env = os.environ.copy()
        set_dummy_credentials(env)
        env.update(self.extra_env, PYTHONUNBUFFERED="1", MOTO_PORT=str(self.port))
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as logf:
            self.proc = subprocess.Popen(
                self._command(), stdin=subprocess.DEVNULL, stdout=logf, stderr=logf,
                env=env, start_new_session=True,
            )
        self._paused = False
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"moto server exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(self.endpoint_url + "/moto-api/", timeout=1):
                    return
            except urllib.error.HTTPError:
                return  # any HTTP answer means it is serving
            except OSError:
                if time.monotonic() > deadline:
                    self.kill()
                    raise RuntimeError(f"moto server did not answer within {timeout}s:\n{self.log_tail()}")
                time.sleep(0.05)

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def pause(self) -> None:
        """Freeze the server: requests connect but get no answer."""
        if self.alive:
            os.kill(self.proc.pid, signal.SIGSTOP)
            self._paused = True

    def resume(self) -> None:
        if self.alive:
            os.kill(self.proc.pid, signal.SIGCONT)
        self._paused = False

    def kill(self) -> None:
        """Die like a crashed server (SIGKILL): open connections are reset,
        new ones refused."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self._paused = False

    def stop(self, timeout: float = 5.0) -> None:
        """Graceful stop, SIGKILL if it does not exit in time."""
        if self.proc is None or self.proc.poll() is not None:
            return
        self.resume()
        self.proc.terminate()
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()

    def restart(self, keep_data: bool = True) -> None:
        """Stop and start on the same port, with the same buckets and objects
        when ``keep_data``."""
        state = self.snapshot() if keep_data and self.alive and not self._paused else None
        self.stop()
        self.start()
        if state:
            self.restore(state)

    def ensure_running(self) -> None:
        """Undo what an earlier test may have done (pause, kill)."""
        if self.alive:
            if self._paused:
                self.resume()
        else:
            self.start()

    def __enter__(self) -> "MotoServer":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    # -- access log ------------------------------------------------------------

    def mark(self) -> int:
        """A position in the access log, for ``requests(since=...)``."""
        try:
            return self.log_path.stat().st_size
        except FileNotFoundError:
            return 0

    def requests(self, since: int = 0) -> list[Request]:
        """Requests the server logged after ``since`` (a :meth:`mark`).

        werkzeug writes the log line before it sends the response, so a
        request whose response the client has seen is already here."""
        with open(self.log_path, "rb") as f:
            f.seek(since)
            return parse_access_log(f.read().decode("utf-8", "replace"))

    def log_tail(self, n: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text("utf-8", "replace").splitlines()[-n:])
        except FileNotFoundError:
            return ""

    # -- data ------------------------------------------------------------------

    def client(self, **config):
        """A boto3 client for setting up and inspecting test data."""
        import boto3
        from botocore.config import Config

        cfg = {"connect_timeout": 5, "read_timeout": 30, "max_pool_connections": 32,
               "retries": {"mode": "standard", "total_max_attempts": 3}}
        cfg.update(config)
        return boto3.client(
            "s3", endpoint_url=self.endpoint_url, region_name=DUMMY_REGION,
            aws_access_key_id=DUMMY_ACCESS_KEY, aws_secret_access_key=DUMMY_SECRET_KEY,
            config=Config(**cfg),
        )

    @property
    def s3(self):
        """A shared client (thread-safe), created on first use."""
        if self._client is None:
            self._client = self.client()
        return self._client

    def create_bucket(self, name: str | None = None) -> str:
        name = name or f"zs-{uuid.uuid4().hex[:16]}"
        try:
            self.s3.create_bucket(Bucket=name)
        except self.s3.exceptions.BucketAlreadyOwnedByYou:
            pass
        return name

    def delete_bucket(self, name: str) -> None:
        """Best effort: objects, then the bucket."""
        try:
            keys = [k for k, _ in self._iter_objects(name)]
            for i in range(0, len(keys), 1000):
                self.s3.delete_objects(
                    Bucket=name, Delete={"Objects": [{"Key": k} for k in keys[i:i + 1000]], "Quiet": True}
                )
            self.s3.delete_bucket(Bucket=name)
        except Exception:
            pass

    def put_many(self, bucket: str, items: dict[str, bytes], threads: int = 16) -> None:
        """Upload many small objects quickly (moto serves requests in threads)."""
        with ThreadPoolExecutor(threads) as pool:
            list(pool.map(lambda kv: self.s3.put_object(Bucket=bucket, Key=kv[0], Body=kv[1]), items.items()))

    def _iter_objects(self, bucket: str):
        for page in self.s3.get_paginator("list_objects_v2").paginate(Bucket=bucket):
            for obj in page.get("Contents", ()):
                yield obj["Key"], obj["Size"]

    def snapshot(self, buckets: list[str] | None = None) -> dict[str, dict[str, bytes]]:
        """All objects of ``buckets`` (default: every bucket), in memory."""
        if buckets is None:
            buckets = [b["Name"] for b in self.s3.list_buckets().get("Buckets", [])]
        state = {}
        with ThreadPoolExecutor(16) as pool:
            for bucket in buckets:
                keys = [k for k, _ in self._iter_objects(bucket)]
                bodies = pool.map(lambda k: self.s3.get_object(Bucket=bucket, Key=k)["Body"].read(), keys)
                state[bucket] = dict(zip(keys, bodies))
        return state

    def restore(self, state: dict[str, dict[str, bytes]]) -> None:
        for bucket, objects in state.items():
            self.create_bucket(bucket)
            self.put_many(bucket, objects)


# --------------------------------------------------------------------------
# a proxy in front of the server


class TcpProxy:
    """A TCP proxy on 127.0.0.1 in front of ``upstream_port`` (the moto
    server): each accepted connection gets its own connection to the server
    and two threads, one copying requests, one copying responses.

    It sees HTTP/1.x requests just well enough to delay and count them: a
    request starts with the first bytes a client sends on a connection after
    the server began answering its previous request (the clients here do not
    pipeline requests, and a ``Expect: 100-continue`` body would count as a
    second request).

    ``delay``: seconds to wait before forwarding each request to the server,
    i.e. one-way latency added per request, as to a distant S3 region.
    Connection set-up is not delayed.  Requests on different connections wait
    independently, so overlapping requests overlap their delays.

    ``rate``: bytes per second at which the server's answers are passed on,
    per connection (0: as fast as they come), i.e. a slow link.

    :meth:`hold`: the server's answer to the next request whose first bytes
    (its request line) a predicate accepts is kept back until :meth:`go`;
    the server has answered it already, so it tells of the store as it was
    (a client whose answer is late, as over a congested link).

    ``faults``: network faults, a :class:`Faults` (None: none).  Each request
    is drawn for at its first bytes: with probability ``p`` it gets one of
    ``kinds``: ``reset`` (the connection cut before the request reaches the
    server: it never happened), ``cut`` (forwarded, so the server acts on it,
    and the connection cut after none or part of the answer: a PUT or DELETE
    that may have landed though the client saw no answer), ``503`` (SlowDown)
    or ``500`` (InternalError) answered by the proxy itself, not forwarded.
    ``fault_counts`` counts what was injected, by kind.

    ``silent``: a black hole.  While it is true, every request that begins
    (also on a connection opened before) is swallowed: never forwarded, never
    answered, its connection left open until the client closes it, as an
    endpoint that stopped answering.  Requests begun after it is set false
    are served again.  A predicate on a request's first bytes swallows only
    the requests it accepts.  ``swallowed`` lists the request lines of the
    requests swallowed.

    Counters, since the start or :meth:`reset`: ``bytes`` the server sent back
    (HTTP headers included), ``requests``, ``inflight`` (requests forwarded or
    waiting to be, not yet answered) and its maximum ``max_inflight``.
    """

    def __init__(self, upstream_port: int, *, delay: float = 0.0, upstream_host: str = "127.0.0.1",
                 rate: float = 0.0):
        self.upstream = (upstream_host, upstream_port)
        self.delay = delay
        self.rate = rate
        self.lock = threading.Lock()
        self.bytes = self.requests = self.inflight = self.max_inflight = 0
        self._conns: set[socket.socket] = set()
        self._hold = None  # predicate on a request's first bytes, until one matched
        self.holding = threading.Event()  # an answer is kept back
        self._go = threading.Event()
        self.faults: Faults | None = None
        self.fault_counts: dict[str, int] = {}
        self.silent = False  # or a predicate on a request's first bytes
        self.swallowed: list[str] = []
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(256)
        self.port = self.sock.getsockname()[1]
        threading.Thread(target=self._accept, name=f"proxy-{self.port}", daemon=True).start()

    @property
    def endpoint_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def reset(self) -> None:
        """Start counting anew (requests still in flight stay in flight)."""
        with self.lock:
            self.bytes = self.requests = 0
            self.max_inflight = self.inflight

    def hold(self, predicate) -> None:
        """Keep back the answer to the next request ``predicate(first_bytes)``
        accepts, until :meth:`go` (or 30 s)."""
        with self.lock:
            self._hold = predicate
            self.holding.clear()
            self._go.clear()

    def go(self) -> None:
        """Pass on the answer kept back (and stop looking for one)."""
        with self.lock:
            self._hold = None
        self._go.set()

    def close(self) -> None:
        """Stop accepting and cut every open connection."""
        with self.lock:
            socks = [self.sock, *self._conns]
        for s in socks:
            _shutdown(s)  # wakes the threads blocked in accept() and recv()
        self.sock.close()

    def __enter__(self) -> "TcpProxy":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(client,), daemon=True).start()

    def _serve(self, client: socket.socket) -> None:
        try:
            server = socket.create_connection(self.upstream)
        except OSError:
            client.close()
            return
        with self.lock:
            self._conns.update((client, server))
        # waiting: a request was seen and its answer has not begun;
        # done: the responses side has finished, nothing more will be answered
        state = {"waiting": False, "done": False}
        requests = threading.Thread(target=self._requests, args=(client, server, state), daemon=True)
        requests.start()
        self._responses(server, client, state)
        requests.join()  # before closing: no thread may use a closed (reused) descriptor
        with self.lock:
            self._conns.difference_update((client, server))
        client.close()
        server.close()

    def _requests(self, client: socket.socket, server: socket.socket, state: dict) -> None:
        try:
            while data := client.recv(1 << 18):
                if not state["waiting"]:  # the first bytes of a request
                    fault = None
                    with self.lock:
                        if state["done"]:
                            break
                        state["waiting"] = True
                        self.requests += 1
                        self.inflight += 1
                        self.max_inflight = max(self.max_inflight, self.inflight)
                        if self._hold is not None and self._hold(data):
                            self._hold = None
                            state["held"] = True
                        if self.faults is not None and (fault := self.faults.draw(data)) is not None:
                            self.fault_counts[fault] = self.fault_counts.get(fault, 0) + 1
                            if fault == "cut":
                                state["cut"] = self.faults.cut_at()
                    if fault == "reset":
                        break
                    silent = self.silent
                    if silent is True or (callable(silent) and silent(data)):  # a black hole
                        with self.lock:
                            self.swallowed.append(data.split(b"\r\n", 1)[0].decode("latin-1"))
                        while client.recv(1 << 18):  # (until the client gives up)
                            pass
                        break
                    if fault in ("503", "500"):
                        client.sendall(_error_answer(fault, data))
                        while client.recv(1 << 18):  # (the body, if any, until the client closes)
                            pass
                        break
                    if self.delay > 0:
                        time.sleep(self.delay)
                server.sendall(data)
        except OSError:
            pass
        _shutdown(client, server)

    def _responses(self, server: socket.socket, client: socket.socket, state: dict) -> None:
        try:
            while data := server.recv(1 << 18):
                if state.get("held"):  # (set before its request was forwarded)
                    state["held"] = False
                    self.holding.set()
                    self._go.wait(30)
                with self.lock:
                    self.bytes += len(data)
                    if state["waiting"]:
                        state["waiting"] = False
                        self.inflight -= 1
                if state.get("cut") is not None:  # the server acted; the client sees part of its answer
                    client.sendall(data[:state["cut"]])
                    break
                step = 1 << 14 if self.rate > 0 else len(data)  # a slow link: 16 KiB at a time
                for i in range(0, len(data), step):
                    if self.rate > 0:
                        time.sleep(min(step, len(data) - i) / self.rate)
                    client.sendall(data[i:i + step])
        except OSError:
            pass
        with self.lock:
            state["done"] = True
            if state["waiting"]:
                state["waiting"] = False
                self.inflight -= 1
        _shutdown(client, server)


@dataclass
class Faults:
    """What :attr:`TcpProxy.faults` injects: each request gets a fault of ``kinds`` with
    probability ``p`` (drawn with ``seed``, in the order requests arrive: the threads
    of a client make that order, and so which request gets which fault, vary from run
    to run), if ``methods`` (e.g. ``{"PUT", "DELETE"}``) is None or holds its method."""

    p: float
    kinds: tuple = ("reset", "cut", "503", "500")
    seed: int = 0
    methods: frozenset | None = None
    #: how many bytes of the answer a ``cut`` lets through, drawn from these: none, part
    #: of the status line, or of the headers (``http.client`` takes the headers it got
    #: before the connection closed as all of them)
    cuts: tuple = (0, 0, 1, 12, 40, 200)

    def __post_init__(self):
        self.rng = random.Random(self.seed)

    def draw(self, first: bytes) -> str | None:
        """The fault for a request whose first bytes are ``first`` (under the proxy's lock)."""
        if self.methods is not None and first.split(b" ", 1)[0].decode("latin-1") not in self.methods:
            return None
        if self.rng.random() >= self.p:
            return None
        return self.rng.choice(self.kinds)

    def cut_at(self) -> int:
        """How many bytes of the answer pass before the cut: none, or some of its head."""
        return self.rng.choice(self.cuts)


def _error_answer(kind: str, first: bytes) -> bytes:
    """The proxy's own answer: 503 SlowDown or 500 InternalError, as S3 gives them."""
    code, status = ("SlowDown", "503 Slow Down") if kind == "503" else ("InternalError", "500 Internal Server Error")
    body = (f'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>{code}</Code>'
            f"<Message>injected by the test proxy</Message></Error>").encode()
    head = (f"HTTP/1.1 {status}\r\nContent-Type: application/xml\r\nContent-Length: {len(body)}\r\n"
            f"Connection: close\r\n\r\n").encode()
    return head + (b"" if first.startswith(b"HEAD ") else body)


def _shutdown(*socks: socket.socket) -> None:
    for s in socks:
        try:
            s.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass


# --------------------------------------------------------------------------
# the child process


def _serve(host: str, port: int) -> None:
    """moto.server.main(), with PUT/POST/DELETE serialised (see module doc)."""
    from moto.moto_server.werkzeug_app import DomainDispatcherApplication, MotoRequestHandler, create_backend_app
    from werkzeug.serving import run_simple

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    signal.signal(signal.SIGINT, lambda *_: sys.exit(0))
    app = DomainDispatcherApplication(create_backend_app)
    app.debug = True
    write_lock = threading.Lock()

    def serialised(environ, start_response):
        if environ.get("REQUEST_METHOD") in ("PUT", "POST", "DELETE"):
            with write_lock:
                result = app(environ, start_response)
                try:
                    body = b"".join(result)
                finally:
                    if hasattr(result, "close"):
                        result.close()
            return [body]
        return app(environ, start_response)

    run_simple(host, port, serialised, threaded=True, request_handler=MotoRequestHandler)


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "--serve":
        _serve(sys.argv[2], int(sys.argv[3]))
    else:
        sys.exit("usage: s3server.py --serve HOST PORT")
