"""Hole punching's pure parts: which lane reaches an advertiser behind a NAT
(:func:`shardcast.core.choose_lane`'s ``PUNCH``), when a downloader punches
(:class:`shardcast.core.PunchPlanner`), which relays an unreachable node reserves on
(:class:`shardcast.core.Reservations`), the advert's ``relays`` and what discovery offers; and
:mod:`p2p.circuits`' address and log filters."""

from __future__ import annotations

import ipaddress
import logging
import random
from typing import Any

import multiaddr
import pytest
import trio
from libp2p.peer.id import ID

from p2p import wire
from p2p.addresses import Interfaces
from p2p.circuits import (
    MAX_PRIVATE_ADDRS,
    CircuitConfig,
    _DCUtR,
    is_private,
    is_unspecified,
    on_link,
    private_listen_addrs,
    quiet_library_noise,
)
from p2p.errors import ConfigError, RemoteProtocolError
from p2p.identity import Identity
from shardcast.core import (
    Lane,
    PunchConfig,
    PunchPlanner,
    PunchTarget,
    Reservations,
    choose_lane,
)
from shardcast.core.reachability import DialbackResult, Reach, Reachability
from shardcast.download.discovery import MAX_RELAYS, NodeAdvert, SourceDirectory

NAT, NAT2, R1, R2, R3 = (
    Identity.from_seed(f"punch-{n}").peer_id for n in ("nat", "nat2", "r1", "r2", "r3")
)
D = "ab" * 32


@pytest.mark.parametrize(
    ("connected", "relays", "relays_connected", "want"),
    [
        (True, (R1,), frozenset({R1}), Lane.STREAM),  # direct already: no punch
        (False, (R1, R2), frozenset({R2}), Lane.PUNCH),
        (False, (R1,), frozenset({R2}), Lane.NONE),  # no relay in common
        (False, (), frozenset({R1}), Lane.NONE),  # an older advert: no relays named
    ],
)
def test_choose_lane_punches_through_a_shared_relay(
    connected: bool, relays: tuple[str, ...], relays_connected: frozenset[str], want: Lane
) -> None:
    got = choose_lane(
        http_url="",
        http_proven=False,
        stream_lane=True,
        connected=connected,
        relays=relays,
        relays_connected=relays_connected,
    )
    assert got is want


def test_choose_lane_never_punches_without_a_stream_lane_or_past_a_proven_url() -> None:
    both = frozenset({R1})
    no_lane = choose_lane(
        http_url="", http_proven=False, stream_lane=False, connected=False, relays=(R1,),
        relays_connected=both,
    )  # fmt: skip
    proven = choose_lane(
        http_url="http://8.8.8.8:1", http_proven=True, stream_lane=True, connected=False,
        relays=(R1,), relays_connected=both,
    )  # fmt: skip
    assert (no_lane, proven) == (Lane.NONE, Lane.HTTP)


def test_the_planner_caps_concurrent_punches_and_one_per_peer() -> None:
    p = PunchPlanner(PunchConfig(max_concurrent=2))
    rng = random.Random(0)
    conn = frozenset({R1})
    assert p.start(NAT, (R1,), conn, 0.0, rng) == R1
    assert p.start(NAT, (R1,), conn, 0.0, rng) is None  # already running
    assert p.start(NAT2, (R2,), conn, 0.0, rng) is None  # no shared relay
    assert p.start(NAT2, (R1,), conn, 0.0, rng) == R1
    third = Identity.from_seed("punch-third").peer_id
    assert p.start(third, (R1,), conn, 0.0, rng) is None  # the cap
    p.done(NAT, direct=True, now=1.0)
    assert p.start(third, (R1,), conn, 1.0, rng) == R1
    assert p.retry_at(NAT) is None


def test_the_planner_backs_off_a_failed_peer_doubling_to_the_cap() -> None:
    cfg = PunchConfig(backoff_initial_s=10.0, backoff_max_s=30.0)
    p = PunchPlanner(cfg)
    rng = random.Random(0)
    conn = frozenset({R1})
    waits = []
    now = 0.0
    for _ in range(4):
        assert p.start(NAT, (R1,), conn, now, rng) == R1
        p.done(NAT, direct=False, now=now)
        retry = p.retry_at(NAT)
        assert retry is not None
        assert p.start(NAT, (R1,), conn, retry - 0.5, rng) is None  # still backing off
        waits.append(retry - now)
        now = retry
    assert waits == [10.0, 20.0, 30.0, 30.0]
    assert p.start(NAT, (R1,), conn, now, rng) == R1
    p.done(NAT, direct=True, now=now)  # success forgets the failures
    assert p.retry_at(NAT) is None


def test_a_punch_without_a_circuit_is_retried_soon() -> None:
    """The relayed dial failed (the peer's reservation not made yet): the NATs were not
    tried, so the retry comes after ``circuit_retry_s``, doubling, at most the backoff of a
    failed punch; a punch that failed through its circuit backs off fully."""
    p = PunchPlanner(PunchConfig(backoff_initial_s=20.0, circuit_retry_s=5.0))
    rng, conn = random.Random(0), frozenset({R1})
    waits, now = [], 0.0
    for _ in range(4):
        assert p.start(NAT, (R1,), conn, now, rng) == R1
        p.done(NAT, direct=False, now=now, circuit=False)
        retry = p.retry_at(NAT)
        assert retry is not None
        waits.append(retry - now)
        now = retry
    assert waits == [5.0, 10.0, 20.0, 20.0]
    assert p.start(NAT, (R1,), conn, now, rng) == R1
    p.done(NAT, direct=False, now=now)  # the punch itself failed: the NAT's verdict
    assert p.retry_at(NAT) == now + 20.0 * 2**4
    with pytest.raises(ConfigError, match="circuit_retry_s"):
        PunchConfig(backoff_initial_s=20.0, circuit_retry_s=30.0)


def test_the_planner_forgets_the_oldest_failures_beyond_its_bound() -> None:
    p = PunchPlanner(PunchConfig(max_tracked=2))
    peers = [Identity.from_seed(f"punch-many-{i}").peer_id for i in range(3)]
    for peer in peers:
        assert p.start(peer, (R1,), frozenset({R1}), 0.0, random.Random(0)) == R1
        p.done(peer, direct=False, now=0.0)
    assert [p.retry_at(x) is not None for x in peers] == [False, True, True]


def test_the_planner_draws_the_relay_among_the_shared_ones() -> None:
    rng = random.Random(5)
    drawn = set()
    for _ in range(20):
        p = PunchPlanner(PunchConfig())
        drawn.add(p.start(NAT, (R1, R2, R3), frozenset({R1, R3}), 0.0, rng))
    assert drawn == {R1, R3}


def test_reservations_only_while_unreachable_up_to_the_bound() -> None:
    res = Reservations(PunchConfig(max_relays=2, backoff_initial_s=30.0))
    assert res.wanted(Reach.UNKNOWN, [R1, R2], 0.0) == []
    assert res.wanted(Reach.REACHABLE, [R1, R2], 0.0) == []
    assert res.wanted(Reach.UNREACHABLE, [R1, R2, R3], 0.0) == [R1, R2]
    res.reserved(R1)
    res.failed(R2, 0.0)
    assert res.wanted(Reach.UNREACHABLE, [R1, R2, R3], 1.0) == [R3]  # R2 backs off
    assert res.wanted(Reach.UNREACHABLE, [R1, R2], 30.0) == [R2]
    res.reserved(R3)
    assert res.wanted(Reach.UNREACHABLE, [R1, R2, R3], 60.0) == []  # two held
    assert res.advertised(Reach.UNREACHABLE) == (R1, R3)
    assert res.advertised(Reach.REACHABLE) == ()


def test_a_reservation_is_lost_with_its_connection() -> None:
    res = Reservations(PunchConfig())
    res.reserved(R1)
    res.reserved(R2)
    assert not res.keep_connected(frozenset({R1, R2}))
    assert res.keep_connected(frozenset({R2}))
    assert res.held == [R2]


def test_punch_config_is_checked() -> None:
    with pytest.raises(ConfigError, match="max_concurrent"):
        PunchConfig(max_concurrent=0)
    with pytest.raises(ConfigError, match="backoff_initial_s"):
        PunchConfig(backoff_initial_s=10.0, backoff_max_s=5.0)


def test_the_advert_carries_relays_and_older_adverts_decode() -> None:
    a = NodeAdvert.of(NAT, "peer", "", [(1, D)], [], stream_lane=True, relays=[R1, R2])
    back = NodeAdvert.decode(a.encode(), NAT)
    assert back == a
    assert back.relays == (R1, R2)
    old = NodeAdvert.of(NAT, "peer", "", [(1, D)], [], stream_lane=True)
    assert b"relays" not in old.encode()
    assert NodeAdvert.decode(old.encode(), NAT).relays == ()
    many = NodeAdvert.of(NAT, "peer", "", [], [], relays=[R1] * (MAX_RELAYS + 3))
    assert len(many.relays) == MAX_RELAYS


@pytest.mark.parametrize(
    "relays",
    [
        [R1] * (MAX_RELAYS + 1),  # too many
        ["not a peer id"],
        [7],
        ["1" * 129],
        R1,  # not a list
    ],
)
def test_hostile_relays_are_refused(relays: object) -> None:
    bad = wire.encode(
        {
            "v": 1,
            "peer_id": NAT,
            "role": "peer",
            "http_url": "",
            "committed": [],
            "filling": [],
            "relays": relays,
        }
    )
    with pytest.raises(RemoteProtocolError, match="relays"):
        NodeAdvert.decode(bad, NAT)


def test_discovery_offers_punch_candidates_not_sources() -> None:
    d = SourceDirectory(
        "me", set(), ttl_s=10.0, max_entries=10, rng=random.Random(0), require_verified=True
    )
    d.offer(NodeAdvert(NAT, "peer", "", (1,), (), stream_lane=True, relays=(R1,)), 0.0)
    d.offer(NodeAdvert(NAT2, "peer", "", (), (1,), stream_lane=True, relays=(R2,)), 0.0)
    via_r1 = frozenset({R1})
    assert d.sources_for(1, 1.0, 10, connected=via_r1) == []  # bytes only once direct
    assert [a.peer_id for a in d.punch_candidates(1, 1.0, connected=via_r1)] == [NAT]
    both = frozenset({R1, R2})
    assert [a.peer_id for a in d.punch_candidates(1, 1.0, connected=both)] == [NAT, NAT2]
    assert d.punch_candidates(2, 1.0, connected=both) == []  # holds no step 2
    assert d.punch_candidates(1, 11.0, connected=both) == []  # expired
    direct = frozenset({R1, NAT})
    assert d.punch_candidates(1, 1.0, connected=direct) == []
    assert [s.base_url for s in d.sources_for(1, 1.0, 10, connected=direct)] == [f"p2p://{NAT}"]


def test_unspecified_addresses_are_recognised() -> None:
    for addr, want in [
        ("/ip4/0.0.0.0/tcp/1", True),
        ("/ip6/::/tcp/1", True),
        ("/ip4/10.0.0.2/tcp/1", False),
        ("/ip6/fd77::2/tcp/1", False),
        ("/dns4/example.org/tcp/1", False),
    ]:
        assert is_unspecified(multiaddr.Multiaddr(addr)) is want


def test_routine_circuit_errors_are_logged_at_debug(caplog: pytest.LogCaptureFixture) -> None:
    quiet_library_noise()
    quiet_library_noise()  # idempotent
    relay_log = logging.getLogger("libp2p.relay.circuit_v2.protocol")
    tcp_log = logging.getLogger("libp2p.transport.tcp.tcp")
    assert len(relay_log.filters) == 1
    with caplog.at_level(logging.INFO):
        relay_log.error("Error relaying data: stream is reset")
        tcp_log.error("Unexpected error opening TCP stream: Failed to connect a from b")
        tcp_log.error("something else")
    assert [(r.name, r.levelname) for r in caplog.records] == [
        ("libp2p.transport.tcp.tcp", "ERROR")
    ]
    with caplog.at_level(logging.DEBUG, logger="libp2p.relay.circuit_v2.protocol"):
        relay_log.error("Error relaying data: stream is reset")
    assert caplog.records[-1].levelname == "DEBUG"


def test_learning_unreachable_changes_the_advert_though_no_url_was_sent() -> None:
    """The stream lane (and the relays with it) must be advertised at once: the first round
    that finds the URL unreachable reports a change."""
    r = Reachability("http://192.168.77.2:8003")
    assert r.observe([DialbackResult.NOT_REACHED], 0.0)
    assert (r.advertised(), r.advertises_stream()) == ("", True)
    assert not r.observe([DialbackResult.NOT_REACHED], 700.0)


def test_of_two_nated_peers_the_greater_peer_id_yields_first() -> None:
    p = PunchPlanner(PunchConfig(yield_s=10.0))
    rng = random.Random(0)
    conn = frozenset({R1})
    assert p.start(NAT, (R1,), conn, 0.0, rng, yield_to_peer=True) is None
    assert p.start(NAT, (R1,), conn, 9.0, rng, yield_to_peer=True) is None
    assert p.start(NAT, (R1,), conn, 10.0, rng, yield_to_peer=True) == R1  # the other did not
    p.done(NAT, direct=False, now=10.0)
    assert p.start(NAT2, (R1,), conn, 0.0, rng) == R1  # no yield: at once


async def test_dcutr_neither_sends_nor_dials_unspecified_addresses() -> None:
    """A host listening on 0.0.0.0 offers its listen addresses when it has no observed one;
    the other side dialled 0.0.0.0 (itself). Both directions drop them."""
    dcutr = _DCUtR.__new__(_DCUtR)  # only the address handling, no host services

    class Host:
        def get_addrs(self) -> list[multiaddr.Multiaddr]:
            return [
                multiaddr.Multiaddr(a) for a in ("/ip4/0.0.0.0/tcp/4003", "/ip4/10.0.0.2/tcp/4003")
            ]

    dcutr.host = Host()  # type: ignore[assignment]  # a stand-in: get_addrs only
    dcutr.interfaces = lambda: Interfaces(("10.0.0.2", "127.0.0.1"))
    sent = [str(multiaddr.Multiaddr(a)) for a in await dcutr._get_observed_addrs()]
    assert sent == ["/ip4/10.0.0.2/tcp/4003"]  # the private one once, no loopback
    raw = [
        multiaddr.Multiaddr(a).to_bytes()
        for a in ("/ip4/0.0.0.0/tcp/1", "/ip6/::/tcp/1", "/ip4/8.8.8.8/tcp/1")
    ]
    assert [str(a) for a in dcutr._decode_observed_addrs(raw)] == ["/ip4/8.8.8.8/tcp/1"]


def _targets(n: int, newest: int = -1) -> list[PunchTarget]:
    return [
        PunchTarget(Identity.from_seed(f"punch-ahead-{newest}-{i}").peer_id, (R1,), newest)
        for i in range(n)
    ]


def test_punching_ahead_prefers_holders_of_the_newest_version_up_to_the_cap() -> None:
    p = PunchPlanner(PunchConfig(max_concurrent=2, ahead_max_direct=3))
    old, new = _targets(3, newest=1), _targets(2, newest=4)
    got = p.ahead([*old, *new], frozenset({R1}), 0, 0.0, random.Random(0))
    assert {peer for peer, _ in got} == {t.peer_id for t in new}  # the concurrency cap: two
    assert all(relay == R1 for _, relay in got)
    assert p.ahead(old, frozenset({R1}), 0, 0.0, random.Random(0)) == []  # two running
    for peer, _ in got:
        p.done(peer, direct=True, now=1.0)
    # two now held directly: room for one more of the cap of three
    again = p.ahead(old, frozenset({R1}), 2, 1.0, random.Random(0))
    assert len(again) == 1
    p.done(again[0][0], direct=True, now=2.0)
    assert p.ahead(old, frozenset({R1}), 3, 2.0, random.Random(0)) == []  # the cap


def test_punching_ahead_draws_fairly_among_equals_with_the_seeded_rng() -> None:
    targets = _targets(4, newest=2)
    firsts = set()
    for seed in range(20):
        p = PunchPlanner(PunchConfig(max_concurrent=1))
        got = p.ahead(targets, frozenset({R1}), 0, 0.0, random.Random(seed))
        firsts.add(got[0][0])
    assert firsts == {t.peer_id for t in targets}  # no advertiser is always last
    one = PunchPlanner(PunchConfig(max_concurrent=1))
    two = PunchPlanner(PunchConfig(max_concurrent=1))
    assert one.ahead(targets, frozenset({R1}), 0, 0.0, random.Random(7)) == two.ahead(
        targets, frozenset({R1}), 0, 0.0, random.Random(7)
    )  # deterministic


def test_punching_ahead_backs_off_a_failed_peer_and_yields_like_start() -> None:
    cfg = PunchConfig(max_concurrent=4, backoff_initial_s=60.0, yield_s=10.0)
    p = PunchPlanner(cfg)
    (t,) = _targets(1, newest=0)
    conn = frozenset({R1})
    assert p.ahead([t], conn, 0, 0.0, random.Random(0)) == [(t.peer_id, R1)]
    p.done(t.peer_id, direct=False, now=5.0)
    assert p.ahead([t], conn, 0, 64.0, random.Random(0)) == []  # backing off until 65 s
    assert p.ahead([t], conn, 0, 65.0, random.Random(0)) == [(t.peer_id, R1)]
    p.done(t.peer_id, direct=True, now=66.0)
    polite = PunchTarget(NAT, (R1,), 0, yield_to_peer=True)
    assert p.ahead([polite], conn, 0, 100.0, random.Random(0)) == []  # yields first
    assert p.ahead([polite], conn, 0, 110.0, random.Random(0)) == [(NAT, R1)]
    assert p.ahead([PunchTarget(NAT2, (R2,))], conn, 0, 110.0, random.Random(0)) == []


def test_punching_ahead_can_be_turned_off() -> None:
    p = PunchPlanner(PunchConfig(ahead_max_direct=0))
    assert p.ahead(_targets(2), frozenset({R1}), 0, 0.0, random.Random(0)) == []
    with pytest.raises(ConfigError, match="ahead_max_direct"):
        PunchConfig(ahead_max_direct=-1)
    with pytest.raises(ConfigError, match="ahead_interval_s"):
        PunchConfig(ahead_interval_s=0.0)


def test_discovery_offers_every_nated_advertiser_to_punch_ahead() -> None:
    d = SourceDirectory(
        "me", set(), ttl_s=10.0, max_entries=10, rng=random.Random(0), require_verified=True
    )
    d.offer(NodeAdvert(NAT, "peer", "", (1,), (), stream_lane=True, relays=(R1,)), 0.0)
    d.offer(NodeAdvert(NAT2, "peer", "", (), (), stream_lane=True, relays=(R1,)), 0.0)
    d.offer(NodeAdvert(R2, "relay", "http://8.8.8.8:1", (1,), ()), 0.0)
    adverts, held = d.punch_ahead(1.0, connected=frozenset({R1}))
    assert ([a.peer_id for a in adverts], held) == ([NAT, NAT2], 0)  # holding nothing yet too
    assert [a.newest() for a in adverts] == [1, -1]
    adverts, held = d.punch_ahead(1.0, connected=frozenset({R1, NAT}))
    assert ([a.peer_id for a in adverts], held) == ([NAT2], 1)
    assert d.punch_ahead(1.0, connected=frozenset()) == ([], 0)  # no shared relay
    assert d.punch_ahead(11.0, connected=frozenset({R1})) == ([], 0)  # expired


def test_discovery_does_not_put_public_lanes_before_punched_stream_lanes() -> None:
    """A holder behind a NAT, held directly (punched), is offered like a public one: complete
    holders are drawn in a seeded random order whatever their lane (the scheduler then ranks
    sources by measured rate only, :mod:`shardcast.core.select`)."""
    firsts = set()
    for seed in range(16):
        d = SourceDirectory(
            "me", set(), ttl_s=10.0, max_entries=10, rng=random.Random(seed), require_verified=False
        )
        d.offer(NodeAdvert(R2, "peer", "http://8.8.8.8:1", (1,), ()), 0.0)
        d.offer(NodeAdvert(NAT, "peer", "", (1,), (), stream_lane=True, relays=(R1,)), 0.0)
        got = d.sources_for(1, 1.0, 10, connected=frozenset({R1, NAT}))
        assert sorted(s.base_url for s in got) == sorted(["http://8.8.8.8:1", f"p2p://{NAT}"])
        firsts.add(got[0].id)
    assert firsts == {R2, NAT}


def _ma(text: str) -> multiaddr.Multiaddr:
    return multiaddr.Multiaddr(text)


def test_private_addresses_are_those_of_a_lan_only() -> None:
    for addr, want in [
        ("/ip4/192.168.77.2/tcp/1", True),
        ("/ip4/10.0.0.2/tcp/1", True),
        ("/ip6/fd77::2/tcp/1", True),
        ("/ip4/100.64.0.1/tcp/1", True),  # shared (carrier-grade NAT)
        ("/ip4/127.0.0.1/tcp/1", False),
        ("/ip4/169.254.0.1/tcp/1", False),
        ("/ip4/0.0.0.0/tcp/1", False),
        ("/ip4/8.8.8.8/tcp/1", False),
        ("/ip6/2001:4860::1/tcp/1", False),
        ("/dns4/example.org/tcp/1", False),
        ("/ip4/192.168.77.2/udp/1/quic-v1", False),  # not TCP
    ]:
        assert is_private(_ma(addr)) is want, addr


def test_private_listen_addresses_expand_unspecified_ones_bounded() -> None:
    interfaces = Interfaces(
        ("192.168.77.2", "8.8.4.4", "10.1.0.2", "127.0.0.1"), ("fd77::2", "::1")
    )
    listen = [
        _ma("/ip4/0.0.0.0/tcp/4003"),
        _ma("/ip6/::/tcp/4004"),
        _ma("/ip4/192.168.77.2/tcp/4003"),  # a duplicate of an expanded one
        _ma("/ip4/127.0.0.1/tcp/5000"),
        _ma("/ip4/10.9.9.9/tcp/7/p2p-circuit"),
    ]
    got = [str(a) for a in private_listen_addrs(listen, interfaces, 10)]
    assert got == [
        "/ip4/192.168.77.2/tcp/4003",
        "/ip4/10.1.0.2/tcp/4003",
        "/ip6/fd77::2/tcp/4004",
    ]
    assert len(private_listen_addrs(listen, interfaces, 2)) == 2
    assert private_listen_addrs(listen, interfaces, 0) == []
    assert MAX_PRIVATE_ADDRS > 0


def test_on_link_addresses_lie_on_this_hosts_networks() -> None:
    subnets = [ipaddress.ip_interface("10.212.235.2/24"), ipaddress.ip_interface("::1/128")]
    assert on_link(_ma("/ip4/10.212.235.3/tcp/4003"), subnets)
    assert not on_link(_ma("/ip4/10.211.235.5/tcp/4003"), subnets)  # the router's WAN side
    assert not on_link(_ma("/dns4/example.org/tcp/1"), subnets)


def test_circuit_config_bounds_the_direct_dial() -> None:
    with pytest.raises(ConfigError, match="direct_timeout_s"):
        CircuitConfig(direct_timeout_s=0.0)
    CircuitConfig(timeout_s=2.0)  # the direct dial's bound is capped by the punch's


class _Dials:
    """A stand-in host for :class:`_DCUtR`'s dial paths: records each dial and fails it (or
    never answers, ``hang``)."""

    def __init__(self, addrs: list[str], *, hang: bool = False) -> None:
        self.known = [_ma(a) for a in addrs]
        self.hang = hang
        self.connections: dict[Any, Any] = {}
        self.dialled: list[tuple[str, bool]] = []

    def get_peerstore(self) -> _Dials:
        return self

    def get_network(self) -> _Dials:
        return self

    def addrs(self, peer_id: Any) -> list[multiaddr.Multiaddr]:
        return list(self.known)

    async def _dial(self, addr: multiaddr.Multiaddr, responder: bool) -> None:
        self.dialled.append((str(addr), responder))
        if self.hang:
            await trio.sleep_forever()
        raise OSError("refused")

    async def dial_addr(self, addr: multiaddr.Multiaddr, peer_id: Any, source: Any) -> None:
        await self._dial(addr, False)

    async def dial_addr_as_responder(
        self, addr: multiaddr.Multiaddr, peer_id: Any, source: Any
    ) -> None:
        await self._dial(addr, True)


def _dcutr(host: _Dials) -> _DCUtR:
    return _DCUtR(
        host,
        dial_timeout_s=30.0,
        direct_timeout_s=5.0,
        interfaces=lambda: Interfaces(("10.212.235.2",)),
        subnets=lambda: [ipaddress.ip_interface("10.212.235.2/24")],
    )


async def test_the_punch_initiator_leaves_on_link_addresses_to_the_other_side() -> None:
    """As the handshake's responder, a dial over the LAN would land on the other side's
    listener (a responder too): the initiator skips it, the other side dials as client."""
    host = _Dials([])
    dcutr = _dcutr(host)
    peer = Identity.from_seed("punch-lan").peer_id
    pid = ID.from_base58(peer)
    lan, wan = _ma("/ip4/10.212.235.3/tcp/4003"), _ma("/ip4/10.211.235.5/tcp/4003")
    for addr in (lan, wan):
        await dcutr._dial_peer(pid, addr, None, as_responder=True)
        await dcutr._dial_peer(pid, addr, None, as_responder=False)
    assert host.dialled == [
        (str(lan), False),  # as client only
        (str(wan), True),  # the predicted public address: a simultaneous open
        (str(wan), False),
    ]


async def test_the_direct_dial_before_a_punch_is_bounded(autojump_clock: trio.abc.Clock) -> None:
    """A SYN to a router's address is dropped silently: the plain dial the library tries
    first (to the advertised addresses) gives up after ``direct_timeout_s``, leaving the
    punch its time."""
    host = _Dials(["/ip4/10.211.235.5/tcp/4003"], hang=True)
    dcutr = _dcutr(host)
    pid = ID.from_base58(Identity.from_seed("punch-router").peer_id)
    start = trio.current_time()
    assert not await dcutr._try_unilateral_upgrade(pid)
    assert trio.current_time() - start == pytest.approx(5.0)
    assert host.dialled == [("/ip4/10.211.235.5/tcp/4003", False)]
