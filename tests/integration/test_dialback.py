"""The dial-back reachability check on real hosts on 127.0.0.1: a lane that answers is
reached, one on a closed port is not, a URL on another address is not dialled, and a follower
whose lane cannot be reached advertises no URL (its URL only to its own network, where a
neighbour verifies and uses it), with the metrics that show it."""

from __future__ import annotations

import random
from pathlib import Path

import trio

from p2p.http_server import HttpServerConfig
from p2p.identity import Identity
from shardcast.core.reachability import DialbackResult, LaneCheck, Reach
from shardcast.download.discovery import NodeAdvert, check_advert_gossip, nodes_topic
from shardcast.download.follower import FollowConfig, Follower
from shardcast.node.dialback import ask
from shardcast.node.node import NodeConfig, ShardcastNode
from tests.helpers import TRAINER, closed_port, trust


async def test_dialback_reaches_an_open_lane_and_not_a_closed_one(tmp_path: Path) -> None:
    tl = trust()
    relay = Identity.from_seed("dialer-2")
    async with (
        ShardcastNode.open(TRAINER, tl, NodeConfig("trainer", "run", tmp_path / "o")) as o,
        ShardcastNode.open(relay, tl, NodeConfig("relay", "run", tmp_path / "r")) as r,
        ShardcastNode.open(
            Identity.from_seed("asker"), tl, NodeConfig("peer", "run", tmp_path / "p")
        ) as p,
    ):
        await p.p2p.connect(o.p2p.multiaddrs()[0])
        await p.p2p.connect(r.p2p.multiaddrs()[0])
        o_id, r_id = o.identity.peer_id, r.identity.peer_id
        closed = f"http://127.0.0.1:{closed_port()}"
        with trio.fail_after(30):
            assert await ask(p.p2p, o_id, p.http_url, 10.0) is DialbackResult.REACHED
            assert await ask(p.p2p, r_id, closed, 10.0) is DialbackResult.NOT_REACHED
            # one dial per asker per 30 s: not an amplifier
            assert await ask(p.p2p, r_id, p.http_url, 10.0) is DialbackResult.REFUSED
            # a URL on another address than the asker's is never dialled
            other = "http://127.0.0.2:1"
            assert await ask(p.p2p, o_id, other, 10.0) is DialbackResult.MISMATCH


async def test_a_follower_on_a_closed_port_learns_it_and_advertises_no_url(
    tmp_path: Path,
) -> None:
    tl = trust()
    async with (
        ShardcastNode.open(TRAINER, tl, NodeConfig("trainer", "run", tmp_path / "o")) as o,
        trio.open_nursery() as nursery,
    ):
        feed = await o.p2p.subscribe(nodes_topic("run"), check_advert_gossip)
        public = f"http://127.0.0.1:{closed_port()}"  # what a NATed peer would claim
        cfg = NodeConfig("peer", "run", tmp_path / "p", public_url=public)
        node = await nursery.start(_open, Identity.from_seed("nat"), cfg)
        f = Follower(
            node,
            FollowConfig(upstreams=(o.p2p.multiaddrs()[0],), advert_interval_s=0.5),
            random.Random(1),
        )
        await nursery.start(f.run)
        after = 0
        with trio.fail_after(30):
            async for msg in feed:
                advert = NodeAdvert.decode(msg.data, msg.origin)
                assert advert.http_url == ""  # never the unreachable URL
                if f.reachability.rounds > 0:
                    after += 1  # adverts sent once it knew
                    if after == 3:
                        break
        assert f.reachability.state is Reach.UNREACHABLE
        assert advert.lan_url == public  # a loopback URL: offered to this host's nodes only
        status = f.reachability_status()
        assert status["state"] == "unreachable"
        assert status["advertised"] is False
        text = node.metrics.render().decode()
        assert 'shardnet_lane_reachability{state="unreachable"} 1.0' in text
        assert 'shardnet_lane_reachability{state="reachable"} 0.0' in text
        assert 'shardnet_dialback_answers_total{result="not_reached"}' in text
        assert 'shardnet_dialback_answers_total{result="not_reached"} 0.0' not in text
        nursery.cancel_scope.cancel()


async def test_a_reachable_follower_advertises_its_url(tmp_path: Path) -> None:
    tl = trust()
    async with (
        ShardcastNode.open(TRAINER, tl, NodeConfig("trainer", "run", tmp_path / "o")) as o,
        trio.open_nursery() as nursery,
    ):
        feed = await o.p2p.subscribe(nodes_topic("run"), check_advert_gossip)
        node = await nursery.start(
            _open, Identity.from_seed("pub"), NodeConfig("peer", "run", tmp_path / "p")
        )
        f = Follower(
            node,
            FollowConfig(upstreams=(o.p2p.multiaddrs()[0],), advert_interval_s=0.5),
            random.Random(1),
        )
        await nursery.start(f.run)
        with trio.fail_after(30):
            async for msg in feed:
                advert = NodeAdvert.decode(msg.data, msg.origin)
                if advert.http_url:
                    break
        assert advert.http_url == node.http_url
        assert f.reachability.state is Reach.REACHABLE
        nursery.cancel_scope.cancel()


async def test_a_lan_url_is_verified_and_used_by_a_neighbour_not_offered_to_others(
    tmp_path: Path,
) -> None:
    """Peer A's lane listens on 127.0.0.2 while its libp2p connections come from 127.0.0.1:
    the trainer, asked to dial it back, answers ``mismatch`` (a non-global address seen from
    elsewhere, as behind a NAT), so A advertises no URL, only a LAN URL. Peer B, on the same
    host, tries that URL, verifies it and may fetch from A; an advert naming a private
    address of a network this host is not on is not tried."""
    tl = trust()
    async with (
        ShardcastNode.open(TRAINER, tl, NodeConfig("trainer", "run", tmp_path / "o")) as o,
        trio.open_nursery() as nursery,
    ):
        up = FollowConfig(upstreams=(o.p2p.multiaddrs()[0],), advert_interval_s=0.5)
        a_cfg = NodeConfig("peer", "run", tmp_path / "a", http=HttpServerConfig(host="127.0.0.2"))
        a_node = await nursery.start(_open, Identity.from_seed("lan-a"), a_cfg)
        b_node = await nursery.start(
            _open, Identity.from_seed("lan-b"), NodeConfig("peer", "run", tmp_path / "b")
        )
        await b_node.p2p.connect(a_node.p2p.multiaddrs()[0])  # neighbours (gossip mesh)
        a = Follower(a_node, up, random.Random(1))
        b = Follower(b_node, up, random.Random(2))
        assert (b.directory.backoff, b.reachability.config) == (up.lane_backoff, up.reachability)
        await nursery.start(a.run)
        await nursery.start(b.run)
        a_id = a_node.identity.peer_id
        with trio.fail_after(30):
            while b.directory.lane_status(a_id, a_node.http_url) is None:
                await b.directory.changed.wait()
        assert a_node.http_url.startswith("http://127.0.0.2:")
        assert a.reachability.state is Reach.UNREACHABLE
        assert a.reachability.last_answers == (DialbackResult.MISMATCH,)
        lane = b.directory.lane_status(a_id, a_node.http_url)
        assert lane is not None
        assert lane.result is LaneCheck.VERIFIED
        assert b.intake.checks[LaneCheck.VERIFIED] >= 1
        assert 'shardnet_advert_checks_total{result="verified"}' in b_node.metrics.render().decode()
        # the same advert with a private address of another network: not B's to try
        foreign = NodeAdvert("x", "peer", "", (1,), (), lan_url="http://198.18.231.7:8003")
        before = b.intake.out_of_scope
        assert b.intake.in_scope(foreign).http_url == ""
        assert b.intake.out_of_scope == before + 1
        nursery.cancel_scope.cancel()


async def _open(identity: Identity, cfg: NodeConfig, *, task_status) -> None:  # type: ignore[no-untyped-def]
    async with ShardcastNode.open(identity, trust(), cfg) as node:
        task_status.started(node)
        await trio.sleep_forever()
