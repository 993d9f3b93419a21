"""The HTTP lane server over a stream-lane stream, send by send: the response head goes out in
the same send as the body's first piece (one muxer frame less per request), and alone before
any wait, so the client sees it as early as over TCP (:mod:`p2p.http_server`)."""

from __future__ import annotations

import random
from pathlib import Path

import trio
import trio.testing

from p2p.http_server import FileSlice, HttpRequest, HttpResponse, HttpServer

BODY = random.Random(24).randbytes(64 * 1024)
REQUEST = b"GET /shard HTTP/1.1\r\nhost: p2p\r\n\r\n"


class RecordingStream:
    """A :class:`~p2p.bytestream.ByteStream` that delivers one request, then waits; every
    ``send_all`` is recorded with the virtual time it happened at."""

    def __init__(self) -> None:
        self.sends: list[tuple[float, bytes]] = []
        self._requested = False
        self.closed = False

    async def receive_some(self, max_bytes: int | None = None) -> bytes:
        if not self._requested:
            self._requested = True
            return REQUEST
        await trio.sleep_forever()
        raise AssertionError("unreachable")

    async def send_all(self, data: bytes | memoryview) -> None:
        self.sends.append((trio.current_time(), bytes(data)))

    async def aclose(self) -> None:
        self.closed = True


def _split(sent: bytes) -> tuple[bytes, bytes]:
    head, _, body = sent.partition(b"\r\n\r\n")
    return head + b"\r\n\r\n", body


async def _serve(response: HttpResponse, until_s: float) -> RecordingStream:
    async def handle(req: HttpRequest) -> HttpResponse:
        return response

    server = HttpServer(handle)
    stream = RecordingStream()
    with trio.move_on_after(until_s):
        await server.serve_stream("peer", stream)
    return stream


def test_a_file_piece_goes_out_with_the_head_in_one_send(tmp_path: Path) -> None:
    path = tmp_path / "shard"
    path.write_bytes(BODY)
    body = FileSlice(path, 0, len(BODY), len(BODY))

    async def main() -> RecordingStream:
        return await _serve(HttpResponse(200, body=body), 5.0)

    stream = trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
    assert len(stream.sends) == 1
    head, got = _split(stream.sends[0][1])
    assert head.startswith(b"HTTP/1.1 200 ")
    assert b"content-length: 65536" in head.lower()
    assert got == BODY


def test_a_bytes_body_goes_out_with_the_head_in_one_send() -> None:
    async def main() -> RecordingStream:
        return await _serve(HttpResponse(429, body=b"over budget"), 5.0)

    stream = trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
    assert len(stream.sends) == 1
    head, got = _split(stream.sends[0][1])
    assert head.startswith(b"HTTP/1.1 429 ")
    assert got == b"over budget"


def test_the_head_is_not_held_while_the_first_piece_is_not_ready(tmp_path: Path) -> None:
    """A relay serving a shard still arriving: the head leaves at once, the body when ready."""
    path = tmp_path / "shard"
    path.write_bytes(BODY)

    async def ready(offset: int) -> int:
        await trio.sleep(2.0)
        return len(BODY)

    body = FileSlice(path, 0, len(BODY), len(BODY), ready=ready)

    async def main() -> RecordingStream:
        return await _serve(HttpResponse(200, body=body), 5.0)

    stream = trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
    assert [round(t, 3) for t, _ in stream.sends] == [0.0, 2.0]
    assert stream.sends[0][1].startswith(b"HTTP/1.1 200 ")
    assert stream.sends[0][1].endswith(b"\r\n\r\n")
    assert stream.sends[1][1] == BODY


def test_a_file_shorter_than_promised_still_sends_the_head(tmp_path: Path) -> None:
    """The client sees a short body (then the end of the stream), as over TCP."""
    path = tmp_path / "shard"
    path.write_bytes(b"")  # truncated after the handler sized it

    body = FileSlice(path, 0, len(BODY), len(BODY))

    async def main() -> RecordingStream:
        return await _serve(HttpResponse(200, body=body), 5.0)

    stream = trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
    assert len(stream.sends) == 1
    assert stream.sends[0][1].startswith(b"HTTP/1.1 200 ")
    assert stream.sends[0][1].endswith(b"\r\n\r\n")
    assert stream.closed
