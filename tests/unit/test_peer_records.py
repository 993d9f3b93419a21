"""p2p.peer_records: when a refused peer record is named, and the periodic re-issue."""

from __future__ import annotations

import pytest
import trio
import trio.testing

from p2p.errors import ConfigError
from p2p.host import HostConfig
from p2p.peer_records import MAX_REMEMBERED, RecordConflicts, refresh_every

A = {"/ip4/10.0.0.1/tcp/4001"}
B = {"/ip4/10.0.0.2/tcp/4001"}


def test_a_refused_record_with_the_same_addresses_is_not_a_conflict() -> None:
    c = RecordConflicts(interval_s=600)
    assert not c.refused("p", A, set(A), now=0.0)
    assert c.conflicts == 0


def test_a_conflict_is_named_once_per_interval_per_peer() -> None:
    c = RecordConflicts(interval_s=600)
    assert c.refused("p", A, B, now=0.0)
    assert not c.refused("p", A, B, now=599.0)
    assert c.refused("q", A, B, now=599.0)  # another PeerID is named at once
    assert c.refused("p", B, A, now=600.0)
    assert c.conflicts == 4  # every conflict is counted, logged or not


def test_the_remembered_peers_are_bounded() -> None:
    c = RecordConflicts(interval_s=600)
    for i in range(3 * MAX_REMEMBERED):
        assert c.refused(f"p{i}", A, B, now=float(i))
    assert len(c._logged) <= MAX_REMEMBERED
    assert not c.refused(f"p{3 * MAX_REMEMBERED - 1}", A, B, now=3.0 * MAX_REMEMBERED)


async def test_the_record_is_reissued_every_interval(
    autojump_clock: trio.testing.MockClock,
) -> None:
    calls: list[float] = []
    with trio.move_on_after(95):
        await refresh_every(30.0, lambda: calls.append(trio.current_time()))
    assert calls == [30.0, 60.0, 90.0]


def test_refresh_every_refuses_a_non_positive_interval() -> None:
    with pytest.raises(ValueError, match="interval_s"):
        trio.run(refresh_every, 0.0, lambda: None)
    with pytest.raises(ConfigError, match="record_refresh_s"):
        HostConfig(record_refresh_s=0)
