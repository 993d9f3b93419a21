"""Circuit relay v2 and DCUtR on real hosts on 127.0.0.1 (:mod:`p2p.circuits`).

R is a relay (``hop``); A stands for a peer behind a NAT: it holds a reservation on R and
serves its lane only over libp2p streams; B reaches A through R, then upgrades to a direct
connection, over which it fetches A's bytes. Loopback has no NAT, so this checks the wiring
(reservation, relayed dial, the hole punch's exchange, closing the circuit, the relay's
bounds), not NAT traversal; that was measured in network namespaces (module docstring of
:mod:`p2p.circuits`).
"""

from __future__ import annotations

import random
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest
import trio

from p2p.bytestream import STREAM_LANE_PROTOCOL, ByteStream, stream_lane_url
from p2p.circuits import CircuitConfig, Circuits, _Relay
from p2p.errors import ConfigError, PeerUnreachable, StreamBroken
from p2p.host import HostConfig, P2PNode
from p2p.http_client import HttpClient
from p2p.http_server import HttpRequest, HttpResponse, HttpServer, file_response
from p2p.identity import Identity

BLOB = random.Random(3).randbytes(2 * (1 << 20) + 77)


@dataclass
class Trio:
    r: P2PNode
    a: P2PNode
    b: P2PNode
    client: HttpClient  # B's
    url: str  # p2p://<A>/blob


def circuits_of(node: P2PNode) -> Circuits:
    assert node.circuits is not None
    return node.circuits


@asynccontextmanager
async def relay_and_two(tmp: Path, relay: CircuitConfig) -> AsyncIterator[Trio]:
    blob = tmp / "blob"
    blob.write_bytes(BLOB)

    async def handle(req: HttpRequest) -> HttpResponse:
        return file_response(req, blob, len(BLOB))

    def cfg(circuits: CircuitConfig) -> HostConfig:
        return HostConfig(("/ip4/127.0.0.1/tcp/0",), dial_timeout_s=3.0, circuits=circuits)

    ids = [Identity.from_seed(f"circuit-{n}") for n in "rab"]
    async with (
        P2PNode.open(ids[0], cfg(relay)) as r,
        P2PNode.open(ids[1], cfg(CircuitConfig(timeout_s=10))) as a,
        P2PNode.open(ids[2], cfg(CircuitConfig(timeout_s=10))) as b,
    ):
        a.serve_stream(STREAM_LANE_PROTOCOL, HttpServer(handle).serve_stream)
        await a.connect(r.multiaddrs()[0], keep=False)
        await circuits_of(a).reserve(r.peer_id)
        await b.connect(r.multiaddrs()[0], keep=False)

        async def opener(peer: str, timeout_s: float) -> ByteStream:
            return await b.open_stream(peer, STREAM_LANE_PROTOCOL, timeout_s)

        async with HttpClient(open_stream=opener) as client:
            yield Trio(r, a, b, client, stream_lane_url(a.peer_id) + "/blob")


# py-libp2p 0.8.1's DCUtR leaves the socket of each failed simultaneous dial for the garbage
# collector to close (``ResourceWarning: unclosed <socket ... laddr=('0.0.0.0', 0)>`` from
# ``dcutr._perform_hole_punch``): a library defect, tolerated here and named in the report.
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
async def test_a_relayed_dial_becomes_a_direct_connection_for_the_lane(tmp_path: Path) -> None:
    async with relay_and_two(tmp_path, CircuitConfig(hop=True)) as t:
        cb = circuits_of(t.b)
        await cb.connect_via(t.r.multiaddrs()[0], t.a.peer_id)
        assert t.a.peer_id in t.b.connected_peers()
        assert not cb.direct(t.a.peer_id)  # only the circuit so far
        assert await cb.hole_punch(t.a.peer_id)
        assert cb.direct(t.a.peer_id)
        got = await t.client.get_bytes(t.url, max_bytes=len(BLOB), timeout_s=10)
        assert got == BLOB


async def test_a_circuit_carries_no_shards(tmp_path: Path) -> None:
    """The relay cuts a circuit after ``circuit_bytes``: a small answer passes, a body bigger
    than that, asked over the circuit alone, breaks (the relay resets both ends at once, so
    the client's retry on a fresh stream finds no connection left)."""
    relay = CircuitConfig(hop=True, circuit_bytes=64 * 1024)
    async with relay_and_two(tmp_path, relay) as t:
        await circuits_of(t.b).connect_via(t.r.multiaddrs()[0], t.a.peer_id)
        small = [c async for c in t.client.stream_range(t.url, 0, 1000, timeout_s=5)]
        assert b"".join(small) == BLOB[:1000]  # coordination-sized exchanges pass
        with pytest.raises((StreamBroken, PeerUnreachable)):
            await t.client.get_bytes(t.url, max_bytes=len(BLOB), timeout_s=5)


async def test_no_reservation_no_circuit(tmp_path: Path) -> None:
    async with relay_and_two(tmp_path, CircuitConfig(hop=True)) as t:
        stranger = Identity.from_seed("circuit-stranger").peer_id
        with pytest.raises(PeerUnreachable, match="relayed dial"):
            await circuits_of(t.b).connect_via(t.r.multiaddrs()[0], stranger)


def test_circuit_config_is_checked() -> None:
    with pytest.raises(ConfigError, match="circuit_bytes"):
        CircuitConfig(circuit_bytes=0)
    with pytest.raises(ConfigError, match="timeout_s"):
        CircuitConfig(timeout_s=0)


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")  # as above
async def test_the_host_punches_through_a_relay_it_holds_a_connection_to(tmp_path: Path) -> None:
    """:meth:`P2PNode.punch`: the relay's address is the connection's; the peer becomes a
    direct peer, and only then carries the lane."""
    async with relay_and_two(tmp_path, CircuitConfig(hop=True)) as t:
        assert t.a.peer_id not in t.b.direct_peers()
        assert await t.b.punch(t.a.peer_id, t.r.peer_id)
        assert t.a.peer_id in t.b.direct_peers()
        assert await t.b.punch(t.a.peer_id, t.r.peer_id)  # already direct: nothing to do
        got = await t.client.get_bytes(t.url, max_bytes=len(BLOB), timeout_s=10)
        assert got == BLOB


async def test_a_host_without_circuits_neither_reserves_nor_punches() -> None:
    ids = [Identity.from_seed(f"circuit-off-{n}").peer_id for n in "ab"]
    cfg = HostConfig(("/ip4/127.0.0.1/tcp/0",))
    async with P2PNode.open(Identity.from_seed("circuit-off"), cfg) as node:
        with pytest.raises(PeerUnreachable, match="circuits are off"):
            await node.reserve(ids[0])
        with pytest.raises(PeerUnreachable, match="circuits are off"):
            await node.punch(ids[0], ids[1])
        assert node.direct_peers() == []


async def test_one_circuit_ending_leaves_another_to_the_same_peer_open(tmp_path: Path) -> None:
    """Two sources reach A through R at once (as two peers punching A ahead of need); the
    first closes its circuit (its punch is done). The second circuit still carries an
    exchange: the relay ends only the circuit that ended (py-libp2p 0.8.1's relay kept its
    circuits by PeerID and, on the end of one, closed the streams of whichever other circuit
    of that peer came last: ``relayed dial failed`` in a third of the lab's punches)."""
    async with relay_and_two(tmp_path, CircuitConfig(hop=True)) as t:
        cfg = HostConfig(("/ip4/127.0.0.1/tcp/0",), dial_timeout_s=3.0, circuits=CircuitConfig())
        async with P2PNode.open(Identity.from_seed("circuit-c"), cfg) as c:
            await c.connect(t.r.multiaddrs()[0], keep=False)
            await circuits_of(t.b).connect_via(t.r.multiaddrs()[0], t.a.peer_id)
            await circuits_of(c).connect_via(t.r.multiaddrs()[0], t.a.peer_id)
            await circuits_of(t.b).close_relayed(t.a.peer_id)
            relay = circuits_of(t.r).protocol
            assert isinstance(relay, _Relay)
            with trio.fail_after(10):
                await relay.wait_ended(2)  # both directions of B's circuit

            async def opener(peer: str, timeout_s: float) -> ByteStream:
                return await c.open_stream(peer, STREAM_LANE_PROTOCOL, timeout_s)

            async with HttpClient(open_stream=opener) as client:
                for _ in range(3):
                    got = [ch async for ch in client.stream_range(t.url, 0, 1000, timeout_s=5)]
                    assert b"".join(got) == BLOB[:1000]
