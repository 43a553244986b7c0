"""Smoke test: the benchmarks run at their smallest size and report ratios (no timing asserts)."""

from bench import checkpoint_stall


def test_checkpoint_stall_smoke(tmp_path, capsys):
    (row,) = checkpoint_stall.main(["--sizes-mb", "4", "--repeats", "1", "--dir", str(tmp_path),
                                    "--json", str(tmp_path / "out.json")])
    assert row["size_mb"] == 4 and row["sync_s"] > 0 and row["async_stall_s"] > 0
    assert "async stall" in capsys.readouterr().out and (tmp_path / "out.json").is_file()
