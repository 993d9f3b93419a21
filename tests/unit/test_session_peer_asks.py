"""What a download asks of discovered peers (pure, :class:`shardcast.core.session.Session`):
manifest parts only if the upstreams do not give them (:meth:`Session.part_asks`), or at once
after a peer gave one (:meth:`Session.part_given`)."""

from __future__ import annotations

import random

from shardcast.core.session import Offer, Session, SessionConfig

SHARD = 8


def _session(n: int = 4, held: tuple[int, ...] = (0, 1)) -> Session:
    """``n`` shards of ``SHARD`` bytes in one part, ``held`` verified already."""
    offers = [Offer(i, SHARD) for i in range(n)]
    return Session(3, [SHARD] * n, 1, [0], offers, held, random.Random(1), SessionConfig(), 0.0)


def test_upstreams_are_asked_for_a_part_first_and_discovered_peers_only_after() -> None:
    s = _session()
    s.add_source("relay-a", False, 0.0)
    s.add_source("peer-x", False, 0.0, extra=True)
    s.add_source("relay-b", False, 0.0)
    s.add_source("peer-y", False, 0.0, extra=True)
    order = ["peer-x", "relay-a", "peer-y", "relay-b"]
    assert s.part_asks(order) == (["relay-a", "relay-b"], ["peer-x", "peer-y"])
    assert s.part_asks(iter(order)) == (["relay-a", "relay-b"], ["peer-x", "peer-y"])


def test_with_no_upstream_left_every_peer_is_asked_for_a_part_at_once() -> None:
    s = _session()
    s.add_source("peer-x", False, 0.0, extra=True)
    s.add_source("peer-y", False, 0.0, extra=True)
    assert s.part_asks(["peer-x", "peer-y"]) == (["peer-x", "peer-y"], [])
    assert s.part_asks([]) == ([], [])


def test_once_a_peer_gave_a_part_every_source_is_asked_at_once() -> None:
    """An upstream that lags behind the peers costs the wait for one round of parts: after
    a discovered peer gave one, parts are asked of everyone at once. A part given by an
    upstream changes nothing."""
    s = _session()
    s.add_source("relay", False, 0.0)
    s.add_source("peer", False, 0.0, extra=True)
    s.part_given("relay")
    assert s.part_asks(["relay", "peer"]) == (["relay"], ["peer"])
    s.part_given("peer")
    assert s.part_asks(["peer", "relay"]) == (["relay", "peer"], [])
