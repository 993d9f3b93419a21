"""A streamed response body (:class:`~p2p.http_body.StreamedBody`, a batch of delta blobs each
sent the moment it is verified) on real HTTP on 127.0.0.1 and on the in-memory network: its
pieces reach the client as they are produced, ``receive_into`` announces them as they land,
and a body that ends short of its length, or runs past it, is cut (the client keeps what
arrived and sees ``ClosedMidBody``, the in-order close a requester tells from a reset), never
padded."""

from __future__ import annotations

import random
from collections.abc import AsyncGenerator, Callable

import pytest
import trio
import trio.testing

from p2p.errors import ClosedMidBody
from p2p.http_client import HttpClient
from p2p.http_server import (
    Handler,
    HttpRequest,
    HttpResponse,
    HttpServerConfig,
    StreamedBody,
    open_http_server,
)
from p2p.memnet import MemNetwork
from tests.helpers import get_into

BODY = bytes(range(256)) * 40  # 10,240 bytes
HALF = len(BODY) // 2


def _handler(produce: Callable[[], AsyncGenerator[bytes, None]]) -> Handler:
    """Answers every request with ``produce()``'s pieces as a body of ``len(BODY)`` bytes."""

    async def handle(req: HttpRequest) -> HttpResponse:
        return HttpResponse(200, [], StreamedBody(len(BODY), produce()))

    return handle


async def test_each_piece_reaches_the_client_before_the_next_exists() -> None:
    """The second half is produced only once the client has announced the first: a server
    that buffered the body, or a client that announced it only whole, would wait forever."""
    seen_first = trio.Event()
    closed: list[bool] = []

    async def produce() -> AsyncGenerator[bytes, None]:
        try:
            yield BODY[:HALF]
            await seen_first.wait()
            yield BODY[HALF:]
        finally:
            closed.append(True)

    async with (
        open_http_server(_handler(produce)) as server,
        HttpClient() as client,
    ):
        buf = bytearray(len(BODY))
        got = 0
        with trio.fail_after(10):
            async for n in client.receive_into(server.url + "/b", memoryview(buf), timeout_s=5):
                got += n
                if got >= HALF:
                    assert bytes(buf[:HALF]) == BODY[:HALF]
                    seen_first.set()
        assert bytes(buf) == BODY
        # the connection is reused: the body's framing ended where its length said
        await get_into(client, server.url + "/b", memoryview(buf), timeout_s=5)
        stats = server.statistics()
    assert closed == [True, True]
    assert (stats.requests, stats.connections_total, stats.bytes_sent) == (2, 1, 2 * len(BODY))


@pytest.mark.parametrize(("sent", "kind"), [(HALF, "not_ready"), (len(BODY) + 1, "body_overrun")])
async def test_a_body_that_ends_short_or_runs_over_is_cut(sent: int, kind: str) -> None:
    async def produce() -> AsyncGenerator[bytes, None]:
        yield BODY[:HALF]
        if sent > HALF:
            yield BODY[HALF:] + b"!"

    async with (
        open_http_server(_handler(produce)) as server,
        HttpClient() as client,
    ):
        buf = bytearray(len(BODY))
        with trio.fail_after(10), pytest.raises(ClosedMidBody, match="closed mid-body"):
            await get_into(client, server.url + "/b", memoryview(buf), timeout_s=5)
        assert bytes(buf[:HALF]) == BODY[:HALF]  # what arrived stays
    assert server.statistics().errors[kind] == 1  # counted by the connection's task, ended


async def test_the_in_memory_network_sends_a_streamed_body_or_cuts_it(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """The simulator's lane takes the same body: the first piece reaches the client before
    the second is produced, and the body is cut short (``ClosedMidBody``, the pieces that came
    kept) when the pieces end early."""
    short, seen_first = [False], trio.Event()

    async def produce() -> AsyncGenerator[bytes, None]:
        yield BODY[:HALF]
        if short[0]:
            return
        await seen_first.wait()  # a later blob, verified once the client had the first
        yield BODY[HALF:]

    async with MemNetwork(random.Random(1)) as net:
        ea, eb = net.endpoint(), net.endpoint()
        async with (
            eb.open_http_server(_handler(produce), HttpServerConfig(host=eb.ip)) as server,
            ea.open_http_client() as client,
        ):
            buf = bytearray(len(BODY))
            got = 0
            with trio.fail_after(60):  # virtual: a lane that gathered the body would hang here
                url = server.url + "/b"
                async for n in client.receive_into(url, memoryview(buf), timeout_s=5):
                    got += n
                    if got >= HALF:
                        assert bytes(buf[:HALF]) == BODY[:HALF]
                        seen_first.set()
            assert got == len(BODY)
            assert bytes(buf) == BODY
            short[0] = True
            buf = bytearray(len(BODY))
            with pytest.raises(ClosedMidBody):
                await get_into(client, server.url + "/b", memoryview(buf), timeout_s=5)
            assert bytes(buf[:HALF]) == BODY[:HALF]
            assert server.statistics().errors["not_ready"] == 1
