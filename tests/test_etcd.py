"""etcd rendezvous: ``elastic-runner run`` and plain torchrun against a real etcd 3.4 (both of
torch's etcd backends), the rendezvous options torch receives, and the pre-flight check's one-line
errors (unreachable, v2 API disabled, TLS)."""

from __future__ import annotations

import json
import pickle
import re
import signal
import sys
import threading
import time
import urllib.request
import uuid
from datetime import datetime, timedelta, timezone

import pytest
from torch.distributed.elastic.rendezvous import RendezvousParameters, dynamic_rendezvous
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import (
    DynamicRendezvousHandler,
    RendezvousTimeout,
)
from torch.distributed.elastic.rendezvous.etcd_rendezvous import (
    _create_etcd_client as legacy_etcd_client,
)
from torch.distributed.elastic.rendezvous.etcd_rendezvous_backend import create_backend
from torch.distributed.run import config_from_args, get_args_parser

from elastic_runner.agent import rendezvous_outage
from elastic_runner.agent.etcd_check import EtcdCheckError, check_etcd, parse_conf
from elastic_runner.agent.launch import torchrun_argv
from elastic_runner.cli import build_parser
from elastic_runner.compat import rendezvous as compat_rendezvous

from .etcd import EtcdServer
from .procs import CONFIGS, cli, free_port, wait_until

DIGITS = str(CONFIGS / "digits.yaml")
SHORT = ["logging.tensorboard_dir=null", "training.max_steps=6"]
# where each backend keeps a run's rendezvous state in etcd
STATE_KEY = {"etcd-v2": "/torch/elastic/rendezvous/{}", "etcd": "/torchelastic/p2p/run_{}"}
_NO_PROXY = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def rdzv_configs(monkeypatch: pytest.MonkeyPatch, *cmd: str) -> dict:
    """The rendezvous options torch's handler receives for ``elastic-runner run *cmd``."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # config_from_args sets it otherwise
    targs = get_args_parser().parse_args(torchrun_argv(build_parser().parse_args(["run", *cmd])))
    return config_from_args(targs)[0].rdzv_configs


def etcd_has_key(server: EtcdServer, key: str) -> bool:
    try:
        with _NO_PROXY.open(f"{server.url}/v2/keys{key}", timeout=10) as r:
            return r.status == 200
    except urllib.error.HTTPError as e:
        if e.code == 404:
            return False
        raise


def rank_summaries(ck) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted((ck / "ranks").glob("rank-*.json"))]


def error_lines(output: str) -> list[str]:
    return [ln for ln in output.splitlines() if ln.startswith("elastic-runner: error:")]


# --- the rendezvous options torch receives (no processes) ---

def test_etcd_v2_conf_carries_tls_and_timeouts(monkeypatch):
    conf = rdzv_configs(
        monkeypatch, "c.yaml", "--rdzv-backend", "etcd-v2", "--rdzv-endpoint", "etcd:2379",
        "--rdzv-conf", "protocol=https,cacert=/tls/ca.pem,cert=/tls/c.pem,key=/tls/c.key",
        "--rdzv-conf", "join_timeout=30,last_call_timeout=5,close_timeout=7,read_timeout=9",
        "--rdzv-conf", "heartbeat=4,keep_alive_interval=2,keep_alive_max_attempt=3")
    assert conf["protocol"] == "https"
    # torch's etcd-v2 reads ca_cert/ssl_cert/ssl_cert_key: legacy spellings are carried over
    assert (conf["ca_cert"], conf["ssl_cert"], conf["ssl_cert_key"]) == (
        "/tls/ca.pem", "/tls/c.pem", "/tls/c.key")
    assert (conf["cacert"], conf["cert"], conf["key"]) == ("/tls/ca.pem", "/tls/c.pem",
                                                           "/tls/c.key")
    for key, value in (("join_timeout", "30"), ("last_call_timeout", "5"),
                       ("close_timeout", "7"), ("read_timeout", "9"), ("heartbeat", "4"),
                       ("keep_alive_interval", "2"), ("keep_alive_max_attempt", "3")):
        assert conf[key] == value, key


def test_legacy_etcd_conf_gets_its_own_spellings(monkeypatch):
    conf = rdzv_configs(monkeypatch, "c.yaml", "--rdzv-backend", "etcd", "--rdzv-conf",
                        "protocol=https,ca_cert=/ca.pem,ssl_cert=/c.pem,ssl_cert_key=/c.key,"
                        "join_timeout=45,last_call_timeout=5,etcd_prefix=/mine")
    assert (conf["cacert"], conf["cert"], conf["key"]) == ("/ca.pem", "/c.pem", "/c.key")
    assert conf["timeout"] == "45"  # legacy etcd's join timeout (torch's default would be 900)
    assert (conf["last_call_timeout"], conf["etcd_prefix"]) == ("5", "/mine")


def test_both_spellings_given_are_left_alone_and_pet_conf_is_completed(monkeypatch):
    conf = rdzv_configs(monkeypatch, "c.yaml", "--rdzv-backend", "etcd-v2", "--rdzv-conf",
                        "ca_cert=/a.pem,cacert=/b.pem")
    assert (conf["ca_cert"], conf["cacert"]) == ("/a.pem", "/b.pem")

    monkeypatch.setenv("PET_RDZV_BACKEND", "etcd-v2")
    monkeypatch.setenv("PET_RDZV_CONF", "protocol=https,cacert=/ca.pem")
    conf = rdzv_configs(monkeypatch, "c.yaml")
    assert (conf["protocol"], conf["ca_cert"]) == ("https", "/ca.pem")


# --- the pre-flight check against real servers (no workers) ---

def test_fixture_restarts_on_the_same_port_and_data(etcd_server):
    req = urllib.request.Request(f"{etcd_server.url}/v2/keys/probe", data=b"value=1",
                                 method="PUT")
    _NO_PROXY.open(req, timeout=10).close()
    etcd_server.stop()
    assert not etcd_server.healthy()
    with pytest.raises(EtcdCheckError, match="connection refused"):
        check_etcd(etcd_server.endpoint, {}, wait_s=0)
    etcd_server.start()
    assert etcd_has_key(etcd_server, "/probe")
    assert check_etcd(etcd_server.endpoint, {}).startswith("3.")


@pytest.mark.parametrize("etcd_server", [{"tls": True}], indirect=True)
def test_tls_options_reach_torchs_etcd_client(etcd_server, monkeypatch):
    s = etcd_server
    tls = f"protocol=https,cacert={s.ca_file},cert={s.client_cert},key={s.client_key}"
    for backend in ("etcd-v2", "etcd"):
        assert check_etcd(s.endpoint, parse_conf(tls), backend=backend).startswith("3.4")
    # what `run` hands torch's etcd-v2 client: a rendezvous state round trip over mutual TLS
    conf = rdzv_configs(monkeypatch, "c.yaml", "--rdzv-backend", "etcd-v2", "--rdzv-endpoint",
                        s.endpoint, "--rdzv-conf", tls)
    backend, store = create_backend(RendezvousParameters("etcd-v2", s.endpoint, "tls-run", 1, 1,
                                                         **conf))
    assert backend.set_state(b"state")[0] == b"state"
    store.set("key", "value")
    assert store.get("key") == b"value"
    # ... and the legacy etcd backend's client, given the etcd-v2 spellings
    tls_v2 = f"protocol=https,ca_cert={s.ca_file},ssl_cert={s.client_cert}," \
             f"ssl_cert_key={s.client_key}"
    conf = rdzv_configs(monkeypatch, "c.yaml", "--rdzv-backend", "etcd", "--rdzv-endpoint",
                        s.endpoint, "--rdzv-conf", tls_v2)
    client = legacy_etcd_client(RendezvousParameters("etcd", s.endpoint, "tls-run", 1, 1, **conf))
    client.write("/legacy-tls", "ok")
    assert client.read("/legacy-tls").value == "ok"

    no_ca = f"protocol=https,cert={s.client_cert},key={s.client_key}"
    with pytest.raises(EtcdCheckError, match=r"not trusted .*cacert=CA.pem"):
        check_etcd(s.endpoint, parse_conf(no_ca))
    with pytest.raises(EtcdCheckError, match=r"TLS handshake .* failed .*client certificate"):
        check_etcd(s.endpoint, parse_conf(f"protocol=https,cacert={s.ca_file}"))
    with pytest.raises(EtcdCheckError, match=rf"etcd at {s.endpoint} expects HTTPS"):
        check_etcd(s.endpoint, {})


# --- the rendezvous state across an etcd outage (torch's handler, compat's fix 2) ---

KEEP_ALIVE_S, KEEP_ALIVE_ATTEMPTS = 0.5, 2  # torch's handler: dead after 1 s without a beat


@pytest.fixture
def patched_handler(monkeypatch):
    """torch's ``DynamicRendezvousHandler`` with compat's fix 2, on subclasses (the real classes
    stay as torch made them for the other tests)."""
    class Holder(dynamic_rendezvous._BackendRendezvousStateHolder):
        pass

    class Handler(DynamicRendezvousHandler):
        pass

    assert rendezvous_outage.apply_rendezvous_fixes(Handler, Holder)
    monkeypatch.setattr(dynamic_rendezvous, "_BackendRendezvousStateHolder", Holder)
    monkeypatch.setattr(rendezvous_outage, "_RETRY_S", 0.2)
    monkeypatch.setenv(compat_rendezvous.SHARE_STORE_SWITCH, "1")
    return Handler


def _handler(cls, etcd_server, run_id: str, addr: str):
    backend, store = create_backend(RendezvousParameters("etcd-v2", etcd_server.endpoint,
                                                         run_id, 1, 2))
    timeout = RendezvousTimeout(join=timedelta(seconds=60), last_call=timedelta(seconds=0.5),
                                heartbeat=timedelta(seconds=2))
    return cls.from_backend(run_id, store, backend, 1, 2, local_addr=addr, timeout=timeout,
                            keep_alive_interval=KEEP_ALIVE_S,
                            keep_alive_max_attempt=KEEP_ALIVE_ATTEMPTS), backend


def _beat_after(backend, node, moment: datetime) -> bool:
    """Whether the state in etcd holds a keep-alive of ``node`` written after ``moment``."""
    beat = pickle.loads(backend.get_state()[0]).last_heartbeats.get(node)
    return beat is not None and beat > moment


@pytest.mark.parametrize("newcomer", ["after", "during"])
def test_a_node_that_outlived_an_etcd_outage_stays_in_its_rendezvous(patched_handler,
                                                                     etcd_server, newcomer):
    """etcd down for 3x the keep-alive lapse. Torch's handler then drops every running node at
    its first read (its own included) and stops beating, so a node arriving next forms a round of
    its own beside the running group (seen in the soak: the running group was fenced out). With
    fix 2 the running node beats again, and a node arriving after the outage, or retrying through
    it, waits for the running node's next round instead."""
    run_id = f"outage-{uuid.uuid4().hex[:8]}"
    running, backend = _handler(patched_handler, etcd_server, run_id, "node-a")
    first = running.next_rendezvous()
    assert (first.rank, first.world_size) == (0, 1)
    assert _beat_after(backend, running._this_node, datetime.now(timezone.utc) - timedelta(1))

    results: list = []
    arrival = threading.Thread(target=lambda: results.append(joiner.next_rendezvous()),
                               daemon=True)
    joiner, _ = _handler(patched_handler, etcd_server, run_id, "node-b")  # its client needs etcd
    etcd_server.stop()
    if newcomer == "during":
        arrival.start()  # retries every _RETRY_S until etcd answers
    time.sleep(3 * KEEP_ALIVE_S * KEEP_ALIVE_ATTEMPTS)  # the fault: the outage's length
    back = datetime.now(timezone.utc)
    etcd_server.start()
    if newcomer == "after":
        wait_until(lambda: _beat_after(backend, running._this_node, back), 15,
                   "the running node's keep-alive after the outage")
        arrival.start()
    wait_until(lambda: running.num_nodes_waiting() == 1, 15,
               "the newcomer to wait for the running node's round")
    assert not results, f"the newcomer formed a round of its own: {results}"
    second = running.next_rendezvous()
    arrival.join(timeout=30)
    assert second.world_size == 2 and [r.world_size for r in results] == [2]
    assert sorted([second.rank, results[0].rank]) == [0, 1]
    for handler in (running, joiner):
        handler.shutdown()


def test_two_running_nodes_both_beat_again_after_etcd_hung(patched_handler, etcd_server):
    """etcd SIGSTOPped for 3x the keep-alive lapse under a round of two running nodes: their
    reads hang and return once it runs again, with no connection error. Without the grace for
    a hung read, the first node to read expired the other, which then never beat again (torch
    beats only for a node in the state), and a node arriving later formed a round of its own
    (seen in the membership soak at fault 45: the running group was fenced out)."""
    run_id = f"hang-{uuid.uuid4().hex[:8]}"
    (a, backend), (b, _) = (_handler(patched_handler, etcd_server, run_id, n)
                            for n in ("node-a", "node-b"))
    rounds: list = []
    threads = [threading.Thread(target=lambda h=h: rounds.append(h.next_rendezvous()),
                                daemon=True) for h in (a, b)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert sorted(r.world_size for r in rounds) == [2, 2]
    etcd_server.proc.send_signal(signal.SIGSTOP)
    time.sleep(3 * KEEP_ALIVE_S * KEEP_ALIVE_ATTEMPTS)
    back = datetime.now(timezone.utc)
    etcd_server.proc.send_signal(signal.SIGCONT)
    for h in (a, b):
        wait_until(lambda h=h: _beat_after(backend, h._this_node, back), 15,
                   f"{h._this_node}'s keep-alive after the hang")
    for h in (a, b):
        h.shutdown()


# --- end to end: real agents and workers (gloo on CPU) ---

@pytest.mark.slow
@pytest.mark.parametrize("backend", ["etcd-v2", "etcd"])
def test_run_with_etcd_rendezvous_then_same_id_is_refused(launch, etcd_server, tmp_path,
                                                          backend):
    run_id, ck = f"job-{uuid.uuid4().hex[:8]}", tmp_path / "ck"
    args = [DIGITS, *SHORT, f"checkpoint.dir={ck}", "--nproc-per-node", "2",
            "--rdzv-backend", backend, "--rdzv-endpoint", etcd_server.endpoint,
            "--rdzv-id", run_id, "--rdzv-conf", "join_timeout=60", "--monitor-interval", "0.2"]
    job = launch(cli("run", *args), name=backend)
    assert job.wait(timeout=240) == 0, job.output[-3000:]
    assert "rendezvous: etcd 3.4." in job.output
    assert (ck / "results.json").is_file()
    assert [(s["rank"], s["world_size"], s["step"]) for s in rank_summaries(ck)] == [
        (0, 2, 6), (1, 2, 6)]
    assert etcd_has_key(etcd_server, STATE_KEY[backend].format(run_id))

    # the ended job closed its rendezvous; the same --rdzv-id again is refused in one line
    again = launch(cli("run", *args), name=f"{backend}-again")
    assert again.wait(timeout=120) == 1, again.output[-3000:]
    errors = error_lines(again.output)
    assert len(errors) == 1 and f"rendezvous '{run_id}'" in errors[0], again.output[-3000:]
    assert "is closed" in errors[0] and "new --rdzv-id" in errors[0]
    assert "Traceback" not in again.output


@pytest.mark.slow
def test_plain_torchrun_with_etcd_v2(launch, etcd_server, tmp_path):
    ck = tmp_path / "ck"
    job = launch([sys.executable, "-m", "torch.distributed.run", "--nnodes=1",
                  "--nproc-per-node=2", "--rdzv-backend=etcd-v2",
                  f"--rdzv-endpoint={etcd_server.endpoint}", "--rdzv-id=plain-etcd",
                  "--rdzv-conf=join_timeout=60", "-m", "elastic_runner", "train", DIGITS,
                  *SHORT, f"checkpoint.dir={ck}"], name="torchrun-etcd")
    assert job.wait(timeout=240) == 0, job.output[-3000:]
    assert [(s["world_size"], s["step"]) for s in rank_summaries(ck)] == [(2, 6), (2, 6)]
    assert etcd_has_key(etcd_server, STATE_KEY["etcd-v2"].format("plain-etcd"))


def exit_after_waiting(job, waiting: str, join_timeout: float, startup_seconds: float) -> int:
    """The exit code of ``job``, which must exit within ``join_timeout`` seconds of logging
    ``waiting`` (its start-up is over then: the imports alone take 1.5 s on an idle 2-core
    machine, 10 s and more under load), plus a margin for the report and the interpreter's
    exit that scales with the measured start-up."""
    wait_until(lambda: waiting in job.output or job.proc.poll() is not None,
               max(60.0, 20 * startup_seconds), f"the job to log {waiting!r}")
    t0 = time.monotonic()
    limit = join_timeout + max(5.0, startup_seconds)  # defaults: 30 s (etcd), 600 s (join)
    code = job.wait(timeout=limit + 60)
    took = time.monotonic() - t0
    assert waiting in job.output, job.output[-3000:]
    assert took < limit, f"exited {took:.1f} s after {waiting!r} (limit {limit:.1f} s)"
    return code


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["etcd-v2", "etcd"])
def test_missing_nodes_time_out_after_join_timeout_in_one_line(launch, etcd_server, tmp_path,
                                                               backend, startup_seconds):
    """join_timeout reaches either backend (legacy etcd reads it as ``timeout``)."""
    job = launch(cli("run", DIGITS, *SHORT, f"checkpoint.dir={tmp_path / 'ck'}", "--nnodes", "2",
                     "--rdzv-backend", backend, "--rdzv-endpoint", etcd_server.endpoint,
                     "--rdzv-id", f"alone-{backend}", "--rdzv-conf", "join_timeout=3"),
                 name="alone")
    assert exit_after_waiting(job, "rendezvous: etcd", 3, startup_seconds) == 1, job.output[-3000:]
    errors = error_lines(job.output)
    assert len(errors) == 1, job.output[-3000:]
    key = "timeout" if backend == "etcd" else "join_timeout"
    assert errors[0] == (
        f"elastic-runner: error: rendezvous 'alone-{backend}' at {etcd_server.endpoint} "
        f"({backend}) timed out: fewer than 2 node(s) (--nnodes 2) joined within 3 s ({key}); "
        "start the other nodes with the same --rdzv-endpoint and --rdzv-id, or raise "
        "--rdzv-conf join_timeout=S")
    assert "Traceback" not in job.output and "task digits" not in job.output


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["etcd-v2", "etcd"])
def test_unreachable_etcd_fails_within_join_timeout_in_one_line(launch, tmp_path, backend,
                                                                startup_seconds):
    endpoint = f"127.0.0.1:{free_port()}"  # nothing listens there
    job = launch(cli("run", DIGITS, *SHORT, f"checkpoint.dir={tmp_path / 'ck'}",
                     "--rdzv-backend", backend, "--rdzv-endpoint", endpoint, "--rdzv-id", "x",
                     "--rdzv-conf", "join_timeout=2"), name="unreachable")
    code = exit_after_waiting(job, f"etcd at {endpoint}: connection refused; retrying", 2,
                              startup_seconds)
    assert code == 2, job.output[-3000:]
    errors = error_lines(job.output)
    assert len(errors) == 1, job.output[-3000:]
    assert errors[0].startswith(f"elastic-runner: error: cannot reach etcd at {endpoint} "
                                "(connection refused; tried for 2 s): is etcd running there "
                                "and started with --enable-v2?")
    assert "--rdzv-conf protocol=https,cacert=" in errors[0]
    assert "Traceback" not in job.output and "task digits" not in job.output


@pytest.mark.slow
@pytest.mark.parametrize("etcd_server", [{"enable_v2": False}], indirect=True)
def test_etcd_without_v2_api_is_named(launch, etcd_server, tmp_path):
    job = launch(cli("run", DIGITS, *SHORT, f"checkpoint.dir={tmp_path / 'ck'}",
                     "--rdzv-backend", "etcd-v2", "--rdzv-endpoint", etcd_server.endpoint,
                     "--rdzv-id", "x"), name="no-v2")
    assert job.wait(timeout=60) == 2, job.output[-3000:]
    errors = error_lines(job.output)
    assert len(errors) == 1, job.output[-3000:]
    assert re.fullmatch(
        rf"elastic-runner: error: etcd 3\.4\.\d+ at {etcd_server.endpoint} does not serve the "
        r"v2 API \(HTTP 404 on /v2/keys\), which torch's etcd rendezvous needs: start etcd with "
        r"--enable-v2 \(etcd 3\.4/3\.5; 3\.6 removed it\), or use --rdzv-backend c10d",
        errors[0]), errors[0]
    assert "Traceback" not in job.output
