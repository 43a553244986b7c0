"""A real etcd 3.4 server for tests: free loopback ports, a temporary data dir, killed by pid.

``etcd_server`` starts ``etcd --enable-v2`` (what torch's ``etcd``/``etcd-v2`` rendezvous
backends speak) with its client and peer URLs on 127.0.0.1 only, waits until ``/health`` answers
(bounded), and yields an :class:`EtcdServer`. ``stop()`` kills it (SIGKILL, an outage);
``start()`` brings it back on the same ports and data dir. Teardown kills it, also when the test
failed. Parametrize indirectly for a server without the v2 API, or one that speaks only HTTPS
with client-certificate authentication (``tls=True``: a throw-away CA, server and client
certificates made with the ``openssl`` command, see ``ca_file``, ``client_cert``, ``client_key``)::

    @pytest.mark.parametrize("etcd_server", [{"enable_v2": False}], indirect=True)

Tests using it are skipped when ``etcd`` (or, for TLS, ``openssl``) is not on PATH, and fail
when ``CI`` is set (tests/needs.py; Debian: ``apt-get install etcd-server``; ``.ci/run``
installs it).
"""

from __future__ import annotations

import json
import os
import platform
import ssl
import subprocess
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from .needs import debian, require_command
from .procs import free_port, kill_and_reap, wait_until

START_TIMEOUT_S = 30.0
# etcd 3.4 refuses to start on architectures other than amd64/ppc64le unless told (GOARCH names)
_GOARCH = {"x86_64": "amd64", "amd64": "amd64", "aarch64": "arm64", "arm64": "arm64",
           "ppc64le": "ppc64le", "s390x": "s390x"}


class EtcdServer:
    """One etcd member on ``host`` (127.0.0.1 unless given: e.g. the bridge address of
    network-namespace nodes); ``endpoint`` is ``"HOST:PORT"`` (client port)."""

    def __init__(self, workdir: Path, enable_v2: bool = True, tls: bool = False,
                 host: str = "127.0.0.1") -> None:
        self.workdir = workdir
        self.data_dir = workdir / "data"
        self.log_path = workdir / "etcd.log"
        self.enable_v2 = enable_v2
        self.client_port = self.peer_port = free_port()
        while self.peer_port == self.client_port:
            self.peer_port = free_port()
        self.host = host
        self.endpoint = f"{host}:{self.client_port}"
        self.url = f"{'https' if tls else 'http'}://{self.endpoint}"
        self.tls = tls
        self.ca_file = self.client_cert = self.client_key = None
        self._context: ssl.SSLContext | None = None
        if tls:
            self.ca_file, self.client_cert, self.client_key = make_certificates(workdir / "tls")
            self._context = ssl.create_default_context(cafile=str(self.ca_file))
            self._context.load_cert_chain(str(self.client_cert), str(self.client_key))
        self.proc: subprocess.Popen[bytes] | None = None

    def argv(self) -> list[str]:
        peer = f"http://{self.host}:{self.peer_port}"
        tls = []
        if self.tls:
            d = self.workdir / "tls"
            tls = ["--cert-file", str(d / "server.pem"), "--key-file", str(d / "server.key"),
                   "--trusted-ca-file", str(self.ca_file), "--client-cert-auth"]
        return ["etcd", "--name", "test", "--data-dir", str(self.data_dir),
                "--listen-client-urls", self.url, "--advertise-client-urls", self.url,
                "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
                "--initial-cluster", f"test={peer}", "--initial-cluster-state", "new",
                "--logger", "zap", "--log-outputs", "stderr", *tls,
                *(["--enable-v2"] if self.enable_v2 else [])]

    def start(self, timeout: float = START_TIMEOUT_S) -> None:
        """Start (or restart, same ports and data dir) and wait until ``/health`` says true."""
        assert self.proc is None, "etcd is already running"
        env = dict(os.environ)
        arch = _GOARCH.get(platform.machine().lower(), platform.machine().lower())
        if arch not in ("amd64", "ppc64le"):
            env["ETCD_UNSUPPORTED_ARCH"] = arch
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(self.argv(), stdout=log, stderr=subprocess.STDOUT,
                                         env=env, start_new_session=True)
        wait_until(self.healthy, timeout, f"etcd at {self.endpoint} to answer /health")

    def healthy(self) -> bool:
        if self.proc is not None and self.proc.poll() is not None:
            raise AssertionError(f"etcd exited with code {self.proc.returncode}; log tail:\n"
                                 + self.log_path.read_text(errors="replace")[-3000:])
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}),
                                             urllib.request.HTTPSHandler(context=self._context))
        try:
            with opener.open(self.url + "/health", timeout=2) as r:
                return json.loads(r.read()).get("health") == "true"
        except (OSError, ValueError):
            return False

    def stop(self) -> None:
        """Kill the server (SIGKILL, by pid) and reap it; a no-op when it is not running."""
        kill_and_reap(self.proc)
        self.proc = None


def make_certificates(d: Path) -> tuple[Path, Path, Path]:
    """A CA, a server certificate for 127.0.0.1 and a client certificate (ECDSA P-256, valid for
    a day) in ``d``; returns (ca.pem, client.pem, client.key)."""
    d.mkdir(parents=True)

    def openssl(*args: str) -> None:
        subprocess.run(["openssl", *args], cwd=d, check=True, capture_output=True, timeout=60)

    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    openssl("req", "-x509", *ec, "-keyout", "ca.key", "-out", "ca.pem", "-days", "1",
            "-subj", "/CN=elastic-runner test CA")
    for name, ext in (("server", "subjectAltName=IP:127.0.0.1\nextendedKeyUsage=serverAuth"),
                      ("client", "extendedKeyUsage=clientAuth")):
        (d / f"{name}.ext").write_text(ext + "\n")
        openssl("req", *ec, "-keyout", f"{name}.key", "-out", f"{name}.csr",
                "-subj", f"/CN={name}")
        openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key",
                "-CAcreateserial", "-out", f"{name}.pem", "-days", "1",
                "-extfile", f"{name}.ext")
    return d / "ca.pem", d / "client.pem", d / "client.key"


@pytest.fixture
def etcd_server(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[EtcdServer]:
    require_command("etcd", debian("etcd-server"))
    options = getattr(request, "param", {})
    if options.get("tls"):
        require_command("openssl", debian("openssl") + " for the TLS certificates")
    workdir = tmp_path / "etcd"
    workdir.mkdir()
    server = EtcdServer(workdir, **options)
    try:
        server.start()
        yield server
    finally:
        server.stop()


@contextmanager
def etcd_on(workdir: Path, host: str) -> Iterator[EtcdServer]:
    """An etcd server listening on ``host`` (e.g. the root namespace's address on the nodes'
    bridge), data in ``workdir`` (made here), stopped on exit."""
    workdir.mkdir()
    server = EtcdServer(workdir, host=host)
    try:
        server.start()
        yield server
    finally:
        server.stop()
