"""Simulation progress: log lines off a terminal, a live line on one, fed by the model's state."""

from __future__ import annotations

import io
import logging

import pytest
from rich.console import Console

from simulations.model import Model
from simulations.progress import SimProgress, Snapshot
from simulations.topology import parse
from tests.sim.test_model import _small


class _Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_log_lines_off_a_terminal_at_the_interval(caplog: pytest.LogCaptureFixture) -> None:
    clock = _Clock()
    prog = SimProgress("model", force_live=False, log_interval_s=10.0, clock=clock)
    snap = Snapshot(sim_s=42.5, published=2, versions=3, latest_step=1, peers_at_latest=4, peers=6)
    with caplog.at_level(logging.INFO, "simulations.progress"), prog:
        assert not prog.due()
        clock.t += 9.9
        assert not prog.due()
        clock.t += 0.1
        assert prog.due()
        prog.update(snap)
        assert not prog.due()
    (rec,) = caplog.records
    assert rec.getMessage() == (
        "simulate_progress mode=model sim_s=42.5 versions_published=2 versions=3 latest_step=1 "
        "peers_committed_latest=4 peers=6 wall_s=10.0"
    )


def test_live_line_on_a_terminal_is_one_line_and_removed() -> None:
    clock = _Clock()
    buf = io.StringIO()
    console = Console(file=buf, force_terminal=True, width=80)
    prog = SimProgress("emulate", force_live=True, refresh_s=0.25, clock=clock, console=console)
    with prog:
        clock.t += 3.0
        prog.update(Snapshot(12.0, 1, 2, 0, 1, 2))
    out = buf.getvalue()
    assert "emulate: elapsed 12.0 s · published 1/2 · peers at step 0: 1/2 · wall 3.0 s" in out
    assert prog.period_s == 0.25


def test_model_feeds_progress_with_its_state() -> None:
    clock = _Clock()
    prog = SimProgress("model", force_live=False, log_interval_s=0.0, clock=clock)
    m = Model(
        parse(
            _small(
                checkpoint={
                    "size_bytes": 64 << 20,
                    "shard_size_bytes": 4 << 20,
                    "versions": 2,
                    "interval_s": 5,
                }
            )
        )
    )
    m.run(prog)
    assert prog.updates > 0
    end = m.snapshot()
    assert (end.published, end.versions, end.latest_step) == (2, 2, 1)
    assert end.peers_at_latest == end.peers == 6
    assert end.sim_s > 5.0
