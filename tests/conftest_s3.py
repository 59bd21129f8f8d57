"""pytest fixtures for tests that need S3: moto's stand-alone server.

Load with ``pytest_plugins = ["tests.conftest_s3"]`` in tests/conftest.py
(or ``-p tests.conftest_s3``).  One server serves the whole session; each
test gets its own bucket.  A test may pause, kill or restart the server:
the next ``s3_bucket`` brings it back (the port stays the same).
"""

from __future__ import annotations

import pytest

from tests.s3server import CLEARED_ENV, MotoServer, dummy_credentials_env

__all__ = ["moto_server", "s3_bucket"]


@pytest.fixture(scope="session")
def moto_server(tmp_path_factory):
    """The running :class:`~tests.s3server.MotoServer`; the process
    environment holds dummy AWS credentials for the whole session, so
    boto3 clients and spawned daemons pick them up."""
    env = pytest.MonkeyPatch()
    for name in CLEARED_ENV:
        env.delenv(name, raising=False)
    for name, value in dummy_credentials_env().items():
        env.setenv(name, value)
    server = MotoServer(tmp_path_factory.mktemp("moto") / "access.log")
    server.start()
    try:
        yield server
    finally:
        server.stop()
        env.undo()


@pytest.fixture
def s3_bucket(moto_server):
    """``(endpoint_url, bucket_name)`` of a fresh, empty bucket."""
    moto_server.ensure_running()
    name = moto_server.create_bucket()
    yield moto_server.endpoint_url, name
    moto_server.ensure_running()
    moto_server.delete_bucket(name)
