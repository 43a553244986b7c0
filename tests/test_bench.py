"""Smoke test: the benchmarks run at their smallest size and report ratios (no timing asserts)."""

import pytest

from bench import checkpoint_stall, metrics_overhead, recovery


def test_checkpoint_stall_smoke(tmp_path, capsys):
    (row,) = checkpoint_stall.main(["--sizes-mb", "4", "--repeats", "1", "--dir", str(tmp_path),
                                    "--json", str(tmp_path / "out.json")])
    assert row["size_mb"] == 4 and row["sync_s"] > 0 and row["async_stall_s"] > 0
    assert "async stall" in capsys.readouterr().out and (tmp_path / "out.json").is_file()


@pytest.mark.slow
def test_recovery_smoke(capsys):
    results = recovery.main(["--repeats", "1", "--scenarios", "sigterm"])
    (run,) = results["sigterm"]
    assert run["recovery_s"] > 0 and run["steps_redone"] == 0  # preemption loses no step
    assert "recovery s" in capsys.readouterr().out


@pytest.mark.slow
def test_metrics_overhead_smoke(capsys):
    summary = metrics_overhead.main(["--steps", "30", "--repeats", "1"])
    (pair,) = summary["pairs"]
    assert pair["off_steps_per_s"] > 0 and pair["on_steps_per_s"] > 0 and pair["scrapes"] > 0
    assert summary["record_us_per_step"] > 0 and summary["scrape_ms_per_rank"] > 0
    assert "metrics on / off steps/s" in capsys.readouterr().out
