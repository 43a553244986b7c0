"""Smoke test of the rendezvous benchmark at its smallest size (no timing asserts)."""

import json
import shutil

import pytest

from bench import rendezvous

from .needs import debian, in_ci, require_command


@pytest.mark.slow
def test_rendezvous_smoke(tmp_path, capsys):
    if in_ci():  # elsewhere the benchmark skips etcd-v2 without etcd and so does this test
        require_command("etcd", debian("etcd-server"))
    out = tmp_path / "r.json"
    result = rendezvous.main(["--agents", "1", "2", "--backends", "c10d", "etcd-v2",
                              "--repeats", "1", "--json", str(out)])
    expected = ["c10d", "etcd-v2"] if shutil.which("etcd") else ["c10d"]
    assert list(result["backends"]) == expected and result["unit"] == "s"
    assert ("etcd-v2" in result["skipped"]) == (shutil.which("etcd") is None)
    assert [(t["backend"], t["agents"]) for t in result["trials"]] == \
        [(b, n) for b in expected for n in (1, 2)]
    for trial in result["trials"]:
        ranks = sorted(a["rank"] for a in trial["per_agent"])
        assert ranks == list(range(trial["agents"]))
        assert all(a["seconds"] > 0 for a in trial["per_agent"])
        assert trial["seconds"] == max(a["seconds"] for a in trial["per_agent"])
    cells = result["backends"]
    assert all(list(cells[b]) == ["1", "2"] for b in expected)
    assert all(c["seconds"]["min"] > 0 for b in expected for c in cells[b].values())
    assert cells["c10d"]["1"]["vs_1_agent"]["of_medians"] == 1.0
    assert cells["c10d"]["2"]["vs_c10d"] is None
    if "etcd-v2" in expected:
        assert cells["etcd-v2"]["2"]["vs_c10d"]["of_medians"] > 0
    assert json.loads(out.read_text()) == result
    printed = capsys.readouterr().out
    assert "rdzv s" in printed and "etcd-v2" in printed  # a row, or the note that it was skipped


def test_rendezvous_rejects_a_bad_group():
    good = [{"rank": 1, "world_size": 2}, {"rank": 0, "world_size": 2}]
    rendezvous.check_group(good, 2)
    with pytest.raises(RuntimeError, match="ranks"):
        rendezvous.check_group([{"rank": 0, "world_size": 2}, {"rank": 0, "world_size": 2}], 2)
    with pytest.raises(RuntimeError, match="world sizes"):
        rendezvous.check_group([{"rank": 0, "world_size": 1}, {"rank": 1, "world_size": 2}], 2)
