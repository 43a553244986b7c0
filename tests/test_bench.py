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
def test_metrics_overhead_smoke(tmp_path):
    # one run of the "on" variant (the endpoint scraped) and the in-process costs; the paired
    # loop in main() only repeats these
    run = metrics_overhead.run_once("on", 25, 0.5, tmp_path)
    assert run["steps_per_s"] > 0 and run["scrapes"] > 0
    micro = metrics_overhead.micro()
    assert micro["record_us_per_step"] > 0 and micro["scrape_ms_per_rank"] > 0
