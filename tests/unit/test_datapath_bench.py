"""``bench/datapath.py``: every receiver (old, new, clone, floor) receives and verifies a small
checkpoint end to end, the report has a row for each, and nothing is left on disk."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "bench" / "datapath.py"
STAGES = {"receive", "hash", "write", "commit", "total"}


def test_every_receiver_runs_and_the_floor_is_reported(tmp_path: Path) -> None:
    out = tmp_path / "out.json"
    work = tmp_path / "work"
    work.mkdir()
    run = subprocess.run(
        [sys.executable, str(BENCH), "--size-mib", "8", "--dir", str(work), "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0, run.stderr
    rows = {tuple(line.split()[:2]) for line in run.stdout.splitlines() if line.strip()}
    for row in (("full", "old"), ("full", "new"), ("full", "floor"), ("next", "clone")):
        assert row in rows, run.stdout
    results = json.loads(out.read_text())
    floor = results["runs"][0]["floor"]["full"]["cpu_s_per_gb"]
    assert STAGES <= set(floor)
    assert floor["total"] > 0
    assert floor["total"] >= floor["receive"]
    assert "floor" in results["median"]["full"]
    assert list(work.iterdir()) == []  # the checkpoint, the stores and the floor's files


def test_a_bad_size_is_one_line_and_exit_2(tmp_path: Path) -> None:
    run = subprocess.run(
        [sys.executable, str(BENCH), "--size-mib", "0", "--dir", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert run.returncode == 2
    assert run.stderr.strip().splitlines() == ["datapath: --size-mib must be in [1, 1024]"]
