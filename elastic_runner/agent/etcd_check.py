"""Pre-flight check of the etcd server behind ``--rdzv-backend etcd-v2`` / ``etcd``.

torch's two etcd rendezvous backends speak etcd's **v2** HTTP API (through python-etcd). When the
server is down, misaddressed, speaks TLS, or runs without ``--enable-v2`` (etcd 3.4/3.5 serve only
the v3 API by default; 3.6 removed v2), torch fails with a deep traceback ending in
``RendezvousConnectionError`` or ``EtcdException: Could not get the list of servers``.
:func:`check_etcd` asks the server first, over plain HTTP(S) with the same TLS options, and raises
:class:`EtcdCheckError` whose message is one line naming the endpoint and the likely cause.

The two backends also spell the same rendezvous options differently (``etcd-v2``: ``ca_cert``,
``ssl_cert``, ``ssl_cert_key``, ``join_timeout``; legacy ``etcd``: ``cacert``, ``cert``, ``key``,
``timeout``) and silently ignore the other spelling; :func:`with_aliases` adds the chosen
backend's spelling of an option given only in the other one, so that either spelling works
(the spellings are torch internals, kept and tested in
:mod:`elastic_runner.compat.rendezvous`, fix 6).

Units: all times are seconds (``float``).
"""

from __future__ import annotations

import contextlib
import http.client
import json
import logging
import socket
import ssl
import time
import urllib.error
import urllib.request
from collections.abc import Mapping

from torch.distributed.elastic.rendezvous.utils import parse_rendezvous_endpoint

from ..compat.rendezvous import ETCD_OPTION_SPELLINGS

log = logging.getLogger(__name__)

DEFAULT_PORT = 2379
DEFAULT_WAIT_S = 30.0  # how long to wait for an unreachable etcd when no join_timeout is given
_ATTEMPT_TIMEOUT_S = 5.0  # connect + read timeout of one HTTP request
_RETRY_S = 0.5

# (etcd-v2 spelling, legacy etcd spelling) of the same rendezvous option
ALIASES = ETCD_OPTION_SPELLINGS

_TLS_HINT = "--rdzv-conf protocol=https,cacert=CA.pem[,cert=CLIENT.pem,key=CLIENT.key]"


class EtcdCheckError(Exception):
    """etcd cannot serve the rendezvous; ``str(err)`` is one line for the user."""


def parse_conf(text: str | None) -> dict[str, str]:
    """``"k1=v1,k2=v2"`` (torchrun's ``--rdzv-conf``) as an ordered dict; no validation."""
    conf: dict[str, str] = {}
    for item in (text or "").split(","):
        key, _, value = item.partition("=")
        if key.strip():
            conf[key.strip()] = value.strip()
    return conf


def with_aliases(conf: Mapping[str, str], backend: str) -> dict[str, str]:
    """``conf`` plus ``backend``'s own spelling of each option given only in the other backend's
    spelling (appended; an option given in both spellings is left alone)."""
    out = dict(conf)
    for v2, legacy in ALIASES:
        own, other = (v2, legacy) if backend == "etcd-v2" else (legacy, v2)
        if other in out and own not in out:
            out[own] = out[other]
    return out


def wait_seconds(conf: Mapping[str, str], backend: str = "etcd-v2") -> float:
    """How long :func:`check_etcd` waits for an unreachable server: the rendezvous join timeout
    that ``backend`` reads (``join_timeout``; legacy ``etcd``: ``timeout``) when given, else
    :data:`DEFAULT_WAIT_S`."""
    key = "join_timeout" if backend == "etcd-v2" else "timeout"
    value = with_aliases(conf, backend).get(key)
    if not value:
        return DEFAULT_WAIT_S
    try:
        return max(float(value), 0.0)
    except ValueError:
        raise EtcdCheckError(f"--rdzv-conf {key}={value}: expected seconds, e.g. 600") from None


def check_etcd(endpoint: str | None, conf: Mapping[str, str],
               wait_s: float = DEFAULT_WAIT_S, backend: str = "etcd-v2") -> str:
    """Check that etcd at ``endpoint`` (``HOST[:PORT]``, port 2379 by default) answers and serves
    the v2 API, with the ``protocol`` and TLS files that ``backend`` will read from ``conf``
    (either spelling, see :func:`with_aliases`).

    Connection failures (refused, timed out, unresolvable host) are retried until ``wait_s``
    seconds have passed (etcd may start together with the job); every other failure is raised at
    once. Returns the server version (``"3.4.23"``).

    Raises:
        EtcdCheckError: the endpoint or options are invalid, the server cannot be reached within
            ``wait_s``, it is not etcd, the TLS set-up does not match, or the v2 API is disabled.
    """
    try:
        host, port = parse_rendezvous_endpoint(endpoint, default_port=DEFAULT_PORT)
    except ValueError as e:
        raise EtcdCheckError(f"invalid --rdzv-endpoint {endpoint!r}: {e} "
                             "(expected HOST:PORT of the etcd client port, e.g. etcd:2379)"
                             ) from None
    where = f"{host}:{port}"
    protocol = conf.get("protocol", "http").strip().lower()
    if protocol not in ("http", "https"):
        raise EtcdCheckError(f"--rdzv-conf protocol={protocol}: expected http or https")
    context = _tls_context(conf, backend) if protocol == "https" else None
    base = f"{protocol}://{host if ':' not in host else f'[{host}]'}:{port}"
    status, body = _first_answer(base, context, host, port, protocol, wait_s)
    if status == 400 and protocol == "http" and _speaks_tls(host, port):
        raise EtcdCheckError(f"etcd at {where} expects HTTPS: add {_TLS_HINT}")
    version = _etcd_version(status, body)
    if version is None:
        raise EtcdCheckError(
            f"{base} is not an etcd server (HTTP {status} on /version): check --rdzv-endpoint "
            "(the etcd client port, usually 2379)")
    _check_v2(base, context, where, version)
    return version


def _first_answer(base: str, context: ssl.SSLContext | None, host: str, port: int,
                  protocol: str, wait_s: float) -> tuple[int, bytes]:
    """``/version``'s status and body, retrying connection failures for ``wait_s`` seconds.

    Raises:
        EtcdCheckError: no answer within ``wait_s``, or a failure not worth retrying.
    """
    where = f"{host}:{port}"
    started = time.monotonic()
    deadline = started + wait_s
    while True:
        timeout = min(_ATTEMPT_TIMEOUT_S, max(deadline - time.monotonic(), 1.0))
        try:
            return _get(base + "/version", context, timeout)
        except EtcdCheckError:
            if protocol == "http" and _speaks_tls(host, port):
                raise EtcdCheckError(f"etcd at {where} expects HTTPS: add {_TLS_HINT}") from None
            raise
        except _Unreachable as e:
            left = deadline - time.monotonic()
            if left <= 0:
                raise EtcdCheckError(
                    f"cannot reach etcd at {where} ({e}; tried for "
                    f"{time.monotonic() - started:.0f} s): is etcd running there and started "
                    f"with --enable-v2? check --rdzv-endpoint and the TLS options ({_TLS_HINT})"
                ) from None
            if time.monotonic() - started < _RETRY_S:  # first failure
                log.warning("etcd at %s: %s; retrying for up to %.0f s", where, e, wait_s)
            time.sleep(min(_RETRY_S, left))


def _check_v2(base: str, context: ssl.SSLContext | None, where: str, version: str) -> None:
    """That etcd ``version`` at ``base`` serves the v2 API on its client port.

    Raises:
        EtcdCheckError: it stopped answering, it is a peer port, or v2 is off or refused.
    """
    try:
        status, body = _get(base + "/v2/keys/", context, _ATTEMPT_TIMEOUT_S)
    except _Unreachable as e:
        raise EtcdCheckError(f"etcd at {where} stopped answering ({e})") from None
    if status == 404 and _status(base + "/health", context) == 404:  # no /health: peer port
        raise EtcdCheckError(
            f"{where} is an etcd peer port, not its client port: point --rdzv-endpoint at the "
            "client port (--listen-client-urls, usually 2379)")
    if status == 404:
        raise EtcdCheckError(
            f"etcd {version} at {where} does not serve the v2 API (HTTP 404 on /v2/keys), which "
            "torch's etcd rendezvous needs: start etcd with --enable-v2 (etcd 3.4/3.5; 3.6 "
            "removed it), or use --rdzv-backend c10d")
    if status != 200:
        first = body.decode(errors="replace").strip().splitlines()[:1]
        raise EtcdCheckError(f"etcd {version} at {where} answered HTTP {status} on /v2/keys"
                             f"{': ' + first[0][:200] if first else ''}")


class _Unreachable(Exception):
    """No HTTP answer at all (worth retrying)."""


# like python-etcd (urllib3), ignore the http(s)_proxy environment variables
_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def _status(url: str, context: ssl.SSLContext | None) -> int | None:
    try:
        return _get(url, context, _ATTEMPT_TIMEOUT_S)[0]
    except (_Unreachable, EtcdCheckError):
        return None


def _speaks_tls(host: str, port: int) -> bool:
    """Whether ``host:port`` answers a TLS handshake (certificates not checked)."""
    context = ssl.create_default_context()
    context.check_hostname, context.verify_mode = False, ssl.CERT_NONE
    try:
        with socket.create_connection((host, port), timeout=_ATTEMPT_TIMEOUT_S) as sock, \
                context.wrap_socket(sock, server_hostname=host):
            return True
    except ssl.SSLError as e:  # an alert (e.g. certificate required) is still TLS
        return "ALERT" in str(e.reason or "")
    except OSError:
        return False


def _tls_context(conf: Mapping[str, str], backend: str) -> ssl.SSLContext:
    """The CA and client certificate that ``backend`` reads from ``conf``."""
    conf = with_aliases(conf, backend)
    names = ALIASES[:3] if backend == "etcd-v2" else [(b, a) for a, b in ALIASES[:3]]
    ca, cert, key = (conf.get(own) for own, _ in names)
    try:
        context = ssl.create_default_context(cafile=ca or None)
        if cert:
            context.load_cert_chain(cert, key or None)
    except (OSError, ssl.SSLError) as e:
        raise EtcdCheckError(f"cannot load the TLS files given with --rdzv-conf "
                             f"(cacert={ca}, cert={cert}, key={key}): {e}") from None
    return context


def _get(url: str, context: ssl.SSLContext | None, timeout: float) -> tuple[int, bytes]:
    """HTTP GET: (status, body) for any HTTP answer; raises :class:`_Unreachable` without one
    and :class:`EtcdCheckError` on TLS errors or a non-HTTP answer."""
    base = "/".join(url.split("/", 3)[:3])  # scheme://host:port
    where = base.split("://", 1)[1]
    try:
        with _open(url, timeout, context) as r:
            return r.status, r.read(65536)
    except urllib.error.HTTPError as e:
        with contextlib.suppress(OSError):
            return e.code, e.read(65536)
        return e.code, b""
    except http.client.HTTPException as e:  # something answered, but not in HTTP
        raise EtcdCheckError(f"{base} is not an etcd server (no HTTP answer: "
                             f"{type(e).__name__}): check --rdzv-endpoint (the etcd client "
                             "port, usually 2379)") from None
    except (urllib.error.URLError, OSError) as e:
        reason = e.reason if isinstance(e, urllib.error.URLError) else e
        if isinstance(reason, ssl.SSLCertVerificationError):
            raise EtcdCheckError(
                f"TLS certificate of etcd at {where} not trusted "
                f"({reason.verify_message or reason}): pass its CA with --rdzv-conf "
                "cacert=CA.pem") from None
        if isinstance(reason, ssl.SSLError):
            raise EtcdCheckError(
                f"TLS handshake with etcd at {where} failed ({reason.reason or reason}): "
                "does it serve plain HTTP (drop protocol=https), or require a client "
                f"certificate (cert=...,key=...)? check {_TLS_HINT}") from None
        raise _Unreachable(_describe(reason, timeout)) from None


def _open(url: str, timeout: float, context: ssl.SSLContext | None):
    if context is None:
        return _OPENER.open(url, timeout=timeout)
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}),
                                         urllib.request.HTTPSHandler(context=context))
    return opener.open(url, timeout=timeout)


def _describe(reason: object, timeout: float) -> str:
    if isinstance(reason, ConnectionRefusedError):
        return "connection refused"
    if isinstance(reason, socket.gaierror):
        return f"cannot resolve the host name: {reason.strerror}"
    if isinstance(reason, (TimeoutError, socket.timeout)):
        return f"no answer within {timeout:.0f} s"
    if isinstance(reason, OSError) and reason.strerror:
        return reason.strerror.lower()
    return str(reason)


def _etcd_version(status: int, body: bytes) -> str | None:
    if status != 200:
        return None
    try:
        version = json.loads(body).get("etcdserver")
    except (ValueError, AttributeError):
        return None
    return str(version) if version else None
