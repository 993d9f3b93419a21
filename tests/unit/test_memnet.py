"""The in-memory network's own policy: time, bandwidth, partitions, tampering, seeded loss
(what the conformance suite cannot check against the real network)."""

from __future__ import annotations

import dataclasses
import random
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import trio
import trio.testing

from p2p.errors import PeerUnreachable, RemoteProtocolError, StreamBroken
from p2p.host import HostConfig
from p2p.http_range import format_content_range, resolve_range
from p2p.http_server import FileSlice, HttpRequest, HttpResponse, HttpServerConfig, file_response
from p2p.identity import Identity
from p2p.memnet import LinkProfile, MemNetwork
from tests.helpers import get_into

if TYPE_CHECKING:
    from trio_typing import TaskStatus

A, B = Identity.from_seed("memnet-a"), Identity.from_seed("memnet-b")
BODY = bytes(range(256)) * 4096  # 1 MiB


async def _lane(req: HttpRequest) -> HttpResponse:
    return HttpResponse(200, [], BODY)


async def _echo(sender: str, data: bytes) -> bytes:
    return data


async def test_transfer_time_is_bandwidth_plus_latency(
    autojump_clock: trio.testing.MockClock,
) -> None:
    profile = LinkProfile(latency_s=0.05, bandwidth_bytes_per_s=1 << 20)
    async with MemNetwork(random.Random(1), profile) as net:
        ea, eb = net.endpoint(), net.endpoint()
        async with (
            eb.open_http_server(_lane, HttpServerConfig(host=eb.ip)) as server,
            ea.open_http_client() as client,
        ):
            t0 = trio.current_time()
            got = await client.get_bytes(server.url + "/x", max_bytes=2 << 20, timeout_s=10)
            elapsed = trio.current_time() - t0
    assert got == BODY
    # connect (2 x latency), request, head, 1 MiB at 1 MiB/s in 4 chunks (latency each)
    assert 1.0 < elapsed < 1.0 + 10 * 0.05


async def test_partition_cuts_connections_until_healed(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with MemNetwork(random.Random(1)) as net:
        ea, eb = net.endpoint(), net.endpoint()
        cfg = HostConfig(dial_timeout_s=3.0)
        async with ea.open_host(A, cfg) as a, eb.open_host(B, cfg) as b:
            b.serve("/e/1", _echo, max_request_bytes=10, max_response_bytes=10, timeout_s=1)
            gone: list[str] = []
            a.on_peer_gone(gone.append)
            await a.connect(b.multiaddrs()[0])
            net.partition([ea.ip], [eb.ip])
            assert gone == [B.peer_id]
            assert a.connected_peers() == []
            t0 = trio.current_time()
            with pytest.raises(PeerUnreachable):
                await a.connect(b.multiaddrs()[0])
            assert trio.current_time() - t0 == pytest.approx(3.0)
            net.heal()
            await a.connect(b.multiaddrs()[0])
            assert await a.request(B.peer_id, "/e/1", b"ok", max_response_bytes=9, timeout_s=1) == (
                b"ok"
            )


async def test_tampering_lane_and_server_death_mid_body(
    autojump_clock: trio.testing.MockClock, tmp_path: Path
) -> None:
    profile = LinkProfile(latency_s=0.01, bandwidth_bytes_per_s=1 << 20)
    async with MemNetwork(random.Random(1), profile) as net:
        ea, eb = net.endpoint(), net.endpoint()
        net.tamper(eb.ip, lambda path, body: body[::-1])
        async with ea.open_http_client() as client, trio.open_nursery() as nursery:
            stop = trio.Event()

            async def serve(task_status: TaskStatus[str] = trio.TASK_STATUS_IGNORED) -> None:
                async with eb.open_http_server(_lane, HttpServerConfig(host=eb.ip)) as server:
                    task_status.started(server.url)
                    await stop.wait()

            url = await nursery.start(serve)
            got = await client.get_bytes(url + "/x", max_bytes=2 << 20, timeout_s=10)
            assert got == BODY[::-1]
            outcome: list[BaseException] = []

            async def fetch() -> None:
                try:
                    await client.get_bytes(url + "/x", max_bytes=2 << 20, timeout_s=10)
                except StreamBroken as exc:
                    outcome.append(exc)

            async with trio.open_nursery() as inner:  # the server dies mid-body
                inner.start_soon(fetch)
                await trio.sleep(0.3)
                stop.set()
            assert len(outcome) == 1
            assert "mid-body" in str(outcome[0])


async def _gossip_run(seed: int) -> int:
    async with MemNetwork(random.Random(seed), LinkProfile(loss=0.5)) as net:
        ea, eb = net.endpoint(), net.endpoint()
        async with ea.open_host(A, HostConfig()) as a, eb.open_host(B, HostConfig()) as b:
            sub = await b.subscribe("t", lambda origin, data: None)
            await a.connect(b.multiaddrs()[0])
            for i in range(100):
                await a.publish("t", str(i).encode())
            await net.wait_quiet()  # every hop has landed or was lost
            return sub.statistics().received


def test_loss_is_seeded() -> None:
    def run(seed: int) -> int:
        return trio.run(_gossip_run, seed, clock=trio.testing.MockClock(autojump_threshold=0))

    first = run(3)
    assert 20 < first < 80
    assert run(3) == first


async def test_receive_range_into_fills_the_view(autojump_clock: trio.testing.MockClock) -> None:
    async with MemNetwork(random.Random(1)) as net:
        ea, eb = net.endpoint(), net.endpoint()
        async with (
            eb.open_http_server(_ranged, HttpServerConfig(host=eb.ip)) as server,
            ea.open_http_client() as client,
        ):
            buf = bytearray(300_000)
            filled = [
                n
                async for n in client.receive_range_into(
                    server.url + "/x", 5, memoryview(buf), timeout_s=5
                )
            ]
    assert sum(filled) == len(buf)
    assert bytes(buf) == BODY[5 : 5 + len(buf)]


async def test_get_into_fills_the_view_or_refuses_another_length(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with MemNetwork(random.Random(1)) as net:
        ea, eb = net.endpoint(), net.endpoint()
        async with (
            eb.open_http_server(_lane, HttpServerConfig(host=eb.ip)) as server,
            ea.open_http_client() as client,
        ):
            buf = bytearray(len(BODY))
            await get_into(client, server.url + "/x", memoryview(buf), timeout_s=5)
            with pytest.raises(RemoteProtocolError, match="Content-Length"):
                await get_into(client, server.url + "/x", memoryview(bytearray(10)), timeout_s=5)
    assert bytes(buf) == BODY


async def _ranged(req: HttpRequest) -> HttpResponse:
    assert req.range is not None
    first, length = resolve_range(req.range, len(BODY))
    return HttpResponse(
        206,
        [("content-range", format_content_range(first, length, len(BODY)))],
        BODY[first : first + length],
    )


async def test_wait_quiet_returns_when_every_hop_has_landed(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A line a - b - c: c's copies travel two hops (the second spawned by b's forwarding);
    wait_quiet returns only once they have all landed, and at once when nothing is in flight."""
    c_id = Identity.from_seed("memnet-c")
    async with MemNetwork(random.Random(1), LinkProfile(latency_s=2.0)) as net:
        ea, eb, ec = net.endpoint(), net.endpoint(), net.endpoint()
        async with (
            ea.open_host(A, HostConfig()) as a,
            eb.open_host(B, HostConfig()) as b,
            ec.open_host(c_id, HostConfig()) as c,
        ):
            subs = [await h.subscribe("t", lambda origin, data: None) for h in (a, b, c)]
            await a.connect(b.multiaddrs()[0])
            await c.connect(b.multiaddrs()[0])
            t0 = trio.current_time()
            for i in range(3):
                await a.publish("t", str(i).encode())
            await net.wait_quiet()
            assert trio.current_time() - t0 >= 4.0  # two hops of 2 s each
            assert [s.statistics().received for s in subs] == [0, 3, 3]
            t1 = trio.current_time()
            await net.wait_quiet()
            assert trio.current_time() == t1


async def test_a_file_slice_is_read_from_its_base(
    autojump_clock: trio.testing.MockClock, tmp_path: Path
) -> None:
    path = tmp_path / "pack"
    path.write_bytes(BODY)
    base, size = 1000, 5000  # a blob inside a pack

    async def lane(req: HttpRequest) -> HttpResponse:
        resp = file_response(req, path, size)
        assert isinstance(resp.body, FileSlice)
        return dataclasses.replace(resp, body=dataclasses.replace(resp.body, base=base))

    async with MemNetwork(random.Random(1)) as net:
        ea, eb = net.endpoint(), net.endpoint()
        async with (
            eb.open_http_server(lane, HttpServerConfig(host=eb.ip)) as server,
            ea.open_http_client() as client,
        ):
            got = await client.get_bytes(server.url + "/x", max_bytes=size, timeout_s=10)
            buf = bytearray(100)
            async for _ in client.receive_range_into(
                server.url + "/x", 7, memoryview(buf), timeout_s=5
            ):
                pass
    assert got == BODY[base : base + size]
    assert bytes(buf) == BODY[base + 7 : base + 107]
