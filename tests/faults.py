"""Fake shard sources for downloader tests: real HTTP on 127.0.0.1, scripted misbehaviour.

:func:`make_version` builds a small signed version committed in an "honest" store;
:func:`honest_source` serves it with the real :class:`~shardcast.serve.server.VersionServer`;
:func:`fault_source` serves the same bytes from a scripted HTTP/1.1 server (h11 over a trio
TCP listener) that misbehaves as its :class:`Fault` policy says, request by request, and
records every range it was asked for.
"""

from __future__ import annotations

import enum
import random
import re
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import h11
import trio

from p2p.http_range import (
    ByteRange,
    UnsatisfiableRange,
    format_content_range,
    format_unsatisfied_range,
    parse_range,
    resolve_range,
)
from p2p.http_server import HttpRequest, HttpResponse, HttpServer, open_http_server
from shardcast.publish.plan import hash_parts
from shardcast.serve.server import VersionServer
from shardcast.store.store import VersionStore
from shardcast.wire.manifest import FileEntry, Header, Manifest, sign_header, sign_part
from tests.helpers import TRAINER, trust

RUN = "run"
_FILES_ROUTE = re.compile(r"^/shardnet/v1/[^/]+/\d+/[0-9a-f]{64}/files/(?P<name>[^/]+)$")


@dataclass(frozen=True)
class Version:
    """A committed test version: its signed manifest, the true bytes, the store holding it."""

    signed: Manifest
    files: dict[str, bytes]
    store: VersionStore

    @property
    def step(self) -> int:
        return self.signed.step

    @property
    def shard_size(self) -> int:
        return self.signed.header.shard_size


def make_version(
    root: Path,
    sizes: dict[str, int],
    shard_size: int,
    *,
    step: int = 1,
    seed: int = 0,
    nonce: int = 1000,
    chunk_bytes: int = 0,
    shards_per_part: int = 1000,
) -> Version:
    """Write files of seeded random bytes, sign their manifest and commit them under ``root``.

    ``chunk_bytes``: the parts list per-shard chunk digests of that size (0: none, so a
    receiver verifies whole shards, byte-granular resumption and assembled-copy blame).

    ``shards_per_part``: shards listed by each signed part (the default puts a test's whole
    version in one part).

    Any flat file names will do: sharding does not look at the content or the layout. Two
    versions of one step differ in manifest digest only if their ``nonce`` (or sizes) differ.
    """
    rng = random.Random(seed)
    files = {name: rng.randbytes(size) for name, size in sorted(sizes.items())}
    directory = root / f"src-{step}"
    directory.mkdir(parents=True)
    for name, data in files.items():
        (directory / name).write_bytes(data)
    entries = tuple(FileEntry(n, len(d)) for n, d in files.items())
    header = Header(RUN, step, shard_size, entries, shards_per_part, nonce=f"{nonce:032x}")
    signed = Manifest(sign_header(header, TRAINER))
    hash_parts(
        directory,
        header,
        signed.digest,
        on_part=lambda p: signed.add_part(sign_part(p, TRAINER)),  # type: ignore[func-returns-value]
        chunk_bytes=chunk_bytes,
    )
    store = VersionStore(root / "honest", RUN, keep_last=4)
    store.adopt(directory, signed)
    return Version(signed, files, store)


@asynccontextmanager
async def honest_source(version: Version) -> AsyncIterator[tuple[HttpServer, list[int]]]:
    """The real lane: a :class:`VersionServer` over the honest store.

    Yields the server and the list of the first byte offsets of the ranges it was asked for.
    """
    server = VersionServer(version.store, trust())
    asked: list[int] = []

    async def handler(request: HttpRequest) -> HttpResponse:
        if isinstance(request.range, ByteRange):
            asked.append(request.range.first)
        return await server.handle(request)

    async with open_http_server(handler) as http:
        yield http, asked


TRICKLE_BYTES = 1024  # Fault.TRICKLE: bytes per piece
TRICKLE_S = 1.0  # Fault.TRICKLE: seconds between pieces


class Fault(enum.Enum):
    """How a fault source answers one range request."""

    HONEST = "honest"
    CORRUPT = "corrupt"  # flips the first byte of the range it serves
    TRUNCATE = "truncate"  # sends the headers and half the body, then closes the connection
    STALL_AFTER_HEADERS = "stall_after_headers"  # sends the headers, then nothing, forever
    STALL_BEFORE_ANSWER = "stall_before_answer"  # reads the request, never answers
    UNAVAILABLE = "unavailable"  # 503 with Retry-After: 1
    WRONG_VERSION = "wrong_version"  # 409: it holds another version under this step
    SHORT_FILE = "short_file"  # serves every file as if it were shorter (a stale copy)
    TRICKLE = "trickle"  # sends the body TRICKLE_BYTES every TRICKLE_S (a congested uplink)


@dataclass(frozen=True)
class Ask:
    """One range request as a fault source sees it (``offset``: in the file)."""

    file: str
    offset: int
    length: int


Policy = Callable[[Ask], Fault]


@dataclass
class FaultSource:
    """A running fault source: its URL and what it was asked."""

    url: str
    asks: list[Ask] = field(default_factory=list)
    body_bytes_sent: int = 0


@asynccontextmanager
async def fault_source(
    version: Version, policy: Fault | Policy, *, short_by: int | None = None
) -> AsyncIterator[FaultSource]:
    """Serve ``version``'s files over HTTP/1.1, misbehaving as ``policy`` says per request.

    Args:
        version: the bytes to (mis)serve.
        policy: one fault for every request, or a function choosing one per request.
        short_by: for ``SHORT_FILE``, how many bytes shorter each file is (default: half).
    """
    choose = _constant(policy) if isinstance(policy, Fault) else policy
    src = FaultSource("")

    async def handle(stream: trio.SocketStream) -> None:
        conn = h11.Connection(h11.SERVER)
        async with stream:
            try:
                while await _answer_one(stream, conn, version, choose, src, short_by):
                    conn.start_next_cycle()
            except (trio.BrokenResourceError, trio.ClosedResourceError, h11.ProtocolError):
                pass  # the downloader hung up (e.g. it cancelled a stalled transfer)

    async with trio.open_nursery() as nursery:
        listeners = await nursery.start(partial(trio.serve_tcp, handle, 0, host="127.0.0.1"))
        src.url = f"http://127.0.0.1:{listeners[0].socket.getsockname()[1]}"
        yield src
        nursery.cancel_scope.cancel()


def _constant(fault: Fault) -> Policy:
    return lambda _ask: fault


async def _next_event(stream: trio.SocketStream, conn: h11.Connection) -> object:
    while True:
        event = conn.next_event()
        if event is not h11.NEED_DATA:
            return event
        conn.receive_data(await stream.receive_some(65536))


async def _answer_one(
    stream: trio.SocketStream,
    conn: h11.Connection,
    version: Version,
    choose: Policy,
    src: FaultSource,
    short_by: int | None,
) -> bool:
    """Serve one request; True if the connection may carry another."""
    request = await _next_event(stream, conn)
    if not isinstance(request, h11.Request):
        return False
    while not isinstance(await _next_event(stream, conn), h11.EndOfMessage):
        pass
    match = _FILES_ROUTE.match(request.target.decode("latin-1"))
    data = version.files.get(match["name"]) if match else None
    headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in request.headers}
    spec = parse_range(headers["range"]) if "range" in headers else None
    if match is None or data is None or spec is None:
        await _send(stream, conn, 404, [], b"")
        return True
    full = resolve_range(spec, len(data))
    ask = Ask(match["name"], *full)
    src.asks.append(ask)
    fault = choose(ask)
    if fault is Fault.SHORT_FILE:
        data = data[: len(data) - (short_by if short_by is not None else len(data) // 2)]
    if fault is Fault.STALL_BEFORE_ANSWER:
        await trio.sleep_forever()
    if fault is Fault.UNAVAILABLE:
        await _send(stream, conn, 503, [("retry-after", "1")], b"")
        return True
    if fault is Fault.WRONG_VERSION:
        await _send(stream, conn, 409, [], b"")
        return True
    try:
        offset, length = resolve_range(spec, len(data))
    except UnsatisfiableRange:
        await _send(
            stream, conn, 416, [("content-range", format_unsatisfied_range(len(data)))], b""
        )
        return True
    body = bytearray(data[offset : offset + length])
    if fault is Fault.CORRUPT:
        body[0] ^= 0xFF
    content_range = [("content-range", format_content_range(offset, length, len(data)))]
    if fault is Fault.STALL_AFTER_HEADERS:
        await _send(stream, conn, 206, content_range, b"", length=length)
        await trio.sleep_forever()
    if fault is Fault.TRICKLE:
        await _send(stream, conn, 206, content_range, b"", length=length)
        for at in range(0, length, TRICKLE_BYTES):
            await trio.sleep(TRICKLE_S)
            piece = bytes(body[at : at + TRICKLE_BYTES])
            await stream.send_all(conn.send(h11.Data(data=piece)))
            src.body_bytes_sent += len(piece)
        await stream.send_all(conn.send(h11.EndOfMessage()))
        return True
    if fault is Fault.TRUNCATE:
        await _send(stream, conn, 206, content_range, bytes(body[: length // 2]), length=length)
        src.body_bytes_sent += length // 2
        return False  # close mid-body
    await _send(stream, conn, 206, content_range, bytes(body))
    src.body_bytes_sent += length
    return True


async def _send(
    stream: trio.SocketStream,
    conn: h11.Connection,
    status: int,
    headers: list[tuple[str, str]],
    body: bytes,
    *,
    length: int | None = None,
) -> None:
    """Send a response head and ``body``; with ``length``, declare more than ``body`` holds
    and leave the message unfinished."""
    declared = len(body) if length is None else length
    head = [*headers, ("content-length", str(declared))]
    out = conn.send(h11.Response(status_code=status, headers=head))
    if body:
        out += conn.send(h11.Data(data=body))
    if length is None:
        out += conn.send(h11.EndOfMessage())
    await stream.send_all(out)
