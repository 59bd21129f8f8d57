"""A throw-away container with systemd as PID 1, for testing the unit
(systemd/zshardfs@.service) under systemd itself (tests/test_systemd_unit.py,
scripts/systemd_check.sh).

It boots this machine's own root file system, read-only with every change
going to memory (``systemd-nspawn --volatile=overlay``), so nothing needs
downloading and nothing the container does reaches the host's files, except
what is bound into it: /dev/fuse, this repository (its .venv is the install)
and the directories the caller names, each at its own path.

How it is started, and why each part:
- ``unshare -m`` first: a private mount namespace in which ``/`` is bound
  (not recursively) to a directory that nspawn boots. nspawn refuses to boot
  ``/`` itself except with --volatile=yes/state (no writable /etc), and a
  recursive bind would bring the host's /dev (devtmpfs), which nspawn refuses
  as "pre-populated". A tmpfs on /run/systemd there keeps nspawn's own state
  off the host (its /run is no tmpfs here: nspawn then refuses to clean it).
- ``--register=no --keep-unit``: the host's PID 1 is not systemd (no
  machined, no bus); ``--private-network``: services the host has enabled
  cannot take the host's ports; ``--link-journal=no``: the container shares
  the host's machine id.
- ``systemd.unit=basic.target``: none of the host's own services start; the
  unit under test needs nothing more (its After= targets are reached).
- A cgroup of its own (with --keep-unit nspawn takes its caller's), and the
  unified hierarchy (``SYSTEMD_NSPAWN_UNIFIED_HIERARCHY=1``, as a Debian 12
  host has it): there systemd enforces DeviceAllow= (a BPF program); with
  this host's hybrid layout the container's devices controller is read-only
  and DeviceAllow= would go unchecked.
Everything dies with the nspawn process: stop() powers the container off, and
kills nspawn (by its PID) if it does not end.
"""

from __future__ import annotations

import os
import shlex
import shutil
import signal
import subprocess
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BOOT_TIMEOUT = 90.0
#: where the container gets a cgroup of its own (a hybrid host's named and
#: unified hierarchies, or a unified host's one): two containers (two test runs)
#: at once would otherwise share the host's, and their units collide
CGROUP_HIERARCHIES = ("/sys/fs/cgroup/systemd", "/sys/fs/cgroup/unified", "/sys/fs/cgroup")


class BootError(RuntimeError):
    pass


class Container:
    def __init__(self, scratch: Path, binds: list[Path] = (), name: str | None = None, private_network: bool = True):
        self.scratch = Path(scratch)
        self.binds = [ROOT, *map(Path, binds)]
        self.name = name or f"zshardfs-test-{os.getpid()}"
        self.proc: subprocess.Popen | None = None
        self.leader: int | None = None
        self.log = self.scratch / "nspawn.log"
        self.private_network = private_network  # (False: the host's network, e.g. for pip)

    # ------------------------------------------------------------------
    def start(self) -> float:
        """Boot; the seconds it took. BootError (with nspawn's output) if it
        cannot."""
        for tool in ("systemd-nspawn", "unshare", "nsenter"):
            if shutil.which(tool) is None:
                raise BootError(f"{tool} is missing (scripts/setup.sh installs systemd-container)")
        self.scratch.mkdir(parents=True, exist_ok=True)
        rootdir = self.scratch / "root"
        rootdir.mkdir(exist_ok=True)
        os.makedirs("/run/systemd", exist_ok=True)
        nspawn = ["systemd-nspawn", "--quiet", "-D", str(rootdir), "--volatile=overlay",
                  "--register=no", "--keep-unit", "--link-journal=no",
                  *(["--private-network"] if self.private_network else []),
                  f"--machine={self.name}", "--bind=/dev/fuse",
                  *(f"--bind={p}" for p in self.binds),
                  "--system-call-filter=bpf", "--boot", "systemd.unit=basic.target"]
        self.cgroups = [Path(h) / self.name for h in CGROUP_HIERARCHIES if Path(h, "cgroup.procs").exists()]
        enter = "".join(f"mkdir -p {shlex.quote(str(c))}; echo $$ > {shlex.quote(str(c))}/cgroup.procs; "
                        for c in self.cgroups)
        script = (f"set -e; {enter}mount --bind / {shlex.quote(str(rootdir))}; "
                  f"mount -t tmpfs -o mode=755 tmpfs /run/systemd; exec {shlex.join(nspawn)}")
        started = time.monotonic()
        with open(self.log, "wb") as out:
            self.proc = subprocess.Popen(["unshare", "-m", "--propagation", "private", "sh", "-c", script],
                                         stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                         start_new_session=True,
                                         env={**os.environ, "SYSTEMD_NSPAWN_UNIFIED_HIERARCHY": "1"})
        deadline = started + BOOT_TIMEOUT
        while self.leader is None:
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise BootError(f"the container did not start: {self._log_tail()}")
            self.leader = self._find_leader()
            time.sleep(0.05)
        while True:
            left = deadline - time.monotonic()
            state = self.run("systemctl is-system-running --wait", check=False,
                             timeout=max(left, 1)).stdout.strip()
            if state in ("running", "degraded"):
                break
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise BootError(f"the container's systemd did not come up ({state!r}): {self._log_tail()}")
            time.sleep(0.2)
        if state == "degraded":
            failed = self.run("systemctl --failed --no-legend --plain", check=False).stdout
            raise BootError(f"the container booted degraded: {failed.strip()}")
        return time.monotonic() - started

    def _find_leader(self) -> int | None:
        """The container's PID 1 as the host sees it: the child of the
        systemd-nspawn our unshare became, once it runs systemd."""
        try:
            kids = Path(f"/proc/{self.proc.pid}/task/{self.proc.pid}/children").read_text().split()
            for kid in kids:
                if Path(f"/proc/{kid}/comm").read_text().strip() == "systemd":
                    return int(kid)
        except (OSError, ValueError):
            pass
        return None

    def _log_tail(self) -> str:
        try:
            return self.log.read_text(errors="replace")[-3000:]
        except OSError:
            return "(no output)"

    # ------------------------------------------------------------------
    def run(self, command: str, *, check: bool = True, timeout: float = 60) -> subprocess.CompletedProcess:
        """``sh -c command`` inside the container, as root."""
        assert self.leader is not None
        result = subprocess.run(["nsenter", "-t", str(self.leader), "-a", "--", "/bin/sh", "-c", command],
                                capture_output=True, text=True, timeout=timeout,
                                env={"PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
                                     "LANG": "C.UTF-8", "SYSTEMD_PAGER": "", "SYSTEMD_COLORS": "0"})
        if check and result.returncode != 0:
            raise AssertionError(f"in the container: {command!r} exited {result.returncode}:\n"
                                 f"{result.stdout}{result.stderr}")
        return result

    def stop(self) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None and self.leader is not None:
            try:
                self.run("systemctl poweroff --no-block", check=False, timeout=20)
            except subprocess.TimeoutExpired:
                pass
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)  # (its own session: nspawn and nothing else of ours)
            self.proc.wait(timeout=30)
        self.proc = None
        for top in self.cgroups:  # (empty now: removed leaves first)
            for path, _dirs, _files in sorted(os.walk(top), key=lambda entry: -len(entry[0])):
                try:
                    os.rmdir(path)
                except OSError:
                    pass
