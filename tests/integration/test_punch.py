"""Nodes use circuits, on real hosts on 127.0.0.1: two peers whose lanes are unreachable
(their public URL is a closed port) follow one relay and hold no connection to each other. Each
learns it is unreachable (dial-back), reserves a slot on the relay and advertises it; the relay
super-seeds (each shard to one of them only), so each must fetch the other's shards: it dials
the other through the relay, DCUtR opens a direct connection, and the stream lane carries the
bytes over it. Loopback has no NAT: this checks the wiring (decision, reservation, advert,
punch, lane), not NAT traversal (tests/deploy/test_nat.py does that in namespaces).
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import trio

from p2p.circuits import CircuitConfig
from p2p.host import HostConfig, P2PNode
from p2p.identity import Identity
from shardcast.core import PunchConfig
from shardcast.download.discovery import NodeAdvert, check_advert_gossip, nodes_topic
from shardcast.download.follower import FollowConfig, Follower, VersionRecord
from shardcast.node.node import NodeConfig, ShardcastNode
from shardcast.publish.origin import Origin, OriginConfig
from shardcast.wire.manifest import Manifest
from tests.helpers import TRAINER, closed_port, make_checkpoint, trust

SIZES = {"model-00001-of-00002.safetensors": 400_000, "model-00002-of-00002.safetensors": 150_001}
LOOPBACK = ("/ip4/127.0.0.1/tcp/0",)


async def _open(identity: Identity, cfg: NodeConfig, *, task_status) -> None:  # type: ignore[no-untyped-def]
    async with ShardcastNode.open(identity, trust(), cfg) as node:
        task_status.started(node)
        await trio.sleep_forever()


# py-libp2p 0.8.1's DCUtR leaves the socket of a failed simultaneous dial to the garbage
# collector (ResourceWarning from dcutr._perform_hole_punch): a library defect, tolerated here.
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
@pytest.mark.parametrize("ahead", [False, True], ids=["on-demand", "ahead"])
async def test_two_unreachable_peers_exchange_shards_over_a_punched_connection(
    tmp_path: Path, ahead: bool
) -> None:
    """``ahead``: the peers punch to each other as soon as they hear each other's advert,
    before any version exists (:meth:`shardcast.core.PunchPlanner.ahead`); else only when a
    download wants the other's bytes."""
    tl = trust()
    ck = make_checkpoint(tmp_path / "ck", SIZES, seed=7)
    want = {name: (ck / name).read_bytes() for name in SIZES}  # publish moves the checkpoint
    committed: dict[str, Path] = {}
    done = trio.Event()

    def hook(name: str):  # type: ignore[no-untyped-def]
        async def on_commit(m: Manifest, path: Path, rec: VersionRecord) -> None:
            committed[name] = path
            if len(committed) == 2:
                done.set()

        return on_commit

    relay_cfg = NodeConfig(
        "relay",
        "run",
        tmp_path / "r",
        serve_once_s=600.0,  # each shard to one peer: the other must get it from that peer
        host=HostConfig(LOOPBACK, circuits=CircuitConfig(hop=True)),
    )
    async with (
        ShardcastNode.open(TRAINER, tl, NodeConfig("trainer", "run", tmp_path / "o")) as o,
        ShardcastNode.open(Identity.from_seed("punch-relay"), tl, relay_cfg) as r,
        trio.open_nursery() as nursery,
    ):
        r_id = r.identity.peer_id
        adverts = await r.p2p.subscribe(nodes_topic("run"), check_advert_gossip)
        fr = Follower(
            r,
            FollowConfig(upstreams=(o.p2p.multiaddrs()[0],), poll_interval_s=0.2),
            random.Random(1),
        )
        await nursery.start(fr.run)
        peers: dict[str, tuple[ShardcastNode, Follower]] = {}
        for name in ("a", "b"):
            cfg = NodeConfig(
                "peer",
                "run",
                tmp_path / name,
                public_url=f"http://127.0.0.1:{closed_port()}",  # what a NATed peer claims
                host=HostConfig(LOOPBACK, circuits=CircuitConfig(timeout_s=10.0)),
            )
            node = await nursery.start(_open, Identity.from_seed(f"punch-{name}"), cfg)
            f = Follower(
                node,
                FollowConfig(
                    upstreams=(r.p2p.multiaddrs()[0],),
                    poll_interval_s=0.2,
                    advert_interval_s=0.5,
                    punch=PunchConfig(ahead_max_direct=8 if ahead else 0),
                ),
                random.Random(2),
                on_commit=hook(name),
            )
            await nursery.start(f.run)
            peers[name] = (node, f)
        ids = {name: node.identity.peer_id for name, (node, _) in peers.items()}

        # each learns it is unreachable, reserves on the relay and says so
        with trio.fail_after(60):
            told: set[str] = set()
            async for msg in adverts:
                advert = NodeAdvert.decode(msg.data, msg.origin)
                if advert.stream_lane and advert.relays == (r_id,):
                    told.add(advert.peer_id)
                    if told == set(ids.values()):
                        break
        (a, fa), (b, fb) = peers["a"], peers["b"]
        if ahead:  # a direct connection before any version exists
            assert isinstance(a.p2p, P2PNode)
            assert isinstance(b.p2p, P2PNode)
            with trio.fail_after(120):
                await a.p2p.wait_direct(ids["b"])
                await b.p2p.wait_direct(ids["a"])
            made = [f.reachability_status()["punches"]["ahead"] for f in (fa, fb)]
            assert sum(made) >= 1, made
        else:
            for node, _ in peers.values():  # only the relay: no connection to each other yet
                assert node.p2p.direct_peers() == [r_id]

        await Origin(o, OriginConfig(shard_size=64 * 1024, shards_per_part=2)).publish(ck, 0)
        with trio.fail_after(90):
            await done.wait()

        for name, path in committed.items():  # byte-exact
            for f_name, data in want.items():
                assert (path / f_name).read_bytes() == data, name
        from_other = {
            name: f.records[-1].stats.bytes_by_source.get(ids[other], 0)  # type: ignore[union-attr]
            for name, other, f in (("a", "b", fa), ("b", "a", fb))
        }
        assert sum(from_other.values()) > 0, from_other  # shards crossed between the NATed peers
        # the drivers decided to punch: the only way the two could meet (a punch may still
        # be running: py-libp2p finishes a round by itself, and the lane needs only the
        # direct connection)
        assert fa.reachability_status()["punches"]["started"] >= 1 or (
            fb.reachability_status()["punches"]["started"] >= 1
        )
        # the bytes went over a direct connection: the circuit is gone
        assert ids["b"] in a.p2p.direct_peers() or ids["a"] in b.p2p.direct_peers()
        assert fa.reachability_status()["relays"] == [r_id]
        nursery.cancel_scope.cancel()
