"""Smoke test: the benchmarks run at their smallest size and report ratios (no timing asserts)."""

import json

import pytest

from bench import (
    checkpoint_stall,
    metrics_overhead,
    overhead,
    peer_copies,
    plot,
    recovery,
    state_transfer,
)
from bench.common import REPO

from .needs import TEST_EXTRAS, require_modules


def test_checkpoint_stall_smoke(tmp_path, capsys):
    (row,) = checkpoint_stall.main(["--sizes-mb", "4", "--repeats", "1", "--dir", str(tmp_path),
                                    "--json", str(tmp_path / "out.json")])
    assert row["size_mb"] == 4 and row["sync_s"] > 0 and row["async_stall_s"] > 0
    assert "async stall" in capsys.readouterr().out and (tmp_path / "out.json").is_file()


@pytest.mark.slow
def test_state_transfer_smoke(tmp_path, capsys):
    """Three ranks, two state sizes: every method timed, the ratios against the raw wire."""
    out = state_transfer.main(["--world-sizes", "3", "--width", "64", "--blocks", "1", "2",
                               "--repeats", "1", "--json", str(tmp_path / "out.json")])
    rows = out["world_sizes"]["3"]
    assert set(rows) == {"1", "2"} and rows["2"]["bytes"] == 2 * rows["1"]["bytes"]
    assert all(rows[b][m]["seconds"] > 0 for b in rows for m in state_transfer.METHODS)
    assert rows["2"]["transfer_vs_raw"] == \
        rows["2"]["raw"]["seconds"] / rows["2"]["transfer"]["seconds"]
    assert rows["2"]["transfer_vs_raw_best"] == \
        rows["2"]["raw"]["min"] / rows["2"]["transfer"]["min"]
    assert "xfer/raw" in capsys.readouterr().out and (tmp_path / "out.json").is_file()
    # a second run measures only the load: its section is merged in, the first run's stays
    second = ["--world-sizes", "--width", "64", "--blocks", "1", "--repeats", "1", "--load",
              "--json", str(tmp_path / "out.json")]
    state_transfer.main(second)
    merged = json.loads((tmp_path / "out.json").read_text())
    assert merged["world_sizes"] == json.loads(json.dumps(out["world_sizes"]))
    assert set(merged["load"]) == {"1"}
    assert merged["runs"]["load"]["command"] == " ".join(["python -m bench.state_transfer",
                                                           *second])
    assert "--world-sizes 3" in merged["runs"]["world_sizes"]["command"]


@pytest.mark.slow
def test_peer_copies_smoke(tmp_path, capsys):
    """Two ranks: every figure measured, the ratios derived from the runs side by side."""
    out = peer_copies.main(["--world-sizes", "2", "--width", "64", "--blocks", "2",
                            "--repeats", "2", "--steps", "4", "--every", "1", "2",
                            "--json", str(tmp_path / "out.json")])
    r = out["results"]["2"]
    raw = r["raw"]
    assert len(raw["none"]) == len(raw["every_1"]) == len(raw["restore"]) == 2
    assert len(raw["stall"]) == 2 * ((1 + 4) + (1 + 2)) and r["stall_s"]["median"] > 0
    assert r["copy_bytes_per_rank"] > r["state_bytes"] / 2  # half the state, and the rest
    for k in ("1", "2"):
        ratios = [n / c for n, c in zip(raw["none"], raw[f"every_{k}"], strict=True)]
        assert r["by_cadence"][k]["throughput_ratio"]["min"] == min(ratios)
    assert "K=2" in capsys.readouterr().out and (tmp_path / "out.json").is_file()


@pytest.mark.slow
def test_recovery_smoke(capsys):
    result = recovery.main(["--repeats", "1", "--scenarios", "sigterm", "--backends", "c10d"])
    (run,) = result["repeats"]
    phases = run["sigterm/c10d"]
    assert phases["steps_redone"] == 0  # the preemption checkpoint is of the last step
    # the phases are read from separate log lines and tile the fault -> first step interval
    assert all(phases[p] > -0.01 for p in recovery.PHASES), phases
    assert sum(phases[p] for p in recovery.PHASES) == pytest.approx(phases["total"], abs=1e-6)
    assert phases["rendezvous"] > 0 and phases["data+model"] > 0
    assert "sigterm/c10d" in capsys.readouterr().out


def test_plots_of_the_published_results(tmp_path):
    require_modules("matplotlib", install_hint=TEST_EXTRAS)
    written = plot.main(["--results", str(REPO / "docs" / "bench"), "--out", str(tmp_path)])
    assert sorted(p.name for p in written) == sorted(f"bench-{n.replace('_', '-')}.png"
                                                     for n in plot.PLOTS)
    for png in written:
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000


@pytest.mark.slow
def test_metrics_overhead_smoke(tmp_path):
    # one run of the "on" variant (the endpoint scraped) and the in-process costs; the paired
    # loop in main() only repeats these
    run = metrics_overhead.run_once("on", 25, 0.5, tmp_path)
    assert run["steps_per_s"] > 0 and run["scrapes"] > 0
    micro = metrics_overhead.micro()
    assert micro["record_us_per_step"] > 0 and micro["scrape_ms_per_rank"] > 0


@pytest.mark.slow
def test_overhead_smoke(tmp_path, capsys):
    """One task (both loops, one pair): the second task's runs are the same code with another
    config, whose arguments test_overhead_runs_the_same_task_in_both_loops checks."""
    summary = overhead.main(["--steps", "20", "--repeats", "1", "--variants", "runner",
                             "--tasks", "digits", "--json", str(tmp_path / "o.json")])
    assert set(summary["tasks"]) == {"digits"}
    (repeat,) = summary["tasks"]["digits"]["repeats"]
    assert set(repeat) == {"bare", "runner"} and min(repeat.values()) > 0
    runner = summary["tasks"]["digits"]["variants"]["runner"]
    assert runner["ratio"]["median"] == repeat["runner"] / repeat["bare"]
    assert runner["overhead_ms"]["median"] == pytest.approx(
        1000 * (1 / repeat["runner"] - 1 / repeat["bare"]))
    # the first task's figures stay at the top level, where bench.plot reads them
    assert summary["variants"] == summary["tasks"]["digits"]["variants"]
    out = capsys.readouterr().out
    assert "digits:" in out and "overhead ms/step" in out
    assert (tmp_path / "o.json").is_file()


def test_overhead_pairs_and_rotation():
    repeats = [{"bare": 100.0, "runner": 80.0}, {"runner": 50.0, "bare": 50.0}]
    summary = overhead.summarize(repeats, ["bare", "runner"])
    assert summary["bare"]["ratio"] == {"median": 1.0, "min": 1.0, "max": 1.0}
    assert summary["runner"]["ratio"] == {"median": 0.9, "min": 0.8, "max": 1.0}
    # 1/80 - 1/100 s = 2.5 ms per step; the second pair adds nothing
    assert summary["runner"]["overhead_ms"]["max"] == pytest.approx(2.5)
    assert summary["runner"]["overhead_ms"]["min"] == pytest.approx(0.0)


def test_overhead_runs_the_same_task_in_both_loops(tmp_path):
    for task, config in (("digits", "configs/digits.yaml"), ("char_lm", "configs/char_lm.yaml")):
        bare = overhead.argv_for("bare", task, 30, 20, tmp_path)
        runner = overhead.argv_for("runner", task, 30, 20, tmp_path)
        assert config in bare and config in runner
        assert "batch.grad_accum_steps=1" in bare and "batch.grad_accum_steps=1" in runner
        assert "training.max_steps=30" in runner and bare[-2:] == ["--steps", "30"]


@pytest.mark.parametrize("config", ["configs/digits.yaml", "configs/char_lm.yaml"])
def test_bare_loop_steps_the_runners_lr_schedule(config):
    # recipe equality: the bare loop's LambdaLR factor is the runner's (the schedule runs over
    # --steps, which bench.overhead also passes to the runner as training.max_steps)
    from bench import bare_ddp
    from elastic_runner.config import load_config
    from elastic_runner.trainer.loop import lr_factor

    cfg = load_config(REPO / config, [])
    s, total = cfg.schedule, 300
    factor = bare_ddp.lr_lambda(cfg, total)
    for step in (0, 1, s.warmup_steps - 1, s.warmup_steps, 150, total - 1, total, total + 5):
        assert factor(step) == lr_factor(step, s.warmup_steps, total, s.min_lr_ratio,
                                         cosine=s.name == "cosine")


def test_profile_step_smoke():
    """bench.profile_step pairs blocks of both loops in one process and reports the runner's
    extra time per step."""
    from bench import profile_step

    out = profile_step.main(["--tasks", "digits", "--steps", "5", "--repeats", "2"])["digits"]
    assert len(out["us_per_step"]["runner"]) == len(out["us_per_step"]["bare"]) == 2
    assert out["bare_us"] > 0 and out["runner_us"] > 0
    assert out["extra_us"]["min"] <= out["extra_us"]["median"] <= out["extra_us"]["max"]
