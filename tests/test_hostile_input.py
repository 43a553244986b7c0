"""Hostile input: checkpoints and configs crafted to escape, execute, mislead or exhaust.

Each case must end in a clear error (exit code 2 through the CLI) that names what is wrong,
fast and in bounded memory, with nothing outside a checkpoint directory read and nothing in it
overwritten. The checkpoints are real ones (``write_checkpoint``, or ``elastic-runner train``),
then tampered with from outside as an attacker would.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import sys
import time
import tracemalloc
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch

from elastic_runner.checkpoint import storage as ckpt
from elastic_runner.config import ConfigError, load_config
from elastic_runner.config_yaml import MAX_ALIAS_NODES, MAX_FILE_BYTES, MAX_STRING_CHARS
from elastic_runner.tasks.export import resolve_checkpoint

from .procs import CONFIGS, run_cli

DIGITS = str(CONFIGS / "digits.yaml")
QUIET = ["logging.tensorboard_dir=null", "logging.progress_bar=false"]


# ---------------------------------------------------------------- helpers


def save(directory: Path, step: int, state: dict[str, Any] | None = None) -> Path:
    (path,) = ckpt.write_checkpoint(directory, f"step-{step:08d}",
                                    state or {"model": {"w": torch.full((4, 3), float(step))}},
                                    {"step": step, "epoch": 0, "world_size": 1})
    return Path(path)


def edit_manifest(step_dir: Path, change: Callable[[dict[str, Any]], Any]) -> None:
    manifest = json.loads((step_dir / ckpt.MANIFEST).read_text())
    changed = change(manifest)
    (step_dir / ckpt.MANIFEST).write_text(json.dumps(manifest if changed is None else changed))


def snapshot(root: Path) -> dict[str, tuple[Any, ...]]:
    """Every entry under ``root``: content hash, inode and mtime (a rewrite with the same bytes
    changes them too), or a link's target."""
    out: dict[str, tuple[Any, ...]] = {}
    for p in sorted(root.rglob("*")):
        st = p.lstat()
        if p.is_symlink():
            out[str(p.relative_to(root))] = ("link", os.readlink(p))
        elif p.is_file():
            out[str(p.relative_to(root))] = (hashlib.sha256(p.read_bytes()).hexdigest(),
                                             st.st_ino, st.st_mtime_ns)
        else:
            out[str(p.relative_to(root))] = ("dir", st.st_ino)
    return out


class _OpenLog:
    """Real paths opened while recording, from one ``open`` audit hook per session (a hook
    cannot be removed: it is installed once and records only inside :func:`opened_files`)."""

    hooked = False
    paths: list[str] | None = None

    @staticmethod
    def hook(event: str, args: tuple[Any, ...]) -> None:
        if _OpenLog.paths is not None and event == "open" and isinstance(args[0], str | bytes):
            _OpenLog.paths.append(os.path.realpath(os.fsdecode(args[0])))


@contextmanager
def opened_files() -> Iterator[list[str]]:
    """The real paths of every file this process opens inside the block (fsspec, torch.load
    and json all open through ``open``, which raises the audit event)."""
    if not _OpenLog.hooked:
        sys.addaudithook(_OpenLog.hook)
        _OpenLog.hooked = True
    _OpenLog.paths = []
    try:
        yield _OpenLog.paths
    finally:
        _OpenLog.paths = None


def assert_bad_input(res: Any, *needles: str, one_line: bool = True) -> str:
    """Exit 2, no traceback, a short stderr naming every needle; returns stderr."""
    err = res.stderr
    assert res.returncode == 2, (res.returncode, res.stdout[-2000:], err[-2000:])
    assert "Traceback" not in res.stdout + err, err[-3000:]
    for needle in needles:
        assert needle in err, (needle, err[-2000:])
    if one_line:
        assert len(err.strip().splitlines()) == 1, err
        assert len(err) < 600, err[:600]
    return err


# ---------------------------------------------------------------- 1. manifest escaping the dir


@pytest.fixture
def hostile_dir(tmp_path: Path) -> tuple[Path, Path, Path]:
    """(checkpoint dir, its newest checkpoint, a file outside): step 1 is valid, step 2 will be
    tampered with; the outside file is a byte copy of step 2's state.pt, so a manifest entry
    pointing at it matches in size and sha256."""
    ck = tmp_path / "ck"
    save(ck, 1)
    newest = save(ck, 2)
    outside = tmp_path / "outside" / "outside.pt"
    outside.parent.mkdir()
    shutil.copyfile(newest / ckpt.STATE_FILE, outside)
    return ck, newest, outside


def escaping_names(outside: Path) -> list[str]:
    return ["../../outside/outside.pt", str(outside), "../step-00000001/state.pt",
            "state.pt/../../../outside/outside.pt"]


def assert_refused_without_reading_outside(ck: Path, newest: Path, outside: Path,
                                           *needles: str) -> None:
    with opened_files() as opened:
        info = ckpt.inspect(newest, verify=True)
        found = ckpt.latest_valid(ck)
        try:
            resolve_checkpoint(newest)  # what evaluate/export/generate do with a path
            error = ""
        except ckpt.CheckpointError as e:
            error = str(e)
    outside_dir = str(outside.parent.resolve())
    assert not [p for p in opened if p.startswith(outside_dir)], "read outside the checkpoint"
    assert not info.valid and error == f"checkpoint {newest} is not valid: {info.reason}", error
    for needle in needles:
        assert needle in info.reason, (needle, info.reason)
    assert found is not None and found.step == 1  # resume skips it for the older valid one


@pytest.mark.parametrize("beside_state", [False, True], ids=["instead", "beside"])
def test_manifest_names_outside_the_directory_are_refused(hostile_dir, beside_state, caplog):
    ck, newest, outside = hostile_dir
    desc = {"bytes": outside.stat().st_size,
            "sha256": hashlib.sha256(outside.read_bytes()).hexdigest()}
    real = json.loads((newest / ckpt.MANIFEST).read_text())["files"]
    for name in escaping_names(outside):
        def point_outside(m: dict[str, Any], name: str = name) -> None:
            m["files"] = {**(real if beside_state else {}), name: desc}

        edit_manifest(newest, point_outside)
        with caplog.at_level("WARNING"):
            assert_refused_without_reading_outside(
                ck, newest, outside, f"manifest names file {name!r}",
                "outside the checkpoint directory")
        assert f"skipping checkpoint {newest}" in caplog.text and repr(name) in caplog.text


@pytest.mark.parametrize("files, reason", [
    ({}, "manifest does not list state.pt"),
    ({"notes.txt": None}, "manifest names file 'notes.txt', not one of this format (state.pt)"),
    ({"state.pt": {"sha256": "0" * 64}}, "manifest entry of state.pt lacks an int 'bytes'"),
])
def test_manifest_lists_exactly_the_state_file(hostile_dir, files, reason):
    """A manifest that leaves state.pt out would let an unverified file load; one naming other
    files (even plain names present in the directory) is not of this format."""
    ck, newest, outside = hostile_dir
    (newest / "notes.txt").write_text("x")
    real = json.loads((newest / ckpt.MANIFEST).read_text())["files"]["state.pt"]
    files = {k: (real if v is None else v) for k, v in files.items()}
    edit_manifest(newest, lambda m: m.update(files=files))
    assert_refused_without_reading_outside(ck, newest, outside, reason)


@pytest.mark.parametrize("linked", [ckpt.STATE_FILE, ckpt.MANIFEST])
def test_symlinked_file_is_not_followed(hostile_dir, linked):
    """state.pt (or the manifest) replaced by a link to an identical file elsewhere: its size
    and sha256 would verify, but the link is refused, not followed."""
    ck, newest, outside = hostile_dir
    target = outside.parent / linked
    os.replace(newest / linked, target)
    (newest / linked).symlink_to(target)
    assert_refused_without_reading_outside(ck, newest, outside,
                                           f"{linked!r} is a symbolic link")


@pytest.mark.parametrize("change, reason", [
    (lambda m: [m], "manifest is a JSON list, not an object"),
    (lambda m: m.update(files=["state.pt"]), "manifest has no 'files' object"),
    (lambda m: m.update(step="2"), "manifest field 'step' has the wrong type"),
    (lambda m: m.update(time="yesterday"), "manifest field 'time' has the wrong type"),
    (lambda m: m.update(fence="x"), "manifest field 'fence' has the wrong type"),
    (lambda m: m.update(format_version="9" * 5000), "format version 9999999999"),
    (lambda m: m.update(pad="x" * (2 << 20)), "bytes, more than a manifest's 1 MiB"),
], ids=["list", "files", "step", "time", "fence", "version", "huge"])
def test_malformed_manifest_fields_are_invalid_not_a_crash(hostile_dir, change, reason):
    ck, newest, outside = hostile_dir
    edit_manifest(newest, change)
    assert_refused_without_reading_outside(ck, newest, outside, reason)
    assert len(ckpt.inspect(newest).reason) < 200


def test_cli_refuses_an_escaping_manifest(hostile_dir):
    ck, newest, outside = hostile_dir
    bad = "../../outside/outside.pt"
    edit_manifest(newest, lambda m: m["files"].update({bad: m["files"]["state.pt"]}))
    before = snapshot(ck.parent)
    res = run_cli("evaluate", DIGITS, "--checkpoint", str(newest), timeout=120)
    assert_bad_input(res, f"checkpoint {newest} is not valid", f"manifest names file {bad!r}")
    assert snapshot(ck.parent) == before


# ---------------------------------------------------------------- 2. a code-running pickle


class RunsCode:
    """Unpickling this calls ``open(marker, "w")``: arbitrary code, here a visible side effect."""

    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self) -> tuple[Any, ...]:
        return (open, (self.marker, "w"))


def test_cli_refuses_a_pickle_that_weights_only_rejects(tmp_path):
    """A committed checkpoint (manifest matches, sha256 verifies) whose state.pt runs code when
    unpickled: export refuses it on one line naming the refused global, and the code never
    runs (evaluate and resume load through the same ``load_state``)."""
    marker = tmp_path / "pwned"
    ck = tmp_path / "ck"
    evil = save(ck, 1, {"model": RunsCode(marker), "train_state": {"step": 1}})
    assert ckpt.inspect(evil, verify=True).valid
    with pytest.raises(ckpt.CheckpointError, match="io.open"):
        ckpt.load_state(evil)
    assert not marker.exists()
    before = snapshot(ck)
    out = tmp_path / "export"
    res = run_cli("export", str(evil), str(out), timeout=120)
    assert_bad_input(res, f"checkpoint {evil}: cannot load state.pt", "io.open")
    assert not marker.exists() and not out.exists()
    assert snapshot(ck) == before


# ---------------------------------------------------------------- 3. tensors of another model


MISMATCH = ["classifier.2.bias: checkpoint (64,) vs model (128,)",
            "classifier.2.weight: checkpoint (64, 1024) vs model (128, 1024)",
            "classifier.4.weight: checkpoint (10, 64) vs model (10, 128)"]


@pytest.fixture(scope="module")
def narrow_checkpoint(tmp_path_factory) -> Path:
    """A real checkpoint dir of the digits CNN with a hidden layer of 64 (the config has 128),
    written by one `elastic-runner train` step."""
    ck = tmp_path_factory.mktemp("narrow") / "ck"
    res = run_cli("train", DIGITS, "model.hidden=64", "training.max_steps=1",
                  f"checkpoint.dir={ck}", *QUIET, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    return ck


def test_tensors_of_another_model_shape_are_named_and_nothing_is_written(narrow_checkpoint,
                                                                         tmp_path):
    ck = narrow_checkpoint
    (step,) = [c for c in ckpt.list_checkpoints(ck) if c.valid]
    before = snapshot(ck)
    # resume: refused before any step, no checkpoint written (the run claims a fencing token)
    res = run_cli("train", DIGITS, f"checkpoint.dir={ck}", "training.max_steps=2", *QUIET,
                  timeout=180)
    assert_bad_input(res, f"checkpoint {step.path} does not match this model", *MISMATCH,
                     one_line=False)  # the names are listed on the lines that follow
    after = {k: v for k, v in snapshot(ck).items() if not k.startswith("fence")}
    assert after == {k: v for k, v in before.items() if not k.startswith("fence")}

    # export (like evaluate, through model_from_checkpoint) trusts the config stored in the
    # checkpoint: make it claim hidden 128 over the same tensors and re-commit, so the manifest
    # (sha256) is right and only the shapes lie
    state = ckpt.load_state(step.path)
    state["config"]["model"]["hidden"] = 128
    lying = save(tmp_path / "lying", step.step, state)
    assert ckpt.inspect(lying, verify=True).valid
    before = snapshot(lying.parent)
    out = tmp_path / "export"
    res = run_cli("export", str(lying), str(out), timeout=120)
    assert_bad_input(res, f"checkpoint {lying} does not match this model", *MISMATCH,
                     one_line=False)
    assert not out.exists() and snapshot(lying.parent) == before


# ---------------------------------------------------------------- 4. huge strings


@contextmanager
def bounded(seconds: float, megabytes: float | None = None) -> Iterator[None]:
    """Fail unless the block takes under ``seconds`` and, when given, allocates under
    ``megabytes`` at peak (Python allocations, tracemalloc; it slows pure-Python parsing
    several times, so the bounds are generous: what they catch takes minutes or GiB)."""
    if megabytes is not None:
        tracemalloc.start()
    start = time.perf_counter()
    try:
        yield
    finally:
        elapsed = time.perf_counter() - start
        peak = tracemalloc.get_traced_memory()[1] / 2**20 if megabytes is not None else 0
        tracemalloc.stop()
    assert elapsed < seconds, f"took {elapsed:.1f} s"
    assert megabytes is None or peak < megabytes, f"allocated {peak:.0f} MiB at peak"


def refused(*args: Any) -> str:
    """The message of the ConfigError that ``load_config(*args)`` raises: short, one line
    (not counting the config file's path, which is as long as pytest's temp directory)."""
    with pytest.raises(ConfigError) as e:
        load_config(*args)
    msg = str(e.value)
    assert len(msg.replace(str(args[0]), "CONFIG")) < 300 and "\n" not in msg, msg[:1000]
    return msg


TEN_MB = 10 << 20


def test_ten_megabyte_override_is_refused_fast_naming_the_key():
    with bounded(seconds=5, megabytes=60):  # the string itself is 10 MiB (x2 in the item)
        msg = refused(DIGITS, ["task=" + "t" * TEN_MB])
    assert msg.startswith(f"task: override value of {TEN_MB} characters, more than the limit "
                          f"of {MAX_STRING_CHARS}: 'tttt")


def test_ten_megabyte_config_file_is_refused_unread(tmp_path):
    big = tmp_path / "big.yaml"
    big.write_text("task: digits\nmetrics:\n  job: " + "j" * TEN_MB + "\n")
    with bounded(seconds=5, megabytes=8):
        msg = refused(big)
    assert msg == f"{big}: config file larger than the limit of {MAX_FILE_BYTES} bytes (1 MiB)"


@pytest.mark.parametrize("text, where", [
    ("task: digits\nmetrics:\n  job: {s}\n", "metrics.job: value"),
    ("task: digits\nfaults:\n  inject:\n    - kind: {s}\n", "faults.inject[0].kind: value"),
    ("task: digits\nmodel:\n  ? {s}\n  : 1\n", "model: key"),  # explicit: any length
])
def test_long_string_in_a_file_names_its_key_path(tmp_path, text, where):
    path = tmp_path / "long.yaml"
    path.write_text(text.format(s="s" * 100_000))
    with bounded(seconds=5):
        msg = refused(path)
    assert msg == (f"{where} of 100000 characters, more than the limit of {MAX_STRING_CHARS}: "
                   f"{'s' * 40!r}...")


def test_cli_long_override_and_huge_file_exit_2_on_one_line(tmp_path):
    # one argument may hold at most 128 KiB (Linux MAX_ARG_STRLEN): 100 000 characters
    res = run_cli("validate", DIGITS, "metrics.job=" + "j" * 100_000, timeout=60)
    assert_bad_input(res, "metrics.job: override value of 100000 characters",
                     f"limit of {MAX_STRING_CHARS}")
    big = tmp_path / "big.yaml"
    big.write_text("task: digits\nmetrics:\n  job: " + "j" * TEN_MB + "\n")
    res = run_cli("train", str(big), timeout=60)
    assert_bad_input(res, f"{big}: config file larger than the limit of {MAX_FILE_BYTES} bytes",
                     one_line=False)  # train logs through its handler: check the error line
    assert "jjjj" not in res.stderr and len(res.stderr) < 1000


# ---------------------------------------------------------------- 5. YAML bombs


def laughs(levels: int = 9, key: str = "seed") -> str:
    """The "billion laughs": 10 strings, each level 10 aliases of the one before (10**9
    strings at 9 levels) under ``key``, which echoes its value in a type error."""
    lines = ["task: digits", "lol:", '  a0: &a0 ["lol", "lol", "lol", "lol", "lol", "lol", '
             '"lol", "lol", "lol", "lol"]']
    for i in range(1, levels):
        lines.append(f"  a{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * 10) + "]")
    return "\n".join([*lines, f"{key}: *a{levels - 1}"]) + "\n"


def test_billion_laughs_is_refused_at_its_line(tmp_path):
    path = tmp_path / "laughs.yaml"
    path.write_text(laughs())
    with bounded(seconds=5, megabytes=10):
        msg = refused(path)
    # a0 has 11 nodes, a1 adds 10 x 11, a2 10 x 111, a3 10 x 1111: a3 (line 6) crosses 10000
    assert MAX_ALIAS_NODES == 10_000
    assert re.fullmatch(rf"{re.escape(str(path))}: invalid YAML at line 6, column \d+: aliases "
                        r"expand to more than 10000 nodes \(an alias bomb\?\); write the values "
                        r"out", msg), msg


def test_billion_laughs_in_an_override_is_refused():
    bomb = ("{a0: &a0 [x, x, x, x, x, x, x, x, x, x], "
            + ", ".join(f"a{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * 10) + "]"
                        for i in range(1, 9)) + "}")
    with bounded(seconds=5, megabytes=10):
        msg = refused(DIGITS, [f"seed={bomb}"])
    assert msg == (f"override {'seed=' + bomb[:75]!r}...: invalid value at line 1, column 206: "
                   "aliases expand to more than 10000 nodes (an alias bomb?); write the values "
                   "out")  # column 206: a3's 8th alias, where 110 + 1110 + 8 x 1111 > 10000


def test_anchors_within_the_bound_still_work(tmp_path):
    path = tmp_path / "anchors.yaml"
    path.write_text("task: digits\noptimizer: &opt\n  lr: 0.01\nschedule:\n  name: constant\n"
                    "faults:\n  inject:\n    - &f {kind: nan, step: 3}\n    - *f\n")
    cfg = load_config(path)
    assert cfg.optimizer.lr == 0.01 and [f.step for f in cfg.faults.inject] == [3, 3]


@pytest.mark.parametrize("text, problem", [
    ("task: digits\nseed: &a [*a]\n", "line 2, column 11: alias *a inside its own anchor"),
    ("task: digits\nmodel: " + "[" * 5000 + "]" * 5000 + "\n",
     "line 2, column 39: nested deeper than 32 levels"),
    ("task: digits\nseed: " + "9" * 100_000 + "\n",
     "line 2, column 7: cannot convert '9999999999999999999999999999999999999999'...: "
     "'Exceeds the limit (4300 digits)"),
    ("task: digits\nseed: 2001-13-45\n",
     "line 2, column 7: cannot convert '2001-13-45': 'month must be in 1..12'"),
], ids=["recursive", "deep", "bigint", "date"])
def test_other_yaml_blowups_are_config_errors(tmp_path, text, problem):
    path = tmp_path / "hostile.yaml"
    path.write_text(text)
    with bounded(seconds=5):
        msg = refused(path)
    assert msg.startswith(f"{path}: invalid YAML at {problem}"), msg


def test_deep_override_key_is_refused():
    """``a.a.a...=1`` nests a section per dot: refused at the bound, not by a RecursionError."""
    msg = refused(DIGITS, ["a." * 5000 + "b=1"])
    assert msg == ".".join(["a"] * 32) + ": nested deeper than 32 levels"


def test_cli_refuses_a_bomb_fast_on_one_line(tmp_path):
    path = tmp_path / "laughs.yaml"
    path.write_text(laughs())
    start = time.monotonic()
    res = run_cli("run", str(path), timeout=60)  # refused before the agent starts any worker
    assert_bad_input(res, f"{path}: invalid YAML at line 6", "more than 10000 nodes")
    assert time.monotonic() - start < 30  # the CLI's start-up; the refusal itself takes ms
