"""One tree of test data, mountable on either backend.

The only backend-specific code of the suites that run on both local and S3
(parametrize over ``BACKENDS``, never copy a test): ``publish`` makes a
private copy of a local tree (a directory, or objects in a fresh moto
bucket under a prefix) and says how to mount it; ``fetch`` brings a stored
tree back as a local directory; ``delete`` removes one stored object behind
a mount's back.  Dummy AWS credentials are set for the whole session by
tests/conftest.py.
"""

from __future__ import annotations

import shutil
import uuid
from pathlib import Path

BACKENDS = ["local", "s3"]


class Source:
    def __init__(self, backend: str, request, workdir: Path):
        self.backend, self.workdir = backend, workdir
        self.server = self.bucket = None
        if backend == "s3":
            self.server = request.getfixturevalue("moto_server")
            self.server.ensure_running()
            self.bucket = self.server.create_bucket()

    def publish(self, root: Path, prefix: str | None = None) -> tuple[str, list[str], str]:
        """(source, extra mount arguments, prefix) of a private copy of ``root``."""
        prefix = prefix or uuid.uuid4().hex[:12]
        if self.backend == "local":
            shutil.copytree(root, self.workdir / prefix, symlinks=True)
            return str(self.workdir / prefix), [], prefix
        items = {f"{prefix}/{p.relative_to(root).as_posix()}": p.read_bytes() for p in root.rglob("*") if p.is_file()}
        self.server.put_many(self.bucket, items)
        return f"s3://{self.bucket}/{prefix}", ["--endpoint-url", self.server.endpoint_url], prefix

    def fetch(self, prefix: str) -> Path:
        """The stored tree as a local directory (S3: a fresh download)."""
        if self.backend == "local":
            return self.workdir / prefix
        dest = self.workdir / f"{prefix}-{uuid.uuid4().hex[:6]}"
        pages = self.server.s3.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=prefix + "/")
        for page in pages:
            for obj in page.get("Contents", ()):
                path = dest / obj["Key"][len(prefix) + 1:]
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_bytes(self.server.s3.get_object(Bucket=self.bucket, Key=obj["Key"])["Body"].read())
        return dest

    def put(self, prefix: str, rel: str, data: bytes) -> None:
        """Replace one stored object of a published tree (another client's write)."""
        if self.backend == "local":
            tmp = self.workdir / prefix / (rel + ".new")
            tmp.write_bytes(data)
            tmp.replace(self.workdir / prefix / rel)
        else:
            self.server.s3.put_object(Bucket=self.bucket, Key=f"{prefix}/{rel}", Body=data)

    def delete(self, prefix: str, rel: str) -> None:
        """Remove one stored object of a published tree."""
        if self.backend == "local":
            (self.workdir / prefix / rel).unlink()
        else:
            self.server.s3.delete_object(Bucket=self.bucket, Key=f"{prefix}/{rel}")

    def close(self) -> None:
        if self.bucket:
            self.server.delete_bucket(self.bucket)
