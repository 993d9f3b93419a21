"""Per-peer resource limits and misbehaviour scores at the libp2p boundary (sans-IO).

Theory of operation
-------------------
py-libp2p 0.8.1 admits inbound streams with one global semaphore per request protocol (64
or 128 slots) and nothing per peer, so one connection that re-opens half-sent streams holds
every slot and honest peers are refused. This module is the bookkeeping of a small resource
manager in the spirit of go-libp2p's ``rcmgr``: every inbound stream is admitted into a
*scope* (``"*"`` for "any stream on the connection", or a protocol id) under two caps — one
per remote peer and one for the whole node — and released when its handler ends. A refusal
names which cap was hit (:class:`Refusal`), so the driver can log it and count it.

:class:`PeerLedger` keeps one misbehaviour score per remote peer: each :class:`Offence` (a
malformed frame, a request its handler rejected as the peer's fault, an invalid gossip
message, a request body not sent in time, a stream over its per-peer cap) subtracts its
penalty; the score recovers linearly with time; a peer whose score falls to ``ban_score`` is
banned for ``ban_s`` seconds (its streams are refused and its connections closed by the
driver). The ledger is bounded: the least recently touched peer
is forgotten first (an unknown peer starts clean, which is what a forgotten one gets).

Both classes are pure: they take ``now`` (seconds, any monotonic clock) as an argument and do
no I/O, so they are tested directly and reused by the simulator. Neither is thread-safe; the
trio driver calls them from one event loop.
"""

from __future__ import annotations

import enum
from collections import OrderedDict
from dataclasses import dataclass, field

from p2p.errors import ConfigError

ANY_STREAM = "*"
"""Scope of every inbound stream on a connection, whatever its protocol."""


class Refusal(enum.Enum):
    """Why an inbound stream was not admitted (the value is the metric / log string)."""

    PEER_LIMIT = "peer_limit"
    GLOBAL_LIMIT = "global_limit"
    BANNED = "banned"


class Offence(enum.Enum):
    """What a remote peer did wrong at the boundary (the value is the log string)."""

    MALFORMED_FRAME = "malformed_frame"
    BAD_REQUEST = "bad_request"
    INVALID_GOSSIP = "invalid_gossip"
    SLOW_REQUEST = "slow_request"
    OVER_LIMIT = "over_limit"


DEFAULT_PENALTIES: dict[Offence, float] = {
    Offence.MALFORMED_FRAME: 60.0,
    Offence.BAD_REQUEST: 10.0,
    Offence.INVALID_GOSSIP: 10.0,
    Offence.SLOW_REQUEST: 5.0,
    Offence.OVER_LIMIT: 1.0,
}


@dataclass(frozen=True)
class ScopeLimit:
    """Caps of one scope: concurrent inbound streams per remote peer and in total."""

    per_peer: int
    total: int

    def __post_init__(self) -> None:
        if not 1 <= self.per_peer <= self.total:
            raise ConfigError("limits", f"need 1 <= per_peer <= total, got {self}")


@dataclass(frozen=True)
class ResourceLimits:
    """Inbound stream limits of a node.

    Attributes:
        streams_per_peer: concurrent inbound streams of one remote peer, any protocol
            (counted from the moment the stream is accepted, before protocol negotiation).
        streams_total: concurrent inbound streams of all peers together.
        requests_per_peer: concurrent inbound requests of one peer on one request protocol.
        pubsub_streams_per_peer: concurrent inbound gossip streams of one peer (one is normal;
            a reconnect briefly makes two).
        request_read_timeout_s: bound on receiving a whole request body after the stream is
            negotiated, seconds of the node's own responsive time (:mod:`p2p.loop_lag`);
            separate from (and usually much shorter than) the handler's own time. Honest
            bodies between 7 loaded nodes on 2 cores took up to 2.06 s (66 of them over
            0.5 s in two loopback bench runs): 2 s charged honest peers, hence 5.
    """

    streams_per_peer: int = 64
    streams_total: int = 4096
    requests_per_peer: int = 8
    pubsub_streams_per_peer: int = 4
    request_read_timeout_s: float = 5.0

    def __post_init__(self) -> None:
        ScopeLimit(self.streams_per_peer, self.streams_total)
        if self.requests_per_peer < 1 or self.pubsub_streams_per_peer < 1:
            raise ConfigError("limits", "per-peer request and gossip stream caps must be >= 1")
        if not self.request_read_timeout_s > 0:
            raise ConfigError("request_read_timeout_s", "must be > 0")


@dataclass(frozen=True)
class Ticket:
    """Proof of one admitted stream; give it back to :meth:`ResourceManager.release`."""

    scope: str
    peer: str


@dataclass(frozen=True)
class ScopeStats:
    """Counters of one scope."""

    open: int
    admitted: int
    refused: dict[str, int]


class ResourceManager:
    """Counts open inbound streams per (scope, peer) and per scope against caps."""

    def __init__(self) -> None:
        self._limits: dict[str, ScopeLimit] = {}
        self._open: dict[str, dict[str, int]] = {}
        self._total: dict[str, int] = {}
        self._admitted: dict[str, int] = {}
        self._refused: dict[str, dict[str, int]] = {}

    def set_limit(self, scope: str, limit: ScopeLimit) -> None:
        """Set (or replace) the caps of ``scope``; streams already open stay counted."""
        self._limits[scope] = limit
        self._open.setdefault(scope, {})
        self._total.setdefault(scope, 0)
        self._admitted.setdefault(scope, 0)
        self._refused.setdefault(scope, {})

    def try_acquire(self, scope: str, peer: str) -> Ticket | Refusal:
        """Admit one stream of ``peer`` into ``scope``, or say which cap refuses it.

        A scope without limits admits everything (and still counts it).
        """
        limit = self._limits.get(scope)
        if limit is None:
            self.set_limit(scope, ScopeLimit(1 << 62, 1 << 62))
            limit = self._limits[scope]
        per_peer = self._open[scope]
        refusal: Refusal | None = None
        if per_peer.get(peer, 0) >= limit.per_peer:
            refusal = Refusal.PEER_LIMIT
        elif self._total[scope] >= limit.total:
            refusal = Refusal.GLOBAL_LIMIT
        if refusal is not None:
            counts = self._refused[scope]
            counts[refusal.value] = counts.get(refusal.value, 0) + 1
            return refusal
        per_peer[peer] = per_peer.get(peer, 0) + 1
        self._total[scope] += 1
        self._admitted[scope] += 1
        return Ticket(scope, peer)

    def release(self, ticket: Ticket) -> None:
        """Give back an admitted stream (exactly once per ticket)."""
        per_peer = self._open[ticket.scope]
        left = per_peer[ticket.peer] - 1
        if left:
            per_peer[ticket.peer] = left
        else:
            del per_peer[ticket.peer]
        self._total[ticket.scope] -= 1

    def open_streams(self, scope: str, peer: str | None = None) -> int:
        """Streams open now in ``scope`` (of ``peer`` only, if given)."""
        if peer is None:
            return self._total.get(scope, 0)
        return self._open.get(scope, {}).get(peer, 0)

    def statistics(self) -> dict[str, ScopeStats]:
        """Counters per scope."""
        return {
            s: ScopeStats(self._total[s], self._admitted[s], dict(self._refused[s]))
            for s in self._limits
        }


@dataclass(frozen=True)
class LedgerConfig:
    """How misbehaviour scores fall, recover and ban.

    Attributes:
        ban_score: a peer whose score is at or below this (scores start at 0) is banned.
        recovery_per_s: score regained per second, up to 0.
        ban_s: how long a ban lasts, seconds.
        max_peers: bound on remembered peers.
        penalties: score lost per offence.
        never_ban: PeerIDs whose offences are counted and logged but never lower a score or
            ban (a node's pinned trainer: it is trusted with everything already, and a peer
            that banned it, for asking again after the peer restarted, say, left the run).
    """

    ban_score: float = -100.0
    recovery_per_s: float = 1.0
    ban_s: float = 600.0
    max_peers: int = 4096
    penalties: dict[Offence, float] = field(default_factory=lambda: dict(DEFAULT_PENALTIES))
    never_ban: frozenset[str] = frozenset()

    def __post_init__(self) -> None:
        if not self.ban_score < 0 or self.recovery_per_s < 0 or self.ban_s < 0:
            raise ConfigError("ledger", "need ban_score < 0, recovery_per_s >= 0, ban_s >= 0")
        if self.max_peers < 1:
            raise ConfigError("ledger.max_peers", "must be >= 1")


@dataclass
class _Entry:
    score: float
    at: float
    banned_until: float


@dataclass(frozen=True)
class LedgerStats:
    """Offences counted by kind, and the peers banned now."""

    offences: dict[str, int]
    banned: tuple[str, ...]


@dataclass(frozen=True)
class BoundaryStats:
    """Inbound streams per scope (``"*"`` or a protocol id) and misbehaviour of peers."""

    streams: dict[str, ScopeStats]
    peers: LedgerStats


class PeerLedger:
    """Misbehaviour scores and bans of remote peers (see module docstring)."""

    def __init__(self, config: LedgerConfig | None = None) -> None:
        self.config = config or LedgerConfig()
        self._peers: OrderedDict[str, _Entry] = OrderedDict()
        self._offences: dict[str, int] = {}

    def _entry(self, peer: str, now: float) -> _Entry:
        e = self._peers.get(peer)
        if e is None:
            e = _Entry(0.0, now, float("-inf"))
            self._peers[peer] = e
            while len(self._peers) > self.config.max_peers:
                self._peers.popitem(last=False)
        else:
            self._peers.move_to_end(peer)
            e.score = min(0.0, e.score + (now - e.at) * self.config.recovery_per_s)
            e.at = max(e.at, now)
        return e

    def offend(self, peer: str, offence: Offence, now: float) -> bool:
        """Record ``offence`` by ``peer``; returns True if this offence starts a ban."""
        self._offences[offence.value] = self._offences.get(offence.value, 0) + 1
        if peer in self.config.never_ban:
            return False
        e = self._entry(peer, now)
        e.score -= self.config.penalties.get(offence, 0.0)
        if e.score <= self.config.ban_score and e.banned_until <= now:
            e.banned_until = now + self.config.ban_s
            e.score = 0.0  # a fresh start once the ban is over
            return True
        return False

    def score(self, peer: str, now: float) -> float:
        """Current score of ``peer`` (0 for an unknown peer)."""
        e = self._peers.get(peer)
        if e is None:
            return 0.0
        return min(0.0, e.score + max(0.0, now - e.at) * self.config.recovery_per_s)

    def is_banned(self, peer: str, now: float) -> bool:
        """True while ``peer`` is banned."""
        e = self._peers.get(peer)
        return e is not None and now < e.banned_until

    def statistics(self, now: float) -> LedgerStats:
        """Offence counters and the peers banned at ``now``."""
        banned = tuple(p for p, e in self._peers.items() if now < e.banned_until)
        return LedgerStats(dict(self._offences), banned)
