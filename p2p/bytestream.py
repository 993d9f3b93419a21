"""The transport seam of the HTTP lane: one byte-stream interface, two transports.

Theory of operation
-------------------
The lane speaks HTTP/1.1 (h11) over a reliable, ordered byte stream. Two transports carry it:

- **TCP**: a ``trio.SocketStream`` the client dials and the server accepts; curl, nginx
  mirrors and every node whose lane is reachable use it (URLs ``http://host:port``);
- **a libp2p stream** on an existing libp2p connection (protocol :data:`STREAM_LANE_PROTOCOL`,
  the idea of the libp2p HTTP spec: HTTP/1.1 semantics over a libp2p stream; URLs
  ``p2p://<PeerID>``). A node behind a NAT cannot accept TCP connections, but it dialled its
  relay, the trainer and public peers, and they can open streams back over those
  connections; so its lane is served through the NAT without a second HTTP implementation.

:class:`ByteStream` is the whole contract both transports meet, and the one
:class:`p2p.http_server.HttpServer` and :class:`p2p.http_client.HttpClient` drive h11 over:
``receive_some``, ``send_all``, ``aclose`` (trio's ``SocketStream`` already has them; the libp2p
adapter lives in :mod:`p2p.host`, the only module importing libp2p). Every bound of the lane
(head size, timeouts, connection slots, body counts, the error table of
:mod:`p2p.http_checks`) holds on both, because it is the same code above the seam. What the
stream transport lacks is TCP's zero-copy paths: a file body is read in chunks and written
(no ``sendfile``) and a range is received through h11 (no ``recv_into``/``SO_RCVLOWAT``).

Stream lane URLs name the PeerID as the authority: ``p2p://12D3KooW…/shardnet/v1/…``. The
PeerID is proven by the connection's Noise handshake, so a stream lane needs no whoami
challenge. Nothing here does I/O.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Protocol

from p2p.errors import BASE58_CHARS

__all__ = [
    "STREAM_LANE_PROTOCOL",
    "STREAM_LANE_SCHEME",
    "ByteStream",
    "StreamHandler",
    "StreamOpener",
    "stream_lane_peer",
    "stream_lane_url",
]

STREAM_LANE_PROTOCOL = "/http/1.1"
"""libp2p protocol id of the HTTP lane over a libp2p stream (libp2p HTTP spec)."""

STREAM_LANE_SCHEME = "p2p"
"""URL scheme of a stream lane: ``p2p://<PeerID>``."""


class ByteStream(Protocol):
    """A reliable, ordered, bidirectional byte stream (trio's ``Stream`` subset the lane uses).

    Errors: ``receive_some`` and ``send_all`` raise ``trio.BrokenResourceError`` when the
    stream broke (reset, connection lost) and ``trio.ClosedResourceError`` after
    :meth:`aclose`; nothing else. Not safe for concurrent sends or concurrent receives.
    """

    async def receive_some(self, max_bytes: int | None = None) -> bytes:
        """Up to ``max_bytes`` bytes (at least one), or ``b""`` once the peer closed its side."""
        ...

    async def send_all(self, data: bytes | memoryview) -> None:
        """Send all of ``data`` (returns once it is handed to the transport)."""
        ...

    async def aclose(self) -> None:
        """Close both directions (idempotent); never raises for a stream already broken."""
        ...


StreamOpener = Callable[[str, float], Awaitable[ByteStream]]
"""``await open(peer_id, timeout_s)``: a new stream-lane stream to ``peer_id`` over an
existing connection. Raises :class:`~p2p.errors.PeerUnreachable` (no connection, or the
stream could not be opened within ``timeout_s``) or
:class:`~p2p.errors.RemoteProtocolError` (the peer does not serve the stream lane)."""

StreamHandler = Callable[[str, ByteStream], Awaitable[None]]
"""``await handle(peer_id, stream)``: serve one inbound stream; the handler closes it."""


def stream_lane_url(peer_id: str) -> str:
    """The base URL of ``peer_id``'s stream lane, ``p2p://<PeerID>``.

    Raises:
        ValueError: ``peer_id`` is not a base58 string (a caller bug).
    """
    if not peer_id or not set(peer_id) <= BASE58_CHARS:
        raise ValueError(f"{peer_id!r} is not a base58 PeerID")
    return f"{STREAM_LANE_SCHEME}://{peer_id}"


def stream_lane_peer(url: str) -> str | None:
    """The PeerID of a ``p2p://<PeerID>[/path]`` URL, or None for any other URL (an
    ``http://`` one, or a malformed authority)."""
    prefix = f"{STREAM_LANE_SCHEME}://"
    if not url.startswith(prefix):
        return None
    peer = url[len(prefix) :].split("/", 1)[0].split("?", 1)[0]
    return peer if peer and set(peer) <= BASE58_CHARS else None
