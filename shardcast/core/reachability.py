"""core: is this node's lane reachable from outside? A dial-back check (pure part).

A node behind a NAT knows its lane URL (``http://192.168.77.2:8003``) but not whether anyone
outside can open it. Followers that hear an unreachable URL in an advert try it, fail, and try
again; the URL steers nothing but costs them a connection attempt each time. So a node first
asks the nodes it is connected to (its upstream relay or trainer) to dial it back
(:mod:`shardcast.node.dialback`, protocol :data:`DIALBACK_PROTOCOL`):

1. the asker sends ``{v: 1, url, nonce}``: its lane URL and a fresh 32-hex nonce;
2. the asked node compares the URL's host with the address it sees the asker's connection
   come from (:func:`judge_request`). Only a URL on that very address is dialled, so the asked
   node can be made to connect to nothing but the asker's own host (it is not an amplifier);
   it also dials each asking PeerID at most once per
   :attr:`DialbackLimits.per_peer_interval_s` (each address once per
   :attr:`DialbackLimits.per_address_interval_s`) and runs at most
   :attr:`DialbackLimits.max_concurrent` dials (:class:`DialbackLimiter`). Otherwise it
   answers ``mismatch`` (with the address it saw) or ``refused``;
3. it fetches ``<url>/shardnet/v1/whoami/<nonce>`` with a short timeout and answers
   ``reached`` if the lane there signed the nonce with the asker's key
   (:func:`shardcast.wire.lane_auth.check_whoami`), ``not_reached`` otherwise.

The asker keeps a :class:`Reachability` per own URL: ``unknown`` until a round of answers
with answers gives a verdict (:func:`verdict`; a round of only ``refused`` answers does not
count): any ``reached`` makes it ``reachable``; else a
``not_reached``, or a ``mismatch`` for a URL on a non-global address (private, loopback,
link-local: a host behind a NAT names its LAN address, which no one outside can open), makes
it ``unreachable``. A round of ``refused``/failed asks, or a ``mismatch`` for a global
address (a multi-homed host, a cloud VM whose upstream is on its private network), tells
nothing: the state stays ``unknown``. The node advertises its URL when ``reachable`` and,
failing open as before this check existed, when ``unknown`` after a round; never when
``unreachable`` (it is then download-only) and not before the first round has finished.
Verdicts are re-checked every :attr:`ReachabilityConfig.recheck_s` (an unknown one after
:attr:`ReachabilityConfig.retry_s`). An asker on the lane's own network (:func:`lan_asker`: a
neighbour behind the same home router, connected to the node over the LAN) reaches a private
URL that nobody outside can, so its answers count only in rounds where no asker from outside
says anything and only until an outside round has decided (a flat private network or one
host, where every asker is a neighbour, still gets a verdict). Found in the namespaced lab: a
NATed peer told ``not_reached`` by its relay and ``reached`` by its neighbour became
``reachable``, advertised its private URL and dropped its stream lane, so it stopped serving
through its NAT.

An unreachable lane is not the end of serving: a node behind a NAT holds the libp2p
connections it dialled (relay, trainer, public peers), and the lane also runs over libp2p
streams on those connections (:mod:`p2p.bytestream`). So an ``unreachable`` node advertises a
*stream lane* instead (:meth:`Reachability.advertises_stream`): its PeerID, proven by the
connection's handshake, no URL to challenge. A downloader picks how to reach an advertiser
with :func:`choose_lane`: its HTTP URL once proven (TCP, zero-copy), else its stream lane
when it holds a direct connection to it, else a hole punch when both hold a connection to
one of the relays the advertiser names, else nothing.

**LAN scope.** Private, loopback, link-local and unique-local addresses (``192.168.0.0/16``,
``127.0.0.0/8``, ``fe80::/10``, ``fd00::/8``, ...) mean something only on their own network,
so such a URL is offered only to, and tried only by, nodes on that network (issue 25): a node
whose lane is not advertised (unreachable from outside, or not checked yet) but whose URL is on
such an address, one of its own interfaces' (not a ``--public-host`` it names, such as its NAT
router's), offers it under a separate advert key, ``lan_url``
(:meth:`Reachability.lan_advertised`; nodes of older code ignore the key, so they never try
it), and a node that hears an advert tries a URL on such an address only if
:func:`lane_in_scope` says the advertiser is on its network: the address is one the
advertiser's connection to it comes from, or, with no connection seen from a global
address, it lies on one of this host's own networks (a loopback URL only from this host).
:func:`scoped_lane` picks the URL of an advert a node may try. NATed peers of one home network
thus use each other's lanes, and nodes elsewhere never try them. A deployment whose "internet"
is itself a private network (a VPN or overlay mesh such as WireGuard on ``10.0.0.0/8`` or
``100.64.0.0/10``, a campus or cloud network joined by peering, a lab's namespaces) declares
it (:attr:`ReachabilityConfig.public_networks`, ``--public-network CIDR``): addresses there are
treated as global by :func:`lane_in_scope`.

Hole punching (circuit relay v2 and DCUtR, :mod:`p2p.circuits`): an unreachable node holds
reservations on up to :attr:`PunchConfig.max_relays` of the public relays it is connected to
(:class:`Reservations`) and advertises their PeerIDs. A downloader that wants bytes from
it dials it through one of those relays and lets DCUtR open a direct connection; the circuit
is closed then, and the stream lane runs over the direct connection only (a relay's circuit
is bounded to coordination-sized exchanges: bulk bytes never cross it). :class:`PunchPlanner`
decides when: at most :attr:`PunchConfig.max_concurrent` punches at once, one per PeerID, and
after a failed punch that PeerID waits :attr:`PunchConfig.backoff_initial_s`, doubling to
:attr:`PunchConfig.backoff_max_s` (a NAT that maps each destination to its own port never
lets a punch through: the downloader stops trying it, and source selection goes on without
it). Of two NATed nodes that could punch each other, the one with the greater PeerID yields
for :attr:`PunchConfig.yield_s` first, so that one punch session runs per pair.

Punching ahead: a punch takes seconds (a relayed dial, DCUtR's round trips, up to three rounds
of :attr:`p2p.circuits.CircuitConfig.timeout_s`), longer than a small version's download, so a
punch started when a download wants the bytes finishes after it. A follower therefore punches
*ahead*, as soon as it hears the advert of a node it can reach only by a punch, whatever that
node holds yet (every follower will hold the next version): :meth:`PunchPlanner.ahead` picks,
among such advertisers, those holding or filling the newest versions first and draws among
equals with the seeded random generator (no advertiser is always last), through the same
admission (:meth:`PunchPlanner.start`: the concurrency cap, one per PeerID, the backoff and the
yield), until :attr:`PunchConfig.ahead_max_direct` nodes behind NATs are held directly. When
the next version is announced, the direct connections exist and source selection can use
those nodes' stream lanes from its first request.

Everything here is a pure function of its arguments (``now`` in trio seconds); no I/O.
"""

from __future__ import annotations

import enum
import ipaddress
import random
from collections import Counter, OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

from p2p import wire
from p2p.errors import ConfigError, RemoteProtocolError

DIALBACK_PROTOCOL = "/shardnet/dialback/1"
MAX_DIALBACK_BYTES = 512
_NONCE_LEN = 32


class Reach(enum.Enum):
    """What this node knows of one of its URLs (value: the status/metric string)."""

    UNKNOWN = "unknown"
    REACHABLE = "reachable"
    UNREACHABLE = "unreachable"


class Lane(enum.Enum):
    """How a downloader reaches an advertiser's lane (value: the metric string)."""

    HTTP = "http"
    """Its advertised ``http://`` URL, over TCP."""
    STREAM = "stream"
    """Its stream lane, over a libp2p connection this node holds (``p2p://<PeerID>``)."""
    PUNCH = "punch"
    """Not yet: a direct connection may be made through one of the relays it advertised
    (circuit relay v2, then DCUtR); its stream lane is usable once that succeeded."""
    NONE = "none"
    """Not now: no proven URL, no stream lane on a direct connection, no shared relay."""


def choose_lane(
    *,
    http_url: str,
    http_proven: bool,
    stream_lane: bool,
    connected: bool,
    relays: tuple[str, ...] = (),
    relays_connected: frozenset[str] = frozenset(),
) -> Lane:
    """How to reach an advertiser (see the module docstring).

    Args:
        http_url: the URL it advertised (empty: none).
        http_proven: that URL answered a whoami challenge with its key (or proof is not
            required here).
        stream_lane: it advertised a stream lane.
        connected: this node holds a direct (not relayed) libp2p connection to it now.
        relays: the relays' PeerIDs it advertised (it holds a reservation on each).
        relays_connected: PeerIDs this node holds a direct connection to.
    """
    if http_url and http_proven:
        return Lane.HTTP
    if stream_lane and connected:
        return Lane.STREAM
    if stream_lane and any(r in relays_connected for r in relays):
        return Lane.PUNCH
    return Lane.NONE


@dataclass(frozen=True)
class PunchConfig:
    """Reservations and hole punches of one node (see the module docstring).

    Raises:
        ConfigError: a field is out of range (names the field).

    Attributes:
        max_relays: reservations an unreachable node holds (and relays it advertises).
        max_concurrent: hole punches a downloader runs at once.
        backoff_initial_s: a PeerID whose punch failed is not tried again for this long,
            seconds; doubled after each further failure in a row ...
        backoff_max_s: ... up to this, seconds.
        circuit_retry_s: a punch whose relayed dial failed (no circuit: the peer's
            reservation not made yet, the relay's circuit slots full, a stream that did not
            open) never tried the NATs, so that PeerID is tried again after this, seconds,
            doubling, at most ``backoff_initial_s``: a node that just started met such
            failures with the full backoff and held punched connections to few NATed peers
            for the first minute.
        max_tracked: bound on remembered PeerIDs (the oldest failure is forgotten first).
        reserve_interval_s: an unreachable node looks for relays to reserve on at least this
            often, seconds.
        yield_s: when both ends could punch each other (both behind NATs, both naming
            relays), the one with the greater PeerID waits this long, seconds, from when it
            first wanted to, for the other's punch: two punch sessions of one pair at once
            dial the same address pairs and both fail (measured on loopback).
        ahead_max_direct: nodes behind NATs (advertising a stream lane) this node punches to
            ahead of need, until it holds direct connections to this many of them (punches
            running count too; 0: punch only when a download wants the bytes).
        ahead_interval_s: how often a follower looks for nodes to punch ahead when no advert
            arrives meanwhile (each advert heard also wakes it), seconds.
    """

    max_relays: int = 2
    max_concurrent: int = 2
    backoff_initial_s: float = 60.0
    backoff_max_s: float = 1800.0
    circuit_retry_s: float = 5.0
    max_tracked: int = 1024
    reserve_interval_s: float = 30.0
    yield_s: float = 10.0
    ahead_max_direct: int = 8
    ahead_interval_s: float = 5.0

    def __post_init__(self) -> None:
        for name in ("max_relays", "max_concurrent", "max_tracked"):
            if getattr(self, name) < 1:
                raise ConfigError(name, "must be >= 1")
        if self.ahead_max_direct < 0:
            raise ConfigError("ahead_max_direct", "must be >= 0")
        if not self.ahead_interval_s > 0:
            raise ConfigError("ahead_interval_s", "must be > 0")
        if not 0 < self.backoff_initial_s <= self.backoff_max_s:
            raise ConfigError("backoff_initial_s", "must be > 0 and <= backoff_max_s")
        if not 0 < self.circuit_retry_s <= self.backoff_initial_s:
            raise ConfigError("circuit_retry_s", "must be > 0 and <= backoff_initial_s")
        if not self.reserve_interval_s > 0:
            raise ConfigError("reserve_interval_s", "must be > 0")
        if self.yield_s < 0:
            raise ConfigError("yield_s", "must be >= 0")


class Reservations:
    """Which relays an unreachable node holds a reservation on (see the module docstring);
    pure, bounded by the candidates it is given. A relay that refused is not asked again for
    :attr:`PunchConfig.backoff_initial_s`, doubling to :attr:`PunchConfig.backoff_max_s`."""

    def __init__(self, config: PunchConfig) -> None:
        self.config = config
        self.held: list[str] = []
        self._failures: dict[str, tuple[int, float]] = {}  # relay -> failures, retry at

    def wanted(self, reach: Reach, candidates: list[str], now: float) -> list[str]:
        """The relays to ask now: none unless ``reach`` is ``unreachable``; else
        ``candidates`` (relays this node holds a direct connection to, best first) neither
        held nor backing off, until :attr:`PunchConfig.max_relays` are held."""
        if reach is not Reach.UNREACHABLE:
            return []
        room = max(0, self.config.max_relays - len(self.held))
        free = [
            c
            for c in candidates
            if c not in self.held and now >= self._failures.get(c, (0, now))[1]
        ]
        return free[:room]

    def reserved(self, relay: str) -> None:
        """``relay`` granted a reservation."""
        self._failures.pop(relay, None)
        if relay not in self.held:
            self.held.append(relay)

    def failed(self, relay: str, now: float) -> None:
        """``relay`` refused or did not answer at ``now``."""
        n = self._failures.get(relay, (0, now))[0] + 1
        wait = min(self.config.backoff_max_s, self.config.backoff_initial_s * 2 ** (n - 1))
        self._failures[relay] = (n, now + wait)

    def keep_connected(self, connected: frozenset[str]) -> bool:
        """Forget reservations on relays no longer in ``connected`` (a reservation lives on
        its connection) and failures of relays gone; True if :attr:`held` changed."""
        before = list(self.held)
        self.held = [r for r in self.held if r in connected]
        self._failures = {r: v for r, v in self._failures.items() if r in connected}
        return self.held != before

    def advertised(self, reach: Reach) -> tuple[str, ...]:
        """The relays to put in adverts: those held, while ``reach`` is ``unreachable``."""
        return tuple(self.held) if reach is Reach.UNREACHABLE else ()


@dataclass(frozen=True)
class PunchTarget:
    """An advertiser this node can reach only by a hole punch (:attr:`Lane.PUNCH`), as
    :meth:`PunchPlanner.ahead` weighs it.

    Attributes:
        peer_id: its PeerID.
        relays: the relays it advertised a reservation on.
        newest: the newest step it holds or fills (-1: none yet).
        yield_to_peer: it may be punching this node (see :attr:`PunchConfig.yield_s`).
    """

    peer_id: str
    relays: tuple[str, ...]
    newest: int = -1
    yield_to_peer: bool = False


class PunchPlanner:
    """When a downloader hole-punches to an advertiser (see the module docstring); pure,
    bounded memory. :meth:`start` admits a punch, :meth:`done` records how it ended."""

    def __init__(self, config: PunchConfig) -> None:
        self.config = config
        self.running: set[str] = set()
        self._failures: OrderedDict[str, tuple[int, float]] = OrderedDict()  # n, retry at
        self._first_wanted: OrderedDict[str, float] = OrderedDict()  # while yielding

    def retry_at(self, peer_id: str) -> float | None:
        """When ``peer_id`` may be punched again after failures (None: no failure now)."""
        entry = self._failures.get(peer_id)
        return entry[1] if entry is not None else None

    def start(
        self,
        peer_id: str,
        relays: tuple[str, ...],
        relays_connected: frozenset[str],
        now: float,
        rng: random.Random,
        *,
        yield_to_peer: bool = False,
    ) -> str | None:
        """The relay to punch ``peer_id`` through now (counted as running until
        :meth:`done`), or None: no advertised relay is connected here, a punch to it runs,
        :attr:`PunchConfig.max_concurrent` run, it is backing off, or ``yield_to_peer``
        (the peer may be punching this node: see :attr:`PunchConfig.yield_s`) and less than
        ``yield_s`` passed since this node first asked. The relay is drawn with ``rng``
        among the shared ones (spreads the relays' circuit slots)."""
        shared = [r for r in relays if r in relays_connected]
        if not shared or peer_id in self.running:
            return None
        if yield_to_peer:
            first = self._first_wanted.setdefault(peer_id, now)
            while len(self._first_wanted) > self.config.max_tracked:
                self._first_wanted.popitem(last=False)
            if now - first < self.config.yield_s:
                return None
        if len(self.running) >= self.config.max_concurrent:
            return None
        retry = self.retry_at(peer_id)
        if retry is not None and now < retry:
            return None
        self.running.add(peer_id)
        return rng.choice(shared)

    def ahead(
        self,
        targets: Sequence[PunchTarget],
        relays_connected: frozenset[str],
        held: int,
        now: float,
        rng: random.Random,
    ) -> list[tuple[str, str]]:
        """Punches to start now ahead of need (module docstring, "Punching ahead"): pairs
        ``(peer_id, relay)``, each admitted by :meth:`start` (so counted as running until
        :meth:`done`).

        Args:
            targets: advertisers reachable only by a punch (none held directly).
            relays_connected: PeerIDs this node holds a direct connection to.
            held: nodes behind NATs (stream-lane advertisers) held directly now.
            now: trio seconds.
            rng: the seeded generator that orders targets of equal ``newest``.

        Returns:
            at most ``ahead_max_direct - held - running`` pairs (none when that is <= 0),
            targets of the newest ``newest`` first, drawn with ``rng`` among equals.
        """
        room = self.config.ahead_max_direct - held - len(self.running)
        if room <= 0:
            return []
        order = list(targets)
        rng.shuffle(order)
        order.sort(key=lambda t: -t.newest)  # stable: drawn among equals
        out: list[tuple[str, str]] = []
        for t in order:
            if len(out) >= room:
                break
            relay = self.start(
                t.peer_id, t.relays, relays_connected, now, rng, yield_to_peer=t.yield_to_peer
            )
            if relay is not None:
                out.append((t.peer_id, relay))
        return out

    def done(self, peer_id: str, *, direct: bool, now: float, circuit: bool = True) -> None:
        """A punch admitted by :meth:`start` ended: ``direct`` if a direct connection
        came of it (forgets the failures), else backs off: from ``backoff_initial_s``, or
        from ``circuit_retry_s`` (at most ``backoff_initial_s``) when ``circuit`` is False
        (the relayed dial failed: the NATs were not tried)."""
        self.running.discard(peer_id)
        self._first_wanted.pop(peer_id, None)
        if direct:
            self._failures.pop(peer_id, None)
            return
        n = self._failures.pop(peer_id, (0, 0.0))[0] + 1
        if circuit:
            wait = min(self.config.backoff_max_s, self.config.backoff_initial_s * 2 ** (n - 1))
        else:
            wait = min(self.config.backoff_initial_s, self.config.circuit_retry_s * 2 ** (n - 1))
        self._failures[peer_id] = (n, now + wait)
        while len(self._failures) > self.config.max_tracked:
            self._failures.popitem(last=False)


class LaneCheck(enum.Enum):
    """The outcome of a whoami challenge of an advertised URL (value: the status string)."""

    VERIFIED = "verified"
    UNREACHABLE = "unreachable"
    """No answer: refused, timed out, or not HTTP."""
    BAD_ANSWER = "bad_answer"
    """An answer that does not prove the advertiser's key (another node is there)."""


class DialbackResult(enum.Enum):
    """One asked node's answer (value: the wire string); ``FAILED`` is the asker's own
    outcome when the ask itself failed (no answer, or the node does not speak the protocol)."""

    REACHED = "reached"
    NOT_REACHED = "not_reached"
    MISMATCH = "mismatch"
    REFUSED = "refused"
    FAILED = "failed"


_WIRE_RESULTS = {r.value: r for r in DialbackResult if r is not DialbackResult.FAILED}


@dataclass(frozen=True)
class DialbackRequest:
    """The asker's request: its lane ``url`` (``http://host:port``) and a fresh ``nonce``."""

    url: str
    nonce: str

    def encode(self) -> bytes:
        """Canonical CBOR bytes."""
        return wire.encode({"v": 1, "url": self.url, "nonce": self.nonce})

    @classmethod
    def decode(cls, data: bytes, sender: str) -> DialbackRequest:
        """Parse a request from ``sender``.

        Raises:
            RemoteProtocolError: malformed, a URL that is not ``http://host:port``, or a
                nonce that is not 32 lowercase hex characters.
        """
        obj = wire.decode(data, max_bytes=MAX_DIALBACK_BYTES, sender=sender)
        wire.need_version(obj, 1, "dialback request", sender)
        url = wire.need_str(obj, "url", 256, sender)
        nonce = wire.need_str(obj, "nonce", _NONCE_LEN, sender)
        if url_host(url) is None:
            raise RemoteProtocolError(sender, f"dialback url {url!r} is not http://host:port")
        if len(nonce) != _NONCE_LEN or not all(c in "0123456789abcdef" for c in nonce):
            raise RemoteProtocolError(sender, "dialback nonce must be 32 lowercase hex")
        return cls(url, nonce)


@dataclass(frozen=True)
class DialbackAnswer:
    """The asked node's answer: a result and the address it saw the asker come from."""

    result: DialbackResult
    observed: str

    def encode(self) -> bytes:
        """Canonical CBOR bytes."""
        return wire.encode({"v": 1, "result": self.result.value, "observed": self.observed})

    @classmethod
    def decode(cls, data: bytes, sender: str) -> DialbackAnswer:
        """Parse an answer from ``sender``.

        Raises:
            RemoteProtocolError: malformed or an unknown result.
        """
        obj = wire.decode(data, max_bytes=MAX_DIALBACK_BYTES, sender=sender)
        wire.need_version(obj, 1, "dialback answer", sender)
        result = _WIRE_RESULTS.get(wire.need_str(obj, "result", 32, sender))
        if result is None:
            raise RemoteProtocolError(sender, "unknown dialback result")
        return cls(result, wire.need_str(obj, "observed", 64, sender))


def url_host(url: str) -> str | None:
    """The host of an ``http://host:port`` URL (brackets of IPv6 removed), or None if the URL
    is not of that form."""
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError:
        return None
    if parts.scheme != "http" or not parts.hostname or port is None or parts.path:
        return None
    return parts.hostname


def _ip(text: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    try:
        return ipaddress.ip_address(text)
    except ValueError:
        return None


def same_address(a: str, b: str) -> bool:
    """True if ``a`` and ``b`` name the same IP address (``::ffff:10.0.0.1`` is
    ``10.0.0.1``); names that are not IP literals never match."""
    x, y = _ip(a), _ip(b)
    if x is None or y is None:
        return False
    if isinstance(x, ipaddress.IPv6Address) and x.ipv4_mapped is not None:
        x = x.ipv4_mapped
    if isinstance(y, ipaddress.IPv6Address) and y.ipv4_mapped is not None:
        y = y.ipv4_mapped
    return x == y


def is_global(host: str) -> bool:
    """True if ``host`` is a global IP address (reachable across the internet if routed); a
    DNS name counts as global (it is meant to be resolved from anywhere)."""
    ip = _ip(host)
    return True if ip is None else ip.is_global


Interface = ipaddress.IPv4Interface | ipaddress.IPv6Interface
"""One of this host's interface addresses with its prefix length (``192.168.77.2/24``)."""


def _unmapped(
    ip: ipaddress.IPv4Address | ipaddress.IPv6Address,
) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        return ip.ipv4_mapped
    return ip


Network = ipaddress.IPv4Network | ipaddress.IPv6Network


def parse_networks(
    cidrs: Sequence[str], field_name: str = "public_networks"
) -> tuple[Network, ...]:
    """``cidrs`` (``10.0.0.0/8``, ``fd00:1::/48``; host bits allowed) as networks.

    Raises:
        ConfigError: one is not an IPv4 or IPv6 network (names ``field_name`` and it).
    """
    out = []
    for text in cidrs:
        try:
            out.append(ipaddress.ip_network(text, strict=False))
        except ValueError as exc:
            raise ConfigError(field_name, f"{text!r} is not a network (CIDR): {exc}") from exc
    return tuple(out)


def lane_in_scope(
    url: str,
    observed: Sequence[str],
    interfaces: Sequence[Interface],
    public: Sequence[Network] = (),
) -> bool:
    """Whether this node may try ``url``, a lane URL another node advertised (module
    docstring, "LAN scope").

    Args:
        url: ``http://host:port``.
        observed: the addresses the advertiser's connections to this node come from, as seen
            here (empty: not connected, or not known).
        interfaces: this host's interface addresses with their prefix lengths.
        public: networks this deployment treats as global
            (:attr:`ReachabilityConfig.public_networks`).

    Returns:
        True for a DNS name, a global address or one in ``public``; for any other address (private,
        loopback, link-local, unique local, shared): True if it is one of ``observed``; else False
        if an ``observed`` address is global (the advertiser reaches this node across the internet,
        so its LAN is not this node's); else for a loopback address True only if every ``observed``
        address is loopback (the advertiser runs on this host), and for the others True if it lies
        on the network of one of ``interfaces``. False for a URL that is not ``http://host:port``.
    """
    host = url_host(url)
    if host is None:
        return False
    ip = _ip(host)
    if ip is None or ip.is_global:
        return True
    ip = _unmapped(ip)
    if any(ip in n for n in public):
        return True
    seen = [_unmapped(o) for o in (_ip(text) for text in observed) if o is not None]
    if ip in seen:
        return True
    if any(o.is_global for o in seen):
        return False
    if ip.is_loopback:
        return all(o.is_loopback for o in seen)
    return any(ip in i.network for i in interfaces)


def scoped_lane(
    http_url: str,
    lan_url: str,
    observed: Sequence[str],
    interfaces: Sequence[Interface],
    public: Sequence[Network] = (),
) -> str:
    """The URL of an advert (its ``http_url`` and ``lan_url``) that this node may try:
    ``lan_url`` if the advertiser's connection to this node comes from that very address (a
    neighbour on this LAN: its ``http_url``, say a port mapped on the home router, would go
    out through the router and back, which routers without NAT loopback refuse); else the
    first of the two that is non-empty and :func:`lane_in_scope` (with ``public``); else
    ``""`` (nothing to try: the advert then offers no HTTP source here)."""
    lan_host = url_host(lan_url) if lan_url else None
    if lan_host is not None and any(same_address(lan_host, o) for o in observed):
        return lan_url
    for url in (http_url, lan_url):
        if url and lane_in_scope(url, observed, interfaces, public):
            return url
    return ""


def judge_request(url: str, observed: list[str]) -> DialbackResult | None:
    """The asked node's rule (see the module docstring): None if the URL may be dialled (its
    host is one of the addresses the asker's connections come from), else ``MISMATCH``.
    ``observed`` empty (the address is not known) gives ``REFUSED``."""
    host = url_host(url)
    if not observed:
        return DialbackResult.REFUSED
    if host is not None and any(same_address(host, o) for o in observed):
        return None
    return DialbackResult.MISMATCH


@dataclass(frozen=True)
class DialbackLimits:
    """Bounds of the asked node.

    Attributes:
        per_peer_interval_s: one dial per asking PeerID per this many seconds (later asks
            are refused).
        per_address_interval_s: one dial per asking address per this many seconds (many
            PeerIDs of one host get no more; a short interval: peers behind one carrier NAT
            share an address).
        max_concurrent: dials running at once (more are refused).
        dial_timeout_s: the whoami fetch's timeout, seconds.
        max_tracked: bound on remembered askers.
    """

    per_peer_interval_s: float = 30.0
    per_address_interval_s: float = 1.0
    max_concurrent: int = 4
    dial_timeout_s: float = 5.0
    max_tracked: int = 4096


class DialbackLimiter:
    """Admission of dial-back requests (see :class:`DialbackLimits`); bounded memory."""

    def __init__(self, limits: DialbackLimits) -> None:
        self.limits = limits
        self._last: OrderedDict[str, float] = OrderedDict()  # PeerID or address -> last dial
        self.running = 0

    def admit(self, peer_id: str, address: str, now: float) -> bool:
        """True (and counted as running until :meth:`done`) if a dial for ``peer_id`` seen at
        ``address`` may start at ``now``."""
        if self.running >= self.limits.max_concurrent:
            return False
        lim = self.limits
        for key, interval in (
            (peer_id, lim.per_peer_interval_s),
            (address, lim.per_address_interval_s),
        ):
            last = self._last.get(key)
            if last is not None and now - last < interval:
                return False
        for key in (peer_id, address):
            self._last.pop(key, None)
            self._last[key] = now
        while len(self._last) > self.limits.max_tracked:
            self._last.popitem(last=False)
        self.running += 1
        return True

    def done(self) -> None:
        """A dial admitted by :meth:`admit` has ended."""
        self.running -= 1


def lan_asker(
    url: str,
    asker_hosts: Sequence[str],
    interfaces: Sequence[Interface],
    public: Sequence[Network] = (),
) -> bool:
    """Whether an asker seen here at ``asker_hosts`` (the remote addresses of this node's
    connections to it) sits on the network of this node's own lane ``url``, so that its
    answer speaks for that network only: a neighbour behind the same home router reaches a
    private URL that nobody outside can (:meth:`Reachability.observe`).

    True if ``url``'s host is a non-global address (not in ``public``) on the network of one
    of ``interfaces`` (loopback: the loopback network) and an asker address lies on that same
    network; False otherwise (a DNS name, a global or ``public`` address, an asker elsewhere,
    or nothing known of the asker).
    """
    host = url_host(url)
    ip = _ip(host) if host is not None else None
    if ip is None or ip.is_global:
        return False
    ip = _unmapped(ip)
    if any(ip in n for n in public):
        return False
    nets = [i.network for i in interfaces if ip in i.network]
    if ip.is_loopback:
        nets.append(ipaddress.ip_network("127.0.0.0/8" if ip.version == 4 else "::1/128"))
    seen = [_unmapped(o) for o in (_ip(text) for text in asker_hosts) if o is not None]
    return any(o in n for o in seen for n in nets if o.version == n.version)


def verdict(url: str, answers: list[DialbackResult]) -> Reach:
    """What one round of answers about ``url`` says (see the module docstring)."""
    if DialbackResult.REACHED in answers:
        return Reach.REACHABLE
    if DialbackResult.NOT_REACHED in answers:
        return Reach.UNREACHABLE
    host = url_host(url)
    if DialbackResult.MISMATCH in answers and host is not None and not is_global(host):
        return Reach.UNREACHABLE
    return Reach.UNKNOWN


@dataclass(frozen=True)
class ReachabilityConfig:
    """When the asker checks.

    Attributes:
        askers: connected nodes asked per round (upstreams first).
        recheck_s: a reachable or unreachable verdict is checked again after this, seconds.
        retry_s: an unknown one (or a round with no one to ask) after this, seconds.
        ask_timeout_s: one ask's timeout (the asked node's dial included), seconds.
        serve_behind_nat: while the lane is unreachable, serve through the NAT anyway: offer
            the stream lane (:meth:`Reachability.advertises_stream`) and hold relay
            reservations that others hole-punch through; off: such a node only downloads
            (its ``lan_url`` is still offered to its own network).
        public_networks: CIDRs whose addresses count as global for LAN scope
            (:func:`lane_in_scope`): a deployment across a private WAN, VPN or overlay.

    Raises:
        ConfigError: a ``public_networks`` entry is not a CIDR.
    """

    askers: int = 3
    recheck_s: float = 600.0
    retry_s: float = 30.0
    ask_timeout_s: float = 10.0
    serve_behind_nat: bool = True
    public_networks: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        parse_networks(self.public_networks)

    def networks(self) -> tuple[Network, ...]:
        """:attr:`public_networks`, parsed."""
        return parse_networks(self.public_networks)


@dataclass
class Reachability:
    """What this node knows of its own lane ``url`` (pure; ``now`` in trio seconds).

    Attributes:
        state: the latest verdict.
        since: when ``state`` was first reached (None: never checked).
        checked_at: when the latest round ended (None: never).
        last_answers: the latest round's answers (of a round with any).
        rounds: rounds that had answers.
        answers_total: every answer recorded, by result (metrics).
    """

    url: str
    config: ReachabilityConfig = field(default_factory=ReachabilityConfig)
    state: Reach = Reach.UNKNOWN
    since: float | None = None
    checked_at: float | None = None
    last_answers: tuple[DialbackResult, ...] = ()
    rounds: int = 0
    answers_total: Counter[DialbackResult] = field(default_factory=Counter)
    from_outside: bool = False
    """``state`` came from askers outside the lane's own network (:meth:`observe`)."""

    def _wait_s(self) -> float:
        if self.rounds == 0:
            return self.config.retry_s / 10  # no one answered yet: ask again soon
        return self.config.retry_s if self.state is Reach.UNKNOWN else self.config.recheck_s

    def due(self, now: float) -> bool:
        """True if a round should run at ``now``."""
        return self.checked_at is None or now - self.checked_at >= self._wait_s()

    def next_due(self, now: float) -> float:
        """Seconds from ``now`` until :meth:`due` (0 if due)."""
        if self.checked_at is None:
            return 0.0
        return max(0.0, self.checked_at + self._wait_s() - now)

    def observe(self, answers: list[DialbackResult], now: float, lan: Sequence[bool] = ()) -> bool:
        """Record a round's answers; True if what to advertise changed (the URL,
        :meth:`advertised`, or the stream lane, :meth:`advertises_stream`: a node whose
        unreachable URL was never advertised still starts to offer its stream lane). A round
        with no answers or only ``refused`` ones (no one could check now) only schedules the
        next one, soon.

        ``lan[i]`` (:func:`lan_asker`) marks ``answers[i]`` as given from the lane's own
        network. Answers from outside decide when they say anything (``reached`` or not); a
        round of neighbours only decides while no outside round has (a flat private network,
        or one host: every asker is a neighbour), else it tells nothing: a peer behind a home
        router, told ``not_reached`` by its relay, stays unreachable (and keeps its stream
        lane) when a neighbour behind the same router reaches its private URL.

        A round that tells nothing (``unknown``) does not undo an earlier verdict."""
        before = (self.advertised(), self.advertises_stream())
        self.checked_at = now
        self.answers_total.update(answers)
        if all(a is DialbackResult.REFUSED for a in answers):
            return False  # no one could check now (rate limits): ask again soon
        self.rounds += 1
        self.last_answers = tuple(answers)
        marks = list(lan) + [False] * (len(answers) - len(lan))
        outside = verdict(self.url, [a for a, m in zip(answers, marks, strict=True) if not m])
        new: Reach
        if outside is not Reach.UNKNOWN:
            new, self.from_outside = outside, True
        elif self.from_outside:
            new = Reach.UNKNOWN  # neighbours only: they cannot undo what outside said
        else:
            new = verdict(self.url, [a for a, m in zip(answers, marks, strict=True) if m])
        if new is Reach.UNKNOWN and self.state is not Reach.UNKNOWN:
            return False
        if new is not self.state or self.since is None:
            self.state, self.since = new, now
        return (self.advertised(), self.advertises_stream()) != before

    def advertised(self) -> str:
        """The URL to put in adverts: empty before the first round with answers and while
        unreachable."""
        if self.rounds == 0 or self.state is Reach.UNREACHABLE:
            return ""
        return self.url

    def advertises_stream(self) -> bool:
        """True if adverts should offer the stream lane: the URL is known unreachable (the
        node serves only over connections it holds) and
        :attr:`ReachabilityConfig.serve_behind_nat` is on."""
        return self.config.serve_behind_nat and self.rounds > 0 and self.state is Reach.UNREACHABLE

    def lan_advertised(self, interfaces: Sequence[Interface]) -> str:
        """The URL to offer to nodes on this node's own network only (advert key
        ``lan_url``): the lane URL when :meth:`advertised` does not offer it and its host is a
        non-global address of this host (one of ``interfaces``, or loopback); else empty. A
        URL on another address (a NAT router's, named with ``--public-host``) is not offered:
        neighbours reach this host at its own address, not at the router's."""
        host = url_host(self.url)
        ip = _ip(host) if host is not None else None
        if ip is None or ip.is_global or self.advertised():
            return ""
        ip = _unmapped(ip)
        if ip.is_loopback or any(ip == i.ip for i in interfaces):
            return self.url
        return ""

    def status(self, wall_of: Callable[[float], str]) -> dict[str, Any]:
        """The ``reachability`` section of ``/status``; ``wall_of(t)`` turns a trio time into
        an ISO wall-clock string."""
        return {
            "http_url": self.url,
            "state": self.state.value,
            "advertised": bool(self.advertised()),
            "stream_lane": self.advertises_stream(),
            "since": wall_of(self.since) if self.since is not None else None,
            "checked_at": wall_of(self.checked_at) if self.checked_at is not None else None,
            "last_answers": [a.value for a in self.last_answers],
        }
