"""Smoke test: the benchmarks run at their smallest size and report ratios (no timing asserts)."""

import pytest

from bench import checkpoint_stall, recovery


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
