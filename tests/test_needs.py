"""tests/needs.py: a missing dependency skips a test outside CI and fails it when ``CI`` is set;
the network-namespace probe; .ci/run sets ``CI`` and installs iproute2."""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Iterator
from typing import Any

import pytest

from . import needs
from .procs import REPO
from .slurm import SLURM_PACKAGES


@pytest.fixture
def fresh_netns_cache() -> Iterator[None]:
    """netns_available() is cached per session: probe afresh, and leave no patched result."""
    needs.netns_available.cache_clear()
    yield
    needs.netns_available.cache_clear()


@pytest.mark.parametrize("value", ["1", "true", "True", "yes", "anything"])
def test_in_ci_when_ci_is_set(monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    monkeypatch.setenv("CI", value)
    assert needs.in_ci()


@pytest.mark.parametrize("value", [None, "", "0", "false", "FALSE", "no", "off", " 0 "])
def test_not_in_ci_when_ci_is_unset_or_false(monkeypatch: pytest.MonkeyPatch,
                                              value: str | None) -> None:
    if value is None:
        monkeypatch.delenv("CI", raising=False)
    else:
        monkeypatch.setenv("CI", value)
    assert not needs.in_ci()


def test_require_fails_in_ci(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CI", "1")
    with pytest.raises(pytest.fail.Exception, match=r"^etcd missing in CI: install apt-get x$"):
        needs.require(False, "etcd", "apt-get x")


def test_require_skips_outside_ci_also_at_module_level(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CI", raising=False)
    with pytest.raises(pytest.skip.Exception, match=r"^etcd missing: install apt-get x") as info:
        needs.require(False, "etcd", "apt-get x")
    assert "CI" in str(info.value)  # the reason says that CI would fail
    # test modules call it before imports that need the dependency
    assert info.value.allow_module_level


@pytest.mark.parametrize("ci", ["1", "0"])
def test_require_passes_what_is_available(monkeypatch: pytest.MonkeyPatch, ci: str) -> None:
    monkeypatch.setenv("CI", ci)
    needs.require(True, "etcd", "apt-get x")
    assert needs.require_command("sh", "x") == shutil.which("sh")
    needs.require_modules("json", "pytest", install_hint="x")


def test_require_command_and_modules_name_what_is_missing(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CI", "true")
    with pytest.raises(pytest.fail.Exception, match=r"^no-such-tool-x \(not on PATH\) missing "
                                                    r"in CI: install the Debian package p "):
        needs.require_command("no-such-tool-x", needs.debian("p"))
    with pytest.raises(pytest.fail.Exception,
                       match=r"^no_such_mod_a and no_such_mod_b missing in CI: install hint$"):
        needs.require_modules("json", "no_such_mod_a", "no_such_mod_b", install_hint="hint")


def test_require_command_looks_first_in_the_given_directories(tmp_path: Any) -> None:
    tool = tmp_path / "sh"
    tool.write_text("#!/bin/sh\n")
    tool.chmod(0o755)
    assert needs.require_command("sh", "x", first_in=str(tmp_path)) == str(tool)
    assert needs.require_command("sh", "x", first_in=str(tmp_path / "none")) == shutil.which("sh")


def test_netns_unavailable_without_ip_or_root(monkeypatch: pytest.MonkeyPatch,
                                              fresh_netns_cache: None) -> None:
    monkeypatch.setattr(needs.shutil, "which", lambda name, **_: None)
    assert not needs.netns_available()
    needs.netns_available.cache_clear()
    monkeypatch.setattr(needs.shutil, "which", lambda name, **_: "/sbin/ip")
    monkeypatch.setattr(needs.os, "geteuid", lambda: 1000)
    assert not needs.netns_available()


def test_netns_probe_adds_and_deletes_one_namespace(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[list[str]] = []

    def fake_run(cmd: list[str], **_: Any) -> subprocess.CompletedProcess:
        calls.append(cmd)
        return subprocess.CompletedProcess(cmd, 0 if cmd[2] == "del" or ok_add else 1)

    monkeypatch.setattr(needs.subprocess, "run", fake_run)
    ok_add = True
    assert needs._probe_netns("/sbin/ip")
    (add, delete) = calls
    assert add[:3] == ["/sbin/ip", "netns", "add"] and delete == ["/sbin/ip", "netns", "del", add[3]]
    calls.clear()
    ok_add = False  # e.g. root without CAP_SYS_ADMIN: nothing to delete
    assert not needs._probe_netns("/sbin/ip") and len(calls) == 1


def test_netns_probe_on_this_machine_leaves_no_namespace(fresh_netns_cache: None) -> None:
    ip = shutil.which("ip")

    def namespaces() -> str:
        if ip is None:
            return ""
        return subprocess.run([ip, "netns", "list"], capture_output=True, text=True,
                              timeout=10).stdout

    before = namespaces()
    available = needs.netns_available()
    assert isinstance(available, bool) and needs.netns_available() is available  # cached
    assert namespaces() == before
    if ip is None or os.geteuid() != 0:
        assert not available


def test_require_netns_follows_the_probe(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(needs, "netns_available", lambda: False)
    monkeypatch.setenv("CI", "1")
    with pytest.raises(pytest.fail.Exception, match=r"^network namespaces .* missing in CI: "
                                                    r"install the Debian package iproute2"):
        needs.require_netns()
    monkeypatch.delenv("CI")
    with pytest.raises(pytest.skip.Exception):
        needs.require_netns()
    monkeypatch.setattr(needs, "netns_available", lambda: True)
    needs.require_netns()


def test_ci_run_sets_ci_and_installs_iproute2_and_slurm() -> None:
    assert '\nexport CI="${CI:-1}"\n' in (REPO / ".ci" / "run").read_text()
    assert "\nbash .ci/debian_packages\n" in (REPO / ".ci" / "run").read_text()
    script = (REPO / ".ci" / "debian_packages").read_text()
    for command in ("ip", "tc", "slurmctld", "slurmd", "sbatch", "munged"):
        assert f"command -v {command} " in script, command
    (install,) = [line for line in script.replace("\\\n", " ").splitlines()
                  if "apt-get install" in line]
    assert {"wordnet-base", "openssl", "iproute2", *SLURM_PACKAGES.split()} <= set(install.split())
