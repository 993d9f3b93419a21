"""Source discovery (``shardcast.discovery``): node adverts and the bounded directory."""

from __future__ import annotations

import random

import pytest

from p2p import wire
from p2p.errors import RemoteProtocolError
from shardcast.discovery import NodeAdvert, SourceDirectory


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
