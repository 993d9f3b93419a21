"""The main job, as a user runs it: `shardnet demo` starts and stops real processes."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest


@pytest.mark.slow  # 0.4-2 min of node processes: outside the 15-minute default run
def test_demo_two_steps_end_to_end(tmp_path: Path) -> None:
    report = tmp_path / "r.json"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "shardnet.cli",
            "demo",
            "--steps",
            "2",
            "--report",
            str(report),
            "--workdir",
            str(tmp_path / "w"),
            "--timeout",
            "400",
        ],
        capture_output=True,
        text=True,
        timeout=500,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    r = json.loads(report.read_text())
    assert r["ok"] is True
    assert r["problems"] == []
    assert [s["step"] for s in r["steps"]] == [0, 1, 2]
    for s in r["steps"]:
        assert s["peers_committed"] == ["peer1", "peer2", "peer3"]  # named as in the table
        assert s["broadcast_s"] is not None
    assert [s["kind"] for s in r["steps"]] == ["anchor", "delta", "delta"]
    assert r["trainer"]["trained_samples"] == r["trainer"]["trained_verified_samples"] > 0
    # the JSON's counts are the table's: per-step samples sum to the totals line
    t = r["totals"]
    assert t["samples_trained"] == sum(s["samples_trained"] for s in r["steps"])
    assert t["samples_trained"] == r["trainer"]["trained_samples"]
    assert t["validator_accepted_samples"] >= t["samples_trained"]
    table = proc.stdout
    assert "kind: anchor = a full version" in table
    assert f"samples trained {t['samples_trained']} (validator accepted" in table
    assert set(r["trainer"]["reputation"]["scores"]) <= {"peer1", "peer2", "peer3"}
    # every node process is gone
    ps = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True, check=True)
    assert str(tmp_path / "w") not in ps.stdout
