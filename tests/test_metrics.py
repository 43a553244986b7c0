"""Metrics and health: per-rank series scraped by a real Prometheus, ``promtool check metrics``
on a live scrape, the dashboard and alert rules checked against the names really exported, the
node endpoint answering through a worker's SIGKILL and restart, a planted hung rank reported
unhealthy, and the per-worker fallback endpoints under plain torchrun."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from elastic_runner.config import ConfigError, MetricsConfig, load_config
from elastic_runner.observe.health import node_health, rank_health
from elastic_runner.observe.metrics import RankMetrics, finish_category

from .procs import CONFIGS, cli, free_port, wait_until
from .prom import prometheus_server  # noqa: F401  (fixture)
from .test_monitoring_files import metric_names_used, promtool_path

DIGITS = str(CONFIGS / "digits.yaml")
# series that exist only for language-model tasks or on CUDA (checked in-process below)
CONDITIONAL = {"elastic_runner_tokens_total", "elastic_runner_tokens_per_second",
               "elastic_runner_cuda_memory_allocated_bytes",
               "elastic_runner_cuda_memory_reserved_bytes"}


def get(port: int, path: str = "/metrics", host: str = "127.0.0.1") -> tuple[int, str]:
    """(HTTP status, body) of a GET on the endpoint at ``host``."""
    try:
        with urllib.request.urlopen(f"http://{host}:{port}{path}", timeout=5) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def samples(text: str, name: str, **labels: str) -> list[float]:
    """Values of the samples called ``name`` whose labels include ``labels``."""
    return [s.value for f in text_string_to_metric_families(text) for s in f.samples
            if s.name == name and labels.items() <= s.labels.items()]


def sample_names(text: str) -> set[str]:
    return {s.name for f in text_string_to_metric_families(text) for s in f.samples}


def train_args(port: int, *extra: str) -> list[str]:
    return ["run", DIGITS, "logging.tensorboard_dir=null", "early_stopping.enabled=false",
            f"metrics.port={port}", "training.max_epochs=1000", "training.max_steps=100000",
            "training.log_every_steps=5", *extra, "--monitor-interval", "0.2"]


# ------------------------------------------------------------------ in-process


def _rank(cfg: MetricsConfig | None = None, **kw) -> RankMetrics:
    return RankMetrics(cfg or MetricsConfig(job="j", node="n"), rank=3, local_rank=1,
                       registry=CollectorRegistry(), **kw)


def test_a_rank_is_stale_only_past_the_timeout_of_its_phase():
    m = _rank()
    m.phase("training", 5.0)
    now = time.time()
    (fresh,) = rank_health(m.registry.collect(), now=now + 1)
    (late,) = rank_health(m.registry.collect(), now=now + 6)
    assert (fresh.rank, fresh.local_rank, fresh.phase) == (3, 1, "training")
    assert not fresh.stale and late.stale and late.heartbeat_timeout_seconds == 5.0
    m.phase("loading", None)  # a checkpoint load is never a hang
    (loading,) = rank_health(m.registry.collect(), now=now + 10_000)
    assert not loading.stale and loading.heartbeat_timeout_seconds == 0

    verdict = node_health([late], expected_local_ranks=1, agent=None)
    assert not verdict.live and not verdict.ready and "rank 3 (local_rank 1)" in verdict.reason
    assert node_health([loading], 1, None).live
    assert not node_health([loading], 1, None).ready


def test_readiness_needs_a_running_agent_and_all_local_ranks_training():
    m = _rank()
    m.phase("training", 60.0)
    ranks = rank_health(m.registry.collect())
    assert node_health(ranks, 1, {"state": "running"}).ready
    restarting = node_health(ranks, 1, {"state": "restarting"})
    assert restarting.live and not restarting.ready and restarting.reason == "agent restarting"
    missing = node_health(ranks, 2, {"state": "running"})
    assert missing.live and not missing.ready and "1 of 2 local ranks" in missing.reason
    assert node_health([], 2, {"state": "rendezvous"}).live


def test_task_and_device_dependent_series_are_exported_when_they_apply():
    plain = generate_latest(_rank().registry).decode()
    m = _rank(cuda=True)
    m.count_tokens(64)
    m.step_done(1, 0, 0.1, 0.01, samples=8, loss=2.0, lr=1e-3)
    lm = generate_latest(m.registry).decode()
    assert not sample_names(plain) & CONDITIONAL
    assert sample_names(lm) >= CONDITIONAL
    assert samples(lm, "elastic_runner_tokens_total", rank="3") == [8 * 64]


def test_disabled_metrics_record_nothing():
    m = _rank(MetricsConfig(enabled=False))
    m.phase("training", 1.0)
    m.step_done(1, 0, 0.1, 0.0, samples=8, loss=1.0, lr=0.1)
    m.window(1.0)
    assert generate_latest(m.registry) == b""


def test_finish_reasons_map_to_bounded_labels():
    assert [finish_category(r) for r in (
        "max_steps reached", "max_epochs reached", "early stopping: no improvement",
        "failed: 3 non-finite steps", "preempted by signal")] == [
        "max_steps", "max_epochs", "early_stopping", "failed", "preempted"]


@pytest.mark.parametrize("override, message", [
    ("metrics.port=70000", "metrics.port"),
    ("metrics.straggler_threshold=0.5", "metrics.straggler_threshold"),
    ("metrics.heartbeat_timeout_seconds=0", "metrics.heartbeat_timeout_seconds"),
    ("metrics.prot=9400", "metrics.prot"),
])
def test_bad_metrics_config_names_the_key(override, message):
    with pytest.raises(ConfigError, match=message.replace(".", r"\.")):
        load_config(DIGITS, [override])


# ------------------------------------------------------------------ real runs


@pytest.mark.slow
def test_prometheus_scrapes_per_rank_series_and_they_cover_dashboard_and_alerts(
        launch, prometheus_server, tmp_path):  # noqa: F811
    promtool = promtool_path()  # before the run: without it the test stops here
    port = free_port()
    prom = prometheus_server([f"127.0.0.1:{port}"])
    job = launch(cli(*train_args(
        port, f"checkpoint.dir={tmp_path / 'ck'}", "checkpoint.every_steps=10",
        "metrics.job=metrics-test",
        "faults.inject=[{kind: slow, rank: 1, step: 1, count: 100000, seconds: 0.05}]")),
        name="scraped")

    def rank1_step() -> float:
        result = prom.query('elastic_runner_step{job="metrics-test", rank="1"}')
        return float(result[0]["value"][1]) if result else 0.0

    # past an epoch end: an evaluation and a checkpoint have been recorded as well
    wait_until(lambda: rank1_step() > 25, 120, "Prometheus to hold rank 1's step > 25")
    status, text = get(port)
    assert status == 200
    check = subprocess.run([promtool, "check", "metrics"], input=text, capture_output=True,
                           text=True, timeout=30)
    assert check.returncode == 0 and not check.stdout.strip() and not check.stderr.strip(), (
        check.stdout + check.stderr)

    missing = metric_names_used() - CONDITIONAL - sample_names(text)
    assert not missing, f"dashboard/alerts use series the runner does not export: {missing}"

    for rank in ("0", "1"):
        assert samples(text, "elastic_runner_step", rank=rank, local_rank=rank,
                       job="metrics-test")[0] > 25
    assert samples(text, "elastic_runner_checkpoint_last_success_timestamp_seconds",
                   rank="0")[0] > time.time() - 120
    assert samples(text, "elastic_runner_world_size", rank="1") == [2]
    # the planted straggler: named by the gauge and in rank 0's log
    assert samples(text, "elastic_runner_straggler_ratio", rank="1")[0] > 1.5
    assert samples(text, "elastic_runner_straggler_ratio", rank="0")[0] < 1.5
    assert "straggler: rank 1 on " in job.output
    # the agent's series and its job label survive the scrape (honor_labels)
    assert prom.query('elastic_runner_agent_state{job="metrics-test", state="running"} == 1')
    assert get(port, "/healthz")[0] == 200 and get(port, "/readyz")[0] == 200


class Poller(threading.Thread):
    """GETs /health every 50 ms and records (status or exception, parsed body or text)."""

    def __init__(self, port: int) -> None:
        super().__init__(daemon=True)
        self.port, self.seen, self.stop = port, [], threading.Event()

    def run(self) -> None:
        while not self.stop.wait(0.05):
            try:
                status, body = get(self.port, "/health")
                self.seen.append((status, json.loads(body) if status in (200, 503) else body))
            except OSError as e:
                self.seen.append((type(e).__name__, None))


@pytest.mark.slow
def test_endpoint_answers_through_a_restart_and_reports_a_hung_rank(launch, tmp_path,
                                                                   startup_seconds):
    port = free_port()
    # 2 s on an idle machine: under load a healthy rank between two steps must not look stale
    heartbeat = max(2.0, round(1.5 * startup_seconds, 1))
    faults = ("faults.inject=[{kind: sigkill, rank: 1, step: 12},"
              " {kind: hang, rank: 1, step: 30, attempts: 2}]")
    job = launch(cli(*train_args(
        port, f"checkpoint.dir={tmp_path / 'ck'}", "checkpoint.every_steps=5", faults,
        "watchdog.hang_timeout_seconds=null", f"metrics.heartbeat_timeout_seconds={heartbeat}",
        "recovery.mode=restart"),  # the restart path (in place: test_inplace.py)
        "--max-restarts", "2"), name="restarted")
    wait_until(lambda: _answers(port), max(60, 20 * startup_seconds), "the node endpoint")
    poller = Poller(port)
    poller.start()
    try:
        wait_until(lambda: get(port, "/healthz")[0] == 503, 180, "/healthz to report the hang")
    finally:
        poller.stop.set()
        poller.join()

    errors = [(s, b) for s, b in poller.seen if s not in (200, 503)]
    assert not errors, f"the endpoint failed to answer: {errors[:3]}"
    during = [b for _, b in poller.seen
              if b["agent"]["restarts"]["failure"] == 1 and b["agent"]["state"] != "running"]
    assert during, "no poll saw the group restarting"
    assert all(b["status"] == "ok" for b in during)  # restarting is not unhealthy
    assert any(len(b["ranks"]) < 2 for b in during)  # the dead worker's series went away
    assert "fault injection: rank 1 sigkill after step 12" in job.output

    _, text = get(port)
    assert samples(text, "elastic_runner_restarts_total", reason="failure") == [1]
    assert samples(text, "elastic_runner_rendezvous_total") == [2]
    code, body = get(port, "/healthz")
    assert code == 503 and "rank 1 (local_rank 1) silent for" in body
    assert get(port, "/readyz")[0] == 503
    code, body = get(port, "/health")
    health = json.loads(body)
    assert code == 503 and health["status"] == "unhealthy"
    stale = {r["rank"]: r for r in health["ranks"]}
    # rank 1 hangs before step 30; rank 0 waits for it in that step's gradient all-reduce
    assert stale[1]["stale"] and stale[1]["step"] == 29 and stale[1]["phase"] == "training"
    assert stale[1]["heartbeat_age_seconds"] > heartbeat


def _answers(port: int) -> bool:
    try:
        return get(port, "/health")[0] in (200, 503)
    except OSError:
        return False


@pytest.mark.slow
def test_plain_torchrun_workers_serve_their_own_endpoints(launch, tmp_path):
    port = free_port()
    while True:  # two consecutive free ports: base + local_rank
        try:
            get(port + 1)
        except OSError:
            break
        port = free_port()
    job = launch([sys.executable, "-m", "torch.distributed.run", "--standalone",
                  "--nproc-per-node", "2", "-m", "elastic_runner", "train", DIGITS,
                  "logging.tensorboard_dir=null", f"checkpoint.dir={tmp_path / 'ck'}",
                  f"metrics.port={port}", "training.max_epochs=1000"], name="torchrun")

    def steps(local_rank: int) -> list[float]:
        try:
            return samples(get(port + local_rank)[1], "elastic_runner_step")
        except OSError:
            return []

    try:
        wait_until(lambda: all(steps(r) and steps(r)[0] > 3 for r in (0, 1)), 120,
                   "both workers' endpoints to show steps")
    except AssertionError as e:  # say why (a worker that cannot bind its port exits 2)
        raise AssertionError(f"{e}\n{job.output[-4000:]}") from None
    for local_rank in (0, 1):
        text = get(port + local_rank)[1]
        ranks = {s.labels["rank"] for f in text_string_to_metric_families(text)
                 for s in f.samples if "rank" in s.labels}
        assert ranks == {str(local_rank)}  # each worker serves its own rank only
        assert "elastic_runner_agent_state" not in text  # no elastic-runner agent here
        code, body = get(port + local_rank, "/health")
        health = json.loads(body)
        assert code == 200 and health["agent"] is None
        assert [r["rank"] for r in health["ranks"]] == [local_rank]
    assert job.proc.poll() is None


def test_a_taken_port_is_a_clear_error_naming_address_and_port():
    from elastic_runner.observe.health import MetricsServer

    first = MetricsServer(CollectorRegistry(), "127.0.0.1", free_port())
    try:
        with pytest.raises(OSError, match=rf"metrics endpoint 127\.0\.0\.1:{first.port}: .*"
                                          r"choose another metrics\.port"):
            MetricsServer(CollectorRegistry(), "127.0.0.1", first.port)
        assert get(first.port, "/healthz")[0] == 200  # no ranks yet: alive
    finally:
        first.close()


def test_a_worker_file_not_yet_sized_does_not_break_a_scrape(tmp_path):
    """A starting worker creates its file before sizing it; prometheus-client's reader fails on
    the empty file, which made a probe during a restart answer HTTP 500."""
    from prometheus_client.multiprocess import MultiProcessCollector

    from elastic_runner.observe.node_metrics import LiveWorkersCollector

    (tmp_path / "counter_999999.db").touch()
    with pytest.raises(Exception):  # noqa: B017 - struct.error from the library's reader
        list(MultiProcessCollector(None, path=str(tmp_path)).collect())
    assert LiveWorkersCollector(str(tmp_path)).collect() == []
