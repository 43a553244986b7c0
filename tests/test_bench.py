"""Smoke test: the benchmarks run at their smallest size and report ratios (no timing asserts)."""

import pytest

from bench import checkpoint_stall, metrics_overhead, overhead, plot, recovery
from bench.common import REPO


def test_checkpoint_stall_smoke(tmp_path, capsys):
    (row,) = checkpoint_stall.main(["--sizes-mb", "4", "--repeats", "1", "--dir", str(tmp_path),
                                    "--json", str(tmp_path / "out.json")])
    assert row["size_mb"] == 4 and row["sync_s"] > 0 and row["async_stall_s"] > 0
    assert "async stall" in capsys.readouterr().out and (tmp_path / "out.json").is_file()


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
    pytest.importorskip("matplotlib")
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
    summary = overhead.main(["--steps", "30", "--repeats", "1", "--variants", "runner",
                             "--json", str(tmp_path / "o.json")])
    (repeat,) = summary["repeats"]
    assert set(repeat) == {"bare", "runner"} and min(repeat.values()) > 0
    assert summary["variants"]["runner"]["ratio"]["median"] == repeat["runner"] / repeat["bare"]
    assert "runner" in capsys.readouterr().out and (tmp_path / "o.json").is_file()
