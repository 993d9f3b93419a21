"""The connections of a py-libp2p host: their sockets, tuned, aborted; the events they raise.

py-libp2p 0.8.1 exposes no socket: :func:`socket_of` walks a connection's layers (swarm
connection, yamux, Noise, raw connection, TCP stream) down to the trio socket, so that this
package can tune it (:mod:`p2p.sockopts`: TCP keepalive, ``TCP_USER_TIMEOUT``), abort it (RST:
a dead peer's send queue dropped at once, :func:`abort_connections`) and ask where an IPv6 peer
comes from (:func:`remote_endpoint`). :class:`ConnectionWatch` is the swarm notifee that does
the tuning on each new connection and tells the node of direct connections and lost peers;
:func:`close_host` closes a host gracefully, then aborts what is still open, so shutdown is
prompt behind a full send buffer; :func:`disable_auto_connect` turns off the library's
AutoConnector (shardnet dials only what it is told).
"""

from __future__ import annotations

import logging
from typing import Any, Protocol

import multiaddr
import trio
from libp2p.abc import INetConn, INetStream, INetwork, INotifee
from libp2p.peer.id import ID

from p2p import sockopts
from p2p.circuits import is_relayed
from p2p.whole_frames import write_frames_whole

log = logging.getLogger(__name__)

__all__ = [
    "ConnectionListener",
    "ConnectionWatch",
    "abort_connections",
    "close_host",
    "disable_auto_connect",
    "remote_endpoint",
    "socket_of",
]


async def close_host(host: Any, close_timeout_s: float) -> None:
    """Close ``host``: gracefully for ``close_timeout_s``; then every socket still open is
    aborted, which wakes a close stuck behind a full send buffer (yamux's GO_AWAY waits for
    the connection's write lock, held by a write the dead peer never acknowledges), and the
    close gets as long again to finish."""
    async with trio.open_nursery() as nursery:

        async def abort_late() -> None:
            await trio.sleep(close_timeout_s)
            n = abort_connections(host.get_network())
            if n:
                log.info("connections_aborted count=%d reason=close_timeout", n)

        nursery.start_soon(abort_late)
        with trio.move_on_after(2 * close_timeout_s):
            await host.close()
        nursery.cancel_scope.cancel()


async def _no_auto_connect() -> None:
    """Replacement for py-libp2p's AutoConnector cycle: shardnet dials only what it is told."""


def disable_auto_connect(host: object) -> None:
    """Turn off py-libp2p 0.8.1's AutoConnector.

    By default it dials every peer in the peerstore until 200 connections are open
    (learnt addresses included). shardnet's topology is explicit (upstreams, bootstrap peers,
    the trainer), so a node must never dial an address it was not configured with or told to
    use by a signed announcement. The library has no switch for this, so the connector's
    cycle is replaced by a no-op on this host only.
    """
    network = host.get_network()  # type: ignore[attr-defined]
    connector = getattr(network, "auto_connector", None)
    if connector is not None:
        connector.maybe_connect = _no_auto_connect


def socket_of(conn: object) -> Any | None:
    """The trio socket under a py-libp2p connection (SwarmConn → Yamux → SecureSession →
    Noise → RawConnection → TrioTCPStream → trio.SocketStream), or None if the layering is
    not the expected one (another transport, another library version)."""
    obj: object = conn
    for _ in range(10):
        if isinstance(obj, trio.SocketStream):
            return obj.socket
        nxt = next(
            (
                getattr(obj, a)
                for a in ("muxed_conn", "secured_conn", "conn", "stream")
                if getattr(obj, a, None) is not None
            ),
            None,
        )
        if nxt is None or nxt is obj:
            return None
        obj = nxt
    return None


def remote_endpoint(conn: Any) -> tuple[str, int] | None:
    """``(IP address, port)`` that a py-libp2p connection comes from, as this node sees it,
    or None (a relayed circuit, a closed socket, an unknown layering).

    py-libp2p's own ``get_remote_address`` answers None for every IPv6 connection (it takes
    only 2-tuples from ``getpeername``, and an IPv6 socket gives 4), so the socket
    (:func:`socket_of`) is asked where the library does not answer: without this, an
    IPv6-only node never saw where an asker came from and refused every dial-back.
    """
    remote = conn.muxed_conn.get_remote_address()
    if remote is not None:
        return str(remote[0]), int(remote[1])
    if is_relayed(conn):  # its socket is the relay's: not where the peer comes from
        return None
    sock = socket_of(conn)
    if sock is None:
        return None
    try:
        peer = sock.getpeername()
    except OSError:
        return None
    if not isinstance(peer, tuple) or len(peer) < 2:
        return None
    return str(peer[0]), int(peer[1])


def abort_connections(network: Any, peer: ID | None = None) -> int:
    """Abort (RST) the sockets of every connection, or of ``peer``'s; returns how many."""
    conns = (
        network.get_connections(peer)
        if peer is not None
        else [c for cs in network.get_connections_map().values() for c in cs]
    )
    n = 0
    for c in conns:
        sock = socket_of(c)
        if sock is not None:
            sockopts.abort(sock)
            n += 1
    return n


class ConnectionListener(Protocol):
    """What :class:`ConnectionWatch` tells (:class:`p2p.host.P2PNode` is one)."""

    def direct_connected(self, peer_id: str) -> None:
        """A direct (not relayed) connection to ``peer_id`` opened."""

    def last_connection_closed(self, peer_id: str) -> None:
        """The last connection to ``peer_id`` closed."""


class ConnectionWatch(INotifee):
    """The swarm's connection events: each new connection's socket tuned and its muxer made
    to write frames whole; direct connections and lost peers told to :attr:`listener`.

    Args:
        tcp_user_timeout_s: ``TCP_USER_TIMEOUT`` of each socket, and the bound of a frame's
            write (:func:`p2p.whole_frames.write_frames_whole`), seconds.

    Attributes:
        listener: told of direct connections and lost peers (None: nobody yet; set once the
            node runs).
    """

    def __init__(self, tcp_user_timeout_s: float) -> None:
        self.tcp_user_timeout_s = tcp_user_timeout_s
        self.listener: ConnectionListener | None = None

    async def connected(self, network: INetwork, conn: INetConn) -> None:
        """Tune the socket and make its muxer write frames whole (:mod:`p2p.whole_frames`: a
        cancelled stream must not corrupt the connection); a peer's first direct connection
        starts its pings (a relayed one does not: a circuit is for coordination, bounded by
        the relay and closed after the hole punch; pings over it failed while DCUtR ran and
        closed it as dead)."""
        sock = socket_of(conn)
        if sock is not None:
            sockopts.tune(sock, self.tcp_user_timeout_s)
        write_frames_whole(conn.muxed_conn, self.tcp_user_timeout_s)
        if self.listener is not None and not is_relayed(conn):
            self.listener.direct_connected(conn.muxed_conn.peer_id.to_base58())

    async def disconnected(self, network: INetwork, conn: INetConn) -> None:
        """A peer's last connection closed: stop its pings, re-dial it if it is kept."""
        pid = conn.muxed_conn.peer_id
        if self.listener is not None and not network.get_connections(pid):
            self.listener.last_connection_closed(pid.to_base58())

    async def opened_stream(self, network: INetwork, stream: INetStream) -> None:
        """Unused."""

    async def closed_stream(self, network: INetwork, stream: INetStream) -> None:
        """Unused."""

    async def listen(self, network: INetwork, multiaddr: multiaddr.Multiaddr) -> None:
        """Unused."""

    async def listen_close(self, network: INetwork, multiaddr: multiaddr.Multiaddr) -> None:
        """Unused."""
