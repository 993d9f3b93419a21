"""shardnet.progress: finished versions leave the display; off a terminal, periodic lines."""

from __future__ import annotations

import logging

import pytest

from shardnet.progress import DownloadProgress


def test_live_display_drops_finished_versions() -> None:
    with DownloadProgress(force=True) as p:
        for step in range(40):  # more versions than a terminal has lines
            p(step, 10, 100)
            p(step, 100, 100)
        p(40, 5, 100)
        assert p._progress is not None
        assert [t.fields["step"] for t in p._progress.tasks] == [40]


def test_periodic_log_lines_off_a_terminal(caplog: pytest.LogCaptureFixture) -> None:
    now = [0.0]
    p = DownloadProgress(log_interval_s=10.0, clock=lambda: now[0])
    p.live = False
    p._progress = None
    caplog.set_level(logging.INFO, logger="shardnet.progress")
    for t, done in ((0.0, 0), (5.0, 50), (10.0, 100), (15.0, 150), (20.0, 200), (21.0, 400)):
        now[0] = t
        p(7, done, 400)
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2  # at 10 s and 20 s; nothing for the finished version
    assert lines[0].startswith("download_progress step=7 percent=25.0 verified_bytes=100")
    assert "rate_bytes_per_s=10 eta_s=30.0" in lines[0]
