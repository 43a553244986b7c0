"""A real S3 API server for tests: moto in server mode on a free loopback port, killed by pid.

``s3_server`` (one per test session: it starts in about a second and holds its objects in
memory) runs ``python -m moto.server -H 127.0.0.1 -p PORT``, waits until it answers (bounded) and
yields an :class:`S3Server`. ``s3_bucket`` gives each test a new bucket on it and points this
process at the server (``S3Server.env`` set with ``monkeypatch``, s3fs's instance cache
cleared); pass ``bucket.env`` to the processes a test starts::

    def test_x(s3_bucket, launch):
        url = f"{s3_bucket.url}/run"                      # s3://<bucket>/run
        job = launch(cli("run", ..., f"checkpoint.dir={url}"), env=s3_bucket.env)
        s3_bucket.fs().exists(f"{s3_bucket.name}/run/step-00000005/manifest.json")

Clients find the server through the standard AWS variables (botocore >= 1.31 honours
``AWS_ENDPOINT_URL``, so s3fs needs no storage options: ``checkpoint.dir`` stays a plain URL).
:meth:`S3Server.fs` is an s3fs client for the test's own checks and fault injection: it does not
cache listings and is not shared with the code under test. A test that stops the server (an
outage) should build its own :class:`S3Server` rather than stop the session's. Tests using it are
skipped when moto or s3fs is not installed, and fail when ``CI`` is set (tests/needs.py;
``pip install -e '.[test]'``).
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import urllib.request
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from .needs import TEST_EXTRAS, require_modules
from .procs import free_port, kill_and_reap, wait_until

START_TIMEOUT_S = 60.0


class S3Server:
    """One moto server on 127.0.0.1; ``endpoint`` is ``"http://127.0.0.1:PORT"``."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.log_path = workdir / "moto.log"
        self.port = free_port()
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def env(self) -> dict[str, str]:
        """What an S3 client needs to reach this server (dummy credentials: moto accepts any)."""
        return {"AWS_ENDPOINT_URL": self.endpoint, "AWS_ACCESS_KEY_ID": "testing",
                "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1",
                "AWS_EC2_METADATA_DISABLED": "true",  # never probe for instance credentials
                "NO_PROXY": "127.0.0.1,localhost", "no_proxy": "127.0.0.1,localhost"}

    def start(self, timeout: float = START_TIMEOUT_S) -> None:
        """Start the server and wait until it answers an S3 request (ListBuckets)."""
        assert self.proc is None, "the S3 server is already running"
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)],
                stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                env={**os.environ, **self.env})
        wait_until(self.healthy, timeout, f"the S3 server at {self.endpoint} to answer")

    def healthy(self) -> bool:
        if self.proc is not None and self.proc.poll() is not None:
            raise AssertionError(f"moto server exited with code {self.proc.returncode}; log "
                                 "tail:\n" + self.log_path.read_text(errors="replace")[-3000:])
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
        try:
            with opener.open(self.endpoint + "/", timeout=2) as r:
                return r.status == 200
        except OSError:  # refused, reset, timed out, HTTP errors (URLError is an OSError)
            return False

    def stop(self) -> None:
        """Kill the server (SIGKILL, by pid: its objects are gone) and reap it; a no-op when
        it is not running."""
        kill_and_reap(self.proc)
        self.proc = None

    def fs(self) -> Any:
        """A fresh s3fs client of this server that caches no listings (the test's own view)."""
        import s3fs

        return s3fs.S3FileSystem(key="testing", secret="testing", skip_instance_cache=True,
                                 use_listings_cache=False,
                                 client_kwargs={"endpoint_url": self.endpoint})


@dataclass
class S3Bucket:
    """A bucket of its own for one test: ``url`` is ``s3://<name>``."""

    server: S3Server
    name: str

    @property
    def url(self) -> str:
        return f"s3://{self.name}"

    @property
    def env(self) -> dict[str, str]:
        return self.server.env

    def fs(self) -> Any:
        return self.server.fs()

    def key(self, relative: str) -> str:
        """``<name>/<relative>``: the path form s3fs takes."""
        return f"{self.name}/{relative.lstrip('/')}"


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[S3Server]:
    require_modules("moto", "s3fs", "flask", install_hint=TEST_EXTRAS + " (moto[server], s3fs)")
    server = S3Server(tmp_path_factory.mktemp("s3"))
    try:
        server.start()
        yield server
    finally:
        server.stop()


def clear_s3fs_instances() -> None:
    """Make this process's next ``s3://`` access build a new s3fs instance: fsspec reuses one
    per argument set, with its endpoint and its (never expiring) listing cache. A test calls it
    to read the bucket as a new process (a restarted rank 0) would."""
    import s3fs

    s3fs.S3FileSystem.clear_instance_cache()


@pytest.fixture
def s3_bucket(s3_server: S3Server, monkeypatch: pytest.MonkeyPatch) -> Iterator[S3Bucket]:
    for key, value in s3_server.env.items():
        monkeypatch.setenv(key, value)
    clear_s3fs_instances()
    bucket = S3Bucket(s3_server, f"ck-{uuid.uuid4().hex[:16]}")
    fs = s3_server.fs()
    fs.mkdir(bucket.name)
    yield bucket
    clear_s3fs_instances()
    with contextlib.suppress(OSError):
        fs.rm(bucket.name, recursive=True)
