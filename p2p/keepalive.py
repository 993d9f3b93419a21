"""When a libp2p connection is dead, and when to dial a lost peer again (sans-IO).

Theory of operation
-------------------
A TCP connection can die without either side hearing of it: a NAT that flushed its
connection-tracking table, a mobile handover, a cable pulled on a middlebox. Both kernels keep
the socket ``ESTABLISHED``; writes pile up in the send queue, reads never return, and every
request on the connection times out while the node still counts the peer as connected (so
nothing ever re-dials it). :class:`Keepalive` decides, per remote peer:

1. **when to ping**: every ``ping_interval_s`` on each connected peer (libp2p ping,
   ``/ipfs/ping/1.0.0``), one ping in flight at a time; again at once after a ping that timed
   out, and ``ping_timeout_s`` after one that failed fast (refused, reset: the connection is
   closing, as when its peer leaves, and the swarm reports it gone meanwhile; pinged again at
   once, three such failures in a few milliseconds declared a departing peer's connection
   "dead", a WARNING for a clean exit);
2. **when a connection is dead**: after ``dead_after_failures`` consecutive failures, a failure
   being a ping that timed out or broke, or a request on the connection that timed out
   (:class:`Outcome`), the last of them a ping: a timed-out request makes the connection
   suspect and pings it at once, so a slow handler on a live peer (whose ping is answered)
   never gets it closed, while a dead one is found within a ping timeout. Any answer (a pong,
   a request answered) resets the count. A dead connection is closed by the driver, which
   makes the peer disconnected;
3. **when to re-dial**: a *kept* peer (one this node dialled and must stay connected to: the
   trainer, its upstreams, bootstrap relays) is dialled again after it disconnects, on an
   exponential schedule with jitter, capped (:meth:`Keepalive.backoff_s`, the schedule of
   gRPC's connection backoff: ``initial * 2**attempt``, jittered by ``±jitter``, at most
   ``redial_max_s``);
4. **when to warn**: the moment every kept peer is disconnected (once, until one is back).

It holds no sockets, takes ``now`` (seconds, any monotonic clock) and a seeded
``random.Random`` as arguments and returns what to do; the trio driver in :mod:`p2p.host`
does the pinging, closing and dialling. Memory is bounded by the number of peers with a
connection plus the kept peers.
"""

from __future__ import annotations

import enum
import random
from dataclasses import dataclass, field

from p2p.errors import ConfigError


class Outcome(enum.Enum):
    """What the driver observed on a connection (value: the metric label)."""

    PONG = "pong"
    PING_TIMEOUT = "ping_timeout"
    PING_FAILED = "ping_failed"
    REQUEST_ANSWERED = "request_answered"
    REQUEST_TIMEOUT = "request_timeout"

    @property
    def failed(self) -> bool:
        """True for the outcomes that count towards a dead connection."""
        return self in (Outcome.PING_TIMEOUT, Outcome.PING_FAILED, Outcome.REQUEST_TIMEOUT)


class Verdict(enum.Enum):
    """The state of a connection after an :class:`Outcome` (value: the log string)."""

    ALIVE = "alive"
    SUSPECT = "suspect"  # failed lately, not yet dead
    DEAD = "dead"  # close it now


@dataclass(frozen=True)
class KeepaliveConfig:
    """Liveness checks of libp2p connections and re-dials of kept peers.

    Attributes:
        ping_interval_s: seconds between pings on one connection (> 0).
        ping_timeout_s: a ping not answered in this many seconds failed (> 0).
        dead_after_failures: consecutive failed pings or timed-out requests that make a
            connection dead (>= 1). With the defaults a silent connection is closed 15-20 s
            after it went silent.
        redial_initial_s: delay before the first re-dial of a lost kept peer, seconds (> 0).
        redial_max_s: cap on the delay between re-dials, seconds (>= ``redial_initial_s``).
        redial_jitter: each delay is scaled by a uniform factor in ``1 ± jitter`` (0..1).
        tcp_user_timeout_s: the kernel aborts a TCP connection whose sent data stays
            unacknowledged this long (``TCP_USER_TIMEOUT``; Linux; 0: the kernel's default of
            ~15 min of retransmissions); TCP keepalive probes idle connections too.
        close_timeout_s: closing the host: a graceful close of its connections (yamux
            GO_AWAY, Noise, TCP FIN) gets this long before their sockets are aborted, the
            close then as long again, and the whole teardown at most three times this long
            (seconds; the default keeps a stop under 5 s; a close that waits behind a full
            send buffer would otherwise wait for ever).
    """

    ping_interval_s: float = 5.0
    ping_timeout_s: float = 5.0
    dead_after_failures: int = 3
    redial_initial_s: float = 1.0
    redial_max_s: float = 30.0
    redial_jitter: float = 0.2
    tcp_user_timeout_s: float = 30.0
    close_timeout_s: float = 1.5

    def __post_init__(self) -> None:
        for name in ("ping_interval_s", "ping_timeout_s", "redial_initial_s"):
            if not getattr(self, name) > 0:
                raise ConfigError(name, "must be > 0")
        if self.dead_after_failures < 1:
            raise ConfigError("dead_after_failures", "must be >= 1")
        if self.redial_max_s < self.redial_initial_s:
            raise ConfigError("redial_max_s", "must be >= redial_initial_s")
        if not 0 <= self.redial_jitter <= 1:
            raise ConfigError("redial_jitter", "must be in 0..1")
        if self.tcp_user_timeout_s < 0:
            raise ConfigError("tcp_user_timeout_s", "must be >= 0")
        if not self.close_timeout_s > 0:
            raise ConfigError("close_timeout_s", "must be > 0")


@dataclass(frozen=True)
class KeepaliveStats:
    """Counters since start.

    Attributes:
        pings: pings answered or failed.
        failures: failed pings and timed-out requests, by :class:`Outcome` value.
        closed_dead: connections declared dead, by the :class:`Outcome` that decided it.
        redials: re-dials of kept peers started.
        redials_ok: of those, the ones that connected.
        redials_failed: of those, the ones that failed.
        kept: kept peers now; kept_connected: of those, connected now.
    """

    pings: int
    failures: dict[str, int]
    closed_dead: dict[str, int]
    redials: int
    redials_ok: int
    redials_failed: int
    kept: int
    kept_connected: int


@dataclass
class _Peer:
    connected: bool = False
    failures: int = 0
    next_ping: float | None = None
    pinging: bool = False
    addr: str | None = None  # kept peers: the address to re-dial
    attempt: int = 0
    next_dial: float | None = None
    dialling: bool = False


@dataclass
class Keepalive:
    """Per-peer liveness and re-dial decisions (see the module docstring).

    Peers are base58 PeerIDs (any hashable string). Not thread-safe; one per node.
    """

    config: KeepaliveConfig = field(default_factory=KeepaliveConfig)
    _peers: dict[str, _Peer] = field(default_factory=dict)
    _pings: int = 0
    _failures: dict[str, int] = field(default_factory=dict)
    _closed: dict[str, int] = field(default_factory=dict)
    _redials: int = 0
    _redials_ok: int = 0
    _redials_failed: int = 0
    _lost_all_said: bool = False

    def backoff_s(self, attempt: int, rng: random.Random) -> float:
        """Delay before re-dial number ``attempt`` (0 = the first), seconds: ``initial *
        2**attempt`` scaled by a uniform factor in ``1 ± jitter``, at most ``redial_max_s``."""
        c = self.config
        base = c.redial_initial_s * 2.0 ** min(attempt, 62)
        scaled = base * (1 + c.redial_jitter * (2 * rng.random() - 1))
        return min(c.redial_max_s, scaled)

    def keep(self, peer: str, addr: str, now: float, rng: random.Random) -> None:
        """Keep ``peer`` connected, re-dialling ``addr`` whenever it is lost. If it is not
        connected now, its first dial is scheduled."""
        p = self._peers.setdefault(peer, _Peer())
        p.addr = addr
        if not p.connected and p.next_dial is None and not p.dialling:
            p.next_dial = now + self.backoff_s(p.attempt, rng)

    def release(self, peer: str) -> None:
        """Stop re-dialling ``peer`` (its connection, if any, stays and is still pinged)."""
        p = self._peers.get(peer)
        if p is None:
            return
        p.addr, p.next_dial, p.attempt = None, None, 0
        if not p.connected and not p.dialling:
            del self._peers[peer]

    def connected(self, peer: str, now: float) -> None:
        """``peer`` has a connection (its first one): ping it from ``now + interval``."""
        p = self._peers.setdefault(peer, _Peer())
        p.connected, p.failures, p.pinging = True, 0, False
        p.next_ping = now + self.config.ping_interval_s
        p.attempt, p.next_dial = 0, None
        self._lost_all_said = False

    def disconnected(self, peer: str, now: float, rng: random.Random) -> None:
        """``peer``'s last connection closed: a kept peer's re-dial is scheduled, any other
        peer is forgotten."""
        p = self._peers.get(peer)
        if p is None:
            return
        p.connected, p.failures, p.pinging, p.next_ping = False, 0, False, None
        if p.addr is None:
            if not p.dialling:
                del self._peers[peer]
            return
        if not p.dialling:
            p.next_dial = now + self.backoff_s(p.attempt, rng)

    def is_connected(self, peer: str) -> bool:
        """True between :meth:`connected` and :meth:`disconnected`."""
        p = self._peers.get(peer)
        return p is not None and p.connected

    def pings_due(self, now: float) -> list[str]:
        """Connected peers to ping now; each is marked as having a ping in flight."""
        due = [
            peer
            for peer, p in self._peers.items()
            if p.connected and not p.pinging and p.next_ping is not None and p.next_ping <= now
        ]
        for peer in due:
            self._peers[peer].pinging = True
        return due

    def observe(self, peer: str, outcome: Outcome, now: float) -> Verdict:
        """Record what a ping or a request to ``peer`` gave.

        Returns:
            :attr:`Verdict.DEAD` (only for a failed ping: see the module docstring) exactly
            once per dead connection (the driver closes it;
            the count restarts on the next :meth:`connected`), else ALIVE or SUSPECT. An
            outcome for a peer not connected is ALIVE and ignored.
        """
        p = self._peers.get(peer)
        if outcome in (Outcome.PONG, Outcome.PING_TIMEOUT, Outcome.PING_FAILED):
            self._pings += 1
            if p is not None and p.pinging:
                p.pinging = False
                if p.connected:
                    p.next_ping = now + self._ping_delay_s(outcome)
        if p is None or not p.connected or p.next_ping is None:
            return Verdict.ALIVE
        if not outcome.failed:
            p.failures = 0
            return Verdict.ALIVE
        self._failures[outcome.value] = self._failures.get(outcome.value, 0) + 1
        p.failures += 1
        if outcome is Outcome.REQUEST_TIMEOUT:
            if not p.pinging:
                p.next_ping = now  # ask the connection itself, now
            return Verdict.SUSPECT
        if p.failures < self.config.dead_after_failures:
            return Verdict.SUSPECT
        self._closed[outcome.value] = self._closed.get(outcome.value, 0) + 1
        p.next_ping = None  # no more pings or verdicts on this connection
        return Verdict.DEAD

    def _ping_delay_s(self, outcome: Outcome) -> float:
        """Seconds from a ping's end to the next ping (module docstring, point 1)."""
        if outcome is Outcome.PING_TIMEOUT:
            return 0.0  # a suspect path: ask it again at once
        if outcome is Outcome.PING_FAILED:
            return self.config.ping_timeout_s  # a closing connection: let the swarm say so
        return self.config.ping_interval_s

    def dials_due(self, now: float) -> list[tuple[str, str]]:
        """Kept peers to dial now, as ``(peer, addr)``; each is marked as being dialled."""
        due = [
            (peer, p.addr)
            for peer, p in self._peers.items()
            if p.addr is not None
            and not p.connected
            and not p.dialling
            and p.next_dial is not None
            and p.next_dial <= now
        ]
        for peer, _ in due:
            p = self._peers[peer]
            p.dialling, p.next_dial = True, None
            self._redials += 1
        return due

    def dial_done(self, peer: str, ok: bool, now: float, rng: random.Random) -> None:
        """A dial from :meth:`dials_due` ended; a failed one schedules the next, later."""
        p = self._peers.get(peer)
        if p is None:
            return
        p.dialling = False
        if ok:
            self._redials_ok += 1
            p.attempt = 0
            return
        self._redials_failed += 1
        if p.addr is None:
            if not p.connected:
                del self._peers[peer]
            return
        p.attempt += 1
        if not p.connected:
            p.next_dial = now + self.backoff_s(p.attempt, rng)

    def lost_all(self) -> bool:
        """True once when every kept peer is disconnected (there being at least one), until
        one connects again: the moment to say so at WARNING."""
        kept = [p for p in self._peers.values() if p.addr is not None]
        if not kept or any(p.connected for p in kept) or self._lost_all_said:
            return False
        self._lost_all_said = True
        return True

    def next_wakeup(self) -> float | None:
        """The earliest time a ping or a dial falls due (None: nothing scheduled)."""
        times = [
            t
            for p in self._peers.values()
            for t in (
                p.next_ping if p.connected and not p.pinging else None,
                p.next_dial if not p.dialling else None,
            )
            if t is not None
        ]
        return min(times, default=None)

    def statistics(self) -> KeepaliveStats:
        """Counters since start (see :class:`KeepaliveStats`)."""
        kept = [p for p in self._peers.values() if p.addr is not None]
        return KeepaliveStats(
            self._pings,
            dict(self._failures),
            dict(self._closed),
            self._redials,
            self._redials_ok,
            self._redials_failed,
            len(kept),
            sum(p.connected for p in kept),
        )
