"""What a download asks of discovered peers (pure, :class:`shardcast.core.session.Session`):
manifest parts only if the upstreams do not give them (:meth:`Session.part_asks`), and
``/have`` long-polls spaced out while a peer reports nothing this node lacks
(:meth:`Session.have_gap_s`)."""

from __future__ import annotations

import random

from shardcast.core.session import (
    PEER_HAVE_GAP_MAX_S,
    PEER_HAVE_GAP_S,
    Offer,
    Session,
    SessionConfig,
)

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


def test_a_peer_reporting_only_what_this_node_holds_is_followed_less_and_less_often() -> None:
    """Answers naming shards 0 and 1 (verified here) or a prefix this node passed double the
    gap from PEER_HAVE_GAP_S up to PEER_HAVE_GAP_MAX_S; an upstream is never spaced out."""
    s = _session()
    s.add_source("relay", False, 0.0)
    s.add_source("peer", False, 0.0, extra=True)
    assert s.have_gap_s("peer") == 0.0  # no answer yet
    s.have_changed("peer", [0], 0.1)
    assert s.have_gap_s("peer") == PEER_HAVE_GAP_S
    s.have_changed("peer", [0, 1], 0.2)
    assert s.have_gap_s("peer") == 2 * PEER_HAVE_GAP_S
    gaps = []
    for t in range(8):
        s.have_changed("peer", [0, 1], 0.3 + t)  # the same answer: still nothing new
        gaps.append(s.have_gap_s("peer"))
    assert gaps == sorted(gaps)
    assert gaps[-1] == PEER_HAVE_GAP_MAX_S
    s.have_changed("relay", [0], 0.3)
    s.have_changed("relay", [0, 1], 0.4)
    assert s.have_gap_s("relay") == 0.0


def test_a_peer_that_has_what_this_node_lacks_is_followed_at_once_again() -> None:
    """A shard this node lacks, or a prefix of one that the peer could not serve from this
    node's byte before, is news: the gap drops to 0. A prefix reported again, or grown where
    the peer already served (a held range request follows it), is not."""
    s = _session(n=5)
    s.add_source("peer", False, 0.0, extra=True)
    s.have_changed("peer", [0, 1], 0.1)
    assert s.have_gap_s("peer") == PEER_HAVE_GAP_S
    s.have_changed("peer", [0, 1, 2], 0.2)  # shard 2: not held here
    assert s.have_gap_s("peer") == 0.0
    s.have_changed("peer", [0, 1, 2], 0.3)
    assert s.have_gap_s("peer") == PEER_HAVE_GAP_S
    s.have_changed("peer", [0, 1, 2], 0.4, {3: 4})  # a verified prefix of shard 3
    assert s.have_gap_s("peer") == 0.0
    s.have_changed("peer", [0, 1, 2], 0.5, {3: 4})  # the same prefix again
    assert s.have_gap_s("peer") == PEER_HAVE_GAP_S
    s.have_changed("peer", [0, 1, 2], 0.6, {3: 6})  # grown: it served byte 0 on already
    assert s.have_gap_s("peer") == 2 * PEER_HAVE_GAP_S
    s.have_changed("peer", [0, 1, 2], 0.7, {3: 6, 4: 2})  # a shard it just started
    assert s.have_gap_s("peer") == 0.0


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
