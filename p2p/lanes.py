"""The narrow network interfaces node code uses: the host (identity, streams, gossip) and the
HTTP lane (client and server), and the factory that opens them.

Theory of operation
-------------------
Node code (:mod:`shardcast.node.node`, the follower, origin, downloader, the rollout exchange and
the trainer's inbox) never needs more from the network than these protocols say. Two
implementations satisfy them:

- the real one: :class:`p2p.host.P2PNode` (py-libp2p), :class:`p2p.http_client.HttpClient`
  and :class:`p2p.http_server.HttpServer` (h11 over trio sockets), opened by
  :data:`REAL_NETWORK`;
- the in-memory one, :mod:`p2p.memnet`, with seeded latency, bandwidth, loss and partitions,
  for many-node tests in virtual time.

Both pass one conformance suite (``tests/conformance/test_lanes.py``): request/response with
its bounds and errors, gossip delivery and validation, peer-gone notification, HTTP ``GET``
with ``Range`` and the status codes the client maps to typed errors. Errors are the ones of
:mod:`p2p.errors` and :mod:`p2p.http_errors`, never a library's.

This module imports neither libp2p nor h11, so code that only names these types imports fast.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Mapping, Sequence
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from p2p.bytestream import ByteStream, StreamHandler, StreamOpener
    from p2p.gossip import GossipMessage, SubscriptionStats
    from p2p.host import HostConfig
    from p2p.http_client import HttpClientStatistics
    from p2p.http_server import HttpRequest, HttpResponse, HttpServerConfig, HttpServerStatistics
    from p2p.identity import Identity
    from p2p.keepalive import KeepaliveStats
    from p2p.limits import BoundaryStats
    from p2p.loop_lag import LoopLag

__all__ = [
    "REAL_NETWORK",
    "GossipCheck",
    "GossipFeed",
    "Host",
    "HttpHandler",
    "HttpLaneClient",
    "HttpLaneServer",
    "Network",
    "RequestHandler",
    "RequestSigner",
]

RequestHandler = Callable[[str, bytes], Awaitable[bytes]]
"""``handler(sender_peer_id, request_bytes) -> response_bytes`` of a request protocol."""

GossipCheck = Callable[[str, bytes], None]
"""``check(origin_peer_id, data)``: raises a ShardnetError to refuse a gossip message."""

HttpHandler = Callable[["HttpRequest"], Awaitable["HttpResponse"]]
"""The HTTP lane application: one request in, one response out."""

RequestSigner = Callable[[str], Sequence[tuple[str, str]]]
"""Headers to add to a lane request, given its target (path and query)."""


class GossipFeed(Protocol):
    """A bounded subscription to one topic; ``async for msg in feed``."""

    async def receive(self) -> GossipMessage:
        """The next message (oldest first); waits for one."""
        ...

    def __aiter__(self) -> GossipFeed: ...

    async def __anext__(self) -> GossipMessage: ...

    def statistics(self) -> SubscriptionStats:
        """Received, delivered and dropped counters."""
        ...


class Host(Protocol):
    """What node code needs from a peer-to-peer host (see :class:`p2p.host.P2PNode` for the
    full contract of each method; the errors named there are the contract)."""

    @property
    def peer_id(self) -> str:
        """This node's PeerID (base58)."""
        ...

    def multiaddrs(self) -> list[str]:
        """Advertised addresses, each ending in ``/p2p/<PeerID>``."""
        ...

    def listen_multiaddrs(self) -> list[str]:
        """Bound listen addresses, without ``/p2p/``."""
        ...

    def connected_peers(self) -> list[str]:
        """PeerIDs with an open connection."""
        ...

    def remote_hosts(self, peer_id: str) -> list[str]:
        """IP addresses ``peer_id``'s open connections come from, as seen here (may be empty)."""
        ...

    def mesh_sizes(self) -> dict[str, int]:
        """Gossip mesh size per joined topic."""
        ...

    @property
    def loop_lag(self) -> LoopLag:
        """How late this node's event loop has run (:mod:`p2p.loop_lag`)."""
        ...

    def boundary_statistics(self) -> BoundaryStats:
        """Inbound stream admission counters, offences charged to peers, bans now."""
        ...

    def keepalive_statistics(self) -> KeepaliveStats:
        """Pings, connections closed as dead and re-dials (:mod:`p2p.keepalive`)."""
        ...

    def on_peer_gone(self, callback: Callable[[str], None]) -> None:
        """Call ``callback(peer_id)`` when a remote's last connection closes (must not block)."""
        ...

    def expect_departures(self, reason: str | None) -> None:
        """Say that kept peers may leave for ``reason`` (e.g. ``"run_finished"``; None: no
        longer): losing all of them is then logged at INFO, not WARNING."""
        ...

    def keep(self, addr: str) -> None:
        """Keep dialling ``addr`` (``/p2p/``-suffixed) with backoff until it connects, and
        re-dial it whenever it is lost, although no dial of it has succeeded yet.

        Raises:
            ConfigError: malformed address.
        """
        ...

    async def connect(self, addr: str) -> str:
        """Dial a ``/p2p/``-suffixed multiaddr; return the remote PeerID.

        Raises:
            ConfigError: malformed address, or this node itself.
            PeerUnreachable: the dial failed or timed out.
        """
        ...

    def serve(
        self,
        protocol: str,
        handler: RequestHandler,
        *,
        max_request_bytes: int,
        max_response_bytes: int,
        timeout_s: float,
        max_concurrent: int = 64,
    ) -> None:
        """Register ``handler`` on ``protocol``; a handler's ShardnetError resets the stream."""
        ...

    async def request(
        self,
        peer_id: str,
        protocol: str,
        payload: bytes,
        *,
        max_response_bytes: int,
        timeout_s: float,
    ) -> bytes:
        """One request on a new stream; the response bytes.

        Raises:
            PeerUnreachable: no connection could be opened.
            StreamBroken: reset, closed early or timed out.
            MessageTooLarge: response over ``max_response_bytes``.
            RemoteProtocolError: the peer does not speak ``protocol``.
        """
        ...

    def serve_stream(
        self,
        protocol: str,
        handler: StreamHandler,
        *,
        max_per_peer: int = 64,
        max_concurrent: int = 256,
    ) -> None:
        """Register ``handler(peer_id, stream)`` for inbound byte streams on ``protocol``."""
        ...

    async def open_stream(self, peer_id: str, protocol: str, timeout_s: float) -> ByteStream:
        """A byte stream to ``peer_id`` over a connection already held.

        Raises:
            PeerUnreachable: no connection, or not opened within ``timeout_s``.
            RemoteProtocolError: the peer does not speak ``protocol``.
        """
        ...

    def direct_peers(self) -> list[str]:
        """PeerIDs with an open direct (not relayed) connection."""
        ...

    async def reserve(self, relay_peer_id: str) -> None:
        """Hold a circuit relay reservation on a connected relay.

        Raises:
            PeerUnreachable: circuits off, not connected, refused, or timed out.
        """
        ...

    async def punch(self, peer_id: str, relay_peer_id: str) -> bool:
        """Dial ``peer_id`` through ``relay_peer_id`` and hole-punch; True once a direct
        connection is held.

        Raises:
            PeerUnreachable: circuits off, no connection to the relay, or the relayed dial
                failed.
        """
        ...

    async def publish(self, topic: str, data: bytes) -> None:
        """Best-effort gossip. Raises MessageTooLarge over the gossip bound."""
        ...

    async def subscribe(self, topic: str, check: GossipCheck) -> GossipFeed:
        """Subscribe with a synchronous validator run before delivery and forwarding."""
        ...

    async def wait_for_subscriber(self, peer_id: str, topic: str, timeout_s: float) -> None:
        """Wait until ``peer_id`` subscribes to ``topic``. Raises StreamBroken on timeout."""
        ...


class HttpLaneClient(Protocol):
    """The HTTP lane client (see :class:`p2p.http_client.HttpClient` for the error table)."""

    def statistics(self) -> HttpClientStatistics:
        """Requests, body bytes received, errors by class name."""
        ...

    async def get_bytes(
        self,
        url: str,
        *,
        max_bytes: int,
        timeout_s: float,
        headers: Sequence[tuple[str, str]] = (),
        anonymous: bool = False,
    ) -> bytes:
        """GET a whole small body (``200`` only); ``headers`` replace defaults of that name."""
        ...

    def stream_range(
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
        """Yield exactly bytes ``[start, start + length)`` of ``url``, or raise."""
        ...

    def receive_into(
        self,
        url: str,
        view: memoryview,
        *,
        timeout_s: float,
        headers: Sequence[tuple[str, str]] = (),
        anonymous: bool = False,
    ) -> AsyncGenerator[int, None]:
        """GET a whole body (``200`` only) of exactly ``len(view)`` bytes into ``view``,
        yielding the count of each newly filled piece (as
        :meth:`p2p.http_client.HttpClient.receive_into`)."""
        ...

    def receive_range_into(
        self,
        url: str,
        start: int,
        view: memoryview,
        *,
        timeout_s: float,
        headers: Sequence[tuple[str, str]] = (),
        anonymous: bool = False,
    ) -> AsyncGenerator[int, None]:
        """Receive bytes ``[start, start + len(view))`` of ``url`` into ``view``, yielding the
        count of each newly filled piece (as
        :meth:`p2p.http_client.HttpClient.receive_range_into`)."""
        ...


class HttpLaneServer(Protocol):
    """A running HTTP lane server."""

    @property
    def port(self) -> int:
        """The bound TCP port."""
        ...

    @property
    def url(self) -> str:
        """``http://host:port`` of the bound address."""
        ...

    def statistics(self) -> HttpServerStatistics:
        """Body bytes sent, requests, connections, errors by kind."""
        ...

    async def serve_stream(self, peer_id: str, stream: ByteStream) -> None:
        """Serve one stream-lane connection from ``peer_id`` (see
        :meth:`p2p.http_server.HttpServer.serve_stream`); closes ``stream``."""
        ...


class Network(Protocol):
    """Opens one node's host and HTTP lane. A node takes one of these (default: the real
    network); every context manager closes what it opened on exit, however it is left."""

    def open_host(
        self, identity: Identity, config: HostConfig
    ) -> AbstractAsyncContextManager[Host]:
        """The node's peer-to-peer host.

        Raises:
            ConfigError, PeerUnreachable: cannot listen (see :meth:`p2p.host.P2PNode.open`).
        """
        ...

    def open_http_server(
        self, handler: HttpHandler, config: HttpServerConfig
    ) -> AbstractAsyncContextManager[HttpLaneServer]:
        """The node's HTTP lane server, listening when the block starts.

        Raises:
            OSError: the address cannot be bound.
        """
        ...

    def open_http_client(
        self,
        *,
        headers: Mapping[str, str],
        sign: RequestSigner | None,
        open_stream: StreamOpener | None = None,
    ) -> AbstractAsyncContextManager[HttpLaneClient]:
        """The node's HTTP lane client (a connection pool); ``open_stream`` opens the
        streams of ``p2p://`` (stream lane) URLs."""
        ...


class _RealNetwork:
    """libp2p host, h11 server and client on real sockets (imports libp2p when first used)."""

    def open_host(
        self, identity: Identity, config: HostConfig
    ) -> AbstractAsyncContextManager[Host]:
        from p2p.host import P2PNode

        return P2PNode.open(identity, config)

    @asynccontextmanager
    async def open_http_server(
        self, handler: HttpHandler, config: HttpServerConfig
    ) -> AsyncIterator[HttpLaneServer]:
        from p2p.http_server import open_http_server

        async with open_http_server(handler, config) as server:
            yield server

    @asynccontextmanager
    async def open_http_client(
        self,
        *,
        headers: Mapping[str, str],
        sign: RequestSigner | None,
        open_stream: StreamOpener | None = None,
    ) -> AsyncIterator[HttpLaneClient]:
        from p2p.http_client import HttpClient

        async with HttpClient(headers=headers, sign=sign, open_stream=open_stream) as client:
            yield client


REAL_NETWORK: Network = _RealNetwork()
"""The production network: libp2p and HTTP/1.1 on real sockets."""
