"""Config loading: typed sections, overrides, and errors that name the key path."""

from pathlib import Path

import pytest

from elastic_runner.config import ConfigError, load_config

from .procs import CONFIGS, run_cli


def write(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "c.yaml"
    p.write_text(text)
    return p


@pytest.mark.parametrize("name", ["digits.yaml", "char_lm.yaml"])
def test_shipped_configs_are_valid(name):
    cfg = load_config(CONFIGS / name)
    assert cfg.task == name.removesuffix(".yaml")


def test_overrides_are_parsed_as_yaml_and_typed():
    cfg = load_config(CONFIGS / "digits.yaml",
                      ["optimizer.lr=1e-4", "optimizer.betas=[0.8, 0.9]", "training.max_steps=7",
                       "model.channels=8", "early_stopping.mode=min"])
    assert cfg.optimizer.lr == 1e-4 and isinstance(cfg.optimizer.lr, float)
    assert cfg.optimizer.betas == (0.8, 0.9)
    assert cfg.training.max_steps == 7
    assert cfg.model.channels == 8
    assert cfg.early_stopping.mode == "min"


@pytest.mark.parametrize("text, expected", [
    ("optimizer:\n  lrr: 0.1\n", "optimizer.lrr: unknown key; did you mean 'optimizer.lr'?"),
    ("checkpont:\n  dir: x\n", "checkpont: unknown key; did you mean 'checkpoint'?"),
    ("batch:\n  micro_batch_size: big\n",
     "batch.micro_batch_size: expected int, got str 'big'"),
    ("early_stopping:\n  mode: minimum\n",
     "early_stopping.mode: expected one of 'min', 'max', got 'minimum' (did you mean 'min'?)"),
    ("model:\n  chanels: 3\n", "model.chanels: unknown key; did you mean 'model.channels'?"),
    ("training:\n  max_steps: 0\n", "training.max_steps: must be >= 1 or null"),
    ("task: nosuch\n", "task: unknown task 'nosuch'"),
    ("optimizer: [1, 2]\n", "optimizer: expected a mapping, got list"),
])
def test_errors_name_the_key_path(tmp_path, text, expected):
    with pytest.raises(ConfigError) as e:
        load_config(write(tmp_path, text))
    assert expected in str(e.value)


def test_unknown_key_lists_valid_keys(tmp_path):
    with pytest.raises(ConfigError, match=r"valid keys: name, lr, weight_decay, betas, momentum"):
        load_config(write(tmp_path, "optimizer:\n  lrr: 0.1\n"))


def test_bad_override_syntax():
    with pytest.raises(ConfigError, match="expected key.path=value"):
        load_config(CONFIGS / "digits.yaml", ["optimizer.lr"])


@pytest.mark.parametrize("command", ["validate", "run", "train"])
def test_cli_config_error_exits_2_without_traceback(tmp_path, command):
    bad = write(tmp_path, "task: digits\noptimizer:\n  lrr: 0.1\n")
    res = run_cli(command, str(bad), timeout=60)
    assert res.returncode == 2, res.stderr
    assert "optimizer.lrr: unknown key; did you mean 'optimizer.lr'?" in res.stderr
    assert "Traceback" not in res.stderr + res.stdout


def test_validate_prints_resolved_values():
    res = run_cli("validate", str(CONFIGS / "digits.yaml"), "optimizer.lr=0.5")
    assert res.returncode == 0, res.stderr
    assert "lr: 0.5" in res.stdout and "valid (config hash" in res.stdout


def test_global_batch_derives_accumulation_or_names_valid_world_sizes():
    cfg = load_config(CONFIGS / "digits.yaml", ["batch.micro_batch_size=4",
                                                "batch.global_batch_size=24"])
    assert [cfg.batch.accumulation_for(w) for w in (1, 2, 3, 6)] == [6, 3, 2, 1]
    with pytest.raises(ConfigError, match=r"valid world sizes: \[1, 2, 3, 6\]"):
        cfg.batch.accumulation_for(4)
    with pytest.raises(ConfigError, match="must be a multiple of batch.micro_batch_size"):
        load_config(CONFIGS / "digits.yaml", ["batch.micro_batch_size=4",
                                              "batch.global_batch_size=10"])
