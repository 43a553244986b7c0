"""What the test tiers need from the machine, and what a test does when it is missing.

Outside CI a missing dependency (etcd, openssl, Prometheus/promtool, kubectl, the S3 server,
transformers, WordNet, network namespaces, ...) skips the test with the reason, which
``pytest -rs`` (the README's test command) lists. When the environment variable ``CI`` is set
(non-empty and not ``0``, ``false``, ``no`` or ``off``; ``.ci/run`` sets it) the same check fails
the test instead: CI installs every dependency, so a skip there would only hide a tier that
stopped running. Every dependency-based skip in tests/ goes through :func:`require` (or one of
the ``require_*`` helpers built on it), so the rule holds in one place.

The one exception is the ``gpu`` marker (``tests/test_gpu.py``): CI has no GPU, so those tests
skip without CUDA everywhere, CI included (docs/gpu.md).
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import uuid
from functools import cache
from typing import NoReturn

import pytest

# values of CI that mean "not CI" (any other non-empty value means CI)
NOT_CI = frozenset({"", "0", "false", "no", "off"})

# install hints, completing "<what> missing: install <hint>"
HF_EXTRA = "the hf extra: pip install -e '.[hf]'"
TEST_EXTRAS = "the test extras: pip install -e '.[test]'"
NETNS_TIMEOUT_S = 10


def debian(package: str) -> str:
    """Install hint for a Debian package that ``.ci/run`` installs."""
    return f"the Debian package {package} (apt-get install {package}; .ci/run installs it)"


def in_ci() -> bool:
    """Whether this run is CI: ``CI`` is set to something other than an empty or false value
    (GitHub Actions and most CI services set ``CI=true``; ``.ci/run`` sets ``CI=1``)."""
    return os.environ.get("CI", "").strip().lower() not in NOT_CI


def missing(what: str, install_hint: str) -> NoReturn:
    """Stop the test because ``what`` is missing: fail in CI, skip elsewhere.

    The skip is allowed at module level, so a test module may call this (through
    :func:`require`) before imports that need the dependency. In CI a module-level call is a
    collection error, which fails the run as well."""
    __tracebackhide__ = True  # -rs and failures name the caller's line
    if in_ci():
        pytest.fail(f"{what} missing in CI: install {install_hint}", pytrace=False)
    pytest.skip(f"{what} missing: install {install_hint} (a failure when CI is set)",
                allow_module_level=True)


def require(available: bool, what: str, install_hint: str) -> None:
    """Go on if ``available``; else skip the test outside CI and fail it in CI (see
    :func:`missing`). ``what`` names the dependency, ``install_hint`` says how to get it."""
    __tracebackhide__ = True  # -rs and failures name the caller's line
    if not available:
        missing(what, install_hint)


def require_command(name: str, install_hint: str, *, first_in: str | None = None) -> str:
    """The path of the executable ``name``, looked up in the ``os.pathsep``-separated
    directories ``first_in`` first (when given), then on PATH; :func:`missing` if neither
    has it."""
    __tracebackhide__ = True  # -rs and failures name the caller's line
    found = (shutil.which(name, path=first_in) if first_in else None) or shutil.which(name)
    if found is None:
        missing(f"{name} (not on PATH)", install_hint)
    return found


def require_modules(*modules: str, install_hint: str) -> None:
    """Require the Python modules ``modules`` to be installed (found, not imported: the S3
    server runs moto in a subprocess, and a broken install should fail at its import)."""
    __tracebackhide__ = True  # -rs and failures name the caller's line
    absent = [m for m in modules if importlib.util.find_spec(m) is None]
    if absent:
        missing(" and ".join(absent), install_hint)


def _probe_netns(ip: str) -> bool:
    """Whether ``ip netns add`` makes a namespace here: add one with a unique name, then delete
    it. Fails without root or without CAP_SYS_ADMIN (an unprivileged container)."""
    name = f"er-probe-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    try:
        added = subprocess.run([ip, "netns", "add", name], capture_output=True,
                               timeout=NETNS_TIMEOUT_S, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return False
    if added.returncode != 0:
        return False
    try:
        deleted = subprocess.run([ip, "netns", "del", name], capture_output=True,
                                 timeout=NETNS_TIMEOUT_S, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return deleted.returncode == 0


@cache
def netns_available() -> bool:
    """Whether network namespaces can be made on this machine (for the multi-node tests that
    put each node in its own namespace): ``ip`` (Debian: iproute2) on PATH, running as root, and
    a probe namespace added and deleted. Probed once per test session (cached)."""
    ip = shutil.which("ip")
    if ip is None or not hasattr(os, "geteuid") or os.geteuid() != 0:
        return False
    return _probe_netns(ip)


def require_netns() -> None:
    """Require network namespaces (:func:`netns_available`): skip the test without them
    outside CI, fail it in CI."""
    __tracebackhide__ = True  # -rs and failures name the caller's line
    require(netns_available(), "network namespaces (`ip netns add` as root)",
            debian("iproute2") + " and run as root with CAP_SYS_ADMIN")
