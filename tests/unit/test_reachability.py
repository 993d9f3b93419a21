"""Advert backoff and drop (SourceDirectory), the dial-back rules and a node's own
reachability state: pure, with the time passed in."""

from __future__ import annotations

import ipaddress
import random

import cbor2
import pytest

from p2p.errors import ConfigError, RemoteProtocolError
from shardcast.core.reachability import (
    DialbackAnswer,
    DialbackLimiter,
    DialbackLimits,
    DialbackRequest,
    DialbackResult,
    Interface,
    LaneCheck,
    Reach,
    Reachability,
    ReachabilityConfig,
    judge_request,
    lan_asker,
    lane_in_scope,
    parse_networks,
    scoped_lane,
    verdict,
)
from shardcast.download.discovery import LaneBackoff, NodeAdvert, SourceDirectory

URL = "http://10.78.0.2:8003"
NONCE = "0123456789abcdef" * 2
R = DialbackResult


def directory() -> SourceDirectory:
    return SourceDirectory(
        "me", set(), ttl_s=10.0, max_entries=100, rng=random.Random(0), require_verified=True
    )


def challenges(d: SourceDirectory, until_s: float, result: LaneCheck) -> list[float]:
    """Drive the directory second by second as the follower does (the advert is re-heard
    every 2 s); the times of the challenges it asked for."""
    out = []
    t = 0.0
    while t <= until_s:
        if t % 2 == 0:
            d.offer(NodeAdvert("nat", "peer", URL, (1,), ()), t)
        for a in d.to_verify(t):
            out.append(t)
            d.verified(a.peer_id, a.http_url, result, t)
        t += 1.0
    return out


def test_an_unreachable_advert_is_tried_at_most_three_times_an_hour_then_dropped() -> None:
    d = directory()
    times = challenges(d, 6 * 3600.0, LaneCheck.UNREACHABLE)
    first = times[0]
    assert first == 0.0
    for start in times:  # any hour from a failure on holds at most three more attempts
        assert len([t for t in times if start < t <= start + 3600]) <= 3
    assert times == [0.0, 60.0, 300.0, 1260.0]  # 60 s, then 4x longer; dropped after four
    lane = d.lane_status("nat", URL)
    assert lane is not None
    assert lane.result is LaneCheck.UNREACHABLE
    assert lane.dropped(d.backoff)
    assert lane.next_at == 1260.0 + LaneBackoff().drop_s


def test_a_dropped_url_starts_over_after_drop_s_and_success_resets() -> None:
    d = directory()
    b = d.backoff
    for t in (0.0, 60.0, 300.0, 1260.0):
        d.offer(NodeAdvert("x", "peer", URL, (1,), ()), t)
        assert [a.peer_id for a in d.to_verify(t)] == ["x"]
        lane = d.verified("x", URL, LaneCheck.BAD_ANSWER, t)
    assert lane.failures == b.max_failures
    later = 1260.0 + b.drop_s
    d.offer(NodeAdvert("x", "peer", URL, (1,), ()), later - 1)
    assert d.to_verify(later - 1) == []
    assert [a.peer_id for a in d.to_verify(later)] == ["x"]
    lane = d.verified("x", URL, LaneCheck.UNREACHABLE, later)
    assert (lane.failures, lane.next_at) == (1, later + b.first_s)
    lane = d.verified("x", URL, LaneCheck.VERIFIED, later + 60)
    assert (lane.failures, lane.result) == (0, LaneCheck.VERIFIED)
    d.offer(NodeAdvert("x", "peer", URL, (1,), ()), later + 60)
    assert [s.id for s in d.sources_for(1, later + 60, 4)] == ["x"]
    d.verified("x", URL, LaneCheck.UNREACHABLE, later + 61)  # it stopped answering
    assert d.sources_for(1, later + 61, 4) == []


def test_a_new_url_is_challenged_at_once() -> None:
    d = directory()
    d.offer(NodeAdvert("x", "peer", URL, (1,), ()), 0.0)
    d.verified("x", URL, LaneCheck.UNREACHABLE, 0.0)
    d.offer(NodeAdvert("x", "peer", "http://10.77.0.9:8003", (1,), ()), 1.0)
    assert [a.http_url for a in d.to_verify(1.0)] == ["http://10.77.0.9:8003"]


def test_a_download_only_advert_offers_nothing_and_is_never_challenged() -> None:
    adv = NodeAdvert("pid", "peer", "", (1,), ())
    assert NodeAdvert.decode(adv.encode(), "pid") == adv
    d = directory()
    d.offer(adv, 0.0)
    assert d.to_verify(0.0) == []
    assert d.sources_for(1, 0.0, 4) == []
    assert [a.peer_id for a, _ in d.entries(0.0)] == ["pid"]
    bad = NodeAdvert("pid", "peer", "ftp://x", (1,), ())
    with pytest.raises(RemoteProtocolError):
        NodeAdvert.decode(bad.encode(), "pid")


# -- dial-back rules --------------------------------------------------------------------------


def test_the_asked_node_dials_only_the_address_the_asker_comes_from() -> None:
    assert judge_request("http://127.0.0.1:9", ["127.0.0.1"]) is None
    assert judge_request("http://127.0.0.1:9", ["::ffff:127.0.0.1"]) is None
    assert judge_request("http://[fd77::2]:9", ["fd77::2"]) is None
    assert judge_request("http://192.168.77.2:8003", ["10.77.0.254"]) is R.MISMATCH
    assert judge_request("http://example.org:80", ["10.77.0.254"]) is R.MISMATCH
    assert judge_request("http://127.0.0.1:9", []) is R.REFUSED


def test_the_dialback_limiter_bounds_dials_per_asker_per_address_and_at_once() -> None:
    lim = DialbackLimiter(
        DialbackLimits(per_peer_interval_s=30.0, per_address_interval_s=1.0, max_concurrent=2)
    )
    assert lim.admit("a", "1.1.1.1", 0.0)
    assert not lim.admit("b", "1.1.1.1", 0.5)  # another PeerID from the same address, too soon
    assert not lim.admit("a", "1.1.1.1", 10.0)  # same peer too soon
    assert lim.admit("b", "1.1.1.1", 10.0)  # peers behind one NAT take turns
    assert not lim.admit("d", "3.3.3.3", 10.0)  # two running
    lim.done()
    assert lim.admit("d", "3.3.3.3", 11.0)
    lim.done()
    lim.done()
    assert lim.admit("a", "1.1.1.1", 30.0)


def test_dialback_messages_round_trip_and_reject_garbage() -> None:
    req = DialbackRequest(URL, NONCE)
    assert DialbackRequest.decode(req.encode(), "p") == req
    ans = DialbackAnswer(R.NOT_REACHED, "10.77.0.254")
    assert DialbackAnswer.decode(ans.encode(), "p") == ans
    for bad in (
        DialbackRequest("http://x:1/path", NONCE).encode(),
        DialbackRequest("http://x", NONCE).encode(),
        DialbackRequest(URL, "XYZ").encode(),
        DialbackAnswer(R.FAILED, "").encode(),  # not a wire result
        b"\xff\x00",
        b"x" * 600,
    ):
        decode = DialbackAnswer.decode if b"result" in bad else DialbackRequest.decode
        with pytest.raises(RemoteProtocolError):
            decode(bad, "p")


@pytest.mark.parametrize(
    ("url", "answers", "want"),
    [
        (URL, [R.REACHED, R.NOT_REACHED], Reach.REACHABLE),
        (URL, [R.NOT_REACHED, R.FAILED], Reach.UNREACHABLE),
        (URL, [R.MISMATCH], Reach.UNREACHABLE),  # a private URL seen from elsewhere: NAT
        ("http://8.8.8.8:8003", [R.MISMATCH], Reach.UNKNOWN),  # global: multi-homed, no verdict
        (URL, [R.REFUSED, R.FAILED], Reach.UNKNOWN),
    ],
)
def test_a_round_gives_a_verdict(url: str, answers: list[DialbackResult], want: Reach) -> None:
    assert verdict(url, answers) is want


def test_a_node_advertises_only_once_reached_and_stops_when_unreachable() -> None:
    cfg = ReachabilityConfig(recheck_s=600.0, retry_s=30.0)
    r = Reachability(URL, cfg)
    assert r.advertised() == ""
    assert r.due(0.0)
    assert not r.observe([], 0.0)  # no one to ask: nothing learned, ask again soon
    assert r.advertised() == ""
    assert r.next_due(0.0) == 3.0
    assert not r.observe([R.REFUSED, R.REFUSED], 3.0)  # rate limited: no verdict either
    assert (r.rounds, r.advertised()) == (0, "")
    assert r.observe([R.REACHED], 3.0)
    assert (r.state, r.since, r.advertised()) == (Reach.REACHABLE, 3.0, URL)
    assert not r.due(500.0)
    assert r.due(603.0)
    assert not r.observe([R.REFUSED], 603.0)  # a round that tells nothing keeps the verdict
    assert r.state is Reach.REACHABLE
    assert r.observe([R.NOT_REACHED], 1203.0)
    assert (r.state, r.since, r.advertised()) == (Reach.UNREACHABLE, 1203.0, "")
    assert r.status(str)["state"] == "unreachable"
    assert r.status(str)["last_answers"] == ["not_reached"]


def test_an_undecided_node_fails_open_after_a_round() -> None:
    r = Reachability("http://8.8.8.8:8003", ReachabilityConfig(retry_s=30.0))
    assert r.observe([R.FAILED], 0.0)  # peers that do not speak the protocol: as before
    assert (r.state, r.advertised()) == (Reach.UNKNOWN, "http://8.8.8.8:8003")
    assert r.next_due(10.0) == 20.0


LAN = (ipaddress.ip_interface("192.168.77.2/24"), ipaddress.ip_interface("fd77::2/64"))
LOOPBACK = (ipaddress.ip_interface("127.0.0.1/8"), ipaddress.ip_interface("::1/128"))


@pytest.mark.parametrize(
    ("url", "observed", "interfaces", "want"),
    [
        # global addresses and DNS names: anyone may try them
        ("http://8.8.8.8:8003", ["203.0.113.9"], LAN, True),
        ("http://relay.example.org:8002", [], (), True),
        # a private address on one of this host's networks: same LAN
        ("http://192.168.77.3:8003", [], LAN, True),
        ("http://192.168.77.3:8003", ["192.168.77.3"], (), True),  # we talk to it there
        ("http://[fd77::3]:8003", [], LAN, True),  # unique local (fd00::/8)
        # ... on no network of this host: another home's LAN
        ("http://192.168.78.3:8003", [], LAN, False),
        ("http://10.0.0.5:8003", [], LAN, False),
        ("http://[fe80::1]:8003", [], LAN, False),  # link-local elsewhere
        ("http://100.64.0.7:8003", [], LAN, False),  # carrier-grade NAT space is not global
        # its connection comes from a global address: it sits behind a NAT, its LAN is not
        # ours even if the private range collides with one of ours
        ("http://192.168.77.3:8003", ["198.51.100.0", "8.8.4.4"], LAN, False),
        ("http://192.168.77.3:8003", ["8.8.4.4"], LAN, False),
        # loopback: only from a node on this very host
        ("http://127.0.0.1:8003", ["127.0.0.1"], LOOPBACK, True),
        ("http://127.0.0.1:8003", [], LOOPBACK, True),
        ("http://127.0.0.1:8003", ["192.168.77.3"], LAN + LOOPBACK, False),
        ("http://[::1]:8003", ["::ffff:127.0.0.1"], LOOPBACK, True),  # IPv4-mapped is IPv4
        ("http://127.0.0.1:8003", ["::ffff:8.8.8.8"], LOOPBACK, False),
        # not a lane URL
        ("ftp://192.168.77.3:21", [], LAN, False),
        ("http://192.168.77.3", [], LAN, False),
    ],
)
def test_a_non_global_lane_url_is_tried_only_on_its_own_network(
    url: str, observed: list[str], interfaces: tuple[Interface, ...], want: bool
) -> None:
    assert lane_in_scope(url, observed, interfaces) is want


def test_an_advert_offers_the_first_url_in_scope() -> None:
    nat_lan = "http://192.168.77.3:8003"
    public = "http://8.8.8.8:8003"
    assert scoped_lane(public, "", [], LAN) == public
    assert scoped_lane("", nat_lan, [], LAN) == nat_lan  # a NATed neighbour: its LAN URL
    assert scoped_lane("", nat_lan, ["8.8.4.4"], LAN) == ""  # seen across the internet
    assert scoped_lane("", nat_lan, [], LOOPBACK) == ""  # another network
    # an older node that failed open names its private URL as http_url: scoped the same way
    assert scoped_lane(nat_lan, "", [], LOOPBACK) == ""
    assert scoped_lane("", "", [], LAN) == ""


def test_a_declared_public_network_counts_as_global() -> None:
    """A deployment across a VPN or a private WAN names it (``--public-network``): its
    addresses are tried from anywhere, other private ones still only on their own network."""
    wan = parse_networks(["10.211.0.0/16", "fd77::/16"])
    peer = "http://10.211.7.4:8003"
    assert not lane_in_scope(peer, [], LAN)  # private, not on this node's network
    assert lane_in_scope(peer, [], LAN, wan)
    assert lane_in_scope("http://[fd77::4]:8003", ["8.8.4.4"], LAN, wan)
    assert not lane_in_scope("http://192.168.77.3:8003", [], LOOPBACK, wan)
    assert scoped_lane(peer, "", [], LAN, wan) == peer
    assert parse_networks(["10.211.7.4/24"]) == (ipaddress.ip_network("10.211.7.0/24"),)
    with pytest.raises(ConfigError, match=r"public_networks.*'10\.300\.0\.0/8'"):
        parse_networks(["10.300.0.0/8"])
    with pytest.raises(ConfigError, match="public_networks"):
        ReachabilityConfig(public_networks=("lan",))


def test_a_private_lane_is_offered_for_its_lan_until_advertised() -> None:
    mine = (ipaddress.ip_interface("10.78.0.2/24"),)
    r = Reachability(URL)  # 10.78.0.2: a private address of this host
    assert (r.advertised(), r.lan_advertised(mine)) == ("", URL)  # not checked yet
    r.observe([R.MISMATCH, R.FAILED], 0.0)  # seen from elsewhere: behind a NAT
    assert (r.state, r.advertised(), r.lan_advertised(mine)) == (Reach.UNREACHABLE, "", URL)
    # a private URL that is not this host's (--public-host naming its NAT router's address):
    # neighbours would not find this host there
    assert r.lan_advertised(LAN) == ""
    assert Reachability("http://127.0.0.2:8003").lan_advertised(()) == "http://127.0.0.2:8003"
    r.observe([R.REACHED], 700.0)  # reachable after all (a port forward): offered to all
    assert (r.advertised(), r.lan_advertised(mine)) == (URL, "")
    assert r.answers_total == {R.MISMATCH: 1, R.FAILED: 1, R.REACHED: 1}
    public = Reachability("http://8.8.8.8:8003")
    public.observe([R.NOT_REACHED], 0.0)
    assert (public.advertised(), public.lan_advertised(mine)) == ("", "")  # never a LAN URL
    named = Reachability("http://peer.example.org:8003")
    assert named.lan_advertised(mine) == ""


def test_the_lan_url_travels_under_its_own_key() -> None:
    plain = NodeAdvert("p", "peer", "", (1,), ())
    assert b"lan_url" not in plain.encode()  # absent when empty: older adverts unchanged
    lan = NodeAdvert.of("p", "peer", "", [(1, "ab" * 32)], [], lan_url="http://10.0.0.2:8003")
    back = NodeAdvert.decode(lan.encode(), "p")
    assert back == lan
    assert back.http_url == ""  # an older node reads no URL to try
    bad = cbor2.loads(lan.encode()) | {"lan_url": "http://10.0.0.2:8003/x"}
    with pytest.raises(RemoteProtocolError, match="url"):
        NodeAdvert.decode(cbor2.dumps(bad), "p")


def test_a_neighbour_behind_the_same_router_is_a_lan_asker() -> None:
    mine = "http://192.168.77.2:8003"
    assert lan_asker(mine, ["192.168.77.3"], LAN)  # a neighbour on the home LAN
    assert not lan_asker(mine, ["10.211.0.1"], LAN)  # the relay, across the router
    assert not lan_asker(mine, [], LAN)  # nothing known of the asker: not a neighbour
    assert not lan_asker("http://8.8.8.8:8003", ["8.8.4.4"], LAN)  # a global lane
    assert not lan_asker("http://relay.example:8002", ["192.168.77.3"], LAN)  # a DNS name
    assert lan_asker("http://[fd77::2]:8003", ["fd77::9"], LAN)
    assert lan_asker("http://127.0.0.1:8003", ["127.0.0.1"], LOOPBACK)  # one host
    public = parse_networks(["192.168.77.0/24"])  # a deployment's private "internet"
    assert not lan_asker(mine, ["192.168.77.3"], LAN, public)


def test_a_neighbour_cannot_make_a_natted_lane_reachable() -> None:
    """A peer behind a home router: its relay (outside) cannot reach its private URL, a
    neighbour behind the same router can. The neighbour's answer must not make the peer
    advertise the URL and drop its stream lane (it would stop serving through the NAT)."""
    r = Reachability("http://192.168.77.2:8003", ReachabilityConfig(serve_behind_nat=True))
    assert r.observe([R.NOT_REACHED, R.REACHED], 0.0, [False, True])
    assert (r.state, r.advertised(), r.advertises_stream()) == (Reach.UNREACHABLE, "", True)
    # a later round that only a neighbour answered tells nothing
    assert not r.observe([R.REACHED], 700.0, [True])
    assert (r.state, r.advertises_stream()) == (Reach.UNREACHABLE, True)
    # the relay reaching it (a port forward set up since) does
    assert r.observe([R.REACHED, R.REACHED], 1400.0, [False, True])
    assert (r.state, r.advertised()) == (Reach.REACHABLE, "http://192.168.77.2:8003")


def test_on_a_flat_network_neighbours_decide() -> None:
    """Every asker on the lane's own network (one LAN, one host): their answers decide, as
    long as no asker from outside has."""
    r = Reachability("http://192.168.77.2:8003", ReachabilityConfig())
    assert r.observe([R.REACHED, R.REACHED], 0.0, [True, True])
    assert (r.state, r.from_outside) == (Reach.REACHABLE, False)
    assert r.observe([R.NOT_REACHED], 700.0, [True])
    assert r.state is Reach.UNREACHABLE


def test_a_neighbour_on_the_lan_is_tried_at_its_lan_url() -> None:
    """A peer with a port mapped on its home router advertises the router's URL and its LAN
    URL: a neighbour connected to it over the LAN takes the LAN URL (no hairpin through the
    router); anyone else the router's."""
    mapped, lan = "http://8.8.8.9:8003", "http://192.168.77.2:8003"
    assert scoped_lane(mapped, lan, ["192.168.77.2"], LAN) == lan
    assert scoped_lane(mapped, lan, [], LAN) == mapped  # not connected: the mapped URL
    assert scoped_lane(mapped, lan, ["8.8.8.9"], LAN) == mapped  # across the internet
