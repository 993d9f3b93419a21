"""The HTTP lane over a libp2p stream, on real hosts on 127.0.0.1 (:mod:`p2p.bytestream`).

Node A stands for a peer behind a NAT: its lane has no TCP listener at all, and A dials B (as
a NATed peer dials its relay). B fetches A's bytes over a stream it opens back on that
connection: byte-exact, with the same client calls, bounds and counters as over TCP. B never
dials: a PeerID it holds no connection to is unreachable.
"""

from __future__ import annotations

import random
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest
import trio
import trio.testing

from p2p.bytestream import STREAM_LANE_PROTOCOL, ByteStream, stream_lane_url
from p2p.errors import LocalProtocolError, PeerUnreachable, StreamBroken
from p2p.host import HostConfig, P2PNode
from p2p.http_client import STREAM_KEEPALIVE_EXPIRY_S, HttpClient
from p2p.http_server import HttpRequest, HttpResponse, HttpServer, HttpServerConfig, file_response
from p2p.identity import Identity

BLOB = random.Random(25).randbytes(3 * (1 << 20) + 12345)


@dataclass
class Lane:
    a: P2PNode
    b: P2PNode
    server: HttpServer  # A's lane, served only over streams
    client: HttpClient  # B's
    url: str  # p2p://<A>
    release: trio.Event  # ends the /hold requests


@asynccontextmanager
async def nated_lane(tmp: Path, config: HttpServerConfig | None = None) -> AsyncIterator[Lane]:
    blob = tmp / "blob"
    blob.write_bytes(BLOB)
    release = trio.Event()

    async def handle(req: HttpRequest) -> HttpResponse:
        if req.path == "/blob":
            return file_response(req, blob, len(BLOB))
        if req.path == "/hold":
            await release.wait()
            return HttpResponse(200, [], b"held")
        return HttpResponse(404)

    server = HttpServer(handle, config)
    cfg = HostConfig(("/ip4/127.0.0.1/tcp/0",), dial_timeout_s=3.0)
    ids = [Identity.from_seed(f"stream-lane-{n}") for n in "ab"]
    async with P2PNode.open(ids[0], cfg) as a, P2PNode.open(ids[1], cfg) as b:
        a.serve_stream(STREAM_LANE_PROTOCOL, server.serve_stream)
        await a.connect(b.multiaddrs()[0], keep=False)  # A dials out; B never dials A

        async def opener(peer: str, timeout_s: float) -> ByteStream:
            return await b.open_stream(peer, STREAM_LANE_PROTOCOL, timeout_s)

        async with HttpClient(open_stream=opener) as client:
            yield Lane(a, b, server, client, stream_lane_url(a.peer_id), release)
            release.set()


async def test_fetch_over_a_stream_the_server_dialled(tmp_path: Path) -> None:
    """Ranges into a buffer, streamed ranges and a whole body: every byte as on disk."""
    async with nated_lane(tmp_path) as lane:
        url = lane.url + "/blob"
        got = bytearray(len(BLOB))
        piece = 1 << 20
        for start in range(0, len(BLOB), piece):
            view = memoryview(got)[start : start + piece]
            filled = 0
            async for n in lane.client.receive_range_into(url, start, view, timeout_s=10):
                filled += n
            assert filled == len(view)
        assert got == BLOB
        streamed = b"".join(
            [c async for c in lane.client.stream_range(url, 1000, 500_000, timeout_s=10)]
        )
        assert streamed == BLOB[1000:501_000]
        whole = await lane.client.get_bytes(url, max_bytes=len(BLOB), timeout_s=10)
        assert whole == BLOB
        sent = lane.server.statistics()
        assert sent.bytes_sent == 2 * len(BLOB) + 500_000
        assert sent.requests == 4 + 1 + 1  # four 1 MiB pieces, a streamed range, a whole GET
        assert lane.client.statistics().bytes_received == sent.bytes_sent
        assert sent.connections_total == 1  # one stream, kept alive across requests
        with pytest.raises(LocalProtocolError, match="not listening"):
            lane.server.port  # noqa: B018  (no TCP listener: only streams reach this lane)


async def test_no_connection_no_stream(tmp_path: Path) -> None:
    """A PeerID B holds no connection to is unreachable: the stream lane never dials."""
    async with nated_lane(tmp_path) as lane:
        stranger = stream_lane_url(Identity.from_seed("stream-lane-stranger").peer_id)
        with pytest.raises(PeerUnreachable, match="no libp2p connection"):
            await lane.client.get_bytes(stranger + "/blob", max_bytes=10, timeout_s=5)
        async with HttpClient() as plain:  # a client without a host cannot open p2p:// URLs
            with pytest.raises(PeerUnreachable, match="no libp2p host"):
                await plain.get_bytes(lane.url + "/blob", max_bytes=10, timeout_s=5)


async def test_stream_lane_takes_the_servers_slots(tmp_path: Path) -> None:
    """A stream without a free connection slot is closed at once (``stream_limit``): the
    client sees the connection closed before any answer, as a refused TCP connection."""
    cfg = HttpServerConfig(max_connections=1)
    async with nated_lane(tmp_path, cfg) as lane, trio.open_nursery() as nursery:
        held: list[bytes] = []

        async def hold() -> None:
            held.append(await lane.client.get_bytes(lane.url + "/hold", max_bytes=10, timeout_s=10))

        nursery.start_soon(hold)
        await trio.testing.wait_all_tasks_blocked(cushion=0.05)
        assert lane.server.statistics().open_connections == 1
        with pytest.raises(StreamBroken, match="before any answer"):
            await lane.client.get_bytes(lane.url + "/blob", max_bytes=len(BLOB), timeout_s=5)
        assert lane.server.statistics().errors["stream_limit"] == 1
        lane.release.set()
    assert held == [b"held"]


async def test_stream_lane_connections_outlive_the_tcp_lanes_keepalive(tmp_path: Path) -> None:
    """An idle stream-lane connection is reused after the TCP lane's keep-alive expiry (its
    own is :data:`p2p.http_client.STREAM_KEEPALIVE_EXPIRY_S`): a second request opens no
    second libp2p stream. With that expiry at 0 it does."""
    async with nated_lane(tmp_path) as lane:
        opened: list[str] = []

        async def opener(peer: str, timeout_s: float) -> ByteStream:
            opened.append(peer)
            return await lane.b.open_stream(peer, STREAM_LANE_PROTOCOL, timeout_s)

        for stream_expiry_s, streams in ((STREAM_KEEPALIVE_EXPIRY_S, 1), (0.0, 2)):
            opened.clear()

            async with HttpClient(
                open_stream=opener,
                keepalive_expiry_s=0.0,
                stream_keepalive_expiry_s=stream_expiry_s,
            ) as client:
                for _ in range(2):
                    got = await client.get_bytes(
                        lane.url + "/blob", max_bytes=len(BLOB), timeout_s=10
                    )
                    assert got == BLOB
            assert opened == [lane.a.peer_id] * streams
