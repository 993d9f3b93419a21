"""Pure decisions of the trainer's wait for rollouts (trainer.readiness)."""

from __future__ import annotations

import pytest

from trainer.readiness import (
    Every,
    StepReadiness,
    StepSnapshot,
    decide,
    known_peers,
    need_batches,
)


def snap(have: int, need: int, known: set[str], delivered: set[str], waited: float) -> StepSnapshot:
    return StepSnapshot(have, need, frozenset(known), frozenset(delivered), waited, 300.0)


def test_need_batches_explicit_wins_else_one_per_known_peer() -> None:
    assert need_batches(3, 1) == 3
    assert need_batches(None, 0) == 1
    assert need_batches(None, 1) == 1
    assert need_batches(None, 4) == 4


def test_enough_batches() -> None:
    assert decide(snap(2, 2, {"a", "b"}, {"a"}, 1.0)) is StepReadiness.ENOUGH_BATCHES


def test_single_peer_delivered_does_not_wait_for_explicit_min_batches() -> None:
    # min_batches=2 set explicitly, one peer in the run: ready once it delivered
    assert decide(snap(1, 2, {"a"}, {"a"}, 0.5)) is StepReadiness.ALL_PEERS_DELIVERED


def test_waits_while_a_known_peer_has_not_delivered() -> None:
    assert decide(snap(1, 3, {"a", "b"}, {"a"}, 10.0)) is StepReadiness.WAIT


def test_no_known_peer_and_no_batch_waits_until_timeout() -> None:
    assert decide(snap(0, 1, set(), set(), 299.9)) is StepReadiness.WAIT
    assert decide(snap(0, 1, set(), set(), 300.0)) is StepReadiness.TIMEOUT


def test_a_peer_whose_batch_was_rejected_has_answered() -> None:
    # the run's only peer had its batch rejected: no batch will come for this step, so the
    # trainer goes on at once instead of sitting out the step timeout
    only = StepSnapshot(0, 1, frozenset({"a"}), frozenset(), 1.0, 300.0, frozenset({"a"}))
    assert decide(only) is StepReadiness.ALL_PEERS_ANSWERED
    # two peers: one delivered, one rejected -> ready; one still silent -> wait
    both = StepSnapshot(1, 2, frozenset({"a", "b"}), frozenset({"a"}), 1.0, 300.0, frozenset({"b"}))
    assert decide(both) is StepReadiness.ALL_PEERS_ANSWERED
    some = StepSnapshot(
        1, 3, frozenset({"a", "b", "c"}), frozenset({"a"}), 1.0, 300.0, frozenset({"b"})
    )
    assert decide(some) is StepReadiness.WAIT
    # a rejection from a peer the run does not count on changes nothing
    other = StepSnapshot(0, 1, frozenset({"a"}), frozenset(), 1.0, 300.0, frozenset({"x"}))
    assert decide(other) is StepReadiness.WAIT


def test_delivery_from_unknown_peer_counts_as_batches_only() -> None:
    assert decide(snap(1, 2, {"a"}, {"x"}, 1.0)) is StepReadiness.WAIT
    assert decide(snap(2, 2, {"a"}, {"x"}, 1.0)) is StepReadiness.ENOUGH_BATCHES


def test_known_peers_drop_silent_and_disallowed() -> None:
    joined = {"a": 0.0, "b": 0.0, "c": 50.0}
    seen = {"a": 95.0, "b": 10.0}
    assert known_peers(joined, seen, 100.0, 60.0) == {"a", "c"}
    assert known_peers(joined, seen, 100.0, 60.0, allowed={"c"}) == {"c"}
    assert known_peers({}, {}, 0.0, 60.0) == frozenset()


def test_every_spaces_lines() -> None:
    e = Every(5.0, start=100.0)
    assert not e.due(100.0)
    assert e.wait_s(100.0) == 5.0
    assert e.due(105.0)
    assert not e.due(106.0)
    assert e.wait_s(106.0) == 4.0
    assert e.due(121.0)  # late: one line, then back on the 5 s grid
    assert e.wait_s(121.0) == 4.0
    with pytest.raises(ValueError, match="interval_s"):
        Every(0.0, 0.0)
