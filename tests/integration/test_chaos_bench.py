"""Smoke test of bench/chaos.py: the quick clean and malformed scenarios on real processes.

It starts (through the bench) an origin, 2 relays and 2 followers on 127.0.0.1 per scenario
and stops them all; it checks the report's shape and that no node crashed, not the timings
(the machine may be shared).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_chaos_quick_clean_and_malformed(tmp_path: Path) -> None:
    out = subprocess.run(
        [
            sys.executable,
            str(REPO / "bench" / "chaos.py"),
            "--quick",
            "--json",
            "--scenarios",
            "clean,malformed",
            "--workdir",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    assert out.returncode == 0, out.stderr[-3000:]
    report = json.loads(out.stdout)
    assert report["clean_s"] is not None
    assert report["clean_s"] > 0
    assert [r["scenario"] for r in report["scenarios"]] == ["clean", "malformed"]
    for r in report["scenarios"]:
        assert "error" not in r, r.get("error")
        assert r["crashed"] == [], r
        assert set(r["targets"]) >= {"no_crash", "time", "rss"}
        assert isinstance(r["meets_targets"], bool)
        assert r["last_follower_commit_s"] is not None
        assert set(r["nodes"]) == {"origin", "relay1", "relay2", "follower1", "follower2"}
        for node in r["nodes"].values():
            assert node["alive"]
            assert node["exit_code"] == 0
    malformed = report["scenarios"][1]
    assert malformed["frames_sent"] == 30  # 5 kinds x 2 protocols x 3 roles
    assert "time_bound_s" in malformed
