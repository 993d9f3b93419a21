"""Source discovery (``shardcast.download.discovery``): node adverts and the bounded directory."""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Callable
from types import SimpleNamespace
from typing import cast

import pytest
import trio

from p2p import wire
from p2p.errors import RemoteProtocolError
from shardcast.core import LaneCheck, PunchConfig
from shardcast.core.tracker import confirmed_elsewhere
from shardcast.download.discovery import HolderReach, NodeAdvert, PunchRecord, SourceDirectory
from shardcast.download.follower import Follower
from shardcast.download.punching import Punching
from shardcast.serve import Requester
from shardcast.wire.messages import NodeInfo, VersionAnnouncement


def advert(
    pid: str, role: str = "peer", committed: tuple[int, ...] = (), filling: tuple[int, ...] = ()
) -> NodeAdvert:
    return NodeAdvert(pid, role, f"http://127.0.0.1:{1000 + len(pid)}", committed, filling)


def test_advert_round_trips() -> None:
    a = advert("Qm-a", "relay", (1, 2), (3,))
    assert NodeAdvert.decode(a.encode(), "Qm-a") == a


def test_advert_naming_another_peer_is_refused() -> None:
    with pytest.raises(RemoteProtocolError, match="claims to be"):
        NodeAdvert.decode(advert("Qm-a").encode(), "Qm-b")


@pytest.mark.parametrize(
    ("field", "value", "match"),
    [
        ("role", "origin", "bad role"),
        ("http_url", "http://evil/path", "bad role"),
        ("committed", [-1], "non-negative"),
        ("filling", [True], "non-negative"),
    ],
)
def test_malformed_advert_is_refused(field: str, value: object, match: str) -> None:
    obj = {
        "v": 1,
        "peer_id": "Qm-a",
        "role": "peer",
        "http_url": "http://127.0.0.1:1",
        "committed": [],
        "filling": [],
    }
    obj[field] = value
    with pytest.raises(RemoteProtocolError, match=match):
        NodeAdvert.decode(wire.encode(obj), "Qm-a")


def test_directory_is_bounded_and_forgets_the_oldest() -> None:
    d = SourceDirectory("me", set(), ttl_s=100.0, max_entries=3, rng=random.Random(0))
    for k in range(5):
        d.offer(advert(f"n{k}", committed=(1,)), now=float(k))
    assert sorted(s.id for s in d.sources_for(1, now=5.0, limit=10)) == ["n2", "n3", "n4"]


def test_directory_skips_itself_upstreams_and_stale_adverts() -> None:
    d = SourceDirectory("me", {"up"}, ttl_s=10.0, max_entries=10, rng=random.Random(0))
    d.offer(advert("me", committed=(1,)), 0.0)
    d.offer(advert("up", committed=(1,)), 0.0)
    d.offer(advert("old", committed=(1,)), 0.0)
    d.offer(advert("new", committed=(1,)), 15.0)
    assert [s.id for s in d.sources_for(1, now=20.0, limit=10)] == ["new"]


def test_directory_news_only_for_what_may_change_its_sources() -> None:
    """``news`` (which wakes downloads' discovery) is set by a new advertiser, a changed
    advert, one heard again after its TTL, a challenge result that changed and a reach
    change; not by the periodic repeat of the same advert, which still sets ``changed``."""
    d = SourceDirectory("me", set(), ttl_s=10.0, max_entries=10, rng=random.Random(0))

    def pulses(act: Callable[[], object]) -> tuple[bool, bool]:
        news, changed = d.news, d.changed
        act()
        return news.is_set(), changed.is_set()

    a = advert("n1", filling=(1,))
    assert pulses(lambda: d.offer(a, 0.0)) == (True, True)
    assert pulses(lambda: d.offer(a, 2.0)) == (False, True)
    assert pulses(lambda: d.offer(advert("n1", committed=(1,)), 4.0)) == (True, True)
    assert pulses(lambda: d.offer(advert("n1", committed=(1,)), 20.0)) == (True, True)
    url = a.http_url
    assert pulses(lambda: d.verified("n1", url, LaneCheck.VERIFIED, 21.0)) == (True, True)
    assert pulses(lambda: d.verified("n1", url, LaneCheck.VERIFIED, 22.0)) == (False, True)
    assert pulses(d.reach_changed) == (True, True)


def test_sources_complete_first_then_filling_relays_then_filling_peers() -> None:
    d = SourceDirectory("me", set(), ttl_s=100.0, max_entries=50, rng=random.Random(3))
    for k in range(4):
        d.offer(advert(f"peer-fill-{k}", "peer", filling=(7,)), 0.0)
        d.offer(advert(f"relay-fill-{k}", "relay", filling=(7,)), 0.0)
        d.offer(advert(f"peer-done-{k}", "peer", committed=(7,)), 0.0)
        d.offer(advert(f"other-{k}", "relay", committed=(6,)), 0.0)
    got = d.sources_for(7, now=1.0, limit=100)
    kinds = [s.id.rsplit("-", 1)[0] for s in got]
    assert kinds == ["peer-done"] * 4 + ["relay-fill"] * 4 + ["peer-fill"] * 4
    assert [s.complete for s in got] == [True] * 4 + [False] * 8
    limited = [s.id.rsplit("-", 1)[0] for s in d.sources_for(7, now=1.0, limit=6)]
    assert limited == ["peer-done"] * 4 + ["relay-fill"] * 2


def test_equivalent_sources_are_spread_by_the_seed() -> None:
    orders = set()
    for seed in range(6):
        d = SourceDirectory("me", set(), ttl_s=100.0, max_entries=50, rng=random.Random(seed))
        for k in range(6):
            d.offer(advert(f"p{k}", committed=(1,)), 0.0)
        orders.add(tuple(s.id for s in d.sources_for(1, now=1.0, limit=6)))
    assert len(orders) > 1


def test_advert_tier_round_trips_and_is_optional() -> None:
    tiered = NodeAdvert("Qm-a", "relay", "http://127.0.0.1:1", (1,), (), tier=1)
    assert NodeAdvert.decode(tiered.encode(), "Qm-a").tier == 1
    assert NodeAdvert.decode(advert("Qm-a").encode(), "Qm-a").tier is None  # an older node


@pytest.mark.parametrize("tier", [-1, True, "1", 10**6])
def test_advert_with_a_bad_tier_is_refused(tier: object) -> None:
    obj = {
        "v": 1,
        "peer_id": "Qm-a",
        "role": "relay",
        "http_url": "http://127.0.0.1:1",
        "committed": [],
        "filling": [],
        "tier": tier,
    }
    with pytest.raises(RemoteProtocolError, match="tier"):
        NodeAdvert.decode(wire.encode(obj), "Qm-a")


def test_directory_reports_advertised_tiers() -> None:
    d = SourceDirectory("me", set(), ttl_s=100.0, max_entries=8, rng=random.Random(0))
    d.offer(NodeAdvert("Qm-r", "relay", "http://127.0.0.1:2", (), (), tier=1), now=0.0)
    d.offer(advert("Qm-p"), now=0.0)
    assert d.tier_of("Qm-r") == 1
    assert d.tier_of("Qm-p") is None
    assert d.tier_of("Qm-unknown") is None


def _info(pid: str, role: str) -> NodeInfo:
    return NodeInfo(pid, role, "run", "http://127.0.0.1:1", (), None)


def _follower(upstreams: dict[str, NodeInfo], d: SourceDirectory, role: str = "relay") -> Follower:
    """The attributes the tier and requester logic read (it does no I/O)."""
    node = SimpleNamespace(config=SimpleNamespace(role=role))
    f = SimpleNamespace(upstreams=upstreams, directory=d, node=node)
    f.tier = lambda: Follower.tier(cast(Follower, f))
    f._same_tier_relay = lambda p: Follower._same_tier_relay(cast(Follower, f), p)
    return cast(Follower, f)


def test_a_follower_tier_counts_hops_from_the_origin() -> None:
    """Relays fed by the origin are tier 1 and exempt each other from super-seeding; nodes
    fed by relays are tier 2 and are super-seeded to (``Follower._same_tier_relay``)."""
    d = SourceDirectory("me", set(), ttl_s=100.0, max_entries=8, rng=random.Random(0))
    d.offer(NodeAdvert("Qm-r2", "relay", "http://127.0.0.1:2", (), (), tier=1), now=0.0)
    d.offer(NodeAdvert("Qm-p", "relay", "http://127.0.0.1:3", (), (), tier=2), now=0.0)
    d.offer(advert("Qm-old", "relay"), now=0.0)  # an older relay: no tier
    relay = _follower({"Qm-o": _info("Qm-o", "origin")}, d)
    assert relay.tier() == 1
    exempt = [Follower._same_tier_relay(relay, p) for p in ("Qm-r2", "Qm-p", "Qm-old", "Qm-x")]
    assert exempt == [True, False, False, False]
    assert _follower({"Qm-r2": _info("Qm-r2", "relay")}, d).tier() == 2
    assert _follower({"Qm-old": _info("Qm-old", "relay")}, d).tier() is None
    assert _follower({}, d).tier() is None


def test_a_node_whose_advert_offers_no_outside_lane_is_download_only() -> None:
    """No URL and no stream lane (a LAN URL serves only its neighbours): super-seeding never
    makes it a holder (``Follower._requester_kind``); unknown nodes are not presumed so."""
    d = SourceDirectory("me", set(), ttl_s=100.0, max_entries=8, rng=random.Random(0))
    d.offer(NodeAdvert("Qm-d", "peer", "", (), (), lan_url="http://192.168.77.2:8003"), 0.0)
    d.offer(NodeAdvert("Qm-e", "peer", "", (), (), stream_lane=True), now=0.0)
    d.offer(NodeAdvert("Qm-c", "peer", "http://10.0.0.3:8003", (), ()), now=0.0)
    assert [d.download_only(p) for p in ("Qm-d", "Qm-e", "Qm-c", "Qm-x")] == [
        True,
        False,
        False,
        False,
    ]
    d.offer(NodeAdvert("Qm-r2", "relay", "http://10.0.0.2:8002", (), (), tier=1), now=0.0)
    origin = {"Qm-o": _info("Qm-o", "origin")}
    kinds = [Follower._requester_kind(_follower(origin, d), p) for p in ("Qm-r2", "Qm-d")]
    assert kinds == [Requester.SIBLING, Requester.DOWNLOAD_ONLY]
    peer = _follower(origin, d, role="peer")  # a peer has no siblings to exempt
    assert Follower._requester_kind(peer, "Qm-r2") is Requester.SERVING


def test_a_same_step_replacement_waits_while_another_upstream_confirms_the_known_one() -> None:
    """After a trainer republishes a step, an upstream that has not caught up must not flip
    this node back while another upstream says what this node knows (it flip-flopped on
    every poll; the republish scenario ended on the old digest in 2 of 375 seeds)."""
    known = cast(VersionAnnouncement, SimpleNamespace(step=1, manifest_digest="new"))
    said = {"r1": (1, "new"), "r2": (1, "old")}
    ready = {"r1", "r2"}
    assert confirmed_elsewhere(known, "r2", said, ready)  # r1 says "new": r2's "old" waits
    assert not confirmed_elsewhere(known, "r1", said, ready)  # nobody else says "new"
    ready.discard("r1")  # r1 gone: its last word counts no more
    assert not confirmed_elsewhere(known, "r2", said, ready)
    assert not confirmed_elsewhere(None, "r2", said, ready)  # nothing known: nothing waits


def test_a_refusals_holder_is_unreachable_only_with_no_lane_now_and_none_coming() -> None:
    """``SourceDirectory.holder_reach``: what a follower names back to a super-seeding source
    (rule 11). Usable and pending holders are waited for as before; only one with no lane in
    scope, no direct connection, and no shared relay or a failed punch is named."""
    d = SourceDirectory(
        "me", set(), ttl_s=100.0, max_entries=16, rng=random.Random(0), require_verified=True
    )
    nat = dict(stream_lane=True, relays=("Qm-relay",))
    d.offer(NodeAdvert("Qm-pub", "peer", "http://10.0.0.3:8003", (), ()), 0.0)
    d.offer(NodeAdvert("Qm-bad", "peer", "http://10.0.0.4:8003", (), ()), 0.0)
    d.offer(NodeAdvert("Qm-eim", "peer", "", (), (), **nat), 0.0)  # type: ignore[arg-type]
    d.offer(NodeAdvert("Qm-sym", "peer", "", (), (), **nat), 0.0)  # type: ignore[arg-type]
    d.offer(NodeAdvert("Qm-far", "peer", "", (), (), stream_lane=True, relays=("Qm-other",)), 0.0)
    d.offer(NodeAdvert("Qm-lan", "peer", "", (), ()), 0.0)  # out of scope: no URL, no stream
    d.verified("Qm-pub", "http://10.0.0.3:8003", LaneCheck.VERIFIED, 1.0)
    d.verified("Qm-bad", "http://10.0.0.4:8003", LaneCheck.UNREACHABLE, 1.0)
    conn = frozenset({"Qm-relay"})
    failed = {"Qm-sym"}.__contains__

    def reach(pid: str, connected: frozenset[str] = conn, now: float = 2.0) -> HolderReach:
        return d.holder_reach(pid, now, connected=connected, punch_failed=failed)

    assert reach("Qm-pub") is HolderReach.USABLE  # a proven URL
    assert reach("Qm-bad") is HolderReach.UNREACHABLE  # its URL failed the challenge
    assert reach("Qm-eim") is HolderReach.PENDING  # a punch may open it: wait
    assert reach("Qm-eim", conn | {"Qm-eim"}) is HolderReach.USABLE  # punched: stream lane
    assert reach("Qm-sym") is HolderReach.UNREACHABLE  # its punch failed
    assert reach("Qm-sym", conn | {"Qm-sym"}) is HolderReach.USABLE  # ... unless held anyway
    assert reach("Qm-far") is HolderReach.UNREACHABLE  # no relay in common
    assert reach("Qm-lan") is HolderReach.UNREACHABLE
    assert reach("Qm-never") is HolderReach.UNKNOWN  # no advert: wait as before
    assert reach("me") is HolderReach.UNKNOWN
    assert reach("Qm-pub", now=200.0) is HolderReach.UNKNOWN  # its advert expired
    d.offer(NodeAdvert("Qm-new", "peer", "http://10.0.0.5:8003", (), ()), 0.0)
    assert reach("Qm-new") is HolderReach.PENDING  # its URL is still to be challenged
    for _ in range(5):  # it kept failing this node: scored out
        d.record("Qm-pub", delivered=False, now=2.0)
    assert reach("Qm-pub") is HolderReach.UNREACHABLE


async def test_a_follower_names_back_only_the_unreachable_holders() -> None:
    """``Follower._unreachable_holders``: the holders of a refusal the follower names back,
    read from its directory, its direct connections and its punch planner's failures."""
    d = SourceDirectory("me", set(), ttl_s=1e9, max_entries=8, rng=random.Random(0))
    d.offer(NodeAdvert("Qm-pub", "peer", "http://10.0.0.3:8003", (), ()), 0.0)
    d.offer(NodeAdvert("Qm-sym", "peer", "", (), (), stream_lane=True, relays=("Qm-r",)), 0.0)
    f = cast(SimpleNamespace, _follower({}, d, role="peer"))
    f.holders_named = Counter()
    f.node.p2p = SimpleNamespace(direct_peers=lambda: ["Qm-r"])
    # no reachability: only the planner's failures and the punch record are read here
    f.punching = Punching(
        f.node.p2p, "me", PunchConfig(), d, None, random.Random(0), lambda: None, list
    )
    named = ["Qm-pub", "Qm-sym", "Qm-x"]
    assert Follower._unreachable_holders(cast(Follower, f), named) == ()  # no punch failed yet
    now = trio.current_time()
    planner = f.punching.planner
    assert planner.start("Qm-sym", ("Qm-r",), frozenset({"Qm-r"}), now, random.Random(0))
    planner.done("Qm-sym", direct=False, now=now)
    assert Follower._unreachable_holders(cast(Follower, f), named) == ("Qm-sym",)
    assert f.holders_named == Counter(
        {HolderReach.USABLE: 2, HolderReach.PENDING: 1, HolderReach.UNKNOWN: 2,
         HolderReach.UNREACHABLE: 1}
    )  # fmt: skip


def test_a_node_whose_punches_keep_failing_counts_punch_only_holders_unreachable() -> None:
    """``PunchRecord``: after ``window`` failed punches in a row (a symmetric NAT here, say)
    a holder reachable only by a punch not tried yet is unreachable, not pending; one direct
    punch ends that."""
    record = PunchRecord(window=2)
    assert not record.failing()
    record.done(False)
    assert not record.failing()  # one failure says little: that peer's NAT, perhaps
    record.done(False)
    assert record.failing()
    record.done(True)
    assert not record.failing()
    with pytest.raises(ValueError, match="window"):
        PunchRecord(window=0)
    d = SourceDirectory("me", set(), ttl_s=100.0, max_entries=8, rng=random.Random(0))
    d.offer(NodeAdvert("Qm-eim", "peer", "", (), (), stream_lane=True, relays=("Qm-r",)), 0.0)
    d.offer(NodeAdvert("Qm-pub", "peer", "http://10.0.0.3:8003", (), ()), 0.0)
    conn = frozenset({"Qm-r"})
    assert d.holder_reach("Qm-eim", 1.0, connected=conn) is HolderReach.PENDING
    hopeless = d.holder_reach("Qm-eim", 1.0, connected=conn, punching_fails=True)
    assert hopeless is HolderReach.UNREACHABLE
    usable = d.holder_reach("Qm-pub", 1.0, connected=conn, punching_fails=True)
    assert usable is HolderReach.USABLE  # a lane needs no punch
