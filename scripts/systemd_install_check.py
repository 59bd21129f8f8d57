"""Follow the install steps in systemd/zshardfs@.service's header, word for
word, inside a throw-away container with systemd as PID 1 (tests/nspawn.py),
then start the unit, read a chunk through the mount, stop it.

    sudo .venv/bin/python scripts/systemd_install_check.py

The tree installed is the last commit (git archive HEAD).
Not part of the test suite: `pip install .` fetches the dependencies from
PyPI (the container uses the host's network for it; about 15 s with pip's
cache warm). tests/test_systemd_unit.py checks the unit itself offline, with
this repository's .venv as the install. Everything the steps write (/opt,
/usr/local/bin, /etc) goes to the container's memory and is gone when it
stops. Exit status 0 when the unit served the chunk and stopped cleanly.
"""

from __future__ import annotations

import hashlib
import os
import re
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.handmade_zarr import SmallStore  # noqa: E402
from tests.nspawn import ROOT, Container  # noqa: E402


def header_steps(unit: str) -> list[str]:
    """The '# Install ...' block's command lines, as written."""
    block = re.search(r"^# Install .*\n((?:#   .*\n)+)", unit, re.M)
    if not block:
        raise SystemExit("the unit's header has no install steps")
    return [re.sub(r"\s+\(Documentation=\)$", "", line[4:].strip()) for line in block.group(1).splitlines()]


def main() -> int:
    unit = (ROOT / "systemd" / "zshardfs@.service").read_text()
    python = Path(os.path.realpath(sys.executable)).parent  # (python3.12 on the steps' PATH)
    with tempfile.TemporaryDirectory(prefix="zshardfs-install-") as scratch:
        store = SmallStore(Path(scratch) / "store")
        subprocess.run(["chmod", "-R", "a+rX", scratch], check=True)
        name = sorted(store.chunks)[0]
        conf = Path(scratch) / "dataset1.conf"
        conf.write_text(f"SOURCE={store.root}\nMOUNTPOINT=/mnt/unsharded\nOPTIONS=ro,allow_other\n")
        steps = [step.replace("$EDITOR /etc/zshardfs/dataset1.conf", f"cp {conf} /etc/zshardfs/dataset1.conf")
                 for step in header_steps(unit)]
        script = "\n".join([
            "set -e", f"export PATH={shlex.quote(str(python))}:$PATH",
            f"mkdir -p /root/src && git -C {shlex.quote(str(ROOT))} archive HEAD | tar x -C /root/src",
            "cd /root/src", *(f"echo '+ {s}' && {s}" for s in steps),
            "systemctl is-active zshardfs@dataset1",
            f"sha256sum /mnt/unsharded/{name}",
            "systemctl stop zshardfs@dataset1",
            "systemctl show -p Result -p ExecMainStatus zshardfs@dataset1",
            "journalctl -u zshardfs@dataset1 -o cat --no-pager",
        ])
        box = Container(Path(scratch) / "box", binds=[Path(scratch)], name=f"zshardfs-install-{os.getpid()}",
                        private_network=False)
        try:
            box.start()
            result = box.run(script, check=False, timeout=900)
        finally:
            box.stop()
    print(result.stdout, end="")
    print(result.stderr, end="", file=sys.stderr)
    expected = hashlib.sha256(store.chunks[name]).hexdigest()
    ok = (result.returncode == 0 and f"{expected}  /mnt/unsharded/{name}" in result.stdout
          and "Result=success" in result.stdout and "ExecMainStatus=0" in result.stdout)
    print("systemd_install_check:", "the header's install steps work" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
