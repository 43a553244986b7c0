"""Command-line papercuts: options and overrides in any order, ``-v`` after the subcommand, and
config mistakes that end with exit code 2 and one line on stderr (no traceback)."""

from __future__ import annotations

import os
import subprocess

import pytest

from elastic_runner.agent.launch import torchrun_argv
from elastic_runner.cli import _overrides, build_parser, main
from elastic_runner.config_base import ConfigError

from .procs import CONFIGS, REPO, cli
from .test_config import user_task

DIGITS = str(CONFIGS / "digits.yaml")


def parse(*argv: str):
    return build_parser().parse_args(list(argv))


def test_run_takes_options_between_and_after_overrides():
    """`run configs/digits.yaml --nproc-per-node 2 training.max_steps=10` (the launch is only
    built, not started)."""
    args = parse("run", DIGITS, "--nproc-per-node", "2", "training.max_steps=10")
    assert (args.config, args.nproc_per_node, args.overrides) == (
        DIGITS, 2, ["training.max_steps=10"])
    argv = torchrun_argv(args)
    assert argv[argv.index("--nproc-per-node") + 1] == "2"
    assert argv[argv.index("--module"):] == ["--module", "elastic_runner", "train", DIGITS,
                                             "training.max_steps=10"]
    args = parse("run", DIGITS, "a=1", "--nnodes", "1:2", "b=2", "--no-resume", "-v", "c=3")
    assert (args.config, args.overrides, args.nnodes) == (DIGITS, ["a=1", "b=2", "c=3"], "1:2")
    assert args.no_resume and args.verbose
    assert torchrun_argv(args)[-6:] == ["train", DIGITS, "a=1", "b=2", "c=3", "--no-resume"]


def test_train_evaluate_validate_take_options_anywhere():
    args = parse("train", DIGITS, "a=1", "--trace-samples", "T", "b=2", "--no-resume")
    assert _overrides(args) == ["a=1", "b=2", "audit.trace_dir=T"] and args.no_resume
    args = parse("evaluate", DIGITS, "a=1", "--checkpoint", "ck", "b=2", "--split", "val")
    assert (args.overrides, args.checkpoint, args.split) == (["a=1", "b=2"], "ck", "val")
    args = parse("validate", DIGITS, "a=1", "--verbose", "b=2")
    assert args.overrides == ["a=1", "b=2"] and args.verbose


def test_verbose_before_or_after_the_subcommand():
    assert parse("-v", "validate", DIGITS).verbose
    assert parse("validate", DIGITS, "-v").verbose
    assert parse("checkpoints", "d", "--verbose").verbose
    assert not parse("validate", DIGITS).verbose


def test_unknown_option_is_still_a_usage_error(capsys):
    with pytest.raises(SystemExit) as e:
        main(["validate", DIGITS, "--bogus", "a=1"])
    assert e.value.code == 2 and "unrecognized arguments: --bogus" in capsys.readouterr().err


def test_validate_with_overrides_around_an_option_in_a_subprocess():
    res = subprocess.run(cli("validate", DIGITS, "training.max_steps=10", "-v",
                             "optimizer.lr=0.5"),
                         capture_output=True, text=True, timeout=120, cwd=REPO,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert res.returncode == 0, res.stderr
    assert "max_steps: 10" in res.stdout and "lr: 0.5" in res.stdout


def one_line_error(capsys, argv: list[str]) -> str:
    """Run the CLI in-process; assert exit code 2 and exactly one stderr line, no traceback."""
    assert main(argv) == 2
    out = capsys.readouterr()
    assert "Traceback" not in out.err + out.out
    lines = out.err.strip().splitlines()
    assert len(lines) == 1, out.err
    assert lines[0].startswith("elastic-runner: error: ")
    return lines[0].removeprefix("elastic-runner: error: ")


def test_empty_config_file_names_the_file(tmp_path, capsys):
    path = tmp_path / "empty.yaml"
    path.write_text("")
    assert one_line_error(capsys, ["validate", str(path)]) == (
        f"{path}: the config file is empty; 'task' is required")
    assert one_line_error(capsys, ["run", str(path), "--nproc-per-node", "1"]).startswith(
        f"{path}: the config file is empty")


def test_config_without_task_is_an_error(tmp_path, capsys):
    path = tmp_path / "c.yaml"
    path.write_text("seed: 1\ntraining:\n  max_steps: 3\n")
    assert one_line_error(capsys, ["validate", str(path)]).startswith("task: required")


def test_task_data_config_not_subclassing_the_base(tmp_path, capsys, monkeypatch):
    monkeypatch.syspath_prepend(str(tmp_path))
    module = user_task(tmp_path, "from dataclasses import dataclass\n\n\n@dataclass\n"
                                 "class DataConfig:\n    rows: int = 1\n\n\n"
                                 "def build(cfg): ...\n").removesuffix(":build")
    path = tmp_path / "c.yaml"
    path.write_text(f"task: {module}:build\ndata:\n  rows: 3\n")
    msg = one_line_error(capsys, ["validate", str(path)])
    assert msg.startswith(f"task: {module}.DataConfig must subclass "
                          "elastic_runner.config.DataConfig"), msg


def test_task_module_not_importable(tmp_path, capsys):
    path = tmp_path / "c.yaml"
    path.write_text("task: not_there_pkg.task:build\n")
    msg = one_line_error(capsys, ["validate", str(path)])
    assert "cannot import task module 'not_there_pkg.task'" in msg and "PYTHONPATH" in msg


def test_schema_for_an_unknown_task(capsys):
    assert one_line_error(capsys, ["schema", "--task", "nosuch"]).startswith(
        "task: unknown task 'nosuch'")


def test_a_scripts_recovery_settings_are_checked_naming_the_key(monkeypatch):
    from elastic_runner.protocol.env import RECOVERY_ENV
    from elastic_runner.recovery.script import script_recovery_config

    monkeypatch.setenv(RECOVERY_ENV, "{heartbeat_timeout_seconds: 0}")
    with pytest.raises(ConfigError, match=r"ELASTIC_RUNNER_RECOVERY: "
                                          r"recovery\.heartbeat_timeout_seconds: .*greater"):
        script_recovery_config()
    monkeypatch.setenv(RECOVERY_ENV, "[1, 2]")
    with pytest.raises(ConfigError, match="expected a mapping"):
        script_recovery_config()
    monkeypatch.setenv(RECOVERY_ENV, "{continue_shrunk: true}")
    with pytest.raises(ConfigError, match="continue_shrunk: true applies to the built-in"):
        script_recovery_config()
    monkeypatch.setenv(RECOVERY_ENV, "{spare_delay_seconds: 0}")
    cfg = script_recovery_config("restart")
    assert (cfg.mode, cfg.spare_delay_seconds) == ("restart", 0)


def test_recovery_flag_is_for_scripts_a_config_sets_recovery_mode(capsys):
    assert main(["run", DIGITS, "--recovery", "restart"]) == 2
    assert "--recovery applies to scripts; a config sets recovery.mode" in capsys.readouterr().err
