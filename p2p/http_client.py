"""HTTP client of the bulk lane: byte ranges and small bodies, h11 over pooled trio sockets.

Theory of operation
-------------------
A downloader holds one :class:`HttpClient` (a pool of keep-alive HTTP/1.1 connections) and
asks each source for shard bytes with :meth:`HttpClient.stream_range`, which sends a single
``Range: bytes=first-last`` and yields exactly the bytes asked for, or raises. The answer is
checked before any byte is yielded: ``206`` with a ``Content-Range`` naming exactly that range
(or ``200`` whose body is exactly the range, when it starts at 0), and a ``Content-Length``, if
any, equal to the length. Small bodies (manifests, parts, have-maps) come from
:meth:`HttpClient.get_bytes` with a size bound checked before and while reading.

The protocol is the ``h11`` library's (the HTTP/1.1 state machine httpx itself uses); this
module only moves bytes between it and a :class:`~p2p.bytestream.ByteStream`, reading 1 MiB
at a time: a TCP connection for an ``http://host:port`` URL, or, for a stream-lane URL
``p2p://<PeerID>``, a libp2p stream opened by the ``open_stream`` callable the client was
given (over a connection the host already holds; see :mod:`p2p.bytestream`). Both transports
go through the same pool, checks, timeouts and error table; only TCP has the zero-copy body
read of :meth:`HttpClient.receive_range_into`. It replaced an
``httpx.AsyncClient``, which reads 64 KiB per call through several layers of async generators:
on loopback the same transfer cost 4.3x the client CPU (1.34 vs 0.31 CPU-s per GiB;
``bench/http_lane.py``), and the client is the hottest code of a broadcast.

The lane is untrusted: the caller checks every byte against the signed manifest. This module
only guarantees the *amount* and *position* of the bytes, and that every failure is one of
the typed errors below. The checks themselves (request headers, response heads, body counts,
error mapping) live in :mod:`p2p.http_checks`, shared with the in-memory client
(:class:`p2p.memnet.MemHttpClient`), so the two cannot drift:

=====================================  ==============================================
what happened                          raised
=====================================  ==============================================
connect refused, DNS, connect timeout  :class:`~p2p.errors.PeerUnreachable`
reset, no progress for ``timeout_s``,  :class:`~p2p.errors.StreamBroken`
body shorter than promised, 5xx other
than 503 (the server failed)
404, 409, 429, 503 (with or without    :class:`~p2p.http_errors.NotAvailable` (``retry_after_s``,
``Retry-After``)                       ``status``)
other status, bad ``Content-Range``,   :class:`~p2p.errors.RemoteProtocolError`
more bytes than asked, malformed head
body over ``max_bytes``                :class:`~p2p.errors.MessageTooLarge`
our pool full for ``timeout_s``        :class:`~p2p.errors.TransportError` (the base class)
bad URL, bad arguments                 :class:`~p2p.errors.LocalProtocolError`
=====================================  ==============================================

``timeout_s`` bounds every wait for the network (connect, each read, each write, a free pool
slot): a source that sends headers and then stalls fails after ``timeout_s`` without progress.
A source that keeps trickling bytes is not a stall; bound whole transfers with
``trio.fail_after`` at the call site. A pooled connection that the server closed while idle is
detected on reuse and the request is retried once on a fresh connection.
"""

from __future__ import annotations

import socket
import time
from collections.abc import AsyncGenerator, Callable, Mapping, Sequence
from contextlib import aclosing
from types import TracebackType
from typing import NoReturn

import h11
import trio

from p2p import sockopts
from p2p.bytestream import ByteStream, StreamOpener
from p2p.errors import (
    ClosedMidBody,
    LocalProtocolError,
    PeerUnreachable,
    RemoteProtocolError,
    StreamBroken,
    TransportError,
)
from p2p.http_checks import (
    NOT_AVAILABLE_STATUSES,
    BodyCount,
    ClientCounters,
    HttpClientStatistics,
    Target,
    check_exact_head,
    check_range_args,
    check_range_head,
    check_whole_head,
    header,
    parse_target,
    request_headers,
    status_error,
)
from p2p.http_range import ByteRange, format_range
from p2p.keepalive import KeepaliveConfig

__all__ = ["HttpClient", "HttpClientStatistics"]

_RECV_BYTES = 1 << 20
#: idle seconds before a pooled stream-lane connection is dropped: longer than the TCP lane's
#: (``keepalive_expiry_s``) so that it outlives the pause between two versions, but below
#: the servers' ``HttpServerConfig.idle_timeout_s`` (30 s). Opening a libp2p stream costs a
#: multistream-select round trip through both nodes' event loops before the request's own:
#: in the NAT lab (bench/nat.py, nine nodes on two busy cores) a new stream took 0.66 s
#: median (p90 1.36 s) before its request was sent, a reused one's answer 0.33 s, a TCP
#: request's 0.036 s; with the TCP lane's 5 s every version opened its streams again
STREAM_KEEPALIVE_EXPIRY_S = 25.0
#: idle stream-lane connections kept for reuse (apart from the TCP ones: an idle stream is a
#: yamux stream, no socket, and the TCP lane's idle connections must not evict them)
MAX_KEEPALIVE_STREAMS = 64
_MAX_HEAD_BYTES = 64 * 1024
#: a refusal (404, 409, 429, 503) whose declared body is at most this many bytes is read to
#: its end so that its connection goes back to the pool; a larger or undeclared one closes
#: it. Refusals are routine (a super-seeding relay's 429s, have-probes and part asks to peers
#: that do not hold the version yet), and closing after each one made the next request to
#: that source open a new connection: a TCP handshake, or on a stream lane a new libp2p
#: stream and its multistream-select round trip (see ``STREAM_KEEPALIVE_EXPIRY_S``)
REFUSAL_DRAIN_BYTES = 4096
#: a body read into the caller's buffer wakes when this many bytes wait in the socket
#: (``SO_RCVLOWAT``), not for every segment: on a link of 1,500-byte packets a read returned
#: ~15 KB and each cost a trip through the event loop (16,000 per 241 MB on a relay)
RECV_LOWAT_BYTES = 256 * 1024
#: how long a read waits for that many bytes before taking what has come: a source slower
#: than ``RECV_LOWAT_BYTES`` per this is read as it arrives for the rest of the body
RECV_LOWAT_WAIT_S = 0.25


class _LowWater:
    """The ``SO_RCVLOWAT`` of one socket while a body is read (restored to 1 by :meth:`reset`,
    so that the next response head on a kept-alive connection is read at once)."""

    def __init__(self, sock: trio.socket.SocketType) -> None:
        self.sock = sock
        self.bytes = 1
        self.enabled = True

    def want(self, remaining: int) -> None:
        """Wake for ``min(RECV_LOWAT_BYTES, remaining)`` bytes (call only while enabled)."""
        self._set(min(RECV_LOWAT_BYTES, remaining))

    def disable(self) -> None:
        """The source is slow: read what arrives from now on."""
        self.enabled = False
        self._set(1)

    def reset(self) -> None:
        """Back to the kernel's default of 1 (errors ignored: the socket may be gone)."""
        try:
            self._set(1)
        except OSError:
            pass

    def _set(self, n: int) -> None:
        if n != self.bytes:
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, n)
            self.bytes = n


class _Conn:
    """One keep-alive connection: a byte stream (TCP or a libp2p stream) and its h11 state
    machine; ``socket`` is the TCP socket (None on a libp2p stream)."""

    def __init__(self, key: tuple[str, int], stream: ByteStream) -> None:
        self.key = key
        self.stream = stream
        self.socket = stream.socket if isinstance(stream, trio.SocketStream) else None
        self.h11 = h11.Connection(h11.CLIENT, max_incomplete_event_size=_MAX_HEAD_BYTES)
        self.idle_since = 0.0
        self.reused = False

    async def aclose(self) -> None:
        with trio.CancelScope(shield=True):
            await self.stream.aclose()

    def reset(self) -> None:
        """Start a fresh h11 state machine (after a body read past h11, exactly framed)."""
        self.h11 = h11.Connection(h11.CLIENT, max_incomplete_event_size=_MAX_HEAD_BYTES)


class HttpClient:
    """A pool of keep-alive HTTP/1.1 connections for the bulk lane (use as ``async with``).

    Args:
        max_connections: connections open at once, over all sources.
        max_keepalive_connections: idle connections kept for reuse (32: a follower's
            bursts of requests to its upstreams left 17 idle at once, and with 16 kept it
            closed and later reopened ~15 per next version of real-1b in the shaped bench).
        keepalive_expiry_s: idle seconds before a pooled connection is dropped; keep it below
            the servers' ``idle_timeout_s`` so a reused connection is rarely closed under us.
        max_keepalive_streams, stream_keepalive_expiry_s: the same for stream-lane
            connections (:data:`MAX_KEEPALIVE_STREAMS`, :data:`STREAM_KEEPALIVE_EXPIRY_S`).
        headers: sent with every request (e.g. ``X-Shardnet-Peer``).
        sign: called with each request's target (path and query) and returning headers to
            add to it (e.g. a signature binding the requester to the path); must be cheap
            and must not block.
        open_stream: opens a stream-lane stream to a PeerID (``p2p://`` URLs,
            :data:`p2p.bytestream.StreamOpener`); None: such URLs raise ``PeerUnreachable``.

    Methods may be called concurrently from several tasks (the pool is shared). Leaving the
    ``async with`` block closes every idle connection; connections in use are closed by the
    call that holds them.
    """

    def __init__(
        self,
        *,
        max_connections: int = 64,
        max_keepalive_connections: int = 32,
        keepalive_expiry_s: float = 5.0,
        max_keepalive_streams: int = MAX_KEEPALIVE_STREAMS,
        stream_keepalive_expiry_s: float = STREAM_KEEPALIVE_EXPIRY_S,
        headers: Mapping[str, str] | None = None,
        sign: Callable[[str], Sequence[tuple[str, str]]] | None = None,
        open_stream: StreamOpener | None = None,
    ) -> None:
        if max_connections < 1 or max_keepalive_connections < 0 or max_keepalive_streams < 0:
            raise LocalProtocolError("connection limits must be positive")
        self._slots = trio.Semaphore(max_connections)
        self._max_idle = max_keepalive_connections
        self._expiry_s = keepalive_expiry_s
        self._max_idle_streams = max_keepalive_streams
        self._stream_expiry_s = stream_keepalive_expiry_s
        self._headers = [(k.lower(), v) for k, v in (headers or {}).items()]
        self._sign = sign
        self._open_stream = open_stream
        self._idle: list[_Conn] = []
        self._closed = False
        self._counters = ClientCounters()

    def statistics(self) -> HttpClientStatistics:
        """A snapshot of the counters (cheap; safe to call at any time)."""
        return self._counters.statistics()

    async def __aenter__(self) -> HttpClient:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._closed = True
        idle, self._idle = self._idle, []
        for conn in idle:
            await conn.aclose()

    # -- connections --------------------------------------------------------------------------

    async def _acquire(self, where: Target, timeout_s: float, fresh: bool) -> _Conn:
        if self._closed:
            raise LocalProtocolError("HttpClient is closed")
        with trio.move_on_after(timeout_s) as waited:
            await self._slots.acquire()
        if waited.cancelled_caught:  # our own pool is full: not the source's fault
            raise TransportError(where.source, "no free connection in the local pool")
        key = where.key
        try:
            now = time.monotonic()
            while not fresh:
                conn = next((c for c in reversed(self._idle) if c.key == key), None)
                if conn is None:
                    break
                self._idle.remove(conn)
                expiry_s = self._expiry_s if conn.socket is not None else self._stream_expiry_s
                if now - conn.idle_since <= expiry_s:
                    conn.reused = True
                    return conn
                await conn.aclose()
            if where.stream_peer:
                return _Conn(key, await self._stream_to(where, timeout_s))
            try:
                with trio.fail_after(timeout_s):
                    stream = await trio.open_tcp_stream(*key)
            except trio.TooSlowError as exc:
                raise PeerUnreachable(
                    where.source, f"connect timed out after {timeout_s}s"
                ) from exc
            except OSError as exc:
                raise PeerUnreachable(where.source, f"connect failed: {exc}") from exc
            sockopts.tune(stream.socket, KeepaliveConfig.tcp_user_timeout_s)  # dead paths end
            return _Conn(key, stream)
        except BaseException:
            self._slots.release()
            raise

    async def _stream_to(self, where: Target, timeout_s: float) -> ByteStream:
        """A new stream-lane stream to ``where.stream_peer`` (see ``open_stream``)."""
        if self._open_stream is None:
            raise PeerUnreachable(where.source, "this client has no libp2p host for p2p:// URLs")
        return await self._open_stream(where.stream_peer, timeout_s)

    async def _release(self, conn: _Conn, reusable: bool) -> None:
        try:
            states = (conn.h11.our_state, conn.h11.their_state)
            if reusable and not self._closed and states in ((h11.DONE,) * 2, (h11.IDLE,) * 2):
                if states[0] is h11.DONE:  # IDLE: reset after a body read past h11
                    conn.h11.start_next_cycle()
                conn.idle_since = time.monotonic()
                self._idle.append(conn)
                tcp = conn.socket is not None
                cap = self._max_idle if tcp else self._max_idle_streams
                kind = [c for c in self._idle if (c.socket is not None) == tcp]  # oldest first
                for old in kind[: max(0, len(kind) - cap)]:
                    self._idle.remove(old)
                    await old.aclose()
            else:
                await conn.aclose()
        finally:
            self._slots.release()

    # -- one exchange -------------------------------------------------------------------------

    async def _send(
        self,
        conn: _Conn,
        target: str,
        host: str,
        extra: list[tuple[str, str]],
        source: str,
        timeout_s: float,
        anonymous: bool = False,
    ) -> None:
        signed = self._sign(target) if self._sign is not None and not anonymous else ()
        headers = request_headers(host, self._headers, signed, extra)
        data = conn.h11.send(h11.Request(method="GET", target=target, headers=headers))
        data += conn.h11.send(h11.EndOfMessage())
        try:
            with trio.fail_after(timeout_s):
                await conn.stream.send_all(data)
        except trio.TooSlowError as exc:
            raise StreamBroken(source, "no progress sending the request") from exc
        except (trio.BrokenResourceError, OSError) as exc:
            raise StreamBroken(source, f"connection broken: {exc}") from exc

    async def _next_event(self, conn: _Conn, source: str, timeout_s: float) -> h11.Event:
        """The next h11 event, reading from the socket as needed."""
        while True:
            try:
                event = conn.h11.next_event()
            except h11.RemoteProtocolError as exc:  # h11 refused to parse what arrived
                raise RemoteProtocolError(source, f"malformed response: {exc}") from exc
            if event is not h11.NEED_DATA:
                return event  # type: ignore[return-value]
            try:
                with trio.fail_after(timeout_s):
                    data = await conn.stream.receive_some(_RECV_BYTES)
            except trio.TooSlowError as exc:
                raise StreamBroken(source, f"no progress for {timeout_s}s") from exc
            except (trio.BrokenResourceError, OSError) as exc:
                raise StreamBroken(source, f"connection broken: {exc}") from exc
            if not data and conn.h11.their_state is not h11.DONE:
                if conn.h11.their_state is h11.SEND_RESPONSE:
                    raise StreamBroken(source, "connection closed before any answer")
                raise ClosedMidBody(source, "connection closed mid-body")
            conn.h11.receive_data(data)

    async def _open_range(
        self,
        url: str,
        start: int,
        length: int,
        timeout_s: float,
        headers: Sequence[tuple[str, str]],
        anonymous: bool,
    ) -> tuple[_Conn, h11.Response, str]:
        """GET ``Range: bytes=start-(start+length-1)`` and check the answer is exactly that
        range (:func:`p2p.http_checks.check_range_head`); the connection is released if not."""
        spec = format_range(ByteRange(start, start + length - 1))
        conn, response, source = await self._open(
            url, timeout_s, [("range", spec), *headers], anonymous
        )
        try:
            check_range_head(response, source, url, start, length)
        except BaseException:
            await self._release(conn, False)
            raise
        return conn, response, source

    async def _open(
        self, url: str, timeout_s: float, extra: list[tuple[str, str]], anonymous: bool = False
    ) -> tuple[_Conn, h11.Response, str]:
        """Send a GET and read the response head; a stale pooled connection is retried once.

        Raises:
            NotAvailable: a refusal (:data:`~p2p.http_checks.NOT_AVAILABLE_STATUSES`), after
                its connection went back to the pool or was closed (:meth:`_refused`).
            and the module's transport errors."""
        where = parse_target(url)
        source, target, host = where.source, where.target, where.netloc
        for attempt in (0, 1):
            conn = await self._acquire(where, timeout_s, fresh=attempt > 0)
            try:
                await self._send(conn, target, host, extra, source, timeout_s, anonymous)
                self._counters.requests += 1
                event = await self._next_event(conn, source, timeout_s)
                if isinstance(event, h11.ConnectionClosed):
                    raise StreamBroken(source, "connection closed before any answer")
                if not isinstance(event, h11.Response):
                    raise RemoteProtocolError(source, f"unexpected {type(event).__name__}")
            except StreamBroken:
                await self._release(conn, False)
                if not conn.reused or attempt:
                    raise
            except BaseException:
                await self._release(conn, False)
                raise
            else:
                if event.status_code in NOT_AVAILABLE_STATUSES:
                    await self._refused(conn, event, source, url, timeout_s)
                return conn, event, source
        raise AssertionError("unreachable")

    async def _refused(
        self, conn: _Conn, response: h11.Response, source: str, url: str, timeout_s: float
    ) -> NoReturn:
        """Release ``conn`` after the refusal ``response`` (reused if :meth:`_drained` read
        its body whole), then raise its :class:`~p2p.http_errors.NotAvailable`."""
        reusable = False
        try:
            reusable = await self._drained(conn, response, source, timeout_s)
        finally:
            await self._release(conn, reusable)
        raise status_error(response, source, url)

    async def _drained(
        self, conn: _Conn, response: h11.Response, source: str, timeout_s: float
    ) -> bool:
        """Read the body of a refusal (``response``) to its end, so that ``conn`` can serve
        the next request. True if it may: the server keeps the connection alive and declared a
        body of at most :data:`REFUSAL_DRAIN_BYTES`, which arrived whole within ``timeout_s``
        (seconds). False (close it) otherwise, or on any failure while reading: the refusal
        itself is what the caller reports."""
        declared = header(response, b"content-length")
        if declared is None or not declared.strip().isdigit() or not _keeps_alive(response):
            return False
        if int(declared) > REFUSAL_DRAIN_BYTES:
            return False
        try:
            while await self._next_data(conn, source, timeout_s) is not None:
                pass
        except (TransportError, RemoteProtocolError):
            return False
        return True

    async def _next_data(self, conn: _Conn, source: str, timeout_s: float) -> bytes | None:
        """The next piece of the body, or None at its end (a coroutine, not a generator, so
        that stopping early leaves no half-run generator behind)."""
        event = await self._next_event(conn, source, timeout_s)
        if isinstance(event, h11.Data):
            self._counters.bytes_received += len(event.data)
            return event.data if isinstance(event.data, bytes) else bytes(event.data)
        if isinstance(event, h11.EndOfMessage):
            return None
        raise StreamBroken(source, f"unexpected {type(event).__name__} in the body")

    # -- public API ---------------------------------------------------------------------------

    async def get_bytes(
        self,
        url: str,
        *,
        max_bytes: int,
        timeout_s: float,
        headers: Sequence[tuple[str, str]] = (),
        anonymous: bool = False,
    ) -> bytes:
        """GET ``url`` and return its whole body (``200`` only).

        Args:
            max_bytes: largest body accepted (bytes), checked before and while reading.
            timeout_s: longest wait without progress (seconds).
            headers: extra request headers; one named like a client default replaces it.
            anonymous: send the request unsigned (no ``sign`` headers), e.g. to a static
                mirror, which has no use for the requester's identity.

        Raises:
            PeerUnreachable, StreamBroken, NotAvailable, RemoteProtocolError, TransportError:
                see the module docstring.
            MessageTooLarge: the declared or received body exceeds ``max_bytes``.
            LocalProtocolError: a malformed URL.

        Safe to call concurrently. Cancellation closes the connection it was using.
        """
        with self._counters.counting_errors():
            conn, response, source = await self._open(url, timeout_s, [*headers], anonymous)
            reusable = False
            try:
                check_whole_head(response, source, url, max_bytes)
                body, bound = bytearray(), BodyCount(source, max_bytes, exact=False)
                while (chunk := await self._next_data(conn, source, timeout_s)) is not None:
                    bound.add(len(chunk))
                    body += chunk
                reusable = True
                return bytes(body)
            finally:
                await self._release(conn, reusable)

    async def stream_range(
        self,
        url: str,
        start: int,
        length: int,
        *,
        timeout_s: float,
        chunk_bytes: int = 1 << 20,
        headers: Sequence[tuple[str, str]] = (),
        anonymous: bool = False,
    ) -> AsyncGenerator[bytes, None]:
        """Yield bytes ``[start, start + length)`` of ``url``: exactly ``length`` bytes in total.

        Args:
            start: offset of the first byte.
            length: number of bytes; ``0`` yields nothing and sends no request.
            timeout_s: longest wait without progress (seconds).
            chunk_bytes: largest chunk yielded (bytes); chunks are yielded as they arrive,
                split when larger, never coalesced.
            headers: extra request headers for this request only.
            anonymous: send the request unsigned (see :meth:`get_bytes`).

        Raises:
            PeerUnreachable, StreamBroken, NotAvailable, RemoteProtocolError, TransportError:
                see the module docstring; all are raised before the first byte is yielded
                except StreamBroken and the "more bytes than asked" RemoteProtocolError.
            LocalProtocolError: a malformed URL or negative ``start``/``length``.

        Safe to run several concurrently. An async generator: a caller that stops early should
        close it (``async with contextlib.aclosing(...)``), which closes its connection at once.
        Cancellation closes the connection; the caller keeps whatever chunks it already took.
        """
        check_range_args(start, length, chunk_bytes)
        if length == 0:
            return
        with self._counters.counting_errors():
            conn, _response, source = await self._open_range(
                url, start, length, timeout_s, headers, anonymous
            )
            reusable = False
            try:
                body = BodyCount(source, length, exact=True)
                while (chunk := await self._next_data(conn, source, timeout_s)) is not None:
                    body.add(len(chunk))
                    if len(chunk) > chunk_bytes:
                        for i in range(0, len(chunk), chunk_bytes):
                            yield chunk[i : i + chunk_bytes]
                    else:
                        yield chunk
                body.end()
                reusable = True
            finally:
                await self._release(conn, reusable)

    async def receive_range_into(
        self,
        url: str,
        start: int,
        view: memoryview,
        *,
        timeout_s: float,
        headers: Sequence[tuple[str, str]] = (),
        anonymous: bool = False,
    ) -> AsyncGenerator[int, None]:
        """Receive bytes ``[start, start + len(view))`` of ``url`` straight into ``view``.

        The zero-copy form of :meth:`stream_range`: once the response head is parsed, the
        body is read with ``recv_into`` into ``view`` itself (at most 1 MiB per read), past
        h11, whose framing the ``Content-Length`` gives exactly; no bytes object is made
        per read and nothing is copied again. A read waits until ``RECV_LOWAT_BYTES`` (or
        what remains) have arrived (``SO_RCVLOWAT``), at most ``RECV_LOWAT_WAIT_S``, after
        which a slow source is read as its bytes come. A body without ``Content-Length`` (chunked)
        and any body on a stream lane (no socket under it) go through h11 and are copied into
        ``view``. Each yielded ``n`` says that the next
        ``n`` bytes of ``view`` (after those already announced) are filled, so the caller can
        hash them while they are hot.

        Args:
            view: a writable, contiguous byte buffer; its length is the range's length
                (``0`` yields nothing and sends no request).
            timeout_s, headers, anonymous: as in :meth:`stream_range`.

        Raises:
            as :meth:`stream_range` (the same errors, raised at the same points).

        Cancellation or an early close closes the connection; the bytes announced so far
        stay in ``view``. Safe to run several concurrently (with different views).
        """
        length = len(view)
        check_range_args(start, length)
        if length == 0:
            return
        with self._counters.counting_errors():
            conn, response, source = await self._open_range(
                url, start, length, timeout_s, headers, anonymous
            )
            reusable = False
            try:
                body = BodyCount(source, length, exact=True)
                async with aclosing(
                    self._body_into(conn, response, source, view, body, timeout_s)
                ) as pieces:
                    async for n in pieces:
                        yield n
                body.end()
                reusable = _reusable(conn, response)
            finally:
                await self._release(conn, reusable)

    async def receive_into(
        self,
        url: str,
        view: memoryview,
        *,
        timeout_s: float,
        headers: Sequence[tuple[str, str]] = (),
        anonymous: bool = False,
    ) -> AsyncGenerator[int, None]:
        """GET ``url`` (``200`` only) whose whole body is exactly ``len(view)`` bytes, straight
        into ``view``, yielding the count of each piece as it lands (the next ``n`` bytes of
        ``view`` after those already announced are filled): the zero-copy form of
        :meth:`get_bytes` for a body whose size the caller knows (a batch of blobs, by their
        signed sizes, handed out one by one as each is whole), read as
        :meth:`receive_range_into` reads a range (``recv_into``, past h11).

        Args:
            view: a writable, contiguous byte buffer of the body's exact length (``0``:
                an empty body is still asked for and checked; nothing is yielded).
            timeout_s: seconds to connect, for the head, and without a byte of the body.
            headers, anonymous: as in :meth:`get_bytes`.

        Raises:
            PeerUnreachable, StreamBroken, NotAvailable, RemoteProtocolError, TransportError:
                see the module docstring; a declared ``Content-Length`` other than
                ``len(view)``, or more bytes than that, is a RemoteProtocolError; a body that
                ends short is StreamBroken. The bytes announced so far stay in ``view``.
            LocalProtocolError: a malformed URL.

        Safe to run several concurrently (with different views). Cancellation or an early
        close closes the connection.
        """
        length = len(view)
        with self._counters.counting_errors():
            conn, response, source = await self._open(url, timeout_s, [*headers], anonymous)
            reusable = False
            try:
                check_exact_head(response, source, url, length)
                body = BodyCount(source, length, exact=True)
                async with aclosing(
                    self._body_into(conn, response, source, view, body, timeout_s)
                ) as pieces:
                    async for n in pieces:
                        yield n
                body.end()
                reusable = _reusable(conn, response)
            finally:
                await self._release(conn, reusable)

    async def _body_into(
        self,
        conn: _Conn,
        response: h11.Response,
        source: str,
        view: memoryview,
        body: BodyCount,
        timeout_s: float,
    ) -> AsyncGenerator[int, None]:
        """Read a checked response's body into ``view`` (exactly ``body.limit`` bytes),
        yielding the count of each piece as it lands: with ``recv_into`` past h11 when the
        head declares a ``Content-Length`` on a TCP connection (h11 is then reset for the
        connection's next exchange), else through h11, copied into ``view``."""
        length = body.limit
        if not _direct(conn, response):
            while (chunk := await self._next_data(conn, source, timeout_s)) is not None:
                got = body.received
                body.add(len(chunk))
                view[got : got + len(chunk)] = chunk
                yield len(chunk)
            return
        assert conn.socket is not None  # _direct
        buffered, _ = conn.h11.trailing_data  # body bytes read with the head
        body.add(len(buffered))
        if buffered:
            view[: len(buffered)] = buffered
            self._counters.bytes_received += len(buffered)
            yield len(buffered)
        lowat = _LowWater(conn.socket)
        try:
            while (got := body.received) < length:
                n = await _read_body(lowat, view[got:length], source, timeout_s)
                body.add(n)
                self._counters.bytes_received += n
                yield n
        finally:
            lowat.reset()
        conn.reset()  # h11 never saw the body: start its next cycle afresh


def _direct(conn: _Conn, response: h11.Response) -> bool:
    """True if the body is read with ``recv_into`` past h11 (a TCP connection and a declared
    ``Content-Length``); False: through h11 (a stream lane, or a chunked body)."""
    return conn.socket is not None and header(response, b"content-length") is not None


def _reusable(conn: _Conn, response: h11.Response) -> bool:
    """True if the connection may serve another request after this body was read whole."""
    return _keeps_alive(response) if _direct(conn, response) else True


def _keeps_alive(response: h11.Response) -> bool:
    """True if the server keeps the connection open after this response (HTTP/1.1 without
    ``Connection: close``)."""
    if response.http_version != b"1.1":
        return False
    return not any(
        k == b"connection" and b"close" in [t.strip() for t in v.lower().split(b",")]
        for k, v in response.headers
    )


async def _read_body(lowat: _LowWater, view: memoryview, source: str, timeout_s: float) -> int:
    """One read of body bytes into ``view`` from ``lowat``'s socket (:func:`_recv_body`),
    its failures mapped to the module's errors.

    Returns:
        bytes read (at least 1).

    Raises:
        StreamBroken: no byte for ``timeout_s`` seconds, or a socket error.
        ClosedMidBody: the peer closed the connection in order.
    """
    try:
        with trio.fail_after(timeout_s):
            n = await _recv_body(lowat.sock, view, lowat)
    except trio.TooSlowError as exc:
        raise StreamBroken(source, f"no progress for {timeout_s}s") from exc
    except OSError as exc:
        raise StreamBroken(source, f"connection broken: {exc}") from exc
    if n == 0:
        raise ClosedMidBody(source, "connection closed mid-body")
    return n


async def _recv_body(sock: trio.socket.SocketType, view: memoryview, lowat: _LowWater) -> int:
    """One read of body bytes into ``view`` (at most ``_RECV_BYTES``): woken only once
    ``RECV_LOWAT_BYTES`` (or all that remains) wait in the socket; if they do not within
    ``RECV_LOWAT_WAIT_S``, the low-water mark is dropped for the rest of the body.

    Returns:
        bytes read (0: the peer closed).

    Raises:
        OSError: from the socket.
    """
    if lowat.enabled:
        lowat.want(len(view))
        # Wait first: trio's recv_into tries the read before waiting, and a read returns
        # whatever has arrived, however little.
        with trio.move_on_after(RECV_LOWAT_WAIT_S) as waiting:
            await trio.lowlevel.wait_readable(sock.fileno())
        if waiting.cancelled_caught:
            lowat.disable()
    return await sock.recv_into(view, min(_RECV_BYTES, len(view)))
