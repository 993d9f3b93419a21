"""Hostile peers against real nodes on 127.0.0.1: no frame ends a node, no peer holds the slots.

An origin -> relay -> peer chain of real shardcast nodes (libp2p hosts and HTTP lanes) takes
every kind of malformed frame (:class:`p2p.hostile.Malformed`) on the gossip protocol and on
the info request protocol, each from a fresh attacker identity, and must go on serving: every
node answers an honest info request after each frame, and a version published after the
attacks still reaches the peer.
"""

from __future__ import annotations

import logging
import random
from dataclasses import replace
from pathlib import Path

import pytest
import trio
import trio.testing
from libp2p.utils.varint import encode_uvarint

from p2p import wire
from p2p.errors import RemoteProtocolError
from p2p.host import HostConfig, P2PNode
from p2p.hostile import MESHSUB, HostileClient, Malformed, frame
from p2p.identity import Identity
from p2p.limits import ANY_STREAM, LedgerConfig, ResourceLimits
from shardcast.download.follower import FollowConfig, Follower, VersionRecord
from shardcast.node.node import NodeConfig, ShardcastNode
from shardcast.publish.origin import Origin, OriginConfig
from shardcast.wire.finish import check_versions_gossip
from shardcast.wire.manifest import Manifest
from shardcast.wire.messages import INFO_PROTOCOL, versions_topic
from tests.helpers import TRAINER, make_checkpoint, trust

SIZES = {"model-00001-of-00001.safetensors": 100_000}
# bans off (an attacker is only counted), so that one attacker can send every frame kind
HOST = HostConfig(
    limits=ResourceLimits(request_read_timeout_s=0.5), ledger=LedgerConfig(ban_score=-1e9)
)


def _cfg(role: str, data: Path) -> NodeConfig:
    return NodeConfig(role, "run", data, host=HOST, info_timeout_s=5)


async def _honest_info(honest: ShardcastNode, target: ShardcastNode) -> None:
    if target.p2p.peer_id not in honest.p2p.connected_peers():
        await honest.p2p.connect(target.p2p.multiaddrs()[0])
    info = await honest.query_info(target.p2p.peer_id)
    assert info.peer_id == target.p2p.peer_id


async def test_malformed_frames_end_only_their_stream(tmp_path: Path) -> None:
    tl = trust()
    committed: dict[int, trio.Event] = {0: trio.Event(), 1: trio.Event()}

    async def on_commit(m: Manifest, path: Path, rec: VersionRecord) -> None:
        committed[m.step].set()

    async with (
        ShardcastNode.open(TRAINER, tl, _cfg("trainer", tmp_path / "o")) as o,
        ShardcastNode.open(Identity.from_seed("relay"), tl, _cfg("relay", tmp_path / "r")) as r,
        ShardcastNode.open(Identity.from_seed("peer"), tl, _cfg("peer", tmp_path / "p")) as p,
        ShardcastNode.open(Identity.from_seed("honest"), tl, _cfg("peer", tmp_path / "h")) as h,
        trio.open_nursery() as nursery,
    ):
        origin = Origin(o, OriginConfig(shard_size=32 * 1024))
        fr = Follower(
            r,
            FollowConfig(upstreams=(o.p2p.multiaddrs()[0],), poll_interval_s=0.2),
            random.Random(1),
        )
        fp = Follower(
            p,
            FollowConfig(upstreams=(r.p2p.multiaddrs()[0],), poll_interval_s=0.2),
            random.Random(2),
            on_commit=on_commit,
        )
        await nursery.start(fr.run)
        await nursery.start(fp.run)
        await origin.publish(make_checkpoint(tmp_path / "ck0", SIZES, seed=0), 0)
        with trio.fail_after(30):
            await committed[0].wait()

        topic = versions_topic("run")
        for victim in (o, r, p):
            async with HostileClient.open() as evil:
                await evil.connect(victim.p2p.multiaddrs()[0])
                for protocol in (MESHSUB, INFO_PROTOCOL):
                    for kind in Malformed:
                        data = frame(kind, topic)
                        if kind is Malformed.HOSTILE_RPC:
                            data += frame(Malformed.GARBAGE)  # then end the stream
                        ended = await evil.send(victim.p2p.peer_id, protocol, data)
                        assert ended in ("reset", "eof"), (victim.config.role, protocol, kind)
                        await _honest_info(h, victim)
            offences = victim.p2p.boundary_statistics().peers.offences
            # garbage protobuf on gossip, an oversized length and an over-long varint on the
            # request protocol, garbage requests; the library resets the rest itself
            assert offences.get("malformed_frame", 0) >= 3, offences
            assert offences.get("bad_request", 0) >= 2, offences
        # a request that never finishes sending its body loses its slot after the deadline
        async with HostileClient.open() as evil:
            await evil.connect(r.p2p.multiaddrs()[0])
            with trio.fail_after(5):
                assert await evil.send(r.p2p.peer_id, INFO_PROTOCOL, b"", hold=True) == "reset"
        assert r.p2p.boundary_statistics().peers.offences["slow_request"] == 1

        # the chain still carries a new version end to end
        await origin.publish(make_checkpoint(tmp_path / "ck1", SIZES, seed=1), 1)
        with trio.fail_after(30):
            await committed[1].wait()
        nursery.cancel_scope.cancel()


async def test_one_peer_cannot_hold_the_request_slots() -> None:
    limits = ResourceLimits(requests_per_peer=2, request_read_timeout_s=30)
    cfg = HostConfig(limits=limits)
    proto = "/shardnet/test-info/1.0.0"

    async def answer(peer: str, req: bytes) -> bytes:
        return b"ok"

    async with (
        P2PNode.open(Identity.from_seed("slots-v"), cfg) as victim,
        P2PNode.open(Identity.from_seed("slots-h"), cfg) as honest,
        HostileClient.open() as evil,
    ):
        victim.serve(
            proto,
            answer,
            max_request_bytes=64,
            max_response_bytes=64,
            timeout_s=10,
            max_concurrent=4,
        )
        await evil.connect(victim.multiaddrs()[0])
        await honest.connect(victim.multiaddrs()[0])
        for _ in range(6):
            # half a request, then nothing; streams over the cap are reset by the victim
            await evil.hold(victim.peer_id, proto, b"\x05ab")
        await trio.testing.wait_all_tasks_blocked(0.05)
        # the attacker got its 2 slots, the rest of its streams were refused; honest peers
        # still have the other 2 of the protocol's 4
        for _ in range(3):
            got = await victim_request(honest, victim.peer_id, proto)
            assert got == b"ok"
        stats = victim.boundary_statistics().streams[proto]
        assert stats.open == 2
        assert stats.refused.get("peer_limit", 0) >= 4
        assert victim.boundary_statistics().streams[ANY_STREAM].open >= 2


async def victim_request(node: P2PNode, peer: str, proto: str) -> bytes:
    return await node.request(peer, proto, b"hi", max_response_bytes=64, timeout_s=5)


async def test_untrusted_gossip_is_not_forwarded(tmp_path: Path) -> None:
    """Signed-by-libp2p gossip whose payload fails the topic check stops at the first node."""
    tl = trust()
    ledger = LedgerConfig(ban_score=-1e9)  # keep the flooder connected: count, do not ban
    host = replace(HOST, ledger=ledger)
    cfg_r = NodeConfig("relay", "run", tmp_path / "r", host=host)
    cfg_p = NodeConfig("peer", "run", tmp_path / "p", host=host)
    async with (
        ShardcastNode.open(Identity.from_seed("g-relay"), tl, cfg_r) as r,
        ShardcastNode.open(Identity.from_seed("g-peer"), tl, cfg_p) as p,
        HostileClient.open() as evil,
    ):
        topic = versions_topic("run")
        rsub = await r.p2p.subscribe(topic, check_versions_gossip(tl, "run"))
        psub = await p.p2p.subscribe(topic, check_versions_gossip(tl, "run"))
        await p.p2p.connect(r.p2p.multiaddrs()[0])
        await p.p2p.wait_for_subscriber(r.p2p.peer_id, topic, timeout_s=10)
        await evil.connect(r.p2p.multiaddrs()[0])
        n = 200
        junk = wire.encode({"body": b"x" * 1000, "signer": evil.identity.peer_id, "sig": b"0" * 64})
        rpcs = b"".join(evil.signed_publish(topic, junk) for _ in range(n))
        # then a garbage frame: the stream ends once the relay has read every message
        assert await evil.send(r.p2p.peer_id, MESHSUB, rpcs + frame(Malformed.GARBAGE)) == "reset"
        await trio.testing.wait_all_tasks_blocked(0.05)
        offences = r.p2p.boundary_statistics().peers.offences
        assert offences["invalid_gossip"] == n
        # neither the relay's subscription nor the peer saw any of them
        assert rsub.statistics().received == 0
        assert psub.statistics().received == 0
        assert p.p2p.boundary_statistics().peers.offences == {}


def _never(origin: str, data: bytes) -> None:
    raise RemoteProtocolError(origin, "not expected")


async def test_repeat_offender_is_banned_and_disconnected() -> None:
    ledger = LedgerConfig(ban_s=600)  # two malformed frames (-60 each) within 20 s reach -100
    cfg = HostConfig(ledger=ledger)
    async with (
        P2PNode.open(Identity.from_seed("ban-v"), cfg) as victim,
        P2PNode.open(Identity.from_seed("ban-h"), cfg) as honest,
        HostileClient.open() as evil,
    ):
        await victim.subscribe("t", _never)
        await honest.connect(victim.multiaddrs()[0])
        await evil.connect(victim.multiaddrs()[0])
        idle = await evil.hold(victim.peer_id, MESHSUB, b"")  # ends when the connection does
        for _ in range(2):
            assert await evil.send(victim.peer_id, MESHSUB, frame(Malformed.GARBAGE)) == "reset"
        stats = victim.boundary_statistics()
        assert stats.peers.banned == (evil.identity.peer_id,)
        # its connection is closed, and a new one gets every stream refused
        assert await evil.wait_ended(idle, wait_s=5) in ("reset", "eof")
        await evil.connect(victim.multiaddrs()[0])
        assert await evil.send(victim.peer_id, MESHSUB, b"") == "reset"
        # honest peers are served as before
        with pytest.raises(RemoteProtocolError):  # a live node refusing an unknown protocol
            await honest.request(victim.peer_id, "/nope/1", b"x", max_response_bytes=8, timeout_s=5)
        assert honest.peer_id in victim.connected_peers()


@pytest.fixture
def stall_clock() -> trio.testing.MockClock:
    """Real-time pace, plus :meth:`~trio.testing.MockClock.jump` to stand for the event loop
    having had no CPU for a while (every deadline and timer passes at once)."""
    return trio.testing.MockClock(rate=1.0)


async def test_a_body_late_because_this_node_stalled_is_not_charged(
    stall_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    """An honest peer's request body reaches a node whose own loop stood still for longer
    than the read timeout (an overloaded host): the request is answered and nobody is
    charged; the node's loop lag says how long it stood still."""
    caplog.set_level(logging.INFO, logger="p2p.host")
    cfg = HostConfig(limits=ResourceLimits(request_read_timeout_s=1.0))
    proto = "/shardnet/test-info/1.0.0"

    async def answer(peer: str, req: bytes) -> bytes:
        return b"ok:" + req

    async with (
        P2PNode.open(Identity.from_seed("stall-v"), cfg) as victim,
        HostileClient.open() as client,
    ):
        victim.serve(proto, answer, max_request_bytes=64, max_response_bytes=64, timeout_s=10)
        await client.connect(victim.multiaddrs()[0])
        stream = await client.open_stream(victim.peer_id, proto)
        await trio.testing.wait_all_tasks_blocked(0.05)  # the victim is reading the body
        stall_clock.jump(2.5)  # the process got no CPU for 2.5 s
        await stream.write(encode_uvarint(2) + b"hi")
        with trio.fail_after(5):
            reply = await stream.read(64)
        assert reply == encode_uvarint(5) + b"ok:hi"
        assert victim.boundary_statistics().peers.offences == {}
        assert victim.loop_lag.worst(trio.current_time(), 10.0) >= 2.0
        late = [r.getMessage() for r in caplog.records if "event_loop_late" in r.getMessage()]
        assert len(late) == 1, late
        assert float(late[0].split("lag_s=")[1].split()[0]) >= 2.0, late

        # a peer that sends nothing is still charged after 1 s of the node's own time
        silent = await client.open_stream(victim.peer_id, proto)
        assert await client.wait_ended(silent, wait_s=5) == "reset"
        assert victim.boundary_statistics().peers.offences == {"slow_request": 1}
