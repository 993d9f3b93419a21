"""The stream lane's pure parts: its URLs, which lane reaches an advertiser
(:func:`shardcast.core.choose_lane`), what a node behind a NAT advertises, and which sources
discovery offers to whom."""

from __future__ import annotations

import random

import pytest

from p2p import wire
from p2p.bytestream import stream_lane_peer, stream_lane_url
from p2p.errors import LocalProtocolError, RemoteProtocolError
from p2p.http_checks import parse_target
from p2p.identity import Identity
from shardcast.core import Lane, LaneCheck, choose_lane
from shardcast.core.reachability import DialbackResult, Reach, Reachability, ReachabilityConfig
from shardcast.download.discovery import NodeAdvert, SourceDirectory

NAT = Identity.from_seed("nated-peer").peer_id
PUB = Identity.from_seed("public-peer").peer_id


def test_stream_lane_urls_name_the_peer_id() -> None:
    base = stream_lane_url(NAT)
    assert base == f"p2p://{NAT}"
    assert stream_lane_peer(base + "/shardnet/v1/run/1/x/have?prefix=1") == NAT
    assert stream_lane_peer("http://127.0.0.1:80/x") is None
    assert stream_lane_peer("p2p://not-base58!/x") is None
    with pytest.raises(ValueError, match="base58"):
        stream_lane_url("0OIl")


def test_parse_target_splits_stream_urls_with_their_case() -> None:
    t = parse_target(stream_lane_url(NAT) + "/shardnet/v1/r/versions?x=1")
    assert t == (f"p2p://{NAT}", (NAT, 0), "/shardnet/v1/r/versions?x=1", NAT, NAT)
    assert parse_target(stream_lane_url(NAT)).target == "/"
    assert parse_target("http://127.0.0.1:9/a").stream_peer == ""
    with pytest.raises(LocalProtocolError):
        parse_target(f"p2p://{NAT}:80/a")  # no port: the PeerID is the whole authority


@pytest.mark.parametrize(
    ("http_url", "proven", "stream", "connected", "want"),
    [
        ("http://1.2.3.4:8003", True, False, False, Lane.HTTP),
        ("http://1.2.3.4:8003", True, True, True, Lane.HTTP),  # TCP first: zero-copy
        ("http://1.2.3.4:8003", False, False, True, Lane.NONE),  # unproven, no stream lane
        ("http://1.2.3.4:8003", False, True, True, Lane.STREAM),
        ("", False, True, True, Lane.STREAM),
        ("", False, True, False, Lane.NONE),  # no connection: the stream lane never dials
        ("", True, False, True, Lane.NONE),  # download-only
    ],
)
def test_choose_lane(
    http_url: str, proven: bool, stream: bool, connected: bool, want: Lane
) -> None:
    got = choose_lane(
        http_url=http_url, http_proven=proven, stream_lane=stream, connected=connected
    )
    assert got is want


def test_an_unreachable_node_advertises_its_stream_lane() -> None:
    r = Reachability("http://192.168.77.2:8003")
    assert not r.advertises_stream()  # before any round: nothing
    r.observe([DialbackResult.NOT_REACHED], 0.0)
    assert (r.state, r.advertised(), r.advertises_stream()) == (Reach.UNREACHABLE, "", True)
    assert r.status(str)["stream_lane"] is True
    r.observe([DialbackResult.REACHED], 700.0)  # port forwarded later: plain HTTP again
    assert (r.advertised(), r.advertises_stream()) == ("http://192.168.77.2:8003", False)


def test_a_node_set_not_to_serve_behind_nat_offers_no_stream_lane() -> None:
    r = Reachability("http://192.168.77.2:8003", ReachabilityConfig(serve_behind_nat=False))
    r.observe([DialbackResult.NOT_REACHED], 0.0)
    assert (r.state, r.advertised(), r.advertises_stream()) == (Reach.UNREACHABLE, "", False)
    assert r.status(str)["stream_lane"] is False


def test_the_advert_carries_stream_lane_and_older_adverts_lack_it() -> None:
    a = NodeAdvert.of(NAT, "peer", "", [(1, "ab" * 32)], [], tier=2, stream_lane=True)
    back = NodeAdvert.decode(a.encode(), NAT)
    assert back == a
    assert back.stream_lane
    old = NodeAdvert.of(NAT, "peer", "", [(1, "ab" * 32)], [])
    assert b"stream_lane" not in old.encode()
    assert not NodeAdvert.decode(old.encode(), NAT).stream_lane


def test_a_stream_lane_that_is_not_a_boolean_is_refused() -> None:
    bad = wire.encode(
        {
            "v": 1,
            "peer_id": NAT,
            "role": "peer",
            "http_url": "",
            "committed": [],
            "filling": [],
            "stream_lane": 1,
        }
    )
    with pytest.raises(RemoteProtocolError, match="stream_lane"):
        NodeAdvert.decode(bad, NAT)


def test_discovery_offers_a_stream_lane_only_to_connected_followers() -> None:
    d = SourceDirectory(
        "me", set(), ttl_s=10.0, max_entries=10, rng=random.Random(0), require_verified=True
    )
    d.offer(NodeAdvert(NAT, "peer", "", (1,), (), stream_lane=True), 0.0)
    d.offer(NodeAdvert(PUB, "peer", "http://8.8.8.8:8003", (1,), (), stream_lane=True), 0.0)
    assert d.to_verify(0.0) == [d.entries(0.0)[1][0]]  # only the URL is challenged
    assert d.sources_for(1, 1.0, 10) == []  # not connected, nothing proven
    got = d.sources_for(1, 1.0, 10, connected=frozenset({NAT, PUB}))
    assert sorted((s.id, s.base_url) for s in got) == sorted(
        [(NAT, f"p2p://{NAT}"), (PUB, f"p2p://{PUB}")]
    )
    d.verified(PUB, "http://8.8.8.8:8003", LaneCheck.VERIFIED, 2.0)
    got = d.sources_for(1, 2.0, 10, connected=frozenset({NAT, PUB}))
    assert {s.id: s.base_url for s in got} == {NAT: f"p2p://{NAT}", PUB: "http://8.8.8.8:8003"}
