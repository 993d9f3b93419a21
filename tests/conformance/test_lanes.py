"""One conformance suite for both networks behind :mod:`p2p.lanes`: the real one (libp2p and
h11 on 127.0.0.1) and the in-memory one (:mod:`p2p.memnet`).

In the spirit of trio's ``check_two_way_stream``: every test takes a :class:`Pair` (two
nodes' hosts, an HTTP lane server on one and a client on the other) from a factory per
implementation, and checks what node code relies on: request/response and its bounds and
errors, gossip delivery, validation and forwarding, peer-gone notification, HTTP GET, Range
semantics and the status-to-error mapping.
"""

from __future__ import annotations

import random
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import trio
import trio.testing

from p2p.bytestream import STREAM_LANE_PROTOCOL, stream_lane_url
from p2p.errors import (
    MessageTooLarge,
    PeerUnreachable,
    RemoteProtocolError,
    ShardnetError,
    StreamBroken,
    short_id,
)
from p2p.host import HostConfig, P2PNode
from p2p.http_client import HttpClient
from p2p.http_errors import NotAvailable
from p2p.http_server import (
    FileSlice,
    HttpRequest,
    HttpResponse,
    HttpServer,
    HttpServerConfig,
    file_response,
)
from p2p.identity import Identity
from p2p.lanes import REAL_NETWORK, Host, HttpHandler, HttpLaneClient, HttpLaneServer, Network
from p2p.memnet import MemNetwork

if TYPE_CHECKING:
    from trio_typing import TaskStatus

    from p2p.bytestream import ByteStream

TOPIC = "/conformance/1"
FILE_BYTES = bytes(range(256)) * 40  # 10,240 bytes


@dataclass
class Pair:
    a: Host
    b: Host
    c: Host
    server: HttpLaneServer  # on b
    client: HttpLaneClient  # on a
    kill_b: Callable[[], Awaitable[None]]  # returns once b's host is closed
    settle: Callable[[], Awaitable[None]]  # returns once no gossip is in flight


def _lane_handler(tmp: Path) -> HttpHandler:
    path = tmp / "blob"
    path.write_bytes(FILE_BYTES)

    async def handle(req: HttpRequest) -> HttpResponse:
        if req.path == "/blob":
            return file_response(req, path, len(FILE_BYTES), etag='"x"')
        if req.path == "/small":
            return HttpResponse(200, [("content-type", "text/plain")], b"hello")
        if req.path == "/busy":
            return HttpResponse(503, [("retry-after", "3")])
        if req.path == "/teapot":
            return HttpResponse(418)
        if req.path == "/boom":
            raise RuntimeError("application bug")
        if req.path == "/short":  # the file is shorter than the slice promises
            return HttpResponse(200, [], FileSlice(path, 0, len(FILE_BYTES) + 100, 1 << 20))
        if req.path == "/headers":
            return HttpResponse(200, [], repr(sorted(req.headers.items())).encode())
        if req.path == "/other-range":  # 206 for bytes other than those asked
            return HttpResponse(206, [("content-range", "bytes 5-9/100")], b"56789")
        if req.path == "/bad-range":  # 206 with a Content-Range that does not parse
            return HttpResponse(206, [("content-range", "bytes five/100")], b"56789")
        if req.path == "/unsatisfiable":
            return HttpResponse(416, [("content-range", "bytes */100")])
        if req.path == "/gone":
            return HttpResponse(404)
        if req.path == "/conflict":
            return HttpResponse(409)
        if req.path == "/slow-down":
            return HttpResponse(429, [("retry-after", "7")])
        if req.path == "/bad-gateway":
            return HttpResponse(502)
        return HttpResponse(404)

    return handle


Factory = Callable[[Path], AbstractAsyncContextManager[Pair]]


@asynccontextmanager
async def real_pair(tmp: Path) -> AsyncIterator[Pair]:
    """Real hosts and lane on 127.0.0.1; host b can be stopped from inside the test."""
    ids = [Identity.from_seed(f"conf-{n}") for n in "abc"]
    cfg = HostConfig(("/ip4/127.0.0.1/tcp/0",), dial_timeout_s=3.0)
    async with (
        REAL_NETWORK.open_host(ids[0], cfg) as a,
        REAL_NETWORK.open_host(ids[2], cfg) as c,
        REAL_NETWORK.open_http_server(
            _lane_handler(tmp), HttpServerConfig(host="127.0.0.1", handler_timeout_s=1.0)
        ) as server,
        REAL_NETWORK.open_http_client(headers={"x-test": "1"}, sign=None) as client,
        trio.open_nursery() as nursery,
    ):
        host_b, held_b = await nursery.start(_hold_host, REAL_NETWORK, ids[1], cfg)
        # Every host runs in this trio run over loopback, where a sent frame is readable at
        # once: when no task can run, nothing is in flight.
        settle = trio.testing.wait_all_tasks_blocked
        yield Pair(a, host_b, c, server, client, held_b.kill, settle)
        held_b.stop.set()


@asynccontextmanager
async def mem_pair(tmp: Path) -> AsyncIterator[Pair]:
    """In-memory hosts and lane; host b can be killed from inside the test."""
    ids = [Identity.from_seed(f"conf-{n}") for n in "abc"]
    async with MemNetwork(random.Random(7)) as net:
        ea, eb, ec = net.endpoint(), net.endpoint(), net.endpoint()
        cfg = HostConfig(dial_timeout_s=3.0)
        async with (
            ea.open_host(ids[0], cfg) as a,
            ec.open_host(ids[2], cfg) as c,
            eb.open_http_server(
                _lane_handler(tmp), HttpServerConfig(host=eb.ip, handler_timeout_s=1.0)
            ) as server,
            ea.open_http_client(headers={"x-test": "1"}, sign=None) as client,
            trio.open_nursery() as nursery,
        ):
            host_b, held_b = await nursery.start(_hold_host, eb, ids[1], cfg)
            yield Pair(a, host_b, c, server, client, held_b.kill, net.wait_quiet)
            held_b.stop.set()


class _Held:
    """A host held open by :func:`_hold_host` until ``stop`` is set."""

    def __init__(self) -> None:
        self.stop = trio.Event()
        self.closed = trio.Event()

    async def kill(self) -> None:
        """Close the host; returns once it is closed (its ``async with`` has exited)."""
        self.stop.set()
        await self.closed.wait()


async def _hold_host(
    net: Network,
    ident: Identity,
    cfg: HostConfig,
    *,
    task_status: TaskStatus[tuple[Host, _Held]] = trio.TASK_STATUS_IGNORED,
) -> None:
    held = _Held()
    try:
        async with net.open_host(ident, cfg) as host:
            task_status.started((host, held))
            await held.stop.wait()
    finally:
        held.closed.set()


@pytest.fixture(params=["real", "mem"])
def pair_factory(request: pytest.FixtureRequest) -> Factory:
    return real_pair if request.param == "real" else mem_pair


async def _echo(sender: str, data: bytes) -> bytes:
    return sender.encode() + b"|" + data


# -- request/response ------------------------------------------------------------------------


async def test_request_response_round_trip(pair_factory: Factory, tmp_path: Path) -> None:
    async with pair_factory(tmp_path) as p:
        p.b.serve("/echo/1", _echo, max_request_bytes=100, max_response_bytes=200, timeout_s=5)
        assert await p.a.connect(p.b.multiaddrs()[0]) == p.b.peer_id
        assert p.b.peer_id in p.a.connected_peers()
        got = await p.a.request(p.b.peer_id, "/echo/1", b"hi", max_response_bytes=200, timeout_s=5)
        assert got == p.a.peer_id.encode() + b"|hi"
        # both directions on one connection
        p.a.serve("/echo/1", _echo, max_request_bytes=100, max_response_bytes=200, timeout_s=5)
        assert await p.b.connect(p.a.multiaddrs()[0]) == p.a.peer_id
        back = await p.b.request(p.a.peer_id, "/echo/1", b"x", max_response_bytes=200, timeout_s=5)
        assert back == p.b.peer_id.encode() + b"|x"


async def test_request_errors(pair_factory: Factory, tmp_path: Path) -> None:
    async def refuse(sender: str, data: bytes) -> bytes:
        raise RemoteProtocolError(sender, "no")

    async def slow(sender: str, data: bytes) -> bytes:
        await trio.sleep(30)
        return b""

    async with pair_factory(tmp_path) as p:
        p.b.serve("/echo/1", _echo, max_request_bytes=10, max_response_bytes=200, timeout_s=5)
        p.b.serve("/refuse/1", refuse, max_request_bytes=10, max_response_bytes=10, timeout_s=5)
        p.b.serve("/slow/1", slow, max_request_bytes=10, max_response_bytes=10, timeout_s=0.5)
        await p.a.connect(p.b.multiaddrs()[0])
        # response over the caller's bound
        with pytest.raises(MessageTooLarge):
            await p.a.request(p.b.peer_id, "/echo/1", b"hi", max_response_bytes=5, timeout_s=5)
        # request over the server's bound: the stream is reset
        with pytest.raises(StreamBroken):
            await p.a.request(p.b.peer_id, "/echo/1", b"x" * 50, max_response_bytes=99, timeout_s=5)
        # the handler refuses
        with pytest.raises(StreamBroken):
            await p.a.request(p.b.peer_id, "/refuse/1", b"x", max_response_bytes=99, timeout_s=5)
        # the handler is too slow for the server's own timeout
        with pytest.raises(StreamBroken):
            await p.a.request(p.b.peer_id, "/slow/1", b"x", max_response_bytes=99, timeout_s=5)
        # the caller's timeout
        with pytest.raises(StreamBroken):
            await p.a.request(p.b.peer_id, "/slow/1", b"x", max_response_bytes=99, timeout_s=0.2)
        # a protocol the peer does not speak
        with pytest.raises(RemoteProtocolError):
            await p.a.request(p.b.peer_id, "/nope/1", b"x", max_response_bytes=99, timeout_s=5)
        # still usable afterwards
        ok = await p.a.request(p.b.peer_id, "/echo/1", b"ok", max_response_bytes=200, timeout_s=5)
        assert ok.endswith(b"|ok")


async def test_dial_errors_and_peer_gone(pair_factory: Factory, tmp_path: Path) -> None:
    async with pair_factory(tmp_path) as p:
        gone = trio.Event()
        b_id, b_addr = p.b.peer_id, p.b.multiaddrs()[0]
        p.a.on_peer_gone(lambda pid: gone.set() if pid == b_id else None)
        await p.a.connect(b_addr)
        await p.kill_b()
        with trio.fail_after(10):
            await gone.wait()
        assert b_id not in p.a.connected_peers()
        with pytest.raises(PeerUnreachable):
            await p.a.request(b_id, "/echo/1", b"x", max_response_bytes=99, timeout_s=2)
        with pytest.raises(PeerUnreachable):
            await p.a.connect(b_addr)


# -- gossip ----------------------------------------------------------------------------------


async def test_gossip_delivery_check_and_forwarding(pair_factory: Factory, tmp_path: Path) -> None:
    """a - b - c in a line: a's message reaches c through b; a refused one reaches nobody."""

    def check(origin: str, data: bytes) -> None:
        if data.startswith(b"bad"):
            raise RemoteProtocolError(origin, "refused by check")

    async with pair_factory(tmp_path) as p:
        subs = {}
        for name, h in (("a", p.a), ("b", p.b), ("c", p.c)):
            subs[name] = await h.subscribe(TOPIC, check)
        await p.a.connect(p.b.multiaddrs()[0])
        await p.c.connect(p.b.multiaddrs()[0])
        await p.a.wait_for_subscriber(p.b.peer_id, TOPIC, timeout_s=10)
        await p.c.wait_for_subscriber(p.b.peer_id, TOPIC, timeout_s=10)
        await p.b.wait_for_subscriber(p.a.peer_id, TOPIC, timeout_s=10)
        await p.b.wait_for_subscriber(p.c.peer_id, TOPIC, timeout_s=10)
        await p.a.publish(TOPIC, b"bad one")
        await p.a.publish(TOPIC, b"good one")
        with trio.fail_after(10):
            mb = await subs["b"].receive()
            mc = await subs["c"].receive()
        assert (mb.origin, mb.data) == (p.a.peer_id, b"good one")
        assert (mc.origin, mc.data) == (p.a.peer_id, b"good one")
        assert subs["a"].statistics().received == 0  # no echo to the publisher
        with pytest.raises(MessageTooLarge):
            await p.a.publish(TOPIC, b"x" * (1 << 20))
        # the same message is delivered once even though it can arrive twice (b and c connect)
        await p.a.connect(p.c.multiaddrs()[0])
        await p.a.wait_for_subscriber(p.c.peer_id, TOPIC, timeout_s=10)
        await p.a.publish(TOPIC, b"second")
        with trio.fail_after(10):
            assert (await subs["c"].receive()).data == b"second"
        await p.settle()  # the copy through b has arrived too, and was suppressed
        assert subs["c"].statistics().delivered == 2
        assert subs["c"].statistics().received == 2


# -- HTTP lane -------------------------------------------------------------------------------


async def test_http_get_and_ranges(pair_factory: Factory, tmp_path: Path) -> None:
    async with pair_factory(tmp_path) as p:
        url = p.server.url
        assert await p.client.get_bytes(url + "/small", max_bytes=10, timeout_s=5) == b"hello"
        echoed = await p.client.get_bytes(url + "/headers", max_bytes=4096, timeout_s=5)
        assert b"('x-test', '1')" in echoed
        whole = await p.client.get_bytes(url + "/blob", max_bytes=1 << 20, timeout_s=5)
        assert whole == FILE_BYTES
        for start, length in ((0, 1), (100, 5000), (10_000, 240), (0, len(FILE_BYTES))):
            got = b""
            async for chunk in p.client.stream_range(
                url + "/blob", start, length, timeout_s=5, chunk_bytes=1000
            ):
                assert len(chunk) <= 1000
                got += chunk
            assert got == FILE_BYTES[start : start + length]
        # past the end: 416 is not a "not available", it is the peer's protocol error
        with pytest.raises(RemoteProtocolError):
            async for _ in p.client.stream_range(url + "/blob", 20_000, 10, timeout_s=5):
                pass
        # a resource that ignores Range (200 for a range not at 0) is refused
        with pytest.raises(RemoteProtocolError):
            async for _ in p.client.stream_range(url + "/small", 1, 2, timeout_s=5):
                pass
        stats = p.server.statistics()
        assert stats.requests >= 7
        assert stats.bytes_sent >= len(FILE_BYTES) * 2
        assert p.client.statistics().bytes_received >= len(FILE_BYTES) * 2


async def test_http_errors(pair_factory: Factory, tmp_path: Path) -> None:
    async with pair_factory(tmp_path) as p:
        url = p.server.url
        with pytest.raises(NotAvailable) as busy:
            await p.client.get_bytes(url + "/busy", max_bytes=10, timeout_s=5)
        assert busy.value.retry_after_s == 3
        with pytest.raises(NotAvailable):
            await p.client.get_bytes(url + "/missing", max_bytes=10, timeout_s=5)
        with pytest.raises(RemoteProtocolError):
            await p.client.get_bytes(url + "/teapot", max_bytes=10, timeout_s=5)
        with pytest.raises(StreamBroken):  # 500: the server failed
            await p.client.get_bytes(url + "/boom", max_bytes=10, timeout_s=5)
        with pytest.raises(MessageTooLarge):
            await p.client.get_bytes(url + "/blob", max_bytes=100, timeout_s=5)
        with pytest.raises(StreamBroken):  # the body ends short of its Content-Length
            await p.client.get_bytes(url + "/short", max_bytes=1 << 20, timeout_s=5)
        dead = url.rsplit(":", 1)[0] + ":1"
        with pytest.raises(PeerUnreachable):
            await p.client.get_bytes(dead + "/small", max_bytes=10, timeout_s=5)
        counts = p.client.statistics().errors
        assert counts["NotAvailable"] == 2
        assert counts["PeerUnreachable"] == 1


async def _failure(call: Awaitable[object]) -> tuple[str, str, float | None]:
    """How ``call`` failed: error class, message without its source label, Retry-After."""
    try:
        await call
    except ShardnetError as exc:
        source = getattr(exc, "peer", None)  # the transport errors name it first
        message = str(exc).removeprefix(f"{short_id(source)}: " if source else "")
        return type(exc).__name__, message, getattr(exc, "retry_after_s", None)
    raise AssertionError("no error")


async def _ask(client: HttpLaneClient, url: str, how: str, start: int, size: int) -> None:
    """``get``: GET a whole body of at most ``size`` bytes; ``range``/``into``: bytes
    ``[start, start + size)`` with ``stream_range``/``receive_range_into``."""
    if how == "get":
        await client.get_bytes(url, max_bytes=size, timeout_s=5)
    elif how == "range":
        async for _ in client.stream_range(url, start, size, timeout_s=5):
            pass
    else:
        async for _ in client.receive_range_into(
            url, start, memoryview(bytearray(size)), timeout_s=5
        ):
            pass


def _url(server: str, path: str) -> str:
    return path if "://" in path else server + path


# (expected error, path asked, how, start, size): each answer is a bad one
HEAD_FAILURES = [
    ("RemoteProtocolError", "/other-range", "range", 0, 5),  # 206 for other bytes
    ("RemoteProtocolError", "/other-range", "into", 0, 5),
    ("RemoteProtocolError", "/bad-range", "range", 0, 5),  # a Content-Range that does not parse
    ("RemoteProtocolError", "/small", "range", 1, 2),  # 200 for a range not at 0
    ("RemoteProtocolError", "/small", "range", 0, 3),  # 200 whose Content-Length is not the range
    ("RemoteProtocolError", "/unsatisfiable", "range", 0, 5),  # 416
    ("RemoteProtocolError", "/teapot", "get", 0, 10),  # 418
    ("RemoteProtocolError", "/other-range", "get", 0, 10),  # 206 to a whole GET
    ("NotAvailable", "/gone", "get", 0, 10),  # 404
    ("NotAvailable", "/conflict", "range", 0, 5),  # 409
    ("NotAvailable", "/slow-down", "range", 0, 5),  # 429 with Retry-After: 7
    ("NotAvailable", "/busy", "get", 0, 10),  # 503 with Retry-After: 3
    ("StreamBroken", "/boom", "get", 0, 10),  # 500
    ("StreamBroken", "/bad-gateway", "range", 0, 5),  # 502
    ("ClosedMidBody", "/short", "range", 0, len(FILE_BYTES) + 100),  # closed short of its length
    ("ClosedMidBody", "/short", "into", 0, len(FILE_BYTES) + 100),
    ("MessageTooLarge", "/blob", "get", 0, 100),  # declared body over the bound
    ("LocalProtocolError", "ftp://x", "get", 0, 10),  # not an http:// URL
    ("LocalProtocolError", "/blob", "range", -1, 5),  # a negative start
    ("LocalProtocolError", "/blob", "into", -1, 5),
]


@asynccontextmanager
async def stream_lane(tmp: Path) -> AsyncIterator[tuple[HttpLaneClient, str]]:
    """The lane over a libp2p stream (:mod:`p2p.bytestream`): host b serves the same handler
    on :data:`STREAM_LANE_PROTOCOL` with no TCP listener, and *b dials a* (as a node behind a
    NAT dials out); a's client asks ``p2p://<b>`` over that connection. Yields the client and
    the base URL."""
    ids = [Identity.from_seed(f"conf-{n}") for n in "ab"]
    cfg = HostConfig(("/ip4/127.0.0.1/tcp/0",), dial_timeout_s=3.0)
    server = HttpServer(_lane_handler(tmp), HttpServerConfig(handler_timeout_s=1.0))
    async with P2PNode.open(ids[0], cfg) as a, P2PNode.open(ids[1], cfg) as b:
        b.serve_stream(STREAM_LANE_PROTOCOL, server.serve_stream)
        await b.connect(a.multiaddrs()[0], keep=False)

        async def opener(peer: str, timeout_s: float) -> ByteStream:
            return await a.open_stream(peer, STREAM_LANE_PROTOCOL, timeout_s)

        async with HttpClient(headers={"x-test": "1"}, open_stream=opener) as client:
            yield client, stream_lane_url(b.peer_id)


async def test_http_clients_fail_alike(tmp_path: Path) -> None:
    """The real client (over TCP and over a libp2p stream) and the in-memory client judge
    answers with the same checks (:mod:`p2p.http_checks`): for each bad answer, the same error
    class, message and Retry-After, and the same error counters. A client that checked on its
    own would drift."""
    got: dict[str, list[tuple[str, str, float | None]]] = {}
    counted: dict[str, dict[str, int]] = {}
    for name, factory in (("real", real_pair), ("mem", mem_pair)):
        (tmp_path / name).mkdir()
        async with factory(tmp_path / name) as p:
            got[name] = [
                await _failure(_ask(p.client, _url(p.server.url, path), how, start, size))
                for _, path, how, start, size in HEAD_FAILURES
            ]
            counted[name] = dict(p.client.statistics().errors)
    (tmp_path / "stream").mkdir()
    async with stream_lane(tmp_path / "stream") as (client, base):
        got["stream"] = [
            await _failure(_ask(client, _url(base, path), how, start, size))
            for _, path, how, start, size in HEAD_FAILURES
        ]
        counted["stream"] = dict(client.statistics().errors)
    for case, real, mem, stream in zip(
        HEAD_FAILURES, got["real"], got["mem"], got["stream"], strict=True
    ):
        assert real[0] == case[0], (case, real)
        assert mem == real, case
        assert stream == real, case
    assert [r[2] for r in got["real"] if r[2] is not None] == [7, 3]  # Retry-After, seconds
    assert counted["mem"] == counted["real"]
    assert counted["stream"] == counted["real"]
