"""HTTP/1.1 server of the bulk lane: h11 over trio sockets, zero-copy file bodies.

Theory of operation
-------------------
:meth:`HttpServer.serve` binds a listening socket, reports readiness through
``task_status.started()`` and accepts connections in a nursery it owns. A semaphore of
``max_connections`` slots is taken *before* each ``accept``, so excess clients wait in the
kernel's listen backlog and the server's memory stays bounded. One client IP address holds at
most ``max_connections_per_ip`` of those slots: a connection above that share is closed right
after ``accept`` (counted as ``per_ip_limit``), so one host that opens many idle connections
(slowloris) cannot fill the slots and the backlog and starve everyone else.

Each connection is one task driving an ``h11.Connection`` (the sans-IO HTTP state machine):
read until h11 yields a request (at most ``max_header_bytes`` buffered; ``header_timeout_s`` for
the first request and once a request has begun, ``idle_timeout_s`` between keep-alive requests),
hand an :class:`HttpRequest` to the application's handler (which may await, e.g. until a relay
has verified a shard; bounded by ``handler_timeout_s``, after which the client gets ``503`` with
``Retry-After``), then send the :class:`HttpResponse`. Only ``GET`` and ``HEAD`` are served and
request bodies are refused (``413``).

Bodies are ``bytes``, a :class:`~p2p.http_body.FileSlice` or a
:class:`~p2p.http_body.StreamedBody` (pieces sent as an async generator produces them, at most
its declared length, the connection cut if they end short). A file slice goes out with
``os.sendfile`` from the page cache straight to the non-blocking socket: on ``EAGAIN`` the
task awaits ``trio.lowlevel.wait_writable`` for at most ``send_timeout_s``, so a client that
stops reading frees its connection after that long. Where sendfile is unavailable or disabled
the file is read with ``os.pread`` in a worker thread, one chunk at a time. h11 is told about
the body with ``send_with_data_passthrough`` (its documented sendfile hook) so its framing
checks still hold. An optional :class:`~p2p.http_range.TokenBucket`, shared by all
connections, caps the server's upload rate (body bytes only). Every abnormal end of a
connection is counted by kind in :meth:`HttpServer.statistics`; none of them stops the server.
Aborted connections are logged one by one at DEBUG only; at INFO one summary line
(``http_connections_aborted count=N since_s=S kinds=...``) covers every abort of an interval
of ``abort_log_interval_s``, so a flood of bad clients cannot flood the log.

The same connections can arrive over libp2p streams (:mod:`p2p.bytestream`): the host hands
each inbound stream-lane stream to :meth:`HttpServer.serve_stream`, which serves it with the
same code, handler, slots, timeouts and counters as a TCP connection. Under the HTTP code a
connection is a small ``_Wire``: a TCP socket (``send`` may send part of a buffer; file bodies
by ``sendfile``) or a :class:`~p2p.bytestream.ByteStream` (at most ``_STREAM_SEND_BYTES`` per
send, so ``send_timeout_s`` still bounds the time without progress; file bodies read with
``pread`` and written, a piece of up to ``_INLINE_READ_BYTES`` on the event loop as sendfile
reads, and the response head in the same send as the body's first piece: every send is at
least one yamux frame and one Noise message, whose cost per request dominates a 64 KiB shard
over a stream). A stream finds a slot free or is closed at once (counted as
``stream_limit``: libp2p has no listen backlog to wait in); one PeerID holds at most
``max_connections_per_ip`` slots.

Cancelling the scope around :meth:`serve` closes every connection, open file and the listener.
A file is read while it is sent: if it is shorter than the slice promised, the connection is
cut (the client sees a short body), never padded. ``sendfile`` itself may block the event loop
on a disk read when the file is not in the page cache; shards are normally just written or
verified, hence cached.
"""

from __future__ import annotations

import email.utils
import enum
import errno
import logging
import os
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from contextlib import aclosing, asynccontextmanager
from dataclasses import dataclass, field
from http import HTTPStatus
from pathlib import Path
from types import MappingProxyType
from typing import TYPE_CHECKING, cast
from urllib.parse import parse_qsl, unquote, urlsplit

import h11
import trio

from p2p import sockopts
from p2p.bytestream import ByteStream
from p2p.errors import ConfigError, LocalProtocolError, RemoteProtocolError
from p2p.http_body import FileSlice, StreamedBody
from p2p.http_range import (
    RangeError,
    RangeSpec,
    TokenBucket,
    UnsatisfiableRange,
    choose_range,
    format_content_range,
    format_unsatisfied_range,
    if_range_holds,
    parse_range,
)
from p2p.keepalive import KeepaliveConfig

if TYPE_CHECKING:
    # trio-typing's stubs (a libp2p dependency) shadow trio's inline types for mypy.
    from trio_typing import TaskStatus

__all__ = [
    "BadRequest",
    "FileSlice",
    "Handler",
    "HttpRequest",
    "HttpResponse",
    "HttpServer",
    "HttpServerConfig",
    "HttpServerStatistics",
    "ServerError",
    "StreamedBody",
    "file_response",
    "open_http_server",
    "parse_request_head",
]

logger = logging.getLogger(__name__)

_RECV_BYTES = 64 * 1024
#: most bytes handed to a libp2p stream per send (a send returns only once all are written,
#: so this bounds what one ``send_timeout_s`` covers: 1 MiB in 30 s is 35 KB/s). On loopback
#: 1 MiB sends moved 30-33 MB/s at 15-17 CPU-s/GiB (both ends), 256 KiB ones 19-30 MB/s at
#: 18-22: the cost is py-libp2p's yamux and Noise (TCP: ~1 CPU-s/GiB)
_STREAM_SEND_BYTES = 1024 * 1024
_COPY_CHUNK_BYTES = 1 << 20
#: file pieces up to this size are read on the event loop (page cache), not in a worker thread
_INLINE_READ_BYTES = 256 * 1024
_HOP_HEADERS = frozenset({"content-length", "transfer-encoding", "connection", "keep-alive"})
_NO_SENDFILE_ERRNOS = frozenset({errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOTSOCK})
_ACCEPT_RETRY_ERRNOS = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOMEM, errno.ENOBUFS})


@dataclass(frozen=True)
class HttpServerConfig:
    """Settings of one :class:`HttpServer`; every limit is enforced per connection.

    Raises:
        ConfigError: a field is out of range (names the field).
    """

    host: str = "127.0.0.1"  #: address to bind (numeric)
    port: int = 0  #: TCP port; 0 picks an ephemeral port
    backlog: int = 128  #: kernel listen backlog (where clients wait above the limit)
    max_connections: int = 256  #: connections served at once
    max_connections_per_ip: int = 128  #: connections of one client IP at once; more are closed
    max_header_bytes: int = 16 * 1024  #: request line + headers; more → 431
    header_timeout_s: float = 10.0  #: to receive a whole request head
    idle_timeout_s: float = 30.0  #: keep-alive wait for the next request
    send_timeout_s: float = 30.0  #: longest time without send progress
    handler_timeout_s: float = 20.0  #: longest handler wait; then 503 + Retry-After
    use_sendfile: bool = True  #: zero-copy file bodies (else pread + send)
    send_chunk_bytes: int = 8 << 20  #: most bytes per sendfile/send call
    bandwidth_bytes_per_s: float | None = None  #: upload cap over all connections
    burst_bytes: int = 256 * 1024  #: token bucket depth when capped
    abort_log_interval_s: float = 10.0  #: at most one INFO summary of aborts per this many s

    def __post_init__(self) -> None:
        for name in (
            "header_timeout_s",
            "idle_timeout_s",
            "send_timeout_s",
            "handler_timeout_s",
            "abort_log_interval_s",
        ):
            if not getattr(self, name) > 0:
                raise ConfigError(name, "must be > 0")
        for name in (
            "backlog",
            "max_connections",
            "max_connections_per_ip",
            "max_header_bytes",
            "send_chunk_bytes",
        ):
            if getattr(self, name) < 1:
                raise ConfigError(name, "must be >= 1")
        if not 0 <= self.port <= 65535:
            raise ConfigError("port", "must be in 0..65535")
        if self.bandwidth_bytes_per_s is not None and not self.bandwidth_bytes_per_s > 0:
            raise ConfigError("bandwidth_bytes_per_s", "must be > 0 or None")
        if self.burst_bytes < 1:
            raise ConfigError("burst_bytes", "must be >= 1")


@dataclass(frozen=True)
class HttpRequest:
    """One request as the handler sees it.

    ``path`` is percent-decoded, ``query`` keeps the last value of a repeated key, header names
    are lower case (repeated headers joined with ``", "``). ``range`` is the single byte range
    asked for, or ``None`` when there is none or it is ignored (see :mod:`p2p.http_range`).
    """

    method: str
    path: str
    query: Mapping[str, str]
    headers: Mapping[str, str]
    range: RangeSpec | None


class BadRequest(RemoteProtocolError):
    """A client's request head cannot be parsed or served (answered with ``status``).

    Args:
        peer: the client (``host:port``).
        message: what was wrong.
        status: the HTTP status to answer (400, 414, 431...).
    """

    def __init__(self, peer: str, message: str, status: int = 400) -> None:
        super().__init__(peer, message)
        self.status = status


def parse_request_head(
    data: bytes, *, max_header_bytes: int = 16 * 1024, peer: str = ""
) -> HttpRequest | None:
    """Sans-IO parse of the first request head in ``data``, exactly as the server reads it.

    Args:
        data: bytes received from a client (untrusted).
        max_header_bytes: the server's bound on an incomplete head.
        peer: the client, for errors.

    Returns:
        The request, or ``None`` when ``data`` does not yet hold a whole head.

    Raises:
        BadRequest: the head is malformed (with h11's status hint), or its target is not a
            URL the server can split.
    """
    conn = h11.Connection(h11.SERVER, max_incomplete_event_size=max_header_bytes)
    try:
        conn.receive_data(data)
        event = conn.next_event()
    except h11.RemoteProtocolError as exc:
        raise BadRequest(peer, str(exc), exc.error_status_hint) from None
    if not isinstance(event, h11.Request):
        return None
    return _to_request(event, peer)


@dataclass(frozen=True)
class HttpResponse:
    """What a handler returns. The server sets Content-Length, Connection, Date and Server."""

    status: int
    headers: Sequence[tuple[str, str]] = ()
    body: bytes | FileSlice | StreamedBody = b""


Handler = Callable[[HttpRequest], Awaitable[HttpResponse]]


def file_response(
    request: HttpRequest,
    path: Path,
    total_size: int,
    *,
    content_type: str = "application/octet-stream",
    headers: Sequence[tuple[str, str]] = (),
    etag: str | None = None,
    last_modified: str | None = None,
) -> HttpResponse:
    """The ``200``/``206``/``304``/``416`` response serving ``request`` from a file of
    ``total_size`` bytes.

    The ``Range`` header is decided as nginx decides it (:func:`p2p.http_range.choose_range`).
    ``If-Range`` is honoured: the range applies only if the condition names this ``etag``
    (strong) or is exactly ``last_modified``; otherwise the whole file is sent (``200``); with
    neither validator, the condition can never hold. ``If-None-Match`` naming ``etag`` (or
    ``*``) answers ``304``. The file is opened only when sent.

    Args:
        etag: the representation's strong entity tag, quoted (``'"<digest>"'``), sent as
            ``ETag``.
        last_modified: an HTTP-date, sent as ``Last-Modified``.
    """
    base = [("accept-ranges", "bytes"), ("content-type", content_type), *headers]
    if etag is not None:
        base.append(("etag", etag))
    if last_modified is not None:
        base.append(("last-modified", last_modified))
    if etag is not None and _none_match(request.headers.get("if-none-match"), etag):
        return HttpResponse(304, [h for h in base if h[0] != "content-type"])
    value = request.headers.get("range") if request.method in ("GET", "HEAD") else None
    if value is not None and "if-range" in request.headers:
        if not if_range_holds(request.headers["if-range"], etag, last_modified):
            value = None
    try:
        chosen = choose_range(value, total_size)
    except UnsatisfiableRange:
        return HttpResponse(416, [*base, ("content-range", format_unsatisfied_range(total_size))])
    if chosen is None:
        return HttpResponse(200, base, FileSlice(path, 0, total_size, total_size))
    offset, length = chosen
    content_range = format_content_range(offset, length, total_size)
    return HttpResponse(
        206, [*base, ("content-range", content_range)], FileSlice(path, offset, length, total_size)
    )


def _none_match(value: str | None, etag: str) -> bool:
    """``If-None-Match`` holds for ``etag`` (weak comparison, RFC 9110 §13.1.2)."""
    if value is None:
        return False
    tags = [t.strip() for t in value.split(",")]
    return "*" in tags or etag.removeprefix("W/") in (t.removeprefix("W/") for t in tags)


class ServerError(enum.StrEnum):
    """Why a server ended a connection abnormally or refused a request (the value is the key
    of :attr:`HttpServerStatistics.errors` and of the ``http_connections_aborted`` log line)."""

    BAD_REQUEST = "bad_request"  # a head h11 rejects, or a request target we do not parse
    REQUEST_BODY = "request_body"  # a GET/HEAD that carries a body
    HEADER_TIMEOUT = "header_timeout"  # a head not complete within header_timeout_s
    SEND_TIMEOUT = "send_timeout"  # a send that made no progress within send_timeout_s
    CLIENT_DISCONNECTED = "client_disconnected"  # the client reset or closed mid-request
    HANDLER = "handler"  # the handler raised: answered 500
    HANDLER_TIMEOUT = "handler_timeout"  # the handler took over handler_timeout_s: 503
    BAD_RESPONSE = "bad_response"  # the handler returned a head h11 cannot send: 500
    SHORT_FILE = "short_file"  # a file ended before the length its head declared
    FILE_ERROR = "file_error"  # a file of the response could not be opened: 500
    BODY_OVERRUN = "body_overrun"  # a streamed body produced more than it declared
    NOT_READY = "not_ready"  # a streamed body ended short of its length (a hold ran out)
    OS_ERROR = "os_error"  # another socket error
    ACCEPT_ERROR = "accept_error"  # accept failed (out of fds or memory); retried
    PER_IP_LIMIT = "per_ip_limit"  # closed at accept: its IP had too many connections open
    STREAM_LIMIT = "stream_limit"  # a stream-lane stream closed: no slot, or its PeerID
    # held too many


@dataclass(frozen=True)
class HttpServerStatistics:
    """Counters of one server since it was built.

    ``bytes_sent`` counts body bytes only; ``requests`` counts responses started; ``errors``
    counts abnormal connection ends and refused requests by :class:`ServerError`.
    """

    bytes_sent: int
    requests: int
    open_connections: int
    connections_total: int
    errors: Mapping[ServerError, int] = field(default_factory=dict)


def _client_ip(addr: object) -> str:
    """The client's IP address from ``accept``'s address (whole ``addr`` if not a tuple)."""
    return str(addr[0]) if isinstance(addr, tuple) and addr else str(addr)


class _SocketWire:
    """A TCP connection under the HTTP code: partial sends, ``sendfile`` by ``fileno``."""

    def __init__(self, sock: trio.socket.SocketType) -> None:
        self.sock = sock
        self.fileno: int | None = sock.fileno()

    async def recv(self, max_bytes: int) -> bytes:
        """Up to ``max_bytes``; ``b""`` at the client's end. Raises OSError."""
        return await self.sock.recv(max_bytes)

    async def send(self, data: memoryview) -> int:
        """Send some of ``data``; the number sent. Raises OSError."""
        return await self.sock.send(data)


class _StreamWire:
    """A stream-lane stream under the HTTP code; its failures become ``ConnectionResetError``
    (a client that went away, as on TCP)."""

    fileno: int | None = None

    def __init__(self, stream: ByteStream) -> None:
        self.stream = stream

    async def recv(self, max_bytes: int) -> bytes:
        """Up to ``max_bytes``; ``b""`` at the client's end. Raises ConnectionResetError."""
        try:
            return await self.stream.receive_some(max_bytes)
        except (trio.BrokenResourceError, trio.ClosedResourceError) as exc:
            raise ConnectionResetError(f"stream broken: {exc}") from exc

    async def send(self, data: memoryview) -> int:
        """Send the first ``_STREAM_SEND_BYTES`` of ``data``; the number sent.

        Raises:
            ConnectionResetError: the stream broke.
        """
        n = min(len(data), _STREAM_SEND_BYTES)
        try:
            await self.stream.send_all(data[:n])
        except (trio.BrokenResourceError, trio.ClosedResourceError) as exc:
            raise ConnectionResetError(f"stream broken: {exc}") from exc
        return n


_Wire = _SocketWire | _StreamWire


class _Abort(Exception):
    """Internal: end this connection now, counting ``kind`` (None: a normal close)."""

    def __init__(self, kind: ServerError | None) -> None:
        super().__init__(kind)
        self.kind = kind


class HttpServer:
    """An HTTP/1.1 server for ``GET``/``HEAD`` that calls ``handler`` for each request.

    Run it with ``await nursery.start(server.serve)`` or ``async with open_http_server(...)``.
    One server runs :meth:`serve` at most once. All methods run in the trio thread; the handler
    is called concurrently for different connections.
    """

    def __init__(self, handler: Handler, config: HttpServerConfig | None = None) -> None:
        self._handler = handler
        self._config = config or HttpServerConfig()
        self._slots = trio.Semaphore(self._config.max_connections)
        self._bucket: TokenBucket | None = None
        self._port: int | None = None
        self._started = False
        self._bytes_sent = 0
        self._requests = 0
        self._open = 0
        self._connections_total = 0
        self._errors: Counter[ServerError] = Counter()
        self._per_ip: Counter[str] = Counter()  # open connections by client IP
        self._aborts: Counter[ServerError] = Counter()  # aborts by kind not yet in a summary line
        self._aborts_since: float | None = None  # when the first of them happened
        self._aborts_pending = trio.Event()

    @property
    def port(self) -> int:
        """The bound TCP port. Raises LocalProtocolError before :meth:`serve` has started."""
        if self._port is None:
            raise LocalProtocolError("HttpServer is not listening yet")
        return self._port

    @property
    def url(self) -> str:
        """``http://host:port`` of the listener (IPv6 hosts bracketed)."""
        host = self._config.host
        return f"http://{f'[{host}]' if ':' in host else host}:{self.port}"

    def statistics(self) -> HttpServerStatistics:
        """A snapshot of the counters (cheap; safe to call at any time)."""
        return HttpServerStatistics(
            self._bytes_sent,
            self._requests,
            self._open,
            self._connections_total,
            MappingProxyType(dict(self._errors)),
        )

    async def serve(self, *, task_status: TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Listen and serve until cancelled; ``started()`` once the port is bound.

        Raises:
            LocalProtocolError: ``serve`` was already called on this server.
            OSError: the address cannot be bound.

        Cancellation closes every connection, open file and the listener before returning.
        """
        if self._started:
            raise LocalProtocolError("HttpServer.serve() may run only once")
        self._started = True
        cfg = self._config
        if cfg.bandwidth_bytes_per_s is not None:
            now = trio.current_time()
            self._bucket = TokenBucket(cfg.bandwidth_bytes_per_s, cfg.burst_bytes, now=now)
        infos = await trio.socket.getaddrinfo(
            cfg.host, cfg.port, type=trio.socket.SOCK_STREAM, flags=trio.socket.AI_PASSIVE
        )
        family, type_, proto, _, sockaddr = infos[0]
        with trio.socket.socket(family, type_, proto) as listener:
            listener.setsockopt(trio.socket.SOL_SOCKET, trio.socket.SO_REUSEADDR, 1)
            await listener.bind(sockaddr)
            listener.listen(cfg.backlog)
            self._port = listener.getsockname()[1]
            logger.info("http_server_listening url=%s sendfile=%s", self.url, cfg.use_sendfile)
            try:
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(self._summarize_aborts)
                    task_status.started()
                    await self._accept_loop(listener, nursery)
            finally:
                self._log_aborts()

    def _note_abort(self, kind: ServerError, peer: str) -> None:
        """Count a connection this server ended or refused (``errors``), for the next
        ``http_connections_aborted`` summary line too."""
        self._errors[kind] += 1
        logger.debug("http_connection_aborted kind=%s peer=%s", kind, peer)
        self._aborts[kind] += 1
        if self._aborts_since is None:
            self._aborts_since = trio.current_time()
            self._aborts_pending.set()

    def _log_aborts(self) -> None:
        """Log the summary line of the aborts noted since the last one, if any."""
        if self._aborts_since is None:
            return
        since_s = trio.current_time() - self._aborts_since
        kinds = ",".join(f"{k}:{n}" for k, n in sorted(self._aborts.items()))
        logger.info(
            "http_connections_aborted count=%d since_s=%.1f kinds=%s",
            sum(self._aborts.values()),
            since_s,
            kinds,
        )
        self._aborts.clear()
        self._aborts_since = None
        self._aborts_pending = trio.Event()

    async def _summarize_aborts(self) -> None:
        """One summary line ``abort_log_interval_s`` after the first abort of each burst."""
        while True:
            await self._aborts_pending.wait()
            await trio.sleep(self._config.abort_log_interval_s)
            self._log_aborts()

    async def _accept_loop(self, listener: trio.socket.SocketType, nursery: trio.Nursery) -> None:
        while True:
            await self._slots.acquire()
            sock, addr = None, None
            try:
                sock, addr = await listener.accept()
            except OSError as exc:
                if exc.errno not in _ACCEPT_RETRY_ERRNOS:
                    raise
                self._errors[ServerError.ACCEPT_ERROR] += 1
                logger.warning("http_accept_failed errno=%s", errno.errorcode.get(exc.errno or 0))
                await trio.sleep(0.1)  # back off while the process is out of fds/memory
            finally:
                if sock is None:
                    self._slots.release()
            if sock is None:
                continue
            ip = _client_ip(addr)
            if self._per_ip[ip] >= self._config.max_connections_per_ip:
                self._note_abort(ServerError.PER_IP_LIMIT, ip)
                sock.close()
                self._slots.release()
                continue
            self._per_ip[ip] += 1
            nursery.start_soon(self._run_connection, sock, addr, ip)

    async def serve_stream(self, peer_id: str, stream: ByteStream) -> None:
        """Serve one inbound stream-lane connection from ``peer_id`` (a libp2p stream the host
        accepted on :data:`p2p.bytestream.STREAM_LANE_PROTOCOL`) until it ends, exactly as a
        TCP connection: same handler, limits, timeouts and counters. Without a free slot, or
        with ``max_connections_per_ip`` streams of ``peer_id`` already open, the stream is
        closed at once (``stream_limit``). Closes ``stream`` in every case.

        Raises nothing for the client's faults or a broken stream (they are counted);
        cancellation closes the stream.
        """
        key = f"p2p/{peer_id}"
        try:
            self._slots.acquire_nowait()
        except trio.WouldBlock:
            self._refuse_stream(peer_id)
            with trio.CancelScope(shield=True):
                await stream.aclose()
            return
        if self._per_ip[key] >= self._config.max_connections_per_ip:
            self._slots.release()
            self._refuse_stream(peer_id)
            with trio.CancelScope(shield=True):
                await stream.aclose()
            return
        self._per_ip[key] += 1

        async def serve() -> None:
            try:
                await self._serve_wire(_StreamWire(stream), key)
            finally:
                with trio.CancelScope(shield=True):
                    await stream.aclose()

        await self._run_tracked(serve, key, key)

    def _refuse_stream(self, peer_id: str) -> None:
        self._note_abort(ServerError.STREAM_LIMIT, f"p2p/{peer_id}")

    async def _run_connection(self, sock: trio.socket.SocketType, addr: object, ip: str) -> None:
        peer = ":".join(str(part) for part in addr[:2]) if isinstance(addr, tuple) else str(addr)

        async def serve() -> None:
            with sock:
                sock.setsockopt(trio.socket.IPPROTO_TCP, trio.socket.TCP_NODELAY, 1)
                sockopts.tune(sock, KeepaliveConfig.tcp_user_timeout_s)  # dead clients end
                await self._serve_wire(_SocketWire(sock), peer)

        await self._run_tracked(serve, peer, ip)

    async def _serve_wire(self, wire: _Wire, peer: str) -> None:
        conn = h11.Connection(h11.SERVER, max_incomplete_event_size=self._config.max_header_bytes)
        await self._serve_connection(wire, conn, peer)

    async def _run_tracked(self, serve: Callable[[], Awaitable[None]], peer: str, ip: str) -> None:
        """Run one connection's ``serve``, counting it and how it ended; releases its slot
        and its share of ``ip``'s (a PeerID's, for a stream) when done."""
        self._open += 1
        self._connections_total += 1
        try:
            await serve()
        except _Abort as exc:
            if exc.kind is not None:
                self._note_abort(exc.kind, peer)
        except ConnectionError:
            self._errors[ServerError.CLIENT_DISCONNECTED] += 1
            logger.debug("http_client_disconnected peer=%s", peer)
        except OSError as exc:
            self._errors[ServerError.OS_ERROR] += 1
            errname = errno.errorcode.get(exc.errno or 0)
            logger.warning("http_connection_error errno=%s peer=%s", errname, peer)
        finally:
            self._open -= 1
            self._per_ip[ip] -= 1
            if self._per_ip[ip] <= 0:
                del self._per_ip[ip]
            self._slots.release()

    async def _serve_connection(self, wire: _Wire, conn: h11.Connection, peer: str) -> None:
        first = True
        while True:
            try:
                event = await self._receive(wire, conn, first=first)
                if isinstance(event, h11.ConnectionClosed):
                    return
                assert isinstance(event, h11.Request)
                request = _to_request(event, peer)
                if not _has_no_body(event):
                    await self._send(wire, conn, HttpResponse(413), head=False, close=True)
                    raise _Abort(ServerError.REQUEST_BODY)
                end = await self._receive(wire, conn, first=False, started=True)
                assert isinstance(end, h11.EndOfMessage)
            except (h11.RemoteProtocolError, BadRequest) as exc:
                if conn.our_state in (h11.IDLE, h11.SEND_RESPONSE):
                    status = exc.status if isinstance(exc, BadRequest) else exc.error_status_hint
                    await self._send(wire, conn, HttpResponse(status), head=False, close=True)
                raise _Abort(ServerError.BAD_REQUEST) from None
            first = False
            response, close = await self._call_handler(request)
            await self._send(wire, conn, response, head=request.method == "HEAD", close=close)
            logger.debug(
                "http_request method=%s path=%s status=%d",
                request.method,
                request.path,
                response.status,
            )
            if conn.our_state is not h11.DONE or conn.their_state is not h11.DONE:
                return
            conn.start_next_cycle()

    async def _receive(
        self,
        wire: _Wire,
        conn: h11.Connection,
        *,
        first: bool,
        started: bool = False,
    ) -> object:
        cfg = self._config
        wait_s = cfg.header_timeout_s if first or started else cfg.idle_timeout_s
        with trio.move_on_after(wait_s) as scope:
            while True:
                event = conn.next_event()
                if event is not h11.NEED_DATA:
                    return event
                # Small reads keep h11's buffer near max_header_bytes (it rejects incomplete
                # heads above that, so a head is refused by 2× the limit at the latest).
                data = await wire.recv(min(_RECV_BYTES, cfg.max_header_bytes))
                if not started:
                    started = True
                    scope.deadline = trio.current_time() + cfg.header_timeout_s
                conn.receive_data(data)
        raise _Abort(ServerError.HEADER_TIMEOUT if started or first else None)

    async def _call_handler(self, request: HttpRequest) -> tuple[HttpResponse, bool]:
        if request.method not in ("GET", "HEAD"):
            return HttpResponse(405, [("allow", "GET, HEAD")]), False
        try:
            with trio.fail_after(self._config.handler_timeout_s):
                return await self._handler(request), False
        except trio.TooSlowError:
            self._errors[ServerError.HANDLER_TIMEOUT] += 1
            return HttpResponse(503, [("retry-after", "1")]), False
        except Exception:  # the application's bug: answer 500, keep serving others
            self._errors[ServerError.HANDLER] += 1
            logger.exception("http_handler_failed method=%s path=%s", request.method, request.path)
            return HttpResponse(500), True

    async def _send(
        self,
        wire: _Wire,
        conn: h11.Connection,
        response: HttpResponse,
        *,
        head: bool,
        close: bool,
    ) -> None:
        body = response.body
        try:
            await self._send_response(wire, conn, response, head=head, close=close)
        finally:
            if isinstance(body, FileSlice) and body.on_done is not None:
                body.on_done()

    async def _send_response(
        self,
        wire: _Wire,
        conn: h11.Connection,
        response: HttpResponse,
        *,
        head: bool,
        close: bool,
    ) -> None:
        body = response.body
        fd = -1
        if isinstance(body, FileSlice) and body.length and not head:
            try:
                fd = _open_first(body.path, body.fallbacks)
            except OSError as exc:
                self._errors[ServerError.FILE_ERROR] += 1
                logger.warning("http_file_open_failed path=%s error=%s", body.path, exc)
                response, body, close = HttpResponse(500), b"", True
        try:
            length = body.length if isinstance(body, FileSlice | StreamedBody) else len(body)
            try:
                event = _to_h11_response(response, length, close=close)
            except h11.LocalProtocolError as exc:  # the handler returned an invalid header
                self._errors[ServerError.BAD_RESPONSE] += 1
                logger.error("http_bad_response status=%s error=%s", response.status, exc)
                event, body, length = _to_h11_response(HttpResponse(500), 0, close=True), b"", 0
            self._requests += 1
            head_bytes = conn.send(event)
            # over a stream the head rides in the body's first muxer frame (see _send_file)
            pending = [head_bytes] if isinstance(wire, _StreamWire) and length and not head else []
            if not pending:
                await self._send_bytes(wire, head_bytes, throttle=False)
            if length and not head:
                # h11 only needs len(); the bytes go out below, by sendfile or in chunks.
                placeholder = body if isinstance(body, bytes) else cast(bytes, _Sized(length))
                conn.send_with_data_passthrough(h11.Data(data=placeholder))
                if isinstance(body, FileSlice | StreamedBody):
                    done = [0]
                    try:
                        if isinstance(body, FileSlice):
                            await self._send_file(wire, fd, body, done, pending)
                        else:
                            await self._send_streamed(wire, body, done, pending)
                    finally:
                        if body.on_sent is not None:
                            body.on_sent(done[0])
                elif (
                    pending
                    and self._bucket is None
                    and len(head_bytes) + length <= _STREAM_SEND_BYTES
                ):
                    await self._send_bytes(wire, head_bytes + body, throttle=False)
                    self._bytes_sent += length
                else:
                    await self._flush(wire, pending)
                    await self._send_bytes(wire, body, throttle=True)
            await self._send_bytes(wire, conn.send(h11.EndOfMessage()), throttle=False)
        finally:
            if fd >= 0:
                os.close(fd)

    async def _send_bytes(self, wire: _Wire, data: bytes, *, throttle: bool) -> None:
        view = memoryview(data)
        while view:
            want = min(len(view), self._config.send_chunk_bytes)
            if throttle:
                want = await self._grant(want)
            with trio.move_on_after(self._config.send_timeout_s):
                sent = await wire.send(view[:want])
                view = view[sent:]
                if throttle:
                    self._bytes_sent += sent
                    self._refund(want - sent)
                continue
            raise _Abort(ServerError.SEND_TIMEOUT)

    async def _flush(self, wire: _Wire, pending: list[bytes]) -> None:
        """Send the response head held back in ``pending`` (if any) on its own."""
        if pending:
            await self._send_bytes(wire, pending.pop(), throttle=False)

    async def _send_streamed(
        self, wire: _Wire, body: StreamedBody, done: list[int], pending: list[bytes]
    ) -> None:
        """Send ``body``'s pieces as they come; ``done[0]`` follows the bytes sent. The
        connection is cut (``not_ready``) if the pieces end short of ``body.length`` and
        (``body_overrun``) if they go past it."""
        async with aclosing(body.pieces) as pieces:
            async for piece in pieces:
                if done[0] + len(piece) > body.length:
                    raise _Abort(ServerError.BODY_OVERRUN)
                await self._flush(wire, pending)
                await self._send_bytes(wire, piece, throttle=True)
                done[0] += len(piece)
        if done[0] < body.length:
            await self._flush(wire, pending)  # the client sees a short body, as over TCP
            raise _Abort(ServerError.NOT_READY)

    async def _send_file(
        self, wire: _Wire, fd: int, part: FileSlice, done: list[int], pending: list[bytes]
    ) -> None:
        """Send ``part``; ``done[0]`` follows the bytes sent so far (also when this raises).

        ``pending`` holds the response head when it was held back to go out with the first
        piece (a stream wire: one muxer frame less); it is sent alone before any wait (a piece
        not yet ready, the rate limit) so the client sees the head as early as over TCP.
        """
        offset, end = part.offset, part.offset + part.length
        use_sendfile = (
            self._config.use_sendfile and hasattr(os, "sendfile") and wire.fileno is not None
        )
        avail = end if part.ready is None else offset
        while offset < end:
            if offset >= avail:
                assert part.ready is not None
                await self._flush(wire, pending)
                avail = min(end, await part.ready(offset))
                if avail <= offset:
                    raise _Abort(ServerError.NOT_READY)
            if self._bucket is not None:
                await self._flush(wire, pending)
            want = await self._grant(min(avail - offset, self._config.send_chunk_bytes))
            try:
                if use_sendfile:
                    assert wire.fileno is not None
                    sent = os.sendfile(wire.fileno, fd, part.base + offset, want)
                else:
                    n = min(want, _COPY_CHUNK_BYTES)
                    # a small piece is read on the event loop, as sendfile reads (from the
                    # page cache, where shards are): a worker thread's hand-off costs more
                    at = part.base + offset
                    if n <= _INLINE_READ_BYTES:
                        chunk = os.pread(fd, n, at)
                    else:
                        chunk = await trio.to_thread.run_sync(os.pread, fd, n, at)
                    sent = len(chunk)
                    if pending and chunk and len(pending[0]) + sent <= _STREAM_SEND_BYTES:
                        await self._send_bytes(wire, pending.pop() + chunk, throttle=False)
                    elif chunk:
                        await self._flush(wire, pending)
                        await self._send_bytes(wire, chunk, throttle=False)
            except BlockingIOError:
                self._refund(want)
                with trio.move_on_after(self._config.send_timeout_s):
                    assert wire.fileno is not None  # only sendfile raises BlockingIOError
                    await trio.lowlevel.wait_writable(wire.fileno)
                    continue
                raise _Abort(ServerError.SEND_TIMEOUT) from None
            except OSError as exc:
                self._refund(want)
                if use_sendfile and offset == part.offset and exc.errno in _NO_SENDFILE_ERRNOS:
                    use_sendfile = False  # e.g. a file system without sendfile support
                    continue
                raise
            self._refund(want - sent)
            if sent == 0:
                logger.warning("http_short_file path=%s offset=%d", part.path, offset)
                await self._flush(wire, pending)  # the client sees a short body, as over TCP
                raise _Abort(ServerError.SHORT_FILE)
            offset += sent
            self._bytes_sent += sent
            done[0] += sent
            await trio.lowlevel.checkpoint()

    async def _grant(self, want: int) -> int:
        if self._bucket is None:
            return want
        while True:
            now = trio.current_time()
            granted = self._bucket.take(want, now)
            if granted:
                return granted
            await trio.sleep(self._bucket.wait_s(want, now))

    def _refund(self, unused: int) -> None:
        if self._bucket is not None:
            self._bucket.refund(unused)


class _Sized:
    """Stands in for a body in h11's passthrough: h11 only takes its ``len()``."""

    def __init__(self, length: int) -> None:
        self._length = length

    def __len__(self) -> int:
        return self._length


def _open_first(path: Path, fallbacks: tuple[Path, ...]) -> int:
    """Open ``path`` read-only, or the first of ``fallbacks`` that exists."""
    for candidate in (path, *fallbacks):
        try:
            return os.open(candidate, os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            if candidate == (fallbacks[-1] if fallbacks else path):
                raise
    raise FileNotFoundError(path)  # unreachable: the loop returns or raises


def _to_request(event: h11.Request, peer: str) -> HttpRequest:
    """The handler's view of an h11 request.

    Raises:
        BadRequest: the target does not split as a URL (``//[x``: an unclosed IPv6 host).
    """
    headers: dict[str, str] = {}
    for raw_name, raw_value in event.headers:
        name, value = raw_name.decode("ascii"), raw_value.decode("latin-1")
        headers[name] = f"{headers[name]}, {value}" if name in headers else value
    method = event.method.decode("ascii")
    try:
        target = urlsplit(event.target.decode("latin-1"))
    except ValueError as exc:  # urlsplit refuses an unbalanced "[" in the authority
        raise BadRequest(peer, f"request target: {exc}") from None
    spec = None
    if "range" in headers and method in ("GET", "HEAD"):
        try:
            spec = parse_range(headers["range"])
        except RangeError as exc:  # ignored per RFC 9110 §14.2: the whole file is sent
            logger.debug("http_range_ignored value=%r reason=%s", headers["range"], exc)
    query = dict(parse_qsl(target.query, keep_blank_values=True))
    return HttpRequest(method, unquote(target.path), query, headers, spec)


def _has_no_body(event: h11.Request) -> bool:
    for name, value in event.headers:
        if name == b"transfer-encoding" or (name == b"content-length" and value.strip() != b"0"):
            return False
    return True


def _to_h11_response(response: HttpResponse, length: int, *, close: bool) -> h11.Response:
    headers = [(n, v) for n, v in response.headers if n.lower() not in _HOP_HEADERS]
    headers += [
        ("content-length", str(length)),
        ("date", email.utils.formatdate(usegmt=True)),
        ("server", "shardnet"),
    ]
    if close:
        headers.append(("connection", "close"))
    try:
        reason = HTTPStatus(response.status).phrase
    except ValueError:
        reason = ""
    return h11.Response(status_code=response.status, headers=headers, reason=reason)


@asynccontextmanager
async def open_http_server(
    handler: Handler, config: HttpServerConfig | None = None
) -> AsyncIterator[HttpServer]:
    """Run an :class:`HttpServer` for the duration of the ``async with`` block.

    The server is listening when the block starts; leaving the block (normally, by an
    exception or by cancellation) cancels it and closes all its sockets and files.

    Raises:
        OSError: the address cannot be bound.
    """
    server = HttpServer(handler, config)
    async with trio.open_nursery() as nursery:
        await nursery.start(server.serve)
        try:
            yield server
        finally:
            nursery.cancel_scope.cancel()
