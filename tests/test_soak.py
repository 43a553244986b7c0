"""The soak (``bench/soak.py``) in small: 10 faults covering every class, injected from outside
into one 2-node x 2-worker job around a real etcd; 5 faults of the classes where a node leaves,
with nodes that leave and join in place (``--min-nodes 1``); plus the pieces it relies on
without processes: the seeded plan and the fault trigger file (``faults.trigger_file``)."""

from __future__ import annotations

import logging

import pytest

from bench import soak
from elastic_runner.config import FaultConfig, FaultSpec, load_config
from elastic_runner.train.faults import FaultInjector, NoTrigger, TriggerFile

from .evidence import DIGITS_TRAIN
from .needs import debian, require_command
from .procs import CONFIGS

# its 3 faults beyond one per class are cheap ones (nan, etcd-outage, worker-sigkill)
SEED = 6
# --min-nodes 1 (8 classes): its 2 faults beyond one per class are a nan and a worker-sigkill
ELASTIC_SEED = 19


def test_plan_is_seeded_and_holds_every_class():
    plan = soak.make_plan(SEED, 10)
    assert plan == soak.make_plan(SEED, 10)
    assert plan != soak.make_plan(SEED + 1, 10)
    kinds = [f.kind for f in plan]
    assert set(kinds) == set(soak.CLASSES) and len(kinds) == 10
    big = [f.kind for f in soak.make_plan(SEED, 100)]
    assert all(14 <= big.count(k) <= 15 for k in soak.CLASSES), big
    with pytest.raises(ValueError, match="at least 7"):
        soak.make_plan(SEED, 6)
    elastic = soak.classes(1)
    assert soak.classes(2) == soak.CLASSES and set(elastic) == {*soak.CLASSES, "node-preempt"}
    kinds = [f.kind for f in soak.make_plan(ELASTIC_SEED, 10, kinds_of=elastic)]
    assert set(kinds) == set(elastic) and sorted(kinds) == sorted(
        [*elastic, "nan", "worker-sigkill"])
    # a node that leaves: the smaller group trains on while it starts again
    f = soak.make_plan(ELASTIC_SEED, 10, kinds_of=elastic)[kinds.index("node-preempt")]
    assert soak.cost(f, 5, elastic=True) > soak.cost(f, 5) + 10 * soak.STEP_RATE_CAP


def test_trigger_file_poisons_the_named_rank_once(tmp_path, caplog):
    path = tmp_path / "trigger"
    cfg = FaultConfig(trigger_file=str(path))
    rank0, rank1 = FaultInjector(cfg, 0, 0), FaultInjector(cfg, 1, 0)
    assert rank1.active and rank1.specs == []  # the callbacks go in; no configured spec

    def step(injector: FaultInjector, n: int) -> bool:
        injector.begin_step(n, n)
        return injector.poison_loss(n, n)

    assert not step(rank1, 3)  # no file yet
    path.write_text("nan rank=1\nbogus line\nnan rank=1\n")
    with caplog.at_level(logging.WARNING, logger="elastic_runner.train.faults"):
        assert not step(rank0, 4)  # not its line; the bad one goes
        assert path.read_text() == "nan rank=1\nnan rank=1\n"
        assert step(rank1, 5)
        assert path.read_text() == "nan rank=1\n"  # one line, one NaN
        assert step(rank1, 6) and not step(rank1, 7)
    assert path.read_text() == ""
    text = caplog.text
    assert "removed the line 'bogus line' (allowed: 'nan rank=R', 'slow rank=R seconds=S'" in text
    assert f"rank 1 poisons its loss at step 5 (trigger file {path})" in text


def test_trigger_file_slows_the_named_rank_while_the_line_stands(tmp_path, caplog, monkeypatch):
    path = tmp_path / "trigger"
    cfg = FaultConfig(trigger_file=str(path), inject=[
        FaultSpec(kind="slow", rank=1, step=2, count=1, seconds=0.5)])
    rank0, rank1 = FaultInjector(cfg, 0, 0), FaultInjector(cfg, 1, 0)
    slept: list[float] = []
    monkeypatch.setattr("elastic_runner.train.faults.time.sleep", slept.append)
    path.write_text("slow rank=1 seconds=0.25\nnan rank=1\n")
    with caplog.at_level(logging.WARNING, logger="elastic_runner.train.faults"):
        rank0.begin_step(1, 1)
        rank1.begin_step(1, 1)
        assert slept == [0.25] and rank1.poison_loss(1, 1)  # both requests at one read
        rank1.begin_step(2, 2)  # the configured slow fault of step 2 adds to the request
        assert slept == [0.25, 0.75] and not rank1.poison_loss(2, 2)
        assert path.read_text() == "slow rank=1 seconds=0.25\n"  # it stands
        path.write_text("")
        rank1.begin_step(3, 3)
    assert slept == [0.25, 0.75]  # ended with the line
    text = caplog.text
    assert text.count("rank 1 sleeps 0.25 s before each step") == 1
    assert "rank 1 no longer sleeps before each step" in text and "rank 0" not in text


def test_no_trigger_file_is_a_null_object_and_the_key_loads():
    injector = FaultInjector(FaultConfig(), 0, 0)
    assert isinstance(injector.trigger, NoTrigger) and not injector.active
    cfg = load_config(CONFIGS / "digits.yaml", ["faults.trigger_file=/tmp/x"])
    assert cfg.faults.trigger_file == "/tmp/x"
    assert isinstance(FaultInjector(cfg.faults, 0, 0).trigger, TriggerFile)


@pytest.mark.slow
@pytest.mark.soak
def test_ten_faults_of_every_class_on_two_nodes(tmp_path):
    require_command("etcd", debian("etcd-server"))
    plan = soak.make_plan(SEED, 10, hold_s=(1.0, 3.0))
    settings = soak.Settings(steps=soak.default_steps(plan), fault_timeout_s=150, timeout_s=420)
    result = soak.soak(plan, SEED, settings, tmp_path)
    faults, job = result["faults"], result["job"]
    brief = [(f["kind"], f.get("error", "")[:300]) for f in faults if not f["survived"]]
    assert len(faults) == 10 and not brief, (brief, result.get("error"))
    assert {f["kind"] for f in faults} == set(soak.CLASSES)
    assert job["completed"] and job["final_step"] == settings.steps, job
    assert job["world_sizes"] == [4]
    complete = [e for e in job["epochs"] if e["complete"]]
    assert len(complete) >= 10
    for e in complete:
        assert e["lost"] == e["duplicated"] == 0 and e["seen_once"] == e["expected"], e
    assert job["corrupt_resumes"] == []
    for f in faults:
        if f["kind"] == "ckpt-corrupt":  # resumed from an older checkpoint, past the bad one
            assert f["resumed_step"] < f["corrupted_step"], f
        if f["kind"] == "nan":
            assert f["skipped_on_all_ranks"] and f["restarts"] == 0, f
        if f["kind"] == "etcd-outage":
            assert f["steps_during_outage"] >= soak.OUTAGE_STEPS and f["restarts"] == 0, f
        if f["kind"] in ("worker-sigkill", "worker-hang"):  # replaced in place
            assert f["path"] == "in_place" and f["restarts"] == 0, f
        if f["kind"] in ("worker-sigterm", "node-kill", "ckpt-corrupt"):
            assert f["path"] == "restart" and f["restarts"] == 1, f
    weights = job["final_weights"]
    assert weights["unexplained_skips"] == [] and weights["bitwise"], weights
    assert soak.passed(result), soak.table(result)


@pytest.mark.slow
@pytest.mark.soak
def test_nodes_that_leave_are_started_again_and_join_in_place(tmp_path):
    """``--min-nodes 1``, the classes of a node leaving (preempted, killed, a worker's SIGTERM)
    and a worker SIGKILL: the other node goes on without it in place (the recovery store
    moving to it when the leaving node hosted it), the driver starts it again and it joins; the
    world size changes, the audit stays exact. (No etcd outage: see the note in bench/soak.py.)
    """
    require_command("etcd", debian("etcd-server"))
    kinds = ("node-preempt", "node-kill", "worker-sigterm", "worker-sigkill")
    plan = soak.make_plan(ELASTIC_SEED, 5, kinds_of=kinds)
    settings = soak.Settings(steps=soak.default_steps(plan, elastic=True), fault_timeout_s=150,
                             timeout_s=420, min_nodes=1)
    result = soak.soak(plan, ELASTIC_SEED, settings, tmp_path)
    faults, job = result["faults"], result["job"]
    brief = [(f["kind"], f.get("error", "")[:300]) for f in faults if not f["survived"]]
    assert len(faults) == 5 and not brief, (brief, result.get("error"))
    assert job["completed"] and job["final_step"] == settings.steps, job
    assert job["world_sizes"] == [2, 4]
    # the global batch of the full world at every size: each epoch the steps passed is complete
    complete = [e for e in job["epochs"] if e["complete"]]
    per_epoch = DIGITS_TRAIN // soak.FULL_GLOBAL_BATCH
    assert len(complete) >= (settings.steps - 1) // per_epoch, complete
    for e in complete:
        assert e["lost"] == e["duplicated"] == 0 and e["seen_once"] == e["expected"], e
    for f in faults:  # every class in place: replaced, or the node left without a restart
        assert f["path"] == "in_place" and f["restarts"] == 0, f
        if f["kind"] in ("node-preempt", "node-kill"):  # it left; started again, it is back
            assert f["returned"] == [f["node"]] and f["world_sizes_after"][-1] == 4, f
        if f["kind"] == "node-preempt":
            assert f["exit_code"] == 143, f
        if f["kind"] == "worker-sigterm":  # its node left in place; started again, it is back
            assert f.get("returned"), f
    assert "final_weights" not in job  # no reference run: another summation order anyway
    assert soak.passed(result), soak.table(result)
