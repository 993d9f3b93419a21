"""An in-memory network for many nodes in one trio run: hosts, gossip and the HTTP lane.

Theory of operation
-------------------
:class:`MemNetwork` is an async context manager that owns a nursery for messages in flight.
Each node gets an :class:`Endpoint` (a :class:`p2p.lanes.Network`) bound to its own loopback
address (``127.77.x.y``: never routed anywhere, so nothing leaks even by mistake). Through it
the node opens a :class:`MemHost` (the :class:`p2p.lanes.Host` protocol), a
:class:`MemHttpServer` and a :class:`MemHttpClient` (the HTTP lane protocols). Node code
cannot tell them from the real ones: the same method contracts and the same typed errors,
checked by one conformance suite (``tests/conformance/test_lanes.py``). The HTTP lane even
uses the real parsing: requests go through h11 and :func:`p2p.http_server.parse_request_head`,
responses through the real server's head builder and the checks the real client makes
(:mod:`p2p.http_checks`: request headers, status and ``Content-Range`` checks, body counts and
bounds, error counters), so the fake cannot drift from the real client.

Time is trio's clock, so under ``trio.testing.MockClock(autojump_threshold=0)`` a broadcast
to fifty nodes takes virtual seconds and no real ones. What a byte costs is set by a
:class:`LinkProfile` per node: one-way latency (plus seeded jitter) and an uplink of
``bandwidth_bytes_per_s`` shared first-come first-served by everything the node sends (a
message of ``n`` bytes occupies the uplink for ``n / bandwidth`` seconds, in chunks of at most
:data:`CHUNK_BYTES`, so concurrent transfers interleave). Chance comes from one seeded
``random.Random``.

Faults are policy of the network, never patches of node code:

- ``loss``: each gossip hop is dropped, each request stream or HTTP exchange is reset
  (``StreamBroken``) with this probability;
- :meth:`MemNetwork.partition`: nodes in different groups cannot reach each other; existing
  connections across groups are closed (peer-gone callbacks fire), dials and HTTP connects
  time out, transfers in flight break; :meth:`MemNetwork.heal` lifts it;
- a node that leaves its host's ``async with`` (killed) drops its connections and in-flight
  streams at once, as a crashed process does;
- :meth:`MemNetwork.tamper` rewrites the body bytes a node's HTTP server sends (a byzantine
  relay).

The in-memory network models the HTTP lane over TCP only: it has no stream lane
(:mod:`p2p.bytestream`). ``MemHost.serve_stream`` registers nothing that a stream could reach,
``MemHost.open_stream`` and a ``p2p://`` URL raise ``PeerUnreachable``, and
``MemHttpServer.serve_stream`` closes the stream; a simulated node that would need one serves
nothing through its NAT, as before the stream lane existed.

Gossip floods every connected subscriber (as :class:`p2p.gossip.DirectPeering` makes the real
router do), runs the subscriber's check before delivery and forwarding, and suppresses
duplicates with a bounded seen-cache per node. Everything a node holds is bounded: the
seen-cache, the subscription queue (the real :class:`p2p.gossip.Subscription`), and the
handler tasks (``max_concurrent`` per protocol).
"""

from __future__ import annotations

import logging
import math
import random
import re
from collections import Counter, OrderedDict
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Mapping, Sequence
from contextlib import aclosing, asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import h11
import trio

from p2p import http_checks
from p2p.bytestream import ByteStream, StreamHandler, StreamOpener
from p2p.errors import (
    ClosedMidBody,
    ConfigError,
    LocalProtocolError,
    MessageTooLarge,
    PeerUnreachable,
    RemoteProtocolError,
    ShardnetError,
    StreamBroken,
    short_id,
)
from p2p.gossip import GossipMessage, Subscription
from p2p.host import HostConfig
from p2p.http_range import ByteRange, format_range
from p2p.http_server import (
    BadRequest,
    FileSlice,
    HttpResponse,
    HttpServerConfig,
    HttpServerStatistics,
    ServerError,
    StreamedBody,
    _to_h11_response,
    parse_request_head,
)
from p2p.identity import Identity
from p2p.keepalive import KeepaliveStats
from p2p.lanes import GossipCheck, HttpHandler, RequestHandler, RequestSigner
from p2p.limits import BoundaryStats, LedgerStats
from p2p.loop_lag import LoopLag

__all__ = ["CHUNK_BYTES", "SEEN_CAP", "Endpoint", "LinkProfile", "MemHost", "MemNetwork", "Tamper"]

log = logging.getLogger(__name__)

CHUNK_BYTES = 256 * 1024
"""Largest piece one transfer occupies the uplink with before others get a turn (bytes)."""
_FRAME_OVERHEAD = 64
SEEN_CAP = 4096
_MULTIADDR = re.compile(r"^/ip4/([0-9.]+)/tcp/(\d+)/p2p/(\w+)$")

Tamper = Callable[[str, bytes], bytes]
"""``tamper(path, body) -> body``: what a byzantine HTTP server sends instead."""


@dataclass(frozen=True)
class LinkProfile:
    """The cost and reliability of what one node sends.

    Attributes:
        latency_s: one-way delay added to every message, seconds.
        jitter_s: up to this much more, drawn uniformly from the network's RNG, seconds.
        bandwidth_bytes_per_s: the node's uplink, shared by all it sends.
        loss: probability a gossip hop is dropped or a stream/HTTP exchange is reset.
    """

    latency_s: float = 0.005
    jitter_s: float = 0.0
    bandwidth_bytes_per_s: float = 100e6
    loss: float = 0.0

    def __post_init__(self) -> None:
        if self.latency_s < 0 or self.jitter_s < 0:
            raise ConfigError("latency_s", "must be >= 0")
        if not self.bandwidth_bytes_per_s > 0:
            raise ConfigError("bandwidth_bytes_per_s", "must be > 0")
        if not 0 <= self.loss < 1:
            raise ConfigError("loss", "must be in [0, 1)")


class _Cut(Exception):
    """Internal: the bytes did not arrive (partition, dead endpoint or loss)."""


@dataclass
class _NetStats:
    messages: int = 0
    bytes: int = 0
    dropped: int = 0


@dataclass(frozen=True)
class MemNetStatistics:
    """Network-wide counters: messages carried, payload bytes, messages lost."""

    messages: int
    bytes: int
    dropped: int


class MemNetwork:
    """The in-memory network (see module docstring). Use ``async with MemNetwork(rng):``.

    Args:
        rng: the only source of chance (jitter, loss).
        profile: the default :class:`LinkProfile` of every node.
    """

    def __init__(self, rng: random.Random, profile: LinkProfile | None = None) -> None:
        self.rng = rng
        self.default_profile = profile or LinkProfile()
        self._profiles: dict[str, LinkProfile] = {}
        self._hosts: dict[str, MemHost] = {}
        self._http: dict[tuple[str, int], MemHttpServer] = {}
        self._groups: dict[str, int] | None = None
        self._uplink_free_at: dict[str, float] = {}
        self._tamper: dict[str, Tamper] = {}
        self._next_port: Counter[str] = Counter()
        self._changed = trio.Event()
        self._stats = _NetStats()
        self._nursery: trio.Nursery | None = None
        self._endpoints = 0
        self._in_flight = 0  # spawned deliveries not finished
        self._quiet = trio.Event()

    async def __aenter__(self) -> MemNetwork:
        self._cm = trio.open_nursery()
        self._nursery = await self._cm.__aenter__()
        return self

    async def __aexit__(self, *exc: object) -> bool | None:
        assert self._nursery is not None
        self._nursery.cancel_scope.cancel()
        return await self._cm.__aexit__(*exc)  # type: ignore[arg-type]

    # -- topology and policy ------------------------------------------------------------------

    def endpoint(self, ip: str | None = None, profile: LinkProfile | None = None) -> Endpoint:
        """A new node's view of the network, on ``ip`` (default: the next ``127.77.x.y``)."""
        if ip is None:
            self._endpoints += 1
            n = self._endpoints
            ip = f"127.77.{n // 250}.{n % 250 + 1}"
        if profile is not None:
            self._profiles[ip] = profile
        return Endpoint(self, ip)

    def set_profile(self, ip: str, profile: LinkProfile) -> None:
        """Change what sending from ``ip`` costs (applies to messages sent from now on)."""
        self._profiles[ip] = profile

    def profile(self, ip: str) -> LinkProfile:
        """The link profile of ``ip``."""
        return self._profiles.get(ip, self.default_profile)

    def partition(self, *groups: Sequence[str]) -> None:
        """Split the network: addresses in different groups cannot reach each other; an
        address in no group is alone. Connections across groups close now."""
        self._groups = {ip: i for i, group in enumerate(groups) for ip in group}
        for host in list(self._hosts.values()):
            for pid in sorted(host._conns):
                other = self._hosts.get(pid)
                if other is not None and not self.reachable(host.ip, other.ip):
                    host._drop(pid)
                    other._drop(host.peer_id)
        self._notify()

    def heal(self) -> None:
        """Lift the partition (connections do not come back by themselves)."""
        self._groups = None
        self._notify()

    def reachable(self, a: str, b: str) -> bool:
        """Whether ``a`` and ``b`` are on the same side of the partition."""
        if self._groups is None or a == b:
            return True
        ga, gb = self._groups.get(a), self._groups.get(b)
        return ga is not None and ga == gb

    def tamper(self, ip: str, fn: Tamper | None) -> None:
        """Make the HTTP server on ``ip`` send ``fn(path, body)`` instead of ``body``."""
        if fn is None:
            self._tamper.pop(ip, None)
        else:
            self._tamper[ip] = fn

    def statistics(self) -> MemNetStatistics:
        """Messages and bytes carried, messages lost."""
        s = self._stats
        return MemNetStatistics(s.messages, s.bytes, s.dropped)

    def host(self, peer_id: str) -> MemHost | None:
        """The live host of ``peer_id``, if any."""
        return self._hosts.get(peer_id)

    # -- carrying bytes -----------------------------------------------------------------------

    def _notify(self) -> None:
        self._changed.set()
        self._changed = trio.Event()

    def _lost(self, src: str) -> bool:
        loss = self.profile(src).loss
        return loss > 0 and self.rng.random() < loss

    async def _carry(self, src: str, dst: str, nbytes: int, alive: Callable[[], bool]) -> None:
        """Move ``nbytes`` from ``src`` to ``dst``: uplink time, then latency.

        Raises:
            _Cut: partitioned before or during the transfer, or ``alive()`` turned false.
        """
        remaining = max(nbytes, 1)
        prof = self.profile(src)
        while True:
            if not self.reachable(src, dst) or not alive():
                self._stats.dropped += 1
                raise _Cut
            piece = min(remaining, CHUNK_BYTES)
            now = trio.current_time()
            start = max(now, self._uplink_free_at.get(src, now))
            done = start + piece / prof.bandwidth_bytes_per_s
            self._uplink_free_at[src] = done
            await trio.sleep_until(done)
            remaining -= piece
            if remaining <= 0:
                break
        delay = prof.latency_s + (self.rng.random() * prof.jitter_s if prof.jitter_s else 0.0)
        await trio.sleep(delay)
        if not self.reachable(src, dst) or not alive():
            self._stats.dropped += 1
            raise _Cut
        self._stats.messages += 1
        self._stats.bytes += nbytes

    def _spawn(self, fn: Callable[..., Any], *args: Any) -> None:
        assert self._nursery is not None, "use MemNetwork inside `async with`"
        self._in_flight += 1

        async def deliver() -> None:
            try:
                await fn(*args)
            finally:
                self._in_flight -= 1
                if not self._in_flight:
                    self._quiet.set()
                    self._quiet = trio.Event()

        self._nursery.start_soon(deliver)

    async def wait_quiet(self) -> None:
        """Wait until no gossip message is in flight: every hop sent has arrived (and been
        checked, delivered or suppressed as a duplicate) or was lost, and so have the hops its
        forwarding sent. Returns at once if none is. A test's way to see that something did
        *not* happen (a duplicate delivered) without sleeping."""
        while self._in_flight:
            await self._quiet.wait()


class Endpoint:
    """One node's :class:`p2p.lanes.Network` on the in-memory network, at address ``ip``."""

    def __init__(self, net: MemNetwork, ip: str) -> None:
        self.net = net
        self.ip = ip

    def _port(self, wanted: int, first: int) -> int:
        if wanted:
            return wanted
        self.net._next_port[f"{self.ip}/{first}"] += 1
        return first + self.net._next_port[f"{self.ip}/{first}"] - 1

    @asynccontextmanager
    async def open_host(self, identity: Identity, config: HostConfig) -> AsyncIterator[MemHost]:
        """A :class:`MemHost` for ``identity``; killed (connections dropped) on exit.

        Raises:
            ConfigError: a live host already has this identity or this address.
        """
        net = self.net
        if identity.peer_id in net._hosts:
            raise ConfigError("listen", f"{short_id(identity.peer_id)} is already running")
        if any(h.ip == self.ip for h in net._hosts.values()):
            raise ConfigError("listen", f"{self.ip} already has a host")
        m = re.search(r"/tcp/(\d+)", config.listen_multiaddrs[0])
        port = self._port(int(m.group(1)) if m else 0, 4001)
        async with trio.open_nursery() as nursery:
            host = MemHost(net, identity, config, self.ip, port, nursery)
            net._hosts[identity.peer_id] = host
            net._notify()
            try:
                yield host
            finally:
                host._die()
                nursery.cancel_scope.cancel()

    @asynccontextmanager
    async def open_http_server(
        self, handler: HttpHandler, config: HttpServerConfig
    ) -> AsyncIterator[MemHttpServer]:
        """A :class:`MemHttpServer` on this endpoint's address (``config.host`` should be the
        endpoint's ``ip``: nodes advertise the URL built from it).

        Raises:
            OSError: the port is taken on this address.
        """
        net = self.net
        port = self._port(config.port, 8001)
        if (self.ip, port) in net._http:
            raise OSError(98, f"address {self.ip}:{port} in use")
        async with trio.open_nursery() as nursery:
            server = MemHttpServer(net, self.ip, port, handler, config, nursery)
            net._http[(self.ip, port)] = server
            try:
                yield server
            finally:
                server.alive = False
                del net._http[(self.ip, port)]
                nursery.cancel_scope.cancel()

    @asynccontextmanager
    async def open_http_client(
        self,
        *,
        headers: Mapping[str, str] | None = None,
        sign: RequestSigner | None = None,
        open_stream: StreamOpener | None = None,
    ) -> AsyncIterator[MemHttpClient]:
        """A :class:`MemHttpClient` sending from this endpoint's address (``open_stream`` is
        ignored: no stream lane here)."""
        client = MemHttpClient(self.net, self.ip, headers or {}, sign)
        try:
            yield client
        finally:
            client.alive = False


# -- host -------------------------------------------------------------------------------------


@dataclass
class _Served:
    handler: RequestHandler
    max_request_bytes: int
    max_response_bytes: int
    timeout_s: float
    slots: trio.Semaphore


@dataclass
class _Topic:
    sub: Subscription
    check: GossipCheck
    refused: int = 0


@dataclass
class _Box:
    value: bytes | None = None
    error: str = "reset"
    done: trio.Event = field(default_factory=trio.Event)


class MemHost:
    """A host on the in-memory network (the :class:`p2p.lanes.Host` protocol); only valid
    inside :meth:`Endpoint.open_host`."""

    def __init__(
        self,
        net: MemNetwork,
        identity: Identity,
        config: HostConfig,
        ip: str,
        port: int,
        nursery: trio.Nursery,
    ) -> None:
        self.net = net
        self.identity = identity
        self.config = config
        self.ip = ip
        self.port = port
        self.alive = True
        self._nursery = nursery
        self._conns: set[str] = set()
        self._served: dict[str, _Served] = {}
        self._topics: dict[str, _Topic] = {}
        self._seen: OrderedDict[tuple[str, int], None] = OrderedDict()
        self._seq = 0
        self._gone: list[Callable[[str], None]] = []
        self.departures_expected: str | None = None  # see expect_departures
        self.kept: set[str] = set()  # addresses given to keep
        self._loop_lag = LoopLag()

    # -- identity and addresses

    @property
    def peer_id(self) -> str:
        """This node's PeerID (base58)."""
        return self.identity.peer_id

    def listen_multiaddrs(self) -> list[str]:
        """``/ip4/<ip>/tcp/<port>``."""
        return [f"/ip4/{self.ip}/tcp/{self.port}"]

    def multiaddrs(self) -> list[str]:
        """``/ip4/<ip>/tcp/<port>/p2p/<PeerID>``."""
        return [f"{a}/p2p/{self.peer_id}" for a in self.listen_multiaddrs()]

    def connected_peers(self) -> list[str]:
        """PeerIDs with an open connection (sorted: deterministic)."""
        return sorted(self._conns)

    def remote_hosts(self, peer_id: str) -> list[str]:
        """The in-memory address of ``peer_id`` if connected (empty otherwise)."""
        other = self.net.host(peer_id) if peer_id in self._conns else None
        return [other.ip] if other is not None else []

    @property
    def loop_lag(self) -> LoopLag:
        """Always zero: the in-memory network has no libp2p stack whose reads could be late
        (its requests have no body deadline)."""
        return self._loop_lag

    def boundary_statistics(self) -> BoundaryStats:
        """Nothing is admitted or charged on the in-memory network: empty counters."""
        return BoundaryStats({}, LedgerStats({}, ()))

    def keepalive_statistics(self) -> KeepaliveStats:
        """The in-memory network's connections never die silently: zero counters."""
        return KeepaliveStats(0, {}, {}, 0, 0, 0, 0, 0)

    def mesh_sizes(self) -> dict[str, int]:
        """Connected subscribers per joined topic (every connection is a direct peer)."""
        out = {}
        for topic in self._topics:
            out[topic] = sum(
                1
                for pid in self._conns
                if (h := self.net._hosts.get(pid)) is not None and topic in h._topics
            )
        return out

    def on_peer_gone(self, callback: Callable[[str], None]) -> None:
        """Call ``callback(peer_id)`` when a connection closes (synchronously; must not block)."""
        self._gone.append(callback)

    def expect_departures(self, reason: str | None) -> None:
        """Recorded only (:attr:`departures_expected`): the in-memory host keeps no peers."""
        self.departures_expected = reason

    def keep(self, addr: str) -> None:
        """Recorded only (:attr:`kept`): the in-memory host re-dials nothing; callers that
        must reach a peer retry on their own schedule (the follower's upstream polls)."""
        if _MULTIADDR.match(addr) is None:
            raise ConfigError("multiaddr", f"{addr!r} is not /ip4/<ip>/tcp/<port>/p2p/<id>")
        self.kept.add(addr)

    # -- connections

    async def connect(self, addr: str) -> str:
        """Dial ``/ip4/<ip>/tcp/<port>/p2p/<PeerID>``; one round trip when reachable.

        Raises:
            ConfigError: malformed address or this node itself.
            PeerUnreachable: nothing listens there (one round trip), it is another node, or
                it is across a partition (after ``dial_timeout_s``).
        """
        m = _MULTIADDR.match(addr)
        if m is None:
            raise ConfigError("multiaddr", f"{addr!r} is not /ip4/<ip>/tcp/<port>/p2p/<id>")
        ip, port, pid = m.group(1), int(m.group(2)), m.group(3)
        if pid == self.peer_id:
            raise ConfigError("multiaddr", f"{addr!r} is this node itself")
        if pid in self._conns:
            return pid
        net = self.net
        if not net.reachable(self.ip, ip):
            await trio.sleep(self.config.dial_timeout_s)
            raise PeerUnreachable(pid, f"dial timed out after {self.config.dial_timeout_s}s")
        await trio.sleep(2 * net.profile(self.ip).latency_s)
        other = net._hosts.get(pid)
        if other is None or other.ip != ip or other.port != port or not self.alive:
            raise PeerUnreachable(pid, "dial failed: connection refused")
        if not net.reachable(self.ip, ip):
            raise PeerUnreachable(pid, "dial failed: partitioned")
        self._conns.add(pid)
        other._conns.add(self.peer_id)
        net._notify()
        return pid

    def _drop(self, pid: str) -> None:
        if pid in self._conns:
            self._conns.discard(pid)
            for cb in self._gone:
                cb(pid)

    def _die(self) -> None:
        self.alive = False
        for pid in sorted(self._conns):
            other = self.net._hosts.get(pid)
            if other is not None:
                other._drop(self.peer_id)
        self._conns.clear()
        if self.net._hosts.get(self.peer_id) is self:
            del self.net._hosts[self.peer_id]
        self.net._notify()

    def _live(self) -> bool:
        return self.alive

    # -- request/response

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
        """Register ``handler(peer_id, request) -> response`` on ``protocol`` (see
        :meth:`p2p.host.P2PNode.serve`: over ``max_concurrent``, a too large request, a
        handler's ShardnetError or timeout all reset the stream)."""
        self._served[protocol] = _Served(
            handler,
            max_request_bytes,
            max_response_bytes,
            timeout_s,
            trio.Semaphore(max_concurrent),
        )

    def serve_stream(
        self,
        protocol: str,
        handler: StreamHandler,
        *,
        max_per_peer: int = 64,
        max_concurrent: int = 256,
    ) -> None:
        """Accepted and unused: the in-memory network carries no byte streams."""

    async def open_stream(self, peer_id: str, protocol: str, timeout_s: float) -> ByteStream:
        """Raises PeerUnreachable: the in-memory network carries no byte streams."""
        raise PeerUnreachable(peer_id, "no byte streams on the in-memory network")

    def direct_peers(self) -> list[str]:
        """Every connection is direct here: :meth:`connected_peers`."""
        return self.connected_peers()

    async def reserve(self, relay_peer_id: str) -> None:
        """Raises PeerUnreachable: the in-memory network has no circuits."""
        raise PeerUnreachable(relay_peer_id, "no circuits on the in-memory network")

    async def punch(self, peer_id: str, relay_peer_id: str) -> bool:
        """Raises PeerUnreachable: the in-memory network has no circuits."""
        raise PeerUnreachable(peer_id, "no circuits on the in-memory network")

    async def request(
        self,
        peer_id: str,
        protocol: str,
        payload: bytes,
        *,
        max_response_bytes: int,
        timeout_s: float,
    ) -> bytes:
        """One request to a connected peer (see :meth:`p2p.lanes.Host.request`)."""
        net = self.net
        other = net._hosts.get(peer_id)
        if peer_id not in self._conns or other is None:
            raise PeerUnreachable(peer_id, f"{protocol}: no connection")
        if net._lost(self.ip):
            await trio.sleep(net.profile(self.ip).latency_s)
            raise StreamBroken(peer_id, f"{protocol}: stream reset (loss)")
        try:
            with trio.fail_after(timeout_s):
                await net._carry(self.ip, other.ip, len(payload) + _FRAME_OVERHEAD, other._live)
                box = other._accept(self.peer_id, protocol, payload)
                await box.done.wait()
                if box.value is None:
                    if box.error == "unsupported":
                        raise RemoteProtocolError(peer_id, f"does not speak {protocol}")
                    raise StreamBroken(peer_id, f"{protocol}: stream {box.error}")
                await net._carry(other.ip, self.ip, len(box.value) + _FRAME_OVERHEAD, self._live)
        except trio.TooSlowError as exc:
            raise StreamBroken(peer_id, f"{protocol} timed out after {timeout_s}s") from exc
        except _Cut as exc:
            raise StreamBroken(peer_id, f"{protocol}: connection lost") from exc
        if len(box.value) > max_response_bytes:
            raise MessageTooLarge(peer_id, f"{protocol} response over {max_response_bytes} bytes")
        return box.value

    def _accept(self, sender: str, protocol: str, payload: bytes) -> _Box:
        box = _Box()
        served = self._served.get(protocol)
        if not self.alive:
            box.done.set()
        elif served is None:
            box.error = "unsupported"
            box.done.set()
        elif len(payload) > served.max_request_bytes or served.slots.value == 0:
            box.done.set()
        else:
            self._nursery.start_soon(self._run_handler, served, sender, protocol, payload, box)
        return box

    async def _run_handler(
        self, served: _Served, sender: str, protocol: str, payload: bytes, box: _Box
    ) -> None:
        try:
            async with served.slots:
                with trio.move_on_after(served.timeout_s):
                    response = await served.handler(sender, payload)
                    if len(response) > served.max_response_bytes:
                        raise LocalProtocolError(f"{protocol} response over the bound")
                    box.value = response
        except ShardnetError as exc:
            log.debug(
                "request_refused protocol=%s peer=%s error=%s", protocol, short_id(sender), exc
            )
        finally:
            box.done.set()

    # -- gossip

    async def publish(self, topic: str, data: bytes) -> None:
        """Flood ``data`` to connected subscribers of ``topic`` (best effort).

        Raises:
            MessageTooLarge: over ``config.gossip.max_message_bytes``.
        """
        if len(data) > self.config.gossip.max_message_bytes:
            raise MessageTooLarge(self.peer_id, f"gossip message of {len(data)} bytes")
        self._seq += 1
        msg_id = (self.peer_id, self._seq)
        self._remember(msg_id)
        self._forward(topic, self.peer_id, data, msg_id, exclude=None)
        await trio.lowlevel.checkpoint()

    def _remember(self, msg_id: tuple[str, int]) -> bool:
        if msg_id in self._seen:
            return False
        self._seen[msg_id] = None
        if len(self._seen) > SEEN_CAP:
            self._seen.popitem(last=False)
        return True

    def _forward(
        self, topic: str, origin: str, data: bytes, msg_id: tuple[str, int], exclude: str | None
    ) -> None:
        for pid in sorted(self._conns):
            other = self.net._hosts.get(pid)
            if pid in (exclude, origin) or other is None or topic not in other._topics:
                continue
            self.net._spawn(self._hop, other, topic, origin, data, msg_id)

    async def _hop(
        self, other: MemHost, topic: str, origin: str, data: bytes, msg_id: tuple[str, int]
    ) -> None:
        if self.net._lost(self.ip):
            self.net._stats.dropped += 1
            return
        try:
            await self.net._carry(self.ip, other.ip, len(data) + _FRAME_OVERHEAD, other._live)
        except _Cut:
            return
        other._gossip_in(self.peer_id, topic, origin, data, msg_id)

    def _gossip_in(
        self, forwarder: str, topic: str, origin: str, data: bytes, msg_id: tuple[str, int]
    ) -> None:
        joined = self._topics.get(topic)
        if not self.alive or forwarder not in self._conns or joined is None:
            return
        if not self._remember(msg_id):
            return
        if len(data) > self.config.gossip.max_message_bytes:
            joined.refused += 1
            return
        try:
            joined.check(origin, data)
        except ShardnetError as exc:
            joined.refused += 1
            log.debug("gossip_refused topic=%s from=%s error=%s", topic, short_id(forwarder), exc)
            return
        joined.sub._push(GossipMessage(origin=origin, data=data))
        self._forward(topic, origin, data, msg_id, exclude=forwarder)

    async def subscribe(self, topic: str, check: GossipCheck) -> Subscription:
        """Join ``topic`` with a validator; a second call returns the first subscription."""
        if topic not in self._topics:
            self._topics[topic] = _Topic(Subscription(topic, self.config.gossip), check)
            self.net._notify()
        await trio.lowlevel.checkpoint()
        return self._topics[topic].sub

    async def wait_for_subscriber(self, peer_id: str, topic: str, timeout_s: float) -> None:
        """Wait until ``peer_id`` is connected and subscribed to ``topic``.

        Raises:
            StreamBroken: not within ``timeout_s``.
        """
        with trio.move_on_after(timeout_s):
            while True:
                other = self.net._hosts.get(peer_id)
                if peer_id in self._conns and other is not None and topic in other._topics:
                    return
                await self.net._changed.wait()
        raise StreamBroken(peer_id, f"no subscription to {topic} within {timeout_s}s")

    def gossip_refused(self) -> dict[str, int]:
        """Gossip messages refused by this node's checks, per topic."""
        return {t: j.refused for t, j in self._topics.items()}


# -- HTTP lane ----------------------------------------------------------------------------------


class MemHttpServer:
    """An HTTP lane server on the in-memory network (the :class:`p2p.lanes.HttpLaneServer`
    protocol). Runs the handler in its own nursery under ``handler_timeout_s`` (then ``503``
    with ``Retry-After``; an exception is ``500``), as the real server does."""

    def __init__(
        self,
        net: MemNetwork,
        ip: str,
        port: int,
        handler: HttpHandler,
        config: HttpServerConfig,
        nursery: trio.Nursery,
    ) -> None:
        self.net = net
        self.ip = ip
        self._port = port
        self._handler = handler
        self._config = config
        self._nursery = nursery
        self.alive = True
        self._bytes_sent = 0
        self._requests = 0
        self._open = 0
        self._total = 0
        self._errors: Counter[ServerError] = Counter()

    @property
    def port(self) -> int:
        """The port this server is registered on."""
        return self._port

    @property
    def url(self) -> str:
        """``http://<ip>:<port>``."""
        return f"http://{self.ip}:{self._port}"

    def statistics(self) -> HttpServerStatistics:
        """Counters, as :meth:`p2p.http_server.HttpServer.statistics`."""
        return HttpServerStatistics(
            self._bytes_sent, self._requests, self._open, self._total, dict(self._errors)
        )

    def _live(self) -> bool:
        return self.alive

    async def serve_stream(self, peer_id: str, stream: ByteStream) -> None:
        """No stream lane in memory: ``stream`` is closed at once."""
        await stream.aclose()

    async def _respond(self, head: bytes, client: str) -> HttpResponse:
        """Parse the request head as the real server does and run the handler."""
        try:
            request = parse_request_head(
                head, max_header_bytes=self._config.max_header_bytes, peer=client
            )
        except BadRequest as exc:
            self._errors[ServerError.BAD_REQUEST] += 1
            return HttpResponse(exc.status)
        if request is None:
            self._errors[ServerError.BAD_REQUEST] += 1
            return HttpResponse(400)
        if request.method not in ("GET", "HEAD"):
            return HttpResponse(405, [("allow", "GET, HEAD")])
        result: list[HttpResponse] = []
        done = trio.Event()

        async def run() -> None:
            try:
                with trio.fail_after(self._config.handler_timeout_s):
                    result.append(await self._handler(request))
            except trio.TooSlowError:
                self._errors[ServerError.HANDLER_TIMEOUT] += 1
                result.append(HttpResponse(503, [("retry-after", "1")]))
            except Exception:
                self._errors[ServerError.HANDLER] += 1
                log.exception("http_handler_failed path=%s", request.path)
                result.append(HttpResponse(500))
            finally:
                done.set()

        self._nursery.start_soon(run)
        await done.wait()
        if not result:
            raise _Cut
        return result[0]

    def _body(
        self,
        response: HttpResponse,
        path: str,
        limit: int | None = None,
        streamed: bytes = b"",
    ) -> tuple[bytes, int, Callable[[int], None] | None]:
        """The body bytes, the length the head declares, and the slice's ``on_sent``.

        A file slice is read now (and released: ``on_done``); a file shorter than the slice
        promised yields fewer bytes than declared, so the client sees the body cut short, as
        from the real server. ``limit``: read at most this many bytes of the slice (those
        its ``ready`` callback vouched for; the body is then cut short there). ``streamed``:
        the bytes a :class:`~p2p.http_body.StreamedBody` produced (:func:`_gather`).
        """
        body = response.body
        if isinstance(body, StreamedBody):
            data, declared, on_sent = streamed, body.length, body.on_sent
        elif isinstance(body, FileSlice):
            data = b""
            try:
                if body.length:
                    data = _read_slice(body, limit)
            except OSError:
                self._errors[ServerError.FILE_ERROR] += 1
                raise
            finally:
                if body.on_done is not None:
                    body.on_done()
            declared, on_sent = body.length, body.on_sent
            if len(data) < declared:
                self._errors[ServerError.SHORT_FILE] += 1
        else:
            data, declared, on_sent = body, len(body), None
        fn = self.net._tamper.get(self.ip)
        return (fn(path, data) if fn is not None else data), declared, on_sent


async def _ready_limit(response: HttpResponse) -> int | None:
    """For a slice of a file still being filled (``FileSlice.ready``): how many of its bytes
    are verified once the producer stops making progress (the real server sends each run as
    it appears; here the body goes out once, then cut short if incomplete). None: no limit."""
    body = response.body
    if not isinstance(body, FileSlice) or body.ready is None or not body.length:
        return None
    pos, end = body.offset, body.offset + body.length
    while pos < end:
        got = await body.ready(pos)
        if got <= pos:
            break
        pos = min(end, got)
    return pos - body.offset


async def _gather(response: HttpResponse, server: MemHttpServer) -> bytes:
    """The bytes a streamed body (:class:`~p2p.http_body.StreamedBody`) produces
    (:func:`_capped`, waited for as long as it takes), for a server with a tamper hook, which
    sees the whole body: it then goes out once whole, or cut short where the pieces ended
    (without a hook, the pieces go out as they come, :func:`_produced`). ``b""`` for any
    other body."""
    body = response.body
    if not isinstance(body, StreamedBody):
        return b""
    return b"".join([piece async for piece in _capped(body, server, "", math.inf)])


async def _capped(
    body: StreamedBody, server: MemHttpServer, source: str, timeout_s: float
) -> AsyncGenerator[bytes, None]:
    """``body``'s pieces as its producer yields them, at most its length (its generator
    closed after), as the real server sends them: a body that ends short or runs over is
    counted on ``server`` (``not_ready``, ``body_overrun``) and ends there.

    Raises:
        StreamBroken: (from ``source``) the producer yielded nothing for ``timeout_s``
            seconds, as a silent socket is the client's StreamBroken.
    """
    sent = 0
    async with aclosing(body.pieces) as pieces:
        while True:
            try:
                with trio.fail_after(timeout_s):
                    piece = await anext(pieces)
            except StopAsyncIteration:
                break
            except trio.TooSlowError as exc:
                raise StreamBroken(source, f"no progress for {timeout_s}s") from exc
            if sent + len(piece) > body.length:
                server._errors[ServerError.BODY_OVERRUN] += 1
                return
            sent += len(piece)
            yield piece
    if sent < body.length:
        server._errors[ServerError.NOT_READY] += 1


def _read_slice(part: FileSlice, limit: int | None = None) -> bytes:
    length = part.length if limit is None else min(limit, part.length)
    for candidate in (part.path, *part.fallbacks):
        try:
            with open(candidate, "rb") as f:
                f.seek(part.base + part.offset)
                return f.read(length)
        except FileNotFoundError:
            continue
    raise FileNotFoundError(part.path)


@dataclass
class _Answer:
    server: MemHttpServer
    event: h11.Response
    body: bytes
    declared: int
    on_sent: Callable[[int], None] | None
    source: str
    stream: StreamedBody | None = None
    """A streamed body sent piece by piece as its producer yields them (``body`` is then
    empty), as the real server sends it."""


async def _produced(a: _Answer, timeout_s: float) -> AsyncGenerator[bytes, None]:
    """The body's bytes as the server has them: ``a.body`` at once, or a streamed body's
    pieces as its producer yields them (:func:`_capped`)."""
    if a.stream is None:
        yield a.body
        return
    async with aclosing(_capped(a.stream, a.server, a.source, timeout_s)) as pieces:
        async for piece in pieces:
            yield piece


class MemHttpClient:
    """An HTTP lane client on the in-memory network (the :class:`p2p.lanes.HttpLaneClient`
    protocol, same errors as :class:`p2p.http_client.HttpClient`)."""

    def __init__(
        self,
        net: MemNetwork,
        ip: str,
        headers: Mapping[str, str],
        sign: RequestSigner | None,
    ) -> None:
        self.net = net
        self.ip = ip
        self.alive = True
        self._headers = [(k.lower(), v) for k, v in headers.items()]
        self._sign = sign
        self._counters = http_checks.ClientCounters()

    def statistics(self) -> http_checks.HttpClientStatistics:
        """Counters, as :meth:`p2p.http_client.HttpClient.statistics`."""
        return self._counters.statistics()

    def _live(self) -> bool:
        return self.alive

    async def _exchange(
        self,
        url: str,
        extra: Sequence[tuple[str, str]],
        timeout_s: float,
        anonymous: bool,
    ) -> _Answer:
        source, (host, port), target, netloc, stream_peer = http_checks.parse_target(url)
        if stream_peer:  # the in-memory network models the TCP lane only
            raise PeerUnreachable(source, "no stream lane on the in-memory network")
        net = self.net
        server = net._http.get((host, port))
        if not net.reachable(self.ip, host):
            await trio.sleep(timeout_s)
            raise PeerUnreachable(source, f"connect timed out after {timeout_s}s")
        await trio.sleep(2 * net.profile(self.ip).latency_s)
        if server is None or not server.alive:
            raise PeerUnreachable(source, "connect failed: connection refused")
        signed = self._sign(target) if self._sign is not None and not anonymous else ()
        headers = http_checks.request_headers(netloc, self._headers, signed, extra)
        conn = h11.Connection(h11.CLIENT)
        head = conn.send(h11.Request(method="GET", target=target, headers=headers))
        head += conn.send(h11.EndOfMessage())
        self._counters.requests += 1
        if net._lost(self.ip):
            raise StreamBroken(source, "connection reset (loss)")
        server._open += 1
        server._total += 1
        try:
            with trio.fail_after(timeout_s):
                await net._carry(self.ip, host, len(head), server._live)
                response = await server._respond(head, f"{self.ip}:0")
            limit = await _ready_limit(response)  # a slice still filling: its verified bytes
            live = response.body if isinstance(response.body, StreamedBody) else None
            if live is not None and net._tamper.get(server.ip) is not None:
                live = None  # a tamper hook sees the whole body: gathered first
            streamed = b"" if live is not None else await _gather(response, server)
            with trio.fail_after(timeout_s):
                on_sent: Callable[[int], None] | None = None
                try:
                    if live is not None:  # sent piece by piece as produced (_body_chunks)
                        body, declared, on_sent = b"", live.length, live.on_sent
                    else:
                        body, declared, on_sent = server._body(
                            response, urlsplit_path(target), limit, streamed
                        )
                except OSError:
                    response, body, declared = HttpResponse(500), b"", 0
                event = _to_h11_response(response, declared, close=False)
                server._requests += 1
                await net._carry(host, self.ip, 256, self._live)
        except trio.TooSlowError as exc:
            raise StreamBroken(source, f"no progress for {timeout_s}s") from exc
        except _Cut as exc:
            raise StreamBroken(source, "connection closed before any answer") from exc
        finally:
            server._open -= 1
        return _Answer(server, event, body, declared, on_sent, source, live)

    async def _body_chunks(self, a: _Answer, timeout_s: float) -> AsyncGenerator[bytes, None]:
        """The body as it arrives; StreamBroken if the server dies, the link is cut, no
        byte comes for ``timeout_s``, or the body ends short of what the head declared."""
        server, delivered = a.server, 0
        try:
            async with aclosing(_produced(a, timeout_s)) as produced:
                async for data in produced:
                    for i in range(0, len(data), CHUNK_BYTES):
                        piece = data[i : i + CHUNK_BYTES]
                        try:
                            with trio.fail_after(timeout_s):
                                await self.net._carry(
                                    server.ip,
                                    self.ip,
                                    len(piece),
                                    lambda: server.alive and self.alive,
                                )
                        except trio.TooSlowError as exc:
                            raise StreamBroken(a.source, f"no progress for {timeout_s}s") from exc
                        except _Cut as exc:
                            raise StreamBroken(a.source, "connection broken mid-body") from exc
                        delivered += len(piece)
                        server._bytes_sent += len(piece)
                        self._counters.bytes_received += len(piece)
                        yield piece
            if delivered < a.declared:
                raise ClosedMidBody(a.source, "connection closed mid-body")
        finally:
            if a.on_sent is not None:
                a.on_sent(delivered)

    async def get_bytes(
        self,
        url: str,
        *,
        max_bytes: int,
        timeout_s: float,
        headers: Sequence[tuple[str, str]] = (),
        anonymous: bool = False,
    ) -> bytes:
        """GET a whole body (``200`` only); see :meth:`p2p.http_client.HttpClient.get_bytes`."""
        with self._counters.counting_errors():
            a = await self._exchange(url, headers, timeout_s, anonymous)
            http_checks.check_whole_head(a.event, a.source, url, max_bytes)
            out, bound = bytearray(), http_checks.BodyCount(a.source, max_bytes, exact=False)
            async with aclosing(self._body_chunks(a, timeout_s)) as chunks:
                async for piece in chunks:
                    bound.add(len(piece))
                    out += piece
            return bytes(out)

    async def receive_into(
        self,
        url: str,
        view: memoryview,
        *,
        timeout_s: float,
        headers: Sequence[tuple[str, str]] = (),
        anonymous: bool = False,
    ) -> AsyncGenerator[int, None]:
        """GET a whole body of exactly ``len(view)`` bytes into ``view``, yielding the count
        of each piece as it lands; see :meth:`p2p.http_client.HttpClient.receive_into` (same
        errors at the same points)."""
        with self._counters.counting_errors():
            a = await self._exchange(url, headers, timeout_s, anonymous)
            http_checks.check_exact_head(a.event, a.source, url, len(view))
            body = http_checks.BodyCount(a.source, len(view), exact=True)
            async with aclosing(self._body_chunks(a, timeout_s)) as chunks:
                async for piece in chunks:
                    got = body.received
                    body.add(len(piece))
                    view[got : got + len(piece)] = piece
                    yield len(piece)
            body.end()

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
        """Yield exactly ``[start, start + length)``; see
        :meth:`p2p.http_client.HttpClient.stream_range`."""
        http_checks.check_range_args(start, length, chunk_bytes)
        if length == 0:
            return
        with self._counters.counting_errors():
            spec = format_range(ByteRange(start, start + length - 1))
            a = await self._exchange(url, [("range", spec), *headers], timeout_s, anonymous)
            http_checks.check_range_head(a.event, a.source, url, start, length)
            body = http_checks.BodyCount(a.source, length, exact=True)
            async with aclosing(self._body_chunks(a, timeout_s)) as chunks:
                async for piece in chunks:
                    body.add(len(piece))
                    for i in range(0, len(piece), chunk_bytes):
                        yield piece[i : i + chunk_bytes]
            body.end()

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
        """Receive ``[start, start + len(view))`` into ``view``, yielding each count filled
        (the zero-copy form of :meth:`stream_range`, same errors at the same points)."""
        length = len(view)
        http_checks.check_range_args(start, length)
        got = 0
        async with aclosing(
            self.stream_range(
                url, start, length, timeout_s=timeout_s, headers=headers, anonymous=anonymous
            )
        ) as chunks:
            async for chunk in chunks:
                view[got : got + len(chunk)] = chunk
                got += len(chunk)
                yield len(chunk)


def urlsplit_path(target: str) -> str:
    """The path part of a request target (``/a/b?x=1`` -> ``/a/b``)."""
    return target.split("?", 1)[0]
