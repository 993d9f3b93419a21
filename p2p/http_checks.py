"""What the HTTP lane's clients check, said once: the real client and the in-memory one share it.

Theory of operation
-------------------
The bulk lane has two clients with one contract (:class:`p2p.lanes.HttpLaneClient`):
:class:`p2p.http_client.HttpClient` (h11 over trio sockets) and
:class:`p2p.memnet.MemHttpClient` (the in-memory network). They differ only in how bytes
move; every decision about what a request carries and whether an answer is acceptable lives
here, so the fake cannot drift from the real client:

- the request: :func:`parse_target` (which URLs are allowed, the source label, the ``Host``
  header), :func:`request_headers` (defaults, then per-request headers, one replacing a
  default of the same name), :func:`check_range_args`;
- the response head: :func:`check_whole_head` (``get_bytes``: ``200`` and a declared size
  within the bound) and :func:`check_range_head` (``stream_range``: ``206`` naming exactly the
  range asked, or ``200`` of exactly that length from 0), both mapping a status to its typed
  error with :func:`status_error`;
- the body as it arrives: :class:`BodyCount` (a whole body within its bound; a range's no
  more, and in the end no fewer, bytes than asked);
- the counters: :class:`ClientCounters` (requests, body bytes, failures by error class).

The error table (which failure raises which typed error) is in :mod:`p2p.http_client`'s
docstring. Nothing here does I/O; ``parse_retry_after`` reads the wall clock for an HTTP-date.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from types import MappingProxyType
from typing import NamedTuple
from urllib.parse import urlsplit

import h11

from p2p.bytestream import stream_lane_peer, stream_lane_url
from p2p.errors import (
    LocalProtocolError,
    MessageTooLarge,
    RemoteProtocolError,
    ShardnetError,
    StreamBroken,
)
from p2p.http_errors import NotAvailable
from p2p.http_range import RangeError, parse_content_range, parse_retry_after

__all__ = [
    "HOLDER_HEADER",
    "MAX_HOLDERS",
    "NOT_AVAILABLE_STATUSES",
    "BodyCount",
    "ClientCounters",
    "HttpClientStatistics",
    "Target",
    "check_exact_head",
    "check_range_args",
    "check_range_head",
    "check_whole_head",
    "header",
    "parse_holders",
    "parse_target",
    "request_headers",
    "status_error",
]

#: statuses that mean "not from this source now": 404, 409, 429, 503 (:class:`NotAvailable`)
NOT_AVAILABLE_STATUSES = frozenset({404, 409, 429, 503})

HOLDER_HEADER = "x-shardnet-holder"
"""Response header of a super-seeding refusal (``429``): the PeerIDs holding the refused
bytes, comma-separated (:class:`shardcast.serve.superseeding.SuperSeeding` rule 11); carried
in :attr:`NotAvailable.holders <p2p.http_errors.NotAvailable>`. Older servers send none."""

MAX_HOLDERS = 4
"""Holders a :data:`HOLDER_HEADER` names at most (more are ignored)."""

_MAX_ID = 128


def parse_holders(value: str | None) -> tuple[str, ...]:
    """The PeerIDs a :data:`HOLDER_HEADER` value names: at most :data:`MAX_HOLDERS`, each
    1-128 characters without ``,:/`` and spaces (others are dropped); empty for None, an
    empty value or one longer than ``MAX_HOLDERS`` names could be."""
    if not value or len(value) > MAX_HOLDERS * (_MAX_ID + 1):
        return ()
    names = (v.strip() for v in value.split(",")[:MAX_HOLDERS])
    return tuple(v for v in names if 0 < len(v) <= _MAX_ID and not set(v) & set(",:/ "))


class Target(NamedTuple):
    """Where an ``http://`` URL points.

    Attributes:
        source: ``http://host:port`` (``p2p://<PeerID>``), the label errors and statistics
            name.
        key: ``(host, port)`` to connect to (``(PeerID, 0)`` for a stream lane).
        target: the request target (path and query).
        netloc: the ``Host`` header (IPv6 addresses in brackets; the PeerID for a stream lane).
        stream_peer: the PeerID of a stream-lane URL (:mod:`p2p.bytestream`), else ``""``.
    """

    source: str
    key: tuple[str, int]
    target: str
    netloc: str
    stream_peer: str = ""


def parse_target(url: str) -> Target:
    """Split an ``http://host[:port]/path`` URL (port 80 by default) or a stream-lane
    ``p2p://<PeerID>/path`` URL (:mod:`p2p.bytestream`).

    Raises:
        LocalProtocolError: not a valid ``http://`` URL with a host, nor a ``p2p://`` URL
            with a base58 PeerID.
    """
    peer = stream_lane_peer(url)
    if peer is not None:
        rest = url[len(stream_lane_url(peer)) :]
        if rest and rest[0] not in "/?":
            raise LocalProtocolError(f"invalid URL {url!r}: p2p://<PeerID>/path only")
        parts = urlsplit(rest)
        target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        return Target(stream_lane_url(peer), (peer, 0), target, peer, peer)
    try:
        parts = urlsplit(url)
        port = parts.port or 80
    except ValueError as exc:
        raise LocalProtocolError(f"invalid URL {url!r}: {exc}") from exc
    if parts.scheme != "http" or not parts.hostname:
        raise LocalProtocolError(f"invalid URL {url!r}: only http://host[:port]/path or p2p://")
    host = parts.hostname
    netloc = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    return Target(f"http://{netloc}", (host, port), target, netloc)


def request_headers(
    netloc: str,
    defaults: Sequence[tuple[str, str]],
    signed: Sequence[tuple[str, str]],
    extra: Sequence[tuple[str, str]],
) -> list[tuple[str, str]]:
    """The headers of one GET: ``Host``, ``Accept-Encoding: identity``, the client's
    ``defaults`` (lower-case names) except those ``extra`` names, the ``signed`` headers, then
    ``extra`` (a per-request header replaces the default of the same name, never doubles it)."""
    named = {k.lower() for k, _ in extra}
    return [
        ("host", netloc),
        ("accept-encoding", "identity"),
        *(h for h in defaults if h[0] not in named),
        *signed,
        *extra,
    ]


def check_range_args(start: int, length: int, chunk_bytes: int | None = None) -> None:
    """Raises LocalProtocolError for a negative ``start``/``length`` or ``chunk_bytes < 1``."""
    if start < 0 or length < 0 or (chunk_bytes is not None and chunk_bytes < 1):
        by = "" if chunk_bytes is None else f" by {chunk_bytes}"
        raise LocalProtocolError(f"bad range request {start}+{length}{by}")


def header(response: h11.Response, name: bytes) -> str | None:
    """The first value of header ``name`` (lower-case bytes), or None."""
    for k, v in response.headers:
        if k == name:
            return v.decode("latin-1")
    return None


def status_error(response: h11.Response, source: str, url: str) -> ShardnetError:
    """The typed error for a status the request cannot use: :class:`NotAvailable` (with
    ``Retry-After`` in seconds, and for a ``429`` the holders :data:`HOLDER_HEADER` names)
    for :data:`NOT_AVAILABLE_STATUSES`, StreamBroken for another 5xx (the server failed, the
    bytes were not wrong), RemoteProtocolError otherwise."""
    status = response.status_code
    what = f"HTTP {status} for {urlsplit(url).path}"
    if status in NOT_AVAILABLE_STATUSES:
        retry = header(response, b"retry-after")
        delay = None if retry is None else parse_retry_after(retry, now_unix_s=time.time())
        holders = parse_holders(header(response, HOLDER_HEADER.encode())) if status == 429 else ()
        return NotAvailable(source, what, retry_after_s=delay, status=status, holders=holders)
    if 500 <= status <= 599:
        return StreamBroken(source, f"server error {what}")
    return RemoteProtocolError(source, f"unexpected {what}")


def check_whole_head(response: h11.Response, source: str, url: str, max_bytes: int) -> None:
    """The head of a whole-body GET: ``200``, and a declared ``Content-Length`` (if any) within
    ``max_bytes``.

    Raises:
        NotAvailable, StreamBroken, RemoteProtocolError: another status (:func:`status_error`).
        MessageTooLarge: the declared body exceeds ``max_bytes``.
    """
    if response.status_code != 200:
        raise status_error(response, source, url)
    declared = header(response, b"content-length")
    if declared is not None and declared.isdigit() and int(declared) > max_bytes:
        raise MessageTooLarge(source, f"body of {declared} bytes exceeds {max_bytes}")


def check_exact_head(response: h11.Response, source: str, url: str, length: int) -> None:
    """The head of a whole-body GET whose body the caller knows to be exactly ``length``
    bytes (``receive_into``): ``200``, and a declared ``Content-Length`` (if any) equal to it.

    Raises:
        NotAvailable, StreamBroken, RemoteProtocolError: another status (:func:`status_error`).
        RemoteProtocolError: a declared ``Content-Length`` other than ``length``.
    """
    if response.status_code != 200:
        raise status_error(response, source, url)
    declared = header(response, b"content-length")
    if declared is not None and declared.strip() != str(length):
        raise RemoteProtocolError(source, f"Content-Length {declared} for {length} bytes expected")


def check_range_head(
    response: h11.Response, source: str, url: str, start: int, length: int
) -> None:
    """The head of a ranged GET for ``[start, start + length)``: ``206`` whose
    ``Content-Range`` names exactly that range, or ``200`` when ``start`` is 0 and a declared
    ``Content-Length`` says the whole representation is that range; a ``Content-Length``, if
    any, equal to ``length``.

    Raises:
        NotAvailable, StreamBroken, RemoteProtocolError: another status (:func:`status_error`).
        RemoteProtocolError: a wrong ``Content-Length`` or ``Content-Range``, or the range
            ignored.
    """
    status = response.status_code
    if status not in (200, 206):
        raise status_error(response, source, url)
    declared = header(response, b"content-length")
    if declared is not None and declared.strip() != str(length):
        raise RemoteProtocolError(source, f"Content-Length {declared} for {length} bytes asked")
    if status == 200:
        if start == 0 and declared is not None:
            return  # the whole representation is exactly the range asked for
        raise RemoteProtocolError(source, "range ignored (200 instead of 206)")
    value = header(response, b"content-range") or ""
    try:
        got = parse_content_range(value)
    except RangeError as exc:
        raise RemoteProtocolError(source, str(exc)) from None
    if got.first != start or got.length != length:
        raise RemoteProtocolError(source, f"Content-Range {value!r} for {start}+{length} asked")


class BodyCount:
    """The bytes of a body counted as they arrive, against ``limit`` (bytes).

    A whole body (``exact=False``, ``get_bytes``) may be any size up to ``limit``; a range's
    (``exact=True``) must be exactly ``limit`` bytes.
    """

    def __init__(self, source: str, limit: int, *, exact: bool) -> None:
        self.source = source
        self.limit = limit
        self.exact = exact
        self.received = 0

    def add(self, n: int) -> None:
        """``n`` more bytes arrived.

        Raises:
            MessageTooLarge: a whole body went past ``limit``.
            RemoteProtocolError: a range's body went past ``limit``.
        """
        self.received += n
        if self.received > self.limit:
            if self.exact:
                raise RemoteProtocolError(self.source, f"more than the {self.limit} bytes")
            raise MessageTooLarge(self.source, f"body exceeds {self.limit} bytes")

    def end(self) -> None:
        """The body ended. Raises StreamBroken if a range's body is short of ``limit``."""
        if self.exact and self.received < self.limit:
            raise StreamBroken(
                self.source, f"body ended after {self.received} of {self.limit} bytes"
            )


@dataclass(frozen=True)
class HttpClientStatistics:
    """Counters of one client: requests sent, body bytes received, failures by error class name
    (``StreamBroken``, ``NotAvailable``...)."""

    requests: int
    bytes_received: int
    errors: Mapping[str, int]


class ClientCounters:
    """The counters behind :class:`HttpClientStatistics` (updated by the client's driver)."""

    def __init__(self) -> None:
        self.requests = 0
        self.bytes_received = 0
        self.errors: Counter[str] = Counter()

    def statistics(self) -> HttpClientStatistics:
        """A snapshot (cheap; safe to call at any time)."""
        return HttpClientStatistics(
            self.requests, self.bytes_received, MappingProxyType(dict(self.errors))
        )

    @contextmanager
    def counting_errors(self) -> Iterator[None]:
        """Count each :class:`~p2p.errors.ShardnetError` that leaves the block by class name
        (and re-raise it)."""
        try:
            yield
        except ShardnetError as exc:
            self.errors[type(exc).__name__] += 1
            raise
