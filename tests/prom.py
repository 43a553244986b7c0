"""A real Prometheus server for tests, on loopback, scraping given targets every second.

``prometheus_server(targets)`` (a fixture factory) writes a config with ``honor_labels: true``
(the runner's ``job`` label must win over the scrape job's), starts ``prometheus`` with its data
in the test's tmp dir, waits for ``/-/ready`` (bounded) and kills it at teardown, by pid.
Tests using it are skipped when ``prometheus`` is not on PATH, and fail when ``CI`` is set
(tests/needs.py; Debian: ``apt-get install prometheus``; ``.ci/run`` installs it).
"""

from __future__ import annotations

import json
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import yaml

from .needs import debian, require_command
from .procs import Job, free_port, wait_until


class Prometheus:
    def __init__(self, job: Job, port: int) -> None:
        self.job, self.url = job, f"http://127.0.0.1:{port}"

    def query(self, promql: str) -> list[dict]:
        """Instant query through the HTTP API; the ``result`` vector."""
        url = f"{self.url}/api/v1/query?{urllib.parse.urlencode({'query': promql})}"
        with urllib.request.urlopen(url, timeout=5) as r:
            body = json.load(r)
        assert body["status"] == "success", body
        return body["data"]["result"]

    def ready(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.url}/-/ready", timeout=2) as r:
                return r.status == 200
        except OSError:
            return False


@pytest.fixture
def prometheus_server(tmp_path: Path) -> Iterator[Callable[[list[str]], Prometheus]]:
    require_command("prometheus", debian("prometheus"))
    jobs: list[Job] = []

    def start(targets: list[str]) -> Prometheus:
        port = free_port()
        config = tmp_path / "prometheus.yml"
        config.write_text(yaml.safe_dump({
            "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
            "scrape_configs": [{"job_name": "elastic-runner", "honor_labels": True,
                                "scrape_timeout": "1s",
                                "static_configs": [{"targets": targets}]}]}))
        job = Job(["prometheus", f"--config.file={config}",
                   f"--storage.tsdb.path={tmp_path / 'tsdb'}",
                   f"--web.listen-address=127.0.0.1:{port}"],
                  tmp_path / "prometheus.log")
        jobs.append(job)
        server = Prometheus(job, port)
        wait_until(server.ready, 30, "prometheus to be ready", poll=0.2)
        return server

    yield start
    for job in jobs:
        job.kill_all()
