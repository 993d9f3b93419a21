"""``p2p.loop_lag``: the loop's lateness is measured per tick and kept out of request-body
deadlines, which still end for a peer that sends nothing."""

from __future__ import annotations

import random
from collections.abc import Hashable

import pytest

from p2p.errors import ConfigError
from p2p.loop_lag import BodyDeadlines, LoopLag


def test_lag_is_how_late_each_wake_up_came() -> None:
    lag = LoopLag(keep=3)
    assert lag.tick(due=1.0, now=1.0) == 0.0
    assert lag.tick(due=1.1, now=1.6) == pytest.approx(0.5)
    assert lag.tick(due=1.7, now=1.65) == 0.0  # early (clock granularity) is not negative
    assert lag.total_s == pytest.approx(0.5)
    assert lag.ticks == 3
    assert lag.worst(now=1.65, window_s=1.0) == pytest.approx(0.5)
    assert lag.worst(now=1.65, window_s=0.04) == 0.0
    for i in range(3):  # only the last `keep` ticks are remembered; the total keeps counting
        lag.tick(due=2.0 + i, now=2.0 + i)
    assert lag.worst(now=10.0, window_s=100.0) == 0.0
    assert lag.total_s == pytest.approx(0.5)


def test_a_silent_peer_is_overdue_after_the_timeout_of_a_punctual_loop() -> None:
    bodies = BodyDeadlines(timeout_s=2.0)
    bodies.begin("s", now=10.0)
    k = 1
    while not bodies.tick(due=10.0 + k / 8, now=10.0 + k / 8):  # eighths: exact in binary
        k += 1
        assert k < 30
    assert 10.0 + k / 8 == 12.0
    assert bodies.own_time("s", now=12.0) == 2.0
    assert len(bodies) == 1  # the caller ends it
    bodies.end("s")
    bodies.end("s")  # twice is harmless
    assert len(bodies) == 0


def test_the_loop_being_late_does_not_count_against_the_peer() -> None:
    bodies = BodyDeadlines(timeout_s=2.0)
    bodies.begin("s", now=10.0)
    assert bodies.tick(due=10.1, now=10.1) == []
    # the loop was blocked for 3 s (the process had no CPU): the next tick comes 3 s late
    assert bodies.tick(due=10.2, now=13.2) == []
    assert bodies.own_time("s", now=13.2) == pytest.approx(0.2)
    # the peer still gets its 2 s of this node's time, no more
    assert bodies.tick(due=14.9, now=14.9) == []
    assert bodies.tick(due=15.0, now=15.0) == ["s"]


def test_lateness_before_a_read_began_is_not_credited_to_it() -> None:
    bodies = BodyDeadlines(timeout_s=2.0)
    # a wake-up due at 10.0 comes at 13.0; the read began at 12.5, while the loop was busy
    bodies.begin("s", now=12.5)
    bodies.tick(due=10.0, now=13.0)
    assert bodies.own_time("s", now=13.0) == 0.0
    assert bodies.tick(due=14.5, now=14.5) == []
    assert bodies.tick(due=15.0, now=15.0) == ["s"]  # 0.5 s of lateness was the read's


def test_a_loop_that_is_always_late_still_frees_the_slot() -> None:
    bodies = BodyDeadlines(timeout_s=2.0, max_factor=5.0)
    bodies.begin("s", now=0.0)
    t, due = 0.0, 0.1
    while True:
        t = due + 0.9  # every wake-up 0.9 s late: own time grows by 0.1 s per second
        if bodies.tick(due=due, now=t):
            break
        due = t + 0.1
    assert t == pytest.approx(10.0, abs=1.0)
    assert bodies.own_time("s", now=t) < 2.0


def test_reads_end_in_order_and_independently() -> None:
    rng = random.Random(3)
    bodies = BodyDeadlines(timeout_s=1.0)
    starts = {f"r{i}": rng.uniform(0, 5) for i in range(20)}
    t = 0.0
    overdue: dict[Hashable, float] = {}
    begun: set[str] = set()
    while len(overdue) < len(starts):
        t = round(t + 0.1, 10)
        for key, s in starts.items():
            if s <= t and key not in begun:
                bodies.begin(key, now=s)
                begun.add(key)
        for done in bodies.tick(due=t, now=t):
            overdue[done] = t
            bodies.end(done)
    for key, s in starts.items():
        assert s + 1.0 <= overdue[key] + 1e-9 < s + 1.2


def test_bad_bounds_are_config_errors() -> None:
    with pytest.raises(ConfigError, match="request_read_timeout_s"):
        BodyDeadlines(timeout_s=0)
    with pytest.raises(ConfigError, match="max_factor"):
        BodyDeadlines(timeout_s=1, max_factor=0.5)
    with pytest.raises(ConfigError, match="keep"):
        LoopLag(keep=0)
