"""HTTP client of the bulk lane: byte ranges and small bodies over a pooled ``httpx.AsyncClient``.

Theory of operation
-------------------
A downloader holds one :class:`HttpClient` (one connection pool, keep-alive) and asks each
source for shard bytes with :meth:`HttpClient.stream_range`, which sends a single
``Range: bytes=first-last`` and yields exactly the bytes asked for, or raises. The answer is
checked before any byte is yielded: ``206`` with a ``Content-Range`` naming exactly that range
(or ``200`` whose body is exactly the range, when it starts at 0), and a ``Content-Length``, if
any, equal to the length. Small bodies (manifests, indexes) come from
:meth:`HttpClient.get_bytes` with a size bound checked before and while reading.

The lane is untrusted: the caller checks every byte against the signed manifest. This module
only guarantees the *amount* and *position* of the bytes, and that every failure is one of
the typed errors below, translated once from httpx here:

=====================================  ==============================================
what happened                          raised
=====================================  ==============================================
connect refused, DNS, connect timeout  :class:`~p2p.errors.PeerUnreachable`
reset, no progress for ``timeout_s``,  :class:`~p2p.errors.StreamBroken`
body shorter than promised, 5xx other
than 503 (the server failed)
404, 429, 503 (with or without         :class:`~p2p.http_errors.NotAvailable` (``retry_after_s``)
``Retry-After``)
other status, bad ``Content-Range``,   :class:`~p2p.errors.RemoteProtocolError`
more bytes than asked, malformed head
body over ``max_bytes``                :class:`~p2p.errors.MessageTooLarge`
our pool full for ``timeout_s``         :class:`~p2p.errors.TransportError` (the base class)
bad URL, bad arguments                 :class:`~p2p.errors.LocalProtocolError`
=====================================  ==============================================

``timeout_s`` bounds every wait for the network (connect, each read, each write, a pooled
connection): a source that sends headers and then stalls fails after ``timeout_s`` without
progress. A source that keeps trickling bytes is not a stall; bound whole transfers with
``trio.fail_after`` at the call site.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import AsyncGenerator, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from types import MappingProxyType, TracebackType
from typing import cast

import h11
import httpx

from p2p.errors import (
    LocalProtocolError,
    MessageTooLarge,
    PeerUnreachable,
    RemoteProtocolError,
    ShardnetError,
    StreamBroken,
    TransportError,
)
from p2p.http_errors import NotAvailable
from p2p.http_range import (
    ByteRange,
    RangeError,
    format_range,
    parse_content_range,
    parse_retry_after,
)

__all__ = ["HttpClient", "HttpClientStatistics"]

_NOT_AVAILABLE = frozenset({404, 429, 503})


@dataclass(frozen=True)
class HttpClientStatistics:
    """Counters of one client: requests sent, body bytes received, failures by error class name
    (``StreamBroken``, ``NotAvailable``...)."""

    requests: int
    bytes_received: int
    errors: Mapping[str, int]


class HttpClient:
    """A pool of keep-alive HTTP/1.1 connections for the bulk lane (use as ``async with``).

    Args:
        max_connections: connections open at once, over all sources.
        max_keepalive_connections: idle connections kept for reuse.
        keepalive_expiry_s: idle seconds before a pooled connection is dropped; keep it below
            the servers' ``idle_timeout_s`` so a reused connection is rarely closed under us.
        headers: sent with every request (e.g. ``X-Shardnet-Peer``).

    Methods may be called concurrently from several tasks (the pool is shared). Leaving the
    ``async with`` block closes every connection.
    """

    def __init__(
        self,
        *,
        max_connections: int = 64,
        max_keepalive_connections: int = 16,
        keepalive_expiry_s: float = 5.0,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        limits = httpx.Limits(
            max_connections=max_connections,
            max_keepalive_connections=max_keepalive_connections,
            keepalive_expiry=keepalive_expiry_s,
        )
        self._client = httpx.AsyncClient(
            limits=limits,
            trust_env=False,
            follow_redirects=False,
            http1=True,
            http2=False,
            headers=dict(headers or {}),
        )
        self._requests = 0
        self._bytes_received = 0
        self._errors: Counter[str] = Counter()

    def statistics(self) -> HttpClientStatistics:
        """A snapshot of the counters (cheap; safe to call at any time)."""
        return HttpClientStatistics(
            self._requests, self._bytes_received, MappingProxyType(dict(self._errors))
        )

    async def __aenter__(self) -> HttpClient:
        await self._client.__aenter__()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self._client.__aexit__(exc_type, exc, tb)

    async def get_bytes(self, url: str, *, max_bytes: int, timeout_s: float) -> bytes:
        """GET ``url`` and return its whole body (``200`` only).

        Args:
            max_bytes: largest body accepted (bytes), checked before and while reading.
            timeout_s: longest wait without progress (seconds).

        Raises:
            PeerUnreachable, StreamBroken, NotAvailable, RemoteProtocolError, TransportError:
                see the module docstring.
            MessageTooLarge: the declared or received body exceeds ``max_bytes``.
            LocalProtocolError: a malformed URL.

        Safe to call concurrently. Cancellation closes the connection it was using.
        """
        try:
            return await self._get_bytes(url, max_bytes, timeout_s)
        except ShardnetError as exc:
            self._errors[type(exc).__name__] += 1
            raise

    async def _get_bytes(self, url: str, max_bytes: int, timeout_s: float) -> bytes:
        source = _source(url)
        response = await self._open(url, source, timeout_s, {})
        try:
            if response.status_code != 200:
                raise _status_error(response, source)
            declared = response.headers.get("content-length")
            if declared is not None and declared.isdigit() and int(declared) > max_bytes:
                raise MessageTooLarge(source, f"body of {declared} bytes exceeds {max_bytes}")
            body, chunks = bytearray(), _Body(response, source)
            try:
                async for chunk in chunks:
                    body += chunk
                    self._bytes_received += len(chunk)
                    if len(body) > max_bytes:
                        raise MessageTooLarge(source, f"body exceeds {max_bytes} bytes")
            finally:
                await chunks.aclose()
            return bytes(body)
        finally:
            await response.aclose()

    async def stream_range(
        self, url: str, start: int, length: int, *, timeout_s: float, chunk_bytes: int = 1 << 20
    ) -> AsyncGenerator[bytes, None]:
        """Yield bytes ``[start, start + length)`` of ``url``: exactly ``length`` bytes in total.

        Args:
            start: offset of the first byte.
            length: number of bytes; ``0`` yields nothing and sends no request.
            timeout_s: longest wait without progress (seconds).
            chunk_bytes: largest chunk yielded (bytes). Chunks are yielded as they arrive
                (httpcore reads 64 KiB at a time), split when larger, never coalesced:
                coalescing into fixed-size chunks halved throughput in bench/http_lane.py.

        Raises:
            PeerUnreachable, StreamBroken, NotAvailable, RemoteProtocolError, TransportError:
                see the module docstring; all are raised before the first byte is yielded
                except StreamBroken and the "more bytes than asked" RemoteProtocolError.
            LocalProtocolError: a malformed URL or negative ``start``/``length``.

        Safe to run several concurrently. An async generator: a caller that stops early must
        close it (``async with contextlib.aclosing(...)``), which closes its connection at once;
        an unclosed one is closed when collected, and trio warns about it. Cancellation closes
        the connection; the caller keeps whatever chunks it already took.
        """
        if start < 0 or length < 0 or chunk_bytes < 1:
            raise LocalProtocolError(f"bad range request {start}+{length} by {chunk_bytes}")
        if length == 0:
            return
        try:
            source = _source(url)
            spec = format_range(ByteRange(start, start + length - 1))
            response = await self._open(url, source, timeout_s, {"range": spec})
            try:
                _check_range_response(response, source, start, length)
                received, chunks = 0, _Body(response, source)
                try:
                    async for chunk in chunks:
                        received += len(chunk)
                        self._bytes_received += len(chunk)
                        if received > length:
                            raise RemoteProtocolError(source, f"more than the {length} bytes")
                        for i in range(0, len(chunk), chunk_bytes):
                            yield chunk[i : i + chunk_bytes] if len(chunk) > chunk_bytes else chunk
                finally:
                    await chunks.aclose()
                if received < length:
                    raise StreamBroken(source, f"body ended after {received} of {length} bytes")
            finally:
                await response.aclose()
        except ShardnetError as exc:  # one generator, not a wrapper: see _Body
            self._errors[type(exc).__name__] += 1
            raise

    async def _open(
        self, url: str, source: str, timeout_s: float, headers: dict[str, str]
    ) -> httpx.Response:
        with _translate(source, body=False):
            request = self._client.build_request(
                "GET",
                url,
                headers={"accept-encoding": "identity", **headers},
                timeout=httpx.Timeout(timeout_s),
            )
            self._requests += 1
            return await self._client.send(request, stream=True)


class _Body:
    """Iterate a response body as it arrives, translating errors; an async iterator.

    httpx's body iterators are nested async generators (encode/httpx#3686); trio warns about any
    that is garbage collected half-way. When the consumer stops early, :meth:`aclose` closes the
    connection first and then runs them to their end (the closed socket ends them with a read
    error, ignored here), so none is left half-way.
    """

    def __init__(self, response: httpx.Response, source: str) -> None:
        self._response = response
        self._source = source
        self._chunks = cast(AsyncGenerator[bytes, None], response.aiter_raw())
        self._done = False

    def __aiter__(self) -> _Body:
        return self

    async def __anext__(self) -> bytes:
        try:
            with _translate(self._source, body=True):
                return await self._chunks.__anext__()
        except BaseException:
            self._done = True  # the generators ended with this exception
            raise

    async def aclose(self) -> None:
        if self._done:
            return
        self._done = True
        try:
            await self._response.aclose()
        finally:
            # Runs even when cancelled: the generators then end with Cancelled at their first
            # checkpoint, which is just as good as running them to their end.
            try:
                async for _ in self._chunks:
                    pass
            except httpx.HTTPError:
                pass  # expected: the connection was closed under the generators


def _source(url: str) -> str:
    """``scheme://host:port`` of ``url``: the label errors and scores use."""
    try:
        parsed = httpx.URL(url)
    except httpx.InvalidURL as exc:
        raise LocalProtocolError(f"invalid URL {url!r}: {exc}") from exc
    return f"{parsed.scheme}://{parsed.netloc.decode('ascii')}"


def _status_error(response: httpx.Response, source: str) -> Exception:
    status = response.status_code
    what = f"HTTP {status} for {response.request.url.path}"
    if status in _NOT_AVAILABLE:
        retry = response.headers.get("retry-after")
        delay = None if retry is None else parse_retry_after(retry, now_unix_s=time.time())
        return NotAvailable(source, what, retry_after_s=delay, status=status)
    if 500 <= status <= 599:  # the server failed; the bytes were not wrong
        return StreamBroken(source, f"server error {what}")
    return RemoteProtocolError(source, f"unexpected {what}")


def _check_range_response(response: httpx.Response, source: str, start: int, length: int) -> None:
    status = response.status_code
    if status not in (200, 206):
        raise _status_error(response, source)
    declared = response.headers.get("content-length")
    if declared is not None and declared.strip() != str(length):
        raise RemoteProtocolError(source, f"Content-Length {declared} for {length} bytes asked")
    if status == 200:
        if start == 0 and declared is not None:
            return  # the whole representation is exactly the range asked for
        raise RemoteProtocolError(source, "range ignored (200 instead of 206)")
    value = response.headers.get("content-range", "")
    try:
        got = parse_content_range(value)
    except RangeError as exc:
        raise RemoteProtocolError(source, str(exc)) from None
    if got.first != start or got.length != length:
        raise RemoteProtocolError(source, f"Content-Range {value!r} for {start}+{length} asked")


@contextmanager
def _translate(source: str, *, body: bool) -> Iterator[None]:
    """Map httpx's exceptions to shardnet's; ``body``: the response head was already read."""
    try:
        yield
    except (httpx.ConnectError, httpx.ConnectTimeout) as exc:
        raise PeerUnreachable(source, f"{type(exc).__name__}: {exc}") from exc
    except httpx.PoolTimeout as exc:  # our own pool is full: not the source's fault
        raise TransportError(source, "no free connection in the local pool") from exc
    except httpx.TimeoutException as exc:
        raise StreamBroken(source, f"no progress: {type(exc).__name__}") from exc
    except httpx.NetworkError as exc:
        raise StreamBroken(source, f"{type(exc).__name__}: {exc}") from exc
    except httpx.RemoteProtocolError as exc:
        # A truncated body and a connection closed before any answer are transport faults; a
        # malformed response head (h11 refused to parse it) is the source's protocol fault.
        if body or not _caused_by(exc, h11.RemoteProtocolError):
            raise StreamBroken(source, f"{exc}") from exc
        raise RemoteProtocolError(source, f"malformed response: {exc}") from exc
    except (httpx.UnsupportedProtocol, httpx.InvalidURL, httpx.LocalProtocolError) as exc:
        raise LocalProtocolError(f"{source}: {exc}") from exc


def _caused_by(exc: BaseException, kind: type[BaseException]) -> bool:
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, kind):
            return True
        seen = seen.__cause__ or seen.__context__
    return False
