"""The HTTP bulk lane over real sockets on 127.0.0.1: p2p.http_server with p2p.http_client.

Misbehaving servers are small scripted trio servers; misbehaving clients are raw sockets.
Timeout tests use a MockClock whose autojump threshold is small but non-zero, so virtual time
only jumps once every task, including the kernel's side of the sockets, has gone quiet.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import random
import socket
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import aclosing, asynccontextmanager
from functools import partial
from pathlib import Path

import h11
import httpx
import pytest
import trio
import trio.lowlevel
import trio.testing

from p2p import http_client
from p2p.errors import (
    ClosedMidBody,
    LocalProtocolError,
    MessageTooLarge,
    PeerUnreachable,
    RemoteProtocolError,
    StreamBroken,
    TransportError,
)
from p2p.http_client import HttpClient
from p2p.http_errors import NotAvailable
from p2p.http_server import (
    FileSlice,
    Handler,
    HttpRequest,
    HttpResponse,
    HttpServer,
    HttpServerConfig,
    file_response,
    open_http_server,
)
from tests.helpers import get_into

SIZE = 3 * 1024 * 1024 + 17
BIG = 64 * 1024 * 1024


@pytest.fixture
def jump_clock() -> trio.testing.MockClock:
    return trio.testing.MockClock(autojump_threshold=0.02)


@pytest.fixture
def blob(tmp_path: Path) -> tuple[Path, bytes]:
    data = random.Random(7).randbytes(SIZE)
    path = tmp_path / "blob.bin"
    path.write_bytes(data)
    return path, data


@pytest.fixture
def big(tmp_path: Path) -> Path:
    """A sparse file larger than any socket buffers, to keep a sender blocked."""
    path = tmp_path / "big.bin"
    with path.open("wb") as f:
        f.truncate(BIG)
    return path


def serve_file(path: Path, big: Path | None = None) -> Handler:
    size = path.stat().st_size if path.exists() else 0

    async def handler(request: HttpRequest) -> HttpResponse:
        if request.path == "/blob":
            return file_response(request, path, size)
        if request.path == "/big" and big is not None:
            return file_response(request, big, BIG)
        if request.path == "/small":
            return HttpResponse(200, [("content-type", "text/plain")], b"hello shardnet")
        return HttpResponse(404, [], b"no such thing")

    return handler


async def collect(client: HttpClient, url: str, start: int, length: int, **kw: float) -> bytes:
    chunks = [c async for c in client.stream_range(url, start, length, timeout_s=kw.get("t", 5.0))]
    return b"".join(chunks)


@asynccontextmanager
async def scripted_server(
    script: Callable[[trio.SocketStream], Awaitable[None]],
) -> AsyncIterator[str]:
    """A one-behaviour HTTP 'server': reads a request head, then runs ``script``."""

    async def handle(stream: trio.SocketStream) -> None:
        async with stream:
            head = b""
            while b"\r\n\r\n" not in head:
                data = await stream.receive_some(4096)
                if not data:
                    return
                head += data
            await script(stream)

    async with trio.open_nursery() as nursery:
        listeners = await nursery.start(partial(trio.serve_tcp, handle, 0, host="127.0.0.1"))
        yield f"http://127.0.0.1:{listeners[0].socket.getsockname()[1]}"
        nursery.cancel_scope.cancel()


async def h11_exchange(
    stream: trio.SocketStream, conn: h11.Connection, target: str, *headers: tuple[str, str]
) -> tuple[h11.Response, bytes]:
    """Send one GET on a raw connection and read the whole response with h11."""
    request = h11.Request(method="GET", target=target, headers=[("host", "x"), *headers])
    await stream.send_all(conn.send(request) + conn.send(h11.EndOfMessage()))
    response, body = None, bytearray()
    while True:
        event = conn.next_event()
        if event is h11.NEED_DATA:
            conn.receive_data(await stream.receive_some(65536))
        elif isinstance(event, h11.Response):
            response = event
        elif isinstance(event, h11.Data):
            body += event.data
        elif isinstance(event, h11.EndOfMessage):
            assert response is not None
            return response, bytes(body)
        else:
            raise AssertionError(f"unexpected {event!r}")


# --- byte-exact transfers ---------------------------------------------------------------------


@pytest.mark.parametrize("use_sendfile", [True, False])
async def test_full_and_ranged_gets_are_byte_exact(
    blob: tuple[Path, bytes], use_sendfile: bool
) -> None:
    path, data = blob
    config = HttpServerConfig(use_sendfile=use_sendfile, send_chunk_bytes=256 * 1024)
    async with open_http_server(serve_file(path), config) as server, HttpClient() as client:
        url = server.url + "/blob"
        assert await collect(client, url, 0, SIZE) == data
        for start, length in [(0, 1), (SIZE - 1, 1), (12345, 1 << 20), (SIZE - 100, 100)]:
            assert await collect(client, url, start, length) == data[start : start + length]
        assert await collect(client, url, 5, 0) == b""
        await trio.testing.wait_all_tasks_blocked()  # the server counts after its last send
        stats = server.statistics()
    assert stats.bytes_sent == SIZE + 1 + 1 + (1 << 20) + 100
    assert (stats.requests, stats.errors) == (5, {})


@pytest.mark.parametrize("use_sendfile", [True, False])
async def test_a_representation_inside_a_larger_file_is_served_from_its_base(
    blob: tuple[Path, bytes], use_sendfile: bool
) -> None:
    path, data = blob
    base, size = 4096 + 3, 100_000  # a blob in a pack: its bytes start inside the file

    async def handler(request: HttpRequest) -> HttpResponse:
        resp = file_response(request, path, size)
        assert isinstance(resp.body, FileSlice)
        return dataclasses.replace(resp, body=dataclasses.replace(resp.body, base=base))

    want = data[base : base + size]
    config = HttpServerConfig(use_sendfile=use_sendfile)
    async with open_http_server(handler, config) as server, HttpClient() as client:
        url = server.url + "/inner"
        assert await collect(client, url, 0, size) == want
        for start, length in [(0, 1), (size - 1, 1), (777, 50_000)]:
            assert await collect(client, url, start, length) == want[start : start + length]


async def test_chunks_respect_chunk_bytes(blob: tuple[Path, bytes]) -> None:
    path, _ = blob
    async with open_http_server(serve_file(path)) as server, HttpClient() as client:
        stream = client.stream_range(server.url + "/blob", 10, 300_000, timeout_s=5, chunk_bytes=7)
        sizes = [len(c) async for c in stream]
    assert sum(sizes) == 300_000
    assert max(sizes) == 7


async def test_stopping_early_closes_the_connection(blob: tuple[Path, bytes]) -> None:
    path, data = blob
    async with open_http_server(serve_file(path)) as server, HttpClient() as client:
        url = server.url + "/blob"
        async with aclosing(client.stream_range(url, 0, SIZE, timeout_s=5)) as chunks:
            async for first in chunks:
                assert data.startswith(first)
                break
        assert await collect(client, url, 100, 10) == data[100:110]  # on a fresh connection
        await trio.testing.wait_all_tasks_blocked()
        server_stats, client_stats = server.statistics(), client.statistics()
    assert (server_stats.connections_total, server_stats.open_connections) == (2, 1)
    assert client_stats.requests == 2
    assert len(first) + 10 <= client_stats.bytes_received < SIZE
    assert client_stats.errors == {}


async def test_cancelling_a_consumer_between_chunks(blob: tuple[Path, bytes]) -> None:
    path, data = blob
    async with open_http_server(serve_file(path)) as server, HttpClient() as client:
        got: list[bytes] = []
        with trio.CancelScope() as scope:
            url = server.url + "/blob"
            async with aclosing(client.stream_range(url, 0, SIZE, timeout_s=5)) as chunks:
                async for chunk in chunks:
                    got.append(chunk)
                    scope.cancel()
                    await trio.sleep_forever()  # cancelled here, outside the generator
        assert scope.cancelled_caught
        assert data.startswith(got[0])
        await trio.testing.wait_all_tasks_blocked()
        assert server.statistics().open_connections == 0


async def test_full_local_pool_is_a_transport_error(
    blob: tuple[Path, bytes], jump_clock: trio.testing.MockClock
) -> None:
    path, _ = blob
    async with (
        open_http_server(serve_file(path)) as server,
        HttpClient(max_connections=1) as client,
    ):
        url = server.url + "/blob"
        async with aclosing(client.stream_range(url, 0, SIZE, timeout_s=5)) as held:
            await anext(held)
            with pytest.raises(TransportError, match="pool") as info:
                await client.get_bytes(server.url + "/small", max_bytes=100, timeout_s=2)
            assert type(info.value) is TransportError
        assert client.statistics().errors == {"TransportError": 1}


async def test_raw_range_forms_head_and_416(blob: tuple[Path, bytes]) -> None:
    path, data = blob
    async with open_http_server(serve_file(path)) as server, httpx.AsyncClient() as client:
        url = server.url + "/blob"
        suffix = await client.get(url, headers={"range": "bytes=-10"})
        assert suffix.status_code == 206
        assert suffix.headers["content-range"] == f"bytes {SIZE - 10}-{SIZE - 1}/{SIZE}"
        assert suffix.content == data[-10:]
        open_ended = await client.get(url, headers={"range": f"bytes={SIZE - 3}-"})
        assert (open_ended.status_code, open_ended.content) == (206, data[-3:])

        head = await client.head(url, headers={"range": "bytes=0-99"})
        assert head.status_code == 206
        assert head.headers["content-length"] == "100"
        assert head.headers["accept-ranges"] == "bytes"
        assert head.content == b""
        full_head = await client.head(url)
        assert (full_head.status_code, full_head.headers["content-length"]) == (200, str(SIZE))

        past_end = await client.get(url, headers={"range": f"bytes={SIZE}-"})
        assert past_end.status_code == 416
        assert past_end.headers["content-range"] == f"bytes */{SIZE}"
        for ignored in ["bytes=0-1,5-6", "items=0-1"]:
            whole = await client.get(url, headers={"range": ignored})
            assert (whole.status_code, len(whole.content)) == (200, SIZE)
        malformed = await client.get(url, headers={"range": "bytes=9-3"})  # nginx: 416
        assert malformed.status_code == 416
        if_range = await client.get(url, headers={"range": "bytes=0-1", "if-range": '"x"'})
        assert if_range.status_code == 200

        stats = server.statistics()
    assert stats.requests == 9
    assert stats.connections_total == 1  # keep-alive throughout


async def test_keep_alive_reuses_one_connection(blob: tuple[Path, bytes]) -> None:
    path, _ = blob
    async with open_http_server(serve_file(path)) as server, HttpClient() as client:
        for _ in range(3):
            assert await client.get_bytes(server.url + "/small", max_bytes=100, timeout_s=5) == (
                b"hello shardnet"
            )
        await collect(client, server.url + "/blob", 0, 1000)
        stats = server.statistics()
    assert (stats.requests, stats.connections_total) == (4, 1)


async def test_handler_that_waits_then_answers() -> None:
    ready = trio.Event()
    seen: list[HttpRequest] = []

    async def handler(request: HttpRequest) -> HttpResponse:
        seen.append(request)
        await ready.wait()
        return HttpResponse(200, [], b"verified shard")

    results: list[bytes] = []
    async with open_http_server(handler) as server, HttpClient() as client:

        async def fetch() -> None:
            url = server.url + "/s%2F1?step=4&x="
            results.append(await client.get_bytes(url, max_bytes=100, timeout_s=5))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(fetch)
            await trio.testing.wait_all_tasks_blocked()
            assert results == []
            assert len(seen) == 1
            ready.set()
    assert results == [b"verified shard"]
    assert seen[0].path == "/s/1"
    assert seen[0].query == {"step": "4", "x": ""}
    assert seen[0].range is None


async def test_not_available_and_other_statuses() -> None:
    async def handler(request: HttpRequest) -> HttpResponse:
        status = int(request.path.strip("/"))
        return HttpResponse(status, [("retry-after", "7")] if status == 503 else [], b"x" * 10)

    async with open_http_server(handler) as server, HttpClient() as client:
        with pytest.raises(NotAvailable) as info:
            await client.get_bytes(server.url + "/503", max_bytes=10, timeout_s=5)
        assert (info.value.status, info.value.retry_after_s) == (503, 7.0)
        with pytest.raises(NotAvailable) as info:
            await collect(client, server.url + "/404", 0, 10)
        assert (info.value.status, info.value.retry_after_s) == (404, None)
        with pytest.raises(StreamBroken, match="server error HTTP 500"):
            await client.get_bytes(server.url + "/500", max_bytes=10, timeout_s=5)
        with pytest.raises(RemoteProtocolError, match="HTTP 418"):
            await client.get_bytes(server.url + "/418", max_bytes=10, timeout_s=5)
        with pytest.raises(RemoteProtocolError, match="range ignored"):
            await collect(client, server.url + "/200", 1, 10)


async def test_a_refusal_leaves_its_connection_for_the_next_request(
    blob: tuple[Path, bytes],
) -> None:
    """A 404/409/429/503 with a small body is read to its end and its connection reused, for
    every kind of request (whole, ranged, into a buffer); a 5xx failure, a refusal with a
    body over ``REFUSAL_DRAIN_BYTES`` or one that says ``Connection: close`` closes it."""
    path, data = blob

    async def handler(request: HttpRequest) -> HttpResponse:
        name = request.path.strip("/")
        if name == "blob":
            return file_response(request, path, SIZE)
        if name == "big-refusal":
            return HttpResponse(503, [], b"x" * (http_client.REFUSAL_DRAIN_BYTES + 1))
        return HttpResponse(int(name), [("retry-after", "1")], b"not here yet")

    async with open_http_server(handler) as server, HttpClient() as client:
        for status in (404, 409, 429, 503):
            with pytest.raises(NotAvailable):
                await client.get_bytes(f"{server.url}/{status}", max_bytes=100, timeout_s=5)
            with pytest.raises(NotAvailable):
                await collect(client, f"{server.url}/{status}", 0, 10)
            with pytest.raises(NotAvailable):
                await get_into(
                    client, f"{server.url}/{status}", memoryview(bytearray(10)), timeout_s=5
                )
        assert await collect(client, server.url + "/blob", 5, 100) == data[5:105]
        assert server.statistics().connections_total == 1
        with pytest.raises(StreamBroken):
            await client.get_bytes(server.url + "/500", max_bytes=100, timeout_s=5)
        assert await collect(client, server.url + "/blob", 0, 10) == data[:10]
        assert server.statistics().connections_total == 2
        with pytest.raises(NotAvailable):
            await client.get_bytes(f"{server.url}/big-refusal", max_bytes=1 << 20, timeout_s=5)
        assert await collect(client, server.url + "/blob", 0, 10) == data[:10]
        assert server.statistics().connections_total == 3

    connections = 0

    async def closing_refusal(stream: trio.SocketStream) -> None:
        nonlocal connections
        connections += 1
        await stream.send_all(
            b"HTTP/1.1 429 Too Many Requests\r\nconnection: close\r\ncontent-length: 4\r\n\r\nbusy"
        )

    async with scripted_server(closing_refusal) as url, HttpClient() as client:
        for _ in range(2):
            with pytest.raises(NotAvailable):
                await client.get_bytes(url + "/x", max_bytes=100, timeout_s=5)
    assert connections == 2


async def test_client_rejects_wrong_ranges(blob: tuple[Path, bytes]) -> None:
    path, _ = blob
    async with open_http_server(serve_file(path)) as server, HttpClient() as client:
        with pytest.raises(RemoteProtocolError, match="416"):
            await collect(client, server.url + "/blob", SIZE, 10)
        with pytest.raises(RemoteProtocolError, match="Content-Length"):
            await collect(client, server.url + "/blob", SIZE - 5, 10)  # clamped by the server
        with pytest.raises(LocalProtocolError):
            await collect(client, server.url + "/blob", -1, 10)


async def test_oversize_bodies_raise_message_too_large(blob: tuple[Path, bytes]) -> None:
    path, _ = blob
    async with open_http_server(serve_file(path)) as server, HttpClient() as client:
        with pytest.raises(MessageTooLarge):
            await client.get_bytes(server.url + "/blob", max_bytes=1000, timeout_s=5)

    async def undeclared(stream: trio.SocketStream) -> None:
        await stream.send_all(b"HTTP/1.1 200 OK\r\nconnection: close\r\n\r\n" + b"z" * 5000)

    async with scripted_server(undeclared) as url, HttpClient() as client:
        with pytest.raises(MessageTooLarge):
            await client.get_bytes(url, max_bytes=1000, timeout_s=5)


@pytest.mark.parametrize(
    ("head", "match"),
    [
        (b"206 Partial Content\r\ncontent-range: bytes 1-10/100\r\ncontent-length: 10", "1-10"),
        (b"206 Partial Content\r\ncontent-range: bytes 0-9/100\r\nconnection: close", "more"),
        (b"206 Partial Content\r\ncontent-length: 10", "Content-Range"),
    ],
)
async def test_client_rejects_misframed_answers(head: bytes, match: str) -> None:
    async def script(stream: trio.SocketStream) -> None:
        await stream.send_all(b"HTTP/1.1 " + head + b"\r\n\r\n" + b"y" * 20)

    async with scripted_server(script) as url, HttpClient() as client:
        with pytest.raises(RemoteProtocolError, match=match):
            await collect(client, url, 0, 10)


async def test_malformed_head_is_a_protocol_error() -> None:
    async def script(stream: trio.SocketStream) -> None:
        await stream.send_all(b"HTTP/1.1 abc\r\n\r\n")

    async with scripted_server(script) as url, HttpClient() as client:
        with pytest.raises(RemoteProtocolError, match="malformed") as info:
            await collect(client, url, 0, 10)
    assert not isinstance(info.value, StreamBroken)


async def test_server_closing_mid_body_is_stream_broken(tmp_path: Path) -> None:
    async def script(stream: trio.SocketStream) -> None:
        head = b"HTTP/1.1 206 Partial Content\r\ncontent-range: bytes 0-99/100\r\n"
        await stream.send_all(head + b"content-length: 100\r\n\r\n" + b"a" * 10)

    async with scripted_server(script) as url, HttpClient() as client:
        with pytest.raises(StreamBroken):
            await collect(client, url, 0, 100)

    # Our own server cuts the connection when a file is shorter than the slice it promised.
    short = tmp_path / "short"
    short.write_bytes(b"b" * 10)

    async def handler(request: HttpRequest) -> HttpResponse:
        return HttpResponse(200, [], FileSlice(short, 0, 100, 100))

    async with open_http_server(handler) as server, HttpClient() as client:
        with pytest.raises(StreamBroken):
            await collect(client, server.url, 0, 100)
        assert server.statistics().errors == {"short_file": 1}


async def test_unreachable_source() -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    async with HttpClient() as client:
        with pytest.raises(PeerUnreachable):
            await client.get_bytes(f"http://127.0.0.1:{port}/x", max_bytes=10, timeout_s=5)
        with pytest.raises(LocalProtocolError):
            await client.get_bytes("ftp://127.0.0.1/x", max_bytes=10, timeout_s=5)


# --- timeouts (virtual time) -------------------------------------------------------------------


async def test_stalled_server_raises_stream_broken_within_timeout(
    jump_clock: trio.testing.MockClock,
) -> None:
    async def stall(stream: trio.SocketStream) -> None:
        head = b"HTTP/1.1 206 Partial Content\r\ncontent-range: bytes 0-99/100\r\n"
        await stream.send_all(head + b"content-length: 100\r\n\r\n" + b"a" * 10)
        await trio.sleep_forever()

    async with scripted_server(stall) as url, HttpClient() as client:
        start = trio.current_time()
        with pytest.raises(StreamBroken, match="no progress"):
            await collect(client, url, 0, 100, t=4.0)
        assert 4.0 <= trio.current_time() - start < 4.5


async def test_handler_timeout_answers_503(jump_clock: trio.testing.MockClock) -> None:
    async def never(request: HttpRequest) -> HttpResponse:
        await trio.sleep_forever()
        raise AssertionError("unreachable")

    config = HttpServerConfig(handler_timeout_s=3.0)
    async with open_http_server(never, config) as server, HttpClient() as client:
        with pytest.raises(NotAvailable) as info:
            await client.get_bytes(server.url, max_bytes=10, timeout_s=10)
        assert info.value.retry_after_s == 1.0
        assert server.statistics().errors == {"handler_timeout": 1}


async def test_client_that_stops_reading_is_dropped(
    blob: tuple[Path, bytes], big: Path, jump_clock: trio.testing.MockClock
) -> None:
    path, _ = blob
    config = HttpServerConfig(send_timeout_s=5.0)
    async with open_http_server(serve_file(path, big), config) as server:
        sock = trio.socket.socket()
        with sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            await sock.connect(("127.0.0.1", server.port))
            await sock.send(b"GET /big HTTP/1.1\r\nhost: x\r\n\r\n")
            await trio.sleep(6.0)  # virtual: lets the server's 5 s send timeout run out
            received = 0
            while data := await sock.recv(1 << 20):
                received += len(data)
        await trio.testing.wait_all_tasks_blocked()
        stats = server.statistics()
    assert 0 < received < BIG
    assert stats.errors == {"send_timeout": 1}
    assert stats.open_connections == 0


async def test_header_and_idle_timeouts(jump_clock: trio.testing.MockClock) -> None:
    config = HttpServerConfig(header_timeout_s=2.0, idle_timeout_s=7.0)
    async with open_http_server(serve_file(Path("/nonexistent")), config) as server:
        for partial in [b"", b"GET / HTTP/1.1\r\n"]:
            async with await trio.open_tcp_stream("127.0.0.1", server.port) as stream:
                await stream.send_all(partial)
                start = trio.current_time()
                assert await stream.receive_some(100) == b""
                assert 2.0 <= trio.current_time() - start < 2.5

        async with await trio.open_tcp_stream("127.0.0.1", server.port) as stream:
            response, body = await h11_exchange(stream, h11.Connection(h11.CLIENT), "/small")
            assert (response.status_code, body) == (200, b"hello shardnet")
            start = trio.current_time()
            assert await stream.receive_some(100) == b""
            assert 7.0 <= trio.current_time() - start < 7.5
        await trio.testing.wait_all_tasks_blocked()
        assert server.statistics().errors == {"header_timeout": 2}


async def test_one_ip_cannot_hold_every_connection_slot(
    jump_clock: trio.testing.MockClock,
) -> None:
    """Slowloris from 127.0.0.2 (idle heads) is capped per IP; 127.0.0.3 is served at once."""
    config = HttpServerConfig(
        max_connections=8, max_connections_per_ip=4, backlog=4, header_timeout_s=1000.0
    )
    async with open_http_server(serve_file(Path("/nonexistent")), config) as server:
        flood: list[trio.socket.SocketType] = []
        try:
            for _ in range(12):
                sock = trio.socket.socket()
                flood.append(sock)
                await sock.bind(("127.0.0.2", 0))
                await sock.connect(("127.0.0.1", server.port))
                await sock.send(b"GET / HTTP/1.1\r\n")  # a head that never ends
            legit = trio.socket.socket()
            with legit:
                await legit.bind(("127.0.0.3", 0))
                await legit.connect(("127.0.0.1", server.port))
                stream = trio.SocketStream(legit)
                start = trio.current_time()
                response, body = await h11_exchange(stream, h11.Connection(h11.CLIENT), "/small")
                assert (response.status_code, body) == (200, b"hello shardnet")
                assert trio.current_time() - start < 1.0
            stats = server.statistics()
            assert stats.errors.get("per_ip_limit") == 8
            assert stats.connections_total == 5  # 4 of the flood + the GET
        finally:
            for sock in flood:
                sock.close()
        await trio.testing.wait_all_tasks_blocked()
        # the flooder's slots are free again once its connections are gone
        async with await trio.open_tcp_stream("127.0.0.1", server.port) as stream:
            response, _ = await h11_exchange(stream, h11.Connection(h11.CLIENT), "/small")
            assert response.status_code == 200


async def test_aborted_connections_are_summarized_not_logged_one_by_one(
    jump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="p2p.http_server")
    config = HttpServerConfig(header_timeout_s=1.0, abort_log_interval_s=10.0)
    async with open_http_server(serve_file(Path("/nonexistent")), config) as server:
        for _ in range(2):  # two bursts, 20 s apart
            async with trio.open_nursery() as nursery:
                for _ in range(5):
                    nursery.start_soon(idle_client, server.port)
            await trio.sleep(20.0)
        assert server.statistics().errors == {"header_timeout": 10}
    lines = [r.getMessage() for r in caplog.records if "aborted" in r.getMessage()]
    assert lines == ["http_connections_aborted count=5 since_s=10.0 kinds=header_timeout:5"] * 2


async def idle_client(port: int) -> None:
    """Connect, send nothing, wait for the server to hang up."""
    async with await trio.open_tcp_stream("127.0.0.1", port) as stream:
        assert await stream.receive_some(100) == b""


async def test_bandwidth_cap_paces_bodies(
    blob: tuple[Path, bytes], jump_clock: trio.testing.MockClock
) -> None:
    path, data = blob
    rate, burst = 1_000_000.0, 256 * 1024
    for use_sendfile in (True, False):
        config = HttpServerConfig(
            bandwidth_bytes_per_s=rate, burst_bytes=burst, use_sendfile=use_sendfile
        )
        async with open_http_server(serve_file(path), config) as server, HttpClient() as client:
            start = trio.current_time()
            assert await collect(client, server.url + "/blob", 0, 1 << 20, t=60) == data[: 1 << 20]
            elapsed = trio.current_time() - start
        assert ((1 << 20) - burst) / rate <= elapsed <= (1 << 20) / rate + 0.1


# --- protocol errors, limits, shutdown ------------------------------------------------------


async def test_bad_requests_are_answered_and_counted(tmp_path: Path) -> None:
    async def boom(request: HttpRequest) -> HttpResponse:
        if request.path == "/bad-header":
            return HttpResponse(200, [("x-bad", "a\r\nb")])
        raise RuntimeError("handler bug")

    config = HttpServerConfig(max_header_bytes=1024)
    async with open_http_server(boom, config) as server:
        cases = [
            (b"NONSENSE\r\n\r\n", 400),
            (b"GET / HTTP/1.1\r\nhost: x\r\nx-big: " + b"a" * 3000 + b"\r\n\r\n", 431),
            (b"GET / HTTP/1.1\r\nhost: x\r\ncontent-length: 3\r\n\r\nabc", 413),
            (b"POST / HTTP/1.1\r\nhost: x\r\n\r\n", 405),
            (b"GET /x HTTP/1.1\r\nhost: x\r\n\r\n", 500),
            (b"GET /bad-header HTTP/1.1\r\nhost: x\r\n\r\n", 500),
        ]
        for raw, status in cases:
            async with await trio.open_tcp_stream("127.0.0.1", server.port) as stream:
                await stream.send_all(raw)
                answer = await stream.receive_some(4096)
                assert answer.startswith(b"HTTP/1.1 %d " % status), answer
        await trio.testing.wait_all_tasks_blocked()
        errors = dict(server.statistics().errors)
    assert errors == {"bad_request": 2, "request_body": 1, "handler": 1, "bad_response": 1}


async def test_missing_file_is_a_500(tmp_path: Path) -> None:
    async def handler(request: HttpRequest) -> HttpResponse:
        return HttpResponse(200, [], FileSlice(tmp_path / "gone", 0, 10, 10))

    async with open_http_server(handler) as server, httpx.AsyncClient() as client:
        assert (await client.get(server.url)).status_code == 500
        assert server.statistics().errors == {"file_error": 1}


async def test_connection_limit_queues_extra_clients(blob: tuple[Path, bytes]) -> None:
    path, _ = blob
    config = HttpServerConfig(max_connections=1)
    async with open_http_server(serve_file(path), config) as server:
        first = await trio.open_tcp_stream("127.0.0.1", server.port)
        first_conn = h11.Connection(h11.CLIENT)
        response, _ = await h11_exchange(first, first_conn, "/small")
        assert response.status_code == 200

        second = await trio.open_tcp_stream("127.0.0.1", server.port)
        async with second, trio.open_nursery() as nursery:
            answers: list[int] = []

            async def ask() -> None:
                response, _ = await h11_exchange(second, h11.Connection(h11.CLIENT), "/small")
                answers.append(response.status_code)

            nursery.start_soon(ask)
            await trio.testing.wait_all_tasks_blocked()
            stats = server.statistics()
            assert (stats.open_connections, stats.requests, answers) == (1, 1, [])
            await first.aclose()  # frees the only slot
        assert answers == [200]


def open_fds() -> set[str]:
    return set(os.listdir("/proc/self/fd"))


async def test_clean_shutdown_leaves_no_fds(blob: tuple[Path, bytes], big: Path) -> None:
    path, _ = blob
    before = open_fds()
    hang = trio.Event()

    async def handler(request: HttpRequest) -> HttpResponse:
        if request.path == "/hang":
            await hang.wait()
        if request.path == "/big":
            return file_response(request, big, BIG)
        return file_response(request, path, SIZE)

    outcomes: list[str] = []
    async with HttpClient() as client:

        async def stuck() -> None:
            try:
                await client.get_bytes(server.url + "/hang", max_bytes=10, timeout_s=30)
            except StreamBroken:
                outcomes.append("broken")

        slow = trio.socket.socket()  # a client that stops reading mid-file
        with slow:
            slow.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            async with trio.open_nursery() as nursery, open_http_server(handler) as server:
                nursery.start_soon(stuck)  # a request waiting inside the handler
                await trio.testing.wait_all_tasks_blocked()
                await collect(client, server.url + "/blob", 0, 10)  # then an idle keep-alive one
                await slow.connect(("127.0.0.1", server.port))
                await slow.send(b"GET /big HTTP/1.1\r\nhost: x\r\n\r\n")
                await trio.testing.wait_all_tasks_blocked()
                stats = server.statistics()
                assert (stats.open_connections, stats.requests) == (3, 2)
    assert outcomes == ["broken"]
    assert open_fds() == before


async def test_server_lifecycle_errors() -> None:
    server = HttpServer(serve_file(Path("/x")))
    with pytest.raises(LocalProtocolError):
        _ = server.url
    async with trio.open_nursery() as nursery:
        await nursery.start(server.serve)
        with pytest.raises(LocalProtocolError):
            await server.serve()
        nursery.cancel_scope.cancel()


async def test_unsplittable_target_is_a_400_and_the_server_keeps_serving() -> None:
    """Regression (found by the decoder fuzzer): ``GET //[x`` made ``urlsplit`` raise
    ValueError out of the connection task, which took the whole server down."""

    async def handler(request: HttpRequest) -> HttpResponse:
        return HttpResponse(200, [], b"ok")

    async with open_http_server(handler) as server, HttpClient() as client:
        stream = await trio.open_tcp_stream("127.0.0.1", server.port)
        async with stream:
            await stream.send_all(b"GET //[x HTTP/1.1\r\nhost: a\r\n\r\n")
            answer = b""
            with trio.fail_after(5):
                while chunk := await stream.receive_some():
                    answer += chunk
        assert answer.startswith(b"HTTP/1.1 400 ")
        assert await client.get_bytes(server.url + "/x", max_bytes=10, timeout_s=5) == b"ok"
        assert server.statistics().errors["bad_request"] == 1


# --- receive_range_into: the body straight into the caller's buffer ---------------------------


async def into(client: HttpClient, url: str, start: int, length: int) -> tuple[bytes, list[int]]:
    buf = bytearray(length)
    pieces = [n async for n in client.receive_range_into(url, start, memoryview(buf), timeout_s=5)]
    return bytes(buf), pieces


@pytest.mark.parametrize("use_sendfile", [True, False])
async def test_receive_into_is_byte_exact_and_keeps_the_connection(
    blob: tuple[Path, bytes], use_sendfile: bool
) -> None:
    path, data = blob
    config = HttpServerConfig(use_sendfile=use_sendfile, send_chunk_bytes=256 * 1024)
    async with open_http_server(serve_file(path), config) as server, HttpClient() as client:
        url = server.url + "/blob"
        for start, length in [(0, SIZE), (0, 1), (SIZE - 1, 1), (12345, 1 << 20), (7, 100)]:
            got, pieces = await into(client, url, start, length)
            assert got == data[start : start + length]
            assert sum(pieces) == length
            assert max(pieces) <= 1 << 20  # at most one 1 MiB read per piece
        assert await into(client, url, 5, 0) == (b"", [])
        # the connection read past h11 is reused, and h11 starts the next exchange cleanly
        assert await client.get_bytes(server.url + "/small", max_bytes=100, timeout_s=5) == (
            b"hello shardnet"
        )
        assert await collect(client, url, 3, 10) == data[3:13]
        stats, client_stats = server.statistics(), client.statistics()
    assert (stats.requests, stats.connections_total) == (7, 1)
    assert client_stats.bytes_received == SIZE + 1 + 1 + (1 << 20) + 100 + 14 + 10


async def test_receive_into_a_body_cut_short_keeps_what_arrived() -> None:
    async def script(stream: trio.SocketStream) -> None:
        head = b"HTTP/1.1 206 Partial Content\r\ncontent-range: bytes 0-99/100\r\n"
        await stream.send_all(head + b"content-length: 100\r\n\r\n" + b"x" * 60)

    async with scripted_server(script) as url, HttpClient() as client:
        buf = bytearray(100)
        pieces: list[int] = []

        async def receive() -> None:
            async for n in client.receive_range_into(url + "/b", 0, memoryview(buf), timeout_s=5):
                pieces.append(n)

        with pytest.raises(ClosedMidBody, match="closed mid-body"):
            await receive()
        assert sum(pieces) == 60
        assert bytes(buf[:60]) == b"x" * 60
        assert client.statistics().errors == {"ClosedMidBody": 1}


async def test_receive_into_refuses_a_wrong_range_and_connection_close() -> None:
    async def wrong(stream: trio.SocketStream) -> None:
        head = b"HTTP/1.1 206 Partial Content\r\ncontent-range: bytes 1-100/200\r\n"
        await stream.send_all(head + b"content-length: 100\r\n\r\n" + b"y" * 100)

    async with scripted_server(wrong) as url, HttpClient() as client:
        with pytest.raises(RemoteProtocolError, match="Content-Range"):
            await into(client, url + "/b", 0, 100)

    async def closing(stream: trio.SocketStream) -> None:
        head = b"HTTP/1.1 206 Partial Content\r\ncontent-range: bytes 0-9/10\r\n"
        await stream.send_all(head + b"connection: close\r\ncontent-length: 10\r\n\r\n0123456789")

    async with scripted_server(closing) as url, HttpClient() as client:
        assert (await into(client, url + "/b", 0, 10))[0] == b"0123456789"
        assert client._idle == []  # the server said close: not pooled


async def test_receive_into_stall_is_stream_broken(
    big: Path, jump_clock: trio.testing.MockClock
) -> None:
    async def script(stream: trio.SocketStream) -> None:
        head = b"HTTP/1.1 206 Partial Content\r\ncontent-range: bytes 0-999/1000\r\n"
        await stream.send_all(head + b"content-length: 1000\r\n\r\n" + b"z" * 10)
        await trio.sleep_forever()

    async with scripted_server(script) as url, HttpClient() as client:
        with pytest.raises(StreamBroken, match="no progress"):
            await into(client, url + "/b", 0, 1000)


async def test_receive_into_wakes_for_large_pieces_and_restores_the_socket(
    blob: tuple[Path, bytes],
) -> None:
    """A body sent in 16 KiB pieces is read in pieces of ``RECV_LOWAT_BYTES`` (the socket's
    low-water mark), and the mark is back at 1 before the kept-alive connection is reused."""
    body = random.Random(5).randbytes(2 << 20)

    async def script(stream: trio.SocketStream) -> None:
        head = f"HTTP/1.1 206 Partial Content\r\ncontent-range: bytes 0-{len(body) - 1}/{len(body)}"
        await stream.send_all(f"{head}\r\ncontent-length: {len(body)}\r\n\r\n".encode())
        for i in range(0, len(body), 16 * 1024):
            await stream.send_all(body[i : i + 16 * 1024])
            await trio.lowlevel.checkpoint()

    async with scripted_server(script) as url, HttpClient() as client:
        got, pieces = await into(client, url + "/b", 0, len(body))
        assert got == body
        assert len(pieces) <= len(body) // http_client.RECV_LOWAT_BYTES + 2, pieces

    path, data = blob
    async with open_http_server(serve_file(path)) as server, HttpClient() as client:
        got, _ = await into(client, server.url + "/blob", 0, SIZE)
        assert got == data
        (conn,) = client._idle
        assert conn.stream.socket.getsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT) == 1
        with trio.fail_after(2):  # a mark left at 256 KiB would hold this 14-byte answer
            assert await client.get_bytes(server.url + "/small", max_bytes=100, timeout_s=5) == (
                b"hello shardnet"
            )
        assert server.statistics().connections_total == 1


async def test_receive_into_a_slow_source_is_read_as_it_arrives(
    jump_clock: trio.testing.MockClock,
) -> None:
    """A source at 160 KB/s would take 1.6 s to fill the low-water mark, longer than the 1 s
    no-progress timeout: after ``RECV_LOWAT_WAIT_S`` the rest is read as it comes."""
    body = random.Random(6).randbytes(400 * 1024)

    async def script(stream: trio.SocketStream) -> None:
        head = f"HTTP/1.1 206 Partial Content\r\ncontent-range: bytes 0-{len(body) - 1}/{len(body)}"
        await stream.send_all(f"{head}\r\ncontent-length: {len(body)}\r\n\r\n".encode())
        for i in range(0, len(body), 8 * 1024):
            await stream.send_all(body[i : i + 8 * 1024])
            await trio.sleep(0.05)

    async with scripted_server(script) as url, HttpClient() as client:
        buf = bytearray(len(body))
        start = trio.current_time()
        async for _ in client.receive_range_into(url + "/b", 0, memoryview(buf), timeout_s=1):
            pass
        assert bytes(buf) == body
        assert trio.current_time() - start < 3.0


# --- get_into: a whole body of known size straight into the caller's buffer -------------------


@pytest.mark.parametrize("use_sendfile", [True, False])
async def test_get_into_is_byte_exact_and_keeps_the_connection(
    blob: tuple[Path, bytes], use_sendfile: bool
) -> None:
    path, data = blob
    config = HttpServerConfig(use_sendfile=use_sendfile, send_chunk_bytes=256 * 1024)
    async with open_http_server(serve_file(path), config) as server, HttpClient() as client:
        buf = bytearray(SIZE)
        await get_into(client, server.url + "/blob", memoryview(buf), timeout_s=5)
        assert bytes(buf) == data
        small = bytearray(14)
        await get_into(client, server.url + "/small", memoryview(small), timeout_s=5)
        assert bytes(small) == b"hello shardnet"
        # the connection read past h11 is reused, and h11 starts the next exchange cleanly
        assert await collect(client, server.url + "/blob", 3, 10) == data[3:13]
        stats = server.statistics()
    assert (stats.requests, stats.connections_total) == (3, 1)


async def test_get_into_refuses_another_length_status_or_a_short_body(
    blob: tuple[Path, bytes],
) -> None:
    path, _ = blob
    async with open_http_server(serve_file(path)) as server, HttpClient() as client:
        with pytest.raises(RemoteProtocolError, match="Content-Length 14 for 15"):
            await get_into(client, server.url + "/small", memoryview(bytearray(15)), timeout_s=5)
        with pytest.raises(NotAvailable):
            await get_into(client, server.url + "/nothing", memoryview(bytearray(4)), timeout_s=5)

    async def short(stream: trio.SocketStream) -> None:
        await stream.send_all(b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\n" + b"x" * 60)

    async with scripted_server(short) as url, HttpClient() as client:
        buf = bytearray(100)
        with pytest.raises(ClosedMidBody, match="closed mid-body"):
            await get_into(client, url + "/b", memoryview(buf), timeout_s=5)
        assert bytes(buf[:60]) == b"x" * 60

    async def chunked_long(stream: trio.SocketStream) -> None:  # no length: read through h11
        body = b"a\r\n0123456789\r\n5\r\nabcde\r\n0\r\n\r\n"
        await stream.send_all(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n" + body)

    async with scripted_server(chunked_long) as url, HttpClient() as client:
        with pytest.raises(RemoteProtocolError, match="more than the 12 bytes"):
            await get_into(client, url + "/b", memoryview(bytearray(12)), timeout_s=5)
        buf = bytearray(15)
        await get_into(client, url + "/b", memoryview(buf), timeout_s=5)
        assert bytes(buf) == b"0123456789abcde"
