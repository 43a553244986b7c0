"""Config loading: typed sections, overrides, and errors that name the key path."""

import importlib
import importlib.util
import json
import sys
import uuid
from pathlib import Path

import jsonschema
import pytest
import torch
import yaml

from elastic_runner.cli import main
from elastic_runner.config import (
    ConfigError,
    DataConfig,
    dump_yaml,
    fingerprint,
    from_dict,
    load_config,
)
from elastic_runner.task_registry import available_tasks, task_target

from .needs import HF_EXTRA, require_modules
from .procs import CONFIGS, REPO, run_cli


def write(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "c.yaml"
    p.write_text(text)
    return p


@pytest.mark.parametrize("name", ["digits.yaml", "char_lm.yaml", "text_classification.yaml",
                                  "causal_lm.yaml"])
def test_shipped_configs_are_valid(name):
    if name in ("text_classification.yaml", "causal_lm.yaml"):
        require_modules("transformers", "tokenizers", install_hint=HF_EXTRA)
    cfg = load_config(CONFIGS / name)
    assert cfg.task == name.removesuffix(".yaml")
    assert sorted(p.name for p in CONFIGS.glob("*.yaml")) == sorted(SHIPPED)


SHIPPED = ["digits.yaml", "char_lm.yaml", "text_classification.yaml", "causal_lm.yaml"]


def test_an_hf_task_without_the_extra_names_it(monkeypatch):
    import builtins

    real_import = builtins.__import__

    def no_transformers(name, *args, **kwargs):
        if name.partition(".")[0] == "transformers":
            raise ModuleNotFoundError("No module named 'transformers'", name="transformers")
        return real_import(name, *args, **kwargs)

    monkeypatch.delitem(sys.modules, "elastic_runner.tasks.causal_lm", raising=False)
    monkeypatch.setattr(builtins, "__import__", no_transformers)
    with pytest.raises(ConfigError, match=r"task: task module 'elastic_runner.tasks.causal_lm' "
                                          r"needs 'transformers'.*pip install "
                                          r"'elastic-runner\[hf\]'"):
        load_config(CONFIGS / "causal_lm.yaml")


def test_tensorboard_without_the_extra_is_refused_naming_the_key(monkeypatch, tmp_path):
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "tensorboard" else real_find_spec(name, *a))
    assert load_config(CONFIGS / "digits.yaml").logging.tensorboard_dir is None  # shipped: off
    with pytest.raises(ConfigError, match=r"^logging\.tensorboard_dir: needs TensorBoard.*"
                                          r"pip install 'elastic-runner\[tensorboard\]'"):
        load_config(CONFIGS / "digits.yaml", [f"logging.tensorboard_dir={tmp_path}"])


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
    if not text.startswith("task:"):  # `task` is required
        text = "task: digits\n" + text
    with pytest.raises(ConfigError) as e:
        load_config(write(tmp_path, text))
    assert expected in str(e.value)


# every message is the exact line of the dataclass-era validator (same inputs, same words)
@pytest.mark.parametrize("raw, expected", [
    ({"batch": {"micro_batch_size": True}}, "batch.micro_batch_size: expected int, got bool True"),
    ({"batch": {"micro_batch_size": 2.0}}, "batch.micro_batch_size: expected int, got float 2.0"),
    ({"batch": {"micro_batch_size": "5"}}, "batch.micro_batch_size: expected int, got str '5'"),
    ({"early_stopping": {"mode": "xyz"}},
     "early_stopping.mode: expected one of 'min', 'max', got 'xyz'"),
    ({"optimizer": {"betas": [1, 2, 3]}}, "optimizer.betas: expected 2 values, got 3"),
    ({"optimizer": {"betas": [1]}}, "optimizer.betas: expected 2 values, got 1"),
    ({"optimizer": {"betas": 3}}, "optimizer.betas: expected a list, got int 3"),
    ({"optimizer": {"betas": [1, "x"]}}, "optimizer.betas[1]: expected float, got str 'x'"),
    ({"optimizer": {"lr": "abc"}}, "optimizer.lr: expected float, got str 'abc'"),
    ({"optimizer": {"lr": True}}, "optimizer.lr: expected float, got bool True"),
    ({"optimizer": {"lr": 0}}, "optimizer.lr: must be > 0"),
    ({"optimizer": {"lr": None}}, "optimizer.lr: expected float, got NoneType None"),
    ({"schedule": {"min_lr_ratio": 2}}, "schedule.min_lr_ratio: must be in [0, 1]"),
    ({"metrics": {"port": 70000}}, "metrics.port: must be a TCP port (1-65535) or null"),
    ({"metrics": {"straggler_threshold": 0.5}},
     "metrics.straggler_threshold: must be > 1 (a ratio to the median) or 0 (off)"),
    ({"faults": {"inject": [{"kind": "boom"}]}}, "faults.inject[0].kind: expected one of "
     "'sigkill', 'sigterm', 'raise', 'hang', 'nan', 'slow', got 'boom'"),
    ({"faults": {"inject": [{"knd": "nan"}]}}, "faults.inject[0].knd: unknown key; did you mean "
     "'faults.inject[0].kind'? (valid keys: kind, rank, step, after_steps, attempts, count, "
     "repeat, seconds, during)"),
    ({"faults": {"inject": {"kind": "nan"}}}, "faults.inject: expected a list, got dict "
     "{'kind': 'nan'}"),
    ({"faults": {"planted_metric": ["a"]}},
     "faults.planted_metric[0]: expected float, got str 'a'"),
    ({"distributed": {"ddp": 3}}, "distributed.ddp: expected a mapping, got int"),
    ({"data": {"num_workers": -1}}, "data.num_workers: must be >= 0"),
    ({"data": 5}, "data: expected a mapping, got int"),
    ({"model": 5}, "model: expected a mapping, got int"),
    ({"checkpoint": {"dir": 5}}, "checkpoint.dir: expected str, got int 5"),
    ({"checkpoint": {"async_save": 1}}, "checkpoint.async_save: expected bool, got int 1"),
    ({"seed": None}, "seed: expected int, got NoneType None"),
    ({"task": 5}, "task: expected str, got int 5"),
    ({"zzz": 1}, "zzz: unknown key (valid keys: task, seed, data, model, optimizer, schedule, "
     "batch, training, eval, checkpoint, early_stopping, distributed, logging, audit, watchdog, "
     "preemption, recovery, restarts, faults, metrics)"),
])
def test_error_lines_match_the_previous_validator(raw, expected):
    with pytest.raises(ConfigError) as e:
        from_dict({"task": "digits", **raw})
    assert str(e.value) == expected


def test_first_error_in_file_order_unknown_sections_first():
    raw = {"task": "digits", "training": {"max_steps": 0}, "optimizer": {"lr": 0}, "zz": 1}
    with pytest.raises(ConfigError, match=r"^zz: unknown key"):
        from_dict(raw)
    with pytest.raises(ConfigError, match=r"^training\.max_steps"):
        from_dict({k: v for k, v in raw.items() if k != "zz"})


def test_unknown_key_lists_valid_keys(tmp_path):
    with pytest.raises(ConfigError, match=r"valid keys: name, lr, weight_decay, betas, momentum"):
        load_config(write(tmp_path, "task: digits\noptimizer:\n  lrr: 0.1\n"))


def test_bad_override_syntax():
    with pytest.raises(ConfigError, match="expected key.path=value"):
        load_config(CONFIGS / "digits.yaml", ["optimizer.lr"])


@pytest.mark.parametrize("command", ["validate", "run", "train"])
def test_cli_config_error_exits_2_without_traceback(tmp_path, capsys, command):
    """``run`` and ``train`` in a fresh interpreter (the entry point's exit status and stderr
    as a shell sees them; both start under torch's ``record``, which installs a fault handler
    on the real stderr); ``validate`` through the same ``main`` in this process, where an
    exception would fail the test instead of printing a traceback."""
    bad = write(tmp_path, "task: digits\noptimizer:\n  lrr: 0.1\n")
    if command != "validate":
        res = run_cli(command, str(bad), timeout=60)
        code, out, err = res.returncode, res.stdout, res.stderr
    else:
        capsys.readouterr()
        code = main([command, str(bad)])
        out, err = capsys.readouterr()
    assert code == 2, err
    assert "optimizer.lrr: unknown key; did you mean 'optimizer.lr'?" in err
    assert "Traceback" not in err + out


def test_validate_prints_resolved_values(capsys):
    capsys.readouterr()
    assert main(["validate", str(CONFIGS / "digits.yaml"), "optimizer.lr=0.5"]) == 0
    out = capsys.readouterr().out
    assert "lr: 0.5" in out and "valid (config hash" in out


def test_global_batch_derives_accumulation_or_names_the_world_sizes_it_fits():
    cfg = load_config(CONFIGS / "digits.yaml", ["batch.micro_batch_size=4",
                                                "batch.global_batch_size=24"])
    # 4 and 5 do not divide it: split unevenly, as many micro-batches as 4 samples need
    assert [cfg.batch.accumulation_for(w) for w in (1, 2, 3, 4, 5, 6)] == [6, 3, 2, 2, 2, 1]
    assert cfg.batch.accumulation_for(24) == 1
    with pytest.raises(ConfigError, match=r"cannot give each of world_size 25 ranks 1 "
                                          r"non-empty.*world sizes it fits: \[1, 2, .*, 24\]$"):
        cfg.batch.accumulation_for(25)
    with pytest.raises(ConfigError, match="must be a multiple of batch.micro_batch_size"):
        load_config(CONFIGS / "digits.yaml", ["batch.micro_batch_size=4",
                                              "batch.global_batch_size=10"])



def test_the_global_batch_of_the_first_world_size_is_kept_by_default(tmp_path):
    """No batch.global_batch_size (configs/digits.yaml: micro-batch 16, accumulation 2): the
    job's first world size sets the global batch, and a restart at another world size keeps
    the newest checkpoint's (its manifest); keep_global_batch: false lets it follow."""
    from elastic_runner.checkpoint import storage as ckpt
    from elastic_runner.trainer.build import keep_global_batch

    cfg = load_config(CONFIGS / "digits.yaml", [f"checkpoint.dir={tmp_path}"])
    assert cfg.batch.global_batch_size is None and not cfg.batch.follows_world_size
    first = keep_global_batch(cfg, 2, None)  # no checkpoint: the first start
    assert first.batch.global_batch_size == 64
    assert [first.batch.accumulation_for(w) for w in (1, 2, 3, 4)] == [4, 2, 2, 1]  # 3: uneven
    ckpt.write_checkpoint(tmp_path, "step-00000005", {"x": 1},
                          {"step": 5, "world_size": 2, "global_batch_size": 64})
    assert keep_global_batch(cfg, 1, None).batch.global_batch_size == 64  # the checkpoint's
    assert keep_global_batch(cfg, 4, 32).batch.global_batch_size == 32  # the live group's
    # a checkpoint of an earlier release has no global_batch_size: its world size's
    ckpt.write_checkpoint(tmp_path, "step-00000009", {"x": 1}, {"step": 9, "world_size": 4})
    assert keep_global_batch(cfg, 1, None).batch.global_batch_size == 128
    follows = load_config(CONFIGS / "digits.yaml", [f"checkpoint.dir={tmp_path}",
                                                    "batch.keep_global_batch=false"])
    assert keep_global_batch(follows, 1, None).batch.global_batch_size is None
    assert follows.batch.accumulation_for(3) == 2
    fixed = load_config(CONFIGS / "digits.yaml", ["batch.global_batch_size=96"])
    assert keep_global_batch(fixed, 1, 64).batch.global_batch_size == 96


def test_continue_shrunk_needs_a_global_batch_that_stays():
    assert load_config(CONFIGS / "digits.yaml", ["recovery.continue_shrunk=true"])
    with pytest.raises(ConfigError, match="recovery.continue_shrunk: needs a global batch"):
        load_config(CONFIGS / "digits.yaml", ["recovery.continue_shrunk=true",
                                              "batch.keep_global_batch=false"])

# ---------------------------------------------------------------- hash compatibility

# Computed with the dataclass-based config.py (before pydantic): checkpoints written then must
# still resume without a config-mismatch warning, so these hashes must never change.
_OLD_HASHES = [
    ({"task": "digits"}, "ef3a9cbe5b451d48"),
    ({"task": "char_lm"}, "528be3ce3d865eab"),
    ({"task": "digits", "seed": 7, "model": {"channels": 8, "dropout": 0},
      "data": {"val_fraction": 0.2}, "optimizer": {"lr": "1e-3", "betas": [0.8, 0.9]},
      "batch": {"micro_batch_size": 4, "global_batch_size": 24},
      "training": {"max_steps": 100, "grad_clip_norm": 2, "precision": "bf16"},
      "distributed": {"timeout_seconds": 300, "ddp": {"bucket_cap_mb": 10}},
      "checkpoint": {"dir": "elsewhere", "every_seconds": 60},
      "faults": {"inject": [{"kind": "nan", "step": 3}]}, "metrics": {"port": 9400}},
     "016c8492bd44e3eb"),
]


@pytest.mark.parametrize("raw, expected", _OLD_HASHES)
def test_fingerprint_is_unchanged_from_the_dataclass_config(raw, expected):
    cfg = from_dict(raw)
    assert cfg.fingerprint() == expected == fingerprint(cfg.to_dict())
    again = from_dict(cfg.to_dict())  # what export/evaluate do with a checkpoint's config
    assert again.to_dict() == cfg.to_dict() and again.fingerprint() == expected


def test_to_dict_is_plain_and_ordered():
    d = from_dict({"task": "digits", "optimizer": {"lr": 1}}).to_dict()
    assert list(d)[:4] == ["task", "seed", "data", "model"]
    assert d["data"] == {"num_workers": 0, "pin_memory": False, "val_fraction": 0.15,
                         "test_fraction": 0.15}
    assert d["optimizer"]["betas"] == [0.9, 0.999] and d["optimizer"]["lr"] == 1.0
    assert isinstance(d["optimizer"]["lr"], float)
    assert dump_yaml(from_dict(d)).startswith("task: digits\nseed: 1234\ndata:\n  num_workers: 0\n")


def test_fault_env_is_appended(monkeypatch):
    monkeypatch.setenv("ELASTIC_RUNNER_FAULTS", "[{kind: sigterm, rank: 1, step: 200}]")
    cfg = load_config(CONFIGS / "digits.yaml", ["faults.inject=[{kind: nan, step: 3}]"])
    assert [(f.kind, f.rank, f.step) for f in cfg.faults.inject] == [
        ("nan", 0, 3), ("sigterm", 1, 200)]


# ---------------------------------------------------------------- task is required


def test_empty_file_is_an_error_naming_the_file(tmp_path):
    path = write(tmp_path, "# nothing yet\n")
    with pytest.raises(ConfigError, match=rf"^{path}: the config file is empty; 'task' is "
                                          "required"):
        load_config(path)


def test_task_is_required(tmp_path):
    with pytest.raises(ConfigError, match=r"^task: required; name the task: one of \["):
        load_config(write(tmp_path, "seed: 3\n"))
    assert load_config(write(tmp_path, "seed: 3\n"), ["task=digits"]).task == "digits"


# ---------------------------------------------------------------- user tasks


USER_TASK = '''
from pydantic import Field

from elastic_runner.config import DataConfig as BaseDataConfig
from elastic_runner.config import ModelConfig as BaseModelConfig


class DataConfig(BaseDataConfig):
    rows: int = Field(100, ge=1)


class ModelConfig(BaseModelConfig):
    hidden: int = 8
    act: str = "relu"


def build(cfg):
    raise NotImplementedError
'''


def user_task(root: Path, source: str = USER_TASK) -> str:
    """A package ``<unique>/task.py`` under ``root``; returns its task name."""
    pkg = root / f"usertask_{uuid.uuid4().hex[:8]}"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "task.py").write_text(source)
    importlib.invalidate_caches()
    return f"{pkg.name}.task:build"


def test_user_task_sections_are_its_pydantic_models(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(tmp_path))
    task = user_task(tmp_path)
    cfg = from_dict({"task": task, "data": {"rows": 5}, "model": {"hidden": 4}})
    assert (cfg.data.rows, cfg.data.num_workers) == (5, 0)
    assert (cfg.model.hidden, cfg.model.act) == (4, "relu")
    assert cfg.to_dict()["data"] == {"num_workers": 0, "pin_memory": False, "rows": 5}
    with pytest.raises(ConfigError, match=r"^model\.hiden: unknown key; did you mean "
                                          r"'model\.hidden'\? \(valid keys: hidden, act\)$"):
        from_dict({"task": task, "model": {"hiden": 4}})
    with pytest.raises(ConfigError, match=r"^data\.rows: must be >= 1$"):
        from_dict({"task": task, "data": {"rows": 0}})


def test_task_without_model_config_gets_a_mapping(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(tmp_path))
    task = user_task(tmp_path, "def build(cfg):\n    return None\n")
    cfg = from_dict({"task": task, "model": {"anything": [1, 2]}})
    assert cfg.model == {"anything": [1, 2]} and from_dict({"task": task}).model == {}
    assert type(cfg.data) is DataConfig


def test_dataclass_sections_are_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(tmp_path))
    task = user_task(tmp_path, "from dataclasses import dataclass\n\n\n@dataclass\n"
                               "class DataConfig:\n    rows: int = 1\n\n\ndef build(cfg): ...\n")
    module = task.partition(":")[0]
    with pytest.raises(ConfigError, match=rf"^task: {module}\.DataConfig must subclass "
                                          r"elastic_runner\.config\.DataConfig"):
        from_dict({"task": task})


def test_task_module_is_imported_as_is_not_from_the_cwd(tmp_path, monkeypatch):
    task = user_task(tmp_path)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    with pytest.raises(ConfigError, match=r"cannot import task module .*PYTHONPATH.*pip install"):
        from_dict({"task": task})
    assert str(tmp_path) not in sys.path  # the loader did not add it either
    monkeypatch.syspath_prepend(str(tmp_path))
    assert from_dict({"task": task}).model.hidden == 8


def test_failing_import_inside_the_task_module_names_it(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(tmp_path))
    task = user_task(tmp_path, "import no_such_dependency_xyz\n\n\ndef build(cfg): ...\n")
    with pytest.raises(ConfigError, match=r"importing task module .* failed: No module named "
                                          r"'no_such_dependency_xyz'; check that its dependencies"):
        from_dict({"task": task})


def test_entry_point_registers_a_task_name(tmp_path, monkeypatch):
    task = user_task(tmp_path)
    dist = tmp_path / "mytasks-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: mytasks\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text(f"[elastic_runner.tasks]\nmytask = {task}\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert "mytask" in available_tasks() and task_target("mytask") == task
    cfg = from_dict({"task": "mytask", "model": {"hidden": 3}})
    assert cfg.model.hidden == 3 and cfg.task == "mytask"


# ---------------------------------------------------------------- JSON Schema


def deploy_configs() -> list[tuple[str, dict]]:
    """Every runner config in deploy/ (YAML documents with a top-level ``task``)."""
    found = []
    for path in sorted((REPO / "deploy").rglob("*.y*ml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if isinstance(doc, dict) and "task" in doc:
                found.append((str(path.relative_to(REPO)), doc))
    return found


def shipped_configs() -> list[tuple[str, dict]]:
    configs = [(f"configs/{p.name}", yaml.safe_load(p.read_text()))
               for p in sorted(CONFIGS.glob("*.yaml"))]
    assert len(configs) >= 2 and deploy_configs(), "no configs found"
    return configs + deploy_configs()


def schema_from_cli(capsys, *args: str) -> dict:
    assert main(["schema", *args]) == 0
    schema = json.loads(capsys.readouterr().out)
    jsonschema.Draft202012Validator.check_schema(schema)
    return schema


def test_every_shipped_config_matches_the_schema(capsys):
    generic = jsonschema.Draft202012Validator(schema_from_cli(capsys))
    for name, doc in shipped_configs():
        assert not [e.message for e in generic.iter_errors(doc)], name
        typed = jsonschema.Draft202012Validator(schema_from_cli(capsys, "--task", doc["task"]))
        assert not [e.message for e in typed.iter_errors(doc)], name
        load_config(REPO / name)  # and the loader agrees


def test_schema_rejects_what_the_loader_rejects(capsys):
    generic = jsonschema.Draft202012Validator(schema_from_cli(capsys))
    digits = jsonschema.Draft202012Validator(schema_from_cli(capsys, "--task", "digits"))
    ok = {"task": "digits", "model": {"channels": 8}, "data": {"val_fraction": 0.2}}
    assert generic.is_valid(ok) and digits.is_valid(ok)
    for bad in ({"seed": 1}, {**ok, "optimizer": {"lrr": 1}}, {**ok, "training": {"max_steps": 0}},
                {**ok, "early_stopping": {"mode": "minimum"}},
                {**ok, "batch": {"micro_batch_size": "x"}}):
        assert not generic.is_valid(bad) and not digits.is_valid(bad), bad
    typo = {**ok, "model": {"chanels": 8}}
    assert generic.is_valid(typo) and not digits.is_valid(typo)  # only the task types `model`


def test_hsdp_replicas_that_do_not_divide_the_world_size_are_refused_naming_the_key():
    """Checked where the mesh is made, before any process group or checkpoint is touched; the
    worker turns a ConfigError into exit code 2 and its one line (test_task_input.py)."""
    from elastic_runner.config import ConfigError
    from elastic_runner.parallel.fsdp import device_mesh

    with pytest.raises(ConfigError, match=r"^distributed\.fsdp\.replicas: 3 does not divide the "
                                          r"world size 2; use a divisor of it \(1: plain FSDP\)$"):
        device_mesh(2, 3, torch.device("cpu"))
