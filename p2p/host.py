"""The libp2p host of a shardnet node: listen, dial, request/response streams, gossip.

Theory of operation
-------------------
``P2PNode.open(identity, config)`` is an async context manager that owns a py-libp2p 0.8.1
host (TCP, Noise, yamux — never mplex, which moves ~25 MB/s), a Pubsub/GossipSub router
configured for small announcements (see :mod:`p2p.gossip`), and the request/response helper
for one-shot streams. Leaving the context cancels every task the node started and closes the
host explicitly (leaving ``host.run()`` alone does not close the listener in 0.8.1).

Request/response: ``serve(protocol, handler)`` registers a handler ``(peer_id, request) ->
response`` on a protocol id such as ``/shardnet/info/1.0.0``; ``request(peer_id, protocol,
payload)`` sends one length-prefixed request and reads one length-prefixed response. Both
directions enforce a byte bound and a timeout (:mod:`p2p.requests`, which translates the
library's exceptions into :mod:`p2p.errors` types). Elsewhere library exceptions are
translated here, once.

Byte streams: ``serve_stream(protocol, handler)`` hands each inbound stream on ``protocol``, as
a :class:`p2p.bytestream.ByteStream`, to ``handler(peer_id, stream)``, and ``open_stream``
opens one to a peer over a connection already held (:mod:`p2p.libp2p_stream`); the HTTP lane
runs over them for nodes that cannot accept TCP (behind a NAT).

With ``HostConfig.circuits`` set, the host also speaks circuit relay v2 and DCUtR
(:mod:`p2p.circuits`, ``P2PNode.circuits``): reservations, relayed dials, hole punching.

Every inbound stream passes :mod:`p2p.boundary` first: per-peer and global stream caps
(:mod:`p2p.limits`), a short deadline for a request body, and fault isolation — a malformed
frame resets its stream and charges the sender, never ends the node. Gossip topics are
subscribed with an application check that runs before a message is delivered or forwarded.

Liveness (:mod:`p2p.keepalive` decides, this module acts): every connected peer is pinged
(libp2p ping) every ``keepalive.ping_interval_s``; consecutive failed pings or timed-out
requests make a connection dead, and it is aborted (RST, the send queue dropped: see
:mod:`p2p.sockopts`) so the peer counts as disconnected. A peer dialled with
``connect(addr, keep=True)`` (the trainer, upstreams, bootstrap relays) is re-dialled with
backoff whenever it is lost; losing every such peer is logged once at WARNING. Every
connection's socket gets TCP keepalive and ``TCP_USER_TIMEOUT``. Closing the node closes
connections gracefully for ``keepalive.close_timeout_s``, then aborts the sockets still open,
so shutdown is prompt even when a connection's send buffer is full.

Only this package imports libp2p.
"""

from __future__ import annotations

import logging
import math
import random
import time
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager, nullcontext
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import multiaddr
import trio
from libp2p import new_host
from libp2p.custom_types import TProtocol
from libp2p.exceptions import BaseLibp2pError
from libp2p.host.ping import ID as PING_PROTOCOL
from libp2p.host.ping import perform_ping_roundtrip
from libp2p.peer.id import ID
from libp2p.peer.peerinfo import info_from_p2p_addr
from libp2p.peer.peerstore import issue_and_cache_local_record
from libp2p.tools.anyio_service import background_trio_service

from p2p import sockopts
from p2p.addresses import (
    advertised_multiaddrs,
    check_multiaddr_text,
    check_public_host,
    ensure_listen_bindable,
    interface_addresses,
)
from p2p.boundary import (
    GossipCheck,
    GuardedPubsub,
    InboundGuard,
    check_library,
    reset_quietly,
    stream_peer,
    topic_validator,
)
from p2p.bytestream import ByteStream, StreamHandler
from p2p.circuits import CircuitConfig, Circuits, is_relayed
from p2p.connections import (
    ConnectionWatch,
    abort_connections,
    close_host,
    disable_auto_connect,
    remote_endpoint,
    socket_of,
)
from p2p.errors import (
    ConfigError,
    MessageTooLarge,
    PeerIdMismatch,
    PeerUnreachable,
    ShardnetError,
    StreamBroken,
    short_id,
)
from p2p.gossip import DirectPeering, GossipConfig, Subscription, make_router, prepare_subscription
from p2p.identity import Identity
from p2p.keepalive import Keepalive, KeepaliveConfig, KeepaliveStats, Outcome, Verdict
from p2p.libp2p_stream import Libp2pByteStream, open_lane_stream
from p2p.library_logs import MISMATCH_LOG_INTERVAL_S, install_library_filters, is_handshake_failure
from p2p.limits import (
    ANY_STREAM,
    BoundaryStats,
    LedgerConfig,
    PeerLedger,
    ResourceLimits,
    ResourceManager,
    ScopeLimit,
)
from p2p.loop_lag import BodyDeadlines, LoopLag
from p2p.peer_records import RecordConflicts, refresh_every, watch_records
from p2p.requests import Handler, RequestStreams

if TYPE_CHECKING:
    from libp2p.pubsub.gossipsub import GossipSub
    from trio_typing import TaskStatus

log = logging.getLogger(__name__)

install_library_filters()

#: how often the node's event loop is sampled for lateness (:class:`p2p.loop_lag.LoopLag`), s
LAG_TICK_S = 0.1
#: a wake-up at least this late (s) is logged as ``event_loop_late`` (INFO), at most once per
#: ``LAG_LOG_INTERVAL_S``
LAG_LOG_S = 1.0
LAG_LOG_INTERVAL_S = 10.0
#: a request body may take this many times ``request_read_timeout_s`` of wall time when the
#: node's own loop was late (:class:`p2p.loop_lag.BodyDeadlines`)
BODY_WALL_FACTOR = 3.0


@dataclass(frozen=True)
class HostConfig:
    """Configuration of the libp2p host.

    Attributes:
        listen_multiaddrs: where to listen, e.g. ``/ip4/127.0.0.1/tcp/0`` (port 0 = ephemeral).
        announce_multiaddrs: what to advertise instead of the listen addresses (see
            :mod:`p2p.addresses`); empty: the listen addresses, unspecified ones expanded.
        public_host: advertise every listen port on this host name/address instead.
        dial_timeout_s: bound on connecting to one peer, seconds.
        gossip: gossipsub settings.
        limits: per-peer and global inbound stream caps, request read deadline.
        ledger: misbehaviour scores and bans of remote peers.
        keepalive: pings, dead connections, re-dials, close timeout (:mod:`p2p.keepalive`).
        circuits: circuit relay v2 and DCUtR (:mod:`p2p.circuits`); None: neither.
        record_refresh_s: this node's signed peer record is re-issued this often, seconds
            (> 0; see :mod:`p2p.peer_records`: after a node with the same key left, the
            others hear this one again within this long).
    """

    listen_multiaddrs: tuple[str, ...] = ("/ip4/127.0.0.1/tcp/0",)
    announce_multiaddrs: tuple[str, ...] = ()
    public_host: str | None = None
    dial_timeout_s: float = 10.0
    gossip: GossipConfig = field(default_factory=GossipConfig)
    limits: ResourceLimits = field(default_factory=ResourceLimits)
    ledger: LedgerConfig = field(default_factory=LedgerConfig)
    keepalive: KeepaliveConfig = field(default_factory=KeepaliveConfig)
    circuits: CircuitConfig | None = None
    record_refresh_s: float = 30.0

    def __post_init__(self) -> None:
        if not self.listen_multiaddrs:
            raise ConfigError("listen_multiaddrs", "at least one address is needed")
        for a in self.listen_multiaddrs:
            parse_multiaddr(a, "listen_multiaddrs")
        for a in self.announce_multiaddrs:
            check_multiaddr_text(a, "announce_multiaddrs")
        if self.public_host is not None:
            check_public_host(self.public_host, "public_host")
        if self.dial_timeout_s <= 0:
            raise ConfigError("dial_timeout_s", "must be > 0")
        if not self.record_refresh_s > 0:
            raise ConfigError("record_refresh_s", "must be > 0")


def parse_multiaddr(text: str, field_name: str = "multiaddr") -> multiaddr.Multiaddr:
    """Parse a multiaddr string.

    Raises:
        ConfigError: not a valid multiaddr.
    """
    try:
        return multiaddr.Multiaddr(text)
    except Exception as exc:  # multiaddr raises several unrelated types
        raise ConfigError(field_name, f"invalid multiaddr {text!r}: {exc}") from exc


def peer_id_of(addr: str) -> str:
    """Return the PeerID in the ``/p2p/<id>`` part of a multiaddr string.

    Raises:
        ConfigError: no ``/p2p/`` component or not a multiaddr.
    """
    try:
        return str(info_from_p2p_addr(parse_multiaddr(addr)).peer_id.to_base58())
    except ConfigError:
        raise
    except Exception as exc:
        raise ConfigError("multiaddr", f"{addr!r} has no /p2p/<PeerID> part: {exc}") from exc


@dataclass(frozen=True)
class _HostParts:
    """The pieces of a libp2p host, built and wired but not started (see :meth:`build`)."""

    host: Any
    listen: list[multiaddr.Multiaddr]
    guard: InboundGuard
    router: GossipSub
    peering: DirectPeering
    watch: ConnectionWatch
    pubsub: GuardedPubsub
    circuits: Circuits | None
    record_conflicts: RecordConflicts

    @classmethod
    def build(cls, identity: Identity, config: HostConfig) -> _HostParts:
        """Check the library and the listen addresses, make the host, and install the
        inbound guard, its stream limits, gossip and the connection notifees.

        Raises:
            ConfigError: a listen port is in use or its address is not this host's.
            LocalProtocolError: the installed libp2p is not the one :mod:`p2p.boundary` guards.
        """
        check_library()
        listen = [parse_multiaddr(a) for a in config.listen_multiaddrs]
        ensure_listen_bindable(config.listen_multiaddrs)
        host = new_host(key_pair=identity.key_pair, muxer_preference="YAMUX", listen_addrs=listen)
        disable_auto_connect(host)
        conflicts = RecordConflicts()
        watch_records(host.get_peerstore(), conflicts, time.monotonic)
        limits = config.limits
        resources = ResourceManager()
        resources.set_limit(ANY_STREAM, ScopeLimit(limits.streams_per_peer, limits.streams_total))
        guard = InboundGuard(host, resources, PeerLedger(config.ledger))
        guard.install()
        router = make_router(config.gossip)
        peering = DirectPeering(router)
        host.get_network().register_notifee(peering)
        watch = ConnectionWatch(config.keepalive.tcp_user_timeout_s)
        host.get_network().register_notifee(watch)
        pubsub = GuardedPubsub(host, router, guard, config.gossip.max_message_bytes)
        for proto in router.get_protocols():
            cap = ScopeLimit(limits.pubsub_streams_per_peer, limits.streams_total)
            resources.set_limit(str(proto), cap)
            guard.wrap_protocol(proto)
        circuits = Circuits(host, config.circuits) if config.circuits is not None else None
        return cls(host, listen, guard, router, peering, watch, pubsub, circuits, conflicts)

    def run_circuits(self, config: HostConfig) -> AbstractAsyncContextManager[Circuits | None]:
        """The circuit services while the host runs (a no-op without ``config.circuits``)."""
        if self.circuits is None:
            return nullcontext(None)
        return self.circuits.running(self.guard, config.limits.requests_per_peer)


class P2PNode:
    """A running libp2p host with request/response and gossip.

    Use :meth:`open`; the instance is only valid inside that context. Methods are safe to call
    from any task of the owning trio run.
    """

    def __init__(
        self,
        identity: Identity,
        config: HostConfig,
        parts: _HostParts,
        nursery: trio.Nursery,
    ) -> None:
        self.identity = identity
        self.config = config
        self._host: object = parts.host
        self._pubsub = parts.pubsub
        self._nursery = nursery
        self._guard = parts.guard
        self._subscriptions: dict[str, Subscription] = {}
        self._peering: DirectPeering | None = parts.peering
        self._interfaces = interface_addresses()
        self._mismatch_logged: dict[str, float] = {}  # addr -> trio time of its ERROR line
        self._loop_lag = LoopLag()
        self._bodies = BodyDeadlines(config.limits.request_read_timeout_s, BODY_WALL_FACTOR)
        self._keepalive = Keepalive(config.keepalive)
        self._requests = RequestStreams(
            parts.host,
            parts.guard,
            self._bodies,
            config.limits,
            self._observe,
            self.connected_peers,
        )
        self._rng = random.Random(identity.peer_id)  # re-dial jitter: reproducible per node
        self._keepalive_changed = trio.Event()
        self._closing = False
        self._departures_expected: str | None = None  # see expect_departures
        self._direct_changed = trio.Event()  # set at each new direct connection
        self.circuits: Circuits | None = None
        """Circuit relay v2 and DCUtR (:mod:`p2p.circuits`), when configured."""
        self.record_conflicts = parts.record_conflicts
        """Peer records refused while another one of the same PeerID was held
        (:mod:`p2p.peer_records`)."""

    def _start_loops(self) -> None:
        """Start the node's own background tasks in its nursery: the watch of inbound
        connections, the keepalive and the signed peer record's refresh."""
        self._nursery.start_soon(self._watch_loop)
        self._nursery.start_soon(self._keepalive_loop)
        self._nursery.start_soon(refresh_every, self.config.record_refresh_s, self.refresh_record)

    def refresh_record(self) -> None:
        """Re-issue and cache this node's signed peer record now, with a newer ``seq`` (the
        pubsub RPCs sent after it carry it); also done every ``config.record_refresh_s`` (see
        :mod:`p2p.peer_records`)."""
        issue_and_cache_local_record(self._host)  # type: ignore[arg-type]

    def _wake_keepalive(self) -> None:
        self._keepalive_changed.set()
        self._keepalive_changed = trio.Event()

    def _on_connected(self, peer_id: str) -> None:
        if not self._keepalive.is_connected(peer_id):
            self._keepalive.connected(peer_id, trio.current_time())
            self._wake_keepalive()

    def direct_connected(self, peer_id: str) -> None:
        """A direct connection to ``peer_id`` opened (:class:`p2p.connections.ConnectionWatch`):
        its pings start with its first one; :meth:`wait_direct` wakes."""
        self._on_connected(peer_id)
        self._direct_changed.set()
        self._direct_changed = trio.Event()

    def last_connection_closed(self, peer_id: str) -> None:
        """``peer_id``'s last connection closed (:class:`p2p.connections.ConnectionWatch`):
        its pings stop; it is re-dialled if kept."""
        self._keepalive.disconnected(peer_id, trio.current_time(), self._rng)
        if not self._closing and self._keepalive.lost_all():
            expected = self._departures_expected
            log.log(
                logging.INFO if expected else logging.WARNING,
                "all_kept_peers_lost kept=%d retrying=yes%s",
                self._keepalive.statistics().kept,
                f" expected={expected}" if expected else "",
            )
        self._wake_keepalive()

    async def _keepalive_loop(self) -> None:
        """Ping peers and re-dial kept ones when :class:`p2p.keepalive.Keepalive` says so."""
        ka = self._keepalive
        for pid in self.connected_peers():  # connected before this loop started
            self._on_connected(pid)
        while True:
            now = trio.current_time()
            for pid in ka.pings_due(now):
                self._nursery.start_soon(self._ping, pid)
            for pid, addr in ka.dials_due(now):
                self._nursery.start_soon(self._redial, pid, addr)
            wake = ka.next_wakeup()
            changed = self._keepalive_changed
            with trio.move_on_at(math.inf if wake is None else wake):
                await changed.wait()

    async def _ping(self, peer_id: str) -> None:
        """One libp2p ping of ``peer_id`` on its open connection; the outcome goes to the
        policy, and a dead verdict closes the connection."""
        timeout_s = self.config.keepalive.ping_timeout_s
        if peer_id not in self.connected_peers():
            return  # gone meanwhile (its disconnect event ends the ping); never dial here
        try:
            with trio.fail_after(timeout_s):
                stream = await self._host.new_stream(  # type: ignore[attr-defined]
                    ID.from_base58(peer_id), [PING_PROTOCOL]
                )
                try:
                    await perform_ping_roundtrip(stream)
                finally:
                    await reset_quietly(stream)
            outcome = Outcome.PONG
        except trio.TooSlowError:
            outcome = Outcome.PING_TIMEOUT
        except (
            BaseLibp2pError,  # stream and muxer errors, a failed negotiation
            OSError,
            ValueError,  # the pong did not echo the ping
            trio.BrokenResourceError,
            trio.ClosedResourceError,  # the socket was aborted meanwhile
        ) as exc:
            log.debug("ping_failed peer=%s error=%s", short_id(peer_id), exc)
            outcome = Outcome.PING_FAILED
        self._observe(peer_id, outcome)

    def _observe(self, peer_id: str, outcome: Outcome) -> None:
        verdict = self._keepalive.observe(peer_id, outcome, trio.current_time())
        if verdict is Verdict.DEAD and not self._closing:
            log.warning(
                "connection_dead peer=%s reason=%s failures=%d",
                short_id(peer_id),
                outcome.value,
                self.config.keepalive.dead_after_failures,
            )
            self._nursery.start_soon(self._close_dead, peer_id)
        self._wake_keepalive()

    async def _close_dead(self, peer_id: str) -> None:
        """Abort ``peer_id``'s connections (nothing graceful gets through a dead path), then
        let the swarm clean up; the disconnect event schedules the re-dial of a kept peer."""
        network = self._host.get_network()  # type: ignore[attr-defined]
        pid = ID.from_base58(peer_id)
        abort_connections(network, pid)
        with trio.move_on_after(self.config.keepalive.close_timeout_s):
            await network.close_peer(pid)

    async def _redial(self, peer_id: str, addr: str) -> None:
        ok = False
        try:
            await self.connect(addr)
            ok = True
            log.info("peer_redialled peer=%s addr=%s", short_id(peer_id), addr)
        except ShardnetError as exc:
            log.debug("redial_failed peer=%s error=%s", short_id(peer_id), exc)
        self._keepalive.dial_done(peer_id, ok, trio.current_time(), self._rng)
        self._wake_keepalive()

    def unsent_bytes(self, peer_id: str) -> int:
        """Bytes written to ``peer_id``'s connections that the kernel has not sent or that
        the peer has not acknowledged (``TIOCOUTQ``, summed; Linux); 0 where unknown. A
        value that only grows is the mark of a dead path."""
        total = 0
        network = self._host.get_network()  # type: ignore[attr-defined]
        for conn in network.get_connections(ID.from_base58(peer_id)):
            sock = socket_of(conn)
            if sock is not None:
                total += sockopts.unsent_bytes(sock)
        return total

    def keepalive_statistics(self) -> KeepaliveStats:
        """Pings, dead connections closed and re-dials (see :mod:`p2p.keepalive`)."""
        return self._keepalive.statistics()

    def release(self, peer_id: str) -> None:
        """Stop re-dialling ``peer_id`` (kept by :meth:`connect`); its connection stays."""
        self._keepalive.release(peer_id)

    def keep(self, addr: str) -> None:
        """Keep dialling ``addr`` (a multiaddr with ``/p2p/<PeerID>``) with the keepalive's
        backoff until it connects, and re-dial it whenever it is lost, as for a peer dialled
        with :meth:`connect`; for a peer this node must reach although its first dial failed
        (an upstream that is down when this node starts).

        Raises:
            ConfigError: ``addr`` is malformed or has no ``/p2p/`` part.
        """
        self._keepalive.keep(peer_id_of(addr), addr, trio.current_time(), self._rng)
        self._wake_keepalive()

    async def _watch_loop(self) -> None:
        """Sample the loop's lateness forever; cancel request-body reads that are overdue in
        this node's own time (see :mod:`p2p.loop_lag`); log a stall of at least
        :data:`LAG_LOG_S` (at most once per :data:`LAG_LOG_INTERVAL_S`, with the worst since)."""
        logged_at = -LAG_LOG_INTERVAL_S
        while True:
            due = trio.current_time() + LAG_TICK_S
            await trio.sleep_until(due)
            now = trio.current_time()
            lag = self._loop_lag.tick(due, now)
            if lag >= LAG_LOG_S and now - logged_at >= LAG_LOG_INTERVAL_S:
                log.info(
                    "event_loop_late lag_s=%.2f worst_10s=%.2f",
                    lag,
                    self._loop_lag.worst(now, LAG_LOG_INTERVAL_S),
                )
                logged_at = now
            for scope in self._bodies.tick(due, now):
                assert isinstance(scope, trio.CancelScope)
                scope.cancel()

    @property
    def peer_id(self) -> str:
        """This node's PeerID (base58)."""
        return self.identity.peer_id

    @property
    def loop_lag(self) -> LoopLag:
        """How late this node's event loop ran (sampled every :data:`LAG_TICK_S`)."""
        return self._loop_lag

    @classmethod
    @asynccontextmanager
    async def open(
        cls, identity: Identity, config: HostConfig, *, helper: bool = False
    ) -> AsyncIterator[P2PNode]:
        """Start the host, listen, and start gossip; stop and close everything on exit.

        ``helper``: a short-lived host that runs before the node's own (the run-card fetch at
        start): its ``host_started`` line is DEBUG, so an operator sees one host per node.

        Raises:
            ConfigError: a listen port is in use or its address is not this host's
                (``listen``), checked before anything starts.
            PeerUnreachable: cannot listen on the configured addresses.
            LocalProtocolError: the installed libp2p is not the one :mod:`p2p.boundary` guards.
        """
        parts = _HostParts.build(identity, config)
        host, listen, pubsub, router = parts.host, parts.listen, parts.pubsub, parts.router
        stop = trio.Event()
        close_s = config.keepalive.close_timeout_s

        async def service(task_status: TaskStatus[P2PNode]) -> None:
            # The host runs shielded from the caller's cancellation and is stopped explicitly:
            # py-libp2p 0.8.1 leaks connection sockets when its tasks are cancelled before
            # host.close() has run, so close() must come first, then the tasks stop.
            with trio.CancelScope(shield=True) as teardown:
                async with host.run(listen_addrs=listen):
                    try:
                        async with trio.open_nursery() as nursery:
                            async with (
                                background_trio_service(pubsub),
                                background_trio_service(router),
                                parts.run_circuits(config) as circuits,
                            ):
                                with trio.fail_after(30):
                                    await pubsub.wait_until_ready()
                                node = cls(identity, config, parts, nursery)
                                node.circuits = circuits
                                parts.watch.listener = node
                                node._start_loops()
                                log.log(
                                    logging.DEBUG if helper else logging.INFO,
                                    "host_started peer_id=%s addrs=%s",
                                    identity.peer_id,
                                    ",".join(node.multiaddrs()),
                                )
                                task_status.started(node)
                                await stop.wait()
                                node._closing = True
                                # The whole teardown is bounded: the host's services, whose
                                # exits py-libp2p does not bound, are cancelled after it.
                                teardown.deadline = trio.current_time() + 3 * close_s
                                # Connections first, while pubsub still runs: a message that
                                # arrives during shutdown must find a live pubsub manager.
                                await close_host(host, close_s)
                                nursery.cancel_scope.cancel()
                    finally:
                        await close_host(host, close_s)  # when the start failed

        try:
            async with trio.open_nursery() as outer:
                node = await outer.start(service)
                try:
                    yield node
                finally:
                    stop.set()
        except BaseExceptionGroup as group:
            # Keep the caller's exception types: the nursery above is an implementation
            # detail, so a single exception from the body or the service is re-raised as is.
            if len(group.exceptions) == 1:
                exc = group.exceptions[0]
                if isinstance(exc, OSError):
                    raise PeerUnreachable(identity.peer_id, f"cannot listen: {exc}") from exc
                raise exc from None
            raise

    def listen_multiaddrs(self) -> list[str]:
        """The bound listen addresses (ports resolved), without ``/p2p/``."""
        return [str(a).split("/p2p/")[0] for a in self._host.get_addrs()]  # type: ignore[attr-defined]

    def multiaddrs(self) -> list[str]:
        """Advertised addresses with the ``/p2p/<PeerID>`` suffix (see :mod:`p2p.addresses`).

        Never an unspecified address: a listener on ``0.0.0.0`` is advertised as this host's
        interface addresses (loopback last) unless announce addresses were configured.
        """
        adv = advertised_multiaddrs(
            self.listen_multiaddrs(),
            self.config.announce_multiaddrs,
            self._interfaces,
            self.config.public_host,
        )
        return [a if "/p2p/" in a else f"{a}/p2p/{self.peer_id}" for a in adv]

    def boundary_statistics(self) -> BoundaryStats:
        """Stream admission counters, offences and current bans (see :mod:`p2p.boundary`)."""
        self._guard.refresh_bans()
        return BoundaryStats(
            self._guard.resources.statistics(),
            self._guard.ledger.statistics(trio.current_time()),
        )

    def expect_departures(self, reason: str | None) -> None:
        """Say that kept peers may leave for ``reason`` (``"run_finished"``: the trainer
        exits after the run's end; None: no longer). Losing every kept peer is then logged
        at INFO with ``expected=<reason>`` instead of at WARNING; re-dialling goes on."""
        self._departures_expected = reason

    def on_peer_gone(self, callback: Callable[[str], None]) -> None:
        """Call ``callback(peer_id)`` (base58) whenever a remote's last connection closes.

        Runs in the libp2p notification task: the callback must not block.
        """
        assert self._peering is not None, "only valid inside P2PNode.open"
        self._peering.on_peer_gone.append(callback)

    def connected_peers(self) -> list[str]:
        """PeerIDs with an open connection."""
        return [p.to_base58() for p in self._host.get_connected_peers()]  # type: ignore[attr-defined]

    def remote_hosts(self, peer_id: str) -> list[str]:
        """The IP addresses that ``peer_id``'s open connections come from, as this node sees
        them (empty: not connected, or the transport does not say)."""
        try:
            pid = ID.from_base58(peer_id)
        except ValueError:
            return []
        out = []
        for conn in self._host.get_network().get_connections(pid):  # type: ignore[attr-defined]
            remote = remote_endpoint(conn)
            if remote is not None and remote[0] not in out:
                out.append(remote[0])
        return out

    def mesh_sizes(self) -> dict[str, int]:
        """Per joined topic, the peers this node sends the topic's messages to: its gossipsub
        mesh and its direct peers subscribed to the topic (every connection is a direct peer,
        :class:`p2p.gossip.DirectPeering`, so the mesh proper stays empty; counting it alone
        showed 0 on every node while gossip flowed). For metrics and status."""
        router = self._pubsub.router
        mesh = getattr(router, "mesh", None) or {}
        direct = set(getattr(router, "direct_peers", None) or {})
        subscribed = self._pubsub.peer_topics
        return {
            str(topic): len(set(peers) | (direct & set(subscribed.get(topic, ()))))
            for topic, peers in mesh.items()
        }

    async def connect(self, addr: str, *, keep: bool = True) -> str:
        """Dial ``addr`` (a multiaddr with ``/p2p/<PeerID>``) and return the remote PeerID.

        With ``keep`` (the default: a node dials only peers it must stay connected to), the
        peer is re-dialled at ``addr`` with backoff whenever its connection is lost or found
        dead, until :meth:`release`.

        Raises:
            ConfigError: ``addr`` is malformed.
            PeerIdMismatch: the node at ``addr`` did not prove its ``/p2p/`` PeerID (wrong
                PeerID or failed handshake); logged at ERROR once per address per
                :data:`MISMATCH_LOG_INTERVAL_S`.
            PeerUnreachable: the dial failed or took longer than ``dial_timeout_s``.
        """
        maddr = parse_multiaddr(addr)
        try:
            info = info_from_p2p_addr(maddr)
        except Exception as exc:
            raise ConfigError("multiaddr", f"{addr!r} has no /p2p/<PeerID> part") from exc
        pid = info.peer_id.to_base58()
        if pid == self.peer_id:
            raise ConfigError("multiaddr", f"{addr!r} is this node itself")
        # Callers retry with their own backoff; libp2p's negative dial cache would otherwise
        # refuse every dial to a peer for 60 s after one failed (a restarted trainer or relay
        # would stay unreachable for a minute after it came back).
        unblock = getattr(self._host.get_network(), "unblock_peer", None)  # type: ignore[attr-defined]
        if unblock is not None:
            unblock(info.peer_id)
        # Dial the address we were given, nothing else: the peerstore also holds what the
        # remote's identify reported (its *bound* addresses, e.g. 0.0.0.0), which other hosts
        # cannot dial and which libp2p would otherwise try, or try only, after a reconnect.
        self._host.get_peerstore().clear_addrs(info.peer_id)  # type: ignore[attr-defined]
        try:
            with trio.fail_after(self.config.dial_timeout_s):
                await self._host.connect(info)  # type: ignore[attr-defined]
        except trio.TooSlowError as exc:
            raise PeerUnreachable(
                pid, f"dial timed out after {self.config.dial_timeout_s}s"
            ) from exc
        except (OSError, ShardnetError) as exc:
            raise PeerUnreachable(pid, f"dial failed: {exc}") from exc
        except Exception as exc:  # libp2p raises SwarmException and friends
            if is_handshake_failure(exc):
                self._report_mismatch(addr, pid)
                raise PeerIdMismatch(
                    pid,
                    f"dial failed: peer id mismatch or handshake failure (the node at {addr} "
                    f"did not prove it is {pid})",
                ) from exc
            raise PeerUnreachable(pid, f"dial failed: {type(exc).__name__}: {exc}") from exc
        log.debug("peer_connected peer=%s", short_id(pid))
        if keep:
            self._keepalive.keep(pid, addr, trio.current_time(), self._rng)
        self._on_connected(pid)
        return pid

    def _report_mismatch(self, addr: str, pid: str) -> None:
        now = trio.current_time()
        last = self._mismatch_logged.get(addr)
        if last is not None and now - last < MISMATCH_LOG_INTERVAL_S:
            log.debug("dial_failed addr=%s expected=%s reason=peer_id_mismatch", addr, pid)
            return
        self._mismatch_logged[addr] = now
        log.error(
            "dial_failed addr=%s expected=%s reason=peer_id_mismatch_or_handshake_failure",
            addr,
            pid,
        )

    def serve(
        self,
        protocol: str,
        handler: Handler,
        *,
        max_request_bytes: int,
        max_response_bytes: int,
        timeout_s: float,
        max_concurrent: int = 64,
    ) -> None:
        """Register ``handler(peer_id, request_bytes) -> response_bytes`` on ``protocol``,
        each request and response bounded in bytes and time, inbound streams capped
        (:meth:`p2p.requests.RequestStreams.serve`)."""
        self._requests.serve(
            protocol,
            handler,
            max_request_bytes=max_request_bytes,
            max_response_bytes=max_response_bytes,
            timeout_s=timeout_s,
            max_concurrent=max_concurrent,
        )

    def serve_stream(
        self,
        protocol: str,
        handler: StreamHandler,
        *,
        max_per_peer: int = 64,
        max_concurrent: int = 256,
    ) -> None:
        """Register ``handler(peer_id, stream)`` for inbound byte streams on ``protocol``.

        Admission: at most ``max_concurrent`` streams on ``protocol`` at once, at most
        ``max_per_peer`` (and ``config.limits.streams_per_peer`` over all protocols) of one
        peer; a stream over a cap is reset at once. ``handler`` owns the stream (it reads,
        writes and closes it, and bounds its own time); an exception escaping it resets the
        stream (:mod:`p2p.boundary`).
        """
        cap = ScopeLimit(min(max_per_peer, max_concurrent), max_concurrent)
        self._guard.resources.set_limit(protocol, cap)

        async def inbound(stream: Any) -> None:
            await handler(stream_peer(stream), Libp2pByteStream(stream))

        self._host.set_stream_handler(  # type: ignore[attr-defined]
            TProtocol(protocol), self._guard.wrap(protocol, inbound)
        )

    async def open_stream(self, peer_id: str, protocol: str, timeout_s: float) -> ByteStream:
        """A new byte stream to ``peer_id`` on ``protocol``, over a connection this node
        already holds (never a new dial).

        Raises:
            PeerUnreachable: no connection to ``peer_id``, or not opened within ``timeout_s``.
            RemoteProtocolError: ``peer_id`` does not speak ``protocol``.
        """
        return await open_lane_stream(self._host, peer_id, protocol, timeout_s)

    def direct_peers(self) -> list[str]:
        """PeerIDs with an open direct (not relayed) connection: the only ones the stream
        lane may carry bulk bytes to (a relay's circuit is for coordination)."""
        if self.circuits is None:
            return self.connected_peers()
        return [p for p in self.connected_peers() if self.circuits.direct(p)]

    async def wait_direct(self, peer_id: str) -> None:
        """Return once a direct (not relayed) connection to ``peer_id`` is held (at once if one
        is). Unbounded: the caller bounds it (``trio.fail_after``); cancelling leaves nothing
        behind."""
        while peer_id not in self.direct_peers():
            await self._direct_changed.wait()

    async def reserve(self, relay_peer_id: str) -> None:
        """Hold a circuit relay reservation on ``relay_peer_id`` (a connected relay), so that
        others can reach this node through it (:meth:`p2p.circuits.Circuits.reserve`).

        Raises:
            PeerUnreachable: no circuits on this host, not connected to the relay, or it
                refused or did not answer in time.
        """
        if self.circuits is None:
            raise PeerUnreachable(relay_peer_id, "circuits are off on this host")
        await self.circuits.reserve(relay_peer_id)

    async def punch(self, peer_id: str, relay_peer_id: str) -> bool:
        """Reach ``peer_id`` through the relay ``relay_peer_id`` (this node holds a direct
        connection to it; ``peer_id`` a reservation there) and upgrade to a direct connection
        by hole punching (DCUtR). True once a direct connection to ``peer_id`` is held; on
        failure the relayed connection is closed too (its relay slot is freed). Bounded by
        ``CircuitConfig.timeout_s`` for the dial, again for the punch, and again for the
        library's own second round after a failed one.

        Raises:
            PeerUnreachable: no circuits on this host, no connection to the relay, or the
                relayed dial failed.
        """
        circuits = self.circuits
        if circuits is None:
            raise PeerUnreachable(peer_id, "circuits are off on this host")
        if circuits.direct(peer_id):
            return True
        relay_addr = self._direct_multiaddr(relay_peer_id)
        if relay_addr is None:
            raise PeerUnreachable(relay_peer_id, "no direct connection to the relay")
        await circuits.connect_via(relay_addr, peer_id)
        if not await circuits.hole_punch(peer_id):
            # py-libp2p retries a failed round by itself ("auto-driving"); on loopback the
            # second round often gets through: wait for it, bounded
            with trio.move_on_after(circuits.config.timeout_s):
                await self.wait_direct(peer_id)
        await circuits.close_relayed(peer_id)
        return circuits.direct(peer_id)

    def _direct_multiaddr(self, peer_id: str) -> str | None:
        """``/ip4|ip6/<host>/tcp/<port>/p2p/<peer_id>`` of a direct connection held to
        ``peer_id`` (its remote address as seen here), or None."""
        pid = ID.from_base58(peer_id)
        for conn in self._host.get_network().get_connections(pid):  # type: ignore[attr-defined]
            if is_relayed(conn):
                continue
            remote = remote_endpoint(conn)
            if remote is None:
                continue
            host, port = remote
            family = "ip6" if ":" in host else "ip4"
            return f"/{family}/{host}/tcp/{port}/p2p/{peer_id}"
        return None

    async def request(
        self,
        peer_id: str,
        protocol: str,
        payload: bytes,
        *,
        max_response_bytes: int,
        timeout_s: float,
    ) -> bytes:
        """Send one request on a new stream to ``peer_id`` and return the response bytes
        (:meth:`p2p.requests.RequestStreams.request`).

        Raises:
            PeerUnreachable: no connection could be opened.
            StreamBroken: the stream was reset, closed early or timed out.
            MessageTooLarge: the response exceeded ``max_response_bytes``.
            RemoteProtocolError: the peer does not speak ``protocol``.
        """
        return await self._requests.request(
            peer_id, protocol, payload, max_response_bytes=max_response_bytes, timeout_s=timeout_s
        )

    async def publish(self, topic: str, data: bytes) -> None:
        """Publish ``data`` on a gossipsub topic (best effort: gossip may drop; see p2p.gossip).

        Raises:
            MessageTooLarge: ``data`` exceeds the configured gossip message bound.
        """
        if len(data) > self.config.gossip.max_message_bytes:
            raise MessageTooLarge(self.peer_id, f"gossip message of {len(data)} bytes")
        prepare_subscription(self._pubsub, self.config.gossip)
        await self._pubsub.publish(topic, data)

    async def wait_for_subscriber(self, peer_id: str, topic: str, timeout_s: float) -> None:
        """Wait until ``peer_id`` is known to subscribe to ``topic`` (event-driven, no polling).

        Raises:
            StreamBroken: not within ``timeout_s`` seconds.
        """
        pid = ID.from_base58(peer_id)
        try:
            await self._pubsub.wait_for_peer(pid, timeout=timeout_s)
            await self._pubsub.wait_for_subscription(pid, topic, timeout=timeout_s)
        except trio.TooSlowError as exc:
            raise StreamBroken(peer_id, f"no subscription to {topic} within {timeout_s}s") from exc

    async def subscribe(self, topic: str, check: GossipCheck) -> Subscription:
        """Subscribe to ``topic``; returns a bounded subscription (one per topic per node).

        ``check(origin, data)`` validates every message on the topic before it is delivered,
        cached or forwarded to other peers; it raises a :class:`ShardnetError` to reject (the
        forwarder is charged). It must be cheap and synchronous (a decode and a signature
        check). A second subscription to the same topic returns the first (and keeps its
        check).
        """
        if topic in self._subscriptions:
            return self._subscriptions[topic]
        self._pubsub.set_topic_validator(
            topic, topic_validator(topic, check, self._guard, self._pubsub.my_id), False
        )
        sub = await Subscription.start(self._pubsub, topic, self.config.gossip, self._nursery)
        self._subscriptions[topic] = sub
        return sub
