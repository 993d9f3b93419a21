"""Circuit relay v2 and hole punching (DCUtR) for a host: reaching a peer behind a NAT.

Theory of operation
-------------------
A node behind a NAT accepts no connection, but it can hold a *reservation* on a public relay
(libp2p circuit relay v2): another node then dials ``<relay>/p2p-circuit/p2p/<peer>`` and the
relay splices the two connections. Over that relayed connection the two run DCUtR (direct
connection upgrade through relay): they exchange their observed addresses and dial each
other at once from their listen ports, which opens a direct TCP connection through NATs
that map a source port the same way for every destination (endpoint-independent mapping;
Linux ``masquerade`` keeps the source port when it is free). Then the relayed connection is
closed: circuits are for coordination only. Each side also sends its private listen
addresses (at most :data:`MAX_PRIVATE_ADDRS`): two hosts behind one NAT that does not hairpin
cannot reach each other at their public address, but connect over their LAN; the DCUtR
initiator leaves the dial over a shared network to the other side (see :class:`_DCUtR`).
The plain direct dial the library tries before the exchange is bounded by
:attr:`CircuitConfig.direct_timeout_s` (a router drops a SYN to its own address silently: it
ate the whole punch's time). Unspecified addresses (``0.0.0.0``, ``::``) are
never offered to nor dialled from the other side, and the library's routine circuit errors
(reset streams, the punch's failed simultaneous dial) are logged at DEBUG
(:func:`quiet_library_noise`). Their relay-side limits are small
(:class:`CircuitConfig`: bytes and seconds per circuit), so shard bytes never cross a relay;
they go over the direct connection, on the stream lane (:mod:`p2p.bytestream`).

:class:`Circuits` wraps py-libp2p 0.8.1's ``relay.circuit_v2`` (protocol, transport, DCUtR):
built on a host, run as services while the host runs (:meth:`Circuits.running`), their
inbound protocols behind :mod:`p2p.boundary`'s guard like every other protocol (admission
caps, fault isolation); the relay's splice of a circuit is this project's (:class:`_Relay`:
the library's ended the wrong circuit of a peer in two at once, failing a third of the NAT
lab's relayed dials). It is opt-in (``HostConfig.circuits``; the command line turns it on
for relays, which relay, and peers, which reserve and punch); a host without it neither
relays nor dials through relays. Measured in network namespaces (two hosts behind two
``masquerade`` routers, a relay on the public side): reservation, relayed dial, a stream over
the circuit and DCUtR all worked, and the direct connection carried a stream after the
circuit was closed.
"""

from __future__ import annotations

import ipaddress
import logging
import math
import time
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import multiaddr
import trio
from libp2p.exceptions import BaseLibp2pError
from libp2p.peer.id import ID
from libp2p.peer.peerinfo import info_from_p2p_addr
from libp2p.relay.circuit_v2 import CircuitV2Protocol, CircuitV2Transport, DCUtRProtocol
from libp2p.relay.circuit_v2.config import RelayConfig, RelayRole
from libp2p.relay.circuit_v2.dcutr import MAX_OBSERVED_ADDRS
from libp2p.relay.circuit_v2.dcutr import PROTOCOL_ID as DCUTR_PROTOCOL
from libp2p.relay.circuit_v2.protocol import PROTOCOL_ID as HOP_PROTOCOL
from libp2p.relay.circuit_v2.protocol import STOP_PROTOCOL_ID as STOP_PROTOCOL
from libp2p.relay.circuit_v2.resources import RelayLimits
from libp2p.tools.anyio_service import background_trio_service

from p2p.addresses import Interfaces, interface_addresses, interface_subnets
from p2p.boundary import InboundGuard, close_quietly, reset_quietly
from p2p.errors import ConfigError, PeerUnreachable
from p2p.limits import ScopeLimit

log = logging.getLogger(__name__)
Ma = multiaddr.Multiaddr
Subnet = ipaddress.IPv4Interface | ipaddress.IPv6Interface

MAX_PRIVATE_ADDRS = 4
"""Private listen addresses a host sends in a DCUtR exchange, at most (bounds the dials)."""

__all__ = [
    "MAX_PRIVATE_ADDRS",
    "CircuitConfig",
    "Circuits",
    "is_private",
    "is_relayed",
    "is_unspecified",
    "on_link",
    "private_listen_addrs",
    "quiet_library_noise",
]


@dataclass(frozen=True)
class CircuitConfig:
    """Circuit relay v2 and DCUtR settings of one host.

    Attributes:
        hop: serve reservations and relay circuits for others (a public relay).
        max_reservations: reservations held for others at once (``hop`` only).
        max_circuits: circuits relayed at once (``hop`` only). The relay's inbound HOP
            streams are capped at ``max_circuits + max_reservations``: a circuit holds one for
            its life, a reservation (also the one py-libp2p's client makes before each
            relayed dial) one for its exchange. Capped at ``max_circuits`` alone, the NAT
            lab's first burst of punches (two public peers and four NATed ones punching
            ahead at once) had 4 of ~20 relayed dials refused (``global_limit``).
        circuit_duration_s: a relayed circuit is cut after this many seconds.
        circuit_bytes: ... or after this many bytes each way: enough for identify and DCUtR,
            never for shards (coordination only).
        timeout_s: bound on a reservation, a relayed dial or a hole punch, seconds.
        direct_timeout_s: bound on the plain direct dial a hole punch tries first (to the
            addresses the peer advertised), seconds; ``timeout_s`` if that is smaller.

    Raises:
        ConfigError: a field is out of range (names the field).
    """

    hop: bool = False
    max_reservations: int = 64
    max_circuits: int = 16
    circuit_duration_s: int = 120
    circuit_bytes: int = 1 << 20
    timeout_s: float = 30.0
    direct_timeout_s: float = 5.0

    def __post_init__(self) -> None:
        for name in ("max_reservations", "max_circuits", "circuit_duration_s", "circuit_bytes"):
            if getattr(self, name) < 1:
                raise ConfigError(name, "must be >= 1")
        if not self.timeout_s > 0:
            raise ConfigError("timeout_s", "must be > 0")
        if not self.direct_timeout_s > 0:
            raise ConfigError("direct_timeout_s", "must be > 0")


def is_unspecified(addr: multiaddr.Multiaddr) -> bool:
    """True if ``addr``'s IP is unspecified (``0.0.0.0``, ``::``): a listen address, never
    one to dial (on Linux a dial to it reaches this host itself)."""
    for proto in ("ip4", "ip6"):
        try:
            value = addr.value_for_protocol(proto)
        except (ValueError, KeyError, TypeError, multiaddr.exceptions.Error):
            continue
        if value is not None:
            try:
                return ipaddress.ip_address(str(value)).is_unspecified
            except ValueError:
                return False
    return False


def _tcp_ip_port(addr: multiaddr.Multiaddr) -> tuple[str, int] | None:
    """``(ip, port)`` of an ``/ip4|ip6/<ip>/tcp/<port>`` multiaddr, or None."""
    for proto in ("ip4", "ip6"):
        try:
            ip, port = addr.value_for_protocol(proto), addr.value_for_protocol("tcp")
        except (ValueError, KeyError, TypeError, multiaddr.exceptions.Error):
            continue
        if ip is not None and port is not None:
            return str(ip), int(port)
    return None


def _ip_of(addr: multiaddr.Multiaddr) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    """The IP of a TCP multiaddr, or None (not TCP over IP, or not an IP literal)."""
    parsed = _tcp_ip_port(addr)
    if parsed is None:
        return None
    try:
        return ipaddress.ip_address(parsed[0])
    except ValueError:
        return None


def is_private(addr: multiaddr.Multiaddr) -> bool:
    """True if ``addr``'s IP means something only on its own network (private, unique
    local, shared, but not loopback, link-local, unspecified or multicast): an address that
    reaches a peer behind the same NAT, never one across the internet."""
    ip = _ip_of(addr)
    if ip is None:
        return False
    odd = ip.is_loopback or ip.is_link_local or ip.is_unspecified or ip.is_multicast
    return not ip.is_global and not odd


def on_link(addr: multiaddr.Multiaddr, subnets: Sequence[Subnet]) -> bool:
    """True if ``addr``'s IP lies on the network of one of ``subnets`` (this host's interface
    addresses with their prefix lengths, :func:`p2p.addresses.interface_subnets`): reached
    with no NAT in between."""
    ip = _ip_of(addr)
    return ip is not None and any(ip in s.network for s in subnets)


def private_listen_addrs(
    listen: Sequence[multiaddr.Multiaddr], interfaces: Interfaces, limit: int
) -> list[multiaddr.Multiaddr]:
    """This host's private TCP listen addresses, what a peer behind the same NAT dials
    (pure).

    Args:
        listen: the host's listen multiaddrs (``/p2p-circuit`` and non-TCP ones skipped);
            an unspecified IP stands for every interface address of its family.
        interfaces: this host's interface addresses (:func:`p2p.addresses.interface_addresses`).
        limit: at most this many are returned.

    Returns:
        ``/ip4|ip6/<ip>/tcp/<port>`` multiaddrs whose IP :func:`is_private` (never loopback or
        unspecified), in listen then interface order, without duplicates.
    """
    out: list[multiaddr.Multiaddr] = []
    for addr in listen:
        parsed = None if "/p2p-circuit" in str(addr) else _tcp_ip_port(addr)
        if parsed is None:
            continue
        ip, port = parsed
        family = "ip6" if ":" in ip else "ip4"
        ips = [ip]
        if is_unspecified(addr):
            ips = list(interfaces.ipv6 if family == "ip6" else interfaces.ipv4)
        for candidate in ips:
            ma = multiaddr.Multiaddr(f"/{family}/{candidate}/tcp/{port}")
            if is_private(ma) and ma not in out:
                out.append(ma)
    return out[:limit]


class _DCUtR(DCUtRProtocol):
    """py-libp2p 0.8.1's DCUtR with four changes.

    - Unspecified addresses are neither sent nor dialled: a host listening on ``0.0.0.0``
      offers it as its own address when it has no observed one, and the other side dialled
      it (itself).
    - This host's private listen addresses (:func:`private_listen_addrs`, at most
      :data:`MAX_PRIVATE_ADDRS`) are sent too, as go-libp2p's identify does: two peers
      behind one NAT without hairpinning cannot reach each other at their public
      addresses, but can over their LAN. A dial that reaches another host with the same
      private address fails the handshake's PeerID check.
    - The DCUtR initiator does not dial the other side's addresses on this host's own
      networks (:func:`on_link`): it upgrades its punch dials as the security handshake's
      responder (a simultaneous open through NATs merges both sides' dials), but with no NAT
      in between its dial lands on the other side's listener, which is the responder too,
      and neither would speak first. The other side dials this host's as the handshake's
      initiator, and this host's listener answers it.
    - The unilateral direct dial before the exchange (the spec's step 0, to addresses the
      peer advertised) is bounded by ``direct_timeout_s``: a NAT drops the SYN to a router's
      address silently, and the dial ate the whole punch's time.
    """

    def __init__(
        self,
        host: Any,
        *,
        dial_timeout_s: float,
        direct_timeout_s: float,
        interfaces: Callable[[], Interfaces] = interface_addresses,
        subnets: Callable[[], Sequence[Subnet]] = interface_subnets,
    ) -> None:
        super().__init__(host, dial_timeout=int(dial_timeout_s))
        self.direct_timeout_s = direct_timeout_s
        self.interfaces = interfaces  # read at each exchange: interfaces come and go
        self.subnets = subnets

    async def _get_observed_addrs(self) -> list[bytes]:
        addrs = [a for a in await super()._get_observed_addrs() if not is_unspecified(Ma(a))]
        listen = [Ma(str(a)) for a in self.host.get_addrs()]
        for ma in private_listen_addrs(listen, self.interfaces(), MAX_PRIVATE_ADDRS):
            if ma.to_bytes() not in addrs:
                addrs.append(ma.to_bytes())
        return addrs[:MAX_OBSERVED_ADDRS]

    def _decode_observed_addrs(self, addr_bytes: list[bytes]) -> list[multiaddr.Multiaddr]:
        decoded: list[multiaddr.Multiaddr] = super()._decode_observed_addrs(addr_bytes)
        return [a for a in decoded if not is_unspecified(a)]

    async def _dial_peer(
        self,
        peer_id: ID,
        addr: multiaddr.Multiaddr,
        source: tuple[str, int] | None = None,
        as_responder: bool = False,
    ) -> None:
        if as_responder and on_link(addr, self.subnets()):
            log.debug("punch_skip_on_link peer=%s addr=%s", peer_id, addr)
            return
        await super()._dial_peer(peer_id, addr, source, as_responder)

    async def _try_unilateral_upgrade(self, peer_id: ID) -> bool:
        with trio.move_on_after(self.direct_timeout_s):
            ok: bool = await super()._try_unilateral_upgrade(peer_id)
            return ok
        return bool(await self._verify_direct_connection(peer_id))


RELAY_READ_BYTES = 64 * 1024
"""Bytes a relay reads from one side of a circuit at a time."""


class _Relay(CircuitV2Protocol):
    """py-libp2p 0.8.1's circuit relay protocol with its splice replaced: each circuit ends
    by itself, and whole.

    The library keeps the streams of its circuits in a map keyed by PeerID (the source's and
    the destination's) and, when either direction of a circuit ends, closes the streams it
    finds under that direction's PeerID: whichever circuit of that peer was stored *last*,
    not necessarily the one that ended. A peer that is in two circuits at once (a NATed peer
    punched by two peers ahead of need, a public peer punching four) lost its newer circuit
    when the older one ended (after its punch), mid-handshake: the other side's relayed dial
    failed ("failed to upgrade mux", "failed to open a stream", status 203) in about a third
    of the NAT lab's punches; and the end of a circuit closed only its source's stream, so
    the destination held the dead relayed connection until something was written on it
    (which then killed yet another circuit). Here :meth:`_relay_data` (one call per
    direction, both in one nursery of the library's ``_handle_connect``) reads from one
    stream and writes to the other until either ends, breaks the circuit's duration or byte
    budget (shared by both directions, as the library passes it), or the write stalls
    ``write_timeout``; then it cancels the other direction (the library's stream ``read``
    does not wake on a local reset) and resets *its own two* streams, which ends both ends'
    relayed connections at once. The library's bookkeeping entry is dropped only if it is
    still this circuit's. :attr:`ended` counts the circuits' directions that
    ended (two a circuit); :meth:`wait_ended` waits for a count.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.ended = 0
        self._ended_changed = trio.Event()
        self._splices: dict[frozenset[int], _Splice] = {}  # by the ids of a circuit's streams

    async def wait_ended(self, count: int) -> None:
        """Return once :attr:`ended` is at least ``count``."""
        while self.ended < count:
            await self._ended_changed.wait()

    async def _relay_data(
        self,
        src_stream: Any,
        dst_stream: Any,
        peer_id: ID,
        deadline: float | None = None,
        circuit_data_limit: list[int] | None = None,
    ) -> None:
        key = frozenset((id(src_stream), id(dst_stream)))
        splice = self._splices.setdefault(key, _Splice())
        scope = trio.CancelScope(
            deadline=math.inf
            if deadline is None
            else trio.current_time() + (deadline - time.monotonic())  # monotonic -> trio
        )
        splice.scopes.append(scope)
        try:
            if not splice.ended:
                with scope:
                    await self._pump(src_stream, dst_stream, circuit_data_limit)
        finally:
            splice.ended = True
            for other in splice.scopes:  # the other direction stops too
                other.cancel()
            splice.done += 1
            if splice.done == 2:
                del self._splices[key]
            with trio.CancelScope(shield=True):
                if self._active_relays.get(peer_id, (None, None))[0] in (src_stream, dst_stream):
                    del self._active_relays[peer_id]
                # both ends learn at once (a circuit carries coordination only: nothing
                # in flight matters once one side has ended)
                await reset_quietly(src_stream)
                await reset_quietly(dst_stream)
            self.ended += 1
            self._ended_changed.set()
            self._ended_changed = trio.Event()

    async def _pump(self, src: Any, dst: Any, budget: list[int] | None) -> None:
        """Copy ``src`` to ``dst`` until ``src`` ends, ``budget[0]`` (bytes left to the
        circuit, shared by both directions) would go below 0, or a write fails or stalls for
        ``write_timeout`` seconds."""
        while True:
            try:
                data = await src.read(RELAY_READ_BYTES)
            except (BaseLibp2pError, OSError, trio.BrokenResourceError):
                return  # EOF, reset, or the connection went
            if not data:
                return
            if budget is not None:
                if len(data) > budget[0]:
                    return
                budget[0] -= len(data)
            with trio.move_on_after(self.write_timeout):
                try:
                    await dst.write(data)
                    continue
                except (BaseLibp2pError, OSError, trio.BrokenResourceError):
                    pass
            return  # the other side is gone or stalled


@dataclass
class _Splice:
    """The two directions of one relayed circuit (:class:`_Relay`)."""

    scopes: list[trio.CancelScope] = field(default_factory=list)
    ended: bool = False  # a direction has ended: the other stops
    done: int = 0  # directions finished


class _Demote(logging.Filter):
    """Turns a library logger's records that are routine on circuits (streams reset when a
    relay cuts a circuit or a peer goes, the hole punch's simultaneous dials failing) into
    DEBUG records: emitted only where that logger is enabled for DEBUG. The outcomes this
    project acts on are raised or returned and logged by its own code."""

    def __init__(self, needle: str = "") -> None:
        super().__init__()
        self.needle = needle

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno <= logging.DEBUG or self.needle not in record.getMessage():
            return True
        record.levelno, record.levelname = logging.DEBUG, "DEBUG"
        return logging.getLogger(record.name).isEnabledFor(logging.DEBUG)


_NOISY = {
    # every ERROR and WARNING there is about one circuit's streams (reset, limits reached)
    "libp2p.relay.circuit_v2.protocol": "",
    "libp2p.relay.circuit_v2.transport": "",
    "libp2p.relay.circuit_v2.dcutr": "",
    # a hole punch's dials bind the listen port ("Failed to connect A from B"); one of the
    # two simultaneous dials fails by design
    "libp2p.transport.tcp.tcp": "Failed to connect",
}


def quiet_library_noise() -> None:
    """Install the :class:`_Demote` filters on py-libp2p's circuit loggers (idempotent)."""
    for name, needle in _NOISY.items():
        logger = logging.getLogger(name)
        if not any(isinstance(f, _Demote) for f in logger.filters):
            logger.addFilter(_Demote(needle))


def is_relayed(conn: Any) -> bool:
    """True if a libp2p connection runs through a relay (a ``/p2p-circuit`` address)."""
    try:
        addrs = conn.get_transport_addresses()
    except (AttributeError, BaseLibp2pError, OSError):
        return False
    return any("/p2p-circuit" in str(a) for a in addrs)


class Circuits:
    """The circuit relay and DCUtR of one py-libp2p host (see the module docstring).

    Methods are valid only inside :meth:`running`; safe to call from any task of the host's
    trio run.
    """

    def __init__(self, host: Any, config: CircuitConfig) -> None:
        self.host = host
        self.config = config
        limits = RelayLimits(
            duration=config.circuit_duration_s,
            data=config.circuit_bytes,
            max_circuit_conns=config.max_circuits,
            max_reservations=config.max_reservations,
        )
        self.protocol = _Relay(host, limits, allow_hop=config.hop)
        roles = RelayRole.STOP | RelayRole.CLIENT | (RelayRole.HOP if config.hop else RelayRole(0))
        self.transport = CircuitV2Transport(
            host, self.protocol, RelayConfig(roles=roles, limits=limits)
        )
        self.dcutr = _DCUtR(
            host,
            dial_timeout_s=config.timeout_s,
            direct_timeout_s=min(config.direct_timeout_s, config.timeout_s),
        )
        quiet_library_noise()
        self._nursery: trio.Nursery | None = None

    @asynccontextmanager
    async def running(self, guard: InboundGuard, per_peer: int) -> AsyncIterator[Circuits]:
        """Run the relay protocol and DCUtR as services; their inbound protocols pass
        ``guard`` (at most ``per_peer`` streams of one peer on each, ``max_circuits +
        max_reservations`` in all on the relay's)."""
        async with (
            trio.open_nursery() as nursery,
            background_trio_service(self.protocol),
            background_trio_service(self.dcutr),
        ):
            await self.protocol.event_started.wait()
            await self.dcutr.event_started.wait()
            protocols = [STOP_PROTOCOL, DCUTR_PROTOCOL] + (
                [HOP_PROTOCOL] if self.config.hop else []
            )
            for proto in protocols:
                total = (
                    self.config.max_circuits + self.config.max_reservations
                    if proto == HOP_PROTOCOL
                    else 4 * per_peer
                )
                guard.resources.set_limit(str(proto), ScopeLimit(per_peer, total))
                inner = self.host.get_mux().handlers[proto]
                # not closed after the handler: a stop or hop stream lives on as the circuit
                self.host.set_stream_handler(proto, guard.wrap(str(proto), inner))
            self._nursery = nursery
            try:
                yield self
            finally:
                self._nursery = None
                nursery.cancel_scope.cancel()

    async def reserve(self, relay_peer_id: str) -> None:
        """Hold a reservation on ``relay_peer_id`` (connected already), so that others can
        reach this host through it; it is refreshed until the host closes.

        Raises:
            PeerUnreachable: not connected to the relay, or it refused or did not answer.
        """
        assert self._nursery is not None, "only valid inside Circuits.running"
        pid = ID.from_base58(relay_peer_id)
        if not self.host.get_network().get_connections(pid):
            raise PeerUnreachable(relay_peer_id, "no connection to the relay")
        try:
            with trio.fail_after(self.config.timeout_s):
                stream = await self.host.new_stream(pid, [HOP_PROTOCOL])
                try:
                    ok = await self.transport.reserve(stream, pid, self._nursery)
                finally:
                    # one exchange per HOP stream (as the library's own refreshes do): left
                    # open, the relay's handler held it, and one of its HOP slots, waiting
                    # 30 s for a next message
                    await close_quietly(stream)
        except trio.TooSlowError as exc:
            raise PeerUnreachable(relay_peer_id, "reservation timed out") from exc
        except (BaseLibp2pError, OSError) as exc:
            raise PeerUnreachable(relay_peer_id, f"reservation failed: {exc!r}") from exc
        if not ok:
            raise PeerUnreachable(relay_peer_id, "reservation refused")

    async def connect_via(self, relay_addr: str, peer_id: str) -> None:
        """Open a relayed connection to ``peer_id`` through the relay at ``relay_addr`` (a
        ``/p2p/``-suffixed multiaddr), where ``peer_id`` holds a reservation.

        Raises:
            PeerUnreachable: the relay or the peer refused, or it took over ``timeout_s``.
        """
        circuit = multiaddr.Multiaddr(f"{relay_addr}/p2p-circuit/p2p/{peer_id}")
        try:
            info_from_p2p_addr(multiaddr.Multiaddr(relay_addr))
            with trio.fail_after(self.config.timeout_s):
                await self.transport.dial(circuit)
        except trio.TooSlowError as exc:
            raise PeerUnreachable(peer_id, "relayed dial timed out") from exc
        except (BaseLibp2pError, OSError, ValueError) as exc:  # ConnectionError is an OSError
            raise PeerUnreachable(peer_id, f"relayed dial failed: {exc!r}") from exc

    async def hole_punch(self, peer_id: str) -> bool:
        """Upgrade the relayed connection to ``peer_id`` to a direct one (DCUtR); on success
        the relayed connections to it are closed. False if no direct connection came of it
        (a NAT that maps each destination to another port: the circuit stays until its
        limits end it, and carries no shards)."""
        pid = ID.from_base58(peer_id)
        try:
            with trio.fail_after(self.config.timeout_s):
                ok = await self.dcutr.initiate_hole_punch(pid)
        except (trio.TooSlowError, BaseLibp2pError, OSError):  # the punch failed: say so
            ok = False
        if not ok or not self.direct(peer_id):
            return False
        await self.close_relayed(peer_id)
        return True

    async def close_relayed(self, peer_id: str) -> None:
        """Close the relayed connections to ``peer_id`` (each bounded by ``timeout_s``; one
        that fails to close is already going)."""
        pid = ID.from_base58(peer_id)
        for conn in list(self.host.get_network().get_connections(pid)):
            if is_relayed(conn):
                with trio.move_on_after(self.config.timeout_s):
                    try:
                        await conn.close()
                    except (BaseLibp2pError, OSError, trio.BrokenResourceError) as exc:
                        # closed meanwhile (the relay cut it, or the peer went)
                        log.debug("circuit_close_failed peer=%s error=%r", peer_id, exc)

    def direct(self, peer_id: str) -> bool:
        """True if this host holds a direct (not relayed) connection to ``peer_id``."""
        conns = self.host.get_network().get_connections(ID.from_base58(peer_id))
        return any(not is_relayed(c) for c in conns)
